"""Per-rank compute of the data-parallel gpt-tiny step with no communication at all:
two one-rank processes side by side, each running the half-batch step.

    python benchmarks/bench_compute_alone.py            # gpt-tiny, batch 8 x 64 split in 2
    python benchmarks/bench_compute_alone.py --procs 1  # one process alone

What a rank of ``bench_data_parallel.py``'s 2-rank gpt-tiny rows computes (d 128, 2
layers, 4 heads, vocab 256, seq 64, half of a batch of 8), with the machine shared the
same way (``--procs`` processes at once, one intra-op thread each), but no collective
and no other rank to wait for. Each process is a one-rank mesh (``Mesh((1,))``) and
times, round-robin (``_models.timed_interleaved``):

- ``pjit_graph``: ``pjit(gpt.train_step, mode=DataParallelMode("replicate",
  compile=False))``: the program's graph, as the ``pjit_ddp`` row runs it;
- ``module``: ``_models.GPTBlocks`` (the module of the ``ddp`` row, not wrapped in
  DDP), ``loss.backward()``, ``torch.optim.AdamW`` (default: the per-tensor loop on CPU);
- ``module_fused``: the same with ``torch.optim.AdamW(fused=True)``.

Medians per process; writes ``benchmarks/results/compute_alone.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from benchmarks import _models as M  # noqa: E402
from benchmarks._models import git_rev, timed_interleaved, write_result  # noqa: E402
from examples import gpt  # noqa: E402


def _child(a: dict) -> dict:
    from sharded import Mesh, P, optim
    from sharded.modes import DataParallelMode
    from sharded import pjit

    torch.set_num_threads(1)
    mesh = Mesh((1,), ("dp",))
    cfg = gpt.GPTConfig(vocab=a["vocab"], d_model=a["d_model"], n_heads=a["heads"],
                        n_layers=a["layers"], seq=a["seq"], sdpa=True)
    params = gpt.init_params(cfg, 0)
    ids, tgt = gpt.batch(cfg, a["batch"], seed=1)
    ids, tgt = ids[: a["batch"] // 2], tgt[: a["batch"] // 2]      # one rank's half
    st = {"p": params, "o": optim.adamw_init(params)}
    f = pjit(lambda p, o, x, y: gpt.train_step(p, o, x, y, cfg), in_specs=(P(), P(), P("dp"), P("dp")),
             mesh=mesh, mode=DataParallelMode("replicate", compile=False))

    def pjit_graph():
        st["p"], st["o"], _ = f(st["p"], st["o"], ids, tgt)

    def module_step(fused: bool):
        model = M.GPTBlocks(params, cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-2, fused=fused)

        def step():
            opt.zero_grad(set_to_none=True)
            M.module_loss(model, ids, tgt).backward()
            opt.step()
        return step

    steps = {"pjit_graph": pjit_graph, "module": module_step(False), "module_fused": module_step(True)}
    times = timed_interleaved(steps, a["warmup"], a["iters"])
    return {"times_s": times, "median_ms": {k: statistics.median(v) * 1e3 for k, v in times.items()}}


def main(argv=None):
    if argv is None and len(sys.argv) == 3 and sys.argv[1] == "--child":
        print(json.dumps(_child(json.loads(sys.argv[2]))))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--procs", type=int, default=2, help="processes side by side (ranks)")
    M.gpt_shape_arguments(ap)    # --batch: the global batch; each process runs half
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "compute_alone.json"))
    args = ap.parse_args(argv)
    a = {k: getattr(args, k) for k in ("vocab", "d_model", "heads", "layers", "batch", "seq",
                                       "warmup", "iters")}
    env = {**os.environ, "PYTHONPATH": ROOT}
    t0 = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", json.dumps(a)],
                              env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(args.procs)]
    per_proc = []
    for p in procs:
        out, err = p.communicate()
        if p.returncode:
            raise RuntimeError(f"a process failed:\n{err[-4000:]}")
        per_proc.append(json.loads(out.strip().splitlines()[-1]))
    print(f"gpt-tiny half-batch step ({args.batch // 2} x {args.seq}), {args.procs} one-rank "
          f"processes side by side, no communication; median ms per process:")
    for k in per_proc[0]["median_ms"]:
        print(f"  {k:<14}" + "  ".join(f"{r['median_ms'][k]:6.2f}" for r in per_proc))
    write_result(args.out, {"benchmark": "compute_alone",
                            "date": datetime.datetime.now().isoformat(timespec="seconds"),
                            "torch": torch.__version__, "git": git_rev(), "cpu_count": os.cpu_count(),
                            "loadavg_at_end": os.getloadavg(), "procs": args.procs, "config": a, "per_process": per_proc},
                 f"{time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
