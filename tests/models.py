"""Small pure-functional models and a rank-side checker shared by the tests."""

from __future__ import annotations

import math

import einops
import torch
import torch.nn.functional as F

from sharded import Mesh, gather, shard
from transforms import pjit


def init(seed, shapes: dict) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(*s, generator=g) * 0.3 for k, s in shapes.items()}


# -- MLP ----------------------------------------------------------------------

MLP_SHAPES = {"w1": (16, 8), "b1": (16,), "w2": (4, 16), "b2": (4,)}
MLP_TP = {"w1": ("tp",), "b1": ("tp",), "w2": (None, "tp"), "b2": ()}


def mlp(p, x):
    h = torch.relu(F.linear(x, p["w1"], p["b1"]))
    return F.linear(h, p["w2"], p["b2"])


def mlp_loss(p, x, y):
    return F.cross_entropy(mlp(p, x), y)


def sgd_step(loss_fn):
    def step(p, *batch):
        g, loss = torch.func.grad_and_value(loss_fn)(p, *batch)
        return {k: p[k] - 0.1 * g[k] for k in p}, loss

    step.__name__ = step.__qualname__ = f"sgd_step_{loss_fn.__name__}"
    return step


# -- attention ------------------------------------------------------------------

ATTN_SHAPES = {"wq": (16, 16), "wk": (16, 16), "wv": (16, 16), "wo": (16, 16),
               "ln_w": (16,), "ln_b": (16,)}
ATTN_TP = {"wq": ("tp",), "wk": ("tp",), "wv": ("tp",), "wo": (None, "tp"), "ln_w": (), "ln_b": ()}
HEADS = 4


def attention(p, x, use_sdpa: bool):
    x = F.layer_norm(x, (x.shape[-1],), p["ln_w"], p["ln_b"])
    q, k, v = (einops.rearrange(F.linear(x, p[w]), "b s (h d) -> b h s d", h=HEADS)
               for w in ("wq", "wk", "wv"))
    if use_sdpa:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
        s = q.shape[-2]
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        mask = torch.ones(s, s, dtype=torch.bool).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
        o = torch.softmax(scores, dim=-1) @ v
    return F.linear(einops.rearrange(o, "b h s d -> b s (h d)"), p["wo"])


def attn_loss_sdpa(p, x):
    return attention(p, x, True).pow(2).mean()


def attn_loss_matmul(p, x):
    return attention(p, x, False).pow(2).mean()


# -- embedding -------------------------------------------------------------------

def embed_loss(p, ids, y):
    h = F.embedding(ids, p["emb"])              # [b, s, d]
    return F.cross_entropy(h.mean(1) @ p["out"].T, y)


# -- rank-side checker -------------------------------------------------------------

def specs_of(table: dict):
    from sharded import P

    return {k: P(*v) for k, v in table.items()}


def check_step(mesh_shape, axis_names, step, args, in_specs, out_specs, *, shard_args=True,
               steps=2):
    """On every rank: run ``step`` ``steps`` times under pjit and single-device, and
    assert the results are equal. Returns the lowered program's cost on this rank."""
    mesh = Mesh(mesh_shape, axis_names)
    f = pjit(step, in_specs=in_specs, out_specs=out_specs, mesh=mesh)
    dist_args = shard(args, in_specs, mesh) if shard_args else args
    ref_args = args
    for _ in range(steps):
        out = f(*dist_args)
        ref = step(*ref_args)
        torch.testing.assert_close(gather(out), ref, rtol=1e-5, atol=1e-5)
        if isinstance(out, tuple):  # feed params back in: params are output 0
            dist_args = (out[0],) + tuple(dist_args[1:])
            ref_args = (ref[0],) + tuple(ref_args[1:])
    assert f.trace_count == 1, f"traced {f.trace_count} times for one signature"
    return f.lower(*dist_args).cost()
