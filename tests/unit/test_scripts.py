"""scripts/run.sh and scripts/test.sh: set up what is missing (once), then the job; .ci/run lints, then calls test.sh.

Run in a copy of the scripts with a stand-in setup.sh, so nothing here installs anything.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

FAKE_SETUP = """#!/usr/bin/env bash
set -euo pipefail
cd "$(dirname "$0")/.."
echo ran >> setup_runs
mkdir -p .venv/bin
printf '#!/bin/sh\\necho "AGENTLOOP $*"\\n' > .venv/bin/agentloop
printf '#!/bin/sh\\necho "PYTHON $*"\\n' > .venv/bin/python
chmod +x .venv/bin/agentloop .venv/bin/python
"""


def _repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    (repo / ".ci").mkdir()
    for name in ("run.sh", "test.sh", "ensure_setup.sh"):
        shutil.copy(ROOT / "scripts" / name, repo / "scripts" / name)
    shutil.copy(ROOT / ".ci" / "run", repo / ".ci" / "run")
    (repo / "scripts" / "setup.sh").write_text(FAKE_SETUP)
    (repo / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    return repo


def _runs(repo: Path) -> int:
    f = repo / "setup_runs"
    return len(f.read_text().splitlines()) if f.exists() else 0


def test_run_and_test_set_up_once_then_only_run(tmp_path):
    repo = _repo(tmp_path)
    out = subprocess.run(["bash", "scripts/run.sh", "--random-model"], cwd=repo, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "AGENTLOOP rollout --random-model" and _runs(repo) == 1
    out = subprocess.run(["bash", "scripts/test.sh", "-x"], cwd=repo, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "PYTHON -m pytest -n 2 --dist loadfile -x" and _runs(repo) == 1  # set up: no more
    out = subprocess.run(["bash", ".ci/run"], cwd=repo, capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[:2] == ["PYTHON -m ruff check .", "PYTHON -m pytest -n 2 --dist loadfile"]
    assert _runs(repo) == 1
    # a changed pyproject.toml or setup.sh means the setup is stale: it runs again, once
    (repo / "pyproject.toml").write_text("[project]\nname = 'y'\n")
    subprocess.run(["bash", "scripts/test.sh"], cwd=repo, capture_output=True, check=True)
    subprocess.run(["bash", "scripts/run.sh"], cwd=repo, capture_output=True, check=True)
    assert _runs(repo) == 2


def test_a_failed_setup_is_not_stamped(tmp_path):
    repo = _repo(tmp_path)
    (repo / "scripts" / "setup.sh").write_text(FAKE_SETUP.replace("chmod +x", "exit 3; chmod +x"))
    assert subprocess.run(["bash", "scripts/run.sh"], cwd=repo, capture_output=True).returncode == 3
    assert not (repo / ".venv" / ".agentloop-setup").exists()
