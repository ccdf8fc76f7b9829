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


# -- FSDP2's test Transformer ------------------------------------------------------
# A port of torch.testing._internal.distributed._tensor.common_dtensor's ModelArgs /
# Transformer (the model of FSDP2's tests, test/distributed/_composable/fsdp) as pure
# functions over a dict with FSDP2's parameter names: token and position embeddings,
# pre-norm blocks (bias-free attention, a 4x MLP with biases), a final norm and an
# output projection tied to the token embedding. No dropout (FSDP2's parity tests
# use dropout_p=0.0).

def transformer_init(seed: int = 0, *, n_layers: int = 3, vocab: int = 8, seq: int = 16,
                     dim: int = 16) -> dict:
    g = torch.Generator().manual_seed(seed)

    def normal(*shape):
        return torch.randn(*shape, generator=g) * 0.1

    layers = [{
        "attention_norm": {"weight": 1.0 + normal(dim), "bias": normal(dim)},
        "attention": {w: normal(dim, dim) for w in ("wq", "wk", "wv", "wo")},
        "ffn_norm": {"weight": 1.0 + normal(dim), "bias": normal(dim)},
        "feed_forward": {"w1": {"weight": normal(4 * dim, dim), "bias": normal(4 * dim)},
                         "w2": {"weight": normal(dim, 4 * dim), "bias": normal(dim)}},
    } for _ in range(n_layers)]
    return {"tok_embeddings": normal(vocab, dim), "pos_embeddings": normal(seq, dim),
            "layers": layers, "norm": {"weight": 1.0 + normal(dim), "bias": normal(dim)}}


def transformer_tp_specs(params: dict) -> dict:
    """Transformer.parallelize's plan without sequence parallelism: the embeddings
    split over "tp" on their rows (RowwiseParallel; the tied output projection is
    then vocab-parallel, ColwiseParallel), wq/wk/wv and w1 column-parallel (w1's
    bias too), wo and w2 row-parallel, norms and w2's bias replicated."""
    from sharded import P

    def layer(_):
        return {"attention_norm": {"weight": P(), "bias": P()},
                "attention": {"wq": P("tp"), "wk": P("tp"), "wv": P("tp"), "wo": P(None, "tp")},
                "ffn_norm": {"weight": P(), "bias": P()},
                "feed_forward": {"w1": {"weight": P("tp"), "bias": P("tp")},
                                 "w2": {"weight": P(None, "tp"), "bias": P()}}}

    return {"tok_embeddings": P("tp"), "pos_embeddings": P("tp"),
            "layers": [layer(lp) for lp in params["layers"]], "norm": {"weight": P(), "bias": P()}}


def _layer_norm(p, x):
    return F.layer_norm(x, (x.shape[-1],), p["weight"], p["bias"])


def transformer(p, tokens, n_heads: int = 4):
    """Transformer.forward: logits [batch, seq, vocab]."""
    b, s = tokens.shape
    h = F.embedding(tokens, p["tok_embeddings"]) + F.embedding(torch.arange(s), p["pos_embeddings"])
    for lp in p["layers"]:
        a = lp["attention"]
        x = _layer_norm(lp["attention_norm"], h)
        q, k, v = (F.linear(x, a[w]).view(b, s, n_heads, -1).transpose(1, 2) for w in ("wq", "wk", "wv"))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + F.linear(o.transpose(1, 2).reshape(b, s, -1), a["wo"])
        ff = lp["feed_forward"]
        x = _layer_norm(lp["ffn_norm"], h)
        h = h + F.linear(F.gelu(F.linear(x, ff["w1"]["weight"], ff["w1"]["bias"])),
                         ff["w2"]["weight"], ff["w2"]["bias"])
    return F.linear(_layer_norm(p["norm"], h), p["tok_embeddings"])     # weight tying


def transformer_loss(p, tokens):
    """FSDP2's parity tests' loss: ``model(inp).sum()``."""
    return transformer(p, tokens).sum()
