"""The GPU acceptance harness (benchmarks/gpu_acceptance.py) is run only on a GPU machine, where a broken row costs
device time: every `rows.<name>` its parts call must be a method of `Rows` (a helper once ended up nested in another
function and two rows failed with AttributeError on the GPU)."""

from __future__ import annotations

import ast
import importlib.util
import inspect
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _harness():
    spec = importlib.util.spec_from_file_location("gpu_acceptance", ROOT / "benchmarks" / "gpu_acceptance.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gpu_acceptance", mod)  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_every_row_the_parts_call_is_a_method_of_rows():
    mod = _harness()
    tree = ast.parse((ROOT / "benchmarks" / "gpu_acceptance.py").read_text())
    called = {n.attr for n in ast.walk(tree)
              if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "rows"}
    assert {"resume", "interrupt", "capacity", "kill_server", "learner"} <= called
    methods = {name for name, _ in inspect.getmembers(mod.Rows, inspect.isfunction)}
    assert called - methods == set(), f"rows.{sorted(called - methods)} called but not methods of Rows"


def test_each_call_starts_from_an_empty_work_dir(tmp_path):
    """A run dir an earlier call left would be resumed by the next call's `agentloop train --run-dir` (finished,
    so it reports the old run's figures: a second smoke of lora-train-0.5b did); the harness's own work dir is
    emptied, one it did not make is refused."""
    mod = _harness()
    work = tmp_path / "acceptance_one"
    mod._fresh_work(work, default=False)  # new: made and marked
    (work / "lora-train-lora").mkdir()
    (work / "lora-train-lora" / "metrics.jsonl").write_text("{}\n")
    mod._fresh_work(work, default=False)
    assert sorted(p.name for p in work.iterdir()) == [mod.WORK_MARK]
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep")
    with pytest.raises(SystemExit, match="did not write"):
        mod._fresh_work(foreign, default=False)
    assert (foreign / "notes.txt").read_text() == "keep"
    mod._fresh_work(foreign, default=True)  # the harness's default path is its own, mark or not
    assert sorted(p.name for p in foreign.iterdir()) == [mod.WORK_MARK]
