"""The cost model of automatic sharding: seconds of compute and of communication.

``CostModel`` prices a collective (``collective_seconds``) and an op (``op_cost``:
a fixed ``op_seconds`` of dispatch plus ``compute_seconds``, its roofline);
``CostModel.h100()`` is a stated table (abstract meshes),
``CostModel.measure(mesh)`` times this machine's collectives and kernels, and
``CostModel.for_mesh(mesh)`` picks one (cached per machine). ``predict(lowered)``
prices a lowered program; ``redistribute_seconds`` prices a change of layout, the
edge cost of the solver.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import importlib
import json
import math
import os
import socket
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch.utils.flop_counter import flop_registry

from sharded import _torch
from sharded.launch import launch as _launch
from sharded.mesh import Mesh, mesh_device
from sharded.passes.analysis import collectives as _collectives

if TYPE_CHECKING:
    from sharded.lowered import Lowered

__all__ = ["CostModel", "predict", "redistribute_seconds", "KINDS", "cache_dir", "cache_path"]

# The kinds a model prices (sharded.passes.analysis's kinds; "send" is a ppermute's).
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send")

# NOTE [Collective cost]
# A collective over n ranks costs ``latency + wire(kind, n) * nbytes * seconds_per_byte``
# (0 for n == 1), where nbytes is the full buffer one rank holds (the OUTPUT of an
# all-gather, the INPUT of a reduce-scatter or an all-reduce; CollectiveCall.bytes) and
# wire(kind, n) the bytes one rank sends per byte of it with ring algorithms: an
# all-gather, a reduce-scatter or an all-to-all send (n - 1) / n, an all-reduce both
# (2 (n - 1) / n), a broadcast or a send the whole buffer. seconds_per_byte is thus
# 1 / "bus bandwidth" as nccl-tests reports it, which is nearly independent of n for
# one kind of link; a measured model fits it per kind on the bytes on the wire.
# ``(latency, seconds_per_byte)`` is kept per kind and per group size: a table row
# ``(kind, group_size, latency_s, seconds_per_byte)`` applies from its group size up
# to the next row's (below the smallest row, the smallest row applies). The stated
# H100 table has rows at 2 (NVLink within a node) and 9 (InfiniBand across nodes); a
# measured one a row per mesh-axis size it timed. A kind without rows is priced as
# another kind's (_FALLBACK): broadcast and send as an all-gather (with their own wire
# factor), all-to-all as an all-gather, reduce-scatter and all-gather as each other.
_WIRE: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2.0 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "send": lambda n: 1.0,
}
_FALLBACK = {
    "broadcast": ("all_gather", "all_reduce"),
    "send": ("all_to_all", "all_gather", "all_reduce"),
    "all_to_all": ("all_gather", "reduce_scatter", "all_reduce"),
    "all_gather": ("reduce_scatter", "all_reduce"),
    "reduce_scatter": ("all_gather", "all_reduce"),
    "all_reduce": ("reduce_scatter", "all_gather"),
}
# kinds of sharded.passes.analysis.collectives that a model prices under another name
_KIND_ALIASES = {"ppermute": "send"}

# ---------------------------------------------------------------------------
# The stated H100 table
# ---------------------------------------------------------------------------
# NOTE [The stated H100 table]
# For abstract meshes (planning a job this machine cannot run): one H100 SXM5 80GB
# per rank, 8 per node over NVLink 4 / NVSwitch (a DGX/HGX H100), nodes over one
# 400 Gb/s NDR InfiniBand NIC per GPU, NCCL. Compute and memory are datasheet peaks
# (NVIDIA H100 Tensor Core GPU datasheet, SXM5 column); collective bandwidths are
# what nccl-tests reaches (bus bandwidth, about 80% of the links' peak), since
# collectives rarely get close to the wire. Dtype: the model assumes float32 tensors
# (the project's default) with TF32 off, torch's default for matmuls
# (torch.backends.cuda.matmul.allow_tf32 = False): 67 TFLOP/s; ``h100("tf32")`` or
# ``h100("bf16")`` prices matmuls at the tensor cores' dense rates. Bytes are the
# graph's own (a bf16 program moves half the bytes of a float32 one by itself).
# Groups of at most 8 ranks are taken to be within a node (the innermost mesh axes,
# as torchrun numbers ranks node by node), larger ones to cross nodes, ring-bound by
# the InfiniBand link. Each op costs H100_OP_SECONDS more (NOTE [Per-op cost]): a
# kernel launch.
H100_FP32_FLOPS = 67e12          # FP32 (CUDA cores), datasheet
H100_TF32_FLOPS = 494.7e12       # TF32 tensor core, dense (989.4 with sparsity), datasheet
H100_BF16_FLOPS = 989.4e12       # BF16/FP16 tensor core, dense (1979 with sparsity), datasheet
H100_HBM_BYTES_PER_S = 3.35e12   # HBM3, 3.35 TB/s, datasheet
# NVLink 4: 18 links x 25 GB/s = 450 GB/s per direction per GPU (900 GB/s both ways);
# nccl-tests all_reduce/all_gather bus bandwidth on 8 H100 SXM is ~360-480 GB/s
# (480 with NVLS/SHARP): the lower figure, without NVLS.
H100_NVLINK_BUS_BYTES_PER_S = 360e9
# ConnectX-7 NDR InfiniBand: 400 Gb/s = 50 GB/s per GPU; ~80% of it reached.
H100_IB_BUS_BYTES_PER_S = 40e9
# NCCL's latency for a small message: ~10-25 us within an NVSwitch node (nccl-tests
# all_reduce of 8 B on 8 GPUs), tens of us more across nodes.
H100_NVLINK_LATENCY_S = 20e-6
H100_IB_LATENCY_S = 50e-6
H100_GPUS_PER_NODE = 8
# One op's fixed cost in a graph run eagerly (a CUDA kernel launch: the host's
# driver/runtime calls and the dispatcher's few us). NVIDIA's "Getting Started with
# CUDA Graphs" (developer.nvidia.com/blog/cuda-graphs/, 2019) times back-to-back
# launches of a ~2.9 us kernel at ~3.8 us each; pegainfer's launch study
# (susun-blog.com/blog/pegainfer-3-cuda-graph, CUDA 13) puts the launch itself at
# ~4-6 us. 5 us: a small op on an H100 costs about this whatever its size.
H100_OP_SECONDS = 5e-6

_H100_FLOPS = {"fp32": H100_FP32_FLOPS, "tf32": H100_TF32_FLOPS, "bf16": H100_BF16_FLOPS}

# to_dict's "format"; from_dict refuses others, and it is part of the cache key. 2: the
# robust fit of NOTE [Measuring] (format 1's free least-squares lines were noise-bound);
# 3: op_seconds, the per-op cost (formats 1 and 2 have none: re-measured).
_FORMAT = 3


@dataclass(frozen=True)
class CostModel:
    """Seconds of compute and communication on one kind of machine.

    - ``flops_per_s``: dense matmul throughput of one device;
    - ``bytes_per_s``: its memory bandwidth (an elementwise op costs its bytes / this);
    - ``op_seconds``: what every op costs on top of its roofline (dispatch, a kernel
      launch: NOTE [Per-op cost]); 0.0 by default;
    - ``collectives``: rows ``(kind, group_size, latency_s, seconds_per_byte)``
      (NOTE [Collective cost]): a collective of ``kind`` over n ranks costs
      ``latency_s + wire(kind, n) * nbytes * seconds_per_byte`` with the row of the
      largest group size <= n.

    Frozen and hashable; ``to_dict``/``from_dict`` round-trip it through JSON.
    """

    name: str
    flops_per_s: float
    bytes_per_s: float
    collectives: tuple[tuple[str, int, float, float], ...] = ()
    op_seconds: float = 0.0
    _rows: dict = field(default_factory=dict, init=False, repr=False, compare=False, hash=False)
    _hash: int = field(default=0, init=False, repr=False, compare=False, hash=False)

    def __hash__(self) -> int:
        return self._hash

    def __post_init__(self) -> None:
        if not (self.flops_per_s > 0 and self.bytes_per_s > 0):
            raise ValueError(
                f"CostModel {self.name!r}: flops_per_s and bytes_per_s must be positive; "
                f"got {self.flops_per_s!r} and {self.bytes_per_s!r}.")
        if not (self.op_seconds >= 0 and math.isfinite(self.op_seconds)):
            raise ValueError(f"CostModel {self.name!r}: op_seconds must be finite and >= 0; "
                             f"got {self.op_seconds!r}.")
        object.__setattr__(self, "op_seconds", float(self.op_seconds))
        rows = tuple(sorted((str(k), int(n), float(a), float(b))
                            for k, n, a, b in self.collectives))
        for kind, n, lat, spb in rows:
            if kind not in KINDS:
                raise ValueError(f"CostModel {self.name!r}: unknown collective kind {kind!r}; "
                                 f"the kinds are {KINDS}.")
            if n < 2 or lat < 0 or spb < 0 or not (math.isfinite(lat) and math.isfinite(spb)):
                raise ValueError(
                    f"CostModel {self.name!r}: the row {(kind, n, lat, spb)} needs a group "
                    f"size >= 2 and finite latency_s, seconds_per_byte >= 0.")
        object.__setattr__(self, "collectives", rows)
        # redistribute_seconds' cache hashes the model on every call: hash it once
        object.__setattr__(self, "_hash", hash((self.name, self.flops_per_s, self.bytes_per_s,
                                               rows, self.op_seconds)))
        by_kind: dict[str, list[tuple[int, float, float]]] = {}
        for kind, n, lat, spb in rows:
            by_kind.setdefault(kind, []).append((n, lat, spb))
        self._rows.update(by_kind)

    # -- pricing ----------------------------------------------------------------
    def collective_seconds(self, kind: str, nbytes: int, group_size: int) -> float:
        """Seconds of one collective of ``kind`` over ``group_size`` ranks on a buffer
        of ``nbytes`` (the output of an all-gather, the input of a reduce-scatter or
        an all-reduce: the full buffer each rank holds); 0 for one rank."""
        if group_size <= 1:
            return 0.0
        kind = _KIND_ALIASES.get(kind, kind)
        lat, spb = self._row(kind, group_size)
        return lat + _WIRE[kind](group_size) * float(nbytes) * spb

    def compute_seconds(self, flops: float, nbytes: float) -> float:
        """Seconds of one op doing ``flops`` and reading and writing ``nbytes``: the
        slower of the two (a roofline)."""
        return max(flops / self.flops_per_s, nbytes / self.bytes_per_s)

    def op_cost(self, flops: float, nbytes: float) -> float:
        """Seconds of one op doing ``flops`` and reading and writing ``nbytes``, run
        as one op: ``op_seconds`` (its dispatch, NOTE [Per-op cost]) plus its
        roofline (``compute_seconds``)."""
        return self.op_seconds + max(flops / self.flops_per_s, nbytes / self.bytes_per_s)

    def _row(self, kind: str, n: int) -> tuple[float, float]:
        if kind not in _WIRE:
            raise ValueError(f"CostModel: unknown collective kind {kind!r}; the kinds are {KINDS}.")
        for k in (kind, *_FALLBACK[kind]):
            rows = self._rows.get(k)
            if rows:
                best = rows[0]
                for row in rows:
                    if row[0] <= n:
                        best = row
                return best[1], best[2]
        raise ValueError(
            f"CostModel {self.name!r} has no figures for {kind!r} (nor any collective): it "
            f"was made for a mesh without axes of more than one rank. Use "
            f"CostModel.for_mesh(mesh) on the mesh the program runs on, or CostModel.h100().")

    # -- models -----------------------------------------------------------------
    @classmethod
    def h100(cls, precision: str = "fp32") -> "CostModel":
        """The stated table of an H100 SXM with NCCL over NVLink within a node (8
        GPUs) and InfiniBand across nodes (NOTE [The stated H100 table]).
        ``precision``: the matmul rate, ``"fp32"`` (default: float32 with TF32 off,
        torch's default), ``"tf32"`` or ``"bf16"``."""
        if precision not in _H100_FLOPS:
            raise ValueError(f"CostModel.h100: precision must be one of {sorted(_H100_FLOPS)}; "
                             f"got {precision!r}.")
        rows = []
        for kind in KINDS:
            rows.append((kind, 2, H100_NVLINK_LATENCY_S, 1.0 / H100_NVLINK_BUS_BYTES_PER_S))
            rows.append((kind, H100_GPUS_PER_NODE + 1, H100_IB_LATENCY_S,
                         1.0 / H100_IB_BUS_BYTES_PER_S))
        suffix = "" if precision == "fp32" else f", {precision} matmuls"
        return cls(name=f"H100 NCCL (stated{suffix})", flops_per_s=_H100_FLOPS[precision],
                   bytes_per_s=H100_HBM_BYTES_PER_S, collectives=tuple(rows),
                   op_seconds=H100_OP_SECONDS)

    @classmethod
    def measure(cls, mesh: Mesh, *, sizes: Sequence[int] = (4 << 10, 64 << 10, 1 << 20, 4 << 20),
                repeats: int = 5) -> "CostModel":
        """Time this machine (NOTE [Measuring]). Collective: call it on every rank of
        ``mesh``; every rank returns the same model. ``sizes``: the buffer bytes to
        time each collective at (the smaller half sets the latencies, the larger half
        the bandwidths); ``repeats``: timed calls per size (3x as many up to 64 KiB;
        a low percentile counts)."""
        return _measure(cls, mesh, tuple(int(s) for s in sizes), int(repeats))

    @classmethod
    def for_mesh(cls, mesh: Mesh) -> "CostModel":
        """The model to plan ``mesh``'s programs with: ``h100()`` for an abstract mesh;
        otherwise this machine's, from the cache file or measured at first use
        (NOTE [The cost-model cache]). Collective on a mesh of real ranks: call it
        on every rank; they all get the same model."""
        return _for_mesh(cls, mesh)

    def describe(self) -> str:
        """The model as a table: compute rates, the per-op cost, and per collective
        kind and group size its latency, bus bandwidth and the seconds of a 4 KiB and a
        4 MiB buffer."""
        lines = [self.name,
                 f"  matmul {self.flops_per_s / 1e9:,.1f} GFLOP/s, memory "
                 f"{self.bytes_per_s / 1e9:,.1f} GB/s, per op {self.op_seconds * 1e6:,.2f} us",
                 f"  {'kind':<15}{'ranks':>6}{'latency':>12}{'bus GB/s':>10}"
                 f"{'4 KiB':>12}{'4 MiB':>12}"]
        for kind, n, lat, spb in self.collectives:
            small = self.collective_seconds(kind, 4 << 10, n)
            big = self.collective_seconds(kind, 4 << 20, n)
            bus = f"{1 / spb / 1e9:10.2f}" if spb > 0 else f"{'inf':>10}"
            lines.append(f"  {kind:<15}{n:>6}{lat * 1e6:>10.1f}us{bus}"
                         f"{small * 1e6:>10.1f}us{big * 1e6:>10.1f}us")
        return "\n".join(lines)

    # -- JSON ---------------------------------------------------------------------
    def to_dict(self) -> dict:
        """A JSON-able dict (``from_dict`` reads it back)."""
        table: dict[str, list[list[float]]] = {}
        for kind, n, lat, spb in self.collectives:
            table.setdefault(kind, []).append([n, lat, spb])
        return {"format": _FORMAT, "name": self.name, "flops_per_s": self.flops_per_s,
                "bytes_per_s": self.bytes_per_s, "op_seconds": self.op_seconds,
                "collectives": table}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "CostModel":
        """The model ``to_dict`` wrote."""
        if not isinstance(d, Mapping) or d.get("format") != _FORMAT:
            raise ValueError(
                f"CostModel.from_dict: not a cost model of format {_FORMAT} (a dict from "
                f"CostModel.to_dict); got {d!r:.200}.")
        try:
            rows = tuple((str(kind), int(n), float(lat), float(spb))
                         for kind, entries in d["collectives"].items() for n, lat, spb in entries)
            return cls(name=str(d["name"]), flops_per_s=float(d["flops_per_s"]),
                       bytes_per_s=float(d["bytes_per_s"]), collectives=rows,
                       op_seconds=float(d["op_seconds"]))
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"CostModel.from_dict: malformed cost model ({e!r}): {d!r:.200}.") from e


# ---------------------------------------------------------------------------
# Measuring
# ---------------------------------------------------------------------------
# NOTE [Per-op cost]
# An op costs a fixed ``op_seconds`` on top of its roofline (CostModel.op_cost): the
# Python call of its aten overload in the graph runner's code, the dispatcher, and on
# a GPU the kernel launch. On CPU a small op's roofline is nanoseconds and this is all
# it costs: a gpt-tiny step's 690-1011 local ops cost more than its flops and bytes
# (benchmarks/README.md, "Automatic sharding": without it ``predict`` gave 0.10-0.50x
# the measured step times). ``measure`` times it as the mean seconds per call of two
# tiny ops (aten.add.Tensor of 64 floats and aten.mm.default of 8 x 8) called
# _OP_LOOP times in a row (a low percentile of such loops, NOTE [Measuring]); on CUDA
# the loop ends with one synchronize, so it times the launch rate, not a kernel's
# round trip. The stated H100 table says 5 us (H100_OP_SECONDS). A collective's
# latency already holds its own call's, and a view's is not charged (predict and the
# solver price neither as an op; predict counts the views apart). It is a floor: on
# the 2-core CPU machine (2026-11-27) the loops gave 2.0-2.6 us per op, where the
# local graph of an 8 x Linear(64) AdamW step ran alone at ~4.5 us per node (52
# priced ops, 97 views, getitems) and a pjit call of it took ~1 ms more than its graph
# (a per-call cost this model does not hold either).

# NOTE [Measuring]
# CostModel.measure times, on each mesh axis of more than one rank, all_reduce,
# all_gather_single, reduce_scatter_single and all_to_all_single with
# torch.distributed on the axis's process group (float32 buffers of each of ``sizes``
# bytes), a local matmul (flops/s), an elementwise add (bytes/s, its two reads and
# one write) and loops of tiny ops (op_seconds: NOTE [Per-op cost]). The machine may
# be noisy (4 gloo ranks on 2 shared cores are preempted for milliseconds at a time,
# 10x a small collective's cost), and noise only ever adds time, so each figure is a
# LOW PERCENTILE of single timed calls (after a warm-up call), not their median nor
# their mean: the 20th percentile of ``repeats`` calls (3x as many for buffers up to
# 64 KiB, which are cheap and whose noise is most of their time), the lowest of fewer
# than 10; each call ends by a device synchronize on CUDA. (Batches of back-to-back
# calls, meant to spread the skew of the ranks' arrivals, did worse there: on 4 ranks
# of 2 cores one call in three or four of a 4 KiB buffer is preempted for 2-15 ms, so
# nearly every batch held one.) Every point starts
# with a barrier over all the mesh's ranks: otherwise one group of an axis times its
# collective while another group is still computing beside it. The local kernels are
# timed after the collectives, since OpenMP's threads spin for a while after a
# parallel region. Every rank times; the ranks' figures are gathered (over
# the mesh's gloo agreement group) and the median over ranks counts, per figure; two
# axes of one size keep the slower time per buffer size. Then per kind and group size
# n, on ``t = latency + x * seconds_per_byte`` with x = wire(kind, n) * nbytes (NOTE
# [Collective cost]):
# - the slope is a least-squares fit with the latency pinned over the larger half of
#   the sizes (bandwidth-bound), the latency the lowest ``t - x * slope`` over the
#   smaller half (latency-bound), the two refined in turn a few times; a free
#   least-squares line over all sizes lets the noise of the large sizes set the
#   intercept (it came out at 5 us for an all-gather next to 2.6 ms for an all-reduce
#   on 4 ranks: format 1 of the cache);
# - the latency is floored at 1 us and the slope at 1 / bytes_per_s (a collective
#   moves its bytes through memory at least once);
# - the kinds are held consistent: each kind's latency within _LATENCY_SPREAD (3x) of
#   the median over the kinds timed on that group size, its slope within
#   _SLOPE_SPREAD (8x) of theirs. Each is a few round trips over the same transport:
#   on gloo, all_gather_single is gloo's allgather, all_to_all_single gloo's
#   alltoall, and reduce_scatter_single (ProcessGroupGloo::_reduce_scatter_base in
#   torch 2.13) a clone of the input, an allreduce of it and a copy of the rank's
#   chunk, so it costs an all-reduce (twice the all-gather's slope on its wire bytes).
# Rank 0's resulting numbers are broadcast at the end (every rank computed the same
# ones from the same gathered figures; the broadcast makes them bit-equal whatever
# happens): every rank plans with the same model and so solves alike. On 4 gloo CPU
# ranks of a 2-core machine (a 2 x 2 mesh) it takes about a second.
_MIN_LATENCY_S = 1e-6
_LATENCY_SPREAD = 3.0
_SLOPE_SPREAD = 8.0
_TIMED_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
_SMALL_BYTES = 64 << 10        # buffers up to this size are timed _SMALL_TRIES x repeats times
_SMALL_TRIES = 3


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _low_seconds(fn, device: torch.device, repeats: int) -> float:
    """A low percentile (the 20th; the lowest of fewer than 10) of ``repeats`` timed
    calls of ``fn``, after a warm-up call (NOTE [Measuring])."""
    fn()                                    # warm-up (and the first call's set-up)
    _sync(device)
    times = []
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 5 if len(times) >= 10 else 0]


def _collective_fn(kind: str, nbytes: int, n: int, group, device: torch.device):
    """A call of ``kind`` over ``group`` on a float32 buffer of about ``nbytes`` (the
    full buffer, as collective_seconds counts it); its exact byte count."""
    elems = max(n, (nbytes // 4) // n * n)
    full = torch.ones(elems, device=device)
    block = torch.ones(elems // n, device=device)
    if kind == "all_reduce":
        return (lambda: dist.all_reduce(full, group=group)), full.numel() * 4
    if kind == "all_gather":
        return (lambda: dist.all_gather_single(full, block, group=group)), full.numel() * 4
    if kind == "reduce_scatter":
        return (lambda: dist.reduce_scatter_single(block, full, group=group)), full.numel() * 4
    out = torch.empty_like(full)
    return (lambda: dist.all_to_all_single(out, full, group=group)), full.numel() * 4


def _fit(points: Sequence[tuple[float, float]], min_slope: float = 0.0) -> tuple[float, float]:
    """``t = a + x * b`` through (x, t) points (NOTE [Measuring]): b fitted with a
    pinned over the larger half of the x's, a the lowest residual over the smaller
    half; a >= 1 us, b >= min_slope."""
    pts = sorted((float(x), float(t)) for x, t in points)
    half = max(1, len(pts) // 2)
    small, big = pts[:half], pts[half:]
    a = min(t for _, t in small)
    b = 0.0
    for _ in range(4):
        den = sum(x * x for x, _ in big)
        b = max(sum(x * (t - a) for x, t in big) / den, 0.0) if den > 0 else 0.0
        a = max(min(t - x * b for x, t in small), _MIN_LATENCY_S)
    return a, max(b, min_slope)


def _clamp_to_median(values: dict, spread: float) -> dict:
    """Each value within ``spread`` times of the values' median (NOTE [Measuring])."""
    if not values:
        return values
    mid = statistics.median(values.values())
    return {k: min(max(v, mid / spread), mid * spread) for k, v in values.items()}


def _fit_table(times: Mapping[tuple[str, int, int], float], bytes_per_s: float
               ) -> dict[tuple[str, int], tuple[float, float]]:
    """(kind, group size) -> (latency_s, seconds_per_byte) from the lowest seconds per
    (kind, group size, exact buffer bytes) (NOTE [Measuring])."""
    points: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for (kind, n, nbytes), t in sorted(times.items()):
        points.setdefault((kind, n), []).append((_WIRE[kind](n) * nbytes, t))
    fits = {key: _fit(pts, 1.0 / bytes_per_s) for key, pts in points.items()}
    out: dict[tuple[str, int], tuple[float, float]] = {}
    for n in sorted({n for _, n in fits}):
        keys = [k for k in fits if k[1] == n]
        lat = _clamp_to_median({k: fits[k][0] for k in keys}, _LATENCY_SPREAD)
        spb = _clamp_to_median({k: fits[k][1] for k in keys}, _SLOPE_SPREAD)
        for k in keys:
            out[k] = (max(lat[k], _MIN_LATENCY_S), max(spb[k], 1.0 / bytes_per_s))
    return out


# a loop of this many tiny ops is one timed call of NOTE [Per-op cost]
_OP_LOOP = 100


def _op_seconds(device: torch.device, repeats: int) -> float:
    """One op's fixed cost (NOTE [Per-op cost]): the mean of a tiny elementwise op's
    and a tiny matmul's seconds per call, each called through its aten overload (as
    the graph runner does) ``_OP_LOOP`` times in a row per timed call."""
    x = torch.ones(64, device=device)
    y = torch.ones(64, device=device)
    a = torch.ones(8, 8, device=device)
    add, mm = torch.ops.aten.add.Tensor, torch.ops.aten.mm.default

    def adds():
        for _ in range(_OP_LOOP):
            add(x, y)

    def mms():
        for _ in range(_OP_LOOP):
            mm(a, a)

    tries = max(10, _SMALL_TRIES * repeats)
    per = [_low_seconds(fn, device, tries) / _OP_LOOP for fn in (adds, mms)]
    return sum(per) / len(per)


def _local_rates(device: torch.device, repeats: int) -> tuple[float, float]:
    big = device.type == "cuda"
    m = 4096 if big else 256
    a = torch.randn(m, m, device=device)
    b = torch.randn(m, m, device=device)
    mm = _low_seconds(lambda: torch.mm(a, b), device, repeats)
    e = (16 << 20 if big else 2 << 20)          # elements: 64 / 8 MiB per operand
    x = torch.ones(e, device=device)
    y = torch.ones(e, device=device)
    out = torch.empty_like(x)
    add = _low_seconds(lambda: torch.add(x, y, out=out), device, repeats)
    return 2.0 * m ** 3 / max(mm, 1e-9), 3.0 * e * 4 / max(add, 1e-9)


def _measure(cls, mesh: Mesh, sizes: tuple[int, ...], repeats: int) -> CostModel:
    if not isinstance(mesh, Mesh):
        raise TypeError(f"CostModel.measure: mesh must be a sharded.Mesh; got {type(mesh).__name__}.")
    mesh.require_ranks("CostModel.measure")
    if not sizes or any(s <= 0 for s in sizes):
        raise ValueError(f"CostModel.measure: sizes must be positive byte counts; got {sizes!r}.")
    device = mesh_device(mesh)
    sync_group = mesh.sync_group()
    # every rank times the same points in the same order: (axis, kind, exact bytes)
    points: list[tuple[int, str, int]] = []
    seconds: list[float] = []
    for i, n in enumerate(mesh.shape):
        if n == 1:
            continue
        group = mesh.device_mesh.get_group(i)
        for kind in _TIMED_KINDS:
            for size in sorted(set(sizes)):
                fn, exact = _collective_fn(kind, size, n, group, device)
                # a small buffer's call is cheap and its noise a large part of its time
                tries = repeats * (_SMALL_TRIES if size <= _SMALL_BYTES else 1)
                points.append((i, kind, exact))
                if sync_group is not None:
                    # every rank starts the point together: the other groups of the
                    # axis are not still computing (or timing something else) beside it
                    dist.barrier(group=sync_group)
                seconds.append(_low_seconds(fn, device, tries))
    # the local kernels last: OpenMP's threads spin for a while after a parallel region,
    # and would take the cores from the collectives timed after them
    flops, bw = _local_rates(device, repeats)
    numbers = [flops, bw, _op_seconds(device, repeats), *seconds]
    group = sync_group
    if group is not None:               # the median over ranks, per figure
        mine = torch.tensor(numbers, dtype=torch.float64)
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(every, mine, group=group)
        numbers = torch.quantile(torch.stack(every), 0.5, dim=0).tolist()
    flops, bw, op_s = numbers[0], numbers[1], numbers[2]
    times: dict[tuple[str, int, int], float] = {}
    for (i, kind, exact), t in zip(points, numbers[3:]):
        key = (kind, mesh.shape[i], exact)
        times[key] = max(times.get(key, 0.0), t)     # axes of one size: the slower
    fits = _fit_table(times, bw)
    keys = sorted(fits)
    final = [flops, bw, op_s] + [v for k in keys for v in fits[k]]
    if group is not None:               # bit-equal on every rank
        buf = torch.tensor(final, dtype=torch.float64)
        dist.broadcast(buf, group=group, group_src=0)
        final = buf.tolist()
    backend = _backend(mesh)
    name = f"measured: {backend}, {mesh.size()} ranks, {_host_of_rank0(mesh)}"
    rows = tuple((k, n, final[3 + 2 * j], final[4 + 2 * j]) for j, (k, n) in enumerate(keys))
    return cls(name=name, flops_per_s=final[0], bytes_per_s=final[1], collectives=rows,
               op_seconds=final[2])


def _backend(mesh: Mesh) -> str:
    if not dist.is_initialized():
        return "none"
    return "nccl" if mesh.device_type == "cuda" else str(dist.get_backend())


def _host_of_rank0(mesh: Mesh) -> str:
    """Rank 0's host name, on every rank (a broadcast over the agreement group)."""
    host = [socket.gethostname()]
    group = mesh.sync_group()
    if group is not None:
        dist.broadcast_object_list(host, group=group, group_src=0, device=torch.device("cpu"))
    return str(host[0])


# ---------------------------------------------------------------------------
# The per-machine cache
# ---------------------------------------------------------------------------
# NOTE [The cost-model cache]
# Measuring takes a second or two and its numbers drift from run to run, so a
# machine's model is measured once and kept in a JSON file under $SHARDED_CACHE_DIR
# (default ~/.cache/sharded), named by a digest of its key: rank 0's host name, the
# world size, the mesh shape, the backend, the device type, torch's version and the
# model's format (_FORMAT: a file of an older measuring method is not read; the key is
# in the file too, and a file whose key differs is a miss). Rank 0 alone reads
# the file and broadcasts what it found (or that it found nothing) over the mesh's
# gloo agreement group, so every rank plans with rank 0's model even where each
# node's cache holds another; on a miss every rank measures (a collective) and rank 0
# writes the file (atomically: a temporary file, then a rename). An unreadable or
# malformed file is a miss. Within a process, models are also kept per key less the
# host name (which differs between nodes, and whose hit or miss must be the same on
# every rank): one read or measure per mesh shape and process-group world.
_MEMO: dict[tuple, CostModel] = {}
_MEMO_LOCK = threading.Lock()


def cache_dir() -> Path:
    """Where measured models are kept: ``$SHARDED_CACHE_DIR``, else ~/.cache/sharded."""
    env = os.environ.get("SHARDED_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "sharded"


def _cache_key(mesh: Mesh) -> dict:
    return {"host": socket.gethostname(),
            "world_size": dist.get_world_size() if dist.is_initialized() else 1,
            "mesh_shape": list(mesh.shape), "backend": _backend(mesh),
            "device_type": mesh.device_type, "torch": torch.__version__, "format": _FORMAT}


def cache_path(key: Mapping[str, Any]) -> Path:
    """The cache file of a cost-model key (NOTE [The cost-model cache])."""
    digest = hashlib.sha1(json.dumps(dict(key), sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / f"cost-model-{digest}.json"


def _read_cache(key: dict) -> dict | None:
    path = cache_path(key)
    try:
        data = json.loads(path.read_text())
        if data.get("key") != key:
            return None
        CostModel.from_dict(data["model"])         # valid, or a miss
        return data["model"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _write_cache(key: dict, model: CostModel) -> None:
    path = cache_path(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"key": key, "model": model.to_dict()}, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass                     # a read-only home: measure again next time


def _memo_key(cls, mesh: Mesh) -> tuple:
    key = _cache_key(mesh)
    memo_key = (cls, id(dist.group.WORLD), *(v for k, v in sorted(key.items()) if k != "host"))
    return tuple(tuple(v) if isinstance(v, list) else v for v in memo_key)


def known_model(mesh: Mesh) -> CostModel | None:
    """The model ``CostModel.for_mesh(mesh)`` gives, if it needs no communication:
    ``h100()`` for an abstract mesh, this process's model of a real mesh once
    ``for_mesh`` has fetched it, else None. The AUTO solver reads it inside the
    lowering, where a collective could hang ranks that failed before it; pjit fetches
    the model first, before anything a rank can fail alone."""
    if mesh.is_abstract:
        return CostModel.h100()
    with _MEMO_LOCK:
        return _MEMO.get(_memo_key(CostModel, mesh))


def _for_mesh(cls, mesh: Mesh) -> CostModel:
    if not isinstance(mesh, Mesh):
        raise TypeError(f"CostModel.for_mesh: mesh must be a sharded.Mesh; got {type(mesh).__name__}.")
    if mesh.is_abstract:
        return cls.h100()
    key = _cache_key(mesh)
    memo_key = _memo_key(cls, mesh)
    with _MEMO_LOCK:
        found = _MEMO.get(memo_key)
    if found is not None:
        return found
    box = [_read_cache(key) if mesh.rank == 0 else None]
    group = mesh.sync_group()
    if group is not None:
        dist.broadcast_object_list(box, group=group, group_src=0, device=torch.device("cpu"))
    if box[0] is not None:
        model = cls.from_dict(box[0])
    else:
        model = cls.measure(mesh)
        if mesh.rank == 0:
            _write_cache(key, model)
    with _MEMO_LOCK:
        _MEMO[memo_key] = model
    return model


# ---------------------------------------------------------------------------
# Redistribution
# ---------------------------------------------------------------------------
def redistribute_seconds(model: CostModel, src: Sequence, dst: Sequence, shape: Sequence[int],
                         itemsize: int, mesh_shape: Sequence[int]) -> float:
    """Seconds to move a tensor of global ``shape`` (``itemsize`` bytes per element)
    from placements ``src`` to ``dst`` (one DTensor placement per mesh axis, the
    axes' sizes ``mesh_shape``): per mesh axis whose placement changes, in axis order,
    the collective on the tensor's local bytes at that point (NOTE [Redistribution
    cost]). Cached by its arguments."""
    return _redistribute(model, src if type(src) is tuple else tuple(src),
                         dst if type(dst) is tuple else tuple(dst),
                         shape if type(shape) is tuple else tuple(shape), itemsize,
                         mesh_shape if type(mesh_shape) is tuple else tuple(mesh_shape))


# NOTE [Redistribution cost]
# Axis by axis, in mesh-axis order, from src's placements towards dst's, each change
# priced on the local block the tensor has then (its dims split by the axes that shard
# them at that point, rounded up): Shard -> Replicate an all-gather (of the gathered
# block), Partial -> Replicate an all-reduce, Partial -> Shard a reduce-scatter (of the
# unscattered block), Shard(i) -> Shard(j) an all-to-all, Shard -> Partial an
# all-gather (the block is then replicated, and replicated is a valid partial), a
# Partial of another reduction an all-reduce; Replicate -> Shard or Partial, and no
# change, cost nothing. A _StridedShard is a Shard of its dim. A sum pending over every
# axis of the mesh, made replicated, is one all-reduce over the mesh's group (as the
# modes lower it: NOTE [One reduction over every mesh axis] in _torch.py). DTensor's own
# planner may order the steps otherwise; the price is the solver's edge weight, not a plan.
def _norm(p) -> tuple:
    if _torch.split_factor(p) is not None or p.is_shard():
        return ("S", p.dim)
    if p.is_partial():
        return ("P", str(getattr(p, "reduce_op", "sum")))
    if p.is_replicate():
        return ("R",)
    raise ValueError(f"redistribute_seconds: unknown placement {p!r}.")


def _local_bytes(shape: tuple, itemsize: int, placements: list, mesh_shape: tuple) -> int:
    dims = list(shape)
    for p, n in zip(placements, mesh_shape):
        if p[0] == "S":
            if not 0 <= p[1] < len(dims):
                raise ValueError(f"redistribute_seconds: Shard({p[1]}) of a tensor of shape "
                                 f"{tuple(shape)}.")
            dims[p[1]] = -(-dims[p[1]] // n)
    return math.prod(dims) * itemsize


def one_reduction(src: Sequence, dst: Sequence, mesh_shape: Sequence[int]) -> bool:
    """Is ``src`` -> ``dst`` (DTensor placements, one per mesh axis) a sum pending over
    every axis of a mesh of two or more axes, made replicated: one all-reduce over the
    mesh's group?"""
    return (sum(n > 1 for n in mesh_shape) > 1
            and all(_torch.is_plain_partial(p) and p.reduce_op == "sum" for p in src)
            and all(_norm(q) == ("R",) for q in dst))


@functools.lru_cache(maxsize=1 << 17)
def _redistribute(model: CostModel, src: tuple, dst: tuple, shape: tuple, itemsize: int,
                  mesh_shape: tuple) -> float:
    if not len(src) == len(dst) == len(mesh_shape):
        raise ValueError(
            f"redistribute_seconds: src {src} and dst {dst} need one placement per mesh "
            f"axis ({len(mesh_shape)}: mesh shape {mesh_shape}).")
    cur = [_norm(p) for p in src]
    want = [_norm(p) for p in dst]
    if one_reduction(src, dst, mesh_shape):
        return model.collective_seconds("all_reduce", _local_bytes(shape, itemsize, cur, mesh_shape),
                                        math.prod(mesh_shape))
    total = 0.0
    for i, n in enumerate(mesh_shape):
        a, b = cur[i], want[i]
        if a == b or n == 1 or a[0] == "R":
            cur[i] = b
            continue
        before = _local_bytes(shape, itemsize, cur, mesh_shape)
        cur[i] = b
        after = _local_bytes(shape, itemsize, cur, mesh_shape)
        if a[0] == "S" and b[0] == "S":   # the block barely changes size
            kind, nbytes = "all_to_all", before
        elif a[0] == "S":                 # -> Replicate or Partial: the gathered block
            kind, nbytes = "all_gather", after
        elif b[0] == "S":                 # Partial -> Shard: the unscattered block
            kind, nbytes = "reduce_scatter", before
        else:                             # Partial -> Replicate, or another Partial
            kind, nbytes = "all_reduce", before
        total += model.collective_seconds(kind, nbytes, n)
    return total


# ---------------------------------------------------------------------------
# Predicting a lowered program
# ---------------------------------------------------------------------------
# NOTE [Predicted step time]
# predict prices the program one rank runs (its local graph): every aten op's op_cost
# (op_seconds, NOTE [Per-op cost], plus its compute_seconds), with the flops of
# torch.utils.flop_counter's formulas (matmuls, convolutions, attention) or else one
# per output element, and the bytes of its tensor inputs and outputs; views,
# collectives and their waits compute nothing and are not charged op_seconds. Each
# collective costs collective_seconds. The total is the sum (reported apart: compute_s
# the rooflines, overhead_s the ops' op_seconds, comm_s the collectives): it assumes
# no overlap of communication with compute (an upper bound where the passes overlap
# them). A Lowered's backward (``lowered.backward``, under autograd) is a program of
# its own: predict it apart.
def tensor_vals(x) -> list[torch.Tensor]:
    """The tensors of a value (a node's fake value, a tensor, or lists of them)."""
    if isinstance(x, torch.fx.Node):
        x = x.meta.get("val")
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in tensor_vals(v)]
    return []


def _meta_val(x):
    if isinstance(x, torch.fx.Node):
        return x.meta.get("val")
    if isinstance(x, (list, tuple)):
        return type(x)(_meta_val(v) for v in x)
    return x


def _nbytes(ts: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def tensor_bytes(x) -> int:
    """The bytes of the tensors of a value (``tensor_vals``)."""
    return _nbytes(tensor_vals(x))


def node_flops_bytes(node: torch.fx.Node) -> tuple[float, float] | None:
    """(flops, bytes read and written) of an op node of a traced program, from its
    fake values; None for what computes nothing (views, collectives, waits)."""
    target = node.target
    if (not isinstance(target, _torch.OpOverload) or target in _torch.COLLECTIVE_OPS
            or target is _torch.WAIT_OP or target.is_view):
        return None
    outs = tensor_vals(node)
    if not outs:
        return None
    nbytes = _nbytes(outs) + sum(_nbytes(tensor_vals(a)) for a in node.args) + sum(
        _nbytes(tensor_vals(v)) for v in node.kwargs.values())
    formula = flop_registry.get(target.overloadpacket)
    flops: float = float(sum(t.numel() for t in outs))
    if formula is not None:
        try:
            flops = float(formula(*_meta_val(node.args), **_meta_val(node.kwargs),
                                  out_val=node.meta.get("val")))
        except Exception:           # a formula that does not fit these arguments
            pass
    return flops, float(nbytes)


def predict(lowered: "Lowered", model: CostModel | None = None) -> dict:
    """Predicted seconds of one call of ``lowered`` on this rank (NOTE [Predicted
    step time]): ``{"compute_s", "overhead_s", "comm_s", "total_s", "ops": count,
    "views": count, "collectives": count, "comm_by_kind": {kind: {"count",
    "seconds"}}}``: ``compute_s`` the ops' rooflines, ``overhead_s`` ``ops`` x
    ``op_seconds``, ``total_s`` the three's sum; ``views`` the view ops (not
    charged). ``model`` None: ``CostModel.for_mesh(lowered.mesh)`` (collective on a
    mesh of real ranks)."""
    if lowered.pipeline is not None:
        raise NotImplementedError(
            f"predict: {lowered.name} is a pipelined step (sharded.pipeline); its time "
            f"depends on the schedule's overlap of stages, which predict does not model. "
            f"Predict a step without pipeline(...), or read lowered.pipeline's schedule.")
    if model is None:
        model = CostModel.for_mesh(lowered.mesh)
    return predict_graph(lowered.local_graph, lowered.mesh, model)


def predict_graph(gm: torch.fx.GraphModule, mesh: Mesh, model: CostModel) -> dict:
    """``predict`` of a local graph (one rank's program) on ``mesh``."""
    compute = 0.0
    ops = views = 0
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        fb = node_flops_bytes(node)
        if fb is not None:
            compute += model.compute_seconds(*fb)
            ops += 1
        elif isinstance(node.target, _torch.OpOverload) and node.target.is_view:
            views += 1
    overhead = ops * model.op_seconds
    comm = 0.0
    by_kind: dict[str, dict[str, float]] = {}
    calls = _collectives(gm, mesh)
    for c in calls:
        s = model.collective_seconds(c.kind, c.bytes, c.group_size)
        comm += s
        row = by_kind.setdefault(c.kind, {"count": 0, "seconds": 0.0})
        row["count"] += 1
        row["seconds"] += s
    return {"compute_s": compute, "overhead_s": overhead, "comm_s": comm,
            "total_s": compute + overhead + comm, "ops": ops, "views": views,
            "collectives": len(calls), "comm_by_kind": by_kind}


# ---------------------------------------------------------------------------
# python -m sharded.auto.cost
# ---------------------------------------------------------------------------
def _measure_here(shape: tuple[int, ...], cached: bool) -> dict:
    """On each local rank: the model of a mesh of ``shape`` (its dict)."""
    mesh = Mesh(shape, tuple(f"a{i}" for i in range(len(shape))))
    return (CostModel.for_mesh(mesh) if cached else CostModel.measure(mesh)).to_dict()


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m sharded.auto.cost [--mesh 2x2] [--cached] [--h100]``: measure this
    machine's model on local ranks (sharded.launch: gloo on CPU, NCCL with a GPU per
    rank) and print it (CostModel.describe)."""
    ap = argparse.ArgumentParser(prog="python -m sharded.auto.cost",
                                 description="Print the cost model of automatic sharding "
                                             "for this machine.")
    ap.add_argument("--mesh", default="2", help="the mesh shape to measure on local ranks, "
                    "e.g. 2 or 2x2 (default 2)")
    ap.add_argument("--cached", action="store_true", help="the cached model if there is "
                    "one (CostModel.for_mesh; measured and cached otherwise)")
    ap.add_argument("--h100", action="store_true", help="print the stated H100 table instead")
    args = ap.parse_args(argv)
    if args.h100:
        print(CostModel.h100().describe())
        return 0
    try:
        shape = tuple(int(x) for x in args.mesh.lower().split("x"))
    except ValueError:
        ap.error(f"--mesh must look like 2 or 2x2; got {args.mesh!r}")
    if not shape or min(shape) < 1:
        ap.error(f"--mesh must have positive sizes; got {args.mesh!r}")
    # the function the ranks run, by its module's name (not __main__'s)
    fn = importlib.import_module(__spec__.name if __spec__ else __name__)._measure_here
    results = _launch(fn, math.prod(shape), shape, args.cached)
    print(CostModel.from_dict(results[0]).describe())
    return 0


if __name__ == "__main__":
    sys.exit(main())
