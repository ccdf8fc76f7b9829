"""The shared expander (sharded/modes/_expand.py), for what DTensor does not do alone:
``cat`` skips legacy empty tensors as torch.cat does (NOTE [cat skips legacy empty
tensors]), a view of a shard laid out otherwise than its global value copies it first
(NOTE [A view of a shard laid out otherwise]), and keyword tensors (SDPA's ``attn_mask``) are laid out as the op's plan
wants (NOTE [Keyword tensors are laid out by the expander]). Local graphs lowered on
abstract meshes in one process; the values on real gloo ranks against one device, in
DTensorExpandMode and both DataParallelMode layouts."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sharded import Mesh, P, gather, with_sharding_constraint
from sharded.modes import DataParallelMode
from transforms import pjit

aten = torch.ops.aten


# -- the functions ------------------------------------------------------------------------------

def cat_cache(x):
    """transformers' DynamicCache: a layer's keys start as torch.tensor([]) and grow by
    cat on the sequence dim (-2) of [batch, heads, seq, dim]."""
    keys = torch.tensor([])
    keys = torch.cat([keys, x * 2], dim=-2)
    return torch.cat([keys, x], dim=-2)


def cat_mixed(x):
    """Legacy empty tensors anywhere in the list, and one of a wider dtype: skipped, but
    the result is float64, as torch.cat's."""
    e64 = torch.tensor([], dtype=torch.float64)
    return torch.cat([torch.tensor([]), x, e64, x + 1, torch.tensor([])], dim=1)


def cat_grad(x):
    return torch.func.grad(lambda x: torch.cat([torch.tensor([]), x, x * x], dim=2).sum())(x)


def _qkv_mask(heads_in_mask: int):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(4, 4, 8, 8, generator=g) for _ in range(3))
    mask = torch.randn(4, heads_in_mask, 8, 8, generator=g)
    return q, k, v, mask


def sdpa_masked(q, k, v, mask):
    """SDPA with an additive mask (a keyword input of the CPU flash kernel), forward and
    the gradient of q through the backward kernel."""
    def f(q):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    out, vjp = torch.func.vjp(f, q)
    return out, vjp(torch.ones_like(out))[0]


def heads_merged(a):
    """Attention's output, [B, H, T, D] stored as [B, T, H, D] (a transpose of a
    [B, T, H, D] value), gathered over its heads and merged back: ``transpose(1, 2)``
    of the global value is contiguous, so the trace holds a view; the gathered block
    is stored [B, H, T, D] and its transpose is not."""
    c = with_sharding_constraint(a.transpose(1, 2) * 2, P())
    return c.transpose(1, 2).view(a.shape[0], a.shape[1], -1)


def _randn(*shape):
    """The same values on every rank."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1))


def _node_shapes(lowered, target) -> list:
    out = []
    for n in lowered.local_graph.graph.nodes:
        if n.op == "call_function" and n.target is target:
            out.append([tuple(a.meta["val"].shape) for a in n.all_input_nodes])
    return out


# -- graphs, in one process --------------------------------------------------------------------

def test_cat_skips_legacy_empty_tensors_on_a_split_dim():
    mesh = Mesh.abstract((2,), ("tp",))
    x = torch.randn(2, 4, 3, 8)
    lowered = pjit(cat_cache, in_specs=P(None, "tp"), out_specs=P(None, "tp"), mesh=mesh).lower(x)
    # each cat reads this rank's heads only; nothing is gathered
    assert _node_shapes(lowered, aten.cat.default) == [[(2, 2, 3, 8)], [(2, 2, 3, 8), (2, 2, 3, 8)]]
    assert lowered.collectives() == []
    mixed = pjit(cat_mixed, in_specs=P("tp"), mesh=mesh).lower(torch.randn(4, 3))
    out = [n for n in mixed.global_graph.graph.nodes if n.op == "output"][0].args[0][0]
    assert out.meta["val"].dtype == torch.float64
    assert _node_shapes(mixed, aten.cat.default) == [[(2, 3), (2, 3)]]


def test_sdpa_mask_is_laid_out_like_the_queries():
    """Split batch: the [b, 1, s, s] mask split too; split heads: a mask that broadcasts
    over the heads stays whole, a per-head one is split like the heads."""
    dp = Mesh.abstract((2,), ("dp",))
    q, k, v, mask = _qkv_mask(1)
    fwd, bwd = aten._scaled_dot_product_flash_attention_for_cpu.default, \
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    batch = (P("dp"),) * 3 + (P(),)     # the mask whole, as transformers builds it
    for mode in (None, DataParallelMode("replicate")):
        lowered = pjit(sdpa_masked, in_specs=batch, mesh=dp, mode=mode).lower(q, k, v, mask)
        assert _node_shapes(lowered, fwd) == [[(2, 4, 8, 8)] * 3 + [(2, 1, 8, 8)]]
        assert _node_shapes(lowered, bwd)[0][-1] == (2, 1, 8, 8)
    tp = Mesh.abstract((2,), ("tp",))
    heads = P(None, "tp")
    lowered = pjit(sdpa_masked, in_specs=(heads, heads, heads, P()), mesh=tp).lower(q, k, v, mask)
    assert _node_shapes(lowered, fwd) == [[(4, 2, 8, 8)] * 3 + [(4, 1, 8, 8)]]
    assert lowered.collectives() == []
    q, k, v, mask = _qkv_mask(4)
    lowered = pjit(sdpa_masked, in_specs=(heads, heads, heads, P()), mesh=tp).lower(q, k, v, mask)
    assert _node_shapes(lowered, fwd) == [[(4, 2, 8, 8)] * 4]
    assert lowered.collectives() == []


def test_a_view_of_a_shard_laid_out_otherwise_copies_it_first():
    """NOTE [A view of a shard laid out otherwise] (sharded/modes/_expand.py): the
    lowering raised "Cannot view a tensor with shape [2, 8, 4, 4] and strides (128,
    4, 32, 1)" from torch's view (AUTO's plan for GPT-2-small on 8x8 met it)."""
    mesh = Mesh.abstract((2,), ("tp",))
    lowered = pjit(heads_merged, in_specs=P(None, None, "tp"), mesh=mesh).lower(torch.empty(2, 8, 4, 4))
    assert _node_shapes(lowered, aten.view.default)[0] == [(2, 8, 4, 4)]
    clones = [n for n in lowered.local_graph.graph.nodes if n.target is aten.clone.default]
    assert clones and clones[-1].users and next(iter(clones[-1].users)).target is aten.view.default


# -- values on real ranks ------------------------------------------------------------------------

def _cases_on_ranks():
    """(case, None or what went wrong) for each function and layout, against one device."""
    meshes = {"tp": Mesh((2,), ("tp",)), "dp": Mesh((2,), ("dp",))}
    cases = {
        "cat cache, heads split": (cat_cache, (_randn(2, 4, 3, 8),), P(None, "tp"), "tp", None),
        "cat mixed, rows split": (cat_mixed, (_randn(4, 3),), P("tp"), "tp", None),
        "cat grad, heads split": (cat_grad, (_randn(2, 4, 3),), P(None, "tp"), "tp", None),
        "sdpa mask, heads split": (sdpa_masked, _qkv_mask(1), (P(None, "tp"),) * 3 + (P(),), "tp", None),
        "sdpa per-head mask, heads split": (sdpa_masked, _qkv_mask(4), (P(None, "tp"),) * 3 + (P(),),
                                            "tp", None),
        "heads merged after a gather": (heads_merged, (_randn(2, 8, 4, 4),), P(None, None, "tp"),
                                        "tp", None),
    }
    for layout in ("replicate", "shard"):
        mode = DataParallelMode(layout)
        cases[f"cat cache, {layout}"] = (cat_cache, (_randn(4, 2, 3, 8),), P("dp"), "dp", mode)
        cases[f"sdpa mask, {layout}"] = (sdpa_masked, _qkv_mask(1), (P("dp"),) * 3 + (P(),), "dp", mode)
    out = {}
    for name, (fn, args, specs, mesh, mode) in cases.items():
        try:
            got = pjit(fn, in_specs=specs, mesh=meshes[mesh], mode=mode)(*args)
            want = fn(*args)
            torch.testing.assert_close(gather(got), want, rtol=1e-5, atol=1e-6)
            out[name] = None
        except Exception as e:  # noqa: BLE001 - reported per case
            out[name] = f"{type(e).__name__}: {str(e)[:1500]}"
    return out


def test_values_equal_one_device_on_ranks(on_ranks):
    results = on_ranks(2, _cases_on_ranks)[0]
    assert len(results) == 10
    assert {k: v for k, v in results.items() if v is not None} == {}
