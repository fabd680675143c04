"""Recompute safety: a checkpointed region whose recomputation diverges from
its forward fails with an error that names the region, the micro-batch and
the first tensor (or, with ``verify_recompute``, the op) that differs; never
with silently different gradients.

What decides the gradients of a checkpointed region is the tensors its
recomputation saves for backward: the backward runs through the forward's own
autograd graph and only takes those tensors from the recomputation. So that
is what is checked, always, at the cost of a Python call per saved tensor in the
forward and in each recomputation (the largest part of the per-call cost on
small regions: docs/performance.md):

* :class:`SavedTensorProbe` stands in front of torch checkpoint's own
  saved-tensor hooks, in the forward and in the recomputation, and records
  for every saved tensor where it comes from (an input of the region, the op
  behind its autograd node, or no autograd history) with its shape, dtype and
  device (a superset of torch's own "default" check, which is then not asked
  for: :func:`torch_determinism_check`).
  torch's early stop stays on: the recomputation ends when it has rebuilt as
  many tensors as the forward saved, and the sequence it built is compared
  with the forward's. A recomputation that finishes having saved fewer (a
  lazily built cache, a shorter path, a fused op that saves less when it
  recomputes) or saves different ones (another op, another shape) is named.
  Ops after the last saved tensor do not affect gradients; they are only run,
  and compared, with ``early_stop`` false.
* Every ``CheckpointError`` torch raises while the region is recomputed or its
  saved tensors are unpacked (the count and metadata checks in its unpack
  hook, "trying to save more tensors") passes through the probe and reaches
  the user as :class:`~ds_pipe_ckpt.RecomputeMismatchError` naming the region.
* ``activation_checkpointing.verify_recompute`` (or ``verify=True``): every op
  (also those that save nothing) is recorded with its output shapes, dtypes
  and devices by a ``TorchDispatchMode`` and the recomputation is compared op
  by op (:class:`~ds_pipe_ckpt.op_trace.OpTrace`). A Python call per op; the
  recomputation then runs to the end.

Neither compares values: an op that returns different numbers with the same
shapes on recomputation (randomness outside torch's and DeepSpeed's
generators) cannot be seen without keeping what checkpointing exists to free.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch.utils._pytree import tree_leaves

from .errors import InPlaceInputError, RecomputeMismatchError
from .compat import (CHECKPOINT_HOOKS_VISIBLE, STOP_RECOMPUTATION, is_checkpoint_pack_hook, pop_hooks, push_hooks,
                     top_saved_tensors_hooks)
from .regions import Region

__all__ = ["SavedTensorProbe", "mismatch", "renamed", "require_tensor_output",
           "STOP_RECOMPUTATION", "torch_determinism_check"]

CAUSES = (
    "Usual causes: an op whose saved tensors depend on torch.is_grad_enabled() or on "
    "requires_grad (fused kernels, e.g. xformers SwiGLU); state or caches filled on the "
    "first call (lazy init, a cached function of a parameter such as w / w.norm(), memoised masks); "
    "data-dependent shapes or control flow; randomness that does not come from torch's generators "
    "or DeepSpeed's model-parallel RNG tracker.")
FIXES = (
    "Fixes: exclude the layer from checkpointing with PipelineModule(checkpointable_layers=[...]) "
    "(or do not wrap it in checkpoint()); compute caches of parameters outside the checkpointed "
    "region, or on every call; make the op deterministic between calls; to find the op, set "
    "\"activation_checkpointing\": {\"verify_recompute\": true} (or checkpoint(..., verify=True)), "
    "and \"debug\": true for torch's op traces with stacks.")


def mismatch(region: Region, problem: str) -> RecomputeMismatchError:
    """The error for a recomputation of ``region`` that diverged as ``problem`` says."""
    return RecomputeMismatchError(
        f"Recomputation of checkpointed {region} diverged from its forward: {problem}\n{CAUSES}\n{FIXES}")


def _first_line(error: BaseException) -> str:
    return str(error).strip().split("\n")[0].removeprefix("torch.utils.checkpoint: ")


# The end of the RuntimeError torch's selective checkpointing raises when a
# recomputation runs an op the forward did not (torch >= 2.5).
_SELECTIVE_MISMATCH = getattr(torch_checkpoint, "_SAC_MISMATCH_MSG", None)


# What torch's autograd says when a tensor it saved was modified in place since.
_INPUT_MODIFIED = "modified by an inplace operation"


def modified_input(region: Region, detail: str) -> InPlaceInputError:
    """The error for an input of ``region`` modified in place after its forward."""
    return InPlaceInputError(
        f"The input of checkpointed {region} was modified in place after its forward ({detail}), before it "
        "was recomputed; the recomputation would see different values. Typically a later layer changes, in "
        "place, a tensor this region received and passed on. Make that op out-of-place (e.g. inplace=False, "
        "x = x + y instead of x += y) or clone the tensor first.")


def renamed(region: Region, error: BaseException) -> RecomputeMismatchError | None:
    """The :class:`RecomputeMismatchError` naming ``region`` that stands for one
    of torch's recomputation errors (a ``CheckpointError``, or selective
    checkpointing's mismatch), or None for any other error."""
    if isinstance(error, RecomputeMismatchError):
        return None
    if isinstance(error, torch_checkpoint.CheckpointError):
        return mismatch(region, _first_line(error))
    if isinstance(error, RuntimeError) and _SELECTIVE_MISMATCH is not None and _SELECTIVE_MISMATCH in str(error):
        return mismatch(region, f"(selective checkpointing) {_first_line(error)}")
    return None


def torch_determinism_check(determinism_check: str, *, torch_contexts: bool) -> str:
    """The ``determinism_check`` to pass to torch's checkpoint for a call with
    ``determinism_check`` (see the module docstring); ``torch_contexts``: the
    call runs under torch's own context managers only (no caller's ``context_fn``).

    torch's "default" check describes every tensor the recomputation saves by
    shape, dtype and device, and compares them with the forward's; the probe
    compares those and where each tensor comes from. Where the probe is sure
    to run (torch's hooks are visible from inside the region, and no caller's
    context manager can put hooks in front of them) torch is asked for "none",
    so that each saved tensor is described once; its count check stays."""
    if determinism_check == "default" and torch_contexts and CHECKPOINT_HOOKS_VISIBLE:
        return "none"
    return determinism_check


# -- what a saved tensor is --------------------------------------------------------------

# A saved tensor's origin: an input of the region (which one is not recorded: a
# tensor passed twice arrives as one object in the forward and as two in the
# recomputation), the class of its autograd node, or, for a leaf, whether it
# requires grad (a parameter; or a constant, a tensor computed without grad).
_INPUT = "input"


def _describe_saved(entry: tuple | None, device: bool = False) -> str:
    if entry is None:
        return "nothing"
    origin, shape, dtype, where = entry
    if origin == _INPUT:
        what = "an input of the region"
    elif origin is True:
        what = "a leaf that requires grad (e.g. a parameter)"
    elif origin is False:
        what = "a tensor without autograd history (a constant, or computed without grad)"
    else:
        what = f"the output of the op recorded as {origin}"
    on = f" on {where}" if device else ""
    return f"{what}, {list(shape)} {str(dtype).removeprefix('torch.')}{on}"


_FIELDS = 4  # per saved tensor in a record: origin, shape, dtype, device

# Autograd nodes of one op under two names. ``reshape`` of a tensor it can alias
# records ``_reshape_alias``, or ``view`` while a TorchDispatchMode is active
# (ATen then takes its subclass-safe path): the same alias of the same values.
# The planner's measuring step runs a recomputation under such a mode and not
# its forward; a user's mode (a profiler, a FLOP counter) may do the same.
_SAME_OP = {"ReshapeAliasBackward0": "ViewBackward0"}


def _entries(record: list) -> list[tuple]:
    """A flat record (origin, shape, dtype, device, origin, ...) as one tuple per
    saved tensor, an autograd node's class as its name, one name per op (:data:`_SAME_OP`)."""
    entries = []
    for i in range(0, len(record), _FIELDS):
        origin = record[i]
        if isinstance(origin, type):
            origin = _SAME_OP.get(origin.__name__, origin.__name__)
        entries.append((origin, *record[i + 1:i + _FIELDS]))
    return entries


def _unpack(torch_unpack: Callable[[Any], torch.Tensor], region: Region, handle: Any) -> torch.Tensor:
    """The forward's unpack hook (bound to its first two arguments): torch
    checkpoint's own, with its errors renamed to name the region (torch
    recomputes the region inside its unpack hook and checks the result there,
    outside the region's function)."""
    try:
        return torch_unpack(handle)
    except (InPlaceInputError, RecomputeMismatchError):
        raise
    except torch_checkpoint.CheckpointError as error:
        if isinstance(error.__cause__, RecomputeMismatchError):
            # torch's debug mode wrapped ours: keep our message, add its op traces.
            raise RecomputeMismatchError(f"{error.__cause__}\n\ntorch's debug report:\n{error}") from error
        raise mismatch(region, _first_line(error)) from error
    except RuntimeError as error:
        if _INPUT_MODIFIED in str(error):  # autograd's version check of a saved input
            raise modified_input(region, _first_line(error)) from error
        raise


class SavedTensorProbe:
    """Watches the tensors one checkpointed call of a region saves for backward
    (see the module docstring).

    :meth:`run_forward` runs the forward, :meth:`run_recomputation` each
    recomputation; both push the probe itself, as the pack hook, in front of
    the pair torch's checkpoint has just pushed (marked as torch's own, see
    :mod:`ds_pipe_ckpt.hooks`): it records each saved tensor and hands it on
    to torch's pack hook. The forward's unpack hook renames torch's errors
    (:func:`_unpack`). One slotted object per call serves as probe and pack
    hook: the saved tensors keep the forward's pack hook alive until the
    backward, and every object alive per region until then is work for the
    garbage collector.
    """

    # _user_hooks: set while the probe is on the hooks stack (ds_pipe_ckpt.hooks)
    __slots__ = ("region", "compare", "forward_saved", "_torch_pack", "_input_ids", "_saved", "_user_hooks")
    _checkpoint_internal = True  # see ds_pipe_ckpt.hooks

    def __init__(self, region: Region, *, compare: bool = True):
        self.region = region
        self.compare = compare  # False (determinism_check="none"): only name torch's own errors
        # What the forward saved, flat: (origin, shape, dtype, device) for each tensor, in order
        # (a flat list of plain values: fewer objects alive until the backward).
        self.forward_saved: list | None = None
        # While a run is in progress: torch's pack hook, the ids of the run's
        # tensor inputs, the record being built.
        self._torch_pack = self._input_ids = self._saved = self._user_hooks = None

    def __call__(self, tensor: torch.Tensor) -> Any:
        """The pack hook: record ``tensor``, then hand it to torch's."""
        if id(tensor) in self._input_ids:
            origin = _INPUT
        else:
            node = tensor.grad_fn
            origin = type(node) if node is not None else tensor.requires_grad
        # A plain tuple, not the torch.Size: the collector untracks a tuple of ints,
        # so it is never promoted to the old generation while the region is in flight.
        self._saved += (origin, tuple(tensor.shape), tensor.dtype, tensor.device)
        return self._torch_pack(tensor)

    def run_forward(self, run: Callable[..., Any], args: tuple) -> Any:
        """``run(*args)``, the forward, recording what it saves."""
        hooks = top_saved_tensors_hooks(False)
        if hooks is None or not is_checkpoint_pack_hook(hooks[0]):
            return run(*args)  # not under a checkpoint (grad disabled): nothing is saved
        torch_pack = hooks[0]
        unpack = functools.partial(_unpack, hooks[1], self.region)  # built in C: no __init__ frame
        if not self.compare:  # torch's own pack hook (it carries the mark and its _user_hooks)
            push_hooks(torch_pack, unpack)
            try:
                return run(*args)
            finally:
                pop_hooks()
        # Set up here and in run_recomputation rather than in a helper: a call, on every call.
        # The ids of all arguments: a saved tensor cannot share one with a live non-tensor.
        saved: list = []
        self._torch_pack, self._input_ids, self._saved = torch_pack, set(map(id, args)), saved
        self._user_hooks = getattr(torch_pack, "_user_hooks", None)
        push_hooks(self, unpack)
        try:
            out = run(*args)
        finally:
            pop_hooks()
            # The saved tensors keep the probe alive until the backward; through it they
            # must not keep torch's hook (a cycle back to torch's frame) or the user's hooks.
            self._torch_pack = self._input_ids = self._saved = self._user_hooks = None
        self.forward_saved = saved
        return out

    def run_recomputation(self, run: Callable[..., Any], args: tuple) -> Any:
        """``run(*args)``, a recomputation, checked against the forward."""
        forward = self.forward_saved
        hooks = top_saved_tensors_hooks(False) if forward is not None else None  # None: the forward recorded nothing
        if hooks is None or not is_checkpoint_pack_hook(hooks[0]):
            return run(*args)
        torch_pack = hooks[0]
        saved: list = []
        self._torch_pack, self._input_ids, self._saved = torch_pack, set(map(id, args)), saved
        self._user_hooks = getattr(torch_pack, "_user_hooks", None)
        push_hooks(self, hooks[1])  # torch's own unpack hook: it raises nothing
        try:
            try:
                out = run(*args)
            finally:
                pop_hooks()
                self._torch_pack = self._input_ids = self._saved = self._user_hooks = None
        except STOP_RECOMPUTATION:
            # torch stopped it once it had rebuilt as many tensors as the forward saved.
            if saved != forward:
                self._compare(saved, finished=False)
            raise
        except torch_checkpoint.CheckpointError as error:  # e.g. more tensors than the forward saved
            if isinstance(error, RecomputeMismatchError):
                raise
            self._compare(saved, finished=False, cause=error)
            raise mismatch(self.region, _first_line(error)) from error
        if saved != forward:
            self._compare(saved, finished=True)
        return out

    def _compare(self, recomputed: list, *, finished: bool, cause: BaseException | None = None) -> None:
        forward = self.forward_saved
        # Finished: it must have saved exactly what the forward saved (with early
        # stop on, finishing at all means it saved fewer). Stopped: what it saved
        # so far must be the forward's first tensors.
        if recomputed == (forward if finished else forward[:len(recomputed)]):
            return
        forward, recomputed = _entries(forward), _entries(recomputed)
        if recomputed == (forward if finished else forward[:len(recomputed)]):
            return  # the same ops, one recorded under another name
        i = next((i for i, (a, b) in enumerate(zip(forward, recomputed)) if a != b),
                 min(len(forward), len(recomputed)))
        if i < len(recomputed) and i < len(forward):
            device = forward[i][:-1] == recomputed[i][:-1]  # they differ only by device: name it
            problem = (f"saved tensor #{i} differs: the forward saved {_describe_saved(forward[i], device)}; "
                       f"the recomputation saved {_describe_saved(recomputed[i], device)}.")
        elif i >= len(recomputed):
            problem = (f"the recomputation finished having saved {len(recomputed)} tensor(s) for backward where "
                       f"the forward saved {len(forward)} (a shorter path); the first one it did not save: "
                       f"#{i}, {_describe_saved(forward[i])}.")
        else:
            problem = (f"the recomputation saved more tensors than the forward's {len(forward)} (a longer "
                       f"path); the first extra one: #{i}, {_describe_saved(recomputed[i])}.")
        error = mismatch(self.region, problem)
        raise error from cause


def require_tensor_output(out: Any, region: Region) -> None:
    """Refuse a region that returns no tensor: nothing could flow back through it."""
    if isinstance(out, torch.Tensor):  # the common case, on every call
        return
    if not any(isinstance(t, torch.Tensor) for t in tree_leaves(out)):
        raise TypeError(f"Checkpointed {region} returned no tensor ({type(out).__name__}): there is "
                        "nothing to recompute and no gradient can flow through it. Call it without "
                        "checkpointing, or return the tensors it computes.")

