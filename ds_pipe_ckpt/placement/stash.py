"""The inputs one checkpointed segment saves for its recomputation, stored the
way ``activation_checkpointing`` asks: sharded over the model-parallel group,
in host memory, in pooled buffers.

Life of a :class:`SegmentStash`:

1. ``pack`` (for each input the region's recomputation will start from, as
   :class:`ds_pipe_ckpt.inputs.SavedInputs` hands them over when the forward
   has ended): remember the tensor, return an index.
2. ``seal`` (right after): the floating-point inputs are packed into one
   byte buffer (:class:`~ds_pipe_ckpt.placement.pack.PackLayout`) of which this rank keeps
   its shard, on the device or in host memory; the references to the full
   tensors are dropped, so their memory is freed unless something else holds
   them (the caller's own references are never touched: the stash copies).
   Kept whole, by reference: non-floating-point tensors (masks, ids), tensors
   with fewer elements than the model-parallel world size, parameters and other
   tensor subclasses, sparse tensors, tensors flagged ``no_checkpointing = True``
   (DeepSpeed's opt-out) and tensors on another device than the first
   floating-point input.
3. ``unpack`` (the recomputation, in backward): the first call brings the shard
   back to the device and all-gathers it (one collective for the whole
   segment), later calls of the same round are served from that; the round
   ends when every saved input has been handed out.

Values are copied byte for byte, so the recomputation sees exactly the
forward's inputs and gradients are bitwise those of an unpartitioned run.
torch restores each unpacked input's ``requires_grad`` and autograd identity
itself, so gradients still flow to the inputs.
"""

from __future__ import annotations

import weakref
from typing import Protocol

import torch
from torch.utils.checkpoint import CheckpointError

from ..config import CheckpointingConfig
from . import kernels
from .pack import PackLayout, byte_view
from .pool import BufferPool
from .profiling import CheckpointProfiler, CheckpointRecord

__all__ = ["SegmentStash", "StashRuntime"]


class StashRuntime(Protocol):
    """What a stash needs of the job's checkpointing runtime
    (:class:`~ds_pipe_ckpt.placement.runtime.CheckpointRuntime` provides it):
    the settings, this rank's place in the model-parallel group, the buffer
    pool and profiler where configured, and the group's collectives."""

    config: CheckpointingConfig
    rank: int
    world_size: int
    partitioned: bool
    pool: BufferPool | None
    profiler: CheckpointProfiler | None

    def synchronize_boundary(self) -> None: ...

    def all_gather(self, output: torch.Tensor, shard: torch.Tensor) -> None: ...


class SegmentStash:
    """One checkpointed segment's saved inputs (see the module docstring)."""

    def __init__(self, runtime: StashRuntime, record: CheckpointRecord | None = None):
        self._runtime = runtime
        self._record = record
        # Before seal(): the tensors torch handed to pack(), deduplicated.
        self._tensors: list[torch.Tensor] = []
        self._index_of: dict[int, int] = {}
        self._handles = 0  # pack() calls: the unpack() calls of one full round
        self._sealed = False
        # After seal().
        self._whole: dict[int, torch.Tensor] = {}
        self._position: dict[int, int] = {}  # tensor index -> position in the layout
        self._layout: PackLayout | None = None
        self._device: torch.device | None = None
        self._stored: torch.Tensor | None = None  # this rank's shard, or the whole packed buffer
        self._release_lease = None  # weakref.finalize returning a pooled buffer
        self._consumed = False  # the pooled buffer went back to the pool after a recomputation
        # During a recomputation round.
        self._restored: list[torch.Tensor] | None = None
        self._unpacked = 0

    # -- forward --------------------------------------------------------------------

    def pack(self, tensor: torch.Tensor) -> int:
        """Remember ``tensor``; return its index."""
        if self._sealed:
            raise RuntimeError("ds_pipe_ckpt: a tensor was added to a checkpoint's input stash after it "
                               "was sealed; this is a bug, please report it")
        index = self._index_of.get(id(tensor))
        if index is None:
            index = len(self._tensors)
            self._index_of[id(tensor)] = index
            self._tensors.append(tensor)
        self._handles += 1
        return index

    def seal(self) -> None:
        """Store the saved inputs as configured and drop the references to the full tensors."""
        self._sealed = True
        tensors, self._tensors, self._index_of = self._tensors, [], {}
        self._device = self._primary_device(tensors)
        packed = [i for i, t in enumerate(tensors) if self._should_pack(t)]
        self._whole = {i: t.detach() for i, t in enumerate(tensors) if i not in packed}
        saved_bytes = sum(t.numel() * t.element_size() for t in tensors)
        if packed:
            self._position = {index: position for position, index in enumerate(packed)}
            self._layout = PackLayout.plan([tensors[i] for i in packed], self._runtime.world_size)
            self._store(self._layout.storage_views([tensors[i] for i in packed]))
        if self._record is not None:
            whole_bytes = sum(t.numel() * t.element_size() for t in self._whole.values())
            self._record.saved_bytes = saved_bytes
            self._record.kept_bytes = whole_bytes + (0 if self._stored is None else self._stored.numel())

    @staticmethod
    def _packable(tensor: torch.Tensor) -> bool:
        return (tensor.is_floating_point()
                and type(tensor) is torch.Tensor  # not parameters, nor subclasses (DTensor, ...)
                and tensor.layout == torch.strided
                and not getattr(tensor, "no_checkpointing", False))

    def _primary_device(self, tensors: list[torch.Tensor]) -> torch.device | None:
        return next((t.device for t in tensors if self._packable(t)), None)

    def _should_pack(self, tensor: torch.Tensor) -> bool:
        return (self._packable(tensor) and tensor.device == self._device
                and tensor.numel() >= max(1, self._runtime.world_size))

    def _store(self, views: list[torch.Tensor]) -> None:
        runtime, layout, device = self._runtime, self._layout, self._device
        offsets = layout.offsets
        to_host = runtime.config.cpu_checkpointing
        pinned = to_host and device.type == "cuda"
        target_device = torch.device("cpu") if to_host else device
        if runtime.partitioned:
            nbytes, begin = layout.shard_bytes, layout.shard_begin(runtime.rank)
        else:
            nbytes, begin = layout.used_bytes, 0
        if runtime.pool is not None:
            lease = runtime.pool.acquire(nbytes, target_device, pinned)
            self._release_lease = weakref.finalize(self, runtime.pool.release, lease)
            stored = lease.buffer
        else:
            stored = torch.empty(nbytes, dtype=torch.uint8, device=target_device, pin_memory=pinned)
        if target_device == device:
            kernels.pack(views, offsets, begin, stored)
        elif runtime.partitioned:
            shard = torch.empty(nbytes, dtype=torch.uint8, device=device)
            kernels.pack(views, offsets, begin, shard)
            stored.copy_(shard, non_blocking=pinned)
        else:
            # The whole buffer goes to the host: copy each tensor straight into its
            # place rather than staging a device-side copy of everything.
            for slot, view in zip(layout.slots, views):
                stored.narrow(0, slot.offset, slot.nbytes).copy_(byte_view(view), non_blocking=pinned)
        self._stored = stored

    # -- backward -------------------------------------------------------------------

    def unpack(self, index: int) -> torch.Tensor:
        """Saved-tensor unpack hook: the input with this index, as the forward saw it."""
        whole = self._whole.get(index)
        if whole is not None:
            result = whole
        else:
            if self._restored is None:
                self._restored = self._restore()
            result = self._restored[self._position[index]]
        self._unpacked += 1
        if self._unpacked == self._handles:  # every input handed out: the round is over
            self._restored, self._unpacked = None, 0
            if self._release_lease is not None:
                self._release_lease()  # the pooled buffer may serve the next segment now
                self._stored, self._consumed = None, True
        return result

    def _restore(self) -> list[torch.Tensor]:
        if self._consumed:
            raise CheckpointError(
                "ds_pipe_ckpt: this checkpoint's partitioned inputs were already recomputed once and "
                "their buffer returned to the pool (activation_checkpointing.contiguous_memory_optimization"
                " = true). Backpropagating through the same checkpointed graph twice (retain_graph=True) "
                "needs contiguous_memory_optimization = false.")
        runtime, layout, device = self._runtime, self._layout, self._device
        profiler = runtime.profiler
        started = profiler.start() if profiler is not None else None
        runtime.synchronize_boundary()
        source = self._stored
        if source.device != device:
            source = source.to(device, non_blocking=source.is_pinned())
        if runtime.partitioned and runtime.world_size > 1:
            if runtime.pool is not None:
                full = runtime.pool.workspace(layout.total_bytes, device)
            else:
                full = torch.empty(layout.total_bytes, dtype=torch.uint8, device=device)
            runtime.all_gather(full, source)
        else:
            full = source
        if runtime.pool is not None and (full is not source or source is self._stored):
            # `full` is a pooled buffer (the gather workspace or this segment's own
            # slot), which will be reused: copy the inputs out of it.
            restored, storage_views = layout.empty(device)
            kernels.unpack(full, layout.offsets, storage_views)
        else:
            restored = layout.views(full)  # a buffer of their own: no copy
        if started is not None:
            self._record.gather_s = profiler.stop(started)
            profiler.log(self._record, "gather")
        return restored
