"""Ring attention with shard_map, checked against single-device SDPA (values and grads).

    python examples/ring_attention.py                 # 2 local ranks: mesh ("sp"=2)
    python examples/ring_attention.py --nprocs 4      # 4 local ranks
    python examples/ring_attention.py --causal        # causal mask (via axis_index)
    torchrun --nproc-per-node 4 examples/ring_attention.py   # same, via torchrun

q, k and v are [batch, heads, seq, head_dim] with the sequence split over mesh axis
"sp", and a key-padding bias [batch, 1, 1, seq] (0 for a real key, -inf for padding)
split the same way. Each rank keeps its block of queries and passes its key/value
block and its bias block around the ring with ``collectives.ppermute`` (point-to-
point: the -inf entries arrive as they left), one hop per step for
``axis_size("sp")`` steps, folding each block into a running (max, sum, weighted sum)
softmax as flash attention does; the running max starts at -inf. No rank ever holds
the full sequence. The gradient of q, k and v comes from ``torch.func.grad`` inside
``pjit``: the ppermutes' transposes send the cotangents around the ring the other
way. Rank 0 prints the differences from single-device SDPA and the collectives per
call.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F

from sharded import Mesh, P, gather, launch
from sharded import collectives as C
from sharded import pjit, shard_map

SPEC = P(None, None, "sp", None)         # [batch, heads, seq, head_dim]: seq over "sp"


def ring_attention_block(q, k, v, bias, causal: bool = False):
    """This rank's output rows: its queries against every rank's keys and values.

    At step t the rank at ring position i holds the k/v/bias block of position i - t
    (mod n); each block updates the running row max ``m`` (from -inf), the running
    softmax denominator ``l`` and the running numerator ``acc``.
    """
    n = C.axis_size("sp")
    ring = [(i, (i + 1) % n) for i in range(n)]      # each rank sends to the next
    me = C.axis_index("sp")
    blk = q.shape[-2]
    scale = q.shape[-1] ** -0.5
    rows = me * blk + torch.arange(blk, device=q.device)   # global query positions

    m = torch.full((*q.shape[:-1], 1), float("-inf"), device=q.device)
    l = torch.zeros((*q.shape[:-1], 1), device=q.device)
    acc = torch.zeros_like(q)
    for step in range(n):
        s = (q @ k.transpose(-2, -1)) * scale + bias  # [b, h, blk, blk]; -inf: padding
        if causal:
            src = (me - step) % n                     # whose k/v block this is
            cols = src * blk + torch.arange(blk, device=q.device)
            s = s.masked_fill(cols[None, :] > rows[:, None], float("-inf"))
        # The output does not depend on m (it cancels), so m carries no gradient. A row
        # whose keys so far are all masked keeps m = -inf: shift by 0 there instead.
        m_new = torch.maximum(m, s.amax(-1, keepdim=True)).detach()
        shift = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        p = torch.exp(s - shift)
        corr = torch.exp(m - shift)
        l = l * corr + p.sum(-1, keepdim=True)
        acc = acc * corr + p @ v
        m = m_new
        if step < n - 1:                              # pass k/v/bias one hop along the ring
            k, v, bias = (C.ppermute(t, "sp", ring) for t in (k, v, bias))
    return acc / l


BIAS_SPEC = P(None, None, None, "sp")      # [batch, 1, 1, seq]: keys over "sp"


def make_ring(mesh, causal: bool):
    return shard_map(lambda q, k, v, bias: ring_attention_block(q, k, v, bias, causal),
                     mesh=mesh, in_specs=(SPEC, SPEC, SPEC, BIAS_SPEC), out_specs=SPEC)


def padding_bias(batch: int, seq: int, g: torch.Generator) -> torch.Tensor:
    """0 for real keys, -inf for padded ones; key 0 is never padded, so no row is
    masked everywhere (SDPA gives NaN for such rows)."""
    pad = torch.rand(batch, seq, generator=g) < 0.3
    pad[:, 0] = False
    return torch.zeros(batch, 1, 1, seq).masked_fill(pad[:, None, None, :], float("-inf"))


def sdpa(q, k, v, bias, causal: bool):
    mask = bias
    if causal:
        n = q.shape[-2]
        upper = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
        mask = mask + torch.zeros(n, n, device=q.device).masked_fill(upper, float("-inf"))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def main(nprocs: int, causal: bool, batch: int, heads: int, seq: int, head_dim: int):
    mesh = Mesh((nprocs,), ("sp",))
    g = torch.Generator().manual_seed(0)               # the same inputs on every rank
    q, k, v = (torch.randn(batch, heads, seq, head_dim, generator=g) for _ in range(3))
    bias = padding_bias(batch, seq, g)
    w = torch.randn(batch, heads, seq, head_dim, generator=g)
    # on the mesh's device (cpu, or this rank's GPU), where the single-device reference runs
    q, k, v, bias, w = (t.to(mesh.device) for t in (q, k, v, bias, w))

    ring = make_ring(mesh, causal)
    out = gather(ring(q, k, v, bias))    # ring(...) is a DTensor laid out as SPEC
    ref = sdpa(q, k, v, bias, causal)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)

    def loss_of(attn):
        return lambda q, k, v, bias: (attn(q, k, v, bias) * w).sum()

    grad_fn = pjit(torch.func.grad(loss_of(ring), argnums=(0, 1, 2)),
                   in_specs=(SPEC, SPEC, SPEC, BIAS_SPEC), mesh=mesh)
    grads = gather(grad_fn(q, k, v, bias))
    ref_grads = torch.func.grad(loss_of(lambda q, k, v, b: sdpa(q, k, v, b, causal)),
                                argnums=(0, 1, 2))(q, k, v, bias)
    torch.testing.assert_close(grads, ref_grads, rtol=1e-5, atol=1e-5)

    # lower() traces and partitions without communicating; gather() is collective,
    # so it stays above, on every rank.
    fwd_lowered, grad_lowered = ring.lower(q, k, v, bias), grad_fn.lower(q, k, v, bias)
    if mesh.rank == 0:
        def counts(lowered):
            return {kind: c["count"] for kind, c in lowered.cost().items() if kind != "total"}

        print(f"mesh {{'sp': {nprocs}}}, q/k/v {tuple(q.shape)} (seq block "
              f"{seq // nprocs} per rank), causal={causal}, padded keys: "
              f"{int(torch.isinf(bias).sum())} of {batch * seq}")
        print(f"  max |ring - sdpa| output: {(out - ref).abs().max().item():.2e}")
        for name, a, b in zip("qkv", grads, ref_grads):
            print(f"  max |ring - sdpa| d{name}:    {(a - b).abs().max().item():.2e}")
        print(f"  collectives per call: forward {counts(fwd_lowered)}, "
              f"grad {counts(grad_lowered)}")
    return True


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nprocs", type=int, default=2, help="local ranks (the size of \"sp\")")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=8)
    a = ap.parse_args()
    rest = (a.causal, a.batch, a.heads, a.seq, a.head_dim)
    if "RANK" in os.environ:       # under torchrun: this process is one rank
        main(int(os.environ["WORLD_SIZE"]), *rest)
    else:                          # laptop path: start --nprocs local CPU ranks
        launch(main, a.nprocs, a.nprocs, *rest)
