"""A short hvd.DistributedOptimizer run: every rank ends with bit-identical parameters."""
import torch
import horovod.torch as hvd

from helpers import assert_identical_on_all_ranks


def small_model():
    torch.manual_seed(1234)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))


def train(model, compression, steps=10, prefix="opt"):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt = hvd.DistributedOptimizer(
        opt,
        named_parameters=[(f"{prefix}.{n}", p) for n, p in model.named_parameters()],
        compression=compression,
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    g = torch.Generator().manual_seed(hvd.rank())  # each rank sees different data
    losses = []
    for _ in range(steps):
        x = torch.randn(16, 32, generator=g)
        y = torch.randn(16, 8, generator=g)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_parameters_bit_identical_after_training():
    model = small_model()
    before = [p.detach().clone() for p in model.parameters()]
    train(model, hvd.Compression.none, prefix="plain")
    assert any(
        not torch.equal(a, b) for a, b in zip(before, model.parameters())
    ), "training changed nothing"
    assert_identical_on_all_ranks(list(model.parameters()), "parameters after 10 steps")


def test_gradients_are_the_average_over_ranks():
    model = torch.nn.Linear(4, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=1.0), named_parameters=[("avg.weight", model.weight)]
    )
    x = torch.full((1, 4), float(hvd.rank() + 1))
    model(x).sum().backward()
    opt.synchronize()
    expected = sum(range(1, hvd.size() + 1)) / hvd.size()
    with opt.skip_synchronize():
        opt.step()
    assert torch.allclose(model.weight.grad, torch.full((1, 4), expected))
    assert_identical_on_all_ranks([model.weight], "weights after one averaged step")
