"""Local ranks: run a function on N processes of this machine (the laptop path).

``launch(fn, nprocs)`` starts N processes with a gloo (CPU) or NCCL (one GPU per
rank) process group, runs ``fn(*args)`` on each and returns the per-rank results.
``RankPool`` keeps the processes alive between calls, so that tests and notebooks pay
the start-up (~1.5 s for 2 ranks, ~3 s for 4) once. torchrun is the cluster path.
"""

from __future__ import annotations

import os
import queue
import socket
import traceback
from typing import Any, Callable

import torch
import torch.multiprocessing as mp

__all__ = ["launch", "RankPool", "RankError"]


class RankError(RuntimeError):
    """A function raised on one or more local ranks; carries each rank's traceback."""


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
        outbox.put((rank, "ready", None))
        while True:
            item = inbox.get()
            if item is None:
                break
            fn, args, kwargs = item
            try:
                outbox.put(_picklable(rank, "ok", fn(*args, **kwargs)))
            except BaseException as e:  # noqa: BLE001 - reported to the parent
                tb = "".join(traceback.format_exception(e))
                outbox.put(_picklable(rank, "err", (e, tb)))
    except BaseException:  # noqa: BLE001
        outbox.put((rank, "err", (None, traceback.format_exc())))
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        finally:
            # gloo can abort at interpreter exit; leave without running it.
            os._exit(0)


def _picklable(rank, status, value):
    """The message for the parent, checked for pickling here: mp.Queue pickles in a
    background thread, where a failure is only printed and the parent would wait out
    its timeout."""
    from multiprocessing.reduction import ForkingPickler

    msg = (rank, status, value)
    try:
        ForkingPickler.dumps(msg)
        return msg
    except Exception as e:  # noqa: BLE001
        tb = value[1] if status == "err" else ""
        what = "exception" if status == "err" else "result"
        return (rank, "err", (RuntimeError(
            f"rank {rank}'s {what} cannot be sent to the parent process ({e}): "
            f"{value[0] if status == 'err' else type(value).__name__!r:.200}"), tb))


class RankPool:
    """``nprocs`` long-lived local ranks that run functions on request.

    ``pool.run(fn, *args)`` runs ``fn(*args)`` on every rank and returns the list of
    results (rank order). ``fn`` must be importable (a module-level function). If a
    rank raises, ``run`` re-raises rank 0's-or-first failing rank's exception with the
    tracebacks of all failing ranks attached; if the ranks hang past ``timeout``
    seconds, the pool is torn down and TimeoutError is raised (the next ``run``
    starts fresh ranks).
    """

    def __init__(self, nprocs: int, *, backend: str | None = None, threads: int | None = None):
        self.nprocs = nprocs
        self.backend = backend or ("nccl" if _use_nccl(nprocs) else "gloo")
        # One rank per core share: oversubscribed intra-op threads slow everything.
        self.threads = threads or max(1, (os.cpu_count() or 1) // nprocs)
        self._procs: list = []

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
        for box in self._inboxes:
            box.put((fn, args, kwargs))
        return self._collect(timeout, getattr(fn, "__qualname__", repr(fn)))

    def _collect(self, timeout: float, what: str) -> list[Any]:
        results: dict[int, tuple] = {}
        while len(results) < self.nprocs:
            try:
                rank, status, value = self._outbox.get(timeout=timeout)
            except queue.Empty:
                self.close(force=True)
                missing = sorted(set(range(self.nprocs)) - set(results))
                raise TimeoutError(
                    f"local ranks {missing} did not finish {what} within {timeout:.0f} s "
                    f"(a hang or a crash); the rank pool was restarted."
                ) from None
            results[rank] = (status, value)
        failed = {r: v for r, (s, v) in results.items() if s == "err"}
        if failed:
            if what == "start":
                self.close(force=True)
            first = min(failed)
            exc, _ = failed[first]
            report = "\n".join(f"--- rank {r} ---\n{tb}" for r, (_, tb) in sorted(failed.items()))
            if exc is None:
                raise RankError(f"{what} failed on ranks {sorted(failed)}:\n{report}")
            exc.add_note(f"(raised on local ranks {sorted(failed)}; tracebacks:)\n{report}")
            raise exc
        return [results[r][1] for r in range(self.nprocs)]

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
    ``if __name__ == "__main__":`` in scripts).
    """
    with RankPool(nprocs, backend=backend) as pool:
        return pool.run(fn, *args, timeout=timeout, **kwargs)
