"""PipelineModule under DeepSpeed's pipeline engine, on 2 and 4 CPU ranks.

One launch per topology trains every case; the tests then compare the loss
sequences and final parameters with the no-checkpoint run, bitwise.
"""

import pytest
import torch

import pipeline_jobs
from pipeline_jobs import case_params, runnable_cases
from ds_pipe_ckpt.testing import run_ranks

STEPS = 12

CASES = {
    "none": {"init": "deepspeed"},
    "deepspeed_init_reentrant": {"init": "deepspeed", "interval": 1},
    "deepspeed_init_non_reentrant": {"init": "deepspeed", "interval": 1, "use_reentrant": False},
    "ours_reentrant": {"init": "ours", "config_interval": 1, "use_reentrant": True},
    "ours_non_reentrant": {"init": "ours", "config_interval": 1, "use_reentrant": False},
    # The flag must hold when the configured interval is 0 and the interval comes later.
    "deepspeed_init_interval_later": {"init": "deepspeed", "config_interval": 0, "use_reentrant": False,
                                      "set_interval_later": 1},
    "ours_interval_later": {"init": "ours", "config_interval": 0, "use_reentrant": False,
                            "set_interval_later": 1},
    "non_reentrant_interval_2": {"init": "ours", "config_interval": 2, "use_reentrant": False},
    "non_reentrant_only_linear": {"init": "ours", "config_interval": 1, "use_reentrant": False,
                                  "checkpointable_layers": ["Linear"]},
    "tied_none": {"init": "deepspeed", "model": "tied"},
    "tied_reentrant": {"init": "ours", "model": "tied", "config_interval": 1},
    "tied_non_reentrant": {"init": "ours", "model": "tied", "config_interval": 1, "use_reentrant": False},
}

NON_REENTRANT = [name for name, case in CASES.items() if case.get("use_reentrant") is False]
REENTRANT = case_params(CASES, [name for name, case in CASES.items()
                                if case.get("use_reentrant") is not False and name not in ("none", "tied_none")])


@pytest.fixture(scope="module", params=[(2, 2), (2, 4)], ids=["pp2", "pp2xdp2"])
def runs(request):
    pp, world = request.param
    return run_ranks(pipeline_jobs.train_cases, world, runnable_cases(CASES), pp, STEPS, timeout=600)


def _baseline(name):
    return "tied_none" if CASES[name].get("model") == "tied" else "none"


@pytest.mark.parametrize("name", case_params(CASES, [n for n in CASES if n not in ("none", "tied_none")]))
def test_losses_and_parameters_equal_no_checkpointing(runs, name):
    for rank, result in enumerate(runs):
        ref, got = result[_baseline(name)], result[name]
        assert got["losses"] == ref["losses"], f"rank {rank}: loss sequence differs from no checkpointing"
        for pname, value in ref["params"].items():
            assert torch.equal(got["params"][pname], value), f"rank {rank}: parameter {pname} differs"


def test_training_makes_progress(runs):
    losses = runs[0]["none"]["losses"]
    assert len(losses) == STEPS
    assert sum(losses[-3:]) < 0.9 * sum(losses[:3]), losses


@pytest.mark.parametrize("name", NON_REENTRANT)
def test_non_reentrant_mode_is_selected(runs, name):
    assert all(r[name]["mode"] == "non_reentrant" for r in runs)


@pytest.mark.parametrize("name", REENTRANT)
def test_reentrant_mode_is_default(runs, name):
    assert all(r[name]["mode"] == "reentrant" for r in runs)


def _relu_count(result):
    return result["local_layers"].count("CountingReLU")


@pytest.mark.parametrize("name", ["deepspeed_init_non_reentrant", "ours_non_reentrant",
                                  "deepspeed_init_interval_later", "ours_interval_later",
                                  "non_reentrant_interval_2", "tied_non_reentrant"])
def test_parameter_free_segments_are_recomputed_in_non_reentrant_mode(runs, name):
    for rank, result in enumerate(runs):
        r = result[name]
        assert all(r["checkpointed_segments"]), f"rank {rank}: a segment was not checkpointed"
        # every parameter-free ReLU ran once in forward and once in recomputation
        assert r["relu_calls"] == 2 * r["micro_batches"] * _relu_count(r), f"rank {rank}"


@pytest.mark.parametrize("name", case_params(CASES, ["deepspeed_init_reentrant", "ours_reentrant", "tied_reentrant"]))
def test_reentrant_mode_keeps_upstream_segment_choice(runs, name):
    for rank, result in enumerate(runs):
        r = result[name]
        assert r["relu_calls"] == r["micro_batches"] * _relu_count(r), f"rank {rank}: ReLU was recomputed"


def test_checkpointable_layers_restricts_non_reentrant_segments(runs):
    for result in runs:
        r = result["non_reentrant_only_linear"]
        assert r["checkpointed_segments"] == [name == "Linear" for name in r["local_layers"]]
        assert r["relu_calls"] == r["micro_batches"] * _relu_count(r)


def test_non_reentrant_does_not_force_input_requires_grad(runs):
    """The engine keeps stage-0 inputs without grad in non-reentrant mode; the
    parameters of the first (checkpointed) segment still trained identically."""
    first = runs[0]
    assert first["ours_non_reentrant"]["params"]["0.weight"].shape == (16, 8)
    assert torch.equal(first["ours_non_reentrant"]["params"]["0.weight"], first["none"]["params"]["0.weight"])
    assert not torch.equal(first["none"]["params"]["0.weight"], first["none"]["initial_first_weight"])
