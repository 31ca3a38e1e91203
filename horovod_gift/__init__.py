"""horovod-gift: low-precision gradient communication for Horovod."""
