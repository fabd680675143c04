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
:func:`push_hooks` and :func:`pop_hooks` (from :mod:`ds_pipe_ckpt.compat`) directly (no context manager) and
follows the same protocol by hand: its pack hook carries the mark, and its
``_user_hooks`` is the pair's below it (:func:`top_hooks`) while it is on the
stack and None after (the saved tensors keep the pack hook alive until the
backward; it must not keep the user's hooks alive with it).

On a torch without that protocol (before 2.14) these are plain
``saved_tensors_hooks``; selective checkpointing there ignores every hook, and
torch's own pairs are recognised by name (:mod:`ds_pipe_ckpt.compat`).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from .compat import CheckpointInternalHooks, is_checkpoint_pack_hook, top_saved_tensors_hooks

__all__ = ["TransparentHooks", "top_hooks"]


class TransparentHooks(CheckpointInternalHooks):
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
    if hooks is None or not is_checkpoint_pack_hook(hooks[0]):
        return None
    return hooks
