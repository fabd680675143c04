"""The inputs a checkpointed region is recomputed from.

torch's non-reentrant checkpoint saves a region's tensor inputs before running
it and recomputes the region from them in backward. Two things can make those
inputs differ from what the forward started from, and both are handled here,
in saved-tensor hooks that see the region's inputs and nothing else
(:class:`SavedInputs`, one per checkpoint call, around torch's):

* **The region modifies an input in place during its forward** (a model that
  starts a layer with ``nn.ReLU(inplace=True)``, ``x.mul_(scale)``, ...). The
  recomputation must start from the values before the modification, so such a
  region gets a private copy of each input it modifies, taken before its
  forward runs. Which inputs a region modifies is learned on its first call:
  that call copies every tensor input and keeps the copies of those it
  modified (the others are dropped when the forward ends); later calls copy
  only those. The forward itself runs on the caller's tensors, so the
  modification is seen by the caller exactly as without checkpointing.
* **Something modifies a saved input in place after the forward and before
  the recomputation** (a later layer's in-place op on a tensor the region
  received and passed on). The recomputation would silently compute different
  gradients; it raises :class:`~ds_pipe_ckpt.InPlaceInputError` naming the
  region instead (tensors' version counters tell).

With ``partition_activations``, ``cpu_checkpointing`` or
``contiguous_memory_optimization`` the inputs are then handed, when the
forward has ended, to the region's
:class:`~ds_pipe_ckpt.placement.runtime.RegionPlacement`, which copies them
(shards, host memory, pooled buffers): later in-place changes cannot reach
those copies.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import InPlaceInputError
from .hooks import TransparentHooks
from .placement.runtime import RegionPlacement
from .recompute import modified_input
from .regions import Region

__all__ = ["SavedInputs", "unexpected_modification"]


def unexpected_modification(region: Region, positions: list[int]) -> InPlaceInputError:
    """The error for a region that modified inputs in place during a forward
    although its first call did not: no copy of their values was kept."""
    return InPlaceInputError(
        f"Checkpointed {region} modified its tensor input(s) {positions} in place during its forward, which "
        "its first call did not do, so no copy of the values it started from was kept and it cannot be "
        "recomputed. Make the in-place op out-of-place (e.g. nn.ReLU(inplace=False), x = x * s instead of "
        "x.mul_(s)), or modify the input in place on every call, not only on some.")


@dataclass(eq=False)
class _Input:
    tensor: torch.Tensor | None  # the caller's tensor (None once a placement holds a copy)
    version: int  # its version when saved, or after the forward for a private copy
    private: torch.Tensor | None = None  # the copy taken before the forward, if any
    index: int = -1  # the placement's index, when it holds the input


class SavedInputs(TransparentHooks):
    """Saved-tensor hooks around one ``torch.utils.checkpoint`` call (see the
    module docstring). Entering starts the region's placement (if any); a
    normal exit means the forward has ended: modifications are checked, facts
    learned, and the inputs handed to the placement."""

    def __init__(self, region: Region, placement: RegionPlacement | None):
        self._region = region
        self._placement = placement
        self._inputs: list[_Input] = []
        facts = region.facts
        copy_all = not facts.learned
        copy = facts.mutated_inputs or frozenset()
        inputs = self._inputs

        def pack(tensor: torch.Tensor) -> int:
            position = len(inputs)
            private = tensor.detach().clone() if copy_all or position in copy else None
            inputs.append(_Input(tensor, tensor._version, private))
            return position

        super().__init__(pack, self._unpack)

    def __enter__(self) -> "SavedInputs":
        if self._placement is not None:
            self._placement.begin_forward(str(self._region))
        return super().__enter__()

    def __exit__(self, exc_type, exc, tb) -> None:
        super().__exit__(exc_type, exc, tb)
        # The saved tensors hold the hooks from here on; this object must not hold
        # them too (its unpack hook is a bound method of it): that cycle would keep
        # the inputs alive until the garbage collector runs, not until the graph is freed.
        self.pack_hook = self.unpack_hook = None
        if exc_type is None and self._inputs:
            self._forward_ended()
        if self._placement is not None and exc_type is None:
            self._placement.end_forward()

    def _forward_ended(self) -> None:
        facts = self._region.facts
        modified = [i for i, entry in enumerate(self._inputs) if entry.tensor._version != entry.version]
        unrecoverable = [i for i in modified if self._inputs[i].private is None]
        if unrecoverable:
            raise unexpected_modification(self._region, unrecoverable)
        if not facts.learned:
            facts.mutated_inputs = frozenset(modified)
        for i, entry in enumerate(self._inputs):
            if i in modified:
                entry.tensor = None  # the recomputation starts from the copy
                entry.version = entry.private._version  # which must reach it untouched
            else:
                entry.private = None
        if self._placement is not None and self._placement.holds_inputs:
            kept = [entry.private if entry.private is not None else entry.tensor for entry in self._inputs]
            for entry, index in zip(self._inputs, self._placement.store(kept)):
                entry.tensor = entry.private = None
                entry.index = index

    def _unpack(self, position: int) -> torch.Tensor:
        entry = self._inputs[position]
        if entry.index >= 0:
            return self._placement.unpack(entry.index)
        if entry.private is not None:
            if entry.private._version != entry.version:
                raise InPlaceInputError(
                    f"Checkpointed {self._region} modifies its tensor input {position} in place and has "
                    "already been recomputed from its private copy of it once; backpropagating through "
                    "it a second time (retain_graph=True) would start from modified values. Make its "
                    "in-place op out-of-place to backpropagate twice.")
            return entry.private
        tensor = entry.tensor
        if tensor._version != entry.version:
            raise modified_input(self._region, f"version {entry.version} -> {tensor._version}")
        return tensor
