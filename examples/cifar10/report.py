"""Outputs of a training launch: loss curves as CSV and PNG, a JSON summary,
and the one-line summary printed per run."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

from examples.outputs import write_loss_outputs

__all__ = ["RunResult", "summary_line", "write_outputs"]

# Steps averaged for the "from -> to" loss in the summary line.
_WINDOW = 10


@dataclass
class RunResult:
    """One trained configuration of a launch, as rank 0 saw it."""

    name: str
    config: str
    checkpointing: str  # "none", "reentrant" or "non_reentrant"
    partition_activations: bool
    checkpoint_interval: int
    losses: list[float] = field(default_factory=list)
    samples_per_s: list[float] = field(default_factory=list)
    wall_s: float = 0.0


def summary_line(run: RunResult, topology: str, data_kind: str, global_batch: int) -> str:
    """``cifar10 <run>: ... loss A -> B ...``: first and last 10-step mean losses."""
    window = max(1, min(_WINDOW, len(run.losses) // 2))
    first = statistics.fmean(run.losses[:window])
    last = statistics.fmean(run.losses[-window:])
    rate = len(run.losses) * global_batch / run.wall_s if run.wall_s else float("nan")
    partitioned = " +partition_activations" if run.partition_activations else ""
    return (f"cifar10 {run.name}: {data_kind} data, {topology}, checkpointing={run.checkpointing}"
            f"{partitioned} (interval {run.checkpoint_interval}), {len(run.losses)} steps x "
            f"{global_batch} samples, loss {first:.4f} -> {last:.4f} (mean of first/last {window}), "
            f"{rate:.1f} samples/s, {run.wall_s:.1f} s")


def write_outputs(out_dir: Path, runs: list[RunResult], meta: dict) -> dict[str, Path]:
    """Write ``loss.csv``, ``loss.png`` and ``summary.json`` into ``out_dir``."""
    return write_loss_outputs(out_dir, runs, {**meta, "runs": [asdict(run) for run in runs]},
                              f"CIFAR-10 AlexNet pipeline, {meta['topology']}, {meta['data_kind']} data",
                              f"training loss (cross-entropy, label smoothing {meta['label_smoothing']})")
