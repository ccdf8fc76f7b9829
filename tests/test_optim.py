"""The pure-functional optimizers match torch.optim step for step."""

import torch

from sharded.optim import adamw, adamw_init, sgd, sgd_init


def _problem():
    g = torch.Generator().manual_seed(0)
    params = {"a": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g)}
    grads = [{k: torch.randn(v.shape, generator=g) for k, v in params.items()} for _ in range(3)]
    return params, grads


def _reference(opt_cls, params, grads, **kw):
    ps = {k: v.clone().requires_grad_() for k, v in params.items()}
    opt = opt_cls(ps.values(), foreach=False, **kw)
    for g in grads:
        for k in ps:
            ps[k].grad = g[k].clone()
        opt.step()
    return {k: v.detach() for k, v in ps.items()}


def test_adamw_matches_torch():
    params, grads = _problem()
    ref = _reference(torch.optim.AdamW, params, grads, lr=1e-2, weight_decay=0.1)
    state = adamw_init(params)
    for g in grads:
        params, state = adamw(params, g, state, lr=1e-2, weight_decay=0.1)
    torch.testing.assert_close(params, ref)


def test_sgd_momentum_matches_torch():
    params, grads = _problem()
    ref = _reference(torch.optim.SGD, params, grads, lr=0.1, momentum=0.9, weight_decay=0.01)
    state = sgd_init(params)
    for g in grads:
        params, state = sgd(params, g, state, lr=0.1, momentum=0.9, weight_decay=0.01)
    torch.testing.assert_close(params, ref)


def test_adamw_fused_and_foreach_paths_both_match_torch():
    """One dtype: torch's fused kernel; mixed dtypes: the foreach ops. Both follow
    torch.optim.AdamW."""
    from sharded import optim

    params, grads = _problem()
    mixed = {"a": params["a"], "b": params["b"].double()}
    mixed_grads = [{"a": g["a"], "b": g["b"].double()} for g in grads]
    assert optim._fusable(list(params.values())) and not optim._fusable(list(mixed.values()))
    ref = _reference(torch.optim.AdamW, mixed, mixed_grads, lr=1e-2, weight_decay=0.1)
    state = adamw_init(mixed)
    for g in mixed_grads:
        mixed, state = adamw(mixed, g, state, lr=1e-2, weight_decay=0.1)
    torch.testing.assert_close(mixed, ref)


def test_adamw_on_eager_dtensors_matches_torch():
    """Eager DTensor params (as a user stepping outside pjit would have): the foreach
    path, since DTensor's strategy for the functional fused kernel is broken in torch
    2.13 (it once raised "Tensor meta for aten._fused_adamw.default should be a
    list[TensorMeta]")."""
    from sharded import Mesh, P, optim, shard

    mesh = Mesh((1,), ("dp",))
    params, grads = _problem()
    ref = _reference(torch.optim.AdamW, params, grads, lr=1e-2, weight_decay=0.1)
    dparams = shard(params, {"a": P("dp"), "b": P()}, mesh)
    assert not optim._fusable(list(dparams.values()))
    state = adamw_init(dparams)
    for g in grads:
        dparams, state = adamw(dparams, shard(g, {"a": P("dp"), "b": P()}, mesh), state,
                               lr=1e-2, weight_decay=0.1)
    torch.testing.assert_close({k: v.full_tensor() for k, v in dparams.items()}, ref)


def test_adamw_step_count_lives_with_the_params():
    """torch's fused CUDA kernel reads the step count on the parameters' device."""
    params = {"w": torch.ones(3, device="meta"), "b": torch.ones(2, device="meta")}
    assert adamw_init(params)["step"].device == torch.device("meta")
    assert adamw_init({"w": torch.ones(3)})["step"].device == torch.device("cpu")
