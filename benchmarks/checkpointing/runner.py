"""Memory and time of every activation-checkpointing path, side by side with
upstream DeepSpeed, on the same pipeline stages in one run.

Run from the repository root::

    python -m benchmarks.checkpointing [--quick] [--json PATH] [--png PATH]
    python -m benchmarks.checkpointing --preset gpu --json PATH --png PATH   # on a GPU
    python -m benchmarks.checkpointing --threads 1 --workloads small_regions_32 small_regions_1024 \
        --variants none torch_non_reentrant deepspeed_non_reentrant ours_non_reentrant --profile   # per-call cost

For each workload (:mod:`benchmarks.checkpointing.workloads`) and variant
(:mod:`benchmarks.checkpointing.variants`) it prints the peak memory of one forward+backward
above the memory held before it, the memory still held after the forward, the
analytic floor (:mod:`benchmarks.checkpointing.floor`), the median, min and max step time
over the timed repetitions, and the ratios to no checkpointing and to
DeepSpeed's non-reentrant checkpoint; on the small-regions workloads also the
time per checkpointed call, and with ``--profile`` where it goes
(:mod:`benchmarks.checkpointing.call_profile`). Runs on CUDA when available, else CPU.

It decides no measurement of its own: what runs is :mod:`.workloads`' and
:mod:`.variants`', how it is measured :mod:`.measure`'s.
"""

from __future__ import annotations

import os

# Keep the profiler's (kineto's) log lines, levels 0-5, out of the report; read
# when the profiler first starts.
os.environ.setdefault("KINETO_LOG_LEVEL", "6")

import argparse  # noqa: E402
import sys  # noqa: E402
from typing import Sequence  # noqa: E402

import torch  # noqa: E402

from ds_pipe_ckpt.testing import run_ranks  # noqa: E402
from ..common import machine_info  # noqa: E402
from .call_profile import profile_variant  # noqa: E402
from .floor import checkpointing_floor, segment_sizes  # noqa: E402
from .measure import Result, Stage, measure_in_rank, measure_variants  # noqa: E402
from .report import WorkloadReport, markdown, write_json, write_png  # noqa: E402
from .variants import VARIANTS, Variant  # noqa: E402
from .workloads import DEFAULT_WORKLOADS, SIZES, WORKLOAD_NAMES, build_workload  # noqa: E402

__all__ = ["main"]

FULL_REPETITIONS = 15
QUICK_REPETITIONS = 5
WARMUP = 1


def _unavailable(variants: Sequence[Variant], device: torch.device) -> dict[str, str]:
    """Variant name -> why it cannot run here, for those that cannot."""
    reasons = {}
    for candidate in variants:
        reason = candidate.unavailable_reason()
        if reason is None and device.type == "cuda" and (candidate.world_size or 0) > torch.cuda.device_count():
            reason = f"needs {candidate.world_size} GPUs, {torch.cuda.device_count()} visible"
        if reason is not None:
            reasons[candidate.name] = reason
    return reasons


def run_in_process(name: str, preset: str, device: torch.device, variants: Sequence[Variant],
                   unavailable: dict[str, str], repetitions: int, profile: bool = False) -> WorkloadReport:
    """Measure the in-process variants on one workload (and, with ``profile``,
    profile one step of each checkpointing variant after the timed ones)."""
    workload = build_workload(name, preset)
    floor = checkpointing_floor(segment_sizes(workload, device))
    runnable = [v for v in variants if v.world_size is None and v.name not in unavailable]
    stage = Stage(workload, device)
    results = measure_variants(stage, runnable, floor.floor_bytes, repetitions, WARMUP)
    report = WorkloadReport(name, workload.description, floor, results, regions=len(workload.segments))
    report.unavailable.update(unavailable)
    if profile:
        report.profiles = [profile_variant(stage, v, len(workload.segments)) for v in runnable if v.checkpoint]
    return report


def run_in_ranks(reports: Sequence[WorkloadReport], preset: str, device: torch.device,
                 variants: Sequence[Variant], unavailable: dict[str, str], repetitions: int, threads: int) -> None:
    """Measure the multi-rank variants on every workload, one launch per world
    size (process start-up is the slow part), and add them to ``reports``."""
    by_name = {report.name: report for report in reports}
    for world_size in sorted({v.world_size for v in variants if v.world_size is not None}):
        names = [v.name for v in variants if v.world_size == world_size and v.name not in unavailable]
        jobs = [(workload, name) for workload in by_name for name in names]
        if not jobs:
            continue
        threads_per_rank = max(1, threads // world_size)
        per_rank = run_ranks(measure_in_rank, world_size, jobs, preset, device.type, repetitions, WARMUP,
                             threads_per_rank, backend="nccl" if device.type == "cuda" else "gloo")
        for records in zip(*per_rank):  # one record per rank for each job
            report = by_name[records[0]["workload"]]
            report.results.append(Result.from_json(records[0]))
            peaks = ", ".join(f"{r['peak_bytes'] / 2**20:.1f}" for r in records)
            report.notes.append(
                f"{records[0]['variant']}: ran in {world_size} rank processes with {threads_per_rank} torch "
                f"thread(s) each, after the other variants; figures are rank 0's (peak MiB by rank: {peaks}).")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.checkpointing",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_const", dest="preset", const="quick",
                        help=f"same as --preset quick: smaller batches, {QUICK_REPETITIONS} timed repetitions "
                        "(under 2 minutes on 2 CPU cores)")
    parser.add_argument("--preset", choices=sorted(SIZES),
                        help="workload sizes (benchmarks/checkpointing/workloads.py SIZES); 'gpu' for a GPU (default: full)")
    parser.set_defaults(preset="full")
    parser.add_argument("--json", metavar="PATH", help="write every result and raw sample to PATH")
    parser.add_argument("--png", metavar="PATH", help="plot peak memory against step time to PATH")
    parser.add_argument("--repetitions", type=int, default=None,
                        help=f"timed steps per variant, at least 5 (default {FULL_REPETITIONS}; "
                        f"{QUICK_REPETITIONS} with --quick)")
    parser.add_argument("--workloads", nargs="+", choices=WORKLOAD_NAMES, default=list(DEFAULT_WORKLOADS),
                        help=f"default: {' '.join(DEFAULT_WORKLOADS)}")
    parser.add_argument("--variants", nargs="+", choices=[v.name for v in VARIANTS],
                        default=[v.name for v in VARIANTS], help="default: all")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: torch's, i.e. the number of cores)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--profile", action="store_true",
                        help="after the timed steps, profile one step of each in-process checkpointing variant "
                        "(cProfile) and report where the time per region call goes")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    repetitions = args.repetitions or (QUICK_REPETITIONS if args.preset == "quick" else FULL_REPETITIONS)
    if repetitions < 5:
        raise SystemExit("--repetitions must be at least 5")
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    variants = [v for v in VARIANTS if v.name in args.variants]
    machine = machine_info(device, threads)
    machine.update(command=" ".join(["python -m benchmarks.checkpointing", *argv]), preset=args.preset,
                   sizes=SIZES[args.preset], repetitions=repetitions, warmup=WARMUP)

    unavailable = _unavailable(variants, device)
    reports = [run_in_process(name, args.preset, device, variants, unavailable, repetitions, args.profile)
               for name in args.workloads]
    run_in_ranks(reports, args.preset, device, variants, unavailable, repetitions, threads)
    machine["load_average_at_end"] = os.getloadavg()
    print(markdown(reports, machine, variants), end="")
    print(f"Load average (1, 5, 15 min): {machine['load_average_at_start']} at start, "
          f"{machine['load_average_at_end']} at end.")
    if args.json:
        write_json(args.json, reports, machine)
    if args.png:
        write_png(args.png, reports, machine, variants)
    return 0


if __name__ == "__main__":
    sys.exit(main())
