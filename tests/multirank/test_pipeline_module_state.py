"""PipelineModule under DeepSpeed's pipeline engine (pp=2, 2 CPU ranks, two
micro-batches in flight): a model with BatchNorm layers trained with
checkpointing in every mode ends with the same running statistics and
``num_batches_tracked`` as the same engine without checkpointing, bit for bit,
as well as the same losses and parameters. (The baseline is built by
``ds_pipe_ckpt.initialize`` too: the gradients of this model exceed DeepSpeed's
default ``gradient_clipping`` of 1.0, which upstream's fp32 path applies with
stage 0's norm only; test_gradient_parity.py compares with the plain model.)

Before ds_pipe_ckpt.module_state, every statistics tensor differed in every
mode (the recomputation updated it a second time).
"""

import pytest
import torch

import pipeline_jobs
from pipeline_jobs import case_params, runnable_cases
from ds_pipe_ckpt.testing import run_ranks

STEPS = 6
BN = {"model": "batchnorm"}
NON_REENTRANT = {**BN, "init": "ours", "use_reentrant": False}
CASES = {
    "none": {**BN, "init": "ours"},
    "reentrant": {**BN, "init": "ours", "config_interval": 1, "use_reentrant": True},
    "non_reentrant": {**NON_REENTRANT, "config_interval": 1},
    "non_reentrant_interval_2": {**NON_REENTRANT, "config_interval": 2},
    "selective": {**NON_REENTRANT, "config_interval": 1, "activation_checkpointing": {"policy": "selective"}},
    "cpu_offloaded": {**NON_REENTRANT, "config_interval": 1,
                      "activation_checkpointing": {"cpu_checkpointing": True}},
    # The planner measures every layer checkpointed, then plans: stage 0 cannot store
    # everything within 0.17 MiB (its smallest budget is 0.15 MiB, measured) and
    # checkpoints some layers; stage 1 stores everything.
    "planned": {**NON_REENTRANT, "config_interval": 0, "activation_checkpointing": {"memory_budget_mb": [0.17, 1.0]}},
}


@pytest.fixture(scope="module")
def runs():
    return run_ranks(pipeline_jobs.train_cases, 2, runnable_cases(CASES), 2, STEPS, timeout=600)


@pytest.mark.parametrize("name", case_params(CASES, [n for n in CASES if n != "none"]))
def test_module_state_equals_training_without_checkpointing(runs, name):
    for rank, result in enumerate(runs):
        ref, got = result["none"], result[name]
        assert got["losses"] == ref["losses"], f"rank {rank}: losses differ from no checkpointing"
        assert ref["buffers"], f"rank {rank} holds no BatchNorm layer"
        differing = [b for b, value in ref["buffers"].items() if not torch.equal(got["buffers"][b], value)]
        assert not differing, f"rank {rank}: buffers {differing} differ from training without checkpointing"
        for pname, value in ref["params"].items():
            assert torch.equal(got["params"][pname], value), f"rank {rank}: parameter {pname} differs"


def test_every_forward_counted_once(runs):
    micro_batches = runs[0]["none"]["micro_batches"]
    for result in runs:
        for name in result:  # the cases DeepSpeed can run here
            counts = {b: v.item() for b, v in result[name]["buffers"].items() if b.endswith("num_batches_tracked")}
            assert counts and set(counts.values()) == {micro_batches}, (name, counts)


def test_the_planned_case_plans(runs):
    assert all(result["planned"]["planned"] for result in runs)
    # Stage 0's plan recomputes some layers, so BatchNorm ran inside a planned recomputation.
    assert "checkpoint" in runs[0]["planned"]["plan_decisions"], runs[0]["planned"]["plan_decisions"]
