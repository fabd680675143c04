"""The GPT example's corpus, batch order and model, in one process."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch

from examples.sampling import GlobalBatchSampler
from examples.gpt.data import (IGNORE_INDEX, PAD_TOKEN, STDLIB_FILES, build_corpus, corpus_path, load_corpus,
                               micro_batches, variable_micro_batches, window_lengths)
from examples.gpt.model import Block, GPTConfig, PositionEmbedding, TokenEmbedding, gpt_layer_specs, lm_head


@pytest.fixture
def fake_stdlib(tmp_path):
    """A directory with every listed file, each holding its own name."""
    source = tmp_path / "stdlib"
    source.mkdir()
    for name in STDLIB_FILES:
        (source / name).write_text(f"# {name}\n")
    return source


def test_corpus_is_the_listed_files_in_order_nul_separated(fake_stdlib, tmp_path):
    corpus = load_corpus(tmp_path / "cache", fake_stdlib)
    expected = b"".join(f"# {name}\n".encode() + b"\x00" for name in STDLIB_FILES)
    assert bytes(corpus.tokens.tolist()) == expected
    assert corpus.tokens.dtype == torch.uint8
    assert corpus.manifest["sha256"] == hashlib.sha256(expected).hexdigest()
    assert [f["name"] for f in corpus.manifest["files"]] == list(STDLIB_FILES) == sorted(STDLIB_FILES)
    assert corpus.path == corpus_path(tmp_path / "cache")


def test_real_stdlib_corpus_is_cached_and_reloaded_identically(tmp_path):
    first = load_corpus(tmp_path)
    second = load_corpus(tmp_path)
    assert torch.equal(first.tokens, second.tokens)
    assert len(first.tokens) > 1_000_000  # about 2.7 MB on Python 3.11


def test_missing_file_is_named(fake_stdlib, tmp_path):
    (fake_stdlib / "typing.py").unlink()
    with pytest.raises(FileNotFoundError, match=r"\['typing.py'\] are missing"):
        build_corpus(tmp_path / "cache", fake_stdlib)


def test_corrupted_cache_is_rejected(fake_stdlib, tmp_path):
    path = build_corpus(tmp_path / "cache", fake_stdlib)
    array = np.load(path)
    array[0] ^= 1
    with open(path, "wb") as handle:
        np.save(handle, array)
    with pytest.raises(ValueError, match="delete both files"):
        load_corpus(tmp_path / "cache", fake_stdlib)


@pytest.mark.parametrize("micro, accum, dp", [(8, 4, 1), (4, 8, 1), (8, 2, 2), (2, 4, 4)])
def test_every_layout_of_a_global_batch_sees_the_same_windows(micro, accum, dp):
    def per_step(micro, accum, dp):
        steps = [set() for _ in range(3)]
        for rank in range(dp):
            sampler = GlobalBatchSampler(100, micro, accum, dp, rank, steps=3, seed=5)
            for index, batch in enumerate(sampler):
                steps[index // accum].update(batch)
        return steps

    reference = per_step(32, 1, 1)
    assert per_step(micro, accum, dp) == reference
    assert all(len(step) == 32 for step in reference)  # no window twice within a step (100 windows per epoch)


def test_sampler_rejects_a_rank_outside_the_group():
    with pytest.raises(ValueError, match="dp_rank = 2 is not in"):
        GlobalBatchSampler(100, 8, 4, 2, 2, steps=1)


def test_targets_are_the_inputs_shifted_by_one(fake_stdlib, tmp_path):
    corpus = load_corpus(tmp_path / "cache", fake_stdlib)
    (inputs, targets), = micro_batches(corpus, [[0, 3]], context=5)
    assert inputs.dtype == targets.dtype == torch.int64 and inputs.shape == (2, 5)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    assert inputs[1].tolist() == corpus.tokens[15:20].tolist()
    assert targets[1].tolist() == corpus.tokens[16:21].tolist()


def test_variable_lengths_cut_each_window_and_pad_each_micro_batch_to_its_longest(fake_stdlib, tmp_path):
    corpus = load_corpus(tmp_path / "cache", fake_stdlib)
    context = 8
    lengths = window_lengths(corpus.num_windows(context), context, seed=3)
    assert lengths.min() >= context // 4 and lengths.max() <= context and len(set(lengths.tolist())) > 1
    assert torch.equal(lengths, window_lengths(corpus.num_windows(context), context, seed=3))  # seeded
    batches = [[0, 5, 2], [7, 1, 4]]
    fixed = list(micro_batches(corpus, batches, context))
    for (inputs, targets), (full_inputs, full_targets), indices in zip(
            variable_micro_batches(corpus, batches, context, lengths), fixed, batches):
        sizes = lengths[torch.tensor(indices)].tolist()
        assert inputs.shape == targets.shape == (len(indices), max(sizes)) and inputs.dtype == torch.long
        for row, size in enumerate(sizes):
            assert torch.equal(inputs[row, :size], full_inputs[row, :size])  # the window's own start
            assert torch.equal(targets[row, :size], full_targets[row, :size])
            assert (inputs[row, size:] == PAD_TOKEN).all() and (targets[row, size:] == IGNORE_INDEX).all()


def test_the_loss_ignores_padding():
    from examples.gpt.model import language_model_loss

    logits, targets = torch.randn(2, 5, 256), torch.randint(0, 256, (2, 5))
    padded = torch.cat([targets[:, :3], torch.full((2, 2), IGNORE_INDEX)], dim=1)
    assert torch.equal(language_model_loss(logits, padded), language_model_loss(logits[:, :3], targets[:, :3]))


@pytest.mark.parametrize("config, flags, message", [
    ("variable_lengths", [], "max_sequence_length = 64 plans for micro-batches of variable length: add "
                             "--variable-lengths"),
    ("planned", ["--variable-lengths"], "a budget with --variable-lengths needs "
                                        "activation_checkpointing.max_sequence_length"),
    ("variable_lengths", ["--variable-lengths", "--context", "96"], "max_sequence_length = 64 is less than "
                                                                    "--context = 96"),
])
def test_a_config_that_does_not_match_variable_lengths_is_refused(capsys, config, flags, message):
    from examples.gpt.train import parse_args

    path = str(Path(__file__).resolve().parents[2] / "examples" / "gpt" / "configs" / f"{config}.json")
    with pytest.raises(SystemExit):
        parse_args(["--deepspeed_config", path, *flags])
    error = capsys.readouterr().err
    assert f"error: {path}: " in error and message in error, error


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="dim = 60 is not divisible by heads = 8"):
        GPTConfig(dim=60, heads=8)
    with pytest.raises(ValueError, match="dropout = 1.0 is invalid"):
        GPTConfig(dropout=1.0)


def test_weights_depend_on_the_seed_and_layer_only():
    config = GPTConfig()
    torch.manual_seed(123)  # the default generator plays no part
    first = [spec.build().state_dict() for spec in gpt_layer_specs(config, seed=1)]
    torch.manual_seed(456)
    second = [spec.build().state_dict() for spec in gpt_layer_specs(config, seed=1)]
    for a, b in zip(first, second):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(first[0]["weight"], first[-1]["weight"])  # both embedding positions
    other = gpt_layer_specs(config, seed=2)[2].build().state_dict()
    assert not torch.equal(other["qkv.weight"], first[2]["qkv.weight"])


def test_model_is_causal_and_the_head_uses_the_embedding():
    config = GPTConfig(dropout=0.0)
    embed, position, block = TokenEmbedding(config, 0), PositionEmbedding(config, 1), Block(config, 2)
    tokens = torch.randint(0, 256, (2, 16))
    changed = tokens.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 256
    out, out_changed = (block(position(embed(t))) for t in (tokens, changed))
    assert torch.equal(out[:, :10], out_changed[:, :10])  # positions before 10 do not see later tokens
    assert not torch.equal(out[:, 10:], out_changed[:, 10:])
    logits = lm_head(embed, out)
    assert logits.shape == (2, 16, 256)
    assert torch.allclose(logits, out @ embed.weight.T)


def test_position_table_rejects_a_longer_sequence():
    config = GPTConfig(context=8)
    with pytest.raises(ValueError, match="sequence of 9 tokens is longer than the model's context"):
        PositionEmbedding(config, 0)(torch.zeros(1, 9, config.dim))
