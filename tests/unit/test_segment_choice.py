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

import pipeline_jobs
from ds_pipe_ckpt.checkpoint import checkpoint_region
from ds_pipe_ckpt.regions import Region
from ds_pipe_ckpt.settings import current_settings
from ds_pipe_ckpt.testing import run_ranks

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


CASES = {
    "none": {},
    "non_reentrant": {"interval": 1, "use_reentrant": False},
    "reentrant": {"interval": 1, "use_reentrant": True},
    # The user's list stands: everything named is checkpointed.
    "listed": {"interval": 1, "use_reentrant": False,
               "checkpointable_layers": ["TokenEmbedding", "PositionEmbedding", "Block", "FinalLayerNorm"]},
    # Inputs kept on the CPU: checkpointing the head frees its input.
    "cpu_checkpointing": {"interval": 1, "use_reentrant": False,
                          "activation_checkpointing": {"cpu_checkpointing": True}},
}


@pytest.fixture(scope="module")
def gpt_runs():
    return run_ranks(pipeline_jobs.train_gpt_segments, 2, CASES, timeout=600)


@pytest.mark.parametrize("name", [n for n in CASES if n != "none"])
def test_losses_and_parameters_equal_no_checkpointing(gpt_runs, name):
    for rank, result in enumerate(gpt_runs):
        ref, got = result["none"], result[name]
        assert got["losses"] == ref["losses"], f"rank {rank}: losses differ from no checkpointing"
        for pname, value in ref["params"].items():
            assert torch.equal(got["params"][pname], value), f"rank {rank}: parameter {pname} differs"


def _by_layer(result):
    """Segment label -> (choice, checkpoint calls), keyed by the layer's name in the label."""
    return {label.split("(")[1].rstrip(")"): (choice, result["calls"].get(label, 0))
            for label, choice in result["choices"].items()}


@pytest.mark.parametrize("name", ["non_reentrant", "reentrant"])
def test_embedding_position_table_and_tied_head_run_plainly(gpt_runs, name):
    stage0, stage1 = (_by_layer(r[name]) for r in gpt_runs)
    micro_batches = gpt_runs[0][name]["micro_batches"]
    # Checkpointed once, on the first call that learns what they save; plain after.
    assert stage0["TokenEmbedding"] == ("plain: frees nothing", 1)
    assert stage0["PositionEmbedding"] == ("plain: frees nothing", 1)
    # Reentrant mode keeps upstream's rule, which leaves out a forward_fn (not a module) already.
    assert stage1["lm_head"] == (("plain", 0) if name == "reentrant" else ("plain: frees nothing", 1))
    # Blocks save activations and dropout masks; the final norm its statistics.
    assert stage0["Block"] == ("checkpointed", micro_batches)
    assert stage1["Block"] == ("checkpointed", micro_batches)
    assert stage1["FinalLayerNorm"] == ("checkpointed", micro_batches)


def test_checkpointable_layers_is_the_users_choice(gpt_runs):
    stage0, stage1 = (_by_layer(r["listed"]) for r in gpt_runs)
    micro_batches = gpt_runs[0]["listed"]["micro_batches"]
    assert stage0["TokenEmbedding"] == ("checkpointed", micro_batches)
    assert stage0["PositionEmbedding"] == ("checkpointed", micro_batches)
    assert stage1["lm_head"] == ("plain", 0)  # not named in the list


def test_inputs_kept_elsewhere_keep_every_segment_checkpointed(gpt_runs):
    for result in gpt_runs:
        micro_batches = result["cpu_checkpointing"]["micro_batches"]
        assert all(value == ("checkpointed", micro_batches) for value in _by_layer(result["cpu_checkpointing"]).values())
