"""Parallel modes: how a single-device graph becomes the program each rank runs."""

from sharded.modes.base import ParallelMode, Partitioned, ShardingRuleError
from sharded.modes.data_parallel import DataParallelMode
from sharded.modes.dtensor_expand import DTensorExpandMode

__all__ = ["ParallelMode", "Partitioned", "ShardingRuleError", "DTensorExpandMode",
           "DataParallelMode"]
