"""A tensor's pieces in one launch (Triton): a bucket cuts each tensor into a piece per rank it
spans, P of them at P ranks, each with its own scales and its own place in a payload buffer; a
launch per piece costs the host ~10 us on a GPU. These kernels take the piece table and run a
program per (tile, piece), with the arithmetic of rotate_feedback_quantize_kernel (without
rotation: the transform ran on the whole tensor) and of the decode kernels, so the same bits as
a call per piece (the reference: Codec's loop over pieces on the torch references).

    quantize:  payload p = Q(x[starts[p]:][:sizes[p]] (+ r)) at buffer[offsets[p]:]
    decode:    out[starts[p]:][:sizes[p]] = D(payload at buffer[offsets[p]:])

Payload layout as formats.payload_layout. Its fp32 scales lie at any byte offset, where a GPU
cannot load or store a float: the kernels move them as four little-endian bytes.
"""
import torch
import triton
import triton.language as tl

from .fp8 import FORMATS, fp8_quantize_tile
from .fused import SCALED, amax_or_inf, quant_block
from .int3 import int3_decode_tile, int3_quantize_tile, int3_store_tile
from .nvfp4 import nvfp4_decode_tile, nvfp4_quantize_tile, nvfp4_store_tile
from .rounding import EXACT_ARITHMETIC, decode_float, tensor_scale_torch

TILE = 4096     # elements a program covers (rotate_feedback_quantize_triton's without rotation)


@triton.jit
def store_fp32_bytes(ptr, value, mask):
    """fp32 values as four little-endian bytes each at ptr (a pointer per value)."""
    bits = value.to(tl.int32, bitcast=True)
    for k in tl.static_range(4):
        tl.store(ptr + k, ((bits >> (8 * k)) & 0xFF).to(tl.uint8), mask=mask)


@triton.jit
def load_fp32_bytes(ptr, mask):
    """The fp32 values whose four little-endian bytes each are at ptr (a pointer per value)."""
    bits = tl.load(ptr, mask=mask, other=0).to(tl.int32)
    for k in tl.static_range(1, 4):
        bits = bits | (tl.load(ptr + k, mask=mask, other=0).to(tl.int32) << (8 * k))
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def pieces_quantize_kernel(
    x_ptr,              # the tensor's flat fp32 input
    residual_ptr,       # its fp32 error-feedback residual, read and rewritten (FEEDBACK)
    starts_ptr,         # int64: each piece's first element
    sizes_ptr,          # int64: each piece's elements
    payload_ptr,        # out: uint8 buffer of the payloads
    offsets_ptr,        # int64: where each piece's payload starts
    tensor_scales_ptr,  # in: each piece's scale (PER_TENSOR, NVFP4, INT3), from AMAX_ONLY
    amax_ptr,           # out (AMAX_ONLY): (pieces, tiles) amax, inf where a value is not finite
    seeds_ptr,          # int64: each piece's stochastic rounding seed
    tiles,              # programs per piece (grid axis 0)
    AMAX_ONLY: tl.constexpr,    # first pass: only the amax of x (+ r)
    FEEDBACK: tl.constexpr,     # add the residual, store the new error
    NVFP4: tl.constexpr,        # NVFP4
    INT3: tl.constexpr,         # INT3 (neither: FP8)
    PER_TENSOR: tl.constexpr,   # FP8 with one scale for the piece
    ROWS: tl.constexpr,         # scale blocks per program
    QBLOCK: tl.constexpr,       # scale block (16 for NVFP4, 32 for INT3)
    EBITS: tl.constexpr,        # FP8 format: exponent bits,
    MBITS: tl.constexpr,        #   mantissa bits,
    BIAS: tl.constexpr,         #   exponent bias,
    MAX: tl.constexpr,          #   largest finite value
    STOCHASTIC: tl.constexpr,   # stochastic rounding (else to nearest even)
):
    tile, piece = tl.program_id(0), tl.program_id(1)
    start, m = tl.load(starts_ptr + piece), tl.load(sizes_ptr + piece)
    rows = tile * ROWS + tl.arange(0, ROWS)
    offs = rows[:, None] * QBLOCK + tl.arange(0, QBLOCK)[None, :]
    mask = offs < m
    y = tl.load(x_ptr + start + offs, mask=mask, other=0.0)
    if FEEDBACK:
        y = y + tl.load(residual_ptr + start + offs, mask=mask, other=0.0)
    if AMAX_ONLY:
        tl.store(amax_ptr + piece * tiles + tile, amax_or_inf(y))
    elif tile * ROWS * QBLOCK < m:
        seed = tl.load(seeds_ptr + piece)
        codes_ptr = payload_ptr + tl.load(offsets_ptr + piece)
        if NVFP4:
            tensor_scale = tl.load(tensor_scales_ptr + piece)
            codes, scale_codes, dequantized = nvfp4_quantize_tile(y, offs, tensor_scale, seed,
                                                                  STOCHASTIC)
            scale_codes_ptr = codes_ptr + (m + 1) // 2
            nvfp4_store_tile(codes_ptr, scale_codes_ptr, codes, scale_codes, rows, m, ROWS)
            store_fp32_bytes(scale_codes_ptr + (m + 15) // 16, tensor_scale, tile == 0)
        elif INT3:
            tensor_scale = tl.load(tensor_scales_ptr + piece)
            codes, scale_codes, dequantized = int3_quantize_tile(y, offs, tensor_scale, seed,
                                                                 STOCHASTIC)
            scale_codes_ptr = codes_ptr + 3 * ((m + 7) // 8)
            int3_store_tile(codes_ptr, scale_codes_ptr, codes, scale_codes, rows, m, ROWS)
            store_fp32_bytes(scale_codes_ptr + (m + 31) // 32, tensor_scale, tile == 0)
        else:
            tensor_scale = tl.load(tensor_scales_ptr + piece) if PER_TENSOR else 0.0
            codes, scale, dequantized = fp8_quantize_tile(
                y, offs, tensor_scale, seed, PER_TENSOR, EBITS, MBITS, BIAS, MAX, STOCHASTIC)
            tl.store(codes_ptr + offs, codes.to(tl.uint8), mask=mask)
            if PER_TENSOR:
                store_fp32_bytes(codes_ptr + m, tensor_scale, tile == 0)
            else:
                store_fp32_bytes(codes_ptr + m + 4 * rows, scale, rows * QBLOCK < m)
        if FEEDBACK:
            tl.store(residual_ptr + start + offs, y - dequantized, mask=mask)


@triton.jit
def pieces_decode_kernel(
    payload_ptr,        # uint8 buffer of the payloads
    offsets_ptr,        # int64: where each piece's payload starts
    out_ptr,            # out: the tensor's flat fp32 values
    starts_ptr,         # int64: each piece's first element
    sizes_ptr,          # int64: each piece's elements
    NVFP4: tl.constexpr,        # NVFP4
    INT3: tl.constexpr,         # INT3 (neither: FP8)
    PER_TENSOR: tl.constexpr,   # FP8 with one scale for the piece
    ROWS: tl.constexpr,         # scale blocks per program
    QBLOCK: tl.constexpr,       # scale block (16 for NVFP4, 32 for INT3)
    EBITS: tl.constexpr,        # FP8 format: exponent bits,
    MBITS: tl.constexpr,        #   mantissa bits,
    BIAS: tl.constexpr,         #   exponent bias
):
    tile, piece = tl.program_id(0), tl.program_id(1)
    start, m = tl.load(starts_ptr + piece), tl.load(sizes_ptr + piece)
    if tile * ROWS * QBLOCK < m:
        rows = tile * ROWS + tl.arange(0, ROWS)
        offs = rows[:, None] * QBLOCK + tl.arange(0, QBLOCK)[None, :]
        codes_ptr = payload_ptr + tl.load(offsets_ptr + piece)
        if NVFP4:
            scale_codes_ptr = codes_ptr + (m + 1) // 2
            tensor_scale = load_fp32_bytes(scale_codes_ptr + (m + 15) // 16, True)
            values = nvfp4_decode_tile(codes_ptr, scale_codes_ptr, tensor_scale, rows, m, ROWS)
        elif INT3:
            scale_codes_ptr = codes_ptr + 3 * ((m + 7) // 8)
            tensor_scale = load_fp32_bytes(scale_codes_ptr + (m + 31) // 32, True)
            values = int3_decode_tile(codes_ptr, scale_codes_ptr, tensor_scale, rows, m, ROWS)
        else:
            if PER_TENSOR:
                scale = load_fp32_bytes(codes_ptr + m + rows * 0, True)
            else:
                scale = load_fp32_bytes(codes_ptr + m + 4 * rows, rows * QBLOCK < m)
            codes = tl.load(codes_ptr + offs, mask=offs < m, other=0)
            values = decode_float(codes, EBITS, MBITS, BIAS) * scale[:, None]
        tl.store(out_ptr + start + offs, values, mask=offs < m)


def _shape(fmt_name, block_size, largest):
    """(scale block, scale blocks per program, programs per piece): a program's tile holds TILE
    elements, and a piece as large as the largest, largest elements."""
    qblock = quant_block(fmt_name, block_size)
    rows = max(1, TILE // qblock)
    return qblock, rows, max(1, -(-largest // (rows * qblock)))


def quantize_pieces_triton(x, residual, starts, sizes, offsets, seeds, largest, payload,
                           fmt_name, block_size, stochastic):
    """Every piece's payload into payload (uint8); residual updated in place. starts, sizes,
    offsets, seeds: int64 tensors on x's device; largest: the largest piece's elements.
    Returns each piece's amax (a tensor; inf where a piece is not finite) when a pass found it
    (a piece scale, or feedback), else None."""
    pieces = starts.numel()
    scaled, per_tensor = fmt_name in SCALED, block_size is None
    qblock, rows, tiles = _shape(fmt_name, block_size, largest)
    fmt = FORMATS.get(fmt_name, FORMATS["fp8_e4m3"])
    common = dict(EXACT_ARITHMETIC, FEEDBACK=residual is not None, NVFP4=fmt_name == "nvfp4",
                  INT3=fmt_name == "int3", PER_TENSOR=per_tensor, ROWS=rows, QBLOCK=qblock,
                  EBITS=fmt.ebits, MBITS=fmt.mbits, BIAS=fmt.bias, MAX=fmt.max,
                  STOCHASTIC=stochastic)
    args = (x, x if residual is None else residual, starts, sizes, payload, offsets)
    amax, tensor_scales = None, x       # FP8 blocks carry their own scales: x is not read
    if scaled or per_tensor or residual is not None:
        partial = torch.empty((pieces, tiles), dtype=torch.float32, device=x.device)
        pieces_quantize_kernel[(tiles, pieces)](*args, partial, partial, seeds, tiles,
                                                AMAX_ONLY=True, **common)
        amax = partial.amax(dim=1)
        if scaled:
            tensor_scales = SCALED[fmt_name][1](amax)
        elif per_tensor:
            tensor_scales = tensor_scale_torch(amax, fmt.max)
    pieces_quantize_kernel[(tiles, pieces)](*args, tensor_scales, x, seeds, tiles,
                                            AMAX_ONLY=False, **common)
    return amax


def decode_pieces_triton(payload, starts, sizes, offsets, largest, out, fmt_name, block_size):
    """Every piece's payload decoded into out (fp32); the tables as in quantize_pieces_triton."""
    qblock, rows, tiles = _shape(fmt_name, block_size, largest)
    fmt = FORMATS.get(fmt_name, FORMATS["fp8_e4m3"])
    pieces_decode_kernel[(tiles, starts.numel())](
        payload, offsets, out, starts, sizes, **EXACT_ARITHMETIC, NVFP4=fmt_name == "nvfp4",
        INT3=fmt_name == "int3", PER_TENSOR=block_size is None, ROWS=rows, QBLOCK=qblock,
        EBITS=fmt.ebits, MBITS=fmt.mbits, BIAS=fmt.bias)
    return out
