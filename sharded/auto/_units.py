"""The decisions of the AUTO layout solver: one unit per op of the global program (per
element of a foreach/fused op), each with the strategies DTensor's own rules allow.

NOTE [Units and strategies]
A unit is one layout decision: a placeholder (an input's layout), an op (which of its
strategies runs it: the layout of each tensor input it needs and of each output it
gives), or an output the user left to the solver. Values are ``(unit, output index)``;
``getitem`` picks a value, it decides nothing. The strategies come from DTensor
(``_torch.op_strategies``: every strategy its rules allow, given the layouts the inputs
may arrive in); an op with no strategy function (DTensor decomposes it, or a custom op)
is probed: DTensor's own plan for each layout its largest input may have, every tensor
input of its rank in that layout, and all replicated. A strategy that needs a
``_StridedShard`` or a dim that its mesh axes do not divide is dropped: a program
traced once for every rank cannot hold uneven shards (NOTE [Residual layouts] in
sharded/lowering.py).
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.distributed.tensor import Partial, Replicate, Shard

from sharded import _region, _torch
from sharded.api import CONSTRAINT_OP, constraint_spec
from sharded.auto.cost import node_flops_bytes, tensor_bytes, tensor_vals
from sharded.spec import to_placements

_RNG = "sharded::rng"


@dataclass
class Unit:
    """One decision: ``strategies[k] = (outs, ins)``, ``outs`` per output its
    placements (None: not a tensor), ``ins`` per tensor input (``inputs``) the
    placements it needs."""

    node: fx.Node | None
    kind: str                          # "input", "op", "output"
    strategies: list
    inputs: list = field(default_factory=list)     # per tensor input: the value read
    setters: list = field(default_factory=list)    # per tensor input: replaces it in the node
    vals: list = field(default_factory=list)       # per output: the fake value (or None)
    compute: list = field(default_factory=list)    # per strategy: seconds
    elem: int | None = None
    path: str | None = None            # inputs and outputs: the pytree path


def placements_of(val, mesh, candidates: bool) -> list[tuple]:
    """Every layout a P can give ``val`` on ``mesh`` with even shards (``candidates``),
    or only the replicated one."""
    n = len(mesh.shape)
    if not candidates or not isinstance(val, torch.Tensor) or val.ndim == 0:
        return [(Replicate(),) * n]
    opts = [Replicate()] + [Shard(d) for d in range(val.ndim)]
    return [pl for pl in itertools.product(opts, repeat=n) if even(val.shape, pl, mesh.shape)]


def even(shape, placements, mesh_shape) -> bool:
    """Whether ``placements`` split ``shape`` evenly (a dim may be split by several
    axes, in mesh-axis order); False for a _StridedShard."""
    sizes = list(shape)
    for size, p in zip(mesh_shape, placements):
        if type(p) is Shard:
            if p.dim >= len(sizes) or sizes[p.dim] % size:
                return False
            sizes[p.dim] //= size
        elif isinstance(p, Partial):
            if p.reduce_op != "sum":        # (an average's partials: the losses are sums here)
                return False
        elif type(p) is not Replicate:
            return False
    return True


class Builder:
    """Builds the units of a global program (NOTE [Units and strategies])."""

    def __init__(self, gm: fx.GraphModule, mesh, model):
        self.gm, self.mesh, self.model = gm, mesh, model
        self.dm = mesh.device_mesh
        self.units: list[Unit] = []
        self.value: dict = {}        # fx node -> (unit, out index) | ("list", node, k) | list
        self.unsupported: dict[str, int] = {}

    # -- values -------------------------------------------------------------------
    def _cands(self, v) -> _torch.Candidates | None:
        u, o = v
        val = self.units[u].vals[o]
        pls = []
        for outs, _ in self.units[u].strategies:
            if outs[o] not in pls:
                pls.append(outs[o])
        return _torch.Candidates(val, pls)

    def add_input(self, node: fx.Node, path: str, placements: list) -> int:
        u = Unit(node, "input", [((pl,), ()) for pl in placements], vals=[node.meta["val"]],
                 path=path)
        u.compute = [0.0] * len(placements)
        self.units.append(u)
        self.value[node] = (len(self.units) - 1, 0)
        return len(self.units) - 1

    def add_node(self, node: fx.Node) -> None:
        if node.target is operator.getitem:
            src, k = node.args
            got = self.value.get(src)
            if isinstance(got, tuple) and got[0] == "multi":         # an op's k-th output
                self.value[node] = (got[1], k)
            elif isinstance(got, tuple) and got[0] == "foreach":     # a foreach op's k-th list
                self.value[node] = ("list", got[1], k)
            elif isinstance(got, tuple) and got[0] == "list":        # ... its element k
                self.value[node] = (self.value[("elem", got[1], k)], got[2])
            return
        if node.op != "call_function":
            return
        flat, setters = self._tensor_args(node)
        val = node.meta.get("val")
        if isinstance(val, (list, tuple)) and any(isinstance(x, (list, tuple)) for x in val):
            self._add_foreach(node, flat, setters)
            return
        strategies = self._strategies(node, flat)
        outs_vals = list(val) if isinstance(val, (list, tuple)) else [val]
        unit = Unit(node, "op", strategies, [v for v in flat], setters, outs_vals)
        self._price(unit, node)
        self.units.append(unit)
        u = len(self.units) - 1
        self.value[node] = ("multi", u) if isinstance(val, (list, tuple)) else (u, 0)

    def _add_foreach(self, node, flat, setters) -> None:
        """A foreach/fused op: one unit per list element (its strategies are per
        element in DTensor's rules too)."""
        lists = [a for a in list(node.args) + list(node.kwargs.values())
                 if isinstance(a, (list, tuple)) and a and all(isinstance(x, fx.Node) for x in a)]
        n = len(lists[0]) if lists else 0
        args = [self._arg(a) for a in node.args]
        kwargs = {k: self._arg(v) for k, v in node.kwargs.items()}
        per_elem = None
        if isinstance(node.target, _torch.OpOverload):
            try:
                per_elem = _torch.op_strategies(node.target, args, kwargs, self.dm)
            except Exception:       # noqa: BLE001 (no rule for these arguments)
                per_elem = None
        val = node.meta["val"]
        for i in range(n):
            # this element's tensor inputs: the i-th of each list, and the tensors
            # that are not in a list
            idx = [j for j, w in enumerate(setters) if w[2] in (None, i)]
            vals = [(v[i] if i < len(v) else None) if isinstance(v, (list, tuple)) else v for v in val]
            strategies = self._clean(per_elem[i] if per_elem is not None and i < len(per_elem)
                                     else None, [flat[j] for j in idx], vals)
            if not strategies:
                name = _torch.op_name(node.target)
                self.unsupported[name] = self.unsupported.get(name, 0) + 1
                strategies = [self._replicated([flat[j] for j in idx], vals)]
            unit = Unit(node, "op", strategies, [flat[j] for j in idx], [setters[j] for j in idx],
                        vals, elem=i)
            self._price(unit, node)
            self.units.append(unit)
            self.value[("elem", node, i)] = len(self.units) - 1
        self.value[node] = ("foreach", node)

    # -- strategies -----------------------------------------------------------------
    def _arg(self, a):
        if isinstance(a, fx.Node):
            v = self.value.get(a)
            if isinstance(v, tuple) and len(v) == 2 and isinstance(v[0], int):
                return self._cands(v)
            return a.meta.get("val")
        if isinstance(a, (list, tuple)):
            return type(a)(self._arg(x) for x in a)
        return a

    def _tensor_args(self, node):
        """The tensor inputs in flatten order: their values, and where each sits
        (``(container, key, list position or None)`` for ``set_input``)."""
        flat, where = [], []

        def visit(container, key, a, pos):
            if isinstance(a, fx.Node):
                v = self.value.get(a)
                if isinstance(v, tuple) and len(v) == 2 and isinstance(v[0], int):
                    flat.append(v)
                    where.append((container, key, pos))
            elif isinstance(a, (list, tuple)) and pos is None:
                for i, x in enumerate(a):
                    visit((container, key), i, x, i)

        for i, a in enumerate(node.args):
            visit("args", i, a, None)
        for k, a in node.kwargs.items():
            visit("kwargs", k, a, None)
        return flat, where

    def _strategies(self, node, flat) -> list:
        vals = node.meta.get("val")
        vals = list(vals) if isinstance(vals, (list, tuple)) else [vals]
        target = node.target
        n = len(self.mesh.shape)
        if target is CONSTRAINT_OP:               # the user's with_sharding_constraint
            pl = to_placements(constraint_spec(node.args[1]), self.mesh)
            return [((pl,), (pl,))]
        if target is _region.REGION_OP:          # a shard_map: the layouts its specs name
            region = _region.lookup(node.args[1], self.gm)
            if len(region.in_placements) == len(flat):
                return [(tuple(tuple(p) for p in region.out_placements),
                         tuple(tuple(p) for p in region.in_placements))]
        if _torch.op_name(target) == _RNG:       # a draw: any layout, computed locally
            outs = placements_of(vals[0], self.mesh, True)
            return [((pl,), tuple((Replicate(),) * n for _ in flat)) for pl in outs]
        found = None
        if isinstance(target, _torch.OpOverload) and target.namespace == "aten":
            args = [self._arg(a) for a in node.args]
            kwargs = {k: self._arg(v) for k, v in node.kwargs.items()}
            try:
                got = _torch.op_strategies(target, args, kwargs, self.dm)
                found = got[0] if got else None
            except Exception:       # noqa: BLE001 (no rule for these arguments: probe)
                found = None
            if found is None:
                found = self._probe(node, flat)
        strategies = self._clean(found, flat, vals)
        if not strategies:
            self.unsupported[_torch.op_name(target)] = self.unsupported.get(_torch.op_name(target), 0) + 1
        return strategies or [self._replicated(flat, vals)]

    def _replicated(self, flat, vals):
        r = (Replicate(),) * len(self.mesh.shape)
        return (tuple(r if isinstance(v, torch.Tensor) else None for v in vals), tuple(r for _ in flat))

    def _probe(self, node, flat) -> list:
        """DTensor's plan for each layout the largest tensor input may arrive in, every
        tensor input of its rank in that layout (others replicated)."""
        if not flat:
            return []
        # the largest tensor input leads (mse_loss_backward's first is a scalar gradient)
        first = max((self._cands(v) for v in flat), key=lambda c: c.val.numel())
        r = (Replicate(),) * len(self.mesh.shape)
        found = []
        for pl in first.placements:
            cands = {}
            for v in flat:
                c = self._cands(v)
                want = pl if (c.val.ndim == first.val.ndim and even(c.val.shape, pl, self.mesh.shape)) else r
                cands[v] = _torch.Candidates(c.val, [want])

            def sub(a):
                if isinstance(a, fx.Node):
                    v = self.value.get(a)
                    if isinstance(v, tuple) and len(v) == 2 and isinstance(v[0], int):
                        return cands[v]
                    return a.meta.get("val")
                if isinstance(a, (list, tuple)):
                    return type(a)(sub(x) for x in a)
                return a

            got = _torch.probe_op(node.target, [sub(a) for a in node.args],
                                  {k: sub(v) for k, v in node.kwargs.items()}, self.dm)
            if got is not None and got not in found:
                found.append(got)
        return found

    def _clean(self, found, flat, vals) -> list:
        """Drop the strategies with uneven or strided shards, or that do not match the
        op's tensors; deduplicate."""
        if found is None:
            return []
        out, seen = [], set()
        in_vals = [self.units[u].vals[o] for u, o in flat]
        for outs, ins in found:
            if len(ins) != len(flat):
                continue
            outs = tuple(outs) + (None,) * (len(vals) - len(outs))
            ok = all(even(v.shape, p, self.mesh.shape) for v, p in zip(in_vals, ins) if p is not None)
            ok = ok and all(p is None or not isinstance(v, torch.Tensor) or even(v.shape, p, self.mesh.shape)
                            for v, p in zip(vals, outs))
            ok = ok and all(p is not None for p in ins)
            key = (outs, ins)
            if ok and key not in seen:
                seen.add(key)
                out.append(key)
        return out

    def _price(self, unit: Unit, node) -> None:
        """Each strategy's compute: the op's flops and bytes (an element of a foreach op:
        its own tensors'), over the ranks that split it, plus the model's per-op cost;
        a view computes nothing."""
        if unit.elem is None:
            fb = node_flops_bytes(node)
            if fb is None:
                unit.compute = [0.0] * len(unit.strategies)
                return
            flops, nbytes = fb
        else:
            flops = float(sum(v.numel() for v in tensor_vals(unit.vals)))
            nbytes = tensor_bytes(unit.vals) + sum(tensor_bytes(self.units[u].vals[o])
                                                   for u, o in unit.inputs)
        mesh_shape = self.mesh.shape
        for outs_pl, _ in unit.strategies:
            first = next((p for p in outs_pl if p is not None), None)
            split = 1
            if first is not None:
                for size, p in zip(mesh_shape, first):
                    if type(p) in (Shard, Partial):
                        split *= size
            unit.compute.append(self.model.op_cost(flops / split, nbytes / split))


def set_input(node: fx.Node, where, new: fx.Node) -> None:
    """Replace the tensor input of ``node`` at ``where`` (from ``Builder._tensor_args``)
    by ``new``."""
    (container, key, _) = where
    if container in ("args", "kwargs"):
        _set(node, container, key, new)
        return
    outer, okey = container
    seq = list(node.args[okey] if outer == "args" else node.kwargs[okey])
    seq[key] = new
    _set(node, outer, okey, seq)


def get_input(node: fx.Node, where) -> fx.Node:
    """The tensor input of ``node`` at ``where`` (from ``Builder._tensor_args``)."""
    (container, key, _) = where
    if container == "args":
        return node.args[key]
    if container == "kwargs":
        return node.kwargs[key]
    outer, okey = container
    return (node.args[okey] if outer == "args" else node.kwargs[okey])[key]


def _set(node: fx.Node, container: str, key, value) -> None:
    if container == "args":
        args = list(node.args)
        args[key] = value
        node.args = tuple(args)
    else:
        node.kwargs = {**node.kwargs, key: value}
