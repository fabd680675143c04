#!/usr/bin/env bash
# A text example (gpt or llama) on CPU: 2 ranks as pp=2, byte-level text of
# Python's standard library (no download needed), 200 steps each without
# activation checkpointing, with non-reentrant checkpointing, with selective
# checkpointing and planned under a 5 MiB budget per stage, from the same
# initial weights and data order. Outputs in runs/MODEL/: loss.csv, loss.png,
# summary.json (with every stage's peak memory).
#
#   bash examples/run_cpu.sh MODEL [more train.py arguments, e.g. --steps 50]
#   OUT_DIR=/tmp/gpt bash examples/run_cpu.sh gpt       # outputs elsewhere
#
# Arguments after MODEL go to examples/MODEL/train.py after the defaults, so a
# --deepspeed_config there replaces the four configs, e.g. variable lengths:
#
#   bash examples/run_cpu.sh gpt --variable-lengths \
#       --deepspeed_config examples/gpt/configs/none.json examples/gpt/configs/variable_lengths.json
#
# Needs python, deepspeed, matplotlib and tqdm on PATH (llama: transformers too;
# e.g. the project's .venv/bin first).
set -euo pipefail
cd "$(dirname "$0")/.."

model="${1:-}"
if [[ "$model" != gpt && "$model" != llama ]]; then
    echo "usage: bash examples/run_cpu.sh gpt|llama [train.py arguments]" >&2
    exit 2
fi
shift
configs="examples/$model/configs"

export DS_ACCELERATOR=cpu
# The ranks share the machine's cores: one thread each.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
out_dir="${OUT_DIR:-runs/$model}"
port=$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')

deepspeed --num_gpus 2 --master_port "$port" "examples/$model/train.py" \
    --pp 2 --steps 200 --out-dir "$out_dir" \
    --deepspeed_config "$configs/none.json" "$configs/non_reentrant.json" "$configs/selective.json" \
        "$configs/planned.json" \
    "$@"

if [[ ! -s "$out_dir/loss.png" ]]; then
    echo "run_cpu.sh: training finished but $out_dir/loss.png was not written" >&2
    exit 1
fi
echo "run_cpu.sh: loss curve in $out_dir/loss.png"
