"""A rank that fails in the middle of training (raises while its program runs, or
dies with os._exit) ends the run on every rank with the cause, under sharded.launch,
RankPool and torchrun; nothing waits for a timeout.

The bound: launch/RankPool kill a rank still running GRACE s after the first failure
(sharded.launch.GRACE, 15 s) and report it as killed; these tests require that no rank
is killed, i.e. every rank ended on its own with the cause. What they test is that the
failure reaches the other ranks, not how fast a loaded machine runs, so the grace is
120 s in tests (tests/conftest.py, patient_grace); a rank left waiting is still killed,
and reported, then. torchrun runs get TORCHRUN_LIMIT (starting the ranks included),
and rank 0 ignores torchrun's SIGTERM, so that it must end with the cause on its own
(tests/_fault_script.py)."""

import os
import subprocess
import sys

import pytest

from sharded import launch
from sharded.launch import RankError
from sharded.sync import RankFailedError
from tests._fault_script import train_until_fault

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCHRUN_LIMIT = 400          # s; about 10 s on an idle machine



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
        launch(train_until_fault, 2, kind, timeout=300)
    check(info.value)


def _whoami():
    import torch.distributed as dist

    return dist.get_rank()


@pytest.mark.parametrize("kind, check", [("raise", _check_raise), ("exit", _check_exit)])
def test_rank_pool_reports_the_failure_and_starts_fresh_ranks(on_ranks, kind, check):
    with pytest.raises((IndexError, RankError)) as info:
        on_ranks(2, train_until_fault, kind, timeout=300)
    check(info.value)
    assert on_ranks(2, _whoami) == [0, 1]          # the pool works again


@pytest.mark.parametrize("kind", ["raise", "exit"])
def test_torchrun_every_rank_ends_with_the_cause(kind, tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1", FAULT_OUTCOME_DIR=str(tmp_path))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(ROOT, "tests", "_fault_script.py"), kind]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=TORCHRUN_LIMIT)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert "rank 1 fails now" in out, out[-3000:]
    # Every rank ends with the cause: rank 1 with its own error (or death), rank 0 with
    # RankFailedError carrying it. Rank 0 ignores torchrun's SIGTERM (tests/_fault_script.py),
    # so it must end on its own, within the 30 s before torchrun's SIGKILL, never left
    # waiting; what it ended with is in its outcome file.
    rank0 = tmp_path / "rank0"
    assert rank0.exists(), "rank 0 did not end on its own (torchrun killed it)\n" + out[-3000:]
    ended = rank0.read_text()
    assert ended.startswith("sharded.errors.RankFailedError: pjit(<lambda>): "), ended
    if kind == "raise":
        assert "rank 1 failed while running its program" in ended and "IndexError" in ended, ended
        assert (tmp_path / "rank1").read_text().startswith("builtins.IndexError: index out of range"), out[-3000:]
        assert "[rank1]: IndexError: index out of range in self" in out, out[-3000:]
    else:
        # a death sends no error: rank 0 sees rank 1's connection close
        assert "another rank stopped responding" in ended and "Rank 0 stops too" in ended, ended
        assert not (tmp_path / "rank1").exists()           # it died (os._exit) where it was
        root = out[out.index("Root Cause (first observed failure)"):]
        assert "rank      : 1 (local_rank: 1)" in root and "exitcode  : 7" in root, root
