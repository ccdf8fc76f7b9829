"""Every private (underscore) torch API that the project touches, in one place.

A torch upgrade should only ever need this file to change. Public torch APIs
(``torch.distributed.tensor``, ``torch.fx``, ``make_fx``) are imported where they
are used.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import (  # noqa: F401  (re-exported)
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
)
from torch.distributed.tensor import DTensor, Shard

from sharded import _registry

OpOverload = torch._ops.OpOverload
OpOverloadPacket = torch._ops.OpOverloadPacket


def op_arg_names(target) -> list[str]:
    """Argument names of an op overload's schema."""
    return [a.name for a in target._schema.arguments]


_NO_DEFAULT = object()


def op_arg_defaults(target) -> list[tuple[str, Any]]:
    """``(name, default)`` of each argument of an op overload's schema, in order;
    the default is ``NO_DEFAULT`` where the argument has none."""
    return [(a.name, a.default_value if a.has_default_value() else _NO_DEFAULT)
            for a in target._schema.arguments]


NO_DEFAULT = _NO_DEFAULT

# the logger of torch's fake-tensor machinery (it logs a failing op at ERROR level)
FAKE_TENSOR_LOGGER = "torch._subclasses.fake_tensor"


def inplace_overload(target) -> OpOverload | None:
    """The in-place form of an aten op overload, the same overload of the packet named
    with a trailing ``_`` (``aten.sub.Tensor`` -> ``aten.sub_.Tensor``), or None."""
    packet = getattr(torch.ops.aten, target.overloadpacket.__name__ + "_", None)
    if packet is None:
        return None
    return getattr(packet, target._overloadname, None)


def is_mutating_op(target) -> bool:
    """True for an aten/custom op overload that writes into one of its inputs."""
    return isinstance(target, OpOverload) and target._schema.is_mutable


def returns_fresh(target) -> bool:
    """True for an op overload whose schema says its results alias none of its inputs
    (``aten.cat``, ``aten.mm``; not ``aten.view`` or ``aten.reshape``: ``Tensor(a)``).
    A schema is no guarantee for composite ops (``einsum``, ``type_as``, ``dropout``
    may return an input); recorded programs hold their decompositions, not them."""
    return isinstance(target, OpOverload) and not target._schema.is_mutable and all(
        r.alias_info is None for r in target._schema.returns)


# The functional collectives as they appear in traced graphs.
c10d_functional = torch.ops._c10d_functional

# torch's functional collectives, entered in the registry of primitives (NOTE [One
# registry of primitives] in sharded/_registry.py) beside sharded's own (ppermute's
# point-to-point op, registered in sharded/collectives.py).
for _op, _kind in {
    c10d_functional.all_reduce.default: "all_reduce",
    c10d_functional.all_reduce_.default: "all_reduce",     # in place (NOTE [All-reduces in place])
    c10d_functional.all_gather_into_tensor.default: "all_gather",
    c10d_functional.reduce_scatter_tensor.default: "reduce_scatter",
    c10d_functional.all_to_all_single.default: "all_to_all",
    c10d_functional.broadcast.default: "broadcast",
}.items():
    _registry.define(_op, collective=_kind)
# DTensor's Shard(i) -> Shard(j) on CUDA meshes (gloo takes an all-gather instead): a
# collective the fingerprint and Lowered.collectives() must see. Synchronous: no wait.
if hasattr(torch.ops, "_dtensor") and hasattr(torch.ops._dtensor, "shard_dim_alltoall"):
    _registry.define(torch.ops._dtensor.shard_dim_alltoall.default, collective="all_to_all")
# op -> its kind as a collective ("all_reduce", ...): the registry's read-only view.
COLLECTIVE_OPS = _registry.COLLECTIVES
WAIT_OP = c10d_functional.wait_tensor.default


def new_fake_mode() -> FakeTensorMode:
    # Real tensors closed over by the function become constants of the graph.
    return FakeTensorMode(allow_non_fake_inputs=True)


def trace_on_fakes(fn, fakes: list, fake_mode) -> torch.fx.GraphModule:
    """``make_fx(fn, tracing_mode="fake")(*fakes)`` for inputs that are already fake
    tensors of ``fake_mode``, traced as AOTAutograd does: under that mode, without
    make_fx converting every input into a fake of a mode of its own (a GPT-2-small
    train step has 375 inputs). The function gets ``fakes`` themselves: an in-place op
    on an input changes them (``trace_global`` makes new ones to trace again). Each
    node's value is the fake the op made (NOTE [A traced value as the op made it])."""
    import threading

    from torch.fx.experimental import proxy_tensor

    set_meta = proxy_tensor.set_meta
    tracing_thread = threading.get_ident()      # (another thread's make_fx keeps its copies)

    def set_meta_as_made(proxy, val):
        node = proxy.node
        if (node.op == "placeholder" or node.op == "call_function" and not _factory(node.target)) \
                and _as_made(val) and threading.get_ident() == tracing_thread:
            node.meta["val"] = val
            return proxy
        return set_meta(proxy, val)

    proxy_tensor.set_meta = set_meta_as_made
    try:
        with fake_mode:
            gm = proxy_tensor.make_fx(fn, tracing_mode="real")(*fakes)
    finally:
        proxy_tensor.set_meta = set_meta
    # a joint program's forward values took autograd's history after they were stored:
    # copies without it, as make_fx's
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if _requires_grad(val):
            node.meta["val"] = _detached(fake_mode, val)
    return gm


# NOTE [A traced value as the op made it]
# make_fx keeps in each node's meta a detached copy of the op's fake result (a new
# FakeTensor per value, and per element of a foreach op's lists) and a TensorMetadata
# beside it, so that a later in-place op on the result cannot change what an earlier
# node says it made. pjit's trace has no in-place op by the time anything reads its
# values: one that has any is traced again under functionalize, from its code, not
# its meta, on new fakes (NOTE [Trace, then functionalize] in sharded/_trace.py; a
# shard_map body, traced inside it, likewise). So the trace keeps the fake the op
# made, and an input's the fake pjit made for it, without the copy or the
# TensorMetadata (nothing reads it): a third of make_fx's per-node bookkeeping on a
# GPT-2-small train step. Values that need the copy keep it: one with a constant's
# real value (const-propagated), and a factory's (``torch.ones``, ``zeros_like``:
# torch's binding of a factory returns a ``detach`` of the new tensor when something
# else holds it, a node more in the program). A joint program's forward values gain
# autograd's history only after they are stored; those that require grad are copied
# once the trace is done (autograd's graph stays out of the meta). Only the tracing
# thread's make_fx calls keep values so. On the GPT-2-small step the trace takes
# about 0.5 s less (benchmarks/results/compile_abstract.json); tests/test_pjit.py
# checks each value's shape, strides, offset, dtype and gradient flag against
# make_fx's copies.
@functools.cache
def _factory(target) -> bool:
    return isinstance(target, OpOverload) and any(a.name == "pin_memory" for a in target._schema.arguments)


def _requires_grad(val) -> bool:
    if isinstance(val, (tuple, list)):
        return any(_requires_grad(v) for v in val)
    return isinstance(val, torch.Tensor) and val.requires_grad


def _detached(fake_mode, val):
    from torch._subclasses.fake_impls import fast_detach

    if isinstance(val, (tuple, list)):
        return type(val)(_detached(fake_mode, v) for v in val)
    return fast_detach(fake_mode, val) if type(val) is FakeTensor and val.requires_grad else val


def _as_made(val) -> bool:
    if type(val) is FakeTensor:
        return not val.requires_grad and val.constant is None
    if type(val) in (tuple, list):
        return all(x is None or _as_made(x) for x in val)
    return False


def group_from_name(name: str) -> dist.ProcessGroup:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def is_functorch_wrapped(x: torch.Tensor) -> bool:
    """Is ``x`` a torch.func (grad/vmap) wrapper of a tensor?"""
    return torch._C._functorch.is_functorch_wrapped_tensor(x)


def is_vmapped(x: torch.Tensor) -> bool:
    """Is ``x`` batched by torch.func.vmap (under any other torch.func wrappers)?"""
    while torch._C._functorch.is_functorch_wrapped_tensor(x):
        if torch._C._functorch.is_batchedtensor(x):
            return True
        x = torch._C._functorch.get_unwrapped(x)
    return False


def functorch_base(x: torch.Tensor) -> torch.Tensor:
    """The plain tensor under ``x``'s torch.func (grad/vmap) wrappers, if any (the same
    Python object that the transform wrapped)."""
    while torch._C._functorch.is_functorch_wrapped_tensor(x):
        x = torch._C._functorch.get_unwrapped(x)
    return x


def clear_functorch_stack():
    """Context: run code as if no torch.func transform were active (tracing a
    self-contained subgraph from inside one)."""
    from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack

    return temporarily_clear_interpreter_stack()


def is_dtensor(x) -> bool:
    return isinstance(x, DTensor)


def is_fake(x) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(x, FakeTensor)


def fake_mode_of(x):
    """The FakeTensorMode a fake tensor belongs to (None for other tensors)."""
    return x.fake_mode if is_fake(x) else None


def written_args(func, args, kwargs) -> list:
    """The tensors an op overload writes into (its in-place and out= arguments)."""
    out = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        v = args[i] if i < len(args) else kwargs.get(a.name)
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out.extend(t for t in v if isinstance(t, torch.Tensor))
    return out


def dispatch_mode_base():
    """torch's base class for dispatch-level modes (below autograd and torch.func)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


def functorch_level() -> int:
    """How many torch.func transforms (grad, vmap, ...) the current code runs under."""
    level = torch._C._functorch.maybe_current_level()
    return 0 if level is None else level


def version(t: torch.Tensor) -> int:
    """The tensor's version counter (bumped by every in-place op on it)."""
    return t._version


def local_tensor(dt: DTensor) -> torch.Tensor:
    """The local shard of a DTensor without going through autograd (hot path)."""
    return dt._local_tensor


def dtensor_spec(dt: DTensor):
    return dt._spec


_DTENSOR_NEW = getattr(torch.Tensor, "_dtensor__new__", None)


def make_dtensor(local: torch.Tensor, spec) -> DTensor:
    """Wrap ``local`` with a precomputed DTensorSpec (no checks, no autograd). Calls
    DTensor's C++ constructor directly: ``DTensor(...)`` also runs an ``__init__``
    that does nothing but costs a dynamo-disable wrapper per call (2.0 -> 0.8 us)."""
    if _DTENSOR_NEW is not None:
        return _DTENSOR_NEW(DTensor, local, spec, requires_grad=local.requires_grad)
    return DTensor(local, spec, requires_grad=local.requires_grad)


def redistribute_untracked(dt: DTensor, placements) -> DTensor:
    """``dt.redistribute(dt.device_mesh, placements)`` without the autograd Function
    that wraps it, for a DTensor that needs no gradient (the expander's: its recording
    keeps the dispatched ops, where the Function leaves nothing): the same
    collectives and local ops, without the Function's per-call cost. Anything
    else (a gradient, a target DTensor checks or normalizes) takes the public path."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.distributed.tensor._redistribute import redistribute_local_tensor

    spec = dt._spec
    placements = tuple(placements)
    if spec.placements == placements:
        return dt
    if dt.requires_grad or any(
            (p.is_partial() and p != q) or getattr(p, "dim", 0) < 0
            for p, q in zip(placements, spec.placements)):
        return dt.redistribute(spec.mesh, placements)
    target = DTensorSpec(spec.mesh, placements, tensor_meta=spec.tensor_meta)
    out = _one_collective(dt._local_tensor, spec, placements)
    if out is None:
        out = redistribute_local_tensor(dt._local_tensor, spec, target, async_op=False,
                                        is_explicit=True)
    return make_dtensor(out, target)


def gather_moved(dt: DTensor, i: int) -> DTensor | None:
    """``dt`` replicated over mesh dim ``i``, where it is ``Shard(d)`` with d > 0, as
    dim 0 of ``dt.movedim(d, 0)`` (one all-gather), moved back: the local ops that
    ``dt.movedim(d, 0)``, its redistribute and ``.movedim(0, d)`` record, made on
    the local shard without DTensor's dispatch of the two moves (the layout is
    ``dt``'s with mesh dim ``i`` replicated, its global shape and strides ``dt``'s).
    None where NOTE [One collective for a move on one axis] does not apply (another
    mesh dim splits dim d too, an uneven split, one rank on the axis, a gradient), or
    where another mesh dim's placement is neither Shard nor Replicate (a pending sum,
    a _StridedShard: DTensor's moves may plan those otherwise)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    spec = dt._spec
    src = spec.placements[i]
    if dt.requires_grad or type(src) is not Shard or src.dim <= 0:
        return None
    d, mesh = src.dim, spec.mesh
    if any(type(p) not in (Shard, Replicate) for j, p in enumerate(spec.placements) if j != i) \
            or mesh.size(i) == 1 or not _alone_on_dim(spec, i, d):
        return None
    placements = tuple(Replicate() if j == i else p for j, p in enumerate(spec.placements))
    out = _all_gather_dim0(dt._local_tensor.movedim(d, 0), mesh, i)
    return make_dtensor(out.movedim(0, d), DTensorSpec(mesh, placements, tensor_meta=spec.tensor_meta))


def _alone_on_dim(spec, i: int, d: int) -> bool:
    """Does mesh dim ``i`` alone split dim ``d`` of ``spec``'s value, evenly, on a mesh
    this rank is in (NOTE [One collective for a move on one axis])?"""
    mesh = spec.mesh
    return (not any(getattr(p, "dim", None) == d for j, p in enumerate(spec.placements) if j != i)
            and mesh.get_coordinate() is not None and spec.shape[d] % mesh.size(i) == 0)


def _all_gather_dim0(x: torch.Tensor, mesh, i: int) -> torch.Tensor:
    """The ranks of mesh dim ``i``'s ``x`` stacked on dim 0: one all-gather and its wait."""
    return WAIT_OP(c10d_functional.all_gather_into_tensor.default(
        x.contiguous(), mesh.size(i), mesh.get_group(i).group_name))


# NOTE [One collective for a move on one axis]
# A gather (Shard(d) -> Replicate) or a reduce-scatter (Partial(sum) -> Shard(d)) on
# one mesh axis, evenly divided, no other axis splitting dim d: the collective and
# its wait, with the layout change written as one view, one move of dim d and one
# copy. DTensor's path makes the same collective, but moves dim d != 0 as one slice
# per rank and a cat (a 16-way axis: 16 slices and a cat per gradient to record and
# to run), and adds a narrow to every gather; its planner and padding checks cost
# more than the collective itself while recording. The local results have the
# shape, strides and values DTensor's have (contiguous); anything else (uneven,
# nested splits of one dim, other reductions) takes DTensor's path. DTensor's narrow
# (an identity slice on every dim of more than 256, where Python's small-int cache
# ends) was the gather's only reader, which hid the parameter's readers from
# ``regather_distant_uses``: a parameter of more than 256 rows was never gathered
# again for the backward (FSDP's reshard after forward), its gathered value kept
# alive across the step (tests/test_passes.py; the slices DTensor still makes in its
# own redistributes, inside an op, are dropped by ``remove_identity_views``). On the
# GPT-2-small step on a 16x4 mesh in DataParallelMode("shard") the local program has
# 4378 nodes instead of 5104, with identity slices dropped too
# (benchmarks/results/compile_abstract.json).
def _one_collective(local: torch.Tensor, spec, placements: tuple) -> torch.Tensor | None:
    from torch.distributed.tensor import Replicate, Shard

    changed = [i for i, (p, q) in enumerate(zip(spec.placements, placements)) if p != q]
    if len(changed) != 1:
        return None
    i = changed[0]
    src, dst = spec.placements[i], placements[i]
    if type(src) is Shard and type(dst) is Replicate:
        d, gather = src.dim, True
    elif is_plain_partial(src) and src.reduce_op == "sum" and type(dst) is Shard:
        d, gather = dst.dim, False
    else:
        return None
    mesh = spec.mesh
    if not _alone_on_dim(spec, i, d):
        return None
    g = mesh.size(i)
    if g == 1:              # (DTensor moves nothing on an axis of one rank)
        return local
    if not gather and local.shape[d] % g:
        return None
    group = mesh.get_group(i).group_name
    shape = list(local.shape)
    if gather:
        out = _all_gather_dim0(local, mesh, i)
        if d == 0:
            return out
        shape[d] *= g       # the ranks' blocks, stacked in dim 0, side by side in dim d
        return out.view(g, *local.shape).movedim(0, d).reshape(shape)
    x = local
    if d != 0:              # rank r's block of dim d first: [g * shape[0], ..., shape[d] / g, ...]
        x = x.view(*shape[:d], g, shape[d] // g, *shape[d + 1:]).movedim(d, 0)
        x = x.contiguous().flatten(0, 1)
    else:
        x = x.contiguous()
    return WAIT_OP(c10d_functional.reduce_scatter_tensor.default(x, "sum", g, group))


def local_shape_of(shape, placements, device_mesh) -> tuple:
    """This rank's shard shape of a tensor of ``shape`` laid out by ``placements``
    (any DTensor placement, _StridedShard included)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    with suspend_dispatch_modes():       # integer arithmetic with real tensors inside
        return tuple(compute_local_shape_and_global_offset(torch.Size(shape), device_mesh,
                                                           tuple(placements))[0])


def build_dtensor_spec(device_mesh, placements, shape, stride, dtype):
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    return DTensorSpec(
        device_mesh,
        tuple(placements),
        tensor_meta=TensorMeta(torch.Size(shape), tuple(stride), dtype),
    )


def hash_store():
    return dist.HashStore()


def is_plain_partial(placement) -> bool:
    """A pending reduction that is only a reduction (not _MaskPartial, whose reduce
    also applies the row-sharded embedding's mask, valid only on the embedding output)."""
    from torch.distributed.tensor import Partial

    return type(placement) is Partial


def strided_shard(dim: int, split_factor: int):
    """DTensor's _StridedShard: a split of ``dim`` minor to ``split_factor`` ranks'
    worth of splits by later mesh axes (NOTE [Axes out of mesh order] in spec.py)."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard(dim, split_factor=split_factor)


def split_factor(placement) -> int | None:
    """A _StridedShard's split factor; None for any other placement."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return placement.split_factor if isinstance(placement, _StridedShard) else None


def is_partial(placement) -> bool:
    from torch.distributed.tensor import Partial

    # _MaskPartial (row-sharded embedding) is a Partial subclass.
    return isinstance(placement, Partial)


# NOTE [Strided-shard index helper under tracing]
# On 2-D meshes DTensor lays out a dim split over two axes as _StridedShard, and its
# redistribute planner calls _StridedShard.local_shard_size_and_offset, which builds
# torch.arange(...) and calls .tolist() on it. While pjit expands a graph, the fake and
# proxy dispatch modes are active, so that arange is fake (``.tolist()`` fails with
# aten._local_scalar_dense) and, on success paths, bloats the trace with index ops.
# The helper is pure integer arithmetic on static sizes, so it runs with the dispatch
# modes suspended.
def _patch_strided_shard_helper() -> None:
    import functools

    from torch.distributed.tensor.placement_types import _StridedShard
    from torch.utils._python_dispatch import _disable_current_modes

    orig = _StridedShard.local_shard_size_and_offset
    if getattr(orig, "_sharded_patched", False):
        return

    @functools.wraps(orig)
    def local_shard_size_and_offset(*args, **kwargs):
        with _disable_current_modes():
            return orig(*args, **kwargs)

    local_shard_size_and_offset._sharded_patched = True
    _StridedShard.local_shard_size_and_offset = local_shard_size_and_offset


_patch_strided_shard_helper()


# NOTE [DTensor caches while expanding]
# DTensor skips its sharding-propagation and redistribute-planner caches whenever
# it is being traced, because torch.compile may trace with symbolic shapes, which are
# unhashable. pjit expands with static shapes only, so the caches are safe, and
# without them each op re-plans from scratch. While this context is active, those two
# modules see "not tracing"; the functional collectives (which decide whether to
# wait eagerly) are not affected. Two more paths skip a cache while tracing, and are
# given one here for as long as the context lasts:
# - The C++ dispatch cache's misses land in `propagate_op_sharding_non_cached`, which
#   does not look in the Python cache that `propagate` (planned_redistributions, the
#   batch check) fills: an op that was planned first was propagated twice. The
#   propagator's instance attribute now goes through that cache.
# - `redistribute_cost` (called for every candidate strategy times every input when an
#   op's single-mesh-dim strategies are expanded to a 2-D mesh: most of the time of a
#   first propagation) plans each move without its cache. Its plans are kept in a dict
#   that lives as long as the context.
@contextlib.contextmanager
def dtensor_caches_while_tracing():
    from torch.distributed.tensor import _redistribute, _sharding_prop

    prop = DTensor._op_dispatcher.sharding_propagator
    uncached = prop.propagate_op_sharding_non_cached
    own = prop.__dict__.get("propagate_op_sharding_non_cached")   # (an enclosing context's)
    plan = _redistribute._gen_transform_infos_non_cached
    plans: dict = {}

    def propagate_shared(schema):
        try:
            hash(schema)
        except TypeError:      # an unhashable schema: as DTensor does it
            return uncached(schema)
        return prop.propagate_op_sharding(schema)

    def plan_kept(src, dst, use_graph_based_transform=None):
        key = (src, dst, use_graph_based_transform)
        try:
            if key in plans:
                return plans[key]
        except TypeError:      # symbolic shapes (another thread's torch.compile)
            return plan(src, dst, use_graph_based_transform)
        plans[key] = plan(src, dst, use_graph_based_transform)
        return plans[key]

    saved = (_sharding_prop._are_we_tracing, _redistribute._are_we_tracing)
    _sharding_prop._are_we_tracing = _redistribute._are_we_tracing = _not_tracing
    prop.propagate_op_sharding_non_cached = propagate_shared
    _redistribute._gen_transform_infos_non_cached = plan_kept
    try:
        yield
    except BaseException:
        # A trace that stopped halfway can leave state in cached specs (a _MaskPartial
        # whose mask buffer was never released); the next trace must not see it.
        DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
        _redistribute._gen_transform_infos.cache_clear()
        raise
    finally:
        _sharding_prop._are_we_tracing, _redistribute._are_we_tracing = saved
        if own is None:
            del prop.propagate_op_sharding_non_cached       # the class's method again
        else:
            prop.propagate_op_sharding_non_cached = own
        _redistribute._gen_transform_infos_non_cached = plan


def _not_tracing() -> bool:
    return False


# Multi-tensor ("foreach") math: one op over a list of tensors; the pure-functional
# optimizers use these so that an update is a handful of graph nodes, not a dozen per
# parameter. DTensor has sharding strategies for them.
foreach_add = torch._foreach_add
foreach_sub = torch._foreach_sub
foreach_mul = torch._foreach_mul
foreach_div = torch._foreach_div
foreach_addcmul = torch._foreach_addcmul
foreach_sqrt = torch._foreach_sqrt


def fused_adamw(params, grads, exp_avgs, exp_avg_sqs, steps, *, lr, beta1, beta2,
                weight_decay, eps):
    """AdamW as one fused kernel over lists (the one ``torch.optim.AdamW(fused=True)``
    runs), functional: returns new ``(params, exp_avgs, exp_avg_sqs)``. A pass that
    finds the inputs dead afterwards may run it in place (``_fused_adamw_``)."""
    # sharded.optim: a 0-d tensor lr takes the kernel's tensor-lr overload (NOTE
    # [Traced hyperparameters] in sharded/optim.py)
    op = FUSED_ADAMW_TENSOR_LR if isinstance(lr, torch.Tensor) else FUSED_ADAMW
    # NOTE [The fused kernel reads memory in order]: torch 2.13's CPU kernel walks
    # each tensor's memory from its data pointer, numel elements, whatever its strides:
    # a transposed gradient (an einsum's, a permute's) is read scrambled, and in the
    # in-place form an expanded one (the gradient of ``w.sum()``) past its storage's
    # end. Every tensor goes in contiguous (a no-op, and no node in a traced program,
    # where it already is; the expander does the same for the local shards).
    params, grads, exp_avgs, exp_avg_sqs = (
        [t.contiguous() for t in ts] for ts in (params, grads, exp_avgs, exp_avg_sqs))
    out = op(
        params, grads, exp_avgs, exp_avg_sqs, [], steps, lr=lr, beta1=beta1, beta2=beta2,
        weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False)
    return out[0], out[2], out[3]


FUSED_ADAMW = torch.ops.aten._fused_adamw.default
FUSED_ADAMW_INPLACE = torch.ops.aten._fused_adamw_.default
# sharded.optim: the fused kernel with ``lr`` a tensor (a schedule's value), and its
# in-place form
FUSED_ADAMW_TENSOR_LR = torch.ops.aten._fused_adamw.tensor_lr
FUSED_ADAMW_TENSOR_LR_INPLACE = torch.ops.aten._fused_adamw_.tensor_lr
# each functional fused AdamW overload -> its in-place form (the one table the
# expander, the in-place pass and the runner read)
FUSED_ADAMW_IN_PLACE = {FUSED_ADAMW: FUSED_ADAMW_INPLACE,
                        FUSED_ADAMW_TENSOR_LR: FUSED_ADAMW_TENSOR_LR_INPLACE}


def suspend_dispatch_modes():
    """Run code outside the active fake/proxy modes (e.g. to infer shapes while tracing)."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


# -- failures: the store every rank can read, and closing process groups ----------------

def default_store():
    """The c10d store of the default process group (every rank can read it)."""
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


# NOTE [Closing gloo connections]
# gloo closes a group's TCP connections only when its ProcessGroup object is freed;
# ``abort()`` and ``shutdown()`` leave them open, and a peer blocked on the group stays
# blocked. ``destroy_process_group`` drops torch's own registries, but two more holders
# keep groups alive: every DeviceMesh keeps its groups in ``_pg_registry``, and
# ``torch.distributed.nn.functional`` binds ``group.WORLD`` as a default argument when
# it is first imported (dynamo imports it the first time a DTensor is made). With
# those cleared the groups are freed and their peers see "Connection closed by peer"
# within a second. A group that user code still holds stays open: its peers then wait
# for their own timeout (or for this process to exit).
def release_process_groups() -> None:
    """Destroy every process group of this process and drop the references that
    would keep gloo's connections open (NOTE [Closing gloo connections])."""
    import gc
    import sys

    from torch.distributed.device_mesh import DeviceMesh

    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - already half torn down
            pass
    for obj in gc.get_objects():
        # (not isinstance: DeviceMesh's metaclass inspects every object it is asked about)
        if DeviceMesh in type(obj).__mro__:
            registry = getattr(obj, "_pg_registry", None)
            if isinstance(registry, dict):
                registry.clear()
    functional = sys.modules.get("torch.distributed.nn.functional")
    if functional is not None:
        for fn in list(vars(functional).values()):
            defaults = getattr(fn, "__defaults__", None)
            if defaults and any(isinstance(d, dist.ProcessGroup) for d in defaults):
                fn.__defaults__ = tuple(None if isinstance(d, dist.ProcessGroup) else d
                                        for d in defaults)
    gc.collect()


def written_tensors(func, args, kwargs) -> list:
    """The tensors an op overload writes into (its ``(a!)`` arguments)."""
    schema = getattr(func, "_schema", None)
    if schema is None or not schema.is_mutable:
        return []
    out = []
    for i, a in enumerate(schema.arguments):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        v = args[i] if i < len(args) else kwargs.get(a.name)
        for t in (v if isinstance(v, (list, tuple)) else (v,)):
            if isinstance(t, torch.Tensor):
                out.append(t)
    return out


def is_tracing_tensor(x: torch.Tensor) -> bool:
    """A fake tensor, or a torch.func / functionalization wrapper: a value that exists
    only while a function is traced."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    return (isinstance(x, (FakeTensor, FunctionalTensor)) or is_functorch_wrapped(x)
            or torch._is_functional_tensor(x))


# NOTE [Bounded caches]
# A compile makes several fx.GraphModules (the traced global program, its
# functionalized form, the expansion, the passes' recompiles), and torch.fx keeps the
# source of every one it ever generated (``torch.fx.graph_module._loader.eval_cache``
# and a ``linecache`` entry, for tracebacks) for the life of the process: ~16 KB per
# compile that outlives the program. pjit drops the sources of the graph modules a
# compile made and did not keep as soon as it ends, and those of the kept ones
# (``Lowered.global_graph``/``local_graph``) when they are freed. Process-wide caches
# that grow with every new shape (the fake-tensor dispatch cache, DTensor's
# sharding-propagation and redistribute-plan caches, which pjit turns on while
# expanding) are cleared when they pass ``_CACHE_LIMIT`` entries.

_CACHE_LIMIT = 4096


def fx_source_mark() -> int:
    """A mark before a compile: sources generated after it are that compile's."""
    from torch.fx.graph_module import _loader

    return _loader.next_id


def release_fx_sources(since: int, keep=()) -> None:
    """Forget the generated sources of graph modules made since ``since``, except
    those of ``keep`` (forgotten when each of them is freed)."""
    import weakref

    from torch.fx.graph_module import _loader

    kept = {_source_key(type(gm)) for gm in keep}
    for key in list(_loader.eval_cache):
        if _source_id(key) >= since and key not in kept:
            _drop_source(key)
    for gm in keep:
        # (looked up when ``gm`` is freed: a lazy module generates its code, and so
        # its source's key, only when it is read or run: NOTE [Code generated once])
        weakref.finalize(gm, _drop_source_of, type(gm))


def _source_key(cls) -> str | None:
    """The key of the generated source of a graph module's class, or None (a lazy
    module whose code was never generated)."""
    code = getattr(cls.__dict__.get("forward"), "__code__", None)
    return code.co_filename if code is not None and code.co_filename.startswith("<eval_with_key>") \
        else None


def _drop_source_of(cls) -> None:
    key = _source_key(cls)
    if key is not None:
        _drop_source(key)


def _source_id(key: str) -> int:
    try:
        return int(key.split(".", 1)[1].split(" ", 1)[0])
    except (IndexError, ValueError):
        return -1


def _drop_source(key: str) -> None:
    import linecache

    from torch.fx.graph_module import _loader

    _loader.eval_cache.pop(key, None)
    linecache.cache.pop(key, None)


def bound_process_caches() -> None:
    """Clear the process-wide caches that grow with every new shape once they pass
    ``_CACHE_LIMIT`` entries (NOTE [Bounded caches])."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.tensor import _redistribute

    if len(FakeTensorMode.cache) > _CACHE_LIMIT:
        FakeTensorMode.cache_clear()
    prop = DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding
    if prop.cache_info().currsize > _CACHE_LIMIT:
        prop.cache_clear()
    if _redistribute._gen_transform_infos.cache_info().currsize > _CACHE_LIMIT:
        _redistribute._gen_transform_infos.cache_clear()


def planned_redistributions(op, args, kwargs) -> list[tuple[torch.Tensor, tuple, tuple]]:
    """The input redistributions DTensor will perform before running ``op`` on
    ``args``: ``(local tensor of the DTensor input, its placements, the placements
    DTensor moves it to)`` for each input it moves. Empty when it moves none; None when
    DTensor cannot plan the op here (it decomposes it instead)."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.utils import _pytree

    dispatcher = DTensor._op_dispatcher
    try:
        info = dispatcher.unwrap_to_op_info(op, args, kwargs)
        dispatcher.sharding_propagator.propagate(info)
    except NotImplementedError:
        return None
    out = info.output_sharding
    if out is None or not out.needs_redistribute or out.redistribute_schema is None:
        return []
    wanted = out.redistribute_schema.args_schema
    if info.args_tree_spec is not None:
        wanted = tuple(_pytree.tree_leaves(wanted))
    moves = []
    for i, spec in enumerate(info.flat_args_schema):
        if isinstance(spec, DTensorSpec) and isinstance(wanted[i], DTensorSpec) and spec != wanted[i]:
            moves.append((info.local_args[i], tuple(spec.placements), tuple(wanted[i].placements)))
    return moves


def planned_kwarg_placements(op, args, kwargs) -> dict[str, tuple]:
    """The placements DTensor's plan for ``op`` wants each tensor keyword argument in,
    for those it would need moved. DTensor moves positional inputs to its plan's
    layouts but never keyword ones ("it's very rare that we need to reshard kwargs",
    torch's _dispatch.redistribute_local_args), and its plan does not even say that
    they need moving: it would run the kernel on a keyword tensor's local data as it
    is (SDPA's ``attn_mask``). So the plan is made here as DTensor makes it (the op's
    strategy, the cheapest of its specs), for ops with a strategy function (every
    ``register_sharding`` rule); others: {}."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.distributed.tensor._op_schema import OpStrategy
    from torch.distributed.tensor._sharding_prop import _select_min_cost_strategy

    dispatcher = DTensor._op_dispatcher
    prop = dispatcher.sharding_propagator
    strategy_fn = prop.op_strategy_funcs.get(op)
    if strategy_fn is None:
        return {}
    schema = dispatcher.unwrap_to_op_info(op, args, kwargs).schema
    names = [k for k, v in schema.kwargs_schema.items() if isinstance(v, DTensorSpec)]
    if not names:
        return {}
    strategy = strategy_fn(prop._wrap_with_op_strategy(schema))
    if not isinstance(strategy, OpStrategy):
        return {}
    chosen = _select_min_cost_strategy(strategy, schema).input_specs or ()
    specs = list(chosen)[len(schema.args_spec):]
    return {k: tuple(w.placements) for k, w in zip(names, specs)
            if isinstance(w, DTensorSpec) and w.placements != schema.kwargs_schema[k].placements}


# NOTE [Positions in a graph]
# Passes that move nodes ask which of two nodes comes first. A dict of positions
# taken from ``enumerate(graph.nodes)`` goes stale at the first move, and rebuilding
# it after every move costs O(nodes) each time: 3,100 nodes times 60-120 reductions on
# a GPT-2-small step, a tenth of a second per pass. torch.fx keeps an order key on
# every node (``Node._sort_key``, what ``node_a < node_b`` compares), updated as nodes
# are inserted and moved: ``POSITIONS[node]`` reads it. Keys compare within one graph.
class _Positions:
    """``POSITIONS[node]``: ``node``'s place in its graph, current after any move
    (NOTE [Positions in a graph])."""

    __slots__ = ()

    def __getitem__(self, node: torch.fx.Node):
        return node._sort_key


POSITIONS = _Positions()


# NOTE [Code generated once]
# A GraphModule generates its Python code (``gm.code``, ``forward``) when it is made and
# on every ``recompile()``: 0.13-0.19 s each for the GPT-2-small step's programs. The
# lowering made three modules whose code nothing runs (make_fx's global trace, the
# loss rewrite's recompile of it, the partition's recording) before the local
# program's passes. These are torch's ``_LazyGraphModule``s: ``recompile()`` only
# marks the code stale, and reading ``code``, calling the module or pickling it
# generates it then. The local program's code is generated once, at the end of the
# lowering (``generate_code``), so that a lowered program's first call does not pay
# for it. Not every path is down to one generation: a program with in-place ops is
# traced again under functionalize, a joint (autograd) program is split by torch's
# partitioner, and AUTO prices two candidates, each with modules of its own. The
# sources of generated code are dropped when their module is freed, looked up then
# (NOTE [Bounded caches]: a lazy module has none until it is read). torch's switch
# for lazy modules is a process-wide flag, set for the duration of pjit's trace
# (pjit's compiles hold ``COMPILE_LOCK``; another thread's make_fx meanwhile would
# make lazy modules too, which behave the same).
def lazy_graph_modules():
    """Context: GraphModules made inside it (make_fx's) generate their code only when
    it is read or run (NOTE [Code generated once])."""
    from torch.fx._lazy_graph_module import _use_lazy_graph_module

    return _use_lazy_graph_module(True)


def lazy_graph_module(root, graph: torch.fx.Graph) -> torch.fx.GraphModule:
    """``GraphModule(root, graph)`` that generates its code when it is read or run."""
    from torch.fx._lazy_graph_module import _LazyGraphModule

    return _LazyGraphModule(root, graph)


def generate_code(gm: torch.fx.GraphModule, stale: bool) -> None:
    """Generate ``gm``'s code now: when ``stale`` (its graph changed since), or when
    it is a lazy module whose code was never generated (NOTE [Code generated once])."""
    from torch.fx._lazy_graph_module import _LazyGraphModule

    if stale:
        gm.recompile()
    if isinstance(gm, _LazyGraphModule):
        gm.real_recompile()


# NOTE [User stack traces]
# Later steps name the user's source line of a node (``node.meta["stack_trace"]``).
# make_fx(record_stack_traces=True) captures and symbolizes the whole Python stack
# for every node (a third of the trace's time on GPT-2-small) and then keeps only the
# frames from the first function named ``forward`` on (nn.Module code): a node traced
# from a pure function gets none. While pjit traces, ``user_stack_traces`` records the
# user's frames instead, cheaply: a walk up ``sys._getframe`` that skips torch's, this
# project's and the standard library's frames (decided once per code object), the
# innermost user frames formatted as a traceback would be.
@contextlib.contextmanager
def user_stack_traces(depth: int = 4):
    import linecache
    import os
    import sys
    import sysconfig

    from torch.fx.proxy import TracerBase

    here = os.path.dirname(os.path.abspath(__file__))
    internal = tuple(os.path.join(p, "") for p in (
        os.path.dirname(torch.__file__), here, os.path.join(os.path.dirname(here), "transforms"),
        sysconfig.get_paths()["stdlib"]))
    # by the code object's id, the code object kept alive with the answer: hashing a
    # code object hashes its bytecode and constants (torch's dispatch functions are
    # large, and the walk passes dozens of them per node)
    is_user: dict = {}
    texts: dict = {}            # the user's frames -> their formatted text
    create_node = TracerBase.create_node

    def create_node_with_user_frames(self, *args, **kwargs):
        node = create_node(self, *args, **kwargs)
        if node.meta.get("stack_trace"):
            return node
        frames = []
        f = sys._getframe(1)
        while f is not None and len(frames) < depth:
            code = f.f_code
            known = is_user.get(id(code))
            if known is None:
                known = is_user[id(code)] = (code, not code.co_filename.startswith("<") and not
                                             os.path.abspath(code.co_filename).startswith(internal))
            if known[1]:
                frames.append((code.co_filename, f.f_lineno, code.co_name))
            f = f.f_back
        if frames:
            key = tuple(frames)
            text = texts.get(key)
            if text is None:
                text = texts[key] = "\n".join(
                    f'  File "{file}", line {line}, in {name}\n    {linecache.getline(file, line).strip()}'
                    for file, line, name in reversed(frames))
            node.meta["stack_trace"] = text
        return node

    TracerBase.create_node = create_node_with_user_frames
    try:
        yield
    finally:
        TracerBase.create_node = create_node


# NOTE [Tracing as torch.export does]
# Libraries ask torch whether they are being traced, and take a traceable branch if
# so: transformers' masking code (find_packed_sequence_indices, the SDPA causal-mask
# shortcut) calls ``.all()`` on a tensor unless ``torch.compiler.is_compiling()`` or
# its own fake-tensor check says otherwise, and the fake tensor check sees only
# torch.func's wrappers under grad. torch.export's non-strict mode, which traces with
# make_fx as pjit does, sets both ``is_compiling()`` and ``is_exporting()`` for the
# duration of its trace (torch._export.utils._compiling_state_context); pjit's trace
# of the user's function does the same, so such code takes the branch it takes under
# export. (torch itself reads the flags too, in the same way as under export: e.g.
# nn.Module skips its always-called hooks after an exception.)
def export_tracing_state():
    """Context: ``torch.compiler.is_compiling()`` and ``is_exporting()`` are True, as
    torch.export's non-strict trace sets them."""
    from torch._export.utils import _compiling_state_context

    return _compiling_state_context()


def source_line(node) -> str:
    """``File "...", line N, in fn`` of the user's code that made ``node``, or ''."""
    trace = node.meta.get("stack_trace") or ""
    lines = [ln.strip() for ln in trace.strip().splitlines() if ln.strip().startswith("File ")]
    return lines[-1] if lines else ""


def storage_key(t: torch.Tensor):
    """An identity for ``t``'s storage (equal for views of one tensor; fake tensors
    too), for alias analysis of traced graphs."""
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(t.untyped_storage())


# -- the joint forward/backward program (pjit under autograd) ----------------------------

def partition_joint(joint, n_fwd_outputs: int):
    """Split a joint forward+backward graph into ``(forward, backward)`` graph modules
    with torch's default partitioner (AOTAutograd's), keeping the program's own order:
    the forward computes the first ``n_fwd_outputs`` outputs and returns, after them,
    the values the backward needs; the backward takes those values (in that order),
    then the cotangents, and returns the joint graph's remaining outputs.

    ``joint``'s nodes carry ``meta["sharded_phase"]`` ("forward" / "backward") and its
    cotangent inputs are placeholders named ``tangents_<k>`` (the partitioner's
    conventions, set here from the phase tags)."""
    import warnings

    from torch._functorch.partitioners import default_partition

    for n in joint.graph.nodes:
        phase = n.meta.get(_registry.META_PHASE)
        if phase is not None:
            n.meta["partitioner_tag"] = "is_forward" if phase == "forward" else "is_backward"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return default_partition(joint, None, num_fwd_outputs=n_fwd_outputs)


# -- donated inputs (pjit donate_argnums) -------------------------------------------------

class _Donated(torch.Tensor):
    """What a donated DTensor holds as its local tensor after the call: the metadata
    of the old shard, and an error for every op (NOTE [Donation] in sharded/_program.py)."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, like: torch.Tensor, message: str):
        t = torch.Tensor._make_wrapper_subclass(cls, like.shape, strides=like.stride(),
                                                dtype=like.dtype, device=like.device)
        t._message = message
        return t

    def __repr__(self):
        return f"<donated: {self._message}>"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        from torch.utils._pytree import tree_leaves

        for a in tree_leaves((args, kwargs or {})):
            if isinstance(a, _Donated):
                raise RuntimeError(a._message)
        raise RuntimeError("a donated tensor was used")


def mark_donated(dt: DTensor, message: str) -> None:
    """Make every later use of ``dt``'s data raise ``message`` (its storage now
    belongs to the program's outputs)."""
    dt._local_tensor = _Donated(dt._local_tensor, message)


def donated_message(dt: DTensor) -> str | None:
    """Why ``dt`` may not be used (it was donated), or None."""
    local = dt._local_tensor
    return local._message if isinstance(local, _Donated) else None


# NOTE [Abstract meshes]
# Mesh.abstract lowers programs for meshes this machine cannot run. A DeviceMesh built
# with ``_init_backend=False`` and an explicit ``_rank`` is this rank's view of the grid
# without joining any process group; each axis gets a process group whose backend is
# torch's FakeProcessGroup (it communicates nothing), registered under a name of its
# own so that DTensor's redistributes and the functional collectives resolve it. The
# registry holds groups weakly: the DeviceMesh keeps them alive. A DeviceMesh equals
# any other over the same rank grid and names (its process groups take no part), so
# DTensor's sharding and redistribute caches would hand an abstract mesh's ops specs
# that hold a real mesh of the same shape (its real groups) or another rank's abstract
# mesh: each abstract mesh gets a ``_thread_id`` of its own, which the equality and
# the hash include (torch uses the field only for the threaded test backend).
_ABSTRACT_IDS = iter(range(-1, -(2 ** 62), -1))


def pipeline_schedule_table(schedule: str, n_ranks: int, n_microbatches: int,
                            virtual: int) -> dict[int, list[tuple[str, int, int] | None]]:
    """torch.distributed.pipelining's per-rank compute table for ``schedule`` ("GPipe",
    "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble"):
    (kind, stage, micro-batch) per slot, kind "F", "B", "I" or "W"; None for an idle
    slot or another action. torch builds every rank's list in each instance, so
    stand-ins for rank 0's stages suffice: stages 0, p, 2p, ... (looped) or 0 and 2p-1
    (ZBVZeroBubble's V: torch derives each rank's two stages, r and 2p-1-r, from
    ``num_stages``). The zero-bubble schedules call
    ``_check_torch_compile_compatibility(stages)``, which reads ``stage.submod``: the
    stand-ins carry an empty ``nn.Module``. (1F1B's table is wrong on the last rank in
    torch 2.13: sharded/pipelining/_schedules.py does not use it.)"""
    import types

    from torch.distributed.pipelining import schedules as ts

    n_stages = n_ranks * virtual

    def stand_in(stage_index: int):
        return types.SimpleNamespace(
            num_stages=n_stages, group_size=n_ranks, group_rank=0, stage_index=stage_index,
            is_first=stage_index == 0, is_last=stage_index == n_stages - 1,
            stage_index_to_group_rank=None, submod=torch.nn.Module())

    if schedule in ("GPipe", "1F1B"):
        single = ts.ScheduleGPipe if schedule == "GPipe" else ts.Schedule1F1B
        table = single(stand_in(0), n_microbatches)._get_pipeline_order() or {}
    elif schedule == "ZBVZeroBubble":
        table = ts.ScheduleZBVZeroBubble([stand_in(0), stand_in(n_stages - 1)],
                                         n_microbatches).pipeline_order
    else:
        cls = {"Interleaved1F1B": ts.ScheduleInterleaved1F1B, "LoopedBFS": ts.ScheduleLoopedBFS,
               "InterleavedZeroBubble": ts.ScheduleInterleavedZeroBubble}[schedule]
        table = cls([stand_in(n_ranks * i) for i in range(virtual)], n_microbatches).pipeline_order
    kinds = {ts._ComputationType.FORWARD: "F", ts._ComputationType.FULL_BACKWARD: "B",
             ts._ComputationType.BACKWARD_INPUT: "I", ts._ComputationType.BACKWARD_WEIGHT: "W"}
    out: dict[int, list[tuple[str, int, int] | None]] = {}
    for rank, actions in table.items():
        row: list[tuple[str, int, int] | None] = []
        for a in actions:
            kind = None if a is None else kinds.get(a.computation_type)
            row.append(None if a is None or kind is None or a.microbatch_index is None
                       else (kind, a.stage_index, a.microbatch_index))
        out[rank] = row
    return out


def boxed(gm) -> None:
    """Make ``gm`` take its inputs as one list that it empties as it goes (fx's boxed
    calling convention, as AOTAutograd's): each input is freed after its last use inside
    the graph, not when the caller's references go."""
    gm.graph.set_codegen(torch.fx.graph._BoxedCodeGen())
    gm.recompile()


def is_boxed(runner) -> bool:
    """Whether ``runner`` is a GraphModule that ``boxed`` made take one list."""
    return isinstance(runner, torch.fx.GraphModule) and \
        isinstance(runner.graph._codegen, torch.fx.graph._BoxedCodeGen)


def op_name(target) -> str | None:
    """The qualified name of an op overload's schema (``"aten::_fused_adamw"``), or
    None for anything else."""
    return target._schema.name if isinstance(target, OpOverload) else None


def device_mesh_without_groups(device_type: str, grid: torch.Tensor, names, rank: int):
    """A DeviceMesh over ``grid``'s ranks with no process groups (NOTE [Stage slices] in
    sharded/mesh.py): DTensors on it hold empty local tensors on the other ranks."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh(device_type, grid, mesh_dim_names=tuple(names), _init_backend=False,
                      _rank=rank)


def abstract_device_mesh(shape, axis_names, rank: int, device_type: str):
    from torch.distributed.device_mesh import DeviceMesh

    grid = torch.arange(int(torch.tensor(shape).prod())).reshape(shape)
    dm = DeviceMesh(device_type, grid, mesh_dim_names=tuple(axis_names), _init_backend=False,
                    _rank=rank)
    coord = [int(c) for c in (grid == rank).nonzero()[0]]
    # the names hold the whole mesh (shape and every axis name): two abstract meshes of
    # one shape that share an axis name, or any two of one shape ("all"), would collide
    dm._sharded_group_prefix = (f"sharded_abstract_{'x'.join(map(str, shape))}_"
                                f"{'.'.join(axis_names)}")
    dm._dim_group_names = [
        _fake_group(dm, f"{dm._sharded_group_prefix}_{axis}_r{rank}", coord[d], shape[d])
        for d, axis in enumerate(axis_names)]
    dm._thread_id = next(_ABSTRACT_IDS)
    dm._hash = None
    dm._sharded_abstract = (tuple(shape), rank)

    def get_local_rank(mesh_dim=None):
        # DTensor's CPU path for moving a shard to another dim (gloo has no all-to-all:
        # it gathers and slices) asks the group for this rank's index, which a group of
        # an abstract mesh cannot answer: its coordinate does
        if mesh_dim is None:
            mesh_dim = 0
        if isinstance(mesh_dim, str):
            mesh_dim = list(axis_names).index(mesh_dim)
        return coord[mesh_dim]

    dm.get_local_rank = get_local_rank
    return dm


# NOTE [One reduction over every mesh axis]
# A pending sum over several mesh axes (a loss over the batch and a vocab-parallel
# head: Partial on "dp" and on "tp") is reduced by DTensor one axis after the other:
# two all-reduces in sequence (DTensor warns), unless a flattened DeviceMesh over
# those axes exists, which is a process group of its own and collective to create.
# Over every axis of a mesh that spans the world, the world's group is that group
# (no group to create, nothing communicated); over every axis of an abstract mesh, a
# fake group of the mesh's size. Other sets of axes keep the reductions in sequence.
# The expander's redistribute takes this group for every mode and every move
# (``Expander._reduced`` in sharded/modes/_expand.py).
def mesh_group(device_mesh) -> str | None:
    """The name of a process group over every rank of ``device_mesh`` that exists
    without communicating (NOTE [One reduction over every mesh axis]), or None."""
    abstract = getattr(device_mesh, "_sharded_abstract", None)
    if abstract is None:
        if dist.is_initialized() and device_mesh.size() == dist.get_world_size():
            return dist.group.WORLD.group_name
        return None
    name = getattr(device_mesh, "_sharded_mesh_group", None)
    if name is None:
        rank = abstract[1]
        name = _fake_group(device_mesh, f"{device_mesh._sharded_group_prefix}_all_r{rank}",
                           rank, device_mesh.size())
        device_mesh._sharded_mesh_group = name
    return name


def _fake_group(device_mesh, name: str, rank: int, size: int) -> str:
    """A fake process group (collectives that communicate nothing) of ``size`` ranks,
    this one ``rank``, registered as ``name`` and kept alive by ``device_mesh`` (the
    registry holds groups weakly); returns ``name``."""
    from torch._C._distributed_c10d import FakeProcessGroup, ProcessGroup
    from torch.distributed.distributed_c10d import _register_process_group

    backend = FakeProcessGroup._create_internal(rank, size, FakeProcessGroup.Options())
    pg = ProcessGroup(dist.HashStore(), rank, size)
    for dev in ("cpu", "cuda"):
        pg._register_backend(torch.device(dev), ProcessGroup.BackendType.CUSTOM, backend)
    pg._set_default_backend(ProcessGroup.BackendType.CUSTOM)
    pg._set_group_name(name)
    _register_process_group(name, pg)
    device_mesh._pg_registry[name] = pg
    return name


def compile_ahead(module, example_inputs: list):
    """Inductor's code for the aten graph module ``module``, compiled now and not
    run: the example inputs give the shapes, dtypes and strides (inductor traces them
    as fake tensors; their data is not read). The compiled code asserts that its
    inputs have those sizes and strides. Inductor's pre-grad passes edit the module
    they are given: pass a copy. (``torch.compile`` compiles at the first call, inside
    the run, so it cannot be asked whether it compiled before any of the program's
    collectives are issued.)"""
    from torch._inductor.compile_fx import compile_fx
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    # Fake inputs from a mode with a ShapeEnv (all shapes static): without one,
    # inductor's and AOTAutograd's on-disk caches are bypassed ("No shape env") and
    # every process compiles from scratch.
    mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)
    fakes = [mode.from_tensor(x, static_shapes=True) if isinstance(x, torch.Tensor) else x
             for x in example_inputs]
    return compile_fx(module, fakes)


# -- mixed precision (sharded/precision.py) -------------------------------------------

def in_grad_transform() -> bool:
    """Does the current code run under a torch.func gradient transform (grad,
    grad_and_value, vjp, jacrev), at any depth of the transform stack?"""
    if torch._C._functorch.maybe_current_level() is None:
        return False
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

    grad = torch._C._functorch.TransformType.Grad
    return any(i.key() == grad for i in retrieve_all_functorch_interpreters())


def is_grad_tracking(x: torch.Tensor) -> bool:
    """Is ``x`` a torch.func grad transform's wrapper (a GradTrackingTensor)?"""
    return torch._C._functorch.is_gradtrackingtensor(x)


# -- activation checkpointing (sharded/_remat.py) -------------------------------------

# NOTE [torch.utils.checkpoint while tracing]
# Under torch.func.grad (pjit's trace of a train step) torch's checkpoint fails:
# the reentrant form is an autograd.Function without setup_context, and the
# non-reentrant form uses saved-tensor hooks, which functorch does not support. Under
# the joint trace it would run, and its recomputation would be traced as plain
# forward ops: saves inlined, not recomputation. So while pjit traces, the function
# ``torch.utils.checkpoint.checkpoint`` calls is swapped for sharded's remat region
# (``redirect``). Hugging Face binds ``functools.partial(checkpoint, ...)`` at
# ``gradient_checkpointing_enable()``, so the name cannot be patched; the swap is of
# the callee of torch's ``_disable_dynamo`` wrapper around checkpoint, which calls
# ``fn.__dynamo_disable`` (the wrapped function's cached attribute) when it is set.

@contextlib.contextmanager
def torch_checkpoint_as(redirect):
    """While inside: ``torch.utils.checkpoint.checkpoint(function, *args, **kw)`` (and
    checkpoint_sequential, which calls it) calls ``redirect(function, *args, **kw)``."""
    import torch.utils.checkpoint as tuc

    inner = getattr(tuc.checkpoint, "__wrapped__", None)
    if inner is None or "fn" not in getattr(tuc.checkpoint.__code__, "co_freevars", ()):
        raise RuntimeError("sharded: torch.utils.checkpoint.checkpoint is not the "
                           "_disable_dynamo wrapper this torch version was expected to have "
                           "(NOTE [torch.utils.checkpoint while tracing] in sharded/_torch.py).")
    key = "__dynamo_disable"
    had = key in vars(inner)
    before = vars(inner).get(key)
    setattr(inner, key, redirect)
    try:
        yield
    finally:
        if had:
            setattr(inner, key, before)
        else:
            delattr(inner, key)


def torch_checkpoint_itself():
    """``torch.utils.checkpoint.checkpoint``'s own function, under its _disable_dynamo
    wrapper (what ``torch_checkpoint_as`` redirects)."""
    import torch.utils.checkpoint as tuc

    return tuc.checkpoint.__wrapped__


def is_noop_checkpoint_context(context_fn) -> bool:
    """Is ``context_fn`` torch.utils.checkpoint's default (no selective policy)?"""
    import torch.utils.checkpoint as tuc

    return context_fn is tuc.noop_context_fn


# ---------------------------------------------------------------------------
# DTensor's op strategies, for the AUTO layout solver (sharded/auto/)
# ---------------------------------------------------------------------------

class Candidates:
    """A tensor argument of an op as the layout solver sees it: its fake value and the
    placements it may arrive in (one per mesh axis each)."""

    __slots__ = ("val", "placements")

    def __init__(self, val, placements):
        self.val = val
        self.placements = list(placements)


def _tensor_meta(val):
    from torch.distributed.tensor._dtensor_spec import TensorMeta

    return TensorMeta(val.shape, val.stride(), val.dtype)


def _spec_placements(spec):
    """Placements of a DTensorSpec, or None (a non-tensor output)."""
    return tuple(spec.placements) if spec is not None else None


def op_strategies(op, args, kwargs, device_mesh) -> list | None:
    """Every strategy DTensor's own rules allow for ``op`` when its tensor arguments
    (``Candidates``, alone or in lists) may arrive in any of their placements: a list,
    per list element for a foreach/fused op (one entry otherwise), of strategies
    ``(output placements per output, input placements per tensor argument in flatten
    order)``. None where the op has no strategy function (DTensor decomposes it or
    propagates it by a rule): the solver probes it (``probe_op``).

    An op with single-mesh-dim rules (most ops in torch 2.13) gets every combination
    of its rules over the mesh axes, each ``_ShardingPlaceholder(d)`` a ``Shard(d)``
    (DTensor's own expansion keeps only the shard kinds its inputs already have and
    takes one layout per input); an op with a whole-mesh strategy function gets it
    with each input's candidate placements."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.distributed.tensor._op_schema import OpSchema, OpSpec, OpStrategy
    from torch.distributed.tensor._ops.single_dim_strategy import (
        _ShardingPlaceholder, _resolve_foreach_elementwise_overload)
    from torch.distributed.tensor.placement_types import Replicate

    prop = DTensor._op_dispatcher.sharding_propagator
    single = prop.op_single_dim_strategy_funcs.get(op)
    fn = prop.op_strategy_funcs.get(op)
    if single is None and fn is None:
        return None

    def is_list(a):
        return isinstance(a, (list, tuple)) and a and all(isinstance(x, Candidates) for x in a)

    def meta_of(a):
        if isinstance(a, Candidates):
            return _tensor_meta(a.val)
        if is_list(a):
            return [_tensor_meta(x.val) for x in a]
        return a

    if single is not None:
        n_axes = device_mesh.ndim
        lists = [a for a in list(args) + list(kwargs.values()) if is_list(a)]
        foreach = bool(lists) and op.name().startswith(("aten::_foreach_", "aten::_amp_foreach_",
                                                        "aten::_fused_"))
        elems = range(len(lists[0])) if foreach else [None]
        out = []
        for i in elems:
            if i is None:
                e_op, e_args, e_kwargs = op, args, kwargs
            else:
                e_op = _resolve_foreach_elementwise_overload(op) or op
                e_args = [a[i] if is_list(a) else a for a in args]
                e_kwargs = {k: (v[i] if is_list(v) else v) for k, v in kwargs.items()}
            rules = single.func(e_op, tuple(meta_of(a) for a in e_args),
                                {k: meta_of(v) for k, v in e_kwargs.items()})
            n_in = sum(1 if isinstance(a, Candidates) else len(a) if is_list(a) else 0
                       for a in list(e_args) + list(e_kwargs.values()))
            rules = [[Shard(p.dim) if isinstance(p, _ShardingPlaceholder) else p for p in r]
                     for r in rules]
            width = len(rules[0]) if rules else None
            if width is None:
                out.append([])
                continue
            n_out = width - n_in
            if not any(all(p is None or isinstance(p, Replicate) for p in r) for r in rules):
                rules.insert(0, [Replicate()] * width)
            found = []
            for combo in itertools.product(rules, repeat=n_axes):
                outs = tuple(None if any(r[k] is None for r in combo) else tuple(r[k] for r in combo)
                             for k in range(n_out))
                ins = tuple(None if any(r[k] is None for r in combo) else tuple(r[k] for r in combo)
                            for k in range(n_out, width))
                found.append((outs, ins))
            out.append(found)
        return out

    # a whole-mesh strategy function expects each input as DTensor passes it at run time
    # (one layout each; some index the inputs' strategy lists in step): call it per
    # combination of the inputs' candidate layouts (each input's own list while their
    # product is small, else per layout of the input with the most, the others in
    # their first), and collect what it allows
    tensors = [a for a in list(args) + list(kwargs.values()) if isinstance(a, Candidates)]
    if not tensors:
        return None
    total = 1
    for t in tensors:
        total *= len(t.placements)
    if total <= 48:
        combos = list(itertools.product(*[t.placements for t in tensors]))
    else:
        main = max(range(len(tensors)), key=lambda k: len(tensors[k].placements))
        combos = [tuple(pl if k == main else t.placements[0] for k, t in enumerate(tensors))
                  for pl in tensors[main].placements]
    info = prop.op_to_schema_info.get(op)
    found: list = []
    for combo in combos:
        pick = dict(zip(map(id, tensors), combo))

        def wrap(a):
            if isinstance(a, Candidates):
                spec = DTensorSpec(device_mesh, tuple(pick[id(a)]), tensor_meta=_tensor_meta(a.val))
                return OpStrategy([OpSpec(spec)])
            return a

        schema = OpSchema(op, tuple(wrap(a) for a in args), {k: wrap(v) for k, v in kwargs.items()},
                          schema_info=info)
        try:
            strategy = fn(schema)
        except Exception:       # noqa: BLE001 (no strategy for this combination)
            continue
        if not isinstance(strategy, OpStrategy):
            return None
        for st in strategy.strategies:
            outs = st.output_specs
            outs = (tuple(_spec_placements(o) for o in outs) if isinstance(outs, tuple)
                    else (_spec_placements(outs),))
            ins = tuple(_spec_placements(i) for i in (st.input_specs or ()))
            if not ins:         # (no input specs: every input in the output's layout)
                ins = tuple(outs[0] for _ in tensors)
            if (outs, ins) not in found:
                found.append((outs, ins))
    return [found]


def _rebuilt(a, device_mesh):
    """A Candidates argument as the DTensorSpec of its first placement (for the output's
    tensor meta, which does not depend on the placements)."""
    if isinstance(a, Candidates):
        return build_dtensor_spec(device_mesh, a.placements[0], a.val.shape, a.val.stride(),
                                  a.val.dtype)
    if isinstance(a, (list, tuple)) and a and all(isinstance(x, Candidates) for x in a):
        return [_rebuilt(x, device_mesh) for x in a]
    return a


def probe_op(op, args, kwargs, device_mesh):
    """DTensor's own plan for ``op`` with its tensor arguments (``Candidates`` with one
    placement each) in those placements: ``(output placements per output, the
    placements it moves each tensor argument to, in flatten order)``; None where
    DTensor cannot plan it."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.distributed.tensor._op_schema import OpSchema
    from torch.utils import _pytree

    prop = DTensor._op_dispatcher.sharding_propagator
    args_s = tuple(_rebuilt(a, device_mesh) for a in args)
    kwargs_s = {k: _rebuilt(v, device_mesh) for k, v in kwargs.items()}
    schema = OpSchema(op, args_s, kwargs_s, schema_info=prop.op_to_schema_info.get(op))
    try:
        sharding = prop.propagate_op_sharding(schema)
    except Exception:       # noqa: BLE001 (any failure: the op cannot be planned here)
        return None
    outs = sharding.output_spec
    outs = (tuple(o.placements if isinstance(o, DTensorSpec) else None for o in outs)
            if isinstance(outs, (tuple, list)) else
            (tuple(outs.placements) if isinstance(outs, DTensorSpec) else None,))
    have = [x for x in _pytree.tree_leaves((args_s, kwargs_s)) if isinstance(x, DTensorSpec)]
    wanted = have
    if sharding.needs_redistribute and sharding.redistribute_schema is not None:
        r = sharding.redistribute_schema
        wanted = [x for x in _pytree.tree_leaves((r.args_schema, r.kwargs_schema))
                  if isinstance(x, DTensorSpec)]
        if len(wanted) != len(have):
            return None
    return outs, tuple(tuple(w.placements) for w in wanted)



# NOTE [Recording the local program]
# The expansion runs the global graph on DTensors over fake local shards; what it
# needs back is the aten ops DTensor runs on those shards, in order, as a graph.
# make_fx records them, at about twice the cost of running them (GPT-2-small on a
# 16x4 mesh: 1.6 s against 0.5 s), on machinery the expansion does not use (proxy
# objects per tensor, a snapshot of every value, a torch-function mode, symbolic
# shapes). ``record_fake`` records them with a dispatch mode of its own, as make_fx
# would:
# - it stands above the fake mode, so it sees each aten op with fake tensors, runs it
#   (the fake mode computes its output's metadata), and adds one node, named as
#   make_fx names it, whose ``meta["val"]`` is that output (each element of a tuple
#   through a ``getitem``);
# - a functional collective (all_reduce, all_gather_into_tensor, reduce_scatter_tensor,
#   all_to_all_single, wait_tensor) on a fake tensor runs its registered meta kernel
#   directly, on the fake tensors: the fake mode caches only aten's ops, and its
#   uncached path for these (meta copies of the inputs, the kernel, fake copies of
#   the outputs) cost about a sixth of DataParallelMode("shard")'s expansion of the
#   GPT-2-small step (372 collectives and as many waits); the kernels make their
#   outputs with ``empty_like``/``new_empty``, which the fake mode runs and caches.
#   Not on a fake tensor that holds a constant (``axis_index``'s): the fake mode
#   computes the collective of its value, where ``empty_like`` would give the
#   result a constant of uninitialised memory;
# - a tensor subclass (DTensor, an AsyncCollectiveTensor) is left to its own
#   ``__torch_dispatch__``, which calls the aten ops on its local tensors: those are
#   recorded;
# - a tensor no recorded op made and no input is a constant: a real tensor (or the
#   real value a fake one holds) read through ``get_attr``; ``lift_fresh`` (how
#   ``torch.tensor`` enters) is recorded as ``lift_fresh_copy``, so no op writes into
#   the constant (an all-reduce reinplaced into ``axis_index``'s constant made each
#   call's result differ: a silent wrong result, found in review);
# - an op that returns one of its inputs (an in-place op, ``wait_tensor``) makes
#   later readers read the new node; an op that writes its inputs first leaves each
#   earlier value a copy (``unsqueeze_`` would change the shape an earlier node's
#   value shows);
# - an op with a CompositeImplicitAutograd kernel and none for the tensors' device
#   (reached below autograd) runs as its decomposition, recorded op by op;
# - inside ``disable_proxy_modes_tracing()`` (looked up when called, as DTensor
#   does) the recording thread records nothing: DTensor runs each op once on
#   global-shaped fake tensors there to learn its output's shape (dead code in the
#   local program, global-sized buffers if it ran).
# Tensors are known by identity, held weakly (a dead tensor's entry goes with it, so
# no identity is reused). A factory's value is a copy: torch's binding of a factory
# (``torch.zeros``) returns a ``detach`` of the new tensor when something else holds
# it. A tensor that is neither made, nor an input, nor a constant (a fake tensor with
# no known value, which make_fx would bake into the program as a constant without a
# value) raises ``UntrackedTensor``. The programs are make_fx's node for node after
# the passes (tests/test_expand.py; the benchmark's GPT-2-small step on a 16x4 mesh
# in both modes); the expansion of that step takes 0.75 s instead of 1.6 s.
class UntrackedTensor(RuntimeError):
    pass


@functools.cache
def _collective_fake_kernels() -> dict:
    """The functional collectives' meta kernels, by op: run on fake tensors (NOTE
    [Recording the local program]), they give what the fake mode gives for the op
    (all_reduce's, and a wait's of a contiguous value, as ``torch.empty`` of its shape:
    what their ``empty_like`` gives)."""
    from torch.distributed import _functional_collectives as fc

    ops = torch.ops._c10d_functional

    def fresh(x: torch.Tensor, *_) -> torch.Tensor:
        # (``torch.empty_like`` of a contiguous value, without the reference
        # implementation's memory-format logic: most of a wait's cost while recording)
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)

    def wait(x: torch.Tensor, *rest) -> torch.Tensor:
        return fresh(x) if x.is_contiguous() else fc._wait_tensor_meta(x, *rest)

    return {ops.all_reduce.default: fresh,         # (fc._all_reduce_meta: contiguous)
            ops.wait_tensor.default: wait,
            ops.all_gather_into_tensor.default: fc._all_gather_into_tensor_native_meta,
            ops.reduce_scatter_tensor.default: fc._reduce_scatter_tensor_native_meta,
            ops.all_to_all_single.default: fc._all_to_all_single_meta}


# NOTE [Fake results by their meta kernel]
# An aten view op (``view``, ``t``, ``permute``: a third of the ops the expansion records)
# and a functional collective or its wait (a fresh tensor of a shape its meta
# function computes) cost the fake mode a cache key of every argument's metadata, a
# lookup, and a meta tensor rebuilt from the entry. Their result is what their meta
# kernel gives, run on the fake input as on a meta tensor (the fake mode's
# ``in_kernel_invocation_manager``, as torch's ``fast_detach`` runs ``detach``): a
# view on the input's storage, a collective's result a tensor of its own, each a
# fake tensor on the input's device. The expansion's recorder and the bucketing
# pass's packing make theirs so, where the one tensor argument is the first, a fake
# of the recording's mode without a constant (the fake mode propagates constants) or
# a gradient; anything else (another library's view op, whose fake kernel may not be
# a meta kernel) goes through the fake mode. Shapes, strides, storage
# offsets and storage sharing are the fake mode's (tests/test_expand.py). On the
# GPT-2-small step on a 16x4 mesh under DataParallelMode("shard"), about 0.15 s of the
# partition and 0.1 s of the passes (benchmarks/results/compile_abstract.json).
def _meta_kernel_answers(fake_mode, args, kwargs) -> bool:
    """Is a call on ``args`` one that ``_by_meta_kernel`` answers: its one tensor the
    first argument, a fake tensor of ``fake_mode`` with no constant, no gradient?"""
    x = args[0] if args else None
    return (type(x) is FakeTensor and x.fake_mode is fake_mode and x.constant is None
            and not x.requires_grad and not kwargs
            and not any(isinstance(a, (torch.Tensor, list, tuple)) and _has_tensor(a) for a in args[1:]))


def _has_tensor(a) -> bool:
    if isinstance(a, torch.Tensor):
        return True
    return isinstance(a, (list, tuple)) and any(_has_tensor(b) for b in a)


def _by_meta_kernel(fake_mode, func, args):
    """``func(*args)`` on a fake tensor by its meta kernel, the result made a fake
    tensor on the input's device (NOTE [Fake results by their meta kernel])."""
    from torch._dispatch.python import no_python_dispatcher
    from torch._subclasses.fake_tensor import in_kernel_invocation_manager

    device = args[0].fake_device
    # (below autograd: the fake mode's own results are no autograd views inside either)
    with no_python_dispatcher(), in_kernel_invocation_manager(fake_mode), \
            torch._C._AutoDispatchBelowADInplaceOrView():
        out = func(*args)
    if isinstance(out, torch.Tensor):
        return FakeTensor(fake_mode, out, device)
    return type(out)(FakeTensor(fake_mode, o, device) for o in out)


def fake_reshape(x: torch.Tensor, shape) -> torch.Tensor:
    """``x.reshape(shape)``; for a contiguous fake tensor, its view by its meta kernel
    (NOTE [Fake results by their meta kernel])."""
    if type(x) is FakeTensor and x.is_contiguous() and _meta_kernel_answers(x.fake_mode, (x,), {}):
        return _by_meta_kernel(x.fake_mode, torch.ops.aten.view.default, (x, list(shape)))
    return x.reshape(shape)


def fake_as_strided(x: torch.Tensor, shape, stride, offset: int) -> torch.Tensor:
    """``x.as_strided(shape, stride, offset)`` outside any dispatch mode; for a fake
    tensor, by its meta kernel (NOTE [Fake results by their meta kernel])."""
    if type(x) is FakeTensor and _meta_kernel_answers(x.fake_mode, (x,), {}):
        return _by_meta_kernel(x.fake_mode, torch.ops.aten.as_strided.default,
                               (x, list(shape), list(stride), offset))
    with suspend_dispatch_modes():
        return x.as_strided(shape, stride, offset)


def fake_empty(like: torch.Tensor, shape) -> torch.Tensor:
    """``like.new_empty(shape)``; for a fake tensor, made as the fake mode makes one,
    without dispatching to it (NOTE [Fake results by their meta kernel])."""
    if type(like) is not FakeTensor:
        return like.new_empty(shape)
    return _by_meta_kernel(like.fake_mode, torch.Tensor.new_empty, (like, tuple(shape)))


def record_fake(fn, inputs: list, fake_mode) -> torch.fx.GraphModule:
    """``fn(*inputs)`` (fake tensors of ``fake_mode``; ``fn`` returns a list of
    tensors) recorded as a graph of aten ops (NOTE [Recording the local program])."""
    import operator
    import threading

    from torch._subclasses.fake_impls import fast_detach
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.fx.experimental import proxy_tensor
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.weak import WeakTensorKeyDictionary

    graph = torch.fx.Graph()
    constants: dict = {}
    node_of = WeakTensorKeyDictionary()
    ops: dict = {}      # op -> (its node name, a factory?, writes its inputs?)

    def track(t, node) -> None:
        node_of[t] = node

    def constant(t) -> torch.fx.Node:
        value = t.constant if isinstance(t, FakeTensor) else t
        if value is None:
            raise UntrackedTensor(f"a fake tensor {tuple(t.shape)} that no recorded op made")
        name = f"_tensor_constant{len(constants)}"
        constants[name] = value
        node = graph.get_attr(name)
        node.meta["val"] = t if isinstance(t, FakeTensor) else fake_mode.from_tensor(t)
        track(t, node)
        return node

    def arg(a):
        if isinstance(a, torch.Tensor):
            node = node_of.get(a)
            return node if node is not None else constant(a)
        if type(a) in (list, tuple):
            return type(a)(arg(x) for x in a)
        if isinstance(a, dict):
            return {k: arg(v) for k, v in a.items()}
        return a

    def about(func) -> tuple:
        found = ops.get(func)
        if found is None:
            schema = func._schema
            found = ops[func] = (graph._target_to_str(func.overloadpacket.__name__),
                                 any(a.name == "pin_memory" for a in schema.arguments),
                                 schema.is_mutable)
        return found

    decomposed: dict = {}       # (op, device type) -> whether make_fx would decompose it
    kept = (torch.ops.aten.size.default, torch.ops.aten.stride.default,
            torch.ops.aten.storage_offset.default)

    def decomposes(func, args, kwargs) -> bool:
        first = next((a for a in itertools.chain(args, kwargs.values())
                      if isinstance(a, torch.Tensor)), None)
        flat = None
        if first is None:       # (tensors in a list: a foreach op's)
            flat = torch.utils._pytree.tree_leaves((args, kwargs))
            first = next((a for a in flat if isinstance(a, torch.Tensor)), None)
        key = (func, first.device.type if first is not None else None)
        found = decomposed.get(key)
        if found is None:
            flat = flat if flat is not None else torch.utils._pytree.tree_leaves((args, kwargs))
            implicit = torch._C.DispatchKey.CompositeImplicitAutograd
            found = decomposed[key] = func not in kept and (
                implicit in func.py_kernels
                or torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), implicit)) \
                and proxy_tensor.autograd_would_have_decomposed(func, flat)
        return found

    fake_kernels = _collective_fake_kernels()
    recording_thread = threading.get_ident()
    paused = [0]
    disable_tracing = proxy_tensor.disable_proxy_modes_tracing

    @contextlib.contextmanager
    def pause():
        mine = threading.get_ident() == recording_thread
        paused[0] += mine
        try:
            with disable_tracing() as mode:
                yield mode
        finally:
            paused[0] -= mine

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if any(t is not FakeTensor and t is not torch.Tensor for t in types):
                return NotImplemented
            if func is torch.ops.prim.device.default:   # (a query; not recorded)
                # answered as the fake mode answers it, without its dispatch: DTensor
                # asks it of a local tensor several times per op (3103 times in the
                # GPT-2-small step's expansion under DataParallelMode("shard"))
                if type(args[0]) is FakeTensor and not args[0].fake_mode.in_kernel_invocation:
                    return args[0].fake_device
                return func(*args, **kwargs)
            if paused[0]:
                return func(*args, **kwargs)
            if decomposes(func, args, kwargs):
                with self:
                    out = func.decompose(*args, **kwargs)
                if out is not NotImplemented:
                    return out
            if func is torch.ops.aten.lift_fresh.default:
                func = torch.ops.aten.lift_fresh_copy.default
            name, factory, writes = about(func)
            if writes:      # the values earlier nodes show stay as they were
                for a in torch.utils._pytree.tree_leaves((args, kwargs)):
                    node = node_of.get(a) if isinstance(a, FakeTensor) else None
                    if node is not None and node.meta.get("val") is a:
                        node.meta["val"] = fast_detach(fake_mode, a)
            fake_kernel = fake_kernels.get(func)
            if fake_kernel is not None and _meta_kernel_answers(fake_mode, args, kwargs):
                out = _by_meta_kernel(fake_mode, fake_kernel, args)     # (as the fake mode would, faster)
            elif func.is_view and func.namespace == "aten" and _meta_kernel_answers(fake_mode, args, kwargs):
                out = _by_meta_kernel(fake_mode, func, args)
            else:
                out = func(*args, **kwargs)
            node = graph.call_function(func, arg(args), arg(kwargs), name=name)
            if factory and isinstance(out, FakeTensor):
                node.meta["val"] = fast_detach(fake_mode, out)
                track(out, node)
            else:
                outputs(out, node)
            return out

    def outputs(out, node) -> None:
        node.meta["val"] = out
        if isinstance(out, torch.Tensor):
            track(out, node)
        elif isinstance(out, (tuple, list)):        # (a foreach op's: lists in a tuple)
            for i, o in enumerate(out):
                if isinstance(o, (torch.Tensor, tuple, list)):
                    outputs(o, graph.call_function(operator.getitem, (node, i)))

    for i, x in enumerate(inputs):
        node = graph.placeholder(f"arg{i}_1")
        node.meta["val"] = x
        track(x, node)
    proxy_tensor.disable_proxy_modes_tracing = pause
    try:
        with fake_mode, Recorder():
            result = fn(*inputs)
    finally:
        proxy_tensor.disable_proxy_modes_tracing = disable_tracing
    graph.output([arg(r) for r in result])
    return lazy_graph_module(constants, graph)     # NOTE [Code generated once]
