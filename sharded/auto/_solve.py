"""The AUTO layout solver: an integer program over the units' strategies (NOTE [The
layout program]), solved by HiGHS through scipy.optimize.milp."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch
from scipy import sparse
from scipy.optimize import Bounds, LinearConstraint, milp

from sharded import _torch
from sharded.auto._units import Unit
from sharded.auto.cost import one_reduction, redistribute_seconds


# NOTE [The layout program]
# One binary x[u, k] per unit u and strategy k, exactly one per unit. The objective, in
# seconds per call of the step under the cost model:
#   compute   sum over ops of the chosen strategy's compute (its flops and bytes over
#             the ranks that split it);
#   moves     per edge (a value read by an op, or returned), the redistribution from
#             the layout its producer gives to the layout the reader's strategy needs.
# An edge's cost depends on two decisions. The producer's strategies are grouped by
# the layout p they give the value, the reader's by the layout q they need; one
# continuous y[e, p, q] per pair, with the marginals  sum_q y[e, p, q] = sum over the
# producer's strategies giving p of x  and  sum_p y[e, p, q] = sum over the reader's
# strategies needing q of x  (the local polytope of a pairwise model: its LP
# relaxation is tight on a tree, so HiGHS rarely branches; a big-M form with one
# variable per reader strategy was ~1000x slower to solve). An edge where one side
# gives or needs one layout whatever it chooses is linear in the other side's x.
# Memory: the bytes per rank of the inputs and the outputs in their chosen layouts
# (the state the step holds) are at most the budget.
#
# NOTE [One move per value and layout]
# A value read by several ops that need it in one layout is moved once (the expander
# redistributes a value to a layout once and reuses it): a row-parallel matmul's
# output, read by the GELU and by its backward, is one all-reduce, not two. Priced per
# edge, the MLP 8x1024 Megatron plan paid 10 activation all-reduces where its program
# has 7, and the solver took a plan 13% slower by its own predictor. So the edges of
# one value are priced together: per pair of layouts (given, needed), continuous
# z >= each reader's indicator of that move (its y, or its x where one side's layout
# is fixed), at the move's price. A reduction's latency is pooled apart from its
# bytes (NOTE [Reductions are bucketed]), so a move costs every reader the same.
# Ties: an AUTO output with an AUTO input of the same path, shape and dtype (the
# parameters a step returns) takes that input's layout: a train loop then feeds each
# step's outputs to the next with no redistribution.


# A program of more columns than this (its x's and one y per pair of layouts on every
# edge; not the z's of moves and pools) gets fewer y's on the edges pointwise ops,
# views and copies read: NOTE [Moves after a pointwise op]
FOLLOW_ABOVE = 100_000

# HiGHS stops when its best layout is provably within this fraction of the optimum
# (a gap, not a time limit: every rank stops at the same point and decides alike).
MIP_GAP = 0.01
# The program's units: microseconds and MiB (seconds of 1e-9 and bytes of 1e9 in one
# matrix are below and above HiGHS's tolerances)
_US, _MIB = 1e6, float(2 ** 20)


@dataclass
class Solution:
    choice: list[int]          # per unit: the chosen strategy
    objective: float
    compute_s: float
    moves_s: float
    memory_bytes: int
    solve_s: float
    variables: int
    constraints: int
    status: str


class Infeasible(Exception):
    def __init__(self, smallest: int):
        self.smallest = smallest


# NOTE [Reductions are bucketed]
# The passes merge consecutive all-reduces over one group and dtype into one
# collective (sharded/passes/bucketing.py), so an all-reduce's latency is paid once
# per bucket, not once per reduced value. A reduction (a sum pending over one axis, or
# over every axis of the mesh at once: one all-reduce over the mesh's group, NOTE
# [Redistribution cost]) is priced by its bytes on its edge, and its latency is
# pooled: one continuous z per pool, at one all-reduce's latency, z >= the term of
# each reduction in the pool. The pools are where the program's all-reduces meet:
# - the step's tail (a reader after the step's last matmul: the optimizer's
#   gradients, or gradients returned as they are): one bucket per group and dtype.
#   A data-parallel step's dozens of gradient all-reduces are a few collectives;
#   charged one each, the solver would gather a small batch to every rank rather
#   than reduce every gradient. A tail pool is added to the objective after the
#   solve, not written into the program: one z over every gradient's reduction
#   made HiGHS take 16 s rather than 6 s on a 4-layer GPT-2-small over 8x8 (140 s
#   at 12 layers), for one latency per group: it tells apart only a plan that
#   reduces nothing in its tail from one that does.
# - before the first op that reads the value, elsewhere (a value read there and in
#   the tail too is reduced there, once): the reductions made before one op are
#   issued together and merged. A mean loss's sum and count, both read by
#   its division, are one all-reduce (charged two, the solver took gathering gpt-tiny's
#   logits at ws2 for cheaper than DDP, which its predictor put the other way).
# A sum over some axes of several is one all-reduce per axis, made one after the
# other, the last axis first (NOTE [Chained reductions]): each is pooled over its axis.
# Not modelled: a tail of more than one bucket's bytes (DEFAULT_BUCKET_BYTES) pays one
# latency per bucket, where the pool charges one (the bytes dominate the price there);
# and a value's reduction is pooled at its first reader, though a later reader may be
# the one that needs it reduced.

@dataclass
class Edge:
    """A value read by a unit's input: ``cost[k][s]`` the move's price from the
    producer's strategy k to the reader's s, less the latency pooled in
    ``pools[k][s]`` (NOTE [Reductions are bucketed]): ``((pool key, latency), ...)``, one
    per all-reduce the move is, or None."""

    reader: int
    input: int
    producer: int
    cost: np.ndarray
    pools: list | None = None


def _reduction(model, p, q, mesh_shape):
    """``((group, latency), ...)``, one per all-reduce the move p -> q is: over every
    axis of the mesh at once, or one per axis where the sum is pending over some axes
    and made replicated there, and nothing else moves; else None."""
    if one_reduction(p, q, mesh_shape):
        return (("mesh", model.collective_seconds("all_reduce", 0, math.prod(mesh_shape))),)
    changed = [(i, size, a, b) for i, (size, a, b) in enumerate(zip(mesh_shape, p, q))
               if a != b and size > 1]
    if not changed or not all(a.is_partial() and b.is_replicate() for _, _, a, b in changed):
        return None
    return tuple((i, model.collective_seconds("all_reduce", 0, size)) for i, size, _, _ in changed)


_HEAVY = ("aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm", "aten::convolution",
          "aten::convolution_backward", "aten::embedding_dense_backward")


def edge_costs(units: list[Unit], model, mesh_shape, order: dict) -> list[Edge]:
    """Per (unit, tensor input), and per output unit likewise, its ``Edge`` (NOTE
    [Reductions are bucketed]); ``order``: each node's position in the program."""
    heavy = [order[u.node] for u in units if u.node is not None and u.kind == "op"
             and _torch.op_name(u.node.target) in _HEAVY]
    last_heavy = max(heavy, default=-1)

    def tail(unit) -> bool:
        return unit.node is None or order.get(unit.node, -1) > last_heavy

    first: dict = {}        # value -> its first reader outside the tail
    for n, unit in enumerate(units):
        if not tail(unit):
            for v in unit.inputs:
                if v not in first or order[unit.node] < order[units[first[v]].node]:
                    first[v] = n
    reductions: dict = {}       # (p, q) -> _reduction(p, q)
    out = []
    for n, unit in enumerate(units):
        for j, (u, o) in enumerate(unit.inputs):
            prod = units[u]
            val = prod.vals[o]
            shape, itemsize = tuple(val.shape), val.element_size()
            src = [outs[o] for outs, _ in prod.strategies]
            dst = [ins[j] for _, ins in unit.strategies]
            # (a value read before the tail too is reduced there, once: NOTE
            # [One move per value and layout])
            where = ("before", first[(u, o)]) if (u, o) in first else ("tail",)
            cost = np.zeros((len(src), len(dst)))
            pools = [[None] * len(dst) for _ in src]
            for a, p in enumerate(src):
                for b, q in enumerate(dst):
                    c = redistribute_seconds(model, p, q, shape, itemsize, mesh_shape)
                    if c == 0.0:
                        continue
                    red = reductions.get((p, q), False)
                    if red is False:
                        red = reductions[(p, q)] = _reduction(model, p, q, mesh_shape)
                    if red is not None:
                        pools[a][b] = tuple(((*where, group, val.dtype), latency)
                                            for group, latency in red)
                        c = max(0.0, c - sum(latency for _, latency in red))
                    cost[a, b] = c
            out.append(Edge(n, j, u, cost, pools))
    return out


class _NoSolution(RuntimeError):
    def __init__(self, message: str, fewer_pairs: bool):
        super().__init__(message)
        self.fewer_pairs = fewer_pairs


def solve(units: list[Unit], edges: list, memory: list, budget: int | None,
          ties: list[tuple[int, int, list[tuple[int, int]]]],
          shared: list[int] | None = None) -> Solution:
    """``memory``: (unit, bytes per strategy) for the units the budget counts;
    ``ties``: (unit a, unit b, pairs (k_a, k_b) that agree): a and b choose agreeing
    strategies; ``shared``: per unit, the earlier unit whose decision it takes (NOTE
    [Identical blocks share decisions] in _blocks.py; None: each its own). Raises
    RuntimeError where the program has no solution, ``Infeasible`` where no layout
    meets the budget."""
    t0 = time.perf_counter()
    try:
        return _solve(units, edges, memory, budget, ties, shared, t0, True)
    except _NoSolution as e:
        if not e.fewer_pairs:
            raise
    # the pairs a large program leaves out made it infeasible (a pricing is then a
    # constraint: NOTE [Moves after a pointwise op]): solve it with every pair
    return _solve(units, edges, memory, budget, ties, shared, t0, False)


def _solve(units, edges, memory, budget, ties, shared, t0: float, may_follow: bool) -> Solution:
    rep = shared if shared is not None else list(range(len(units)))
    offset = []
    nx = 0
    for i, unit in enumerate(units):
        if rep[i] != i:                 # the columns of the unit it shares with
            offset.append(offset[rep[i]])
            continue
        offset.append(nx)
        nx += len(unit.strategies)
    c = np.zeros(nx)
    for i, unit in enumerate(units):
        c[offset[i]:offset[i] + len(unit.strategies)] += unit.compute
    rows, cols, vals, lo, hi = [], [], [], [], []
    y_cost: list[float] = []
    r = 0
    # exactly one strategy per unit
    for i, unit in enumerate(units):
        if rep[i] != i:
            continue
        for k in range(len(unit.strategies)):
            rows.append(r)
            cols.append(offset[i] + k)
            vals.append(1.0)
        lo.append(1.0)
        hi.append(1.0)
        r += 1
    ny = 0
    # per value read (producer unit, output) and pair of layouts (given, needed): each
    # reader's term, an expression over x or y that is 1 where that move is made, and
    # its cost (NOTE [One move per value and layout])
    moves: dict = {}
    pooled: dict = {}       # pool key -> (latency, terms): NOTE [Reductions are bucketed]
    edge_y: dict = {}       # (producer, output, reader, input) of the shared units -> {pair: y}
    # the edges with what they read, and the columns of the program with one y per
    # pair of layouts on every edge: above FOLLOW_ABOVE, NOTE [Moves after a pointwise op]
    grouped = []
    full, counted = nx, set()
    for e in edges:
        if not e.cost.any() and (e.pools is None or not any(map(any, e.pools))):
            continue
        o = units[e.reader].inputs[e.input][1]
        # group the producer's strategies by the layout they give this value, the
        # reader's by the layout they need it in (NOTE [The layout program])
        gp = _keyed_groups(units[e.producer].strategies, lambda st: st[0][o])
        gq = _keyed_groups(units[e.reader].strategies, lambda st: st[1][e.input])
        grouped.append((e, o, gp, gq))
        key = (rep[e.producer], o, rep[e.reader], e.input)
        if len(gp) > 1 and len(gq) > 1 and key not in counted:
            counted.add(key)
            full += len(gp) * len(gq)
    follow = may_follow and full > FOLLOW_ABOVE
    for e, o, gp, gq in grouped:
        n, j, u, cm = e.reader, e.input, e.producer, e.cost
        ys_of = edge_y.get((rep[u], o, rep[n], j))      # (the same edge of a shared block)
        if len(gp) > 1 and len(gq) > 1 and ys_of is None:
            # one y per pair of layouts, or per free pair on a follower's edge (NOTE
            # [Moves after a pointwise op])
            pairs = [(a, b) for a in range(len(gp)) for b in range(len(gq))]
            if follow and _follows(units, e, o):
                free = {(a, b) for a, b in pairs if cm[gp[a][1][0], gq[b][1][0]] == 0.0
                        or _reduces(gp[a][0], gq[b][0])}
                stuck = set(range(len(gp))) - {a for a, _ in free}
                pairs = [(a, b) for a, b in pairs if a in stuck or (a, b) in free]
            ys_of = edge_y[(rep[u], o, rep[n], j)] = {ab: nx + ny + i for i, ab in enumerate(pairs)}
            ny += len(pairs)
            y_cost += [0.0] * len(pairs)
            # sum_q y[p, q] = sum of x[u, k] over the k that give p, and
            # sum_p y[p, q] = sum of x[n, s] over the s that need q (a pair without a
            # y is 0)
            marginals = [([ys_of[(a, b)] for b in range(len(gq)) if (a, b) in ys_of], offset[u], ks)
                         for a, (_, ks) in enumerate(gp)]
            marginals += [([ys_of[(a, b)] for a in range(len(gp)) if (a, b) in ys_of], offset[n], ss)
                          for b, (_, ss) in enumerate(gq)]
            for ys, at, xs in marginals:
                rows += [r] * (len(ys) + len(xs))
                cols += ys + [at + k for k in xs]
                vals += [1.0] * len(ys) + [-1.0] * len(xs)
                lo.append(0.0)
                hi.append(0.0)
                r += 1
        for a, (pkey, ks) in enumerate(gp):
            for b, (qkey, ss) in enumerate(gq):
                cost = float(cm[ks[0], ss[0]])
                pool = e.pools[ks[0]][ss[0]] if e.pools is not None else None
                if cost == 0.0 and pool is None:
                    continue
                if len(gp) > 1 and len(gq) > 1:
                    if (a, b) not in ys_of:       # a move the program does not make
                        continue
                    term = (ys_of[(a, b)],)
                elif len(gp) > 1:        # the reader needs one layout whatever it chooses
                    term = tuple(offset[u] + k for k in ks)
                elif len(gq) > 1:        # the producer gives one layout whatever it chooses
                    term = tuple(offset[n] + k for k in ss)
                else:                    # a move made whatever both choose
                    term = tuple(offset[u] + k for k in range(len(units[u].strategies)))
                if cost > 0.0:
                    moves.setdefault((u, o, pkey, qkey), []).append((cost, term))
                for key, latency in pool or ():
                    pooled.setdefault(key, (latency, []))[1].append(term)
    # a move several readers need, and a pool of latencies, are paid once: a continuous
    # z >= the term of each, at its price (a move's price is the same for every reader:
    # it depends on the value and the two layouts alone). The tail's pools are priced
    # after the solve (NOTE [Reductions are bucketed]).
    # Groups of one set of terms are one z at the sum of their prices (the same move
    # of each shared block: NOTE [Identical blocks share decisions]).
    tail = [pool for key, pool in pooled.items() if key[0] == "tail"]
    groups: dict = {}
    for price, terms in [(terms[0][0], [t for _, t in terms])
                         for terms in moves.values()] + [
                             pool for key, pool in pooled.items() if key[0] != "tail"]:
        key = tuple(sorted(set(terms)))
        groups[key] = groups.get(key, 0.0) + price
    for terms, price in groups.items():
        if len(terms) == 1:
            for col in terms[0]:
                if col < nx:
                    c[col] += price
                else:
                    y_cost[col - nx] += price
            continue
        z = nx + ny
        ny += 1
        y_cost.append(price)
        for term in terms:
            rows += [r] * (1 + len(term))
            cols += [z, *term]
            vals += [1.0] + [-1.0] * len(term)
            lo.append(0.0)
            hi.append(np.inf)
            r += 1
    tied: set = set()
    for a, b, pairs in ties:
        # x[a, ka] == x[b, kb] for each agreeing pair; others of b are 0 where a has no
        # pair (once per pair of columns: the same tie of each shared block)
        for ka, kb in pairs:
            if offset[a] + ka == offset[b] + kb or (offset[a] + ka, offset[b] + kb) in tied:
                continue
            tied.add((offset[a] + ka, offset[b] + kb))
            rows += [r, r]
            cols += [offset[a] + ka, offset[b] + kb]
            vals += [1.0, -1.0]
            lo.append(0.0)
            hi.append(0.0)
            r += 1
    nvar = nx + ny
    cost = np.concatenate([c, np.array(y_cost)]) * _US
    mem = np.zeros(nvar)                       # MiB per rank of each x
    for i, sizes in memory:
        for k, nbytes in enumerate(sizes):
            mem[offset[i] + k] += nbytes / _MIB
    A = sparse.csr_array((vals, (rows, cols)), shape=(r, nvar))
    integrality = np.concatenate([np.ones(nx), np.zeros(ny)])
    bounds = Bounds(np.zeros(nvar), np.ones(nvar))
    runs = [0]

    def run(objective, budget_row: bool = False):
        cons = [LinearConstraint(A, lo, hi)]
        if budget_row:
            cons.append(LinearConstraint(sparse.csr_array(mem.reshape(1, -1)), -np.inf,
                                         budget / _MIB))
        runs[0] += 1
        res = milp(objective, integrality=integrality, bounds=bounds, constraints=cons,
                   options={"disp": False, "mip_rel_gap": MIP_GAP})
        if res.x is None:
            raise _NoSolution(f"the layout program has no solution ({res.message})", follow)
        return res.x

    x = run(cost)
    if budget is not None and memory and mem @ x > budget / _MIB:
        if smallest_memory(memory) > budget:
            raise Infeasible(smallest_memory(memory))
        x = _within_budget(run, cost, mem, budget / _MIB, x)
    choice = []
    for i, unit in enumerate(units):
        seg = x[offset[i]:offset[i] + len(unit.strategies)]
        choice.append(int(np.argmax(seg)))
    compute = float(sum(units[i].compute[k] for i, k in enumerate(choice)))
    used = int(sum(sizes[choice[i]] for i, sizes in memory))
    objective = float(cost @ x) / _US
    objective += sum(latency for latency, terms in tail
                     if any(sum(x[col] for col in term) > 0.5 for term in terms))
    return Solution(choice, objective, compute, objective - compute, used,
                    time.perf_counter() - t0, nvar, r, f"{runs[0]} solve(s)")


# NOTE [A budget by its price]
# A memory budget is one row over every input and output's layouts: a knapsack
# constraint across the whole program, which leaves the relaxation far from integral
# (gpt-tiny on a 2x2 mesh: 75-260 s in HiGHS, against 1.5 s without it). The budget
# is priced instead (Lagrangian relaxation): minimise time + lam * MiB, with lam
# doubled from a small price until the layouts fit, then bisected (4 steps) between
# the last price that did not fit and the first that did; the fitting solution of
# least time is kept. Each solve has the shape HiGHS solves fast. A budget that no
# price meets (possible only where the prices' solutions all overshoot it while
# some layout fits) falls back to the exact row.

def _within_budget(run, cost, mem, budget_mib, x0):
    t_free = max(float(cost @ x0), 1.0)
    lam = t_free / max(float(mem @ x0), 1e-9) * 1e-3       # µs per MiB
    best, fail_lam, ok_lam = None, 0.0, None
    for _ in range(40):
        x = run(cost + lam * mem)
        if mem @ x <= budget_mib * (1 + 1e-9):
            best, ok_lam = x, lam
            break
        fail_lam, lam = lam, lam * 4
    if best is None:
        return run(cost, budget_row=True)
    for _ in range(4):
        mid = (fail_lam + ok_lam) / 2 if fail_lam > 0 else ok_lam / 4
        x = run(cost + mid * mem)
        if mem @ x <= budget_mib * (1 + 1e-9):
            ok_lam = mid
            if cost @ x < cost @ best:
                best = x
        else:
            fail_lam = mid
    return best


# NOTE [Moves after a pointwise op]
# Most of a model's edges are read by pointwise ops (a transformer's residual adds,
# norms, activations and their backward) and by views, on values of up to 6 layouts
# per mesh axis: one y per pair of layouts is 16 x 16 to 36 x 36 variables per edge on
# a 2x2 mesh, and a 1-layer Llama (tests/test_auto.py) on 2x2 was 161,449 columns,
# 137,548 of them y's: HiGHS took 70 s on the H100 table, 142 s on this machine's
# measured model. A move before a pointwise op, a view or a copy whose output
# holds as many elements of the same dtype can mostly be made after it instead, at the
# same bytes: the op runs in the layout its input came in, and its output moves
# (Alpa's "follow" of elementwise ops, without forcing the op's layout). So, in a
# program of more than FOLLOW_ABOVE columns, such an edge gets y's only for the pairs
# that move nothing (the same layout, or a local slice of a replicated dim) or
# reduce a pending sum and otherwise only slice (an all-reduce, whose latency is
# pooled with the reductions before the same op, NOTE [Reductions are bucketed]: made
# after a division, a mean loss's sum would pay a latency of its own; a
# reduce-scatter, which sequence parallelism makes before a norm or an add), and every
# pair of a layout the producer gives that the reader cannot take without a move.
# Pricing moves becomes forbidding some: where that leaves no solution, the program
# is solved again with every pair. The Llama: 79,184 columns, 18 s, the same optimum
# (benchmarks/bench_auto_solve.py, benchmarks/results/auto_solve.json; 22 s on the
# measured model); gpt-tiny, the MLP and a stack of identical layers on 2x2
# (restricted at any size in tests/test_auto.py) the same optimum too.
# What it gives up, and why smaller programs keep every pair: a move that several such
# readers of one value need is made once per reader's output instead of once (the
# docs/auto.md example, restricted: its squared error read by the forward's and the
# backward's pow, each then gathered, where one gather before both was cheaper than
# an all-reduce's latency: 14% over the optimum), and a partner input of the reader
# may then move too. NOTE [Two candidates] in _decide.py prices the propagation's
# program beside the solver's.

_COPIES = (torch.ops.aten.clone.default, torch.ops.aten._unsafe_view.default)


def _follows(units: list[Unit], e: Edge, o: int) -> bool:
    """Whether edge ``e`` (the producer's output ``o``) is read by a pointwise op, a
    view or a copy whose output holds as many elements of the same dtype (NOTE [Moves
    after a pointwise op])."""
    reader = units[e.reader]
    node = reader.node
    if reader.kind != "op" or node is None or not reader.vals:
        return False
    op = node.target
    if not isinstance(op, _torch.OpOverload) or not (
            torch.Tag.pointwise in op.tags or op.is_view or op in _COPIES):
        return False
    val, out = units[e.producer].vals[o], reader.vals[0]
    return (isinstance(val, torch.Tensor) and isinstance(out, torch.Tensor)
            and val.numel() == out.numel() and val.dtype == out.dtype)


def _reduces(p, q) -> bool:
    """Whether p -> q (placements per mesh axis) reduces a pending sum and otherwise
    only slices: on each axis where they differ, a Partial becomes Replicate or Shard
    (an all-reduce, a reduce-scatter) or a Replicate becomes a Shard (a local slice);
    at least one Partial goes (NOTE [Moves after a pointwise op])."""
    reduced = False
    for a, b in zip(p, q):
        if a == b:
            continue
        if a.is_partial() and not b.is_partial():
            reduced = True
        elif not (a.is_replicate() and b.is_shard()):
            return False
    return reduced


def _keyed_groups(strategies, key) -> list[tuple]:
    """``(key, strategy indices)`` per value of ``key`` (in order of first appearance)."""
    out: dict = {}
    for k, st in enumerate(strategies):
        out.setdefault(key(st), []).append(k)
    return list(out.items())


def smallest_memory(memory: list) -> int:
    """The least bytes the budgeted units can take (each at its smallest layout)."""
    return int(sum(min(sizes) for _, sizes in memory))
