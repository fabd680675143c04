"""Rank functions for the planner tests under DeepSpeed's pipeline engine
(module level, so that ``spawn`` can import them): a model people build from
torch's own layers, planned under per-stage budgets."""

from __future__ import annotations

import warnings

import deepspeed
import torch
import torch.distributed as dist
import torch.nn as nn

import ds_pipe_ckpt
from ds_pipe_ckpt.memory import track_cpu_allocations, track_memory
from ds_pipe_ckpt.planning.stage import PlanPredictionWarning

WIDTH, SEQUENCE, MICRO_BATCH, MICRO_BATCHES = 64, 64, 16, 4


class MeanPool(nn.Module):
    """Mean over the sequence: saves no tensor for its backward."""

    def forward(self, x):
        return x.mean(dim=1)


def encoder_layers(blocks: int = 6) -> list[nn.Module]:
    """A ``Linear`` in, torch's ``nn.TransformerEncoderLayer`` blocks, a mean-pool and a ``Linear`` head."""
    torch.manual_seed(0)
    return ([nn.Linear(16, WIDTH)]
            + [nn.TransformerEncoderLayer(WIDTH, 4, dim_feedforward=2 * WIDTH, dropout=0.0, batch_first=True)
               for _ in range(blocks)]
            + [MeanPool(), nn.Linear(WIDTH, 4)])


# DeepSpeed's usual pipeline configuration: ZeRO stage 1 and bf16 (a reduce bucket
# small enough that activations, not the bucket, decide what fits).
BF16_ZERO1 = {"zero_optimization": {"stage": 1, "reduce_bucket_size": 50_000}, "bf16": {"enabled": True}}


def _config(pp: int, section: dict | None, precision: str = "fp32") -> dict:
    config = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": MICRO_BATCHES,
              "train_batch_size": MICRO_BATCH * MICRO_BATCHES * (dist.get_world_size() // pp),
              "steps_per_print": 10**9, "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
              "pipeline": {"use_reentrant": False}}
    if section is not None:
        config["activation_checkpointing"] = section
    if precision == "bf16_zero1":
        config.update(BF16_ZERO1)
    elif precision != "fp32":
        raise ValueError(f"precision {precision!r}: expected 'fp32' or 'bf16_zero1'")
    return config


def _batches(steps: int, precision: str = "fp32"):
    generator = torch.Generator().manual_seed(7)
    for _ in range(steps * MICRO_BATCHES):
        x = torch.randn(MICRO_BATCH, SEQUENCE, 16, generator=generator)
        yield (x.bfloat16() if precision == "bf16_zero1" else x), x[:, 0, :4].argmax(dim=-1)


def _engine(pp: int, section: dict | None, precision: str = "fp32"):
    module = ds_pipe_ckpt.PipelineModule(layers=encoder_layers(), num_stages=pp, loss_fn=nn.CrossEntropyLoss(),
                                         partition_method="uniform")
    engine, _, _, _ = ds_pipe_ckpt.initialize(model=module, config=_config(pp, section, precision),
                                              model_parameters=list(module.parameters()))
    return engine, module


def plan_under_budgets(pp: int, fractions: list[float], steps: int = 4, precision: str = "fp32") -> dict:
    """Train without checkpointing, measuring each stage's step peak; then, for
    each fraction, train planned under budgets of that fraction of every
    stage's peak. Returns this rank's losses, peaks, plans and warnings.
    ``precision`` ``"bf16_zero1"`` trains in bf16 under ZeRO stage 1."""
    track_cpu_allocations()
    stage = dist.get_rank() // (dist.get_world_size() // pp)
    engine, module = _engine(pp, None, precision)
    data = _batches(steps, precision)
    losses = [float(engine.train_batch(data_iter=data))]  # warm-up
    with track_memory("cpu") as tracker:
        losses.append(float(engine.train_batch(data_iter=data)))
    losses += [float(engine.train_batch(data_iter=data)) for _ in range(steps - 2)]
    peaks = [torch.zeros(()) for _ in range(dist.get_world_size())]
    dist.all_gather(peaks, torch.tensor(float(tracker.report.peak_bytes)))
    stage_peaks = [peaks[s * (dist.get_world_size() // pp)].item() for s in range(pp)]
    del engine, module
    result = {"stage": stage, "none_losses": losses, "none_peak_bytes": stage_peaks[stage], "runs": {}}
    for fraction in fractions:
        budgets = [round(fraction * peak / 2**20, 4) for peak in stage_peaks]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", PlanPredictionWarning)
            engine, module = _engine(pp, {"memory_budget_mb": budgets}, precision)
            data = _batches(steps, precision)
            run_losses = [float(engine.train_batch(data_iter=data)) for _ in range(steps)]
        plan = module.checkpoint_plan
        result["runs"][fraction] = {
            "losses": run_losses,
            "budget_bytes": int(budgets[stage] * 2**20),
            "planned": plan is not None,
            "predicted_bytes": None if plan is None else plan.plan.predicted_peak_bytes,
            "measured_bytes": None if plan is None else plan.measured_peak_bytes,
            "earlier_checks": None if plan is None else plan.earlier_checks,
            "decisions": None if plan is None else [d.value for d in plan.decisions()],
            "warnings": [str(w.message) for w in caught if issubclass(w.category, PlanPredictionWarning)],
        }
        del engine, module
    # Through ds_pipe_ckpt.initialize with the total-memory key.
    engine, module = _engine(pp, {"max_memory_mb": 10**6}, precision)
    data = _batches(steps, precision)
    result["max_memory_losses"] = [float(engine.train_batch(data_iter=data)) for _ in range(steps)]
    plan = module.checkpoint_plan
    result["max_memory_plan"] = None if plan is None else (plan.budget_bytes, plan.step_start_bytes)
    return result


def zero_floor(budget_mb: float, bucket_elements: int) -> str:
    """Plan under ZeRO stage 1 and bf16 with a budget below the reduce bucket;
    returns the ConfigError the stage raises."""
    config = _config(2, {"memory_budget_mb": budget_mb})
    config.update({"zero_optimization": {"stage": 1, "reduce_bucket_size": bucket_elements}, "bf16": {"enabled": True}})
    module = ds_pipe_ckpt.PipelineModule(layers=encoder_layers(2), num_stages=2, loss_fn=nn.CrossEntropyLoss(),
                                         partition_method="uniform")
    engine, _, _, _ = ds_pipe_ckpt.initialize(model=module, config=config, model_parameters=list(module.parameters()))
    data = ((x.bfloat16(), y) for x, y in _batches(4))
    try:
        for _ in range(4):
            engine.train_batch(data_iter=data)
    except ds_pipe_ckpt.ConfigError as error:
        return str(error)
    return "no error"


def refused_budget(budget_mb) -> dict:
    """Train under ``memory_budget_mb = budget_mb``, which some stage cannot
    keep; returns the ConfigError this rank raised and at which step."""
    engine, _ = _engine(2, {"memory_budget_mb": budget_mb})
    data = _batches(4)
    for step in range(4):
        try:
            engine.train_batch(data_iter=data)
        except ds_pipe_ckpt.ConfigError as error:
            return {"stage": engine.stage_id, "step": step, "message": str(error)}
    return {"stage": engine.stage_id, "step": None, "message": "no error"}
