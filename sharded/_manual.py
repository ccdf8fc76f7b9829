"""Manual regions (the inside of shard_map): the mesh a body runs on, and which values
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

# NOTE [Two trackers: dispatch level and function level]
The set of every value (its "vma") is computed by a TorchDispatchMode, which sees
every aten op the body runs on plain tensors: below autograd and below torch.func,
so also the ops of a torch.func.grad/vmap nested in the body, the backward ops that
autograd runs, in-place ops and factories. Its rule is JAX's: a result varies over
the union of its tensor inputs' axes; a collective has its own rule (its entry in
the registry of primitives, sharded/_registry.py, filled beside the collective); a
random op draws from the counter-based generator (the draw hook, filled by
sharded/random/rewrite.py); an in-place op updates the destination's set
(and its base's). A tensor no op of the region produced (a constant the body closes
over) is invariant: it is the same Python value on every rank.

The implicit ``pvary`` must be visible to autograd, so a TorchFunctionMode (above
autograd) inserts it: when a call's floating-point tensor arguments vary over
different axes, the less varying ones are ``pvary``'d to the union. It reads a
torch.func wrapper's set from the plain tensor under it (the same object the
dispatch tracker tagged). The sets are tags on those plain tensors, scoped by a
token per region run, so a stale tag from another run is never read.

The function mode also guards the boundary of the region: a DTensor in the body is
an error (bodies see local tensors); in a traced body, a traced value of the
enclosing program that the body closes over is captured as an extra replicated
input (NOTE [Closures] in sharded/_region.py); in an eager body, Python control flow
on a varying value (``bool``, ``item``) is an error, since ranks would take
different paths.

# NOTE [Hooks of the manual layer]
This module is the lowest layer of shard_map: the collectives (sharded/collectives.py),
the random draws (sharded/random/rewrite.py) and the regions (sharded/_region.py) are
built on it and import it; it imports none of them. Where it needs them it reads the
registry of primitives (varying-axes rules) or calls a hook that the layer above
fills when it is imported: the implicit ``pvary`` (``set_pvary_hooks``, from
collectives) and a body's random draws (``set_draw_hooks``, from random.rewrite).
Entering a region checks that both are filled: every module that enters one
(_region, _shard_map) imports both layers.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import optree
import torch
from torch.overrides import TorchFunctionMode

from sharded import _registry, _torch, random as srandom

if TYPE_CHECKING:
    from sharded.mesh import Mesh

_ATTR = "_sharded_vma"
_STATE = threading.local()


class _Hooks:
    """The slots the layers above fill (NOTE [Hooks of the manual layer])."""

    pvary: Callable | None = None        # (x, axes) -> x varying over the axes too
    pvary_: Callable | None = None       # in place, before an in-place op
    is_random: Callable | None = None    # (func, args, kwargs) -> does the call draw?
    draw: Callable | None = None         # (ctx, func, args, kwargs) -> the call's values


_HOOKS = _Hooks()


def set_pvary_hooks(pvary: Callable, pvary_: Callable) -> None:
    _HOOKS.pvary, _HOOKS.pvary_ = pvary, pvary_


def set_draw_hooks(is_random: Callable, draw: Callable) -> None:
    _HOOKS.is_random, _HOOKS.draw = is_random, draw


def _check_hooks(api: str) -> None:
    missing = [m for m, filled in (("sharded.collectives", _HOOKS.pvary),
                                   ("sharded.random.rewrite", _HOOKS.draw)) if filled is None]
    if missing:
        raise RuntimeError(f"{api}: internal error: a manual region entered before "
                           f"{' and '.join(missing)} filled its hooks (import it first).")


@dataclass
class ManualContext:
    mesh: Mesh
    check_vma: bool
    api: str                     # e.g. "shard_map(body)", for messages
    eager: bool = False          # True: real values, collectives run now
    fake_mode: object = None     # traced: the region's FakeTensorMode
    rng_state: object = None     # traced: the region's (seed, offset) input
    n_draws: int = 0             # traced: random draws so far
    captures: dict = field(default_factory=dict)   # id(outer value) -> stand-in
    new_captures: list = field(default_factory=list)
    outer_transforms: bool = False   # traced under a torch.func transform of the program
    token: object = field(default_factory=object)

    # -- the region's boundary ----------------------------------------------------
    def local_value(self, x, below_transforms: bool = False):
        """``x`` as the body may use it: DTensors are an error, a traced value of the
        enclosing program is replaced by its capture (see NOTE [Closures])."""
        if _torch.is_dtensor(x):   # (not a TypeError: Python turns those into NotImplemented)
            raise ValueError(
                f"{self.api}: the body uses a DTensor of shape {tuple(x.shape)}; a shard_map "
                f"body sees local tensors. Pass it as an argument with an in_spec instead "
                f"of closing over it."
            )
        if self.eager:
            return x
        base = _torch.functorch_base(x)
        if _torch.is_fake(base) and _torch.fake_mode_of(base) is not self.fake_mode:
            return self.capture(x, base, below_transforms)
        return x

    def capture(self, x, base, below_transforms: bool = False):
        """The stand-in for a traced value of the enclosing program (keyed by the
        tensor under any torch.func wrapper: a transform inside the body wraps it
        anew each time)."""
        entry = self.captures.get(id(base))
        if entry is None and below_transforms and self.outer_transforms:
            # Seen first under a transform of the body, the value is known only by the
            # tensor under the enclosing transform's wrapper: capturing that would cut
            # the enclosing transform's gradient path (a silently missing gradient).
            raise closure_under_transforms(self.api)
        if entry is None:
            with untracked():
                stand_in = torch.empty(x.shape, dtype=x.dtype, device=x.device)
            entry = self.captures[id(base)] = (x, stand_in)
            self.new_captures.append(x)
        return entry[1]

    def check_concrete(self, what: str, x) -> None:
        """Python control flow on a tensor value (``bool(x)``, ``x.item()``)."""
        if self.eager:
            axes = vma_of(x)
            if axes:
                a = _ordered(self.mesh, axes)[0]
                raise ValueError(
                    f"{self.api}: {what} on a value that varies over mesh axis {a!r}: "
                    f"ranks could take different paths and then wait for each other's "
                    f"collectives forever. Python control flow may depend only on values "
                    f"that are the same on every rank: reduce it first (psum/pmax/"
                    f"all_gather over {a!r}), or use torch.where."
                )
            return
        if _torch.is_fake(_torch.functorch_base(x)):
            raise ValueError(
                f"{self.api}: {what} needs a concrete value, but inside a function that "
                f"pjit traces, the shard_map body is traced with abstract values. Use "
                f"torch.where for value-dependent choices, or call the shard_map outside "
                f"pjit (eagerly), where control flow on values that are the same on every "
                f"rank (a psum, a pmax) is allowed."
            )

    # -- random draws -------------------------------------------------------------
    def next_draw(self, device) -> tuple[torch.Tensor, int]:
        """(rng state, draw number) for the next random op of the body."""
        if not self.eager:
            draw = self.n_draws
            self.n_draws += 1
            return self.rng_state, draw
        with untracked():
            srandom._agree_on_seed(self.mesh)
            seed, offset = srandom._take(1, device)
            return torch.stack([seed, offset]), 0


def closure_under_transforms(name) -> NotImplementedError:
    # torch.func cannot wrap a wrapper of the enclosing program's transforms at the
    # body's own levels (an internal assertion); see ManualContext.capture.
    return NotImplementedError(
        f"{name}: the body closes over a traced value and uses it only inside a "
        f"torch.func transform of the body, while a torch.func transform encloses the "
        f"shard_map; pass the value as an argument (with in_spec P()) instead of closing "
        f"over it."
    )


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
    """Context: run (or trace) a shard_map body, tracking varying axes."""

    def __init__(self, ctx: ManualContext):
        self.ctx = ctx
        self.fn_mode = _VmaFunctionMode(ctx)
        self.dispatch_mode = _VmaDispatchMode(ctx)

    def __enter__(self):
        if getattr(_STATE, "ctx", None) is not None:
            raise NotImplementedError(
                f"{self.ctx.api}: shard_map inside another shard_map body is not supported."
            )
        _check_hooks(self.ctx.api)
        _STATE.ctx = self.ctx
        self.fn_mode.__enter__()
        self.dispatch_mode.__enter__()
        return self

    def __exit__(self, *exc):
        try:
            self.dispatch_mode.__exit__(*exc)
            self.fn_mode.__exit__(*exc)
        finally:
            _STATE.ctx = None


class untracked:
    """Run internals (a collective's lowering, the RNG tracker) without tracking."""

    def __enter__(self):
        self.prev = getattr(_STATE, "raw", False)
        _STATE.raw = True

    def __exit__(self, *exc):
        _STATE.raw = self.prev


def _raw() -> bool:
    return getattr(_STATE, "raw", False)


# -- the sets -----------------------------------------------------------------------

def vma_of(x) -> frozenset:
    """The mesh axes ``x`` may vary over (empty: the same on every rank)."""
    tag = getattr(_torch.functorch_base(x), _ATTR, None)
    ctx = active()
    if tag is None or ctx is None or tag[0] is not ctx.token:
        return frozenset()
    return tag[1]


def set_vma(x, axes) -> None:
    ctx = active()
    if ctx is None or not isinstance(x, torch.Tensor):
        return
    try:
        setattr(_torch.functorch_base(x), _ATTR, (ctx.token, frozenset(axes)))
    except (AttributeError, RuntimeError):
        pass


def _ordered(mesh, axes) -> tuple:
    return tuple(a for a in mesh.axis_names if a in axes)


def _leaves(tree) -> list:
    return optree.tree_leaves(tree, none_is_leaf=True)


def differentiable(x: torch.Tensor) -> bool:
    return x.dtype.is_floating_point or x.dtype.is_complex


def varying_to(x, axes: frozenset):
    """``x`` pvary'd to vary over ``axes`` (a superset of its own)."""
    missing = axes - vma_of(x)
    # in mesh order: a set's order differs between processes (string hashing), and the
    # ranks must build the same program
    return _HOOKS.pvary(x, _ordered(active().mesh, missing)) if missing else x


# -- the dispatch-level tracker ----------------------------------------------------------

class _VmaDispatchMode(_torch.dispatch_mode_base()):
    """Sets the vma of every result (NOTE [Two trackers])."""

    def __init__(self, ctx: ManualContext):
        super().__init__()
        self.ctx = ctx

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _raw():
            return func(*args, **kwargs)
        if not self.ctx.eager:       # captures that a transform in the body wrapped
            flat, spec = optree.tree_flatten((args, kwargs), none_is_leaf=True)
            local = [self.ctx.local_value(x, below_transforms=True) if isinstance(x, torch.Tensor)
                     else x for x in flat]
            if any(a is not b for a, b in zip(local, flat)):
                args, kwargs = optree.tree_unflatten(spec, local)
        rule = _registry.VMA_RULES.get(func)
        if rule is not None:
            out = func(*args, **kwargs)
            set_vma(out, rule(args, kwargs))
            return out
        if _HOOKS.is_random(func, args, kwargs):
            return _HOOKS.draw(self.ctx, func, args, kwargs)
        tensors = [x for x in _leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        union = frozenset().union(*(vma_of(t) for t in tensors))
        out = func(*args, **kwargs)
        for r in _leaves(out):
            if isinstance(r, torch.Tensor):
                set_vma(r, union)
        if union:
            for w in _torch.written_args(func, args, kwargs):
                set_vma(w, union)
                if w._base is not None:
                    set_vma(w._base, vma_of(w._base) | union)
        return out


# -- the function-level tracker --------------------------------------------------------

_T = torch.Tensor
# Calls that turn a tensor into a Python value (control flow depends on it).
_CONCRETIZE = {
    _T.__bool__: "bool(x)", _T.item: "x.item()", _T.tolist: "x.tolist()",
    _T.__int__: "int(x)", _T.__float__: "float(x)", _T.__index__: "an index from x",
    _T.__complex__: "complex(x)", _T.numpy: "x.numpy()",
}
# Autograd machinery takes tensors but computes nothing the sets apply to (and
# pvary'ing the outputs handed to autograd.grad would cut them from their graph).
_PASSTHROUGH = {
    torch.autograd.grad, torch.autograd.backward, _T.backward, _T.requires_grad_,
    _T.retain_grad, _T.register_hook,
}
# Metadata queries and attribute access make no new values from several inputs.
_NO_COMBINE = {"__get__", "__set__", "size", "dim", "numel", "stride", "is_contiguous",
               "__len__", "element_size", "data_ptr", "storage_offset", "nelement",
               "ndimension", "get_device", "is_floating_point", "is_complex",
               "__repr__", "__str__", "__format__", "untyped_storage"}
_INPLACE_DUNDER = {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__",
                   "__ifloordiv__", "__imod__", "__ipow__", "__iand__", "__ior__",
                   "__ixor__", "__ilshift__", "__irshift__", "__imatmul__"}


def _destinations(func, name: str, args, kwargs) -> list:
    dsts = []
    if name in _INPLACE_DUNDER or (name.endswith("_") and not name.startswith("__")):
        if args and isinstance(args[0], torch.Tensor):
            dsts.append(args[0])
    out = kwargs.get("out")
    dsts.extend(t for t in _leaves(out) if isinstance(t, torch.Tensor))
    return dsts


class _VmaFunctionMode(TorchFunctionMode):
    """Inserts the implicit pvary and guards the region's boundary (NOTE [Two
    trackers])."""

    def __init__(self, ctx: ManualContext):
        super().__init__()
        self.ctx = ctx

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _raw() or func in _PASSTHROUGH:
            return func(*args, **kwargs)
        ctx = self.ctx
        flat, spec = optree.tree_flatten((args, kwargs), none_is_leaf=True)
        local = [ctx.local_value(x) if isinstance(x, torch.Tensor) else x for x in flat]
        if any(a is not b for a, b in zip(local, flat)):
            flat = local
            args, kwargs = optree.tree_unflatten(spec, flat)
        what = _CONCRETIZE.get(func)
        if what is not None:
            ctx.check_concrete(what, args[0])
        name = getattr(func, "__name__", "")
        if name in _NO_COMBINE or _is_sharded_op(func):
            return func(*args, **kwargs)
        tensors = [x for x in flat if isinstance(x, torch.Tensor)]
        if len(tensors) < 2:
            return func(*args, **kwargs)
        sets = [vma_of(t) for t in tensors]
        union = frozenset().union(*sets)
        if any(s != union for s in sets):
            dsts = _destinations(func, name, args, kwargs)
            for d in dsts:
                _pvary_in_place(d, union)
            flat = [varying_to(x, union) if isinstance(x, torch.Tensor) and differentiable(x)
                    and not any(x is d for d in dsts) else x for x in flat]
            args, kwargs = optree.tree_unflatten(spec, flat)
        return func(*args, **kwargs)


def _pvary_in_place(dst, union: frozenset) -> None:
    """Before an in-place op makes ``dst`` vary over more axes, route the gradient of
    its old value through a pvary (whose transpose is the psum it needs). Only where
    autograd can see ``dst``; elsewhere the dispatch tracker's new tag is enough."""
    if not differentiable(dst) or not (dst.requires_grad or _torch.is_functorch_wrapped(dst)):
        return
    missing = union - vma_of(dst)
    if missing:
        _HOOKS.pvary_(dst, _ordered(active().mesh, missing))


def _is_sharded_op(func) -> bool:
    return isinstance(func, _torch.OpOverload) and func.namespace == "sharded"
