"""Rank functions for the variable-length planner tests under DeepSpeed's
pipeline engine (module level, for spawn): ``PipelineModule(dynamic_shape=True)``
fed micro-batches each padded to its own length, as fine-tuning does."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.nn as nn

import ds_pipe_ckpt
from ds_pipe_ckpt.memory import track_cpu_allocations, track_memory
from ds_pipe_ckpt.planning.stage import PlanPredictionWarning

from planner_jobs import MICRO_BATCH, MICRO_BATCHES, _config, encoder_layers

# The planner measures these steps itself: the first (what it keeps allocated), the
# measuring step and the first planned one (its check).
MEASURING_STEP, FIRST_PLANNED_STEP = 1, 2


LLAMA_MICRO_BATCH = 4


def _batches(model: str, lengths: list[list[int]], seed: int = 7):
    """One micro-batch per length, step by step: for ``"encoder"``, MICRO_BATCH
    sequences of that length (features of 16) labelled from their first
    token; for ``"llama"``, LLAMA_MICRO_BATCH sequences of byte tokens and
    their next tokens."""
    generator = torch.Generator().manual_seed(seed)
    for step in lengths:
        if len(step) != MICRO_BATCHES:
            raise ValueError(f"each step needs {MICRO_BATCHES} micro-batch lengths, got {step}")
        for length in step:
            if model == "llama":
                tokens = torch.randint(0, 256, (LLAMA_MICRO_BATCH, length + 1), generator=generator)
                yield tokens[:, :-1], tokens[:, 1:]
            else:
                x = torch.randn(MICRO_BATCH, length, 16, generator=generator)
                yield x, x[:, 0, :4].argmax(dim=-1)


def _engine(model: str, section: dict | None):
    """pp=2: torch's encoder layers (``"encoder"``), or transformers' Llama
    decoder layers with SDPA attention, as the Llama example builds them."""
    if model == "llama":
        from examples.llama.model import CHECKPOINTABLE_LAYERS, causal_lm_loss, llama_layer_specs, small_config

        module = ds_pipe_ckpt.PipelineModule(layers=llama_layer_specs(small_config(), seed=0), num_stages=2,
                                             loss_fn=causal_lm_loss, partition_method="type:DecoderLayer",
                                             checkpointable_layers=list(CHECKPOINTABLE_LAYERS), dynamic_shape=True)
        micro = LLAMA_MICRO_BATCH
    else:
        module = ds_pipe_ckpt.PipelineModule(layers=encoder_layers(), num_stages=2, loss_fn=nn.CrossEntropyLoss(),
                                             partition_method="uniform", dynamic_shape=True)
        micro = MICRO_BATCH
    config = _config(2, section) | {"train_micro_batch_size_per_gpu": micro,
                                    "train_batch_size": micro * MICRO_BATCHES}
    engine, _, _, _ = ds_pipe_ckpt.initialize(model=module, config=config,
                                              model_parameters=[p for p in module.parameters() if p.requires_grad])
    return engine, module


def _stage_peaks(peak_bytes: int) -> list[float]:
    peaks = [torch.zeros(()) for _ in range(dist.get_world_size())]
    dist.all_gather(peaks, torch.tensor(float(peak_bytes)))
    return [p.item() for p in peaks]


def train_variable_lengths(model: str, lengths: list[list[int]], fraction: float, max_length: int) -> dict:
    """Train without checkpointing on ``lengths`` (micro-batch lengths per
    step), then planned under budgets of ``fraction`` x each stage's peak
    without checkpointing on a step at ``max_length``. Returns this rank's
    losses of both, the budget, every planned step's peak (the planner's own
    for the steps it measures and checks, ours around ``train_batch`` for the
    others) and the plan; where the planner refused the budget (a ConfigError
    at a step's start), its message as ``refused`` and the steps before it."""
    track_cpu_allocations()
    engine, module = _engine(model, None)
    full = [[max_length] * MICRO_BATCHES] * 3
    data = _batches(model, full)
    engine.train_batch(data_iter=data)  # warm-up
    with track_memory("cpu") as tracker:
        engine.train_batch(data_iter=data)
    stage_peaks = _stage_peaks(tracker.report.peak_bytes)
    del engine, module
    engine, _ = _engine(model, None)
    data = _batches(model, lengths)
    none_losses = [float(engine.train_batch(data_iter=data)) for _ in lengths]
    del engine

    budgets = [round(fraction * peak / 2**20, 4) for peak in stage_peaks]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", PlanPredictionWarning)
        engine, module = _engine(model, {"memory_budget_mb": budgets, "max_sequence_length": max_length})
        data = _batches(model, lengths)
        losses, peaks, refused = [], [], None
        for step in range(len(lengths)):
            try:
                if step in (0, MEASURING_STEP, FIRST_PLANNED_STEP):
                    losses.append(float(engine.train_batch(data_iter=data)))
                    peaks.append(None)
                    continue
                with track_memory("cpu") as tracker:
                    losses.append(float(engine.train_batch(data_iter=data)))
                peaks.append(tracker.report.peak_bytes)
            except ds_pipe_ckpt.ConfigError as error:  # at a step's start, on every rank
                refused = str(error)
                break
    plan = module.checkpoint_plan
    if refused is not None and plan is None:
        return {"stage": engine.stage_id, "refused": refused, "losses": losses, "none_losses": none_losses,
                "budget_bytes": int(budgets[engine.stage_id] * 2**20), "step_peaks": peaks}
    # The first step allocates the optimizer's state once: counted apart (the plan table says so).
    planner_peaks = [plan.first_step_peak_bytes - plan.first_step_kept_bytes, plan.measuring_step_peak_bytes,
                     plan.earlier_checks[0][1] if plan.earlier_checks else plan.measured_peak_bytes]
    peaks[:len(planner_peaks)] = planner_peaks[:len(peaks)]
    return {"stage": engine.stage_id, "refused": refused, "none_losses": none_losses, "losses": losses,
            "budget_bytes": int(budgets[engine.stage_id] * 2**20), "step_peaks": peaks,
            "bound_bytes": plan.predicted_peak_bytes, "earlier_checks": plan.earlier_checks,
            "first_step": (plan.first_step_peak_bytes, plan.first_step_kept_bytes),
            "table": plan.table(),
            "plans": {p.length: [s.decision.value for s in p.plan.segments for _ in range(s.start, s.end)]
                      for p in plan.lengths.by_length},
            "warnings": [str(w.message) for w in caught if issubclass(w.category, PlanPredictionWarning)]}


def oversized_micro_batch(max_length: int, length: int) -> dict:
    """pp=1 (one rank): train planned under a generous budget for micro-batches
    up to ``max_length``, then feed a step whose last micro-batch is ``length``
    long. Returns the error and whether every parameter is as it was before
    that step."""
    engine, module = _engine_pp1({"memory_budget_mb": 10_000, "max_sequence_length": max_length})
    data = _batches("encoder", [[max_length] * MICRO_BATCHES] * 3)
    for _ in range(3):
        engine.train_batch(data_iter=data)
    before = [p.detach().clone() for p in module.parameters()]
    try:
        engine.train_batch(data_iter=_batches("encoder", [[max_length] * (MICRO_BATCHES - 1) + [length]]))
    except ds_pipe_ckpt.ConfigError as error:
        message = str(error)
    else:
        message = "no error"
    unchanged = all(torch.equal(a, b) for a, b in zip(before, module.parameters()))
    return {"message": message, "parameters_unchanged": unchanged}


def _engine_pp1(section: dict):
    module = ds_pipe_ckpt.PipelineModule(layers=encoder_layers(2), num_stages=1, loss_fn=nn.CrossEntropyLoss(),
                                         partition_method="uniform", dynamic_shape=True)
    engine, _, _, _ = ds_pipe_ckpt.initialize(model=module, config=_config(1, section),
                                              model_parameters=list(module.parameters()))
    return engine, module
