"""Collectives over named mesh axes, for shard_map bodies, with the gradients of the
single-device program.

Every collective takes one mesh axis name or a tuple of names (JAX's semantics: a
tuple acts as one axis of the product size, the first name major). Each is one
primitive with its rules beside it (JAX's ``lax/parallel.py`` layout):

- a ``sharded::`` custom op: what a traced body records (axis names, no ranks);
- an autograd.Function whose backward is JAX's transpose rule, so it works under
  torch.func.grad/vjp (and, with its op's vmap rule, under torch.func.vmap);
- its varying-axes rule (NOTE [Varying manual axes] in sharded/_manual.py);
- its lowering: what one rank runs (torch's functional collectives, or
  ``sharded::collective_permute`` for point-to-point sends), used by the
  partitioner and, eagerly, by the op itself.

==============  ==========================================  ==========================
collective      result                                       transpose (backward)
==============  ==========================================  ==========================
psum            sum over the axes; invariant over them       pvary
pmean           psum / axis size                             pvary / axis size
pmax, pmin      max/min over the axes; invariant             cotangent where x won
all_gather      blocks of every rank, concatenated; invar.   this rank's block
psum_scatter    sum, then this rank's block; varying         all_gather, pvary'd
ppermute        the block of the rank that sends to us       ppermute with the inverse
all_to_all      split a dim, exchange, concatenate another   all_to_all with dims swapped
axis_index      this rank's coordinate on the axes           (integer, no gradient)
pvary           x, marked varying over the axes              psum
==============  ==========================================  ==========================

A value that is invariant over an axis (e.g. a replicated input) is ``pvary``'d
before a collective over that axis, as in JAX: ``psum`` of it over an axis of size n
is ``n * x``, its ``all_gather`` is n copies, and each one's gradient is the sum of
the cotangents of the copies. ``pmax``/``pmin`` over an axis the value does not vary
over return it unchanged.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from sharded import _manual, _registry, _torch
from sharded._manual import set_vma, varying_to, vma_of
from sharded.mesh import mesh_device

__all__ = ["psum", "pmean", "pmax", "pmin", "all_gather", "psum_scatter", "ppermute",
           "all_to_all", "axis_index", "axis_size", "pvary", "varying_axes"]

_F = _torch.c10d_functional


# -- axes ---------------------------------------------------------------------------------

def _axes(api: str, axis) -> tuple[str, ...]:
    """``axis`` (a name or a tuple of names) as a tuple, checked against the mesh."""
    ctx = _manual.current(api)
    if isinstance(axis, str):
        axes = (axis,)
    elif isinstance(axis, (tuple, list)) and all(isinstance(a, str) for a in axis):
        axes = tuple(axis)
    else:
        raise TypeError(f"{api}: axis must be a mesh axis name or a tuple of names; got {axis!r}.")
    for a in axes:
        if a not in ctx.mesh.axis_names:
            raise ValueError(
                f"{api}: mesh axis {a!r} is not in the shard_map mesh; its axes are "
                f"{ctx.mesh.axis_names}."
            )
    if len(set(axes)) != len(axes):
        raise ValueError(f"{api}: axes {axes} name a mesh axis twice.")
    return axes


def _key(axes) -> str:
    return ",".join(axes)


def _unkey(key: str) -> tuple[str, ...]:
    return tuple(a for a in key.split(",") if a)


def _size(mesh, axes) -> int:
    return math.prod(mesh.size(a) for a in axes)


def _combined_index(mesh, axes, coord=None) -> int:
    """This rank's index along ``axes`` taken together (the first axis major)."""
    coord = mesh.coordinate() if coord is None else coord
    i = 0
    for a in axes:
        k = mesh.axis_names.index(a)
        i = i * mesh.shape[k] + coord[k]
    return i


def _group(mesh, axis: str) -> str:
    return mesh.device_mesh.get_group(axis).group_name


def _constant(values, dtype, device) -> Tensor:
    """A tensor constant of the local program. Rank-dependent values enter a graph only
    as constants (each its own ``_tensor_constant``), so CSE never merges two different
    ones on some ranks only."""
    return torch.tensor(values, dtype=dtype, device=device)


# -- primitives: definition helpers ---------------------------------------------------------

def _eager(op_name: str, lower, *args):
    """A primitive called outside a traced body: run its lowering now."""
    ctx = _manual.current(op_name)
    with _manual.untracked():
        out = lower(ctx.mesh, *args)
        x = args[0] if args and isinstance(args[0], Tensor) else None
        if x is not None and out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
            out = out.clone()        # a custom op's output never aliases its input
    return out


def _elementwise_vmap(op):
    def rule(info, in_dims, x, *rest):
        return op(x, *rest), in_dims[0]

    return rule


def _dims_vmap(op, n_dims: int):
    """vmap rule for an op ``op(x, axes, *dims, *rest)``: the batch dim goes first and
    the op's dims shift by one."""
    def rule(info, in_dims, x, axes, *rest):
        bdim = in_dims[0]
        if bdim is None:
            return op(x, axes, *rest), None
        x = x.movedim(bdim, 0)
        dims = [d + 1 for d in rest[:n_dims]]
        return op(x, axes, *dims, *rest[n_dims:]), 0

    return rule


def _register(op, lower, vma_rule, vmap_rule=None):
    """The primitive's lowering, varying-axes rule and vmap rule, in the registry
    (NOTE [One registry of primitives] in sharded/_registry.py); its autograd form is
    registered once its autograd.Function is defined."""
    _registry.define(op, lower=lower, vma=vma_rule, vmap=vmap_rule)


def _linear(name: str, op, transpose):
    """The autograd.Function of a linear primitive (JAX's ``deflinear2``): the forward
    is ``op(x, *params)``; the backward is ``transpose(ct, *params)``. Usable under
    torch.func.grad/vjp (setup_context) and vmap (the op's vmap rule)."""
    def forward(x, *params):
        return op(x, *params)

    def setup_context(ctx, inputs, output):
        ctx.params = inputs[1:]

    def backward(ctx, ct):
        return (transpose(ct, *ctx.params), *([None] * len(ctx.params)))

    return type(name, (torch.autograd.Function,), {
        "generate_vmap_rule": True, "forward": staticmethod(forward),
        "setup_context": staticmethod(setup_context), "backward": staticmethod(backward),
    })


def _with(args, kwargs):
    return vma_of(args[0]) | set(_unkey(args[1]))


def _without(args, kwargs):
    return vma_of(args[0]) - set(_unkey(args[1]))


# -- pvary and its inverse cast -----------------------------------------------------------------

@torch.library.custom_op("sharded::pvary", mutates_args=())
def _pvary_op(x: Tensor, axes: str) -> Tensor:
    return x.clone()


@torch.library.custom_op("sharded::unvary", mutates_args=())
def _unvary_op(x: Tensor, axes: str) -> Tensor:
    return x.clone()


for _op in (_pvary_op, _unvary_op):
    _op.register_fake(lambda x, axes: torch.empty_like(x))

PVARY = torch.ops.sharded.pvary.default
UNVARY = torch.ops.sharded.unvary.default
_register(PVARY, lambda mesh, x, axes: x, _with, _elementwise_vmap(PVARY))
_register(UNVARY, lambda mesh, x, axes: x, _without, _elementwise_vmap(UNVARY))


class _PVary(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x, axes):
        ctx = _manual.active()
        if ctx is not None and ctx.eager:    # nothing to record: a view, re-tagged
            out = x.view_as(x)
            set_vma(out, vma_of(x) | set(_unkey(axes)))
            return out
        return PVARY(x, axes)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.axes = inputs[1]

    @staticmethod
    def backward(ctx, ct):
        return _PSum.apply(ct, ctx.axes), None


# check_vma=False outputs: the user vouches that x is the same on every rank along the
# axes. Identity; the transpose is that of a mean of equal values: pvary(ct) / size.
_Unvary = _linear("_Unvary", lambda x, axes, n: UNVARY(x, axes),
                  lambda ct, axes, n: _PVary.apply(ct, axes) / n)


class _PVaryInPlace(torch.autograd.Function):
    """pvary of a tensor an in-place op is about to make vary (see
    _manual._pvary_in_place): marks it varying in place; the transpose is psum. (A
    copy into it would send autograd's zero cotangent for the old value, typed like
    the varying new one, into an invariant gradient.)"""

    @staticmethod
    def forward(x, axes):
        set_vma(x, vma_of(x) | set(_unkey(axes)))
        return x

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.axes = inputs[1]
        ctx.mark_dirty(inputs[0])

    @staticmethod
    def backward(ctx, ct):
        return _PSum.apply(ct, ctx.axes), None


def pvary_(x: Tensor, axes) -> Tensor:
    """In-place pvary (internal: before an in-place op with a more varying operand)."""
    return _PVaryInPlace.apply(x, _key(axes))


def pvary(x: Tensor, axes) -> Tensor:
    """Mark ``x`` as varying over ``axes`` (a name or a tuple of names): an identity
    whose transpose is psum. Axes ``x`` already varies over are left as they are."""
    names = _axes("pvary", axes)
    missing = tuple(a for a in names if a not in vma_of(x))
    if not missing:
        return x
    return _PVary.apply(x, _key(missing))


def unvary(x: Tensor, axes) -> Tensor:
    """Internal: take ``x`` as the same on every rank along ``axes`` (see _Unvary)."""
    names = _axes("shard_map", axes)
    return _Unvary.apply(x, _key(names), _size(_manual.current("shard_map").mesh, names))


# -- psum, pmax, pmin -------------------------------------------------------------------------

def _all_reduce(mesh, x, op: str, axes):
    for a in axes:
        if mesh.size(a) > 1:
            x = _F.wait_tensor(_F.all_reduce(x.contiguous(), op, _group(mesh, a)))
    return x


def _reduce_op(name: str, reduce: str):
    @torch.library.custom_op(f"sharded::{name}", mutates_args=())
    def op(x: Tensor, axes: str) -> Tensor:
        return _eager(name, lambda mesh, x, axes: _all_reduce(mesh, x, reduce, _unkey(axes)), x, axes)

    op.register_fake(lambda x, axes: torch.empty_like(x))
    overload = getattr(torch.ops.sharded, name).default
    _register(overload, lambda mesh, x, axes: _all_reduce(mesh, x, reduce, _unkey(axes)),
              _without, _elementwise_vmap(overload))
    return overload


PSUM = _reduce_op("psum", "sum")
PMAX = _reduce_op("pmax", "max")
PMIN = _reduce_op("pmin", "min")


_PSum = _linear("_PSum", PSUM, lambda ct, axes: _PVary.apply(ct, axes))


class _PExtreme(torch.autograd.Function):
    """pmax/pmin. The gradient goes where ``x`` is the extreme, split evenly among
    the ranks that tie (as torch.amax/amin split it among tied elements)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, axes, op):
        return op(x, axes)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.axes = inputs[1]
        ctx.save_for_backward(inputs[0], output)

    @staticmethod
    def backward(ctx, ct):
        x, y = ctx.saved_tensors
        won = (x == y).to(ct.dtype)
        return ct * won / _PSum.apply(won, ctx.axes), None, None


def psum(x: Tensor, axis: str | Sequence[str]) -> Tensor:
    """Sum of ``x`` over the mesh axis (or axes); the result is invariant over them."""
    axes = _axes("psum", axis)
    if not axes:
        return x
    return _PSum.apply(varying_to(x, frozenset(axes)), _key(axes))


def pmean(x: Tensor, axis: str | Sequence[str]) -> Tensor:
    """Mean of ``x`` over the mesh axis (or axes)."""
    axes = _axes("pmean", axis)
    return psum(x, axes) / _size(_manual.current("pmean").mesh, axes)


def _extreme(api, x, axis, op):
    axes = [a for a in _axes(api, axis) if a in vma_of(x)]
    if not axes:                 # the same on every rank: the max is x itself
        return x
    return _PExtreme.apply(x, _key(axes), op)


def pmax(x: Tensor, axis: str | Sequence[str]) -> Tensor:
    """Elementwise max over the axis (or axes); the gradient goes where x is the max."""
    return _extreme("pmax", x, axis, PMAX)


def pmin(x: Tensor, axis: str | Sequence[str]) -> Tensor:
    """Elementwise min over the axis (or axes); the gradient goes where x is the min."""
    return _extreme("pmin", x, axis, PMIN)


# -- all_gather, its transpose (this rank's block), psum_scatter ---------------------------------

def _gather_tiled(mesh, x, axis, dim):
    k = mesh.size(axis)
    if k == 1:
        return x
    g = _F.wait_tensor(_F.all_gather_into_tensor(x.movedim(dim, 0).contiguous(), k, _group(mesh, axis)))
    return g.movedim(0, dim)


def _scatter_tiled(mesh, x, axis, dim):
    k = mesh.size(axis)
    if k == 1:
        return x
    y = _F.wait_tensor(_F.reduce_scatter_tensor(x.movedim(dim, 0).contiguous(), "sum", k,
                                                _group(mesh, axis)))
    return y.movedim(0, dim)


def _lower_all_gather(mesh, x, axes, dim, tiled, n):
    y = x if tiled else x.unsqueeze(dim)
    for a in reversed(_unkey(axes)):      # minor axis first: the first axis ends up major
        y = _gather_tiled(mesh, y, a, dim)
    return y


def _lower_block(mesh, x, axes, dim, tiled, n):
    names = _unkey(axes)
    size = x.shape[dim] // n
    start = _combined_index(mesh, names) * size
    y = x.index_select(dim, _constant(list(range(start, start + size)), torch.int64, x.device))
    return y if tiled else y.squeeze(dim)


def _lower_psum_scatter(mesh, x, axes, dim, tiled, n):
    y = x
    for a in _unkey(axes):                # major axis first
        y = _scatter_tiled(mesh, y, a, dim)
    return y if tiled else y.squeeze(dim)


def _gathered_shape(x, axes, dim, tiled, n):
    shape = list(x.shape)
    if tiled:
        shape[dim] *= n
    else:
        shape.insert(dim, n)
    return x.new_empty(shape)


def _block_shape(x, axes, dim, tiled, n):
    shape = list(x.shape)
    if tiled:
        shape[dim] //= n
    else:
        del shape[dim]
    return x.new_empty(shape)


@torch.library.custom_op("sharded::all_gather", mutates_args=())
def _all_gather_op(x: Tensor, axes: str, dim: int, tiled: bool, n: int) -> Tensor:
    return _eager("all_gather", _lower_all_gather, x, axes, dim, tiled, n)


@torch.library.custom_op("sharded::axis_block", mutates_args=())
def _block_op(x: Tensor, axes: str, dim: int, tiled: bool, n: int) -> Tensor:
    return _eager("all_gather", _lower_block, x, axes, dim, tiled, n)


@torch.library.custom_op("sharded::psum_scatter", mutates_args=())
def _psum_scatter_op(x: Tensor, axes: str, dim: int, tiled: bool, n: int) -> Tensor:
    return _eager("psum_scatter", _lower_psum_scatter, x, axes, dim, tiled, n)


_all_gather_op.register_fake(_gathered_shape)
_block_op.register_fake(_block_shape)
_psum_scatter_op.register_fake(_block_shape)
ALL_GATHER = torch.ops.sharded.all_gather.default
AXIS_BLOCK = torch.ops.sharded.axis_block.default
PSUM_SCATTER = torch.ops.sharded.psum_scatter.default
_register(ALL_GATHER, _lower_all_gather, _without, _dims_vmap(ALL_GATHER, 1))
_register(AXIS_BLOCK, _lower_block, _with, _dims_vmap(AXIS_BLOCK, 1))
_register(PSUM_SCATTER, _lower_psum_scatter, _with, _dims_vmap(PSUM_SCATTER, 1))


_AllGather = _linear("_AllGather", ALL_GATHER, lambda ct, *params: _Block.apply(ct, *params))
# this rank's block of an invariant value (all_gather's transpose), and back
_Block: Any = _linear("_Block", AXIS_BLOCK, lambda ct, *params: _AllGather.apply(ct, *params))
# every rank's x fed every block of the sum: the gathered cotangent, varying
_PsumScatter = _linear("_PsumScatter", PSUM_SCATTER,
                       lambda ct, *params: _PVary.apply(_AllGather.apply(ct, *params), params[0]))


def all_gather(x: Tensor, axis: str | Sequence[str], *, dim: int = 0, tiled: bool = False) -> Tensor:
    """The blocks ``x`` of every rank along ``axis`` (a name or a tuple of names, the
    first major): stacked in a new dim ``dim``, or concatenated along ``dim`` when
    ``tiled``. The result is invariant over the axes (JAX's ``all_gather_invariant``)."""
    axes = _axes("all_gather", axis)
    mesh = _manual.current("all_gather").mesh
    dim = dim % (x.ndim + (0 if tiled else 1))
    if not axes:
        return x if tiled else x.unsqueeze(dim)
    return _AllGather.apply(varying_to(x, frozenset(axes)), _key(axes), dim, tiled, _size(mesh, axes))


def psum_scatter(x: Tensor, axis: str | Sequence[str], *, dim: int = 0, tiled: bool = False) -> Tensor:
    """Sum ``x`` over ``axis`` (a name or a tuple of names, the first major) and keep
    this rank's block of dim ``dim`` (which must divide by the axes' size; without
    ``tiled`` its size must equal it and the dim is removed). The result varies over
    the axes."""
    axes = _axes("psum_scatter", axis)
    mesh = _manual.current("psum_scatter").mesh
    dim = dim % x.ndim
    n = _size(mesh, axes)
    label = _axes_label(axes, n)
    _check_split("psum_scatter", f"dim {dim}", x, dim, n, label, tiled,
                 "; pass tiled=True to keep a block instead")
    if not axes:
        return x if tiled else x.squeeze(dim)
    return _PsumScatter.apply(varying_to(x, frozenset(axes)), _key(axes), dim, tiled, n)


def _check_split(api, what, x, dim, n, label, tiled, hint):
    """``x``'s dim ``dim`` splits into one block per rank (tiled) or has one entry per
    rank (untiled)."""
    if x.shape[dim] % n:
        raise ValueError(f"{api}: {what} of x (shape {tuple(x.shape)}) must divide by the "
                         f"size of {label}.")
    if not tiled and x.shape[dim] != n:
        raise ValueError(f"{api} without tiled needs {what} of x (shape {tuple(x.shape)}) "
                         f"to equal the size of {label}{hint}.")


def _axes_label(axes, n) -> str:
    if len(axes) == 1:
        return f"mesh axis {axes[0]!r} ({n})"
    return f"mesh axes {axes} ({n} together)"


# -- all_to_all -----------------------------------------------------------------------------

def _exchange(mesh, y, axis):
    """Equal all-to-all on dim 0 (of size = the axis size): ``y[j]`` goes to rank j;
    ``result[s]`` came from rank s."""
    k = mesh.size(axis)
    if k == 1:
        return y
    splits = [1] * k
    return _F.wait_tensor(_F.all_to_all_single(y.contiguous(), splits, splits, _group(mesh, axis)))


def _lower_all_to_all(mesh, x, axes, split_dim, concat_dim, tiled, n):
    names = _unkey(axes)
    sizes = [mesh.size(a) for a in names]
    blocks = x.movedim(split_dim, 0)                       # [S, ...rest]
    rest = blocks.shape[1:]
    if tiled:
        blocks = blocks.reshape(n, blocks.shape[0] // n, *rest)   # block j = rows of rank j
        inner = 1
    else:
        inner = 0
    y = blocks.reshape(*sizes, *blocks.shape[1:])          # [j1, ..., jk, ...]
    # One all-to-all per axis (the first major). After step t the leading dims are
    # [q_t, ..., q_1, j_{t+1}, ..., j_k]: sources so far, newest first.
    for t, a in enumerate(names):
        y = _exchange(mesh, y.movedim(t, 0), a)
    k = len(names)
    y = y.permute(*reversed(range(k)), *range(k, y.ndim))  # [q_1, ..., q_k, ...]
    y = y.reshape(n, *y.shape[k:])                         # sources, the first axis major
    if not tiled:                                          # [n, ...rest]: new dim at concat
        return y.movedim(0, concat_dim)
    y = y.movedim(1, split_dim + 1)                        # [n, x's dims, split shrunk]
    y = y.movedim(0, concat_dim)                           # sources just before concat dim
    shape = list(y.shape)
    shape[concat_dim:concat_dim + 2] = [shape[concat_dim] * shape[concat_dim + 1]]
    return y.reshape(shape) if inner else y


@torch.library.custom_op("sharded::all_to_all", mutates_args=())
def _all_to_all_op(x: Tensor, axes: str, split_dim: int, concat_dim: int, tiled: bool,
                   n: int) -> Tensor:
    return _eager("all_to_all", _lower_all_to_all, x, axes, split_dim, concat_dim, tiled, n)


@_all_to_all_op.register_fake
def _(x, axes, split_dim, concat_dim, tiled, n):
    shape = list(x.shape)
    if tiled:
        shape[split_dim] //= n
        shape[concat_dim] *= n
    else:
        del shape[split_dim]
        shape.insert(concat_dim, n)
    return x.new_empty(shape)


ALL_TO_ALL = torch.ops.sharded.all_to_all.default
_register(ALL_TO_ALL, _lower_all_to_all, _with, _dims_vmap(ALL_TO_ALL, 2))


_AllToAll: Any = _linear("_AllToAll", ALL_TO_ALL, lambda ct, axes, split_dim, concat_dim, tiled, n:
                    _AllToAll.apply(ct, axes, concat_dim, split_dim, tiled, n))


def all_to_all(x: Tensor, axis: str | Sequence[str], split_dim: int, concat_dim: int, *,
               tiled: bool = True) -> Tensor:
    """Split dim ``split_dim`` into one block per rank of ``axis`` (a name or a tuple
    of names, the first major), send block j to rank j, and put the blocks received
    along ``concat_dim`` in rank order. ``tiled`` (the default here): the blocks are
    concatenated, so ``split_dim`` shrinks and ``concat_dim`` grows by the axes' size;
    without it ``split_dim`` must equal that size and is removed, and a new dim of that
    size is inserted at ``concat_dim`` (JAX's ``tiled=False``). The expert-parallel
    exchange; the result varies over the axes."""
    axes = _axes("all_to_all", axis)
    mesh = _manual.current("all_to_all").mesh
    n = _size(mesh, axes)
    split_dim = split_dim % x.ndim
    concat_dim = concat_dim % (x.ndim if tiled else x.ndim)
    label = _axes_label(axes, n)
    _check_split("all_to_all", f"split dim {split_dim}", x, split_dim, n, label, tiled, "")
    if not axes:
        return x if tiled else x.squeeze(split_dim).unsqueeze(concat_dim)
    return _AllToAll.apply(varying_to(x, frozenset(axes)), _key(axes), split_dim, concat_dim,
                           tiled, n)


# -- ppermute: point-to-point -------------------------------------------------------------------
# NOTE [ppermute and CSE]
# A rank sends its block to one destination and receives from one source: one
# point-to-point exchange (``sharded::collective_permute``, batched isend/irecv), so
# the bytes moved are one block per rank and inf/NaN pass through unchanged; a rank
# that no pair sends to gets zeros. The local op's arguments are the same on every
# rank: the whole permutation as (source rank, destination rank) pairs of the whole
# mesh, not this rank's peers. Two different ppermutes therefore never look alike to
# CSE on some ranks only (which would pair different collectives across ranks), while
# a ppermute and its recomputation in a vjp (the same op on the same input) merge on
# every rank alike.

@torch.library.custom_op("sharded::collective_permute", mutates_args=())
def _collective_permute(x: Tensor, pairs: list[int], group: str) -> Tensor:
    me = dist.get_rank()
    flat = list(zip(pairs[::2], pairs[1::2]))
    dst = [d for s, d in flat if s == me]
    src = [s for s, d in flat if d == me]
    if dst and dst[0] == me:
        return x.clone()
    out = torch.zeros_like(x)
    ops = []
    if dst:
        ops.append(dist.P2POp(dist.isend, x.contiguous(), dst[0]))
    if src:
        ops.append(dist.P2POp(dist.irecv, out, src[0]))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return out


_collective_permute.register_fake(lambda x, pairs, group: torch.empty_like(x))
COLLECTIVE_PERMUTE = torch.ops.sharded.collective_permute.default
# The passes and the cross-rank fingerprint see it as a collective (its last
# argument is the process group of its first axis, as for torch's collectives).
_registry.define(COLLECTIVE_PERMUTE, collective="ppermute")


def _global_pairs(mesh, axes, pairs) -> list[int]:
    """(source rank, destination rank) for every rank of the mesh, flattened."""
    with _torch.suspend_dispatch_modes():
        ranks = mesh.device_mesh.mesh
        out = []
        dims = [mesh.axis_names.index(a) for a in axes]
        sizes = [mesh.shape[d] for d in dims]
        dst_of = dict(pairs)
        for coord in itertools.product(*[range(s) for s in mesh.shape]):
            d = dst_of.get(_combined_index(mesh, axes, coord))
            if d is None:
                continue
            dest = list(coord)
            for dim, size in zip(reversed(dims), reversed(sizes)):
                dest[dim], d = d % size, d // size
            out += [int(ranks[coord]), int(ranks[tuple(dest)])]
    return out


def _lower_ppermute(mesh, x, axes, perm):
    names = _unkey(axes)
    pairs = list(zip(perm[::2], perm[1::2]))
    moving = [a for a in names if mesh.size(a) > 1]
    if not moving:                       # one rank along the axes
        return x if (0, 0) in pairs else torch.zeros_like(x)
    return COLLECTIVE_PERMUTE(x.contiguous(), _global_pairs(mesh, names, pairs),
                              _group(mesh, moving[0]))


@torch.library.custom_op("sharded::ppermute", mutates_args=())
def _ppermute_op(x: Tensor, axes: str, perm: list[int]) -> Tensor:
    return _eager("ppermute", _lower_ppermute, x, axes, perm)


_ppermute_op.register_fake(lambda x, axes, perm: torch.empty_like(x))
PPERMUTE = torch.ops.sharded.ppermute.default
_register(PPERMUTE, _lower_ppermute, _with, _elementwise_vmap(PPERMUTE))


def _inverse(perm: list) -> list:
    return [v for s, d in zip(perm[::2], perm[1::2]) for v in (d, s)]


_PPermute: Any = _linear("_PPermute", PPERMUTE,
                    lambda ct, axes, perm: _PPermute.apply(ct, axes, _inverse(perm)))


def ppermute(x: Tensor, axis: str | Sequence[str], perm: Sequence[tuple[int, int]]) -> Tensor:
    """Send ``x`` from rank ``src`` to rank ``dst`` along ``axis`` for each ``(src,
    dst)`` in ``perm`` (indices along the axis, or along a tuple of axes taken
    together, the first major); a rank no one sends to gets zeros. Point-to-point:
    each rank moves one block."""
    axes = _axes("ppermute", axis)
    n = _size(_manual.current("ppermute").mesh, axes)
    try:
        pairs = [(int(s), int(d)) for s, d in perm]
    except (TypeError, ValueError):
        raise TypeError(f"ppermute: perm must be (src, dst) pairs of ints; got {perm!r}.") from None
    srcs, dsts = [s for s, _ in pairs], [d for _, d in pairs]
    if len(set(srcs)) != len(srcs) or len(set(dsts)) != len(dsts) or not all(
            0 <= i < n for i in srcs + dsts):
        raise ValueError(
            f"ppermute: perm {pairs} must pair distinct sources with distinct "
            f"destinations, each in range({n}) (the size of {_axes_label(axes, n)})."
        )
    if not axes:
        return x if (0, 0) in pairs else torch.zeros_like(x)
    flat = [v for p in pairs for v in p]
    return _PPermute.apply(varying_to(x, frozenset(axes)), _key(axes), flat)


# -- axis_index, axis_size ----------------------------------------------------------------------

def _lower_axis_index(mesh, axes, device):
    return _constant(_combined_index(mesh, _unkey(axes)), torch.int64, device)


@torch.library.custom_op("sharded::axis_index", mutates_args=())
def _axis_index_op(axes: str, device: torch.device) -> Tensor:
    ctx = _manual.current("axis_index")
    with _manual.untracked():
        return _lower_axis_index(ctx.mesh, axes, device)


_axis_index_op.register_fake(lambda axes, device: torch.empty((), dtype=torch.int64, device=device))
AXIS_INDEX = torch.ops.sharded.axis_index.default
_register(AXIS_INDEX, _lower_axis_index, lambda args, kwargs: frozenset(_unkey(args[0])))


def axis_index(axis: str | Sequence[str]) -> Tensor:
    """This rank's coordinate along ``axis`` (for a tuple of axes, the index along
    them taken together, the first major): an int64 scalar that varies over them."""
    axes = _axes("axis_index", axis)
    return AXIS_INDEX(_key(axes), mesh_device(_manual.current("axis_index").mesh))


def varying_axes(x: Tensor) -> frozenset:
    """The mesh axes ``x`` may vary over in this shard_map body (JAX's
    ``jax.typeof(x).vma``); empty: the same on every rank."""
    _manual.current("varying_axes")
    return vma_of(x)


def axis_size(axis: str | Sequence[str]) -> int:
    """The number of ranks along ``axis`` (or several axes together)."""
    return _size(_manual.current("axis_size").mesh, _axes("axis_size", axis))


# The primitives as differentiable calls (for interpreting a region's graph under
# torch.func: sharded/_region.py).
_registry.define(PVARY, autograd=lambda x, axes: _PVary.apply(x, axes))
_registry.define(UNVARY, autograd=lambda x, axes: _Unvary.apply(
    x, axes, _size(_manual.current("shard_map").mesh, _unkey(axes))))
_registry.define(PSUM, autograd=lambda x, axes: _PSum.apply(x, axes))
_registry.define(PMAX, autograd=lambda x, axes: _PExtreme.apply(x, axes, PMAX))
_registry.define(PMIN, autograd=lambda x, axes: _PExtreme.apply(x, axes, PMIN))
_registry.define(ALL_GATHER, autograd=lambda *a: _AllGather.apply(*a))
_registry.define(AXIS_BLOCK, autograd=lambda *a: _Block.apply(*a))
_registry.define(PSUM_SCATTER, autograd=lambda *a: _PsumScatter.apply(*a))
_registry.define(ALL_TO_ALL, autograd=lambda *a: _AllToAll.apply(*a))
_registry.define(PPERMUTE, autograd=lambda *a: _PPermute.apply(*a))

# The implicit pvary of the manual-region tracker (NOTE [Two trackers] in
# sharded/_manual.py): the lower layer's hook, filled here.
_manual.set_pvary_hooks(pvary, pvary_)

for _f in (psum, pmean, pmax, pmin, all_gather, psum_scatter, all_to_all, ppermute, axis_index, pvary):
    setattr(_f, "_sharded_collective", True)
