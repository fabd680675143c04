"""``PipelineModule(partition_method="planned")`` under DeepSpeed's engine
(2 ranks, pp=2): every rank agrees on the cut, training reproduces the
losses of DeepSpeed's uniform cut (the math does not depend on where the
stages are cut), a saved profile is read back instead of profiling again,
and bad settings are named."""

from __future__ import annotations


import pytest
import torch
import torch.nn as nn

from ds_pipe_ckpt import ConfigError, LayerSpec, PartitionPlanning, PipelineModule
from ds_pipe_ckpt.planning.layer_profiling import spec_name
from ds_pipe_ckpt.planning.planned_partition import partition_from_config, planned_partition

import partition_jobs


def test_a_profile_of_another_micro_batch_is_measured_again(tmp_path):
    path = tmp_path / "profile.json"
    specs = partition_jobs.layer_specs()
    names = [spec_name(spec) for spec in specs]

    def planning(batch):
        return PartitionPlanning(memory_budget_mb=64.0, micro_batches=4, sample=torch.randn(batch, 8),
                                 profile_path=str(path))
    _, _, note = planned_partition(specs, names, 2, planning(8))
    assert note.startswith(f"profiled and saved to {path}")
    _, _, note = planned_partition(specs, names, 2, planning(8))
    assert note.startswith(f"read from {path}")
    _, chain, note = planned_partition(specs, names, 2, planning(16))
    assert note.startswith(f"{path} was measured on a sample of [[[8, 8], 'torch.float32']], not "
                           "[[[16, 8], 'torch.float32']]; profiled again and rewritten")
    assert chain.layers[0].input_bytes == 16 * 8 * 4
    _, _, note = planned_partition(specs, names[:-1] + ["Other"], 2, planning(16))
    assert "describes other layers" in note


def test_the_planning_reads_the_deepspeed_config():
    config = {"gradient_accumulation_steps": 6, "pipeline": {"use_reentrant": False, "partition_profile": "p.json"},
              "activation_checkpointing": {"memory_budget_mb": [40, 60]}}
    planning = PartitionPlanning.from_config(config, sample="x", labels="y")
    assert (planning.memory_budget_mb, planning.micro_batches, planning.profile_path) == ([40, 60], 6, "p.json")
    assert (planning.sample, planning.labels) == ("x", "y")
    assert planning.budgets_bytes(2) == (40 * 2**20, 60 * 2**20)


def test_the_micro_batches_are_derived_as_deepspeed_derives_them():
    planning = PartitionPlanning.from_config({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4,
                                              "pipeline": {"use_reentrant": False},
                                              "activation_checkpointing": {"memory_budget_mb": 40}})
    assert planning.micro_batches is None
    assert [planning.micro_batches_for(dp) for dp in (1, 2, 4)] == [16, 8, 4]
    with pytest.raises(ConfigError, match=r"train_batch_size = 64 is invalid: expected train_micro_batch_size_per_gpu "
                                          r"x gradient_accumulation_steps x data-parallel size = 4 x 5 x 3"):
        planning.micro_batches_for(3)
    only_micro = PartitionPlanning(memory_budget_mb=40, train_micro_batch_size_per_gpu=4)
    assert only_micro.micro_batches_for(2) == 1  # DeepSpeed: train_batch_size = micro x data parallel


@pytest.mark.parametrize("change, match", [
    (dict(activation_checkpointing={}), "activation_checkpointing.memory_budget_mb.*each stage's budget"),
    (dict(activation_checkpointing={"max_memory_mb": 100}), "max_memory_mb.*give activation_checkpointing.memory_b"),
    (dict(gradient_accumulation_steps=0), "gradient_accumulation_steps.*a positive int"),
    (dict(gradient_accumulation_steps=None), "gradient_accumulation_steps = None .*or train_batch_size and train_mic"),
    (dict(gradient_accumulation_steps=None, train_batch_size=2.5), "train_batch_size = 2.5 .*a positive integer"),
    (dict(pipeline={"use_reentrant": False, "partition_profile": 3}), "pipeline.partition_profile.*a file path"),
    (dict(pipeline={"use_reentrant": True}), "memory_budget_mb.*null unless pipeline.use_reentrant is false"),
])
def test_a_bad_planning_config_is_named(change, match):
    config = {"gradient_accumulation_steps": 4, "pipeline": {"use_reentrant": False},
              "activation_checkpointing": {"memory_budget_mb": 40}} | change
    with pytest.raises(ConfigError, match=match):
        PartitionPlanning.from_config(config)


def test_planned_without_its_settings_is_named():
    with pytest.raises(ConfigError, match="partition_method.*planned.*partition_planning"):
        PipelineModule(layers=[LayerSpec(nn.Linear, 2, 2)] * 2, num_stages=1, partition_method="planned")


def test_the_partition_method_comes_from_the_config():
    assert partition_from_config({}, default="type:Block") == ("type:Block", None)
    assert partition_from_config({"pipeline": {"partition_method": "uniform"}}) == ("uniform", None)
    method, planning = partition_from_config(
        {"gradient_accumulation_steps": 2, "pipeline": {"partition_method": "planned", "use_reentrant": False},
         "activation_checkpointing": {"memory_budget_mb": 12.5}}, sample="x")
    assert method == "planned" and (planning.memory_budget_mb, planning.micro_batches, planning.sample) == \
        (12.5, 2, "x")
    with pytest.raises(ConfigError, match="pipeline.partition_method = 3"):
        partition_from_config({"pipeline": {"partition_method": 3}})


def test_a_module_cut_otherwise_than_the_config_says_is_named():
    """A module built with another method than pipeline.partition_method is
    caught by initialize before any engine exists."""
    from ds_pipe_ckpt.initialize import _check_partition

    module = PipelineModule.__new__(PipelineModule)
    module.__dict__["partition_method"] = "parameters"
    with pytest.raises(ConfigError, match=r"pipeline.partition_method = 'planned'.*cut with \('parameters'\)"):
        _check_partition(module, {"pipeline": {"partition_method": "planned"}})
    _check_partition(module, {"pipeline": {"partition_method": "Parameters"}})


def test_a_budget_no_cut_fits_is_a_config_error_naming_each_stages_least_budget():
    specs = partition_jobs.layer_specs()
    names = [spec_name(spec) for spec in specs]
    planning = PartitionPlanning.from_config(
        {"gradient_accumulation_steps": 4, "pipeline": {"use_reentrant": False},
         "activation_checkpointing": {"memory_budget_mb": 0.001}}, sample=torch.randn(8, 8))
    with pytest.raises(ConfigError, match=r"activation_checkpointing.memory_budget_mb = 0.001 is invalid: expected a "
                                          r"budget some cut of the layers fits. No cut of 7 layers into 2 stages .*"
                                          r"stage 0: at least [0-9.]+ MiB, stage 1: at least [0-9.]+ MiB"):
        planned_partition(specs, names, 2, planning)
