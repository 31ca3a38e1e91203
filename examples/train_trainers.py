"""A transformers GPT-2 trained under Lightning (DDP, or FSDP2 through ModelParallelStrategy),
Accelerate and the transformers Trainer, with or without GIFT (horovod_gift.integrations): the
lines README's trainer section shows, tested in torchrun_tests/test_integrations.py and measured
over seeds by benchmarks/trainers.py. The task: a 64-token language in which token t+1 is
5 t + 3 (mod 64), one token in 8 random.

    torchrun --nproc-per-node 2 examples/train_trainers.py --trainer lightning --gift
"""
import argparse
import json
import os

import torch
import torch.distributed as dist
import transformers
from engines import shutdown

VOCAB, LENGTH, BATCH, STEPS_AN_EPOCH, LR = 64, 16, 8, 8, 1e-2
GIFT = {"format": "nvfp4", "min_elements": 1024}


def tiny_gpt2(seed=0):
    torch.manual_seed(seed)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=32, n_layer=2,
                                     n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def sequences(count, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.empty(count, LENGTH, dtype=torch.long)
    x[:, 0] = torch.randint(0, VOCAB, (count,), generator=g)
    for t in range(1, LENGTH):
        x[:, t] = (5 * x[:, t - 1] + 3) % VOCAB
    noise = torch.rand(count, LENGTH, generator=g) < 0.125
    return torch.where(noise, torch.randint(0, VOCAB, (count, LENGTH), generator=g), x)


def train_set(seed=0):
    return sequences(BATCH * STEPS_AN_EPOCH * dist.get_world_size(), seed=1000 + seed)


def held_out_loss(model):
    """On every rank, of the whole model (FSDP gathers its shards for the forward)."""
    model = getattr(model, "module", model)
    with torch.no_grad():
        x = sequences(64, seed=2)
        return float(model(input_ids=x, labels=x).loss)


# ---------------------------------------------------------------- Lightning
def lightning_fit(folder, epochs, gift, resume=None, fsdp=False, seed=0):
    """(trainer, the GPT-2, GiftCallback or None) after trainer.fit; fsdp: ModelParallelStrategy
    with each block and the model fully_shard'ed in configure_model."""
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import fully_shard

    from horovod_gift.integrations.lightning import GiftCallback

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = tiny_gpt2(seed)

        def configure_model(self):
            if fsdp:
                mesh = self.device_mesh["data_parallel"]
                for block in self.model.transformer.h:
                    fully_shard(block, mesh=mesh)
                fully_shard(self.model, mesh=mesh)

        def training_step(self, batch, index):
            return self.model(input_ids=batch, labels=batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=LR)

    world = dist.get_world_size()
    strategy = (ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
                if fsdp else "ddp")
    callback = GiftCallback(**GIFT) if gift else None
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_epochs=epochs,
                         default_root_dir=folder, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[callback] if gift else [])
    module = Module()
    data = torch.utils.data.DataLoader(train_set(seed), batch_size=BATCH)
    trainer.fit(module, data, ckpt_path=resume)
    return trainer, module.model, callback


# ---------------------------------------------------------------- Accelerate
def accelerate_train(folder, epochs, gift, first_epoch=0, ddp_kwargs=None, seed=0):
    """(the prepared model, GIFT's state or None); accelerator.save_state after each epoch into
    folder/epoch{k}, loaded from there when first_epoch > 0."""
    from accelerate import Accelerator

    from horovod_gift.integrations.accelerate import install

    accelerator = Accelerator(cpu=True, kwargs_handlers=[ddp_kwargs] if ddp_kwargs else None)
    model = tiny_gpt2(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    data = torch.utils.data.DataLoader(train_set(seed), batch_size=BATCH)
    model, optimizer, data = accelerator.prepare(model, optimizer, data)
    state = install(accelerator, model, **GIFT) if gift else None
    if first_epoch:
        accelerator.load_state(os.path.join(folder, f"epoch{first_epoch}"))
    for epoch in range(first_epoch, epochs):
        for batch in data:
            accelerator.backward(model(input_ids=batch, labels=batch).loss)
            optimizer.step()
            optimizer.zero_grad()
        accelerator.save_state(os.path.join(folder, f"epoch{epoch + 1}"))
    return model, state


# ---------------------------------------------------------------- the transformers Trainer
def hf_train(folder, epochs, gift, resume=None, seed=0):
    """(the trained GPT-2, use_gift's callback or None); a checkpoint each epoch."""
    from horovod_gift.integrations.hf_trainer import use_gift

    rows = [{"input_ids": x, "labels": x} for x in train_set(seed)]
    args = transformers.TrainingArguments(
        output_dir=folder, per_device_train_batch_size=BATCH, num_train_epochs=epochs,
        learning_rate=LR, lr_scheduler_type="constant", weight_decay=0.0,
        save_strategy="epoch", logging_strategy="no", report_to=[], use_cpu=True,
        ddp_backend="gloo", seed=seed, disable_tqdm=True)
    trainer = transformers.Trainer(model=tiny_gpt2(seed), args=args, train_dataset=rows)
    callback = use_gift(trainer, **GIFT) if gift else None
    trainer.train(resume_from_checkpoint=resume)
    return trainer.model, callback


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trainer", choices=["lightning", "lightning-fsdp", "accelerate", "hf"],
                   required=True)
    p.add_argument("--gift", action="store_true")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--folder", default="runs/trainers")
    p.add_argument("--out", help="rank 0 writes {held_out, stats} here as JSON")
    args = p.parse_args()
    dist.init_process_group("gloo")
    folder = os.path.join(args.folder, f"{args.trainer}-{args.seed}-{int(args.gift)}")
    if args.trainer.startswith("lightning"):
        _, model, callback = lightning_fit(folder, args.epochs, args.gift, seed=args.seed,
                                           fsdp=args.trainer == "lightning-fsdp")
        state = callback and callback.state
    elif args.trainer == "accelerate":
        model, state = accelerate_train(folder, args.epochs, args.gift, seed=args.seed)
    else:
        model, callback = hf_train(folder, args.epochs, args.gift, seed=args.seed)
        state = callback and callback.state
    result = {"held_out": held_out_loss(model), "stats": state.stats() if state else None}
    if dist.get_rank() == 0:
        print(json.dumps(result, default=str))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, default=str)
    shutdown()


if __name__ == "__main__":
    main()
