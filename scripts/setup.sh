#!/usr/bin/env bash
# One-command setup on a fresh machine: a virtualenv in .venv with agentloop, sglang 0.5.23
# (CPU engine usable; torch comes with it), Ray (the ray extra: cluster.backend=ray and its tests), the
# test tools (pytest, ruff), verl 0.9.1 for the verl parity tests and the environment libraries (the envs extra:
# reasoning-gym, TextArena, openenv-core), then the tiny model built once. verifiers gets a virtualenv of its own,
# built by its tests on first use (`agentloop envs setup verifiers`, cached in ~/.cache/agentloop/env-venvs).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

# sglang brings torch and its CUDA libraries: ~11 GB in .venv. Fail before installing, naming the
# shortfall, rather than halfway through pip with "No space left on device".
NEED_GB=${AGENTLOOP_SETUP_NEED_GB:-13}
if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c "import sglang" 2>/dev/null; then
    free_kb=$(df -Pk . | awk 'NR==2 {print $4}')
    if [ "$free_kb" -lt $((NEED_GB * 1024 * 1024)) ]; then
        echo "setup: only $((free_kb / 1024 / 1024)) GB free on $(df -P . | awk 'NR==2 {print $6}');" \
             "installing sglang + torch into .venv needs about ${NEED_GB} GB." >&2
        exit 1
    fi
fi

# bubblewrap: the python tool's and the code reward's sandbox backend (tools.python.backend=auto picks it).
# Fail soft: without it, root gets the builtin backend; not root gets no isolation (train then refuses).
if ! command -v bwrap >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        if DEBIAN_FRONTEND=noninteractive apt-get install -y -q bubblewrap >/dev/null 2>&1 \
           || { apt-get update -q >/dev/null 2>&1 \
                && DEBIAN_FRONTEND=noninteractive apt-get install -y -q bubblewrap >/dev/null 2>&1; }; then
            echo "setup: installed bubblewrap ($(command -v bwrap))"
        else
            echo "setup: could not install bubblewrap; the sandbox uses its builtin backend (needs root)" >&2
        fi
    else
        echo "setup: bubblewrap not found (apt-get install bubblewrap as root); the sandbox falls back" \
             "to its builtin backend (root) or runs unisolated" >&2
    fi
fi

if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
# --no-cache-dir: a wheel cache would hold a second copy of several GB of wheels.
.venv/bin/python -m pip install -q --no-cache-dir --upgrade pip
.venv/bin/python -m pip install -q --no-cache-dir -e ".[sglang,dev,ray,verl-parity,envs,tinker]"
# verl 0.9.1 for tests/unit/train/test_verl_parity.py (its own functions against ours): without its dependencies,
# whose pins would fight sglang's; the verl-parity extra above holds the few its imports need
.venv/bin/python -m pip install -q --no-cache-dir --no-deps "verl==0.9.1"
# tinker-cookbook for the Tinker service's tests (its recipes run unchanged against `agentloop tinker serve`): without
# its dependencies, as tml-renderers>=0.4.1 is not on PyPI (only its audio recipes use it); the tinker extra above
# holds the rest of what it needs
.venv/bin/python -m pip install -q --no-cache-dir --no-deps "tinker-cookbook==0.6.1"
.venv/bin/python -c "import sglang, torch, ray, agentloop; print('agentloop', agentloop.__version__, '| sglang', sglang.__version__, '| torch', torch.__version__, '| ray', ray.__version__)"
.venv/bin/python -c "import reasoning_gym, textarena, openenv; print('envs: reasoning-gym', reasoning_gym.__version__, '| textarena, openenv-core importable')"
.venv/bin/python -W ignore -c "import verl.trainer.ppo.ray_trainer, verl.workers.utils.losses, verl; print('verl', verl.__version__, '(for the parity tests)')"
.venv/bin/agentloop build-model
