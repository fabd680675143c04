"""Only segments whose checkpointing frees memory are checkpointed: a region
whose first checkpointed call saved for backward nothing but its inputs and
parameters (an embedding, a tied LM head, a cast, a reshape) runs plainly
after it, unless the user chose (``checkpointable_layers``) or inputs are kept
elsewhere (CPU checkpointing, partitioning). Losses and parameters stay bitwise
those of no checkpointing."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from ds_pipe_ckpt.checkpoint import checkpoint_region
from ds_pipe_ckpt.regions import Region
from ds_pipe_ckpt.settings import current_settings


_LINEAR = nn.Linear(8, 30, bias=False)


_EMBEDDING = nn.Embedding(10, 8)


class _Scaled(nn.Module):
    """Multiplies by a buffer (as a rotary table is used): saves the buffer."""

    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 8))

    def forward(self, x):
        return x * self.scale


_SCALED = _Scaled()


REGIONS = {
    # Saves only its inputs and parameters (views of them included).
    "linear on [B, T, d] (a reshaped view of the input, the weight's transpose)": (_LINEAR, True),
    "embedding (the indices)": (_EMBEDDING, True),
    "tied head F.linear(x, embedding.weight)": (lambda x: F.linear(x, _EMBEDDING.weight), True),
    "cast": (lambda x: x.double(), True),
    "reshape": (lambda x: x.reshape(-1, 8), True),
    "add of a parameter slice": (lambda x: x + _LINEAR.weight[:1], True),
    "multiply by a module buffer": (_SCALED, True),
    # Saves memory of its own.
    "linear then gelu (gelu's input)": (lambda x: F.gelu(_LINEAR(x)), False),
    "layer norm (mean and rstd)": (nn.LayerNorm(8), False),
    "dropout (the mask)": (lambda x: F.dropout(x, 0.1), False),
    "exp (its output)": (torch.exp, False),
}


@pytest.mark.parametrize("name", list(REGIONS))
def test_first_call_learns_whether_a_region_saves_only_inputs(name):
    function, expected = REGIONS[name]
    x = torch.randint(0, 10, (2, 5)) if function is _EMBEDDING else torch.randn(2, 5, 8, requires_grad=True)
    region = Region(name)
    assert region.facts.saves_only_inputs is None
    out = checkpoint_region(function, (x, ), {}, region, current_settings().options(use_reentrant=False))
    assert region.facts.saves_only_inputs is expected
    out.sum().backward()  # the learning call's recomputation is checked as any other


def test_nothing_is_learned_without_grad():
    region = Region("no grad")
    with torch.no_grad():
        checkpoint_region(_LINEAR, (torch.randn(2, 8), ), {}, region, current_settings().options(use_reentrant=False))
    assert region.facts.saves_only_inputs is None


def test_learned_with_determinism_check_none_too():
    region = Region("no check")
    options = current_settings().options(use_reentrant=False, determinism_check="none")
    checkpoint_region(_LINEAR, (torch.randn(2, 5, 8, requires_grad=True), ), {}, region, options).sum().backward()
    assert region.facts.saves_only_inputs is True
