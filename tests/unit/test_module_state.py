"""A recomputation leaves module state alone: BatchNorm's running statistics
and ``num_batches_tracked``, and any buffer a forward updates, end exactly as
without checkpointing (bitwise, fp32, CPU), with the same losses, gradients
and eval-mode outputs, in every path of ``checkpoint()``.

Before ds_pipe_ckpt.module_state, every case here failed: the recomputation
updated the statistics a second time (``num_batches_tracked`` 8 after 4 steps,
``running_mean`` off by 0.066 after 4 SGD steps at momentum 0.3).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint

import ds_pipe_ckpt
from checkpoint_modes import MODES

STEPS = 4


class Block(nn.Module):
    """A ResNet-style block as people write it: conv, BatchNorm, in-place ReLU, residual add."""

    def __init__(self, channels: int = 4):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels, momentum=0.3)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels, momentum=None)  # cumulative average: reads num_batches_tracked

    def forward(self, x, scale=1.0):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out * scale + x)


class Counted(nn.Module):
    """A forward that reads the buffer it updates (a call counter) and
    replaces another buffer by assignment (an exponential moving average)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("ema", torch.zeros(8))

    def forward(self, x):
        self.calls += 1
        self.ema = 0.9 * self.ema + 0.1 * x.detach().mean(0)
        return torch.tanh(self.linear(x)) * self.calls.float() + self.ema


def _mlp():
    return nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16, momentum=0.3), nn.ReLU(), nn.Linear(16, 4))


def _state(module):
    return {name: value.clone() for name, value in module.state_dict().items()}


def _assert_same_state(expected: dict, actual: dict, what: str = ""):
    assert actual.keys() == expected.keys()
    differing = {name: (expected[name] - actual[name]).abs().max().item() if expected[name].is_floating_point()
                 else (expected[name].tolist(), actual[name].tolist())
                 for name in expected if not torch.equal(expected[name], actual[name])}
    assert not differing, f"{what}state_dict entries differ from training without checkpointing: {differing}"


def _train(make_model, make_input, call, *, steps=STEPS, seed=0):
    """Train ``steps`` SGD steps; ``call(model, x)`` is the forward (None: no
    checkpointing). Returns the model, the losses and every step's gradients."""
    torch.manual_seed(seed)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(seed + 1)
    losses, grads = [], []
    for _ in range(steps):
        x = make_input(generator).requires_grad_()
        out = model(x) if call is None else call(model, x)
        loss = out.square().mean()
        loss.backward()
        losses.append(loss.item())
        grads.append([p.grad.clone() for p in model.parameters()] + [x.grad.clone()])
        optimizer.step()
        optimizer.zero_grad()
    return model, losses, grads


def _assert_same_training(make_model, make_input, call, eval_input):
    ref, ref_losses, ref_grads = _train(make_model, make_input, None)
    got, losses, grads = _train(make_model, make_input, call)
    assert losses == ref_losses
    for step, (a, b) in enumerate(zip(ref_grads, grads)):
        assert all(torch.equal(x, y) for x, y in zip(a, b)), f"gradients differ at step {step}"
    _assert_same_state(_state(ref), _state(got))
    ref.eval(), got.eval()
    with torch.no_grad():
        assert torch.equal(ref(eval_input), got(eval_input)), "eval-mode outputs differ"


def _images(generator):
    return torch.randn(8, 4, 6, 6, generator=generator)


def _vectors(generator):
    return torch.randn(32, 16, generator=generator)


# Every form a region takes; each builds its checkpointed call from the model.
FORMS = {
    "module": lambda m, x, r: ds_pipe_ckpt.checkpoint(m, x, use_reentrant=r),
    "bound_method": lambda m, x, r: ds_pipe_ckpt.checkpoint(m.forward, x, use_reentrant=r),
    "partial_of_method": lambda m, x, r: ds_pipe_ckpt.checkpoint(functools.partial(Block.forward, m, scale=0.5), x,
                                                                 use_reentrant=r),
    "closure": lambda m, x, r: ds_pipe_ckpt.checkpoint(lambda t: m(t, scale=0.5), x, use_reentrant=r),
    "keyword_arguments": lambda m, x, r: ds_pipe_ckpt.checkpoint(m, x, scale=0.5, use_reentrant=r),
}


def _uncheckpointed(form):
    return lambda m, x: m(x) if form in ("module", "bound_method") else m(x, scale=0.5)


@pytest.mark.parametrize("use_reentrant", MODES)
def test_batchnorm_statistics_equal_training_without_checkpointing(use_reentrant):
    _assert_same_training(_mlp, _vectors, lambda m, x: ds_pipe_ckpt.checkpoint(m, x, use_reentrant=use_reentrant),
                          torch.randn(5, 16))


@pytest.mark.parametrize("use_reentrant", MODES)
@pytest.mark.parametrize("form", list(FORMS))
def test_every_form_of_region_keeps_its_modules_state(form, use_reentrant):
    ref, _, _ = _train(Block, _images, _uncheckpointed(form))
    got, _, _ = _train(Block, _images, lambda m, x: FORMS[form](m, x, use_reentrant))
    _assert_same_state(_state(ref), _state(got), f"{form}: ")
    assert got.bn1.num_batches_tracked.item() == STEPS


@pytest.mark.parametrize("use_reentrant", MODES)
def test_a_forward_that_reads_and_reassigns_its_buffers_is_recomputed_from_their_values_before_it(use_reentrant):
    _assert_same_training(Counted, lambda g: torch.randn(6, 8, generator=g),
                          lambda m, x: ds_pipe_ckpt.checkpoint(m, x, use_reentrant=use_reentrant),
                          torch.randn(3, 8))


@pytest.mark.parametrize("use_reentrant", MODES)
def test_micro_batches_in_flight_recompute_in_any_order(use_reentrant):
    """1F1B: later forwards move the statistics on before an earlier micro-batch is recomputed."""
    torch.manual_seed(0)
    ref, got = _mlp(), _mlp()
    got.load_state_dict(ref.state_dict())
    xs = [torch.randn(32, 16).requires_grad_() for _ in range(3)]
    ref_out = [ref(x) for x in xs]
    out = [ds_pipe_ckpt.checkpoint(got, x.detach().requires_grad_(), use_reentrant=use_reentrant) for x in xs]
    for i in (1, 0, 2):
        ref_out[i].sum().backward()
        out[i].sum().backward()
    _assert_same_state(_state(ref), _state(got))
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(ref.parameters(), got.parameters()))


@pytest.mark.parametrize("use_reentrant", MODES)
def test_statistics_are_learned_again_when_the_training_mode_changes(use_reentrant):
    """A region first checkpointed in eval mode (nothing changes) must still
    keep its statistics once the model trains."""
    make = functools.partial(Block, 4)
    call = lambda m, x: ds_pipe_ckpt.checkpoint(m, x, use_reentrant=use_reentrant)  # noqa: E731
    models = []
    for checkpointed in (False, True):
        torch.manual_seed(0)
        model = make()
        x = torch.randn(8, 4, 6, 6, requires_grad=True)
        model.eval()
        (call(model, x) if checkpointed else model(x)).sum().backward()
        model.train()
        for _ in range(2):
            (call(model, x) if checkpointed else model(x)).sum().backward()
        models.append(model)
    _assert_same_state(_state(models[0]), _state(models[1]))
    assert models[1].bn1.num_batches_tracked.item() == 2


def test_a_second_backward_recomputes_from_the_same_values():
    torch.manual_seed(0)
    ref, got = Counted(), Counted()
    got.load_state_dict(ref.state_dict())
    x = torch.randn(6, 8, requires_grad=True)
    ref_out = ref(x)
    out = ds_pipe_ckpt.checkpoint(got, x, use_reentrant=False)
    for _ in range(2):
        ref_out.sum().backward(retain_graph=True)
        out.sum().backward(retain_graph=True)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(ref.parameters(), got.parameters()))
    _assert_same_state(_state(ref), _state(got))


@pytest.mark.parametrize("settings", [
    pytest.param({"policy": "selective"}, id="selective"),
    pytest.param({"verify_recompute": True}, id="verify_recompute"),
    pytest.param({"early_stop": False}, id="run_to_the_end"),
    pytest.param({"checkpoint_in_cpu": True}, id="cpu_offloaded"),
    pytest.param({"partition_activations": True}, id="partitioned"),
    pytest.param({"partition_activations": True, "contiguous_checkpointing": True, "num_checkpoints": 8},
                 id="partitioned_contiguous"),
])
def test_every_placement_and_policy_keeps_module_state(settings):
    ds_pipe_ckpt.configure(use_reentrant=False, **settings)
    _assert_same_training(Block, _images, lambda m, x: ds_pipe_ckpt.checkpoint(m, x), torch.randn(2, 4, 6, 6))


def test_torchs_own_checkpoint_updates_the_statistics_twice():
    """What ds_pipe_ckpt fixes: torch's checkpoint recomputes BatchNorm's update."""
    ref, _, _ = _train(_mlp, _vectors, None)
    got, _, _ = _train(_mlp, _vectors, lambda m, x: torch_checkpoint.checkpoint(m, x, use_reentrant=False))
    assert got[1].num_batches_tracked.item() == 2 * ref[1].num_batches_tracked.item() == 2 * STEPS
    assert not torch.equal(got[1].running_mean, ref[1].running_mean)


def test_the_modules_own_buffers_stay_the_same_objects():
    """Optimizers, EMA copies and DDP's buffer broadcast hold references to buffers."""
    model = _mlp()
    before = {name: buffer for name, buffer in model.named_buffers()}
    x = torch.randn(32, 16, requires_grad=True)
    ds_pipe_ckpt.checkpoint(model, x, use_reentrant=False).sum().backward()
    assert all(buffer is before[name] for name, buffer in model.named_buffers())


def test_a_region_without_buffers_learns_that_once():
    from ds_pipe_ckpt.regions import RegionRegistry  # noqa: F401  (the facts live in the settings' registry)

    model = nn.Sequential(nn.Linear(8, 8), nn.GELU())
    x = torch.randn(4, 8, requires_grad=True)
    ds_pipe_ckpt.checkpoint(model, x, use_reentrant=False).sum().backward()
    facts = ds_pipe_ckpt.current_settings().regions.facts_for(model).buffers
    assert facts.owners == ()  # later calls keep nothing and look at nothing

    bn_model = _mlp()
    ds_pipe_ckpt.checkpoint(bn_model, torch.randn(8, 16, requires_grad=True), use_reentrant=False).sum().backward()
    facts = ds_pipe_ckpt.current_settings().regions.facts_for(bn_model).buffers
    assert [ref() for ref in facts.owners] == [bn_model[1]]
    assert facts.changed == {(True, ): ((0, "running_mean"), (0, "running_var"), (0, "num_batches_tracked"))}


def test_functional_batch_norm_on_a_captured_modules_buffers():
    """A closure that updates a captured module's buffers without calling it."""
    torch.manual_seed(0)
    norm = nn.BatchNorm1d(8)
    ref_norm = nn.BatchNorm1d(8)

    def region(bn):
        return lambda x: torch.tanh(F.batch_norm(x, bn.running_mean, bn.running_var, bn.weight, bn.bias,
                                                 training=True, momentum=0.5))

    x = torch.randn(16, 8, requires_grad=True)
    for _ in range(3):
        region(ref_norm)(x).sum().backward()
        ds_pipe_ckpt.checkpoint(region(norm), x, use_reentrant=False).sum().backward()
    _assert_same_state(_state(ref_norm), _state(norm))
