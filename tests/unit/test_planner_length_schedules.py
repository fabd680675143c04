"""A memory budget is a hard limit on every step, whatever lengths the data
gives: a property test over drawn length schedules and budgets, in one
process (one stage, torch's ``nn.TransformerEncoderLayer`` blocks,
``PipelineModule(dynamic_shape=True)``, Adam), driven as DeepSpeed's engine
drives a stage (forward and backward per micro-batch, then the optimizer step).

Each example draws the micro-batch lengths of every step (1 to
``MAX_LENGTH``: growing, shrinking, mixed inside a step, a length first seen
late) and a budget between 0.35 and 1 x the stage's peak without
checkpointing on a step at ``MAX_LENGTH``. Either the planner refuses the
budget with a ConfigError naming a smallest budget above it, at a step's
start, before any step went over; or every step, the first planned one
included, peaks within the budget. The losses are those of training without
checkpointing, bit for bit. (The same under the engine at pp=2:
``tests/multirank/test_planner_lengths_engine.py``.)
"""

from __future__ import annotations

import functools
import re

import torch
import torch.nn as nn
from deepspeed.runtime.activation_checkpointing import checkpointing as ds_checkpointing
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import ds_pipe_ckpt
from ds_pipe_ckpt import ConfigError
from ds_pipe_ckpt.memory import track_cpu_allocations, track_memory

from stage_steps import train_step

MAX_LENGTH = 32
MICRO_BATCHES = 2
STEPS = 6
WIDTH = 32
MIB = 2**20
# The steps the planner measures itself (it leaves a step someone else profiles alone).
FIRST, MEASURING, FIRST_PLANNED = 0, 1, 2


class MeanOverSequence(nn.Module):
    def forward(self, x):
        return x.mean(dim=1)


def _module() -> ds_pipe_ckpt.PipelineModule:
    torch.manual_seed(0)
    layers = ([nn.Linear(8, WIDTH)]
              + [nn.TransformerEncoderLayer(WIDTH, 4, dim_feedforward=4 * WIDTH, dropout=0.0, batch_first=True)
                 for _ in range(3)]
              + [MeanOverSequence(), nn.Linear(WIDTH, 4)])
    return ds_pipe_ckpt.PipelineModule(layers=layers, num_stages=1, dynamic_shape=True,
                                       activation_checkpoint_func=ds_checkpointing.non_reentrant_checkpoint)


def _steps(schedule: list[list[int]]) -> list[list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(5)
    return [[torch.randn(4, length, 8, generator=generator) for length in step] for step in schedule]


@functools.lru_cache(maxsize=None)
def _peak_without_checkpointing() -> int:
    """The stage's peak on a step of micro-batches ``MAX_LENGTH`` long, no checkpointing (the third step)."""
    ds_pipe_ckpt.configure()
    module = _module()
    optimizer = torch.optim.Adam(module.parameters(), lr=1e-3)
    data = _steps([[MAX_LENGTH] * MICRO_BATCHES] * 3)
    for micro_batches in data[:2]:
        train_step(module, optimizer, micro_batches)
    with track_memory("cpu") as tracker:
        train_step(module, optimizer, data[2])
    return tracker.report.peak_bytes


def _losses_without_checkpointing(schedule) -> list[float]:
    ds_pipe_ckpt.configure()
    module = _module()
    optimizer = torch.optim.Adam(module.parameters(), lr=1e-3)
    return [train_step(module, optimizer, micro_batches) for micro_batches in _steps(schedule)]


def _planned(schedule, budget_bytes):
    """Losses and step peaks under the budget, up to the step the planner refused (and its error)."""
    ds_pipe_ckpt.configure(use_reentrant=False, memory_budget_mb=budget_bytes / MIB)
    module = _module()
    module.enable_planning(budget_bytes, MICRO_BATCHES, max_sequence_length=MAX_LENGTH)
    optimizer = torch.optim.Adam(module.parameters(), lr=1e-3)
    losses, peaks, error = [], [], None
    for step, micro_batches in enumerate(_steps(schedule)):
        try:
            if step in (FIRST, MEASURING, FIRST_PLANNED):
                losses.append(train_step(module, optimizer, micro_batches))
                peaks.append(None)
            else:
                with track_memory("cpu") as tracker:
                    losses.append(train_step(module, optimizer, micro_batches))
                peaks.append(tracker.report.peak_bytes)
        except ConfigError as refused:
            error = refused
            break
    plan = module.checkpoint_plan
    if plan is not None:  # the planner's own figures for the steps it measured
        planner_peaks = [plan.first_step_peak_bytes - plan.first_step_kept_bytes, plan.measuring_step_peak_bytes,
                         plan.measured_peak_bytes if not plan.earlier_checks else plan.earlier_checks[0][1]]
        peaks[:len(planner_peaks)] = planner_peaks[:len(peaks)]
    return losses, peaks, error, plan


lengths = st.integers(min_value=1, max_value=MAX_LENGTH)
schedules = st.lists(st.lists(lengths, min_size=MICRO_BATCHES, max_size=MICRO_BATCHES),
                     min_size=STEPS, max_size=STEPS)


# No shrinking: each example trains two models; a failure prints the schedule and budget as drawn.
@settings(max_examples=5, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate], suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(schedule=schedules, fraction=st.floats(min_value=0.35, max_value=1.0))
def test_no_step_goes_over_the_budget_and_the_losses_are_exact(single_rank_process_group, schedule, fraction):
    track_cpu_allocations()
    budget = int(fraction * _peak_without_checkpointing())
    expected = _losses_without_checkpointing(schedule)
    losses, peaks, error, plan = _planned(schedule, budget)
    try:
        over = [(step, peak) for step, peak in enumerate(peaks) if peak is not None and peak > budget]
        assert not over, (schedule, budget, over, plan.table() if plan else None)
        assert losses == expected[:len(losses)]
        if error is not None:
            smallest = float(re.search(r"at least ([0-9.]+) MiB", str(error)).group(1))
            assert smallest * MIB > budget * 0.999, str(error)
            assert len(losses) >= MEASURING + 1  # refused at a step start once measured, never mid-step
        else:
            assert len(losses) == STEPS
            assert plan.predicted_peak_bytes <= budget
    finally:
        ds_pipe_ckpt.configure()


def test_the_plan_reports_each_buckets_predicted_and_measured_peak(single_rank_process_group):
    """Every bucket a checked step had as its longest shows its measured peak,
    within its predicted one; the others say they were not seen."""
    track_cpu_allocations()
    schedule = [[32, 32], [8, 32], [32, 32], [8, 8], [16, 4], [32, 8], [24, 24], [8, 8]]
    ds_pipe_ckpt.configure(use_reentrant=False, memory_budget_mb=10_000)
    try:
        module = _module()
        module.enable_planning(10_000 * MIB, MICRO_BATCHES, max_sequence_length=MAX_LENGTH)
        optimizer = torch.optim.Adam(module.parameters(), lr=1e-3)
        for micro_batches in _steps(schedule):
            train_step(module, optimizer, micro_batches)
    finally:
        ds_pipe_ckpt.configure()
    plan = module.checkpoint_plan
    measured = plan.measured_by_length
    # Checked from step 2 on, one step per bucket at most, until each was a step's longest.
    assert set(measured) == {32, 8, 16, 24}, measured
    for edge, peak in measured.items():
        assert 0 < peak <= plan.predicted_for(edge), (edge, plan.table())
    assert plan.predicted_for(8) < plan.predicted_for(32) == plan.predicted_peak_bytes
    table = plan.table()
    assert "| predicted peak MiB | measured peak MiB |" in table
    assert f"| {plan.predicted_for(24) / MIB:.2f} | {measured[24] / MIB:.2f} |" in table
    assert table.count("| not seen |") == len(plan.lengths.by_length) - len(measured)
