"""Sharding for the CPU flash-attention ops that F.scaled_dot_product_attention uses.

DTensor has no strategy for ``_scaled_dot_product_flash_attention_for_cpu`` and its
backward. Attention is independent across batch (dim 0) and heads (dim 1), so both
ops run shard-locally when q, k, v (and the saved out/logsumexp, and the gradients)
are all sharded on the same one of those dims; otherwise everything is replicated.
The forward and the backward are registered together: decomposing only the forward
gives silently wrong gradients (its backward expects logsumexp, not the weights).
"""

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.experimental import register_sharding

aten = torch.ops.aten


def _positional(n_tensors: int, n_args: int, pl):
    return [pl] * n_tensors + [None] * (n_args - n_tensors)


@register_sharding(aten._scaled_dot_product_flash_attention_for_cpu.default)
def _sdpa_cpu_forward(query, key, value, *args, attn_mask=None, scale=None):
    if attn_mask is not None:
        # The rule cannot place a keyword-only mask; keep everything replicated.
        return [([Replicate(), Replicate()], _positional(3, 3 + len(args), Replicate()))]
    n = 3 + len(args)
    return [
        ([pl, pl], _positional(3, n, pl))
        for pl in (Replicate(), Shard(0), Shard(1))
    ]


@register_sharding(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
def _sdpa_cpu_backward(grad_out, query, key, value, out, logsumexp, *args, attn_mask=None, scale=None):
    if attn_mask is not None:
        return [([Replicate()] * 3, _positional(6, 6 + len(args), Replicate()))]
    n = 6 + len(args)
    return [
        ([pl, pl, pl], _positional(6, n, pl))
        for pl in (Replicate(), Shard(0), Shard(1))
    ]
