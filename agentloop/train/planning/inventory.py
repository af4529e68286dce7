"""The machine a run is planned for: the visible GPUs (asked of torch in a short child process, so the orchestrator
never holds a CUDA context), or those cluster.gpu_memory_gib / cluster.num_gpus name.

Map:
    gpu_inventory   the visible GPUs: name, total and free memory
    machine_for     each planned GPU's usable GiB and the machine in words ([]: a CPU run, nothing planned)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from agentloop.config import Config
from agentloop.errors import ConfigError
from agentloop.train.planning import memory as planner

_GPU_PROBE = ("import json, torch\n"
              "n = torch.cuda.device_count() if torch.cuda.is_available() else 0\n"
              "out = []\n"
              "for i in range(n):\n"
              "    free, total = torch.cuda.mem_get_info(i)\n"
              "    out.append({'name': torch.cuda.get_device_name(i), 'free': free, 'total': total})\n"
              "print(json.dumps(out))\n")


def gpu_inventory(timeout_s: float = 120.0, *, dev: Path = Path("/dev")) -> list[dict[str, Any]]:
    """The visible GPUs: [{name, total, free}] in bytes. Empty without a GPU device node in `dev` (then torch is
    not even imported); else asked of torch in a child process, which takes its CUDA contexts with it when it
    exits (the orchestrator never holds one)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return []
    if not any(dev.glob("nvidia[0-9]*")):
        return []
    try:
        out = subprocess.run([sys.executable, "-c", _GPU_PROBE], capture_output=True, text=True, timeout=timeout_s,
                             check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, OSError, ValueError, IndexError) as e:
        raise ConfigError(f"could not read the GPUs' memory (torch.cuda.mem_get_info in a child process): "
                          f"{type(e).__name__}: {e}; set cluster.gpu_memory_gib and cluster.num_gpus to plan without "
                          "reading them") from None


def _on_gpu(device: str, gpus_here: bool, planned: bool) -> bool:
    return device == "cuda" or (device == "auto" and (gpus_here or planned))


def machine_for(cfg: Config, inventory: list[dict[str, Any]], *, dry_run: bool) -> tuple[list[float], str]:
    """Each planned GPU's usable GiB, and the machine in words ([] : a CPU run, nothing planned)."""
    cl = cfg.cluster
    planned = cl.gpu_memory_gib is not None
    servers_gpu = not cfg.server.urls and _on_gpu(cfg.server.device, bool(inventory), planned)
    learner_gpu = _on_gpu(cfg.learner.device, bool(inventory), planned)
    if not (servers_gpu or learner_gpu):
        return [], ""
    if not inventory:
        if not planned:
            raise ConfigError("server.device / learner.device is cuda but no GPU is visible; set "
                              "cluster.gpu_memory_gib (and cluster.num_gpus) to plan for GPUs from this machine with "
                              "--dry-run")
        if not dry_run:
            raise ConfigError(f"cluster.gpu_memory_gib={cl.gpu_memory_gib:g} plans for GPUs, but none is visible "
                              "here: this run would run on CPU. Plan for GPUs with --dry-run, or unset "
                              "cluster.gpu_memory_gib")
        n = cl.num_gpus or 1
        return [float(cl.gpu_memory_gib)] * n, (f"{n} GPU{'s' if n > 1 else ''} of {cl.gpu_memory_gib:g} GiB "
                                                "(cluster.gpu_memory_gib; none visible here)")
    n = cl.num_gpus or len(inventory)
    if n > len(inventory):
        if not dry_run:
            raise ConfigError(f"cluster.num_gpus={n} but {len(inventory)} GPU(s) are visible; plan for more with "
                              "--dry-run only")
        inventory = inventory + [inventory[-1]] * (n - len(inventory))
    gib = [float(cl.gpu_memory_gib) if planned else g["free"] / planner.GIB for g in inventory[:n]]
    names = Counter(g["name"] for g in inventory[:n])
    what = ", ".join(f"{c} x {name}" for name, c in names.items())
    size = f"{cl.gpu_memory_gib:g} GiB each (cluster.gpu_memory_gib)" if planned else \
        "free: " + ", ".join(f"{x:.1f}" for x in gib) + " GiB"
    return gib, f"{what}, {size}"


__all__ = ["gpu_inventory", "machine_for"]
