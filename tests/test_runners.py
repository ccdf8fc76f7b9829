"""The runner choice (NOTE [Runners] in sharded/modes/_runner.py): every mode takes
``compile=False | True | "auto"``; inductor's code gives the graph's results (on real
ranks, with the data-parallel collectives inside), "auto" switches at the same call on
every rank and only for programs big enough, a failed compile falls back to the graph,
and ``Lowered`` reports the compile times and the runner."""

from __future__ import annotations

import os

import pytest
import torch

from sharded import Mesh, P, gather, optim
from sharded.modes import DataParallelMode, DTensorExpandMode
from sharded.modes import _runner
from tests import test_data_parallel as dpm
from tests.requires import needs_cxx
from transforms import pjit


def _tiny(x):
    return torch.relu(x * 2 + 1).sum()


def _tiny2(x):        # another function: pjit's cache is per function
    return torch.relu(x * 2 + 1).sum()


def test_compile_choices_are_checked():
    for bad in ("yes", 1, 0, None):
        with pytest.raises(ValueError, match=r"DTensorExpandMode: compile must be False \(run the graph\), True"):
            DTensorExpandMode(compile=bad)
        with pytest.raises(ValueError, match=r"DataParallelMode: compile must be False"):
            DataParallelMode(compile=bad)
    # the choice is part of the program's identity
    assert DTensorExpandMode(compile=True).cache_key() != DTensorExpandMode().cache_key()
    assert DataParallelMode(compile=False).cache_key() != DataParallelMode().cache_key()


def test_auto_keeps_small_programs_as_graphs():
    mesh = Mesh((1,), ("dp",))
    f = pjit(_tiny, in_specs=P(), mesh=mesh)           # default: compile="auto"
    x = torch.randn(8)
    low = f.lower(x)
    assert _runner.compute_ops(low.local_graph) < _runner.compile_min_ops()
    runner = low._c.runner
    assert runner.state.next_check == -1               # never compiles
    for _ in range(3):
        torch.testing.assert_close(gather(f(x)), _tiny(x))
    assert low.runner() == "graph" and low.compile_times()["inductor"] is None
    times = low.compile_times()
    assert set(times) == {"trace", "partition", "passes", "inductor"}
    assert all(times[k] > 0 for k in ("trace", "partition", "passes"))


@needs_cxx
def test_compile_true_and_auto_switch(monkeypatch):
    """compile=True runs inductor from the first call; "auto" once the graph has run
    for SHARDED_COMPILE_BUDGET seconds, asked at calls FIRST_CHECK, 2 x FIRST_CHECK,
    ...; both equal the graph."""
    monkeypatch.setenv("SHARDED_COMPILE_BUDGET", "1e-9")
    monkeypatch.setenv("SHARDED_COMPILE_MIN_OPS", "0")
    monkeypatch.setattr(_runner, "FIRST_CHECK", 2)
    mesh = Mesh((1,), ("dp",))
    x = torch.randn(16)
    graph = pjit(_tiny2, in_specs=P(), mesh=mesh, mode=DTensorExpandMode(compile=False))
    eager = pjit(_tiny2, in_specs=P(), mesh=mesh, mode=DTensorExpandMode(compile=True))
    auto = pjit(_tiny2, in_specs=P(), mesh=mesh, mode=DTensorExpandMode(compile="auto"))
    want = gather(graph(x))
    kinds = []
    for _ in range(3):
        torch.testing.assert_close(gather(auto(x)), want)
        kinds.append(auto.lower(x).runner())
    assert kinds == ["graph", "graph", "inductor"]
    torch.testing.assert_close(gather(eager(x)), want)
    low = eager.lower(x)
    assert low.runner() == "inductor" and low.compile_times()["inductor"] > 0
    assert graph.lower(x).runner() == "graph"


def test_failed_compile_falls_back_to_the_graph(monkeypatch):
    def broken_compile(graph, example_inputs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(_runner._torch, "compile_ahead", broken_compile)
    mesh = Mesh((1,), ("dp",))
    f = pjit(lambda x: _tiny(x), in_specs=P(), mesh=mesh, mode=DTensorExpandMode(compile=True))
    x = torch.randn(8)
    with pytest.warns(UserWarning, match=r"pjit\(<lambda>\): inductor could not compile the "
                                         r"program, so it runs as a graph on every rank \(rank 0: "
                                         r"RuntimeError: no C\+\+ compiler\)"):
        out = f(x)
    torch.testing.assert_close(gather(out), _tiny(x))
    assert f.lower(x).runner() == "graph (compile failed)"
    torch.testing.assert_close(gather(f(x)), _tiny(x))       # no second warning needed


def _compile_fails_on_rank_1():
    """inductor fails on rank 1 only: the ranks agree on the outcome before anything
    runs, so both warn and run the graph (before the agreement, rank 0 ran inductor's
    code and rank 1 the graph)."""
    import warnings

    import torch.distributed as dist

    real = _runner._torch.compile_ahead

    def fails_on_rank_1(graph, example_inputs):
        if dist.get_rank() == 1:
            raise RuntimeError("the compiler was killed")
        return real(graph, example_inputs)

    _runner._torch.compile_ahead = fails_on_rank_1
    try:
        mesh = Mesh((2,), ("dp",))
        f = pjit(_tiny2, in_specs=P("dp"), mesh=mesh, mode=DTensorExpandMode(compile=True))
        x = torch.arange(16.0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            first = gather(f(x))
        second = gather(f(x))
        return ([str(w.message) for w in caught if "inductor" in str(w.message)],
                f.lower(x).runner(), first, second)
    finally:
        _runner._torch.compile_ahead = real


@needs_cxx
def test_a_compile_failing_on_one_rank_keeps_every_rank_on_the_graph(on_ranks):
    for messages, kind, first, second in on_ranks(2, _compile_fails_on_rank_1):
        assert kind == "graph (compile failed)"
        assert len(messages) == 1 and "runs as a graph on every rank (rank 1: RuntimeError: " \
            "the compiler was killed)" in messages[0], messages
        torch.testing.assert_close(first, _tiny2(torch.arange(16.0)))
        torch.testing.assert_close(second, first)


def _compiled_data_parallel_step():
    """On every rank: DataParallelMode("shard") with "auto": rank 0's budget is spent
    at once, rank 1's never, and both switch to inductor at the check at call 1 (the
    ranks decide together); every step equals the single-device step, with the
    gathers and reduce-scatters inside the compiled code."""
    import torch.distributed as dist

    os.environ["SHARDED_COMPILE_BUDGET"] = "1e-9" if dist.get_rank() == 0 else "1e9"
    first, _runner.FIRST_CHECK = _runner.FIRST_CHECK, 1
    try:
        mesh = Mesh((2,), ("dp",))
        # a function of its own: the pooled ranks keep each program's run state (how
        # long it has run as a graph), and test_data_parallel runs dpm.train_step's
        # program on this mesh first (this test then failed after it, on every tree)
        step = pjit(lambda *a: dpm.train_step(*a), in_specs=dpm._specs(False), mesh=mesh,
                    mode=DataParallelMode("shard"))
        params = dpm.init()
        opt = optim.adamw_init(params)
        ids, targets = dpm.batch()
        p, o, rp, ro = params, opt, params, opt
        kinds = []
        for _ in range(3):
            p, o, loss = step(p, o, ids, targets)
            rp, ro, ref_loss = dpm.train_step(rp, ro, ids, targets)
            torch.testing.assert_close(gather(loss), ref_loss, rtol=1e-5, atol=1e-5)
            kinds.append(step.lower(p, o, ids, targets).runner())
        torch.testing.assert_close(gather(p), rp, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(gather(o), ro, rtol=1e-4, atol=1e-6)
        kinds_collectives = {c.kind for c in step.lower(p, o, ids, targets).collectives()}
        return kinds, kinds_collectives
    finally:
        del os.environ["SHARDED_COMPILE_BUDGET"]
        _runner.FIRST_CHECK = first


@needs_cxx
def test_inductor_runs_the_data_parallel_program(on_ranks):
    for kinds, collectives in on_ranks(2, _compiled_data_parallel_step):
        assert kinds == ["graph", "inductor", "inductor"]
        assert {"all_gather", "reduce_scatter"} <= collectives, collectives


def _grad_loss(p, x):
    return (torch.tanh(x @ p["w"]) * p["b"]).pow(2).mean()


@needs_cxx
def test_inductor_runs_the_backward_program_too():
    """loss.backward() and torch.func.grad through a pjit'd loss with compile=True:
    the forward and the backward programs both run inductor's code and give the
    single-device gradients."""
    from sharded import shard

    mesh = Mesh((1,), ("dp",))
    g = torch.Generator().manual_seed(0)
    p = {"w": torch.randn(8, 8, generator=g), "b": torch.randn(8, generator=g)}
    x = torch.randn(4, 8, generator=g)
    ref = {k: v.clone().requires_grad_() for k, v in p.items()}
    _grad_loss(ref, x).backward()
    f = pjit(_grad_loss, in_specs=(P(), P()), out_specs=P(), mesh=mesh,
             mode=DTensorExpandMode(compile=True))
    dp = {k: v.requires_grad_() for k, v in shard({k: v.clone() for k, v in p.items()}, P(), mesh).items()}
    for _ in range(2):
        for v in dp.values():
            v.grad = None
        f(dp, x).backward()
        for k in p:
            torch.testing.assert_close(dp[k].grad.full_tensor(), ref[k].grad)
    low = f.lower(dp, x)
    assert low.runner() == "inductor" and low.backward.runner() == "inductor"
    times = low.backward.compile_times()
    assert times["partition"] > 0 and times["passes"] > 0 and times["inductor"] > 0
    grads = torch.func.grad(lambda q: f(q, x))(shard(p, P(), mesh))
    for k in p:
        torch.testing.assert_close(grads[k].full_tensor(), ref[k].grad)


def _evicted_and_rebuilt(tmp):
    """On every rank, with a cache of 1 program and "auto" switching at the second
    check: rank 0 alone evicts and rebuilds the program (it lowers another signature
    in between); its runner keeps the call count, so both ranks ask "compile now?" at
    the same calls and switch together (a reset count once desynchronised the
    decision's all-reduce from the agreement's: a hang)."""
    import torch.distributed as dist

    import importlib

    pjit_module = importlib.import_module("sharded._cache")

    first, _runner.FIRST_CHECK = _runner.FIRST_CHECK, 2
    size, pjit_module.CACHE_SIZE = pjit_module.CACHE_SIZE, 1
    os.environ["SHARDED_COMPILE_BUDGET"] = "1e-9"
    os.environ["SHARDED_COMPILE_MIN_OPS"] = "0"
    try:
        mesh = Mesh((2,), ("dp",))
        f = pjit(_evict_fn, in_specs=P("dp"), mesh=mesh)
        x, other = torch.arange(8.0), torch.arange(16.0)
        kinds = []
        for i in range(5):
            if i == 1 and dist.get_rank() == 0:
                f.lower(other)             # evicts x's program on rank 0 only
            torch.testing.assert_close(gather(f(x)), _evict_fn(x))
            kinds.append(f.lower(x).runner())
        return kinds
    finally:
        _runner.FIRST_CHECK, pjit_module.CACHE_SIZE = first, size
        del os.environ["SHARDED_COMPILE_BUDGET"], os.environ["SHARDED_COMPILE_MIN_OPS"]


def _evict_fn(x):
    return (x * 2 + 1).sum()


@needs_cxx
def test_a_rank_that_rebuilds_a_program_stays_in_step(on_ranks):
    kinds = on_ranks(2, _evicted_and_rebuilt, None)
    assert kinds[0] == kinds[1] == ["graph", "graph", "inductor", "inductor", "inductor"], kinds


@needs_cxx
def test_donated_adamw_step_compiles_with_inductor():
    """compile=True with donation: the fused AdamW stays functional for inductor (its
    in-place form on donated inputs does not compile in torch 2.13: the compile once
    failed and fell back to the graph), so the parameters are not updated in the
    donated storage; values equal the graph's. "auto" keeps the donated in-place
    program a graph."""
    import warnings

    mesh = Mesh((1,), ("dp",))
    params = dpm.init()
    ids, targets = dpm.batch()
    outs = {}
    for name, compile in (("graph", False), ("inductor", True)):
        step = pjit(dpm.train_step, in_specs=dpm._specs(False), mesh=mesh,
                    mode=DataParallelMode("replicate", compile=compile), donate_argnums=(0, 1))
        p = {k: v.clone() for k, v in params.items()}
        o = optim.adamw_init(p)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                p, o, loss = step(p, o, ids, targets)
        assert not [w for w in caught if "could not compile" in str(w.message)]
        outs[name] = (gather(p), gather(loss))
        low = step.lower(p, o, ids, targets)
        assert low.runner() == name
    torch.testing.assert_close(outs["inductor"], outs["graph"], rtol=1e-5, atol=1e-6)
    auto = pjit(dpm.train_step, in_specs=dpm._specs(False), mesh=mesh,
                mode=DataParallelMode("replicate"), donate_argnums=(0, 1))
    p = {k: v.clone() for k, v in params.items()}
    low = auto.lower(p, optim.adamw_init(p), ids, targets)
    assert low._c.runner.state.next_check == -1      # never compiles


def _tiny3(x):        # a program of its own in the pooled ranks' caches
    return torch.relu(x * 3 + 1).sum()


def _dies_while_compiling():
    import torch.distributed as dist

    real = _runner._torch.compile_ahead

    def dies_on_rank_1(graph, example_inputs):
        if dist.get_rank() == 1:
            os._exit(7)
        return real(graph, example_inputs)

    _runner._torch.compile_ahead = dies_on_rank_1
    try:
        f = pjit(_tiny3, in_specs=P("dp"), mesh=Mesh((2,), ("dp",)),
                 mode=DTensorExpandMode(compile=True))
        return gather(f(torch.arange(16.0)))
    finally:
        _runner._torch.compile_ahead = real


def test_a_rank_dying_while_compiling_stops_the_others(on_ranks):
    """The compile agreement waits for a slow compiler (SHARDED_COMPILE_TIMEOUT), but
    not for a dead rank: rank 0 ends with RankFailedError as soon as rank 1's
    connections close, and no rank is killed by the pool's grace timeout (120 s in
    tests: tests/conftest.py, patient_grace)."""
    from sharded.launch import RankError

    with pytest.raises(RankError) as info:
        on_ranks(2, _dies_while_compiling, timeout=300)
    text = str(info.value)
    assert "local rank 1 died (exit code 7)" in text, text
    assert "RankFailedError" in text and "while compiling its program" in text, text
    assert "killed ---" not in text, text
