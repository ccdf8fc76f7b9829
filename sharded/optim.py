"""Small pure-functional optimizers over parameter pytrees (for use inside pjit).

Each update takes and returns pytrees; nothing is mutated, so a whole train step
(forward, backward, update) is one traced program. Numerics follow torch.optim
(SGD with momentum; AdamW with decoupled weight decay and bias correction).
"""

from __future__ import annotations

import optree
import torch

__all__ = ["sgd", "sgd_init", "adamw", "adamw_init"]


def _map(fn, *trees):
    return optree.tree_map(fn, *trees, none_is_leaf=False)


def sgd_init(params):
    """Momentum buffers for ``sgd`` (zeros like the params)."""
    return _map(torch.zeros_like, params)


def sgd(params, grads, state=None, *, lr: float, momentum: float = 0.0, weight_decay: float = 0.0):
    """One SGD step; returns ``(params, state)``. ``state`` from ``sgd_init`` when
    ``momentum`` is non-zero, else None."""
    if weight_decay:
        grads = _map(lambda g, p: g + weight_decay * p, grads, params)
    if momentum:
        if state is None:
            raise ValueError("sgd with momentum needs state=sgd_init(params).")
        state = _map(lambda b, g: momentum * b + g, state, grads)
        grads = state
    return _map(lambda p, g: p - lr * g, params, grads), state


def adamw_init(params):
    """AdamW state: step count and first/second moments."""
    zeros = _map(torch.zeros_like, params)
    return {"step": torch.zeros((), dtype=torch.float32), "m": zeros, "v": _map(torch.zeros_like, params)}


def adamw(params, grads, state, *, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
          weight_decay: float = 1e-2):
    """One AdamW step (as torch.optim.AdamW); returns ``(params, state)``."""
    b1, b2 = betas
    step = state["step"] + 1
    m = _map(lambda m, g: b1 * m + (1 - b1) * g, state["m"], grads)
    v = _map(lambda v, g: b2 * v + (1 - b2) * g * g, state["v"], grads)
    bc1 = 1 - b1 ** step
    bc2_sqrt = torch.sqrt(1 - b2 ** step)

    def update(p, m, v):
        p = p * (1 - lr * weight_decay)
        return p - (lr / bc1) * m / (v.sqrt() / bc2_sqrt + eps)

    params = _map(update, params, m, v)
    return params, {"step": step, "m": m, "v": v}
