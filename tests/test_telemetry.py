"""The periodic log line: averages since the last line, also across a loaded step count."""
import logging

from horovod_gift.telemetry import Telemetry


def test_log_lines_average_since_the_last_and_survive_a_rollback(caplog):
    t = Telemetry(log_every=2)
    with caplog.at_level(logging.INFO, logger="horovod_gift"):
        for step in (1, 2, 3, 4):
            t.add(elements=100, payload_bytes=50, bytes_sent=2_000_000)
            t.end_step(step, lambda: {"whiten": 3}, is_rank0=True)
        t.restart(2)                       # a checkpoint of step 2 loaded
        for step in (3, 4):
            t.add(elements=100, payload_bytes=50, bytes_sent=2_000_000)
            t.end_step(step, lambda: {"whiten": 3}, is_rank0=True)
        t.end_step(4, lambda: {}, is_rank0=True)        # no step since the last line: no line
        t.end_step(6, lambda: {}, is_rank0=False)       # only rank 0 logs
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3, lines
    assert all("4.00 bits/element" in line and "2 MB sent/step" in line for line in lines), lines
