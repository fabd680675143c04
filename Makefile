# Two entry points, both installing everything they need into .venv first:
#   make test     - the test suite (what CI runs)
#   make test-fast - the in-process tier, tests/unit (under 3 minutes): run it on every change
#   make cifar10  - the CIFAR-10 pipeline example on CPU, 8 ranks (pp=2 x mp=2 x dp=2)
# and more, the same way:
#   make gpt             - the GPT pipeline example on CPU (pp=2): none, non-reentrant, selective, planned
#   make llama           - the Llama pipeline example (transformers' layers) on CPU (pp=2), the same four modes
#   make benchmark       - python -m benchmarks.checkpointing (one stage, every path, beside upstream and torch)
#   make benchmark-pipeline - python -m benchmarks.pipeline --budget 0.3 0.5 0.75 (per stage, in the engine)
#   make benchmark-partition - the planned partition against DeepSpeed's, GPT and Llama at pp=2 and 4 (about 30 min)
#   make benchmark-lengths - variable-length micro-batches: plans per length against one for the longest (encoder, pp=2)
#   make compat          - the unit tests against every supported (DeepSpeed, torch) pair, a venv each (.compat/), and the matrix

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export DS_ACCELERATOR ?= cpu

.PHONY: install test test-fast cifar10 gpt llama benchmark benchmark-pipeline benchmark-partition benchmark-lengths compat

$(STAMP): setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	# Exactly these: they come from the machine's disk; other versions download GBs.
	$(PY) -m pip install torch==2.14.1 torchvision==0.29.1
	$(PY) -m pip install -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest

test-fast: $(STAMP)
	$(PY) -m pytest tests/unit

cifar10: $(STAMP)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" bash examples/cifar10/run_cpu.sh

gpt: $(STAMP)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" bash examples/gpt/run_cpu.sh

llama: $(STAMP)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" bash examples/llama/run_cpu.sh

benchmark: $(STAMP)
	$(PY) -m benchmarks.checkpointing

benchmark-pipeline: $(STAMP)
	$(PY) -m benchmarks.pipeline --budget 0.3 0.5 0.75

benchmark-partition: $(STAMP)
	for model in gpt llama; do \
	  $(PY) -m benchmarks.pipeline --partition planned --model $$model --blocks 16 --vocab 4096 --pp 2 4 \
	    --budget 0.5 0.7 --timed-steps 3 --png partition-$$model.png || exit 1; \
	done

benchmark-lengths: $(STAMP)
	$(PY) -m benchmarks.pipeline --lengths --model encoder --blocks 8 --pp 2 --budget 0.5 0.7 --timed-steps 20

# Not in CI (CI keeps the pinned pair of `make test`): downloads each torch (CUDA builds, ~3.5 GB, run on the CPU).
compat: $(STAMP)
	$(PY) -m pip install -q uv
	$(PY) .ci/compat.py
