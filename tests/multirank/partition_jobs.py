"""Rank function for the planned-partition tests (module level, for spawn)."""

from __future__ import annotations

import torch
import torch.nn as nn

import ds_pipe_ckpt
from ds_pipe_ckpt import LayerSpec, PartitionPlanning, PipelineModule

WIDTH, MICRO_BATCH, GRAD_ACCUM = 32, 8, 4


def layer_specs():
    """An input projection, five MLP blocks of growing width (so that the
    layers differ in time and memory) and a head."""
    blocks = [LayerSpec(nn.Sequential, nn.Linear(WIDTH, WIDTH * w), nn.GELU(), nn.Linear(WIDTH * w, WIDTH))
              for w in (1, 2, 4, 8, 16)]
    return [LayerSpec(nn.Linear, 8, WIDTH), *blocks, LayerSpec(nn.Linear, WIDTH, 4)]


def train_with_partition(method, budget_mb, profile_path, steps=3, from_config=False):
    """Train ``steps`` steps with ``partition_method=method``; returns the
    losses, the cut and this rank's layers. ``from_config``: the planning read
    by ``partition_from_config`` from a DeepSpeed config that gives
    ``train_batch_size`` and ``train_micro_batch_size_per_gpu`` only (DeepSpeed
    derives the gradient accumulation steps)."""
    ds_pipe_ckpt.configure()
    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": GRAD_ACCUM,
              "train_batch_size": MICRO_BATCH * GRAD_ACCUM, "steps_per_print": 10**9}
    planning = None
    sample = torch.randn(MICRO_BATCH, 8, generator=torch.Generator().manual_seed(1))
    labels = sample[:, :4].argmax(dim=-1)
    if from_config:
        del config["gradient_accumulation_steps"]
        config |= {"pipeline": {"partition_method": method, "use_reentrant": False, "partition_profile": profile_path},
                   "activation_checkpointing": {"memory_budget_mb": budget_mb}}
        method, planning = ds_pipe_ckpt.partition_from_config(config, sample=sample, labels=labels)
    elif method == "planned":
        planning = PartitionPlanning(memory_budget_mb=budget_mb, micro_batches=GRAD_ACCUM, sample=sample,
                                     labels=labels, profile_path=profile_path)
    module = PipelineModule(layers=layer_specs(), num_stages=2, loss_fn=nn.CrossEntropyLoss(), seed_layers=True,
                            partition_method=method, partition_planning=planning)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.05)
    # One engine for every cut, so that losses compare bit for bit on every DeepSpeed
    # (upstream's own scales gradient accumulation differently before 0.19).
    engine, _, _, _ = ds_pipe_ckpt.initialize(model=module, optimizer=optimizer, config=config)
    generator = torch.Generator().manual_seed(5)
    xs = torch.randn(steps * GRAD_ACCUM, MICRO_BATCH, 8, generator=generator)
    data = iter([(x, x[:, :4].argmax(dim=-1)) for x in xs])
    losses = [float(engine.train_batch(data_iter=data)) for _ in range(steps)]
    plan = module.partition_plan
    return {"losses": losses, "parts": list(module.parts), "stage": engine.stage_id,
            "boundaries": None if plan is None else list(plan.boundaries),
            "local_layers": len(module.forward_funcs), "profile_source": module.partition_profile_source}
