"""What the language-model examples' training scripts share (``examples/gpt``,
``examples/llama``): the pipeline grid, one run of a DeepSpeed config (steps,
one measured step, progress, per-stage peaks), its record and summary line.

A run is ``steps`` calls of ``engine.train_batch()``. Every rank measures one of
them (``memory_step``): its peak memory above what was allocated when the step
began (:mod:`ds_pipe_ckpt.memory`); the peaks are gathered so that rank 0 knows
every stage's. Rank 0 shows progress: a tqdm bar when stderr is a terminal, a
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
    "summary_line",
    "topology_text",
    "train_run",
]

MIB = 2**20
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


def gather_peaks(peak_bytes: int, stage: int) -> tuple[dict[str, int], dict[str, int]]:
    """(largest peak of each stage, every rank's peak), on every rank."""
    records: list = [None] * dist.get_world_size()
    dist.all_gather_object(records, (dist.get_rank(), stage, peak_bytes))
    by_stage: dict[str, int] = {}
    for _, record_stage, peak in records:
        by_stage[str(record_stage)] = max(peak, by_stage.get(str(record_stage), peak))
    by_rank = {str(rank): peak for rank, _, peak in sorted(records)}
    return by_stage, by_rank


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
    rank; returns the run's record (on every rank, with every stage's peak).
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
    start = time.perf_counter()
    peak_bytes = 0
    for step in range(1, steps + 1):
        measure = step == memory_step
        if measure:
            gc.collect()  # no garbage of earlier steps freed inside the measured step
        step_start = time.perf_counter()
        loss, peak = _train_step(engine, batches, measure)
        peak_bytes = peak if measure else peak_bytes
        rate = global_batch / (time.perf_counter() - step_start)
        result.losses.append(loss)
        result.samples_per_s.append(rate)
        bar.set_postfix(loss=f"{loss:.4f}", samples_s=f"{rate:.0f}")
        bar.update()
    result.wall_s = time.perf_counter() - start
    bar.close()
    result.peak_memory_by_stage, result.peak_memory_by_rank = gather_peaks(peak_bytes, engine.stage_id)
    return result


def _mode_text(run: RunResult) -> str:
    extras = [f"policy={run.policy}"] if run.policy else []
    extras += ["partition_activations"] * run.partition_activations + ["cpu_checkpointing"] * run.cpu_checkpointing
    return f"checkpointing={run.checkpointing}" + "".join(f" +{e}" for e in extras)


def summary_line(label: str, run: RunResult, topology: str, global_batch: int, context: int) -> str:
    """``<label> <run>: ... loss A -> B ..., peak MiB by stage ...``."""
    window = max(1, min(_WINDOW, len(run.losses) // 2))
    first, last = statistics.fmean(run.losses[:window]), statistics.fmean(run.losses[-window:])
    rate = len(run.losses) * global_batch * context / run.wall_s if run.wall_s else float("nan")
    peaks = " ".join(f"{stage}:{peak / MIB:.2f}" for stage, peak in sorted(run.peak_memory_by_stage.items(),
                                                                            key=lambda item: int(item[0])))
    return (f"{label} {run.name}: {topology}, {_mode_text(run)} (interval {run.checkpoint_interval}), "
            f"{len(run.losses)} steps x {global_batch} sequences, loss {first:.4f} -> {last:.4f} "
            f"(mean of first/last {window}), {rate:.0f} tokens/s, {run.wall_s:.1f} s, "
            f"peak MiB by stage (step {run.memory_step}) {peaks}")
