"""pjit on real gloo ranks equals the single-device program (assert_close)."""

import pytest
import torch

from sharded import P
from tests.models import (
    ATTN_SHAPES, ATTN_TP, MLP_SHAPES, MLP_TP, attn_loss_matmul, attn_loss_sdpa, check_step,
    embed_loss, init, mlp_loss, sgd_step, specs_of,
)


def _batch(seed, n=8, d=8, classes=4):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g), torch.randint(0, classes, (n,), generator=g)


# -- rank-side bodies (module level: the pool pickles them by reference) --------------

def _mlp_data_parallel(ws):
    p = init(0, MLP_SHAPES)
    x, y = _batch(1)
    return check_step((ws,), ("dp",), sgd_step(mlp_loss), (p, x, y),
                      (P(), P("dp"), P("dp")), (P(), P()))


def _mlp_tensor_parallel(ws):
    p = init(0, MLP_SHAPES)
    x, y = _batch(1)
    specs = specs_of(MLP_TP)
    return check_step((ws,), ("tp",), sgd_step(mlp_loss), (p, x, y),
                      (specs, P(), P()), (specs, P()))


def _mlp_dp_tp():
    p = init(0, MLP_SHAPES)
    x, y = _batch(1)
    specs = specs_of(MLP_TP)
    return check_step((2, 2), ("dp", "tp"), sgd_step(mlp_loss), (p, x, y),
                      (specs, P("dp"), P("dp")), (specs, P()))


def _embedding_row_sharded(ws):
    g = torch.Generator().manual_seed(3)
    p = {"emb": torch.randn(16, 8, generator=g), "out": torch.randn(4, 8, generator=g)}
    ids = torch.randint(0, 16, (4, 5), generator=g)
    y = torch.randint(0, 4, (4,), generator=g)
    specs = {"emb": P("tp"), "out": P()}
    return check_step((ws,), ("tp",), sgd_step(embed_loss), (p, ids, y),
                      (specs, P(), P()), (specs, P()))


def _attention(mesh_shape, names, use_sdpa):
    p = init(5, ATTN_SHAPES)
    x = torch.randn(4, 6, 16, generator=torch.Generator().manual_seed(6))
    specs = specs_of(ATTN_TP)
    batch = P("dp") if "dp" in names else P()
    loss = attn_loss_sdpa if use_sdpa else attn_loss_matmul
    return check_step(mesh_shape, names, sgd_step(loss), (p, x), (specs, batch), (specs, P()))


# -- tests -------------------------------------------------------------------------

@pytest.mark.parametrize("ws", [2, 4])
def test_mlp_train_step_batch_sharded(on_ranks, ws):
    costs = on_ranks(ws, _mlp_data_parallel, ws)
    # Data parallel: the gradients (4 params) and the loss are reduced over "dp".
    assert costs[0]["all_reduce"]["count"] >= 1


@pytest.mark.parametrize("ws", [2, 4])
def test_mlp_train_step_megatron(on_ranks, ws):
    on_ranks(ws, _mlp_tensor_parallel, ws)


def test_mlp_train_step_dp_x_tp_mesh(on_ranks):
    on_ranks(4, _mlp_dp_tp)


@pytest.mark.parametrize("ws", [2, 4])
def test_row_sharded_embedding(on_ranks, ws):
    on_ranks(ws, _embedding_row_sharded, ws)


@pytest.mark.parametrize("use_sdpa", [False, True], ids=["matmul", "sdpa"])
def test_attention_heads_sharded(on_ranks, use_sdpa):
    on_ranks(2, _attention, (2,), ("tp",), use_sdpa)


@pytest.mark.parametrize("use_sdpa", [False, True], ids=["matmul", "sdpa"])
def test_attention_dp_x_tp(on_ranks, use_sdpa):
    cost = on_ranks(4, _attention, (2, 2), ("dp", "tp"), use_sdpa)[0]
    # Pending sums are reduced where they meet a non-linear op, not reduce-scattered
    # and all-gathered back (DTensor's greedy choice on 2-D meshes).
    assert set(cost) == {"all_reduce", "total"}, cost
