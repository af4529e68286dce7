"""The journal's format, writer, reader, header check, compaction and resume plan, without an event loop or a server.

Frames are checksummed and length-prefixed: a torn tail or a flipped bit drops that record only (counted), the
rest is read. The writer is a thread fed by a bounded queue: what is written is in order and survives a closed
process (read back by a fresh reader); a full queue drops records (counted) instead of blocking. The fold is
order-free: duplicates (a compaction killed before deleting its inputs) count once, a RESTART voids older
generations, a gap ends what an episode can replay. A journal of another model, data or config is refused by name.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from agentloop.config import load_config
from agentloop.journal import Journal, JournalMismatchError, codec, journal_header
from agentloop.journal.config import JournalConfig
from agentloop.journal.frames import frame, scan
from agentloop.journal.journal import compact_segments
from agentloop.journal.reader import read_journal
from agentloop.journal.writer import SegmentWriter
from agentloop.records import EpisodeRecord, TokenOutput


def _out(ids: list[int], version: int = 3) -> TokenOutput:
    return TokenOutput(token_ids=ids, logprobs=[-0.5 - i / 7 for i in range(len(ids))], finish_reason="stop",
                       weight_version=str(version), token_versions=[version] * len(ids), server="http://s")


def _gen(uid: int, repeat: int, n: int, ids: list[int], *, g: int = 0, attempt: int = 0, version: int = 3) -> bytes:
    meta, blobs = codec.gen_meta(g, n, 10 + n, 1000 + n, _out(ids, version))
    return codec.encode(codec.GEN, uid, attempt, repeat, meta, blobs)


def _rec(uid: int, repeat: int) -> EpisodeRecord:
    return EpisodeRecord(prompt_ids=[1, 2, 3], response_ids=[7, 8, 9], response_mask=[1, 0, 1],
                         response_logprobs=[-0.25, 0.0, -1e-9], token_versions=[4, None, 5], weight_versions=["5"],
                         reward=1.0, episode_id=f"{uid}-{repeat}", index=uid, uid=uid, repeat=repeat, data_source="t",
                         loop="tool_agent_loop", seed=12, extra={"messages": [{"role": "tool", "content": "<|im_end|>"}]})


# ---------------------------------------------------------------------------- frames


def test_frames_round_trip_and_a_torn_tail_is_dropped_and_counted():
    payloads = [_gen(5, r, 0, [r, r + 1]) for r in range(4)]
    data = b"".join(frame(p) for p in payloads)
    frames, damage = scan(data)
    assert [bytes(p) for _, p in frames] == payloads and damage == []
    torn = data[:-7]  # the kill cut the last write short
    frames, damage = scan(torn)
    assert [bytes(p) for _, p in frames] == payloads[:3]
    assert len(damage) == 1 and damage[0].tail and damage[0].offset == len(b"".join(frame(p) for p in payloads[:3]))


def test_a_flipped_bit_or_a_broken_length_costs_that_record_only():
    payloads = [_gen(5, r, 0, list(range(20))) for r in range(5)]
    framed = [frame(p) for p in payloads]
    data = bytearray(b"".join(framed))
    start2 = sum(len(f) for f in framed[:2])
    data[start2 + 30] ^= 0x10  # a bit in record 2's payload: its checksum fails
    frames, damage = scan(bytes(data))
    assert [bytes(p) for _, p in frames] == [payloads[i] for i in (0, 1, 3, 4)]
    assert len(damage) == 1 and not damage[0].tail and damage[0].offset == start2
    data = bytearray(b"".join(framed))
    start3 = sum(len(f) for f in framed[:3])
    data[start3:start3 + 4] = (2 ** 31).to_bytes(4, "little")  # record 3's length points far past the end
    frames, damage = scan(bytes(data))
    assert [bytes(p) for _, p in frames] == [payloads[i] for i in (0, 1, 2, 4)] and len(damage) == 1


def test_token_outputs_and_records_come_back_exactly():
    out = _out([1, 2, 2 ** 31 - 1], 7)
    out.token_versions = [6, 7, None]
    meta, blobs = codec.gen_meta(2, 9, 55, 123, out)
    kind, uid, attempt, repeat, m, b = codec.decode(codec.encode(codec.GEN, 41, 2, 3, meta, blobs))
    assert (kind, uid, attempt, repeat, m["g"], m["n"], m["pl"], m["ph"]) == (codec.GEN, 41, 2, 3, 2, 9, 55, 123)
    back = codec.token_output(m, b)
    assert back.token_ids == out.token_ids and back.logprobs == out.logprobs  # float64: bit-exact
    assert back.token_versions == [6, 7, None] and back.weight_version == "7" and back.server == "http://s"
    recs = [_rec(3, 1), _rec(3, 1).model_copy(update={"segment": 1, "token_versions": []})]
    meta, blobs = codec.done_meta(0, recs)
    _, _, _, _, m, b = codec.decode(codec.encode(codec.DONE, 3, 0, 1, meta, blobs))
    assert [r.model_dump() for r in codec.done_records(m, b)] == [r.model_dump() for r in recs]


# ---------------------------------------------------------------------------- writer


def _writer(tmp_path: Path, **kw) -> SegmentWriter:
    header = codec.encode(codec.HEADER, codec.RUN, 0, 0, {"format": 1, "model": "m", "data": "d", "config": {}})
    return SegmentWriter(tmp_path, "d", lambda: header, **kw)


def test_the_writer_keeps_order_and_what_it_wrote_survives_the_process(tmp_path):
    w = _writer(tmp_path, write_interval_ms=1, fsync_interval_ms=0)
    payloads = [_gen(9, 0, n, [n]) for n in range(50)]
    for p in payloads:
        assert w.put(lambda p=p: p, len(p))
    w.sync().result(10)
    assert w.stats["fsyncs"] >= 1 and w.stats["records"] == 50
    # what a reader in another process finds: the header, then every record in order
    frames, damage = scan((tmp_path / "d-000001.jal").read_bytes())
    assert damage == [] and codec.decode(frames[0][1])[0] == codec.HEADER
    assert [bytes(p) for _, p in frames[1:]] == payloads
    assert w.rotate().result(10) == tmp_path / "d-000001.jal"
    w.put(lambda: payloads[0], 10)
    w.close()
    assert sorted(p.name for p in tmp_path.glob("*.jal")) == ["d-000001.jal", "d-000002.jal"]
    assert read_journal(tmp_path).records == 1 + 50 + 1 + 1  # two headers


def test_a_full_queue_drops_records_and_counts_them_instead_of_blocking(tmp_path):
    gate = threading.Event()
    w = _writer(tmp_path, write_interval_ms=0, max_queue_mb=0.001)  # ~1 KB of records may wait
    p = _gen(1, 0, 0, list(range(10)))

    def slow() -> bytes:  # a disk that does not keep up: the first record holds the writer
        gate.wait(10)
        return p

    assert w.put(slow, 600)
    results = [w.put(lambda: p, 300) for _ in range(5)]
    assert results[0] and not all(results)
    assert w.stats["dropped_queue_full"] == results.count(False)
    gate.set()
    w.close()
    assert read_journal(tmp_path).records == 1 + 1 + results.count(True)


def test_a_failing_disk_turns_the_journal_off_not_the_run(tmp_path):
    w = _writer(tmp_path, write_interval_ms=0)

    def broken() -> bytes:
        raise OSError(28, "No space left on device")

    assert w.put(broken, 10)
    with pytest.raises(OSError, match="No space"):
        w.sync().result(10)
    assert isinstance(w.error, OSError) and not w.put(lambda: b"x" * 20, 20)
    w.close()


# ---------------------------------------------------------------------------- the fold


def _segment(path: Path, payloads: list[bytes]) -> None:
    header = codec.encode(codec.HEADER, codec.RUN, 0, 0, {"format": 1, "model": "m", "data": "d", "config": {}})
    path.write_bytes(b"".join(frame(p) for p in [header, *payloads]))


def test_generations_duplicates_gaps_drops_and_trained_groups(tmp_path):
    eff = lambda n, name, done: codec.encode(  # noqa: E731
        codec.EFFECT_DONE if done else codec.EFFECT_START, 7, 0, 1, {"g": 1, "n": n, "name": name, "ah": 5,
                                                                    **({"v": {"ok": n}} if done else {})})
    first = [_gen(7, 0, 0, [1]), _gen(7, 0, 1, [2]), _gen(7, 0, 3, [4]),  # effect 2 lost: replay stops at 1
             _gen(7, 1, 0, [9]), codec.encode(codec.RESTART, 7, 0, 1, {"g": 1, "why": "diverged"}),
             _gen(7, 1, 0, [10], g=1), eff(1, "tool:calculator", False),
             _gen(8, 0, 0, [3], attempt=0), codec.encode(codec.DROP, 8, 0, 0, {"why": "given out again"}),
             _gen(8, 0, 0, [3], attempt=1), _gen(11, 0, 0, [5])]
    _segment(tmp_path / "d-000001.jal", first)
    # a compaction killed after its rename: the same records again, plus one more and the TRAINED record
    _segment(tmp_path / "c-000001.jal", first + [eff(1, "tool:calculator", True),
                                                 codec.encode(codec.TRAINED, codec.RUN, 0, 0,
                                                              {"step": 2, "uids": [11], "data_state": {"next": 12}})])
    state = read_journal(tmp_path)
    assert state.damaged_records == 0 and len(state.headers) == 2
    ep0, ep1 = state.episodes[(7, 0, 0)], state.episodes[(7, 0, 1)]
    assert [e.out.token_ids for e in ep0.replay()] == [[1], [2]]
    assert ep1.g == 1 and [e.kind for e in ep1.replay()] == ["gen", "effect"]
    assert ep1.replay()[0].out.token_ids == [10] and ep1.replay()[1].done and ep1.replay()[1].value == {"ok": 1}
    assert state.trained == {11} and state.data_state == {"next": 12} and state.trained_step == 2
    assert sorted(state.groups()) == [7, 8] and list(state.groups()[8]) == [1]  # attempt 0 dropped, 11 trained


# ---------------------------------------------------------------------------- header, compaction, resume plan


def _cfg(*over: str):
    return load_config(None, ['server.urls=["http://127.0.0.1:1"]', *over])


def test_a_journal_of_another_model_data_or_config_is_refused_by_name(tmp_path):
    cfg = _cfg()
    d = tmp_path / "journal"
    j = Journal.open(d, cfg.journal, journal_header(cfg, "/models/a", "sha256:aaa"))
    j.put(lambda: _gen(1, 0, 0, [1]), 10)
    j.close()
    Journal.open(d, cfg.journal, journal_header(cfg, "/models/a", "sha256:aaa")).close()  # the same run: fine
    with pytest.raises(JournalMismatchError, match=r"model: '/models/a' -> '/models/b'"):
        Journal.open(d, cfg.journal, journal_header(cfg, "/models/b", "sha256:aaa"))
    with pytest.raises(JournalMismatchError, match=r"data \(the training rows' fingerprint\): 'sha256:aaa' -> "):
        Journal.open(d, cfg.journal, journal_header(cfg, "/models/a", "sha256:bbb"))
    other = _cfg("tools.max_turns=7")
    with pytest.raises(JournalMismatchError, match=r"config tools: '[0-9a-f]+' -> '[0-9a-f]+'.*journal.on_mismatch"):
        Journal.open(d, other.journal, journal_header(other, "/models/a", "sha256:aaa"))
    # discard: moved aside, a fresh journal
    lines: list[str] = []
    other.journal.on_mismatch = "discard"
    j = Journal.open(d, other.journal, journal_header(other, "/models/a", "sha256:aaa"), say=lines.append)
    j.close()
    assert j.state.records == 0 and len(list(tmp_path.glob("journal.discarded-*"))) == 1 and "moved to" in lines[0]


def test_compaction_keeps_only_groups_still_in_flight(tmp_path):
    _segment(tmp_path / "d-000001.jal", [_gen(1, 0, 0, [1]), _gen(2, 0, 0, [2]), _gen(3, 0, 0, [3]),
                                         codec.encode(codec.DROP, 3, 0, 0, {"why": "stale"}), _gen(3, 0, 0, [4],
                                                                                              attempt=1)])
    _segment(tmp_path / "d-000002.jal", [_gen(2, 1, 0, [5]), _gen(4, 0, 0, [6])])
    header = codec.encode(codec.HEADER, codec.RUN, 0, 0, {"format": 1, "model": "m", "data": "d", "config": {}})
    stats = compact_segments([tmp_path / "d-000001.jal", tmp_path / "d-000002.jal"], tmp_path / "c-000001.jal",
                             frozenset({2}), frozenset({(3, 0)}), 5, {"next": 9}, header)
    assert sorted(p.name for p in tmp_path.glob("*")) == ["c-000001.jal"] and stats["bytes_out"] < stats["bytes_in"]
    state = read_journal(tmp_path)
    assert sorted(k[:2] for k in state.episodes) == [(1, 0), (3, 1), (4, 0)]  # 2 trained, (3, 0) dropped
    assert (3, 0) in state.dropped and state.data_state == {"next": 9}


def test_the_resume_plan_continues_untrained_groups_and_drops_stale_ones_counted(tmp_path):
    cfg = _cfg()
    header = journal_header(cfg, "m", "d")
    d = tmp_path / "j"
    j = Journal.open(d, cfg.journal, header)
    for p in [_gen(3, 0, 0, [1, 2], version=4), _gen(3, 1, 0, [3], version=5),  # in flight, fresh enough
              _gen(4, 0, 0, [1], version=1),  # its oldest token too old for the first step
              _gen(2, 0, 0, [1], version=4),  # trained before the kill (its TRAINED record was lost)
              _gen(6, 0, 0, [8], attempt=0), _gen(6, 0, 0, [9, 9], attempt=1, version=5)]:
        j.put(lambda p=p: p, len(p))
    meta, blobs = codec.done_meta(0, [_rec(6, 1)])
    j.put(lambda: codec.encode(codec.DONE, 6, 1, 1, meta, blobs), 100)
    j.close()
    j = Journal.open(d, cfg.journal, header)
    plan = j.plan_resume(handed_out=lambda uid: uid != 2, floor_version=3)
    assert plan.groups == {3: 0, 6: 1} and plan.dropped_stale == [(4, 0, 1)] and plan.already_trained == 1
    assert (plan.episodes, plan.finished_episodes, plan.tokens) == (4, 1, 3 + 2 + 2)
    assert j.counts["groups_dropped_stale"] == 1 and j.counts["episodes_dropped_stale"] == 1
    s = j.resumed_sample(_sample(6))
    assert (s.uid, s.attempt) == (6, 1) and j.resumed_sample(_sample(6)).attempt == 0  # once
    assert j.oldest_version(3) == 4 and j.oldest_version(6) == 4  # the finished record holds version 4
    j.close()
    # the drops were journaled: a second resume does not see those groups again
    j = Journal.open(d, cfg.journal, header)
    assert sorted(j.state.groups()) == [2, 3, 6] and list(j.state.groups()[6]) == [1]
    j.close()


def _sample(uid: int):
    from agentloop.records import Sample

    return Sample(index=uid, uid=uid, data_source="t", messages=[{"role": "user", "content": "x"}])


def test_journal_config_is_on_by_default_with_documented_keys():
    cfg = JournalConfig()
    assert cfg.enabled and cfg.fsync_interval_ms == 1000 and cfg.on_mismatch == "refuse"
    for name, field in JournalConfig.model_fields.items():
        assert field.description, f"journal.{name} has no docstring"


def test_each_step_boundary_compacts_what_came_before_into_one_segment(tmp_path):
    """A step's groups leave the journal once its batch went to the learner: after three step boundaries the journal
    is one compacted segment (the last one's output, which took in the one before) plus the open one, holding only
    the groups still in flight."""
    cfg = _cfg()
    j = Journal.open(tmp_path, cfg.journal, journal_header(cfg, "m", "d"))
    for step in (1, 2, 3):
        for uid in (2 * step, 2 * step + 1):
            p = _gen(uid, 0, 0, list(range(30)))
            j.put(lambda p=p: p, len(p))
        j.trained(step, [2 * step - 1] if step > 1 else [], {"next": 2 * step + 2})  # trains the previous odd uid
        j.settle()
    p = _gen(99, 0, 0, [1])
    j.put(lambda: p, len(p))
    j.close()
    names = sorted(f.name for f in tmp_path.glob("*.jal"))
    assert names == ["c-000003.jal", "d-000004.jal"], names
    state = read_journal(tmp_path)
    assert sorted({k[0] for k in state.episodes}) == [2, 4, 6, 7, 99] and state.data_state == {"next": 8}
    assert j.counts["compactions"] == 3 and state.damaged_records == 0
