"""The wrappers ds_pipe_ckpt puts on DeepSpeed's checkpointing module when it
is imported (:func:`install`): ``configure``, ``reset`` and ``checkpoint``,
each calling DeepSpeed's function first and unchanged, then ds_pipe_ckpt's
settings, buffers or checkpoint (:mod:`ds_pipe_ckpt.upstream_checkpointing`
says what each does and why).

It sits above the modules it calls, so that nothing below imports it; only
the package's ``__init__`` does.
"""

from __future__ import annotations

from deepspeed.runtime.activation_checkpointing import checkpointing as ds_checkpointing

from .checkpoint import deepspeed_checkpoint_call
from .placement.runtime import reset
from .settings import record_deepspeed_configure
from .upstream_checkpointing import (ORIGINAL_CHECKPOINT, ORIGINAL_CONFIGURE, ORIGINAL_RESET, is_wrapper,
                                     mark_wrapper)

__all__ = ["install"]


def _configure(mpu_=None, deepspeed_config=None, partition_activations=None, contiguous_checkpointing=None,
               num_checkpoints=None, checkpoint_in_cpu=None, synchronize=None, profile=None):
    ORIGINAL_CONFIGURE(mpu_, deepspeed_config=deepspeed_config, partition_activations=partition_activations,
                       contiguous_checkpointing=contiguous_checkpointing, num_checkpoints=num_checkpoints,
                       checkpoint_in_cpu=checkpoint_in_cpu, synchronize=synchronize, profile=profile)
    record_deepspeed_configure(mpu_, deepspeed_config, partition_activations=partition_activations,
                               contiguous_checkpointing=contiguous_checkpointing, num_checkpoints=num_checkpoints,
                               checkpoint_in_cpu=checkpoint_in_cpu, synchronize=synchronize, profile=profile)


def _reset():
    reset()  # DeepSpeed's reset, then ds_pipe_ckpt's buffers


def _checkpoint(function, *args, **kwargs):
    return deepspeed_checkpoint_call(function, args, kwargs)


_WRAPPERS = {"configure": mark_wrapper(_configure, ORIGINAL_CONFIGURE),
             "reset": mark_wrapper(_reset, ORIGINAL_RESET),
             "checkpoint": mark_wrapper(_checkpoint, ORIGINAL_CHECKPOINT)}


def install() -> None:
    """Put the wrappers on DeepSpeed's module (idempotent)."""
    for name, wrapper in _WRAPPERS.items():
        if not is_wrapper(getattr(ds_checkpointing, name)):
            setattr(ds_checkpointing, name, wrapper)
