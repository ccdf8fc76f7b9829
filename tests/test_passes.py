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
