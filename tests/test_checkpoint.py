"""sharded.checkpoint: resharding on load, resume equals the uninterrupted run, each
rank writes only its shards, atomic publish (failed and killed saves), async saves,
and errors that name the key path."""

from __future__ import annotations

import os
import pickle
import signal

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor, Partial

from examples import gpt_module as gm
from examples import gpt_train
from sharded import Mesh, P, checkpoint, gather, shard
from sharded import random as srandom
from sharded.checkpoint import CheckpointError
from sharded.spec import block

TC = gpt_train.TrainConfig(
    model=gm.Config(vocab=32, d_model=16, n_heads=2, n_layers=1, seq=8, dropout=0.1),
    batch_size=8, lr=1e-2, seed=0)


# -- resume a GPT with dropout: equal to the uninterrupted run ---------------------------

def _train_save_continue(ckpt: str, dp: int, tp: int):
    """3 steps, save (params, AdamW state, RNG state, step), 2 more steps."""
    trainer = gpt_train.Trainer(gpt_train.make_mesh(dp, tp), TC)
    for _ in range(3):
        trainer.train_step()
    trainer.save(ckpt)
    losses = [trainer.train_step() for _ in range(2)]
    return losses, gather(trainer.params), gather(trainer.opt)


def _resume(ckpts: list, dp: int, tp: int):
    """On a fresh program for this mesh, with the RNG moved on: for each checkpoint,
    load it and train the same 2 steps."""
    trainer = gpt_train.Trainer(gpt_train.make_mesh(dp, tp), TC)
    out = []
    for ckpt in ckpts:
        srandom.manual_seed(12345)        # whatever the state was, the checkpoint's wins
        trainer.restore(ckpt)
        step = trainer.step
        losses = [trainer.train_step() for _ in range(2)]
        out.append((step, losses, gather(trainer.params), gather(trainer.opt)))
    # The RNG state is part of what resumes: the same checkpoint without it (dropout
    # draws other numbers) gives another loss.
    trainer.restore(ckpts[0])
    srandom.manual_seed(12345)
    out.append(trainer.train_step())
    return out


@pytest.fixture(scope="module")
def gpt_runs(tmp_path_factory, on_ranks):
    d = tmp_path_factory.mktemp("gpt")
    a, b = str(d / "2x2"), str(d / "tp2")
    runs = {
        "2x2": on_ranks(4, _train_save_continue, a, 2, 2)[0],     # FSDP x TP, sp plan
        "tp2": on_ranks(2, _train_save_continue, b, 1, 2)[0],     # a 2-rank TP mesh
    }
    return {"dirs": {"2x2": a, "tp2": b}, "runs": runs}


def test_resume_on_the_same_mesh_is_bitwise(gpt_runs, on_ranks):
    dirs, runs = gpt_runs["dirs"], gpt_runs["runs"]
    (step, losses, params, opt), (step_b, losses_b, params_b, opt_b), other_rng = on_ranks(
        4, _resume, [dirs["2x2"], dirs["tp2"]], 2, 2)[0]
    ref_losses, ref_params, ref_opt = runs["2x2"]
    assert step == 3 and losses == ref_losses
    assert abs(other_rng - ref_losses[0]) > 1e-4
    for k in ref_params:
        assert torch.equal(params[k], ref_params[k]), k
        assert torch.equal(opt["m"][k], ref_opt["m"][k]) and torch.equal(opt["v"][k], ref_opt["v"][k]), k
    assert torch.equal(opt["step"], ref_opt["step"])
    # Saved from a 2-rank ("tp",) mesh, resumed on ("dp", "tp") 2x2: only the order of
    # the reductions differs (dropout draws the same numbers on any mesh).
    ref_losses, ref_params, ref_opt = runs["tp2"]
    assert step_b == 3
    torch.testing.assert_close(losses_b, ref_losses, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(params_b, ref_params, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(opt_b, ref_opt, rtol=1e-4, atol=1e-6)


def test_resume_on_a_1d_mesh_of_4(gpt_runs, on_ranks):
    dirs, runs = gpt_runs["dirs"], gpt_runs["runs"]
    (step, losses, params, opt), _ = on_ranks(4, _resume, [dirs["2x2"]], 4, 1)[0]
    ref_losses, ref_params, ref_opt = runs["2x2"]
    assert step == 3
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(params, ref_params, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(opt, ref_opt, rtol=1e-4, atol=1e-6)


def _plain_torch_run(tc, steps: int):
    """The Trainer's run in plain torch on one device: the same nn.Module GPT run
    eagerly, torch.optim.AdamW, the same global batches, and each dropout's mask drawn
    through the library's generator as documented (docs/random.md): draw d of step k's
    program is Philox(seed, offset + d, i) over the global elements, the offset k times
    the program's draws, the draws in the forward's order. Returns the losses, the
    parameters and AdamW's moments."""
    model = gm.GPT(tc.model, seed=tc.seed)
    p = tc.model.dropout
    per_step = 1 + 2 * tc.model.n_layers          # after the embeddings; 2 per block
    counter = {"offset": 0, "draw": 0}

    def dropout(x):           # torch's CPU dropout: x * (bernoulli(1 - p) / (1 - p))
        keep = srandom.bernoulli(tc.seed, counter["offset"] + counter["draw"],
                                 torch.arange(x.numel()), 1 - p).reshape(x.shape)
        counter["draw"] += 1
        return x * keep.to(x.dtype).div_(1 - p)

    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.forward = dropout
    opt = torch.optim.AdamW(model.parameters(), lr=tc.lr)
    chain = gpt_train.markov_chain(tc)
    losses = []
    for step in range(steps):
        rows = gpt_train.MarkovText(tc, 1, step, step + 1, chain)
        ids, targets = (torch.stack(t) for t in zip(*(rows[i] for i in range(tc.batch_size))))
        counter.update(offset=step * per_step, draw=0)
        loss = model(ids, targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
        assert counter["draw"] == per_step
        losses.append(loss.item())
    params = {k: v.detach() for k, v in model.named_parameters()}
    moments = {"m": {k: opt.state[v]["exp_avg"] for k, v in model.named_parameters()},
               "v": {k: opt.state[v]["exp_avg_sq"] for k, v in model.named_parameters()}}
    return losses, params, moments


def test_fsdp_sp_gpt_with_dropout_equals_plain_torch(gpt_runs):
    """The 2x2 run (FSDP x the sequence-parallel plan, dropout 0.1; steps 3 and 4 after
    its save) equals the nn.Module trained eagerly on one device with torch.optim.AdamW
    and the same dropout bits, not only pjit on one process (which shares the rewrite)."""
    ref_losses, ref_params, ref_moments = _plain_torch_run(TC, 5)
    losses, params, opt = gpt_runs["runs"]["2x2"]
    torch.testing.assert_close(losses, ref_losses[3:], rtol=1e-5, atol=1e-6)
    # The key projection's bias has no gradient (softmax ignores a constant added to
    # every score of a row): its gradient is rounding noise, which AdamW's update
    # divides by its own size; its moments (noise, tiny) are compared below.
    noise = [k for k in ref_params if k.endswith("attn.wk.bias")]
    assert noise and all(opt["m"][k].abs().max() < 1e-6 for k in noise)
    torch.testing.assert_close({k: v for k, v in params.items() if k not in noise},
                               {k: v for k, v in ref_params.items() if k not in noise},
                               rtol=1e-4, atol=1e-5)
    for k in ("m", "v"):
        torch.testing.assert_close(opt[k], ref_moments[k], rtol=1e-4, atol=1e-7)
    assert int(opt["step"]) == 5
    # the masks matter: without dropout the run is another one
    no_drop = gpt_train.TrainConfig(**{**TC.__dict__, "model": gm.Config(**{**TC.model.__dict__, "dropout": 0.0})})
    assert abs(_plain_torch_run(no_drop, 4)[0][3] - losses[0]) > 1e-3


# -- each rank writes only its own shards; resharding in every direction -----------------

_BIG = {"a": (64, 128), "b": (128, 64), "c": (64, 64), "d": (256,)}
_SPECS_2x2 = {"a": P("dp", "tp"), "b": P("tp"), "c": P(), "d": P(("dp", "tp"))}


def _values():
    g = torch.Generator().manual_seed(3)
    return {k: torch.randn(*s, generator=g) for k, s in _BIG.items()}


def _save_2x2_and_reshard(root: str):
    vals = _values()
    mesh = Mesh((2, 2), ("dp", "tp"))
    tree = {"w": shard(vals, _SPECS_2x2, mesh), "plain": torch.arange(10.0), "step": 7,
            "rng": {"seed": 5, "offset": 11}, "name": "run-1", "none": None}
    checkpoint.save(os.path.join(root, "from2x2"), tree)
    # What each rank holds: (key, global offsets) of its blocks.
    held = sorted({(f"w.{k}", tuple(block(x.shape, x.placements, mesh, mesh.coordinate())[1]))
                   for k, x in tree["w"].items()})
    # 2x2 -> 4 (new split dims), and sharded -> replicated.
    mesh4 = Mesh((4,), ("dp",))
    like = {"w": shard({k: torch.zeros(s) for k, s in _BIG.items()},
                       {"a": P(None, "dp"), "b": P(), "c": P("dp"), "d": P("dp")}, mesh4),
            "plain": torch.zeros(10), "step": 0, "rng": {"seed": None, "offset": 0},
            "name": "", "none": 1}
    out = checkpoint.load(os.path.join(root, "from2x2"), like)
    ok = {k: torch.equal(gather(v), vals[k]) and v.placements == like["w"][k].placements
          and v.device_mesh == mesh4.device_mesh for k, v in out["w"].items()}
    rest = {k: out[k] for k in ("plain", "step", "rng", "name", "none")}
    untouched = all(torch.equal(gather(v), torch.zeros(_BIG[k])) for k, v in like["w"].items())
    # 4 -> 2x2
    checkpoint.save(os.path.join(root, "from4"), {"w": out["w"]})
    back = checkpoint.load(os.path.join(root, "from4"), {"w": shard(
        {k: torch.zeros(s) for k, s in _BIG.items()}, _SPECS_2x2, mesh)})
    ok_back = {k: torch.equal(gather(v), vals[k]) and v.placements == tree["w"][k].placements
               for k, v in back["w"].items()}
    return held, ok, rest, untouched, ok_back


def test_each_rank_writes_only_its_shards_and_load_reshards(tmp_path, on_ranks):
    res = on_ranks(4, _save_2x2_and_reshard, str(tmp_path))
    held = {r: set(res[r][0]) for r in range(4)}
    for r in range(4):
        _, ok, rest, untouched, ok_back = res[r]
        assert all(ok.values()) and all(ok_back.values()), (ok, ok_back)
        assert untouched     # like is not modified
        torch.testing.assert_close(rest["plain"], torch.arange(10.0))
        assert rest["step"] == 7 and rest["rng"] == {"seed": 5, "offset": 11}
        assert rest["name"] == "run-1" and rest["none"] is None
    path = str(tmp_path / "from2x2")
    files = sorted(f for f in os.listdir(path) if f.endswith(".distcp"))
    assert files == [f"__{r}_0.distcp" for r in range(4)]
    # Every chunk sits in the file of a rank that holds it, and nothing is written twice.
    md = dcp.FileSystemReader(path).read_metadata()
    chunks = [(idx.fqn, tuple(idx.offset), info.relative_path)
              for idx, info in md.storage_data.items() if idx.fqn.startswith("w.")]
    assert len({c[:2] for c in chunks}) == len(chunks)
    for fqn, offset, rel in chunks:
        r = int(rel.split("_")[2])
        assert (fqn, offset) in held[r], (fqn, offset, rel)
    # On disk: one copy of the state (plus DCP's per-chunk headers), not world-size copies.
    one_copy = sum(torch.Size(s).numel() * 4 for s in _BIG.values())
    on_disk = sum(os.path.getsize(os.path.join(path, f)) for f in files)
    assert one_copy <= on_disk < one_copy * 1.1 + 2048 * len(md.storage_data), (on_disk, one_copy)


# -- nothing half-written -----------------------------------------------------------------

def _failing_save(path: str):
    """A save that raises on rank 1 in the middle of writing leaves the previous
    checkpoint; every rank raises."""
    mesh = Mesh((2,), ("dp",))
    x = torch.arange(8.0)
    checkpoint.save(path, {"x": shard(x, P("dp"), mesh), "step": 1})
    orig = dcp.FileSystemWriter.write_data

    def write_data(self, plan, planner):
        raise OSError(28, "No space left on device")

    if mesh.rank == 1:
        dcp.FileSystemWriter.write_data = write_data
    try:
        checkpoint.save(path, {"x": shard(x + 100, P("dp"), mesh), "step": 2})
        err = None
    except CheckpointError as e:
        err = str(e)
    finally:
        dcp.FileSystemWriter.write_data = orig
    back = checkpoint.load(path, {"x": shard(torch.zeros(8), P(), mesh), "step": 0})
    return err, gather(back["x"]), back["step"]


def test_failed_save_keeps_the_previous_checkpoint(tmp_path, on_ranks):
    for err, x, step in on_ranks(2, _failing_save, str(tmp_path / "ckpt")):
        assert err is not None and "No space left on device" in err, err
        assert "previous checkpoint at this path, if any, is unchanged" in err
        assert step == 1 and torch.equal(x, torch.arange(8.0))


def _killed_rank(rank: int, port: int, path: str, report: str):
    """A rank of a 2-process world (not the pool): save step 1, then save step 2, during
    which rank 1 is killed after writing its shard."""
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), SHARDED_CHECKPOINT_TIMEOUT="60")
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    mesh = Mesh((2,), ("dp",))
    x = torch.arange(8.0)
    checkpoint.save(path, {"x": shard(x, P("dp"), mesh), "step": 1})
    if rank == 1:
        orig = dcp.FileSystemWriter.write_data

        def write_then_die(self, plan, planner):
            fut = orig(self, plan, planner)
            fut.wait()
            os.kill(os.getpid(), signal.SIGKILL)

        dcp.FileSystemWriter.write_data = write_then_die
    try:
        checkpoint.save(path, {"x": shard(x + 100, P("dp"), mesh), "step": 2})
        outcome = "saved"
    except BaseException as e:  # noqa: BLE001
        outcome = f"{type(e).__name__}: {e}"
    with open(report, "wb") as f:
        pickle.dump(outcome, f)
    os._exit(0)


def test_rank_killed_mid_save_keeps_the_previous_checkpoint(tmp_path):
    import torch.multiprocessing as mp

    from sharded.launch import _free_port

    path, report = str(tmp_path / "ckpt"), str(tmp_path / "rank0.pkl")
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_killed_rank, args=(r, port, path, report)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=180)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    assert not alive, "a rank hung after its peer was killed mid-save"
    assert procs[1].exitcode == -signal.SIGKILL
    with open(report, "rb") as f:
        outcome = pickle.load(f)
    assert outcome.startswith("CheckpointError"), outcome
    # The interrupted save left only its partial directory; the previous one loads (here
    # in one process, as plain tensors).
    assert any(".ckpt.partial-" in n for n in os.listdir(tmp_path))
    back = checkpoint.load(path, {"x": torch.zeros(8), "step": 0})
    assert back["step"] == 1 and torch.equal(back["x"], torch.arange(8.0))
    # The next save of the path removes the leftovers.
    checkpoint.save(path, {"x": torch.ones(8), "step": 3})
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "rank0.pkl"]
    assert checkpoint.load(path, {"x": torch.zeros(8), "step": 0})["step"] == 3


def test_crash_between_the_two_renames_is_recovered(tmp_path):
    path = str(tmp_path / "ckpt")
    checkpoint.save(path, {"x": torch.arange(3.0)})
    # What a crash after "old checkpoint moved aside" and before "new one moved in" leaves.
    os.rename(path, str(tmp_path / ".ckpt.old-0123"))
    assert checkpoint.exists(path)
    assert torch.equal(checkpoint.load(path, {"x": torch.zeros(3)})["x"], torch.arange(3.0))
    checkpoint.save(path, {"x": torch.ones(3)})
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


# -- async saves ------------------------------------------------------------------------

def _async_roundtrip(path: str):
    mesh = Mesh((2,), ("dp",))
    x = shard(torch.arange(8.0), P("dp"), mesh)
    pending = checkpoint.save(path, {"x": x, "step": 1}, async_save=True)
    x.to_local().add_(1000)             # training goes on; the checkpoint has the old values
    pending.result()
    assert pending.done()
    again = checkpoint.save(path, {"x": x, "step": 2}, async_save=True)
    # load waits for the pending save first
    back = checkpoint.load(path, {"x": shard(torch.zeros(8), P(), mesh), "step": 0})
    return again.done(), back["step"], gather(back["x"])


def test_async_save(tmp_path, on_ranks):
    path = str(tmp_path / "ckpt")
    for done, step, x in on_ranks(2, _async_roundtrip, path):
        assert done and step == 2
        torch.testing.assert_close(x, torch.arange(8.0) + 1000)


def _async_snapshot(path: str):
    mesh = Mesh((2,), ("dp",))
    x = shard(torch.arange(8.0), P("dp"), mesh)
    pending = checkpoint.save(path, {"x": x}, async_save=True)
    x.to_local().add_(1000)
    checkpoint.wait()
    return pending.done(), gather(checkpoint.load(path, {"x": shard(torch.zeros(8), P("dp"), mesh)})["x"])


def test_async_save_writes_the_state_at_the_call(tmp_path, on_ranks):
    for done, x in on_ranks(2, _async_snapshot, str(tmp_path / "ckpt")):
        assert done and torch.equal(x, torch.arange(8.0))


# -- errors -------------------------------------------------------------------------------

def _tree():
    return {"params": {"w": torch.randn(4, 3), "b": torch.zeros(3)}, "step": 5}


def test_load_errors_name_the_key_path(tmp_path):
    path = str(tmp_path / "ckpt")
    checkpoint.save(path, _tree())
    ok = {"params": {"w": torch.zeros(4, 3), "b": torch.zeros(3)}, "step": 0}
    with pytest.raises(ValueError, match=r"like\['params'\]\['u'\]: key 'params.u' is not in the checkpoint"):
        checkpoint.load(path, {**ok, "params": {**ok["params"], "u": torch.zeros(1)}})
    with pytest.raises(ValueError, match=r"(?s)key 'params.b' is in the checkpoint but not in like.*strict=False"):
        checkpoint.load(path, {**ok, "params": {"w": torch.zeros(4, 3)}})
    sub = checkpoint.load(path, {"params": {"w": torch.zeros(4, 3)}}, strict=False)
    assert list(sub["params"]) == ["w"]
    with pytest.raises(ValueError, match=r"like\['params'\]\['w'\]: shape \(3, 4\) here, but the checkpoint holds shape \(4, 3\)"):
        checkpoint.load(path, {**ok, "params": {**ok["params"], "w": torch.zeros(3, 4)}})
    with pytest.raises(ValueError, match=r"like\['params'\]\['b'\]: dtype torch.float64 here"):
        checkpoint.load(path, {**ok, "params": {**ok["params"], "b": torch.zeros(3, dtype=torch.float64)}})
    with pytest.raises(ValueError, match=r"like\['step'\]: a tensor here, but the checkpoint holds a Python value"):
        checkpoint.load(path, {**ok, "step": torch.zeros(())})
    with pytest.raises(ValueError, match=r"like\['params'\]\['b'\]: a int here, but the checkpoint holds a tensor"):
        checkpoint.load(path, {**ok, "params": {**ok["params"], "b": 0}})
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        checkpoint.load(str(tmp_path / "nope"), ok)
    assert not checkpoint.exists(str(tmp_path / "nope")) and checkpoint.exists(path)


def test_save_errors(tmp_path):
    with pytest.raises(TypeError, match=r"tree\['opt'\] is a object; checkpoint leaves must be"):
        checkpoint.save(str(tmp_path / "a"), {"opt": object()})
    with pytest.raises(ValueError, match=r"tree\['a'\]\['b'\] and tree\['a.b'\] both have the key 'a.b'"):
        checkpoint.save(str(tmp_path / "a"), {"a.b": 1, "a": {"b": 2}})
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep me")
    with pytest.raises(ValueError, match="is a directory that is not a checkpoint"):
        checkpoint.save(str(tmp_path / "notes"), {"x": 1})
    assert (tmp_path / "notes" / "todo.txt").read_text() == "keep me"
    # Saving over a checkpoint replaces it and leaves nothing beside it.
    path = str(tmp_path / "ckpt")
    checkpoint.save(path, {"x": torch.zeros(2), "step": 1})
    checkpoint.save(path, {"x": torch.ones(2), "step": 2})
    assert checkpoint.load(path, {"x": torch.zeros(2), "step": 0})["step"] == 2
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "notes"]


def _rank_dependent(path: str):
    mesh = Mesh((2,), ("dp",))
    errors = []
    try:                                   # a scalar that differs between ranks
        checkpoint.save(path, {"x": shard(torch.zeros(4), P("dp"), mesh), "step": mesh.rank})
    except CheckpointError as e:
        errors.append(str(e))
    try:                                   # a pending sum cannot be stored
        checkpoint.save(path, {"g": DTensor.from_local(torch.ones(2), mesh.device_mesh, [Partial()])})
    except (ValueError, CheckpointError) as e:
        errors.append(f"{type(e).__name__}: {e}")
    checkpoint.save(path, {"x": shard(torch.zeros(4), P("dp"), mesh)})
    like = {"x": shard(torch.zeros(4), P(), mesh)}
    if mesh.rank == 1:                     # a like that only one rank gets wrong
        like["extra"] = 0
    try:
        checkpoint.load(path, like)
    except (ValueError, CheckpointError) as e:
        errors.append(f"{type(e).__name__}: {e}")
    # likes that are each valid but differ between ranks
    like = {"x": shard(torch.zeros(4), P(), mesh) if mesh.rank == 0 else torch.zeros(4)}
    try:
        checkpoint.load(path, like)
    except CheckpointError as e:
        errors.append(str(e))
    return errors


def test_ranks_that_disagree_fail_together(tmp_path, on_ranks):
    res = on_ranks(2, _rank_dependent, str(tmp_path / "ckpt"))
    for rank, errors in enumerate(res):
        assert len(errors) == 4, errors
        assert "rank 1 differs from rank 0" in errors[0] and "tree['step']" in errors[0]
        assert "tree['g'] holds a pending reduction" in errors[1]
        if rank == 1:
            assert errors[2].startswith("ValueError") and "like['extra']" in errors[2]
        else:
            assert errors[2].startswith("CheckpointError") and "rank 1 failed" in errors[2]
        assert "every rank must load with the same like" in errors[3], errors[3]
        assert "rank 0: like['x']: dtensor" in errors[3] and "rank 1: like['x']: tensor" in errors[3]
