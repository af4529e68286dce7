"""reasoning-gym's procedural datasets as verl rows (`agentloop data prepare reasoning_gym`, or `--env reasoning_gym:`).

    reasoning_gym_rows   tasks x size entries from `reasoning_gym.create_dataset(task, size=, seed=, **config)`,
                         each one row: data_source `reasoning_gym`, the entry's question as the user message
                         (after a system prompt: reasoning-gym's own SYSTEM_PROMPTS by name, or your text), the
                         entry's answer as ground truth and the whole entry (question, answer, metadata) as JSON in
                         extra_info["reasoning_gym"], which the reward (agentloop.rewards.reasoning_gym) hands to
                         reasoning-gym's own `score_answer` of the entry's `metadata["source_dataset"]`
    ANSWER_FORMATS       how the answer is read from the response: `answer_tag` is reasoning-gym's own
                         `extract_answer` (the last <answer>...</answer>), `hashes` the number after the last
                         `####` (the GSM8K-style line the project's tiny warm-started model writes)

Several tasks: each gets `size` entries of its own dataset (seed `seed`), interleaved task by task. The
entry is stored as JSON text so its metadata (nested, of any shape) survives a Parquet file unchanged.
reasoning-gym is an optional dependency (`pip install 'agentloop[envs]'`): imported only here, on use.
"""

from __future__ import annotations

import json
from typing import Any

from agentloop.errors import ConfigError, DataError

SOURCE = "reasoning_gym"
"""data_source of every row (the task is in extra_info; the reward is registered under this name)."""

ANSWER_FORMATS = ("answer_tag", "hashes")

CALCULATOR_TOOL_NOTE = "calculator"
"""`tools=["calculator"]`: the rows offer agentloop's calculator tool (tools_kwargs), for tool_agent_loop."""


def import_reasoning_gym() -> Any:
    try:
        import reasoning_gym
    except ImportError as e:
        raise ConfigError("reasoning-gym is not installed: pip install 'agentloop[envs]' (or reasoning-gym==0.1.25)"
                          f" ({e})") from None
    return reasoning_gym


def system_prompt_text(system_prompt: str | None) -> str | None:
    """A name of reasoning-gym's SYSTEM_PROMPTS ("default", "DeepSeekZero", "simple", ...) -> its text; any other
    string is the prompt itself; None or "" -> no system message."""
    if not system_prompt:
        return None
    from reasoning_gym.utils import SYSTEM_PROMPTS

    return SYSTEM_PROMPTS.get(system_prompt, system_prompt)


def reasoning_gym_rows(tasks: list[str], size: int, seed: int = 0, *, split: str = "train",
                       config: dict[str, dict[str, Any]] | None = None, system_prompt: str | None = "default",
                       answer_format: str = "answer_tag", tools: list[str] | None = None) -> list[dict[str, Any]]:
    """verl rows of `size` entries of each task (see the module doc). `config`: per task, the keyword arguments of
    its dataset config (`{"basic_arithmetic": {"min_terms": 2, "max_terms": 2}}`)."""
    rg = import_reasoning_gym()
    if not tasks:
        raise DataError("reasoning_gym: name at least one task (--task NAME[,NAME...])")
    if size < 1:
        raise DataError(f"reasoning_gym: --size must be >= 1, got {size}")
    if answer_format not in ANSWER_FORMATS:
        raise DataError(f"reasoning_gym: answer format {answer_format!r} is not one of {list(ANSWER_FORMATS)}")
    config = config or {}
    unknown = sorted(set(config) - set(tasks))
    if unknown:
        raise DataError(f"reasoning_gym: config given for tasks {unknown} that are not among --task {tasks}")
    known = set(rg.factory.DATASETS)
    missing = [t for t in tasks if t not in known]
    if missing:
        raise DataError(f"reasoning_gym: unknown task(s) {missing}; reasoning-gym {rg.__version__} has "
                        f"{len(known)}: {', '.join(sorted(known))}")
    system = system_prompt_text(system_prompt)
    per_task = []
    for task in tasks:
        try:
            ds = rg.create_dataset(task, size=size, seed=seed, **config.get(task, {}))
        except Exception as e:  # noqa: BLE001 - reasoning-gym's own message (a bad config key or value)
            raise DataError(f"reasoning_gym: create_dataset({task!r}, size={size}, seed={seed}, "
                            f"**{config.get(task, {})}) failed: {type(e).__name__}: {e}") from None
        per_task.append((task, ds))
    rows = []
    for i in range(size):
        for task, ds in per_task:
            entry = ds[i]
            messages = ([{"role": "system", "content": system}] if system else []) + \
                [{"role": "user", "content": entry["question"]}]
            extra: dict[str, Any] = {
                "split": split, "index": len(rows), "task": task,
                "reasoning_gym": json.dumps({"entry": _plain(entry), "answer_format": answer_format}),
            }
            if tools:
                extra["tools_kwargs"] = {t: {} for t in tools}
            rows.append({"data_source": SOURCE, "prompt": messages, "ability": task,
                         "reward_model": {"style": "rule", "ground_truth": str(entry["answer"])},
                         "extra_info": extra})
    return rows


def _plain(entry: Any) -> Any:
    """The entry as JSON data (reasoning-gym's metadata may hold tuples, sets or numpy numbers): what does not
    survive JSON is an error naming it, as the reward would otherwise score a changed entry."""
    try:
        text = json.dumps(entry)
    except TypeError as e:
        raise DataError(f"reasoning_gym: an entry of {entry.get('metadata', {}).get('source_dataset')!r} holds data "
                        f"that is not JSON ({e}); it cannot be stored in a row") from None
    return json.loads(text)


def parse_task_config(text: str | None) -> dict[str, dict[str, Any]]:
    """`--config '{"task": {"key": value}}'` -> the mapping (DataError naming what is wrong)."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"reasoning_gym: --config is not JSON: {e}") from None
    if not isinstance(value, dict) or not all(isinstance(v, dict) for v in value.values()):
        raise DataError("reasoning_gym: --config must be a JSON object of task -> {config key: value}")
    return value


__all__ = ["ANSWER_FORMATS", "SOURCE", "import_reasoning_gym", "parse_task_config", "reasoning_gym_rows",
           "system_prompt_text"]
