import math
import random

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from sharded.random import (bernoulli, counter, counts, global_indices, normal,
                            philox4x32, randint, uniform, uniform_bits)
from sharded.random.philox import _mulhilo, _unit

M32 = 0xFFFFFFFF


def _ref_philox(ctr, key, rounds=10):
    """Straightforward Python big-int Philox4x32 (Random123 reference)."""
    c, k = list(ctr), list(key)
    for r in range(rounds):
        if r:
            k = [(k[0] + 0x9E3779B9) & M32, (k[1] + 0xBB67AE85) & M32]
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [(p1 >> 32) ^ c[1] ^ k[0], p1 & M32, (p0 >> 32) ^ c[3] ^ k[1], p0 & M32]
    return c


KATS = [  # Random123 kat_vectors, philox4x32 10 rounds
    ([0, 0, 0, 0], [0, 0], [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]),
    ([M32] * 4, [M32] * 2, [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]),
    ([0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344], [0xA4093822, 0x299F31D0],
     [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]),
]


def test_known_answers():
    ctr = torch.tensor([k[0] for k in KATS])
    key = torch.tensor([k[1] for k in KATS])
    out = philox4x32(ctr, key)
    assert out.dtype == torch.int64
    assert out.tolist() == [k[2] for k in KATS]
    for c, k, expect in KATS:
        assert _ref_philox(c, k) == expect


def test_matches_reference_random_inputs_and_rounds():
    rng = random.Random(0)
    ctrs = [[rng.getrandbits(32) for _ in range(4)] for _ in range(64)]
    keys = [[rng.getrandbits(32) for _ in range(2)] for _ in range(64)]
    for rounds in (1, 7, 10):
        out = philox4x32(torch.tensor(ctrs), torch.tensor(keys), rounds=rounds)
        assert out.tolist() == [_ref_philox(c, k, rounds) for c, k in zip(ctrs, keys)]


def test_mulhilo_exact():
    rng = random.Random(1)
    a = [0, 1, M32, M32 - 1, 0x80000000, 0xFFFF, 0x10000] + [rng.getrandbits(32) for _ in range(200)]
    t = torch.tensor(a)
    for m in (0xD2511F53, 0xCD9E8D57, M32, 0x80000000, 0x7FFFFFFF, 0x1234, 0):
        hi, lo = _mulhilo(t, m)
        assert hi.tolist() == [(x * m) >> 32 for x in a]
        assert lo.tolist() == [(x * m) & M32 for x in a]


def test_seed_offset_int_or_tensor_and_counter_layout():
    idx = torch.arange(10)
    a = uniform_bits(2**40 + 7, 3, idx)
    b = uniform_bits(torch.tensor(2**40 + 7), torch.tensor(3), idx)
    assert torch.equal(a, b)
    c = counter(2**33 + 5, torch.tensor([2**32 + 1]))
    assert c.tolist() == [[1, 1, 5, 2]]
    # 32-bit draws pack 4 elements per Philox block: element 9 is word 1 of block 2.
    ref = _ref_philox([2, 0, 3, 0], [7, 256])
    assert a[9].item() == ref[1]
    assert uniform_bits(-1, -1, idx).min() >= 0 and uniform_bits(-1, -1, idx).max() <= M32


def test_block_equals_slice_of_full_draw():
    gshape = (6, 10)
    full = torch.arange(60).view(gshape)
    assert torch.equal(global_indices(gshape, gshape, (0, 0)), full)
    idx = global_indices(gshape, (3, 4), (2, 5))
    assert torch.equal(idx, full[2:5, 5:9])
    for fn in (uniform_bits,
               lambda s, o, i: uniform(s, o, i),
               lambda s, o, i: uniform(s, o, i, torch.float64),
               lambda s, o, i: uniform(s, o, i, torch.bfloat16),
               lambda s, o, i: normal(s, o, i, torch.float32),
               lambda s, o, i: normal(s, o, i, torch.float64),
               lambda s, o, i: bernoulli(s, o, i, 0.4),
               lambda s, o, i: randint(s, o, i, -5, 17)):
        whole = fn(123, 9, full)
        assert torch.equal(fn(123, 9, idx), whole[2:5, 5:9])
        # order / shape of the request does not matter either
        assert torch.equal(fn(123, 9, idx.flatten().flip(0)), whole[2:5, 5:9].flatten().flip(0))
    # Regions: the per-block fast path (aligned rows) and the per-element path
    # (unaligned) give the bits of the full draw too.
    g = (6, 8)
    full8 = torch.arange(48).view(g)
    for fn in (uniform_bits,
               lambda s, o, i: uniform(s, o, i, torch.float64),
               lambda s, o, i: normal(s, o, i, torch.float32),
               lambda s, o, i: normal(s, o, i, torch.float64),
               lambda s, o, i: randint(s, o, i, 0, 9)):
        whole = fn(5, 2, full8)
        assert torch.equal(fn(5, 2, (g, g, (0, 0))), whole)
        assert torch.equal(fn(5, 2, (g, (3, 4), (2, 4))), whole[2:5, 4:8])   # aligned
        assert torch.equal(fn(5, 2, (g, (3, 3), (1, 5))), whole[1:4, 5:8])   # not aligned
    # a 3-D block
    g3 = (4, 5, 6)
    i3 = global_indices(g3, (2, 3, 2), (1, 2, 4))
    assert torch.equal(i3, torch.arange(120).view(g3)[1:3, 2:5, 4:6])
    assert global_indices((), (), ()).item() == 0
    with pytest.raises(ValueError):
        global_indices((4,), (3,), (2,))


def test_offsets_and_seeds_differ_and_do_not_overlap():
    n, o = 1000, 17
    idx = torch.arange(n)
    a = uniform_bits(5, o, idx)
    b = uniform_bits(5, o + counts(n), idx)
    c = uniform_bits(6, o, idx)
    assert (a != b).float().mean() > 0.99 and (a != c).float().mean() > 0.99
    ca = {tuple(r) for r in counter(o, idx).tolist()}
    cb = {tuple(r) for r in counter(o + counts(n), idx).tolist()}
    assert len(ca) == len(cb) == n and not (ca & cb)
    assert counts(n) >= 1


def test_unit_interval_edges():
    top = torch.tensor([M32, 0])
    for dt in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        u = _unit(top, top, dt)
        assert u.dtype == dt and u[0].item() < 1.0 and u[1].item() == 0.0
    assert _unit(top, top, torch.float64)[0].item() == 1 - 2.0**-53
    assert _unit(top, top, torch.float32)[0].item() == 1 - 2.0**-24
    idx = torch.arange(4096)
    for dt in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        u = uniform(1, 2, idx, dt)
        assert u.dtype == dt and u.min() >= 0 and u.max() < 1
        z = normal(1, 2, idx, dt)
        assert z.dtype == dt and torch.isfinite(z).all()


def test_statistics():
    n = 1 << 20
    idx = torch.arange(n)
    u = uniform(2024, 0, idx, torch.float64)
    assert abs(u.mean().item() - 0.5) < 6 * math.sqrt(1 / 12 / n)
    assert abs(u.var().item() - 1 / 12) < 6 * math.sqrt((1 / 80 - 1 / 144) / n)
    u32 = uniform(2024, 1, idx)
    assert abs(u32.double().mean().item() - 0.5) < 6 * math.sqrt(1 / 12 / n)
    for dt in (torch.float32, torch.float64):
        z = normal(2024, 2, idx, dt).double()
        assert abs(z.mean().item()) < 6 / math.sqrt(n)
        assert abs(z.var().item() - 1) < 6 * math.sqrt(2 / n)
        assert abs((z.abs() < 1).double().mean().item() - 0.682689) < 6 * math.sqrt(0.22 / n)
    p = 0.3
    keep = bernoulli(2024, 3, idx, p).double().mean().item()
    assert abs(keep - p) < 6 * math.sqrt(p * (1 - p) / n)
    r = randint(2024, 4, idx, -3, 7)
    assert r.min().item() == -3 and r.max().item() == 6
    freq = torch.bincount(r + 3, minlength=10).double()
    assert (freq - n / 10).abs().max().item() < 6 * math.sqrt(n * 0.1 * 0.9)
    big = randint(2024, 5, idx[:4096], 0, 2**32)
    assert big.min() >= 0 and big.max() < 2**32 and big.max() > 2**31
    with pytest.raises(ValueError):
        randint(0, 0, idx, 3, 3)


def test_make_fx_fake_trace():
    def f(seed, off, idx):
        return uniform(seed, off, idx), normal(seed, off, idx, torch.float64), \
            bernoulli(seed, off, idx, 0.5), randint(seed, off, idx, 0, 10)

    args = (torch.tensor(11), torch.tensor(2**35 + 4), torch.arange(24).view(4, 6))
    gm = make_fx(f, tracing_mode="fake")(*args)
    for got, want in zip(gm(*args), f(11, 2**35 + 4, args[2])):
        assert torch.equal(got, want)
    # a different seed/offset fed to the same graph gives the eager values
    args2 = (torch.tensor(12), torch.tensor(0), args[2])
    assert torch.equal(gm(*args2)[0], uniform(12, 0, args[2]))
    g2 = make_fx(lambda o: global_indices((8, 8), (2, 3), (o, 1)), tracing_mode="fake")(torch.tensor(0))
    assert torch.equal(g2(torch.tensor(4)), torch.arange(64).view(8, 8)[4:6, 1:4])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    idx = torch.arange(4099)
    for fn in (uniform_bits, lambda s, o, i: normal(s, o, i, torch.float64),
               lambda s, o, i: uniform(s, o, i, torch.bfloat16)):
        cpu = fn(torch.tensor(3), 77, idx)
        gpu = fn(torch.tensor(3), 77, idx.cuda())
        assert gpu.is_cuda and torch.equal(gpu.cpu(), cpu)
    kat = philox4x32(torch.tensor([KATS[2][0]]).cuda(), torch.tensor([KATS[2][1]]).cuda())
    assert kat.tolist() == [KATS[2][2]]
