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
    # Under tests/test_faults.py (FAULT_OUTCOME_DIR set): rank 0 ignores the SIGTERM that
    # torchrun sends the other ranks as soon as one ends (its SIGKILL follows 30 s
    # later), so the test sees whether rank 0 ended on its own with rank 1's failure as
    # its cause; each rank writes the exception it ended with to FAULT_OUTCOME_DIR/rank<r>.
    outcome_dir = os.environ.get("FAULT_OUTCOME_DIR")
    rank = os.environ.get("RANK", "?")
    if outcome_dir and rank == "0":
        import signal

        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        train_until_fault(sys.argv[1])
    except BaseException as e:
        if outcome_dir:
            with open(os.path.join(outcome_dir, f"rank{rank}"), "w") as f:
                f.write(f"{type(e).__module__}.{type(e).__qualname__}: {e}")
        raise
