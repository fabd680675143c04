"""Micro-batches of variable length (``PipelineModule(dynamic_shape=True)``):
the lengths a stage plans for.

With ``dynamic_shape=True`` DeepSpeed's engine sends every micro-batch's
shapes, so that fine-tuning can pad each micro-batch to its own longest
sample. A memory budget must then hold for every length up to the longest the
data can give, which the user declares:
``activation_checkpointing.max_sequence_length`` (and ``sequence_dim``, the
dimension of the stage's tensors that holds the sequence: 1 for batch-first
``[batch, sequence, ...]``, 0 for Megatron's ``[sequence, batch, ...]``).

The lengths from 1 to the maximum are cut into ``length_buckets`` equal
buckets (:data:`LENGTH_BUCKETS` by default; 1 plans once, for the longest). Each bucket is planned once, for its longest length (its *edge*),
from the stage's layers measured at that very length: activations grow
linearly with the length in most layers and quadratically in eager
attention, and measuring at each edge assumes neither, only that a layer
keeps no more for a shorter micro-batch than for a longer one. A micro-batch
follows the plan of the bucket its length falls in.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
import torch.nn.functional as F

from ..config import LENGTH_BUCKETS, LENGTH_BUCKETS_ALLOWED, SECTION, SEQUENCE_DIM_ALLOWED, require_int
from ..errors import ConfigError

__all__ = ["SequenceLengths", "LENGTH_BUCKETS"]  # LENGTH_BUCKETS: config's, the default

MAX_LENGTH_KEY = f"{SECTION}.max_sequence_length"
DIM_KEY = f"{SECTION}.sequence_dim"


@dataclass(frozen=True)
class SequenceLengths:
    """The micro-batch lengths a stage plans for: up to ``max_length`` along
    ``dim`` of its tensors, in ``buckets`` buckets."""

    max_length: int
    dim: int = 1
    buckets: int = LENGTH_BUCKETS

    def __post_init__(self) -> None:
        require_int(MAX_LENGTH_KEY, self.max_length, 1, "a positive integer (tokens)")
        require_int(DIM_KEY, self.dim, 0, SEQUENCE_DIM_ALLOWED)
        require_int(f"{SECTION}.length_buckets", self.buckets, 1, LENGTH_BUCKETS_ALLOWED)

    @cached_property
    def edges(self) -> tuple[int, ...]:
        """The longest length of each bucket, ascending; the last is ``max_length``."""
        count = min(self.buckets, self.max_length)
        return tuple(sorted({-(-self.max_length * i // count) for i in range(1, count + 1)}))

    def length_of(self, inputs: tuple, where: str) -> int:
        """The sequence length of a stage's inputs: the size along ``dim`` of
        their first tensor that has that dimension.

        Raises:
            ConfigError: no input tensor has ``dim + 1`` dimensions (``where`` names the stage).
        """
        for value in inputs:
            if isinstance(value, torch.Tensor) and value.dim() > self.dim:
                return int(value.shape[self.dim])
        shapes = [tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__ for v in inputs]
        raise ConfigError(DIM_KEY, self.dim, f"a dimension of {where}'s input tensors (shapes {shapes})",
                          "It says which dimension of the tensors a stage receives holds the sequence.")

    def edge_for(self, length: int, where: str) -> int:
        """The edge of the bucket ``length`` falls in.

        Raises:
            ConfigError: ``length`` is above ``max_length`` (``where`` names the stage and micro-batch).
        """
        if length > self.max_length:
            raise ConfigError(MAX_LENGTH_KEY, self.max_length,
                              f"at least the length of every micro-batch: {where} received one of {length} "
                              f"along dimension {self.dim}",
                              "The memory budget is planned for micro-batches up to that length; this one was "
                              "stopped before its forward (no optimizer step ran in this step). Raise "
                              "max_sequence_length, or truncate the data to it.")
        return next(edge for edge in self.edges if edge >= length)

    def resized(self, inputs: tuple, length: int, new_length: int) -> tuple:
        """``inputs`` as a micro-batch of ``new_length``: each tensor whose size
        along ``dim`` is ``length`` cut to ``new_length`` or padded with zeros
        (a stand-in of that shape for measuring, not data); others as they are.
        Floating-point tensors keep whether they require grad."""
        def resize(value: Any) -> Any:
            if not isinstance(value, torch.Tensor) or value.dim() <= self.dim or value.shape[self.dim] != length:
                return value
            detached = value.detach()
            if new_length <= length:
                resized = detached.narrow(self.dim, 0, new_length).clone()
            else:
                pad = [0, 0] * (value.dim() - 1 - self.dim) + [0, new_length - length]
                resized = F.pad(detached, pad)
            return resized.requires_grad_(value.requires_grad and value.is_floating_point())

        return tuple(resize(value) for value in inputs)
