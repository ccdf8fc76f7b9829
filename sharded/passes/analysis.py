"""Reading collectives out of a per-rank graph: cost and cross-rank fingerprint."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
import torch.fx as fx

from sharded import _torch


@dataclass(frozen=True)
class CollectiveCall:
    """One functional collective in a local graph."""

    kind: str              # all_reduce, all_gather, reduce_scatter, all_to_all, broadcast
    shape: tuple           # shape of the input on this rank
    dtype: torch.dtype
    axis: str | tuple      # mesh axis it runs over (every axis: their tuple), else the group name
    reduce_op: str | None  # "sum", "avg", ... for reductions
    bytes: int             # the larger of its input and output on this rank
    node: str = ""
    group_size: int = 1    # ranks taking part
    wire_bytes: int = 0    # bytes this rank sends with ring algorithms (see cost())

    def __str__(self):
        red = f" {self.reduce_op}" if self.reduce_op else ""
        dt = str(self.dtype).replace("torch.", "")
        return f"{self.kind}{red} {dt}{list(self.shape)} over {self.axis!r}"


def _nbytes(val) -> int:
    if isinstance(val, torch.Tensor):
        return val.numel() * val.element_size()
    return 0


def collectives(gm: fx.GraphModule, mesh=None) -> list[CollectiveCall]:
    out = []
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target not in _torch.COLLECTIVE_OPS:
            continue
        kind = _torch.COLLECTIVE_OPS[n.target]
        inp = n.args[0].meta.get("val")
        res = n.meta.get("val")
        group = n.args[-1]
        axis = (mesh.axis_of_group(group) if mesh is not None else None) or group
        if mesh is not None and axis == group and group == _torch.mesh_group(mesh.device_mesh):
            axis = tuple(mesh.axis_names)       # NOTE [One reduction over every mesh axis]
        reduce_op = n.args[1] if kind in ("all_reduce", "reduce_scatter") else None
        size = _torch.group_from_name(group).size() if isinstance(group, str) else 1
        full = max(_nbytes(inp), _nbytes(res))
        out.append(
            CollectiveCall(
                kind=kind,
                shape=tuple(inp.shape) if inp is not None else (),
                dtype=inp.dtype if inp is not None else None,
                axis=axis,
                reduce_op=reduce_op,
                bytes=full,
                node=n.name,
                group_size=size,
                wire_bytes=int(full * _WIRE.get(kind, lambda k: 1.0)(size)),
            )
        )
    return out


# Bytes one rank sends per byte of the full tensor, with ring algorithms over n ranks:
# an all-gather or a reduce-scatter passes n - 1 blocks of 1/n; an all-reduce is both.
_WIRE = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
}


def cost(gm: fx.GraphModule, mesh=None, by: str = "kind") -> dict:
    """Collectives of a local graph by kind (or by mesh axis, ``by="axis"``):
    ``{"all_reduce": {"count": 2, "bytes": 512, "wire_bytes": 256}, ..., "total":
    {...}}``, per call of the program on this rank. ``bytes`` is the larger of each
    collective's input and output (the full tensor of an all-gather or
    reduce-scatter); ``wire_bytes`` what the rank sends with ring algorithms (an
    all-reduce of B bytes over n ranks sends 2 (n - 1) / n * B)."""
    if by not in ("kind", "axis"):
        raise ValueError(f"cost: by must be 'kind' or 'axis'; got {by!r}.")
    table: dict[str, dict[str, int]] = {}
    total = {"count": 0, "bytes": 0, "wire_bytes": 0}
    for c in collectives(gm, mesh):
        key = c.kind if by == "kind" else (c.axis if isinstance(c.axis, str) else str(c.axis))
        row = table.setdefault(key, {"count": 0, "bytes": 0, "wire_bytes": 0})
        row["count"] += 1
        row["bytes"] += c.bytes
        row["wire_bytes"] += c.wire_bytes
        total["count"] += 1
        total["bytes"] += c.bytes
        total["wire_bytes"] += c.wire_bytes
    table["total"] = total
    return table


def fingerprint(gm: fx.GraphModule, mesh, extra: tuple = ()) -> tuple[str, list[str]]:
    """A digest of the collective sequence (kinds, shapes, dtypes, axes) plus ``extra``.

    Ranks of one program must issue the same collectives in the same order; comparing
    digests before the first run turns a would-be hang into an error.
    """
    lines = [str(x) for x in extra] + [str(c) for c in collectives(gm, mesh)]
    digest = hashlib.sha1("\n".join(lines).encode()).hexdigest()
    return digest, lines


def memory(gm: fx.GraphModule) -> dict:
    """A static estimate of this rank's memory while it runs ``gm``: bytes of the
    inputs (held by the caller throughout), and the peak of live bytes (inputs plus
    every intermediate from the op that allocates it to its last use, as the
    generated code frees it, or to the wait of a gather or reduce-scatter that reads
    it; views and in-place ops allocate nothing), with the node
    where it is reached. ``{"input_bytes", "output_bytes", "peak_bytes", "peak_node"}``."""
    held_until_wait = (_torch.c10d_functional.reduce_scatter_tensor.default,
                       _torch.c10d_functional.all_gather_into_tensor.default)

    nodes = list(gm.graph.nodes)
    sizes: dict = {}
    first: dict = {}
    last: dict = {}
    for i, n in enumerate(nodes):
        vals = n.meta.get("val")
        for v in vals if isinstance(vals, (list, tuple)) else [vals]:
            if isinstance(v, torch.Tensor):
                key = _torch.storage_key(v)
                sizes[key] = v.untyped_storage().nbytes()
                first.setdefault(key, i)
                last[key] = i
        for a in n.all_input_nodes:
            avals = a.meta.get("val")
            for v in avals if isinstance(avals, (list, tuple)) else [avals]:
                if isinstance(v, torch.Tensor):
                    last[_torch.storage_key(v)] = i
    # a gather's or reduce-scatter's input is held by its work until the wait (the
    # functional all-reduce runs on a copy made when it is issued)
    pos = {n: i for i, n in enumerate(nodes)}
    for n in nodes:
        if n.op == "call_function" and n.target in held_until_wait:
            wait = next((u for u in n.users if u.target is _torch.WAIT_OP), None)
            val = n.args[0].meta.get("val") if isinstance(n.args[0], fx.Node) else None
            if wait is not None and isinstance(val, torch.Tensor):
                key = _torch.storage_key(val)
                last[key] = max(last.get(key, 0), pos[wait])
    inputs = {_torch.storage_key(n.meta["val"]) for n in nodes
              if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)}
    out_node = nodes[-1]
    outputs = set()
    for a in out_node.all_input_nodes:
        avals = a.meta.get("val")
        for v in avals if isinstance(avals, (list, tuple)) else [avals]:
            if isinstance(v, torch.Tensor):
                outputs.add(_torch.storage_key(v))
    for key in inputs | outputs:
        last[key] = len(nodes)
    allocs: dict = {}
    frees: dict = {}
    for key, i in first.items():
        if key not in inputs:
            allocs.setdefault(i, []).append(key)
            frees.setdefault(last[key], []).append(key)
    live = sum(sizes[k] for k in inputs)
    peak, peak_node = live, None
    for i, n in enumerate(nodes):
        live += sum(sizes[k] for k in allocs.get(i, ()))
        if live > peak:
            peak, peak_node = live, n.name
        live -= sum(sizes[k] for k in frees.get(i, ()))
    return {"input_bytes": sum(sizes[k] for k in inputs),
            "output_bytes": sum(sizes[k] for k in outputs - inputs),
            "peak_bytes": peak, "peak_node": peak_node}
