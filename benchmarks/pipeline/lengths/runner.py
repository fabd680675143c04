"""``python -m benchmarks.pipeline --lengths --budget F [F ...]``: budgets with
variable-length micro-batches (``PipelineModule(dynamic_shape=True)``, issue 23):
the planner's plan per length (``adaptive``) against one plan made for the
longest micro-batch (``static``) and the best uniform interval that fits at the
longest (``uniform_best``).

Per pipeline depth, one launch (:mod:`benchmarks.pipeline.lengths.rank`) runs:

1. At the maximum length (the model's context), ``none`` (no checkpointing)
   and every uniform ``activation_checkpoint_interval`` k (non-reentrant): one
   warm-up and one measured step each, then :data:`SELECTION_STEPS` timed
   steps each, round-robin. Each stage's budget at fraction F is F x its
   ``none`` peak; ``uniform_best`` is the fastest of them whose peak fits
   every stage's budget (:func:`benchmarks.pipeline.budget.uniform_best`).
2. On one seeded schedule of micro-batch lengths drawn uniformly between a
   quarter of the maximum and the maximum (:func:`length_schedule`), the same
   for every configuration: ``none``, each distinct ``uniform_best``, and per
   F ``adaptive`` (``memory_budget_mb`` and ``max_sequence_length``, the default
   ``length_buckets``) and ``static`` (the same with ``"length_buckets": 1``).
   Each runs the warm-up steps (the planner's own first steps, possible
   plans made again and its checks of each length bucket:
   :data:`LENGTH_WARMUP_STEPS`),
   then the measured steps (each stage's peak around ``train_batch``), then
   the timed steps, round-robin across the configurations, without the
   profiler.

A planned configuration's step peaks also include the steps the planner
measures itself: step 0 (less what it allocates once, the optimizer's
state), the measuring step and every planned step it checks.

It starts no ranks (:mod:`benchmarks.pipeline.runner` passes the launch in)
and prints nothing.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import Callable, Mapping

from ds_pipe_ckpt.testing import RankFailure

from ds_pipe_ckpt.config import LENGTH_BUCKETS

from ..budget import PLANNED_WARMUP_STEPS, planned_mode
from ..modes import PipelineMode, merge_config

__all__ = ["ADAPTIVE", "STATIC", "NONE", "UNIFORM_BEST", "MEASURED_STEPS", "SELECTION_STEPS", "LENGTH_WARMUP_STEPS",
           "LengthSchedule",
           "length_schedule", "adaptive_mode", "static_mode", "length_records", "LengthLauncher"]

ADAPTIVE, STATIC, NONE, UNIFORM_BEST = "adaptive", "static", "none", "uniform_best"
# Variable-length steps measured per configuration (under the profiler, slower).
MEASURED_STEPS = 4
# Timed steps at the maximum length per uniform interval, to pick the fastest that fits.
SELECTION_STEPS = 2
LENGTH_SEED = 0
# The planner checks (profiles, on CPU) at most one step per length bucket besides
# its own first steps and calibrations: all of them in the warm-up, none in the
# measured or timed steps.
LENGTH_WARMUP_STEPS = PLANNED_WARMUP_STEPS + LENGTH_BUCKETS

# Runs one launch at pipeline depth pp on a schedule; returns every rank's records; raises RankFailure.
LengthLauncher = Callable[[int, "LengthSchedule"], list[dict]]


@dataclass(frozen=True)
class LengthSchedule:
    """Micro-batch lengths, step by step (each step a tuple of one length per
    micro-batch): the warm-up, measured and timed steps every configuration
    runs, in that order."""

    max_length: int
    warmup: tuple[tuple[int, ...], ...]
    measured: tuple[tuple[int, ...], ...]
    timed: tuple[tuple[int, ...], ...]

    @property
    def min_length(self) -> int:
        """The shortest length drawn: a quarter of the maximum, rounded up."""
        return -(-self.max_length // 4)

    @property
    def steps(self) -> tuple[tuple[int, ...], ...]:
        return self.warmup + self.measured + self.timed


def length_schedule(max_length: int, micro_batches: int, timed: int, measured: int = MEASURED_STEPS,
                    warmup: int = LENGTH_WARMUP_STEPS, seed: int = LENGTH_SEED) -> LengthSchedule:
    """``warmup + measured + timed`` steps of ``micro_batches`` lengths each,
    drawn uniformly from ``[ceil(max_length / 4), max_length]`` by a generator
    seeded with ``seed``.

    Raises:
        ValueError: a non-positive maximum or micro-batch count, or a negative step count.
    """
    if max_length < 1 or micro_batches < 1:
        raise ValueError(f"max_length = {max_length} and micro_batches = {micro_batches} must be positive")
    if min(warmup, measured, timed) < 0:
        raise ValueError(f"step counts must be >= 0, got warmup {warmup}, measured {measured}, timed {timed}")
    draw = random.Random(seed)
    low = -(-max_length // 4)

    def steps(count: int) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(draw.randint(low, max_length) for _ in range(micro_batches)) for _ in range(count))

    return LengthSchedule(max_length, steps(warmup), steps(measured), steps(timed))


def _length_mode(name: str, budgets_bytes: dict[int, int], fraction: float, max_length: int,
                 buckets: int | None) -> PipelineMode:
    planned = planned_mode(budgets_bytes, fraction)
    section: dict = {"max_sequence_length": max_length}
    if buckets is not None:
        section["length_buckets"] = buckets
    return dataclasses.replace(planned, name=name,
                               config=merge_config(planned.config, {"activation_checkpointing": section}))


def adaptive_mode(budgets_bytes: dict[int, int], fraction: float, max_length: int) -> PipelineMode:
    """The planner under per-stage budgets (bytes, by stage), a plan per length
    bucket (the default ``length_buckets``)."""
    mode = _length_mode(ADAPTIVE, budgets_bytes, fraction, max_length, None)
    return dataclasses.replace(mode, description=f"{mode.description}; a plan per length bucket")


def static_mode(budgets_bytes: dict[int, int], fraction: float, max_length: int) -> PipelineMode:
    """The planner with one plan, made for the longest micro-batch (``"length_buckets": 1``)."""
    mode = _length_mode(STATIC, budgets_bytes, fraction, max_length, 1)
    return dataclasses.replace(mode, description=f"{mode.description}; one plan, for the maximum length")


def length_records(schedules: Mapping[int, LengthSchedule], launch: LengthLauncher,
                   root_error: Callable[[str], str]) -> list[dict]:
    """Every rank's records of one launch per pipeline depth (the keys of
    ``schedules``, each run on its schedule), or one ``{"pp", "record": "launch",
    "unavailable": reason}`` record for a launch that failed."""
    records: list[dict] = []
    for pp, schedule in schedules.items():
        try:
            records += launch(pp, schedule)
        except RankFailure as failure:
            records.append({"pp": pp, "record": "launch", "rank": 0, "unavailable": root_error(str(failure))})
    return records
