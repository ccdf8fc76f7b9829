"""Random ops inside pjit: every element has its single-device value, bitwise,
whatever the mesh and the layout; the state is explicit and restorable."""

import pytest
import torch
import torch.nn.functional as F

from sharded import Mesh, P, gather
from sharded import random as srandom
from transforms import pjit


def draws(x):
    return (
        F.dropout(x, 0.5),
        torch.func.functional_call(torch.nn.Dropout(0.25), {}, (x,)),
        torch.rand(8, 6),
        torch.randn_like(x),
        torch.randint(0, 10, (8, 6)),
        x.bernoulli(0.3),
        torch.bernoulli(torch.sigmoid(x)),
        torch.empty(8, 6).uniform_(-2.0, 3.0),
        torch.empty(8, 6).normal_(1.0, 0.5),
        torch.ops.aten.native_dropout.default(x, 0.4, True)[0],   # dropout as traced on CUDA
    )


X = torch.linspace(-1, 1, 48).reshape(8, 6)


def _run(mesh_shape, names, spec, out_spec, seed=1234):
    mesh = Mesh(mesh_shape, names)
    srandom.manual_seed(seed)
    f = pjit(draws, in_specs=spec, out_specs=out_spec, mesh=mesh)
    first, second = f(X), f(X)
    locals_ = [t.to_local() for t in first]
    return gather(first), gather(second), locals_, mesh.coordinate()


def _reference(seed=1234):
    """The same program on a world of one (the single-device values)."""
    full, second, _, _ = _run((1,), ("dp",), P(), P(), seed)
    return full, second


LAYOUTS = [
    (2, (2,), ("dp",), P("dp"), None),
    (2, (2,), ("dp",), P(None, "dp"), P(None, "dp")),
    (2, (2,), ("dp",), P("dp"), P()),
    (4, (4,), ("dp",), P("dp"), P("dp")),
    (4, (2, 2), ("dp", "tp"), P("dp", "tp"), P("dp", "tp")),
    (4, (2, 2), ("dp", "tp"), P(("dp", "tp")), P()),
]


@pytest.mark.parametrize("ws, shape, names, spec, out_spec", LAYOUTS)
def test_bitwise_equal_to_one_device_for_any_mesh_and_layout(on_ranks, ws, shape, names, spec, out_spec):
    ref_first, ref_second = _reference()
    for full, second, locals_, coord in on_ranks(ws, _run, shape, names, spec, out_spec):
        for a, b in zip(full, ref_first):
            assert torch.equal(a, b)
        for a, b in zip(second, ref_second):
            assert torch.equal(a, b)
        if out_spec == P():   # replicated: every rank holds the whole single-device value
            for a, b in zip(locals_, ref_first):
                assert torch.equal(a, b)
    # Two calls draw different numbers.
    assert not torch.equal(ref_first[2], ref_second[2])


def test_state_restores_and_seeds_differ():
    mesh = Mesh((1,), ("dp",))
    f = pjit(lambda: torch.rand(5), in_specs=(), mesh=mesh)
    srandom.manual_seed(7)
    state = srandom.get_rng_state()
    a, b = f().full_tensor(), f().full_tensor()
    assert srandom.get_rng_state()["offset"] == state["offset"] + 2
    srandom.set_rng_state(state)
    assert torch.equal(f().full_tensor(), a) and torch.equal(f().full_tensor(), b)
    srandom.manual_seed(8)
    assert not torch.equal(f().full_tensor(), a)
    with pytest.raises(ValueError, match="set_rng_state expects a dict from get_rng_state"):
        srandom.set_rng_state({"seed": 1})
    # A state without a seed takes one again (from rank 0) at the next call.
    srandom.set_rng_state({"seed": None, "offset": 0})
    f()
    assert srandom.get_rng_state()["seed"] is not None


def _seed_from_rank_0():
    import torch.distributed as dist

    srandom.set_rng_state({"seed": None, "offset": 0})
    torch.manual_seed(100 + dist.get_rank())      # ranks' torch seeds differ
    mesh = Mesh((2,), ("dp",))
    out = pjit(lambda: torch.rand(4), in_specs=(), out_specs=P(), mesh=mesh)()
    return out.to_local(), srandom.get_rng_state()["seed"]


def test_ranks_agree_on_the_seed_without_manual_seed(on_ranks):
    (a, seed_a), (b, seed_b) = on_ranks(2, _seed_from_rank_0)
    assert seed_a == seed_b == 100 and torch.equal(a, b)


def _dropout_step(mesh_shape, names):
    mesh = Mesh(mesh_shape, names)
    srandom.manual_seed(99)
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(6, 6, generator=g), torch.randn(8, 6, generator=g)

    def loss(w, x):
        return F.dropout(torch.tanh(x @ w), 0.3).pow(2).mean()

    step = pjit(torch.func.grad_and_value(loss), in_specs=(P(), P(names[0])), mesh=mesh)
    return gather(step(w, x))


def test_dropout_train_step_gradients_match_one_device(on_ranks):
    ref_grad, ref_loss = _dropout_step((1,), ("dp",))
    for grad, loss in on_ranks(2, _dropout_step, (2,), ("dp",)):
        torch.testing.assert_close(loss, ref_loss)
        torch.testing.assert_close(grad, ref_grad)
    # and the mask really is random: some, not all, elements dropped
    mesh = Mesh((1,), ("dp",))
    srandom.manual_seed(3)
    kept = pjit(lambda x: F.dropout(x, 0.3) != 0, in_specs=P(), mesh=mesh)(torch.ones(200_000))
    rate = kept.full_tensor().float().mean().item()
    assert abs(rate - 0.7) < 0.005, rate   # ~7 sigma


def test_unsupported_random_op_is_an_error():
    mesh = Mesh((1,), ("dp",))
    f = pjit(lambda: torch.randperm(6), in_specs=(), mesh=mesh)
    with pytest.raises(NotImplementedError, match=r"random op aten.randperm.default has no counter-based rewrite yet"):
        f()


def test_attention_with_and_without_dropout():
    # On CPU, attention dropout decomposes into ops the rewrite covers; without
    # dropout the attention kernel is not a random op.
    mesh = Mesh((1,), ("dp",))
    q = torch.randn(1, 2, 4, 8)
    plain = pjit(lambda q: F.scaled_dot_product_attention(q, q, q), in_specs=P(), mesh=mesh)
    torch.testing.assert_close(plain(q).full_tensor(), F.scaled_dot_product_attention(q, q, q))
    drop = pjit(lambda q: F.scaled_dot_product_attention(q, q, q, dropout_p=0.5), in_specs=P(), mesh=mesh)
    srandom.manual_seed(5)
    a = drop(q).full_tensor()
    srandom.manual_seed(5)
    assert torch.equal(drop(q).full_tensor(), a)
    assert not torch.allclose(a, F.scaled_dot_product_attention(q, q, q))


def test_attention_kernel_with_dropout_is_an_error():
    mesh = Mesh((1,), ("dp",))
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    f = pjit(lambda q: flash(q, q, q, 0.1)[0], in_specs=P(), mesh=mesh)
    with pytest.raises(NotImplementedError, match=r"with dropout_p > 0 \(attention dropout\) has no counter-based rewrite yet"):
        f(torch.randn(1, 2, 4, 8))


def test_compiled_local_graph_draws_the_same_bits():
    from sharded.modes import DTensorExpandMode

    mesh = Mesh((1,), ("dp",))
    x = torch.randn(64)
    outs = []
    for mode in (DTensorExpandMode(), DTensorExpandMode(compile=True)):
        srandom.manual_seed(11)
        outs.append(pjit(lambda x: (F.dropout(x, 0.5), torch.rand(64)), in_specs=P(), mesh=mesh, mode=mode)(x))
    for a, b in zip(*outs):
        assert torch.equal(a.full_tensor(), b.full_tensor())


def test_values_follow_the_documented_formula():
    """Draw d of a program at state (seed, offset) is Philox(seed, offset + d, i), as
    docs/random.md says (the seed and offset inputs were once fed swapped)."""
    mesh = Mesh((1,), ("dp",))
    f = pjit(lambda x: (torch.rand(6) + x, torch.rand(6) + x), in_specs=P(), mesh=mesh)
    srandom.set_rng_state({"seed": 11, "offset": 5})
    a, b = (t.full_tensor() for t in f(torch.zeros(())))
    idx = torch.arange(6)
    assert torch.equal(a, srandom.uniform(11, 5, idx, torch.float32))
    assert torch.equal(b, srandom.uniform(11, 6, idx, torch.float32))
