"""What runs a partitioned program each call: the FX graph, or inductor's code.

# NOTE [Runners]
Every mode takes ``compile=``:

- ``False``: the local graph's own Python code, one op call per node. No compile
  cost; per-op overhead of a few microseconds.
- ``True``: ``torch.compile(graph, backend="inductor", fullgraph=True)`` from the
  first call: elementwise chains fused into C++ (or Triton) kernels, buffers reused.
  Compiling costs seconds to a minute on CPU at the first call; inductor's on-disk
  caches make a later process's compile of the same program several times faster.
- ``"auto"`` (the default): the graph for the first ``SHARDED_COMPILE_AFTER`` calls
  (default 100), then inductor, if the program has at least
  ``SHARDED_COMPILE_MIN_OPS`` compute ops (default 32). A test, a notebook cell or a
  short run never pays a compile; a training run pays it once, at a step every rank
  reaches together (the call count is the same on every rank, the ranks agree on
  every call), and runs compiled code for the thousands of steps after. A program of
  a handful of ops gains nothing from fusion and stays a graph.

Measured on the 2-core CPU machine (benchmarks/README.md): inductor takes the MLP
8x1024 data-parallel step from 1.05x DDP's time to 0.63x, a small GPT's from 1.03x to
0.93x; it compiles in 10-80 s cold and 8-13 s with warm caches. At ~10% of a 30 ms
step, a 10 s compile pays after ~3,000 steps: not in a test, easily in a training run.

If the compile fails (no C++ compiler on the machine, an op inductor cannot lower),
the runner warns once and keeps the graph: the failure comes before any compiled code
runs, so no collective was issued and every rank still runs the same collectives in
the same order. The compiled code issues the graph's collectives in the graph's order
(inductor keeps functional collectives where they are unless asked to reorder), so a
rank may run compiled code while another still runs the graph.
"""

from __future__ import annotations

import os
import time
import warnings

import torch
import torch.fx as fx

from sharded import _torch

CHOICES = (False, True, "auto")


def compile_after() -> int:
    return int(os.environ.get("SHARDED_COMPILE_AFTER", "100"))


def compile_min_ops() -> int:
    return int(os.environ.get("SHARDED_COMPILE_MIN_OPS", "32"))


def check_compile(value, api: str):
    if not (value is False or value is True or (isinstance(value, str) and value == "auto")):
        raise ValueError(
            f"{api}: compile must be False (run the graph), True (inductor from the first "
            f"call) or 'auto' (the graph, then inductor after {compile_after()} calls for "
            f"programs of {compile_min_ops()}+ ops); got {value!r}."
        )
    return value


def compute_ops(graph: fx.GraphModule) -> int:
    """The program's ops that inductor could fuse or plan (not collectives, waits,
    getitems or views of nothing)."""
    skip = set(_torch.COLLECTIVE_OPS) | {_torch.WAIT_OP}
    return sum(1 for n in graph.graph.nodes
               if n.op == "call_function" and n.target not in skip
               and getattr(n.target, "__name__", "") != "getitem")


def make_runner(graph: fx.GraphModule, compile, name: str = "pjit"):
    """What runs ``graph`` each call, for ``compile`` (NOTE [Runners])."""
    if compile is False:
        return graph
    if compile is True:
        return Runner(graph, name, after=0, min_ops=0)
    return Runner(graph, name, after=compile_after(), min_ops=compile_min_ops())


class Runner:
    """Runs the graph, and inductor's compiled code from call ``after`` on (call 0:
    from the first call) if the graph has ``min_ops`` compute ops or more."""

    def __init__(self, graph: fx.GraphModule, name: str, *, after: int, min_ops: int):
        self.graph = graph
        self.name = name
        self.after = after
        self.calls = 0
        self.fn = graph
        self.kind = "graph"            # "graph", "inductor" or "graph (compile failed)"
        self.compile_seconds: float | None = None   # inductor's compile (its first call)
        self._compiled = None
        if compute_ops(graph) < min_ops:
            self.after = -1            # never

    def __call__(self, *args):
        first = self.calls == self.after
        if first:
            self._compiled = torch.compile(self.graph, backend="inductor", fullgraph=True)
            self.kind = "inductor"
        self.calls += 1
        if self._compiled is not None:
            try:
                if not first:
                    return self._compiled(*args)
                t0 = time.perf_counter()
                out = self._compiled(*args)
                self.compile_seconds = time.perf_counter() - t0     # (and one run)
                return out
            except Exception as e:
                if not _torch.is_compile_failure(e):
                    raise
                warnings.warn(f"{self.name}: inductor could not compile the program, so it "
                              f"runs as a graph ({type(e).__name__}: {str(e)[:300]})",
                              stacklevel=2)
                self._compiled = None
                self.kind = "graph (compile failed)"
        return self.graph(*args)
