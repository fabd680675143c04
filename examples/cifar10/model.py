"""CIFAR-10 models (32x32x3 inputs) as lists of pipeline layers, with a
tensor-parallel classifier head.

* :func:`alexnet_layers`: five convolutions with ReLUs and three max-pools (the
  CIFAR-10 AlexNet that DeepSpeed's pipeline tests use), a flatten, and the head.
* :func:`resnet_layers`: a small CIFAR ResNet with BatchNorm (module state that
  a forward updates: running statistics), in-place ReLUs and residual adds,
  then global average pooling, a flatten, and the head.

The head is ``column-parallel linear -> ReLU -> dropout -> row-parallel linear``.

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

__all__ = ["alexnet_layers", "resnet_layers", "BasicBlock", "TensorParallelClassifier", "ALEXNET_CHANNELS",
           "RESNET_WIDTHS", "MODELS"]

# Output channels of the five convolutions of the CIFAR-10 AlexNet.
ALEXNET_CHANNELS = (64, 192, 384, 256, 256)
# Channels of the ResNet's stages (the CIFAR ResNets of He et al. 2016: 16, 32, 64).
RESNET_WIDTHS = (16, 32, 64)
# The models train.py can build (``--model``, or the config's ``cifar10.model``).
MODELS = ("alexnet", "resnet")


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


def _bn_conv(in_channels: int, out_channels: int, kernel_size: int, stride: int = 1) -> nn.Conv2d:
    # A convolution followed by BatchNorm: no bias (the BatchNorm's shift replaces
    # it); He initialisation for the ReLU that follows, as torchvision's ResNet.
    conv = nn.Conv2d(in_channels, out_channels, kernel_size, stride=stride, padding=kernel_size // 2,
                     bias=False)
    nn.init.kaiming_normal_(conv.weight, mode="fan_out", nonlinearity="relu")
    return conv


class BasicBlock(nn.Module):
    """ResNet's basic block, written as torchvision writes it::

        out = relu_(bn1(conv1(x)))          # in-place ReLU
        out = bn2(conv2(out))
        out += shortcut(x)                  # in-place residual add
        out = relu_(out)

    ``shortcut`` is the identity, or a strided 1x1 convolution and a BatchNorm
    when the block changes the resolution or the width.
    """

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1):
        super().__init__()
        self.conv1 = _bn_conv(in_channels, out_channels, 3, stride)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = _bn_conv(out_channels, out_channels, 3)
        self.bn2 = nn.BatchNorm2d(out_channels)
        if stride != 1 or in_channels != out_channels:
            self.downsample = nn.Sequential(_bn_conv(in_channels, out_channels, 1, stride),
                                            nn.BatchNorm2d(out_channels))
        else:
            self.downsample = None

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


def resnet_layers(num_classes: int = 10, tp_group=None, tp_rank: int = 0, tp_world_size: int = 1,
                  *, widths: Sequence[int] = RESNET_WIDTHS, blocks: int = 1, hidden: int = 256,
                  dropout: float = 0.1) -> list[nn.Module]:
    """A small CIFAR ResNet's pipeline layers, in order: input ``[B, 3, 32, 32]``
    float, output logits ``[B, num_classes]``.

    Layers: the stem as three layers, ``Conv2d(3x3) -> BatchNorm2d ->
    ReLU(inplace=True)`` (the ReLU on its own, so that an in-place operation
    can begin a checkpointed segment or a pipeline stage); then per width
    ``blocks`` :class:`BasicBlock` layers, the first of each width after the
    first halving the resolution (strided convolution, 1x1-convolution
    shortcut); ``AdaptiveAvgPool2d(1)``, ``Flatten`` and the tensor-parallel
    head (one layer: no stage boundary inside it). ``widths = (16, 32, 64)``
    with ``blocks = 3`` is He et al.'s ResNet-20 (with this head); the default
    ``blocks = 1`` is an 8-convolution ResNet for CPUs.

    Every BatchNorm2d keeps running statistics (``running_mean``,
    ``running_var``, ``num_batches_tracked``): a forward in training mode
    updates them, evaluation uses them.

    Initialisation comes from torch's default generator in a fixed order
    (convolutions: He normal, fan-out, no bias; BatchNorm: weight 1, bias 0;
    head: ``nn.Linear``'s default, at full size), so ``torch.manual_seed(s)``
    before this call gives the same model for every pipeline/tensor/data-parallel
    layout.

    Args:
        num_classes: number of output logits.
        tp_group, tp_rank, tp_world_size: the tensor-parallel group of the head,
            as for :func:`alexnet_layers`.
        widths: channels of each resolution stage (32x32, 16x16, 8x8, ...); the stem
            has ``widths[0]``.
        blocks: basic blocks per width.
        hidden: width of the head's hidden layer; divisible by ``tp_world_size``.
        dropout: dropout probability in the head.
    """
    if not widths or any(w < 1 for w in widths):
        raise ValueError(f"widths must list one or more positive widths, got {tuple(widths)}")
    if blocks < 1:
        raise ValueError(f"blocks must be >= 1, got {blocks}")
    if len(widths) > 6:
        raise ValueError(f"{len(widths)} widths would halve a 32x32 input below 1x1; at most 6")
    layers: list[nn.Module] = [
        _bn_conv(3, widths[0], 3),
        nn.BatchNorm2d(widths[0]),
        nn.ReLU(inplace=True),
    ]
    in_channels = widths[0]
    for stage, width in enumerate(widths):
        for block in range(blocks):
            stride = 2 if stage > 0 and block == 0 else 1
            layers.append(BasicBlock(in_channels, width, stride))
            in_channels = width
    layers += [
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        TensorParallelClassifier(in_channels, hidden, num_classes, dropout, tp_group, tp_rank, tp_world_size),
    ]
    return layers
