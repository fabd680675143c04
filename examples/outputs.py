"""What every example launch writes: the loss of each run per step as CSV
and as a plot, and a JSON summary."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any, Protocol, Sequence

__all__ = ["TrainedRun", "write_loss_outputs"]

_LINESTYLES = ("-", "--", ":", "-.")


class TrainedRun(Protocol):
    """What the outputs need of a run: its name, and per step its loss and rate."""

    name: str
    losses: list[float]
    samples_per_s: list[float]


def _write_csv(path: Path, runs: Sequence[TrainedRun]) -> None:
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["run", "step", "loss", "samples_per_s"])
        for run in runs:
            for step, (loss, rate) in enumerate(zip(run.losses, run.samples_per_s), start=1):
                writer.writerow([run.name, step, repr(loss), f"{rate:.2f}"])


def _plot(path: Path, runs: Sequence[TrainedRun], title: str, ylabel: str) -> None:
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


def write_loss_outputs(out_dir: Path, runs: Sequence[TrainedRun], summary: Any, title: str,
                       ylabel: str) -> dict[str, Path]:
    """Write ``loss.csv`` (one row per run and step), ``loss.png`` (one curve per
    run, labelled with its largest distance from the first run) and
    ``summary.json`` (``summary``) into ``out_dir``; return their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"csv": out_dir / "loss.csv", "png": out_dir / "loss.png", "summary": out_dir / "summary.json"}
    _write_csv(paths["csv"], runs)
    _plot(paths["png"], runs, title, ylabel)
    paths["summary"].write_text(json.dumps(summary, indent=1) + "\n")
    return paths
