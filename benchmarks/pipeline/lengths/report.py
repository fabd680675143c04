"""Present ``python -m benchmarks.pipeline --lengths`` results
(:mod:`benchmarks.pipeline.lengths.runner`): one table per pipeline depth and budget,
the target line (the adaptive plan's mean step time at most 0.90 x the static
plan's, with no step over budget) and the JSON document. Pure functions of
the per-rank records.

It measures nothing and prints nothing itself: :mod:`benchmarks.pipeline.runner`
prints what it returns.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Mapping, Sequence

from .runner import ADAPTIVE, NONE, STATIC, UNIFORM_BEST, LengthSchedule
from ..report import MIB, infeasible_minimum

__all__ = ["TARGET_RATIO", "LengthRow", "comparison", "target_line", "lengths_markdown", "lengths_document"]

TARGET_RATIO = 0.90
ROW_ORDER = (NONE, UNIFORM_BEST, STATIC, ADAPTIVE)
PLANNED_ROWS = (ADAPTIVE, STATIC)


@dataclass(frozen=True)
class LengthRow:
    """One configuration of a (pp, budget) comparison, over its ranks.

    Attributes:
        config: none, uniform_best, static or adaptive.
        mode: the run's mode (uniform_best: the interval chosen).
        step_times_s: per timed step, the slowest rank's time.
        peaks_by_stage: per stage, ``(step, peak bytes)`` of every measured step
            (the planner's own first, for planned rows), the largest over the stage's ranks.
        planning_s: the planner's own time over the run, the largest over the stages.
        length_plans: per stage, the plan of each length bucket (planned rows).
        bucket_peaks: per stage (planned rows), per length bucket ``(edge, predicted
            peak, measured peak or None)``: the plan's prediction for a step whose
            longest micro-batch is in the bucket, and the highest measured planned
            step (from the first planned one) whose longest micro-batch was.
        reason: why the row did not run (e.g. the planner refused the budget), else None.
    """

    config: str
    mode: str | None = None
    step_times_s: tuple[float, ...] = ()
    peaks_by_stage: Mapping[int, tuple[tuple[int, int], ...]] = dataclasses.field(default_factory=dict)
    planning_s: float | None = None
    length_plans: Mapping[int, tuple[dict, ...]] = dataclasses.field(default_factory=dict)
    bucket_peaks: Mapping[int, tuple[tuple[int, int, int | None], ...]] = dataclasses.field(default_factory=dict)
    reason: str | None = None

    @property
    def step_s(self) -> float | None:
        """The mean step time, or None when nothing was timed."""
        return sum(self.step_times_s) / len(self.step_times_s) if self.step_times_s else None

    @property
    def steps_measured(self) -> int:
        return sum(len(steps) for steps in self.peaks_by_stage.values())

    def over_budget(self, budgets: Sequence[int]) -> list[tuple[int, int, int]]:
        """``(stage, step, peak)`` of every measured step above its stage's budget."""
        return [(stage, step, peak) for stage, steps in self.peaks_by_stage.items() for step, peak in steps
                if peak > budgets[stage]]

    def worst_by_stage(self) -> dict[int, int]:
        return {stage: max(peak for _, peak in steps) for stage, steps in self.peaks_by_stage.items() if steps}


def _row(config: str, records: Sequence[dict]) -> LengthRow:
    """The row of one run's records (one per rank)."""
    missing = [r for r in records if "unavailable" in r]
    if missing:
        return LengthRow(config, records[0]["mode"], reason=missing[0]["unavailable"])
    timed = [r["step_times_s"] for r in records]
    peaks: dict[int, dict[int, int]] = {}
    for record in records:
        slot = peaks.setdefault(record["stage"], {})
        for entry in record["step_peaks"]:
            slot[entry["step"]] = max(entry["peak_bytes"], slot.get(entry["step"], 0))
    planning = [r["planning_s"] for r in records if "planning_s" in r]
    return LengthRow(config, records[0]["mode"], tuple(max(times) for times in zip(*timed)),
                     {stage: tuple(sorted(slot.items())) for stage, slot in sorted(peaks.items())},
                     max(planning) if planning else None,
                     {r["stage"]: tuple(r["length_plans"]) for r in records if r.get("length_plans")},
                     {r["stage"]: _bucket_peaks(r) for r in records if r.get("length_plans")})


# The planner's own steps before its first plan (step 0, the measuring step): not planned steps.
_FIRST_PLANNED_STEP = 2


def _bucket_peaks(record: dict) -> tuple[tuple[int, int, int | None], ...]:
    """One rank's ``(edge, predicted, measured or None)`` per length bucket (:class:`LengthRow`)."""
    plans = sorted(record["length_plans"], key=lambda plan: plan["length"])
    measured: dict[int, int] = {}
    for entry in record["step_peaks"]:
        if entry["step"] < _FIRST_PLANNED_STEP:
            continue
        edge = next(plan["length"] for plan in plans if plan["length"] >= max(entry["lengths"]))
        measured[edge] = max(entry["peak_bytes"], measured.get(edge, 0))
    return tuple((plan["length"], plan["predicted_peak_bytes"], measured.get(plan["length"])) for plan in plans)


def comparison(records: Sequence[dict]) -> dict[tuple[int, float], tuple[list[int], list[LengthRow]]]:
    """Per (pp, budget fraction), in order: each stage's budget (bytes, stage 0
    first) and the rows of :data:`ROW_ORDER` that the launch ran or refused."""
    runs = [r for r in records if r.get("record") == "run"]
    groups = {}
    for choice in (r for r in records if r.get("record") == "choice"):
        pp, fraction = choice["pp"], choice["budget_fraction"]
        mine = [r for r in runs if r["pp"] == pp]
        rows = [_row(NONE, [r for r in mine if r["mode"] == NONE])]
        if choice["uniform_mode"] is None:
            rows.append(LengthRow(UNIFORM_BEST, reason="no uniform interval (nor none) fits the budget on every stage"))
        else:
            rows.append(_row(UNIFORM_BEST, [r for r in mine if r["mode"] == choice["uniform_mode"]]))
        rows += [_row(config, [r for r in mine if r["config"] == config and r["budget_fraction"] == fraction])
                 for config in (STATIC, ADAPTIVE)]
        groups[(pp, fraction)] = (list(choice["budgets_bytes"]), rows)
    return groups


def _reason(row: LengthRow) -> str:
    """Why a row did not run: the planner's least budget when it refused, else the reason as given."""
    minimum = infeasible_minimum(row.reason or "")
    if minimum is None:
        return str(row.reason)
    return f"the planner refused: stage {minimum[0]} needs at least {minimum[1]:.2f} MiB"


def _find(rows: Sequence[LengthRow], config: str) -> LengthRow | None:
    return next((row for row in rows if row.config == config), None)


def target_line(pp: int, fraction: float, rows: Sequence[LengthRow], budgets: Sequence[int]) -> str:
    """``adaptive / static = X (target <= 0.90): met|missed``, met when the
    ratio of mean step times is at most the target and no measured step of
    either planned row exceeded its stage's budget."""
    head = f"- pp={pp}, budget {fraction:g} x:"
    adaptive, static = _find(rows, ADAPTIVE), _find(rows, STATIC)
    absent = [row for row in (adaptive, static) if row is None or row.step_s is None]
    if absent:
        reasons = "; ".join(f"{row.config}: {_reason(row)}" for row in absent if row is not None)
        return f"{head} adaptive / static (target <= {TARGET_RATIO:.2f}): not measured ({reasons or 'not run'})"
    ratio = adaptive.step_s / static.step_s
    over = {row.config: len(row.over_budget(budgets)) for row in (adaptive, static)}
    met = ratio <= TARGET_RATIO and not any(over.values())
    return (f"{head} adaptive / static = {ratio:.2f} (target <= {TARGET_RATIO:.2f}): {'met' if met else 'missed'}; "
            f"steps over budget: adaptive {over[ADAPTIVE]}, static {over[STATIC]}")


def _ms(row: LengthRow) -> str:
    if row.step_s is None:
        return "-"
    return f"{row.step_s * 1e3:.0f} ({min(row.step_times_s) * 1e3:.0f}-{max(row.step_times_s) * 1e3:.0f})"


def _table(pp: int, fraction: float, budgets: Sequence[int], rows: Sequence[LengthRow]) -> list[str]:
    static = _find(rows, STATIC)
    reference = static.step_s if static is not None else None
    lines = [f"### pp={pp}, budget {fraction:g} x: " + ", ".join(f"{b / MIB:.2f}" for b in budgets)
             + " MiB by stage", "",
             "| configuration | mean step ms (min-max) | ÷ static | steps over budget / measured "
             "| worst step ÷ budget, by stage | planner s |",
             "|---|---:|---:|---:|---|---:|"]
    for row in rows:
        name = f"{row.config} ({row.mode})" if row.config == UNIFORM_BEST and row.mode else row.config
        if row.reason is not None:
            lines.append(f"| {name} | not available: {_reason(row)} | | | | |")
            continue
        ratio = f"{row.step_s / reference:.2f}" if reference and row.step_s else "-"
        worst = ", ".join(f"{peak / budgets[stage]:.2f}" for stage, peak in row.worst_by_stage().items())
        planner = f"{row.planning_s:.2f}" if row.planning_s is not None else "-"
        lines.append(f"| {name} | {_ms(row)} | {ratio} | {len(row.over_budget(budgets))} / {row.steps_measured} "
                     f"| {worst} | {planner} |")
    none = _find(rows, NONE)
    if none is not None and none.step_s and static is not None and static.step_s:
        lines += ["", f"Static's mean step over none's (no checkpointing) on the same lengths: "
                      f"{static.step_s / none.step_s:.2f} x: at most {1 - none.step_s / static.step_s:.0%} of a "
                      "static step is checkpointing's cost (recomputation), the most an adaptive plan can save."]
    for row in rows:
        for stage, plans in row.length_plans.items():
            buckets = "; ".join(f"<= {p['length']}: {p['stored']}/{p['checkpointed']}/{p['selective']}, "
                                f"{p['recompute_s'] * 1e3:.1f} ms" for p in plans)
            lines.append(f"- {row.config}, stage {stage}: layers stored/checkpointed/selective and recomputation "
                         f"per micro-batch, by length: {buckets}")
        for stage, buckets in row.bucket_peaks.items():
            peaks = "; ".join(f"<= {edge}: {predicted / MIB:.2f} / "
                              + ("not seen" if measured is None else f"{measured / MIB:.2f}")
                              for edge, predicted, measured in buckets)
            lines.append(f"- {row.config}, stage {stage}: predicted / measured peak MiB of a planned step, by the "
                         f"bucket of its longest micro-batch: {peaks}")
    return lines + [""]


def _schedule_line(pp: int, schedule: LengthSchedule) -> str:
    return (f"pp={pp}: {len(schedule.steps[0]) if schedule.steps else 0} micro-batches per step, lengths "
            f"drawn uniformly from [{schedule.min_length}, {schedule.max_length}]; {len(schedule.warmup)} warm-up, "
            f"{len(schedule.measured)} measured and {len(schedule.timed)} timed steps per configuration, the same "
            "lengths in the same order for each.")


def lengths_markdown(records: Sequence[dict], machine: dict, schedules: Mapping[int, LengthSchedule]) -> str:
    """The tables, the launch failures and the target lines."""
    groups = comparison(records)
    lines = [f"## Variable-length micro-batches: adaptive plans against a static plan for the maximum "
             f"({machine['model']})", "",
             f"{machine['device']}, {machine.get('torch_threads', '?')} thread(s) per rank; "
             f"{machine['micro_batch']} sequences per micro-batch. Command: `{machine['command']}`.", ""]
    lines += [_schedule_line(pp, schedule) for pp, schedule in schedules.items()] + [""]
    lines += ["Budget: F x each stage's peak without checkpointing on a step at the maximum length. Peaks: "
              "bytes allocated above a step's start, around `train_batch` (the planner's own steps: step 0 less "
              "the optimizer state it allocates once, the measuring step, each checked planned step). "
              "Step time: per timed step the slowest rank's, averaged; no profiler. "
              "none runs without a budget: its count shows how many steps the budget binds.", ""]
    for (pp, fraction), (budgets, rows) in groups.items():
        lines += _table(pp, fraction, budgets, rows)
    lines += [f"- pp={r['pp']}: the launch failed: {r['unavailable']}" for r in records
              if r.get("record") == "launch"]
    lines += ["Targets:"] + [target_line(pp, fraction, rows, budgets)
                             for (pp, fraction), (budgets, rows) in groups.items()]
    return "\n".join(lines) + "\n"


def lengths_document(records: Sequence[dict], machine: dict, schedules: Mapping[int, LengthSchedule]) -> dict:
    """The JSON document: ``{"machine", "schedules", "results", "unavailable", "rows", "targets"}``."""
    groups = comparison(records)
    return {"machine": machine,
            "schedules": {str(pp): dataclasses.asdict(s) for pp, s in schedules.items()},
            "results": [r for r in records if "unavailable" not in r],
            "unavailable": [r for r in records if "unavailable" in r],
            "rows": [{"pp": pp, "budget_fraction": fraction, "budgets_bytes": budgets}
                     | dataclasses.asdict(row) | {"mean_step_time_s": row.step_s,
                                                   "steps_over_budget": len(row.over_budget(budgets)),
                                                   "steps_measured": row.steps_measured}
                     for (pp, fraction), (budgets, rows) in groups.items() for row in rows],
            "targets": [target_line(pp, fraction, rows, budgets)
                        for (pp, fraction), (budgets, rows) in groups.items()]}
