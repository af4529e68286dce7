"""`agentloop data prepare` (the data sets' own files -> verl rows) and `agentloop data check`."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from agentloop.cli import main
from agentloop.config import DataConfig
from agentloop.data import (
    check_file,
    generate_countdown,
    load_file,
    load_samples,
    read_rows,
)
from agentloop.data.prepare import prepare_code, prepare_gsm8k
from agentloop.data.templates import COUNTDOWN_TEMPLATES, GSM8K_INSTRUCTION
from agentloop.errors import DataError
from agentloop.rewards import get_reward

GSM8K_ROWS = [
    {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                 "How many clips did Natalia sell altogether in April and May?",
     "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
               "altogether in April and May.\n#### 72"},
    {"question": "A company paid $1,200 per month. How much in a year?",
     "answer": "12 * 1200 = 14400\n#### 14,400"},
]


def _parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_prepare_gsm8k_from_the_datasets_parquet(tmp_path, capsys):
    src = _parquet(tmp_path / "test-00000-of-00001.parquet", GSM8K_ROWS)
    out = tmp_path / "gsm8k.parquet"
    assert main(["data", "prepare", "gsm8k", "--input", str(src), "--output", str(out)]) == 0
    assert "wrote 2 rows" in capsys.readouterr().out
    rows = [r for _, r in read_rows(out)]
    assert rows[0]["data_source"] == "openai/gsm8k" and rows[0]["ability"] == "math"
    assert rows[0]["prompt"] == [{"role": "user", "content": GSM8K_ROWS[0]["question"] + " " + GSM8K_INSTRUCTION}]
    assert rows[0]["prompt"][0]["content"].endswith('output the final answer after "####".')
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["72", "14400"]  # verl: commas removed
    assert rows[1]["extra_info"] == {"split": "test", "index": 1, "answer": GSM8K_ROWS[1]["answer"],
                                     "question": GSM8K_ROWS[1]["question"]}
    # the rows load, and verl's reward scores the dataset's own solutions 1.0
    for s in load_file(out):
        assert get_reward(s.data_source)(s.data_source, s.extra_info["answer"].replace("14,400", "14400"),
                                         s.ground_truth) == 1.0
    assert check_file(out).problems == []


def test_prepare_gsm8k_names_the_bad_row(tmp_path):
    src = tmp_path / "g.jsonl"
    src.write_text(json.dumps(GSM8K_ROWS[0]) + "\n" + json.dumps({"question": "q", "answer": "no marker"}) + "\n")
    with pytest.raises(DataError, match=r"g.jsonl:2: the answer has no '#### <number>' line"):
        prepare_gsm8k(read_rows(src))
    with pytest.raises(DataError, match=r"g.jsonl:1: missing 'answer'"):
        prepare_gsm8k([(f"{src}:1", {"question": "q"})])
    arr = tmp_path / "g.json"  # one JSON array works too
    arr.write_text(json.dumps(GSM8K_ROWS))
    assert [r["reward_model"]["ground_truth"] for r in prepare_gsm8k(read_rows(arr))] == ["72", "14400"]


def test_prepare_countdown_from_files_and_generator(tmp_path):
    src = _parquet(tmp_path / "train.parquet", [{"target": 98, "nums": [44, 19, 35]}, {"target": 24, "nums": [2, 3, 4, 1]}])
    out = tmp_path / "cd.jsonl"
    assert main(["data", "prepare", "countdown", "--input", str(src), "--output", str(out), "--limit", "1"]) == 0
    rows = [r for _, r in read_rows(out)]
    assert len(rows) == 1 and rows[0]["data_source"] == "countdown"
    assert rows[0]["prompt"][0]["content"] == COUNTDOWN_TEMPLATES["base"].format(numbers=[44, 19, 35], target=98)
    assert "Using the numbers [44, 19, 35], create an equation that equals 98." in rows[0]["prompt"][0]["content"]
    assert rows[0]["reward_model"]["ground_truth"] == {"target": 98, "numbers": [44, 19, 35]}
    gen = generate_countdown(5, seed=3, template="qwen-instruct")
    assert gen == generate_countdown(5, seed=3, template="qwen-instruct")
    fn = get_reward("countdown")
    for r in gen:
        prompt = r["prompt"][0]["content"]
        assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<think>")
        # TinyZero's reward on prompt + response: the reference solution scores 1.0, a wrong one 0.1
        gt = r["reward_model"]["ground_truth"]
        assert fn("countdown", prompt + f" ok </think> <answer>{r['extra_info']['reference_solution']}</answer>", gt) == 1.0
        assert fn("countdown", prompt + " ok </think> <answer>1 + 1</answer>", gt) == 0.1


def test_prepare_search_r1_rows(tmp_path, capsys):
    src = tmp_path / "nq.jsonl"
    src.write_text(json.dumps({"id": "1", "question": " who wrote hamlet ", "golden_answers": ["Shakespeare",
                                                                                               "William Shakespeare"]})
                   + "\n")
    out = tmp_path / "nq.parquet"
    assert main(["data", "prepare", "search_r1", "--input", str(src), "--output", str(out), "--data-source", "nq"]) == 0
    (s,) = load_file(out)
    assert s.data_source == "nq" and s.ground_truth == {"target": ["Shakespeare", "William Shakespeare"]}
    assert s.messages[0]["content"].endswith("For example, <answer> Beijing </answer>. Question: who wrote hamlet?\n")
    assert main(["data", "prepare", "search_r1", "--input", str(src), "--output", str(tmp_path / "x.jsonl")]) == 2
    assert "nq.jsonl:1: no data_source: pass --data-source" in capsys.readouterr().err


def test_prepare_code_function_and_stdio_problems(tmp_path):
    rows = [("r0", {"question": "Write add(a, b).", "entry_point": "add", "tests": ["assert add(1, 2) == 3"]}),
            ("r1", {"question": "Print a+b.", "tests": [{"input": "1 2\n", "output": "3\n"}]}),
            ("r2", {"question": "Echo.", "input_output": json.dumps({"inputs": ["x\n"], "outputs": ["x\n"]})})]
    out = prepare_code(rows)
    assert out[0]["reward_model"]["ground_truth"] == {"entry_point": "add", "tests": ["assert add(1, 2) == 3"]}
    assert out[1]["reward_model"]["ground_truth"] == {"tests": [{"stdin": "1 2\n", "stdout": "3\n"}]}
    assert out[2]["reward_model"]["ground_truth"] == {"tests": [{"stdin": "x\n", "stdout": "x\n"}]}
    assert all(r["data_source"] == "agentloop/code" and r["extra_info"]["tools_kwargs"] == {"python": {}} for r in out)
    assert "standard input" in out[1]["prompt"][1]["content"] and "standard input" in out[1]["prompt"][0]["content"]
    with pytest.raises(DataError, match="r9: no tests"):
        prepare_code([("r9", {"question": "q"})])
    # parquet output keeps the mixed-type tests as JSON
    p = tmp_path / "code.parquet"
    assert main(["data", "prepare", "code", "--builtin", "code", "--output", str(p)]) == 0
    s = load_samples(DataConfig(path=str(p)))
    assert json.loads(s[0].ground_truth)["entry_point"] == "add_digits"
    assert check_file(p).errors == 0


def test_data_check_reports_every_problem_row_by_row(tmp_path, capsys):
    good = {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "q"}],
            "reward_model": {"style": "rule", "ground_truth": "72"}}
    lines = [
        json.dumps(good),
        json.dumps({**good, "reward_model": {"ground_truth": 72}}),            # int: never equals verl's string
        json.dumps({**good, "reward_model": {"ground_truth": "1,234"}}),       # commas: never matches
        "{not json",
        json.dumps({"prompt": [{"role": "robot", "content": "q"}]}),           # no data_source, bad role
        json.dumps({**good, "data_source": "countdown", "reward_model": {"ground_truth": {"target": "24"}}}),
        json.dumps({**good, "data_source": "gsm8k", "agent_name": "tool_agent",
                    "extra_info": {"tools_kwargs": {"no_such_tool": {}}}}),
        json.dumps({**good, "data_source": "my/unknown"}),
    ]
    f = tmp_path / "rows.jsonl"
    f.write_text("\n".join(lines) + "\n")
    code = main(["data", "check", str(f)])
    out = capsys.readouterr().out
    assert code == 1
    assert f"{f}:1:" not in out
    assert f"{f}:2: error: ground truth 72 is a int: verl compares the extracted answer as a STRING" in out
    assert f"{f}:3: error: ground truth '1,234' cannot be matched by verl's rule" in out
    assert f"{f}:4: error: invalid JSON" in out
    assert f"{f}:5: error: missing 'data_source'" in out and f"{f}:5: error: prompt[0] has bad role 'robot'" in out
    assert f"{f}:6: error: countdown ground truth must be" in out
    assert f"{f}:7: warning: verl has no reward for 'gsm8k'" in out
    assert f"{f}:7: warning: agent_name 'tool_agent' is verl's per-row loop choice" in out
    assert "rollout.loop=tool_agent_loop" in out and "tool 'no_such_tool', which is not registered" in out
    assert f"{f}:8: warning: no reward is registered for data_source 'my/unknown'" in out
    assert out.strip().splitlines()[-1].startswith(f"{f}: 8 rows, 6 errors in 5 rows")
    f.write_text(lines[0] + "\n")
    assert main(["data", "check", str(f)]) == 0


def _verl_search_r1_rows(path):
    """Rows in the shape verl's examples/data_preprocess/preprocess_search_r1_dataset.py writes, as parquet."""
    rows = []
    for i, (ds, q, a) in enumerate([("nq", "capital of australia?", "Canberra"),
                                    ("nq", "river of paris?", "Seine"),
                                    ("hotpotqa", "who painted the mona lisa?", "Leonardo da Vinci")]):
        tagged = "searchR1_" + ds
        rows.append({"data_source": tagged,
                     "prompt": [{"role": "system", "content": "You are a helpful and harmless assistant."},
                                {"role": "user", "content": "Answer the given question. Question: " + q}],
                     "ability": "fact-reasoning",
                     "reward_model": {"style": "rule", "ground_truth": {"target": [a]}},
                     "extra_info": {"index": i, "need_tools_kwargs": True, "question": q, "split": "train",
                                    "tools_kwargs": {"search": {"create_kwargs": {
                                        "ground_truth": {"target": [a]}, "question": q, "data_source": tagged}}}},
                     "metadata": None})
    pq.write_table(pa.Table.from_pylist(rows), path)
    return rows


def test_data_check_with_verls_search_tool_config_says_which_rows_call_what(tmp_path, capsys):
    """`data check --tools-config`: verl's own search tool config loads (no clash with our built-in `search`,
    verl's class through our port) and every row is shown able to call it; without it, the searchR1_* rows are
    warned that they would bind to our built-in search."""
    from tests.unit.tools.test_verl_tools import SEARCH_TOOL_CONFIG

    data = tmp_path / "train.parquet"
    _verl_search_r1_rows(data)
    tools = tmp_path / "search_tool_config.yaml"
    tools.write_text(SEARCH_TOOL_CONFIG.format(url="http://127.0.0.1:8000/retrieve"))
    assert main(["data", "check", str(data), "--tools-config", str(tools)]) == 0
    out = capsys.readouterr().out
    assert "binds to agentloop's built-in `search`" not in out
    assert ("verl tool config, offered to every row: search: verl.tools.search_tool.SearchTool (verl is not "
            "installed: agentloop's port agentloop.tools.verl_ports.SearchTool)") in out
    assert "  searchR1_nq: rows can call search (all 2 rows)" in out
    assert "  searchR1_hotpotqa: rows can call search (all 1 rows)" in out
    assert main(["data", "check", str(data)]) == 0  # warnings only
    out = capsys.readouterr().out
    assert out.count("binds to agentloop's built-in `search`") == 3
    # a plain row is offered the config's tools too; a tools_kwargs entry without create_kwargs is named
    plain = tmp_path / "plain.jsonl"
    plain.write_text(json.dumps({"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "q"}],
                                 "reward_model": {"ground_truth": "1"}}) + "\n" +
                     json.dumps({"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "q"}],
                                 "reward_model": {"ground_truth": "1"},
                                 "extra_info": {"tools_kwargs": {"search": {"ground_truth": "1"}}}}) + "\n")
    assert main(["data", "check", str(plain), "--tools-config", str(tools)]) == 0
    out = capsys.readouterr().out
    assert "  openai/gsm8k: rows can call search (all 2 rows)" in out
    assert f"{plain}:2: warning: tools_kwargs['search'] has no 'create_kwargs' dict" in out
