"""DTensorExpandMode: propagate the input layouts op by op with DTensor's sharding
rules (NOTE [Expansion by one make_fx over an Interpreter] in ``_expand.py``), with
one policy on top: where a pending reduction may travel.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from sharded import _torch
from sharded.modes._expand import SPECIAL_OPS, LayoutPolicy, expand, reduced
from sharded.modes._runner import check_compile
from sharded.modes.base import ParallelMode, Partitioned

aten = torch.ops.aten

# NOTE [Where a pending reduction may travel]
# A Partial (pending sum) value stays Partial through ops that are linear in it:
# views, sums, matmuls with a non-partial operand, scaling, add/sub of two partials,
# and the zero padding of slice/select backward. Anywhere else it is reduced to Replicate first. Left to its greedy
# cost model, DTensor instead reduce-scatters a partial that meets a replicated
# operand (e.g. the residual add after a row-parallel matmul) and all-gathers it again
# before the next matmul; on a 2x2 mesh a 2-layer GPT step took 95 collectives that way.
# A masked partial (the row-sharded embedding's _MaskPartial) never travels: its
# reduction applies the ids mask, valid only on the embedding's own output.
# A partial value read by more than one op is reduced once, where it is produced:
# otherwise each consumer reduces its own derived copy (AdamW reads a gradient twice,
# which cost two all-reduces per parameter). So is one whose only readers are ops
# that would reduce it anyway (not linear in it): reduced where it is produced, a
# gradient's reduction sits in backward order, where the passes bucket it and the rest
# of the backward overlaps it, instead of queuing up before the optimizer (a fused
# optimizer kernel reads each gradient once). Ops the expander handles itself (layout
# constraints) are left to reduce it their way (a reduce-scatter to a split layout).
_LINEAR_IN_PARTIAL = {
    aten.view, aten._unsafe_view, aten.reshape, aten.t, aten.transpose, aten.permute,
    aten.unsqueeze, aten.squeeze, aten.expand, aten.clone, aten.alias, aten.detach,
    aten.slice, aten.select, aten.split, aten.split_with_sizes, aten.neg, aten.sum,
    aten.mm, aten.bmm, aten.addmm, aten.mul, aten.div, aten.add, aten.sub,
    aten.slice_backward, aten.select_backward,   # zero padding: the gradient of x[:s], x[i]
}
_ADDITIVE = {aten.add, aten.sub}


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
        dts = [a for a in (*args, *kwargs.values()) if isinstance(a, DTensor)]
        partial = [a for a in dts if any(_torch.is_partial(p) for p in a.placements)]
        if not partial:
            return args, kwargs
        packet = target.overloadpacket
        masked = any(not _torch.is_plain_partial(p) for a in partial for p in a.placements
                     if _torch.is_partial(p))
        if packet in _LINEAR_IN_PARTIAL and not masked:
            if packet not in _ADDITIVE or len(partial) == len(dts):
                return args, kwargs
        return (tuple(reduce_pending(ex, a) for a in args),
                {k: reduce_pending(ex, v) for k, v in kwargs.items()})

    def after_node(self, ex, node, result):
        if isinstance(result, DTensor) and reduce_where_produced(node):
            return reduce_pending(ex, result)
        return result


def reduce_where_produced(node) -> bool:
    """Should a pending sum made by ``node`` be reduced at once (NOTE [Where a pending
    reduction may travel])? Yes when several ops read it, or when every reader is an
    op that would reduce it anyway."""
    if len(node.users) > 1:
        return True
    return bool(node.users) and all(
        u.op == "call_function" and isinstance(u.target, _torch.OpOverload)
        and u.target not in SPECIAL_OPS and u.target.overloadpacket not in _LINEAR_IN_PARTIAL
        for u in node.users)


def reduce_pending(ex, a):
    """``a`` with its pending reductions done (Partial -> Replicate)."""
    if isinstance(a, DTensor) and any(_torch.is_partial(p) for p in a.placements):
        return ex.redistribute(a, reduced(a.placements))
    return a
