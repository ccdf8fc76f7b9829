"""shard_map and the named-axis collectives: forward values and gradients equal the
single-device program, on real gloo ranks."""

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from sharded import Mesh, P, gather, shard, spec_of
from sharded import collectives as C
from tests.models import MLP_SHAPES, MLP_TP, init, mlp, specs_of
from transforms import pjit, shard_map


def _check_fwd_and_grad(mesh, region, reference, args, in_specs):
    """``region`` (a shard_map) and ``reference`` (single-device) agree on the value and
    on the gradients of ``(out * weight).sum()`` for every float argument, with the
    gradient taken by torch.func.grad inside pjit."""
    out = region(*args)
    ref = reference(*args)
    torch.testing.assert_close(gather(out), ref, rtol=1e-5, atol=1e-5)
    weight = torch.randn(ref.shape, generator=torch.Generator().manual_seed(9))
    argnums = tuple(i for i, a in enumerate(args)
                    if not isinstance(a, torch.Tensor) or a.dtype.is_floating_point)

    def loss_of(f):
        return lambda *a: (f(*a) * weight).sum()

    g = pjit(torch.func.grad(loss_of(region), argnums=argnums), in_specs=in_specs, mesh=mesh)
    grads = g(*args)
    ref_grads = torch.func.grad(loss_of(reference), argnums=argnums)(*args)
    torch.testing.assert_close(gather(grads), ref_grads, rtol=1e-5, atol=1e-5)
    return g.lower(*args)


# -- rank-side bodies --------------------------------------------------------------------

def _megatron_by_hand(ws):
    mesh = Mesh((ws,), ("tp",))
    torch.manual_seed(0)
    p, x = init(0, MLP_SHAPES), torch.randn(6, 8)
    specs = specs_of(MLP_TP)

    def body(p, x):
        h = torch.relu(F.linear(x, p["w1"], p["b1"]))
        return C.psum(h @ p["w2"].T, "tp") + p["b2"]

    region = shard_map(body, mesh=mesh, in_specs=(specs, P()), out_specs=P())
    lowered = _check_fwd_and_grad(mesh, region, mlp, (p, x), (specs, P()))
    return [str(c) for c in lowered.collectives()]


def _data_parallel_pmean(ws):
    mesh = Mesh((ws,), ("dp",))
    torch.manual_seed(0)
    p, x, y = init(0, MLP_SHAPES), torch.randn(8, 8), torch.randint(0, 4, (8,))

    def local_loss(p, x, y):
        return C.pmean(F.cross_entropy(mlp(p, x), y), "dp")

    region = shard_map(local_loss, mesh=mesh, in_specs=(P(), P("dp"), P("dp")), out_specs=P())
    loss = region(p, x, y)
    torch.testing.assert_close(gather(loss), F.cross_entropy(mlp(p, x), y))
    step = pjit(torch.func.grad_and_value(region), in_specs=(P(), P("dp"), P("dp")), mesh=mesh)
    grads, loss = step(p, x, y)
    ref_grads, ref_loss = torch.func.grad_and_value(lambda p: F.cross_entropy(mlp(p, x), y))(p)
    torch.testing.assert_close(gather(grads), ref_grads, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gather(loss), ref_loss)
    return [str(c) for c in step.lower(p, x, y).collectives()]


def _ring(ws):
    mesh = Mesh((ws,), ("dp",))
    x = torch.randn(ws * 2, 3, generator=torch.Generator().manual_seed(1))
    ring = [(i, (i + 1) % ws) for i in range(ws)]
    region = shard_map(lambda x: C.ppermute(x * x, "dp", ring), mesh=mesh,
                       in_specs=P("dp"), out_specs=P("dp"))
    # block i moves to position i + 1: a roll of the blocks
    lowered = _check_fwd_and_grad(mesh, region, lambda x: torch.roll(x * x, 2, 0), (x,), (P("dp"),))
    # the forward ppermute (merged with the vjp's recomputed one) and its transpose:
    # point-to-point, one block each
    calls = [c for c in lowered.collectives() if c.kind == "ppermute"]
    assert len(calls) == 2 and all(c.shape == (2, 3) for c in calls), calls


def _all_to_all_swaps_the_sharded_dim(ws):
    mesh = Mesh((ws,), ("ep",))
    x = torch.randn(ws * 2, ws * 3, generator=torch.Generator().manual_seed(2))
    region = shard_map(lambda x: C.all_to_all(torch.sin(x), "ep", split_dim=1, concat_dim=0),
                       mesh=mesh, in_specs=P("ep"), out_specs=P(None, "ep"))
    out = region(x)
    assert spec_of(out) == P(None, "ep")
    _check_fwd_and_grad(mesh, region, torch.sin, (x,), (P("ep"),))


def _gather_scatter_round_trips(ws):
    mesh = Mesh((ws,), ("dp",))
    x = torch.randn(ws * 2, 3, generator=torch.Generator().manual_seed(3))
    gathered = shard_map(lambda x: C.all_gather(torch.sin(x), "dp", tiled=True), mesh=mesh,
                         in_specs=P("dp"), out_specs=P())
    _check_fwd_and_grad(mesh, gathered, torch.sin, (x,), (P("dp"),))
    stacked = shard_map(lambda x: C.all_gather(x, "dp", dim=1), mesh=mesh,
                        in_specs=P("dp"), out_specs=P())
    torch.testing.assert_close(gather(stacked(x)), x.reshape(ws, 2, 3).transpose(0, 1))
    # all_gather then psum_scatter: every rank adds the same full value: ws * x.
    round_trip = shard_map(
        lambda x: C.psum_scatter(C.all_gather(x, "dp", tiled=True), "dp", tiled=True),
        mesh=mesh, in_specs=P("dp"), out_specs=P("dp"))
    _check_fwd_and_grad(mesh, round_trip, lambda x: ws * x, (x,), (P("dp"),))
    # psum_scatter of per-rank partial sums, then all_gather back: the full sum.
    reduce_then_gather = shard_map(
        lambda x: C.all_gather(C.psum_scatter(x.repeat(ws, 1), "dp", tiled=True), "dp", tiled=True),
        mesh=mesh, in_specs=P("dp"), out_specs=P())
    _check_fwd_and_grad(mesh, reduce_then_gather,
                        lambda x: x.reshape(ws, 2, 3).sum(0).repeat(ws, 1), (x,), (P("dp"),))


def _axis_index(ws):
    mesh = Mesh((ws,), ("dp",))
    x = torch.randn(ws * 2, 3, generator=torch.Generator().manual_seed(4))
    region = shard_map(lambda x: x * (C.axis_index("dp") + 1) + C.axis_size("dp"), mesh=mesh,
                       in_specs=P("dp"), out_specs=P("dp"))
    scale = torch.arange(1, ws + 1).repeat_interleave(2)[:, None]
    _check_fwd_and_grad(mesh, region, lambda x: x * scale + ws, (x,), (P("dp"),))


def _two_d_mesh():
    mesh = Mesh((2, 2), ("dp", "tp"))
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(5))
    over_tp = shard_map(lambda x: C.psum(torch.sin(x), "tp"), mesh=mesh,
                        in_specs=P("dp", "tp"), out_specs=P("dp"))
    _check_fwd_and_grad(mesh, over_tp, lambda x: torch.sin(x).reshape(4, 2, 3).sum(1),
                        (x,), (P("dp", "tp"),))
    over_both = shard_map(lambda x: C.psum(torch.sin(x), ("dp", "tp")), mesh=mesh,
                          in_specs=P("dp", "tp"), out_specs=P())
    _check_fwd_and_grad(mesh, over_both, lambda x: torch.sin(x).reshape(2, 2, 2, 3).sum((0, 2)),
                        (x,), (P("dp", "tp"),))
    mean_both = shard_map(lambda x: C.pmean(x.sum(), ("dp", "tp")), mesh=mesh,
                          in_specs=P("dp", "tp"), out_specs=P())
    torch.testing.assert_close(gather(mean_both(x)), x.sum() / 4)
    mx = shard_map(lambda x: C.pmax(x, ("dp", "tp")), mesh=mesh, in_specs=P("dp", "tp"), out_specs=P())
    torch.testing.assert_close(gather(mx(x)), x.reshape(2, 2, 2, 3).amax((0, 2)))
    # pmin's gradient goes where x is the min: compare with the single-device amin
    mn = shard_map(lambda x: C.pmin(torch.sin(x), "tp"), mesh=mesh, in_specs=P("dp", "tp"), out_specs=P("dp"))
    _check_fwd_and_grad(mesh, mn, lambda x: torch.sin(x).reshape(4, 2, 3).amin(1), (x,), (P("dp", "tp"),))


def _eager_inputs_and_pjit_composition():
    mesh = Mesh((2,), ("dp",))
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(6))
    region = shard_map(lambda x: C.psum(x.sum(0, keepdim=True), "dp"), mesh=mesh,
                       in_specs=P("dp"), out_specs=P())
    for arg in (x, shard(x, P("dp"), mesh), shard(x, P(), mesh)):
        out = region(arg)
        assert isinstance(out, DTensor) and spec_of(out) == P()
        torch.testing.assert_close(gather(out), x.sum(0, keepdim=True))
    # A manual region inside an automatically partitioned program.
    f = pjit(lambda x: region(torch.cos(x)) * 2 + x.mean(), in_specs=P("dp"), mesh=mesh)
    torch.testing.assert_close(gather(f(x)), torch.cos(x).sum(0, keepdim=True) * 2 + x.mean())
    text = region.lower(x).as_text()
    assert "_c10d_functional.all_reduce" in text, text


def _errors():
    mesh = Mesh((2,), ("dp",))
    x = torch.randn(4, 3)
    msgs = {}
    for name, fn, kw, arg in [
        ("unknown_axis", lambda x: C.psum(x, "tp"), dict(in_specs=P("dp"), out_specs=P()), x),
        ("varying_out", lambda x: x * 2, dict(in_specs=P("dp"), out_specs=P()), x),
        ("in_specs", lambda x: x, dict(in_specs=(P(), P()), out_specs=P()), x),
        ("not_divisible", lambda x: x, dict(in_specs=P("dp"), out_specs=P("dp")), torch.ones(3, 2)),
        ("nested", lambda x: shard_map(lambda y: y, mesh=mesh, in_specs=P(), out_specs=P())(x),
         dict(in_specs=P("dp"), out_specs=P("dp")), x),
        ("scatter_untiled", lambda x: C.psum_scatter(x, "dp"), dict(in_specs=P(), out_specs=P("dp")), x),
        ("scatter_divide", lambda x: C.psum_scatter(x, "dp", dim=1, tiled=True),
         dict(in_specs=P(), out_specs=P("dp")), x),
        ("a2a_divide", lambda x: C.all_to_all(x, "dp", split_dim=1, concat_dim=0),
         dict(in_specs=P("dp"), out_specs=P("dp")), x),
        ("bad_perm", lambda x: C.ppermute(x, "dp", [(0, 1), (1, 1)]),
         dict(in_specs=P("dp"), out_specs=P("dp")), x),
    ]:
        try:
            shard_map(fn, mesh=mesh, **kw)(arg)
            msgs[name] = "no error"
        except Exception as e:  # noqa: BLE001
            msgs[name] = f"{type(e).__name__}: {e}"
    try:
        C.psum(x, "dp")
        msgs["outside"] = "no error"
    except RuntimeError as e:
        msgs["outside"] = str(e)
    # check_vma=False lets a varying value through (the user vouches for it).
    out = shard_map(lambda x: x.sum() * 0, mesh=mesh, in_specs=P("dp"), out_specs=P(),
                    check_vma=False)(x)
    torch.testing.assert_close(gather(out), torch.zeros(()))
    return msgs


def _regressions():
    mesh = Mesh((2,), ("dp",))
    x = torch.arange(4.0).reshape(2, 2)

    # Several ppermutes in one body: each rank routes each one correctly (a rank-
    # dependent send buffer once let CSE merge different ppermutes on one rank only).
    def perms(x):
        return torch.stack([C.ppermute(x, "dp", p) for p in
                            ([(0, 1)], [(0, 1), (1, 0)], [(1, 0)], [(1, 0), (0, 1)])])

    out = gather(shard_map(perms, mesh=mesh, in_specs=P("dp"), out_specs=P(None, "dp"))(x))
    z = torch.zeros(1, 2)
    torch.testing.assert_close(out, torch.stack(
        [torch.cat([z, x[:1]]), x.flip(0), torch.cat([x[1:], z]), x.flip(0)]))

    # Tensors a body creates from nothing are the same on every rank (invariant).
    total = shard_map(lambda x: C.psum(x.sum(), "dp") + torch.zeros(()), mesh=mesh,
                      in_specs=P("dp"), out_specs=P())(x)
    torch.testing.assert_close(gather(total), x.sum())

    # check_vma=False skips the output check but keeps gradients right.
    torch.manual_seed(0)
    p, xs, y = init(0, MLP_SHAPES), torch.randn(8, 8), torch.randint(0, 4, (8,))
    region = shard_map(lambda p, x, y: C.pmean(F.cross_entropy(mlp(p, x), y), "dp"),
                       mesh=mesh, in_specs=(P(), P("dp"), P("dp")), out_specs=P(), check_vma=False)
    grads = pjit(torch.func.grad(region), in_specs=(P(), P("dp"), P("dp")), mesh=mesh)(p, xs, y)
    ref = torch.func.grad(lambda p: F.cross_entropy(mlp(p, xs), y))(p)
    torch.testing.assert_close(gather(grads), ref, rtol=1e-5, atol=1e-6)

    # Second-order gradients: the vjp of a region is a region, differentiable again.
    cube = shard_map(lambda x: C.psum((x ** 3).sum(), "dp"), mesh=mesh, in_specs=P("dp"), out_specs=P())
    hess = pjit(torch.func.grad(lambda x: torch.func.grad(cube)(x).sum()), in_specs=P("dp"), mesh=mesh)
    torch.testing.assert_close(gather(hess(x)), 6 * x)

    # Forward mode is a clear error.
    try:
        pjit(lambda x: torch.func.jvp(cube, (x,), (x,))[1], in_specs=P("dp"), mesh=mesh)(x)
        raise AssertionError("no error")
    except NotImplementedError as e:
        assert "forward-mode differentiation (torch.func.jvp, jacfwd) through a shard_map is not supported" in str(e), e

    # A closed-over traced value used only under a transform inside the body, with a
    # transform around the region: an error, not a gradient path silently cut.
    def outer(p, x):
        inner = shard_map(lambda x: torch.func.grad(lambda q: (q * x).sum())(p), mesh=mesh,
                          in_specs=P("dp"), out_specs=P("dp"))
        return inner(x).sum()

    try:
        pjit(torch.func.grad(outer), in_specs=(P(), P("dp")), mesh=mesh)(torch.ones(2), x)
        raise AssertionError("no error")
    except NotImplementedError as e:
        assert "uses it only inside a torch.func transform of the body" in str(e), e

    # A torch.func transform around an eager call is a clear error.
    f = shard_map(lambda x: C.psum(x.sum(), "dp"), mesh=mesh, in_specs=P("dp"), out_specs=P())
    try:
        torch.func.grad(lambda x: f(x).to_local())(x)
        return "no error"
    except TypeError as e:
        return str(e)


def _every_collective(kind):
    """Every collective on a sharded and on a replicated input, with each kind of
    out_spec (invariant, varying, and naming an axis the output does not vary over):
    values and gradients against the single-device program (torch.func). ``kind``
    "1d": one axis "x"; "tuple": the tuple ("x", "y") of a 2x2 mesh."""
    mesh = Mesh((2, 2), ("x", "y")) if kind == "tuple" else Mesh((torch.distributed.get_world_size(),), ("x",))
    a = ("x", "y") if kind == "tuple" else "x"
    n = mesh.size()
    ring, partial = [(i, (i + 1) % n) for i in range(n)], [(0, n - 1)]

    def body(x):
        i = C.axis_index(a).to(x.dtype)
        return {
            "psum": C.psum(torch.sin(x), a), "psum_fanout": C.psum(torch.sin(x), a),
            "pmean": C.pmean(x, a), "pmax": C.pmax(x, a), "pmin": C.pmin(x, a),
            "gather": C.all_gather(x, a, tiled=True), "stack_fanout": C.all_gather(x, a, dim=1),
            "scatter": C.psum_scatter(x, a, dim=1, tiled=True),
            "ring": C.ppermute(x, a, ring), "partial": C.ppermute(x, a, partial),
            "a2a": C.all_to_all(x, a, split_dim=1, concat_dim=0), "index": x * (i + 1),
            "pvary": C.pvary(x, a),
        }

    inv, var, cols = P(), P(a), P(None, a)
    out_specs = {"psum": inv, "psum_fanout": var, "pmean": inv, "pmax": inv, "pmin": inv,
                 "gather": inv, "stack_fanout": var, "scatter": cols, "ring": var,
                 "partial": var, "a2a": cols, "index": var, "pvary": var}

    def tile(t):
        return t.repeat(n, *([1] * (t.ndim - 1)))

    def sharded_ref(X):                          # X: [2n, 4], block r = rows 2r, 2r+1
        B = X.reshape(n, 2, 4)
        shifted = torch.roll(X, 2, 0)
        only = torch.cat([torch.zeros(2 * (n - 1), 4), X[:2]])
        scale = torch.arange(1, n + 1, dtype=X.dtype).repeat_interleave(2)[:, None]
        return {"psum": torch.sin(B).sum(0), "psum_fanout": tile(torch.sin(B).sum(0)),
                "pmean": B.mean(0), "pmax": B.amax(0), "pmin": B.amin(0), "gather": X,
                "stack_fanout": tile(B.transpose(0, 1)), "scatter": B.sum(0), "ring": shifted,
                "partial": only, "a2a": X, "index": X * scale, "pvary": X}

    def replicated_ref(x):                       # x: [2, 4], the same on every rank
        scale = torch.arange(1, n + 1, dtype=x.dtype).repeat_interleave(2)[:, None]
        return {"psum": n * torch.sin(x), "psum_fanout": tile(n * torch.sin(x)), "pmean": x,
                "pmax": x, "pmin": x, "gather": tile(x),
                "stack_fanout": tile(x[:, None].expand(2, n, 4)), "scatter": n * x,
                "ring": tile(x), "partial": torch.cat([torch.zeros(2 * (n - 1), 4), x]),
                "a2a": tile(x), "index": tile(x) * scale, "pvary": tile(x)}

    weights = {k: torch.randn(8 * n * n, generator=torch.Generator().manual_seed(i))
               for i, k in enumerate(out_specs)}

    def loss_of(f):
        def loss(x):
            out = f(x)
            return sum((out[k] * weights[k][:out[k].numel()].reshape(out[k].shape)).sum() for k in out)

        return loss

    for spec, x, ref in ((var, torch.randn(2 * n, 4, generator=torch.Generator().manual_seed(7)), sharded_ref),
                         (inv, torch.randn(2, 4, generator=torch.Generator().manual_seed(8)), replicated_ref)):
        region = shard_map(body, mesh=mesh, in_specs=spec, out_specs=out_specs)
        got = gather(region(x))                   # eager, op by op
        want = ref(x)
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-5, msg=f"{k} ({spec!r})")
        grads = pjit(torch.func.grad(loss_of(region)), in_specs=spec, mesh=mesh)(x)
        torch.testing.assert_close(gather(grads), torch.func.grad(loss_of(ref))(x), rtol=1e-5, atol=1e-5)


def _issue_regressions(ws):
    """The findings of issue 9, each as it was reproduced, on ``ws`` ranks."""
    mesh = Mesh((ws,), ("dp",))
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(3, generator=g), torch.randn(2 * ws, 3, generator=g)

    # 2. grad inside the body: JAX's canonical data-parallel step (traced and eager)
    def local_loss(w, x):
        return C.pmean(((x @ w) ** 2).mean(), "dp")

    step = shard_map(lambda w, x: torch.func.grad(local_loss)(w, x), mesh=mesh,
                     in_specs=(P(), P("dp")), out_specs=P())
    ref = torch.func.grad(lambda w: ((x @ w) ** 2).mean())(w)
    torch.testing.assert_close(gather(pjit(step, in_specs=(P(), P("dp")), mesh=mesh)(w, x)), ref)
    torch.testing.assert_close(gather(step(w, x)), ref)

    # ... and differentiated again from outside (a grad inside the body, one outside)
    cubic = shard_map(lambda w, x: torch.func.grad(lambda w, x: C.pmean(((x @ w) ** 3).mean(), "dp"))(w, x),
                      mesh=mesh, in_specs=(P(), P("dp")), out_specs=P())
    outer = pjit(torch.func.grad(lambda w, x: cubic(w, x).pow(2).sum()), in_specs=(P(), P("dp")), mesh=mesh)
    ref = torch.func.grad(lambda w: torch.func.grad(lambda w: ((x @ w) ** 3).mean())(w).pow(2).sum())(w)
    torch.testing.assert_close(gather(outer(w, x)), ref, rtol=1e-5, atol=1e-4)

    # 3. closures are invariant: accepted with out P(); the gradient is not ws times too large
    c = torch.tensor([2.0, 3.0, 4.0])
    for check in (True, False):
        f = shard_map(lambda w: w * c, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=check)
        grad = pjit(torch.func.grad(lambda w: f(w).sum()), in_specs=P(), mesh=mesh)(w)
        torch.testing.assert_close(gather(grad), c)

    # check_vma=False: an output typed varying that is in fact the same on every rank
    # (the user vouches) has the gradient of one value, not of ws copies
    f = shard_map(lambda w, x: w * (1 + (x - x).sum()), mesh=mesh, in_specs=(P(), P("dp")),
                  out_specs=P(), check_vma=False)
    grad = pjit(torch.func.grad(lambda w, x: f(w, x).sum()), in_specs=(P(), P("dp")), mesh=mesh)(w, x)
    torch.testing.assert_close(gather(grad), torch.ones(3))

    # pmax/pmin split the gradient among tied ranks, as torch.amax splits it
    tied = torch.tensor([1.0, 5.0, 2.0]).repeat(ws)
    mx = shard_map(lambda t: C.pmax(t, "dp"), mesh=mesh, in_specs=P("dp"), out_specs=P())
    grad = pjit(torch.func.grad(lambda t: (mx(t) * torch.arange(3.0)).sum()), in_specs=P("dp"), mesh=mesh)(tied)
    torch.testing.assert_close(gather(grad), torch.func.grad(
        lambda t: (t.reshape(ws, 3).amax(0) * torch.arange(3.0)).sum())(tied))

    # 3. in-place ops update the destination's varying axes ...
    def acc_body(x):
        acc = torch.zeros(3)
        acc.add_(x.sum(0))
        return acc

    try:
        shard_map(acc_body, mesh=mesh, in_specs=P("dp"), out_specs=P())(x)
        raise AssertionError("no error")
    except ValueError as e:
        assert "does not name mesh axis 'dp'" in str(e), e
    # ... and route the old value's gradient through a pvary (a psum in the backward),
    # under a grad inside the body and under one outside it
    def inner(w, x):
        def loss(w):
            acc = w * 1.0
            acc.add_(x.sum(0))
            return C.psum(acc.sum(), "dp")

        return torch.func.grad(loss)(w)

    f = shard_map(inner, mesh=mesh, in_specs=(P(), P("dp")), out_specs=P())
    torch.testing.assert_close(gather(f(w, x)), torch.full((3,), float(ws)))
    torch.testing.assert_close(gather(pjit(f, in_specs=(P(), P("dp")), mesh=mesh)(w, x)), torch.full((3,), float(ws)))

    def outer(w, x):
        acc = w * 1.0
        acc.add_(x.sum(0))
        return C.psum(acc, "dp")

    f = shard_map(outer, mesh=mesh, in_specs=(P(), P("dp")), out_specs=P())
    grad = pjit(torch.func.grad(lambda w, x: f(w, x).sum()), in_specs=(P(), P("dp")), mesh=mesh)(w, x)
    torch.testing.assert_close(gather(grad), torch.full((3,), float(ws)))

    # 4. ppermute is point-to-point: inf and NaN arrive unchanged, one block per rank
    y = torch.tensor([[float("inf"), 1.0], [float("nan"), float("-inf")]]).repeat(ws, 1)
    shift = shard_map(lambda y: C.ppermute(y, "dp", [(i, (i + 1) % ws) for i in range(ws)]),
                      mesh=mesh, in_specs=P("dp"), out_specs=P("dp"))
    torch.testing.assert_close(gather(shift(y)), torch.roll(y, 2, 0), equal_nan=True)
    cost = shift.lower(y).cost()
    assert cost["ppermute"]["count"] == 1 and cost["ppermute"]["bytes"] == 2 * 2 * 4, cost
    assert cost["total"]["count"] == 1, cost
    return True


# -- tests ---------------------------------------------------------------------------------

@pytest.mark.parametrize("ws", [2, 4])
def test_megatron_mlp_by_hand(on_ranks, ws):
    calls = on_ranks(ws, _megatron_by_hand, ws)[0]
    # the forward psum and the input gradient's psum (transpose of the implicit pvary)
    assert calls == ["all_reduce sum float32[6, 4] over 'tp'", "all_reduce sum float32[6, 8] over 'tp'"], calls


@pytest.mark.parametrize("ws", [2, 4])
def test_data_parallel_step_with_pmean(on_ranks, ws):
    calls = on_ranks(ws, _data_parallel_pmean, ws)[0]
    # the loss's pmean, and one psum of the parameter gradients (bucketed)
    assert len(calls) == 2 and all(c.startswith("all_reduce sum") for c in calls), calls


@pytest.mark.parametrize("ws", [2, 4])
def test_ppermute_ring(on_ranks, ws):
    on_ranks(ws, _ring, ws)


@pytest.mark.parametrize("ws", [2, 4])
def test_all_to_all(on_ranks, ws):
    on_ranks(ws, _all_to_all_swaps_the_sharded_dim, ws)


@pytest.mark.parametrize("ws", [2, 4])
def test_all_gather_psum_scatter_round_trips(on_ranks, ws):
    on_ranks(ws, _gather_scatter_round_trips, ws)


def test_axis_index(on_ranks):
    on_ranks(4, _axis_index, 4)


def test_collectives_over_one_and_both_axes_of_a_2x2_mesh(on_ranks):
    on_ranks(4, _two_d_mesh)


def test_eager_on_dtensors_and_plain_tensors_and_inside_pjit(on_ranks):
    on_ranks(2, _eager_inputs_and_pjit_composition)


def test_errors(on_ranks):
    m = on_ranks(2, _errors)[0]
    assert "psum: mesh axis 'tp' is not in the shard_map mesh; its axes are ('dp',)" in m["unknown_axis"], m
    assert ("ValueError: shard_map(<lambda>) out_specs (for output) does not name mesh axis "
            "'dp', so the output must be the same on every rank along it") in m["varying_out"], m
    assert "in_specs has 2 entries but the call has 1 positional args" in m["in_specs"], m
    assert "maps dim 0 (size 3) to mesh axis 'dp' (size 2), which does not divide it" in m["not_divisible"], m
    assert "shard_map inside a shard_map body is not supported" in m["nested"], m
    assert "runs only inside a shard_map body" in m["outside"], m
    assert "without tiled needs dim 0 of x (shape (4, 3)) to equal the size of mesh axis 'dp' (2); pass tiled=True" in m["scatter_untiled"], m
    assert "psum_scatter: dim 1 of x (shape (4, 3)) must divide by the size of mesh axis 'dp' (2)" in m["scatter_divide"], m
    assert "all_to_all: split dim 1 of x (shape (2, 3)) must divide by the size of mesh axis 'dp' (2)" in m["a2a_divide"], m
    assert "ppermute: perm [(0, 1), (1, 1)] must pair distinct sources with distinct destinations" in m["bad_perm"], m


def test_regressions(on_ranks):
    msg = on_ranks(2, _regressions)[0]
    assert "was called inside a torch.func transform (grad, vmap, ...); an eager shard_map call is not differentiable from outside" in msg, msg


@pytest.mark.parametrize("ws", [2, 4])
def test_every_collective_value_and_gradient(on_ranks, ws):
    on_ranks(ws, _every_collective, "1d")


def test_every_collective_over_an_axis_tuple(on_ranks):
    on_ranks(4, _every_collective, "tuple")


@pytest.mark.parametrize("ws", [2, 4])
def test_issue_9_findings(on_ranks, ws):
    on_ranks(ws, _issue_regressions, ws)


def test_axes_from_sets_follow_mesh_order():
    """Axes the tracker gathers in Python sets reach the program in mesh order: a
    set's iteration order differs between processes (string hashing), so ranks once
    built multi-axis pvarys (and their psum transposes) in different orders."""
    # A pair of names this process iterates backwards. Each pair is backwards with
    # probability about 7/16 (two slots of 8 from the string hashes; same slot: insertion
    # order); 512 candidates all forwards has probability (9/16) ** 512 < 1e-127.
    names = next((a, b) for a, b in ((f"a{i}", f"b{i}") for i in range(512))
                 if tuple(frozenset((a, b))) == (b, a))
    mesh = Mesh((1, 1), names)
    f = shard_map(lambda x, w: x * w, mesh=mesh, in_specs=(P(names), P()), out_specs=P(names))
    lowered = f.lower(torch.ones(4), torch.ones(4))
    code = "\n".join(r.graph_module.code for r in lowered.global_graph.children())
    assert f"pvary.default(arg1_1, '{names[0]},{names[1]}')" in code, code
