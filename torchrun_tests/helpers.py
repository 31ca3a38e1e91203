"""Cross-rank checks over the outcomes' own gloo group (conftest.py), a small model, its data
and a training loop."""
import torch
from torch import nn

from conftest import allgather as gathered
from outcomes import assert_identical


def assert_identical_on_all_ranks(tensors, what="tensors"):
    assert_identical(tensors, what, gathered)


class Net(nn.Module):
    """Two linear layers (whitened), an embedding, a LayerNorm and biases under min_elements."""

    def __init__(self, vocab=64, dim=32, hidden=96):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        x = x + self.down(torch.nn.functional.gelu(self.up(x)))
        return self.head(self.norm(x))


def batch(step, rank, size=8, length=6, vocab=64):
    """The batch of one rank at one step: different on every rank, the same on every run; the
    target is a fixed function of the token, so the loss falls."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, vocab, (size, length), generator=g)
    return tokens, (5 * tokens + 3) % vocab


def loss_of(model, step, rank):
    inputs, targets = batch(step, rank)
    logits = model(inputs)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def train(model, opt, steps, first=0, each_step=None):
    """steps optimizer steps from step `first`; each_step(step) runs after each backward.
    Returns the losses."""
    rank, losses = torch.distributed.get_rank(), []
    for step in range(first, first + steps):
        opt.zero_grad()
        loss = loss_of(model, step, rank)
        loss.backward()
        if each_step is not None:
            each_step(step)
        opt.step()
        losses.append(loss.item())
    return losses
