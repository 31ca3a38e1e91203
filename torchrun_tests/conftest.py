"""pytest under torchrun (scripts/run_tests.sh: --nproc-per-node 2 and 4, gloo on the CPU).

Every rank runs every test. After each test the ranks exchange their outcomes over a gloo group
of their own (not the default group the code under test uses), so a test that fails on any rank
fails on all of them with that rank's message, and no rank runs ahead into the next test's
collectives. Horovod is made unimportable: the DDP and FSDP frontends must work on a torch-only
install."""
import datetime
import pathlib
import sys

sys.modules["horovod"] = sys.modules["horovod.torch"] = None   # before horovod_gift is imported
# mpi_tests/outcomes.py, shared with the mpirun suites: after this directory, whose helpers.py
# must win over theirs
sys.path.append(str(pathlib.Path(__file__).resolve().parent.parent / "mpi_tests"))
sys.path.append(str(pathlib.Path(__file__).resolve().parent.parent / "examples"))

import pytest  # noqa: E402
import torch.distributed as dist  # noqa: E402
from engines import shutdown  # noqa: E402
from outcomes import share_outcome  # noqa: E402

OUTCOMES = []       # the group the outcomes travel on, made once the default group is up
EXIT_STATUS = []    # pytest's, once the session has finished


def pytest_configure(config):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    OUTCOMES.append(dist.new_group(backend="gloo"))


def pytest_sessionfinish(session, exitstatus):
    EXIT_STATUS.append(int(exitstatus))


def pytest_unconfigure(config):
    """End the process with pytest's status and without Python's finalization (engines.shutdown
    says why: a gloo worker aborts the process otherwise, now and then, whatever the outcome)."""
    shutdown(EXIT_STATUS[-1] if EXIT_STATUS else 1)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    share_outcome(outcome.get_result(), allgather)


def allgather(value):
    """Every rank's picklable value, in rank order, over the outcomes' own group."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, value, group=OUTCOMES[0])
    return everyone
