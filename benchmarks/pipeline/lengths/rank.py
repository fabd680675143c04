"""One rank's side of ``python -m benchmarks.pipeline --lengths``
(:mod:`benchmarks.pipeline.lengths.runner`): every configuration's engine at one
pipeline depth, built with ``PipelineModule(dynamic_shape=True)`` and fed
micro-batches of the schedule's lengths, as fine-tuning pads each micro-batch
to its own longest sample.

Records, this rank's (each with ``record``, ``pp``, ``rank``):

* ``"maximum"``: ``none`` and each uniform interval at the maximum length,
  as :func:`benchmarks.pipeline.report.summarize` reads them (peak, step times);
* ``"choice"`` (rank 0 only): per budget fraction, each stage's budget
  (``budgets_bytes``, stage 0 first) and the ``uniform_best`` mode, or None;
* ``"run"``: per configuration on the variable lengths (``config``: none,
  uniform_best, adaptive, static; ``mode``; ``budget_fraction``), its
  ``step_peaks`` and ``step_times_s``, and for the planned ones the planner's
  time (``planning_s``), its bound and its plan per length; or ``unavailable``
  with the planner's error when it refused the budget.

It runs inside the rank processes: it starts no ranks and prints no report;
its records go back to :mod:`benchmarks.pipeline.runner`.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

import ds_pipe_ckpt
from ds_pipe_ckpt.memory import track_cpu_allocations, track_memory
from ds_pipe_ckpt.planning.plan import Decision
from examples.gpt.engine import pipeline_topology

from ..budget import stage_budgets, uniform_best, uniform_modes
from .runner import (ADAPTIVE, NONE, SELECTION_STEPS, STATIC, UNIFORM_BEST, LengthSchedule, adaptive_mode,
                               static_mode)
from ..models import EncoderConfig, LlamaSizes, _encoder_specs, default_partition, model_description
from ..modes import PipelineMode, Preset, base_config, merge_config, micro_batches_in_flight, modes
from ..report import summarize
from ...common import synchronize

__all__ = ["measure_lengths"]

# Data seeds of the steps at the maximum length (the schedule's steps use their index).
_MAXIMUM_SEED = 1_000_000
# The steps the planner measures itself (ds_pipe_ckpt.planning.stage): step 0, the
# measuring step, then each checked planned step.
_MEASURING_STEP, _FIRST_PLANNED_STEP = 1, 2


def _micro_batches(model: EncoderConfig | LlamaSizes, micro_batch: int, lengths: Sequence[int],
                   seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """One micro-batch per length: the encoder's random features labelled from
    their first position, or Llama's random byte tokens and their next tokens."""
    generator = torch.Generator().manual_seed(seed)
    for length in lengths:
        if isinstance(model, LlamaSizes):
            tokens = torch.randint(0, 256, (micro_batch, length + 1), generator=generator)
            yield tokens[:, :-1], tokens[:, 1:]
        else:
            x = torch.randn(micro_batch, length, model.features, generator=generator)
            yield x, x[:, 0, :model.classes].argmax(dim=-1)


def _build_engine(model: EncoderConfig | LlamaSizes, config: dict, topology: Any) -> Any:
    """The model's pipeline with ``dynamic_shape=True`` (the benchmark's models
    are built with fixed shapes by :func:`benchmarks.pipeline.models.build_engine`)."""
    if isinstance(model, LlamaSizes):
        from examples.llama.model import CHECKPOINTABLE_LAYERS, causal_lm_loss, llama_layer_specs, prepare_config

        specs, loss, checkpointable = (llama_layer_specs(prepare_config(model.config()), seed=0), causal_lm_loss,
                                       list(CHECKPOINTABLE_LAYERS))
    elif isinstance(model, EncoderConfig):
        torch.manual_seed(0)  # LayerSpecs are built in layer order on every stage: the same weights
        specs, loss, checkpointable = _encoder_specs(model), nn.CrossEntropyLoss(), ["TransformerEncoderLayer"]
    else:
        raise ValueError(f"--lengths runs the encoder and llama models, not {model_description(model)}")
    module = ds_pipe_ckpt.PipelineModule(layers=specs, topology=topology, loss_fn=loss,
                                         partition_method=default_partition(model),
                                         checkpointable_layers=checkpointable, dynamic_shape=True)
    engine, _, _, _ = ds_pipe_ckpt.initialize(model=module, config=config,
                                              model_parameters=[p for p in module.parameters() if p.requires_grad])
    return engine


@dataclass(eq=False)
class _Run:
    """One configuration's engine, and what was measured of it."""

    name: str
    mode: PipelineMode
    config: dict
    engine: Any
    preset: Preset
    fraction: float | None = None
    step_peaks: list[dict] = field(default_factory=list)
    samples_s: list[float] = field(default_factory=list)
    unavailable: str | None = None

    def step(self, lengths: Sequence[int], seed: int) -> None:
        """One ``train_batch`` on micro-batches of ``lengths``, this engine's
        checkpointing settings in force (they are global)."""
        ds_pipe_ckpt.configure(mpu=self.engine.module.mpu(), deepspeed_config=self.config)
        self.engine.train_batch(data_iter=_micro_batches(self.preset.model, self.preset.micro_batch, lengths, seed))

    def measured_step(self, lengths: Sequence[int], seed: int) -> int:
        """The step's peak above its start (under the profiler on CPU)."""
        gc.collect()  # no garbage of earlier steps or engines freed inside the measured step
        with track_memory(self.engine.device) as tracker:
            self.step(lengths, seed)
        return tracker.report.peak_bytes

    def timed_step(self, lengths: Sequence[int], seed: int) -> None:
        dist.barrier()
        synchronize(self.engine.device)
        start = time.perf_counter()
        self.step(lengths, seed)
        synchronize(self.engine.device)
        self.samples_s.append(time.perf_counter() - start)



def _new_run(name: str, mode: PipelineMode, preset: Preset, pp: int, fraction: float | None = None) -> _Run:
    config = merge_config(base_config(preset, pp), mode.config)
    engine = _build_engine(preset.model, config, pipeline_topology(dist.get_world_size(), pp, 1))
    return _Run(name, mode, config, engine, preset, fraction)


def _round_robin(runs: Sequence[_Run], steps: Sequence[Sequence[int]], first_seed: int) -> None:
    """Time every run on each step in turn, so that a change in load hits all alike."""
    for index, lengths in enumerate(steps):
        for run in runs:
            run.timed_step(lengths, first_seed + index)


def _maximum_record(run: _Run, pp: int, peak: int) -> dict:
    stage = run.engine.stage_id
    accumulation = run.engine.gradient_accumulation_steps()
    return {"record": "maximum", "pp": pp, "mp": 1, "mode": run.mode.name, "stage": stage, "rank": dist.get_rank(),
            "peak_bytes": peak, "step_net_bytes": 0, "step_time_s": statistics.median(run.samples_s),
            "step_times_s": list(run.samples_s), "micro_batches": accumulation,
            "micro_batches_in_flight": micro_batches_in_flight(pp, stage, accumulation)}


def _maximum_phase(preset: Preset, pp: int, schedule: LengthSchedule, fractions: Sequence[float]
                   ) -> tuple[_Run, dict[float, _Run | None], dict[float, dict[int, int]], list[dict]]:
    """``none`` and every uniform interval at the maximum length: the budgets
    and, per fraction, the fastest interval that fits them (every rank reaches
    the same choice from the gathered records). Returns the ``none`` run, the
    chosen run per fraction (None: none fits), the budgets per fraction (bytes
    by stage), and this rank's ``maximum`` and ``choice`` records."""
    none_mode = next(mode for mode in modes() if mode.name == NONE)
    candidates = [none_mode, *uniform_modes(-(-preset.model.blocks // pp) + 2)]
    longest = (schedule.max_length, ) * preset.accumulation_per_stage * pp
    runs, peaks = [], {}
    for mode in candidates:
        run = _new_run(mode.name, mode, preset, pp)
        run.step(longest, _MAXIMUM_SEED)
        peaks[mode.name] = run.measured_step(longest, _MAXIMUM_SEED + 1)
        runs.append(run)
    _round_robin(runs, [longest] * SELECTION_STEPS, _MAXIMUM_SEED + 2)
    records = [_maximum_record(run, pp, peaks[run.name]) for run in runs]
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, records)
    summaries = summarize([r for rank in gathered for r in rank])
    none = next(s for s in summaries if s.mode == NONE)
    by_name = {run.name: run for run in runs}
    chosen, budgets = {}, {}
    for fraction in fractions:
        budgets[fraction] = stage_budgets(none, fraction)
        best = uniform_best(summaries, budgets[fraction])
        chosen[fraction] = by_name[best.mode] if best is not None else None
        if dist.get_rank() == 0:
            records.append({"record": "choice", "pp": pp, "rank": 0, "budget_fraction": fraction,
                            "budgets_bytes": [budgets[fraction][stage] for stage in sorted(budgets[fraction])],
                            "uniform_mode": best.mode if best is not None else None})
    return by_name[NONE], chosen, budgets, records


def _planner_peaks(plan: Any, schedule: LengthSchedule) -> list[dict]:
    """The warm-up steps the planner measured itself: step 0 less what it
    allocates once (the optimizer's state, which memory_budget_mb leaves out),
    the measuring step, and each planned step it checked."""
    peaks = []
    if plan.first_step_peak_bytes is not None:
        peaks.append((0, plan.first_step_peak_bytes - plan.first_step_kept_bytes))
    if plan.measuring_step_peak_bytes is not None:
        peaks.append((_MEASURING_STEP, plan.measuring_step_peak_bytes))
    checked = [measured for _, measured in plan.earlier_checks] + [plan.measured_peak_bytes]
    peaks += [(_FIRST_PLANNED_STEP + i, peak) for i, peak in enumerate(checked) if peak is not None]
    return [{"step": step, "lengths": list(schedule.warmup[step]), "peak_bytes": peak, "measured_by": "planner"}
            for step, peak in peaks if step < len(schedule.warmup)]


def _plan_fields(run: _Run, schedule: LengthSchedule) -> dict:
    plan = getattr(run.engine.module, "checkpoint_plan", None)
    if plan is None:
        return {}
    per_length = []
    for length_plan in (plan.lengths.by_length if plan.lengths is not None else ()):
        counts = length_plan.counts()
        per_length.append({"length": length_plan.length, "stored": counts[Decision.STORE],
                           "checkpointed": counts[Decision.CHECKPOINT], "selective": counts[Decision.SELECTIVE],
                           "held_bytes": length_plan.held_bytes, "recompute_s": length_plan.plan.recompute_s,
                           "predicted_peak_bytes": plan.predicted_for(length_plan.length)})
    return {"planning_s": plan.planning_s, "predicted_peak_bytes": plan.predicted_peak_bytes,
            "planner_budget_bytes": plan.budget_bytes, "plans_made": len(plan.earlier_checks) + 1,
            "length_plans": per_length, "planner_step_peaks": _planner_peaks(plan, schedule)}


def _run_record(run: _Run, pp: int, schedule: LengthSchedule) -> dict:
    record = {"record": "run", "pp": pp, "rank": dist.get_rank(), "config": run.name, "mode": run.mode.name,
              "budget_fraction": run.fraction}
    if run.unavailable is not None:
        return record | {"unavailable": run.unavailable}
    fields = _plan_fields(run, schedule)
    steps = fields.pop("planner_step_peaks", []) + run.step_peaks
    return record | fields | {"stage": run.engine.stage_id, "step_peaks": steps, "step_times_s": list(run.samples_s)}


def _variable_phase(runs: list[_Run], schedule: LengthSchedule) -> None:
    """Warm up, measure and time every run on the schedule; a planned run whose
    budget the planner refuses (on every rank at once) is marked unavailable."""
    warmup, measured = len(schedule.warmup), len(schedule.measured)
    for run in runs:
        try:
            for index, lengths in enumerate(schedule.warmup):
                run.step(lengths, index)
        except ds_pipe_ckpt.ConfigError as error:
            run.unavailable = str(error)
            run.engine = None
            gc.collect()
            continue
        for index, lengths in enumerate(schedule.measured, start=warmup):
            peak = run.measured_step(lengths, index)
            run.step_peaks.append({"step": index, "lengths": list(lengths), "peak_bytes": peak,
                                   "measured_by": "benchmark"})
    _round_robin([run for run in runs if run.unavailable is None], schedule.timed, warmup + measured)


def measure_lengths(pp: int, fractions: Sequence[float], preset: Preset, schedule: LengthSchedule,
                    threads: int) -> list[dict]:
    """This rank's records (module docstring) of every configuration at depth
    ``pp``, on ``schedule``. Run by ``run_ranks`` with ``pp`` ranks."""
    if dist.get_world_size() != pp:
        raise ValueError(f"pp={pp} needs {pp} ranks, this launch has {dist.get_world_size()}")
    torch.set_num_threads(threads)
    if not torch.cuda.is_available():
        track_cpu_allocations()  # before any engine exists: its frees are then counted exactly
    # DeepSpeed prints its pipeline layout on stdout: keep the report there clean.
    with contextlib.redirect_stdout(sys.stderr):
        none, chosen, budgets, records = _maximum_phase(preset, pp, schedule, fractions)
        runs = [none] + list({id(run): run for run in chosen.values()
                                if run is not None and run is not none}.values())
        for run in runs:
            run.samples_s.clear()  # times at the maximum length: in the maximum records
            run.name = NONE if run is none else UNIFORM_BEST
        del chosen
        gc.collect()  # the intervals not chosen
        for fraction in fractions:
            runs += [_new_run(ADAPTIVE, adaptive_mode(budgets[fraction], fraction, schedule.max_length), preset, pp,
                              fraction),
                     _new_run(STATIC, static_mode(budgets[fraction], fraction, schedule.max_length), preset, pp,
                              fraction)]
        _variable_phase(runs, schedule)
        records += [_run_record(run, pp, schedule) for run in runs]
    ds_pipe_ckpt.configure()
    return records
