"""sharded/rules/losses.py: a mean loss becomes a sum over its total weight, with the
same bits on one device (the split runs are in test_data_parallel.py)."""

import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from sharded.rules.losses import mean_losses_as_sums


def test_mean_losses_as_sums_keeps_the_bits():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(12, 7, generator=g, requires_grad=True)
    targets = torch.randint(0, 7, (12,), generator=g)
    targets[:3] = -100
    weight = torch.rand(7, generator=g) + 0.5

    def f(x, t, w):
        plain = F.cross_entropy(x, t)
        weighted = F.cross_entropy(x, t, weight=w)
        grad, = torch.autograd.grad(plain + weighted, x)
        return plain, weighted, grad

    gm = make_fx(f)(logits, targets, weight)
    expected = gm(logits, targets, weight)
    assert mean_losses_as_sums(gm) == 2
    assert all(n.args[3] == 2 for n in gm.graph.nodes if n.target is torch.ops.aten.nll_loss_forward.default)
    got = gm(logits, targets, weight)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
