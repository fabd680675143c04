"""Byte layout of a checkpointed segment's packed inputs, and the pure-torch
pack/unpack that the compiled ops (``csrc/``) reproduce bit for bit.

Layout: the K packed tensors are concatenated as raw bytes, each starting at a
16-byte-aligned offset (so that any dtype can be viewed in place and copies can
use 16-byte vectors). The total is padded to a multiple of ``16 * world_size``;
rank ``r`` keeps the contiguous byte range ``[r * shard_bytes, (r + 1) * shard_bytes)``.
Gaps and padding are zeros. Sharding bytes rather than each tensor separately
balances the shards for any sizes and dtype mix, and one all-gather into a single
tensor (``all_gather_single``) of the shards rebuilds the whole buffer, from which the tensors are plain views.

Each tensor is stored in *storage order*: a tensor whose elements are dense in
memory (contiguous, transposed, channels-last...) keeps its exact strides when
restored; other strided tensors (e.g. ``x[:, ::2]``) are restored contiguous.

This module imports only torch (no DeepSpeed), so that the kernels can be built,
tested and benchmarked on machines without DeepSpeed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = ["ALIGNMENT", "TensorSlot", "PackLayout", "pack_fallback", "unpack_fallback", "byte_view"]

ALIGNMENT = 16  # bytes: the vector width of the CUDA copy kernel


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _storage_order(tensor: torch.Tensor) -> tuple[int, ...] | None:
    """The dimension permutation under which ``tensor`` is contiguous, or None
    when its elements are not dense in memory (gaps or overlaps)."""
    order = tuple(sorted(range(tensor.dim()), key=lambda d: (-tensor.stride(d), -tensor.size(d), d)))
    if tensor.permute(order).is_contiguous():
        return order
    return None


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor as a 1-D uint8 view (no copy)."""
    if not tensor.is_contiguous():
        raise ValueError(f"byte_view needs a contiguous tensor, got strides {tuple(tensor.stride())}")
    flat = tensor.reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


@dataclass(frozen=True)
class TensorSlot:
    """Where one tensor lives in the packed buffer and how to rebuild it."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int  # bytes from the start of the packed buffer
    nbytes: int
    # Permutation from the tensor's dimensions to storage order, or None when the
    # tensor is restored contiguous.
    order: tuple[int, ...] | None

    def storage_view(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` as a contiguous tensor in storage order (a copy only when
        its elements are not dense in memory)."""
        if self.order is None:
            return tensor.contiguous()
        return tensor.permute(self.order)

    def view_of(self, buffer: torch.Tensor) -> torch.Tensor:
        """The tensor, viewed in place in the packed ``buffer`` (uint8)."""
        flat = buffer.narrow(0, self.offset, self.nbytes).view(self.dtype)
        return self._restride(flat)

    def empty(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """A fresh tensor with the original strides, and its contiguous storage-order view."""
        flat = torch.empty(self.nbytes // self.dtype.itemsize, dtype=self.dtype, device=device)
        return self._restride(flat), flat

    def _restride(self, flat: torch.Tensor) -> torch.Tensor:
        if self.order is None:
            return flat.view(self.shape)
        stored_shape = [self.shape[d] for d in self.order]
        inverse = sorted(range(len(self.order)), key=self.order.__getitem__)
        return flat.view(stored_shape).permute(inverse)


@dataclass(frozen=True)
class PackLayout:
    """The packed-buffer layout of a list of tensors, sharded over ``world_size`` ranks."""

    slots: tuple[TensorSlot, ...]
    used_bytes: int  # end of the last tensor
    world_size: int
    shard_bytes: int  # bytes each rank keeps; a multiple of ALIGNMENT

    @classmethod
    def plan(cls, tensors: Sequence[torch.Tensor], world_size: int = 1) -> "PackLayout":
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        slots = []
        offset = 0
        for tensor in tensors:
            offset = _round_up(offset, ALIGNMENT)
            nbytes = tensor.numel() * tensor.element_size()
            order = None if tensor.is_contiguous() else _storage_order(tensor)
            slots.append(TensorSlot(tuple(tensor.shape), tensor.dtype, offset, nbytes, order))
            offset += nbytes
        shard = _round_up(_round_up(offset, ALIGNMENT * world_size) // world_size, ALIGNMENT)
        return cls(tuple(slots), offset, world_size, shard)

    @property
    def total_bytes(self) -> int:
        """Bytes of the gathered buffer: ``world_size * shard_bytes``."""
        return self.world_size * self.shard_bytes

    @property
    def offsets(self) -> list[int]:
        return [slot.offset for slot in self.slots]

    def shard_begin(self, rank: int) -> int:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank}")
        return rank * self.shard_bytes

    def storage_views(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The contiguous storage-order tensors the pack op reads."""
        return [slot.storage_view(t) for slot, t in zip(self.slots, tensors, strict=True)]

    def views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """The tensors as views of the gathered ``buffer`` (no copy)."""
        self._check_buffer(buffer)
        return [slot.view_of(buffer) for slot in self.slots]

    def empty(self, device: torch.device) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Fresh tensors for :meth:`unpack`-style restoration, and their storage-order views."""
        pairs = [slot.empty(device) for slot in self.slots]
        return [p[0] for p in pairs], [p[1] for p in pairs]

    def _check_buffer(self, buffer: torch.Tensor) -> None:
        if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() < self.used_bytes:
            raise ValueError(f"expected a 1-D uint8 buffer of at least {self.used_bytes} bytes, "
                             f"got {buffer.dtype} of shape {tuple(buffer.shape)}")


def _check_byte_buffer(buffer: torch.Tensor, op: str, name: str) -> None:
    if buffer.dtype != torch.uint8:
        raise RuntimeError(f"ds_pipe_ckpt::{op}: {name} must be a uint8 tensor, got {buffer.dtype}")
    if buffer.dim() != 1 or not buffer.is_contiguous():
        raise RuntimeError(f"ds_pipe_ckpt::{op}: {name} must be a contiguous 1-D tensor, got sizes "
                           f"{tuple(buffer.shape)} and strides {tuple(buffer.stride())}")


def _check_tensors(tensors: Sequence[torch.Tensor], offsets: Sequence[int], buffer: torch.Tensor, op: str,
                   name: str) -> None:
    if len(tensors) != len(offsets):
        raise RuntimeError(f"ds_pipe_ckpt::{op}: got {len(tensors)} {name} but {len(offsets)} offsets")
    previous_end = 0
    for i, (tensor, offset) in enumerate(zip(tensors, offsets)):
        if not tensor.is_contiguous():
            raise RuntimeError(f"ds_pipe_ckpt::{op}: {name}[{i}] must be contiguous (pass its storage-order "
                               f"view), got strides {tuple(tensor.stride())}")
        if tensor.device != buffer.device:
            raise RuntimeError(f"ds_pipe_ckpt::{op}: {name}[{i}] is on {tensor.device} but the buffer is on "
                               f"{buffer.device}")
        if offset < previous_end:
            raise RuntimeError(f"ds_pipe_ckpt::{op}: offsets must be non-decreasing and {name} must not "
                               f"overlap: {name}[{i}] starts at byte {offset} but the previous one ends at "
                               f"byte {previous_end}")
        previous_end = offset + tensor.numel() * tensor.element_size()


def pack_fallback(tensors: Sequence[torch.Tensor], offsets: Sequence[int], begin: int, out: torch.Tensor) -> None:
    """Write bytes ``[begin, begin + out.numel())`` of the packed buffer into ``out``.

    Same contract and result as ``torch.ops.ds_pipe_ckpt.pack``: ``tensors`` are
    contiguous, on ``out``'s device, at non-decreasing, non-overlapping byte
    ``offsets``; bytes that no tensor covers are zeroed.
    """
    _check_byte_buffer(out, "pack", "out")
    _check_tensors(tensors, offsets, out, "pack", "tensors")
    if begin < 0:
        raise RuntimeError(f"ds_pipe_ckpt::pack: begin must be >= 0, got {begin}")
    end = begin + out.numel()
    cursor = begin
    for tensor, first in zip(tensors, offsets):
        lo = max(first, begin)
        hi = min(first + tensor.numel() * tensor.element_size(), end)
        if lo >= hi:
            continue
        if lo > cursor:
            out[cursor - begin:lo - begin].zero_()
        out[lo - begin:hi - begin].copy_(byte_view(tensor)[lo - first:hi - first])
        cursor = hi
    if cursor < end:
        out[cursor - begin:].zero_()


def unpack_fallback(buffer: torch.Tensor, offsets: Sequence[int], outs: Sequence[torch.Tensor]) -> None:
    """Copy bytes ``[offsets[i], offsets[i] + nbytes(outs[i]))`` of ``buffer`` into ``outs[i]``.

    Same contract and result as ``torch.ops.ds_pipe_ckpt.unpack``.
    """
    _check_byte_buffer(buffer, "unpack", "buffer")
    _check_tensors(outs, offsets, buffer, "unpack", "outs")
    for i, (out, offset) in enumerate(zip(outs, offsets)):
        nbytes = out.numel() * out.element_size()
        if offset + nbytes > buffer.numel():
            raise RuntimeError(f"ds_pipe_ckpt::unpack: outs[{i}] needs bytes [{offset}, {offset + nbytes}) "
                               f"but the buffer has {buffer.numel()}")
        byte_view(out).copy_(buffer[offset:offset + nbytes])
