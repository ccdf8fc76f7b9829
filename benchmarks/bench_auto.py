"""AUTO specs against the hand-written plans: measured and predicted step time of a
train step on local gloo ranks, every plan side by side in one run, plus the solve time
of a GPT-2-small step on an abstract 8x8 mesh.

    python benchmarks/bench_auto.py              # gpt-tiny and the MLP, world 2 and 2x2
    python benchmarks/bench_auto.py --quick      # tiny shapes, 2 rounds (a smoke run; auto_quick.json, not committed)

Models (forward, backward, ``sharded.optim.adamw`` lr 1e-3 weight decay 1e-2, the
graph runner ``DTensorExpandMode(compile=False)`` unless the plan is a
DataParallelMode):

  gpt   ``examples/gpt_module.GPT`` (the nn.Module GPT of ``bench_tp_plans.py``, whose
        Megatron and sequence-parallel plans go through ``sharded.plans.parallelize``),
        at the benchmarks' gpt-tiny size: d 128, 2 layers, 4 heads, vocab 256, batch
        8 x 64; its pure step is ``gpt_module.make_train_step``.
  mlp   ``benchmarks/_models`` MLP (the MLP of ``bench_train_step`` and
        ``bench_data_parallel``): 8 x Linear(1024) with GELU, MSE loss, batch 64.

Plans (``PLANS``), on 2 ranks (``ws2``) and on 4 ranks as ("dp", "tp") = 2x2:

  auto       ``in_specs=(AUTO, AUTO, AUTO, AUTO)``, ``out_specs=(AUTO, AUTO, P())``:
             the solver lays out the batch too, as the hand plans each choose theirs
             (megatron at ws2 replicates it, ddp splits it); the state comes out as it went
             in; ws2: Mesh((2,), ("dp",)); 2x2: Mesh((2, 2), ("dp", "tp"))
  auto_dp    ``auto`` with the batch fixed to P("dp") (2x2: replicated over "tp"), the
             issue's example, the AUTO row before 2026-11-27; not a hand plan (AUTO /
             best hand plan is given for both AUTO rows)
  ddp        parameters and moments P(), batch split over every rank (ws2: P("dp") on
             ("dp",); 2x2: P(("dp", "tp")) on the 2x2 mesh), DTensorExpandMode
  ddp_mode   DataParallelMode("replicate"), batch P("dp") (2x2: on Mesh((4,), ("dp",)):
             the mode takes one axis)
  fsdp       DataParallelMode("shard"), batch P("dp") (2x2: on Mesh((4,), ("dp",)), the
             state sharded over all 4 ranks)
  megatron   Megatron tensor parallelism over "tp" (gpt: ``gpt_module.megatron_plan``;
             mlp: ``bench_train_step.mlp_tp_specs``); ws2: Mesh((2,), ("tp",)), batch
             P() (replicated); 2x2: batch P("dp")
  sp         gpt only: Megatron plus sequence parallelism (``gpt_module.sp_plan``,
             torchtitan's), meshes as megatron

For every plan: the measured step time (every plan set up and run ``--warmup`` times,
then timed round-robin: one step of each per round, a barrier before each step,
``--iters`` rounds; the slowest rank's median), and the step time that
``sharded.auto.cost.predict(lowered, model)`` predicts from rank 0's program, with the
cost model the AUTO solver used (``CostModel.for_mesh`` of the AUTO row's mesh; the
2x2 rows on Mesh((4,)) are priced with it too). The predicted ranking of the plans
against the measured one (equal orders, Spearman's rho; and the order of the distinct
programs, plans that lower to one program taken together: NOTE [Ranking distinct
programs]), the error per plan
(predicted / measured), AUTO / the best hand plan, the AUTO lower, build and solve
seconds, the layouts it chose and the program it kept (``lowered.auto["candidates"]``:
the predicted seconds of the program with the solver's moves and of DTensor's
propagation from the chosen input layouts; ``["chosen"]``). After the timing, every row's state (losses,
parameter and moment checksums) is checked against a single-device run of as many
steps (NOTE [Every row did the same work] in ``_models.py``); a row that differs fails
the run, after the results are written.

Then, in this process: ``pjit(gpt.train_step, in_specs=(AUTO, AUTO, P("dp"),
P("dp")), out_specs=(AUTO, AUTO, P()))`` lowered on ``Mesh.abstract((8, 8), ("dp",
"tp"))`` for GPT-2-small (12 layers, d 768, vocab 8192, seq 128, batch 64; the shapes
of ``bench_compile.py --abstract``, uninitialised tensors): ``lower`` seconds and the
solver's ``build_s`` and ``solve_s`` (issue 26: solve <= 60 s), and the predicted
step of AUTO and of the Megatron and DDP-like hand plans on the stated H100 table (a
hand plan that does not lower on that mesh is recorded as such: Megatron's 12 heads do
not split over tp = 8).

Writes ``benchmarks/results/auto.json`` (``--quick``: ``auto_quick.json``).
Run from a clean export of a commit (``git archive HEAD | tar -x -C DIR``, no ``.git``
there), set ``BENCH_GIT_REV`` to that commit: it is recorded as the result's ``git``.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import functools
import hashlib
import math
import os
import re
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
from benchmarks._models import git_rev, timed_interleaved, write_result  # noqa: E402
from sharded import RankPool  # noqa: E402

PLANS = {
    "auto": "AUTO params, AdamW state and batch (out: AUTO, tied to the inputs), on the mesh "
            "the row names (ws2: (2,) ('dp',); 2x2: (2, 2) ('dp', 'tp'))",
    "auto_dp": "AUTO as 'auto' with the batch fixed to P('dp')",
    "ddp": "params/state P(), batch over every rank; DTensorExpandMode",
    "ddp_mode": "DataParallelMode('replicate'), batch P('dp')",
    "fsdp": "DataParallelMode('shard'), batch P('dp')",
    "megatron": "Megatron specs over 'tp' (ws2: batch replicated; 2x2: batch P('dp'))",
    "sp": "Megatron + sequence parallel over 'tp' (gpt only)",
}
LR, WD = 1e-3, 1e-2
LAYOUTS = {"ws2": (2,), "2x2": (2, 2)}


def _meshes(layout: str):
    """The plans' meshes on this layout: {plan: (mesh, batch spec)}."""
    from sharded import AUTO, Mesh, P

    if layout == "ws2":
        dp, tp = Mesh((2,), ("dp",)), Mesh((2,), ("tp",))
        return {"auto": (dp, AUTO), "auto_dp": (dp, P("dp")), "ddp": (dp, P("dp")),
                "ddp_mode": (dp, P("dp")),
                "fsdp": (dp, P("dp")), "megatron": (tp, P()), "sp": (tp, P())}
    grid, flat = Mesh((2, 2), ("dp", "tp")), Mesh((4,), ("dp",))
    return {"auto": (grid, AUTO), "auto_dp": (grid, P("dp")),
            "ddp": (grid, P(("dp", "tp"))), "ddp_mode": (flat, P("dp")),
            "fsdp": (flat, P("dp")), "megatron": (grid, P("dp")), "sp": (grid, P("dp"))}


def _model(a: dict, name: str) -> dict:
    """params, batch, the pure step of an unparallelized model, and for a tp plan its
    (step, param specs) on ``mesh``."""
    from sharded import optim

    if name == "gpt":
        from examples import gpt_module as gm
        from sharded.plans import parallelize

        cfg = gm.Config(vocab=a["vocab"], d_model=a["d_model"], n_heads=a["heads"],
                        n_layers=a["layers"], seq=a["seq"])
        base = gm.GPT(cfg, seed=0)
        g = torch.Generator().manual_seed(1)
        toks = torch.randint(0, cfg.vocab, (a["batch"], cfg.seq + 1), generator=g)
        batch = (toks[:, :-1].contiguous(), toks[:, 1:].contiguous())
        update = functools.partial(optim.adamw, lr=LR, weight_decay=WD)

        def plain_step():                      # a module of its own (no plan's hooks)
            return gm.make_train_step(copy.deepcopy(base), update)

        def tp(plan, mesh):
            model = copy.deepcopy(base)
            specs = parallelize(model, gm.PLANS[plan](), mesh, axis="tp")
            return gm.make_train_step(model, update), specs

        params = {k: v.detach().clone() for k, v in base.named_parameters()}
        return {"params": params, "batch": batch, "plain_step": plain_step, "tp": tp,
                "plans": list(PLANS)}
    from benchmarks.bench_train_step import mlp_tp_specs

    params = M.mlp_init(a["mlp_width"], a["mlp_layers"])
    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(a["mlp_batch"], a["mlp_width"], generator=g),
             torch.randn(a["mlp_batch"], a["mlp_width"], generator=g))

    def mlp_step(p, o, x, y):
        grads, loss = torch.func.grad_and_value(M.mlp_loss)(p, x, y)
        p, o = optim.adamw(p, grads, o, lr=LR, weight_decay=WD)
        return p, o, loss

    def tp(plan, mesh):
        assert plan == "megatron"
        return (lambda *xs: mlp_step(*xs)), mlp_tp_specs(params)

    return {"params": params, "batch": batch, "plain_step": lambda: (lambda *xs: mlp_step(*xs)),
            "tp": tp, "plans": [p for p in PLANS if p != "sp"]}


def _summary(layouts: dict) -> dict:
    """The chosen spec of each parameter, list indices as ``*`` (``blocks.*.attn.wq.weight``):
    {path: spec, or "spec (n) | spec (m)" where the blocks differ}."""
    out: dict = {}
    for path, spec in layouts["inputs"].items():
        if not path.startswith("args[0]"):
            continue
        key = re.sub(r"\[(\d+)\]", "[*]", path[len("args[0]"):])
        key = re.sub(r"\['([^']*)'\]", r".\1", key).strip(".")
        key = re.sub(r"\.\d+\.", ".*.", key)             # a module path's block index
        out.setdefault(key, []).append(str(spec))
    return {k: v[0] if len(set(v)) == 1 else " | ".join(f"{s} ({v.count(s)})" for s in sorted(set(v)))
            for k, v in out.items()}


def _run_model(a: dict, layout: str, name: str) -> dict:
    from sharded import AUTO, P, gather, optim, pjit, shard
    from sharded.auto.cost import CostModel, predict
    from sharded.modes import DataParallelMode, DTensorExpandMode

    rank = dist.get_rank()
    spec = _model(a, name)
    params, (x, y) = spec["params"], spec["batch"]
    meshes = _meshes(layout)
    auto_mesh = meshes["auto"][0]
    model = CostModel.for_mesh(auto_mesh)       # what the AUTO row's solver uses
    out: dict = {"lower_s": {}, "predicted": {}, "cost": {}, "loss0": {}, "cost_model": model.to_dict()}
    steps, fingerprints = {}, {}

    for plan in [p for p in a["plans"] if p in spec["plans"] and p in meshes]:
        mesh, bs = meshes[plan]
        st: dict = {}
        if plan in ("ddp_mode", "fsdp"):
            mode = DataParallelMode("replicate" if plan == "ddp_mode" else "shard", compile=False)
            f = pjit(spec["plain_step"](), in_specs=(P(), P(), bs, bs), mesh=mesh, mode=mode)
            st["p"] = optree.tree_map(torch.clone, params)
            st["o"] = pjit(optim.adamw_init, in_specs=P(), mesh=mesh, mode=mode)(params)   # born sharded
            args = (x, y)
        else:
            if plan.startswith("auto"):
                fn, ps = spec["plain_step"](), AUTO
            elif plan == "ddp":
                fn, ps = spec["plain_step"](), P()
            else:
                fn, ps = spec["tp"](plan, mesh)
            os_ = AUTO if ps is AUTO else {"step": P(), "m": ps, "v": ps}
            f = pjit(fn, in_specs=(ps, os_, bs, bs), out_specs=(ps, os_, P()), mesh=mesh,
                     mode=DTensorExpandMode(compile=False))
            st["p"], st["o"] = params, optim.adamw_init(params)
            args = (x, y) if bs is AUTO else shard((x, y), bs, mesh)
        dist.barrier()
        t0 = time.perf_counter()
        low = f.lower(st["p"], st["o"], *args)
        out["lower_s"][plan] = time.perf_counter() - t0
        if plan.startswith("auto"):
            # the layouts the solver chose: the state laid out as they say (the
            # outputs come back the same, out_specs tied to the inputs)
            st["p"], st["o"] = shard((params, optim.adamw_init(params)),
                                     (low.in_specs[0], low.in_specs[1]), mesh)
            if bs is AUTO:                      # the batch as the solver laid it out
                args = shard((x, y), (low.in_specs[2], low.in_specs[3]), mesh)
            rep = low.auto
            ar = out.setdefault("autos", {})[plan] = {
                k: rep[k] for k in ("solve_s", "build_s", "apply_s", "lower_s", "objective_s",
                                    "compute_s", "moves_s", "memory_bytes", "variables",
                                    "constraints", "status", "applied", "unapplied",
                                    "unsupported_ops", "candidates", "chosen",
                                    "propagation_failed") if k in rep}
            ar["mesh"] = list(mesh.shape) if hasattr(mesh, "shape") else None
            ar["solver_cost_model"] = rep.get("model")
            ar["decide_s"] = low.compile_times().get("decide")
            ar["layouts"] = _summary(low.layouts)
            ar["explain"] = low.explain() if rank == 0 else None
            if plan == "auto":
                out["auto"] = ar
        elif plan not in ("ddp_mode", "fsdp"):
            st["p"], st["o"] = shard((params, optim.adamw_init(params)), (ps, os_), mesh)
        out["predicted"][plan] = predict(low, model)
        c = low.cost()
        out["cost"][plan] = {k: v["count"] for k, v in c.items() if k != "total"}
        out["cost"][plan]["bytes"] = c["total"]["bytes"]
        out["cost"][plan]["local_nodes"] = len(low.local_graph.graph.nodes)
        out.setdefault("program", {})[plan] = program_id(low)

        def step(f=f, st=st, args=args):
            st["p"], st["o"], st["loss"] = f(st["p"], st["o"], *args)
        step()                                  # the set-up step (first call: compile + agree)
        out["loss0"][plan] = float(gather(st["loss"]))
        steps[plan] = step
        fingerprints[plan] = lambda st=st: M.functional_fingerprint(st["loss"], st["p"], st["o"])

    out["times"] = timed_interleaved(steps, a["warmup"], a["iters"])
    out["fingerprint"] = {p: fp() for p, fp in fingerprints.items()}
    if rank == 0:                               # one device, as many steps
        fn = spec["plain_step"]()
        p, o = params, optim.adamw_init(params)
        for _ in range(1 + a["warmup"] + a["iters"]):
            p, o, loss = fn(p, o, x, y)
        out["reference"] = M.functional_fingerprint(loss, p, o)
    return out


def program_id(lowered) -> str:
    """A digest of the program a rank runs: each node's kind, target, value shape and
    dtype and the positions of its inputs, in order, and each collective's kind, shape
    and group size (not names or group names: the same DDP program on a (4,) and on a
    2x2 mesh is one program). Plans with one program have one cost and can be ranked
    only by noise (NOTE [Ranking distinct programs])."""
    pos, sig = {}, []
    for i, n in enumerate(lowered.local_graph.graph.nodes):
        pos[n] = i
        v = n.meta.get("val")
        sig.append((n.op, str(n.target),
                    (tuple(v.shape), str(v.dtype)) if isinstance(v, torch.Tensor) else None,
                    tuple(pos[a] for a in n.all_input_nodes)))
    sig.append(tuple((c.kind, tuple(c.shape), c.group_size) for c in lowered.collectives()))
    return hashlib.sha1(repr(sig).encode()).hexdigest()[:12]


def _rank_main(a: dict, layout: str) -> dict:
    return {name: _run_model(a, layout, name) for name in a["models"]}


# -- GPT-2-small on an abstract 8x8 mesh -----------------------------------------------------

def _abstract(a: dict) -> dict:
    import gc

    from benchmarks.bench_compile import _inputs
    from examples import gpt
    from sharded import AUTO, Mesh, P, pjit
    from sharded.auto.cost import CostModel, predict

    dp, tp = a["abstract_mesh"]
    mesh = Mesh.abstract((dp, tp), ("dp", "tp"), rank=0)
    ca = {"layers": a["abstract_layers"], "seq": a["abstract_seq"], "matmul_attn": False,
          "vocab": a["abstract_vocab"], "batch": a["abstract_batch"]}
    cfg, params, opt, ids, tgt = _inputs(ca)
    h100 = CostModel.for_mesh(mesh)
    res: dict = {"mesh": [dp, tp], "config": ca, "cost_model": h100.name}
    # the hand plans priced beside AUTO: Megatron over "tp" (batch over "dp"), and
    # DDP-like (everything P(), the batch over both axes)
    plans = {"auto": (AUTO, AUTO, P("dp")), "megatron": (gpt.tp_specs(params), None, P("dp")),
             "ddp": (gpt.dp_specs(params), None, P(("dp", "tp")))}
    for plan, (ps, os_, bs) in plans.items():
        os_ = os_ or gpt.opt_specs(ps)
        f = pjit(lambda *xs: gpt.train_step(*xs), in_specs=(ps, os_, bs, bs),
                 out_specs=(ps, os_, P()), mesh=mesh, static_argnums=(4,))
        gc.collect()
        t0 = time.perf_counter()
        try:
            low = f.lower(params, opt, ids, tgt, cfg)
        except Exception as e:        # noqa: BLE001 (a hand plan this mesh cannot run)
            if plan == "auto":
                raise
            res.setdefault("hand_plan_errors", {})[plan] = f"{type(e).__name__}: {str(e)[:300]}"
            print(f"  {plan}: cannot lower on this mesh: {str(e).splitlines()[0][:200]}")
            continue
        s = time.perf_counter() - t0
        pred = predict(low, h100)
        res.setdefault("predicted_ms", {})[plan] = pred["total_s"] * 1e3
        if plan == "auto":
            res.update({"lower_s": s, "solve_s": low.auto["solve_s"], "build_s": low.auto["build_s"],
                        "apply_s": low.auto.get("apply_s"), "variables": low.auto.get("variables"),
                        "constraints": low.auto.get("constraints"),
                        "objective_ms": low.auto["objective_s"] * 1e3,
                        "candidates_ms": {k: v * 1e3 for k, v in
                                          (low.auto.get("candidates") or {}).items()},
                        "chosen": low.auto.get("chosen"),
                        "compile_times": low.compile_times(), "layouts": _summary(low.layouts),
                        "explain": low.explain()})
            print(f"GPT-2-small ({ca['layers']} layers, d 768, vocab {ca['vocab']}, batch "
                  f"{ca['batch']} x {ca['seq']}) AUTO on Mesh.abstract(({dp}, {tp})): lower "
                  f"{s:.1f} s (build {res['build_s']:.1f} s, solve {res['solve_s']:.1f} s; aim: "
                  f"solve <= 60 s)")
        del low, f
    print("  predicted step on the H100 table (ms): "
          + ", ".join(f"{k} {v:.1f}" for k, v in res["predicted_ms"].items()))
    return res


# -- report --------------------------------------------------------------------------------------

def _ranks(xs: list[float]) -> list[float]:
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    r = [0.0] * len(xs)
    for pos, i in enumerate(order):
        r[i] = float(pos)
    return r


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation of two lists (no ties expected)."""
    n = len(a)
    if n < 2:
        return float("nan")
    ra, rb = _ranks(a), _ranks(b)
    d2 = sum((x - y) ** 2 for x, y in zip(ra, rb))
    return 1 - 6 * d2 / (n * (n * n - 1))


# NOTE [Orders the rounds can tell apart]
# Plans run in interleaved rounds (each round runs every plan once), and the machine's
# load moves a round's times together: two plans with one program have come out 15%
# apart by their medians. An order between two programs is read from the rounds,
# paired: A is faster than B when it was faster in so many of the rounds that a fair
# coin would do so with probability under 5% (a two-sided sign test; 9 of 10 rounds).
# Otherwise the rounds do not tell them apart, and either predicted order agrees with
# the measurement. A round's time is its slowest rank's; a program's that several
# plans lower to, their mean.
SIGN_TEST_P = 0.05


def sign_test(wins: int, n: int) -> float:
    """Two-sided p-value of ``wins`` of ``n`` paired rounds under a fair coin."""
    if n == 0:
        return 1.0
    k = max(wins, n - wins)
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k, n + 1)) / 2 ** n)


def rounds_won(a: list[float], b: list[float]) -> tuple[int, int]:
    """The paired rounds in which ``a`` was faster than ``b``, and slower (ties in
    neither)."""
    return sum(x < y for x, y in zip(a, b)), sum(x > y for x, y in zip(a, b))


def told_apart(a: list[float], b: list[float]) -> int:
    """-1 where the rounds say ``a`` is faster, 1 where ``b`` is, 0 where they do not
    tell them apart (NOTE [Orders the rounds can tell apart]; tied rounds left out)."""
    wins, losses = rounds_won(a, b)
    if sign_test(wins, wins + losses) >= SIGN_TEST_P:
        return 0
    return -1 if wins > losses else 1


def _table(layout: str, name: str, per_rank: list[dict], a: dict) -> dict:
    r0 = per_rank[0][name]
    plans = list(r0["times"])
    ms = {p: max(statistics.median(r[name]["times"][p]) for r in per_rank) * 1e3 for p in plans}
    pred = {p: r0["predicted"][p]["total_s"] * 1e3 for p in plans}
    checked = M.same_work(r0["fingerprint"], r0["reference"])
    hand = [p for p in plans if not p.startswith("auto")]
    best = min(hand, key=lambda p: ms[p]) if hand else None
    pred_best = min(hand, key=lambda p: pred[p]) if hand else None
    measured_order = sorted(plans, key=lambda p: ms[p])
    predicted_order = sorted(plans, key=lambda p: pred[p])
    rho = spearman([pred[p] for p in plans], [ms[p] for p in plans])
    # NOTE [Ranking distinct programs]: plans that lower to one program (DDP by
    # DTensorExpandMode on the 2x2 grid and by DataParallelMode on (4,); AUTO where it
    # chose replicated state) have one predicted cost, and their measured order is
    # the machine's noise. The ranking is checked over distinct programs, each at the
    # mean of its plans' medians.
    groups: dict = {}
    for p in plans:
        groups.setdefault(r0.get("program", {}).get(p, p), []).append(p)
    names = {g: "=".join(ps) for g, ps in groups.items()}
    g_ms = {g: statistics.mean(ms[p] for p in ps) for g, ps in groups.items()}
    g_pred = {g: statistics.mean(pred[p] for p in ps) for g, ps in groups.items()}
    distinct_measured = [names[g] for g in sorted(groups, key=g_ms.get)]
    distinct_predicted = [names[g] for g in sorted(groups, key=g_pred.get)]
    # the orders the rounds can tell apart (NOTE [Orders the rounds can tell apart])
    rounds = {p: [max(ts) for ts in zip(*(r[name]["times"][p] for r in per_rank))] for p in plans}
    g_rounds = {g: [statistics.mean(ts) for ts in zip(*(rounds[p] for p in ps))]
                for g, ps in groups.items()}
    apart = []
    for i, g in enumerate(groups):
        for h in list(groups)[i + 1:]:
            said = told_apart(g_rounds[g], g_rounds[h])
            if said:
                fast, slow = (g, h) if said < 0 else (h, g)
                apart.append({"faster": names[fast], "slower": names[slow],
                              "predicted_alike": g_pred[fast] <= g_pred[slow]})
    vs_best = None
    if best and "auto" in ms and r0.get("program", {}).get("auto") != r0.get("program", {}).get(best):
        wins, losses = rounds_won(rounds["auto"], rounds[best])
        vs_best = {"auto_faster_rounds": wins, "rounds": len(rounds["auto"]),
                   "p": sign_test(wins, wins + losses),
                   "auto_slower": told_apart(rounds["auto"], rounds[best]) > 0}
    auto = r0.get("auto", {})
    print(f"\n{name} on {layout}: median of {a['iters']} interleaved rounds after {a['warmup']} "
          f"warm-up, slowest rank")
    print(f"{'plan':<10}{'ms/step':>9}{'predicted':>11}{'pred/meas':>11}{'comp ms':>9}{'comm ms':>9}"
          f"{'colls':>7}{'nodes':>7}{'lower s':>9}{'same work':>11}")
    for p in plans:
        pr = r0["predicted"][p]
        ok = "DIFFERENT" if checked[p]["failures"] else f"{checked[p]['max_rel_diff']:.0e}"
        print(f"{p:<10}{ms[p]:>9.1f}{pred[p]:>11.1f}{pred[p] / ms[p]:>11.2f}{pr['compute_s'] * 1e3:>9.1f}"
              f"{pr['comm_s'] * 1e3:>9.1f}{pr['collectives']:>7}{r0['cost'][p]['local_nodes']:>7}"
              f"{r0['lower_s'][p]:>9.2f}{ok:>11}")
    row = {"median_ms": ms,
           "min_max_ms": {p: (min(min(r[name]["times"][p]) for r in per_rank) * 1e3,
                              max(max(r[name]["times"][p]) for r in per_rank) * 1e3) for p in plans},
           "predicted_ms": pred,
           "predicted": r0["predicted"],
           "pred_over_measured": {p: pred[p] / ms[p] for p in plans},
           "measured_order": measured_order, "predicted_order": predicted_order,
           "orders_equal": measured_order == predicted_order, "spearman": rho,
           "distinct_measured_order": distinct_measured,
           "distinct_predicted_order": distinct_predicted,
           "distinct_orders_equal": distinct_measured == distinct_predicted,
           "told_apart": apart,
           "ranking_agrees_where_told_apart": all(x["predicted_alike"] for x in apart),
           "auto_against_best_hand_by_rounds": vs_best,
           "programs": r0.get("program", {}),
           "auto_same_program_as": {ap: [p for p in hand if r0.get("program", {}).get(p) is not None
                                         and r0["program"][p] == r0["program"].get(ap)]
                                    for ap in plans if ap.startswith("auto")},
           "best_hand": best, "predicted_best_hand": pred_best,
           "auto_over_best_hand": ms["auto"] / ms[best] if best and "auto" in ms else None,
           "auto_predicted_over_best_hand_predicted": (pred["auto"] / pred[pred_best]
                                                       if pred_best and "auto" in pred else None),
           "auto_dp_over_best_hand": (ms["auto_dp"] / ms[best]
                                      if best and "auto_dp" in ms else None),
           "autos": r0.get("autos", {}),
           "lower_s": r0["lower_s"], "collectives": r0["cost"], "loss_first_step": r0["loss0"],
           "auto": auto, "cost_model": r0["cost_model"],
           "same_work": {"rtol": M.SAME_WORK_RTOL, "steps": r0["reference"]["step"],
                         "reference": r0["reference"], "rows": r0["fingerprint"], "checked": checked},
           "times_ms_per_rank": {p: [[t * 1e3 for t in r[name]["times"][p]] for r in per_rank]
                                 for p in plans}}
    if "auto" in ms and best:
        print(f"AUTO / best hand plan ({best}): {row['auto_over_best_hand']:.2f}  (predicted: "
              f"{row['auto_predicted_over_best_hand_predicted']:.2f} of {pred_best})")
    for ap, same in row["auto_same_program_as"].items():
        if same:
            print(f"{ap} lowers to the same program as: {', '.join(same)}")
    print(f"measured order:  {' < '.join(measured_order)}")
    print(f"predicted order: {' < '.join(predicted_order)}  (equal: {row['orders_equal']}, "
          f"Spearman {rho:.2f})")
    print(f"distinct programs, measured:  {' < '.join(distinct_measured)}")
    print(f"distinct programs, predicted: {' < '.join(distinct_predicted)}  (equal: "
          f"{row['distinct_orders_equal']})")
    print(f"orders the rounds tell apart (sign test, p < {SIGN_TEST_P}): {len(apart)}; predicted "
          f"alike: {sum(x['predicted_alike'] for x in apart)}"
          + "".join(f"\n  NOT predicted: {x['faster']} < {x['slower']}"
                    for x in apart if not x["predicted_alike"]))
    if vs_best:
        print(f"AUTO faster than {best} in {vs_best['auto_faster_rounds']} of {vs_best['rounds']} "
              f"rounds (sign test p {vs_best['p']:.3f}; slower as the rounds tell: "
              f"{vs_best['auto_slower']})")
    for ap, ar in r0.get("autos", {}).items():
        print(f"{ap}: program kept: {ar.get('chosen')}; candidates (predicted ms): "
              + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in (ar.get("candidates") or {}).items())
              + (f"; propagation failed: {ar['propagation_failed']}" if ar.get("propagation_failed")
                 else ""))
    if "auto_dp" in ms and best:
        print(f"AUTO, batch P('dp') / best hand plan ({best}): {row['auto_dp_over_best_hand']:.2f}")
    if auto:
        print(f"AUTO: lower {r0['lower_s']['auto']:.2f} s (build {auto['build_s']:.2f} s, solve "
              f"{auto['solve_s']:.2f} s), solver objective {auto['objective_s'] * 1e3:.1f} ms; layouts: "
              + "; ".join(f"{k}: {v}" for k, v in auto["layouts"].items()))
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="gpt,mlp")
    ap.add_argument("--layouts", default="ws2,2x2", help="comma-separated subset of ws2,2x2")
    ap.add_argument("--plans", default=",".join(PLANS))
    M.gpt_shape_arguments(ap)
    M.mlp_arguments(ap)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--abstract-mesh", default="8x8")
    ap.add_argument("--abstract-layers", type=int, default=12)
    ap.add_argument("--no-abstract", action="store_true", help="skip the GPT-2-small solve")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: tiny shapes, 1 warm-up, 2 rounds, a 2-layer abstract GPT-2 on 2x2")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.vocab, args.d_model, args.layers, args.batch, args.seq = 64, 32, 1, 8, 16
        args.mlp_width, args.mlp_layers, args.mlp_batch = 64, 2, 16
        args.warmup, args.iters = 1, 2
        args.abstract_mesh, args.abstract_layers = "2x2", 2
    out_path = args.out or os.path.join(ROOT, "benchmarks", "results",
                                        "auto_quick.json" if args.quick else "auto.json")
    a = {k: getattr(args, k) for k in ("vocab", "d_model", "heads", "layers", "batch", "seq",
                                       "mlp_width", "mlp_layers", "mlp_batch", "warmup", "iters")}
    a["models"] = [m for m in args.models.split(",") if m]
    a["plans"] = [p for p in args.plans.split(",") if p]
    layouts = [x for x in args.layouts.split(",") if x]
    a["abstract_mesh"] = tuple(int(v) for v in args.abstract_mesh.split("x"))
    a["abstract_layers"], a["abstract_seq"], a["abstract_vocab"], a["abstract_batch"] = \
        args.abstract_layers, 128, 8192, 64

    t0 = time.perf_counter()
    results: dict = {}
    for layout in layouts:
        world = 1
        for n in LAYOUTS[layout]:
            world *= n
        with RankPool(world) as pool:
            per_rank = pool.run(_rank_main, a, layout, timeout=1800)
        results[layout] = {name: _table(layout, name, per_rank, a) for name in a["models"]}
        results[layout]["threads_per_rank"] = max(1, (os.cpu_count() or 1) // world)
    wall = time.perf_counter() - t0

    summary = {f"{name}@{layout}": {
        "auto_over_best_hand": results[layout][name]["auto_over_best_hand"],
        "auto_dp_over_best_hand": results[layout][name]["auto_dp_over_best_hand"],
        "best_hand": results[layout][name]["best_hand"],
        "orders_equal": results[layout][name]["orders_equal"],
        "distinct_orders_equal": results[layout][name]["distinct_orders_equal"],
        "spearman": results[layout][name]["spearman"],
        "told_apart": len(results[layout][name]["told_apart"]),
        "ranking_agrees_where_told_apart": results[layout][name]["ranking_agrees_where_told_apart"],
        "auto_slower_by_rounds": bool((results[layout][name]["auto_against_best_hand_by_rounds"]
                                       or {}).get("auto_slower")),
    } for layout in layouts for name in a["models"]}
    print("\nsummary: " + "; ".join(
        f"{k}: AUTO/best {v['auto_over_best_hand']:.2f} ({v['best_hand']}; slower as the rounds "
        f"tell: {v['auto_slower_by_rounds']}), ranking "
        f"{'equal' if v['orders_equal'] else 'differs'} (rho {v['spearman']:.2f}), of distinct "
        f"programs {'equal' if v['distinct_orders_equal'] else 'differs'}, where the rounds tell "
        f"{v['told_apart']} orders apart {'agrees' if v['ranking_agrees_where_told_apart'] else 'DIFFERS'}"
        for k, v in summary.items()))
    result = {
        "benchmark": "auto",
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "git": git_rev(),
        "cpu_count": os.cpu_count(),
        "config": a,
        "plans": PLANS,
        "summary": summary,
        "results": results,
        "abstract_gpt2_small": None,
        "wall_s": wall,
    }
    write_result(out_path, result, f"ranks: {wall:.0f} s")     # (kept if the solve below fails)
    if not args.no_abstract:
        result["abstract_gpt2_small"] = _abstract(a)
        result["wall_s"] = time.perf_counter() - t0
        write_result(out_path, result, f"{result['wall_s']:.0f} s")
    for layout in layouts:
        for name in a["models"]:
            r = results[layout][name]["same_work"]
            M.require_same_work(r["rows"], r["reference"], f"bench_auto {name} on {layout}")
    return result


if __name__ == "__main__":
    main()
