"""Outputs of a GPT training launch: ``loss.csv``, ``loss.png``, ``summary.json``
and the one-line summary printed per run."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from examples.outputs import write_loss_outputs
from examples.training import MIB, RunResult
from examples.training import summary_line as _summary_line

__all__ = ["RunResult", "summary_line", "write_outputs", "MIB"]


def summary_line(run: RunResult, topology: str, global_batch: int, context: int) -> str:
    """``gpt <run>: ... loss A -> B ..., peak MiB by stage ...``."""
    return _summary_line("gpt", run, topology, global_batch, context)


def write_outputs(out_dir: Path, runs: list[RunResult], meta: dict) -> dict[str, Path]:
    """Write ``loss.csv``, ``loss.png`` and ``summary.json``
    (``{"meta": meta, "runs": [...]}``) into ``out_dir``; return their paths."""
    return write_loss_outputs(out_dir, runs, {"meta": meta, "runs": [asdict(run) for run in runs]},
                              f"GPT pipeline on Python stdlib bytes, {meta['topology']}",
                              "training loss (next-byte cross-entropy, nats)")
