"""Issue 23: the same layouts give the same program, whichever mode decided them.

DataParallelMode("replicate") chooses replicated state and a batch split over "dp";
DTensorExpandMode given those layouts as specs must lower the same local program (the
same ops, in the same order, on the same shapes), so that neither mode's step is
slower for a reason the other has fixed. Checked in one process on abstract meshes.
"""

import copy

import optree
import pytest
import torch

from benchmarks import _models as M
from examples import gpt, gpt_module
from sharded import Mesh, P, optim, pjit
from sharded.modes import DataParallelMode, DTensorExpandMode


def _program(lowered) -> list:
    """Each local node's kind, target, value shape and dtype, and its arguments (a node
    as its position, anything else as it is: the process group's name, a reduce op, a
    scalar), in order; node names left out."""
    pos: dict = {}
    out = []
    for i, n in enumerate(lowered.local_graph.graph.nodes):
        pos[n] = i
        v = n.meta.get("val")
        args = torch.fx.node.map_arg((n.args, n.kwargs), lambda a: ("node", pos[a]))
        out.append((n.op, str(n.target), repr(args),
                    (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else None))
    return out


def _module_gpt(update):
    """examples/gpt_module.py's GPT (learned position table) over its named_parameters()."""
    cfg = gpt_module.Config(vocab=64, d_model=32, n_heads=2, n_layers=2, seq=8)
    model = gpt_module.GPT(cfg, seed=0)
    params = {k: v.detach().to("meta") for k, v in model.named_parameters()}
    ids = torch.zeros(8, 8, dtype=torch.long, device="meta")
    return gpt_module.make_train_step(copy.deepcopy(model), update), params, (ids, ids)


def _functional_gpt():
    cfg = gpt.GPTConfig(vocab=64, d_model=32, n_heads=2, n_layers=2, seq=8, sdpa=True)
    params = optree.tree_map(lambda t: t.to("meta"), gpt.init_params(cfg, 0))

    def step(p, o, x, y):
        grads, loss = torch.func.grad_and_value(gpt.loss_fn)(p, x, y, cfg)
        return (*optim.adamw(p, grads, o), loss)

    return step, params, tuple(t.to("meta") for t in gpt.batch(cfg, 8, seed=1))


def _mlp():
    params = optree.tree_map(lambda t: t.to("meta"), M.mlp_init(64, 3))
    x = torch.empty(8, 64, device="meta")
    return M.mlp_train_step, params, (x, x)


CASES = {
    "module_gpt_adamw": lambda: _module_gpt(optim.adamw),
    "module_gpt_per_tensor_adamw": lambda: _module_gpt(M.per_tensor_adamw),
    "functional_gpt": _functional_gpt,
    "mlp": _mlp,
}


@pytest.mark.parametrize("case,shape", [(c, (2,)) for c in CASES] + [("module_gpt_adamw", (4,))]
                         + [(c, (2, 2)) for c in CASES])
def test_replicated_state_lowers_alike_in_both_modes(case, shape):
    """A GPT with a learned position table: under DTensorExpandMode the pending sum of
    the position table's gradient input was reduced before the embedding's backward,
    after the other gradients' bucket had been read, so its table's gradient went out
    in an all-reduce of its own (3 all-reduces a step against DataParallelMode's 2).
    Both modes now ask one policy where a pending sum is reduced
    (sharded/modes/_pending.py).

    On a 2x2 mesh with the batch split over both axes (DDP over four ranks), a
    gradient pending over both axes was reduced one axis after the other, and the
    reductions over "dp" were not bucketed: 40-odd all-reduces a step. Both modes now
    reduce a sum pending over every axis in one all-reduce over the mesh's group, the
    loss's count of targets included."""
    step, params, batch = CASES[case]()
    axes = ("dp", "tp")[:len(shape)]
    mesh = Mesh.abstract(shape, axes)
    batch_spec = P(axes if len(axes) > 1 else axes[0])
    specs = dict(in_specs=(P(), P(), batch_spec, batch_spec), out_specs=(P(), P(), P()), mesh=mesh)
    state = optim.adamw_init(params)
    by_expand = pjit(step, mode=DTensorExpandMode(), **specs).lower(params, state, *batch)
    by_dp = pjit(step, mode=DataParallelMode("replicate", axis=axes if len(axes) > 1 else axes[0]),
                 **specs).lower(params, state, *batch)
    assert by_dp.in_specs == by_expand.in_specs        # the same layouts ...
    assert _program(by_expand) == _program(by_dp)      # ... give the same program
    reductions = [c for c in by_expand.collectives() if c.kind == "all_reduce"]
    assert all(c.axis == (axes if len(axes) > 1 else axes[0]) for c in reductions), reductions
    n_params = sum(t.numel() for t in optree.tree_leaves(params))
    # every gradient in one bucket with the loss's sum, and the loss's count of
    # targets apart. (The loss's all-reduce went apart on 2x2 when an identity view of
    # its result fed the output: read at once, it ended the bucket.)
    buckets = [c.shape[0] for c in reductions if c.shape != ()]
    assert buckets == [n_params + 1], reductions


@pytest.mark.parametrize("case", list(CASES))
def test_a_batch_over_two_axes_of_three_lowers_alike_in_both_modes(case):
    """DDP over two axes of a ("dp", "fsdp", "tp") mesh: a gradient pending over "dp"
    and "fsdp" is reduced one axis after the other. DTensorExpandMode left the order to
    DTensor ("dp" first) and did not chain the reductions, so each gradient's
    all-reduce over "dp" went out alone (7 collectives a step for the MLP against
    DataParallelMode's 2); both now reduce over "fsdp" and then "dp", and both run
    the chained-reduction passes (NOTE [Chained reductions]): one bucket per axis,
    whichever order DataParallelMode's axes are named in (named ("fsdp", "dp"), it
    reduced over "dp" first: found by review)."""
    step, params, batch = CASES[case]()
    mesh = Mesh.abstract((2, 2, 2), ("dp", "fsdp", "tp"))
    batch_spec = P(("dp", "fsdp"))
    specs = dict(in_specs=(P(), P(), batch_spec, batch_spec), out_specs=(P(), P(), P()), mesh=mesh)
    state = optim.adamw_init(params)
    by_expand = pjit(step, mode=DTensorExpandMode(), **specs).lower(params, state, *batch)
    for axis in (("dp", "fsdp"), ("fsdp", "dp")):
        by_dp = pjit(step, mode=DataParallelMode("replicate", axis=axis), **specs).lower(
            params, state, *batch)
        assert _program(by_expand) == _program(by_dp), axis
    n_params = sum(t.numel() for t in optree.tree_leaves(params))
    buckets = [(c.axis, c.shape[0]) for c in by_expand.collectives() if c.shape != ()]
    assert [axis for axis, _ in buckets] == ["fsdp", "dp"], buckets
    assert all(n_params <= size <= n_params + 1 for _, size in buckets), buckets


def test_a_sum_pending_over_every_axis_is_one_all_reduce_where_an_op_needs_it():
    """A sum pending over both axes of a 2x2 mesh, read by an op that is not linear in
    it (a number added, a floor division), is reduced by the policy in one all-reduce
    over the mesh: the policy took `x.sum(0) + 1` for linear (the number is no DTensor
    operand), and DTensor reduced it inside the add, one axis after the other. A
    scaling stays linear; a pending divisor is reduced apart from its numerator."""
    mesh = Mesh.abstract((2, 2), ("dp", "tp"))
    cases = {
        "plus a number": (lambda x: x.sum(0) + 1, 1),
        "a number minus": (lambda x: 1 - x.sum(0), 1),
        "floor division": (lambda x: torch.div(x.sum(0), 3, rounding_mode="floor"), 1),
        "scaled": (lambda x: x.sum(0) * 3, 1),
        "over a pending divisor": (lambda x: x.sum(0) / ((x * x).sum(0) + 1), 2),
    }
    for name, (f, n) in cases.items():
        lowered = pjit(f, in_specs=P(("dp", "tp")), out_specs=P(), mesh=mesh,
                       mode=DTensorExpandMode()).lower(torch.empty(8, 4))
        got = [(c.kind, c.axis) for c in lowered.collectives()]
        assert got == [("all_reduce", ("dp", "tp"))] * n, (name, got)
