"""The activation-checkpointing settings in force, held in one object.

``configure()`` builds a new :class:`CheckpointingSettings` from defaults, a
DeepSpeed config and keyword overrides, checks it, and swaps it in. Nothing
else is module-level state.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field
from typing import Any

from deepspeed import comm as ds_comm
from deepspeed.runtime.activation_checkpointing import checkpointing as ds_checkpointing

from .config import CheckpointingConfig, load_ds_config
from .errors import ConfigError
from .parallel import TensorParallelGroup

logger = logging.getLogger("ds_pipe_ckpt")

__all__ = ["CheckpointingSettings", "configure", "current_settings"]

# Options the reentrant mode delegates to DeepSpeed's checkpointing module (the
# non-reentrant mode implements them in ds_pipe_ckpt.placement).
_UPSTREAM_OPTIONS = (
    "partition_activations",
    "cpu_checkpointing",
    "contiguous_memory_optimization",
    "synchronize_checkpoint_boundary",
    "profile",
)


@dataclass
class CheckpointingSettings:
    """Configuration plus the model-parallel unit (``mpu``) it applies to."""

    config: CheckpointingConfig = field(default_factory=CheckpointingConfig)
    model_parallel: TensorParallelGroup | None = None
    # Warnings already issued, so that each is logged once per configuration.
    warned: set = field(default_factory=set)
    # State the checkpoints of this configuration share (buffer pool, profile
    # records): a ds_pipe_ckpt.placement.runtime.CheckpointRuntime, created on first use.
    runtime: Any = field(default=None, repr=False, compare=False)

    def warn_once(self, key: str, message: str, category: type[Warning] = UserWarning) -> None:
        """Issue ``message`` the first time ``key`` is seen under this configuration."""
        if key not in self.warned:
            self.warned.add(key)
            warnings.warn(message, category, stacklevel=3)


class _Holder:
    settings = CheckpointingSettings()


def current_settings() -> CheckpointingSettings:
    """The settings in force (defaults until :func:`configure` is called)."""
    return _Holder.settings


def _check_supported(config: CheckpointingConfig, model_parallel: TensorParallelGroup | None) -> None:
    if config.partition_activations and model_parallel is None:
        raise ConfigError("activation_checkpointing.partition_activations", True,
                          "false when no model-parallel group is known",
                          "Pass mpu= (an object with get_model_parallel_group/rank/world_size, "
                          "e.g. PipelineModule.mpu()) to configure(), or use ds_pipe_ckpt.initialize().")


def _configure_upstream(config: CheckpointingConfig, model_parallel: TensorParallelGroup | None) -> None:
    """Mirror the options into DeepSpeed's checkpointing module, which the
    reentrant mode delegates to. DeepSpeed's configure() needs torch.distributed;
    the non-reentrant mode does not use DeepSpeed's copy of these options."""
    if not ds_comm.is_initialized():
        needs_dist = [k for k in _UPSTREAM_OPTIONS if getattr(config, k)]
        if needs_dist and config.use_reentrant:
            raise ConfigError(f"activation_checkpointing.{needs_dist[0]}", True,
                              "false before torch.distributed is initialized in the reentrant mode",
                              "Call deepspeed.init_distributed() first (the reentrant mode delegates this "
                              "option to DeepSpeed), or set pipeline.use_reentrant to false.")
        return
    ds_checkpointing.configure(
        model_parallel,
        partition_activations=config.partition_activations,
        contiguous_checkpointing=config.contiguous_memory_optimization,
        num_checkpoints=config.number_checkpoints,
        checkpoint_in_cpu=config.cpu_checkpointing,
        synchronize=config.synchronize_checkpoint_boundary,
        profile=config.profile,
    )


def configure(mpu: Any = None, deepspeed_config: Any = None, **overrides: Any) -> CheckpointingSettings:
    """Configure activation checkpointing: drop-in for ``deepspeed.checkpointing.configure``.

    Each call starts from the defaults, then applies ``deepspeed_config``, then
    ``overrides``. The result is one settings object (returned), not module globals.

    Args:
        mpu: model-parallel unit (``get_model_parallel_group/rank/world_size``;
            a pipeline's ``PipelineModule.mpu()`` grid works). Needed for
            ``partition_activations``.
        deepspeed_config: a DeepSpeed config dict, JSON path or base64 string; its
            ``pipeline.use_reentrant`` and ``activation_checkpointing`` sections are read.
        **overrides: DeepSpeed's keywords ``partition_activations``,
            ``contiguous_checkpointing``, ``num_checkpoints``, ``checkpoint_in_cpu``,
            ``synchronize``, ``profile``, plus ``use_reentrant`` and ``debug``.
            ``None`` leaves a value unchanged.

    Raises:
        ConfigError: a value of the wrong type or range, an unknown
            ``activation_checkpointing`` key, partitioning without ``mpu``.
        TypeError: an unknown keyword.
    """
    config = CheckpointingConfig.from_ds_config(load_ds_config(deepspeed_config))
    config = config.with_overrides(**overrides)
    model_parallel = None if mpu is None else TensorParallelGroup.from_mpu(mpu)
    _check_supported(config, model_parallel)
    _configure_upstream(config, model_parallel)
    settings = CheckpointingSettings(config=config, model_parallel=model_parallel)
    _Holder.settings = settings
    logger.info("activation checkpointing configured: %s", config)
    return settings
