"""Where a pending reduction may travel: the policy both modes apply to Partial
(pending-sum) values, on top of DTensor's op strategies.

# NOTE [Where a pending reduction may travel]
A Partial (pending sum) value stays Partial through ops that are linear in it:
views, sums, matmuls with a non-partial operand, scaling, add/sub of two partials,
and the zero padding of slice/select backward. Anywhere else it is reduced to
Replicate first. Left to its greedy cost model, DTensor instead reduce-scatters a
partial that meets a replicated operand (e.g. the residual add after a row-parallel
matmul) and all-gathers it again before the next matmul; on a 2x2 mesh a 2-layer GPT
step took 95 collectives that way. A masked partial (the row-sharded embedding's
_MaskPartial) never travels: its reduction applies the ids mask, valid only on the
embedding's own output.
A partial value read by more than one op is reduced once, where it is produced:
otherwise each consumer reduces its own derived copy (AdamW reads a gradient twice,
which cost two all-reduces per parameter). So is one whose only readers are ops that
would reduce it anyway (not linear in it): reduced where it is produced, a gradient's
reduction sits in backward order, where the passes bucket it and the rest of the
backward overlaps it, instead of queuing up before the optimizer (a fused optimizer
kernel reads each gradient once). Ops the expander handles itself (layout
constraints) are left to reduce it their way (a reduce-scatter to a split layout).

# NOTE [A pending sum through a cast]
A float-to-float cast (``aten._to_copy`` to another dtype, on the same device) is
linear too, but not exactly: the sum of the casts is not the cast of the sum. Where
the reduction goes decides the dtype it runs in, so the mode says it: a pending sum
travels through a cast to the mode's ``reduce_dtype`` and is reduced after it, in
that dtype, and is reduced before any other cast, in the dtype it has. Mixed precision's gradients are
the case (sharded/precision.py): the backward of a parameter cast to bf16 produces
its gradient as a bf16 pending sum, then casts it to the parameter's fp32. With
``reduce_dtype=torch.float32`` the sum travels through that cast and is reduced (or
reduce-scattered) in fp32, FSDP2's ``reduce_dtype``; with None (every mode's
default) it is reduced in bf16 before the cast, FSDP2's default of reducing in
``param_dtype``, half the bytes. DTensor's own rule for ``_to_copy`` keeps a sum
pending through a float-to-float cast, so the expander only has to allow it.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from sharded import _torch
from sharded.modes._expand import SPECIAL_OPS

aten = torch.ops.aten

LINEAR_IN_PARTIAL = frozenset({
    aten.view, aten._unsafe_view, aten.reshape, aten.t, aten.transpose, aten.permute,
    aten.unsqueeze, aten.squeeze, aten.expand, aten.clone, aten.alias, aten.detach,
    aten.slice, aten.select, aten.split, aten.split_with_sizes, aten.neg, aten.sum,
    aten.mm, aten.bmm, aten.addmm, aten.mul, aten.div, aten.add, aten.sub,
    aten.slice_backward, aten.select_backward,   # zero padding: the gradient of x[:s], x[i]
})
ADDITIVE = frozenset({aten.add, aten.sub})


def is_masked(partial) -> bool:
    """Does one of the pending values ``partial`` carry a masked pending sum (the
    row-sharded embedding's _MaskPartial), which never travels?"""
    return any(not _torch.is_plain_partial(p) for a in partial for p in a.placements
               if _torch.is_partial(p))


_TO_COPY = aten._to_copy.default
# keyword arguments of a cast that change nothing a sum depends on
_CAST_KWARGS = frozenset({"dtype", "layout", "device", "memory_format", "non_blocking"})


def casts_to(target, src, kwargs, reduce_dtype) -> bool:
    """Is ``target`` (with ``kwargs``, on its input ``src``, a tensor) a float-to-float
    cast to ``reduce_dtype`` on ``src``'s device, through which a pending sum travels
    (NOTE [A pending sum through a cast])?"""
    if reduce_dtype is None or target is not _TO_COPY or not isinstance(src, torch.Tensor):
        return False
    dst = kwargs.get("dtype")
    return (dst == reduce_dtype and dst != src.dtype and src.dtype.is_floating_point
            and set(kwargs) <= _CAST_KWARGS
            and kwargs.get("layout", torch.strided) == torch.strided
            and torch.device(kwargs.get("device") or src.device).type == src.device.type)


def linear_in_partial(target, n_partial: int, n_dtensors: int, *, src=None,
                      kwargs=None, reduce_dtype=None) -> bool:
    """Is ``target`` linear in its pending operands (``n_partial`` of its
    ``n_dtensors`` DTensor operands): may their sums stay pending through it? A cast
    (``src``: its input, ``kwargs``: its keyword arguments) is, where it casts to
    ``reduce_dtype`` (NOTE [A pending sum through a cast])."""
    if casts_to(target, src, kwargs or {}, reduce_dtype):
        return True
    packet = target.overloadpacket
    if packet not in LINEAR_IN_PARTIAL:
        return False
    return packet not in ADDITIVE or n_partial == n_dtensors


def reduce_where_produced(node, reduce_dtype=None) -> bool:
    """Should a pending sum made by ``node`` be reduced at once? Yes when several ops
    read it, or when every reader is an op that would reduce it anyway (a cast to
    ``reduce_dtype`` would not: NOTE [A pending sum through a cast])."""
    if len(node.users) > 1:
        return True
    src = node.meta.get("val")
    return bool(node.users) and all(
        u.op == "call_function" and isinstance(u.target, _torch.OpOverload)
        and u.target not in SPECIAL_OPS and u.target.overloadpacket not in LINEAR_IN_PARTIAL
        and not casts_to(u.target, src, u.kwargs, reduce_dtype)
        for u in node.users)


def travels(target, args, kwargs, dts, partial, reduce_dtype=None) -> bool:
    """May the pending sums ``partial`` (of the op's DTensor operands ``dts``) stay
    pending through ``target`` (NOTE [Where a pending reduction may travel])? Both
    modes ask this, so that the same layouts give the same program."""
    if is_masked(partial):
        return False
    if len(partial) > 1 and target.overloadpacket is aten.mul \
            and any(sum(map(_torch.is_partial, a.placements)) > 1 for a in partial):
        # a product of two pending sums is no sum of products: both reduced first (by
        # the policy: one all-reduce over every axis they are pending on, where DTensor
        # reduces one axis after the other)
        return False
    if target is _EMBEDDING_BACKWARD:
        return len(partial) == 1 and partial[0] is args[0] and _table_no_larger(args)
    if target.overloadpacket in ADDITIVE and not all(isinstance(a, DTensor) for a in args[:2]):
        # a sum plus a number is not the sum of each part plus it: reduced here, by
        # the policy (one all-reduce over every axis it is pending on, where DTensor
        # would reduce one axis after the other)
        return False
    if kwargs.get("rounding_mode") is not None:
        return False                 # the floor of a sum is not the sum of the floors
    return linear_in_partial(target, len(partial), len(dts), src=partial[0],
                             kwargs=kwargs, reduce_dtype=reduce_dtype)


# NOTE [A pending sum through an embedding's backward]
# embedding_dense_backward(grad, ids, rows, ...) is linear in ``grad``: a pending sum
# may be reduced before it or after it, on the table's gradient. After it, where that
# is no larger (a position table looked up by positions: grad and table both
# [seq, d]), the table's gradient is reduced once, to its parameter's layout, as FSDP
# reduces the gradient it computed on its own examples. Reduced before it, it was
# reduced twice under "shard": the [seq, d] grad to the state layout of its shape (a
# reduce-scatter), and the table's gradient again. With replicated state, reduced
# before it, its all-reduce came after the other gradients' bucket had been read
# (by this very backward), and went out alone (DTensorExpandMode, before both modes
# shared this rule). Where the table is larger (a vocabulary under a tensor-parallel
# pending sum), the grad is reduced first. Not with scale_grad_by_freq, whose counts
# are of this rank's ids.
_EMBEDDING_BACKWARD = aten.embedding_dense_backward.default


def _table_no_larger(args) -> bool:
    grad, rows, by_freq = args[0], args[2], args[4]
    return not by_freq and rows * grad.shape[-1] <= grad.numel()


def reduced_by_readers(node, value, reduce_dtype=None) -> bool:
    """Should the pending sum ``value`` made by ``node`` be reduced where it is made
    (``reduce_where_produced``), unless its one reader is an embedding's backward
    that carries it (NOTE [A pending sum through an embedding's backward])?"""
    if not reduce_where_produced(node, reduce_dtype):
        return False
    return not all(u.target is _EMBEDDING_BACKWARD and u.args[0] is node and len(node.users) == 1
                   and _table_no_larger((value, *u.args[1:])) for u in node.users)


def pending_divisor(target, args) -> bool:
    """Is this a division by a pending sum (a mean loss's count of targets)? It is
    reduced before the division, and the pending numerator travels through it (a
    division is linear in its numerator, not in its divisor); DTensor's plan for a sum
    over a count, both pending, reduced the count one mesh axis after the other."""
    return (target.overloadpacket is aten.div and len(args) > 1
            and isinstance(args[1], DTensor) and any(map(_torch.is_partial, args[1].placements)))
