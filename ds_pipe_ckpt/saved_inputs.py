"""Whether a region saves only its inputs: its first checkpointed call learns
whether its forward saves for backward anything beyond its inputs and its
modules' parameters and buffers (``RegionFacts.saves_only_inputs``).

A region that saves nothing else (a token embedding, a position table, a tied
LM head, a cast) frees no memory by being checkpointed;
:mod:`~ds_pipe_ckpt.segment_choice` then runs it plainly. This module only
learns the fact; it must not change what the probe it extends checks.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from .recompute import SavedTensorProbe
from .regions import Region

__all__ = ["SavedTensorLearner"]


def _storage(tensor: torch.Tensor) -> int | None:
    """The address of the memory ``tensor`` views, or None where it has none to
    compare (a tensor subclass without storage)."""
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


class SavedTensorLearner(SavedTensorProbe):
    """The probe of a region's first checkpointed call: as
    :class:`SavedTensorProbe`, and it learns whether the forward saves anything
    for backward beyond its inputs and its modules' parameters and buffers
    (``RegionFacts.saves_only_inputs``).

    A saved tensor counts as an input or a parameter when it is one (by
    identity, or a leaf that requires grad), is a view of one, or uses the
    same memory as one of them or of the region's modules' buffers:
    ``F.linear`` on a ``[B, T, d]`` input saves a reshaped view of it and of
    the weight's transpose. Whatever else it saves (an activation, a dropout
    mask, a norm's statistics) is memory that checkpointing frees.
    """

    __slots__ = ("_other",)

    def __init__(self, region: Region, *, compare: bool = True):
        super().__init__(region, compare=compare)
        self._other: list | None = None  # while the forward runs: the saved tensors not known as inputs

    def __call__(self, tensor: torch.Tensor) -> Any:
        other = self._other  # None in a recomputation
        if other is not None and not self._known(tensor):
            base = tensor._base  # a view: of an input or a parameter, it holds no memory of its own
            if base is None or not self._known(base):
                other.append(_storage(tensor))
        return super().__call__(tensor)

    def _known(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is an input of the region or a leaf that requires grad (a parameter)."""
        return id(tensor) in self._input_ids or (tensor.grad_fn is None and tensor.requires_grad)

    def learn_forward(self, run: Callable[..., Any], args: tuple, modules: Any) -> Any:
        """:meth:`run_forward`, recording what it saves even where this call's
        recomputation is not compared, then noting on the region's facts whether
        it saved only ``args`` and ``modules``' parameters and buffers
        (``modules``: a callable that returns them, called only when needed)."""
        compare, self.compare, self._other = self.compare, True, []
        try:
            out = self.run_forward(run, args)
        finally:
            self.compare, other, self._other = compare, self._other, None
        if self.forward_saved is None:  # not under torch's checkpoint hooks: nothing seen
            return out
        if not compare:
            self.forward_saved = None
        if other:
            known = {_storage(t) for t in args if isinstance(t, torch.Tensor)}
            for module in modules():
                known.update(_storage(t) for t in module.parameters())
                known.update(_storage(t) for t in module.buffers())
            known.discard(None)
            self.region.facts.saves_only_inputs = all(address in known for address in other)
        else:
            self.region.facts.saves_only_inputs = True
        return out
