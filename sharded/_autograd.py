"""pjit under autograd: a pjit'd function as one ``autograd.Function`` whose forward
and backward are partitioned per-rank programs, traced and cached together.

# NOTE [pjit under autograd]
A call whose tensor inputs require grad (DTensor parameters before ``loss.backward()``)
or are torch.func-wrapped (``torch.func.grad``, ``vjp``, ``jacrev``) is keyed with its
requires-grad flags and compiled from the joint program (NOTE [The joint program] in
``sharded/_trace.py``), split by torch's partitioner into two global programs:

- the forward: the function's outputs, then the values the backward needs (the
  residuals); partitioned with the call's in_specs and out_specs, the residuals
  keeping the layout propagation gives them (pending sums reduced);
- the backward: residuals and one cotangent per output that requires grad, laid out
  as the forward produced them, to one gradient per input that needs one, laid out
  as that input enters the program (its in_specs, or the layout the mode chose).

Both are partitioned by the pjit's mode like any program, so a gradient's collectives
are those of the single-device backward run on DTensors: a replicated parameter's
gradient is reduced once, in a bucket, and equals the single-device gradient.
``PjitFunction`` runs them: ``forward`` (outputs and residuals; residuals are
returned as outputs, marked non-differentiable and saved in ``setup_context``, which
is what torch.func needs), ``backward`` (``BackwardFunction``: its own autograd.Function
so that ``jacrev``'s vmap over the backward has a rule, a loop over the batch, and
so that differentiating the backward again raises). The backward program agrees
across ranks like any call (sharded/sync.py) and its failures reach every rank.
A gradient is laid out like its input: a DTensor input's gradient is redistributed
to the input's own placements when the program took it in another layout; a plain
input's gradient is the full tensor on every rank. Random draws are in the forward
and the backward reads what they drew (a saved residual): nothing is drawn twice.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate

from sharded import _torch, random as srandom, sync
from sharded._arguments import VMAP
from sharded.spec import reduced

_HIGHER_ORDER = (
    "{name}: its backward is not differentiable (higher-order gradients through a pjit "
    "call are not supported). Put the outer transform inside the function instead, e.g. "
    "pjit(torch.func.grad(torch.func.grad(f)), ...)."
)
_JVP = (
    "{name}: forward-mode differentiation (torch.func.jvp, jacfwd) through a pjit call "
    "is not supported; use reverse mode (grad, vjp, jacrev) or put the transform "
    "inside the function."
)


class Call:
    """One differentiable call: its cache entry and the layouts its inputs came in."""

    __slots__ = ("entry", "sources")

    def __init__(self, entry, sources: list):
        self.entry = entry
        self.sources = sources       # per tensor input: its placements (DTensor) or None (plain)


def apply(entry, tensors: list) -> list:
    """Run ``entry`` (a differentiable cache entry) on ``tensors`` (its tensor inputs)
    under autograd; returns the tensor outputs."""
    call = Call(entry, [tuple(t.placements) if isinstance(t, DTensor) else None
                        for t in (_torch.functorch_base(x) for x in tensors)])
    outs = PjitFunction.apply(call, *tensors)
    return list(outs[:entry.n_tensor_out])


class PjitFunction(torch.autograd.Function):
    """NOTE [pjit under autograd]."""

    @staticmethod
    def forward(call: Call, *tensors):
        outs, residuals = call.entry.forward(list(tensors))
        return (*outs, *residuals)

    @staticmethod
    def setup_context(ctx, inputs, output):
        call = inputs[0]
        entry = call.entry
        n = entry.n_tensor_out
        ctx.call = call
        ctx.set_materialize_grads(False)
        nondiff = [o for o, d in zip(output[:n], entry.diff_out) if not d]
        ctx.mark_non_differentiable(*nondiff, *output[n:])
        # NOTE [Differentiating the backward]: the inputs that get a gradient are
        # saved too, as anchors of the backward
        anchors = [inputs[1 + i] for i in entry.grad_in]
        ctx.n_residuals = len(output) - n
        ctx.n_anchors = len(anchors)
        # NOTE [Outputs the backward reads]: an output that shares storage with a
        # residual is saved too, so that an in-place update of it before the backward
        # raises torch's own "modified by an inplace operation" error, as in eager
        # code, instead of giving a wrong gradient
        ctx.save_for_backward(*output[n:], *anchors, *_read_by_backward(output[:n], output[n:]))

    @staticmethod
    def backward(ctx, *grads):
        call = ctx.call
        entry = call.entry
        n = entry.n_tensor_out
        cotangents = [g for g, d in zip(grads[:n], entry.diff_out) if d]
        out = [None] * (1 + len(call.sources))
        if entry.backward is None or not entry.grad_in:
            return tuple(out)
        if all(g is None for g in cotangents):
            return tuple(out)
        saved = ctx.saved_tensors       # (checks the versions of the saved outputs)
        k = ctx.n_residuals
        grads_in = BackwardFunction.apply(call, k, len(cotangents), *saved[:k], *cotangents,
                                          *saved[k:k + ctx.n_anchors])
        for i, g in zip(entry.grad_in, grads_in):
            out[1 + i] = g
        return tuple(out)

    @staticmethod
    def vmap(info, in_dims, call, *tensors):
        raise NotImplementedError(VMAP.format(name=call.entry.name))

    @staticmethod
    def jvp(ctx, *tangents):
        raise NotImplementedError(_JVP.format(name=ctx.call.entry.name))


def _storage(t):
    if not isinstance(t, torch.Tensor):
        return None
    local = _torch.local_tensor(t) if isinstance(t, DTensor) else t
    if _torch.is_functorch_wrapped(local):
        return None              # (torch.func's wrappers have no storage to compare)
    return _torch.storage_key(local)


def _read_by_backward(outs, residuals) -> list:
    """The outputs that share storage with a residual (NOTE [Outputs the backward
    reads]): ``exp``'s backward reads its result, which is also the output."""
    saved = {_storage(r) for r in residuals} - {None}
    return [o for o in outs if _storage(o) in saved]


# NOTE [Differentiating the backward]
# The backward program is first order: its residuals leave the forward marked
# non-differentiable, so autograd would see the gradients it returns as constants of
# the inputs and a second derivative taken through them would be silently zero
# (torch.func.grad of torch.func.grad, or torch.autograd.grad with create_graph=True
# followed by a backward through the gradients). So ``BackwardFunction`` also takes
# the inputs that get a gradient (saved by ``PjitFunction``) as anchors it does not
# read: when the differentiation is nested, its outputs depend on them for autograd,
# and differentiating them reaches ``BackwardFunction.backward``, which raises.


class BackwardFunction(torch.autograd.Function):
    """The backward program as an autograd.Function: a vmap rule (``jacrev``) and a
    clear error when it is differentiated again (NOTE [Differentiating the backward])."""

    @staticmethod
    def forward(call: Call, n_res: int, n_cot: int, *tensors):
        return tuple(_run_backward(call, list(tensors[:n_res]),
                                   list(tensors[n_res:n_res + n_cot])))

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.name = inputs[0].entry.name

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError(_HIGHER_ORDER.format(name=ctx.name))

    @staticmethod
    def vmap(info, in_dims, call, n_res, n_cot, *tensors):
        # jacrev: vmap over the cotangents. The program is per example; run it once
        # per element of the batch.
        dims = in_dims[3:]
        results = []
        for b in range(info.batch_size):
            args = [t if d is None else t.select(d, b) for t, d in zip(tensors, dims)]
            results.append(BackwardFunction.apply(call, n_res, n_cot, *args))
        stacked = tuple(torch.stack([r[k] for r in results]) for k in range(len(results[0])))
        return stacked, (0,) * len(stacked)


def _run_backward(call: Call, residuals: list, cotangents: list) -> list:
    entry = call.entry
    bw = entry.backward
    name = f"{entry.name} backward"
    try:
        outcome = bw.outcome(cotangents)
    except Exception as e:  # noqa: BLE001 - every rank must hear about it
        outcome = e
    states = sync.agree(bw.mesh, name, outcome)
    if states is not None and bw.n_draws:
        srandom._settle(states, name)
    return sync.run_guarded(name, _gradients, call, residuals, cotangents, mesh=bw.mesh)


def _gradients(call: Call, residuals: list, cotangents: list) -> list:
    """Run the backward program; each gradient laid out like its input."""
    entry = call.entry
    bw = entry.backward
    locals_ = bw.run(residuals, cotangents)
    dm = bw.mesh.device_mesh
    grads = []
    for i, local, spec in zip(entry.grad_in, locals_, bw.grad_specs):
        dt = _torch.make_dtensor(local, spec)
        src = call.sources[i]
        g: torch.Tensor = dt
        if src is None:                          # a plain input: the full gradient
            g = dt.full_tensor() if any(not isinstance(p, Replicate) for p in spec.placements) \
                else local
        elif src != tuple(spec.placements):
            g = dt.redistribute(dm, reduced(src))
        grads.append(g)
    return grads
