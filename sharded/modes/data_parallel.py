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
  where it is produced, to the layout of the parameter its readers combine it with,
  else the state layout of its shape (NOTE [A gradient takes its parameter's
  layout]): that puts every gradient reduction in backward order, where the passes
  bucket and overlap them, whichever optimizer reads the gradients (NOTE [An element
  of a multi-output op's result]). Over every mesh axis at once it is one all-reduce (NOTE
  [One reduction over every mesh axis] in _torch.py).
- A broadcast of a replicated value to a batch value's shape (the backward's seed of
  ``logits.sum()``) is split like that value (NOTE [A broadcast to the batch's
  shape]).
- Outputs without an out_spec: batch values stay split, everything else takes the
  state layout (updated parameters and moments come out as they went in; a reduced
  loss is a replicated scalar).
"""

from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor, Replicate, Shard

from sharded import _torch
from sharded.modes._expand import RNG_OP, SPECIAL_OPS, LayoutPolicy, expand
from sharded.modes._runner import check_compile
from sharded.modes.base import CLEANUP, EARLY_REDUCTIONS, REINPLACE, ParallelMode, Partitioned, Pass
from sharded.modes._pending import is_masked, linear_in_partial, reduce_where_produced
from sharded.passes import (DEFAULT_BUCKET_BYTES, bound_reduce_scatters, bucket_all_gathers,
                            bucket_all_reduces, bucket_reduce_scatters, prefetch_all_gathers,
                            regather_distant_uses, sink_waits)
from sharded.spec import from_placements, reduced, to_placements

_F = _torch.c10d_functional

_SHARDINGS = ("replicate", "shard")
_EXPAND = torch.ops.aten.expand.default


def _sharded(mode) -> bool:
    """Does ``mode`` shard state (the passes of FSDP's schedule)?"""
    return mode.param_sharding == "shard"


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
        its first dim that no other axis splits, where that dim divides (``"shard"``).
        State whose every dim another axis splits (a column-parallel bias, ``P("tp")``)
        is split on its first dim whose block divides, minor to those axes:
        ``P(("tp", "dp"))``, as FSDP2 lays out a tensor-parallel parameter (NOTE [Axes
        out of mesh order] in spec.py)."""
        out = list(placements)
        out[dp] = Replicate()
        if self.param_sharding != "shard":
            return tuple(out)
        n = mesh.shape[dp]
        split = {i: p.dim for i, p in enumerate(placements) if i != dp and _is_split(p)}
        free = [d for d in range(len(shape)) if d not in split.values()]
        if free:
            if shape[free[0]] % n == 0 and shape[free[0]] >= n:
                out[dp] = Shard(free[0])
            return tuple(out)
        for d, size in enumerate(shape):
            axes = [i for i, dim in split.items() if dim == d]
            block = size // math.prod(mesh.shape[i] for i in axes)
            if block % n == 0 and block >= n:
                factor = math.prod(mesh.shape[i] for i in axes if i > dp)
                out[dp] = Shard(d) if factor == 1 else _torch.strided_shard(d, factor)
                break
        return tuple(out)

    # -- passes ------------------------------------------------------------------------------
    # NOTE [Pass order] in base.py; the communication schedule of NOTE [Bucketing] and
    # NOTE [Overlap]: gradient reductions bucketed in backward order (all-reduces, or
    # reduce-scatters for "shard", by unit, one in flight), parameter gathers bucketed
    # by unit in use order and prefetched ``prefetch`` buckets ahead, waits sunk to the
    # first use
    passes = (
        *CLEANUP,
        # (after cse: it merged the forward's and the backward's gather of a weight)
        Pass("regather_distant_uses", lambda g, m: regather_distant_uses(g), after=("cse",),
             when=_sharded),
        *EARLY_REDUCTIONS,
        Pass("bucket_reduce_scatters", lambda g, m: bucket_reduce_scatters(g, m.bucket_bytes),
             after=("hoist_reductions",), when=_sharded),
        Pass("bucket_all_gathers", lambda g, m: bucket_all_gathers(g, m.bucket_bytes),
             after=("regather_distant_uses",), when=_sharded),
        Pass("bucket_all_reduces", lambda g, m: bucket_all_reduces(g, m.bucket_bytes),
             after=("hoist_reductions",)),
        Pass("sink_waits", lambda g, m: sink_waits(g),
             after=("bucket_reduce_scatters", "bucket_all_gathers", "bucket_all_reduces")),
        Pass("bound_reduce_scatters", lambda g, m: bound_reduce_scatters(g, inflight=1),
             after=("sink_waits",), when=_sharded),
        Pass("prefetch_all_gathers", lambda g, m: prefetch_all_gathers(g, m.prefetch),
             after=("sink_waits",), when=_sharded),
        REINPLACE,
    )


def _path(node: fx.Node) -> str:
    return node.meta.get("sharded_path", node.name)


# NOTE [A broadcast to the batch's shape]
# The backward of a loss that sums over the batch without reading anything per
# example (``logits.sum()``, ``x.mean()``: FSDP2's test loss) starts from ``ones``
# broadcast to the summed value's shape: an expand of a replicated scalar, so
# replicated too. Left so, every rank computed the whole batch's gradient through the
# layers until it met the batch, and where it met a parameter shard first (the tied
# head's ``grad @ wte``) it became a pending sum of an activation's shape, reduced over
# the axis as if it were state and gathered again (FSDP2's 3-layer Transformer at 2
# ranks: a [4, 16, 16] gradient). An expand of a replicated value to the shape of a
# batch value seen before, broadcast along that value's batch dim, is split there
# instead: a slice of this rank's examples, no communication; the batch value's shape
# must name one batch dim (a shape with the batch on two different dims is left as it
# is).

# NOTE [A gradient takes its parameter's layout]
# A pending sum is reduced to the layout of the state it meets: where its reader
# combines it with state of its shape (the parameter beside it in a fused or foreach
# optimizer's lists, the parameter it is added to), to that state's placements on
# every axis, slicing first where the sum is replicated over another axis and the
# state split (no communication; the reductions then move only this rank's slice);
# else to the state layout of its shape. The gradient of a table split over "tp" on its
# rows, which the backward leaves replicated over "tp" (FSDP2's 2-D test checks the
# same of its position embedding), was reduce-scattered to P("dp") from its own
# placements and then moved to the parameter's P("tp", "dp") before the optimizer: an
# all-to-all (on gloo an all-gather), and a plan that Mesh.abstract could not lower.


# NOTE [An element of a multi-output op's result]
# A layer norm's backward returns the input's, the weight's and the bias's gradients
# as one tuple; each is read through a getitem, and the getitem is where the
# gradient is produced. The policy reduced pending sums where produced only after
# ops, not after getitems, so such a gradient stayed pending until its readers: with
# sharded.optim.adamw, one fused op that reduces it (all of them together, where the
# optimizer starts), but with a per-parameter AdamW (``g * (1 - b1)``, ``g * g``:
# linear, so the sum travelled) each reader reduced a copy of its own, three
# reductions per layer norm gradient, in the optimizer, each awaited at once; they
# broke every bucket around them (issue 23: the benchmark's GPT at 2 ranks, 39
# all-reduces a step under "replicate" against 3 with the fused optimizer and with
# DTensorExpandMode, whose policy reduces after getitems too; "shard" 40
# reduce-scatters and 19 all-reduces against 4 and 2). A getitem's pending sum is
# reduced where produced like any other: the same buckets with either optimizer.


class _DataParallelPolicy(LayoutPolicy):
    """NOTE [Batch-dim analysis]."""

    def __init__(self, mode: DataParallelMode, mesh, dp: int, batch_inputs: set):
        self.mode = mode
        self.mesh = mesh
        self.dp = dp
        self.batch: set[fx.Node] = set(batch_inputs)   # values that hold the batch split
        self._reads_batch = False                     # does the current op read the batch?
        self._batch_dims: dict[tuple, set[int]] = {}  # shape of a batch value -> its batch dims

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
        travels = bool(partial) and _travels(target, args, dts, partial)
        meets_state = any(_is_split(self._dp(a)) and id(a) not in batch_vals
                          and not _has_partial(a) for a in dts)

        def fix(a):
            if not isinstance(a, DTensor):
                return a
            source = batch_vals.get(id(a))
            if _has_partial(a) and not travels:
                # reduced where its consumer needs it: onto the layout of the state it
                # meets (the shards the optimizer runs on), else replicated
                if meets_state and not batch_vals:
                    peers = [b for b in dts if id(b) not in batch_vals]
                    a = self._reduce(ex, a, *self._state_layout(a, peers))
                else:
                    a = self._reduce(ex, a, (Replicate(),) * len(a.placements))
            elif batch_vals and _torch.is_partial(self._dp(a)):
                a = self._reduce(ex, a, (Replicate(),) * len(a.placements), others=False)
            if source is not None:
                batch_args[id(_torch.local_tensor(a))] = (source, a)
            elif batch_vals and _is_split(self._dp(a)):
                a = self._gather(ex, a)                    # gather state before use
            return a

        args, kwargs = _map_tensors(fix, (args, kwargs))
        if batch_vals:
            self._check_batch_kept(node, target, args, kwargs, batch_args)
        return args, kwargs

    def after_node(self, ex, node, result):
        if node.op == "placeholder":
            if node in self.batch and isinstance(result, DTensor):
                self._add_batch(node, result)
            return result
        if node.op != "call_function":
            return result
        if node.target is operator.getitem:
            if node.args[0] in self.batch and isinstance(result, DTensor) and isinstance(self._dp(result), Shard):
                self._add_batch(node, result)
        else:
            if node.target in SPECIAL_OPS:
                reads = any(a in self.batch for a in node.all_input_nodes) or node.target is RNG_OP
            else:
                reads = self._reads_batch
            self._reads_batch = False
            if reads and any(isinstance(self._dp(v), Shard) for v in _tensors(result) if isinstance(v, DTensor)):
                self._add_batch(node, result)
            elif node.target is _EXPAND and isinstance(result, DTensor):
                result = self._split_broadcast(ex, node, result)
        if isinstance(result, DTensor) and _has_partial(result) and _reduced_by_readers(node, result):
            # reduced once, where produced (NOTE [Batch-dim analysis]), to the layout
            # of the state its readers combine it with; a getitem too (NOTE [An
            # element of a multi-output op's result])
            return self._reduce(ex, result, *self._state_layout(result, self._peers(ex, node)))
        return result

    def output_placements(self, ex, index, value, spec):
        if spec is not None:
            return to_placements(spec, ex.mesh)
        out_node = next(iter(n for n in reversed(ex.module.graph.nodes) if n.op == "output"))
        node = out_node.args[0][index]
        done = reduced(value.placements)
        # (``value``, not ``ex.env``: the interpreter has freed the values by now)
        if isinstance(node, fx.Node) and node in self.batch and isinstance(self._dp(value), Shard):
            return done
        return self.mode.state_placements(value.shape, list(done), self.mesh, self.dp)

    # -- helpers -------------------------------------------------------------------------------
    def _add_batch(self, node, value) -> None:
        self.batch.add(node)
        for v in _tensors(value):
            if isinstance(v, DTensor) and isinstance(self._dp(v), Shard):
                self._batch_dims.setdefault(tuple(v.shape), set()).add(self._dp(v).dim)

    def _split_broadcast(self, ex, node, value):
        """NOTE [A broadcast to the batch's shape]: ``value`` (an expand) split on the
        batch dim where it has the shape of a batch value and broadcasts along that dim."""
        dims = self._batch_dims.get(tuple(value.shape), set())
        if len(dims) != 1 or not isinstance(self._dp(value), Replicate):
            return value
        d = next(iter(dims))
        src = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
        lead = value.ndim - (src.ndim if isinstance(src, torch.Tensor) else 0)
        if src is not None and d >= lead and src.shape[d - lead] != 1:
            return value              # not broadcast along the batch dim: a copy per example
        self.batch.add(node)
        return self._with_dp(ex, value, Shard(d))      # a slice of this rank's examples

    def _state_layout(self, value, peers) -> tuple[tuple, bool]:
        """The layout a pending sum ``value`` is reduced to (NOTE [A gradient takes
        its parameter's layout]), and whether it is a peer's: that of the first state in
        ``peers`` (values its reader combines it with) of its shape that it can reach
        without moving a split, else the state layout of its shape given its own other
        axes."""
        for peer in peers:
            if (isinstance(peer, DTensor) and peer.shape == value.shape and not _has_partial(peer)
                    and all(_torch.is_partial(p) or isinstance(p, Replicate) or p == q
                            for p, q in zip(value.placements, peer.placements))):
                return tuple(peer.placements), True
        others = list(reduced(value.placements))
        return self.mode.state_placements(value.shape, others, self.mesh, self.dp), False

    def _peers(self, ex, node) -> list:
        """The values that ``node``'s readers combine it with: their other arguments,
        and for a multi-tensor op (a foreach or fused optimizer) the same element of
        their other lists. Batch values are no peers."""
        out = []
        for u in node.users:
            if u.op != "call_function":
                continue
            args = [*u.args, *u.kwargs.values()]
            lists = [a for a in args if isinstance(a, (list, tuple))]
            for a in args:
                if a is node:
                    out += [b for b in args if isinstance(b, fx.Node) and b is not node]
                elif isinstance(a, (list, tuple)) and node in a:
                    i = a.index(node)
                    out += [b[i] for b in lists if b is not a and len(b) > i and isinstance(b[i], fx.Node)]
        return [ex.env[b] for b in out if b in ex.env and b not in self.batch]

    def _reduce(self, ex, a, target, slice_: bool = False, others: bool = True):
        """``a`` with its pending sums done, to ``target``'s placements: over the axis,
        and (if ``others``) over the other axes. With ``slice_`` (``target`` is the
        layout of the state ``a`` meets), a replicated axis that ``target`` splits is
        sliced first (no communication), so the reductions move only this rank's
        slice."""
        pls = list(a.placements)
        for i, p in enumerate(pls):
            if slice_ and (i == self.dp or others) and isinstance(p, Replicate) \
                    and not isinstance(target[i], Replicate):
                pls[i] = target[i]
        a = ex.redistribute(a, pls)
        pending = [i for i, p in enumerate(pls) if (i == self.dp or others) and _torch.is_partial(p)]
        for i in pending:
            pls[i] = target[i]
        if len(pending) == len(pls) > 1 and all(
                _torch.is_plain_partial(p) and p.reduce_op == "sum" for p in a.placements) \
                and all(isinstance(p, Replicate) for p in pls):
            group = _torch.mesh_group(self.mesh.device_mesh)
            if group is not None:
                # NOTE [One reduction over every mesh axis]: one all-reduce, not one per axis
                local = _torch.local_tensor(a).contiguous()
                out = _F.wait_tensor.default(_F.all_reduce.default(local, "sum", group))
                return ex.globals_of([out], [tuple(pls)], [a.shape])[0]
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
        if d == 0 or not isinstance(self._dp(a), Shard):      # (a _StridedShard: as it is)
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


def _is_split(placement) -> bool:
    """Shard, or DTensor's _StridedShard (NOTE [Axes out of mesh order])."""
    return isinstance(placement, Shard) or _torch.split_factor(placement) is not None


def _has_partial(x) -> bool:
    return any(_torch.is_partial(p) for p in x.placements)


def _travels(target, args, dts, partial) -> bool:
    """May the pending sums stay pending through this op (NOTE [Where a pending
    reduction may travel])?"""
    if is_masked(partial):
        return False
    if target is _EMBEDDING_BACKWARD:
        return len(partial) == 1 and partial[0] is args[0] and _table_no_larger(args)
    return linear_in_partial(target, len(partial), len(dts))


# NOTE [A pending sum through an embedding's backward]
# embedding_dense_backward(grad, ids, rows, ...) is linear in ``grad``: a pending sum
# may be reduced before it or after it, on the table's gradient. After it, where that
# is no larger (a position table looked up by positions: grad and table both
# [seq, d]), the table's gradient is reduced once, to its parameter's layout, as FSDP
# reduces the gradient it computed on its own examples. Reduced before it, it was
# reduced twice: the [seq, d] grad to the state layout of its shape (a reduce-scatter),
# and the table's gradient again. Where the table is larger (a vocabulary under a
# tensor-parallel pending sum), the grad is reduced first. Not with
# scale_grad_by_freq, whose counts are of this rank's ids.
_EMBEDDING_BACKWARD = torch.ops.aten.embedding_dense_backward.default


def _table_no_larger(args) -> bool:
    grad, rows, by_freq = args[0], args[2], args[4]
    return not by_freq and rows * grad.shape[-1] <= grad.numel()


def _reduced_by_readers(node, value) -> bool:
    """Would every reader of ``node`` (a pending sum) reduce it (NOTE [Where a pending
    reduction may travel]), an embedding's backward only where the table is larger?"""
    if not reduce_where_produced(node):
        return False
    return not all(u.target is _EMBEDDING_BACKWARD and u.args[0] is node and len(node.users) == 1
                   and _table_no_larger((value, *u.args[1:])) for u in node.users)


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
