"""Outputs of a GPT training launch: ``loss.csv``, ``loss.png``, ``summary.json``
and the one-line summary printed per run."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

from examples.outputs import write_loss_outputs

__all__ = ["RunResult", "summary_line", "write_outputs", "MIB"]

MIB = 2**20
# Steps averaged for the "from -> to" loss in the summary line.
_WINDOW = 10


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
    checkpointing: str  # "none", "reentrant" or "non_reentrant"
    policy: str | None
    partition_activations: bool
    cpu_checkpointing: bool
    checkpoint_interval: int
    losses: list[float] = field(default_factory=list)
    samples_per_s: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    memory_step: int = 0
    peak_memory_by_stage: dict[str, int] = field(default_factory=dict)
    peak_memory_by_rank: dict[str, int] = field(default_factory=dict)


def _mode_text(run: RunResult) -> str:
    extras = [f"policy={run.policy}"] if run.policy else []
    extras += ["partition_activations"] * run.partition_activations + ["cpu_checkpointing"] * run.cpu_checkpointing
    return f"checkpointing={run.checkpointing}" + "".join(f" +{e}" for e in extras)


def summary_line(run: RunResult, topology: str, global_batch: int, context: int) -> str:
    """``gpt <run>: ... loss A -> B ..., peak MiB by stage ...``."""
    window = max(1, min(_WINDOW, len(run.losses) // 2))
    first, last = statistics.fmean(run.losses[:window]), statistics.fmean(run.losses[-window:])
    rate = len(run.losses) * global_batch * context / run.wall_s if run.wall_s else float("nan")
    peaks = " ".join(f"{stage}:{peak / MIB:.2f}" for stage, peak in sorted(run.peak_memory_by_stage.items(),
                                                                            key=lambda item: int(item[0])))
    return (f"gpt {run.name}: {topology}, {_mode_text(run)} (interval {run.checkpoint_interval}), "
            f"{len(run.losses)} steps x {global_batch} sequences, loss {first:.4f} -> {last:.4f} "
            f"(mean of first/last {window}), {rate:.0f} tokens/s, {run.wall_s:.1f} s, "
            f"peak MiB by stage (step {run.memory_step}) {peaks}")


def write_outputs(out_dir: Path, runs: list[RunResult], meta: dict) -> dict[str, Path]:
    """Write ``loss.csv``, ``loss.png`` and ``summary.json``
    (``{"meta": meta, "runs": [...]}``) into ``out_dir``; return their paths."""
    return write_loss_outputs(out_dir, runs, {"meta": meta, "runs": [asdict(run) for run in runs]},
                              f"GPT pipeline on Python stdlib bytes, {meta['topology']}",
                              "training loss (next-byte cross-entropy, nats)")
