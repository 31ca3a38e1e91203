"""The wire format: element formats and their scales (formats.py, over horovod_gift.kernels),
a tensor's pieces encoded and decoded in one call (tensor_codec.Codec), the randomized Hadamard
rotation (rotation.py) and reused buffers (workspaces.py). Imports no other layer of GIFT."""
