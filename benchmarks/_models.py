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
    """The repository's revision, ``+dirty`` with uncommitted changes (for results)."""
    import os
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root,
                             capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=root, capture_output=True, text=True).stdout.strip()
        return rev + ("+dirty" if dirty else "")
    except OSError:
        return "unknown"


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


# -- timing ---------------------------------------------------------------------------------------

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
