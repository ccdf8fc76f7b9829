"""Small pure-functional optimizers over parameter pytrees (for use inside pjit).

Each update takes and returns pytrees; nothing is mutated, so a whole train step
(forward, backward, update) is one traced program. The math runs on multi-tensor
ops over all parameters at once, so an update adds a few graph nodes, not a dozen per
parameter: AdamW is torch's fused kernel (the one ``torch.optim.AdamW(fused=True)``
runs: one pass over parameters, gradients and moments) where every tensor is floating
point of one dtype and device, else foreach ops. Numerics follow torch.optim (SGD
with momentum and weight decay; AdamW with decoupled weight decay and bias
correction).
"""

from __future__ import annotations

import optree
import torch

from sharded import _torch

__all__ = ["sgd", "sgd_init", "adamw", "adamw_init"]


def _leaves(tree, like=None):
    """Leaves of ``tree`` (following the structure of ``like``) and the treedef."""
    treedef = optree.tree_structure(like if like is not None else tree)
    return treedef.flatten_up_to(tree), treedef


def sgd_init(params):
    """Momentum buffers for ``sgd`` (zeros like the params)."""
    return optree.tree_map(torch.zeros_like, params)


def sgd(params, grads, state=None, *, lr: float, momentum: float = 0.0, weight_decay: float = 0.0):
    """One SGD step (as torch.optim.SGD); returns ``(params, state)``. ``state`` from
    ``sgd_init`` when ``momentum`` is non-zero, else None."""
    p, treedef = _leaves(params)
    g, _ = _leaves(grads, params)
    if weight_decay:
        g = _torch.foreach_add(g, _torch.foreach_mul(p, weight_decay))
    if momentum:
        if state is None:
            raise ValueError("sgd with momentum needs state=sgd_init(params).")
        b, _ = _leaves(state, params)
        g = _torch.foreach_add(_torch.foreach_mul(b, momentum), g)
        state = treedef.unflatten(g)
    p = _torch.foreach_sub(p, _torch.foreach_mul(g, lr))
    return treedef.unflatten(p), state


def adamw_init(params):
    """AdamW state: step count and first/second moments. The step count is a float32
    scalar on the device of the (plain tensor) parameters, where torch's fused CUDA
    kernel reads it (``torch.optim.AdamW(fused=True)`` keeps it there too); on the
    default device for DTensor parameters."""
    device = next((t.device for t in optree.tree_leaves(params)
                   if isinstance(t, torch.Tensor) and not _torch.is_dtensor(t)), None)
    return {
        "step": torch.zeros((), dtype=torch.float32, device=device),
        "m": optree.tree_map(torch.zeros_like, params),
        "v": optree.tree_map(torch.zeros_like, params),
    }


def adamw(params, grads, state, *, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
          weight_decay: float = 1e-2):
    """One AdamW step (as torch.optim.AdamW); returns ``(params, state)``."""
    b1, b2 = betas
    p, treedef = _leaves(params)
    g, _ = _leaves(grads, params)
    m, _ = _leaves(state["m"], params)
    v, _ = _leaves(state["v"], params)
    step = state["step"] + 1
    if _fusable(p, g, m, v):
        p, m, v = _torch.fused_adamw(p, g, m, v, [step] * len(p), lr=lr, beta1=b1, beta2=b2,
                                     weight_decay=weight_decay, eps=eps)
        new_state = {"step": step, "m": treedef.unflatten(m), "v": treedef.unflatten(v)}
        return treedef.unflatten(p), new_state
    m = _torch.foreach_add(_torch.foreach_mul(m, b1), _torch.foreach_mul(g, 1 - b1))
    v = _torch.foreach_addcmul(_torch.foreach_mul(v, b2), g, g, value=1 - b2)
    bias1 = 1 - b1 ** step
    bias2_sqrt = torch.sqrt(1 - b2 ** step)
    denom = _torch.foreach_add(_torch.foreach_div(_torch.foreach_sqrt(v), bias2_sqrt), eps)
    p = _torch.foreach_mul(p, 1 - lr * weight_decay)
    p = _torch.foreach_sub(p, _torch.foreach_mul(_torch.foreach_div(m, denom), lr / bias1))
    new_state = {"step": step, "m": treedef.unflatten(m), "v": treedef.unflatten(v)}
    return treedef.unflatten(p), new_state


def _fusable(*lists) -> bool:
    """Can torch's fused AdamW kernel run these (floating point, one dtype and device,
    CPU or CUDA, as torch.optim's ``fused=True`` requires; not eager DTensors, whose
    sharding strategy for the functional kernel is broken in torch 2.13: NOTE [Fused
    optimizer kernels] in sharded/modes/_expand.py)?"""
    tensors = [t for xs in lists for t in xs]
    if not tensors or any(_torch.is_dtensor(_torch.functorch_base(t)) for t in tensors):
        return False
    dtype, device = tensors[0].dtype, tensors[0].device
    return (dtype.is_floating_point and device.type in ("cpu", "cuda", "meta")
            and all(t.dtype == dtype and t.device == device for t in tensors))
