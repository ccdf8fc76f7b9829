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

__all__ = ["P", "PartitionSpec"]


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


def to_placements(spec: P, mesh) -> tuple[Placement, ...]:
    """The DTensor placements (one per mesh axis) that realise ``spec`` on ``mesh``."""
    placements: list[Placement] = [Replicate() for _ in mesh.axis_names]
    for dim, entry in enumerate(spec):
        for axis in _axes_of(entry):
            placements[mesh.axis_names.index(axis)] = Shard(dim)
    return tuple(placements)


def from_placements(placements: Iterable[Placement], mesh, ndim: int) -> P:
    """The spec of a DTensor laid out by ``placements`` on ``mesh``.

    Raises ValueError for Partial placements, which a spec cannot express.
    """
    entries: list[list[str]] = [[] for _ in range(ndim)]
    for axis, pl in zip(mesh.axis_names, placements):
        if isinstance(pl, Shard):
            entries[pl.dim].append(axis)
        elif _torch.is_partial(pl):
            raise ValueError(
                f"a tensor with placements {tuple(placements)} is a pending reduction "
                f"over mesh axis {axis!r}; a PartitionSpec cannot express it. Reduce it "
                f"first (e.g. dtensor.redistribute(...) to Replicate)."
            )
        elif not isinstance(pl, Replicate):
            raise ValueError(f"unsupported placement {pl!r} on mesh axis {axis!r}")
    out = [None if not e else (e[0] if len(e) == 1 else tuple(e)) for e in entries]
    while out and out[-1] is None:
        out.pop()
    return P(*out)


def block(shape: Sequence[int], placements: Sequence[Placement], mesh, coord=None):
    """``(sizes, starts)`` of the block of a tensor of ``shape`` laid out by
    ``placements`` that the rank at mesh coordinate ``coord`` holds (this rank's by
    default). Shards nest in mesh-axis order (axis 0 major), as DTensor lays them out."""
    if coord is None:
        coord = mesh.coordinate()
    sizes, starts = list(shape), [0] * len(shape)
    for axis_i, pl in enumerate(placements):
        if type(pl) is Shard:
            sizes[pl.dim] //= mesh.shape[axis_i]
            starts[pl.dim] += coord[axis_i] * sizes[pl.dim]
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
