#!/usr/bin/env bash
# Build the default warm start on one GPU, measure it, and export its weights under $OUT/warm/default_model
# (the artefact shipped as agentloop/assets/warm_calculator/). Variants: add lines like
#   python3 benchmarks/gpu_build_warm.py "$OUT/warm" tf25 tool_fraction=0.25 &
set -u
source .sglang-gpu/install.sh
mkdir -p "$OUT/warm"
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/warm/gpu.txt"
python3 benchmarks/gpu_build_warm.py "$OUT/warm" default --export 2>&1 | tail -n 5
sha256sum "$OUT"/warm/default_model/*
