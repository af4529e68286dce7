"""The asynchronous schedule's rules, without an event loop: staleness, admission, the group buffer."""

from __future__ import annotations

import pytest

from agentloop.train.schedule import Admission, GroupBuffer, Staleness


def test_staleness_window():
    s = Staleness(0)
    assert s.min_version(1) == 0 and s.trainable(0, 1) and not s.trainable(0, 2) and s.trainable(None, 9)
    s2 = Staleness(2)
    assert s2.min_version(5) == 2 and s2.trainable(2, 5) and not s2.trainable(1, 5)
    assert s2.lag(2, 5) == 2 and s2.lag(4, 5) == 0
    with pytest.raises(ValueError):
        Staleness(-1)


def simulate(eta: int, B: int, steps: int, first: int = 1) -> list[tuple[int, list[int]]]:
    """Run the rules the way the orchestrator does, with groups that finish in admission order and a
    learner that trains as soon as B eligible groups are buffered; `first` > 1: a run resumed after
    step first-1 (nothing in flight, positions from (first-1)·B on). Returns (version at admission,
    uids admitted) for each admission burst, and checks the staleness bound of every batch and that
    no more than (η + 1)·B groups are ever admitted and not yet trained."""
    adm = Admission(B, eta, total=(steps - first + 1) * B, base_version=first - 1)
    buf: GroupBuffer[int] = GroupBuffer(Staleness(eta))
    version, uid, running, bursts = first - 1, (first - 1) * B, [], []
    for step in range(first, steps + 1):
        while True:
            k = adm.allowed(version)
            if k:
                burst = list(range(uid, uid + k))
                uid += k
                bursts.append((version, burst))
                running += [(u, version) for u in burst]
                adm.started(k)
            assert uid - (step - 1) * B <= (eta + 1) * B, (step, uid)  # admitted, not yet trained
            if (batch := buf.take(step, B)) is not None:
                break
            u, v = running.pop(0)  # the oldest running group finishes
            adm.finished(kept=True)
            buf.add(u, v, v)
        assert all(v >= step - 1 - eta for v in batch), (step, batch)
        version = step
    return bursts


def test_eta_zero_is_the_synchronous_schedule():
    bursts = simulate(eta=0, B=3, steps=4)
    assert bursts == [(0, [0, 1, 2]), (1, [3, 4, 5]), (2, [6, 7, 8]), (3, [9, 10, 11])]


def test_eta_one_keeps_one_more_batch_in_flight():
    bursts = simulate(eta=1, B=2, steps=4)
    assert bursts[0] == (0, [0, 1, 2, 3])  # (η + v + 1)·B = 4 at version 0
    assert [v for v, _ in bursts] == [0, 1, 2]  # then B more per new version, until the total is reached
    assert sum(len(b) for _, b in bursts) == 8


@pytest.mark.parametrize("eta", [0, 1, 2])
def test_a_resumed_run_keeps_exactly_a_fresh_runs_bound(eta):
    """Resumed after step 5 (the checkpoint), admission allows what a fresh run allows at its start, and
    the rest of the run is a fresh run's schedule, shifted by five versions and 5·B positions (η = 0:
    B prompts per version, the synchronous schedule)."""
    B, k = 3, 6
    resumed = Admission(B, eta, total=4 * B, base_version=k - 1)
    assert resumed.allowed(k - 1) == Admission(B, eta).allowed(0) == (eta + 1) * B
    with pytest.raises(ValueError, match="older than"):
        resumed.allowed(k - 2)
    shifted = [(v + k - 1, [u + (k - 1) * B for u in burst]) for v, burst in simulate(eta, B, steps=4)]
    assert simulate(eta, B, steps=k + 3, first=k) == shifted
    if eta == 0:
        assert shifted == [(5, [15, 16, 17]), (6, [18, 19, 20]), (7, [21, 22, 23]), (8, [24, 25, 26])]


def test_cancelled_groups_give_their_room_back_and_total_caps():
    adm = Admission(batch_size=2, max_staleness=0, total=3)
    assert adm.allowed(0) == 2
    adm.started(2)
    adm.finished(kept=False)  # cancelled: room again
    assert adm.allowed(0) == 1
    adm.finished(kept=True)
    assert adm.allowed(5) == 2  # the version would allow 12, the run needs only 3
    adm.dropped()  # a buffered group evicted as stale
    assert adm.allowed(5) == 3
    with pytest.raises(RuntimeError):
        Admission(1, 0).finished(kept=True)


def test_buffer_takes_oldest_eligible_first_and_returns_uid_order():
    buf: GroupBuffer[str] = GroupBuffer(Staleness(1))
    for uid, v in [(7, 2), (3, 1), (5, 0), (9, 2)]:
        buf.add(uid, v, f"g{uid}")
    # step 3 trains from version 2, η = 1: versions >= 1 are eligible; 5 (version 0) is not
    assert buf.eligible(3) == 3
    assert buf.take(3, 2) == ["g3", "g7"]  # oldest first (3: v1, then 7: v2 by arrival), in uid order
    assert buf.take(3, 2) is None
    assert buf.evict_stale(3) == ["g5"] and len(buf) == 1
    with pytest.raises(ValueError):
        buf.add(9, 2, "dup")
