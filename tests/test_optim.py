"""The pure-functional optimizers match torch.optim step for step."""

import torch

from sharded.optim import adamw, adamw_init, sgd, sgd_init


def _problem():
    g = torch.Generator().manual_seed(0)
    params = {"a": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g)}
    grads = [{k: torch.randn(v.shape, generator=g) for k, v in params.items()} for _ in range(3)]
    return params, grads


def _reference(opt_cls, params, grads, decayed=None, **kw):
    """torch.optim's steps on ``grads``; with ``decayed``, two param groups: weight
    decay on those leaves only."""
    ps = {k: v.clone().requires_grad_() for k, v in params.items()}
    groups = list(ps.values())
    if decayed is not None:
        wd = kw.pop("weight_decay")
        groups = [{"params": [ps[k] for k in ps if k in decayed], "weight_decay": wd},
                  {"params": [ps[k] for k in ps if k not in decayed], "weight_decay": 0.0}]
    opt = opt_cls(groups, foreach=False, **kw)
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


# -- schedules -------------------------------------------------------------------------------

def test_schedules_follow_optax():
    """optax's formulas and argument meanings (optax/schedules/_schedule.py), at ints
    and at 0-d tensors, in float64."""
    import math

    from sharded import optim

    lin = optim.linear_schedule(1.0, 0.01, transition_steps=100, transition_begin=5)
    for k, want in ((0, 1.0), (5, 1.0), (6, 1.0 - 0.99 / 100), (105, 0.01), (110, 0.01)):
        assert math.isclose(float(lin(k)), want, rel_tol=1e-12), k
    cos = optim.cosine_decay_schedule(2.0, decay_steps=10, alpha=0.1)
    for k in (0, 3, 10, 20):
        t = min(k, 10)
        want = 2.0 * ((1 - 0.1) * 0.5 * (1 + math.cos(math.pi * t / 10)) + 0.1)
        assert math.isclose(float(cos(k)), want, rel_tol=1e-12), k
    wc = optim.warmup_cosine_decay_schedule(0.0, 1.0, warmup_steps=4, decay_steps=14, end_value=0.1)
    assert [float(wc(k)) for k in range(5)] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert math.isclose(float(wc(9)), 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 5 / 10)), rel_tol=1e-12)
    assert math.isclose(float(wc(14)), 0.1) and math.isclose(float(wc(1000)), 0.1)
    assert float(optim.constant_schedule(3e-4)(7)) == 3e-4
    step = torch.tensor(2.0)       # adamw_init's step count
    assert wc(step).dtype == torch.float64 and float(wc(step)) == 0.5
    assert float(optim.linear_schedule(1.0, 0.0, 0)(5)) == 1.0     # no transition: constant


def test_schedule_errors_name_the_schedule():
    import pytest

    from sharded import optim

    with pytest.raises(ValueError, match="cosine_decay_schedule: decay_steps must be an int >= 1; got 0"):
        optim.cosine_decay_schedule(1.0, 0)
    with pytest.raises(ValueError, match="warmup_cosine_decay_schedule: decay_steps counts the warmup"):
        optim.warmup_cosine_decay_schedule(0.0, 1.0, warmup_steps=10, decay_steps=10)
    with pytest.raises(TypeError, match="a schedule takes the step count"):
        optim.constant_schedule(1.0)("3")


# -- traced hyperparameters ----------------------------------------------------------------------

def test_tensor_lr_keeps_the_fused_kernel_and_its_numerics():
    """A float64 lr tensor on CPU: the fused kernel's tensor-lr overload, bitwise the
    float lr; a schedule as lr is called with the step count."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from sharded import optim

    params, grads = _problem()
    sched = optim.linear_schedule(1e-2, 1e-3, 3)
    a, sa = params, adamw_init(params)
    b, sb = params, adamw_init(params)
    c, sc = params, adamw_init(params)
    for k, g in enumerate(grads):
        a, sa = adamw(a, g, sa, lr=float(sched(k)), weight_decay=0.1)
        b, sb = adamw(b, g, sb, lr=torch.tensor(float(sched(k)), dtype=torch.float64), weight_decay=0.1)
        c, sc = adamw(c, g, sc, lr=sched, weight_decay=0.1)
    torch.testing.assert_close(b, a, rtol=0, atol=0)
    torch.testing.assert_close(c, a, rtol=0, atol=0)
    gm = make_fx(lambda p, g, s, lr: adamw(p, g, s, lr=lr))(params, grads[0], adamw_init(params),
                                                           torch.tensor(1e-3))
    targets = {n.target for n in gm.graph.nodes}
    assert torch.ops.aten._fused_adamw.tensor_lr in targets
    assert torch.ops.aten._fused_adamw.default not in targets


def test_tensor_betas_and_weight_decay_take_the_foreach_ops():
    """Tensor betas and weight decay: the foreach ops (the fused kernel takes floats
    there), equal to torch.optim.AdamW."""
    params, grads = _problem()
    ref = _reference(torch.optim.AdamW, params, grads, lr=1e-2, betas=(0.8, 0.99), weight_decay=0.1)
    state = adamw_init(params)
    for g in grads:
        params, state = adamw(params, g, state, lr=torch.tensor(1e-2),
                              betas=(torch.tensor(0.8), torch.tensor(0.99)),
                              weight_decay=torch.tensor(0.1))
    torch.testing.assert_close(params, ref)


def test_sgd_takes_tensor_lr_and_weight_decay():
    params, grads = _problem()
    ref = _reference(torch.optim.SGD, params, grads, lr=0.1, momentum=0.9, weight_decay=0.01)
    state = sgd_init(params)
    for g in grads:
        params, state = sgd(params, g, state, lr=torch.tensor(0.1), momentum=0.9,
                            weight_decay=torch.tensor(0.01))
    torch.testing.assert_close(params, ref)


# -- weight-decay masks ----------------------------------------------------------------------------

def test_weight_decay_masks_match_two_param_groups():
    """A predicate on (dotted path, leaf) and a pytree of bools pick the same leaves;
    fused kernel (one dtype) and foreach ops (tensor weight decay) both equal
    torch.optim.AdamW with a decay group and a no-decay group."""
    g = torch.Generator().manual_seed(1)
    params = {"blocks": [{"w": torch.randn(4, 3, generator=g), "ln": torch.randn(3, generator=g)}],
              "head": torch.randn(2, 4, generator=g), "bias": torch.randn(2, generator=g)}
    flat = {"blocks.0.w": params["blocks"][0]["w"], "blocks.0.ln": params["blocks"][0]["ln"],
            "head": params["head"], "bias": params["bias"]}
    steps = [optree_like(params, g) for _ in range(3)]
    ref = _reference(torch.optim.AdamW, flat, [_flatten(s) for s in steps],
                     {"blocks.0.w", "head"}, lr=1e-2, weight_decay=0.3)
    seen = []

    def predicate(name, p):
        seen.append(name)
        return p.ndim >= 2

    bools = {"blocks": [{"w": True, "ln": False}], "head": True, "bias": False}
    for mask, wd in ((predicate, 0.3), (bools, 0.3), (bools, torch.tensor(0.3))):
        p, s = params, adamw_init(params)
        for gr in steps:
            p, s = adamw(p, gr, s, lr=1e-2, weight_decay=wd, mask=mask)
        torch.testing.assert_close(_flatten(p), ref)
    assert seen[:4] == ["bias", "blocks.0.ln", "blocks.0.w", "head"]    # optree's key order
    sgd_ref = _reference(torch.optim.SGD, flat, [_flatten(s) for s in steps],
                         {"blocks.0.w", "head"}, lr=0.1, weight_decay=0.3)
    p = params
    for gr in steps:
        p, _ = sgd(p, gr, lr=0.1, weight_decay=0.3, mask=predicate)
    torch.testing.assert_close(_flatten(p), sgd_ref)


def optree_like(params, g):
    import optree

    return optree.tree_map(lambda t: torch.randn(t.shape, generator=g), params)


def _flatten(tree) -> dict:
    import optree

    paths, leaves, _ = optree.tree_flatten_with_path(tree)
    return {".".join(map(str, p)): v for p, v in zip(paths, leaves)}


def test_mask_errors_name_the_path_and_the_fix():
    import pytest

    params, grads = _problem()
    state = adamw_init(params)
    with pytest.raises(TypeError, match=r"adamw: mask\['b'\] is 1; each entry must be a bool"):
        adamw(params, grads[0], state, mask={"a": True, "b": 1})
    with pytest.raises(ValueError, match="adamw: mask must be a pytree of bools with the structure"):
        adamw(params, grads[0], state, mask={"a": True})
    with pytest.raises(TypeError, match=r"adamw: mask\('a', leaf\) returned None"):
        adamw(params, grads[0], state, mask=lambda name, p: None)


# -- clipping ----------------------------------------------------------------------------------------

def test_clip_by_global_norm_matches_clip_grad_norm_():
    """Clipping (norm above max_norm) and not (below): the norm and the gradients
    equal torch.nn.utils.clip_grad_norm_'s."""
    from sharded import optim

    params, grads = _problem()
    for max_norm in (0.5, 100.0):
        ps = [v.clone().requires_grad_() for v in params.values()]
        for p, k in zip(ps, params):
            p.grad = grads[0][k].clone()
        ref_norm = torch.nn.utils.clip_grad_norm_(ps, max_norm)
        clipped, norm = optim.clip_by_global_norm(grads[0], max_norm)
        torch.testing.assert_close(norm, ref_norm)
        torch.testing.assert_close(clipped, {k: p.grad for k, p in zip(params, ps)})
    assert float(norm) < 100.0 < float("inf")


def test_clip_by_global_norm_rejects_a_non_positive_max_norm():
    import pytest

    from sharded import optim

    _, grads = _problem()
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match=r"clip_by_global_norm: max_norm must be a positive number; "
                                             r"got .*\. Pass the largest gradient norm"):
            optim.clip_by_global_norm(grads[0], bad)


# -- accumulation -------------------------------------------------------------------------------------

def test_accumulate_equals_the_whole_batch():
    """The mean over micro-batches of a mean loss's gradients and values is the whole
    batch's, for 1, 2 and 4 micro-batches; non-tensor leaves pass through."""
    from sharded import optim

    params, _ = _problem()
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(8, 3, generator=g), torch.randn(8, 4, generator=g)

    def loss(p, x, y, scale):
        return scale * torch.nn.functional.mse_loss(torch.tanh(x @ p["a"].T) * p["b"].sum(), y)

    ref = torch.func.grad_and_value(loss)(params, x, y, 2.0)
    for n in (1, 2, 4):
        got = optim.accumulate(torch.func.grad_and_value(loss), params, x, y, 2.0, num_microbatches=n)
        torch.testing.assert_close(got, ref)


def test_accumulate_errors():
    import pytest

    from sharded import optim

    params, _ = _problem()
    fn = torch.func.grad(lambda p, x: (x @ p["a"]).sum())
    x = torch.randn(6, 4)
    with pytest.raises(ValueError, match=r"accumulate: batch\[0\] has 6 rows on dim 0, which do not "
                                         r"divide into num_microbatches=4; pick a num_microbatches"):
        optim.accumulate(fn, params, x, num_microbatches=4)
    with pytest.raises(ValueError, match="accumulate: num_microbatches must be an int >= 1; got 0"):
        optim.accumulate(fn, params, x, num_microbatches=0)


def test_adamw_with_gradients_and_params_of_any_strides_matches_torch():
    """NOTE [The fused kernel reads memory in order]: torch's CPU fused AdamW reads a
    transposed gradient (an einsum's or a permute's, as torch.func.grad returns it)
    scrambled and an expanded one (the gradient of ``w.sum()``) past its storage.
    sharded.optim's fused path equals torch.optim.AdamW (the for-loop form) on them,
    for a transposed parameter too, eagerly and traced."""
    from torch.fx.experimental.proxy_tensor import make_fx

    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(3, 4, generator=g), "s": torch.randn(4, generator=g),
              "t": torch.randn(5, 3, generator=g).t()}
    x = torch.randn(4, 5, generator=g)

    def loss(p):
        return (torch.einsum("ij,jk->ik", x.t(), p["w"].t()).pow(2).sum() + 3 * p["s"].sum()
                + (p["t"] @ torch.ones(5)).pow(2).sum())

    grads = torch.func.grad(loss)(params)
    assert not grads["w"].is_contiguous() and grads["s"].stride() == (0,), grads
    assert not params["t"].is_contiguous()
    ref = _reference(torch.optim.AdamW, params, [grads] * 3, lr=1e-2, weight_decay=0.1)

    def steps(p, grads):
        state = adamw_init(p)
        for _ in range(3):
            p, state = adamw(p, grads, state, lr=1e-2, weight_decay=0.1)
        return p

    torch.testing.assert_close(steps(params, grads), ref)
    traced = make_fx(lambda p: steps(p, torch.func.grad(loss)(p)))
    torch.testing.assert_close(traced(params)(params), ref)
