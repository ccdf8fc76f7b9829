"""Cut one rank's program of a pipelined train step into the pieces a schedule runs.

# NOTE [Pipeline pieces]
pjit traces the whole train step once, with ``pipeline(loss_fn)`` standing for ONE
micro-batch (``sharded::microbatch`` gives the first micro-batch's rows), and the mode
lowers it for this rank as it lowers any step (the "pp" axis is replicated: nothing is
laid out over it, so the program is the one every pp rank would run with the whole
model). The marks then say what each node is:

- **per micro-batch** (``mb``): what depends on a micro-batch's rows or on the
  loss's gradient seed (``pipeline_output_grad``): the forward (``F``) and the
  backward (``B``) of the micro-batch;
- **after the micro-batches** (``tail``): what reads the pipelined function's loss
  (``pipeline_output``) or a parameter's gradient (``pipeline_input_grad``): the
  optimizer, the returned loss. These values are the mean over the micro-batches
  (a gradient still pending a reduction is summed locally first, then reduced once);
- **before** (``pre``): the rest, computed once per step where needed: a parameter's
  all-gather, its cast, constants.

Stages: ``pipe_split`` raises the stage of what follows it (the forward takes the
largest stage of its inputs), ``pipe_split_grad`` lowers it (the backward of stage k
starts where the gradient crosses the split back); a tail node runs on the stage of
its largest input (a parameter's update on the parameter's stage), list ops over
several stages' tensors (a fused optimizer, the global norm) are cut per stage first.
A value one rank computes and another reads is sent once (``Transfer``). Each piece is
a GraphModule; ``Split`` lists them per stage (``F``/``B``), per rank (``pre``) and per
round of the tail (a round ends where a value crosses ranks).
"""

from __future__ import annotations

import operator
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from sharded import _torch
from sharded._registry import META_PATH
from sharded.pipelining import _markers as M
from sharded.pipelining import _schedules
from sharded.pipelining._api import PipelineConfig

PRE, MB, TAIL = "pre", "mb", "tail"


class PipelineError(ValueError):
    """A pipelined step that cannot be cut into stages (raised while lowering, on
    every rank, before anything is communicated)."""


@dataclass
class Piece:
    """One compiled unit: ``graph`` takes ``inputs`` (node names of the full program)
    and returns ``outputs`` (node names)."""

    name: str
    graph: fx.GraphModule
    inputs: list[str]
    outputs: list[str]
    per_microbatch: bool = False


@dataclass
class Split:
    config: PipelineConfig
    n_stages: int
    n_ranks: int
    stage_of: dict[str, int | None]          # node name -> stage (None: anywhere)
    zone_of: dict[str, str]
    phase_of: dict[str, str]                 # mb nodes: "F" / "B"
    kind_of: dict[str, str] = field(default_factory=dict)   # mb nodes: F, B (or I / W)
    pieces: dict[str, dict[int, Piece]] = field(default_factory=dict)   # kind -> stage -> piece
    pre: Piece | None = None                 # this rank's
    tail: list[Piece] = field(default_factory=list)   # this rank's, per round
    accumulate: dict[str, str] = field(default_factory=dict)   # boundary node -> its mb input
    means: set = field(default_factory=set)      # boundary nodes averaged (the loss); others summed
    microbatch_inputs: dict[str, str] = field(default_factory=dict)   # microbatch node -> placeholder
    placeholders: list[str] = field(default_factory=list)
    outputs: list = field(default_factory=list)       # output args (node names or constants)
    out_stage: list = field(default_factory=list)     # per output: stage or None
    rank_of_stage: dict[int, int] = field(default_factory=dict)
    boundaries: list = field(default_factory=list)    # chosen split indices
    param_stage: dict[str, int] = field(default_factory=dict)   # placeholder -> stage
    tail_round: dict[str, int] = field(default_factory=dict)    # tail node -> its round
    tail_needed: dict[int, set] = field(default_factory=dict)   # rank -> tail nodes it computes

    def rank_of(self, node: str) -> int | None:
        """The pp rank that computes ``node`` (None: every rank that reads it)."""
        st = self.stage_of.get(node)
        return None if st is None else self.rank_of_stage[st]

    def mb_pieces(self) -> list[Piece]:
        """This rank's per-micro-batch pieces, by stage then kind."""
        return [t[s] for s in sorted({s for t in self.pieces.values() for s in t})
                for t in self.pieces.values() if s in t]


def _inputs(n: fx.Node) -> list[fx.Node]:
    return list(n.all_input_nodes)


def split_program(gm: fx.GraphModule, n_ranks: int, rank: int,
                  global_numel: dict[str, int] | None = None) -> Split:
    """The pieces of ``gm`` (this rank's program of the whole step, one micro-batch)
    for pp rank ``rank`` of ``n_ranks`` (NOTE [Pipeline pieces]). ``global_numel``:
    each input placeholder's global size, which the even split weighs (a shard's size
    may differ between the ranks of one stage, which must all cut alike)."""
    g = gm.graph
    outs = [n for n in g.nodes if n.op == "call_function" and n.target is M.OUTPUT]
    if len(outs) != 1:
        raise PipelineError(f"a pipelined step must call its pipeline(...) function once; it "
                            f"called {len(outs)}.")
    config = PipelineConfig.parse(outs[0].args[1])
    n_stages = n_ranks * config.virtual
    _untie_seeds(gm)
    _scale_seeds(gm, config.microbatches)

    # -- zones --------------------------------------------------------------------
    zone: dict[str, str] = {}
    phase: dict[str, str] = {}
    for n in g.nodes:
        if n.op in ("placeholder", "output", "get_attr"):
            zone[n.name] = PRE if n.op != "output" else TAIL
            continue
        ins = _inputs(n)
        if n.target in (M.OUTPUT, M.INPUT_GRAD):
            zone[n.name] = TAIL
            continue
        in_tail = any(zone[i.name] == TAIL for i in ins)
        in_mb = n.target in (M.MICROBATCH, M.OUTPUT_GRAD) or any(zone[i.name] == MB for i in ins)
        if in_tail and in_mb:
            raise PipelineError(
                f"{_where(n)} reads both a micro-batch's values and the pipelined "
                f"function's mean result (its loss or a gradient). The gradient of the "
                f"pipelined loss must seed the backward directly: differentiate "
                f"pipeline(loss_fn) itself, scaled by constants only.")
        zone[n.name] = TAIL if in_tail else MB if in_mb else PRE
        if zone[n.name] == MB:
            phase[n.name] = "B" if (n.target is M.OUTPUT_GRAD or any(
                phase.get(i.name) == "B" for i in ins)) else "F"

    rng_only = _draws_per_microbatch(g, zone, phase)

    # -- stage boundaries: forced splits, or candidates chosen by cost -------------------
    splits = [n for n in g.nodes if n.op == "call_function" and n.target is M.SPLIT]
    forced = sorted({n.args[1] for n in splits if n.args[2]})
    candidates = sorted({n.args[1] for n in splits if not n.args[2]})
    if n_stages == 1:
        chosen = []          # pp=1: one stage, the boundaries inside it (micro-batching stays)
    elif forced:
        chosen = forced
    else:
        chosen = _even_split(g, zone, phase, candidates, n_stages, global_numel or {})
    if len(chosen) + 1 != n_stages:
        raise PipelineError(
            f"the pipelined function has {len(chosen) + 1} stages ({len(chosen)} pipe_split "
            f"boundaries) but the mesh's {config.axis!r} axis has {n_ranks} ranks x "
            f"{config.virtual} virtual stages = {n_stages} stages; "
            + ("add or remove pipe_split calls, or change virtual_stages." if forced else
               f"there are too few blocks to split into {n_stages} stages."))
    rank_of_stage = dict(enumerate(_schedules.stage_ranks(config.schedule, n_ranks, config.virtual)))
    step_of = {idx: k + 1 for k, idx in enumerate(chosen)}

    # -- stages of the micro-batch nodes --------------------------------------------
    stage: dict[str, int | None] = {}
    for n in g.nodes:
        if zone[n.name] != MB:
            continue
        staged: list[int] = [v_ for v_ in (stage.get(i.name) for i in _inputs(n) if zone[i.name] == MB)
                             if v_ is not None]
        st: int | None = max(staged) if staged else None
        index: Any = n.args[1] if len(n.args) > 1 else None
        if n.target is M.MICROBATCH:
            st = None
        elif n.target is M.SPLIT and index in step_of:
            prev = 0 if st is None else st
            st = step_of[index]
            if prev != st - 1:
                raise PipelineError(f"pipe_split boundary {index} is crossed from stage {prev}; "
                                    f"the splits must be crossed in order.")
        elif n.target is M.SPLIT_GRAD and index in step_of:
            st = step_of[index] - 1
        elif phase[n.name] == "F" and st is None:
            # read from the batch: the first stage's; from random draws only: anywhere
            if any(zone[i.name] == MB and i.name not in rng_only for i in _inputs(n)):
                st = 0
            elif n.name not in rng_only and any(zone[i.name] == MB for i in _inputs(n)):
                rng_only.add(n.name)
        stage[n.name] = st

    # -- the stages of the values before: the stage of their readers ---------------------
    # (through stage-less micro-batch values too: a weight read through its dropout)
    readers: dict[str, set] = defaultdict(set)
    for n in reversed(list(g.nodes)):
        if zone[n.name] == MB:
            mine = {stage[n.name]} if stage[n.name] is not None else readers[n.name]
        elif zone[n.name] == PRE:
            mine = readers[n.name]
        else:
            continue
        for i in _inputs(n):
            if zone[i.name] == PRE or (zone[i.name] == MB and stage.get(i.name) is None):
                readers[i.name] |= mine
    param_stage: dict[str, int] = {}
    for n in g.nodes:
        if n.op == "call_function" and n.target is M.INPUT:
            rs = readers[n.name]
            if len(rs) > 1:
                raise PipelineError(
                    f"{_path(n.args[0])} is read by stages {sorted(rs)}: a parameter belongs to "
                    f"one stage (tied weights, or a value used after a pipe_split without "
                    f"passing through it). Untie it, or keep all its uses in one stage.")
            if rs:
                owner_stage = next(iter(rs))
                stage[n.name] = owner_stage
                param_stage[_arg_node(n, 0).name] = owner_stage

    empty = sorted(set(range(n_stages)) - set(param_stage.values()))
    if empty:
        raise PipelineError(
            f"pipeline stage(s) {empty} of {n_stages} read no parameters (two pipe_split "
            f"boundaries with no block between them, or a split after the last block?); "
            f"every stage must hold parameters. Move the pipe_split calls (boundaries at "
            f"{chosen}).")

    # -- the owners of the values before: a parameter's view or cast is its stage's -----
    def owner(x):
        st_ = stage.get(x.name)
        return param_stage.get(x.name) if st_ is None and x.op == "placeholder" else st_

    for n in g.nodes:
        if zone[n.name] == PRE and n.op == "call_function" and stage.get(n.name) is None:
            ss = {owner(i) for i in _inputs(n)} - {None}
            if len(ss) == 1:
                stage[n.name] = ss.pop()

    # -- the tail: list ops cut per stage, then each node on its largest input's stage -----
    for n in list(g.nodes):
        if getattr(n, "_erased", False) or zone.get(n.name) != TAIL or n.op == "output" \
                or n.name in stage:
            continue
        if n.target is M.INPUT_GRAD:
            marker = _input_marker(g, n.args[1])
            stage[n.name] = stage.get(marker.name) if marker is not None else None
            continue
        if _is_list_op(n) and _cut_list_op(g, n, zone, stage, owner):
            continue
        # the stage of its input of most dims (a parameter's update, not the clipping
        # factor it is scaled by), the later stage on a tie: dims, not sizes, so that
        # every rank cuts alike (a shard's size may differ from rank to rank)
        best, s_ = -1, None
        for i in _inputs(n):
            si = owner(i)
            if si is None:
                continue
            dims = _ndim(i)
            if dims > best or (dims == best and si > (s_ if s_ is not None else -1)):
                best, s_ = dims, si
        stage[n.name] = s_
    for n in g.nodes:
        stage.setdefault(n.name, None)
    # a gradient that no micro-batch value feeds (a parameter's data-free loss term):
    # computed on the parameter's stage, in its backward piece
    for n in g.nodes:
        if n.op == "call_function" and n.target in (M.INPUT_GRAD, M.OUTPUT):
            x = _arg_node(n, 0)
            if zone.get(x.name) == MB and stage.get(x.name) is None:
                stage[x.name] = stage.get(n.name)
                if stage[x.name] is None:
                    raise PipelineError(f"{_where(x)}: the gradient of a parameter no stage "
                                        f"reads; the pipeline cannot place it.")
    out_node = next(n for n in reversed(g.nodes) if n.op == "output")
    out_args = list(out_node.args[0])
    split = Split(config, n_stages, n_ranks, stage, zone, phase, rank_of_stage=rank_of_stage,
                  boundaries=chosen, param_stage=param_stage)
    split.outputs = [a.name if isinstance(a, fx.Node) else a for a in out_args]
    split.out_stage = [(stage.get(a.name) if a.op != "placeholder" else param_stage.get(a.name))
                       if isinstance(a, fx.Node) else None for a in out_args]
    split.placeholders = [n.name for n in g.find_nodes(op="placeholder")]
    for n in g.nodes:
        if n.op == "call_function" and n.target in (M.OUTPUT, M.INPUT_GRAD):
            split.accumulate[n.name] = n.args[0].name
            if n.target is M.OUTPUT:
                split.means.add(n.name)
        if n.op == "call_function" and n.target is M.MICROBATCH:
            split.microbatch_inputs[n.name] = n.args[0].name
    _build_pieces(gm, split, rank)
    return split


def _draws_per_microbatch(g: fx.Graph, zone: dict, phase: dict) -> set[str]:
    """Random draws that a micro-batch's values read are the micro-batch's own: a draw
    reads only the seed and offset inputs, so the zones leave it before the
    micro-batches, where every micro-batch would share one; those (and what is computed
    from them) become per-micro-batch values without a stage, recomputed in each piece
    that reads them at the micro-batch's offset (the forward and the backward of a
    micro-batch draw the same numbers). Returns their names."""
    offset = next((p for p in g.find_nodes(op="placeholder") if p.meta.get(META_PATH) == "rng offset"),
                  None)
    if offset is None:
        return set()
    drawn: set[str] = set()
    for n in g.nodes:
        if n.op == "call_function" and zone[n.name] == PRE and n.target is not M.INPUT and any(
                i is offset or i.name in drawn for i in n.all_input_nodes):
            drawn.add(n.name)      # (not through the function's inputs: drawn once a step)
    feeds: set[str] = set()
    for n in reversed(list(g.nodes)):
        if n.name in drawn and any(zone.get(u.name) == MB or u.name in feeds for u in n.users):
            feeds.add(n.name)
    for n in g.nodes:
        if n.name in feeds:
            after = [u for u in n.users if zone.get(u.name) == TAIL]
            if after:
                raise PipelineError(
                    f"{_where(n)} is a random draw read both by the micro-batches (each draws "
                    f"its own) and after them by {_where(after[0])}; draw it outside the "
                    f"pipelined function and pass it in, or draw twice.")
            zone[n.name], phase[n.name] = MB, "F"
    return feeds


def _arg_node(n: fx.Node, k: int) -> fx.Node:
    """The node ``n`` takes as its argument ``k`` (a mark's input)."""
    a = n.args[k]
    assert isinstance(a, fx.Node), (n, k)
    return a


def _where(n: fx.Node) -> str:
    st = n.meta.get("stack_trace")
    line = st.strip().splitlines()[-1].strip() if st else ""
    return f"{n.name} ({n.target})" + (f" at `{line}`" if line else "")


def _path(n) -> str:
    return n.meta.get(META_PATH, n.name) if isinstance(n, fx.Node) else str(n)


def _numel(n: fx.Node) -> int:
    v = n.meta.get("val")
    return v.numel() if isinstance(v, torch.Tensor) else 0


def _ndim(n: fx.Node) -> int:
    v = n.meta.get("val")
    return v.ndim if isinstance(v, torch.Tensor) else -1


def _input_marker(g: fx.Graph, index: int):
    for n in g.find_nodes(op="call_function", target=M.INPUT):
        if n.args[1] == index:
            return n
    return None


_LIKE = {torch.ops.aten.ones_like.default: 1.0, torch.ops.aten.zeros_like.default: 0.0,
         torch.ops.aten.full_like.default: None}


def _untie_seeds(gm: fx.GraphModule) -> None:
    """``ones_like(loss)`` (the backward's seed) reads only the loss's shape: a
    constant, so the backward does not wait for the mean over micro-batches."""
    g = gm.graph
    for n in list(g.nodes):
        if n.op == "call_function" and n.target in _LIKE:
            val = n.meta.get("val")
            if not isinstance(val, torch.Tensor):
                continue
            fill = _LIKE[n.target]
            fill = n.args[1] if fill is None else fill
            with g.inserting_before(n):
                new = g.call_function(torch.ops.aten.full.default, (list(val.shape), fill),
                                      {"dtype": val.dtype, "layout": val.layout, "device": val.device})
            new.meta.update(n.meta)
            n.replace_all_uses_with(new)
            g.erase_node(n)


def _scale_seeds(gm: fx.GraphModule, m: int) -> None:
    """Each micro-batch's backward starts from the loss's gradient over ``m``: the
    gradients leave the pieces already scaled, as autograd scales each term of a
    mean, and the tail sums them (the loss itself is averaged there)."""
    if m == 1:
        return
    g = gm.graph
    for n in g.find_nodes(op="call_function", target=M.OUTPUT_GRAD):
        seed = n.args[0]
        with g.inserting_before(n):
            scaled = g.call_function(torch.ops.aten.div.Tensor, (seed, m))
        scaled.meta.update(seed.meta)
        n.replace_input_with(seed, scaled)


def _even_split(g, zone, phase, candidates: list[int], n_stages: int,
                global_numel: dict[str, int]) -> list[int]:
    """Choose ``n_stages - 1`` of the candidate boundaries so that the largest stage's
    cost (the parameter elements its forward reads) is as small as it can be."""
    if n_stages == 1:
        return []
    if len(candidates) + 1 < n_stages:
        raise PipelineError(
            f"{n_stages} stages were asked for but the model's {len(candidates)} candidate "
            f"split points (pipe_split(h, auto=True), or blocks=) cut it into only "
            f"{len(candidates) + 1} pieces (more stages than blocks): use fewer pp ranks or "
            f"virtual stages, or a deeper model.")
    seg: dict[str, int] = {}
    counted: set[str] = set()
    cost = [0.0] * (len(candidates) + 1)
    pos = {c: k + 1 for k, c in enumerate(candidates)}
    for n in g.nodes:
        if zone[n.name] != MB or phase[n.name] != "F":
            continue
        ins = [seg[i.name] for i in _inputs(n) if i.name in seg]
        s = max(ins) if ins else 0
        if n.target is M.SPLIT:
            s = pos[n.args[1]]
        seg[n.name] = s
        todo = [i for i in _inputs(n) if zone[i.name] == PRE]
        while todo:        # (a parameter reaches its readers through views and casts)
            i = todo.pop()
            if i.name in counted:
                continue
            counted.add(i.name)
            if i.op == "call_function" and i.target is M.INPUT:
                src = _arg_node(i, 0)
                cost[s] += global_numel.get(src.name, _numel(src))
            else:
                todo.extend(x for x in _inputs(i) if zone[x.name] == PRE)
    # the split that minimizes the largest stage's cost (linear partition, by DP)
    n = len(cost)
    prefix = [0.0]
    for c in cost:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, n_stages + 1):
        for j in range(k, n - (n_stages - k) + 1):
            for c in range(k - 1, j):
                v = max(best[k - 1][c], prefix[j] - prefix[c])
                if v < best[k][j]:
                    best[k][j], cut[k][j] = v, c
    chosen, j = [], n
    for k in range(n_stages, 1, -1):
        j = cut[k][j]
        chosen.append(candidates[j - 1])
    return sorted(chosen)


_FOREACH_PREFIXES = ("_foreach_", "_fused_")


def _is_list_op(n: fx.Node) -> bool:
    name = _torch.op_name(n.target) if n.op == "call_function" else None
    if name is None:
        return False
    return name.split("::")[-1].startswith(_FOREACH_PREFIXES) or name == "sharded::sum_of_squares"


def _cut_list_op(g: fx.Graph, n: fx.Node, zone, stage, owner) -> bool:
    """A list op (a fused optimizer, a foreach op, the global norm's sum of squares)
    over tensors of several stages becomes one op per stage (each given its stage);
    False if ``n`` is within one stage."""
    nargs: Any = n.args
    target: Any = n.target
    lists = [k for k, a in enumerate(nargs) if isinstance(a, (list, tuple)) and a
             and all(isinstance(x, fx.Node) for x in a)]
    if not lists:
        return False
    length = len(nargs[lists[0]])
    per = []
    for j in range(length):
        ss = {owner(nargs[k][j]) for k in lists if j < len(nargs[k])} - {None}
        per.append(max(ss) if ss else None)
    groups = sorted({s for s in per if s is not None})
    if len(groups) <= 1:
        return False
    is_sos = _torch.op_name(n.target) == "sharded::sum_of_squares"
    val: Any = n.meta.get("val")
    nested = isinstance(val, (list, tuple)) and bool(val) and isinstance(val[0], (list, tuple))
    parts = []
    with g.inserting_before(n):
        for s in groups:
            idx = [j for j in range(length) if per[j] == s or (per[j] is None and s == groups[-1])]
            args = [([a[j] for j in idx] if k in lists else a) for k, a in enumerate(nargs)]
            new = g.call_function(target, tuple(args), dict(n.kwargs))
            if is_sos:
                new.meta["val"] = val
            elif nested:
                new.meta["val"] = type(val)(type(v)(v[j] for j in idx) if len(v) == length else v
                                            for v in val)
            elif isinstance(val, (list, tuple)):
                new.meta["val"] = type(val)(val[j] for j in idx)
            zone[new.name], stage[new.name] = TAIL, s
            parts.append((s, idx, new))
    if is_sos:
        with g.inserting_before(n):
            total = parts[0][2]
            for _, _, p in parts[1:]:
                total = g.call_function(torch.ops.aten.add.Tensor, (total, p))
                total.meta["val"] = val
                zone[total.name], stage[total.name] = TAIL, max(groups)
        n.replace_all_uses_with(total)
        g.erase_node(n)
        return True
    where = {j: (s, p, idx.index(j)) for s, idx, p in parts for j in idx}

    def take(user, src, k, s):
        with g.inserting_before(user):
            b = g.call_function(operator.getitem, (src, k))
        b.meta["val"] = src.meta["val"][k]
        zone[b.name], stage[b.name] = TAIL, s
        return b

    for user in list(n.users):
        if user.op != "call_function" or user.target is not operator.getitem:
            raise PipelineError(f"{_where(n)} over several stages is read whole; the "
                                f"pipeline cannot cut it per stage.")
        if nested:
            for user2 in list(user.users):
                if user2.target is not operator.getitem:
                    raise PipelineError(f"{_where(n)} over several stages is read whole; "
                                        f"the pipeline cannot cut it per stage.")
                s, p, j2 = where[int(user2.args[1])]  # type: ignore[arg-type]
                user2.replace_all_uses_with(take(user2, take(user2, p, user.args[1], s), j2, s))
                g.erase_node(user2)
        else:
            s, p, j2 = where[int(user.args[1])]  # type: ignore[arg-type]
            user.replace_all_uses_with(take(user, p, j2, s))
        g.erase_node(user)
    g.erase_node(n)
    return True


# ---------------------------------------------------------------------------
# Pieces
# ---------------------------------------------------------------------------

def _build_pieces(gm: fx.GraphModule, split: Split, rank: int) -> None:
    g = gm.graph
    nodes = {n.name: n for n in g.nodes}
    zone, stage, phase = split.zone_of, split.stage_of, split.phase_of
    mine = {s for s, r in split.rank_of_stage.items() if r == rank}
    _kinds(g, split)
    kinds = ("F", "I", "W") if split.config.schedule in _schedules.ZERO_BUBBLE else ("F", "B")
    kind = split.kind_of
    for k in kinds:
        split.pieces[k] = {}
    for s in sorted(mine):
        for k in kinds:
            core = {n.name for n in g.nodes if zone[n.name] == MB and stage[n.name] == s
                    and kind.get(n.name) == k}
            # stage-less micro-batch values (a backward's constants, a view of the
            # targets) are computed in every piece that reads them
            todo = [nodes[x] for x in core]
            while todo:
                for i in _inputs(todo.pop()):
                    if zone[i.name] == MB and stage[i.name] is None and i.target is not M.MICROBATCH \
                            and i.name not in core:
                        core.add(i.name)
                        todo.append(i)
            members = [n for n in g.nodes if n.name in core]
            split.pieces[k][s] = _piece(gm, f"{k}{s}", members, per_mb=True)
    # the tail, in rounds: a value read on another rank than the one computing it ends
    # a round
    rnd: dict[str, int] = {}
    for n in g.nodes:
        if zone[n.name] != TAIL or n.op == "output" or n.name in split.accumulate:
            if n.name in split.accumulate:
                rnd[n.name] = 0
            continue
        r = 0
        for i in _inputs(n):
            if zone[i.name] == TAIL and i.name in rnd:
                ri, rn = split.rank_of(i.name), split.rank_of(n.name)
                far = ri is not None and rn is not None and ri != rn
                r = max(r, rnd[i.name] + (1 if far else 0))
        rnd[n.name] = r
    split.tail_round = rnd
    n_rounds = max(rnd.values(), default=0) + 1
    split.tail_needed = {r: _needed_here(g, split, r) for r in range(split.n_ranks)}
    tail_needed = split.tail_needed[rank]
    for t in range(n_rounds):
        members = [n for n in g.nodes if zone[n.name] == TAIL and n.op != "output"
                   and n.name not in split.accumulate and rnd.get(n.name) == t
                   and n.name in tail_needed]
        split.tail.append(_piece(gm, f"tail{t}", members, per_mb=False))
    # the values before, this rank's: what its pieces read
    need: set[str] = set()
    for p in [*split.mb_pieces(), *split.tail]:
        need.update(p.inputs)
        need.update(split.microbatch_inputs[x] for x in p.inputs if x in split.microbatch_inputs)
    for name, s in zip(split.outputs, split.out_stage):      # (outputs computed before)
        if isinstance(name, str) and zone[name] == PRE and (s is None or split.rank_of_stage[s] == rank):
            need.add(name)
    pre_members = _closure_pre(g, zone, need)
    split.pre = _piece(gm, "pre", pre_members, per_mb=False)


def _kinds(g: fx.Graph, split: Split) -> None:
    """Each micro-batch node's piece kind: "F" or "B"; under a zero-bubble schedule a
    stage's backward is cut in two (Qi et al. 2023): "I", what the gradient it sends to
    the previous stage needs, and "W", the rest (its parameters' gradients), which the
    schedule may run later to fill the bubble."""
    zone, stage, phase = split.zone_of, split.stage_of, split.phase_of
    zb = split.config.schedule in _schedules.ZERO_BUBBLE
    for n in g.nodes:
        if zone[n.name] == MB:
            split.kind_of[n.name] = phase[n.name] if not zb or phase[n.name] == "F" else "W"
    if not zb:
        return
    byname = {n.name: n for n in g.nodes}
    todo = [n for n in g.nodes if zone[n.name] == MB and phase[n.name] == "B"
            and stage[n.name] is not None
            and any(zone.get(u.name) == MB and stage.get(u.name) not in (None, stage[n.name])
                    for u in n.users)]
    while todo:
        n = todo.pop()
        if split.kind_of[n.name] == "I":
            continue
        split.kind_of[n.name] = "I"
        todo.extend(i for i in _inputs(byname[n.name]) if zone[i.name] == MB and phase[i.name] == "B"
                    and stage[i.name] in (stage[n.name], None))


def _needed_here(g, split: Split, rank: int) -> set[str]:
    """The tail nodes rank ``rank`` computes: those on its stages, the outputs it
    returns that belong to no stage, and the stage-less tail nodes these read."""
    zone, stage = split.zone_of, split.stage_of
    byname = {n.name: n for n in g.nodes}
    here = {n.name for n in g.nodes if zone[n.name] == TAIL and n.op != "output"
            and n.name not in split.accumulate and split.rank_of(n.name) == rank}
    out_node = next(n for n in reversed(g.nodes) if n.op == "output")
    here |= {a.name for a in out_node.args[0] if isinstance(a, fx.Node) and zone[a.name] == TAIL
             and stage.get(a.name) is None and a.name not in split.accumulate}
    todo = list(here)
    while todo:
        for i in _inputs(byname[todo.pop()]):
            if zone[i.name] == TAIL and stage[i.name] is None and i.name not in here \
                    and i.name not in split.accumulate:
                here.add(i.name)
                todo.append(i.name)
    return here


def _closure_pre(g, zone, need: set[str]) -> list[fx.Node]:
    byname = {n.name: n for n in g.nodes}
    take: set[str] = set()
    todo = [x for x in need if x in byname and zone[x] == PRE and byname[x].op != "placeholder"]
    while todo:
        name = todo.pop()
        if name in take:
            continue
        take.add(name)
        for i in _inputs(byname[name]):
            if zone[i.name] == PRE and i.op != "placeholder":
                todo.append(i.name)
    return [n for n in g.nodes if n.name in take]


_IDENTITY_MARKS = (M.SPLIT, M.SPLIT_GRAD, M.INPUT, M.INPUT_GRAD, M.OUTPUT, M.OUTPUT_GRAD)


def _piece(gm, name: str, members: list[fx.Node], *, per_mb: bool) -> Piece:
    """A GraphModule of ``members`` (in program order): its inputs are the values they
    read from outside, its outputs the values read outside (or returned)."""
    inside = {n.name for n in members}
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}
    inputs: list[str] = []
    for n in members:                 # (placeholders first: passes expect them on top)
        for x in _inputs(n):
            if x.name not in inside and x.name not in env:
                ph = graph.placeholder(x.name)
                ph.meta.update({k: v for k, v in x.meta.items()
                                if k in ("val", "tensor_meta", META_PATH)})
                env[x.name] = ph
                inputs.append(x.name)
    for n in members:
        if n.op == "call_function" and n.target in _IDENTITY_MARKS:
            env[n.name] = env[_arg_node(n, 0).name]   # (a mark is the identity: no copy)
            continue
        env[n.name] = graph.node_copy(n, lambda x: env[x.name])
    outputs = [n.name for n in members
               if any(u.name not in inside for u in n.users)]
    graph.output(tuple(env[o] for o in outputs))
    return Piece(name, fx.GraphModule(gm, graph), inputs, outputs, per_microbatch=per_mb)
