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

import functools
import math
import operator

import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor, Replicate, Shard

from sharded import _torch, precision
from sharded.modes._expand import RNG_OP, SPECIAL_OPS, LayoutPolicy, expand
from sharded.modes._runner import check_compile
from sharded.modes.base import CLEANUP, EARLY_REDUCTIONS, REINPLACE, ParallelMode, Partitioned, Pass
from sharded.modes._pending import pending_divisor, reduced_by_readers, travels
from sharded.passes import (DEFAULT_BUCKET_BYTES, bound_reduce_scatters, bucket_all_gathers,
                            bucket_all_reduces, bucket_reduce_scatters, defer_chained_reductions,
                            hoist_chained_reductions, prefetch_all_gathers, regather_distant_uses,
                            sink_waits)
from sharded.spec import from_placements, reduced, to_placements


_SHARDINGS = ("replicate", "shard")
_EXPAND = torch.ops.aten.expand.default


def _sharded(mode) -> bool:
    """Does ``mode`` shard state (the passes of FSDP's schedule)?"""
    return mode.param_sharding == "shard"


def _hybrid(mode) -> bool:
    """Does ``mode`` reduce over two data axes (NOTE [Chained reductions])?"""
    return len(mode.axes) > 1


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

    ``axis`` is one mesh axis, or HSDP's pair ``(replicate, shard)`` (NOTE [HSDP]): the
    batch split over both, state replicated over the first and laid out over the
    second as above (``"replicate"``: DDP over both). Sharding that the in_specs give
    over other mesh axes is kept: on a ("dp", "tp") mesh, tensor-parallel specs
    compose with either layout in one program. ``bucket_bytes`` caps a bucket of gradients or (``"shard"``) of parameter gathers;
    buckets pack whole blocks, read off the parameters' pytree paths (NOTE
    [Bucketing]), so about one block's bytes gives FSDP's per-block schedule and a
    larger cap fewer, larger collectives. ``prefetch`` is how many parameter gather
    buckets are issued ahead of their use (``"shard"``). ``compile`` chooses what runs
    the local program, as for every mode (NOTE [Runners]: ``False``, ``True`` or
    ``"auto"``).

    Mixed precision, FSDP2's ``MixedPrecisionPolicy`` (docs/precision.md):
    ``param_dtype`` is the dtype the differentiated function (inside
    ``torch.func.grad``) sees the step's floating inputs in: parameters are cast on
    their shards and gathered in it, the forward and backward compute in it, and the
    optimizer reads the fp32 masters and gradients (NOTE [Casts at use inside the
    differentiated function] in sharded/precision.py). ``reduce_dtype`` is the dtype
    gradients are reduced in: ``torch.float32`` reduces them after the cast back to
    the masters' dtype; None reduces them in the dtype the backward produces,
    ``param_dtype`` (NOTE [A pending sum through a cast] in _pending.py).
    """

    name = "DataParallelMode"

    def __init__(self, param_sharding: str = "replicate", *, axis: str | tuple[str, str] = "dp",
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, prefetch: int = 1,
                 param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None,
                 compile: bool | str = "auto"):
        if param_sharding not in _SHARDINGS:
            raise ValueError(
                f"DataParallelMode param_sharding must be one of {_SHARDINGS}; got "
                f"{param_sharding!r}."
            )
        axis = _check_axis(axis)
        if not (isinstance(bucket_bytes, int) and bucket_bytes > 0):
            raise ValueError(f"DataParallelMode bucket_bytes must be a positive int; got {bucket_bytes!r}.")
        if not (isinstance(prefetch, int) and prefetch >= 0):
            raise ValueError(f"DataParallelMode prefetch must be an int >= 0; got {prefetch!r}.")
        self.param_sharding = param_sharding
        self.axis = axis
        self.bucket_bytes = bucket_bytes
        self.prefetch = prefetch
        self.param_dtype = precision.check_dtype("DataParallelMode", "param_dtype", param_dtype)
        self.reduce_dtype = precision.check_dtype("DataParallelMode", "reduce_dtype", reduce_dtype)
        self.compile = check_compile(compile, "DataParallelMode")

    def cache_key(self) -> tuple:
        return (type(self).__name__, self.param_sharding, self.axis, self.bucket_bytes,
                self.prefetch, self.param_dtype, self.reduce_dtype, self.compile)

    def __repr__(self):
        extra = "" if self.compile == "auto" else f", compile={self.compile!r}"
        for k in ("param_dtype", "reduce_dtype"):
            if getattr(self, k) is not None:
                extra = f", {k}={getattr(self, k)}" + extra
        return f"DataParallelMode({self.param_sharding!r}, axis={self.axis!r}{extra})"

    def traced_function(self, fn):
        """``fn`` computing in ``param_dtype`` inside the function it differentiates
        (NOTE [Casts at use inside the differentiated function] in
        sharded/precision.py), or ``fn`` itself without a ``param_dtype``; a
        ``reduce_dtype`` the gradients cannot be reduced in is an error at trace."""
        traced = fn if self.param_dtype is None else precision.in_grad(
            fn, self.param_dtype, api=repr(self))
        if self.reduce_dtype in (None, self.param_dtype):
            return traced

        @functools.wraps(fn)
        def checked(*tensors):
            self._check_reduce_dtype(tensors)
            return traced(*tensors)

        return checked

    def _check_reduce_dtype(self, tensors) -> None:
        """A gradient is reduced in ``reduce_dtype`` where it passes through a cast to
        it (NOTE [A pending sum through a cast]): the cast back from ``param_dtype``
        to its parameter's dtype. So ``reduce_dtype``, unless it is ``param_dtype``,
        must be the dtype of the floating inputs; nothing else casts a gradient to
        it, and it would be reduced in another dtype, silently."""
        other = sorted({str(t.dtype) for t in tensors if isinstance(t, torch.Tensor)
                        and t.is_floating_point() and t.dtype not in (self.reduce_dtype, self.param_dtype)})
        if other:
            computed = ("in their parameters' dtype" if self.param_dtype is None
                        else f"in param_dtype ({self.param_dtype}), then cast back")
            raise ValueError(
                f"{self!r}: gradients are computed {computed} to their parameters' dtype "
                f"({', '.join(other)} here); nothing casts them to reduce_dtype "
                f"{self.reduce_dtype}, so they would be reduced in another dtype. Use "
                f"reduce_dtype=None (reduce in the dtype they are computed in), or the "
                f"floating inputs' dtype (fp32 masters: reduce_dtype=torch.float32).")

    @property
    def axes(self) -> tuple[str, ...]:
        """The data-parallel mesh axes: ``(axis,)``, or HSDP's ``(replicate, shard)``
        (NOTE [HSDP])."""
        return (self.axis,) if isinstance(self.axis, str) else tuple(self.axis)

    def axis_indices(self, mesh) -> tuple[int, ...]:
        """The mesh dims of ``axes``; an error naming the mesh's axes if one is not on it."""
        missing = [a for a in self.axes if a not in mesh.axis_names]
        if missing:
            hint = (f"axis= one of {mesh.axis_names}" if isinstance(self.axis, str) else
                    f"axis= a (replicate, shard) pair of distinct axes of {mesh.axis_names}")
            raise ValueError(
                f"{self!r}: mesh axis {missing[0]!r} is not in the mesh {mesh} (its axes: "
                f"{mesh.axis_names}); pass {hint}, or build the mesh with an axis named "
                f"{missing[0]!r}."
            )
        return tuple(mesh.axis_names.index(a) for a in self.axes)

    # -- partition ---------------------------------------------------------------------
    def partition(self, graph, in_placements, out_specs, mesh) -> Partitioned:
        dps = self.axis_indices(mesh)
        dp = dps[-1]
        placeholders = [n for n in graph.graph.nodes if n.op == "placeholder"]
        batch = self._check_batch_inputs(placeholders, in_placements, mesh, dps)
        layouts = [
            tuple(pl) if n in batch else self.state_placements(n.meta["val"].shape, pl, mesh, dp)
            for n, pl in zip(placeholders, in_placements)
        ]
        policy = _DataParallelPolicy(self, mesh, dps, batch)
        part = expand(graph, layouts, out_specs, mesh, policy, repr(self))
        part.in_placements = layouts
        part.layouts = policy.describe(graph, layouts, part.out_placements, mesh)
        return part

    def _check_batch_inputs(self, placeholders, in_placements, mesh, dps) -> set:
        """The batch inputs (their spec names the axis); they must agree on the size of
        the batch they split. Under HSDP (two axes) a batch input splits one dim over
        both (NOTE [HSDP]). An input whose ``meta["sharded_kind"]`` says what it is
        (pjit's backward program: a residual or cotangent of the forward, which the
        forward's analysis classified) is taken as that kind."""
        batch, sizes = set(), {}
        for n, pl in zip(placeholders, in_placements):
            ps = [pl[i] for i in dps]
            kind = n.meta.get("sharded_kind")
            if kind is not None:
                if kind == "batch" and all(isinstance(p, Shard) for p in ps):
                    batch.add(n)
                continue
            # (one axis: a Shard, as before HSDP; two: any split, so that a strided
            # one is an error below)
            if not any(isinstance(p, Shard) if len(dps) == 1 else _is_split(p) for p in ps):
                continue
            if len(dps) > 1 and not (all(isinstance(p, Shard) for p in ps)
                                     and len({p.dim for p in ps}) == 1):
                both = tuple(mesh.axis_names[i] for i in sorted(dps))
                raise ValueError(
                    f"{self!r}: input {_path(n)} names "
                    f"{' and '.join(repr(mesh.axis_names[i]) for i, p in zip(dps, ps) if _is_split(p))} "
                    f"in its spec, so it is a batch input, and a batch input under hybrid "
                    f"sharding is split over both data axes {self.axes!r} on one dim: give it "
                    f"the spec P({both!r}) (the axes in the mesh's order, on its batch dim), "
                    f"or, if it is not batch, a spec without either axis."
                )
            d = ps[-1].dim
            batch.add(n)
            sizes[n] = (d, n.meta["val"].shape[d])
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
        ``placements``: replicated over the axis (``"replicate"``), or split over it
        (``dp``: HSDP's shard axis, replicated over its replicate axis) on
        its first dim that no other axis splits, where that dim divides (``"shard"``).
        State whose every dim another axis splits (a column-parallel bias, ``P("tp")``)
        is split on its first dim whose block divides, minor to those axes:
        ``P(("tp", "dp"))``, as FSDP2 lays out a tensor-parallel parameter (NOTE [Axes
        out of mesh order] in spec.py)."""
        out = list(placements)
        dps = self.axis_indices(mesh)
        for i in dps:                   # HSDP: replicated over the first axis too
            out[i] = Replicate()
        if self.param_sharding != "shard":
            return tuple(out)
        n = mesh.shape[dp]
        split = {i: p.dim for i, p in enumerate(placements) if i not in dps and _is_split(p)}
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
        Pass("defer_chained_reductions", lambda g, m: defer_chained_reductions(g),
             after=("hoist_reductions",), when=_hybrid),
        Pass("bucket_reduce_scatters", lambda g, m: bucket_reduce_scatters(g, m.bucket_bytes),
             after=("hoist_reductions", "defer_chained_reductions"), when=_sharded),
        Pass("bucket_all_gathers", lambda g, m: bucket_all_gathers(g, m.bucket_bytes),
             after=("regather_distant_uses",), when=_sharded),
        Pass("bucket_all_reduces", lambda g, m: bucket_all_reduces(g, m.bucket_bytes),
             after=("hoist_reductions", "defer_chained_reductions")),
        Pass("sink_waits", lambda g, m: sink_waits(g),
             after=("bucket_reduce_scatters", "bucket_all_gathers", "bucket_all_reduces")),
        Pass("bound_reduce_scatters", lambda g, m: bound_reduce_scatters(g, inflight=1),
             after=("sink_waits",), when=_sharded),
        Pass("hoist_chained_reductions", lambda g, m: hoist_chained_reductions(g),
             after=("sink_waits", "bound_reduce_scatters"), when=_hybrid),
        Pass("prefetch_all_gathers", lambda g, m: prefetch_all_gathers(g, m.prefetch),
             after=("sink_waits",), when=_sharded),
        REINPLACE,
    )


def _check_axis(axis):
    """``axis`` as the mode keeps it: a mesh axis name, or HSDP's (replicate, shard)
    pair of distinct names (NOTE [HSDP]); a clear error for anything else."""
    if isinstance(axis, str):
        return axis
    fix = ('pass axis= one mesh axis name ("dp"), or, for hybrid sharding (HSDP), a '
           '(replicate, shard) pair of distinct mesh axis names such as '
           '("dp_replicate", "dp_shard")')
    if not isinstance(axis, (tuple, list)):
        raise TypeError(f"DataParallelMode axis must be a mesh axis name or a pair of them; "
                        f"got {axis!r}: {fix}.")
    bad = [a for a in axis if not isinstance(a, str)]
    if bad:
        raise TypeError(f"DataParallelMode axis={tuple(axis)!r}: {bad[0]!r} is not a mesh "
                        f"axis name (a str); {fix}.")
    if len(axis) == 1:
        return axis[0]
    if len(axis) != 2:
        raise ValueError(f"DataParallelMode axis={tuple(axis)!r} names {len(axis)} axes; data "
                         f"parallelism takes one axis, or two for HSDP (parameters replicated "
                         f"over the first, sharded over the second): {fix}. Other mesh axes "
                         f"(\"tp\") are laid out by the in_specs.")
    if axis[0] == axis[1]:
        raise ValueError(f"DataParallelMode axis={tuple(axis)!r} names mesh axis {axis[0]!r} "
                         f"twice; {fix}, or axis={axis[0]!r} for one axis.")
    return tuple(axis)


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


# NOTE [HSDP]
# ``axis=("dp_replicate", "dp_shard")`` is FSDP2's 2-D mesh convention (torchtitan's
# dp_replicate x fsdp): the batch is split over both axes (``P(("dp_replicate",
# "dp_shard"))``, on one dim, the axes in the mesh's order), state is laid out over
# "dp_shard" by ``state_placements`` and replicated over "dp_replicate". The analysis
# is the one of NOTE [Batch-dim analysis] over the pair: a value is batch when it is
# split over both axes, a pending sum over either is reduced where the batch meets
# it, parameters are gathered over "dp_shard" only (``dp``, the second axis). A
# gradient, pending over both axes, is reduced in two steps: reduce-scattered over
# "dp_shard" onto its parameter's shard, then that shard all-reduced over
# "dp_replicate", so the replicate axis (across hosts, in torchtitan's layout) moves
# 1/n of the bytes (FSDP2's order; DTensor's own plan for (Partial, Partial) ->
# (Replicate, Shard) is free to all-reduce the full gradient first). The passes
# bucket both steps (NOTE [Chained reductions] in sharded/passes/bucketing.py).
# ``"replicate"`` with a pair is DDP over both axes (kept rather than rejected: a
# torchtitan-style mesh switches layouts without a new mesh): a sum pending over every
# axis of the mesh is one all-reduce over the world (NOTE [One reduction over every
# mesh axis]); beside "tp" (two of three axes), one all-reduce per axis, the later
# mesh axis first, as the expander reduces any such sum (the program
# DTensorExpandMode lowers from the same layouts). A mean loss's pending divisor (its count of targets) is
# reduced before the division and its numerator travels (a division is linear in
# its numerator): DTensor's plan for a sum over a count, both pending, reduced the
# count one axis after the other.


class _DataParallelPolicy(LayoutPolicy):
    """NOTE [Batch-dim analysis]."""

    def __init__(self, mode: DataParallelMode, mesh, dps: tuple[int, ...], batch_inputs: set):
        self.mode = mode
        self.mesh = mesh
        self.dps = dps        # the data axes' mesh dims (HSDP: replicate, shard)
        self.dp = dps[-1]     # the one state is split over ("shard")
        self.batch: set[fx.Node] = set(batch_inputs)   # values that hold the batch split
        self._reads_batch = False                     # does the current op read the batch?
        self._batch_dims: dict[tuple, set[int]] = {}  # shape of a batch value -> its batch dims

    # -- kinds -----------------------------------------------------------------------------
    def is_batch(self, ex, node) -> bool:
        v = ex.env.get(node)
        return node in self.batch and isinstance(v, DTensor) and self._batch_split(v)

    def _dp(self, x):
        return x.placements[self.dp]

    def _batch_split(self, x) -> bool:
        """Is ``x`` split over every data axis (the batch's layout)?"""
        return all(isinstance(x.placements[i], Shard) for i in self.dps)

    def _over_dps(self, x, kind) -> bool:
        """Is ``x`` laid out as ``kind`` (Replicate, ...) over every data axis?"""
        return all(isinstance(x.placements[i], kind) for i in self.dps)

    # -- hooks -------------------------------------------------------------------------------
    def before_op(self, ex, node, target, args, kwargs):
        if pending_divisor(target, args):
            # reduced first, the pending numerator travels (NOTE [HSDP]: pending over
            # every mesh axis, one all-reduce, where DTensor reduced one axis after the
            # other)
            args = (args[0], self._reduce(ex, args[1], (Replicate(),) * len(args[1].placements)),
                    *args[2:])
        batch_vals = {id(ex.env[a]): a for a in node.all_input_nodes if self.is_batch(ex, a)}
        self._reads_batch = bool(batch_vals)
        batch_args = {}       # id of the local tensor the op gets -> the batch input node
        dts = [a for a in _tensors((args, kwargs)) if isinstance(a, DTensor)]
        partial = [a for a in dts if _has_partial(a)]
        pending_travels = bool(partial) and travels(target, args, kwargs, dts, partial,
                                                    self.mode.reduce_dtype)
        meets_state = any(_is_split(self._dp(a)) and id(a) not in batch_vals
                          and not _has_partial(a) for a in dts)

        def fix(a):
            if not isinstance(a, DTensor):
                return a
            source = batch_vals.get(id(a))
            if _has_partial(a) and not pending_travels:
                # reduced where its consumer needs it: onto the layout of the state it
                # meets (the shards the optimizer runs on), else replicated
                if meets_state and not batch_vals:
                    peers = [b for b in dts if id(b) not in batch_vals]
                    a = self._reduce(ex, a, *self._state_layout(a, peers))
                else:
                    a = self._reduce(ex, a, (Replicate(),) * len(a.placements))
            elif batch_vals and any(_torch.is_partial(a.placements[i]) for i in self.dps):
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
            if node.args[0] in self.batch and isinstance(result, DTensor) and self._batch_split(result):
                self._add_batch(node, result)
        else:
            if node.target in SPECIAL_OPS:
                reads = any(a in self.batch for a in node.all_input_nodes) or node.target is RNG_OP
            else:
                reads = self._reads_batch
            self._reads_batch = False
            if reads and any(self._batch_split(v) for v in _tensors(result) if isinstance(v, DTensor)):
                self._add_batch(node, result)
            elif node.target is _EXPAND and isinstance(result, DTensor):
                result = self._split_broadcast(ex, node, result)
        if isinstance(result, DTensor) and _has_partial(result) \
                and reduced_by_readers(node, result, self.mode.reduce_dtype):
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
        if isinstance(node, fx.Node) and node in self.batch and self._batch_split(value):
            return done
        return self.mode.state_placements(value.shape, list(done), self.mesh, self.dp)

    # -- helpers -------------------------------------------------------------------------------
    def _add_batch(self, node, value) -> None:
        self.batch.add(node)
        for v in _tensors(value):
            if isinstance(v, DTensor) and self._batch_split(v):
                self._batch_dims.setdefault(tuple(v.shape), set()).add(self._dp(v).dim)

    def _split_broadcast(self, ex, node, value):
        """NOTE [A broadcast to the batch's shape]: ``value`` (an expand) split on the
        batch dim where it has the shape of a batch value and broadcasts along that dim."""
        dims = self._batch_dims.get(tuple(value.shape), set())
        if len(dims) != 1 or not self._over_dps(value, Replicate):
            return value
        d = next(iter(dims))
        src = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
        lead = value.ndim - (src.ndim if isinstance(src, torch.Tensor) else 0)
        if src is not None and d >= lead and src.shape[d - lead] != 1:
            return value              # not broadcast along the batch dim: a copy per example
        self.batch.add(node)
        return self._with_dps(ex, value, Shard(d))     # a slice of this rank's examples

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
            if slice_ and (i in self.dps or others) and isinstance(p, Replicate) \
                    and not isinstance(target[i], Replicate):
                pls[i] = target[i]
        a = ex.redistribute(a, pls)
        pending = [i for i, p in enumerate(pls) if (i in self.dps or others) and _torch.is_partial(p)]
        for i in pending:
            pls[i] = target[i]
        if all(isinstance(pls[i], Replicate) for i in pending):
            # over every mesh axis: one all-reduce where it can; over some: one per
            # axis, in the expander's order (Expander._reduced), whichever
            # order the mode's axes are named in
            return ex.redistribute(a, pls)
        rep = self.dps[0] if len(self.dps) > 1 else None
        if rep in pending and len(pending) > 1:
            # NOTE [HSDP]: reduced (reduce-scattered) over the other axes first, then
            # (the shard) over the replicate axis
            first = list(pls)
            first[rep] = a.placements[rep]
            a = ex.redistribute(a, first)
        return ex.redistribute(a, pls)

    def _with_dp(self, ex, a, placement):
        pls = list(a.placements)
        pls[self.dp] = placement
        return ex.redistribute(a, pls)

    def _with_dps(self, ex, a, placement):
        pls = list(a.placements)
        for i in self.dps:
            pls[i] = placement
        return ex.redistribute(a, pls)

    def _gather(self, ex, a):
        """``a`` replicated over the axis. A split of dim d > 0 (the view ``w.t()`` of a
        parameter shard) is gathered as dim 0 of ``a.movedim(d, 0)``: one all-gather
        and two views, where DTensor's own gather of dim d cuts the result into one
        piece per rank and concatenates them (a 128-way axis: 128 slices to trace)."""
        d = self._dp(a).dim
        if d == 0 or not isinstance(self._dp(a), Shard):      # (a _StridedShard: as it is)
            return self._with_dp(ex, a, Replicate())
        gathered = _torch.gather_moved(a, self.dp)     # (the same ops, without DTensor's dispatch)
        if gathered is not None:
            return gathered
        return self._with_dp(ex, a.movedim(d, 0), Replicate()).movedim(0, d)

    def _check_batch_kept(self, node, target, args, kwargs, batch_args):
        """Error if DTensor's plan for the op moves a batch input off its split."""
        moves = _torch.planned_redistributions(target, args, kwargs)
        for local, src, dst in moves or ():
            a, value = batch_args.get(id(local), (None, None))
            moved = [i for i in self.dps if src[i] != dst[i]]
            if a is not None and moved:
                i = moved[0]
                where = f" ({_torch.source_line(node)})" if _torch.source_line(node) else ""
                raise ValueError(
                    f"{self.mode!r} cannot keep the batch split over mesh axis "
                    f"{self.mesh.axis_names[i]!r} at node {node.name!r} = {target}{where}: its input "
                    f"{a.name!r} (shape {tuple(value.shape)}) is split over "
                    f"{self.mesh.axis_names[i]!r} as {src[i]}, and the op would need it as "
                    f"{dst[i]}, which gathers activations across the batch. Make the "
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
