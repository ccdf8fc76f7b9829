"""Small pure-functional optimizers over parameter pytrees (for use inside pjit).

Each update takes and returns pytrees; nothing is mutated, so a whole train step
(forward, backward, update) is one traced program. The math runs on multi-tensor
ops over all parameters at once, so an update adds a few graph nodes, not a dozen per
parameter: AdamW is torch's fused kernel (the one ``torch.optim.AdamW(fused=True)``
runs: one pass over parameters, gradients and moments) where every tensor is floating
point of one dtype and device, else foreach ops. Numerics follow torch.optim (SGD
with momentum and weight decay; AdamW with decoupled weight decay and bias
correction).

Also here (docs/optim.md): learning-rate schedules in optax's manner (pure functions
of the step count made of torch ops, so they trace into the step), hyperparameters as
traced values (a tensor ``lr`` is an input of the program, a float is baked into it),
``clip_by_global_norm`` (one scalar reduction per step under pjit, whatever the
gradients' layouts), weight-decay masks, and gradient accumulation inside one program
(``accumulate``).
"""

from __future__ import annotations

import math
from typing import Callable, Sequence, Union

import optree
import torch
from torch.distributed.tensor import DTensor, Partial, Replicate

from sharded import _registry, _torch

__all__ = [
    "sgd", "sgd_init", "adamw", "adamw_init",
    "constant_schedule", "linear_schedule", "cosine_decay_schedule",
    "warmup_cosine_decay_schedule", "join_schedules",
    "global_norm", "clip_by_global_norm", "accumulate",
]

Scalar = Union[float, torch.Tensor]
Schedule = Callable[[Union[int, torch.Tensor]], torch.Tensor]
"""A schedule: the step count (an int or a 0-d tensor) to a 0-d float64 tensor."""


def _leaves(tree, like=None):
    """Leaves of ``tree`` (following the structure of ``like``) and the treedef."""
    treedef = optree.tree_structure(like if like is not None else tree)
    return treedef.flatten_up_to(tree), treedef


# ---------------------------------------------------------------------------------------
# Schedules (optax's names and argument meanings)
# ---------------------------------------------------------------------------------------

# NOTE [Schedules are traced]
# A schedule maps the step count (the number of updates done before this one, as
# optax counts: 0 on the first update) to a value, with torch ops on a float64
# scalar: called with ``opt_state["step"]`` inside a pjit'd step, it is part of the
# program, so a learning rate that changes every step neither retraces nor leaves the
# device. float64 because torch.optim's schedulers compute in Python floats (doubles):
# the same formula in float64 gives the same learning rate to the last bit or two, and
# torch's fused CPU AdamW kernel given a float64 ``lr`` tensor is bitwise the kernel
# given the same Python float. Called with a Python int it returns a float64 tensor
# too (``float(schedule(k))`` is what ``LambdaLR`` wants).

def _count(step) -> torch.Tensor:
    if isinstance(step, torch.Tensor):
        return step.to(torch.float64)
    if isinstance(step, bool) or not isinstance(step, (int, float)):
        raise TypeError(f"a schedule takes the step count as an int or a 0-d tensor; got {step!r}.")
    return torch.tensor(float(step), dtype=torch.float64)


def _check_steps(api: str, name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{api}: {name} must be an int >= {minimum}; got {value!r}.")


def constant_schedule(value: float) -> Schedule:
    """``value`` at every step."""
    def schedule(step):
        return torch.full_like(_count(step), float(value))
    return schedule


def linear_schedule(init_value: float, end_value: float, transition_steps: int,
                    transition_begin: int = 0) -> Schedule:
    """``init_value`` until ``transition_begin``, then linearly to ``end_value`` over
    ``transition_steps`` steps, then ``end_value`` (optax.linear_schedule; a linear
    warmup is ``linear_schedule(0.0, peak, warmup_steps)``). ``transition_steps`` 0: the
    constant ``init_value``, as optax."""
    _check_steps("linear_schedule", "transition_steps", transition_steps, 0)
    _check_steps("linear_schedule", "transition_begin", transition_begin, 0)
    if transition_steps == 0:
        return constant_schedule(init_value)

    def schedule(step):
        count = torch.clamp(_count(step) - transition_begin, 0, transition_steps)
        frac = 1 - count / transition_steps
        return (init_value - end_value) * frac + end_value
    return schedule


def cosine_decay_schedule(init_value: float, decay_steps: int, alpha: float = 0.0,
                          exponent: float = 1.0) -> Schedule:
    """``init_value * ((1 - alpha) * (0.5 * (1 + cos(pi * t / decay_steps))) ** exponent
    + alpha)`` for ``t = min(step, decay_steps)`` (optax.cosine_decay_schedule: ``alpha``
    is the final value as a fraction of ``init_value``)."""
    _check_steps("cosine_decay_schedule", "decay_steps", decay_steps, 1)

    def schedule(step):
        count = torch.clamp(_count(step), max=decay_steps)
        cosine = 0.5 * (1 + torch.cos(math.pi * count / decay_steps))
        return init_value * ((1 - alpha) * cosine ** exponent + alpha)
    return schedule


def join_schedules(schedules: Sequence[Schedule], boundaries: Sequence[int]) -> Schedule:
    """``schedules[0]`` before ``boundaries[0]``, then ``schedules[1]`` counted from
    that boundary, and so on (optax.join_schedules)."""
    if len(schedules) != len(boundaries) + 1:
        raise ValueError(f"join_schedules: {len(schedules)} schedules need "
                         f"{len(schedules) - 1} boundaries; got {list(boundaries)}.")

    def schedule(step):
        count = _count(step)
        out = schedules[0](count)
        for boundary, fn in zip(boundaries, schedules[1:]):
            out = torch.where(count < boundary, out, fn(count - boundary))
        return out
    return schedule


def warmup_cosine_decay_schedule(init_value: float, peak_value: float, warmup_steps: int,
                                 decay_steps: int, end_value: float = 0.0,
                                 exponent: float = 1.0) -> Schedule:
    """Linear warmup from ``init_value`` to ``peak_value`` over ``warmup_steps``, then a
    cosine decay to ``end_value`` at step ``decay_steps`` (which counts the warmup, as
    optax.warmup_cosine_decay_schedule)."""
    _check_steps("warmup_cosine_decay_schedule", "warmup_steps", warmup_steps, 0)
    if isinstance(decay_steps, bool) or not isinstance(decay_steps, int) or decay_steps <= warmup_steps:
        raise ValueError(f"warmup_cosine_decay_schedule: decay_steps counts the warmup and must "
                         f"be an int > warmup_steps ({warmup_steps}); got {decay_steps!r}.")
    alpha = 0.0 if peak_value == 0.0 else end_value / peak_value
    return join_schedules(
        [linear_schedule(init_value, peak_value, warmup_steps),
         cosine_decay_schedule(peak_value, decay_steps - warmup_steps, alpha, exponent)],
        [warmup_steps])


# ---------------------------------------------------------------------------------------
# Weight-decay masks
# ---------------------------------------------------------------------------------------

def _path_name(path: tuple) -> str:
    return ".".join(str(k) for k in path)


def _decay_mask(api: str, mask, params) -> list[bool]:
    """One bool per leaf of ``params``: does weight decay apply to it? ``mask`` is None
    (every leaf), a pytree of bools with the structure of ``params``, or a predicate
    ``mask(name, leaf) -> bool`` called with the leaf's dotted path (``"blocks.0.ln.w"``,
    as ``named_parameters()`` names it)."""
    paths, leaves, _ = optree.tree_flatten_with_path(params)
    if mask is None:
        return [True] * len(leaves)
    if callable(mask):
        out = []
        for path, leaf in zip(paths, leaves):
            v = mask(_path_name(path), leaf)
            if not isinstance(v, bool):
                raise TypeError(f"{api}: mask({_path_name(path)!r}, leaf) returned {v!r}; the "
                                f"predicate must return a bool (True: decay this leaf).")
            out.append(v)
        return out
    treedef = optree.tree_structure(params)
    try:
        flags = treedef.flatten_up_to(mask)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{api}: mask must be a pytree of bools with the structure of the "
                         f"params ({treedef}), or a predicate (name, leaf) -> bool; {e}") from None
    for path, v in zip(paths, flags):
        if not isinstance(v, bool):
            raise TypeError(f"{api}: mask[{_path_name(path)!r}] is {v!r}; each entry must be a "
                            f"bool (True: decay this leaf).")
    return [bool(v) for v in flags]


def _subset(xs: list, idx: list[int]) -> list:
    return [xs[i] for i in idx]


# ---------------------------------------------------------------------------------------
# SGD
# ---------------------------------------------------------------------------------------

def sgd_init(params):
    """Momentum buffers for ``sgd`` (zeros like the params)."""
    return optree.tree_map(torch.zeros_like, params)


def sgd(params, grads, state=None, *, lr: Scalar, momentum: float = 0.0,
        weight_decay: Scalar = 0.0, mask=None):
    """One SGD step (as torch.optim.SGD); returns ``(params, state)``. ``state`` from
    ``sgd_init`` when ``momentum`` is non-zero, else None. ``lr`` and ``weight_decay``
    may be 0-d tensors (inputs of a traced program); ``mask`` as for ``adamw``."""
    p, treedef = _leaves(params)
    g, _ = _leaves(grads, params)
    decay = _decay_mask("sgd", mask, params)
    if _nonzero(weight_decay):
        g = list(g)
        idx = [i for i, d in enumerate(decay) if d]
        if idx:
            wd = _torch.foreach_add(_subset(g, idx), _torch.foreach_mul(_subset(p, idx), weight_decay))
            for i, x in zip(idx, wd):
                g[i] = x
    if momentum:
        if state is None:
            raise ValueError("sgd with momentum needs state=sgd_init(params).")
        b, _ = _leaves(state, params)
        g = _torch.foreach_add(_torch.foreach_mul(b, momentum), g)
        state = treedef.unflatten(g)
    p = _torch.foreach_sub(p, _torch.foreach_mul(g, lr))
    return treedef.unflatten(p), state


def _nonzero(x) -> bool:
    return isinstance(x, torch.Tensor) or bool(x)


# ---------------------------------------------------------------------------------------
# AdamW
# ---------------------------------------------------------------------------------------

def adamw_init(params):
    """AdamW state: step count and first/second moments. The step count is a float32
    scalar on the device of the (plain tensor) parameters, where torch's fused CUDA
    kernel reads it (``torch.optim.AdamW(fused=True)`` keeps it there too); on the
    default device for DTensor parameters."""
    device = next((t.device for t in optree.tree_leaves(params)
                   if isinstance(t, torch.Tensor) and not _torch.is_dtensor(t)), None)
    return {
        "step": torch.zeros((), dtype=torch.float32, device=device),
        "m": optree.tree_map(torch.zeros_like, params),
        "v": optree.tree_map(torch.zeros_like, params),
    }


# NOTE [Traced hyperparameters]
# A Python float hyperparameter is a constant of the traced program (pjit's cache key
# holds static values: another float is another program). A 0-d tensor is an input or
# an intermediate of the program, so one program serves every value: pass
# ``lr=schedule`` (called with ``state["step"]``), ``lr=schedule(opt_state["step"])``, or
# an lr tensor argument of the step. torch's fused AdamW kernel has an overload that
# takes ``lr`` as a tensor (``aten._fused_adamw.tensor_lr``; betas, weight decay and eps
# stay floats), so a tensor ``lr`` keeps the fused path: as fast as a float lr, about
# 3x faster than the foreach ops (benchmarks/bench_optim.py); a float64 lr tensor on
# CPU gives results bitwise equal to the float lr. CUDA's kernel reads a float32 lr on
# the parameters' device, so there the lr is cast. Tensor betas or a tensor weight
# decay take the foreach ops (the fused kernel has no overload for them).

def adamw(params, grads, state, *, lr: Scalar | Schedule = 1e-3, betas=(0.9, 0.999),
          eps: float = 1e-8, weight_decay: Scalar = 1e-2, mask=None):
    """One AdamW step (as torch.optim.AdamW); returns ``(params, state)``.

    ``lr``, ``betas`` and ``weight_decay`` may be Python floats (constants of a traced
    program) or 0-d tensors (inputs or values of it: NOTE [Traced hyperparameters]);
    ``lr`` may also be a schedule, called with ``state["step"]`` (the number of updates
    before this one). ``mask`` picks the leaves that weight decay applies to: a pytree
    of bools matching ``params``, or a predicate ``mask(name, leaf) -> bool`` on each
    leaf's dotted path, e.g. ``lambda name, p: p.ndim >= 2`` (no decay on biases and
    norms); None: every leaf (torch.optim.AdamW with one param group)."""
    if callable(lr):
        lr = lr(state["step"])
    b1, b2 = betas
    p, treedef = _leaves(params)
    g, _ = _leaves(grads, params)
    m, _ = _leaves(state["m"], params)
    v, _ = _leaves(state["v"], params)
    decay = _decay_mask("adamw", mask, params)
    step = state["step"] + 1
    scalars_fusable = not any(isinstance(x, torch.Tensor) for x in (b1, b2, weight_decay))
    if scalars_fusable and _fusable(p, g, m, v):
        lr_arg = _fused_lr(lr, p[0].device)
        new_p, new_m, new_v = list(p), list(m), list(v)
        for wd, idx in ((weight_decay, [i for i, d in enumerate(decay) if d]),
                        (0.0, [i for i, d in enumerate(decay) if not d])):
            if not idx:
                continue
            ps, ms, vs = _torch.fused_adamw(_subset(p, idx), _subset(g, idx), _subset(m, idx),
                                            _subset(v, idx), [step] * len(idx), lr=lr_arg,
                                            beta1=b1, beta2=b2, weight_decay=wd, eps=eps)
            for i, a, b, c in zip(idx, ps, ms, vs):
                new_p[i], new_m[i], new_v[i] = a, b, c
        new_state = {"step": step, "m": treedef.unflatten(new_m), "v": treedef.unflatten(new_v)}
        return treedef.unflatten(new_p), new_state
    m = _torch.foreach_add(_torch.foreach_mul(m, b1), _torch.foreach_mul(g, 1 - b1))
    if isinstance(b2, torch.Tensor):
        v = _torch.foreach_add(_torch.foreach_mul(v, b2),
                               _torch.foreach_mul(_torch.foreach_mul(g, g), 1 - b2))
    else:
        v = _torch.foreach_addcmul(_torch.foreach_mul(v, b2), g, g, value=1 - b2)
    bias1 = 1 - b1 ** step
    bias2_sqrt = torch.sqrt(1 - b2 ** step)
    denom = _torch.foreach_add(_torch.foreach_div(_torch.foreach_sqrt(v), bias2_sqrt), eps)
    idx = [i for i, d in enumerate(decay) if d]
    if idx and _nonzero(weight_decay):
        p = list(p)
        for i, x in zip(idx, _torch.foreach_mul(_subset(p, idx), 1 - lr * weight_decay)):
            p[i] = x
    p = _torch.foreach_sub(p, _torch.foreach_mul(_torch.foreach_div(m, denom), lr / bias1))
    new_state = {"step": step, "m": treedef.unflatten(m), "v": treedef.unflatten(v)}
    return treedef.unflatten(p), new_state


def _fused_lr(lr, device: torch.device):
    """``lr`` as the fused kernel takes it: a float, or a 0-d tensor (float32 on the
    parameters' device for CUDA's kernel; as it is on CPU: NOTE [Traced hyperparameters])."""
    if not isinstance(lr, torch.Tensor):
        return lr
    if lr.dim() != 0:
        raise ValueError(f"adamw: lr must be a float, a 0-d tensor or a schedule; got a tensor "
                         f"of shape {tuple(lr.shape)}.")
    if device.type == "cuda":
        return lr.to(device=device, dtype=torch.float32)
    return lr


def _fusable(*lists) -> bool:
    """Can torch's fused AdamW kernel run these (floating point, one dtype and device,
    CPU or CUDA, as torch.optim's ``fused=True`` requires; not eager DTensors, whose
    sharding strategy for the functional kernel is broken in torch 2.13: NOTE [Fused
    optimizer kernels] in sharded/modes/_expand.py)?"""
    tensors = [t for xs in lists for t in xs]
    if not tensors or any(_torch.is_dtensor(_torch.functorch_base(t)) for t in tensors):
        return False
    dtype, device = tensors[0].dtype, tensors[0].device
    return (dtype.is_floating_point and device.type in ("cpu", "cuda", "meta")
            and all(t.dtype == dtype and t.device == device for t in tensors))


# ---------------------------------------------------------------------------------------
# Global-norm clipping
# ---------------------------------------------------------------------------------------

# NOTE [One reduction for a global norm]
# The squared global norm of a pytree is the sum of its leaves' sums of squares. Under
# pjit each leaf's sum is this rank's share of a sum over the mesh axes that split the
# leaf, and a plain traced ``sum(g.pow(2).sum() for g in leaves)`` leaves DTensor (and
# the modes' pending-sum policy) to reduce each split leaf's share before adding it to a
# replicated one: one scalar all-reduce per split leaf and axis (3 on the test MLP's
# ("dp", "tp") Megatron specs; where every leaf is split, the shares stay pending to
# one: NOTE [Adding zero] in sharded/rewrites/algebra.py). ``sharded::sum_of_squares`` is one op over the list,
# with its own expansion: each leaf's pending sums (a gradient not yet reduced) are
# done first, the rank sums the squares of its blocks of every leaf, counting a leaf
# that is replicated over a split axis only on that axis's coordinate 0 (so each
# element counts once), and one all-reduce of the scalar over the split axes finishes
# it (over every axis of the mesh at once where there are several: NOTE [One reduction
# over every mesh axis] in sharded/_torch.py). On one device it is the sum itself.

def _acc_dtype(xs) -> torch.dtype:
    dtype = torch.float32
    for x in xs:
        dtype = torch.promote_types(dtype, x.dtype)
    return dtype


@torch.library.custom_op("sharded::sum_of_squares", mutates_args=())
def _sum_of_squares(xs: list[torch.Tensor]) -> torch.Tensor:
    acc = _acc_dtype(xs)
    return torch.stack([x.to(acc).pow(2).sum() for x in xs]).sum()


@_sum_of_squares.register_fake
def _(xs):
    return xs[0].new_empty((), dtype=_acc_dtype(xs))


def _sum_of_squares_backward(ctx, grad):
    return [2 * x * grad.to(x.dtype) for x in ctx.saved_tensors]


def _sum_of_squares_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[0])


_sum_of_squares.register_autograd(_sum_of_squares_backward, setup_context=_sum_of_squares_setup)
SUM_OF_SQUARES = torch.ops.sharded.sum_of_squares.default


def _is_split(placement) -> bool:
    return not isinstance(placement, Replicate) and not _torch.is_partial(placement)


def _expand_sum_of_squares(ex, node, args, kwargs):
    """NOTE [One reduction for a global norm]."""
    xs = [ex.as_dtensor(x) for x in args[0]]
    xs = [ex.redistribute(x, [Replicate() if _torch.is_partial(p) else p for p in x.placements])
          for x in xs]
    mesh, ndim = ex.mesh, ex.mesh.ndim
    split = sorted({j for x in xs for j, p in enumerate(x.placements) if _is_split(p)})
    # one all-reduce over every rank only where the split axes are all the mesh's (of
    # more than one rank): a pipelined step's "pp" axis is split by stage, not by
    # layout, and each stage's ranks sum their own (sharded/pipelining/_split.py)
    everywhere = all(j in split or mesh.shape[j] == 1 for j in range(ndim))
    group = _torch.mesh_group(mesh.device_mesh) if len(split) > 1 and everywhere else None
    if group is not None:
        split = list(range(ndim))
    coord = mesh.coordinate()
    acc = _acc_dtype(xs)
    parts = [_torch.local_tensor(x).to(acc).pow(2).sum() for x in xs
             if not any(isinstance(x.placements[j], Replicate) and coord[j] for j in split)]
    device = _torch.local_tensor(xs[0]).device
    local = torch.stack(parts).sum() if parts else torch.zeros((), dtype=acc, device=device)
    replicated = (Replicate(),) * ndim
    if group is not None:
        out = _torch.WAIT_OP(_torch.c10d_functional.all_reduce.default(local, "sum", group))
        return ex.globals_of([out], [replicated], [()])[0]
    pending = tuple(Partial() if j in split else Replicate() for j in range(ndim))
    total = ex.globals_of([local], [pending], [()])[0]
    return ex.redistribute(total, replicated)


_registry.define(SUM_OF_SQUARES, expand=_expand_sum_of_squares)


def global_norm(tree) -> torch.Tensor:
    """The L2 norm of all the leaves of ``tree`` together (float32, or float64 if a leaf
    is), with one scalar reduction under pjit (NOTE [One reduction for a global norm]).
    Eager DTensors (outside pjit) may live on different meshes: each leaf's sum is
    reduced on its own mesh, and the sums are added as plain tensors."""
    leaves = [x for x in optree.tree_leaves(tree) if isinstance(x, torch.Tensor)]
    if not leaves:
        raise ValueError("global_norm: the tree has no tensor leaves.")
    if any(_torch.is_dtensor(_torch.functorch_base(x)) for x in leaves):
        acc = _acc_dtype(leaves)
        total = None
        for x in leaves:
            s = x.to(acc).pow(2).sum()
            s = s.full_tensor() if isinstance(s, DTensor) else s
            total = s if total is None else total + s.to(total.device)
        assert total is not None
        return total.sqrt()
    return SUM_OF_SQUARES(leaves).sqrt()


def clip_by_global_norm(grads, max_norm: float):
    """``grads`` scaled by ``min(1, max_norm / (norm + 1e-6))``, and ``norm``, their
    global L2 norm before clipping: ``torch.nn.utils.clip_grad_norm_``'s formula, as a
    function. Returns ``(grads, norm)``. Under pjit the norm costs one scalar all-reduce
    per step over any mix of layouts (NOTE [One reduction for a global norm]); outside
    pjit it takes DTensors on different meshes (which clip_grad_norm_ rejects)."""
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm > 0:
        raise ValueError(
            f"clip_by_global_norm: max_norm must be a positive number; got {max_norm!r}. "
            f"Pass the largest gradient norm to allow (e.g. 1.0), or leave the clip out.")
    leaves, treedef = optree.tree_flatten(grads)
    norm = global_norm(leaves)
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    tensors = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    if any(isinstance(leaves[i], DTensor) for i in tensors):
        # eager DTensors, maybe on several meshes: the coefficient replicated on each
        scaled = [leaves[i] * _replicated_like(coef, leaves[i]) for i in tensors]
    else:
        scaled = list(_torch.foreach_mul([leaves[i] for i in tensors], coef))
    out = list(leaves)
    for i, x in zip(tensors, scaled):
        out[i] = x.to(leaves[i].dtype) if x.dtype != leaves[i].dtype else x
    return treedef.unflatten(out), norm


def _replicated_like(value: torch.Tensor, x):
    if not isinstance(x, DTensor):
        return value
    return DTensor.from_local(value.to(_torch.local_tensor(x).device), x.device_mesh,
                              [Replicate()] * x.device_mesh.ndim, run_check=False)


# ---------------------------------------------------------------------------------------
# Gradient accumulation
# ---------------------------------------------------------------------------------------

# NOTE [Gradient accumulation in one program]
# ``accumulate`` runs ``grad_fn`` on ``num_microbatches`` micro-batches in a Python loop
# that the trace unrolls, adding each micro-batch's results into a running sum, and
# divides by the count once at the end. The trace is sequential: micro-batch i's
# forward and backward finish (and the generated code frees their activations) before
# micro-batch i+1 starts, so the step holds the activations of one micro-batch. Under
# pjit a gradient is a pending sum over the batch axes until something needs it
# reduced; adding two pending sums keeps it pending (NOTE [Where a pending reduction may
# travel] in sharded/modes/_pending.py), so the sum over micro-batches is reduced once
# per step, as with one micro-batch. Micro-batch i is rows i, i + N, i + 2N, ... of
# the batch (a reshape to [B / N, N, ...] and a select): that keeps each rank's rows on
# the rank when the batch is split over its first dim, where contiguous slices would
# cut across the ranks' blocks and move rows.

def accumulate(grad_fn: Callable, params, *batch, num_microbatches: int, batch_dim: int = 0):
    """``grad_fn(params, *micro_batch)`` over ``num_microbatches`` micro-batches of
    ``batch``, averaged: returns the mean over micro-batches of whatever ``grad_fn``
    returns (a pytree of tensors: the gradients, or ``(grads, loss)`` from
    ``torch.func.grad_and_value``). For a loss that is a mean over examples, that is
    the full batch's gradient and loss. Every tensor in ``batch`` is split on
    ``batch_dim``, whose size must divide by ``num_microbatches``; micro-batch ``i`` is
    rows ``i, i + N, ...`` (NOTE [Gradient accumulation in one program]). Other leaves
    are passed to every micro-batch as they are."""
    n = num_microbatches
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"accumulate: num_microbatches must be an int >= 1; got {n!r}.")
    tree: list = list(batch)
    paths, leaves, treedef = optree.tree_flatten_with_path(tree)  # type: ignore[var-annotated,arg-type]
    for path, x in zip(paths, leaves):
        if isinstance(x, torch.Tensor):
            if x.dim() <= batch_dim:
                raise ValueError(f"accumulate: batch{_index(path)} has shape {tuple(x.shape)}, "
                                 f"no dim {batch_dim} to split into micro-batches; pass it "
                                 f"through grad_fn's closure instead.")
            if x.shape[batch_dim] % n:
                raise ValueError(
                    f"accumulate: batch{_index(path)} has {x.shape[batch_dim]} rows on dim "
                    f"{batch_dim}, which do not divide into num_microbatches={n}; pick a "
                    f"num_microbatches that divides the batch size.")
    if n == 1:
        return grad_fn(params, *batch)
    total = None
    for i in range(n):
        micro = treedef.unflatten([_micro(x, i, n, batch_dim) for x in leaves])
        out = grad_fn(params, *micro)
        total = out if total is None else optree.tree_map(torch.add, total, out)
    assert total is not None
    return optree.tree_map(lambda t: t / n, total)


def _micro(x, i: int, n: int, dim: int):
    if not isinstance(x, torch.Tensor):
        return x
    return x.unflatten(dim, (x.shape[dim] // n, n)).select(dim + 1, i)


def _index(path: tuple) -> str:
    return "".join(f"[{k!r}]" for k in path)      # path[0]: the position in batch

