"""The pipeline's marks in a traced program: where the stages split, where the
pipelined function's inputs enter and its loss leaves, and the micro-batch.

Each mark is a ``sharded::`` op that computes the identity (a micro-batch: the first
micro-batch's rows) and whose gradient is another mark, so that the joint program of a
train step (forward, ``torch.func.grad``, optimizer) shows both halves of every
boundary. The lowering (``sharded/pipelining/_split.py``) reads them on this rank's
program to cut it into per-stage pieces (NOTE [Pipeline pieces]); they survive the
partition with the layout of their input (a pending sum stays pending: a gradient is
summed over the micro-batches before it is reduced).
"""

from __future__ import annotations

import functools

import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor, Shard

from sharded import _registry


# -- the ops --------------------------------------------------------------------------

@torch.library.custom_op("sharded::pipe_split", mutates_args=())
def _split(x: torch.Tensor, index: int, forced: bool) -> torch.Tensor:
    return x.clone()


@torch.library.custom_op("sharded::pipe_split_grad", mutates_args=())
def _split_grad(g: torch.Tensor, index: int, forced: bool) -> torch.Tensor:
    return g.clone()


@torch.library.custom_op("sharded::pipeline_input", mutates_args=())
def _input(x: torch.Tensor, index: int) -> torch.Tensor:
    return x.clone()


@torch.library.custom_op("sharded::pipeline_input_grad", mutates_args=())
def _input_grad(g: torch.Tensor, index: int) -> torch.Tensor:
    return g.clone()


@torch.library.custom_op("sharded::pipeline_output", mutates_args=())
def _output(x: torch.Tensor, config: str) -> torch.Tensor:
    return x.clone()


@torch.library.custom_op("sharded::pipeline_output_grad", mutates_args=())
def _output_grad(g: torch.Tensor, config: str) -> torch.Tensor:
    return g.clone()


@torch.library.custom_op("sharded::microbatch", mutates_args=())
def _microbatch(x: torch.Tensor, microbatches: int) -> torch.Tensor:
    return x.narrow(0, 0, x.shape[0] // microbatches).clone()


def _identity_fake(x, *args):
    return torch.empty_like(x)


for _op in (_split, _split_grad, _input, _input_grad, _output, _output_grad):
    _op.register_fake(_identity_fake)


@_microbatch.register_fake
def _(x, microbatches):
    return x.new_empty((x.shape[0] // microbatches, *x.shape[1:]))


SPLIT = torch.ops.sharded.pipe_split.default
SPLIT_GRAD = torch.ops.sharded.pipe_split_grad.default
INPUT = torch.ops.sharded.pipeline_input.default
INPUT_GRAD = torch.ops.sharded.pipeline_input_grad.default
OUTPUT = torch.ops.sharded.pipeline_output.default
OUTPUT_GRAD = torch.ops.sharded.pipeline_output_grad.default
MICROBATCH = torch.ops.sharded.microbatch.default
MARKS = (SPLIT, SPLIT_GRAD, INPUT, INPUT_GRAD, OUTPUT, OUTPUT_GRAD, MICROBATCH)
_GRAD_OF = {SPLIT: SPLIT_GRAD, INPUT: INPUT_GRAD, OUTPUT: OUTPUT_GRAD}
_GRAD_OF.update({g: f for f, g in list(_GRAD_OF.items())})      # (a gradient's gradient)

# nothing may drop or merge them before the cut reads them
for _m in MARKS:
    fx.node.has_side_effect(_m)


class _Mark(torch.autograd.Function):
    """A differentiable mark: the identity forward, its gradient marked by the
    matching ``*_grad`` op (so the backward of the joint program shows the boundary)."""

    @staticmethod
    def forward(x, op, *args):
        return op(x, *args)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.op, ctx.args = inputs[1], inputs[2:]

    @staticmethod
    def backward(ctx, grad):
        return (_Mark.apply(grad, _GRAD_OF[ctx.op], *ctx.args), None) + (None,) * len(ctx.args)


def mark(op, x: torch.Tensor, *args) -> torch.Tensor:
    """``x`` through the mark ``op`` (differentiable)."""
    return _Mark.apply(x, op, *args)


def _mark_vmap(op, info, in_dims, x, *args):
    return op(x, *args), in_dims[0]


# -- the marks in a rank's program: the layout of their input ------------------------

def _expand_identity(op, ex, node, args, kwargs):
    x, *rest = args
    if not isinstance(x, DTensor):
        return op(x, *rest)
    local = op(x.to_local(), *rest)
    return DTensor.from_local(local, x.device_mesh, x.placements, run_check=False,
                              shape=x.shape, stride=x.stride())


def _expand_microbatch(ex, node, args, kwargs):
    """This rank's rows of the first micro-batch: the first 1/m of its own rows (a
    data-parallel rank splits its shard of the batch into micro-batches, as
    torch.distributed.pipelining does under data parallelism)."""
    x, m = args
    if not isinstance(x, DTensor):
        return MICROBATCH(x, m)
    for axis, pl in enumerate(x.placements):
        if isinstance(pl, Shard) and pl.dim != 0:
            raise ValueError(
                f"pipeline: a batch argument laid out as {tuple(x.placements)} on mesh axis "
                f"{x.device_mesh.mesh_dim_names[axis]!r} is split along dim {pl.dim}; "
                f"micro-batches are rows (dim 0): shard the batch on dim 0 or replicate it.")
    local = x.to_local()
    if local.shape[0] % m:
        raise ValueError(
            f"pipeline: this rank's shard of a batch argument has {local.shape[0]} rows "
            f"(global {tuple(x.shape)}, {tuple(x.placements)}), which do not split into "
            f"{m} micro-batches; make the per-rank batch a multiple of {m}.")
    out = MICROBATCH(local, m)
    shape = (x.shape[0] // m, *x.shape[1:])
    return DTensor.from_local(out, x.device_mesh, x.placements, run_check=False,
                              shape=torch.Size(shape), stride=_contiguous_strides(shape))


def _contiguous_strides(shape) -> tuple:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))


for _m in (SPLIT, SPLIT_GRAD, INPUT, INPUT_GRAD, OUTPUT, OUTPUT_GRAD):
    _registry.define(_m, expand=functools.partial(_expand_identity, _m),
                     vmap=functools.partial(_mark_vmap, _m))
_registry.define(MICROBATCH, expand=_expand_microbatch)
