"""DeepSpeed's pipeline engine at pp=1 with ds_pipe_ckpt's checkpointing, on one GPU.

A single process (``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``/``LOCAL_RANK``
as ``tests/gpu/run.sh`` sets them; defaults for one rank otherwise) trains a
``ds_pipe_ckpt.PipelineModule`` (a ``Linear`` in, torch's ``nn.TransformerEncoderLayer``
blocks with dropout, a mean-pool and a head) under ``ds_pipe_ckpt.initialize``,
nccl backend, and checks:

* ``max_memory_mb "auto"``: the planner plans under the device's capacity less
  10%, and every planned step's total (what the step began with plus its peak)
  stays under it;
* ``memory_budget_mb`` tight: a budget of :data:`BUDGET_FRACTION` of the
  largest step peak without checkpointing; every planned step's peak above its
  start, ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``
  at the step's start, stays within it;
* the same in bf16 (``"bf16": {"enabled": true}``);
* selective checkpointing of every layer (``activation_checkpoint_interval`` 1,
  ``"policy": "selective"``).

Each run's losses are compared with the same run without checkpointing
(:data:`LOSS_RTOL`): on CUDA within a relative tolerance, since a reduction
whose order is not fixed (atomics in attention's backward) may round a gradient
differently in two runs of the same program, checkpointed or not; on CPU bit
for bit, as ``tests/unit`` checks. Peaks are printed per step; a table of every
check, passed or failed and why, comes last; ``--json PATH`` writes it all.
Exit status 0 when every check passed.

``DS_PIPE_CKPT_GPU_TESTS_ON_CPU=1`` runs the same program on CPU (gloo, a tiny
model, ``DS_ACCELERATOR=cpu``): a dry run on a machine without a GPU. There the
peaks are measured with ``ds_pipe_ckpt.memory`` (the torch profiler), except in
the steps the planner profiles itself (the first three of a planned run: one
profiler at a time), where the planner's own measurement of its checked step
stands in; and ``"auto"``, which needs a CUDA device, is replaced by a number.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import platform
import socket
import sys
import time
import traceback
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

ON_CPU = os.environ.get("DS_PIPE_CKPT_GPU_TESTS_ON_CPU") == "1"
if ON_CPU:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # read when DeepSpeed is first imported

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import ds_pipe_ckpt  # noqa: E402
from ds_pipe_ckpt.memory import track_cpu_allocations, track_memory  # noqa: E402
from ds_pipe_ckpt.planning.stage import PlanPredictionWarning  # noqa: E402

MIB = 2**20
DEVICE = torch.device("cpu" if ON_CPU else "cuda")
BACKEND = "gloo" if ON_CPU else "nccl"
# The tight budget, as a fraction of the largest step peak without checkpointing:
# low enough that the plan must recompute, above the floor of one layer's rebuild.
BUDGET_FRACTION = 0.6
# Relative tolerance on every step's loss against the run without checkpointing.
# CPU: bit for bit. CUDA, fp32: 1e-4, three orders of magnitude above the drift
# that differently rounded gradients add over these few steps, below the change
# one optimizer step makes (a wrong gradient or dropout mask shows). CUDA, bf16:
# 2**-6, two units in the last place of bf16's 8 significant bits (a loss of
# slightly different weights may round to the next bf16 value).
LOSS_RTOL = {"fp32": 0.0, "bf16": 0.0} if ON_CPU else {"fp32": 1e-4, "bf16": 2.0**-6}
FEATURES, CLASSES = 16, 8
# Dropout in attention and the MLP: the recomputation must replay torch's RNG.
DROPOUT = 0.1


@dataclass(frozen=True)
class Sizes:
    width: int
    heads: int
    blocks: int
    sequence: int
    micro_batch: int
    micro_batches: int  # per step (gradient accumulation)
    steps: int  # 0: warm-up, 1: the planner measures, 2: first planned (checked), then planned


# GPU: about 5 GiB of activations per micro-batch in fp32, each step well under a second on an H200.
SIZES = Sizes(32, 2, 3, 64, 8, 2, 4) if ON_CPU else Sizes(1024, 16, 8, 1024, 8, 2, 6)


class MeanPool(nn.Module):
    """Mean over the sequence (saves nothing for its backward: the planner stores it)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=1)


def layers(sizes: Sizes) -> list[nn.Module]:
    torch.manual_seed(0)
    return ([nn.Linear(FEATURES, sizes.width)]
            + [nn.TransformerEncoderLayer(sizes.width, sizes.heads, dim_feedforward=4 * sizes.width, dropout=DROPOUT,
                                          activation="gelu", batch_first=True, norm_first=True)
               for _ in range(sizes.blocks)]
            + [MeanPool(), nn.Linear(sizes.width, CLASSES)])


def batches(sizes: Sizes, precision: str) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(7)
    for _ in range(sizes.steps * sizes.micro_batches):
        x = torch.randn(sizes.micro_batch, sizes.sequence, FEATURES, generator=generator)
        label = x[:, :, :CLASSES].sum(dim=1).argmax(dim=-1)
        yield (x.bfloat16() if precision == "bf16" else x), label


def ds_config(sizes: Sizes, precision: str, section: dict | None, interval: int = 0) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": sizes.micro_batch,
        "gradient_accumulation_steps": sizes.micro_batches,
        "train_batch_size": sizes.micro_batch * sizes.micro_batches,
        "steps_per_print": 10**9,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},  # no fused op to build
        "pipeline": {"use_reentrant": False, "activation_checkpoint_interval": interval},
    }
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    if section is not None:
        config["activation_checkpointing"] = section
    return config


@dataclass
class Step:
    loss: float
    seconds: float
    planned: bool  # a plan chose this step's checkpointing (it was made at the step's start)
    start_bytes: int | None  # allocated when the step began (CUDA)
    peak_bytes: int | None  # above the step's start; None where not measured
    measured_by: str  # how peak_bytes was measured


@dataclass
class Run:
    steps: list[Step]
    plan: dict | None
    warnings: list[str]

    @property
    def losses(self) -> list[float]:
        return [s.loss for s in self.steps]

    def peak(self, steps: list[Step] | None = None) -> int | None:
        peaks = [s.peak_bytes for s in (self.steps[1:] if steps is None else steps) if s.peak_bytes is not None]
        return max(peaks) if peaks else None


def _train_step(engine: Any, data: Iterator, profile: bool) -> tuple[float, float, int | None, int | None, str]:
    """One ``train_batch``: loss, seconds, allocated at its start, peak above it, and how."""
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        started = time.perf_counter()
        loss = engine.train_batch(data_iter=data)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        return float(loss), seconds, start, torch.cuda.max_memory_allocated() - start, "torch.cuda.max_memory_allocated"
    if not profile:
        started = time.perf_counter()
        loss = engine.train_batch(data_iter=data)
        return float(loss), time.perf_counter() - started, None, None, "not measured"
    started = time.perf_counter()
    with track_memory(DEVICE) as tracker:
        loss = engine.train_batch(data_iter=data)
    return (float(loss), time.perf_counter() - started, tracker.report.start_bytes, tracker.report.peak_bytes,
            "ds_pipe_ckpt.memory (CPU)")


def train(sizes: Sizes, precision: str, section: dict | None, interval: int = 0) -> Run:
    """Train ``sizes.steps`` steps under a fresh engine; every step measured."""
    module = ds_pipe_ckpt.PipelineModule(layers=layers(sizes), num_stages=1, loss_fn=nn.CrossEntropyLoss(),
                                         partition_method="uniform")
    engine, _, _, _ = ds_pipe_ckpt.initialize(model=module, config=ds_config(sizes, precision, section, interval),
                                              model_parameters=[p for p in module.parameters() if p.requires_grad])
    torch.manual_seed(1)  # the dropout masks: the same in every run
    planner = module.planning_enabled
    data = batches(sizes, precision)
    steps = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", PlanPredictionWarning)
        for index in range(sizes.steps):
            # On CPU the planner profiles its first steps and its checked step itself.
            profile = not planner or (module.checkpoint_plan is not None and index >= 3)
            loss, seconds, start, peak, how = _train_step(engine, data, profile)
            plan = module.checkpoint_plan
            if peak is None and plan is not None and len(steps) and not steps[-1].planned:
                peak, how = plan.measured_peak_bytes, "the planner's check (CPU)"  # the first planned step
            steps.append(Step(loss, seconds, plan is not None, start, peak, how))
    plan = module.checkpoint_plan
    summary = None
    if plan is not None:
        decisions = [d.value for d in plan.decisions()]
        summary = {"budget_bytes": plan.budget_bytes, "step_start_bytes": plan.step_start_bytes,
                   "predicted_peak_bytes": plan.predicted_peak_bytes, "measured_peak_bytes": plan.measured_peak_bytes,
                   "earlier_checks": list(plan.earlier_checks), "decisions": decisions,
                   "counts": {d: decisions.count(d) for d in sorted(set(decisions))}, "table": plan.table()}
    run = Run(steps, summary, [str(w.message) for w in caught if issubclass(w.category, PlanPredictionWarning)])
    del engine, module
    gc.collect()
    if DEVICE.type == "cuda":
        torch.cuda.empty_cache()
    return run


@dataclass
class Check:
    name: str
    precision: str
    passed: bool = False
    reasons: list[str] = field(default_factory=list)  # why it failed
    notes: list[str] = field(default_factory=list)
    budget_bytes: int | None = None
    reference_peak_bytes: int | None = None
    planned_peak_bytes: int | None = None
    max_relative_loss_difference: float | None = None
    bitwise_equal_losses: bool | None = None
    run: dict | None = None


def compare_losses(check: Check, losses: list[float], reference: list[float]) -> None:
    rtol = LOSS_RTOL[check.precision]
    differences = [abs(a - b) / max(abs(b), 1e-30) for a, b in zip(losses, reference)]
    check.max_relative_loss_difference = max(differences)
    check.bitwise_equal_losses = losses == reference
    if any(not math.isfinite(loss) for loss in losses):
        check.reasons.append(f"non-finite loss: {losses}")
    if check.max_relative_loss_difference > rtol:
        step = differences.index(check.max_relative_loss_difference)
        check.reasons.append(f"step {step}'s loss {losses[step]!r} differs from {reference[step]!r} without "
                             f"checkpointing by {check.max_relative_loss_difference:.3g} relative (tolerance {rtol:g})")


def check_budget(check: Check, run: Run, total: bool) -> None:
    """Every planned step within the plan's budget (``total``: what the step
    began with counted too, as ``max_memory_mb`` counts it)."""
    if run.plan is None:
        check.reasons.append("no plan was made")
        return
    planned = [s for s in run.steps if s.planned]
    if not planned:
        check.reasons.append("no planned step ran")
    limit = run.plan["budget_bytes"] + ((run.plan["step_start_bytes"] or 0) if total else 0)
    check.budget_bytes = limit
    check.planned_peak_bytes = run.peak(planned)
    for index, step in enumerate(run.steps):
        if not step.planned:
            continue
        if step.peak_bytes is None:
            check.notes.append(f"step {index}: peak not measured ({step.measured_by})")
            continue
        used = step.peak_bytes + ((step.start_bytes or 0) if total else 0)
        if used > limit:
            check.reasons.append(f"step {index} peaked at {used / MIB:.2f} MiB, over the budget of "
                                 f"{limit / MIB:.2f} MiB ({step.measured_by})")
    if run.warnings:
        check.notes.append(f"{len(run.warnings)} PlanPredictionWarning(s): {run.warnings[0][:300]}")


def run_check(check: Check, work) -> Check:
    try:
        work(check)
    except Exception:  # one failing check does not stop the others
        check.reasons.append("raised:\n" + traceback.format_exc())
    check.passed = not check.reasons
    return check


def _print_run(title: str, run: Run) -> None:
    print(f"-- {title}")
    for index, step in enumerate(run.steps):
        peak = "-" if step.peak_bytes is None else f"{step.peak_bytes / MIB:10.2f} MiB"
        print(f"   step {index}: loss {step.loss:.8f}  {step.seconds * 1e3:8.1f} ms  peak {peak}"
              f"{'  planned' if step.planned else ''}  [{step.measured_by}]")
    if run.plan is not None:
        print("   " + run.plan["table"].replace("\n", "\n   "))
    for message in run.warnings:
        print(f"   PlanPredictionWarning: {message}")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python tests/gpu/engine_checks.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="PATH", help="write every check, step and plan to PATH")
    args = parser.parse_args(argv)
    if DEVICE.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device is visible (DS_PIPE_CKPT_GPU_TESTS_ON_CPU=1 runs the CPU dry run)")
        return 2
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(sock.getsockname()[1])
    if DEVICE.type == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    else:
        track_cpu_allocations()  # before any model: CPU peaks count every free exactly
    with contextlib.redirect_stdout(sys.stderr):
        deepspeed.init_distributed(dist_backend=BACKEND, verbose=False)
    started = time.perf_counter()
    device_name = torch.cuda.get_device_name() if DEVICE.type == "cuda" else f"CPU ({platform.processor() or '?'})"
    print(f"engine checks on {device_name}: torch {torch.__version__}, deepspeed {deepspeed.__version__}, "
          f"backend {BACKEND}, {SIZES}")

    references: dict[str, Run] = {}

    def reference(precision: str) -> Run:
        if precision not in references:
            references[precision] = train(SIZES, precision, None)
            _print_run(f"no checkpointing, {precision}", references[precision])
        return references[precision]

    def planned(section_of_budget, total: bool):
        def work(check: Check) -> None:
            base = reference(check.precision)
            check.reference_peak_bytes = base.peak()
            section = section_of_budget(base)
            check.notes.append(f"activation_checkpointing: {json.dumps(section)}")
            run = train(SIZES, check.precision, section)
            _print_run(check.name, run)
            check.run = asdict(run)
            check_budget(check, run, total)
            compare_losses(check, run.losses, base.losses)
        return work

    def selective(check: Check) -> None:
        base = reference(check.precision)
        check.reference_peak_bytes = base.peak()
        run = train(SIZES, check.precision, {"policy": "selective"}, interval=1)
        _print_run(check.name, run)
        check.run = asdict(run)
        check.planned_peak_bytes = run.peak()
        compare_losses(check, run.losses, base.losses)

    def tight(run: Run) -> dict:
        return {"memory_budget_mb": round(BUDGET_FRACTION * run.peak() / MIB, 3)}

    auto = "auto" if DEVICE.type == "cuda" else 10**6  # "auto" is a ConfigError off CUDA
    checks = [
        run_check(Check(f"max_memory_mb {auto!r}", "fp32"), planned(lambda run: {"max_memory_mb": auto}, total=True)),
        run_check(Check(f"memory_budget_mb {BUDGET_FRACTION} x peak", "fp32"), planned(tight, total=False)),
        run_check(Check(f"bf16, memory_budget_mb {BUDGET_FRACTION} x peak", "bf16"), planned(tight, total=False)),
        run_check(Check("selective, every layer", "fp32"), selective),
    ]
    print(table(checks))
    print(f"engine checks: {sum(c.passed for c in checks)} passed, {sum(not c.passed for c in checks)} failed "
          f"in {time.perf_counter() - started:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "device": device_name, "torch": torch.__version__, "deepspeed": deepspeed.__version__,
            "sizes": asdict(SIZES), "loss_rtol": LOSS_RTOL, "budget_fraction": BUDGET_FRACTION,
            "references": {k: asdict(v) for k, v in references.items()},
            "checks": [asdict(c) for c in checks]}, indent=1, default=str))
    return 0 if all(c.passed for c in checks) else 1


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / MIB:.1f}"


def table(checks: list[Check]) -> str:
    lines = ["", "| check | result | budget MiB | peak MiB, planned steps | peak MiB, no ckpt | loss max rel diff "
             "(tol) | bitwise | plan |", "|---|---|---:|---:|---:|---:|---|---|"]
    for c in checks:
        plan = (c.run or {}).get("plan") or {}
        counts = ", ".join(f"{n} {d}" for d, n in plan.get("counts", {}).items()) or "-"
        difference = "-" if c.max_relative_loss_difference is None else f"{c.max_relative_loss_difference:.2g}"
        lines.append(f"| {c.name} | {'PASS' if c.passed else 'FAIL'} | {_mib(c.budget_bytes)} | "
                     f"{_mib(c.planned_peak_bytes)} | {_mib(c.reference_peak_bytes)} | {difference} "
                     f"({LOSS_RTOL[c.precision]:g}) | {c.bitwise_equal_losses} | {counts} |")
    for c in checks:
        for reason in c.reasons:
            lines.append(f"FAIL {c.name}: {reason}")
        for note in c.notes:
            lines.append(f"note {c.name}: {note}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
