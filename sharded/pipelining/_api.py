"""``pipeline(loss_fn, ...)`` and ``pipe_split``: the user's side of pipeline
parallelism (docs/pipeline.md).

``pipeline(loss_fn, microbatches=m)`` is a function transform, used inside a train
step the way ``shard_map`` and ``remat`` are: ``torch.func.grad(pipeline(loss_fn, ...))``.
Its value is defined without any mesh: the mean over ``m`` micro-batches (the batch
arguments split along dim 0) of ``loss_fn(params, *micro_batch)``, which is
``loss_fn(params, *batch)`` for a loss that is a mean over examples. Called outside
pjit it computes exactly that. Traced by pjit on a mesh with a ``"pp"`` axis, it
marks the function's inputs, its loss and its split points, and the lowering turns
the step into per-stage programs that a schedule runs (NOTE [Pipeline pieces] in
sharded/pipelining/_split.py).
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from typing import Callable, Sequence

import optree
import torch

from sharded import _manual
from sharded._trace_state import in_global_trace
from sharded.pipelining import _markers, _schedules

_STATE = threading.local()


@dataclass(frozen=True)
class PipelineConfig:
    """What the lowering needs to know of a pipeline, carried in the graph (the
    loss's mark) as text."""

    microbatches: int
    schedule: str
    axis: str
    virtual: int

    def text(self) -> str:
        return f"{self.microbatches};{self.schedule};{self.axis};{self.virtual}"

    @staticmethod
    def parse(text: str) -> "PipelineConfig":
        m, schedule, axis, v = text.split(";")
        return PipelineConfig(int(m), schedule, axis, int(v))


class _Region:
    """The pipeline being traced: counts its split points."""

    def __init__(self):
        self.splits = 0


def pipe_split(x, *, auto: bool = False):
    """Mark a stage boundary: the values in ``x`` (a tensor or a pytree of tensors)
    are what the next stage receives. Inside ``pipeline(...)`` traced by pjit, each
    call is a boundary (``auto=True``: a candidate boundary, of which the lowering
    picks those that split the stages evenly by cost); anywhere else it returns
    ``x`` unchanged. Calling it inside a shard_map body is an error."""
    if _manual.active() is not None:
        raise ValueError(
            "pipe_split was called inside a shard_map body: a pipeline stage boundary "
            "must be in the global program, between shard_map calls. Move the split "
            "out of the body (split before or after the shard_map call).")
    region = getattr(_STATE, "region", None)
    if region is None:
        return x
    index = region.splits
    region.splits += 1

    def one(t):
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            return _markers.mark(_markers.SPLIT, t, index, not auto)
        return t

    return optree.tree_map(one, x)


def pipeline(fn: Callable | None = None, /, *, microbatches: int, schedule: str = "1F1B",
             axis: str = "pp", virtual_stages: int = 1,
             blocks: Sequence[torch.nn.Module] | None = None,
             split_before: Sequence[torch.nn.Module] = ()) -> Callable:
    """Pipeline ``fn(params, *batch) -> loss`` over the mesh axis ``axis``.

    - ``microbatches``: the batch arguments (every argument after ``params``) are split
      into this many micro-batches along dim 0 (on each data-parallel rank, its own
      rows); the result is the mean of ``fn`` over them.
    - ``schedule``: ``"GPipe"``, ``"1F1B"``, ``"Interleaved1F1B"``, ``"LoopedBFS"``,
      ``"InterleavedZeroBubble"`` or ``"ZBVZeroBubble"`` (torch.distributed.pipelining's
      schedules; the zero-bubble ones cut each backward into its input and weight
      parts; docs/pipeline.md).
    - ``virtual_stages``: stages per pp rank (2 or more for the interleaved schedules).
    - Stage boundaries: ``pipe_split(h)`` calls inside ``fn``; or ``split_before``,
      modules whose inputs start a stage; or ``blocks``, a ModuleList (or list of
      modules) that the lowering splits evenly by cost.

    The stages' parameters, gradients and optimizer state live on their pp ranks only.
    """
    if fn is None:
        return functools.partial(pipeline, microbatches=microbatches, schedule=schedule, axis=axis,
                                 virtual_stages=virtual_stages, blocks=blocks,
                                 split_before=split_before)
    if not callable(fn):
        raise TypeError(f"pipeline expects a callable; got {type(fn).__name__}.")
    if not (isinstance(microbatches, int) and not isinstance(microbatches, bool) and microbatches >= 1):
        raise ValueError(f"pipeline: microbatches must be an int >= 1; got {microbatches!r}.")
    if not (isinstance(virtual_stages, int) and virtual_stages >= 1):
        raise ValueError(f"pipeline: virtual_stages must be an int >= 1; got {virtual_stages!r}.")
    schedule = _schedules.normalize(schedule)
    if schedule == "ZBVZeroBubble" and virtual_stages != 2:
        raise ValueError(f"pipeline: 'ZBVZeroBubble' places two stages on each rank (a V); "
                         f"use virtual_stages=2 (got {virtual_stages}).")
    if virtual_stages > 1 and schedule in ("GPipe", "1F1B"):
        raise ValueError(f"pipeline: schedule {schedule!r} runs one stage per rank; for "
                         f"virtual_stages={virtual_stages} use 'Interleaved1F1B' or 'LoopedBFS'.")
    if not isinstance(axis, str):
        raise TypeError(f"pipeline: axis must be a mesh axis name (str); got {axis!r}.")
    config = PipelineConfig(microbatches, schedule, axis, virtual_stages)
    hooked = list(split_before) + list(blocks or ())
    for mod in hooked:
        if not isinstance(mod, torch.nn.Module):
            raise TypeError(f"pipeline: split_before and blocks take nn.Modules; got "
                            f"{type(mod).__name__}.")

    @functools.wraps(fn)
    def pipelined(params, *batch):
        if not batch:
            raise TypeError(f"pipeline({_name(fn)}): call it as f(params, *batch), with at "
                            f"least one batch argument to split into micro-batches.")
        for i, b in enumerate(batch):
            for leaf in optree.tree_leaves(b):
                if isinstance(leaf, torch.Tensor) and (leaf.ndim == 0 or leaf.shape[0] % microbatches):
                    raise ValueError(
                        f"pipeline({_name(fn)}): batch argument {i + 1} has shape "
                        f"{tuple(leaf.shape)}, whose dim 0 does not split into "
                        f"{microbatches} micro-batches; use a batch that is a multiple "
                        f"of {microbatches} (or change microbatches).")
        if not in_global_trace():
            return _eager(fn, config, params, batch)
        return _traced(fn, config, params, batch, split_before, blocks)

    pipelined.pipeline_config = config      # type: ignore[attr-defined]
    return pipelined


def _name(fn) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def _eager(fn, config: PipelineConfig, params, batch):
    """The definition: the mean over the micro-batches."""
    m = config.microbatches
    chunks = [optree.tree_map(lambda t: t.chunk(m)[j] if isinstance(t, torch.Tensor) else t, batch)
              for j in range(m)]
    losses = [fn(params, *c) for c in chunks]
    return torch.stack(losses).mean() if m > 1 else losses[0]


def _traced(fn, config: PipelineConfig, params, batch, split_before, blocks):
    if getattr(_STATE, "region", None) is not None:
        raise NotImplementedError(f"pipeline({_name(fn)}) inside another pipeline is not supported.")
    if _manual.active() is not None:
        raise ValueError(f"pipeline({_name(fn)}) was called inside a shard_map body; call it in "
                         f"the global program (a shard_map may run inside its stages).")
    counter = iter(range(1 << 30))

    def enter(t):
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            return _markers.mark(_markers.INPUT, t, next(counter))
        return t

    params = optree.tree_map(enter, params)
    batch = optree.tree_map(
        lambda t: _markers.MICROBATCH(t, config.microbatches) if isinstance(t, torch.Tensor) else t, batch)
    region = _STATE.region = _Region()
    handles = []
    try:
        for mod in split_before:
            handles.append(mod.register_forward_pre_hook(_split_hook(forced=True), with_kwargs=True))
        for k, mod in enumerate(blocks or ()):
            if k:
                handles.append(mod.register_forward_pre_hook(_split_hook(forced=False), with_kwargs=True))
        loss = fn(params, *batch)
    finally:
        for h in handles:
            h.remove()
        _STATE.region = None
    if not (isinstance(loss, torch.Tensor) and loss.ndim == 0 and loss.is_floating_point()):
        raise TypeError(f"pipeline({_name(fn)}) must return a scalar floating loss; got "
                        f"{type(loss).__name__}{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}.")
    del region
    return _markers.mark(_markers.OUTPUT, loss, config.text())


def _split_hook(forced: bool):
    def hook(module, args, kwargs):
        return pipe_split((args, kwargs), auto=not forced)
    return hook
