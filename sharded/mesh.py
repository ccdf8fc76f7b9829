"""Mesh: a grid of ranks with named axes, over a torch.distributed DeviceMesh.

"axis" always means a mesh axis; "dim" always means a tensor dimension.
"""

from __future__ import annotations

import atexit
import math
import os
import threading
import weakref
from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from sharded import _torch, sync

__all__ = ["Mesh", "current_mesh"]

# Meshes are collective to create (one process group per axis), so equal meshes are
# shared: tests and notebooks that build Mesh((2,), ("dp",)) many times reuse one.
# Bounded by the distinct (shape, names, device type) a program uses.
_CACHE: dict[tuple, "Mesh"] = {}
# Meshes over user-made DeviceMeshes live as long as someone holds them (a dict keyed
# by id() would keep every DeviceMesh alive, and could hand a reused id a stale mesh).
_FROM_DM: "weakref.WeakValueDictionary[int, Mesh]" = weakref.WeakValueDictionary()
_ABSTRACT: dict[tuple, "Mesh"] = {}
_LOCK = threading.RLock()
_STACK = threading.local()


def mesh_device(mesh) -> torch.device:
    """The device a rank's tensors of ``mesh`` are made on: for a CUDA mesh this
    process's current CUDA device (also for an abstract mesh, unlike ``Mesh.device``),
    else the mesh's device type."""
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


class Mesh:
    """A named device mesh.

    ``Mesh((2, 2), ("dp", "tp"))`` lays the world's 4 ranks out as a 2x2 grid in
    row-major order: ranks 0 and 1 share ``dp`` coordinate 0. Starts the default
    process group from torchrun's environment variables (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT``) when none is running; a mesh of one rank needs
    no environment at all.

    With CUDA available the group is ``cpu:gloo,cuda:nccl`` and the mesh a CUDA mesh.
    Before NCCL starts (and whenever a CUDA mesh is built), each rank is put on its
    ``LOCAL_RANK`` device, or 0 where the process sees a single device, and a rank
    whose CUDA was already initialised on another device is an error
    (NOTE [One GPU per rank]).

    ``with mesh:`` makes it the default for ``pjit``/``shard_map`` called inside.
    """

    device_mesh: DeviceMesh
    axis_names: tuple[str, ...]
    shape: tuple[int, ...]
    device_type: str
    _abstract_rank: int | None
    _group_axes: dict[str, str]

    def __new__(cls, shape: Sequence[int], axis_names: Sequence[str], *, device_type=None):
        shape, axis_names = _check_args(shape, axis_names)
        sync.check_usable(f"Mesh{shape}")
        _ensure_process_group(shape, device_type)
        device_type = device_type or _default_device_type()
        if device_type == "cuda":
            _use_local_cuda_device(f"Mesh{shape}")
        key = (id(dist.group.WORLD), shape, axis_names, device_type)
        with _LOCK:
            if key not in _CACHE:
                dm = init_device_mesh(device_type, tuple(shape), mesh_dim_names=tuple(axis_names))
                mesh = cls._from_dm(dm)
                # Creating a mesh is collective anyway: make the agreement's group
                # now, in the same order on every rank.
                sync.group_for(mesh)
                if mesh.size() > 1:
                    sync.install_excepthook()
                _CACHE[key] = mesh
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
        with _LOCK:
            for mesh in (*_CACHE.values(), *_ABSTRACT.values()):
                if mesh.device_mesh is device_mesh:
                    return mesh
            found = _FROM_DM.get(id(device_mesh))
            if found is None or found.device_mesh is not device_mesh:
                found = _FROM_DM[id(device_mesh)] = cls._from_dm(device_mesh)
            return found

    @classmethod
    def abstract(cls, shape: Sequence[int], axis_names: Sequence[str], *, rank: int = 0,
                 device_type: str = "cpu") -> "Mesh":
        """A mesh of any size, for ``.lower()`` only: ``pjit(f, ..., mesh=m).lower(*args)``
        builds the program that rank ``rank`` of this mesh runs, in this process, with
        no process group to join (NOTE [Abstract meshes] in ``sharded/_torch.py``).
        ``Mesh.abstract((64, 8), ("dp", "tp"))`` plans a 512-rank job on a laptop;
        arguments may be meta tensors (``torch.empty(shape, device="meta")``), so no
        memory is allocated for them. Running a program on it is an error."""
        shape, axis_names = _check_args(shape, axis_names)
        n = math.prod(shape)
        if not (isinstance(rank, int) and 0 <= rank < n):
            raise ValueError(
                f"Mesh.abstract{shape}: rank must be an int in range({n}); got {rank!r}."
            )
        if device_type not in ("cpu", "cuda"):
            raise ValueError(f"Mesh.abstract: device_type must be 'cpu' or 'cuda'; got {device_type!r}.")
        key = (shape, axis_names, rank, device_type)
        with _LOCK:
            if key not in _ABSTRACT:
                dm = _torch.abstract_device_mesh(shape, axis_names, rank, device_type)
                mesh = cls._from_dm(dm)
                mesh._abstract_rank = rank
                _ABSTRACT[key] = mesh
            return _ABSTRACT[key]

    @property
    def is_abstract(self) -> bool:
        """A mesh from ``Mesh.abstract``: programs on it can be lowered, not run."""
        return self._abstract_rank is not None

    def require_ranks(self, api: str) -> None:
        """Error if this mesh is abstract (there are no ranks to run on)."""
        if self.is_abstract:
            raise RuntimeError(
                f"{api} cannot run on {self!r}: it is an abstract mesh (Mesh.abstract), "
                f"for .lower() only. Run on a Mesh of real ranks (torchrun, or "
                f"sharded.launch)."
            )

    @classmethod
    def _from_dm(cls, dm: DeviceMesh) -> "Mesh":
        self = object.__new__(cls)
        self._abstract_rank = None
        self.device_mesh = dm
        self.axis_names = tuple(dm.mesh_dim_names or ())
        self.shape = tuple(dm.mesh.shape)
        self.device_type = dm.device_type
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
    def device(self) -> torch.device:
        """The device this rank's shards live on: ``cpu``, or for a CUDA mesh this
        process's current CUDA device (its ``LOCAL_RANK`` device under torchrun; NOTE
        [One GPU per rank]). A single-device reference to compare with the mesh's
        results belongs on it: ``torch.testing.assert_close`` checks devices. For an
        abstract mesh, the device type without an index."""
        if self.device_type == "cuda" and self._abstract_rank is None:
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device(self.device_type)

    @property
    def rank(self) -> int:
        """This process's global rank (for an abstract mesh, the rank it lowers for)."""
        if self._abstract_rank is not None:
            return self._abstract_rank
        return dist.get_rank()

    def coordinate(self) -> tuple[int, ...]:
        """This rank's coordinate along each axis."""
        return tuple(self.device_mesh.get_coordinate() or ())

    def axis_of_group(self, group_name: str) -> str | None:
        """The mesh axis whose process group is named ``group_name``, or None."""
        return self._group_axes.get(group_name)

    def sync_group(self):
        """The gloo group (bounded timeout) over the mesh's ranks that pjit's
        cross-rank agreement uses (``sharded.sync.group_for``); None for one rank."""
        return sync.group_for(self)

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
        if self._abstract_rank is not None:
            return (f"Mesh.abstract({{{inner}}}, rank={self._abstract_rank}, "
                    f"device_type={self.device_type!r})")
        return f"Mesh({{{inner}}}, device_type={self.device_type!r})"

    def __reduce__(self):
        if self._abstract_rank is not None:
            return (_rebuild_abstract, (self.shape, self.axis_names, self._abstract_rank, self.device_type))
        return (_rebuild, (self.shape, self.axis_names, self.device_type))


def _rebuild(shape, axis_names, device_type):
    return Mesh(shape, axis_names, device_type=device_type)


def _rebuild_abstract(shape, axis_names, rank, device_type):
    return Mesh.abstract(shape, axis_names, rank=rank, device_type=device_type)


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
            backend = "gloo"
            if torch.cuda.is_available():
                backend = "cpu:gloo,cuda:nccl"
                _use_local_cuda_device(f"Mesh{shape}")      # before NCCL starts
            dist.init_process_group(backend)
            # destroyed when the program ends, before the interpreter tears down:
            # gloo's worker threads, still alive at C++ static destruction, aborted a
            # rank at exit now and then ("terminate called without an active
            # exception", SIGABRT after the run had finished; once in CI's torchrun
            # test of examples/gpt_train.py). Non-daemon threads (an async
            # checkpoint's) have finished by then; groups the program destroyed
            # itself leave nothing to do.
            atexit.register(_torch.release_process_groups)
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


# NOTE [One GPU per rank]
# NCCL needs every rank of a node on a CUDA device of its own, chosen before NCCL
# starts. torch's DeviceMesh sets it as a side effect of its set-up, from LOCAL_RANK,
# and only when nothing has initialised CUDA yet; otherwise it keeps whatever device is
# current, silently: two ranks on cuda:0 fail later inside NCCL ("Duplicate GPU
# detected") or share one GPU. Mesh does it itself, before it starts NCCL and whenever
# it builds a CUDA mesh, and checks the result:
# - the device is LOCAL_RANK (torchrun's convention, and DeviceMesh's), or 0 when the
#   process sees exactly one device (a launcher that gives each process its own GPU
#   with CUDA_VISIBLE_DEVICES, as SLURM's --gpus-per-task does: LOCAL_RANK 1 is then
#   device 0 of that process, where DeviceMesh's set_device(1) would fail with "invalid
#   device ordinal"); a LOCAL_RANK beyond the devices of a process that sees several
#   is an error (two ranks would share one);
# - CUDA not initialised yet: torch.cuda.set_device(device); initialised with that
#   device current: nothing to do; initialised on another device (a tensor was made
#   on "cuda" before the mesh, or set_device chose another): an error naming both and
#   the fix, rather than tensors and NCCL's communicator on the wrong GPU.
# Without LOCAL_RANK (not torchrun nor sharded.launch) the device is the caller's
# choice, and DeviceMesh's heuristic (global rank % devices) applies as before.


def _local_cuda_device(local_rank: int, device_count: int, api: str = "Mesh") -> int:
    """The CUDA device index of the process with ``LOCAL_RANK`` ``local_rank`` that sees
    ``device_count`` devices (NOTE [One GPU per rank]): ``local_rank``, or 0 where the
    process sees exactly one device; an error where it sees none, or fewer than
    ``local_rank + 1`` but more than one."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    seen = f"CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else "CUDA_VISIBLE_DEVICES unset"
    if device_count < 1:
        raise RuntimeError(
            f"{api} runs on CUDA (NCCL) but this process sees no CUDA device ({seen}). "
            f"Check CUDA_VISIBLE_DEVICES, or build a CPU mesh with device_type='cpu'."
        )
    if local_rank < 0:
        raise ValueError(f"{api}: LOCAL_RANK must be >= 0; got {local_rank}.")
    if local_rank < device_count:
        return local_rank
    if device_count == 1:
        return 0
    raise RuntimeError(
        f"{api}: this rank has LOCAL_RANK={local_rank} but its process sees only "
        f"{device_count} CUDA devices ({seen}), so it has no device of its own. Start at "
        f"most {device_count} processes per node (torchrun --nproc-per-node "
        f"{device_count}), or give each process exactly one device with "
        f"CUDA_VISIBLE_DEVICES."
    )


def _use_local_cuda_device(api: str = "Mesh") -> int | None:
    """Put this process on its ``LOCAL_RANK`` CUDA device, or check that it is on it
    (NOTE [One GPU per rank]); returns the device index, or None without
    ``LOCAL_RANK`` in the environment (the device is then the caller's choice)."""
    raw = os.environ.get("LOCAL_RANK")
    if raw is None:
        return None
    try:
        local_rank = int(raw)
    except ValueError:
        raise ValueError(f"{api}: LOCAL_RANK must be an int; got {raw!r}.") from None
    want = _local_cuda_device(local_rank, torch.cuda.device_count(), api)
    if not torch.cuda.is_initialized():
        torch.cuda.set_device(want)
        return want
    current = torch.cuda.current_device()
    if current != want:
        raise RuntimeError(
            f"{api}: this rank (LOCAL_RANK={local_rank}) must run on cuda:{want}, but "
            f"CUDA was initialised before the mesh with cuda:{current} as the current "
            f"device (a tensor made on 'cuda', or torch.cuda.set_device({current})), so "
            f"this rank would compute and start NCCL on another rank's GPU. Call "
            f"torch.cuda.set_device(int(os.environ['LOCAL_RANK'])) at the start of the "
            f"program, before anything touches CUDA (or build the Mesh first); where a "
            f"launcher gives each process one device with CUDA_VISIBLE_DEVICES, that "
            f"device is cuda:0."
        )
    return want


def _default_device_type() -> str:
    if torch.cuda.is_available() and "nccl" in str(dist.get_backend()):
        return "cuda"
    return "cpu"


# NOTE [Stage slices]
# A pipeline stage's state lives on the ranks of one coordinate of the pipeline axis:
# a DTensor on the slice of the mesh at that coordinate (the other axes). On the
# slice's own ranks it is the mesh's sub-DeviceMesh (its process groups); on every
# other rank a DeviceMesh over the same ranks without process groups, on which the
# DTensor holds an empty local tensor (DTensor's rule for a rank outside the mesh).
# One object per (mesh, axis, coordinate), so DTensors of one stage compare equal.
_SLICES: dict[tuple, DeviceMesh] = {}
_SLICE_OF: "weakref.WeakValueDictionary[int, Mesh]" = weakref.WeakValueDictionary()
_SLICE_INFO: dict[int, tuple[str, int]] = {}


def stage_slice(mesh: Mesh, axis: str, coord: int) -> DeviceMesh:
    """The DeviceMesh of ``mesh`` at coordinate ``coord`` of ``axis`` (NOTE [Stage
    slices]); a mesh of one axis gives a one-rank slice named ``axis + "_stage"``."""
    key = (id(mesh), axis, coord)
    with _LOCK:
        found = _SLICES.get(key)
        if found is not None:
            return found
        d = mesh.axis_names.index(axis)
        rest = tuple(a for a in mesh.axis_names if a != axis)
        grid = mesh.device_mesh.mesh.select(d, coord)
        mine = mesh.coordinate()[d] == coord if not mesh.is_abstract else False
        if rest and mine:
            dm = mesh.device_mesh[rest]
        else:
            names = rest or (f"{axis}_stage",)
            grid = grid if rest else grid.reshape(1)
            dm = _torch.device_mesh_without_groups(mesh.device_type, grid, names, mesh.rank)
        _SLICES[key] = dm
        _SLICE_OF[id(dm)] = mesh
        _SLICE_INFO[id(dm)] = (axis, coord)
        return dm


def slice_of(device_mesh) -> tuple[Mesh, str, int] | None:
    """(mesh, axis, coordinate) if ``device_mesh`` is a stage slice (``stage_slice``)."""
    mesh = _SLICE_OF.get(id(device_mesh))
    if mesh is None or _SLICES.get((id(mesh), *_SLICE_INFO[id(device_mesh)])) is not device_mesh:
        return None
    return (mesh, *_SLICE_INFO[id(device_mesh)])
