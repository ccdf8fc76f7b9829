"""pjit: trace a pure function once per input signature, lower it for this rank, and
run the per-rank program on DTensors.

Each call: key (sharded/_arguments.py) -> cache (sharded/_cache.py) -> lower on a miss
(sharded/lowering.py) -> agree across ranks (sharded/sync.py) -> run (sharded/_program.py).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterable, Sequence

from sharded import _autograd, _torch, random as srandom, sync
from sharded._arguments import UNSPECIFIED, Arguments, Signature
from sharded._cache import COMPILE_LOCK, ProgramCache, Steady
from sharded._program import Forward
from sharded._trace import in_global_trace
from sharded.lowered import Lowered
from sharded.lowering import build_forward
from sharded.mesh import Mesh, current_mesh
from sharded.auto.cost import CostModel
from sharded.modes import DTensorExpandMode, ParallelMode

__all__ = ["pjit", "Pjit", "UNSPECIFIED"]


def pjit(
    fn: Callable | None = None,
    /,
    *,
    in_specs,
    out_specs=UNSPECIFIED,
    mesh: Mesh | None = None,
    mode: ParallelMode | None = None,
    static_argnums: int | Sequence[int] = (),
    static_argnames: str | Iterable[str] = (),
    donate_argnums: int | Sequence[int] = (),
    donate_argnames: str | Iterable[str] = (),
    memory_budget: int | None = None,
    cost_model=None,
):
    """Partition ``fn`` over ``mesh`` and return a jitted callable.

    - ``in_specs``: a pytree prefix of the arguments, with ``P`` or ``None``
      (replicated) leaves. A single ``P`` covers every argument; a tuple has one
      entry per positional argument (static ones left out), and tensors passed by
      keyword are replicated (``P()``); a dict names arguments by parameter name,
      positional or keyword, and an argument it does not name is replicated.
      DTensor inputs are redistributed if their layout differs; plain tensors are taken
      as the same global value on every rank and sliced locally.
    - ``out_specs``: a pytree prefix of the outputs; ``UNSPECIFIED`` keeps the layout
      that propagation gives (pending reductions are reduced to replicated).
    - ``static_argnums`` / ``static_argnames``: arguments passed as Python values
      (negative numbers count from the end, as in JAX); each distinct value traces a
      new program. A name and a position that denote the same parameter are the
      same static argument. Non-tensor leaves of the other args are static too.
    - ``donate_argnums`` / ``donate_argnames``: arguments whose DTensors the call
      consumes: the program may compute its outputs in their storage (a train step
      updates parameters and moments in place), and reading one afterwards raises.
      See docs/concepts.md, "Donation".
    - ``AUTO`` (``from sharded import AUTO``) in in_specs or out_specs, for any
      subtree: a solver chooses those layouts (docs/auto.md); ``.lower(...).in_specs``
      are the chosen specs and ``.lower(...).explain()`` says why. ``memory_budget``:
      bytes per rank the step's state (inputs and outputs) may take; ``cost_model``:
      a ``sharded.auto.CostModel`` (default: measured on the mesh at first use).

    A call whose tensor inputs require grad, or that runs under ``torch.func.grad``,
    ``vjp`` or ``jacrev``, is differentiable: its backward is a partitioned program
    traced with the forward (docs/concepts.md, "Gradients through pjit").

    Programs are cached per function (weakly: they go when the function goes) and
    configuration, so ``pjit(f, ...)(x)`` in a loop traces once, and per input
    signature (tree structure, shapes, dtypes, static values, mesh, mode, default
    dtype and autocast state). Before every run the ranks check that they call the
    same program (one small collective; docs/concepts.md, "Cross-rank agreement").
    """
    if fn is None:
        return functools.partial(
            pjit, in_specs=in_specs, out_specs=out_specs, mesh=mesh, mode=mode,
            static_argnums=static_argnums, static_argnames=static_argnames,
            donate_argnums=donate_argnums, donate_argnames=donate_argnames,
            memory_budget=memory_budget, cost_model=cost_model,
        )
    return Pjit(fn, in_specs, out_specs, mesh, mode, static_argnums, donate_argnums,
                static_argnames=static_argnames, donate_argnames=donate_argnames,
                memory_budget=memory_budget, cost_model=cost_model)


class Pjit:
    """The callable that pjit returns. ``.lower(*args)`` shows the program;
    ``trace_count`` counts the programs it has used (one per input signature)."""

    def __init__(self, fn, in_specs, out_specs, mesh, mode, static_argnums, donate_argnums=(), *,
                 static_argnames=(), donate_argnames=(), memory_budget=None, cost_model=None):
        if not callable(fn):
            raise TypeError(f"pjit expects a callable; got {type(fn).__name__} {fn!r:.80}.")
        self.fn = fn
        self.in_specs = in_specs
        self.out_specs = out_specs
        self.mesh = mesh
        self.mode = mode if mode is not None else DTensorExpandMode()
        if not isinstance(self.mode, ParallelMode):
            raise TypeError(f"pjit mode must be a sharded.modes.ParallelMode; got {self.mode!r}.")
        self.name = f"pjit({getattr(fn, '__name__', type(fn).__name__)})"
        self.arguments = Arguments(fn, self.name, in_specs, out_specs, static_argnums,
                                   static_argnames, donate_argnums, donate_argnames,
                                   memory_budget, cost_model)
        if self.arguments.auto and type(self.mode) is not DTensorExpandMode:
            raise ValueError(
                f"{self.name}: AUTO specs are decided by the layout solver, which lowers "
                f"through the default mode (DTensorExpandMode); {self.mode!r} chooses layouts "
                f"itself. Drop mode=..., or give every spec by hand.")
        try:
            config: tuple | None = ((type(self.mode), self.mode.cache_key()),
                                    *self.arguments.config())
        except TypeError:
            config = None
        self._cache = ProgramCache(fn, config)
        self._steady: Steady | None = None      # the last call's plan, to match the next
        # Name and docs only: a __wrapped__ attribute would let torch.func (and
        # inspect) call the raw function, bypassing this wrapper.
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)
        self.__doc__ = getattr(fn, "__doc__", None)

    @property
    def trace_count(self) -> int:
        """Programs this object has used (traced, or found in the cache when another
        pjit of the same function traced them): one per signature, so a count that
        grows with the calls means retracing."""
        return self._cache.trace_count

    # -- API ----------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        if in_global_trace():
            raise NotImplementedError(
                f"{self.name} was called inside another pjit-traced function; nested "
                f"pjit is not supported. Call the inner function directly (use "
                f"with_sharding_constraint for the layouts it imposed)."
            )
        try:
            mesh = current_mesh(self.mesh, self.name)
        except Exception as e:  # noqa: BLE001 - the other ranks may be waiting to agree
            sync.agree(None, self.name, e)
            raise
        entry, grad = None, None
        try:
            hit = self._steady_match(args, kwargs, mesh)
            if hit is not None:                    # NOTE [The steady-state call]
                entry, leaves, shards, plain = hit
                outcome = entry.steady_outcome(plain, leaves)
            else:
                self._auto_model(mesh)
                sig = self.arguments.signature(args, kwargs, mesh)
                entry = self._cache.lookup(sig, self.name) or self._compile(sig, args)
                leaves, grad, shards = sig.leaves, sig.grad, None
                outcome = entry.outcome(leaves)
                self._steady = Steady.arm(sig, entry, outcome, len(args), self._cache.table().programs,
                                          self._cache.key(sig))
        except Exception as e:  # noqa: BLE001 - every rank must hear about it
            outcome = e
            self._steady = None
        agreement = None
        if grad is not None:
            states = sync.agree(mesh, self.name, outcome)
        else:       # NOTE [The agreement overlaps the program]
            agreement = sync.agree_async(mesh, self.name, outcome)
            states = agreement.states
        if states is not None and entry is not None and entry.n_draws:
            srandom._settle(states, self.name)
        if grad is not None:
            return sync.run_guarded(self.name, self._run_grad, entry, leaves, mesh=mesh)
        return sync.run_guarded(self.name, entry.run, leaves, shards, agreement, mesh=mesh,
                                agreement=agreement)

    def lower(self, *args, **kwargs) -> Lowered:
        """Trace and partition for ``args`` without running (no communication, but for
        one case: a step with AUTO specs and no ``cost_model`` on a mesh of real ranks
        fetches the machine's cost model at its first lower or call in the process, a
        collective: lower it on every rank). For a differentiable call (inputs that
        require grad) ``.backward`` is the backward program's ``Lowered``."""
        mesh = current_mesh(self.mesh, self.name)
        self._auto_model(mesh)
        sig = self.arguments.signature(args, kwargs, mesh)
        entry = self._cache.lookup(sig, self.name, touch=False) or self._compile(sig, args)
        return Lowered(entry, self.name)

    def _auto_model(self, mesh) -> None:
        """An AUTO step's cost model, fetched before anything a rank can fail alone
        (the signature, the trace): at first use a collective (NOTE in
        sharded/auto/cost.py ``known_model``)."""
        if self.arguments.auto and self.arguments.cost_model is None and not mesh.is_abstract:
            CostModel.for_mesh(mesh)

    @staticmethod
    def _run_grad(entry: Forward, leaves: list) -> Any:
        """The differentiable path (NOTE [pjit under autograd])."""
        return entry.outputs(_autograd.apply(entry, entry.tensor_leaves(leaves)))

    def _steady_match(self, args, kwargs, mesh):
        """NOTE [The steady-state call]: (program, leaves, shards) or None."""
        if self._steady is None:
            return None
        try:
            return self._steady.match(args, kwargs, mesh)
        except Exception:  # noqa: BLE001 - an odd static value's ==: the full path says why
            return None

    def _compile(self, sig: Signature, args) -> Forward:
        with COMPILE_LOCK:
            entry = self._cache.lookup(sig, self.name)     # another thread may have compiled it
            if entry is not None:
                return entry
            key = self._cache.key(sig)

            def run_state(suffix: tuple):
                return self._cache.run_state(key + suffix)

            mark = _torch.fx_source_mark()
            keep: tuple = ()
            try:
                if _torch.functorch_level() > 0:     # called under torch.func.grad etc.
                    with _torch.clear_functorch_stack():
                        entry = build_forward(self.arguments, self.mode, sig, args, run_state)
                else:
                    entry = build_forward(self.arguments, self.mode, sig, args, run_state)
                keep = (entry.global_graph, entry.local_graph)
                if entry.backward is not None:
                    keep += (entry.backward.global_graph, entry.backward.local_graph)
            finally:
                _torch.release_fx_sources(mark, keep)   # NOTE [Bounded caches]
                _torch.bound_process_caches()
            self._cache.store(sig, entry)
            self._cache.count(entry)
            return entry
