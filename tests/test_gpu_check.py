"""benchmarks/gpu_check.py on a machine without CUDA: it says so and exits 2; its
--cpu-smoke run does every step of its in-process sections with tiny sizes; a row
whose losses disagree with the reference fails the step-time section."""

import json
import os
import subprocess
import sys

import pytest
import torch

from benchmarks import gpu_check

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_without_cuda_it_says_so(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main([]) == 2
    err = capsys.readouterr().err
    assert "no CUDA device is visible" in err and "--cpu-smoke" in err


def test_cpu_smoke(tmp_path):
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    res = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_check.py"),
                          "--cpu-smoke", "--models", "tiny", "--warmup", "0", "--iters", "1",
                          "--out", str(out)], capture_output=True, text=True, timeout=300,
                         cwd=ROOT, env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    result = json.loads(out.read_text())
    sections = {k: v["status"] for k, v in result["sections"].items()}
    assert sections == {"cuda_tests": "skipped", "local_rank": "skipped",
                        "train_example": "skipped", "nccl_world_1": "ok", "step_time": "ok"}
    rows = result["step_time"]["tiny"]["rows"]
    assert set(rows) == set(gpu_check.SMOKE_ROWS)
    assert all(r["same_work"] is True and len(r["times_ms"]) == 1 for r in rows.values())
    assert "random bits of dropout, rand, randn, randint equal" in result["sections"]["nccl_world_1"]["detail"]
    assert "torch_compile" in res.stdout and "same work" in res.stdout


def _facts(loss0, loss_end):
    return {"loss0": loss0, "loss_end": loss_end, "first_call_s": 0.1, "step_peak_mib": None}


def test_a_row_that_did_different_work_fails_the_section(monkeypatch, capsys):
    facts = {"eager": _facts(5.0, 4.0), "pjit": _facts(5.0, 4.0001), "torch_compile": _facts(5.0, 4.1)}
    assert gpu_check.same_work(facts) == {"eager": True, "pjit": True, "torch_compile": False}
    assert gpu_check.same_work({"pjit": _facts(5.0, 4.0)}) == {"pjit": None}

    def time_model(mesh, cfg, batch, rows, warmup, iters, backend):
        agree = gpu_check.same_work(facts)
        table = {r: {"median_ms": 1.0, "min_ms": 1.0, "max_ms": 1.0, "same_work": agree[r],
                     "times_ms": [1.0], **f} for r, f in facts.items()}
        return table, {"pjit_inductor": "RuntimeError: no compiler"}

    monkeypatch.setattr(gpu_check, "time_model", time_model)
    ctx = {"mesh": None, "smoke": True, "device_name": "cpu", "compile_backend": "eager",
           "args": gpu_check.parse_args(["--cpu-smoke", "--models", "tiny"]), "results": {}}
    with pytest.raises(RuntimeError, match=r"tiny/torch_compile did different work.*"
                       r"tiny/pjit_inductor: RuntimeError: no compiler"):
        gpu_check.section_step_time(ctx)
    table = capsys.readouterr().out
    assert "NO: DIFFERENT WORK" in table and "ERROR: RuntimeError: no compiler" in table
    assert ctx["results"]["step_time"]["tiny"]["rows"]["torch_compile"]["same_work"] is False


def test_reading_pytest_and_train_output():
    assert gpu_check.pytest_summary("SKIPPED [1] test_x.py:3: needs 4 passed GPUs\n"
                                    "1 passed, 2 skipped, 1 error in 3.10s\n") == \
        {"passed": 1, "skipped": 2, "error": 1}
    out = gpu_check.train_output(
        "mesh {'dp': 1, 'tp': 2} on cuda: compiled in 6.2 s, collectives per step {}\n"
        "step   pjit loss  1-device loss\n   0      5.5706         5.5706\n"
        "  29      1.0071         1.0072\n"
        "max |pjit - single device| loss difference over 30 steps: 4.77e-07\n")
    assert out == {"pjit": [5.5706, 1.0071], "reference": [5.5706, 1.0072], "max_diff": 4.77e-07,
                   "mesh": "{'dp': 1, 'tp': 2}", "device": "cuda"}
