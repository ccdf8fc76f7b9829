"""sharded.optim's training essentials under pjit (docs/optim.md): a schedule's
learning rate is a value of the program (1,000 steps trace once and equal
torch.optim.AdamW + LambdaLR), clip_by_global_norm costs one scalar all-reduce over any
mix of layouts, gradient accumulation reduces the gradients once per step, and a train
step with all of them equals torch's on one device on real gloo ranks (ws 2 and 2x2;
DataParallelMode "replicate" and "shard", DTensorExpandMode)."""

from __future__ import annotations

import pytest
import torch

from sharded import Mesh, P, gather, optim, shard
from sharded.modes import DataParallelMode, DTensorExpandMode
from tests.ranks import InPlaceReductions
from tests.test_data_parallel import TP_SPECS, batch, init, loss_fn
from transforms import pjit

SCHED = optim.warmup_cosine_decay_schedule(0.0, 1e-2, warmup_steps=2, decay_steps=6, end_value=1e-3)
MAX_NORM = 0.5


def no_decay_on_vectors(name, p):
    return p.ndim >= 2


def train_step(params, opt_state, ids, targets, micro: int = 1, clip: bool | str = True):
    """Warmup + cosine lr from the step count, weight decay on matrices only, the
    gradients of ``micro`` micro-batches, clipped to MAX_NORM (``clip="traced"``: by a
    norm written as a plain sum of squares, to count what it costs)."""
    grads, loss = optim.accumulate(torch.func.grad_and_value(loss_fn), params, ids, targets,
                                   num_microbatches=micro)
    norm = torch.zeros(())
    if clip == "traced":
        norm = torch.sqrt(sum(g.pow(2).sum() for g in grads.values()))
        grads = {k: g * torch.clamp(MAX_NORM / (norm + 1e-6), max=1.0) for k, g in grads.items()}
    elif clip:
        grads, norm = optim.clip_by_global_norm(grads, MAX_NORM)
    params, opt_state = optim.adamw(params, grads, opt_state, lr=SCHED, weight_decay=0.1,
                                    mask=no_decay_on_vectors)
    return params, opt_state, loss, norm


def traced_hyper_step(params, opt_state, ids, targets):
    """Betas and weight decay computed in the step from the step count (tensors: the
    foreach ops), the lr from SCHED (a tensor: the fused kernel's tensor-lr overload
    where it is not forced off)."""
    grads, loss = torch.func.grad_and_value(loss_fn)(params, ids, targets)
    s = opt_state["step"]
    params, opt_state = optim.adamw(params, grads, opt_state, lr=SCHED,
                                    betas=(torch.full_like(s, 0.8), torch.full_like(s, 0.99)),
                                    weight_decay=optim.constant_schedule(0.1)(s),
                                    mask=no_decay_on_vectors)
    return params, opt_state, loss, torch.zeros(())


def torch_reference(params, ids, targets, steps, *, schedule=SCHED, peak=1e-2, clip=True,
                    betas=(0.9, 0.999)):
    """torch.optim.AdamW with two param groups (decay / no decay), LambdaLR with the same
    schedule, clip_grad_norm_, the full batch: params and the norms before clipping."""
    ps = {k: v.clone().requires_grad_() for k, v in params.items()}
    groups = [{"params": [v for v in ps.values() if v.ndim >= 2], "weight_decay": 0.1},
              {"params": [v for v in ps.values() if v.ndim < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=peak, betas=betas)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: float(schedule(k)) / peak)
    norms = []
    for _ in range(steps):
        opt.zero_grad()
        loss_fn(ps, ids, targets).backward()
        if clip:
            norms.append(torch.nn.utils.clip_grad_norm_(list(ps.values()), MAX_NORM))
        opt.step()
        sched.step()
    return {k: v.detach() for k, v in ps.items()}, norms


# -- one device, in process -----------------------------------------------------------------

def tiny_loss(p, x, y):
    return torch.nn.functional.mse_loss(torch.tanh(x @ p["w"].T + p["b"]) @ p["v"].T, y)


def test_a_thousand_scheduled_steps_trace_once_and_equal_torch():
    """The lr changes every step (warmup + cosine from ``opt_state["step"]``): one
    program for 1,000 steps, whose parameters equal torch.optim.AdamW + LambdaLR's."""
    sched = optim.warmup_cosine_decay_schedule(0.0, 5e-2, warmup_steps=100, decay_steps=1000,
                                               end_value=1e-3)

    def step(p, o, x, y):
        g, loss = torch.func.grad_and_value(tiny_loss)(p, x, y)
        return (*optim.adamw(p, g, o, lr=sched, weight_decay=0.1), loss)

    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(8, 4, generator=g), "b": torch.randn(8, generator=g),
              "v": torch.randn(2, 8, generator=g)}
    x, y = torch.randn(16, 4, generator=g), torch.randn(16, 2, generator=g)
    f = pjit(step, in_specs=(P(), P(), P("dp"), P("dp")), mesh=Mesh((1,), ("dp",)),
             mode=DTensorExpandMode(compile=False))
    p, o = params, optim.adamw_init(params)
    for _ in range(1000):
        p, o, _ = f(p, o, x, y)
    assert f.trace_count == 1
    lowered = f.lower(p, o, x, y)
    assert any(n.target is torch.ops.aten._fused_adamw.tensor_lr for n in lowered.local_graph.graph.nodes)

    ref = {k: v.clone().requires_grad_() for k, v in params.items()}
    opt = torch.optim.AdamW(ref.values(), lr=5e-2, weight_decay=0.1)
    lambda_lr = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: float(sched(k)) / 5e-2)
    for _ in range(1000):
        opt.zero_grad()
        tiny_loss(ref, x, y).backward()
        opt.step()
        lambda_lr.step()
    assert gather(o["step"]).item() == 1000
    torch.testing.assert_close(gather(p), {k: v.detach() for k, v in ref.items()})


def test_tensor_lr_argument_does_not_retrace():
    """An lr passed as a 0-d tensor argument is an input: new values, one program; a
    float lr passed as a static argument is a constant: one program per value."""
    def step(p, o, x, y, lr):
        g = torch.func.grad(tiny_loss)(p, x, y)
        return optim.adamw(p, g, o, lr=lr)

    g = torch.Generator().manual_seed(1)
    params = {"w": torch.randn(8, 4, generator=g), "b": torch.randn(8, generator=g),
              "v": torch.randn(2, 8, generator=g)}
    x, y = torch.randn(4, 4, generator=g), torch.randn(4, 2, generator=g)
    mesh = Mesh((1,), ("dp",))
    f = pjit(step, in_specs=(P(), P(), P("dp"), P("dp"), P()), mesh=mesh,
             mode=DTensorExpandMode(compile=False))
    p, o = params, optim.adamw_init(params)
    rp, ro = params, optim.adamw_init(params)
    for lr in (1e-2, 3e-3, 1e-3):
        p, o = f(p, o, x, y, torch.tensor(lr, dtype=torch.float64))
        rp, ro = step(rp, ro, x, y, lr)
    assert f.trace_count == 1
    torch.testing.assert_close(gather(p), rp, rtol=0, atol=0)    # float64 lr: bitwise
    static = pjit(step, in_specs=(P(), P(), P("dp"), P("dp")), static_argnums=(4,), mesh=mesh,
                  mode=DTensorExpandMode(compile=False))
    for lr in (1e-2, 3e-3):
        static(params, optim.adamw_init(params), x, y, lr)
    assert static.trace_count == 2


# -- collectives, lowered on abstract meshes --------------------------------------------------

def _lower(mesh, mode, specs, **kw):
    step = pjit(lambda p, o, i, t: train_step(p, o, i, t, **kw), in_specs=specs, mesh=mesh, mode=mode)
    params = init()
    ids, targets = batch()
    return step.lower(params, optim.adamw_init(params), ids, targets)


TP = (TP_SPECS, {"step": P(), "m": TP_SPECS, "v": TP_SPECS}, P("dp"), P("dp"))
DP = (P(), P(), P("dp"), P("dp"))
MODES = {"expand": DTensorExpandMode, "replicate": lambda: DataParallelMode("replicate"),
         "shard": lambda: DataParallelMode("shard")}


def _kinds(lowered):
    return [(c.kind, c.axis, tuple(c.shape)) for c in lowered.collectives()]


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("mesh_kind", ["dp", "dp_tp"])
def test_clipping_adds_one_scalar_all_reduce(mode, mesh_kind):
    """Over the gradients' mixed layouts (Megatron splits w1, b1, w2 over "tp", the
    rest replicated; under "shard" every leaf is split over "dp" too), the norm adds one
    scalar to the program's all-reduces: an all-reduce of its own, or one element more
    in a bucket of scalars that the passes merged it into; nothing else changes. A plain
    traced sum of squares costs one per split leaf where replicated leaves are among
    them (3 on ("dp", "tp") in DTensorExpandMode). With every gradient replicated (1-D "dp", parameters
    replicated) it costs nothing."""
    if mesh_kind == "dp":
        mesh, specs = Mesh.abstract((2,), ("dp",)), DP
    else:
        mesh, specs = Mesh.abstract((2, 2), ("dp", "tp")), TP
    without = _kinds(_lower(mesh, MODES[mode](), specs, clip=False))
    with_clip = _kinds(_lower(mesh, MODES[mode](), specs, clip=True))
    scalars = {("dp", "expand"): 0, ("dp", "replicate"): 0}.get((mesh_kind, mode), 1)

    def others(cs):
        return sorted((c for c in cs if c[0] != "all_reduce" or _numel(c[2]) > 2), key=str)

    def scalar_elements(cs):
        return sum(_numel(c[2]) for c in cs if c[0] == "all_reduce" and _numel(c[2]) <= 2)

    assert others(with_clip) == others(without), (without, with_clip)
    assert scalar_elements(with_clip) == scalar_elements(without) + scalars, (without, with_clip)
    assert len(without) <= len(with_clip) <= len(without) + scalars, (without, with_clip)
    if mode == "shard" and mesh_kind == "dp_tp":
        assert ("all_reduce", ("dp", "tp"), ()) in with_clip       # one, over both axes
    if mesh_kind == "dp_tp":      # docs/optim.md's table: what a plain traced norm costs
        traced = _kinds(_lower(mesh, MODES[mode](), specs, clip="traced"))
        # under "shard" every leaf's share is pending: Python's sum() starts from 0,
        # which the program drops (NOTE [Adding zero]), and the shares stay pending to
        # one all-reduce (7 before); replicated leaves among split ones (Megatron's
        # norms and biases) still reduce each split leaf's share as they meet it
        assert len(traced) - len(without) == {"expand": 3, "replicate": 3, "shard": 1}[mode], \
            (without, traced)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _gradient_reductions(lowered):
    """The collectives that reduce gradients: over "dp", more than the loss's scalars
    (the mean's count of targets, per micro-batch: NOTE [A mean over a split batch])."""
    return [c for c in _kinds(lowered)
            if c[1] == "dp" and c[0] in ("all_reduce", "reduce_scatter") and _numel(c[2]) > 2]


@pytest.mark.parametrize("mode", sorted(MODES))
def test_accumulation_reduces_gradients_once(mode):
    """4 micro-batches: the gradient reductions of one (the pending sums stay pending
    through the adds); the activations' peak is lower than the whole batch's."""
    mesh = Mesh.abstract((2,), ("dp",))
    one = _lower(mesh, MODES[mode](), DP, micro=1, clip=False)
    four = _lower(mesh, MODES[mode](), DP, micro=4, clip=False)
    grads_one, grads_four = _gradient_reductions(one), _gradient_reductions(four)
    assert grads_one, _kinds(one)
    assert len(grads_four) == len(grads_one), (_kinds(one), _kinds(four))
    numel = sum(v.numel() for v in init().values())
    for grads in (grads_one, grads_four):     # every gradient element, once (a bucket may hold the loss)
        assert numel <= sum(_numel(shape) for _, _, shape in grads) <= numel + 2, grads
    assert len([c for c in _kinds(four) if c[0] == "all_gather"]) <= \
        max(1, len([c for c in _kinds(one) if c[0] == "all_gather"]))


def test_accumulation_holds_one_micro_batch():
    """The program's peak memory with 4 micro-batches is below the whole batch's:
    activations of one micro-batch at a time (a batch large next to the params)."""
    mesh = Mesh.abstract((2,), ("dp",))
    params = init()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 16, (64, 6), generator=g)
    peaks = {}
    for micro in (1, 4):
        f = pjit(lambda p, o, i, t, m=micro: train_step(p, o, i, t, micro=m, clip=False),
                 in_specs=DP, mesh=mesh, mode=DataParallelMode("replicate"))
        peaks[micro] = f.lower(params, optim.adamw_init(params), ids, ids).memory()["peak_bytes"]
    assert peaks[4] < 0.6 * peaks[1], peaks


# -- real ranks against one device -------------------------------------------------------------

def _on_ranks(mesh_shape, names, runs, steps=3):
    """On every rank: for each (mode, micro, tp[, clip]) in ``runs``, ``steps`` pjit'd
    train steps (schedule, mask, clipping, ``micro`` micro-batches) equal torch's on one
    device (``clip="traced"``: the norm a plain sum of squares)."""
    mesh = Mesh(mesh_shape, names)
    params = init()
    ids, targets = batch()
    ref, ref_norms = torch_reference(params, ids, targets, steps)
    out, in_place = {}, 0
    for mode, micro, tp, *rest in runs:
        clip = rest[0] if rest else True
        f = pjit(lambda p, o, i, t, m=micro, c=clip: train_step(p, o, i, t, micro=m, clip=c),
                 in_specs=TP if tp else DP, mesh=mesh, mode=MODES[mode]())
        p, o = params, optim.adamw_init(params)
        norms = []
        watch = InPlaceReductions()
        for k in range(steps):
            with watch.on_call(k):
                p, o, _, norm = f(p, o, ids, targets)
            norms.append(gather(norm))
        watch.check()
        in_place += watch.seen
        torch.testing.assert_close(torch.stack(norms), torch.stack(ref_norms), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(gather(p), ref, rtol=1e-4, atol=1e-5)
        assert f.trace_count == 1
        out[(mode, micro, tp, *rest)] = [n.item() for n in norms]
    assert in_place > 0          # (the gradient buckets: the watch saw them)
    return out


def _traced_hyper_on_ranks(steps=3):
    """On every rank: traced betas and weight decay (the foreach ops) equal
    torch.optim.AdamW with those values, in DTensorExpandMode and "shard"."""
    mesh = Mesh((2,), ("dp",))
    params = init()
    ids, targets = batch()
    ref, _ = torch_reference(params, ids, targets, steps, clip=False, betas=(0.8, 0.99))
    for mode in ("expand", "shard"):
        f = pjit(traced_hyper_step, in_specs=DP, mesh=mesh, mode=MODES[mode]())
        p, o = params, optim.adamw_init(params)
        for _ in range(steps):
            p, o, _, _ = f(p, o, ids, targets)
        assert f.trace_count == 1
        torch.testing.assert_close(gather(p), ref, rtol=1e-4, atol=1e-5)
    return True


def test_traced_betas_and_weight_decay_equal_torch(on_ranks):
    assert all(on_ranks(2, _traced_hyper_on_ranks))


def test_train_step_equals_torch_on_two_ranks(on_ranks):
    runs = [("expand", 2, False), ("replicate", 2, False), ("shard", 2, False), ("shard", 1, False),
            ("shard", 1, False, "traced")]
    res = on_ranks(2, _on_ranks, (2,), ("dp",), runs)[0]
    assert all(n > MAX_NORM for n in res[("shard", 2, False)][:1])      # clipping acted


def test_train_step_equals_torch_on_2x2(on_ranks):
    # a norm summed by hand over leaves split over "dp", "tp" or both: one all-reduce
    # (NOTE [Adding zero] in sharded/rewrites/algebra.py)
    runs = [("expand", 2, True), ("shard", 2, True), ("shard", 1, True, "traced"),
            ("expand", 1, True, "traced")]
    res = on_ranks(4, _on_ranks, (2, 2), ("dp", "tp"), runs)[0]
    assert set(res) == set(runs)


def _eager_clip_across_meshes():
    """Eager DTensors on two meshes (a 1-D and a 2-D one over the same ranks): torch's
    clip_grad_norm_ rejects them (pytorch issue 180346); clip_by_global_norm takes them."""
    m1, m2 = Mesh((4,), ("dp",)), Mesh((2, 2), ("dp", "tp"))
    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(8, 4, generator=g), torch.randn(4, 6, generator=g)
    grads = {"a": shard(a, P("dp"), m1), "b": shard(b, P("dp", "tp"), m2)}
    clipped, norm = optim.clip_by_global_norm(grads, 1.0)
    total = torch.sqrt(a.pow(2).sum() + b.pow(2).sum())
    coef = torch.clamp(1.0 / (total + 1e-6), max=1.0)
    torch.testing.assert_close(norm, total)
    torch.testing.assert_close(gather(clipped), {"a": a * coef, "b": b * coef})
    params = []
    for x in grads.values():
        w = torch.zeros_like(x).requires_grad_()
        w.grad = x.clone()
        params.append(w)
    try:
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        return ""
    except Exception as e:  # noqa: BLE001 - what torch raises is its business
        return str(e)


def test_eager_clip_across_meshes(on_ranks):
    for torch_error in on_ranks(4, _eager_clip_across_meshes):
        assert "must have the same mesh" in torch_error, torch_error


def test_donated_scheduled_step_runs_the_fused_kernel_in_place():
    """A donated step with a schedule's lr: the in-place tensor-lr kernel
    (``_fused_adamw_.tensor_lr``) updates the parameters and moments in their storage,
    and equals the undonated step."""
    def step(p, o, x, y):
        g = torch.func.grad(tiny_loss)(p, x, y)
        return optim.adamw(p, g, o, lr=optim.cosine_decay_schedule(1e-2, 10))

    g = torch.Generator().manual_seed(4)
    params = {"w": torch.randn(8, 4, generator=g), "b": torch.randn(8, generator=g),
              "v": torch.randn(2, 8, generator=g)}
    x, y = torch.randn(4, 4, generator=g), torch.randn(4, 2, generator=g)
    mesh = Mesh((1,), ("dp",))
    kw = dict(in_specs=(P(), P(), P("dp"), P("dp")), mesh=mesh, mode=DTensorExpandMode(compile=False))
    donated = pjit(step, donate_argnums=(0, 1), **kw)
    # shard's blocks on one rank are the caller's tensors, which the donated step writes
    p, o = shard(({k: v.clone() for k, v in params.items()}, optim.adamw_init(params)), P(), mesh)
    targets = {n.target for n in donated.lower(p, o, x, y).local_graph.graph.nodes}
    assert torch.ops.aten._fused_adamw_.tensor_lr in targets
    rp, ro = params, optim.adamw_init(params)
    for _ in range(3):
        p, o = donated(p, o, x, y)
        rp, ro = step(rp, ro, x, y)
    torch.testing.assert_close(gather(p), rp, rtol=0, atol=0)
