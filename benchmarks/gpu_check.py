"""One script for a lent GPU. Everything it runs on the device is checked against the torch path
run on the CPU:

1. Kernels: compiles every Triton kernel and checks it bit for bit against its torch reference on
   fresh random data; times it with triton.testing.do_bench and prints its effective bandwidth
   (bytes the kernel must move / time) beside a measured device copy.
2. GIFT's per-step path, for 2 and 4 ranks simulated in one process (Horovod cannot run there):
   transform (none, randomized Hadamard rotation, low-rank input whitening with given factors +
   rotation), stage-1 quantization with a residual per tensor, the fp32 sums in rank order 0..n-1
   and the average, stage-2 quantization with a residual per owned chunk, decode of every owner's
   bytes, inverse transform; 2 steps, so the residuals feed back; FP8 E4M3 (per tensor and per
   32), E5M2, NVFP4 and INT3, nearest and stochastic rounding; one bucket of tensors of odd
   sizes. Each rank runs the library's own TransformPlan, BucketReduction and StagePipeline (start,
   exchange, finish, as GIFT calls them; on CUDA the second stage runs on the pipeline's side
   stream), Horovod's collectives replaced by an in-process exchange (LocalGroup). The
   transformed gradients, the bytes every rank gathers, every rank's residuals and results must
   equal the CPU's bit for bit, and every rank must end with identical bytes. Whitening is a
   matmul whose last bit depends on the BLAS: the whitened tensor's transformed gradient and
   result are compared with a tolerance (said so in the table), and the CPU's codec goes on from
   the device's whitened values, so that the codec, residuals and bytes stay bit-exact. The
   simulated step (all ranks) is timed on the device, per element per rank (informative).

    python benchmarks/gpu_check.py [--elements 268435456] [--step-elements 1048576]
Exits 1 if anything differs from its reference; prints two tables. A dry run of the script's
logic on the CPU (the Triton interpreter as the device; small sizes, timings meaningless):
    TRITON_INTERPRET=1 python benchmarks/gpu_check.py --device cpu --elements 65536 \\
        --check-elements 8192 --step-elements 8192
"""
import argparse
import math
import sys
import time
import traceback
import types

import torch  # noqa: E402
import triton  # noqa: E402

from horovod_gift.codec.tensor_codec import Codec  # noqa: E402
from horovod_gift.reduce.collective import BucketReduction, owned_elements  # noqa: E402
from horovod_gift.reduce.communicator import LocalGroup  # noqa: E402
from horovod_gift.codec.backend import use_kernels  # noqa: E402
from horovod_gift.geometry.whitening import InputWhitening  # noqa: E402
from horovod_gift.kernels import fp8, fused, hadamard, int3, nvfp4  # noqa: E402
from horovod_gift.reduce.pipeline import StagePipeline  # noqa: E402
from horovod_gift.codec.rotation import HadamardRotation  # noqa: E402
from horovod_gift.telemetry import Telemetry  # noqa: E402
from horovod_gift.geometry.transforms import TransformPlan  # noqa: E402

DEVICE = "cuda"


def same_bits(gpu, cpu):
    if gpu is None or cpu is None:
        return gpu is None and cpu is None
    return gpu.shape == cpu.shape and torch.equal(gpu.cpu().contiguous().view(torch.uint8),
                                                  cpu.contiguous().view(torch.uint8))


def check(name, gpu_fn, cpu_fn, failures):
    gpu_out, cpu_out = gpu_fn(), cpu_fn()
    gpu_out = gpu_out if isinstance(gpu_out, tuple) else (gpu_out,)
    cpu_out = cpu_out if isinstance(cpu_out, tuple) else (cpu_out,)
    if not all(same_bits(g, c) for g, c in zip(gpu_out, cpu_out)):
        failures.append(name)


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


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


def check_kernels(x, m, failures):
    """Each kernel against its reference on m elements; the (name, ms, GB/s) of each on x."""
    n = x.numel()
    rows = []
    seeded = torch.Generator(device="cpu").manual_seed(0)
    scales = torch.exp(torch.randn(m, device="cpu") * 2)
    xs = torch.randn(m, generator=seeded, device="cpu") * scales
    xg = xs.to(DEVICE)
    for fmt_name, block in (("fp8_e4m3", None), ("fp8_e4m3", 32), ("fp8_e5m2", None),
                            ("fp8_e5m2", 16)):
        spec = fp8.FORMATS[fmt_name]
        for sr in (False, True):
            scale = fp8.tensor_scale_torch(xs.abs().amax(), spec.max) if block is None else None
            scale_g = None if scale is None else scale.to(DEVICE)
            per = "per " + str(block) if block else "per tensor"
            label = f"{fmt_name} {per}{' SR' if sr else ''}"
            check(f"encode {label} ",
                  lambda: fp8.fp8_encode_triton(xg, spec, block, scale_g, 3, sr),
                  lambda: fp8.fp8_encode_torch(xs, spec, block, scale, 3, sr), failures)
            big_scale = fp8.tensor_scale_torch(x.abs().amax(), spec.max) if block is None else None
            codes, scales = fp8.fp8_encode_triton(x, spec, block, big_scale, 3, sr)
            rows.append(timed(f"encode {label}", lambda: fp8.fp8_encode_triton(
                x, spec, block, big_scale, 3, sr), 5 * n))
            rows.append(timed(f"decode {label}",
                              lambda: fp8.fp8_decode_triton(codes, scales, spec, block), 5 * n))
            c_cpu, s_cpu = fp8.fp8_encode_torch(xs, spec, block, scale, 3, sr)
            if not same_bits(fp8.fp8_decode_triton(c_cpu.to(DEVICE), s_cpu.to(DEVICE), spec, block),
                             fp8.fp8_decode_torch(c_cpu, s_cpu, spec, block)):
                failures.append(f"decode {label}")
    # the E4M3-scaled formats: (name, tensor scale, encoders and decoders (Triton, torch),
    # bytes an element the kernels move: 4 read + codes + a scale a block)
    scaled = (("nvfp4", nvfp4.nvfp4_tensor_scale_torch, nvfp4.nvfp4_encode_triton,
               nvfp4.nvfp4_encode_torch, nvfp4.nvfp4_decode_triton, nvfp4.nvfp4_decode_torch,
               4.5625),
              ("int3", int3.int3_tensor_scale_torch, int3.int3_encode_triton,
               int3.int3_encode_torch, int3.int3_decode_triton, int3.int3_decode_torch,
               4 + 3 / 8 + 1 / int3.BLOCK))
    for name, tensor_scale, encode, encode_ref, decode, decode_ref, moved in scaled:
        for sr in (False, True):
            label = f"{name} encode{' SR' if sr else ''}"
            ts = tensor_scale(xs.abs().amax()).reshape(1)
            check(f"{label} ", lambda: encode(xg, ts.to(DEVICE), 3, sr),
                  lambda: encode_ref(xs, ts, 3, sr), failures)
            big_ts = tensor_scale(x.abs().amax()).reshape(1)
            packed, sc = encode(x, big_ts, 3, sr)
            rows.append(timed(label, lambda: encode(x, big_ts, 3, sr), moved * n))
            rows.append(timed(f"{name} decode", lambda: decode(packed, sc, big_ts, n),
                              moved * n))
            p_cpu, s_cpu = encode_ref(xs, ts, 3, sr)
            if not same_bits(decode(p_cpu.to(DEVICE), s_cpu.to(DEVICE), ts.to(DEVICE), m),
                             decode_ref(p_cpu, s_cpu, ts, m)):
                failures.append(f"{name} decode")
    for block in (16, 128):
        for inverse in (False, True):
            label = f"hadamard {block}{' inverse' if inverse else ''}"
            check(f"{label} ", lambda: hadamard.hadamard_triton(xg, block, 7, inverse),
                  lambda: hadamard.hadamard_torch(xs, block, 7, inverse), failures)
            rows.append(timed(label, lambda: hadamard.hadamard_triton(x, block, 7, inverse), 8 * n))
        in_place = xg.clone()        # as the library undoes the rotation of a decoded sum
        check(f"hadamard {block} inverse in place ",
              lambda: hadamard.hadamard_triton(in_place, block, 7, True, in_place),
              lambda: hadamard.hadamard_torch(xs, block, 7, True), failures)
    for fmt_name, block, rotation in (("nvfp4", None, (128, 1)), ("nvfp4", None, None),
                                      ("int3", None, (128, 1)), ("int3", None, None),
                                      ("fp8_e4m3", 32, None), ("fp8_e4m3", 32, (128, 1)),
                                      ("fp8_e4m3", None, (128, 1))):
        label = (f"fused {fmt_name}{' per ' + str(block) if block else ''}"
                 f"{' + hadamard' if rotation else ''} + feedback")
        r_cpu = torch.randn(m, device="cpu") * 1e-2
        r_gpu = r_cpu.to(DEVICE)
        check(label + " ",
              lambda: fused.rotate_feedback_quantize_triton(xg, r_gpu.clone(), fmt_name, block,
                                                            rotation, 5, False),
              lambda: fused.rotate_feedback_quantize_torch(xs, r_cpu.clone(), fmt_name, block,
                                                           rotation, 5, False), failures)
        residual = torch.zeros(n, device=DEVICE)
        payload = {"nvfp4": 0.5625, "int3": 3 / 8 + 1 / int3.BLOCK}.get(
            fmt_name, 1 + (4 / block if block else 0))
        # the amax pass reads x and r
        per_tensor_pass = 8 if (fmt_name in fused.SCALED or block is None) else 0
        rows.append(timed(label, lambda: fused.rotate_feedback_quantize_triton(
            x, residual, fmt_name, block, rotation, 5, False),
            (12 + payload + per_tensor_pass) * n))
    for fmt_name, block in (("nvfp4", None), ("int3", None), ("fp8_e4m3", None),
                            ("fp8_e4m3", 32)):
        k = 8
        payloads = [fused.rotate_feedback_quantize_torch(torch.randn(m, device="cpu"), None,
                                                         fmt_name, block) for _ in range(k)]
        codes = torch.stack([q[0] for q in payloads])
        scales = torch.stack([q[1] for q in payloads])
        tss = None if payloads[0][2] is None else torch.cat([q[2] for q in payloads])
        tss_g = None if tss is None else tss.to(DEVICE)
        check(f"accumulate {k} x {fmt_name} ",
              lambda: fused.accumulate_triton(codes.to(DEVICE), scales.to(DEVICE), tss_g, m,
                                              fmt_name, block),
              lambda: fused.accumulate_torch(codes, scales, tss, m, fmt_name, block), failures)
    return rows


# ---------------------------------------------------------------- GIFT's per-step path

STEP_CODECS = (("fp8_e4m3", None), ("fp8_e4m3", 32), ("fp8_e5m2", None), ("nvfp4", None),
               ("int3", None))
STEP_TRANSFORMS = ("none", "hadamard", "whiten+hadamard")
IN_FEATURES, WHITENING_RANK, HADAMARD_BLOCK, SEED = 96, 16, 128, 5
WHITEN_TOLERANCE = 1e-5      # of the largest magnitude in the tensor


def bucket_shapes(elements):
    """One bucket of about `elements`: a Linear weight (the one tensor whiten+hadamard whitens; the
    others it rotates) and 1-D tensors of odd sizes, one shorter than a rotation block."""
    rows = max(2, elements // 2 // IN_FEATURES)
    return {"fc.weight": (rows, IN_FEATURES), "fc.bias": (elements // 4 + 7,),
            "norm.weight": (max(1, elements // 8 - 3),), "gains": (37,)}


def whitening_pair(device):
    """fc.weight's InputWhitening with factors computed once on the CPU from a batch of correlated
    activations, and one holding the same factors on `device`."""
    g = torch.Generator(device="cpu").manual_seed(11)
    mix = torch.randn(IN_FEATURES, IN_FEATURES, generator=g, device="cpu")
    spread = torch.logspace(-2, 1, IN_FEATURES, device="cpu")
    cpu = InputWhitening(IN_FEATURES, rank=WHITENING_RANK)
    cpu.update(torch.randn(4 * IN_FEATURES, IN_FEATURES, generator=g, device="cpu") @ mix * spread)
    dev = InputWhitening(IN_FEATURES, rank=WHITENING_RANK)
    dev.load_state_dict(dict(cpu.state_dict(),
                             factors={k: v.to(device) for k, v in cpu.factors.items()}))
    return cpu, dev


def gradients(shapes, n, step):
    """Every rank's gradients of a step, on the CPU: heavy-tailed, each tensor at its own scale."""
    g = torch.Generator(device="cpu").manual_seed(1000 * step + n)
    return [[torch.randn(s, generator=g, device="cpu")
             * torch.randn(s, generator=g, device="cpu").exp() * 10.0 ** (j - 2)
             for j, s in enumerate(shapes.values())] for _ in range(n)]


class SimulatedRanks:
    """GIFT's per-step path for n ranks of one bucket, as GiftCore and its StagePipeline run it:
    TransformPlan.forward in place, a BucketReduction per rank whose stage-1 residuals (per
    tensor) and stage-2 residual (per owned chunk) persist across steps, every start, every
    exchange, finish over the inputs, TransformPlan.inverse in place."""

    def __init__(self, n, codec, transform, shapes, whitening, device):
        self.n, self.codec, self.shapes, self.device = n, codec, shapes, device
        statistics = types.SimpleNamespace(whitening={"fc.weight": whitening}, transposed=set())
        self.plan = TransformPlan(dict.fromkeys(shapes), transform, statistics,
                                  HadamardRotation(HADAMARD_BLOCK, codec.seed))
        self.group = LocalGroup(n)
        self.comms = self.group.communicators()
        self.residual1 = [[torch.zeros(math.prod(s), device=device) for s in shapes.values()]
                          for _ in range(n)]
        self.residual2 = [None] * n

    def forward(self, grads):
        return [[self.plan.forward(name, g, in_place=True) for name, g in zip(self.shapes, mine)]
                for mine in grads]

    def reduce(self, flats, step):
        """Every rank's reduced flats, through GIFT's StagePipeline: on CUDA the second stages
        run on its side stream."""
        pipelines = []
        for k in range(self.n):
            if self.residual2[k] is None:
                owned = owned_elements([f.numel() for f in flats[k]], self.n, k, self.codec.align)
                self.residual2[k] = torch.zeros(owned, device=self.device)
            pipeline = StagePipeline([list(self.shapes)], Telemetry(0))
            pipeline.start(0, BucketReduction("gpu_check", flats[k], self.codec, self.comms[k],
                                              self.residual1[k], self.residual2[k],
                                              average=True, step=step))
            pipelines.append(pipeline)
        for pipeline in pipelines:
            pipeline.exchange_all()
        return [list(pipeline.finish(0).values()) for pipeline in pipelines]

    def gathered(self):
        """The bytes every rank gathered in the last step's allgather."""
        return self.group.latest["gpu_check.allgather"]

    def inverse(self, reduced):
        return [[self.plan.inverse(name, u, in_place=True).view(shape)
                 for (name, shape), u in zip(self.shapes.items(), mine)] for mine in reduced]


def on_device(fn):
    """fn() and the seconds it took, the device's queue drained before and after."""
    sync()
    t0 = time.perf_counter()
    out = fn()
    sync()
    return out, time.perf_counter() - t0


def scaled_difference(gpu, cpu):
    """max |gpu - cpu| / max |cpu|."""
    return float((gpu.cpu() - cpu).abs().max() / cpu.abs().max().clamp_min(1e-30))


def check_step_path(n, fmt, block, rounding, transform, elements, whitening):
    """Two steps, checked. Returns the table's cells: max |device - CPU| over the results, the
    relative L2 error of the second step's result against the fp32 mean, the milliseconds of the
    second (warm) step on the device, and "bit-exact", or what differed."""
    shapes = bucket_shapes(elements)
    codec = Codec(fmt, block, rounding, SEED)
    dev = SimulatedRanks(n, codec, transform, shapes, whitening[1], DEVICE)
    ref = SimulatedRanks(n, codec, transform, shapes, whitening[0], "cpu")
    whitened = {name for name in shapes if ref.plan.choice[name].startswith("whiten")}
    problems, max_diff, worst_whitening = [], 0.0, 0.0

    def compare(what, gpu, cpu, name):
        nonlocal worst_whitening
        if name in whitened:
            difference = scaled_difference(gpu, cpu)
            worst_whitening = max(worst_whitening, difference)
            if not difference <= WHITEN_TOLERANCE:
                problems.append(f"{what}: {difference:.1e} of its max, beyond the tolerance")
        elif not same_bits(gpu, cpu):
            problems.append(what)

    for step in range(2):
        grads = gradients(shapes, n, step)
        mean = [torch.stack(list(tensors)).mean(0) for tensors in zip(*grads)]
        inputs = [[g.to(DEVICE, copy=True) for g in mine] for mine in grads]
        with use_kernels("triton"):
            u_dev, forward_seconds = on_device(lambda: dev.forward(inputs))
            u_sent = [[u.to("cpu", copy=True) for u in mine] for mine in u_dev]  # finish overwrites
            out_dev, rest_seconds = on_device(lambda: dev.inverse(dev.reduce(u_dev, step)))
        with use_kernels("torch"):
            u_ref = ref.forward(grads)
            for k in range(n):
                for name, sent, u in zip(shapes, u_sent[k], u_ref[k]):
                    compare(f"step {step} rank {k} transformed {name}", sent, u, name)
                    if name in whitened:         # the codec goes on from the same values
                        u.copy_(sent)
            out_ref = ref.inverse(ref.reduce(u_ref, step))
        if not same_bits(dev.gathered(), ref.gathered()):
            problems.append(f"step {step} gathered bytes")
        for k in range(n):
            if not same_bits(dev.residual2[k], ref.residual2[k]):
                problems.append(f"step {step} rank {k} stage-2 residual")
            for name, r_dev, r_ref in zip(shapes, dev.residual1[k], ref.residual1[k]):
                if not same_bits(r_dev, r_ref):
                    problems.append(f"step {step} rank {k} stage-1 residual of {name}")
            for name, o_dev, o_ref, o0_dev, o0_ref in zip(shapes, out_dev[k], out_ref[k],
                                                          out_dev[0], out_ref[0]):
                compare(f"step {step} rank {k} result {name}", o_dev, o_ref, name)
                max_diff = max(max_diff, float((o_dev.cpu() - o_ref).abs().max()))
                if not (same_bits(o_dev, o0_dev) and same_bits(o_ref, o0_ref)):
                    problems.append(f"step {step} rank {k} result {name} differs from rank 0's")
        exact = torch.cat([t.reshape(-1) for t in mean]).double()
        got = torch.cat([t.cpu().reshape(-1) for t in out_dev[0]]).double()
        error = float((got - exact).norm() / exact.norm())
    if problems:
        more = f" (+{len(problems) - 1} more)" if problems[1:] else ""
        verdict = f"FAILED: {problems[0]}{more}"
    else:
        verdict = "bit-exact"
        if whitened:
            verdict += (f" except whitened {', '.join(sorted(whitened))}: within "
                        f"{WHITEN_TOLERANCE:g} of its max (worst {worst_whitening:.1e})")
    return max_diff, error, (forward_seconds + rest_seconds) * 1e3, verdict


def check_step_paths(elements, failures):
    """One table row per (ranks, format, rounding, transform); failures get one entry per row."""
    whitening = whitening_pair(DEVICE)
    shapes = bucket_shapes(elements)
    per_rank = sum(math.prod(s) for s in shapes.values())
    print(f"\nGIFT's per-step path against the CPU, 2 steps, one bucket of {per_rank} elements a "
          f"rank: {', '.join(f'{k} {tuple(v)}' for k, v in shapes.items())}. max abs diff: over "
          "every rank's results; error: rank 0's second result against the fp32 mean (relative "
          "L2); ms: the device's second step, all ranks; whitening in fp32 matmuls of precision "
          f"'{torch.get_float32_matmul_precision()}'.\n")
    print("| ranks | format | rounding | transform | max abs diff | error vs fp32 mean "
          "| device ms/step | ns/element/rank | result |\n|---|---|---|---|---|---|---|---|---|",
          flush=True)
    for n in (2, 4):
        for fmt, block in STEP_CODECS:
            scaling = f" per {block}" if block else ("" if fmt in fused.SCALED else " per tensor")
            label = fmt + scaling
            for rounding in ("nearest", "stochastic"):
                for transform in STEP_TRANSFORMS:
                    try:
                        diff, error, ms, verdict = check_step_path(n, fmt, block, rounding,
                                                                   transform, elements, whitening)
                        cells = (f"{diff:.3g} | {error:.3g} | {ms:.3f} | "
                                 f"{ms * 1e6 / (n * per_rank):.3f}")
                    except Exception as e:       # a crash fails this row; the others still run
                        traceback.print_exc()
                        cells, verdict = "- | - | - | -", f"FAILED: {type(e).__name__}: {e}"
                    if verdict.startswith("FAILED"):
                        failures.append(f"{n} ranks {label} {rounding} {transform}")
                    print(f"| {n} | {label} | {rounding} | {transform} | {cells} | {verdict} |",
                          flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--elements", type=int, default=1 << 28, help="elements timed per kernel")
    p.add_argument("--check-elements", type=int, default=(1 << 22) + 4096 * 3,
                   help="elements each kernel is checked on")
    p.add_argument("--step-elements", type=int, default=1 << 20,
                   help="elements a rank in the bucket of the per-step check")
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
    copy_ms = bench(x.clone)
    copy_gbs = 8 * n / copy_ms / 1e6
    failures = []
    # correctness on a smaller tensor (the CPU reference is slow), speed on the large one
    rows = check_kernels(x, args.check_elements, failures)
    del x
    print(f"\ndevice copy: {copy_ms:.3f} ms for {n} fp32 elements = {copy_gbs:.0f} GB/s\n")
    print("| kernel | ms | GB/s | of copy |\n|---|---|---|---|")
    for kernel, ms, gbs in rows:
        print(f"| {kernel} | {ms:.3f} | {gbs:.0f} | {gbs / copy_gbs:.0%} |")
    print("\nbit-exact against the torch reference: "
          + ("all kernels" if not failures else "FAILED: " + ", ".join(failures)), flush=True)
    kernel_failures = len(failures)
    t0 = time.perf_counter()
    check_step_paths(args.step_elements, failures)
    step_failures = failures[kernel_failures:]
    print(f"\nper-step path against the CPU ({time.perf_counter() - t0:.0f} s): "
          + ("every row as its result says" if not step_failures
             else "FAILED: " + ", ".join(step_failures)))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
