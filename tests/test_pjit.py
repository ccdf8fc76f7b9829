"""pjit behaviour on real ranks: caching, static args, layouts in and out, pytrees,
vmap, sharding constraints, the Megatron collective count, and cross-rank checks."""

import os
import traceback
import re
from collections import namedtuple

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from sharded import Mesh, P, gather, shard, spec_of, with_sharding_constraint
from sharded.modes import DTensorExpandMode
from sharded.sync import RankFailedError, RankMismatchError
from tests.models import MLP_SHAPES, MLP_TP, init, mlp, specs_of
from transforms import pjit

Batch = namedtuple("Batch", ["x", "y"])


# -- rank-side bodies ------------------------------------------------------------------

def _cache_and_static():
    mesh = Mesh((2,), ("dp",))
    calls = []

    def f(x, cfg, n):
        calls.append(1)
        return x * cfg["scale"] + n

    g = pjit(f, in_specs=(P("dp"), None), static_argnums=(2,), mesh=mesh)
    x = torch.arange(8.0).reshape(4, 2)
    torch.testing.assert_close(gather(g(x, {"scale": 2.0}, 1)), x * 2 + 1)
    g(x, {"scale": 2.0}, 1)
    assert g.trace_count == 1 and len(calls) == 1, "same signature must not trace again"
    torch.testing.assert_close(gather(g(x, {"scale": 2.0}, 5)), x * 2 + 5)
    torch.testing.assert_close(gather(g(x, {"scale": 3.0}, 5)), x * 3 + 5)
    torch.testing.assert_close(gather(g(torch.ones(6, 2), {"scale": 3.0}, 5)), torch.full((6, 2), 8.0))
    assert g.trace_count == 4


def _layouts_in_and_out():
    mesh = Mesh((2,), ("dp",))
    torch.manual_seed(0)  # plain tensors must hold the same global value on every rank
    x = torch.randn(4, 6)

    def f(x, w):
        return x * 2, x.sum(), x @ w

    w = torch.randn(6, 4)
    g = pjit(f, in_specs=(P("dp"), P(None, "dp")), mesh=mesh)
    # DTensor input laid out differently from in_specs: resharded on the way in.
    xd = shard(x, P(None, "dp"), mesh)
    for arg in (x, xd):
        a, s, m = g(arg, w)
        assert isinstance(a, DTensor)
        assert spec_of(a) == P("dp"), spec_of(a)        # propagated layout
        assert spec_of(s) == P()                         # pending sum reduced
        torch.testing.assert_close(gather(a), x * 2)
        torch.testing.assert_close(gather(s), x.sum())
        torch.testing.assert_close(gather(m), x @ w)
    # out_specs force layouts; a pytree prefix works.
    h = pjit(f, in_specs=(P("dp"), P()), out_specs=(P(None, "dp"), P(), P()), mesh=mesh)
    a, s, m = h(x, w)
    assert spec_of(a) == P(None, "dp") and spec_of(m) == P()
    torch.testing.assert_close(gather(m), x @ w)


def _unspecified_per_output_and_strided_inputs():
    from transforms import UNSPECIFIED

    mesh = Mesh((2,), ("dp",))
    x = torch.arange(24.0).reshape(4, 6)
    f = pjit(lambda x: (x * 2, x.sum(0)), in_specs=P("dp"), out_specs=(UNSPECIFIED, P()), mesh=mesh)
    a, b = f(x)
    assert spec_of(a) == P("dp") and spec_of(b) == P()
    # A cache hit with a non-contiguous DTensor (same shape, other strides).
    g = pjit(lambda x: x.reshape(-1), in_specs=P(), mesh=mesh)
    g(x)
    t = shard(torch.arange(24.0).reshape(6, 4), P(), mesh).T
    torch.testing.assert_close(gather(g(t)), torch.arange(24.0).reshape(6, 4).T.reshape(-1))


def _pytrees_and_vmap():
    mesh = Mesh((2,), ("dp",))
    torch.manual_seed(0)
    p = init(0, MLP_SHAPES)
    b = Batch(torch.randn(8, 8), torch.randint(0, 4, (8,)))

    def per_example_grads(p, batch):
        def loss(p, x, y):
            return F.cross_entropy(mlp(p, x[None]), y[None])

        return torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(p, batch.x, batch.y)

    g = pjit(per_example_grads, in_specs=(P(), Batch(P("dp"), P("dp"))), mesh=mesh)
    out = g(p, b)
    assert spec_of(out["w1"]) == P("dp")
    torch.testing.assert_close(gather(out), per_example_grads(p, b), rtol=1e-5, atol=1e-5)


def _sharding_constraint():
    mesh = Mesh((2,), ("dp",))
    torch.manual_seed(0)
    x = torch.randn(4, 4)

    def f(x):
        y = torch.sin(x)
        y = with_sharding_constraint(y, P())      # force a gather here
        return y.T @ y

    g = pjit(f, in_specs=P("dp"), mesh=mesh)
    lowered = g.lower(x)
    kinds = [c.kind for c in lowered.collectives()]
    assert kinds == ["all_gather"], kinds
    torch.testing.assert_close(gather(g(x)), f(x))
    # Eagerly, on a DTensor, it redistributes.
    assert spec_of(with_sharding_constraint(shard(x, P("dp"), mesh), P(None, "dp"))) == P(None, "dp")

    # Under torch.func.grad the constraint is differentiable (identity).
    def loss(x):
        return with_sharding_constraint(torch.sin(x), P()).pow(2).sum()

    gg = pjit(torch.func.grad(loss), in_specs=P("dp"), mesh=mesh)
    torch.testing.assert_close(gather(gg(x)), torch.func.grad(lambda x: torch.sin(x).pow(2).sum())(x))


def _megatron_collectives(ws):
    mesh = Mesh((ws,), ("tp",))
    torch.manual_seed(0)
    p, x = init(0, MLP_SHAPES), torch.randn(8, 8)
    specs = specs_of(MLP_TP)

    def step(p, x):
        (gp, gx), loss = torch.func.grad_and_value(
            lambda p, x: mlp(p, x).pow(2).sum(), argnums=(0, 1))(p, x)
        return gp, gx, loss

    lowered = pjit(step, in_specs=(specs, P()), out_specs=(specs, P(), P()), mesh=mesh).lower(p, x)
    cost = lowered.cost()
    text = lowered.as_text()
    calls = [str(c) for c in lowered.collectives()]
    return cost, calls, "all_reduce" in text and "over 'tp'" in text


def _mismatched_shapes():
    mesh = Mesh((2,), ("dp",))
    n = 4 if mesh.rank == 0 else 8         # rank 1 is given another batch size
    g = pjit(lambda x: x.sum(), in_specs=P("dp"), mesh=mesh)
    try:
        g(torch.ones(n, 2))
    except RankMismatchError as e:
        return str(e)
    return "no error"


def _one_rank_fails():
    mesh = Mesh((2,), ("dp",))
    n = 4 if mesh.rank == 0 else 5         # not divisible on rank 1 only
    g = pjit(lambda x: x * 2, in_specs=P("dp"), mesh=mesh)
    try:
        g(torch.ones(n, 2))
    except (RankFailedError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _disagree_in_the_steady_state(donate: bool):
    """NOTE [The agreement overlaps the program]: three good calls (from the second on
    the steady path, the agreement checked inside the program), then rank 1 calls with
    another static scale: both ranks raise RankMismatchError at the program's
    agreement point, before any collective, and the next good calls still run (the
    process groups were left open), with the right result. The runner's compile
    checks (all-reduces at its calls 1, 2, 4, 8, ...; asked here with a budget never
    reached) stay in step: the stopped call was no run on either rank. Donated: the
    stopped call wrote nothing and the inputs stay usable."""
    os.environ["SHARDED_COMPILE_MIN_OPS"], os.environ["SHARDED_COMPILE_BUDGET"] = "0", "1e9"
    try:
        mesh = Mesh((2,), ("dp",))
        g = pjit(lambda x, s: x * s + 1, in_specs=P("dp"), mesh=mesh, static_argnums=1,
                 donate_argnums=(0,) if donate else (), mode=DTensorExpandMode(compile="auto"))
        x = shard(torch.arange(8.0).reshape(4, 2), P("dp"), mesh)
        out = []
        for _ in range(3):                  # (the runner asks at calls 1 and 2, not 3)
            x = g(x, 2.0)
        out.append(gather(x).sum().item())
        try:
            g(x, 3.0 if mesh.rank == 1 else 2.0)
            out.append("no error")
        except RankMismatchError as e:
            # (raised at the program's agreement point, inside the program, not before
            # the call: sync.agreed is in the traceback, called by the program's code)
            frames = traceback.extract_tb(e.__traceback__)
            at_point = any(f.name == "agreed" for f in frames) and any(
                f.name == "forward" and "eval_with_key" in f.filename for f in frames)
            out.append(str(e).splitlines()[0] + f" agreement={at_point}")
        for _ in range(6):                  # past the compile checks at calls 4 and 8
            x = g(x, 2.0)
        out.append(gather(x).sum().item())
        # before the agreement point: no collective and no in-place write (donated,
        # x * 2 + 1 runs in x's storage: mul_, add_)
        lines = g.lower(x, 2.0).as_text().splitlines()
        point = next(i for i, line in enumerate(lines) if "agreed" in line)
        inplace = [i for i, line in enumerate(lines) if re.search(r"aten\.\w+_\.", line)]
        out.append(not any("_c10d_functional" in line for line in lines[:point])
                   and bool(inplace) == donate and all(point < i for i in inplace))
        return out
    finally:
        del os.environ["SHARDED_COMPILE_MIN_OPS"], os.environ["SHARDED_COMPILE_BUDGET"]


def _dp_adamw_bucketed():
    from sharded import optim

    mesh = Mesh((2,), ("dp",))
    torch.manual_seed(0)
    p = init(0, MLP_SHAPES)
    x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))

    def step(p, opt, x, y):
        g, loss = torch.func.grad_and_value(lambda p: F.cross_entropy(mlp(p, x), y))(p)
        p, opt = optim.adamw(p, g, opt, lr=1e-2)
        return p, opt, loss

    opt = optim.adamw_init(p)
    ospec = {"step": P(), "m": P(), "v": P()}
    f = pjit(step, in_specs=(P(), ospec, P("dp"), P("dp")), mesh=mesh)
    out = f(p, opt, x, y)
    torch.testing.assert_close(gather(out), step(p, opt, x, y), rtol=1e-5, atol=1e-5)
    lowered = f.lower(p, opt, x, y)
    code = [n for n in lowered.local_graph.graph.nodes]
    grad_buckets = [c for c in lowered.collectives() if c.shape and c.shape[0] > 1]
    ar = next(n for n in code if n.name == grad_buckets[0].node)
    wait = next(iter(ar.users))
    return ([str(c) for c in lowered.collectives()], sum(v.numel() for v in p.values()),
            code.index(wait) - code.index(ar))


def _no_collectives_over_size_1_axes():
    mesh = Mesh((1, 2), ("dp", "tp"))
    torch.manual_seed(0)
    p, x, y = init(0, MLP_SHAPES), torch.randn(8, 8), torch.randint(0, 4, (8,))
    specs = specs_of(MLP_TP)

    def step(p, x, y):
        return torch.func.grad_and_value(lambda p: F.cross_entropy(mlp(p, x), y))(p)

    f = pjit(step, in_specs=(specs, P("dp"), P("dp")), out_specs=(specs, P()), mesh=mesh)
    torch.testing.assert_close(gather(f(p, x, y)), step(p, x, y), rtol=1e-5, atol=1e-5)
    return [c.axis for c in f.lower(p, x, y).collectives()]


def _review_regressions():
    mesh = Mesh((2,), ("dp",))
    g = torch.Generator().manual_seed(0)
    w, ids = torch.randn(8, 4, generator=g), torch.tensor([0, 5, 7, 2])
    # A row-sharded embedding's masked partial is reduced before any other op.
    for f in (lambda w, ids: F.embedding(ids, w).t(), lambda w, ids: F.embedding(ids, w).sum()):
        out = pjit(f, in_specs=(P("dp"), P()), mesh=mesh)(w, ids)
        torch.testing.assert_close(gather(out), f(w, ids))
    # Static values that compare equal but differ in type trace separately.
    h = pjit(lambda x, s: x * s, in_specs=(P(), None), mesh=mesh)
    xi = torch.arange(4)
    assert h(xi, 1).dtype == torch.int64 and h(xi, 1.0).dtype == torch.float32
    # A DTensor from another mesh is an error on a cache hit too.
    other = Mesh((2,), ("tp",))
    k = pjit(lambda x: x + 1, in_specs=P(), mesh=mesh)
    k(shard(xi, P(), mesh))
    try:
        k(shard(xi, P(), other))
        raise AssertionError("no error")
    except ValueError as e:
        assert "not on the pjit mesh" in str(e), e
    # Nested pjit is a clear error.
    inner = pjit(lambda x: x * 2, in_specs=P(), mesh=mesh)
    try:
        pjit(lambda x: inner(x) + 1, in_specs=P(), mesh=mesh)(torch.ones(2))
        raise AssertionError("no error")
    except NotImplementedError as e:
        assert "nested pjit is not supported" in str(e), e
    # A constraint on a tensor made inside the function (not derived from an input).
    c = pjit(lambda x: x + with_sharding_constraint(torch.ones(4, 2), P("dp")), in_specs=P(), mesh=mesh)
    torch.testing.assert_close(gather(c(torch.zeros(4, 2))), torch.ones(4, 2))


# -- tests -------------------------------------------------------------------------------

def test_traces_once_per_signature_and_static_args(on_ranks):
    on_ranks(2, _cache_and_static)


def test_input_resharding_and_output_layouts(on_ranks):
    on_ranks(2, _layouts_in_and_out)


def test_unspecified_per_output_and_strided_inputs(on_ranks):
    on_ranks(2, _unspecified_per_output_and_strided_inputs)


def test_namedtuple_specs_and_vmap_of_grad(on_ranks):
    on_ranks(2, _pytrees_and_vmap)


def test_with_sharding_constraint(on_ranks):
    on_ranks(2, _sharding_constraint)


@pytest.mark.parametrize("ws", [2, 4])
def test_megatron_mlp_has_one_all_reduce_forward_one_backward(on_ranks, ws):
    cost, calls, annotated = on_ranks(ws, _megatron_collectives, ws)[0]
    assert cost["all_reduce"]["count"] == 2, calls
    assert cost["total"]["count"] == 2, calls
    # forward: the [8, 4] output; backward: the [8, 8] input gradient.
    assert calls == ["all_reduce sum float32[8, 4] over 'tp'", "all_reduce sum float32[8, 8] over 'tp'"]
    assert annotated


def test_ranks_with_different_shapes_error_instead_of_hanging(on_ranks):
    msgs = on_ranks(2, _mismatched_shapes)
    for m in msgs:
        assert "ranks called it with different arguments or built different programs" in m, m
        assert "rank 1 differs from rank 0" in m and "[4, 2]" in m and "[8, 2]" in m, m


def test_one_rank_failing_to_compile_stops_all(on_ranks):
    r0, r1 = on_ranks(2, _one_rank_fails)
    assert r1.startswith("ValueError") and "does not divide" in r1, r1
    assert r0.startswith("RankFailedError") and "rank 1 failed to build its program" in r0, r0


@pytest.mark.parametrize("donate", [False, True])
def test_a_disagreement_in_the_steady_state_stops_every_rank_before_communicating(on_ranks, donate):
    # x = arange(8): n steps of x * 2 + 1 give 2**n x + 2**n - 1: three sum to
    # 8 * 28 + 7 * 8, nine to 512 * 28 + 511 * 8
    for r in on_ranks(2, _disagree_in_the_steady_state, donate):
        assert r[0] == 8 * 28 + 7 * 8, r
        assert "ranks called it with different arguments or built different programs" in r[1], r
        assert r[1].endswith("agreement=True"), r
        assert r[2:] == [512 * 28 + 511 * 8, True], r


def test_data_parallel_gradients_are_bucketed_and_overlapped(on_ranks):
    calls, n_params, wait_distance = on_ranks(2, _dp_adamw_bucketed)[0]
    # One all-reduce carries every gradient (and the loss's pending sum, which the
    # backward does not read; the other is the count of the loss's targets).
    assert f"all_reduce sum float32[{n_params + 1}] over 'dp'" in calls, calls
    assert len(calls) <= 3, calls
    # Its wait is sunk below compute that does not need it (overlap).
    assert wait_distance > 1, wait_distance


def test_collectives_over_size_1_axes_are_dropped(on_ranks):
    axes = on_ranks(2, _no_collectives_over_size_1_axes)[0]
    assert axes and set(axes) == {"tp"}, axes


def test_review_regressions(on_ranks):
    on_ranks(2, _review_regressions)


# -- the program cache (single process, a mesh of one rank) ----------------------------------

@pytest.fixture(scope="module")
def mesh1():
    return Mesh((1,), ("dp",))


_TRACES = []


def _traced_once(x):
    _TRACES.append(1)
    return x * 2


class _Model:
    def __init__(self):
        self.traces = 0

    def step(self, x):
        self.traces += 1
        return x + 1


def test_pjit_in_a_loop_traces_once(mesh1):
    # The cache is keyed on the function (weakly) and the configuration, not on the
    # object pjit returns (as JAX's).
    _TRACES.clear()
    x = torch.ones(4)
    for _ in range(3):
        pjit(_traced_once, in_specs=P(), mesh=mesh1)(x)
    assert len(_TRACES) == 1
    pjit(_traced_once, in_specs=P("dp"), mesh=mesh1)(x)          # another configuration
    pjit(_traced_once, in_specs=P(), out_specs=P(), mesh=mesh1)(x)
    assert len(_TRACES) == 3
    m = _Model()
    for _ in range(3):
        torch.testing.assert_close(gather(pjit(m.step, in_specs=P(), mesh=mesh1)(x)), x + 1)
    assert m.traces == 1                                         # bound methods too
    # another instance's method is another function (its self is an input of the
    # trace): traced once for itself, not served the first instance's program
    m2 = _Model()
    for _ in range(2):
        pjit(m2.step, in_specs=P(), mesh=mesh1)(x)
    assert (m.traces, m2.traces) == (1, 1)


def test_the_trace_takes_its_fake_inputs_as_they_are(monkeypatch):
    """The trace runs on the fake inputs pjit made (``_torch.trace_on_fakes``), as
    AOTAutograd does: make_fx(tracing_mode="fake") converted each into a fake of a
    mode of its own (375 inputs in a GPT-2-small train step). What the later steps
    read of the trace holds: the placeholders' shapes, the stack traces naming the
    user's line, a closed-over tensor as a constant and a factory's op."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    converted = []
    from_tensor = FakeTensorMode.from_tensor

    def counted(self, t, *a, **kw):
        if isinstance(t, FakeTensor):
            converted.append(tuple(t.shape))
        return from_tensor(self, t, *a, **kw)

    monkeypatch.setattr(FakeTensorMode, "from_tensor", counted)
    bias = torch.arange(6.0)

    def f(x, w, b):
        return torch.tanh(x @ w + b) + bias + torch.ones(6)

    mesh = Mesh.abstract((2,), ("tp",))
    low = pjit(f, in_specs=(P(), P(None, "tp"), P("tp")), mesh=mesh).lower(
        torch.randn(3, 4), torch.randn(4, 6), torch.randn(6))
    assert converted == []
    g = low.global_graph.graph
    assert [n.meta["val"].shape for n in g.find_nodes(op="placeholder")][:3] == [(3, 4), (4, 6), (6,)]
    mm = next(n for n in g.nodes if n.target is torch.ops.aten.mm.default)
    assert "return torch.tanh(x @ w + b)" in mm.meta["stack_trace"]
    assert g.find_nodes(op="get_attr")            # ``bias``, a constant of the program
    assert any(n.target is torch.ops.aten.ones.default for n in g.nodes)


def test_the_traces_values_are_make_fxs(monkeypatch):
    """NOTE [A traced value as the op made it]: each node of the trace holds the fake
    its op made (make_fx stores a detached copy of each, and a TensorMetadata), and
    the values say what make_fx's copies say (shape, strides, offset, dtype, gradient
    flag) for every node: a multi-output op's tuple, a torch.func.grad's backward, a
    constant, factories (no ``detach`` of theirs more than make_fx's), a joint
    program's forward values (without autograd's history). A function that changes a
    value's shape in place (``y.t_()``) is traced again under functionalize, and says
    the same as well."""
    from sharded import _torch
    from torch.fx.experimental import proxy_tensor

    set_meta = proxy_tensor.set_meta
    bias = torch.arange(6.0)

    def f(x, w, b):
        h = F.layer_norm(x @ w, (6,)) + bias + torch.ones(6) + torch.zeros_like(b) + torch.full_like(b, 2)
        g = torch.func.grad(lambda w: torch.tanh(x @ w).sum())(w)
        return h.t().sum(0), g.view(-1) * b.sum()

    def g(x, w, b):
        y = x @ w
        y.t_()
        return y.unsqueeze(0) + b.view(6, 1)

    def values(gm):
        return [(n.name, str(n.target), tuple(v.shape), v.stride(), v.storage_offset(), v.dtype,
                 v.requires_grad)
                for n in gm.graph.nodes if n.op != "output"
                for v in (n.meta["val"] if isinstance(n.meta["val"], (tuple, list)) else [n.meta["val"]])
                if isinstance(v, torch.Tensor)]

    args = (torch.randn(3, 4), torch.randn(4, 6), torch.randn(6))
    mesh = Mesh.abstract((2,), ("tp",))
    def joint(x, w, b):          # (lowered on a w that requires grad: the joint program)
        return torch.tanh(x @ w).sum(0) * b

    grad_args = (args[0], args[1].clone().requires_grad_(), args[2])
    lower = {fn: (lambda fn=fn: pjit(lambda *a: fn(*a), in_specs=(P(), P(None, "tp"), P("tp")),
                                     mesh=mesh).lower(*(grad_args if fn is joint else args)).global_graph)
             for fn in (f, g, joint)}
    ours = {fn: lower[fn]() for fn in (f, g, joint)}
    assert any(n.op == "call_function" for n in ours[joint].graph.nodes)
    assert not [n for n in ours[joint].graph.nodes
                if isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].requires_grad]
    assert proxy_tensor.set_meta is set_meta
    ln = next(n for n in ours[f].graph.nodes if n.target is torch.ops.aten.native_layer_norm.default)
    assert isinstance(ln.meta["val"], tuple) and len(ln.meta["val"]) == 3
    assert not [n for n in ours[f].graph.nodes if n.op == "call_function" and "tensor_meta" in n.meta
                and not _torch._factory(n.target)]
    assert not [n for n in ours[g].graph.nodes if n.op == "call_function" and n.target._schema.is_mutable]
    monkeypatch.setattr(_torch, "_as_made", lambda val: False)       # make_fx's copies
    for fn in (f, g, joint):
        assert values(ours[fn]) == values(lower[fn]()), fn.__name__


def test_cache_key_has_the_default_dtype_and_autocast(mesh1):
    f = pjit(lambda x: x + torch.ones(2), in_specs=P(), mesh=mesh1)
    assert f(torch.ones(2)).dtype == torch.float32
    saved = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert f(torch.ones(2, dtype=torch.float32)).dtype == torch.float64
    finally:
        torch.set_default_dtype(saved)
    assert f.trace_count == 2
    g = pjit(lambda a, b: a @ b, in_specs=P(), mesh=mesh1)
    a = torch.ones(2, 2)
    assert g(a, a).dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert g(a, a).dtype == torch.bfloat16
    assert g(a, a).dtype == torch.float32 and g.trace_count == 2   # the float32 program again


class _Cfg:
    def __init__(self, scale, names):
        self.scale, self.names = scale, names


def test_static_args_enter_the_digest_stably():
    from sharded._fingerprint import stable_repr

    a, b = _Cfg(2.0, ("x",)), _Cfg(2.0, ("x",))
    assert repr(a) != repr(b)                          # default reprs carry the address
    assert stable_repr(a) == stable_repr(b) and "0x" not in stable_repr(a)
    assert stable_repr(_Cfg(3.0, ("x",))) != stable_repr(a)
    long_a, long_b = tuple(range(300)) + (1,), tuple(range(300)) + (2,)
    assert stable_repr(long_a) != stable_repr(long_b)  # not cut at 200 characters
    assert stable_repr(torch.device("cpu")) == stable_repr(torch.device("cpu", 0))


def _compile_many(mesh, n):
    def f(x):
        return x * 2
    g = pjit(f, in_specs=P(), mesh=mesh)
    for i in range(1, n + 1):
        g(torch.ones(i))
    return f


def test_a_thousand_compiles_do_not_grow_memory(mesh1, monkeypatch):
    import gc
    import linecache
    import sys
    import tracemalloc

    from torch.distributed.device_mesh import init_device_mesh
    from torch.fx.graph_module import _loader
    from torch._subclasses.fake_tensor import FakeTensorMode

    import sharded.mesh
    from sharded import _torch
    from sharded.api import constraint_spec

    pj = sys.modules["sharded._cache"]
    monkeypatch.setattr(pj, "CACHE_SIZE", 16)
    monkeypatch.setattr(_torch, "_CACHE_LIMIT", 1024)
    _compile_many(mesh1, 50)                           # warm up
    gc.collect()
    sources, lines = len(_loader.eval_cache), len(linecache.cache)
    f = _compile_many(mesh1, 250)                      # one function, 250 shapes

    def fresh_functions(n):
        for k in range(n):
            pjit(lambda x: x * 2 + k, in_specs=P(), mesh=mesh1)(torch.ones(3))

    fresh_functions(400)
    gc.collect()
    tracemalloc.start()
    start = tracemalloc.get_traced_memory()[0]
    fresh_functions(300)                               # 1,000 compiles in all
    gc.collect()
    growth = tracemalloc.get_traced_memory()[0] - start
    tracemalloc.stop()
    assert len(pj._TABLES[f].programs) == 16           # an LRU per function
    assert len(_loader.eval_cache) - sources <= 2 * 16 + 2, "torch.fx kept generated sources"
    assert len(linecache.cache) - lines <= 2 * 16 + 2
    # a program's global graph generates its code when read (NOTE [Code generated
    # once]); its source goes with the program all the same
    sources, lines = len(_loader.eval_cache), len(linecache.cache)
    for k in range(100):
        low = pjit(lambda x: x * 3 + k, in_specs=P(), mesh=mesh1).lower(torch.ones(3))
        assert "mul" in low.global_graph.code
    del low
    gc.collect()
    assert len(_loader.eval_cache) - sources <= 2, "a lazily generated source was kept"
    assert len(linecache.cache) - lines <= 2
    assert len(FakeTensorMode.cache) <= 1024
    # A program kept per compile would cost ~60 KB each (18 MB for these 300); what
    # remains is torch's own tables (interned names, dispatch caches up to their
    # limit), which may resize once (~4 MB).
    assert growth < 8e6, f"{growth / 1e6:.1f} MB more after the last 300 compiles"
    # meshes over user DeviceMeshes live as long as the DeviceMesh
    for _ in range(50):
        sharded.Mesh.from_device_mesh(init_device_mesh("cpu", (1,), mesh_dim_names=("dp",)))
    gc.collect()
    assert len(sharded.mesh._FROM_DM) <= 1
    assert constraint_spec.cache_info().maxsize == 256  # the constraint's spec is text, no table


def test_threads_share_the_cache_safely(mesh1):
    import threading

    f = pjit(lambda x: x * 3, in_specs=P(), mesh=mesh1)
    errors = []

    def work(k):
        try:
            for i in range(1, 9):
                torch.testing.assert_close(gather(f(torch.ones(i) * k)), torch.ones(i) * 3 * k)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert f.trace_count == 8                          # one trace per shape, whichever thread


def test_argnums_and_argnames_must_be_ints_and_strs():
    """The shared normalisation of static/donate argnums and argnames names the option
    and the bad value."""
    f = lambda x, y: x  # noqa: E731
    with pytest.raises(TypeError, match=r"pjit\(<lambda>\): static_argnums must be an int or a sequence of ints; got 1\.5\."):
        pjit(f, in_specs=P(), static_argnums=1.5)
    with pytest.raises(TypeError, match=r"donate_argnums must be ints; got True in \(True,\)"):
        pjit(f, in_specs=P(), donate_argnums=(True,))
    with pytest.raises(TypeError, match=r"static_argnames must be a str or a sequence of str; got 3\."):
        pjit(f, in_specs=P(), static_argnames=3)
