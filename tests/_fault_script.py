"""A training loop in which rank 1 fails at step 3; run by tests/test_faults.py under
torchrun (``torchrun --nproc-per-node 2 tests/_fault_script.py raise|exit``) and, as
``train_until_fault``, under sharded.launch and RankPool."""

import os
import sys
import threading

import torch
import torch.distributed as dist
import torch.nn.functional as F

from sharded import Mesh, P
from transforms import pjit


def train_until_fault(kind: str, steps: int = 100_000):
    """Rank 1 fails at step 3: ``raise``: an index out of range in its shard of the
    batch (an IndexError while the program runs); ``exit``: the process ends with
    os._exit(7) 0.2 s later, wherever it is (usually inside a step)."""
    mesh = Mesh((2,), ("dp",))
    torch.manual_seed(0)
    w = torch.randn(8, 3)
    step = pjit(lambda w, ids: F.embedding(ids, w).sum(), in_specs=(P(), P("dp")), mesh=mesh)
    ids = torch.tensor([1, 2, 3, 4])
    for i in range(steps):
        if i == 3:
            if dist.get_rank() == 1:
                print(f"rank 1 fails now ({kind})", flush=True)
            if kind == "raise":             # one global batch, the bad index in rank 1's shard
                ids = torch.tensor([1, 2, 3, 40])
            elif dist.get_rank() == 1:
                threading.Timer(0.2, os._exit, (7,)).start()
        step(w, ids)
    return "finished"


if __name__ == "__main__":
    train_until_fault(sys.argv[1])
