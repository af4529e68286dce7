"""The scale benches through the CLI, small: `agentloop bench rollout --scripted-server` reports, side by side in
one run, engine and bare client with loop lag p50/p99/max, engine/bare and KB per in-flight episode for single-
turn and three-turn tool episodes; `bench cache` shows sticky routing reusing more of the prefix cache;
`bench tools --remote` gives the same records with remote tools as with local ones."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]


def _cli(*args: str, cwd: Path) -> str:
    p = subprocess.run([sys.executable, "-m", "agentloop.cli", *args], cwd=cwd, capture_output=True, text=True,
                       timeout=900, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout


def test_bench_rollout_capacity_side_by_side(tmp_path):
    out = tmp_path / "r.json"
    text = _cli("bench", "rollout", "--scripted-server", "--bench-requests", "0", "--bench-episodes", "40",
                "--bench-rounds", "1", "--bench-waves", "1", "--bench-latency-s", "0.2", "--out", str(out),
                f"run_dir=\"{tmp_path / 'run'}\"", cwd=tmp_path)
    report = json.loads(out.read_text())["capacity"]
    assert set(report["kinds"]) == {"single", "tool"}
    for k in report["kinds"].values():
        med = k["median"]
        assert med["ratio"] > 0
        for side in ("bare", "engine"):
            m = med[side]
            assert m["episodes"] == 40 and m["errors"] == 0 and m["peak_inflight"] > 0
            for key in ("lag_p50_ms", "lag_p99_ms", "lag_max_ms", "kb_per_inflight_episode"):
                assert key in m
    tool = report["kinds"]["tool"]["rounds"][0]["engine"]
    assert tool["turns_per_episode"] == 3.0
    assert "single engine/bare episodes/s" in text and "tool   engine/bare episodes/s" in text
    assert "KB/episode" in text and "lag p50/p99/max ms" in text


def test_bench_cache_sticky_vs_not(tmp_path):
    out = tmp_path / "c.json"
    text = _cli("bench", "cache", "--scripted-server", "--bench-episodes", "80", "--bench-rounds", "1",
                "--bench-latency-s", "0.1", "--out", str(out), f"run_dir=\"{tmp_path / 'run'}\"", cwd=tmp_path)
    med = json.loads(out.read_text())["median"]
    assert med["sticky"]["errors"] == med["not_sticky"]["errors"] == 0
    assert med["sticky"]["hit_rate_later_turns"] >= 0.9
    assert med["sticky"]["hit_rate_later_turns"] > med["not_sticky"]["hit_rate_later_turns"]
    assert "sticky" in text and "not_sticky" in text


def test_bench_tools_remote_same_records(tmp_path):
    out = tmp_path / "t.json"
    text = _cli("bench", "tools", "--remote", "--scripted-server", "--bench-episodes", "40", "--bench-rounds", "1",
                "--bench-latency-s", "0.1", "--out", str(out), f"run_dir=\"{tmp_path / 'run'}\"", cwd=tmp_path)
    report = json.loads(out.read_text())
    assert report["same_records"] is True
    for side in ("local", "remote"):
        assert report["median"][side]["errors"] == 0 and report["median"][side]["tool_errors"] == 0
        assert report["rounds"][0][side]["tool_calls"] == 40 * 2
    assert "remote/local episodes/s" in text
