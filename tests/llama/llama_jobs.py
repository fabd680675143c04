"""Rank functions for the Llama pipeline tests that run in ``run_ranks``
processes (module level, so that ``spawn`` can import them)."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import torch
import torch.distributed as dist

from ds_pipe_ckpt.memory import track_cpu_allocations, track_memory
from examples.llama.engine import build_engine
from examples.llama.pretrained import load_config
from examples.sampling import GlobalBatchSampler
from examples.training import pipeline_topology

CONFIG_DIR = Path(__file__).resolve().parents[2] / "examples" / "llama" / "configs"
MICRO_BATCH = 2
GLOBAL_BATCH = 8


def _config(name: str, budget_mb: list[float] | None = None) -> dict:
    """The example's config ``name`` with the tests' batch sizes, and
    ``budget_mb`` in place of a planned config's budget."""
    config = json.loads((CONFIG_DIR / f"{name}.json").read_text())
    config.update(train_batch_size=GLOBAL_BATCH, train_micro_batch_size_per_gpu=MICRO_BATCH)
    section = config.get("activation_checkpointing", {})
    if "memory_budget_mb" in section:
        if budget_mb is None:
            raise ValueError(f"config {name!r} is planned: train 'none' first to measure the budget")
        section["memory_budget_mb"] = budget_mb
    return config


def _train(engine, topology, inputs: torch.Tensor, targets: torch.Tensor, steps: int, measure_step: int = 0):
    """``steps`` steps on consecutive global batches of (inputs, targets);
    returns the losses and the peak bytes of step ``measure_step`` (1-based; 0: none)."""
    dp = topology.get_dim("data")
    sampler = GlobalBatchSampler(len(inputs), MICRO_BATCH, engine.gradient_accumulation_steps(), dp,
                                 engine.grid.get_data_parallel_rank(), steps, seed=0)
    batches = ((inputs[indices], targets[indices]) for indices in sampler)
    losses, peak = [], 0
    for step in range(1, steps + 1):
        if step == measure_step:
            gc.collect()
            with track_memory("cpu") as tracker:
                losses.append(float(engine.train_batch(data_iter=batches)))
            peak = tracker.report.peak_bytes
        else:
            losses.append(float(engine.train_batch(data_iter=batches)))
    return losses, peak


def _stage_peaks(peak: int, stage: int, pp: int) -> list[int]:
    records = [None] * dist.get_world_size()
    dist.all_gather_object(records, (stage, peak))
    return [max(p for s, p in records if s == wanted) for wanted in range(pp)]


def pipeline_runs(checkpoints: dict[str, str], first_loss_layouts: list[tuple[str, int]], inputs: torch.Tensor,
                  targets: torch.Tensor, modes: list[str], mode_pp: int, mode_steps: int,
                  budget_fractions: list[float]) -> dict:
    """For each (checkpoint label, pp) of ``first_loss_layouts``: the first
    loss of the global batch ``inputs[:8]`` from that checkpoint directory at
    that pp. Then, from the
    first checkpoint at ``mode_pp``: ``mode_steps`` steps per config of
    ``modes`` ("none" first), the planned one under ``budget_fractions[s]`` of
    stage ``s``'s peak without checkpointing. Returns this rank's results."""
    track_cpu_allocations()
    world = dist.get_world_size()
    result = {"first_losses": {}, "modes": {}}
    for label, pp in first_loss_layouts:
        directory = checkpoints[label]
        topology = pipeline_topology(world, pp)
        engine, loaded = build_engine(_config("none"), load_config(directory), topology, pretrained=directory)
        losses, _ = _train(engine, topology, inputs[:GLOBAL_BATCH], targets[:GLOBAL_BATCH], 1)
        result["first_losses"][(label, pp)] = losses[0]
        result.setdefault("loaded", {})[(label, pp)] = loaded.names
        del engine
        gc.collect()

    directory = next(iter(checkpoints.values()))
    model = load_config(directory)
    topology = pipeline_topology(world, mode_pp)
    budget = None
    for name in modes:
        engine, _ = build_engine(_config(name, budget), model, topology, pretrained=directory)
        # Only "none" is measured here (for the budgets): the planner measures its own
        # steps, and leaves alone a step that someone else profiles.
        losses, peak = _train(engine, topology, inputs, targets, mode_steps, measure_step=2 if name == "none" else 0)
        plan = engine.module.checkpoint_plan
        result["modes"][name] = {
            "losses": losses,
            "stage": engine.stage_id,
            "params": {key: value.detach().clone() for key, value in engine.module.state_dict().items()},
            "decisions": None if plan is None else [d.value for d in plan.decisions()],
            "budget_mb": budget,
            "checked": None if plan is None else {
                "budget_bytes": plan.budget_bytes,
                "predicted_bytes": plan.plan.predicted_peak_bytes,
                "measured_bytes": plan.measured_peak_bytes,
                "keeps_graph": plan.problem.backward_keeps_graph,
            },
        }
        if name == "none":
            budget = [round(fraction * p / 2**20, 4)
                      for fraction, p in zip(budget_fractions, _stage_peaks(peak, engine.stage_id, mode_pp))]
        del engine
        gc.collect()
    return result
