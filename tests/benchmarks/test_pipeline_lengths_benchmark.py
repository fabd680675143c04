"""``python -m benchmarks.pipeline --lengths`` (benchmarks.pipeline.lengths, its
rank side and its report): the schedule of lengths, the configurations'
configs, the rows, the target line and the JSON, from records as the rank
processes return them (a fake ``run_ranks``), and one tiny real launch of the
whole flow. No timing is asserted."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

import benchmarks.pipeline.runner as pipeline_cli
from benchmarks.pipeline.runner import _parser, main
from benchmarks.pipeline.budget import PLANNED_WARMUP_STEPS
from benchmarks.pipeline.lengths.runner import (ADAPTIVE, LENGTH_WARMUP_STEPS, MEASURED_STEPS, NONE, STATIC,
                                                UNIFORM_BEST, adaptive_mode, length_records, length_schedule,
                                                static_mode)
from benchmarks.pipeline.lengths.report import comparison, lengths_document, lengths_markdown, target_line
from benchmarks.pipeline.report import MIB
from ds_pipe_ckpt.testing import RankFailure

BUDGETS = [int(4 * MIB), int(2 * MIB)]  # 0.5 x the none peaks at the maximum (8 and 4 MiB)
# Per run (config, mode, fraction): stage peaks of each measured step (MiB) and timed seconds per rank.
RUNS = {
    (NONE, NONE, None): ([[7.0, 6.0], [3.5, 3.0]], [[1.00, 1.00], [0.90, 1.10]]),
    (UNIFORM_BEST, "uniform_1", None): ([[3.0, 2.5], [1.5, 1.2]], [[1.50, 1.50], [1.40, 1.60]]),
    (STATIC, STATIC, 0.5): ([[3.9, 3.8], [1.9, 1.8]], [[1.40, 1.40], [1.40, 1.40]]),
    (ADAPTIVE, ADAPTIVE, 0.5): ([[3.9, 3.9], [1.9, 1.95]], [[1.10, 1.20], [1.20, 1.10]]),
}


def _records(pp: int = 2) -> list[list[dict]]:
    """Per rank, the records ``measure_lengths`` returns: the maximum-length
    measurements, rank 0's choice, then one record per run on the lengths."""
    per_rank = []
    for stage in range(2):
        records = [{"record": "maximum", "pp": pp, "mp": 1, "mode": mode, "stage": stage, "rank": stage,
                    "peak_bytes": int(peak[stage] * MIB), "step_net_bytes": 0, "step_time_s": 1.0,
                    "step_times_s": [1.0], "micro_batches": 4, "micro_batches_in_flight": 2 - stage}
                   for mode, peak in ((NONE, (8.0, 4.0)), ("uniform_1", (3.0, 1.5)))]
        if stage == 0:
            records.append({"record": "choice", "pp": pp, "rank": 0, "budget_fraction": 0.5,
                            "budgets_bytes": BUDGETS, "uniform_mode": "uniform_1"})
        for (config, mode, fraction), (peaks, times) in RUNS.items():
            record = {"record": "run", "pp": pp, "rank": stage, "config": config, "mode": mode,
                      "budget_fraction": fraction, "stage": stage, "step_times_s": times[stage],
                      "step_peaks": [{"step": LENGTH_WARMUP_STEPS + i, "lengths": [16, 32, 64, 40],
                                      "peak_bytes": int(p * MIB), "measured_by": "benchmark"}
                                     for i, p in enumerate(peaks[stage])]}
            if fraction is not None:
                record["step_peaks"].insert(0, {"step": 1, "lengths": [64] * 4, "peak_bytes": int(1.0 * MIB),
                                                "measured_by": "planner"})
                record |= {"planning_s": 0.5 + stage, "predicted_peak_bytes": BUDGETS[stage],
                           "length_plans": [{"length": 32, "stored": 2, "checkpointed": 0, "selective": 0,
                                             "held_bytes": 1, "recompute_s": 0.0,
                                             "predicted_peak_bytes": BUDGETS[stage] // 2},
                                            {"length": 64, "stored": 0, "checkpointed": 2, "selective": 0,
                                             "held_bytes": 1, "recompute_s": 0.004,
                                             "predicted_peak_bytes": BUDGETS[stage]}]}
            records.append(record)
        per_rank.append(records)
    return per_rank


def _flat(per_rank: list[list[dict]]) -> list[dict]:
    return [record for rank in per_rank for record in rank]


MACHINE = {"model": "encoder d=32", "device": "cpu", "micro_batch": 8, "torch_threads": "pp=2: 1",
           "command": "python -m benchmarks.pipeline --lengths --model encoder --budget 0.5"}
SCHEDULES = {2: length_schedule(64, 4, timed=2, measured=2)}


# -- the schedule and the configurations ----------------------------------------------

@given(max_length=st.integers(1, 4096), micro_batches=st.integers(1, 8), timed=st.integers(0, 5),
       seed=st.integers(0, 2**32))
def test_every_length_lies_between_a_quarter_of_the_maximum_and_the_maximum(max_length, micro_batches, timed, seed):
    schedule = length_schedule(max_length, micro_batches, timed, seed=seed)
    assert (len(schedule.warmup), len(schedule.measured), len(schedule.timed)) == (LENGTH_WARMUP_STEPS,
                                                                                   MEASURED_STEPS, timed)
    assert schedule.steps == schedule.warmup + schedule.measured + schedule.timed
    assert all(len(step) == micro_batches for step in schedule.steps)
    assert all(schedule.min_length <= n <= max_length for step in schedule.steps for n in step)
    assert 4 * schedule.min_length >= max_length > 4 * (schedule.min_length - 1)
    assert length_schedule(max_length, micro_batches, timed, seed=seed) == schedule  # seeded


def test_the_schedule_spans_its_range_and_is_fixed_by_its_seed():
    schedule = length_schedule(128, 4, timed=50)
    lengths = [n for step in schedule.steps for n in step]
    assert min(lengths) == 32 and max(lengths) == 128  # 236 draws from 97 values
    assert len(set(schedule.timed)) > 1
    assert length_schedule(128, 4, timed=50, seed=1) != schedule
    with pytest.raises(ValueError, match="must be positive"):
        length_schedule(0, 4, 1)
    with pytest.raises(ValueError, match="must be >= 0"):
        length_schedule(64, 4, -1)


def test_adaptive_and_static_differ_only_in_the_length_buckets():
    budgets = {0: int(4 * MIB), 1: int(2 * MIB)}
    adaptive, static = adaptive_mode(budgets, 0.5, 128), static_mode(budgets, 0.5, 128)
    assert (adaptive.name, static.name) == (ADAPTIVE, STATIC)
    assert adaptive.config["activation_checkpointing"] == {"memory_budget_mb": [4.0, 2.0], "max_sequence_length": 128}
    assert static.config["activation_checkpointing"] == {"memory_budget_mb": [4.0, 2.0], "max_sequence_length": 128,
                                                         "length_buckets": 1}
    for mode in (adaptive, static):
        assert mode.config["pipeline"] == {"activation_checkpoint_interval": 0, "use_reentrant": False}
        assert mode.warmup_steps == PLANNED_WARMUP_STEPS


# -- the rows, the target line, the tables and the JSON ---------------------------------

def test_rows_count_every_measured_step_against_its_stage_budget():
    (budgets, rows), = comparison(_flat(_records())).values()
    assert budgets == BUDGETS
    by_config = {row.config: row for row in rows}
    assert [row.config for row in rows] == [NONE, UNIFORM_BEST, STATIC, ADAPTIVE]
    assert by_config[UNIFORM_BEST].mode == "uniform_1"
    # none: both steps of each stage over 4 and 2 MiB; the planned rows: none (the planner's step included).
    assert len(by_config[NONE].over_budget(budgets)) == 4 and by_config[NONE].steps_measured == 4
    assert by_config[STATIC].steps_measured == by_config[ADAPTIVE].steps_measured == 6
    assert by_config[ADAPTIVE].over_budget(budgets) == []
    # Per timed step the slowest rank: (1.2 + 1.2) / 2.
    assert by_config[ADAPTIVE].step_s == pytest.approx(1.2)
    assert by_config[ADAPTIVE].planning_s == 1.5


def test_the_target_line():
    (budgets, rows), = comparison(_flat(_records())).values()
    assert target_line(2, 0.5, rows, budgets) == ("- pp=2, budget 0.5 x: adaptive / static = 0.86 (target <= 0.90): "
                                                  "met; steps over budget: adaptive 0, static 0")
    over = _flat(_records())
    for record in over:
        if record.get("config") == ADAPTIVE and record["stage"] == 1:
            record["step_peaks"][-1]["peak_bytes"] = BUDGETS[1] + 1
    (budgets, rows), = comparison(over).values()
    assert target_line(2, 0.5, rows, budgets).endswith(": missed; steps over budget: adaptive 1, static 0")


def test_a_refused_budget_is_reported_by_its_least_budget():
    records = [r for r in _flat(_records()) if r.get("config") != ADAPTIVE]
    records.append({"record": "run", "pp": 2, "rank": 0, "config": ADAPTIVE, "mode": ADAPTIVE, "budget_fraction": 0.5,
                    "unavailable": "activation_checkpointing.memory_budget_mb = 0.988 is invalid: expected at least "
                                   "1.10 MiB for pipeline stage 1. No plan keeps ..."})
    (budgets, rows), = comparison(records).values()
    assert target_line(2, 0.5, rows, budgets) == (
        "- pp=2, budget 0.5 x: adaptive / static (target <= 0.90): not measured (adaptive: the planner refused: "
        "stage 1 needs at least 1.10 MiB)")
    assert "| adaptive | not available: the planner refused: stage 1 needs at least 1.10 MiB |" in \
        lengths_markdown(records, MACHINE, SCHEDULES)


def test_markdown_and_json():
    records = _flat(_records())
    text = lengths_markdown(records, MACHINE, SCHEDULES)
    assert "### pp=2, budget 0.5 x: 4.00, 2.00 MiB by stage" in text
    assert "| adaptive | 1200 (1200-1200) | 0.86 | 0 / 6 | 0.97, 0.97 | 1.50 |" in text
    assert "| uniform_best (uniform_1) | 1550 (1500-1600) | 1.11 | 0 / 4 | 0.75, 0.75 | - |" in text
    assert "| none | 1050 (1000-1100) | 0.75 | 4 / 4 | 1.75, 1.75 | - |" in text
    assert f"lengths drawn uniformly from [16, 64]; {LENGTH_WARMUP_STEPS} warm-up, 2 measured and 2 timed steps" in text
    assert "- adaptive, stage 0: layers stored/checkpointed/selective and recomputation per micro-batch, by length: " \
           "<= 32: 2/0/0, 0.0 ms; <= 64: 0/2/0, 4.0 ms" in text
    # The measuring step (step 1) is not a planned step; every later one's longest micro-batch is 64.
    worst = max(peak for step, peak in next(r for r in comparison(records)[(2, 0.5)][1]
                                            if r.config == ADAPTIVE).peaks_by_stage[0] if step > 1)
    assert ("- adaptive, stage 0: predicted / measured peak MiB of a planned step, by the bucket of its longest "
            f"micro-batch: <= 32: 2.00 / not seen; <= 64: 4.00 / {worst / MIB:.2f}") in text
    assert text.rstrip().endswith("adaptive / static = 0.86 (target <= 0.90): met; steps over budget: adaptive 0, "
                                  "static 0")
    document = json.loads(json.dumps(lengths_document(records, MACHINE, SCHEDULES)))
    assert document["targets"] == [text.rstrip().splitlines()[-1]]
    assert document["schedules"]["2"]["max_length"] == 64
    adaptive = next(r for r in document["rows"] if r["config"] == ADAPTIVE)
    assert adaptive["steps_over_budget"] == 0 and adaptive["steps_measured"] == 6
    assert adaptive["mean_step_time_s"] == pytest.approx(1.2) and adaptive["budgets_bytes"] == BUDGETS


def test_a_failed_launch_is_recorded():
    def launch(pp, schedule):
        raise RankFailure("rank 1 raised:\nRuntimeError: boom")

    records = length_records(SCHEDULES, launch, lambda report: report.splitlines()[-1])
    assert records == [{"pp": 2, "record": "launch", "rank": 0, "unavailable": "RuntimeError: boom"}]
    assert "- pp=2: the launch failed: RuntimeError: boom" in lengths_markdown(records, MACHINE, SCHEDULES)


# -- the command line -------------------------------------------------------------------

@pytest.mark.parametrize("argv", [["--lengths", "--model", "encoder"], ["--lengths", "--budget", "0.5"],
                                  ["--lengths", "--model", "encoder", "--budget", "0.5", "--modes", "none"],
                                  ["--lengths", "--model", "llama", "--budget", "0.5", "--partition", "planned"]])
def test_the_command_line_refuses_what_lengths_does_not_run(argv, capsys):
    with pytest.raises(SystemExit):
        main(argv)
    assert "--lengths needs --budget" in capsys.readouterr().err


def test_the_command_line_runs_one_launch_per_depth(monkeypatch, tmp_path, capsys):
    calls = []

    def fake_run_ranks(fn, world_size, pp, fractions, preset, schedule, rank_threads, **kwargs):
        calls.append((fn.__name__, world_size, pp, fractions, preset.model.context, schedule))
        return _records(pp)

    monkeypatch.setattr(pipeline_cli, "run_ranks", fake_run_ranks)
    path = tmp_path / "lengths.json"
    assert main(["--lengths", "--model", "encoder", "--context", "64", "--pp", "2", "--budget", "0.5",
                 "--timed-steps", "3", "--measured-steps", "2", "--json", str(path)]) == 0
    (name, world, pp, fractions, context, schedule), = calls
    assert (name, world, pp, fractions, context) == ("measure_lengths", 2, 2, (0.5, ), 64)
    assert (schedule.max_length, len(schedule.measured), len(schedule.timed)) == (64, 2, 3)
    assert all(len(step) == 4 for step in schedule.steps)  # 2 x pp micro-batches
    assert "adaptive / static = 0.86 (target <= 0.90): met" in capsys.readouterr().out
    assert json.loads(path.read_text())["machine"]["command"].startswith("python -m benchmarks.pipeline --lengths")
    assert _parser().parse_args(["--lengths"]).measured_steps == MEASURED_STEPS


# -- one real launch --------------------------------------------------------------------

def test_a_tiny_launch_measures_every_configuration():
    """pp=2, a small encoder: every configuration measured on the lengths, the
    planned ones within their budgets from the planner's own steps on."""
    import dataclasses

    from benchmarks.pipeline.lengths.rank import measure_lengths
    from benchmarks.pipeline.models import EncoderConfig
    from benchmarks.pipeline.modes import PRESETS
    from ds_pipe_ckpt.testing import run_ranks

    # Sequences long for a narrow model, so that the activations, which plans control, are most of
    # a stage's peak; small enough for a test (about 25 s), with a budget (0.95 x) that every
    # configuration fits at this size.
    preset = dataclasses.replace(PRESETS["quick"], model=EncoderConfig(dim=32, heads=2, blocks=4, context=64))
    # The planner's length checks may run on into the timed step: a test, not a timing.
    schedule = length_schedule(64, 4, timed=1, measured=1, warmup=PLANNED_WARMUP_STEPS)
    records = _flat(run_ranks(measure_lengths, 2, 2, (0.95, ), preset, schedule, 1, timeout=600, threads=1))
    (budgets, rows), = comparison(records).values()
    by_config = {row.config: row for row in rows}
    assert list(by_config) == [NONE, UNIFORM_BEST, STATIC, ADAPTIVE]
    for row in rows:
        assert row.reason is None, row.reason
        assert len(row.step_times_s) == 1
    for config in (STATIC, ADAPTIVE):
        row = by_config[config]
        assert row.over_budget(budgets) == [], (config, budgets, row.peaks_by_stage)
        assert row.steps_measured >= 2 * 4  # step 0, the measuring, first planned and the benchmark's step
        assert row.planning_s > 0
    assert [len(plans) for plans in by_config[ADAPTIVE].length_plans.values()] == [8, 8]
    for stage, buckets in by_config[ADAPTIVE].bucket_peaks.items():
        seen = [(edge, predicted, measured) for edge, predicted, measured in buckets if measured is not None]
        assert seen and all(measured <= predicted for _, predicted, measured in seen), (stage, buckets)
    assert [len(plans) for plans in by_config[STATIC].length_plans.values()] == [1, 1]
