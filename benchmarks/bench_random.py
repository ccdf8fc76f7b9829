"""Counter-based random numbers vs torch's own generator, side by side in one run.

    python benchmarks/bench_random.py                 # 1e5 and 1e6 elements, 1 thread
    python benchmarks/bench_random.py --sizes 1000000 --no-compiled

For each size: torch.rand(n) and F.dropout(x, 0.5) eagerly (torch's Philox/MT
generator, values that depend on the layout under partitioning) and under
torch.compile (inductor's own random kernels), against the same ops inside pjit on a
one-rank mesh, where they are rewritten to the counter-based generator: the plain graph
path (DTensorExpandMode(compile=False)) and the compiled path
(DTensorExpandMode(compile=True), inductor). Each row's first calls (trace, partition,
compile) are timed on their own; then every row is warmed up and all rows of a size
are timed round-robin (``_models.timed_interleaved``: one call of each row per round,
--iters rounds), so that load from outside hits every row alike. Medians; writes
benchmarks/results/random.json.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks._models import git_rev, timed_interleaved, write_result  # noqa: E402
from sharded import Mesh, P  # noqa: E402
from sharded.modes import DTensorExpandMode  # noqa: E402
from sharded import pjit  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="100000,1000000")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-compiled", action="store_true", help="no inductor rows (pjit compiled, torch.compile)")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "random.json"))
    a = ap.parse_args()
    load = os.getloadavg()      # (other jobs on a shared machine)
    torch.set_num_threads(a.threads)
    mesh = Mesh((1,), ("dp",))      # (a one-rank process group: timed_interleaved's barrier)
    modes = {"graph": DTensorExpandMode(compile=False)}
    if not a.no_compiled:
        modes["compiled"] = DTensorExpandMode(compile=True)
    rows = []
    for n in [int(s) for s in a.sizes.split(",")]:
        x = torch.randn(n)
        calls = {"torch.rand": lambda: torch.rand(n), "F.dropout": lambda: F.dropout(x, 0.5)}
        for name, mode in modes.items():
            rand = pjit(lambda: torch.rand(n), in_specs=(), mesh=mesh, mode=mode)
            drop = pjit(lambda x: F.dropout(x, 0.5), in_specs=P(), mesh=mesh, mode=mode)
            calls[f"{name} rand"], calls[f"{name} dropout"] = rand, (lambda drop=drop: drop(x))
        if not a.no_compiled:
            crand = torch.compile(lambda: torch.rand(n))
            cdrop = torch.compile(lambda x: F.dropout(x, 0.5))
            calls["torch.compile rand"], calls["torch.compile dropout"] = crand, (lambda: cdrop(x))
        row: dict = {"numel": n}
        for name, fn in calls.items():
            t0 = time.perf_counter()
            fn()
            row[f"{name} first call s"] = time.perf_counter() - t0
        times = timed_interleaved(calls, a.warmup, a.iters)
        row["times_s"] = times
        for name, ts in times.items():
            row[name] = statistics.median(ts) * 1e3
        for name in calls:
            if name.endswith(" rand"):
                row[f"{name} ratio"] = row[name] / row["torch.rand"]
            elif name.endswith(" dropout"):
                row[f"{name} ratio"] = row[name] / row["F.dropout"]
        rows.append(row)
        print(f"n={n:>8}: torch.rand {row['torch.rand']:.2f} ms, F.dropout {row['F.dropout']:.2f} ms "
              f"(median of {a.iters} interleaved rounds)")
        for name in [*modes, *([] if a.no_compiled else ["torch.compile"])]:
            label = name if name == "torch.compile" else f"pjit {name}"
            print(f"  {label:<14} rand {row[f'{name} rand']:8.2f} ms ({row[f'{name} rand ratio']:5.2f}x)   "
                  f"dropout {row[f'{name} dropout']:8.2f} ms ({row[f'{name} dropout ratio']:5.2f}x)   "
                  f"first calls {row[f'{name} rand first call s'] + row[f'{name} dropout first call s']:.1f} s")
    write_result(a.out, {"benchmark": "random", "torch": torch.__version__, "git": git_rev(),
                         "threads": a.threads, "machine": platform.machine(),
                         "cpu_count": os.cpu_count(), "loadavg_at_start": load, "iters": a.iters, "warmup": a.warmup,
                         "date": time.strftime("%Y-%m-%d"), "rows": rows})


if __name__ == "__main__":
    main()
