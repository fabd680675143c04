"""``PipelineModule(partition_method="planned")`` under DeepSpeed's engine
(2 ranks, pp=2): every rank agrees on the cut, training reproduces the
losses of DeepSpeed's uniform cut (the math does not depend on where the
stages are cut), a saved profile is read back instead of profiling again,
and bad settings are named."""

from __future__ import annotations

import json

import pytest
import torch.nn as nn

from ds_pipe_ckpt import ConfigError, LayerSpec, PipelineModule
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
    assert again[0]["boundaries"] == planned[0]["boundaries"]


def test_planned_without_its_settings_is_named():
    with pytest.raises(ConfigError, match="partition_method.*planned.*partition_planning"):
        PipelineModule(layers=[LayerSpec(nn.Linear, 2, 2)] * 2, num_stages=1, partition_method="planned")
