#!/usr/bin/env bash
# Set up what is still missing, and nothing when it is done: runs scripts/setup.sh (the .venv with
# agentloop, sglang and the test tools, then the tiny model) unless .venv already holds a setup made
# from the current pyproject.toml and scripts/setup.sh (their hash is stamped in .venv after a setup
# that finished). Used by scripts/run.sh and scripts/test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
STAMP=.venv/.agentloop-setup
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ -x .venv/bin/python ] && [ -x .venv/bin/agentloop ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$want" ]; then
    exit 0
fi
echo "setup: .venv is missing or older than pyproject.toml / scripts/setup.sh; running scripts/setup.sh" >&2
bash scripts/setup.sh
echo "$want" > "$STAMP"
