"""GIFT in the transformers Trainer (and its subclasses: SFTTrainer, ...): a callback bound to
the trainer, since the Trainer has no comm-hook option and rebuilds Accelerate's DDP settings.

    from horovod_gift.integrations.hf_trainer import use_gift
    trainer = Trainer(model=model, args=args, ...)
    gift = use_gift(trainer, format="nvfp4")
    trainer.train()

GIFT is installed on the wrapped model (DDP or FSDP2) when training begins. Each rank's GIFT
state goes into every checkpoint folder (gift-rank{rank}.pt, beside the Trainer's
rng_state_{rank}.pth) and is loaded on resume from a checkpoint of args.output_dir."""
import os

from transformers import TrainerCallback

from .engines import RankFiles, check_engaged, install


class GiftTrainerCallback(TrainerCallback):
    """Made by use_gift; .state is GIFT's state once training began (stats(), describe())."""

    def __init__(self, trainer, config=None, **options):
        self.trainer, self.config, self.options = trainer, config, options
        self.state = self.files = None
        self.checked = False

    def folder(self, args, state):
        # the Trainer's own checkpoint folder (Trainer._save_checkpoint)
        return os.path.join(args.output_dir, f"checkpoint-{state.global_step}")

    def on_train_begin(self, args, state, control, **kwargs):
        if self.state is None:      # a second train() call keeps the first one's GIFT
            self.state = install(self.trainer.model_wrapped, self.config, **self.options)
            self.files = self.state and RankFiles(self.state)
        if self.files and state.global_step > 0:        # resumed from a checkpoint
            self.files.load(self.folder(args, state))

    def on_step_end(self, args, state, control, **kwargs):
        if not self.checked:
            check_engaged(self.state, state.global_step)
            self.checked = True

    def on_save(self, args, state, control, **kwargs):
        if self.files:          # on every process
            self.files.save(self.folder(args, state))


def use_gift(trainer, config=None, **options):
    """Add GIFT to trainer (config: a GiftConfig, options: fields of it); returns the callback,
    whose .state is GIFT's once training began."""
    callback = GiftTrainerCallback(trainer, config, **options)
    trainer.add_callback(callback)
    return callback
