"""The shared expander (sharded/modes/_expand.py), for what DTensor does not do alone:
``cat`` skips legacy empty tensors as torch.cat does (NOTE [cat skips legacy empty
tensors]), a view of a shard laid out otherwise than its global value copies it first
(NOTE [A view of a shard laid out otherwise]), and keyword tensors (SDPA's ``attn_mask``) are laid out as the op's plan
wants (NOTE [Keyword tensors are laid out by the expander]). Local graphs lowered on
abstract meshes in one process; the values on real gloo ranks against one device, in
DTensorExpandMode and both DataParallelMode layouts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sharded import Mesh, P, gather, with_sharding_constraint
from sharded.modes import DataParallelMode
from transforms import pjit

aten = torch.ops.aten


# -- the functions ------------------------------------------------------------------------------

def cat_cache(x):
    """transformers' DynamicCache: a layer's keys start as torch.tensor([]) and grow by
    cat on the sequence dim (-2) of [batch, heads, seq, dim]."""
    keys = torch.tensor([])
    keys = torch.cat([keys, x * 2], dim=-2)
    return torch.cat([keys, x], dim=-2)


def cat_mixed(x):
    """Legacy empty tensors anywhere in the list, and one of a wider dtype: skipped, but
    the result is float64, as torch.cat's."""
    e64 = torch.tensor([], dtype=torch.float64)
    return torch.cat([torch.tensor([]), x, e64, x + 1, torch.tensor([])], dim=1)


def cat_grad(x):
    return torch.func.grad(lambda x: torch.cat([torch.tensor([]), x, x * x], dim=2).sum())(x)


def _qkv_mask(heads_in_mask: int):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(4, 4, 8, 8, generator=g) for _ in range(3))
    mask = torch.randn(4, heads_in_mask, 8, 8, generator=g)
    return q, k, v, mask


def sdpa_masked(q, k, v, mask):
    """SDPA with an additive mask (a keyword input of the CPU flash kernel), forward and
    the gradient of q through the backward kernel."""
    def f(q):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    out, vjp = torch.func.vjp(f, q)
    return out, vjp(torch.ones_like(out))[0]


def heads_merged(a):
    """Attention's output, [B, H, T, D] stored as [B, T, H, D] (a transpose of a
    [B, T, H, D] value), gathered over its heads and merged back: ``transpose(1, 2)``
    of the global value is contiguous, so the trace holds a view; the gathered block
    is stored [B, H, T, D] and its transpose is not."""
    c = with_sharding_constraint(a.transpose(1, 2) * 2, P())
    return c.transpose(1, 2).view(a.shape[0], a.shape[1], -1)


def _randn(*shape):
    """The same values on every rank."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1))


def _node_shapes(lowered, target) -> list:
    out = []
    for n in lowered.local_graph.graph.nodes:
        if n.op == "call_function" and n.target is target:
            out.append([tuple(a.meta["val"].shape) for a in n.all_input_nodes])
    return out


# -- graphs, in one process --------------------------------------------------------------------

def test_cat_skips_legacy_empty_tensors_on_a_split_dim():
    mesh = Mesh.abstract((2,), ("tp",))
    x = torch.randn(2, 4, 3, 8)
    lowered = pjit(cat_cache, in_specs=P(None, "tp"), out_specs=P(None, "tp"), mesh=mesh).lower(x)
    # each cat reads this rank's heads only; nothing is gathered
    assert _node_shapes(lowered, aten.cat.default) == [[(2, 2, 3, 8)], [(2, 2, 3, 8), (2, 2, 3, 8)]]
    assert lowered.collectives() == []
    mixed = pjit(cat_mixed, in_specs=P("tp"), mesh=mesh).lower(torch.randn(4, 3))
    out = [n for n in mixed.global_graph.graph.nodes if n.op == "output"][0].args[0][0]
    assert out.meta["val"].dtype == torch.float64
    assert _node_shapes(mixed, aten.cat.default) == [[(2, 3), (2, 3)]]


def test_sdpa_mask_is_laid_out_like_the_queries():
    """Split batch: the [b, 1, s, s] mask split too; split heads: a mask that broadcasts
    over the heads stays whole, a per-head one is split like the heads."""
    dp = Mesh.abstract((2,), ("dp",))
    q, k, v, mask = _qkv_mask(1)
    fwd, bwd = aten._scaled_dot_product_flash_attention_for_cpu.default, \
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    batch = (P("dp"),) * 3 + (P(),)     # the mask whole, as transformers builds it
    for mode in (None, DataParallelMode("replicate")):
        lowered = pjit(sdpa_masked, in_specs=batch, mesh=dp, mode=mode).lower(q, k, v, mask)
        assert _node_shapes(lowered, fwd) == [[(2, 4, 8, 8)] * 3 + [(2, 1, 8, 8)]]
        assert _node_shapes(lowered, bwd)[0][-1] == (2, 1, 8, 8)
    tp = Mesh.abstract((2,), ("tp",))
    heads = P(None, "tp")
    lowered = pjit(sdpa_masked, in_specs=(heads, heads, heads, P()), mesh=tp).lower(q, k, v, mask)
    assert _node_shapes(lowered, fwd) == [[(4, 2, 8, 8)] * 3 + [(4, 1, 8, 8)]]
    assert lowered.collectives() == []
    q, k, v, mask = _qkv_mask(4)
    lowered = pjit(sdpa_masked, in_specs=(heads, heads, heads, P()), mesh=tp).lower(q, k, v, mask)
    assert _node_shapes(lowered, fwd) == [[(4, 2, 8, 8)] * 4]
    assert lowered.collectives() == []


def test_a_view_of_a_shard_laid_out_otherwise_copies_it_first():
    """NOTE [A view of a shard laid out otherwise] (sharded/modes/_expand.py): the
    lowering raised "Cannot view a tensor with shape [2, 8, 4, 4] and strides (128,
    4, 32, 1)" from torch's view (AUTO's plan for GPT-2-small on 8x8 met it)."""
    mesh = Mesh.abstract((2,), ("tp",))
    lowered = pjit(heads_merged, in_specs=P(None, None, "tp"), mesh=mesh).lower(torch.empty(2, 8, 4, 4))
    # the first view of a value that is no gather's: the gather's own view of its
    # blocks comes before it (NOTE [One collective for a move on one axis] in
    # sharded/_torch.py)
    from sharded._torch import WAIT_OP

    views = [n for n in lowered.local_graph.graph.nodes
             if n.target is aten.view.default and n.args[0].target is not WAIT_OP]
    assert tuple(views[0].args[0].meta["val"].shape) == (2, 8, 4, 4)
    clones = [n for n in lowered.local_graph.graph.nodes if n.target is aten.clone.default]
    assert clones and clones[-1].users and next(iter(clones[-1].users)).target is aten.view.default


# -- the recording is make_fx's (NOTE [Recording the local program] in sharded/_torch.py) ---------

_CAPTURED = torch.linspace(-1.0, 1.0, 8).reshape(2, 4)       # a real tensor the function closes over
_MESH_TP = Mesh.abstract((2,), ("tp",))


def _mixed(x, w, q, k, v):
    """The special ops (a random draw, a sharding constraint, a shard_map region), a
    captured constant, torch.tensor([]) in a cat, SDPA (DTensor runs it on global
    shapes to learn its output's) and a gradient."""
    from sharded import collectives as C, shard_map

    region = shard_map(lambda a: C.psum(a, "tp"), mesh=_MESH_TP, in_specs=P(None, "tp"),
                       out_specs=P())

    def loss(w):
        h = with_sharding_constraint(F.dropout(x @ w, 0.5), P(None, "tp"))
        a = F.scaled_dot_product_attention(q, k, v)
        return (region(h) * _CAPTURED).sum() + cat_cache(a).sum()

    return torch.func.grad_and_value(loss)(w)


def _rank_sum(x, mesh):
    """x + the sum of the ranks' indices along "tp": axis_index is a constant the
    program makes (torch.tensor), which the summing all-reduce must not write into."""
    from sharded import collectives as C, shard_map

    return shard_map(lambda a: a + C.psum(C.axis_index("tp"), "tp"), mesh=mesh, in_specs=P("tp"),
                     out_specs=P("tp"))(x)


def _exchange(x, mesh):
    """An all-to-all in a region (a functional all_to_all_single and its wait)."""
    from sharded import collectives as C, shard_map

    return shard_map(lambda a: C.all_to_all(a * 2, "tp", 1, 0), mesh=mesh, in_specs=P("tp"),
                     out_specs=P(None, "tp"))(x)


def _program(gm) -> list[str]:
    """Each node: its op and name, its arguments (nodes by position), its value's
    shape, strides and dtype; a constant by its value."""
    at = {n: i for i, n in enumerate(gm.graph.nodes)}

    def text(a):
        if isinstance(a, torch.fx.Node):
            return f"%{at[a]}"
        if isinstance(a, (list, tuple)):
            return "[" + ", ".join(text(x) for x in a) + "]"
        if isinstance(a, dict):
            return "{" + ", ".join(f"{k}: {text(v)}" for k, v in a.items()) + "}"
        return repr(a)

    out = []
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        meta = (tuple(val.shape), val.stride(), val.dtype) if isinstance(val, torch.Tensor) else None
        what = getattr(gm, n.target).tolist() if n.op == "get_attr" else n.target
        out.append(f"{n.op} {n.name} {what} {text(n.args)} {text(n.kwargs)} {meta}")
    return out


def test_the_recorded_program_is_make_fxs(monkeypatch):
    """The expansion's recording gives make_fx's program node for node (after the
    passes): the same ops and names, arguments, values and constants, nothing of
    DTensor's shape inference, and ``torch.tensor``'s constant copied before use
    (``axis_index``)."""
    from examples import gpt
    from sharded import _torch, optim, random as srandom
    from sharded.modes import DTensorExpandMode
    from torch.fx.experimental.proxy_tensor import make_fx

    cfg = gpt.tiny(n_layers=2, d_model=32, n_heads=4, vocab=64, seq=8)
    params = gpt.init_params(cfg, 0)
    state, (ids, tgt) = optim.adamw_init(params), gpt.batch(cfg, 4)
    specs = gpt.tp_specs(params)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 8, 8, generator=g) for _ in range(3))
    cases = {
        "gpt, Megatron on 2x2": lambda: pjit(
            lambda *a: gpt.train_step(*a), in_specs=(specs, gpt.opt_specs(specs), P("dp"), P("dp")),
            out_specs=(specs, gpt.opt_specs(specs), P()), mesh=Mesh.abstract((2, 2), ("dp", "tp")),
            static_argnums=(4,), mode=DTensorExpandMode()).lower(params, state, ids, tgt, cfg),
        "gpt, DataParallelMode('shard') on 4": lambda: pjit(
            lambda *a: gpt.train_step(*a), in_specs=(None, None, P("dp"), P("dp")),
            mesh=Mesh.abstract((4,), ("dp",)), static_argnums=(4,),
            mode=DataParallelMode("shard")).lower(params, state, ids, tgt, cfg),
        "special ops, constants, sdpa": lambda: pjit(
            lambda *a: _mixed(*a), in_specs=(P(), P(None, "tp"), P(), P(), P()),
            mesh=_MESH_TP).lower(torch.randn(2, 4), torch.randn(4, 8), q, k, v),
        "axis_index in a region": lambda: pjit(
            lambda x: _rank_sum(x, _MESH_TP), in_specs=P("tp"), mesh=_MESH_TP).lower(torch.randn(4, 2)),
        "all_to_all in a region": lambda: pjit(
            lambda x: _exchange(x, _MESH_TP), in_specs=P("tp"), mesh=_MESH_TP).lower(torch.randn(4, 6)),
    }
    srandom.manual_seed(0)
    recorded = {name: _program(lower().local_graph) for name, lower in cases.items()}
    monkeypatch.setattr(_torch, "record_fake",
                        lambda fn, inputs, fake_mode: make_fx(fn, tracing_mode="fake")(*inputs))
    for name, lower in cases.items():
        assert recorded[name] == _program(lower().local_graph), name
    assert any("_c10d_functional" in line for line in recorded["gpt, Megatron on 2x2"])
    assert any(line.startswith("get_attr") for line in recorded["special ops, constants, sdpa"])
    assert any("lift_fresh_copy" in line for line in recorded["axis_index in a region"])
    # the collectives' meta kernels run directly while recording (NOTE [Recording the
    # local program]): each of them is in a case above (an all_reduce is all_reduce_
    # after the passes: NOTE [All-reduces in place])
    every = "\n".join(line for lines in recorded.values() for line in lines)
    for op in _torch._collective_fake_kernels():
        name = str(op).replace(".all_reduce.", ".all_reduce_.")
        assert name in every, name


def test_a_raw_recording_is_make_fxs():
    """Before any pass: a constant from torch.tensor (copied: lift_fresh_copy), a
    factory, an op that changes a value's shape in place (the earlier value keeps its
    shape), a view, node names."""
    from sharded import _torch
    from torch.fx.experimental.proxy_tensor import make_fx

    fake = _torch.new_fake_mode()
    with fake:
        x = torch.empty(3, 2)

    def fn(*xs):
        c = torch.tensor([1.0, 2.0])
        y = xs[0].clone()
        y.unsqueeze_(0)
        return [y + c + torch.zeros(2), c * 2, xs[0].narrow(0, 0, 2).t()]

    recorded = _program(_torch.record_fake(fn, [x], fake))
    assert recorded == _program(make_fx(fn, tracing_mode="fake")(x))
    assert any("lift_fresh_copy" in line for line in recorded)
    assert any(line.startswith("call_function clone ") and "(3, 2)" in line for line in recorded)


def test_fake_results_by_their_meta_kernel_are_the_fake_modes(monkeypatch):
    """NOTE [Fake results by their meta kernel]: a view op's result and a functional
    collective's, made by the meta kernel, have the shape, strides, storage offset,
    dtype and device the fake mode gives, and share the input's storage exactly where
    the fake mode's do; the recorder makes every view and collective of a program so,
    and the passes the values of the nodes they make."""
    from sharded import _torch
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.multiprocessing.reductions import StorageWeakRef

    fake = _torch.new_fake_mode()
    with fake:
        x = torch.empty(4, 6, 8)[:, 1:]               # an offset, not contiguous
        y = torch.empty(6, 8, dtype=torch.float64)[1:]
        z = torch.empty(4, 6)
        one = torch.empty(1, 8)
    c = torch.ops._c10d_functional
    calls = [
        (aten.permute.default, (x, [2, 0, 1])), (aten.transpose.int, (x, 0, 2)),
        (aten.slice.Tensor, (x, 2, 1, 5, 2)), (aten.select.int, (x, 1, 2)),
        (aten.unsqueeze.default, (x, 1)), (aten.expand.default, (one, [3, 8])),
        (aten.view.default, (z, [8, -1])), (aten.t.default, (y,)), (aten.alias.default, (x,)),
        (aten.split_with_sizes.default, (x, [1, 3], 0)), (aten.unbind.int, (y, 1)),
        (aten.as_strided.default, (z, [2, 3], [1, 2], 1)), (aten.diagonal.default, (z,)),
        (c.all_gather_into_tensor.default, (z, 2, "0")), (c.reduce_scatter_tensor.default, (z, "sum", 2, "0")),
        (c.all_reduce.default, (x, "sum", "0")), (c.wait_tensor.default, (x,)),
        (c.all_reduce.default, (z, "sum", "0")), (c.wait_tensor.default, (z,)),
        (c.all_to_all_single.default, (z, [1, 3], [2, 2], "0")),
    ]
    kernels = _torch._collective_fake_kernels()

    def what(t, source):
        return (type(t), tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.device,
                StorageWeakRef(t.untyped_storage()) == StorageWeakRef(source.untyped_storage()))

    for op, args in calls:
        assert op.is_view or op in kernels, op
        with fake:
            want = op(*args)
        got = _torch._by_meta_kernel(fake, kernels.get(op, op), args)
        wants, gots = (want, got) if isinstance(want, (list, tuple)) else ([want], [got])
        assert type(got) is type(want) and len(gots) == len(wants), op
        assert [what(t, args[0]) for t in gots] == [what(t, args[0]) for t in wants], op
        assert all(type(t) is FakeTensor and t.fake_mode is fake for t in gots), op
        assert all(what(t, args[0])[-1] == op.is_view for t in gots), op     # (views share storage)
    reshaped, empty = _torch.fake_reshape(z, (3, -1)), _torch.fake_empty(y, (5, 2))
    strided = _torch.fake_as_strided(y, (2, 3), (1, 2), 9)
    with fake:
        assert what(reshaped, z) == what(z.reshape(3, -1), z)
        assert what(empty, y) == what(y.new_empty(5, 2), y)
        assert what(strided, y) == what(y.as_strided((2, 3), (1, 2), 9), y)

    made = []
    by_meta, reshape = _torch._by_meta_kernel, _torch.fake_reshape
    monkeypatch.setattr(_torch, "_by_meta_kernel",
                        lambda mode, op, args: made.append(op) or by_meta(mode, op, args))
    monkeypatch.setattr(_torch, "fake_reshape", lambda x, shape: made.append("packed") or reshape(x, shape))
    params = {"w": torch.randn(4, 3), "v": torch.randn(4, 2)}
    low = pjit(lambda p, x: ((x @ p["w"].t()) @ p["v"]).sum(), in_specs=(None, P("dp")),
               mesh=Mesh.abstract((2,), ("dp",)), mode=DataParallelMode("shard")).lower(params, torch.randn(8, 3))
    recorded = {n.target for n in low.local_graph.graph.nodes if n.op == "call_function"}
    c = torch.ops._c10d_functional
    assert {aten.t.default, *(kernels[op] for op in (c.all_gather_into_tensor.default, c.wait_tensor.default,
                                                     c.all_reduce.default))} <= set(made)
    assert "packed" in made and aten.cat.default in recorded      # (a bucket of the two gathers)


def test_a_gather_of_a_moved_dim_is_dtensors_program(monkeypatch):
    """``_torch.gather_moved``: DataParallelMode("shard") gathers a parameter shard split
    on a dim d > 0 (a colwise weight under "tp" on 2x2, the state split on dim 1) by the
    local ops DTensor's ``movedim``, redistribute and ``movedim`` back record, without
    DTensor's dispatch of the moves: the same program, node for node, values included."""
    from examples import gpt
    from sharded import _torch, optim

    cfg = gpt.tiny(n_layers=1, d_model=32, n_heads=4, vocab=64, seq=8)
    params = gpt.init_params(cfg, 0)
    state, (ids, tgt) = optim.adamw_init(params), gpt.batch(cfg, 4)
    specs = gpt.tp_specs(params)

    def lower():
        return pjit(lambda *a: gpt.train_step(*a), in_specs=(specs, gpt.opt_specs(specs), P("dp"), P("dp")),
                    mesh=Mesh.abstract((2, 2), ("dp", "tp")), static_argnums=(4,),
                    mode=DataParallelMode("shard")).lower(params, state, ids, tgt, cfg).local_graph

    used = []
    gather_moved = _torch.gather_moved
    monkeypatch.setattr(_torch, "gather_moved", lambda dt, i: used.append(gather_moved(dt, i)) or used[-1])
    ours = _program(lower())
    assert used and all(u is not None for u in used)
    monkeypatch.setattr(_torch, "gather_moved", lambda dt, i: None)        # DTensor's moves
    assert ours == _program(lower())


def test_a_gather_of_a_moved_dim_is_taken_only_where_dtensor_moves_nothing_else():
    """``_torch.gather_moved`` answers a shard split on dim d > 0 whose other mesh dims
    are Shard elsewhere or Replicate, split evenly: its layout is the input's with the
    axis replicated, its global shape and strides the input's. It leaves to DTensor
    (None) a pending sum or a split of the same dim on the other axis, an uneven split
    and a split of dim 0."""
    from sharded import _torch
    from torch.distributed.tensor import Partial, Replicate, Shard

    dm = Mesh.abstract((2, 2), ("dp", "tp")).device_mesh
    fake = _torch.new_fake_mode()
    with fake:
        x = torch.empty(4, 3)
    cases = {((Shard(1), Replicate()), (4, 6)): True, ((Shard(1), Shard(0)), (8, 6)): True,
             ((Shard(1), Partial()), (4, 6)): False, ((Shard(1), Shard(1)), (4, 12)): False,
             ((Shard(1), Replicate()), (4, 5)): False, ((Shard(0), Replicate()), (8, 3)): False}
    got = {}

    def run(local):
        for (placements, shape), _ in cases.items():
            spec = _torch.build_dtensor_spec(dm, placements, shape, (shape[1], 1), local.dtype)
            out = _torch.gather_moved(_torch.make_dtensor(local, spec), 0)
            got[(placements, shape)] = out is not None
            if out is not None:
                assert out.placements == (Replicate(), placements[1])
                assert (out.shape, out.stride()) == (torch.Size(shape), (shape[1], 1))
                assert tuple(out._local_tensor.shape) == (local.shape[0], shape[1])     # (dim 1 whole)
        return []

    _torch.record_fake(run, [x], fake)
    assert got == cases


def test_an_output_is_its_value_and_an_input_returned_is_a_view_of_it():
    """The expansion returns each computed output as the value itself (DTensor's
    ``to_local`` recorded a view of every output: 374 in a 12-layer GPT-2-small train
    step); an input returned as it is gets a view, so the program never hands an input
    back as its output."""
    mesh = Mesh.abstract((2,), ("tp",))
    for grad in (True, False):       # (to_local made its view only with grad enabled)
        with torch.set_grad_enabled(grad):
            low = pjit(lambda x, w: (x, x @ w, w * 2, w), in_specs=(P(), P(None, "tp")),
                       mesh=mesh).lower(torch.randn(3, 4), torch.randn(4, 6))
        g = low.local_graph.graph
        x, w = g.find_nodes(op="placeholder")[:2]        # (then pjit's agreement token)
        outs = next(n for n in g.nodes if n.op == "output").args[0]
        assert outs[0].target is torch.ops.aten.view.default and outs[0].args[0] is x
        assert outs[1].target is torch.ops.aten.mm.default
        assert outs[2].target is torch.ops.aten.mul.Tensor
        assert outs[3].target is torch.ops.aten.view.default and outs[3].args[0] is w
        assert not [n for n in g.nodes if n.target is torch.ops.aten.view.default and n not in (outs[0], outs[3])]


def test_dtensor_plans_each_op_and_each_move_once_while_expanding(monkeypatch):
    """NOTE [DTensor caches while expanding]: an op that ``planned_redistributions``
    propagated (the data-parallel batch check) is not propagated again when it runs,
    and expanding an op's strategies to a 2-D mesh plans each move once. Shapes no
    other test uses: DTensor's C++ dispatch cache has never seen them."""
    import collections

    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._redistribute import DTensorRedistributePlanner
    from torch.distributed.tensor._sharding_prop import LocalLRUCache, ShardingPropagator

    props, plans = collections.Counter(), collections.Counter()
    propagate = ShardingPropagator.propagate_op_sharding_non_cached
    greedy = DTensorRedistributePlanner.generate_greedy_transform_infos

    def counted_propagate(self, schema):
        props[schema] += 1
        return propagate(self, schema)

    def counted_greedy(self, src, dst, *a, **kw):
        plans[(src, dst)] += 1
        return greedy(self, src, dst, *a, **kw)

    monkeypatch.setattr(ShardingPropagator, "propagate_op_sharding_non_cached", counted_propagate)
    monkeypatch.setattr(DTensorRedistributePlanner, "generate_greedy_transform_infos", counted_greedy)
    prop = DTensor._op_dispatcher.sharding_propagator
    monkeypatch.setattr(prop, "propagate_op_sharding", LocalLRUCache(prop.propagate_op_sharding_non_cached))

    def step(w1, w2, x):
        return torch.func.grad(lambda w1, w2: torch.tanh(x @ w1 @ w2).square().mean(), (0, 1))(w1, w2)

    g = torch.Generator().manual_seed(0)
    w1, w2, x = torch.randn(22, 26, generator=g), torch.randn(26, 18, generator=g), torch.randn(12, 22, generator=g)
    pjit(step, in_specs=(P(None, "tp"), P("tp"), P("dp")), mesh=Mesh.abstract((2, 2), ("dp", "tp")),
         mode=DataParallelMode("shard")).lower(w1, w2, x)
    assert props and plans
    assert max(props.values()) == 1, [str(s) for s, k in props.items() if k > 1]
    assert max(plans.values()) == 1, [f"{a} -> {b}" for (a, b), k in plans.items() if k > 1]


def test_a_fake_tensor_no_op_made_is_an_error_naming_its_shape():
    """A fake tensor that is not an input, no recorded op made, and holds no value has
    nothing the program could read it from."""
    from sharded import _torch

    fake = _torch.new_fake_mode()
    with fake:
        x, stray = torch.empty(3), torch.empty(5, 3)
    with pytest.raises(_torch.UntrackedTensor, match=r"a fake tensor \(5, 3\) that no recorded op made"):
        _torch.record_fake(lambda a: [a + stray], [x], fake)


# -- values on real ranks ------------------------------------------------------------------------

def _cases_on_ranks():
    """(case, None or what went wrong) for each function and layout, against one device."""
    meshes = {"tp": Mesh((2,), ("tp",)), "dp": Mesh((2,), ("dp",))}
    cases = {
        "cat cache, heads split": (cat_cache, (_randn(2, 4, 3, 8),), P(None, "tp"), "tp", None),
        "cat mixed, rows split": (cat_mixed, (_randn(4, 3),), P("tp"), "tp", None),
        "cat grad, heads split": (cat_grad, (_randn(2, 4, 3),), P(None, "tp"), "tp", None),
        "sdpa mask, heads split": (sdpa_masked, _qkv_mask(1), (P(None, "tp"),) * 3 + (P(),), "tp", None),
        "sdpa per-head mask, heads split": (sdpa_masked, _qkv_mask(4), (P(None, "tp"),) * 3 + (P(),),
                                            "tp", None),
        "heads merged after a gather": (heads_merged, (_randn(2, 8, 4, 4),), P(None, None, "tp"),
                                        "tp", None),
    }
    for layout in ("replicate", "shard"):
        mode = DataParallelMode(layout)
        cases[f"cat cache, {layout}"] = (cat_cache, (_randn(4, 2, 3, 8),), P("dp"), "dp", mode)
        cases[f"sdpa mask, {layout}"] = (sdpa_masked, _qkv_mask(1), (P("dp"),) * 3 + (P(),), "dp", mode)
    out = {}
    try:        # a constant of the program (axis_index's) reads the same in every call
        f = pjit(lambda x: _rank_sum(x, meshes["tp"]), in_specs=P("tp"), mesh=meshes["tp"])
        x = _randn(4, 2)
        for _ in range(3):
            torch.testing.assert_close(gather(f(x)), x + 1.0)
        out["axis_index, three calls"] = None
    except Exception as e:  # noqa: BLE001 - reported per case
        out["axis_index, three calls"] = f"{type(e).__name__}: {str(e)[:1500]}"
    for name, (fn, args, specs, mesh, mode) in cases.items():
        try:
            got = pjit(fn, in_specs=specs, mesh=meshes[mesh], mode=mode)(*args)
            want = fn(*args)
            torch.testing.assert_close(gather(got), want, rtol=1e-5, atol=1e-6)
            out[name] = None
        except Exception as e:  # noqa: BLE001 - reported per case
            out[name] = f"{type(e).__name__}: {str(e)[:1500]}"
    return out


def test_values_equal_one_device_on_ranks(on_ranks):
    results = on_ranks(2, _cases_on_ranks)[0]
    assert len(results) == 11
    assert {k: v for k, v in results.items() if v is not None} == {}


# -- one collective for a move on one axis ---------------------------------------------------------

def _one_collective_moves():
    """Each move of NOTE [One collective for a move on one axis] (sharded/_torch.py)
    against DTensor's own redistribute of the same DTensor: the local results equal
    bitwise, with the same shape and strides; the moves it leaves to DTensor (uneven,
    one dim split over two axes, avg and max partials, Partial -> Replicate) return
    None."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    from sharded import _torch

    rank = dist.get_rank()
    flat = Mesh((4,), ("dp",)).device_mesh
    square = Mesh((2, 2), ("dp", "tp")).device_mesh
    lone = Mesh((1, 4), ("dp", "tp")).device_mesh
    R, S = Replicate(), Shard
    # (mesh, source placements, target placements, global shape, local made transposed)
    moves = [
        (flat, (S(0),), (R,), (8, 3), False), (flat, (S(1),), (R,), (3, 8), False),
        (flat, (S(2),), (R,), (2, 3, 8), False), (flat, (S(1),), (R,), (3, 8), True),
        (flat, (Partial(),), (S(0),), (8, 3), False), (flat, (Partial(),), (S(1),), (3, 8), False),
        (flat, (Partial(),), (S(2),), (2, 3, 8), False), (flat, (Partial(),), (S(1),), (3, 8), True),
        (square, (S(0), S(1)), (R, S(1)), (4, 6), False),
        (square, (Partial(), S(0)), (S(1), S(0)), (4, 6), False),
        (square, (S(0), Partial()), (S(0), S(1)), (4, 6), True),
        (lone, (S(1), S(0)), (R, S(0)), (8, 3), True),        # an axis of one rank
        (lone, (Partial(), S(0)), (S(1), S(0)), (8, 3), True),
    ]
    left = [(flat, (S(0),), (R,), (5, 3)), (flat, (Partial(),), (S(1),), (3, 6)),
            (flat, (Partial("avg"),), (S(0),), (8, 3)), (flat, (Partial("max"),), (S(0),), (8, 3)),
            (square, (S(0), S(0)), (R, S(0)), (8, 3)), (square, (Partial(), R), (R, R), (4, 6))]
    out = []
    g = torch.Generator().manual_seed(rank)
    for dm, src, dst, shape, transposed in moves:
        if any(isinstance(p, Partial) for p in src):
            local_shape = list(shape)
            for p, n in zip(src, dm.shape):
                if isinstance(p, Shard):
                    local_shape[p.dim] //= n
            local = torch.randn(*local_shape, generator=g)      # each rank's own summand
            if transposed:
                local = local.t().contiguous().t()
            dt = DTensor.from_local(local, dm, src, run_check=False, shape=torch.Size(shape),
                                    stride=torch.empty(shape).stride())
        else:
            full = torch.randn(*shape, generator=torch.Generator().manual_seed(7))
            dt = distribute_tensor(full, dm, src)
            if transposed:
                dt = DTensor.from_local(dt.to_local().t().contiguous().t(), dm, src, run_check=False,
                                        shape=dt.shape, stride=dt.stride())
        want = dt.redistribute(dm, dst).to_local()
        got = _torch._one_collective(dt.to_local(), dt._spec, dst)
        out.append((str(src), str(dst), shape, transposed, got is not None and torch.equal(got, want)
                    and got.stride() == want.stride(), tuple(want.shape)))
    for dm, src, dst, shape in left:
        full = torch.randn(*shape, generator=torch.Generator().manual_seed(7))
        dt = distribute_tensor(full, dm, [R if isinstance(p, Partial) else p for p in src])
        if any(isinstance(p, Partial) for p in src):
            dt = DTensor.from_local(dt.to_local(), dm, src, run_check=False)
        out.append((str(src), str(dst), shape, "left to DTensor",
                    _torch._one_collective(dt.to_local(), dt._spec, dst) is None, None))
    return out


def test_one_collective_per_move_equals_dtensors_on_ranks(on_ranks):
    results = on_ranks(4, _one_collective_moves)
    for rank, moves in enumerate(results):
        assert len(moves) == 19
        assert [m for m in moves if m[4] is not True] == [], rank
