"""The steady-state call (NOTE [The steady-state call] in sharded/_cache.py): a call
with the last call's signature and inputs in the planned layouts skips the full
signature, and anything that differs (shape, dtype, layout, mesh, static arguments,
tree structure, default dtype, autocast, requires_grad, donation, a program gone from
the cache) takes the full path and gives the single-device result.

Each test runs a few calls to arm the plan, then counts full-path calls by wrapping
``Arguments.signature`` of the pjit (the full path builds the signature; the steady
path does not)."""

from __future__ import annotations

import pytest
import torch

from sharded import Mesh, P, gather, shard
from transforms import pjit


@pytest.fixture
def mesh():
    return Mesh((1,), ("dp",))


def _count_full_path(f):
    calls = []
    full = f.arguments.signature

    def counted(*a, **k):
        calls.append(1)
        return full(*a, **k)

    f.arguments.signature = counted
    return calls


def _step(p, x):
    return {k: v * 0.5 + x.sum() for k, v in p.items()}


def _params(mesh):
    return {"a": shard(torch.arange(4.0), P(), mesh), "b": shard(torch.ones(2, 2), P(), mesh)}


def _armed(mesh, fn=_step, **kw):
    f = pjit(fn, in_specs=(P(), P("dp")), mesh=mesh, **kw)
    p = _params(mesh)
    x = torch.arange(6.0).reshape(3, 2)
    for _ in range(3):
        p = f(p, x)
    return f, p, x


def _want(p, x):
    return {k: gather(v) * 0.5 + x.sum() for k, v in p.items()}


def test_steady_calls_skip_the_full_path(mesh):
    f, p, x = _armed(mesh)
    full = _count_full_path(f)
    for _ in range(3):
        want = _want(p, x)
        p = f(p, x)
        torch.testing.assert_close(gather(p), want)
    assert full == []
    assert f.trace_count == 1


@pytest.mark.parametrize("change", ["shape", "dtype", "tree", "layout", "plain_for_dtensor",
                                    "global_shape"])
def test_a_different_input_takes_the_full_path(mesh, change):
    f, p, x = _armed(mesh)
    full = _count_full_path(f)
    if change == "shape":
        x = torch.arange(8.0).reshape(4, 2)
    elif change == "dtype":
        x = x.double()
    elif change == "tree":
        p = dict(p, c=shard(torch.zeros(3), P(), mesh))
    elif change == "layout":        # the same values, laid out otherwise: redistributed
        p = dict(p, b=shard(gather(p["b"]), P("dp"), mesh))
    elif change == "plain_for_dtensor":
        p = dict(p, a=gather(p["a"]))
    elif change == "global_shape":
        p = dict(p, a=shard(torch.arange(5.0), P(), mesh))
    want = {k: (gather(v) if isinstance(v, torch.distributed.tensor.DTensor) else v) * 0.5 + x.sum()
            for k, v in p.items()}
    out = f(p, x)
    torch.testing.assert_close(gather(out), want)
    assert len(full) == 1, change
    # ... and the next call with the same inputs is steady again
    f(out, x)
    assert len(full) == 2 if change in ("layout", "plain_for_dtensor") else len(full) == 1


def test_static_arguments_mesh_and_ambient_state(mesh):
    def scaled(p, x, k):
        return {n: v * k + torch.ones(()) for n, v in p.items()}, x.sum()

    f = pjit(scaled, in_specs=(P(), P("dp")), static_argnums=(2,))
    p, x = _params(mesh), torch.ones(2, 2)
    with mesh:
        for _ in range(3):
            p, _ = f(p, x, 2.0)
        full = _count_full_path(f)
        ref = gather(p)
        out, _ = f(p, x, 3.0)                       # another static value
        torch.testing.assert_close(gather(out), {n: v * 3.0 + 1 for n, v in ref.items()})
        assert len(full) == 1
        out, _ = f(p, x, 3)                         # 3 == 3.0, but another type
        assert len(full) == 2
        f(p, x, 3)
        assert len(full) == 2                       # steady
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)      # torch.ones(()) is traced anew
        try:
            out, _ = f(p, x, 3)
        finally:
            torch.set_default_dtype(previous)
        assert len(full) == 3
        with torch.autocast("cpu", dtype=torch.bfloat16):
            f(p, x, 3)
        assert len(full) == 4
    other = Mesh((1,), ("dp",))                     # another mesh object
    with other:
        p2 = {n: shard(gather(v), P(), other) for n, v in p.items()}
        f(p2, x, 3)
    assert len(full) == 5


class _Scale:
    """A static argument whose == raises for another value (hashes differ, so the
    full path's dict lookup never calls it)."""

    def __init__(self, k):
        self.k = k

    def __hash__(self):
        return hash(self.k)

    def __eq__(self, other):
        if self.k != other.k:
            raise TypeError("cannot compare scales")
        return True

    def __repr__(self):
        return f"_Scale({self.k})"


def test_a_static_value_that_cannot_be_compared_takes_the_full_path(mesh):
    f = pjit(lambda x, s: x * s.k, in_specs=(P("dp"),), static_argnums=(1,), mesh=mesh)
    x = torch.ones(2)
    for _ in range(3):
        f(x, _Scale(2.0))
    full = _count_full_path(f)
    torch.testing.assert_close(gather(f(x, _Scale(3.0))), torch.full((2,), 3.0))
    assert len(full) == 1


def test_requires_grad_and_donation_take_the_full_path(mesh):
    f, p, x = _armed(mesh)
    full = _count_full_path(f)
    w = p["a"].detach().requires_grad_()
    out = f(dict(p, a=w), x)
    assert len(full) == 1 and out["a"].requires_grad     # the differentiable path
    out["a"].sum().backward()
    torch.testing.assert_close(gather(w.grad), torch.full((4,), 0.5))

    g = pjit(_step, in_specs=(P(), P("dp")), mesh=mesh, donate_argnums=(0,))
    q = _params(mesh)
    for _ in range(3):
        q = g(q, x)
    full = _count_full_path(g)
    consumed = q
    q = g(q, x)
    assert full == []
    with pytest.raises(RuntimeError, match=r"cannot be used: .*donated"):
        g(consumed, x)                              # a donated input is refused
    assert len(full) == 1


def test_a_program_gone_from_the_cache_takes_the_full_path(mesh, monkeypatch):
    f, p, x = _armed(mesh)
    full = _count_full_path(f)
    f._cache.table().programs.clear()
    out = f(p, x)
    torch.testing.assert_close(gather(out), _want(p, x))
    assert len(full) == 1 and f.trace_count == 2


def _layout_change_on_two_ranks():
    """After steady calls, an input laid out otherwise (the same global values) is
    redistributed by the full path; every call equals the single-device result."""
    mesh = Mesh((2,), ("dp",))
    f = pjit(_step, in_specs=(P(), P("dp")), mesh=mesh)
    p = {"a": shard(torch.arange(4.0), P(), mesh), "b": shard(torch.ones(2, 2), P(), mesh)}
    x = shard(torch.arange(8.0).reshape(4, 2), P("dp"), mesh)
    whole = gather(x)
    outs = []
    for i in range(5):
        want = {k: gather(v) * 0.5 + whole.sum() for k, v in p.items()}
        if i == 3:
            p = dict(p, a=shard(gather(p["a"]), P("dp"), mesh))
        p = f(p, x)
        outs.append((gather(p), want))
    return outs


def test_layout_change_on_two_ranks(on_ranks):
    for outs in on_ranks(2, _layout_change_on_two_ranks):
        for got, want in outs:
            torch.testing.assert_close(got, want)
