"""Graph passes: CSE merges duplicate pure ops (and collectives), never random ops."""

import functools
import itertools

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from sharded.passes import cse, dce


def _count(gm, name):
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and name in str(n.target))


def test_cse_merges_duplicates_but_not_random_ops():
    def f(x):
        a = torch.sin(x) + torch.sin(x)
        r = torch.rand_like(x) + torch.rand_like(x)
        return a, r

    gm = make_fx(f)(torch.ones(3))
    assert _count(gm, "sin") == 2 and _count(gm, "rand_like") == 2
    gm = cse(gm)
    gm.recompile()
    assert _count(gm, "sin") == 1 and _count(gm, "rand_like") == 2
    torch.testing.assert_close(gm(torch.ones(3))[0], 2 * torch.sin(torch.ones(3)))


def test_dce_drops_dead_detach_():
    def f(x):
        y = torch.cos(x)
        torch.ops.aten.detach_.default(torch.ones(2))   # dead, metadata-only
        return x + 1

    gm = dce(make_fx(f)(torch.ones(3)))
    gm.recompile()
    assert _count(gm, "cos") == 0 and _count(gm, "detach_") == 0


def test_identity_views_are_dropped_except_an_inputs_into_outputs():
    from sharded.passes import remove_identity_views

    def f(x):
        y = torch.sin(x.view(2, 3))          # identity view: dropped
        # into an output: dropped (the output is ``y``), a reshaping view kept, and an
        # input's identity view kept (no output is an input itself)
        return y.view(2, 3), y.view(3, 2), x.view(2, 3)

    gm = make_fx(f, tracing_mode="fake")(torch.ones(2, 3))
    assert _count(gm, "view") == 4
    gm = remove_identity_views(gm)
    gm.recompile()
    assert _count(gm, "view") == 2
    outs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    assert outs[0].target is torch.ops.aten.sin.default
    assert outs[2].target is torch.ops.aten.view.default and outs[2].args[0].op == "placeholder"
    x = torch.randn(2, 3)
    a, b, c = gm(x)
    torch.testing.assert_close(a, torch.sin(x))
    torch.testing.assert_close(b, torch.sin(x).view(3, 2))
    assert c is not x and c.data_ptr() == x.data_ptr()


def _adam_like(p, m, g):
    m = torch._foreach_add(torch._foreach_mul(m, 0.9), torch._foreach_mul(g, 0.1))
    d = torch._foreach_add(torch._foreach_sqrt(torch._foreach_mul(g, g)), 1e-8)
    return torch._foreach_sub(p, torch._foreach_div(m, d)), m


def test_reinplace_foreach_writes_only_into_dead_intermediates():
    from sharded.passes import memory, reinplace_foreach

    args = ([torch.randn(4), torch.randn(3, 2)], [torch.randn(4), torch.randn(3, 2)],
            [torch.randn(4), torch.randn(3, 2)])
    gm = make_fx(_adam_like, tracing_mode="fake")(*args)
    gm = reinplace_foreach(gm)
    gm.recompile()
    inplace = [n for n in gm.graph.nodes if n.op == "call_function"
               and getattr(n.target, "overloadpacket", None) is not None
               and n.target.overloadpacket.__name__.endswith("_")]
    # m*0.9 + ...: into m*0.9; sqrt(g*g) + eps: into sqrt; p - m/d: into m/d is not
    # possible (m is an output), so the division stays functional
    assert len(inplace) >= 3, gm.code
    copies = [[t.clone() for t in a] for a in args]
    torch.testing.assert_close(gm(*args), _adam_like(*copies))
    torch.testing.assert_close(args, copies)         # inputs untouched


def test_reinplacing_lowers_the_peak():
    from sharded.passes import memory, reinplace_foreach

    def chain(xs):
        return torch._foreach_mul(torch._foreach_add(torch._foreach_mul(xs, 2.0), 1.0), 3.0)

    xs = [torch.randn(10)]
    gm = make_fx(chain, tracing_mode="fake")(xs)
    assert memory(gm)["peak_bytes"] == 3 * 40        # the input and two live intermediates
    gm = reinplace_foreach(gm)
    gm.recompile()
    assert memory(gm)["peak_bytes"] == 2 * 40        # one buffer, reused
    torch.testing.assert_close(gm(xs), chain(xs))


def test_memory_estimate_counts_inputs_and_intermediates():
    from sharded.passes import memory

    def f(x):
        y = x * 2            # 400 bytes, freed after z
        z = y.view(-1) + 1   # 400 bytes, the output
        return z

    m = memory(make_fx(f, tracing_mode="fake")(torch.randn(10, 10)))
    assert m["input_bytes"] == 400 and m["output_bytes"] == 400
    assert m["peak_bytes"] == 1200 and m["peak_node"] == "add"


def test_hoisted_reductions_stay_after_their_inputs():
    """The backward program of a GPT loss under DataParallelMode (pjit under autograd):
    hoist_reductions moves every gradient all-reduce back to where its gradient is
    produced; many move behind one node, and the graph must stay in topological order
    (fractional positions once placed one before its own input: "Argument
    'slice_backward' ... was used before it has been defined"). Lowered on an
    abstract mesh of 2, in this process."""
    import math

    import optree

    from examples import gpt
    from sharded import Mesh, P
    from sharded.modes import DataParallelMode
    from transforms import pjit

    mesh = Mesh.abstract((2,), ("dp",))
    cfg = gpt.GPTConfig(vocab=64, d_model=32, n_heads=2, n_layers=2, seq=8, sdpa=True)
    params = optree.tree_map(lambda t: t.to("meta").requires_grad_(), gpt.init_params(cfg, 0))
    ids, tgt = gpt.batch(cfg, 4, seed=1)
    loss = pjit(lambda p, x, y: gpt.loss_fn(p, x, y, cfg), in_specs=(P(), P("dp"), P("dp")),
                out_specs=P(), mesh=mesh, mode=DataParallelMode("replicate"))
    low = loss.lower(params, ids.to("meta"), tgt.to("meta"))
    low.backward.local_graph.graph.lint()
    # every gradient is reduced once (bucketed), none twice
    reduced = sum(math.prod(c.shape) for c in low.backward.collectives() if c.kind == "all_reduce")
    assert reduced == sum(t.numel() for t in optree.tree_leaves(params))


def test_reductions_move_up_with_their_scaling_and_keep_their_order():
    """NOTE [Reductions as soon as their gradient exists], on a graph written out: two
    gradients, b's produced before a's, updated as ``p - 0.1 * g`` in the order a, b.
    Each scaling moves up with its all-reduce to where its gradient exists, a's
    all-reduce stays first (the order is the same on every rank, where positions need
    not be), and nothing reads a result between the two: they merge into one bucket."""
    import torch.fx as fx

    from sharded._torch import WAIT_OP, c10d_functional
    from sharded.passes import bucket_all_reduces, hoist_reductions

    aten = torch.ops.aten
    with torch._subclasses.FakeTensorMode():
        g = fx.Graph()
        pa, pb, x = (g.placeholder(n) for n in ("pa", "pb", "x"))

        def op(target, *args):
            n = g.call_function(target, args)
            n.meta["val"] = torch.empty(8)
            return n
        for n in (pa, pb, x):
            n.meta["val"] = torch.empty(8)
        grad_b = op(aten.mul.Tensor, x, pb)          # b's gradient first (backward order)
        grad_a = op(aten.mul.Tensor, grad_b, pa)
        outs = []
        for p, grad in ((pa, grad_a), (pb, grad_b)):
            scaled = op(aten.mul.Tensor, grad, 0.1)
            reduced = op(WAIT_OP, op(c10d_functional.all_reduce.default, scaled, "sum", "g"))
            outs.append(op(aten.sub.Tensor, p, reduced))
        g.output(tuple(outs))
    gm = hoist_reductions(fx.GraphModule(torch.nn.Module(), g))
    gm.graph.lint()
    names = [n.name for n in gm.graph.nodes]
    ars = [n for n in gm.graph.nodes if n.target is c10d_functional.all_reduce.default]
    assert [a.args[0].args[0] for a in ars] == [grad_a, grad_b], names   # a's, then b's
    assert all(a.prev is a.args[0] for a in ars), names                    # each scaling with it
    assert names.index(ars[-1].name) < min(names.index(n) for n in names if n.startswith("wait")), " ".join(names)
    bucket_all_reduces(gm)
    assert _count(gm, "all_reduce") == 1, gm.graph


# -- units, buckets and reduce-scatters in flight (NOTE [Bucketing]) ---------------------------

def test_unit_of_path():
    from sharded.passes import unit_of_path

    assert unit_of_path("args[0]['blocks'][3]['attn']['wq']") == "args[0]['blocks'][3]"
    assert unit_of_path("args[0]['wte']") == "args[0]"
    assert unit_of_path("kwargs['params']['layers'][0]['w']") == "kwargs['params']['layers'][0]"
    assert unit_of_path("args[0][3]") == "args[0][3]"
    assert unit_of_path("args[0].blocks[1].w") == "args[0].blocks[1]"
    assert unit_of_path("args[1]") == "args[1]"
    # a named_parameters() dict: the dotted module path counts
    assert unit_of_path("args[0]['blocks.3.attn.wq']") == "args[0]['blocks.3']"
    assert unit_of_path("args[0]['lm_head.weight']") == "args[0]"
    assert unit_of_path("args[0]['h'][1]['mlp.c_fc.weight']") == "args[0]['h'][1]"
    assert unit_of_path("residual getitem_3") is None and unit_of_path(None) is None


_GPT = dict(vocab=64, d_model=32, n_heads=2, n_layers=2, seq=8, sdpa=True)


def _block_bytes():
    import optree

    from examples import gpt

    block = gpt.init_params(gpt.GPTConfig(**_GPT), 0)["blocks"][0]
    return sum(t.numel() * t.element_size() for t in optree.tree_leaves(block))


def _gpt_shard_step(bucket_bytes):
    """A 2-layer GPT train step under DataParallelMode("shard"), lowered for rank 0 of
    an abstract mesh of 2."""
    from examples import gpt
    from sharded import Mesh, P, optim
    from sharded.modes import DataParallelMode
    from transforms import pjit

    cfg = gpt.GPTConfig(**_GPT)
    params = gpt.init_params(cfg, 0)
    ids, tgt = gpt.batch(cfg, 4, seed=1)
    step = pjit(lambda p, o, x, y: gpt.train_step(p, o, x, y, cfg),
                in_specs=(P(), P(), P("dp"), P("dp")), mesh=Mesh.abstract((2,), ("dp",)),
                mode=DataParallelMode("shard", bucket_bytes=bucket_bytes))
    return step.lower(params, optim.adamw_init(params), ids, tgt), params


def _gather_buckets(gm):
    """Each all-gather's members, as the parameters (placeholders) they gather."""
    from sharded._torch import c10d_functional
    from sharded.passes.bucketing import _source

    out = []
    for n in gm.graph.nodes:
        if n.target is c10d_functional.all_gather_into_tensor.default:
            operand = n.args[0]
            parts = operand.args[0] if operand.target is torch.ops.aten.cat.default else [operand]
            out.append([_source(p) for p in parts])
    return out


def _max_gathered_alive(gm) -> int:
    """The most gathered buckets alive at once: each from its wait to the last use of
    anything viewed out of it (the members are views of one buffer)."""
    from sharded._torch import WAIT_OP, c10d_functional

    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    aliases = {torch.ops.aten.view.default, torch.ops.aten.reshape.default,
               torch.ops.aten.split_with_sizes.default, torch.ops.aten.permute.default,
               torch.ops.aten.t.default, torch.ops.aten.slice.Tensor}

    def last_use(n):
        end = pos[n]
        for u in n.users:
            view = u.target in aliases or getattr(u.target, "__name__", "") == "getitem"
            end = max(end, last_use(u) if view else pos[u])
        return end

    spans = [(pos[w], last_use(w)) for n in nodes
             if n.target is c10d_functional.all_gather_into_tensor.default
             for w in n.users if w.target is WAIT_OP]
    return max(sum(a <= i <= b for a, b in spans) for i in range(len(nodes)))


def test_gather_buckets_follow_units():
    """A block's gathers share one bucket, never another block's (a bucket holds one
    block and 1 KiB more, so a block's run fits and two do not), and its forward
    gather and backward regather are two
    collectives: each block is gathered exactly twice. No bucket gathers a parameter
    twice. At most two gathered buckets are alive at once (this block's and the
    prefetched next): a weight that the forward and the backward both read as is (a
    layer norm's; CSE merged its two gathers) is gathered again for the backward,
    where once it kept the forward's whole bucket alive across the step. With the
    default 8 MiB the forward's gathers and the backward's regathers still stay apart
    (once, one bucket held every gather of the step)."""
    from sharded.passes import unit_of_path

    low, _ = _gpt_shard_step(_block_bytes() + 1024)
    buckets = _gather_buckets(low.local_graph)
    per_block = {0: 0, 1: 0}
    for members in buckets:
        assert all(m is not None for m in members) and len(set(members)) == len(members)
        units = {unit_of_path(m.meta["sharded_path"]) for m in members}
        assert len(units) == 1, units
        for b in per_block:
            per_block[b] += units == {f"args[0]['blocks'][{b}]"}
    assert per_block == {0: 2, 1: 2}

    assert _max_gathered_alive(low.local_graph) <= 2     # prefetch=1: this one and the next

    low, _ = _gpt_shard_step(8 * 2**20)
    buckets = _gather_buckets(low.local_graph)
    assert len(buckets) >= 2
    for members in buckets:
        assert len(set(members)) == len(members)


def _tanh_blocks_step(params, x):
    def loss(p):
        h = x
        for b in p["blocks"]:
            h = torch.tanh(h @ b["w"]) * b["s"]
        return h.sum()

    g = torch.func.grad(loss)(params)
    return torch.utils._pytree.tree_map(lambda a, b: a - 0.1 * b, params, g)


def test_every_parameter_is_gathered_again_for_the_backward_whatever_its_size():
    """regather_distant_uses sees a gathered parameter's readers whatever its size:
    DTensor's gather ended in an identity slice on a dim of more than 256 (Python's
    small-int cache), a reader of the gathered value, so a scale of 512 was gathered
    once and kept alive from the forward to the backward, where one of 64 was gathered
    again (NOTE [One collective for a move on one axis] in sharded/_torch.py;
    ``remove_identity_views`` drops the slices DTensor makes inside an op). Three blocks
    ``tanh(h @ w) * s`` in DataParallelMode("shard"), one parameter per bucket: the
    same gathers at 64 and at 512, and each block's scale gathered in the forward and
    again in the backward but the last block's (its backward follows at once)."""
    from sharded import Mesh, P
    from sharded.modes import DataParallelMode
    from transforms import pjit

    def gathers(rows, mesh=Mesh.abstract((2,), ("dp",)), specs=P()):
        params = {"blocks": [{"w": torch.randn(rows, rows), "s": torch.randn(rows)} for _ in range(3)]}
        low = pjit(lambda p, x: _tanh_blocks_step(p, x), in_specs=(specs, P("dp")), mesh=mesh,
                   mode=DataParallelMode("shard", bucket_bytes=1)).lower(params, torch.randn(4, rows))
        count: dict = {}
        for members in _gather_buckets(low.local_graph):
            for m in members:
                path = m.meta["sharded_path"].removeprefix("args[0]['blocks']") if m is not None else None
                count[path] = count.get(path, 0) + 1
        return count

    small = gathers(64)
    assert small == gathers(512)
    assert [small[f"[{b}]['s']"] for b in range(3)] == [2, 2, 1]
    # 2x2, the weights column-parallel: the slice was one of the scale's readers, from
    # a gather DTensor makes inside the op that reads it (removed as an identity view)
    mesh = Mesh.abstract((2, 2), ("dp", "tp"))
    specs = {"blocks": [{"w": P(None, "tp"), "s": P()} for _ in range(3)]}
    small = gathers(64, mesh, specs)
    assert small == gathers(512, mesh, specs)
    assert small["[0]['s']"] == 3


def test_reduce_scatters_in_flight_are_bounded():
    """bound_reduce_scatters under DataParallelMode("shard"): each reduce-scatter is
    waited for before the next one is issued (a reduce-scatter's input, full-size
    gradients, lives until its wait), and every gradient is still reduced once."""
    import math

    import optree

    from sharded._torch import WAIT_OP, c10d_functional

    low, params = _gpt_shard_step(4 * 1024)
    nodes = list(low.local_graph.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    rs = [n for n in nodes if n.target is c10d_functional.reduce_scatter_tensor.default]
    assert len(rs) >= 4
    for earlier, later in zip(rs, rs[1:]):
        wait = next(u for u in earlier.users if u.target is WAIT_OP)
        assert pos[wait] < pos[later]
    # (every dim 0 divides by 2: every gradient is reduce-scattered)
    scattered = sum(math.prod(c.shape) for c in low.collectives() if c.kind == "reduce_scatter")
    assert scattered == sum(t.numel() for t in optree.tree_leaves(params))


def test_memory_estimate_holds_a_collective_input_until_its_wait():
    """A reduce-scatter's work holds its input until the wait: the estimate counts the
    input alive until then, not freed at the collective."""
    import torch.fx as fx

    from sharded._torch import WAIT_OP, c10d_functional
    from sharded.passes import memory

    with torch._subclasses.FakeTensorMode():
        x, big, out = torch.empty(256), torch.empty(1024), torch.empty(128)
        g = fx.Graph()
        a = g.placeholder("a")
        a.meta["val"] = x
        grads = g.call_function(torch.ops.aten.mul.Tensor, (a, 2))
        grads.meta["val"] = torch.empty(256)
        rs = g.call_function(c10d_functional.reduce_scatter_tensor.default, (grads, "sum", 2, "g"))
        rs.meta["val"] = out
        other = g.call_function(torch.ops.aten.mul.Tensor, (a, 3))   # while rs is in flight
        other.meta["val"] = big
        wait = g.call_function(WAIT_OP, (rs,))
        wait.meta["val"] = out
        res = g.call_function(torch.ops.aten.add.Tensor, (wait, other))
        res.meta["val"] = torch.empty(1024)
        g.output((res,))
    m = memory(fx.GraphModule(torch.nn.Module(), g))
    # input 1 KiB + grads 1 KiB (held) + rs out 0.5 KiB + other 4 KiB, at "other"
    assert m["peak_bytes"] >= 1024 + 1024 + 512 + 4096, m


# -- reads of shapes, counts of targets, all-reduces in place ----------------------------------

def test_like_factories_no_longer_read_their_input():
    """``ones_like(x)`` reads only x's shape: it becomes ``full``, so a backward's seed
    no longer waits for the loss's all-reduce (untie_shape_reads)."""
    from sharded.passes import untie_shape_reads

    def f(x):
        y = torch.exp(x)
        return torch.ones_like(y), torch.zeros_like(y, dtype=torch.float64), torch.full_like(y, 3.0), \
            torch.ones_like(y.t(), memory_format=torch.preserve_format)

    gm = make_fx(f, tracing_mode="fake")(torch.ones(2, 3))
    gm = dce(untie_shape_reads(gm))
    gm.recompile()
    # the non-contiguous y.t() keeps its ones_like (preserve_format keeps strides)
    assert _count(gm, "ones_like") == 1 and _count(gm, "zeros_like") == 0 and _count(gm, "full_like") == 0
    a, b, c, d = gm(torch.randn(2, 3))
    torch.testing.assert_close(a, torch.ones(2, 3))
    torch.testing.assert_close(b, torch.zeros(2, 3, dtype=torch.float64))
    torch.testing.assert_close(c, torch.full((2, 3), 3.0))
    assert d.shape == (3, 2) and d.stride() == (1, 3)


def _all_reduce_graph(read_after: bool, input_too: bool):
    """x = a * 2; r = all_reduce(x); [read x after the all-reduce]; out = wait(r) + 1."""
    import torch.fx as fx

    from sharded._torch import WAIT_OP, c10d_functional

    with torch._subclasses.FakeTensorMode():
        g = fx.Graph()
        a = g.placeholder("a")
        a.meta["val"] = torch.empty(8)
        x = a if input_too else g.call_function(torch.ops.aten.mul.Tensor, (a, 2))
        x.meta["val"] = x.meta.get("val", torch.empty(8))
        r = g.call_function(c10d_functional.all_reduce.default, (x, "sum", "g"))
        r.meta["val"] = torch.empty(8)
        later = g.call_function(torch.ops.aten.mul.Tensor, (x, 3)) if read_after else None
        if later is not None:
            later.meta["val"] = torch.empty(8)
        w = g.call_function(WAIT_OP, (r,))
        w.meta["val"] = r.meta["val"]
        out = g.call_function(torch.ops.aten.add.Tensor, (w, 1))
        out.meta["val"] = torch.empty(8)
        g.output((out,) + ((later,) if later is not None else ()))
    return fx.GraphModule(torch.nn.Module(), g)


def test_all_reduces_run_in_place_only_on_dead_intermediates():
    """NOTE [All-reduces in place]: the functional all-reduce's copy is dropped where
    nothing else reads its input; an input of the program, or a value read after the
    all-reduce, keeps the copy. The in-place result is its input's storage (what
    memory() and the alias analysis of later passes see)."""
    from sharded._torch import c10d_functional
    from sharded.passes import reinplace_foreach

    def kinds(gm):
        return [n.target for n in gm.graph.nodes
                if n.target in (c10d_functional.all_reduce.default, c10d_functional.all_reduce_.default)]

    from sharded._torch import WAIT_OP, storage_key

    dead = reinplace_foreach(_all_reduce_graph(read_after=False, input_too=False))
    assert kinds(dead) == [c10d_functional.all_reduce_.default]
    x = next(n for n in dead.graph.nodes if n.target is torch.ops.aten.mul.Tensor)
    wait = next(n for n in dead.graph.nodes if n.target is WAIT_OP)
    assert storage_key(wait.meta["val"]) == storage_key(x.meta["val"])
    dead.recompile()
    assert "all_reduce_" in dead.code
    for read_after, input_too in ((True, False), (False, True)):
        gm = reinplace_foreach(_all_reduce_graph(read_after, input_too))
        assert kinds(gm) == [c10d_functional.all_reduce.default], (read_after, input_too)


def test_data_parallel_step_schedule():
    """A GPT train step under DataParallelMode("replicate"), lowered on an abstract mesh
    of 2: the count of the loss's targets is all-reduced inside the forward, with
    matmuls before it (they overlap the call's agreement, checked just before it) and
    after it (they overlap the count's own all-reduce; count_targets_early), the
    gradient bucket is reduced in place, and no wait sits between the forward and the
    backward other than the count's, which the backward's first op needs."""
    import optree

    from examples import gpt
    from sharded import Mesh, P, optim
    from sharded._torch import WAIT_OP, c10d_functional
    from sharded.modes import DataParallelMode
    from transforms import pjit

    cfg = gpt.GPTConfig(vocab=64, d_model=32, n_heads=2, n_layers=2, seq=8, sdpa=True)
    params = optree.tree_map(lambda t: t.to("meta"), gpt.init_params(cfg, 0))
    ids, tgt = (t.to("meta") for t in gpt.batch(cfg, 4, seed=1))
    step = pjit(lambda p, o, x, y: gpt.train_step(p, o, x, y, cfg),
                in_specs=(P(), P(), P("dp"), P("dp")), mesh=Mesh.abstract((2,), ("dp",)),
                mode=DataParallelMode("replicate"))
    nodes = list(step.lower(params, optim.adamw_init(params), ids, tgt).local_graph.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    from sharded import sync

    mms = [pos[n] for n in nodes if n.target is torch.ops.aten.mm.default]
    first_mm = min(mms)
    reductions = [n for n in nodes if n.target in (c10d_functional.all_reduce.default,
                                                   c10d_functional.all_reduce_.default)]
    count = next(n for n in reductions if "sum" in n.args[0].args[0].name)
    nll = next(n for n in nodes if n.target is torch.ops.aten.nll_loss_forward.default)
    point = next(n for n in nodes if n.target is sync.agreed)
    assert pos[point] < pos[count] == min(pos[n] for n in reductions)
    assert any(m < pos[point] for m in mms) and any(pos[count] < m < pos[nll] for m in mms)
    bucket = [n for n in reductions if n.args[0].target is torch.ops.aten.cat.default]
    assert len(bucket) == 1 and bucket[0].target is c10d_functional.all_reduce_.default
    nll_bwd = next(n for n in nodes if n.target is torch.ops.aten.nll_loss_backward.default)
    waits = [n for n in nodes if n.target is WAIT_OP and first_mm < pos[n] < pos[nll_bwd]]
    assert [w.args[0] for w in waits] == [count], waits


def test_large_gradients_are_reduce_scattered_without_a_copy():
    """NOTE [Bucketing]: under "shard", a gradient larger than PACK_BYTES (a 4 MiB
    weight) is reduce-scattered as it is, not copied into a bucket (which kept it and
    its copy alive at once); the biases still share buckets. Lowered on an abstract
    mesh of 2 with meta tensors."""
    import math

    import optree

    from benchmarks import _models as M
    from sharded import Mesh, P, optim
    from sharded.modes import DataParallelMode
    from sharded.passes.bucketing import PACK_BYTES
    from transforms import pjit

    params = optree.tree_map(lambda t: t.to("meta"), M.mlp_init(1024, 3))
    x = torch.empty(8, 1024, device="meta")
    step = pjit(M.mlp_train_step, in_specs=(P(), P(), P("dp"), P("dp")),
                mesh=Mesh.abstract((2,), ("dp",)), mode=DataParallelMode("shard"))
    low = step.lower(params, optim.adamw_init(params), x, x)
    nodes = {n.name: n for n in low.local_graph.graph.nodes}
    scatters = [c for c in low.collectives() if c.kind == "reduce_scatter"]
    big = [c for c in scatters if c.bytes > PACK_BYTES]
    assert len(big) == 3, scatters
    assert all(nodes[c.node].args[0].target is not torch.ops.aten.cat.default for c in big)
    assert sum(math.prod(c.shape) for c in scatters) == sum(t.numel() for t in optree.tree_leaves(params))
    assert len(scatters) < 3 + 3, scatters     # the biases share at least one bucket


def test_dtensor_cuda_all_to_all_is_a_collective():
    """DTensor's Shard(i) -> Shard(j) on CUDA meshes records
    ``_dtensor::shard_dim_alltoall`` (gloo takes an all-gather instead, so the CPU runs
    never show it): it is a collective for the fingerprint and ``collectives()``."""
    import torch.fx as fx

    from sharded import Mesh
    from sharded.passes import collectives

    mesh = Mesh.abstract((2,), ("dp",))
    group = mesh.device_mesh.get_group(0).group_name
    with torch._subclasses.FakeTensorMode():
        g = fx.Graph()
        a = g.placeholder("a")
        a.meta["val"] = torch.empty(4, 8)
        t = g.call_function(torch.ops._dtensor.shard_dim_alltoall.default, (a, 0, 1, group))
        t.meta["val"] = torch.empty(8, 4)
        g.output((t,))
    calls = collectives(fx.GraphModule(torch.nn.Module(), g), mesh)
    assert [(c.kind, c.shape, c.axis, c.group_size) for c in calls] == [("all_to_all", (4, 8), "dp", 2)]


def test_gradient_buckets_do_not_depend_on_the_optimizer():
    """Issue 23: a GPT step over a ``named_parameters()``-style dict (dotted keys),
    lowered on an abstract mesh of 2. With a per-parameter AdamW, DataParallelMode
    ("replicate") reduced every layer norm gradient (an element of
    native_layer_norm_backward's result) where the optimizer read it, once per reader,
    and those reductions split the buckets: 39 all-reduces a step on the benchmark's
    GPT where sharded.optim.adamw and DTensorExpandMode had 3. Every gradient is
    reduced once, where it is produced, and both optimizers give the same buckets:
    all-reduces ("replicate", as DTensorExpandMode with replicated specs) and
    reduce-scatters ("shard"). Plain SGD as a JAX user writes it, ``p - lr * g`` per
    parameter, reduced each gradient after its scaling, just before its update, in the
    optimizer's order: 25 all-reduces (24 reduce-scatters under "shard") where ``p - g``
    had 2 (NOTE [Reductions as soon as their gradient exists])."""
    import math

    import optree

    from benchmarks._models import per_tensor_adamw
    from examples import gpt
    from sharded import Mesh, P, optim
    from sharded.modes import DataParallelMode, DTensorExpandMode
    from transforms import pjit

    cfg = gpt.GPTConfig(vocab=64, d_model=32, n_heads=2, n_layers=2, seq=8, sdpa=True)
    tree = gpt.init_params(cfg, 0)
    paths, leaves, treedef = optree.tree_flatten_with_path(tree)
    keys = [".".join(str(k) for k in path) for path in paths]
    params = {k: t.to("meta") for k, t in zip(keys, leaves)}
    ids, tgt = (t.to("meta") for t in gpt.batch(cfg, 4, seed=1))

    def loss(p, x, y):
        return gpt.loss_fn(optree.tree_unflatten(treedef, [p[k] for k in keys]), x, y, cfg)

    def step_with(update):
        def step(p, o, x, y):
            grads, value = torch.func.grad_and_value(loss)(p, x, y)
            return (*update(p, grads, o), value)
        return step

    def sgd(p, g, o):                 # as with jax.tree.map: scaled, then subtracted
        return {k: v - 0.1 * g[k] for k, v in p.items()}, o

    def sgd_unscaled(p, g, o):
        return {k: v - g[k] for k, v in p.items()}, o

    optimizers = {"per_tensor": per_tensor_adamw, "optim.adamw": optim.adamw, "sgd": sgd,
                  "sgd_unscaled": sgd_unscaled, "optim.sgd": functools.partial(optim.sgd, lr=0.1)}
    modes = {"replicate": DataParallelMode("replicate"), "shard": DataParallelMode("shard"),
             "expand": DTensorExpandMode()}
    counts, reduced, peaks = {}, {}, {}
    for (mname, mode), (oname, update) in itertools.product(modes.items(), optimizers.items()):
        low = pjit(step_with(update), in_specs=(P(), P(), P("dp"), P("dp")),
                   mesh=Mesh.abstract((2,), ("dp",)), mode=mode).lower(
                       params, optim.adamw_init(params), ids, tgt)
        cost = low.cost()
        counts[mname, oname] = tuple(cost.get(k, {}).get("count", 0)
                                     for k in ("all_reduce", "reduce_scatter"))
        reduced[mname, oname] = sum(math.prod(c.shape) for c in low.collectives()
                                    if c.kind in ("all_reduce", "reduce_scatter"))
        peaks[mname, oname] = low.memory()["peak_bytes"]
    for mname in modes:
        assert len({counts[mname, oname] for oname in optimizers}) == 1, counts
        # and the scaling costs no memory the plain update does not (the buckets'
        # cost, which the per-parameter reductions did not pay, is the same for both)
        assert peaks[mname, "sgd"] <= peaks[mname, "sgd_unscaled"], peaks
    assert counts["replicate", "optim.adamw"][0] <= 3, counts
    n = sum(t.numel() for t in params.values())
    for oname in optimizers:
        assert counts["replicate", oname] == counts["expand", oname], counts
        # every gradient once, and a few scalars (the loss's count of targets)
        for mname in modes:
            assert n <= reduced[mname, oname] <= n + 4, reduced


def test_pass_lists_are_declared_in_order():
    """NOTE [Pass order]: each mode's passes are one declared list, the shared cleanup
    first and the reinplacing last; a list that puts a pass before one it must follow
    is refused where the mode class is defined."""
    import pytest

    from sharded.modes import DataParallelMode, DTensorExpandMode
    from sharded.modes.base import CLEANUP, check_order

    names = [p.name for p in DataParallelMode.passes]
    assert names[:len(CLEANUP)] == [p.name for p in CLEANUP] == [
        "remove_trivial_collectives", "remove_identity_views", "untie_shape_reads", "dce", "cse"]
    assert [p.name for p in DTensorExpandMode.passes] == [
        *names[:len(CLEANUP)], "count_targets_early", "hoist_reductions",
        "sink_casts_of_reductions", "defer_chained_reductions", "bucket_all_reduces", "sink_waits",
        "hoist_chained_reductions", "reinplace_foreach"]
    assert names[-1] == "reinplace_foreach"
    swapped = list(DataParallelMode.passes)
    i, j = names.index("count_targets_early"), names.index("hoist_reductions")
    swapped[i], swapped[j] = swapped[j], swapped[i]
    with pytest.raises(ValueError, match="'hoist_reductions' must come after.*count_targets_early"):
        check_order(swapped, "test")
    with pytest.raises(ValueError, match="must come after"):
        type("Reversed", (DTensorExpandMode,), {"passes": tuple(reversed(DTensorExpandMode.passes))})


def test_a_mode_that_overrides_transform_and_compile_still_gets_finalized():
    """sharded/lowering.py runs a mode's declared pass list with one code generation
    at the end; a custom mode that overrides ``transform_and_compile`` (as
    docs/concepts.md shows) is called instead, and its program is still finalized:
    outputs unaliased and the agreement point in place, with code that matches its
    graph."""
    from sharded import Mesh, P, sync
    from sharded.modes import DTensorExpandMode
    from transforms import pjit

    calls = []

    class Logged(DTensorExpandMode):
        def transform_and_compile(self, graph, mesh):
            calls.append(len(graph.graph.nodes))
            return super().transform_and_compile(graph, mesh)

    def f(x):
        y = x * 2
        return y, y                                   # two outputs of one value
    mesh = Mesh.abstract((2,), ("dp",))
    for mode in (Logged(), DTensorExpandMode()):
        low = pjit(f, in_specs=P("dp"), mesh=mesh, mode=mode).lower(torch.ones(4, 2))
        gm = low.local_graph
        assert any(n.target is sync.agreed for n in gm.graph.nodes)
        assert "agreed" in gm.code and "clone" in gm.code     # the code is the graph's
        out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        assert out[0] is not out[1]                             # unaliased
    assert len(calls) == 1


def test_a_global_norm_summed_from_zero_costs_one_reduction():
    """NOTE [Adding zero] (sharded/rewrites/algebra.py): a clipped step's global norm
    written with Python's ``sum()`` (which starts from 0), under DataParallelMode
    ("shard"), reduced each parameter's sum of squares on its own: 25 all-reduces a
    step for a 24-tensor GPT, where ``sharded.optim.clip_by_global_norm`` pays one.
    The two now lower to the same collectives."""
    import optree

    from examples import gpt
    from sharded import Mesh, P, optim
    from sharded.modes import DataParallelMode
    from transforms import pjit

    cfg = gpt.GPTConfig(vocab=64, d_model=32, n_heads=2, n_layers=2, seq=8, sdpa=True)
    params = optree.tree_map(lambda t: t.to("meta"), gpt.init_params(cfg, 0))
    ids, tgt = (t.to("meta") for t in gpt.batch(cfg, 4, seed=1))

    def by_hand(grads):
        leaves = optree.tree_leaves(grads)
        norm = torch.sqrt(sum((g ** 2).sum() for g in leaves))
        coef = torch.clamp(1.0 / (norm + 1e-6), max=1.0)
        return optree.tree_map(lambda g: g * coef, grads)

    def with_optim(grads):
        return optim.clip_by_global_norm(grads, 1.0)[0]

    counts = {}
    for name, clip in (("by_hand", by_hand), ("optim", with_optim)):
        def step(p, x, y, clip=clip):
            g, loss = torch.func.grad_and_value(gpt.loss_fn)(p, x, y, cfg)
            return optree.tree_map(lambda a, b: a - 0.1 * b, p, clip(g)), loss
        low = pjit(step, in_specs=(P(), P("dp"), P("dp")), mesh=Mesh.abstract((2,), ("dp",)),
                   mode=DataParallelMode("shard")).lower(params, ids, tgt)
        counts[name] = {k: v["count"] for k, v in low.cost().items() if k != "total"}
    assert counts["by_hand"] == counts["optim"], counts
    assert counts["optim"]["all_reduce"] <= 3 and counts["optim"]["reduce_scatter"] == 1, counts


def test_adding_zero_is_dropped_only_where_the_sum_is_the_value_itself():
    """drop_zero_additions: ``x + 0`` and ``x - 0`` read ``x``; not where the sum is a
    new tensor of another dtype, shape or layout, nor where ``x`` is an input."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from sharded.rewrites.algebra import drop_zero_additions

    def f(a, b):
        s = a.sum() * 2
        t = 0 + s                           # dropped
        u = (a * 3) - 0                     # dropped
        v = a + 0                           # an input: kept
        vt = a.t() + 0                      # a view of an input: kept (found by review)
        nan = torch.add(a * 3, 0, alpha=float("inf"))   # inf * 0 is nan: kept
        w = b.expand(4, 3) + 0              # a dense sum of an expanded view: kept
        i = (a > 0).sum() + 0.0             # int64 + 0.0 is float: kept
        return t, u, v, vt, nan, w, i

    args = (torch.randn(4, 3), torch.randn(1, 3))
    gm = make_fx(f, tracing_mode="fake")(*args)
    adds = lambda: [n for n in gm.graph.nodes if n.target in (torch.ops.aten.add.Tensor,   # noqa: E731
                                                               torch.ops.aten.sub.Tensor)]
    before = len(adds())
    assert drop_zero_additions(gm) == 2 and len(adds()) == before - 2, gm.graph
    gm.recompile()
    outs = gm(*args)
    for got, want in zip(outs, f(*args)):
        assert got.dtype == want.dtype and got.stride() == want.stride()
        torch.testing.assert_close(got, want, equal_nan=True)
    assert outs[3].untyped_storage().data_ptr() != args[0].untyped_storage().data_ptr()


def test_an_all_reduce_runs_in_place_only_on_a_tensor_its_producer_allocates():
    """Gloo reduces ``numel`` elements from the data pointer (NOTE [All-reduces in
    place]): a bucket's unpacked piece (``reshape(getitem(split(...)))``), valued as a
    tensor of its own as the bucketing pass values it, is a view of the bucket at run
    time and stays functional; a full view of a fresh tensor is reduced in place."""
    import operator

    import torch.fx as fx

    from sharded._torch import WAIT_OP, c10d_functional
    from sharded.passes import reinplace_foreach

    aten = torch.ops.aten

    def reduced(make_x):
        with torch._subclasses.FakeTensorMode():
            g = fx.Graph()
            a = g.placeholder("a")
            a.meta["val"] = torch.empty(16)

            def call(fn, args, val):
                node = g.call_function(fn, args)
                node.meta["val"] = val
                return node

            x = make_x(call, call(aten.mul.Tensor, (a, 2), torch.empty(16)))
            r = call(c10d_functional.all_reduce.default, (x, "sum", "g"), torch.empty(x.meta["val"].shape))
            w = call(WAIT_OP, (r,), r.meta["val"])
            g.output((call(aten.add.Tensor, (w, 1), torch.empty(w.meta["val"].shape)),))
        gm = reinplace_foreach(fx.GraphModule(torch.nn.Module(), g))
        return [n.target for n in gm.graph.nodes if n.target in (
            c10d_functional.all_reduce.default, c10d_functional.all_reduce_.default)]

    def piece(call, buf):
        pieces = call(aten.split_with_sizes.default, (buf, [8, 8]), None)
        return call(aten.reshape.default, (call(operator.getitem, (pieces, 1), None), [8]), torch.empty(8))

    def full_view(call, buf):
        return call(aten.view.default, (buf, [2, 8]), buf.meta["val"].view(2, 8))

    assert reduced(piece) == [c10d_functional.all_reduce.default]
    assert reduced(full_view) == [c10d_functional.all_reduce_.default]


def test_a_foreach_op_is_not_reinplaced_over_another_view_of_what_it_writes():
    """``_foreach_add([a[1:]], [a[:-1]])``: the operands are different nodes over one
    storage; written in place, a[1:] would read elements it already wrote."""
    from sharded.passes import reinplace_foreach

    def f(p):
        a = p * 2
        return torch._foreach_add([a[1:]], [a[:-1]])[0]

    gm = reinplace_foreach(make_fx(f, tracing_mode="fake")(torch.randn(6)))
    gm.recompile()
    assert "_foreach_add_" not in gm.code, gm.code
    x = torch.randn(6)
    torch.testing.assert_close(gm(x), f(x))


def test_a_lowering_generates_its_programs_code_once_and_before_it_runs(monkeypatch):
    """NOTE [Code generated once]: the trace, the loss rewrite's recompile and the
    partition's recording generate no code; the local program's is generated once, by
    ``lower()`` (a lowered program's first call does not pay for it), under the
    declared pass list and under a mode that overrides ``transform_and_compile``
    (which recompiles in it). The global program still shows its code when read."""
    import torch.fx as fx
    from torch.fx._lazy_graph_module import _LazyGraphModule

    from examples import gpt
    from sharded import Mesh, P, optim
    from sharded.modes import DataParallelMode, DTensorExpandMode
    from transforms import pjit

    generated = []
    real = fx.Graph.python_code

    def counted(self, *args, **kwargs):
        generated.append(len(self.nodes))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(fx.Graph, "python_code", counted)

    class Custom(DTensorExpandMode):
        def transform_and_compile(self, graph, mesh):
            graph = super().transform_and_compile(graph, mesh)
            graph.recompile()
            return graph

    cfg = gpt.tiny(n_layers=1, d_model=32, vocab=64, seq=8)
    params = gpt.init_params(cfg)
    state, (ids, tgt) = optim.adamw_init(params), gpt.batch(cfg, 4)
    mesh = Mesh.abstract((2,), ("dp",))
    for mode in (DTensorExpandMode(), DataParallelMode("shard"), Custom()):
        generated.clear()
        low = pjit(lambda *a: gpt.train_step(*a), in_specs=(None, None, P("dp"), P("dp")),
                   mesh=mesh, static_argnums=(4,), mode=mode).lower(params, state, ids, tgt, cfg)
        local = low.local_graph
        assert generated == [len(local.graph.nodes)], (type(mode).__name__, generated)
        assert not (isinstance(local, _LazyGraphModule) and local._needs_recompile())
        assert "_fused_adamw" in local.code and generated == [len(local.graph.nodes)]
        assert "nll_loss" in low.global_graph.code      # generated when read


def test_positions_follow_nodes_as_they_move():
    """NOTE [Positions in a graph]: ``_torch.POSITIONS`` orders nodes as the graph
    does after inserts and moves (the passes compare places with it instead of a table
    rebuilt after each move)."""
    import torch.fx as fx

    from sharded._torch import POSITIONS

    g = fx.Graph()
    x = g.placeholder("x")
    a = g.call_function(torch.neg, (x,))
    b = g.call_function(torch.sin, (a,))
    c = g.call_function(torch.cos, (b,))
    g.output(c)
    with g.inserting_before(b):
        d = g.call_function(torch.exp, (a,))
    a.prepend(g.call_function(torch.tan, (x,)))   # made at the end, moved to the front
    c.prepend(d)            # d moves from before b to just before c
    b.append(g.call_function(torch.abs, (b,)))
    nodes = list(g.nodes)
    assert sorted(nodes, key=POSITIONS.__getitem__) == nodes
    assert POSITIONS[b] < POSITIONS[d] < POSITIONS[c]
