"""The scalar arithmetic of the native CPU kernels (numba, inlined into them): fp32 bit tricks,
the rounding hash, encoding / decoding a float format, and a block's two-level scale (NVFP4,
INT3), operation for operation as the torch references in rounding.py and two_level.py, so the
same bits.

Exactness rules: every constant is an np.float32 (a Python float would turn the arithmetic into
fp64), bit casts are scalar `.view`s, and rounding to nearest even adds and subtracts 1.5 * 2**23
in fp32 as the references do. numba's LLVM code is IEEE fp32 without fastmath: no contraction of
a * b + c into a fused multiply-add, which would round once where the references round twice.
"""
import numpy as np
from numba import njit

F0 = np.float32(0.0)
F1 = np.float32(1.0)
HALF = np.float32(0.5)
TWO = np.float32(2.0)
FOUR = np.float32(4.0)
SIX = np.float32(6.0)
INF = np.float32(np.inf)
RNE_MAGIC = np.float32(12582912.0)  # 1.5 * 2**23: (v + M) - M rounds 0 <= v < 2**22 to even
HASH_UNIT = np.float32(5.9604644775390625e-08)  # 2**-24
NVFP4_BLOCK = 16
E4M3 = (4, 3, 7, np.float32(448.0))  # (exponent bits, mantissa bits, bias, largest value)
E5M2 = (5, 2, 15, np.float32(57344.0))
E2M1 = (2, 1, 1, np.float32(6.0))
FP8_FORMATS = {"fp8_e4m3": E4M3, "fp8_e5m2": E5M2}
KERNEL = dict(nogil=True, cache=True, error_model="numpy", boundscheck=False)


@njit(inline="always")
def pow2(e):
    """2**e as fp32 for an integer e in [-126, 127], built from its bits."""
    return np.int32((e + 127) << 23).view(np.float32)


@njit(inline="always")
def uniform_hash(seed_term, index):
    """rounding.uniform_hash: a uniform fp32 in [0, 1) for an element index. seed_term is
    (seed * 0x9E3779B9) mod 2**32, computed once by the caller."""
    m = np.uint64(0xFFFFFFFF)
    h = (np.uint64(index) & m) ^ seed_term
    h = h ^ (h >> np.uint64(16))
    h = (h * np.uint64(0x7FEB352D)) & m
    h = h ^ (h >> np.uint64(15))
    h = (h * np.uint64(0x846CA68B)) & m
    h = h ^ (h >> np.uint64(16))
    h = (h * np.uint64(0x7FEB352D)) & m
    h = h ^ (h >> np.uint64(15))
    return np.float32(h >> np.uint64(8)) * HASH_UNIT


@njit(inline="always")
def encode_float(v, noise, ebits, mbits, bias, largest, stochastic):
    """rounding.encode_float: (code, value) of a finite fp32 value, the code's sign in bit
    ebits + mbits, value what decode_float gives for that code (+0 for code 0). The rounded
    magnitude is already that value, so the quantizers' residuals need no decoding."""
    sign = (np.float32(v).view(np.int32) >> 31) & 1
    a = abs(v)
    e = max(((np.float32(a).view(np.int32) >> 23) & 0xFF) - 127, 1 - bias)
    units = a * pow2(mbits - e)  # exact: a power-of-two scaling
    if stochastic:
        whole = np.float32(np.floor(units))
        rounded = whole + (F1 if noise < units - whole else F0)
    else:
        rounded = (units + RNE_MAGIC) - RNE_MAGIC
    q = min(rounded * pow2(e - mbits), largest)
    qbits = np.float32(q).view(np.int32)
    qe = (qbits >> 23) - 127
    normal = ((qe + bias) << mbits) | ((qbits >> (23 - mbits)) & ((1 << mbits) - 1))
    subnormal = np.int32(q * pow2(mbits - 1 + bias))
    code = normal if qe >= 1 - bias else subnormal
    nonzero = code != 0
    signed_code = np.int32(code | (sign << (ebits + mbits)) if nonzero else 0)
    value = np.int32(qbits | (sign << 31) if nonzero else 0).view(np.float32)
    return signed_code, value


@njit(inline="always")
def decode_float(code, ebits, mbits, bias):
    """rounding.decode_float: the fp32 value of a code."""
    sign = (code >> (ebits + mbits)) & 1
    ef = (code >> mbits) & ((1 << ebits) - 1)
    m = code & ((1 << mbits) - 1)
    normal = np.int32(((ef - bias + 127) << 23) | (m << (23 - mbits))).view(np.float32)
    value = normal if ef > 0 else np.float32(m) * pow2(1 - bias - mbits)
    return np.int32(np.float32(value).view(np.int32) | (sign << 31)).view(np.float32)


@njit(inline="always")
def e4m3_block_scale(amax, tensor_scale, grid_max):
    """two_level_scale_torch for one block of NVFP4 or INT3 (grid_max 6 or 3): its E4M3 scale
    code and its denominator, the code's value times the tensor scale."""
    t_usable = tensor_scale > F0 and tensor_scale < INF
    ratio = min(amax / (tensor_scale * grid_max), E4M3[3]) if t_usable else F0
    code, scale = encode_float(ratio, ratio, E4M3[0], E4M3[1], E4M3[2], E4M3[3], False)
    return code, scale * tensor_scale


@njit(inline="always")
def block_divisor(denom):
    """What a block's values are divided by: its denominator, or inf where that is 0 or not
    finite, so the values become zeros (two_level_scale_torch)."""
    return denom if (denom > F0 and denom < INF) else INF


MAGNITUDE_BITS = np.int32(0x7FFFFFFF)
INF_BITS = np.int32(0x7F800000)


@njit(inline="always")
def magnitude_bits(v):
    """The bits of |v| as an int32: ordered as |v| is for every non-NaN v, and a NaN or inf is
    >= INF_BITS. A max over them is an integer reduction, which LLVM vectorizes; a float max,
    with its NaN rules, stays scalar."""
    return np.float32(v).view(np.int32) & MAGNITUDE_BITS
