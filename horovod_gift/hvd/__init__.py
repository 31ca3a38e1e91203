"""The Horovod frontend: GIFT, a Compressor for hvd.DistributedOptimizer (compressor.py), the
Horovod Communicator and allreduce (comm.py), and every assumption GIFT makes about Horovod's
private behaviour (internals.py). The only layer that imports horovod."""
