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
    model: str = "alexnet"
    gradient_accumulation_steps: int = 1  # micro-batches per step on each data-parallel rank
    losses: list[float] = field(default_factory=list)
    samples_per_s: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    # Eval mode on the first ``eval_samples`` test images (0: not evaluated):
    # correct predictions, their share, and the training criterion's mean.
    eval_samples: int = 0
    eval_correct: int = 0
    eval_accuracy: float | None = None
    eval_loss: float | None = None
    eval_s: float = 0.0


def summary_line(run: RunResult, topology: str, data_kind: str, global_batch: int) -> str:
    """``cifar10 <run>: ... loss A -> B ...``: first and last 10-step mean losses."""
    window = max(1, min(_WINDOW, len(run.losses) // 2))
    first = statistics.fmean(run.losses[:window])
    last = statistics.fmean(run.losses[-window:])
    rate = len(run.losses) * global_batch / run.wall_s if run.wall_s else float("nan")
    partitioned = " +partition_activations" if run.partition_activations else ""
    evaluated = (f"; eval on {run.eval_samples} test images: accuracy {run.eval_accuracy:.2%}, "
                 f"loss {run.eval_loss:.4f}, {run.eval_s:.1f} s" if run.eval_samples else "")
    return (f"cifar10 {run.name}: {run.model}, {data_kind} data, {topology}, checkpointing={run.checkpointing}"
            f"{partitioned} (interval {run.checkpoint_interval}), {len(run.losses)} steps x "
            f"{global_batch} samples, loss {first:.4f} -> {last:.4f} (mean of first/last {window}), "
            f"{rate:.1f} samples/s, {run.wall_s:.1f} s{evaluated}")


_MODEL_NAMES = {"alexnet": "AlexNet", "resnet": "ResNet"}
_LINESTYLES = ("-", "--", ":", "-.")


def _plot_per_model(path: Path, runs: list[RunResult], models: list[str], title: str, ylabel: str) -> None:
    """``loss.png`` of a launch that trained several models: one panel per model,
    each run labelled with its largest distance from that model's first run."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, panels = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for axes, model in zip(panels[0], models):
        mine = [run for run in runs if run.model == model]
        for index, run in enumerate(mine):
            label = run.name
            if index:
                gap = max(abs(a - b) for a, b in zip(run.losses, mine[0].losses))
                label += f" (max |loss - {mine[0].name}| = {gap:.3g})"
            axes.plot(range(1, len(run.losses) + 1), run.losses, label=label, linewidth=1.2,
                      linestyle=_LINESTYLES[index % len(_LINESTYLES)])
        axes.set_xlabel("step")
        axes.set_ylabel(ylabel)
        axes.set_title(_MODEL_NAMES.get(model, model), fontsize=10)
        axes.grid(alpha=0.3)
        axes.legend(fontsize=8)
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def write_outputs(out_dir: Path, runs: list[RunResult], meta: dict) -> dict[str, Path]:
    """Write ``loss.csv``, ``loss.png`` and ``summary.json`` into ``out_dir``.

    When the runs trained more than one model, ``loss.png`` has a panel per
    model (curves are compared within a model only)."""
    models = list(dict.fromkeys(run.model for run in runs))
    names = " and ".join(_MODEL_NAMES.get(model, model) for model in models)
    title = f"CIFAR-10 {names} pipeline, {meta['topology']}, {meta['data_kind']} data"
    ylabel = f"training loss (cross-entropy, label smoothing {meta['label_smoothing']})"
    paths = write_loss_outputs(out_dir, runs, {**meta, "runs": [asdict(run) for run in runs]}, title, ylabel)
    if len(models) > 1:
        _plot_per_model(paths["png"], runs, models, title, ylabel)
    return paths
