"""The users' reports (shared/seeds) as tests."""

import warnings

import deepspeed
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from deepspeed.runtime.activation_checkpointing import checkpointing as ds_checkpointing

import ds_pipe_ckpt
from ds_pipe_ckpt import RecomputeMismatchError, ReentrantFallbackWarning


# -- seed 000: Lightning user, checkpoint() on a batch that does not require grad ------------

def _train_seed_000(checkpoint_fn, steps=5):
    torch.manual_seed(0)
    model = nn.Linear(1, 1)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    for step in range(steps):
        batch = torch.rand(4, 1)  # a data batch: requires_grad=False
        res = checkpoint_fn(model, batch)
        loss = nn.MSELoss()(res, torch.zeros_like(res))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return before, [p.detach().clone() for p in model.parameters()]


@pytest.mark.deepspeed_reentrant
def test_seed_000_upstream_reentrant_output_has_no_grad_fn():
    """What the user hit: DeepSpeed's (reentrant) checkpoint drops the graph."""
    res = deepspeed.checkpointing.checkpoint(nn.Linear(1, 1), torch.rand(4, 1))
    assert res.grad_fn is None and not res.requires_grad
    with pytest.raises(RuntimeError, match="does not require grad and does not have a grad_fn"):
        nn.MSELoss()(res, torch.zeros_like(res)).backward()


@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_seed_000_trains_with_our_checkpoint(use_reentrant):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        before, after = _train_seed_000(lambda m, b: ds_pipe_ckpt.checkpoint(m, b, use_reentrant=use_reentrant))
    assert all(not torch.equal(a, b) for a, b in zip(before, after)), "parameters did not change"
    ref_before, ref_after = _train_seed_000(lambda m, b: m(b))
    assert all(torch.equal(a, b) for a, b in zip(after, ref_after)), "training differs from no checkpointing"
    assert any(issubclass(w.category, ReentrantFallbackWarning) for w in caught) == use_reentrant


# -- seed 003: a fused op that saves different tensors in forward and recomputation ---------

class _SwiGLUFn(torch.autograd.Function):
    """SwiGLU ``silu(x @ w1) * (x @ w2)`` with two backward strategies, as fused
    kernels have: keep every intermediate (fast backward) or keep only the inputs
    and recompute inside backward (memory-efficient). Same forward and gradients."""

    @staticmethod
    def forward(ctx, x, w1, w2, keep_intermediates):
        a, b = x @ w1, x @ w2
        out = F.silu(a) * b
        if keep_intermediates:
            ctx.save_for_backward(x, w1, w2, a, b, torch.sigmoid(a))
        else:
            ctx.save_for_backward(x, w1, w2)
        return out

    @staticmethod
    def backward(ctx, grad):
        saved = ctx.saved_tensors
        x, w1, w2 = saved[:3]
        a, b = (saved[3], saved[4]) if len(saved) > 3 else (x @ w1, x @ w2)
        sig = torch.sigmoid(a)
        grad_a = grad * b * (sig * (1 + a * (1 - sig)))
        grad_b = grad * F.silu(a)
        return grad_a @ w1.t() + grad_b @ w2.t(), x.t() @ grad_a, x.t() @ grad_b, None


class FusedSwiGLU(nn.Module):
    """Mimics seed 003: a fused op that saves different tensors in the forward and in
    its recomputation. The reporter's xformers SwiGLU chose its kernel by grad mode /
    requires_grad; this one keeps intermediates on its first call of a step (6 saved
    tensors) and uses the memory-efficient kernel after (3), which gives the same
    divergence: forward and recomputation save different tensors, while training
    without checkpointing is unaffected."""

    def __init__(self, dim=8, hidden=16):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(dim, hidden) / dim**0.5)
        self.w2 = nn.Parameter(torch.randn(dim, hidden) / dim**0.5)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return _SwiGLUFn.apply(x, self.w1, self.w2, self.calls == 1)


@pytest.mark.parametrize("keep_intermediates", [True, False])
def test_seed_003_fused_op_gradients_are_right_with_either_kernel(keep_intermediates):
    torch.manual_seed(0)
    fused = FusedSwiGLU()
    fused.calls = 0 if keep_intermediates else 1
    x = torch.randn(4, 8, requires_grad=True)
    fused(x).pow(2).sum().backward()
    w1, w2 = (w.detach().clone().requires_grad_() for w in (fused.w1, fused.w2))
    xr = x.detach().clone().requires_grad_()
    (F.silu(xr @ w1) * (xr @ w2)).pow(2).sum().backward()
    for got, ref in ((x.grad, xr.grad), (fused.w1.grad, w1.grad), (fused.w2.grad, w2.grad)):
        torch.testing.assert_close(got, ref)


def test_seed_003_fused_op_trains_outside_checkpointing():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), FusedSwiGLU(), nn.Linear(16, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    x = torch.randn(32, 8)
    target = x.sum(-1, keepdim=True)
    losses = []
    for _ in range(30):
        model[1].calls = 0
        loss = (model(x) - target).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


def test_seed_003_torch_alone_does_not_name_the_layer():
    """torch's error for the same module: counts, but no layer."""
    fused = FusedSwiGLU()
    x = torch.randn(4, 8, requires_grad=True)
    out = torch.utils.checkpoint.checkpoint(fused, x, use_reentrant=False)
    with pytest.raises(torch.utils.checkpoint.CheckpointError, match="A different number of tensors") as err:
        out.sum().backward()
    assert "FusedSwiGLU" not in str(err.value)


def test_seed_003_our_error_names_the_pipeline_layer(single_rank_process_group):
    torch.manual_seed(0)
    module = ds_pipe_ckpt.PipelineModule(
        layers=[nn.Linear(8, 8), FusedSwiGLU(), nn.Linear(16, 1)], num_stages=1,
        activation_checkpoint_interval=1, activation_checkpoint_func=ds_checkpointing.non_reentrant_checkpoint)
    x = torch.randn(4, 8)
    with pytest.raises(RecomputeMismatchError) as err:
        module(x).sum().backward()
    message = str(err.value)
    assert "pipeline layer 1 (FusedSwiGLU) in micro-batch 1" in message
    assert "the recomputation finished having saved 3 tensor(s) for backward where the forward saved 6" in message
    assert "checkpointable_layers" in message


def test_seed_003_excluding_the_layer_with_checkpointable_layers_trains(single_rank_process_group):
    torch.manual_seed(0)
    module = ds_pipe_ckpt.PipelineModule(
        layers=[nn.Linear(8, 8), FusedSwiGLU(), nn.Linear(16, 1)], num_stages=1,
        activation_checkpoint_interval=1, activation_checkpoint_func=ds_checkpointing.non_reentrant_checkpoint,
        checkpointable_layers=["Linear"])
    module(torch.randn(4, 8)).sum().backward()
    assert all(p.grad is not None for p in module.parameters())
