"""The Llama pipeline for one DeepSpeed config: module and engine, from a
``LlamaConfig`` (seeded weights) or a checkpoint directory (each stage loads
its own layers)."""

from __future__ import annotations

import os
from typing import Any

import torch
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
from transformers import LlamaConfig

import ds_pipe_ckpt

from .model import CHECKPOINTABLE_LAYERS, causal_lm_loss, llama_layer_specs, prepare_config
from .pretrained import LoadedWeights, load_local_weights

__all__ = ["DEFAULT_PARTITION_METHOD", "build_module", "build_engine"]

# Balance the decoder layers across stages (DeepSpeed's "type:REGEX" method); the
# embedding and rotary table go with the first stage, the norm and head with the last.
DEFAULT_PARTITION_METHOD = "type:DecoderLayer"


def build_module(model: LlamaConfig, topology: PipeModelDataParallelTopology, seed: int = 0,
                 pretrained: str | os.PathLike | None = None, partition_method: str = DEFAULT_PARTITION_METHOD,
                 partition_planning: ds_pipe_ckpt.PartitionPlanning | None = None,
                 dynamic_shape: bool = False) -> tuple[Any, LoadedWeights | None]:
    """The ``ds_pipe_ckpt.PipelineModule`` of ``model`` on this rank's stage:
    weights seeded with ``seed`` (the same for every layout), or, with
    ``pretrained`` (a checkpoint directory whose config is ``model``), the
    checkpoint's, read for this stage's layers only. Returns the module and
    what was loaded (``None`` without ``pretrained``). Only the decoder layers
    are checkpointable. ``partition_planning`` goes with ``partition_method="planned"``
    (``ds_pipe_ckpt.partition_from_config``). ``dynamic_shape``: micro-batches
    of variable length (DeepSpeed sends each one's shapes; a budget then needs
    ``activation_checkpointing.max_sequence_length``).
    """
    model = prepare_config(model)
    specs = llama_layer_specs(model, seed=None if pretrained is not None else seed)
    module = ds_pipe_ckpt.PipelineModule(layers=specs, topology=topology, loss_fn=causal_lm_loss,
                                         partition_method=partition_method, partition_planning=partition_planning,
                                         checkpointable_layers=list(CHECKPOINTABLE_LAYERS),
                                         dynamic_shape=dynamic_shape)
    loaded = load_local_weights(module, model, pretrained) if pretrained is not None else None
    return module, loaded


def build_engine(config: dict, model: LlamaConfig, topology: PipeModelDataParallelTopology, seed: int = 0,
                 pretrained: str | os.PathLike | None = None, dropout_seed: int | None = None,
                 partition_method: str = DEFAULT_PARTITION_METHOD,
                 partition_planning: ds_pipe_ckpt.PartitionPlanning | None = None,
                 dynamic_shape: bool = False) -> tuple[Any, LoadedWeights | None]:
    """``ds_pipe_ckpt.initialize`` of :func:`build_module` under ``config`` (a
    DeepSpeed config dict with an ``optimizer`` section); returns DeepSpeed's
    ``PipelineEngine`` and what was loaded.

    The default generator (attention dropout, when the config has any) is
    seeded with ``dropout_seed`` (default ``seed``) last, so every config built
    with the same seeds draws the same masks.
    """
    if "optimizer" not in config:
        raise ValueError("the DeepSpeed config has no \"optimizer\" section; the Llama example builds its optimizer "
                         "from it, e.g. {\"type\": \"AdamW\", \"params\": {\"lr\": 0.001, \"torch_adam\": true}}")
    module, loaded = build_module(model, topology, seed, pretrained, partition_method, partition_planning,
                                  dynamic_shape)
    engine, _, _, _ = ds_pipe_ckpt.initialize(model=module, config=config,
                                              model_parameters=[p for p in module.parameters() if p.requires_grad])
    torch.manual_seed(seed if dropout_seed is None else dropout_seed)
    return engine, loaded
