"""Shared long-lived gloo rank pools for the multi-rank tests.

Spawning 4 ranks costs ~3 s, so each world size gets one pool per test session
(``sharded.RankPool``); a test costs only what its function does on the ranks.
Functions sent to the ranks must be module-level (importable by reference).
"""

from __future__ import annotations

import atexit

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
