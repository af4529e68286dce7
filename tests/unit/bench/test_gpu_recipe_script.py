"""benchmarks/gpu_recipe.sh: valid bash, and its CPU dry run prepares checked data and a valid config."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "benchmarks" / "gpu_recipe.sh"


def test_script_is_valid_bash():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


@pytest.mark.parametrize("recipe", ["search_r1", "countdown"])
def test_dry_run_prepares_data_and_resolves_the_config(recipe, tmp_path):
    env = {**os.environ, "DRY_RUN": "1", "OUT": str(tmp_path), "MODEL": "/models/some-0.5b",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(["bash", str(SCRIPT), recipe], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "0 errors in 0 rows" in proc.stdout and f"agentloop.cli train --config configs/recipe_{recipe}.yaml" in proc.stdout
    cfg = yaml.safe_load((tmp_path / f"config_{recipe}.yaml").read_text())
    assert cfg["data"]["path"] == str(tmp_path / f"data_{recipe}" / "train.parquet")
    assert cfg["data"]["val_path"] == str(tmp_path / f"data_{recipe}" / "test.parquet")
    assert cfg["model"]["path"] == "/models/some-0.5b" and cfg["train"]["steps"] == 3
    if recipe == "search_r1":
        assert cfg["rollout"]["loop"] == "search_r1_agent_loop"
        assert cfg["tools"]["search"]["url"] == "http://127.0.0.1:8765/retrieve"
    else:
        assert cfg["data"]["apply_chat_template"] is False
