"""Data loading: verl rows from JSONL/Parquet, error locations, built-in sets."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import agentloop.data as data
from agentloop.config import DataConfig
from agentloop.data import (
    builtin_rows,
    get_dataset,
    list_datasets,
    load_file,
    load_samples,
    register_dataset,
    rows_to_samples,
    to_plain,
    write_jsonl,
)
from agentloop.errors import DataError
from agentloop.rewards import get_reward, score_episode
from tests.unit.api_check import assert_public_api


def row(**over):
    r = {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+1?"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "2"},
        "extra_info": {"index": 7, "split": "test"},
    }
    r.update(over)
    return r


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_all_is_exactly_the_public_namespace():
    assert_public_api(data)


def test_jsonl_rows_become_samples(tmp_path):
    tools = {"calc": {"create_kwargs": {"x": 1}}}
    p = write_lines(tmp_path / "d.jsonl", [
        json.dumps(row()),
        "",
        json.dumps(row(extra_info={"tools_kwargs": tools})),
        json.dumps(row(tools_kwargs={"top": {}}, extra_info={"tools_kwargs": tools})),
    ])
    samples = load_file(p)
    assert [s.index for s in samples] == [0, 1, 2]  # row positions; blank lines do not count
    s = samples[0]
    assert s.data_source == "openai/gsm8k" and s.ground_truth == "2" and s.ability == "math"
    assert s.messages[1] == {"role": "user", "content": "1+1?"}
    assert s.extra_info == {"index": 7, "split": "test"} and s.tools_kwargs == {}
    assert samples[1].tools_kwargs == tools
    assert samples[2].tools_kwargs == {"top": {}}  # top-level wins
    assert len(load_file(p, max_samples=2)) == 2


def test_optional_fields(tmp_path):
    r = {"data_source": "x", "prompt": [{"role": "user", "content": "hi"}]}
    s = load_file(write_lines(tmp_path / "d.jsonl", [json.dumps(r)]))[0]
    assert s.ground_truth is None and s.extra_info == {} and s.ability is None


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ("{not json", "invalid JSON"),
        ("[1, 2]", "must be a JSON object"),
        (json.dumps({"prompt": [{"role": "user", "content": "x"}]}), "missing 'data_source'"),
        (json.dumps(row(data_source="")), "'data_source' must be a non-empty string"),
        (json.dumps(row(data_source=3)), "'data_source' must be a non-empty string"),
        (json.dumps({"data_source": "x"}), "missing 'prompt'"),
        (json.dumps(row(prompt=[])), "non-empty list"),
        (json.dumps(row(prompt="hello")), "non-empty list"),
        (json.dumps(row(prompt=["hello"])), "prompt[0] must be a {role, content} dict"),
        (json.dumps(row(prompt=[{"role": "user"}])), "prompt[0] lacks content"),
        (json.dumps(row(prompt=[{"role": "wizard", "content": "x"}])), "bad role 'wizard'"),
        (json.dumps(row(prompt=[{"role": "user", "content": 5}])), "content must be a string"),
        (json.dumps(row(reward_model="2")), "'reward_model' must be a dict"),
        (json.dumps(row(extra_info=[1])), "'extra_info' must be a dict"),
        (json.dumps(row(tools_kwargs=[1])), "'tools_kwargs' must be a dict"),
        (json.dumps(row(extra_info={"tools_kwargs": {"calc": 3}})), "extra_info.tools_kwargs['calc']"),
        (json.dumps(row(ability=1)), "'ability' must be a string"),
    ],
)
def test_malformed_jsonl_row_names_file_and_line(tmp_path, line, needle):
    p = write_lines(tmp_path / "bad.jsonl", [json.dumps(row()), "", line])
    with pytest.raises(DataError) as ei:
        load_file(p)
    msg = str(ei.value)
    assert msg.startswith(f"{p}:3: "), msg
    assert needle in msg, msg


def test_file_level_errors(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(DataError, match="empty data file"):
        load_file(empty)
    with pytest.raises(DataError, match=r"unknown data file extension '\.csv'"):
        load_file(tmp_path / "rows.csv")
    with pytest.raises(DataError, match="does not exist"):
        load_file(tmp_path / "missing.jsonl")
    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match="not a readable Parquet file"):
        load_file(junk)
    binary = tmp_path / "bin.jsonl"
    binary.write_bytes(json.dumps(row()).encode() + b"\n\xff\xfe\n")
    with pytest.raises(DataError, match=r"bin.jsonl:2: not UTF-8"):
        load_file(binary)


def test_parquet_round_trip(tmp_path):
    rows = [
        row(extra_info={"index": 0, "tools_kwargs": {"calc": {"create_kwargs": {"a": 1}}}}),
        row(
            prompt=[{"role": "user", "content": "q"}],
            reward_model={"style": "rule", "ground_truth": "5"},
            extra_info={"index": 1},
        ),
    ]
    p = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows), p)
    samples = load_file(p)
    assert [s.index for s in samples] == [0, 1]
    assert samples[0].messages == rows[0]["prompt"]
    assert samples[0].tools_kwargs == {"calc": {"create_kwargs": {"a": 1}}}
    # The struct column gives row 1 an extra_info.tools_kwargs of None: no tools, not an error.
    assert samples[1].tools_kwargs == {}
    assert samples[1].ground_truth == "5" and samples[1].extra_info["index"] == 1
    # Back to JSONL and again: identical samples.
    out = write_jsonl(samples, tmp_path / "again.jsonl")
    assert load_file(out) == samples


def test_parquet_message_keys_missing_in_some_rows(tmp_path):
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "name": "bot"}]
    p = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist([row(prompt=msgs)]), p)
    got = load_file(p)[0].messages
    assert got == msgs  # the struct gave message 0 a name=None, which is dropped


def test_malformed_parquet_row_names_row(tmp_path):
    p = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist([row(), row(data_source=None)]), p)
    with pytest.raises(DataError, match=r"d\.parquet row 1: 'data_source' must be a non-empty string"):
        load_file(p)
    empty = tmp_path / "empty.parquet"
    pq.write_table(pa.Table.from_pylist([row()]).slice(0, 0), empty)
    with pytest.raises(DataError, match="empty data file"):
        load_file(empty)


def test_numpy_rows_are_normalized():
    r = row(
        prompt=np.array([{"role": "user", "content": "x"}], dtype=object),
        reward_model={"ground_truth": {"target": np.int64(5), "numbers": np.array([1, 4])}},
    )
    s = rows_to_samples([r], source="df")[0]
    assert s.messages == [{"role": "user", "content": "x"}]
    assert s.ground_truth == {"target": 5, "numbers": [1, 4]}
    assert type(s.ground_truth["target"]) is int and type(s.ground_truth["numbers"][0]) is int
    assert to_plain(np.float32(0.5)) == 0.5 and type(to_plain(np.bool_(True))) is bool
    with pytest.raises(DataError, match=r"^df row 1: missing 'data_source'"):
        rows_to_samples([r, {"prompt": []}], source="df")


def test_builtin_sets_are_deterministic_and_valid():
    assert {"arithmetic", "countdown", "gsm8k_mini"} <= set(list_datasets())
    # our own sets keep our lenient rewards (agentloop/...), not verl's / TinyZero's names
    for name, source, size in [("arithmetic", "agentloop/arithmetic", 64), ("countdown", "agentloop/countdown", 64),
                               ("gsm8k_mini", "agentloop/gsm8k", 16)]:
        samples = load_samples(DataConfig(builtin=name))
        assert len(samples) == size
        assert {s.data_source for s in samples} == {source}
        assert builtin_rows(name) == builtin_rows(name)
    assert len(load_samples(DataConfig(builtin="arithmetic", max_samples=5))) == 5
    with pytest.raises(DataError, match="unknown built-in data set 'nope'"):
        load_samples(DataConfig(builtin="nope"))


def test_builtin_ground_truths_score_with_their_rewards():
    for s in load_samples(DataConfig(builtin="arithmetic")):
        a, op, b = s.messages[-1]["content"].removeprefix("What is ").rstrip("?").split()
        value = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        assert s.ground_truth == str(value)
    for s in load_samples(DataConfig(builtin="countdown")):
        answer = f"<answer>{s.extra_info['reference_solution']}</answer>"
        assert score_episode(get_reward(s.data_source), s.data_source, answer, s.ground_truth, s.extra_info).score == 1.0
    for s in load_samples(DataConfig(builtin="gsm8k_mini")):
        answer = s.extra_info["answer"]
        assert score_episode(get_reward(s.data_source), s.data_source, answer, s.ground_truth, s.extra_info).score == 1.0


def test_register_dataset_and_export(tmp_path):
    def tiny():
        return [row()]

    register_dataset("tiny_test_set", tiny)
    register_dataset("tiny_test_set", tiny)  # same function: no-op
    assert get_dataset("tiny_test_set") is tiny
    with pytest.raises(DataError, match="already registered"):
        register_dataset("tiny_test_set", lambda: [])
    samples = load_samples(DataConfig(builtin="tiny_test_set"))
    p = write_jsonl(builtin_rows("countdown"), tmp_path / "sub" / "countdown.jsonl")
    assert len(load_file(p)) == 64 and samples[0].ground_truth == "2"
    with pytest.raises(DataError, match=r"write_jsonl.*row 0: missing 'data_source'"):
        write_jsonl([{"prompt": []}], tmp_path / "bad.jsonl")


def test_load_samples_from_path_uses_prompt_key(tmp_path):
    r = row()
    r["messages"] = r.pop("prompt")
    p = write_lines(tmp_path / "d.jsonl", [json.dumps(r)] * 3)
    samples = load_samples(DataConfig(path=str(p), prompt_key="messages", max_samples=2))
    assert len(samples) == 2 and samples[1].index == 1
