"""Tracing: make_fx of the user's function on fake global-shaped tensors,
functionalized. The result is the global graph: the single-device program, aten ops
only, with torch.func.grad / vmap / einops already resolved."""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from sharded import _region, _torch
from sharded._trace_state import global_trace as _global_trace, in_global_trace  # noqa: F401


class TracingError(RuntimeError):
    """The function cannot be traced into a static program."""


def trace_global(flat_fn: Callable, metas: Sequence[torch.Tensor], api: str) -> fx.GraphModule:
    """Trace ``flat_fn`` (flat tensors in, flat tensors out) on fakes like ``metas``.

    # NOTE [Trace, then functionalize]
    The function is traced as is first: torch.func.grad/vmap and autograd.Functions
    (with_sharding_constraint, the collectives) resolve to aten ops. Only if that
    graph has in-place ops is it traced again under functionalize (views are kept:
    DTensor has rules for views but not for several ``*_copy`` ops). Functionalizing
    the user function directly would fail on autograd.Functions under grad ("NYI:
    Functionalize rule for custom_function_call").
    """
    fake_mode = _torch.new_fake_mode()
    with fake_mode:
        fakes = [torch.empty_strided(m.shape, m.stride(), dtype=m.dtype, device=m.device) for m in metas]
    try:
        with _region.region_scope() as regions:   # shard_map bodies, owned by the graph
            with _global_trace(), _torch.user_stack_traces():
                # stack traces: errors in later steps name the user's source line
                gm = make_fx(flat_fn, tracing_mode="fake", record_stack_traces=True)(*fakes)
            if _has_mutations(gm):
                gm = make_fx(torch.func.functionalize(gm, remove="mutations"), tracing_mode="fake")(*fakes)
        regions.attach(gm)
        return gm
    except (_torch.DataDependentOutputException, _torch.DynamicOutputShapeException) as e:
        raise TracingError(
            f"{api}: the function's Python control flow or output shape depends on "
            f"tensor values ({e.func if hasattr(e, 'func') else e}: e.g. `if x.sum() > 0`, "
            f"x.item(), x.tolist(), x.nonzero()). The function is traced once with "
            f"abstract values; use torch.where for value-dependent choices, or pass the "
            f"value as a static argument (static_argnums)."
        ) from None


def _has_mutations(gm: fx.GraphModule) -> bool:
    return any(n.op == "call_function" and _torch.is_mutating_op(n.target) for n in gm.graph.nodes)


def mutated_inputs(gm: fx.GraphModule) -> list[int]:
    """Indices of placeholders that the functionalized graph writes back into."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    out = []
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is torch.ops.aten.copy_.default:
            dst = n.args[0]
            if dst in placeholders:
                out.append(placeholders.index(dst))
    return out
