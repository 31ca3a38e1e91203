import os

# Kernel tests run Triton's CPU interpreter; it must be chosen before triton is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")
# torch.compile costs seconds per variant; only tests/test_compiled.py turns it on.
os.environ.setdefault("HOROVOD_GIFT_COMPILE", "0")
