"""Run a pipelined step on one rank: its pieces in the schedule's order, the values
that cross ranks sent point to point over the pipeline axis's process group.

# NOTE [Pipeline messages]
Every rank knows every rank's order and which values each piece sends where (the cut
is the same on every rank), so a receiver posts its receives from a given sender in
exactly the order that sender sends: messages between two ranks are matched by order
(NCCL ignores tags), never by a tag. A send is posted as soon as its value is computed
and waited at the end of the step; a receive is posted when the value is first needed
(with the earlier messages from the same sender still pending before it), and
``AHEAD`` receives per sender are kept posted from then on, so that a message lands
while this rank computes.
"""

from __future__ import annotations

import time
from collections import defaultdict, deque
from typing import Any

import torch
import torch.distributed as dist

from sharded import _torch, sync
from sharded.pipelining._markers import MICROBATCH
from sharded.pipelining._schedules import Action
from sharded.pipelining._split import MB, TAIL, Split

_LAST_TIMELINE: list = []
AHEAD = 2          # receives kept posted per sender (NOTE [Pipeline messages])

# NOTE [Pipeline memory]
# A micro-batch's values live from the piece that computes them to the last piece on
# this rank that reads them, and no longer: the runtime drops its own references to a
# piece's inputs before the call when that piece is their last reader, a micro-batch
# piece (run as a graph) takes its inputs boxed (one list it empties as it goes), so a
# backward frees each residual at its last use inside it, as autograd frees what it
# saved, and the loop forgets the last action's outputs before the next one (a
# backward's whole gradient would otherwise live through the next forward, the last
# one's through the optimizer). A finished send's buffer is dropped at the next send.


def last_timeline() -> dict:
    """The compute slots of this process's last pipelined step: ``{"start": t0, "end":
    t1, "slots": [(label, start, end), ...]}`` (perf_counter seconds), or {} before
    any step. For measuring the bubble (benchmarks/bench_pipeline.py)."""
    return dict(_LAST_TIMELINE[-1]) if _LAST_TIMELINE else {}


class Plan:
    """What every rank sends to every other, in order (NOTE [Pipeline messages])."""

    def __init__(self, split: Split, order: dict[int, list[Action]], graph_nodes: dict,
                 tail_needed: dict[int, set]):
        self.split = split
        zone, stage = split.zone_of, split.stage_of
        rank_of = split.rank_of_stage
        # mb values: the ranks that read each (by their readers' stages)
        self.mb_readers: dict[str, set[int]] = defaultdict(set)
        for name, node in graph_nodes.items():
            if zone.get(name) != MB or node.target is MICROBATCH:
                continue
            for u in node.users:
                su = stage.get(u.name)
                if zone.get(u.name) in (MB, TAIL) and su is not None:
                    self.mb_readers[name].add(rank_of[su])
        self.producer_rank = {name: rank_of[s] for name, s in stage.items() if s is not None}
        # per (stage, phase): the values it sends, in program order
        self.sends_of: dict[tuple, list[tuple[str, int]]] = defaultdict(list)
        for name, node in graph_nodes.items():
            st = stage.get(name)
            if zone.get(name) != MB or st is None:
                continue
            for dst in sorted(self.mb_readers.get(name, ())):
                if dst != rank_of[st]:
                    self.sends_of[(st, split.kind_of[name])].append((name, dst))
        # the messages each pair exchanges, in the sender's order (F/B first, then tail)
        self.queue: dict[tuple[int, int], list[tuple[str, int | None]]] = defaultdict(list)
        for src, actions in order.items():
            for a in actions:
                for name, dst in self.sends_of.get((a.stage, a.kind), ()):
                    self.queue[(src, dst)].append((name, a.mb))
        # tail values: read on another rank than the one computing them
        self.tail_sends: dict[int, list[tuple[str, int]]] = defaultdict(list)   # round -> (name, dst)
        rnd = split.tail_round
        for name, node in graph_nodes.items():
            src_ = split.rank_of(name)
            if zone.get(name) != TAIL or node.op == "output" or src_ is None:
                continue
            src = src_
            for dst, needed in tail_needed.items():
                if dst == src:
                    continue
                if any(u.name in needed for u in node.users):
                    self.tail_sends[rnd[name]].append((name, dst))
        # scalar outputs owned by one stage (the loss): sent to every other rank as soon
        # as they are computed (-1: after the micro-batches; t: after tail round t),
        # after that round's tail messages
        self.out_sends: dict[int, list[tuple[str, int]]] = defaultdict(list)
        seen = set()
        for name, s in zip(split.outputs, split.out_stage):
            if isinstance(name, str) and s is not None and name not in seen and _is_scalar(graph_nodes[name]):
                seen.add(name)
                when = -1 if name in split.accumulate else rnd.get(name, 0)
                for dst in range(split.n_ranks):
                    if dst != rank_of[s]:
                        self.out_sends[when].append((name, dst))
        rounds = sorted(set(self.tail_sends) | set(self.out_sends) | {-1})
        for t in rounds:       # (the order the runtime sends them: NOTE [Pipeline messages])
            for name, dst in self.tail_sends.get(t, ()):
                self.queue[(self.producer_rank[name], dst)].append((name, None))
            for name, dst in self.out_sends.get(t, ()):
                self.queue[(self.producer_rank[name], dst)].append((name, None))


def _has_collective(runner) -> bool:
    graph = runner.graph if isinstance(runner, torch.fx.GraphModule) else runner.graph.graph
    return any(n.op == "call_function" and n.target in _torch.COLLECTIVE_OPS for n in graph.nodes)


def _is_scalar(node) -> bool:
    """0-d (the loss): dims, not sizes, so every rank decides alike."""
    v = node.meta.get("val")
    return isinstance(v, torch.Tensor) and v.ndim == 0


class PipelineRunner:
    """Runs this rank's pieces for one step (``__call__(*inputs) -> outputs``)."""

    def __init__(self, split: Split, plan: Plan, order: dict[int, list[Action]], rank: int,
                 group, metas: dict[str, Any], offset_name: str | None, n_draws: int,
                 runners: dict[str, Any]):
        self.split, self.plan, self.rank, self.group = split, plan, rank, group
        self.actions = order[rank]
        self.metas = metas                  # node name -> local fake value (for buffers)
        self.offset_name, self.n_draws = offset_name, n_draws
        self.runners = runners              # piece name -> callable
        self.boxed = {n for n, r in runners.items() if _torch.is_boxed(r)}
        # the pieces that communicate (a collective inside): the agreement comes first
        self.communicating = {name for name, r in runners.items() if _has_collective(r)}
        self.m = split.config.microbatches
        mine = split.mb_pieces()
        # local uses of each mb value (to free it after its last reader)
        self.uses: dict[str, int] = defaultdict(int)
        for p in mine:
            for x in p.inputs:
                if split.zone_of.get(x) == MB:
                    self.uses[x] += 1
        acc_of: dict[str, list[str]] = defaultdict(list)   # mb value -> boundary nodes
        for b, x in split.accumulate.items():
            acc_of[x].append(b)
        # per piece, computed once: where each argument comes from (0: computed before
        # the micro-batches, 1: this micro-batch's, made here, received, or its rows of a
        # batch argument; 2: the random offset of this micro-batch), which outputs are
        # summed into a gradient, and which micro-batch values it is the last to read
        self.arg_plan: dict[str, list] = {}
        self.acc_plan: dict[str, list] = {}
        self.free_plan: dict[str, list] = {}
        self.last_plan: dict[str, list] = {}
        for p in mine:
            plan_ = []
            for x in p.inputs:
                if split.zone_of.get(x) == MB:
                    plan_.append((1, x, split.microbatch_inputs.get(x)))
                elif x == offset_name:
                    plan_.append((2, x, None))
                else:
                    plan_.append((0, x, None))
            self.arg_plan[p.name] = plan_
            self.acc_plan[p.name] = [(k, b) for k, name in enumerate(p.outputs) for b in acc_of.get(name, ())]
            self.free_plan[p.name] = [(x, self.uses[x]) for x in p.inputs if split.zone_of.get(x) == MB] \
                + [(x, 1) for x in p.outputs if not self.uses.get(x)]
            self.last_plan[p.name] = [(x, self.uses[x]) for x in p.inputs if split.zone_of.get(x) == MB]

    # -- messages -------------------------------------------------------------------
    def _send(self, value: torch.Tensor, dst: int) -> None:
        self._before()
        self._sent = [s_ for s_ in self._sent if not s_[0].is_completed()]   # (their buffers go)
        t = value.detach()
        if not t.is_contiguous():
            t = t.contiguous()
        self._sent.append((dist.isend(t, group=self.group, group_dst=dst), t))

    def _post(self, src: int) -> None:
        """Post the next receive from ``src``, in the order it sends."""
        name, mb = self._expected[src].popleft()
        meta = self.metas[name]
        buf = torch.empty(meta.shape, dtype=meta.dtype, device=self.device)
        self._posted[(name, mb)] = (dist.irecv(buf, group=self.group, group_src=src), buf)
        self._ahead[src] += 1

    def _post_ahead(self) -> None:
        """Keep ``AHEAD`` receives posted per sender, so a message lands while this
        rank computes (once the call's agreement is checked)."""
        if self._agreement is not None:
            return
        for src, q in self._expected.items():
            while q and self._ahead[src] < AHEAD:
                self._post(src)

    def _recv(self, name: str, mb: int | None, src: int) -> torch.Tensor:
        self._before()
        key = (name, mb)
        while key not in self._posted:
            self._post(src)
        work, buf = self._posted.pop(key)
        self._ahead[src] -= 1
        self._post_ahead()
        work.wait()
        return buf

    def _send_round(self, t: int, env: dict) -> None:
        plan = self.plan
        for table in (plan.tail_sends, plan.out_sends):
            for name, dst in table.get(t, ()):
                if plan.producer_rank[name] == self.rank:
                    self._send(env[name], dst)

    def _before(self, piece: str | None = None) -> None:
        """The call's cross-rank agreement, checked before this rank's first message
        or collective (NOTE [The agreement overlaps the program] in sharded/sync.py)."""
        if self._agreement is not None and (piece is None or piece in self.communicating):
            agreement, self._agreement = self._agreement, None
            sync.agreed(agreement)

    # -- one step -------------------------------------------------------------------
    _agreement: Any = None        # the call's, until checked (_before)
    _sent: list = []              # (work, buffer) of this step's sends not yet waited

    def __call__(self, *inputs, agreement=None):
        split, plan = self.split, self.plan
        self._agreement = agreement
        t_start = time.perf_counter()
        slots: list = []
        self._sent: list = []
        self._posted: dict = {}
        self._ahead: dict[int, int] = defaultdict(int)
        self._expected = {src: deque(plan.queue.get((src, self.rank), ()))
                          for src in range(split.n_ranks)}
        env: dict[str, Any] = dict(zip(split.placeholders, inputs))
        base_offset = env.get(self.offset_name) if self.offset_name else None
        if base_offset is not None:     # (micro-batch j draws at base + j d; the rest after)
            env[self.offset_name] = base_offset + self.m * self.n_draws
        self.device = next((x.device for x in inputs if isinstance(x, torch.Tensor)),
                           torch.device("cpu"))
        pre = split.pre
        if pre is not None and pre.outputs:
            self._before("pre")
            env.update(zip(pre.outputs, self.runners["pre"](*[env[i] for i in pre.inputs])))
        mbenv: dict[tuple[str, int], Any] = {}
        left: dict[tuple[str, int], int] = {}
        acc: dict[str, Any] = {}
        owned: set[str] = set()
        runners = self.runners
        for a in self.actions:
            piece = split.pieces[a.kind][a.stage]
            mb = a.mb
            args = []
            for kind, x, aux in self.arg_plan[piece.name]:
                if kind == 0:
                    args.append(env[x])
                elif kind == 1:
                    v = mbenv.get((x, mb))
                    if v is None:
                        v = mbenv[(x, mb)] = (env[aux].chunk(self.m)[mb] if aux is not None
                                              else self._recv(x, mb, plan.producer_rank[x]))
                    args.append(v)
                else:
                    args.append(base_offset + mb * self.n_draws)
            v = None                    # (NOTE [Pipeline memory]: no extra reference)
            if self._agreement is not None:
                self._before(piece.name)
            for x, uses in self.last_plan[piece.name]:      # (NOTE [Pipeline memory])
                if left.get((x, mb), uses) <= 1:
                    mbenv.pop((x, mb), None)
            t0 = time.perf_counter()
            outs = runners[piece.name](args) if piece.name in self.boxed else runners[piece.name](*args)
            slots.append((a, t0, time.perf_counter()))
            for name, v in zip(piece.outputs, outs):
                mbenv[(name, mb)] = v
            sends = plan.sends_of.get((a.stage, a.kind))
            if sends:
                for name, dst in sends:
                    self._send(mbenv[(name, mb)], dst)
            self._post_ahead()
            for k, b in self.acc_plan[piece.name]:
                v = outs[k]
                if b not in acc:
                    acc[b] = v                    # (the piece's; not ours to write)
                elif b in owned:
                    acc[b].add_(v)
                else:
                    acc[b] = acc[b] + v
                    owned.add(b)
            # free what no later piece here reads (sends hold their own reference)
            for x, uses in self.free_plan[piece.name]:
                key = (x, mb)
                n = left.get(key, uses) - 1
                if n <= 0:
                    mbenv.pop(key, None)
                    left.pop(key, None)
                else:
                    left[key] = n
            outs = v = args = None      # (else they live through the next action)
        for b, v in acc.items():      # (gradients arrive scaled: _scale_seeds)
            env[b] = v / self.m if self.m > 1 and b in split.means else v
        self._send_round(-1, env)
        for t, piece in enumerate(split.tail):
            args = []
            for x in piece.inputs:
                if x not in env:
                    env[x] = self._recv(x, None, plan.producer_rank[x])
                args.append(env[x])
            if piece.outputs:
                self._before(piece.name)
                env.update(zip(piece.outputs, self.runners[piece.name](*args)))
            self._send_round(t, env)
        outs = []
        for name, s in zip(split.outputs, split.out_stage):
            if not isinstance(name, str):
                outs.append(name)
            elif s is None or split.rank_of_stage[s] == self.rank:
                outs.append(env[name])
            elif (name, None) in self._posted or any(n == name for n, _ in self._expected[split.rank_of_stage[s]]):
                env[name] = self._recv(name, None, split.rank_of_stage[s])
                outs.append(env[name])
            elif name in env:
                outs.append(env[name])
            else:
                outs.append(None)
        self._before()
        for work, _ in self._sent:
            work.wait()
        self._sent = []
        _LAST_TIMELINE[:] = [{"start": t_start, "end": time.perf_counter(),
                              "slots": [(f"{a.kind}{a.stage}.{a.mb}", t0, t1) for a, t0, t1 in slots]}]
        return outs


__all__ = ["PipelineRunner", "Plan", "last_timeline"]
