#!/usr/bin/env bash
# Build the warm start over the renderings real harnesses send (VARIED_SPEC: the Agents SDK's strict schema,
# LangChain's key order, smolagents' system prompt, agentloop's own) on one GPU, measure it per rendering, and
# export its weights under $OUT/warm/varied_model (to replace agentloop/models/assets/warm_calculator/).
# Target: T1 accuracy above 0.3 under every rendering (by_rendering_T1 in $OUT/warm/varied.json).
set -u
source .sglang-gpu/install.sh
mkdir -p "$OUT/warm"
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/warm/gpu.txt"
python3 benchmarks/gpu_build_warm.py "$OUT/warm" varied --export --renderings renderings=varied max_len=2048 \
    n_traces=24576 steps=4500 2>&1 | tail -n 12
sha256sum "$OUT"/warm/varied_model/*
