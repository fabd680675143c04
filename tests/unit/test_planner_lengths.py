"""Memory budgets with micro-batches of variable length, without ranks: the
length keys are validated and named, the buckets cover every length up to
``max_sequence_length``, a micro-batch is cut or padded along the sequence
only, and the per-length plans keep the budget for every mix of lengths in
flight (a property test over the pure cost model and solver)."""

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ds_pipe_ckpt import ConfigError, CheckpointingConfig
from ds_pipe_ckpt.planning.cost_model import predicted_peak_bytes, recompute_seconds
from ds_pipe_ckpt.planning.length_plans import held_and_single_peak, plan_lengths
from ds_pipe_ckpt.planning.minimum_budget import InfeasibleBudgetError
from ds_pipe_ckpt.planning.problem import LayerProfile, StageProblem
from ds_pipe_ckpt.planning.shapes import SequenceLengths
from ds_pipe_ckpt.planning.solver import plan_stage


@pytest.mark.parametrize("section, match", [
    ({"max_sequence_length": 128}, "max_sequence_length = 128 is invalid: expected null unless memory_budget_mb"),
    ({"memory_budget_mb": 10, "max_sequence_length": 0}, "max_sequence_length = 0 is invalid: expected a positive"),
    ({"memory_budget_mb": 10, "max_sequence_length": 64, "sequence_dim": -1}, "sequence_dim = -1 is invalid"),
    ({"memory_budget_mb": 10, "sequence_dim": 0}, "sequence_dim = 0 is invalid: expected 1 .* unless max_seq"),
    ({"memory_budget_mb": 10, "max_sequence_length": 64, "length_buckets": 0}, "length_buckets = 0 is invalid"),
    ({"memory_budget_mb": 10, "length_buckets": 4}, "length_buckets = 4 is invalid: expected 8 .* unless max_seq"),
])
def test_bad_length_keys_are_named(section, match):
    with pytest.raises(ConfigError, match=match):
        CheckpointingConfig.from_ds_config({"pipeline": {"use_reentrant": False}, "activation_checkpointing": section})


def test_a_budget_with_dynamic_shapes_needs_the_maximum(single_rank_process_group):
    import torch.nn as nn

    import ds_pipe_ckpt
    from ds_pipe_ckpt.initialize import _check_plannable

    dynamic = ds_pipe_ckpt.PipelineModule(layers=[nn.Linear(2, 2)], num_stages=1, dynamic_shape=True)
    with pytest.raises(ConfigError, match=r"activation_checkpointing.max_sequence_length = None is invalid: expected "
                                          r"the longest micro-batch"):
        _check_plannable(dynamic, {"activation_checkpointing": {"memory_budget_mb": 10}},
                         "activation_checkpointing.memory_budget_mb")
    static = ds_pipe_ckpt.PipelineModule(layers=[nn.Linear(2, 2)], num_stages=1)
    with pytest.raises(ConfigError, match="max_sequence_length = 64 is invalid: expected null unless the "
                                          "PipelineModule is built with dynamic_shape=True"):
        _check_plannable(static, {"activation_checkpointing": {"memory_budget_mb": 10, "max_sequence_length": 64}},
                         "activation_checkpointing.memory_budget_mb")


def test_buckets_cover_every_length_up_to_the_maximum():
    lengths = SequenceLengths(100)
    assert lengths.edges == (13, 25, 38, 50, 63, 75, 88, 100)
    assert [lengths.edge_for(n, "here") for n in (1, 13, 14, 99, 100)] == [13, 13, 25, 100, 100]
    assert SequenceLengths(3).edges == (1, 2, 3)
    assert SequenceLengths(100, buckets=1).edges == (100, )  # one plan, made for the longest
    with pytest.raises(ConfigError, match="max_sequence_length = 100 .* here received one of 101 along dimension 1"):
        lengths.edge_for(101, "here")


def test_a_micro_batch_is_cut_or_padded_along_the_sequence_only():
    import torch

    lengths = SequenceLengths(64, dim=1)
    hidden = torch.randn(2, 8, 8, requires_grad=True)  # the hidden size equals the length: left alone
    tokens = torch.ones(2, 8, dtype=torch.long)
    longer = lengths.resized((hidden, tokens, 3), 8, 12)
    assert [tuple(t.shape) for t in longer[:2]] == [(2, 12, 8), (2, 12)] and longer[2] == 3
    assert longer[0].requires_grad and not longer[1].requires_grad
    assert torch.equal(longer[0][:, :8], hidden.detach()) and not longer[0][:, 8:].any()
    shorter = lengths.resized((hidden, ), 8, 5)
    assert tuple(shorter[0].shape) == (2, 5, 8)
    assert lengths.length_of((3, tokens), "stage 0") == 8
    with pytest.raises(ConfigError, match="sequence_dim = 1 is invalid: expected a dimension of stage 0's input"):
        lengths.length_of((torch.ones(4), ), "stage 0")


def _problem(length: int, in_flight: int, budget: int, attention: int) -> tuple[StageProblem, int]:
    """A stage of 4 layers at ``length``: each saves linearly in the length,
    plus ``attention`` x length^2 (eager attention's scores); its engine bytes."""
    layers = [LayerProfile(name=f"layer {i}", input_bytes=0 if i == 0 else 100 * length,
                           saved_bytes=(300 + 50 * i) * length + attention * length * length,
                           forward_s=(1 + i) * length / 1024, selective_saved_bytes=150 * length,
                           selective_recompute_s=length / 4096)
              for i in range(4)]
    engine = 200 * length
    return StageProblem(layers=layers, in_flight=in_flight, budget_bytes=budget,
                        base_bytes=(in_flight + 1) * engine + 5000), engine


def _mixed_peak(plans: dict, mix: tuple[int, ...]) -> int:
    """The cost model's peak of micro-batches of lengths ``mix`` in flight,
    oldest first, each on its length's plan: the k-th forward's end, and the
    oldest's backward with the others held (the formula plan_lengths bounds)."""
    first = plans[mix[0]]
    fixed = first.problem.base_bytes - (first.problem.in_flight + 1) * first.engine_bytes
    held = [plans[n].held_bytes for n in mix]
    return fixed + sum(held) + first.single_peak_bytes - first.held_bytes


@settings(max_examples=60, deadline=None)
@given(in_flight=st.integers(1, 3), fraction=st.floats(0.3, 1.0), attention=st.integers(0, 4))
def test_every_mix_in_flight_keeps_the_budget_and_no_length_plans_worse_than_the_longest(in_flight, fraction,
                                                                                          attention):
    lengths = (16, 32, 48, 64)
    store_all, _ = _problem(64, in_flight, 10**12, attention)
    problems, engine = {}, {}
    full = predicted_peak_bytes(store_all, plan_stage(store_all).segments)
    budget = int(full * fraction)
    for n in lengths:
        problems[n], engine[n] = _problem(n, in_flight, budget, attention)
    try:
        plans = plan_lengths(problems, engine)
    except InfeasibleBudgetError:  # the longest has no plan: nothing to check
        return
    assert plans.bound_bytes <= budget
    by_length = {p.length: p for p in plans.by_length}
    assert by_length[64].plan == plan_stage(problems[64])
    for mix in itertools.product(lengths, repeat=in_flight):
        assert _mixed_peak(by_length, mix) <= plans.bound_bytes
    for n in lengths:
        held, single = held_and_single_peak(problems[n], by_length[n].plan)
        assert (held + engine[n], single + 2 * engine[n]) == (by_length[n].held_bytes, by_length[n].single_peak_bytes)
        # One length in flight: the bound's formula is the cost model's own peak.
        assert _mixed_peak(by_length, (n, ) * in_flight) == predicted_peak_bytes(problems[n], by_length[n].plan.segments)
        # Never more recomputation than any longer length's plan would cost at this length.
        for longer in (m for m in lengths if m > n):
            assert by_length[n].plan.recompute_s <= recompute_seconds(problems[n], by_length[longer].plan.segments)
