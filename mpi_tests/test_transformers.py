"""GIFT on Hugging Face transformers models as users build them (from a config, random init):
Llama with tied and untied embeddings, GPT-2 (Conv1D layers, tied), Qwen2 (biases on q/k/v), each
with and without gradient checkpointing. Every rank ends bit-identical, and the whitening is
engaged on every linear weight, the tied one included."""
import pytest
import torch
import horovod.torch as hvd
from transformers import AutoConfig, AutoModelForCausalLM

import horovod_gift as gift
from helpers import assert_identical_on_all_ranks

VOCAB = 64
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, vocab_size=VOCAB, bos_token_id=None, eos_token_id=None,
             pad_token_id=None)
MODELS = {
    "llama-tied": ("llama", dict(SMALL, tie_word_embeddings=True)),
    "llama-untied": ("llama", dict(SMALL, tie_word_embeddings=False)),
    "qwen2": ("qwen2", dict(SMALL, tie_word_embeddings=False)),
    "gpt2": ("gpt2", dict(n_embd=64, n_layer=2, n_head=2, vocab_size=VOCAB, n_positions=32,
                          bos_token_id=None, eos_token_id=None)),
}
def build(kind, checkpointing):
    model_type, options = MODELS[kind]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **options))
    if checkpointing:
        model.activation_checkpointing_enable()
    return model.train()


def train(kind, checkpointing, steps=5, compile=None):
    """compile: None, or "before" / "after" GIFT is made: torch.compile the model then."""
    model = build(kind, checkpointing)
    if compile == "before":
        model = torch.compile(model, backend="aot_eager")
    compression = gift.GIFT(model, min_elements=256, refresh_every=2, verbose=False)
    if compile == "after":
        model = torch.compile(model, backend="aot_eager")
    opt = hvd.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2),
                                   named_parameters=model.named_parameters(),
                                   compression=compression)
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 * step + hvd.rank())
        x = torch.randint(0, VOCAB, (4, 16), generator=g)
        opt.zero_grad()
        model(input_ids=x, labels=x, use_cache=False).loss.backward()
        opt.step()
    return model, compression


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
@pytest.mark.parametrize("kind", list(MODELS))
def test_transformers_models_train_identically_with_every_linear_weight_whitened(kind,
                                                                                 checkpointing):
    model, compression = train(kind, checkpointing)
    assert_identical_on_all_ranks(list(model.parameters()), f"{kind} parameters")
    tied = model.config.tie_word_embeddings
    embedding = next(n for n, p in model.named_parameters()
                     if p is model.get_input_embeddings().weight)
    two_d = {n for n, p in model.named_parameters() if p.dim() == 2}
    unread = {"transformer.wpe.weight"} | (set() if tied else {embedding})
    whitened = {n for n, plan in compression.plan.choice.items() if plan == "whiten"}
    assert whitened == two_d - unread, compression.describe()
    stats = compression.statistics
    assert all(stats.whitening[n].factors for n in whitened), "a whitened weight has no factors"
    if tied:
        assert stats.borrowed == {embedding: ["lm_head"]}
        assert f"read through another module: {embedding} by lm_head" in compression.describe()
    if kind == "gpt2":
        assert ("2-D weights no linear module reads (not whitened): transformer.wpe.weight"
                in compression.describe())
    if kind == "gpt2":      # every Conv1D weight is stored (in, out)
        assert stats.transposed == {n for n in whitened if ".h." in n}


@pytest.mark.parametrize("kind", ["gpt2", "llama-tied"])
def test_checkpointing_counts_each_layers_statistics_once(kind):
    """The checkpointed run recomputes every decoder layer's forward inside backward; its
    statistics (their token counts and values) are those of the plain run."""
    histories = []
    for checkpointing in (False, True):
        _, compression = train(kind, checkpointing, steps=3)
        histories.append(compression.statistics.local_state_dict())
    plain, checkpointed = histories
    assert set(plain) == set(checkpointed)
    for owner in plain:
        assert float(checkpointed[owner][-1]) == float(plain[owner][-1]), owner   # tokens
        torch.testing.assert_close(checkpointed[owner], plain[owner], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("order", ["before", "after"])
def test_gift_made_before_or_after_torch_compile_trains_as_eager(order):
    """torch.compile with the aot_eager backend (dynamo's capture of GIFT's hooks without a C++
    compiler): the statistics are taken and shared as in eager, every weight whitened, and the
    parameters are those of the eager run up to the whitening's tolerance, identical on every
    rank."""
    torch._dynamo.reset()
    eager, eager_compression = train("llama-tied", False, steps=4)
    compiled, compression = train("llama-tied", False, steps=4, compile=order)
    assert_identical_on_all_ranks(list(compiled.parameters()), "compiled parameters")
    # statistics taken, and shared as in eager (q/k/v read one input, gate/up another)
    owners = [len(c.statistics.local_state_dict()) for c in (eager_compression, compression)]
    assert owners[1] == owners[0] > 0, owners
    assert all(plan == "whiten" for n, plan in compression.plan.choice.items()
               if n in compression.reducer.bucket_of and compression.params[n].dim() == 2)
    # Compiled kernels round differently, which moves a few NVFP4 codes by a step: the runs
    # agree to a small part of the distance the parameters travelled
    start = build("llama-tied", False)
    moved = apart = 0.0
    for p0, p, q in zip(start.parameters(), eager.parameters(), compiled.parameters()):
        moved += float((p - p0).square().sum())
        apart += float((q - p).square().sum())
    assert (apart / moved) ** 0.5 < 0.01, (apart / moved) ** 0.5


class Projection(torch.nn.Module):
    """A linear layer GIFT knows only once registered."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(64, 32))

    def forward(self, x):
        return x @ self.weight.t()


def test_a_linear_class_registered_on_one_rank_only_raises_on_every_rank():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), Projection())
    if hvd.rank() == 0:
        gift.register_linear(Projection)
    try:
        compression = gift.GIFT(model, min_elements=256, verbose=False)
    finally:
        gift.geometry.linear_layers.REGISTRY.pop(Projection, None)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   compression=compression)
    with pytest.raises(ValueError, match="call gift.register_linear on every rank"):
        model(torch.randn(4, 32)).sum().backward()      # the check runs at the first gradient
        opt.step()
