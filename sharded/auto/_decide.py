"""The decide step for AUTO specs: units (sharded/auto/_units.py), the layout program
(sharded/auto/_solve.py), then the decisions written into the global program."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch.fx as fx
from torch.distributed.tensor import Partial, Replicate, Shard

from sharded._registry import META_PATH
from sharded.errors import ShardingRuleError
from sharded.api import CONSTRAINT_OP, spec_text
from sharded.auto._blocks import shared_decisions
from sharded.auto._explain import report as _report
from sharded.auto._solve import Infeasible, edge_costs, solve
from sharded.auto._units import Builder, Unit, get_input, placements_of, set_input
from sharded.auto.cost import CostModel, known_model, predict_graph
from sharded.spec import AUTO, P, from_placements, to_placements


@dataclass
class AutoRequest:
    """What pjit asks of the decide step: the budget, the cost model (None: the
    mesh's, ``CostModel.for_mesh``) and the output paths (for ties)."""

    budget: int | None = None
    model: CostModel | None = None
    out_paths: list = field(default_factory=list)
    name: str = "pjit"


@dataclass
class Decision:
    in_placements: list        # per graph input
    out_specs: list            # per output: a P (AUTO ones decided) or None
    report: dict
    model: CostModel
    moves: Callable[[fx.GraphModule], list]    # writes the solver's moves: NOTE [Applying ...]


def _expressible(pl, mesh, ndim) -> P | None:
    try:
        return from_placements(pl, mesh, ndim)
    except ValueError:
        return None


def decide(gm: fx.GraphModule, mesh, in_placements: list, out_specs: list,
           request: AutoRequest) -> Decision:
    """Choose the layouts of the AUTO inputs and outputs of ``gm`` (``in_placements``
    None, ``out_specs`` AUTO) and of every value in between. ``Decision.moves(gm)``
    writes the moves into ``gm`` (NOTE [Applying the decisions]); ``lower_decided``
    lowers the program with them and without them and keeps the faster."""
    t0 = time.perf_counter()
    model = request.model or known_model(mesh)
    if model is None:       # (pjit fetched it before the lowering: see known_model)
        raise RuntimeError(
            f"{request.name}: the AUTO solver has no cost model for {mesh!r}; pjit fetches "
            f"it (CostModel.for_mesh, a collective at first use) before it lowers a step. "
            f"Pass cost_model= to pjit, or call CostModel.for_mesh(mesh) on every rank first.")
    b = Builder(gm, mesh, model)
    placeholders = gm.graph.find_nodes(op="placeholder")
    in_units = []
    for node, pl in zip(placeholders, in_placements):
        path = node.meta.get(META_PATH, node.name)
        cands = placements_of(node.meta["val"], mesh, True) if pl is None else [tuple(pl)]
        in_units.append(b.add_input(node, path, cands))
    for node in gm.graph.nodes:
        if node.op == "call_function":
            b.add_node(node)
    out_node = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    out_vals = out_node.args[0]
    out_units: list[int | None] = []
    for k, (a, spec) in enumerate(zip(out_vals, out_specs)):
        v = b.value.get(a) if isinstance(a, fx.Node) else None
        if not (isinstance(v, tuple) and len(v) == 2 and isinstance(v[0], int)):
            out_units.append(None)
            continue
        val = b.units[v[0]].vals[v[1]]
        path = request.out_paths[k] if k < len(request.out_paths) else f"output[{k}]"
        if spec is AUTO:
            cands = placements_of(val, mesh, True)
        elif spec is None:      # the propagated layout, its pending sums reduced
            cands = None
        else:
            cands = [to_placements(spec, mesh)]
        if cands is None:
            unit = Unit(None, "output", [], [v], [], [val], path=path)
            prod = b.units[v[0]]
            seen = []
            for outs, _ in prod.strategies:
                got = tuple(Replicate() if isinstance(p, Partial) else p for p in outs[v[1]])
                if got not in seen:
                    seen.append(got)
            unit.strategies = [((pl,), (pl,)) for pl in seen]
        else:
            unit = Unit(None, "output", [((pl,), (pl,)) for pl in cands], [v], [], [val], path=path)
        unit.compute = [0.0] * len(unit.strategies)
        b.units.append(unit)
        out_units.append(len(b.units) - 1)

    units = b.units
    mesh_shape = tuple(mesh.shape)
    order = {node: k for k, node in enumerate(gm.graph.nodes)}
    edges = edge_costs(units, model, mesh_shape, order)
    memory = []
    for i in in_units + [u for u in out_units if u is not None]:
        val = units[i].vals[0]
        memory.append((i, [_bytes(val, outs[0], mesh_shape) for outs, _ in units[i].strategies]))
    ties = _ties(units, in_units, out_units, out_specs, in_placements)
    shared = shared_decisions(units)        # NOTE [Identical blocks share decisions]
    t1 = time.perf_counter()
    try:
        sol = solve(units, edges, memory, request.budget, ties, shared)
    except RuntimeError as e:
        raise RuntimeError(
            f"{request.name}: the AUTO layout solver found no layout on {mesh!r} ({e}); "
            f"this is a bug of the solver: please report it with the step. Give the specs "
            f"by hand meanwhile.") from None
    except Infeasible as e:
        raise ValueError(
            f"{request.name}: no layout fits memory_budget={request.budget:,} bytes per rank "
            f"on {mesh!r}: the smallest layout of the step's inputs and outputs takes "
            f"{e.smallest:,} bytes per rank (every AUTO tensor sharded as far as the mesh "
            f"divides it). Raise the budget, use a larger mesh, or shard the fixed specs."
        ) from None
    t2 = time.perf_counter()
    new_in = []
    for i, pl in zip(in_units, in_placements):
        new_in.append(units[i].strategies[sol.choice[i]][0][0] if pl is None else pl)
    new_out = []
    for u, spec in zip(out_units, out_specs):
        if spec is AUTO and u is not None:
            pl = units[u].strategies[sol.choice[u]][0][0]
            new_out.append(from_placements(pl, mesh, units[u].vals[0].ndim))
        else:
            new_out.append(None if spec is AUTO else spec)
    report = _report(units, sol, in_units, out_units, edges, mesh, model, request,
                     b.unsupported, {"build_s": t1 - t0, "solve_s": t2 - t1},
                     shared)
    return Decision(new_in, new_out, report, model,
                    lambda g: _apply(g, units, sol.choice, mesh, report))


# NOTE [Two candidates]
# The solver's moves are its model's plan; DTensor's propagation from the same input
# layouts is the program a user gets by giving the chosen specs by hand. The model
# prices each move on its own (the passes' buckets as pools of latency alone), so its
# plan can pay for moves the propagation does without (a small tensor gathered to
# save compute the model overrates). Both programs are lowered
# and priced by the same model on their real collectives (``predict_graph``: after
# the passes, buckets included), and the cheaper is kept (the propagation on a tie:
# then ``lowered.in_specs`` given by hand is the same program). The report says
# which, with both predictions. Where the propagation fails (a view DTensor cannot
# shard from the layouts it propagates, that the solver's moves avoid) the solver's
# program is kept, and ``report["propagation_failed"]`` says why.

def lower_decided(gm: fx.GraphModule, decision: Decision, mesh,
                  lower: Callable[[fx.GraphModule], Any]) -> Any:
    """``lower(gm)`` of the program with the solver's moves and of the program
    without them (NOTE [Two candidates]); returns the faster's result, ``gm`` holding
    its moves (or none)."""
    rep = decision.report
    t0 = time.perf_counter()
    rep["candidates"] = {}
    plain = plain_s = failed = None
    try:
        plain = lower(gm)
        plain_s = rep["candidates"]["propagation"] = predict_graph(plain.graph, mesh,
                                                                   decision.model)["total_s"]
    except (ShardingRuleError, RuntimeError) as e:
        # DTensor's propagation from these layouts can meet a view it cannot shard
        # (heads that the axis does not divide) where the solver's moves avoid it;
        # anything else is not the propagation's to fail
        if not isinstance(e, ShardingRuleError) and "could not partition" not in str(e):
            raise
        failed = e
        rep["propagation_failed"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    chosen, result = "propagation", plain
    inserted = decision.moves(gm)
    if inserted or plain is None:
        try:
            moved = lower(gm)
        except Exception as e:
            if failed is not None:      # both failed: the propagation's error first
                raise e from failed
            raise
        moved_s = rep["candidates"]["solver's moves"] = predict_graph(
            moved.graph, mesh, decision.model)["total_s"]
        if plain_s is None or moved_s < plain_s:
            chosen, result = "solver's moves", moved
        else:
            _undo(gm, inserted)
    elif failed is not None:
        raise failed
    rep["chosen"] = chosen
    rep["lower_s"] = time.perf_counter() - t0
    return result


def _bytes(val, pl, mesh_shape) -> int:
    n = val.numel() * val.element_size()
    for size, p in zip(mesh_shape, pl):
        if type(p) is Shard:
            n //= size
    return n


def _tie(a: Unit, b: Unit, i: int, u: int) -> tuple | None:
    """(i, u, pairs): unit u (b) takes the layout unit i (a) takes, where every layout
    of a is one of b's."""
    if a.vals[0].shape != b.vals[0].shape or a.vals[0].dtype != b.vals[0].dtype:
        return None
    index = {outs[0]: k for k, (outs, _) in enumerate(b.strategies)}
    pairs = [(k, index[outs[0]]) for k, (outs, _) in enumerate(a.strategies) if outs[0] in index]
    return (i, u, pairs) if len(pairs) == len(a.strategies) == len(b.strategies) else None


def _ties(units, in_units, out_units, out_specs, in_placements) -> list:
    """An AUTO output with an AUTO input of the same path (after ``args``/``output``),
    shape and dtype takes its layout (NOTE [The layout program]). The blocks of a
    stack are not tied here: tying them by such rows (one layout per block path) made
    HiGHS take 40 s rather than 7 s on GPT-2-small over an 8x8 mesh; they share their
    columns instead (NOTE [Identical blocks share decisions] in _blocks.py)."""
    ties = []
    by_path = {}
    for i, pl in zip(in_units, in_placements):
        if pl is None:
            p = units[i].path or ""
            by_path[p.split("args", 1)[-1] if p.startswith("args") else p] = i
    for u, spec in zip(out_units, out_specs):
        if u is None or spec is not AUTO:
            continue
        p = units[u].path or ""
        key = p.split("output", 1)[-1] if p.startswith("output") else p
        i = by_path.get(key)
        if i is not None:
            tie = _tie(units[i], units[u], i, u)
            if tie is not None:
                ties.append(tie)
    return ties


# NOTE [Applying the decisions]
# The solution becomes the program through the partitioner that runs every pjit step
# (DTensorExpandMode): the chosen layouts of the AUTO inputs are their specs, and a
# ``sharded::sharding_constraint`` goes on each edge where the solution moves a value
# (the reader's strategy needs another layout than its producer gives), so DTensor's
# per-op propagation, which picks the cheapest strategy for the layouts its inputs
# arrive in, meets each op with its inputs already in the chosen strategy's layouts.
# A move to a layout no P expresses (to a Partial: free, a local division) is left to
# DTensor, which makes its own choice there; ``report["unapplied"]`` counts them.

def _apply(gm, units, choice, mesh, report: dict) -> list:
    """Write the moves of ``choice`` into ``gm``; returns the nodes it inserted."""
    g = gm.graph
    applied, unapplied = 0, 0
    made: dict = {}
    for n, unit in enumerate(units):
        if unit.kind != "op":
            continue
        _, ins = unit.strategies[choice[n]]
        for j, (u, o) in enumerate(unit.inputs):
            if unit.elem and unit.setters[j][2] is None:
                continue        # a foreach op's tensor outside its lists: element 0 moves it
            prod = units[u]
            have = prod.strategies[choice[u]][0][o]
            want = ins[j]
            if have == want:
                continue
            spec = _expressible(want, mesh, prod.vals[o].ndim)
            if spec is None:
                unapplied += 1
                continue
            src = get_input(unit.node, unit.setters[j])
            key = (src, spec)
            if key not in made:
                with g.inserting_before(unit.node):
                    c = g.call_function(CONSTRAINT_OP, (src, spec_text(spec)))
                c.meta["val"] = src.meta["val"]
                c.meta["stack_trace"] = unit.node.meta.get("stack_trace")
                made[key] = c
            src = made[key]
            set_input(unit.node, unit.setters[j], src)
            applied += 1
    g.lint()
    report["applied"], report["unapplied"] = applied, unapplied
    return list(made.values())


def _undo(gm, inserted: list) -> None:
    """Take out the constraints ``_apply`` inserted."""
    for node in reversed(inserted):
        node.replace_all_uses_with(node.args[0])
        gm.graph.erase_node(node)
    gm.graph.lint()
