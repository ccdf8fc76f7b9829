"""Collectives over named mesh axes, for shard_map bodies, with the gradients of the
single-device program.

Each is an autograd.Function (usable under torch.func.grad/vjp) whose backward is
the JAX transpose rule, and each records which axes its result varies over
(NOTE [Varying manual axes] in sharded/_manual.py):

==============  ==========================================  ==========================
collective      result                                       transpose (backward)
==============  ==========================================  ==========================
psum            sum over the axes; invariant over them       pvary (identity)
pmean           psum / axis size                             pvary / axis size
pmax, pmin      max/min over the axes; invariant             cotangent where x won
all_gather      blocks of every rank, concatenated; invar.   this rank's block
psum_scatter    sum, then this rank's block; varying         all_gather
ppermute        the block of the rank that sends to us       ppermute with the inverse
all_to_all      split a dim, exchange, concatenate another   all_to_all with dims swapped
axis_index      this rank's coordinate on the axis           (integer, no gradient)
==============  ==========================================  ==========================

A value that is invariant over an axis (e.g. a replicated input) is treated as if
``pvary``'d first, as in JAX: ``psum`` of it over an axis of size n is ``n * x``.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from sharded import _manual, _torch
from sharded._manual import pvary, set_vma, vma_of

__all__ = ["psum", "pmean", "pmax", "pmin", "all_gather", "psum_scatter", "ppermute",
           "all_to_all", "axis_index", "axis_size", "pvary"]

_F = _torch.c10d_functional


# -- helpers ----------------------------------------------------------------------------

def _axes(api: str, axis) -> tuple[str, ...]:
    ctx = _manual.current(api)
    axes = (axis,) if isinstance(axis, str) else tuple(axis)
    for a in axes:
        if a not in ctx.mesh.axis_names:
            raise ValueError(
                f"{api}: mesh axis {a!r} is not in the shard_map mesh; its axes are "
                f"{ctx.mesh.axis_names}."
            )
    return axes


def _one_axis(api: str, axis) -> str:
    if not isinstance(axis, str):
        raise TypeError(f"{api} takes one mesh axis name; got {axis!r}.")
    return _axes(api, axis)[0]


def _group(axis: str) -> str:
    return _manual.current("collective").mesh.device_mesh.get_group(axis).group_name


def _size(axes) -> int:
    mesh = _manual.current("collective").mesh
    return math.prod(mesh.size(a) for a in axes)


def _index(axis: str) -> int:
    mesh = _manual.current("collective").mesh
    return mesh.coordinate()[mesh.axis_names.index(axis)]


def _all_reduce(x, op: str, axes):
    for a in axes:
        x = _F.wait_tensor(_F.all_reduce(x.contiguous(), op, _group(a)))
    return x


def _gather_dim0(x, axis):
    n = _size([axis])
    return _F.wait_tensor(_F.all_gather_into_tensor(x.contiguous(), n, _group(axis)))


def _all_gather(x, axis, dim):
    """Tiled all-gather along ``dim``."""
    g = _gather_dim0(x.movedim(dim, 0), axis)          # [n * x.shape[dim], ...]
    return g.movedim(0, dim) if dim else g


def _reduce_scatter(x, axis, dim):
    """Tiled: sum over the axis, keep this rank's block of ``dim``."""
    n = _size([axis])
    y = _F.wait_tensor(_F.reduce_scatter_tensor(x.movedim(dim, 0).contiguous(), "sum", n, _group(axis)))
    return y.movedim(0, dim) if dim else y


def _block(x, axis, dim):
    n = _size([axis])
    return x.chunk(n, dim)[_index(axis)]


def _exchange(x, axis):
    """Equal all-to-all on dim 0: block j of ``x`` goes to rank j; block s of the
    result came from rank s."""
    n = _size([axis])
    splits = [x.shape[0] // n] * n
    return _F.wait_tensor(_F.all_to_all_single(x.contiguous(), splits, splits, _group(axis)))


def _all_to_all(x, axis, split_dim, concat_dim):
    n = _size([axis])
    y = x.movedim(split_dim, 0).contiguous()                     # blocks to send, on dim 0
    y = _exchange(y, axis)
    y = y.movedim(0, split_dim)                                  # blocks received, by source
    return torch.cat(y.chunk(n, split_dim), dim=concat_dim)


def _ppermute(x, axis, perm):
    """Send to ``dst`` for each (src, dst); ranks no one sends to get zeros.

    # NOTE [ppermute and CSE]
    The send buffer is ``x`` times a one-hot constant over destinations, so the graph
    has the same structure on every rank (only the constant's values differ). The
    constants are shared per (axis, perm, role), a key that is the same on every rank:
    two uses of one perm (a forward and the vjp's recomputed forward) read the same
    constant, and CSE merges them on every rank alike; different perms never share
    one, even where their values coincide on some rank. Placing ``x`` into a
    rank-dependent slot instead let CSE merge different ppermutes on one rank only,
    pairing different collectives across ranks.
    """
    n, me = _size([axis]), _index(axis)
    dst_of = dict(perm)
    src_of = {d: s for s, d in perm}
    send = _one_hot(axis, perm, "send", dst_of.get(me), n, x)
    recv = _exchange(x.unsqueeze(0) * send, axis)      # recv[s] came from s
    return (recv * _one_hot(axis, perm, "recv", src_of.get(me), n, x)).sum(0)


_ONE_HOTS: dict = {}


def _one_hot(axis, perm, role, j, n, like):
    key = (id(_manual.current("ppermute").mesh), axis, perm, role, like.dtype, like.device, like.ndim)
    if key not in _ONE_HOTS:
        with _torch.suspend_dispatch_modes():   # a real constant, not a traced value
            values = torch.tensor([1.0 if i == j else 0.0 for i in range(n)],
                                  dtype=like.dtype, device=like.device)
            _ONE_HOTS[key] = values.view(n, *([1] * like.ndim))
    return _ONE_HOTS[key]


# -- psum family ---------------------------------------------------------------------------

class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(x, op, varying, invariant):
        with _manual.untracked():
            y = _all_reduce(x, op, varying)
            if invariant and op == "sum":
                y = y * _size(invariant)
        return y

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, op, varying, invariant = inputs
        ctx.op, ctx.invariant = op, invariant
        if op != "sum":
            ctx.save_for_backward(x, output)

    @staticmethod
    def backward(ctx, ct):
        if ctx.op == "sum":
            return (ct * _size(ctx.invariant) if ctx.invariant else ct), None, None, None
        x, y = ctx.saved_tensors
        return ct * (x == y).to(ct.dtype), None, None, None


def _reduce(api, x, axis, op):
    axes = _axes(api, axis)
    have = vma_of(x)
    varying = tuple(a for a in axes if a in have)
    invariant = tuple(a for a in axes if a not in have)
    out = _Reduce.apply(x, op, varying, invariant)
    set_vma(out, have - set(axes))
    return out


def psum(x: torch.Tensor, axis: str | Sequence[str]) -> torch.Tensor:
    """Sum of ``x`` over the mesh axis (or axes); the result is invariant over them."""
    return _reduce("psum", x, axis, "sum")


def pmean(x: torch.Tensor, axis: str | Sequence[str]) -> torch.Tensor:
    """Mean of ``x`` over the mesh axis (or axes)."""
    return psum(x, axis) / _size(_axes("pmean", axis))


def pmax(x: torch.Tensor, axis: str | Sequence[str]) -> torch.Tensor:
    """Elementwise max over the axis (or axes); the gradient goes where x is the max."""
    return _reduce("pmax", x, axis, "max")


def pmin(x: torch.Tensor, axis: str | Sequence[str]) -> torch.Tensor:
    """Elementwise min over the axis (or axes); the gradient goes where x is the min."""
    return _reduce("pmin", x, axis, "min")


# -- gathers and scatters ----------------------------------------------------------------------

class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(x, axis, dim, was_varying):
        with _manual.untracked():
            return _all_gather(x, axis, dim)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.axis, ctx.dim, ctx.was_varying = inputs

    @staticmethod
    def backward(ctx, ct):
        with _manual.untracked():
            if ctx.was_varying:
                return _block(ct, ctx.axis, ctx.dim), None, None, None
            # x was the same on every rank: it was used once per block.
            return sum(ct.chunk(_size([ctx.axis]), ctx.dim)), None, None, None


def all_gather(x: torch.Tensor, axis: str, *, dim: int = 0, tiled: bool = False) -> torch.Tensor:
    """The blocks ``x`` of every rank along ``axis``: stacked in a new dim ``dim``, or
    concatenated along ``dim`` when ``tiled``. The result is invariant over ``axis``."""
    axis = _one_axis("all_gather", axis)
    dim = dim % (x.ndim + (0 if tiled else 1))
    src = x if tiled else x.unsqueeze(dim)
    out = _AllGather.apply(src, axis, dim, axis in vma_of(x))
    set_vma(out, vma_of(x) - {axis})
    return out


class _PsumScatter(torch.autograd.Function):
    @staticmethod
    def forward(x, axis, dim, was_varying):
        with _manual.untracked():
            if was_varying:
                return _reduce_scatter(x, axis, dim)
            return _block(x, axis, dim) * _size([axis])

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.axis, ctx.dim, ctx.was_varying = inputs

    @staticmethod
    def backward(ctx, ct):
        with _manual.untracked():
            g = _all_gather(ct, ctx.axis, ctx.dim)
            if not ctx.was_varying:
                g = g * _size([ctx.axis])
            return g, None, None, None


def psum_scatter(x: torch.Tensor, axis: str, *, dim: int = 0, tiled: bool = False) -> torch.Tensor:
    """Sum ``x`` over ``axis`` and keep this rank's block of dim ``dim`` (which must
    divide by the axis size; without ``tiled`` its size must equal the axis size and
    the dim is removed). The result varies over ``axis``."""
    axis = _one_axis("psum_scatter", axis)
    dim = dim % x.ndim
    n = _size([axis])
    if x.shape[dim] % n:
        raise ValueError(
            f"psum_scatter: dim {dim} of x (shape {tuple(x.shape)}) must divide by the "
            f"size of mesh axis {axis!r} ({n})."
        )
    if not tiled and x.shape[dim] != n:
        raise ValueError(
            f"psum_scatter without tiled needs dim {dim} of x (shape {tuple(x.shape)}) "
            f"to equal the size of mesh axis {axis!r} ({n}); pass tiled=True to keep "
            f"a block instead."
        )
    out = _PsumScatter.apply(x, axis, dim, axis in vma_of(x))
    if not tiled:
        out = out.squeeze(dim)
    set_vma(out, vma_of(x) | {axis})
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(x, axis, split_dim, concat_dim):
        with _manual.untracked():
            return _all_to_all(x, axis, split_dim, concat_dim)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.axis, ctx.split_dim, ctx.concat_dim = inputs

    @staticmethod
    def backward(ctx, ct):
        with _manual.untracked():
            return _all_to_all(ct, ctx.axis, ctx.concat_dim, ctx.split_dim), None, None, None


def all_to_all(x: torch.Tensor, axis: str, split_dim: int, concat_dim: int) -> torch.Tensor:
    """Split dim ``split_dim`` into one block per rank of ``axis``, send block j to rank
    j, and concatenate the blocks received along ``concat_dim`` (JAX's tiled
    all_to_all). The expert-parallel exchange."""
    axis = _one_axis("all_to_all", axis)
    split_dim, concat_dim = split_dim % x.ndim, concat_dim % x.ndim
    n = _size([axis])
    if x.shape[split_dim] % n:
        raise ValueError(
            f"all_to_all: split dim {split_dim} of x (shape {tuple(x.shape)}) must divide "
            f"by the size of mesh axis {axis!r} ({n})."
        )
    out = _AllToAll.apply(x, axis, split_dim, concat_dim)
    set_vma(out, vma_of(x) | {axis})
    return out


class _PPermute(torch.autograd.Function):
    @staticmethod
    def forward(x, axis, perm):
        with _manual.untracked():
            return _ppermute(x, axis, perm)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.axis, perm = inputs
        ctx.inverse = tuple((d, s) for s, d in perm)

    @staticmethod
    def backward(ctx, ct):
        with _manual.untracked():
            return _ppermute(ct, ctx.axis, ctx.inverse), None, None


def ppermute(x: torch.Tensor, axis: str, perm: Sequence[tuple[int, int]]) -> torch.Tensor:
    """Send ``x`` from rank ``src`` to rank ``dst`` along ``axis`` for each ``(src,
    dst)`` in ``perm`` (indices along the axis); a rank no one sends to gets zeros."""
    axis = _one_axis("ppermute", axis)
    n = _size([axis])
    perm = tuple((int(s), int(d)) for s, d in perm)
    srcs, dsts = [s for s, _ in perm], [d for _, d in perm]
    if len(set(srcs)) != len(srcs) or len(set(dsts)) != len(dsts) or not all(
            0 <= i < n for i in srcs + dsts):
        raise ValueError(
            f"ppermute: perm {list(perm)} must pair distinct sources with distinct "
            f"destinations, each in range({n}) (the size of mesh axis {axis!r})."
        )
    out = _PPermute.apply(x, axis, perm)
    set_vma(out, vma_of(x) | {axis})
    return out


# -- indices ------------------------------------------------------------------------------------

def axis_index(axis: str) -> torch.Tensor:
    """This rank's coordinate along ``axis`` (an int64 scalar that varies over it)."""
    axis = _one_axis("axis_index", axis)
    out = torch.tensor(_index(axis), dtype=torch.int64)
    set_vma(out, {axis})
    return out


def axis_size(axis: str | Sequence[str]) -> int:
    """The number of ranks along ``axis`` (or several axes together)."""
    return _size(_axes("axis_size", axis))


for _f in (psum, pmean, pmax, pmin, all_gather, psum_scatter, all_to_all, ppermute, axis_index, pvary):
    setattr(_f, "_sharded_collective", True)
