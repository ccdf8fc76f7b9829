"""Mixed precision: compute in a low-precision dtype, keep fp32 master state.

Two ways to ask for it (docs/precision.md):

- ``DataParallelMode(..., param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``,
  FSDP2's ``MixedPrecisionPolicy``: the mode traces the step under ``in_grad`` below
  (NOTE [Casts at use inside the differentiated function]) and reduces gradients in
  ``reduce_dtype`` (NOTE [A pending sum through a cast] in sharded/modes/_pending.py).
- ``Policy(param_dtype, output_dtype=...)``, for any mode and inside shard_map bodies,
  in jmp's manner: ``policy.wrap(loss_fn)`` casts the floating inputs of ``loss_fn``
  at its boundary and its floating outputs on the way out; differentiate the wrapped
  function and the gradients come back through the casts' backward, in the masters'
  dtype.

Both give the same values: each tensor is cast once per differentiated call, and a
cast's value does not depend on where in the program it runs.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import optree
import torch
import torch.fx as fx
from torch.overrides import TorchFunctionMode

from sharded import _torch

__all__ = ["Policy", "cast", "in_grad"]


def check_dtype(api: str, name: str, dtype, *, optional: bool = True) -> torch.dtype | None:
    """``dtype`` if it is a floating-point torch.dtype (or None where ``optional``),
    else an error naming ``api``, the argument and the fix."""
    if dtype is None and optional:
        return None
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        what = f"{dtype!r}" + ("" if isinstance(dtype, torch.dtype) else f" ({type(dtype).__name__})")
        raise ValueError(
            f"{api}: {name} must be a floating-point torch.dtype"
            f"{' or None' if optional else ''}; got {what}. Mixed precision casts "
            f"floating-point tensors only: pass e.g. {name}=torch.bfloat16 "
            f"(or torch.float16, torch.float32)."
        )
    return dtype


def cast(tree: Any, dtype: torch.dtype | None) -> Any:
    """``tree`` with each floating-point tensor leaf cast to ``dtype`` (integer and
    boolean tensors, and non-tensor leaves, as they are); ``dtype=None``: ``tree``.
    Differentiable: the gradient of a cast leaf comes back in the leaf's own dtype."""
    check_dtype("sharded.precision.cast", "dtype", dtype)
    if dtype is None:
        return tree
    return optree.tree_map(
        lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x,
        tree, none_is_leaf=True)


class Policy:
    """A functional mixed-precision policy (jmp's ``Policy``, FSDP2's names).

    - ``param_dtype``: the dtype the differentiated function computes in. ``wrap``
      casts every floating-point tensor in the wrapped function's arguments to it:
      parameters and floating inputs alike (FSDP2's ``param_dtype`` with
      ``cast_forward_inputs=True``; jmp's ``compute_dtype``). None: no cast.
    - ``output_dtype``: the dtype of the wrapped function's floating outputs:
      wrapping a model's forward with ``torch.float32`` gives fp32 logits, so the
      loss computed from them is fp32 (FSDP2's ``output_dtype``; jmp's
      ``output_dtype``). None: as computed.

    Masters are whatever the caller holds (fp32 parameters and optimizer state): the
    gradient of each cast parameter comes back through the cast's backward in the
    parameter's dtype. Where gradients are reduced, and in which dtype, is the
    mode's choice (``DataParallelMode(reduce_dtype=...)``); docs/precision.md.

    ::

        policy = Policy(param_dtype=torch.bfloat16)
        grads, loss = torch.func.grad_and_value(policy.wrap(loss_fn))(params, x, y)
        # or the forward in bf16, its outputs (and so the loss) in fp32:
        forward = Policy(torch.bfloat16, output_dtype=torch.float32).wrap(forward)
    """

    def __init__(self, param_dtype: torch.dtype | None = None, output_dtype: torch.dtype | None = None):
        self.param_dtype = check_dtype("sharded.precision.Policy", "param_dtype", param_dtype)
        self.output_dtype = check_dtype("sharded.precision.Policy", "output_dtype", output_dtype)

    def cast_to_compute(self, tree: Any) -> Any:
        """``tree``'s floating tensors in ``param_dtype``."""
        return cast(tree, self.param_dtype)

    def cast_to_output(self, tree: Any) -> Any:
        """``tree``'s floating tensors in ``output_dtype``."""
        return cast(tree, self.output_dtype)

    def wrap(self, fn: Callable) -> Callable:
        """``fn`` with its arguments cast to ``param_dtype`` and its outputs to
        ``output_dtype`` (positional and keyword arguments; non-tensor ones pass
        through)."""

        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            args, kwargs = self.cast_to_compute((args, kwargs))
            return self.cast_to_output(fn(*args, **kwargs))

        return wrapped

    def __eq__(self, other):
        return isinstance(other, Policy) and (self.param_dtype, self.output_dtype) == (
            other.param_dtype, other.output_dtype)

    def __hash__(self):
        return hash((Policy, self.param_dtype, self.output_dtype))

    def __repr__(self):
        return f"Policy(param_dtype={self.param_dtype}, output_dtype={self.output_dtype})"


# NOTE [Casts at use inside the differentiated function]
# FSDP2's MixedPrecisionPolicy is, in a program's terms: the forward that autograd
# differentiates sees its parameters (and floating forward inputs) in param_dtype; the
# gradient comes back through the cast's backward in the parameter's fp32; the
# optimizer, outside the forward, reads fp32 masters. A train step written as
# ``grads = torch.func.grad(loss)(params, batch); optim.adamw(params, grads, ...)``
# says where that forward is: inside the grad transform. So ``in_grad(fn, dtype)``
# runs ``fn`` under a TorchFunctionMode that, at every op, replaces a floating input
# of ``fn`` by its cast to ``dtype`` where the op runs inside the differentiated
# function:
# - a grad transform's wrapper (GradTrackingTensor) of one of ``fn``'s inputs: a
#   parameter the step differentiates (at any nesting of wrappers);
# - one of ``fn``'s inputs used as it is while a grad transform is active: a batch
#   input (FSDP2's cast_forward_inputs), a parameter closed over;
# - in a program that is itself differentiated (pjit called on inputs that require
#   grad: the joint trace), every use of every floating input.
# - a tensor computed from one of ``fn``'s floating inputs outside the transform (a
#   micro-batch sliced off the batch by ``optim.accumulate``, a parameter reshaped
#   before the grad call) counts as that input: it is cast where the transform uses
#   it (``_derive``). Without this it would reach the forward in fp32 beside bf16
#   parameters ("expected m1 and m2 to have the same dtype"), or silently compute in
#   fp32 where it meets only elementwise ops.
# A program that is differentiated from outside (the joint trace) and that also
# differentiates inside (a train step called on parameters that require grad) is an
# error: its forward cannot be told from its optimizer, and casting every use would
# hand the optimizer bf16 masters (a silent rounding of the fp32 parameters).
# Each tensor is cast once per grad call (a cache keyed on the wrapper, as autocast
# caches its weight casts), at its first use, so a tied weight read twice has one
# cast and its two gradients meet in param_dtype before the cast's backward. The
# optimizer runs outside the transform and reads the fp32 inputs and fp32 gradients.
# Under pjit this runs while the step is traced: the casts are ``_to_copy`` ops of the
# global program, where the mode lays them out like any op; under DataParallelMode
# "shard" the cast of a parameter reads its shard (the op does not read the batch),
# so the all-gather before the op that does read the batch moves param_dtype bytes.
# In-place ops are not redirected (an in-place write into an input stays the error
# it is under pjit). Ops inside an autograd.Function's own forward (shard_map bodies,
# with_sharding_constraint) see what the Function was given; a shard_map body that
# should compute in bf16 takes the functional ``Policy``.


class _CastInGrad(TorchFunctionMode):
    """NOTE [Casts at use inside the differentiated function]."""

    def __init__(self, dtype: torch.dtype, inputs: list, joint: bool, api: str):
        super().__init__()
        self.dtype = dtype
        self.inputs = {id(t): t for t in inputs if t.is_floating_point() and t.dtype != dtype}
        self.joint = joint
        self.api = api
        self.cache: dict[tuple, tuple] = {}     # key -> (tensor, its cast): keeps ids unique

    def _cast(self, x: Any, in_grad: bool) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        if self.joint and in_grad and (_torch.is_grad_tracking(x) or id(x) in self.inputs):
            raise ValueError(
                f"{self.api}: the function differentiates inside itself (torch.func.grad) "
                f"and is called on tensors that require grad, so its forward cannot be told "
                f"from its optimizer: casting every use to {self.dtype} would hand the "
                f"optimizer {self.dtype} copies of the fp32 masters. Pass tensors that do not "
                f"require grad (e.g. {{k: v.detach() for k, v in model.named_parameters()}}), "
                f"or differentiate the call from outside only.")
        if _torch.is_grad_tracking(x):
            if id(_torch.functorch_base(x)) not in self.inputs:
                return x
            key: tuple = (id(x),)
        elif id(x) in self.inputs:
            if not self.joint and not in_grad:
                return x
            key = (id(x), _torch.functorch_level())
        else:
            return x
        hit = self.cache.get(key)
        if hit is None:
            hit = self.cache[key] = (x, x.to(self.dtype))
        return hit[1]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.inputs or _not_a_use(func):
            return func(*args, **kwargs)
        if self.joint or _torch.functorch_level():
            in_grad = _torch.in_grad_transform()        # once per op, not per tensor
            args, kwargs = optree.tree_map(lambda x: self._cast(x, in_grad), (args, kwargs),
                                           none_is_leaf=True)
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        self._derive((args, kwargs), out)
        return out

    def _derive(self, args, out) -> None:
        """Outside the transforms: ``out`` computed from one of the inputs counts as
        an input (NOTE [Casts at use inside the differentiated function])."""
        if not any(isinstance(a, torch.Tensor) and id(a) in self.inputs
                   for a in optree.tree_leaves(args, none_is_leaf=True)):
            return
        for t in optree.tree_leaves(out, none_is_leaf=True):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != self.dtype:
                self.inputs[id(t)] = t


def _not_a_use(func) -> bool:
    """Is ``func`` an in-place op (a write into an input stays the error it is),
    autograd's own API (``torch.autograd.grad``'s inputs are the tensors to
    differentiate with respect to, never their casts) or an aten op overload (what
    tracing and the transforms call below the user's code)?"""
    if func in _AUTOGRAD_API or isinstance(func, (_torch.OpOverload, _torch.OpOverloadPacket)):
        return True     # (aten ops called from inside dispatch: make_fx's own, functorch's)
    name = getattr(func, "__name__", "")
    return (name.endswith("_") and not name.startswith("__")) or name in _IN_PLACE_DUNDERS


_AUTOGRAD_API = frozenset({torch.autograd.grad, torch.autograd.backward, torch.Tensor.backward})


_IN_PLACE_DUNDERS = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__",
                               "__ifloordiv__", "__imod__", "__ipow__", "__iand__", "__ior__",
                               "__ixor__", "__ilshift__", "__irshift__", "__imatmul__"})


def in_grad(fn: Callable, param_dtype: torch.dtype, *,
            api: str = "sharded.precision.in_grad") -> Callable:
    """``fn`` (tensors in) computing in ``param_dtype`` inside the function it
    differentiates: NOTE [Casts at use inside the differentiated function]. This is
    ``DataParallelMode(param_dtype=...)``'s policy; called eagerly it is the same
    policy on one device."""
    dtype = check_dtype("sharded.precision.in_grad", "param_dtype", param_dtype, optional=False)

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        leaves = [x for x in optree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        joint = any(t.requires_grad for t in leaves)
        with _CastInGrad(dtype, leaves, joint, api):
            return fn(*args, **kwargs)

    return wrapped


# NOTE [A cast after a reduction waits for its reader]
# With gradients reduced in param_dtype (a mode's reduce_dtype None), each reduction's
# result is cast back to the master dtype by the cast's backward, which autograd
# runs right after the gradient is produced: the cast reads the reduction's result
# at once, so the reduction could not wait in a bucket for the next gradients (a
# GPT step's bucket of gradients became one all-reduce per gradient). This pass
# moves each cast of a reduction's result down to its first reader (the optimizer),
# before the buckets are made; the reduction's wait then sinks there too.

_TO_COPY = torch.ops.aten._to_copy.default


def sink_casts_of_reductions(gm: fx.GraphModule) -> fx.GraphModule:
    """NOTE [A cast after a reduction waits for its reader]."""
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    for n in nodes:
        if not (n.op == "call_function" and n.target is _TO_COPY and n.users
                and isinstance(n.args[0], fx.Node) and n.args[0].target is _torch.WAIT_OP):
            continue
        first = min(n.users, key=lambda u: pos[u])
        if first is not n.next:
            first.prepend(n)
    return gm
