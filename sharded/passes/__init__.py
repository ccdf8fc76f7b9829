"""Graph passes on per-rank (local) graphs."""

from sharded.passes.analysis import CollectiveCall, collectives, cost, fingerprint
from sharded.passes.cleanup import cse, dce

__all__ = ["CollectiveCall", "collectives", "cost", "fingerprint", "cse", "dce"]
