"""Shared long-lived gloo rank pools for the multi-rank tests.

Spawning 4 ranks costs ~3 s, so each world size gets one pool per test session
(``sharded.RankPool``); a test costs only what its function does on the ranks.
Functions sent to the ranks must be module-level (importable by reference).
"""

from __future__ import annotations

import atexit
import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sharded.launch import RankPool

_POOLS: dict[int, RankPool] = {}


def pool(world_size: int) -> RankPool:
    if world_size not in _POOLS:
        _POOLS[world_size] = RankPool(world_size, backend="gloo", threads=1)
    return _POOLS[world_size]


def run(world_size: int, fn, *args, timeout: float = 300.0, **kwargs) -> list:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` pooled ranks; per-rank results."""
    return pool(world_size).run(fn, *args, timeout=timeout, **kwargs)


@atexit.register
def _close_all():
    for p in _POOLS.values():
        p.close()


class InPlaceReductions(TorchDispatchMode):
    """What the programs hand gloo to reduce in place (NOTE [All-reduces in place]):
    gloo reduces ``numel`` elements from the data pointer, so each such tensor must be
    contiguous and its whole storage (a bucket's piece is a view: gloo would write the
    neighbours' elements; an expanded tensor: past the storage's end)."""

    def __init__(self):
        super().__init__()
        self.seen, self.bad = 0, []

    def on_call(self, k: int):
        """The context for a pjit'd function's ``k``-th call (0-based): this watch
        from the second call on (the first traces and compiles under no mode)."""
        return self if k else contextlib.nullcontext()

    def check(self) -> None:
        assert not self.bad, f"in-place all-reduces of tensors that are not their storage: {self.bad}"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops._c10d_functional.all_reduce_.default:
            x = args[0]
            self.seen += 1
            if not (x.is_contiguous() and x.storage_offset() == 0
                    and x.untyped_storage().nbytes() == x.numel() * x.element_size()):
                self.bad.append((tuple(x.shape), x.storage_offset(), x.untyped_storage().nbytes()))
        return func(*args, **(kwargs or {}))
