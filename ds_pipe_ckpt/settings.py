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
from .options import CheckpointOptions
from .errors import ConfigError
from .parallel import TensorParallelGroup
from .regions import RegionRegistry

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
    # What the functions given to checkpoint() showed on their first call
    # (carried over by configure(): it does not depend on the configuration).
    regions: RegionRegistry = field(default_factory=RegionRegistry, repr=False, compare=False)
    # Resolved per-call options, by the keywords they were resolved from.
    _options: dict = field(default_factory=dict, repr=False, compare=False)
    # State the checkpoints of this configuration share (buffer pool, profile
    # records): a ds_pipe_ckpt.placement.runtime.CheckpointRuntime, created on first use.
    runtime: Any = field(default=None, repr=False, compare=False)

    def options(self, **keywords: Any) -> CheckpointOptions:
        """:meth:`CheckpointOptions.resolve` of ``keywords`` (``None``: as
        configured) under this configuration, cached: it runs on every
        checkpointed call."""
        # Names, values and their types: True and 1 are equal keys, and only one of them is valid.
        values = tuple(keywords.values())
        key = (tuple(keywords), values, tuple(map(type, values)))
        try:
            return self._options[key]
        except KeyError:
            pass
        except TypeError:  # an unhashable value: resolve() names it
            return CheckpointOptions.resolve(self.config, **keywords)
        options = self._options[key] = CheckpointOptions.resolve(self.config, **keywords)
        if len(self._options) > 64:  # e.g. a new context_fn per call
            self._options.pop(next(iter(self._options)))
        return options

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


def _model_parallel_group(config: CheckpointingConfig, mpu: Any) -> TensorParallelGroup | None:
    """The group partitioned activations are split over. Without an ``mpu``,
    partitioning has a group of one rank (nothing to split), as upstream
    DeepSpeed trains then too."""
    if mpu is not None:
        return TensorParallelGroup.from_mpu(mpu)
    if config.partition_activations:
        logger.info("activation_checkpointing.partition_activations is true but no model-parallel unit (mpu) "
                    "was given: partitioning over a group of one rank, i.e. the inputs are kept whole. Pass "
                    "mpu= to configure() (ds_pipe_ckpt.initialize passes a PipelineModule's grid).")
        return TensorParallelGroup.single()
    return None


def _configure_upstream(config: CheckpointingConfig, model_parallel: TensorParallelGroup | None) -> None:
    """Mirror the options into DeepSpeed's checkpointing module, which the
    reentrant mode delegates to. DeepSpeed's configure() needs torch.distributed;
    the non-reentrant mode does not use DeepSpeed's copy of these options."""
    if not ds_comm.is_initialized():
        needs_dist = [k for k in _UPSTREAM_OPTIONS if getattr(config, k)
                      and not (k == "partition_activations" and model_parallel.world_size == 1)]
        if needs_dist and config.use_reentrant:
            raise ConfigError(f"activation_checkpointing.{needs_dist[0]}", True,
                              "false before torch.distributed is initialized in the reentrant mode",
                              "Call deepspeed.init_distributed() first (the reentrant mode delegates this "
                              "option to DeepSpeed), or set pipeline.use_reentrant to false.")
        return
    # Over a group of one there is nothing to partition; DeepSpeed would still
    # copy every input (and gather over its default group).
    partition = config.partition_activations and model_parallel.world_size > 1
    ds_checkpointing.configure(
        model_parallel,
        partition_activations=partition,
        contiguous_checkpointing=config.contiguous_memory_optimization and partition,
        num_checkpoints=config.number_checkpoints,
        checkpoint_in_cpu=config.cpu_checkpointing,
        synchronize=config.synchronize_checkpoint_boundary,
        profile=config.profile,
    )


def configure(mpu_: Any = None,
              deepspeed_config: Any = None,
              partition_activations: bool | None = None,
              contiguous_checkpointing: bool | None = None,
              num_checkpoints: int | None = None,
              checkpoint_in_cpu: bool | None = None,
              synchronize: bool | None = None,
              profile: bool | None = None,
              *,
              mpu: Any = None,
              **overrides: Any) -> CheckpointingSettings:
    """Configure activation checkpointing: drop-in for ``deepspeed.checkpointing.configure``
    (the same arguments, names and positional order).

    Each call starts from the defaults, then applies ``deepspeed_config``, then
    the keyword values. The result is one settings object (returned), not
    module globals.

    Args:
        mpu_: model-parallel unit (``get_model_parallel_group/rank/world_size``,
            or the tensor-parallel variants; a pipeline's ``PipelineModule.mpu()``
            grid works): the group ``partition_activations`` splits over. Without
            one, partitioning has a group of one rank (a one-time log note).
            ``mpu=`` is accepted as well.
        deepspeed_config: a DeepSpeed config dict, JSON path or base64 string; its
            ``pipeline.use_reentrant`` and ``activation_checkpointing`` sections are read.
        partition_activations, contiguous_checkpointing, num_checkpoints,
        checkpoint_in_cpu, synchronize, profile: DeepSpeed's overrides of the
            ``activation_checkpointing`` keys; ``None`` leaves a value as configured.
        **overrides: ours: ``use_reentrant``, ``debug``, ``verify_recompute``,
            ``early_stop``, ``policy``, ``save_ops`` (``None``: as configured).

    Raises:
        ConfigError: a value of the wrong type or range, an unknown
            ``activation_checkpointing`` key, an ``mpu`` without model-parallel methods.
        TypeError: an unknown keyword, or ``mpu_`` and ``mpu`` both given.
    """
    if mpu_ is not None and mpu is not None and mpu_ is not mpu:
        raise TypeError("configure() got two model-parallel units: pass either mpu_ (DeepSpeed's name) or mpu")
    mpu = mpu_ if mpu_ is not None else mpu
    config = CheckpointingConfig.from_ds_config(load_ds_config(deepspeed_config))
    config = config.with_overrides(partition_activations=partition_activations,
                                   contiguous_checkpointing=contiguous_checkpointing,
                                   num_checkpoints=num_checkpoints, checkpoint_in_cpu=checkpoint_in_cpu,
                                   synchronize=synchronize, profile=profile, **overrides)
    model_parallel = _model_parallel_group(config, mpu)
    _configure_upstream(config, model_parallel)
    # What regions showed on their first call does not depend on the
    # configuration: keep it, so that reconfiguring does not relearn every region.
    settings = CheckpointingSettings(config=config, model_parallel=model_parallel, regions=_Holder.settings.regions)
    _Holder.settings = settings
    logger.info("activation checkpointing configured: %s", config)
    return settings
