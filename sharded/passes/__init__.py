"""Graph passes on per-rank (local) graphs."""

from sharded.passes.analysis import CollectiveCall, collectives, cost, fingerprint
from sharded.passes.bucketing import bucket_all_reduces, sink_waits
from sharded.passes.cleanup import cse, dce, remove_trivial_collectives

__all__ = ["CollectiveCall", "collectives", "cost", "fingerprint", "cse", "dce", "remove_trivial_collectives",
           "bucket_all_reduces", "sink_waits"]
