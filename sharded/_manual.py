"""Manual regions (the inside of shard_map): the mesh they run on, and which values
vary over which mesh axes.

# NOTE [Varying manual axes]
Inside shard_map each value is either the same on every rank of a mesh axis
(invariant over it) or may differ (varying). Inputs vary over the axes their in_spec
names; collectives change the set (``psum`` over an axis makes a value invariant over
it, ``psum_scatter`` makes it varying, ...). The set matters for gradients: where an
invariant value meets a varying one, it is implicitly ``pvary``'d, an identity whose
transpose is a ``psum`` of the cotangent over those axes. That is what makes the
gradient of a replicated parameter used with a sharded batch the sum of the per-rank
contributions, as in the single-device program (JAX's check_vma, the same rules).

The sets are tracked while the body is traced (never at run time) by a
TorchFunctionMode that tags every tensor result with the union of its inputs' sets
and inserts the implicit ``pvary``. Tags live on the tensor objects; tensors the
tracker never saw (made inside a nested torch.func transform) are treated as varying
over every axis of the region.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import optree
import torch
from torch.overrides import TorchFunctionMode

if TYPE_CHECKING:
    from sharded.mesh import Mesh

_ATTR = "_sharded_vma"
_STATE = threading.local()


@dataclass
class ManualContext:
    mesh: Mesh
    check_vma: bool
    api: str                # e.g. "shard_map(body)", for messages


def current(api: str) -> ManualContext:
    ctx = getattr(_STATE, "ctx", None)
    if ctx is None:
        raise RuntimeError(
            f"{api} is a collective over named mesh axes and runs only inside a "
            f"shard_map body (or a function it calls); wrap the code in "
            f"shard_map(fn, mesh=..., in_specs=..., out_specs=...)."
        )
    return ctx


def active() -> ManualContext | None:
    return getattr(_STATE, "ctx", None)


class manual_region:
    """Context: run a shard_map body (tracks varying axes when check_vma)."""

    def __init__(self, ctx: ManualContext):
        self.ctx = ctx
        # Always tracked: the implicit pvary is what makes gradients right;
        # check_vma only decides whether outputs are checked against their specs.
        self.mode = _VmaMode(ctx)

    def __enter__(self):
        if getattr(_STATE, "ctx", None) is not None:
            raise NotImplementedError(
                f"{self.ctx.api}: shard_map inside another shard_map body is not supported."
            )
        _STATE.ctx = self.ctx
        if self.mode is not None:
            self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        try:
            if self.mode is not None:
                self.mode.__exit__(*exc)
        finally:
            _STATE.ctx = None


class untracked:
    """Run a collective's internals without varying-axes tracking (it sets its
    result's axes itself)."""

    def __enter__(self):
        self.prev = getattr(_STATE, "raw", False)
        _STATE.raw = True

    def __exit__(self, *exc):
        _STATE.raw = self.prev


# -- the sets -----------------------------------------------------------------------

def vma_of(x) -> frozenset:
    v = getattr(x, _ATTR, None)
    if v is None:
        ctx = active()
        return frozenset(ctx.mesh.axis_names) if ctx is not None else frozenset()
    return v


def set_vma(x, axes) -> None:
    if isinstance(x, torch.Tensor):
        try:
            setattr(x, _ATTR, frozenset(axes))
        except (AttributeError, RuntimeError):
            pass


class _VmaMode(TorchFunctionMode):
    def __init__(self, ctx: ManualContext):
        super().__init__()
        self.ctx = ctx

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(_STATE, "raw", False):
            return func(*args, **kwargs)   # inside a collective: it sets its own sets
        if func in _PASSTHROUGH:
            return func(*args, **kwargs)
        flat, spec = _flatten((args, kwargs))
        tensors = [x for x in flat if isinstance(x, torch.Tensor)]
        if not tensors:   # factories (zeros, arange, tensor(...)): the same on every rank
            out = func(*args, **kwargs)
            for r in _flatten(out)[0]:
                set_vma(r, ())
            return out
        sets = [vma_of(t) for t in tensors]
        union = frozenset().union(*sets)
        if len(set(sets)) > 1 and _is_compute(func):
            flat = [
                pvary(x, union - vma_of(x)) if isinstance(x, torch.Tensor) and vma_of(x) != union else x
                for x in flat
            ]
            args, kwargs = _unflatten(spec, flat)
        out = func(*args, **kwargs)
        for r in _flatten(out)[0]:
            if isinstance(r, torch.Tensor) and getattr(r, _ATTR, None) is None:
                set_vma(r, union)
        return out


# Autograd machinery takes tensors but computes nothing the sets apply to (and
# pvary'ing the outputs handed to autograd.grad would cut them from their graph).
_PASSTHROUGH = {
    torch.autograd.grad, torch.autograd.backward, torch.Tensor.backward,
    torch.Tensor.requires_grad_, torch.Tensor.retain_grad, torch.Tensor.register_hook,
}


def _is_compute(func) -> bool:
    # Metadata queries and in-place setters take tensors but make no new values.
    name = getattr(func, "__name__", "")
    return name not in {"__get__", "__set__", "size", "dim", "numel", "stride", "is_contiguous"}


def _flatten(tree):
    return optree.tree_flatten(tree, none_is_leaf=True)


def _unflatten(spec, leaves):
    return optree.tree_unflatten(spec, leaves)


# -- pvary ----------------------------------------------------------------------------

class _PVary(torch.autograd.Function):
    @staticmethod
    def forward(x, axes):
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.axes = inputs[1]

    @staticmethod
    def backward(ctx, ct):
        from sharded.collectives import psum

        return psum(ct, ctx.axes), None


def pvary(x: torch.Tensor, axes) -> torch.Tensor:
    """Mark ``x`` as varying over ``axes`` (identity; its transpose is psum)."""
    axes = tuple(sorted(axes, key=str))
    if not axes:
        return x
    out = _PVary.apply(x, axes)
    set_vma(out, vma_of(x) | set(axes))
    return out


# -- bodies in traced programs ------------------------------------------------------------
# NOTE [shard_map in a traced program]
# Inside pjit's global trace, a shard_map call becomes one ``sharded::shard_map`` op
# (and, under torch.func.grad, a ``sharded::shard_map_vjp`` op for its backward). Both
# name a registered ManualBody. The partitioner runs the body on this rank's shards
# (``run_body``), so the body's ops and collectives are traced straight into the local
# program; the vjp op re-runs the body under torch.func.vjp, whose forward collectives
# CSE merges with the forward op's.


@dataclass
class ManualBody:
    fn: Callable[..., Any]       # flat local tensors -> flat local tensors
    mesh: Mesh
    name: str
    check_vma: bool
    in_placements: list          # per input
    in_vma: list                 # frozenset of axes each input varies over
    out_placements: list         # per output
    out_allowed: list            # axes each output may vary over (its spec's axes)
    out_paths: list              # "out_specs[0]" etc., for messages
    out_shapes: list             # global
    out_dtypes: list


_BODIES: list[ManualBody] = []


def register_body(body: ManualBody) -> int:
    _BODIES.append(body)
    return len(_BODIES) - 1


def get_body(body_id: int) -> ManualBody:
    return _BODIES[body_id]


def run_body(body: ManualBody, local_inputs: list, describe=None) -> list:
    """Run ``body`` on this rank's shards and check its outputs' varying axes.
    ``describe(outs)``, if given, fills in the body's output layouts first (the
    trace-time run that infers them)."""
    with manual_region(ManualContext(body.mesh, body.check_vma, body.name)):
        return _body_outputs(body, local_inputs, describe)


def _body_outputs(body: ManualBody, local_inputs: list, describe=None) -> list:
    for x, v in zip(local_inputs, body.in_vma):
        set_vma(x, v)
    outs = list(body.fn(*local_inputs))
    if describe is not None:
        describe(outs)
    if body.check_vma:
        for o, allowed, path in zip(outs, body.out_allowed, body.out_paths):
            extra = vma_of(o) - allowed
            if extra:
                axis = sorted(extra)[0]
                raise ValueError(
                    f"{path} does not name mesh axis {axis!r}, so the "
                    f"output must be the same on every rank along it, but the function "
                    f"leaves it varying over {axis!r}. Reduce it (psum/pmean/"
                    f"all_gather over {axis!r}) or add {axis!r} to its spec. "
                    f"(check_vma=False skips this check.)"
                )
    return outs


@torch.library.custom_op("sharded::shard_map", mutates_args=())
def _shard_map_op(inputs: list[torch.Tensor], body_id: int) -> list[torch.Tensor]:
    raise RuntimeError("sharded::shard_map runs only inside pjit's partitioner.")


@_shard_map_op.register_fake
def _(inputs, body_id):
    b = get_body(body_id)
    device = inputs[0].device if inputs else torch.device("cpu")
    return [torch.empty(s, dtype=d, device=device) for s, d in zip(b.out_shapes, b.out_dtypes)]


@torch.library.custom_op("sharded::shard_map_vjp", mutates_args=())
def _shard_map_vjp_op(inputs: list[torch.Tensor], cotangents: list[torch.Tensor],
                      body_id: int) -> list[torch.Tensor]:
    raise RuntimeError("sharded::shard_map_vjp runs only inside pjit's partitioner.")


@_shard_map_vjp_op.register_fake
def _(inputs, cotangents, body_id):
    return [torch.empty_like(x) for x in inputs]


SHARD_MAP_OP = torch.ops.sharded.shard_map.default
SHARD_MAP_VJP_OP = torch.ops.sharded.shard_map_vjp.default


def differentiable(x: torch.Tensor) -> bool:
    return x.dtype.is_floating_point or x.dtype.is_complex


def run_body_vjp(body: ManualBody, local_inputs: list, local_cts: list) -> list:
    """Gradients of the body's inputs on this rank (zeros for integer inputs)."""
    which = [i for i, x in enumerate(local_inputs) if differentiable(x)]

    def f(*xs):
        full = list(local_inputs)
        for i, x in zip(which, xs):
            full[i] = x
        return _body_outputs(body, full)

    # Forward and backward both run in the region: transposes call collectives.
    with manual_region(ManualContext(body.mesh, body.check_vma, body.name)):
        outs, vjp_fn = torch.func.vjp(f, *[local_inputs[i] for i in which])
        grads = vjp_fn([ct.to(o.dtype) for ct, o in zip(local_cts, outs)])
    result = [torch.zeros_like(x) for x in local_inputs]
    for i, g in zip(which, grads):
        result[i] = g
    return result
