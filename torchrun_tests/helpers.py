"""Cross-rank checks over the outcomes' own gloo group (conftest.py), and a small model."""
import hashlib

import torch
import torch.distributed as dist
from torch import nn

from conftest import OUTCOMES


def digest(tensors):
    """SHA-256 of the exact bytes of a sequence of tensors (dtype and shape included)."""
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().contiguous().cpu()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def gathered(value):
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, value, group=OUTCOMES[0])
    return everyone


def assert_identical_on_all_ranks(tensors, what="tensors"):
    digests = gathered(digest(tensors))
    assert len(set(digests)) == 1, f"{what} differ across ranks: {digests}"


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
