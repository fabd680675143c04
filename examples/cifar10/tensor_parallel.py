"""Tensor (model) parallelism for the classifier head, Megatron style.

A column-parallel linear splits its output features across the tensor-parallel
group; a row-parallel linear splits its input features and all-reduces its
partial outputs. Between the two, activations are sharded, so element-wise
ops there (activation, dropout) run on shards. Dropout inside that region
draws from DeepSpeed's model-parallel RNG tracker, seeded differently per
tensor-parallel rank (:func:`seed_model_parallel_rng`), so that each shard gets
its own mask; the tracker is what checkpointing must replay on recomputation.

Every sharded layer first builds the full, unsharded parameters (with
``nn.Linear``'s initialisation, from the default generator) and keeps its
slice, so the model's function does not depend on the tensor-parallel size.

With ``world_size == 1`` no collective is issued and no process group is
needed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from deepspeed.runtime.activation_checkpointing.checkpointing import get_cuda_rng_tracker

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "TensorParallelDropout",
    "copy_to_tensor_parallel_region",
    "reduce_from_tensor_parallel_region",
    "seed_model_parallel_rng",
    "MODEL_PARALLEL_RNG",
]

# The tracker entry that ``tracker.fork()`` uses by default.
MODEL_PARALLEL_RNG = "model-parallel-rng"
# DeepSpeed's (and Megatron's) offset of the model-parallel seed.
_MODEL_PARALLEL_SEED_OFFSET = 2718


class _CopyToTensorParallelRegion(torch.autograd.Function):
    """Identity forward; backward all-reduces the gradient over the group.

    The input is replicated on every rank of the group and each rank uses it for
    its own shard, so its full gradient is the sum of the ranks' contributions.
    """

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTensorParallelRegion(torch.autograd.Function):
    """All-reduce forward (sums the ranks' partial outputs); identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_tensor_parallel_region(x: torch.Tensor, group, world_size: int) -> torch.Tensor:
    """Enter the tensor-parallel region with a replicated ``x``."""
    return x if world_size == 1 else _CopyToTensorParallelRegion.apply(x, group)


def reduce_from_tensor_parallel_region(x: torch.Tensor, group, world_size: int) -> torch.Tensor:
    """Leave the tensor-parallel region: sum the partial results of the group."""
    return x if world_size == 1 else _ReduceFromTensorParallelRegion.apply(x, group)


def _shard(size: int, rank: int, world_size: int, what: str) -> slice:
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"tensor-parallel rank {rank} is invalid for world size {world_size}")
    if size % world_size:
        raise ValueError(f"{what} = {size} is not divisible by the tensor-parallel world size "
                         f"{world_size}; choose a size that is a multiple of it")
    part = size // world_size
    return slice(rank * part, (rank + 1) * part)


def _check_group(group, world_size: int) -> None:
    if world_size > 1 and group is None:
        raise ValueError(f"tp_group is required when tp_world_size = {world_size} > 1")


class ColumnParallelLinear(nn.Module):
    """``y[:, shard] = x @ W[shard].T + b[shard]``: output features split over the group.

    Input: replicated ``[B, in_features]``. Output: this rank's shard,
    ``[B, out_features // world_size]``.
    """

    def __init__(self, in_features: int, out_features: int, group=None, rank: int = 0,
                 world_size: int = 1):
        super().__init__()
        _check_group(group, world_size)
        rows = _shard(out_features, rank, world_size, "out_features")
        full = nn.Linear(in_features, out_features)
        self.weight = nn.Parameter(full.weight.detach()[rows].clone())
        self.bias = nn.Parameter(full.bias.detach()[rows].clone())
        self.group, self.world_size = group, world_size
        self.in_features, self.out_features = in_features, out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = copy_to_tensor_parallel_region(x, self.group, self.world_size)
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"world_size={self.world_size}")


class RowParallelLinear(nn.Module):
    """``y = sum_ranks(x[:, shard] @ W[:, shard].T) + b``: input features split over the group.

    Input: this rank's shard ``[B, in_features // world_size]``. Output:
    replicated ``[B, out_features]`` (the bias is added once, after the all-reduce).
    """

    def __init__(self, in_features: int, out_features: int, group=None, rank: int = 0,
                 world_size: int = 1):
        super().__init__()
        _check_group(group, world_size)
        cols = _shard(in_features, rank, world_size, "in_features")
        full = nn.Linear(in_features, out_features)
        self.weight = nn.Parameter(full.weight.detach()[:, cols].clone())
        self.bias = nn.Parameter(full.bias.detach().clone())
        self.group, self.world_size = group, world_size
        self.in_features, self.out_features = in_features, out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = F.linear(x, self.weight)
        return reduce_from_tensor_parallel_region(partial, self.group, self.world_size) + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"world_size={self.world_size}")


class TensorParallelDropout(nn.Dropout):
    """Dropout on a tensor-parallel shard, with its mask drawn from DeepSpeed's
    model-parallel RNG tracker (``get_cuda_rng_tracker().fork()``).

    The tracker must be seeded first (:func:`seed_model_parallel_rng`). In eval
    mode, or with ``p == 0``, it is the identity and leaves the tracker alone.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        with get_cuda_rng_tracker().fork(MODEL_PARALLEL_RNG):
            return super().forward(x)


def seed_model_parallel_rng(seed: int, tp_rank: int) -> None:
    """(Re)seed the tracker's model-parallel state with ``seed + 2718 + tp_rank``,
    DeepSpeed's convention (``model_parallel_cuda_manual_seed``), without
    reseeding the default generator as that function does.

    Ranks of one tensor-parallel group get different masks for their shards;
    ranks holding the same shard (data-parallel replicas, pipeline stages,
    other runs) get the same stream; the offset keeps the stream apart from a
    default generator seeded with ``seed``.
    """
    tracker = get_cuda_rng_tracker()
    tracker.reset()
    tracker.add(MODEL_PARALLEL_RNG, seed + _MODEL_PARALLEL_SEED_OFFSET + tp_rank)
