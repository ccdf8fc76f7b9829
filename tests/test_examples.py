"""The main example runs under torchrun (the cluster path) and matches one device; the
examples' models run on whatever device their inputs are on."""

import os
import subprocess
import sys
import types

import optree
import pytest
import torch

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
    # what benchmarks/gpu_check.py reads from the same run on GPUs
    from benchmarks.gpu_check import train_output
    out = train_output(res.stdout)
    assert out["device"] == "cpu" and out["mesh"] == "{'dp': 1, 'tp': 2}", out
    assert out["pjit"] == losses and out["max_diff"] is not None and out["max_diff"] < 1e-4, out


def test_ring_attention_example_matches_sdpa():
    cmd = [sys.executable, os.path.join(ROOT, "examples", "ring_attention.py")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=_env())
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    # -inf padding travels around the ring; forward: k, v and the bias, one hop each;
    # the gradient adds the transposes for k and v (the bias needs none)
    assert "max |ring - sdpa| dq" in res.stdout and "padded keys: 12 of 32" in res.stdout, res.stdout
    assert "forward {'ppermute': 3}, grad {'ppermute': 5" in res.stdout, res.stdout


@pytest.mark.parametrize("sdpa", [True, False])
def test_the_gpt_runs_on_its_inputs_device(sdpa):
    """Meta tensors stand in for a GPU: a tensor made without ``device=`` lands on the
    CPU, and an op mixing it with the inputs raises."""
    from examples import gpt
    from sharded import optim

    cfg = gpt.tiny(n_layers=1, d_model=16, vocab=32, seq=8, sdpa=sdpa)
    params = optree.tree_map(lambda t: t.to("meta"), gpt.init_params(cfg))
    ids = torch.zeros(2, 8, dtype=torch.long, device="meta")
    p, o, loss = gpt.train_step(params, optim.adamw_init(params), ids, ids, cfg)
    assert loss.device.type == o["step"].device.type == p["wte"].device.type == "meta"


def test_the_module_gpt_runs_on_its_inputs_device():
    from examples import gpt_module

    model = gpt_module.GPT(gpt_module.Config(n_layers=1, dropout=0.1)).to("meta")
    ids = torch.zeros(2, 8, dtype=torch.long, device="meta")
    assert model(ids, ids).device.type == "meta"


@pytest.mark.parametrize("causal", [False, True])
def test_ring_attention_runs_on_its_inputs_device(monkeypatch, causal):
    from examples import ring_attention as ring

    # the block on one rank, outside shard_map: its named-axis queries answered here
    monkeypatch.setattr(ring, "C", types.SimpleNamespace(
        axis_size=lambda axis: 1,
        axis_index=lambda axis: torch.zeros((), dtype=torch.long, device="meta")))
    q = torch.empty(2, 2, 16, 8, device="meta")
    bias = torch.empty(2, 1, 1, 16, device="meta")
    assert ring.ring_attention_block(q, q, q, bias, causal).device.type == "meta"
    assert ring.sdpa(q, q, q, bias, causal).device.type == "meta"


def _env():
    # the checkout under test, not whichever `sharded` is installed (a script's own
    # directory comes first on its sys.path, not the working directory)
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
