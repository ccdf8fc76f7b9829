"""sharded/rewrites/losses.py: a mean loss becomes a sum over its total weight, with the
same bits on one device (the split runs are in test_data_parallel.py)."""

import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import pytest

from sharded.rewrites.losses import COUNTED_OPS, MEAN, MEAN_IS_GLOBAL, mean_losses_as_sums


def test_mean_losses_as_sums_keeps_the_bits():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(12, 7, generator=g, requires_grad=True)
    targets = torch.randint(0, 7, (12,), generator=g)
    targets[:3] = -100
    weight = torch.rand(7, generator=g) + 0.5

    def f(x, t, w):
        plain = F.cross_entropy(x, t)
        weighted = F.cross_entropy(x, t, weight=w)
        grad, = torch.autograd.grad(plain + weighted, x)
        return plain, weighted, grad

    gm = make_fx(f)(logits, targets, weight)
    expected = gm(logits, targets, weight)
    assert mean_losses_as_sums(gm) == 2
    assert all(n.args[3] == 2 for n in gm.graph.nodes if n.target is torch.ops.aten.nll_loss_forward.default)
    got = gm(logits, targets, weight)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)


# -- every loss of torch.nn.functional, split over the batch ------------------------------------
# (NOTE [A mean over a split batch]: mse_loss and the other losses traced to one aten op
# gave gradients world-size times too large in every mode before the rewrite)

def _batch(n: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return dict(x=torch.randn(n, 4, generator=g), y=torch.randn(n, 4, generator=g),
                p=torch.rand(n, 4, generator=g) * 0.8 + 0.1,
                t01=(torch.rand(n, 4, generator=g) > 0.5).float(),
                sgn=torch.sign(torch.randn(n, 4, generator=g)),
                cls=torch.randint(0, 4, (n,), generator=g))


W4 = torch.linspace(0.5, 1.5, 4)


def _losses(reduction: str) -> dict:
    """name -> loss(w, batch) for every loss of torch.nn.functional that traces
    (gaussian_nll_loss checks its variance's values; ctc_loss needs sequences); the
    unreduced ones summed with weights."""
    r = reduction

    def red(out):
        return out if r != "none" else (out * torch.linspace(1, 2, out.shape[-1])).sum() \
            if out.dim() > 1 else (out * torch.linspace(1, 2, out.shape[0])).sum()

    return {
        "mse_loss": lambda w, b: red(F.mse_loss(b["x"] * w, b["y"], reduction=r)),
        "l1_loss": lambda w, b: red(F.l1_loss(b["x"] * w, b["y"], reduction=r)),
        "smooth_l1_loss": lambda w, b: red(F.smooth_l1_loss(b["x"] * w, b["y"], reduction=r, beta=0.5)),
        "huber_loss": lambda w, b: red(F.huber_loss(b["x"] * w, b["y"], reduction=r, delta=0.5)),
        "binary_cross_entropy": lambda w, b: red(F.binary_cross_entropy(
            torch.sigmoid(b["x"] * w), b["t01"], weight=torch.linspace(0.5, 2, 4), reduction=r)),
        "binary_cross_entropy_with_logits": lambda w, b: red(F.binary_cross_entropy_with_logits(
            b["x"] * w, b["t01"], pos_weight=torch.full((4,), 2.0), reduction=r)),
        "soft_margin_loss": lambda w, b: red(F.soft_margin_loss(b["x"] * w, b["sgn"], reduction=r)),
        "kl_div": lambda w, b: red(F.kl_div(F.log_softmax(b["x"] * w, -1), F.softmax(b["y"], -1),
                                            reduction="batchmean" if r == "mean" else r)),
        "poisson_nll_loss": lambda w, b: red(F.poisson_nll_loss(b["x"] * w, b["p"], reduction=r)),
        "hinge_embedding_loss": lambda w, b: red(F.hinge_embedding_loss(b["x"] * w, b["sgn"], reduction=r)),
        "cosine_embedding_loss": lambda w, b: red(F.cosine_embedding_loss(
            b["x"] * w, b["y"], b["sgn"][:, 0], reduction=r)),
        "margin_ranking_loss": lambda w, b: red(F.margin_ranking_loss(
            (b["x"] * w)[:, 0], b["y"][:, 0], b["sgn"][:, 0], reduction=r)),
        "triplet_margin_loss": lambda w, b: red(F.triplet_margin_loss(
            b["x"] * w, b["y"], b["y"].flip(1), reduction=r)),
        "cross_entropy": lambda w, b: red(F.cross_entropy(b["x"] * w, b["cls"], reduction=r)),
        "cross_entropy_smoothed": lambda w, b: red(F.cross_entropy(
            b["x"] * w, b["cls"], label_smoothing=0.1, reduction=r)),
        "cross_entropy_probs": lambda w, b: red(F.cross_entropy(
            b["x"] * w, F.softmax(b["y"], -1), reduction=r)),
        "multi_margin_loss": lambda w, b: red(F.multi_margin_loss(
            b["x"] * w, b["cls"], weight=torch.linspace(0.5, 2, 4), reduction=r)),
        "multilabel_margin_loss": lambda w, b: red(F.multilabel_margin_loss(
            b["x"] * w, torch.where(b["t01"] > 0, b["cls"][:, None].expand(-1, 4), -1), reduction=r)),
        "multilabel_soft_margin_loss": lambda w, b: red(F.multilabel_soft_margin_loss(
            b["x"] * w, b["t01"], reduction=r)),
        "logsigmoid (a DPO-style loss)": lambda w, b: red(-F.logsigmoid(
            (b["x"] * w)[:, 0] - (b["x"] * w)[:, 1])) if r == "none" else
            -F.logsigmoid((b["x"] * w)[:, 0] - (b["x"] * w)[:, 1]).sum() / (1 if r == "sum" else b["x"].shape[0]),
    }


def _every_loss(ws: int, reductions: tuple) -> int:
    """On every rank: each loss's value and gradient under pjit, batch split over "dp",
    equal one device in both DataParallelMode layouts and DTensorExpandMode; returns
    the cases checked."""
    from sharded import Mesh, P, gather, shard
    from sharded.modes import DataParallelMode, DTensorExpandMode
    from transforms import pjit

    mesh = Mesh((ws,), ("dp",))
    checked = 0
    b = _batch(2 * ws)
    for r in reductions:
        for name, loss in _losses(r).items():
            gv = torch.func.grad_and_value(loss)
            for mode in (DataParallelMode("replicate"), DataParallelMode("shard"), DTensorExpandMode()):
                f = pjit(lambda w, b, gv=gv: gv(w, b), in_specs=(P(), P("dp")), mesh=mesh, mode=mode)
                (grad, value), (ref_grad, ref_value) = f(W4, b), gv(W4, b)
                where = f"{name}, reduction={r!r}, {mode!r}"
                torch.testing.assert_close(gather(value), ref_value, rtol=1e-5, atol=1e-6, msg=where)
                torch.testing.assert_close(gather(grad), ref_grad, rtol=1e-5, atol=1e-6, msg=where)
                checked += 1
    # the module style (pjit under autograd): the loss's backward op is in the backward
    # program pjit traces with the forward
    for name in ("mse_loss", "binary_cross_entropy", "huber_loss"):
        loss = _losses("mean")[name]
        f = pjit(loss, in_specs=(P(), P("dp")), out_specs=P(), mesh=mesh, mode=DataParallelMode("replicate"))
        w = shard(W4.clone(), P(), mesh).requires_grad_()
        f(w, _batch(2 * ws)).backward()
        ref = torch.func.grad(loss)(W4, _batch(2 * ws))
        torch.testing.assert_close(gather(w.grad), ref, rtol=1e-5, atol=1e-6, msg=name)
        checked += 1
    # float16 (computed in float32 and cast back) and float16 against a float32 target
    # (float32, as on one device); the DTensor's recorded dtype is its data's
    for name, loss in (("float16", lambda w, b: F.mse_loss(b["x"].half() * w, b["y"].half())),
                       ("float16 input, float32 target", lambda w, b: F.mse_loss(b["x"].half() * w, b["y"]))):
        f = pjit(loss, in_specs=(P(), P("dp")), out_specs=P(), mesh=mesh, mode=DataParallelMode("replicate"))
        w = shard(W4.half(), P(), mesh).requires_grad_()
        value = f(w, _batch(2 * ws))
        value.backward()
        ref_grad, ref = torch.func.grad_and_value(loss)(W4.half(), _batch(2 * ws))
        assert value._spec.tensor_meta.dtype == value.to_local().dtype == ref.dtype, name
        torch.testing.assert_close(gather(value), ref, msg=name)
        torch.testing.assert_close(gather(w.grad), ref_grad, msg=name)
        checked += 1
    return checked


@pytest.mark.parametrize("ws", [2, 4])
def test_every_loss_equals_one_device_split_over_the_batch(on_ranks, ws):
    """(Checked on the ranks.) ws 2: every loss, mean and sum; ws 4: the means."""
    reductions = ("mean", "sum", "none") if ws == 2 else ("mean",)
    checked = on_ranks(ws, _every_loss, ws, reductions)
    assert checked == [len(_losses("mean")) * 3 * len(reductions) + 5] * ws


# -- the rewrite on one device --------------------------------------------------------------

def _reduction(n):
    at = [a.name for a in n.target._schema.arguments].index("reduction")
    return n.args[at] if len(n.args) > at else n.kwargs.get("reduction", MEAN)


def test_counted_losses_keep_their_values_and_gradients():
    """Each op of the tables, its reduction passed or defaulted, and in
    float16 (computed in float32: a Sum may overflow where the mean does not)."""
    b = _batch(6)

    def f(x, b):
        return (F.mse_loss(x, b["y"]) + F.smooth_l1_loss(x, b["y"], beta=0.5)
                + F.huber_loss(x, b["y"], delta=0.5) + F.soft_margin_loss(x, b["sgn"])
                + F.binary_cross_entropy(torch.sigmoid(x), b["t01"])
                + F.multi_margin_loss(x, b["cls"]) + F.multilabel_margin_loss(x, b["cls"][:, None].expand(6, 4)))

    def f_kw(x, b):                      # a Sum stays a Sum (make_fx passes it by position)
        return (torch.ops.aten.mse_loss.default(x, b["y"], reduction=1)
                + torch.ops.aten.huber_loss.default(x, b["y"], reduction=2, delta=0.5))

    def logits_only(x, b):               # no grad: binary_cross_entropy_with_logits stays one op
        return F.binary_cross_entropy_with_logits(x, b["t01"])

    for fn, n_ops in ((torch.func.grad_and_value(f), 14), (torch.func.grad_and_value(f_kw), 2),
                      (logits_only, 1)):
        gm = make_fx(fn)(b["x"], b)
        expected = gm(b["x"], b)
        assert mean_losses_as_sums(gm) == n_ops
        assert not [n for n in gm.graph.nodes if n.target in COUNTED_OPS and _reduction(n) == MEAN]
        torch.testing.assert_close(gm(b["x"], b), expected)

    mixed = make_fx(lambda x, y: F.mse_loss(x.half(), y))(b["x"], b["y"])   # float32, as torch
    expected = mixed(b["x"], b["y"])
    assert mean_losses_as_sums(mixed) == 1
    got = mixed(b["x"], b["y"])
    assert got.dtype == expected.dtype == torch.float32
    torch.testing.assert_close(got, expected)

    x16 = (torch.ones(300, 256) * 16).half()
    y16 = torch.zeros(300, 256).half()      # the squared errors' sum, 256 * 76800, is no float16
    gm = make_fx(torch.func.grad_and_value(lambda x, y: F.mse_loss(x, y)))(x16, y16)
    expected = gm(x16, y16)
    assert mean_losses_as_sums(gm) == 2
    got = gm(x16, y16)
    assert got[1].dtype == got[0].dtype == torch.float16
    torch.testing.assert_close(got, expected)
    assert torch.isfinite(got[1]) and float(got[1]) == 256.0

    # a float16 cross-entropy: its total weight, computed in float32, goes back to
    # float16 for the backward's nll_loss_backward (which reads it as its own dtype)
    logits16 = b["x"].half()
    gm = make_fx(torch.func.grad_and_value(lambda x, t: F.cross_entropy(x, t, weight=torch.ones(4).half())))(
        logits16, b["cls"])
    expected = gm(logits16, b["cls"])
    assert mean_losses_as_sums(gm) == 1
    got = gm(logits16, b["cls"])
    assert got[0].dtype == got[1].dtype == torch.float16
    torch.testing.assert_close(got, expected)


def test_every_op_with_a_mean_reduction_is_known():
    """Every aten op with a ``reduction`` argument that survives tracing (not
    CompositeImplicitAutograd, which traces to its parts) is rewritten or divides by a
    global count already: a loss op torch adds later fails here, not silently."""
    known = {op.name() for op in COUNTED_OPS + MEAN_IS_GLOBAL}
    unknown = []
    for s in torch._C._jit_get_all_schemas():
        if not s.name.startswith("aten::") or "reduction" not in [a.name for a in s.arguments]:
            continue
        name = s.name + (f".{s.overload_name}" if s.overload_name else "")
        if s.overload_name in ("out", "output", "grad_input") or torch._C._dispatch_has_kernel_for_dispatch_key(
                name, torch._C.DispatchKey.CompositeImplicitAutograd):
            continue
        if name not in known and f"{name}.default" not in known and s.name not in known:
            unknown.append(name)
    assert not unknown, unknown
