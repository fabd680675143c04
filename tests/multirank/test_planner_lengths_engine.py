"""Memory budgets with micro-batches of variable length
(``PipelineModule(dynamic_shape=True)``, ``activation_checkpointing.max_sequence_length``)
under DeepSpeed's pipeline engine, pp=2, 4 micro-batches per step.

The budget of each stage is 0.8 x its peak without checkpointing on a step of
micro-batches of the maximum length. Every step is measured on every stage,
step 0 (before any plan; less the optimizer state it allocates once, which
the plan table reports) and the planner's measuring step included, with the
lengths changing between steps and within them in both orders (short ones
first and the longest last is the hard one under 1F1B): no step exceeds its
budget, and the losses are those of training without checkpointing, bit for
bit, whichever micro-batch of the measuring step comes first.

A drawn schedule and budget (between 0.5 and 0.9 x that peak; the property
test over many draws runs in one process, tests/unit/test_planner_length_schedules.py):
the budget is planned and kept on every step, or refused at a step's start,
on every rank, with the smallest budget that fits named above it.
"""

import random
import re

import pytest

import length_jobs
from ds_pipe_ckpt.planning.plan import Decision
from ds_pipe_ckpt.testing import run_ranks


MAX_LENGTH = 64


FRACTION = 0.8


SCHEDULES = {
    # Measured on short micro-batches; then each step goes from short to the longest.
    "short_then_long": [[32] * 4] * 4 + [[16, 32, 48, 64]] * 3,
    # Measured on the longest; then from the longest to short, then short only.
    "long_then_short": [[64] * 4] * 2 + [[64, 48, 32, 16]] * 2 + [[16] * 4] * 3,
    # Lengths 1..64 mixed inside every step, the measuring step's first micro-batch
    # short (9) and others long (61, 34); all 64 for the first time late.
    "mixed_inside_steps": [[31, 17, 48, 61], [9, 2, 61, 34], [30, 25, 61, 61], [51, 20, 30, 20], [64] * 4,
                           [64, 1, 64, 1], [40] * 4],
    # The measuring step's first micro-batch the longest (63), the others shorter.
    "longest_measured_first": [[50, 54, 6, 34], [63, 52, 39, 62], [46, 28, 18, 37], [18, 13, 33, 19], [64] * 4,
                               [61, 13, 46, 56]],
    # Transformers' Llama: measured on short ones, then every order.
    "mixed": [[64] * 4, [32] * 4, [16, 32, 48, 64], [64, 48, 32, 16], [16] * 4, [64, 16, 64, 16], [40] * 4],
}


@pytest.fixture(scope="module", params=[("encoder", "short_then_long"), ("encoder", "long_then_short"),
                                        ("encoder", "mixed_inside_steps"), ("encoder", "longest_measured_first"),
                                        ("llama", "mixed")], ids=lambda p: "-".join(p))
def run(request):
    model, schedule = request.param
    return run_ranks(length_jobs.train_variable_lengths, 2, model, SCHEDULES[schedule], FRACTION, MAX_LENGTH,
                     timeout=600)


def test_no_step_of_any_stage_exceeds_its_budget(run):
    for stage in run:
        assert stage["refused"] is None, stage["refused"]
        assert None not in stage["step_peaks"], stage["step_peaks"]
        over = [(step, peak) for step, peak in enumerate(stage["step_peaks"]) if peak > stage["budget_bytes"]]
        assert not over, (stage["stage"], stage["budget_bytes"], over, stage["table"])
        assert stage["bound_bytes"] <= stage["budget_bytes"]
        # A first planned step above its prediction is planned again once, from the step after it.
        assert len(stage["earlier_checks"]) <= 1, stage["warnings"]


def test_the_first_step_reports_what_it_allocates_once(run):
    """Step 0 (no plan yet) allocates Adam's state: measured apart, and named in the plan table."""
    for stage in run:
        peak, kept = stage["first_step"]
        assert 0 < kept < peak
        assert "stayed allocated: memory allocated once, in the first step" in stage["table"]


def test_the_losses_are_those_without_checkpointing(run):
    assert run[1]["losses"] == run[1]["none_losses"]


def test_shorter_micro_batches_store_more(run):
    """Each length is planned at its own size: the shortest stores everything,
    the longest checkpoints something (0.8 x the peak at the maximum)."""
    for stage in run:
        plans = stage["plans"]
        assert set(plans[min(plans)]) == {Decision.STORE.value}, stage["table"]
        assert set(plans[MAX_LENGTH]) != {Decision.STORE.value}, stage["table"]
        assert "Any mix of lengths in flight peaks at most at" in stage["table"]


def test_a_micro_batch_over_the_maximum_is_named_before_its_forward():
    outcome, = run_ranks(length_jobs.oversized_micro_batch, 1, 32, 40, timeout=300)
    assert outcome["message"].startswith(
        "activation_checkpointing.max_sequence_length = 32 is invalid: expected at least the length of every "
        "micro-batch: pipeline stage 0 (micro-batch ")
    assert "received one of 40 along dimension 1" in outcome["message"]
    assert outcome["parameters_unchanged"]



def _drawn_schedule(seed: int) -> tuple[list[list[int]], float]:
    """Six steps of four lengths drawn from 1..MAX_LENGTH and a budget fraction
    from 0.5 to 0.9, by a seeded generator (each draw is a 2-rank launch that
    trains two engines: one, fixed, so that a failure reproduces)."""
    draw = random.Random(seed)
    return [[draw.randint(1, MAX_LENGTH) for _ in range(4)] for _ in range(6)], draw.uniform(0.5, 0.9)


def test_a_drawn_length_schedule_keeps_the_budget_or_is_refused_before_a_step_breaks_it():
    schedule, fraction = _drawn_schedule(35)
    stages = run_ranks(length_jobs.train_variable_lengths, 2, "encoder", schedule, fraction, MAX_LENGTH, timeout=600)
    refusals = {stage["refused"] is None for stage in stages}
    assert len(refusals) == 1, [stage["refused"] for stage in stages]  # every rank, or none
    for stage in stages:
        over = [(step, peak) for step, peak in enumerate(stage["step_peaks"])
                if peak is not None and peak > stage["budget_bytes"]]
        assert not over, (schedule, fraction, stage["stage"], stage["budget_bytes"], over, stage.get("table"))
        if stage["refused"] is not None:  # the refusing stage's budget and the smallest that fits it, named
            configured, smallest = re.search(r"memory_budget_mb = ([0-9.]+) is invalid: expected at least "
                                             r"([0-9.]+) MiB", stage["refused"]).groups()
            assert float(smallest) > float(configured), stage["refused"]
    assert stages[1]["losses"] == stages[1]["none_losses"][:len(stages[1]["losses"])]
