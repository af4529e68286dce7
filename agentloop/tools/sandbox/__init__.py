"""The sandbox that runs model-written Python: `await run_python(code, limits)`.

    limits.py    SandboxLimits (what a run may use; the `tools.python` config extends it), SandboxResult
    runner.py    the parent side: run_python / start_python, output capture, kills, verdicts, uid slots
    backends.py  which backend runs here (bwrap, builtin, none), isolation_status / require_isolation
    rootfs.py    the minimal root both isolating backends build (what of the host is visible: almost nothing)
    cgroups.py   per-run memory and pids cgroups (v2, else v1, else rlimits only)
    launcher.py  the child side, run as a script: cgroups, namespaces, the root, then the supervised program

May import: the standard library, pydantic and agentloop.errors (the python tool and the code reward
build on it); launcher.py only the standard library.
"""

from agentloop.tools.sandbox.backends import (
           IsolationStatus,
           isolation_status,
           require_isolation,
)
from agentloop.tools.sandbox.limits import SandboxLimits, SandboxResult
from agentloop.tools.sandbox.runner import (
           SandboxProcess,
           loop_semaphore,
           run_python,
           start_python,
)

__all__ = ["IsolationStatus", "SandboxLimits", "SandboxProcess", "SandboxResult", "isolation_status",
           "loop_semaphore", "require_isolation", "run_python", "start_python"]
