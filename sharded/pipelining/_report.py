"""What ``pjit(step).lower(...)`` shows of a pipelined step (``Lowered.pipeline``):
the schedule with each rank's sends, receives and compute slots, per-stage memory, and
the bubble fraction, all from the cut program (no run, so it works on
``Mesh.abstract`` meshes of any size)."""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.fx as fx

from sharded.pipelining import _schedules
from sharded.pipelining._split import MB, TAIL, Split

_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default,
            torch.ops.aten.baddbmm.default}


def _bytes(n: fx.Node) -> int:
    v = n.meta.get("val")
    return v.numel() * v.element_size() if isinstance(v, torch.Tensor) else 0


def _flops(n: fx.Node) -> float:
    """2·M·N·K of a matmul node (the compute that dominates a block), else 0."""
    if n.op != "call_function" or n.target not in _MATMULS:
        return 0.0
    out = n.meta.get("val")
    a = n.args[1] if n.target in (torch.ops.aten.addmm.default, torch.ops.aten.baddbmm.default) else n.args[0]
    av = a.meta.get("val") if isinstance(a, fx.Node) else None
    if not isinstance(out, torch.Tensor) or not isinstance(av, torch.Tensor):
        return 0.0
    return 2.0 * out.numel() * av.shape[-1]


def report(split: Split, order: dict, graph: fx.GraphModule) -> dict:
    """``{"schedule", "stages": [{stage, rank, state_bytes, activation_bytes_per_microbatch,
    forward_flops, backward_flops}], "ranks": [{rank, stages, state_bytes,
    peak_in_flight, activation_bytes_peak, bytes_estimate}], "bubble_theory",
    "bubble_simulated", "transfers": text}``; bytes are this rank's shard sizes
    (each pp rank's dp/tp shard is the same size)."""
    cfg = split.config
    zone, stage, phase = split.zone_of, split.stage_of, split.phase_of
    S = split.n_stages
    state = [0] * S
    act = [0] * S
    fflops = [0.0] * S
    bflops = [0.0] * S
    owner_of_placeholder: dict[str, int] = dict(split.param_stage)
    for n in graph.graph.nodes:
        s = stage.get(n.name)
        if n.op == "placeholder" or s is None:
            continue
        if zone.get(n.name) == TAIL:
            for i in n.all_input_nodes:
                if i.op == "placeholder" and i.name not in owner_of_placeholder:
                    owner_of_placeholder[i.name] = s
        if zone.get(n.name) == MB:
            (fflops if phase[n.name] == "F" else bflops)[s] += _flops(n)
            if phase[n.name] == "F" and any(phase.get(u.name) == "B" for u in n.users):
                act[s] += _bytes(n)            # kept for the backward
    for n in graph.graph.find_nodes(op="placeholder"):
        s = owner_of_placeholder.get(n.name)
        if s is not None:
            state[s] += _bytes(n)
    stages = [{"stage": s, "rank": split.rank_of_stage[s], "state_bytes": state[s],
               "activation_bytes_per_microbatch": act[s], "forward_flops": fflops[s],
               "backward_flops": bflops[s]} for s in range(S)]
    ranks = []
    for r, actions in sorted(order.items()):
        live: dict[int, int] = defaultdict(int)
        peak_bytes, peak_mb = 0, 0
        for a in actions:
            live[a.stage] += 1 if a.kind == "F" else -1 if a.kind in ("B", "W") else 0
            now = sum(k * act[s] for s, k in live.items())
            peak_bytes = max(peak_bytes, now)
            peak_mb = max(peak_mb, sum(live.values()))
        mine = [s for s in range(S) if split.rank_of_stage[s] == r]
        st_bytes = sum(state[s] for s in mine)
        ranks.append({"rank": r, "stages": mine, "state_bytes": st_bytes,
                      "peak_in_flight": peak_mb, "activation_bytes_peak": peak_bytes,
                      "bytes_estimate": st_bytes + peak_bytes})
    f = max(sum(fflops) / S, 1.0)
    b = max(sum(bflops) / S, 1.0)
    placement = [split.rank_of_stage[s] for s in range(S)]
    sim = _schedules.simulate(order, split.n_ranks, cfg.microbatches, cfg.virtual,
                              f_cost=1.0, b_cost=b / f, placement=placement)
    return {
        "schedule": cfg.schedule, "pp": split.n_ranks, "virtual_stages": cfg.virtual,
        "microbatches": cfg.microbatches, "n_stages": S, "boundaries": list(split.boundaries),
        "stages": stages, "ranks": ranks,
        "bubble_theory": _schedules.theory_bubble(cfg.schedule, split.n_ranks, cfg.microbatches,
                                                  cfg.virtual),
        "bubble_simulated": sim.bubble,
        "transfers": _schedules.format_transfers(_schedules.transfers(order, split.n_ranks, cfg.virtual,
                                                                      placement=placement)),
    }


def format_report(rep: dict) -> str:
    """``report`` as text: the schedule, stages, ranks and each rank's slots."""
    mib = 2.0 ** 20
    lines = [f"pipeline: {rep['schedule']}, pp={rep['pp']} x {rep['virtual_stages']} virtual = "
             f"{rep['n_stages']} stages, {rep['microbatches']} micro-batches; bubble "
             f"{rep['bubble_simulated']:.3f} (theory {rep['bubble_theory']:.3f})"]
    for s in rep["stages"]:
        lines.append(f"  stage {s['stage']} on rank {s['rank']}: state {s['state_bytes'] / mib:.2f} MiB, "
                     f"activations {s['activation_bytes_per_microbatch'] / mib:.2f} MiB per "
                     f"micro-batch, {s['forward_flops'] / 1e9:.3f}/{s['backward_flops'] / 1e9:.3f} "
                     f"GFLOP forward/backward")
    for r in rep["ranks"]:
        lines.append(f"  rank {r['rank']}: stages {r['stages']}, up to {r['peak_in_flight']} "
                     f"micro-batches in flight, ~{r['bytes_estimate'] / mib:.2f} MiB "
                     f"(state {r['state_bytes'] / mib:.2f} + activations "
                     f"{r['activation_bytes_peak'] / mib:.2f})")
    lines.append("each rank's receives, compute slots and sends, in order:")
    lines.append(rep["transfers"])
    return "\n".join(lines)
