"""sharded.optim.adamw's three paths, side by side in one run: torch's fused kernel with
a float lr, the fused kernel's tensor-lr overload (a scheduled or traced lr), and the
foreach ops (tensor betas or weight decay, which no fused overload takes).

    python benchmarks/bench_optim.py                  # 16 parameters of 256x256, 1 thread

Each row updates the same parameters, gradients and moments (copies), one update per
call; the rows are timed round-robin (one call of each per round) so that load from
outside hits them alike, and each row's result is checked against the float-lr row
(bitwise for the tensor lr, to float rounding for the foreach ops) before any timing.
Medians; writes benchmarks/results/optim.json (docs/optim.md quotes it).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from benchmarks._models import git_rev, write_result  # noqa: E402
from sharded import optim  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=int, default=16)
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "optim.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    params = {f"p{i}": torch.randn(args.size, args.size, generator=g) for i in range(args.params)}
    grads = {k: torch.randn(v.shape, generator=g) for k, v in params.items()}
    state = optim.adamw_init(params)
    lr = 1e-3
    rows = {
        "fused, float lr": lambda: optim.adamw(params, grads, state, lr=lr),
        "fused, tensor lr": lambda: optim.adamw(params, grads, state,
                                                lr=torch.tensor(lr, dtype=torch.float64)),
        "foreach (tensor betas)": lambda: optim.adamw(
            params, grads, state, lr=lr, betas=(torch.tensor(0.9), torch.tensor(0.999))),
    }
    # the same work: one update from the same state
    ref = rows["fused, float lr"]()[0]
    for name, fn in rows.items():
        out = fn()[0]
        for k in ref:
            if name == "fused, tensor lr":
                assert torch.equal(out[k], ref[k]), (name, k)
            else:
                torch.testing.assert_close(out[k], ref[k], rtol=1e-5, atol=1e-6)
    for fn in rows.values():
        for _ in range(3):
            fn()
    times: dict[str, list[float]] = {n: [] for n in rows}
    for _ in range(args.iters):
        for name, fn in rows.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    med = {n: sorted(t)[len(t) // 2] * 1e3 for n, t in times.items()}
    base = med["fused, float lr"]
    for n, ms in med.items():
        print(f"{n:24s} {ms:7.2f} ms  {ms / base:5.2f}x")
    write_result(args.out, {
        "benchmark": "optim", "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "torch": torch.__version__,
        "git": git_rev(), "cpu_count": os.cpu_count(), "machine": platform.machine(),
        "loadavg_at_start": list(os.getloadavg()),
        "config": {"params": args.params, "size": args.size, "iters": args.iters, "threads": args.threads},
        "median_ms": med, "ratio_to_fused_float_lr": {n: ms / base for n, ms in med.items()},
    })


if __name__ == "__main__":
    main()
