"""Feeding data: each rank's own piece of a batch made into one global value
(``from_local_data``), and the check that a plain tensor given as one global value
holds the same values on every rank (``value_digests``).

# NOTE [Per-rank data]
A plain tensor given to ``pjit``, ``shard_map`` or ``shard`` is one global value: each
rank takes its block of it (``local_slice``), with no communication. A data-parallel
user's loader (a ``DistributedSampler``, a sharded dataset) gives every rank a batch
of its *own*: taken as a global value, each rank would keep a slice of its own local
batch, and the program would train on the wrong data without a word. Two things close
that hole:

- ``from_local_data(local, spec, mesh)`` says what the pieces are: the global value
  whose block on each rank is that rank's piece (JAX's
  ``make_array_from_process_local_data``). Its global shape is the piece's shape times
  the mesh size of the axes that ``spec`` names on each dim; ranks that share a block
  (the "tp" ranks of one "dp" group) give the same piece. The result is a DTensor
  whose local tensor is the piece itself: a pjit whose in_specs ask for that layout
  takes it without communication.
- The values of plain tensors are checked by every pjit call and every eager
  shard_map call (not by ``shard``, which does not communicate). Each folds a digest of
  each plain tensor input (a CRC-32 of its bytes on CPU; on another device two
  weighted sums computed there and one 16-byte copy per tensor, which waits for the
  device; with its dtype and shape) into the token of the per-call agreement
  (sharded/sync.py, NOTE [Agreement on every call]): the same one all-reduce as
  before, so ranks whose plain inputs are equal pay only the hashing
  (benchmarks/bench_data_parallel.py measures it per step). Ranks whose values differ
  all raise ``RankMismatchError``, naming the input and pointing to
  ``from_local_data``, before any of them communicates. It runs on every call, so a
  loader that starts to hand out per-rank batches at step 1000 is caught at step
  1000. Tensors the function closes over are compared through the program's text
  (their digest is part of it: ``sharded/_fingerprint.py``, ``program_lines``).

What it does not check: that a DTensor's shards are consistent (a DTensor made with
``DTensor.from_local`` from per-rank values, claiming ``Replicate``); that is what
``from_local_data``'s own check (``check=True``) is for: it compares the pieces of
ranks that share a block, and every rank's piece shape, once per call.
"""

from __future__ import annotations

import functools
import zlib

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from sharded import _torch, _tree, sync
from sharded.mesh import Mesh, current_mesh
from sharded.spec import P, axes_of_dim, check_spec, to_placements

__all__ = ["from_local_data", "value_digest", "value_digests"]


# ---------------------------------------------------------------------------
# Digests of tensor values
# ---------------------------------------------------------------------------


def value_digest(x: torch.Tensor) -> int:
    """A digest of ``x``'s values, dtype and shape (a CRC-32 of its bytes on the CPU,
    two 64-bit weighted sums of them on another device, folded with the dtype and
    shape into 62 bits); equal on every rank when the tensors are equal, and different
    where they differ but for a collision (about 2**-32 for unrelated values; a CRC
    catches every change to one run of up to 32 bits). No communication."""
    return value_digests([x])[0]


def value_digests(xs: list[torch.Tensor]) -> list[int]:
    """``value_digest`` of each tensor, with one device-to-host copy in all for the
    tensors that are not on the CPU. Tensors wrapped by torch.func (grad, vmap) are
    digested as the tensor they wrap."""
    if not xs:
        return []
    with _torch.clear_functorch_stack():
        return _digests([_torch.functorch_base(x) for x in xs])


def _digests(xs: list[torch.Tensor]) -> list[int]:
    if any(isinstance(x, DTensor) for x in xs):
        raise TypeError("value_digest takes plain tensors; got a DTensor.")
    xs = [x.detach() for x in xs]
    out = [0] * len(xs)
    on_device = [i for i, x in enumerate(xs) if x.device.type != "cpu"]
    for i, x in enumerate(xs):
        if x.device.type == "cpu":
            out[i] = _fold(zlib.crc32(_bytes(x).numpy().data), x)
    if on_device:
        sums = torch.stack([_device_sum(xs[i]) for i in on_device]).cpu().tolist()
        for i, (a, b) in zip(on_device, sums):
            out[i] = _fold(sync.token(a, b), xs[i])
    return out


def _bytes(x: torch.Tensor) -> torch.Tensor:
    """``x``'s values as a flat uint8 tensor (views resolved, made contiguous)."""
    if x.is_conj():
        x = x.resolve_conj()
    if x.is_neg():
        x = x.resolve_neg()
    return x.contiguous().reshape(-1).view(torch.uint8)


_CHUNK = 1 << 20          # 8-byte words per step of the device digest (8 MiB)


def _device_sum(x: torch.Tensor, chunk: int = _CHUNK) -> torch.Tensor:
    """Two int64 weighted sums of ``x``'s bytes taken as 8-byte words, computed on its
    device ``chunk`` words at a time (the weights made from the word's index: nothing
    cached, a few chunk-sized temporaries). Integer sums wrap alike in any order: the
    same on every device and in every run."""
    b = _bytes(x)
    pad = (-b.numel()) % 8
    if pad:
        b = torch.cat([b, b.new_zeros(pad)])
    words = b.view(torch.int64)
    total = torch.zeros(2, dtype=torch.int64, device=words.device)
    for lo in range(0, words.numel(), chunk):
        w = words[lo:lo + chunk]
        i = torch.arange(lo, lo + w.numel(), dtype=torch.int64, device=w.device)
        total[0] += (w * (i * 0x1E3779B97F4A7C15 + 0x2545F4914F6CDD1D)).sum()
        total[1] += ((w ^ (w >> 29)) * (i * 0x27D4EB2F165667C5 + 0x165667B19E3779F9)).sum()
    return total


@functools.lru_cache(maxsize=None)
def _dtype_code(dtype: torch.dtype) -> int:
    return sync.token(dtype)


def _fold(h: int, x: torch.Tensor) -> int:
    """``h`` with ``x``'s dtype and shape folded in (62 bits; the hash of a tuple of
    ints is not salted: the same in every process)."""
    mixed = (h * 0x9E3779B97F4A7C15) ^ (hash(tuple(x.shape)) * 0xC2B2AE3D27D4EB4F) \
        ^ _dtype_code(x.dtype)
    return mixed & ((1 << 62) - 1)


def plain_value_lines(paths: list[str], digests: list[int]) -> list[str]:
    return [f"input {p}: a plain tensor with values {d:016x}" for p, d in zip(paths, digests)]


# ---------------------------------------------------------------------------
# from_local_data
# ---------------------------------------------------------------------------


def from_local_data(local, spec: P | None = None, mesh: Mesh | None = None, *, check: bool = True):
    """The global value whose block on each rank is that rank's ``local`` piece
    (JAX's ``make_array_from_process_local_data``), as a DTensor laid out by ``spec``.

    Use it for data that each rank loads on its own (a ``DataLoader`` with a
    ``DistributedSampler``, a sharded dataset)::

        batch = sharded.from_local_data(local_batch, P("dp"), mesh)
        params, loss = step(params, batch)          # in_specs: P("dp") for the batch

    - The global shape is the local shape times, on each dim, the mesh size of the
      axes ``spec`` names on it: a ``(4, 128)`` piece with ``P("dp")`` on a
      ``("dp", "tp")`` mesh of shape ``(2, 2)`` is the ``(8, 128)`` batch.
    - Ranks that share a block give the same piece: with ``P("dp")`` on that mesh,
      the two "tp" ranks of one "dp" group load the same rows.
    - ``local`` may be a pytree of tensors (a dict batch); ``spec`` is then a pytree
      prefix of it (default ``P()``: every rank holds the whole value). The result
      has ``local``'s structure, with DTensor leaves; non-tensor leaves pass through.
    - The piece is the result's local tensor (moved to the mesh's device type when it
      is on another): a pjit whose in_specs ask for ``spec`` takes it as it is, with
      no communication.
    - ``check=True`` (default) compares every rank's piece shape and dtype, and the
      values of ranks that share a block, with one small collective (a digest per
      piece); they raise ``ValueError`` on every rank where they differ (a last batch
      shorter on one rank: pass ``drop_last=True`` to the sampler or loader).
      ``check=False`` skips it: no communication at all.
    """
    mesh = current_mesh(mesh, "from_local_data")
    if not check:
        return _global_values(local, spec, mesh)[0]
    mesh.require_ranks("from_local_data")
    try:
        tree, pieces = _global_values(local, spec, mesh)
    except Exception as e:  # noqa: BLE001 - the other ranks wait in the check: tell them
        _check_pieces(e, mesh, "")
        raise
    structure = f"{_tree.flatten(local)[1]}, " + (
        ", ".join(f"{path} as {sp!r}" for path, sp, _ in pieces) or "no tensors")
    _check_pieces(pieces, mesh, structure)
    return tree


def _global_values(local, spec, mesh: Mesh):
    """(``local`` with each tensor leaf made its global DTensor, [(path, spec, piece)])."""
    leaves, treedef = _tree.flatten(local)
    paths = _tree.leaf_paths(local, "local")
    matched = _tree.broadcast_prefix(P() if spec is None else spec, local, "from_local_data spec")
    out: list = []
    pieces: list[tuple[str, P, torch.Tensor]] = []
    for leaf, lpath, (spath, sp) in zip(leaves, paths, matched):
        if not isinstance(leaf, torch.Tensor):
            out.append(leaf)
            continue
        if isinstance(leaf, DTensor):
            raise TypeError(
                f"from_local_data: {lpath} is already a DTensor (a global value); pass "
                f"this rank's plain tensor piece, or pass the DTensor to pjit as it is."
            )
        sp = P() if sp is None else sp
        if not isinstance(sp, P):
            raise TypeError(f"{spath}: expected a P, got {sp!r}.")
        where = f"{spath} (for {lpath})"
        if len(sp) > leaf.ndim:
            check_spec(sp, leaf.shape, mesh, where)          # (raises: too many entries)
        # the axis names and their order (a size-0 shape: every split divides it)
        check_spec(sp, [0] * leaf.ndim, mesh, where)
        gshape = [n * mesh.size(list(axes_of_dim(sp, d))) if axes_of_dim(sp, d) else n
                  for d, n in enumerate(leaf.shape)]
        piece = leaf if leaf.is_contiguous() else leaf.contiguous()
        pieces.append((lpath, sp, piece))
        out.append(DTensor.from_local(
            piece, mesh.device_mesh, to_placements(sp, mesh), run_check=False,
            shape=torch.Size(gshape), stride=_contiguous_strides(gshape)))
    return _tree.unflatten(treedef, out), pieces


def _contiguous_strides(shape) -> tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))


def _check_pieces(pieces, mesh: Mesh, structure: str) -> None:
    """Every rank's pytree, piece shapes and dtypes equal, and equal values where ranks
    share a block (``from_local_data``'s ``check``); one all-gather of a few bytes per
    piece over the agreement's group. ``pieces``: this rank's [(path, spec, piece)], or
    the exception that stopped it before the check (every rank then raises: the
    others never wait for it)."""
    group = sync.group_for(mesh)
    if group is None:
        return
    me = dist.get_rank()
    if isinstance(pieces, BaseException):
        payload: tuple = (me, "error", f"{type(pieces).__name__}: {pieces}")
    else:
        try:
            digests = value_digests([p for _, _, p in pieces])
        except Exception as e:  # noqa: BLE001 - the other ranks wait in the check
            _check_pieces(e, mesh, "")
            raise
        coord = mesh.coordinate()
        mine = [(tuple(p.shape), str(p.dtype).replace("torch.", ""), d,
                 tuple(c for c, a in zip(coord, mesh.axis_names) if a in sp.axes()))
                for (_, sp, p), d in zip(pieces, digests)]
        payload = (me, "ok", structure, mine)
    with sync.peer_failures("from_local_data"):
        gathered = sync.all_gather_objects(payload, group)
    failed = [g for g in gathered if g[1] == "error"]
    if failed:
        if isinstance(pieces, BaseException):
            return                                   # (the caller raises its own)
        r, _, err = failed[0]
        raise sync.RankFailedError(
            f"from_local_data: rank {r} failed before the check of the pieces, so rank {me} "
            f"stops too:\n  {err}", rank=r, error=err)
    r0, _, structure0, _ = gathered[0]
    for r, _, structure_r, _ in gathered[1:]:
        if structure_r != structure0:
            raise ValueError(
                f"from_local_data: rank {r0} and rank {r} gave pieces of different pytree "
                f"structures or specs:\n  rank {r0}: {structure0}\n  rank {r}: {structure_r}\n"
                f"Every rank must give the same structure and specs (with its own values).")
    for k, (lpath, sp, _) in enumerate(pieces):
        by_rank = [(g[0], g[3][k]) for g in gathered]
        r0, (shape0, dtype0, _, _) = by_rank[0]
        for r, (shape, dtype, _, _) in by_rank[1:]:
            if (shape, dtype) != (shape0, dtype0):
                raise ValueError(
                    f"from_local_data: the pieces of {lpath} differ across ranks: rank {r0} "
                    f"gave {dtype0}{list(shape0)}, rank {r} gave {dtype}{list(shape)}. Every "
                    f"rank must give a piece of the same shape and dtype (a last batch "
                    f"shorter on some ranks: pass drop_last=True to the DistributedSampler "
                    f"or DataLoader, or pad the batch)."
                )
        first: dict[tuple, tuple[int, int]] = {}
        for r, (_, _, d, block) in by_rank:
            if block in first and first[block][1] != d:
                shared = [a for a in mesh.axis_names if a not in sp.axes()]
                raise ValueError(
                    f"from_local_data: ranks {first[block][0]} and {r} share the block of "
                    f"{lpath} laid out as {sp!r} on {mesh!r} (they differ only on mesh "
                    f"axes {tuple(shared)}, which {sp!r} does not split), but gave "
                    f"different pieces. Ranks that share a block must load the same data: "
                    f"give the sampler num_replicas and rank from the axes the spec splits "
                    f"(e.g. mesh.coordinate on 'dp'), not from the global rank."
                )
            first.setdefault(block, (r, d))
