"""The exceptions users catch, in one module (``from sharded.errors import ...``; the
top-level ``sharded`` package re-exports them).

- ``RankMismatchError``: ranks called a program with different signatures, built
  different programs, or passed plain tensors whose values differ (every rank raises
  it, before anything is communicated).
- ``RankFailedError``: another rank failed; this rank stops instead of waiting.
- ``TracingError``: the function cannot be traced into a static program (the message
  names the user's line).
- ``CapturedStateError``: the function changes a tensor or module state it does not
  take as an argument.
- ``CheckpointError``: a save or load failed on some rank (every rank raises it), or
  there is no checkpoint to load.
- ``ShardingRuleError``: an op of the program has no sharding rule for the layouts it
  receives (register one with ``sharded.rules.register_sharding``).
- ``RankError``: ``sharded.launch``'s ranks failed or died (raised in the launching
  process).

This module imports nothing of the package: every layer may raise these.
"""

from __future__ import annotations


class RankMismatchError(RuntimeError):
    """Ranks called a program with different signatures or built different programs."""


class RankFailedError(RuntimeError):
    """Another rank failed; ``rank`` is the failing rank (None if unknown), ``error``
    its exception as text and ``remote_traceback`` its traceback."""

    def __init__(self, message: str, *, rank: int | None = None, error: str = "",
                 remote_traceback: str = ""):
        super().__init__(message)
        self.rank = rank
        self.error = error
        self.remote_traceback = remote_traceback


class TracingError(RuntimeError):
    """The function cannot be traced into a static program."""


class CapturedStateError(RuntimeError):
    """The function changes a tensor or module state it does not take as an argument."""


class CheckpointError(RuntimeError):
    """A save or load failed on some rank (every rank raises it), or there is no
    checkpoint to load."""


class ShardingRuleError(NotImplementedError):
    """An op in the program has no sharding rule for the layouts it receives."""


class RankError(RuntimeError):
    """Ranks started by ``sharded.launch`` failed or died."""


__all__ = ["RankMismatchError", "RankFailedError", "TracingError", "CapturedStateError",
           "CheckpointError", "ShardingRuleError", "RankError"]
