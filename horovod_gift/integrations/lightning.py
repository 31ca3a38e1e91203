"""GIFT in PyTorch Lightning: a callback.

    from horovod_gift.integrations.lightning import GiftCallback
    trainer = L.Trainer(strategy="ddp", callbacks=[GiftCallback(format="nvfp4")])

On DDPStrategy it registers GIFT's hook itself: Lightning's own ddp_comm_hook option registers a
hook only on CUDA devices and drops it elsewhere without a word. On ModelParallelStrategy (FSDP2:
fully_shard in configure_model) it attaches GIFT to the sharded model. Each rank's GIFT state is
saved with every checkpoint, in directory/step{global_step}/gift-rank{rank}.pt (directory:
trainer.default_root_dir/gift unless given), and loaded when training resumes from it."""
import os

import lightning.pytorch as pl

from .engines import RankFiles, check_engaged, install


class GiftCallback(pl.Callback):
    """config: a GiftConfig; options: fields of it to replace (GiftConfig documents each);
    directory: where each rank's GIFT state goes at a checkpoint. After fit starts, .state is
    GIFT's state (stats(), describe())."""

    def __init__(self, config=None, *, directory=None, **options):
        self.config, self.options, self.directory = config, options, directory
        self.trainer = self.state = self.files = self.resume_from = None
        self.checked = False

    def on_fit_start(self, trainer, pl_module):
        self.trainer = trainer
        self.directory = self.directory or os.path.join(trainer.default_root_dir, "gift")
        self.state = install(trainer.strategy.model, self.config, **self.options)
        self.files = self.state and RankFiles(self.state)
        if self.files and self.resume_from is not None:
            self.files.load(self.resume_from)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if not self.checked and trainer.global_step > 0:
            check_engaged(self.state, trainer.global_step)
            self.checked = True

    def folder(self):
        return os.path.join(self.directory, f"step{self.trainer.global_step}")

    def state_dict(self):
        """What the checkpoint (written by rank 0) holds of GIFT: where each rank's state is."""
        return {"folder": self.folder()} if self.files else {}

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        if self.files:          # on every rank
            self.files.save(self.folder())

    def load_state_dict(self, state_dict):
        # Lightning restores callbacks before on_fit_start under DDP, after it under FSDP2
        self.resume_from = state_dict.get("folder")
        if self.files and self.resume_from is not None:
            self.files.load(self.resume_from)
