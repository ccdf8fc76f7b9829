"""The benchmarks' same-work check (NOTE [Every row did the same work] in
benchmarks/_models.py): a row that trained with wrong gradients, a wrong learning rate
or fewer steps fails with the row and the difference named; a right row, stepped by
torch's AdamW on an nn.Module where the reference is functional, passes."""

import functools

import pytest
import torch

from benchmarks import _models as M

STEPS, WIDTH, LAYERS = 6, 32, 3


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(16, WIDTH, generator=g), torch.randn(16, WIDTH, generator=g)


@functools.lru_cache(maxsize=None)
def _functional(steps=STEPS, grad_scale=1.0, lr=1e-3):
    """The functional MLP step as the benchmarks run it, with its gradients scaled."""
    from sharded import optim

    x, y = _batch()
    p = M.mlp_init(WIDTH, LAYERS)
    o = optim.adamw_init(p)
    for _ in range(steps):
        grads, loss = torch.func.grad_and_value(M.mlp_loss)(p, x, y)
        grads = torch.utils._pytree.tree_map(lambda t: t * grad_scale, grads)
        p, o = optim.adamw(p, grads, o, lr=lr)
    return M.functional_fingerprint(loss, p, o)


@functools.lru_cache(maxsize=None)
def _module(steps=STEPS):
    x, y = _batch()
    model = M.MLPModule(M.mlp_init(WIDTH, LAYERS))
    opt = M.torch_adamw(model.parameters(), lr=1e-3, weight_decay=1e-2)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
    return M.optimizer_fingerprint(loss.detach(), opt)


def test_right_rows_pass():
    ref = _functional()
    checked = M.require_same_work({"functional": ref, "module": _module()}, ref, "test")
    assert checked["module"]["max_rel_diff"] < M.SAME_WORK_RTOL / 10


@pytest.mark.parametrize("row, names", [
    # Adam is blind to the gradients' scale: the loss and parameters agree, the moments do not
    (lambda: _functional(grad_scale=2.0), ["exp_avg_sumsq", "exp_avg_sq_sum"]),
    (lambda: _functional(lr=2e-3), ["loss", "exp_avg_sumsq"]),
    (lambda: _functional(steps=STEPS - 1), [f"ran {STEPS - 1} optimizer steps, the reference {STEPS}"]),
])
def test_a_wrong_row_fails_with_the_difference_named(row, names):
    with pytest.raises(M.DifferentWork) as e:
        M.require_same_work({"right": _module(), "wrong": row()}, _functional(), "bench_test")
    msg = str(e.value)
    assert "bench_test: 1 row(s) did different work" in msg and "  wrong: " in msg
    assert "  right: " not in msg
    for name in names:
        assert name in msg
    assert "relative difference" in msg


def test_gradients_twice_too_large_leave_loss_and_params_alone():
    """Why the check reads the moments: under AdamW the loss and the parameters of a
    row with 2x gradients agree with the right run to float rounding."""
    checked = M.same_work({"wrong": _functional(grad_scale=2.0)}, _functional())["wrong"]
    text = "; ".join(checked["failures"])
    assert "exp_avg_sq_sum" in text and "loss " not in text and "params_sum" not in text


def test_program_id_groups_one_program_on_either_mesh_and_parts_others():
    """bench_auto's NOTE [Ranking distinct programs]: DDP lowered by DTensorExpandMode
    on a 2x2 mesh (the batch over both axes) and by DataParallelMode on a flat (4,)
    mesh is one program, so one digest; the MLP's Megatron specs on the 2x2 mesh are
    another program, another digest."""
    import optree

    from benchmarks.bench_auto import program_id
    from benchmarks.bench_train_step import mlp_tp_specs
    from sharded import Mesh, P, optim, pjit
    from sharded.modes import DataParallelMode, DTensorExpandMode

    params = optree.tree_map(lambda t: t.to("meta"), M.mlp_init(64, 2))
    state = optim.adamw_init(params)
    x = torch.empty(8, 64, device="meta")
    grid, flat = Mesh.abstract((2, 2), ("dp", "tp")), Mesh.abstract((4,), ("dp",))

    def lower(mesh, ps, bs, mode):
        os_ = {"step": P(), "m": ps, "v": ps}
        return pjit(M.mlp_train_step, in_specs=(ps, os_, bs, bs), out_specs=(ps, os_, P()),
                    mesh=mesh, mode=mode).lower(params, state, x, x)

    ddp = program_id(lower(grid, P(), P(("dp", "tp")), DTensorExpandMode()))
    ddp_mode = program_id(lower(flat, P(), P("dp"), DataParallelMode("replicate")))
    megatron = program_id(lower(grid, mlp_tp_specs(params), P("dp"), DTensorExpandMode()))
    assert ddp == ddp_mode != megatron


def test_orders_are_read_from_the_rounds_by_a_sign_test():
    """bench_auto's NOTE [Orders the rounds can tell apart]: 9 of 10 paired rounds tell
    two programs apart (p 0.021), 8 of 10 do not (p 0.11); which one is faster."""
    from benchmarks.bench_auto import sign_test, told_apart

    assert sign_test(9, 10) == pytest.approx(22 / 1024) and sign_test(1, 10) == sign_test(9, 10)
    assert sign_test(8, 10) == pytest.approx(112 / 1024) and sign_test(5, 10) == 1.0
    slow = [2.0] * 10
    assert told_apart([1.0] * 9 + [3.0], slow) == -1 and told_apart(slow, [1.0] * 9 + [3.0]) == 1
    assert told_apart([1.0] * 8 + [3.0] * 2, slow) == 0
