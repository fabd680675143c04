"""``checkpoint()``: DeepSpeed's activation-checkpoint call, built on torch's
non-reentrant checkpoint.

Two modes, chosen by ``pipeline.use_reentrant`` / ``use_reentrant=``:

* **Non-reentrant** (:func:`checkpoint_non_reentrant`): torch's
  ``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` around a
  :class:`~ds_pipe_ckpt.region_call.RegionCall` (DeepSpeed's model-parallel RNG
  tracker replayed, the recomputation checked) inside
  :class:`~ds_pipe_ckpt.inputs.SavedInputs` (in-place inputs, placement of the
  saved inputs).
* **Reentrant**: DeepSpeed's own ``deepspeed.checkpointing.checkpoint``
  (:mod:`ds_pipe_ckpt.reentrant`), except where it would lose gradients:

  - a call with no tensor input that requires grad (DeepSpeed would return an
    output without ``grad_fn`` and drop the gradients of the parameters inside)
    runs non-reentrantly, with a one-time :class:`~ds_pipe_ckpt.ReentrantFallbackWarning`;
  - a region's first call (with grad enabled) runs non-reentrantly, which gives
    the same result and learns two things DeepSpeed's path cannot see: whether
    the region modifies an input in place (such a region keeps running
    non-reentrantly, with a one-time warning) and whether its recomputation
    reproduces its forward (a cache of a parameter built on the first call, such
    as ``w / w.norm()``, fails there with a
    :class:`~ds_pipe_ckpt.RecomputeMismatchError`; through DeepSpeed's path its
    parameter would silently get no gradient, since the forward runs without grad).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.utils.checkpoint as torch_checkpoint
from deepspeed.runtime.activation_checkpointing import checkpointing as ds_checkpointing

from .compat import require_deepspeed_reentrant
from .inputs import SavedInputs
from .options import CheckpointOptions
from .placement.runtime import placement_for
from .reentrant import reentrant_checkpoint
from .region_call import RegionCall
from .regions import Region, describe_callable
from .settings import CheckpointingSettings, current_settings
from .errors import ReentrantFallbackWarning
from .upstream_checkpointing import ORIGINAL_CHECKPOINT

__all__ = ["checkpoint", "checkpoint_region", "checkpoint_non_reentrant", "deepspeed_checkpoint_call"]

_FALLBACK_WARNING = (
    "ds_pipe_ckpt.checkpoint: reentrant checkpointing of {name} was called with no tensor "
    "input that requires grad; the reentrant path would return an output without grad_fn and "
    "silently drop the gradients of the parameters inside it. Using torch's non-reentrant "
    "checkpoint for such calls instead (same math). Set pipeline.use_reentrant=false to "
    "use it everywhere and silence this warning.")
_IN_PLACE_WARNING = (
    "ds_pipe_ckpt.checkpoint: checkpointed {name} modifies its input in place during its forward, "
    "which DeepSpeed's reentrant checkpoint cannot recompute; it runs through torch's non-reentrant "
    "checkpoint instead (same math). Set pipeline.use_reentrant=false to use it everywhere and "
    "silence this warning.")


def checkpoint_non_reentrant(function: Callable[..., Any], args: tuple, kwarg_names: tuple[str, ...],
                             region: Region, options: CheckpointOptions, settings: CheckpointingSettings,
                             observer: Any = None) -> Any:
    """torch's non-reentrant checkpoint of ``function`` (see the module docstring);
    ``args`` ends with the values of the keyword arguments named ``kwarg_names``.
    ``observer``: see :class:`~ds_pipe_ckpt.region_call.RegionCall`."""
    placement = placement_for(settings)
    call = RegionCall(function, region, kwarg_names=kwarg_names,
                      tracker=ds_checkpointing.get_cuda_rng_tracker() if options.preserve_rng_state else None,
                      check=options.determinism_check != "none", verify=options.verify, placement=placement,
                      observer=observer)
    # Our input hooks are needed to learn about a region, to recompute one that
    # modifies its input from a private copy, and to hand the inputs to a
    # placement. Otherwise torch saves the inputs itself, and its version check
    # (renamed by the probe to name the region) refuses a modified one.
    mutated = region.facts.mutated_inputs  # None: not learned yet
    if placement is None and mutated is not None and not mutated:
        return torch_checkpoint.checkpoint(call, *args, **options.torch_keywords)
    with SavedInputs(region, placement):
        return torch_checkpoint.checkpoint(call, *args, **options.torch_keywords)


def _inputs_are_copied(settings: CheckpointingSettings) -> bool:
    """Whether DeepSpeed's reentrant path stores copies of floating-point inputs."""
    config = settings.config
    partitioned = config.partition_activations and settings.model_parallel is not None \
        and settings.model_parallel.world_size > 1
    return config.cpu_checkpointing or partitioned


def checkpoint_region(function: Callable[..., Any], args: tuple, kwargs: dict, region: Region,
                      options: CheckpointOptions, observer: Any = None,
                      settings: CheckpointingSettings | None = None) -> Any:
    """Checkpoint ``function(*args, **kwargs)`` as ``region`` with ``options``
    (what :func:`checkpoint` and ``PipelineModule`` call) under ``settings``
    (None: the settings in force). An ``observer`` (non-reentrant mode only)
    watches the forward and the recomputation."""
    if settings is None:
        settings = current_settings()
    kwarg_names = tuple(kwargs)
    flat = (*args, *kwargs.values()) if kwargs else args
    if not options.use_reentrant:
        return checkpoint_non_reentrant(function, flat, kwarg_names, region, options, settings, observer)
    if observer is not None:
        raise ValueError("checkpoint_region: an observer needs the non-reentrant mode")
    if torch.is_grad_enabled():
        if not any(isinstance(a, torch.Tensor) and a.requires_grad for a in flat):
            settings.warn_once("reentrant-fallback", _FALLBACK_WARNING.format(name=region.name),
                               ReentrantFallbackWarning)
            return checkpoint_non_reentrant(function, flat, kwarg_names, region, options.learning(), settings)
        if not region.facts.learned:
            require_deepspeed_reentrant()  # on the region's first call, not on its first through DeepSpeed
            return checkpoint_non_reentrant(function, flat, kwarg_names, region, options.learning(), settings)
        if region.facts.mutates_inputs:
            settings.warn_once(f"reentrant-in-place:{region.name}", _IN_PLACE_WARNING.format(name=region.name),
                               ReentrantFallbackWarning)
            return checkpoint_non_reentrant(function, flat, kwarg_names, region, options.learning(), settings)
    return reentrant_checkpoint(function, flat, kwarg_names, region, inputs_are_copied=_inputs_are_copied(settings))


def checkpoint(function: Callable[..., Any], *args: Any, use_reentrant: bool | None = None,
               preserve_rng_state: bool | None = None, context_fn: Callable[[], tuple] | None = None,
               determinism_check: str | None = None, debug: bool | None = None, early_stop: bool | None = None,
               respect_saved_tensors_hooks: bool | None = None, verify: bool | None = None, **kwargs: Any) -> Any:
    """Checkpoint ``function(*args, **kwargs)``: drop-in for ``deepspeed.checkpointing.checkpoint``
    that also takes ``torch.utils.checkpoint.checkpoint``'s keywords.

    The region's activations are not kept; they are recomputed in backward.

    Args:
        function: the region: a module, a function, a bound method or a
            ``functools.partial`` (errors name it as ``Class.method`` or by
            the module's class). It may return a tensor or any structure of
            them (tuples, lists, dicts, nested) with non-tensors mixed in.
        *args, **kwargs: its arguments. Non-tensors, ``None`` and tensors that do
            not require grad are fine; parameters used inside ``function`` get
            their gradients either way.
        use_reentrant: ``None`` (default) follows :func:`configure` /
            ``pipeline.use_reentrant``; ``False`` uses
            ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``; ``True``
            uses DeepSpeed's reentrant checkpoint where that is exact (see
            :mod:`ds_pipe_ckpt.checkpoint`).
        preserve_rng_state, context_fn, determinism_check, debug, early_stop,
        respect_saved_tensors_hooks: torch's options, with torch's meaning
            (``None``: torch's default, or the ``activation_checkpointing``
            value where one exists: ``debug``, ``early_stop``). With
            ``use_reentrant=True``, ``context_fn``, ``debug``,
            ``respect_saved_tensors_hooks`` and ``preserve_rng_state=False``
            raise :class:`~ds_pipe_ckpt.ConfigError`; ``early_stop`` and
            ``determinism_check`` are accepted and unused, as in torch.
            ``preserve_rng_state=False`` also skips the replay of DeepSpeed's
            model-parallel RNG tracker; ``determinism_check="none"`` also turns
            off ds_pipe_ckpt's recomputation check.
        verify: non-reentrant only; ``None`` follows
            ``activation_checkpointing.verify_recompute``. ``True`` compares the
            recomputation with the forward op by op and names the first differing
            op in the :class:`~ds_pipe_ckpt.RecomputeMismatchError` (a Python call per op).

    Errors: a recomputation that diverges from the forward raises
    :class:`~ds_pipe_ckpt.RecomputeMismatchError` naming ``function``; a saved
    input modified in place after the forward raises
    :class:`~ds_pipe_ckpt.InPlaceInputError`; a function that returns no tensor
    is refused at forward time. A function that modifies its own input in place
    is recomputed from a private copy of that input (non-reentrant mode).

    RNG: the CPU and accelerator generators and DeepSpeed's model-parallel RNG
    tracker (``deepspeed.checkpointing.get_cuda_rng_tracker()``) are replayed for
    the recomputation, so dropout masks match the forward's exactly.

    Returns:
        what ``function`` returns, in the same structure.
    """
    if not callable(function):
        raise TypeError(f"checkpoint() expects a callable as its first argument, got {type(function).__name__}")
    settings = current_settings()
    options = settings.options(use_reentrant=use_reentrant, preserve_rng_state=preserve_rng_state,
                               early_stop=early_stop, determinism_check=determinism_check, debug=debug,
                               verify=verify, context_fn=context_fn,
                               respect_saved_tensors_hooks=respect_saved_tensors_hooks)
    region = settings.regions.region_for(function)
    if not options.use_reentrant and not kwargs:  # what checkpoint_region would do, one call sooner
        return checkpoint_non_reentrant(function, args, (), region, options, settings)
    return checkpoint_region(function, args, kwargs, region, options, settings=settings)


def deepspeed_checkpoint_call(function: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """A call of ``deepspeed.checkpointing.checkpoint(function, *args, **kwargs)``
    (ds_pipe_ckpt wraps it, see :mod:`ds_pipe_ckpt.deepspeed_wrappers`): after
    :func:`ds_pipe_ckpt.route_deepspeed_checkpoint`, ds_pipe_ckpt's checkpoint
    under the settings in force, ``kwargs`` going to ``function`` as DeepSpeed
    passes them; otherwise DeepSpeed's reentrant checkpoint, unchanged."""
    settings = current_settings()
    if settings.routes_deepspeed_checkpoint:
        region = settings.regions.region_for(function)
        return checkpoint_region(function, args, kwargs, region, settings.options(), settings=settings)
    if not settings.config.use_reentrant:
        settings.log_once("deepspeed-checkpoint-not-routed",
                          f"pipeline.use_reentrant is false, but {describe_callable(function)} is checkpointed by "
                          "deepspeed.checkpointing.checkpoint, DeepSpeed's reentrant checkpoint (the training "
                          "stack's own call). Call ds_pipe_ckpt.route_deepspeed_checkpoint() once before training "
                          "to run these calls through ds_pipe_ckpt's checkpoint, in the job's mode.")
    return ORIGINAL_CHECKPOINT(function, *args, **kwargs)
