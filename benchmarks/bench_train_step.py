"""Train-step time of a small GPT (or an MLP) on local gloo ranks: pjit (DP, TP; the
graph runner and inductor) vs DDP, eager DTensor TP and single-device eager, side by
side in one run.

    python benchmarks/bench_train_step.py [--d-model 128 --layers 2 --batch 8 ...]
    python benchmarks/bench_train_step.py --model mlp      # 8 x Linear(1024), batch 64

Every rank gets ``cpu_count // world`` intra-op threads (sharded.launch's default).
Every mode is set up and run ``--warmup`` times, then the modes are timed round-robin
(one step of each per round, ``--iters`` rounds, a barrier before every step) so that
load from outside hits all modes alike; the reported time is the median step time,
the slowest rank's median. After the timing, every row's state (losses, parameter and
moment checksums) is checked against a single-device run of as many steps (NOTE [Every
row did the same work] in ``_models.py``); a row that differs fails the run, after the
results are written. The module rows (``single_module``, ``ddp``) use
``torch.optim.AdamW(fused=True)``, the kernel of ``sharded.optim.adamw``. Writes
``benchmarks/results/train_step.json``.
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

from examples import gpt  # noqa: E402
from benchmarks import _models as M  # noqa: E402
from benchmarks._models import (SAME_WORK_RTOL, git_rev, require_same_work, same_work,  # noqa: E402
                                timed_interleaved, write_result)
from sharded import launch  # noqa: E402


MODES = {
    "single": "single-device eager (functional, sharded.optim.adamw), full batch",
    "single_module": "single-device eager nn.Module + torch.optim.AdamW(fused=True), full batch",
    "pjit_dp": "pjit data parallel: batch P('dp'), params replicated; compile=False (graph)",
    "pjit_dp_inductor": "pjit_dp with compile=True (inductor)",
    "pjit_dp_reduced": "pjit DP, grads constrained to P() before AdamW",
    "ddp": "DDP(nn.Module) + torch.optim.AdamW(fused=True), batch split",
    "pjit_tp": "pjit tensor parallel: tp_specs, batch replicated; compile=False (graph)",
    "pjit_tp_inductor": "pjit_tp with compile=True (inductor)",
    "dtensor_tp": "eager DTensor TP: same functional grads on DTensor params from shard(), torch fused AdamW",
}
DEFAULT_MODES = ["single", "single_module", "pjit_dp", "pjit_dp_inductor", "ddp", "pjit_tp",
                 "pjit_tp_inductor", "dtensor_tp"]


def mlp_tp_specs(params):
    """Megatron pairs over "tp": even layers split on the output dim, odd layers on
    the input dim (their bias replicated)."""
    from sharded import P

    return {"layers": [{"w": P("tp") if i % 2 == 0 else P(None, "tp"),
                        "b": P("tp") if i % 2 == 0 else P()}
                       for i in range(len(params["layers"]))]}


def _rank_main(a: dict) -> dict:
    import sharded.rules  # noqa: F401  (SDPA sharding rules, for eager DTensor)
    from torch.nn.parallel import DistributedDataParallel as DDP

    from benchmarks._models import GPTModule, module_loss, train_step_reduced_grads
    from sharded import Mesh, P, gather, optim, shard
    from sharded.modes import DTensorExpandMode
    from sharded import pjit

    rank, world = dist.get_rank(), dist.get_world_size()
    if a["model"] == "mlp":
        params = M.mlp_init(a["mlp_width"], a["mlp_layers"])
        g = torch.Generator().manual_seed(1)
        ids = torch.randn(a["mlp_batch"], a["mlp_width"], generator=g)
        tgt = torch.randn(a["mlp_batch"], a["mlp_width"], generator=g)
        cfg = None
        functional_step, loss_fn = M.mlp_train_step, M.mlp_loss
        make_module = lambda: M.MLPModule(params)                     # noqa: E731
        mod_loss = lambda m, x, y: torch.nn.functional.mse_loss(m(x), y)   # noqa: E731
        tp_specs, dp_specs = mlp_tp_specs, gpt.dp_specs
    else:
        cfg = gpt.GPTConfig(vocab=a["vocab"], d_model=a["d_model"], n_heads=a["heads"],
                            n_layers=a["layers"], seq=a["seq"], sdpa=not a["matmul_attn"])
        params = gpt.init_params(cfg, 0)
        ids, tgt = gpt.batch(cfg, a["batch"], seed=1)
        functional_step, loss_fn = gpt.train_step, gpt.loss_fn
        make_module = lambda: GPTModule(params, cfg)                   # noqa: E731
        mod_loss = module_loss
        tp_specs, dp_specs = gpt.tp_specs, gpt.dp_specs
    extra = () if cfg is None else (cfg,)
    lb = ids.shape[0] // world
    my_ids, my_tgt = ids[rank * lb:(rank + 1) * lb], tgt[rank * lb:(rank + 1) * lb]
    out: dict = {"times": {}, "loss0": {}, "first_call_s": {}, "cost": {}}
    steps: dict = {}
    fingerprints: dict = {}     # mode -> its state's fingerprint, read after the timing

    def record(mode, step, first_loss, fingerprint):
        out["loss0"][mode] = first_loss
        steps[mode] = step
        fingerprints[mode] = fingerprint

    def setup(mode):  # one scope per mode: the step closures must not share names
        torch.manual_seed(0)
        if mode == "single":
            st = {"p": params, "o": optim.adamw_init(params)}

            def step():
                st["p"], st["o"], st["loss"] = functional_step(st["p"], st["o"], ids, tgt, *extra)
            step()
            record(mode, step, float(st["loss"]),
                   lambda: M.functional_fingerprint(st["loss"], st["p"], st["o"]))

        elif mode in ("single_module", "ddp"):
            model = make_module()
            x, y = (ids, tgt) if mode == "single_module" else (my_ids, my_tgt)
            if mode == "ddp":
                model = DDP(model)
            opt = M.torch_adamw(model.parameters(), lr=1e-3, weight_decay=1e-2)
            st = {}

            def global_loss():
                loss = st["loss"].clone()
                if mode == "ddp":
                    dist.all_reduce(loss, op=dist.ReduceOp.AVG)
                return loss

            def step():
                opt.zero_grad(set_to_none=True)
                loss = mod_loss(model, x, y)
                loss.backward()
                opt.step()
                st["loss"] = loss.detach()
            step()
            record(mode, step, float(global_loss()), lambda: M.optimizer_fingerprint(global_loss(), opt))

        elif mode in ("pjit_dp", "pjit_dp_inductor", "pjit_dp_reduced", "pjit_tp", "pjit_tp_inductor"):
            if mode.startswith("pjit_tp"):
                mesh = Mesh((world,), ("tp",))
                ps, bs = tp_specs(params), P()
            else:
                mesh = Mesh((world,), ("dp",))
                ps, bs = dp_specs(params), P("dp")
            os_ = gpt.opt_specs(ps)
            fn = train_step_reduced_grads if mode == "pjit_dp_reduced" else functional_step
            fn_ = lambda *args: fn(*args)        # noqa: E731  (a program of its own per mode)
            f = pjit(fn_, in_specs=(ps, os_, bs, bs), out_specs=(ps, os_, P()), mesh=mesh,
                     static_argnums=(4,) if extra else (),
                     mode=DTensorExpandMode(compile=mode.endswith("_inductor")))
            st = {"p": shard(params, ps, mesh), "o": shard(optim.adamw_init(params), os_, mesh)}
            d_ids, d_tgt = shard((ids, tgt), bs, mesh)
            low = f.lower(st["p"], st["o"], d_ids, d_tgt, *extra)
            out["cost"][mode] = low.cost()
            out["cost"][mode]["local_nodes"] = len(low.local_graph.graph.nodes)

            def step():
                st["p"], st["o"], st["loss"] = f(st["p"], st["o"], d_ids, d_tgt, *extra)
            dist.barrier()
            t0 = time.perf_counter()
            step()  # first call: compile (traced by .lower above) + agree + run
            out["first_call_s"][mode] = time.perf_counter() - t0
            record(mode, step, float(gather(st["loss"])),
                   lambda: M.functional_fingerprint(st["loss"], st["p"], st["o"]))

        elif mode == "dtensor_tp":
            mesh = Mesh((world,), ("tp",))
            # a copy: shard() slices plain tensors without copying them, and the
            # optimizer updates its parameters in place
            st = {"p": shard(optree.tree_map(torch.clone, params), tp_specs(params), mesh)}
            d_ids, d_tgt = shard((ids, tgt), P(), mesh)
            # the functional step's gradients, then torch's fused AdamW in place (the
            # kernel of the pjit rows: sharded.optim.adamw on eager DTensors would
            # fall back to foreach ops, NOTE [Fused optimizer kernels])
            leaves = optree.tree_leaves(st["p"])
            opt = M.torch_adamw(leaves, lr=1e-3, weight_decay=1e-2)

            def step():
                grads, st["loss"] = torch.func.grad_and_value(loss_fn)(st["p"], d_ids, d_tgt, *extra)
                for t, g_ in zip(leaves, optree.tree_leaves(grads)):
                    t.grad = g_
                opt.step()
            step()
            record(mode, step, float(gather(st["loss"])), lambda: M.optimizer_fingerprint(st["loss"], opt))
        else:
            raise ValueError(f"unknown mode {mode!r}; choose from {list(MODES)}")

    for mode in a["modes"]:
        setup(mode)
    out["times"] = timed_interleaved(steps, a["warmup"], a["iters"])
    # NOTE [Every row did the same work] in benchmarks/_models.py: every row ran its
    # set-up step, the warm-up and the timed rounds; so does the reference
    out["fingerprint"] = {mode: fp() for mode, fp in fingerprints.items()}
    p, o = params, optim.adamw_init(params)
    for _ in range(1 + a["warmup"] + a["iters"]):
        p, o, loss = functional_step(p, o, ids, tgt, *extra)
    out["reference"] = M.functional_fingerprint(loss, p, o)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=("gpt", "mlp"), default="gpt")
    M.mlp_arguments(ap)
    M.gpt_arguments(ap)          # --batch: the global batch
    ap.add_argument("--matmul-attn", action="store_true", help="matmul+softmax, not SDPA")
    ap.add_argument("--modes", default=",".join(DEFAULT_MODES),
                    help="comma-separated subset of " + ",".join(MODES))
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "train_step.json"))
    args = ap.parse_args(argv)
    a = {k: getattr(args, k) for k in ("model", "mlp_width", "mlp_layers", "mlp_batch", "vocab",
                                       "d_model", "heads", "layers", "batch", "seq",
                                       "matmul_attn", "warmup", "iters")}
    a["modes"] = [m for m in args.modes.split(",") if m]
    if (args.mlp_batch if args.model == "mlp" else args.batch) % args.world:
        ap.error("the batch must be divisible by --world")

    t0 = time.perf_counter()
    per_rank = launch(_rank_main, args.world, a)
    wall = time.perf_counter() - t0

    ms = {m: max(statistics.median(r["times"][m]) for r in per_rank) * 1e3 for m in a["modes"]}
    spread = {m: (min(min(r["times"][m]) for r in per_rank) * 1e3,
                  max(max(r["times"][m]) for r in per_rank) * 1e3) for m in a["modes"]}
    base = ms.get("single")
    what = (f"MLP {args.mlp_layers}x{args.mlp_width} batch={args.mlp_batch}" if args.model == "mlp"
            else f"GPT d={args.d_model} L={args.layers} H={args.heads} V={args.vocab} "
                 f"batch={args.batch} seq={args.seq} sdpa={not args.matmul_attn}")
    print(f"{what}; world {args.world}, "
          f"{max(1, (os.cpu_count() or 1) // args.world)} thread(s)/rank; "
          f"median of {args.iters} interleaved rounds after {args.warmup} warmup")
    ref = per_rank[0]["reference"]
    checked = same_work(per_rank[0]["fingerprint"], ref)
    n = ref["step"]
    print(f"{'mode':<17}{'ms/step':>9}{'min..max':>16}{'vs single':>11}{'loss@0':>9}"
          f"{f'loss@{n}':>9}{'same work':>11}  what")
    for m in a["modes"]:
        rel = f"{ms[m] / base:.2f}x" if base else "-"
        lo, hi = spread[m]
        ok = "DIFFERENT" if checked[m]["failures"] else f"{checked[m]['max_rel_diff']:.0e}"
        print(f"{m:<17}{ms[m]:>9.1f}{f'{lo:.1f}..{hi:.1f}':>16}{rel:>11}"
              f"{per_rank[0]['loss0'][m]:>9.4f}{per_rank[0]['fingerprint'][m]['loss']:>9.4f}{ok:>11}"
              f"  {MODES[m]}")
    print(f"same work: each row's state after {n} steps against the single-device run's "
          f"(largest relative difference of its checksums; tolerance {SAME_WORK_RTOL:g})")
    ratios = {}
    for num, den in (("pjit_dp", "ddp"), ("pjit_dp_inductor", "ddp"), ("pjit_dp_reduced", "ddp"),
                     ("pjit_tp", "dtensor_tp"), ("pjit_tp_inductor", "dtensor_tp"),
                     ("ddp", "single_module")):
        if num in ms and den in ms:
            ratios[f"{num}/{den}"] = ms[num] / ms[den]
    for m in ms:
        if base and m != "single":
            ratios[f"{m}/single"] = ms[m] / base
    print("ratios: " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()))
    cost = per_rank[0]["cost"]
    for m, c in cost.items():
        kinds = {k: v["count"] for k, v in c.items() if isinstance(v, dict) and k != "total"}
        print(f"{m}: collectives per step (rank 0) {kinds}, {c['total']['bytes']} bytes; "
              f"{c['local_nodes']} local graph nodes; first call "
              f"{per_rank[0]['first_call_s'][m]:.2f} s")
    if args.model == "mlp":
        from benchmarks._models import mlp_init
        leaves = optree.tree_leaves(mlp_init(args.mlp_width, args.mlp_layers))
    else:
        cfg = gpt.GPTConfig(vocab=args.vocab, d_model=args.d_model, n_heads=args.heads,
                            n_layers=args.layers, seq=args.seq)
        leaves = optree.tree_leaves(gpt.init_params(cfg, 0))
    n_tensors, n_elems = len(leaves), sum(t.numel() for t in leaves)
    print(f"model: {n_tensors} parameter tensors, {n_elems / 1e6:.2f} M parameters")
    result = {
        "benchmark": "train_step",
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "git": git_rev(),
        "world_size": args.world,
        "threads_per_rank": max(1, (os.cpu_count() or 1) // args.world),
        "cpu_count": os.cpu_count(),
        "config": a,
        "param_tensors": n_tensors,
        "param_count": n_elems,
        "median_ms": ms,
        "min_max_ms": spread,
        "ratios": ratios,
        "loss_first_step": {m: per_rank[0]["loss0"][m] for m in a["modes"]},
        "same_work": {"rtol": SAME_WORK_RTOL, "steps": n, "reference": ref,
                      "rows": per_rank[0]["fingerprint"], "checked": checked},
        "pjit_first_call_s": per_rank[0]["first_call_s"],
        "pjit_cost_rank0": cost,
        "modes": {m: MODES[m] for m in a["modes"]},
        "times_ms_per_rank": {m: [[t * 1e3 for t in r["times"][m]] for r in per_rank]
                              for m in a["modes"]},
        "wall_s": wall,
    }
    write_result(args.out, result, f"{wall:.0f} s")
    require_same_work(per_rank[0]["fingerprint"], ref, "bench_train_step")


if __name__ == "__main__":
    main()
