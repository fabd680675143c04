"""Configuration: strict validation with errors that name the key, the value
and what is allowed; configure() semantics; initialize() signature."""

import inspect
import json
import logging

import deepspeed
import pytest
import torch

import ds_pipe_ckpt
from ds_pipe_ckpt import CheckpointingConfig, ConfigError
from ds_pipe_ckpt.compat import DEEPSPEED_VERSION
from ds_pipe_ckpt.parallel import TensorParallelGroup


@pytest.mark.parametrize("value", ["false", "False", 0, 1, [False]])
def test_use_reentrant_must_be_a_json_boolean(value):
    with pytest.raises(ConfigError, match=r"pipeline\.use_reentrant = .* expected a JSON boolean") as err:
        CheckpointingConfig.from_ds_config({"pipeline": {"use_reentrant": value}})
    assert err.value.key == "pipeline.use_reentrant" and err.value.value == value


@pytest.mark.parametrize("flag", [True, False])
def test_use_reentrant_booleans(flag):
    assert CheckpointingConfig.from_ds_config({"pipeline": {"use_reentrant": flag}}).use_reentrant is flag


def test_absent_means_reentrant():
    assert CheckpointingConfig.from_ds_config({}).use_reentrant is True
    assert CheckpointingConfig.from_ds_config({"pipeline": {}}).use_reentrant is True


@pytest.mark.parametrize("value", [-1, 1.5, "2", True])
def test_interval_must_be_a_non_negative_integer(value):
    with pytest.raises(ConfigError, match=r"pipeline\.activation_checkpoint_interval = .* integer >= 0"):
        CheckpointingConfig.from_ds_config({"pipeline": {"activation_checkpoint_interval": value}})


def test_unknown_activation_checkpointing_key_is_rejected():
    with pytest.raises(ConfigError, match=r"activation_checkpointing\.partition_activation = True.*check the spelling"):
        CheckpointingConfig.from_ds_config({"activation_checkpointing": {"partition_activation": True}})


def test_activation_checkpointing_values_are_typed():
    with pytest.raises(ConfigError, match=r"activation_checkpointing\.cpu_checkpointing = 'yes'"):
        CheckpointingConfig.from_ds_config({"activation_checkpointing": {"cpu_checkpointing": "yes"}})
    with pytest.raises(ConfigError, match=r"activation_checkpointing\.number_checkpoints = 0"):
        CheckpointingConfig.from_ds_config({"activation_checkpointing": {"number_checkpoints": 0}})


def test_contiguous_buffers_need_partitioning_and_number_checkpoints():
    with pytest.raises(ConfigError, match="contiguous_memory_optimization = True.*partition_activations"):
        CheckpointingConfig(contiguous_memory_optimization=True, number_checkpoints=4)
    with pytest.raises(ConfigError, match="number_checkpoints = None.*positive integer when contiguous"):
        CheckpointingConfig(partition_activations=True, contiguous_memory_optimization=True)


def test_debug_needs_non_reentrant():
    with pytest.raises(ConfigError, match=r"activation_checkpointing\.debug = True.*use_reentrant is false"):
        CheckpointingConfig.from_ds_config({"activation_checkpointing": {"debug": True}})
    cfg = CheckpointingConfig.from_ds_config({"pipeline": {"use_reentrant": False},
                                              "activation_checkpointing": {"debug": True}})
    assert cfg.debug


def test_section_must_be_an_object():
    with pytest.raises(ConfigError, match=r"pipeline = \[\] is invalid: expected a JSON object"):
        CheckpointingConfig.from_ds_config({"pipeline": []})


def test_configure_starts_from_defaults_each_call():
    ds_pipe_ckpt.configure(use_reentrant=False)
    assert ds_pipe_ckpt.current_settings().config.use_reentrant is False
    ds_pipe_ckpt.configure()
    assert ds_pipe_ckpt.current_settings().config == CheckpointingConfig()


def test_configure_overrides_beat_the_config_and_none_keeps_it(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"pipeline": {"use_reentrant": False}}))
    assert ds_pipe_ckpt.configure(deepspeed_config=str(path)).config.use_reentrant is False
    assert ds_pipe_ckpt.configure(deepspeed_config=str(path), use_reentrant=None).config.use_reentrant is False
    assert ds_pipe_ckpt.configure(deepspeed_config=str(path), use_reentrant=True).config.use_reentrant is True


def test_configure_rejects_unknown_keywords():
    with pytest.raises(TypeError, match="unexpected keyword argument 'partition'"):
        ds_pipe_ckpt.configure(partition=True)


def test_configure_rejects_bad_override_values():
    with pytest.raises(ConfigError, match=r"pipeline\.use_reentrant = 'false'"):
        ds_pipe_ckpt.configure(use_reentrant="false")


def test_partitioning_without_a_model_parallel_group_is_a_group_of_one(caplog):
    """Upstream trains with partition_activations and no mpu: so do we, over one rank."""
    with caplog.at_level(logging.INFO, logger="ds_pipe_ckpt"):
        settings = ds_pipe_ckpt.configure(use_reentrant=False, partition_activations=True)
    assert settings.model_parallel.world_size == 1 and settings.config.partition_activations
    assert sum("no model-parallel unit (mpu) was given" in m for m in caplog.messages) == 1
    torch.manual_seed(0)
    lin, x = torch.nn.Linear(3, 3), torch.randn(2, 3, requires_grad=True)
    ds_pipe_ckpt.checkpoint(lin, x).sum().backward()
    expected = torch.autograd.grad(lin(x).sum(), [x, *lin.parameters()])
    got = [x.grad, *(p.grad for p in lin.parameters())]
    assert all(torch.equal(a, b) for a, b in zip(expected, got))


def test_configure_has_deepspeeds_signature():
    """Upstream's argument names and positional order, mpu_ included."""
    ours = list(inspect.signature(ds_pipe_ckpt.configure).parameters.values())
    upstream = list(inspect.signature(deepspeed.checkpointing.configure).parameters.values())
    assert [(p.name, p.kind) for p in ours[:len(upstream)]] == [(p.name, p.kind) for p in upstream]
    assert all(p.default is None for p in ours[1:len(upstream)])


def test_configure_accepts_lightnings_call():
    """Lightning's DeepSpeedStrategy configures activation checkpointing with exactly
    this call (mpu_=None, values from the config's section, None when absent)."""
    section = {"partition_activations": True, "cpu_checkpointing": False}
    settings = ds_pipe_ckpt.configure(mpu_=None, partition_activations=section.get("partition_activations"),
                                      contiguous_checkpointing=section.get("contiguous_memory_optimization"),
                                      checkpoint_in_cpu=section.get("cpu_checkpointing"),
                                      profile=section.get("profile"))
    assert settings.config.partition_activations and settings.model_parallel.world_size == 1
    lin = torch.nn.Linear(2, 2)
    with pytest.warns(ds_pipe_ckpt.ReentrantFallbackWarning):  # a batch without grad, as in seed 000
        for _ in range(2):
            ds_pipe_ckpt.checkpoint(lin, torch.randn(3, 2)).sum().backward()
    assert lin.weight.grad is not None


def test_configure_accepts_upstream_calls():
    """(Non-reentrant, so that no process group is needed for the offload option.)"""
    mpu = TensorParallelGroup.single()
    non_reentrant = {"pipeline": {"use_reentrant": False}}
    settings = ds_pipe_ckpt.configure(mpu_=mpu, deepspeed_config=non_reentrant, checkpoint_in_cpu=True)
    assert settings.model_parallel is mpu and settings.config.cpu_checkpointing and not settings.config.use_reentrant
    settings = ds_pipe_ckpt.configure(mpu, non_reentrant, True, None, None, True, None, None)  # positionally
    assert settings.config.partition_activations and settings.config.cpu_checkpointing
    assert ds_pipe_ckpt.configure(mpu=mpu).model_parallel is mpu  # our keyword, still accepted
    with pytest.raises(TypeError, match="two model-parallel units"):
        ds_pipe_ckpt.configure(mpu_=mpu, mpu=TensorParallelGroup.single())


def test_bad_mpu_is_named():
    with pytest.raises(ConfigError, match="mpu = .*get_model_parallel_group"):
        ds_pipe_ckpt.configure(mpu=object())


def test_unreadable_config_is_named():
    with pytest.raises(ConfigError, match="deepspeed_config = 'no-such-file.json'"):
        ds_pipe_ckpt.configure(deepspeed_config="no-such-file.json")


def test_checkpoint_argument_errors():
    lin = torch.nn.Linear(2, 2)
    x = torch.randn(1, 2, requires_grad=True)
    with pytest.raises(ConfigError, match="use_reentrant = 'no'"):
        ds_pipe_ckpt.checkpoint(lin, x, use_reentrant="no")
    with pytest.raises(ConfigError, match="debug = True.*use_reentrant=True"):
        ds_pipe_ckpt.checkpoint(lin, x, use_reentrant=True, debug=True)
    with pytest.raises(TypeError, match="expects a callable"):
        ds_pipe_ckpt.checkpoint(x, x)


def test_initialize_has_deepspeeds_signature():
    ours = inspect.signature(ds_pipe_ckpt.initialize).parameters
    theirs = inspect.signature(deepspeed.initialize).parameters
    assert list(ours) == list(theirs)
    assert [p.default for p in ours.values()] == [p.default for p in theirs.values()]


@pytest.mark.parametrize("config, key", [
    ({"pipeline": {"use_reentrant": "false"}}, "pipeline.use_reentrant"),
    ({"pipeline": {"activation_checkpoint_interval": -2}}, "pipeline.activation_checkpoint_interval"),
    ({"activation_checkpointing": {"profiling": True}}, "activation_checkpointing.profiling"),
    # Read when the module is built (partition_from_config): never silently ignored.
    ({"pipeline": {"partition_method": "planned"}}, "pipeline.partition_method"),
    ({"pipeline": {"partition_profile": "profile.json"}}, "pipeline.partition_profile"),
])
def test_initialize_validates_before_building_anything(config, key):
    # No process group exists in this process: the error must come first.
    with pytest.raises(ConfigError) as err:
        ds_pipe_ckpt.initialize(model=torch.nn.Linear(2, 2), config=config)
    assert err.value.key == key


def test_initialize_reads_args_deepspeed_config(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"pipeline": {"use_reentrant": "no"}}))

    class Args:
        deepspeed_config = str(path)

    with pytest.raises(ConfigError, match="pipeline.use_reentrant = 'no'"):
        ds_pipe_ckpt.initialize(args=Args(), model=torch.nn.Linear(2, 2))


@pytest.mark.parametrize("kwargs, match", [
    ({"activation_checkpoint_interval": -1}, r"activation_checkpoint_interval = -1 is invalid: expected an integer >= 0"),
    ({"activation_checkpoint_interval": 2.0}, r"activation_checkpoint_interval = 2\.0"),
    ({"checkpointable_layers": "Linear"}, r"checkpointable_layers = 'Linear' is invalid: expected a list of layer class names"),
    ({"checkpointable_layers": [torch.nn.Linear]}, r"checkpointable_layers = .* list of layer class names"),
    ({"activation_checkpoint_func": "checkpoint"}, r"activation_checkpoint_func = 'checkpoint' is invalid: expected a callable"),
])
def test_pipeline_module_arguments_are_validated(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        ds_pipe_ckpt.PipelineModule(layers=[torch.nn.Linear(2, 2)], num_stages=1, **kwargs)


def test_verify_recompute_needs_non_reentrant():
    with pytest.raises(ConfigError, match=r"activation_checkpointing\.verify_recompute = True is invalid: "
                                          r"expected false unless pipeline\.use_reentrant is false"):
        CheckpointingConfig.from_ds_config({"activation_checkpointing": {"verify_recompute": True}})


# -- upstream's asserts: code that catches what DeepSpeed raises catches ours --------------

def _upstream_configure(**kwargs):
    from deepspeed.runtime.activation_checkpointing import checkpointing as ds_checkpointing

    return ds_checkpointing.configure(mpu_=None, **kwargs)


UPSTREAM_CONFIGURE_ASSERTS = [
    # DeepSpeed's test_configure_with_contiguous_checkpointing_requires_num_checkpoints
    pytest.param({"partition_activations": True, "contiguous_checkpointing": True}, "number of layers",
                 id="contiguous_without_num_checkpoints",
                 marks=pytest.mark.skipif(DEEPSPEED_VERSION[:2] < (0, 19), reason=(
                     "DeepSpeed before 0.19 does not assert this; ours raises the same ConfigError on every "
                     "version (test_contiguous_buffers_need_partitioning_and_number_checkpoints)"))),
    pytest.param({"partition_activations": False, "contiguous_checkpointing": True, "num_checkpoints": 4},
                 "only available with partitioned activations", id="contiguous_without_partitioning"),
]


@pytest.mark.parametrize("kwargs, words", UPSTREAM_CONFIGURE_ASSERTS)
def test_configure_raises_what_upstream_asserts(kwargs, words):
    with pytest.raises(AssertionError, match=words) as upstream:
        _upstream_configure(**kwargs)
    with pytest.raises(AssertionError, match=words) as ours:
        ds_pipe_ckpt.configure(mpu_=None, **kwargs)
    assert isinstance(ours.value, ConfigError) and isinstance(ours.value, ValueError)
    assert str(upstream.value).split(".")[0] in str(ours.value)  # upstream's words, and ours before them
    assert str(ours.value).startswith("activation_checkpointing.")


UPSTREAM_PIPELINE_ASSERTS = [
    pytest.param(lambda m: m(checkpointable_layers="Linear"), "must be type of list", id="checkpointable_layers"),
    pytest.param(lambda m: m().set_checkpoint_interval(-1), "interval >= 0", id="negative_interval"),
]


@pytest.mark.parametrize("build, words", UPSTREAM_PIPELINE_ASSERTS)
def test_pipeline_module_raises_what_upstream_asserts(single_rank_process_group, build, words):
    import functools

    import deepspeed.pipe
    import torch.nn as nn

    def module(cls, **kwargs):
        return cls(layers=[nn.Linear(2, 2)], num_stages=1, **kwargs)

    with pytest.raises(AssertionError) as upstream:
        build(functools.partial(module, deepspeed.pipe.PipelineModule))
    with pytest.raises(AssertionError, match=words) as ours:
        build(functools.partial(module, ds_pipe_ckpt.PipelineModule))
    assert isinstance(ours.value, ConfigError)
    assert str(upstream.value) in str(ours.value)
