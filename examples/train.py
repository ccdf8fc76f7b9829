"""Train a small GPT with pjit on local ranks, and check it against one device.

    python examples/train.py                 # 2 local ranks: mesh ("dp"=1, "tp"=2)
    python examples/train.py --dp 2 --tp 2   # 4 local ranks, 2-D mesh
    torchrun --nproc-per-node 4 examples/train.py --dp 2 --tp 2   # same, via torchrun

The whole train step (forward, backward, AdamW) is one pjit call: parameters and
optimizer moments are Megatron-sharded over "tp", the batch is split over "dp".
Rank 0 prints the loss of the distributed run next to the single-device run, which
runs on the mesh's device (``mesh.device``: CPU under gloo, this rank's GPU under
NCCL).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import optree
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gpt  # noqa: E402  (examples/gpt.py)
from sharded import Mesh, P, gather, launch, optim, shard  # noqa: E402
from sharded import pjit  # noqa: E402


def pattern_batch(cfg, batch_size: int):
    """Sequences that follow a learnable rule (next = (3 * tok + 1) mod vocab)."""
    toks = torch.empty(batch_size, cfg.seq + 1, dtype=torch.long)
    toks[:, 0] = torch.arange(batch_size) * 5 % cfg.vocab
    for i in range(cfg.seq):
        toks[:, i + 1] = (3 * toks[:, i] + 1) % cfg.vocab
    return toks[:, :-1].contiguous(), toks[:, 1:].contiguous()


def main(dp: int, tp: int, steps: int, batch_size: int, lr: float):
    mesh = Mesh((dp, tp), ("dp", "tp"))
    cfg = gpt.tiny()
    params = gpt.init_params(cfg, seed=0)
    opt_state = optim.adamw_init(params)
    ids, targets = pattern_batch(cfg, batch_size)
    # the single-device reference runs where the mesh's shards live (cpu, or cuda:k)
    params, opt_state, ids, targets = optree.tree_map(
        lambda t: t.to(mesh.device), (params, opt_state, ids, targets))

    param_specs = gpt.tp_specs(params)
    opt_specs = gpt.opt_specs(param_specs)
    step = pjit(
        gpt.train_step,
        in_specs=(param_specs, opt_specs, P("dp"), P("dp")),
        out_specs=(param_specs, opt_specs, P()),
        static_argnums=(4, 5),
        mesh=mesh,
    )
    d_params, d_opt = shard((params, opt_state), (param_specs, opt_specs), mesh)
    d_ids, d_targets = shard((ids, targets), P("dp"), mesh)

    t0 = time.perf_counter()
    lowered = step.lower(d_params, d_opt, d_ids, d_targets, cfg, lr)
    compile_s = time.perf_counter() - t0
    if mesh.rank == 0:
        counts = {k: v["count"] for k, v in lowered.cost().items() if k != "total"}
        print(f"mesh {dict(zip(mesh.axis_names, mesh.shape))} on {mesh.device.type}: "
              f"compiled in {compile_s:.1f} s, "
              f"collectives per step {counts}")
        print(f"{'step':>4}  {'pjit loss':>10}  {'1-device loss':>13}")

    ref_params, ref_opt = params, opt_state
    worst = 0.0
    for i in range(steps):
        d_params, d_opt, loss = step(d_params, d_opt, d_ids, d_targets, cfg, lr)
        ref_params, ref_opt, ref_loss = gpt.train_step(ref_params, ref_opt, ids, targets, cfg, lr)
        loss = gather(loss)
        worst = max(worst, abs(loss.item() - ref_loss.item()))
        if mesh.rank == 0 and (i % 5 == 0 or i == steps - 1):
            print(f"{i:>4}  {loss.item():>10.4f}  {ref_loss.item():>13.4f}")
    torch.testing.assert_close(loss, ref_loss, rtol=1e-4, atol=1e-4)
    if mesh.rank == 0:
        print(f"max |pjit - single device| loss difference over {steps} steps: {worst:.2e}")
    return loss.item()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    a = ap.parse_args()
    args = (a.dp, a.tp, a.steps, a.batch_size, a.lr)
    if "RANK" in os.environ:       # under torchrun: this process is one rank
        main(*args)
    else:                          # laptop path: start dp * tp local CPU ranks
        launch(main, a.dp * a.tp, *args)
