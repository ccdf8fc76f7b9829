"""HSDP: DataParallelMode("shard", axis=("dp_replicate", "dp_shard")) (FSDP2's 2-D mesh
convention, torchtitan's dp_replicate x fsdp). State is sharded over "dp_shard" and
replicated over "dp_replicate", the batch split over both; gradients are
reduce-scattered over "dp_shard" and the shards all-reduced over "dp_replicate";
parameters are gathered over "dp_shard" only. On real gloo ranks a small GPT's train
steps equal one device (2x2, and 2x2x2 with Megatron specs over "tp"); the programs'
collectives, their axes and buckets are checked on the ranks and on abstract meshes;
bad axes are clear errors. ``DataParallelMode("replicate", axis=(a, b))`` is DDP over
both axes."""

from __future__ import annotations

import math

import optree
import pytest
import torch

from examples import gpt
from sharded import Mesh, P, gather, optim, spec_of
from sharded.modes import DataParallelMode, DTensorExpandMode
from sharded.spec import local_shape
from tests.ranks import InPlaceReductions
from transforms import pjit

AXES = ("dp_replicate", "dp_shard")
BATCH = P(AXES)          # the batch split over both axes, "dp_replicate" major
CFG = gpt.GPTConfig(vocab=32, d_model=16, n_heads=2, n_layers=2, seq=8)


def _step(cfg):
    return lambda p, o, x, y: gpt.train_step(p, o, x, y, cfg)


def _specs(params, tp: bool):
    ps = gpt.tp_specs(params) if tp else gpt.dp_specs(params)
    return ps, gpt.opt_specs(ps)


def _calls(lowered) -> list:
    return [(c.kind, c.axis, c.shape, c.group_size, c.bytes, c.wire_bytes) for c in lowered.collectives()]


# -- rank-side bodies ---------------------------------------------------------------------

def _train(mesh_shape, names, sharding, steps=3, bucket_bytes=None):
    """On every rank: ``steps`` GPT train steps under HSDP (or DDP over both axes;
    ``sharding="expand"``: DTensorExpandMode given DDP's layouts) equal the same steps
    on one device (losses, parameters, AdamW moments); returns the layouts and the
    program's collectives."""
    mesh = Mesh(mesh_shape, names)
    tp = "tp" in names
    params = gpt.init_params(CFG, 0)
    ps, os_ = _specs(params, tp)
    kw = {} if bucket_bytes is None else {"bucket_bytes": bucket_bytes}
    mode = DTensorExpandMode() if sharding == "expand" else DataParallelMode(sharding, axis=AXES, **kw)
    step = pjit(_step(CFG), in_specs=(ps, os_, BATCH, BATCH), mesh=mesh, mode=mode)
    ids, targets = gpt.batch(CFG, 8, seed=1)
    p, o = params, optim.adamw_init(params)
    rp, ro = p, o
    watch = InPlaceReductions()
    for k in range(steps):
        with watch.on_call(k):
            p, o, loss = step(p, o, ids, targets)
        rp, ro, ref = gpt.train_step(rp, ro, ids, targets, CFG)
        torch.testing.assert_close(gather(loss), ref, rtol=1e-5, atol=1e-5)
    watch.check()
    torch.testing.assert_close(gather(p), rp, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(gather(o), ro, rtol=1e-4, atol=1e-6)
    assert step.trace_count == 1
    lowered = step.lower(p, o, ids, targets)
    return {
        "specs": optree.tree_leaves(optree.tree_map(spec_of, p), is_leaf=lambda x: isinstance(x, P)),
        "local": [t.to_local().numel() for t in optree.tree_leaves(p)],
        "calls": _calls(lowered),
        "text": lowered.as_text(),
        "layouts": lowered.layouts,
        "in_place_reductions": watch.seen,
    }


def _train_2x2():
    return {s: _train((2, 2), AXES, s) for s in ("shard", "replicate")}


def _train_2x2x2():
    return {s: _train((2, 2, 2), (*AXES, "tp"), s, steps=2) for s in ("shard", "replicate", "expand")}


_RESULTS: dict = {}


def _results(on_ranks, ws):
    if ws not in _RESULTS:
        _RESULTS[ws] = on_ranks(ws, _train_2x2 if ws == 4 else _train_2x2x2)[0]
    return _RESULTS[ws]


def _numel(tp: int = 1) -> tuple[int, int]:
    """The elements of the GPT's parameters in one "tp" block, and the number of
    parameters."""
    params = gpt.init_params(CFG, 0)
    specs = optree.tree_leaves(gpt.tp_specs(params), is_leaf=lambda x: isinstance(x, P))
    leaves = optree.tree_leaves(params)
    return (sum(t.numel() // (tp if "tp" in s.axes() else 1) for t, s in zip(leaves, specs)),
            len(leaves))


def _by(calls, kind, axis):
    return [c for c in calls if c[0] == kind and c[1] == axis]


# -- on ranks ------------------------------------------------------------------------------

def _check_hsdp_program(r, tp: int):
    total, n_params = _numel(tp)
    calls = r["calls"]
    # every parameter sharded over dp_shard (its dims all divide), replicated over dp_replicate
    assert all("dp_shard" in s.axes() and "dp_replicate" not in s.axes() for s in r["specs"]), r["specs"]
    assert sum(r["local"]) == total // 2
    # parameters gathered over dp_shard only, gradients reduce-scattered over dp_shard only
    gathers = [c for c in calls if c[0] == "all_gather"]
    scatters = [c for c in calls if c[0] == "reduce_scatter"]
    assert gathers and all(c[1] == "dp_shard" and c[3] == 2 for c in gathers), gathers
    assert scatters and all(c[1] == "dp_shard" and c[3] == 2 for c in scatters), scatters
    # each gradient's "tp" block reduce-scattered once; its shard all-reduced once over
    # dp_replicate; in buckets (NOTE [Chained reductions]), not one per parameter
    assert sum(math.prod(c[2]) for c in scatters) == total, scatters
    over_rep = [c for c in calls if c[1] == "dp_replicate"]
    assert {c[0] for c in over_rep} == {"all_reduce"}, over_rep
    grads = [c for c in over_rep if c[2] != ()]      # (not the loss's count)
    # (the loss's pending sum over "dp_replicate" may share the last bucket)
    assert total // 2 <= sum(math.prod(c[2]) for c in grads) <= total // 2 + 1, over_rep
    assert len(scatters) < n_params and len(grads) <= len(scatters), (scatters, grads)
    # ring costs over each sub-group: its own size
    for kind, axis, shape, n, b, w in calls:
        factor = 2 * (n - 1) / n if kind == "all_reduce" else (n - 1) / n
        assert w == int(factor * b), (kind, axis, n, b, w)
    assert "over 'dp_replicate'" in r["text"] and "over 'dp_shard'" in r["text"]


def test_hsdp_2x2_equals_one_device(on_ranks):
    """(Losses, parameters and moments checked against one device on the ranks.)"""
    r = _results(on_ranks, 4)["shard"]
    _check_hsdp_program(r, tp=1)
    # the loss's count of targets (in the forward) and the loss: each one all-reduce
    # over both axes (the world), not one per axis
    assert [c[:3] for c in r["calls"] if c[2] == ()] == [("all_reduce", AXES, ())] * 2, r["calls"]
    assert r["layouts"]["inputs"]["args[2]"] == ("batch", BATCH)
    assert r["layouts"]["inputs"]["args[0]['wte']"] == ("state", P("dp_shard"))


def test_replicate_over_two_axes_is_ddp(on_ranks):
    """DataParallelMode("replicate", axis=pair): parameters replicated over both, one
    bucket of gradients all-reduced over both axes at once (the 2x2 mesh is the
    world: one group)."""
    r = _results(on_ranks, 4)["replicate"]
    total, _ = _numel()
    assert all(s == P() for s in r["specs"])
    assert {c[0] for c in r["calls"]} == {"all_reduce"}
    assert all(c[1] == AXES and c[3] == 4 for c in r["calls"]), r["calls"]
    assert sum(math.prod(c[2]) for c in r["calls"]) == total + 2
    assert r["in_place_reductions"] > 0      # (its bucket is reduced in place: the watch saw it)


def test_hsdp_with_tp_2x2x2_equals_one_device(on_ranks):
    """(Numerics checked on 8 ranks.) ("dp_replicate", "dp_shard", "tp") with Megatron
    specs over "tp": HSDP over the first two axes of each "tp" block."""
    res = _results(on_ranks, 8)
    r = res["shard"]
    _check_hsdp_program(r, tp=2)
    assert {c[1] for c in r["calls"]} <= {"dp_shard", "dp_replicate", "tp"}
    # DDP over both data axes beside "tp": each gradient all-reduced over each data
    # axis once, in buckets (a sum over two of three axes is one reduction per axis)
    r = res["replicate"]
    total, n_params = _numel(2)
    for axis in AXES:
        grads = [c for c in _by(r["calls"], "all_reduce", axis) if c[2] != ()]
        assert total <= sum(math.prod(c[2]) for c in grads) <= total + 1, (axis, r["calls"])
        assert len(grads) < n_params // 2, grads
    # DTensorExpandMode given those layouts: the same collectives (issue 23: it reduced
    # over "dp_replicate" first, each gradient alone), and one device's values
    assert res["expand"]["calls"] == r["calls"]


# -- abstract meshes: the plan without ranks -----------------------------------------------

def _lower(shape, names, mode, cfg=CFG, batch=8):
    mesh = Mesh.abstract(shape, names)
    with torch.device("meta"):
        params = gpt.init_params(cfg)
        opt = optim.adamw_init(params)
    ids = torch.empty(batch, cfg.seq, dtype=torch.long, device="meta")
    ps, os_ = _specs(params, "tp" in names)
    step = pjit(_step(cfg), in_specs=(ps, os_, BATCH, BATCH), mesh=mesh, mode=mode)
    return step.lower(params, opt, ids, ids), params, ps


@pytest.mark.parametrize("shape", [(2, 4), (4, 2, 2)])
def test_hsdp_plans_on_abstract_meshes(shape):
    """Each gradient is reduce-scattered over dp_shard and its shard all-reduced over
    dp_replicate, once; group sizes and ring bytes are the sub-group's."""
    names = AXES + (("tp",) if len(shape) == 3 else ())
    low, params, ps = _lower(shape, names, DataParallelMode("shard", axis=AXES), batch=16)
    tp_mesh = Mesh.abstract((1, 1, shape[-1]) if len(shape) == 3 else (1, 1), names)
    block = sum(math.prod(local_shape(t.shape, s, tp_mesh)) for t, s in zip(
        optree.tree_leaves(params), optree.tree_leaves(ps, is_leaf=lambda x: isinstance(x, P))))
    calls = _calls(low)
    rs = [c for c in calls if c[0] == "reduce_scatter"]
    assert all(c[1] == "dp_shard" and c[3] == shape[1] for c in rs)
    assert sum(math.prod(c[2]) for c in rs) == block
    ar = [c for c in _by(calls, "all_reduce", "dp_replicate") if c[2] != ()]
    assert all(c[3] == shape[0] for c in ar)
    assert block // shape[1] <= sum(math.prod(c[2]) for c in ar) <= block // shape[1] + 1
    assert all(c[1] == "dp_shard" for c in calls if c[0] == "all_gather")
    cost = low.cost(by="axis")
    assert cost["dp_replicate"]["wire_bytes"] == sum(c[5] for c in calls if c[1] == "dp_replicate")


@pytest.mark.parametrize("precision,bucket_bytes", [({}, 4096), ({"param_dtype": torch.bfloat16}, 2048)],
                         ids=["fp32", "bf16-reductions"])
def test_buckets_and_overlap_over_two_axes(precision, bucket_bytes):
    """NOTE [Chained reductions]: with buckets smaller than a block, several
    reduce-scatter buckets over dp_shard, each followed by its all-reduce over
    dp_replicate as soon as it is waited for (while the backward goes on): the
    replicate-axis reductions are no more than the shard-axis ones, not one per
    parameter, and at most one reduce-scatter is in flight. With gradients reduced in
    bf16 (mixed precision, reduce_dtype None) each reduced shard is cast back to fp32
    by its own reader: the replicate-axis reductions still share buckets."""
    _, n_params = _numel()
    low, _, _ = _lower((2, 2), AXES, DataParallelMode("shard", axis=AXES, bucket_bytes=bucket_bytes,
                                                       **precision))
    nodes = list(low.local_graph.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    calls = {c.node: c for c in low.collectives()}
    rs = [n for n in nodes if calls.get(n.name) and calls[n.name].kind == "reduce_scatter"]
    ar = [n for n in nodes if calls.get(n.name) and calls[n.name].axis == "dp_replicate"]
    assert 2 < len(rs) < n_params and 2 < len(ar) <= len(rs), (len(rs), len(ar))
    for a, b in zip(rs, rs[1:]):
        assert pos[next(iter(a.users))] < pos[b]          # its wait before the next one
    # the replicate-axis all-reduces are issued during the backward, each right
    # after the reduce-scatter wait it reads (no reduce-scatter issued in between)
    assert sum(pos[a] < pos[rs[-1]] for a in ar) >= len(ar) - 1
    waits = [next(iter(r.users)) for r in rs]
    for a in ar:
        last = max((w for w in waits if pos[w] < pos[a]), key=pos.__getitem__)
        assert not any(pos[last] < pos[r] < pos[a] for r in rs), a


# -- errors --------------------------------------------------------------------------------

def test_bad_axes():
    with pytest.raises(ValueError, match=r"names 3 axes.*HSDP"):
        DataParallelMode("shard", axis=("a", "b", "c"))
    with pytest.raises(ValueError, match=r"names mesh axis 'dp' twice"):
        DataParallelMode("shard", axis=("dp", "dp"))
    with pytest.raises(TypeError, match=r"DataParallelMode axis=\('dp', 3\): 3 is not a mesh axis name"):
        DataParallelMode("shard", axis=("dp", 3))
    with pytest.raises(TypeError, match="DataParallelMode axis must be a mesh axis name or a pair"):
        DataParallelMode("shard", axis=3)
    assert DataParallelMode("shard", axis=["dp_replicate", "dp_shard"]).axis == AXES
    assert DataParallelMode("shard", axis=("dp",)).axis == "dp"


def _error(fn, *args) -> str:
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 - the message is what the test checks
        return f"{type(e).__name__}: {e}"
    return "no error"


def test_errors_name_the_axes_and_the_fix():
    mesh = Mesh.abstract((2, 1), ("dp_replicate", "fsdp"))
    x = torch.empty(8, 4, device="meta")
    msg = _error(pjit(lambda x: x.sum(), in_specs=P(("dp_replicate", "fsdp")), mesh=mesh,
                      mode=DataParallelMode("shard", axis=AXES)).lower, x)
    assert "DataParallelMode('shard', axis=('dp_replicate', 'dp_shard'))" in msg, msg
    assert "mesh axis 'dp_shard' is not in the mesh" in msg and "('dp_replicate', 'fsdp')" in msg, msg
    assert "pass axis= a (replicate, shard) pair" in msg, msg
    mesh = Mesh.abstract((2, 2), AXES)
    mode = DataParallelMode("shard", axis=AXES)
    # a batch input split over one of the two axes
    msg = _error(pjit(lambda x: x.sum(), in_specs=P("dp_shard"), mesh=mesh, mode=mode).lower, x)
    assert "split over both data axes" in msg and "P(('dp_replicate', 'dp_shard'))" in msg, msg
    # the batch must divide by the product of both axes' sizes
    msg = _error(pjit(lambda x: x.sum(), in_specs=BATCH, mesh=mesh, mode=mode).lower,
                 torch.empty(6, 4, device="meta"))
    assert "does not divide it" in msg and "4" in msg, msg
