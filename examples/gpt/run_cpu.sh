#!/usr/bin/env bash
# The GPT example on CPU (pp=2; none, non-reentrant, selective, planned under
# 5 MiB per stage; outputs in runs/gpt/): examples/run_cpu.sh gpt.
#
#   make gpt                                           # from the repository root, or:
#   bash examples/gpt/run_cpu.sh [more train.py arguments, e.g. --steps 50]
#   OUT_DIR=/tmp/gpt bash examples/gpt/run_cpu.sh      # outputs elsewhere
set -euo pipefail
exec bash "$(dirname "$0")/../run_cpu.sh" gpt "$@"
