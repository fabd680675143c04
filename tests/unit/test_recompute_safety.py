"""Recompute safety: divergent recomputations, in-place inputs and bad calls
fail with errors that name the region (pipeline layers or function), the
micro-batch and, where known, the op."""

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointError
from deepspeed.runtime.activation_checkpointing import checkpointing as ds_checkpointing

import ds_pipe_ckpt
from ds_pipe_ckpt import InPlaceInputError, RecomputeMismatchError
from ds_pipe_ckpt.compat import TORCH_VERSION


class LazyCache(nn.Module):
    """Builds a cache on its first call and takes a shorter path afterwards."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.cache = None

    def forward(self, x):
        if self.cache is None:
            self.cache = True
            return torch.tanh(torch.sigmoid(self.lin(x)))
        return torch.tanh(self.lin(x))


class LongerOnRecompute(nn.Module):
    """Takes a longer path from its second call on."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        h = self.lin(x)
        if self.calls > 1:
            h = torch.sigmoid(h)
        return torch.tanh(h)


class SwapsOp(nn.Module):
    """Same number and shapes of saved tensors, a different op on recomputation:
    torch's metadata check cannot see it; gradients would silently be wrong."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        h = self.lin(x)
        return torch.tanh(h) if self.calls == 1 else torch.sigmoid(h)


DIVERGING = [LazyCache, LongerOnRecompute, SwapsOp]


@pytest.mark.parametrize("verify", [False, True], ids=["graph_check", "op_trace"])
@pytest.mark.parametrize("cls", DIVERGING)
def test_divergent_recomputation_names_the_function(cls, verify):
    module = cls()
    out = ds_pipe_ckpt.checkpoint(module, torch.randn(2, 4, requires_grad=True), use_reentrant=False, verify=verify)
    with pytest.raises(RecomputeMismatchError) as err:
        out.sum().backward()
    message = str(err.value)
    assert f"function {cls.__name__}" in message
    assert "Usual causes" in message and "checkpointable_layers" in message and "verify_recompute" in message
    assert isinstance(err.value, CheckpointError)


def test_saved_tensor_check_names_the_differing_tensor():
    out = ds_pipe_ckpt.checkpoint(SwapsOp(), torch.randn(2, 4, requires_grad=True), use_reentrant=False)
    with pytest.raises(RecomputeMismatchError, match=r"saved tensor #2 differs: the forward saved the output of the op "
                                                     r"recorded as TanhBackward0, \[2, 4\] float32; the recomputation "
                                                     r"saved the output of the op recorded as SigmoidBackward0"):
        out.sum().backward()


def test_a_shorter_path_is_named_with_the_first_missing_tensor():
    class Shortcut(nn.Module):
        """Skips its second layer from the second call on (as a cache would)."""

        def __init__(self):
            super().__init__()
            self.a, self.b, self.calls = nn.Linear(4, 4), nn.Linear(4, 4), 0

        def forward(self, x):
            self.calls += 1
            h = torch.tanh(self.a(x))
            return h if self.calls > 1 else torch.tanh(self.b(h))

    out = Shortcut()
    y = ds_pipe_ckpt.checkpoint(out, torch.randn(2, 4, requires_grad=True), use_reentrant=False)
    with pytest.raises(RecomputeMismatchError, match=r"finished having saved 3 tensor\(s\) for backward where the "
                                                     r"forward saved 6 \(a shorter path\); the first one it did not "
                                                     r"save: #3, the output of the op recorded as TanhBackward0"):
        y.sum().backward()


def test_longer_path_is_caught_within_what_torch_recomputes():
    """LongerOnRecompute inserts an op before the last saved tensor: torch's early
    stop still runs that far, and the tensors saved up to there differ."""
    out = ds_pipe_ckpt.checkpoint(LongerOnRecompute(), torch.randn(2, 4, requires_grad=True), use_reentrant=False)
    with pytest.raises(RecomputeMismatchError, match="saved tensor #2 differs"):
        out.sum().backward()


def test_op_trace_names_op_position_and_shapes():
    out = ds_pipe_ckpt.checkpoint(SwapsOp(), torch.randn(2, 4, requires_grad=True), use_reentrant=False, verify=True)
    with pytest.raises(RecomputeMismatchError, match=r"op #\d+ differs: forward ran aten\.tanh\.default -> "
                                                     r"\[2, 4\] float32 on cpu, recomputation ran aten\.sigmoid"):
        out.sum().backward()


def test_verify_recompute_from_config():
    ds_pipe_ckpt.configure(deepspeed_config={"pipeline": {"use_reentrant": False},
                                             "activation_checkpointing": {"verify_recompute": True}})
    out = ds_pipe_ckpt.checkpoint(SwapsOp(), torch.randn(2, 4, requires_grad=True))
    with pytest.raises(RecomputeMismatchError, match="op #"):
        out.sum().backward()


@pytest.mark.skipif(TORCH_VERSION[:2] < (2, 14), reason=(
    "torch before 2.14: its debug mode logs op records that pytest's log handler cannot format (TypeError), "
    "torch's own checkpoint(debug=True) as well"))
def test_debug_mode_adds_torch_op_traces():
    ds_pipe_ckpt.configure(use_reentrant=False, debug=True)
    out = ds_pipe_ckpt.checkpoint(SwapsOp(), torch.randn(2, 4, requires_grad=True))
    with pytest.raises(RecomputeMismatchError) as err:
        out.sum().backward()
    message = str(err.value)
    assert message.startswith("Recomputation of checkpointed function SwapsOp diverged from its forward: saved tensor #2")
    assert "Stack traces of the operators that ran in the original forward" in message
    assert isinstance(err.value.__cause__, CheckpointError)


def test_deterministic_regions_pass_both_checks():
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.3), nn.GELU(), nn.LayerNorm(8))
    for verify in (False, True):
        x = torch.randn(3, 8, requires_grad=True)
        ds_pipe_ckpt.checkpoint(block, x, use_reentrant=False, verify=verify).sum().backward()
        assert x.grad is not None


@pytest.mark.parametrize("use_reentrant", [pytest.param(True, marks=pytest.mark.deepspeed_reentrant), False])
def test_function_returning_no_tensor_is_refused(use_reentrant):
    lin = nn.Linear(2, 2)

    def fn(x):
        lin(x)
        return None

    with pytest.raises(TypeError, match=r"Checkpointed function .*fn returned no tensor \(NoneType\)"):
        ds_pipe_ckpt.checkpoint(fn, torch.randn(1, 2, requires_grad=True), use_reentrant=use_reentrant)


def test_pipeline_segment_error_names_layers_and_micro_batch(single_rank_process_group):
    torch.manual_seed(0)
    module = ds_pipe_ckpt.PipelineModule(
        layers=[nn.Linear(4, 4), nn.ReLU(), LazyCache(), nn.Linear(4, 2)], num_stages=1,
        activation_checkpoint_interval=2, activation_checkpoint_func=ds_checkpointing.non_reentrant_checkpoint)
    with pytest.raises(RecomputeMismatchError) as err:
        module(torch.randn(3, 4)).sum().backward()
    assert "checkpointed pipeline layers 2-3 (LazyCache, Linear) in micro-batch 1 diverged" in str(err.value)


class ExtraOpAtTheEnd(nn.Module):
    """From its second call on, appends an op after the last tensor the forward saved."""

    def __init__(self):
        super().__init__()
        self.lin, self.calls = nn.Linear(4, 4), 0

    def forward(self, x):
        self.calls += 1
        h = torch.tanh(self.lin(x))
        return h.sigmoid() if self.calls > 1 else h


def test_ops_after_the_last_saved_tensor_do_not_change_gradients_and_are_not_run():
    """With torch's early stop (the default) the recomputation ends once every tensor
    the backward needs is rebuilt: an op appended after that is never run, and the
    gradients are those of no checkpointing."""
    torch.manual_seed(0)
    module, x = ExtraOpAtTheEnd(), torch.randn(2, 4, requires_grad=True)
    ds_pipe_ckpt.checkpoint(module, x, use_reentrant=False).sum().backward()
    module.calls = 0
    expected = torch.autograd.grad(module(x).sum(), [x, *module.parameters()])
    got = [x.grad, *(p.grad for p in module.parameters())]
    assert all(torch.equal(a, b) for a, b in zip(expected, got))


def test_without_early_stop_the_whole_recomputation_must_match():
    ds_pipe_ckpt.configure(use_reentrant=False, early_stop=False)
    out = ds_pipe_ckpt.checkpoint(ExtraOpAtTheEnd(), torch.randn(2, 4, requires_grad=True))
    with pytest.raises(RecomputeMismatchError, match=r"saved more tensors than the forward's 3 \(a longer path\); the "
                                                     r"first extra one: #3, the output of the op recorded as "
                                                     r"SigmoidBackward0") as err:
        out.sum().backward()
    assert "save more tensors during recomputation" in str(err.value.__cause__)


def test_torchs_own_check_is_renamed_when_ours_is_off():
    """determinism_check="none" turns off the saved-tensor comparison (torch's
    meaning); torch's own count check, raised in its unpack hook, still names the region."""
    out = ds_pipe_ckpt.checkpoint(LazyCache(), torch.randn(2, 4, requires_grad=True), use_reentrant=False,
                                  determinism_check="none")
    with pytest.raises(RecomputeMismatchError, match=r"function LazyCache diverged from its forward: A different "
                                                     r"number of tensors was saved") as err:
        out.sum().backward()
    assert type(err.value.__cause__) is CheckpointError


def test_input_modified_in_place_after_the_forward_is_named():
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    h = x * 1.0
    out = ds_pipe_ckpt.checkpoint(lin, h, use_reentrant=False)
    h.add_(1.0)  # a later layer changes the saved input in place
    with pytest.raises(InPlaceInputError, match=r"input of checkpointed function Linear was modified in place "
                                                r"after its forward \(version 0 -> 1\)"):
        out.sum().backward()


def test_pipeline_next_layer_modifying_a_passed_through_tensor_is_named(single_rank_process_group):
    class PassThrough(nn.Module):
        """Returns its input next to a new tensor (as a mask is passed along)."""

        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x), x

    class AddInPlace(nn.Module):
        def forward(self, pair):
            a, b = pair
            return b.add_(a)

    module = ds_pipe_ckpt.PipelineModule(
        layers=[nn.Linear(4, 4), PassThrough(), AddInPlace(), nn.Linear(4, 1)], num_stages=1,
        activation_checkpoint_interval=1, activation_checkpoint_func=ds_checkpointing.non_reentrant_checkpoint,
        checkpointable_layers=["Linear", "PassThrough"])
    with pytest.raises(InPlaceInputError, match=r"input of checkpointed pipeline layer 1 \(PassThrough\) in "
                                                r"micro-batch 1 was modified in place after its forward"):
        module(torch.randn(3, 4)).sum().backward()


def test_a_reshape_recorded_as_a_view_under_a_dispatch_mode_is_not_a_divergence():
    """``reshape`` records ``_reshape_alias``, or ``view`` under a TorchDispatchMode:
    a backward (so the recomputation) under torch's FlopCounterMode, the forward
    outside it, as the planner's measuring step does. torch's SDPA math path
    (attention with dropout on a CPU) reshapes such a view and saves it."""
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.1, batch_first=True, norm_first=True)
    x = torch.randn(2, 8, 16)
    grads = []
    for checkpointed in (False, True):
        layer.zero_grad()
        torch.manual_seed(1)  # the dropout masks
        out = ds_pipe_ckpt.checkpoint(layer, x, use_reentrant=False) if checkpointed else layer(x)
        with FlopCounterMode(display=False):
            out.square().sum().backward()
        grads.append([p.grad.clone() for p in layer.parameters()])
    for plain, checkpointed in zip(*grads):
        assert torch.equal(plain, checkpointed)
