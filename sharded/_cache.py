"""pjit's program cache (per function, weakly), the run state that outlives a
program's eviction, and the steady-state matcher that lets a training loop's call skip
the full signature."""

from __future__ import annotations

import collections
import inspect
import os
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from sharded import _torch, _tree
from sharded._arguments import Signature
from sharded._fingerprint import ambient
from sharded._program import Forward
from sharded.mesh import Mesh
from sharded.spec import local_slice
from sharded.modes._runner import RunState

# NOTE [The program cache is keyed on the function]
# JAX caches on the function, not on the object jit returns: ``pjit(f, ...)(x)`` in a
# loop must trace once. Programs live in a table keyed weakly on the function (for a
# bound method, on its object, with the function in the key), so they go when the
# function goes; under it, by the pjit configuration (in_specs and out_specs as
# hashable trees, mode, static_argnums) and the call's signature, in an LRU of
# SHARDED_CACHE_SIZE (default 64) programs per function, so 1,000 shapes do not grow
# memory without bound. A function that cannot be weakly referenced or hashed, or a
# configuration that cannot be hashed, falls back to a cache on the pjit object.
# Beside the programs, the table keeps each program key's RunState (NOTE [Runners] in
# sharded/modes/_runner.py), which outlives the program's eviction: a rank that evicts
# a program and rebuilds it keeps its call count, so the ranks' "compile now?"
# questions stay at the same calls (bounded: oldest out). Lookups and inserts take a
# lock; compiles take another (tracing swaps module-level state in torch), so two
# threads never trace at once.

CACHE_SIZE = int(os.environ.get("SHARDED_CACHE_SIZE", "64"))
RUN_STATES_SIZE = 4096
COMPILE_LOCK = threading.RLock()
_LOCK = threading.RLock()


class _Table:
    """One function's programs (an LRU) and their run states."""

    __slots__ = ("programs", "run_states", "__weakref__")

    def __init__(self):
        self.programs: collections.OrderedDict = collections.OrderedDict()
        self.run_states: collections.OrderedDict = collections.OrderedDict()


_TABLES: "weakref.WeakKeyDictionary[Any, _Table]" = weakref.WeakKeyDictionary()


def _anchor(fn) -> tuple | None:
    """(object to key weakly, extra key part) for ``fn``; None if it cannot be."""
    anchor, sub = (fn.__self__, fn.__func__) if inspect.ismethod(fn) else (fn, None)
    try:
        weakref.ref(anchor)
        hash(anchor)
    except TypeError:
        return None
    return anchor, sub


class ProgramCache:
    """One pjit's view of the cache: its function's table under its configuration
    (or a table of its own when the function or configuration cannot be keyed).
    ``trace_count`` counts the programs this pjit has used (traced, or found when
    another pjit of the same function traced them): one per signature, so a count that
    grows with the calls means retracing."""

    def __init__(self, fn, config: tuple | None):
        self._anchor = _anchor(fn)
        self._config = config
        self._own = _Table() if self._anchor is None or config is None else None
        self.trace_count = 0
        self._used: weakref.WeakSet = weakref.WeakSet()

    def table(self) -> _Table:
        if self._own is not None:
            return self._own
        assert self._anchor is not None
        anchor = self._anchor[0]
        with _LOCK:
            table = _TABLES.get(anchor)
            if table is None:
                table = _TABLES[anchor] = _Table()
            return table

    def key(self, sig: Signature) -> tuple:
        sub = self._anchor[1] if self._anchor is not None else None
        return (sub, self._config, sig.key)

    def lookup(self, sig: Signature, name: str, touch: bool = True) -> Forward | None:
        with _LOCK:
            programs = self.table().programs
            key = self.key(sig)
            try:
                entry = programs.get(key)
            except TypeError:
                raise TypeError(
                    f"{name}: non-tensor arguments are static and must be hashable; "
                    f"got an unhashable one in {unhashable(sig)}. Make it a tensor, a tuple "
                    f"or a frozen dataclass."
                ) from None
            if entry is not None:
                if touch:          # (``lower`` runs nothing: it leaves the LRU order alone)
                    programs.move_to_end(key)
                self.count(entry)
            return entry

    def count(self, entry: Forward) -> None:
        if entry not in self._used:
            self._used.add(entry)
            self.trace_count += 1

    def store(self, sig: Signature, entry: Forward) -> None:
        with _LOCK:
            programs = self.table().programs
            programs[self.key(sig)] = entry
            while len(programs) > CACHE_SIZE:
                programs.popitem(last=False)

    def run_state(self, key: tuple) -> RunState:
        with _LOCK:
            table = self.table().run_states
            state = table.get(key)
            if state is None:
                state = table[key] = RunState()
                while len(table) > RUN_STATES_SIZE:
                    table.popitem(last=False)
            return state


def unhashable(sig: Signature) -> str:
    """Which static value of ``sig`` cannot be hashed (for the error)."""
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


# NOTE [The steady-state call]
# A training loop calls one program with the same signature every step, its state
# leaves being the DTensors the last call returned. Such a call is matched against the
# last call's plan (``Steady``) instead of building the full signature, hashing it
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
class Steady:
    mesh: Mesh
    nargs: int
    nums: tuple          # the static argnums, resolved for ``nargs`` arguments
    static: tuple        # their values
    treedef: Any
    ambient: tuple
    entry: "Forward"
    expect: list         # per leaf: a DTensorSpec, ("tensor", shape, dtype, device), ("static", type, value)
    cache: collections.OrderedDict
    key: tuple
    plain: list          # indices of the plain tensor leaves (their values are checked)

    @staticmethod
    def arm(sig: Signature, entry: "Forward", outcome, nargs: int, cache, key) -> "Steady | None":
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
        return Steady(sig.mesh, nargs, sig.static_argnums, sig.static_args, sig.treedef,
                       sig.ambient, entry, expect, cache, key, plain)

    def match(self, args: tuple, kwargs: dict, mesh) -> "tuple[Forward, list, list, list] | None":
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
        if treedef != self.treedef or ambient() != self.ambient:
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
                # local_input's DTensor case, inline (this loop runs per leaf per call;
                # requires_grad was refused above)
                local = _torch.local_tensor(x)
                shards.append(local if local.is_contiguous() else local.contiguous())
            elif t is torch.Tensor:
                if type(want) is not tuple or want[0] != "tensor" or x.shape != want[1] \
                        or x.dtype != want[2] or x.device != want[3] or x.requires_grad \
                        or _torch.is_functorch_wrapped(x):
                    return None
                shards.append(local_slice(x, plan[j], self.entry.mesh))   # (local_input's plain case)
            elif isinstance(x, torch.Tensor) or type(want) is not tuple or want[0] != "static" \
                    or t is not want[1] or not (x is want[2] or x == want[2]):
                return None
        with _LOCK:
            if self.key not in self.cache:
                return None
            self.cache.move_to_end(self.key)
        return self.entry, leaves, shards, self.plain
