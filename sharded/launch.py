"""Local ranks: run a function on N processes of this machine (the laptop path).

``launch(fn, nprocs)`` starts N processes with a gloo (CPU) or NCCL (one GPU per
rank) process group, runs ``fn(*args)`` on each and returns the per-rank results.
``RankPool`` keeps the processes alive between calls, so that tests and notebooks pay
the start-up (~1.5 s for 2 ranks, ~3 s for 4) once. torchrun is the cluster path.

# NOTE [The first failure ends the run]
The parent watches its ranks, not just their results: it polls the result queue in
short steps and checks that every rank that owes a result is alive. The first failure
(an exception, or a rank that died) starts the end of the run:
- a rank that raised has already published its error (``sharded.sync.publish``);
  if the others have not all reported within ``RELEASE_AFTER`` seconds (they may be
  blocked in a collective with it), the parent tells it to release its process
  groups, so that theirs fail and they raise RankFailedError with its cause;
- ranks still running ``GRACE`` seconds after the first failure are killed.
The parent then raises the root cause (the first exception that is not an echo of
another rank's failure, or the death of a rank) with every rank's outcome as a
note. A pool whose ranks died, were killed or released their groups starts fresh
ranks on its next run; one whose ranks all raised (the same bad input everywhere)
stays up.
"""

from __future__ import annotations

import os
import queue
import socket
import sys
import time
import types
import traceback
from typing import Any, Callable

import torch
import torch.multiprocessing as mp

from sharded import sync
from sharded.errors import RankError
from sharded.sync import RankFailedError, add_note

__all__ = ["launch", "RankPool", "RankError"]

RELEASE_AFTER = 1.0      # s after the first failure before failed ranks release their groups
GRACE = 15.0             # s after the first failure before ranks still running are killed
_POLL = 0.1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, backend, threads, inbox, outbox):
    import torch.distributed as dist

    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    torch.set_num_threads(threads)
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    try:
        dist.init_process_group(backend, rank=rank, world_size=world)
        outbox.put((rank, "ready", None, False))
        while True:
            item = inbox.get()
            if item is None:
                break
            if item[0] == "release":
                sync.release(f"rank {rank} failed in {item[1]}", wait=5.0)
                continue
            _, job, fn, args, kwargs = item
            sync.set_epoch(job)
            what = getattr(fn, "__qualname__", repr(fn))
            try:
                result = fn(*args, **kwargs)
                outbox.put(_picklable(rank, "ok", result, released=sync.released() is not None))
            except BaseException as e:  # noqa: BLE001 - reported to the parent
                sync.publish(e, what, "in the launched function")
                tb = "".join(traceback.format_exception(e))
                outbox.put(_picklable(rank, "err", (e, tb), released=sync.released() is not None))
    except BaseException:  # noqa: BLE001
        outbox.put((rank, "err", (None, traceback.format_exc()), True))
    finally:
        try:
            if dist.is_initialized() and sync.released() is None:
                dist.destroy_process_group()
        finally:
            # gloo can abort at interpreter exit; leave without running it.
            os._exit(0)


def _picklable(rank, status, value, released: bool = False):
    """The message for the parent, checked for pickling here: mp.Queue pickles in a
    background thread, where a failure is only printed and the parent would wait out
    its timeout."""
    from multiprocessing.reduction import ForkingPickler

    msg = (rank, status, value, released)
    try:
        ForkingPickler.dumps(msg)
        return msg
    except Exception as e:  # noqa: BLE001
        tb = value[1] if status == "err" else ""
        what = "exception" if status == "err" else "result"
        return (rank, "err", (RuntimeError(
            f"rank {rank}'s {what} cannot be sent to the parent process ({e}): "
            f"{value[0] if status == 'err' else type(value).__name__!r:.200}"), tb), released)


class RankPool:
    """``nprocs`` long-lived local ranks that run functions on request.

    ``pool.run(fn, *args)`` runs ``fn(*args)`` on every rank and returns the list of
    results (rank order). ``fn`` must be importable (a module-level function). If a
    rank raises or dies, ``run`` ends the run within seconds (NOTE [The first failure
    ends the run]) and raises the root cause: the failing rank's own exception, with
    every rank's outcome and traceback as a note, or RankError for a rank that died.
    If the ranks are still running after ``timeout`` seconds, the pool is torn down
    and TimeoutError is raised. Either way the next ``run`` starts fresh ranks when
    the old ones cannot go on.
    """

    def __init__(self, nprocs: int, *, backend: str | None = None, threads: int | None = None):
        self.nprocs = nprocs
        self.backend = backend or ("nccl" if _use_nccl(nprocs) else "gloo")
        # One rank per core share: oversubscribed intra-op threads slow everything.
        self.threads = threads or max(1, (os.cpu_count() or 1) // nprocs)
        self._procs: list = []
        self._jobs = 0

    def start(self, timeout: float = 120.0) -> "RankPool":
        """Start the ranks (if not running) and wait until each has joined."""
        if self._procs:
            return self
        ctx = mp.get_context("spawn")
        self._outbox = ctx.Queue()
        self._inboxes = [ctx.Queue() for _ in range(self.nprocs)]
        port = _free_port()
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(r, self.nprocs, port, self.backend, self.threads, self._inboxes[r], self._outbox),
                daemon=True,
            )
            for r in range(self.nprocs)
        ]
        for p in self._procs:
            p.start()
        self._collect(timeout, "start")
        return self

    def run(self, fn: Callable, *args, timeout: float = 300.0, **kwargs) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; the results in rank order."""
        self.start()
        self._jobs += 1
        for box in self._inboxes:
            box.put(("job", self._jobs, fn, args, kwargs))
        return self._collect(timeout, getattr(fn, "__qualname__", repr(fn)))

    def _collect(self, timeout: float, what: str) -> list[Any]:
        results: dict[int, tuple] = {}       # rank -> (status, value, released)
        order: list[int] = []                # ranks in the order they failed
        start = time.monotonic()
        first_failure = None
        released_sent = False
        while len(results) < self.nprocs:
            now = time.monotonic()
            try:
                rank, status, value, released = self._outbox.get(timeout=_POLL)
                results[rank] = (status, value, released)
                if status == "err":
                    order.append(rank)
                    first_failure = first_failure or time.monotonic()
                continue
            except queue.Empty:
                pass
            for r, p in enumerate(self._procs):
                if r not in results and not p.is_alive():
                    results[r] = ("died", p.exitcode, True)
                    order.append(r)
                    first_failure = first_failure or now
            if first_failure is not None and len(results) < self.nprocs:
                if not released_sent and now - first_failure > RELEASE_AFTER:
                    released_sent = True
                    for r in order:
                        if results[r][0] == "err":
                            self._inboxes[r].put(("release", what))
                if now - first_failure > GRACE:
                    for r, p in enumerate(self._procs):
                        if r not in results:
                            p.kill()
                            results[r] = ("killed", None, True)
                            order.append(r)
            if now - start > timeout and len(results) < self.nprocs:
                self.close(force=True)
                missing = sorted(set(range(self.nprocs)) - set(results))
                raise TimeoutError(
                    f"local ranks {missing} did not finish {what} within {timeout:.0f} s "
                    f"(a hang); the rank pool was restarted."
                )
        if not order:
            if any(results[r][2] for r in results):     # a rank caught a failure: groups closed
                self.close(force=True)
            return [results[r][1] for r in range(self.nprocs)]
        broken = what == "start" or released_sent or any(
            results[r][0] in ("died", "killed") or results[r][2] for r in results)
        if broken:
            self.close(force=True)
        raise self._failure(results, order, what, broken)

    def _failure(self, results: dict, order: list, what: str, broken: bool) -> BaseException:
        def summary(r):
            status, value, _ = results[r]
            if status == "died":
                return f"--- rank {r}: died (exit code {value}) ---"
            if status == "killed":
                return f"--- rank {r}: still running {GRACE:.0f} s after the first failure; killed ---"
            if status == "ok":
                return f"--- rank {r}: finished ---"
            exc, tb = value
            return f"--- rank {r} ---\n{tb.rstrip()}"

        def is_root(r):
            status, value, _ = results[r]
            return status == "died" or (status == "err" and not isinstance(value[0], RankFailedError))

        root = next((r for r in order if is_root(r)), order[0])
        report = "\n".join(summary(r) for r in sorted(results))
        tail = " The rank pool will start fresh ranks." if broken else ""
        status, value, _ = results[root]
        if status == "died":
            return RankError(f"local rank {root} died (exit code {value}) while running "
                             f"{what}.{tail}\n{report}")
        if status == "killed" or value[0] is None:
            return RankError(f"{what} failed on local ranks {sorted(order)}.{tail}\n{report}")
        exc = value[0]
        failed = sorted(r for r in results if results[r][0] != "ok")
        add_note(exc, f"(raised on local rank {root}; ranks {failed} failed; every rank's "
                 f"outcome:){tail}\n{report}")
        return exc

    def close(self, force: bool = False) -> None:
        """Stop the ranks (``force``: kill them without waiting)."""
        if not self._procs:
            return
        if not force:
            for box in self._inboxes:
                box.put(None)
            for p in self._procs:
                p.join(timeout=10)
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self._procs = []

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()


def _use_nccl(nprocs: int) -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() >= nprocs


def launch(fn: Callable, nprocs: int, *args, backend: str | None = None,
           timeout: float = 3600.0, **kwargs) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``nprocs`` local ranks; return their results.

    ``backend`` defaults to NCCL when there is one GPU per rank, else gloo on CPU.
    ``fn`` must be importable by the child processes (defined at module level; under
    ``if __name__ == "__main__":`` in scripts). A rank that raises or dies ends the
    run within seconds; its exception (or RankError) is raised here, with every
    rank's outcome as a note. ``timeout`` bounds a run that hangs.
    """
    with RankPool(nprocs, backend=backend) as pool:
        return pool.run(fn, *args, timeout=timeout, **kwargs)


# NOTE [sharded.launch is the module and the function]
# ``sharded.launch(fn, nprocs)`` runs ``fn`` on local ranks, and ``sharded.launch`` is
# also this module (``sharded.launch.RankPool``, ``sharded.launch.GRACE``,
# ``import sharded.launch as m``). Had the package bound the function to the name, the
# module would be reachable only through ``sys.modules`` (``mock.patch("sharded.launch.
# GRACE")`` and ``import sharded.launch as m`` both found the function). So the module
# is callable instead: calling it calls ``launch``.
class _CallableModule(types.ModuleType):
    def __call__(self, fn: Callable, nprocs: int, *args, **kwargs) -> list[Any]:
        return launch(fn, nprocs, *args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
