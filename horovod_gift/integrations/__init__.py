"""GIFT in the trainers users run. Each module imports its trainer only when imported itself (the
trainers are optional extras: pip install horovod-gift[trainers]):

    lightning.GiftCallback       Lightning's DDPStrategy (CPU included) and ModelParallelStrategy
    accelerate.install           after Accelerator.prepare, DDP or FSDP2
    hf_trainer.use_gift          the transformers Trainer (and its subclasses)
    engines.install              any DistributedDataParallel or fully_shard model
    torchft.GiftDiLoCo           torchft's DiLoCo, its outer all-reduce through GIFT's codec
                                 (pip install horovod-gift[torchft])

Each one refuses a model GIFT cannot serve (DeepSpeed, FSDP1, DataParallel) by name, raises at
the first optimizer step if the engine never called GIFT (a trainer that dropped the hook would
otherwise train in fp32 without a word), hands fp16's GradScaler to GIFT, and saves each rank's
GIFT state beside the trainer's checkpoint, so that a resume is bit for bit. torchtitan:
docs/trainers.md."""
