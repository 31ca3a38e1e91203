"""Data-parallel pretraining of a Hugging Face transformers causal LM, from its config (random
initialization, nothing downloaded), on the byte-level corpus, with Horovod and GIFT.

    horovodrun -np 2 -H localhost:2 python examples/train_hf.py --config gpt2 \
        --compression gift-nvfp4
    horovodrun -np 8 python examples/train_hf.py --config my_model/config.json \
        --gradient-checkpointing --device cuda

--config: a model type transformers knows (llama, gpt2, qwen2, mistral, gemma, ...) or a config
JSON file. By model type, the model is sized by --dim and --layers (default 128 and 2, as
examples/train_llama.py); from a JSON, as the file says unless --dim or --layers are given. The
vocabulary is always set to 256 (the corpus is bytes). Every other flag is train_llama.py's.
Needs transformers: pip install "horovod-gift[hf]".
"""
import pathlib
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import train_llama  # noqa: E402

VOCAB = 256     # the corpus is bytes


class CausalLM(torch.nn.Module):
    """model(tokens, targets) -> (logits, loss), the interface train_llama.main trains: the loss
    over the targets given (the corpus' batches are already shifted by one byte)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, tokens, targets=None):
        logits = self.model(input_ids=tokens, use_cache=False).logits
        if targets is None:
            return logits
        return logits, F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                       targets.reshape(-1))


def parse_args(argv=None):
    p = train_llama.make_parser(__doc__)
    p.add_argument("--config", default="llama",
                   help="a transformers model type (llama, gpt2, qwen2, ...) or a config JSON file")
    p.add_argument("--tie-embeddings", choices=("config", "yes", "no"), default="config",
                   help="tie the input embedding and the LM head (default: as the config says)")
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="model.gradient_checkpointing_enable(): recompute activations in backward")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.set_defaults(dim=None, layers=None)
    return p.parse_args(argv)


def make_config(args):
    """The transformers config of --config, sized by --dim / --layers (module docstring)."""
    from transformers import AutoConfig

    path = pathlib.Path(args.config)
    by_file = path.suffix == ".json" and path.exists()
    config = AutoConfig.from_pretrained(str(path)) if by_file else AutoConfig.for_model(args.config)
    dim, layers = args.dim, args.layers
    if not by_file:
        dim, layers = dim or 128, layers or 2
    if dim is not None:
        heads = max(1, dim // 32)
        config.hidden_size, config.num_attention_heads = dim, heads
        if hasattr(config, "num_key_value_heads"):
            config.num_key_value_heads = heads
        if hasattr(config, "head_dim"):
            config.head_dim = dim // heads
        if hasattr(config, "intermediate_size"):
            config.intermediate_size = (8 * dim // 3 + 7) // 8 * 8
    if layers is not None:
        config.num_hidden_layers = layers
    config.vocab_size = VOCAB
    # ids of the tokenizer the config was made for; bytes have none
    config.bos_token_id = config.eos_token_id = config.pad_token_id = None
    if getattr(config, "max_position_embeddings", args.seq_len) < args.seq_len:
        config.max_position_embeddings = args.seq_len
    if args.tie_embeddings != "config":
        config.tie_word_embeddings = args.tie_embeddings == "yes"
    return config


def build_model(args, device):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(make_config(args))
    if args.gradient_checkpointing:
        model.activation_checkpointing_enable()
    model = CausalLM(model).to(device).train()
    return torch.compile(model) if args.compile else model


if __name__ == "__main__":
    train_llama.main(parse=parse_args, build=build_model)
