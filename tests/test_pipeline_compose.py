"""Pipeline parallelism composed with the rest of the library (docs/pipeline.md):
real model code (a Hugging Face Llama split by module, by hand and evenly by cost),
sharded.checkpoint across pipeline sizes (save at pp=2, load at pp=1 and back), the
per-call agreement (a rank that diverges fails, never hangs), and the schedule that
``.lower()`` shows on an abstract pp=8 x dp=8 x tp=8 mesh."""

from __future__ import annotations

import optree
import pytest
import torch
import torch.nn.functional as F

from sharded import (Mesh, P, RankMismatchError, checkpoint, gather, optim, pipe_split, pipeline,
                     pjit, shard)
from sharded.modes import DTensorExpandMode
from sharded.pipelining import PipelineError
from tests.ranks import run


# -- a Hugging Face model, split by module ------------------------------------------

def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    return LlamaForCausalLM(cfg)


def _llama_step(model, split: str):
    def loss_fn(params, ids):
        return torch.func.functional_call(model, params, (ids,), {"labels": ids}).loss

    kw = {"blocks": model.model.layers} if split == "blocks" else \
        {"split_before": [model.model.layers[2]]}
    pl = pipeline(loss_fn, microbatches=2, **kw)

    def step(p, opt, ids):
        g, loss = torch.func.grad_and_value(pl)(p, ids)
        p, opt = optim.adamw(p, g, opt, lr=1e-2)
        return p, opt, loss
    return step


def _ids():
    return torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))


def _llama_on_ranks():
    out = {}
    for split in ("split_before", "blocks"):
        model = _llama()
        p = {k: v.detach() for k, v in model.named_parameters()}
        opt = optim.adamw_init(p)
        step = pjit(_llama_step(model, split), in_specs=(P(), P(), P()), mesh=Mesh((2,), ("pp",)))
        losses = []
        for _ in range(2):
            p, opt, loss = step(p, opt, _ids())
            losses.append(float(loss.full_tensor()))
        out[split] = (losses, {k: v.full_tensor() for k, v in p.items() if v.to_local().numel()})
    return out


def test_hugging_face_llama_split_by_module_matches_one_device():
    """A transformers LlamaForCausalLM (tiny random config) called through
    functional_call, its layers split by ``split_before=`` (hooks while traced) and by
    ``blocks=`` (the lowering picks the boundary that evens out parameters), at pp=2
    against the same step on one device."""
    model = _llama()
    p = {k: v.detach() for k, v in model.named_parameters()}
    opt = optim.adamw_init(p)
    step = _llama_step(model, "split_before")
    ref_losses = []
    for _ in range(2):
        p, opt, loss = step(p, opt, _ids())
        ref_losses.append(float(loss))
    results = run(2, _llama_on_ranks)
    for split in ("split_before", "blocks"):
        held = [set(r[split][1]) for r in results]
        assert held[0] and held[1] and not held[0] & held[1], split   # each stage's own
        assert held[0] | held[1] == set(p), split
        if split == "blocks":      # 4 layers over 2 stages: 2 each (by parameter count)
            assert sum("layers" in k for k in held[0]) == sum("layers" in k for k in held[1])
        for losses, params in (r[split] for r in results):
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))
            for k, v in params.items():
                # (Adam divides by a tiny second moment: a few ulps of the gradient
                # show in the fifth digit of a parameter)
                torch.testing.assert_close(v, p[k], atol=1e-4, rtol=1e-3)


# -- checkpoints across pipeline sizes --------------------------------------------------

def _mlp(n=4, d=8):
    g = torch.Generator().manual_seed(0)
    return {"blocks": [{"w": torch.randn(d, d, generator=g) * 0.3, "b": torch.zeros(d)} for _ in range(n)],
            "head": torch.randn(d, 3, generator=g)}


def _mlp_loss(p, x, y):
    h = x
    for i, blk in enumerate(p["blocks"]):
        if i == 2:
            h = pipe_split(h)
        h = torch.tanh(h @ blk["w"] + blk["b"])
    return F.cross_entropy(h @ p["head"], y)


def _mlp_step(m=2):
    pl = pipeline(_mlp_loss, microbatches=m)

    def step(p, opt, x, y):
        g, loss = torch.func.grad_and_value(pl)(p, x, y)
        p, opt = optim.adamw(p, g, opt, lr=1e-2)
        return p, opt, loss
    return step


def _batch():
    return torch.randn(8, 8, generator=torch.Generator().manual_seed(1)), torch.arange(8) % 3


def _checkpoint_on_ranks(path):
    x, y = _batch()
    p, opt = _mlp(), optim.adamw_init(_mlp())
    step = pjit(_mlp_step(), in_specs=(P(), P(), P(), P()), mesh=Mesh((2,), ("pp",)))
    p, opt, _ = step(p, opt, x, y)
    checkpoint.save(path, {"p": p, "opt": opt})
    # pp = 1: the whole model in this process, as plain tensors
    flat = checkpoint.load(path, {"p": _mlp(), "opt": optim.adamw_init(_mlp())})
    # pp = 1 on a mesh: one pipeline stage, data parallel over both ranks
    step1 = pjit(_mlp_step(), in_specs=(P(), P(), P("dp"), P("dp")), mesh=Mesh((1, 2), ("pp", "dp")))
    p1, opt1, loss1 = step1(flat["p"], flat["opt"], x, y)
    checkpoint.save(path + "_pp1", {"p": p1, "opt": opt1})
    # back at pp = 2, into the stages' slices
    back = checkpoint.load(path + "_pp1", {"p": p, "opt": opt})
    p2, opt2, loss2 = step(back["p"], back["opt"], x, y)
    return (optree.tree_leaves(flat["p"]), float(loss1.full_tensor()), float(loss2.full_tensor()),
            [t.full_tensor() for t in optree.tree_leaves(p2) if t.to_local().numel()],
            [t.to_local().numel() for t in optree.tree_leaves(back["p"])])


def test_checkpoint_saved_at_pp2_loads_at_pp1_and_back(tmp_path):
    """sharded.checkpoint (DCP) of stage-slice DTensors: saved by a pp=2 step, loaded
    as whole tensors (pp=1 in one process) and onto a pp=1 x dp=2 mesh, trained a
    step there, saved, and loaded back into the pp=2 slices: every value equals one
    device's run of the same three steps."""
    x, y = _batch()
    p, opt = _mlp(), optim.adamw_init(_mlp())
    step = _mlp_step()
    ref = []
    for _ in range(3):
        p, opt, loss = step(p, opt, x, y)
        ref.append((optree.tree_leaves(p), float(loss)))
    results = run(2, _checkpoint_on_ranks, str(tmp_path / "ck"))
    for flat, loss1, loss2, held, numels in results:
        for a, b in zip(flat, ref[0][0]):
            torch.testing.assert_close(a, b)
        assert loss1 == pytest.approx(ref[1][1], rel=1e-6)
        assert loss2 == pytest.approx(ref[2][1], rel=1e-6)
        assert 0 in numels and any(numels)         # back on its stage's ranks only
    gathered = results[0][3] + results[1][3]
    assert len(gathered) == len(ref[2][0])
    for got, want in zip(gathered, ref[2][0]):
        torch.testing.assert_close(got, want)


# -- the per-call agreement ------------------------------------------------------------

def _diverging_rank():
    import torch.distributed as dist

    x, y = _batch()
    m = 2 if dist.get_rank() == 0 else 4          # rank 1 builds a different program
    step = pjit(_mlp_step(m), in_specs=(P(), P(), P(), P()), mesh=Mesh((2,), ("pp",)))
    try:
        step(_mlp(), optim.adamw_init(_mlp()), x, y)
    except RankMismatchError as e:
        return str(e)
    return None


def test_a_rank_with_another_pipeline_fails_on_every_rank():
    """Rank 1 pipelines with 4 micro-batches, rank 0 with 2: both raise
    RankMismatchError at the call's agreement, before any stage sends anything."""
    msgs = run(2, _diverging_rank, timeout=120)
    assert all(m is not None and "different" in m for m in msgs), msgs


# -- the schedule on an abstract mesh ---------------------------------------------------

def test_abstract_pp8_dp8_tp8_step_shows_its_schedule():
    """A Megatron MLP stack at pp=8 x dp=8 x tp=8 lowers in this process: 8 stages of
    2 blocks, each stage's state and activations, the bubble (simulated from the
    stages' FLOPs; theory (p-1)/(m+p-1) for 1F1B), and every rank's receives,
    compute slots and sends."""
    L, D, m = 16, 64, 16
    params = {"blocks": [{"w1": torch.empty(D, 4 * D, device="meta"), "w2": torch.empty(4 * D, D, device="meta")}
                         for _ in range(L)], "head": torch.empty(D, 32, device="meta")}
    specs = {"blocks": [{"w1": P(None, "tp"), "w2": P("tp", None)} for _ in range(L)], "head": P()}

    def loss_fn(p, x, y):
        h = x
        for i, b in enumerate(p["blocks"]):
            if i and i % 2 == 0:
                h = pipe_split(h)
            h = h + F.gelu(h @ b["w1"]) @ b["w2"]
        return F.cross_entropy(h @ p["head"], y)

    pl = pipeline(loss_fn, microbatches=m, schedule="1F1B")

    def step(p, opt, x, y):
        g, loss = torch.func.grad_and_value(pl)(p, x, y)
        p, opt = optim.adamw(p, g, opt, lr=1e-3)
        return p, opt, loss

    mesh = Mesh.abstract((8, 8, 8), ("pp", "dp", "tp"), rank=0)
    opt = optim.adamw_init(params)
    x = torch.empty(256, D, device="meta")
    y = torch.empty(256, dtype=torch.long, device="meta")
    low = pjit(step, in_specs=(specs, {"step": P(), "m": specs, "v": specs}, P("dp"), P("dp")),
               mesh=mesh, mode=DTensorExpandMode()).lower(params, opt, x, y)
    rep = low.pipeline
    assert rep["n_stages"] == 8 and rep["microbatches"] == m
    assert rep["bubble_theory"] == pytest.approx(7 / (m + 7))
    assert abs(rep["bubble_simulated"] - rep["bubble_theory"]) < 0.1 * rep["bubble_theory"]
    block_state = 3 * 2 * 2 * (D * 4 * D // 8) * 4    # (param + 2 moments) x 2 blocks x 2 matrices
    assert [s["state_bytes"] for s in rep["stages"][:7]] == [block_state] * 7
    assert rep["stages"][7]["state_bytes"] > block_state            # (the head)
    assert all(s["activation_bytes_per_microbatch"] > 0 for s in rep["stages"])
    assert [r["peak_in_flight"] for r in rep["ranks"]] == [8, 7, 6, 5, 4, 3, 2, 1]
    text = low.as_text()
    assert "rank 0: F0.0 send F0.0->r1" in text and "rank 7: recv F7.0<-r6 F7.0 B7.0 send B7.0->r6" in text
    assert "# piece F0" in text and "# piece B0" in text


def test_pipeline_errors_name_the_fix():
    """Bad pipelines fail while lowering (every rank lowers the same program), with
    what to change: tied parameters across stages, a stage with no parameters, a
    stage count that differs from the mesh's, and in_specs over the pipeline axis."""
    mesh = Mesh.abstract((2,), ("pp",))
    x, y = _batch()

    def lower(loss_fn, specs=P(), params=None, virtual=1):
        pl = pipeline(loss_fn, microbatches=2, virtual_stages=virtual,
                      schedule="Interleaved1F1B" if virtual > 1 else "1F1B")

        def step(p, x, y):
            return torch.func.grad_and_value(pl)(p, x, y)
        return pjit(step, in_specs=(specs, P(), P()), mesh=mesh).lower(params or _mlp(), x, y)

    def tied(p, x, y):
        h = torch.tanh(x @ p["blocks"][0]["w"])
        h = pipe_split(h)
        return F.cross_entropy(torch.tanh(h @ p["blocks"][0]["w"]) @ p["head"], y)

    with pytest.raises(PipelineError, match=r"read by stages \[0, 1\].*tied"):
        lower(tied)

    def empty_stage(p, x, y):
        h = pipe_split(x)
        for blk in p["blocks"]:
            h = torch.tanh(h @ blk["w"] + blk["b"])
        return F.cross_entropy(h @ p["head"], y)

    with pytest.raises(PipelineError, match=r"stage\(s\) \[0\] of 2 read no parameters"):
        lower(empty_stage)
    with pytest.raises(PipelineError, match=r"2 stages \(1 pipe_split.*4 stages"):
        lower(_mlp_loss, virtual=2)
    with pytest.raises(ValueError, match=r"'1F1B' runs one stage per rank"):
        pipeline(_mlp_loss, microbatches=2, virtual_stages=2)
    with pytest.raises(PipelineError, match=r"over the pipeline axis 'pp'"):
        lower(_mlp_loss, specs={"blocks": [{"w": P("pp"), "b": P()}] * 4, "head": P()})


# -- torch's tensor-parallel styles on the other axis ---------------------------------------

def _plan_step(model, m):
    def loss_fn(p, ids, targets):
        return torch.func.functional_call(model, p, (ids, targets))

    pl = pipeline(loss_fn, microbatches=m, blocks=model.blocks)

    def step(p, opt, ids, targets):
        g, loss = torch.func.grad_and_value(pl)(p, ids, targets)
        p, opt = optim.sgd(p, g, opt, lr=0.1, momentum=0.9)
        return p, opt, loss
    return step


def _plans_on_ranks():
    from examples import gpt_module as gm
    from sharded.plans import parallelize

    cfg = gm.Config(vocab=64, d_model=32, n_heads=4, n_layers=4, seq=16)
    ids, targets = gm.pattern_batch(cfg, 4)
    mesh = Mesh((2, 2), ("pp", "tp"))
    out = {}
    for name in ("megatron", "sp"):
        torch.manual_seed(0)
        model = gm.GPT(cfg)
        specs = parallelize(model, gm.PLANS[name](), mesh, axis="tp")
        params = {k: v.detach() for k, v in model.named_parameters()}
        opt = optim.sgd_init(params)
        step = pjit(_plan_step(model, 2), in_specs=(specs, specs, P(), P()), mesh=mesh)
        losses = []
        for _ in range(2):
            params, opt, loss = step(params, opt, ids, targets)
            losses.append(float(loss.full_tensor()))
        out[name] = (losses, {k: v.full_tensor() for k, v in params.items() if v.to_local().numel()})
    return out


def test_tensor_parallel_plans_compose_with_the_pipeline():
    """examples/gpt_module.GPT laid out by torch's ParallelStyle plans (Megatron, and
    sequence parallel) on "tp", its 4 blocks split evenly over "pp" (blocks=), on a
    2x2 pp x tp mesh: losses and parameters equal the module's step on one device."""
    from examples import gpt_module as gm

    cfg = gm.Config(vocab=64, d_model=32, n_heads=4, n_layers=4, seq=16)
    ids, targets = gm.pattern_batch(cfg, 4)
    torch.manual_seed(0)
    model = gm.GPT(cfg)
    params = {k: v.detach() for k, v in model.named_parameters()}
    opt = optim.sgd_init(params)
    step = _plan_step(model, 2)
    ref = []
    for _ in range(2):
        params, opt, loss = step(params, opt, ids, targets)
        ref.append(float(loss))
    for out in run(4, _plans_on_ranks):
        for name in ("megatron", "sp"):
            losses, held = out[name]
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=1e-5, atol=1e-5)
            assert held and len(held) < len(params)
            for k, v in held.items():
                torch.testing.assert_close(v, params[k], rtol=1e-4, atol=1e-5)


# -- found by review: each was a silent wrong result or a failure ----------------------------

def _one_rank_step(loss_fn, m, donate=()):
    pl = pipeline(loss_fn, microbatches=m)

    def step(p, opt, x, y):
        g, loss = torch.func.grad_and_value(pl)(p, x, y)
        p, opt = optim.adamw(p, g, opt, lr=1e-2)
        return p, opt, loss
    return pjit(step, in_specs=(P(), P(), P(), P()), mesh=Mesh((1,), ("pp",)), donate_argnums=donate)


def _dropout_loss(p, x, y):
    h = x
    for i, blk in enumerate(p["blocks"]):
        if i == 2:
            h = pipe_split(h)
        h = F.dropout(torch.tanh(h @ blk["w"] + blk["b"]), 0.5, training=True)
    return F.cross_entropy(h @ p["head"], y)


def test_each_micro_batch_draws_its_own_random_numbers():
    """A dropout's mask depends only on the seed and the offset, not on the batch: it
    must still be drawn per micro-batch (micro-batch j at offset + j x draws). With the
    halves a, b of a batch as the 2 micro-batches, [a; b] and [b; a] give different mean
    losses: each half meets the other micro-batch's mask (one mask shared by both
    micro-batches gave equal losses)."""
    from sharded import random as srandom

    x, y = _batch()
    swapped_x, swapped_y = torch.cat([x[4:], x[:4]]), torch.cat([y[4:], y[:4]])
    step = _one_rank_step(_dropout_loss, 2)
    losses = []
    for bx, by in ((x, y), (swapped_x, swapped_y), (x, y)):
        srandom.manual_seed(0)
        losses.append(gather(step(_mlp(), optim.adamw_init(_mlp()), bx, by)[2]))
    assert not torch.equal(losses[0], losses[1])
    assert torch.equal(losses[0], losses[2])             # (the same seed: the same draws)


def test_donated_parameter_read_before_the_optimizer_is_not_overwritten():
    """A parameter read before the micro-batches (here scaled: ``w * 0.5``, as a
    multiplier or a LoRA merge would) and donated: only the optimizer, the last piece
    that reads it, may write its storage. Parameters equal the step without donation."""
    def scaled(p, x, y):
        h = torch.tanh(x @ (p["blocks"][0]["w"] * 0.5))
        h = pipe_split(h)
        return F.cross_entropy(torch.tanh(h @ p["blocks"][1]["w"]) @ p["head"], y)

    x, y = _batch()
    want, _, _ = _one_rank_step(scaled, 2)(_mlp(), optim.adamw_init(_mlp()), x, y)
    p = shard(_mlp(), P(), Mesh((1,), ("pp",)))
    got, _, _ = _one_rank_step(scaled, 2, donate=(0, 1))(p, optim.adamw_init(_mlp()), x, y)
    torch.testing.assert_close(gather(got), gather(want), rtol=0, atol=0)


def test_a_gradient_no_micro_batch_feeds_is_accumulated():
    """A parameter in a data-free term of the loss (an L2 penalty): its gradient does not
    depend on the micro-batch, and it is summed over the micro-batches like the others
    (it was in no piece: the step failed). Equal to one device."""
    def penalised(p, x, y):        # ("extra": read by the penalty only)
        return _mlp_loss(p, x, y) + 0.01 * (p["extra"] ** 2).sum()

    x, y = _batch()
    p = {**_mlp(), "extra": torch.ones(3)}
    opt = optim.adamw_init(p)
    got, _, loss = _one_rank_step(penalised, 4)(p, opt, x, y)
    pl = pipeline(penalised, microbatches=4)
    g, ref_loss = torch.func.grad_and_value(pl)(p, x, y)
    want, _ = optim.adamw(p, g, opt, lr=1e-2)
    torch.testing.assert_close(gather(loss), ref_loss)
    torch.testing.assert_close(gather(got), want)


def test_the_digest_tells_programs_apart():
    """The cross-rank agreement compares a digest of the pipelined program: two modes
    (different collectives), or the same step with other in_specs, give different
    digests, so ranks that built different programs fail instead of hanging."""
    from sharded.modes import DataParallelMode

    mesh = Mesh.abstract((2, 2), ("pp", "dp"))
    x, y = _batch()
    pl = pipeline(_mlp_loss, microbatches=2)

    def step(p, x, y):
        return torch.func.grad_and_value(pl)(p, x, y)

    def digest(mode, batch=P("dp")):
        lo = pjit(step, in_specs=(P(), batch, batch), mesh=mesh, mode=mode).lower(_mlp(), x, y)
        return lo._c.program

    rep, sh = digest(DataParallelMode("replicate", axis="dp")), digest(DataParallelMode("shard", axis="dp"))
    assert rep != sh
    assert digest(DTensorExpandMode()) != digest(DTensorExpandMode(), P())


def test_a_value_drawn_outside_the_pipeline_is_drawn_once():
    """A mask drawn in the step outside pipeline(...) and passed in is one value for
    every micro-batch (only draws inside the pipelined function are per micro-batch):
    swapping the halves of the batch leaves the mean loss alone."""
    from sharded import random as srandom

    def masked(p, x, y):
        return _mlp_loss({**p, "blocks": [{**p["blocks"][0], "w": p["blocks"][0]["w"] * p["mask"]},
                                          *p["blocks"][1:]]}, x, y)

    pl = pipeline(masked, microbatches=2)

    def step(p, x, y):
        mask = (torch.rand(8, 8) > 0.5).float()
        return torch.func.grad_and_value(pl)({**p, "mask": mask}, x, y)[1]

    run = pjit(step, in_specs=(P(), P(), P()), mesh=Mesh((1,), ("pp",)))
    x, y = _batch()
    losses = []
    for bx, by in ((x, y), (torch.cat([x[4:], x[:4]]), torch.cat([y[4:], y[:4]]))):
        srandom.manual_seed(0)
        losses.append(gather(run(_mlp(), bx, by)))
    torch.testing.assert_close(losses[0], losses[1])


def test_a_returned_view_of_a_donated_parameter_keeps_its_value():
    """The step returns a view of a parameter it updates (``w.t()``) with the parameters
    donated: the optimizer may not update that storage in place (the view would show
    the new values), as without pipelining."""
    def step_of(p, opt, x, y):
        g, loss = torch.func.grad_and_value(pipeline(_mlp_loss, microbatches=2))(p, x, y)
        view = p["head"].t()
        p, opt = optim.adamw(p, g, opt, lr=1e-1)
        return p, opt, loss, view

    mesh = Mesh((1,), ("pp",))
    x, y = _batch()
    run = pjit(step_of, in_specs=(P(), P(), P(), P()), mesh=mesh, donate_argnums=(0, 1))
    out = run(shard(_mlp(), P(), mesh), optim.adamw_init(_mlp()), x, y)
    torch.testing.assert_close(gather(out[3]), _mlp()["head"].t(), rtol=0, atol=0)


def test_random_weights_and_random_penalties_on_every_stage():
    """Weight dropout in each of 4 stages (one rank, 4 virtual stages) and a penalty
    scaled by a draw: every stage holds parameters read only through their dropout,
    and a gradient that only a draw feeds is placed on its parameter's stage. The four
    schedules that run 4 stages on one rank agree bit for bit."""
    from sharded import random as srandom

    def noisy(p, x, y):
        h = x
        for i, blk in enumerate(p["blocks"]):
            if i:
                h = pipe_split(h)
            h = torch.tanh(h @ F.dropout(blk["w"], 0.3, training=True) + blk["b"])
        return F.cross_entropy(h @ p["head"], y) + (p["extra"] * torch.rand(3)).sum()

    x, y = _batch()
    results = []
    for schedule in ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble"):
        pl = pipeline(noisy, microbatches=2, schedule=schedule, virtual_stages=4)

        def step(p, x, y, pl=pl):
            return torch.func.grad_and_value(pl)(p, x, y)

        srandom.manual_seed(0)
        g, loss = pjit(step, in_specs=(P(), P(), P()), mesh=Mesh((1,), ("pp",)))(
            {**_mlp(), "extra": torch.ones(3)}, x, y)
        results.append(optree.tree_leaves(gather((g, loss))))
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            assert torch.equal(a, b)


def test_gradients_are_reduced_once_per_step_whatever_the_micro_batches():
    """docs/pipeline.md ("Gradient accumulation"): a gradient's pending reduction passes
    through the marks, so under DataParallelMode("shard") a micro-batch's pieces reduce
    nothing and the tail reduce-scatters once per step: the step's reductions are the
    same for 2 and 4 micro-batches (and its parameters' all-gathers run once, before)."""
    from sharded.modes import DataParallelMode
    from sharded.passes import collectives

    mesh = Mesh.abstract((2, 2), ("pp", "dp"))
    x, y = _batch()
    counts = {}
    for m in (2, 4):
        pl = pipeline(_mlp_loss, microbatches=m)

        def step(p, opt, x, y, pl=pl):
            g, loss = torch.func.grad_and_value(pl)(p, x, y)
            return (*optim.adamw(p, g, opt, lr=1e-2), loss)

        lo = pjit(step, in_specs=(P(), P(), P("dp"), P("dp")), mesh=mesh,
                  mode=DataParallelMode("shard", axis="dp")).lower(_mlp(), optim.adamw_init(_mlp()), x, y)
        cost = lo.cost()
        counts[m] = {k: v["count"] for k, v in cost.items() if k != "total"}
        in_micro_batches = [c for name, gm in lo._c.pieces() if name[0] in "FB"
                            for c in collectives(gm, mesh)]
        assert not in_micro_batches, in_micro_batches
    assert counts[2] == counts[4] and counts[2].get("reduce_scatter", 0) >= 1, counts
