"""ds_pipe_ckpt.compat: the one place where torch and DeepSpeed versions differ.

The behaviour each difference guards is tested by the rest of the suite, which
``make compat`` runs against every supported pair; here, the switches
themselves, including the branches the installed pair does not take.
"""

from __future__ import annotations

import types
import warnings

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint as torch_checkpoint
from deepspeed.runtime.activation_checkpointing import checkpointing as ds_checkpointing

import ds_pipe_ckpt
from ds_pipe_ckpt import UpstreamLimitError, compat


@pytest.mark.parametrize("text, expected", [("2.14.1", (2, 14, 1)), ("2.13.0+cpu", (2, 13, 0)),
                                            ("2.16.0a0+git1234", (2, 16, 0)), ("0.19", (0, 19, 0))])
def test_version_tuple(text, expected):
    assert compat.version_tuple(text) == expected


def test_the_installed_pair_is_in_the_stated_range_and_setup_py_states_it():
    assert compat.unsupported_versions() == []
    from pathlib import Path
    setup = (Path(__file__).resolve().parents[2] / "setup.py").read_text()
    (torch_low, torch_high), (ds_low, ds_high) = compat.TORCH_RANGE, compat.DEEPSPEED_RANGE
    assert f'"torch>={torch_low[0]}.{torch_low[1]},<{torch_high[0]}.{torch_high[1] + 1}"' in setup
    assert f'"deepspeed>={ds_low[0]}.{ds_low[1]}' in setup and f'<{ds_high[0]}.{ds_high[1] + 1}"' in setup


def test_a_version_outside_the_range_is_named(monkeypatch):
    monkeypatch.setattr(compat, "TORCH_VERSION", (2, 9, 1))
    monkeypatch.setattr(compat, "DEEPSPEED_VERSION", (0, 20, 0))
    problems = compat.unsupported_versions()
    assert problems == ["torch 2.9.1 is outside the range ds_pipe_ckpt is tested with (2.11 to 2.15.x)",
                        "deepspeed 0.20.0 is outside the range ds_pipe_ckpt is tested with (0.16 to 0.19.x)"]


def test_torch_checkpoint_hooks_are_recognised_in_the_forward_and_the_recomputation():
    assert compat.CHECKPOINT_HOOKS_VISIBLE
    seen = []

    def region(x):
        hooks = compat.top_saved_tensors_hooks(False)
        seen.append(compat.is_checkpoint_pack_hook(hooks[0]))
        return x.exp()

    x = torch.randn(3, requires_grad=True)
    with torch.autograd.graph.save_on_cpu():  # a user's pair below torch's: not torch's
        user_pack = compat.top_saved_tensors_hooks(False)[0]
        torch_checkpoint.checkpoint(region, x, use_reentrant=False).sum().backward()
    assert seen == [True, True]
    assert not compat.is_checkpoint_pack_hook(user_pack)
    assert not compat.is_checkpoint_pack_hook(lambda t: t)


def test_backward_keeps_graph_is_none_outside_a_backward():
    assert compat.backward_keeps_graph() is None


def _engine(pipeline: dict, method=None):
    engine = types.SimpleNamespace(_config=types.SimpleNamespace(pipeline=pipeline))
    if method is not None:
        engine._reentrant_activation_checkpointing = method
    return engine


def test_engine_inputs_require_grad_reads_the_config_before_deepspeed_0_19():
    assert compat.engine_inputs_require_grad(_engine({}, method=lambda: True))  # 0.19: the engine says
    assert not compat.engine_inputs_require_grad(_engine({"activation_checkpoint_interval": 0}))
    assert compat.engine_inputs_require_grad(_engine({"activation_checkpoint_interval": 1}))
    assert compat.engine_inputs_require_grad(_engine({"activation_checkpoint_interval": 1, "use_reentrant": True}))
    assert not compat.engine_inputs_require_grad(_engine({"activation_checkpoint_interval": 1,
                                                          "use_reentrant": False}))


class _Module:
    """What resolve_use_reentrant touches of a PipelineModule."""

    def __init__(self, interval: int):
        self.activation_checkpoint_func = ds_checkpointing.checkpoint
        self.activation_checkpoint_interval = interval
        self.precomputed = 0

    def _precompute_checkpointable_values(self):
        self.precomputed += 1


@pytest.mark.parametrize("interval", [0, 2])
def test_use_reentrant_false_is_applied_before_deepspeed_0_19(monkeypatch, interval):
    monkeypatch.setattr(compat, "DEEPSPEED_VERSION", (0, 18, 9))
    module = _Module(interval)
    compat.resolve_use_reentrant(module, {"pipeline": {"use_reentrant": False}})
    assert module.activation_checkpoint_func is ds_checkpointing.non_reentrant_checkpoint
    assert module.precomputed == (1 if interval else 0)
    for config in ({}, {"pipeline": {}}, {"pipeline": {"use_reentrant": True}}):
        untouched = _Module(interval)
        compat.resolve_use_reentrant(untouched, config)
        assert untouched.activation_checkpoint_func is ds_checkpointing.checkpoint


def test_use_reentrant_is_left_to_deepspeed_0_19(monkeypatch):
    monkeypatch.setattr(compat, "DEEPSPEED_VERSION", (0, 19, 8))
    module = _Module(2)
    compat.resolve_use_reentrant(module, {"pipeline": {"use_reentrant": False}})
    assert module.activation_checkpoint_func is ds_checkpointing.checkpoint


def test_deepspeeds_reentrant_checkpoint_without_streams_is_named_before_it_fails(monkeypatch):
    monkeypatch.setattr(compat, "DEEPSPEED_REENTRANT_RUNS_ON_CPU", False)
    accelerator = types.SimpleNamespace(Stream=None, device_name=lambda: "cpu")
    monkeypatch.setattr(compat, "get_accelerator", lambda: accelerator)
    layer = nn.Linear(4, 4)
    with pytest.raises(UpstreamLimitError, match=r"reentrant checkpoint cannot run on the cpu accelerator.*"
                                                 r"use_reentrant to false"):
        ds_pipe_ckpt.checkpoint(layer, torch.randn(2, 4, requires_grad=True), use_reentrant=True)
    # torch's non-reentrant checkpoint runs anywhere.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ds_pipe_ckpt.checkpoint(layer, torch.randn(2, 4, requires_grad=True), use_reentrant=False).sum().backward()
    accelerator.Stream = object  # an accelerator with streams (a GPU): DeepSpeed's own path
    compat.require_deepspeed_reentrant()


def test_without_recognisable_checkpoint_hooks_the_planner_is_refused_and_import_warns(monkeypatch):
    from ds_pipe_ckpt.planning.layer_profiling import profile_layer_specs

    monkeypatch.setattr(compat, "CHECKPOINT_HOOKS_VISIBLE", False)
    with pytest.raises(ds_pipe_ckpt.ConfigError, match=r"activation_checkpointing.memory_budget_mb = 64.0 is invalid: "
                                                       r"expected null with torch .*tested range \(2.11 to 2.15.x\)"):
        compat.require_checkpoint_hooks("activation_checkpointing.memory_budget_mb", 64.0)
    with pytest.raises(ds_pipe_ckpt.ConfigError, match=r"pipeline.partition_method = 'planned'"):
        profile_layer_specs([nn.Linear(2, 2)], torch.randn(1, 2))
    with pytest.warns(UserWarning, match=r"checkpoint hooks are not recognised: the recompute check falls back"):
        ds_pipe_ckpt._warn_outside_the_tested_range()


def test_the_cuda_ops_find_torchs_architectures_without_a_gpu(monkeypatch):
    """torch before 2.14 lists its architectures only with a visible GPU; the
    ops' build still needs them on a build machine."""
    if torch.version.cuda is None:
        assert compat.compiled_cuda_archs() == []
        return
    expected = torch._C._cuda_getArchFlags().split()
    assert expected and all(arch.startswith(("sm_", "compute_")) for arch in expected)
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: [])  # as torch 2.11 to 2.13 answer without a GPU
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    assert compat.compiled_cuda_archs() == expected
    from ds_pipe_ckpt.placement import op_builder
    flags = op_builder._arch_flags()
    assert f"-gencode=arch=compute_{expected[-1][3:]},code=sm_{expected[-1][3:]}" in flags
