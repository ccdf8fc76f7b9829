"""pjit and shard_map under their original import path (``from transforms import
pjit``). They live in ``sharded`` (``from sharded import pjit, shard_map``), which a
user's own ``transforms.py`` cannot shadow; this package re-exports them."""

from sharded import UNSPECIFIED, Lowered, TracingError, pjit, shard_map

__all__ = ["pjit", "shard_map", "Lowered", "TracingError", "UNSPECIFIED"]
