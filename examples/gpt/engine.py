"""The GPT pipeline for one DeepSpeed config: topology, module and engine.

Shared by ``examples/gpt/train.py`` and ``benchmarks/pipeline/models.py`` so that
both run exactly the same model.
"""

from __future__ import annotations

from typing import Any

import torch
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

import ds_pipe_ckpt
from examples.training import checkpointing_mode, pipeline_topology

from .model import CHECKPOINTABLE_LAYERS, GPTConfig, gpt_layer_specs, language_model_loss

__all__ = ["pipeline_topology", "build_engine", "checkpointing_mode", "DEFAULT_PARTITION_METHOD"]

# Balance the transformer blocks across stages (DeepSpeed's "type:REGEX" method);
# the embedding goes with the first stage, the final norm and head with the last.
DEFAULT_PARTITION_METHOD = "type:Block"


def build_engine(config: dict, model: GPTConfig, topology: PipeModelDataParallelTopology, seed: int = 0,
                 dropout_seed: int | None = None, partition_method: str = DEFAULT_PARTITION_METHOD,
                 partition_planning: ds_pipe_ckpt.PartitionPlanning | None = None, dynamic_shape: bool = False) -> Any:
    """``ds_pipe_ckpt.initialize`` of the GPT pipeline under ``config`` (a DeepSpeed
    config dict with an ``optimizer`` section); returns DeepSpeed's ``PipelineEngine``.

    The weights depend only on ``seed``; the default generator (dropout masks) is
    seeded with ``dropout_seed`` (default ``seed``) last, so every config built
    with the same seeds starts from the same weights and draws the same masks.
    Only the transformer blocks are checkpointed (``checkpointable_layers``),
    every ``pipeline.activation_checkpoint_interval`` of them. ``partition_planning``
    goes with ``partition_method="planned"`` (``ds_pipe_ckpt.partition_from_config``).
    ``dynamic_shape``: micro-batches of variable length (DeepSpeed sends each
    one's shapes; a budget then needs ``activation_checkpointing.max_sequence_length``).
    """
    if "optimizer" not in config:
        raise ValueError("the DeepSpeed config has no \"optimizer\" section; the GPT example builds its optimizer "
                         "from it, e.g. {\"type\": \"Adam\", \"params\": {\"lr\": 0.001, \"torch_adam\": true}}")
    module = ds_pipe_ckpt.PipelineModule(layers=gpt_layer_specs(model, seed), topology=topology,
                                         loss_fn=language_model_loss, partition_method=partition_method,
                                         partition_planning=partition_planning,
                                         checkpointable_layers=list(CHECKPOINTABLE_LAYERS),
                                         dynamic_shape=dynamic_shape)
    engine, _, _, _ = ds_pipe_ckpt.initialize(model=module, config=config,
                                              model_parameters=[p for p in module.parameters() if p.requires_grad])
    torch.manual_seed(seed if dropout_seed is None else dropout_seed)
    return engine
