"""`python -m agentloop.inference.sglang_cpu.launch_server <sglang.launch_server args>`.

Registers our fallback ops (and the seeded-sampling patch) in this process, then runs SGLang's own launcher unchanged.
Child processes get the ops through `site/common_ops.py` (the caller must put
`agentloop.inference.sglang_cpu.site_dir()` on PYTHONPATH; `launcher.LocalServer` does).
"""

from __future__ import annotations

import runpy
import sys


def main(argv: list[str] | None = None) -> None:
    from agentloop.inference.sglang_cpu.no_pin import install as install_no_pin
    from agentloop.inference.sglang_cpu.ops import register
    from agentloop.inference.sglang_cpu.seeded_sampling import install

    register()
    install()
    install_no_pin()
    sys.argv = ["sglang.launch_server", *(sys.argv[1:] if argv is None else argv)]
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
