"""Build warm-start variants of the tiny model on a GPU and measure their tool use (one process each).

Usage (on the GPU machine, from the repo root):
    python3 benchmarks/gpu_build_warm.py OUT_DIR NAME [--export] [--renderings] key=value ...
Writes OUT_DIR/NAME/{model files, stats.json}. The spec keys are WarmStartSpec fields. --renderings also measures
the model on the task as each harness renders it (agentloop.models.warmstart.renderings), at T=1.
"""

import json
import os
import shutil
import sys
import time
from pathlib import Path

from agentloop.models.modelzoo import ensure_tiny_model
from agentloop.models.warmstart import (
    WarmStartSpec,
    ensure_warm_model,
    evaluate_tool_use,
)


def main() -> None:
    global kv_flags
    out, name, *kv = sys.argv[1:]
    kv_flags = [a for a in kv if a.startswith("--")]
    kv = [a for a in kv if not a.startswith("--")]
    fields = {}
    for item in kv:
        k, v = item.split("=", 1)
        fields[k] = json.loads(v) if v[:1] in "0123456789.-[{" or v in ("true", "false") else v
    fields.setdefault("device", "cuda")  # device=cpu: the script's own smoke run, small sizes
    spec = WarmStartSpec(**fields)
    dev, n_eval = spec.device, int(os.environ.get("WARM_N_EVAL", "128"))
    cache = Path(out) / "cache"
    base = ensure_tiny_model(cache)
    t0 = time.monotonic()
    model_dir = ensure_warm_model(cache, spec, base_dir=base)
    build_s = time.monotonic() - t0
    stats = {"name": name, "spec": spec.model_dump(mode="json"), "digest": model_dir.name, "base": base.name,
             "build_s": build_s}
    for temp in (1.0, 0.0):
        s = evaluate_tool_use(model_dir, n=n_eval, temperature=temp, device=dev)
        stats[f"T{temp:g}"] = s.model_dump(exclude={"examples"})
        stats[f"T{temp:g}_examples"] = s.examples[:3]
    if "--renderings" in kv_flags:  # the task as each harness renders it (renderings.py), sampled at T=1
        from agentloop.models.warmstart.renderings import renderings

        stats["by_rendering_T1"] = {name: evaluate_tool_use(model_dir, n=n_eval, temperature=1.0, device=dev,
                                                            rendering=name).model_dump(exclude={"examples"})
                                    for name in renderings()}
    (Path(out) / f"{name}.json").write_text(json.dumps(stats, indent=2))
    if len(sys.argv) > 1 and "--export" in kv_flags:
        dest = Path(out) / f"{name}_model"  # two folders down at most: the device returns it
        dest.mkdir(exist_ok=True)
        for f in ("model.safetensors", "config.json", "agentloop_warmstart.json", "generation_config.json"):
            if (model_dir / f).is_file():
                shutil.copyfile(model_dir / f, dest / f)
    print(json.dumps({k: stats[k] for k in ("name", "digest", "build_s")}),
          {t: (round(stats[t]["tool_call_rate"], 3), round(stats[t]["accuracy"], 3)) for t in ("T1", "T0")}, flush=True)
    for name, r in stats.get("by_rendering_T1", {}).items():
        print(f"  {name:<22} T1 tool calls {r['tool_call_rate']:.3f}  accuracy {r['accuracy']:.3f}", flush=True)


if __name__ == "__main__":
    main()
