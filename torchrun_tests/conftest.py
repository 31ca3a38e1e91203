"""pytest under torchrun (scripts/run_tests.sh: --nproc-per-node 2 and 4, gloo on the CPU).

Every rank runs every test. After each test the ranks exchange their outcomes over a gloo group
of their own (not the default group the code under test uses), so a test that fails on any rank
fails on all of them with that rank's message, and no rank runs ahead into the next test's
collectives. Horovod is made unimportable: the DDP and FSDP frontends must work on a torch-only
install."""
import datetime
import sys

sys.modules["horovod"] = sys.modules["horovod.torch"] = None   # before horovod_gift is imported

import pytest
import torch.distributed as dist

OUTCOMES = []       # the group the outcomes travel on, made once the default group is up


def pytest_configure(config):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    OUTCOMES.append(dist.new_group(backend="gloo"))


def pytest_unconfigure(config):
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when != "call":
        return
    mine = (report.failed, str(report.longrepr) if report.failed else "")
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine, group=OUTCOMES[0])
    failures = [(rank, text) for rank, (failed, text) in enumerate(everyone) if failed]
    if failures and not report.failed:
        report.outcome = "failed"
    if failures:
        report.longrepr = "\n".join(
            f"--- rank {rank} of {len(everyone)} failed:\n{text}" for rank, text in failures)
