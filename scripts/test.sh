#!/usr/bin/env bash
# The tests in one command, on a fresh machine or a set-up one: whatever set-up is missing
# (scripts/ensure_setup.sh), then pytest (arguments are passed on). CI's .ci/run calls this.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/ensure_setup.sh
exec .venv/bin/python -m pytest "$@"
