"""DeepSpeed's checkpointing module (``deepspeed.checkpointing``) as
ds_pipe_ckpt sees it: the functions it had before ds_pipe_ckpt was imported
and a snapshot of the settings it holds. It imports nothing of ds_pipe_ckpt:
the modules that act on those settings import it.

Training stacks configure checkpointing on DeepSpeed's module, in code:
GPT-NeoX calls ``deepspeed.checkpointing.configure(mpu, partition_activations=...,
checkpoint_in_cpu=..., ...)`` and ``deepspeed.checkpointing.reset()`` every step,
Megatron-DeepSpeed ``configure(mpu, deepspeed_config=..., ...)`` and, from its
own layers, ``deepspeed.checkpointing.checkpoint(...)``. Importing ds_pipe_ckpt
replaces those three attributes of the module with thin wrappers
(:mod:`ds_pipe_ckpt.deepspeed_wrappers`), which call DeepSpeed's function
first and unchanged:

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
           "is_deepspeed_checkpoint", "mark_wrapper", "is_wrapper", "CONFIGURE_CALL"]

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


def mark_wrapper(wrapper: Callable[..., Any], original: Callable[..., Any]) -> Callable[..., Any]:
    """``wrapper`` named and documented as ``original``, and marked as wrapping it."""
    wrapper = functools.wraps(original)(wrapper)
    setattr(wrapper, _MARK, original)
    return wrapper


def is_wrapper(function: Any) -> bool:
    """Whether ``function`` is one of ds_pipe_ckpt's wrappers of DeepSpeed's functions."""
    return hasattr(function, _MARK)
