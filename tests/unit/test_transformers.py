"""Hugging Face transformers models, built from configs (nothing downloaded),
with ``ds_pipe_ckpt.checkpoint`` as their checkpoint function, called the way
transformers calls it: ``fn(functools.partial(Layer.forward, layer, **kw),
hidden_states, ...)`` with the user's ``gradient_checkpointing_kwargs`` as
keywords. Loss and every parameter gradient must equal training without
checkpointing, bit for bit (CPU, fp32, dropout on), in both modes, over two
steps (the reentrant mode's first call of each layer runs non-reentrantly; the
second step goes through DeepSpeed's reentrant checkpoint).
"""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import modeling_utils
from transformers.modeling_layers import GradientCheckpointingLayer

import ds_pipe_ckpt
from checkpoint_modes import MODES

VOCAB, SEQ, BATCH = 96, 12, 3


def gpt2(attn_pdrop=0.0):
    """Attention dropout is off here: with it on, checkpointing GPT-2 with torch's own
    non-reentrant checkpoint already gives gradients that differ from no checkpointing
    by a few 1e-9 (measured), see test_gpt2_with_attention_dropout_matches_torchs_checkpoint."""
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.1, embd_pdrop=0.1,
        attn_pdrop=attn_pdrop))


def llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, attention_dropout=0.1))


def bert():
    return transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=32, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1))


MODELS = {"gpt2": gpt2, "llama": llama, "bert": bert}


def _train(model_fn, steps=2, **checkpointing):
    """Losses and gradients of ``steps`` steps (each from its own seed), with
    ``model.activation_checkpointing_enable(activation_checkpointing_kwargs=...)``
    when ``checkpointing`` is given."""
    torch.manual_seed(0)
    model = model_fn().train()
    if checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=checkpointing)
    results = []
    for step in range(steps):
        model.zero_grad(set_to_none=True)
        generator = torch.Generator().manual_seed(100 + step)
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
        torch.manual_seed(step)  # dropout
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    return results, model


@pytest.fixture
def ours_in_transformers(monkeypatch):
    """What a user does to use ds_pipe_ckpt in transformers: replace the checkpoint
    function ``activation_checkpointing_enable`` (and the deprecated
    ``gradient_checkpointing_enable``) wraps."""
    monkeypatch.setattr(modeling_utils, "checkpoint", ds_pipe_ckpt.checkpoint)


@pytest.mark.parametrize("kwargs", [
    pytest.param({"use_reentrant": True}, marks=pytest.mark.deepspeed_reentrant),
    {"use_reentrant": False},
    {"use_reentrant": False, "preserve_rng_state": True, "early_stop": True, "determinism_check": "default"},
], ids=["reentrant", "non_reentrant", "non_reentrant_torch_keywords"])
@pytest.mark.parametrize("name", list(MODELS))
def test_loss_and_every_gradient_equal_no_checkpointing(ours_in_transformers, name, kwargs):
    expected, _ = _train(MODELS[name])
    got, model = _train(MODELS[name], **kwargs)
    assert model.is_activation_checkpointing
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    assert len(layers) == 2 and all(layer.gradient_checkpointing for layer in layers)
    for step, ((loss_a, grads_a), (loss_b, grads_b)) in enumerate(zip(expected, got)):
        assert torch.equal(loss_a, loss_b), f"step {step}: loss {loss_a} vs {loss_b}"
        assert grads_a.keys() == grads_b.keys()
        for parameter, grad in grads_a.items():
            assert torch.equal(grad, grads_b[parameter]), f"step {step}: {parameter} differs"


@pytest.mark.parametrize("use_reentrant", MODES)
def test_gpt2_with_attention_dropout_matches_torchs_checkpoint(monkeypatch, use_reentrant):
    """Where torch's own checkpoint does not reproduce training without checkpointing
    bit for bit, ours reproduces torch's checkpoint bit for bit."""
    with_attention_dropout = lambda: gpt2(attn_pdrop=0.1)
    expected, _ = _train(with_attention_dropout, use_reentrant=False)  # torch.utils.checkpoint.checkpoint
    monkeypatch.setattr(modeling_utils, "checkpoint", ds_pipe_ckpt.checkpoint)
    got, _ = _train(with_attention_dropout, use_reentrant=use_reentrant)
    for (loss_a, grads_a), (loss_b, grads_b) in zip(expected, got):
        assert torch.equal(loss_a, loss_b)
        assert all(torch.equal(grad, grads_b[name]) for name, grad in grads_a.items())


def test_errors_name_the_transformers_layer(ours_in_transformers):
    """A layer whose recomputation diverges is named as ``GPT2Block.forward``, not "partial"."""
    torch.manual_seed(0)
    model = gpt2().train()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    block = model.transformer.h[1]
    original = block.mlp.forward
    calls = []

    def lazily_cached_mlp(hidden_states):
        calls.append(1)
        return original(hidden_states) if len(calls) == 1 else hidden_states * 0.5  # a different path

    block.mlp.forward = lazily_cached_mlp
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    loss = model(input_ids=ids, labels=ids).loss
    with pytest.raises(ds_pipe_ckpt.RecomputeMismatchError,
                       match=r"^Recomputation of checkpointed function GPT2Block\.forward diverged"):
        loss.backward()


def test_a_lazy_parameter_cache_inside_a_transformer_block_is_named(ours_in_transformers):
    """Issue 10's hole, inside GPT-2: the MLP's input projection uses a
    weight-normed copy of its weight, built on the first call and reused. The
    recomputation (torch's early stop on) saves fewer tensors than the forward;
    the block is named, where torch alone raised a bare count mismatch."""
    torch.manual_seed(0)
    model = gpt2().train()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    projection = model.transformer.h[1].mlp.c_fc
    cache = {}

    def weight_normed(hidden_states):
        if "weight" not in cache:
            cache["weight"] = projection.weight / projection.weight.norm(dim=0, keepdim=True)
        flat = hidden_states.reshape(-1, hidden_states.size(-1))
        return torch.addmm(projection.bias, flat, cache["weight"]).view(*hidden_states.shape[:-1], -1)

    projection.forward = weight_normed
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    loss = model(input_ids=ids, labels=ids).loss
    with pytest.raises(ds_pipe_ckpt.RecomputeMismatchError,
                       match=r"^Recomputation of checkpointed function GPT2Block\.forward diverged"):
        loss.backward()
