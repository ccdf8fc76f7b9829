"""A catalogue of bad or unusual inputs and faults, on real gloo ranks.

Each case runs on every rank (2 ranks on a ("dp",) mesh, a few on 4 ranks on a
("dp", "tp") mesh) and asserts what a user should get: the correct result, or a clear
error on every rank (its type, and a message that names the API, the argument's path
and the fix). Cases run in batches, one rank call per batch, each case catching its
own outcome; a hang would be cut by the batch's timeout, and a wrong result fails its
own check. Cases that close the process groups (a failure while a program runs) run
last, one per call.
"""

from __future__ import annotations

import collections
import dataclasses
import re
import time

import einops
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from sharded import Mesh, P, gather, shard, spec_of
from sharded import collectives as C
from sharded import random as srandom
from sharded._tree import register_dataclass
from sharded.modes import DTensorExpandMode
from tests.test_errors import _no_rule  # a custom op without a sharding rule
from transforms import UNSPECIFIED, pjit, shard_map


def _mesh():
    return Mesh((2,), ("dp",))


def _rank():
    return dist.get_rank()


def _x():
    return torch.arange(8.0).reshape(4, 2)


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@dataclasses.dataclass(frozen=True)
class Batch:
    x: torch.Tensor
    y: torch.Tensor


@register_dataclass
@dataclasses.dataclass(frozen=True)
class RegBatch:
    x: torch.Tensor
    y: torch.Tensor


@dataclasses.dataclass
class Out:
    a: torch.Tensor


class MyDict(dict):
    pass


class ModelOutput(collections.OrderedDict):
    """Like a HuggingFace ModelOutput: an OrderedDict subclass."""


class Holder:
    def __init__(self, t):
        self.t = t


class Cfg:                       # default repr: its address differs on every rank
    def __init__(self, scale):
        self.scale = scale


# -- cases: in_specs and out_specs --------------------------------------------------------

def c_spec_dict_keys():
    f = pjit(lambda p, x: p["w"] @ x, in_specs=({"w": P(), "b": P()}, P()), mesh=_mesh())
    return f({"w": torch.ones(2, 2)}, torch.ones(2))


def c_spec_container_for_tensor():
    return pjit(lambda p: p["w"], in_specs=({"w": {"a": P()}},), mesh=_mesh())({"w": torch.ones(2)})


def c_spec_count():
    return pjit(lambda a, b: a + b, in_specs=(P(),), mesh=_mesh())(torch.ones(2), torch.ones(2))


def c_spec_string():
    return pjit(lambda x: x, in_specs=("dp",), mesh=_mesh())(torch.ones(2))


def c_spec_unknown_axis():
    return pjit(lambda p: p["w"] * 2, in_specs=({"w": P("tp")},), mesh=_mesh())({"w": torch.ones(2)})


def c_spec_repeated_axis():
    return pjit(lambda x: x, in_specs=P("dp", "dp"), mesh=_mesh())(torch.ones(2, 2))


def c_spec_too_long():
    return pjit(lambda x: x, in_specs=P(None, "dp"), mesh=_mesh())(torch.ones(4))


def c_spec_not_divisible():
    return pjit(lambda x: x * 2, in_specs=P("dp"), mesh=_mesh())(torch.ones(3, 2))


def c_spec_dict_by_name_ok():
    f = pjit(lambda x, y: x * y, in_specs={"x": P("dp")}, mesh=_mesh())
    out = f(torch.arange(4.0), y=torch.full((4,), 2.0))
    assert spec_of(out) == P("dp"), spec_of(out)
    _close(gather(out), torch.arange(4.0) * 2)


def c_spec_dict_unknown_name():
    return pjit(lambda x: x, in_specs={"z": P()}, mesh=_mesh())(torch.ones(2))


def c_spec_bad_entry():
    return pjit(lambda x: x, in_specs=P(1), mesh=_mesh())(torch.ones(2))


def c_spec_scalar_sharded():
    return pjit(lambda x: x * 2, in_specs=P("dp"), mesh=_mesh())(torch.tensor(1.0))


def c_spec_list_ok():
    out = pjit(lambda a, b: a + b, in_specs=[P("dp"), P()], mesh=_mesh())(_x(), _x())
    assert spec_of(out) == P("dp")
    _close(gather(out), _x() * 2)


def c_spec_none_ok():
    out = pjit(lambda a: a * 3, in_specs=None, mesh=_mesh())(_x())
    assert spec_of(out) == P()
    _close(gather(out), _x() * 3)


def c_spec_namedtuple_ok():
    Pair = collections.namedtuple("Pair", ["a", "b"])
    f = pjit(lambda p: p.a @ p.b.T, in_specs=(Pair(P("dp"), P()),), mesh=_mesh())
    _close(gather(f(Pair(_x(), _x()))), _x() @ _x().T)


def c_out_specs_too_long():
    f = pjit(lambda x: (x, x.sum()), in_specs=P(), out_specs=(P(), P("dp")), mesh=_mesh())
    return f(torch.ones(4))


def c_out_specs_count():
    f = pjit(lambda x: (x, x), in_specs=P(), out_specs=(P(), P(), P()), mesh=_mesh())
    return f(torch.ones(4))


def c_out_specs_string():
    return pjit(lambda x: x, in_specs=P(), out_specs="dp", mesh=_mesh())(torch.ones(4))


def c_out_specs_unspecified_mix_ok():
    f = pjit(lambda x: (x * 2, x.sum(0)), in_specs=P("dp"), out_specs=(UNSPECIFIED, P()), mesh=_mesh())
    a, b = f(_x())
    assert spec_of(a) == P("dp") and spec_of(b) == P()
    _close(gather(b), _x().sum(0))


# -- cases: the mesh ---------------------------------------------------------------------

def c_no_mesh():
    return pjit(lambda x: x, in_specs=P())(torch.ones(2))


def c_mesh_not_a_mesh():
    return pjit(lambda x: x, in_specs=P(), mesh="dp")(torch.ones(2))


def c_mesh_wrong_size():
    return Mesh((4,), ("dp",))


def c_mesh_duplicate_names():
    return Mesh((1, 2), ("dp", "dp"))


def c_mesh_names_length():
    return Mesh((1, 2), ("dp",))


def c_mesh_zero():
    return Mesh((0,), ("dp",))


def c_mesh_name_type():
    return Mesh((2,), (1,))


def c_dtensor_on_other_mesh():
    k = pjit(lambda x: x + 1, in_specs=P(), mesh=_mesh())
    return k(shard(_x(), P(), Mesh((2,), ("tp",))))


def c_with_mesh_ok():
    with _mesh():
        out = pjit(lambda x: x * 2, in_specs=P("dp"))(_x())
    _close(gather(out), _x() * 2)


def c_mesh_only_on_rank_0():
    f = pjit(lambda x: x * 2, in_specs=P("dp"))
    if _rank() == 0:
        with _mesh():
            return f(_x())
    return f(_x())


# -- cases: static arguments --------------------------------------------------------------

def c_static_negative_ok():
    f = pjit(lambda x, n: x * n, in_specs=P(), static_argnums=-1, mesh=_mesh())
    _close(gather(f(_x(), 3)), _x() * 3)


def c_static_varargs_negative_ok():
    f = pjit(lambda *a: a[0] * a[1], in_specs=P(), static_argnums=-1, mesh=_mesh())
    _close(gather(f(_x(), 4)), _x() * 4)


def c_static_out_of_range():
    return pjit(lambda x, n: x * n, in_specs=P(), static_argnums=5, mesh=_mesh())


def c_static_not_int():
    return pjit(lambda x, n: x * n, in_specs=P(), static_argnums="1", mesh=_mesh())


def c_static_duplicate():
    return pjit(lambda x, n: x * n, in_specs=P(), static_argnums=(1, -1), mesh=_mesh())


def c_static_tensor():
    f = pjit(lambda x, n: x * n, in_specs=P(), static_argnums=1, mesh=_mesh())
    return f(torch.ones(2), torch.ones(2))


def c_static_tensor_nested():
    f = pjit(lambda x, n: x * n[0], in_specs=P(), static_argnums=1, mesh=_mesh())
    return f(torch.ones(2), (3, torch.ones(2)))


def c_static_unhashable_leaf():
    return pjit(lambda x, cfg: x, in_specs=(P(), None), mesh=_mesh())(torch.ones(2), {1, 2})


def c_static_unhashable_arg():
    f = pjit(lambda x, n: x * n[0], in_specs=P(), static_argnums=1, mesh=_mesh())
    return f(torch.ones(2), [2, 3])


def c_static_default_repr_equal_ok():
    f = pjit(lambda x, cfg: x * cfg.scale, in_specs=P(), static_argnums=1, mesh=_mesh())
    _close(gather(f(_x(), Cfg(2.0))), _x() * 2)


def c_static_default_repr_differs():
    f = pjit(lambda x, cfg: x * cfg.scale, in_specs=P(), static_argnums=1, mesh=_mesh())
    return f(_x(), Cfg(2.0 if _rank() == 0 else 3.0))


def c_static_leaf_differs():
    f = pjit(lambda x, cfg: x * cfg["scale"], in_specs=(P(), None), mesh=_mesh())
    return f(_x(), {"scale": 2.0 if _rank() == 0 else 3.0})


def c_static_int_differs():
    f = pjit(lambda x, n: x * n, in_specs=P(), static_argnums=1, mesh=_mesh())
    return f(_x(), 1 + _rank())


def c_static_int_vs_float_ok():
    h = pjit(lambda x, s: x * s, in_specs=(P(), None), mesh=_mesh())
    xi = torch.arange(4)
    assert h(xi, 1).dtype == torch.int64 and h(xi, 1.0).dtype == torch.float32


# -- cases: inputs -----------------------------------------------------------------------

def c_frozen_dataclass_unregistered():
    f = pjit(lambda b: b.x + b.y, in_specs=P(), mesh=_mesh())
    return f(Batch(torch.ones(2), torch.ones(2)))


def c_frozen_dataclass_registered_ok():
    f = pjit(lambda b: RegBatch(b.x * 2, b.y), in_specs=(RegBatch(P("dp"), None),), mesh=_mesh())
    out = f(RegBatch(_x(), _x()))
    assert isinstance(out, RegBatch) and spec_of(out.x) == P("dp")
    _close(gather(out.x), _x() * 2)


def c_module_arg():
    return pjit(lambda m, x: m(x), in_specs=P(), mesh=_mesh())(nn.Linear(2, 2), torch.ones(2))


def c_dict_subclass_arg():
    return pjit(lambda d: d["a"] * 2, in_specs=P(), mesh=_mesh())(MyDict(a=torch.ones(2)))


def c_object_with_tensors_arg():
    return pjit(lambda h: h.t * 2, in_specs=P(), mesh=_mesh())(Holder(torch.ones(2)))


def c_keyword_args_ok():
    f = pjit(lambda x, y: x + y, in_specs=P("dp"), mesh=_mesh())   # one P covers keywords too
    out = f(_x(), y=_x())
    assert spec_of(out) == P("dp"), spec_of(out)
    _close(gather(out), _x() * 2)


def c_keyword_tuple_specs_replicated_ok():
    f = pjit(lambda x, y: x * y, in_specs=(P("dp"),), mesh=_mesh())  # y: P() by default
    _close(gather(f(_x(), y=torch.tensor([1.0, 2.0]))), _x() * torch.tensor([1.0, 2.0]))
    assert f.lower(_x(), y=torch.ones(2)).in_specs == [P("dp"), P()]


def c_keyword_static_ok():
    f = pjit(lambda x, *, scale: x * scale, in_specs=P("dp"), static_argnames="scale",
             mesh=_mesh())
    _close(gather(f(_x(), scale=2.0)), _x() * 2)
    _close(gather(f(_x(), scale=2.0)), _x() * 2)
    _close(gather(f(_x(), scale=3.0)), _x() * 3)
    assert f.trace_count == 2, f.trace_count


def c_keyword_unexpected():
    return pjit(lambda x: x, in_specs=P(), mesh=_mesh())(_x(), z=_x())


def c_keyword_multiple_values():
    return pjit(lambda x: x, in_specs=P(), mesh=_mesh())(_x(), x=_x())


def c_keyword_spec_not_divisible():
    f = pjit(lambda x, y: x.sum() + y.sum(), in_specs={"y": P("dp")}, mesh=_mesh())
    return f(_x(), y=torch.ones(3))


def c_static_argnames_unknown():
    return pjit(lambda x, scale: x * scale, static_argnames=("scael",), in_specs=P(), mesh=_mesh())


def c_static_argnames_not_str():
    return pjit(lambda x, scale: x * scale, static_argnames=(1,), in_specs=P(), mesh=_mesh())


def c_static_kwarg_tensor():
    f = pjit(lambda x, scale: x * scale, static_argnames="scale", in_specs=P(), mesh=_mesh())
    return f(_x(), scale=torch.ones(2))


def c_static_kwarg_unhashable():
    f = pjit(lambda x, cfg: x * cfg["s"], static_argnames="cfg", in_specs=P(), mesh=_mesh())
    return f(_x(), cfg={"s": 2.0})


def c_in_specs_dict_names_static():
    return pjit(lambda x, scale: x * scale, in_specs={"scale": P()}, static_argnames="scale",
                mesh=_mesh())


def c_donate_argnames_unknown():
    return pjit(lambda params, x: x, donate_argnames="parms", in_specs=P(), mesh=_mesh())


def c_donated_read_after_call():
    f = pjit(lambda w: w * 2, in_specs=P("dp"), donate_argnums=0, mesh=_mesh())
    w = shard(_x(), P("dp"), _mesh())
    ptr = w.to_local().untyped_storage().data_ptr()
    out = f(w)
    _close(gather(out), _x() * 2)
    assert out.to_local().untyped_storage().data_ptr() == ptr     # computed in w's storage
    return w + 1


def c_donated_passed_again():
    f = pjit(lambda w: w * 2, in_specs=P("dp"), donate_argnames="w", mesh=_mesh())
    w = shard(_x(), P("dp"), _mesh())
    f(w)
    return f(w)


def c_shape_differs():
    return pjit(lambda x: x.sum(), in_specs=P("dp"), mesh=_mesh())(torch.ones(4 + 4 * _rank(), 2))


def c_dtype_differs():
    dtype = torch.float32 if _rank() == 0 else torch.float64
    return pjit(lambda x: x.sum(), in_specs=P("dp"), mesh=_mesh())(torch.ones(4, 2, dtype=dtype))


def c_input_layout_differs():
    f = pjit(lambda x: x * 2, in_specs=P(), mesh=_mesh())
    x = _x()
    return f(shard(x, P("dp"), _mesh()) if _rank() == 0 else x)


def c_in_specs_differ():
    f = pjit(lambda x: x * 2, in_specs=P("dp") if _rank() == 0 else P(), mesh=_mesh())
    return f(_x())


def c_dtensor_resharded_ok():
    f = pjit(lambda x: x * 2, in_specs=P(None, "dp"), mesh=_mesh())
    out = f(shard(_x(), P("dp"), _mesh()))
    assert spec_of(out) == P(None, "dp")
    _close(gather(out), _x() * 2)


def c_scalar_and_none_leaves_ok():
    f = pjit(lambda x, s, n: x * s if n is None else x, in_specs=(P(), None, None), mesh=_mesh())
    _close(gather(f(_x(), 2.5, None)), _x() * 2.5)


def c_inside_torch_func_grad_ok():
    g = pjit(lambda x: x * 2, in_specs=P(), mesh=_mesh())
    _close(torch.func.grad(lambda x: g(x).sum())(torch.ones(2)), torch.full((2,), 2.0))


def c_inside_torch_func_vmap():
    g = pjit(lambda x: x * 2, in_specs=P(), mesh=_mesh())
    return torch.func.vmap(g)(torch.ones(3, 2))


def c_not_callable():
    return pjit(3, in_specs=P(), mesh=_mesh())


def c_mode_not_a_mode():
    return pjit(lambda x: x, in_specs=P(), mesh=_mesh(), mode="dtensor")


def c_no_args_ok():
    out = pjit(lambda: torch.ones(2) * 3, in_specs=(), mesh=_mesh())()
    _close(gather(out), torch.full((2,), 3.0))


# -- cases: outputs -----------------------------------------------------------------------

def c_out_dataclass():
    return pjit(lambda x: Out(x), in_specs=P(), mesh=_mesh())(torch.ones(2))


def c_out_dict_subclass():
    return pjit(lambda x: {"o": ModelOutput(logits=x)}, in_specs=P(), mesh=_mesh())(torch.ones(2))


def c_out_generator():
    return pjit(lambda x: (x, (y for y in [x])), in_specs=P(), mesh=_mesh())(torch.ones(2))


def c_out_object():
    return pjit(lambda x: (x, object()), in_specs=P(), mesh=_mesh())(torch.ones(2))


def c_out_function():
    return pjit(lambda x: [x, torch.sin], in_specs=P(), mesh=_mesh())(torch.ones(2))


def c_out_scalars_ok():
    a, n, none, s = pjit(lambda x: (x * 2, 3, None, "s"), in_specs=P(), mesh=_mesh())(_x())
    assert (n, none, s) == (3, None, "s")
    _close(gather(a), _x() * 2)


def c_out_rank_dependent_shape():
    r = _rank()
    return pjit(lambda x: x[: 2 + 2 * r], in_specs=P(), mesh=_mesh())(_x())


def c_shard_map_rank_dependent_shape():
    r = _rank()
    region = shard_map(lambda x: x[: 1 + r], mesh=_mesh(), in_specs=P("dp"), out_specs=P("dp"))
    return gather(region(_x()))


def c_rank_dependent_constant():
    r = _rank()
    return gather(pjit(lambda x: x * (2 if r == 0 else 3), in_specs=P("dp"), mesh=_mesh())(_x()))


def c_rank_dependent_branch():
    r = _rank()
    return gather(pjit(lambda x: torch.sin(x) if r == 0 else torch.cos(x), in_specs=P(), mesh=_mesh())(_x()))


# -- cases: the function ------------------------------------------------------------------

def shape_bug(x, w):
    y = x * 2
    return y @ w


def c_shape_bug():
    return pjit(shape_bug, in_specs=P(), mesh=_mesh())(torch.ones(4, 3), torch.ones(4, 2))


def c_user_raise():
    def f(x):
        if x.shape[0] % 2:
            raise ValueError("batch must be even")
        return x
    return pjit(f, in_specs=P(), mesh=_mesh())(torch.ones(3))


def c_data_dependent_branch():
    def f(x):
        return x if x.sum() > 0 else -x
    return pjit(f, in_specs=P(), mesh=_mesh())(torch.ones(2))


def c_item():
    return pjit(lambda x: x * x.sum().item(), in_specs=P(), mesh=_mesh())(torch.ones(2))


def c_nonzero():
    return pjit(lambda x: x.nonzero(), in_specs=P(), mesh=_mesh())(torch.ones(2))


def c_input_mutation():
    def f(p, x):
        p["w"].add_(x)
        return p["w"] * 2
    return pjit(f, in_specs=P(), mesh=_mesh())({"w": torch.ones(2)}, torch.ones(2))


def c_captured_mutation():
    c = torch.zeros(2)

    def f(x):
        c.add_(1)
        return x + c
    try:
        return pjit(f, in_specs=P(), mesh=_mesh())(torch.ones(2))
    finally:
        assert c.tolist() == [0.0, 0.0], f"the captured tensor was changed: {c}"


def c_batchnorm_closed_over():
    bn = nn.BatchNorm1d(2)
    try:
        return pjit(lambda x: bn(x), in_specs=P("dp"), mesh=_mesh())(torch.randn(4, 2))
    finally:
        assert int(bn.num_batches_tracked) == 0 and bn.running_mean.abs().sum() == 0, \
            "BatchNorm's buffers were changed while tracing"


def c_batchnorm_functional_ok():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = {k: v.detach().clone() for k, v in model.named_buffers()}
    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))

    def loss_fn(p, b, x, y):
        b = {k: v.clone() for k, v in b.items()}     # BatchNorm updates them in place
        return F.cross_entropy(torch.func.functional_call(model, (p, b), (x,)), y), b

    def step(p, b, x, y):
        grads, b = torch.func.grad(loss_fn, has_aux=True)(p, b, x, y)
        return {k: v - 0.1 * grads[k] for k, v in p.items()}, b

    f = pjit(step, in_specs=(P(), P(), P("dp"), P("dp")), mesh=_mesh())
    p1, b1 = f(params, buffers, x, y)
    p2, b2 = f(p1, b1, x, y)
    rp, rb = step(*step(params, buffers, x, y), x, y)
    _close(gather(p2), rp)
    _close(gather(b2), rb)
    assert int(gather(b2)["1.num_batches_tracked"]) == 2


class _LastLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.last_loss = None

    def forward(self, x):
        y = self.lin(x)
        self.last_loss = y.pow(2).mean()     # llama2.c keeps its loss like this
        return y


def c_leaked_attribute_ok():
    torch.manual_seed(0)              # plain tensor inputs must be equal on every rank
    m = _LastLoss()
    params = {k: v.detach() for k, v in m.named_parameters()}

    def step(p, x):
        torch.func.functional_call(m, p, (x,))
        return m.last_loss

    x = _x()
    out = pjit(step, in_specs=(P(), P("dp")), mesh=_mesh())(params, x)
    assert "LeakedTracer" in repr(m.last_loss), repr(m.last_loss)
    try:
        m.last_loss + 1
    except RuntimeError as e:
        assert "m.last_loss was set by the function while pjit(step) traced it" in str(e), e
    else:
        raise AssertionError("using the leaked attribute did not raise")
    _close(gather(out), torch.func.functional_call(m, params, (x,)).pow(2).mean())


class _Counter(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x):
        self.seen = self.seen + x.shape[0]
        return x * 2


def c_buffer_reassigned():
    m = _Counter()
    before = m.seen
    try:
        return pjit(lambda x: m(x), in_specs=P(), mesh=_mesh())(_x())
    finally:
        assert m.seen is before and float(m.seen) == 0.0, "the buffer was not restored"


def c_nested_pjit():
    inner = pjit(lambda x: x * 2, in_specs=P(), mesh=_mesh())
    return pjit(lambda x: inner(x) + 1, in_specs=P(), mesh=_mesh())(torch.ones(2))


def c_no_sharding_rule():
    return pjit(lambda x: _no_rule(x), in_specs=P("dp"), mesh=_mesh())(torch.ones(4))


def c_randperm():
    return pjit(lambda x: x[torch.randperm(4)], in_specs=P(), mesh=_mesh())(torch.ones(4))


def c_psum_outside_shard_map():
    return pjit(lambda x: C.psum(x, "dp"), in_specs=P(), mesh=_mesh())(torch.ones(4))


def c_shard_map_unknown_axis():
    region = shard_map(lambda x: x, mesh=_mesh(), in_specs=P("dp"), out_specs=P("tp"))
    return region(_x())


def c_shard_map_body_raises():
    def body(x):
        raise ValueError("bad body")
    return shard_map(body, mesh=_mesh(), in_specs=P("dp"), out_specs=P("dp"))(_x())


def c_grad_of_non_scalar():
    return pjit(torch.func.grad(lambda x: x * 2), in_specs=P(), mesh=_mesh())(torch.ones(2))


def c_einops_bad_pattern():
    return pjit(lambda x: einops.rearrange(x, "a b c -> a (b c)"), in_specs=P(), mesh=_mesh())(_x())


# -- cases: agreement and random numbers ----------------------------------------------------

def c_cache_hit_divergence():
    f = pjit(lambda x: x.sum(), in_specs=P("dp"), mesh=_mesh())
    f(torch.ones(4, 2))                                     # both ranks cache it
    try:
        f(torch.ones(4, 2) if _rank() == 0 else torch.ones(8, 2))   # rank 0 hits, rank 1 misses
    except Exception as e:  # noqa: BLE001
        err = e
    else:
        raise AssertionError("no error")
    _close(gather(f(torch.ones(4, 2))), torch.tensor(8.0))  # the ranks still work together
    raise err


def c_compile_error_on_one_rank():
    return pjit(lambda x: x * 2, in_specs=P("dp"), mesh=_mesh())(torch.ones(4 + _rank(), 2))


def _dropout_program():
    return pjit(lambda x: F.dropout(x, 0.5), in_specs=P("dp"), mesh=_mesh())


def _with_rng_state(state, fn):
    saved = srandom.get_rng_state()
    srandom.set_rng_state(state)
    try:
        return fn()
    finally:
        srandom.set_rng_state(saved)


def c_seed_on_one_rank():
    state = {"seed": 1 if _rank() == 0 else None, "offset": 0}
    return _with_rng_state(state, lambda: _dropout_program()(torch.ones(4, 2)))


def c_seeds_differ():
    return _with_rng_state({"seed": 10 + _rank(), "offset": 0}, lambda: _dropout_program()(torch.ones(4, 2)))


def c_offsets_differ():
    return _with_rng_state({"seed": 5, "offset": _rank()}, lambda: _dropout_program()(torch.ones(4, 2)))


def c_no_seed_ok():
    def run():
        full = gather(_dropout_program()(torch.ones(8, 4)))
        every = [torch.empty_like(full) for _ in range(2)]
        dist.all_gather(every, full)
        assert torch.equal(every[0], every[1]), "the ranks drew different numbers"
        assert srandom.get_rng_state()["seed"] is not None
    _with_rng_state({"seed": None, "offset": 0}, run)


def c_default_dtype_differs():
    saved = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64 if _rank() == 1 else torch.float32)
    try:
        return pjit(lambda x: x + torch.ones(2), in_specs=P(), mesh=_mesh())(
            torch.ones(2, dtype=torch.float32))
    finally:
        torch.set_default_dtype(saved)


def c_autocast_on_one_rank():
    f = pjit(lambda x: x @ x.T, in_specs=P(), mesh=_mesh())
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=_rank() == 0):
        return f(_x())


def c_ambient_dtype_in_key_ok():
    f = pjit(lambda x: x + torch.ones(2), in_specs=P(), mesh=_mesh())
    assert f(torch.ones(2)).dtype == torch.float32
    saved = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        out = f(torch.ones(2))
    finally:
        torch.set_default_dtype(saved)
    assert out.dtype == torch.float64 and f.trace_count == 2, (out.dtype, f.trace_count)


def c_index_error_in_every_shard():
    # The same failure on every rank while the program runs (NOTE [Failures alike]):
    # each rank raises it, and the process groups stay usable.
    w = torch.randn(8, 3, generator=torch.Generator().manual_seed(0))
    f = pjit(lambda w, ids: F.embedding(ids, w).sum(), in_specs=(P(), P("dp")), mesh=_mesh())
    try:
        f(w, torch.tensor([40, 41, 42, 43]))
    except IndexError as e:
        err = e
    else:
        raise AssertionError("no error")
    ids = torch.tensor([1, 2, 3, 4])
    _close(gather(f(w, ids)), F.embedding(ids, w).sum())
    raise err


# -- cases that close the process groups (a failure while a program runs) -------------------

def c_index_error_in_one_shard():
    # one global batch whose bad index lies in rank 1's shard only (a batch that
    # differs across ranks fails on every rank before running: tests/test_data.py)
    w = torch.randn(8, 3, generator=torch.Generator().manual_seed(0))
    f = pjit(lambda w, ids: F.embedding(ids, w).sum(), in_specs=(P(), P("dp")), mesh=_mesh())
    f(w, torch.tensor([1, 2, 3, 4]))
    return f(w, torch.tensor([1, 2, 3, 40]))


# -- cases on a 2x2 mesh (4 ranks) --------------------------------------------------------------

def _mesh2():
    return Mesh((2, 2), ("dp", "tp"))


def c2_megatron_ok():
    torch.manual_seed(0)
    x, w1, w2 = torch.randn(4, 8), torch.randn(8, 8), torch.randn(8, 8)

    def f(x, w1, w2):
        return torch.relu(x @ w1) @ w2

    g = pjit(f, in_specs=(P("dp"), P(None, "tp"), P("tp")), out_specs=P("dp"), mesh=_mesh2())
    _close(gather(g(x, w1, w2)), f(x, w1, w2))


def c2_shape_differs_on_rank_3():
    n = 8 if _rank() == 3 else 4
    return pjit(lambda x: x.sum(), in_specs=P("dp", "tp"), mesh=_mesh2())(torch.ones(n, 4))


def c2_compile_error_on_rank_2():
    n = 5 if _rank() == 2 else 4
    return pjit(lambda x: x * 2, in_specs=P("dp"), mesh=_mesh2())(torch.ones(n, 4))


def c2_cache_hit_divergence_on_rank_3():
    f = pjit(lambda x: x.sum(), in_specs=P(("dp", "tp")), mesh=_mesh2())
    f(torch.ones(4, 2))
    return f(torch.ones(8 if _rank() == 3 else 4, 2))


def c2_seed_differs_on_rank_2():
    prog = pjit(lambda x: F.dropout(x, 0.5), in_specs=P("dp", "tp"), mesh=_mesh2())
    return _with_rng_state({"seed": 3 if _rank() == 2 else 4, "offset": 0}, lambda: prog(torch.ones(4, 4)))


def c2_index_error_on_rank_2():
    w = torch.randn(8, 3, generator=torch.Generator().manual_seed(0))
    f = pjit(lambda w, ids: F.embedding(ids, w).sum(), in_specs=(P(), P(("dp", "tp"))), mesh=_mesh2())
    f(w, torch.tensor([1, 2, 3, 4]))
    return f(w, torch.tensor([1, 2, 30, 4]))          # the bad index in rank 2's shard


# -- expectations ----------------------------------------------------------------------------

OK = ("ok",)


def E(exc: str, pattern: str):
    """Every rank raises ``exc`` (or a subclass) with a message matching ``pattern``."""
    return ("raise", exc, pattern)


def fails_on(rank: int, exc: str, pattern: str, where: str):
    """``rank`` raises ``exc``; every other rank raises RankFailedError naming it."""
    return ("fails_on", rank, E(exc, pattern), E("RankFailedError", rf"rank {rank} failed {where}"))


MISMATCH = E("RankMismatchError", r"ranks called it with different arguments or built different "
                                  r"programs\.\n  rank \d differs from rank \d at item \d+")

CASES = {
    # in_specs / out_specs
    "spec_dict_keys": (c_spec_dict_keys, E("ValueError", r"pjit\(<lambda>\) in_specs\[0\] does not match the argument's keys: spec for key\(s\) \['b'\] not in the argument")),
    "spec_container_for_tensor": (c_spec_container_for_tensor, E("ValueError", r"in_specs\[0\]\['w'\] is a dict, but the argument there is a tensor of shape \(2,\)")),
    "spec_count": (c_spec_count, E("ValueError", r"in_specs has 1 entries but the call has 2 positional args")),
    "spec_string": (c_spec_string, E("TypeError", r"in_specs\[0\] is 'dp'; expected P\(...\), None, or a container. Did you mean P\('dp'\)\?")),
    "spec_unknown_axis": (c_spec_unknown_axis, E("ValueError", r"in_specs\[0\]\['w'\] \(for args\[0\]\['w'\]\) is P\('tp'\), which names mesh axis 'tp', but the mesh has axes \('dp',\)")),
    "spec_repeated_axis": (c_spec_repeated_axis, E("ValueError", r"uses mesh axis 'dp' twice \(dims 0 and 1\)")),
    "spec_too_long": (c_spec_too_long, E("ValueError", r"has 2 entries, but the tensor has 1 dims \(shape \(4,\)\)")),
    "spec_not_divisible": (c_spec_not_divisible, E("ValueError", r"in_specs \(for args\[0\]\) maps dim 0 \(size 3\) to mesh axis 'dp' \(size 2\), which does not divide it; pad the input or change the mesh")),
    "spec_dict_by_name_ok": (c_spec_dict_by_name_ok, OK),
    "spec_dict_unknown_name": (c_spec_dict_unknown_name, E("ValueError", r"pjit\(<lambda>\): in_specs\['z'\] names no parameter of the function; it takes \(x\)")),
    "spec_bad_entry": (c_spec_bad_entry, E("TypeError", r"P entry 0 must be None, a mesh axis name or a tuple of axis names; got 1")),
    "spec_scalar_sharded": (c_spec_scalar_sharded, E("ValueError", r"is P\('dp'\), which has 1 entries, but the tensor has 0 dims")),
    "spec_list_ok": (c_spec_list_ok, OK),
    "spec_none_ok": (c_spec_none_ok, OK),
    "spec_namedtuple_ok": (c_spec_namedtuple_ok, OK),
    "out_specs_too_long": (c_out_specs_too_long, E("ValueError", r"out_specs\[1\] \(for output\[1\]\) is P\('dp'\), which has 1 entries, but the tensor has 0 dims")),
    "out_specs_count": (c_out_specs_count, E("ValueError", r"out_specs has 3 entries but the argument there has 2")),
    "out_specs_string": (c_out_specs_string, E("TypeError", r"out_specs is 'dp'; expected P\(...\), None, or a container. Did you mean P\('dp'\)\?")),
    "out_specs_unspecified_mix_ok": (c_out_specs_unspecified_mix_ok, OK),
    # the mesh
    "no_mesh": (c_no_mesh, E("ValueError", r"pjit\(<lambda>\) needs a mesh: pass mesh=Mesh\(...\) or call it inside `with mesh:`")),
    "mesh_not_a_mesh": (c_mesh_not_a_mesh, E("TypeError", r"pjit\(<lambda>\): mesh must be a sharded.Mesh; got str")),
    "mesh_wrong_size": (c_mesh_wrong_size, E("ValueError", r"Mesh\(4,\) has 4 ranks but the world has 2")),
    "mesh_duplicate_names": (c_mesh_duplicate_names, E("ValueError", r"Mesh axis names must be unique; 'dp' repeats")),
    "mesh_names_length": (c_mesh_names_length, E("ValueError", r"give one name per axis")),
    "mesh_zero": (c_mesh_zero, E("ValueError", r"Mesh shape must be positive ints; got \(0,\)")),
    "mesh_name_type": (c_mesh_name_type, E("TypeError", r"Mesh axis names must be non-empty strings; got 1")),
    "dtensor_on_other_mesh": (c_dtensor_on_other_mesh, E("ValueError", r"pjit\(<lambda>\): args\[0\] is a DTensor on .*not on the pjit mesh .*gather it and shard it onto this mesh")),
    "with_mesh_ok": (c_with_mesh_ok, OK),
    "mesh_only_on_rank_0": (c_mesh_only_on_rank_0, fails_on(1, "ValueError", r"needs a mesh", "to build its program")),
    # static arguments
    "static_negative_ok": (c_static_negative_ok, OK),
    "static_varargs_negative_ok": (c_static_varargs_negative_ok, OK),
    "static_out_of_range": (c_static_out_of_range, E("ValueError", r"pjit\(<lambda>\): static_argnums has 5, but the function takes 2 positional argument\(s\)")),
    "static_not_int": (c_static_not_int, E("TypeError", r"static_argnums must be ints; got '1'")),
    "static_duplicate": (c_static_duplicate, E("ValueError", r"static_argnums \(1, -1\) names an argument twice")),
    "static_tensor": (c_static_tensor, E("TypeError", r"pjit\(<lambda>\): args\[1\] is static \(static_argnums\) but is a tensor of shape \(2,\)\. .*pass tensors as regular arguments")),
    "static_tensor_nested": (c_static_tensor_nested, E("TypeError", r"args\[1\]\[1\] is static \(static_argnums\) but is a tensor of shape \(2,\)")),
    "static_unhashable_leaf": (c_static_unhashable_leaf, E("TypeError", r"non-tensor arguments are static and must be hashable; got an unhashable one in set")),
    "static_unhashable_arg": (c_static_unhashable_arg, E("TypeError", r"non-tensor arguments are static and must be hashable; got an unhashable one in static argument list")),
    "static_default_repr_equal_ok": (c_static_default_repr_equal_ok, OK),
    "static_default_repr_differs": (c_static_default_repr_differs, E("RankMismatchError", r"rank 1 differs from rank 0 at item \d+ .*\n    rank 0: static args\[1\]: <tests.test_catalogue.Cfg dict\({'scale': 2.0}\)>\n    rank 1: static args\[1\]: <tests.test_catalogue.Cfg dict\({'scale': 3.0}\)>")),
    "static_leaf_differs": (c_static_leaf_differs, E("RankMismatchError", r"rank 0: static leaf args\[1\]\['scale'\]: 2.0\n    rank 1: static leaf args\[1\]\['scale'\]: 3.0")),
    "static_int_differs": (c_static_int_differs, E("RankMismatchError", r"rank 0: static args\[1\]: 1\n    rank 1: static args\[1\]: 2")),
    "static_int_vs_float_ok": (c_static_int_vs_float_ok, OK),
    # inputs
    "frozen_dataclass_unregistered": (c_frozen_dataclass_unregistered, E("TypeError", r"args\[0\] is an instance of Batch \(a dataclass with tensors in \['x', 'y'\]\) that is not a registered pytree node.*sharded.register_dataclass\(Batch\)")),
    "frozen_dataclass_registered_ok": (c_frozen_dataclass_registered_ok, OK),
    "module_arg": (c_module_arg, E("TypeError", r"args\[0\] is an nn.Module \(Linear\); pass its parameters instead.*torch.func.functional_call")),
    "dict_subclass_arg": (c_dict_subclass_arg, E("TypeError", r"args\[0\] is an instance of MyDict \(a dict subclass that is not a registered pytree node\) holding tensors")),
    "object_with_tensors_arg": (c_object_with_tensors_arg, E("TypeError", r"args\[0\] is an instance of Holder with tensor attributes \['t'\]")),
    # keyword arguments (NOTE [Keyword arguments] in sharded/_arguments.py)
    "keyword_args_ok": (c_keyword_args_ok, OK),
    "keyword_tuple_specs_replicated_ok": (c_keyword_tuple_specs_replicated_ok, OK),
    "keyword_static_ok": (c_keyword_static_ok, OK),
    "keyword_unexpected": (c_keyword_unexpected, E("TypeError", r"pjit\(<lambda>\) got an unexpected keyword argument 'z'; the function takes \(x\)")),
    "keyword_multiple_values": (c_keyword_multiple_values, E("TypeError", r"pjit\(<lambda>\) got multiple values for argument 'x' \(positional argument 0 and a keyword\)")),
    "keyword_spec_not_divisible": (c_keyword_spec_not_divisible, E("ValueError", r"in_specs\['y'\] \(for kwargs\['y'\]\) maps dim 0 \(size 3\) to mesh axis 'dp' \(size 2\), which does not divide it")),
    "static_argnames_unknown": (c_static_argnames_unknown, E("ValueError", r"static_argnames has 'scael', but the function has no parameter of that name; it takes \(x, scale\)")),
    "static_argnames_not_str": (c_static_argnames_not_str, E("TypeError", r"static_argnames must be strs; got 1")),
    "static_kwarg_tensor": (c_static_kwarg_tensor, E("TypeError", r"pjit\(<lambda>\): kwargs\['scale'\] is static \(static_argnames\) but is a tensor of shape \(2,\)")),
    "static_kwarg_unhashable": (c_static_kwarg_unhashable, E("TypeError", r"static kwargs\['cfg'\] \(static_argnames\), dict")),
    "in_specs_dict_names_static": (c_in_specs_dict_names_static, E("ValueError", r"in_specs\['scale'\] names a static argument; static arguments take no spec")),
    # donation (NOTE [Donation] in sharded/_program.py)
    "donate_argnames_unknown": (c_donate_argnames_unknown, E("ValueError", r"donate_argnames has 'parms', but the function has no parameter of that name; it takes \(params, x\)")),
    "donated_read_after_call": (c_donated_read_after_call, E("RuntimeError", r"^args\[0\] was donated to pjit\(<lambda>\); use the returned value")),
    "donated_passed_again": (c_donated_passed_again, E("RuntimeError", r"pjit\(<lambda>\): args\[0\] cannot be used: args\[0\] was donated to pjit\(<lambda>\); use the returned value")),
    "shape_differs": (c_shape_differs, E("RankMismatchError", r"rank 0: input args\[0\]: float32\[4, 2\] P\('dp'\)\n    rank 1: input args\[0\]: float32\[8, 2\] P\('dp'\)")),
    "dtype_differs": (c_dtype_differs, E("RankMismatchError", r"rank 0: input args\[0\]: float32\[4, 2\].*\n    rank 1: input args\[0\]: float64\[4, 2\]")),
    "input_layout_differs": (c_input_layout_differs, E("RankMismatchError", r"rank 0: input args\[0\]: a DTensor laid out as \(Shard\(dim=0\),\), redistributed before the program")),
    "in_specs_differ": (c_in_specs_differ, MISMATCH),
    "dtensor_resharded_ok": (c_dtensor_resharded_ok, OK),
    "scalar_and_none_leaves_ok": (c_scalar_and_none_leaves_ok, OK),
    "inside_torch_func_grad_ok": (c_inside_torch_func_grad_ok, OK),
    "inside_torch_func_vmap": (c_inside_torch_func_vmap, E("TypeError", r"pjit\(<lambda>\) was called inside torch.func.vmap; a pjit call cannot be batched from outside. Put vmap inside the function")),
    "not_callable": (c_not_callable, E("TypeError", r"pjit expects a callable; got int 3")),
    "mode_not_a_mode": (c_mode_not_a_mode, E("TypeError", r"pjit mode must be a sharded.modes.ParallelMode; got 'dtensor'")),
    "no_args_ok": (c_no_args_ok, OK),
    # outputs
    "out_dataclass": (c_out_dataclass, E("TypeError", r"pjit\(<lambda>\): output is an instance of Out, a dataclass that is not a registered pytree node; register it with sharded.register_dataclass\(Out\)")),
    "out_dict_subclass": (c_out_dict_subclass, E("TypeError", r"output\['o'\] is an instance of ModelOutput, a dict subclass that is not a registered pytree node .*return dict\(out\)")),
    "out_generator": (c_out_generator, E("TypeError", r"output\[1\] is a generator or iterator .*return a tuple or list")),
    "out_object": (c_out_object, E("TypeError", r"output\[1\] is an object of type object\. Outputs must be tensors, Python scalars or None")),
    "out_function": (c_out_function, E("TypeError", r"output\[1\] is an object of type builtin_function_or_method")),
    "out_scalars_ok": (c_out_scalars_ok, OK),
    "out_rank_dependent_shape": (c_out_rank_dependent_shape, E("RankMismatchError", r"rank 0: output output: float32\[2, 2\] .*\n    rank 1: output output: float32\[4, 2\]")),
    "shard_map_rank_dependent_shape": (c_shard_map_rank_dependent_shape, E("RankMismatchError", r"shard_map\(<lambda>\): ranks called it with different arguments .*\n    rank 0: output .*float32\[2, 2\].*\n    rank 1: output .*float32\[4, 2\]")),
    "rank_dependent_constant": (c_rank_dependent_constant, E("RankMismatchError", r"rank 0: mul = aten.mul.Tensor\(arg0_1, 2\).*\n    rank 1: mul = aten.mul.Tensor\(arg0_1, 3\)")),
    "rank_dependent_branch": (c_rank_dependent_branch, E("RankMismatchError", r"rank 0: sin = aten.sin.default\(arg0_1\).*\n    rank 1: cos = aten.cos.default\(arg0_1\)")),
    # the function
    "shape_bug": (c_shape_bug, E("RuntimeError", r"pjit\(shape_bug\): tracing the function failed: RuntimeError: .*\n  at .*test_catalogue.py:\d+ in shape_bug: `return y @ w`\n  with inputs args\[0\]: float32\[4, 3\], args\[1\]: float32\[4, 2\] \(global shapes\)")),
    "user_raise": (c_user_raise, E("ValueError", r"^batch must be even\nNOTES: \(raised while pjit\(f\) traced the function with inputs args\[0\]: float32\[3\]\)")),
    "data_dependent_branch": (c_data_dependent_branch, E("TracingError", r"pjit\(f\): the function's Python control flow or output shape depends on tensor values.*use torch.where")),
    "item": (c_item, E("TracingError", r"depends on tensor values")),
    "nonzero": (c_nonzero, E("TracingError", r"depends on tensor values")),
    "input_mutation": (c_input_mutation, E("ValueError", r"pjit\(f\): the function mutates its input args\[0\]\['w'\] in place; pjit functions must be pure")),
    "captured_mutation": (c_captured_mutation, E("CapturedStateError", r"pjit\(f\): the function changes c \(shape \(2,\), torch.float32\) in place with aten.add_.Tensor at .*test_catalogue.py:\d+ in f: `c.add_\(1\)`.*pass the tensor in as an argument and return its new value")),
    "batchnorm_closed_over": (c_batchnorm_closed_over, E("CapturedStateError", r"changes bn.num_batches_tracked \(shape \(\), torch.int64\) in place .*torch.func.functional_call")),
    "batchnorm_functional_ok": (c_batchnorm_functional_ok, OK),
    "leaked_attribute_ok": (c_leaked_attribute_ok, OK),
    "buffer_reassigned": (c_buffer_reassigned, E("CapturedStateError", r"pjit\(<lambda>\): the function assigns new tensors to m.seen, which it does not take as arguments")),
    "nested_pjit": (c_nested_pjit, E("NotImplementedError", r"nested pjit is not supported")),
    "no_sharding_rule": (c_no_sharding_rule, E("ShardingRuleError", r"DTensorExpandMode has no sharding rule for sharded_tests.no_rule.default .*register_sharding")),
    "randperm": (c_randperm, E("NotImplementedError", r"random op aten.randperm.default has no counter-based rewrite")),
    "psum_outside_shard_map": (c_psum_outside_shard_map, E("RuntimeError", r"runs only inside a shard_map body")),
    "shard_map_unknown_axis": (c_shard_map_unknown_axis, E("ValueError", r"shard_map\(<lambda>\) out_specs .*names mesh axis 'tp', but the mesh has axes \('dp',\)")),
    "shard_map_body_raises": (c_shard_map_body_raises, E("ValueError", r"^bad body")),
    "grad_of_non_scalar": (c_grad_of_non_scalar, E("RuntimeError", r"tracing the function failed: RuntimeError: .*scalar.*\n  at .*test_catalogue.py:\d+ \(where the function is defined\)")),
    "einops_bad_pattern": (c_einops_bad_pattern, E("EinopsError", r"tracing the function failed: EinopsError: .*\n  at .*test_catalogue.py:\d+ in <lambda>")),
    # agreement and random numbers
    "cache_hit_divergence": (c_cache_hit_divergence, E("RankMismatchError", r"rank 0: input args\[0\]: float32\[4, 2\] P\('dp'\)\n    rank 1: input args\[0\]: float32\[8, 2\] P\('dp'\)")),
    "compile_error_on_one_rank": (c_compile_error_on_one_rank, fails_on(1, "ValueError", r"does not divide", "to build its program")),
    "seed_on_one_rank": (c_seed_on_one_rank, E("RankMismatchError", r"the ranks' random states differ \(rank 0: seed 1 offset 0, rank 1: seed None offset 0\).*manual_seed")),
    "seeds_differ": (c_seeds_differ, E("RankMismatchError", r"random states differ \(rank 0: seed 10 offset 0, rank 1: seed 11 offset 0\)")),
    "offsets_differ": (c_offsets_differ, E("RankMismatchError", r"random states differ \(rank 0: seed 5 offset 0, rank 1: seed 5 offset 1\)")),
    "no_seed_ok": (c_no_seed_ok, OK),
    "default_dtype_differs": (c_default_dtype_differs, E("RankMismatchError", r"rank 0: ambient: default dtype torch.float32\n    rank 1: ambient: default dtype torch.float64")),
    "autocast_on_one_rank": (c_autocast_on_one_rank, E("RankMismatchError", r"rank 0: ambient: default dtype torch.float32, autocast cpu torch.bfloat16\n    rank 1: ambient: default dtype torch.float32\n")),
    "ambient_dtype_in_key_ok": (c_ambient_dtype_in_key_ok, OK),
    "index_error_in_every_shard": (c_index_error_in_every_shard, E("IndexError", r"^index out of range in self$")),
}

FATAL = {
    "index_error_in_one_shard": (c_index_error_in_one_shard, fails_on(
        1, "IndexError", r"index out of range in self", r"while running its program \(pjit\(<lambda>\)\), so rank 0 stops too:\n  IndexError: index out of range")),
}

CASES_2D = {
    "2d_megatron_ok": (c2_megatron_ok, OK),
    "2d_shape_differs_on_rank_3": (c2_shape_differs_on_rank_3, E("RankMismatchError", r"rank 3 differs from rank 0")),
    "2d_compile_error_on_rank_2": (c2_compile_error_on_rank_2, fails_on(2, "ValueError", r"does not divide", "to build its program")),
    "2d_cache_hit_divergence_on_rank_3": (c2_cache_hit_divergence_on_rank_3, E("RankMismatchError", r"rank 3 differs from rank 0")),
    "2d_seed_differs_on_rank_2": (c2_seed_differs_on_rank_2, E("RankMismatchError", r"rank 2: seed 3 offset 0")),
}

FATAL_2D = {
    "2d_index_error_on_rank_2": (c2_index_error_on_rank_2, fails_on(
        2, "IndexError", r"index out of range in self", r"while running its program.*\n  IndexError: index out of range")),
}


# -- running the cases ------------------------------------------------------------------------

def _outcome(fn):
    t0 = time.monotonic()
    try:
        fn()
        status = ("ok", [], "")
    except AssertionError as e:                 # a case's own check: a wrong result
        status = ("wrong", ["AssertionError"], str(e))
    except BaseException as e:  # noqa: BLE001
        notes = getattr(e, "__notes__", [])
        msg = str(e) + ("\nNOTES: " + "\n".join(notes) if notes else "")
        status = ("raised", [c.__name__ for c in type(e).__mro__], msg)
    return status + (time.monotonic() - t0,)


def _run_batch(table: str, names: list[str]) -> dict:
    cases = globals()[table]
    return {name: _outcome(cases[name][0]) for name in names}


def _check(name: str, expected, outcomes: list) -> list[str]:
    """Problems with one case's per-rank outcomes (empty if it behaved)."""
    problems = []

    def match(rank, exp, got):
        status, mro, msg, _ = got
        if exp[0] == "ok":
            if status != "ok":
                problems.append(f"{name} rank {rank}: expected a result, got {status} {mro[:1]}: {msg[:600]}")
        elif status != "raised" or exp[1] not in mro:
            problems.append(f"{name} rank {rank}: expected {exp[1]}, got {status} {mro[:1]}: {msg[:600]}")
        elif not re.search(exp[2], msg, re.DOTALL):
            problems.append(f"{name} rank {rank}: {exp[1]} message does not match {exp[2]!r}:\n{msg[:1500]}")

    for rank, got in enumerate(outcomes):
        if expected[0] in ("ok", "raise"):
            match(rank, expected, got)
        elif expected[0] == "fails_on":
            _, bad, own, other = expected
            match(rank, own if rank == bad else other, got)
    return problems


def _run_table(on_ranks, world: int, table: str, names: list[str], timeout: float) -> None:
    results = on_ranks(world, _run_batch, table, names, timeout=timeout)
    cases = globals()[table]
    problems = []
    for name in names:
        problems += _check(name, cases[name][1], [r[name] for r in results])
    assert not problems, "\n\n".join(problems)


def test_catalogue_has_enough_cases():
    assert len(CASES) + len(FATAL) + len(CASES_2D) + len(FATAL_2D) >= 80


@pytest.mark.parametrize("part", [0, 1])
def test_catalogue_on_2_ranks(on_ranks, part):
    names = sorted(CASES)[part::2]
    _run_table(on_ranks, 2, "CASES", names, timeout=240)


@pytest.mark.parametrize("name", sorted(FATAL))
def test_catalogue_failure_while_running(on_ranks, name):
    _run_table(on_ranks, 2, "FATAL", [name], timeout=120)


def test_catalogue_on_a_2x2_mesh(on_ranks):
    _run_table(on_ranks, 4, "CASES_2D", sorted(CASES_2D), timeout=240)
    _run_table(on_ranks, 4, "FATAL_2D", sorted(FATAL_2D), timeout=120)
