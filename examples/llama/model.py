"""transformers' Llama (``LlamaForCausalLM``) as DeepSpeed pipeline layers.

Layers, in order (:func:`llama_layer_specs`)::

    TiedLayerSpec("embed", TokenEmbedding)        tokens [B, T] int64 -> hidden [B, T, d]
    LayerSpec(RotaryEmbedding)                    hidden -> (hidden, cos, sin)
    LayerSpec(DecoderLayer, config, i) x layers   (hidden, cos, sin) -> (hidden, cos, sin)
    LayerSpec(FinalNorm)                          (hidden, cos, sin) -> hidden
    TiedLayerSpec("embed", TokenEmbedding, forward_fn=lm_head)   hidden -> logits [B, T, vocab]

With ``config.tie_word_embeddings`` false the first and last are
``LayerSpec(TokenEmbedding)`` and ``LayerSpec(LMHead)``, each with its own weight.

The modules inside are transformers' own (``LlamaDecoderLayer``,
``LlamaRotaryEmbedding``, ``LlamaRMSNorm``), called as ``LlamaModel`` calls
them: the rotary table (cos, sin) is computed once from position ids
``0 .. T-1`` and given to every decoder layer as ``position_embeddings``, with
the causal mask of transformers' ``create_causal_mask`` for the configured
attention implementation (``None`` under SDPA, which then runs with
``is_causal``). So the pipeline computes what ``LlamaForCausalLM`` computes,
and :func:`causal_lm_loss` is transformers' ``ForCausalLMLoss``.

Between stages DeepSpeed passes a tuple of tensors, and its engine expects a
gradient back for every floating-point tensor it passed (it calls ``backward``
on each output of a stage and sends each input's ``.grad`` to the stage
before). The rotary table is a constant: the decoder layers use it detached
(no gradient is computed through the attention), pass it on unchanged, and
:class:`FinalNorm` gives it a zero gradient (:class:`_ConstantsEnd`), which
flows back through the stages to :class:`RotaryEmbedding`'s output, where it
ends.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import LlamaConfig
from transformers.loss.loss_utils import ForCausalLMLoss
from transformers.masking_utils import create_causal_mask
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

from ds_pipe_ckpt import LayerSpec, TiedLayerSpec

__all__ = [
    "ATTENTION_IMPLEMENTATIONS",
    "CHECKPOINTABLE_LAYERS",
    "EMBED_KEY",
    "DecoderLayer",
    "FinalNorm",
    "LMHead",
    "RotaryEmbedding",
    "TokenEmbedding",
    "causal_lm_loss",
    "layer_index",
    "lm_head",
    "llama_layer_specs",
    "prepare_config",
    "small_config",
]

# Key of the tied token embedding / LM head.
EMBED_KEY = "embed"
# The layers a checkpoint may cover (PipelineModule's ``checkpointable_layers``).
CHECKPOINTABLE_LAYERS = ("DecoderLayer",)
# Attention implementations that run on any device without extra packages.
ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager")


def small_config(**overrides) -> LlamaConfig:
    """The example's default model for CPUs: byte-level vocabulary (256), hidden
    64, 4 layers, 4 heads sharing 2 key/value heads, MLP 128, tied embeddings,
    SDPA attention; ``overrides`` are ``LlamaConfig`` keywords."""
    values = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  tie_word_embeddings=True, attn_implementation="sdpa")
    values.update(overrides)
    return prepare_config(LlamaConfig(**values))


def prepare_config(config: LlamaConfig) -> LlamaConfig:
    """Check ``config`` for the pipeline and choose its attention implementation:
    SDPA, as ``LlamaForCausalLM`` does, when none is set (a config loaded from
    a checkpoint has none). Returns ``config``, changed in place.

    Raises:
        ValueError: an attention implementation other than
            :data:`ATTENTION_IMPLEMENTATIONS`, or sizes that do not fit together.
    """
    if config._attn_implementation is None:
        config._attn_implementation = "sdpa"
    if config._attn_implementation not in ATTENTION_IMPLEMENTATIONS:
        raise ValueError(f"attention implementation {config._attn_implementation!r} is not supported by the "
                         f"pipeline example; use one of {ATTENTION_IMPLEMENTATIONS}")
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads"):
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"LlamaConfig.{name} = {value!r} is invalid: expected a positive integer")
    if config.num_attention_heads % config.num_key_value_heads:
        raise ValueError(f"LlamaConfig.num_attention_heads = {config.num_attention_heads} is not a multiple of "
                         f"num_key_value_heads = {config.num_key_value_heads}")
    return config


def _initialise(module: nn.Module, std: float, seed: int | None) -> None:
    """``LlamaForCausalLM``'s initial distribution (weights N(0, std), biases
    0, the padding row 0, norms 1) from a generator seeded with ``seed``;
    ``None`` leaves torch's default initialisation (weights that a checkpoint
    will overwrite)."""
    if seed is None:
        return
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for sub in module.modules():
            if isinstance(sub, (nn.Linear, nn.Embedding)):
                nn.init.normal_(sub.weight, 0.0, std, generator=generator)
            if isinstance(sub, nn.Linear) and sub.bias is not None:
                nn.init.zeros_(sub.bias)
            if isinstance(sub, nn.Embedding) and sub.padding_idx is not None:
                sub.weight[sub.padding_idx].zero_()


class TokenEmbedding(nn.Embedding):
    """Token ids ``[B, T]`` to ``[B, T, hidden]`` (``model.embed_tokens``); with
    tied embeddings its ``weight`` is also the LM head (:func:`lm_head`)."""

    def __init__(self, config: LlamaConfig, init_seed: int | None = None):
        super().__init__(config.vocab_size, config.hidden_size, config.pad_token_id)
        _initialise(self, config.initializer_range, init_seed)


def lm_head(embedding: TokenEmbedding, hidden: torch.Tensor) -> torch.Tensor:
    """``forward_fn`` of the tied head: logits ``hidden @ embedding.weight.T``."""
    return F.linear(hidden, embedding.weight)


class LMHead(nn.Module):
    """The untied head (``lm_head``): logits ``[B, T, vocab]``."""

    def __init__(self, config: LlamaConfig, init_seed: int | None = None):
        super().__init__()
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        _initialise(self, config.initializer_range, init_seed)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


def _position_ids(hidden: torch.Tensor) -> torch.Tensor:
    """``[[0, 1, ..., T-1]]``, as ``LlamaModel`` makes them without a cache."""
    return torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)


class RotaryEmbedding(nn.Module):
    """``hidden -> (hidden, cos, sin)``: transformers' ``LlamaRotaryEmbedding``
    table for positions ``0 .. T-1`` (``[1, T, head_dim]`` each, in the hidden
    states' dtype). Its buffers are not saved (they follow from the config).

    cos and sin leave this layer as leaves that require grad: the pipeline
    engine runs ``backward`` on every floating-point tensor a stage sends, and
    their (zero) gradient ends here.
    """

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.rotary = LlamaRotaryEmbedding(config)

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            cos, sin = self.rotary(hidden, _position_ids(hidden))
        return hidden, cos.requires_grad_(torch.is_grad_enabled()), sin.requires_grad_(torch.is_grad_enabled())


class DecoderLayer(nn.Module):
    """transformers' ``LlamaDecoderLayer(config, index)`` on the tuple
    ``(hidden, cos, sin)``: returns ``(layer(hidden), cos, sin)``.

    The layer is called as ``LlamaModel`` calls it, with
    ``position_embeddings=(cos, sin)`` (detached: the table is a constant),
    ``position_ids`` ``0 .. T-1`` and the causal mask of
    ``create_causal_mask`` for the config's attention implementation.
    """

    def __init__(self, config: LlamaConfig, index: int, init_seed: int | None = None):
        super().__init__()
        self.config = config
        self.index = index
        self.layer = LlamaDecoderLayer(config, index)
        _initialise(self, config.initializer_range, init_seed)

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hidden, cos, sin = inputs
        position_ids = _position_ids(hidden)
        mask = create_causal_mask(config=self.config, inputs_embeds=hidden, attention_mask=None, cache=None,
                                  position_ids=position_ids)
        hidden = self.layer(hidden, attention_mask=mask, position_ids=position_ids,
                            position_embeddings=(cos.detach(), sin.detach()))
        return hidden, cos, sin

    def extra_repr(self) -> str:
        return f"index={self.index}"


class _ConstantsEnd(torch.autograd.Function):
    """``hidden`` unchanged; the constants it is given get a zero gradient
    (what DeepSpeed's engine needs to send back for them)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, *constants: torch.Tensor) -> torch.Tensor:
        ctx.constants = [(c.shape, c.dtype, c.device) for c in constants]
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        zeros = (torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.constants)
        return (grad, *zeros)


class FinalNorm(nn.Module):
    """``(hidden, cos, sin) -> norm(hidden)``: the ``LlamaRMSNorm`` after the
    last decoder layer (``model.norm``); the rotary table ends here."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
        hidden, cos, sin = inputs
        return self.norm(_ConstantsEnd.apply(hidden, cos, sin))


def causal_lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The pipeline's ``loss_fn``: transformers' ``ForCausalLMLoss`` with
    ``shift_labels=targets`` (the data gives targets already shifted): mean
    cross-entropy in float32 over the targets that are not -100. ``targets``
    may be a strided view (the data's windows shifted by one): it is made
    contiguous, as transformers makes its shifted labels."""
    return ForCausalLMLoss(logits, None, logits.shape[-1], shift_labels=targets.contiguous())


def layer_index(config: LlamaConfig, part: str, decoder: int = 0) -> int:
    """Position in :func:`llama_layer_specs` of ``part`` (``"embed"``,
    ``"rotary"``, ``"decoder"`` with its index ``decoder``, ``"norm"``,
    ``"head"``).

    Raises:
        ValueError: an unknown part, or a decoder index outside the model.
    """
    layers = config.num_hidden_layers
    positions = {"embed": 0, "rotary": 1, "norm": 2 + layers, "head": 3 + layers}
    if part == "decoder":
        if not 0 <= decoder < layers:
            raise ValueError(f"decoder layer {decoder} is not in [0, {layers})")
        return 2 + decoder
    if part not in positions:
        raise ValueError(f"unknown part {part!r}: expected one of {sorted(positions) + ['decoder']}")
    return positions[part]


def llama_layer_specs(config: LlamaConfig, seed: int | None = 0) -> list[LayerSpec]:
    """``LlamaForCausalLM`` as pipeline layer specs, tokens ``[B, T]`` (int64)
    to logits ``[B, T, vocab]``.

    Layer ``i`` is initialised from seed ``seed * 100_003 + i`` (the two
    tied positions share one module and therefore one seed), so the weights do
    not depend on the pipeline layout. ``seed=None`` skips that initialisation,
    for weights loaded from a checkpoint afterwards
    (:func:`examples.llama.pretrained.load_local_weights`).
    """
    config = prepare_config(config)

    def init_seed(index: int) -> int | None:
        return None if seed is None else seed * 100_003 + index

    head = layer_index(config, "head")
    if config.tie_word_embeddings:
        first = TiedLayerSpec(EMBED_KEY, TokenEmbedding, config, init_seed(0), tied_weight_attr="weight")
        # Same constructor arguments as position 0: whichever is built first on a
        # stage is the module both positions use.
        last = TiedLayerSpec(EMBED_KEY, TokenEmbedding, config, init_seed(0), forward_fn=lm_head,
                             tied_weight_attr="weight")
    else:
        first = LayerSpec(TokenEmbedding, config, init_seed(0))
        last = LayerSpec(LMHead, config, init_seed(head))
    return [
        first,
        LayerSpec(RotaryEmbedding, config),
        *(LayerSpec(DecoderLayer, config, i, init_seed(layer_index(config, "decoder", i)))
          for i in range(config.num_hidden_layers)),
        LayerSpec(FinalNorm, config),
        last,
    ]
