"""Cross-rank agreement, and failures that reach every rank.

Every rank builds and runs its own program. Two things would otherwise hang the
others: a rank that calls with another signature (another shape, another static
value, a cache hit where the others miss), and a rank that fails, in compile or in a
step, while the others wait in a collective. This module turns both into exceptions
on every rank, within seconds, carrying the cause.

# NOTE [Agreement on every call]
Before a program runs, the ranks of its mesh all-reduce (MAX) a pair ``[t, -t]`` of
int64 over a gloo group of their own (``group_for``): ``t`` is a 62-bit digest of
everything that must be equal on every rank (the program's fingerprint, how the
inputs will be redistributed, the random state). One tiny collective per call; the
ranks compare ``max(t) == min(t)``. Only when they differ, or some rank failed to
build its program, or the random seed must be settled, do they exchange the full
description (``all_gather_objects``): every rank then raises the same verdict, the
failing rank its own exception, the others ``RankFailedError`` with its error and
traceback, or ``RankMismatchError`` with the first differing line. Because it runs
on every call, a rank that hits its cache while another misses cannot slip past it.

# NOTE [The agreement overlaps the program]
Blocking on the agreement cost every call a wait with nothing to do: 0.5-3 ms of a
13 ms data-parallel GPT step on 2 gloo ranks (each wake-up of a blocked rank costs
time on a busy machine; the step without it took 1.4 ms less CPU). Where nothing
needs the verdict before the program starts (no random seed to settle, no input to
redistribute, not a differentiable call), ``agree_async`` issues the same all-reduce
without waiting and returns an ``Agreement``, which the program takes as its last
input; ``agreed(agreement)`` waits for the verdict and checks it where the program is
about to communicate or write: pjit puts a call to it just before the first op of
every local program that is not a pure aten op (a collective, an in-place write that
may land in a donated input, another namespace's op; the program's own compute
before that point overlaps the agreement), and a runner that runs inductor's code
calls it before that code. No collective of the program, no redistribution of an
input and no write into a donated input happens before the verdict, so ranks that
disagree still never meet in a wrong collective: every rank raises the same verdict
there, and that error (the ``Agreement`` records that it failed) leaves the process groups usable,
the donated inputs the caller's, and the runner's count of runs (its compile checks
are collectives at calls 1, 2, 4, ...) as it was. The price: a rank that disagrees
computes the program's opening local ops before it raises.

# NOTE [Failures reach every rank]
A rank that fails while its program runs (after the agreement: an IndexError in its
shard, a KeyboardInterrupt) cannot tell the others through a collective: they are
blocked in one. It publishes its error and traceback to the c10d store (which every
rank can read) and then releases its process groups (``_torch.release_process_groups``):
gloo closes their connections, and a peer blocked on one fails within a second. The
peer sees a communication error, reads the store and raises ``RankFailedError`` with
the failing rank's own error; it releases its groups too, so ranks further away fail
as well. A rank that died (killed, ``os._exit``) publishes nothing: its peers see the
connection close and say so. After a release the process cannot communicate any
more: later calls raise at once (``check_usable``); ``launch``/``RankPool`` start
fresh ranks. The agreement's own group has a bounded timeout
(``SHARDED_SYNC_TIMEOUT``, default 300 s), the last resort when a rank is stuck
without failing.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import hashlib
import os
import pickle
import sys
import threading
import traceback as _traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from sharded import _torch
from sharded.errors import RankFailedError, RankMismatchError  # noqa: F401  (sync.RankMismatchError: re-exported)

__all__ = ["RankMismatchError", "RankFailedError", "Outcome", "Agreement", "agree", "agree_async", "agreed",
           "exchange", "run_guarded",
           "check_usable", "publish", "release", "released", "group_for"]

FORCE = 1 << 62                     # a token that makes every rank take the full exchange
_MASK = FORCE - 1




# ---------------------------------------------------------------------------
# Agreement
# ---------------------------------------------------------------------------


@dataclass
class Outcome:
    """What a rank brings to the agreement of one call.

    - ``program``: a digest (< 2**62) of the program and of how this call's inputs
      are laid out; equal on every rank of a correct SPMD program.
    - ``lines``: the readable form of that digest, computed only on a mismatch.
    - ``rng``: ``(seed or None, offset, this rank's torch.initial_seed())`` when the
      program draws random numbers, else None.
    - ``values``: ``(path, digest)`` of each input that must hold the same values on
      every rank (a plain tensor given as one global value: NOTE [Per-rank data] in
      sharded/data.py); ranks that differ only here get an error naming the input.
    """

    program: int
    lines: Callable[[], list[str]]
    rng: tuple | None = None
    values: tuple = ()

    def token(self) -> int:
        """``program`` with the ``values`` folded in: what the ranks compare."""
        return token(self.program, self.values) if self.values else self.program


def token(*parts) -> int:
    """A stable (not per-process salted) 62-bit digest of ``parts``' text."""
    data = "\x1f".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") & _MASK


def agree(mesh, api: str, outcome) -> list | None:
    """All ranks of ``mesh`` call this once per call of a program, with an
    ``Outcome`` or the exception that stopped them before running. Returns None when
    every rank brought the same program and random state (the common, one-collective
    path); after a full exchange, the list of every rank's ``rng`` (to settle the
    seed). Otherwise raises on every rank (see NOTE [Agreement on every call]).
    ``mesh`` None: the world (a rank that could not even find its mesh)."""
    issued = _issue(mesh, api, outcome)
    if issued is None:                         # one rank: nothing to compare
        if isinstance(outcome, BaseException):
            raise outcome
        return [outcome.rng] if outcome.rng is not None and outcome.rng[0] is None else None
    return _verdict(issued, api, outcome)


def _issue(mesh, api: str, outcome):
    """Start the agreement's all-reduce of ``[t, -t]``; ``(work, buf, group)``, or None
    for a mesh of one rank."""
    check_usable(api)
    if mesh is not None:
        mesh.require_ranks(api)        # an abstract mesh's collectives are fakes
    group = group_for(mesh)
    if group is None:
        return None
    if isinstance(outcome, BaseException):
        t = FORCE
    elif outcome.rng is None:
        t = outcome.token()
    elif outcome.rng[0] is None:
        t = FORCE                              # the seed must be settled together
    else:
        t = token(outcome.token(), outcome.rng[0], outcome.rng[1])
    buf = torch.tensor([t, -t], dtype=torch.int64)
    try:
        work = dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=group, async_op=True)
    except Exception as e:  # noqa: BLE001 - a peer failed or died
        raise _peer_failure(api, e, "before running its program") from None
    return work, buf, group


def _verdict(issued, api: str, outcome) -> list | None:
    """Wait for the all-reduce ``_issue`` started: None when every rank agrees, else
    the full exchange (its list of random states, or the verdict raised)."""
    work, buf, group = issued
    try:
        work.wait()
    except Exception as e:  # noqa: BLE001 - a peer failed or died
        raise _peer_failure(api, e, "before running its program") from None
    hi, neg_lo = buf.tolist()
    if hi == -neg_lo and hi < FORCE:
        return None
    return _exchange(group, api, outcome)


class Agreement:
    """One call's agreement as a value (NOTE [The agreement overlaps the program]):
    ``agree_async`` returns it, the program takes it as its last input, and its
    ``check()`` waits for the verdict where the program first communicates or writes.
    ``states``: the random states when the verdict came at once (``agree``'s return);
    ``failed``: the verdict was that the ranks disagree (so the call never ran: the
    process groups stay usable and donated inputs stay the caller's)."""

    __slots__ = ("_issued", "_api", "_outcome", "states", "failed")

    def __init__(self, issued, api: str, outcome, states: list | None = None):
        self._issued, self._api, self._outcome = issued, api, outcome
        self.states = states
        self.failed = False

    def check(self) -> None:
        """Wait for the verdict (the first time; later calls return at once). Raises
        on every rank, as ``agree`` does, where the ranks disagree."""
        issued = self._issued
        if issued is None:
            return
        self._issued = None
        try:
            _verdict(issued, self._api, self._outcome)
        except BaseException:
            self.failed = True
            raise


def agree_async(mesh, api: str, outcome) -> Agreement:
    """``agree``, with the verdict checked later, by the returned ``Agreement``, where it
    can be (NOTE [The agreement overlaps the program]): an outcome that carries random
    state (a seed to settle) or an exception takes ``agree``'s blocking path."""
    if mesh is None or isinstance(outcome, BaseException) or outcome.rng is not None:
        return Agreement(None, api, outcome, agree(mesh, api, outcome))
    return Agreement(_issue(mesh, api, outcome), api, outcome)


def agreed(agreement: Agreement | None) -> None:
    """Check ``agreement`` (None: the call agreed already, blocking): the target of a
    program's agreement point."""
    if agreement is not None:
        agreement.check()


def exchange(group, api: str, outcome, *, failed: str = " to build its program",
             error=None, comm_error=None) -> list:
    """Every rank's ``outcome`` (picklable), in the group's rank order, as ``(rank,
    outcome)``; or, when some rank brought an exception instead, raise on every rank:
    that rank its own exception, the others ``RankFailedError`` naming the first failed
    rank ("rank 1 failed{failed}, so rank 0 stops too: ..."), or ``error(message)``
    when given. A communication failure raises ``comm_error(e)`` when given, else as a
    peer's failure. The one cross-rank exchange behind pjit's agreement (its full
    exchange) and checkpoint's."""
    me = dist.get_rank()
    if isinstance(outcome, BaseException):
        payload: tuple = ("error", me, _describe(outcome), _format_tb(outcome))
    else:
        payload = ("ok", me, outcome)
    try:
        gathered = all_gather_objects(payload, group)
    except Exception as e:  # noqa: BLE001 - a peer failed or died
        if comm_error is not None:
            raise comm_error(e) from None
        raise _peer_failure(api, e, "before running its program") from None
    errors = [p for p in gathered if p[0] == "error"]
    if errors:
        if isinstance(outcome, BaseException):
            raise outcome
        _, r, err, tb = errors[0]
        message = (f"{api}: rank {r} failed{failed}, so rank {me} stops too:\n  {err}"
                   + (f"\n(and {len(errors) - 1} other rank(s))" if len(errors) > 1 else ""))
        if error is not None:
            raise error(message) from None
        raise RankFailedError(message, rank=r, error=err, remote_traceback=tb) from None
    return [(p[1], p[2]) for p in gathered]


def _exchange(group, api: str, outcome) -> list:
    if not isinstance(outcome, BaseException):
        outcome = (outcome.program, outcome.lines(), outcome.rng, outcome.values)
    # ("ok", rank, program, lines, rng, values) per rank
    gathered = [("ok", r, *o) for r, o in exchange(group, api, outcome)]
    if len({p[2] for p in gathered}) > 1:
        raise RankMismatchError(f"{api}: ranks called it with different arguments or built "
                                f"different programs.\n" + _diff(gathered)) from None
    if len({p[5] for p in gathered}) > 1:
        raise RankMismatchError(_values_differ(api, gathered)) from None
    return [p[4] for p in gathered]


def _values_differ(api: str, gathered) -> str:
    """The error for plain inputs whose values differ across ranks (NOTE [Per-rank
    data] in sharded/data.py)."""
    ref = gathered[0]
    for p in gathered[1:]:
        for (path, a), (_, b) in zip(ref[5], p[5]):
            if a != b:
                return (
                    f"{api}: {path} is a plain tensor whose values differ across ranks (rank "
                    f"{ref[1]} and rank {p[1]} hold different values, compared bitwise). A "
                    f"plain tensor input "
                    f"is one global value, the same on every rank; each rank takes its block "
                    f"of it. For data that each rank loads on its own (a DataLoader with a "
                    f"DistributedSampler), build the global batch with "
                    f"sharded.from_local_data(local_batch, spec, mesh) and pass that DTensor; "
                    f"for state, give every rank the same value (the same seed) or pass a "
                    f"DTensor."
                )
    return f"{api}: the ranks' plain tensor inputs differ."


def all_gather_objects(obj, group) -> list:
    """Every rank's picklable ``obj`` (in rank order), as pickled bytes in uint8 tensors.
    (torch's all_gather_object goes through numpy.)"""
    data = pickle.dumps(obj)
    n = dist.get_world_size(group)
    size = torch.tensor([len(data)], dtype=torch.int64)
    sizes = [torch.zeros_like(size) for _ in range(n)]
    dist.all_gather(sizes, size, group=group)
    longest = max(int(x) for x in sizes)
    buf = torch.zeros(longest, dtype=torch.uint8)
    buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    bufs = [torch.empty_like(buf) for _ in range(n)]
    dist.all_gather(bufs, buf, group=group)
    return [pickle.loads(bytes(b[: int(k)].tolist())) for b, k in zip(bufs, sizes)]


def _diff(gathered) -> str:
    ref = gathered[0]
    for p in gathered[1:]:
        if p[2] == ref[2]:
            continue
        a_lines, b_lines = ref[3], p[3]
        for i in range(max(len(a_lines), len(b_lines))):
            a = a_lines[i] if i < len(a_lines) else "<nothing>"
            b = b_lines[i] if i < len(b_lines) else "<nothing>"
            if a != b:
                return (
                    f"  rank {p[1]} differs from rank {ref[1]} at item {i} of its program "
                    f"signature:\n    rank {ref[1]}: {a}\n    rank {p[1]}: {b}\n"
                    f"  Every rank must call with the same global shapes, dtypes, specs, input "
                    f"layouts and static arguments, and the function must not depend on the "
                    f"rank."
                )
        return f"  rank {p[1]} and rank {ref[1]} differ in a way their descriptions do not show."
    return "  (digests differ)"


_GROUPS: dict[tuple, object] = {}
_GROUPS_LOCK = threading.Lock()


_TIMEOUTS = {"agree": ("SHARDED_SYNC_TIMEOUT", "300"),
             "compile": ("SHARDED_COMPILE_TIMEOUT", "3600")}


def group_for(mesh, purpose: str = "agree"):
    """The gloo group (bounded timeout) that the ranks of ``mesh`` agree over; None for
    a mesh of one rank. One group per set of ranks and purpose: every mesh over the
    whole world shares one. ``mesh`` None: the world's. ``purpose`` "agree": the
    per-call agreement (``SHARDED_SYNC_TIMEOUT`` seconds, default 300); "compile": the
    agreement after an inductor compile, which waits for the slowest rank's compiler
    (``SHARDED_COMPILE_TIMEOUT``, default 3600)."""
    if not dist.is_initialized():
        return None
    if mesh is None:
        ranks = tuple(range(dist.get_world_size()))
    else:
        if mesh.size() == 1:
            return None
        ranks = tuple(sorted(mesh.device_mesh.mesh.flatten().tolist()))
    if len(ranks) == 1:
        return None
    with _GROUPS_LOCK:
        if (ranks, purpose) not in _GROUPS:
            # Both groups at once, when the ranks first agree (they all make their
            # first Mesh together): making a group needs every one of its ranks, and
            # a rank that died while compiling would leave the others waiting in
            # new_group for torch's default timeout.
            world = len(ranks) == dist.get_world_size()
            for p, (var, default) in _TIMEOUTS.items():
                secs = float(os.environ.get(var, default))
                _GROUPS[(ranks, p)] = dist.new_group(
                    list(ranks), backend="gloo", timeout=datetime.timedelta(seconds=secs),
                    use_local_synchronization=not world,
                )
        return _GROUPS[(ranks, purpose)]


def agree_compiled(mesh, api: str, error: str | None) -> list[tuple[int, str]]:
    """Every rank of ``mesh`` calls this after compiling a program ahead of its run,
    with its compile's error (None: it compiled). Returns the same list on every
    rank: (rank, error) for each rank whose compile failed. Over the "compile" group
    (``group_for``): a rank whose compiler is slower waits the others up to
    ``SHARDED_COMPILE_TIMEOUT`` seconds; a rank that dies (a compiler killed for
    memory) closes its connections, and the others stop at once."""
    check_usable(api)
    group = group_for(mesh, "compile") if mesh is not None else None
    if group is None:
        return [] if error is None else [(dist.get_rank() if dist.is_initialized() else 0, error)]
    try:
        gathered = all_gather_objects((dist.get_rank(), error), group)
    except Exception as e:  # noqa: BLE001 - a peer failed or died while compiling
        raise _peer_failure(api, e, "while compiling its program") from None
    return [(r, err) for r, err in gathered if err is not None]


# ---------------------------------------------------------------------------
# Failures
# ---------------------------------------------------------------------------

_KEY = "sharded/failure/{}"
_STATE: dict[str, Any] = {"released": None, "published": False, "epoch": 0, "store": None, "rank": -1,
          "world": 0, "calls": 0}
_LOCK = threading.Lock()


def add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)`` (Python 3.11+); on 3.10 the note is appended to the
    message's first argument."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    elif exc.args and isinstance(exc.args[0], str):
        exc.args = (f"{exc.args[0]}\n{note}", *exc.args[1:])
    else:
        exc.args = (*exc.args, note)


def released() -> str | None:
    """Why this rank's process groups were closed, or None while they are usable."""
    return _STATE["released"]


def check_usable(api: str) -> None:
    if _STATE["released"] is not None:
        raise RankFailedError(
            f"{api}: this rank's process groups were closed after {_STATE['released']}; "
            f"the ranks cannot communicate any more. Restart the program (sharded.launch "
            f"and RankPool start fresh ranks)."
        )


def set_epoch(epoch: int) -> None:
    """Start a new job (RankPool): forget this rank's published failure of the last
    one, so that peers never read a stale record."""
    with _LOCK:
        if _STATE["published"]:
            store = _store()
            if store is not None:
                try:
                    store.delete_key(_KEY.format(_STATE["rank"]))
                except Exception:  # noqa: BLE001
                    pass
        _STATE["published"] = False
        _STATE["epoch"] = epoch
        _STATE["calls"] = 0


def publish(exc: BaseException, api: str, where: str) -> None:
    """Write this rank's failure (error and traceback) where every rank can read it
    (the c10d store). Once per rank; a RankFailedError (an echo of another rank's
    failure) is not published."""
    if isinstance(exc, RankFailedError) or not _multi_rank():
        return
    with _LOCK:
        if _STATE["published"]:
            return
        store = _store()
        if store is None:
            return
        record = {"rank": _STATE["rank"], "api": api, "where": where, "epoch": _STATE["epoch"],
                  "error": _describe(exc), "traceback": _format_tb(exc)}
        try:
            store.set(_KEY.format(record["rank"]), pickle.dumps(record))
            _STATE["published"] = True
        except Exception:  # noqa: BLE001 - the store is gone: nothing to tell
            pass


def release(reason: str, wait: float = 0.0) -> None:
    """Close this rank's process groups so that peers blocked on them fail fast
    (NOTE [Failures reach every rank]). It runs in the background (a collective stuck
    in flight can block it; the exception should not wait for it), up to ``wait``
    seconds in the foreground; this rank counts as released at once."""
    with _LOCK:
        if _STATE["released"] is not None or not dist.is_initialized():
            return
        _store()                               # keep the store alive: peers read it
        _STATE["released"] = reason
        _GROUPS.clear()
    done = threading.Thread(target=_torch.release_process_groups, daemon=True,
                            name="sharded-release")
    done.start()
    _RELEASING.append(done)
    if wait:
        done.join(timeout=wait)


_RELEASING: list = []


@atexit.register
def _finish_releasing() -> None:
    # A release still running in a daemon thread when the interpreter finalizes would
    # abort the process inside gloo (SIGABRT); give it a bounded time to finish.
    for t in _RELEASING:
        t.join(timeout=10.0)


def run_guarded(api: str, fn, *args, mesh=None, agreement: Agreement | None = None):
    """``fn(*args)`` (a program's run, an eager shard_map body), where a failure
    reaches every rank: a communication error caused by another rank becomes
    RankFailedError with that rank's error; this rank's own error is re-raised, and,
    unless every rank of ``mesh`` failed alike (NOTE [Failures alike]), published
    with this rank's groups released first. ``agreement``: the call's, when the run
    checks it (a verdict that the ranks disagree is raised as it is)."""
    with _LOCK:
        _STATE["calls"] += 1
        call = _STATE["calls"]
    try:
        return fn(*args)
    except BaseException as e:
        if agreement is not None and agreement.failed:
            # every rank raises the agreement's verdict before communicating: this
            # was no run (NOTE [Failures alike] counts runs alike on every rank)
            with _LOCK:
                _STATE["calls"] -= 1
            raise
        if not _multi_rank():
            raise
        if _is_comm_error(e):
            raise _peer_failure(api, e, "while running its program") from None
        if mesh is not None and _failed_alike(mesh, call, e):
            raise
        me = dist.get_rank()
        publish(e, api, "while running its program")
        add_note(e, f"({api} failed on rank {me} while running; its process groups were "
                   f"closed so that the other ranks stop too.)")
        release(f"rank {me} failed in {api}")
        raise


# NOTE [Failures alike]
# The same bad input often fails every rank at the same op (an index out of range in
# every shard, a typo in an eager shard_map body). Then no rank waits in a collective
# and the process groups can stay usable. A rank that fails writes its error's text
# to the store under the call's number (every rank counts its guarded calls; SPMD
# programs count alike) and waits up to ALIKE_WAIT seconds for the other ranks of the
# mesh: if all of them failed with the same text, it just raises; otherwise it takes
# the failure path (publish, release). A rank that gives up too early only makes the
# others fail a collective later, with its error: never a hang.
ALIKE_WAIT = 2.0


def _failed_alike(mesh, call: int, e: BaseException) -> bool:
    import time

    store = _store()
    if store is None:
        return False
    ranks = sorted(mesh.device_mesh.mesh.flatten().tolist())
    keys = [f"sharded/alike/{_STATE['epoch']}/{call}/{r}" for r in ranks]
    text = _describe(e)
    try:
        store.set(keys[ranks.index(_STATE["rank"])], text.encode())
        deadline = time.monotonic() + ALIKE_WAIT
        while not store.check(keys):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return all(store.get(k).decode() == text for k in keys)
    except Exception:  # noqa: BLE001 - the store is gone: take the failure path
        return False


@contextlib.contextmanager
def peer_failures(api: str):
    """Inside: a communication error caused by another rank's failure becomes
    RankFailedError with that rank's error (eager collectives outside pjit)."""
    try:
        yield
    except Exception as e:
        if _multi_rank() and _is_comm_error(e):
            raise _peer_failure(api, e, "") from None
        raise


def _peer_failure(api: str, e: BaseException, where: str) -> RankFailedError:
    """The error to raise when a collective failed because of another rank."""
    if isinstance(e, RankFailedError):
        return e
    _store()
    me = _STATE["rank"]
    record = _read_failure(exclude=me)
    release(f"a failure on another rank ({api})")
    if record is not None:
        err = RankFailedError(
            f"{api}: rank {record['rank']} failed {record['where']} ({record['api']}), so "
            f"rank {me} stops too:\n  {record['error']}",
            rank=record["rank"], error=record["error"], remote_traceback=record["traceback"],
        )
        add_note(err, f"rank {record['rank']}'s traceback:\n{record['traceback'].rstrip()}")
        return err
    return RankFailedError(
        f"{api}: another rank stopped responding{' ' + where if where else ''} (its connection closed or timed "
        f"out) without reporting an error: it was killed, ran out of memory, called "
        f"os._exit, or is stuck. See that rank's own output. Rank {me} stops too.\n"
        f"  {_describe(e)[:300]}",
        error=_describe(e),
    )


def _read_failure(exclude: int, wait: float = 0.5) -> dict | None:
    """The lowest rank's published failure of this epoch (waiting briefly: a peer
    publishes before it releases, but a cascade may arrive first)."""
    import time

    store = _store()
    if store is None:
        return None
    deadline = time.monotonic() + wait
    while True:
        for r in range(_STATE["world"]):
            if r == exclude:
                continue
            try:
                key = _KEY.format(r)
                if store.check([key]):
                    rec = pickle.loads(store.get(key))
                    if rec.get("epoch") == _STATE["epoch"]:
                        return rec
            except Exception:  # noqa: BLE001 - the store's host died
                return None
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)


def _store():
    if _STATE["store"] is None and dist.is_initialized():
        try:
            _STATE["store"] = _torch.default_store()
            _STATE["rank"], _STATE["world"] = dist.get_rank(), dist.get_world_size()
        except Exception:  # noqa: BLE001
            return None
    return _STATE["store"]


def _multi_rank() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


_COMM_MARKERS = ("Connection closed", "Connection reset", "Broken pipe", "Socket Timeout",
                 "gloo", "NCCL", "ProcessGroup", "process group", "Timed out")


def _is_comm_error(e: BaseException) -> bool:
    if isinstance(e, (RankFailedError, getattr(dist, "DistError", RankFailedError))):
        return True
    return isinstance(e, RuntimeError) and any(m in str(e) for m in _COMM_MARKERS)


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def _format_tb(e: BaseException) -> str:
    return "".join(_traceback.format_exception(type(e), e, e.__traceback__))


# ---------------------------------------------------------------------------
# Uncaught exceptions (torchrun): publish them before the process exits
# ---------------------------------------------------------------------------

_HOOKED: list[Any] = []


def install_excepthook() -> None:
    """Publish an uncaught exception of the main program before the process exits,
    so that peers that see its connection close can say why (idempotent)."""
    if _HOOKED:
        return
    previous = sys.excepthook

    def hook(tp, value, tb):
        try:
            if isinstance(value, BaseException):
                publish(value, "the main program", "with an uncaught exception")
        finally:
            previous(tp, value, tb)

    sys.excepthook = hook
    _HOOKED.append(previous)
