#!/usr/bin/env bash
# The Llama example on CPU (transformers' LlamaForCausalLM parts, a small seeded
# LlamaConfig: hidden 64, 4 layers, 4 heads / 2 key-value heads, byte-level
# vocabulary; pp=2; none, non-reentrant, selective, planned under 5 MiB per
# stage; outputs in runs/llama/): examples/run_cpu.sh llama.
#
#   make llama                                           # from the repository root, or:
#   bash examples/llama/run_cpu.sh [more train.py arguments, e.g. --steps 50]
#   OUT_DIR=/tmp/llama bash examples/llama/run_cpu.sh    # outputs elsewhere
set -euo pipefail
exec bash "$(dirname "$0")/../run_cpu.sh" llama "$@"
