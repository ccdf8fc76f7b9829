"""Moved to ``sharded/rewrites/losses.py``: the loss rewrites are no sharding rules.
Kept for imports not yet moved (``sharded/lowering.py``); remove once none is left."""

from sharded.rewrites.losses import COUNTED_OPS, MEAN, MEAN_IS_GLOBAL, SUM, mean_losses_as_sums

__all__ = ["COUNTED_OPS", "MEAN", "MEAN_IS_GLOBAL", "SUM", "mean_losses_as_sums"]
