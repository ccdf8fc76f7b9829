"""The main example runs under torchrun (the cluster path) and matches one device."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The examples import this checkout's packages (not an installed copy elsewhere).
ENV = {**os.environ, "OMP_NUM_THREADS": "1",
       "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}


def test_train_example_under_torchrun():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(ROOT, "examples", "train.py"), "--steps", "6"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=ENV, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    lines = res.stdout.splitlines()
    losses = [float(l.split()[1]) for l in lines if l.strip()[:1].isdigit()]
    assert len(losses) == 2 and losses[-1] < losses[0], res.stdout
    assert "loss difference over 6 steps" in res.stdout


def test_ring_attention_example_matches_sdpa():
    cmd = [sys.executable, os.path.join(ROOT, "examples", "ring_attention.py")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env=ENV)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    assert "max |ring - sdpa| dq" in res.stdout and "'all_to_all': 4" in res.stdout, res.stdout
