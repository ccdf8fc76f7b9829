"""Ring attention with shard_map, checked against single-device SDPA (values and grads).

    python examples/ring_attention.py                 # 2 local ranks: mesh ("sp"=2)
    python examples/ring_attention.py --nprocs 4      # 4 local ranks
    python examples/ring_attention.py --causal        # causal mask (via axis_index)
    torchrun --nproc-per-node 4 examples/ring_attention.py   # same, via torchrun

q, k and v are [batch, heads, seq, head_dim] with the sequence split over mesh axis
"sp". Each rank keeps its block of queries and passes its key/value block around the
ring with ``collectives.ppermute``, one hop per step for ``axis_size("sp")`` steps,
folding each block into a running (max, sum, weighted sum) softmax as flash attention
does. No rank ever holds the full sequence. The gradient of q, k and v comes from
``torch.func.grad`` inside ``pjit``: the ppermutes' transposes send the cotangents
around the ring the other way. Rank 0 prints the differences from one device and the
collectives per call.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F

from sharded import Mesh, P, gather, launch
from sharded import collectives as C
from transforms import pjit, shard_map

SPEC = P(None, None, "sp", None)         # [batch, heads, seq, head_dim]: seq over "sp"


def ring_attention_block(q, k, v, causal: bool = False):
    """This rank's output rows: its queries against every rank's keys and values.

    At step t the rank at ring position i holds the k/v block of position i - t
    (mod n); each block updates the running row max ``m``, the running softmax
    denominator ``l`` and the running numerator ``acc``.
    """
    n = C.axis_size("sp")
    ring = [(i, (i + 1) % n) for i in range(n)]      # each rank sends to the next
    me = C.axis_index("sp")
    blk = q.shape[-2]
    scale = q.shape[-1] ** -0.5
    rows = me * blk + torch.arange(blk)               # global query positions

    m = l = acc = None
    for step in range(n):
        s = (q @ k.transpose(-2, -1)) * scale        # [b, h, blk, blk]
        if causal:
            src = (me - step) % n                     # whose k/v block this is
            cols = src * blk + torch.arange(blk)
            s = s.masked_fill(cols[None, :] > rows[:, None], float("-inf"))
        # The output does not depend on m (it cancels), so m carries no gradient.
        # Step 0 is the rank's own block: with causal, every row has its diagonal.
        blk_max = s.amax(-1, keepdim=True).detach()
        if step == 0:
            m_new = blk_max
            p = torch.exp(s - m_new)
            l, acc = p.sum(-1, keepdim=True), p @ v
        else:
            m_new = torch.maximum(m, blk_max)
            corr = torch.exp(m - m_new)
            p = torch.exp(s - m_new)
            l = l * corr + p.sum(-1, keepdim=True)
            acc = acc * corr + p @ v
        m = m_new
        if step < n - 1:                              # pass k/v one hop along the ring
            k = C.ppermute(k, "sp", ring)
            v = C.ppermute(v, "sp", ring)
    return acc / l


def make_ring(mesh, causal: bool):
    return shard_map(lambda q, k, v: ring_attention_block(q, k, v, causal), mesh=mesh,
                     in_specs=(SPEC, SPEC, SPEC), out_specs=SPEC)


def main(nprocs: int, causal: bool, batch: int, heads: int, seq: int, head_dim: int):
    mesh = Mesh((nprocs,), ("sp",))
    g = torch.Generator().manual_seed(0)               # the same inputs on every rank
    q, k, v = (torch.randn(batch, heads, seq, head_dim, generator=g) for _ in range(3))
    w = torch.randn(batch, heads, seq, head_dim, generator=g)

    ring = make_ring(mesh, causal)
    out = gather(ring(q, k, v))          # ring(...) is a DTensor laid out as SPEC
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)

    def loss_of(attn):
        return lambda q, k, v: (attn(q, k, v) * w).sum()

    grad_fn = pjit(torch.func.grad(loss_of(ring), argnums=(0, 1, 2)),
                   in_specs=(SPEC, SPEC, SPEC), mesh=mesh)
    grads = gather(grad_fn(q, k, v))
    ref_grads = torch.func.grad(
        loss_of(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal)),
        argnums=(0, 1, 2))(q, k, v)
    torch.testing.assert_close(grads, ref_grads, rtol=1e-5, atol=1e-5)

    # lower() traces and partitions without communicating; gather() is collective,
    # so it stays above, on every rank.
    fwd_lowered, grad_lowered = ring.lower(q, k, v), grad_fn.lower(q, k, v)
    if mesh.rank == 0:
        def counts(lowered):
            return {kind: c["count"] for kind, c in lowered.cost().items() if kind != "total"}

        print(f"mesh {{'sp': {nprocs}}}, q/k/v {tuple(q.shape)} (seq block "
              f"{seq // nprocs} per rank), causal={causal}")
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
