"""What the language-model examples' training scripts share (``examples/gpt``,
``examples/llama``): the pipeline grid, one run of a DeepSpeed config (steps,
one measured step, progress, per-stage peaks), its record and summary line.

A run is ``steps`` calls of ``engine.train_batch()``. Every rank measures one of
them (``memory_step``): its peak memory above what was allocated when the step
began (:mod:`ds_pipe_ckpt.memory`); the peaks are gathered so that rank 0 knows
every stage's. A planned run (a budget in ``activation_checkpointing``) has
every step measured (:func:`step_peaks`) and each stage's budget recorded.
Rank 0 shows progress: a tqdm bar when stderr is a terminal, a
line every ``log_every`` steps otherwise (logs and CI keep no carriage-return
updates).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, TextIO

import torch.distributed as dist
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
from tqdm import tqdm

import ds_pipe_ckpt
from ds_pipe_ckpt.memory import track_memory

__all__ = [
    "MIB",
    "RunResult",
    "LineProgress",
    "add_progress_arguments",
    "checkpointing_mode",
    "gather_peaks",
    "load_json_config",
    "make_progress",
    "pipeline_topology",
    "rank0_first",
    "step_peaks",
    "summary_line",
    "topology_text",
    "train_run",
]

MIB = 2**20
# The planner measures the first three steps of a planned run itself (the first
# step, the measuring step, the first planned step) and leaves alone a step that
# another profiler measures: those are not wrapped in track_memory.
PLANNER_STEPS = 3
# Steps averaged for the "from -> to" loss in the summary line.
_WINDOW = 10
DEFAULT_LOG_EVERY = 10


def pipeline_topology(world_size: int, pp: int, mp: int = 1) -> PipeModelDataParallelTopology:
    """The (pipe, data, model) grid of ``world_size`` ranks; data-parallel size
    ``world_size / (pp * mp)``.

    The examples' models have no tensor-parallel layers: the ``mp`` ranks of a
    stage compute the same thing. The axis exists so that
    ``activation_checkpointing.partition_activations`` has a model-parallel
    group to shard checkpoint inputs across.

    Raises:
        ValueError: ``world_size`` is not a multiple of ``pp * mp``.
    """
    if pp < 1 or mp < 1 or world_size % (pp * mp):
        raise ValueError(f"world size {world_size} cannot be split as pp={pp} x mp={mp} x dp: launch a "
                         "multiple of pp * mp ranks")
    return PipeModelDataParallelTopology(num_pp=pp, num_mp=mp, num_dp=world_size // (pp * mp))


def topology_text(topology: PipeModelDataParallelTopology) -> str:
    """``pp=P mp=M dp=D``."""
    return f"pp={topology.get_dim('pipe')} mp={topology.get_dim('model')} dp={topology.get_dim('data')}"


def checkpointing_mode(engine: Any) -> str:
    """``"planned"`` (``activation_checkpointing.memory_budget_mb``), ``"none"``,
    ``"reentrant"`` or ``"non_reentrant"``: what the engine's module runs."""
    module = engine.module
    if module.planning_enabled:
        return "planned"
    return "none" if module.activation_checkpoint_interval == 0 else module.checkpoint_mode


def load_json_config(path: str | Path) -> dict:
    """A DeepSpeed JSON config as a dict."""
    with open(path) as handle:
        return json.load(handle)


def rank0_first(load):
    """``load()`` on rank 0, then, after a barrier, on the other ranks (rank 0
    writes a cache that the others then read); returns this rank's result."""
    if dist.get_rank() == 0:
        value = load()
    dist.barrier()
    if dist.get_rank() != 0:
        value = load()
    return value


# -- progress -------------------------------------------------------------------------

def add_progress_arguments(parser: argparse.ArgumentParser) -> None:
    """``--log-every N``: outside a terminal, a progress line every N steps."""
    parser.add_argument("--log-every", type=int, default=DEFAULT_LOG_EVERY, metavar="N",
                        help="when stderr is not a terminal (a log file, CI), print a progress line every N "
                        "steps instead of a progress bar")


class LineProgress:
    """tqdm's ``set_postfix``/``update``/``close`` as one line every ``every``
    steps (and at the last), for output that is not a terminal::

        llama none: step 20/200, loss=3.1234, samples_s=41
    """

    def __init__(self, total: int, desc: str, every: int, stream: TextIO | None = None):
        if every < 1:
            raise ValueError(f"progress every {every} steps is invalid: expected at least 1")
        self.total, self.desc, self.every = total, desc, every
        self.stream = stream
        self.n = 0
        self._postfix: dict[str, Any] = {}

    def set_postfix(self, **values: Any) -> None:
        self._postfix = values

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.n % self.every == 0 or self.n == self.total:
            fields = "".join(f", {key}={value}" for key, value in self._postfix.items())
            print(f"{self.desc}: step {self.n}/{self.total}{fields}", file=self.stream or sys.stderr, flush=True)

    def close(self) -> None:
        pass


class _NoProgress:
    def set_postfix(self, **values: Any) -> None:
        pass

    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def make_progress(total: int, desc: str, *, enabled: bool, log_every: int = DEFAULT_LOG_EVERY,
                  stream: TextIO | None = None):
    """A tqdm bar on ``stream`` (default stderr) when it is a terminal, else a
    :class:`LineProgress`; nothing when not ``enabled``."""
    if not enabled:
        return _NoProgress()
    stream = stream or sys.stderr
    if stream.isatty():
        return tqdm(total=total, desc=desc, unit="step", dynamic_ncols=True, mininterval=0.5, file=stream)
    return LineProgress(total, desc, log_every, stream)


# -- one run --------------------------------------------------------------------------

@dataclass
class RunResult:
    """One trained configuration of a launch, as rank 0 saw it.

    ``peak_memory_by_stage`` maps a pipeline stage (as a string, for JSON) to the
    largest peak over that stage's ranks of one ``engine.train_batch()``: bytes
    allocated above what was allocated when the step began
    (:mod:`ds_pipe_ckpt.memory`), measured at step ``memory_step``.
    ``peak_memory_by_rank`` has every rank's figure, by global rank.

    A run with a budget also has, per stage (as a string), its budget
    (``budget_bytes_by_stage``, the plan's ``budget_bytes``), every step's peak
    (``step_peaks_by_stage``, largest over the stage's ranks, :func:`step_peaks`;
    ``None`` for a planner step the planner did not reach) and what step 1 left
    allocated once (``first_step_kept_bytes_by_stage``, not counted in its
    peak); ``steps_over_budget`` lists the steps (1-based) on which some stage
    went over its budget. Without a budget these stay empty.
    """

    name: str
    config: str
    checkpointing: str  # "none", "reentrant", "non_reentrant" or "planned"
    policy: str | None
    partition_activations: bool
    cpu_checkpointing: bool
    checkpoint_interval: int
    partition_method: str = ""  # the PipelineModule's partition_method
    stage_boundaries: list[int] = field(default_factory=list)  # each stage's first layer, then the layer count
    losses: list[float] = field(default_factory=list)
    samples_per_s: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    memory_step: int = 0
    peak_memory_by_stage: dict[str, int] = field(default_factory=dict)
    peak_memory_by_rank: dict[str, int] = field(default_factory=dict)
    budget_bytes_by_stage: dict[str, int] = field(default_factory=dict)
    step_peaks_by_stage: dict[str, list[int | None]] = field(default_factory=dict)
    first_step_kept_bytes_by_stage: dict[str, int | None] = field(default_factory=dict)
    steps_over_budget: list[int] = field(default_factory=list)


def gather_peaks(peak_bytes: int, stage: int) -> tuple[dict[str, int], dict[str, int]]:
    """(largest peak of each stage, every rank's peak), on every rank."""
    records: list = [None] * dist.get_world_size()
    dist.all_gather_object(records, (dist.get_rank(), stage, peak_bytes))
    by_stage: dict[str, int] = {}
    for _, record_stage, peak in records:
        by_stage[str(record_stage)] = max(peak, by_stage.get(str(record_stage), peak))
    by_rank = {str(rank): peak for rank, _, peak in sorted(records)}
    return by_stage, by_rank


def step_peaks(plan: Any, measured: list[int | None]) -> list[int | None]:
    """Every step's peak of a planned run on this rank: ``measured`` (ours, by
    step, ``None`` where not measured) with the first :data:`PLANNER_STEPS`
    taken from ``plan`` (``module.checkpoint_plan``, ``None`` before any plan):
    step 1 less what it allocates once (``first_step_kept_bytes``: DeepSpeed's
    pipeline buffers, the optimizer's state), the measuring step, and the first
    planned step (that of the first plan when the planner planned again)."""
    peaks = list(measured)
    if plan is None:
        return [None if step < PLANNER_STEPS else peak for step, peak in enumerate(peaks)]
    first = (None if plan.first_step_peak_bytes is None
             else plan.first_step_peak_bytes - plan.first_step_kept_bytes)
    checked = plan.earlier_checks[0][1] if plan.earlier_checks else plan.measured_peak_bytes
    for step, peak in enumerate((first, plan.measuring_step_peak_bytes, checked)[:len(peaks)]):
        peaks[step] = peak
    return peaks


def _record_budget(result: RunResult, plan: Any, stage: int, peaks: list[int | None]) -> None:
    """Gather every stage's budget (from its ``plan``) and step ``peaks``
    (:func:`step_peaks`) into ``result``, on every rank."""
    mine = (stage, None if plan is None else plan.budget_bytes, peaks,
            None if plan is None else plan.first_step_kept_bytes)
    records: list = [None] * dist.get_world_size()
    dist.all_gather_object(records, mine)
    for record_stage, budget, peaks, kept in records:
        key = str(record_stage)
        if budget is not None:
            result.budget_bytes_by_stage[key] = budget
        result.first_step_kept_bytes_by_stage[key] = kept
        known = result.step_peaks_by_stage.get(key, [None] * len(peaks))
        result.step_peaks_by_stage[key] = [a if b is None else b if a is None else max(a, b)
                                           for a, b in zip(known, peaks)]
    result.steps_over_budget = sorted({
        step for key, peaks in result.step_peaks_by_stage.items() if key in result.budget_bytes_by_stage
        for step, peak in enumerate(peaks, start=1)
        if peak is not None and peak > result.budget_bytes_by_stage[key]})


def _train_step(engine: Any, batches: Iterator, measure: bool) -> tuple[float, int]:
    """One ``engine.train_batch()``: its loss and, with ``measure``, its peak
    memory (bytes above what was allocated when it began; else 0)."""
    if not measure:
        return float(engine.train_batch(data_iter=batches)), 0
    with track_memory(engine.device) as tracker:
        loss = float(engine.train_batch(data_iter=batches))
    return loss, tracker.report.peak_bytes


def train_run(engine: Any, batches: Iterator, *, config_path: str | Path, config: dict, steps: int,
              memory_step: int, global_batch: int, progress_label: str, show_progress: bool,
              log_every: int = DEFAULT_LOG_EVERY) -> RunResult:
    """Train ``steps`` steps of ``engine`` (built from ``config``, read from
    ``config_path``) on ``batches``, measuring step ``memory_step`` on every
    rank (with a budget: every step, the planner's own first steps from its
    plan); returns the run's record (on every rank, with every stage's peak).
    Rank 0 shows progress when ``show_progress``.

    Raises:
        ValueError: ``memory_step`` is not in ``[1, steps]``.
    """
    if not 1 <= memory_step <= steps:
        raise ValueError(f"memory_step = {memory_step} is not in [1, steps = {steps}]")
    settings = ds_pipe_ckpt.current_settings().config
    result = RunResult(name=Path(config_path).stem, config=str(config_path), checkpointing=checkpointing_mode(engine),
                       policy=(config.get("activation_checkpointing") or {}).get("policy"),
                       partition_activations=settings.partition_activations,
                       cpu_checkpointing=settings.cpu_checkpointing,
                       checkpoint_interval=engine.module.activation_checkpoint_interval,
                       partition_method=engine.module.partition_method,
                       stage_boundaries=[int(b) for b in engine.module.parts], memory_step=memory_step)
    bar = make_progress(steps, f"{progress_label} {result.name}", enabled=show_progress and dist.get_rank() == 0,
                        log_every=log_every)
    planned = result.checkpointing == "planned"
    measured: list[int | None] = []
    start = time.perf_counter()
    for step in range(1, steps + 1):
        measure = step > PLANNER_STEPS if planned else step == memory_step
        if measure:
            gc.collect()  # no garbage of earlier steps freed inside the measured step
        step_start = time.perf_counter()
        loss, peak = _train_step(engine, batches, measure)
        measured.append(peak if measure else None)
        rate = global_batch / (time.perf_counter() - step_start)
        result.losses.append(loss)
        result.samples_per_s.append(rate)
        bar.set_postfix(loss=f"{loss:.4f}", samples_s=f"{rate:.0f}")
        bar.update()
    result.wall_s = time.perf_counter() - start
    bar.close()
    if planned:
        measured = step_peaks(engine.module.checkpoint_plan, measured)
        _record_budget(result, engine.module.checkpoint_plan, engine.stage_id, measured)
    result.peak_memory_by_stage, result.peak_memory_by_rank = gather_peaks(measured[memory_step - 1] or 0,
                                                                           engine.stage_id)
    return result


def _mode_text(run: RunResult) -> str:
    extras = [f"policy={run.policy}"] if run.policy else []
    extras += ["partition_activations"] * run.partition_activations + ["cpu_checkpointing"] * run.cpu_checkpointing
    return f"checkpointing={run.checkpointing}" + "".join(f" +{e}" for e in extras)


def summary_line(label: str, run: RunResult, topology: str, global_batch: int, context: float) -> str:
    """``<label> <run>: ... loss A -> B ..., peak MiB by stage ...`` (and, with a
    budget, each stage's largest step peak against it and how many steps went
    over); ``context`` is the tokens per sequence that the tokens/s count."""
    window = max(1, min(_WINDOW, len(run.losses) // 2))
    first, last = statistics.fmean(run.losses[:window]), statistics.fmean(run.losses[-window:])
    rate = len(run.losses) * global_batch * context / run.wall_s if run.wall_s else float("nan")
    peaks = " ".join(f"{stage}:{peak / MIB:.2f}" for stage, peak in sorted(run.peak_memory_by_stage.items(),
                                                                            key=lambda item: int(item[0])))
    return (f"{label} {run.name}: {topology}, {_mode_text(run)} (interval {run.checkpoint_interval}), "
            f"{len(run.losses)} steps x {global_batch} sequences, loss {first:.4f} -> {last:.4f} "
            f"(mean of first/last {window}), {rate:.0f} tokens/s, {run.wall_s:.1f} s, "
            f"peak MiB by stage (step {run.memory_step}) {peaks}{_budget_text(run)}")


def _budget_text(run: RunResult) -> str:
    """``; largest step peak / budget MiB by stage 0:4.10/5.00 ..., 0 of 8 steps over budget``."""
    if not run.budget_bytes_by_stage:
        return ""
    stages = sorted(run.budget_bytes_by_stage, key=int)
    largest = {stage: max((p for p in run.step_peaks_by_stage[stage] if p is not None), default=0) for stage in stages}
    pairs = " ".join(f"{stage}:{largest[stage] / MIB:.2f}/{run.budget_bytes_by_stage[stage] / MIB:.2f}"
                     for stage in stages)
    return (f"; largest step peak / budget MiB by stage {pairs}, {len(run.steps_over_budget)} of "
            f"{len(run.losses)} steps over budget")
