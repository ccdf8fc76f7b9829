"""Communication passes: bucket collectives, and overlap them with compute.

# NOTE [Bucketing]
A data-parallel step reduces every gradient separately (one collective per
parameter); an FSDP step also gathers every parameter separately. Like DDP's and
FSDP's buckets, consecutive collectives of one kind over the same group, op and dtype
are merged into one collective on a flat concatenation, up to ``bucket_bytes`` (one
open bucket per group, op and dtype: collectives over different groups are
independent streams):

- all_reduce: flatten and concatenate; split the result.
- reduce_scatter (over dim 0 of its input, as the functional op): view each input as
  ``[group_size, -1]`` and concatenate along dim 1, so that row r of the bucket holds
  the blocks that rank r keeps; the result's row splits into each member's block.
- all_gather (into dim 0): flatten and concatenate each rank's blocks; the result,
  viewed as ``[group_size, -1]``, splits along dim 1 into each member's gathered
  blocks.

A reduction bucket (gradients, produced in backward order) is issued where its last
member was, so every input exists, and may only grow while none of its results is
needed yet: buckets leave in backward order and the rest of the backward overlaps
them. A gather bucket (parameters, read in forward or backward order) is issued
where its first member was (the members' inputs, views of parameter shards, are
moved up with it). Ranks run the same passes on the same graph shape, so they issue
the same buckets in the same order.

Buckets of a sharded program also follow *units*, FSDP's per-block wrapping read off
the parameters' pytree paths (``unit_of_path``): ``args[0]['blocks'][3]['attn']['wq']``
belongs to ``args[0]['blocks'][3]``, the block its first list index names, and a
parameter under no list to its argument's root unit (embeddings, final norm). A
*run* is one unit's consecutive collectives (a block's gathers in the forward; its
regathers in the backward). A bucket holds one run, cut by ``bucket_bytes`` if it
is larger, so a block is not split across two buckets; several runs share a
bucket only up to ``PACK_BYTES`` (1 MiB), where a collective's cost is mostly its
latency: small blocks share a bucket, large ones get their own, and gathered weights
are alive about one block at a time, as with FSDP's per-block wrapping. A gather bucket never holds the same parameter twice: the
forward's gather and the backward's regather stay two collectives, and full weights
live from their gather to their last use in that pass, not across the step. (Byte
caps alone once put a small GPT's every gather, forward and backward, into one
bucket, alive for the whole step.) A reduction takes the unit of the latest gather
before it (the block whose backward produced it). A gradient larger than
``PACK_BYTES`` is reduce-scattered as it is, outside any bucket: copied into one, it
and its copy were alive at once (4 MiB more at the MLP 8x1024 step's peak, which
then read 1.07x FSDP2's), and at that size a collective's latency is a small part of
its cost; the smaller gradients around it still share buckets, and it is no member
of their runs (a run that began at it once left its next gradient without a run
size: a GPT of width 768 on 4-way "tp" failed to plan). A reduce-scatter's
input (full-size gradients) lives until its wait; ``bound_reduce_scatters`` waits for
each before the one ``inflight`` places later is issued, so at most ``inflight``
reduce-scatter inputs are alive at once. DataParallelMode keeps one in flight (gloo
runs one group's collectives in order, so the earlier one has usually finished when
the next is issued): on the MLP 8x1024 step two in flight held 4 MiB more at the peak
(80.2 MiB against 76.3-76.7 with one; FSDP2 77.3-79.1) at no measurable speed
(0.69-0.70x FSDP2's step time with one).

torch ships greedy bucketing passes (``torch._inductor.fx_passes.bucketing``); on a
data-parallel GPT step they merge every parameter gather of the step, forward and
backward, into one all-gather at the start (no memory saved) and every gradient into
one reduce-scatter after the backward (no overlap), and leave the graph to be
re-sorted, so the project keeps its own, with these policies.

# NOTE [Overlap]
Functional collectives are asynchronous until ``wait_tensor``. Tracing puts each wait
right after its collective; ``sink_waits`` moves it down to just before the first
use of the result, so compute runs while a collective is in flight.
``prefetch_all_gathers`` moves each gather up to just after the wait of the gather
``ahead`` places before it: the next parameters arrive while this layer computes,
and at most ``ahead + 1`` gathered buckets are alive at once.
"""

from __future__ import annotations

import operator
import re

import torch
import torch.fx as fx

from sharded import _torch
from sharded._torch import POSITIONS as _POS
from sharded.passes.cleanup import _is_pure

_F = _torch.c10d_functional
_ALL_REDUCE = _F.all_reduce.default
_REDUCE_SCATTER = _F.reduce_scatter_tensor.default
_ALL_GATHER = _F.all_gather_into_tensor.default
_WAIT = _torch.WAIT_OP
aten = torch.ops.aten

# 8 MiB: the MLP 8x1024 data-parallel step (32 MiB of gradients) on 2 gloo ranks took
# 92 ms with 25 MiB buckets (two buckets: the second all-reduce waits ~26 ms after the
# backward, measured by the profiler) and 73-75 ms with 1-8 MiB ones (DDP: 82 ms);
# `bench_data_parallel.py --models mlp --modes ddp,pjit_ddp_donated --bucket-mib 25`
# (and 8): 1.16x and 1.01x DDP (benchmarks/README.md).
DEFAULT_BUCKET_BYTES = 8 * 1024 * 1024

# Runs of several units share a bucket only up to this many bytes (NOTE [Bucketing]):
# the MLP 8x1024 "shard" step (4 MiB layers) with two layers per 8 MiB gather bucket
# held 36.9 MiB of temporaries at its peak against FSDP2's 28.7 MiB (per-layer
# gathers); gpt-tiny's whole model (1.6 MiB) in one bucket held 8.6 MiB against 6.7;
# and gpt-tiny's 0.75 MiB blocks each in a bucket of its own took 7 gathers a step
# instead of 3 and 0.92x FSDP2's step time instead of 0.66-0.74x.
PACK_BYTES = 1024 * 1024


def _wait_of(node: fx.Node) -> fx.Node | None:
    for u in node.users:
        if u.target is _WAIT:
            return u
    return None


def _group_size(node: fx.Node) -> int:
    return node.args[-2] if node.target in (_REDUCE_SCATTER, _ALL_GATHER) else 1


def _key(node: fx.Node):
    val = node.args[0].meta.get("val")
    op = node.args[1] if node.target in (_ALL_REDUCE, _REDUCE_SCATTER) else None
    return (node.target, op, node.args[-1], val.dtype, val.device)


def _bucketable(node: fx.Node) -> bool:
    wait = _wait_of(node)
    return (wait is not None and len(node.users) == 1 and bool(wait.users)
            and node.args[0].meta.get("val") is not None)


def bucket_all_reduces(gm: fx.GraphModule, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> fx.GraphModule:
    """Merge consecutive all-reduces (NOTE [Bucketing])."""
    return _bucket(gm, _ALL_REDUCE, bucket_bytes)


def bucket_reduce_scatters(gm: fx.GraphModule, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> fx.GraphModule:
    """Merge consecutive reduce-scatters (NOTE [Bucketing])."""
    return _bucket(gm, _REDUCE_SCATTER, bucket_bytes)


def bucket_all_gathers(gm: fx.GraphModule, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> fx.GraphModule:
    """Merge consecutive all-gathers (NOTE [Bucketing])."""
    return _bucket(gm, _ALL_GATHER, bucket_bytes)


_TOKEN = re.compile(r"\[(?:\d+|'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\")\]|\.\w+")


def unit_of_path(path: str | None) -> str | None:
    """The unit (NOTE [Bucketing]) of a parameter at pytree ``path``: the path up to
    its first list index after the argument's own (``args[0]['blocks'][3]['ln1_w']``
    -> ``args[0]['blocks'][3]``), where a string key's dotted module path counts too
    (``args[0]['blocks.3.attn.wq']``, a ``named_parameters()`` dict -> ``args[0]['blocks.3']``);
    else the argument (``args[0]['wte']`` -> ``args[0]``); None for a name that is no
    pytree path (``residual getitem_3``)."""
    m = re.match(r"[A-Za-z_]\w*", path or "")
    if m is None:
        return None
    tokens = _TOKEN.findall(path[m.end():])
    if not tokens:
        return None
    unit = m.group(0) + tokens[0]
    for tok in tokens[1:]:
        if tok[1:-1].isdigit():
            return unit + tok
        if tok[:2] in ("['", '["'):
            pieces = tok[2:-2].split(".")
            for i, piece in enumerate(pieces[:-1]):
                if piece.isdigit():
                    return unit + tok[:2] + ".".join(pieces[:i + 1]) + tok[-2:]
        unit += tok
    return m.group(0) + tokens[0]


def _source(node) -> fx.Node | None:
    """The input that ``node`` is made of by a chain of pure one-input ops (views,
    copies: a gather's operand, a loss's targets), or None."""
    while isinstance(node, fx.Node) and node.op == "call_function":
        ins = node.all_input_nodes
        if len(ins) != 1 or not _movable_op(node):
            return None
        node = ins[0]
    return node if isinstance(node, fx.Node) and node.op == "placeholder" else None


def _units(nodes: list[fx.Node]) -> dict:
    """``{collective: (unit, source)}``: a gather's unit is its parameter's; a
    reduction's is the unit of the latest gather before it (NOTE [Bucketing])."""
    out: dict = {}
    current = None
    for n in nodes:
        if n.op != "call_function":
            continue
        if n.target is _ALL_GATHER:
            src = _source(n.args[0])
            current = unit_of_path(src.meta.get("sharded_path")) if src is not None else None
            out[n] = (current, src)
        elif n.target in (_ALL_REDUCE, _REDUCE_SCATTER):
            out[n] = (current, None)
    return out


def _bucket(gm: fx.GraphModule, target, bucket_bytes: int) -> fx.GraphModule:
    """One open bucket per (group, op, dtype): collectives over different groups are
    independent streams, so a tensor-parallel all-reduce between two data-parallel
    ones does not end their bucket. Buckets pack whole unit runs, and a gather bucket
    holds each source once (NOTE [Bucketing])."""
    gather = target is _ALL_GATHER
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    units = _units(nodes)
    candidates = [n for n in nodes if n.op == "call_function" and n.target is target]
    sizes = {n: _operand_bytes(n) for n in candidates if _bucketable(n)}
    if target is _REDUCE_SCATTER:
        # larger ones are reduce-scattered as they are, the bucket around them left
        # open, and belong to no run (NOTE [Bucketing])
        candidates = [n for n in candidates if sizes.get(n, 0) <= PACK_BYTES]
    run_bytes = _run_bytes(candidates, sizes, units)
    buckets: list[list[fx.Node]] = []
    open_: dict = {}       # key -> [members, bytes, earliest use of a member's result]

    def flush(k):
        members = open_.pop(k, [[]])[0]
        if len(members) > 1:
            buckets.append(members)

    for n in candidates:
        k = _key(n)
        if n not in sizes:
            flush(k)
            continue
        nbytes = sizes[n]
        unit, src = units[n]
        if k in open_:
            members, size, earliest_use = open_[k]
            new_run = units[members[-1]][0] != unit
            cap = min(bucket_bytes, PACK_BYTES) if new_run else bucket_bytes
            if size + (run_bytes[n] if new_run else nbytes) > cap or (
                    src is not None and any(units[m][1] is src for m in members)) or (
                    not _movable(n.args[0], pos[members[0]], pos) if gather else pos[n] >= earliest_use):
                flush(k)
        members, size, earliest_use = open_.setdefault(k, [[], 0, len(nodes)])
        first_use = min((pos[u] for u in _wait_of(n).users), default=len(nodes))
        open_[k] = [members + [n], size + nbytes, min(earliest_use, first_use)]
    for k in list(open_):
        flush(k)
    buckets.sort(key=lambda b: pos[b[0]])
    for b in buckets:
        _merge(gm, b)
    return gm


def _operand_bytes(n: fx.Node) -> int:
    val = n.args[0].meta["val"]
    return max(val.numel() * val.element_size(), _nbytes(n))


def _run_bytes(candidates: list[fx.Node], sizes: dict, units: dict) -> dict:
    """``{first collective of a run: bytes of the run}``: a run is a maximal sequence
    of one key's bucketable collectives of one unit (one block's gathers in one pass)."""
    out: dict = {}
    last: dict = {}        # key -> (unit, first member of the current run)
    for n in candidates:
        if n not in sizes:
            last.pop(_key(n), None)
            continue
        k, unit = _key(n), units[n][0]
        run = last.get(k)
        if run is None or run[0] != unit:
            run = last[k] = (unit, n)
            out[n] = 0
        out[run[1]] += sizes[n]
    return out


def _movable(node, limit: int, pos: dict) -> bool:
    """Can ``node`` (with the pure ops it needs) be computed before position ``limit``?"""
    if not isinstance(node, fx.Node) or pos[node] < limit or node.op in ("placeholder", "get_attr"):
        return True
    if not _movable_op(node):
        return False
    return all(_movable(a, limit, pos) for a in node.all_input_nodes)


def _nbytes(n: fx.Node) -> int:
    val = n.meta.get("val")
    return val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0


def _merge(gm: fx.GraphModule, bucket: list[fx.Node]) -> None:
    """One collective for ``bucket``; its wait and the unpacking go just before the
    first consumer of any member's result."""
    g = gm.graph
    target = bucket[0].target
    gather = target is _ALL_GATHER
    if gather:       # issued where the first member was; the others' inputs move up
        anchor = bucket[0]
        for n in bucket[1:]:
            move_before(n.args[0], anchor)
    else:
        anchor = bucket[-1]
    n_ranks = _group_size(anchor)
    vals = [n.args[0].meta["val"] for n in bucket]
    outs = [n.meta["val"] for n in bucket]
    waits = [_wait_of(n) for n in bucket]
    first_user = min((u for w in waits for u in w.users), key=_POS.__getitem__)

    def call(fn, args, val):
        node = g.call_function(fn, args)
        node.meta["val"] = val
        return node

    with g.inserting_before(anchor):
        if target is _REDUCE_SCATTER:
            parts = [call(aten.reshape.default, (n.args[0], [n_ranks, -1]),
                          _torch.fake_reshape(v, (n_ranks, -1))) for n, v in zip(bucket, vals)]
            flat = call(aten.cat.default, (parts, 1),
                        _torch.fake_empty(vals[0], (n_ranks, sum(v.numel() for v in vals) // n_ranks)))
        else:
            parts = [call(aten.reshape.default, (n.args[0], [-1]), _torch.fake_reshape(v, (-1,)))
                     for n, v in zip(bucket, vals)]
            flat = call(aten.cat.default, (parts,), _torch.fake_empty(vals[0], (sum(v.numel() for v in vals),)))
        args = (flat,) + tuple(anchor.args[1:])
        # (the functional all-reduce's result is a tensor of its own, not ``flat``:
        # reinplace_foreach makes it ``flat`` where nothing else reads that)
        flat_val = flat.meta["val"]
        out_val = _torch.fake_empty(flat_val, (n_ranks * flat_val.numel(),) if gather else
                                    (1, flat_val.shape[1]) if target is _REDUCE_SCATTER
                                    else tuple(flat_val.shape))
        coll = call(target, args, out_val)
    with g.inserting_before(first_user):
        wait = call(_WAIT, (coll,), out_val)
        if gather:
            rows = call(aten.view.default, (wait, [n_ranks, -1]),
                        _torch.fake_reshape(out_val, (n_ranks, -1)))
            sizes, dim = [v.numel() for v in vals], 1
        else:
            rows = call(aten.view.default, (wait, [-1]), _torch.fake_reshape(out_val, (-1,)))
            sizes = [o.numel() for o in outs]
            dim = 0
        pieces = call(aten.split_with_sizes.default, (rows, sizes, dim), None)
        results = []
        for i, o in enumerate(outs):
            piece = call(operator.getitem, (pieces, i), None)
            results.append(call(aten.reshape.default, (piece, list(o.shape)), o))
    for n, w, r in zip(bucket, waits, results):
        w.replace_all_uses_with(r)
        g.erase_node(w)
        g.erase_node(n)


def _movable_op(n: fx.Node) -> bool:
    """Is ``n`` a pure op that the scheduling passes may move (no collective, wait,
    random or mutating op)?"""
    return (n.op == "call_function" and _is_pure(n.target) and n.target not in _torch.COLLECTIVE_OPS
            and n.target is not _WAIT)


def move_before(node, anchor: fx.Node) -> bool:
    """Move ``node`` (and the pure ops it needs) up to just before ``anchor``, if it is
    not there already; False if something it needs cannot move (a collective, a wait,
    a random or mutating op, or ``anchor`` itself: two micro-batches' targets made from
    one view, moved up to one anchor, ``sharded.optim.accumulate``)."""
    if node is anchor:
        return False
    if not isinstance(node, fx.Node) or _POS[node] < _POS[anchor] or node.op in ("placeholder", "get_attr"):
        return True
    if not _movable_op(node):
        return False
    if not all(move_before(a, anchor) for a in node.all_input_nodes):
        return False
    anchor.prepend(node)
    return True


# NOTE [Reductions as soon as their gradient exists]
# ``hoist_reductions`` moves each all-reduce and reduce-scatter up to where the value
# it reduces can first be computed. A gradient's reduction then sits where the
# backward produced it: the bucketing pass merges consecutive reductions while none
# of their results is read yet, and the rest of the backward overlaps them.
# - A reduction the expansion emitted where an output is laid out (a gradient of
#   pjit's backward program, reduced to its parameter's layout at the end) moves back
#   to where the gradient is produced.
# - A reduction moves with the pure ops that compute its input for it alone (each
#   read only by the next). In ``p - lr * g`` (the update a JAX user writes with
#   tree_map) the gradient travels pending through the scaling, and the expansion
#   reduces it just before the subtraction, in the optimizer's order. Moved alone,
#   each reduction stayed there, each update read its result before the next one was
#   issued, and none merged: 25 all-reduces a step for a 24-tensor GPT under every
#   mode (24 reduce-scatters under "shard"), where ``p - g`` and ``sharded.optim``
#   gave 2.
# - Reductions keep their order: each also goes behind the one before it. The order
#   in which the expansion emits collectives is the same on every rank; where ops sit
#   need not be. Ordered by where their inputs exist instead, the ranks of
#   examples/gpt_train.py's 2x2 large-run step (sequence-parallel over "tp", "shard"
#   over "dp", bf16, remat) issued a "tp" and a "dp" reduce-scatter in opposite
#   orders, and the call stopped with a RankMismatchError. So ``p - lr * g``
#   reduces in the optimizer's order: merged, but a bucket leaves behind the latest
#   gradient among its members and those before them, where ``p - g`` reduces in
#   backward order, overlapped by more of the backward.
# - The ops stay where they are, and the reduction only follows them, where they
#   compute its input from the inputs alone, read directly or through views (a loss's
#   count of targets, which ``count_targets_early`` put halfway through the forward, so that
#   it overlaps the call's agreement: at the start, the agreement would be waited for
#   at once), or from another collective's result (the squares of reduce-scattered
#   gradients summed for a clipped step's global norm: moved up behind that result,
#   they sat between two reduce-scatters of one bucket and split it, 18 a step for 1;
#   NOTE [Chained reductions] places those).

def hoist_reductions(gm: fx.GraphModule) -> fx.GraphModule:
    """Issue each all-reduce and reduce-scatter as soon as its input can be computed
    (NOTE [Reductions as soon as their gradient exists]). Its wait stays where it is.
    Gathers are not hoisted (that would gather every parameter at once;
    ``prefetch_all_gathers`` schedules them)."""
    nodes = list(gm.graph.nodes)
    pos = _POS                  # (current as nodes move: NOTE [Positions in a graph])
    inputs = [n for n in nodes if n.op == "placeholder"]
    anchor = inputs[-1] if inputs else None    # then the previous reduction: order kept
    for n in nodes:
        if n.op != "call_function" or n.target not in (_ALL_REDUCE, _REDUCE_SCATTER):
            continue
        chain = _feeding_chain(n, pos)
        needed = {a for m in (*chain, n) for a in m.all_input_nodes} - set(chain)
        if chain and (all(_source(a) is not None for a in needed)
                      or any(a.target is _WAIT for a in needed)):
            chain, needed = [], set(n.all_input_nodes)     # it stays; the reduction follows
        at = max(needed | ({anchor} if anchor is not None else set()), key=pos.__getitem__)
        if at.op == "placeholder":
            at = inputs[-1]
        anchor = n
        if pos[at] >= pos[n]:
            continue                        # nowhere earlier to go
        for m in (*chain, n):
            if pos[m] > pos[at]:            # (a chain's op already earlier stays)
                at.append(m)
                at = m
    return gm


def _feeding_chain(reduction: fx.Node, pos: dict) -> list[fx.Node]:
    """The pure ops that compute ``reduction``'s input for it alone (each read by the
    next one only: a gradient scaled by the learning rate, viewed, cast), in program
    order; they move with it."""
    chain: set[fx.Node] = set()
    todo = list(reduction.all_input_nodes)
    while todo:
        a = todo.pop()
        if a not in chain and len(a.users) == 1 and _movable_op(a):
            chain.add(a)
            todo.extend(a.all_input_nodes)
    return sorted(chain, key=pos.__getitem__)


def sink_waits(gm: fx.GraphModule) -> fx.GraphModule:
    """Move each ``wait_tensor`` to just before the first use of its result."""
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    for n in nodes:
        if n.op != "call_function" or n.target is not _WAIT or not n.users:
            continue
        first = min(n.users, key=lambda u: pos[u])
        if first is not n.next:
            first.prepend(n)
    return gm


def regather_distant_uses(gm: fx.GraphModule) -> fx.GraphModule:
    """Give a gathered parameter's later uses a gather of their own where another
    unit's gather lies between them and its earlier uses (NOTE [Bucketing]): CSE
    merges the forward's and the backward's gather of a weight that both read as is
    (a layer norm's), and one such use in the backward kept the forward's whole
    bucket alive across the step. This is FSDP's reshard after forward. Run after
    ``cse`` and before bucketing."""
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    units = _units(nodes)
    gathers = [n for n in nodes if n.op == "call_function" and n.target is _ALL_GATHER]
    for g in gathers:
        unit = units[g][0]
        wait = _wait_of(g)
        if unit is None or wait is None or len(g.users) != 1:
            continue
        others = [pos[o] for o in gathers if units[o][0] != unit]
        uses = sorted(wait.users, key=pos.__getitem__)
        current, last = wait, pos[uses[0]]
        for u in uses[1:]:
            if any(last < p < pos[u] for p in others):
                with gm.graph.inserting_before(u):
                    again = gm.graph.call_function(_ALL_GATHER, g.args, g.kwargs)
                    again.meta.update(g.meta)
                    again.meta["val"] = _torch.fake_empty(g.meta["val"], g.meta["val"].shape)  # a buffer of its own
                    current = gm.graph.call_function(_WAIT, (again,))
                    current.meta.update(wait.meta)
                    current.meta["val"] = again.meta["val"]
            if current is not wait:
                u.replace_input_with(wait, current)
            last = pos[u]
    return gm


# NOTE [Chained reductions]
# A pending sum over two data axes reduced to a layout split over one of them (HSDP's
# gradient: Partial on (replicate, shard), its parameter Replicate, Shard) is
# reduce-scattered over the shard axis and the shard then all-reduced over the
# replicate axis (NOTE [HSDP] in data_parallel.py); a sum over two axes of a 3-D mesh
# reduced to replicated (DDP over two axes beside "tp") is two all-reduces in
# sequence. Either way the second reduction reads the first one's result at once,
# which ended every bucket of the first kind after one member (a 2-layer GPT under
# HSDP: 24 reduce-scatters a step). ``defer_chained_reductions`` moves each second
# reduction (with the first one's wait and the views between them) down to where
# the first result of its cluster is read (the optimizer; a cluster is a run of
# chains whose first reductions are all waited for before any of their results is
# read, so gradients whose results are each read by a cast of their own, bf16
# reductions cast back to fp32 masters, still move together), so the first
# reductions bucket in backward order and the second ones bucket together;
# ``hoist_chained_reductions``, after the waits are placed, issues each second
# bucket as soon as its input exists (right after the first bucket's wait), so it
# overlaps the rest of the backward, in the order the ranks issued them. (It issues
# early any reduction computed from other reductions' results alone, with the pure
# ops between: a clipped step's global norm, all-reduced over "tp", moves up with its
# squares and sums; the collectives keep their order.) A chain is two reductions: a
# sum over three axes of four is three, and only its last axis's are bucketed.


def _chain(r2: fx.Node) -> tuple[fx.Node, list[fx.Node]] | None:
    """``(w1, views)``: the wait of the reduction that ``r2`` (a reduction) reads
    through ``views`` (pure one-input ops, each read only by the next), else None."""
    views: list[fx.Node] = []
    node = r2.args[0]
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target is not _WAIT:
        if len(node.users) != 1 or len(node.all_input_nodes) != 1 or not _movable_op(node):
            return None
        views.append(node)
        node = node.all_input_nodes[0]
    if not (isinstance(node, fx.Node) and node.target is _WAIT and len(node.users) == 1):
        return None
    r1 = node.args[0]
    if not (isinstance(r1, fx.Node) and r1.target in (_ALL_REDUCE, _REDUCE_SCATTER)):
        return None
    return node, views[::-1]


def defer_chained_reductions(gm: fx.GraphModule) -> fx.GraphModule:
    """Move each reduction that reads another's result at once, with that wait and
    the views between, down to where the first result of its cluster is read (NOTE
    [Chained reductions]). Run before the bucketing passes."""
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    chains = []
    for r2 in nodes:
        if r2.op != "call_function" or r2.target not in (_ALL_REDUCE, _REDUCE_SCATTER):
            continue
        found = _chain(r2)
        w2 = _wait_of(r2)
        if found is None or w2 is None or len(r2.users) != 1 or not w2.users:
            continue
        chains.append((found[0], found[1], r2, w2))
    # in clusters: consecutive chains whose first reductions are waited for before
    # any of their results is read all move to where the first of them is read (a
    # chain in the forward, a loss's count, is a cluster of its own; gradients'
    # chains read one by one, each by a cast to its master's dtype, are one cluster)
    chains.sort(key=lambda c: pos[c[0]])
    clusters: list[list] = []          # [target, members]
    for c in chains:
        first = min(c[3].users, key=pos.__getitem__)
        if clusters and pos[c[0]] < pos[clusters[-1][0]]:
            clusters[-1][1].append(c)
            if pos[first] < pos[clusters[-1][0]]:
                clusters[-1][0] = first
        else:
            clusters.append([first, [c]])
    for target, members in clusters:
        for w1, views, r2, w2 in members:
            for n in (w1, *views, r2, w2):
                target.prepend(n)
    return gm


def hoist_chained_reductions(gm: fx.GraphModule) -> fx.GraphModule:
    """Issue each reduction whose input is computed from other reductions' results
    alone, by pure ops, as soon as those results are waited for, those ops moved up with it,
    keeping the order of the reductions over each group (NOTE [Chained
    reductions]). Run after ``sink_waits`` and ``bound_reduce_scatters``."""
    targets = (_ALL_REDUCE, _REDUCE_SCATTER)
    order = _POS                # (current as nodes move: NOTE [Positions in a graph])
    for r2 in [n for n in gm.graph.nodes if n.op == "call_function" and n.target in targets]:
        stops, pure = _impure_sources(r2.args[0])
        # (only what is computed from reductions' results alone: a gradient, which
        # the backward computes from the inputs too, stays where the passes put it)
        if not stops or not all(s.target is _WAIT and isinstance(s.args[0], fx.Node)
                                and s.args[0].target in targets for s in stops):
            continue
        limit = max(stops, key=order.__getitem__)
        for n in gm.graph.nodes:          # the reduction before it over its group stays before it
            if n is r2:
                break
            if n.op == "call_function" and n.target in _torch.COLLECTIVE_OPS and n.args[-1] == r2.args[-1] \
                    and order[n] > order[limit]:
                limit = n
        anchor = limit.next
        while anchor in pure:             # (already in place)
            anchor = anchor.next
        if order[anchor] >= order[r2] or not move_before(r2.args[0], anchor):
            continue
        anchor.prepend(r2)
    return gm


def _impure_sources(node) -> tuple[list[fx.Node], set[fx.Node]]:
    """The nodes that ``node`` is computed from by pure ops (waits, placeholders,
    impure ops: ``node`` itself if it is one), and those pure ops."""
    out: list[fx.Node] = []
    seen: set = set()
    todo = [node]
    while todo:
        n = todo.pop()
        if not isinstance(n, fx.Node) or n in seen:
            continue
        seen.add(n)
        if _movable_op(n):
            todo.extend(n.all_input_nodes)
        else:
            out.append(n)
    return out, seen - set(out)


def bound_reduce_scatters(gm: fx.GraphModule, inflight: int = 2) -> fx.GraphModule:
    """Wait for each reduce-scatter before the one ``inflight`` places after it (over
    the same group) is issued: at most ``inflight`` buckets of full-size gradients
    are alive at once (NOTE [Bucketing]). Run after ``sink_waits``."""
    by_group: dict = {}
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is _REDUCE_SCATTER:
            by_group.setdefault(n.args[-1], []).append(n)
    # (one order: a wait moves only at its own check, and moving it leaves the order
    # of every other pair as it was)
    order = {n: j for j, n in enumerate(gm.graph.nodes)}
    for seq in by_group.values():
        for earlier, later in zip(seq, seq[inflight:]):
            wait = _wait_of(earlier)
            if wait is not None and order[wait] > order[later]:
                later.prepend(wait)
    return gm


def prefetch_all_gathers(gm: fx.GraphModule, ahead: int = 1) -> fx.GraphModule:
    """Issue each all-gather just after the wait of the one ``ahead`` places before
    it (NOTE [Overlap]); the first ``ahead`` are issued as early as their inputs
    allow. Run after ``sink_waits``."""
    gathers = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is _ALL_GATHER]
    for i, ag in enumerate(gathers):
        if i < ahead:
            continue
        wait = _wait_of(gathers[i - ahead])
        if wait is None:
            continue
        if _POS[ag] <= _POS[wait]:
            continue
        move_before(ag, wait.next)
    return gm
