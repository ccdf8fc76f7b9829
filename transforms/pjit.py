"""pjit: trace a pure function once per input signature, partition it for this rank,
and run the per-rank program on DTensors.

Pipeline (one direction): key -> cache -> check -> trace -> partition -> passes ->
agree -> run.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import functools
import inspect
import operator
import os
import re
import threading
import time
import types
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor, Replicate, Shard

from sharded import _torch, _tree, random as srandom, sync
from sharded.data import value_digests
from sharded.mesh import Mesh, current_mesh
from sharded.modes import DTensorExpandMode, ParallelMode
from sharded.modes._runner import RunState
from sharded.passes import fingerprint, unalias_outputs
from sharded.random.rewrite import rewrite_random_ops
from sharded.rules.losses import mean_losses_as_sums
from sharded.spec import P, check_spec, from_placements, local_slice, to_placements
from transforms import _autograd
from transforms._trace import in_global_trace, mutated_inputs, trace_global
from transforms.lowered import Lowered


class _Unspecified:
    def __repr__(self):
        return "UNSPECIFIED"


UNSPECIFIED = _Unspecified()


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
        )
    return Pjit(fn, in_specs, out_specs, mesh, mode, static_argnums, donate_argnums,
                static_argnames=static_argnames, donate_argnames=donate_argnames)


# ---------------------------------------------------------------------------
# The program cache
# ---------------------------------------------------------------------------

# NOTE [The program cache is keyed on the function]
# JAX caches on the function, not on the object jit returns: ``pjit(f, ...)(x)`` in a
# loop must trace once. Programs live in a table keyed weakly on the function (for a
# bound method, on its object, with the function in the key), so they go when the
# function goes; under it, by the pjit configuration (in_specs and out_specs as
# hashable trees, mode, static_argnums) and the call's signature, in an LRU of
# SHARDED_CACHE_SIZE (default 64) programs per function, so 1,000 shapes do not grow
# memory without bound. A function that cannot be weakly referenced or hashed, or a
# configuration that cannot be hashed, falls back to a cache on the pjit object.
# Lookups and inserts take a lock; compiles take another (tracing swaps module-level
# state in torch), so two threads never trace at once.

CACHE_SIZE = int(os.environ.get("SHARDED_CACHE_SIZE", "64"))
_PROGRAMS: "weakref.WeakKeyDictionary[Any, collections.OrderedDict]" = weakref.WeakKeyDictionary()
# Per function, per program key: its runner's RunState (NOTE [Runners]), which outlives
# the cache entry: a rank that evicts a program and rebuilds it keeps its call count,
# so the ranks' "compile now?" questions stay at the same calls. Bounded (oldest out).
_RUN_STATES: "weakref.WeakKeyDictionary[Any, collections.OrderedDict]" = weakref.WeakKeyDictionary()
_RUN_STATES_SIZE = 4096
_CACHE_LOCK = threading.RLock()
_COMPILE_LOCK = threading.RLock()


def _anchor(fn) -> tuple | None:
    """(object to key weakly, extra key part) for ``fn``; None if it cannot be."""
    anchor, sub = (fn.__self__, fn.__func__) if inspect.ismethod(fn) else (fn, None)
    try:
        weakref.ref(anchor)
        hash(anchor)
    except TypeError:
        return None
    return anchor, sub


def _hashable_tree(tree):
    leaves, treedef = _tree.flatten(tree)
    key = (treedef, tuple(leaves))
    hash(key)
    return key


@dataclass
class _Signature:
    mesh: Mesh
    leaves: list                 # flat leaves of the dynamic args (then dynamic kwargs)
    treedef: Any                 # of the dynamic args, or of (args, kwargs) with keywords
    static_args: tuple
    static_argnums: tuple        # normalized for this call
    key: tuple
    ambient: tuple = ()
    static_kwargs: dict | None = None   # None: called without keyword arguments
    grad: tuple | None = None    # per tensor leaf: requires grad (None: the no-grad path)


@dataclass(eq=False)
class Compiled:
    """One traced and partitioned program (a cache entry). ``run`` is the per-call
    path: everything it needs is planned at compile time."""

    global_graph: fx.GraphModule
    local_graph: fx.GraphModule
    runner: Any                          # runs the local graph (it, or a compiled form)
    mesh: Mesh
    name: str
    in_plan: list                        # per dynamic leaf: placements, or None (static)
    in_paths: list                       # per dynamic leaf: its path (args[0]['w'])
    in_specs: list[P]                    # per tensor input (for Lowered)
    out_treedef: Any
    out_plan: list                       # per output leaf: ("static", value) or ("dtensor", spec)
    out_placements: list                 # per tensor output (for Lowered)
    layouts: dict | None = None          # the mode's report of the layouts it chose
    n_draws: int = 0                     # random draws per call (counter-based RNG)
    rng_device: Any = None
    program: int = 0                     # digest the ranks compare before each run
    lines: Callable = list               # the digest's readable form (for a mismatch)
    times: dict = field(default_factory=dict)   # seconds: trace, partition, passes
    # differentiable entries (NOTE [pjit under autograd] in transforms/_autograd.py)
    differentiable: bool = False
    n_tensor_out: int = 0                # the program's first outputs; residuals follow
    diff_out: list = dataclasses.field(default_factory=list)   # per tensor output: requires grad
    grad_in: list = dataclasses.field(default_factory=list)    # tensor inputs that get a gradient
    backward: Any = None                 # _autograd.Backward, or None
    # donation (NOTE [Donation])
    donated: list = dataclasses.field(default_factory=list)    # leaf indices of donated tensors
    donated_local: list = dataclasses.field(default_factory=list)  # ... their program input index
    donated_msgs: list = dataclasses.field(default_factory=list)
    reused: dict = dataclasses.field(default_factory=dict)     # donated input path -> output path

    def steady_outcome(self, plain: list[int], leaves: list) -> sync.Outcome:
        """``outcome`` for inputs already in the planned layouts; ``plain``: the
        indices of the leaves that are plain tensors (their values are checked: NOTE
        [Per-rank data] in sharded/data.py)."""
        return sync.Outcome(self.program, self.lines,
                            srandom._call_state() if self.n_draws else None,
                            self._values(plain, leaves) if plain else ())

    def _values(self, plain: list[int], leaves: list) -> tuple:
        """(path, value digest) of the plain tensor leaves at ``plain``."""
        digests = value_digests([leaves[i] for i in plain])
        return tuple((self.in_paths[i], d) for i, d in zip(plain, digests))

    def outcome(self, leaves: list) -> sync.Outcome:
        """What this call brings to the cross-rank agreement (no communication):
        checks DTensor inputs and folds in those that will be redistributed."""
        dm = self.mesh.device_mesh
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
            if leaf.device_mesh is not dm and leaf.device_mesh != dm:
                raise ValueError(
                    f"{self.name}: {self.in_paths[i]} is a DTensor on {leaf.device_mesh}, not "
                    f"on the pjit mesh {self.mesh}; gather it and shard it onto this mesh."
                )
            if leaf.placements != pl:
                moves.append((self.in_paths[i], tuple(leaf.placements)))
        if not moves:
            return self.steady_outcome(plain, leaves)
        program = sync.token(self.program, moves)

        def lines():
            return self.lines() + [f"input {p}: a DTensor laid out as {pl}, redistributed "
                                   f"before the program" for p, pl in moves]

        return sync.Outcome(program, lines, srandom._call_state() if self.n_draws else None,
                            self._values(plain, leaves) if plain else ())

    def _locals(self, leaves: list, plan: list) -> list:
        """This rank's input tensors for the program (``plan``: per leaf, its
        placements, or None for a static leaf)."""
        dm = self.mesh.device_mesh
        locals_ = []
        for leaf, pl in zip(leaves, plan):
            if pl is None:
                continue
            if isinstance(leaf, DTensor):
                if leaf.placements != pl:
                    sync.agreed()         # (communicates: the ranks must agree first)
                    leaf = leaf.redistribute(dm, pl)
                # the program was traced on contiguous shards (views inside it assume so)
                t = _torch.local_tensor(leaf)
                if t.requires_grad:
                    t = t.detach()
                locals_.append(t if t.is_contiguous() else t.contiguous())
            else:
                locals_.append(local_slice(leaf.detach(), pl, self.mesh))
        return self._complete(locals_)

    def _complete(self, locals_: list) -> list:
        """The inputs' shards, with donated inputs given storage of their own and this
        call's random seed and offsets appended."""
        if self.donated:
            _separate_donated(locals_, self.donated_local)
        if self.n_draws:
            locals_.extend(srandom._take(self.n_draws, self.rng_device))
        return locals_

    def run(self, leaves: list, shards: list | None = None) -> Any:
        """``shards``: the tensor inputs' local shards when the caller already took
        them (NOTE [The steady-state call])."""
        locals_ = self._locals(leaves, self.in_plan) if shards is None else self._complete(shards)
        if self.donated:
            try:
                outs = iter(self.runner(*locals_))
            except BaseException as e:
                # stopped by the agreement before writing anything (NOTE [The agreement
                # overlaps the program]): the donated inputs are still the caller's
                if not getattr(e, "agreement", False):
                    self._consume(leaves)
                raise
            self._consume(leaves)
        else:
            outs = iter(self.runner(*locals_))
        flat = [v if kind == "static" else _torch.make_dtensor(next(outs), v)
                for kind, v in self.out_plan]
        return _tree.unflatten(self.out_treedef, flat)

    # -- donation (NOTE [Donation]) ------------------------------------------------------
    def _consume(self, leaves: list, tensors_only: bool = False) -> None:
        """After a call: every donated DTensor raises when used. ``leaves``: all the
        dynamic leaves, or (``tensors_only``) the tensor inputs."""
        for i, k, msg in zip(self.donated, self.donated_local, self.donated_msgs):
            leaf = _torch.functorch_base(leaves[k if tensors_only else i])
            if isinstance(leaf, DTensor) and _torch.donated_message(leaf) is None:
                _torch.mark_donated(leaf, msg)

    # -- the differentiable path (NOTE [pjit under autograd]) ------------------------
    def run_grad(self, leaves: list) -> Any:
        tensors = [leaf for leaf, pl in zip(leaves, self.in_plan) if pl is not None]
        outs = iter(_autograd.apply(self, tensors))
        flat = [v if kind == "static" else next(outs) for kind, v in self.out_plan]
        return _tree.unflatten(self.out_treedef, flat)

    def forward(self, tensors: list) -> tuple[list, list]:
        """The forward program on the tensor inputs: (output DTensors, residuals)."""
        plan = [pl for pl in self.in_plan if pl is not None]
        locals_ = self._locals(tensors, plan)
        if self.donated:
            try:
                outs = self.runner(*locals_)
            finally:
                self._consume(tensors, tensors_only=True)
        else:
            outs = self.runner(*locals_)
        n = self.n_tensor_out
        specs = [v for kind, v in self.out_plan if kind != "static"]
        return [_torch.make_dtensor(o, spec) for o, spec in zip(outs[:n], specs)], list(outs[n:])


# NOTE [The steady-state call]
# A training loop calls one program with the same signature every step, its state
# leaves being the DTensors the last call returned. Such a call is matched against the
# last call's plan (``_Steady``) instead of building the full signature, hashing it
# and checking every input's layout: the same mesh object, no keyword arguments, the
# same static arguments (identity, else type and ==), the same tree structure and
# ambient state (default dtype, autocast), and per leaf: a DTensor whose spec is the
# very object seen last time (or equal to it: then the new object is remembered), not
# requiring grad and not donated; a plain tensor of the same shape, dtype and device,
# neither requiring grad nor wrapped by torch.func; a static leaf of the same type
# and value. DTensorSpec covers the mesh, placements, global shape, stride and dtype,
# and pjit wraps every output in the spec planned at compile time, so from the third
# step on a state leaf is matched by one identity comparison. The program must still
# be in the cache (the lookup is an LRU touch): the cache stays the one place that
# says which programs exist. Anything else takes the full path, which re-arms the
# plan: a call with keyword arguments, a differentiable call, an input to be
# redistributed. The per-call agreement still runs: it is what keeps a rank that
# calls something else from hanging the others.


@dataclass(eq=False, slots=True)
class _Steady:
    mesh: Mesh
    nargs: int
    nums: tuple          # the static argnums, resolved for ``nargs`` arguments
    static: tuple        # their values
    treedef: Any
    ambient: tuple
    entry: "Compiled"
    expect: list         # per leaf: a DTensorSpec, ("tensor", shape, dtype, device), ("static", type, value)
    cache: collections.OrderedDict
    key: tuple
    plain: list          # indices of the plain tensor leaves (their values are checked)

    @staticmethod
    def arm(sig: _Signature, entry: "Compiled", outcome, nargs: int, cache, key) -> "_Steady | None":
        """The plan to match the next call against, or None when this call is not the
        steady kind (keywords, a backward, inputs that were redistributed)."""
        if sig.grad is not None or sig.static_kwargs is not None or outcome.program != entry.program:
            return None
        expect: list = []
        for x in sig.leaves:
            if type(x) is DTensor:
                spec = _torch.dtensor_spec(x)
                if spec.tensor_meta is None:
                    return None
                expect.append(spec)
            elif type(x) is torch.Tensor:
                expect.append(("tensor", x.shape, x.dtype, x.device))
            elif isinstance(x, torch.Tensor):
                return None
            else:
                expect.append(("static", type(x), x))
        plain = [j for j, w in enumerate(expect) if type(w) is tuple and w[0] == "tensor"]
        return _Steady(sig.mesh, nargs, sig.static_argnums, sig.static_args, sig.treedef,
                       sig.ambient, entry, expect, cache, key, plain)

    def match(self, args: tuple, kwargs: dict, mesh) -> "tuple[Compiled, list, list, list] | None":
        """(program, leaves, their local shards) when this call has the armed plan's
        signature and its inputs are in the planned layouts; None: take the full
        path."""
        if kwargs or mesh is not self.mesh or len(args) != self.nargs:
            return None
        nums = self.nums
        if nums:
            for i, v in zip(nums, self.static):
                a = args[i]
                if a is not v and (type(a) is not type(v) or a != v):
                    return None
            dyn = tuple(a for i, a in enumerate(args) if i not in nums)
        else:
            dyn = args
        leaves, treedef = _tree.flatten(dyn)
        if treedef != self.treedef or _ambient() != self.ambient:
            return None
        expect, plan, shards = self.expect, self.entry.in_plan, []
        for j, x in enumerate(leaves):
            want = expect[j]
            t = type(x)
            if t is DTensor:
                spec = _torch.dtensor_spec(x)
                if spec is not want:
                    if type(want) is tuple or spec != want:
                        return None
                    expect[j] = spec
                if x.requires_grad or _torch.donated_message(x) is not None:
                    return None
                local = _torch.local_tensor(x)      # (contiguous: the program assumes so)
                shards.append(local if local.is_contiguous() else local.contiguous())
            elif t is torch.Tensor:
                if type(want) is not tuple or want[0] != "tensor" or x.shape != want[1] \
                        or x.dtype != want[2] or x.device != want[3] or x.requires_grad \
                        or _torch.is_functorch_wrapped(x):
                    return None
                shards.append(local_slice(x, plan[j], self.entry.mesh))
            elif isinstance(x, torch.Tensor) or type(want) is not tuple or want[0] != "static" \
                    or t is not want[1] or not (x is want[2] or x == want[2]):
                return None
        with _CACHE_LOCK:
            if self.key not in self.cache:
                return None
            self.cache.move_to_end(self.key)
        return self.entry, leaves, shards, self.plain


class Pjit:
    """The callable that pjit returns. ``.lower(*args)`` shows the program."""

    def __init__(self, fn, in_specs, out_specs, mesh, mode, static_argnums, donate_argnums=(), *,
                 static_argnames=(), donate_argnames=()):
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
        self._params = _parameters(fn)
        self.static_argnums, self.static_argnames = _both(
            fn, self._params, static_argnums, static_argnames, "static", self.name)
        self.donate_argnums, self.donate_argnames = _both(
            fn, self._params, donate_argnums, donate_argnames, "donate", self.name)
        both = (set(self.static_argnums) & set(self.donate_argnums)) | (
            self.static_argnames & self.donate_argnames)
        if both:
            raise ValueError(
                f"{self.name}: argument(s) {sorted(both, key=str)} are both static and donated; "
                f"a static argument is a Python value, not a buffer to donate."
            )
        _check_in_specs_names(in_specs, self._params, self.static_argnames, self.name)
        self._mode_key = (type(self.mode), self.mode.cache_key())
        self._anchor = _anchor(fn)
        try:
            self._config = (self._mode_key, _hashable_tree(in_specs), _hashable_tree(out_specs),
                            self.static_argnums, tuple(sorted(self.static_argnames)),
                            self.donate_argnums, tuple(sorted(self.donate_argnames)))
        except TypeError:
            self._config = None
        self._own_cache: collections.OrderedDict = collections.OrderedDict()
        self._steady: _Steady | None = None      # the last call's plan, to match the next
        self._own_states: collections.OrderedDict = collections.OrderedDict()
        # Programs this object has used (traced, or found in the cache when another
        # pjit of the same function traced them): one per signature, so a count that
        # grows with the calls means retracing.
        self.trace_count = 0
        self._used: weakref.WeakSet = weakref.WeakSet()
        # Name and docs only: a __wrapped__ attribute would let torch.func (and
        # inspect) call the raw function, bypassing this wrapper.
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)
        self.__doc__ = getattr(fn, "__doc__", None)

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
                grad = None
                outcome = entry.steady_outcome(plain, leaves)
            else:
                sig = self._signature(args, kwargs, mesh)
                entry = self._lookup(sig) or self._compile(sig, args)
                leaves, grad, shards = sig.leaves, sig.grad, None
                outcome = entry.outcome(leaves)
                self._steady = _Steady.arm(sig, entry, outcome, len(args), self._cache(),
                                           self._full_key(sig))
        except Exception as e:  # noqa: BLE001 - every rank must hear about it
            outcome = e
            self._steady = None
        if grad is not None:
            states = sync.agree(mesh, self.name, outcome)
        else:       # NOTE [The agreement overlaps the program]
            states = sync.agree_async(mesh, self.name, outcome)
        if states is not None and entry is not None and entry.n_draws:
            srandom._settle(states, self.name)
        if grad is not None:
            return sync.run_guarded(self.name, entry.run_grad, leaves, mesh=mesh)
        try:
            return sync.run_guarded(self.name, entry.run, leaves, shards, mesh=mesh)
        finally:
            sync.drop_pending()

    def lower(self, *args, **kwargs) -> Lowered:
        """Trace and partition for ``args`` without running (no communication). For
        a differentiable call (inputs that require grad) ``.backward`` is the
        backward program's ``Lowered``."""
        sig = self._signature(args, kwargs, current_mesh(self.mesh, self.name))
        entry = self._lookup(sig, touch=False) or self._compile(sig, args)
        return Lowered(entry, self.name)

    def _steady_match(self, args, kwargs, mesh):
        """NOTE [The steady-state call]: (program, leaves, shards) or None."""
        if self._steady is None:
            return None
        try:
            return self._steady.match(args, kwargs, mesh)
        except Exception:  # noqa: BLE001 - an odd static value's ==: the full path says why
            return None

    # -- Checks and cache key ------------------------------------------------
    def _signature(self, args, kwargs, mesh) -> _Signature:
        nums = self._static_argnums_for(len(args))
        static = tuple(args[i] for i in nums)
        for i, v in zip(nums, static):
            _check_static_arg(v, f"args[{i}]", self.name)
        dyn = tuple(a for i, a in enumerate(args) if i not in nums)
        static_kw, dyn_kw = None, None
        if kwargs:
            static_kw, dyn_kw = self._split_kwargs(args, kwargs)
            leaves, treedef = _tree.flatten((dyn, dyn_kw))
        else:
            leaves, treedef = _tree.flatten(dyn)
        leaf_keys: list[tuple] = []
        differentiable = False
        for j, x in enumerate(leaves):
            if isinstance(x, torch.Tensor):
                if x.requires_grad or _torch.is_functorch_wrapped(x):
                    differentiable = True
                leaf_keys.append((x.shape, x.dtype, x.device.type))   # (a Size is a tuple)
            else:
                if type(x) not in _PLAIN_STATIC:
                    _check_leaf(x, functools.partial(_dyn_path, args, nums, dyn_kw, j), self.name)
                leaf_keys.append(("static", type(x), x))   # 1, 1.0 and True are distinct
        ambient = _ambient()
        key: tuple = (treedef, tuple(leaf_keys), tuple((type(v), v) for v in static), nums, mesh,
                      ambient)
        if static_kw is not None:     # (the dynamic ones are in the treedef)
            key = key + (("kwargs", tuple((k, type(v), v) for k, v in sorted(static_kw.items()))),)
        grad = None
        if differentiable:      # NOTE [pjit under autograd]: a program with a backward
            if any(_torch.is_vmapped(x) for x in leaves if isinstance(x, torch.Tensor)):
                raise TypeError(_autograd.VMAP.format(name=self.name))
            enabled = torch.is_grad_enabled()
            grad = tuple(enabled and x.requires_grad for x in leaves if isinstance(x, torch.Tensor))
            if any(grad) or any(_torch.is_functorch_wrapped(x) for x in leaves
                                if isinstance(x, torch.Tensor)):
                key = key + (("grad", grad),)
            else:
                grad = None
        return _Signature(mesh, leaves, treedef, static, nums, key, ambient, static_kw, grad)

    def _split_kwargs(self, args, kwargs) -> tuple[dict, dict]:
        """(static, dynamic) keyword arguments, checked against the signature."""
        params = self._params
        if params is not None:
            for k in kwargs:
                if k in params.positional[:len(args)]:
                    raise TypeError(f"{self.name} got multiple values for argument {k!r} "
                                    f"(positional argument {params.positional.index(k)} and a "
                                    f"keyword).")
                if params.keywords is not None and k not in params.keywords:
                    raise TypeError(
                        f"{self.name} got an unexpected keyword argument {k!r}; the function "
                        f"takes ({', '.join(params.names)})."
                    )
        static = {k: v for k, v in kwargs.items() if k in self.static_argnames}
        for k, v in static.items():
            _check_static_arg(v, f"kwargs[{k!r}]", self.name, "static_argnames")
        dyn = {k: v for k, v in kwargs.items() if k not in self.static_argnames}
        return static, dyn

    def _static_argnums_for(self, nargs: int) -> tuple:
        return _argnums_for(self.static_argnums, nargs, self._params, self.name, "static_argnums")

    def _cache(self) -> collections.OrderedDict:
        if self._anchor is None or self._config is None:
            return self._own_cache
        anchor, sub = self._anchor
        per_fn = _PROGRAMS.get(anchor)
        if per_fn is None:
            per_fn = _PROGRAMS[anchor] = collections.OrderedDict()
        return per_fn

    def _run_state(self, key: tuple) -> RunState:
        with _CACHE_LOCK:
            table: collections.OrderedDict
            if self._anchor is None or self._config is None:
                table = self._own_states
            else:
                found = _RUN_STATES.get(self._anchor[0])
                if found is None:
                    found = _RUN_STATES[self._anchor[0]] = collections.OrderedDict()
                table = found
            state = table.get(key)
            if state is None:
                state = table[key] = RunState()
                while len(table) > _RUN_STATES_SIZE:
                    table.popitem(last=False)
            return state

    def _full_key(self, sig: _Signature) -> tuple:
        sub = self._anchor[1] if self._anchor is not None else None
        return (sub, self._config, sig.key)

    def _lookup(self, sig: _Signature, touch: bool = True) -> Compiled | None:
        with _CACHE_LOCK:
            cache = self._cache()
            key = self._full_key(sig)
            try:
                entry = cache.get(key)
            except TypeError:
                raise TypeError(
                    f"{self.name}: non-tensor arguments are static and must be hashable; "
                    f"got an unhashable one in {_unhashable(sig)}. Make it a tensor, a tuple "
                    f"or a frozen dataclass."
                ) from None
            if entry is not None:
                if touch:          # (``lower`` runs nothing: it leaves the LRU order alone)
                    cache.move_to_end(key)
                self._count(entry)
            return entry

    def _count(self, entry: Compiled) -> None:
        if entry not in self._used:
            self._used.add(entry)
            self.trace_count += 1

    def _store(self, sig: _Signature, entry: Compiled) -> None:
        with _CACHE_LOCK:
            cache = self._cache()
            cache[self._full_key(sig)] = entry
            while len(cache) > CACHE_SIZE:
                cache.popitem(last=False)

    def _leaf_specs(self, args: tuple, dyn: tuple, nums: tuple, dyn_kw: dict) -> list[tuple[str, Any]]:
        """(spec path, spec) for every dynamic leaf, positional args then keywords
        (NOTE [Keyword arguments])."""
        specs = self.in_specs
        if isinstance(specs, dict):                  # by parameter name
            pos = self._params.positional if self._params is not None else ()
            out = []
            for i, a in ((i, a) for i, a in enumerate(args) if i not in nums):
                if i >= len(pos):
                    raise TypeError(
                        f"{self.name}: in_specs is a dict, which names arguments by parameter "
                        f"name, but positional argument {i} has no name (it goes to *args); "
                        f"give in_specs as a tuple with one entry per positional argument.")
                out += _tree.broadcast_prefix(specs.get(pos[i]), a,
                                              f"{self.name} in_specs[{pos[i]!r}]")
            kw = {k: specs.get(k) for k in dyn_kw}
            labels = {k: f"{self.name} in_specs[{k!r}]" for k in dyn_kw}
        elif _tree.is_spec_leaf(specs):              # one spec for everything
            out = _tree.arg_specs(specs, dyn, self.name)
            kw = {k: specs for k in dyn_kw}
            labels = {k: f"{self.name} in_specs" for k in dyn_kw}
        else:                                        # one entry per positional parameter
            specs = tuple(specs) if isinstance(specs, (tuple, list)) else specs
            excluded = " (static_argnums excluded)" if nums else ""
            kw, labels = {}, {}
            if isinstance(specs, tuple) and len(specs) > len(dyn) and self._params is not None:
                # parameters after the call's positional args, passed by keyword
                names = [k for i, k in enumerate(self._params.positional) if i not in nums]
                if len(specs) <= len(names):
                    for j in range(len(dyn), len(specs)):
                        kw[names[j]], labels[names[j]] = specs[j], f"{self.name} in_specs[{j}]"
                    specs = specs[:len(dyn)]
            out = _tree.arg_specs(specs, dyn, self.name, excluded)
            for k in dyn_kw:
                if k not in kw:
                    kw[k] = None
                    labels[k] = f"{self.name} default P() for keyword arguments"
        for k in sorted(dyn_kw):                     # the flatten order of a dict
            out += _tree.broadcast_prefix(kw.get(k), dyn_kw[k], labels[k])
        return out

    # -- Trace, partition, passes ---------------------------------------------
    def _compile(self, sig: _Signature, args) -> Compiled:
        with _COMPILE_LOCK:
            entry = self._lookup(sig)          # another thread may have compiled it
            if entry is not None:
                return entry
            mark = _torch.fx_source_mark()
            keep: tuple = ()
            try:
                if _torch.functorch_level() > 0:     # called under torch.func.grad etc.
                    with _torch.clear_functorch_stack():
                        entry = self._build(sig, args)
                else:
                    entry = self._build(sig, args)
                keep = (entry.global_graph, entry.local_graph)
                if entry.backward is not None:
                    keep += (entry.backward.global_graph, entry.backward.local_graph)
            finally:
                _torch.release_fx_sources(mark, keep)   # NOTE [Bounded caches]
                _torch.bound_process_caches()
            self._store(sig, entry)
            self._count(entry)
            return entry

    def _build(self, sig: _Signature, args) -> Compiled:
        mesh = sig.mesh
        nums = sig.static_argnums
        dyn = tuple(a for i, a in enumerate(args) if i not in nums)
        dyn_kw = _tree.unflatten(sig.treedef, sig.leaves)[1] if sig.static_kwargs is not None else {}
        leaf_specs = self._leaf_specs(args, dyn, nums, dyn_kw)
        paths = _dyn_paths(args, nums, dyn_kw)
        tensor_leaf = [isinstance(x, torch.Tensor) for x in sig.leaves]

        in_specs, in_placements, metas, tensor_paths = [], [], [], []
        for x, (spath, spec), apath in zip(sig.leaves, leaf_specs, paths):
            if not isinstance(x, torch.Tensor):
                continue
            x = _torch.functorch_base(x)       # under torch.func.grad: the tensor it wraps
            spec = P() if spec is None else spec
            check_spec(spec, x.shape, mesh, f"{spath} (for {apath})")
            if isinstance(x, DTensor) and x.device_mesh != mesh.device_mesh:
                raise ValueError(
                    f"{self.name}: {apath} is a DTensor on {x.device_mesh}, not on the "
                    f"pjit mesh {mesh}; gather it and shard it onto this mesh."
                )
            in_specs.append(spec)
            in_placements.append(to_placements(spec, mesh))
            metas.append(x)
            tensor_paths.append(apath)

        out_info: dict[str, Any] = {}
        flat_fn = self._flat_fn(sig, out_info)
        inputs = [f"{p}: {_fmt_meta(m)}" for p, m in zip(tensor_paths, metas)]
        t0 = time.perf_counter()
        global_gm = trace_global(flat_fn, metas, self.name, fn=self.fn, inputs=inputs,
                                 requires_grad=sig.grad)
        times = {"trace": time.perf_counter() - t0}
        mutated = [i for i in mutated_inputs(global_gm) if i < len(tensor_paths)]
        if mutated:
            raise ValueError(
                f"{self.name}: the function mutates its input {tensor_paths[mutated[0]]} "
                f"in place; pjit functions must be pure. Return the new value instead "
                f"(e.g. `w = w - lr * g` rather than `w.sub_(lr * g)`). A module that updates "
                f"its buffers in place (BatchNorm) needs them cloned inside the function "
                f"and returned (docs/concepts.md, 'Module state')."
            )
        joint = global_gm.meta.get("joint")
        backward_gm = None
        if joint is not None:          # NOTE [pjit under autograd]
            global_gm, backward_gm = _torch.partition_joint(global_gm, joint.n_out)

        out_leaves, out_treedef = out_info["leaves"], out_info["treedef"]
        out_specs = self._out_leaf_specs(out_leaves, out_treedef, mesh)
        out_paths = [p for p, v in zip(_tree.leaf_paths(_tree.unflatten(out_treedef, out_leaves),
                                                        "output"), out_leaves)
                     if isinstance(v, torch.Tensor)]
        n_out = len(out_specs)
        n_draws = rewrite_random_ops(global_gm, self.name)
        mean_losses_as_sums(global_gm)          # NOTE [A mean over a split batch]
        # (read after the rewrites: a float16 loss's output is then its cast back)
        out_vals = [n for n in global_gm.graph.nodes if n.op == "output"][0].args[0]
        n_saved = len(out_vals) - n_out
        rng_placements = [to_placements(P(), mesh)] * 2 if n_draws else []  # seed, offset
        for node, path in zip(global_gm.graph.find_nodes(op="placeholder"),
                              tensor_paths + ["rng seed", "rng offset"]):
            node.meta["sharded_path"] = path
        t0 = time.perf_counter()
        part = self.mode.partition(global_gm, in_placements + rng_placements,
                                   out_specs + [None] * n_saved, mesh)
        if n_saved:
            res_specs = _plain_residual_specs(part.out_placements[n_out:], out_vals[n_out:], mesh)
            if res_specs is not None:       # NOTE [Residual layouts]
                part = self.mode.partition(global_gm, in_placements + rng_placements,
                                           out_specs + res_specs, mesh)
        donated = self._donated_leaves(args, nums, dyn_kw, sig.leaves)
        donated_local = [tensor_leaf[:j].count(True) for j in donated]
        placeholders = part.graph.graph.find_nodes(op="placeholder")
        for k in donated_local:                 # NOTE [Writing into donated inputs]
            placeholders[k].meta["sharded_donated"] = True
        t1 = time.perf_counter()
        local_gm = self.mode.transform_and_compile(part.graph, mesh)
        unalias_outputs(local_gm, n_out)       # (every mode: residuals are not the user's)
        _agreement_point(local_gm)
        local_gm.recompile()
        times.update(partition=t1 - t0, passes=time.perf_counter() - t1)
        reused = _reused_inputs(local_gm, donated_local, [paths[j] for j in donated], out_paths
                                ) if donated else {}
        if part.in_placements is not None:       # the mode laid the inputs out itself
            in_placements = list(part.in_placements[:len(in_placements)])
            in_specs = [from_placements(pl, mesh, m.ndim) for pl, m in zip(in_placements, metas)]

        out_dt_specs = [
            _torch.build_dtensor_spec(mesh.device_mesh, pl, v.meta["val"].shape,
                                      v.meta["val"].stride(), v.meta["val"].dtype)
            for v, pl in zip(out_vals, part.out_placements)
        ]
        backward = None
        if backward_gm is not None:
            backward = self._build_backward(
                backward_gm, joint, part, out_vals, out_dt_specs, out_paths, in_placements,
                metas, mesh, state=self._run_state(self._full_key(sig) + ("backward",)))
        sig_lines = [f"input {p}: {_fmt_meta(m)} {s!r}"
                     for p, m, s in zip(tensor_paths, metas, in_specs)]
        sig_lines += [f"static args[{i}]: {stable_repr(v)}" for i, v in zip(nums, sig.static_args)]
        sig_lines += [f"static kwargs[{k!r}]: {stable_repr(v)}"
                      for k, v in sorted((sig.static_kwargs or {}).items())]
        sig_lines += [f"static leaf {p}: {stable_repr(x)}"
                      for p, x in zip(paths, sig.leaves) if not isinstance(x, torch.Tensor)]
        sig_lines += [f"ambient: {_ambient_text(sig.ambient)}"]
        sig_lines += [f"output {p}: {_fmt_meta(v.meta['val'])} {tuple(pl)}"
                      for p, v, pl in zip(out_paths, out_vals, part.out_placements)]
        if sig.grad is not None:
            sig_lines += [f"requires grad: {list(sig.grad)}"]

        def lines() -> list[str]:
            out = (sig_lines + ["global program:"] + program_lines(global_gm)
                   + ["local collectives:"] + fingerprint(local_gm, mesh)[1])
            if backward is not None:
                out += (["backward program:"] + program_lines(backward.global_graph)
                        + ["backward collectives:"] + fingerprint(backward.local_graph, mesh)[1])
            return out

        placements = iter(in_placements)
        in_plan = [next(placements) if t else None for t in tensor_leaf]
        dt_specs = iter(out_dt_specs)
        out_plan = [("static", v) if not isinstance(v, torch.Tensor) else ("dtensor", next(dt_specs))
                    for v in out_leaves]
        return Compiled(
            global_graph=global_gm, local_graph=local_gm, runner=self.mode.runner(local_gm, self.name, mesh,
                                                            self._run_state(self._full_key(sig))),
            mesh=mesh, name=self.name, in_plan=in_plan, in_paths=paths, in_specs=in_specs,
            out_treedef=out_treedef, out_plan=out_plan,
            out_placements=part.out_placements[:n_out],
            layouts=part.layouts, n_draws=n_draws,
            rng_device=_mesh_device(mesh) if n_draws else None,
            program=sync.token(*lines()), lines=lines, times=times,
            differentiable=joint is not None, n_tensor_out=n_out,
            diff_out=list(joint.diff_out) if joint is not None else [],
            grad_in=list(joint.grad_in) if joint is not None else [],
            backward=backward,
            donated=donated, donated_local=donated_local, reused=reused,
            donated_msgs=[f"{paths[j]} was donated to {self.name}; use the returned value"
                          for j in donated],
        )

    def _donated_leaves(self, args, nums, dyn_kw: dict, leaves: list) -> list[int]:
        """Indices of the tensor leaves that belong to donated arguments."""
        if not self.donate_argnums and not self.donate_argnames:
            return []
        donate = set(_argnums_for(self.donate_argnums, len(args), self._params, self.name,
                                  "donate_argnums"))
        owner = []
        for i, a in enumerate(args):
            if i not in nums:
                owner += [i in donate] * len(_tree.flatten(a)[0])
        for k in sorted(dyn_kw):                    # the flatten order of a dict
            owner += [k in self.donate_argnames] * len(_tree.flatten(dyn_kw[k])[0])
        return [j for j, (d, x) in enumerate(zip(owner, leaves)) if d and isinstance(x, torch.Tensor)]

    def _build_backward(self, gm, joint, fwd, out_vals, out_dt_specs, out_paths, in_placements,
                        metas, mesh, state=None) -> "_autograd.Backward":
        """Partition the backward global program (NOTE [pjit under autograd]): its
        inputs are the forward's residuals and the cotangents of the outputs that
        require grad, laid out as the forward produced them; its outputs are the
        gradients, laid out as their inputs enter the forward program."""
        n_out = joint.n_out
        res_vals = out_vals[n_out:]
        res_pl = list(fwd.out_placements[n_out:])
        diff = [i for i in range(n_out) if joint.diff_out[i]]
        in_pl = res_pl + [fwd.out_placements[i] for i in diff]
        kinds = (fwd.layouts or {}).get("outputs", {})
        placeholders = gm.graph.find_nodes(op="placeholder")
        sources = [(f"residual {v.name}", n_out + k) for k, v in enumerate(res_vals)]
        sources += [(f"cotangent of {out_paths[i]}", i) for i in diff]
        for node, (path, k) in zip(placeholders, sources):
            node.meta["sharded_path"] = path
            kind = kinds.get(f"output[{k}]")
            if kind is not None:       # DataParallelMode: batch or state, as in the forward
                node.meta["sharded_kind"] = kind[0]
        n_draws = rewrite_random_ops(gm, f"{self.name} backward")
        mean_losses_as_sums(gm)                 # (a loss's backward op: the same NOTE)
        rng = [to_placements(P(), mesh)] * 2 if n_draws else []
        grad_specs = [from_placements(in_placements[i], mesh, metas[i].ndim) for i in joint.grad_in]
        t0 = time.perf_counter()
        part = self.mode.partition(gm, in_pl + rng, grad_specs, mesh)
        t1 = time.perf_counter()
        local_gm = self.mode.transform_and_compile(part.graph, mesh)
        if unalias_outputs(local_gm):          # gradients (one may be clipped in place)
            local_gm.recompile()
        times = {"trace": 0.0, "partition": t1 - t0, "passes": time.perf_counter() - t1}
        got = list(part.in_placements) if part.in_placements is not None else in_pl
        dm = mesh.device_mesh
        res_moves = []
        for v, src, dst in zip(res_vals, res_pl, got):
            val = v.meta["val"]
            res_moves.append(None if tuple(src) == tuple(dst) else (
                _torch.build_dtensor_spec(dm, src, val.shape, val.stride(), val.dtype), tuple(dst)))
        tan_specs = []
        for i, dst in zip(diff, got[len(res_vals):]):
            val = out_vals[i].meta["val"]
            tan_specs.append(_torch.build_dtensor_spec(dm, dst, val.shape, val.stride(), val.dtype))
        out_node = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
        grad_dt = [
            _torch.build_dtensor_spec(dm, pl, v.meta["val"].shape, v.meta["val"].stride(),
                                      v.meta["val"].dtype)
            for v, pl in zip(out_node.args[0], part.out_placements)
        ]
        name = f"{self.name} backward"
        return _autograd.Backward(
            global_graph=gm, local_graph=local_gm, runner=self.mode.runner(local_gm, name, mesh, state),
            mesh=mesh, name=name, res_moves=res_moves, tan_specs=tan_specs, grad_specs=grad_dt,
            n_draws=n_draws, rng_device=_mesh_device(mesh) if n_draws else None,
            program=sync.token(name, *program_lines(gm), *fingerprint(local_gm, mesh)[1]),
            lines=lambda: [name] + program_lines(gm) + fingerprint(local_gm, mesh)[1],
            in_specs=[_spec_or_placements(pl, mesh, n.meta["val"].ndim) for pl, n in zip(got, placeholders)],
            out_placements=list(part.out_placements), layouts=part.layouts,
            times=times,
        )

    def _flat_fn(self, sig: _Signature, out_info: dict) -> Callable:
        """``fn`` over flat tensors: rebuilds the args (with the static leaves) and
        flattens the outputs, recording their structure and static leaves."""
        leaves, treedef = sig.leaves, sig.treedef
        statics = dict(zip(sig.static_argnums, sig.static_args))
        static_kw = sig.static_kwargs
        fn, name = self.fn, self.name

        def flat_fn(*tensors):
            it = iter(tensors)
            filled = [next(it) if isinstance(x, torch.Tensor) else x for x in leaves]
            tree = _tree.unflatten(treedef, filled)
            pos, kw = (tree, {}) if static_kw is None else (tree[0], {**static_kw, **tree[1]})
            dyn = iter(pos)
            n = len(statics) + len(pos)
            args = [statics[i] if i in statics else next(dyn) for i in range(n)]
            out = fn(*args, **kw)
            out_leaves, out_treedef = _tree.flatten(out)
            for k, v in enumerate(out_leaves):
                if not isinstance(v, _OUTPUT_LEAVES):
                    path = _tree.leaf_paths(out, "output")[k]
                    raise TypeError(_bad_output(name, path, v)) from None
            out_info["leaves"], out_info["treedef"] = out_leaves, out_treedef
            return [v for v in out_leaves if isinstance(v, torch.Tensor)]

        return flat_fn

    def _out_leaf_specs(self, out_leaves, out_treedef, mesh) -> list:
        tensors = [v for v in out_leaves if isinstance(v, torch.Tensor)]
        if self.out_specs is UNSPECIFIED:
            return [None] * len(tensors)
        tree = _tree.unflatten(out_treedef, out_leaves)
        matched = _tree.broadcast_prefix(
            self.out_specs, tree, f"{self.name} out_specs",
            is_leaf=lambda x: _tree.is_spec_leaf(x) or x is UNSPECIFIED)
        paths = _tree.leaf_paths(tree, "output")
        specs: list = []
        for v, (spath, spec), opath in zip(out_leaves, matched, paths):
            if not isinstance(v, torch.Tensor):
                continue
            if spec is UNSPECIFIED:       # this output keeps its propagated layout
                specs.append(None)
                continue
            spec = P() if spec is None else spec
            check_spec(spec, v.shape, mesh, f"{spath} (for {opath})")
            specs.append(spec)
        return specs


# NOTE [Donation]
# ``donate_argnums``/``donate_argnames`` name arguments whose DTensors the call
# consumes, as in JAX: the program may compute its outputs in their storage. pjit
# marks the donated inputs of the per-rank program (``meta["sharded_donated"]``) before
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
# input is the same value on every rank, sliced locally, and stays the caller's. A
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


def _reused_inputs(gm: fx.GraphModule, donated_local: list[int], in_paths: list[str],
                   out_paths: list[str]) -> dict:
    """{donated input path: output path that shares its storage, or None}; warns for
    the donated inputs whose storage no output reuses."""
    placeholders = gm.graph.find_nodes(op="placeholder")
    out_node = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    outs: dict = {}
    for a, path in zip(out_node.args[0], out_paths):     # (not the residuals after them)
        val = a.meta.get("val") if isinstance(a, fx.Node) else None
        if isinstance(val, torch.Tensor):
            outs.setdefault(_torch.storage_key(val), path)
    reused = {}
    for k, path in zip(donated_local, in_paths):
        reused[path] = outs.get(_torch.storage_key(placeholders[k].meta["val"]))
    unused = [p for p, o in reused.items() if o is None]
    if unused:
        warnings.warn(
            f"pjit: the storage of donated input(s) {unused[:8]}{' ...' if len(unused) > 8 else ''} "
            f"is not reused: no output of the same shape, dtype and layout is computed from "
            f"them in place (or an output, or the backward, still reads them). They are "
            f"consumed by the call all the same.", stacklevel=4)
    return reused


# NOTE [Residual layouts]
# The forward returns each residual in the layout propagation gives it, so that the
# backward starts where the forward left off, with no communication in between.
# A layout no P expresses (DTensor's _StridedShard, from a view that merges two
# sharded dims) is the exception: its shards may differ in size from rank to rank,
# which a program traced once for every rank cannot have, and few sharding rules
# take it. Views are recomputed in the backward (NOTE [Views are recomputed in the
# backward] in transforms/_trace.py), so a residual rarely has one; if one does, the
# forward is partitioned again with that residual's strided mesh axes replicated.


def _agreement_point(gm) -> None:
    """Check the call's agreement just before the first op of the program that is not
    a pure aten op (a collective, an in-place write that may land in a donated input,
    any other namespace's op: DTensor's CUDA all-to-all is ``_dtensor::``), or at its
    end: NOTE [The agreement overlaps the program]. Before that point the program only
    computes into its own memory, so ranks that disagree stop with nothing sent and
    nothing overwritten. Inductor's copy leaves the call out; its runner checks before
    running it."""
    g = gm.graph

    def local(n) -> bool:
        if n.op != "call_function":
            return n.op in ("placeholder", "get_attr")
        if isinstance(n.target, _torch.OpOverload):
            return n.target.namespace == "aten" and not _torch.is_mutating_op(n.target) \
                and n.target not in _torch.COLLECTIVE_OPS
        return n.target is operator.getitem

    where = next(n for n in g.nodes if not local(n))     # (the output node at the latest)
    with g.inserting_before(where):
        point = g.call_function(sync.agreed, ())
    point.meta["sharded_agreement"] = True


def _plain_residual_specs(placements: list, vals: list, mesh) -> list | None:
    """Out specs for the residuals if some residual's layout has no P (NOTE
    [Residual layouts]): None for each plain one, its layout with the strided mesh
    axes replicated for the others; None if every layout is plain."""
    specs: list = []
    changed = False
    for pl, v in zip(placements, vals):
        ndim = v.meta["val"].ndim
        try:
            from_placements(pl, mesh, ndim)
            specs.append(None)
        except ValueError:
            plain = tuple(p if type(p) in (Shard, Replicate) else Replicate() for p in pl)
            specs.append(from_placements(plain, mesh, ndim))
            changed = True
    return specs if changed else None


def _spec_or_placements(placements, mesh, ndim):
    """The P of ``placements``, or the placements where no P expresses them (a
    residual laid out as a _StridedShard)."""
    try:
        return from_placements(placements, mesh, ndim)
    except ValueError:
        return tuple(placements)


def _mesh_device(mesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


# ---------------------------------------------------------------------------
# Argument checks
# ---------------------------------------------------------------------------

def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _tuple_of(value, is_one, one_or_many: str, many: str, what: str, api: str) -> tuple:
    """``value`` (one item or a sequence of items, each passing ``is_one``) as a tuple;
    ``one_or_many`` and ``many`` describe the items in the errors."""
    if is_one(value):
        value = (value,)
    try:
        value = tuple(value)
    except TypeError:
        raise TypeError(f"{api}: {what} must be {one_or_many}; got {value!r}.") from None
    for x in value:
        if not is_one(x):
            raise TypeError(f"{api}: {what} must be {many}; got {x!r} in {value!r}.")
    return value


def _argnums(fn, nums, what: str, api: str) -> tuple:
    """``static_argnums``/``donate_argnums`` as a sorted tuple; negative numbers are
    resolved against ``fn``'s positional parameters when its signature says how many
    there are (no ``*args``), else per call (as JAX does)."""
    nums = _tuple_of(nums, _is_int, "an int or a sequence of ints", "ints", what, api)
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        params = None
    if params is not None and not any(p.kind is p.VAR_POSITIONAL for p in params):
        n = sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)
        return _resolve_argnums(nums, n, api, what, f"the function takes {n} positional argument(s)")
    if len(set(nums)) != len(nums):
        raise ValueError(f"{api}: {what} {nums!r} names an argument twice.")
    return tuple(sorted(nums))


def _resolve_argnums(nums: tuple, n: int, api: str, what: str, against: str) -> tuple:
    """``nums`` as sorted indices in [0, n), negative ones counted from the end;
    ``against`` says what ``n`` counts (for the error)."""
    out = []
    for i in nums:
        j = i + n if i < 0 else i
        if not 0 <= j < n:
            raise ValueError(
                f"{api}: {what} has {i}, but {against}; {what} index the positional "
                f"arguments (negative ones count from the end)."
            )
        out.append(j)
    if len(set(out)) != len(out):
        raise ValueError(f"{api}: {what} {tuple(nums)!r} names an argument twice.")
    return tuple(sorted(out))


# NOTE [Keyword arguments]
# A call may pass arguments by keyword. Keywords named in ``static_argnames`` are static
# (hashable Python values in the cache key, as static_argnums); the others are dynamic
# inputs like positional ones: their tensors are program inputs, their other leaves
# static. ``in_specs`` lays them out: a single P covers them too; a tuple covers the
# positional arguments and keyword tensors are replicated (P()); a dict names arguments
# by parameter name, positional or keyword, and an argument it does not name is
# replicated. As in JAX, a name and a position that denote the same parameter (via
# inspect.signature) are the same argument for static_argnums/static_argnames and for
# donate_argnums/donate_argnames. Paths in messages read ``kwargs['mask']``.

@dataclass(frozen=True)
class _Params:
    positional: tuple            # names of the positional parameters, in order
    keywords: frozenset | None   # names accepted by keyword (None: the function has **kwargs)
    names: tuple                 # every parameter, for messages
    varargs: bool                # the function has *args


def _argnums_for(nums: tuple, nargs: int, params: "_Params | None", api: str, what: str) -> tuple:
    """``nums`` for a call with ``nargs`` positional args: for a function without
    ``*args`` they were resolved when pjit was called, and those beyond the call's
    positional args are passed by keyword (or take their default); otherwise they are
    resolved now, negative ones from the end."""
    if all(0 <= i < nargs for i in nums):
        return nums                                  # the common case, resolved
    if params is not None and not params.varargs:
        return tuple(i for i in nums if i < nargs)
    return _resolve_argnums(nums, nargs, api, what, f"the call has {nargs} positional args")


def _parameters(fn) -> _Params | None:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    positional = tuple(p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
    keywords = None if any(p.kind is p.VAR_KEYWORD for p in params) else frozenset(
        p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
    names = tuple(("*" if p.kind is p.VAR_POSITIONAL else "**" if p.kind is p.VAR_KEYWORD else "")
                  + p.name for p in params)
    return _Params(positional, keywords, names, any(p.kind is p.VAR_POSITIONAL for p in params))


def _both(fn, params: _Params | None, nums, names, what: str, api: str) -> tuple[tuple, frozenset]:
    """``{what}_argnums`` and ``{what}_argnames`` completed from each other through the
    signature (NOTE [Keyword arguments])."""
    nums = _argnums(fn, nums, f"{what}_argnums", api)
    names = _tuple_of(names, lambda k: isinstance(k, str), "a str or a sequence of str", "strs",
                      f"{what}_argnames", api)
    for k in names:
        if params is not None and params.keywords is not None and k not in params.keywords \
                and k not in params.positional:
            raise ValueError(
                f"{api}: {what}_argnames has {k!r}, but the function has no parameter of that "
                f"name; it takes ({', '.join(params.names)})."
            )
    if params is None:
        return nums, frozenset(names)
    pos = params.positional
    nums = tuple(sorted(set(nums) | {pos.index(k) for k in names if k in pos}))
    names = frozenset(names) | {pos[i] for i in nums if 0 <= i < len(pos)}
    return nums, names


def _check_in_specs_names(in_specs, params: _Params | None, static: frozenset, api: str) -> None:
    if not isinstance(in_specs, dict):
        return
    for k in in_specs:
        if not isinstance(k, str):
            raise TypeError(f"{api}: in_specs as a dict names arguments by parameter name; "
                            f"got key {k!r}.")
        if k in static:
            raise ValueError(f"{api}: in_specs[{k!r}] names a static argument; static "
                             f"arguments take no spec.")
        if params is not None and params.keywords is not None and k not in params.keywords \
                and k not in params.positional:
            raise ValueError(
                f"{api}: in_specs[{k!r}] names no parameter of the function; it takes "
                f"({', '.join(params.names)})."
            )


_PLAIN_STATIC = frozenset({type(None), bool, int, float, complex, str, bytes, torch.dtype,
                           torch.device, P})
_OUTPUT_LEAVES = (torch.Tensor, type(None), bool, int, float, complex, str)


def _dyn_paths(args, nums, dyn_kw: dict | None = None) -> list[str]:
    paths = []
    for i, a in enumerate(args):
        if i not in nums:
            paths.extend(_tree.leaf_paths(a, f"args[{i}]"))
    if dyn_kw:
        paths.extend(_tree.leaf_paths(dyn_kw, "kwargs"))
    return paths


def _dyn_path(args, nums, dyn_kw, j) -> str:
    return _dyn_paths(args, nums, dyn_kw)[j]


def _holds_tensors(x) -> str | None:
    """Why the non-tensor leaf ``x`` hides tensors from pjit, or None."""
    if isinstance(x, torch.nn.Module):
        return (f"an nn.Module ({type(x).__name__}); pass its parameters instead, e.g. "
                f"dict(model.named_parameters()), and call it inside the function with "
                f"torch.func.functional_call(model, params, (x,))")
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        names = [f.name for f in dataclasses.fields(x) if _tensorish(getattr(x, f.name, None))]
        if names:
            return (f"an instance of {type(x).__name__} (a dataclass with tensors in {names}) "
                    f"that is not a registered pytree node, so pjit cannot see its tensors; register it with "
                    f"sharded.register_dataclass({type(x).__name__})")
        return None
    if isinstance(x, (dict, list, tuple)):
        values = x.values() if isinstance(x, dict) else x
        if any(_tensorish(v) for v in values):
            return (f"an instance of {type(x).__name__} (a {type(x).__mro__[1].__name__} subclass "
                    f"that is not a registered pytree node) holding tensors; pass a plain "
                    f"{type(x).__mro__[1].__name__} or register the type with "
                    f"sharded.register_pytree_node")
        return None
    attrs = getattr(x, "__dict__", None)
    if isinstance(attrs, dict):
        names = [k for k, v in attrs.items() if _tensorish(v)]
        if names:
            return (f"an instance of {type(x).__name__} with tensor attributes {names[:5]}, which "
                    f"pjit cannot see; pass the tensors in a dict or tuple, or register the type "
                    f"(sharded.register_dataclass for a dataclass)")
    return None


def _tensorish(v) -> bool:
    if isinstance(v, (torch.Tensor, torch.nn.Module)):
        return True
    if isinstance(v, (list, tuple)) and len(v) <= 64:
        return any(isinstance(x, torch.Tensor) for x in v)
    if isinstance(v, dict) and len(v) <= 64:
        return any(isinstance(x, torch.Tensor) for x in v.values())
    return False


def _check_leaf(x, path_of: Callable[[], str], api: str) -> None:
    why = _holds_tensors(x)
    if why is not None:
        raise TypeError(f"{api}: {path_of()} is {why}.")


def _check_static_arg(v, where: str, api: str, what: str = "static_argnums") -> None:
    """A static argument is a Python value baked into the program: no tensors."""
    if type(v) in _PLAIN_STATIC:
        return
    leaves = _tree.flatten(v)[0]
    paths = None
    for k, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor) or _holds_tensors(leaf) is not None:
            paths = paths or _tree.leaf_paths(v, where)
            kind = (f"a tensor of shape {tuple(leaf.shape)}" if isinstance(leaf, torch.Tensor)
                    else _holds_tensors(leaf))
            raise TypeError(
                f"{api}: {paths[k]} is static ({what}) but is {kind}. Static "
                f"arguments are Python values baked into the program (each new one traces "
                f"again); pass tensors as regular arguments with an in_specs entry."
            )


def _bad_output(api: str, path: str, v) -> str:
    tname = type(v).__name__
    if inspect.isgenerator(v) or isinstance(v, (types.GeneratorType, map, filter, zip)):
        fix = "a generator or iterator (evaluated lazily, after tracing); return a tuple or list"
    elif isinstance(v, dict):
        fix = (f"an instance of {tname}, a dict subclass that is not a registered pytree "
               f"node (e.g. a HuggingFace ModelOutput); return dict(out) (or out.to_tuple()), or register "
               f"the type with sharded.register_pytree_node")
    elif isinstance(v, (list, tuple)):
        fix = (f"an instance of {tname}, a {type(v).__mro__[1].__name__} subclass that is not "
               f"a registered pytree node; return a plain {type(v).__mro__[1].__name__} or register the type")
    elif dataclasses.is_dataclass(v):
        fix = (f"an instance of {tname}, a dataclass that is not a registered pytree node; "
               f"register it with sharded.register_dataclass({tname})")
    else:
        fix = f"an object of type {tname}"
    return (f"{api}: {path} is {fix}. Outputs must be tensors, Python scalars or None, in "
            f"tuples, lists, dicts, namedtuples or registered pytree nodes (anything else "
            f"would carry tracing values out of the function).")


def _unhashable(sig: _Signature) -> str:
    for kind in sig.key[1]:
        if kind[0] == "static":
            try:
                hash(kind[2])
            except TypeError:
                return f"{type(kind[2]).__name__} {kind[2]!r:.80}"
    for v in sig.static_args:
        try:
            hash(v)
        except TypeError:
            return f"static argument {type(v).__name__} {v!r:.80}"
    for k, v in (sig.static_kwargs or {}).items():
        try:
            hash(v)
        except TypeError:
            return f"static kwargs[{k!r}] (static_argnames), {type(v).__name__} {v!r:.80}"
    return "the arguments"


def _fmt_meta(m) -> str:
    return f"{str(m.dtype).replace('torch.', '')}{list(m.shape)}"


# ---------------------------------------------------------------------------
# Ambient state and stable descriptions (the cache key and the fingerprint)
# ---------------------------------------------------------------------------

_AUTOCAST_DEVICES = ("cpu", "cuda")


def _ambient() -> tuple:
    """Process state that changes what tracing records: the default dtype (factory
    ops) and autocast (casts inserted before dispatch)."""
    autocast = tuple((d, torch.get_autocast_dtype(d)) for d in _AUTOCAST_DEVICES
                     if torch.is_autocast_enabled(d))
    return (torch.get_default_dtype(), autocast)


def _ambient_text(amb: tuple) -> str:
    dtype, autocast = amb
    text = f"default dtype {dtype}"
    if autocast:
        text += ", autocast " + ", ".join(f"{d} {t}" for d, t in autocast)
    return text


_ADDRESS = re.compile(r" (object )?at 0x[0-9a-fA-F]+")


def stable_repr(v, depth: int = 0) -> str:
    """``v`` as text that is equal on every rank for equal values: no memory
    addresses (an object's default repr has one), full length (hashed, not cut)."""
    if v is None or isinstance(v, (bool, int, float, complex, str, bytes)):
        return repr(v)
    if isinstance(v, torch.device):
        return f"device({v.type!r})"      # cuda:0 on rank 0 is cuda:1 on rank 1
    if isinstance(v, (torch.dtype, P)):
        return repr(v)
    if isinstance(v, enum.Enum):
        return f"{type(v).__qualname__}.{v.name}"
    if isinstance(v, type):
        return f"{v.__module__}.{v.__qualname__}"
    if isinstance(v, (types.FunctionType, types.BuiltinFunctionType, types.MethodType)):
        return f"{getattr(v, '__module__', '')}.{getattr(v, '__qualname__', repr(v))}"
    if depth > 6:
        return f"<{type(v).__qualname__}>"
    if isinstance(v, (list, tuple)):
        inner = ", ".join(stable_repr(x, depth + 1) for x in v)
        return f"{type(v).__qualname__}({inner})"
    if isinstance(v, (set, frozenset)):
        return f"{type(v).__qualname__}({sorted(stable_repr(x, depth + 1) for x in v)})"
    if isinstance(v, dict):
        items = ", ".join(f"{stable_repr(k, depth + 1)}: {stable_repr(x, depth + 1)}"
                          for k, x in v.items())
        return f"{type(v).__qualname__}({{{items}}})"
    if dataclasses.is_dataclass(v):
        fields = ", ".join(f"{f.name}={stable_repr(getattr(v, f.name, None), depth + 1)}"
                           for f in dataclasses.fields(v))
        return f"{type(v).__qualname__}({fields})"
    if type(v).__repr__ is object.__repr__:
        attrs = getattr(v, "__dict__", None)
        inner = stable_repr(attrs, depth + 1) if isinstance(attrs, dict) else ""
        return f"<{type(v).__module__}.{type(v).__qualname__} {inner}>"
    return _ADDRESS.sub("", repr(v))


def program_lines(gm: fx.GraphModule) -> list[str]:
    """The global program as text that is equal on every rank of a correct SPMD
    program: each node's op, literal arguments (aten ops; other ops' integers can be
    ids local to a process) and output shape. A rank-dependent branch, constant or
    shape shows here."""
    out = []
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        shape = _fmt_val(val)
        if n.op == "placeholder":
            out.append(f"{n.name}: input {shape}")
        elif n.op == "get_attr":
            t = getattr(gm, n.target, None)
            text = f"{n.name}: constant {shape or _fmt_val(t)}"
            if isinstance(t, torch.Tensor) and not _torch.is_tracing_tensor(t):
                # a captured tensor is one global value too (NOTE [Per-rank data]): its
                # values, or their digest, are part of the program the ranks compare
                if t.numel() <= 16:
                    text += f" = {t.detach().cpu().flatten().tolist()}"
                else:
                    text += f" with values {value_digests([t])[0]:016x}"
            out.append(text)
        elif n.op == "output":
            out.append(f"output {[_fmt_val(a.meta.get('val')) if isinstance(a, fx.Node) else repr(a) for a in n.args[0]]}")
        else:
            aten = getattr(n.target, "namespace", None) in ("aten", "prims")
            args = ", ".join([_fmt_arg(a, aten) for a in n.args]
                             + [f"{k}={_fmt_arg(v, aten)}" for k, v in n.kwargs.items()])
            out.append(f"{n.name} = {n.target}({args}) -> {shape}")
    return out


def _fmt_val(v) -> str:
    if isinstance(v, torch.Tensor):
        return _fmt_meta(v)
    if isinstance(v, (list, tuple)):
        return "(" + ", ".join(_fmt_val(x) for x in v) + ")"
    return "" if v is None else type(v).__name__


def _fmt_arg(a, literal: bool) -> str:
    if isinstance(a, fx.Node):
        return a.name
    if isinstance(a, (list, tuple)):
        return "[" + ", ".join(_fmt_arg(x, literal) for x in a) + "]"
    if isinstance(a, torch.device):
        return f"device({a.type!r})"
    if not literal and isinstance(a, int) and not isinstance(a, bool):
        return "#"
    return stable_repr(a)
