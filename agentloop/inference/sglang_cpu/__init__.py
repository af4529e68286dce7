"""Pure-torch stand-ins for the `sgl_kernel` CPU ops SGLang's CPU engine needs.

PyPI's `sglang-kernel` wheel is CUDA-only: on a machine without libcuda its native
`common_ops` library fails to load, so `import sgl_kernel` fails and SGLang's CPU engine
cannot start. `sgl_kernel` then falls back to a plain `import common_ops`; our `site/`
directory provides that module, which registers (in namespace `sgl_kernel`, with
`torch.library`) the few CPU ops SGLang calls on a model like ours.

Map:
    ops.py              the op implementations and `register()` (idempotent; skips ops already defined)
    seeded_sampling.py  makes `sampling_seed` reproducible on CPU (SGLang ignores it there)
    no_pin.py           pinned host memory is a no-op without CUDA (SGLang's LoRA layers pin index tensors)
    site/common_ops.py  the module sgl_kernel falls back to; importing it calls both
    launch_server.py    `python -m agentloop.inference.sglang_cpu.launch_server <sglang args>`
    zygote.py           the zygote for CPU servers (agentloop.util.zygote): imports SGLang once, forks each CPU
                        server LocalServer asks it for (through agentloop.util.forked)

Every SGLang server process (main, scheduler, detokenizer) imports `sgl_kernel` itself, so
putting `site_dir()` on PYTHONPATH is enough; `launcher.LocalServer` does that for CPU
launches only. We never register `convert_weight_packed`, so SGLang keeps to its native
(non-AMX) torch paths for norms, activations, rotary embedding and linear layers.

Simplified: only ops reached by dense Qwen2-style models with the torch_native attention
backend are provided; others (MoE, mamba, quantized GEMMs, AMX kernels) are not.
"""

from __future__ import annotations

from pathlib import Path

from agentloop.inference.sglang_cpu.ops import OPS, register

__all__ = ["OPS", "register", "site_dir"]


def site_dir() -> Path:
    """The directory to prepend to PYTHONPATH of a CPU SGLang server."""
    return Path(__file__).resolve().parent / "site"
