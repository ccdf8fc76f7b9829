"""Train-step time of a GPT nn.Module under one tensor-parallel plan: pjit (the plan
through ``sharded.plans.parallelize``, one traced program per rank) vs torch's eager
TP (the same plan through ``parallelize_module``, DTensor hooks), Megatron and
sequence parallel, side by side in one run.

    python benchmarks/bench_tp_plans.py [--d-model 128 --layers 2 --batch 8 --seq 64 ...]

The model is ``examples/gpt_module.GPT`` and the plans are ``megatron_plan()`` and
``sp_plan()`` there (torch's ParallelStyle objects, as torchtitan writes them). Every
mode starts from the same weights and batch and runs forward, backward and AdamW
(lr 1e-3, weight decay 1e-2): pjit with ``sharded.optim.adamw`` inside the program,
eager TP with ``torch.optim.AdamW(fused=True)`` on the DTensor parameters (the same
fused kernel). Modes are timed
round-robin (one step of each per round, a barrier before every step) after
``--warmup`` steps; the reported time is the slowest rank's median. After the timing,
every row's state (losses, parameter and moment checksums) is checked against the
unparallelized module's run of as many steps (NOTE [Every row did the same work] in
``_models.py``); a row that differs fails the run, after the results are written.
Writes ``benchmarks/results/tp_plans.json``.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import functools
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks import _models as M  # noqa: E402
from benchmarks._models import git_rev, timed_interleaved, write_result  # noqa: E402
from examples import gpt_module as gm  # noqa: E402
from sharded import launch  # noqa: E402

MODES = {
    "pjit_megatron": "pjit, Megatron plan via sharded.plans.parallelize",
    "torch_megatron": "eager torch TP: parallelize_module(Megatron plan) + torch.optim.AdamW(fused=True)",
    "pjit_sp": "pjit, sequence-parallel plan (torchtitan's) via parallelize",
    "torch_sp": "eager torch TP: parallelize_module(SP plan) + torch.optim.AdamW(fused=True)",
    "single": "single-device eager module + torch.optim.AdamW(fused=True) (every rank, full batch)",
}
LR, WD = 1e-3, 1e-2


def _rank_main(a: dict) -> dict:
    from torch.distributed.tensor.parallel import parallelize_module

    from sharded import Mesh, P, gather, optim, shard
    from sharded.modes import DTensorExpandMode
    from sharded.plans import parallelize
    from sharded import pjit

    world = dist.get_world_size()
    cfg = gm.Config(vocab=a["vocab"], d_model=a["d_model"], n_heads=a["heads"],
                    n_layers=a["layers"], seq=a["seq"])
    base = gm.GPT(cfg, seed=0)
    g = torch.Generator().manual_seed(1)
    toks = torch.randint(0, cfg.vocab, (a["batch"], cfg.seq + 1), generator=g)
    ids, tgt = toks[:, :-1].contiguous(), toks[:, 1:].contiguous()
    mesh = Mesh((world,), ("tp",))
    out: dict = {"loss0": {}, "first_call_s": {}, "cost": {}}
    steps: dict = {}
    fingerprints: dict = {}     # mode -> its state's fingerprint, read after the timing

    def eager_step(model):
        opt = M.torch_adamw(model.parameters(), lr=LR, weight_decay=WD)
        st = {}

        def step():
            opt.zero_grad(set_to_none=True)
            loss = model(ids, tgt)
            loss.backward()
            opt.step()
            st["loss"] = loss.detach()
        step()
        return step, float(gather(st["loss"])), lambda: M.optimizer_fingerprint(st["loss"], opt)

    for mode in a["modes"]:
        plan_name = mode.split("_", 1)[-1]
        if mode == "single":
            steps[mode], out["loss0"][mode], fingerprints[mode] = eager_step(copy.deepcopy(base))
        elif mode.startswith("torch_"):
            model = parallelize_module(copy.deepcopy(base), mesh.device_mesh, gm.PLANS[plan_name]())
            steps[mode], out["loss0"][mode], fingerprints[mode] = eager_step(model)
        elif mode.startswith("pjit_"):
            model = copy.deepcopy(base)
            specs = parallelize(model, gm.PLANS[plan_name](), mesh)
            params = {k: v.detach() for k, v in model.named_parameters()}
            ospecs = {"step": P(), "m": specs, "v": specs}
            update = functools.partial(optim.adamw, lr=LR, weight_decay=WD)
            f = pjit(gm.make_train_step(model, update), in_specs=(specs, ospecs, P(), P()),
                     out_specs=(specs, ospecs, P()), mesh=mesh,
                     mode=DTensorExpandMode(compile=False))   # the graph runner
            st = {"p": shard(params, specs, mesh), "o": shard(optim.adamw_init(params), ospecs, mesh)}
            low = f.lower(st["p"], st["o"], ids, tgt)
            cost = low.cost()
            cost["local_nodes"] = len(low.local_graph.graph.nodes)
            out["cost"][mode] = cost

            def step(f=f, st=st):
                st["p"], st["o"], st["loss"] = f(st["p"], st["o"], ids, tgt)
            dist.barrier()
            t0 = time.perf_counter()
            step()
            out["first_call_s"][mode] = time.perf_counter() - t0
            steps[mode], out["loss0"][mode] = step, float(gather(st["loss"]))
            fingerprints[mode] = lambda st=st: M.functional_fingerprint(st["loss"], st["p"], st["o"])
        else:
            raise ValueError(f"unknown mode {mode!r}; choose from {list(MODES)}")
    out["times"] = timed_interleaved(steps, a["warmup"], a["iters"])
    # NOTE [Every row did the same work] in benchmarks/_models.py: every row ran its
    # set-up step, the warm-up and the timed rounds; so does the reference (the
    # unparallelized module, torch's fused AdamW)
    out["fingerprint"] = {mode: fp() for mode, fp in fingerprints.items()}
    model = copy.deepcopy(base)
    opt = M.torch_adamw(model.parameters(), lr=LR, weight_decay=WD)
    for _ in range(1 + a["warmup"] + a["iters"]):
        opt.zero_grad(set_to_none=True)
        loss = model(ids, tgt)
        loss.backward()
        opt.step()
    out["reference"] = M.optimizer_fingerprint(loss.detach(), opt)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    M.gpt_arguments(ap)          # --world: the tensor-parallel ranks
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ",".join(MODES))
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "tp_plans.json"))
    args = ap.parse_args(argv)
    a = {k: getattr(args, k) for k in ("vocab", "d_model", "heads", "layers", "batch", "seq",
                                       "warmup", "iters")}
    a["modes"] = [m for m in args.modes.split(",") if m]
    if args.seq % args.world or args.heads % args.world:
        ap.error("--seq and --heads must be divisible by --world")

    t0 = time.perf_counter()
    per_rank = launch(_rank_main, args.world, a)
    wall = time.perf_counter() - t0

    ms = {m: max(statistics.median(r["times"][m]) for r in per_rank) * 1e3 for m in a["modes"]}
    spread = {m: (min(min(r["times"][m]) for r in per_rank) * 1e3,
                  max(max(r["times"][m]) for r in per_rank) * 1e3) for m in a["modes"]}
    print(f"GPT module d={args.d_model} L={args.layers} H={args.heads} V={args.vocab} "
          f"batch={args.batch} seq={args.seq}; tp={args.world}, "
          f"{max(1, (os.cpu_count() or 1) // args.world)} thread(s)/rank; "
          f"median of {args.iters} interleaved rounds after {args.warmup} warmup")
    ref, fps = per_rank[0]["reference"], per_rank[0]["fingerprint"]
    checked = M.same_work(fps, ref)
    n = ref["step"]
    print(f"{'mode':<16}{'ms/step':>9}{'min..max':>16}{'loss@0':>9}{f'loss@{n}':>9}{'same work':>11}  what")
    for m in a["modes"]:
        lo, hi = spread[m]
        ok = "DIFFERENT" if checked[m]["failures"] else f"{checked[m]['max_rel_diff']:.0e}"
        print(f"{m:<16}{ms[m]:>9.1f}{f'{lo:.1f}..{hi:.1f}':>16}"
              f"{per_rank[0]['loss0'][m]:>9.4f}{fps[m]['loss']:>9.4f}{ok:>11}  {MODES[m]}")
    print(f"same work: each row's state after {n} steps against the single-device run's "
          f"(largest relative difference of its checksums; tolerance {M.SAME_WORK_RTOL:g})")
    ratios = {f"pjit_{p}/torch_{p}": ms[f"pjit_{p}"] / ms[f"torch_{p}"]
              for p in ("megatron", "sp") if f"pjit_{p}" in ms and f"torch_{p}" in ms}
    if "single" in ms:
        ratios.update({f"{m}/single": ms[m] / ms["single"] for m in ms if m != "single"})
    print("ratios: " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()))
    cost = per_rank[0]["cost"]
    for m, c in cost.items():
        kinds = {k: v["count"] for k, v in c.items() if isinstance(v, dict) and k != "total"}
        print(f"{m}: collectives per step (rank 0) {kinds}; {c['local_nodes']} local graph "
              f"nodes; first call {per_rank[0]['first_call_s'][m]:.2f} s")
    result = {
        "benchmark": "tp_plans",
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "git": git_rev(),
        "world_size": args.world,
        "threads_per_rank": max(1, (os.cpu_count() or 1) // args.world),
        "cpu_count": os.cpu_count(),
        "config": a,
        "median_ms": ms,
        "min_max_ms": spread,
        "ratios": ratios,
        "loss_first_step": {m: per_rank[0]["loss0"][m] for m in a["modes"]},
        "same_work": {"rtol": M.SAME_WORK_RTOL, "steps": n, "reference": ref, "rows": fps,
                      "checked": checked},
        "pjit_first_call_s": per_rank[0]["first_call_s"],
        "pjit_cost_rank0": cost,
        "modes": {m: MODES[m] for m in a["modes"]},
        "times_ms_per_rank": {m: [[t * 1e3 for t in r["times"][m]] for r in per_rank]
                              for m in a["modes"]},
        "wall_s": wall,
    }
    write_result(args.out, result, f"{wall:.0f} s")
    M.require_same_work(fps, ref, "bench_tp_plans")


if __name__ == "__main__":
    main()
