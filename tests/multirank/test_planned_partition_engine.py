"""``PipelineModule(partition_method="planned")`` under DeepSpeed's engine
(2 ranks, pp=2): every rank agrees on the cut, training reproduces the
losses of DeepSpeed's uniform cut (the math does not depend on where the
stages are cut), and a saved profile is read back instead of profiling again."""

from __future__ import annotations

import json

import pytest

from ds_pipe_ckpt.planning.planned_partition import PROFILE_FORMAT
from ds_pipe_ckpt.testing import run_ranks

import partition_jobs


TIMEOUT = 240


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory):
    return str(tmp_path_factory.mktemp("partition") / "profile.json")


@pytest.fixture(scope="module")
def runs(profile_path):
    planned = run_ranks(partition_jobs.train_with_partition, 2, "planned", 64.0, profile_path, timeout=TIMEOUT)
    uniform = run_ranks(partition_jobs.train_with_partition, 2, "uniform", None, None, timeout=TIMEOUT)
    again = run_ranks(partition_jobs.train_with_partition, 2, "planned", 64.0, profile_path, timeout=TIMEOUT)
    return planned, uniform, again


def test_a_config_without_gradient_accumulation_steps_trains_planned(runs, profile_path):
    """DeepSpeed derives gradient_accumulation_steps from train_batch_size and
    train_micro_batch_size_per_gpu (32 / 8 / 1 data-parallel rank = 4): so does
    the planned partition, read by partition_from_config and trained through
    ds_pipe_ckpt.initialize."""
    planned, uniform, _ = runs
    derived = run_ranks(partition_jobs.train_with_partition, 2, "planned", 64.0, profile_path, 3, True,
                        timeout=TIMEOUT)
    assert "planned for 2 stages, 4 micro-batches per step" in derived[0]["profile_source"]
    assert derived[0]["boundaries"] == planned[0]["boundaries"]
    assert derived[1]["losses"] == uniform[1]["losses"]


def test_every_rank_agrees_on_the_planned_cut(runs):
    planned, _, _ = runs
    assert planned[0]["boundaries"] == planned[1]["boundaries"] == planned[0]["parts"]
    start, middle, end = planned[0]["boundaries"]
    assert (start, end) == (0, 7) and 0 < middle < 7
    assert [run["local_layers"] for run in planned] == [middle, 7 - middle]


def test_the_planned_cut_trains_as_the_uniform_one(runs):
    """Same layers, same seeds, same data: the losses of any cut are the same
    sums in the same order (no tied weights here), so bit for bit."""
    planned, uniform, _ = runs
    assert planned[1]["losses"] == uniform[1]["losses"]  # the last stage reports the loss


def test_a_saved_profile_is_read_and_gives_the_same_cut(runs, profile_path):
    planned, _, again = runs
    data = json.loads(open(profile_path).read())
    assert data["format"] == PROFILE_FORMAT and len(data["layers"]) == 7
    assert planned[0]["profile_source"].startswith(f"profiled and saved to {profile_path}")
    assert again[0]["profile_source"].startswith(f"read from {profile_path}")
    assert "planned for 2 stages, 4 micro-batches per step, budgets 64.00, 64.00 MiB" in again[0]["profile_source"]
    assert again[0]["boundaries"] == planned[0]["boundaries"]


def test_the_loss_is_profiled_with_the_labels(runs, profile_path):
    """CrossEntropyLoss on [8, 4] logits saves their log-probabilities (128 B)
    and a 4-byte total weight beyond its inputs."""
    data = json.loads(open(profile_path).read())
    assert data["loss_saved_bytes"] == 8 * 4 * 4 + 4 and data["loss_s"] > 0
    assert data["sample"] == [[[8, 8], "torch.float32"]] and data["labels"] == [[[8], "torch.int64"]]
