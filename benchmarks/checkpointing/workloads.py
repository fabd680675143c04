"""The pipeline stages the benchmark runs: a list of segments, each of which is
checkpointed as one unit, and the stage input's shape.

* ``gpt_stage``: a stack of pre-LayerNorm GPT blocks (causal self-attention and
  a 4x MLP), one segment per block.
* ``alexnet_stage``: the CIFAR-10 AlexNet pipeline layers of
  ``examples.cifar10.model``, one segment per layer.
* ``small_regions_N`` (N = 32, 128, 512, 1024; not run unless named): N
  regions of ``Linear(64, 64)`` + GELU on a batch of 32, each checkpointed:
  kernels of microseconds, so the step time is the checkpointing code's own
  per-call cost, and how that cost grows with the regions alive in a step
  (what a GPU sees for small layers).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["Workload", "TransformerBlock", "gpt_stage", "alexnet_stage", "small_regions", "build_workload", "SIZES",
           "WORKLOAD_NAMES", "DEFAULT_WORKLOADS", "SMALL_REGION_COUNTS"]

SMALL_REGION_COUNTS = (32, 128, 512, 1024)
DEFAULT_WORKLOADS = ("gpt_stage", "alexnet_stage")
WORKLOAD_NAMES = DEFAULT_WORKLOADS + tuple(f"small_regions_{n}" for n in SMALL_REGION_COUNTS)

# Sizes by preset: "full" (the default) and "quick" fit a 2-core CPU in about a
# minute and in well under two; "gpu" is sized for one data-centre GPU.
SIZES = {
    "full": {
        "gpt_stage": {"layers": 6, "dim": 128, "heads": 4, "batch": 8, "seq": 256},
        "alexnet_stage": {"batch": 128},
    },
    "quick": {
        "gpt_stage": {"layers": 4, "dim": 128, "heads": 4, "batch": 4, "seq": 256},
        "alexnet_stage": {"batch": 64},
    },
    "gpu": {
        "gpt_stage": {"layers": 8, "dim": 1024, "heads": 16, "batch": 8, "seq": 1024},
        "alexnet_stage": {"batch": 4096},
    },
}


@dataclass
class Workload:
    """A pipeline stage: ``segments`` run in order on an input of ``input_shape``."""

    name: str
    description: str
    segments: list[nn.Module]
    input_shape: tuple[int, ...]

    def to(self, device: torch.device) -> "Workload":
        for segment in self.segments:
            segment.to(device)
        return self

    def parameters(self) -> list[nn.Parameter]:
        return [p for segment in self.segments for p in segment.parameters()]

    def make_input(self, device: torch.device, seed: int = 0) -> torch.Tensor:
        """The stage input. It requires grad, as DeepSpeed's pipeline engine makes
        every stage input (and as DeepSpeed's reentrant checkpoint needs)."""
        generator = torch.Generator().manual_seed(seed)
        return torch.randn(self.input_shape, generator=generator).to(device).requires_grad_()


class TransformerBlock(nn.Module):
    """Pre-LayerNorm GPT block: ``x + proj(attn(ln1(x)))``, then ``x + fc2(gelu(fc1(ln2(x))))``.

    Attention is causal ``scaled_dot_product_attention``; the MLP hidden size is 4x.
    """

    def __init__(self, dim: int, heads: int):
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim {dim} is not divisible by heads {heads}")
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        qkv = self.qkv(self.ln1(x)).view(batch, seq, 3, self.heads, dim // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [batch, heads, seq, head_dim]
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(batch, seq, dim))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def gpt_stage(layers: int, dim: int, heads: int, batch: int, seq: int, seed: int = 0) -> Workload:
    """``layers`` GPT blocks of width ``dim``, on ``batch`` sequences of ``seq`` tokens."""
    torch.manual_seed(seed)
    blocks = [TransformerBlock(dim, heads) for _ in range(layers)]
    return Workload(
        name="gpt_stage",
        description=(f"{layers} GPT blocks (d={dim}, {heads} heads, MLP 4x, causal SDPA), "
                     f"batch {batch} x {seq} tokens, fp32, checkpointed per block"),
        segments=blocks,
        input_shape=(batch, seq, dim),
    )


def alexnet_stage(batch: int, seed: int = 0) -> Workload:
    """The CIFAR-10 AlexNet pipeline layers (single process, no tensor parallelism)."""
    from examples.cifar10.model import alexnet_layers  # needs the repository root on sys.path

    torch.manual_seed(seed)
    layers = alexnet_layers(num_classes=10)
    return Workload(
        name="alexnet_stage",
        description=(f"CIFAR-10 AlexNet ({len(layers)} layers of examples.cifar10.model), "
                     f"batch {batch} x 3x32x32, fp32, checkpointed per layer"),
        segments=layers,
        input_shape=(batch, 3, 32, 32),
    )


def small_regions(regions: int, dim: int = 64, batch: int = 32, seed: int = 0) -> Workload:
    """``regions`` segments of ``Linear(dim, dim)`` + GELU on ``batch`` rows."""
    torch.manual_seed(seed)
    return Workload(
        name=f"small_regions_{regions}",
        description=(f"{regions} regions of Linear({dim}, {dim}) + GELU, batch {batch}, fp32, each checkpointed: "
                     "the checkpointing code's per-call cost"),
        segments=[nn.Sequential(nn.Linear(dim, dim), nn.GELU()) for _ in range(regions)],
        input_shape=(batch, dim),
    )


def build_workload(name: str, preset: str = "full") -> Workload:
    """The workload called ``name`` at the sizes of ``preset`` (a key of :data:`SIZES`)."""
    builders = {"gpt_stage": gpt_stage, "alexnet_stage": alexnet_stage}
    if name.startswith("small_regions_") and name in WORKLOAD_NAMES:
        return small_regions(int(name.removeprefix("small_regions_")))  # the same size in every preset
    if name not in builders:
        raise KeyError(f"unknown workload {name!r}; known: {', '.join(WORKLOAD_NAMES)}")
    return builders[name](**SIZES[preset][name])
