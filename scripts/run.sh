#!/usr/bin/env bash
# The main job in one command, on a fresh machine or a set-up one: whatever set-up is missing
# (scripts/ensure_setup.sh), then `agentloop rollout` (the warm-started tiny model using the calculator
# tool on the built-in calculator set; arguments are passed on, e.g. --random-model).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/ensure_setup.sh
exec .venv/bin/agentloop rollout "$@"
