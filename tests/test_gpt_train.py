"""examples/gpt_train.py end to end: a run on local ranks (the default 2x2 mesh), then
``--resume`` under torchrun on a 1-D mesh of 2; the loss curve continues the first run
and matches the single-device run at every step."""

import csv
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--d-model", "16", "--layers", "1", "--heads", "2", "--seq", "8", "--vocab", "32",
        "--batch-size", "8", "--ckpt-every", "2"]


def _run(cmd, run_dir, after_tiny=()):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(cmd + TINY + list(after_tiny) + ["--run-dir", run_dir],
                         capture_output=True, text=True,
                         timeout=600, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    return res


def test_gpt_train_resumes_on_another_mesh_under_torchrun(tmp_path):
    run_dir = str(tmp_path / "run")
    script = os.path.join(ROOT, "examples", "gpt_train.py")
    first = _run([sys.executable, script, "--steps", "4", "--no-reference"], run_dir)
    assert "mesh dp=2,tp=2 (sp plan over 'tp', DataParallelMode('shard') over 'dp'): started" in first.stdout
    assert "checkpoint at step 4" in first.stdout
    assert "loss=" in first.stderr and "tok_s=" in first.stderr        # the progress bar
    second = _run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node", "2", script, "--resume", "--dp", "2", "--tp", "1",
                   "--steps", "6"], run_dir)
    assert "mesh dp=2 (" in second.stdout and "resumed at step 4" in second.stdout, second.stdout
    # Steps 0-3 on 2x2, 4-5 resumed on ("dp",)=2, all equal to one device.
    assert "loss difference over 6 steps" in second.stdout, second.stdout
    diff = float(second.stdout.split("loss difference over 6 steps: ")[1].split()[0])
    assert diff < 1e-4, second.stdout
    with open(os.path.join(run_dir, "metrics.csv")) as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == list(range(6))
    assert [r["mesh"] for r in rows] == ["dp=2,tp=2"] * 4 + ["dp=2"] * 2
    png = os.path.join(run_dir, "loss.png")
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert sorted(os.listdir(run_dir)) == ["checkpoint", "loss.png", "metrics.csv", "reference.json"]


def test_gpt_train_with_the_large_run_flags(tmp_path):
    """bf16 with fp32 masters, block remat, warmup + cosine and clipping, from flags, on
    the default 2x2 mesh: the loss follows one device's run of the same configuration
    to bf16 precision (within two ulps: an ulp of a loss near 3.4 is 2**-6)."""
    run_dir = str(tmp_path / "run")
    script = os.path.join(ROOT, "examples", "gpt_train.py")
    res = _run([sys.executable, script, "--steps", "4", "--bf16", "--remat", "block",
                "--schedule", "cosine", "--warmup", "2", "--decay-steps", "4", "--clip", "0.5"],
               run_dir)
    assert ("DataParallelMode('shard') over 'dp', bf16, remat block, warmup 2 + cosine, "
            "clip 0.5): started") in res.stdout, res.stdout
    diff = float(res.stdout.split("loss difference over 4 steps: ")[1].split()[0])
    assert diff <= 2 ** -5, res.stdout
    with open(os.path.join(run_dir, "metrics.csv")) as f:
        losses = [float(r["loss"]) for r in csv.DictReader(f)]
    # computed in bf16: each loss in [2, 4) is a multiple of bf16's ulp there
    assert len(losses) == 4 and all(2 <= x < 4 and (x * 64).is_integer() for x in losses), losses


def test_gpt_train_pipelined(tmp_path):
    """--pp 2 on 2 local ranks, mesh ("pp"=2,): the loss pipelined (1F1B, the default 4
    micro-batches; the 2 blocks on 2 stages), without dropout, equals at every step the
    loss of the whole-batch step on one device: the mean over equal micro-batches of a
    mean cross-entropy is the whole batch's. (With dropout the example's reference is
    the same micro-batches on one process: docs/examples.md.)"""
    run_dir = str(tmp_path / "run")
    script = os.path.join(ROOT, "examples", "gpt_train.py")
    res = _run([sys.executable, script, "--steps", "2", "--pp", "2", "--dp", "1", "--tp", "1"],
               run_dir, after_tiny=["--layers", "2", "--ckpt-every", "2", "--dropout", "0"])
    assert "mesh pp=2 (1F1B over 'pp', 4 micro-batches): started" in res.stdout, res.stdout
    assert "checkpoint at step 2" in res.stdout, res.stdout
    diff = float(res.stdout.split("loss difference over 2 steps: ")[1].split()[0])
    assert diff < 1e-5, res.stdout
    with open(os.path.join(run_dir, "metrics.csv")) as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == [0, 1]
    assert [r["mesh"] for r in rows] == ["pp=2"] * 2
