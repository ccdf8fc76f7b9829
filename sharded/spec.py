"""PartitionSpec: how each tensor dim is split over the named axes of a mesh.

``P("dp", None, ("x", "y"))`` says: dim 0 is split over mesh axis ``"dp"``, dim 1 is
not split, dim 2 is split over ``"x"`` and ``"y"`` together (``"x"`` major, ``"y"``
minor). Trailing dims may be left out. A mesh axis that no dim names is replicated.

# NOTE [Uneven shards]
A dim must be divisible by the product of the sizes of the axes that split it; any
other size is rejected with an error that names the dim, the axes and the fix.
torch.chunk-style uneven shards (trailing shards smaller or empty) are not supported
yet: DTensor's view ops fail on them and the workaround costs all-gathers.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch
from torch.distributed.tensor import Placement, Replicate, Shard

from sharded import _torch

__all__ = ["AUTO", "P", "PartitionSpec"]


class P:
    """A PartitionSpec. Immutable and hashable; ``P()`` is fully replicated."""

    __slots__ = ("_entries",)
    _entries: tuple

    def __init__(self, *entries):
        norm = []
        for i, e in enumerate(entries):
            if e is None or isinstance(e, str):
                norm.append(e)
            elif isinstance(e, (tuple, list)) and all(isinstance(a, str) for a in e):
                e = tuple(e)
                norm.append(e if len(e) != 1 else e[0])
                if len(e) == 0:
                    norm[-1] = None
            else:
                raise TypeError(
                    f"P entry {i} must be None, a mesh axis name or a tuple of axis "
                    f"names; got {e!r}."
                )
        object.__setattr__(self, "_entries", tuple(norm))

    def __setattr__(self, name, value):
        raise AttributeError("P is immutable")

    # -- sequence-like --------------------------------------------------------
    def __len__(self):
        return len(self._entries)

    def __iter__(self):
        return iter(self._entries)

    def __getitem__(self, i):
        return self._entries[i]

    def __eq__(self, other):
        if not isinstance(other, P):
            return NotImplemented
        return _strip(self._entries) == _strip(other._entries)

    def __hash__(self):
        return hash(("P", _strip(self._entries)))

    def __repr__(self):
        return "P(" + ", ".join(repr(e) for e in self._entries) + ")"

    def __reduce__(self):
        return (P, self._entries)

    # -- helpers --------------------------------------------------------------
    def axes(self) -> list[str]:
        """Every mesh axis named by this spec, in order of appearance."""
        out: list[str] = []
        for e in self._entries:
            out.extend(_axes_of(e))
        return out


PartitionSpec = P


class _Auto:
    """The type of ``AUTO``: one instance, pickled and copied as itself."""

    __slots__ = ()
    _instance: "_Auto | None" = None

    def __new__(cls):
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self):
        return "AUTO"

    def __reduce__(self):
        return (_Auto, ())


# A spec the layout solver chooses (docs/auto.md): ``pjit(step, in_specs=(AUTO, P("dp")))``.
# It may stand for any subtree of in_specs or out_specs; the chosen specs are
# ``pjit(...).lower(...).in_specs``.
AUTO = _Auto()


def _strip(entries: tuple) -> tuple:
    out = list(entries)
    while out and out[-1] is None:
        out.pop()
    return tuple(out)


def _axes_of(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
    return tuple(entry)


# ---------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------


def check_spec(spec: P, shape: Sequence[int], mesh, where: str) -> None:
    """Raise a clear error if ``spec`` cannot lay out a tensor of ``shape`` on ``mesh``.

    ``where`` names the spec for the message, e.g. ``"pjit in_specs[0]['w']"``.
    """
    names = mesh.axis_names
    if len(spec) > len(shape):
        raise ValueError(
            f"{where} is {spec!r}, which has {len(spec)} entries, but the tensor has "
            f"{len(shape)} dims (shape {tuple(shape)}); a spec may have at most one entry "
            f"per dim."
        )
    seen: dict[str, int] = {}
    for dim, entry in enumerate(spec):
        for axis in _axes_of(entry):
            if axis not in names:
                raise ValueError(
                    f"{where} is {spec!r}, which names mesh axis {axis!r}, but the mesh "
                    f"has axes {names}."
                )
            if axis in seen:
                raise ValueError(
                    f"{where} is {spec!r}, which uses mesh axis {axis!r} twice (dims "
                    f"{seen[axis]} and {dim}); a mesh axis may split at most one dim once."
                )
            seen[axis] = dim
        axes = _axes_of(entry)
        if len(axes) > 1:
            order = [names.index(a) for a in axes]
            if order != sorted(order):
                raise NotImplementedError(
                    f"{where} is {spec!r}: dim {dim} is split over {axes}, in an order "
                    f"other than the mesh's {names}; list the axes in mesh order, e.g. "
                    f"{tuple(sorted(axes, key=names.index))}."
                )
        n = 1
        for a in axes:
            n *= mesh.size(a)
        if n > 1 and shape[dim] % n != 0:
            axes_txt = (
                f"mesh axis {axes[0]!r} (size {n})"
                if len(axes) == 1
                else f"mesh axes {axes} (size {n} together)"
            )
            raise ValueError(
                f"{where} maps dim {dim} (size {shape[dim]}) to {axes_txt}, which does "
                f"not divide it; pad the input or change the mesh. (Uneven shards are "
                f"not supported.)"
            )


# ---------------------------------------------------------------------------
# Conversions to and from DTensor placements
# ---------------------------------------------------------------------------


# NOTE [Axes out of mesh order]
# ``P(("x", "y"))`` splits a dim over "x" (major) and then "y" (minor): each rank's
# block is contiguous, and the ranks along "y" split their "x" block. DTensor nests
# the shards of one dim in mesh-axis order; an axis that the spec lists after axes
# that come later in the mesh is a _StridedShard whose split factor is the product of
# those later axes' sizes: P(("tp", "dp")) on a ("dp", "tp") mesh is
# (_StridedShard(0, split_factor=|tp|), Shard(0)), FSDP2's layout of a tensor-parallel
# parameter, which DataParallelMode("shard") gives a parameter that "tp" already splits
# on its only dim. Read back, a _StridedShard is a spec only where its split factor is
# such a product (a contiguous block); any other (a view that merged two split dims) is
# a layout no P expresses, and from_placements raises ValueError.


def to_placements(spec: P, mesh) -> tuple[Placement, ...]:
    """The DTensor placements (one per mesh axis) that realise ``spec`` on ``mesh``
    (NOTE [Axes out of mesh order])."""
    names = mesh.axis_names
    placements: list[Placement] = [Replicate() for _ in names]
    for dim, entry in enumerate(spec):
        axes = _axes_of(entry)
        for j, axis in enumerate(axes):
            i = names.index(axis)
            factor = 1
            for earlier in axes[:j]:
                if names.index(earlier) > i:
                    factor *= mesh.shape[names.index(earlier)]
            placements[i] = Shard(dim) if factor == 1 else _torch.strided_shard(dim, factor)
    return tuple(placements)


def from_placements(placements: Iterable[Placement], mesh, ndim: int) -> P:
    """The spec of a DTensor laid out by ``placements`` on ``mesh``.

    Raises ValueError for Partial placements, which a spec cannot express, and for a
    _StridedShard that is no contiguous block (NOTE [Axes out of mesh order]).
    """
    placements = tuple(placements)
    by_dim: list[list[int]] = [[] for _ in range(ndim)]
    for i, (axis, pl) in enumerate(zip(mesh.axis_names, placements)):
        if isinstance(pl, Shard) or _torch.split_factor(pl) is not None:
            by_dim[getattr(pl, "dim")].append(i)
        elif _torch.is_partial(pl):
            raise ValueError(
                f"a tensor with placements {placements} is a pending reduction "
                f"over mesh axis {axis!r}; a PartitionSpec cannot express it. Reduce it "
                f"first (e.g. dtensor.redistribute(...) to Replicate)."
            )
        elif not isinstance(pl, Replicate):
            raise ValueError(f"unsupported placement {pl!r} on mesh axis {axis!r}")
    entries = []
    for axes_i in by_dim:
        order = _nesting(axes_i, placements, mesh)
        names = tuple(mesh.axis_names[i] for i in order)
        entries.append(None if not names else names[0] if len(names) == 1 else names)
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


def _nesting(axes_i: list[int], placements: tuple, mesh) -> list[int]:
    """The mesh axes (indices) that split one dim, major to minor (NOTE [Axes out of
    mesh order]): from the last in mesh order back, each goes in after the axes whose
    sizes multiply to its split factor."""
    order: list[int] = []
    for i in reversed(axes_i):
        factor = _torch.split_factor(placements[i]) or 1
        at, product = 0, 1
        while product < factor and at < len(order):
            product *= mesh.shape[order[at]]
            at += 1
        if product != factor:
            raise ValueError(
                f"unsupported placement {placements[i]!r} on mesh axis "
                f"{mesh.axis_names[i]!r}: its split factor is no product of the sizes of "
                f"the later mesh axes that split dim {placements[i].dim}, so the blocks are "
                f"not contiguous and no PartitionSpec expresses them"
            )
        order.insert(at, i)
    return order


def block(shape: Sequence[int], placements: Sequence[Placement], mesh, coord=None):
    """``(sizes, starts)`` of the block of a tensor of ``shape`` laid out by
    ``placements`` that the rank at mesh coordinate ``coord`` holds (this rank's by
    default). The shards of a dim nest as its spec lists their axes: in mesh-axis
    order (axis 0 major), as DTensor lays them out, except where a _StridedShard puts
    an axis after later ones (NOTE [Axes out of mesh order])."""
    if coord is None:
        coord = mesh.coordinate()
    placements = tuple(placements)
    sizes, starts = list(shape), [0] * len(shape)
    for dim in range(len(shape)):
        axes_i = [i for i, pl in enumerate(placements)
                  if (type(pl) is Shard or _torch.split_factor(pl) is not None)
                  and getattr(pl, "dim") == dim]
        for i in _nesting(axes_i, placements, mesh):
            sizes[dim] //= mesh.shape[i]
            starts[dim] += coord[i] * sizes[dim]
    return tuple(sizes), tuple(starts)


def local_shape(shape: Sequence[int], spec: P, mesh) -> tuple[int, ...]:
    """The shape of each rank's block of a tensor of ``shape`` laid out by ``spec``."""
    return block(shape, to_placements(spec, mesh), mesh, coord=(0,) * len(mesh.shape))[0]


def axes_of_dim(spec: P, dim: int) -> tuple[str, ...]:
    """The mesh axes that split tensor dim ``dim`` under ``spec`` (major to minor)."""
    return _axes_of(spec[dim]) if dim < len(spec) else ()


def local_slice(tensor: torch.Tensor, placements: Sequence[Placement], mesh) -> torch.Tensor:
    """This rank's block of a global ``tensor`` laid out by ``placements``; no communication."""
    sizes, starts = block(tensor.shape, placements, mesh)
    for dim, (size, start) in enumerate(zip(sizes, starts)):
        if size != tensor.shape[dim]:
            tensor = tensor.narrow(dim, start, size)
    return tensor.contiguous()


def reduced(placements) -> tuple:
    """``placements`` with every pending reduction done (Partial -> Replicate)."""
    return tuple(Replicate() if _torch.is_partial(p) else p for p in placements)
