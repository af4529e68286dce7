#!/usr/bin/env bash
# One-command setup on a fresh machine: a virtualenv in .venv with agentloop, sglang 0.5.23
# (CPU engine usable; torch comes with it) and the test tools, then the tiny model built once.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[sglang,dev]"
.venv/bin/python -c "import sglang, torch, agentloop; print('agentloop', agentloop.__version__, '| sglang', sglang.__version__, '| torch', torch.__version__)"
.venv/bin/agentloop build-model
