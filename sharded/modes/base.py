"""The ParallelMode interface.

A mode turns the global graph (the single-device program, traced by make_fx and
functionalized) into the program one rank runs, in two steps:

- ``partition(graph, in_placements, out_specs, mesh)``: choose layouts for every
  value and expand the graph for THIS rank (local shapes, rank-dependent constants,
  collectives). Returns a ``Partitioned``.
- ``transform_and_compile(local_graph, mesh)``: the mode's pass list (``passes``,
  NOTE [Pass order]) on the local graph; ``runner(graph)`` gives what runs it each
  call: the graph, or inductor's code for it, as the mode's ``compile`` says
  (``False``, ``True`` or ``"auto"``, the default: NOTE [Runners] in
  ``sharded/modes/_runner.py``).

Modes are chosen per pjit call (``pjit(..., mode=...)``); the default is
``DTensorExpandMode()``.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from torch.distributed.tensor import Placement

from sharded.errors import ShardingRuleError
from sharded.precision import sink_casts_of_reductions
from sharded.modes._runner import make_runner
from sharded.passes import (bucket_all_reduces, cse, dce, defer_chained_reductions,
                            hoist_chained_reductions, hoist_reductions, reinplace_foreach,
                            remove_identity_views, remove_trivial_collectives, sink_waits,
                            untie_shape_reads)
from sharded.rewrites.losses import count_targets_early


@dataclass
class Partitioned:
    """A partitioned program: the local graph and the placements of its outputs.
    A mode that lays out inputs itself (DataParallelMode lays out state) returns the
    placements it chose in ``in_placements``; ``layouts`` is what ``Lowered.layouts``
    shows (the mode's report of the layouts it chose)."""

    graph: fx.GraphModule
    out_placements: list[tuple[Placement, ...]]
    in_placements: list[tuple[Placement, ...]] | None = None
    layouts: dict | None = None


# NOTE [Pass order]
# A mode's passes on its local graph are one tuple of named passes, ``passes``, run in
# order by ``run_passes``. Each pass states beside it the passes that must run before
# it where the list has them (``after``; ``check_order`` enforces it when a mode class
# is defined), and ``when`` the modes that run it (DataParallelMode's "shard" steps).
# Every mode starts with CLEANUP and ends with REINPLACE; the
# communication schedule between them is the mode's.

@dataclass(frozen=True)
class Pass:
    """One entry of a pass list: ``run(graph, mode) -> graph``."""

    name: str
    # (graph, the mode that declares the list: its own type, which reads its settings)
    run: Callable[[fx.GraphModule, Any], fx.GraphModule]
    after: tuple[str, ...] = ()           # passes that must come before it, where listed
    when: Callable[[Any], bool] | None = None    # None: every mode runs it


# what the expansion leaves: size-1 collectives, identity views, like-factories that
# wait for their input, dead and duplicate nodes
CLEANUP = (
    Pass("remove_trivial_collectives", lambda g, m: remove_trivial_collectives(g)),
    Pass("remove_identity_views", lambda g, m: remove_identity_views(g)),
    Pass("untie_shape_reads", lambda g, m: untie_shape_reads(g)),
    # drops what the three above left unread
    Pass("dce", lambda g, m: dce(g),
         after=("remove_trivial_collectives", "remove_identity_views", "untie_shape_reads")),
    Pass("cse", lambda g, m: cse(g), after=("dce",)),
)
# a loss's count of targets from the targets (sharded/rewrites/losses.py), then every
# reduction issued as soon as its input exists: the count's all-reduce halfway
# through the forward, each gradient's where it is produced (NOTE [Overlap])
EARLY_REDUCTIONS = (
    Pass("count_targets_early", lambda g, m: count_targets_early(g), after=("cse",)),
    Pass("hoist_reductions", lambda g, m: hoist_reductions(g), after=("count_targets_early",)),
    # mixed precision: a reduced gradient's cast to its master's dtype moves down to
    # its reader, so the reduction can join a bucket (sharded/precision.py)
    Pass("sink_casts_of_reductions", lambda g, m: sink_casts_of_reductions(g),
         after=("hoist_reductions",)),
)
# the optimizer's multi-tensor ops and all-reduces in place where nothing else reads
# their inputs (after the buckets: a bucket's all-reduce runs in its own flat copy)
REINPLACE = Pass("reinplace_foreach", lambda g, m: reinplace_foreach(g, fused=m.compile is not True),
                 after=("bucket_all_reduces", "sink_waits"))


def check_order(passes: Sequence[Pass], owner: str = "") -> None:
    """Raise if a pass comes before one it must follow (NOTE [Pass order]) or a name
    is listed twice."""
    seen: dict[str, int] = {}
    for i, p in enumerate(passes):
        if p.name in seen:
            raise ValueError(f"{owner} pass list: {p.name!r} is listed twice.")
        seen[p.name] = i
    for p in passes:
        late = [a for a in p.after if a in seen and seen[a] > seen[p.name]]
        if late:
            raise ValueError(f"{owner} pass list: {p.name!r} must come after {late}.")


def run_passes(graph: fx.GraphModule, passes: Sequence[Pass], mode: "ParallelMode",
               recompile: bool = True) -> fx.GraphModule:
    """``passes`` in order on ``graph`` (those whose ``when`` holds for ``mode``), then
    one lint and one recompile (the passes only edit ``graph.graph``; ``recompile=False``
    leaves the code generation to a caller that edits the graph further)."""
    for p in passes:
        if p.when is None or p.when(mode):
            graph = p.run(graph, mode)
    graph.graph.lint()      # a pass that moved a node before its input fails here
    if recompile:
        graph.recompile()
    return graph


class ParallelMode(abc.ABC):
    """Interface of a parallel mode (see the module docstring)."""

    name: str = "ParallelMode"
    compile: bool | str = "auto"      # NOTE [Runners]
    # the dtype pending gradient sums are reduced in where a cast to it is on their
    # way (NOTE [A pending sum through a cast] in _pending.py); None: the dtype
    # the backward produces them in
    reduce_dtype: torch.dtype | None = None
    # NOTE [Pass order]: cleanup, the loss's count and the reductions early, all-reduces
    # bucketed, waits sunk to the first use, then in place
    passes: tuple[Pass, ...] = (
        *CLEANUP,
        *EARLY_REDUCTIONS,
        # a sum over two axes of three: two all-reduces in sequence, each bucketed
        # (NOTE [Chained reductions])
        Pass("defer_chained_reductions", lambda g, m: defer_chained_reductions(g),
             after=("hoist_reductions",)),
        Pass("bucket_all_reduces", lambda g, m: bucket_all_reduces(g),
             after=("hoist_reductions", "defer_chained_reductions")),
        Pass("sink_waits", lambda g, m: sink_waits(g), after=("bucket_all_reduces",)),
        Pass("hoist_chained_reductions", lambda g, m: hoist_chained_reductions(g),
             after=("sink_waits",)),
        REINPLACE,
    )

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        check_order(cls.passes, cls.__name__)

    @abc.abstractmethod
    def partition(
        self,
        graph: fx.GraphModule,
        in_placements: Sequence[tuple[Placement, ...]],
        out_specs: Sequence,
        mesh,
    ) -> Partitioned:
        """Expand ``graph`` (placeholders = the global inputs, laid out by
        ``in_placements``; ``node.meta["sharded_path"]`` names each for messages) into
        this rank's graph. ``out_specs[i]`` is the P the i-th output must have, or
        None to keep the propagated layout."""

    def transform_and_compile(self, graph: fx.GraphModule, mesh) -> fx.GraphModule:
        """The mode's pass list on its local graph (NOTE [Pass order])."""
        return run_passes(graph, self.passes, self)

    def traced_function(self, fn: Callable) -> Callable:
        """The function the lowering traces for ``fn`` (flat tensors in, flat tensors
        out): ``fn`` itself, or ``fn`` under a policy that acts while it is traced
        (DataParallelMode's ``param_dtype``: NOTE [Casts at use inside the
        differentiated function] in sharded/precision.py)."""
        return fn

    def runner(self, graph: fx.GraphModule, name: str | None = None, mesh=None, state=None):
        """What runs the local graph each call: the graph itself, or inductor's code
        for it, as ``self.compile`` says (NOTE [Runners]). The graph stays the
        inspectable program (``Lowered``)."""
        return make_runner(graph, self.compile, name or self.name, mesh, state)

    def cache_key(self) -> tuple:
        """What distinguishes this mode's programs in pjit's cache."""
        return (type(self).__name__, self.compile)

    def __repr__(self):
        return f"{type(self).__name__}()"
