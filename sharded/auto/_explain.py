"""What the AUTO solver chose and why: ``Lowered.auto`` (a dict) and ``Lowered.explain()``."""

from __future__ import annotations

import re

from torch.distributed.tensor import Partial, Replicate, Shard

from sharded.spec import from_placements


def _pl_text(pl, mesh, ndim) -> str:
    try:
        return repr(from_placements(pl, mesh, ndim))
    except ValueError:
        return "(" + ", ".join(_one(p) for p in pl) + ")"


def _one(p) -> str:
    if type(p) is Shard:
        return f"S({p.dim})"
    if isinstance(p, Partial):
        return "Partial"
    if isinstance(p, Replicate):
        return "R"
    return repr(p)


def _block_of(path: str) -> tuple[str, str]:
    """(block, leaf): the path with list indices (and the numbers of a dotted key,
    ``'layers.3.attn.wq'``) as ``*``, split before its last key (or the last part of a
    dotted key)."""
    head = re.match(r"^[a-z]+\[[^\]]*\]", path)       # args[0]: the argument, kept
    cut = head.end() if head else 0
    norm = path[:cut] + re.sub(r"\[(\d+)\]", "[*]", path[cut:])
    m = re.match(r"^(.*)(\[[^\[\]]*\])$", norm)
    if not m:
        return norm, ""
    block, leaf = m.group(1), m.group(2)
    dotted = re.match(r"^\['(.+)\.([^.]+)'\]$", leaf)
    if dotted and len(path) > cut:
        return (block + "['" + re.sub(r"(^|\.)\d+(?=\.|$)", r"\1*", dotted.group(1)) + "']",
                "['" + dotted.group(2) + "']")
    return block, leaf


def _where(node) -> str:
    trace = (node.meta.get("stack_trace") or "") if node is not None else ""
    lines = [x.strip() for x in trace.strip().splitlines() if x.strip().startswith("File")]
    return lines[-1] if lines else (node.name if node is not None else "")


def report(units, sol, in_units, out_units, edges, mesh, model, request,
           unsupported, times, shared=None) -> dict:
    choice = sol.choice
    ms = tuple(mesh.shape)
    inputs, outputs, blocks = {}, {}, {}
    for i in in_units:
        u = units[i]
        pl = u.strategies[choice[i]][0][0]
        val = u.vals[0]
        if u.path in ("rng seed", "rng offset"):
            continue
        text = _pl_text(pl, mesh, val.ndim)
        inputs[u.path] = from_placements(pl, mesh, val.ndim)
        nbytes = val.numel() * val.element_size()
        for size, p in zip(ms, pl):
            if type(p) is Shard:
                nbytes //= size
        block, leaf = _block_of(u.path)
        row = blocks.setdefault(block, {"block": block, "specs": {}, "bytes": 0, "tensors": 0})
        row["specs"].setdefault(leaf, {})
        row["specs"][leaf][text] = row["specs"][leaf].get(text, 0) + 1
        row["bytes"] += nbytes
        row["tensors"] += 1
    for i in out_units:
        if i is None:
            continue
        u = units[i]
        pl = u.strategies[choice[i]][0][0]
        try:
            outputs[u.path] = from_placements(pl, mesh, u.vals[0].ndim)
        except ValueError:
            outputs[u.path] = tuple(pl)
    # the moves the solution pays for, by where they are in the user's code
    # (a move several readers need is made once: NOTE [One move per value and layout])
    by_where: dict = {}
    pools: dict = {}        # pooled latencies: one per pool (NOTE [Reductions are bucketed])
    made: set = set()
    for e in edges:
        n, j, u = e.reader, e.input, e.producer
        prod, reader = units[u], units[n]
        o = reader.inputs[j][1]
        src = prod.strategies[choice[u]][0][o]
        dst = reader.strategies[choice[n]][1][j]
        if (u, o, src, dst) in made:
            continue
        made.add((u, o, src, dst))
        c = float(e.cost[choice[u], choice[n]])
        pooled = e.pools[choice[u]][choice[n]] if e.pools is not None else None
        for key, latency in pooled or ():
            pools.setdefault(key, [latency, 0])[1] += 1
        if c <= 0.0:
            continue
        val = prod.vals[o]
        what = (f"{tuple(val.shape)} {_pl_text(src, mesh, val.ndim)} -> "
                f"{_pl_text(dst, mesh, val.ndim)}")
        key = (_where(reader.node) if reader.node is not None else f"output {reader.path}", what)
        row = by_where.setdefault(key, {"where": key[0], "move": what, "count": 0, "seconds": 0.0})
        row["count"] += 1
        row["seconds"] += c
    for (*where, group, dtype), (latency, count) in pools.items():
        at = ("the step's tail" if where[0] == "tail"
              else f"{units[where[1]].node.name}'s inputs")
        over = "the mesh" if group == "mesh" else repr(mesh.axis_names[group])
        by_where[("pool", *where, group, dtype)] = {
            "where": at, "move": f"latency of {count} {dtype} all-reduce(s) over {over}, merged",
            "count": 1, "seconds": latency}
    top = sorted(by_where.values(), key=lambda r: -r["seconds"])
    # compute by op
    by_op: dict = {}
    for i, u in enumerate(units):
        if u.kind != "op":
            continue
        name = str(getattr(u.node.target, "__name__", u.node.target))
        by_op[name] = by_op.get(name, 0.0) + u.compute[choice[i]]
    return {
        "inputs": inputs, "outputs": outputs,
        "blocks": list(blocks.values()),
        "objective_s": sol.objective, "compute_s": sol.compute_s, "moves_s": sol.moves_s,
        "memory_bytes": sol.memory_bytes, "budget": request.budget,
        "moves": top, "compute_by_op": dict(sorted(by_op.items(), key=lambda kv: -kv[1])),
        "model": model.name, "mesh": repr(mesh),
        "units": len(units), "variables": sol.variables, "constraints": sol.constraints,
        # units that take an identical block's decision (NOTE [Identical blocks share
        # decisions] in _blocks.py), and the decisions the solver made
        "shared_units": sum(1 for i, r in enumerate(shared) if r != i) if shared else 0,
        "decisions": len(set(shared)) if shared else len(units),
        "status": sol.status, **times,
        "applied": 0, "unapplied": 0,          # (the moves written: _decide._apply)
        "unsupported_ops": dict(unsupported),
    }


def _candidates(rep: dict) -> list[str]:
    """Which program was kept (NOTE [Two candidates] in sharded/auto/_decide.py)."""
    cands = rep.get("candidates")
    if not cands:
        return []
    said = {"propagation": "DTensor's propagation from the chosen input layouts",
            "solver's moves": f"the solver's {rep['applied']} moves written into the program"}
    line = (f"  program: {said[rep['chosen']]}; predicted from its collectives: "
            + ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in cands.items()))
    if rep.get("propagation_failed"):
        line += f"; DTensor's propagation failed: {rep['propagation_failed']}"
    return [line]


def _choices(found: dict) -> str:
    """One spec, or each spec with how many of the block's tensors took it."""
    if len(found) == 1:
        return next(iter(found))
    return " | ".join(f"{spec} x{n}" for spec, n in found.items())


def explain(rep: dict, lowered_cost: dict | None = None) -> str:
    """The report as text: the chosen layout per block, then the terms of the
    objective (compute, moves, memory) and the most expensive moves."""
    mb = 2 ** 20
    lines = [f"AUTO layouts on {rep['mesh']} (cost model: {rep['model']})",
             f"  solved in {rep['solve_s']:.2f} s ({rep['variables']} variables, "
             f"{rep['constraints']} constraints, {rep['decisions']} decisions for "
             f"{rep['units']} units: {rep['shared_units']} take an identical block's; "
             f"built in {rep['build_s']:.2f} s)",
             f"  predicted per step: compute {rep['compute_s'] * 1e3:.3f} ms + communication "
             f"{rep['moves_s'] * 1e3:.3f} ms = {rep['objective_s'] * 1e3:.3f} ms",
             f"  state per rank (inputs and outputs): {rep['memory_bytes'] / mb:.2f} MiB"
             + (f" of a {rep['budget'] / mb:.2f} MiB budget" if rep.get("budget") else ""),
             *_candidates(rep),
             "", "Chosen layout per block (inputs; list indices as *):"]
    for row in rep["blocks"]:
        specs = ", ".join(f"{leaf or '.'}: {_choices(s)}" for leaf, s in row["specs"].items())
        lines.append(f"  {row['block'] or '(top)'}  [{row['tensors']} tensors, "
                     f"{row['bytes'] / mb:.2f} MiB per rank]  {specs}")
    if rep["outputs"]:
        lines += ["", "Outputs:"]
        lines += [f"  {p}: {s!r}" for p, s in rep["outputs"].items()]
    lines += ["", "Communication the solution pays for (most expensive first):"]
    for row in rep["moves"][:12]:
        lines.append(f"  {row['seconds'] * 1e3:8.3f} ms  {row['count']:4d} x {row['move']}"
                     f"  at {row['where']}")
    if not rep["moves"]:
        lines.append("  none")
    lines += ["", "Compute by op (predicted, this rank):"]
    for name, s in list(rep["compute_by_op"].items())[:8]:
        lines.append(f"  {s * 1e3:8.3f} ms  {name}")
    if rep["unapplied"]:
        lines.append(f"\n{rep['unapplied']} chosen move(s) to a layout no P expresses "
                     f"were left to DTensor's propagation.")
    if rep["unsupported_ops"]:
        lines.append(f"Ops with no strategy (kept replicated): {rep['unsupported_ops']}")
    if lowered_cost is not None:
        lines.append(f"\nThe lowered program's collectives: {lowered_cost}")
    return "\n".join(lines)
