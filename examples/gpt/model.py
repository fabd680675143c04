"""A small GPT language model as DeepSpeed pipeline layers.

Layers, in order (:func:`gpt_layer_specs`)::

    TiedLayerSpec("embed", TokenEmbedding)          tokens [B, T] int64 -> [B, T, d]
    LayerSpec(PositionEmbedding)                    + learned position table
    LayerSpec(Block) x blocks                       pre-LayerNorm transformer blocks
    LayerSpec(FinalLayerNorm)
    TiedLayerSpec("embed", TokenEmbedding, forward_fn=lm_head)   [B, T, d] -> logits [B, T, vocab]

The language-model head is the token embedding's weight (tied input/output
embeddings, as in GPT-2): both positions use the same ``"embed"`` key, so a
stage that holds both holds one module, and when they sit on different stages
DeepSpeed broadcasts the weight from the first at start-up and all-reduces its
gradient across the two before each optimizer step.

Dropout (on the attention output and on the MLP output of every block) draws
from torch's default generator, which a checkpoint's recomputation replays
(``preserve_rng_state``), so checkpointing changes memory, never the masks.

Every layer initialises its parameters from its own generator, seeded from the
model seed and the layer's index, so a given seed gives the same weights for
every pipeline layout (a stage builds only its own layers).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ds_pipe_ckpt import LayerSpec, TiedLayerSpec

__all__ = [
    "GPTConfig",
    "check_sizes",
    "TokenEmbedding",
    "PositionEmbedding",
    "Block",
    "FinalLayerNorm",
    "lm_head",
    "language_model_loss",
    "gpt_layer_specs",
    "EMBED_KEY",
    "CHECKPOINTABLE_LAYERS",
]

# Key of the tied token embedding / LM head.
EMBED_KEY = "embed"
# The layers a checkpoint may cover (PipelineModule's ``checkpointable_layers``):
# the transformer blocks, where the activations are.
CHECKPOINTABLE_LAYERS = ("Block",)
# GPT-2's initialisation: weights N(0, 0.02); residual projections scaled by 1/sqrt(2 * blocks).
_INIT_STD = 0.02


def check_sizes(sizes: Any, names: tuple[str, ...]) -> None:
    """Raises ValueError naming the field unless every one of ``names`` is a
    positive int and ``dim`` is a multiple of ``heads`` (for any sizes
    dataclass with those fields: this model's, the benchmarks' others)."""
    owner = type(sizes).__name__
    for name in names:
        value = getattr(sizes, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{owner}.{name} = {value!r} is invalid: expected a positive integer")
    if sizes.dim % sizes.heads:
        raise ValueError(f"{owner}.dim = {sizes.dim} is not divisible by heads = {sizes.heads}; "
                         "choose dim as a multiple of heads")


@dataclass(frozen=True)
class GPTConfig:
    """Model sizes. The defaults train on 2 CPU cores in seconds per hundred steps.

    Attributes:
        vocab_size: number of token ids (256 for byte-level text).
        context: longest sequence (size of the position table).
        dim: model width; divisible by ``heads``.
        heads: attention heads.
        blocks: transformer blocks.
        dropout: probability of the dropouts on the attention and MLP outputs.
    """

    vocab_size: int = 256
    context: int = 64
    dim: int = 64
    heads: int = 4
    blocks: int = 4
    dropout: float = 0.1

    def __post_init__(self):
        check_sizes(self, ("vocab_size", "context", "dim", "heads", "blocks"))
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout = {self.dropout!r} is invalid: expected 0 <= dropout < 1")


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _init_linear(linear: nn.Linear, generator: torch.Generator, std: float = _INIT_STD) -> nn.Linear:
    with torch.no_grad():
        nn.init.normal_(linear.weight, 0.0, std, generator=generator)
        nn.init.zeros_(linear.bias)
    return linear


class TokenEmbedding(nn.Embedding):
    """Token ids ``[B, T]`` to vectors ``[B, T, dim]``; its ``weight`` is also
    the LM head (:func:`lm_head`)."""

    def __init__(self, config: GPTConfig, init_seed: int):
        super().__init__(config.vocab_size, config.dim)
        with torch.no_grad():
            nn.init.normal_(self.weight, 0.0, _INIT_STD, generator=_generator(init_seed))


def lm_head(embedding: TokenEmbedding, hidden: torch.Tensor) -> torch.Tensor:
    """``forward_fn`` of the head position: logits ``[B, T, vocab] = hidden @ weight.T``."""
    return F.linear(hidden, embedding.weight)


class PositionEmbedding(nn.Module):
    """Adds a learned position vector: ``x + table[:T]``."""

    def __init__(self, config: GPTConfig, init_seed: int):
        super().__init__()
        self.table = nn.Parameter(torch.empty(config.context, config.dim))
        with torch.no_grad():
            nn.init.normal_(self.table, 0.0, _INIT_STD, generator=_generator(init_seed))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[1]
        if length > self.table.shape[0]:
            raise ValueError(f"sequence of {length} tokens is longer than the model's context "
                             f"({self.table.shape[0]}); raise GPTConfig.context or shorten the input")
        return x + self.table[:length]


class Block(nn.Module):
    """Pre-LayerNorm transformer block::

        x = x + dropout(proj(attention(ln1(x))))      causal scaled_dot_product_attention
        x = x + dropout(fc2(gelu(fc1(ln2(x)))))       MLP, hidden 4 x dim

    Input and output ``[B, T, dim]``. Dropout masks come from torch's default
    generator.
    """

    def __init__(self, config: GPTConfig, init_seed: int):
        super().__init__()
        self.heads = config.heads
        self.dropout = config.dropout
        generator = _generator(init_seed)
        residual_std = _INIT_STD / math.sqrt(2 * config.blocks)
        self.ln1 = nn.LayerNorm(config.dim)
        self.qkv = _init_linear(nn.Linear(config.dim, 3 * config.dim), generator)
        self.proj = _init_linear(nn.Linear(config.dim, config.dim), generator, residual_std)
        self.ln2 = nn.LayerNorm(config.dim)
        self.fc1 = _init_linear(nn.Linear(config.dim, 4 * config.dim), generator)
        self.fc2 = _init_linear(nn.Linear(4 * config.dim, config.dim), generator, residual_std)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, dim = x.shape
        qkv = self.qkv(x).view(batch, length, 3, self.heads, dim // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [batch, heads, length, head_dim]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(batch, length, dim))

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + F.dropout(self.attention(self.ln1(x)), self.dropout, self.training)
        return x + F.dropout(self.mlp(self.ln2(x)), self.dropout, self.training)


class FinalLayerNorm(nn.LayerNorm):
    """The LayerNorm after the last block."""

    def __init__(self, config: GPTConfig):
        super().__init__(config.dim)


def language_model_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (nats) of ``logits [B, T, V]`` against ``targets [B, T]``
    (the pipeline's ``loss_fn``)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def gpt_layer_specs(config: GPTConfig, seed: int = 0) -> list[LayerSpec]:
    """The model as pipeline layer specs, input tokens ``[B, T]`` (int64) to
    logits ``[B, T, vocab]``. Layer ``i`` is initialised from seed
    ``seed * 100_003 + i`` (the two embedding positions share one module and
    therefore one seed), so the weights do not depend on the pipeline layout.
    """
    def init_seed(index: int) -> int:
        return seed * 100_003 + index

    return [
        TiedLayerSpec(EMBED_KEY, TokenEmbedding, config, init_seed(0), tied_weight_attr="weight"),
        LayerSpec(PositionEmbedding, config, init_seed(1)),
        *(LayerSpec(Block, config, init_seed(2 + b)) for b in range(config.blocks)),
        LayerSpec(FinalLayerNorm, config),
        # Same constructor arguments as position 0: whichever is built first on a
        # stage is the module both positions use.
        TiedLayerSpec(EMBED_KEY, TokenEmbedding, config, init_seed(0), forward_fn=lm_head,
                      tied_weight_attr="weight"),
    ]
