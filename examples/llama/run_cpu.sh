#!/usr/bin/env bash
# The Llama example on CPU: transformers' LlamaForCausalLM parts as a DeepSpeed
# pipeline on 2 ranks (pp=2), a small seeded LlamaConfig (hidden 64, 4 layers,
# 4 heads / 2 key-value heads, byte-level vocabulary), byte-level text of
# Python's standard library (no download needed), 200 steps each without
# activation checkpointing, with non-reentrant checkpointing, with selective
# checkpointing and planned under a 5 MiB budget per stage, from the same
# initial weights and data order. Outputs in runs/llama/: loss.csv, loss.png,
# summary.json (with every stage's peak memory).
#
#   make llama                                           # from the repository root, or:
#   bash examples/llama/run_cpu.sh [more train.py arguments, e.g. --steps 50]
#   OUT_DIR=/tmp/llama bash examples/llama/run_cpu.sh    # outputs elsewhere
#
# Needs python, deepspeed, transformers, matplotlib and tqdm on PATH (e.g. the
# project's .venv/bin first).
set -euo pipefail
cd "$(dirname "$0")/../.."

export DS_ACCELERATOR=cpu
# The ranks share the machine's cores: one thread each.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
out_dir="${OUT_DIR:-runs/llama}"
port=$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')

deepspeed --num_gpus 2 --master_port "$port" examples/llama/train.py \
    --pp 2 --steps 200 --out-dir "$out_dir" \
    --deepspeed_config examples/llama/configs/none.json examples/llama/configs/non_reentrant.json \
        examples/llama/configs/selective.json examples/llama/configs/planned.json \
    "$@"

if [[ ! -s "$out_dir/loss.png" ]]; then
    echo "run_cpu.sh: training finished but $out_dir/loss.png was not written" >&2
    exit 1
fi
echo "run_cpu.sh: loss curve in $out_dir/loss.png"
