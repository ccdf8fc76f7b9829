"""The ParallelMode interface.

A mode turns the global graph (the single-device program, traced by make_fx and
functionalized) into the program one rank runs, in two steps:

- ``partition(graph, in_placements, out_specs, mesh)``: choose layouts for every
  value and expand the graph for THIS rank (local shapes, rank-dependent constants,
  collectives). Returns a ``Partitioned``.
- ``transform_and_compile(local_graph, mesh)``: mode-specific passes on the local
  graph (at least dead-code elimination); ``runner(graph)`` gives what runs it each
  call: the graph, or inductor's code for it, as the mode's ``compile`` says
  (``False``, ``True`` or ``"auto"``, the default: NOTE [Runners] in
  ``sharded/modes/_runner.py``).

Modes are chosen per pjit call (``pjit(..., mode=...)``); the default is
``DTensorExpandMode()``.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Sequence

import torch.fx as fx
from torch.distributed.tensor import Placement

from sharded.errors import ShardingRuleError
from sharded.modes._runner import make_runner
from sharded.passes import (bucket_all_reduces, count_targets_early, cse, dce, hoist_reductions,
                            reinplace_foreach, remove_identity_views, remove_trivial_collectives,
                            sink_waits, untie_shape_reads)


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


class ParallelMode(abc.ABC):
    """Interface of a parallel mode (see the module docstring)."""

    name: str = "ParallelMode"
    compile: bool | str = "auto"      # NOTE [Runners]

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
        """Default passes: drop size-1 collectives and identity views, untie reads of
        shapes only, DCE, CSE, count a loss's targets early, bucket all-reduces, sink
        waits so collectives overlap with compute, and run the optimizer's
        multi-tensor ops and all-reduces in place where nothing else reads their
        inputs."""
        graph = cse(dce(untie_shape_reads(remove_identity_views(remove_trivial_collectives(graph)))))
        graph = hoist_reductions(count_targets_early(graph))
        graph = reinplace_foreach(sink_waits(bucket_all_reduces(graph)),
                                  fused=self.compile is not True)
        graph.graph.lint()      # a pass that moved a node before its input fails here
        graph.recompile()
        return graph

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
