"""Mixed precision: DataParallelMode("shard", param_dtype=bf16, reduce_dtype=fp32)
against FSDP2 with the same MixedPrecisionPolicy, step time and peak memory of a GPT
train step on local gloo ranks, side by side in one run.

    python benchmarks/bench_precision.py                 # gpt-tiny (d 128), 2 ranks
    python benchmarks/bench_precision.py --iters 30 --d-model 256

Rows (every one: forward, backward, AdamW on fp32 masters):

  fsdp2           fully_shard on every block and the root, fp32;
                  torch.optim.AdamW(fused=True)
  fsdp2_bf16      the same with mp_policy=MixedPrecisionPolicy(param_dtype=bf16,
                  reduce_dtype=fp32)
  pjit_fsdp       pjit(step, mode=DataParallelMode("shard")), batch P("dp"), fp32
  pjit_fsdp_bf16  DataParallelMode("shard", param_dtype=bf16, reduce_dtype=fp32)
  pjit_fsdp_bf16_donated
                  pjit_fsdp_bf16 with donate_argnums=(0, 1): masters and moments updated
                  in the donated storage, as FSDP2 updates in place (the like-for-like
                  memory row)

The pjit rows run the graph (``compile=False``). Timing and memory follow
bench_data_parallel.py: rows built, warmed up and timed round-robin (a barrier
before every step; the slowest rank's median), then peak resident memory in processes
of their own, each row built and run from nothing inside the window (after a warm-up
build outside it), the least of three rounds. After the timing, every row's state is
compared with a single-device run of as many steps (NOTE [Every row did the same
work] in ``_models.py``): the fp32 rows with the plain step at SAME_WORK_RTOL, the
bf16 rows with the same policy on one device (``sharded.precision.in_grad`` of the
step, eager) at BF16_RTOL (ranks round their shares of each gradient to bf16 before
summing them, one device does not: see BF16_RTOL), and the pjit bf16 rows with
fsdp2_bf16 at SAME_WORK_RTOL. Writes ``benchmarks/results/precision.json``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import optree  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks import _models as M  # noqa: E402
from benchmarks._models import git_rev, write_result  # noqa: E402
from examples import gpt  # noqa: E402
from sharded import launch  # noqa: E402

ROWS = ("fsdp2", "fsdp2_bf16", "pjit_fsdp", "pjit_fsdp_bf16", "pjit_fsdp_bf16_donated")
RATIOS = (("pjit_fsdp_bf16", "fsdp2_bf16"), ("pjit_fsdp", "fsdp2"), ("fsdp2_bf16", "fsdp2"),
          ("pjit_fsdp_bf16", "pjit_fsdp"), ("pjit_fsdp_bf16_donated", "fsdp2_bf16"))
MEM_RATIOS = (("pjit_fsdp_bf16", "fsdp2_bf16"), ("pjit_fsdp_bf16_donated", "fsdp2_bf16"),
              ("pjit_fsdp", "fsdp2"), ("fsdp2_bf16", "fsdp2"))
# bf16 rows against the same policy on one device. They differ by more than float
# rounding: on ranks, each rank's share of a gradient is rounded to bf16 before the
# fp32 sum across ranks (FSDP2's MixedPrecisionPolicy the same), where one device
# rounds the whole sum once; the extra rounding noise raises Adam's second moments
# (the committed run: exp_avg_sq's sum 5% above one device's after 24 steps, the
# parameters within 2e-4). Wrong work differs by 0.2 or more (2x gradients: the
# moments 4x). The pjit bf16 rows are also checked against fsdp2_bf16, the same
# policy on the same ranks, at SAME_WORK_RTOL.
BF16_RTOL = 0.1
BF16, F32 = torch.bfloat16, torch.float32


def _spec(a: dict) -> dict:
    cfg = gpt.GPTConfig(vocab=a["vocab"], d_model=a["d_model"], n_heads=a["heads"],
                        n_layers=a["layers"], seq=a["seq"], sdpa=True)
    params = gpt.init_params(cfg, 0)

    def step(p, o, x, y):
        return gpt.train_step(p, o, x, y, cfg)

    return dict(cfg=cfg, params=params, step=step, batch=gpt.batch(cfg, a["batch"], seed=1))


def _build(row: str, spec: dict, world: int, rank: int):
    """Everything a row needs (built inside the memory window); returns step()."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from sharded import Mesh, P, optim, pjit
    from sharded.modes import DataParallelMode

    x, y = spec["batch"]
    st: dict = {}
    bf16 = "bf16" in row
    if row.startswith("fsdp2"):
        local = tuple(t.chunk(world)[rank] for t in (x, y))
        model = M.GPTBlocks(spec["params"], spec["cfg"])
        mesh = Mesh((world,), ("dp",)).device_mesh
        mp = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=F32) if bf16 else MixedPrecisionPolicy()
        for unit in model.blocks:
            fully_shard(unit, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        opt = M.torch_adamw(model.parameters(), lr=1e-3, weight_decay=1e-2)

        def step():
            opt.zero_grad(set_to_none=True)
            loss = M.module_loss(model, *local)
            loss.backward()
            opt.step()
            st["loss"] = loss.detach()

        def fingerprint():
            loss = st["loss"].float()          # this rank's batch: the mean of the ranks' means
            dist.all_reduce(loss, op=dist.ReduceOp.AVG)
            return M.optimizer_fingerprint(loss, opt)
        st["fingerprint"] = fingerprint
    else:
        mesh = Mesh((world,), ("dp",))
        donate = (0, 1) if row.endswith("_donated") else ()
        kw = dict(param_dtype=BF16, reduce_dtype=F32) if bf16 else {}
        mode = DataParallelMode("shard", compile=False, **kw)
        f = pjit(spec["step"], in_specs=(P(), P(), P("dp"), P("dp")), mesh=mesh, mode=mode,
                 donate_argnums=donate)
        init = pjit(optim.adamw_init, in_specs=P(), mesh=mesh, mode=mode)   # born sharded
        st["p"] = pjit(lambda t: optree.tree_map(torch.clone, t), in_specs=P(), mesh=mesh, mode=mode)(
            spec["params"]) if donate else optree.tree_map(torch.clone, spec["params"])
        st["o"] = init(spec["params"])

        def step():
            st["p"], st["o"], st["loss"] = f(st["p"], st["o"], x, y)
        st["lower"] = lambda: f.lower(st["p"], st["o"], x, y)
        st["fingerprint"] = lambda: M.functional_fingerprint(st["loss"].float(), st["p"], st["o"])
    step()
    return step, st


def _rank_main(a: dict) -> dict:
    import sharded.rules  # noqa: F401  (SDPA sharding rules)

    rank, world = dist.get_rank(), dist.get_world_size()
    spec = _spec(a)
    return _memory(a, spec, world, rank) if a["phase"] == "memory" else _time(a, spec, world, rank)


def _memory(a: dict, spec: dict, world: int, rank: int) -> dict:
    method, peaks = M.least_window_peaks(a["rows"], lambda row: _build(row, spec, world, rank))
    return {"peak_method": method, "peak_bytes": peaks}


def _time(a: dict, spec: dict, world: int, rank: int) -> dict:
    from sharded import optim, precision

    steps, states = {}, {}
    for row in a["rows"]:
        steps[row], states[row] = _build(row, spec, world, rank)
    res: dict = {"times": M.timed_interleaved(steps, a["warmup"], a["iters"])}
    # NOTE [Every row did the same work]: the first step in _build, the warm-up and the
    # timed rounds; the references take as many, on one device
    res["fingerprint"] = {r: states[r]["fingerprint"]() for r in a["rows"]}
    n = 1 + a["warmup"] + a["iters"]
    res["reference"] = {}
    for name, step in (("fp32", spec["step"]), ("bf16", precision.in_grad(spec["step"], BF16))):
        p, o = spec["params"], optim.adamw_init(spec["params"])
        for _ in range(n):
            p, o, loss = step(p, o, *spec["batch"])
        res["reference"][name] = M.functional_fingerprint(loss.float(), p, o)
    res["cost"] = {}
    for r in a["rows"]:
        if "lower" in states[r]:
            res["cost"][r] = {}
            for c in states[r]["lower"]().collectives():
                key = f"{c.kind} {str(c.dtype).replace('torch.', '')}"
                row = res["cost"][r].setdefault(key, {"count": 0, "bytes": 0})
                row["count"] += 1
                row["bytes"] += c.bytes
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    M.gpt_arguments(ap)
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "precision.json"))
    args = ap.parse_args(argv)
    a = {k: getattr(args, k) for k in ("vocab", "d_model", "heads", "layers", "batch", "seq",
                                       "warmup", "iters")}
    a["rows"] = [r for r in args.rows.split(",") if r]

    t0 = time.perf_counter()
    per_rank = launch(_rank_main, args.world, {**a, "phase": "time"})
    memory = launch(_rank_main, args.world, {**a, "phase": "memory"})
    wall = time.perf_counter() - t0
    threads = max(1, (os.cpu_count() or 1) // args.world)
    ms = {r: max(statistics.median(p["times"][r]) for p in per_rank) * 1e3 for r in a["rows"]}
    peak = {r: max(m["peak_bytes"][r] for m in memory) for r in a["rows"]}
    ratios = {f"{n}/{d}": ms[n] / ms[d] for n, d in RATIOS if n in ms and d in ms}
    mem_ratios = {f"{n}/{d}": peak[n] / peak[d] for n, d in MEM_RATIOS if n in peak and d in peak}
    fps, refs = per_rank[0]["fingerprint"], per_rank[0]["reference"]
    checked = {}
    for r in a["rows"]:
        kind, rtol = ("bf16", BF16_RTOL) if "bf16" in r else ("fp32", M.SAME_WORK_RTOL)
        checked[r] = {**M.same_work({r: fps[r]}, refs[kind], rtol)[r], "reference": kind, "rtol": rtol}
        if r.startswith("pjit_fsdp_bf16") and "fsdp2_bf16" in fps:
            # the same policy on the same ranks: FSDP2's state
            vs = M.same_work({r: fps[r]}, fps["fsdp2_bf16"])[r]
            checked[r]["vs_fsdp2_bf16"] = vs["max_rel_diff"]
            checked[r]["failures"] += [f"against fsdp2_bf16: {f}" for f in vs["failures"]]

    n = refs["fp32"]["step"]
    print(f"\ngpt d {a['d_model']}, {a['layers']} layers, vocab {a['vocab']}, batch {a['batch']} x "
          f"{a['seq']}: world {args.world}, {threads} thread(s)/rank, median of {args.iters} "
          f"interleaved rounds after {args.warmup} warmup; peak memory per rank: "
          f"{memory[0]['peak_method']} (benchmarks/_models.py)")
    print(f"{'row':<24}{'ms/step':>9}{'peak MiB':>10}{f'loss@{n}':>10}{'same work':>11}  reference")
    for r in a["rows"]:
        c = checked[r]
        ok = "DIFFERENT" if c["failures"] else f"{c['max_rel_diff']:.0e}"
        vs = f"; {c['vs_fsdp2_bf16']:.0e} from fsdp2_bf16" if "vs_fsdp2_bf16" in c else ""
        print(f"{r:<24}{ms[r]:>9.1f}{peak[r] / 2**20:>10.2f}{fps[r]['loss']:>10.4f}{ok:>11}  "
              f"one device {c['reference']} (rtol {c['rtol']:g}){vs}")
    print("time ratios: " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()))
    print("peak memory ratios: " + ", ".join(f"{k} {v:.2f}" for k, v in mem_ratios.items()))
    for r, c in per_rank[0]["cost"].items():
        print(f"{r}: collectives per step " + ", ".join(
            f"{k} x{v['count']} ({v['bytes'] / 2**10:.0f} KiB)" for k, v in c.items()))
    result = {"benchmark": "precision", "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "torch": torch.__version__, "git": git_rev(), "world_size": args.world,
              "threads_per_rank": threads, "cpu_count": os.cpu_count(), "config": a,
              "median_ms": ms, "peak_bytes": peak, "peak_method": memory[0]["peak_method"],
              "ratios": ratios, "peak_memory_ratios": mem_ratios,
              "aim": {"pjit_fsdp_bf16/fsdp2_bf16 time": 0.8, "pjit_fsdp_bf16/fsdp2_bf16 memory": 1.0},
              "cost_rank0": per_rank[0]["cost"],
              "same_work": {"steps": n, "references": refs, "rows": fps, "checked": checked},
              "times_ms_per_rank": {r: [[t * 1e3 for t in p["times"][r]] for p in per_rank]
                                    for r in a["rows"]},
              "wall_s": wall}
    write_result(args.out, result, f"{wall:.0f} s")
    bad = {r: c["failures"] for r, c in checked.items() if c["failures"]}
    if bad:
        raise M.DifferentWork("bench_precision: rows did different work from the single-device "
                              "run (NOTE [Every row did the same work] in benchmarks/_models.py):\n"
                              + "\n".join(f"  {r}: " + "; ".join(f) for r, f in bad.items()))


if __name__ == "__main__":
    main()
