#!/usr/bin/env bash
# Every GPU check of ds_pipe_ckpt in one call, for a single-GPU machine with
# CUDA (nvcc), a CUDA build of PyTorch and a host C++ compiler, without network
# access. On this project's lent GPU machine, after `bash tests/gpu/prepare_wheels.sh`
# here (DeepSpeed and what the machine lacks for it, as wheels in .whl/):
#
#     run(command="bash tests/gpu/run.sh", carry=[".whl"], timeout_s=540)
#
# Elsewhere: `bash tests/gpu/run.sh` from anywhere (DeepSpeed installed, or .whl/).
#
# Steps, each under its own time limit (seconds), all of them under 8 minutes:
#  1. setup (60): installs .whl/*.whl into /tmp/site (if .whl/ exists) and checks
#     that DeepSpeed's requirements are all met there (tests/gpu/wheels.py --installed);
#  2. build (120): builds csrc/ for the visible GPU (into $DS_PIPE_CKPT_OPS_CACHE,
#     default .cache/ops; a rerun reuses the build);
#  3. kernels (75): tests/gpu/test_kernels_gpu.py (bit-exact against the fallback,
#     a checkpointed segment through the ops);
#  4. ops-throughput (60): pack/unpack against a device-to-device copy;
#  5. engine (120): tests/gpu/engine_checks.py, DeepSpeed's engine at pp=1 (nccl)
#     under the planner (max_memory_mb "auto", a tight memory_budget_mb checked
#     against every planned step's torch.cuda.max_memory_allocated, bf16) and
#     selective checkpointing, losses against the runs without checkpointing;
#  6. benchmark (100): python -m benchmarks.checkpointing on CUDA, ours beside
#     torch's and DeepSpeed's checkpoints (--preset gpu, 5 timed rounds).
# Steps 5 and 6 are skipped when DeepSpeed cannot be imported. A step gets at
# most what is left of the 8 minutes. A summary table comes last.
#
# Results: the logs and JSON of every step, and summary.md, under $OUT when it
# is set (8 files, flat), else under runs/gpu/.
set -uo pipefail
cd "$(dirname "$0")/../.."
REPO="$PWD"
RESULTS="${OUT:-$REPO/runs/gpu}"
mkdir -p "$RESULTS"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export DS_PIPE_CKPT_OPS_CACHE="${DS_PIPE_CKPT_OPS_CACHE:-$REPO/.cache/ops}"
export MAX_JOBS="${MAX_JOBS:-8}"
# One rank of DeepSpeed's engine (steps 5 and 6 start their own ranks where they need more).
export RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT="${MASTER_PORT:-29517}"
export CUBLAS_WORKSPACE_CONFIG="${CUBLAS_WORKSPACE_CONFIG:-:4096:8}"  # cuBLAS's own results reproducible
PYTHON="${PYTHON:-$(command -v python3 || command -v python)}"

DEADLINE=470  # seconds: the whole script stays under 8 minutes
SUMMARY=()
status=0

# run_step NAME LIMIT LOG COMMAND...: COMMAND under `timeout` (LIMIT, or what is
# left of DEADLINE if less), its output shown and appended to LOG; one summary row.
run_step() {
    local name=$1 limit=$2 log=$3
    shift 3
    local left=$((DEADLINE - SECONDS))
    ((limit > left)) && limit=$left
    if ((limit < 15)); then
        SUMMARY+=("| $name | SKIP | 0 | no time left of the ${DEADLINE} s |")
        status=1
        return 1
    fi
    echo "== $name (limit ${limit} s)" | tee -a "$log"
    local started=$SECONDS rc
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$log"
    rc=${PIPESTATUS[0]}
    local result=PASS note=""
    if ((rc == 124 || rc == 137)); then
        result=FAIL note="timed out after ${limit} s"
    elif ((rc != 0)); then
        result=FAIL note="exit status $rc"
    fi
    [[ $result == FAIL ]] && status=1
    SUMMARY+=("| $name | $result | $((SECONDS - started)) | ${note:+$note; }$(basename "$log") |")
    [[ $result == PASS ]]
}

skip_step() {  # skip_step NAME REASON
    SUMMARY+=("| $1 | SKIP | 0 | $2 |")
    status=1
}

SETUP_LOG="$RESULTS/setup.log"
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || echo "nvidia-smi not available"
    "$PYTHON" -c 'import sys, torch; print(f"Python {sys.version.split()[0]}, torch {torch.__version__}, CUDA {torch.version.cuda}, GPU visible: {torch.cuda.is_available()}")'
} 2>&1 | tee "$SETUP_LOG"

setup() {
    if [[ -d .whl ]]; then
        ls -l .whl
        "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .whl/*.whl || return 1
    fi
    "$PYTHON" tests/gpu/wheels.py --installed
}
[[ -d .whl ]] && export PYTHONPATH="/tmp/site:$PYTHONPATH"
export -f setup
export PYTHON
DEEPSPEED=0
run_step setup 60 "$SETUP_LOG" bash -c setup && DEEPSPEED=1

BUILD_OK=0
run_step build 120 "$SETUP_LOG" "$PYTHON" - <<'PY' && BUILD_OK=1
import sys, time
sys.path.insert(0, "tests/gpu")
from standalone import import_modules
(op_builder,) = import_modules("placement.op_builder")
started = time.perf_counter()
cached = op_builder.cached_library() is not None
library = op_builder.build()
print(f"{'cached' if cached else 'built'} {library} in {time.perf_counter() - started:.1f} s")
PY

if ((BUILD_OK)); then
    run_step kernels 75 "$RESULTS/kernels.log" "$PYTHON" tests/gpu/test_kernels_gpu.py
    run_step ops-throughput 60 "$RESULTS/ops_throughput.log" "$PYTHON" tests/gpu/bench.py
else
    skip_step kernels "the build failed"
    skip_step ops-throughput "the build failed"
fi

if ((DEEPSPEED)); then
    run_step engine 120 "$RESULTS/engine.log" "$PYTHON" tests/gpu/engine_checks.py --json "$RESULTS/engine.json"
    run_step benchmark 100 "$RESULTS/checkpointing.log" "$PYTHON" -m benchmarks.checkpointing --device cuda \
        --preset gpu --repetitions 5 --workloads gpt_stage alexnet_stage \
        --variants none torch_non_reentrant deepspeed_reentrant deepspeed_non_reentrant ours_non_reentrant \
        ours_selective --json "$RESULTS/checkpointing.json"
else
    skip_step engine "DeepSpeed is not importable (setup failed; see setup.log)"
    skip_step benchmark "DeepSpeed is not importable (setup failed; see setup.log)"
fi

{
    echo
    echo "## GPU checks: $(date -u +%Y-%m-%dT%H:%M:%SZ), total ${SECONDS} s"
    echo
    echo "| step | result | seconds | note, log |"
    echo "|---|---|---:|---|"
    printf '%s\n' "${SUMMARY[@]}"
    if [[ -f "$RESULTS/engine.json" ]]; then
        echo
        "$PYTHON" -c 'import json, sys
for c in json.load(open(sys.argv[1]))["checks"]:
    print(f"engine: {c[\"name\"]}: {\"PASS\" if c[\"passed\"] else \"FAIL\"}")' "$RESULTS/engine.json"
    fi
    echo
    echo "results in $RESULTS; exit status $status"
} | tee "$RESULTS/summary.md"
exit $status
