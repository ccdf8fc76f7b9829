"""Function transforms over sharded programs: pjit (and, later, shard_map)."""

from transforms._trace import TracingError
from transforms.lowered import Lowered
from transforms.pjit import UNSPECIFIED, pjit

__all__ = ["pjit", "Lowered", "TracingError", "UNSPECIFIED"]
