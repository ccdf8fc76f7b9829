"""Mean losses over a split batch: the sum of the losses over the count of targets.

# NOTE [A mean over a split batch]
``F.cross_entropy`` (and ``F.nll_loss``) with ``reduction="mean"`` trace to
``nll_loss_forward(x, target, weight, Mean, ignore_index)``: the loss is
``sum(-w[t] * x[t]) / total_weight`` over the counted targets (those other than
``ignore_index``; ``total_weight`` is their count, or the sum of their class
weights). DTensor's strategy for it, with the batch split, is a ``Partial("avg")``
of each rank's local mean: the mean of the ranks' means, which is the global mean
only when every rank counts the same number of targets. With ``ignore_index``
targets (padding) or class weights spread unevenly over the ranks, the loss that
pjit returned was silently wrong (its gradient was right: the backward divides by
the all-reduced ``total_weight``).

``mean_losses_as_sums`` rewrites the single-device program before it is
partitioned: ``nll_loss_forward(..., Mean, ...)`` becomes ``nll_loss_forward(...,
Sum, ...)`` divided by its own ``total_weight``. On one device this is the same
computation (torch's kernels compute the mean as that sum divided by that weight:
the same bits); split, both the sum and the weight are pending sums, and the loss is
their quotient after both are reduced. The backward (``nll_loss_backward``, already
traced) is unchanged.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

aten = torch.ops.aten
MEAN, SUM = 1, 2            # torch's Reduction enum (nll_loss_forward's 4th argument)
_FORWARDS = (aten.nll_loss_forward.default, aten.nll_loss2d_forward.default)


def mean_losses_as_sums(gm: fx.GraphModule) -> int:
    """NOTE [A mean over a split batch]; returns the number of losses rewritten (then
    ``gm.recompile()`` has been called)."""
    g = gm.graph
    count = 0
    for n in list(g.nodes):
        if n.op != "call_function" or n.target not in _FORWARDS or len(n.args) != 5 \
                or n.args[3] != MEAN:
            continue
        vals = n.meta.get("val")
        loss_users = [u for u in n.users if u.target is operator.getitem and u.args[1] == 0]
        n.args = n.args[:3] + (SUM,) + n.args[4:]
        if not loss_users:
            count += 1
            continue
        with g.inserting_after(n):
            weight = g.call_function(operator.getitem, (n, 1))
        with g.inserting_after(weight):
            total = g.call_function(operator.getitem, (n, 0))
        with g.inserting_after(total):
            mean = g.call_function(aten.div.Tensor, (total, weight))
        if isinstance(vals, (list, tuple)):
            weight.meta["val"], total.meta["val"] = vals[1], torch.empty_like(vals[0])
        for u in loss_users:
            mean.meta.update(u.meta)
            u.replace_all_uses_with(mean)
            g.erase_node(u)
        count += 1
    if count:
        g.lint()
        gm.recompile()
    return count
