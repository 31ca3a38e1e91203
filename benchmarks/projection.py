"""Gradient-sync time per step on GPU clusters of nodes, on paper, from stated inputs.

    .venv/bin/python benchmarks/projection.py [--codec-gbs 2600 [--measured]]

Writes benchmarks/results/projection.md. Every input is a flag; each is ASSUMED (a vendor figure
or a chosen point of a sweep) unless --measured says the codec bandwidth came from a GPU run.

Cluster. P GPUs in N = P / L nodes of L GPUs; NVLink inside a node (V bytes/s per GPU, one
direction); one NIC per GPU of R bit/s across nodes. A step syncs E gradient elements (the
parameter count) at q = bits / 8 bytes an element: fp32 32 bits, fp16 16, FP8 8 (its scales are
left out, under 0.1 %), NVFP4 4.5 (4-bit values and one 8-bit scale per 16).

Model
  Bandwidth only: no per-message latency, no overlap with compute, one bucket's stages in
  sequence (no overlap between stages or buckets). A collective's time is the slowest of the
  links it uses at once, max(NIC bytes / R, NVLink bytes / V); a step's is the sum of its
  collectives' and of its codec time. Bytes are those one GPU sends.
  fp32 / fp16 ring (Horovod's allreduce: NCCL; fp16 = Horovod's fp16 compression, its casts
    left out): NCCL runs L rings (channels), each crossing nodes at a different GPU's NIC:
      NIC     2 (N-1)/N * E q / L
      NVLink  2 (P-1)/P * E q  -  the NIC's bytes
    (a flat ring's NIC carries 2 (P-1)/P E q / L, within 1/N of this: the model favours it.)
  gift flat (collective.py: alltoall of quantized chunks, then an allgather of the owners'
    re-quantized chunks, over all P ranks):
      alltoall   NIC (P-L)/P * E q (point to point, each rank's own NIC);  NVLink (L-1)/P * E q
      allgather  equal slots, so Horovod calls ncclAllGather, a ring of L channels as above:
                 NIC (N-1)/N * E q / L;  NVLink (P-1)/P * E q - the NIC's bytes
  gift two-hop (two_hop.py):
      1 node reduce-scatter, fp32 alltoall   NVLink (L-1)/L * E * 4
      2 flat reduction among the N GPUs of one local rank (one a node), on E / L elements:
                                             NIC    2 (N-1)/N * (E/L) q
      3 node allgather of step 2's bytes      NVLink (L-1) * (E/L) q
  Codec: bytes the kernels move per GPU, at the codec bandwidth C (b = q):
    flat:    stage-1 fused transform + feedback + encode  E (4 + 8 + 8 + b)
               (amax pass, x, residual read and write, payload)
             owner's sums  E b + 4 E/P;  stage-2 encode  (E/P) (12 + b);  final decode  E (b + 4)
    two-hop: node sum (read L rows of E/L fp32, write one)  4 E + 4 E/L
             stage-1 encode of the node sum  (E/L) (20 + b)
             owner's sums over N  (E/L) b + 4 E/(L N);  stage-2 encode  E/(L N) (12 + b)
             final decode of all L x N payloads  E (b + 4)
    The node sum is charged at C too, though a plain fp32 sum could run at copy bandwidth.
  Not modelled: whitening matmuls (4 r flops an element), per-message latency (at P = 1024 the
  flat alltoall sends P messages a bucket of E_b / P elements, 2.3 KB of a 4M-element bucket in
  NVFP4; two-hop sends N of the same size: latency favours two-hop, the model leaves it out),
  and the host's time (below).

Host time. benchmarks/host_scale.py measures one rank's host time a step of P simulated ranks on
a CPU with the CPU (numba) kernels, elements / 4 and / 16, Llama-3.2-1B and Llama-3.1-8B shapes:
not a GPU's host overhead, which no run has measured. This projection leaves host time out; the
.md quotes host_scale.md's ratios to P = 8 (read from that file) to show it does not grow with P.

Inputs and their sources:
  L (--gpus-per-node 8 4): ASSUMED, 8 for HGX H100/H200 nodes; 4 also reported.
  R (--nic-gbit 25 100 400): ASSUMED, a sweep: 25 GbE to 400 Gbit/s InfiniBand NDR, one a GPU.
  V (--nvlink-gbs 450): ASSUMED from NVIDIA's spec, NVLink4 on H100/H200 SXM: 900 GB/s a GPU
    both directions, 450 GB/s each way.
  C (--codec-gbs 2600): ASSUMED: no GPU was lent to the session that wrote this, so the
    default (about 62 % of an H200's measured 4211 GB/s copy) comes from a published
    measurement of portable Triton NVFP4 kernels of the same design (2641 GB/s, 62 %; 1761 GB/s
    with a fused Hadamard). Replace it with benchmarks/gpu_check.py's number (--measured).
  E (--params 1e9 8e9 70e9) and P (--ranks 64 256 1024): chosen points.
"""

import argparse
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
BITS = {"fp32": 32, "fp16": 16, "fp8": 8.0, "nvfp4": 4.5}
# arm: (collective, format); fp32 ring is the baseline, fp16 ring the second one
ARMS = {
    "fp32 ring": ("ring", "fp32"),
    "fp16 ring": ("ring", "fp16"),
    "gift-fp8 two-hop": ("two-hop", "fp8"),
    "gift-nvfp4 flat": ("flat", "nvfp4"),
    "gift-nvfp4 two-hop": ("two-hop", "nvfp4"),
}


def ring_bytes(e, q, p, local):
    """(NIC, NVLink) bytes a GPU sends in NCCL's allreduce (ring of L channels)."""
    n = p // local
    nic = 2 * (n - 1) / n * e * q / local
    return nic, 2 * (p - 1) / p * e * q - nic


def gather_bytes(e, q, p, local):
    """(NIC, NVLink) bytes a GPU sends in ncclAllGather of e elements in all (ring, L channels)."""
    n = p // local
    nic = (n - 1) / n * e * q / local
    return nic, (p - 1) / p * e * q - nic


def nic_bytes(collective, e, q, p, local):
    """Bytes one NIC sends a step."""
    n = p // local
    if collective == "ring":
        return ring_bytes(e, q, p, local)[0]
    if collective == "flat":
        return (p - local) / p * e * q + gather_bytes(e, q, p, local)[0]
    return 2 * (n - 1) / n * e / local * q


def codec_bytes(collective, e, q, p, local):
    """Bytes the GPU kernels move a step (0 for the rings: NCCL's sum is in its copy)."""
    n = p // local
    if collective == "ring":
        return 0.0
    if collective == "flat":
        return e * (20 + q) + e * q + 4 * e / p + e / p * (12 + q) + e * (q + 4)
    node = e / local
    return (4 * e + 4 * node + node * (20 + q) + node * q + 4 * node / n
            + node / n * (12 + q) + e * (q + 4))


def step_seconds(collective, fmt, e, p, local, nic_gbit, nvlink_gbs, codec_gbs):
    """(NIC-bound collectives' time, NVLink-only stages' time, codec time) of one step; their
    sum is the step's sync time."""
    q = BITS[fmt] / 8
    r, v = nic_gbit * 1e9 / 8, nvlink_gbs * 1e9
    n = p // local
    codec = codec_bytes(collective, e, q, p, local) / (codec_gbs * 1e9)
    if collective == "ring":
        nic, nvl = ring_bytes(e, q, p, local)
        return max(nic / r, nvl / v), 0.0, codec
    if collective == "flat":
        a_nic, a_nvl = (p - local) / p * e * q, (local - 1) / p * e * q
        g_nic, g_nvl = gather_bytes(e, q, p, local)
        return max(a_nic / r, a_nvl / v) + max(g_nic / r, g_nvl / v), 0.0, codec
    stage1 = (local - 1) / local * e * 4 / v
    stage2 = 2 * (n - 1) / n * e / local * q / r
    stage3 = (local - 1) * e / local * q / v
    return stage2, stage1 + stage3, codec


def host_notes(path):
    """Per section of host_scale.md: {model: (ratio to P = 8 at the largest P, largest P)}."""
    if not path.exists():
        return []
    sections, current = [], None
    for line in path.read_text().splitlines():
        if line.startswith("Rank 0 of P simulated"):
            divide = re.search(r"elements / (\d+)", line)
            current = {"divide": divide.group(1) if divide else "?", "rows": {}}
            sections.append(current)
        elif current is not None and line.startswith("| Llama"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            current["rows"][cells[0]] = (int(cells[1]), cells[-1])  # model: (P, after x P = 8)
    return sections


def fmt_cell(t, base, fp16):
    if base is None:
        return f"{t:.3f} s"
    if fp16 is None:
        return f"{t:.3f} s ({base / t:.1f}x)"
    return f"{t:.3f} s ({base / t:.1f}x / {fp16 / t:.1f}x)"


def time_table(args, local, params_list, ranks_list):
    lines = [
        "| params | P (N nodes) | NIC | " + " | ".join(ARMS) + " |",
        "|---|---|---|" + "---|" * len(ARMS),
    ]
    for e in params_list:
        for p in ranks_list:
            for rate in args.nic_gbit:
                times = {arm: sum(step_seconds(c, f, e, p, local, rate, args.nvlink_gbs,
                                               args.codec_gbs))
                         for arm, (c, f) in ARMS.items()}
                base, fp16 = times["fp32 ring"], times["fp16 ring"]
                cells = [fmt_cell(base, None, None), fmt_cell(fp16, base, None)]
                cells += [fmt_cell(t, base, fp16) for arm, t in times.items()
                          if arm not in ("fp32 ring", "fp16 ring")]
                lines.append(f"| {e / 1e9:g}B | {p} ({p // local}) | {rate:g} Gbit/s | "
                             + " | ".join(cells) + " |")
    return lines


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--gpus-per-node", type=int, nargs="+", default=[8, 4],
                   help="L; the first gets the full table, the others a table at --small-params "
                        "(ASSUMED)")
    p.add_argument("--nic-gbit", type=float, nargs="+", default=[25, 100, 400],
                   help="R, one NIC a GPU, Gbit/s (ASSUMED)")
    p.add_argument("--nvlink-gbs", type=float, default=450.0,
                   help="V, NVLink GB/s a GPU one way (ASSUMED: NVLink4 spec)")
    p.add_argument("--codec-gbs", type=float, default=2600.0,
                   help="C, the GIFT kernels' effective GB/s (ASSUMED unless --measured)")
    p.add_argument("--measured", action="store_true",
                   help="the codec bandwidth comes from benchmarks/gpu_check.py")
    p.add_argument("--params", type=float, nargs="+", default=[1e9, 8e9, 70e9],
                   help="E, gradient elements")
    p.add_argument("--small-params", type=float, default=8e9,
                   help="E for the tables of the other node sizes and the breakdown")
    p.add_argument("--ranks", type=int, nargs="+", default=[64, 256, 1024], help="P")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "projection.md"))
    args = p.parse_args()
    main_l = args.gpus_per_node[0]
    codec_source = ("MEASURED with benchmarks/gpu_check.py" if args.measured else
                    "ASSUMED (no GPU measurement yet; from a published Triton NVFP4 kernel "
                    "measurement, ~62 % of an H200's copy bandwidth)")
    lines = [
        "# Projected gradient-sync time per step on nodes of GPUs (on paper)",
        "",
        "Command: `.venv/bin/python benchmarks/projection.py`"
        + (f" (with `--codec-gbs {args.codec_gbs:g} --measured`)" if args.measured else ""),
        "",
        "No number here is a measurement on a GPU cluster: it is arithmetic on the inputs below.",
        "",
        "| input | value | source |",
        "|---|---|---|",
        f"| L, GPUs a node | {', '.join(map(str, args.gpus_per_node))} | ASSUMED "
        "(8: HGX H100/H200) |",
        f"| R, one NIC a GPU | {', '.join(f'{r:g}' for r in args.nic_gbit)} Gbit/s | ASSUMED "
        "(a sweep) |",
        f"| V, NVLink a GPU, one way | {args.nvlink_gbs:g} GB/s | ASSUMED (NVIDIA spec, "
        "NVLink4 H100/H200 SXM: 900 GB/s both ways) |",
        f"| C, GIFT codec bandwidth | {args.codec_gbs:g} GB/s | {codec_source} |",
        f"| E, gradient elements | {', '.join(f'{e / 1e9:g}B' for e in args.params)} | "
        "chosen points |",
        f"| P, GPUs | {', '.join(map(str, args.ranks))} | chosen points |",
        "| bits an element | fp32 32, fp16 16, FP8 8, NVFP4 4.5 | the formats |",
        "",
        "## Model (the module docstring of `benchmarks/projection.py`)",
        "",
        "```",
        __doc__.split("Model\n", 1)[1].split("\nHost time.", 1)[0].rstrip(),
        "```",
        "",
        "## Bytes per NIC per gradient element",
        "",
        "Bytes one NIC sends a step divided by E (gift-fp8 two-hop is the nvfp4 column x 8/4.5).",
        "",
        "| L | P | N | fp32 ring | fp16 ring | gift-nvfp4 flat | gift-nvfp4 two-hop | "
        "gift-fp8 two-hop |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for local in sorted(set(args.gpus_per_node), reverse=True):
        for ranks in args.ranks:
            cells = [nic_bytes(c, 1.0, BITS[f] / 8, ranks, local) for c, f in
                     (ARMS["fp32 ring"], ARMS["fp16 ring"], ARMS["gift-nvfp4 flat"],
                      ARMS["gift-nvfp4 two-hop"], ARMS["gift-fp8 two-hop"])]
            lines.append(f"| {local} | {ranks} | {ranks // local} | "
                         + " | ".join(f"{c:.3f}" for c in cells) + " |")
    lines += [
        "",
        "Had the flat reduction's allgather gone rank to rank instead of NCCL's ring, its NIC "
        "would carry 2 (P-L)/P E q: "
        + ", ".join(f"{2 * (ranks - main_l) / ranks * BITS['nvfp4'] / 8:.3f} E at P = {ranks}"
                    for ranks in args.ranks) + f" (L = {main_l}).",
        "",
        f"## Seconds a step, L = {main_l}",
        "",
        "Each cell: seconds a step (speedup against fp32 ring / against fp16 ring).",
        "",
    ]
    lines += time_table(args, main_l, args.params, args.ranks)
    for local in args.gpus_per_node[1:]:
        lines += ["", f"## Seconds a step, L = {local}, {args.small_params / 1e9:g}B parameters",
                  ""]
        lines += time_table(args, local, [args.small_params], args.ranks)
    big = max(args.ranks)
    lines += [
        "",
        f"## Where the time goes: {args.small_params / 1e9:g}B, P = {big}, L = {main_l}",
        "",
        "NIC: the collectives that cross nodes (for the rings and flat, max of NIC and NVLink "
        "time); NVLink: two-hop's node stages 1 and 3; codec: the GIFT kernels.",
        "",
        "| NIC | arm | NIC s | NVLink s | codec s | total s |",
        "|---|---|---|---|---|---|",
    ]
    for rate in args.nic_gbit:
        for arm, (c, f) in ARMS.items():
            parts = step_seconds(c, f, args.small_params, big, main_l, rate, args.nvlink_gbs,
                                 args.codec_gbs)
            lines.append(f"| {rate:g} Gbit/s | {arm} | "
                         + " | ".join(f"{x:.3f}" for x in parts) + f" | {sum(parts):.3f} |")
    lines += [
        "",
        "## Host time",
        "",
        "Left out of every time above: no GPU run has measured the host's time a step. "
        "`benchmarks/host_scale.py` measures rank 0's host time of P simulated ranks on a CPU "
        "with the CPU (numba) kernels, so its milliseconds are not a GPU's host overhead; what "
        "carries over is how it scales with P. From `benchmarks/results/host_scale.md` (after "
        "the per-tensor native calls), host time a step against P = 8:",
        "",
    ]
    sections = host_notes(ROOT / "benchmarks" / "results" / "host_scale.md")
    for section in sections:
        lines.append(f"- elements / {section['divide']}: " + "; ".join(
            f"{model} {ratio} at P = {ranks}"
            for model, (ranks, ratio) in section["rows"].items()))
    if not sections:
        lines.append("- (benchmarks/results/host_scale.md not found)")
    lines += [
        "",
        "host_scale's target is at most 1.5x at P = 1024; see its Reading for the elements / 16 "
        "case (pieces under the NVFP4 kernel's 512-element chunk, run zero-padded).",
    ]
    text = "\n".join(lines) + "\n"
    pathlib.Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
