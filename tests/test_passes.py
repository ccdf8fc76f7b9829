"""Graph passes: CSE merges duplicate pure ops (and collectives), never random ops."""

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


def test_identity_views_are_dropped_except_into_outputs():
    from sharded.passes import remove_identity_views

    def f(x):
        y = torch.sin(x.view(2, 3))          # identity view: dropped
        return y.view(2, 3), y.view(3, 2)    # into the outputs: kept

    gm = make_fx(f, tracing_mode="fake")(torch.ones(2, 3))
    assert _count(gm, "view") == 3
    gm = remove_identity_views(gm)
    gm.recompile()
    assert _count(gm, "view") == 2
    x = torch.randn(2, 3)
    a, b = gm(x)
    torch.testing.assert_close(a, torch.sin(x))
    torch.testing.assert_close(b, torch.sin(x).view(3, 2))


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
