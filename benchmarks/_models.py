"""Small helpers shared by the benchmarks: an nn.Module view of the functional GPT
(for DDP / torch.optim) and a train-step variant for pjit data parallelism."""

from __future__ import annotations

import time

import optree
import torch
import torch.nn as nn
import torch.nn.functional as F

from examples import gpt
from sharded import P, optim, with_sharding_constraint


def write_result(path: str, result: dict, note: str = "") -> None:
    """Write a benchmark's ``result`` as JSON to ``path`` (making its folder) and say so."""
    import json
    import os

    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(result, fh, indent=1)
    print(f"wrote {path}{f' ({note})' if note else ''}")


def git_rev() -> str:
    """The repository's revision, ``+dirty`` with uncommitted changes (for results);
    in a clean export of a commit (no ``.git``), ``BENCH_GIT_REV`` names it."""
    import os
    import subprocess

    if os.environ.get("BENCH_GIT_REV"):
        return os.environ["BENCH_GIT_REV"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root,
                             capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=root, capture_output=True, text=True).stdout.strip()
    except OSError:
        return "unknown"
    return rev + ("+dirty" if dirty else "") if rev else "unknown"


class GPTModule(nn.Module):
    """Holds the params of ``gpt.init_params`` as a flat ParameterList and runs
    ``gpt.forward`` on them (same math as the functional model)."""

    def __init__(self, params: dict, cfg: gpt.GPTConfig):
        super().__init__()
        leaves, self._treedef = optree.tree_flatten(params)
        self.cfg = cfg
        self.flat = nn.ParameterList([nn.Parameter(t.detach().clone()) for t in leaves])

    def forward(self, ids):
        return gpt.forward(optree.tree_unflatten(self._treedef, list(self.flat)), ids, self.cfg)


def module_loss(model, ids, targets):
    logits = model(ids)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def train_step_reduced_grads(params, opt_state, ids, targets, cfg, lr: float = 1e-3):
    """``gpt.train_step`` with the gradients constrained to replicated (P()) before
    AdamW: under pjit data parallelism this all-reduces each gradient once, instead of
    letting the pending reductions flow into the optimizer."""
    grads, loss = torch.func.grad_and_value(gpt.loss_fn)(params, ids, targets, cfg)
    grads = optree.tree_map(lambda g: with_sharding_constraint(g, P()), grads)
    params, opt_state = optim.adamw(params, grads, opt_state, lr=lr)
    return params, opt_state, loss


# -- block-structured modules (fully_shard wraps each block, as FSDP2 users do) -------------

class _Block(nn.Module):
    """One transformer block of ``gpt.forward`` (same math), its params as attributes."""

    def __init__(self, blk: dict, cfg: gpt.GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.ln1_w, self.ln1_b = nn.Parameter(blk["ln1_w"].clone()), nn.Parameter(blk["ln1_b"].clone())
        self.ln2_w, self.ln2_b = nn.Parameter(blk["ln2_w"].clone()), nn.Parameter(blk["ln2_b"].clone())
        self.attn = nn.ParameterDict({k: nn.Parameter(v.clone()) for k, v in blk["attn"].items()})
        self.mlp = nn.ParameterDict({k: nn.Parameter(v.clone()) for k, v in blk["mlp"].items()})

    def forward(self, x):
        d = self.cfg.d_model
        x = x + gpt._attention(dict(self.attn), F.layer_norm(x, (d,), self.ln1_w, self.ln1_b), self.cfg)
        return x + gpt._mlp(dict(self.mlp), F.layer_norm(x, (d,), self.ln2_w, self.ln2_b))


class GPTBlocks(nn.Module):
    """``gpt.forward`` as an nn.Module with one submodule per block (for FSDP2)."""

    def __init__(self, params: dict, cfg: gpt.GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte, self.wpe = nn.Parameter(params["wte"].clone()), nn.Parameter(params["wpe"].clone())
        self.lnf_w, self.lnf_b = nn.Parameter(params["lnf_w"].clone()), nn.Parameter(params["lnf_b"].clone())
        self.blocks = nn.ModuleList([_Block(b, cfg) for b in params["blocks"]])

    def forward(self, ids):
        x = F.embedding(ids, self.wte) + self.wpe[: ids.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        x = F.layer_norm(x, (self.cfg.d_model,), self.lnf_w, self.lnf_b)
        return x @ self.wte.T


# -- an MLP, functional and as a module --------------------------------------------------------

def mlp_init(width: int, layers: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"layers": [{"w": torch.randn(width, width, generator=g) / width ** 0.5,
                        "b": torch.zeros(width)} for _ in range(layers)]}


def mlp_forward(params, x):
    for i, layer in enumerate(params["layers"]):
        x = F.linear(x, layer["w"], layer["b"])
        if i < len(params["layers"]) - 1:
            x = F.gelu(x)
    return x


def mlp_loss(params, x, y):
    return F.mse_loss(mlp_forward(params, x), y)


def mlp_train_step(params, opt_state, x, y, lr: float = 1e-3):
    grads, loss = torch.func.grad_and_value(mlp_loss)(params, x, y)
    params, opt_state = optim.adamw(params, grads, opt_state, lr=lr)
    return params, opt_state, loss


class MLPModule(nn.Module):
    def __init__(self, params: dict):
        super().__init__()
        self.layers = nn.ModuleList()
        for layer in params["layers"]:
            lin = nn.Linear(*layer["w"].shape[::-1])
            lin.weight.data.copy_(layer["w"])
            lin.bias.data.copy_(layer["b"])
            self.layers.append(lin)

    def forward(self, x):
        for i, lin in enumerate(self.layers):
            x = lin(x)
            if i < len(self.layers) - 1:
                x = F.gelu(x)
        return x


# -- the optimizer of the torch rows --------------------------------------------------------------

def torch_adamw(params, lr: float = 1e-3, weight_decay: float = 1e-2) -> torch.optim.AdamW:
    """``torch.optim.AdamW(fused=True)``, the kernel ``sharded.optim.adamw`` runs in the
    pjit rows (so that a ratio compares the step, not fused against per-tensor AdamW).
    DTensor and plain parameters (a TP plan leaves the norms plain) go in separate
    groups: one fused call takes one kind."""
    from torch.distributed.tensor import DTensor

    params = list(params)
    kinds = ([p for p in params if isinstance(p, DTensor)],
             [p for p in params if not isinstance(p, DTensor)])
    return torch.optim.AdamW([{"params": g} for g in kinds if g], lr=lr,
                             weight_decay=weight_decay, fused=True)


# -- the same-work check --------------------------------------------------------------------------

# NOTE [Every row did the same work]
# A row that computes something else than the others can be fast for that reason, and
# its first loss (taken before any update) cannot show it. Every row of
# bench_train_step, bench_data_parallel and bench_tp_plans runs the same number of
# steps from the same parameters and batch (its first step at set-up, the warm-up, the
# timed rounds), so after the timing each row's state is compared with a single-device
# run of that many steps: the optimizer's step count (exactly), the last step's loss,
# and float64 checksums of the parameters (sum, sum of absolute values, sum of
# squares), of Adam's first moments (sum of squares) and of its second moments (sum).
# Parameter layouts differ between rows (a dict, a module, shards), so the checksums
# are over all elements. Adam is invariant to the scale of the gradients (a row with
# gradients 2x too large has the same parameters and losses to float precision); its
# moments are not: 2x gradients make both moments' checksums 4x.
#
# SAME_WORK_RTOL is the largest relative difference allowed (the parameters' signed
# sum, which cancels, relative to their sum of absolute values). Rows that did the same
# work differ by float rounding, which Adam amplifies: an element whose gradient is
# near zero takes a step of about lr whose sign the rounding decides. Over the default
# 24 steps the committed runs differ by 1e-7 to 1e-5 where only the order of
# reductions differs, and by up to 1.1e-4 (the MLP's last loss, 0.036, falling from
# 1.0) between torch's fused AdamW kernel and the same math in foreach ops (on one
# device, and bench_train_step's dtensor_tp row while it ran foreach ops); wrong rows
# differ by 0.2 or more (tests/test_benchmarks.py: 2x gradients, lr 2x, a step fewer).
SAME_WORK_RTOL = 1e-3
# the scale of a signed checksum (differences relative to it)
_SCALE = {"params_sum": "params_l1"}


class DifferentWork(AssertionError):
    """A benchmark row whose state after its steps is not the single-device run's."""


def _full(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t.full_tensor() if hasattr(t, "full_tensor") else t      # DTensor: a collective


def fingerprint(loss, params, exp_avg, exp_avg_sq, step) -> dict:
    """A row's state after its steps, as numbers comparable across layouts (NOTE
    [Every row did the same work]): ``loss`` the last step's (global) loss, the rest
    lists of tensors (DTensors are gathered: every rank must call this in the same
    order). The sums are taken in float64."""
    def sums(ts):
        ts = [_full(t).double() for t in ts]
        return (sum(float(t.sum()) for t in ts), sum(float(t.abs().sum()) for t in ts),
                sum(float((t * t).sum()) for t in ts))

    p_sum, p_l1, p_sumsq = sums(params)
    return {"step": int(float(_full(torch.as_tensor(step)))), "loss": float(_full(torch.as_tensor(loss))),
            "params_sum": p_sum, "params_l1": p_l1, "params_sumsq": p_sumsq,
            "exp_avg_sumsq": sums(exp_avg)[2], "exp_avg_sq_sum": sums(exp_avg_sq)[0]}


def functional_fingerprint(loss, params, opt_state) -> dict:
    """``fingerprint`` of a functional row: ``params`` a pytree, ``opt_state`` from
    ``sharded.optim.adamw_init`` (``{"step", "m", "v"}``)."""
    return fingerprint(loss, optree.tree_leaves(params), optree.tree_leaves(opt_state["m"]),
                       optree.tree_leaves(opt_state["v"]), opt_state["step"])


def optimizer_fingerprint(loss, opt: torch.optim.Optimizer) -> dict:
    """``fingerprint`` of a row stepped by ``torch.optim.AdamW`` (or ``SGDSteps``: no
    moments) ``opt``."""
    ps = [p for g in opt.param_groups for p in g["params"]]
    steps = {int(float(_full(torch.as_tensor(opt.state[p]["step"])))) for p in ps}
    if len(steps) != 1:
        raise DifferentWork(f"the parameters of one optimizer took different numbers of steps: {steps}")
    moments = [[opt.state[p][k] for p in ps if k in opt.state[p]] for k in ("exp_avg", "exp_avg_sq")]
    return fingerprint(loss, ps, *moments, steps.pop())


class SGDSteps(torch.optim.SGD):
    """``torch.optim.SGD`` that counts its steps in each parameter's state, as AdamW
    does (the same-work check compares step counts)."""

    def step(self, closure=None):
        out = super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["step"] = self.state[p].get("step", 0) + 1
        return out


def same_work(rows: dict[str, dict], reference: dict, rtol: float = SAME_WORK_RTOL) -> dict:
    """Compare each row's ``fingerprint`` with the single-device run's ``reference``:
    ``{row: {"max_rel_diff": d, "failures": [text, ...]}}`` (no failures: the row did
    the same work). Each checksum's difference is relative to the reference's
    magnitude (the parameters' sum: to their sum of absolute values); the step count
    must be equal."""
    out = {}
    for row, fp in rows.items():
        failures, worst = [], 0.0
        if fp["step"] != reference["step"]:
            failures.append(f"ran {fp['step']} optimizer steps, the reference {reference['step']}")
        for key, ref in reference.items():
            if key == "step":
                continue
            d = abs(fp[key] - ref) / max(abs(reference[_SCALE.get(key, key)]), 1e-30)
            worst = max(worst, d)
            if not d <= rtol:                                     # (NaN fails)
                failures.append(f"{key} {fp[key]:.7g} vs {ref:.7g} (relative difference {d:.2g} > {rtol:g})")
        out[row] = {"max_rel_diff": worst, "failures": failures}
    return out


def require_same_work(rows: dict[str, dict], reference: dict, what: str,
                      rtol: float = SAME_WORK_RTOL) -> dict:
    """``same_work``, raising DifferentWork naming every row that differs and how."""
    checked = same_work(rows, reference, rtol)
    bad = {r: c["failures"] for r, c in checked.items() if c["failures"]}
    if bad:
        raise DifferentWork(
            f"{what}: {len(bad)} row(s) did different work from the single-device run of "
            f"{reference['step']} steps (NOTE [Every row did the same work] in benchmarks/_models.py):\n"
            + "\n".join(f"  {r}: " + "; ".join(f) for r, f in bad.items()))
    return checked


# -- timing ---------------------------------------------------------------------------------------

def median_ms(fn, iters: int, warmup: int = 3) -> float:
    """The median milliseconds of ``iters`` calls of ``fn`` after ``warmup`` calls, in
    this process alone (no barrier; one row: rows to compare go through
    ``timed_interleaved``)."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2] * 1e3


def timed_interleaved(steps: dict, warmup: int, iters: int) -> dict[str, list[float]]:
    """Warm every mode up, then time them round-robin (one step of each mode per
    round, a barrier before each step), so that load from outside the benchmark hits
    every mode alike."""
    for step in steps.values():
        for _ in range(warmup):
            step()
    times: dict[str, list[float]] = {m: [] for m in steps}
    for _ in range(iters):
        for mode, step in steps.items():
            torch.distributed.barrier()
            t0 = time.perf_counter()
            step()
            times[mode].append(time.perf_counter() - t0)
    torch.distributed.barrier()
    return times


# -- peak memory ---------------------------------------------------------------------------------

def peak_allocated_bytes(fn) -> int:
    """The peak of the bytes that ``fn`` has allocated and not yet freed (CPU tensors),
    read from the profiler's allocation events (a private profiler API; benchmark
    code only). Frees of memory allocated before ``fn`` ran are not counted (they
    once made a row read less than its own state). The profiler sees the allocations
    and frees of the calling thread only; a free on another thread shows when its
    block is allocated again, so the peak may overcount such memory until then."""
    import gc

    from torch._C._profiler import _EventType

    gc.collect()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True) as prof:
        fn()
    allocs, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        if e.typed[0] == _EventType.Allocation:
            allocs.append((e.start_time_ns, e.typed[1].alloc_size, e.typed[1].ptr))
        stack.extend(e.children)
    live = peak = 0
    mine: dict = {}                       # ptr -> bytes, allocated inside the window
    for _, nbytes, ptr in sorted(allocs):
        if nbytes > 0:
            # a block allocated again was freed first, on a thread the profiler does not
            # follow (gloo's, releasing a collective's tensors)
            live += nbytes - mine.get(ptr, 0)
            mine[ptr] = nbytes
        elif ptr in mine:
            live -= mine.pop(ptr)
        peak = max(peak, live)
    return peak


# The profiler's count above misses frees on other threads (gloo's, releasing a
# collective's tensors): a row moved by up to 1 MiB of ~10 from run to run, by which
# thread happened to drop a bucket last. The resident-set count below sees every
# thread: glibc is told to give every block of 64 KiB or more its own mapping
# (returned to the kernel when freed) and to trim its heap above 128 KiB, the kernel's
# high-water mark of resident memory is reset before the window (/proc/self/clear_refs)
# and read after it. It counts what a rank really holds (gloo's own buffers included,
# for every row alike) to a page, plus the Python objects the window creates.

def peak_measure():
    """``(method, measure)``: how this machine measures a window's peak memory
    (``"resident"``: the process's resident set, where the heap returns memory exactly;
    else ``"profiler"``: torch's allocations) and the function that does
    (``measure(fn) -> bytes``)."""
    if exact_heap():
        return "resident", peak_resident_bytes
    return "profiler", peak_allocated_bytes


def least_window_peaks(rows, build) -> tuple[str, dict]:
    """``(method, {row: bytes})``: each row built by ``build(row) -> (step, state)`` and
    stepped twice, from nothing, inside a measured window (``peak_measure``), after
    one warm-up build of every row outside it: one-time allocations (compiles,
    DTensor's and gloo's caches) would otherwise land on whichever row runs first. The
    least of three rounds: an allocation made once lands in a row's first window only."""
    method, measure = peak_measure()
    for row in rows:
        warm_step, _ = build(row)
        warm_step()
        del warm_step
    peaks: dict = {}
    for _ in range(3):
        for row in rows:
            def window():
                step, _ = build(row)
                step()
                step()
            torch.distributed.barrier()
            peak = measure(window)
            peaks[row] = min(peak, peaks.get(row, peak))
    return method, peaks


def gpt_shape_arguments(ap, *, layers: int = 2, batch: int = 8, seq: int = 64) -> None:
    """The GPT-shape options the benchmarks share (gpt-tiny by default)."""
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=layers)
    ap.add_argument("--batch", type=int, default=batch)
    ap.add_argument("--seq", type=int, default=seq)


def mlp_arguments(ap) -> None:
    """The MLP-shape options the benchmarks share (8 x Linear(1024), batch 64)."""
    ap.add_argument("--mlp-width", type=int, default=1024)
    ap.add_argument("--mlp-layers", type=int, default=8)
    ap.add_argument("--mlp-batch", type=int, default=64)


def gpt_arguments(ap, *, layers: int = 2, batch: int = 8, seq: int = 64, warmup: int = 3,
                  iters: int = 20) -> None:
    """The GPT-shape, world and timing options the train-step benchmarks share."""
    gpt_shape_arguments(ap, layers=layers, batch=batch, seq=seq)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=warmup)
    ap.add_argument("--iters", type=int, default=iters)


def exact_heap() -> bool:
    """Make resident memory follow allocations (glibc, Linux): True if it could. Call
    once in a process that measures memory only (the mappings slow allocation)."""
    import ctypes
    import os

    if not os.path.exists("/proc/self/clear_refs"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        ok = libc.mallopt(m_mmap_threshold, 64 * 1024) and libc.mallopt(m_trim_threshold, 128 * 1024)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return bool(ok)


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def peak_resident_bytes(fn) -> int:
    """The peak of this process's resident memory while ``fn`` runs, above what was
    resident when it started (after ``exact_heap()``; every thread's allocations)."""
    import ctypes
    import gc

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")                          # VmHWM := VmRSS
    base = _status_bytes("VmRSS:")
    fn()
    return _status_bytes("VmHWM:") - base


def per_tensor_sgd(params: dict, grads: dict, state: dict, lr: float = 1e-2):
    """SGD as a JAX user writes it with ``tree_map``: ``p - lr * g`` for each parameter
    of a flat dict (``torch.optim.SGD``'s math). ``state`` from
    ``sharded.optim.adamw_init`` (its moments unused, its step counted, so that the
    same-work check reads it as AdamW's); returns ``(params, state)``."""
    return {k: p - lr * grads[k] for k, p in params.items()}, {**state, "step": state["step"] + 1}


def per_tensor_adamw(params: dict, grads: dict, state: dict, lr: float = 1e-3, betas=(0.9, 0.999),
                     eps: float = 1e-8, weight_decay: float = 1e-2):
    """AdamW as users write one: pure (optax-style), elementwise ops on each parameter
    of a flat dict in turn; the math of ``torch.optim.AdamW(foreach=False)``. ``state``
    from ``sharded.optim.adamw_init``; returns ``(params, state)``."""
    b1, b2 = betas
    step = state["step"] + 1
    new, m, v = {}, {}, {}
    for k, p in params.items():
        g = grads[k]
        m[k] = state["m"][k] * b1 + g * (1 - b1)
        v[k] = state["v"][k] * b2 + g * g * (1 - b2)
        update = (m[k] / (1 - b1 ** step)) / ((v[k] / (1 - b2 ** step)).sqrt() + eps)
        new[k] = p * (1 - lr * weight_decay) - lr * update
    return new, {"step": step, "m": m, "v": v}
