"""How quantized gradients travel and are summed: the Communicator interface (communicator.py),
a bucket's two-stage reduction (collective.py), over nodes in two hops (two_hop.py), which one a
bucket takes (topology.py), a step's reductions moved on stage by stage (pipeline.py) and the
error-feedback residuals (feedback.py). Imports horovod_gift.codec; no engine."""
