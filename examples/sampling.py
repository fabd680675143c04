"""The order in which the examples feed data: the same global batches at
every step, whatever the (pipeline, model, data)-parallel layout."""

from __future__ import annotations

from typing import Iterator

import torch
from torch.utils.data import Sampler

__all__ = ["GlobalBatchSampler"]


class GlobalBatchSampler(Sampler[list[int]]):
    """This data-parallel rank's micro-batches of item indices, in training order.

    The item stream is a seeded permutation of the ``num_items`` items per
    epoch. Step ``s`` trains on the next ``micro_batch * grad_accum * dp_size``
    items of that stream whatever the topology: rank ``d`` takes the ``d``-th
    contiguous share and splits it into ``grad_accum`` micro-batches. So every
    layout with the same global batch sees the same items at the same step, and
    runs that differ only in their configuration see the same data.
    """

    def __init__(self, num_items: int, micro_batch: int, grad_accum: int, dp_size: int,
                 dp_rank: int, steps: int, seed: int = 0):
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank = {dp_rank} is not in [0, dp_size = {dp_size})")
        for name, value in (("num_items", num_items), ("micro_batch", micro_batch),
                            ("grad_accum", grad_accum), ("steps", steps)):
            if value <= 0:
                raise ValueError(f"{name} = {value} must be positive")
        self.num_items = num_items
        self.micro_batch, self.grad_accum = micro_batch, grad_accum
        self.dp_size, self.dp_rank = dp_size, dp_rank
        self.steps, self.seed = steps, seed

    def __len__(self) -> int:
        return self.steps * self.grad_accum

    def _stream(self, start: int, count: int) -> list[int]:
        indices: list[int] = []
        epoch, offset = divmod(start, self.num_items)
        while len(indices) < count:
            generator = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            order = torch.randperm(self.num_items, generator=generator)
            indices.extend(order[offset:offset + count - len(indices)].tolist())
            epoch, offset = epoch + 1, 0
        return indices

    def __iter__(self) -> Iterator[list[int]]:
        share = self.micro_batch * self.grad_accum
        global_batch = share * self.dp_size
        for step in range(self.steps):
            mine = self._stream(step * global_batch + self.dp_rank * share, share)
            for m in range(self.grad_accum):
                yield mine[m * self.micro_batch:(m + 1) * self.micro_batch]
