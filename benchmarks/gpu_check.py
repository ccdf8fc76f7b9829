"""GPU check: what the project claims on CUDA, checked in one command.

    python benchmarks/gpu_check.py                   # a machine with >= 1 GPU; < 8 min on one
    python benchmarks/gpu_check.py --models tiny     # quicker: no GPT-2-small rows
    python benchmarks/gpu_check.py --cpu-smoke      # this script's logic on CPU, tiny sizes

Sections, each reported ok / FAILED / skipped with its time:

1. ``cuda_tests``: the suite's CUDA tests (``CUDA_TESTS``: Philox bits on CUDA equal
   CPU's) in a pytest subprocess; a skipped test counts as a failure here.
2. ``local_rank``: Mesh's device choice in fresh processes (NOTE [One GPU per rank] in
   sharded/mesh.py): a LOCAL_RANK=1 process that sees one device (CUDA_VISIBLE_DEVICES)
   runs on cuda:0; with 2+ GPUs, LOCAL_RANK=1 runs on cuda:1, and a LOCAL_RANK=1 process
   whose CUDA was initialised on cuda:0 gets the error.
3. ``train_example``: ``examples/train.py`` under torchrun on CUDA (NCCL, ``--tp`` =
   min(2, GPUs)), its loss against the single-device run on the same GPU.
4. ``nccl_world_1``: in this process, ``Mesh((1,), ("dp",))`` starts the process group
   from torchrun's variables (as under ``torchrun --nproc-per-node 1``):
   ``cpu:gloo,cuda:nccl``, the rank on cuda:LOCAL_RANK; an NCCL all-reduce; shard and
   gather on the device; random ops under pjit on the CUDA mesh give the bits of the
   CPU mesh (graph runner and inductor).
5. ``step_time``: train-step time (forward, backward, AdamW) at world size 1 for
   gpt-tiny and a GPT-2-small-sized GPT; rows ``ROWS``, timed round-robin by
   ``benchmarks/_models.timed_interleaved`` with the device synchronised after every
   step. Every row must agree with ``eager`` on the loss of its first and its last
   step (all rows run the same steps on the same data): a row that did different
   work fails the section. Aim: ``pjit_inductor`` <= 1.05x ``torch_compile``.

Prints a table and writes ``benchmarks/results/gpu_check.json``. Exit status: 0 when
every section passed, 1 when one failed, 2 without CUDA (unless ``--cpu-smoke``).
``--cpu-smoke`` runs sections 4 and 5 with tiny sizes, without the inductor rows
(``torch_compile`` on dynamo's eager backend), and skips the subprocess sections; on a
machine without CUDA it checks the script, not the GPU (tests/test_gpu_check.py).
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import optree  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks._models import (  # noqa: E402
    GPTModule, git_rev, module_loss, timed_interleaved, torch_adamw, write_result,
)
from examples import gpt  # noqa: E402

# The suite's tests that need CUDA (they skip without it); add new ones here.
CUDA_TESTS = ["tests/test_philox.py::test_cuda_matches_cpu"]

ROWS = {
    "pjit": "pjit(gpt.train_step), params P(), batch P('dp'); DTensorExpandMode(compile=False): the graph runner",
    "pjit_inductor": "the same with DTensorExpandMode(compile=True): inductor (compiled before the first call)",
    "eager": "gpt.train_step eagerly on plain tensors: torch.func.grad_and_value + sharded.optim.adamw (fused)",
    "eager_module": "nn.Module (benchmarks/_models.GPTModule), loss.backward(), torch.optim.AdamW(fused=True)",
    "torch_compile": "eager_module with torch.compile(module) (inductor; dynamo's eager backend in --cpu-smoke)",
}
DEFAULT_ROWS = ["pjit", "pjit_inductor", "eager", "eager_module", "torch_compile"]
SMOKE_ROWS = ["pjit", "eager", "eager_module", "torch_compile"]
REFERENCE_ROW = "eager"
AIM = ("pjit_inductor", "torch_compile", 1.05)       # numerator, denominator, at most
# Losses must agree with the reference row to this relative tolerance: the first step
# (same params, same batch) and the last (the same steps on the same data; fp32
# summation order differs between the kernels of the rows).
LOSS0_RTOL, LOSS_END_RTOL = 1e-4, 1e-3


class Skip(Exception):
    """A section that does not apply here (why is its message)."""


# ---------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------

def model_configs(smoke: bool, args) -> dict:
    """name -> (GPTConfig, batch, description)."""
    if smoke:
        return {
            "tiny": (gpt.GPTConfig(vocab=32, d_model=16, n_heads=2, n_layers=1, seq=8), 2,
                     "smoke: d 16, 1 layer, vocab 32, batch 2 x 8"),
            "gpt2": (gpt.GPTConfig(vocab=64, d_model=32, n_heads=4, n_layers=2, seq=16), 2,
                     "smoke: d 32, 2 layers, vocab 64, batch 2 x 16"),
        }
    return {
        "tiny": (gpt.GPTConfig(vocab=256, d_model=128, n_heads=4, n_layers=2, seq=64), 8,
                 "gpt-tiny: d 128, 2 layers, 4 heads, vocab 256, batch 8 x 64"),
        "gpt2": (gpt.gpt2_small(seq=args.gpt2_seq), args.gpt2_batch,
                 f"GPT-2-small-sized: d 768, 12 layers, 12 heads, vocab 50257, "
                 f"batch {args.gpt2_batch} x {args.gpt2_seq}"),
    }


# ---------------------------------------------------------------------------
# Sections
# ---------------------------------------------------------------------------

def _env(**extra) -> dict:
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("TORCHELASTIC_") and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                            "MASTER_ADDR", "MASTER_PORT")}
    return {**env, "PYTHONPATH": path, **extra}


def _run(cmd, timeout: float, **env) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env=_env(**env))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pytest_summary(text: str) -> dict:
    """Counts from pytest's last line ('3 passed, 1 skipped in 2.1s')."""
    lines = [line for line in text.splitlines() if line.strip()]
    counts = {}
    for n, what in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)",
                              lines[-1] if lines else ""):
        counts["error" if what.startswith("error") else what] = int(n)
    return counts


def section_cuda_tests(ctx) -> str:
    if not ctx["cuda"]:
        raise Skip("no CUDA: the CUDA tests would skip")
    res = _run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *CUDA_TESTS],
               timeout=300)
    counts = pytest_summary(res.stdout)
    if res.returncode != 0 or counts.get("skipped") or counts.get("passed", 0) != len(CUDA_TESTS):
        raise RuntimeError(f"pytest {' '.join(CUDA_TESTS)}: exit {res.returncode}, {counts}; "
                           f"a skip counts as a failure on a GPU machine:\n{res.stdout[-3000:]}"
                           f"{res.stderr[-2000:]}")
    return f"{counts['passed']} passed: {', '.join(CUDA_TESTS)}"


_DEVICE_PROBE = """
import torch, torch.distributed as dist
from sharded import Mesh
if {touch_cuda_first}:
    torch.zeros(1, device="cuda")           # CUDA initialised on cuda:0 before the mesh
m = Mesh((1,), ("dp",))
x = torch.ones(2, device=m.device)
dist.all_reduce(x)
print("DEVICE", m.device, torch.cuda.current_device(), dist.get_backend(), x.tolist())
"""


def _probe(local_rank: int, touch_cuda_first: bool, **env) -> subprocess.CompletedProcess:
    code = _DEVICE_PROBE.format(touch_cuda_first=touch_cuda_first)
    return _run([sys.executable, "-c", code], timeout=180, RANK="0", WORLD_SIZE="1",
                LOCAL_RANK=str(local_rank), MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(_free_port()), **env)


def section_local_rank(ctx) -> str:
    if not ctx["cuda"]:
        raise Skip("no CUDA")
    done = []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    first = visible.split(",")[0] if visible else "0"
    res = _probe(1, False, CUDA_VISIBLE_DEVICES=first)
    if res.returncode != 0 or "DEVICE cuda:0 0 " not in res.stdout or "nccl" not in res.stdout:
        raise RuntimeError(f"LOCAL_RANK=1 with CUDA_VISIBLE_DEVICES={first} (one device) should "
                           f"run on cuda:0 under NCCL:\n{res.stdout[-2000:]}{res.stderr[-3000:]}")
    done.append("LOCAL_RANK=1 seeing one device: cuda:0")
    if torch.cuda.device_count() >= 2:
        res = _probe(1, False)
        if res.returncode != 0 or "DEVICE cuda:1 1 " not in res.stdout:
            raise RuntimeError(f"LOCAL_RANK=1 should run on cuda:1:\n{res.stdout[-2000:]}"
                               f"{res.stderr[-3000:]}")
        done.append("LOCAL_RANK=1: cuda:1")
        res = _probe(1, True)
        if res.returncode == 0 or "(LOCAL_RANK=1) must run on cuda:1" not in res.stderr:
            raise RuntimeError(f"LOCAL_RANK=1 with CUDA initialised on cuda:0 should raise Mesh's "
                               f"error:\n{res.stdout[-2000:]}{res.stderr[-3000:]}")
        done.append("CUDA initialised on cuda:0 before a LOCAL_RANK=1 mesh: the error")
    else:
        done.append("(one GPU: the cuda:1 cases need two)")
    return "; ".join(done)


def train_output(text: str) -> dict:
    """The losses and the difference that examples/train.py prints."""
    rows = [line.split() for line in text.splitlines() if line.strip()[:1].isdigit()]
    m = re.search(r"loss difference over (\d+) steps: ([0-9.e+-]+)", text)
    dev = re.search(r"^mesh (\{.*?\}) on (\w+):", text, re.M)
    return {"pjit": [float(r[1]) for r in rows], "reference": [float(r[2]) for r in rows],
            "max_diff": float(m.group(2)) if m else None, "mesh": dev.group(1) if dev else None,
            "device": dev.group(2) if dev else None}


def section_train_example(ctx) -> str:
    if not ctx["cuda"]:
        raise Skip("no CUDA (on CPU: tests/test_examples.py runs it under torchrun)")
    n = min(2, torch.cuda.device_count())
    res = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                str(n), "examples/train.py", "--dp", "1", "--tp", str(n), "--steps", "30"],
               timeout=420, OMP_NUM_THREADS="1")
    out = train_output(res.stdout)
    ok = (res.returncode == 0 and out["device"] == "cuda" and out["max_diff"] is not None
          and len(out["pjit"]) >= 2 and out["pjit"][-1] < out["pjit"][0])
    if not ok:
        raise RuntimeError(f"examples/train.py on {n} GPU(s): exit {res.returncode}, {out}:\n"
                           f"{res.stdout[-3000:]}{res.stderr[-4000:]}")
    ctx["train_example"] = out
    return (f"{n} rank(s), mesh {out['mesh']} on cuda: loss {out['pjit'][0]:.4f} -> "
            f"{out['pjit'][-1]:.4f}, max |pjit - single device| {out['max_diff']:.2e}")


def _torchrun_env() -> None:
    """torchrun's variables for a world of 1, unless torchrun set them."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))


def _random_fn(x):
    return (F.dropout(x, 0.5), torch.rand(5, 7, device=x.device),
            torch.randn(3, 4, device=x.device), torch.randint(0, 1000, (6,), device=x.device))


def _random_draws(mesh, compile: bool):
    from sharded import P, gather, shard
    from sharded import random as srandom
    from sharded.modes import DTensorExpandMode
    from sharded import pjit

    x = shard(torch.ones(4, 6, device=mesh.device), P("dp"), mesh)
    f = pjit(_random_fn, in_specs=P("dp"), mesh=mesh, mode=DTensorExpandMode(compile=compile))
    srandom.manual_seed(1234)
    return [t.cpu() for t in gather(f(x))]


def section_nccl_world_1(ctx) -> str:
    from sharded import Mesh, P, gather, shard

    _torchrun_env()
    mesh = Mesh((1,), ("dp",))
    ctx["mesh"] = mesh
    backend = str(dist.get_backend())
    want = "cuda" if ctx["cuda"] else "cpu"
    if mesh.device_type != want:
        raise RuntimeError(f"Mesh((1,)) is a {mesh.device_type!r} mesh; expected {want!r} "
                           f"(backend {backend})")
    device = mesh.device
    notes = [f"backend {backend}", f"mesh device {device}"]
    if ctx["cuda"]:
        if "nccl" not in backend:
            raise RuntimeError(f"the process group's backend is {backend!r}, not NCCL")
        if device.index != torch.cuda.current_device() or device.index != int(os.environ["LOCAL_RANK"]):
            raise RuntimeError(f"mesh.device {device} is not cuda:LOCAL_RANK "
                               f"(LOCAL_RANK={os.environ['LOCAL_RANK']}, current device "
                               f"{torch.cuda.current_device()})")
    x = torch.arange(4.0, device=device)
    dist.all_reduce(x)
    if not torch.equal(x.cpu(), torch.arange(4.0)):
        raise RuntimeError(f"all_reduce over a world of 1 changed the tensor: {x}")
    d = shard(torch.arange(8.0).reshape(4, 2), P("dp"), mesh)
    if d.to_local().device != device or not torch.equal(gather(d).cpu(), torch.arange(8.0).reshape(4, 2)):
        raise RuntimeError(f"shard/gather: local shard on {d.to_local().device}, expected {device}")
    # random numbers: the bits of the CPU mesh on the CUDA mesh, graph and inductor
    cpu_mesh = Mesh((1,), ("dp",), device_type="cpu")
    ref = _random_draws(cpu_mesh, compile=False)
    names = ("dropout", "rand", "randn", "randint")
    variants = [("graph", False)] + ([("inductor", True)] if not ctx["smoke"] else [])
    for label, compile in variants:
        got = _random_draws(mesh, compile)
        bad = {n: (a.double() - b.double()).abs().max().item()
               for n, a, b in zip(names, got, ref) if not torch.equal(a, b)}
        if bad:
            raise RuntimeError(f"random ops under pjit on the {mesh.device_type} mesh ({label}) differ "
                               f"from the CPU mesh's bits: max |difference| {bad}")
    notes.append(f"random bits of {', '.join(names)} equal the CPU mesh's "
                 f"({', '.join(v for v, _ in variants)})")
    return "; ".join(notes)


# -- step time ---------------------------------------------------------------------------

def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_row(row: str, mesh, cfg, params, ids, tgt, compile_backend: str):
    """``(step, loss)`` for one row: ``step()`` runs one train step from the row's own
    state and synchronises the device; ``loss()`` is the loss of the last step."""
    from sharded import P, gather, optim, shard
    from sharded.modes import DTensorExpandMode
    from sharded import pjit

    device = mesh.device
    st: dict = {}
    if row in ("pjit", "pjit_inductor"):
        ps = gpt.dp_specs(params)
        os_ = gpt.opt_specs(ps)
        fn = lambda *a: gpt.train_step(*a)       # noqa: E731  (a program of its own per row)
        f = pjit(fn, in_specs=(ps, os_, P("dp"), P("dp")), out_specs=(ps, os_, P()),
                 static_argnums=(4,), mesh=mesh,
                 mode=DTensorExpandMode(compile=row == "pjit_inductor"))
        st.update(p=shard(params, ps, mesh), o=shard(optim.adamw_init(params), os_, mesh))
        d_ids, d_tgt = shard((ids, tgt), P("dp"), mesh)

        def step():
            st["p"], st["o"], st["loss"] = f(st["p"], st["o"], d_ids, d_tgt, cfg)
            _sync(device)

        return step, lambda: float(gather(st["loss"]))
    if row == "eager":
        st.update(p=params, o=optim.adamw_init(params))

        def step():
            st["p"], st["o"], st["loss"] = gpt.train_step(st["p"], st["o"], ids, tgt, cfg)
            _sync(device)

        return step, lambda: float(st["loss"])
    if row in ("eager_module", "torch_compile"):
        model = GPTModule(params, cfg).to(device)
        run = torch.compile(model, backend=compile_backend) if row == "torch_compile" else model
        opt = torch_adamw(model.parameters(), lr=1e-3, weight_decay=1e-2)

        def step():
            opt.zero_grad(set_to_none=True)
            loss = module_loss(run, ids, tgt)
            loss.backward()
            opt.step()
            st["loss"] = loss.detach()
            _sync(device)

        return step, lambda: float(st["loss"])
    raise ValueError(f"unknown row {row!r}; choose from {list(ROWS)}")


def step_peak_mib(step, device) -> float | None:
    """What one step allocates above the memory live before it (CUDA), in MiB."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    return (torch.cuda.max_memory_allocated(device) - before) / 2**20


def same_work(facts: dict, reference: str = REFERENCE_ROW) -> dict:
    """Per row: do its first and last losses agree with ``reference``'s (None without
    a reference row)?"""
    ref = facts.get(reference)
    out = {}
    for row, f in facts.items():
        if ref is None:
            out[row] = None
            continue
        ok0 = abs(f["loss0"] - ref["loss0"]) <= LOSS0_RTOL * max(1.0, abs(ref["loss0"]))
        ok1 = abs(f["loss_end"] - ref["loss_end"]) <= LOSS_END_RTOL * max(1.0, abs(ref["loss_end"]))
        out[row] = ok0 and ok1
    return out


def time_model(mesh, cfg, batch: int, rows: list[str], warmup: int, iters: int,
               compile_backend: str) -> tuple[dict, dict]:
    """Every row's step time and facts (``{row: {...}}``), and the rows that failed to
    build or run their first step (``{row: error}``): one broken row leaves the others'
    numbers."""
    device = mesh.device
    to_dev = lambda tree: optree.tree_map(lambda t: t.to(device), tree)     # noqa: E731
    params = to_dev(gpt.init_params(cfg, 0))
    ids, tgt = to_dev(gpt.batch(cfg, batch, seed=1))
    steps, losses, facts, errors = {}, {}, {}, {}
    for row in rows:
        try:
            step, loss = make_row(row, mesh, cfg, params, ids, tgt, compile_backend)
            t0 = time.perf_counter()
            step()                                # compiles where the row compiles
            facts[row] = {"first_call_s": time.perf_counter() - t0, "loss0": loss()}
        except Exception as e:  # noqa: BLE001  (reported as the row's error)
            traceback.print_exc()
            errors[row] = f"{type(e).__name__}: {e}"
            continue
        steps[row], losses[row] = step, loss
    times = timed_interleaved(steps, warmup, iters)
    for row, step in steps.items():
        facts[row]["step_peak_mib"] = step_peak_mib(step, device)
    for row in steps:                              # every row ran the same steps
        facts[row]["loss_end"] = losses[row]()
    agree = same_work(facts)
    table = {}
    for row in steps:
        ms = [t * 1e3 for t in times[row]]
        table[row] = {"median_ms": statistics.median(ms), "min_ms": min(ms), "max_ms": max(ms),
                      "same_work": agree[row], **facts[row], "times_ms": ms}
    return table, errors


def ratios(table: dict) -> dict:
    out = {}
    for num, den in (AIM[:2], ("pjit", "eager"), ("pjit_inductor", "pjit"),
                     ("torch_compile", "eager_module"), ("eager_module", "eager")):
        if num in table and den in table:
            out[f"{num}/{den}"] = table[num]["median_ms"] / table[den]["median_ms"]
    return out


def format_table(title: str, table: dict, errors: dict | None = None) -> str:
    lines = [title, f"{'row':<15}{'ms/step':>9}{'min..max':>17}{'first call s':>14}"
                    f"{'step peak MiB':>15}{'loss@0':>10}{'loss@end':>10}  same work"]
    for row, r in table.items():
        peak = "-" if r["step_peak_mib"] is None else f"{r['step_peak_mib']:.0f}"
        same = {True: "yes", False: "NO: DIFFERENT WORK", None: f"(no {REFERENCE_ROW} row)"}[r["same_work"]]
        lines.append(f"{row:<15}{r['median_ms']:>9.2f}{r['min_ms']:>8.2f}..{r['max_ms']:<7.2f}"
                     f"{r['first_call_s']:>14.1f}{peak:>15}{r['loss0']:>10.4f}{r['loss_end']:>10.4f}"
                     f"  {same}")
    for row, err in (errors or {}).items():
        lines.append(f"{row:<15}  ERROR: {err[:200]}")
    rs = ratios(table)
    if rs:
        lines.append("ratios: " + ", ".join(f"{k} {v:.2f}" for k, v in rs.items()))
    key = f"{AIM[0]}/{AIM[1]}"
    if key in rs:
        lines.append(f"aim {key} <= {AIM[2]}: {'met' if rs[key] <= AIM[2] else 'MISSED'} ({rs[key]:.2f})")
    return "\n".join(lines)


def section_step_time(ctx) -> str:
    if "mesh" not in ctx:
        raise Skip("needs the mesh of nccl_world_1, which did not start")
    a = ctx["args"]
    results = ctx["results"]["step_time"] = {}
    problems = []
    for name in a.models:
        cfg, batch, what = model_configs(ctx["smoke"], a)[name]
        iters = a.iters if name == "tiny" else a.gpt2_iters
        entry = results[name] = {"what": what, "config": vars(cfg), "batch": batch,
                                 "warmup": a.warmup, "iters": iters}
        try:
            table, errors = time_model(ctx["mesh"], cfg, batch, a.rows, a.warmup, iters,
                                       ctx["compile_backend"])
        except Exception as e:  # noqa: BLE001  (the next model still runs)
            traceback.print_exc()
            entry["error"] = f"{type(e).__name__}: {e}"
            problems.append(f"{name}: {entry['error'][:300]}")
            continue
        entry.update(rows=table, errors=errors, ratios=ratios(table))
        title = (f"{what}; world 1 on {ctx['device_name']}; median of {iters} interleaved "
                 f"rounds after {a.warmup} warm-up steps")
        print(format_table(title, table, errors), flush=True)
        problems += [f"{name}/{row} did different work (its losses disagree with "
                     f"{REFERENCE_ROW!r}'s)" for row, r in table.items() if r["same_work"] is False]
        problems += [f"{name}/{row}: {err[:300]}" for row, err in errors.items()]
    if problems:
        raise RuntimeError("; ".join(problems))
    return f"{len(a.models)} model(s) x {len(a.rows)} rows; every row did the same work"


SECTIONS = {
    "cuda_tests": section_cuda_tests,
    "local_rank": section_local_rank,
    "train_example": section_train_example,
    "nccl_world_1": section_nccl_world_1,
    "step_time": section_step_time,
}


def run_section(name: str, fn, ctx) -> dict:
    print(f"== {name} ...", flush=True)
    t0 = time.perf_counter()
    try:
        status, detail = "ok", fn(ctx)
    except Skip as e:
        status, detail = "skipped", str(e)
    except Exception as e:  # noqa: BLE001  (reported, and the exit status says so)
        traceback.print_exc()
        status, detail = "FAILED", f"{type(e).__name__}: {e}"
    out = {"status": status, "seconds": round(time.perf_counter() - t0, 1), "detail": detail}
    print(f"[{status}] {name} ({out['seconds']} s): {detail[:500]}", flush=True)
    return out


# ---------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="tiny sizes, no subprocess sections, no inductor rows (tests)")
    ap.add_argument("--sections", default=",".join(SECTIONS),
                    help="comma-separated subset of " + ",".join(SECTIONS))
    ap.add_argument("--models", default="tiny,gpt2", help="comma-separated subset of tiny,gpt2")
    ap.add_argument("--rows", default=None, help="comma-separated subset of " + ",".join(ROWS))
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--iters", type=int, default=None, help="timed rounds, gpt-tiny")
    ap.add_argument("--gpt2-iters", type=int, default=None, help="timed rounds, GPT-2-small")
    ap.add_argument("--gpt2-batch", type=int, default=4)
    ap.add_argument("--gpt2-seq", type=int, default=1024)
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/"
                    "gpu_check.json; with --cpu-smoke, a file in the temp folder)")
    a = ap.parse_args(argv)
    smoke = a.cpu_smoke
    a.sections = [s for s in a.sections.split(",") if s]
    a.models = [m for m in a.models.split(",") if m]
    a.rows = [r for r in (a.rows or ",".join(SMOKE_ROWS if smoke else DEFAULT_ROWS)).split(",") if r]
    for what, got, known in (("section", a.sections, SECTIONS), ("model", a.models, ("tiny", "gpt2")),
                             ("row", a.rows, ROWS)):
        unknown = [x for x in got if x not in known]
        if unknown:
            ap.error(f"unknown {what}(s) {unknown}; choose from {list(known)}")
    a.warmup = a.warmup if a.warmup is not None else (1 if smoke else 3)
    a.iters = a.iters if a.iters is not None else (2 if smoke else 20)
    a.gpt2_iters = a.gpt2_iters if a.gpt2_iters is not None else (2 if smoke else 10)
    if a.out is None:
        a.out = (os.path.join(tempfile.gettempdir(), "gpu_check_cpu_smoke.json") if smoke
                 else os.path.join(ROOT, "benchmarks", "results", "gpu_check.json"))
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not a.cpu_smoke:
        print(f"gpu_check: no CUDA device is visible (torch.cuda.is_available() is False; torch "
              f"{torch.__version__}, built with CUDA {torch.version.cuda}), so there is nothing "
              f"to check. Run it on a machine with a GPU, or with --cpu-smoke to run its logic "
              f"on CPU with tiny sizes (what tests/test_gpu_check.py does).", file=sys.stderr)
        return 2
    device_name = torch.cuda.get_device_name(0) if cuda else "cpu"
    ctx: dict = {"cuda": cuda, "smoke": a.cpu_smoke, "args": a, "device_name": device_name,
                 "compile_backend": "eager" if a.cpu_smoke else "inductor"}
    result: dict = {
        "benchmark": "gpu_check",
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "torch": torch.__version__, "cuda": torch.version.cuda, "git": git_rev(),
        "device": device_name, "device_count": torch.cuda.device_count() if cuda else 0,
        "cpu_smoke": a.cpu_smoke, "world_size": 1,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "rows": {r: ROWS[r] for r in a.rows}, "aim": f"{AIM[0]} <= {AIM[2]}x {AIM[1]}",
        "sections": {},
    }
    ctx["results"] = result
    print(f"gpu_check on {device_name}{' (--cpu-smoke)' if a.cpu_smoke else ''}: torch "
          f"{torch.__version__}, CUDA {torch.version.cuda}, git {result['git']}", flush=True)
    t0 = time.perf_counter()
    try:
        for name in a.sections:
            if a.cpu_smoke and name in ("cuda_tests", "local_rank", "train_example"):
                result["sections"][name] = {"status": "skipped", "seconds": 0.0,
                                            "detail": "--cpu-smoke: subprocess sections skipped"}
                continue
            result["sections"][name] = run_section(name, SECTIONS[name], ctx)
    finally:
        result["wall_s"] = round(time.perf_counter() - t0, 1)
        write_result(a.out, result, f"{result['wall_s']:.0f} s")
    print("\nsummary:")
    for name, s in result["sections"].items():
        print(f"  {s['status']:<8} {name:<14} {s['seconds']:>6.1f} s  {s['detail'][:160]}")
    failed = [n for n, s in result["sections"].items() if s["status"] == "FAILED"]
    if failed:
        print(f"gpu_check FAILED: {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
