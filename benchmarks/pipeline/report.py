"""Present ``python -m benchmarks.pipeline`` results: per-stage summaries, the
markdown tables (the 1F1B imbalance across stages), the targets, the JSON
document and the grouped-bar plot. Pure functions of the per-rank records.

It measures nothing and prints nothing itself: :mod:`benchmarks.pipeline.runner`
prints what it returns.
"""

from __future__ import annotations

import json
import re
import textwrap
from dataclasses import asdict, dataclass
from typing import Iterable, Sequence

from ds_pipe_ckpt.planning.stage_budget import PREDICTION_TOLERANCE

__all__ = ["ModeSummary", "TargetCheck", "summarize", "check_targets", "check_budget_targets", "markdown",
           "document", "write_json", "write_png", "write_budget_png", "MIB"]

MIB = 2**20
BASELINE = "none"
FULL = "non_reentrant"
SELECTIVE = "selective"
# Modes whose peak must be below the baseline's on every stage.
MEMORY_TARGET_MODES = (FULL, SELECTIVE)


@dataclass(frozen=True)
class ModeSummary:
    """One mode at one topology, across its ranks.

    Attributes:
        peak_bytes_by_stage: the largest peak over each stage's ranks.
        in_flight_by_stage: micro-batches of forward state each stage holds (1F1B).
        step_time_s: the largest of the ranks' median step times (a pipeline
            step is as slow as its slowest rank).
        step_time_min_s, step_time_max_s: over every rank's timed steps.
        net_bytes: the largest |bytes left allocated by the measured step|
            over the ranks; about 0 in a steady state.
        budget_fraction: for the ``--budget`` rows (``planned``, ``uniform_best``),
            the budget as a fraction of each stage's peak without checkpointing.
        budget_bytes_by_stage, predicted_peak_bytes_by_stage: those rows' budgets
            and (``planned``) the plan's predictions.
        uniform_mode: for ``uniform_best``, the uniform mode it is.
        planned_steps_by_stage: for ``planned``, every planned step measured on
            each stage (the planner's checks, the first planned step first, then
            the benchmark's measured step), as ``(step, peak, predicted)`` bytes,
            the largest peak over the stage's ranks.
        measuring_peak_bytes_by_stage: for ``planned``, the planner's measuring
            step (every layer checkpointed).
    """

    pp: int
    mp: int
    mode: str
    micro_batches: int
    peak_bytes_by_stage: dict[int, int]
    in_flight_by_stage: dict[int, int]
    step_time_s: float
    step_time_min_s: float
    step_time_max_s: float
    net_bytes: int
    budget_fraction: float | None = None
    budget_bytes_by_stage: dict[int, int] | None = None
    predicted_peak_bytes_by_stage: dict[int, int] | None = None
    uniform_mode: str | None = None
    planned_steps_by_stage: dict[int, tuple[tuple[int, int, int], ...]] | None = None
    measuring_peak_bytes_by_stage: dict[int, int] | None = None

    @property
    def over_budget_steps(self) -> list[tuple[int, int, int]]:
        """``(stage, step, peak)`` of every measured planned step above its stage's budget."""
        budgets = self.budget_bytes_by_stage or {}
        return [(stage, step, peak) for stage, steps in (self.planned_steps_by_stage or {}).items()
                for step, peak, _ in steps if peak > budgets[stage]]

    @property
    def planned_steps_measured(self) -> int:
        return sum(len(steps) for steps in (self.planned_steps_by_stage or {}).values())

    @property
    def worst_step_by_stage(self) -> dict[int, int]:
        """Per stage, the largest peak of its measured planned steps."""
        return {stage: max(peak for _, peak, _ in steps) for stage, steps in (self.planned_steps_by_stage or {}).items()
                if steps}

    @property
    def prediction_errors(self) -> list[float]:
        """``(predicted - measured) / measured`` of every measured planned step
        (negative: the step used more than predicted)."""
        return [(predicted - peak) / peak for steps in (self.planned_steps_by_stage or {}).values()
                for _, peak, predicted in steps if peak]

    @property
    def imbalance(self) -> float:
        """First stage's peak over the last stage's."""
        stages = sorted(self.peak_bytes_by_stage)
        last = self.peak_bytes_by_stage[stages[-1]]
        return self.peak_bytes_by_stage[stages[0]] / last if last else float("inf")


@dataclass(frozen=True)
class TargetCheck:
    """One target: ``met`` is None when a mode it needs was not measured."""

    pp: int
    target: str
    met: bool | None
    detail: str

    def line(self) -> str:
        verdict = {True: "met", False: "MISSED", None: "not measured"}[self.met]
        return f"- pp={self.pp}: {self.target}: {verdict} ({self.detail})"


def summarize(records: Iterable[dict]) -> list[ModeSummary]:
    """One :class:`ModeSummary` per (pp, mp, mode) of the measured records, in
    order of first appearance. Records with an ``unavailable`` key are skipped."""
    groups: dict[tuple[int, int, str, float | None], list[dict]] = {}
    for record in records:
        if "unavailable" not in record:
            key = (record["pp"], record["mp"], record["mode"], record.get("budget_fraction"))
            groups.setdefault(key, []).append(record)
    summaries = []
    for (pp, mp, mode, fraction), group in groups.items():
        peaks: dict[int, int] = {}
        in_flight: dict[int, int] = {}
        for record in group:
            peaks[record["stage"]] = max(record["peak_bytes"], peaks.get(record["stage"], 0))
            in_flight[record["stage"]] = record["micro_batches_in_flight"]
        samples = [t for record in group for t in record["step_times_s"]]
        budgets = {r["stage"]: r["budget_bytes"] for r in group if "budget_bytes" in r} or None
        predicted = {r["stage"]: r["predicted_peak_bytes"] for r in group if "predicted_peak_bytes" in r} or None
        steps, measuring = _planned_steps(group)
        summaries.append(ModeSummary(
            pp=pp, mp=mp, mode=mode, micro_batches=group[0]["micro_batches"],
            peak_bytes_by_stage=dict(sorted(peaks.items())), in_flight_by_stage=dict(sorted(in_flight.items())),
            step_time_s=max(record["step_time_s"] for record in group),
            step_time_min_s=min(samples), step_time_max_s=max(samples),
            net_bytes=max(abs(record["step_net_bytes"]) for record in group),
            budget_fraction=fraction,
            budget_bytes_by_stage=dict(sorted(budgets.items())) if budgets else None,
            predicted_peak_bytes_by_stage=dict(sorted(predicted.items())) if predicted else None,
            uniform_mode=group[0].get("uniform_mode"),
            planned_steps_by_stage=steps, measuring_peak_bytes_by_stage=measuring))
    return summaries


def _planned_steps(group: Sequence[dict]) -> tuple[dict | None, dict | None]:
    """Per stage, the measured planned steps (largest peak over the stage's ranks
    per step) and the measuring step's peak, from the records' ``step_peaks``."""
    by_stage: dict[int, dict[int, tuple[int, int, int]]] = {}
    measuring: dict[int, int] = {}
    for record in group:
        for entry in record.get("step_peaks", ()):
            stage, step, peak = record["stage"], entry["step"], entry["peak_bytes"]
            if entry["kind"] == "measuring":
                measuring[stage] = max(peak, measuring.get(stage, 0))
                continue
            slot = by_stage.setdefault(stage, {})
            if step not in slot or peak > slot[step][1]:
                slot[step] = (step, peak, entry["predicted_bytes"])
    steps = {stage: tuple(slot[step] for step in sorted(slot)) for stage, slot in sorted(by_stage.items())}
    return steps or None, dict(sorted(measuring.items())) or None


def _find(summaries: Sequence[ModeSummary], pp: int, mode: str, fraction: float | None = None) -> ModeSummary | None:
    return next((s for s in summaries if s.pp == pp and s.mode == mode and s.budget_fraction == fraction), None)


def check_targets(summaries: Sequence[ModeSummary]) -> list[TargetCheck]:
    """Per pp: non-reentrant and selective checkpointing lower every stage's
    peak below no checkpointing; selective's median step time lies between no
    checkpointing and full (non-reentrant) checkpointing."""
    checks = []
    for pp in sorted({s.pp for s in summaries}):
        none = _find(summaries, pp, BASELINE)
        for name in MEMORY_TARGET_MODES:
            target = f"{name} peak < {BASELINE} peak on every stage"
            mode = _find(summaries, pp, name)
            if none is None or mode is None:
                checks.append(TargetCheck(pp, target, None, f"{BASELINE} or {name} missing"))
                continue
            ratios = {stage: mode.peak_bytes_by_stage[stage] / none.peak_bytes_by_stage[stage]
                      for stage in none.peak_bytes_by_stage}
            detail = ", ".join(f"stage {stage} {ratio:.3f} x" for stage, ratio in ratios.items())
            checks.append(TargetCheck(pp, target, all(r < 1 for r in ratios.values()), detail))
        full, selective = _find(summaries, pp, FULL), _find(summaries, pp, SELECTIVE)
        target = f"{BASELINE} <= {SELECTIVE} <= {FULL} median step time"
        if none is None or full is None or selective is None:
            checks.append(TargetCheck(pp, target, None, f"{BASELINE}, {SELECTIVE} or {FULL} missing"))
        else:
            times = [none.step_time_s, selective.step_time_s, full.step_time_s]
            detail = " / ".join(f"{t * 1e3:.0f}" for t in times) + " ms"
            checks.append(TargetCheck(pp, target, times[0] <= times[1] <= times[2], detail))
    return checks


def _ratio(value: float, reference: float | None) -> str:
    return f"{value / reference:.2f}" if reference else "-"


def _table(pp: int, summaries: Sequence[ModeSummary], unavailable: Sequence[dict], order: Sequence[str],
           processes_note: str) -> list[str]:
    rank_of = {name: index for index, name in enumerate(order)}
    rows = sorted((s for s in summaries if s.pp == pp), key=lambda s: rank_of.get(s.mode, len(order)))
    stages = sorted({stage for s in rows for stage in s.peak_bytes_by_stage})
    none = _find(summaries, pp, BASELINE)
    in_flight = ", ".join(str(rows[0].in_flight_by_stage[stage]) for stage in stages)
    lines = [f"### pp = {pp}", "",
             f"{rows[0].micro_batches} micro-batches per step; micro-batches in flight by stage (1F1B): {in_flight}.",
             "",
             "| mode | pp x mp | " + " | ".join(f"stage {s} MiB" for s in stages)
             + f" | stage 0 ÷ stage {stages[-1]} | ÷ {BASELINE}, by stage "
             f"| step ms: median (min-max) | ÷ {BASELINE} |",
             "|---|---|" + "---:|" * len(stages) + "---:|---|---:|---:|"]
    for s in rows:
        peaks = " | ".join(f"{s.peak_bytes_by_stage[stage] / MIB:.2f}" for stage in stages)
        versus = ", ".join(_ratio(s.peak_bytes_by_stage[stage], none.peak_bytes_by_stage.get(stage) if none else None)
                           for stage in stages)
        lines.append(f"| {s.mode} | {s.pp} x {s.mp} | {peaks} | {s.imbalance:.2f} | {versus} "
                     f"| {s.step_time_s * 1e3:.0f} ({s.step_time_min_s * 1e3:.0f}-{s.step_time_max_s * 1e3:.0f}) "
                     f"| {_ratio(s.step_time_s, none.step_time_s if none else None)} |")
    seen = set()
    for record in unavailable:
        if record["pp"] == pp and record["mode"] not in seen:
            seen.add(record["mode"])
            lines.append(f"| {record['mode']} | {record['pp']} x {record['mp']} | not available: "
                         f"{record['unavailable']} |" + " |" * (len(stages) + 3))
    return lines + ["", processes_note, ""]


def _processes_note(records: Sequence[dict], pp: int, cpus: int | None) -> str:
    """How many rank processes and threads each topology ran with."""
    layouts = sorted({(r["mp"], r["pp"] * r["mp"] * r.get("dp", 1), r.get("torch_threads"))
                      for r in records if r["pp"] == pp and "unavailable" not in r})
    parts = [f"pp x mp = {pp} x {mp}: {world} rank processes, {threads} torch thread(s) each"
             for mp, world, threads in layouts]
    note = "Ran as " + "; ".join(parts) + (f", on {cpus} logical CPUs." if cpus else ".")
    if cpus and any(world * (threads or 1) > cpus for _, world, threads in layouts):
        note += " Step times of rows whose ranks outnumber the CPUs are not comparable with the others."
    return note


def markdown(records: Sequence[dict], machine: dict, mode_descriptions: dict[str, str]) -> str:
    """The report: machine, modes, one table per pipeline depth, the targets."""
    every_summary = summarize(records)
    summaries = [s for s in every_summary if s.budget_fraction is None]
    unavailable = [r for r in records if "unavailable" in r and "budget_fraction" not in r]
    lines = [f"Machine: {machine['summary']}", f"Model: {machine['model']}", "", "Modes:", ""]
    lines += [f"- `{name}`: {text}" for name, text in mode_descriptions.items()] + [""]
    lines += ["Peak: bytes allocated above the start of one `engine.train_batch()`, the largest over the "
              "stage's ranks. Step time: the slowest rank's median.", ""]
    for pp in sorted({s.pp for s in summaries}):
        lines += _table(pp, summaries, unavailable, list(mode_descriptions),
                        _processes_note(records, pp, machine.get("cpu_count")))
    budget_rows = [s for s in every_summary if s.budget_fraction is not None]
    budget_unavailable = [r for r in records if "unavailable" in r and "budget_fraction" in r]
    if budget_rows or budget_unavailable:
        lines += _budget_tables(budget_rows, budget_unavailable)
    lines += ["Targets:"] + [check.line() for check in check_targets(summaries)]
    if budget_rows or budget_unavailable:
        lines += [check.line() for check in check_budget_targets(budget_rows, budget_unavailable)]
    return "\n".join(lines) + "\n"


def document(records: Sequence[dict], machine: dict) -> dict:
    """The JSON document: ``{"machine", "results", "unavailable", "summary", "targets"}``."""
    summaries = summarize(records)
    plain = [s for s in summaries if s.budget_fraction is None]
    budget_rows = [s for s in summaries if s.budget_fraction is not None]
    budget_unavailable = [r for r in records if "unavailable" in r and "budget_fraction" in r]
    return {
        "machine": machine,
        "results": [r for r in records if "unavailable" not in r],
        "unavailable": [r for r in records if "unavailable" in r],
        "summary": [asdict(s) | {"imbalance": s.imbalance} for s in summaries],
        "targets": [asdict(check) for check in (check_targets(plain)
                                                 + check_budget_targets(budget_rows, budget_unavailable))],
    }


# -- --budget: the planner against the best uniform interval ---------------------------

PLANNED, UNIFORM_BEST = "planned", "uniform_best"
# The planner's ConfigError when no plan fits (ds_pipe_ckpt.planning.stage).
_MINIMUM = re.compile(r"expected at least ([0-9.]+) MiB for pipeline stage (\d+)")


def infeasible_minimum(message: str) -> tuple[int, float] | None:
    """(stage, least feasible MiB) from the planner's ``ConfigError`` in a rank's report, or None."""
    match = _MINIMUM.search(message)
    return (int(match.group(2)), float(match.group(1))) if match else None


def _infeasible_cell(reason: str) -> str:
    minimum = infeasible_minimum(reason)
    return f"stage {minimum[0]} needs at least {minimum[1]:.2f} MiB" if minimum else reason


def _mib(values: dict[int, int] | None, stages: Sequence[int]) -> str:
    return ", ".join(f"{values[stage] / MIB:.2f}" for stage in stages) if values else "-"


def _error_range(errors: Sequence[float]) -> str:
    if not errors:
        return "-"
    low, high = min(errors), max(errors)
    return f"{low:+.1%}" if abs(high - low) < 5e-4 else f"{low:+.1%} to {high:+.1%}"


def _budget_tables(rows: Sequence[ModeSummary], unavailable: Sequence[dict]) -> list[str]:
    lines = []
    for pp in sorted({s.pp for s in rows} | {r["pp"] for r in unavailable}):
        fractions = sorted({s.budget_fraction for s in rows if s.pp == pp}
                           | {r["budget_fraction"] for r in unavailable if r["pp"] == pp})
        lines += [f"### pp = {pp}: memory budgets", "",
                  "Budget: a fraction of each stage's peak without checkpointing. MiB by stage, stage 0 first. "
                  "Planned: the largest peak of the stage's measured planned steps (the planner's check of its "
                  "first planned step, of any plan made again, and the benchmark's measured step); steps: those "
                  "measured, over all stages, and how many went over their stage's budget; prediction error: "
                  "(predicted - measured) / measured over those steps (negative: more than predicted).", "",
                  "| budget | stage budgets MiB | planned peak MiB | planned predicted MiB | steps measured "
                  "/ over budget | prediction error | planned step ms | uniform_best | its peak MiB | its step ms "
                  "| planned ÷ uniform_best |",
                  "|---|---|---|---|---:|---|---:|---|---|---:|---:|"]
        for fraction in fractions:
            planned = _find(rows, pp, PLANNED, fraction)
            uniform = _find(rows, pp, UNIFORM_BEST, fraction)
            missing = [r for r in unavailable if r["pp"] == pp and r["budget_fraction"] == fraction]
            reasons = {r["mode"]: r["unavailable"] for r in missing}
            if planned or uniform:
                budgets = (planned or uniform).budget_bytes_by_stage
            else:
                budgets = {int(stage): b for stage, b in missing[0]["budgets_bytes"].items()} if missing else None
            stages = sorted(budgets) if budgets else []
            if planned:
                worst = planned.worst_step_by_stage or planned.peak_bytes_by_stage
                planned_cells = (f"{_mib(worst, stages)} | {_mib(planned.predicted_peak_bytes_by_stage, stages)} | "
                                 f"{planned.planned_steps_measured} / {len(planned.over_budget_steps)} | "
                                 f"{_error_range(planned.prediction_errors)} | {planned.step_time_s * 1e3:.0f}")
            else:
                planned_cells = f"infeasible: {_infeasible_cell(reasons.get(PLANNED, 'not run'))} | - | - | - | -"
            if uniform:
                uniform_cells = (f"{uniform.uniform_mode} | {_mib(uniform.peak_bytes_by_stage, stages)} | "
                                 f"{uniform.step_time_s * 1e3:.0f}")
            else:
                uniform_cells = "none fits | - | -"
            ratio = f"{planned.step_time_s / uniform.step_time_s:.2f}" if planned and uniform else "-"
            lines.append(f"| {fraction:g} x | {_mib(budgets, stages)} | {planned_cells} | {uniform_cells} | {ratio} |")
        lines.append("")
    return lines


def check_budget_targets(rows: Sequence[ModeSummary], unavailable: Sequence[dict]) -> list[TargetCheck]:
    """Per (pp, budget): every stage planned; no measured planned step (the
    first included) above its stage's budget; the planned step time no slower
    than the best uniform interval that fits; every measured planned step
    within the planner's ``PREDICTION_TOLERANCE`` of its prediction."""
    checks = []
    keys = sorted({(s.pp, s.budget_fraction) for s in rows} | {(r["pp"], r["budget_fraction"]) for r in unavailable})
    for pp, fraction in keys:
        planned, uniform = _find(rows, pp, PLANNED, fraction), _find(rows, pp, UNIFORM_BEST, fraction)
        tag = f"budget {fraction:g} x"
        if planned is None:
            reason = next((r["unavailable"] for r in unavailable
                           if (r["pp"], r["budget_fraction"], r["mode"]) == (pp, fraction, PLANNED)), "not run")
            # A budget nothing fits is met by the planner's error naming the least budget
            # that does, at the first step, instead of a run over it.
            minimum = infeasible_minimum(reason)
            refused = minimum is not None and uniform is None
            detail = (f"no plan and no uniform interval fits; the planner names the least budget: stage "
                      f"{minimum[0]} needs {minimum[1]:.2f} MiB" if refused else reason)
            checks.append(TargetCheck(pp, f"{tag}: planned runs, or names the least budget where nothing fits",
                                      refused, detail))
            continue
        budgets = planned.budget_bytes_by_stage
        unplanned = sorted(set(budgets) - set(planned.predicted_peak_bytes_by_stage or {}))
        checks.append(TargetCheck(pp, f"{tag}: every stage planned", not unplanned,
                                  f"stages {unplanned} did not plan" if unplanned else f"{len(budgets)} stages"))
        worst = planned.worst_step_by_stage or planned.peak_bytes_by_stage
        over = planned.over_budget_steps
        ratios = ", ".join(f"stage {s} {worst[s] / budgets[s]:.3f} x budget" for s in budgets if s in worst)
        checks.append(TargetCheck(
            pp, f"{tag}: no measured planned step over budget", not over and worst.keys() >= budgets.keys(),
            f"{len(over)} of {planned.planned_steps_measured} steps over"
            + "".join(f"; stage {s} step {step}: {peak / budgets[s]:.3f} x" for s, step, peak in over)
            + f"; worst: {ratios}"))
        if uniform is None:
            checks.append(TargetCheck(pp, f"{tag}: planned step time <= uniform_best's", True,
                                      "no uniform interval fits the budget"))
        else:
            ratio = planned.step_time_s / uniform.step_time_s
            checks.append(TargetCheck(pp, f"{tag}: planned step time <= uniform_best's ({uniform.uniform_mode})",
                                      ratio <= 1, f"{ratio:.3f} x"))
        errors = planned.prediction_errors
        checks.append(TargetCheck(pp, f"{tag}: predicted peak within {PREDICTION_TOLERANCE:.0%} of every measured "
                                      "planned step",
                                  bool(errors) and all(abs(e) <= PREDICTION_TOLERANCE for e in errors),
                                  _error_range(errors) if errors else "no prediction"))
    return checks


def write_budget_png(path: str, records: Sequence[dict], machine: dict) -> None:
    """Step time against budget, planned and uniform_best, one panel per pipeline depth."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [s for s in summarize(records) if s.budget_fraction is not None]
    depths = sorted({s.pp for s in rows})
    if not depths:
        return
    figure, axes = plt.subplots(1, len(depths), figsize=(5.5 * len(depths), 4.2), squeeze=False)
    for axis, pp in zip(axes[0], depths):
        for mode, marker in ((PLANNED, "o-"), (UNIFORM_BEST, "s--")):
            points = sorted((s.budget_fraction, s.step_time_s * 1e3) for s in rows if s.pp == pp and s.mode == mode)
            if points:
                axis.plot(*zip(*points), marker, label=mode)
        axis.set_title(f"pp = {pp}")
        axis.set_xlabel("budget, fraction of each stage's peak without checkpointing")
        axis.set_ylabel("step time, ms (median)")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    title = f"Pipeline: step time under a memory budget ({machine['model']}; {machine['device']})"
    # About 14 characters of a 9-point title per inch: wrap it to the figure.
    figure.suptitle(textwrap.fill(title, width=int(14 * figure.get_figwidth())), fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def write_json(path: str, records: Sequence[dict], machine: dict) -> None:
    with open(path, "w") as handle:
        json.dump(document(records, machine), handle, indent=2)
        handle.write("\n")


def write_png(path: str, records: Sequence[dict], machine: dict, order: Sequence[str] = ()) -> None:
    """Peak memory per stage, one group of bars (one per mode, in ``order``
    first) per stage, one panel per pipeline depth."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rank_of = {name: index for index, name in enumerate(order)}
    summaries = sorted((s for s in summarize(records) if s.budget_fraction is None),
                       key=lambda s: rank_of.get(s.mode, len(rank_of)))
    depths = sorted({s.pp for s in summaries})
    names = list(dict.fromkeys(s.mode for s in summaries))
    colors = {name: f"C{i % 10}" for i, name in enumerate(names)}
    figure, axes = plt.subplots(1, len(depths), figsize=(6 + 2.5 * max(depths), 4.8), squeeze=False)
    for axis, pp in zip(axes[0], depths):
        rows = [s for s in summaries if s.pp == pp]
        width = 0.8 / len(rows)
        for index, s in enumerate(rows):
            stages = list(s.peak_bytes_by_stage)
            offsets = [stage - 0.4 + width * (index + 0.5) for stage in stages]
            axis.bar(offsets, [s.peak_bytes_by_stage[stage] / MIB for stage in stages], width,
                     color=colors[s.mode], label=f"{s.mode} (mp={s.mp})" if s.mp > 1 else s.mode)
        stages = sorted(rows[0].in_flight_by_stage)
        axis.set_xticks(stages, [f"stage {stage}\n{rows[0].in_flight_by_stage[stage]} in flight" for stage in stages])
        axis.set_title(f"pp = {pp}, {rows[0].micro_batches} micro-batches per step")
        axis.set_ylabel("peak above start of train_batch, MiB")
        axis.grid(axis="y", alpha=0.3)
        axis.legend(fontsize=8)
    figure.suptitle(f"Pipeline: peak memory per stage ({machine['model']}; {machine['device']})", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
