"""Gradient-sync time per step on GPU clusters, on paper, from stated inputs.

    .venv/bin/python benchmarks/projection.py [--codec-gbs 2600]

Model (no overlap with compute, bandwidth-bound ring):
  wire:  2 (n-1)/n * P * bits/8 bytes per rank over a link of R bit/s
  codec: bytes the GIFT kernels must move per rank at the codec's effective bandwidth:
         stage 1 fused transform + feedback + encode, P * (4 + 8 + 8 + bits/8)
             (amax pass, x, residual read and write, payload);
         owner sums:  P * bits/8 + 4 P / n;  stage 2 encode: P/n * (12 + bits/8);
         final decode: P * (bits/8 + 4)
The codec bandwidth is an INPUT: no GPU was lent to the session that wrote this, so the default
(2600 GB/s, about 62 % of an H200's measured 4211 GB/s copy) is ASSUMED from a published
measurement of portable Triton NVFP4 kernels of the same design (2641 GB/s, 62 %; 1761 GB/s with
a fused Hadamard). Replace it with benchmarks/gpu_check.py's
number when a GPU run exists. Whitening matmuls (4 r flops per element) are left out.
"""

import argparse
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
ARMS = {"none (fp32)": 32, "fp16": 16, "gift-fp8": 8.0, "gift-nvfp4": 4.5}


def sync_seconds(params, ranks, link_gbit, bits, codec_gbs, compressed):
    wire = 2 * (ranks - 1) / ranks * params * bits / 8 / (link_gbit * 1e9 / 8)
    if not compressed:
        return wire, 0.0
    b = bits / 8
    moved = (
        params * (20 + b)
        + params * b
        + 4 * params / ranks
        + params / ranks * (12 + b)
        + params * (b + 4)
    )
    return wire, moved / (codec_gbs * 1e9)


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--codec-gbs", type=float, default=2600.0)
    p.add_argument(
        "--measured", action="store_true", help="the codec bandwidth comes from gpu_check.py"
    )
    args = p.parse_args()
    source = (
        "measured with benchmarks/gpu_check.py"
        if args.measured
        else "ASSUMED (no GPU measurement yet)"
    )
    lines = [
        "# Projected gradient-sync time per step (on paper)",
        "",
        f"Codec bandwidth {args.codec_gbs:.0f} GB/s per GPU: {source}. Model and inputs: see "
        "`benchmarks/projection.py`. Time = wire + codec, no overlap with compute; speedup "
        "against fp32.",
        "",
        "| params | ranks | link | " + " | ".join(ARMS) + " |",
        "|---|---|---|" + "---|" * len(ARMS),
    ]
    for params in (1e9, 8e9, 70e9):
        for ranks in (8, 64, 1024):
            for link in (25, 100, 400):
                cells = []
                base = None
                for arm, bits in ARMS.items():
                    wire, codec = sync_seconds(
                        params, ranks, link, bits, args.codec_gbs, arm.startswith("gift")
                    )
                    total = wire + codec
                    base = base or total
                    cells.append(
                        f"{total:.3f} s"
                        + (f" ({base / total:.1f}x)" if arm != "none (fp32)" else "")
                    )
                lines.append(
                    f"| {params / 1e9:.0f}B | {ranks} | {link} Gbit/s | " + " | ".join(cells) + " |"
                )
    text = "\n".join(lines) + "\n"
    (ROOT / "benchmarks" / "results" / "projection.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
