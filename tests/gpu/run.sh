#!/usr/bin/env bash
# GPU checks of ds_pipe_ckpt's pack/unpack ops, for a single-GPU machine with
# CUDA (nvcc), a CUDA build of PyTorch and a host C++ compiler; DeepSpeed,
# pytest, ninja and network access are not needed. Run from anywhere:
#
#     bash tests/gpu/run.sh
#
# 1. builds csrc/ for the visible GPU (into $DS_PIPE_CKPT_OPS_CACHE, default
#    .cache/ops in the repository; a rerun reuses the build),
# 2. runs tests/gpu/test_kernels_gpu.py (bit-exact against the fallback, a
#    checkpointed segment through the ops),
# 3. measures pack/unpack throughput against a device-to-device copy and
#    prints the table last.
#
# Each step has its own time limit; the whole script stays under 5 minutes.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export DS_PIPE_CKPT_OPS_CACHE="${DS_PIPE_CKPT_OPS_CACHE:-$PWD/.cache/ops}"
export MAX_JOBS="${MAX_JOBS:-8}"
PYTHON="${PYTHON:-$(command -v python3 || command -v python)}"

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || echo "nvidia-smi not available"
"$PYTHON" - <<'PY' || exit 1
import torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, GPU visible: {torch.cuda.is_available()}")
PY

status=0
echo "== build"
SECONDS=0
timeout 150 "$PYTHON" - <<'PY' || { echo "build FAILED"; exit 1; }
import sys, time
sys.path.insert(0, "tests/gpu")
from standalone import import_modules
(op_builder,) = import_modules("op_builder")
started = time.perf_counter()
cached = op_builder.cached_library() is not None
library = op_builder.build()
print(f"{'cached' if cached else 'built'} {library} in {time.perf_counter() - started:.1f} s")
PY

echo "== tests"
timeout 90 "$PYTHON" tests/gpu/test_kernels_gpu.py || { echo "tests FAILED or timed out"; status=1; }

echo "== throughput"
timeout 90 "$PYTHON" tests/gpu/bench.py || { echo "benchmark FAILED or timed out"; status=1; }
echo "total ${SECONDS} s"
exit $status
