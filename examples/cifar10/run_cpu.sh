#!/usr/bin/env bash
# The CIFAR-10 example on CPU: 8 ranks as pp=2 x mp=2 x dp=2, generated
# CIFAR-10-format data (no download needed), 100 steps without activation
# checkpointing and 100 with non-reentrant checkpointing, from the same initial
# weights and data order. Outputs in runs/cifar10/: loss.csv, loss.png, summary.json.
#
#   make cifar10                       # from the repository root, or:
#   bash examples/cifar10/run_cpu.sh [more train.py arguments, e.g. --steps 50]
#   bash examples/cifar10/run_cpu.sh --model resnet   # the ResNet (BatchNorm) instead of the AlexNet
#
# Needs python, deepspeed, torchvision, matplotlib and tqdm on PATH (make puts
# the project's .venv first).
set -euo pipefail
cd "$(dirname "$0")/../.."

export DS_ACCELERATOR=cpu
# 8 ranks share the machine's cores: one thread each.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
out_dir=runs/cifar10
port=$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')

deepspeed --num_gpus 8 --master_port "$port" examples/cifar10/train.py \
    --pp 2 --mp 2 --steps 100 --out-dir "$out_dir" \
    --deepspeed_config examples/cifar10/configs/none.json examples/cifar10/configs/non_reentrant.json \
    "$@"

if [[ ! -s "$out_dir/loss.png" ]]; then
    echo "run_cpu.sh: training finished but $out_dir/loss.png was not written" >&2
    exit 1
fi
echo "run_cpu.sh: loss curve in $out_dir/loss.png"
