"""A small GPT as an nn.Module, trained with a tensor-parallel plan under pjit.

    python examples/gpt_module.py                      # 4 local ranks, mesh ("dp"=2, "tp"=2), SP plan
    python examples/gpt_module.py --plan megatron      # Megatron plan (all-reduces)
    python examples/gpt_module.py --dp 1 --tp 2        # 2 ranks
    torchrun --nproc-per-node 4 examples/gpt_module.py # the same under torchrun

The model is plain torch (nn.Embedding, nn.LayerNorm, nn.Linear). The plan is the one
you would give torch's ``parallelize_module`` (torchtitan's Llama plans are written so);
``sharded.plans.parallelize`` turns it into parameter specs and makes the styles'
activation layouts part of the traced program. The whole train step (forward,
backward, AdamW) through ``torch.func.functional_call`` is one pjit program per rank:
Megatron over "tp", the batch split over "dp". Rank 0 prints the loss next to the
single-device run and the collectives of the step.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sharded import P, optim  # noqa: E402
from sharded.plans import (  # noqa: E402
    colwise, prepare_input, prepare_output, rowwise, sequence_parallel,
)


@dataclass(frozen=True)
class Config:
    vocab: int = 128
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    seq: int = 32
    mlp_ratio: int = 4
    dropout: float = 0.0     # after the embeddings and on each residual branch (GPT-2)


class Attention(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        d = cfg.d_model
        self.head_dim = d // cfg.n_heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        # -1 heads: the same code runs under torch's eager TP, where q/k/v are local
        # shards (n_heads / tp heads); under pjit every shape is global.
        b, s = x.shape[0], x.shape[1]
        q, k, v = (w(x).view(b, s, -1, self.head_dim).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.fc1 = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.fc2 = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(cfg.d_model), nn.LayerNorm(cfg.d_model)
        self.attn, self.mlp = Attention(cfg), MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x):
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    """Token and position embeddings, pre-norm blocks, final norm, untied LM head.
    ``forward(ids, targets)`` returns the mean next-token cross-entropy."""

    def __init__(self, cfg: Config, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        # Activation checkpointing: None, or a wrapper applied to each block's call,
        # e.g. sharded.remat or functools.partial(sharded.remat, policy=...)
        self.remat = None
        for name, p in self.named_parameters():
            if p.ndim == 2:
                std = 0.02 / math.sqrt(2 * cfg.n_layers) if name.endswith(("wo.weight", "fc2.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, ids, targets):
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = self.drop(self.wte(ids) + self.wpe(pos))
        for blk in self.blocks:
            x = (self.remat(blk) if self.remat is not None else blk)(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


# -- plans (as for torch's parallelize_module) ----------------------------------------------

def megatron_plan(builders: bool = False) -> dict:
    """Megatron TP: q/k/v and fc1 column-parallel, wo and fc2 row-parallel (one
    all-reduce each forward), the vocabulary split in the embedding and the head."""
    if builders:
        return {
            "wte": rowwise(input_layouts=P()),
            "blocks.*.attn.w[qkv]": colwise(),
            "blocks.*.attn.wo": rowwise(),
            "blocks.*.mlp.fc1": colwise(),
            "blocks.*.mlp.fc2": rowwise(),
            "head": colwise(output_layouts=P()),
        }
    return {
        "wte": RowwiseParallel(input_layouts=Replicate()),
        "blocks.*.attn.w[qkv]": ColwiseParallel(),
        "blocks.*.attn.wo": RowwiseParallel(),
        "blocks.*.mlp.fc1": ColwiseParallel(),
        "blocks.*.mlp.fc2": RowwiseParallel(),
        "head": ColwiseParallel(output_layouts=Replicate()),
    }


def sp_plan(builders: bool = False) -> dict:
    """torchtitan's Llama plan: Megatron plus sequence parallelism. Between blocks the
    activations are split over the sequence (dim 1): row-parallel outputs are
    reduce-scattered to it, and all-gathered again before attention and the MLP.
    The position embedding's [seq, d] output is split over the sequence (dim 0) to
    match (Llama has no such table; torch needs this to add it to a local shard)."""
    if builders:
        seq = P(None, "tp")
        return {
            "wte": rowwise(input_layouts=P(), output_layouts=seq),
            "wpe": prepare_output(output_layouts=P(), desired_output_layouts=P("tp")),
            "blocks.*.ln[12]": sequence_parallel(),
            "blocks.*.attn": prepare_input(input_layouts=seq, desired_input_layouts=P()),
            "blocks.*.attn.w[qkv]": colwise(),
            "blocks.*.attn.wo": rowwise(output_layouts=seq),
            "blocks.*.mlp": prepare_input(input_layouts=seq, desired_input_layouts=P()),
            "blocks.*.mlp.fc1": colwise(),
            "blocks.*.mlp.fc2": rowwise(output_layouts=seq),
            "ln_f": sequence_parallel(),
            "head": colwise(input_layouts=seq, output_layouts=P()),
        }
    return {
        "wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "wpe": PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0)),
        "blocks.*.ln[12]": SequenceParallel(),
        "blocks.*.attn": PrepareModuleInput(input_layouts=(Shard(1),),
                                            desired_input_layouts=(Replicate(),)),
        "blocks.*.attn.w[qkv]": ColwiseParallel(),
        "blocks.*.attn.wo": RowwiseParallel(output_layouts=Shard(1)),
        "blocks.*.mlp": PrepareModuleInput(input_layouts=(Shard(1),),
                                           desired_input_layouts=(Replicate(),)),
        "blocks.*.mlp.fc1": ColwiseParallel(),
        "blocks.*.mlp.fc2": RowwiseParallel(output_layouts=Shard(1)),
        "ln_f": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }


PLANS = {"megatron": megatron_plan, "sp": sp_plan}


def make_train_step(model: nn.Module, update=None, policy=None):
    """A pure train step over the module's parameters: forward and backward through
    ``torch.func.functional_call``, then ``update(params, grads, opt_state)``
    (default: ``sharded.optim.adamw`` with lr 1e-3). ``policy``: a
    ``sharded.precision.Policy`` the differentiated forward runs under."""
    update = update or functools.partial(optim.adamw, lr=1e-3)

    def train_step(params, opt_state, ids, targets):
        def loss_of(p):
            return torch.func.functional_call(model, p, (ids, targets))

        if policy is not None:
            loss_of = policy.wrap(loss_of)
        grads, loss = torch.func.grad_and_value(loss_of)(params)
        params, opt_state = update(params, grads, opt_state)
        return params, opt_state, loss

    return train_step


def pattern_batch(cfg: Config, batch_size: int):
    """Sequences that follow a learnable rule (next = (3 * tok + 1) mod vocab)."""
    toks = torch.empty(batch_size, cfg.seq + 1, dtype=torch.long)
    toks[:, 0] = torch.arange(batch_size) * 5 % cfg.vocab
    for i in range(cfg.seq):
        toks[:, i + 1] = (3 * toks[:, i] + 1) % cfg.vocab
    return toks[:, :-1].contiguous(), toks[:, 1:].contiguous()


def main(plan: str, dp: int, tp: int, steps: int, batch_size: int, lr: float):
    from sharded import Mesh, gather, shard
    from sharded.plans import parallelize
    from sharded import pjit

    mesh = Mesh((dp, tp), ("dp", "tp"))
    cfg = Config()
    # the single-device reference runs on the mesh's device (cpu, or this rank's GPU)
    model = GPT(cfg).to(mesh.device)
    specs = parallelize(model, PLANS[plan](), mesh, axis="tp")
    params = {k: v.detach() for k, v in model.named_parameters()}
    opt_state = optim.adamw_init(params)
    opt_state["step"] = opt_state["step"].to(mesh.device)
    opt_specs = {"step": P(), "m": specs, "v": specs}
    ids, targets = (t.to(mesh.device) for t in pattern_batch(cfg, batch_size))

    train_step = make_train_step(model, functools.partial(optim.adamw, lr=lr))
    step = pjit(train_step, in_specs=(specs, opt_specs, P("dp"), P("dp")),
                out_specs=(specs, opt_specs, P()), mesh=mesh)
    d_params, d_opt = shard((params, opt_state), (specs, opt_specs), mesh)
    d_ids, d_targets = shard((ids, targets), P("dp"), mesh)

    t0 = time.perf_counter()
    lowered = step.lower(d_params, d_opt, d_ids, d_targets)
    if mesh.rank == 0:
        by_axis: dict = {}
        for c in lowered.collectives():
            by_axis.setdefault(c.axis, {}).setdefault(c.kind, 0)
            by_axis[c.axis][c.kind] += 1
        print(f"{plan} plan on mesh {dict(zip(mesh.axis_names, mesh.shape))}: compiled in "
              f"{time.perf_counter() - t0:.1f} s; collectives per step {by_axis}")
        print(f"{'step':>4}  {'pjit loss':>10}  {'1-device loss':>13}")

    ref_params, ref_opt = params, opt_state
    worst = 0.0
    for i in range(steps):
        d_params, d_opt, loss = step(d_params, d_opt, d_ids, d_targets)
        ref_params, ref_opt, ref_loss = train_step(ref_params, ref_opt, ids, targets)
        loss = gather(loss)
        worst = max(worst, abs(loss.item() - ref_loss.item()))
        if mesh.rank == 0 and (i % 5 == 0 or i == steps - 1):
            print(f"{i:>4}  {loss.item():>10.4f}  {ref_loss.item():>13.4f}")
    torch.testing.assert_close(loss, ref_loss, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(gather(d_params), ref_params, rtol=1e-3, atol=1e-4)
    if mesh.rank == 0:
        print(f"max |pjit - single device| loss difference over {steps} steps: {worst:.2e}")
    return loss.item()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plan", choices=sorted(PLANS), default="sp")
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    a = ap.parse_args()
    args = (a.plan, a.dp, a.tp, a.steps, a.batch_size, a.lr)
    if "RANK" in os.environ:       # under torchrun: this process is one rank
        main(*args)
    else:                          # laptop path: start dp * tp local CPU ranks
        from sharded import launch

        launch(main, a.dp * a.tp, *args)
