#!/usr/bin/env bash
# Build the warm start over the renderings real harnesses send (VARIED_SPEC: the Agents SDK's strict schema,
# LangChain's key order, smolagents' system prompt, agentloop's own) on one GPU, measure it per rendering, and
# pack its weights and figures into $OUT/warm_varied.tgz (varied.json, varied_model/: to replace
# agentloop/models/assets/warm_calculator/). Target: T1 accuracy above 0.3 under every rendering
# (by_rendering_T1 in varied.json). From the repo root on the GPU machine (stage first: benchmarks/gpu_stage.sh).
set -u
source benchmarks/gpu_env.sh warm_varied.log
W=/tmp/warm_varied
mkdir -p "$W"
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$W/gpu.txt"
python3 benchmarks/gpu_build_warm.py "$W" varied --export --renderings renderings=varied max_len=2048 \
    n_traces=24576 steps=4500 2>&1 | tail -n 12
sha256sum "$W"/varied_model/*
tar czf "$OUT/warm_varied.tgz" -C "$W" gpu.txt varied.json varied_model
