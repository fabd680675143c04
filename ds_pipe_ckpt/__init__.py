"""ds_pipe_ckpt: activation checkpointing for DeepSpeed pipeline-parallel
training, built on torch's non-reentrant checkpoint.

Drop-in imports::

    from ds_pipe_ckpt import PipelineModule, LayerSpec, TiedLayerSpec   # for deepspeed.pipe
    import ds_pipe_ckpt; ds_pipe_ckpt.checkpoint(fn, *args)            # for deepspeed.checkpointing
    engine, *_ = ds_pipe_ckpt.initialize(model=..., config=...)        # for deepspeed.initialize

The mode is the DeepSpeed JSON flag ``"pipeline": {"use_reentrant": false}``.

Importing the package wraps ``deepspeed.checkpointing.configure``, ``reset``
and ``checkpoint`` (DeepSpeed's functions still run, first and unchanged): a
training stack's own configure call is then in force for ds_pipe_ckpt too,
and its own checkpoint calls can be routed here with
:func:`route_deepspeed_checkpoint` (see :mod:`ds_pipe_ckpt.deepspeed_wrappers`).
"""

import warnings as _warnings

from . import compat
from .checkpoint import checkpoint
from .config import CheckpointingConfig
from .errors import ConfigError, InPlaceInputError, RecomputeMismatchError, ReentrantFallbackWarning, UpstreamLimitError
from .initialize import initialize
from .placement.runtime import profile_records, reset
from .pipe import LayerSpec, PipelineModule, TiedLayerSpec
from .planning.planned_partition import PartitionPlanning, partition_from_config
from .settings import CheckpointingSettings, configure, current_settings, route_deepspeed_checkpoint
from . import deepspeed_wrappers as _deepspeed_wrappers

__all__ = [
    "PipelineModule",
    "LayerSpec",
    "TiedLayerSpec",
    "PartitionPlanning",
    "partition_from_config",
    "checkpoint",
    "configure",
    "current_settings",
    "route_deepspeed_checkpoint",
    "initialize",
    "reset",
    "profile_records",
    "CheckpointingConfig",
    "CheckpointingSettings",
    "ConfigError",
    "RecomputeMismatchError",
    "InPlaceInputError",
    "ReentrantFallbackWarning",
    "UpstreamLimitError",
]

__version__ = "0.2.0"


def _warn_outside_the_tested_range() -> None:
    problems = compat.unsupported_versions()
    if not compat.CHECKPOINT_HOOKS_VISIBLE:
        problems.append(f"torch {compat.torch.__version__}'s checkpoint hooks are not recognised: the recompute check "
                        "falls back to torch's own determinism_check (its errors do not name the layer) and memory "
                        "planning is unavailable")
    if problems:
        _warnings.warn("ds_pipe_ckpt: " + "; ".join(problems) + ". The tested range is in README.md "
                       "(\"Supported versions\").", UserWarning, stacklevel=3)


_warn_outside_the_tested_range()
_deepspeed_wrappers.install()
