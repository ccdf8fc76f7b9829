"""Algebraic rewrites of the global program: an identity op dropped where keeping it
would cost a collective.

# NOTE [Adding zero]
Python's ``sum(...)`` starts from the number 0, so a global norm written as
``sum((g ** 2).sum() for g in grads)`` traces to ``add(s0, 0)`` and then ``add(acc,
s1)``, ... A split program holds each ``s`` as a pending sum (the squares of a
gradient's shard, under "shard"), and a pending sum plus a number is reduced first (a
number added on every rank would be counted once per rank), so the first ``s`` was
all-reduced alone, then every other one as it met the replicated total: one scalar
all-reduce per parameter, where ``sharded.optim.global_norm`` pays one. Adding zero
is no op: ``drop_zero_additions`` reads ``x`` where the program adds (or subtracts)
the number 0 to it, before the program is partitioned, and the total stays a pending
sum to the square root. Only where the sum's value is ``x`` itself: the same dtype,
shape and strides (an expanded ``x`` plus 0 is a fresh dense tensor, which a later
view may need), ``x`` is computed by the program and holds no storage of an input or
a constant (a view of an input would become an output sharing the caller's tensor),
and ``alpha`` is finite. The one value that changes is a negative zero, which
``-0.0 + 0`` makes positive.
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx

from sharded import _torch

aten = torch.ops.aten
_ADD_SUB = frozenset({aten.add.Tensor, aten.sub.Tensor, aten.add.Scalar, aten.sub.Scalar})


def drop_zero_additions(gm: fx.GraphModule) -> int:
    """NOTE [Adding zero]: every ``x + 0`` and ``x - 0`` reads ``x``; returns how many
    were dropped."""
    dropped = 0
    held = None          # the storages of the program's inputs and constants
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target not in _ADD_SUB or len(n.args) != 2:
            continue
        x, zero = n.args
        if not _is_zero(zero) or not isinstance(x, fx.Node) or x.op != "call_function" \
                or set(n.kwargs) - {"alpha"} or not _finite(n.kwargs.get("alpha", 1)):
            continue
        val, xval = n.meta.get("val"), x.meta.get("val")
        if not (isinstance(val, torch.Tensor) and isinstance(xval, torch.Tensor)
                and val.dtype == xval.dtype and val.shape == xval.shape
                and val.stride() == xval.stride()):
            continue
        if held is None:
            held = {_torch.storage_key(m.meta["val"]) for m in gm.graph.nodes
                    if m.op in ("placeholder", "get_attr")
                    and isinstance(m.meta.get("val"), torch.Tensor)}
        if _torch.storage_key(xval) in held:      # a view of an input or a constant
            continue
        n.replace_all_uses_with(x)
        gm.graph.erase_node(n)
        dropped += 1
    return dropped


def _is_zero(v) -> bool:
    return type(v) in (int, float) and v == 0


def _finite(alpha) -> bool:
    """``x + alpha * 0`` is ``x`` for a finite ``alpha`` (inf or nan times 0 is nan)."""
    return type(alpha) in (int, float) and math.isfinite(alpha)
