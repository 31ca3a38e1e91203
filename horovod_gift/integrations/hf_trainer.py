"""GIFT in the transformers Trainer (and its subclasses: SFTTrainer, ...): a callback bound to
the trainer, since the Trainer has no comm-hook option and rebuilds Accelerate's DDP settings.

    from horovod_gift.integrations.hf_trainer import use_gift
    trainer = Trainer(model=model, args=args, ...)
    gift = use_gift(trainer, format="nvfp4")
    trainer.train()

GIFT is installed on the wrapped model (DDP or FSDP2) when training begins, again if a later
train() wraps a new model (model_init). fp16 training's GradScaler is handed to GIFT. Each rank's
GIFT state goes into every checkpoint folder (gift-rank{rank}.pt, beside the Trainer's
rng_state_{rank}.pth) and is loaded from the checkpoint train(resume_from_checkpoint=...) resumes
from. hyperparameter_search is refused (its trials checkpoint elsewhere)."""
import functools
import os

from transformers import TrainerCallback
from transformers.trainer_utils import get_last_checkpoint

from .engines import RankFiles, install


class GiftTrainerCallback(TrainerCallback):
    """Made by use_gift; .state is GIFT's state once training began (stats(), describe())."""

    def __init__(self, trainer, config=None, **options):
        self.trainer, self.config, self.options = trainer, config, options
        self.state = self.files = self.installed_on = None
        self.resume_from = None     # the checkpoint folder train() was asked to resume from

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_hyper_param_search:
            raise ValueError("GIFT: hyperparameter_search is not supported (each trial "
                             "checkpoints in a folder of its own); train each trial with "
                             "use_gift on a Trainer of its own")
        wrapped = self.trainer.model_wrapped
        if wrapped is not self.installed_on:        # the first train(), or a new model
            accelerator = self.trainer.accelerator
            self.state = install(wrapped, self.config,
                                 grad_scaler=getattr(accelerator, "scaler", None),
                                 **self.options)
            self.files, self.installed_on = self.state and RankFiles(self.state), wrapped
        if self.files and self.resume_from is not None:
            self.files.load(self.resume_from)

    def on_save(self, args, state, control, **kwargs):
        if self.files:          # on every process, into the Trainer's checkpoint folder
            self.files.save(os.path.join(args.output_dir, f"checkpoint-{state.global_step}"))


def use_gift(trainer, config=None, **options):
    """Add GIFT to trainer (config: a GiftConfig, options: fields of it); returns the callback,
    whose .state is GIFT's once training began."""
    callback = GiftTrainerCallback(trainer, config, **options)
    trainer.add_callback(callback)
    train = trainer.train

    @functools.wraps(train)
    def train_with_gift(resume_from_checkpoint=None, *args, **kwargs):
        # the folder the Trainer resolves (True: the last checkpoint of output_dir)
        callback.resume_from = (get_last_checkpoint(trainer.args.output_dir)
                                if resume_from_checkpoint is True else resume_from_checkpoint)
        return train(resume_from_checkpoint, *args, **kwargs)
    trainer.train = train_with_gift
    return callback
