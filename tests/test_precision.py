"""Mixed precision (sharded/precision.py, docs/precision.md): DataParallelMode's
``param_dtype``/``reduce_dtype`` (FSDP2's MixedPrecisionPolicy) and the functional
``Policy`` for any mode.

- On real gloo ranks, bf16 training of the test GPT equals the same policy on one
  device (the eager ``precision.in_grad`` step): losses within bf16 tolerance, the
  fp32 master parameters' updates close; in both layouts, with either reduce dtype,
  at world sizes 2 and 4, on a 2x2 ("dp", "tp") mesh with Megatron specs, with HSDP,
  for a pjit call differentiated from outside, and with ``Policy.wrap`` under
  DTensorExpandMode and inside a shard_map body.
- The lowered programs move what the policy says: bf16 all-gathers of half the fp32
  program's bytes, gradient reductions in ``reduce_dtype`` (fp32: the fp32 program's
  bytes; None: bf16, half), as many collectives as the fp32 program (the buckets hold).
- Bad dtypes are clear errors.
"""

from __future__ import annotations

import optree
import pytest
import torch

from examples import gpt
from sharded import Mesh, P, gather, optim, precision, spec_of
from sharded.modes import DataParallelMode, DTensorExpandMode
from tests.ranks import InPlaceReductions
from transforms import pjit

BF16, F32 = torch.bfloat16, torch.float32
CFG = gpt.GPTConfig(vocab=32, d_model=16, n_heads=2, n_layers=2, seq=8)
LR = 0.5


def sgd_step(params, ids, targets):
    """A plain SGD step: the masters' update is ``LR`` times the gradient, so the
    comparison of updates is a comparison of gradients."""
    grads, loss = torch.func.grad_and_value(gpt.loss_fn)(params, ids, targets, CFG)
    return optree.tree_map(lambda p, g: p - LR * g, params, grads), loss


POLICY = precision.Policy(param_dtype=BF16)


def policy_sgd_step(params, ids, targets):
    """``sgd_step`` with the functional policy: the loss function wrapped."""
    loss_fn = POLICY.wrap(lambda p, i, t: gpt.loss_fn(p, i, t, CFG))
    grads, loss = torch.func.grad_and_value(loss_fn)(params, ids, targets)
    return optree.tree_map(lambda p, g: p - LR * g, params, grads), loss


def adamw_step(params, opt_state, ids, targets):
    return gpt.train_step(params, opt_state, ids, targets, CFG, lr=1e-2)


def _close_updates(got: dict, ref: dict, start: dict) -> float:
    """Check that the fp32 masters ``got`` and ``ref`` moved alike from ``start``:
    each element's update within 5% of the reference's, or within 2% of the step's
    largest update (bf16 gradients summed in another order differ by a few bf16
    ulps). Returns the largest difference relative to the largest update."""
    leaves = list(zip(optree.tree_leaves(got), optree.tree_leaves(ref), optree.tree_leaves(start)))
    scale = max(float((r - s).abs().max()) for _, r, s in leaves)
    worst = 0.0
    for g, r, s in leaves:
        assert g.dtype == F32 and r.dtype == F32
        torch.testing.assert_close(g - s, r - s, rtol=0.05, atol=0.02 * scale)
        worst = max(worst, float(((g - s) - (r - s)).abs().max()) / scale)
    return worst


# -- on the ranks ---------------------------------------------------------------------------

def _train(mesh_shape, names, mode, step_fn=sgd_step, tp=False, steps=3, batch_spec=P("dp")):
    """``steps`` SGD steps under pjit against the eager single-device step with the
    same policy (``precision.in_grad``, or the step's own ``Policy.wrap``)."""
    mesh = Mesh(mesh_shape, names)
    p0 = gpt.init_params(CFG, 0)
    ps = gpt.tp_specs(p0) if tp else P()
    step = pjit(step_fn, in_specs=(ps, batch_spec, batch_spec), mesh=mesh, mode=mode)
    ref = step_fn if step_fn is policy_sgd_step else precision.in_grad(step_fn, BF16)
    ids, targets = gpt.batch(CFG, 8, seed=1)
    p, rp = p0, p0
    losses = []
    watch = InPlaceReductions()
    for k in range(steps):
        with watch.on_call(k):
            p, loss = step(p, ids, targets)
        rp, ref_loss = ref(rp, ids, targets)
        assert loss.dtype == BF16 and ref_loss.dtype == BF16
        # one bf16 ulp at the loss's magnitude (the ranks sum their halves of the batch)
        torch.testing.assert_close(gather(loss).float(), ref_loss.float(), rtol=1e-2, atol=1e-2)
        losses.append(float(gather(loss)))
    worst = _close_updates(gather(p), rp, p0)
    assert losses[-1] < losses[0]
    watch.check()
    low = step.lower(p, ids, targets)
    return {"worst": worst, "specs": {k: spec_of(v) for k, v in p.items() if k != "blocks"},
            "collectives": sorted({(c.kind, str(c.dtype)) for c in low.collectives()}),
            "by_axis": sorted({(c.kind, str(c.axis), str(c.dtype)) for c in low.collectives()})}


def _adamw_sharded():
    """AdamW under "shard" + bf16: the masters and the moments stay fp32 and sharded;
    the losses equal the single-device step with the same policy."""
    mesh = Mesh((2,), ("dp",))
    mode = DataParallelMode("shard", param_dtype=BF16, reduce_dtype=F32)
    step = pjit(adamw_step, in_specs=(P(), P(), P("dp"), P("dp")), mesh=mesh, mode=mode)
    ref = precision.in_grad(adamw_step, BF16)
    p = rp = gpt.init_params(CFG, 0)
    o = ro = optim.adamw_init(p)
    ids, targets = gpt.batch(CFG, 8, seed=1)
    p0 = p
    for _ in range(2):
        p, o, loss = step(p, o, ids, targets)
        rp, ro, ref_loss = ref(rp, ro, ids, targets)
        torch.testing.assert_close(gather(loss).float(), ref_loss.float(), rtol=1e-2, atol=1e-2)
    # The fp32 masters moved as one device's did. AdamW's first steps move a weight
    # by about lr * sign(gradient), so where a gradient is near zero the ranks' bf16
    # rounding can flip its update: nearly every update agrees to 5%, and none differs
    # by more than two steps' worth (2 * lr per step).
    agree = total = 0
    for a, b, s in zip(optree.tree_leaves(gather(p)), optree.tree_leaves(rp), optree.tree_leaves(p0)):
        assert a.dtype == F32
        du, dr = a - s, b - s
        agree += int(((du - dr).abs() <= 0.05 * dr.abs() + 1e-5).sum())
        total += du.numel()
        assert float((du - dr).abs().max()) <= 2 * 2 * 1e-2
    assert agree >= 0.95 * total, (agree, total)
    # the first moments: fp32 averages of gradients that match to bf16 rounding (of
    # each rank's share, so near-zero sums differ by more than their own magnitude)
    agree = total = 0
    for a, b in zip(optree.tree_leaves(gather(o["m"])), optree.tree_leaves(ro["m"])):
        assert a.dtype == F32
        agree += int(((a - b).abs() <= 0.05 * b.abs() + 0.02 * float(b.abs().max())).sum())
        total += a.numel()
    assert agree >= 0.98 * total, (agree, total)
    return {"param": (str(p["wte"].dtype), spec_of(p["wte"])),
            "moments": (str(o["m"]["wte"].dtype), spec_of(o["m"]["wte"]),
                        str(o["v"]["wte"].dtype), spec_of(o["v"]["wte"]))}


def _loss(p, ids, targets):
    return gpt.loss_fn(p, ids, targets, CFG)


def _differentiated_call():
    """A pjit call that autograd differentiates from outside (``loss.backward()``):
    the whole function computes in bf16, and the parameters' gradients come back
    fp32, reduced in fp32, equal to the same policy on one device."""
    from sharded import shard

    mesh = Mesh((2,), ("dp",))
    f = pjit(_loss, in_specs=(P(), P("dp"), P("dp")), out_specs=P(), mesh=mesh,
             mode=DataParallelMode("replicate", param_dtype=BF16, reduce_dtype=F32))
    p0 = gpt.init_params(CFG, 0)
    params = optree.tree_map(lambda t: t.requires_grad_(), shard(optree.tree_map(torch.clone, p0), P(), mesh))
    ref = optree.tree_map(lambda t: t.clone().requires_grad_(), p0)
    ids, targets = gpt.batch(CFG, 8, seed=1)
    loss = f(params, ids, targets)
    loss.backward()
    ref_loss = POLICY.wrap(_loss)(ref, ids, targets)
    ref_loss.backward()
    torch.testing.assert_close(gather(loss).float(), ref_loss.detach().float(), rtol=1e-2, atol=1e-2)
    for a, b in zip(optree.tree_leaves(params), optree.tree_leaves(ref)):
        g = gather(a.grad)
        assert g.dtype == F32
        torch.testing.assert_close(g, b.grad, rtol=0.05, atol=0.02 * float(b.grad.abs().max()))
    low = f.lower(params, ids, targets)
    return {"loss": str(loss.dtype),
            "backward": sorted({(c.kind, str(c.dtype)) for c in low.backward.collectives()})}


def _tanh_loss(w, x):
    return torch.tanh(x @ w).sum()


def _shard_map_policy():
    """Policy.wrap inside a shard_map body that pjit differentiates: the body's
    matmuls run in bf16 on this rank's block of the batch, the gradient of the fp32
    weight comes back fp32, equal to the policy on one device."""
    from sharded import shard_map
    from sharded.collectives import psum

    mesh = Mesh((2,), ("dp",))

    def loss(w, x):
        body = shard_map(lambda w, x: psum(POLICY.wrap(_tanh_loss)(w, x), "dp"), mesh=mesh,
                         in_specs=(P(), P("dp")), out_specs=P())
        return body(w, x)

    def step(w, x):
        g, value = torch.func.grad_and_value(loss)(w, x)
        return g, value

    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(8, 4, generator=g), torch.randn(6, 8, generator=g)
    f = pjit(step, in_specs=(P(), P("dp")), mesh=mesh, mode=DTensorExpandMode(compile=False))
    grad, value = f(w, x)
    ref_grad, ref_value = torch.func.grad_and_value(POLICY.wrap(_tanh_loss))(w, x)
    assert grad.dtype == F32 and value.dtype == BF16
    torch.testing.assert_close(gather(value).float(), ref_value.float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(gather(grad), ref_grad, rtol=2e-2, atol=2e-2 * float(ref_grad.abs().max()))
    low = f.lower(w, x)
    return sorted({str(n.meta["val"].dtype) for n in low.local_graph.graph.nodes
                   if n.target is torch.ops.aten.mm.default})


def _all_ws2():
    out = {}
    for sharding, rd in (("replicate", F32), ("shard", F32), ("shard", None)):
        out[(sharding, rd)] = _train((2,), ("dp",), DataParallelMode(sharding, param_dtype=BF16,
                                                                      reduce_dtype=rd))
    out["policy-expand"] = _train((2,), ("dp",), DTensorExpandMode(compile=False),
                                  step_fn=policy_sgd_step)
    out["adamw"] = _adamw_sharded()
    out["differentiated"] = _differentiated_call()
    out["shard_map"] = _shard_map_policy()
    return out


_RESULTS: dict = {}


@pytest.fixture
def ws2(on_ranks):
    if not _RESULTS:
        _RESULTS.update(on_ranks(2, _all_ws2)[0])
    return _RESULTS


@pytest.mark.parametrize("sharding,rd", [("replicate", F32), ("shard", F32), ("shard", None)])
def test_mode_policy_equals_one_device(ws2, sharding, rd):
    r = ws2[(sharding, rd)]
    assert r["worst"] < 0.05
    want = P("dp") if sharding == "shard" else P()
    assert r["specs"]["wte"] == want                    # fp32 masters, in the mode's layout
    reduce = "all_reduce" if sharding == "replicate" else "reduce_scatter"
    assert (reduce, str(rd or BF16)) in r["collectives"]
    if sharding == "shard":
        assert ("all_gather", "torch.bfloat16") in r["collectives"]
        assert ("all_gather", "torch.float32") not in r["collectives"]


def test_functional_policy_in_another_mode(ws2):
    r = ws2["policy-expand"]
    assert r["worst"] < 0.05
    # DTensorExpandMode reduces in the dtype the backward produces: param_dtype
    assert ("all_reduce", "torch.bfloat16") in r["collectives"]


def test_adamw_on_fp32_sharded_masters(ws2):
    r = ws2["adamw"]
    assert r["param"] == ("torch.float32", P("dp"))
    assert r["moments"] == ("torch.float32", P("dp"), "torch.float32", P("dp"))


def test_a_differentiated_pjit_call_computes_in_bf16(ws2):
    r = ws2["differentiated"]
    assert r["loss"] == "torch.bfloat16"
    assert ("all_reduce", "torch.float32") in r["backward"]
    assert ("all_reduce", "torch.bfloat16") not in r["backward"]


def test_functional_policy_in_a_shard_map_body(ws2):
    assert ws2["shard_map"] == ["torch.bfloat16"]        # every matmul of the body


def _all_ws4():
    mp = dict(param_sharding="shard", param_dtype=BF16, reduce_dtype=F32)
    hsdp = ("dp_replicate", "dp_shard")
    return {
        "1d": _train((4,), ("dp",), DataParallelMode(**mp)),
        "2x2-tp": _train((2, 2), ("dp", "tp"), DataParallelMode(**mp), tp=True),
        "hsdp": _train((2, 2), hsdp, DataParallelMode(**mp, axis=hsdp), batch_spec=P(hsdp)),
    }


@pytest.fixture
def ws4(on_ranks):
    if not _RESULTS4:
        _RESULTS4.update(on_ranks(4, _all_ws4)[0])
    return _RESULTS4


_RESULTS4: dict = {}


def test_four_ranks_equal_one_device(ws4):
    r = ws4["1d"]
    assert r["worst"] < 0.05
    assert ("all_gather", "torch.bfloat16") in r["collectives"]
    assert ("reduce_scatter", "torch.float32") in r["collectives"]


def test_composes_with_megatron_on_2x2(ws4):
    r = ws4["2x2-tp"]
    assert r["worst"] < 0.05
    assert ("all_gather", "torch.bfloat16") in r["collectives"]
    assert ("reduce_scatter", "torch.float32") in r["collectives"]
    assert ("all_gather", "torch.float32") not in r["collectives"]


def test_composes_with_hsdp(ws4):
    """HSDP: bf16 gathers over the shard axis; gradients reduce-scattered over it and
    all-reduced over the replicate axis, both in fp32."""
    r = ws4["hsdp"]
    assert r["worst"] < 0.05
    assert ("all_gather", "dp_shard", "torch.bfloat16") in r["by_axis"]
    assert ("reduce_scatter", "dp_shard", "torch.float32") in r["by_axis"]
    assert ("all_reduce", "dp_replicate", "torch.float32") in r["by_axis"]
    assert ("all_gather", "dp_shard", "torch.float32") not in r["by_axis"]
    assert ("reduce_scatter", "dp_shard", "torch.bfloat16") not in r["by_axis"]
    assert not any(a == "dp_replicate" and k != "all_reduce" for k, a, _ in r["by_axis"])


# -- the lowered programs (abstract meshes: no ranks) ---------------------------------------

def _lower(mesh, mode, tp=False):
    with torch.device("meta"):
        params = gpt.init_params(CFG)
        opt = optim.adamw_init(params)
    ids = torch.empty(mesh.shape[0] * 2, CFG.seq, dtype=torch.long, device="meta")
    ps = gpt.tp_specs(params) if tp else P()
    step = pjit(adamw_step, in_specs=(ps, gpt.opt_specs(ps) if tp else P(), P("dp"), P("dp")),
                mesh=mesh, mode=mode)
    return step.lower(params, opt, ids, ids)


def _by_kind_dtype(low, axis="dp") -> dict:
    out: dict = {}
    for c in low.collectives():
        if c.axis == axis:
            row = out.setdefault((c.kind, c.dtype), [0, 0])
            row[0] += 1
            row[1] += c.bytes
    return out


@pytest.mark.parametrize("shape,names,tp", [((4,), ("dp",), False), ((2, 2), ("dp", "tp"), True)])
def test_gathers_in_bf16_reductions_in_reduce_dtype(shape, names, tp):
    """"shard": each parameter shard is cast before its all-gather (bf16 on the wire,
    half the fp32 program's bytes), and gradients are reduce-scattered after the
    cast back (fp32, the fp32 program's bytes) with reduce_dtype=float32, before it
    (bf16, half) with None; as many collectives as the fp32 program."""
    mesh = Mesh.abstract(shape, names)
    base = _by_kind_dtype(_lower(mesh, DataParallelMode("shard"), tp))
    fp32 = _by_kind_dtype(_lower(mesh, DataParallelMode("shard", param_dtype=BF16, reduce_dtype=F32), tp))
    half = _by_kind_dtype(_lower(mesh, DataParallelMode("shard", param_dtype=BF16), tp))
    ag, rs = base[("all_gather", F32)], base[("reduce_scatter", F32)]
    assert ("all_gather", F32) not in fp32 and ("all_gather", F32) not in half
    assert fp32[("all_gather", BF16)] == [ag[0], ag[1] // 2]
    assert fp32[("reduce_scatter", F32)] == rs
    assert ("reduce_scatter", BF16) not in fp32
    assert half[("all_gather", BF16)] == [ag[0], ag[1] // 2]
    assert half[("reduce_scatter", BF16)] == [rs[0], rs[1] // 2]
    assert ("reduce_scatter", F32) not in half


def test_replicate_reduces_in_reduce_dtype():
    """"replicate": the gradients' all-reduce is fp32 with reduce_dtype=float32 and
    bf16 with None; no gather."""
    mesh = Mesh.abstract((4,), ("dp",))
    fp32 = _lower(mesh, DataParallelMode("replicate", param_dtype=BF16, reduce_dtype=F32))
    half = _lower(mesh, DataParallelMode("replicate", param_dtype=BF16))
    grads = sum(t.numel() for t in optree.tree_leaves(gpt.init_params(CFG)))
    for low, dtype in ((fp32, F32), (half, BF16)):
        reduced = sum(c.shape[0] if c.shape else 1 for c in low.collectives()
                      if c.kind == "all_reduce" and c.dtype == dtype)
        assert reduced >= grads, (dtype, reduced, grads)
        assert not any(c.kind == "all_gather" for c in low.collectives())
    # no gradient reduced in the other dtype (at most the loss's scalars are bf16)
    assert sum(c.bytes for c in fp32.collectives() if c.dtype == BF16) <= 16
    assert not any(c.dtype == F32 and c.shape for c in half.collectives())


def test_optimizer_reads_fp32_and_forward_computes_bf16():
    """In the global program, every matmul of the differentiated function is bf16
    and the optimizer's fused kernel reads fp32 parameters and gradients."""
    low = _lower(Mesh.abstract((2,), ("dp",)), DataParallelMode("shard", param_dtype=BF16,
                                                                 reduce_dtype=F32))
    nodes = list(low.global_graph.graph.nodes)
    mms = [n for n in nodes if n.target in (torch.ops.aten.mm.default, torch.ops.aten.bmm.default)]
    assert mms and all(n.meta["val"].dtype == BF16 for n in mms)
    adam = [n for n in nodes if n.target is torch.ops.aten._fused_adamw.default]
    assert adam
    for n in adam:
        for lst in n.args[:2]:                      # params, grads
            assert all(a.meta["val"].dtype == F32 for a in lst)


# -- one device -----------------------------------------------------------------------------

def test_in_grad_is_the_functional_policy():
    """The mode's trace-time casts (precision.in_grad) and the explicit casts of
    Policy.wrap give the same step on one device, bit for bit; the optimizer outside
    the grad sees fp32."""
    p = gpt.init_params(CFG, 0)
    ids, targets = gpt.batch(CFG, 4, seed=1)
    a, la = precision.in_grad(sgd_step, BF16)(p, ids, targets)
    b, lb = policy_sgd_step(p, ids, targets)
    assert la.dtype == BF16 and torch.equal(la, lb)
    for x, y in zip(optree.tree_leaves(a), optree.tree_leaves(b)):
        assert x.dtype == F32 and torch.equal(x, y)
    seen = {}

    def step(p, x):
        def loss(p, x):
            seen["inside"] = (p["w"].dtype, x.dtype)
            return (x @ p["w"]).sum()
        g = torch.func.grad(loss)(p, x)
        seen["outside"] = (p["w"].dtype, g["w"].dtype)
        return g

    precision.in_grad(step, BF16)({"w": torch.randn(4, 3)}, torch.randn(2, 4))
    assert seen == {"inside": (BF16, BF16), "outside": (F32, F32)}


def test_policy_output_dtype_and_cast():
    pol = precision.Policy(param_dtype=BF16, output_dtype=F32)
    f = pol.wrap(lambda w, x, n: ((x @ w).sum() * n, x.dtype, n))
    out, xdt, n = f(torch.randn(4, 3), torch.randn(2, 4), 3)
    assert out.dtype == F32 and xdt == BF16 and n == 3
    tree = precision.cast({"a": torch.ones(2), "i": torch.ones(2, dtype=torch.long), "s": 1.0}, BF16)
    assert tree["a"].dtype == BF16 and tree["i"].dtype == torch.long and tree["s"] == 1.0


def test_bad_dtypes_are_clear_errors():
    with pytest.raises(ValueError, match=r"DataParallelMode: param_dtype must be a floating-point "
                                         r"torch.dtype or None; got torch.int32"):
        DataParallelMode("shard", param_dtype=torch.int32)
    with pytest.raises(ValueError, match=r"reduce_dtype must be .*got 'bf16' \(str\).*torch.bfloat16"):
        DataParallelMode(reduce_dtype="bf16")
    with pytest.raises(ValueError, match=r"sharded.precision.Policy: param_dtype .* torch.bool"):
        precision.Policy(param_dtype=torch.bool)
    with pytest.raises(ValueError, match=r"sharded.precision.cast: dtype"):
        precision.cast(torch.ones(2), torch.long)
    with pytest.raises(ValueError, match=r"in_grad: param_dtype must be a floating-point torch.dtype; got None"):
        precision.in_grad(sgd_step, None)


def test_cache_key_and_repr_name_the_dtypes():
    a, b = DataParallelMode("shard"), DataParallelMode("shard", param_dtype=BF16)
    c = DataParallelMode("shard", param_dtype=BF16, reduce_dtype=F32)
    assert len({a.cache_key(), b.cache_key(), c.cache_key()}) == 3
    assert "param_dtype=torch.bfloat16" in repr(c) and "reduce_dtype=torch.float32" in repr(c)


def test_a_reduce_dtype_nothing_casts_to_is_an_error():
    """Gradients are reduced in reduce_dtype where they pass through a cast to it: the
    cast back from param_dtype to the masters' dtype. A reduce_dtype that is neither
    param_dtype nor the floating inputs' dtype would be ignored (the gradients reduced
    in another dtype, silently): an error at trace."""
    mesh = Mesh.abstract((2,), ("dp",))
    with pytest.raises(ValueError, match=r"reduce_dtype=torch.bfloat16\): gradients are computed in "
                                         r"their parameters' dtype .*torch.float32 here.*reduce_dtype=None"):
        _lower(mesh, DataParallelMode("replicate", reduce_dtype=BF16))
    with pytest.raises(ValueError, match=r"nothing casts them to reduce_dtype torch.float16"):
        _lower(mesh, DataParallelMode("shard", param_dtype=BF16, reduce_dtype=torch.float16))
    _lower(mesh, DataParallelMode("replicate", reduce_dtype=F32))     # fp32 masters: nothing to do


def test_a_step_that_differentiates_inside_on_inputs_that_require_grad_is_an_error():
    """Called on parameters that require grad, a train step that differentiates
    inside is differentiated from outside too: every use would be cast, and the
    optimizer would get bf16 copies of the masters. The mode says so instead."""
    mesh = Mesh((1,), ("dp",))
    f = pjit(sgd_step, in_specs=(P(), P("dp"), P("dp")), mesh=mesh,
             mode=DataParallelMode(param_dtype=BF16))
    p = optree.tree_map(lambda t: t.requires_grad_(), gpt.init_params(CFG, 0))
    ids, targets = gpt.batch(CFG, 4, seed=1)
    with pytest.raises(Exception, match=r"differentiates inside itself .*Pass tensors that do not "
                                        r"require grad"):
        f(p, ids, targets)
    with pytest.raises(ValueError, match=r"in_grad: the function differentiates inside itself"):
        precision.in_grad(sgd_step, BF16)(p, ids, targets)


def _mlp_loss(w, x, y):
    return torch.nn.functional.mse_loss(torch.tanh(x @ w["a"]) @ w["b"], y)


def _accumulated_step(w, x, y):
    g = optim.accumulate(torch.func.grad(_mlp_loss), w, x, y, num_microbatches=2)
    return optree.tree_map(lambda p, d: p - 0.1 * d, w, g)


def test_inputs_sliced_before_the_grad_are_cast_too():
    """optim.accumulate slices the batch outside torch.func.grad: the micro-batches
    are new tensors, computed from the step's float inputs, and are cast where the
    grad uses them (they once reached the matmul in fp32 beside bf16 weights:
    "expected m1 and m2 to have the same dtype"). Equal, bit for bit, to the casts
    written into the loss; under pjit every matmul is bf16."""
    g = torch.Generator().manual_seed(0)
    w = {"a": torch.randn(4, 8, generator=g), "b": torch.randn(8, 2, generator=g)}
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)
    got = precision.in_grad(_accumulated_step, BF16)(w, x, y)

    def by_hand(w, x, y):
        grad = torch.func.grad(POLICY.wrap(_mlp_loss))
        return optree.tree_map(lambda p, d: p - 0.1 * d, w,
                               optim.accumulate(grad, w, x, y, num_microbatches=2))

    want = by_hand(w, x, y)
    for k in w:
        assert got[k].dtype == F32 and torch.equal(got[k], want[k]), k
    low = pjit(_accumulated_step, in_specs=(P(), P("dp"), P("dp")), mesh=Mesh.abstract((2,), ("dp",)),
               mode=DataParallelMode(param_dtype=BF16, reduce_dtype=F32)).lower(w, x, y)
    mms = [n for n in low.global_graph.graph.nodes if n.target is torch.ops.aten.mm.default]
    assert mms and all(n.meta["val"].dtype == BF16 for n in mms)
