"""Sharding for the CPU flash-attention ops that F.scaled_dot_product_attention uses.

DTensor has no strategy for ``_scaled_dot_product_flash_attention_for_cpu`` and its
backward. Attention is independent across batch (dim 0) and heads (dim 1), so both
ops run shard-locally when q, k, v (and the saved out/logsumexp, and the gradients)
are all sharded on the same one of those dims; otherwise everything is replicated.
The forward and the backward are registered together: decomposing only the forward
gives silently wrong gradients (its backward expects logsumexp, not the weights).

An ``attn_mask`` (keyword-only; transformers passes its causal mask explicitly when
traced) broadcasts against ``[batch, heads, q, k]`` from the right: with q, k, v split
on dim d it is split on its own dim d where that dim is full, and replicated where it
broadcasts (size 1 or absent), e.g. a ``[batch, 1, q, k]`` mask under a head split.
DTensor lists a keyword tensor's placement after the positional ones.
"""

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.experimental import register_sharding

aten = torch.ops.aten


def _positional(n_tensors: int, n_args: int, pl):
    return [pl] * n_tensors + [None] * (n_args - n_tensors)


def _mask(attn_mask, pl) -> list:
    """The mask's placement (as a trailing keyword input) when q, k, v are laid out
    as ``pl``: [] without a mask."""
    if attn_mask is None:
        return []
    if not isinstance(pl, Shard):
        return [Replicate()]
    shape = attn_mask.tensor_meta.shape
    d = pl.dim - (4 - len(shape))          # the mask's dim that lines up with dim pl.dim
    return [Shard(d) if d >= 0 and shape[d] != 1 else Replicate()]


@register_sharding(aten._scaled_dot_product_flash_attention_for_cpu.default)
def _sdpa_cpu_forward(query, key, value, *args, attn_mask=None, scale=None):
    n = 3 + len(args)
    return [
        ([pl, pl], _positional(3, n, pl) + _mask(attn_mask, pl))
        for pl in (Replicate(), Shard(0), Shard(1))
    ]


@register_sharding(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
def _sdpa_cpu_backward(grad_out, query, key, value, out, logsumexp, *args, attn_mask=None, scale=None):
    n = 6 + len(args)
    return [
        ([pl, pl, pl], _positional(6, n, pl) + _mask(attn_mask, pl))
        for pl in (Replicate(), Shard(0), Shard(1))
    ]
