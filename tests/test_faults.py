"""A rank that fails in the middle of training (raises while its program runs, or
dies with os._exit) ends the run on every rank with the cause, under sharded.launch,
RankPool and torchrun; nothing waits for a timeout.

The bound: launch/RankPool kill a rank still running 15 s after the first failure
(sharded.launch.GRACE) and report it as killed; these tests require that no rank is
killed, i.e. every rank ended on its own with the cause. torchrun runs get a 120 s
limit that includes starting the ranks."""

import os
import subprocess
import sys

import pytest

from sharded import launch
from sharded.launch import RankError
from sharded.sync import RankFailedError
from tests._fault_script import train_until_fault

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _notes(e) -> str:
    return "\n".join(getattr(e, "__notes__", []))


def _check_raise(e):
    # The root cause is rank 1's own IndexError; rank 0 ended with RankFailedError
    # carrying it (and rank 1's traceback); no rank was killed.
    assert isinstance(e, IndexError) and "index out of range" in str(e), repr(e)
    notes = _notes(e)
    assert "raised on local rank 1" in notes, notes
    assert ("RankFailedError: pjit(<lambda>): rank 1 failed while running its program "
            "(pjit(<lambda>)), so rank 0 stops too:\n  IndexError: index out of range") in notes, notes
    assert "killed ---" not in notes, notes


def _check_exit(e):
    assert isinstance(e, RankError) and "local rank 1 died (exit code 7)" in str(e), repr(e)
    assert "Rank 0 stops too" in str(e) and "RankFailedError" in str(e), str(e)
    assert "killed ---" not in str(e), str(e)


@pytest.mark.parametrize("kind, check", [("raise", _check_raise), ("exit", _check_exit)])
def test_launch_reports_the_failing_rank_and_ends_the_others(kind, check):
    with pytest.raises((IndexError, RankError)) as info:
        launch(train_until_fault, 2, kind, timeout=120)
    check(info.value)


def _whoami():
    import torch.distributed as dist

    return dist.get_rank()


@pytest.mark.parametrize("kind, check", [("raise", _check_raise), ("exit", _check_exit)])
def test_rank_pool_reports_the_failure_and_starts_fresh_ranks(on_ranks, kind, check):
    with pytest.raises((IndexError, RankError)) as info:
        on_ranks(2, train_until_fault, kind, timeout=120)
    check(info.value)
    assert on_ranks(2, _whoami) == [0, 1]          # the pool works again


@pytest.mark.parametrize("kind", ["raise", "exit"])
def test_torchrun_every_rank_ends_with_the_cause(kind):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(ROOT, "tests", "_fault_script.py"), kind]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert "rank 1 fails now" in out, out[-3000:]
    # Every rank ends with the cause: rank 1 with its own error (or death), rank 0 with
    # RankFailedError carrying it, unless torchrun stopped it first (SIGTERM: torchrun
    # ends the other ranks as soon as one exits), never left waiting.
    assert ("[rank0]: sharded.sync.RankFailedError: pjit(<lambda>): " in out
            or "exitcode  : -15" in out), out[-3000:]
    if kind == "raise":
        assert "[rank1]: IndexError: index out of range in self" in out, out[-3000:]
        if "[rank0]: sharded.sync.RankFailedError" in out:
            assert "rank 1 failed while running its program" in out, out[-3000:]
    else:
        root = out[out.index("Root Cause (first observed failure)"):]
        assert "rank      : 1 (local_rank: 1)" in root and "exitcode  : 7" in root, root
