"""The cost model of automatic sharding (sharded/auto/cost.py): the stated H100 table,
redistribution prices, JSON, the per-machine cache, predictions of lowered programs,
and measuring on real gloo ranks (every rank gets rank 0's model)."""

import dataclasses
import json
import os
import types

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from sharded import Mesh, P, _torch, pjit
from sharded.auto import cost
from sharded.auto.cost import CostModel, predict, redistribute_seconds

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send")


def test_h100_prices_grow_with_bytes_and_group_size():
    m = CostModel.h100()
    assert m.flops_per_s == cost.H100_FP32_FLOPS and m.bytes_per_s == cost.H100_HBM_BYTES_PER_S
    for kind in KINDS:
        assert m.collective_seconds(kind, 1 << 30, 1) == 0.0
        by_bytes = [m.collective_seconds(kind, b, 8) for b in (0, 1 << 10, 1 << 20, 1 << 30)]
        assert by_bytes == sorted(by_bytes) and by_bytes[0] > 0 and by_bytes[-1] > by_bytes[1]
        by_size = [m.collective_seconds(kind, 1 << 26, n) for n in (2, 4, 8, 16, 64, 512)]
        assert by_size == sorted(by_size), kind
    # within a node (NVLink) much cheaper than across nodes (InfiniBand)
    assert m.collective_seconds("all_reduce", 1 << 28, 16) > 5 * m.collective_seconds("all_reduce", 1 << 28, 8)
    # ring all-reduce: 2 (n - 1) / n of the buffer over the bus bandwidth, plus latency
    want = cost.H100_NVLINK_LATENCY_S + 2 * 7 / 8 * 2**30 / cost.H100_NVLINK_BUS_BYTES_PER_S
    assert m.collective_seconds("all_reduce", 2**30, 8) == pytest.approx(want)
    assert m.collective_seconds("ppermute", 100, 2) == m.collective_seconds("send", 100, 2)
    # a roofline: the slower of flops and bytes
    assert m.compute_seconds(67e12, 0) == pytest.approx(1.0)
    assert m.compute_seconds(0, 3.35e12) == pytest.approx(1.0)
    assert CostModel.h100("bf16").flops_per_s == cost.H100_BF16_FLOPS
    with pytest.raises(ValueError, match="precision must be one of"):
        CostModel.h100("fp8")
    with pytest.raises(ValueError, match="unknown collective kind 'gather'"):
        m.collective_seconds("gather", 8, 2)


def test_op_cost_is_the_per_op_seconds_plus_the_roofline():
    m = CostModel.h100()
    assert m.op_seconds == cost.H100_OP_SECONDS and 4e-6 <= m.op_seconds <= 6e-6
    assert m.op_cost(0, 0) == m.op_seconds
    assert m.op_cost(67e12, 0) == pytest.approx(1.0 + m.op_seconds)
    assert m.op_cost(0, 3.35e12) == pytest.approx(1.0 + m.op_seconds)
    assert m.compute_seconds(0, 0) == 0.0                  # the roofline alone
    assert m.op_cost(2e9, 4e6) == m.op_seconds + m.compute_seconds(2e9, 4e6)
    # old constructors: no per-op cost
    bare = CostModel("bare", 1e9, 1e9)
    assert bare.op_seconds == 0.0 and bare.op_cost(1e9, 0) == bare.compute_seconds(1e9, 0) == 1.0
    assert CostModel("x", 1e9, 1e9, op_seconds=1e-5) != bare
    for bad in (-1e-6, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="op_seconds must be finite and >= 0"):
            CostModel("bad", 1e9, 1e9, op_seconds=bad)


def test_rows_per_group_size_and_fallbacks():
    m = CostModel("t", 1e9, 1e9, collectives=(("all_reduce", 2, 1.0, 0.0),
                                              ("all_reduce", 4, 2.0, 0.0)))
    assert [m.collective_seconds("all_reduce", 8, n) for n in (1, 2, 3, 4, 64)] == [0, 1, 1, 2, 2]
    # a kind without rows is priced as another kind's
    assert m.collective_seconds("all_gather", 8, 2) == 1.0
    bare = CostModel("bare", 1e9, 1e9)
    assert bare.collective_seconds("all_reduce", 8, 1) == 0.0
    with pytest.raises(ValueError, match="no figures for 'all_reduce'"):
        bare.collective_seconds("all_reduce", 8, 2)
    with pytest.raises(ValueError, match="must be positive"):
        CostModel("bad", 0.0, 1.0)
    with pytest.raises(ValueError, match="unknown collective kind"):
        CostModel("bad", 1.0, 1.0, collectives=(("gather", 2, 0.0, 0.0),))


def test_json_round_trip():
    for m in (CostModel.h100(), CostModel.h100("tf32"),
              CostModel("x", 1.5e9, 2.5e9, collectives=(("all_gather", 2, 1e-3, 1e-9),)),
              CostModel("y", 1.5e9, 2.5e9, collectives=(("all_gather", 2, 1e-3, 1e-9),),
                        op_seconds=7e-6)):
        back = CostModel.from_dict(json.loads(json.dumps(m.to_dict())))
        assert back == m and hash(back) == hash(m)
        assert back.collective_seconds("all_gather", 1 << 20, 2) == m.collective_seconds("all_gather", 1 << 20, 2)
        assert back.op_seconds == m.op_seconds
    with pytest.raises(ValueError, match="not a cost model"):
        CostModel.from_dict({"name": "x"})
    with pytest.raises(ValueError, match="malformed"):
        CostModel.from_dict({"format": cost._FORMAT, "name": "x", "flops_per_s": 1.0})
    # format 1 (the free least-squares fit, whose latencies were noise) is refused
    old = {**CostModel.h100().to_dict(), "format": 1}
    with pytest.raises(ValueError, match=f"not a cost model of format {cost._FORMAT}"):
        CostModel.from_dict(old)
    # format 2 (no op_seconds) is refused too: a cached one is measured again
    assert cost._FORMAT == 3
    two = {k: v for k, v in CostModel.h100().to_dict().items() if k != "op_seconds"}
    with pytest.raises(ValueError, match="not a cost model of format 3"):
        CostModel.from_dict({**two, "format": 2})
    with pytest.raises(ValueError, match="malformed"):
        CostModel.from_dict({**two, "format": 3})
    assert "per op 5.00 us" in CostModel.h100().describe()
    assert "H100 NCCL (stated)" in CostModel.h100().describe()
    assert "all_reduce" in CostModel.h100().describe()


def test_redistribute_seconds():
    m = CostModel.h100()
    shape, full = (1024, 512), 1024 * 512 * 4
    cs = m.collective_seconds

    def rs(src, dst, mesh_shape=(8,)):
        return redistribute_seconds(m, src, dst, shape, 4, mesh_shape)

    assert rs((Shard(0),), (Replicate(),)) == cs("all_gather", full, 8)
    assert rs((Partial(),), (Replicate(),)) == cs("all_reduce", full, 8)
    assert rs((Partial(),), (Shard(1),)) == cs("reduce_scatter", full, 8)
    assert rs((Shard(0),), (Shard(1),)) == cs("all_to_all", full // 8, 8)
    assert rs((Shard(0),), (Partial(),)) == cs("all_gather", full, 8)
    assert rs((Partial(),), (Partial("avg"),)) == cs("all_reduce", full, 8)
    for src, dst in (((Replicate(),), (Shard(0),)), ((Replicate(),), (Partial(),)),
                     ((Shard(1),), (Shard(1),)), ((Partial(),), (Partial(),))):
        assert rs(src, dst) == 0.0
    assert rs((Shard(0),), (Replicate(),), (1,)) == 0.0        # one rank: nothing moves
    # a _StridedShard is a Shard of its dim
    assert rs((_torch.strided_shard(0, 2),), (Replicate(),)) == rs((Shard(0),), (Replicate(),))
    # 2-D: axis by axis in mesh order, each on the block at that point
    two = rs((Shard(0), Shard(0)), (Replicate(), Replicate()), (2, 4))
    assert two == pytest.approx(cs("all_gather", full // 4, 2) + cs("all_gather", full, 4))
    mixed = rs((Partial(), Shard(1)), (Shard(0), Replicate()), (2, 4))
    assert mixed == pytest.approx(cs("reduce_scatter", full // 4, 2) + cs("all_gather", full // 2, 4))
    # a sum pending over every axis, made replicated: one all-reduce over the mesh's
    # group, as the modes lower it (NOTE [One reduction over every mesh axis]); over
    # two axes of three, one per axis
    assert rs((Partial(), Partial()), (Replicate(), Replicate()), (2, 4)) == cs("all_reduce", full, 8)
    assert rs((Partial(),) * 3, (Replicate(),) * 3, (2, 2, 2)) == cs("all_reduce", full, 8)
    assert rs((Partial(), Partial(), Replicate()), (Replicate(),) * 3, (2, 2, 2)) == pytest.approx(
        2 * cs("all_reduce", full, 2))
    # lists and tuples alike, answered from the cache
    before = cost._redistribute.cache_info().hits
    assert redistribute_seconds(m, [Shard(0)], [Replicate()], [1024, 512], 4, [8]) == rs(
        (Shard(0),), (Replicate(),))
    assert cost._redistribute.cache_info().hits > before
    with pytest.raises(ValueError, match="one placement per mesh axis"):
        rs((Shard(0),), (Replicate(),), (2, 2))
    with pytest.raises(ValueError, match=r"Shard\(2\) of a tensor of shape"):
        rs((Shard(2),), (Replicate(),))


def _step(w, x, y):
    grad, loss = torch.func.grad_and_value(lambda w: ((x @ w - y) ** 2).mean())(w)
    return w - 0.1 * grad, loss


def test_predict_on_an_abstract_mesh():
    mesh = Mesh.abstract((4,), ("dp",))
    args = (torch.empty(256, 128, device="meta"), torch.empty(512, 256, device="meta"),
            torch.empty(512, 128, device="meta"))
    dp = pjit(_step, in_specs=(P(), P("dp"), P("dp")), mesh=mesh).lower(*args)
    rep = pjit(_step, in_specs=(P(), P(), P()), mesh=mesh).lower(*args)
    a, b = predict(dp), predict(rep)
    assert a == predict(dp, CostModel.h100())          # abstract mesh: the stated table
    assert a["collectives"] == 2 and a["comm_by_kind"]["all_reduce"]["count"] == 2
    # the gradient's all-reduce: 256 x 128 floats over 4 ranks
    assert a["comm_s"] >= CostModel.h100().collective_seconds("all_reduce", 256 * 128 * 4, 4)
    assert b["collectives"] == 0 and b["comm_s"] == 0.0 and a["comm_s"] > b["comm_s"]
    for p, low in ((a, dp), (b, rep)):
        assert p["total_s"] == pytest.approx(p["compute_s"] + p["overhead_s"] + p["comm_s"])
        assert p["compute_s"] > 0
        # every op priced is charged op_seconds: the call_function nodes that are not
        # views, collectives or waits
        nodes = [n for n in low.local_graph.graph.nodes if n.op == "call_function"]
        priced = [n for n in nodes if isinstance(n.target, _torch.OpOverload)
                  and not n.target.is_view and n.target not in _torch.COLLECTIVE_OPS
                  and n.target is not _torch.WAIT_OP]
        assert p["ops"] == len(priced) > 0 and len(nodes) > p["ops"]
        assert p["views"] == sum(isinstance(n.target, _torch.OpOverload) and n.target.is_view
                                 for n in nodes) > 0
        assert p["overhead_s"] == pytest.approx(p["ops"] * cost.H100_OP_SECONDS)
        # without a per-op cost: the same rooflines, no overhead
        bare = cost.predict_graph(low.local_graph, mesh, dataclasses.replace(
            CostModel.h100(), op_seconds=0.0))
        assert bare["overhead_s"] == 0.0 and bare["ops"] == p["ops"]
        assert bare["compute_s"] == p["compute_s"]
        assert bare["total_s"] == pytest.approx(p["total_s"] - p["overhead_s"])
    # the two matmuls' flops (forward and the weight's gradient) at least: 4x less per
    # rank with the batch split 4 ways
    mm_flops = 2 * (2 * 512 * 256 * 128)
    assert b["compute_s"] >= mm_flops / cost.H100_FP32_FLOPS
    assert a["compute_s"] < b["compute_s"]
    with pytest.raises(NotImplementedError, match="pipelined step"):
        predict(types.SimpleNamespace(pipeline={"stages": 2}, name="pjit(f)", mesh=mesh))


def test_cache_file(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDED_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cost, "_MEMO", {})
    measured = []
    real = cost._measure

    def counting(cls, mesh, sizes, repeats):
        measured.append(mesh)
        return real(cls, mesh, sizes, repeats)

    monkeypatch.setattr(cost, "_measure", counting)
    assert CostModel.for_mesh(Mesh.abstract((8, 8), ("dp", "tp"))) == CostModel.h100()
    mesh = Mesh((1,), ("dp",))
    first = CostModel.for_mesh(mesh)
    assert len(measured) == 1 and first.name.startswith("measured: ") and first.flops_per_s > 0
    (path,) = tmp_path.iterdir()
    data = json.loads(path.read_text())
    assert data["key"]["mesh_shape"] == [1] and data["key"]["torch"] == torch.__version__
    assert data["key"]["format"] == cost._FORMAT and data["model"]["format"] == cost._FORMAT
    # a file of format 1 was keyed without the format: another file, never read
    old_key = {k: v for k, v in data["key"].items() if k != "format"}
    assert cost.cache_path(old_key) != path
    assert CostModel.from_dict(data["model"]) == first
    assert CostModel.for_mesh(mesh) is first                 # the in-process memo
    # a new process (memo empty) reads the file: a doctored figure shows it was read
    data["model"]["flops_per_s"] = 1234.0
    path.write_text(json.dumps(data))
    monkeypatch.setattr(cost, "_MEMO", {})
    assert CostModel.for_mesh(mesh).flops_per_s == 1234.0 and len(measured) == 1
    # a malformed file, or one of another key, is a miss: measured and rewritten
    for bad in ("{not json", json.dumps({**data, "key": {**data["key"], "torch": "0.0"}})):
        path.write_text(bad)
        monkeypatch.setattr(cost, "_MEMO", {})
        assert CostModel.for_mesh(mesh).flops_per_s != 1234.0
        assert json.loads(path.read_text())["key"] == data["key"]
    assert len(measured) == 3


def _measure_on_ranks(cache):
    mesh = Mesh((2,), ("dp",))
    measured = CostModel.measure(mesh, sizes=(4 << 10, 256 << 10, 1 << 20), repeats=2)
    os.environ["SHARDED_CACHE_DIR"] = cache
    try:
        cost._MEMO.clear()
        cached = CostModel.for_mesh(mesh)
    finally:
        del os.environ["SHARDED_CACHE_DIR"]
    return measured.to_dict(), cached.to_dict(), sorted(os.listdir(cache))


def test_measure_on_gloo_ranks(on_ranks, tmp_path):
    results = on_ranks(2, _measure_on_ranks, str(tmp_path))
    (m0, c0, files0), (m1, c1, _) = results
    assert m0 == m1 and c0 == c1                   # rank 0's model on every rank
    assert len(files0) == 1                        # rank 0 wrote the cache file
    model = CostModel.from_dict(m0)
    assert model.name.startswith("measured: gloo, 2 ranks")
    assert model.flops_per_s > 0 and model.bytes_per_s > 0
    assert {(k, n) for k, n, _, _ in model.collectives} == {
        (k, 2) for k in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")}
    for _, _, lat, spb in model.collectives:
        assert lat > 0 and spb > 0
    assert model.collective_seconds("all_reduce", 1 << 20, 2) > model.collective_seconds("all_reduce", 0, 2) > 0
    # a tiny op's dispatch: about a microsecond to tens of them on CPU
    assert 1e-7 <= model.op_seconds <= 1e-3, model.describe()
    assert model.op_cost(0, 0) == model.op_seconds


def _free_fit(points):
    """Format 1's fit: a free least-squares line (the noise-bound one)."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    mt = sum(t for _, t in points) / n
    b = sum((x - mx) * (t - mt) for x, t in points) / sum((x - mx) ** 2 for x, _ in points)
    return mt - b * mx, b


def test_fit_is_robust_to_noise_at_the_large_sizes():
    lat, spb = 300e-6, 1e-9                 # 0.3 ms, 1 GB/s
    xs = [4 << 10, 64 << 10, 1 << 20, 4 << 20]
    clean = [(x, lat + x * spb) for x in xs]
    a, b = cost._fit(clean)
    assert a == pytest.approx(lat) and b == pytest.approx(spb)
    # the 4 MiB point preempted (+4 ms): a free line's intercept goes below zero (format
    # 1 floored it at 1 us: the all-gather's 5 us); the pinned fit keeps the latency
    noisy = [(x, t + extra) for (x, t), extra in zip(clean, (0, 0, 0, 4e-3))]
    assert _free_fit(noisy)[0] < 1e-5
    a, b = cost._fit(noisy)
    assert a == pytest.approx(lat, rel=0.25) and spb <= b < 2.5 * spb
    # a noisy small size: the lowest of the latency-bound points counts
    a, _ = cost._fit([(x, t + extra) for (x, t), extra in zip(clean, (2e-3, 0, 0, 0))])
    assert a == pytest.approx(lat, rel=0.05)
    # no growth with size: a latency, and the floor for the slope
    a, b = cost._fit([(x, 1e-3) for x in xs], min_slope=1e-12)
    assert a == pytest.approx(1e-3) and b == 1e-12
    # never below 1 us
    assert cost._fit([(x, 1e-9) for x in xs])[0] == cost._MIN_LATENCY_S


def test_fit_table_holds_the_kinds_together():
    xs = [4 << 10, 64 << 10, 1 << 20, 4 << 20]
    lats = {"all_reduce": 2.6e-3, "all_gather": 4.9e-6, "reduce_scatter": 1.3e-3,
            "all_to_all": 0.9e-3}                          # format 1's 4-rank figures
    times = {(k, 2, x): lat + x * 1e-9 for k, lat in lats.items() for x in xs}
    times.update({("all_gather", 4, x): 5e-4 + x * 1e-6 for x in xs})
    fits = cost._fit_table(times, bytes_per_s=1e12)
    at2 = {k: fits[(k, 2)] for k in lats}
    mid = sorted(lats.values())[1:3]
    mid_lat = sum(mid) / 2
    for k, (lat, spb) in at2.items():
        assert mid_lat / cost._LATENCY_SPREAD <= lat <= mid_lat * cost._LATENCY_SPREAD
        assert spb > 0
    assert at2["all_gather"][0] == pytest.approx(mid_lat / cost._LATENCY_SPREAD)
    assert at2["all_reduce"][0] == pytest.approx(2.6e-3, rel=1e-6)       # within the spread
    # a group size is held on its own (one kind timed: nothing to hold it to)
    assert fits[("all_gather", 4)][0] == pytest.approx(5e-4)
    # the slope is floored at one pass through memory
    slow = cost._fit_table({("all_reduce", 2, x): 1e-3 for x in xs}, bytes_per_s=1e10)
    assert slow[("all_reduce", 2)][1] == pytest.approx(1e-10)


def _measure_model(shape):
    import time

    mesh = Mesh(shape, ("dp", "tp")[:len(shape)])
    t0 = time.perf_counter()
    model = CostModel.measure(mesh)                 # the defaults, as for_mesh measures
    return model.to_dict(), time.perf_counter() - t0


@pytest.mark.parametrize("world,shape", [(2, (2,)), (4, (2, 2))])
def test_measured_latencies_are_consistent(on_ranks, world, shape):
    results = on_ranks(world, _measure_model, shape)
    dicts = [d for d, _ in results]
    assert all(d == dicts[0] for d in dicts)          # the same model on every rank
    model = CostModel.from_dict(dicts[0])
    print(f"\n{model.describe()}\n  measured in {max(s for _, s in results):.2f} s")
    assert model.name.startswith(f"measured: gloo, {world} ranks")
    assert {(k, n) for k, n, _, _ in model.collectives} == {
        (k, 2) for k in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")}
    lats = [lat for _, _, lat, _ in model.collectives]
    # the same order across kinds: a few round trips over one transport each
    assert max(lats) <= 20 * min(lats), model.describe()
    assert min(lats) >= 10e-6, model.describe()       # loopback TCP: tens of us at least
    for _, _, _, spb in model.collectives:
        assert spb >= 1.0 / model.bytes_per_s
    # a 4 MiB buffer costs more than a 4 KiB one, and both more than nothing
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        assert model.collective_seconds(kind, 4 << 20, 2) > model.collective_seconds(kind, 4 << 10, 2) > 0
    # a couple of seconds at most, on a loaded 2-core machine too
    assert max(s for _, s in results) < 6.0
