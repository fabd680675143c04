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
    steps = [_step(engine, batches, measured=step == measure_step) for step in range(1, steps + 1)]
    return [loss for loss, _ in steps], max(peak or 0 for _, peak in steps)


def _step(engine, batches, measured: bool) -> tuple[float, int | None]:
    """One ``train_batch``: its loss, and its peak bytes when ``measured``."""
    if not measured:
        return float(engine.train_batch(data_iter=batches)), None
    gc.collect()
    with track_memory("cpu") as tracker:
        loss = float(engine.train_batch(data_iter=batches))
    return loss, tracker.report.peak_bytes


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


def lora_engine(section: dict | None):
    """pp=2: the example's Llama layers with peft's LoRA (r=4 on q_proj and
    v_proj, as ``inject_adapter_in_model`` adds it), the base frozen."""
    import ds_pipe_ckpt
    from peft import LoraConfig, inject_adapter_in_model

    from examples.llama.model import CHECKPOINTABLE_LAYERS, causal_lm_loss, llama_layer_specs, small_config

    module = ds_pipe_ckpt.PipelineModule(layers=llama_layer_specs(small_config(), seed=0), num_stages=2,
                                         loss_fn=causal_lm_loss, partition_method="type:DecoderLayer",
                                         checkpointable_layers=list(CHECKPOINTABLE_LAYERS))
    torch.manual_seed(0)  # LoRA's A matrices are drawn from the default generator
    inject_adapter_in_model(LoraConfig(r=4, target_modules=["q_proj", "v_proj"]), module)
    for name, parameter in module.named_parameters():
        parameter.requires_grad_("lora_" in name)
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4, "train_batch_size": 16,
              "steps_per_print": 10**9, "pipeline": {"use_reentrant": False},
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}}
    if section is not None:
        config["activation_checkpointing"] = section
    engine, _, _, _ = ds_pipe_ckpt.initialize(model=module, config=config,
                                              model_parameters=[p for p in module.parameters() if p.requires_grad])
    return engine


def _token_batches(steps: int):
    generator = torch.Generator().manual_seed(3)
    for _ in range(steps * 4):
        tokens = torch.randint(0, 256, (4, SEQUENCE_LORA + 1), generator=generator)
        yield tokens[:, :-1], tokens[:, 1:]


SEQUENCE_LORA = 64


def lora_steps(fraction: float, steps: int) -> dict:
    """Train LoRA without checkpointing (each stage's peak of its third step
    sets the budgets: ``fraction`` of it), then planned: every step's peak,
    the planner's own for step 0 (less what it allocates once), the
    measuring step and the first planned step, ours around ``train_batch``
    for the others."""
    track_cpu_allocations()
    engine = lora_engine(None)
    data = _token_batches(steps)
    none = [_step(engine, data, measured=step == 2) for step in range(steps)]
    losses, peak = [loss for loss, _ in none], none[2][1]
    stage = engine.stage_id
    budgets = [round(fraction * p / 2**20, 4) for p in _stage_peaks(peak, stage, 2)]
    del engine
    gc.collect()
    engine = lora_engine({"memory_budget_mb": budgets})
    data = _token_batches(steps)
    planned = [_step(engine, data, measured=step >= 3) for step in range(steps)]  # the planner measures 0-2
    planned_losses, peaks = [loss for loss, _ in planned], [peak for _, peak in planned]
    plan = engine.module.checkpoint_plan
    peaks[:3] = [plan.first_step_peak_bytes - plan.first_step_kept_bytes, plan.measuring_step_peak_bytes,
                 plan.measured_peak_bytes]
    return {"stage": stage, "none_losses": losses, "losses": planned_losses, "budget_bytes": int(budgets[stage] * 2**20),
            "step_peaks": peaks, "first_step": (plan.first_step_peak_bytes, plan.first_step_kept_bytes),
            "table": plan.table()}
