"""Sharding rules the project registers with DTensor, and how users add their own.

``register_sharding(op)`` is DTensor's decorator (re-exported): the decorated
function takes the op's arguments (tensors replaced by their specs) and returns a
list of ``(output_placements, input_placements)`` pairs, each for one mesh axis, that
the op can run with; DTensor expands them over every axis of the mesh. Example::

    from torch.distributed.tensor import Replicate, Shard
    from sharded.rules import register_sharding

    @register_sharding(torch.ops.mylib.rmsnorm.default)
    def _(x, weight, eps):
        return [([Replicate()], [Replicate(), Replicate(), None]),
                ([Shard(0)], [Shard(0), Replicate(), None])]
"""

from torch.distributed.tensor.experimental import register_sharding

from sharded.rules import attention, rowwise  # noqa: F401  (register on import)

__all__ = ["register_sharding"]
