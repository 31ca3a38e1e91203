"""GIFT in PyTorch Lightning: a callback.

    from horovod_gift.integrations.lightning import GiftCallback
    trainer = L.Trainer(strategy="ddp", callbacks=[GiftCallback(format="nvfp4")])

On DDPStrategy it registers GIFT's hook itself: Lightning's own ddp_comm_hook option registers a
hook only on CUDA devices and drops it elsewhere without a word. On ModelParallelStrategy (FSDP2:
fully_shard in configure_model) it attaches GIFT to the sharded model. fp16 training's
GradScaler (precision="16-mixed") is handed to GIFT. Each rank's GIFT state is saved with every
checkpoint, in directory/step{global_step}/gift-rank{rank}.pt (directory:
trainer.default_root_dir/gift unless given), and loaded when training resumes from it; the
folders of all but the last keep_last checkpoints are removed (GIFT's per-rank state is about
the size of the model's gradients: a resume from an older checkpoint restarts it, with a
warning)."""
import contextlib
import os
import shutil

import lightning.pytorch as pl

from .engines import RankFiles, install


class GiftCallback(pl.Callback):
    """config: a GiftConfig; options: fields of it to replace (GiftConfig documents each);
    directory: where each rank's GIFT state goes at a checkpoint; keep_last: how many of those
    checkpoints keep it. After fit starts, .state is GIFT's state (stats(), describe())."""

    def __init__(self, config=None, *, directory=None, keep_last=2, **options):
        self.config, self.options = config, options
        self.directory, self.keep_last = directory, keep_last
        self.trainer = self.state = self.files = self.resume_from = None
        self.saved = []         # this fit's GIFT folders, oldest first

    def on_fit_start(self, trainer, pl_module):
        self.trainer = trainer
        self.directory = self.directory or os.path.join(trainer.default_root_dir, "gift")
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self.state = install(trainer.strategy.model, self.config, grad_scaler=scaler,
                             **self.options)
        self.files = self.state and RankFiles(self.state)
        if self.files and self.resume_from is not None:
            self.files.load(self.resume_from)

    def on_fit_end(self, trainer, pl_module):
        self.resume_from = None     # a later fit() without ckpt_path starts from this state

    def folder(self):
        return os.path.join(self.directory, f"step{self.trainer.global_step}")

    def state_dict(self):
        """What the checkpoint (written by rank 0) holds of GIFT: where each rank's state is."""
        return {"folder": self.folder()} if self.files else {}

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        if not self.files:
            return
        folder = self.folder()      # on every rank: its own file
        self.files.save(folder)
        if folder not in self.saved:
            self.saved.append(folder)
        while len(self.saved) > self.keep_last:
            old = self.saved.pop(0)
            with contextlib.suppress(FileNotFoundError):    # rank 0 may have removed it all
                os.remove(RankFiles.path(old))
            if trainer.is_global_zero:
                shutil.rmtree(old, ignore_errors=True)

    def load_state_dict(self, state_dict):
        # Lightning restores callbacks before on_fit_start under DDP, after it under FSDP2
        self.resume_from = state_dict.get("folder")
        if self.files and self.resume_from is not None:
            self.files.load(self.resume_from)
