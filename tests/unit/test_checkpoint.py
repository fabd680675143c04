"""checkpoint(): outputs, parameter and input gradients equal (bitwise, fp32,
CPU) to running the function without checkpointing, in both modes.

In the reentrant mode a region's first call runs non-reentrantly (it learns
whether the region modifies its inputs) and later calls go through DeepSpeed's
reentrant checkpoint: the reentrant cases check both calls."""

import warnings

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint as torch_checkpoint
from deepspeed.runtime.activation_checkpointing import checkpointing as ds_checkpointing

import ds_pipe_ckpt
from ds_pipe_ckpt import ReentrantFallbackWarning
from checkpoint_modes import MODES


def _grads(module, inputs):
    return ([None if p.grad is None else p.grad.clone() for p in module.parameters()],
            [t.grad.clone() if isinstance(t, torch.Tensor) and t.grad is not None else None for t in inputs])


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    return []


def _run(module, fn, make_inputs, use_reentrant, seed=0, kwargs=None):
    """Run fn once without checkpointing and with it (twice in the reentrant
    mode: its first and a later call) from the same RNG state; return
    (reference, checkpointed...) as (outputs, param grads, input grads)."""
    results = []
    for checkpointed in (False, True, True) if use_reentrant else (False, True):
        module.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        inputs = make_inputs()
        if checkpointed:
            out = ds_pipe_ckpt.checkpoint(fn, *inputs, use_reentrant=use_reentrant, **(kwargs or {}))
        else:
            out = fn(*inputs, **(kwargs or {}))
        loss = sum((t.float() * (i + 1)).sum() for i, t in enumerate(_tensors(out)) if t.requires_grad)
        loss.backward()
        results.append((out, *_grads(module, inputs)))
    return results


def _assert_bitwise(ref, *calls):
    for got in calls:
        _assert_call_bitwise(ref, got)


def _assert_call_bitwise(ref, got):
    ref_out, ref_pg, ref_ig = ref
    out, pg, ig = got
    ref_t, got_t = _tensors(ref_out), _tensors(out)
    assert len(ref_t) == len(got_t)
    for a, b in zip(ref_t, got_t):
        assert torch.equal(a, b), "outputs differ"
    for i, (a, b) in enumerate(zip(ref_pg, pg)):
        assert (a is None) == (b is None), f"parameter {i}: gradient presence differs"
        if a is not None:
            assert torch.equal(a, b), f"parameter {i}: gradient differs by {(a - b).abs().max()}"
    for i, (a, b) in enumerate(zip(ref_ig, ig)):
        assert (a is None) == (b is None), f"input {i}: gradient presence differs"
        if a is not None:
            assert torch.equal(a, b), f"input {i}: gradient differs"


@pytest.fixture
def mlp():
    torch.manual_seed(1234)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))


@pytest.mark.parametrize("use_reentrant", MODES)
def test_plain_linear(use_reentrant):
    torch.manual_seed(0)
    lin = nn.Linear(8, 3)
    ref, *got = _run(lin, lin, lambda: (torch.randn(5, 8, requires_grad=True), ), use_reentrant)
    _assert_bitwise(ref, *got)
    assert all(call[2][0] is not None for call in got), "input gradient missing"


@pytest.mark.parametrize("use_reentrant", MODES)
@pytest.mark.parametrize("mask_dtype", [torch.float32, torch.bool])
def test_masked_inputs(mlp, use_reentrant, mask_dtype):
    def fn(x, mask):
        h = mlp(x)
        return h.masked_fill(~mask, 0.0) if mask.dtype == torch.bool else h * mask

    def make():
        g = torch.Generator().manual_seed(3)
        mask = torch.rand(6, 4, generator=g) > 0.5
        return torch.randn(6, 8, generator=g, requires_grad=True), mask.to(mask_dtype)

    ref, *got = _run(mlp, fn, make, use_reentrant)
    _assert_bitwise(ref, *got)


@pytest.mark.parametrize("use_reentrant", MODES)
def test_non_tensor_inputs_and_outputs_keep_their_order(mlp, use_reentrant):
    def fn(a, scale, nothing, b, tag):
        assert nothing is None and tag == "tag" and scale == 3
        return b * scale, tag, mlp(a), None, scale

    make = lambda: (torch.randn(2, 8, requires_grad=True), 3, None, torch.randn(2, 4, requires_grad=True), "tag")
    ref, *got = _run(mlp, fn, make, use_reentrant)
    _assert_bitwise(ref, *got)
    for out, _, _ in got:
        assert out[1] == "tag" and out[3] is None and out[4] == 3


@pytest.mark.parametrize("use_reentrant", MODES)
def test_more_outputs_than_inputs(mlp, use_reentrant):
    def fn(x):
        h = mlp(x)
        return h, h.relu(), h.sigmoid(), x * 2

    ref, *got = _run(mlp, fn, lambda: (torch.randn(3, 8, requires_grad=True), ), use_reentrant)
    _assert_bitwise(ref, *got)


@pytest.mark.parametrize("use_reentrant", MODES)
def test_inputs_without_grad_still_train_parameters(mlp, use_reentrant):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ref, *got = _run(mlp, mlp, lambda: (torch.randn(4, 8), ), use_reentrant)
    _assert_bitwise(ref, *got)
    assert all(g is not None for g in got[-1][1]), "parameter gradients were dropped"
    fallback = [w for w in caught if issubclass(w.category, ReentrantFallbackWarning)]
    assert len(fallback) == (1 if use_reentrant else 0)
    if use_reentrant:
        assert "silently drop the gradients" in str(fallback[0].message)


def test_fallback_warning_is_issued_once():
    lin = nn.Linear(2, 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            ds_pipe_ckpt.checkpoint(lin, torch.randn(1, 2), use_reentrant=True).sum().backward()
    assert sum(issubclass(w.category, ReentrantFallbackWarning) for w in caught) == 1


@pytest.mark.deepspeed_reentrant
def test_reentrant_mode_is_deepspeeds_checkpoint_after_the_first_call():
    """With an input requiring grad the reentrant mode is DeepSpeed's own function,
    from the region's second call on (the first runs non-reentrantly, same math)."""
    lin = nn.Linear(2, 2)
    x = torch.randn(1, 2, requires_grad=True)
    first = ds_pipe_ckpt.checkpoint(lin, x, use_reentrant=True)
    later = ds_pipe_ckpt.checkpoint(lin, x, use_reentrant=True)
    assert type(first.grad_fn).__name__ == "AddmmBackward0"
    assert type(later.grad_fn).__name__ == "CheckpointFunctionBackward"


@pytest.mark.parametrize("use_reentrant", MODES)
def test_dropout_masks_match_after_recomputation(use_reentrant):
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(32, 64), nn.Dropout(0.5), nn.ReLU(), nn.Dropout(0.3), nn.Linear(64, 8)).train()
    ref, *got = _run(block, block, lambda: (torch.randn(16, 32, requires_grad=True), ), use_reentrant, seed=7)
    _assert_bitwise(ref, *got)


@pytest.mark.parametrize("use_reentrant", MODES)
def test_keyword_arguments(mlp, use_reentrant):
    def fn(x, *, bias, scale=1.0):
        return mlp(x) * scale + bias

    make = lambda: (torch.randn(3, 8, requires_grad=True), )
    bias = torch.randn(4, requires_grad=True)
    ref, *got = _run(mlp, fn, make, use_reentrant, kwargs={"bias": bias, "scale": 0.5})
    _assert_bitwise(ref, *got)
    assert bias.grad is not None


def test_autograd_grad_non_reentrant(mlp):
    x = torch.randn(5, 8, requires_grad=True)
    params = list(mlp.parameters())
    torch.manual_seed(0)
    ref = torch.autograd.grad(mlp(x).pow(2).sum(), [x, *params])
    out = ds_pipe_ckpt.checkpoint(mlp, x, use_reentrant=False)
    got = torch.autograd.grad(out.pow(2).sum(), [x, *params])
    for a, b in zip(ref, got):
        assert torch.equal(a, b)


@pytest.mark.parametrize("use_reentrant", MODES)
def test_model_parallel_rng_tracker_is_replayed(model_parallel_tracker, use_reentrant):
    torch.manual_seed(0)
    lin = nn.Linear(32, 32)

    def fn(x):
        h = lin(x)
        with model_parallel_tracker.fork():
            h = nn.functional.dropout(h, 0.5, training=True)
        return nn.functional.dropout(h, 0.2, training=True)

    states = model_parallel_tracker.get_states()

    def make():
        model_parallel_tracker.set_states(dict(states))  # same tracker state for both runs
        return (torch.randn(8, 32, requires_grad=True), )

    ref, *got = _run(lin, fn, make, use_reentrant, seed=11)
    _assert_bitwise(ref, *got)


def test_recomputation_leaves_rng_streams_where_the_forward_left_them(model_parallel_tracker):
    lin = nn.Linear(4, 4)

    def fn(x):
        with model_parallel_tracker.fork():
            return nn.functional.dropout(lin(x), 0.5)

    out = ds_pipe_ckpt.checkpoint(fn, torch.randn(2, 4, requires_grad=True), use_reentrant=False)
    after_forward = (torch.get_rng_state(), model_parallel_tracker.get_states()["model-parallel-rng"])
    out.sum().backward()  # recomputes
    assert torch.equal(torch.get_rng_state(), after_forward[0])
    assert torch.equal(model_parallel_tracker.get_states()["model-parallel-rng"], after_forward[1])


@pytest.mark.parametrize("use_reentrant", [pytest.param(True, marks=pytest.mark.deepspeed_reentrant), False])
def test_none_follows_configured_mode(use_reentrant):
    ds_pipe_ckpt.configure(use_reentrant=use_reentrant)
    lin = nn.Linear(2, 2)
    for _ in range(2):  # the reentrant mode's first call of a region runs non-reentrantly
        out = ds_pipe_ckpt.checkpoint(lin, torch.randn(1, 2, requires_grad=True))
    assert (type(out.grad_fn).__name__ == "CheckpointFunctionBackward") == use_reentrant


@pytest.mark.parametrize("settings", [{}, {"checkpoint_in_cpu": True}], ids=["plain", "offloaded"])
def test_inputs_are_freed_with_the_graph_not_by_the_garbage_collector(settings):
    """No reference cycle through ds_pipe_ckpt's hooks: a checkpointed region's input
    (and the stored copy of it) dies with the autograd graph, as with torch alone.
    (DeepSpeed's own reentrant checkpoint keeps its input until the garbage
    collector runs: measured, not ours to change.)"""
    import gc
    import weakref

    ds_pipe_ckpt.configure(mpu=ds_pipe_ckpt.parallel.TensorParallelGroup.single(), use_reentrant=False, **settings)
    lin = nn.Linear(4, 4)
    # torch's own first non-reentrant checkpoint in a process keeps its input
    # until the garbage collector runs (measured with torch alone): warm up.
    torch_checkpoint.checkpoint(nn.Linear(1, 1), torch.ones(1, 1, requires_grad=True), use_reentrant=False).sum().backward()
    gc.disable()
    try:
        for _ in range(2):  # the first call of a region learns about it
            h = torch.randn(3, 4, requires_grad=True) * 1.0
            alive = weakref.ref(h)
            out = ds_pipe_ckpt.checkpoint(lin, h)
            del h
            out.sum().backward()
            del out
            assert alive() is None
    finally:
        gc.enable()


@pytest.mark.parametrize("use_reentrant", [False, pytest.param(True, marks=pytest.mark.deepspeed_reentrant)])
def test_input_gradient_keeps_its_layout_so_earlier_reductions_are_bitwise(use_reentrant):
    """A strided gradient reaching a checkpointed region (a later ``transpose``,
    as GPT-NeoX's ``[s, b, h] -> [b, s, h]`` after its last layer) leaves it with
    the layout the graph without checkpointing gives: the bias gradient before
    the region, a sum over sequence and batch, is bitwise that of no
    checkpointing. DeepSpeed's and torch's reentrant checkpoint hand it back
    contiguous, and that sum then differs in the last bits."""
    torch.manual_seed(0)
    bias = nn.Parameter(torch.randn(64))
    norm = nn.LayerNorm(64)
    x, weight = torch.randn(16, 2, 64), torch.randn(2, 16, 64)

    def region(t):
        return t + (norm(t) * 2 + norm(t).tanh())  # the residual, then two branches

    def bias_grad(checkpointed):
        bias.grad = None
        h = x + bias
        out = checkpointed(region, h) if checkpointed else region(h)
        (out.transpose(0, 1).contiguous() * weight).sum().backward()
        return bias.grad.clone()

    expected = bias_grad(None)
    for call in range(3):  # in reentrant mode the first call runs non-reentrantly, later ones through DeepSpeed's
        got = bias_grad(lambda f, h: ds_pipe_ckpt.checkpoint(f, h, use_reentrant=use_reentrant))
        assert torch.equal(got, expected), f"call {call}: max difference {(got - expected).abs().max().item()}"
