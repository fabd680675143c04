"""``python -m benchmarks.pipeline --partition planned --budget F [F ...]``: the
planned partition (stage boundaries chosen with each stage's checkpointing,
``pipeline.partition_method = "planned"``) against DeepSpeed's
``"parameters"`` and ``"uniform"`` partitions, under the same memory budget.

The budget is one number for every stage, as for identical devices: F times
the highest stage peak without checkpointing under DeepSpeed's default
``"parameters"`` partition. Per pipeline depth:

1. One launch measures, under each DeepSpeed partition, no checkpointing and
   every uniform ``activation_checkpoint_interval`` k = 1, 2, ... (the choices
   a user has by hand): their peaks pick, per budget, the fastest that fits
   every stage (``uniform_best``).
2. Per budget, one launch runs side by side, timed round-robin: each DeepSpeed
   partition with its ``uniform_best`` and with the per-stage planner
   (``activation_checkpointing.memory_budget_mb``), and the planned partition
   with the per-stage planner (``pipeline.partition_method = "planned"``, its
   layer profile kept in ``pipeline.partition_profile`` and reused by the
   next budgets). Where a stage of a DeepSpeed partition fits no plan, its
   planner fails that launch; each configuration then runs in its own launch,
   and the one that fails is recorded with the planner's message.

Every record carries the budget, the partition and its cut; planner rows the
planner's measured steps (the first planned step included), so that steps
over budget are counted.

It starts no ranks (:mod:`benchmarks.pipeline.runner` passes the launcher
in) and prints nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from ds_pipe_ckpt.testing import RankFailure

from ..budget import PLANNED_WARMUP_STEPS, uniform_best, uniform_modes
from ..modes import Layout, PipelineMode, merge_config
from ..report import MIB, ModeSummary, summarize

__all__ = ["DEEPSPEED_PARTITIONS", "PLANNED_PARTITION", "UNIFORM_BEST", "PLANNER", "measured_modes",
           "planner_mode", "shared_budget", "partition_rows", "Launcher"]

DEEPSPEED_PARTITIONS = ("parameters", "uniform")
PLANNED_PARTITION = "planned"
UNIFORM_BEST = "uniform_best"  # the row's checkpointing: the fastest uniform interval that fits
PLANNER = "planner"  # the row's checkpointing: the per-stage planner under the budget

# Runs one launch of rank processes for a layout and its modes; raises RankFailure.
Launcher = Callable[[Layout, Sequence[PipelineMode]], list[dict]]


def _on_partition(partition: str, mode: PipelineMode) -> PipelineMode:
    """``mode`` under ``partition``: its name prefixed, the method in its config."""
    return PipelineMode(f"{partition}:{mode.name}", f"{mode.description}, partition_method {partition!r}",
                        merge_config(mode.config, {"pipeline": {"partition_method": partition}}),
                        warmup_steps=mode.warmup_steps)


def measured_modes(max_interval: int) -> tuple[PipelineMode, ...]:
    """Per DeepSpeed partition: no checkpointing and uniform intervals 1 .. ``max_interval``."""
    none = PipelineMode("none", "no activation checkpointing", {"pipeline": {"activation_checkpoint_interval": 0}})
    return tuple(_on_partition(partition, mode) for partition in DEEPSPEED_PARTITIONS
                 for mode in (none, *uniform_modes(max_interval)))


def planner_mode(partition: str, budget_bytes: int, fraction: float, profile_path: str) -> PipelineMode:
    """The per-stage planner under ``budget_bytes`` on every stage, the stages
    cut by ``partition`` (``"planned"``: with the planner's profile at ``profile_path``)."""
    pipeline: dict = {"activation_checkpoint_interval": 0, "use_reentrant": False}
    if partition == PLANNED_PARTITION:
        pipeline["partition_profile"] = profile_path
    mode = PipelineMode(PLANNER, f"memory_budget_mb = {fraction:g} x the highest stage peak without checkpointing",
                        {"pipeline": pipeline, "activation_checkpointing": {"memory_budget_mb": budget_bytes / MIB}},
                        warmup_steps=PLANNED_WARMUP_STEPS)
    return _on_partition(partition, mode)


def shared_budget(none: ModeSummary, fraction: float) -> int:
    """``fraction`` of the highest stage peak of ``none``, in bytes."""
    if not fraction > 0:
        raise ValueError(f"a budget fraction must be positive, got {fraction}")
    return int(fraction * max(none.peak_bytes_by_stage.values()))


@dataclass(frozen=True)
class _Row:
    """One configuration of a budget's comparison: its mode and how it is tagged."""

    mode: PipelineMode
    partition: str
    checkpointing: str  # UNIFORM_BEST or PLANNER


def _tagged(records: list[dict], row: _Row, pp: int, fraction: float, budget: int) -> list[dict]:
    return [r | {"partition": row.partition, "checkpointing": row.checkpointing, "budget_fraction": fraction,
                 "budget_bytes": budget, "row": f"{row.partition} + {row.checkpointing}"}
            | ({"uniform_mode": r["mode"].split(":", 1)[1]} if row.checkpointing == UNIFORM_BEST else {})
            for r in records if r.get("pp") == pp and r.get("mode") == row.mode.name]


def _unavailable(partition: str, checkpointing: str, pp: int, fraction: float, budget: int, reason: str) -> dict:
    return {"pp": pp, "mp": 1, "mode": f"{partition}:{checkpointing}", "rank": 0, "partition": partition,
            "checkpointing": checkpointing, "budget_fraction": fraction, "budget_bytes": budget,
            "row": f"{partition} + {checkpointing}", "unavailable": reason}


def partition_rows(pp: int, fractions: Sequence[float], blocks: int, launch: Launcher, profile_path: str,
                   root_error: Callable[[str], str]) -> list[dict]:
    """Every record of the comparison at depth ``pp`` (module docstring):
    the measured modes untagged, then per budget fraction the tagged rows
    (``partition``, ``checkpointing``, ``budget_fraction``, ``budget_bytes``)
    or one ``unavailable`` record per row that could not run."""
    candidates = measured_modes(-(-blocks // pp) + 2)
    measured = launch(Layout(pp, 1, tuple(m.name for m in candidates)), candidates)
    summaries = summarize(measured)
    by_name = {s.mode: s for s in summaries if s.pp == pp}
    none = by_name.get(f"{DEEPSPEED_PARTITIONS[0]}:none")
    if none is None:
        raise RuntimeError(f"pp={pp}: the {DEEPSPEED_PARTITIONS[0]} partition without checkpointing was not "
                           "measured; its peak sets the budgets")
    records = list(measured)
    mode_of = {m.name: m for m in candidates}
    for fraction in fractions:
        budget = shared_budget(none, fraction)
        rows: list[_Row] = []
        missing: list[dict] = []
        for partition in DEEPSPEED_PARTITIONS:
            mine = [s for name, s in by_name.items() if name.startswith(f"{partition}:")]
            best = uniform_best(mine, {stage: budget for stage in none.peak_bytes_by_stage})
            if best is None:
                missing.append(_unavailable(partition, UNIFORM_BEST, pp, fraction, budget,
                                            "no uniform interval (nor none) fits the budget on every stage"))
            else:
                rows.append(_Row(mode_of[best.mode], partition, UNIFORM_BEST))
        rows += [_Row(planner_mode(p, budget, fraction, profile_path), p, PLANNER)
                 for p in (*DEEPSPEED_PARTITIONS, PLANNED_PARTITION)]
        records += missing + _run_rows(rows, pp, fraction, budget, launch, root_error)
    return records


def _run_rows(rows: list[_Row], pp: int, fraction: float, budget: int, launch: Launcher,
              root_error: Callable[[str], str]) -> list[dict]:
    """All rows in one launch; where it fails, each row in its own."""
    try:
        measured = launch(Layout(pp, 1, tuple(r.mode.name for r in rows)), [r.mode for r in rows])
        return [record for row in rows for record in _tagged(measured, row, pp, fraction, budget)]
    except RankFailure:
        pass
    records = []
    for row in rows:
        try:
            records += _tagged(launch(Layout(pp, 1, (row.mode.name,)), [row.mode]), row, pp, fraction, budget)
        except RankFailure as failure:
            records.append(_unavailable(row.partition, row.checkpointing, pp, fraction, budget,
                                        root_error(str(failure))))
    return records
