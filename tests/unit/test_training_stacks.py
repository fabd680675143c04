"""Training stacks switched by one import (GPT-NeoX, Megatron-DeepSpeed): what
they configure in code is in force, ds_pipe_ckpt.initialize undoes none of it,
and one use_reentrant holds for the whole job. Shaped like the stacks' calls,
on our own small models; the pp=2 x mp=2 runs, where partitioning really
splits, are in test_partition_distributed.py."""

from __future__ import annotations

import functools
import logging

import deepspeed
import pytest
import torch
import torch.nn as nn
from deepspeed.runtime.activation_checkpointing import checkpointing as ds_checkpointing

import ds_pipe_ckpt
from ds_pipe_ckpt import LayerSpec, PipelineModule, upstream_checkpointing
from ds_pipe_ckpt.errors import ConfigError

SECTION_KEYS = ("partition_activations", "cpu_checkpointing", "synchronize_checkpoint_boundary", "profile",
                "number_checkpoints", "use_reentrant")


def _in_force(*keys):
    config = ds_pipe_ckpt.current_settings().config
    return {key: getattr(config, key) for key in keys or SECTION_KEYS}


def _pipeline(**kwargs):
    torch.manual_seed(0)
    return PipelineModule([LayerSpec(nn.Linear, 6, 6), LayerSpec(nn.Tanh), LayerSpec(nn.Linear, 6, 3)],
                          num_stages=1, partition_method="uniform", loss_fn=nn.CrossEntropyLoss(),
                          activation_checkpoint_interval=1, **kwargs)


def _json(**sections):
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, **sections}


def _initialize(module, config, via=ds_pipe_ckpt.initialize):
    engine, *_ = via(model=module, model_parameters=module.parameters(), config=config)
    return engine


def test_deepspeeds_configure_is_ds_pipe_ckpts(single_rank_process_group):
    """GPT-NeoX's call, on DeepSpeed's module: the same values govern ds_pipe_ckpt."""
    deepspeed.checkpointing.configure(None, partition_activations=True, num_checkpoints=3, checkpoint_in_cpu=True,
                                      synchronize=True, profile=False)
    assert _in_force() == {"partition_activations": True, "cpu_checkpointing": True,
                           "synchronize_checkpoint_boundary": True, "profile": False, "number_checkpoints": 3,
                           "use_reentrant": True}
    assert ds_pipe_ckpt.current_settings().sources.program_call == "deepspeed.checkpointing.configure()"
    # And DeepSpeed's own module holds them (for upstream's reentrant checkpoint).
    upstream = (ds_checkpointing.CPU_CHECKPOINT, ds_checkpointing.SYNCHRONIZE, ds_checkpointing.num_layers)
    assert upstream == (True, True, 3)


def test_initialize_undoes_nothing_a_program_configured(single_rank_process_group):
    """The issue's report: configure(mpu, partition, synchronize) then initialize with
    a JSON without activation_checkpointing reset both modules to the defaults."""
    deepspeed.checkpointing.configure(None, partition_activations=True, checkpoint_in_cpu=True, synchronize=True)
    before = _in_force()
    _initialize(_pipeline(), _json(pipeline={"use_reentrant": False}))
    assert _in_force() == {**before, "use_reentrant": False}
    assert (ds_checkpointing.CPU_CHECKPOINT, ds_checkpointing.SYNCHRONIZE) == (True, True)


def test_code_over_json_over_defaults_and_the_log_says_which(single_rank_process_group, caplog):
    ds_pipe_ckpt.configure(synchronize=True, checkpoint_in_cpu=True)
    with caplog.at_level(logging.WARNING, logger="ds_pipe_ckpt"):
        _initialize(_pipeline(), _json(pipeline={"use_reentrant": False}, activation_checkpointing={
            "synchronize_checkpoint_boundary": False, "profile": True}))
    # The call's keywords win; the JSON's other keys hold; the rest are defaults.
    assert _in_force() == {"partition_activations": False, "cpu_checkpointing": True,
                           "synchronize_checkpoint_boundary": True, "profile": True, "number_checkpoints": None,
                           "use_reentrant": False}
    notes = [r.getMessage() for r in caplog.records if "is in force" in r.getMessage()]
    assert notes == ["ds_pipe_ckpt: activation_checkpointing.synchronize_checkpoint_boundary = False in the JSON, "
                     "True by ds_pipe_ckpt.configure(): True is in force"]


def test_a_configure_call_after_initialize_keeps_the_jsons_other_keys(single_rank_process_group):
    """Megatron-DeepSpeed configures after the engine is built."""
    _initialize(_pipeline(), _json(pipeline={"use_reentrant": False}, activation_checkpointing={"profile": True}))
    deepspeed.checkpointing.configure(None, checkpoint_in_cpu=True)
    assert _in_force("profile", "cpu_checkpointing", "use_reentrant") == {
        "profile": True, "cpu_checkpointing": True, "use_reentrant": False}
    # The latest call wins: the next one replaces it, and the JSON still holds.
    deepspeed.checkpointing.configure(None, synchronize=True)
    assert _in_force("profile", "cpu_checkpointing", "synchronize_checkpoint_boundary") == {
        "profile": True, "cpu_checkpointing": False, "synchronize_checkpoint_boundary": True}


def test_a_configure_calls_deepspeed_config_counts_as_the_call(single_rank_process_group, tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, '
                    '"activation_checkpointing": {"cpu_checkpointing": true, "profile": true}}')
    deepspeed.checkpointing.configure(None, deepspeed_config=str(path), profile=False)
    assert _in_force("cpu_checkpointing", "profile") == {"cpu_checkpointing": True, "profile": False}


def test_reset_every_step_changes_no_setting(single_rank_process_group):
    deepspeed.checkpointing.configure(None, checkpoint_in_cpu=True, synchronize=True)
    before = ds_pipe_ckpt.current_settings()
    deepspeed.checkpointing.reset()
    ds_pipe_ckpt.reset()
    assert ds_pipe_ckpt.current_settings() is before


def test_a_change_behind_the_wrapper_is_adopted(single_rank_process_group, caplog):
    """A stack that imported DeepSpeed's configure before ds_pipe_ckpt: the
    settings read DeepSpeed's module, so they cannot go stale."""
    with caplog.at_level(logging.WARNING, logger="ds_pipe_ckpt"):
        upstream_checkpointing.ORIGINAL_CONFIGURE(None, checkpoint_in_cpu=True, num_checkpoints=4)
        assert _in_force("cpu_checkpointing", "number_checkpoints") == {"cpu_checkpointing": True,
                                                                        "number_checkpoints": 4}
        ds_checkpointing.SYNCHRONIZE = True  # a global set by hand
        assert _in_force("synchronize_checkpoint_boundary") == {"synchronize_checkpoint_boundary": True}
    assert sum("behind ds_pipe_ckpt's wrapper" in r.getMessage() for r in caplog.records) == 2


def test_the_engines_use_reentrant_is_ds_pipe_ckpt_checkpoints_too(single_rank_process_group):
    """Built by deepspeed.initialize, not ours: the JSON's false still reaches
    ds_pipe_ckpt.checkpoint, which then keeps a frozen input's parameter gradients."""
    # The interval in the JSON too: before 0.19 DeepSpeed's engine reads use_reentrant only then.
    _initialize(_pipeline(), _json(pipeline={"use_reentrant": False, "activation_checkpoint_interval": 1}),
                via=deepspeed.initialize)
    assert ds_pipe_ckpt.current_settings().config.use_reentrant is False


def test_one_mode_per_job(single_rank_process_group):
    ds_pipe_ckpt.configure(use_reentrant=True)
    module = _pipeline()
    engine = _initialize(module, _json(pipeline={"use_reentrant": False, "activation_checkpoint_interval": 1}),
                         via=deepspeed.initialize)
    batch = iter([(torch.randn(2, 6), torch.tensor([0, 2]))])
    with pytest.raises(ConfigError, match=r"use_reentrant.*pipeline\.use_reentrant in the JSON"):
        engine.train_batch(data_iter=batch)


class _Layer(nn.Module):
    """A stack's layer that checkpoints itself through DeepSpeed, keyword arguments included."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(5, 5)

    def block(self, x, *, scale):
        return torch.tanh(self.linear(x)) * scale

    def forward(self, x):
        return deepspeed.checkpointing.checkpoint(functools.partial(self.block), x, scale=2.0)


def _layer_gradients(run):
    torch.manual_seed(1)
    layer = _Layer()
    x = torch.randn(3, 5)  # an input that does not require grad, as a stack's embedding output may not
    loss = run(layer, x).square().sum()
    if loss.requires_grad:  # upstream's reentrant checkpoint here returns a loss without a graph
        loss.backward()
    return [None if p.grad is None else p.grad.clone() for p in layer.parameters()]


def test_routed_deepspeed_checkpoint_calls_run_ds_pipe_ckpts(single_rank_process_group):
    ds_pipe_ckpt.configure(use_reentrant=False)
    ds_pipe_ckpt.route_deepspeed_checkpoint()
    routed = _layer_gradients(lambda layer, x: layer(x))
    plain = _layer_gradients(lambda layer, x: layer.block(x, scale=2.0))
    assert all(g is not None for g in routed)
    for got, want in zip(routed, plain):
        assert torch.equal(got, want)
    ds_pipe_ckpt.route_deepspeed_checkpoint(False)
    assert not ds_pipe_ckpt.current_settings().routes_deepspeed_checkpoint


@pytest.mark.deepspeed_reentrant
def test_unrouted_calls_stay_upstreams_and_the_log_says_so_once(single_rank_process_group, caplog):
    ds_pipe_ckpt.configure(use_reentrant=False)
    with caplog.at_level(logging.WARNING, logger="ds_pipe_ckpt"):
        upstreams = _layer_gradients(lambda layer, x: layer(x))
        _layer_gradients(lambda layer, x: layer(x))
    # DeepSpeed's reentrant checkpoint, unchanged: no input requires grad, so the
    # output has no graph and the parameters get no gradient (what the opt-in fixes).
    assert upstreams == [None, None]
    notes = [r.getMessage() for r in caplog.records if "route_deepspeed_checkpoint" in r.getMessage()]
    assert len(notes) == 1 and "_Layer.block" in notes[0], notes


def test_route_takes_a_boolean():
    with pytest.raises(ConfigError, match="route_deepspeed_checkpoint"):
        ds_pipe_ckpt.route_deepspeed_checkpoint("yes")


def test_restore_defaults_forgets_every_source(single_rank_process_group):
    deepspeed.checkpointing.configure(None, checkpoint_in_cpu=True)
    ds_pipe_ckpt.route_deepspeed_checkpoint()
    from ds_pipe_ckpt.settings import restore_defaults

    settings = restore_defaults()
    assert settings.config == ds_pipe_ckpt.CheckpointingConfig() and not settings.routes_deepspeed_checkpoint
    assert ds_checkpointing.CPU_CHECKPOINT is False
