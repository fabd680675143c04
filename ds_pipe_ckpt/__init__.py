"""ds_pipe_ckpt: activation checkpointing for DeepSpeed pipeline-parallel
training, built on torch's non-reentrant checkpoint.

Drop-in imports::

    from ds_pipe_ckpt import PipelineModule, LayerSpec, TiedLayerSpec   # for deepspeed.pipe
    import ds_pipe_ckpt; ds_pipe_ckpt.checkpoint(fn, *args)            # for deepspeed.checkpointing
    engine, *_ = ds_pipe_ckpt.initialize(model=..., config=...)        # for deepspeed.initialize

The mode is the DeepSpeed JSON flag ``"pipeline": {"use_reentrant": false}``.
"""

from .checkpoint import checkpoint
from .config import CheckpointingConfig
from .errors import ConfigError, InPlaceInputError, RecomputeMismatchError, ReentrantFallbackWarning
from .initialize import initialize
from .placement.runtime import profile_records, reset
from .pipe import LayerSpec, PipelineModule, TiedLayerSpec
from .planning.planned_partition import PartitionPlanning, partition_from_config
from .settings import CheckpointingSettings, configure, current_settings

__all__ = [
    "PipelineModule",
    "LayerSpec",
    "TiedLayerSpec",
    "PartitionPlanning",
    "partition_from_config",
    "checkpoint",
    "configure",
    "current_settings",
    "initialize",
    "reset",
    "profile_records",
    "CheckpointingConfig",
    "CheckpointingSettings",
    "ConfigError",
    "RecomputeMismatchError",
    "InPlaceInputError",
    "ReentrantFallbackWarning",
]

__version__ = "0.1.0"
