"""Outputs of a training launch: loss curves as CSV and PNG, a JSON summary,
and the one-line summary printed per run."""

from __future__ import annotations

import csv
import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

__all__ = ["RunResult", "summary_line", "write_outputs"]

# Steps averaged for the "from -> to" loss in the summary line.
_WINDOW = 10
_LINESTYLES = ("-", "--", ":", "-.")


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


def _write_csv(path: Path, runs: list[RunResult]) -> None:
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["run", "step", "loss", "samples_per_s"])
        for run in runs:
            for step, (loss, rate) in enumerate(zip(run.losses, run.samples_per_s), start=1):
                writer.writerow([run.name, step, repr(loss), f"{rate:.2f}"])


def _plot(path: Path, runs: list[RunResult], title: str, ylabel: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 4.5))
    first = runs[0]
    for index, run in enumerate(runs):
        label = run.name
        if index:  # identical curves would hide each other: say how far apart they are
            gap = max(abs(a - b) for a, b in zip(run.losses, first.losses))
            label += f" (max |loss - {first.name}| = {gap:.3g})"
        axes.plot(range(1, len(run.losses) + 1), run.losses, label=label, linewidth=1.2,
                  linestyle=_LINESTYLES[index % len(_LINESTYLES)])
    axes.set_xlabel("step")
    axes.set_ylabel(ylabel)
    axes.set_title(title, fontsize=10)
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def write_outputs(out_dir: Path, runs: list[RunResult], meta: dict) -> dict[str, Path]:
    """Write ``loss.csv``, ``loss.png`` and ``summary.json`` into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"csv": out_dir / "loss.csv", "png": out_dir / "loss.png", "summary": out_dir / "summary.json"}
    _write_csv(paths["csv"], runs)
    _plot(paths["png"], runs, f"CIFAR-10 AlexNet pipeline, {meta['topology']}, {meta['data_kind']} data",
          f"training loss (cross-entropy, label smoothing {meta['label_smoothing']})")
    summary = {**meta, "runs": [asdict(run) for run in runs]}
    paths["summary"].write_text(json.dumps(summary, indent=1) + "\n")
    return paths
