"""Present the results: a markdown table per workload with the targets checked,
the JSON record with every sample, and a memory-vs-time plot.

It measures nothing and prints nothing itself: :mod:`.runner` prints what it returns.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from typing import Sequence

from .call_profile import CallProfile, markdown_lines as profile_lines
from .floor import Floor
from .measure import Result
from .variants import Variant

__all__ = ["WorkloadReport", "markdown", "write_json", "write_png"]

MIB = 2**20
BASELINE = "none"
UPSTREAM = "deepspeed_non_reentrant"
TORCH = "torch_non_reentrant"
OURS = "ours_non_reentrant"
# The targets for OURS: peak <= upstream's, median step time <= 1.01 x torch's
# own non-reentrant checkpoint (1.05 x on the small-regions workloads, where the
# step is nothing but checkpointing code), peak within 10% of the floor on the GPT stage.
TIME_TOLERANCE = 1.01
SMALL_REGIONS_TIME_TOLERANCE = 1.05
FLOOR_TOLERANCE = 1.10
FLOOR_TARGET_WORKLOAD = "gpt_stage"


@dataclass
class WorkloadReport:
    """Everything measured for one workload."""

    name: str
    description: str
    floor: Floor
    results: list[Result]
    unavailable: dict[str, str] = field(default_factory=dict)  # variant -> reason
    notes: list[str] = field(default_factory=list)
    regions: int | None = None  # checkpointed calls per step (segments), for the per-call figures
    profiles: list[CallProfile] = field(default_factory=list)

    def result(self, variant: str) -> Result | None:
        return next((r for r in self.results if r.variant == variant), None)


def _ratio(value: float, reference: Result | None, attribute: str) -> str:
    if reference is None:
        return "-"
    base = getattr(reference, attribute)
    return f"{value / base:.2f}" if base else "-"


def _table(report: WorkloadReport, variant_names: Sequence[str]) -> list[str]:
    none, upstream, torch_own = report.result(BASELINE), report.result(UPSTREAM), report.result(TORCH)
    lines = [
        "| variant | peak MiB | ÷ none | ÷ DS non-reentrant | ÷ floor | held after forward MiB "
        "| step ms: median (min-max) | ÷ none | ÷ DS non-reentrant | ÷ torch non-reentrant |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    footnotes = []
    for name in variant_names:
        result = report.result(name)
        if result is None:
            if name in report.unavailable:
                footnotes.append(f"{name}: {report.unavailable[name]}")
                lines.append(f"| {name} | not available [{len(footnotes)}] |" + " |" * 9)
            continue
        median = result.time_median_s
        floor = f"{result.peak_bytes / result.floor_bytes:.2f}" if result.floor_bytes else "-"
        lines.append(
            f"| {name} | {result.peak_bytes / MIB:.1f} | {_ratio(result.peak_bytes, none, 'peak_bytes')} "
            f"| {_ratio(result.peak_bytes, upstream, 'peak_bytes')} | {floor} "
            f"| {result.held_after_forward_bytes / MIB:.1f} "
            f"| {median * 1e3:.0f} ({min(result.samples_s) * 1e3:.0f}-{max(result.samples_s) * 1e3:.0f}) "
            f"| {_ratio(median, none, 'time_median_s')} | {_ratio(median, upstream, 'time_median_s')} "
            f"| {_ratio(median, torch_own, 'time_median_s')} |")
    lines += [""] + [f"[{i}] {text}" for i, text in enumerate(footnotes, 1)]
    return lines


def _per_call(report: WorkloadReport, variant_names: Sequence[str]) -> list[str]:
    """Step time per checkpointed call on a small-regions workload (where the
    step is nothing but checkpointing code), and the checkpointing code's own
    share of it: the step time without checkpointing subtracted."""
    if not report.name.startswith("small_regions_") or not report.regions:
        return []
    none, torch_own = report.result(BASELINE), report.result(TORCH)
    lines = [f"Per region call ({report.regions} per step; medians): step time / {report.regions}, and the "
             "checkpointing code's own part (minus the step without checkpointing):", "",
             "| variant | ms per call | own ms per call | own ÷ torch non-reentrant's |", "|---|---:|---:|---:|"]
    torch_cost = None if none is None or torch_own is None else torch_own.time_median_s - none.time_median_s
    for name in variant_names:
        result = report.result(name)
        if result is None:
            continue
        per_call = result.time_median_s / report.regions
        own = "-" if none is None or name == BASELINE else \
            f"{(result.time_median_s - none.time_median_s) / report.regions * 1e3:.3f}"
        versus = "-" if own == "-" or not torch_cost else \
            f"{(result.time_median_s - none.time_median_s) / torch_cost:.2f}"
        lines.append(f"| {name} | {per_call * 1e3:.3f} | {own} | {versus} |")
    return lines + [""]


def paired_ratio(samples: Sequence[float], reference: Sequence[float]) -> float:
    """Median over the timed rounds of one variant's step time over another's in
    the same round. Rounds interleave the variants, so a change in machine load
    during the run cancels out of each ratio (it does not out of a ratio of medians)."""
    return statistics.median(a / b for a, b in zip(samples, reference))


def time_tolerance(workload: str) -> float:
    """The step-time target of OURS over TORCH on ``workload``."""
    return SMALL_REGIONS_TIME_TOLERANCE if workload.startswith("small_regions_") else TIME_TOLERANCE


def _targets(reports: Sequence[WorkloadReport]) -> list[str]:
    lines = [f"Targets for {OURS}:"]
    for report in reports:
        ours, upstream, torch_own = report.result(OURS), report.result(UPSTREAM), report.result(TORCH)
        if ours is None or torch_own is None:
            continue
        if upstream is not None:
            peak = ours.peak_bytes / upstream.peak_bytes
            lines.append(f"- {report.name}: peak {peak:.3f} x {UPSTREAM} (target <= 1): "
                         f"{'met' if peak <= 1 else 'MISSED'}")
        time_ratio = paired_ratio(ours.samples_s, torch_own.samples_s)
        tolerance = time_tolerance(report.name)
        versus_upstream = ("" if upstream is None else
                           f"; per-round {paired_ratio(ours.samples_s, upstream.samples_s):.3f} x {UPSTREAM}")
        lines.append(f"- {report.name}: step time {time_ratio:.3f} x {TORCH}, median of the per-round ratios "
                     f"(target <= {tolerance}): {'met' if time_ratio <= tolerance else 'MISSED'} "
                     f"(ratio of medians {ours.time_median_s / torch_own.time_median_s:.3f} x{versus_upstream})")
        if report.name == FLOOR_TARGET_WORKLOAD and ours.floor_bytes:
            over = ours.peak_bytes / ours.floor_bytes
            lines.append(f"- {report.name}: peak {over:.3f} x the analytic floor (target <= {FLOOR_TOLERANCE}): "
                         f"{'met' if over <= FLOOR_TOLERANCE else 'MISSED'}")
    return lines


def _floor_line(floor: Floor) -> str:
    return (f"Analytic floor {floor.floor_bytes / MIB:.1f} MiB, reached at segment {floor.segment}'s backward: "
            f"held segment inputs {floor.held_inputs_bytes / MIB:.1f} + stage output "
            f"{floor.output_bytes / MIB:.1f} + segment activations {floor.activation_bytes / MIB:.1f} "
            f"+ incoming gradient {floor.incoming_grad_bytes / MIB:.1f} "
            f"+ accumulated parameter gradients {floor.parameter_grad_bytes / MIB:.1f} MiB.")


def markdown(reports: Sequence[WorkloadReport], machine: dict, variants: Sequence[Variant]) -> str:
    """The whole report as markdown."""
    variant_names = [v.name for v in variants]
    lines = [f"Machine: {machine['summary']}", "", "Variants:", ""]
    lines += [f"- `{v.name}`: {v.description}" for v in variants] + [""]
    for report in reports:
        lines += [f"### {report.name}", "", report.description + ".", "", _floor_line(report.floor), ""]
        lines += _table(report, variant_names)
        lines += report.notes + [""]
        lines += _per_call(report, variant_names)
        lines += profile_lines(report.profiles)
    lines += _targets(reports)
    return "\n".join(lines) + "\n"


def write_json(path: str, reports: Sequence[WorkloadReport], machine: dict) -> None:
    """Every raw sample, plus each workload's floor terms and unavailable variants."""
    document = {
        "machine": machine,
        "results": [r.as_json() for report in reports for r in report.results],
        "workloads": {report.name: {"description": report.description, "floor": report.floor.as_dict()}
                      for report in reports},
        "unavailable": [{"workload": report.name, "variant": name, "reason": reason}
                        for report in reports for name, reason in report.unavailable.items()],
    }
    with open(path, "w") as handle:
        json.dump(document, handle, indent=2)
        handle.write("\n")


def write_png(path: str, reports: Sequence[WorkloadReport], machine: dict, variants: Sequence[Variant]) -> None:
    """Peak memory against median step time (min-max bars), one panel per
    workload, one colour and marker per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    styles = {v.name: (f"C{i % 10}", "osD^v<>p*h"[i % 10]) for i, v in enumerate(variants)}
    figure, axes = plt.subplots(1, len(reports), figsize=(6 * len(reports), 5), squeeze=False)
    for axis, report in zip(axes[0], reports):
        for result in report.results:
            median = result.time_median_s * 1e3
            errors = [[median - min(result.samples_s) * 1e3], [max(result.samples_s) * 1e3 - median]]
            color, marker = styles[result.variant]
            axis.errorbar(median, result.peak_bytes / MIB, xerr=errors, fmt=marker, color=color, capsize=3,
                          label=result.variant)
        axis.axhline(report.floor.floor_bytes / MIB, linestyle="--", color="grey", label="analytic floor")
        axis.set_title(report.name)
        axis.set_xlabel("step time, ms (median, min-max)")
        axis.set_ylabel("peak memory above start of step, MiB")
        axis.set_ylim(bottom=0)
        axis.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="lower center", ncol=5, fontsize=8)
    figure.suptitle(f"Activation checkpointing: memory vs time ({machine['device']})", fontsize=10)
    figure.tight_layout(rect=(0, 0.1, 1, 1))
    figure.savefig(path, dpi=120)
    plt.close(figure)
