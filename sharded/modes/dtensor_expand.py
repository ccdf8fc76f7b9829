"""DTensorExpandMode: propagate the input layouts op by op with DTensor's sharding
rules (NOTE [Expansion by one recording over an Interpreter] in ``_expand.py``), with
one policy on top: where a pending reduction may travel.
"""

from __future__ import annotations

from torch.distributed.tensor import DTensor

from sharded import _torch
from sharded.modes._expand import LayoutPolicy, expand
from sharded.modes._pending import pending_divisor, reduced_by_readers, travels
from sharded.modes._runner import check_compile
from sharded.modes.base import ParallelMode, Partitioned
from sharded.spec import reduced

# NOTE [Where a pending reduction may travel] is in sharded/modes/_pending.py: the
# policy both modes apply.


class DTensorExpandMode(ParallelMode):
    """Propagate input placements through the program with DTensor's op strategies.

    A pending reduction (Partial) left on an output whose spec is unspecified is
    reduced to Replicate, so outputs always have a PartitionSpec.

    ``compile`` chooses what runs the local program (NOTE [Runners]): ``False`` the
    graph, ``True`` inductor's code from the first call (it fuses elementwise chains
    such as the counter-based RNG's, at a compile cost of seconds to a minute on
    CPU), ``"auto"`` (default) the graph first and inductor once a long run makes
    the compile pay.
    """

    name = "DTensorExpandMode"

    def __init__(self, *, compile: bool | str = "auto"):
        self.compile = check_compile(compile, "DTensorExpandMode")

    def __repr__(self):
        return f"DTensorExpandMode(compile={self.compile!r})"

    def partition(self, graph, in_placements, out_specs, mesh) -> Partitioned:
        return expand(graph, in_placements, out_specs, mesh, PendingSumPolicy(), self.name)


class PendingSumPolicy(LayoutPolicy):
    """NOTE [Where a pending reduction may travel]."""

    def before_op(self, ex, node, target, args, kwargs):
        if pending_divisor(target, args):
            args = (args[0], reduce_pending(ex, args[1]), *args[2:])
        dts = [a for a in (*args, *kwargs.values()) if isinstance(a, DTensor)]
        partial = [a for a in dts if any(_torch.is_partial(p) for p in a.placements)]
        if not partial:
            return args, kwargs
        if travels(target, args, kwargs, dts, partial):
            return args, kwargs
        return (tuple(reduce_pending(ex, a) for a in args),
                {k: reduce_pending(ex, v) for k, v in kwargs.items()})

    def after_node(self, ex, node, result):
        if isinstance(result, DTensor) and any(_torch.is_partial(p) for p in result.placements) \
                and reduced_by_readers(node, result):
            return reduce_pending(ex, result)
        return result


def reduce_pending(ex, a):
    """``a`` with its pending reductions done (Partial -> Replicate)."""
    if isinstance(a, DTensor) and any(_torch.is_partial(p) for p in a.placements):
        return ex.redistribute(a, reduced(a.placements))
    return a
