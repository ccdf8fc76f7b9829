"""A small pure-functional GPT (no nn.Module) for pjit.

Parameters are a nested dict pytree; ``forward``/``loss_fn``/``train_step`` are pure
functions of it, so a whole train step (forward, backward, AdamW) is one traced
program. ``tp_specs`` gives Megatron tensor parallelism over mesh axis ``"tp"``;
``dp_specs`` replicates everything (data parallelism shards the batch instead).

Run ``python examples/gpt.py`` to check, on 2 local ranks (gloo on CPU, NCCL with
two GPUs), that pjit with ``tp_specs`` and with the batch sharded over ``"dp"``
matches single-device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import einops
import optree
import torch
import torch.nn.functional as F

from sharded import P, optim


@dataclass(frozen=True)  # frozen: hashable, so it can be a pjit static argument
class GPTConfig:
    vocab: int = 256
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    seq: int = 32
    sdpa: bool = True        # False: explicit matmul + softmax attention
    mlp_ratio: int = 4

    @staticmethod
    def tiny(**kw) -> "GPTConfig":
        return GPTConfig(**{**dict(vocab=256, d_model=64, n_heads=4, n_layers=2, seq=32), **kw})

    @staticmethod
    def gpt2_small(**kw) -> "GPTConfig":
        return GPTConfig(**{**dict(vocab=50257, d_model=768, n_heads=12, n_layers=12, seq=1024), **kw})


tiny = GPTConfig.tiny
gpt2_small = GPTConfig.gpt2_small


def init_params(cfg: GPTConfig, seed: int = 0) -> dict:
    """GPT-2 style init. Linear weights are [out, in] (as nn.Linear); the LM head is
    tied to ``wte``."""
    g = torch.Generator().manual_seed(seed)
    d, h = cfg.d_model, cfg.mlp_ratio * cfg.d_model

    def normal(*shape, std=0.02):
        return torch.randn(*shape, generator=g) * std

    proj_std = 0.02 / math.sqrt(2 * cfg.n_layers)
    blocks = []
    for _ in range(cfg.n_layers):
        blocks.append({
            "ln1_w": torch.ones(d), "ln1_b": torch.zeros(d),
            "attn": {"wq": normal(d, d), "wk": normal(d, d), "wv": normal(d, d),
                     "wo": normal(d, d, std=proj_std)},
            "ln2_w": torch.ones(d), "ln2_b": torch.zeros(d),
            "mlp": {"up": normal(h, d), "down": normal(d, h, std=proj_std)},
        })
    return {
        "wte": normal(cfg.vocab, d),
        "wpe": normal(cfg.seq, d, std=0.01),
        "blocks": blocks,
        "lnf_w": torch.ones(d), "lnf_b": torch.zeros(d),
    }


def _attention(p, x, cfg: GPTConfig):
    q, k, v = (einops.rearrange(F.linear(x, p[w]), "b s (h d) -> b h s d", h=cfg.n_heads)
               for w in ("wq", "wk", "wv"))
    if cfg.sdpa:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
        s = q.shape[-2]
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        mask = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
        o = torch.softmax(scores, dim=-1) @ v
    return F.linear(einops.rearrange(o, "b h s d -> b s (h d)"), p["wo"])


def _mlp(p, x):
    return F.linear(F.gelu(F.linear(x, p["up"])), p["down"])


def forward(params, ids, cfg: GPTConfig):
    """Logits [batch, seq, vocab] for token ids [batch, seq]."""
    d = cfg.d_model
    s = ids.shape[1]
    x = F.embedding(ids, params["wte"]) + params["wpe"][:s]
    for blk in params["blocks"]:
        x = x + _attention(blk["attn"], F.layer_norm(x, (d,), blk["ln1_w"], blk["ln1_b"]), cfg)
        x = x + _mlp(blk["mlp"], F.layer_norm(x, (d,), blk["ln2_w"], blk["ln2_b"]))
    x = F.layer_norm(x, (d,), params["lnf_w"], params["lnf_b"])
    return x @ params["wte"].T


def loss_fn(params, ids, targets, cfg: GPTConfig):
    logits = forward(params, ids, cfg)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def train_step(params, opt_state, ids, targets, cfg: GPTConfig, lr: float = 1e-3):
    """One AdamW step; returns ``(params, opt_state, loss)``. ``cfg`` (and ``lr``) are
    static: pass them as pjit static_argnums."""
    grads, loss = torch.func.grad_and_value(loss_fn)(params, ids, targets, cfg)
    params, opt_state = optim.adamw(params, grads, opt_state, lr=lr)
    return params, opt_state, loss


def batch(cfg: GPTConfig, batch_size: int, seed: int = 1, seq: int | None = None):
    """Random token ids and next-token targets, [batch, seq] each."""
    g = torch.Generator().manual_seed(seed)
    s = seq or cfg.seq
    toks = torch.randint(0, cfg.vocab, (batch_size, s + 1), generator=g)
    return toks[:, :-1].contiguous(), toks[:, 1:].contiguous()


# -- specs --------------------------------------------------------------------------

_COLWISE = {"wq", "wk", "wv", "up"}
_ROWWISE = {"wo", "down"}


def tp_specs(params):
    """Megatron TP over mesh axis "tp": wq/wk/wv/up split on the output dim (P("tp")),
    wo/down on the input dim (P(None, "tp")), everything else replicated."""
    def spec(path, _leaf):
        name = path[-1]
        if name in _COLWISE:
            return P("tp")
        if name in _ROWWISE:
            return P(None, "tp")
        return P()

    return optree.tree_map_with_path(spec, params, none_is_leaf=True)


def dp_specs(params):
    """Everything replicated (data parallelism shards the batch)."""
    return optree.tree_map(lambda _: P(), params, none_is_leaf=True)


def opt_specs(param_specs):
    """Specs for ``optim.adamw_init(params)``: moments laid out like the params."""
    return {"step": P(), "m": param_specs, "v": param_specs}


# -- check on 2 local ranks ----------------------------------------------------------

def _check_on_rank(mode: str, sdpa: bool, steps: int = 2):
    from sharded import Mesh, gather, shard
    from sharded import pjit

    cfg = tiny(sdpa=sdpa)
    params = init_params(cfg, 0)
    opt = optim.adamw_init(params)
    ids, tgt = batch(cfg, 4)
    if mode == "tp":
        mesh = Mesh((2,), ("tp",))
        pspecs, bspec = tp_specs(params), P()
    else:
        mesh = Mesh((2,), ("dp",))
        pspecs, bspec = dp_specs(params), P("dp")
    ospecs = opt_specs(pspecs)
    # the single-device reference runs on the mesh's device (cpu, or this rank's GPU)
    params, opt, ids, tgt = optree.tree_map(lambda t: t.to(mesh.device), (params, opt, ids, tgt))
    step = pjit(train_step, in_specs=(pspecs, ospecs, bspec, bspec),
                out_specs=(pspecs, ospecs, P()), mesh=mesh, static_argnums=(4,))
    d_params, d_opt = shard(params, pspecs, mesh), shard(opt, ospecs, mesh)
    d_ids, d_tgt = shard((ids, tgt), bspec, mesh)
    r_params, r_opt = params, opt
    losses, max_param_diff = [], 0.0
    for _ in range(steps):
        d_params, d_opt, d_loss = step(d_params, d_opt, d_ids, d_tgt, cfg)
        r_params, r_opt, r_loss = train_step(r_params, r_opt, ids, tgt, cfg)
        torch.testing.assert_close(gather(d_loss), r_loss, rtol=1e-5, atol=1e-5)
        # Adam divides by sqrt(v): where a gradient is ~0, summation-order noise in
        # the sharded gradient (1e-9) becomes a ~1e-5 parameter difference; looser
        # tolerance for params than for the loss.
        torch.testing.assert_close(gather(d_params), r_params, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(gather(d_opt), r_opt, rtol=1e-4, atol=1e-6)
        diff = max((a - b).abs().max().item() for a, b in
                   zip(optree.tree_leaves(gather(d_params)), optree.tree_leaves(r_params)))
        max_param_diff = max(max_param_diff, diff)
        losses.append(float(r_loss))
    cost = step.lower(d_params, d_opt, d_ids, d_tgt, cfg).cost()
    return losses, max_param_diff, {k: v["count"] for k, v in cost.items()}


if __name__ == "__main__":
    from sharded import launch

    for mode in ("dp", "tp"):
        for sdpa in (True, False):
            res = launch(_check_on_rank, 2, mode, sdpa)
            losses, diff, cost = res[0]
            print(f"{mode} sdpa={sdpa}: pjit == single-device for 2 steps "
                  f"(losses {[round(x, 4) for x in losses]}, max |param diff| {diff:.1e}); "
                  f"collectives {cost}")
