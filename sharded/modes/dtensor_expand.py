"""DTensorExpandMode: propagate the input layouts op by op with DTensor's sharding
rules, and trace what DTensor does for this rank into a plain local graph.

# NOTE [Expansion by one make_fx over an Interpreter]
The global graph is run by an ``fx.Interpreter`` on DTensors built from fake local
shards, under one ``make_fx``. DTensor picks each op's output layout, inserts the
redistributes as functional collectives and computes local shapes and rank-dependent
constants (the row-sharded embedding's mask bounds); make_fx records the aten ops it
runs on the local shards. Tracing op by op instead would lose state that DTensor keeps
in placements across ops (``_MaskPartial`` carries the embedding mask) and silently
bake it as a constant. The Interpreter keeps node attribution for error messages.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.experimental import implicit_replication
from torch.fx.experimental.proxy_tensor import make_fx

from sharded import _manual, _torch, rules  # noqa: F401  (rules registers the project's shardings)
from sharded.api import CONSTRAINT_OP, constraint_spec
from sharded.random.rewrite import RNG_OP, sample
from sharded.modes.base import ParallelMode, Partitioned, ShardingRuleError
from sharded.spec import block, check_spec, local_shape, from_placements, to_placements

_NO_RULE = "does not have a sharding strategy registered"

aten = torch.ops.aten

# NOTE [Where a pending reduction may travel]
# A Partial (pending sum) value stays Partial through ops that are linear in it:
# views, sums, matmuls with a non-partial operand, scaling, and add/sub of two
# partials. Anywhere else it is reduced to Replicate first. Left to its greedy
# cost model, DTensor instead reduce-scatters a partial that meets a replicated
# operand (e.g. the residual add after a row-parallel matmul) and all-gathers it again
# before the next matmul; on a 2x2 mesh a 2-layer GPT step took 95 collectives that way.
# A masked partial (the row-sharded embedding's _MaskPartial) never travels: its
# reduction applies the ids mask, valid only on the embedding's own output.
# A partial value read by more than one op is reduced once, where it is produced:
# otherwise each consumer reduces its own derived copy (AdamW reads a gradient twice,
# which cost two all-reduces per parameter), and the gradient reductions, all
# produced in the backward pass and read in the update, could not be bucketed.
_LINEAR_IN_PARTIAL = {
    aten.view, aten._unsafe_view, aten.reshape, aten.t, aten.transpose, aten.permute,
    aten.unsqueeze, aten.squeeze, aten.expand, aten.clone, aten.alias, aten.detach,
    aten.slice, aten.select, aten.split, aten.split_with_sizes, aten.neg, aten.sum,
    aten.mm, aten.bmm, aten.addmm, aten.mul, aten.div, aten.add, aten.sub,
}
_ADDITIVE = {aten.add, aten.sub}


class DTensorExpandMode(ParallelMode):
    """Propagate input placements through the program with DTensor's op strategies.

    A pending reduction (Partial) left on an output whose spec is unspecified is
    reduced to Replicate, so outputs always have a PartitionSpec.

    ``compile=True`` runs the local graph through ``torch.compile`` (inductor): it
    fuses elementwise chains such as the counter-based RNG's, at a compile cost of
    seconds to a minute on CPU.
    """

    name = "DTensorExpandMode"

    def __init__(self, *, compile: bool = False):
        self.compile = compile

    def runner(self, graph):
        return torch.compile(graph, backend="inductor", fullgraph=True) if self.compile else graph

    def cache_key(self) -> tuple:
        return (type(self).__name__, self.compile)

    def __repr__(self):
        return f"DTensorExpandMode(compile={self.compile})"

    def partition(self, graph, in_placements, out_specs, mesh) -> Partitioned:
        dm = mesh.device_mesh
        metas = [n.meta["val"] for n in graph.graph.nodes if n.op == "placeholder"]
        fake_mode = _torch.new_fake_mode()
        with fake_mode:
            local_inputs = [
                torch.empty(
                    local_shape(m.shape, from_placements(pl, mesh, m.ndim), mesh),
                    dtype=m.dtype, device=m.device if m.device.type != "meta" else "cpu",
                )
                for m, pl in zip(metas, in_placements)
            ]
        out_placements: list = []

        def run_local(*locals_):
            dts = [
                DTensor.from_local(x, dm, pl, run_check=False, shape=m.shape, stride=m.stride())
                for x, pl, m in zip(locals_, in_placements, metas)
            ]
            with implicit_replication():
                outs = _Expander(graph, self, mesh).run(*dts)
            out_placements.clear()
            result = []
            for i, (o, spec) in enumerate(zip(outs, out_specs)):
                if not isinstance(o, DTensor):  # a factory output: same on every rank
                    o = DTensor.from_local(o, dm, [Replicate()] * mesh.ndim, run_check=False)
                target = to_placements(spec, mesh) if spec is not None else _reduced(o.placements)
                if tuple(o.placements) != target:
                    o = o.redistribute(dm, target)
                out_placements.append(tuple(o.placements))
                result.append(o.to_local())
            return result

        with _torch.dtensor_caches_while_tracing():
            local = make_fx(run_local, tracing_mode="fake")(*local_inputs)
        return Partitioned(local, list(out_placements))


class _Expander(fx.Interpreter):
    def __init__(self, gm, mode, mesh):
        super().__init__(gm)
        self.mode = mode
        self.mesh = mesh

    def call_function(self, target, args, kwargs):
        if target is CONSTRAINT_OP:
            x, spec_id = args
            spec = constraint_spec(spec_id)
            check_spec(spec, x.shape, self.mesh, "with_sharding_constraint spec")
            if not isinstance(x, DTensor):   # made from nothing: the same on every rank
                x = DTensor.from_local(x, self.mesh.device_mesh, [Replicate()] * self.mesh.ndim,
                                       run_check=False)
            return x.redistribute(self.mesh.device_mesh, to_placements(spec, self.mesh))
        if target is RNG_OP:
            return self._random(self._node, *args, **kwargs)
        if target is _manual.SHARD_MAP_OP:
            inputs, body_id = args
            body = _manual.get_body(body_id)
            outs = _manual.run_body(body, self._locals(inputs, body.in_placements))
            return self._globals(outs, body.out_placements, body.out_shapes)
        if target is _manual.SHARD_MAP_VJP_OP:
            inputs, cts, body_id = args
            body = _manual.get_body(body_id)
            grads = _manual.run_body_vjp(body, self._locals(inputs, body.in_placements),
                                         self._locals(cts, body.out_placements))
            return self._globals(grads, body.in_placements, [x.shape for x in inputs])
        if isinstance(target, _torch.OpOverload):
            args, kwargs = self._reduce_partials(target, args, kwargs)
        return super().call_function(target, args, kwargs)

    def _random(self, n, seed, offset, draw, shape, kind, a, b, dtype, like=None, p=None):
        """This rank's block of a random draw (NOTE [Random numbers that do not depend
        on the mesh]): computed from the global indices of the elements it holds."""
        placements = self._random_layout(n, shape, like, p)
        sizes, starts = block(shape, placements, self.mesh)
        seed, offset = seed.to_local(), offset.to_local()
        p_local = self._locals([p], [placements])[0] if p is not None else None
        region = (tuple(shape), sizes, starts, seed.device)
        values = sample(seed, offset + draw, region, kind, a, b, dtype, p_local)
        return DTensor.from_local(values, self.mesh.device_mesh, placements, run_check=False,
                                  shape=torch.Size(shape), stride=_contiguous_strides(shape))

    def _random_layout(self, n, shape, like, p):
        """Where a draw's block should live: like its probabilities or its like-tensor,
        else like a same-shaped operand of a consumer, else replicated."""
        shape = tuple(shape)
        candidates = [p, like] + [
            self.env.get(a) for u in n.users for a in u.all_input_nodes if a is not n
        ]
        for c in candidates:
            if isinstance(c, DTensor) and tuple(c.shape) == shape and all(
                    type(pl) in (Shard, Replicate) or _torch.is_partial(pl) for pl in c.placements):
                return _reduced(c.placements)
        return (Replicate(),) * self.mesh.ndim

    def _locals(self, xs, placements):
        """This rank's shards of ``xs`` laid out as ``placements`` (a manual region's
        inputs)."""
        dm = self.mesh.device_mesh
        out = []
        for x, pl in zip(xs, placements):
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, dm, [Replicate()] * self.mesh.ndim, run_check=False)
            if tuple(x.placements) != tuple(pl):
                x = x.redistribute(dm, pl)
            out.append(x.to_local())
        return out

    def _globals(self, locals_, placements, shapes):
        dm = self.mesh.device_mesh
        return [
            DTensor.from_local(x, dm, pl, run_check=False, shape=torch.Size(shape),
                               stride=_contiguous_strides(shape))
            for x, pl, shape in zip(locals_, placements, shapes)
        ]

    def _reduce_partials(self, target, args, kwargs):
        dts = [a for a in (*args, *kwargs.values()) if isinstance(a, DTensor)]
        partial = [a for a in dts if any(_torch.is_partial(p) for p in a.placements)]
        if not partial:
            return args, kwargs
        packet = target.overloadpacket
        masked = any(not _torch.is_plain_partial(p) for a in partial for p in a.placements
                     if _torch.is_partial(p))
        if packet in _LINEAR_IN_PARTIAL and not masked:
            if packet not in _ADDITIVE or len(partial) == len(dts):
                return args, kwargs
        reduce = self._reduce
        return tuple(reduce(a) for a in args), {k: reduce(v) for k, v in kwargs.items()}

    def _reduce(self, a):
        """``a`` with its pending reductions done (Partial -> Replicate)."""
        if isinstance(a, DTensor) and any(_torch.is_partial(p) for p in a.placements):
            return a.redistribute(self.mesh.device_mesh, _reduced(a.placements))
        return a

    def run_node(self, n):
        self._node = n
        try:
            result = super().run_node(n)
            if len(n.users) > 1 and isinstance(result, DTensor):
                result = self._reduce(result)
            return result
        except (ShardingRuleError, ValueError, TypeError):
            raise
        except Exception as e:  # noqa: BLE001 - re-raised with the node named
            layouts = _layouts(self, n)
            if _NO_RULE in str(e):
                raise ShardingRuleError(
                    f"{self.mode.name} has no sharding rule for {n.target} (node "
                    f"{n.name!r}, inputs {layouts}). Register one with "
                    f"sharded.rules.register_sharding({n.target}) (see docs/concepts.md, "
                    f"'Sharding rules'), or lay its inputs out as Replicate."
                ) from None
            raise RuntimeError(
                f"{self.mode.name} could not partition node {n.name!r} = {n.target}"
                f"(inputs {layouts}): {type(e).__name__}: {e}"
            ) from e


def _layouts(interp, n) -> list[str]:
    out = []
    for a in n.all_input_nodes:
        v = interp.env.get(a)
        if isinstance(v, DTensor):
            out.append(f"{a.name}: {tuple(v.shape)} {tuple(v.placements)}")
        elif isinstance(v, torch.Tensor):
            out.append(f"{a.name}: {tuple(v.shape)} plain")
    return out


def _reduced(placements) -> tuple:
    """``placements`` with every pending reduction done (Partial -> Replicate)."""
    return tuple(Replicate() if _torch.is_partial(p) else p for p in placements)


def _contiguous_strides(shape) -> tuple:
    strides, acc = [], 1
    for size in reversed(tuple(shape)):
        strides.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(strides))
