import os

# Kernel tests run Triton's CPU interpreter; it must be chosen before triton is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")
