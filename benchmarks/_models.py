"""Small helpers shared by the benchmarks: an nn.Module view of the functional GPT
(for DDP / torch.optim) and a train-step variant for pjit data parallelism."""

from __future__ import annotations

import optree
import torch
import torch.nn as nn
import torch.nn.functional as F

from examples import gpt
from sharded import P, optim, with_sharding_constraint


def git_rev() -> str:
    """The repository's revision, ``+dirty`` with uncommitted changes (for results)."""
    import os
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root,
                             capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=root, capture_output=True, text=True).stdout.strip()
        return rev + ("+dirty" if dirty else "")
    except OSError:
        return "unknown"


class GPTModule(nn.Module):
    """Holds the params of ``gpt.init_params`` as a flat ParameterList and runs
    ``gpt.forward`` on them (same math as the functional model)."""

    def __init__(self, params: dict, cfg: gpt.GPTConfig):
        super().__init__()
        leaves, self._treedef = optree.tree_flatten(params)
        self.cfg = cfg
        self.flat = nn.ParameterList([nn.Parameter(t.detach().clone()) for t in leaves])

    def forward(self, ids):
        return gpt.forward(optree.tree_unflatten(self._treedef, list(self.flat)), ids, self.cfg)


def module_loss(model, ids, targets):
    logits = model(ids)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def train_step_reduced_grads(params, opt_state, ids, targets, cfg, lr: float = 1e-3):
    """``gpt.train_step`` with the gradients constrained to replicated (P()) before
    AdamW: under pjit data parallelism this all-reduces each gradient once, instead of
    letting the pending reductions flow into the optimizer."""
    grads, loss = torch.func.grad_and_value(gpt.loss_fn)(params, ids, targets, cfg)
    grads = optree.tree_map(lambda g: with_sharding_constraint(g, P()), grads)
    params, opt_state = optim.adamw(params, grads, opt_state, lr=lr)
    return params, opt_state, loss
