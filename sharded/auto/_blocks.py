"""Identical blocks share their decisions: which units of the layout program take the
same strategy as a unit of an earlier block (NOTE [Identical blocks share decisions]).

# NOTE [Identical blocks share decisions]
A model's repeated blocks (a transformer's layers, an MLP's stacked Linears) are traced
into one copy of the same ops per block. The solver gives the units of a block the
columns of the same units of an earlier block: one decision per class of matched
units, so the program's size no longer grows with depth (GPT-2-small's 12 layers on
an 8x8 mesh: 390,917 variables before). A class's units take one strategy; each still
pays its own compute, moves and memory (the costs add up on the shared columns), so
the program is the original one with ``x[u] = x[rep(u)]`` added: exact for the
plans it keeps, a restriction of the rest.

Which blocks: the inputs whose pytree paths differ only in one number inside one
argument (``args[0]['blocks'][3]['wq']``, not ``args[0]`` against ``args[2]``; the
varying position with the most values) are instances of one template; instance
``k`` is matched with instance ``k + PERIOD`` where the two have the same shape,
dtype and strategies. Every other block, not the
next one: the best layout of a stack of identical Linears alternates (Megatron's
column-parallel layer then row-parallel layer, the MLP's plan in
benchmarks/README.md), and a period of one would forbid it; two keeps that plan and
every period-one plan, at twice the smallest program.

From the matched inputs the match spreads to their readers: a reader of a matched
value is matched with the reader of its partner at the same input position, the
k-th with the k-th among readers of the same kind, where both do the same op on the
same shapes with the same strategies and each other input of the two is matched,
shared, or an op's result not matched yet and alike (the activation a block reads
from the one before: block 0 reads the embedding's output as block 2 reads block
1's, so those two share a decision). Inputs are matched by their paths alone, so the
head's parameters (the final layer norm's, shaped as the blocks') keep their own
decisions, as do the units reading them. A unit is matched once; a class is the
units joined by matches, and its first unit (in program order) is its
representative.
"""

from __future__ import annotations

import re
from collections import deque

from sharded.auto._units import Unit

PERIOD = 2           # instance k shares with instance k + PERIOD (see the NOTE)

_NUMBER = re.compile(r"\d+")
_ARGUMENT = re.compile(r"^[A-Za-z_]+\[[^\]]*\]")     # args[2]: which argument, not a block


def _kind(unit: Unit) -> tuple:
    """What must agree for two units to share a decision, cheap to hash (their
    strategies and compute are compared in full too: ``alike`` below)."""
    vals = tuple((tuple(v.shape), v.dtype) if hasattr(v, "shape") else None for v in unit.vals)
    target = unit.node.target if unit.kind == "op" and unit.node is not None else None
    # (not the element of a foreach op: each block's tensors are other elements of it)
    return unit.kind, target, vals, len(unit.strategies), len(unit.inputs)


def shared_decisions(units: list[Unit], period: int = PERIOD) -> list[int]:
    """Per unit, the unit whose decision it takes (itself where it keeps its own)."""
    kinds = [_kind(u) for u in units]

    def alike(a: int, b: int) -> bool:
        return (kinds[a] == kinds[b] and units[a].strategies == units[b].strategies
                and list(units[a].compute) == list(units[b].compute))

    readers: list[list[tuple[int, int]]] = [[] for _ in units]
    for r, unit in enumerate(units):
        for j, (u, _) in enumerate(unit.inputs):
            readers[u].append((r, j))
    image: dict[int, int] = {}       # unit -> its partner in a later block
    taken: set[int] = set()
    todo: deque = deque()

    def bind(a: int, b: int) -> None:
        image[a] = b
        taken.add(b)
        todo.append((a, b))

    def free(a: int, b: int) -> bool:
        return a != b and a not in image and b not in taken and alike(a, b)

    for a, b in _template_pairs(units, period):
        if free(a, b):
            bind(a, b)
    while todo:
        a, b = todo.popleft()
        mine, theirs = _by_kind(readers[a], kinds), _by_kind(readers[b], kinds)
        for key, ras in mine.items():
            rbs = theirs.get(key, ())
            if len(ras) != len(rbs):
                continue
            for ra, rb in zip(ras, rbs):
                if not free(ra, rb):
                    continue
                fresh: list[tuple[int, int]] = []
                for (pa, oa), (pb, ob) in zip(units[ra].inputs, units[rb].inputs):
                    if oa != ob:
                        break
                    if pa == pb or image.get(pa) == pb:
                        continue
                    if units[pa].kind == "input" or not free(pa, pb) or \
                            any(pa == x or pb == y for x, y in fresh):
                        break       # (inputs match by their paths alone)
                    fresh.append((pa, pb))
                else:
                    bind(ra, rb)
                    for pa, pb in fresh:
                        bind(pa, pb)
    rep = list(range(len(units)))        # union-find over the matches, the least index first

    def find(i: int) -> int:
        while rep[i] != i:
            rep[i] = rep[rep[i]]
            i = rep[i]
        return i

    for a, b in image.items():
        ra, rb = find(a), find(b)
        if ra != rb:
            rep[max(ra, rb)] = min(ra, rb)
    return [find(i) for i in range(len(units))]


def _by_kind(readers: list[tuple[int, int]], kinds: list) -> dict:
    """Readers grouped by (input position, kind), each group in program order."""
    out: dict = {}
    for r, j in readers:
        out.setdefault((j, kinds[r]), []).append(r)
    return out


def _template_pairs(units: list[Unit], period: int) -> list[tuple[int, int]]:
    """(instance k, instance k + period) of each template of the inputs' paths."""
    templates: dict = {}
    for i, u in enumerate(units):
        if u.kind == "input" and u.path:
            head = _ARGUMENT.match(u.path)
            arg, inside = (u.path[:head.end()], u.path[head.end():]) if head else ("", u.path)
            numbers = tuple(int(x) for x in _NUMBER.findall(inside))
            if numbers:
                templates.setdefault(arg + _NUMBER.sub("#", inside), []).append((numbers, i))
    pairs = []
    for found in templates.values():
        width = len(found[0][0])
        # the position that numbers the blocks: the one with the most values
        pos = max(range(width), key=lambda d: (len({n[d] for n, _ in found}), -d))
        rows: dict = {}
        for numbers, i in found:
            rest = numbers[:pos] + numbers[pos + 1:]
            rows.setdefault(rest, []).append((numbers[pos], i))
        for row in rows.values():
            row.sort()
            pairs += [(row[k][1], row[k + period][1]) for k in range(len(row) - period)]
    return pairs
