"""The code reward (tests run in the python tool's sandbox) and the tool-aware reward combination."""

from __future__ import annotations

import asyncio

import pytest

from agentloop.config import Config
from agentloop.records import Sample
from agentloop.rewards import get_reward
from agentloop.rewards.code import (
    CodeRewardConfig,
    extract_code,
    make_code_reward,
    parse_ground_truth,
)
from agentloop.rewards.tool_aware import ToolRewardConfig, combine_tool_reward
from agentloop.rollout.scorer import Scorer

GT = {"entry_point": "add", "tests": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", [[2, 2], 4], [[0, 0], 0]]}
GOOD = "Here it is:\n```python\ndef add(a, b):\n    return a + b\n```\n"
FAST = CodeRewardConfig(timeout_s=60.0, per_test_timeout_s=10.0)
"""Deadlines an honest solution meets also on a loaded machine (a test's verdict never hangs on the CPU's speed);
the tests of deadlines set their own."""


def score(answer: str, gt=GT, cfg: CodeRewardConfig = FAST) -> dict:
    return asyncio.run(make_code_reward(cfg)("agentloop/code", answer, gt, None))


def test_correct_answer_scores_one():
    r = score(GOOD)
    assert r["score"] == 1.0 and r["tests_passed"] == 4 and r["tests_total"] == 4
    assert r["sandbox"] == "ok" and r["code_from"] == "block" and r["first_failure"] == ""


def test_wrong_answer_pass_rate_and_all_or_nothing():
    wrong = "```python\ndef add(a, b):\n    return a + b if a >= 0 else 99\n```"
    r = score(wrong)
    assert r["score"] == 0.75 and r["tests_passed"] == 3
    assert "assert add(-1, 1) == 0" in r["first_failure"] and "AssertionError" in r["first_failure"]
    strict = FAST.model_copy(update={"mode": "all_or_nothing"})
    assert score(wrong, cfg=strict)["score"] == 0.0
    assert score(GOOD, cfg=strict)["score"] == 1.0


def test_pair_results_compare_tuples_as_lists_and_report_mismatch():
    gt = {"entry_point": "pair", "tests": [[[1], [1, 2]], [[3], [3, 4]]]}
    assert score("def pair(x):\n    return (x, x + 1)\n", gt)["score"] == 1.0
    r = score("def pair(x):\n    return [x]\n", gt)
    assert r["score"] == 0.0 and "returned [1], expected [1, 2]" in r["first_failure"]


def test_extraction():
    two = "```python\nx = 1\n```\ntext\n```py\ndef add(a, b): return a + b\n```"
    assert extract_code(two) == ("def add(a, b): return a + b\n", "block")
    assert extract_code("```\ndef f(): pass\n```") == ("def f(): pass\n", "block")
    chatml = "<|im_start|>assistant\ndef add(a, b):\n    return a + b<|im_end|>\n"
    assert extract_code(chatml) == ("def add(a, b):\n    return a + b", "text")
    assert extract_code("   ") == ("", "none")
    r = score("")
    assert r["score"] == 0.0 and r["sandbox"] == "no_code"


def test_syntax_error_and_missing_function():
    r = score("```python\ndef add(a, b) return a\n```")
    assert r["score"] == 0.0 and "SyntaxError" in r["first_failure"]
    r = score("```python\ndef plus(a, b):\n    return a + b\n```")
    assert r["score"] == 0.0 and "NameError" in r["first_failure"]


def test_bad_ground_truth_is_an_error():
    for bad in (None, {"tests": []}, {"entry_point": "f", "tests": [42]}, {"tests": [[[1], 2]]}):
        with pytest.raises(ValueError):
            parse_ground_truth(bad)
    assert parse_ground_truth('{"entry_point": "f", "tests": ["assert f()"]}') == ("f", ["assert f()"])


def test_endless_loop_is_contained_and_earlier_tests_count():
    code = "def add(a, b):\n    while a == 2:\n        pass\n    return a + b\n"
    hang = CodeRewardConfig(timeout_s=20.0, per_test_timeout_s=3.0)
    r = score(code, cfg=hang)
    assert r["tests_passed"] == 3 and r["score"] == 0.75  # only [[2, 2], 4] hangs, cut by its deadline
    assert "longer than" in r["first_failure"]
    r = score("while True:\n    pass\n", cfg=hang)  # at load time
    assert r["score"] == 0.0 and "loading the solution failed" in r["first_failure"]


def test_endless_loop_that_swallows_the_deadline_hits_the_wall_limit():
    code = ("def add(a, b):\n    while True:\n        try:\n            while True: pass\n"
            "        except BaseException:\n            pass\n")
    r = score(code, cfg=CodeRewardConfig(timeout_s=2.0, per_test_timeout_s=0.5))
    assert r["score"] == 0.0 and r["sandbox"] in ("timeout", "cpu_limit")


def test_fork_bomb_is_contained_and_a_concurrent_run_is_unaffected():
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"

    async def both():
        fn = make_code_reward(CodeRewardConfig(timeout_s=8.0, per_test_timeout_s=4.0))
        return await asyncio.gather(fn("agentloop/code", bomb, GT), fn("agentloop/code", GOOD, GT))

    bad, good = asyncio.run(both())
    assert bad["score"] == 0.0 and good["score"] == 1.0


def test_environment_of_the_scorer_is_not_visible(monkeypatch):
    monkeypatch.setenv("AGENTLOOP_SECRET_TEST", "hunter2")
    gt = {"entry_point": "leak", "tests": ["assert leak() == 'hunter2'", "assert 'hunter2' not in leak_proc()"]}
    code = ("import os\n"
            "def leak():\n    return os.environ.get('AGENTLOOP_SECRET_TEST')\n"
            "def leak_proc():\n"
            "    try:\n        return open(f'/proc/{os.getppid()}/environ', 'rb').read().decode('latin-1')\n"
            "    except OSError:\n        return ''\n")
    r = score(code, gt)
    assert r["tests_passed"] == 1 and "leak() == 'hunter2'" in r["first_failure"]


def test_printing_exiting_and_forged_lines_do_not_fool_the_reward():
    body = GOOD.split("```python\n")[1].split("```")[0]
    flood = "print('x' * 10**6)\nimport sys\nsys.stderr.write('y' * 10**6)\n" + body
    assert score(flood)["score"] == 1.0  # the solution's output goes to /dev/null, not into the output cap
    assert score("import sys\nsys.exit(0)\n")["score"] == 0.0
    main_block = "def add(a, b):\n    return a + b\nif __name__ == '__main__':\n    raise SystemExit(1)\n"
    assert score(main_block)["score"] == 1.0  # loaded as a module, not as __main__
    forged = "import os\nfor i in range(4):\n    print('0' * 32, i, 1, '\"\"')\n    os.write(1, b'x 0 1 \"\"\\n')\n"
    assert score(forged)["score"] == 0.0
    exit_hard = "import os\nos._exit(0)\n"
    assert score(exit_hard)["score"] == 0.0


def test_registered_and_scored_by_the_engine_scorer():
    fn = get_reward("agentloop/code")
    assert asyncio.iscoroutinefunction(fn)
    scorer = Scorer(Config())
    s = Sample(index=0, data_source="agentloop/code", messages=[{"role": "user", "content": "x"}], ground_truth=GT)
    value, info = asyncio.run(scorer.score(s, GOOD))
    assert value == 1.0 and info["tests_total"] == 4 and info["sandbox"] == "ok"


# ---------------------------------------------------------------- tool-aware combination


def test_combine_tool_reward_rule():
    extra = {"tool_penalty": 0.2, "tool_rewards": {"python": 0.5, "search": 0.1}}
    r, info = combine_tool_reward(1.0, extra)
    assert r == pytest.approx(1.0 - 0.2 + 0.6)
    assert info == {"task_score": 1.0, "tool_penalty": 0.2, "tool_reward": pytest.approx(0.6)}
    cfg = ToolRewardConfig(penalty_weight=2.0, tool_reward_weight=0.5, tool_reward_names=["python"],
                           max_reward=1.0)
    r, _ = combine_tool_reward(1.0, extra, cfg)
    assert r == pytest.approx(min(1.0, 1.0 - 0.4 + 0.25))
    r, _ = combine_tool_reward(0.0, {"tool_penalty": 3.0}, ToolRewardConfig(min_reward=-1.0))
    assert r == -1.0
    assert extra == {"tool_penalty": 0.2, "tool_rewards": {"python": 0.5, "search": 0.1}}  # pure


def test_combine_tool_reward_without_tool_fields_is_identity():
    assert combine_tool_reward(0.75, {"response_text": "x"}) == (0.75, {})
    assert combine_tool_reward(0.75, {"tool_penalty": 0.0, "tool_rewards": {}}) == (
        0.75, {"task_score": 0.75, "tool_penalty": 0.0, "tool_reward": 0.0})


def test_combine_tool_reward_rejects_bad_values():
    with pytest.raises(ValueError):
        combine_tool_reward(1.0, {"tool_penalty": float("nan")})
    with pytest.raises(ValueError):
        combine_tool_reward(1.0, {"tool_rewards": {"x": "lots"}})
    with pytest.raises(ValueError):
        ToolRewardConfig(min_reward=1.0, max_reward=0.0)
