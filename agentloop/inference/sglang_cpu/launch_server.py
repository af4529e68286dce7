"""`python -m agentloop.inference.sglang_cpu.launch_server <sglang.launch_server args>`.

Registers our fallback ops (and the seeded-sampling patch) in this process, then runs SGLang's own launcher unchanged,
but for how it starts its children: forked from this process once it imported their modules, not spawned
(`_fork_children`). A spawned child (the scheduler, the detokenizer) imports sglang again, GPU libraries it cannot use
here included (flashinfer, cutlass, inductor): ~27 s of CPU for the scheduler's modules alone on our 2-core box, at
every server start. Spawned children (SGLang's memory saver asks for them) get the ops through `site/common_ops.py`
(the caller must put `agentloop.inference.sglang_cpu.site_dir()` on PYTHONPATH; `launcher.LocalServer` does).
"""

from __future__ import annotations

import runpy
import sys


def main(argv: list[str] | None = None) -> None:
    prepare("--enable-memory-saver" not in (sys.argv[1:] if argv is None else argv))
    run(sys.argv[1:] if argv is None else argv)


def prepare(fork_children: bool = True) -> None:
    """Everything before SGLang's launcher runs: our ops and patches, and (unless the server's children need a fresh
    process: the memory saver preloads a library) forked children. Idempotent; the zygote
    (agentloop.inference.sglang_cpu.zygote) calls it once for all the servers it forks."""
    from agentloop.inference.sglang_cpu.no_pin import install as install_no_pin
    from agentloop.inference.sglang_cpu.ops import register
    from agentloop.inference.sglang_cpu.seeded_sampling import install
    from agentloop.inference.sglang_fixes import install as install_fixes

    register()
    install()
    install_no_pin()
    install_fixes()
    if fork_children:
        _fork_children()


def run(argv: list[str]) -> None:
    """SGLang's own launcher, unchanged, on `argv` (sglang.launch_server's flags)."""
    sys.argv = ["sglang.launch_server", *argv]
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)


def _fork_children() -> None:
    """SGLang's children are forked once this process imported their modules: SGLang asks for "spawn" (what CUDA
    needs; a CPU server never initializes CUDA), which is turned into "fork". Safe here because nothing ran before
    the fork but imports and the parsing of arguments: no torch parallel region (OpenMP's pool does not survive a
    fork), no ZMQ context (the tokenizer manager makes its own after the children start), no thread."""
    import multiprocessing
    import multiprocessing.context

    import sglang.srt.managers.detokenizer_manager
    import sglang.srt.managers.scheduler  # noqa: F401
    import torch.multiprocessing

    real = multiprocessing.context.DefaultContext.set_start_method

    def set_start_method(self, method, force=False):
        return real(self, "fork" if method == "spawn" else method, force=force)

    multiprocessing.context.DefaultContext.set_start_method = set_start_method
    for mod in (multiprocessing, torch.multiprocessing):
        if getattr(mod, "set_start_method", None) is not None:
            mod.set_start_method = multiprocessing.context._default_context.set_start_method


if __name__ == "__main__":
    main()
