"""Segment choice in the engine, the GPT example at pp=2: the embedding, the
position table and the tied head run plainly after their first call, unless
the user chose (``checkpointable_layers``) or inputs are kept elsewhere (CPU
checkpointing, partitioning); losses and parameters stay bitwise those of no
checkpointing, in every mode."""

import pytest
import torch

import pipeline_jobs
from pipeline_jobs import case_params, runnable_cases
from ds_pipe_ckpt.testing import run_ranks


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
    return run_ranks(pipeline_jobs.train_gpt_segments, 2, runnable_cases(CASES), timeout=600)


@pytest.mark.parametrize("name", case_params(CASES, [n for n in CASES if n != "none"]))
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


@pytest.mark.parametrize("name", case_params(CASES, ["non_reentrant", "reentrant"]))
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
