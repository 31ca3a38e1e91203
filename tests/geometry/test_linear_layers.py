"""Which modules' weights are whitened (linear_layers.py) and their statistics: transformers'
Conv1D (weight stored in x out), classes given to register_linear, tied weights, activation
checkpointing (reentrant or not) and torch.compile. One process: statistics over a LocalGroup of
one rank."""
import pytest
import torch
import torch.utils.checkpoint
from transformers.pytorch_utils import Conv1D

import horovod_gift as gift
from horovod_gift.geometry import linear_layers
from horovod_gift.reduce.communicator import LocalGroup
from horovod_gift.codec.rotation import HadamardRotation
from horovod_gift.geometry.statistics import WhiteningStatistics
from horovod_gift.geometry.transforms import TransformPlan


def statistics_of(model, refresh_every=1):
    return WhiteningStatistics(model, dict(model.named_parameters()), whitening_rank=4, damping=1.0,
                               refresh_every=refresh_every, window=5,
                               comm=LocalGroup(1).communicators()[0])


def step(model, stats, x):
    """One step as GIFT runs it: forward and backward, refresh from the steps before, then this
    step's sums go into the history."""
    model(x).sum().backward()
    changed = stats.refresh()
    stats.advance()
    return changed


class KeywordLinear(torch.nn.Module):
    """A linear layer of a kind GIFT cannot know: weight stored (in, out), input by keyword."""

    def __init__(self, n_in, n_out):
        super().__init__()
        self.kernel = torch.nn.Parameter(torch.randn(n_in, n_out) / n_in ** 0.5)

    def forward(self, *, hidden_states):
        return hidden_states @ self.kernel


class Stack(torch.nn.Module):
    """A Conv1D (transformers' transposed linear), a registered custom layer, and an nn.Linear
    head tied to an embedding, in the way transformers ties them."""

    def __init__(self, vocab=48, dim=32, checkpoint=None):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(vocab, dim)
        self.conv = Conv1D(64, dim)
        self.custom = KeywordLinear(64, dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.checkpoint = checkpoint      # None, or use_reentrant for the middle layers

    def middle(self, x):
        return self.custom(hidden_states=torch.relu(self.conv(x)))

    def forward(self, tokens):
        x = self.embed(tokens)
        if self.checkpoint is None:
            h = self.middle(x)
        else:
            h = torch.utils.checkpoint.checkpoint(self.middle, x, use_reentrant=self.checkpoint)
        return self.head(x + h)


@pytest.fixture
def registered():
    gift.register_linear(KeywordLinear, input="hidden_states", weight="kernel", layout="in_out")
    yield
    del linear_layers.REGISTRY[KeywordLinear]


def tokens(seed, vocab=48):
    return torch.randint(0, vocab, (4, 10), generator=torch.Generator().manual_seed(seed))


def test_conv1d_registered_classes_and_tied_weights_are_found(registered):
    stats = statistics_of(Stack())
    assert stats.readers == {"conv.weight": ["conv"], "custom.kernel": ["custom"],
                             "embed.weight": ["head"]}
    assert stats.transposed == {"conv.weight", "custom.kernel"}
    assert stats.borrowed == {"embed.weight": ["head"]}
    # in_features from each layout: 32 for Conv1D(64, 32), 64 for the custom (64, 32) kernel
    assert stats.whitening["conv.weight"].in_features == 32
    assert stats.whitening["custom.kernel"].in_features == 64
    stats.remove_hooks()


def test_each_reader_feeds_its_own_input_to_the_weights_statistic(registered):
    model = Stack()
    stats = statistics_of(model)
    x = tokens(0)
    model(x).sum().backward()
    stats.refresh()     # settles who owns which statistic
    stats.advance()
    model(x).sum().backward()
    with torch.no_grad():       # not counted
        hidden = model.embed(x)
        expected = {"conv.weight": hidden, "custom.kernel": torch.relu(model.conv(hidden)),
                    "embed.weight": hidden + model.middle(hidden)}
    for name, activations in expected.items():
        alone = gift.InputWhitening(activations.shape[-1], rank=4)
        sums = torch.zeros(alone.statistic.numel)
        alone.statistic.accumulate(activations.detach().reshape(-1, activations.shape[-1]), sums)
        torch.testing.assert_close(stats._sums[name][:-1], sums, rtol=1e-5, atol=1e-5)
        assert float(stats._sums[name][-1]) == 40.0, name     # 4 x 10 tokens, counted once
    stats.remove_hooks()


def test_a_weight_stored_in_by_out_is_whitened_on_its_input_side(registered):
    """The map of a Conv1D gradient (in, out) is the nn.Linear map of its transpose, and the
    inverse undoes it, in place or not."""
    model = Stack()
    stats = statistics_of(model)
    for seed in range(2):
        step(model, stats, tokens(seed))
    plan = TransformPlan(dict(model.named_parameters()), "whiten", stats, HadamardRotation(128))
    w = stats.whitening["conv.weight"]
    assert w.factors, "no factors after a refresh"
    g = torch.randn(32, 64)                 # Conv1D(64, 32): weight (in=32, out=64)
    u = plan.forward("conv.weight", g)
    torch.testing.assert_close(u.view(32, 64), w.forward(g.t().contiguous()).t(),
                               rtol=1e-5, atol=1e-6)
    assert not torch.allclose(u.view(32, 64), g), "the whitening did nothing"
    back = plan.inverse("conv.weight", u.clone())
    torch.testing.assert_close(back.view(32, 64), g, rtol=1e-4, atol=1e-5)
    in_place = plan.inverse("conv.weight", u.clone(), in_place=True)
    assert torch.equal(in_place, back)
    stats.remove_hooks()


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_a_checkpointed_layer_is_counted_once(registered, reentrant):
    """Checkpointing recomputes conv and custom inside backward: their statistics are those of
    the plain run (non-reentrant: the forward's; reentrant: the recomputation's, as its first
    forward runs without grad; GIFT folds them into the next step's, as advance() runs at the
    step's first gradient)."""
    plain, checkpointed = Stack(), Stack(checkpoint=reentrant)
    stats = [statistics_of(plain, refresh_every=100), statistics_of(checkpointed,
                                                                     refresh_every=100)]
    for seed in range(3):
        for model, s in zip((plain, checkpointed), stats):
            step(model, s, tokens(seed))
    for name in ("conv.weight", "custom.kernel"):
        history = [s._history[name] for s in stats]
        assert float(history[1][-1]) == float(history[0][-1]), name
        torch.testing.assert_close(history[1], history[0], rtol=1e-5, atol=1e-5)
    for s in stats:
        s.remove_hooks()


@pytest.mark.parametrize("order", ["hooks before compile", "hooks after compile"])
def test_statistics_are_taken_under_torch_compile(registered, order):
    """torch.compile (the aot_eager backend: dynamo's capture of the hooks without a C++
    compiler) gives the statistics of the eager model."""
    torch._dynamo.reset()
    eager, model = Stack(), Stack()
    reference = statistics_of(eager)
    if order == "hooks before compile":
        stats, compiled = statistics_of(model), torch.compile(model, backend="aot_eager")
    else:
        compiled = torch.compile(model, backend="aot_eager")
        stats = statistics_of(compiled)
    for seed in range(3):
        step(eager, reference, tokens(seed))
        step(compiled, stats, tokens(seed))
    prefix = "" if order == "hooks before compile" else "_orig_mod."
    for name, history in reference._history.items():
        torch.testing.assert_close(stats._history[prefix + name], history, rtol=1e-5, atol=1e-5)
    for s in (reference, stats):
        s.remove_hooks()


def test_registration_is_checked():
    with pytest.raises(TypeError, match="nn.Module subclass"):
        gift.register_linear(torch.matmul)
    with pytest.raises(ValueError, match="layout must be one of"):
        gift.register_linear(KeywordLinear, layout="transposed")
    with pytest.raises(TypeError, match="argument index or keyword name"):
        gift.register_linear(KeywordLinear, input=1.5)
    assert KeywordLinear not in linear_layers.REGISTRY


def test_a_registration_naming_a_missing_input_says_so_in_the_forward():
    gift.register_linear(KeywordLinear, input="x", weight="kernel", layout="in_out")
    try:
        model = Stack()
        stats = statistics_of(model)
        with pytest.raises(ValueError, match="KeywordLinear was registered with input='x'"):
            model(tokens(0))
        stats.remove_hooks()
    finally:
        del linear_layers.REGISTRY[KeywordLinear]
