"""Sharding for ops DTensor has no strategy for that are independent across rows:
``log_sigmoid`` (``F.logsigmoid``, ``multilabel_soft_margin_loss``, DPO-style
losses) elementwise, and the multi-margin losses row by row.

- ``log_sigmoid_forward(x)`` returns ``(out, buffer)``: on CPU the buffer is as large
  as ``x`` and laid out as it is; on CUDA it is empty (replicated). Any layout of
  ``x`` that is not a pending sum runs shard-locally.
- ``multi_margin_loss`` and ``multilabel_margin_loss`` score each row (frame) of a
  ``[N, C]`` input against its target on its own: split on dim 0, the unreduced
  losses are split too and their Sum is a pending sum. pjit has rewritten their Mean
  into a Sum over the global count by then (NOTE [A mean over a split batch]), so a
  Mean never reaches these rules split.
"""

import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.experimental import register_sharding

aten = torch.ops.aten
SUM, NONE = 2, 0


def _layouts(x) -> list:
    return [Replicate()] + [Shard(d) for d in range(len(x.tensor_meta.shape))]


@register_sharding(aten.log_sigmoid_forward.default)
def _log_sigmoid_forward(x):
    cpu = x.mesh.device_type == "cpu"
    return [([pl, pl if cpu else Replicate()], [pl]) for pl in _layouts(x)]


@register_sharding(aten.log_sigmoid_backward.default)
def _log_sigmoid_backward(grad, x, buffer):
    same = tuple(buffer.tensor_meta.shape) == tuple(x.tensor_meta.shape)
    return [([pl], [pl, pl, pl if same else Replicate()]) for pl in _layouts(x)]


def _rows(x, reduction: int):
    """(the loss's placement, the inputs' placement) with the frames split, or None
    where the input has no frames (1-D) or the reduction is a Mean."""
    if len(x.tensor_meta.shape) != 2 or reduction not in (SUM, NONE):
        return None
    return (Partial() if reduction == SUM else Shard(0)), Shard(0)


@register_sharding(aten.multi_margin_loss.default)
def _multi_margin(x, target, p=1, margin=1, weight=None, reduction=1):
    w = Replicate() if weight is not None else None
    rep = [([Replicate()], [Replicate(), Replicate(), None, None, w, None])]
    rows = _rows(x, reduction)
    if rows is None:
        return rep
    out, row = rows
    return rep + [([out], [row, row, None, None, w, None])]


@register_sharding(aten.multi_margin_loss_backward.default)
def _multi_margin_backward(grad, x, target, p, margin, weight=None, reduction=1):
    w = Replicate() if weight is not None else None
    rep = [([Replicate()], [Replicate(), Replicate(), Replicate(), None, None, w, None])]
    rows = _rows(x, reduction)
    if rows is None:
        return rep
    _, row = rows
    g = Replicate() if reduction == SUM else row
    return rep + [([row], [g, row, row, None, None, w, None])]


@register_sharding(aten.multilabel_margin_loss_forward.default)
def _multilabel_margin(x, target, reduction):
    rep = [([Replicate(), Replicate()], [Replicate(), Replicate(), None])]
    rows = _rows(x, reduction)
    if rows is None:
        return rep
    out, row = rows
    return rep + [([out, row], [row, row, None])]


@register_sharding(aten.multilabel_margin_loss_backward.default)
def _multilabel_margin_backward(grad, x, target, reduction, is_target):
    rep = [([Replicate()], [Replicate(), Replicate(), Replicate(), None, Replicate()])]
    rows = _rows(x, reduction)
    if rows is None:
        return rep
    _, row = rows
    g = Replicate() if reduction == SUM else row
    return rep + [([row], [g, row, row, None, row])]
