"""Selective (op-level) checkpointing: ``"activation_checkpointing": {"policy":
"selective"}`` keeps the outputs of matmuls, convolutions and attention and
recomputes the rest. Gradients are bitwise those of no checkpointing (CPU,
fp32), DeepSpeed's RNG tracker is replayed, the recompute check stays on, and
the keys are validated like every other."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from deepspeed.runtime.activation_checkpointing import checkpointing as ds_checkpointing

import ds_pipe_ckpt
from benchmarks.checkpointing.workloads import TransformerBlock
from ds_pipe_ckpt import CheckpointingConfig, ConfigError, RecomputeMismatchError
from ds_pipe_ckpt.selective import DEFAULT_SAVE_OPS, ops_to_keep, resolve_ops

SELECTIVE = {"pipeline": {"use_reentrant": False}, "activation_checkpointing": {"policy": "selective"}}


class DropoutBlock(nn.Module):
    """A transformer block with dropout in three places, one of them drawn from
    DeepSpeed's model-parallel tracker (as tensor-parallel regions do)."""

    def __init__(self, dim=16, heads=4):
        super().__init__()
        self.block = TransformerBlock(dim, heads)
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        h = F.dropout(self.block(x), 0.2, training=True)
        with ds_checkpointing.get_cuda_rng_tracker().fork():
            h = F.dropout(h, 0.3, training=True)
        return self.out(F.gelu(h))


def convnet():
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.BatchNorm2d(8), nn.Conv2d(8, 8, 3),
                         nn.Dropout(0.2), nn.Flatten(), nn.Linear(8 * 6 * 6, 10))


def _gradients(module, make_input, checkpoint, seed=5, tracker=None):
    tracker_states = tracker.get_states() if tracker is not None else None
    module.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    x = make_input()
    out = module(x) if checkpoint is None else checkpoint(module, x)
    out.pow(2).sum().backward()
    if tracker is not None:
        tracker.set_states(tracker_states)
    return [out.detach(), x.grad, *(p.grad for p in module.parameters())]


@pytest.mark.parametrize("model, make_input", [
    (lambda: DropoutBlock(), lambda: torch.randn(2, 10, 16, requires_grad=True)),
    (convnet, lambda: torch.randn(4, 3, 8, 8, requires_grad=True)),
], ids=["transformer_block", "convnet"])
def test_gradients_are_bitwise_those_of_no_checkpointing(model_parallel_tracker, model, make_input):
    torch.manual_seed(0)
    module = model().train()
    ds_pipe_ckpt.configure(deepspeed_config=SELECTIVE)
    expected = _gradients(module, make_input, None, tracker=model_parallel_tracker)
    for call in range(2):
        got = _gradients(module, make_input, ds_pipe_ckpt.checkpoint, tracker=model_parallel_tracker)
        for i, (a, b) in enumerate(zip(expected, got)):
            assert torch.equal(a, b), f"call {call}: tensor {i} differs"


class MatmulTanhRelu(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        return torch.tanh(x @ self.w).relu()


def test_the_kept_ops_are_not_rerun_and_the_others_are():
    """Under the selective policy the recomputation gets mm's output from the
    forward and recomputes tanh and relu: count the kernels run, with torch's
    dispatch-level op log."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class OpLog(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    module = MatmulTanhRelu()
    x = torch.randn(4, 8, requires_grad=True)
    for policy, recomputed_mm in (("full", 1), ("selective", 0)):
        ds_pipe_ckpt.configure(use_reentrant=False, policy=policy)
        out = ds_pipe_ckpt.checkpoint(module, x)
        log = OpLog()
        with log:
            out.sum().backward()
        assert log.ops.count("mm") == 2 + recomputed_mm, (policy, log.ops)  # backward's two mms
        assert log.ops.count("tanh") == 1, (policy, log.ops)  # recomputed either way


def test_a_user_op_list_replaces_the_default_set():
    ds_pipe_ckpt.configure(use_reentrant=False, policy="selective", save_ops=["aten.tanh"])
    settings = ds_pipe_ckpt.current_settings()
    assert settings.config.save_ops == ("aten.tanh",)
    module = MatmulTanhRelu()
    x = torch.randn(4, 8, requires_grad=True)
    expected = torch.autograd.grad(module(x).sum(), [x, module.w])
    got = torch.autograd.grad(ds_pipe_ckpt.checkpoint(module, x).sum(), [x, module.w])
    assert all(torch.equal(a, b) for a, b in zip(expected, got))


def test_the_recompute_check_stays_on():
    class Diverging(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.calls = nn.Linear(4, 4), 0

        def forward(self, x):
            self.calls += 1
            h = self.lin(x)
            return torch.tanh(h) if self.calls == 1 else torch.sigmoid(h)

    ds_pipe_ckpt.configure(deepspeed_config=SELECTIVE)
    out = ds_pipe_ckpt.checkpoint(Diverging(), torch.randn(2, 4, requires_grad=True))
    # Whichever sees it first: torch's selective checkpointing (its storage has no
    # sigmoid) or our saved-tensor comparison (torch before 2.13 runs it first).
    with pytest.raises(RecomputeMismatchError, match=r"function Diverging diverged from its forward: (\(selective "
                                                     r"checkpointing\) aten\.sigmoid\.default encountered during "
                                                     r"backward but not found in storage|saved tensor #\d+ differs: "
                                                     r"the forward saved the output of the op recorded as "
                                                     r"TanhBackward0, .*the recomputation saved the output of the op "
                                                     r"recorded as SigmoidBackward0)"):
        out.sum().backward()


def test_default_set_resolves_on_this_build():
    ops = ops_to_keep(None)
    names = {str(op.overloadpacket) for op in ops}
    assert {"aten.mm", "aten.addmm", "aten.bmm", "aten.convolution"} <= names
    assert names <= set(DEFAULT_SAVE_OPS)
    assert any("scaled_dot_product" in name for name in names)


@pytest.mark.parametrize("section, key, match", [
    ({"policy": "sometimes"}, "activation_checkpointing.policy", 'expected "full" or "selective"'),
    ({"policy": "selective"}, "activation_checkpointing.policy", "unless pipeline.use_reentrant is false"),
    ({"save_ops": ["aten.mm"]}, "activation_checkpointing.save_ops", 'null unless activation_checkpointing.policy'),
    ({"policy": "selective", "save_ops": "aten.mm"}, "activation_checkpointing.save_ops", "a non-empty list"),
    ({"policy": "selective", "save_ops": []}, "activation_checkpointing.save_ops", "a non-empty list"),
    ({"policy": "selective", "save_ops": ["aten.mm", "aten.matmul_please"]}, "activation_checkpointing.save_ops",
     "ATen op names"),
    ({"policy": "selective", "save_ops": ["mm"]}, "activation_checkpointing.save_ops", "ATen op names"),
])
def test_policy_and_save_ops_are_validated(section, key, match):
    reentrant = "unless pipeline.use_reentrant" in match
    config = {"pipeline": {"use_reentrant": reentrant}, "activation_checkpointing": section}
    if key.endswith("save_ops") and "null unless" in match:
        config["pipeline"]["use_reentrant"] = False
    with pytest.raises(ConfigError, match=match) as err:
        CheckpointingConfig.from_ds_config(config)
    assert err.value.key == key


def test_op_names_resolve_to_every_overload_or_one():
    assert torch.ops.aten.mm.default in resolve_ops(["aten.mm"])
    assert resolve_ops(["aten.add.Tensor"]) == (torch.ops.aten.add.Tensor,)


def test_selective_with_a_context_fn_of_ones_own_is_refused():
    ds_pipe_ckpt.configure(deepspeed_config=SELECTIVE)
    with pytest.raises(ConfigError, match="context_fn = .* is invalid: expected None when "
                                          "activation_checkpointing.policy is \"selective\""):
        ds_pipe_ckpt.checkpoint(nn.Linear(2, 2), torch.randn(1, 2, requires_grad=True),
                                context_fn=torch.utils.checkpoint.noop_context_fn)


def test_selective_in_a_pipeline_trains_exactly(single_rank_process_group):
    """PipelineModule under the selective policy: every segment's gradients equal
    those of no checkpointing."""
    def build():
        torch.manual_seed(0)
        return ds_pipe_ckpt.PipelineModule(
            layers=[TransformerBlock(16, 4), TransformerBlock(16, 4), nn.Linear(16, 3)], num_stages=1,
            activation_checkpoint_interval=1, activation_checkpoint_func=ds_checkpointing.non_reentrant_checkpoint)

    x = torch.randn(2, 6, 16)
    reference = build()
    reference.set_checkpoint_interval(0)
    reference(x).pow(2).sum().backward()
    ds_pipe_ckpt.configure(deepspeed_config=SELECTIVE)
    module = build()
    module(x).pow(2).sum().backward()
    for (name, a), b in zip(reference.named_parameters(), module.parameters()):
        assert torch.equal(a.grad, b.grad), name
