"""The main example runs under torchrun (the cluster path) and matches one device."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_train_example_under_torchrun():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(ROOT, "examples", "train.py"), "--steps", "6"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_env(), cwd=ROOT)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    lines = res.stdout.splitlines()
    losses = [float(l.split()[1]) for l in lines if l.strip()[:1].isdigit()]
    assert len(losses) == 2 and losses[-1] < losses[0], res.stdout
    assert "loss difference over 6 steps" in res.stdout


def test_ring_attention_example_matches_sdpa():
    cmd = [sys.executable, os.path.join(ROOT, "examples", "ring_attention.py")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=_env())
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    # -inf padding travels around the ring; forward: k, v and the bias, one hop each;
    # the gradient adds the transposes for k and v (the bias needs none)
    assert "max |ring - sdpa| dq" in res.stdout and "padded keys: 12 of 32" in res.stdout, res.stdout
    assert "forward {'ppermute': 3}, grad {'ppermute': 5" in res.stdout, res.stdout


def _env():
    # the checkout under test, not whichever `sharded` is installed (a script's own
    # directory comes first on its sys.path, not the working directory)
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
