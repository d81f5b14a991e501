"""A NIXL transfer's bookkeeping (``kv/remote.py`` ``Transfer``), its agent replaced by a stand-in
that answers as NIXL does (pure logic; the real agents are in tests/engine/test_remote_kv.py): an
error NIXL raises is a failed read, a transfer NIXL refuses to abort stays unsettled (its
destination may still be written), one past its deadline is cancelled and counted, and one given
an emulated latency is not seen complete before that passes."""
import time

import pytest

from oasiskv.kv.remote import ReadStats, RemoteReadError, Transfer


class Agent:
    def __init__(self, states, cancellable=True):
        self.states, self.cancellable, self.released = list(states), cancellable, 0

    def check_xfer_state(self, handle):
        state = self.states.pop(0)
        if isinstance(state, Exception):
            raise state
        return state

    def release_xfer_handle(self, handle):
        if not self.cancellable:
            raise RuntimeError("transfer in progress, cannot abort")
        self.released += 1


def transfer(agent, deadline=60.0, latency=0.0):
    stats = ReadStats()
    return Transfer(agent, object(), "peer", time.monotonic() + deadline, stats, latency), stats


def test_done_then_settled_and_timed():
    t, stats = transfer(Agent(["PROC", "DONE"]))
    assert not t.done() and not t.settled
    assert t.done() and t.settled and t.done()
    assert stats.failed == 0 and len(stats.latencies) == 1


def test_an_error_nixl_raises_is_a_failed_read():
    agent = Agent([RuntimeError("nixlNotFoundError: remote agent removed")])
    t, stats = transfer(agent)
    with pytest.raises(RemoteReadError, match="nixlNotFoundError"):
        t.done()
    assert t.settled and agent.released == 1 and stats.failed == 1
    with pytest.raises(RemoteReadError):  # and stays failed
        t.done()
    assert stats.failed == 1


def test_past_the_deadline_cancelled_but_unsettled_while_nixl_refuses():
    agent = Agent(["PROC"] * 3, cancellable=False)
    t, stats = transfer(agent, deadline=-1.0)
    with pytest.raises(TimeoutError):
        t.check_deadline()
    assert stats.failed == 1 and not t.settled  # may still write: keep its blocks
    assert not t.cancel()
    agent.cancellable = True
    assert t.cancel() and t.settled
    t.check_deadline()  # settled: nothing to time out any more
    assert stats.failed == 1


def test_an_emulated_latency_holds_a_completed_transfer_until_it_passes():
    t, stats = transfer(Agent(["DONE"] * 2), latency=30.0)
    assert not t.done() and not t.done() and not t.settled  # (NIXL says DONE)
    assert not stats.latencies
    t, stats = transfer(Agent(["DONE"]), latency=0.01)
    time.sleep(0.01)
    assert t.done() and t.settled and stats.latencies[0] >= 0.01
