#!/usr/bin/env bash
# The tests in one command, on a fresh machine or a set-up one: whatever set-up is missing
# (scripts/ensure_setup.sh), then pytest (arguments are passed on). CI's .ci/run calls this.
# Two pytest-xdist workers, a file each at a time (module fixtures stay shared); AGENTLOOP_TEST_WORKERS sets how
# many, and `-n 0` among the arguments runs in one process (docs/tests.md: why two, on two cores).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/ensure_setup.sh
exec .venv/bin/python -m pytest -n "${AGENTLOOP_TEST_WORKERS:-2}" --dist loadfile "$@"
