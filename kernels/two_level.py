"""NVFP4's two-level scaling, which INT3 shares: one place for what both formats' kernels and
references do alike.

    s_t = amax(tensor) / (GRID_MAX * 448)             one fp32 per tensor (given by the caller)
    s_b = E4M3(amax(block) / (GRID_MAX * s_t))        one E4M3 code per block
    v   = x / (s_b * s_t), rounded to the format's grid [-GRID_MAX, GRID_MAX] (E2M1's 6, INT3's 3)
A block whose denominator s_b * s_t is 0 or not finite (a non-finite tensor scale makes them all
NaN) scales to zeros (torch divides it by inf, which leaves a NaN a NaN).

Triton: the scaling of a tile, the blocks' denominators when decoding, and the launches of the
two formats' encode and decode kernels (they take the same arguments). torch: the scaling of
(blocks, block) rows, the values of codes, and the references of the launches.
"""
import torch
import triton
import triton.language as tl

from .rounding import E4M3, EXACT_ARITHMETIC, blocks_torch, decode_float, encode_float


# ---------------------------------------------------------------- Triton
@triton.jit
def two_level_scale(y, tensor_scale, GRID_MAX: tl.constexpr):
    """Scales a (ROWS, BLOCK) tile, a block a row: returns the rows' E4M3 scale codes, their
    denominators and the tile divided by them."""
    amax = tl.max(tl.abs(y), axis=1)
    t_usable = (tensor_scale > 0) & (tensor_scale < float("inf"))
    ratio = tl.where(t_usable,
                     tl.math.div_rn(amax, tl.zeros_like(amax) + tensor_scale * GRID_MAX), 0.0)
    scale_codes = encode_float(ratio, ratio, 4, 3, 7, 448.0, False)   # E4M3
    denom = decode_float(scale_codes, 4, 3, 7) * tensor_scale      # E4M3
    usable = (denom > 0) & (denom < float("inf"))
    v = tl.where(usable[:, None], tl.math.div_rn(y, tl.where(usable, denom, 1.0)[:, None]), 0.0)
    return scale_codes, denom, v


@triton.jit
def two_level_denominators(scale_codes_ptr, tensor_scale, rows, n, BLOCK: tl.constexpr):
    """The denominators of the blocks rows (of n elements): their E4M3 scale codes' values times
    the tensor scale."""
    scale_codes = tl.load(scale_codes_ptr + rows, mask=rows * BLOCK < n, other=0)
    return decode_float(scale_codes, 4, 3, 7) * tensor_scale   # E4M3


def two_level_encode_triton(kernel, x, packed_bytes, block, rows, tensor_scale, seed, stochastic):
    """kernel (an encode kernel, with nvfp4_encode_kernel's arguments) on flat fp32 x, rows blocks
    a program: packed codes (packed_bytes of them) and one E4M3 scale code per block."""
    n = x.numel()
    packed = torch.empty(packed_bytes, dtype=torch.uint8, device=x.device)
    scale_codes = torch.empty(triton.cdiv(n, block), dtype=torch.uint8, device=x.device)
    if n:
        grid = (triton.cdiv(n, block * rows),)
        kernel[grid](x, packed, scale_codes, tensor_scale, n, seed, **EXACT_ARITHMETIC, ROWS=rows,
                     STOCHASTIC=stochastic)
    return packed, scale_codes


def two_level_decode_triton(kernel, packed, scale_codes, tensor_scale, n, out, block, rows):
    """kernel (a decode kernel, with nvfp4_decode_kernel's arguments), rows blocks a program: n
    decoded fp32 values, into out if it is not None."""
    out = torch.empty(n, dtype=torch.float32, device=packed.device) if out is None else out
    if n:
        grid = (triton.cdiv(n, block * rows),)
        kernel[grid](packed, scale_codes, tensor_scale, out, n, **EXACT_ARITHMETIC, ROWS=rows)
    return out


# ---------------------------------------------------------------- torch
def e4m3_block_denominators(scale_codes, tensor_scale):
    """What each block's values are multiplied by: its E4M3 scale code times the tensor scale."""
    return scale_codes.view(torch.float8_e4m3fn).to(torch.float32) * tensor_scale


def two_level_scale_torch(blocks, block_amax, tensor_scale, grid_max):
    """The twin of two_level_scale for (blocks, block) rows whose amax per row the caller has:
    returns the rows' E4M3 scale codes (uint8), their denominators and the rows divided by
    them."""
    tensor_scale = tensor_scale.to(torch.float32).reshape(())
    t_usable = (tensor_scale > 0) & (tensor_scale < float("inf"))
    ratio = torch.where(t_usable, block_amax / (tensor_scale * grid_max), 0.0)
    scale_codes = ratio.clamp_max(E4M3.max).to(torch.float8_e4m3fn).view(torch.uint8)
    denom = e4m3_block_denominators(scale_codes, tensor_scale)
    # dividing by inf gives the kernel's zeros for unusable blocks with no full-size mask
    v = blocks / torch.where((denom > 0) & (denom < float("inf")), denom, float("inf"))[:, None]
    return scale_codes, denom, v


def two_level_values_torch(codes, scale_codes, tensor_scale, block, grid_values):
    """fp32 values of unpacked codes (uint8; padded or cut to the blocks of scale_codes): the
    grid_values of the codes (as int32) times their block's denominator."""
    codes = codes.to(torch.int32)     # uint8 compares are slow in Inductor's CPU code
    if codes.numel() != scale_codes.numel() * block:
        codes = torch.nn.functional.pad(codes, (0, scale_codes.numel() * block - codes.numel()))
    denom = e4m3_block_denominators(scale_codes, tensor_scale.to(torch.float32).reshape(()))
    return (grid_values(codes).view(-1, block) * denom[:, None]).reshape(-1)


def two_level_encode_torch(x, block, quantize_blocks, pack, tensor_scale, seed, stochastic):
    """The reference of two_level_encode_triton: x's codes, from the format's quantize_blocks
    (nvfp4_quantize_blocks_torch's arguments) packed by pack (codes, x's size), and one E4M3 scale
    code per block."""
    blocks = blocks_torch(x, block)
    codes, scale_codes, _ = quantize_blocks(blocks, blocks.abs().amax(dim=1), tensor_scale, seed,
                                            stochastic)
    return pack(codes, x.numel()), scale_codes


def two_level_decode_torch(packed, scale_codes, tensor_scale, n, out, unpack, values_of):
    """The reference of two_level_decode_triton: n decoded fp32 values, the format's values_of
    (nvfp4_values_torch's arguments) of the codes that unpack gives, into out if it is not
    None."""
    values = values_of(unpack(packed), scale_codes, tensor_scale)[:n]
    return values if out is None else out.copy_(values)
