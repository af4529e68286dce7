"""`agentloop data prepare RECIPE`: the data sets' own files (as users download them) -> verl rows.

    gsm8k       rows {question, answer} (openai/gsm8k's parquet/JSONL) -> verl's GSM8K rows: data_source
                openai/gsm8k, question + " " + verl's instruction, ground truth = the number after the
                answer's FIRST "#### " with commas removed (verl's preprocessing)
    countdown   rows {nums | numbers, target} (Jiayi-Pan/Countdown-Tasks-3to4), or `generate_countdown` ->
                TinyZero's rows: data_source countdown, its base / qwen-instruct prompt (raw text: train with
                data.apply_chat_template=false), ground truth {target, numbers}
    search_r1   rows {question, golden_answers[, data_source]} (FlashRAG / nq_hotpotqa_train) -> Search-R1's
                rows: its prompt, ground truth {target: golden_answers}, data_source nq / hotpotqa / ...
    code        rows {question | prompt, entry_point, tests} (function tests), {question, tests: [{stdin,
                stdout}]}, or APPS-style {question, input_output: '{"inputs": [...], "outputs": [...]}'} ->
                rows of data_source agentloop/code with the python tool enabled

    read_rows / write_rows   a .jsonl / .parquet file <-> plain dicts (written rows are validated first)
    PREPARERS                recipe name -> (rows -> verl rows); `prepare(recipe, rows, ...)` calls one

Every converter raises DataError naming the input row that lacks what it needs.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from agentloop.data.builtin import _countdown_puzzle, _Lcg
from agentloop.data.loader import (
    JSONL_SUFFIXES,
    PARQUET_SUFFIXES,
    parse_row,
    read_jsonl_rows,
    read_parquet_rows,
    to_plain,
)
from agentloop.data.templates import (
    GSM8K_INSTRUCTION,
    countdown_prompt,
    search_r1_prompt,
)
from agentloop.data.tool_demos import CODE_SOURCE, CODE_STDIO_SYSTEM, CODE_SYSTEM
from agentloop.errors import DataError

Row = dict[str, Any]

# ---------------------------------------------------------------- files


def read_rows(path: str | Path) -> Iterator[tuple[str, Row]]:
    """(where, row) of each row of a .jsonl / .json (JSON lines or one array) / .parquet file, as plain Python."""
    p = Path(path)
    suffix = p.suffix.lower()
    if not p.is_file():
        raise DataError(f"{p}: input file does not exist")
    if suffix == ".json" and p.read_text(encoding="utf-8-sig").lstrip().startswith("["):
        reader = _json_array_rows  # a JSON array (`datasets`' to_json writes JSON lines, also as .json)
    elif suffix in JSONL_SUFFIXES or suffix == ".json":
        reader = read_jsonl_rows
    elif suffix in PARQUET_SUFFIXES:
        reader = read_parquet_rows
    else:
        raise DataError(f"{p}: unknown extension {p.suffix!r}; expected .jsonl, .json or .parquet")
    for where, row in reader(p):
        row = to_plain(row)
        if not isinstance(row, dict):
            raise DataError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
        yield where, row


def _json_array_rows(p: Path) -> Iterator[tuple[str, Any]]:
    try:
        rows = json.loads(p.read_text(encoding="utf-8-sig"))
    except json.JSONDecodeError as e:
        raise DataError(f"{p}: invalid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    for i, row in enumerate(rows):
        yield f"{p} item {i}", row


def write_rows(rows: list[Row], path: str | Path) -> Path:
    """Write verl rows as .jsonl or .parquet (each validated as a verl row first); returns the path."""
    p = Path(path)
    if not rows:
        raise DataError(f"{p}: nothing to write (no rows)")
    for i, row in enumerate(rows):
        parse_row(row, i, where=f"{p} row {i}")
    p.parent.mkdir(parents=True, exist_ok=True)
    suffix = p.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        p.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    elif suffix in PARQUET_SUFFIXES:
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            table = pa.Table.from_pylist(rows)
        except (pa.ArrowException, TypeError, ValueError) as e:
            raise DataError(f"{p}: these rows do not fit one Parquet schema ({e}); write .jsonl instead") from None
        pq.write_table(table, p)
    else:
        raise DataError(f"{p}: unknown extension {p.suffix!r}; write .jsonl or .parquet")
    return p


def _field(row: Row, where: str, *names: str, kind: type | tuple[type, ...] = str) -> Any:
    for n in names:
        if n in row and row[n] is not None:
            v = row[n]
            if not isinstance(v, kind):
                raise DataError(f"{where}: {n!r} must be a {getattr(kind, '__name__', kind)}, got {type(v).__name__}")
            return v
    raise DataError(f"{where}: missing {' or '.join(repr(n) for n in names)} (columns: {sorted(row)})")


# ---------------------------------------------------------------- gsm8k

_GSM8K_ANSWER = re.compile(r"#### (-?[0-9.,]+)")


def gsm8k_ground_truth(answer: str) -> str | None:
    """verl's preprocessing: the FIRST `#### <number>` of the solution, commas removed."""
    m = _GSM8K_ANSWER.search(answer)
    return m.group(1).replace(",", "") if m else None


def prepare_gsm8k(rows: Iterable[tuple[str, Row]], split: str = "train") -> list[Row]:
    """openai/gsm8k rows {question, answer} -> verl's rows (examples/data_preprocess/gsm8k.py)."""
    out = []
    for idx, (where, row) in enumerate(rows):
        question = _field(row, where, "question")
        answer = _field(row, where, "answer")
        truth = gsm8k_ground_truth(answer)
        if truth is None:
            raise DataError(f"{where}: the answer has no '#### <number>' line: {answer[-80:]!r}")
        out.append({
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": question + " " + GSM8K_INSTRUCTION}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": truth},
            "extra_info": {"split": split, "index": idx, "answer": answer, "question": question},
        })
    return out


# ---------------------------------------------------------------- countdown


def _countdown_row(numbers: list[int], target: int, idx: int, split: str, template: str) -> Row:
    return {
        "data_source": "countdown",
        "prompt": [{"role": "user", "content": countdown_prompt(numbers, target, template)}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": {"target": target, "numbers": numbers}},
        "extra_info": {"split": split, "index": idx},
    }


def prepare_countdown(rows: Iterable[tuple[str, Row]], split: str = "train", template: str = "base") -> list[Row]:
    """Countdown-Tasks rows {nums, target} -> TinyZero's rows (examples/data_preprocess/countdown.py)."""
    out = []
    for idx, (where, row) in enumerate(rows):
        nums = _field(row, where, "nums", "numbers", kind=list)
        target = _field(row, where, "target", kind=int)
        if not nums or not all(isinstance(n, int) and not isinstance(n, bool) for n in nums):
            raise DataError(f"{where}: 'nums' must be a non-empty list of integers, got {nums!r}")
        out.append(_countdown_row([int(n) for n in nums], int(target), idx, split, template))
    return out


def generate_countdown(n: int, seed: int = 0, split: str = "train", template: str = "base") -> list[Row]:
    """`n` solvable puzzles from the project's generator (3-4 numbers in 1..50, target 1..999), TinyZero rows."""
    if n < 1:
        raise DataError(f"generate at least one puzzle, got {n}")
    rng = _Lcg(seed)
    rows = []
    for idx in range(n):
        numbers, target, solution = _countdown_puzzle(rng)
        row = _countdown_row(numbers, target, idx, split, template)
        row["extra_info"]["reference_solution"] = solution
        rows.append(row)
    return rows


# ---------------------------------------------------------------- search_r1


def prepare_search_r1(rows: Iterable[tuple[str, Row]], split: str = "train", data_source: str | None = None
                      ) -> list[Row]:
    """FlashRAG rows {question, golden_answers} -> Search-R1's rows (scripts/data_process/nq_search.py).

    data_source: this name for every row, else the row's own `data_source` column (nq_hotpotqa_train has one).
    """
    out = []
    for idx, (where, row) in enumerate(rows):
        question = _field(row, where, "question")
        golden = row.get("golden_answers")
        if golden is None and isinstance(row.get("reward_model"), dict):  # already Search-R1 rows
            golden = (row["reward_model"].get("ground_truth") or {}).get("target")
        if isinstance(golden, str):
            golden = [golden]
        if not isinstance(golden, list) or not golden or not all(isinstance(g, str) for g in golden):
            raise DataError(f"{where}: 'golden_answers' must be a non-empty list of strings, got {golden!r}")
        source = data_source or row.get("data_source")
        if not isinstance(source, str) or not source:
            raise DataError(f"{where}: no data_source: pass --data-source (nq, hotpotqa, ...) or give the rows "
                            "a 'data_source' column")
        out.append({
            "data_source": source,
            "prompt": [{"role": "user", "content": search_r1_prompt(question)}],
            "ability": "fact-reasoning",
            "reward_model": {"style": "rule", "ground_truth": {"target": list(golden)}},
            "extra_info": {"split": split, "index": idx},
        })
    return out


# ---------------------------------------------------------------- code

CODE_STDIO_NOTE = "Read the input from standard input and print the answer to standard output."


def code_ground_truth(row: Row, where: str) -> dict[str, Any]:
    """The reward's ground truth from one code problem row (function tests or stdin/stdout tests)."""
    tests = row.get("tests")
    if isinstance(tests, str):
        try:
            tests = json.loads(tests)
        except json.JSONDecodeError:
            raise DataError(f"{where}: 'tests' is a string but not JSON") from None
    if row.get("entry_point") is not None:
        if not isinstance(row["entry_point"], str) or not isinstance(tests, list) or not tests:
            raise DataError(f"{where}: function problems need a string 'entry_point' and a non-empty list 'tests'")
        return {"entry_point": row["entry_point"], "tests": tests}
    if isinstance(tests, list) and tests:
        io = []
        for i, t in enumerate(tests):
            if not isinstance(t, dict):
                raise DataError(f"{where}: tests[{i}] must be {{stdin, stdout}} (or give an 'entry_point')")
            stdin, stdout = t.get("stdin", t.get("input")), t.get("stdout", t.get("output"))
            if not isinstance(stdin, str) or not isinstance(stdout, str):
                raise DataError(f"{where}: tests[{i}] needs string 'stdin' and 'stdout'")
            io.append({"stdin": stdin, "stdout": stdout})
        return {"tests": io}
    spec = row.get("input_output")
    if spec is not None:
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError:
                raise DataError(f"{where}: 'input_output' is not JSON") from None
        ins, outs = (spec.get("inputs"), spec.get("outputs")) if isinstance(spec, dict) else (None, None)
        if not isinstance(ins, list) or not isinstance(outs, list) or len(ins) != len(outs) or not ins:
            raise DataError(f"{where}: 'input_output' needs equally long non-empty 'inputs' and 'outputs'")
        if spec.get("fn_name"):
            return {"entry_point": spec["fn_name"], "tests": [[a, b] for a, b in zip(ins, outs)]}
        return {"tests": [{"stdin": str(a), "stdout": str(b)} for a, b in zip(ins, outs)]}
    raise DataError(f"{where}: no tests: give 'entry_point' + 'tests', 'tests' as [{{stdin, stdout}}], "
                    "or 'input_output'")


def prepare_code(rows: Iterable[tuple[str, Row]], split: str = "train") -> list[Row]:
    """Code problems with hidden tests -> rows of agentloop/code (python tool on, tests in the ground truth)."""
    out = []
    for idx, (where, row) in enumerate(rows):
        question = _field(row, where, "question", "prompt", "problem")
        truth = code_ground_truth(row, where)
        function = "entry_point" in truth
        text = question if function else f"{question}\n\n{CODE_STDIO_NOTE}"
        system = CODE_SYSTEM if function else CODE_STDIO_SYSTEM
        out.append({
            "data_source": CODE_SOURCE,
            "prompt": [{"role": "system", "content": system}, {"role": "user", "content": text}],
            "ability": "code",
            "reward_model": {"style": "rule", "ground_truth": truth},
            "extra_info": {"split": split, "index": idx, "question": question, "tools_kwargs": {"python": {}}},
        })
    return out


def code_rows_for_parquet(rows: list[Row]) -> list[Row]:
    """Code rows Parquet can hold: the ground truth as a JSON string (test lists mix types, which one Parquet
    schema cannot) and no `{"python": {}}` tools_kwargs (an empty struct; the recipe's `tools.names` offers
    the python tool instead)."""
    out = []
    for r in rows:
        r = dict(r)
        r["reward_model"] = {**r["reward_model"], "ground_truth": json.dumps(r["reward_model"]["ground_truth"])}
        extra = dict(r.get("extra_info") or {})
        kwargs = {k: v for k, v in (extra.pop("tools_kwargs", None) or {}).items() if v}
        if kwargs:
            extra["tools_kwargs"] = kwargs
        r["extra_info"] = extra
        out.append(r)
    return out


PREPARERS: dict[str, Callable[..., list[Row]]] = {
    "gsm8k": prepare_gsm8k,
    "countdown": prepare_countdown,
    "search_r1": prepare_search_r1,
    "code": prepare_code,
}
"""Recipe name -> converter of the data set's own rows."""


def prepare(recipe: str, rows: Iterable[tuple[str, Row]], **options: Any) -> list[Row]:
    """The verl rows of `recipe` from (where, row) pairs; options are the converter's keywords."""
    try:
        fn = PREPARERS[recipe]
    except KeyError:
        raise DataError(f"unknown recipe {recipe!r}; known: {sorted(PREPARERS)}") from None
    out = fn(rows, **options)
    if not out:
        raise DataError(f"{recipe}: the input has no rows")
    return out
