"""benchmarks.checkpointing: the small-regions workloads (the per-call cost of
checkpointing) build and run, and their target is read against torch's own
checkpoint. The figures themselves are measured on a quiet machine
(docs/performance.md), never asserted here."""

import pytest
import torch

from benchmarks.checkpointing import runner
from benchmarks.checkpointing.report import time_tolerance
from benchmarks.checkpointing.workloads import DEFAULT_WORKLOADS, WORKLOAD_NAMES, build_workload


def test_small_region_workloads_have_their_size():
    for regions in (32, 1024):
        workload = build_workload(f"small_regions_{regions}", "quick")
        assert len(workload.segments) == regions
        assert workload.input_shape == (32, 64)
        assert [type(m).__name__ for m in workload.segments[0]] == ["Linear", "GELU"]
    assert "small_regions_1024" in WORKLOAD_NAMES and "small_regions_32" not in DEFAULT_WORKLOADS
    assert time_tolerance("small_regions_32") == 1.05 and time_tolerance("gpt_stage") == 1.01


def test_the_benchmark_runs_a_small_regions_workload(capsys):
    threads = torch.get_num_threads()
    try:
        assert runner.main(["--threads", "1", "--repetitions", "5", "--workloads", "small_regions_32",
                            "--variants", "none", "torch_non_reentrant", "ours_non_reentrant"]) == 0
    finally:
        torch.set_num_threads(threads)
    report = capsys.readouterr().out
    assert "### small_regions_32" in report
    assert "- small_regions_32: step time" in report and "(target <= 1.05)" in report
    assert "1 torch threads" in report


def test_the_region_loop_runs(capsys):
    from benchmarks.checkpointing import region_loop

    threads = torch.get_num_threads()
    try:
        region_loop.main(["4", "--rounds", "3"])
    finally:
        torch.set_num_threads(threads)
    assert "N = 4: torch " in capsys.readouterr().out


def test_the_per_call_figures_and_profile_are_reported(capsys):
    threads = torch.get_num_threads()
    try:
        assert runner.main(["--threads", "1", "--repetitions", "5", "--workloads", "small_regions_32",
                            "--variants", "none", "torch_non_reentrant", "ours_non_reentrant",
                            "--profile"]) == 0
    finally:
        torch.set_num_threads(threads)
    report = capsys.readouterr().out
    assert "| variant | ms per call | own ms per call | own ÷ torch non-reentrant's |" in report
    assert "| ours_non_reentrant | " in report.split("| variant | ms per call |")[1]
    assert "Profile (cProfile, garbage collector off), per region call" in report
    assert "ours_non_reentrant: ds_pipe_ckpt's own time per region call" in report


def test_the_region_loop_measures_the_ablations(capsys):
    from benchmarks.checkpointing import region_loop
    from ds_pipe_ckpt.recompute import SavedTensorProbe
    from ds_pipe_ckpt.region_call import RegionCall

    before = (SavedTensorProbe.run_forward, RegionCall.__call__)
    threads = torch.get_num_threads()
    try:
        region_loop.main(["4", "--rounds", "2", "--ablations"])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    for name in ("ours", "ours_check_off", "ours_no_renaming", "ours_bare_call"):
        assert f"{name} / torch" in out
    assert (SavedTensorProbe.run_forward, RegionCall.__call__) == before  # the patches are undone


def test_rank_measurements_count_frees_on_every_thread(monkeypatch):
    """measure_in_rank turns on the CPU allocator's process-wide size records
    before it builds a stage: gloo's worker threads free the buffers of the
    partitioned variant's all-gathers, and without the records those frees
    are never subtracted (steps end 0.1 to 3 MiB over; UnaccountedMemoryError)."""
    from benchmarks.checkpointing import measure
    from ds_pipe_ckpt.memory import cpu_allocations_tracked, track_cpu_allocations

    seen = []

    def build_workload_stub(name, preset):
        seen.append(cpu_allocations_tracked())
        raise LookupError("stop before the stage is built")

    threads = torch.get_num_threads()
    previous = track_cpu_allocations(False)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 0)
    monkeypatch.setattr(measure, "build_workload", build_workload_stub)
    try:
        with pytest.raises(LookupError):
            measure.measure_in_rank([("alexnet_stage", "ours_partitioned")], "quick", "cpu", 5, 1, threads)
    finally:
        track_cpu_allocations(previous)
        torch.set_num_threads(threads)
    assert seen == [True]
