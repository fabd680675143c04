"""The pure logic of ``python -m benchmarks.pipeline``: modes and their configs,
the 1F1B in-flight count, the per-stage summary, the targets, the table and
the JSON document, on hand-made per-rank records (no timing is asserted)."""

import json

import pytest

from benchmarks.pipeline.modes import (PRESETS, PipelineMode, base_config, layouts, merge_config,
                                       micro_batches_in_flight, modes)
from benchmarks.pipeline.report import check_targets, document, markdown, summarize, write_json, write_png

MIB = 2**20


def test_mode_configs_merge_into_the_base_config():
    base = base_config(PRESETS["quick"], pp=2)
    assert base["gradient_accumulation_steps"] == 4  # 2 x pp
    assert base["train_batch_size"] == base["train_micro_batch_size_per_gpu"] * 4
    by_name = {mode.name: mode for mode in modes()}
    assert list(by_name)[0] == "none"
    selective = merge_config(base, by_name["selective"].config)
    assert selective["pipeline"] == {"activation_checkpoint_interval": 1, "use_reentrant": False}
    assert selective["activation_checkpointing"] == {"policy": "selective"}
    assert selective["optimizer"] == base["optimizer"]
    assert "activation_checkpointing" not in base  # the base is not modified
    assert by_name["partitioned"].mp == 2
    assert merge_config(base, by_name["partitioned"].config)["activation_checkpointing"] == {
        "partition_activations": True}


def test_merge_config_merges_nested_sections_and_replaces_values():
    base = {"a": {"x": 1, "y": {"p": 1}}, "b": 2}
    assert merge_config(base, {"a": {"y": {"q": 2}}, "b": 3, "c": [1]}) == {
        "a": {"x": 1, "y": {"p": 1, "q": 2}}, "b": 3, "c": [1]}
    assert base == {"a": {"x": 1, "y": {"p": 1}}, "b": 2}


def test_layouts_group_modes_by_model_parallel_size():
    mode_list = (PipelineMode("none", ""), PipelineMode("planned", "", {"x": 1}), PipelineMode("partitioned", "", mp=2))
    plan = layouts(PRESETS["full"], mode_list)
    assert [(l.pp, l.mp, l.modes, l.world_size) for l in plan] == [
        (2, 1, ("none", "planned"), 2), (2, 2, ("partitioned",), 4),
        (4, 1, ("none", "planned"), 4), (4, 2, ("partitioned",), 8)]


@pytest.mark.parametrize("pp, micro_batches, expected", [
    (2, 4, [2, 1]),
    (4, 8, [4, 3, 2, 1]),
    (4, 2, [2, 2, 2, 1]),  # fewer micro-batches than stages: capped
])
def test_micro_batches_in_flight_follows_1f1b(pp, micro_batches, expected):
    assert [micro_batches_in_flight(pp, stage, micro_batches) for stage in range(pp)] == expected


def test_micro_batches_in_flight_rejects_a_stage_outside_the_pipeline():
    with pytest.raises(ValueError, match="stage 2 is not in"):
        micro_batches_in_flight(2, 2, 4)


def _record(mode, stage, rank, peak_mib, times, mp=1, pp=2, net=0):
    return {"model": "gpt", "pp": pp, "mp": mp, "dp": 1, "mode": mode, "stage": stage, "rank": rank,
            "peak_bytes": int(peak_mib * MIB), "step_net_bytes": net, "step_time_s": sorted(times)[len(times) // 2],
            "step_times_s": times, "micro_batches": 2 * pp,
            "micro_batches_in_flight": micro_batches_in_flight(pp, stage, 2 * pp), "torch_threads": 1}


RECORDS = [
    _record("none", 0, 0, 10.0, [0.20, 0.21, 0.22]), _record("none", 1, 1, 6.0, [0.20, 0.21, 0.22]),
    _record("non_reentrant", 0, 0, 4.0, [0.30, 0.31, 0.32]), _record("non_reentrant", 1, 1, 3.0, [0.30, 0.30, 0.30]),
    _record("selective", 0, 0, 5.0, [0.25, 0.26, 0.27], net=8), _record("selective", 1, 1, 6.5, [0.25, 0.26, 0.27]),
    # mp=2: two ranks per stage; the stage's figure is the larger.
    _record("partitioned", 0, 0, 3.5, [0.5, 0.6, 0.7], mp=2), _record("partitioned", 0, 1, 3.6, [0.5, 0.6, 0.8], mp=2),
    _record("partitioned", 1, 2, 2.5, [0.5, 0.6, 0.7], mp=2), _record("partitioned", 1, 3, 2.5, [0.5, 0.6, 0.7], mp=2),
    {"pp": 2, "mp": 1, "mode": "planned", "rank": 0, "unavailable": "activation_checkpointing.budget = 0.5 is invalid"},
]


def test_summary_takes_the_largest_peak_of_each_stage_and_the_slowest_rank():
    summaries = {s.mode: s for s in summarize(RECORDS)}
    assert list(summaries) == ["none", "non_reentrant", "selective", "partitioned"]
    partitioned = summaries["partitioned"]
    assert partitioned.peak_bytes_by_stage == {0: int(3.6 * MIB), 1: int(2.5 * MIB)}
    assert partitioned.in_flight_by_stage == {0: 2, 1: 1}
    assert partitioned.step_time_s == 0.6
    assert (partitioned.step_time_min_s, partitioned.step_time_max_s) == (0.5, 0.8)
    assert summaries["none"].imbalance == pytest.approx(10 / 6)
    assert summaries["selective"].net_bytes == 8


def test_targets_flag_a_stage_above_the_baseline():
    checks = check_targets(summarize(RECORDS))
    assert [(c.target, c.met) for c in checks] == [
        ("non_reentrant peak < none peak on every stage", True),
        ("selective peak < none peak on every stage", False),  # stage 1: 6.5 > 6.0 MiB
        ("none <= selective <= non_reentrant median step time", True),
    ]
    assert checks[1].detail == "stage 0 0.500 x, stage 1 1.083 x"
    # non_reentrant's time is its slowest rank's median: 310 ms.
    assert checks[2].line() == ("- pp=2: none <= selective <= non_reentrant median step time: met "
                                "(210 / 260 / 310 ms)")


def test_targets_without_a_mode_are_not_measured():
    checks = check_targets(summarize([r for r in RECORDS if r["mode"] != "selective"]))
    assert [c.met for c in checks] == [True, None, None]


def test_markdown_table_shows_stage_peaks_imbalance_and_unavailable_modes():
    machine = {"summary": "cpu: test machine", "model": "gpt", "device": "cpu", "cpu_count": 2}
    order = {"none": "no checkpointing", "partitioned": "sharded", "selective": "kept matmuls"}
    text = markdown(RECORDS, machine, order)
    rows = [line.split(" | ")[0] for line in text.splitlines() if line.startswith("| ") and "MiB" not in line]
    assert rows == ["| none", "| partitioned", "| selective", "| non_reentrant", "| planned"]
    assert "4 micro-batches per step; micro-batches in flight by stage (1F1B): 2, 1." in text
    assert "| none | 2 x 1 | 10.00 | 6.00 | 1.67 | 1.00, 1.00 | 210 (200-220) | 1.00 |" in text
    assert "| partitioned | 2 x 2 | 3.60 | 2.50 | 1.44 | 0.36, 0.42 | 600 (500-800) | 2.86 |" in text
    assert "| planned | 2 x 1 | not available: activation_checkpointing.budget = 0.5 is invalid |" in text
    assert "- pp=2: selective peak < none peak on every stage: MISSED" in text
    assert ("Ran as pp x mp = 2 x 1: 2 rank processes, 1 torch thread(s) each; pp x mp = 2 x 2: 4 rank processes, "
            "1 torch thread(s) each, on 2 logical CPUs. Step times of rows whose ranks outnumber the CPUs are not "
            "comparable with the others.") in text


def test_json_document_keeps_every_rank_record(tmp_path):
    machine = {"summary": "cpu", "model": "gpt", "device": "cpu"}
    path = tmp_path / "pipeline.json"
    write_json(str(path), RECORDS, machine)
    loaded = json.loads(path.read_text())
    assert loaded == json.loads(json.dumps(document(RECORDS, machine)))
    assert loaded["machine"] == machine
    assert len(loaded["results"]) == 10
    assert {"model", "pp", "mp", "mode", "stage", "rank", "peak_bytes", "step_time_s",
            "micro_batches_in_flight"} <= set(loaded["results"][0])
    assert loaded["unavailable"][0]["mode"] == "planned"
    assert loaded["summary"][0]["peak_bytes_by_stage"] == {"0": 10 * MIB, "1": 6 * MIB}


def test_png_has_a_panel_per_depth(tmp_path):
    records = RECORDS + [_record("none", stage, stage, 4.0 - stage, [0.3], pp=4) for stage in range(4)]
    path = tmp_path / "pipeline.png"
    write_png(str(path), records, {"model": "gpt", "device": "cpu"}, ["none", "partitioned"])
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_command_line_model_sizes_override_the_preset():
    from benchmarks.pipeline.runner import _parser, _preset

    preset = _preset(_parser().parse_args(["--quick", "--dim", "128", "--context", "32"]))
    assert (preset.model.dim, preset.model.context, preset.model.blocks) == (128, 32, PRESETS["quick"].model.blocks)
    assert preset.pipeline_depths == PRESETS["quick"].pipeline_depths
    assert _preset(_parser().parse_args([])) == PRESETS["full"]
    with pytest.raises(ValueError, match="dim = 100 is not divisible by heads = 8"):
        _preset(_parser().parse_args(["--dim", "100", "--heads", "8"]))


def test_command_line_chooses_the_model_depths_and_timed_steps():
    from benchmarks.pipeline.runner import _parser, _preset
    from benchmarks.pipeline.models import EncoderConfig, model_description, model_name

    preset = _preset(_parser().parse_args(["--model", "encoder", "--blocks", "8", "--pp", "2", "4", "2",
                                           "--timed-steps", "3"]))
    assert preset.model == EncoderConfig(dim=128, context=128, blocks=8)
    assert (model_name(preset.model), preset.pipeline_depths, preset.timed_steps) == ("encoder", (2, 4), 3)
    assert model_description(preset.model).startswith("encoder (nn.TransformerEncoderLayer) d=128 heads=4 blocks=8")
    assert model_name(PRESETS["full"].model) == "gpt"
    with pytest.raises(ValueError, match="--timed-steps 0: at least one step"):
        _preset(_parser().parse_args(["--timed-steps", "0"]))
    with pytest.raises(ValueError, match="--pp 2 0: every pipeline depth must be >= 1"):
        _preset(_parser().parse_args(["--pp", "2", "0"]))
    with pytest.raises(ValueError, match="EncoderConfig.dim = 100 is not divisible by heads = 8"):
        _preset(_parser().parse_args(["--model", "encoder", "--dim", "100", "--heads", "8"]))
    with pytest.raises(ValueError, match="classes = 10 > features = 4"):
        EncoderConfig(features=4)
    llama = _preset(_parser().parse_args(["--model", "llama", "--blocks", "6", "--quick"])).model
    assert (model_name(llama), llama.blocks, llama.dim, llama.context) == ("llama", 6, 128, 128)
    config = llama.config()
    assert (config.num_hidden_layers, config.hidden_size, config.num_key_value_heads, config.vocab_size) == (6, 128, 2, 256)
    with pytest.raises(ValueError, match="LlamaSizes.dim = 100 is not divisible by heads = 8"):
        _preset(_parser().parse_args(["--model", "llama", "--dim", "100", "--heads", "8"]))


# -- --budget: planned against the best uniform interval ----------------------------------

from benchmarks.pipeline.budget import (PLANNED, UNIFORM_BEST, BudgetOutcome, budget_records,  # noqa: E402
                                        infeasible_minimum, planned_mode, stage_budgets, uniform_best,
                                        uniform_modes)
from benchmarks.pipeline.report import check_budget_targets, write_budget_png  # noqa: E402


def _rank_record(mode, stage, peak_mib, step_s, **extra):
    return {"pp": 2, "mp": 1, "dp": 1, "mode": mode, "stage": stage, "rank": stage, "peak_bytes": int(peak_mib * MIB),
            "step_net_bytes": 0, "step_time_s": step_s, "step_times_s": [step_s], "micro_batches": 4,
            "micro_batches_in_flight": 2 - stage, "torch_threads": 1, **extra}


def _summary(mode, peaks_mib, step_s):
    return summarize([_rank_record(mode, stage, peak, step_s) for stage, peak in enumerate(peaks_mib)])[0]


def test_budgets_are_fractions_of_each_stages_peak_without_checkpointing():
    none = _summary("none", [10.0, 6.0], 0.1)
    assert stage_budgets(none, 0.5) == {0: 5 * MIB, 1: 3 * MIB}
    mode = planned_mode(stage_budgets(none, 0.5), 0.5)
    assert mode.config["activation_checkpointing"]["memory_budget_mb"] == [5.0, 3.0]
    assert mode.config["pipeline"] == {"activation_checkpoint_interval": 0, "use_reentrant": False}
    assert mode.warmup_steps == 5 and mode.name == PLANNED  # measure, plan + check, 2 re-plans, 1 quiet
    with pytest.raises(ValueError, match="must be positive"):
        stage_budgets(none, 0)


def test_uniform_best_is_the_fastest_candidate_that_fits_every_stage():
    candidates = [_summary("none", [10.0, 6.0], 0.10), _summary("uniform_1", [4.0, 3.0], 0.16),
                  _summary("uniform_2", [5.0, 4.0], 0.13), _summary("uniform_3", [7.0, 3.5], 0.12)]
    assert uniform_best(candidates, {0: 6 * MIB, 1: 4 * MIB}).mode == "uniform_2"  # uniform_3 is over on stage 0
    assert uniform_best(candidates, {0: 20 * MIB, 1: 20 * MIB}).mode == "none"
    assert uniform_best(candidates, {0: 3 * MIB, 1: 3 * MIB}) is None
    assert [m.name for m in uniform_modes(3)] == ["uniform_1", "uniform_2", "uniform_3"]
    assert uniform_modes(2)[1].config["pipeline"]["activation_checkpoint_interval"] == 2


def test_the_planners_error_gives_the_least_feasible_budget():
    message = ("ds_pipe_ckpt.errors.ConfigError: activation_checkpointing.memory_budget_mb = 1.2 is invalid: "
               "expected at least 1.83 MiB for pipeline stage 0. No plan keeps ...")
    assert infeasible_minimum(message) == (0, 1.83)
    assert infeasible_minimum("RuntimeError: connection closed") is None


def _steps(measuring_mib, *planned):
    """``step_peaks`` as the rank records carry them: (step, peak MiB, predicted MiB) per planned step."""
    return [{"step": 2, "kind": "measuring", "peak_bytes": int(measuring_mib * MIB), "predicted_bytes": None}] + [
        {"step": step, "kind": "planned", "peak_bytes": int(peak * MIB), "predicted_bytes": int(predicted * MIB)}
        for step, peak, predicted in planned]


def test_budget_rows_targets_and_table():
    budgets = {0: 6 * MIB, 1: 4 * MIB}
    planned = [_rank_record("planned", 0, 5.5, 0.12, predicted_peak_bytes=int(5.8 * MIB),
                            step_peaks=_steps(3.0, (3, 5.6, 5.8), (6, 5.5, 5.8))),
               _rank_record("planned", 1, 3.0, 0.12, predicted_peak_bytes=int(3.6 * MIB),
                            step_peaks=_steps(2.0, (3, 3.0, 3.6), (6, 3.0, 3.6)))]
    uniform = [_rank_record("uniform_2", 0, 5.0, 0.13), _rank_record("uniform_2", 1, 4.0, 0.13)]
    outcome = BudgetOutcome(2, 0.5, budgets, planned=planned, uniform=_summary("uniform_2", [5.0, 4.0], 0.13),
                            uniform_records=uniform)
    rows = budget_records(outcome)
    assert {(r["mode"], r["stage"], r["budget_bytes"]) for r in rows} == {
        (PLANNED, 0, 6 * MIB), (PLANNED, 1, 4 * MIB), (UNIFORM_BEST, 0, 6 * MIB), (UNIFORM_BEST, 1, 4 * MIB)}
    assert all(r["budget_fraction"] == 0.5 for r in rows)
    assert {r["uniform_mode"] for r in rows if r["mode"] == UNIFORM_BEST} == {"uniform_2"}
    infeasible = BudgetOutcome(2, 0.3, {0: 3 * MIB, 1: 2 * MIB}, infeasible="ConfigError: ... at least 4.2 MiB ...")
    rows += budget_records(infeasible)
    summaries = [s for s in summarize(rows) if s.budget_fraction is not None]
    checks = {(c.target.split(":")[0], c.target.split(": ", 1)[1].split(" (")[0]): c
              for c in check_budget_targets(summaries, [r for r in rows if "unavailable" in r])}
    assert checks[("budget 0.5 x", "every stage planned")].met is True
    assert checks[("budget 0.5 x", "no measured planned step over budget")].met is True
    assert checks[("budget 0.5 x", "planned step time <= uniform_best's")].met is True
    prediction = checks[("budget 0.5 x", "predicted peak within 10% of every measured planned step")]
    assert prediction.met is False and prediction.detail == "+3.6% to +20.0%"
    refused = checks[("budget 0.3 x", "planned runs, or names the least budget where nothing fits")]
    assert refused.met is False  # the reason names no least budget
    named = "ConfigError: activation_checkpointing.memory_budget_mb = 3 is invalid: expected at least 4.20 MiB for " \
        "pipeline stage 0."
    checks = {c.target: c for c in check_budget_targets(
        [], [r | {"unavailable": named} if r["mode"] == PLANNED else r for r in budget_records(infeasible)])}
    refused = checks["budget 0.3 x: planned runs, or names the least budget where nothing fits"]
    assert refused.met is True and refused.detail.endswith("stage 0 needs 4.20 MiB")
    report = markdown(rows + [_rank_record("none", 0, 10.0, 0.1), _rank_record("none", 1, 6.0, 0.1)],
                      {"summary": "cpu", "model": "gpt", "cpu_count": 2}, {"none": "no checkpointing"})
    assert "### pp = 2: memory budgets" in report
    # The worst measured planned step of stage 0 was its first (5.60 MiB), not the benchmark's (5.50).
    assert ("| 0.5 x | 6.00, 4.00 | 5.60, 3.00 | 5.80, 3.60 | 4 / 0 | +3.6% to +20.0% | 120 | uniform_2 | 5.00, 4.00 "
            "| 130 | 0.92 |") in report
    assert "| 0.3 x | 3.00, 2.00 | infeasible: ConfigError: ... at least 4.2 MiB ... | - | - | - | - | none fits" in report
    assert "### pp = 2\n" in report  # the plain table holds only the plain modes
    assert "| planned |" not in report.split("### pp = 2: memory budgets")[0]


def test_a_first_planned_step_over_budget_misses_the_target_and_a_stage_without_plan_is_named():
    budgets = {0: 6 * MIB, 1: 4 * MIB}
    planned = [_rank_record("planned", 0, 5.5, 0.12, predicted_peak_bytes=int(5.7 * MIB),
                            step_peaks=_steps(3.0, (3, 6.3, 5.6), (4, 5.5, 5.7), (6, 5.5, 5.7))),
               _rank_record("planned", 1, 3.0, 0.12)]  # stage 1 never planned
    rows = budget_records(BudgetOutcome(2, 0.5, budgets, planned=planned))
    (summary,) = [s for s in summarize(rows) if s.mode == PLANNED]
    assert summary.over_budget_steps == [(0, 3, int(6.3 * MIB))]
    assert summary.measuring_peak_bytes_by_stage == {0: 3 * MIB}
    checks = {c.target.split(": ", 1)[1].split(" (")[0]: c
              for c in check_budget_targets([s for s in summarize(rows) if s.budget_fraction is not None], [])}
    over = checks["no measured planned step over budget"]
    assert over.met is False and over.detail.startswith("1 of 3 steps over; stage 0 step 3: 1.050 x")
    assert checks["every stage planned"].met is False and checks["every stage planned"].detail == \
        "stages [1] did not plan"
    assert checks["predicted peak within 10% of every measured planned step"].detail == "-11.1% to +3.6%"


def test_budget_plot_is_written(tmp_path):
    rows = budget_records(BudgetOutcome(2, 0.5, {0: 6 * MIB, 1: 4 * MIB},
                                        planned=[_rank_record("planned", 0, 5.5, 0.12),
                                                 _rank_record("planned", 1, 3.0, 0.12)]))
    write_budget_png(str(tmp_path / "budget.png"), rows, {"model": "gpt", "device": "cpu"})
    assert (tmp_path / "budget.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
