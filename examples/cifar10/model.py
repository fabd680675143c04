"""AlexNet-style CIFAR-10 model (32x32x3 inputs) as a list of pipeline layers,
with a tensor-parallel classifier head.

Layers, in order: five convolutions with ReLUs and three max-pools (the
CIFAR-10 AlexNet that DeepSpeed's pipeline tests use), a flatten, and a head
``column-parallel linear -> ReLU -> dropout -> row-parallel linear``.

The head is a single pipeline layer on purpose: DeepSpeed's pipeline engine
splits the activations it sends between stages across the model-parallel group
and reassembles them on the receiver, which is only right for activations that
are replicated across that group. A stage boundary must therefore never fall
inside the tensor-parallel region, where activations are sharded.
"""

from __future__ import annotations

from typing import Sequence

import torch.nn as nn

from .tensor_parallel import ColumnParallelLinear, RowParallelLinear, TensorParallelDropout

__all__ = ["alexnet_layers", "TensorParallelClassifier", "ALEXNET_CHANNELS"]

# Output channels of the five convolutions of the CIFAR-10 AlexNet.
ALEXNET_CHANNELS = (64, 192, 384, 256, 256)


class TensorParallelClassifier(nn.Module):
    """``logits = RowParallel(Dropout(ReLU(ColumnParallel(x))))``.

    Input ``[B, in_features]`` and output ``[B, num_classes]`` are replicated
    across the tensor-parallel group; the ``hidden`` activations in between
    are sharded. With a ``tp_group`` the dropout mask comes from DeepSpeed's
    model-parallel RNG tracker (seed it with
    :func:`~examples.cifar10.tensor_parallel.seed_model_parallel_rng`); without
    one (single process, ``tp_world_size == 1``) it is an ordinary dropout.
    """

    def __init__(self, in_features: int, hidden: int, num_classes: int, dropout: float,
                 tp_group=None, tp_rank: int = 0, tp_world_size: int = 1):
        super().__init__()
        self.fc1 = ColumnParallelLinear(in_features, hidden, tp_group, tp_rank, tp_world_size)
        self.act = nn.ReLU()
        self.dropout = nn.Dropout(dropout) if tp_group is None else TensorParallelDropout(dropout)
        self.fc2 = RowParallelLinear(hidden, num_classes, tp_group, tp_rank, tp_world_size)

    def forward(self, x):
        return self.fc2(self.dropout(self.act(self.fc1(x))))


def _conv(in_channels: int, out_channels: int, **kwargs) -> nn.Conv2d:
    # He initialisation (ReLU gain) instead of PyTorch's default: the narrow
    # variants used in tests then learn within a few dozen steps.
    conv = nn.Conv2d(in_channels, out_channels, **kwargs)
    nn.init.kaiming_normal_(conv.weight, nonlinearity="relu")
    nn.init.zeros_(conv.bias)
    return conv


def alexnet_layers(num_classes: int = 10, tp_group=None, tp_rank: int = 0, tp_world_size: int = 1,
                   *, channels: Sequence[int] = ALEXNET_CHANNELS, hidden: int = 256,
                   dropout: float = 0.1) -> list[nn.Module]:
    """The model's pipeline layers, in order: input ``[B, 3, 32, 32]`` float,
    output logits ``[B, num_classes]``.

    Parameters are initialised from torch's default generator in a fixed order
    (convolutions: He normal, zero bias; linears: ``nn.Linear``'s default), at
    their full (unsharded) size, so ``torch.manual_seed(s)`` before this call
    gives the same model for every pipeline/tensor/data-parallel layout.

    Args:
        num_classes: number of output logits.
        tp_group, tp_rank, tp_world_size: the tensor-parallel group the head is
            split over (for a DeepSpeed pipeline: the grid's slice-parallel
            group). ``tp_group`` may be None only when ``tp_world_size == 1``.
        channels: output channels of the five convolutions.
        hidden: width of the head's hidden layer; divisible by ``tp_world_size``.
        dropout: dropout probability in the head.
    """
    if len(channels) != 5:
        raise ValueError(f"channels must list the 5 convolution widths, got {tuple(channels)}")
    c1, c2, c3, c4, c5 = channels
    return [
        _conv(3, c1, kernel_size=11, stride=4, padding=5),  # 32x32 -> 8x8
        nn.ReLU(),
        nn.MaxPool2d(kernel_size=2, stride=2),  # -> 4x4
        _conv(c1, c2, kernel_size=5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(kernel_size=2, stride=2),  # -> 2x2
        _conv(c2, c3, kernel_size=3, padding=1),
        nn.ReLU(),
        _conv(c3, c4, kernel_size=3, padding=1),
        nn.ReLU(),
        _conv(c4, c5, kernel_size=3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(kernel_size=2, stride=2),  # -> 1x1
        nn.Flatten(),
        TensorParallelClassifier(c5, hidden, num_classes, dropout, tp_group, tp_rank, tp_world_size),
    ]
