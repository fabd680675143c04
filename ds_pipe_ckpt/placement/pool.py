"""Preallocated buffers for partitioned checkpoint inputs
(``activation_checkpointing.contiguous_memory_optimization``).

Each checkpointed segment stores its shard in one of at most
``number_checkpoints`` buffers, allocated on first use and reused by later
micro-batches, so that long-lived shards do not fragment the allocator between
the short-lived activations of forward and backward. A segment holds its buffer
from the end of its forward until its recomputation has consumed the shard (or
until the segment's autograd graph is freed without a backward); then the
buffer is free for the next segment. Gathers land in one reused workspace per
device. :meth:`BufferPool.reset` forgets every buffer (segments that still hold
one keep it alive until they are done with it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import NUMBER_CHECKPOINTS_ALLOWED
from ..errors import ConfigError
from .pack import ALIGNMENT

__all__ = ["BufferPool", "BufferLease"]

KEY = "activation_checkpointing.number_checkpoints"


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(eq=False)
class _Slot:
    device: torch.device
    pinned: bool
    storage: torch.Tensor  # uint8, 1-D
    in_use: bool = False

    @property
    def capacity(self) -> int:
        return self.storage.numel()


class BufferLease:
    """A segment's hold on one pooled buffer: ``buffer`` is its first ``nbytes`` bytes."""

    __slots__ = ("buffer", "_slot", "_generation")

    def __init__(self, buffer: torch.Tensor, slot: _Slot, generation: int):
        self.buffer = buffer
        self._slot = slot
        self._generation = generation


class BufferPool:
    """At most ``capacity`` buffers held at once, reused across micro-batches and steps."""

    def __init__(self, capacity: int):
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0:
            raise ConfigError(KEY, capacity, NUMBER_CHECKPOINTS_ALLOWED)
        self.capacity = capacity
        self._slots: list[_Slot] = []
        self._workspaces: dict[torch.device, torch.Tensor] = {}
        self._generation = 0
        self.allocations = 0  # buffers allocated so far (slots, regrown slots and workspaces)

    # -- statistics ---------------------------------------------------------------

    @property
    def in_use(self) -> int:
        return sum(slot.in_use for slot in self._slots)

    @property
    def allocated_bytes(self) -> int:
        """Bytes the pool holds: slots plus workspaces."""
        return sum(s.capacity for s in self._slots) + sum(w.numel() for w in self._workspaces.values())

    # -- leases -------------------------------------------------------------------

    def acquire(self, nbytes: int, device: torch.device, pinned: bool = False) -> BufferLease:
        """Lend a buffer of at least ``nbytes`` bytes on ``device`` (pinned host memory if ``pinned``).

        Raises:
            ConfigError: ``capacity`` (``number_checkpoints``) buffers are already held.
        """
        device = torch.device(device)
        in_use = self.in_use
        if in_use >= self.capacity:
            raise ConfigError(
                KEY, self.capacity, f"at least {in_use + 1}",
                f"{in_use} checkpointed segments already hold partitioned inputs whose recomputation has "
                "not run yet, and one more arrived. Set number_checkpoints to the number of checkpointed "
                "segments per micro-batch times the micro-batches in flight at once on a stage. After "
                "forwards that are never backpropagated with grad enabled (e.g. evaluation without "
                "torch.no_grad()), drop their outputs or call ds_pipe_ckpt.reset().")
        free = [s for s in self._slots if not s.in_use]
        matching = [s for s in free if s.device == device and s.pinned == pinned]
        fitting = [s for s in matching if s.capacity >= nbytes]
        if fitting:
            slot = min(fitting, key=lambda s: s.capacity)
        elif len(self._slots) < self.capacity:
            slot = _Slot(device, pinned, self._allocate(nbytes, device, pinned))
            self._slots.append(slot)
        else:
            # Every buffer exists and none free one fits: regrow the largest free one.
            slot = max(matching or free, key=lambda s: s.capacity)
            slot.device, slot.pinned = device, pinned
            slot.storage = self._allocate(nbytes, device, pinned)
        slot.in_use = True
        return BufferLease(slot.storage.narrow(0, 0, nbytes), slot, self._generation)

    def release(self, lease: BufferLease) -> None:
        """Return a lease's buffer to the pool (a no-op after :meth:`reset` or a second call)."""
        if lease._generation == self._generation and lease._slot is not None:
            lease._slot.in_use = False
        lease._slot = None
        lease.buffer = None

    def workspace(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """A reused scratch buffer of ``nbytes`` bytes on ``device`` (one per device; valid until
        the next call for that device)."""
        device = torch.device(device)
        current = self._workspaces.get(device)
        if current is None or current.numel() < nbytes:
            current = self._allocate(nbytes, device, False)
            self._workspaces[device] = current
        return current.narrow(0, 0, nbytes)

    def reset(self) -> None:
        """Forget every buffer and lease. Buffers still held by a segment stay valid for it and
        are freed when it is done; new segments get new buffers."""
        self._generation += 1
        self._slots = []
        self._workspaces = {}

    def _allocate(self, nbytes: int, device: torch.device, pinned: bool) -> torch.Tensor:
        self.allocations += 1
        return torch.empty(_round_up(max(nbytes, 1), ALIGNMENT), dtype=torch.uint8, device=device,
                           pin_memory=pinned)
