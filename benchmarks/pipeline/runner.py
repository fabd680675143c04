"""Peak memory of every pipeline stage and step time, per activation-checkpointing
mode, in DeepSpeed's PipelineEngine on the GPT example model (or transformers'
Llama layers, ``--model llama``, or a stack of torch's
``nn.TransformerEncoderLayer``, ``--model encoder``).

Run from the repository root::

    python -m benchmarks.pipeline [--quick] [--json PATH] [--png PATH] [--dim D] [--context T] [--blocks N]
    python -m benchmarks.pipeline --budget 0.3 0.5 0.75 [...]   # also the planner against uniform intervals
    python -m benchmarks.pipeline --modes none --budget 0.3 [...]  # only what the budget rows need
    python -m benchmarks.pipeline --model encoder --modes none --budget 0.3 0.5 0.7 0.9 --timed-steps 5
    python -m benchmarks.pipeline --partition planned --model llama --blocks 16 --vocab 4096 --budget 0.5 0.7
    python -m benchmarks.pipeline --lengths --model encoder --pp 2 --budget 0.5 0.7 --timed-steps 10

For each pipeline depth (pp=2; also pp=4 without ``--quick``) and mode
(:mod:`benchmarks.pipeline.modes`: none, reentrant, non_reentrant, selective,
partitioned at mp=2, cpu_offload), every rank runs ``engine.train_batch()``
with gradient accumulation 2 x pp and reports the peak memory of one step
above what was allocated when it began (:mod:`ds_pipe_ckpt.memory`) and its
median step time. Under DeepSpeed's 1F1B schedule stage ``s`` holds the
forward state of ``min(pp - s, micro-batches)`` micro-batches, so the first
stage peaks highest; the tables show that imbalance and what each mode does
to it. Ranks run in local processes (``ds_pipe_ckpt.testing.run_ranks``), one
launch per world size. On CUDA when available, else CPU (gloo).

With ``--budget F ...`` it also runs, per depth and fraction F, the planner
under budgets of F times each stage's peak without checkpointing (``planned``)
and finds the fastest uniform ``activation_checkpoint_interval`` that fits the
same budgets (``uniform_best``): :mod:`benchmarks.pipeline.budget`. Every
step of a planned run that is measured (the planner's measuring step, each
planned step it checks, the first one included, and the benchmark's measured
step) is reported with its peak, and the planned steps over their budget are
counted. With ``--png P`` a second plot, ``P`` with ``-budget`` before its
suffix, shows step time against budget.

With ``--partition planned --budget F ...`` it compares instead the planned
partition (``pipeline.partition_method = "planned"``: stage boundaries chosen
with each stage's checkpointing) with DeepSpeed's ``"parameters"`` and
``"uniform"`` partitions, each with its best uniform interval and with the
per-stage planner, under one budget on every stage
(:mod:`benchmarks.pipeline.partition.runner`); ``--png P`` then plots step time per
budget and configuration.

With ``--lengths --budget F ...`` (``--model encoder`` or ``llama``) the
micro-batches vary in length (``PipelineModule(dynamic_shape=True)``, lengths
drawn uniformly from a quarter of the context to the context): the planner
with a plan per length bucket (``adaptive``) against one plan made for the
longest micro-batch (``static``) and the best uniform interval that fits at
the longest, every measured step's peak against its budget, in one launch
per depth (:mod:`benchmarks.pipeline.lengths.runner`).

It decides no measurement itself: :mod:`.modes` and :mod:`.models` say what
runs, :mod:`.partition` and :mod:`.lengths` what their comparisons run, the
rank modules measure.
"""

from __future__ import annotations

import os

# Keep the profiler's (kineto's) log lines, levels 0-5, out of the report; read
# when the profiler first starts.
os.environ.setdefault("KINETO_LOG_LEVEL", "6")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Sequence  # noqa: E402

import torch  # noqa: E402

from ds_pipe_ckpt.testing import RankFailure, run_ranks  # noqa: E402
from examples.gpt.data import load_corpus  # noqa: E402

from ..common import machine_info  # noqa: E402
from .budget import (PLANNED, BudgetOutcome, budget_records, infeasible_minimum,  # noqa: E402
                     planned_mode, stage_budgets, uniform_best, uniform_modes)
from .lengths.runner import MEASURED_STEPS, LengthSchedule, length_records, length_schedule  # noqa: E402
from .lengths.rank import measure_lengths  # noqa: E402
from .lengths.report import lengths_document, lengths_markdown  # noqa: E402
from .models import MODEL_NAMES, EncoderConfig, LlamaSizes, model_description  # noqa: E402
from .partition.runner import partition_rows  # noqa: E402
from .partition.report import partition_document, partition_markdown, write_partition_png  # noqa: E402
from .modes import PRESETS, Layout, PipelineMode, Preset, layouts, modes  # noqa: E402
from .rank import measure_layouts  # noqa: E402
from .report import markdown, summarize, write_budget_png, write_json, write_png  # noqa: E402

__all__ = ["main"]

REPO_ROOT = Path(__file__).resolve().parents[2]  # benchmarks/pipeline/runner.py
# Seconds per launch before its ranks are killed (the full run's 8-rank launch
# takes a few minutes on 2 busy cores).
LAUNCH_TIMEOUT = 1200


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.pipeline", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_const", dest="preset", const="quick", default="full",
                        help="pp=2 only, fewer timed steps (about a minute on 2 CPU cores)")
    parser.add_argument("--json", metavar="PATH", help="write every per-rank record to PATH")
    parser.add_argument("--png", metavar="PATH", help="plot peak memory per stage and mode to PATH")
    parser.add_argument("--cache-dir", default=str(REPO_ROOT / ".cache" / "gpt"),
                        help="where the GPT example's corpus is cached")
    parser.add_argument("--model", choices=MODEL_NAMES, default="gpt",
                        help="gpt: the GPT example (default); llama: transformers' Llama layers (examples/llama); "
                             "encoder: a Linear, nn.TransformerEncoderLayer blocks, a mean-pool and a Linear head, "
                             "on random features")
    parser.add_argument("--pp", type=int, nargs="+", metavar="PP",
                        help="pipeline depths (default: the preset's, 2 and 4; --quick: 2)")
    parser.add_argument("--timed-steps", type=int, metavar="N", help="timed steps per mode (default: the preset's)")
    for name in ("dim", "context", "blocks", "heads"):
        parser.add_argument(f"--{name}", type=int, help=f"model {name} (default: the benchmark preset's)")
    parser.add_argument("--vocab", type=int, dest="vocab_size",
                        help="vocabulary of the gpt and llama models (default 256, byte-level); a larger one costs "
                             "what a real vocabulary's head and loss do")
    parser.add_argument("--modes", nargs="+", metavar="MODE", choices=[mode.name for mode in modes()],
                        help="measure only these modes (default: all of "
                             f"{', '.join(mode.name for mode in modes())}); --budget needs none")
    parser.add_argument("--budget", type=float, nargs="+", metavar="F",
                        help="also run the planner with each stage's budget F x its peak without checkpointing, "
                             "against the best uniform interval that fits (e.g. --budget 0.3 0.5 0.75)")
    parser.add_argument("--partition", choices=("planned", ), default=None,
                        help="planned: compare the planned partition with DeepSpeed's \"parameters\" and \"uniform\" "
                             "ones under --budget F x the highest stage peak without checkpointing, on every stage")
    parser.add_argument("--lengths", action="store_true",
                        help="variable-length micro-batches (dynamic_shape=True, the encoder or llama model): the "
                             "planner's plan per length against one plan for the longest and the best uniform "
                             "interval that fits, under --budget F x each stage's peak at the longest")
    parser.add_argument("--measured-steps", type=int, default=MEASURED_STEPS, metavar="N",
                        help=f"with --lengths: variable-length steps whose peak is measured, per configuration "
                             f"(default {MEASURED_STEPS})")
    return parser


def _preset(args: argparse.Namespace) -> Preset:
    """The named preset, with the model, its sizes, the depths and the timed
    steps given on the command line.

    Raises:
        ValueError: a size, depth or step count the model or preset refuses (named).
    """
    preset = PRESETS[args.preset]
    model = {"encoder": EncoderConfig, "llama": LlamaSizes}.get(args.model)
    model = preset.model if model is None else model(dim=preset.model.dim, context=preset.model.context)
    sizes = {name: getattr(args, name) for name in ("dim", "context", "blocks", "heads", "vocab_size")
             if getattr(args, name) is not None}
    if "vocab_size" in sizes and isinstance(model, EncoderConfig):
        raise ValueError(f"--vocab {sizes['vocab_size']}: the encoder model classifies features; it has no vocabulary")
    changes: dict = {"model": dataclasses.replace(model, **sizes)}
    if args.pp is not None:
        if any(pp < 1 for pp in args.pp):
            raise ValueError(f"--pp {' '.join(map(str, args.pp))}: every pipeline depth must be >= 1")
        changes["pipeline_depths"] = tuple(dict.fromkeys(args.pp))
    if args.timed_steps is not None:
        if args.timed_steps < 1:
            raise ValueError(f"--timed-steps {args.timed_steps}: at least one step must be timed")
        changes["timed_steps"] = args.timed_steps
    return dataclasses.replace(preset, **changes)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        preset = _preset(args)
    except ValueError as error:  # GPTConfig / EncoderConfig names the bad size
        parser.error(str(error))
    mode_list = tuple(mode for mode in modes() if args.modes is None or mode.name in args.modes)
    if args.partition and not args.budget:
        parser.error("--partition planned needs --budget F [F ...]: the comparison is under budgets")
    if args.lengths and (not args.budget or args.partition or args.modes or args.png or args.model == "gpt"):
        parser.error("--lengths needs --budget F [F ...] and --model encoder or llama, without --partition, "
                     "--modes or --png: it runs its own configurations")
    if args.lengths and args.measured_steps < 1:
        parser.error(f"--measured-steps {args.measured_steps}: at least one step must be measured")
    if args.budget and all(mode.name != "none" for mode in mode_list):
        parser.error("--budget needs the none mode: its peaks set the budgets")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cores = os.cpu_count() or 1
    machine = machine_info(device, torch.get_num_threads())
    machine.update(command=" ".join(["python -m benchmarks.pipeline", *argv]), preset=args.preset,
                   model=model_description(preset.model), micro_batch=preset.micro_batch,
                   warmup_steps=preset.warmup_steps, timed_steps=preset.timed_steps,
                   cpu_allocation_tracking=device.type == "cpu")
    cache_dir = None if args.model == "encoder" else args.cache_dir  # gpt and llama train on the corpus
    if cache_dir is not None:
        load_corpus(cache_dir)  # written once here, read by every rank

    start = time.perf_counter()
    if args.lengths:
        return _lengths_main(args, preset, device, cores, machine, start)
    if args.partition:
        return _partition_main(args, preset, cache_dir, device, cores, machine, start)
    records = _launch(layouts(preset, mode_list), preset, cache_dir, device, cores, mode_list)
    if args.budget:
        records += _budget_rows(args.budget, preset, records, cache_dir, device, cores)
    machine["load_average_at_end"] = os.getloadavg()
    machine["wall_s"] = round(time.perf_counter() - start, 1)

    print(markdown(records, machine, {m.name: m.description + (f" (mp={m.mp})" if m.mp > 1 else "")
                                      for m in mode_list}), end="")
    print(f"Load average (1, 5, 15 min): {machine['load_average_at_start']} at start, "
          f"{machine['load_average_at_end']} at end; {machine['wall_s']} s.")
    if args.json:
        write_json(args.json, records, machine)
    if args.png:
        write_png(args.png, records, machine, [m.name for m in mode_list])
        if args.budget:
            png = Path(args.png)
            write_budget_png(str(png.with_name(f"{png.stem}-budget{png.suffix}")), records, machine)
    return 0


def _partition_main(args: argparse.Namespace, preset: Preset, cache_dir: str | None, device: torch.device,
                    cores: int, machine: dict, start: float) -> int:
    """``--partition planned``: the comparison of :mod:`benchmarks.pipeline.partition.runner`."""
    records: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="ds_pipe_ckpt-partition-") as directory:
        for pp in preset.pipeline_depths:
            def launch(layout: Layout, mode_list: Sequence[PipelineMode]) -> list[dict]:
                return _launch([layout], preset, cache_dir, device, cores, mode_list)
            records += partition_rows(pp, args.budget, preset.model.blocks, launch,
                                      str(Path(directory) / f"profile-pp{pp}.json"), _root_error)
    machine["load_average_at_end"] = os.getloadavg()
    machine["wall_s"] = round(time.perf_counter() - start, 1)
    machine["torch_threads"] = ", ".join(f"pp={pp}: {max(1, cores // pp)}" for pp in preset.pipeline_depths)
    print(partition_markdown(records, machine), end="")
    print(f"Load average (1, 5, 15 min): {machine['load_average_at_start']} at start, "
          f"{machine['load_average_at_end']} at end; {machine['wall_s']} s.")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(partition_document(records, machine), handle, indent=2)
            handle.write("\n")
    if args.png:
        write_partition_png(args.png, records, machine)
    return 0


def _lengths_main(args: argparse.Namespace, preset: Preset, device: torch.device, cores: int, machine: dict,
                  start: float) -> int:
    """``--lengths``: the comparison of :mod:`benchmarks.pipeline.lengths.runner`, one launch per depth."""
    schedules = {pp: length_schedule(preset.model.context, preset.accumulation_per_stage * pp, preset.timed_steps,
                                     measured=args.measured_steps) for pp in preset.pipeline_depths}

    def launch(pp: int, schedule: LengthSchedule) -> list[dict]:
        threads = max(1, cores // pp)
        print(f"benchmarks.pipeline --lengths: pp={pp}, {threads} thread(s) per rank", file=sys.stderr, flush=True)
        per_rank = run_ranks(measure_lengths, pp, pp, tuple(args.budget), preset, schedule, threads,
                             timeout=LAUNCH_TIMEOUT, backend="nccl" if device.type == "cuda" else "gloo",
                             threads=threads)
        return [record for rank in per_rank for record in rank]

    records = length_records(schedules, launch, _root_error)
    machine["load_average_at_end"] = os.getloadavg()
    machine["wall_s"] = round(time.perf_counter() - start, 1)
    machine["torch_threads"] = ", ".join(f"pp={pp}: {max(1, cores // pp)}" for pp in preset.pipeline_depths)
    print(lengths_markdown(records, machine, schedules), end="")
    print(f"Load average (1, 5, 15 min): {machine['load_average_at_start']} at start, "
          f"{machine['load_average_at_end']} at end; {machine['wall_s']} s.")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(lengths_document(records, machine, schedules), handle, indent=2)
            handle.write("\n")
    return 0


def _launch(plan: list[Layout], preset: Preset, cache_dir: str | None, device: torch.device, cores: int,
            mode_list: Sequence[PipelineMode]) -> list[dict]:
    """Measure every layout of ``plan``, one launch of rank processes per world size."""
    records: list[dict] = []
    for world_size, group in itertools.groupby(sorted(plan, key=lambda l: l.world_size), key=lambda l: l.world_size):
        group = list(group)
        if device.type == "cuda" and world_size > torch.cuda.device_count():
            records += [{"pp": l.pp, "mp": l.mp, "mode": name, "rank": None,
                         "unavailable": f"needs {world_size} GPUs, {torch.cuda.device_count()} visible"}
                        for l in group for name in l.modes]
            continue
        threads = max(1, cores // world_size)
        print(f"benchmarks.pipeline: {world_size} ranks, {threads} thread(s) each: "
              + "; ".join(f"pp={l.pp} x mp={l.mp}: {', '.join(l.modes)}" for l in group), file=sys.stderr, flush=True)
        per_rank = run_ranks(measure_layouts, world_size, group, preset, cache_dir, threads, tuple(mode_list),
                             timeout=LAUNCH_TIMEOUT, backend="nccl" if device.type == "cuda" else "gloo",
                             threads=threads)
        rank_records = [r for rank in per_rank for r in rank]
        # One "unavailable" entry per mode, not per rank.
        records += [r for r in rank_records if "unavailable" not in r or r["rank"] == 0]
    return records


def _budget_rows(fractions: Sequence[float], preset: Preset, records: list[dict], cache_dir: str | None,
                 device: torch.device, cores: int) -> list[dict]:
    """``planned`` and ``uniform_best`` rows for every depth and budget fraction."""
    rows: list[dict] = []
    for pp in preset.pipeline_depths:
        none = next((s for s in summarize(records) if (s.pp, s.mp, s.mode, s.budget_fraction) == (pp, 1, "none", None)),
                    None)
        if none is None:
            continue
        # Uniform intervals over the blocks of the most loaded stage, plus the two
        # layers before (embeddings, input projection) or after (final norm and
        # head, mean-pool and head) the blocks that a stage at either end holds.
        candidates = uniform_modes(-(-preset.model.blocks // pp) + 2)
        uniform_records = _launch([Layout(pp, 1, tuple(m.name for m in candidates))], preset, cache_dir, device,
                                  cores, candidates)
        measured = [s for s in summarize(uniform_records)] + [none]
        for fraction in fractions:
            outcome = BudgetOutcome(pp, fraction, stage_budgets(none, fraction))
            mode = planned_mode(outcome.budgets, fraction)
            try:
                outcome.planned = _launch([Layout(pp, 1, (PLANNED,))], preset, cache_dir, device, cores, (mode,))
            except RankFailure as failure:  # no plan fits: the planner named the least budget
                outcome.infeasible = _root_error(str(failure))
            outcome.uniform = uniform_best(measured, outcome.budgets)
            if outcome.uniform is not None:
                source = records if outcome.uniform.mode == "none" else uniform_records
                outcome.uniform_records = [r for r in source if r["pp"] == pp and r["mode"] == outcome.uniform.mode
                                           and "unavailable" not in r]
            rows += budget_records(outcome)
    return rows


def _root_error(report: str) -> str:
    """The planner's error naming the least feasible budget when a rank raised
    it, else the first error line of the ranks' tracebacks (the first rank to
    fail reports first; its peers then fail with lost connections)."""
    lines = [line.strip() for line in report.splitlines() if "Error: " in line and not line.startswith(" ")]
    planner = [line for line in lines if infeasible_minimum(line) is not None]
    return (planner or lines or report.strip().splitlines()[-1:])[0]


if __name__ == "__main__":
    sys.exit(main())
