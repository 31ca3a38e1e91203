"""Reused buffers for the codec's temporaries, kept per thread, device and purpose.

On the CPU a fresh tensor of over 32 MB is mapped anew by glibc on every allocation and costs a
page fault per 4 KB (a 1e7-element sum: 45-50 ms into a new tensor, 20-22 ms into a reused one),
so temporaries the size of a bucket's piece live here, at the largest size asked for. On a GPU
the caching allocator already reuses memory; the buffers cost the same there and are kept for
one code path. benchmarks/memory.py counts them in GIFT's memory per parameter byte.
"""
import threading

import torch

_workspaces = threading.local()


def workspace(n, device, purpose):
    """A buffer of n fp32 elements for a temporary of `purpose` (one user at a time each); on
    CUDA one per stream too (GIFT's second stages run on a side stream, beside the first)."""
    buffers = _workspaces.__dict__.setdefault("buffers", {})
    device = torch.device(device)
    key = (device, purpose, torch.cuda.current_stream(device) if device.type == "cuda" else None)
    buffer = buffers.get(key)
    if buffer is None or buffer.numel() < n:
        buffer = buffers[key] = torch.empty(n, dtype=torch.float32, device=device)
    return buffer[:n]
