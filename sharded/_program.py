"""The program type: one traced and partitioned program (the forward, or the backward
of a differentiable call) with what runs it each call: its inputs' shards in
(``local_input``), its outputs wrapped out as DTensors, donation, and the random
seed and offsets appended (NOTE [Random numbers that do not depend on the mesh])."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor

from sharded import _torch, _tree, random as srandom, sync
from sharded.data import value_digests
from sharded.mesh import Mesh
from sharded._arguments import check_on_mesh
from sharded.spec import local_slice


def local_input(x: torch.Tensor, placements, mesh) -> torch.Tensor:
    """This rank's shard of an input as a program takes it. A DTensor: its local
    tensor, redistributed first to ``placements`` when they are given and differ (the
    caller has the ranks agree before: that communicates), detached, and contiguous
    (the program was traced on contiguous shards; views inside it assume so). A plain
    tensor (one global value on every rank): its block, sliced locally."""
    if isinstance(x, DTensor):
        if placements is not None and tuple(x.placements) != tuple(placements):
            x = x.redistribute(x.device_mesh, tuple(placements))
        t = _torch.local_tensor(x)
        if t.requires_grad:
            t = t.detach()
        return t if t.is_contiguous() else t.contiguous()
    return local_slice(x.detach() if x.requires_grad else x, placements, mesh)


@dataclass(eq=False, kw_only=True)
class Program:
    """What every program has: its global (single-device) and local (this rank's)
    graphs, what runs the local one, the digest the ranks compare before each run,
    and the inspection data ``Lowered`` shows."""

    global_graph: fx.GraphModule
    local_graph: fx.GraphModule
    runner: Any                          # runs the local graph (it, or a compiled form)
    mesh: Mesh
    name: str
    in_specs: list = field(default_factory=list)        # per tensor input (for Lowered)
    out_placements: list = field(default_factory=list)  # per tensor output (for Lowered)
    layouts: dict | None = None          # the mode's report of the layouts it chose
    n_draws: int = 0                     # random draws per call (counter-based RNG)
    rng_device: Any = None
    program: int = 0                     # digest the ranks compare before each run
    lines: Callable = list               # the digest's readable form (for a mismatch)
    times: dict = field(default_factory=dict)   # seconds: trace, partition, passes

    def random_state(self):
        """This call's random state for the agreement (None: the program draws none)."""
        return srandom._call_state() if self.n_draws else None

    def with_random_inputs(self, locals_: list) -> list:
        """``locals_`` with this call's random seed and offsets appended."""
        if self.n_draws:
            locals_.extend(srandom._take(self.n_draws, self.rng_device))
        return locals_


@dataclass(eq=False, kw_only=True)
class Forward(Program):
    """A pjit call's program (a cache entry). ``run`` is the per-call path: everything
    it needs is planned at compile time."""

    in_plan: list                        # per dynamic leaf: placements, or None (static)
    in_paths: list                       # per dynamic leaf: its path (args[0]['w'])
    out_treedef: Any
    out_plan: list                       # per output leaf: ("static", value) or ("dtensor", spec)
    # differentiable entries (NOTE [pjit under autograd] in sharded/_autograd.py)
    differentiable: bool = False
    n_tensor_out: int = 0                # the program's first outputs; residuals follow
    diff_out: list = field(default_factory=list)   # per tensor output: requires grad
    grad_in: list = field(default_factory=list)    # tensor inputs that get a gradient
    backward: "Backward | None" = None
    # donation (NOTE [Donation])
    donated: list = field(default_factory=list)    # leaf indices of donated tensors
    donated_local: list = field(default_factory=list)  # ... their program input index
    donated_msgs: list = field(default_factory=list)
    reused: dict = field(default_factory=dict)     # donated input path -> output path
    auto: dict | None = None             # AUTO specs: the solver's report (docs/auto.md)
    auto_specs: tuple | None = None      # ... (in_specs, out_specs) with AUTO decided

    def __post_init__(self):
        # derived once, read per call: the tensor leaves' placements and the tensor
        # outputs' DTensorSpecs
        self.tensor_plan = [pl for pl in self.in_plan if pl is not None]
        self.out_dtensor_specs = [v for kind, v in self.out_plan if kind != "static"]

    def steady_outcome(self, plain: list[int], leaves: list) -> sync.Outcome:
        """``outcome`` for inputs already in the planned layouts; ``plain``: the
        indices of the leaves that are plain tensors (their values are checked: NOTE
        [Per-rank data] in sharded/data.py)."""
        return sync.Outcome(self.program, self.lines,
                            self.random_state(),
                            self._values(plain, leaves) if plain else ())

    def _values(self, plain: list[int], leaves: list) -> tuple:
        """(path, value digest) of the plain tensor leaves at ``plain``."""
        digests = value_digests([leaves[i] for i in plain])
        return tuple((self.in_paths[i], d) for i, d in zip(plain, digests))

    def outcome(self, leaves: list) -> sync.Outcome:
        """What this call brings to the cross-rank agreement (no communication):
        checks DTensor inputs and folds in those that will be redistributed."""
        moves = []
        if self.differentiable:           # torch.func-wrapped inputs: look at what they wrap
            leaves = [_torch.functorch_base(x) if isinstance(x, torch.Tensor) else x for x in leaves]
        plain = [i for i, (leaf, pl) in enumerate(zip(leaves, self.in_plan))
                 if pl is not None and isinstance(leaf, torch.Tensor) and not isinstance(leaf, DTensor)]
        for i, (leaf, pl) in enumerate(zip(leaves, self.in_plan)):
            if pl is None or not isinstance(leaf, DTensor):
                continue
            why = _torch.donated_message(leaf)
            if why is not None:
                raise RuntimeError(f"{self.name}: {self.in_paths[i]} cannot be used: {why}.")
            check_on_mesh(leaf, self.mesh, self.in_paths[i], self.name)
            if leaf.placements != pl:
                moves.append((self.in_paths[i], tuple(leaf.placements)))
        if not moves:
            return self.steady_outcome(plain, leaves)
        program = sync.token(self.program, moves)

        def lines():
            return self.lines() + [f"input {p}: a DTensor laid out as {pl}, redistributed "
                                   f"before the program" for p, pl in moves]

        return sync.Outcome(program, lines, self.random_state(),
                            self._values(plain, leaves) if plain else ())

    def _locals(self, leaves: list, plan: list, agreement: sync.Agreement | None,
                tensors_only: bool = False) -> list:
        """This rank's input tensors for the program (``plan``: per leaf, its
        placements, or None for a static leaf)."""
        locals_ = []
        for leaf, pl in zip(leaves, plan):
            if pl is None:
                continue
            if isinstance(leaf, DTensor) and leaf.placements != pl:
                sync.agreed(agreement)   # (redistributing communicates: the ranks agree first)
            locals_.append(local_input(leaf, pl, self.mesh))
        return self._complete(locals_, agreement, leaves, tensors_only)

    def _complete(self, locals_: list, agreement: sync.Agreement | None, leaves: list,
                  tensors_only: bool = False) -> list:
        """The inputs' shards, with donated inputs given storage of their own, this
        call's random seed and offsets appended, and its agreement last (the program
        checks it: NOTE [The agreement overlaps the program]). ``leaves``: the
        dynamic leaves, or (``tensors_only``) the tensor inputs."""
        if self.donated:
            _separate_donated(locals_, self.donated_local)
            for i, k in zip(self.donated, self.donated_local):
                leaf = _torch.functorch_base(leaves[k if tensors_only else i])
                if not isinstance(leaf, DTensor):
                    # a plain input stays the caller's (NOTE [Donation]): its shard can
                    # be the caller's own storage, which the program would write
                    locals_[k] = locals_[k].clone()
        self.with_random_inputs(locals_).append(agreement)
        return locals_

    def run(self, leaves: list, shards: list | None = None,
            agreement: sync.Agreement | None = None) -> Any:
        """``shards``: the tensor inputs' local shards when the caller already took
        them (NOTE [The steady-state call]); ``agreement``: the call's, not yet
        checked."""
        locals_ = self._locals(leaves, self.in_plan, agreement) if shards is None \
            else self._complete(shards, agreement, leaves)
        if self.donated:
            try:
                outs = iter(self.runner(*locals_))
            except BaseException:
                # stopped by the agreement before writing anything (NOTE [The agreement
                # overlaps the program]): the donated inputs are still the caller's
                if agreement is None or not agreement.failed:
                    self._consume(leaves)
                raise
            self._consume(leaves)
        else:
            outs = iter(self.runner(*locals_))
        return self.outputs(map(_torch.make_dtensor, outs, self.out_dtensor_specs))

    # -- donation (NOTE [Donation]) ------------------------------------------------------
    def _consume(self, leaves: list, tensors_only: bool = False) -> None:
        """After a call: every donated DTensor raises when used. ``leaves``: all the
        dynamic leaves, or (``tensors_only``) the tensor inputs."""
        for i, k, msg in zip(self.donated, self.donated_local, self.donated_msgs):
            leaf = _torch.functorch_base(leaves[k if tensors_only else i])
            if isinstance(leaf, DTensor) and _torch.donated_message(leaf) is None:
                _torch.mark_donated(leaf, msg)

    # -- the differentiable path (NOTE [pjit under autograd]) ------------------------
    def tensor_leaves(self, leaves: list) -> list:
        """The tensor inputs among the dynamic leaves."""
        return [leaf for leaf, pl in zip(leaves, self.in_plan) if pl is not None]

    def outputs(self, tensors) -> Any:
        """The call's result: the output tree with ``tensors`` (the tensor outputs, in
        order) in their places among the static leaves."""
        outs = iter(tensors)
        flat = [v if kind == "static" else next(outs) for kind, v in self.out_plan]
        return _tree.unflatten(self.out_treedef, flat)

    def forward(self, tensors: list) -> tuple[list, list]:
        """The forward program on the tensor inputs: (output DTensors, residuals)."""
        locals_ = self._locals(tensors, self.tensor_plan, None, tensors_only=True)  # (agreed, blocking)
        if self.donated:
            try:
                outs = self.runner(*locals_)
            finally:
                self._consume(tensors, tensors_only=True)
        else:
            outs = self.runner(*locals_)
        n = self.n_tensor_out
        return ([_torch.make_dtensor(o, spec) for o, spec in zip(outs[:n], self.out_dtensor_specs)],
                list(outs[n:]))



@dataclass(eq=False, kw_only=True)
class Backward(Program):
    """The backward program of a differentiable call (NOTE [pjit under autograd] in
    sharded/_autograd.py): residuals and cotangents in, gradients out."""

    res_moves: list            # per residual: None, or (src spec, dst placements) to redistribute
    tan_specs: list            # per cotangent input: the DTensorSpec it must arrive as
    grad_specs: list           # per gradient output: its DTensorSpec

    def outcome(self, cotangents) -> sync.Outcome:
        moves = []
        for k, (g, spec) in enumerate(zip(cotangents, self.tan_specs)):
            check_on_mesh(g, self.mesh, f"the cotangent of output {k}", self.name)
            if isinstance(g, DTensor) and tuple(g.placements) != tuple(spec.placements):
                moves.append((k, tuple(g.placements)))
        rng = self.random_state()
        # a plain cotangent is one global value too (NOTE [Per-rank data])
        bases = [_torch.functorch_base(g) if isinstance(g, torch.Tensor) else None
                 for g in cotangents]
        plain = [k for k, g in enumerate(bases) if g is not None and not isinstance(g, DTensor)]
        values = tuple(zip([f"the cotangent of output {k}" for k in plain],
                           value_digests([cotangents[k] for k in plain])))
        if not moves:
            return sync.Outcome(self.program, self.lines, rng, values)

        def lines():
            return self.lines() + [f"cotangent {k}: a DTensor laid out as {pl}, redistributed "
                                   f"before the backward" for k, pl in moves]

        return sync.Outcome(sync.token(self.program, moves), lines, rng, values)

    def run(self, residuals, cotangents) -> list:
        locals_ = []
        for r, move in zip(residuals, self.res_moves):
            if move is not None:           # a residual's layout the backward takes otherwise
                src, dst = move
                r = local_input(_torch.make_dtensor(r, src), dst, self.mesh)
            locals_.append(r if r.is_contiguous() else r.contiguous())
        for g, spec in zip(cotangents, self.tan_specs):
            if g is None:
                g = torch.zeros(spec.shape, dtype=spec.tensor_meta.dtype)
            locals_.append(local_input(g, spec.placements, self.mesh))
        return list(self.runner(*self.with_random_inputs(locals_)))


# NOTE [Donation]
# ``donate_argnums``/``donate_argnames`` name arguments whose DTensors the call
# consumes, as in JAX: the program may compute its outputs in their storage. pjit
# marks the donated inputs of the per-rank program (``meta[META_DONATED]``) before
# the passes, and ``reinplace_foreach`` (NOTE [Writing into donated inputs] in
# sharded/passes/inplace.py) turns the update chains that end in an output of the same
# shape, dtype and strides into in-place ops on the donated storage: a train step
# updates its parameters and moments in place, and the outputs share storage with
# the donated inputs (``Lowered.donated`` lists which). After the call, each donated
# DTensor's local tensor is replaced by one whose every op raises "args[0]['w'] was
# donated to pjit(step); use the returned value", so a stale read is an error, not
# old (or overwritten) values; so is passing it to pjit again. Every donated DTensor
# is consumed, whether or not its storage could be reused (a warning at compile time
# names those that could not). Plain tensors are never written or consumed: a plain
# input is the same value on every rank, sliced locally, and stays the caller's (a
# donated one's shard is copied before the run, since it may be the caller's storage). A
# donated shard that shares memory with another input of the same call is copied
# first (the program would overwrite what the other input reads).


def _separate_donated(locals_: list, donated: list[int]) -> None:
    """Copy each donated input that overlaps another input's memory (NOTE [Donation])."""
    spans: dict = {}
    for k, t in enumerate(locals_):
        if t.numel():
            start = t.storage_offset() * t.element_size()
            spans.setdefault(t.untyped_storage().data_ptr(), []).append(
                (k, start, start + t.numel() * t.element_size()))
    for k in donated:
        t = locals_[k]
        if not t.numel():
            continue
        start = t.storage_offset() * t.element_size()
        end = start + t.numel() * t.element_size()
        if any(j != k and a < end and start < b
               for j, a, b in spans.get(t.untyped_storage().data_ptr(), ())):
            locals_[k] = t.clone()

