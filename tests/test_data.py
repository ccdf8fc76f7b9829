"""Feeding data (sharded/data.py, NOTE [Per-rank data]): ``from_local_data`` builds the
global batch from each rank's own piece, and a plain tensor whose values differ across
ranks, given where it is one global value, fails on every rank in every mode, on the
first call and on any later one, instead of training on the wrong data.

The per-rank data recipe (a DataLoader with a DistributedSampler per "dp" group on a
("dp", "tp") mesh) trains as one device does on the same global batches."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard

from sharded import Mesh, P, from_local_data, gather, optim, shard, spec_of
from sharded.data import value_digest, value_digests, _device_sum
from sharded.modes import DataParallelMode, DTensorExpandMode
from transforms import pjit, shard_map
from tests import ranks

D, H, V = 8, 16, 12


# -- digests, in one process ------------------------------------------------------------

def test_value_digest_tells_values_dtype_and_shape_apart():
    x = torch.arange(12.0).reshape(3, 4)
    same = [x, x.clone(), x.t().contiguous().t()]           # equal values, other strides
    assert len({value_digest(t) for t in same}) == 1
    others = [x + 1e-6, x.reshape(4, 3), x.to(torch.float64), x.to(torch.bfloat16),
              x.flip(0), torch.zeros(0), torch.tensor(1.0)]
    digests = [value_digest(t) for t in [x, *others]]
    assert len(set(digests)) == len(digests)
    assert value_digests([x, x.int()]) == [value_digest(x), value_digest(x.int())]
    assert value_digest(torch.tensor([True, False])) != value_digest(torch.tensor([False, True]))


def test_the_device_digest_is_deterministic_and_tells_values_apart():
    # the path taken for CUDA tensors, exercised on the CPU
    x = torch.randint(0, 100, (64, 33))
    a, b = _device_sum(x), _device_sum(x.clone())
    assert torch.equal(a, b)
    y = x.clone()
    y[10, 7] += 1
    assert not torch.equal(_device_sum(y), a)
    assert torch.equal(_device_sum(x, chunk=7), a)            # chunks sum alike
    assert not torch.equal(_device_sum(x.flatten()[:-1]), _device_sum(x.flatten()[1:]))
    z = x.clone()
    z[0, 0], z[0, 1] = x[0, 1], x[0, 0]                     # a swap: the same bytes, moved
    assert x[0, 0] == x[0, 1] or not torch.equal(_device_sum(z), a)


def test_from_local_data_on_one_rank_is_the_piece():
    mesh = Mesh((1,), ("dp",))
    x = torch.arange(6.0).reshape(3, 2)
    d = from_local_data(x, P("dp"), mesh)
    assert isinstance(d, DTensor) and d.shape == (3, 2) and spec_of(d) == P("dp")
    assert d.to_local().data_ptr() == x.data_ptr()          # no copy
    tree = from_local_data({"ids": x.long(), "n": 3}, {"ids": P("dp"), "n": None}, mesh)
    assert tree["n"] == 3 and spec_of(tree["ids"]) == P("dp")


def test_from_local_data_errors():
    mesh = Mesh((1,), ("dp",))
    with pytest.raises(ValueError, match=r"from_local_data spec \(for local\) is P\('tp'\), which names mesh axis 'tp', but the mesh has axes \('dp',\)"):
        from_local_data(torch.ones(2), P("tp"), mesh)
    with pytest.raises(ValueError, match=r"from_local_data spec \(for local\) is P\('dp', None\), which has 2 entries, but the tensor has 1 dims \(shape \(2,\)\)"):
        from_local_data(torch.ones(2), P("dp", None), mesh)
    with pytest.raises(TypeError, match=r"from_local_data: local is already a DTensor"):
        from_local_data(from_local_data(torch.ones(2), P(), mesh), P(), mesh)


# -- on ranks ---------------------------------------------------------------------------

def _init(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"w1": torch.randn(H, D, generator=g) * 0.3, "b1": torch.zeros(H),
            "w2": torch.randn(V, H, generator=g) * 0.3}


def _loss(p, x, y):
    h = F.gelu(F.linear(x, p["w1"], p["b1"]))
    return F.cross_entropy(F.linear(h, p["w2"]), y)


def _step(p, x, y):
    grads, loss = torch.func.grad_and_value(_loss)(p, x, y)
    return {k: p[k] - 0.1 * grads[k] for k in p}, loss


TP = {"w1": P("tp"), "b1": P("tp"), "w2": P(None, "tp")}


def _dataset(n=32, seed=5):
    g = torch.Generator().manual_seed(seed)
    return torch.utils.data.TensorDataset(torch.randn(n, D, generator=g),
                                          torch.randint(0, V, (n,), generator=g))


def _recipe(mesh_shape, names, mode_name, steps=3, local_batch=4):
    """The docs' recipe (docs/data.md): a DistributedSampler per "dp" coordinate, each
    rank's batch made global with from_local_data, against one device on the batches
    the ranks' pieces make up together."""
    from torch.utils.data import DataLoader, DistributedSampler

    mesh = Mesh(mesh_shape, names)
    dp = mesh.size("dp")
    dp_rank = mesh.coordinate()[names.index("dp")]
    data = _dataset()
    sampler = DistributedSampler(data, num_replicas=dp, rank=dp_rank, shuffle=True, seed=7,
                                 drop_last=True)
    loader = DataLoader(data, batch_size=local_batch, sampler=sampler, drop_last=True)
    tp = "tp" in names
    pspecs = TP if tp else P()
    mode = {"expand": DTensorExpandMode(), "replicate": DataParallelMode("replicate"),
            "shard": DataParallelMode("shard")}[mode_name]
    step = pjit(_step, in_specs=(pspecs, P("dp"), P("dp")), out_specs=(pspecs, P()), mesh=mesh,
                mode=mode)
    params = shard(_init(), pspecs, mesh)
    ref = _init()
    moved = []
    import unittest.mock as mock
    real = DTensor.redistribute
    for i, (x, y) in enumerate(loader):
        if i == steps:
            break
        bx, by = from_local_data((x, y), P("dp"), mesh)
        def counted(self, *a, **k):
            if self is bx or self is by:
                moved.append(1)
            return real(self, *a, **k)

        with mock.patch.object(DTensor, "redistribute", counted):
            params, loss = step(params, bx, by)
        # one device, on the global batch: the dp groups' pieces in "dp" order
        gx, gy = gather(bx), gather(by)
        ref, ref_loss = _step(ref, gx, gy)
        torch.testing.assert_close(gather(loss), ref_loss)
    for k in ref:
        torch.testing.assert_close(gather(params[k]), ref[k])
    return len(moved), tuple(bx.shape)


def _many_recipes(cases):
    return [_recipe(*c) for c in cases]


@pytest.mark.parametrize("ws,cases", [
    (2, [((2,), ("dp",), "expand"), ((2,), ("dp",), "replicate"), ((2,), ("dp",), "shard")]),
    (4, [((2, 2), ("dp", "tp"), "expand"), ((2, 2), ("dp", "tp"), "shard"),
         ((4,), ("dp",), "replicate")]),
])
def test_the_distributed_sampler_recipe_equals_one_device(ws, cases):
    out = ranks.run(ws, _many_recipes, cases)
    for rank_out in out:
        for (moved, shape), (mesh_shape, names, _) in zip(rank_out, cases):
            assert moved == 0, "a batch in the layout in_specs asks for moved"
            dp = mesh_shape[names.index("dp")]
            assert shape == (4 * dp, D)


def _differing_plain(mode_name, where, call_at):
    """Every call gives the batch as a plain tensor; at call ``call_at`` (and later)
    rank 1's differs. Returns the error each rank raised, and that the next good call
    still works (the agreement raises before anything communicates)."""
    mesh = Mesh((dist_world(),), ("dp",))
    mode = {"expand": DTensorExpandMode(), "replicate": DataParallelMode("replicate"),
            "shard": DataParallelMode("shard")}[mode_name]
    params = _init()
    x = torch.randn(8, D, generator=torch.Generator().manual_seed(1))
    y = torch.arange(8) % V
    if where == "grad":         # the differentiable path: autograd from outside
        step = pjit(_loss, in_specs=(P(), P("dp"), P("dp")), mesh=mesh, mode=mode)
        state = shard(params, P(), mesh)
        state = {k: v.requires_grad_() for k, v in state.items()}
        call = lambda xb: step(state, xb, y).backward()  # noqa: E731
    else:
        step = pjit(_step, in_specs=(P(), P("dp"), P("dp")), mesh=mesh, mode=mode)
        state = shard(params, P(), mesh)
        call = lambda xb: step(state, xb, y)  # noqa: E731
    for _ in range(call_at):
        call(x)
    bad = x + 1.0 if torch.distributed.get_rank() == 1 else x
    try:
        call(bad)
    except Exception as e:  # noqa: BLE001
        err = (type(e).__name__, str(e))
    else:
        err = None
    call(x)                      # the groups are still usable
    return err


def _captured_differs():
    """A tensor the function closes over is one global value too: a per-rank one
    (more than 16 elements: only its digest is in the program) stops every rank."""
    mesh = Mesh((2,), ("dp",))
    t = torch.arange(32.0) + torch.distributed.get_rank()
    f = pjit(lambda x: x * t, in_specs=P("dp"), out_specs=P("dp"), mesh=mesh)
    try:
        f(torch.ones(32))
    except Exception as e:  # noqa: BLE001
        return type(e).__name__, str(e)
    return None


def test_captured_tensors_that_differ_stop_every_rank():
    for err in ranks.run(2, _captured_differs):
        assert err is not None, "a per-rank captured tensor ran silently"
        assert err[0] == "RankMismatchError"
        assert "_tensor_constant0: constant float32[32] with values" in err[1]


def dist_world():
    return torch.distributed.get_world_size()


def _differing_cases(cases):
    return [_differing_plain(*c) for c in cases]


def test_plain_inputs_whose_values_differ_fail_on_every_rank_in_every_mode():
    cases = [("expand", "call", 0), ("replicate", "call", 0), ("shard", "call", 0),
             ("expand", "call", 3), ("replicate", "call", 3), ("shard", "call", 3),
             ("expand", "grad", 0), ("shard", "grad", 2)]
    out = ranks.run(2, _differing_cases, cases)
    for rank_out in out:
        for err, case in zip(rank_out, cases):
            assert err is not None, f"{case}: a per-rank batch ran silently"
            name, msg = err
            assert name == "RankMismatchError", (case, err)
            assert "args[1] is a plain tensor whose values differ across ranks (rank 0 and rank 1 hold different values, compared bitwise)" in msg, (case, msg)
            assert "sharded.from_local_data(local_batch, spec, mesh)" in msg


def _shard_map_differs():
    mesh = Mesh((2,), ("dp",))
    r = torch.distributed.get_rank()
    f = shard_map(lambda x: x * 2, mesh=mesh, in_specs=P("dp"), out_specs=P("dp"))
    try:
        f(torch.ones(4) * (1 + r))
        err = None
    except Exception as e:  # noqa: BLE001
        err = (type(e).__name__, str(e))
    same = gather(f(torch.arange(4.0)))       # still usable; equal inputs pass
    return err, same


def test_eager_shard_map_checks_plain_values_too():
    for err, same in ranks.run(2, _shard_map_differs):
        assert err is not None and err[0] == "RankMismatchError"
        assert "args[0] is a plain tensor whose values differ across ranks" in err[1]
        torch.testing.assert_close(same, torch.arange(4.0) * 2)


def _from_local_data_checks():
    mesh = Mesh((2, 2), ("dp", "tp"))
    r = torch.distributed.get_rank()
    dp, tp = mesh.coordinate()
    out = {}
    # the "tp" ranks of one "dp" group share a block and give the same piece
    d = from_local_data(torch.full((2, 3), float(dp)), P("dp"), mesh)
    out["global"] = gather(d)
    # a piece split over both axes: every rank its own
    d2 = from_local_data(torch.full((1, 3), float(r)), P(("dp", "tp")), mesh)
    out["both"] = gather(d2)
    out["specs"] = (spec_of(d), spec_of(d2), tuple(d.placements))
    # shard_map takes it as any DTensor: each rank's block is its piece
    local_sum = shard_map(lambda x: x.sum(0, keepdim=True), mesh=mesh, in_specs=P("dp"),
                          out_specs=P("dp"))
    out["shard_map"] = gather(local_sum(d))
    for name, piece, spec in [
        ("shape", torch.zeros(2 if r != 3 else 1, 3), P("dp")),
        ("shared", torch.full((2, 3), float(r)), P("dp")),
    ]:
        try:
            from_local_data(piece, spec, mesh)
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    # a rank that fails before the check (a bad spec on rank 3 only) stops every rank,
    # none waits; ranks whose pytrees differ all raise
    for name, piece, spec in [
        ("one_rank_fails", torch.zeros(2, 3), P("zz") if r == 3 else P("dp")),
        ("structure", {"a": torch.zeros(2, 3), **({"b": torch.zeros(2)} if r == 1 else {})}, P("dp")),
    ]:
        try:
            from_local_data(piece, spec, mesh)
            out[name] = None
        except Exception as e:  # noqa: BLE001
            out[name] = f"{type(e).__name__}: {e}"
    # check=False: no communication, no check
    out["unchecked"] = tuple(from_local_data(torch.full((2, 3), float(r)), P("dp"), mesh,
                                             check=False).shape)
    return out


def test_from_local_data_on_a_2x2_mesh():
    outs = ranks.run(4, _from_local_data_checks)
    for out in outs:
        torch.testing.assert_close(out["global"], torch.tensor([0.0, 0.0, 1.0, 1.0])[:, None].expand(4, 3))
        torch.testing.assert_close(out["both"], torch.arange(4.0)[:, None].expand(4, 3))
        assert out["specs"] == (P("dp"), P(("dp", "tp")), (Shard(0), Replicate()))
        torch.testing.assert_close(out["shard_map"], torch.tensor([0.0, 2.0])[:, None].expand(2, 3))
        assert "from_local_data: the pieces of local differ across ranks: rank 0 gave float32[2, 3], rank 3 gave float32[1, 3]" in out["shape"]
        assert "drop_last=True" in out["shape"]
        assert "from_local_data: ranks 0 and 1 share the block of local laid out as P('dp')" in out["shared"]
        assert "mesh axes ('tp',)" in out["shared"]
        assert out["unchecked"] == (4, 3)
        assert "structure" in out and "gave pieces of different pytree structures or specs" in out["structure"]
    assert out["one_rank_fails"].startswith("ValueError: from_local_data spec (for local) is P('zz')")
    for out in outs[:3]:
        assert out["one_rank_fails"].startswith("RankFailedError: from_local_data: rank 3 failed before the check of the pieces")
