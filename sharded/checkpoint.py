"""Sharded checkpoints that reshard on load, on torch.distributed.checkpoint (DCP).

``save(path, tree)``, called on every rank, writes a pytree of DTensors, plain
tensors and Python scalars (an int step, ``sharded.random.get_rng_state()``, a config
string) to the directory ``path``; each rank writes only the shards it holds, and a
value replicated over several ranks is written once. ``load(path, like)`` returns a
pytree shaped like ``like``: each DTensor leaf of ``like`` gives the mesh and layout
to load that value into, whatever mesh and layout it was saved from (2x2 -> 4,
4 -> 2x2, sharded -> replicated, or onto one process as a plain tensor).

```python
from sharded import checkpoint, random as srandom

state = {"params": params, "opt": opt_state, "step": step, "rng": srandom.get_rng_state()}
checkpoint.save("run/ckpt", state)                    # every rank; atomic
...
like = {"params": params, "opt": opt_state, "step": 0, "rng": srandom.get_rng_state()}
state = checkpoint.load("run/ckpt", like)             # any mesh, any layout
srandom.set_rng_state(state["rng"])
```

The format is DCP's (a directory with one ``.distcp`` file per rank and a
``.metadata`` file); keys are the pytree paths joined by dots
(``params.blocks.0.attn.wq``), as in a ``state_dict``, so torch's own DCP tools read
it too.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import shutil
import threading
import uuid
import warnings
from concurrent.futures import Future
from typing import Any

import optree
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.tensor import DTensor

from sharded import _tree
from sharded.errors import CheckpointError
from sharded.sync import all_gather_objects, exchange

__all__ = ["save", "load", "wait", "exists", "PendingSave", "CheckpointError"]

#: Leaf types saved as Python values (pickled by DCP, written once).
SCALAR_TYPES = (bool, int, float, complex, str, bytes, type(None))


# ---------------------------------------------------------------------------
# API
# ---------------------------------------------------------------------------


def save(path: str | os.PathLike, tree: Any, *, async_save: bool = False) -> PendingSave | None:
    """Write ``tree`` to the checkpoint directory ``path``. Call it on every rank.

    ``tree`` is a pytree (dicts, lists, tuples, namedtuples) whose leaves are
    DTensors, plain tensors or Python scalars (``int``, ``float``, ``bool``,
    ``complex``, ``str``, ``bytes``, ``None``). Each rank writes the shards of the
    DTensors it holds; a shard replicated over several ranks, a plain tensor and a
    scalar are written once. Plain tensors and scalars are taken as the same value on
    every rank (as ``pjit`` takes plain tensor inputs): ranks compare them, and their
    structure, shapes and layouts, before writing anything, and all fail together
    with the first difference otherwise.

    Nothing is half-written: the checkpoint is written to a temporary directory
    beside ``path`` and published by a rename once every rank has finished, replacing
    a checkpoint already at ``path``. A save that fails, or a rank killed mid-save,
    leaves the previous checkpoint at ``path`` loadable (NOTE [Atomic publish]).

    With ``async_save=True`` the state is copied (the copy is what gets written, so
    training may go on and change nothing in the checkpoint) and written in the
    background with DCP's ``async_save``; the call returns a ``PendingSave`` at
    once. The next ``save`` or ``load`` waits for it, or call ``wait()`` (e.g.
    before the program exits). ``path`` must be on a filesystem every rank sees.
    """
    wait()
    api = "sharded.checkpoint.save"
    path = _abspath(path, api)
    world, rank, sync, io = _world()
    try:
        leaves, keys, paths, _ = _flatten(tree, "tree", api)
        lines = _save_signature(leaves, keys, paths, api)
        problem = _check_target(path, api) if rank == 0 else None
        if problem is not None:
            raise ValueError(problem)
        outcome: Any = (_digest(lines), lines, uuid.uuid4().hex)
    except (TypeError, ValueError) as e:
        outcome = e
    token = _agree_to_save(outcome, world, rank, sync, api)
    tmp = _sibling(path, f"partial-{token}")
    if rank == 0:
        _remove_siblings(path, "partial-", keep=tmp)
    state_dict = dict(zip(keys, leaves))
    if not async_save:
        error = None
        try:
            _dcp_save(state_dict, tmp, io)
        except BaseException as e:  # noqa: BLE001 - reported on every rank by _publish
            error = e
        _publish(path, tmp, rank, io, error, api)
        return None
    staged = _stage(state_dict)
    future: Future = Future()
    pending = PendingSave(path, future)
    _PENDING.append(pending)
    try:
        dcp_future = _dcp_save(staged, tmp, io, use_async=True)
    except BaseException as e:  # noqa: BLE001
        dcp_future = Future()
        dcp_future.set_exception(e)
    thread = threading.Thread(
        target=_finish_async, args=(dcp_future, future, path, tmp, rank, io, api),
        name=f"sharded-checkpoint-{os.path.basename(path)}",
    )
    thread.start()
    return pending


def load(path: str | os.PathLike, like: Any, *, strict: bool = True) -> Any:
    """Read the checkpoint at ``path`` into a pytree shaped like ``like``. Call it on
    every rank.

    Each leaf of ``like`` says what to load there, by its key path:

    - a DTensor: the value comes back as a new DTensor with the same global shape,
      dtype, mesh and placements as this leaf (its values are not read), whatever
      mesh and layout it was saved with; each rank reads only the parts of the saved
      shards that overlap its own shard.
    - a plain tensor: the full value, as saved, on this leaf's device.
    - a Python scalar (any value; ``0`` or ``None`` will do): the value as saved.

    A tensor leaf's shape and dtype must match the saved ones. Keys of ``like`` that
    the checkpoint lacks, leaves of the wrong kind, and (with ``strict=True``)
    checkpoint keys that ``like`` lacks are errors that list every mismatch with its
    key path; ``strict=False`` loads a subset. ``like`` itself is not modified.
    """
    wait()
    api = "sharded.checkpoint.load"
    path = _abspath(path, api)
    world, rank, sync, io = _world()
    try:
        leaves, keys, paths, treedef = _flatten(like, "like", api)
        path = _resolve(path, api)
        metadata = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
        _check_like(leaves, keys, paths, metadata, strict, path, api)
        lines = [f"{p}: {_kind(x)}" for p, x in zip(paths, leaves)]
        outcome: Any = (_digest(lines), lines)
    except (TypeError, ValueError, OSError, CheckpointError) as e:
        outcome = e
    if world > 1:
        gathered = _agree(outcome, rank, sync, api, "load")
        for r, (digest, other) in enumerate(gathered):
            if digest != gathered[0][0]:
                raise CheckpointError(f"{api}: every rank must load with the same like; "
                                      + _first_difference(gathered[0][1], other, r, "like"))
    elif isinstance(outcome, BaseException):
        raise outcome
    state_dict = {k: _target(x, metadata[k]) for k, x in zip(keys, leaves)}
    try:
        _dcp_load(state_dict, path, io)
    except BaseException as e:  # noqa: BLE001
        raise CheckpointError(f"{api}({path!r}) failed while reading: {e}") from None
    return _tree.unflatten(treedef, [state_dict[k] for k in keys])


def wait() -> None:
    """Wait until every asynchronous save of this process is published; raise the
    first one's error, if any. Call it on every rank (each rank's save takes part in
    collectives until it is done)."""
    while _PENDING:
        _PENDING[0].result()


def exists(path: str | os.PathLike) -> bool:
    """Whether ``load(path, ...)`` finds a published checkpoint (including one left
    beside ``path`` by a crash in the middle of replacing it)."""
    try:
        _resolve(_abspath(path, "sharded.checkpoint.exists"), "sharded.checkpoint.exists")
        return True
    except CheckpointError:
        return False


class PendingSave:
    """An asynchronous save in progress, returned by ``save(..., async_save=True)``."""

    def __init__(self, path: str, future: Future):
        self.path = path
        self._future = future

    def done(self) -> bool:
        """Whether the checkpoint is published (or the save failed)."""
        return self._future.done()

    def result(self, timeout: float | None = None) -> None:
        """Wait until the checkpoint is published at ``path``; raise the save's error."""
        try:
            self._future.result(timeout)
        finally:
            if self._future.done() and self in _PENDING:
                _PENDING.remove(self)

    def __repr__(self) -> str:
        state = "done" if self.done() else "writing"
        return f"PendingSave({self.path!r}, {state})"


_PENDING: list[PendingSave] = []


# ---------------------------------------------------------------------------
# Keys: pytree paths <-> DCP keys
# ---------------------------------------------------------------------------


def _flatten(tree, name: str, api: str):
    """(leaves, DCP keys, readable paths, treedef) of ``tree``; errors on leaves that
    cannot be saved and on two paths that give the same key."""
    path_entries, leaves, treedef = optree.tree_flatten_with_path(tree, none_is_leaf=True)
    paths = _tree.leaf_paths(tree, name)
    keys = [".".join(str(e) for e in entries) for entries in path_entries]
    seen: dict[str, str] = {}
    for key, p, leaf in zip(keys, paths, leaves):
        if not isinstance(leaf, (torch.Tensor,) + SCALAR_TYPES):
            raise TypeError(
                f"{api}: {p} is a {type(leaf).__name__}; checkpoint leaves must be "
                f"DTensors, tensors or Python scalars (int, float, bool, complex, str, "
                f"bytes, None). Convert it (torch.as_tensor(...) for an array) or leave "
                f"it out of the tree."
            )
        if key in seen:
            raise ValueError(
                f"{api}: {seen[key]} and {p} both have the key {key!r} (keys are the "
                f"path entries joined by '.'); rename one of the dict keys."
            )
        seen[key] = p
    return leaves, keys, paths, treedef


def _kind(x) -> str:
    if isinstance(x, DTensor):
        return "dtensor"
    if isinstance(x, torch.Tensor):
        return "tensor"
    return "scalar"


# ---------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------


def _save_signature(leaves, keys, paths, api: str) -> list[str]:
    """One line per leaf: what every rank must agree on before anything is written.
    Plain tensors and scalars are written by one rank only, so their values are part
    of it (a digest); for DTensors, the global shape and the layout."""
    lines = []
    for key, p, x in zip(keys, paths, leaves):
        if isinstance(x, DTensor):
            partial = [str(pl) for pl in x.placements if pl.is_partial()]
            if partial:
                raise ValueError(
                    f"{api}: {p} holds a pending reduction ({partial[0]}), which a "
                    f"checkpoint cannot store; reduce it first "
                    f"(x.redistribute(placements=[Replicate()...]) or out_specs)."
                )
            mesh = x.device_mesh
            lines.append(
                f"{p}: DTensor {tuple(x.shape)} {x.dtype} on mesh "
                f"{tuple(mesh.mesh.shape)} {mesh.mesh_dim_names} as {tuple(x.placements)}"
            )
        elif isinstance(x, torch.Tensor):
            lines.append(f"{p}: tensor {tuple(x.shape)} {x.dtype}, values {_tensor_digest(x)}")
        else:
            r = repr(x)
            shown = r if len(r) <= 60 else f"{r[:50]}... (digest {_digest([r])[:12]})"
            lines.append(f"{p}: {type(x).__name__} {shown}")
    return lines


def _tensor_digest(x: torch.Tensor) -> str:
    data = x.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    return hashlib.sha1(data.numpy().tobytes()).hexdigest()[:12]


def _digest(lines: list[str]) -> str:
    return hashlib.sha1("\n".join(lines).encode()).hexdigest()


def _check_like(leaves, keys, paths, metadata, strict: bool, path: str, api: str) -> None:
    problems = []
    for key, p, x in zip(keys, paths, leaves):
        md = metadata.get(key)
        if md is None:
            problems.append(f"{p}: key {key!r} is not in the checkpoint")
        elif isinstance(md, BytesStorageMetadata):
            if isinstance(x, torch.Tensor):
                problems.append(f"{p}: a tensor here, but the checkpoint holds a Python "
                                f"value at {key!r}")
        elif isinstance(md, TensorStorageMetadata):
            if not isinstance(x, torch.Tensor):
                problems.append(f"{p}: a {type(x).__name__} here, but the checkpoint holds "
                                f"a tensor {tuple(md.size)} {md.properties.dtype} at {key!r}")
            elif tuple(x.shape) != tuple(md.size):
                problems.append(f"{p}: shape {tuple(x.shape)} here, but the checkpoint "
                                f"holds shape {tuple(md.size)} at {key!r}")
            elif x.dtype != md.properties.dtype:
                problems.append(f"{p}: dtype {x.dtype} here, but the checkpoint holds "
                                f"{md.properties.dtype} at {key!r} (load with that dtype "
                                f"and cast after)")
        else:
            problems.append(f"{p}: the checkpoint holds a {type(md).__name__} at {key!r}, "
                            f"which sharded.checkpoint does not read")
    if strict:
        extra = sorted(set(metadata) - set(keys))
        problems += [f"key {k!r} is in the checkpoint but not in like" for k in extra]
    if problems:
        shown = "\n  ".join(problems[:12])
        more = f"\n  ... and {len(problems) - 12} more" if len(problems) > 12 else ""
        fix = (" Pass strict=False to load a subset of the checkpoint." if strict and any(
            "not in like" in q for q in problems) else "")
        raise ValueError(
            f"{api}({path!r}): like does not match the checkpoint ({len(problems)} "
            f"problem{'s' if len(problems) > 1 else ''}):\n  {shown}{more}\n"
            f"like must have the checkpoint's keys, a tensor (DTensor or plain) of the "
            f"saved shape and dtype where a tensor was saved, and a Python value where "
            f"one was saved.{fix}"
        )


def _target(x, md):
    """The object DCP loads into for the like leaf ``x`` (fresh: like is not modified)."""
    if isinstance(x, DTensor):
        return torch.empty_like(x, requires_grad=False)
    if isinstance(x, torch.Tensor):
        return torch.empty(tuple(md.size), dtype=md.properties.dtype, device=x.device)
    return x


# ---------------------------------------------------------------------------
# Agreement between ranks
# ---------------------------------------------------------------------------


def _world():
    """(world size, rank, the agreement group, the I/O group); the groups are None
    without a process group.

    Both are gloo groups over the world with bounded timeouts, so that a rank that
    dies or never calls save/load makes the others fail instead of hang: ranks agree
    on what to do over one with ``SHARDED_SYNC_TIMEOUT`` seconds (default 300, as for
    pjit's agreement); DCP coordinates its writes and reads over the other, whose
    collectives wait for the slowest rank's I/O, with ``SHARDED_CHECKPOINT_TIMEOUT``
    seconds (default 1800). They are created the first time every rank calls save or
    load."""
    if not dist.is_available() or not dist.is_initialized():
        return 1, 0, None, None
    key = id(dist.group.WORLD)
    if key not in _GROUPS:
        _GROUPS[key] = tuple(
            dist.new_group(backend="gloo", timeout=datetime.timedelta(
                seconds=float(os.environ.get(var, default))))
            for var, default in (("SHARDED_SYNC_TIMEOUT", "300"),
                                 ("SHARDED_CHECKPOINT_TIMEOUT", "1800")))
    sync, io = _GROUPS[key]
    return dist.get_world_size(), dist.get_rank(), sync, io


_GROUPS: dict[int, tuple] = {}


def _agree_to_save(outcome, world: int, rank: int, group, api: str) -> str:
    """Raise on every rank unless every rank's tree has the same signature; return
    rank 0's token (the name of the temporary directory)."""
    if world == 1:
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome[2]
    gathered = _agree(outcome, rank, group, api, "save")
    ref = gathered[0]
    for r, (digest, lines, _) in enumerate(gathered):
        if digest != ref[0]:
            raise CheckpointError(f"{api}: every rank must save the same tree; "
                                  + _first_difference(ref[1], lines, r, "tree"))
    return ref[2]


def _agree(outcome, rank: int, group, api: str, what: str) -> list:
    """Every rank's outcome (rank order); raises CheckpointError on every rank when one
    failed before the save or load (``what``) or could not take part
    (sharded.sync.exchange)."""
    def unreachable(e):
        return CheckpointError(f"{api}: ranks could not agree before the {what} (a rank did "
                               f"not call {what}, or died): {e}")

    return [o for _, o in exchange(group, api, outcome, failed="", error=CheckpointError,
                                   comm_error=unreachable)]


def _first_difference(ref: list[str], lines: list[str], r: int, what: str) -> str:
    hint = (" Plain tensors and Python scalars are written once, so they must be equal "
            "on every rank; DTensors must have the same global shape, dtype and layout."
            if what == "tree" else "")
    for i in range(max(len(ref), len(lines))):
        a = ref[i] if i < len(ref) else "<nothing>"
        b = lines[i] if i < len(lines) else "<nothing>"
        if a != b:
            return (f"rank {r} differs from rank 0 at leaf {i}:\n    rank 0: {a}\n    "
                    f"rank {r}: {b}\n {hint}")
    return f"their {what}s differ."


# ---------------------------------------------------------------------------
# Writing and publishing
# ---------------------------------------------------------------------------

# NOTE [Atomic publish]
# DCP writes a checkpoint as files in one directory: each rank's shards, then the
# coordinator's ``.metadata``. Written in place, a failed save over an existing
# checkpoint would leave a mix of old and new files. So every save writes into a fresh
# sibling ``.<name>.partial-<token>`` (the token is rank 0's, shared when ranks agree
# on the tree). DCP returns on every rank only after the coordinator wrote the
# metadata, which it does only after every rank reported its writes, so when it
# returns on rank 0 the new checkpoint is complete. Rank 0 then publishes it: an old
# checkpoint at ``path`` is renamed to ``.<name>.old-<token>``, the new one renamed to
# ``path``, the directory synced, and the old one deleted; ranks then agree on the
# outcome. Renames within one directory are atomic, so ``path`` always holds a
# complete checkpoint, except between the two renames, when a crash leaves the
# previous one complete at ``.<name>.old-*``; ``load`` and ``exists`` look there when
# ``path`` is missing. A failed or killed save leaves only a partial directory, which
# the next save of the same path removes.


def _abspath(path, api: str) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{api}: path must be a str or os.PathLike; got {type(path).__name__}.")
    return os.path.abspath(os.fspath(path))


def _sibling(path: str, tag: str) -> str:
    parent, name = os.path.split(path)
    return os.path.join(parent, f".{name}.{tag}")


def _siblings(path: str, prefix: str) -> list[str]:
    parent, name = os.path.split(path)
    start = f".{name}.{prefix}"
    try:
        found = [os.path.join(parent, n) for n in os.listdir(parent) if n.startswith(start)]
    except FileNotFoundError:
        return []
    return sorted(found, key=os.path.getmtime)


def _remove_siblings(path: str, prefix: str, keep: str | None = None) -> None:
    for p in _siblings(path, prefix):
        if p != keep:
            shutil.rmtree(p, ignore_errors=True)


def _is_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, ".metadata"))


def _check_target(path: str, api: str) -> str | None:
    """Why ``path`` must not be replaced, or None."""
    if os.path.exists(path) and not (os.path.isdir(path) and _is_checkpoint(path)):
        what = "a directory" if os.path.isdir(path) else "a file"
        return (f"{api}: {path!r} exists and is {what} that is not a checkpoint; save "
                f"replaces only a checkpoint. Choose another path or remove it.")
    return None


def _resolve(path: str, api: str) -> str:
    """The directory holding the published checkpoint for ``path``."""
    if _is_checkpoint(path):
        return path
    if not os.path.exists(path):
        aside = [p for p in _siblings(path, "old-") if _is_checkpoint(p)]
        if aside:
            return aside[-1]
        raise CheckpointError(
            f"{api}: no checkpoint at {path!r}. Save one with "
            f"sharded.checkpoint.save({path!r}, tree) first (check the path).")
    raise CheckpointError(
        f"{api}: {path!r} is not a checkpoint (it has no .metadata file; a save that "
        f"was interrupted never publishes one).")


def _dcp_save(state_dict: dict, tmp: str, group, use_async: bool = False):
    writer = dcp.FileSystemWriter(tmp)
    with warnings.catch_warnings():
        # DCP warns when it runs without a process group; that is intended here.
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        if use_async:
            return dcp.async_save(state_dict, storage_writer=writer, process_group=group,
                                  no_dist=group is None, async_stager=_AlreadyStaged())
        return dcp.save(state_dict, storage_writer=writer, process_group=group,
                        no_dist=group is None)


def _dcp_load(state_dict: dict, path: str, group) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dcp.load(state_dict, storage_reader=dcp.FileSystemReader(path), process_group=group,
                 no_dist=group is None)


def _publish(path: str, tmp: str, rank: int, group, error: BaseException | None, api: str) -> None:
    """Rank 0 moves the finished checkpoint to ``path``; every rank returns once it is
    there, or raises (all of them) if the save failed anywhere."""
    if error is None and rank == 0:
        try:
            old = _sibling(path, "old-" + os.path.basename(tmp).rsplit("-", 1)[-1])
            if os.path.exists(path):
                os.rename(path, old)
            os.rename(tmp, path)
            _sync_dir(os.path.dirname(path))
            _remove_siblings(path, "old-")
        except OSError as e:
            error = e
    status = None if error is None else f"{type(error).__name__}: {error}"
    if group is not None:
        try:
            statuses = all_gather_objects(status, group)
        except RuntimeError as e:
            statuses = [f"RuntimeError: {e}"]
    else:
        statuses = [status]
    failed = {r: s for r, s in enumerate(statuses) if s is not None}
    if failed:
        r = min(failed)
        raise CheckpointError(
            f"{api}({path!r}) failed (rank {r}: {failed[r]}); the previous checkpoint at "
            f"this path, if any, is unchanged."
        ) from None


def _sync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------
# Asynchronous saves
# ---------------------------------------------------------------------------


def _stage(state_dict: dict) -> dict:
    """A copy of every tensor (DTensors rebuilt around copies of their local shards),
    so that what is written is the state at the time of the call."""
    out: dict = {}
    for k, x in state_dict.items():
        if isinstance(x, DTensor):
            out[k] = DTensor.from_local(
                x.to_local().detach().clone(), x.device_mesh, x.placements,
                run_check=False, shape=x.shape, stride=x.stride())
        elif isinstance(x, torch.Tensor):
            out[k] = x.detach().clone()
        else:
            out[k] = x
    return out


class _AlreadyStaged(AsyncStager):
    """DCP's staging step for a state dict that ``_stage`` already copied. (DCP's
    default stager deep-copies tensor storages, which fails on DTensors built by
    ``DTensor.from_local`` in torch 2.13: "invalid python storage".)"""

    _synchronize_after_execute = False

    def stage(self, state_dict):
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def _finish_async(dcp_future: Future, future: Future, path: str, tmp: str, rank: int, group,
                  api: str) -> None:
    error = None
    try:
        dcp_future.result()
    except BaseException as e:  # noqa: BLE001
        error = e
    try:
        _publish(path, tmp, rank, group, error, api)
    except BaseException as e:  # noqa: BLE001
        future.set_exception(e)
    else:
        future.set_result(None)
