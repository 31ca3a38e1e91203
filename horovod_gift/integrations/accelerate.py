"""GIFT in Hugging Face Accelerate: one call after prepare().

    from horovod_gift.integrations.accelerate import install
    model, optimizer, data = accelerator.prepare(model, optimizer, data)
    gift = install(accelerator, model, format="nvfp4")

DDP (MULTI_GPU, MULTI_CPU) gets GIFT's hook, FSDP2 (FullyShardedDataParallelPlugin with
fsdp_version=2) gets fsdp.attach. DistributedDataParallelKwargs(comm_hook=...) takes only
Accelerate's own DDPCommunicationHookType and maps anything else to no hook at all: install()
refuses such a setting by name rather than let GIFT look installed. fp16's GradScaler
(mixed_precision="fp16") is handed to GIFT. accelerator.save_state / load_state keep each rank's
GIFT state in the checkpoint folder (gift-rank{rank}.pt)."""
from accelerate.utils import DDPCommunicationHookType

from .engines import RankFiles
from .engines import install as install_on_model


def install(accelerator, model, config=None, **options):
    """GIFT on model as accelerator.prepare returned it (config: a GiftConfig, options: fields
    of it); returns GIFT's state (stats(), describe()), or None in a single process. Every
    process calls it, before the first backward."""
    hook = getattr(accelerator.ddp_handler, "comm_hook", DDPCommunicationHookType.NO)
    if hook != DDPCommunicationHookType.NO:
        if isinstance(hook, DDPCommunicationHookType):
            raise ValueError(f"GIFT: DistributedDataParallelKwargs(comm_hook={hook}) already "
                             "gave DDP Accelerate's hook; GIFT replaces it: remove comm_hook")
        raise ValueError(f"GIFT: DistributedDataParallelKwargs(comm_hook={hook!r}): Accelerate "
                         "takes only its DDPCommunicationHookType there and registered no hook "
                         "for this one; remove comm_hook and call install(accelerator, model)")
    state = install_on_model(model, config, grad_scaler=accelerator.scaler, **options)
    if state is not None:
        files = RankFiles(state)
        accelerator.register_save_state_pre_hook(lambda models, weights, folder:
                                                 files.save(folder))
        accelerator.register_load_state_pre_hook(lambda models, folder: files.load(folder))
    return state
