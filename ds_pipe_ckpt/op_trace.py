"""``activation_checkpointing.verify_recompute``: a region's forward is
recorded op by op (every op, also those that save nothing, with its output
shapes, dtypes and devices) under a ``TorchDispatchMode``, and its
recomputation is compared with it op by op. A Python call per op; the
recomputation then runs to the end. Values are not compared.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .recompute import mismatch
from .regions import Region

__all__ = ["OpTrace"]


def _tensor_meta(out: Any) -> tuple:
    return tuple((tuple(t.shape), t.dtype, t.device) for t in tree_leaves(out) if isinstance(t, torch.Tensor))


def _describe_op(op: tuple | None) -> str:
    if op is None:
        return "nothing"
    name, meta = op
    outputs = ", ".join(f"{list(shape)} {str(dtype).replace('torch.', '')} on {device}"
                        for shape, dtype, device in meta) or "no tensor"
    return f"{name} -> {outputs}"


# torch's checkpoint detaches tensors it saves during recomputation (not during
# the forward); those detaches are its own, not the region's.
_IGNORED_OPS = frozenset({torch.ops.aten.detach.default})


class OpTrace(TorchDispatchMode):
    """Records a forward's op sequence, then checks a recomputation against it."""

    def __init__(self, region: Region):
        super().__init__()
        self.region = region
        self.recorded: list[tuple] = []
        self.position: int | None = None  # None while recording

    @contextlib.contextmanager
    def replaying(self) -> Iterator[None]:
        self.position = 0
        with self:
            yield
        if self.position < len(self.recorded):
            raise mismatch(self.region, (
                f"it ran {self.position} ops where the forward ran {len(self.recorded)} (a shorter path); "
                f"first op not reproduced: #{self.position} {_describe_op(self.recorded[self.position])}."))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _IGNORED_OPS:
            return out
        op = (str(func), _tensor_meta(out))
        if self.position is None:
            self.recorded.append(op)
            return out
        expected = self.recorded[self.position] if self.position < len(self.recorded) else None
        if op != expected:
            extra = " (a longer path)" if expected is None else ""
            raise mismatch(self.region, (
                f"op #{self.position} differs{extra}: forward ran {_describe_op(expected)}, "
                f"recomputation ran {_describe_op(op)}."))
        self.position += 1
        return out
