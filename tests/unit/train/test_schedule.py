"""The asynchronous schedule's rules, without an event loop: staleness, admission, the group buffer, and the
AsyncSchedule object the orchestrator drives (fakes for prompts and groups)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from agentloop.train.orchestrator.schedule import Admission, AsyncSchedule, Cancel, GroupBuffer, Retry, Staleness


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


# ---------------------------------------------------------------------------- AsyncSchedule, driven by fakes


@dataclass
class P:
    """A prompt as the cursor hands it out."""

    uid: int
    attempt: int = 0

    @property
    def group_uid(self) -> int:
        return self.uid


@dataclass
class G:
    """A group as it leaves the stream."""

    sample: P
    oldest: int | None
    cancelled: str | None = None
    n: int = 2

    @property
    def oldest_version(self) -> int | None:
        return self.oldest


def admit_all(s: AsyncSchedule, nxt: list[int]) -> list[P]:
    out = []
    for _ in range(s.admit()):
        p = P(nxt[0])
        nxt[0] += 1
        s.started(p)
        out.append(p)
    return out


def test_eta_zero_admits_and_batches_exactly_the_synchronous_steps():
    s: AsyncSchedule[G] = AsyncSchedule(2, 0, total=6)
    nxt = [0]
    for step in (1, 2, 3):
        assert s.step_begins(step, {}) == []
        prompts = admit_all(s, nxt)
        assert [p.uid for p in prompts] == [2 * step - 2, 2 * step - 1]
        assert s.admit() == 0 and s.take(step) is None  # nothing more until the batch trains
        for p in reversed(prompts):  # finishing order does not matter
            assert s.group_done(G(p, step - 1), complete=True) == []
        batch = s.take(step)
        assert [g.sample.uid for g in batch] == [p.uid for p in prompts]
        s.version_pushed(step)
    assert s.admit() == 0 and s.untrained() == [] and s.counts["groups_cancelled"] == 0


def test_cancelled_and_stale_groups_are_given_out_again_and_leave_their_room():
    s: AsyncSchedule[G] = AsyncSchedule(2, 1, total=8)
    nxt = [0]
    ps = admit_all(s, nxt)
    assert len(ps) == 4  # (η + 1)·B at version 0
    cmds = s.group_done(G(ps[0], None, cancelled="stale: started at 0"), complete=False)
    assert cmds == [Retry(ps[0])] and s.admit() == 1  # its room is given again
    assert s.group_done(G(ps[1], None, cancelled="the run ended"), complete=False) == [Retry(ps[1])]
    assert (s.counts["cancelled_stale"], s.counts["cancelled_other"], s.counts["episodes_cancelled"]) == (1, 1, 4)
    # step 3 with η = 1 needs versions >= 1: a group of version 0 that finishes then is not kept
    s.step_begins(3, {})
    assert s.group_done(G(ps[2], 0), complete=True) == [Retry(ps[2])] and len(s) == 0


def test_a_new_step_evicts_buffered_groups_and_cancels_running_ones_that_became_too_stale():
    s: AsyncSchedule[G] = AsyncSchedule(1, 0, total=5)
    nxt = [0]
    (a,) = admit_all(s, nxt)
    s.group_done(G(a, 0), complete=True)
    s.take(1)
    s.version_pushed(1)
    (b,) = admit_all(s, nxt)
    s.group_done(G(b, 0), complete=True)  # finished after step 1 trained: step 2 (η = 0) needs version 1
    assert len(s) == 0 and s.counts["groups_cancelled"] == 1
    (c,) = admit_all(s, nxt)
    s.group_done(G(c, 1), complete=True)
    assert len(s) == 1
    s.take(2)
    s.version_pushed(2)
    (d,) = admit_all(s, nxt)
    s.group_done(G(d, 2), complete=True)
    cmds = s.step_begins(3, {7: 1, 8: 2, 9: None})  # running groups: uid -> started version
    assert cmds == [Cancel(7, "stale: started at version 1, step 3 needs >= 2")]
    s.version_pushed(2)
    assert s.step_begins(4, {}) == [Retry(d)] and len(s) == 0  # version 2 can no longer join step 4


def test_infrastructure_failures_are_retried_a_bounded_number_of_times():
    s: AsyncSchedule[G] = AsyncSchedule(1, 0, total=3, infra_retries=2)
    (p,) = admit_all(s, [5])
    assert s.group_done(G(p, 0), complete=False) == [Retry(p)]
    again = P(5, attempt=1)
    s.started(again)
    assert s.group_done(G(again, 0), complete=False) == [Retry(again)]
    last = P(5, attempt=2)
    s.started(last)
    assert s.group_done(G(last, 0), complete=False) == []  # given up: no longer owed to a checkpoint
    assert s.counts["groups_dropped_infra"] == 3 and s.untrained() == []


def test_a_run_that_ends_gives_nothing_out_again_and_keeps_what_it_owes():
    s: AsyncSchedule[G] = AsyncSchedule(2, 1, total=8, first_step=4)
    ps = admit_all(s, [30])
    assert len(ps) == 4  # a resumed run keeps a fresh run's bound
    s.end()
    assert s.admit() == 0
    assert s.group_done(G(ps[0], None, cancelled="the run ended"), complete=False) == []
    assert s.untrained() == [30, 31, 32, 33]  # the data state gives them out again on resume
    assert s.since({"groups_cancelled": 0}, ["groups_cancelled", "groups_dropped_infra"]) == \
        {"groups_cancelled": 1, "groups_dropped_infra": 0}
