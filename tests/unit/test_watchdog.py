"""kvstore.watchdog: the bound of one exchange, and what it says when the bound passes.
(The end-to-end case, a server stopped with SIGSTOP, is in test_dist.py.)"""
import time

import pytest

from mxhylo.kvstore import watchdog


def test_bound_is_derived_from_the_slowest_exchange():
    w = watchdog.StallWatchdog(None)
    assert w.enabled and w.bound() == watchdog.FIRST_EXCHANGES_BOUND
    for seconds in (0.01, 0.02, 0.01):
        w.begin(1)
        w._owed.started -= seconds          # as if the exchange had taken that long
        w.end()
    assert w.bound() == watchdog.AUTO_MIN   # 20 x 0.02 s is below the floor
    w.begin(4)
    w._owed.started -= 10.0
    w.end()
    assert w.bound() == pytest.approx(watchdog.AUTO_FACTOR * 10.0, rel=1e-3)
    assert watchdog.StallWatchdog(7).bound() == 7.0
    assert not watchdog.StallWatchdog(0).enabled and not watchdog.StallWatchdog(False).enabled


@pytest.mark.parametrize("bad", [-1, "60", True, [1]])
def test_bad_bound_is_refused_by_name(bad):
    with pytest.raises(ValueError, match="stall_timeout must be"):
        watchdog.StallWatchdog(bad)


def test_a_stalled_exchange_is_reported_with_its_step_keys_and_servers():
    said = []
    w = watchdog.StallWatchdog(0.5, rank=3, on_stall=said.append)
    w.begin(1)
    w.end()                                  # a completed exchange says nothing
    w.begin(2)
    w.owe(12, "conv1_weight", 1)
    w.owe(13, "conv1_weight", 0)
    w.owe(20, "fc_weight", 1)
    w.settled(13)
    w.owe(6, "bias", 0)
    w.settled_layer("bias")
    w.waiting_on_layer("conv1_weight")
    deadline = time.time() + 10
    while not said and time.time() < deadline:
        time.sleep(0.1)
    assert len(said) == 1, said
    message = said[0]
    assert message.startswith("mxhylo: worker 3: exchange 2 (training step 2 under a "
                              "Trainer) has not completed after")
    assert "waiting for layer 'conv1_weight' (key 12, server 1)" in message
    assert "Still owed: conv1_weight (key 12, server 1), fc_weight (key 20, server 1)." \
        in message
    assert "Parameter server(s) 1 (ps-lite's server ranks)" in message
    time.sleep(1.2)
    assert len(said) == 1                    # reported once


def test_no_report_while_exchanges_finish_in_time():
    said = []
    w = watchdog.StallWatchdog(0.6, on_stall=said.append)
    for step in range(6):
        w.begin(step)
        time.sleep(0.2)
        w.end()
    time.sleep(1.0)
    assert said == []


def _stall_message(w):
    said = []
    w.on_stall = said.append
    deadline = time.time() + 10
    while not said and time.time() < deadline:
        time.sleep(0.1)
    assert len(said) == 1, said
    return said[0]


def test_a_stall_in_the_workers_own_backward_does_not_blame_the_servers():
    # an exchange waits for the worker's own next gradient: backward (or the encode) is
    # what stalls, while an earlier layer's keys are still owed
    w = watchdog.StallWatchdog(0.5, rank=1)
    w.begin(5)
    w.owe(12, "conv1_weight", 1)
    w.waiting_on_self()
    message = _stall_message(w)
    assert "waiting for this worker's own next gradient" in message
    assert "not for a server" in message
    assert "Still owed by the servers: conv1_weight (key 12, server 1)." in message
    assert "Parameter server(s)" not in message


def test_once_the_server_is_waited_on_again_the_servers_are_named():
    w = watchdog.StallWatchdog(0.5, rank=1)
    w.begin(5)
    w.waiting_on_self()
    w.owe(12, "conv1_weight", 1)
    w.waiting("the aggregates of every layer pushed")
    message = _stall_message(w)
    assert "own next gradient" not in message
    assert "waiting for the aggregates of every layer pushed" in message
    assert "Parameter server(s) 1 (ps-lite's server ranks)" in message
