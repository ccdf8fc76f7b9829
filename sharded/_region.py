"""shard_map regions in traced programs: the body traced once into a subgraph, the op
that carries it, its backward, and what one rank runs for it.

# NOTE [shard_map in a traced program]
Inside pjit's global trace, a shard_map call traces its body once, on fake LOCAL
shards, into a ``Region``: an fx graph of aten ops and the collectives as
``sharded::`` primitives (axis names, no ranks: the same graph on every rank, like
JAX's closed jaxpr), with the layouts at its boundary. The global program gets one
op, ``sharded::shard_map(inputs, region)``, whose ``region`` names a submodule of the
global GraphModule (the program owns its regions; nothing outlives it). The op's
autograd rule is the region's vjp, itself a region traced from the forward region's
graph (``Region.vjp``), so gradients of any order come from the subgraph, never from
re-running the user's Python. The partitioner runs a region's graph on this rank's
shards and lowers each primitive to what this rank sends and receives
(``Region.run_local``): the collectives land in the local program next to
DTensor's own.

# NOTE [Closures]
A body may close over tensors. A constant (a real tensor) is the same on every rank:
it is invariant and becomes a constant of the subgraph. A traced value of the
enclosing program (a pjit input, or a value computed from one) cannot be a constant
of the subgraph: the trace finds such values (by their fake mode) and traces the
body again with them as extra inputs, replicated over the mesh (invariant), so that
gradients flow back to them through the op, as in JAX (closed-over tracers are
implicit inputs).

# NOTE [Random numbers in a body]
A random op in a body (torch.rand, dropout, ...) draws from the counter-based
generator (docs/random.md): the region gets one more input, ``(seed, offset)``, and
draw ``d`` of the body has the values ``Philox(seed, offset + d, i)``, the same in
the forward and in every recomputation (the vjp replays the same draws). A draw varies
over the axes its tensor inputs vary over (``torch.rand(n)``: invariant, the same on
every rank; ``dropout(x)`` with ``x`` split over "dp": a different mask per "dp"
rank): element ``i`` of this rank's draw has index ``c * numel + i``, where ``c`` is
this rank's index along those axes taken together in mesh order. So a value that is
the same on every rank of an axis stays so.
"""

from __future__ import annotations

import itertools
import math
import threading
import weakref
from typing import Callable, Sequence

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from sharded import _manual, _registry, _torch, collectives as C
from sharded._manual import ManualContext, differentiable, manual_region, set_vma, vma_of
from sharded.mesh import mesh_device
from sharded.random import rewrite  # noqa: F401  (fills the manual layer's draw hook)
from sharded.spec import P, axes_of_dim, from_placements, to_placements

_STATE = threading.local()
# Live regions by key. The op's fake kernel gets only the key (a custom op's arguments
# are tensors and plain values), and so do the graphs split from a joint graph, which
# keep the node but not the submodule that owns the region; weak, so a region lives
# as long as the program (the GraphModule) that owns it.
_LIVE: "weakref.WeakValueDictionary[str, Region]" = weakref.WeakValueDictionary()
_COUNTER = itertools.count()


class Region(torch.nn.Module):
    """A shard_map body traced once: ``graph`` takes this rank's input blocks (then
    the captured values, then the rng state if the body draws) and returns its output
    blocks; the placements say how the blocks tile the global values."""

    captured: list             # the enclosing program's values the body closes over

    def __init__(self, graph: fx.GraphModule, *, name, mesh, check_vma, in_placements,
                 in_axes, in_shapes, out_placements, out_axes, out_shapes, out_dtypes,
                 out_local_shapes, n_draws):
        super().__init__()
        self.graph_module = graph
        self.name = name
        self.mesh = mesh
        self.check_vma = check_vma
        self.in_placements = list(in_placements)
        self.in_axes = list(in_axes)
        self.in_shapes = list(in_shapes)          # local
        self.out_placements = list(out_placements)
        self.out_axes = list(out_axes)
        self.out_shapes = list(out_shapes)        # global
        self.out_dtypes = list(out_dtypes)
        self.out_local_shapes = list(out_local_shapes)
        self.n_draws = n_draws
        self.key = f"shard_map_{next(_COUNTER)}"
        self.device = torch.device(mesh.device_type)
        self._derived: dict = {}

    def extra_repr(self):
        return f"{self.name}, key={self.key!r}"

    # -- running the graph ----------------------------------------------------------
    def interpret(self, inputs: Sequence[torch.Tensor]) -> list:
        """Run the graph with each primitive as its autograd.Function (so torch.func
        can differentiate it); inside a manual region."""
        return _Differentiable(self.graph_module).run(*inputs)

    def run_local(self, local_inputs: Sequence[torch.Tensor]) -> list:
        """What this rank runs: the graph with every primitive lowered (under the
        partitioner's recording, the ops land in the local program)."""
        return _Lowering(self.graph_module, self.mesh).run(*local_inputs)

    def dead_outputs(self) -> list:
        """Placeholders for the outputs of a region whose results nothing reads (the
        forward of a vjp whose primal outputs are dropped): no collectives for them."""
        return [torch.empty(s, dtype=d, device=self.device)
                for s, d in zip(self.out_local_shapes, self.out_dtypes)]

    # -- the backward -------------------------------------------------------------------
    def vjp(self, needed: Sequence[int]) -> "Region":
        """The region computing the cotangents of the inputs ``needed`` (floating-point
        ones) from the inputs and the cotangents of the floating-point outputs."""
        diff_in = [i for i in needed if _is_diff(self._in_dtypes[i])]
        key = tuple(diff_in)
        if key in self._derived:
            return self._derived[key]
        n_in = len(self.in_shapes)
        diff_out = [j for j, d in enumerate(self.out_dtypes) if _is_diff(d)]
        fwd = self

        def body(*xs):
            ins, cts = list(xs[:n_in]), xs[n_in:]

            def f(*primals):
                full = list(ins)
                for i, p in zip(diff_in, primals):
                    full[i] = p
                outs = fwd.interpret(full)
                return tuple(outs[j] for j in diff_out)

            _, vjp_fn = torch.func.vjp(f, *[ins[i] for i in diff_in])
            return list(vjp_fn(tuple(cts)))

        in_metas = [(s, d) for s, d in zip(self.in_shapes, self._in_dtypes)] + [
            (self.out_local_shapes[j], self.out_dtypes[j]) for j in diff_out]
        boundary = Boundary(
            in_placements=self.in_placements + [self.out_placements[j] for j in diff_out],
            in_axes=self.in_axes + [self.out_axes[j] for j in diff_out],
            describe=lambda outs: [
                (self.in_placements[i], self.in_axes[i], self._in_global_shape(i),
                 f"{self.name} gradient of input {i}") for i in diff_in],
        )
        vjp = trace_region(body, in_metas, boundary, self.mesh, f"{self.name} (vjp)",
                           self.check_vma)
        vjp.diff_in, vjp.diff_out = diff_in, diff_out
        self._derived[key] = vjp
        return vjp

    # -- vmap ----------------------------------------------------------------------
    def batched(self, in_dims: Sequence[int | None], size: int) -> "Region":
        """The region applied to a batch: inputs with a dim in ``in_dims`` carry the
        batch in dim 0 (never split over the mesh), as do all the outputs."""
        key = ("vmap", tuple(in_dims), size)
        if key in self._derived:
            return self._derived[key]
        if self.n_draws:
            raise NotImplementedError(
                f"{self.name}: torch.func.vmap over a shard_map whose body draws random "
                f"numbers is not supported; draw them outside and pass them in."
            )
        fwd = self
        dims = tuple(0 if d is not None else None for d in in_dims)

        def body(*xs):
            return list(torch.func.vmap(lambda *a: tuple(fwd.interpret(list(a))),
                                        in_dims=dims, out_dims=0)(*xs))

        in_metas = [((size, *s) if d is not None else s, dt)
                    for s, dt, d in zip(self.in_shapes, self._in_dtypes, in_dims)]
        in_pl = [_shift(pl, self.mesh) if d is not None else pl
                 for pl, d in zip(self.in_placements, in_dims)]
        boundary = Boundary(
            in_placements=in_pl, in_axes=self.in_axes,
            describe=lambda outs: [
                (_shift(self.out_placements[j], self.mesh), self.out_axes[j],
                 (size, *self.out_shapes[j]), f"{self.name} (vmap) output {j}")
                for j in range(len(outs))],
        )
        region = trace_region(body, in_metas, boundary, self.mesh, f"{self.name} (vmap)",
                              self.check_vma)
        self._derived[key] = region
        return region

    @property
    def _in_dtypes(self):
        return [n.meta["val"].dtype for n in self.graph_module.graph.nodes if n.op == "placeholder"]

    def _in_global_shape(self, i) -> tuple:
        local = self.in_shapes[i]
        spec = from_placements(self.in_placements[i], self.mesh, len(local))
        return tuple(s * math.prod(self.mesh.size(a) for a in axes_of_dim(spec, d))
                     for d, s in enumerate(local))


def _shift(placements, mesh) -> tuple:
    """Placements of a tensor that got a new leading (batch) dim."""
    from torch.distributed.tensor import Shard

    return tuple(Shard(p.dim + 1) if isinstance(p, Shard) else p for p in placements)


def _is_diff(dtype) -> bool:
    return dtype.is_floating_point or dtype.is_complex


class _Differentiable(fx.Interpreter):
    """The graph with each primitive as its differentiable call (its registry entry's
    ``autograd``)."""

    def call_function(self, target, args, kwargs):
        fn = _registry.AUTOGRAD.get(target)
        if fn is not None:
            return fn(*args, **kwargs)
        return super().call_function(target, args, kwargs)


class _Lowering(fx.Interpreter):
    """The graph with each primitive lowered (its registry entry's ``lower``)."""

    def __init__(self, gm, mesh):
        super().__init__(gm)
        self.mesh = mesh

    def call_function(self, target, args, kwargs):
        lower = _registry.LOWERINGS.get(target)
        if lower is not None:
            return lower(self.mesh, *args, **kwargs)
        return super().call_function(target, args, kwargs)


# -- tracing a body ---------------------------------------------------------------------------

class Boundary:
    """The layouts at a region's boundary: the inputs' placements and axes, and
    ``describe(outs) -> [(placements, axes, global shape, path)]`` for the outputs
    (called on the traced outputs, so out_specs errors surface at trace time)."""

    def __init__(self, in_placements, in_axes, describe: Callable):
        self.in_placements = list(in_placements)
        self.in_axes = list(in_axes)
        self.describe = describe


def trace_region(fn: Callable, in_metas, boundary: Boundary, mesh, name: str,
                 check_vma: bool) -> "Region":
    """Trace ``fn`` (flat local tensors -> flat local tensors) into a Region, on fake
    local shards with ``in_metas`` = [(shape, dtype)], independent of any trace or
    torch.func transform around the call."""
    outer_transforms = _torch.functorch_level() > 0
    with _torch.suspend_dispatch_modes(), _torch.clear_functorch_stack():
        fake_mode = _torch.new_fake_mode()
        device = mesh_device(mesh)
        captured: list = []
        for _attempt in range(3):      # a second pass only if the body closes over traced values
            with fake_mode:
                fakes = [torch.empty(s, dtype=d, device=device) for s, d in in_metas]
                caps = [torch.empty(c.shape, dtype=c.dtype, device=c.device) for c in captured]
                state = torch.empty(2, dtype=torch.int64, device=device)
            info: dict = {}
            traced = _traced_body(fn, len(fakes), captured, boundary, mesh, name, check_vma,
                                  fake_mode, outer_transforms, info)
            try:
                gm = make_fx(traced, tracing_mode="fake")(*fakes, *caps, state)
            except RuntimeError as e:
                if outer_transforms and "wrapped->level() < level" in str(e):
                    raise _manual.closure_under_transforms(name) from None
                raise
            if not info["new_captures"]:
                break
            captured = captured + info["new_captures"]
        else:
            raise RuntimeError(f"{name}: the values the body closes over changed between traces.")
        gm = _functionalize(gm, [*fakes, *caps, state], name)
        gm.graph.eliminate_dead_code()     # e.g. a vjp's recomputed forward outputs
        gm.recompile()
        n_draws = info["n_draws"]
        if not n_draws:
            _drop_last_placeholder(gm)
    outs = info["outs"]
    cap_pl = [to_placements(P(), mesh)] * len(captured)
    state_pl = [to_placements(P(), mesh)] if n_draws else []
    region = Region(
        gm, name=name, mesh=mesh, check_vma=check_vma,
        in_placements=boundary.in_placements + cap_pl + state_pl,
        in_axes=boundary.in_axes + [frozenset()] * (len(captured) + (1 if n_draws else 0)),
        in_shapes=[tuple(s) for s, _ in in_metas] + [tuple(c.shape) for c in captured]
        + ([(2,)] if n_draws else []),
        out_placements=[o[0] for o in outs], out_axes=[o[1] for o in outs],
        out_shapes=[tuple(o[2]) for o in outs], out_dtypes=info["out_dtypes"],
        out_local_shapes=info["out_local_shapes"], n_draws=n_draws,
    )
    region.captured = captured
    return region


def _traced_body(fn, n_in, captured, boundary, mesh, name, check_vma, fake_mode,
                 outer_transforms, info):
    def traced(*xs):
        ins, caps, state = list(xs[:n_in]), xs[n_in:-1], xs[-1]
        ctx = ManualContext(mesh, check_vma, name, eager=False, fake_mode=fake_mode,
                            rng_state=state, outer_transforms=outer_transforms)
        for outer, stand_in in zip(captured, caps):
            ctx.captures[id(_torch.functorch_base(outer))] = (outer, stand_in)
        with manual_region(ctx):
            for x, axes in zip(ins, boundary.in_axes):
                set_vma(x, axes)
            outs = [_as_tensor(o, name, i) for i, o in enumerate(fn(*ins))]
            layouts = boundary.describe(outs)
            outs = finish_outputs(outs, layouts, mesh, check_vma)
        info.update(outs=layouts, new_captures=ctx.new_captures, n_draws=ctx.n_draws,
                    out_dtypes=[o.dtype for o in outs],
                    out_local_shapes=[tuple(o.shape) for o in outs])
        return outs

    return traced


def _as_tensor(o, name: str, i: int):
    if isinstance(o, torch.Tensor):
        return o
    if isinstance(o, (bool, int, float)):     # a Python number: the same on every rank
        return torch.tensor(o)
    raise TypeError(
        f"{name}: output leaf {i} is {type(o).__name__}; shard_map outputs must be "
        f"tensors (or Python numbers)."
    )


def finish_outputs(outs, layouts, mesh, check_vma: bool, cast: bool = True) -> list:
    """Check each output's varying axes against its spec and make them equal: the
    implicit pvary at the output (an out_spec naming an axis the value does not vary
    over: its transpose sums the cotangents), or, with check_vma=False, the user's
    word that the value is the same along the axes its spec does not name. (Eagerly
    the casts, identities for the values, are skipped: ``cast=False``.)"""
    done = []
    for o, (placements, allowed, shape, path) in zip(outs, layouts):
        extra = vma_of(o) - allowed
        if extra:
            if check_vma:
                axis = _manual._ordered(mesh, extra)[0]
                raise ValueError(
                    f"{path} does not name mesh axis {axis!r}, so the output must be the "
                    f"same on every rank along it, but the function leaves it varying over "
                    f"{axis!r}. Reduce it (psum/pmean/all_gather over {axis!r}) or add "
                    f"{axis!r} to its spec. (check_vma=False skips this check.)"
                )
            if cast and differentiable(o):
                o = C.unvary(o, _manual._ordered(mesh, extra))
        missing = allowed - vma_of(o)
        if cast and missing and differentiable(o):
            o = C.pvary(o, _manual._ordered(mesh, missing))
        done.append(o)
    return done


def functionalized(gm: fx.GraphModule, fakes) -> fx.GraphModule:
    """``gm`` without in-place ops: traced again under ``torch.func.functionalize``
    (views kept; NOTE [Trace, then functionalize] in sharded/_trace.py) when it has
    any, else ``gm`` itself. A write into an input becomes a ``copy_`` into its
    placeholder at the end (``mutated_inputs``). ``fakes``: the inputs, or a function
    that makes them (where the first trace may have changed its own in place)."""
    if not any(n.op == "call_function" and _torch.is_mutating_op(n.target) for n in gm.graph.nodes):
        return gm
    inputs = fakes() if callable(fakes) else fakes
    return make_fx(torch.func.functionalize(gm, remove="mutations"), tracing_mode="fake")(*inputs)


def mutated_inputs(gm: fx.GraphModule) -> list[int]:
    """Indices of the placeholders that the functionalized ``gm`` writes back into."""
    placeholders = gm.graph.find_nodes(op="placeholder")
    index = {p: i for i, p in enumerate(placeholders)}
    return [index[n.args[0]] for n in gm.graph.nodes
            if n.op == "call_function" and n.target is torch.ops.aten.copy_.default
            and n.args[0] in index]


def _functionalize(gm: fx.GraphModule, fakes, name: str) -> fx.GraphModule:
    """The region's graph without in-place ops (as pjit's global graph: the passes and
    the partitioner need a functional program); mutating an input is an error."""
    gm = functionalized(gm, fakes)
    mutated = mutated_inputs(gm)
    if mutated:
        raise ValueError(
            f"{name}: the body mutates its input {mutated[0]} in "
            f"place; shard_map bodies must not change their inputs. Return the new "
            f"value instead (e.g. `w = w - lr * g` rather than `w.sub_(lr * g)`)."
        )
    return gm


def _drop_last_placeholder(gm: fx.GraphModule) -> None:
    last = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
    if not last.users:
        gm.graph.erase_node(last)
        gm.recompile()


# -- the op in the global program -------------------------------------------------------------

class region_scope:
    """Context around a global trace: the regions its shard_map calls create, to be
    attached to the traced GraphModule (``attach``)."""

    def __enter__(self):
        self.prev = getattr(_STATE, "scope", None)
        self.regions: list[Region] = []
        _STATE.scope = self.regions
        return self

    def __exit__(self, *exc):
        _STATE.scope = self.prev

    def attach(self, gm: fx.GraphModule) -> None:
        for r in self.regions:
            gm.add_submodule(r.key, r)


def register(region: Region) -> str:
    scope = getattr(_STATE, "scope", None)
    if scope is None:
        raise RuntimeError("a shard_map region can only be created inside pjit's trace.")
    scope.append(region)
    _LIVE[region.key] = region
    return region.key


def lookup(key: str, module: torch.nn.Module | None = None) -> Region:
    region = _LIVE.get(key)
    if region is None and module is not None:
        region = getattr(module, key, None)
    if region is None:
        raise RuntimeError(f"sharded::shard_map: region {key!r} is not part of this program.")
    return region


@torch.library.custom_op("sharded::shard_map", mutates_args=())
def _region_op(inputs: list[torch.Tensor], region: str) -> list[torch.Tensor]:
    raise RuntimeError("sharded::shard_map runs only inside pjit's partitioner.")


@_region_op.register_fake
def _(inputs, region):
    r = lookup(region)
    return [torch.empty(s, dtype=d, device=r.device) for s, d in zip(r.out_shapes, r.out_dtypes)]


REGION_OP = torch.ops.sharded.shard_map.default


class RegionFn(torch.autograd.Function):
    """The region as one differentiable op of the global program; its backward is the
    vjp region (NOTE [shard_map in a traced program])."""

    @staticmethod
    def forward(key, *inputs):
        return tuple(REGION_OP(list(inputs), key))

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.key = inputs[0]
        ctx.save_for_backward(*inputs[1:])

    @staticmethod
    def backward(ctx, *cts):
        inputs = ctx.saved_tensors
        region = lookup(ctx.key)
        needs = getattr(ctx, "needs_input_grad", None) or (True,) * (1 + len(inputs))
        needed = [i for i, x in enumerate(inputs) if differentiable(x) and needs[1 + i]]
        if not needed:
            return (None,) * (1 + len(inputs))
        vjp = region.vjp(needed)
        register(vjp)
        cts = [torch.zeros(s, dtype=d, device=region.device) if ct is None else ct.to(d)
               for ct, s, d in zip(cts, region.out_shapes, region.out_dtypes)]
        cts = [cts[j] for j in vjp.diff_out]
        grads = RegionFn.apply(vjp.key, *inputs, *cts)
        result = [None] * len(inputs)
        for i, g in zip(vjp.diff_in, grads):
            result[i] = g
        return (None, *result)


def _region_jvp(ctx, *tangents):
    raise NotImplementedError(
        f"{lookup(ctx.key).name}: forward-mode differentiation (torch.func.jvp, jacfwd) "
        f"through a shard_map is not supported; use reverse mode (grad, vjp, jacrev)."
    )


RegionFn.jvp = staticmethod(_region_jvp)


def _region_vmap(info, in_dims, key, *inputs):
    """torch.func.vmap over a region: one batched region (batch dims moved first)."""
    batched = lookup(key).batched(in_dims[1:], info.batch_size)
    moved = [x.movedim(d, 0) if d is not None else x for x, d in zip(inputs, in_dims[1:])]
    outs = RegionFn.apply(register(batched), *moved)
    return tuple(outs), (0,) * len(outs)


RegionFn.vmap = staticmethod(_region_vmap)


def call(region: Region, inputs: Sequence[torch.Tensor]) -> list:
    """Emit the region's op into the global trace."""
    key = register(region)
    return list(RegionFn.apply(key, *inputs))
