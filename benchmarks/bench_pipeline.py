"""Pipeline parallelism: ``sharded.pipelining`` against ``torch.distributed.pipelining``,
step time, peak memory and the bubble of a train step on 2 gloo ranks, side by side
in one run.

    python benchmarks/bench_pipeline.py                    # 8-layer gpt-tiny, pp=2, m 4 and 8, GPipe and 1F1B
    python benchmarks/bench_pipeline.py --microbatches 4 --schedules 1F1B --iters 10

The model is ``examples/gpt.py``'s GPT at its ``tiny()`` size (d 64, 4 heads, vocab 256,
seq 32; batch 16) with 8 layers and an untied LM head (``head``, a copy of ``wte``
at init: a parameter belongs to one stage in both libraries, and torch's
PipelineStage has no tied weights either), split after block 3: stage 0 is the
embeddings and blocks 0-3, stage 1 blocks 4-7, the final norm and the head. Every row
is one train step (forward, backward of m micro-batches, AdamW lr 1e-3, betas (0.9,
0.999), eps 1e-8, weight decay 1e-2 on every parameter) of the same batch:

  ours   pjit(step, mesh=Mesh((2,), ("pp",))) where step is
         torch.func.grad_and_value(pipeline(loss, microbatches=m, schedule=s)) and
         sharded.optim.adamw (torch's fused AdamW kernel), ``pipe_split(h)`` before
         block 4 inside the loss; the graph runner (compile=False)
  torch  PipelineStage(stage module) + ScheduleGPipe / Schedule1F1B(n_microbatches=m,
         loss_fn=cross-entropy, scale_grads=True: the loss is the mean over the
         micro-batches of their means, as ours), then torch.optim.AdamW(fused=True)
         step and zero_grad on the stage's parameters

Rows are named ``<side>_<schedule>_m<m>``. Step time: every row is built, warmed up,
then the rows are timed round-robin (``_models.timed_interleaved``: one step of each
row per round, a barrier before each step); reported is the slowest rank's median.
Peak memory per rank: measured in processes of their own after the timing
(``_models.least_window_peaks``: each row built from nothing and stepped twice inside
the window, least of three rounds; ours takes the whole model's parameters and AdamW
state as its first step's input, as a user's step does, and gives back each stage's
part on its rank, donated: the optimizer updates them in place, as torch's AdamW), and,
as ``steady``, the peak above the held state while a row that has already stepped
takes two more steps (ours then holds its stages' part only).

Bubble: ours records the compute slots of its last step (``last_timeline()``); torch's
rows get the same record by timing each ``forward_one_chunk`` / ``backward_one_chunk``
of the stage (the schedule's receives are outside them, as ours). Per timed step:

  idle (step)  per rank, 1 - busy / (end - start) over the whole step (its prologue,
               the micro-batches, the optimizer tail: the tail counts as idle);
  bubble       the mean over ranks of 1 - busy / W, W the span from the first rank's
               start to the last compute slot of any rank (the micro-batch phase, as
               the theory's makespan); both the median over the timed steps;
  theory       (p-1)/(m+p-1);
  simulated    ``_schedules.simulate`` of the schedule's order with the measured mean
               forward and backward slot (no transfer cost: with one cost for every
               stage this is the theory exactly, for GPipe and 1F1B);
  sim/stage    the same order run with each stage's own measured mean F and B slot
               (the stages differ: stage 0 has the embeddings, stage 1 the head and
               the loss), still no transfer cost;
  step parts   per rank, where the step time goes: compute slots, before the first
               (prologue; on rank 1 the wait for its first input), between slots
               (waits for messages, the runner's own work), after the last (the
               optimizer tail; ours also sends the loss to every rank and waits for its
               sends).

The "within 10% of theory" aim compares ``bubble`` with ``theory`` (relative).

Same work: after the timing every row's state (the last loss, float64 checksums of
its parameters and Adam moments, summed over the two stages, and the step count) is
checked against one device running the same loss unpipelined for as many steps
(NOTE [Every row did the same work] in ``_models.py``); a row that differs fails the
run after the results are written. Writes ``benchmarks/results/pipeline.json``.
"""

from __future__ import annotations

import argparse
import datetime
import functools
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
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks import _models as M  # noqa: E402
from benchmarks._models import git_rev, write_result  # noqa: E402
from examples import gpt  # noqa: E402
from sharded import launch  # noqa: E402

SIDES = ("ours", "torch")
LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 1e-2


# -- the model ---------------------------------------------------------------------------------

def init_params(cfg: gpt.GPTConfig) -> dict:
    """``gpt.init_params`` with an untied head (a copy of ``wte``)."""
    p = gpt.init_params(cfg, 0)
    p["head"] = p["wte"].clone()
    return p


def _block(blk, x, cfg):
    d = cfg.d_model
    x = x + gpt._attention(blk["attn"], F.layer_norm(x, (d,), blk["ln1_w"], blk["ln1_b"]), cfg)
    return x + gpt._mlp(blk["mlp"], F.layer_norm(x, (d,), blk["ln2_w"], blk["ln2_b"]))


def loss_fn(params, ids, targets, cfg: gpt.GPTConfig, split_at: int):
    """``gpt.loss_fn`` with the untied head and a stage boundary before block
    ``split_at`` (``pipe_split`` is the identity outside a traced pipeline)."""
    from sharded.pipelining import pipe_split

    d = cfg.d_model
    x = F.embedding(ids, params["wte"]) + params["wpe"][: ids.shape[1]]
    for i, blk in enumerate(params["blocks"]):
        if i == split_at:
            x = pipe_split(x)
        x = _block(blk, x, cfg)
    x = F.layer_norm(x, (d,), params["lnf_w"], params["lnf_b"])
    logits = x @ params["head"].T
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


@functools.lru_cache(maxsize=None)
def our_step(cfg: gpt.GPTConfig, split_at: int, m: int, schedule: str):
    """The train step of row (schedule, m); one function object per row, so that a
    new pjit of it hits pjit's cache (the memory windows do not count compiles)."""
    from sharded import optim
    from sharded.pipelining import pipeline

    pl = pipeline(lambda p, x, y: loss_fn(p, x, y, cfg, split_at), microbatches=m, schedule=schedule)

    def step(params, opt_state, ids, targets):
        grads, loss = torch.func.grad_and_value(pl)(params, ids, targets)
        params, opt_state = optim.adamw(params, grads, opt_state, lr=LR, betas=BETAS, eps=EPS,
                                        weight_decay=WD)
        return params, opt_state, loss
    return step


def reference_step(params, opt_state, ids, targets, cfg, split_at):
    from sharded import optim

    grads, loss = torch.func.grad_and_value(loss_fn)(params, ids, targets, cfg, split_at)
    params, opt_state = optim.adamw(params, grads, opt_state, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    return params, opt_state, loss


class Stage0(nn.Module):
    """Embeddings and blocks [0, split_at) (``_models._Block``: the same math)."""

    def __init__(self, params, cfg, split_at):
        super().__init__()
        self.wte, self.wpe = nn.Parameter(params["wte"].clone()), nn.Parameter(params["wpe"].clone())
        self.blocks = nn.ModuleList([M._Block(b, cfg) for b in params["blocks"][:split_at]])

    def forward(self, ids):
        x = F.embedding(ids, self.wte) + self.wpe[: ids.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return x


class Stage1(nn.Module):
    """Blocks [split_at, n), the final norm and the head (logits)."""

    def __init__(self, params, cfg, split_at):
        super().__init__()
        self.cfg = cfg
        self.blocks = nn.ModuleList([M._Block(b, cfg) for b in params["blocks"][split_at:]])
        self.lnf_w, self.lnf_b = nn.Parameter(params["lnf_w"].clone()), nn.Parameter(params["lnf_b"].clone())
        self.head = nn.Parameter(params["head"].clone())

    def forward(self, x):
        for blk in self.blocks:
            x = blk(x)
        x = F.layer_norm(x, (self.cfg.d_model,), self.lnf_w, self.lnf_b)
        return x @ self.head.T


def _ce(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


# -- the rows ----------------------------------------------------------------------------------

def _parse(row: str):
    side, schedule, m = row.split("_")
    return side, schedule, int(m[1:])


def _sum_fingerprints(parts: list[dict]) -> dict:
    """The two stages' partial checksums as one row's (sums add; the step count and the
    loss are every rank's)."""
    out = dict(parts[0])
    for p in parts[1:]:
        for k in ("params_sum", "params_l1", "params_sumsq", "exp_avg_sumsq", "exp_avg_sq_sum"):
            out[k] += p[k]
    return out


def _gathered_fingerprint(local: dict) -> dict:
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    steps = {p["step"] for p in parts}
    if len(steps) != 1:
        raise M.DifferentWork(f"the stages took different numbers of steps: {steps}")
    return _sum_fingerprints(parts)


def _build(row: str, a: dict, rank: int, timelines: list | None = None):
    """Everything a row needs (built inside the memory window); returns (step, state)."""
    from sharded import Mesh, P, optim, pjit

    side, schedule, m = _parse(row)
    cfg, split_at = a["cfg"], a["split_at"]
    ids, tgt = a["batch"]
    st: dict = {}
    if side == "ours":
        from sharded.pipelining import last_timeline

        mesh = Mesh((2,), ("pp",))
        f = pjit(our_step(cfg, split_at, m, schedule), in_specs=(P(), P(), P(), P()), mesh=mesh,
                 donate_argnums=(0, 1))    # (torch updates its parameters in place too)
        # the whole model and its AdamW state go in; each stage's part comes back on its rank
        st["p"], st["o"] = a["params"], optim.adamw_init(a["params"])

        def step():
            st["p"], st["o"], st["loss"] = f(st["p"], st["o"], ids, tgt)
            if timelines is not None:
                timelines.append(last_timeline())

        def fingerprint():
            mine = lambda ts: [t.to_local() for t in ts if t.to_local().numel()]   # noqa: E731
            loss = st["loss"]
            loss = loss.to_local() if hasattr(loss, "to_local") else loss
            step_t = st["o"]["step"]
            step_t = step_t.to_local() if hasattr(step_t, "to_local") else step_t
            local = M.fingerprint(loss, mine(optree.tree_leaves(st["p"])),
                                  mine(optree.tree_leaves(st["o"]["m"])),
                                  mine(optree.tree_leaves(st["o"]["v"])), step_t)
            return _gathered_fingerprint(local)
        st["fingerprint"] = fingerprint
    else:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        module = (Stage0 if rank == 0 else Stage1)(a["params"], cfg, split_at)
        stage = PipelineStage(module, rank, 2, torch.device("cpu"))
        if timelines is not None:
            slots: list = []
            for kind, name in (("F", "forward_one_chunk"), ("B", "backward_one_chunk")):
                def timed(*args, _f=getattr(stage, name), _k=kind, **kw):
                    t0 = time.perf_counter()
                    out = _f(*args, **kw)
                    slots.append((f"{_k}{rank}", t0, time.perf_counter()))
                    return out
                setattr(stage, name, timed)
        cls = ScheduleGPipe if schedule == "GPipe" else Schedule1F1B
        sched = cls(stage, n_microbatches=m, loss_fn=_ce, scale_grads=True)
        opt = M.torch_adamw(module.parameters(), lr=LR, weight_decay=WD)
        assert opt.defaults["betas"] == BETAS and opt.defaults["eps"] == EPS

        def step():
            if timelines is not None:
                slots.clear()
                t0 = time.perf_counter()
            losses: list = []
            if rank == 0:
                sched.step(ids)
            else:
                sched.step(target=tgt, losses=losses, return_outputs=False)
                st["loss"] = torch.stack(losses).mean().detach()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if timelines is not None:
                timelines.append({"start": t0, "end": time.perf_counter(), "slots": list(slots)})

        def fingerprint():
            loss = st.get("loss", torch.zeros(()))
            dist.broadcast(loss, src=1)                    # the last stage's loss
            st["loss"] = loss
            return _gathered_fingerprint(M.optimizer_fingerprint(loss, opt))
        st["fingerprint"] = fingerprint
    step()
    return step, st


def _steady_peaks(a: dict, rank: int) -> dict:
    """Each row's peak above its held state while it takes two steps (the row built
    and stepped twice outside the window: ours then holds its stage's part only; the
    least of three rounds)."""
    _, measure = M.peak_measure()
    peaks: dict = {}
    for _ in range(3):
        for row in a["rows"]:
            step, _st = _build(row, a, rank)
            step()

            def window():
                step()
                step()
            dist.barrier()
            peak = measure(window)
            peaks[row] = min(peak, peaks.get(row, peak))
            del step, _st
    return peaks


# -- one phase on every rank -------------------------------------------------------------------

def _rank_main(a: dict) -> dict:
    rank = dist.get_rank()
    cfg = gpt.GPTConfig(vocab=a["vocab"], d_model=a["d_model"], n_heads=a["heads"],
                        n_layers=a["layers"], seq=a["seq"], sdpa=True)
    a = {**a, "cfg": cfg, "params": init_params(cfg), "batch": gpt.batch(cfg, a["batch"], seed=1)}
    if a["phase"] == "memory":
        method, peaks = M.least_window_peaks(a["rows"], lambda row: _build(row, a, rank))
        return {"peak_method": method, "peak_bytes": peaks, "steady_peak_bytes": _steady_peaks(a, rank)}
    steps, states, timelines = {}, {}, {}
    for row in a["rows"]:
        timelines[row] = []
        t0 = time.perf_counter()
        steps[row], states[row] = _build(row, a, rank, timelines[row])
        states[row]["first_s"] = time.perf_counter() - t0
    for tl in timelines.values():
        tl.clear()
    times = M.timed_interleaved(steps, a["warmup"], a["iters"])
    for tl in timelines.values():
        del tl[: len(tl) - a["iters"]]                  # the timed steps' records
    fps = {row: states[row]["fingerprint"]() for row in a["rows"]}
    from sharded import optim
    p, o = a["params"], optim.adamw_init(a["params"])
    for _ in range(1 + a["warmup"] + a["iters"]):
        p, o, loss = reference_step(p, o, *a["batch"], cfg, a["split_at"])
    return {"times": times, "timelines": timelines, "fingerprint": fps,
            "reference": M.functional_fingerprint(loss, p, o),
            "first_s": {row: states[row]["first_s"] for row in a["rows"]}}


# -- the bubble --------------------------------------------------------------------------------

def bubble_of(per_rank_timelines: list[list[dict]], schedule: str, m: int) -> dict:
    """Idle fractions of one row from every rank's records of the timed steps
    (the module docstring's definitions), medians over the steps."""
    from sharded.pipelining import _schedules as S

    n_ranks = len(per_rank_timelines)
    steps = len(per_rank_timelines[0])
    step_idle = {r: [] for r in range(n_ranks)}
    parts = {r: {"busy": [], "before_first_slot": [], "between_slots": [], "after_last_slot": []}
             for r in range(n_ranks)}
    phase_idle = {r: [] for r in range(n_ranks)}
    bubbles, costs = [], {}
    for i in range(steps):
        tls = [per_rank_timelines[r][i] for r in range(n_ranks)]
        start = min(t["start"] for t in tls)
        last = max(s[2] for t in tls for s in t["slots"])
        idle = []
        for r, t in enumerate(tls):
            busy = sum(t1 - t0 for _, t0, t1 in t["slots"])
            sl = t["slots"]
            for k, v in (("busy", busy), ("before_first_slot", sl[0][1] - t["start"]),
                         ("between_slots", sl[-1][2] - sl[0][1] - busy),
                         ("after_last_slot", t["end"] - sl[-1][2])):
                parts[r][k].append(v * 1e3)
            step_idle[r].append(1 - busy / (t["end"] - t["start"]))
            phase_idle[r].append(1 - busy / (last - start))
            idle.append(phase_idle[r][-1])
            for label, t0, t1 in t["slots"]:
                # ours: "F0.3" (kind, stage, micro-batch); torch's rows: "F0"
                costs.setdefault((label[0], int(label[1:].split(".")[0])), []).append(t1 - t0)
        bubbles.append(sum(idle) / len(idle))
    med = statistics.median
    mean = {k: statistics.fmean(v) for k, v in costs.items()}
    f_cost = statistics.fmean([x for (k, _), v in costs.items() if k == "F" for x in v])
    b_cost = statistics.fmean([x for (k, _), v in costs.items() if k == "B" for x in v])
    order = S.order(schedule, n_ranks, m)
    sim = S.simulate(order, n_ranks, m, 1, f_cost=f_cost, b_cost=b_cost)
    # the same order with each stage's own measured F and B (the stages differ: stage 1
    # has the head and the loss); simulate() takes one F and one B cost for all stages
    slots = S._run(order, n_ranks, lambda act, r: mean[(act.kind, act.stage)], lambda dep, r: 0.0)
    makespan = max(end for s in slots.values() for _, _, end in s)
    sim_stage = statistics.fmean(1 - sum(e - b for _, b, e in s) / makespan for s in slots.values())
    theory = S.theory_bubble(schedule, n_ranks, m)
    bubble = med(bubbles)
    return {"bubble": bubble, "theory": theory, "simulated": sim.bubble,
            "simulated_per_stage_costs": sim_stage,
            "bubble_vs_theory": bubble / theory - 1,
            "idle_step_per_rank": [med(step_idle[r]) for r in range(n_ranks)],
            "idle_phase_per_rank": [med(phase_idle[r]) for r in range(n_ranks)],
            # where each rank's step time goes (medians, ms): compute slots, before the
            # first (the prologue; rank 1: waiting for its first input), between them
            # (waits and the runner's own work), after the last (the optimizer tail)
            "step_parts_ms_per_rank": [{k: med(v) for k, v in parts[r].items()} for r in range(n_ranks)],
            "f_slot_ms": f_cost * 1e3, "b_slot_ms": b_cost * 1e3,
            "slot_ms_per_stage": {f"{k}{st}": v * 1e3 for (k, st), v in sorted(mean.items())},
            "slots_per_step": [len(per_rank_timelines[r][0]["slots"]) for r in range(n_ranks)]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    M.gpt_arguments(ap, layers=8, batch=16, seq=32, warmup=2, iters=15)
    ap.set_defaults(d_model=64)          # examples/gpt.py's tiny(): d 64, 4 heads, vocab 256, seq 32
    ap.add_argument("--split-at", type=int, default=None, help="first block of stage 1 (default: layers // 2)")
    ap.add_argument("--microbatches", default="4,8")
    ap.add_argument("--schedules", default="GPipe,1F1B")
    ap.add_argument("--sides", default=",".join(SIDES))
    ap.add_argument("--no-memory", dest="memory", action="store_false", help="skip the peak-memory phase")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "pipeline.json"))
    args = ap.parse_args(argv)
    if args.world != 2:
        raise SystemExit("bench_pipeline: pp=2, world 2 only (stage 0 and stage 1 modules)")
    a = {k: getattr(args, k) for k in ("vocab", "d_model", "heads", "layers", "batch", "seq",
                                       "warmup", "iters")}
    a["split_at"] = args.layers // 2 if args.split_at is None else args.split_at
    ms = [int(x) for x in args.microbatches.split(",") if x]
    schedules = [s for s in args.schedules.split(",") if s]
    sides = [s for s in args.sides.split(",") if s]
    a["rows"] = [f"{side}_{s}_m{m}" for s in schedules for m in ms for side in sides]

    t0 = time.perf_counter()
    per_rank = launch(_rank_main, args.world, {**a, "phase": "time"}, backend="gloo")
    memory = (launch(_rank_main, args.world, {**a, "phase": "memory"}, backend="gloo")
              if args.memory else None)
    wall = time.perf_counter() - t0
    threads = max(1, (os.cpu_count() or 1) // args.world)
    rows = a["rows"]
    ms_row = {r: max(statistics.median(pr["times"][r]) for pr in per_rank) * 1e3 for r in rows}
    peak = {r: max(mr["peak_bytes"][r] for mr in memory) for r in rows} if memory else {}
    peak_per_rank = {r: [mr["peak_bytes"][r] for mr in memory] for r in rows} if memory else {}
    steady = {r: [mr["steady_peak_bytes"][r] for mr in memory] for r in rows} if memory else {}
    bubbles = {r: bubble_of([pr["timelines"][r] for pr in per_rank], _parse(r)[1], _parse(r)[2])
               for r in rows}
    ref, fps = per_rank[0]["reference"], per_rank[0]["fingerprint"]
    checked = M.same_work(fps, ref)
    n = ref["step"]
    pairs = {}
    for s in schedules:
        for m in ms:
            o, t = f"ours_{s}_m{m}", f"torch_{s}_m{m}"
            if o in ms_row and t in ms_row:
                pairs[f"{s} m={m}"] = {
                    "time_ratio": ms_row[o] / ms_row[t],
                    "peak_ratio": peak[o] / peak[t] if peak else None,
                    "peak_ratio_per_rank": ([x / y for x, y in zip(peak_per_rank[o], peak_per_rank[t])]
                                            if peak else None),
                    "steady_peak_ratio": max(steady[o]) / max(steady[t]) if steady else None,
                    "bubble_ours": bubbles[o]["bubble"], "bubble_torch": bubbles[t]["bubble"]}

    print(f"\ngpt d {a['d_model']}, {a['layers']} layers (split before block {a['split_at']}), "
          f"batch {a['batch']} x {a['seq']}, vocab {a['vocab']}; pp=2 on gloo, {threads} thread(s)/rank; "
          f"median of {a['iters']} interleaved rounds after {a['warmup']} warm-up")
    if memory:
        print(f"peak memory per rank: {memory[0]['peak_method']} (benchmarks/_models.py)")
    print(f"{'row':<18}{'ms/step':>9}{'peak MiB r0/r1':>16}{'bubble':>8}{'theory':>8}{'sim':>7}{'sim/st':>8}"
          f"{'idle step r0/r1':>17}{'F ms':>7}{'B ms':>7}{f'loss@{n}':>9}{'same work':>11}")
    for r in rows:
        b = bubbles[r]
        mib = "/".join(f"{x / 2**20:.1f}" for x in peak_per_rank[r]) if peak else "-"
        ok = "DIFFERENT" if checked[r]["failures"] else f"{checked[r]['max_rel_diff']:.0e}"
        print(f"{r:<18}{ms_row[r]:>9.1f}{mib:>16}{b['bubble']:>8.3f}{b['theory']:>8.3f}{b['simulated']:>7.3f}"
              f"{b['simulated_per_stage_costs']:>8.3f}"
              f"{'/'.join(f'{x:.2f}' for x in b['idle_step_per_rank']):>17}{b['f_slot_ms']:>7.2f}"
              f"{b['b_slot_ms']:>7.2f}{fps[r]['loss']:>9.4f}{ok:>11}")
    print("step parts per rank, ms (compute slots | before the first | between | after the last):")
    for r in rows:
        print(f"  {r:<16}" + "   ".join(
            " | ".join(f"{v:.1f}" for v in p.values()) for p in bubbles[r]["step_parts_ms_per_rank"]))
    if steady:
        print("steady step peak above the held state, MiB r0/r1: " + ", ".join(
            f"{r} {'/'.join(f'{x / 2**20:.1f}' for x in steady[r])}" for r in rows))
    print(f"same work: each row's state after {n} steps against one device's (tolerance {M.SAME_WORK_RTOL:g})")
    for k, v in pairs.items():
        pr = (f", peak memory {v['peak_ratio']:.2f} (per rank "
              + "/".join(f"{x:.2f}" for x in v["peak_ratio_per_rank"]) + ")") if v["peak_ratio"] else ""
        sr = f", steady step peak {v['steady_peak_ratio']:.2f}" if v["steady_peak_ratio"] else ""
        print(f"ours/torch {k}: time {v['time_ratio']:.2f}{pr}{sr}")
    result = {"benchmark": "pipeline", "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "torch": torch.__version__, "git": git_rev(), "world_size": args.world,
              "threads_per_rank": threads, "cpu_count": os.cpu_count(), "config": a,
              "median_ms": ms_row, "peak_bytes": peak, "peak_bytes_per_rank": peak_per_rank,
              "steady_peak_bytes_per_rank": steady,
              "peak_method": memory[0]["peak_method"] if memory else None,
              "ratios_ours_over_torch": pairs, "bubble": bubbles,
              "first_step_s": {r: max(pr["first_s"][r] for pr in per_rank) for r in rows},
              "same_work": {"rtol": M.SAME_WORK_RTOL, "steps": n, "reference": ref, "rows": fps,
                            "checked": checked},
              "times_ms_per_rank": {r: [[t * 1e3 for t in pr["times"][r]] for pr in per_rank] for r in rows},
              "wall_s": wall}
    write_result(args.out, result, f"{wall:.0f} s")
    M.require_same_work(fps, ref, "bench_pipeline")


if __name__ == "__main__":
    main()
