"""Episode identity: each dispatched prompt has a uid (its data-cursor position) from which its seed,
episode ids and GRPO group derive, so epochs and steps that cross an epoch boundary never collide."""

from __future__ import annotations

import pytest

from agentloop.config import Config
from agentloop.errors import ConfigError
from agentloop.records import Sample
from agentloop.rollout.engine import RolloutEngine
from agentloop.train.orchestrator.cursor import DataCursor, DataMismatchError, fingerprint


def rows(n: int) -> list[Sample]:
    return [Sample(index=i, data_source="d", messages=[{"role": "user", "content": f"q{i}"}]) for i in range(n)]


class _SM:
    expected_version = None


def engine() -> RolloutEngine:
    return RolloutEngine(Config(), _SM(), None, object, scorer=object())  # type: ignore[arg-type]


def test_ten_rows_four_per_step_thirty_steps_never_collide():
    cur, eng, n = DataCursor(rows(10), seed=1), engine(), 4
    episode_ids, seeds_by_row = set(), {}
    groups = []
    for _ in range(30):
        batch = cur.take(4)
        groups.append([s.group_uid for s in batch])
        for s in batch:
            for r in range(n):
                ep = s.with_repeat(r)
                assert ep.episode_id not in episode_ids
                episode_ids.add(ep.episode_id)
                seeds_by_row.setdefault(s.index, []).append(eng.sampling_params(ep).seed)
    assert len(episode_ids) == 30 * 4 * n
    # a step crossing the epoch boundary (positions 8..11) holds rows of two epochs as distinct groups
    assert all(len(set(g)) == 4 for g in groups) and groups[2] == [8, 9, 10, 11]
    for seeds in seeds_by_row.values():  # 12 epochs x 4 repeats: every seed differs
        assert len(seeds) == 48 and len(set(seeds)) == 48


def test_same_position_same_prompt_and_seed_across_runs():
    a, b = DataCursor(rows(10), seed=3), DataCursor(rows(10), seed=3)
    assert [s.model_dump() for s in a.take(25)] == [s.model_dump() for s in b.take(25)]
    assert DataCursor(rows(10), seed=4).take(10) != DataCursor(rows(10), seed=3).take(10)


def test_retry_comes_first_with_a_new_attempt_and_fresh_seeds():
    cur, eng = DataCursor(rows(5), seed=0), engine()
    first = cur.take(2)
    cur.retry(first[1])
    again = cur.take(2)
    assert again[0].uid == first[1].uid and again[0].attempt == 1 and again[0].index == first[1].index
    assert again[1].uid == 2  # then new positions
    assert again[0].episode_id != first[1].episode_id
    assert eng.sampling_params(again[0]).seed != eng.sampling_params(first[1]).seed


def test_state_round_trip_gives_untrained_positions_out_again():
    cur = DataCursor(rows(6), seed=0)
    cur.take(5)
    state = cur.state(untrained=[1, 3])
    assert state == {"next": 5, "requeue": [1, 3], "rows": 6, "fingerprint": fingerprint(rows(6))}
    back = DataCursor.from_state(rows(6), 0, state)
    assert [s.uid for s in back.take(3)] == [1, 3, 5]
    assert DataCursor.from_state(rows(6), 0, 4).position == 4  # older runs stored an int
    with pytest.raises(ConfigError, match="unreadable data position"):
        DataCursor.from_state(rows(6), 0, {"nope": 1})


def test_a_state_stored_for_other_rows_is_refused_naming_the_file_unless_forced():
    """The data position indexes the rows it was handed out from: other rows (another file, order, limit or
    held-out slice) under the same position would train other prompts and skip or repeat some."""
    state = DataCursor(rows(6), seed=0).state()
    assert DataCursor.from_state(rows(6), 0, state).position == 0  # the same rows: fine
    other = rows(6)
    other[2] = other[2].model_copy(update={"ground_truth": "7"})
    for changed in (rows(5), rows(6)[::-1], other):
        assert fingerprint(changed) != state["fingerprint"]
        with pytest.raises(DataMismatchError, match=r"the training data changed since this run's checkpoint: "
                                                     r"/data/own\.jsonl gives \d rows .*stored for 6 rows.*--force"):
            DataCursor.from_state(changed, 0, state, source="/data/own.jsonl")
    forced = DataCursor.from_state(rows(5), 0, {**state, "next": 7}, force=True)
    assert forced.position == 7 and not forced.matches(state) and forced.take(1)[0].uid == 7
    # states of older runs hold no fingerprint: they resume as before
    old = {"next": 3, "requeue": [1]}
    assert DataCursor.from_state(rows(5), 0, old).matches(old) and DataCursor.from_state(rows(5), 0, 3).position == 3
