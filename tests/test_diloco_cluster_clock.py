"""benchmarks/diloco_cluster.py's full-clock threshold: the compute a step below which an arm
is 20x sooner than DDP fp32 (issue 55's target), from measured steps and sync seconds; and the
names its cached runs go by."""
import argparse
import math
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))
from diloco_cluster import compute_for_speedup, shape_tag  # noqa: E402
from scaling import learning_rate  # noqa: E402


def clock(steps, compute, sync):
    return steps * (compute + sync)


@pytest.mark.parametrize("base_steps, base_sync, steps, sync",
                         [(210, 1.67, 600, 0.0024), (200, 2.35, 600, 0.0012),
                          (300, 24.0, 600, 0.05)])
def test_at_the_threshold_the_arm_is_exactly_20x_and_under_it_more(base_steps, base_sync, steps,
                                                                   sync):
    c = compute_for_speedup(20, base_steps, base_sync, steps, sync)
    assert 0 < c < math.inf
    ratio = clock(base_steps, c, base_sync) / clock(steps, c, sync)
    assert ratio == pytest.approx(20, rel=1e-12)
    assert clock(base_steps, c / 2, base_sync) / clock(steps, c / 2, sync) > 20
    assert clock(base_steps, 2 * c, base_sync) / clock(steps, 2 * c, sync) < 20


def test_an_arm_not_20x_sooner_even_link_bound_has_no_threshold():
    # 600 steps x 0.1 s of sync = 60 s against DDP's 200 x 1 s: 3.3x with no compute at all
    assert compute_for_speedup(20, 200, 1.0, 600, 0.1) is None


def test_an_arm_needing_20x_fewer_steps_and_less_sync_is_20x_sooner_at_any_compute():
    assert compute_for_speedup(20, 4000, 1.0, 100, 0.01) == math.inf


def shape(**changes):
    dims = dict(dim=512, layers=2, lr=learning_rate(512), replicas=2, group_size=1, batch_size=16)
    return argparse.Namespace(**dict(dims, **changes))


def test_a_run_is_named_by_what_differs_from_the_first_studys_shape():
    # the first study's runs keep their names (its caches stay reusable); anything else that
    # changes the training names itself, so no run is reused for another shape's
    assert shape_tag(shape()) == "d512"
    tags = [shape_tag(shape(**c)) for c in (dict(batch_size=4), dict(group_size=2),
                                             dict(replicas=4), dict(layers=4), dict(lr=1e-3))]
    assert tags == ["d512-b4", "d512-g2", "d512-r4", "d512-l4", "d512-lr0.001"]
