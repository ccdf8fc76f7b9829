"""Per-rank action orders of pipeline schedules, their check, a simulator and theory.

An order maps each rank to the compute actions it runs, in run order: ``Action("F",
stage, mb)`` (forward of micro-batch ``mb`` through ``stage``) and ``Action("B", stage,
mb)`` (its full backward). The zero-bubble schedules (``ZERO_BUBBLE``, Qi et al. 2023,
arXiv 2401.10241) cut each backward in two: ``Action("I", stage, mb)``, the backward for
the stage's input (the gradient sent to the previous stage), and ``Action("W", stage,
mb)``, the backward for its weights, which they run later to fill the bubble; their
orders have no "B".

There are ``n_stages = n_ranks * virtual`` stages. :func:`stage_ranks` gives the rank of
each: ``s % n_ranks`` for every schedule but ZBVZeroBubble (torch's looped placement,
``generate_stage_to_rank_mapping(style="loop")``); ZBVZeroBubble has exactly two stages
a rank in a V (``style="v"``): stage ``s`` on rank ``s`` for ``s < n_ranks`` and on rank
``2 * n_ranks - 1 - s`` otherwise. :func:`check`, :func:`simulate` and
:func:`transfers` take that list as ``placement`` (None: looped).

The orders are those of ``torch.distributed.pipelining`` (torch 2.13): GPipe,
Interleaved1F1B, LoopedBFS, InterleavedZeroBubble and ZBVZeroBubble are read from
torch's tables; 1F1B is the order torch's runtime ``Schedule1F1B._step_microbatches``
executes (its table is wrong, see :func:`_one_f_one_b`). Every order is checked by
:func:`check` before it is returned.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

from sharded import _torch

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble",
             "ZBVZeroBubble")
# the schedules whose backward is split into "I" and "W" actions
ZERO_BUBBLE = ("InterleavedZeroBubble", "ZBVZeroBubble")

# torch's class names, accepted by normalize()
_TORCH_NAMES = {
    "ScheduleGPipe": "GPipe",
    "Schedule1F1B": "1F1B",
    "ScheduleInterleaved1F1B": "Interleaved1F1B",
    "ScheduleLoopedBFS": "LoopedBFS",
    "ScheduleInterleavedZeroBubble": "InterleavedZeroBubble",
    "ScheduleZBVZeroBubble": "ZBVZeroBubble",
}
_BY_LOWER = {n.lower(): n for n in SCHEDULES} | {k.lower(): v for k, v in _TORCH_NAMES.items()}
# the schedules with any number (virtual >= 1) of looped stages a rank; ZBVZeroBubble
# has exactly 2 a rank, the others 1
_MULTI_STAGE = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")
_V_SHAPED = ("ZBVZeroBubble",)
_KINDS = ("F", "B", "I", "W")


class Action(NamedTuple):
    """One compute slot: ``kind`` "F" (forward), "B" (full backward), "I" (backward for
    the input) or "W" (backward for the weights) of micro-batch ``mb`` through
    ``stage``."""

    kind: str
    stage: int
    mb: int

    def __str__(self) -> str:
        return f"{self.kind}{self.stage}.{self.mb}"


Order = dict[int, list[Action]]


class Transfer(NamedTuple):
    """One item of a rank's run: kind "recv F", "F", "send F", "recv B", "B", "send B",
    "recv I", "I", "send I" or "W" for ``(stage, mb)``; ``peer`` is the other rank of a
    send/receive, None for compute."""

    kind: str
    stage: int
    mb: int
    peer: int | None


@dataclasses.dataclass
class Timeline:
    """A simulated run: per-rank ``slots`` of ``(action, start, end)``, the
    ``makespan``, each rank's busy time, its idle fraction ``1 - busy / makespan`` and
    ``bubble``, the mean idle fraction over ranks."""

    makespan: float
    per_rank_busy: dict[int, float]
    idle_fraction: dict[int, float]
    bubble: float
    slots: dict[int, list[tuple[Action, float, float]]]


def normalize(name: str) -> str:
    """The canonical name (one of ``SCHEDULES``) of a schedule named case-insensitively
    by it or by torch's class name (``ScheduleInterleaved1F1B``); ValueError otherwise."""
    canonical = _BY_LOWER.get(name.lower()) if isinstance(name, str) else None
    if canonical is None:
        raise ValueError(
            f"unknown pipeline schedule {name!r}; accepted (case-insensitive): "
            f"{', '.join(SCHEDULES)} or torch's {', '.join(_TORCH_NAMES)}")
    return canonical


def _owner(stage: int, n_ranks: int, placement: Sequence[int] | None = None) -> int:
    return stage % n_ranks if placement is None else placement[stage]


def _validate_sizes(schedule: str, n_ranks: int, n_microbatches: int, virtual: int) -> None:
    for arg, value in (("n_ranks", n_ranks), ("n_microbatches", n_microbatches),
                       ("virtual", virtual)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{schedule}: {arg} must be an int >= 1, got {value!r}")
    if schedule in _V_SHAPED:
        if virtual != 2:
            raise ValueError(
                f"{schedule} runs exactly 2 stages per rank (a V: stage s and "
                f"2*n_ranks-1-s on rank s), so virtual must be 2 (got {virtual})")
    elif virtual != 1 and schedule not in _MULTI_STAGE:
        raise ValueError(
            f"{schedule} runs one stage per rank, so virtual must be 1 (got {virtual}); "
            f"schedules with several stages per rank (virtual >= 1): {', '.join(_MULTI_STAGE)}"
            f" (and {', '.join(_V_SHAPED)}: virtual = 2)")


def stage_ranks(schedule: str, n_ranks: int, virtual: int = 1) -> list[int]:
    """The rank of each of the ``n_ranks * virtual`` stages of ``schedule``: looped
    (stage ``s`` on rank ``s % n_ranks``) for every schedule but ZBVZeroBubble, whose V
    puts stage ``s`` on rank ``s`` for ``s < n_ranks`` and on ``2 * n_ranks - 1 - s``
    otherwise (torch's ``generate_stage_to_rank_mapping`` styles "loop" and "v")."""
    name = normalize(schedule)
    for arg, value in (("n_ranks", n_ranks), ("virtual", virtual)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: {arg} must be an int >= 1, got {value!r}")
    if name in _V_SHAPED:
        if virtual != 2:
            raise ValueError(f"{name} runs exactly 2 stages per rank, so virtual must be 2 "
                             f"(got {virtual})")
        return [s if s < n_ranks else 2 * n_ranks - 1 - s for s in range(2 * n_ranks)]
    return [s % n_ranks for s in range(n_ranks * virtual)]


def order(schedule: str, n_ranks: int, n_microbatches: int, virtual: int = 1) -> Order:
    """Each rank's compute actions, in run order, for ``schedule`` on ``n_ranks`` ranks
    with ``n_microbatches`` micro-batches and ``virtual`` stages per rank (checked by
    :func:`check` with the schedule's :func:`stage_ranks`). The zero-bubble schedules
    (``ZERO_BUBBLE``) use "F", "I" and "W" actions, the others "F" and "B";
    ZBVZeroBubble needs ``virtual=2``."""
    name = normalize(schedule)
    _validate_sizes(name, n_ranks, n_microbatches, virtual)
    if name == "1F1B":
        result = _one_f_one_b(n_ranks, n_microbatches)
    else:
        table = _torch_pipeline_order(name, n_ranks, n_microbatches, virtual)
        result = {rank: [a for a in table.get(rank, []) if a is not None]
                  for rank in range(n_ranks)}
    check(result, n_ranks, n_microbatches, virtual,
          placement=stage_ranks(name, n_ranks, virtual))
    return result


def _one_f_one_b(n_ranks: int, n_microbatches: int) -> Order:
    """1F1B as torch's runtime ``Schedule1F1B._step_microbatches`` runs it: stage ``s``
    does ``min(m, n_stages - s)`` warm-up forwards, then "1B1F" (one backward, then one
    forward while forwards remain), then the remaining backwards.

    Not torch's ``Schedule1F1B._get_pipeline_order()`` (torch 2.13): with no warm-up
    forward (``num_forward = p - 1 - rank`` is 0 on the last rank) its ``forward_mb``
    stays 0 and is incremented before its first use, so the last rank's table starts at
    F1 and ends at F{m} (p=2, m=4, rank 1: 1F1 1B0 1F2 1B1 1F3 1B2 1F4 1B3), missing
    F0 and naming a micro-batch that does not exist. The runtime has no such bug.
    """
    result: Order = {}
    for stage in range(n_ranks):
        warmup = min(n_microbatches, n_ranks - stage)
        actions = [Action("F", stage, mb) for mb in range(warmup)]
        fwd, bwd = warmup, 0
        while True:  # 1B1F
            actions.append(Action("B", stage, bwd))
            bwd += 1
            if fwd == n_microbatches:
                break
            actions.append(Action("F", stage, fwd))
            fwd += 1
        actions += [Action("B", stage, mb) for mb in range(bwd, n_microbatches)]
        result[stage] = actions
    return result


def _torch_pipeline_order(schedule: str, n_ranks: int, n_microbatches: int,
                          virtual: int) -> dict[int, list[Action | None]]:
    """torch's compute table for ``schedule`` (any of ``SCHEDULES``) as
    :class:`Action` lists; ``None`` marks an idle slot or a non-compute action (the
    table itself: ``_torch.pipeline_schedule_table``)."""
    try:
        table = _torch.pipeline_schedule_table(schedule, n_ranks, n_microbatches, virtual)
    except ValueError as exc:
        if schedule in ("GPipe", "1F1B", "ZBVZeroBubble"):
            raise
        rounds = max(1, n_microbatches // n_ranks)
        works = [m for m in range(1, 4 * n_ranks + 1) if m % max(1, m // n_ranks) == 0]
        raise ValueError(
            f"{schedule} with n_ranks={n_ranks}, n_microbatches={n_microbatches}: "
            f"torch needs n_microbatches to be a multiple of its number of rounds "
            f"max(1, n_microbatches // n_ranks) = {rounds}; that holds for any "
            f"n_microbatches below {2 * n_ranks} and any multiple of n_ranks (up to "
            f"{4 * n_ranks}: {works}). torch said: {exc}") from exc
    return {rank: [None if a is None else Action(*a) for a in row] for rank, row in table.items()}



_Grad = Mapping[tuple[int, int], str]


def _deps(action: Action, n_stages: int, grad: _Grad | None = None) -> list[Action]:
    """The actions ``action`` waits for: F(s, mb) on F(s-1, mb); B(s, mb) and I(s, mb) on
    F(s, mb) and the input gradient of stage s+1 (none past the last stage), which is
    ``grad[(s+1, mb)]`` of that stage ("B" or "I"; "B" when not given); W(s, mb) on
    I(s, mb)."""
    kind, s, mb = action
    if kind == "F":
        return [Action("F", s - 1, mb)] if s > 0 else []
    if kind == "W":
        return [Action("I", s, mb)]
    deps = [Action("F", s, mb)]
    if s < n_stages - 1:
        deps.append(Action((grad or {}).get((s + 1, mb), "B"), s + 1, mb))
    return deps


def check(order: Mapping[int, Sequence[Action]], n_ranks: int, n_microbatches: int,
          virtual: int, *, placement: Sequence[int] | None = None) -> None:
    """Raise RuntimeError unless, for every (stage, mb), F appears exactly once and its
    backward exactly once, either as one B or (zero-bubble) as one I and one W, each on
    the rank that owns the stage (``placement[stage]``; None: ``stage % n_ranks``), and
    the ranks, each running its list in order, finish without deadlock (the message
    names each stuck rank and what it waits on)."""
    n_stages = n_ranks * virtual
    if set(order) != set(range(n_ranks)):
        raise RuntimeError(f"order has ranks {sorted(order)}, expected 0..{n_ranks - 1}")
    if placement is not None and (len(placement) != n_stages
                                  or any(not 0 <= r < n_ranks for r in placement)):
        raise RuntimeError(f"placement {list(placement)} is not a rank in 0..{n_ranks - 1} "
                           f"for each of the {n_stages} stages")
    seen: dict[Action, int] = {}
    for rank, actions in order.items():
        for a in actions:
            if (not isinstance(a, tuple) or len(a) != 3 or a[0] not in _KINDS
                    or not 0 <= a[1] < n_stages or not 0 <= a[2] < n_microbatches):
                raise RuntimeError(
                    f"rank {rank}: {a!r} is not an F/B/I/W action of a stage in "
                    f"0..{n_stages - 1} and a micro-batch in 0..{n_microbatches - 1}")
            a = Action(*a)
            owner = _owner(a.stage, n_ranks, placement)
            if owner != rank:
                raise RuntimeError(f"rank {rank} runs {a}, but stage {a.stage} lives on "
                                   f"rank {owner}")
            if a in seen:
                raise RuntimeError(f"{a} appears twice (rank {rank})")
            seen[a] = rank
    split = any(a.kind in "IW" for a in seen)
    missing: list[Action] = []
    grad: dict[tuple[int, int], str] = {}
    for s in range(n_stages):
        for mb in range(n_microbatches):
            has = {k for k in _KINDS if Action(k, s, mb) in seen}
            if "B" in has and has & {"I", "W"}:
                raise RuntimeError(
                    f"stage {s} micro-batch {mb} has both a full backward B{s}.{mb} and "
                    f"a split one ({' '.join(f'{k}{s}.{mb}' for k in 'IW' if k in has)})")
            want = "FIW" if has & {"I", "W"} or ("B" not in has and split) else "FB"
            missing += [Action(k, s, mb) for k in want if k not in has]
            grad[(s, mb)] = "B" if "B" in has else "I"
    if missing:
        missing.sort(key=lambda a: (_KINDS.index(a.kind), a.stage, a.mb))
        raise RuntimeError(f"order misses {len(missing)} action(s): "
                           f"{' '.join(map(str, missing[:10]))}")
    _run(order, n_stages, lambda a, r: 0.0, lambda dep, r: 0.0, grad)


def _grads(order: Mapping[int, Sequence[Action]]) -> dict[tuple[int, int], str]:
    """(stage, mb) -> the kind ("B" or "I") of its input-gradient action in ``order``."""
    return {(a[1], a[2]): a[0] for acts in order.values() for a in acts if a[0] in "BI"}


def _run(order: Mapping[int, Sequence[Action]], n_stages: int,
         cost: Callable[[Action, int], float],
         link: Callable[[Action, int], float],
         grad: _Grad | None = None) -> dict[int, list[tuple[Action, float, float]]]:
    """Run each rank's list in order; an action starts when its rank is free and each
    dependency (:func:`_deps` with ``grad``) has ended (plus ``link(dep, rank)``).
    RuntimeError on deadlock."""
    done: dict[Action, float] = {}
    pos = {rank: 0 for rank in order}
    free = {rank: 0.0 for rank in order}
    slots: dict[int, list[tuple[Action, float, float]]] = {rank: [] for rank in order}
    remaining = sum(len(v) for v in order.values())
    while remaining:
        progressed = False
        for rank, actions in order.items():
            while pos[rank] < len(actions):
                a = Action(*actions[pos[rank]])
                deps = _deps(a, n_stages, grad)
                if any(d not in done for d in deps):
                    break
                start = max([free[rank]] + [done[d] + link(d, rank) for d in deps])
                end = start + cost(a, rank)
                done[a] = end
                free[rank] = end
                slots[rank].append((a, start, end))
                pos[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            waits = []
            for rank, actions in order.items():
                if pos[rank] < len(actions):
                    a = Action(*actions[pos[rank]])
                    need = [str(d) for d in _deps(a, n_stages, grad) if d not in done]
                    waits.append(f"rank {rank} at {a} waits for {', '.join(need)}")
            raise RuntimeError("pipeline order deadlocks: " + "; ".join(waits))
    return slots


def simulate(order: Mapping[int, Sequence[Action]], n_ranks: int, n_microbatches: int,
             virtual: int, f_cost: float = 1.0, b_cost: float = 2.0,
             p2p_cost: float = 0.0, i_cost: float | None = None,
             w_cost: float | None = None, *,
             placement: Sequence[int] | None = None) -> Timeline:
    """Event-driven run of ``order``: each action takes ``f_cost`` (F), ``b_cost`` (B),
    ``i_cost`` (I) or ``w_cost`` (W; each of these two ``b_cost / 2`` when None) and
    starts at the latest of its rank being free and each dependency's end (plus
    ``p2p_cost`` when the dependency ran on another rank, by ``placement``; None:
    stage ``s`` on rank ``s % n_ranks``)."""
    check(order, n_ranks, n_microbatches, virtual, placement=placement)
    costs = {"F": f_cost, "B": b_cost,
             "I": b_cost / 2 if i_cost is None else i_cost,
             "W": b_cost / 2 if w_cost is None else w_cost}
    slots = _run(
        order, n_ranks * virtual,
        lambda a, r: costs[a.kind],
        lambda dep, r: p2p_cost if _owner(dep.stage, n_ranks, placement) != r else 0.0,
        _grads(order))
    makespan = max((end for s in slots.values() for _, _, end in s), default=0.0)
    busy = {r: sum(end - start for _, start, end in s) for r, s in slots.items()}
    idle = {r: (1.0 - b / makespan) if makespan > 0 else 0.0 for r, b in busy.items()}
    bubble = sum(idle.values()) / len(idle) if idle else 0.0
    return Timeline(makespan, busy, idle, bubble, slots)


def theory_bubble(schedule: str, n_ranks: int, n_microbatches: int, virtual: int = 1) -> float:
    """The idle fraction of each rank by the usual analysis, with p = n_ranks, m =
    n_microbatches, v = virtual: (p-1)/(m+p-1) for GPipe and 1F1B; (p-1)/(v*m+p-1) for
    Interleaved1F1B and LoopedBFS; (p-1)/(3*v*m+p-1) for InterleavedZeroBubble and
    ZBVZeroBubble (v = 2), see below.

    The fill and drain take (p-1) stage-steps of forward plus backward on every rank and
    the work is m (GPipe, 1F1B) or v*m (v stages a rank, each 1/v of the model) of them.
    Interleaved1F1B: Narayanan et al. 2021 (arXiv 2104.04473, section 2.2.2), bubble
    time fraction (p-1)/(v*m) of the work, i.e. (p-1)/(v*m+p-1) of the makespan.
    LoopedBFS: Lamy-Poirier 2022 (arXiv 2211.05953) gives breadth-first the same bubble
    as depth-first (interleaved) looping; both formulas assume m >= p for v > 1 (with
    m < p a rank also idles between its loops, which this formula leaves out).

    The zero-bubble schedules assume equal costs of a stage's F, I and W (1 each, so a
    stage's work per micro-batch is 3): InterleavedZeroBubble (p-1)/(3*v*m+p-1),
    ZBVZeroBubble (p-1)/(6*m+p-1) (v = 2), i.e. every rank idles p-1 stage-forwards
    whatever m. For v = 1 this is ZB-H1 of Qi et al. 2023 (arXiv 2401.10241, section
    3): bubble (p-1)(T_F+T_B-T_W) with T_B the input backward, p-1 forwards with equal
    costs, a third of 1F1B's (p-1)(T_F+T_B+T_W). For v > 1 and for ZBV the formula is
    not the paper's (which calls ZB-V's bubble about zero with equal costs): it is
    what :func:`simulate` measures on torch's actual orders (f = i = w = 1, free
    point-to-point), exactly, for every m >= p (InterleavedZeroBubble) and every
    m >= 2p (ZBVZeroBubble); for fewer micro-batches the simulated bubble is larger
    and the formula a lower bound.
    """
    name = normalize(schedule)
    _validate_sizes(name, n_ranks, n_microbatches, virtual)
    p, m, v = n_ranks, n_microbatches, virtual
    if name in ZERO_BUBBLE:
        return (p - 1) / (3 * v * m + p - 1)
    return (p - 1) / (v * m + p - 1)


def format_order(order: Mapping[int, Sequence[Action]]) -> str:
    """One line per rank: ``rank 0: F0.0 F0.1 B0.0 ...`` (kind, stage.mb)."""
    return "\n".join(f"rank {rank}: " + " ".join(str(Action(*a)) for a in order[rank])
                     for rank in sorted(order))


def _num(x: float) -> str:
    return f"{x:g}"


def format_timeline(timeline: Timeline) -> str:
    """One line per rank, its slots in time order as ``F0.1[1-2]`` with idle gaps as
    ``.(2)``, then the makespan and bubble."""
    lines = []
    for rank in sorted(timeline.slots):
        items, t = [], 0.0
        for a, start, end in timeline.slots[rank]:
            if start > t:
                items.append(f".({_num(start - t)})")
            items.append(f"{a}[{_num(start)}-{_num(end)}]")
            t = end
        if timeline.makespan > t:
            items.append(f".({_num(timeline.makespan - t)})")
        lines.append(f"rank {rank}: " + " ".join(items)
                     + f"  idle {timeline.idle_fraction[rank]:.3f}")
    lines.append(f"makespan {_num(timeline.makespan)}, bubble {timeline.bubble:.4f}")
    return "\n".join(lines)


def transfers(order: Mapping[int, Sequence[Action]], n_ranks: int,
              virtual: int, *, placement: Sequence[int] | None = None
              ) -> dict[int, list[Transfer]]:
    """Each rank's run in order with its point-to-point traffic: "recv F" from the
    previous stage's rank before an F, "send F" to the next stage's rank after it;
    "recv B" / "recv I" from the next stage's rank before a B / an I (the gradient for
    the stage's output, sent by that stage's B or I), "send B" / "send I" to the
    previous stage's rank after it; a W neither sends nor receives. Only where the
    neighbour stage lives on another rank: stages are placed by ``placement`` (None:
    stage ``s`` on rank ``s % n_ranks``), and between two stages on one rank (the tip
    of ZBVZeroBubble's V, stages p-1 and p) there is no message. ValueError when an
    action is on a rank that does not own its stage."""
    n_stages = n_ranks * virtual
    result: dict[int, list[Transfer]] = {}
    for rank in sorted(order):
        items: list[Transfer] = []
        for a in order[rank]:
            kind, s, mb = a
            if _owner(s, n_ranks, placement) != rank:
                raise ValueError(
                    f"rank {rank} runs {Action(*a)}, but stage {s} lives on rank "
                    f"{_owner(s, n_ranks, placement)} (placement "
                    f"{'looped' if placement is None else list(placement)})")
            if kind == "W":
                items.append(Transfer(kind, s, mb, None))
                continue
            src, dst = (s - 1, s + 1) if kind == "F" else (s + 1, s - 1)
            if 0 <= src < n_stages and _owner(src, n_ranks, placement) != rank:
                items.append(Transfer(f"recv {kind}", s, mb, _owner(src, n_ranks, placement)))
            items.append(Transfer(kind, s, mb, None))
            if 0 <= dst < n_stages and _owner(dst, n_ranks, placement) != rank:
                items.append(Transfer(f"send {kind}", s, mb, _owner(dst, n_ranks, placement)))
        result[rank] = items
    return result


def format_transfers(listing: Mapping[int, Sequence[Transfer]]) -> str:
    """One line per rank, e.g. ``rank 1: recv F1.0<-r0 F1.0 send F1.0->r2 ...``."""
    lines = []
    for rank in sorted(listing):
        items = []
        for t in listing[rank]:
            if t.peer is None:
                items.append(f"{t.kind}{t.stage}.{t.mb}")
            else:
                arrow = "<-" if t.kind.startswith("recv") else "->"
                items.append(f"{t.kind}{t.stage}.{t.mb}{arrow}r{t.peer}")
        lines.append(f"rank {rank}: " + " ".join(items))
    return "\n".join(lines)
