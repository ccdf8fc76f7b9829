"""sharded: JAX-style SPMD for PyTorch.

``pjit`` partitions a pure function over a named mesh, ``shard_map`` maps per-rank
code over its shards; both live here (``from sharded import pjit, shard_map``). The
``transforms`` package re-exports them under their original import path.
"""

from sharded import launch, precision, rules  # launch: the module, callable (NOTE in sharded/launch.py)
from sharded._pjit import UNSPECIFIED, pjit
from sharded._remat import checkpoint_name, remat, remat_policies
from sharded.pipelining import pipe_split, pipeline
from sharded._shard_map import shard_map
from sharded._tree import register_dataclass, register_pytree_node
from sharded.api import gather, shard, spec_of, visualize_sharding, with_sharding_constraint
from sharded.data import from_local_data
from sharded.errors import (CapturedStateError, CheckpointError, RankError, RankFailedError,
                            RankMismatchError, ShardingRuleError, TracingError)
from sharded.launch import RankPool
from sharded.lowered import Lowered
from sharded.mesh import Mesh
from sharded.spec import AUTO, P, PartitionSpec

__all__ = [
    "pjit", "shard_map", "UNSPECIFIED", "Lowered",
    "Mesh", "P", "PartitionSpec", "AUTO", "shard", "gather", "spec_of", "from_local_data",
    "with_sharding_constraint", "visualize_sharding", "launch", "RankPool",
    "register_dataclass", "register_pytree_node", "rules", "precision",
    "RankMismatchError", "RankFailedError", "TracingError", "CapturedStateError",
    "CheckpointError", "ShardingRuleError", "RankError",
    "remat", "checkpoint_name", "remat_policies",
    "pipeline", "pipe_split",
]
