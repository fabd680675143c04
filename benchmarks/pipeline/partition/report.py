"""The report of ``python -m benchmarks.pipeline --partition planned``
(:mod:`benchmarks.pipeline.partition.runner`): one table per pipeline depth and
budget, the target line and a plot.

It measures nothing and prints nothing itself: :mod:`benchmarks.pipeline.runner`
prints what it returns.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from typing import Sequence

from .runner import DEEPSPEED_PARTITIONS, PLANNED_PARTITION, PLANNER, UNIFORM_BEST
from ..report import MIB, ModeSummary, summarize

__all__ = ["PARTITION_TARGET", "RowResult", "comparison", "partition_markdown", "partition_document",
           "write_partition_png"]

# The planned partition's step time over the best of DeepSpeed's partitions
# (each with its best uniform interval or the per-stage planner) at half the
# no-checkpoint peak.
PARTITION_TARGET = 0.85
TARGET_FRACTION = 0.5
ROW_ORDER = tuple((p, c) for p in DEEPSPEED_PARTITIONS for c in (UNIFORM_BEST, PLANNER)) + \
    ((PLANNED_PARTITION, PLANNER),)


@dataclass(frozen=True)
class RowResult:
    """One row of a (pp, budget) comparison: its summary, or why it did not run."""

    partition: str
    checkpointing: str
    summary: ModeSummary | None
    parts: tuple[int, ...] | None
    reason: str | None
    partition_plan: dict | None

    @property
    def label(self) -> str:
        return f"{self.partition} + {self.checkpointing}"

    @property
    def step_s(self) -> float | None:
        return None if self.summary is None else self.summary.step_time_s

    def over_budget(self, budget: int) -> list[tuple[int, int, int]]:
        """``(stage, step, peak)`` of every measured step over ``budget``: the
        planner's checked steps and the benchmark's, or the measured step."""
        s = self.summary
        if s is None:
            return []
        if s.planned_steps_by_stage:
            return s.over_budget_steps
        return [(stage, 0, peak) for stage, peak in s.peak_bytes_by_stage.items() if peak > budget]

    def steps_measured(self) -> int:
        s = self.summary
        if s is None:
            return 0
        return s.planned_steps_measured or len(s.peak_bytes_by_stage)


def comparison(records: Sequence[dict]) -> dict[tuple[int, float], tuple[int, list[RowResult]]]:
    """Per (pp, budget fraction): the budget in bytes and the rows, in table order."""
    tagged = [r for r in records if "checkpointing" in r]
    summaries = {(s.pp, s.mode, s.budget_fraction): s for s in summarize(tagged)}
    result: dict[tuple[int, float], tuple[int, list[RowResult]]] = {}
    for key in sorted({(r["pp"], r["budget_fraction"]) for r in tagged}):
        group = [r for r in tagged if (r["pp"], r["budget_fraction"]) == key]
        rows = []
        for partition, checkpointing in ROW_ORDER:
            mine = [r for r in group if (r["partition"], r["checkpointing"]) == (partition, checkpointing)]
            if not mine:
                continue
            measured = [r for r in mine if "unavailable" not in r]
            reason = None if measured else mine[0]["unavailable"]
            summary = summaries.get((key[0], measured[0]["mode"], key[1])) if measured else None
            parts = tuple(measured[0]["parts"]) if measured else None
            plan = next((r["partition_plan"] for r in measured if "partition_plan" in r), None)
            rows.append(RowResult(partition, checkpointing, summary, parts, reason, plan))
        result[key] = (group[0]["budget_bytes"], rows)
    return result


def _cut(parts: tuple[int, ...] | None) -> str:
    return "-" if parts is None else "/".join(str(b - a) for a, b in zip(parts, parts[1:]))


def _best_deepspeed(rows: Sequence[RowResult]) -> RowResult | None:
    timed = [r for r in rows if r.partition != PLANNED_PARTITION and r.step_s is not None]
    return min(timed, key=lambda r: r.step_s) if timed else None


def target_line(pp: int, fraction: float, rows: Sequence[RowResult], budget: int) -> str:
    planned = next((r for r in rows if r.partition == PLANNED_PARTITION), None)
    best = _best_deepspeed(rows)
    over = sum(len(r.over_budget(budget)) for r in rows if r.checkpointing == PLANNER)
    if planned is None or planned.step_s is None:
        verdict = "not measured (the planned partition did not run)"
    elif best is None:
        verdict = "met: no DeepSpeed partition runs within this budget, the planned one does"
    else:
        ratio = planned.step_s / best.step_s
        verdict = (f"{'met' if ratio <= PARTITION_TARGET else 'MISSED'} (planned {ratio:.2f} x the best of "
                   f"DeepSpeed's, {best.label})")
    return (f"- pp={pp}, budget {fraction:g} x: planned partition <= {PARTITION_TARGET} x the best DeepSpeed "
            f"partition: {verdict}; planner steps over budget: {over}")


def _table(pp: int, fraction: float, budget: int, rows: Sequence[RowResult]) -> list[str]:
    planned = next((r for r in rows if r.partition == PLANNED_PARTITION and r.step_s is not None), None)
    lines = [f"### pp={pp}, budget {fraction:g} x = {budget / MIB:.2f} MiB on every stage", "",
             "| partition | checkpointing | layers per stage | step ms | ÷ planned | peak MiB by stage "
             "| worst planned step MiB by stage | steps over budget |",
             "|---|---|---|---:|---:|---|---|---:|"]
    for row in rows:
        s = row.summary
        what = row.checkpointing + (f" ({s.uniform_mode})" if s is not None and s.uniform_mode else "")
        if s is None:
            reason = (row.reason or "did not run").replace("|", "/")
            lines.append(f"| {row.partition} | {what} | - | - | - | {textwrap.shorten(reason, 220)} | - | - |")
            continue
        ratio = f"{s.step_time_s / planned.step_s:.2f}" if planned is not None else "-"
        worst = s.worst_step_by_stage
        lines.append(f"| {row.partition} | {what} | {_cut(row.parts)} | {s.step_time_s * 1e3:.0f} | {ratio} "
                     f"| {', '.join(f'{v / MIB:.1f}' for v in s.peak_bytes_by_stage.values())} "
                     f"| {', '.join(f'{v / MIB:.1f}' for v in worst.values()) if worst else '-'} "
                     f"| {len(row.over_budget(budget))} of {row.steps_measured()} |")
    if planned is not None and planned.partition_plan:
        plan = planned.partition_plan
        lines += ["", f"The planned cut's model: stage times {', '.join(f'{t * 1e3:.0f}' for t in plan['stage_seconds'])}"
                      f" ms per micro-batch, 1F1B step {plan['step_seconds'] * 1e3:.0f} ms; predicted peaks "
                      f"{', '.join(f'{b / MIB:.1f}' for b in plan['predicted_peak_bytes'])} MiB (profile "
                      f"{plan['profile_source'].split(';')[0]})."]
    return lines + [""]


def partition_markdown(records: Sequence[dict], machine: dict) -> str:
    """The comparison tables and the target lines."""
    groups = comparison(records)
    lines = [f"## Planned partition against DeepSpeed's ({machine['model']})", "",
             f"{machine['device']}, {machine.get('torch_threads', '?')} thread(s) per rank; "
             f"{machine['micro_batch']} sequences per micro-batch, 2 x pp micro-batches per step; "
             f"{machine['timed_steps']} timed steps per row, round-robin within a launch. Command: "
             f"`{machine['command']}`.", ""]
    for (pp, fraction), (budget, rows) in groups.items():
        lines += _table(pp, fraction, budget, rows)
    lines += ["Targets:"] + [target_line(pp, fraction, rows, budget) for (pp, fraction), (budget, rows)
                             in groups.items() if fraction == TARGET_FRACTION] + [""]
    others = [target_line(pp, fraction, rows, budget) for (pp, fraction), (budget, rows) in groups.items()
              if fraction != TARGET_FRACTION]
    if others:
        lines += ["Other budgets:"] + others + [""]
    return "\n".join(lines)


def partition_document(records: Sequence[dict], machine: dict) -> dict:
    """The JSON document: ``{"machine", "results", "unavailable", "targets"}``
    (``targets``: the target line of every pipeline depth and budget)."""
    return {"machine": machine,
            "results": [r for r in records if "unavailable" not in r],
            "unavailable": [r for r in records if "unavailable" in r],
            "targets": [target_line(pp, fraction, rows, budget)
                        for (pp, fraction), (budget, rows) in comparison(records).items()]}


def write_partition_png(path: str, records: Sequence[dict], machine: dict) -> None:
    """Step time of every row, one group per budget, one panel per pipeline depth;
    a row that does not fit the budget is marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = comparison(records)
    depths = sorted({pp for pp, _ in groups})
    if not depths:
        return
    figure, axes = plt.subplots(1, len(depths), figsize=(6.5 * len(depths), 5.0), squeeze=False)
    colors = {key: f"C{i}" for i, key in enumerate(ROW_ORDER)}
    for axis, pp in zip(axes[0], depths):
        fractions = sorted(f for p, f in groups if p == pp)
        width = 0.8 / len(ROW_ORDER)
        for g, fraction in enumerate(fractions):
            _, rows = groups[(pp, fraction)]
            present = {(r.partition, r.checkpointing): r for r in rows}
            for i, key in enumerate(ROW_ORDER):
                x = g - 0.4 + width * (i + 0.5)
                row = present.get(key)
                label = f"{key[0]} + {key[1]}" if g == 0 else None
                if row is None or row.step_s is None:
                    axis.bar(x, 0, width, color=colors[key], label=label)
                    axis.text(x, 0, "x", ha="center", va="bottom", fontsize=9, color=colors[key])
                else:
                    axis.bar(x, row.step_s * 1e3, width, color=colors[key], label=label)
        axis.set_xticks(range(len(fractions)), [f"{f:g} x" for f in fractions])
        axis.set_xlabel("budget per stage, x the highest peak without checkpointing\n(a bar marked x: does not fit)")
        axis.set_ylabel("step time, ms (median)")
        axis.set_title(f"pp = {pp}")
        axis.grid(axis="y", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="lower center", ncol=len(ROW_ORDER), fontsize=8, frameon=False)
    title = f"Planned partition against DeepSpeed's ({machine['model']}; {machine['device']})"
    figure.suptitle(textwrap.fill(title, width=int(14 * figure.get_figwidth())), fontsize=9)
    figure.tight_layout(rect=(0, 0.07, 1, 1))
    figure.savefig(path, dpi=120)
    plt.close(figure)
