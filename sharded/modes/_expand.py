"""Expansion: the step every mode shares. Run the global graph on DTensors built from
fake local shards, and record what this rank runs.

# NOTE [Expansion by one recording over an Interpreter]
The global graph is run by an ``fx.Interpreter`` on DTensors built from fake local
shards, under one recording (``_torch.record_fake``: NOTE [Recording the local
program]). DTensor picks each op's output layout, inserts the redistributes as
functional collectives and computes local shapes and rank-dependent constants (the
row-sharded embedding's mask bounds); the recording keeps the aten ops it runs on the
local shards. Tracing op by op instead would lose state that DTensor keeps in
placements across ops (``_MaskPartial`` carries the embedding mask) and silently bake
it as a constant. The Interpreter keeps node attribution for error messages.

# NOTE [Modes are layout policies]
A mode differs from another only in how layouts are chosen (a ``LayoutPolicy``) and in
its passes. The ops that every mode meets and that DTensor knows nothing of are
handled here, once, for every mode (``SPECIAL_OPS``): sharding constraints, the
counter-based random draws and shard_map regions. A policy sees every other op before
DTensor runs it (``before_op``: redistribute its inputs) and every result after
(``after_node``).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.experimental import implicit_replication

from sharded import _region, _registry, _torch, rules  # noqa: F401  (rules registers the project's shardings)
from sharded.api import CONSTRAINT_OP, constraint_spec
from sharded.modes.base import Partitioned, ShardingRuleError
from sharded.random.rewrite import RNG_OP, sample
from sharded.spec import block, check_spec, from_placements, local_shape, reduced, to_placements

_NO_RULE = "does not have a sharding strategy registered"
_F = _torch.c10d_functional


class LayoutPolicy:
    """How a mode chooses layouts on top of DTensor's op strategies. The default
    leaves every choice to DTensor."""

    def before_op(self, ex: "Expander", node: fx.Node, target, args, kwargs):
        """Redistribute an op's DTensor inputs before DTensor runs it; returns
        ``(args, kwargs)``."""
        return args, kwargs

    def after_node(self, ex: "Expander", node: fx.Node, result):
        """Adjust a node's result (e.g. reduce a pending sum once, where produced)."""
        return result

    def output_placements(self, ex: "Expander", index: int, value: DTensor, spec) -> tuple:
        """The placements output ``index`` leaves the program with: its spec's when
        given, else the propagated ones with pending sums reduced."""
        if spec is not None:
            return to_placements(spec, ex.mesh)
        return reduced(value.placements)


def expand(graph: fx.GraphModule, in_placements: Sequence[tuple], out_specs: Sequence,
           mesh, policy: LayoutPolicy, mode_name: str) -> Partitioned:
    """This rank's program for ``graph`` with inputs laid out as ``in_placements`` and
    outputs as ``out_specs`` (None: the policy decides)."""
    dm = mesh.device_mesh
    metas = [n.meta["val"] for n in graph.graph.nodes if n.op == "placeholder"]
    with _torch.new_fake_mode() as fake_mode:
        local_inputs = [
            torch.empty(
                _local_shape(m, pl, mesh),
                dtype=m.dtype, device=m.device if m.device.type != "meta" else "cpu",
            )
            for m, pl in zip(metas, in_placements)
        ]
    out_placements: list = []

    def run_local(*locals_):
        inputs = {id(x) for x in locals_}
        dts = [_input_dtensor(x, dm, pl, m) for x, pl, m in zip(locals_, in_placements, metas)]
        ex = Expander(graph, mesh, policy, mode_name)
        with implicit_replication():
            outs = ex.run(*dts)
        out_placements.clear()
        result = []
        for i, (o, spec) in enumerate(zip(outs, out_specs)):
            o = ex.as_dtensor(o)
            target = tuple(policy.output_placements(ex, i, o, spec))
            o = ex.redistribute(o, target)
            out_placements.append(tuple(o.placements))
            # an output is the local value itself; one that is an input gets a view of
            # it (the program never returns an input as it is; DTensor's to_local
            # made one only with grad enabled). to_local recorded a view of every
            # output, through the fake mode: 374 in a 12-layer GPT-2-small train step
            # (its parameters, two moments, step count and loss).
            local = _torch.local_tensor(o)
            result.append(local.view(local.shape) if id(local) in inputs else local)
        return result

    with _torch.dtensor_caches_while_tracing():     # NOTE [Recording the local program]
        local = _torch.record_fake(run_local, local_inputs, fake_mode)
    # each input keeps its pytree path (passes read it: NOTE [Bucketing] units)
    for g, loc in zip(graph.graph.find_nodes(op="placeholder"), local.graph.find_nodes(op="placeholder")):
        if "sharded_path" in g.meta:
            loc.meta["sharded_path"] = g.meta["sharded_path"]
    return Partitioned(local, list(out_placements))


def _input_dtensor(x, dm, placements, meta) -> DTensor:
    """Input ``x`` (this rank's shard) as a DTensor, wrapped as it is where
    ``DTensor.from_local`` would only add a view of it (NOTE [Expansion cost])."""
    placements = tuple(placements)
    if x.device.type != dm.device_type or any(getattr(p, "dim", 0) < 0 for p in placements):
        return DTensor.from_local(x, dm, placements, run_check=False, shape=meta.shape,
                                  stride=meta.stride())
    return _torch.make_dtensor(x, _torch.build_dtensor_spec(dm, placements, meta.shape,
                                                            meta.stride(), x.dtype))


def _local_shape(meta, placements, mesh) -> tuple:
    try:
        return local_shape(meta.shape, from_placements(placements, mesh, meta.ndim), mesh)
    except ValueError:   # a layout no spec expresses (_StridedShard: a residual of pjit's forward)
        return _torch.local_shape_of(meta.shape, placements, mesh.device_mesh)


class Expander(fx.Interpreter):
    """Runs the global graph on DTensors (see the module NOTEs)."""

    def __init__(self, gm: fx.GraphModule, mesh, policy: LayoutPolicy, mode_name: str):
        super().__init__(gm)
        self.extra_traceback = False     # errors name the node themselves
        self.mesh = mesh
        self.policy = policy
        self.mode_name = mode_name
        self.node: fx.Node | None = None
        # (id of a DTensor, placements) -> (that DTensor, it redistributed): NOTE
        # [Expansion cost]
        self._redistributed: dict = {}

    # -- the interpreter ------------------------------------------------------------
    def call_function(self, target, args, kwargs):
        handler = SPECIAL_OPS.get(target)
        if handler is not None:
            return handler(self, self.node, args, kwargs)
        if target is _CAT:
            return _cat(self, args, kwargs)
        if isinstance(target, _torch.OpOverload):
            args, kwargs = self.policy.before_op(self, self.node, target, args, kwargs)
            if target is _VIEW and isinstance(args[0], DTensor):
                args = (_viewable(self, args[0]), *args[1:])
            if target in _ELEMENTWISE_LISTS:
                return _elementwise_lists(self, target, args, kwargs)
            if any(isinstance(v, torch.Tensor) for v in kwargs.values()):
                kwargs = _keyword_inputs_laid_out(self, target, args, kwargs)
        return super().call_function(target, args, kwargs)

    def run_node(self, n):
        self.node = n
        try:
            return self.policy.after_node(self, n, super().run_node(n))
        except (ShardingRuleError, ValueError, TypeError):
            raise
        except Exception as e:  # noqa: BLE001 - re-raised with the node named
            layouts = self.layouts(n)
            if _NO_RULE in str(e):
                raise ShardingRuleError(
                    f"{self.mode_name} has no sharding rule for {n.target} (node "
                    f"{n.name!r}, inputs {layouts}). Register one with "
                    f"sharded.rules.register_sharding({n.target}) (see docs/concepts.md, "
                    f"'Sharding rules'), or lay its inputs out as Replicate."
                ) from None
            raise RuntimeError(
                f"{self.mode_name} could not partition node {n.name!r} = {n.target}"
                f"(inputs {layouts}): {type(e).__name__}: {e}"
            ) from e

    # -- helpers for policies and special ops -------------------------------------------
    def as_dtensor(self, x) -> DTensor:
        """``x``, or a plain tensor made from nothing (the same on every rank) as a
        replicated DTensor."""
        if isinstance(x, DTensor):
            return x
        return DTensor.from_local(x, self.mesh.device_mesh, [Replicate()] * self.mesh.ndim,
                                  run_check=False)

    def redistribute(self, x, placements) -> DTensor:
        x = self.as_dtensor(x)
        placements = tuple(placements)
        if tuple(x.placements) == placements:
            return x
        key = (id(x), placements)
        done = self._redistributed.get(key)
        if done is not None and done[0] is x:
            return done[1]
        y = self._reduced(x, placements)
        if y is None:
            y = _torch.redistribute_untracked(x, placements)
        self._redistributed[key] = (x, y)
        return y

    def _reduced(self, x: DTensor, placements: tuple) -> DTensor | None:
        """``x``, a sum pending over several axes of the mesh, made replicated over them
        and nothing else moved; None for any other move. Over every axis: one
        all-reduce over the mesh's group, not one per axis (NOTE [One reduction over
        every mesh axis] in _torch.py). Over some (or over every one where the mesh
        has no group of its own: a pipeline stage's submesh): one all-reduce per axis,
        from the last axis to the first, where DTensor takes the first axis first; the
        passes chain two such reductions (NOTE [Chained reductions] in
        sharded/passes/bucketing.py). Every redistribute the expander makes comes here
        (the modes' policies, DataParallelMode's reductions, sharding constraints,
        out_specs), so the same layouts give the same program; DTensor's own, inside
        an op, do not: the policies reduce a pending sum before any op not linear in
        it."""
        src = tuple(x.placements)
        if len(src) != len(placements):
            return None
        changed = [i for i, (a, b) in enumerate(zip(src, placements)) if a != b]
        if len(changed) < 2 or not all(
                _torch.is_plain_partial(src[i]) and src[i].reduce_op == "sum"
                and isinstance(placements[i], Replicate) for i in changed):
            return None
        group = _torch.mesh_group(self.mesh.device_mesh) if len(changed) == len(src) else None
        if group is not None:
            local = _torch.local_tensor(x).contiguous()
            out = _F.wait_tensor.default(_F.all_reduce.default(local, "sum", group))
            return self.globals_of([out], [placements], [x.shape])[0]
        pls = list(src)
        for i in reversed(changed):
            pls[i] = Replicate()
            x = _torch.redistribute_untracked(x, tuple(pls))
        return x

    def locals_of(self, xs, placements) -> list:
        """This rank's shards of ``xs`` laid out as ``placements``."""
        return [self.redistribute(x, pl).to_local() for x, pl in zip(xs, placements)]

    def globals_of(self, locals_, placements, shapes) -> list:
        dm = self.mesh.device_mesh
        return [
            DTensor.from_local(x, dm, pl, run_check=False, shape=torch.Size(shape),
                               stride=contiguous_strides(shape))
            for x, pl, shape in zip(locals_, placements, shapes)
        ]

    def layouts(self, n: fx.Node) -> list[str]:
        out = []
        for a in n.all_input_nodes:
            v = self.env.get(a)
            if isinstance(v, DTensor):
                out.append(f"{a.name}: {tuple(v.shape)} {tuple(v.placements)}")
            elif isinstance(v, torch.Tensor):
                out.append(f"{a.name}: {tuple(v.shape)} plain")
        return out


# NOTE [Expansion cost]
# The expansion runs every op of the global graph through DTensor and records the
# local ops DTensor runs. The expander skips the work that leaves nothing in the
# program:
# - Inputs are wrapped as DTensors as they are: ``DTensor.from_local`` adds a view of
#   each input (an autograd detail), an identity view that every mode's passes drop
#   (``remove_identity_views``).
# - A value laid out the same way for several readers (a parameter shard gathered
#   for the forward's matmul and again for the backward's) is redistributed once,
#   and every reader gets that result. CSE would merge the copies afterwards (a
#   collective is a pure op of its input): the program is the same, without running
#   DTensor's redistribute and recording its collective, wait, chunk and cat again
#   for each copy. The key holds the value itself, so an id reused by a freed
#   tensor never hits. It relies on the global program being functional (pjit's
#   trace functionalizes it): no op writes into a value once it is made, so its
#   redistributed copy stays right for every later reader.
# - Redistributes skip the autograd Function around them (nothing here needs a
#   gradient; ``_torch.redistribute_untracked``).
# - The local ops are recorded by a dispatch mode of this project's, not make_fx
#   (NOTE [Recording the local program] in _torch.py): make_fx's per-op bookkeeping
#   (proxies, a snapshot of every value, a torch-function mode noting each node's
#   torch function) cost twice the ops themselves.
# The local programs are the same as without these (the benchmark's GPT-2-small step
# on a 16x4 mesh, both modes, compared node for node).

# -- the special ops: one handler each, for every mode ------------------------------------

Handler = Callable[[Expander, fx.Node, tuple, dict], object]
# op -> its handler: the ``expand`` field of the registry of primitives (NOTE [One
# registry of primitives] in sharded/_registry.py), a read-only view. The handlers
# here are the ops of the layers below the modes; an op defined above them (a plan's
# layout, sharded/plans.py) registers its handler where it is defined.
SPECIAL_OPS = _registry.EXPAND


def special_op(target):
    """Register the handler of an op that DTensor knows nothing of."""
    def register(fn: Handler) -> Handler:
        _registry.define(target, expand=fn)
        return fn

    return register


@special_op(CONSTRAINT_OP)
def _sharding_constraint(ex: Expander, node, args, kwargs):
    x, spec_id = args
    spec = constraint_spec(spec_id)
    check_spec(spec, x.shape, ex.mesh, "with_sharding_constraint spec")
    return ex.redistribute(x, to_placements(spec, ex.mesh))


@special_op(RNG_OP)
def _random(ex: Expander, node, args, kwargs):
    """This rank's block of a random draw (NOTE [Random numbers that do not depend on
    the mesh]): computed from the global indices of the elements it holds."""
    seed, offset, draw, shape, kind, a, b, dtype = args
    like, p = kwargs.get("like"), kwargs.get("p")
    placements = _random_layout(ex, node, shape, like, p)
    sizes, starts = block(shape, placements, ex.mesh)
    seed, offset = seed.to_local(), offset.to_local()
    p_local = ex.locals_of([p], [placements])[0] if p is not None else None
    region = (tuple(shape), sizes, starts, seed.device)
    values = sample(seed, offset + draw, region, kind, a, b, dtype, p_local)
    return DTensor.from_local(values, ex.mesh.device_mesh, placements, run_check=False,
                              shape=torch.Size(shape), stride=contiguous_strides(shape))


def _random_layout(ex: Expander, n, shape, like, p) -> tuple:
    """Where a draw's block should live: like its probabilities or its like-tensor,
    else like a same-shaped operand of a consumer, else replicated."""
    shape = tuple(shape)
    candidates = [p, like] + [
        ex.env.get(a) for u in n.users for a in u.all_input_nodes if a is not n
    ]
    for c in candidates:
        if isinstance(c, DTensor) and tuple(c.shape) == shape and all(
                type(pl) in (Shard, Replicate) or _torch.is_partial(pl) for pl in c.placements):
            return reduced(c.placements)
    return (Replicate(),) * ex.mesh.ndim


@special_op(_region.REGION_OP)
def _shard_map(ex: Expander, node, args, kwargs):
    """A shard_map region (NOTE [shard_map in a traced program] in sharded/_region.py):
    its inputs laid out as its in_specs, its graph run on this rank's blocks with the
    collectives lowered, its outputs tiled by its out_specs. A region's backward is a
    region too, so this one handler serves both."""
    inputs, key = args
    region = _region.lookup(key, ex.module)
    if all(not u.users for u in node.users):     # nothing reads its outputs
        outs = region.dead_outputs()
    else:
        outs = region.run_local(ex.locals_of(inputs, region.in_placements))
    return ex.globals_of(outs, region.out_placements, region.out_shapes)


# -- keyword tensors ---------------------------------------------------------------------------------

# NOTE [Keyword tensors are laid out by the expander]
# DTensor redistributes an op's positional inputs to the layouts its sharding plan
# chose, but not its keyword inputs: it runs the kernel on a keyword tensor's local
# data as it is. SDPA takes its mask as ``attn_mask=`` (transformers passes one when
# traced): with q, k, v split over the batch, the plan wants the mask split too, and
# the kernel would get the whole mask with a quarter of the queries. The expander
# moves keyword tensors to the plan's layouts before DTensor runs the op.
def _keyword_inputs_laid_out(ex: Expander, target, args, kwargs) -> dict:
    wanted = _torch.planned_kwarg_placements(target, args, kwargs)
    if not wanted:
        return kwargs
    return {k: ex.redistribute(v, wanted[k]) if k in wanted else v for k, v in kwargs.items()}


# -- cat of legacy empty tensors ------------------------------------------------------------------

# NOTE [cat skips legacy empty tensors]
# torch.cat skips every input of shape (0,) (a "legacy empty" tensor), whatever the
# rank of the others, though each still counts for the result's dtype (torch.cat of
# a float64 (0,) and a float32 [2, 3] is float64). transformers' DynamicCache starts
# a layer's keys and values as torch.tensor([]) and appends with cat, so a traced
# model with a cache holds cat((0,), keys). DTensor's cat strategy reads the cat dim
# of every input and fails on the (0,) one ("Dimension out of range") once the other
# is split (the heads under a tensor-parallel plan). The expander drops those inputs
# before the policy and DTensor see the op, and casts the result to the dtype the
# global graph recorded, which is torch's. All inputs empty: cat as is.
_CAT = torch.ops.aten.cat.default


def _is_legacy_empty(x) -> bool:
    return isinstance(x, torch.Tensor) and x.dim() == 1 and x.shape[0] == 0


def _cat(ex: Expander, args, kwargs):
    tensors = list(args[0] if args else kwargs["tensors"])
    kept = [t for t in tensors if not _is_legacy_empty(t)]
    if kept and len(kept) < len(tensors):
        args, kwargs = ((kept, *args[1:]), kwargs) if args else ((), {**kwargs, "tensors": kept})
    args, kwargs = ex.policy.before_op(ex, ex.node, _CAT, args, kwargs)
    out = fx.Interpreter.call_function(ex, _CAT, args, kwargs)
    val = ex.node.meta.get("val") if ex.node is not None else None
    if isinstance(val, torch.Tensor) and out.dtype != val.dtype:
        out = out.to(val.dtype)
    return out


# -- a view of a shard laid out otherwise -------------------------------------------------

# NOTE [A view of a shard laid out otherwise]
# A traced ``view`` was valid on the global value's strides. A shard can be laid out
# otherwise: attention's output, [B, H, T, D] stored as [B, T, H, D], is gathered
# over its heads into a fresh [B, H, T, D] block, and ``transpose(1, 2).view(B, T,
# H * D)``, a view of the global value, is no view of that block ("Cannot view a
# tensor with shape ..."). The program is functional (NOTE [Expansion cost]), so a
# copy computes the same values: a shard that is not contiguous where its global value
# is gets a contiguous copy before the view.
_VIEW = torch.ops.aten.view.default


def _viewable(ex: Expander, x: DTensor) -> DTensor:
    local = _torch.local_tensor(x)
    src = ex.node.args[0] if ex.node is not None else None
    val = src.meta.get("val") if isinstance(src, fx.Node) else None
    if local.is_contiguous() or not isinstance(val, torch.Tensor) or not val.is_contiguous():
        return x
    return _torch.make_dtensor(local.contiguous(), _torch.dtensor_spec(x))


# -- multi-tensor kernels DTensor cannot plan ---------------------------------------------------

# NOTE [Fused optimizer kernels]
# sharded.optim.adamw runs torch's fused AdamW kernel (one pass over parameters,
# gradients and moments: 3-4x the foreach ops on CPU). A traced program holds its
# functional form, ``_fused_adamw``, whose DTensor strategy is broken in torch 2.13 (it
# expects one list of outputs and gets five). The kernel is elementwise per parameter,
# so the expander runs it itself: element i's operands (gradient, moments) are laid
# out as its parameter is (after the mode's policy reduced the pending gradients:
# an all-reduce, or a reduce-scatter onto the parameter's shards), the kernel runs on
# the local shards, and each result takes its parameter's placements.
_ELEMENTWISE_LISTS = set(_torch.FUSED_ADAMW_IN_PLACE)   # lr a float or a tensor


def _elementwise_lists(ex: Expander, target, args, kwargs):
    params = args[0]
    laid = []
    for a in args:
        if isinstance(a, (list, tuple)) and len(a) == len(params) and a is not params:
            a = [ex.redistribute(x, p.placements if x.ndim else reduced(x.placements))
                 if isinstance(x, torch.Tensor) else x      # scalars (the step) replicated
                 for x, p in zip(a, params)]
        laid.append(a)

    def local(a):
        if isinstance(a, DTensor):     # (NOTE [The fused kernel reads memory in order])
            return _torch.local_tensor(a).contiguous()
        if isinstance(a, (list, tuple)):
            return [local(x) for x in a]
        return a

    # a tensor lr (the tensor-lr overload) is one value on every rank
    kwargs = {k: ex.redistribute(v, reduced(v.placements)) if isinstance(v, DTensor) else v
              for k, v in kwargs.items()}
    outs = target(*[local(a) for a in laid], **{k: local(v) for k, v in kwargs.items()})
    dm = ex.mesh.device_mesh
    return tuple(
        [_torch.make_dtensor(o, _torch.build_dtensor_spec(dm, p.placements, p.shape, p.stride(), o.dtype))
         for o, p in zip(out, params)]
        for out in outs)


# -- placement helpers ------------------------------------------------------------------------

def contiguous_strides(shape) -> tuple:
    strides, acc = [], 1
    for size in reversed(tuple(shape)):
        strides.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(strides))
