"""The calculator task: arithmetic the tiny model cannot do in its head but can do with the tool.

One generator serves the eval set (`calculator`), the RL training set (`calculator_train`) and
the supervised warm start's synthetic traces, so all three agree on wording and answer format.

A problem: "What is 37 * 24 + 5?"; the intended episode calls
`calculator({"expression": "37 * 24 + 5"})`, reads `893` and answers `#### 893`
(scored by the GSM8K-style reward registered for data_source `agentloop/calculator`).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from agentloop.data.builtin import _Lcg, register_dataset

CALCULATOR_SOURCE = "agentloop/calculator"
CALCULATOR_SYSTEM = (
    "You are a careful assistant. Use the calculator tool for arithmetic. "
    "Finish with the final answer on its own line as `#### <number>`."
)


class CalcProblem(BaseModel):
    """One calculator problem."""

    question: str
    """The user's question."""
    expression: str
    """The expression to send to the calculator."""
    answer: int
    """The exact result."""


def calculator_problem(rng: _Lcg) -> CalcProblem:
    """Two operations on two-digit numbers: `a op b op c` with op in {+, -, *}."""
    a, b, c = rng.randint(11, 99), rng.randint(11, 99), rng.randint(2, 99)
    form = rng.randint(0, 3)
    expr = [f"{a} * {b} + {c}", f"{a} * {b} - {c}", f"{a} + {b} * {c}", f"({a} + {b}) * {c}"][form]
    value = [a * b + c, a * b - c, a + b * c, (a + b) * c][form]
    return CalcProblem(question=f"What is {expr}?", expression=expr, answer=value)


def calculator_rows(n: int = 64, seed: int = 3, split: str = "test") -> list[dict[str, Any]]:
    """verl rows of the calculator task; each row enables the `calculator` tool via tools_kwargs."""
    rng = _Lcg(seed)
    rows = []
    for i in range(n):
        p = calculator_problem(rng)
        rows.append({
            "data_source": CALCULATOR_SOURCE,
            "prompt": [{"role": "system", "content": CALCULATOR_SYSTEM}, {"role": "user", "content": p.question}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(p.answer)},
            "extra_info": {"split": split, "index": i, "expression": p.expression,
                           "tools_kwargs": {"calculator": {}}},
        })
    return rows


register_dataset("calculator", calculator_rows)
register_dataset("calculator_train", lambda: calculator_rows(n=4096, seed=12345, split="train"))
