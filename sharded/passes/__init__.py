"""Graph passes on per-rank (local) graphs.

Each pass edits ``gm.graph`` in place and returns ``gm`` without regenerating its
code (that costs ~0.1 s per pass on a GPT-2-sized graph): call ``gm.recompile()``
once after the last pass, as ``run_passes`` in sharded/modes/base.py does. Which passes
a mode runs, in which order, is its pass list there (NOTE [Pass order]). The loss
rewrite ``count_targets_early``, one of those passes, lives with the other loss
rewrites in sharded/rewrites/losses.py.
"""

from sharded.passes.analysis import CollectiveCall, collectives, cost, fingerprint, memory
from sharded.passes.bucketing import (DEFAULT_BUCKET_BYTES, bucket_all_gathers, bucket_all_reduces,
                                     bucket_reduce_scatters, bound_reduce_scatters, defer_chained_reductions,
                                     hoist_chained_reductions, hoist_reductions,
                                     prefetch_all_gathers, regather_distant_uses, sink_waits,
                                     unit_of_path)
from sharded.passes.inplace import reinplace_foreach
from sharded.passes.cleanup import (cse, dce, remove_identity_views, remove_trivial_collectives,
                                    unalias_outputs, untie_shape_reads)

__all__ = ["CollectiveCall", "collectives", "cost", "fingerprint", "memory", "cse", "dce", "remove_trivial_collectives", "remove_identity_views",
           "bucket_all_reduces", "bucket_reduce_scatters", "bucket_all_gathers",
           "prefetch_all_gathers", "sink_waits", "bound_reduce_scatters", "unit_of_path",
           "regather_distant_uses", "hoist_reductions", "defer_chained_reductions",
           "hoist_chained_reductions", "DEFAULT_BUCKET_BYTES", "reinplace_foreach",
           "unalias_outputs", "untie_shape_reads"]
