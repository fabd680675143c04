"""``python -m benchmarks.pipeline --partition planned``
(benchmarks.pipeline.partition and its report), driven by a fake launcher
that returns rank records as the rank processes do: the modes and budgets,
the choice of the best uniform interval per partition, the fallback to one
launch per row when a planner fails, the tables, the target line and the
plot."""

from __future__ import annotations

import pytest

from benchmarks.pipeline.runner import _parser, _preset
from benchmarks.pipeline.modes import Layout
from benchmarks.pipeline.partition.runner import (PLANNED_PARTITION, PLANNER, measured_modes, partition_rows,
                                           planner_mode, shared_budget)
from benchmarks.pipeline.partition.report import (comparison, partition_document, partition_markdown, target_line,
                                                  write_partition_png)
from benchmarks.pipeline.report import MIB, summarize
from ds_pipe_ckpt.testing import RankFailure

# Per mode: (peak MiB of stage 0, of stage 1, step seconds). The budget at 0.5 x
# is 5 MiB (half of parameters:none's 10).
MEASURED = {
    "parameters:none": (10.0, 6.0, 1.0), "parameters:uniform_1": (4.0, 3.0, 1.4),
    "parameters:uniform_2": (5.5, 4.0, 1.2), "parameters:uniform_3": (7.0, 5.0, 1.1),
    "uniform:none": (12.0, 4.0, 1.1), "uniform:uniform_1": (4.5, 2.0, 1.5),
    "uniform:uniform_2": (6.0, 3.0, 1.3), "uniform:uniform_3": (8.0, 3.5, 1.2),
}
PLANNED = {"parameters:planner": (4.8, 4.9, 1.25), "planned:planner": (4.9, 4.7, 1.0)}


def _records(mode, layout):
    *peaks, step = MEASURED.get(mode) or PLANNED[mode]
    records = []
    for stage, peak in enumerate(peaks):
        record = {"pp": layout.pp, "mp": 1, "dp": 1, "mode": mode, "stage": stage, "rank": stage,
                  "peak_bytes": int(peak * MIB), "step_net_bytes": 0, "step_time_s": step, "step_times_s": [step],
                  "micro_batches": 4, "micro_batches_in_flight": 2 - stage, "parts": [0, 5, 8]}
        if mode.endswith(PLANNER):
            # The planner's checked first planned step, then the benchmark's.
            record["step_peaks"] = [{"step": 2, "kind": "measuring", "peak_bytes": int(3 * MIB), "predicted_bytes": None},
                                    {"step": 3, "kind": "planned", "peak_bytes": int(peak * MIB),
                                     "predicted_bytes": int(peak * MIB)},
                                    {"step": 6, "kind": "planned", "peak_bytes": int(peak * MIB),
                                     "predicted_bytes": int(peak * MIB)}]
        if mode == "planned:planner":
            record["parts"] = [0, 4, 8]
            record["partition_plan"] = {"boundaries": [0, 4, 8], "stage_seconds": [0.2, 0.2], "step_seconds": 1.0,
                                        "predicted_peak_bytes": [int(4.9 * MIB), int(4.7 * MIB)],
                                        "profile_source": "profiled and saved to p.json; planned for 2 stages"}
        records.append(record)
    return records


class FakeLauncher:
    """Records as the ranks return them; a launch holding ``uniform:planner``
    fails, as a stage the planner cannot fit does."""

    def __init__(self):
        self.launches = []

    def __call__(self, layout, mode_list):
        self.launches.append(layout.modes)
        assert [m.name for m in mode_list] == list(layout.modes)
        if "uniform:planner" in layout.modes:
            raise RankFailure("rank 1 raised:\nds_pipe_ckpt.errors.ConfigError: activation_checkpointing."
                              "memory_budget_mb = 5.0 is invalid: expected at least 6.10 MiB for pipeline stage 1.")
        return [r for name in layout.modes for r in _records(name, layout)]


@pytest.fixture(scope="module")
def partition_records():
    launcher = FakeLauncher()
    records = partition_rows(2, [0.5], blocks=2, launch=launcher, profile_path="p.json",
                             root_error=lambda report: report.splitlines()[-1])
    return launcher, records


def test_modes_cut_the_stages_as_their_names_say():
    modes = {m.name: m for m in measured_modes(2)}
    assert list(modes) == ["parameters:none", "parameters:uniform_1", "parameters:uniform_2",
                           "uniform:none", "uniform:uniform_1", "uniform:uniform_2"]
    assert modes["uniform:uniform_2"].config["pipeline"] == {"activation_checkpoint_interval": 2,
                                                               "use_reentrant": False, "partition_method": "uniform"}
    planned = planner_mode(PLANNED_PARTITION, 5 * MIB, 0.5, "p.json")
    assert planned.name == "planned:planner"
    assert planned.config["pipeline"] == {"activation_checkpoint_interval": 0, "use_reentrant": False,
                                          "partition_profile": "p.json", "partition_method": "planned"}
    assert planned.config["activation_checkpointing"] == {"memory_budget_mb": 5.0}
    assert "partition_profile" not in planner_mode("parameters", 5 * MIB, 0.5, "p.json").config["pipeline"]


def test_the_budget_is_a_fraction_of_the_highest_stage_peak():
    none = summarize(_records("parameters:none", Layout(2, 1, ("parameters:none", ))))[0]
    assert shared_budget(none, 0.5) == int(5 * MIB)
    with pytest.raises(ValueError, match="must be positive"):
        shared_budget(none, 0)


def test_rows_fall_back_to_one_launch_each_when_a_planner_fails(partition_records):
    launcher, records = partition_records
    # The measured modes, the combined launch (fails), then one launch per row.
    assert launcher.launches[0] == tuple(m.name for m in measured_modes(3))  # intervals 1 .. 1 block + 2
    rows = ("parameters:uniform_1", "uniform:uniform_1", "parameters:planner", "uniform:planner", "planned:planner")
    assert launcher.launches[1] == rows
    assert launcher.launches[2:] == [(name,) for name in rows]
    failed = [r for r in records if r.get("mode") == "uniform:planner"]
    assert failed == [{"pp": 2, "mp": 1, "mode": "uniform:planner", "rank": 0, "partition": "uniform",
                       "checkpointing": PLANNER, "budget_fraction": 0.5, "budget_bytes": int(5 * MIB),
                       "row": "uniform + planner",
                       "unavailable": "ds_pipe_ckpt.errors.ConfigError: activation_checkpointing.memory_budget_mb = "
                                      "5.0 is invalid: expected at least 6.10 MiB for pipeline stage 1."}]


def test_the_comparison_picks_each_partitions_best_fitting_interval(partition_records):
    _, records = partition_records
    (budget, rows), = comparison(records).values()
    assert budget == int(5 * MIB)
    by_label = {r.label: r for r in rows}
    assert list(by_label) == ["parameters + uniform_best", "parameters + planner", "uniform + uniform_best",
                              "uniform + planner", "planned + planner"]
    # uniform_2 (5.5 MiB on stage 0) does not fit 5 MiB: uniform_1 is the fastest that does.
    assert by_label["parameters + uniform_best"].summary.uniform_mode == "uniform_1"
    assert by_label["uniform + uniform_best"].summary.uniform_mode == "uniform_1"
    assert by_label["uniform + planner"].summary is None and "6.10 MiB" in by_label["uniform + planner"].reason
    assert by_label["planned + planner"].parts == (0, 4, 8)
    assert all(not r.over_budget(budget) for r in rows)
    assert by_label["planned + planner"].steps_measured() == 4  # two planned steps on each stage
    # planned 1.0 s against parameters + planner's 1.25 s: 0.80 <= 0.85.
    assert target_line(2, 0.5, rows, budget) == (
        "- pp=2, budget 0.5 x: planned partition <= 0.85 x the best DeepSpeed partition: met (planned 0.80 x the "
        "best of DeepSpeed's, parameters + planner); planner steps over budget: 0")


def test_a_planned_step_over_budget_is_counted(partition_records):
    _, records = partition_records
    over = [r | {"step_peaks": r["step_peaks"][:1] + [dict(r["step_peaks"][1], peak_bytes=int(5.2 * MIB))]
                 + r["step_peaks"][2:]} if r.get("mode") == "planned:planner" and r.get("stage") == 0 else r
            for r in records]
    (budget, rows), = comparison(over).values()
    planned = next(r for r in rows if r.partition == PLANNED_PARTITION)
    assert planned.over_budget(budget) == [(0, 3, int(5.2 * MIB))]
    assert target_line(2, 0.5, rows, budget).endswith("planner steps over budget: 1")


def test_markdown_and_plot(partition_records, tmp_path):
    _, records = partition_records
    machine = {"model": "gpt d=32", "device": "cpu", "micro_batch": 8, "timed_steps": 3,
               "command": "python -m benchmarks.pipeline --partition planned --budget 0.5"}
    text = partition_markdown(records, machine)
    assert "### pp=2, budget 0.5 x = 5.00 MiB on every stage" in text
    assert "| planned | planner | 4/4 | 1000 | 1.00 | 4.9, 4.7 | 4.9, 4.7 | 0 of 4 |" in text
    assert "| parameters | uniform_best (uniform_1) | 5/3 | 1400 | 1.40 | 4.0, 3.0 | - | 0 of 2 |" in text
    assert "| uniform | planner | - | - | - | ds_pipe_ckpt.errors.ConfigError" in text
    assert "The planned cut's model: stage times 200, 200 ms per micro-batch, 1F1B step 1000 ms" in text
    path = tmp_path / "partition.png"
    write_partition_png(str(path), records, machine)
    assert path.stat().st_size > 10_000
    document = partition_document(records, machine)
    assert document["targets"] == [target_line(2, 0.5, comparison(records)[(2, 0.5)][1], int(5 * MIB))]
    assert [r["mode"] for r in document["unavailable"]] == ["uniform:planner"]


def test_the_command_line_needs_budgets_and_knows_the_vocabulary():
    args = _parser().parse_args(["--partition", "planned", "--model", "llama", "--vocab", "4096", "--budget", "0.5"])
    assert args.partition == "planned" and _preset(args).model.vocab_size == 4096
    assert _preset(_parser().parse_args(["--vocab", "1024"])).model.vocab_size == 1024
    with pytest.raises(ValueError, match="--vocab 64: the encoder model .* has no vocabulary"):
        _preset(_parser().parse_args(["--model", "encoder", "--vocab", "64"]))


def test_a_budget_no_uniform_interval_fits_is_recorded_per_partition():
    """At 0.3 x (3 MiB) no measured interval fits either partition: one
    unavailable record each, and only the planners run."""
    launcher = FakeLauncher()
    records = partition_rows(2, [0.3], blocks=2, launch=launcher, profile_path="p.json",
                             root_error=lambda report: report.splitlines()[-1])
    missing = [r for r in records if r.get("checkpointing") == "uniform_best"]
    assert [(r["mode"], r["unavailable"]) for r in missing] == [
        ("parameters:uniform_best", "no uniform interval (nor none) fits the budget on every stage"),
        ("uniform:uniform_best", "no uniform interval (nor none) fits the budget on every stage")]
    assert launcher.launches[1] == ("parameters:planner", "uniform:planner", "planned:planner")
