"""Compile time of pjit (trace + partition: the first ``.lower(...)``) for a
GPT-2-small-shaped train step (grad + AdamW) on a ("dp", "tp") mesh of local ranks,
against plain single-process ``make_fx(functionalize(step), tracing_mode="fake")``.

    python benchmarks/bench_compile.py [--layers 12 --batch 2 --seq 128 --world 4]

Parameters are ``torch.empty`` tensors (never initialised, nothing is computed):
tracing only reads shapes. Times reported:

Every timing follows a warm-up trace of a 1-layer tiny model (one-time costs).

- ``make_fx (parent)``: the plain trace in the parent process, alone on the machine.
- ``make_fx (rank)``: the same trace on every rank at once, under the same CPU
  contention as the ranks' ``.lower`` (world size > cores oversubscribes the CPU).
- ``lower``: the first ``pjit(...).lower(...)`` on every rank at once, split into
  trace (the global graph), partition (DTensor expansion) and passes (DCE/CSE and
  the collective fingerprint).

Wall and CPU (``time.process_time``) seconds are both reported: tracing is
single-threaded Python, so CPU time is the number that does not depend on how
oversubscribed the machine is. The ratio ``lower / make_fx (rank)`` compares like
with like (make_fx on the ranks is the mean of a run just before and just after). Writes
``benchmarks/results/compile.json``.

    python benchmarks/bench_compile.py --abstract     # one process, Mesh.abstract((16, 4))
    python benchmarks/bench_compile.py --inductor     # inductor's compile of gpt-tiny, cold and warm

``--abstract`` lowers the same step in this one process on ``Mesh.abstract((dp, tp),
("dp", "tp"))`` (rank 0's program; nothing communicates; by default issue 23's
configuration: a 16x4 mesh, vocab 8192, batch 64, which ``--mesh``, ``--vocab`` and
``--batch`` change), with ``DTensorExpandMode`` (Megatron ``tp_specs`` in and out,
batch over dp) and ``DataParallelMode("shard")`` (the same in_specs, state sharded
over dp too; its out_specs left to the mode, so the updated state comes out sharded
as it went in: ``--megatron-out-specs`` gives it the Megatron out_specs, which
all-gather every parameter and moment over dp at the end of the step),
against plain ``make_fx``: ``--rounds`` rounds of the three, each lower a fresh
function (no cache hit); CPU seconds, split into trace, partition and passes by the
same timers as above (CPU, with how often each ran: ``stage_calls``), and the wall
seconds ``Lowered.compile_times()`` reports for those stages. Writes
``benchmarks/results/compile_abstract.json``.

Every timed trace and lower starts with ``gc.collect()``: a lower leaves a large heap,
and a full pass of the collector over it, charged to whatever trace or stage runs
when it falls, is no part of the cost being measured.

``--inductor`` times inductor's compile of the gpt-tiny train step (d 128, 2 layers,
batch 8 x 64; ``DataParallelMode("shard", compile=True)`` on a one-rank mesh, one
process): ``Lowered.compile_times()["inductor"]`` (the compile with its first run) in
a fresh process with an empty ``TORCHINDUCTOR_CACHE_DIR`` (cold), then in two more
fresh processes on that cache (warm). Writes
``benchmarks/results/compile_inductor.json``.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import optree  # noqa: E402
import torch  # noqa: E402

from examples import gpt  # noqa: E402
from benchmarks._models import git_rev, write_result  # noqa: E402
from sharded import launch  # noqa: E402


def _cfg(a, tiny: bool = False) -> gpt.GPTConfig:
    if tiny:  # for warm-up: same ops, small shapes
        return gpt.tiny(n_layers=a["layers"], seq=a["seq"], sdpa=not a["matmul_attn"])
    return gpt.gpt2_small(n_layers=a["layers"], sdpa=not a["matmul_attn"],
                          **({"vocab": a["vocab"]} if a.get("vocab") else {}))


def _empty_like_tree(tree):
    return optree.tree_map(lambda t: torch.empty(t.shape, dtype=t.dtype), tree)


def _inputs(a, tiny: bool = False):
    """Uninitialised params / AdamW state with GPT-2-small shapes, and a batch."""
    cfg = _cfg(a, tiny)
    params = _empty_params(cfg)
    opt = {"step": torch.zeros(()), "m": _empty_like_tree(params), "v": _empty_like_tree(params)}
    ids = torch.zeros(a["batch"], a["seq"], dtype=torch.long)
    return cfg, params, opt, ids, ids.clone()


def _empty_params(cfg: gpt.GPTConfig) -> dict:
    d, h = cfg.d_model, cfg.mlp_ratio * cfg.d_model
    e = torch.empty
    return {
        "wte": e(cfg.vocab, d), "wpe": e(cfg.seq, d),
        "blocks": [{
            "ln1_w": e(d), "ln1_b": e(d),
            "attn": {"wq": e(d, d), "wk": e(d, d), "wv": e(d, d), "wo": e(d, d)},
            "ln2_w": e(d), "ln2_b": e(d),
            "mlp": {"up": e(h, d), "down": e(d, h)},
        } for _ in range(cfg.n_layers)],
        "lnf_w": e(d), "lnf_b": e(d),
    }


def plain_make_fx(a, tiny: bool = False) -> tuple[float, float, int]:
    """Wall seconds, CPU seconds and node count of make_fx(functionalize(train_step)) on fakes."""
    from torch.fx.experimental.proxy_tensor import make_fx

    cfg, params, opt, ids, tgt = _inputs(a, tiny)
    leaves, treedef = optree.tree_flatten((params, opt, ids, tgt))

    def flat(*xs):
        p, o, i, t = optree.tree_unflatten(treedef, list(xs))
        return optree.tree_leaves(gpt.train_step(p, o, i, t, cfg))

    gc.collect()    # each timed trace starts from the same collector state (module docstring)
    t0, c0 = time.perf_counter(), time.process_time()
    gm = make_fx(torch.func.functionalize(flat, remove="mutations_and_views"),
                 tracing_mode="fake")(*leaves)
    return time.perf_counter() - t0, time.process_time() - c0, len(gm.graph.nodes)


class _Timers:
    """Wraps pjit's pipeline stages with timers (benchmark-side monkeypatching only)."""

    def __init__(self, mode_cls=None):
        import sharded.lowering as pj      # the lowering pipeline (trace, partition, passes)
        from sharded.modes import DTensorExpandMode

        DTensorExpandMode = mode_cls or DTensorExpandMode  # noqa: N806 (the mode's class)

        self.t = {"trace": 0.0, "partition": 0.0, "passes": 0.0, "fingerprint": 0.0}
        self.cpu = dict(self.t)
        self.calls = {k: 0 for k in self.t}   # (partition: 2 where a backward's residuals re-partition)
        self._undo = []
        self._wrap(pj, "trace_global", "trace")
        self._wrap(pj, "fingerprint", "fingerprint")
        self._wrap(DTensorExpandMode, "partition", "partition")
        self._wrap(pj, "passes_and_finalize", "passes")

    def _wrap(self, owner, name, key):
        orig = getattr(owner, name)
        t, cpu, calls = self.t, self.cpu, self.calls

        def timed(*args, **kw):
            calls[key] += 1
            t0, c0 = time.perf_counter(), time.process_time()
            try:
                return orig(*args, **kw)
            finally:
                t[key] += time.perf_counter() - t0
                cpu[key] += time.process_time() - c0

        setattr(owner, name, timed)
        self._undo.append((owner, name, orig))

    def restore(self):
        for owner, name, orig in reversed(self._undo):
            setattr(owner, name, orig)


def _rank_main(a: dict) -> dict:
    import torch.distributed as dist

    from sharded import Mesh, P
    from sharded import pjit

    dp, tp = a["mesh"]
    mesh = Mesh((dp, tp), ("dp", "tp"))
    cfg, params, opt, ids, tgt = _inputs(a)
    ps = gpt.tp_specs(params)
    os_ = gpt.opt_specs(ps)
    bs = P("dp")
    out = {}

    # Warm up one-time costs (dispatch caches, lazy imports, DTensor's sharding-prop
    # caches for the same op set) on a 1-layer tiny model before timing anything.
    warm = {**a, "layers": 1}
    plain_make_fx(warm, tiny=True)
    tcfg, tp_, to_, ti, tt = _inputs(warm, tiny=True)
    tps = gpt.tp_specs(tp_)
    pjit(gpt.train_step, in_specs=(tps, gpt.opt_specs(tps), P("dp"), P("dp")),
         out_specs=(tps, gpt.opt_specs(tps), P()), mesh=mesh,
         static_argnums=(4,)).lower(tp_, to_, ti, tt, tcfg)

    dist.barrier()
    mk_before = plain_make_fx(a)
    out["make_fx_nodes"] = mk_before[2]

    f = pjit(gpt.train_step, in_specs=(ps, os_, bs, bs), out_specs=(ps, os_, P()),
             mesh=mesh, static_argnums=(4,))
    timers = _Timers()
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    low = f.lower(params, opt, ids, tgt, cfg)
    out["lower_s"], out["lower_cpu_s"] = time.perf_counter() - t0, time.process_time() - c0
    timers.restore()
    out["stages_s"], out["stages_cpu_s"] = dict(timers.t), dict(timers.cpu)
    dist.barrier()
    mk_after = plain_make_fx(a)
    # The machine is oversubscribed (and may be shared): the baseline is the mean of a
    # trace just before and one just after the lower.
    out["make_fx_s"] = (mk_before[0] + mk_after[0]) / 2
    out["make_fx_cpu_s"] = (mk_before[1] + mk_after[1]) / 2
    out["make_fx_runs"] = [mk_before[:2], mk_after[:2]]
    out["global_nodes"] = len(low.global_graph.graph.nodes)
    out["local_nodes"] = len(low.local_graph.graph.nodes)
    cost = low.cost()
    out["cost"] = cost
    by_axis: dict = {}
    for c in low.collectives():
        key = f"{c.kind} over {c.axis}"
        by_axis[key] = by_axis.get(key, 0) + 1
    out["collectives_by_axis"] = by_axis
    t0 = time.perf_counter()
    f.lower(params, opt, ids, tgt, cfg)
    out["cached_lower_s"] = time.perf_counter() - t0
    return out


# -- --abstract: one process, Mesh.abstract ----------------------------------------------------

def _abstract(a: dict, rounds: int) -> dict:
    from sharded import UNSPECIFIED, Mesh, P
    from sharded.modes import DataParallelMode, DTensorExpandMode
    from sharded import pjit

    dp, tp = a["mesh"]
    mesh = Mesh.abstract((dp, tp), ("dp", "tp"), rank=0)
    modes = {"DTensorExpandMode": DTensorExpandMode,
             "DataParallelMode('shard')": lambda: DataParallelMode("shard")}
    # DataParallelMode lays out the state itself: its outputs keep the layout the
    # state came in with (sharded over dp). Out specs of the Megatron layout (tp
    # only) would gather every parameter and moment over dp at the end of each step.
    mode_out_specs = {"DataParallelMode('shard')": a.get("megatron_out_specs", False)}

    def lower(mode, tiny=False, out_specs=True):
        cfg, params, opt, ids, tgt = _inputs(a if not tiny else {**a, "layers": 1}, tiny)
        ps = gpt.tp_specs(params)
        outs = (ps, gpt.opt_specs(ps), P()) if out_specs else UNSPECIFIED
        # a fresh function each time (pjit's cache is keyed on it); CPU seconds per
        # stage from the benchmark-side timers, wall seconds from compile_times()
        m = mode()
        timers = _Timers(type(m))
        f = pjit(lambda *xs: gpt.train_step(*xs), in_specs=(ps, gpt.opt_specs(ps), P("dp"), P("dp")),
                 out_specs=outs, mesh=mesh, static_argnums=(4,), mode=m)
        gc.collect()
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            low = f.lower(params, opt, ids, tgt, cfg)
        finally:
            timers.restore()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        return {"s": wall, "cpu_s": cpu, "stages_s": low.compile_times(),
                "stages_cpu_s": dict(timers.cpu), "stage_calls": dict(timers.calls),
                "global_nodes": len(low.global_graph.graph.nodes),
                "local_nodes": len(low.local_graph.graph.nodes),
                "collectives": {k: v["count"] for k, v in low.cost().items() if k != "total"}}

    plain_make_fx({**a, "layers": 1}, tiny=True)       # warm-up: one-time costs
    for name, mode in modes.items():
        lower(mode, tiny=True, out_specs=mode_out_specs.get(name, True))
    runs: dict = {"make_fx": [], **{name: [] for name in modes}}
    for _ in range(rounds):                             # interleaved: load hits all alike
        s, cpu, nodes = plain_make_fx(a)
        runs["make_fx"].append({"s": s, "cpu_s": cpu, "nodes": nodes})
        for name, mode in modes.items():
            runs[name].append(lower(mode, out_specs=mode_out_specs.get(name, True)))
    med = {k: statistics.median(r["cpu_s"] for r in v) for k, v in runs.items()}
    print(f"one process, Mesh.abstract(({dp}, {tp}), ('dp', 'tp')), rank 0; "
          f"{rounds} rounds, median CPU s (min..max):")
    for k, v in runs.items():
        cpus = [r["cpu_s"] for r in v]
        line = f"  {k:<28}{med[k]:6.2f} ({min(cpus):.2f}..{max(cpus):.2f})"
        if k != "make_fx":
            st = {s: statistics.median(r["stages_cpu_s"][s] for r in v) for s in ("trace", "partition", "passes")}
            line += (f"  {med[k] / med['make_fx']:.2f}x make_fx; stages (CPU s) "
                     + ", ".join(f"{s} {t:.2f}" for s, t in st.items())
                     + f"; local graph {v[0]['local_nodes']} nodes, collectives {v[0]['collectives']}")
        print(line)
    return {"runs": runs, "median_cpu_s": med,
            "out_specs": {k: "Megatron (tp_specs, opt_specs, P())" if mode_out_specs.get(k, True)
                          else "unspecified (the mode's)" for k in modes},
            "ratio_over_make_fx_cpu": {k: med[k] / med["make_fx"] for k in modes}}


# -- --inductor: inductor's compile of gpt-tiny, cold and warm ------------------------------------

def _inductor_child() -> None:
    """In a fresh process: lower and run the gpt-tiny step once with compile=True and
    print Lowered.compile_times() as JSON on the last line."""
    import json

    from sharded import Mesh, P, optim
    from sharded.modes import DataParallelMode
    from sharded import pjit

    torch.set_num_threads(1)
    cfg = gpt.tiny(d_model=128, n_heads=4, n_layers=2, seq=64)
    params = gpt.init_params(cfg)
    opt = optim.adamw_init(params)
    ids = torch.randint(0, cfg.vocab, (8, cfg.seq))
    f = pjit(gpt.train_step, in_specs=(P(), P(), P("dp"), P("dp")), mesh=Mesh((1,), ("dp",)),
             static_argnums=(4,), mode=DataParallelMode("shard", compile=True))
    t0 = time.perf_counter()
    f(params, opt, ids, ids, cfg)
    first = time.perf_counter() - t0
    low = f.lower(params, opt, ids, ids, cfg)
    assert low.runner() == "inductor", low.runner()
    print(json.dumps({**low.compile_times(), "first_call_s": first}))


def _inductor(warm_runs: int = 2) -> dict:
    import json
    import subprocess
    import tempfile

    cache = tempfile.mkdtemp(prefix="bench_compile_inductor_")
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "PYTHONPATH": ROOT}
    runs = []
    for i in range(1 + warm_runs):
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--inductor-child"],
                             env=env, capture_output=True, text=True, cwd=ROOT)
        if out.returncode:
            raise RuntimeError(f"inductor child failed:\n{out.stderr[-4000:]}")
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(f"  {'cold' if i == 0 else 'warm'}: inductor {runs[-1]['inductor']:.2f} s "
              f"(trace {runs[-1]['trace']:.2f}, partition {runs[-1]['partition']:.2f}, "
              f"passes {runs[-1]['passes']:.2f}; first call {runs[-1]['first_call_s']:.2f} s)")
    return {"cache_dir": "fresh tempdir per benchmark run", "cold": runs[0], "warm": runs[1:]}


def main(argv=None):
    if argv is None and sys.argv[1:] == ["--inductor-child"]:
        return _inductor_child()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--batch", type=int, default=None,
                    help="global batch (sharded over dp); default 2, --abstract 64")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=None,
                    help="default GPT-2's 50257, --abstract 8192 (issue 23's configuration)")
    ap.add_argument("--mesh", default=None, help="dp x tp, e.g. 2x2 or 1x2; default 2x2, "
                    "--abstract 16x4")
    ap.add_argument("--matmul-attn", action="store_true")
    ap.add_argument("--skip-parent", action="store_true", help="no parent make_fx timing")
    ap.add_argument("--abstract", action="store_true",
                    help="lower in this one process on Mesh.abstract (no ranks)")
    ap.add_argument("--rounds", type=int, default=3, help="--abstract: rounds of the three")
    ap.add_argument("--megatron-out-specs", action="store_true",
                    help="--abstract: DataParallelMode's outputs laid out by the Megatron "
                    "specs too (default: the mode's, state stays sharded over dp)")
    ap.add_argument("--inductor", action="store_true",
                    help="inductor's compile of the gpt-tiny step, cold and warm caches")
    ap.add_argument("--out", default=None, help="default: benchmarks/results/compile.json "
                    "(compile_abstract.json, compile_inductor.json)")
    args = ap.parse_args(argv)
    # --abstract defaults to issue 23's configuration: 16x4 mesh, vocab 8192, batch 64
    args.mesh = args.mesh or ("16x4" if args.abstract else "2x2")
    args.batch = args.batch or (64 if args.abstract else 2)
    args.vocab = args.vocab or (8192 if args.abstract else None)
    dp, tp = (int(x) for x in args.mesh.lower().split("x"))
    world = dp * tp
    a = {"layers": args.layers, "batch": args.batch, "seq": args.seq, "mesh": (dp, tp),
         "matmul_attn": args.matmul_attn, "vocab": args.vocab,
         "megatron_out_specs": args.megatron_out_specs}
    cfg = _cfg(a)
    name = "compile_abstract" if args.abstract else "compile_inductor" if args.inductor else "compile"
    args.out = args.out or os.path.join(ROOT, "benchmarks", "results", f"{name}.json")
    common = {"benchmark": name, "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "torch": torch.__version__, "git": git_rev(), "cpu_count": os.cpu_count(),
              "loadavg_at_start": os.getloadavg()}      # (other jobs on a shared machine)
    if args.inductor:
        print("inductor's compile of the gpt-tiny train step (d 128, 2 layers, batch 8 x 64), "
              "DataParallelMode('shard', compile=True), one-rank mesh, one process:")
        t0 = time.perf_counter()
        res = _inductor()
        return write_result(args.out, {**common, **res}, f"{time.perf_counter() - t0:.0f} s")
    if args.abstract:
        torch.set_num_threads(1)
        print(f"GPT-2-small shapes: d={cfg.d_model} heads={cfg.n_heads} vocab={cfg.vocab} "
              f"layers={cfg.n_layers}; batch {args.batch} x seq {args.seq}; train step "
              f"(grad_and_value + AdamW)")
        t0 = time.perf_counter()
        res = _abstract(a, args.rounds)
        return write_result(args.out, {**common, "mesh": {"dp": dp, "tp": tp, "abstract": True},
                                       "config": {**a, "d_model": cfg.d_model, "vocab": cfg.vocab},
                                       **res}, f"{time.perf_counter() - t0:.0f} s")
    print(f"GPT-2-small shapes: d={cfg.d_model} heads={cfg.n_heads} vocab={cfg.vocab} "
          f"layers={cfg.n_layers}; batch {args.batch} x seq {args.seq}; train step "
          f"(grad_and_value + AdamW); mesh dp={dp} x tp={tp} ({world} ranks, "
          f"{os.cpu_count()} cores)")

    parent = None
    if not args.skip_parent:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        plain_make_fx({**a, "layers": 1}, tiny=True)  # warm-up
        parent_s, parent_cpu, parent_nodes = plain_make_fx(a)
        parent = {"make_fx_s": parent_s, "make_fx_cpu_s": parent_cpu, "nodes": parent_nodes}
        print(f"make_fx (parent, alone): {parent_s:.2f} s wall, {parent_cpu:.2f} s CPU "
              f"({parent_nodes} nodes)")

    t0 = time.perf_counter()
    per_rank = launch(_rank_main, world, a)
    wall = time.perf_counter() - t0

    def med(key):
        return statistics.median(r[key] for r in per_rank)

    mk, lw, mkc, lwc = med("make_fx_s"), med("lower_s"), med("make_fx_cpu_s"), med("lower_cpu_s")
    st = {k: statistics.median(r["stages_cpu_s"][k] for r in per_rank)
          for k in per_rank[0]["stages_cpu_s"]}
    r0 = per_rank[0]
    print(f"{'(median over ' + str(world) + ' ranks, all at once)':<36}{'wall s':>8}{'CPU s':>8}")
    print(f"{'make_fx (mean of before/after)':<36}{mk:>8.2f}{mkc:>8.2f}")
    print(f"{'pjit first .lower':<36}{lw:>8.2f}{lwc:>8.2f}")
    print("  lower stages (CPU s): " + ", ".join(f"{k} {v:.2f}" for k, v in st.items()))
    print(f"ratio lower / make_fx: {lw / mk:.2f}x wall, {lwc / mkc:.2f}x CPU"
          + (f";  lower wall / parent make_fx wall: {lw / parent['make_fx_s']:.2f}x" if parent else ""))
    print(f"cached .lower: {r0['cached_lower_s'] * 1e3:.1f} ms")
    print(f"nodes: global graph {r0['global_nodes']} (plain make_fx {r0['make_fx_nodes']}), "
          f"local graph (rank 0) {r0['local_nodes']}")
    kinds = {k: v for k, v in r0["cost"].items() if k != "total"}
    print("collectives (rank 0): " + ", ".join(
        f"{k} x{v['count']} ({v['bytes'] / 2**20:.1f} MiB)" for k, v in kinds.items())
        + f"; by axis {r0['collectives_by_axis']}")
    print(f"per layer: lower {lwc / cfg.n_layers:.2f} CPU s, make_fx {mkc / cfg.n_layers:.2f} "
          f"CPU s (includes the embedding/head/AdamW share)")

    result = {
        "benchmark": "compile",
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "git": git_rev(),
        "world_size": world,
        "mesh": {"dp": dp, "tp": tp},
        "cpu_count": os.cpu_count(),
        "config": {**a, "d_model": cfg.d_model, "n_heads": cfg.n_heads, "vocab": cfg.vocab,
                   "wpe_rows": cfg.seq, "step": "grad_and_value + sharded.optim.adamw"},
        "make_fx_parent": parent,
        "make_fx_rank_s": [r["make_fx_s"] for r in per_rank],
        "make_fx_rank_cpu_s": [r["make_fx_cpu_s"] for r in per_rank],
        "make_fx_rank_runs_wall_cpu_s": [r["make_fx_runs"] for r in per_rank],
        "lower_s": [r["lower_s"] for r in per_rank],
        "lower_cpu_s": [r["lower_cpu_s"] for r in per_rank],
        "lower_stages_s": [r["stages_s"] for r in per_rank],
        "lower_stages_cpu_s": [r["stages_cpu_s"] for r in per_rank],
        "ratio_lower_over_make_fx_rank": lw / mk,
        "ratio_lower_over_make_fx_rank_cpu": lwc / mkc,
        "ratio_lower_over_make_fx_parent": lw / parent["make_fx_s"] if parent else None,
        "cached_lower_s": r0["cached_lower_s"],
        "global_nodes": r0["global_nodes"],
        "local_nodes": [r["local_nodes"] for r in per_rank],
        "make_fx_nodes": r0["make_fx_nodes"],
        "cost_rank0": r0["cost"],
        "collectives_by_axis_rank0": r0["collectives_by_axis"],
        "wall_s": wall,
    }
    write_result(args.out, result, f"{wall:.0f} s on the ranks")


if __name__ == "__main__":
    main()
