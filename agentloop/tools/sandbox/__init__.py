"""The sandbox that runs model-written Python: `await run_python(code, limits)`.

    limits.py    SandboxLimits (what a run may use; the `tools.python` config extends it), SandboxResult
    runner.py    the parent side: uid slots, interpreter choice, spawning, output capture, verdicts
    launcher.py  the child side, run as a script: namespaces, read-only mounts, rlimits, then the program

May import: the standard library and pydantic only (the python tool and the code reward build on it).
"""

from agentloop.tools.sandbox.limits import SandboxLimits, SandboxResult
from agentloop.tools.sandbox.runner import loop_semaphore, pick_interpreter, run_python

__all__ = ["SandboxLimits", "SandboxResult", "loop_semaphore", "pick_interpreter", "run_python"]
