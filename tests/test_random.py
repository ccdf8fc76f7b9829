"""Random ops inside pjit: every element has its single-device value, bitwise,
whatever the mesh and the layout; the state is explicit and restorable."""

import math

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


# -- each op's distribution against its own arguments and against torch's op ---------------
# NOTE [Statistical checks that cannot fail by chance]
# The reference of the tests above is the same program on a world of one, which goes
# through the same rewrite: an argument swapped or ignored by the rewrite would pass
# them. Here each op's draws are checked against the distribution its arguments name,
# from first principles, and against torch's own op (a two-sample Kolmogorov-Smirnov
# distance, or frequencies). N = 2**16 draws each; every bound is at least 10 standard
# errors (chance of a false failure < 1e-22 each: the seed is fixed, so a pass is a
# pass forever), and far inside what a swapped or ignored argument moves (>= 0.2).

N = 1 << 16
LO, HI = -3, 7                     # randint's range (asymmetric: a dropped low fails)
A, B = -2.0, 3.0                   # uniform_'s bounds
MU, SIGMA = 3.0, 0.25              # normal_'s mean and std (swapped: mean 0.25, std 3)
PS = torch.tensor([0.0, 0.05, 0.3, 0.5, 0.9, 1.0])     # bernoulli's probabilities, by row


def _ops(x64, p):
    return {
        "rand": torch.rand(N),
        "uniform_": torch.empty(N).uniform_(A, B),
        "normal_": torch.empty(N).normal_(MU, SIGMA),
        "randint": torch.randint(LO, HI, (N,)),
        "randint_high": torch.randint(HI, (N,)),
        "bernoulli": torch.bernoulli(p),
        "bernoulli_p": torch.zeros(N).bernoulli(0.3),
        "rand_like": torch.rand_like(x64),
        "randn_like": torch.randn_like(x64),
    }


def _torch_ops(x64, p):
    """torch's own ops with torch's generator: the statistics to agree with."""
    torch.manual_seed(0)
    return _ops(x64, p)


def _ks(a, b) -> float:
    """Two-sample Kolmogorov-Smirnov distance."""
    a, b = a.double().flatten().sort().values, b.double().flatten().sort().values
    v = torch.cat([a, b])
    fa = torch.searchsorted(a, v, right=True).double() / a.numel()
    fb = torch.searchsorted(b, v, right=True).double() / b.numel()
    return (fa - fb).abs().max().item()


# sqrt(-ln(alpha / 2) / 2) * sqrt(2 / N) at alpha = 1e-22: 0.028 for N = 2**16
KS_BOUND = math.sqrt(-math.log(0.5e-22) / 2) * math.sqrt(2 / N)


def _moments(x, mean, std):
    """Sample mean and std within 10 standard errors of ``mean`` and ``std`` (the std's
    standard error as for a normal sample, which bounds a uniform one's too)."""
    x = x.double()
    m, s = x.mean().item(), x.std().item()
    assert abs(m - mean) < 10 * std / math.sqrt(N), (m, mean)
    assert abs(s - std) < 10 * std / math.sqrt(2 * N), (s, std)


def _check_distributions(out, ref, x64, p):
    # rand / rand_like: [0, 1), mean 1/2, std 1/sqrt(12); rand_like keeps the dtype
    for name in ("rand", "rand_like"):
        u = out[name]
        assert u.dtype == (torch.float64 if name == "rand_like" else torch.float32), (name, u.dtype)
        assert u.shape == ref[name].shape
        assert 0.0 <= u.min().item() < 1e-3 and 1 - 1e-3 < u.max().item() < 1.0, name
        _moments(u, 0.5, 1 / math.sqrt(12))
        assert _ks(u, ref[name]) < KS_BOUND, name
    # uniform_(A, B): within [A, B), reaching both ends, the moments of U(A, B)
    u = out["uniform_"]
    assert A <= u.min().item() < A + 1e-2 and B - 1e-2 < u.max().item() < B, (u.min(), u.max())
    _moments(u, (A + B) / 2, (B - A) / math.sqrt(12))
    assert _ks(u, ref["uniform_"]) < KS_BOUND
    # normal_(MU, SIGMA), randn_like: the moments, the mass within one sigma, torch's
    _moments(out["normal_"], MU, SIGMA)
    assert _ks(out["normal_"], ref["normal_"]) < KS_BOUND
    z = out["randn_like"]
    assert z.dtype == torch.float64 and z.shape == x64.shape
    _moments(z, 0.0, 1.0)
    within = (z.abs() < 1).double().mean().item()    # 0.6827 for N(0, 1); sd 0.0018
    assert abs(within - math.erf(1 / math.sqrt(2))) < 0.02, within
    assert _ks(z, ref["randn_like"]) < KS_BOUND
    # randint(LO, HI) / randint(HI): int64, exactly the integers of [lo, HI), each with
    # frequency 1 / (HI - lo) (10 sigma of a binomial count), as torch's
    for name, lo in (("randint", LO), ("randint_high", 0)):
        r = out[name]
        assert r.dtype == torch.int64, r.dtype
        values = torch.arange(lo, HI)
        for draws in (r, ref[name]):
            counts = (draws[:, None] == values).sum(0).double()
            assert counts.sum().item() == N, (name, "values outside the range")
            q = 1 / len(values)
            assert ((counts - N * q).abs() < 10 * math.sqrt(N * q * (1 - q))).all(), (name, counts)
    # bernoulli(p): each row's rate is its p (exactly for 0 and 1), as torch's;
    # bernoulli(x, 0.3): rate 0.3
    for draws in (out["bernoulli"], ref["bernoulli"]):
        assert draws.shape == p.shape and set(draws.unique().tolist()) <= {0.0, 1.0}
        rates = draws.double().mean(1)
        sd = (PS * (1 - PS) / p.shape[1]).sqrt()
        assert ((rates - PS).abs() <= 10 * sd).all(), rates
    b = out["bernoulli_p"]
    assert abs(b.double().mean().item() - 0.3) < 10 * math.sqrt(0.21 / N), b.mean()


def test_each_random_op_follows_its_arguments():
    """NOTE [Statistical checks that cannot fail by chance]: each op's draws under pjit
    (a mesh of one; the values are the same on any mesh, as the tests above show)."""
    mesh = Mesh((1,), ("dp",))
    x64 = torch.zeros(N // 4, 4, dtype=torch.float64)
    p = PS[:, None].expand(len(PS), N // 8).contiguous()
    ref = _torch_ops(x64, p)
    srandom.set_rng_state({"seed": 2024, "offset": 0})
    out = {k: v.full_tensor() for k, v in pjit(_ops, in_specs=P(), mesh=mesh)(x64, p).items()}
    _check_distributions(out, ref, x64, p)
    # the documented formula: draw d at state (seed, offset) is Philox(seed, offset + d, i),
    # uniform_(A, B) its A + (B - A) u and normal_(MU, SIGMA) its MU + SIGMA z: a swap of A
    # and B has U(A, B)'s distribution but reverses this order
    idx = torch.arange(N)
    torch.testing.assert_close(out["uniform_"], A + (B - A) * srandom.uniform(2024, 1, idx, torch.float32))
    torch.testing.assert_close(out["normal_"], MU + SIGMA * srandom.normal(2024, 2, idx, torch.float32))
