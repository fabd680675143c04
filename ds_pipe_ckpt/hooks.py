"""Saved-tensor hooks that stay out of the way of torch's checkpoint.

ds_pipe_ckpt puts two kinds of ``torch.autograd.graph.saved_tensors_hooks``
around or inside torch's non-reentrant checkpoint: one that holds a region's
inputs (:mod:`ds_pipe_ckpt.inputs`) and one that watches what the region saves
(:mod:`ds_pipe_ckpt.recompute`). Neither is a *user's* hook. torch's
selective checkpointing looks for the user's hooks (to route the tensors it
caches through them, e.g. ``save_on_cpu``) by walking past its own internal
hooks; it recognises them by a ``_checkpoint_internal`` mark on the pack
function and follows the ``_user_hooks`` each records while on the stack.
:class:`TransparentHooks` carries the same mark, so selective checkpointing
sees through ours to the hooks the user really installed (and warns, or not,
exactly as it would without ds_pipe_ckpt).

The recompute check pushes its pair on every checkpointed call, so it uses
:func:`push_hooks` and :func:`pop_hooks` directly (no context manager) and
follows the same protocol by hand: its pack hook carries the mark, and its
``_user_hooks`` is the pair's below it (:func:`top_hooks`) while it is on the
stack and None after (the saved tensors keep the pack hook alive until the
backward; it must not keep the user's hooks alive with it).

On a torch without that protocol (before 2.14) these are plain
``saved_tensors_hooks``; selective checkpointing there ignores every hook.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.utils.checkpoint as torch_checkpoint

__all__ = ["TransparentHooks", "top_hooks", "top_saved_tensors_hooks", "push_hooks", "pop_hooks",
           "CAN_SEE_CHECKPOINT_HOOKS"]

# The base that records ``_user_hooks`` while on the stack (torch >= 2.14).
_Base = getattr(torch_checkpoint, "_checkpoint_internal_hook", torch.autograd.graph.saved_tensors_hooks)

# The saved-tensor hooks stack (what saved_tensors_hooks enters and exits).
push_hooks: Callable[[Callable, Callable], None] = torch._C._autograd._push_saved_tensors_default_hooks
pop_hooks: Callable[[], None] = torch._C._autograd._pop_saved_tensors_default_hooks
_top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def _no_hooks(ignore_disabled: bool) -> None:  # a torch that cannot read the stack
    return None


# The pair on top of the stack, or None: what top_hooks() reads (called with
# False; inline where a call matters).
top_saved_tensors_hooks: Callable[[bool], tuple | None] = _top if _top is not None else _no_hooks
# Whether top_hooks() can see torch checkpoint's pair from inside a region: the
# stack can be read and torch marks its pairs (the protocol above, torch >= 2.14).
CAN_SEE_CHECKPOINT_HOOKS = _top is not None and hasattr(torch_checkpoint, "_checkpoint_internal_hook")


class TransparentHooks(_Base):
    """``saved_tensors_hooks(pack, unpack)`` that torch's checkpoint treats as its own.

    ``pack`` must take attributes: a function object (a closure or a plain
    function, not a bound method), on which the mark is set, or an object that
    carries the mark already and has a ``_user_hooks`` attribute slot.
    """

    def __init__(self, pack: Callable[[torch.Tensor], Any], unpack: Callable[[Any], torch.Tensor]):
        if not getattr(pack, "_checkpoint_internal", False):
            pack._checkpoint_internal = True
        super().__init__(pack, unpack)


def top_hooks() -> tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]] | None:
    """The (pack, unpack) pair that a tensor saved right now would go through,
    if it is one of torch checkpoint's internal pairs; otherwise None (no
    checkpoint is running here, or this torch cannot tell)."""
    hooks = top_saved_tensors_hooks(False)
    if hooks is None or not getattr(hooks[0], "_checkpoint_internal", False):
        return None
    return hooks
