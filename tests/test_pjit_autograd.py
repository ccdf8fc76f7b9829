"""pjit under autograd on real gloo ranks: ``loss.backward()``, ``torch.autograd.grad``
and torch.func (``grad``, ``vjp``, ``jacrev``) through a pjit'd function give the
single-device gradients, laid out like the inputs, from a backward program traced once
with the forward (NOTE [pjit under autograd] in sharded/_autograd.py)."""

from __future__ import annotations

import optree
import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate

from examples import gpt
from sharded import Mesh, P, gather, shard, spec_of
from sharded import random as srandom
from sharded.modes import DataParallelMode
from tests import test_data_parallel as dpm
from tests.models import (ATTN_SHAPES, ATTN_TP, MLP_SHAPES, MLP_TP, attn_loss_matmul, init,
                          mlp_loss, specs_of)
from transforms import pjit


def _batch(seed=1, n=8, d=8, classes=4):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g), torch.randint(0, classes, (n,), generator=g)


def _leaves(params, specs, mesh):
    """DTensor params that require grad (their own storage)."""
    return optree.tree_map(lambda v: v.requires_grad_(),
                           shard(optree.tree_map(torch.clone, params), specs, mesh))


def _ref_grads(loss, params, *batch):
    ref = optree.tree_map(lambda v: v.clone().requires_grad_(), params)
    out = loss(ref, *batch)
    out.backward()
    return out.detach(), optree.tree_map(lambda v: v.grad, ref)


def _check_backward(mesh, loss, params, pspecs, batch, bspecs, mode=None, calls=2, layout=None):
    """``loss.backward()`` through pjit: loss and ``.grad`` equal the single-device
    ones, each gradient laid out like its parameter (laid out as ``layout``, default
    ``pspecs``); one trace for every call. Returns the backward program's collectives."""
    f = pjit(loss, in_specs=(pspecs, *bspecs), out_specs=P(), mesh=mesh, mode=mode)
    dist_params = _leaves(params, pspecs if layout is None else layout, mesh)
    ref_loss, ref = _ref_grads(loss, params, *batch)
    for _ in range(calls):
        for v in optree.tree_leaves(dist_params):
            v.grad = None
        out = f(dist_params, *batch)
        assert out.requires_grad and out.grad_fn is not None
        out.backward()
    torch.testing.assert_close(gather(out.detach()), ref_loss, rtol=1e-5, atol=1e-5)
    paths, leaves, _ = optree.tree_flatten_with_path(dist_params)
    for k, v, r in zip(paths, leaves, optree.tree_leaves(ref)):
        assert isinstance(v.grad, DTensor), k
        assert v.grad.placements == v.placements, (k, v.grad.placements, v.placements)
        torch.testing.assert_close(v.grad.full_tensor(), r, rtol=1e-4, atol=1e-5)
    assert f.trace_count == 1, f.trace_count
    low = f.lower(dist_params, *batch)
    assert low.backward is not None
    return [(c.kind, c.axis) for c in low.backward.collectives()]


# -- rank-side bodies ----------------------------------------------------------------------

def _backward_1d(ws):
    out = {}
    x, y = _batch()
    params = init(0, MLP_SHAPES)
    dp = Mesh((ws,), ("dp",))
    out["dp"] = _check_backward(dp, mlp_loss, params, P(), (x, y), (P("dp"), P("dp")))
    tp = Mesh((ws,), ("tp",))
    out["tp"] = _check_backward(tp, mlp_loss, params, specs_of(MLP_TP), (x, y), (P(), P()))

    # torch.autograd.grad, with a plain input that requires grad too: its gradient is
    # the full tensor on every rank (a plain input is the same value everywhere)
    aparams = init(5, ATTN_SHAPES)
    xa = torch.randn(4, 6, 16, generator=torch.Generator().manual_seed(6))
    f = pjit(attn_loss_matmul, in_specs=(specs_of(ATTN_TP), P()), out_specs=P(), mesh=tp)
    dist_params = _leaves(aparams, specs_of(ATTN_TP), tp)
    xg = xa.clone().requires_grad_()
    grads = torch.autograd.grad(f(dist_params, xg), [dist_params["wq"], dist_params["wo"], xg])
    ref = {k: v.clone().requires_grad_() for k, v in aparams.items()}
    xr = xa.clone().requires_grad_()
    ref_grads = torch.autograd.grad(attn_loss_matmul(ref, xr), [ref["wq"], ref["wo"], xr])
    assert spec_of(grads[0]) == P("tp") and spec_of(grads[1]) == P(None, "tp")
    assert type(grads[2]) is torch.Tensor
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g.full_tensor() if isinstance(g, DTensor) else g, r,
                                   rtol=1e-4, atol=1e-5)

    # DataParallelMode, both layouts: the backward program classifies its inputs as
    # the forward did (residual activations are batch, saved parameters state)
    dparams = dpm.init()
    ids, targets = dpm.batch()
    for sharding in ("replicate", "shard"):
        out[sharding] = _check_backward(dp, dpm.loss_fn, dparams, P(), (ids, targets),
                                        (P("dp"), P("dp")), mode=DataParallelMode(sharding))
    # FSDP-style parameters, laid out as the mode lays out state (their in_specs do
    # not name "dp": they are not the batch): gradients come back sharded like them
    fsdp = {k: P("dp") if v.shape[0] % ws == 0 else P() for k, v in dparams.items()}
    out["shard-fsdp-params"] = _check_backward(dp, dpm.loss_fn, dparams, P(), (ids, targets),
                                               (P("dp"), P("dp")), mode=DataParallelMode("shard"),
                                               layout=fsdp)
    return out


def _backward_2x2():
    mesh = Mesh((2, 2), ("dp", "tp"))
    x, y = _batch()
    out = {"mlp": _check_backward(mesh, mlp_loss, init(0, MLP_SHAPES), specs_of(MLP_TP), (x, y),
                                  (P("dp"), P("dp")))}
    xa = torch.randn(4, 6, 16, generator=torch.Generator().manual_seed(6))
    out["attn"] = _check_backward(mesh, attn_loss_matmul, init(5, ATTN_SHAPES), specs_of(ATTN_TP),
                                  (xa,), (P("dp"),))
    # GPT with SDPA (its output is [b, s, h, d] in memory: the view after its
    # transpose relies on those strides, so it is not recomputed in the backward)
    import sharded.rules  # noqa: F401  (SDPA sharding rules)

    gparams = gpt.init_params(_GPT)
    ids, tgt = gpt.batch(_GPT, 4)
    out["gpt"] = _check_backward(mesh, _gpt_loss, gparams, gpt.tp_specs(gparams), (ids, tgt),
                                 (P("dp"), P("dp")), calls=1)
    return out


_GPT = gpt.tiny(n_layers=1, d_model=16, n_heads=2, vocab=32, seq=8)


def _gpt_loss(p, ids, tgt):
    return gpt.loss_fn(p, ids, tgt, _GPT)


def _adamw_loop(mesh_shape, names, tp, steps=5):
    """torch.optim.AdamW on DTensor params with pjit forward+backward equals the same
    loop on one device, step for step."""
    mesh = Mesh(mesh_shape, names)
    pspecs = specs_of(MLP_TP) if tp else P()
    bspec = P("dp") if "dp" in names else P()
    params = init(0, MLP_SHAPES)
    f = pjit(mlp_loss, in_specs=(pspecs, bspec, bspec), out_specs=P(), mesh=mesh)
    dist_params = _leaves(params, pspecs, mesh)
    ref = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    opt = torch.optim.AdamW(dist_params.values(), lr=1e-2, weight_decay=1e-2)
    ref_opt = torch.optim.AdamW(ref.values(), lr=1e-2, weight_decay=1e-2)
    for i in range(steps):
        x, y = _batch(seed=10 + i)
        opt.zero_grad()
        loss = f(dist_params, x, y)
        loss.backward()
        opt.step()
        ref_opt.zero_grad()
        ref_loss = mlp_loss(ref, x, y)
        ref_loss.backward()
        ref_opt.step()
        torch.testing.assert_close(gather(loss.detach()), ref_loss.detach(), rtol=1e-5, atol=1e-5)
    for k, v in dist_params.items():
        assert v.placements == (shard(params[k], pspecs[k] if tp else P(), mesh)).placements
        torch.testing.assert_close(v.detach().full_tensor(), ref[k].detach(), rtol=1e-4, atol=1e-5)
    assert f.trace_count == 1
    return True


def _dropout_loss(p, x, y):
    h = F.dropout(torch.relu(F.linear(x, p["w1"], p["b1"])), 0.5)
    return F.cross_entropy(F.linear(h, p["w2"], p["b2"]), y)


def _second_order_autograd(f, mesh, leaves, x, y):
    (g,) = torch.autograd.grad(f(leaves, x, y), [leaves["b1"]], create_graph=True)
    (g * shard(torch.arange(16.0), P(), mesh)).sum().backward()


def _func_transforms(ws):
    mesh = Mesh((ws,), ("dp",))
    params = init(0, MLP_SHAPES)
    x, y = _batch()
    f = pjit(mlp_loss, in_specs=(P(), P("dp"), P("dp")), out_specs=P(), mesh=mesh)
    ref = torch.func.grad(lambda p: mlp_loss(p, x, y))(params)
    for _ in range(3):     # grad(jit(f)): plain params in, plain gradients out
        got = torch.func.grad(lambda p: f(p, x, y))(params)
        for k in params:
            assert type(got[k]) is torch.Tensor
            torch.testing.assert_close(got[k], ref[k], rtol=1e-4, atol=1e-5)
    assert f.trace_count == 1, f.trace_count
    # the form: DTensor params, gradients laid out like them
    dist_params = shard({k: v.clone() for k, v in params.items()}, P(), mesh)
    got = torch.func.grad(lambda p: f(p, x, y))(dist_params)
    for k in params:
        assert isinstance(got[k], DTensor) and got[k].placements == (Replicate(),)
        torch.testing.assert_close(got[k].full_tensor(), ref[k], rtol=1e-4, atol=1e-5)
    # vjp of a vector-valued function (per-example losses, split over "dp")
    per_ex = pjit(lambda p, x, y: F.cross_entropy(F.linear(torch.relu(F.linear(x, p["w1"], p["b1"])),
                                                           p["w2"], p["b2"]), y, reduction="none"),
                  in_specs=(P(), P("dp"), P("dp")), out_specs=P("dp"), mesh=mesh)
    plain = lambda p: F.cross_entropy(F.linear(torch.relu(F.linear(x, p["w1"], p["b1"])),  # noqa: E731
                                               p["w2"], p["b2"]), y, reduction="none")
    ct = torch.linspace(0.5, 1.5, 8)
    out, vjp_fn = torch.func.vjp(lambda p: per_ex(p, x, y), params)
    ref_out, ref_vjp = torch.func.vjp(plain, params)
    torch.testing.assert_close(gather(out), ref_out)
    (got,), (want,) = vjp_fn(ct), ref_vjp(ct)
    for k in params:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-5)
    # jacrev (vmap over the backward): the jacobian of the per-example losses
    jac = torch.func.jacrev(lambda b1: per_ex({**params, "b1": b1}, x, y))(params["b1"])
    ref_jac = torch.func.jacrev(lambda b1: plain({**params, "b1": b1}))(params["b1"])
    torch.testing.assert_close(gather(jac) if isinstance(jac, DTensor) else jac, ref_jac,
                               rtol=1e-4, atol=1e-5)

    # random draws: the backward reads the forward's draws. Gradients through pjit
    # equal the gradients taken inside pjit with the same random state.
    drop = pjit(_dropout_loss, in_specs=(P(), P("dp"), P("dp")), out_specs=P(), mesh=mesh)
    inside = pjit(torch.func.grad(_dropout_loss), in_specs=(P(), P("dp"), P("dp")), mesh=mesh)
    srandom.manual_seed(7)
    want = gather(inside(params, x, y))
    srandom.manual_seed(7)
    got = torch.func.grad(lambda p: drop(p, x, y))(params)
    srandom.manual_seed(7)
    leaves = _leaves(params, P(), mesh)
    drop(leaves, x, y).backward()
    for k in params:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(leaves[k].grad.full_tensor(), want[k], rtol=1e-5, atol=1e-6)

    errors = {}
    for name, call in {
        "vmap": lambda: torch.func.vmap(lambda xx: f(params, xx, y))(torch.stack([x, x])),
        # (a weighted sum: the plain sum of d loss / d b2 is identically zero, so a
        # silently zero second derivative would pass for the right one)
        "second_order": lambda: torch.func.grad(
            lambda w: (torch.func.grad(lambda p: f(p, x, y))({**params, "w1": w})["b1"]
                       * torch.arange(16.0)).sum()
        )(params["w1"]),
        "create_graph": lambda: _second_order_autograd(f, mesh, _leaves(params, P(), mesh), x, y),
        "jvp": lambda: torch.func.jvp(lambda b: f({**params, "b2": b}, x, y), (params["b2"],),
                                      (torch.ones(4),)),
    }.items():
        try:
            call()
            errors[name] = None
        except Exception as e:  # noqa: BLE001 - the tests check type and message
            errors[name] = (type(e).__name__, str(e))
    return errors


# -- tests -------------------------------------------------------------------------------------

@pytest.mark.parametrize("ws", [2, 4])
def test_backward_equals_single_device(on_ranks, ws):
    """DP, Megatron TP, torch.autograd.grad with a plain input, DataParallelMode in
    both layouts: gradients equal, laid out like the params."""
    colls = on_ranks(ws, _backward_1d, ws)[0]
    # a replicated parameter's gradient is reduced once: one bucket of all-reduces
    # over "dp" for the whole backward, none for Megatron's parameter gradients
    assert colls["dp"] == [("all_reduce", "dp")], colls["dp"]
    assert colls["tp"] == [], colls["tp"]
    assert colls["replicate"] == [("all_reduce", "dp")], colls["replicate"]
    kinds = {k for k, _ in colls["shard"]}
    assert "reduce_scatter" in kinds, colls["shard"]


def test_backward_2x2_mesh(on_ranks):
    colls = on_ranks(4, _backward_2x2)[0]
    assert all(axis in ("dp", "tp") for _, axis in colls["mlp"] + colls["attn"])


@pytest.mark.parametrize("ws,mesh_shape,names,tp", [
    (2, (2,), ("dp",), False),
    (4, (2, 2), ("dp", "tp"), True),
])
def test_torch_optim_adamw_loop(on_ranks, ws, mesh_shape, names, tp):
    assert all(on_ranks(ws, _adamw_loop, mesh_shape, names, tp))


@pytest.mark.parametrize("ws", [2, 4])
def test_torch_func_transforms(on_ranks, ws):
    for errors in on_ranks(ws, _func_transforms, ws):
        kind, msg = errors["vmap"]
        assert kind == "TypeError" and "was called inside torch.func.vmap" in msg, msg
        for case in ("second_order", "create_graph"):    # never a silent zero
            assert errors[case] is not None, case
            kind, msg = errors[case]
            assert kind == "NotImplementedError" and "higher-order gradients" in msg, msg
        kind, msg = errors["jvp"]
        assert kind == "NotImplementedError" and "forward-mode" in msg, msg


def test_no_grad_path_unchanged():
    """Without inputs that require grad, the program has no backward and its
    outputs no history (one process, a 1-rank mesh)."""
    mesh = Mesh((1,), ("dp",))
    f = pjit(mlp_loss, in_specs=(P(), P("dp"), P("dp")), out_specs=P(), mesh=mesh)
    params = init(0, MLP_SHAPES)
    x, y = _batch()
    out = f(params, x, y)
    assert out.grad_fn is None and not out.requires_grad
    assert f.lower(params, x, y).backward is None
    with torch.no_grad():
        out = f({k: v.clone().requires_grad_() for k, v in params.items()}, x, y)
    assert out.grad_fn is None
    assert f.trace_count == 1
