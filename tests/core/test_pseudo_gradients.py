"""DiLoCo's pseudo-gradients through GIFT's reduction (core/pseudo_gradients.py), on threaded
ranks of one process: identical bits, the participants' average, two hops that send 1/L across
replicas, and residuals that change only when a step commits."""

import torch

from horovod_gift.config import GiftConfig
from horovod_gift.core.pseudo_gradients import PseudoGradientState
from horovod_gift.integrations.torchft import RankNumbering
from horovod_gift.reduce.communicator import LocalGroup, StopAtFirstError
from horovod_gift.reduce.topology import Flat, TwoHop

import ranks

SHAPES = {"a.weight": (64, 96), "b.weight": (40, 64), "b.bias": (40,)}


def deltas(seed):
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=gen) * (1 + k) for k, (n, s) in enumerate(SHAPES.items())}


def state(**options):
    return PseudoGradientState(deltas(0), GiftConfig.for_diloco(**options))


def in_threads(n, work):
    """ranks.in_threads, raising the first rank's error."""
    out = ranks.in_threads(n, work)
    for value in out:
        if isinstance(value, Exception):
            raise value
    return out


def flat_sync(states, grads, participants=None, participating=None, step=0):
    comms = LocalGroup(len(states), threads=True).communicators()

    def work(k):
        sync = states[k].prepare(grads[k], Flat(comms[k]), comms[k],
                                 participants or len(states), step,
                                 use_residuals=participating is None or participating[k]).start()
        return sync.finish(), sync
    return in_threads(len(states), work)


def test_every_replica_gets_the_same_bits_close_to_the_average():
    grads = [deltas(1 + k) for k in range(3)]
    exact = {n: sum(g[n] for g in grads) / 3 for n in SHAPES}
    states = [state() for _ in range(3)]
    results = flat_sync(states, grads)
    assert all(bad == [] for bad, _ in results)
    for n in SHAPES:
        assert all(torch.equal(grads[0][n], g[n]) for g in grads[1:]), n
        error = (grads[0][n] - exact[n]).norm() / exact[n].norm()
        assert error < (1e-6 if n == "b.bias" else 0.35), (n, error)
    assert states[0].residual_bytes() > 0


def test_error_feedback_carries_the_error_into_the_next_sync():
    """Over syncs of the same deltas, the mean of the averages approaches the exact average."""
    states = [state() for _ in range(2)]
    total = {n: torch.zeros(s) for n, s in SHAPES.items()}
    for step in range(8):
        grads = [deltas(1 + k) for k in range(2)]
        flat_sync(states, grads, step=step)
        for s in states:
            s.commit()
        for n in SHAPES:
            total[n] += grads[0][n]
    exact = {n: (deltas(1)[n] + deltas(2)[n]) / 2 for n in SHAPES}
    error = (total["a.weight"] / 8 - exact["a.weight"]).norm() / exact["a.weight"].norm()
    once = [deltas(1 + k) for k in range(2)]
    flat_sync([state() for _ in range(2)], once)
    single = (once[0]["a.weight"] - exact["a.weight"]).norm() / exact["a.weight"].norm()
    assert error < single / 4, (error, single)


def test_a_discarded_step_leaves_the_residuals_as_they_were():
    states = [state() for _ in range(2)]
    flat_sync(states, [deltas(1), deltas(2)])
    for s in states:
        s.commit()
    before = [{n: r.clone() for n, r in s.feedback.stage1.items()} for s in states]
    before2 = [{k: r.clone() for k, r in s.feedback.stage2.items()} for s in states]
    flat_sync(states, [deltas(3), deltas(4)], step=1)
    assert not torch.equal(states[0].feedback.stage1["a.weight"], before[0]["a.weight"])
    for s, r1, r2 in zip(states, before, before2):
        s.rollback()
        assert all(torch.equal(s.feedback.stage1[n], r1[n]) for n in r1)
        assert all(torch.equal(s.feedback.stage2[k], r2[k]) for k in r2)


def test_a_replica_that_does_not_participate_sends_zeros_and_keeps_its_residuals():
    grads = [deltas(1), deltas(2), {n: torch.zeros(s) for n, s in SHAPES.items()}]
    exact = (grads[0]["a.weight"] + grads[1]["a.weight"]) / 2
    flat_sync([state() for _ in range(3)], grads, participants=2,
              participating=[True, True, False])
    error = (grads[2]["a.weight"] - exact).norm() / exact.norm()
    assert error < 0.35, error      # the average of the two that take part
    # with residuals from an earlier sync, the one that does not take part keeps its own
    states = [state() for _ in range(3)]
    flat_sync(states, [deltas(4), deltas(5), deltas(6)])
    for s in states:
        s.commit()
    kept = {n: r.clone() for n, r in states[2].feedback.stage1.items()}
    grads = [deltas(1), deltas(2), {n: torch.zeros(s) for n, s in SHAPES.items()}]
    flat_sync(states, grads, participants=2, participating=[True, True, False], step=1)
    assert kept and all(torch.equal(states[2].feedback.stage1[n], r) for n, r in kept.items())
    assert all(torch.equal(grads[0][n], grads[2][n]) for n in SHAPES)


def test_a_new_quorum_folds_r2_into_r1_and_loses_no_error():
    """r2 is the error of the average; in r1 (the error of one rank's share of the sum) it
    counts divisor times."""
    states = [state() for _ in range(2)]
    flat_sync(states, [deltas(1), deltas(2)])

    def total(s, r2_scale):
        return (sum(r.double().sum() for r in s.feedback.stage1.values())
                + r2_scale * sum(r.double().sum() for r in s.feedback.stage2.values()))
    carried = sum(total(s, 2) for s in states)
    assert sum(total(s, 0) for s in states) != carried
    for s in states:
        s.commit()
        s._fold(s.layout)
        assert s.feedback.stage2 == {}
    assert torch.isclose(sum(total(s, 0) for s in states), carried, rtol=1e-5)


def two_hop_sync(groups, ranks_a_group, grads, config):
    """Replica groups of ranks_a_group ranks holding the same pseudo-gradients."""
    nodes = [LocalGroup(ranks_a_group, threads=True).communicators() for _ in range(groups)]
    crosses = [LocalGroup(groups, threads=True).communicators() for _ in range(ranks_a_group)]
    states = [PseudoGradientState(deltas(0), config) for _ in range(groups * ranks_a_group)]

    def work(k):
        g, local = divmod(k, ranks_a_group)
        node, cross = nodes[g][local], crosses[local][g]
        topology = TwoHop(RankNumbering(k, groups * ranks_a_group), node, cross)
        sync = states[k].prepare(grads[k], topology, cross, groups, 0).start()
        sync.finish()
        return sync
    return in_threads(groups * ranks_a_group, work)


class FailsToSend(StopAtFirstError):
    """A communicator whose every alltoall raises when issued (a lost link)."""

    def alltoall_async(self, tensor, splits, name):
        raise RuntimeError("alltoall failed: injected by the test")


def test_a_failure_across_replicas_on_one_rank_fails_the_sync_on_every_rank_of_its_group():
    """Local rank 1 of replica group 0 cannot send across replicas (its peer in group 1 then
    times out): every rank of both groups raises from finish(), none waits for a peer that left
    the sync, and each says why (its own error, or its group peer's local rank)."""
    groups, per_group = 2, 2
    # the group's timeout exceeds the one across replicas, as GiftDiLoCo asks: a group's ranks
    # wait for a peer that waits out a collective across replicas
    nodes = [LocalGroup(per_group, threads=True, timeout=20.0).communicators()
             for _ in range(groups)]
    crosses = [LocalGroup(groups, threads=True, timeout=1.0).communicators()
               for _ in range(per_group)]
    config = GiftConfig.for_diloco()

    def work(k):
        g, local = divmod(k, per_group)
        node, cross = nodes[g][local], crosses[local][g]
        if k == 1:
            cross = FailsToSend(cross)
        topology = TwoHop(RankNumbering(k, groups * per_group), node, cross)
        state = PseudoGradientState(deltas(0), config)
        state.prepare(deltas(g + 1), topology, cross, groups, 0).start().finish()
    outcomes = ranks.in_threads(groups * per_group, work)
    assert all(isinstance(o, Exception) for o in outcomes), outcomes
    assert "injected by the test" in str(outcomes[1])
    for k in (0, 2):      # the node peers of the failed ranks
        assert "failed on local rank(s) [1]" in str(outcomes[k]), outcomes[k]


def test_two_hops_send_one_share_of_the_replica_group_across_replicas():
    config = GiftConfig.for_diloco()
    per_group = [deltas(1), deltas(2)]
    grads = [{n: t.clone() for n, t in per_group[k // 2].items()} for k in range(4)]
    syncs = two_hop_sync(2, 2, grads, config)
    exact = {n: (per_group[0][n] + per_group[1][n]) / 2 for n in SHAPES}
    for n in SHAPES:
        assert all(torch.equal(grads[0][n], g[n]) for g in grads[1:]), n
        error = (grads[0][n] - exact[n]).norm() / exact[n].norm()
        assert error < (1e-6 if n == "b.bias" else 0.35), (n, error)
    across = syncs[0].reductions[0].across.bytes_sent
    flat = [deltas(1), deltas(2)]
    _, flat_sync_ = flat_sync([state(), state()], flat)[0]
    assert across <= 0.55 * flat_sync_.reductions[0].bytes_sent, (across, flat_sync_.bytes_sent)


def test_state_dict_round_trip_resumes_the_same_residuals():
    states = [state() for _ in range(2)]
    flat_sync(states, [deltas(1), deltas(2)])
    for s in states:
        s.commit()
    saved = [s.state_dict() for s in states]
    resumed = [state() for _ in range(2)]
    for s, st in zip(resumed, saved):
        s.load_state_dict(st)
    a, b = [deltas(3), deltas(4)], [deltas(3), deltas(4)]
    flat_sync(states, a, step=1)
    flat_sync(resumed, b, step=1)
    assert all(torch.equal(a[0][n], b[0][n]) for n in SHAPES)
