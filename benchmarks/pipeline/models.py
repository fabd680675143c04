"""The models ``python -m benchmarks.pipeline`` runs (``--model``): how each is
described, built as a DeepSpeed pipeline engine and fed.

* ``gpt`` (default): the GPT example (``examples/gpt``) on its byte-level
  corpus; ``--blocks 24 --dim 64`` is the deeper model of docs/performance.md.
* ``llama``: transformers' Llama (``examples/llama``: ``LlamaDecoderLayer``,
  rotary table, RMSNorm, tied head) at the benchmark's sizes, on the GPT
  example's corpus (byte-level, as the Llama example trains by default).
* ``encoder``: a model built from torch's own layers, as people write one:
  a ``Linear`` in, ``nn.TransformerEncoderLayer`` blocks (``batch_first``,
  GELU), a mean over the sequence (a layer that saves nothing for its
  backward) and a ``Linear`` classifier, on seeded random features whose
  label is the argmax of a few of them.

In all, only the transformer blocks are checkpointed
(``checkpointable_layers``), so a uniform ``activation_checkpoint_interval``
counts blocks, and DeepSpeed balances the blocks across stages
(``partition_method="type:<block class>"``) unless the config's
``pipeline.partition_method`` says otherwise (``--partition``).

It builds models, engines and batches only: it measures nothing and starts no
ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.nn as nn
from deepspeed.pipe import LayerSpec

import ds_pipe_ckpt
from examples.gpt.data import Corpus, micro_batches
from examples.gpt.engine import DEFAULT_PARTITION_METHOD as GPT_PARTITION
from examples.gpt.engine import build_engine as build_gpt_engine
from examples.llama.engine import DEFAULT_PARTITION_METHOD as LLAMA_PARTITION
from examples.gpt.model import GPTConfig, check_sizes
from examples.llama.engine import build_engine as build_llama_engine
from examples.llama.model import small_config
from examples.sampling import GlobalBatchSampler

__all__ = ["EncoderConfig", "LlamaSizes", "MODEL_NAMES", "model_name", "model_description", "build_engine", "training_batches",
           "blocks_of", "default_partition"]

MODEL_NAMES = ("gpt", "llama", "encoder")


@dataclass(frozen=True)
class EncoderConfig:
    """Sizes of the ``encoder`` model (the field names are the GPT model's, so
    ``--dim``, ``--context``, ``--blocks`` and ``--heads`` size either).

    Attributes:
        dim: model width; divisible by ``heads``.
        heads: attention heads.
        blocks: ``nn.TransformerEncoderLayer`` blocks.
        context: sequence length of every sample.
        features: input features per position.
        classes: output classes.
    """

    dim: int = 128
    heads: int = 4
    blocks: int = 4
    context: int = 128
    features: int = 16
    classes: int = 10

    def __post_init__(self):
        check_sizes(self, ("dim", "heads", "blocks", "context", "features", "classes"))
        if self.classes > self.features:
            raise ValueError(f"EncoderConfig.classes = {self.classes} > features = {self.features}: a sample's "
                             "label is the argmax of its first `classes` features")


@dataclass(frozen=True)
class LlamaSizes:
    """Sizes of the ``llama`` model (field names as the GPT model's).

    Attributes:
        dim: hidden size; divisible by ``heads``.
        heads: attention heads, sharing ``heads // 2`` key/value heads (grouped-query
            attention, as Llama 2 70B and Llama 3 have), at least 1.
        blocks: decoder layers.
        context: sequence length of every sample.
        vocab_size: token ids (the corpus is byte-level: ids above 255 are never
            drawn, but the head and the loss cost what a real vocabulary's do).
    """

    dim: int = 128
    heads: int = 4
    blocks: int = 4
    context: int = 128
    vocab_size: int = 256

    def __post_init__(self):
        check_sizes(self, ("dim", "heads", "blocks", "context", "vocab_size"))

    def config(self):
        """The ``LlamaConfig``: the Llama example's small config at these sizes
        (MLP 2 x dim with SwiGLU, byte-level vocabulary, tied embeddings, SDPA)."""
        return small_config(hidden_size=self.dim, intermediate_size=2 * self.dim, num_hidden_layers=self.blocks,
                            num_attention_heads=self.heads, num_key_value_heads=max(1, self.heads // 2),
                            max_position_embeddings=max(1024, self.context), vocab_size=self.vocab_size)


class MeanOverSequence(nn.Module):
    """``[B, T, D] -> [B, D]``: the mean over the sequence (its backward needs no saved tensor)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=1)


Model = GPTConfig | LlamaSizes | EncoderConfig


def model_name(model: Model) -> str:
    return {EncoderConfig: "encoder", LlamaSizes: "llama"}.get(type(model), "gpt")


def model_description(model: Model) -> str:
    """The ``model`` field of the JSON records."""
    if isinstance(model, LlamaSizes):
        return (f"llama (transformers LlamaDecoderLayer) d={model.dim} heads={model.heads} "
                f"kv_heads={max(1, model.heads // 2)} blocks={model.blocks} context={model.context} "
                f"vocab={model.vocab_size}")
    if isinstance(model, EncoderConfig):
        return (f"encoder (nn.TransformerEncoderLayer) d={model.dim} heads={model.heads} blocks={model.blocks} "
                f"context={model.context} features={model.features} classes={model.classes}")
    return (f"gpt d={model.dim} heads={model.heads} blocks={model.blocks} context={model.context} "
            f"vocab={model.vocab_size} dropout={model.dropout}")


def blocks_of(model: Model) -> int:
    return model.blocks


def _encoder_specs(model: EncoderConfig) -> list[LayerSpec]:
    block = LayerSpec(nn.TransformerEncoderLayer, model.dim, model.heads, dim_feedforward=4 * model.dim,
                      dropout=0.0, activation="gelu", batch_first=True)
    return ([LayerSpec(nn.Linear, model.features, model.dim)] + [block] * model.blocks
            + [LayerSpec(MeanOverSequence), LayerSpec(nn.Linear, model.dim, model.classes)])


def default_partition(model: Model) -> str:
    """The model's ``partition_method`` when the config names none: its blocks balanced."""
    return {EncoderConfig: "type:TransformerEncoderLayer", LlamaSizes: LLAMA_PARTITION}.get(type(model), GPT_PARTITION)


def build_engine(config: dict, model: Model, topology: Any, seed: int = 0,
                 sample: tuple[torch.Tensor, torch.Tensor] | None = None) -> Any:
    """``ds_pipe_ckpt.initialize`` of ``model``'s pipeline under ``config`` (a
    DeepSpeed config with an ``optimizer`` section), seeded with ``seed`` (the
    GPT model's weights depend on nothing else; the encoder's also on which
    layers a stage builds: the benchmark compares memory and time, not losses).
    The stages are cut as ``pipeline.partition_method`` says (default:
    :func:`default_partition`); ``"planned"`` profiles the layers on
    ``sample``, one micro-batch's ``(inputs, labels)``."""
    inputs, labels = sample if sample is not None else (None, None)
    method, planning = ds_pipe_ckpt.partition_from_config(config, default=default_partition(model), sample=inputs,
                                                          labels=labels)
    if isinstance(model, GPTConfig):
        return build_gpt_engine(config, model, topology, seed=seed, partition_method=method,
                                partition_planning=planning)
    if isinstance(model, LlamaSizes):
        engine, _ = build_llama_engine(config, model.config(), topology, seed=seed, partition_method=method,
                                       partition_planning=planning)
        return engine
    torch.manual_seed(seed)  # LayerSpecs are built in layer order on every stage: the same weights
    module = ds_pipe_ckpt.PipelineModule(layers=_encoder_specs(model), topology=topology,
                                         loss_fn=nn.CrossEntropyLoss(), partition_method=method,
                                         partition_planning=planning,
                                         checkpointable_layers=["TransformerEncoderLayer"])
    engine, _, _, _ = ds_pipe_ckpt.initialize(model=module, config=config,
                                              model_parameters=[p for p in module.parameters() if p.requires_grad])
    return engine


def _encoder_batches(model: EncoderConfig, micro_batch: int, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    while True:
        x = torch.randn(micro_batch, model.context, model.features, generator=generator)
        yield x, x[:, 0, :model.classes].argmax(dim=-1)


def training_batches(model: Model, corpus: Corpus | None, micro_batch: int,
                     accumulation: int, steps: int, seed: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The micro-batches of ``steps`` steps (the first and the last stage draw
    the same ones: both consume the engine's data iterator)."""
    if isinstance(model, EncoderConfig):
        return _encoder_batches(model, micro_batch, seed)
    if corpus is None:
        raise ValueError(f"the {model_name(model)} model trains on the GPT example's corpus: pass it")
    sampler = GlobalBatchSampler(corpus.num_windows(model.context), micro_batch, accumulation, 1, 0, steps, seed=seed)
    return micro_batches(corpus, sampler, model.context)
