"""Code written for upstream DeepSpeed or for torch's checkpoint, run unchanged
through ds_pipe_ckpt: exact gradients or a clear error, never silently wrong
ones, in both modes.

In the reentrant mode a region's first call runs non-reentrantly (it learns
what DeepSpeed's reentrant path cannot see); the reentrant cases call each
region more than once so that DeepSpeed's path is exercised too.
"""

from __future__ import annotations

import collections
import functools
import warnings

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint as torch_checkpoint
from deepspeed.runtime.activation_checkpointing import checkpointing as ds_checkpointing

import ds_pipe_ckpt
from ds_pipe_ckpt.compat import MARKS_CHECKPOINT_HOOKS
from ds_pipe_ckpt import ConfigError, InPlaceInputError, RecomputeMismatchError, ReentrantFallbackWarning
from checkpoint_modes import MODES


def _grads(module, *inputs):
    return [t.grad.clone() if t.grad is not None else None for t in (*inputs, *module.parameters()) if t.is_leaf]


def _reference(module, fn, make_input, seed=0):
    module.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    x = make_input()
    out = fn(x)
    out.pow(2).sum().backward()
    return out.detach(), _grads(module, x)


def _checkpointed(module, fn, make_input, use_reentrant, seed=0):
    module.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    x = make_input()
    out = ds_pipe_ckpt.checkpoint(fn, x, use_reentrant=use_reentrant)
    out.pow(2).sum().backward()
    return out.detach(), _grads(module, x)


def _assert_equal(expected, got):
    (out_a, grads_a), (out_b, grads_b) = expected, got
    assert torch.equal(out_a, out_b)
    for i, (a, b) in enumerate(zip(grads_a, grads_b)):
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), f"gradient {i} differs"


# -- item 1: regions that modify their input in place --------------------------------------

class ReluFirst(nn.Module):
    """A block as people write them: an in-place activation is its first op."""

    def __init__(self):
        super().__init__()
        self.act = nn.ReLU(inplace=True)
        self.lin = nn.Linear(6, 6)

    def forward(self, x):
        return self.lin(self.act(x))


class ScaleInPlace(nn.Module):
    """Not idempotent: recomputing from the modified input would double the scale."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x):
        x.mul_(3.0)
        return torch.tanh(self.lin(x))


class InPlaceOnly(nn.Module):
    """ReLU(inplace=True) alone, as a pipeline segment of one layer is: returns its input."""

    def __init__(self):
        super().__init__()
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        return self.act(x)


@pytest.mark.parametrize("use_reentrant", MODES)
@pytest.mark.parametrize("cls", [ReluFirst, ScaleInPlace, InPlaceOnly])
def test_regions_that_modify_their_input_in_place_are_exact(cls, use_reentrant):
    torch.manual_seed(0)
    module = cls()
    w = torch.randn(6, 6, requires_grad=True)

    def make():
        return torch.randn(4, 6) @ w  # a non-leaf, as a previous layer's output is

    def fn(x):
        return module(x) * 1.5

    # The caller sees the modification, as without checkpointing: a later use of x
    # (a residual) must read the modified values through the graph.
    def with_residual(checkpointed):
        def run(x):
            h = ds_pipe_ckpt.checkpoint(fn, x, use_reentrant=use_reentrant) if checkpointed else fn(x)
            return h + x
        return run

    expected = _reference(module, with_residual(False), make)
    expected_w = w.grad.clone()
    w.grad = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for call in range(3):  # the first call learns, later calls act on it
            w.grad = None
            _assert_equal(expected, _reference(module, with_residual(True), make))
            assert torch.equal(w.grad, expected_w), f"call {call}: the gradient reaching the caller differs"
    in_place_warnings = [w for w in caught if issubclass(w.category, ReentrantFallbackWarning)]
    assert len(in_place_warnings) == (1 if use_reentrant else 0)
    if use_reentrant:
        assert f"function {test_regions_that_modify_their_input_in_place_are_exact.__name__}.<locals>.fn modifies " \
               "its input in place" in str(in_place_warnings[0].message)


def test_a_region_that_starts_modifying_its_input_later_is_refused():
    lin = nn.Linear(4, 4)
    calls = []

    def fn(x):
        calls.append(1)
        if len(calls) > 2:  # forward and recomputation of the first call leave x alone
            x.mul_(2)
        return lin(x)

    make = lambda: torch.randn(2, 4, requires_grad=True) * 1.0
    ds_pipe_ckpt.checkpoint(fn, make(), use_reentrant=False).sum().backward()
    with pytest.raises(InPlaceInputError, match=r"modified its tensor input\(s\) \[0\] in place during its forward, "
                                                r"which its first call did not do"):
        ds_pipe_ckpt.checkpoint(fn, make(), use_reentrant=False)


def test_backward_twice_through_a_region_that_modifies_its_input_is_refused():
    module = ScaleInPlace()
    out = ds_pipe_ckpt.checkpoint(module, torch.randn(2, 6, requires_grad=True) * 1.0, use_reentrant=False)
    out.sum().backward(retain_graph=True)
    with pytest.raises(InPlaceInputError, match="already been recomputed from its private copy"):
        out.sum().backward()


# -- item 4: an input modified in place after the forward ----------------------------------

def _learned(fn, make, use_reentrant):
    """Call ``fn`` once so that the reentrant mode's later calls take DeepSpeed's path."""
    ds_pipe_ckpt.checkpoint(fn, make(), use_reentrant=use_reentrant).sum().backward()


@pytest.mark.parametrize("use_reentrant", MODES)
@pytest.mark.parametrize("how", ["no_grad", "recorded", "passed_through"])
def test_input_modified_after_the_forward_is_named_not_silently_wrong(use_reentrant, how):
    """Upstream's reentrant checkpoint returned gradients off by up to 3.85 here, with no error."""
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)

    def fn(x):
        return lin(x) if how != "passed_through" else (lin(x), x)

    make = lambda: torch.randn(3, 4, requires_grad=True) * 1.0
    _learned(lambda x: fn(x)[0] if how == "passed_through" else fn(x), make, use_reentrant)
    x = make()
    out = ds_pipe_ckpt.checkpoint(fn, x, use_reentrant=use_reentrant)
    if how == "no_grad":
        with torch.no_grad():
            x.add_(1.0)
    elif how == "recorded":
        x.mul_(2.0)
    else:
        out, passed = out
        out = out + passed.relu_()  # the next layer modifies the tensor the region returned
    with pytest.raises(InPlaceInputError, match=r"input (0 )?of checkpointed function .*fn was modified in place "
                                                r"after its forward"):
        out.sum().backward()


@pytest.mark.deepspeed_reentrant
def test_reentrant_mode_still_refuses_a_region_whose_forward_modifies_inputs_unexpectedly():
    """A region whose first call left its input alone goes through DeepSpeed's
    path later; if it then modifies its input, that is refused at once."""
    lin = nn.Linear(4, 4)
    calls = []

    def fn(x):
        calls.append(1)
        if len(calls) > 2:
            x.mul_(2)
        return lin(x)

    make = lambda: torch.randn(2, 4, requires_grad=True) * 1.0
    _learned(fn, make, True)
    with pytest.raises(InPlaceInputError, match="DeepSpeed's reentrant checkpoint runs the forward without grad"):
        ds_pipe_ckpt.checkpoint(fn, make(), use_reentrant=True)


@pytest.mark.deepspeed_reentrant
def test_reentrant_mode_evaluates_an_in_place_region_without_grad():
    """Evaluation (grad disabled) recomputes nothing, so a region that modifies its
    input in place (a stage that begins with ReLU(inplace=True)) runs as it would
    without checkpointing, as in DeepSpeed, in both modes."""
    model = nn.Sequential(nn.ReLU(inplace=True), nn.Linear(4, 3))
    x = torch.randn(5, 4)
    with torch.no_grad():
        expected = model(x.clone())
        for use_reentrant in (True, False):
            got_input = x.clone()
            got = ds_pipe_ckpt.checkpoint(model, got_input, use_reentrant=use_reentrant)
            assert torch.equal(got, expected), use_reentrant
            assert torch.equal(got_input, x.clamp(min=0)), use_reentrant


# -- item 5: structured outputs ------------------------------------------------------------

Pair = collections.namedtuple("Pair", "first second")


class Structured(nn.Module):
    def __init__(self, shape: str):
        super().__init__()
        self.shape = shape
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        a, b, c = self.a(x), self.b(x).tanh(), self.c(x).sigmoid()
        return {
            "list": lambda: [a, b, c],
            "nested": lambda: ((a, b), c),
            "dict": lambda: {"a": a, "rest": [b, {"c": c}], "n": 3},
            "namedtuple": lambda: Pair(a, (b, c)),
        }[self.shape]()


def _leaves(obj):
    return [t for t in torch.utils._pytree.tree_leaves(obj) if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("use_reentrant", MODES)
@pytest.mark.parametrize("shape", ["list", "nested", "dict", "namedtuple"])
def test_structured_outputs_keep_their_structure_and_every_gradient(shape, use_reentrant):
    torch.manual_seed(0)
    module = Structured(shape)
    make = lambda: torch.randn(3, 4, generator=torch.Generator().manual_seed(1), requires_grad=True)

    def loss(out):
        return sum((t * (i + 1)).pow(2).sum() for i, t in enumerate(_leaves(out)))

    x = make()
    expected = module(x)
    loss(expected).backward()
    expected_grads = _grads(module, x)
    for _ in range(2):
        module.zero_grad(set_to_none=True)
        x = make()
        got = ds_pipe_ckpt.checkpoint(module, x, use_reentrant=use_reentrant)
        assert torch.utils._pytree.tree_structure(got) == torch.utils._pytree.tree_structure(expected)
        assert type(got) is type(expected)
        loss(got).backward()
        for i, (a, b) in enumerate(zip(expected_grads, _grads(module, x))):
            assert a is not None and torch.equal(a, b), f"gradient {i} differs or is missing"


@pytest.mark.deepspeed_reentrant
def test_reentrant_refuses_an_output_it_cannot_see_into():
    class Holder:
        def __init__(self, tensor):
            self.tensor = tensor

    lin = nn.Linear(2, 2)
    calls = []

    def fn(x):
        calls.append(1)
        return lin(x) if len(calls) <= 2 else (lin(x), Holder(lin(x)))

    make = lambda: torch.randn(1, 2, requires_grad=True)
    _learned(fn, make, True)
    with pytest.raises(TypeError, match="returned a Holder holding tensors, which DeepSpeed's reentrant checkpoint "
                                        "cannot see into"):
        ds_pipe_ckpt.checkpoint(fn, make(), use_reentrant=True)


# -- item 6: a cached function of a parameter ----------------------------------------------

class CachedWeightNorm(nn.Module):
    """Weight norm with its normalised weight cached on the first call (and reused, as
    rotary tables and weight caches are): the recomputation does not rebuild it."""

    def __init__(self):
        super().__init__()
        self.v = nn.Parameter(torch.randn(4, 4))
        self.cache = None

    def forward(self, x):
        if self.cache is None:
            self.cache = self.v / self.v.norm(dim=1, keepdim=True)
        return x @ self.cache.t()


@pytest.mark.deepspeed_reentrant
def test_upstream_reentrant_checkpoint_silently_drops_the_cached_parameters_gradient():
    """What users get from DeepSpeed: the cache is built under no_grad in the
    forward, the recomputation reuses it, and v never gets a gradient."""
    module = CachedWeightNorm()
    x = torch.randn(2, 4, requires_grad=True)
    ds_checkpointing.checkpoint(module, x).sum().backward()
    assert module.v.grad is None and x.grad is not None


@pytest.mark.parametrize("use_reentrant", MODES)
def test_a_cached_function_of_a_parameter_is_named_on_the_first_call(use_reentrant):
    module = CachedWeightNorm()
    out = ds_pipe_ckpt.checkpoint(module, torch.randn(2, 4, requires_grad=True), use_reentrant=use_reentrant)
    with pytest.raises(RecomputeMismatchError, match=r"^Recomputation of checkpointed function CachedWeightNorm "
                                                     r"diverged from its forward: saved tensor #0 differs: the forward "
                                                     r"saved a leaf that requires grad"):
        out.sum().backward()


# -- item 7: names of what the user wrote -------------------------------------------------

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x, scale=1.0):
        self.calls += 1
        h = self.lin(x) * scale
        return torch.tanh(h) if self.calls == 1 else torch.sigmoid(h)  # diverges on recomputation


@pytest.mark.parametrize("wrap, name", [
    (lambda b: functools.partial(Block.forward, b, scale=2.0), "Block.forward"),  # as transformers calls
    (lambda b: b.forward, "Block.forward"),
    (lambda b: b, "Block"),
    (lambda b: functools.partial(b, scale=2.0), "Block"),
])
def test_errors_name_the_class_and_method_the_user_wrote(wrap, name):
    out = ds_pipe_ckpt.checkpoint(wrap(Block()), torch.randn(2, 4, requires_grad=True), use_reentrant=False)
    with pytest.raises(RecomputeMismatchError, match=rf"^Recomputation of checkpointed function {name} diverged"):
        out.sum().backward()


def test_warnings_name_the_method_too():
    block = Block()
    with pytest.warns(ReentrantFallbackWarning, match="reentrant checkpointing of function Block.forward was called"):
        ds_pipe_ckpt.checkpoint(functools.partial(Block.forward, block), torch.randn(2, 4), use_reentrant=True)


# -- item 8: torch's checkpoint keywords ---------------------------------------------------

def _dropout_block():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.GELU(), nn.Linear(8, 8))


def _grads_of(checkpoint_fn, block, seed=3):
    block.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    x = torch.randn(4, 8, requires_grad=True)
    checkpoint_fn(block, x).pow(2).sum().backward()
    return [x.grad, *(p.grad for p in block.parameters())]


@pytest.mark.parametrize("keywords", [
    dict(preserve_rng_state=False),
    dict(early_stop=False),
    dict(determinism_check="none"),
    dict(debug=True),
    dict(context_fn=lambda: torch_checkpoint.create_selective_checkpoint_contexts([torch.ops.aten.mm.default])),
], ids=["preserve_rng_state", "early_stop", "determinism_check", "debug", "context_fn"])
def test_torch_keywords_have_torchs_meaning_in_non_reentrant_mode(keywords):
    """The same gradients as torch's own checkpoint with the same keywords (with
    preserve_rng_state=False the dropout masks of the recomputation are fresh, in
    torch's and in ours alike)."""
    block = _dropout_block()
    expected = _grads_of(lambda f, x: torch_checkpoint.checkpoint(f, x, use_reentrant=False, **keywords), block)
    got = _grads_of(lambda f, x: ds_pipe_ckpt.checkpoint(f, x, use_reentrant=False, **keywords), block)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    reference = _grads_of(lambda f, x: f(x), block)
    same_as_no_checkpointing = all(torch.equal(a, b) for a, b in zip(reference, got))
    assert same_as_no_checkpointing == ("preserve_rng_state" not in keywords)


@pytest.mark.deepspeed_reentrant
def test_torch_keywords_never_reach_the_function():
    seen = {}

    def fn(x, **kwargs):
        seen.update(kwargs)
        return x * 2

    for use_reentrant in (True, False):
        ds_pipe_ckpt.checkpoint(fn, torch.randn(2, requires_grad=True), use_reentrant=use_reentrant,
                                early_stop=True, determinism_check="default", mine=1).sum().backward()
    assert seen == {"mine": 1}


@pytest.mark.parametrize("keyword, value", [
    ("context_fn", torch_checkpoint.noop_context_fn), ("debug", True), ("preserve_rng_state", False),
    ("respect_saved_tensors_hooks", True),
])
def test_keywords_the_reentrant_mode_cannot_honour_are_named(keyword, value):
    with pytest.raises(ConfigError, match=rf"^{keyword} = .* is invalid: expected .*use_reentrant=True"):
        ds_pipe_ckpt.checkpoint(nn.Linear(2, 2), torch.randn(1, 2, requires_grad=True), use_reentrant=True,
                                **{keyword: value})


def test_bad_keyword_values_are_named():
    lin, x = nn.Linear(2, 2), torch.randn(1, 2, requires_grad=True)
    with pytest.raises(ConfigError, match="determinism_check = 'strict' is invalid"):
        ds_pipe_ckpt.checkpoint(lin, x, use_reentrant=False, determinism_check="strict")
    with pytest.raises(ConfigError, match="preserve_rng_state = 'no' is invalid"):
        ds_pipe_ckpt.checkpoint(lin, x, use_reentrant=False, preserve_rng_state="no")
    with pytest.raises(ConfigError, match="context_fn = 3 is invalid"):
        ds_pipe_ckpt.checkpoint(lin, x, use_reentrant=False, context_fn=3)


# -- item 9: torch's selective checkpointing composes cleanly ------------------------------

@pytest.mark.parametrize("settings", [{}, {"checkpoint_in_cpu": True}], ids=["plain", "offloaded_inputs"])
def test_selective_checkpointing_through_context_fn_warns_nothing(settings):
    ds_pipe_ckpt.configure(mpu=ds_pipe_ckpt.parallel.TensorParallelGroup.single(), use_reentrant=False, **settings)
    block = _dropout_block()
    context_fn = functools.partial(torch_checkpoint.create_selective_checkpoint_contexts,
                                   [torch.ops.aten.addmm.default])
    expected = _grads_of(lambda f, x: f(x), block)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = _grads_of(lambda f, x: ds_pipe_ckpt.checkpoint(f, x, context_fn=context_fn), block)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))


def test_a_users_own_saved_tensor_hooks_are_still_seen_by_selective_checkpointing():
    """Ours are transparent; the user's save_on_cpu is not, exactly as with torch alone."""
    block = _dropout_block()
    context_fn = functools.partial(torch_checkpoint.create_selective_checkpoint_contexts,
                                   [torch.ops.aten.addmm.default])
    warned = []
    for checkpoint_fn in (torch_checkpoint.checkpoint, ds_pipe_ckpt.checkpoint):
        with torch.autograd.graph.save_on_cpu(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            checkpoint_fn(block, torch.randn(4, 8, requires_grad=True), use_reentrant=False, context_fn=context_fn)
        warned.append([str(w.message) for w in caught if "respect_saved_tensors_hooks" in str(w.message)])
    assert warned[0] == warned[1]
    if MARKS_CHECKPOINT_HOOKS:  # torch >= 2.14 sees the user's hooks (and warns); before, it ignores every hook
        assert warned[0], "torch's checkpoint did not warn"
