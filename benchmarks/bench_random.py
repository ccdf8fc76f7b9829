"""Counter-based random numbers vs torch's own generator, side by side in one run.

    python benchmarks/bench_random.py                 # 1e5 and 1e6 elements, 1 thread
    python benchmarks/bench_random.py --sizes 1000000 --no-compiled

For each size: torch.rand(n) and F.dropout(x, 0.5) eagerly (torch's Philox/MT
generator, values that depend on the layout under partitioning), against the same
ops inside pjit on a one-rank mesh, where they are rewritten to the counter-based
generator: the plain graph path (DTensorExpandMode(compile=False)) and the compiled path
(DTensorExpandMode(compile=True), inductor). Medians of --iters calls; writes
benchmarks/results/random.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch
import torch.nn.functional as F

from sharded import Mesh, P
from sharded.modes import DTensorExpandMode
from transforms import pjit


def median_ms(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2] * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="100000,1000000")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-compiled", action="store_true")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "random.json"))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    mesh = Mesh((1,), ("dp",))
    modes = {"graph": DTensorExpandMode(compile=False)}
    if not a.no_compiled:
        modes["compiled"] = DTensorExpandMode(compile=True)
    rows = []
    for n in [int(s) for s in a.sizes.split(",")]:
        x = torch.randn(n)
        row = {"numel": n,
               "torch.rand": median_ms(lambda: torch.rand(n), a.iters),
               "F.dropout": median_ms(lambda: F.dropout(x, 0.5), a.iters)}
        for name, mode in modes.items():
            rand = pjit(lambda: torch.rand(n), in_specs=(), mesh=mesh, mode=mode)
            drop = pjit(lambda x: F.dropout(x, 0.5), in_specs=P(), mesh=mesh, mode=mode)
            t0 = time.perf_counter()
            rand(), drop(x)
            row[f"{name} first calls s"] = time.perf_counter() - t0
            row[f"{name} rand"] = median_ms(rand, a.iters)
            row[f"{name} dropout"] = median_ms(lambda: drop(x), a.iters)
            row[f"{name} rand ratio"] = row[f"{name} rand"] / row["torch.rand"]
            row[f"{name} dropout ratio"] = row[f"{name} dropout"] / row["F.dropout"]
        rows.append(row)
        print(f"n={n:>8}: torch.rand {row['torch.rand']:.2f} ms, F.dropout {row['F.dropout']:.2f} ms")
        for name in modes:
            print(f"  pjit {name:<8} rand {row[f'{name} rand']:8.2f} ms ({row[f'{name} rand ratio']:5.1f}x)   "
                  f"dropout {row[f'{name} dropout']:8.2f} ms ({row[f'{name} dropout ratio']:5.1f}x)   "
                  f"first calls {row[f'{name} first calls s']:.1f} s")
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"torch": torch.__version__, "threads": a.threads, "machine": platform.machine(),
                   "date": time.strftime("%Y-%m-%d"), "rows": rows}, f, indent=1)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
