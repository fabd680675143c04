"""``checkpoint()``: DeepSpeed's activation-checkpoint call, built on torch's
non-reentrant checkpoint."""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
import torch.utils.checkpoint as torch_checkpoint
from deepspeed.runtime.activation_checkpointing import checkpointing as ds_checkpointing

from .errors import ConfigError, ReentrantFallbackWarning
from .placement.runtime import saved_input_hooks
from .recompute import CheckInputsUnmodified, InputVersionCheck, RecomputeGuard, Region
from .rng import ReplayTrackerStates
from .settings import current_settings

__all__ = ["checkpoint", "checkpoint_region", "checkpoint_non_reentrant"]

_FALLBACK_WARNING = (
    "ds_pipe_ckpt.checkpoint: reentrant checkpointing of {name} was called with no tensor "
    "input that requires grad; the reentrant path would return an output without grad_fn and "
    "silently drop the gradients of the parameters inside it. Using torch's non-reentrant "
    "checkpoint for such calls instead (same math). Set pipeline.use_reentrant=false to "
    "use it everywhere and silence this warning.")


def _name_of(function: Callable[..., Any]) -> str:
    name = getattr(function, "__qualname__", None) or getattr(function, "__name__", None)
    return name or type(function).__name__


def _any_tensor_requires_grad(args: tuple, kwargs: dict) -> bool:
    return any(isinstance(a, torch.Tensor) and a.requires_grad
               for a in (*args, *kwargs.values()))


def checkpoint_non_reentrant(function: Callable[..., Any], args: tuple, kwargs: dict, *,
                             region: Region, debug: bool, verify: bool) -> Any:
    """torch's non-reentrant checkpoint of ``function(*args, **kwargs)``, with
    DeepSpeed's model-parallel RNG tracker replayed for the recomputation, the
    recomputation checked against the forward (see :mod:`ds_pipe_ckpt.recompute`)
    and the saved inputs placed as ``activation_checkpointing`` configures."""
    settings = current_settings()
    # verify compares every op of the recomputation: it must run to the end.
    early_stop = settings.config.early_stop and not verify
    guarded = RecomputeGuard(ReplayTrackerStates(function, ds_checkpointing.get_cuda_rng_tracker()),
                             region, verify=verify, early_stop=early_stop)
    with saved_input_hooks(settings.config, settings.model_parallel) as placement:
        # Placement hooks copy the inputs when the forward ends; otherwise the live
        # tensors are saved and must not change before the recomputation.
        with contextlib.nullcontext() if placement.holds_inputs else InputVersionCheck(region):
            return torch_checkpoint.checkpoint(placement.wrap(guarded), *args, use_reentrant=False,
                                               preserve_rng_state=True, debug=debug, early_stop=early_stop,
                                               **kwargs)


def checkpoint(function: Callable[..., Any], *args: Any, use_reentrant: bool | None = None,
               debug: bool | None = None, verify: bool | None = None, **kwargs: Any) -> Any:
    """Checkpoint ``function(*args, **kwargs)``: drop-in for ``deepspeed.checkpointing.checkpoint``.

    The region's activations are not kept; they are recomputed in backward.

    Args:
        function: the region to run. It may return a tensor, a tuple (nested
            structures and non-tensors included) or anything torch's checkpoint accepts.
        *args, **kwargs: its arguments. Non-tensors, ``None`` and tensors that do
            not require grad are fine; parameters used inside ``function`` get
            their gradients either way.
        use_reentrant: ``None`` (default) follows :func:`configure` /
            ``pipeline.use_reentrant``; ``False`` uses
            ``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` (supports
            ``torch.autograd.grad``, keyword arguments and inputs without grad);
            ``True`` uses DeepSpeed's reentrant checkpoint, except for calls with
            no tensor input requiring grad, which would lose parameter gradients
            there: those use the non-reentrant path, with a one-time
            :class:`ReentrantFallbackWarning`.
        debug: non-reentrant only; ``None`` follows ``activation_checkpointing.debug``.
            ``True`` makes recomputation errors carry torch's op traces.
        verify: non-reentrant only; ``None`` follows
            ``activation_checkpointing.verify_recompute``. ``True`` compares the
            recomputation with the forward op by op and names the first differing
            op in the :class:`RecomputeMismatchError` (a Python call per op).

    Errors: a recomputation that diverges from the forward raises
    :class:`RecomputeMismatchError` naming ``function``; a function that modifies
    its tensor inputs in place, or returns no tensor, is refused at forward time.

    RNG: the CPU and accelerator generators and DeepSpeed's model-parallel RNG
    tracker (``deepspeed.checkpointing.get_cuda_rng_tracker()``) are replayed for
    the recomputation, so dropout masks match the forward's exactly.

    Returns:
        what ``function`` returns.
    """
    if not callable(function):
        raise TypeError(f"checkpoint() expects a callable as its first argument, got {type(function).__name__}")
    return checkpoint_region(function, args, kwargs, region=Region(f"function {_name_of(function)}"),
                             use_reentrant=use_reentrant, debug=debug, verify=verify)


def _resolve_flag(key: str, value: bool | None, configured: bool) -> bool:
    if value is None:
        return configured
    if not isinstance(value, bool):
        raise ConfigError(key, value, "True, False or None (None follows configure())")
    return value


def checkpoint_region(function: Callable[..., Any], args: tuple, kwargs: dict, *, region: Region,
                      use_reentrant: bool | None = None, debug: bool | None = None,
                      verify: bool | None = None) -> Any:
    """:func:`checkpoint` with an explicit region name (used by PipelineModule)."""
    config = current_settings().config
    use_reentrant = _resolve_flag("use_reentrant", use_reentrant, config.use_reentrant)
    debug = _resolve_flag("debug", debug, config.debug)
    verify = _resolve_flag("verify", verify, config.verify_recompute)
    if use_reentrant:
        for key, value in (("debug", debug), ("verify", verify)):
            if value:
                raise ConfigError(key, value, "False with use_reentrant=True",
                                  f"{key} checks torch's non-reentrant recomputation.")
        if not torch.is_grad_enabled() or _any_tensor_requires_grad(args, kwargs):
            return ds_checkpointing.checkpoint(CheckInputsUnmodified(function, region), *args, **kwargs)
        current_settings().warn_once("reentrant-fallback", _FALLBACK_WARNING.format(name=region.name),
                                     ReentrantFallbackWarning)
    return checkpoint_non_reentrant(function, args, kwargs, region=region, debug=debug, verify=verify)
