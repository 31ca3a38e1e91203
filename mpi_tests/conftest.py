"""Every rank runs every test. After each test the ranks exchange their outcomes through mpi4py
(independent of the Horovod code under test), so a test that fails on any rank fails on all of
them with that rank's message, and no rank runs ahead into the next test's collectives.

GIFT_TEST_NODE_SIZE=L makes every GIFT the tests build see nodes of L consecutive ranks (its
node_size), so that topology="auto" takes the two-hop reduction: scripts/run_tests.sh runs the
tests of Horovod's options and of training under it."""
import os

import pytest
from mpi4py import MPI

import horovod.torch as hvd
import horovod_gift
from outcomes import share_outcome

COMM = MPI.COMM_WORLD

if os.environ.get("GIFT_TEST_NODE_SIZE"):
    class NodesOfTheTestSize(horovod_gift.GIFT):
        def __init__(self, *args, node_size=int(os.environ["GIFT_TEST_NODE_SIZE"]), **kw):
            super().__init__(*args, node_size=node_size, **kw)

        def _bind(self, optimizer):     # a silent fall back to flat would test nothing here
            super()._bind(optimizer)
            if self.process_set.process_set_id == 0 and self.config.topology == "auto":
                topology = self.reducer.topology
                assert topology.description[0] == "two-hop", topology.describe()

    horovod_gift.GIFT = NodesOfTheTestSize


def pytest_configure(config):
    hvd.init(process_sets="dynamic")   # lets tests add process sets


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    share_outcome(outcome.get_result(), COMM.allgather)


@pytest.fixture
def comm():
    """The MPI world communicator, for cross-rank assertions."""
    return COMM
