"""Exact-arithmetic rounding to small floating-point formats, as Triton helpers and their torch
twins.

Both sides round the same way with the same fp32 operations, so they give the same bits in the
Triton interpreter, compiled on a GPU, in torch, and in the CPU's native kernels (native.py).
Triton's own fp8 casts are wrong in the interpreter (ties, carries, saturation), so no kernel
relies on them.

A format is (EBITS, MBITS, BIAS, MAX): E4M3 = (4, 3, 7, 448), E5M2 = (5, 2, 15, 57344),
E2M1 = (2, 1, 1, 6). Its smallest normal exponent is 1 - BIAS. Values are rounded to nearest
even, or stochastically with a counter-based hash (same stream in torch and Triton), and saturate
at MAX. Codes carry the sign in their top bit.
"""
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

RNE_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2**23: (v + M) - M rounds |v| < 2**22 to nearest even


@dataclass(frozen=True)
class FloatFormat:
    name: str
    ebits: int
    mbits: int
    bias: int
    max: float

    @property
    def emin(self):
        return 1 - self.bias

    @property
    def bits(self):
        return 1 + self.ebits + self.mbits


E4M3 = FloatFormat("e4m3", 4, 3, 7, 448.0)
E5M2 = FloatFormat("e5m2", 5, 2, 15, 57344.0)
E2M1 = FloatFormat("e2m1", 2, 1, 1, 6.0)


# ---------------------------------------------------------------- Triton
# Every launch passes these. By default the GPU compiler contracts a * b + c into one fused
# multiply-add, rounded once where the torch references (and the interpreter) round twice: the
# residual y - q * scale and the fp32 sums of decoded payloads would differ in the last bit.
EXACT_ARITHMETIC = {"enable_fp_fusion": False}

@triton.jit
def _pow2(e):
    """2**e as fp32 for an int32 tensor e in [-126, 127], built from its bits."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def uniform_hash(seed, index):
    """A uniform float in [0, 1) for (seed, element index): lowbias32 applied twice."""
    h = index.to(tl.uint32) ^ (seed.to(tl.uint32) * 0x9E3779B9)
    h = h ^ (h >> 16)
    h = h * 0x7FEB352D
    h = h ^ (h >> 15)
    h = h * 0x846CA68B
    h = h ^ (h >> 16)
    h = h * 0x7FEB352D
    h = h ^ (h >> 15)
    return (h >> 8).to(tl.float32) * 5.9604644775390625e-08


@triton.jit
def is_nonfinite(x):
    return ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) == 0xFF


@triton.jit
def encode_float(v, noise, EBITS: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr,
                 MAX: tl.constexpr, STOCHASTIC: tl.constexpr):
    """Codes (int32, sign in bit EBITS+MBITS) of finite fp32 values v; noise in [0, 1) if
    STOCHASTIC."""
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 31) & 1
    a = tl.abs(v)
    e = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, 1 - BIAS)
    units = a * _pow2(MBITS - e)               # exact: a power-of-two scaling, < 2**(MBITS+1)
    if STOCHASTIC:
        whole = tl.floor(units)
        rounded = whole + (noise < units - whole).to(tl.float32)
    else:
        rounded = (units + RNE_MAGIC) - RNE_MAGIC
    q = tl.minimum(rounded * _pow2(e - MBITS), MAX)
    qbits = q.to(tl.int32, bitcast=True)
    qe = (qbits >> 23) - 127
    normal = ((qe + BIAS) << MBITS) | ((qbits >> (23 - MBITS)) & ((1 << MBITS) - 1))
    subnormal = (q * _pow2(tl.full(q.shape, MBITS - 1 + BIAS, tl.int32))).to(tl.int32)
    code = tl.where(qe >= 1 - BIAS, normal, subnormal)
    return tl.where(code == 0, 0, code | (sign << (EBITS + MBITS)))  # no negative zero


@triton.jit
def encode_float_seeded(v, offs, seed, EBITS: tl.constexpr, MBITS: tl.constexpr,
                        BIAS: tl.constexpr, MAX: tl.constexpr, STOCHASTIC: tl.constexpr):
    """encode_float of a tile v whose element indices are offs: with STOCHASTIC, its noise is
    uniform_hash(seed, offs)."""
    if STOCHASTIC:
        noise = uniform_hash(seed, offs)
    else:
        noise = v   # not read: rounding to nearest even takes no noise
    return encode_float(v, noise, EBITS, MBITS, BIAS, MAX, STOCHASTIC)


@triton.jit
def decode_float(code, EBITS: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr):
    """fp32 values of int32 codes."""
    code = code.to(tl.int32)
    sign = (code >> (EBITS + MBITS)) & 1
    ef = (code >> MBITS) & ((1 << EBITS) - 1)
    m = code & ((1 << MBITS) - 1)
    normal = (((ef - BIAS + 127) << 23) | (m << (23 - MBITS))).to(tl.float32, bitcast=True)
    subnormal = m.to(tl.float32) * _pow2(tl.full(m.shape, 1 - BIAS - MBITS, tl.int32))
    value = tl.where(ef > 0, normal, subnormal)
    return (value.to(tl.int32, bitcast=True) | (sign << 31)).to(tl.float32, bitcast=True)


# ---------------------------------------------------------------- torch
def blocks_torch(x, block_size):
    """Flat x as (blocks, block_size) rows, zero-padded only when the last block is partial."""
    pad = -x.numel() % block_size
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    # the rows' count as n // block_size, the form other views of x take
    return x.view(-1, block_size)


def tensor_scale_torch(amax, divisor):
    """The fp32 scale amax / divisor (FP8: the format's largest value; NVFP4 and INT3, a tensor
    scale: the grid maximum times E4M3's 448); NaN for a non-finite amax, so all it scales
    decodes to NaN."""
    amax = amax.to(torch.float32)
    nan = torch.full_like(amax, float("nan"))
    return torch.where(torch.isfinite(amax), amax / divisor, nan)


def pow2_torch(e):
    return ((e + 127) << 23).to(torch.int32).view(torch.float32)


def uniform_hash_torch(seed, index):
    """The same stream as `uniform_hash`, with int64 arithmetic masked to 32 bits."""
    m = 0xFFFFFFFF
    h = (index.to(torch.int64) & m) ^ ((int(seed) * 0x9E3779B9) & m)
    h = h ^ (h >> 16)
    h = (h * 0x7FEB352D) & m
    h = h ^ (h >> 15)
    h = (h * 0x846CA68B) & m
    h = h ^ (h >> 16)
    h = (h * 0x7FEB352D) & m
    h = h ^ (h >> 15)
    return (h >> 8).to(torch.float32) * 5.9604644775390625e-08


def element_noise_torch(seed, v):
    """Stochastic rounding's noise for each element of v (in v's shape): uniform_hash_torch of
    its flat index, as encode_float_seeded draws it."""
    return uniform_hash_torch(seed, torch.arange(v.numel(), device=v.device)).view_as(v)


def encode_float_torch(v, fmt: FloatFormat, noise=None):
    """Codes (int32) of finite fp32 values v: the twin of `encode_float`."""
    bits = v.view(torch.int32)
    sign = (bits >> 31) & 1
    a = v.abs()
    e = torch.clamp_min(((a.view(torch.int32) >> 23) & 0xFF) - 127, fmt.emin)
    units = a * pow2_torch(fmt.mbits - e)
    if noise is not None:
        whole = torch.floor(units)
        rounded = whole + (noise < units - whole).to(torch.float32)
    else:
        rounded = _round_even(units)
    q = torch.clamp_max(rounded * pow2_torch(e - fmt.mbits), fmt.max)
    qbits = q.view(torch.int32)
    qe = (qbits >> 23) - 127
    normal = ((qe + fmt.bias) << fmt.mbits) | ((qbits >> (23 - fmt.mbits)) & ((1 << fmt.mbits) - 1))
    subnormal = (q * 2.0 ** (fmt.mbits - fmt.emin)).to(torch.int32)
    code = torch.where(qe >= fmt.emin, normal, subnormal)
    return torch.where(code == 0, 0, code | (sign << (fmt.ebits + fmt.mbits)))


def round_e2m1_nearest_torch(v):
    """E2M1 codes (int32) of v and their values, round to nearest even and saturate (NaN -> 0),
    without bit casts: the grid 0, .5, 1, 1.5 | 2, 3 | 4, 6 has
    steps .5, 1 and 2, so the code is an even-rounded multiple of the step plus an offset per range.
    One rounding with a per-range multiplier, and NaN sent to 0 by comparisons (nan_to_num compiles
    to a scalar loop): the quantize stage with error feedback runs in 28-32 ms instead of 42-47 (1e7
    elements). The codes equal encode_float_torch(v, E2M1) for finite v; the values are
    decode_e2m1_torch's of them, computed here so the error-feedback residual needs no pass over
    the codes."""
    a = v.abs()
    a = torch.where(a < 6.0, a, torch.where(a >= 6.0, 6.0, 0.0))   # NaN compares false both ways
    low, mid = a < 2.0, a < 4.0
    units = _round_even(a * torch.where(low, 2.0, torch.where(mid, 1.0, 0.5)))
    code = (units + torch.where(low, 0.0, torch.where(mid, 2.0, 4.0))).to(torch.int32)
    negative = (v < 0) & (code > 0)
    code = torch.where(negative, code + 8, code)
    value = units * torch.where(low, 0.5, torch.where(mid, 1.0, 2.0))   # units x the step: exact
    return code, torch.where(negative, -value, value)


def _round_even(t):
    """Nearest integer, ties to even, for 0 <= t < 2**22."""
    return (t + 12582912.0) - 12582912.0


def decode_e2m1_torch(code):
    """Values of E2M1 codes (see round_e2m1_nearest_torch)."""
    m = (code & 7).to(torch.float32)
    value = torch.where(m < 4.0, m * 0.5, torch.where(m < 6.0, m - 2.0, m * 2.0 - 8.0))
    return torch.where(code >= 8, -value, value)
