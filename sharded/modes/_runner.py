"""What runs a partitioned program each call: the FX graph, or inductor's code.

# NOTE [Runners]
Every mode takes ``compile=``:

- ``False``: the local graph's own Python code, one op call per node. No compile
  cost; per-op overhead of a few microseconds.
- ``True``: inductor's code from the first call: elementwise chains fused into C++
  (or Triton) kernels, buffers reused.
  Compiling costs seconds to a minute on CPU at the first call; inductor's on-disk
  caches make a later process's compile of the same program several times faster.
- ``"auto"`` (the default): rent, then buy. The program runs as a graph until the
  time spent running it reaches ``SHARDED_COMPILE_BUDGET`` seconds (default 20, about
  what inductor takes to compile a small train step on CPU with warm caches), then
  inductor compiles it. This is the ski-rental rule: whatever the number of calls
  turns out to be, the total time (runs + compile) stays within a small factor of
  the better of "never compile" and "compile at once" (2x if the decision were taken
  at every call; about 3x here, as it is asked at calls 1, 2, 4, 8, ... and the
  graph may run up to twice the budget first), without knowing the number of calls
  in advance. A test, a notebook cell or a short run never pays a compile; a
  training run pays it once and runs compiled code for the thousands of steps after.
  Programs of fewer than ``SHARDED_COMPILE_MIN_OPS`` compute ops (default 32) gain
  nothing from fusion and stay graphs. The ranks decide together: their clocks
  differ, so at calls 1, 2, 4, 8, ... (every rank runs each program the same number
  of times) they all-reduce "my budget is spent" (MAX, one tiny collective over the
  agreement's group) and switch at the same call. pjit keeps each program's count and
  decision across rebuilds of its cache entry, so a rank that evicted and rebuilt a
  program stays in step with the others (and runs the compiled code again if they
  do).

Measured on the 2-core CPU machine (README, 2026-11-24): inductor takes the MLP
8x1024 data-parallel step from 1.10x DDP's time to 1.00x and its tensor-parallel step
from 0.50x eager DTensor's to 0.48x; on gpt-tiny the difference is within the
machine's noise (1.15x vs 1.06x DDP that day, 1.05x vs 1.16x the day before). It
compiles in 10-80 s cold and 1-13 s with warm caches.

A donated optimizer step runs torch's fused AdamW in place on its donated inputs,
which inductor in torch 2.13 cannot compile ("mutating a non-functional tensor with a
functional tensor"): "auto" keeps such a program a graph (donation already removed
its copies), and ``compile=True`` keeps the fused AdamW functional (the parameters and
moments then get fresh storage; the donated inputs are still consumed).

Compiling ahead. The switch compiles the local graph with inductor directly
(``_torch.compile_ahead``: ``compile_fx`` on the call's inputs, whose shapes and
strides the code then asserts; pjit's inputs are always contiguous shards), before
anything runs, and the ranks then agree on the outcome (``sync.agree_compiled``, one
small all_gather): inductor's code runs only if every rank compiled, otherwise every
rank warns, naming the ranks that failed and why, and keeps the graph. So the ranks
of a program always run the same code, whose collectives are in the same order:
``torch.compile`` compiles inside the first call's run, where a compile that failed
on one rank only (a compiler killed for memory, a full disk, a cache written by two
ranks at once) would leave that rank on the graph while the others ran inductor's
code. The agreement waits over a group of its own with a long timeout
(``SHARDED_COMPILE_TIMEOUT``, default 3600 s), so a rank whose compile takes minutes
longer (a cold cache) is waited for rather than timed out by the 300 s of the
per-call agreement; a rank that dies while compiling closes its connections and the
others stop at once with ``RankFailedError``. Nothing ran before the agreement, so a
failure anywhere leaves no collective half-issued. Compiling the aten graph directly
also skips dynamo's retrace of it.

Limit: a rank that evicted a compiled program from its cache and rebuilt it compiles
again on its own (the others run the code they have); if that compile fails, this
rank alone runs the graph, with a warning that says so.
"""

from __future__ import annotations

import copy
import os
import time
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.fx as fx

from sharded import _registry, _torch, sync

FAILED = "graph (compile failed)"


def compile_budget() -> float:
    return float(os.environ.get("SHARDED_COMPILE_BUDGET", "20"))


def compile_min_ops() -> int:
    return int(os.environ.get("SHARDED_COMPILE_MIN_OPS", "32"))


def check_compile(value, api: str):
    if not (value is False or value is True or (isinstance(value, str) and value == "auto")):
        raise ValueError(
            f"{api}: compile must be False (run the graph), True (inductor from the first "
            f"call) or 'auto' (the graph, then inductor once the program has run "
            f"{compile_budget():g} s as a graph); got {value!r}."
        )
    return value


def compute_ops(graph: fx.GraphModule) -> int:
    """The program's ops that inductor could fuse or plan (not collectives, waits or
    getitems)."""
    skip = set(_torch.COLLECTIVE_OPS) | {_torch.WAIT_OP}
    return sum(1 for n in graph.graph.nodes
               if n.op == "call_function" and n.target not in skip
               and getattr(n.target, "__name__", "") != "getitem")


def make_runner(graph: fx.GraphModule, compile, name: str = "pjit", mesh=None,
                state: "RunState | None" = None):
    """What runs ``graph`` each call, for ``compile`` (NOTE [Runners]). ``state``
    carries the call count and the decision across rebuilds of the same program
    (pjit keeps one per program key: an entry evicted from its cache on one rank
    only must not restart that rank's count)."""
    if compile is False:
        return graph
    state = state if state is not None else RunState()
    if compile is True:
        return Runner(graph, name, mesh, state, budget=0.0, min_ops=0)
    return Runner(graph, name, mesh, state, budget=compile_budget(), min_ops=compile_min_ops())


FIRST_CHECK = 1       # "auto" asks at calls 1, 2, 4, 8, ...


@dataclass
class RunState:
    """A program's runs on this rank, kept across rebuilds of its runner: the ranks
    run each program the same number of times, so these agree across ranks."""

    calls: int = 0
    graph_seconds: float = 0.0     # spent running the graph
    next_check: int | None = None  # the call that asks next; -1: never
    decided: str | None = None     # "inductor" or "graph (compile failed)", once decided


class Runner:
    """Runs the graph until the time it has spent running it reaches ``budget``
    seconds (0: from the first call), then inductor's code; programs of fewer than
    ``min_ops`` compute ops stay graphs. The ranks of ``mesh`` decide together."""

    def __init__(self, graph: fx.GraphModule, name: str, mesh, state: RunState, *,
                 budget: float, min_ops: int):
        self.graph = graph
        self.name = name
        self.mesh = mesh
        self.budget = budget
        self.state = state
        self.compile_seconds: float | None = None   # inductor's compile (its first call)
        self._compiled = None
        # a pjit forward takes its call's Agreement as its last input (NOTE [The
        # agreement overlaps the program] in sharded/sync.py)
        self._agreement = any(n.meta.get(_registry.META_AGREEMENT) for n in graph.graph.nodes)
        if state.next_check is None:
            state.next_check = 0 if budget <= 0 else FIRST_CHECK
            if compute_ops(graph) < min_ops or (budget > 0 and _fused_inplace(graph)):
                state.next_check = -1      # never

    @property
    def kind(self) -> str:
        """``"graph"``, ``"inductor"`` or ``"graph (compile failed)"``."""
        if self._compiled is not None:
            return "inductor"
        return FAILED if self.state.decided == FAILED else "graph"

    def _worth_compiling(self) -> bool:
        """Has the graph run for ``budget`` seconds on some rank? Every rank asks at
        the same call (the ranks run each program the same number of times) and gets
        the same answer (one small all-reduce at calls 1, 2, 4, 8, ...)."""
        want = self.state.graph_seconds >= self.budget
        group = sync.group_for(self.mesh) if self.mesh is not None else None
        if group is not None:
            flag = torch.tensor([int(want)])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
            want = bool(flag.item())
        return want

    def _switch_now(self, agreement) -> bool:
        """Compile at this call? Yes when the ranks decided so earlier (this runner was
        rebuilt after the switch), for ``compile=True``, or when asked and agreed."""
        # where this call communicates (the check's all-reduce, the compile's
        # agreement), the call's own agreement comes first, before any state changes
        # (NOTE [The agreement overlaps the program])
        st = self.state
        if st.decided == "inductor" or self.budget <= 0:
            sync.agreed(agreement)
            return True
        if st.calls != st.next_check:
            return False
        sync.agreed(agreement)
        st.next_check *= 2
        return self._worth_compiling()

    def __call__(self, *args):
        st = self.state
        agreement, inputs = (args[-1], args[:-1]) if self._agreement else (None, args)
        if self._compiled is None and (st.next_check != -1 or st.decided == "inductor") \
                and self._switch_now(agreement):
            return self._first_compiled_call(args, inputs)
        if self._compiled is not None:
            sync.agreed(agreement)      # (inductor's code leaves out the agreement point)
            st.calls += 1
            return self._compiled(*inputs)
        t0 = time.perf_counter()
        out = self.graph(*args)
        # counted once it ran: the ranks count runs alike (the compile checks at calls
        # 1, 2, 4, ... are collectives), and a call that its agreement stopped inside
        # the graph was no run on any rank
        st.calls += 1
        st.graph_seconds += time.perf_counter() - t0
        return out

    def _first_compiled_call(self, args, inputs):
        """Compile ahead of this call's run, agree on the outcome, then run: inductor's
        code when every rank compiled, else the graph on every rank (NOTE [Runners],
        "Compiling ahead")."""
        st = self.state
        rebuilt = st.decided == "inductor"      # the ranks agreed before this rebuild
        st.decided, st.next_check = "inductor", -1
        st.calls += 1
        t0 = time.perf_counter()
        try:
            compiled, error = _torch.compile_ahead(_for_inductor(self.graph), inputs), None
        except Exception as e:  # noqa: BLE001 - nothing ran: every failure is a failed compile
            compiled, error = None, f"{type(e).__name__}: {str(e)[:300]}"
        seconds = time.perf_counter() - t0
        if rebuilt:         # (the other ranks run the code they compiled before)
            failed = [] if error is None else [(-1, error)]
        else:
            failed = sync.agree_compiled(self.mesh, self.name, error)
        if failed:
            if rebuilt:
                where = f"on this rank, which rebuilt it ({error})"
            else:
                where = "on every rank (" + "; ".join(f"rank {r}: {err}" for r, err in failed) + ")"
            warnings.warn(f"{self.name}: inductor could not compile the program, so it "
                          f"runs as a graph {where}", stacklevel=3)
            st.decided = FAILED
            return self.graph(*args)
        self._compiled = compiled
        self.compile_seconds = seconds
        return compiled(*inputs)


def _for_inductor(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of the local program for inductor (``gm`` stays the program that
    ``as_text`` shows and that runs if the compile fails). AOTAutograd refuses
    mutating ops with alias annotations: an all-reduce that the passes made in place
    (NOTE [All-reduces in place]: nothing reads its input afterwards) goes back to its
    functional form, which inductor reinplaces itself. The call's agreement point is a
    Python call inductor does not compile: it is left out with its input, and the
    runner checks the agreement before it runs the compiled code."""
    module = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    for n in list(module.graph.nodes):
        if n.op == "call_function" and n.target is _torch.c10d_functional.all_reduce_.default:
            n.target = _torch.c10d_functional.all_reduce.default
        elif n.meta.get(_registry.META_AGREEMENT):
            agreement = n.args[0]           # (the program's last input: the runner keeps it)
            module.graph.erase_node(n)
            module.graph.erase_node(agreement)
    module.recompile()
    return module


def _fused_inplace(graph: fx.GraphModule) -> bool:
    """Does the program run torch's in-place fused AdamW (a donated optimizer step,
    NOTE [Fused optimizer kernels in place])? Inductor in torch 2.13 cannot compile it
    ("mutating a non-functional tensor with a functional tensor"); such a program
    already updates its state in place, and "auto" keeps it a graph."""
    return any(n.op == "call_function"
               and n.target in _torch.FUSED_ADAMW_IN_PLACE.values()
               for n in graph.graph.nodes)
