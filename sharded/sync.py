"""Cross-rank agreement at compile time.

Every rank builds its own program. If one rank's program differs (another input
shape, a rank-dependent Python branch) or fails to build, the others would wait in
its first collective forever. Before the first run, ranks exchange a digest of their
collective sequence (or their error) over a gloo group with a bounded timeout
(``SHARDED_SYNC_TIMEOUT``, default 300 s) and all fail together with a readable diff.
"""

from __future__ import annotations

import pickle

import torch
import torch.distributed as dist


class RankMismatchError(RuntimeError):
    """Ranks built different programs, or some rank failed to build its program."""


def agree(mesh, api: str, outcome) -> None:
    """All ranks of ``mesh`` call this with either ``(digest, lines)`` or the exception
    their compile raised. Returns if every rank built the same program; otherwise
    raises on every rank (the failing rank re-raises its own exception)."""
    if mesh.size() == 1:
        if isinstance(outcome, BaseException):
            raise outcome
        return
    if isinstance(outcome, BaseException):
        payload = ("error", f"{type(outcome).__name__}: {outcome}")
    else:
        payload = ("ok",) + tuple(outcome)
    gathered = all_gather_objects(payload, mesh.sync_group())
    me = dist.get_rank()
    errors = {r: p[1] for r, p in enumerate(gathered) if p[0] == "error"}
    if errors:
        if isinstance(outcome, BaseException):
            raise outcome
        r = min(errors)
        raise RankMismatchError(
            f"{api}: rank {r} failed to build its program, so rank {me} stops too:\n"
            f"  {errors[r]}"
        )
    digests = {p[1] for p in gathered}
    if len(digests) == 1:
        return
    raise RankMismatchError(f"{api}: ranks built different programs.\n" + _diff(gathered))


def all_gather_objects(obj, group) -> list:
    """Every rank's picklable ``obj`` (in rank order), as pickled bytes in uint8 tensors.
    (torch's all_gather_object needs numpy, which torch does not install.)"""
    data = pickle.dumps(obj)
    n = dist.get_world_size(group)
    size = torch.tensor([len(data)], dtype=torch.int64)
    sizes = [torch.zeros_like(size) for _ in range(n)]
    dist.all_gather(sizes, size, group=group)
    longest = max(int(x) for x in sizes)
    buf = torch.zeros(longest, dtype=torch.uint8)
    buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    bufs = [torch.empty_like(buf) for _ in range(n)]
    dist.all_gather(bufs, buf, group=group)
    return [pickle.loads(bytes(b[: int(k)].tolist())) for b, k in zip(bufs, sizes)]


def _diff(gathered) -> str:
    ref_rank = 0
    ref = gathered[0][2]
    for r, p in enumerate(gathered):
        lines = p[2]
        if p[1] == gathered[ref_rank][1]:
            continue
        for i in range(max(len(ref), len(lines))):
            a = ref[i] if i < len(ref) else "<nothing>"
            b = lines[i] if i < len(lines) else "<nothing>"
            if a != b:
                return (
                    f"  rank {r} differs from rank {ref_rank} at item {i} of its program "
                    f"signature:\n    rank {ref_rank}: {a}\n    rank {r}: {b}\n"
                    f"  Every rank must call with the same global shapes, dtypes, specs "
                    f"and static arguments."
                )
    return "  (digests differ)"
