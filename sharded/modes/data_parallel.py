"""DataParallelMode: the user names the batch; the mode lays out everything else.

# NOTE [Batch-dim analysis]
Inputs whose spec names the mode's axis are the batch; every other tensor input is
state (parameters, optimizer moments, step counters). While the global graph is
expanded (the shared Expander, NOTE [Modes are layout policies]), every value gets
one of four kinds along the axis:

  batch    split over the axis on its batch dim (Shard(d), d tracked by DTensor's
           dim rules: views that fold or split the batch, permutes, transposes,
           expand, squeeze/unsqueeze, matmuls, reductions over other dims, ...)
  partial  the batch was reduced away (the loss, the gradients): a pending sum
  state    state laid out over the axis (``"shard"``: Shard on its first free dim)
  repl     the same on every rank (replicated state, constants, reduced values)

The kinds are DTensor's placements plus one bit per value, "this Shard is the
batch" (a state shard is a Shard too). The policy keeps them honest:

- An op that reads the batch gets every state input all-gathered first (FSDP's
  gather before use; a no-op for replicated state) and every pending sum reduced.
  Before it runs, DTensor's plan for the op is read: if DTensor would move a batch
  input off its batch split (an all-gather of activations: a sort or cumsum over
  the batch, ``x[0]``, batch-norm statistics), compilation stops with an error naming
  the node and its source line. Activations are never gathered.
- A pending sum travels through linear ops (NOTE [Where a pending reduction may
  travel]). Where it must be reduced, it becomes the layout its consumer computes
  in: the state layout when it meets state of its shape (``"shard"``: a
  reduce-scatter, the optimizer runs on shards), else replicated (an all-reduce).
  A pending sum read by several ops (a gradient read twice by a foreach AdamW), or
  only by ops that would reduce it anyway (the fused AdamW kernel), is reduced once,
  where it is produced, to the state layout of its shape: that puts every gradient
  reduction in backward order, where the passes bucket and overlap them.
- Outputs without an out_spec: batch values stay split, everything else takes the
  state layout (updated parameters and moments come out as they went in; a reduced
  loss is a replicated scalar).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor, Replicate, Shard

from sharded import _torch
from sharded.modes._expand import RNG_OP, SPECIAL_OPS, LayoutPolicy, expand
from sharded.modes._runner import check_compile
from sharded.modes.base import ParallelMode, Partitioned
from sharded.modes.dtensor_expand import _ADDITIVE, _LINEAR_IN_PARTIAL, reduce_where_produced
from sharded.passes import (DEFAULT_BUCKET_BYTES, bound_reduce_scatters, bucket_all_gathers,
                            bucket_all_reduces, bucket_reduce_scatters, count_targets_early, cse,
                            dce, hoist_reductions, prefetch_all_gathers, regather_distant_uses,
                            reinplace_foreach, remove_identity_views, remove_trivial_collectives,
                            sink_waits, untie_shape_reads)
from sharded.spec import P, from_placements, to_placements

_SHARDINGS = ("replicate", "shard")


class DataParallelMode(ParallelMode):
    """Data parallelism from a batch-dim analysis (NOTE [Batch-dim analysis]).

    - ``param_sharding="replicate"``: state replicated over ``axis`` (DDP): gradients
      all-reduced in buckets issued in backward order, the optimizer on full
      replicas.
    - ``param_sharding="shard"``: state sharded over ``axis`` on its first dim not
      split by another mesh axis, where that dim divides (FSDP / ZeRO-3); replicated
      where it does not (scalars). Each parameter is all-gathered before use (and
      again for the backward), gradients are reduce-scattered in buckets, the
      optimizer runs on shards.

    Sharding that the in_specs give over other mesh axes is kept: on a ("dp", "tp")
    mesh, tensor-parallel specs compose with either layout in one program.
    ``bucket_bytes`` caps a bucket of gradients or (``"shard"``) of parameter gathers;
    buckets pack whole blocks, read off the parameters' pytree paths (NOTE
    [Bucketing]), so about one block's bytes gives FSDP's per-block schedule and a
    larger cap fewer, larger collectives. ``prefetch`` is how many parameter gather
    buckets are issued ahead of their use (``"shard"``). ``compile`` chooses what runs
    the local program, as for every mode (NOTE [Runners]: ``False``, ``True`` or
    ``"auto"``).
    """

    name = "DataParallelMode"

    def __init__(self, param_sharding: str = "replicate", *, axis: str = "dp",
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, prefetch: int = 1,
                 compile: bool | str = "auto"):
        if param_sharding not in _SHARDINGS:
            raise ValueError(
                f"DataParallelMode param_sharding must be one of {_SHARDINGS}; got "
                f"{param_sharding!r}."
            )
        if not isinstance(axis, str):
            raise TypeError(f"DataParallelMode axis must be a mesh axis name; got {axis!r}.")
        if not (isinstance(bucket_bytes, int) and bucket_bytes > 0):
            raise ValueError(f"DataParallelMode bucket_bytes must be a positive int; got {bucket_bytes!r}.")
        if not (isinstance(prefetch, int) and prefetch >= 0):
            raise ValueError(f"DataParallelMode prefetch must be an int >= 0; got {prefetch!r}.")
        self.param_sharding = param_sharding
        self.axis = axis
        self.bucket_bytes = bucket_bytes
        self.prefetch = prefetch
        self.compile = check_compile(compile, "DataParallelMode")

    def cache_key(self) -> tuple:
        return (type(self).__name__, self.param_sharding, self.axis, self.bucket_bytes,
                self.prefetch, self.compile)

    def __repr__(self):
        extra = "" if self.compile == "auto" else f", compile={self.compile!r}"
        return f"DataParallelMode({self.param_sharding!r}, axis={self.axis!r}{extra})"

    # -- partition ---------------------------------------------------------------------
    def partition(self, graph, in_placements, out_specs, mesh) -> Partitioned:
        if self.axis not in mesh.axis_names:
            raise ValueError(
                f"{self!r}: mesh axis {self.axis!r} is not in the mesh {mesh}; pass "
                f"axis= one of {mesh.axis_names}."
            )
        dp = mesh.axis_names.index(self.axis)
        placeholders = [n for n in graph.graph.nodes if n.op == "placeholder"]
        batch = self._check_batch_inputs(placeholders, in_placements, mesh, dp)
        layouts = [
            tuple(pl) if n in batch else self.state_placements(n.meta["val"].shape, pl, mesh, dp)
            for n, pl in zip(placeholders, in_placements)
        ]
        policy = _DataParallelPolicy(self, mesh, dp, batch)
        part = expand(graph, layouts, out_specs, mesh, policy, repr(self))
        part.in_placements = layouts
        part.layouts = policy.describe(graph, layouts, part.out_placements, mesh)
        return part

    def _check_batch_inputs(self, placeholders, in_placements, mesh, dp) -> set:
        """The batch inputs (their spec names the axis); they must agree on the size of
        the batch they split. An input whose ``meta["sharded_kind"]`` says what it is
        (pjit's backward program: a residual or cotangent of the forward, which the
        forward's analysis classified) is taken as that kind."""
        batch, sizes = set(), {}
        for n, pl in zip(placeholders, in_placements):
            p = pl[dp]
            kind = n.meta.get("sharded_kind")
            if kind is not None:
                if kind == "batch" and isinstance(p, Shard):
                    batch.add(n)
                continue
            if isinstance(p, Shard):
                batch.add(n)
                sizes[n] = (p.dim, n.meta["val"].shape[p.dim])
        if len({size for _, size in sizes.values()}) > 1:
            lines = "\n".join(f"  {_path(n)}: dim {d} (size {s})" for n, (d, s) in sizes.items())
            raise ValueError(
                f"{self!r}: the inputs whose specs name mesh axis {self.axis!r} are the "
                f"batch, so they must split batches of one size, but they split:\n{lines}\n"
                f"Put {self.axis!r} on each batch input's batch dim, and give inputs that "
                f"are not batch (parameters, state) a spec without {self.axis!r}."
            )
        return batch

    def state_placements(self, shape, placements, mesh, dp) -> tuple:
        """The layout of state of ``shape`` whose other mesh axes are laid out as
        ``placements``: replicated over the axis (``"replicate"``), or split over it on
        its first dim that no other axis splits, where that dim divides (``"shard"``)."""
        out = list(placements)
        out[dp] = Replicate()
        if self.param_sharding == "shard":
            taken = {p.dim for i, p in enumerate(placements) if i != dp and isinstance(p, Shard)}
            n = mesh.shape[dp]
            for d, size in enumerate(shape):
                if d not in taken:
                    if size % n == 0 and size >= n:
                        out[dp] = Shard(d)
                    break
        return tuple(out)

    # -- passes ------------------------------------------------------------------------------
    def transform_and_compile(self, graph: fx.GraphModule, mesh) -> fx.GraphModule:
        """Cleanup, CSE, then the communication schedule (NOTE [Bucketing], NOTE
        [Overlap]): gradient reductions bucketed in backward order (all-reduces, or
        reduce-scatters for ``"shard"``, by unit, one in flight), parameter
        gathers bucketed by unit in use order and prefetched ``prefetch`` buckets
        ahead, waits sunk to the first use."""
        graph = cse(dce(untie_shape_reads(remove_identity_views(remove_trivial_collectives(graph)))))
        if self.param_sharding == "shard":
            graph = regather_distant_uses(graph)
        graph = hoist_reductions(count_targets_early(graph))
        if self.param_sharding == "shard":
            graph = bucket_reduce_scatters(graph, self.bucket_bytes)
            graph = bucket_all_gathers(graph, self.bucket_bytes)
        graph = bucket_all_reduces(graph, self.bucket_bytes)
        graph = sink_waits(graph)
        if self.param_sharding == "shard":
            graph = bound_reduce_scatters(graph, inflight=1)
            graph = prefetch_all_gathers(graph, self.prefetch)
        graph = reinplace_foreach(graph, fused=self.compile is not True)
        graph.graph.lint()
        graph.recompile()
        return graph


def _path(node: fx.Node) -> str:
    return node.meta.get("sharded_path", node.name)


class _DataParallelPolicy(LayoutPolicy):
    """NOTE [Batch-dim analysis]."""

    def __init__(self, mode: DataParallelMode, mesh, dp: int, batch_inputs: set):
        self.mode = mode
        self.mesh = mesh
        self.dp = dp
        self.batch: set[fx.Node] = set(batch_inputs)   # values that hold the batch split
        self._reads_batch = False                     # does the current op read the batch?

    # -- kinds -----------------------------------------------------------------------------
    def is_batch(self, ex, node) -> bool:
        v = ex.env.get(node)
        return node in self.batch and isinstance(v, DTensor) and isinstance(v.placements[self.dp], Shard)

    def _dp(self, x):
        return x.placements[self.dp]

    # -- hooks -------------------------------------------------------------------------------
    def before_op(self, ex, node, target, args, kwargs):
        batch_vals = {id(ex.env[a]): a for a in node.all_input_nodes if self.is_batch(ex, a)}
        self._reads_batch = bool(batch_vals)
        batch_args = {}       # id of the local tensor the op gets -> the batch input node
        dts = [a for a in _tensors((args, kwargs)) if isinstance(a, DTensor)]
        partial = [a for a in dts if _has_partial(a)]
        travels = bool(partial) and _travels(target, dts, partial)
        meets_state = any(isinstance(self._dp(a), Shard) and id(a) not in batch_vals
                          and not _has_partial(a) for a in dts)

        def fix(a):
            if not isinstance(a, DTensor):
                return a
            source = batch_vals.get(id(a))
            if _has_partial(a) and not travels:
                # reduced where its consumer needs it: onto the state shards the
                # optimizer runs on, else replicated
                shard = meets_state and not batch_vals
                a = self._reduce(ex, a, self._state_dp(a) if shard else Replicate())
            elif batch_vals and _torch.is_partial(self._dp(a)):
                a = self._reduce(ex, a, Replicate(), others=False)
            if source is not None:
                batch_args[id(_torch.local_tensor(a))] = (source, a)
            elif batch_vals and isinstance(self._dp(a), Shard):
                a = self._gather(ex, a)                    # gather state before use
            return a

        args, kwargs = _map_tensors(fix, (args, kwargs))
        if batch_vals:
            self._check_batch_kept(node, target, args, kwargs, batch_args)
        return args, kwargs

    def after_node(self, ex, node, result):
        if node.op == "placeholder":
            return result
        if node.op == "call_function" and node.target is operator.getitem:
            if node.args[0] in self.batch and isinstance(result, DTensor) and isinstance(self._dp(result), Shard):
                self.batch.add(node)
            return result
        if node.op != "call_function":
            return result
        if node.target in SPECIAL_OPS:
            reads = any(a in self.batch for a in node.all_input_nodes) or node.target is RNG_OP
        else:
            reads = self._reads_batch
        self._reads_batch = False
        if reads and any(isinstance(self._dp(v), Shard) for v in _tensors(result) if isinstance(v, DTensor)):
            self.batch.add(node)
        if isinstance(result, DTensor) and _has_partial(result) and reduce_where_produced(node):
            # reduced once, where produced (NOTE [Batch-dim analysis])
            target = self._state_dp(result)
            return self._reduce(ex, result, target)
        return result

    def output_placements(self, ex, index, value, spec):
        if spec is not None:
            return to_placements(spec, ex.mesh)
        out_node = next(iter(n for n in reversed(ex.module.graph.nodes) if n.op == "output"))
        node = out_node.args[0][index]
        reduced = [Replicate() if _torch.is_partial(p) else p for p in value.placements]
        # (``value``, not ``ex.env``: the interpreter has freed the values by now)
        if isinstance(node, fx.Node) and node in self.batch and isinstance(self._dp(value), Shard):
            return tuple(reduced)
        return self.mode.state_placements(value.shape, reduced, self.mesh, self.dp)

    # -- helpers -------------------------------------------------------------------------------
    def _state_dp(self, value):
        others = [Replicate() if _torch.is_partial(p) else p for p in value.placements]
        return self.mode.state_placements(value.shape, others, self.mesh, self.dp)[self.dp]

    def _reduce(self, ex, a, dp_target, others: bool = True):
        """``a`` with its pending sums done: over the axis to ``dp_target``, over the
        other axes (if ``others``) to Replicate."""
        pls = list(a.placements)
        for i, p in enumerate(pls):
            if _torch.is_partial(p) and (i == self.dp or others):
                pls[i] = dp_target if i == self.dp else Replicate()
        return ex.redistribute(a, pls)

    def _with_dp(self, ex, a, placement):
        pls = list(a.placements)
        pls[self.dp] = placement
        return ex.redistribute(a, pls)

    def _gather(self, ex, a):
        """``a`` replicated over the axis. A split of dim d > 0 (the view ``w.t()`` of a
        parameter shard) is gathered as dim 0 of ``a.movedim(d, 0)``: one all-gather
        and two views, where DTensor's own gather of dim d cuts the result into one
        piece per rank and concatenates them (a 128-way axis: 128 slices to trace)."""
        d = self._dp(a).dim
        if d == 0:
            return self._with_dp(ex, a, Replicate())
        return self._with_dp(ex, a.movedim(d, 0), Replicate()).movedim(0, d)

    def _check_batch_kept(self, node, target, args, kwargs, batch_args):
        """Error if DTensor's plan for the op moves a batch input off its split."""
        moves = _torch.planned_redistributions(target, args, kwargs)
        for local, src, dst in moves or ():
            a, value = batch_args.get(id(local), (None, None))
            if a is not None and src[self.dp] != dst[self.dp]:
                where = f" ({_torch.source_line(node)})" if _torch.source_line(node) else ""
                raise ValueError(
                    f"{self.mode!r} cannot keep the batch split over mesh axis "
                    f"{self.mode.axis!r} at node {node.name!r} = {target}{where}: its input "
                    f"{a.name!r} (shape {tuple(value.shape)}) is split over "
                    f"{self.mode.axis!r} as {src[self.dp]}, and the op would need it as "
                    f"{dst[self.dp]}, which gathers activations across the batch. Make the "
                    f"computation independent across examples (no sort, cumsum, indexing "
                    f"or statistics over the batch dim), or partition this program with "
                    f"DTensorExpandMode and explicit specs."
                )

    # -- report (for Lowered) ------------------------------------------------------------------
    def describe(self, graph, in_layouts, out_placements, mesh) -> dict:
        """The layout the mode chose for each input and output: ``{path: (kind, P)}``."""
        placeholders = [n for n in graph.graph.nodes if n.op == "placeholder"]
        inputs = {}
        for n, pl in zip(placeholders, in_layouts):
            kind = "batch" if n in self.batch else "state"
            inputs[_path(n)] = (kind, _spec(pl, mesh, n.meta["val"].ndim))
        out_node = next(n for n in reversed(graph.graph.nodes) if n.op == "output")
        outputs = {}
        for i, (v, pl) in enumerate(zip(out_node.args[0], out_placements)):
            ndim = v.meta["val"].ndim if isinstance(v, fx.Node) else 0
            kind = "batch" if v in self.batch else "state"
            outputs[f"output[{i}]"] = (kind, _spec(pl, mesh, ndim))
        return {"inputs": inputs, "outputs": outputs}


def _spec(placements, mesh, ndim):
    try:
        return from_placements(placements, mesh, ndim)
    except ValueError:   # a layout no spec expresses (_StridedShard: a residual of pjit's forward)
        return tuple(placements)


def _has_partial(x) -> bool:
    return any(_torch.is_partial(p) for p in x.placements)


def _travels(target, dts, partial) -> bool:
    """May the pending sums stay pending through this op (NOTE [Where a pending
    reduction may travel])?"""
    packet = target.overloadpacket
    masked = any(not _torch.is_plain_partial(p) for a in partial for p in a.placements
                 if _torch.is_partial(p))
    if packet not in _LINEAR_IN_PARTIAL or masked:
        return False
    return packet not in _ADDITIVE or len(partial) == len(dts)


def _tensors(tree):
    """Every tensor in a nest of tuples, lists and dicts."""
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, (list, tuple)):
        for x in tree:
            yield from _tensors(x)
    elif isinstance(tree, dict):
        for x in tree.values():
            yield from _tensors(x)


def _map_tensors(fn, tree):
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, tuple):
        return tuple(_map_tensors(fn, x) for x in tree)
    if isinstance(tree, list):
        return [_map_tensors(fn, x) for x in tree]
    if isinstance(tree, dict):
        return {k: _map_tensors(fn, v) for k, v in tree.items()}
    return tree
