"""Counter-based random numbers (Philox4x32-10, Random123) in pure torch ops.

Guarantee: for every sampler here, the value of the element with global
row-major linear index ``i`` is a pure function of ``(seed, offset, i)``
(plus dtype and distribution parameters).  It does not depend on which other
indices are drawn in the same call, on the shape of the tensor or shard, on
the device, or on the mesh.  A shard draws its part of a tensor by passing
the global indices of the elements it holds (``global_indices``), or the region
``(global_shape, sizes, starts)`` of its block; the result is bitwise equal to
the matching slice of the full draw.

Counter layout: a draw needing ``k`` words per element (1 for 32-bit draws:
bits, float32/16/bf16 uniform, bernoulli, randint; 2 for float64 uniform and
float32 normal; 4 for float64 normal) packs ``4 // k`` consecutive elements in
one Philox block.  Element ``i`` takes words ``[s*k, s*k + k)`` of block
``b = i // (4 // k)``, ``s = i % (4 // k)``, with::

    counter = [lo32(b), hi32(b), lo32(offset), hi32(offset)]
    key     = [lo32(seed), hi32(seed)]

A region whose rows are whole blocks runs Philox once per block, ``4 // k``
times less work than once per element (``_words``).

Offset unit: one *draw*.  ``offset`` has its own counter words, so draws at
different offsets never share a counter, whatever their sizes (i, offset <
2**64).  A tracker therefore advances the offset by ``counts(numel) == 1``
per draw; any larger step is equally safe.

``seed`` and ``offset`` may be Python ints or 0-dim int64 tensors (e.g. graph
inputs under ``make_fx``).  Everything is int64 arithmetic with explicit
32-bit masks and no data-dependent control flow, so results are identical on
CPU and CUDA and the functions trace under ``make_fx(tracing_mode="fake")``.
"""
import math

import torch
from torch import Tensor

__all__ = ["philox4x32", "counter", "uniform_bits", "uniform", "normal",
           "bernoulli", "randint", "global_indices", "counts"]

_M0, _M1 = 0xD2511F53, 0xCD9E8D57        # Philox round multipliers
_W0, _W1 = 0x9E3779B9, 0xBB67AE85        # Weyl key increments
_MASK = 0xFFFFFFFF


def _mulhilo(a, m: int):
    """Exact ``(hi32, lo32)`` of the 64-bit product ``a * m``.

    ``a`` holds uint32 values in int64; ``m`` is a uint32 constant.  A plain
    int64 ``a * m`` can exceed 2**63, so for ``m >= 2**31`` we multiply by
    ``m' = m - 2**32`` instead: ``|a * m'| < 2**63`` (no overflow, no reliance
    on wrap-around), ``a * m = a * m' + a * 2**32``, hence
    ``lo = (a*m') & 0xffffffff`` (two's complement) and
    ``hi = ((a*m') >> 32) + a`` (arithmetic shift = floor division), which is
    already in [0, 2**32).  4 elementwise ops per call.
    """
    if m >= 2**31:
        p = a * (m - 2**32)
        return (p >> 32) + a, p & _MASK
    p = a * m
    return p >> 32, p & _MASK


def _philox(c0, c1, c2, c3, k0, k1, rounds: int = 10):
    """Philox4x32 on broadcastable uint32-in-int64 words (tensors or ints)."""
    for r in range(rounds):
        if r:
            k0, k1 = (k0 + _W0) & _MASK, (k1 + _W1) & _MASK
        hi0, lo0 = _mulhilo(c0, _M0)
        hi1, lo1 = _mulhilo(c2, _M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def philox4x32(counter: Tensor, key: Tensor, rounds: int = 10) -> Tensor:
    """Random123 ``philox4x32_R``: int64 ``counter[..., 4]`` and ``key[..., 2]``
    holding uint32 values -> int64 ``[..., 4]`` of uint32 values."""
    c, k = counter.unbind(-1), key.unbind(-1)
    out = _philox(c[0], c[1], c[2], c[3], k[0], k[1], rounds)
    return torch.stack(torch.broadcast_tensors(*out), -1)


def _split(x, device):
    if isinstance(x, Tensor):
        x = x.to(device=device, dtype=torch.int64)
    return x & _MASK, (x >> 32) & _MASK


def counter(offset, index: Tensor) -> Tensor:
    """The Philox counter ``[..., 4]`` of block ``index`` at ``offset``."""
    i0, i1 = _split(index.long(), index.device)
    o0, o1 = _split(offset, index.device)
    z = torch.zeros_like(i0)
    return torch.stack([i0, i1, z + o0, z + o1], -1)


def _block(seed, offset, index: Tensor):
    dev = index.device
    return _philox(*_split(index.long(), dev), *_split(offset, dev), *_split(seed, dev))


def counts(numel: int) -> int:
    """Offset advance for a draw of ``numel`` elements: always 1 (one draw)."""
    return 1


def _words(seed, offset, where, k: int) -> Tensor:
    """``k`` random words per element, shaped ``[k, *shape]``.

    Element ``i`` takes words ``[s*k, s*k + k)`` of Philox block ``i // (4 // k)``,
    where ``s = i % (4 // k)``: one Philox call serves ``4 // k`` consecutive elements.
    ``where`` is a tensor of global indices, or a region ``(global_shape, sizes,
    starts)`` of a row-major tensor: then, when the region's rows are whole blocks
    (the last dim's size, start and global size all divide by ``4 // k``), Philox runs
    once per block instead of once per element (the same bits, ~``4 // k`` x less work).
    """
    per = 4 // k
    if isinstance(where, tuple):
        shape, sizes, starts = where[:3]
        device = where[3] if len(where) > 3 else None
        if shape and shape[-1] % per == 0 and sizes[-1] % per == 0 and starts[-1] % per == 0:
            blocks = global_indices((*shape[:-1], shape[-1] // per), (*sizes[:-1], sizes[-1] // per),
                                    (*starts[:-1], starts[-1] // per), device)
            w = torch.stack(_block(seed, offset, blocks), -1)           # [..., n / per, 4]
            return w.reshape(*sizes, k).movedim(-1, 0)
        where = global_indices(shape, sizes, starts, device)
    index = where.long()
    w = torch.stack(_block(seed, offset, index // per), -1)              # [..., 4]
    if per > 1:
        slot = (index % per).unsqueeze(-1) * k + torch.arange(k, device=index.device)
        w = torch.gather(w, -1, slot)
    return w.movedim(-1, 0)


def uniform_bits(seed, offset, where) -> Tensor:
    """Uniform uint32 values (as int64) for the elements of ``where``."""
    return _words(seed, offset, where, 1)[0]


def _unit(w0, w1, dtype):
    """Words -> [0, 1) in ``dtype``, exactly k * 2**-m (never 1.0)."""
    if dtype == torch.float64:                           # 53 bits from 2 words
        return ((w0 >> 5) * 2**26 + (w1 >> 6)).to(torch.float64) * 2.0**-53
    m = 1 - round(math.log2(torch.finfo(dtype).eps))     # 24 f32, 11 f16, 8 bf16
    return ((w0 >> (32 - m)).to(torch.float32) * 2.0**-m).to(dtype)


def uniform(seed, offset, where, dtype=torch.float32) -> Tensor:
    """Uniform floats in [0, 1): float64 uses 53 bits (2 words per element), other
    float dtypes their mantissa width from 1 word (24 bits for float32, 11 float16,
    8 bfloat16), so 1.0 is never produced."""
    if dtype == torch.float64:
        w = _words(seed, offset, where, 2)
        return _unit(w[0], w[1], dtype)
    return _unit(_words(seed, offset, where, 1)[0], None, dtype)


def normal(seed, offset, where, dtype=torch.float32) -> Tensor:
    """Standard normals via Box-Muller (cosine branch), u1 in (0, 1]: float64 from
    two 53-bit uniforms (4 words per element), other dtypes from two float32
    uniforms (2 words), then cast."""
    if dtype == torch.float64:
        w = _words(seed, offset, where, 4)
        u1 = 1.0 - _unit(w[0], w[1], dtype)
        u2 = _unit(w[2], w[3], dtype)
    else:
        w = _words(seed, offset, where, 2)
        u1 = 1.0 - _unit(w[0], None, torch.float32)
        u2 = _unit(w[1], None, torch.float32)
    z = torch.sqrt(-2.0 * torch.log(u1)) * torch.cos((2.0 * math.pi) * u2)
    return z.to(dtype)


def bernoulli(seed, offset, where, p) -> Tensor:
    """Bool mask ``u < p`` with ``u = word * 2**-32`` (exact in float64); ``p`` is a
    float or a tensor broadcastable with the elements."""
    return uniform_bits(seed, offset, where).to(torch.float64) * 2.0**-32 < p


def randint(seed, offset, where, low: int, high: int, dtype=torch.int64) -> Tensor:
    """Integers in [low, high) by multiply-shift ``(bits * r) >> 32`` with
    ``r = high - low <= 2**32`` (computed with 16-bit halves, no overflow).
    Each value gets floor or ceil of 2**32 / r words: relative bias <= r / 2**32."""
    r = high - low
    if not 0 < r <= 2**32:
        raise ValueError(f"randint needs 0 < high - low <= 2**32, got {r}")
    w = uniform_bits(seed, offset, where)
    q = ((w >> 16) * r + (((w & 0xFFFF) * r) >> 16)) >> 16
    return (q + low).to(dtype)


def global_indices(global_shape, local_shape, local_offsets, device=None) -> Tensor:
    """Global row-major linear indices (int64, shaped ``local_shape``) of the
    block of a ``global_shape`` tensor starting at ``local_offsets`` per dim.
    Offsets may be ints or 0-dim int64 tensors."""
    nd = len(global_shape)
    if not len(local_shape) == len(local_offsets) == nd:
        raise ValueError("global_shape, local_shape, local_offsets ranks differ")
    idx = torch.zeros((), dtype=torch.int64, device=device)
    stride = 1
    for d in reversed(range(nd)):
        n, off = local_shape[d], local_offsets[d]
        if isinstance(off, int) and not (0 <= off and off + n <= global_shape[d]):
            raise ValueError(f"block {off}:{off + n} outside dim {d} of {global_shape}")
        shape = [1] * nd
        shape[d] = n
        a = torch.arange(n, dtype=torch.int64, device=device) + off
        idx = idx + (a * stride).view(shape)
        stride *= global_shape[d]
    return idx
