"""Every difference between the torch and DeepSpeed versions ds_pipe_ckpt supports.

The supported range is :data:`TORCH_RANGE` and :data:`DEEPSPEED_RANGE` (the
same as ``setup.py``'s and the README's; ``make compat`` runs the unit tests
against it). The rest of the package imports what differs from here; no other
module compares versions.

What it is for: reading the installed versions once, and each torch or
DeepSpeed behaviour that differs within the range behind one named flag or
function. What it must not do: decide what ds_pipe_ckpt does with a
difference, or patch an engine; the correction of DeepSpeed's
gradient-accumulation scale, which measures the engine at hand instead of
reading its version, is :mod:`ds_pipe_ckpt.gradient_accumulation`.

torch
    ``_checkpoint_internal_hook`` (2.14 and later) marks the pack hooks of
    torch's non-reentrant checkpoint with ``_checkpoint_internal`` and lets
    selective checkpointing walk past them to the user's hooks
    (``_user_hooks``). The recompute check and the planner's profiler find
    torch's pair on the saved-tensor hooks stack by that mark; before 2.14
    they find it by the pack hook's name instead (:func:`is_checkpoint_pack_hook`),
    and whether that works on the torch at hand is tested once, on a tiny
    checkpoint, at import (:data:`CHECKPOINT_HOOKS_VISIBLE`). Where it does not,
    the recompute check leaves the comparison to torch's own
    ``determinism_check`` (its errors then do not name the layer) and the
    planner refuses its keys (:func:`require_checkpoint_hooks`); importing
    ds_pipe_ckpt warns.

    ``torch.cuda.get_arch_list()`` is empty without a visible GPU before 2.14,
    so the CUDA ops' build reads the architectures from torch's own flags
    (:func:`compiled_cuda_archs`). ``torch.distributed.all_gather_single`` is
    2.14's name of ``all_gather_into_tensor`` (:func:`all_gather_single`).

DeepSpeed
    * ``PipelineEngine._reentrant_activation_checkpointing`` (0.19): whether
      the engine makes the first stage's inputs require grad. Before 0.19 it
      reads ``config["pipeline"]`` instead, and only when the JSON config sets
      ``activation_checkpoint_interval`` (:func:`engine_inputs_require_grad`).
    * Before 0.19, the engine resolves ``pipeline.use_reentrant`` only when the
      JSON config sets ``activation_checkpoint_interval`` above 0, so a module
      built with its own interval keeps DeepSpeed's reentrant checkpoint
      whatever the flag says; ``ds_pipe_ckpt.initialize`` applies the flag in
      every case (:func:`resolve_use_reentrant`), a plain ``deepspeed.initialize``
      of those versions does not.
    * Before 0.19, DeepSpeed's reentrant checkpoint asks the accelerator for a
      stream to copy partitioned activations on; the CPU accelerator has none
      and it fails with ``TypeError: 'NoneType' object is not callable``
      (:data:`DEEPSPEED_REENTRANT_RUNS_ON_CPU`). That is DeepSpeed's own limit on a
      CPU (on a GPU it works); ds_pipe_ckpt's reentrant mode raises
      :class:`~ds_pipe_ckpt.UpstreamLimitError` there instead, naming the way
      around it (:func:`require_deepspeed_reentrant`).
"""

from __future__ import annotations

import re
from typing import Any, Callable

import deepspeed
import torch
import torch.distributed as dist
import torch.utils.checkpoint as torch_checkpoint
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.activation_checkpointing import checkpointing as ds_checkpointing

from .errors import ConfigError, UpstreamLimitError

__all__ = [
    "TORCH_RANGE", "DEEPSPEED_RANGE", "TORCH_VERSION", "DEEPSPEED_VERSION", "version_tuple",
    "CheckpointInternalHooks", "MARKS_CHECKPOINT_HOOKS", "CHECKPOINT_HOOKS_VISIBLE", "is_checkpoint_pack_hook",
    "push_hooks", "pop_hooks", "top_saved_tensors_hooks", "backward_keeps_graph", "STOP_RECOMPUTATION",
    "compiled_cuda_archs", "ALL_GATHER_SINGLE", "all_gather_single",
    "engine_inputs_require_grad", "resolve_use_reentrant", "DEEPSPEED_REENTRANT_RUNS_ON_CPU",
    "require_deepspeed_reentrant", "require_checkpoint_hooks", "unsupported_versions",
]

# [lowest, highest] minor versions tested (make compat); setup.py says the same.
TORCH_RANGE = ((2, 11), (2, 15))
DEEPSPEED_RANGE = ((0, 16), (0, 19))


def version_tuple(version: str) -> tuple[int, int, int]:
    """``"2.13.0+cpu"`` -> ``(2, 13, 0)``; missing or non-numeric parts are 0."""
    parts = [int(m.group()) if (m := re.match(r"\d+", p)) else 0 for p in version.split("+")[0].split(".")[:3]]
    return tuple(parts + [0] * (3 - len(parts)))  # type: ignore[return-value]


TORCH_VERSION = version_tuple(torch.__version__)
DEEPSPEED_VERSION = version_tuple(deepspeed.__version__)


def _range(bounds: tuple[tuple[int, int], tuple[int, int]]) -> str:
    (low, high) = bounds
    return f"{low[0]}.{low[1]} to {high[0]}.{high[1]}.x"


def unsupported_versions() -> list[str]:
    """The installed torch and DeepSpeed versions outside the tested range, as
    sentences (empty when both are inside it)."""
    problems = []
    for name, version, (low, high) in (("torch", TORCH_VERSION, TORCH_RANGE),
                                        ("deepspeed", DEEPSPEED_VERSION, DEEPSPEED_RANGE)):
        if not low <= version[:2] <= high:
            problems.append(f"{name} {'.'.join(map(str, version))} is outside the range ds_pipe_ckpt is tested "
                            f"with ({_range((low, high))})")
    return problems


# -- torch: the saved-tensor hooks stack ------------------------------------------------

# Push and pop a (pack, unpack) pair without a context manager (torch >= 2.0).
push_hooks: Callable[[Callable, Callable], None] = torch._C._autograd._push_saved_tensors_default_hooks
pop_hooks: Callable[[], None] = torch._C._autograd._pop_saved_tensors_default_hooks

_top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def _no_hooks(ignore_disabled: bool) -> None:  # a torch that cannot read the stack
    return None


# The pair on top of the stack, or None (called with False: ignore_disabled).
top_saved_tensors_hooks: Callable[[bool], tuple | None] = _top if _top is not None else _no_hooks

# The base class of pairs that torch's checkpoint treats as its own (records
# ``_user_hooks`` while on the stack): torch >= 2.14; a plain pair before.
CheckpointInternalHooks: type = getattr(torch_checkpoint, "_checkpoint_internal_hook",
                                        torch.autograd.graph.saved_tensors_hooks)
MARKS_CHECKPOINT_HOOKS = hasattr(torch_checkpoint, "_checkpoint_internal_hook")

# Before 2.14, torch's checkpoint pushes closures defined in these __init__s
# (the recomputation's wrapped by torch._dynamo.disable, which keeps the name).
_CHECKPOINT_PACK_HOOKS = frozenset({"_checkpoint_hook.__init__.<locals>.pack_hook",
                                    "_recomputation_hook.__init__.<locals>.pack_hook"})


def _named_as_torch_checkpoint_hook(pack: Any) -> bool:
    if getattr(pack, "__module__", None) != torch_checkpoint.__name__:
        return False
    if getattr(pack, "__qualname__", None) not in _CHECKPOINT_PACK_HOOKS:
        return False
    pack._checkpoint_internal = True  # found once per pair: later lookups read the mark
    return True


def is_checkpoint_pack_hook(pack: Any) -> bool:
    """Whether ``pack`` is the pack hook of one of torch checkpoint's own pairs
    (or a pair marked as such, :class:`ds_pipe_ckpt.hooks.TransparentHooks`)."""
    return getattr(pack, "_checkpoint_internal", False) or (
        not MARKS_CHECKPOINT_HOOKS and _named_as_torch_checkpoint_hook(pack))


def _checkpoint_hooks_visible() -> bool:
    """Whether, inside a region of torch's non-reentrant checkpoint, the pair on
    top of the stack is recognisably torch's: in the forward and in the recomputation."""
    seen: list[bool] = []

    def region(x: torch.Tensor) -> torch.Tensor:
        hooks = top_saved_tensors_hooks(False)
        seen.append(hooks is not None and is_checkpoint_pack_hook(hooks[0]))
        return x.sin()

    try:
        with torch.inference_mode(False), torch.enable_grad():
            x = torch.ones(1, device="cpu", requires_grad=True)
            torch_checkpoint.checkpoint(region, x, use_reentrant=False).sum().backward()
    except Exception:  # noqa: BLE001 - any failure means: cannot be seen
        return False
    return len(seen) == 2 and all(seen)


# Whether the recompute check and the planner's profiler can find torch's
# checkpoint hooks from inside a region (every supported torch: tested here).
CHECKPOINT_HOOKS_VISIBLE: bool = _checkpoint_hooks_visible()


def require_checkpoint_hooks(key: str, value: Any) -> None:
    """Raise a ``ConfigError`` naming ``key`` where the planner cannot measure
    layers on this torch (:data:`CHECKPOINT_HOOKS_VISIBLE` is False: a torch
    outside the tested range whose checkpoint hooks are not recognised)."""
    if CHECKPOINT_HOOKS_VISIBLE:
        return
    raise ConfigError(key, value, f"null with torch {torch.__version__}",
                      "The planner measures what each layer saves through torch checkpoint's saved-tensor "
                      "hooks, which ds_pipe_ckpt cannot recognise in this torch; use a torch in the tested "
                      f"range ({_range(TORCH_RANGE)}), or checkpoint uniformly "
                      "(pipeline.activation_checkpoint_interval).")


# torch raises this from its recomputation hook to stop a recomputation early
# (torch >= 2.1); it passes through the region's function on its way out.
STOP_RECOMPUTATION: type[BaseException] = getattr(torch_checkpoint, "_StopRecomputationError", type(None))


def backward_keeps_graph() -> bool | None:
    """Inside a backward: whether it keeps the graph (``retain_graph=True``).
    None outside a backward, and where this torch has no way to tell."""
    query = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    task = getattr(torch._C, "_current_graph_task_id", None)
    if query is None or task is None or task() == -1:
        return None
    return bool(query())


def compiled_cuda_archs() -> list[str]:
    """The CUDA architectures this torch was built for (``"sm_90"``, ...), with or
    without a visible GPU: what the CUDA ops are compiled for when nothing else
    says. ``torch.cuda.get_arch_list()`` returns them only with a GPU before
    torch 2.14 (empty on a build machine); torch's own flags hold them throughout.
    Empty for a CPU-only torch."""
    archs = torch.cuda.get_arch_list()
    if archs or torch.version.cuda is None:
        return archs
    flags = getattr(torch._C, "_cuda_getArchFlags", None)
    return (flags() or "").split() if flags is not None else []


# torch.distributed's gather of equal shards into one tensor: ``all_gather_single``
# from 2.14 (``all_gather_into_tensor`` became an alias that warns on every call),
# ``all_gather_into_tensor`` before.
ALL_GATHER_SINGLE = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"


def all_gather_single(output: torch.Tensor, shard: torch.Tensor, group: Any = None) -> Any:
    """Each rank's ``shard`` of ``group`` into ``output``, in rank order
    (:data:`ALL_GATHER_SINGLE`, looked up on each call)."""
    return getattr(dist, ALL_GATHER_SINGLE)(output, shard, group=group)


# -- DeepSpeed ------------------------------------------------------------------------

def engine_inputs_require_grad(engine: Any) -> bool:
    """Whether DeepSpeed's ``PipelineEngine`` makes the first stage's floating
    point inputs require grad (it does for its reentrant checkpoint)."""
    method = getattr(engine, "_reentrant_activation_checkpointing", None)
    if method is not None:  # DeepSpeed >= 0.19
        return bool(method())
    pipeline = engine._config.pipeline
    return pipeline.get("activation_checkpoint_interval", 0) > 0 and bool(pipeline.get("use_reentrant", True))


def resolve_use_reentrant(module: Any, param_dict: Any) -> None:
    """Give a pipeline ``module`` the checkpoint function ``pipeline.use_reentrant``
    asks for, as DeepSpeed 0.19's engine does whatever the interval. Before 0.19
    the engine did so only when the JSON config set
    ``pipeline.activation_checkpoint_interval`` above 0, so a module built with
    its own interval (or planned, interval 0) kept the reentrant checkpoint
    under ``"use_reentrant": false``. Called by ``ds_pipe_ckpt.initialize``
    after ``deepspeed.initialize``; a no-op on DeepSpeed 0.19 and later."""
    if DEEPSPEED_VERSION[:2] >= (0, 19) or not isinstance(param_dict, dict):
        return
    if (param_dict.get("pipeline") or {}).get("use_reentrant") is not False:
        return
    if module.activation_checkpoint_func is not ds_checkpointing.non_reentrant_checkpoint:
        module.activation_checkpoint_func = ds_checkpointing.non_reentrant_checkpoint
        if module.activation_checkpoint_interval > 0:  # which segments are checkpointable depends on it
            module._precompute_checkpointable_values()


# DeepSpeed's reentrant checkpoint on the CPU accelerator: before 0.19 it calls
# the accelerator's (absent) stream and fails with a TypeError.
DEEPSPEED_REENTRANT_RUNS_ON_CPU = DEEPSPEED_VERSION[:2] >= (0, 19)


def deepspeed_reentrant_runs() -> bool:
    """Whether DeepSpeed's own reentrant checkpoint can run on this DeepSpeed and
    accelerator: from 0.19 anywhere, before it only on an accelerator with streams."""
    return DEEPSPEED_REENTRANT_RUNS_ON_CPU or get_accelerator().Stream is not None


def require_deepspeed_reentrant() -> None:
    """Raise :class:`~ds_pipe_ckpt.UpstreamLimitError` where DeepSpeed's reentrant
    checkpoint cannot run: before 0.19, on an accelerator without streams (the
    CPU), it fails inside with ``TypeError: 'NoneType' object is not callable``."""
    if deepspeed_reentrant_runs():
        return
    accelerator = get_accelerator()
    raise UpstreamLimitError(
        f"DeepSpeed {deepspeed.__version__}'s reentrant checkpoint cannot run on the {accelerator.device_name()} "
        "accelerator: it asks the accelerator for a stream and this one has none (DeepSpeed fixed it in 0.19). "
        "Set pipeline.use_reentrant to false (or pass use_reentrant=False) to use torch's non-reentrant "
        "checkpoint, which runs anywhere, or upgrade DeepSpeed to 0.19.")
