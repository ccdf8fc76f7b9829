"""sharded: JAX-style SPMD for PyTorch (the distributed model; no function transforms).

Function transforms (pjit, shard_map) live in the ``transforms`` package.
"""

from sharded import rules  # registers the project's sharding rules with DTensor
from sharded._tree import register_dataclass, register_pytree_node
from sharded.data import from_local_data
from sharded.api import gather, shard, spec_of, visualize_sharding, with_sharding_constraint
from sharded.launch import RankPool, launch
from sharded.mesh import Mesh
from sharded.spec import P, PartitionSpec

__all__ = [
    "Mesh", "P", "PartitionSpec", "shard", "gather", "spec_of", "from_local_data",
    "with_sharding_constraint", "visualize_sharding", "launch", "RankPool",
    "register_dataclass", "register_pytree_node", "rules",
]
