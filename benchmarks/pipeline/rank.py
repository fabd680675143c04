"""One rank's side of ``python -m benchmarks.pipeline``: build the model's pipeline
engine (:mod:`benchmarks.pipeline.models`) for every mode of a layout, measure the memory of one
``engine.train_batch()`` and time several.

Run in rank processes by :func:`ds_pipe_ckpt.testing.run_ranks` (one launch
per world size). For each layout (pipeline topology) the engines of all its
modes are built, warmed up and measured one after the other, then kept alive
while the timed steps go round-robin over them, so that a change in machine
load hits every mode alike. The activation-checkpointing settings are global
(``ds_pipe_ckpt.configure``), so each engine's are applied again before each of
its steps, as ``ds_pipe_ckpt.initialize`` applied them when it was built.

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

import ds_pipe_ckpt
from ds_pipe_ckpt.memory import MemoryReport, track_cpu_allocations, track_memory
from examples.gpt.data import Corpus, load_corpus
from examples.gpt.engine import pipeline_topology

from .models import build_engine, model_description, training_batches
from .modes import Layout, PipelineMode, Preset, base_config, merge_config, micro_batches_in_flight
from .modes import modes as all_modes
from ..common import synchronize

__all__ = ["measure_layouts", "model_description"]


@dataclass
class _Run:
    """One mode's engine in one layout, and what was measured of it."""

    mode: PipelineMode
    config: dict
    engine: Any
    batches: Iterator
    memory: MemoryReport | None = None
    samples_s: list[float] = field(default_factory=list)

    def activate(self) -> None:
        """Put this engine's checkpointing settings in force."""
        ds_pipe_ckpt.configure(mpu=self.engine.module.mpu(), deepspeed_config=self.config)

    def step(self) -> None:
        self.engine.train_batch(data_iter=self.batches)



def _warmup_steps(mode: PipelineMode, preset: Preset) -> int:
    return preset.warmup_steps if mode.warmup_steps is None else mode.warmup_steps


def _build_run(mode: PipelineMode, layout: Layout, preset: Preset, corpus: Corpus | None) -> _Run:
    config = merge_config(base_config(preset, layout.pp), mode.config)
    topology = pipeline_topology(dist.get_world_size(), layout.pp, layout.mp)
    steps = _warmup_steps(mode, preset) + 1 + preset.timed_steps
    accumulation = config["gradient_accumulation_steps"]
    # The first micro-batch of the run: what a planned partition profiles the layers on.
    sample = next(training_batches(preset.model, corpus, preset.micro_batch, accumulation, steps))
    engine = build_engine(config, preset.model, topology, seed=0, sample=sample)
    batches = training_batches(preset.model, corpus, preset.micro_batch, accumulation, steps)
    return _Run(mode, config, engine, batches)


def _partition_fields(module: Any) -> dict:
    """How the stages were cut, and the planned partition's model of the step."""
    fields = {"partition_method": module.partition_method, "parts": [int(p) for p in module.parts]}
    plan = getattr(module, "partition_plan", None)
    if plan is not None:
        fields["partition_plan"] = {
            "boundaries": list(plan.boundaries), "stage_seconds": list(plan.stage_seconds),
            "step_seconds": plan.step_seconds,
            "predicted_peak_bytes": [p.predicted_peak_bytes for p in plan.stage_plans],
            "profile_source": module.partition_profile_source}
    return fields


# The planner's steps (ds_pipe_ckpt.planning.stage): the first warms up, the
# second is the measuring step, the third the first planned step, which the
# planner checks; a check that fails plans again and checks the next step.
_MEASURING_STEP = 2
_FIRST_PLANNED_STEP = 3


def _plan_fields(engine: Any, measured_step: int, measured_peak_bytes: int) -> dict:
    """The planner's prediction and decisions for the stage, when it planned,
    and ``step_peaks``: the peak of every step measured, in order: the planner's
    measuring step (every layer checkpointed), each planned step the planner
    checked (the first planned step first; one more per plan made again), and
    the benchmark's own measured step ``measured_step``."""
    plan = getattr(engine.module, "checkpoint_plan", None)
    if plan is None:
        return {}
    steps = [{"step": _MEASURING_STEP, "kind": "measuring", "peak_bytes": plan.measuring_step_peak_bytes,
              "predicted_bytes": None}]
    checks = [*plan.earlier_checks, (plan.plan.predicted_peak_bytes, plan.measured_peak_bytes)]
    steps += [{"step": _FIRST_PLANNED_STEP + i, "kind": "planned", "peak_bytes": measured, "predicted_bytes": predicted}
              for i, (predicted, measured) in enumerate(checks) if measured is not None]
    steps.append({"step": measured_step, "kind": "planned", "peak_bytes": measured_peak_bytes,
                  "predicted_bytes": plan.plan.predicted_peak_bytes})
    return {"predicted_peak_bytes": plan.plan.predicted_peak_bytes,
            "planner_measured_peak_bytes": plan.measured_peak_bytes,
            "plan": [(s.start, s.end, s.decision.value) for s in plan.plan.segments],
            "plan_recompute_s": plan.plan.recompute_s,
            "plans_made": len(checks),
            "step_peaks": steps}


def _records(layout: Layout, preset: Preset, runs: Sequence[_Run], threads: int) -> list[dict]:
    records = []
    for run in runs:
        engine = run.engine
        accumulation = engine.gradient_accumulation_steps()
        measured_step = _warmup_steps(run.mode, preset) + 1
        records.append(_plan_fields(engine, measured_step, run.memory.peak_bytes)
                       | _partition_fields(engine.module) | {
            "model": model_description(preset.model),
            "pp": layout.pp,
            "mp": layout.mp,
            "dp": 1,
            "mode": run.mode.name,
            "stage": engine.stage_id,
            "rank": dist.get_rank(),
            "peak_bytes": run.memory.peak_bytes,
            "step_net_bytes": run.memory.final_bytes,
            "step_time_s": statistics.median(run.samples_s),
            "step_times_s": list(run.samples_s),
            "micro_batches": accumulation,
            "micro_batch_size": preset.micro_batch,
            "micro_batches_in_flight": micro_batches_in_flight(layout.pp, engine.stage_id, accumulation),
            "samples_per_step": preset.micro_batch * accumulation,
            "tokens_per_step": preset.micro_batch * accumulation * preset.model.context,
            "device": str(engine.device),
            "torch_threads": threads,
            "config": run.config,
        })
    return records


def _measure_layout(layout: Layout, preset: Preset, corpus: Corpus | None, threads: int,
                    mode_list: Sequence[PipelineMode]) -> list[dict]:
    runs, unavailable = [], []
    for mode in (m for m in mode_list if m.name in layout.modes):
        try:
            run = _build_run(mode, layout, preset, corpus)
        except (ds_pipe_ckpt.ConfigError, NotImplementedError) as error:  # e.g. a key not known yet
            unavailable.append({"pp": layout.pp, "mp": layout.mp, "mode": mode.name, "rank": dist.get_rank(),
                                "unavailable": str(error)})
            continue
        run.activate()
        for _ in range(_warmup_steps(mode, preset)):
            run.step()
        gc.collect()  # no garbage of earlier steps or engines freed inside the measured step
        with track_memory(run.engine.device) as tracker:
            run.step()
        run.memory = tracker.report
        runs.append(run)
    for _ in range(preset.timed_steps):
        for run in runs:
            run.activate()
            dist.barrier()
            synchronize(run.engine.device)
            start = time.perf_counter()
            run.step()
            synchronize(run.engine.device)
            run.samples_s.append(time.perf_counter() - start)
    records = _records(layout, preset, runs, threads) + unavailable
    runs.clear()
    gc.collect()
    return records


def measure_layouts(layouts: Sequence[Layout], preset: Preset, cache_dir: str | None, threads: int,
                    mode_list: Sequence[PipelineMode] | None = None) -> list[dict]:
    """This rank's records for every layout (all of the launch's world size):
    one per mode measured, plus one ``{"unavailable": message, ...}`` per mode
    whose config ``ds_pipe_ckpt.initialize`` rejected. The layouts name their
    modes among ``mode_list`` (default: :func:`benchmarks.pipeline.modes.modes`).
    Run by ``run_ranks``."""
    mode_list = all_modes() if mode_list is None else mode_list
    torch.set_num_threads(threads)
    if not torch.cuda.is_available():
        track_cpu_allocations()  # before any engine exists: its frees are then counted exactly
    corpus = load_corpus(cache_dir) if cache_dir is not None else None  # built by the parent process
    records = []
    # DeepSpeed prints its pipeline layout on stdout: keep the report there clean.
    with contextlib.redirect_stdout(sys.stderr):
        for layout in layouts:
            if layout.world_size != dist.get_world_size():
                raise ValueError(f"layout pp={layout.pp} x mp={layout.mp} needs {layout.world_size} ranks, "
                                 f"this launch has {dist.get_world_size()}")
            records += _measure_layout(layout, preset, corpus, threads, mode_list)
    ds_pipe_ckpt.configure()
    return records
