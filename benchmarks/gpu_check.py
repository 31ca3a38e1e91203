"""One script for a lent GPU: compile every kernel, check it bit for bit against its torch
reference (run on the CPU) on fresh random data, time it with triton.testing.do_bench and print
effective bandwidth (bytes the kernel must move / time) beside a measured device copy.

    python benchmarks/gpu_check.py [--elements 268435456]
Exits 1 if any kernel differs from its reference; prints one table. A dry run of the script's
logic on the CPU (Triton interpreter, small sizes, timings meaningless):
    TRITON_INTERPRET=1 python benchmarks/gpu_check.py --device cpu --elements 65536 --check-elements 8192
"""
import time
import argparse
import sys

import torch
import triton

from horovod_gift.kernels import fp8, fused, hadamard, nvfp4

DEVICE = "cuda"


def same_bits(gpu, cpu):
    if gpu is None or cpu is None:
        return gpu is None and cpu is None
    return gpu.shape == cpu.shape and torch.equal(gpu.cpu().contiguous().view(torch.uint8), cpu.contiguous().view(torch.uint8))


def check(name, gpu_fn, cpu_fn, failures):
    gpu_out, cpu_out = gpu_fn(), cpu_fn()
    gpu_out = gpu_out if isinstance(gpu_out, tuple) else (gpu_out,)
    cpu_out = cpu_out if isinstance(cpu_out, tuple) else (cpu_out,)
    if not all(same_bits(g, c) for g, c in zip(gpu_out, cpu_out)):
        failures.append(name)


def bench(fn):
    if DEVICE == "cuda":
        return triton.testing.do_bench(fn)
    fn()
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def timed(name, fn, nbytes):
    ms = bench(fn)
    return name, ms, nbytes / ms / 1e6


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--elements", type=int, default=1 << 28)
    p.add_argument("--check-elements", type=int, default=(1 << 22) + 4096 * 3)
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing measured")
        return 0
    n = args.elements
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU (Triton interpreter dry run)"
    print(f"device: {name}  torch {torch.__version__}  triton {triton.__version__}")
    x = torch.randn(n, device=DEVICE)
    copy_ms = bench(lambda: x.clone())
    copy_gbs = 8 * n / copy_ms / 1e6
    rows, failures = [], []
    # correctness on a smaller tensor (the CPU reference is slow), speed on the large one
    m = args.check_elements
    xs = torch.randn(m, generator=torch.Generator().manual_seed(0)) * torch.exp(torch.randn(m) * 2)
    xg = xs.to(DEVICE)
    for fmt_name, block in (("fp8_e4m3", None), ("fp8_e4m3", 32), ("fp8_e5m2", None), ("fp8_e5m2", 16)):
        spec = fp8.FORMATS[fmt_name]
        for stochastic in (False, True):
            scale = fp8.tensor_scale_torch(xs.abs().amax(), spec.max) if block is None else None
            label = f"{fmt_name} {'per ' + str(block) if block else 'per tensor'}{' SR' if stochastic else ''}"
            check(f"encode {label} ",
                  lambda: fp8.fp8_encode_triton(xg, spec, block, None if scale is None else scale.to(DEVICE), 3, stochastic),
                  lambda: fp8.fp8_encode_torch(xs, spec, block, scale, 3, stochastic), failures)
            big_scale = fp8.tensor_scale_torch(x.abs().amax(), spec.max) if block is None else None
            codes, scales = fp8.fp8_encode_triton(x, spec, block, big_scale, 3, stochastic)
            rows.append(timed(f"encode {label}", lambda: fp8.fp8_encode_triton(x, spec, block, big_scale, 3, stochastic),
                              5 * n))
            rows.append(timed(f"decode {label}", lambda: fp8.fp8_decode_triton(codes, scales, spec, block), 5 * n))
            c_cpu, s_cpu = fp8.fp8_encode_torch(xs, spec, block, scale, 3, stochastic)
            if not same_bits(fp8.fp8_decode_triton(c_cpu.to(DEVICE), s_cpu.to(DEVICE), spec, block), fp8.fp8_decode_torch(c_cpu, s_cpu, spec, block)):
                failures.append(f"decode {label}")
    for stochastic in (False, True):
        ts = nvfp4.nvfp4_tensor_scale_torch(xs.abs().amax()).reshape(1)
        check(f"nvfp4 encode{' SR' if stochastic else ''} ", lambda: nvfp4.nvfp4_encode_triton(xg, ts.to(DEVICE), 3, stochastic),
              lambda: nvfp4.nvfp4_encode_torch(xs, ts, 3, stochastic), failures)
        big_ts = nvfp4.nvfp4_tensor_scale_torch(x.abs().amax()).reshape(1)
        packed, sc = nvfp4.nvfp4_encode_triton(x, big_ts, 3, stochastic)
        rows.append(timed(f"nvfp4 encode{' SR' if stochastic else ''}", lambda: nvfp4.nvfp4_encode_triton(x, big_ts, 3, stochastic), 4.5625 * n))
        rows.append(timed("nvfp4 decode", lambda: nvfp4.nvfp4_decode_triton(packed, sc, big_ts, n), 4.5625 * n))
        p_cpu, s_cpu = nvfp4.nvfp4_encode_torch(xs, ts, 3, stochastic)
        if not same_bits(nvfp4.nvfp4_decode_triton(p_cpu.to(DEVICE), s_cpu.to(DEVICE), ts.to(DEVICE), m), nvfp4.nvfp4_decode_torch(p_cpu, s_cpu, ts, m)):
            failures.append("nvfp4 decode")
    for block in (16, 128):
        for inverse in (False, True):
            check(f"hadamard {block}{' inverse' if inverse else ''} ",
                  lambda: hadamard.hadamard_triton(xg, block, 7, inverse), lambda: hadamard.hadamard_torch(xs, block, 7, inverse),
                  failures)
            rows.append(timed(f"hadamard {block}{' inverse' if inverse else ''}", lambda: hadamard.hadamard_triton(x, block, 7, inverse), 8 * n))
        in_place = xg.clone()                   # as the library undoes the rotation of a decoded sum
        check(f"hadamard {block} inverse in place ", lambda: hadamard.hadamard_triton(in_place, block, 7, True, in_place),
              lambda: hadamard.hadamard_torch(xs, block, 7, True), failures)
    for fmt_name, block, rotation in (("nvfp4", None, (128, 1)), ("nvfp4", None, None), ("fp8_e4m3", 32, None),
                                      ("fp8_e4m3", 32, (128, 1)), ("fp8_e4m3", None, (128, 1))):
        label = f"fused {fmt_name}{' per ' + str(block) if block else ''}{' + hadamard' if rotation else ''} + feedback"
        r_cpu = torch.randn(m) * 1e-2
        r_gpu = r_cpu.to(DEVICE)
        check(label + " ", lambda: fused.rotate_feedback_quantize_triton(xg, r_gpu.clone(), fmt_name, block, rotation, 5, False),
              lambda: fused.rotate_feedback_quantize_torch(xs, r_cpu.clone(), fmt_name, block, rotation, 5, False), failures)
        residual = torch.zeros(n, device=DEVICE)
        payload = 0.5625 if fmt_name == "nvfp4" else 1 + (4 / block if block else 0)
        per_tensor_pass = 8 if (fmt_name == "nvfp4" or block is None) else 0   # the amax pass reads x and r
        rows.append(timed(label, lambda: fused.rotate_feedback_quantize_triton(x, residual, fmt_name, block, rotation, 5, False),
                          (12 + payload + per_tensor_pass) * n))
    for fmt_name, block in (("nvfp4", None), ("fp8_e4m3", None), ("fp8_e4m3", 32)):
        k = 8
        payloads = [fused.rotate_feedback_quantize_torch(torch.randn(m), None, fmt_name, block) for _ in range(k)]
        codes = torch.stack([q[0] for q in payloads])
        scales = torch.stack([q[1] for q in payloads])
        tss = None if payloads[0][2] is None else torch.cat([q[2] for q in payloads])
        check(f"accumulate {k} x {fmt_name} ",
              lambda: fused.accumulate_triton(codes.to(DEVICE), scales.to(DEVICE), None if tss is None else tss.to(DEVICE), m, fmt_name, block),
              lambda: fused.accumulate_torch(codes, scales, tss, m, fmt_name, block), failures)
    print(f"\ndevice copy: {copy_ms:.3f} ms for {n} fp32 elements = {copy_gbs:.0f} GB/s\n")
    print(f"| kernel | ms | GB/s | of copy |\n|---|---|---|---|")
    for name, ms, gbs in rows:
        print(f"| {name} | {ms:.3f} | {gbs:.0f} | {gbs / copy_gbs:.0%} |")
    print("\nbit-exact against the torch reference: " + ("all kernels" if not failures else "FAILED: " + ", ".join(failures)))
    return 1 if failures else 0



if __name__ == "__main__":
    sys.exit(main())
