"""DataParallelMode against DDP and FSDP2: step time, peak memory and compile time of
a train step on local gloo ranks, side by side in one run.

    python benchmarks/bench_data_parallel.py                  # gpt-tiny and MLP, 2 ranks
    python benchmarks/bench_data_parallel.py --models mlp --iters 30

Modes (every one: forward, backward, AdamW; SGD with ``--optimizer per-tensor-sgd``):

  single     the functional step on the full batch, one process per rank (reference)
  ddp        DistributedDataParallel(nn.Module) + torch.optim.AdamW(fused=True), batch split
  pjit_ddp   pjit(step, mode=DataParallelMode("replicate")), batch P("dp")
  fsdp2      fully_shard on every block (GPT) / layer (MLP) and the root +
             torch.optim.AdamW(fused=True)
  pjit_fsdp  pjit(step, mode=DataParallelMode("shard")), batch P("dp")
  pjit_loop  the module-style loop: pjit(loss, mode=DataParallelMode("replicate")) on
             DTensor params that require grad, loss.backward(), torch.optim.AdamW(fused=True)
             (pjit's forward and backward programs, torch's optimizer), against ddp
  pjit_ddp_donated, pjit_fsdp_donated
             pjit_ddp / pjit_fsdp with donate_argnums=(0, 1): parameters and moments
             updated in the donated storage (peak memory against the undonated rows)
  pjit_ddp_inductor, pjit_fsdp_inductor
             pjit_ddp / pjit_fsdp with compile=True (inductor; the other pjit rows run
             the graph, compile=False); time only (their compile would dominate the
             peak-memory window)

``--optimizer per-tensor`` runs every row with AdamW as users write one over a
``named_parameters()``-style dict (dotted keys): the pjit rows and the reference step
a pure per-parameter update (``_models.per_tensor_adamw``: elementwise ops on each parameter
in turn), the torch rows ``torch.optim.AdamW(foreach=False)`` (the same math, one
parameter at a time); it writes ``benchmarks/results/data_parallel_per_tensor.json``.
``--optimizer per-tensor-sgd`` runs SGD the same way: ``p - lr * g`` for each parameter
(``_models.per_tensor_sgd``, as a JAX user writes it with ``tree_map``) against
``torch.optim.SGD(foreach=False)``; it writes
``benchmarks/results/data_parallel_per_tensor_sgd.json``.
The default, ``fused``, steps ``sharded.optim.adamw`` and ``torch.optim.AdamW(fused=True)``
(one kernel).

Every rank gets ``cpu_count // world`` intra-op threads (one each on the 2-core
machine). The modes are warmed up, then timed round-robin (one step of each per
round, a barrier before every step): the reported time is the slowest rank's median.
Peak memory is measured in processes of their own, after the timing: the peak of a
rank's resident memory (every thread's allocations, gloo's included) from building
the mode (its own copy of the parameters, module, optimizer, sharding: every row builds
all of its state inside the window) through three steps, with glibc set up so that
resident memory follows allocations (``_models.peak_resident_bytes``; the profiler's
count of the calling thread's allocations, ``peak_allocated_bytes``, where that is not
available), after a warm-up build of every mode outside the window (pjit's programs
are then cached: the compile is not counted); the least of three rounds of every mode
is reported. Compile time is ``pjit(...).lower(...)`` (trace,
partition, passes) for each DataParallelMode layout and for DTensorExpandMode with
replicated parameter specs (what data parallelism was before). After the timing,
every row's state (losses, parameter and moment checksums) is checked against a
single-device run of as many steps (NOTE [Every row did the same work] in
``_models.py``); a row that differs fails the run, after the results are written.
Writes ``benchmarks/results/data_parallel.json``.
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

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks import _models as M  # noqa: E402
from benchmarks._models import git_rev, write_result  # noqa: E402
from examples import gpt  # noqa: E402
from sharded import launch  # noqa: E402

MODES = ("single", "ddp", "pjit_ddp", "pjit_ddp_inductor", "fsdp2", "pjit_fsdp",
         "pjit_fsdp_inductor", "pjit_loop", "pjit_ddp_donated", "pjit_fsdp_donated")
RATIOS = (("pjit_ddp", "ddp"), ("pjit_fsdp", "fsdp2"), ("pjit_ddp_inductor", "ddp"),
          ("pjit_fsdp_inductor", "fsdp2"), ("ddp", "single"), ("fsdp2", "single"),
          ("pjit_loop", "ddp"), ("pjit_ddp_donated", "pjit_ddp"), ("pjit_fsdp_donated", "pjit_fsdp"),
          ("pjit_ddp_donated", "ddp"), ("pjit_fsdp_donated", "fsdp2"))
# (DDP and FSDP2 update their state in place: the donated rows are the like-for-like
# memory comparison; undonated, a step holds the old and the new state at once)
MEM_RATIOS = (("pjit_ddp", "ddp"), ("pjit_fsdp", "fsdp2"), ("pjit_loop", "ddp"),
              ("pjit_ddp_donated", "pjit_ddp"), ("pjit_fsdp_donated", "pjit_fsdp"),
              ("pjit_ddp_donated", "ddp"), ("pjit_fsdp_donated", "fsdp2"))


def flat_dict(tree):
    """``tree``'s leaves as a dict of dotted keys, as ``named_parameters()`` gives
    (``blocks.0.attn.wq``), and the function that rebuilds the tree from such a dict."""
    import optree

    paths, leaves, treedef = optree.tree_flatten_with_path(tree)
    keys = [".".join(str(k) for k in path) for path in paths]
    return dict(zip(keys, leaves)), lambda d: optree.tree_unflatten(treedef, [d[k] for k in keys])


def _per_tensor(spec: dict, optimizer: str) -> dict:
    """``spec`` with its functional rows on a flat dict of dotted keys, stepped by
    ``per_tensor_adamw`` (``optimizer`` "per-tensor") or ``per_tensor_sgd``
    ("per-tensor-sgd"), and its torch rows by ``torch.optim.AdamW(foreach=False)`` or
    ``torch.optim.SGD(foreach=False)``, the same math."""
    params, unflat = flat_dict(spec["params"])
    loss_fn = spec["loss_fn"]
    update = M.per_tensor_sgd if optimizer == "per-tensor-sgd" else M.per_tensor_adamw

    def flat_loss(p, x, y):
        return loss_fn(unflat(p), x, y)

    def step(p, o, x, y):
        grads, loss = torch.func.grad_and_value(flat_loss)(p, x, y)
        p, o = update(p, grads, o)
        return p, o, loss

    def torch_opt(ps):
        if optimizer == "per-tensor-sgd":
            return M.SGDSteps(list(ps), lr=1e-2, foreach=False)
        return torch.optim.AdamW(list(ps), lr=1e-3, weight_decay=1e-2, foreach=False, fused=False)
    return {**spec, "params": params, "step": step, "loss_fn": flat_loss, "torch_opt": torch_opt}


def _model(a: dict, name: str):
    """(functional params, step fn, loss of a module, module factory, batch, static args,
    FSDP units of a module, the torch rows' optimizer)."""
    spec = _model_fused(a, name)
    return spec if a.get("optimizer", "fused") == "fused" else _per_tensor(spec, a["optimizer"])


def _model_fused(a: dict, name: str):
    if name == "gpt":
        cfg = gpt.GPTConfig(vocab=a["vocab"], d_model=a["d_model"], n_heads=a["heads"],
                            n_layers=a["layers"], seq=a["seq"], sdpa=True)
        params = gpt.init_params(cfg, 0)
        ids, tgt = gpt.batch(cfg, a["batch"], seed=1)
        return dict(params=params, step=lambda p, o, x, y: gpt.train_step(p, o, x, y, cfg),
                    loss_fn=lambda p, x, y: gpt.loss_fn(p, x, y, cfg),
                    module=lambda: M.GPTBlocks(params, cfg), loss=M.module_loss, batch=(ids, tgt),
                    units=lambda m: list(m.blocks), torch_opt=_torch_adamw)
    width, layers = a["mlp_width"], a["mlp_layers"]
    params = M.mlp_init(width, layers)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(a["mlp_batch"], width, generator=g), torch.randn(a["mlp_batch"], width, generator=g)
    return dict(params=params, step=M.mlp_train_step, loss_fn=M.mlp_loss,
                module=lambda: M.MLPModule(params),
                loss=lambda m, x, y: torch.nn.functional.mse_loss(m(x), y), batch=(x, y),
                units=lambda m: list(m.layers), torch_opt=_torch_adamw)


def _torch_adamw(params):
    return M.torch_adamw(params, lr=1e-3, weight_decay=1e-2)


def optree_clone(tree):
    """A copy of every tensor of ``tree`` (traced: new shards of their own)."""
    import optree

    return optree.tree_map(torch.clone, tree)


def _build(mode: str, spec: dict, world: int, rank: int):
    """Everything a mode needs (built inside the memory window); returns step()."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    from sharded import Mesh, P, optim
    from sharded.modes import DataParallelMode
    from sharded import pjit

    x, y = spec["batch"]
    local = tuple(t.chunk(world)[rank] for t in (x, y))
    st: dict = {}
    if mode == "single":
        st["p"] = optree_clone(spec["params"])        # built inside the window, as every row's
        st["o"] = optim.adamw_init(st["p"])

        def step():
            st["p"], st["o"], st["loss"] = spec["step"](st["p"], st["o"], x, y)
        st["fingerprint"] = lambda: M.functional_fingerprint(st["loss"], st["p"], st["o"])
    elif mode in ("ddp", "fsdp2"):
        model = spec["module"]()
        if mode == "ddp":
            model = DDP(model)
        else:
            mesh = Mesh((world,), ("dp",)).device_mesh
            for unit in spec["units"](model):
                fully_shard(unit, mesh=mesh)
            fully_shard(model, mesh=mesh)
        opt = spec["torch_opt"](model.parameters())

        def step():
            opt.zero_grad(set_to_none=True)
            loss = spec["loss"](model, *local)
            loss.backward()
            opt.step()
            st["loss"] = loss.detach()

        def fingerprint():
            loss = st["loss"].clone()          # this rank's batch: the mean of the ranks' means
            dist.all_reduce(loss, op=dist.ReduceOp.AVG)
            return M.optimizer_fingerprint(loss, opt)
        st["fingerprint"] = fingerprint
    elif mode == "pjit_loop":
        import optree

        from sharded import shard

        mesh = Mesh((world,), ("dp",))
        loss_fn = pjit(spec["loss_fn"], in_specs=(P(), P("dp"), P("dp")), out_specs=P(),
                       mesh=mesh, mode=DataParallelMode("replicate", compile=False))
        params = optree.tree_map(lambda t: t.requires_grad_(),
                                 shard(optree.tree_map(torch.clone, spec["params"]), P(), mesh))
        opt = spec["torch_opt"](optree.tree_leaves(params))

        def step():
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(params, x, y)
            loss.backward()
            opt.step()
            st["loss"] = loss.detach()
        st["lower"] = lambda: loss_fn.lower(params, x, y)
        st["fingerprint"] = lambda: M.optimizer_fingerprint(st["loss"], opt)
    else:
        mesh = Mesh((world,), ("dp",))
        layout = "replicate" if mode.startswith("pjit_ddp") else "shard"
        donate = (0, 1) if mode.endswith("_donated") else ()
        mode = DataParallelMode(layout, compile=mode.endswith("_inductor"),   # (not "auto")
                                **({"bucket_bytes": spec["bucket_bytes"]} if spec["bucket_bytes"] else {}))
        f = pjit(spec["step"], in_specs=(P(), P(), P("dp"), P("dp")), mesh=mesh, mode=mode,
                 donate_argnums=donate)
        init = pjit(optim.adamw_init, in_specs=P(), mesh=mesh, mode=mode)   # born sharded
        # the params are built inside the window, as every row's (donated: shards of
        # their own, so the caller's stay readable)
        st["p"] = pjit(optree_clone, in_specs=P(), mesh=mesh, mode=mode)(
            spec["params"]) if donate else optree_clone(spec["params"])
        st["o"] = init(spec["params"])

        def step():
            st["p"], st["o"], st["loss"] = f(st["p"], st["o"], x, y)
        st["lower"] = lambda: f.lower(st["p"], st["o"], x, y)
        st["fingerprint"] = lambda: M.functional_fingerprint(st["loss"], st["p"], st["o"])
    step()
    return step, st


def _compile_times(spec: dict, world: int) -> dict:
    from sharded import Mesh, P, optim
    from sharded.modes import DataParallelMode, DTensorExpandMode
    from sharded import pjit

    mesh = Mesh((world,), ("dp",))
    x, y = spec["batch"]
    opt = optim.adamw_init(spec["params"])
    out = {}
    for name, mode in (("DataParallelMode('replicate')", DataParallelMode("replicate")),
                       ("DataParallelMode('shard')", DataParallelMode("shard")),
                       ("DTensorExpandMode, params P()", DTensorExpandMode())):
        step = spec["step"]
        # a fresh function: pjit's cache is keyed on the function, and this measures
        # a compile, not a cache hit
        f = pjit(lambda *args: step(*args), in_specs=(P(), P(), P("dp"), P("dp")), mesh=mesh, mode=mode)
        dist.barrier()
        t0 = time.perf_counter()
        low = f.lower(spec["params"], opt, x, y)
        out[name] = {"s": time.perf_counter() - t0,
                     "collectives": {k: v["count"] for k, v in low.cost().items() if k != "total"}}
    return out


def _rank_main(a: dict) -> dict:
    """One phase on every rank: "memory" (a process of its own: glibc is set up to make
    resident memory follow allocations, which slows them) or "time"."""
    import sharded.rules  # noqa: F401  (SDPA sharding rules)

    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict = {}
    for name in a["models"]:
        spec = _model(a, name)
        spec["bucket_bytes"] = int(a["bucket_mib"] * 2**20) if a["bucket_mib"] else None
        out[name] = _memory(a, spec, world, rank) if a["phase"] == "memory" else _time(a, spec, world, rank)
    return out


def _memory(a: dict, spec: dict, world: int, rank: int) -> dict:
    # each mode built and run alone, from nothing, inside the window (the inductor
    # rows are timed only, as before)
    modes = [m for m in a["modes"] if not m.endswith("_inductor")]
    method, peaks = M.least_window_peaks(modes, lambda mode: _build(mode, spec, world, rank))
    return {"peak_method": method, "peak_bytes": peaks}


def _time(a: dict, spec: dict, world: int, rank: int) -> dict:
    res: dict = {"times": {}, "loss0": {}}
    from sharded import optim
    # all modes built, then timed round-robin
    steps, states = {}, {}
    for mode in a["modes"]:
        steps[mode], states[mode] = _build(mode, spec, world, rank)
    for mode in a["modes"]:
        loss = states[mode]["loss"]
        loss = loss.full_tensor() if hasattr(loss, "full_tensor") else loss.clone()
        if mode in ("ddp", "fsdp2"):
            dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        res["loss0"][mode] = float(loss)
    res["times"] = M.timed_interleaved(steps, a["warmup"], a["iters"])
    # NOTE [Every row did the same work] in benchmarks/_models.py: every row ran its
    # first step in _build, the warm-up and the timed rounds; so does the reference
    res["fingerprint"] = {m: states[m]["fingerprint"]() for m in a["modes"]}
    p, o = spec["params"], optim.adamw_init(spec["params"])
    for _ in range(1 + a["warmup"] + a["iters"]):
        p, o, loss = spec["step"](p, o, *spec["batch"])
    res["reference"] = M.functional_fingerprint(loss, p, o)
    res["check_s"] = _value_check_time(spec, a["iters"])
    res["cost"] = {m: {k: v["count"] for k, v in states[m]["lower"]().cost().items()
                       if k != "total"}
                   for m in a["modes"] if "lower" in states[m]}
    res["compile"] = _compile_times(spec, world) if a["compile"] else {}
    return res


def _value_check_time(spec: dict, iters: int) -> list[float]:
    """What the check that plain inputs are equal on every rank costs the pjit rows per
    step (NOTE [Per-rank data] in sharded/data.py): the digests of the step's plain
    inputs, the batch, timed alone (the all-reduce that carries them runs anyway)."""
    from sharded.data import value_digests

    x, y = spec["batch"]
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        value_digests([x, y])
        times.append(time.perf_counter() - t0)
    return times


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="gpt,mlp")
    M.gpt_arguments(ap)
    M.mlp_arguments(ap)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--bucket-mib", type=float, default=None,
                    help="bucket_bytes of the pjit rows in MiB (default: DataParallelMode's)")
    ap.add_argument("--optimizer", choices=("fused", "per-tensor", "per-tensor-sgd"), default="fused",
                    help="the rows' AdamW (see the module docstring)")
    ap.add_argument("--no-compile", dest="compile", action="store_false",
                    help="skip the compile-time comparison")
    ap.add_argument("--out", default=None, help="default: benchmarks/results/data_parallel.json "
                    "(data_parallel_per_tensor.json with --optimizer per-tensor, "
                    "data_parallel_per_tensor_sgd.json with per-tensor-sgd)")
    args = ap.parse_args(argv)
    if args.out is None:
        name = {"per-tensor": "data_parallel_per_tensor.json",
                "per-tensor-sgd": "data_parallel_per_tensor_sgd.json"}.get(args.optimizer,
                                                                           "data_parallel.json")
        args.out = os.path.join(ROOT, "benchmarks", "results", name)
    a = {k: getattr(args, k) for k in ("vocab", "d_model", "heads", "layers", "batch", "seq",
                                       "mlp_width", "mlp_layers", "mlp_batch", "warmup", "iters",
                                       "compile", "bucket_mib", "optimizer")}
    a["models"] = [m for m in args.models.split(",") if m]
    a["modes"] = [m for m in args.modes.split(",") if m]

    t0 = time.perf_counter()
    per_rank = launch(_rank_main, args.world, {**a, "phase": "time"})
    memory = launch(_rank_main, args.world, {**a, "phase": "memory"})
    for r, m in zip(per_rank, memory):
        for name in a["models"]:
            r[name].update(m[name])
    wall = time.perf_counter() - t0
    threads = max(1, (os.cpu_count() or 1) // args.world)
    result = {"benchmark": "data_parallel", "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "torch": torch.__version__, "git": git_rev(), "world_size": args.world,
              "threads_per_rank": threads, "cpu_count": os.cpu_count(), "config": a, "models": {}}
    for name in a["models"]:
        ms = {m: max(statistics.median(r[name]["times"][m]) for r in per_rank) * 1e3 for m in a["modes"]}
        peak = {m: max(r[name]["peak_bytes"][m] for r in per_rank) for m in a["modes"]
                if m in per_rank[0][name]["peak_bytes"]}
        ratios = {f"{n}/{d}": ms[n] / ms[d] for n, d in RATIOS if n in ms and d in ms}
        mem_ratios = {f"{n}/{d}": peak[n] / peak[d] for n, d in MEM_RATIOS
                      if n in peak and d in peak and peak[d]}
        print(f"\n{name}: world {args.world}, {threads} thread(s)/rank, median of {args.iters} "
              f"interleaved rounds after {args.warmup} warmup")
        print(f"peak memory per rank: {per_rank[0][name]['peak_method']} (benchmarks/_models.py)")
        ref, fps = per_rank[0][name]["reference"], per_rank[0][name]["fingerprint"]
        checked = M.same_work(fps, ref)
        n = ref["step"]
        print(f"{'mode':<18}{'ms/step':>9}{'peak MiB':>10}{'loss@0':>10}{f'loss@{n}':>10}{'same work':>11}")
        for m in a["modes"]:
            mib = f"{peak[m] / 2**20:.2f}" if m in peak else "-"
            ok = "DIFFERENT" if checked[m]["failures"] else f"{checked[m]['max_rel_diff']:.0e}"
            print(f"{m:<18}{ms[m]:>9.1f}{mib:>10}{per_rank[0][name]['loss0'][m]:>10.4f}"
                  f"{fps[m]['loss']:>10.4f}{ok:>11}")
        print(f"same work: each row's state after {n} steps against the single-device run's "
              f"(largest relative difference of its checksums; tolerance {M.SAME_WORK_RTOL:g})")
        print("time ratios: " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()))
        check_ms = max(statistics.median(r[name]["check_s"]) for r in per_rank) * 1e3
        check_pct = {m: 100 * check_ms / ms[m] for m in a["modes"] if m.startswith("pjit_")}
        print(f"plain-input value check: {check_ms * 1e3:.1f} us per step ("
              + ", ".join(f"{v:.2f}% of {m}" for m, v in check_pct.items()) + ")")
        print("peak memory ratios: " + ", ".join(f"{k} {v:.2f}" for k, v in mem_ratios.items()))
        for m, c in per_rank[0][name]["cost"].items():
            print(f"{m}: collectives per step {c}")
        for k, v in per_rank[0][name]["compile"].items():
            print(f"compile {k}: {v['s']:.2f} s, {v['collectives']}")
        result["models"][name] = {
            "median_ms": ms, "peak_bytes": peak, "peak_method": per_rank[0][name]["peak_method"],
            "ratios": ratios, "peak_memory_ratios": mem_ratios,
            "loss_first_step": per_rank[0][name]["loss0"], "cost_rank0": per_rank[0][name]["cost"],
            "same_work": {"rtol": M.SAME_WORK_RTOL, "steps": n, "reference": ref, "rows": fps,
                          "checked": checked},
            "compile_rank0": per_rank[0][name]["compile"],
            "value_check_ms": check_ms, "value_check_pct_of_step": check_pct,
            "times_ms_per_rank": {m: [[t * 1e3 for t in r[name]["times"][m]] for r in per_rank]
                                  for m in a["modes"]},
        }
    result["wall_s"] = wall
    write_result(args.out, result, f"{wall:.0f} s")
    for name in a["models"]:
        M.require_same_work(per_rank[0][name]["fingerprint"], per_rank[0][name]["reference"],
                            f"bench_data_parallel, {name}")


if __name__ == "__main__":
    main()
