"""Whether pjit is tracing a function into its global (single-device) graph.

``transforms`` sets the flag (``global_trace``); code in ``sharded`` that behaves
differently while traced (shard_map regions, the hooks of ``sharded.plans``) reads it
(``in_global_trace``), so ``sharded`` needs no import of ``transforms``.
"""

from __future__ import annotations

import threading

_STATE = threading.local()


def in_global_trace() -> bool:
    """True while pjit traces a function into its global (single-device) graph."""
    return getattr(_STATE, "depth", 0) > 0


class global_trace:
    """Context manager: the code inside runs under pjit's global trace."""

    def __enter__(self):
        _STATE.depth = getattr(_STATE, "depth", 0) + 1

    def __exit__(self, *exc):
        _STATE.depth -= 1
