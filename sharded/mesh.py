"""Mesh: a grid of ranks with named axes, over a torch.distributed DeviceMesh.

"axis" always means a mesh axis; "dim" always means a tensor dimension.
"""

from __future__ import annotations

import datetime
import math
import os
import threading
from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from sharded import _torch

__all__ = ["Mesh", "current_mesh"]

# Meshes are collective to create (one process group per axis), so equal meshes are
# shared: tests and notebooks that build Mesh((2,), ("dp",)) many times reuse one.
_CACHE: dict[tuple, "Mesh"] = {}
_STACK = threading.local()


class Mesh:
    """A named device mesh.

    ``Mesh((2, 2), ("dp", "tp"))`` lays the world's 4 ranks out as a 2x2 grid in
    row-major order: ranks 0 and 1 share ``dp`` coordinate 0. Starts the default
    process group from torchrun's environment variables (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT``) when none is running; a mesh of one rank needs
    no environment at all.

    ``with mesh:`` makes it the default for ``pjit``/``shard_map`` called inside.
    """

    device_mesh: DeviceMesh
    axis_names: tuple[str, ...]
    shape: tuple[int, ...]
    device_type: str
    _sync_group: dist.ProcessGroup | None
    _group_axes: dict[str, str]

    def __new__(cls, shape: Sequence[int], axis_names: Sequence[str], *, device_type=None):
        shape, axis_names = _check_args(shape, axis_names)
        _ensure_process_group(shape, device_type)
        device_type = device_type or _default_device_type()
        key = (id(dist.group.WORLD), shape, axis_names, device_type)
        if key not in _CACHE:
            dm = init_device_mesh(device_type, tuple(shape), mesh_dim_names=tuple(axis_names))
            _CACHE[key] = cls._from_dm(dm)
        return _CACHE[key]

    @classmethod
    def from_device_mesh(cls, device_mesh: DeviceMesh) -> "Mesh":
        """The Mesh over ``device_mesh`` (the same object for the same DeviceMesh, so
        pjit's cache, keyed by mesh, is not missed)."""
        if device_mesh.mesh_dim_names is None:
            raise ValueError(
                "Mesh.from_device_mesh needs a DeviceMesh with mesh_dim_names; build it "
                "with init_device_mesh(..., mesh_dim_names=(...))."
            )
        for mesh in _CACHE.values():
            if mesh.device_mesh is device_mesh:
                return mesh
        mesh = _CACHE[("from", id(device_mesh))] = cls._from_dm(device_mesh)
        return mesh

    @classmethod
    def _from_dm(cls, dm: DeviceMesh) -> "Mesh":
        self = object.__new__(cls)
        self.device_mesh = dm
        self.axis_names = tuple(dm.mesh_dim_names or ())
        self.shape = tuple(dm.mesh.shape)
        self.device_type = dm.device_type
        self._sync_group = None
        self._group_axes = {}
        for i, name in enumerate(self.axis_names):
            self._group_axes[dm.get_group(i).group_name] = name
        return self

    # -- queries --------------------------------------------------------------
    def size(self, axis: str | Sequence[str] | None = None) -> int:
        """The number of ranks along ``axis`` (or several axes together); the whole
        mesh's size when ``axis`` is None."""
        if axis is None:
            return math.prod(self.shape)
        axes = (axis,) if isinstance(axis, str) else tuple(axis)
        n = 1
        for a in axes:
            if a not in self.axis_names:
                raise ValueError(
                    f"mesh axis {a!r} is not in the mesh; its axes are {self.axis_names}."
                )
            n *= self.shape[self.axis_names.index(a)]
        return n

    @property
    def ndim(self) -> int:
        """The number of mesh axes."""
        return len(self.shape)

    @property
    def rank(self) -> int:
        """This process's global rank."""
        return dist.get_rank()

    def coordinate(self) -> tuple[int, ...]:
        """This rank's coordinate along each axis."""
        return tuple(self.device_mesh.get_coordinate() or ())

    def axis_of_group(self, group_name: str) -> str | None:
        """The mesh axis whose process group is named ``group_name``, or None."""
        return self._group_axes.get(group_name)

    def sync_group(self):
        """A gloo group over the whole mesh with a bounded timeout, used to compare
        programs across ranks at compile time (so a bad rank errors, not hangs)."""
        if self._sync_group is None:
            secs = float(os.environ.get("SHARDED_SYNC_TIMEOUT", "300"))
            ranks = sorted(self.device_mesh.mesh.flatten().tolist())
            self._sync_group = dist.new_group(
                ranks, backend="gloo", timeout=datetime.timedelta(seconds=secs)
            )
        return self._sync_group

    # -- context manager ------------------------------------------------------
    def __enter__(self):
        stack = getattr(_STACK, "meshes", None)
        if stack is None:
            stack = _STACK.meshes = []
        stack.append(self)
        return self

    def __exit__(self, *exc):
        _STACK.meshes.pop()

    def __repr__(self):
        inner = ", ".join(f"{n!r}: {s}" for n, s in zip(self.axis_names, self.shape))
        return f"Mesh({{{inner}}}, device_type={self.device_type!r})"

    def __reduce__(self):
        return (_rebuild, (self.shape, self.axis_names, self.device_type))


def _rebuild(shape, axis_names, device_type):
    return Mesh(shape, axis_names, device_type=device_type)


def current_mesh(mesh: Mesh | None, api: str) -> Mesh:
    """``mesh`` if given, else the innermost ``with mesh:``; error if neither."""
    if mesh is not None:
        if not isinstance(mesh, Mesh):
            raise TypeError(f"{api}: mesh must be a sharded.Mesh; got {type(mesh).__name__}.")
        return mesh
    stack = getattr(_STACK, "meshes", None)
    if stack:
        return stack[-1]
    raise ValueError(
        f"{api} needs a mesh: pass mesh=Mesh(...) or call it inside `with mesh:`."
    )


# ---------------------------------------------------------------------------
# Checks and process-group start-up
# ---------------------------------------------------------------------------


def _check_args(shape, axis_names):
    if isinstance(shape, int):
        shape = (shape,)
    if isinstance(axis_names, str):
        axis_names = (axis_names,)
    shape, axis_names = tuple(shape), tuple(axis_names)
    if not all(isinstance(s, int) and s > 0 for s in shape):
        raise ValueError(f"Mesh shape must be positive ints; got {shape!r}.")
    if len(shape) != len(axis_names):
        raise ValueError(
            f"Mesh got shape {shape} ({len(shape)} axes) but {len(axis_names)} axis "
            f"names {axis_names}; give one name per axis."
        )
    for a in axis_names:
        if not isinstance(a, str) or not a:
            raise TypeError(f"Mesh axis names must be non-empty strings; got {a!r}.")
    dup = sorted({a for a in axis_names if axis_names.count(a) > 1})
    if dup:
        raise ValueError(f"Mesh axis names must be unique; {dup[0]!r} repeats in {axis_names}.")
    return shape, axis_names


def _ensure_process_group(shape, device_type):
    need = math.prod(shape)
    if not dist.is_initialized():
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
            dist.init_process_group(backend)
        elif need == 1:
            dist.init_process_group("gloo", store=_torch.hash_store(), rank=0, world_size=1)
        else:
            raise RuntimeError(
                f"Mesh{shape} needs {need} ranks but no process group is running. Start "
                f"the program with `torchrun --nproc-per-node {need} script.py`, or run "
                f"the function on local ranks with sharded.launch(fn, {need})."
            )
    world = dist.get_world_size()
    if world != need:
        raise ValueError(
            f"Mesh{shape} has {need} ranks but the world has {world}; the mesh must "
            f"cover every rank (its shape's product must equal the world size)."
        )


def _default_device_type() -> str:
    if torch.cuda.is_available() and "nccl" in str(dist.get_backend()):
        return "cuda"
    return "cpu"
