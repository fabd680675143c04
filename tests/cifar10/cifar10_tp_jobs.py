"""Rank functions for the tensor-parallel tests (module level, so that
``spawn`` can import them). Each returns tensors for the test to compare."""

from __future__ import annotations

import torch
import torch.distributed as dist

from examples.cifar10.model import alexnet_layers
from examples.cifar10.tensor_parallel import (TensorParallelDropout, copy_to_tensor_parallel_region,
                                              reduce_from_tensor_parallel_region, seed_model_parallel_rng)

SMALL = {"channels": (4, 8, 8, 8, 8), "hidden": 8}


def region_functions() -> dict[str, torch.Tensor]:
    """copy-to / reduce-from on rank-dependent inputs and output gradients."""
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    x = torch.full((2, 3), float(rank + 1), requires_grad=True)
    copied = copy_to_tensor_parallel_region(x, group, world)
    copied.backward(torch.full_like(copied, 10.0 * (rank + 1)))
    y = torch.full((2, 3), float(rank + 1), requires_grad=True)
    reduced = reduce_from_tensor_parallel_region(y, group, world)
    reduced.backward(torch.full_like(reduced, 10.0 * (rank + 1)))
    return {"copied": copied.detach(), "copy_grad": x.grad, "reduced": reduced.detach(), "reduce_grad": y.grad}


def alexnet_forward_backward(tp: bool) -> dict[str, torch.Tensor]:
    """Eval-mode forward and backward of the model, tensor parallel over all
    ranks (``tp``) or unsharded; same seed, same input, same output gradient."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    if tp:
        layers = alexnet_layers(10, dist.group.WORLD, rank, world, **SMALL)
    else:
        layers = alexnet_layers(10, **SMALL)
    model = torch.nn.Sequential(*layers).eval()
    inputs = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
    logits = model(inputs)
    logits.backward(torch.randn(logits.shape, generator=torch.Generator().manual_seed(2)))
    head = layers[-1]
    return {
        "logits": logits.detach(),
        "input_grad": inputs.grad,
        "conv1_weight_grad": layers[0].weight.grad,
        "fc1_weight": head.fc1.weight.detach(), "fc1_weight_grad": head.fc1.weight.grad,
        "fc2_weight": head.fc2.weight.detach(), "fc2_weight_grad": head.fc2.weight.grad,
        "fc2_bias_grad": head.fc2.bias.grad,
    }


def dropout_mask(seed: int) -> torch.Tensor:
    """The mask TensorParallelDropout draws on this rank after seeding."""
    seed_model_parallel_rng(seed, dist.get_rank())
    return TensorParallelDropout(0.5)(torch.ones(4, 16)) == 0


def two_rank_checks() -> dict:
    """Everything the 2-rank tests compare, in one spawn (start-up is paid once)."""
    return {
        "regions": region_functions(),
        "model": {"tp": alexnet_forward_backward(tp=True), "full": alexnet_forward_backward(tp=False)},
        "mask": dropout_mask(seed=7),
        "mask_again": dropout_mask(seed=7),
    }
