"""Function transforms over sharded programs: pjit and shard_map."""

from transforms._trace import TracingError
from transforms.lowered import Lowered
from transforms.pjit import UNSPECIFIED, pjit
from transforms.shard_map import shard_map

__all__ = ["pjit", "shard_map", "Lowered", "TracingError", "UNSPECIFIED"]
