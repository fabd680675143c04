"""DeepSpeed's checkpointing module (``deepspeed.checkpointing``) as
ds_pipe_ckpt sees it: the functions it had before ds_pipe_ckpt was imported,
a snapshot of the settings it holds, and the three calls that training stacks
make on it, observed.

Training stacks configure checkpointing on DeepSpeed's module, in code:
GPT-NeoX calls ``deepspeed.checkpointing.configure(mpu, partition_activations=...,
checkpoint_in_cpu=..., ...)`` and ``deepspeed.checkpointing.reset()`` every step,
Megatron-DeepSpeed ``configure(mpu, deepspeed_config=..., ...)`` and, from its
own layers, ``deepspeed.checkpointing.checkpoint(...)``. Importing ds_pipe_ckpt
replaces those three attributes of the module with thin wrappers
(:func:`install`), which call DeepSpeed's function first and unchanged:

* ``configure``: then hands the call's values to
  :func:`ds_pipe_ckpt.settings.record_deepspeed_configure`, so that they are
  the settings ds_pipe_ckpt's checkpoint uses too, in both modes.
* ``reset``: :func:`ds_pipe_ckpt.reset`, which also releases ds_pipe_ckpt's pooled buffers.
* ``checkpoint``: routed to :func:`ds_pipe_ckpt.checkpoint` only after the
  explicit opt-in :func:`ds_pipe_ckpt.route_deepspeed_checkpoint`; otherwise
  it is upstream's reentrant checkpoint, with a one-time log line when the
  job's ``use_reentrant`` is false.

A program that captured one of the original functions before the import
(``from deepspeed.runtime.activation_checkpointing.checkpointing import
configure``) still reaches DeepSpeed's module state: the settings read
:func:`snapshot` on every use and adopt values that changed behind the
wrappers, so they cannot go stale.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

from deepspeed.runtime.activation_checkpointing import checkpointing as ds_checkpointing

__all__ = ["ORIGINAL_CONFIGURE", "ORIGINAL_RESET", "ORIGINAL_CHECKPOINT", "UpstreamState", "snapshot", "state_key",
           "is_deepspeed_checkpoint", "install", "CONFIGURE_CALL"]

_MARK = "_ds_pipe_ckpt_wraps"


def _original(name: str) -> Callable[..., Any]:
    """``ds_checkpointing.<name>`` as DeepSpeed defined it (also after :func:`install`)."""
    function = getattr(ds_checkpointing, name)
    return getattr(function, _MARK, function)


ORIGINAL_CONFIGURE = _original("configure")
ORIGINAL_RESET = _original("reset")
ORIGINAL_CHECKPOINT = _original("checkpoint")

# How messages name a configure() call made on DeepSpeed's module.
CONFIGURE_CALL = "deepspeed.checkpointing.configure()"


class UpstreamState(NamedTuple):
    """The settings DeepSpeed's checkpointing module holds (its module globals)."""

    mpu: Any
    partition_activations: bool
    contiguous_memory_optimization: bool
    number_checkpoints: int | None
    cpu_checkpointing: bool
    synchronize_checkpoint_boundary: bool
    profile: bool
    configured: bool  # deepspeed.checkpointing.is_configured()

    def fields(self) -> dict[str, Any]:
        """The values as :class:`~ds_pipe_ckpt.CheckpointingConfig` fields."""
        return {name: getattr(self, name) for name in self._fields if name not in ("mpu", "configured")}


def state_key() -> tuple:
    """What DeepSpeed's checkpointing module holds now, as a plain tuple in
    :class:`UpstreamState`'s order (read on every checkpoint call: a few attribute reads)."""
    module = ds_checkpointing
    return (module.mpu, module.PARTITION_ACTIVATIONS, module.CONTIGUOUS_CHECKPOINTING, module.num_layers,
            module.CPU_CHECKPOINT, module.SYNCHRONIZE, module.PROFILE_TIME, module.deepspeed_checkpointing_enabled)


def snapshot() -> UpstreamState:
    """What DeepSpeed's checkpointing module holds now."""
    return UpstreamState(*state_key())


def is_deepspeed_checkpoint(function: Any) -> bool:
    """Whether ``function`` is ``deepspeed.checkpointing.checkpoint`` (DeepSpeed's or the wrapper)."""
    return function is ORIGINAL_CHECKPOINT or getattr(function, _MARK, None) is ORIGINAL_CHECKPOINT


def _wrapping(original: Callable[..., Any]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def decorate(wrapper: Callable[..., Any]) -> Callable[..., Any]:
        wrapper = functools.wraps(original)(wrapper)
        setattr(wrapper, _MARK, original)
        return wrapper

    return decorate


@_wrapping(ORIGINAL_CONFIGURE)
def _configure(mpu_=None, deepspeed_config=None, partition_activations=None, contiguous_checkpointing=None,
               num_checkpoints=None, checkpoint_in_cpu=None, synchronize=None, profile=None):
    ORIGINAL_CONFIGURE(mpu_, deepspeed_config=deepspeed_config, partition_activations=partition_activations,
                       contiguous_checkpointing=contiguous_checkpointing, num_checkpoints=num_checkpoints,
                       checkpoint_in_cpu=checkpoint_in_cpu, synchronize=synchronize, profile=profile)
    from .settings import record_deepspeed_configure

    record_deepspeed_configure(mpu_, deepspeed_config, partition_activations=partition_activations,
                               contiguous_checkpointing=contiguous_checkpointing, num_checkpoints=num_checkpoints,
                               checkpoint_in_cpu=checkpoint_in_cpu, synchronize=synchronize, profile=profile)


@_wrapping(ORIGINAL_RESET)
def _reset():
    from .placement.runtime import reset  # DeepSpeed's reset, then ds_pipe_ckpt's buffers

    reset()


@_wrapping(ORIGINAL_CHECKPOINT)
def _checkpoint(function, *args, **kwargs):
    from .checkpoint import deepspeed_checkpoint_call

    return deepspeed_checkpoint_call(function, args, kwargs)


def install() -> None:
    """Put the wrappers on DeepSpeed's module (idempotent)."""
    for name, wrapper in (("configure", _configure), ("reset", _reset), ("checkpoint", _checkpoint)):
        if not hasattr(getattr(ds_checkpointing, name), _MARK):
            setattr(ds_checkpointing, name, wrapper)
