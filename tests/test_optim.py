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
