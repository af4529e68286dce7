"""Router: least-outstanding + sticky + caps + eject/readmit, without an event loop."""

import pytest

from agentloop.routing import Availability, Router


def test_least_outstanding_spreads_load():
    r = Router(["a", "b", "c"], max_inflight=10)
    picks = [r.acquire(f"e{i}") for i in range(6)]
    assert sorted(picks) == [0, 0, 1, 1, 2, 2]
    assert [s.inflight for s in r.servers] == [2, 2, 2]


def test_sticky_episode_returns_to_its_server():
    r = Router(["a", "b"], max_inflight=10)
    first = r.acquire("ep")
    r.release(first)
    # load the other server less than this one: sticky must still win
    r.acquire("x")
    r.acquire("y")
    again = r.acquire("ep")
    assert again == first
    assert r.servers[first].sticky_hits == 1


def test_spill_when_sticky_server_full():
    r = Router(["a", "b"], max_inflight=1)
    s = r.acquire("ep")
    r.release(s)
    r.acquire("other")  # least-loaded picks the other server, then ep's server is free
    blocker = r.acquire("blocker")  # fills ep's server
    assert blocker == s
    spilled = r.acquire("ep")
    assert spilled is None  # both full now
    r.release(1 - s)
    spilled = r.acquire("ep")
    assert spilled == 1 - s and r.servers[spilled].spills == 1


def test_full_vs_down():
    r = Router(["a"], max_inflight=1, eject_after=1)
    assert r.acquire("a1") == 0
    assert r.acquire("a2") is None and r.availability() is Availability.FULL
    r.release(0)
    assert r.record_failure(0) is True
    assert r.availability() is Availability.DOWN
    assert r.acquire("a3") is None
    assert r.readmit(0) is True
    assert r.acquire("a3") == 0


def test_eject_after_consecutive_failures_only():
    r = Router(["a", "b"], max_inflight=5, eject_after=2)
    assert r.record_failure(0) is False
    r.record_success(0)
    assert r.record_failure(0) is False
    assert r.record_failure(0) is True
    assert not r.servers[0].healthy
    assert all(r.acquire(f"e{i}") == 1 for i in range(3))


def test_avoided_server_used_only_as_last_resort():
    r = Router(["a", "b"], max_inflight=5)
    assert r.acquire("e", avoid={0}) == 1
    r.eject(1)
    assert r.acquire("f", avoid={0}) == 0


def test_release_without_acquire_is_a_bug():
    r = Router(["a"], max_inflight=1)
    with pytest.raises(RuntimeError):
        r.release(0)


def test_sticky_map_is_bounded():
    r = Router(["a", "b"], max_inflight=10**6, sticky_capacity=100)
    for i in range(1000):
        r.release(r.acquire(f"e{i}"))
    assert len(r._sticky) == 100
