"""What pjit's per-call cross-rank agreement costs.

    python benchmarks/bench_agreement.py               # 2 ranks, 2000 calls
    python benchmarks/bench_agreement.py --world 4 --iters 500

Before every run of a program the ranks all-reduce a pair of int64 (NOTE [Agreement
on every call] in sharded/sync.py). On local gloo ranks this measures, per call:
- ``agree``: ``sync.agree`` alone, for a program the ranks agree on;
- ``tiny``: a whole call of ``pjit(lambda x: x * 2)`` on a [8, 8] input (no
  collective in the program: the agreement is most of what it communicates);
- ``tiny_allreduce``: ``pjit(lambda x: x.sum())`` of a batch sharded over "dp" (one
  all-reduce in the program) for comparison;
- ``leaves17`` and ``leaves17_program``: a call of a program over 16 replicated [4, 4]
  parameters and a [8, 4] batch (no collective but the agreement), and its local
  program run alone: their difference is the call path's own cost (signature, cache
  lookup, unwrapping the 17 inputs, wrapping the outputs as DTensors).
Medians over ``--iters`` calls, slowest rank; writes benchmarks/results/agreement.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from benchmarks._models import median_ms  # noqa: E402
from sharded import Mesh, P, launch, shard, sync  # noqa: E402
from sharded.modes import DTensorExpandMode  # noqa: E402
from sharded import pjit  # noqa: E402


def _median_us(fn, iters: int) -> float:
    return median_ms(fn, iters) * 1e3


def _rank(world: int, iters: int) -> dict:
    mesh = Mesh((world,), ("dp",))
    outcome = sync.Outcome(program=12345, lines=lambda: ["program"])
    x = torch.ones(8, 8)
    tiny = pjit(lambda x: x * 2, in_specs=P(), mesh=mesh)
    tiny_ar = pjit(lambda x: x.sum(), in_specs=P("dp"), mesh=mesh)
    torch.manual_seed(0)    # plain inputs are one global value: the same on every rank
    params = shard({f"w{i}": torch.randn(4, 4) for i in range(16)}, P(), mesh)
    batch = torch.randn(8, 4)
    many = pjit(_scale, in_specs=(P(), P()), mesh=mesh,
                mode=DTensorExpandMode(compile=False))
    many(params, batch)
    runner = many.lower(params, batch)._c.runner
    locals_ = [v.to_local() for v in params.values()] + [batch]
    return {
        "agree": _median_us(lambda: sync.agree(mesh, "bench", outcome), iters),
        "tiny": _median_us(lambda: tiny(x), iters),
        "tiny_allreduce": _median_us(lambda: tiny_ar(x), iters),
        "leaves17": _median_us(lambda: many(params, batch), iters),
        "leaves17_program": _median_us(lambda: runner(*locals_), iters),
    }


def _scale(p, x):
    return {k: v * 0.9 for k, v in p.items()}, x.sum()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "agreement.json"))
    a = ap.parse_args()
    per_rank = launch(_rank, a.world, a.world, a.iters)
    worst = {k: max(r[k] for r in per_rank) for k in per_rank[0]}
    print(f"world {a.world}, {a.iters} calls, median us per call (slowest rank):")
    for k, v in worst.items():
        print(f"  {k:16s} {v:9.1f}")
    print(f"  agreement share of a tiny call: {worst['agree'] / worst['tiny']:.0%}")
    print(f"  17-input call path outside its program: "
          f"{worst['leaves17'] - worst['leaves17_program'] - worst['agree']:.1f} us (and the agreement)")
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"benchmark": "agreement", "torch": torch.__version__, "world": a.world,
                   "iters": a.iters, "cpu_count": os.cpu_count(), "median_us": worst,
                   "per_rank": per_rank}, f, indent=1)


if __name__ == "__main__":
    main()
