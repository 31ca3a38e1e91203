"""Triton kernels of horovod-gift, each beside the plain-torch reference it must match."""
