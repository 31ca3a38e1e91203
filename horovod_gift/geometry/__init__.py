"""What makes a gradient near-isotropic before it is quantized: the input whitening of a linear
layer's gradient (whitening.py) from per-layer input statistics (statistics.py, sketch.py), which
modules are linear layers (linear_layers.py), and which tensor takes which transform
(transforms.py). Imports only horovod_gift.codec and the top-level config."""
