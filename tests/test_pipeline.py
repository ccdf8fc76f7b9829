"""Pipeline parallelism on real gloo ranks (sharded.pipelining, docs in its module
docstrings): a pipelined train step (``pipeline(loss_fn, microbatches=m, schedule=...)``
inside ``torch.func.grad_and_value``, AdamW after it) equals the same step run eagerly on
one device (losses over steps and final parameters); each stage's state lives on its
stage's slice of the mesh only; bad programs are clear errors on every rank, never a
hang; random numbers do not depend on the pipeline.

Sources named per test: the issue's "Must hold" list; torch's
``test/distributed/pipelining/test_schedule.py`` (2.13: its ``ScheduleTest`` runs every
schedule over micro-batch counts and checks the stage's gradients and parameters against
the model on one device); torchtitan issue 775 (fewer micro-batches than stages hung).

All the cases of a world size run in ONE call on the shared rank pools (tests/ranks.py),
each case caught on the ranks so that one failing case is reported on its own.
"""

from __future__ import annotations

import functools
import traceback

import optree
import pytest
import torch
import torch.nn.functional as F

from sharded import Mesh, P, optim, pipe_split, pipeline, pjit, shard_map
from sharded import random as srandom
from sharded.modes import DataParallelMode, DTensorExpandMode
from sharded.pipelining._schedules import stage_ranks

D, HID, N_CLASSES, BATCH = 8, 16, 3, 8


# -- the model, its step and the one-device reference ---------------------------------------

def init(n_blocks: int = 4, megatron: bool = False) -> dict:
    g = torch.Generator().manual_seed(0)
    if megatron:
        blocks = [{"w1": torch.randn(D, HID, generator=g) * 0.3,
                   "w2": torch.randn(HID, D, generator=g) * 0.3} for _ in range(n_blocks)]
    else:
        blocks = [{"w": torch.randn(D, D, generator=g) * 0.3, "b": torch.zeros(D)}
                  for _ in range(n_blocks)]
    return {"blocks": blocks, "head": torch.randn(D, N_CLASSES, generator=g)}


def data(batch: int = BATCH):
    x = torch.randn(batch, D, generator=torch.Generator().manual_seed(1))
    return x, torch.arange(batch) % N_CLASSES


def loss_fn(p, x, y, splits=(2,), auto=False, dropout=0.0):
    """``splits``: the block indices with a ``pipe_split`` before them (repeated: several
    splits in a row). Blocks are tanh(h @ w + b), or Megatron MLPs h + tanh(h @ w1) @ w2
    (w1 split on its output dim over "tp", w2 on its input dim)."""
    h = x
    for i, blk in enumerate(p["blocks"]):
        for _ in range(list(splits).count(i)):
            h = pipe_split(h, auto=auto)
        if "w1" in blk:
            h = h + torch.tanh(h @ blk["w1"]) @ blk["w2"]
        else:
            h = torch.tanh(h @ blk["w"] + blk["b"])
        if dropout:
            h = F.dropout(h, dropout, training=True)
    return F.cross_entropy(h @ p["head"], y)


def make_step(m, schedule="1F1B", splits=(2,), virtual=1, clip=False, dropout=0.0, auto=False):
    pl = pipeline(functools.partial(loss_fn, splits=splits, auto=auto, dropout=dropout),
                  microbatches=m, schedule=schedule, virtual_stages=virtual)

    def step(p, opt, x, y):
        g, loss = torch.func.grad_and_value(pl)(p, x, y)
        norm = torch.zeros(())
        if clip:
            g, norm = optim.clip_by_global_norm(g, 0.5)
        p, opt = optim.adamw(p, g, opt, lr=1e-2)
        return p, opt, loss, norm
    return step


STEP_KEYS = ("m", "schedule", "splits", "virtual", "clip", "dropout", "auto")


def _step_kw(case: dict) -> dict:
    return {k: case[k] for k in STEP_KEYS if k in case}


def reference(case: dict):
    """The case's steps run eagerly on one device (pipeline(...) outside pjit: the mean
    over the micro-batches)."""
    p = init(case.get("n_blocks", 4), case.get("megatron", False))
    opt = optim.adamw_init(p)
    x, y = data(case.get("batch", BATCH))
    step = make_step(**_step_kw(case))
    losses = []
    for _ in range(case.get("steps", 2)):
        p, opt, loss, norm = step(p, opt, x, y)
        losses.append((float(loss), float(norm)))
    return losses, optree.tree_leaves(p)


# -- rank-side bodies -----------------------------------------------------------------------

def _mode(name):
    return {None: None, "replicate": DataParallelMode("replicate", axis="dp"),
            "shard": DataParallelMode("shard", axis="dp"),
            "expand": DTensorExpandMode()}[name]


def _megatron_specs(n_blocks: int):
    ps = {"blocks": [{"w1": P(None, "tp"), "w2": P("tp", None)} for _ in range(n_blocks)],
          "head": P()}
    return ps, {"step": P(), "m": ps, "v": ps}


def _train(case: dict) -> dict:
    """On every rank: the case's pipelined steps under pjit; the losses, the full
    parameters this rank's stage holds, and each leaf's local element count."""
    mesh = Mesh(case["shape"], case["names"])
    n_blocks = case.get("n_blocks", 4)
    p = init(n_blocks, case.get("megatron", False))
    opt = optim.adamw_init(p)
    x, y = data(case.get("batch", BATCH))
    b = case.get("batch_spec", P("dp") if "dp" in case["names"] else P())
    ps, os_ = _megatron_specs(n_blocks) if case.get("megatron") else (P(), P())
    step = pjit(make_step(**_step_kw(case)), in_specs=(ps, os_, b, b), mesh=mesh,
                mode=_mode(case.get("mode")))
    if case.get("seed") is not None:
        srandom.manual_seed(case["seed"])
    losses, raw = [], []
    for _ in range(case.get("steps", 2)):
        p, opt, loss, norm = step(p, opt, x, y)
        loss_mesh = tuple(loss.device_mesh.mesh.flatten().tolist())
        loss, norm = loss.full_tensor(), norm.full_tensor()
        losses.append((float(loss), float(norm)))
        raw.append(loss)
    full = {k: leaf.full_tensor() for k, leaf in enumerate(optree.tree_leaves(p))
            if leaf.to_local().numel() > 0}
    local = lambda tree: [leaf.to_local().numel() for leaf in optree.tree_leaves(tree)]  # noqa: E731
    return {"losses": losses, "raw": raw, "full": full, "p_local": local(p),
            "m_local": local(opt["m"]), "v_local": local(opt["v"]),
            "step_local": opt["step"].to_local().numel(), "trace_count": step.trace_count,
            "loss_mesh": loss_mesh}


def _guarded(fn, *args):
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 (reported per case by the tests)
        return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}


def _train_all(cases: dict) -> dict:
    return {name: _guarded(_train, case) for name, case in cases.items()}


def _gather_outputs() -> dict:
    """On every rank: sharded.gather of a pipelined step's parameters (stage-slice
    DTensors) after one step."""
    from sharded import gather
    case = {"shape": (2,), "names": ("pp",), "m": 2, "steps": 1}
    mesh = Mesh(case["shape"], case["names"])
    p = init()
    opt = optim.adamw_init(p)
    x, y = data()
    step = pjit(make_step(2), in_specs=(P(), P(), P(), P()), mesh=mesh)
    p, opt, _, _ = step(p, opt, x, y)
    return _guarded(lambda: {"leaves": optree.tree_leaves(gather(p))})


def _restaged() -> dict:
    """On 4 ranks (pp=2 x dp=2, "shard"): steps split before block 2, then 1, then 2."""
    from sharded import gather

    def body():
        mesh = Mesh((2, 2), ("pp", "dp"))
        p, opt = init(), optim.adamw_init(init())
        x, y = data()
        specs = (P(), P(), P("dp"), P("dp"))
        mode = DataParallelMode("shard", axis="dp")
        at2 = pjit(make_step(2), in_specs=specs, mesh=mesh, mode=mode)
        at1 = pjit(make_step(2, splits=(1,)), in_specs=specs, mesh=mesh, mode=mode)
        losses = []
        for step in (at2, at1, at2):
            p, opt, loss, _ = step(p, opt, x, y)
            losses.append(float(loss.full_tensor()))
        return {"losses": losses, "leaves": optree.tree_leaves(gather(p))}
    return _guarded(body)


# -- bad inputs (2 ranks) ---------------------------------------------------------------------

def _bad_step(kind: str):
    """(step, in_specs, mesh, args) of one bad program."""
    p = init()
    opt = optim.adamw_init(p)
    x, y = data()
    mesh = Mesh((2,), ("pp",))
    specs = (P(), P(), P(), P())
    if kind == "indivisible_batch":          # batch 6 into 4 micro-batches
        x, y = data(6)
        step = make_step(4)
    elif kind == "more_stages_than_blocks":  # 2 blocks, a candidate split before each, 4 stages
        p = init(2)
        opt = optim.adamw_init(p)
        step = make_step(2, "Interleaved1F1B", splits=(0, 1), virtual=2, auto=True)
    elif kind == "stage_count_mismatch":     # 3 forced stages on pp=2 x 1 virtual stage
        step = make_step(2, splits=(1, 2))
    elif kind == "split_in_shard_map":
        def body(h):
            return pipe_split(h)

        def lf(p, x, y):
            h = x
            for i, blk in enumerate(p["blocks"]):
                if i == 2:
                    h = shard_map(body, mesh=mesh, in_specs=P(), out_specs=P())(h)
                h = torch.tanh(h @ blk["w"] + blk["b"])
            return F.cross_entropy(h @ p["head"], y)
        pl = pipeline(lf, microbatches=2)

        def step(p, opt, x, y):
            g, loss = torch.func.grad_and_value(pl)(p, x, y)
            p, opt = optim.adamw(p, g, opt, lr=1e-2)
            return p, opt, loss
    elif kind == "stage_without_params":     # two splits in a row: stage 1 has no block
        step = make_step(2, "Interleaved1F1B", splits=(2, 2, 3), virtual=2)
    elif kind == "no_pp_axis":
        mesh = Mesh((2,), ("dp",))
        step = make_step(2)
    elif kind == "params_over_pp":
        step = make_step(2)
        specs = (P("pp"), P(), P(), P())
    else:
        raise AssertionError(kind)
    return pjit(step, in_specs=specs, mesh=mesh), (p, opt, x, y)


BAD = ("indivisible_batch", "more_stages_than_blocks", "stage_count_mismatch",
       "split_in_shard_map", "stage_without_params", "no_pp_axis", "params_over_pp")


def _bad_all(kinds=BAD) -> dict:
    out = {}
    for kind in kinds:
        try:
            step, args = _bad_step(kind)
            step(*args)
            out[kind] = "no error"
        except Exception as e:  # noqa: BLE001
            out[kind] = f"{type(e).__name__}: {e}"
    if kinds != BAD:
        return out
    # the pool still runs a good step after the errors (no rank left waiting)
    out["after"] = _guarded(_train, {"shape": (2,), "names": ("pp",), "m": 2, "steps": 1})
    return out


# -- the cases ------------------------------------------------------------------------------

PP = {"shape": (2,), "names": ("pp",)}
CASES_2 = {
    **{f"1F1B_m{m}": {**PP, "m": m} for m in (1, 2, 4, 8)},
    "1F1B_m3_batch6": {**PP, "m": 3, "batch": 6},
    "GPipe_m4": {**PP, "m": 4, "schedule": "GPipe"},
    "Interleaved1F1B_v2_m4": {**PP, "m": 4, "schedule": "Interleaved1F1B", "virtual": 2,
                              "splits": (1, 2, 3)},
    "LoopedBFS_v2_m4": {**PP, "m": 4, "schedule": "LoopedBFS", "virtual": 2, "splits": (1, 2, 3)},
    # torchtitan issue 775: fewer micro-batches than stages
    "Interleaved1F1B_v2_m1": {**PP, "m": 1, "schedule": "Interleaved1F1B", "virtual": 2,
                              "splits": (1, 2, 3)},
    "LoopedBFS_v2_m1": {**PP, "m": 1, "schedule": "LoopedBFS", "virtual": 2, "splits": (1, 2, 3)},
    "1F1B_m4_clip": {**PP, "m": 4, "clip": True},
    # zero-bubble (Qi et al. 2023): each backward cut into its input and weight parts;
    # ZBV's V places stages 1 and 2 on rank 1 (no message between them)
    "InterleavedZeroBubble_m4": {**PP, "m": 4, "schedule": "InterleavedZeroBubble"},
    "InterleavedZeroBubble_v2_m4": {**PP, "m": 4, "schedule": "InterleavedZeroBubble",
                                    "virtual": 2, "splits": (1, 2, 3)},
    "ZBVZeroBubble_m4_clip": {**PP, "m": 4, "schedule": "ZBVZeroBubble", "virtual": 2,
                              "splits": (1, 2, 3), "clip": True},
    "ZBVZeroBubble_m1": {**PP, "m": 1, "schedule": "ZBVZeroBubble", "virtual": 2,
                         "splits": (1, 2, 3)},
    # candidate splits (pipe_split(h, auto=True)) before blocks 1, 2, 3: the lowering picks
    "auto_split_1F1B_m2": {**PP, "m": 2, "splits": (1, 2, 3), "auto": True},
    "auto_split_Interleaved1F1B_v2_m2": {**PP, "m": 2, "splits": (1, 2, 3), "auto": True,
                                         "schedule": "Interleaved1F1B", "virtual": 2},
    # random numbers: pp=2 against pp=1 (x dp=2, the batch replicated), the same seed
    "dropout_pp2": {**PP, "m": 4, "dropout": 0.1, "seed": 0},
    "dropout_pp1": {"shape": (1, 2), "names": ("pp", "dp"), "batch_spec": P(), "m": 4,
                    "splits": (), "dropout": 0.1, "seed": 0},
    # ... and pp=1 x dp=2 against pp=2 x dp=2 (CASES_4), the batch split over "dp"
    "dropout_pp1_dp2": {"shape": (1, 2), "names": ("pp", "dp"), "mode": "shard", "m": 2,
                        "splits": (), "dropout": 0.1, "seed": 0},
}
PPDP = {"shape": (2, 2), "names": ("pp", "dp")}
# every mode with 2 and 4 micro-batches, each under one of 1F1B and GPipe
CASES_4 = {f"{mode}_{sched}_m{m}": {**PPDP, "mode": mode, "m": m, "schedule": sched}
           for mode, scheds in (("replicate", ("1F1B", "GPipe")), ("shard", ("GPipe", "1F1B")),
                                ("expand", ("1F1B", "GPipe")))
           for m, sched in zip((2, 4), scheds)}
# the pp axis second: a stage's slice is a column of the mesh
CASES_4["dp_pp_axis_order_shard_1F1B_m2"] = {"shape": (2, 2), "names": ("dp", "pp"),
                                            "mode": "shard", "m": 2}
# clipping's global norm over tensor-parallel shards: a "tp" rank's program may differ
# from its peer's in its nodes, never in its stages (examples/gpt_train.py --clip found it)
CASES_4["tp_clip"] = {"shape": (2, 2), "names": ("pp", "tp"), "megatron": True, "mode": "expand",
                      "m": 2, "clip": True, "n_blocks": 2, "splits": (1,)}
CASES_4["dropout_pp2_dp2"] = {**PPDP, "mode": "shard", "m": 2, "dropout": 0.1, "seed": 0}
PPDPTP = {"shape": (2, 2, 2), "names": ("pp", "dp", "tp"), "megatron": True, "m": 2,
          "n_blocks": 2, "splits": (1,)}
CASES_8 = {
    "megatron_expand": {**PPDPTP, "mode": "expand"},
    "megatron_dp_shard": {**PPDPTP, "mode": "shard"},
}

_RESULTS: dict = {}


def _results(on_ranks, ws):
    if ws not in _RESULTS:
        if ws == "bad":
            _RESULTS[ws] = on_ranks(2, _bad_all, timeout=120.0)
        elif ws == "restaged":
            _RESULTS[ws] = on_ranks(4, _restaged, timeout=120.0)
        elif ws == "gather":
            _RESULTS[ws] = on_ranks(2, _gather_outputs, timeout=60.0)
        else:
            cases = {2: CASES_2, 4: CASES_4, 8: CASES_8}[ws]
            _RESULTS[ws] = on_ranks(ws, _train_all, cases, timeout=240.0)
    return _RESULTS[ws]


def _ok(results: list, name: str) -> list:
    rs = [r[name] for r in results]
    errors = [f"rank {k}: {r['error']}\n{r['traceback']}" for k, r in enumerate(rs) if "error" in r]
    assert not errors, "\n".join(errors)
    return rs


def _check_equal_one_device(results: list, name: str, case: dict) -> list:
    rs = _ok(results, name)
    ref_losses, ref_leaves = reference(case)
    for k, r in enumerate(rs):
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses),
                                   rtol=1e-5, atol=1e-5, msg=lambda m: f"rank {k} losses: {m}")
        for i, v in r["full"].items():
            torch.testing.assert_close(v, ref_leaves[i], rtol=1e-4, atol=1e-5,
                                       msg=lambda m: f"rank {k} param leaf {i}: {m}")
        assert r["trace_count"] == 1
    # every parameter comes back whole on some rank
    assert set().union(*(r["full"] for r in rs)) == set(range(len(ref_leaves)))
    return rs


def _leaf_stages(case: dict) -> list[int]:
    """The stage of each parameter leaf (optree order: blocks[i].b/.w, ..., head)."""
    splits = case.get("splits", (2,))
    stages = []
    for i in range(case.get("n_blocks", 4)):
        s = sum(1 for t in splits if t <= i)
        stages += [s, s]
    return stages + [len(splits)]


def _pp_coords(case: dict) -> list[int]:
    """Each rank's coordinate on the "pp" axis of the case's mesh (row-major ranks)."""
    grid = torch.arange(int(torch.tensor(case["shape"]).prod())).reshape(case["shape"])
    d = case["names"].index("pp")
    return [int((grid == r).nonzero()[0][d]) for r in range(grid.numel())]


# -- the tests: pp=2 on 2 ranks ---------------------------------------------------------------

@pytest.mark.parametrize("name", [n for n in CASES_2 if not n.startswith("dropout")])
def test_pp2_equals_one_device(on_ranks, name):
    """The issue's must-hold list (pp=2: micro-batch counts 1, 2, 4, 8 with 1F1B; GPipe;
    Interleaved1F1B and LoopedBFS with 2 virtual stages; clip_by_global_norm in the step;
    torch's zero-bubble schedules InterleavedZeroBubble and ZBVZeroBubble),
    as torch's test_schedule.py ScheduleTest checks each schedule against one device;
    ``*_v2_m1``: one micro-batch for 4 stages (torchtitan issue 775 hung there). Losses
    (and the clipped norm) over 2 steps and the final parameters equal one device's;
    ``auto_split_*``: candidate boundaries (``pipe_split(h, auto=True)``) the lowering
    chooses among."""
    _check_equal_one_device(_results(on_ranks, 2), name, CASES_2[name])


@pytest.mark.parametrize("name", ["1F1B_m4", "Interleaved1F1B_v2_m4", "1F1B_m4_clip",
                                  "ZBVZeroBubble_m4_clip"])
def test_pp2_state_lives_on_its_stage(on_ranks, name):
    """The issue's must-hold list: each rank holds only its stages' parameters and AdamW
    moments (the other stages' leaves are empty locally), so the ranks' local elements add
    up to the model once; the step count and the loss are scalars on the whole mesh."""
    rs = _ok(_results(on_ranks, 2), name)
    case = CASES_2[name]
    stages = _leaf_stages(case)
    total = [t.numel() for t in optree.tree_leaves(init())]
    # (looped placement, stage s on rank s % 2; ZBV's V: stages 0..3 on ranks 0, 1, 1, 0)
    rank_of = stage_ranks(case.get("schedule", "1F1B"), 2, case.get("virtual", 1))
    for key in ("p_local", "m_local", "v_local"):
        for rank, r in enumerate(rs):
            for i, (n, s) in enumerate(zip(r[key], stages)):
                assert (n > 0) == (rank_of[s] == rank), (key, rank, i, s, r[key])
        assert [sum(r[key][i] for r in rs) for i in range(len(total))] == total, key
    assert all(r["step_local"] == 1 for r in rs)
    assert all(r["loss_mesh"] == (0, 1) for r in rs)


def test_dropout_pp2_equals_pp1_bitwise(on_ranks):
    """The issue's must-hold list (random numbers): a dropout inside every block gives,
    with the same seed (sharded.random.manual_seed(0) on every rank, docs/random.md), the
    same losses and parameters at pp=2 as at pp=1 (a ("pp", "dp") mesh of shape (1, 2),
    the batch replicated), bit for bit."""
    res = _results(on_ranks, 2)
    pp2, pp1 = _ok(res, "dropout_pp2"), _ok(res, "dropout_pp1")
    _assert_bitwise(pp2, pp1)
    # the dropout did something: the loss differs from the run without it
    no_dropout, _ = reference({"m": 4})
    assert pp1[0]["losses"][0][0] != no_dropout[0][0]


def test_dropout_pp2_dp2_equals_pp1_dp2_bitwise(on_ranks):
    """The issue's must-hold list (random numbers), with data parallelism: pp=2 x dp=2
    (4 ranks) gives the losses and parameters of pp=1 x dp=2 (2 ranks), bit for bit, the
    batch split over "dp" in both, DataParallelMode("shard"). (The micro-batches are each
    dp rank's own rows, so the dp size itself changes which rows meet which dropout mask;
    the pp size does not.)"""
    _assert_bitwise(_ok(_results(on_ranks, 4), "dropout_pp2_dp2"),
                    _ok(_results(on_ranks, 2), "dropout_pp1_dp2"))


def _assert_bitwise(pp2: list, pp1: list) -> None:
    """Every rank of the pp=2 run: the losses and the parameters it holds equal the pp=1
    run's (whose ranks together hold every parameter), bit for bit."""
    full1 = {}
    for r in pp1:
        full1.update(r["full"])
    assert set(full1) == set(range(len(optree.tree_leaves(init()))))
    for k, r in enumerate(pp2):
        for a, b in zip(r["raw"], pp1[0]["raw"]):
            assert torch.equal(a, b), (k, a, b)
        for i, v in r["full"].items():
            assert torch.equal(v, full1[i]), (k, i)


def test_gather_pipeline_outputs_on_every_rank(on_ranks):
    """docs/pipeline.md ("What comes back": a stage's state must be gathered before
    another pjit function takes it) and sharded.gather's contract (every DTensor as a
    full plain tensor on every rank): gather of a pipelined step's parameters gives every
    rank the whole model, equal to one device's after the same step."""
    res = _results(on_ranks, "gather")
    _, ref_leaves = reference({"m": 2, "steps": 1})
    for k, r in enumerate(res):
        assert "error" not in r, f"rank {k}: {r.get('error')}"
        for a, b in zip(r["leaves"], ref_leaves, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


# -- pp=2 x dp=2 on 4 ranks ----------------------------------------------------------------------

@pytest.mark.parametrize("name", [n for n in CASES_4 if not n.startswith(("dropout", "tp_"))])
def test_pp2_dp2_equals_one_device(on_ranks, name):
    """The issue's must-hold list: pp=2 x dp=2 with DataParallelMode("replicate"),
    DataParallelMode("shard") and DTensorExpandMode, the batch P("dp"), 2 and 4
    micro-batches, 1F1B and GPipe: losses and final parameters equal one device's; a
    stage's state is on its two ranks only (split over "dp" under "shard"); also with the
    mesh's axes as ("dp", "pp"), a stage's slice then a column of the mesh."""
    rs = _check_equal_one_device(_results(on_ranks, 4), name, CASES_4[name])
    case = CASES_4[name]
    stages = _leaf_stages(case)
    total = [t.numel() for t in optree.tree_leaves(init())]
    copies = 1 if case["mode"] == "shard" else 2
    pp_coord = _pp_coords(case)
    for key in ("p_local", "m_local", "v_local"):
        for rank, r in enumerate(rs):
            for i, (n, s) in enumerate(zip(r[key], stages)):
                assert (n > 0) == (s == pp_coord[rank]), (key, rank, i, r[key])
        assert [sum(r[key][i] for r in rs) for i in range(len(total))] == [copies * t for t in total]


def test_pp2_tp2_clipped_equals_one_device(on_ranks):
    """clip_by_global_norm over a Megatron MLP's tensor-parallel shards on a pp=2 x tp=2
    mesh (examples/gpt_train.py --pp 2 --tp 2 --clip failed with a RankMismatchError):
    losses, the clipped norm and the parameters equal one device's."""
    _check_equal_one_device(_results(on_ranks, 4), "tp_clip", CASES_4["tp_clip"])


# -- pp=2 x dp=2 x tp=2 on 8 ranks -------------------------------------------------------------

@pytest.mark.parametrize("name", list(CASES_8))
def test_pp2_dp2_tp2_megatron_equals_one_device(on_ranks, name):
    """The issue's must-hold list: a Megatron MLP per block (w1 column-parallel
    P(None, "tp"), w2 row-parallel P("tp", None), the params' in_specs naming "tp") on a
    ("pp", "dp", "tp") mesh of 2 x 2 x 2, under DTensorExpandMode and DataParallelMode
    ("shard" over "dp" composed with the "tp" specs, as
    tests/test_data_parallel.py's TP_SPECS and tests/test_hsdp.py's 2x2x2 run): losses
    and parameters equal one device's; a stage's state is on its 4 ranks only."""
    rs = _check_equal_one_device(_results(on_ranks, 8), name, CASES_8[name])
    stages = _leaf_stages(CASES_8[name])
    pp_coord = _pp_coords(CASES_8[name])
    for rank, r in enumerate(rs):
        for i, (n, s) in enumerate(zip(r["p_local"], stages)):
            assert (n > 0) == (s == pp_coord[rank]), (rank, i, r["p_local"])


# -- bad inputs: clear errors on every rank, no hang ---------------------------------------------

BAD_EXPECT = {
    "indivisible_batch": ("ValueError", "does not split into 4 micro-batches"),
    "more_stages_than_blocks": ("PipelineError", "more stages than blocks"),
    "stage_count_mismatch": ("PipelineError", "3 stages"),
    "split_in_shard_map": ("ValueError", "pipe_split was called inside a shard_map body"),
    "stage_without_params": ("PipelineError", "read no parameters"),
    "no_pp_axis": ("PipelineError", "has no axis 'pp'"),
    "params_over_pp": ("PipelineError", "over the pipeline axis 'pp'"),
}
@pytest.mark.parametrize("kind", BAD)
def test_bad_pipeline_is_clear_error_on_every_rank(on_ranks, kind):
    """The issue's must-hold list (bad input is a clear error on every rank, not a hang):
    a batch of 6 in 4 micro-batches; more stages (2 ranks x 2 virtual) than blocks (2,
    with a candidate split before each); forced splits giving 3 stages on 2; a pipe_split
    inside a shard_map body; a stage with no parameters (two pipe_splits in a row); a mesh
    without the "pp" axis; in_specs that lay a parameter out over "pp". After them the
    same ranks still run a good pipelined step."""
    res = _results(on_ranks, "bad")
    typ, phrase = BAD_EXPECT[kind]
    msgs = [r[kind] for r in res]
    for k, msg in enumerate(msgs):
        assert msg.startswith(typ + ":") and phrase in msg, (k, msg)
    _ok(res, "after")


def test_state_moves_to_its_new_stage_when_the_splits_move(on_ranks):
    """docs/pipeline.md ("Feeding state back"): one step's stage state (split before
    block 2) fed to a step split before block 1, then back, on pp=2 x dp=2 under
    DataParallelMode("shard"): block 1's parameters and moments move from stage 0's
    ranks to stage 1's (each dp shard to its counterpart) and back; the three steps'
    losses and the final parameters equal one device's."""
    res = _results(on_ranks, "restaged")
    ref_losses, ref_leaves = reference({"m": 2, "steps": 3})
    for k, r in enumerate(res):
        assert "error" not in r, f"rank {k}: {r.get('error')}"
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor([l for l, _ in ref_losses]))
        for a, b in zip(r["leaves"], ref_leaves, strict=True):
            torch.testing.assert_close(a, b)
