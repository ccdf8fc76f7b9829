"""A pjit program's outputs never share storage with one another, in every mode.

CSE merges equal computations, and ``optim.adamw_init``'s two ``zeros_like`` per
parameter once came back as one tensor in both moments: ``m.add_(1)`` changed ``v``,
where the single-device program returns two tensors (a silent wrong result for any
caller that updates state in place, as torch.optim does). The same holds for the
gradients that pjit's backward program hands to autograd: ``a + b`` gives both
inputs one gradient, and ``.grad`` of one clipped in place must not move the other.
And an output that the backward reads (``exp``'s result) once gave a wrong gradient
when updated in place before the backward; it now raises torch's own error, as eager
code does.
On real gloo ranks (world 2).
"""

from __future__ import annotations

import optree
import torch
from torch.distributed.tensor import DTensor

from sharded import Mesh, P, optim, shard
from sharded.modes import DataParallelMode, DTensorExpandMode
from transforms import pjit


def _zeros_twice(x):
    return torch.zeros_like(x), torch.zeros_like(x), x * 1.0, x * 1.0


def _same_tensor_twice(x):
    y = x + 1.0
    return y, y, y.view(-1)


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def _separate(outs) -> list[str]:
    """The pairs of outputs whose local storages are one, and whether an in-place
    update of one moved another."""
    leaves = [_local(t) for t in optree.tree_leaves(outs)]
    bad = []
    for i, a in enumerate(leaves):
        for j in range(i + 1, len(leaves)):
            if a.untyped_storage().data_ptr() == leaves[j].untyped_storage().data_ptr():
                bad.append(f"outputs {i} and {j} share storage")
    before = [t.clone() for t in leaves]
    leaves[0].add_(1.0)
    for j in range(1, len(leaves)):
        if not torch.equal(leaves[j], before[j]):
            bad.append(f"add_ on output 0 changed output {j}")
    return bad


def _body():
    mesh = Mesh((2,), ("dp",))
    torch.manual_seed(0)          # plain inputs are one global value: the same on every rank
    params = {"w": torch.randn(4, 4), "b": torch.randn(4)}
    x = torch.randn(4, 4)
    out = {}
    for mode in (DTensorExpandMode(), DataParallelMode("replicate"), DataParallelMode("shard")):
        for fn, arg in ((optim.adamw_init, params), (_zeros_twice, x), (_same_tensor_twice, x)):
            res = pjit(fn, in_specs=P(), mesh=mesh, mode=mode)(arg)
            out[repr(mode), fn.__name__] = _separate(res)
    # the backward program's gradients: d(a + b)/da and d(a + b)/db are one tensor
    a, b = (shard(torch.randn(4, 4), P(), mesh).requires_grad_() for _ in range(2))
    loss = pjit(lambda a, b: (a + b).sum(), in_specs=(P(), P()), out_specs=P(), mesh=mesh)
    loss(a, b).backward()
    out["grads"] = _separate([a.grad, b.grad])
    # an output the backward reads (exp's result), updated in place before the
    # backward: torch's own error, as in eager code, never a wrong gradient
    x0 = torch.randn(4, 4)
    xs = shard(x0.clone(), P(), mesh).requires_grad_()
    y = pjit(torch.exp, in_specs=P(), out_specs=P(), mesh=mesh)(xs)
    with torch.no_grad():
        y.add_(1.0)
    try:
        y.sum().backward()
        out["in-place before backward"] = [f"no error; gradient off by "
                                           f"{float((xs.grad.full_tensor() - x0.exp()).abs().max())}"]
    except RuntimeError as e:
        ok = "modified by an inplace operation" in str(e)
        out["in-place before backward"] = [] if ok else [f"another error: {e}"]
    return out


def test_outputs_never_share_storage(on_ranks):
    for res in on_ranks(2, _body):
        assert len(res) == 11
        for case, bad in res.items():
            assert bad == [], (case, bad)
