"""GIFT's engine-neutral state of a model: what every frontend shares (state_base.GiftStateBase)
and the step of Horovod and DDP (gift_core.GiftCore, over the buckets of reducer.BucketReducer).
Imports the codec, geometry and reduce layers; no engine."""
