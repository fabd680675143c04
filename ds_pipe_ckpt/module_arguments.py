"""The checks of :class:`~ds_pipe_ckpt.PipelineModule`'s constructor
arguments, raising :class:`~ds_pipe_ckpt.ConfigError` where DeepSpeed asserts.

Checks values only; it builds nothing and reads no configuration (the rules
between the module and a memory budget are
:func:`ds_pipe_ckpt.config.check_module_against_config`).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from .config import validate_interval
from .errors import ConfigError

__all__ = ["check_module_arguments", "require_checkpoint_func"]


def require_checkpoint_func(func: Any) -> Callable[..., Any]:
    """``func`` if it is callable; else a ConfigError naming ``activation_checkpoint_func``."""
    if not callable(func):
        raise ConfigError("activation_checkpoint_func", func, "a callable func(function, *args)")
    return func


def check_module_arguments(interval: Any, partition_method: Any, partition_planning: Any, checkpoint_func: Any,
                           checkpointable_layers: Sequence[str] | None) -> list[str] | None:
    """Check the arguments DeepSpeed's ``PipelineModule`` would assert on (and
    ``partition_method="planned"``, which needs ``partition_planning``);
    return ``checkpointable_layers`` as a list (None stays None).

    Raises:
        ConfigError: naming the first invalid argument.
    """
    validate_interval("activation_checkpoint_interval", interval)
    if isinstance(partition_method, str) and partition_method.lower() == "planned" and partition_planning is None:
        raise ConfigError("partition_method", partition_method,
                          "a DeepSpeed method, or \"planned\" with partition_planning=PartitionPlanning(...)",
                          "The planned cut needs the stages' budgets, the micro-batches per step and a "
                          "sample micro-batch (ds_pipe_ckpt.planning.planned_partition.PartitionPlanning).")
    require_checkpoint_func(checkpoint_func)
    if checkpointable_layers is None:
        return None
    if isinstance(checkpointable_layers, str) or not all(isinstance(name, str) for name in checkpointable_layers):
        raise ConfigError("checkpointable_layers", checkpointable_layers,
                          "a list of layer class names (strings) or None",
                          upstream="param `checkpointable_layers` must be type of list.")
    return list(checkpointable_layers)
