"""Stage boundaries chosen with each stage's checkpointing plan
(ds_pipe_ckpt.planning.partition): the least modelled 1F1B step time against
exhaustive search over every cut of small chains, hand-solved cuts, the
infeasible-budget error and validation."""

from __future__ import annotations

from itertools import combinations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ds_pipe_ckpt.planning import InfeasibleBudgetError, LayerProfile, plan_stage
from ds_pipe_ckpt.planning.partition import InfeasiblePartitionError, PartitionProblem, plan_cut, plan_partition


def layer(name, input_bytes, saved_bytes, forward_s, selective_saved_bytes=None, selective_recompute_s=None,
          grad_bytes=0):
    return LayerProfile(name, input_bytes, saved_bytes, forward_s, selective_saved_bytes, selective_recompute_s,
                        grad_bytes=grad_bytes)


def every_cut(problem: PartitionProblem):
    """(step seconds, slowest stage seconds, boundaries) of every cut that fits."""
    n, pp, m = len(problem.layers), problem.stages, problem.micro_batches
    for inner in combinations(range(1, n), pp - 1):
        boundaries = (0, *inner, n)
        times = []
        for s, (a, b) in enumerate(zip(boundaries, boundaries[1:])):
            try:
                plan = plan_stage(problem.stage_problem(s, a, b))
            except InfeasibleBudgetError:
                break
            times.append(sum(problem.layers[i].forward_s + problem.backward_s[i] for i in range(a, b))
                         + plan.recompute_s + (problem.loss_s if b == n else 0.0))
        else:
            yield sum(times) + (m - 1) * max(times), max(times), boundaries


TIMES = st.integers(1, 8).map(lambda quarters: quarters / 4)


@st.composite
def partition_problems(draw) -> PartitionProblem:
    n = draw(st.integers(1, 6))
    pp = draw(st.integers(1, min(n, 3)))
    layers = []
    for index in range(n):
        saved = draw(st.integers(0, 12))
        selective = draw(st.none() | st.integers(0, saved))
        layers.append(layer(f"l{index}", draw(st.integers(0, 8)), saved, draw(TIMES), selective,
                            None if selective is None else draw(TIMES), grad_bytes=draw(st.sampled_from([0, 0, 2]))))
    return PartitionProblem(layers=layers, backward_s=[draw(TIMES) for _ in range(n)],
                            output_bytes=draw(st.integers(0, 8)), stages=pp,
                            micro_batches=draw(st.sampled_from([1, 2, 4, 8])),
                            budget_bytes=[draw(st.integers(20, 90)) for _ in range(pp)],
                            allow_selective=draw(st.booleans()), planner_margins=False,
                            loss_s=draw(st.sampled_from([0.0, 0.0, 1.5])), loss_saved_bytes=draw(st.integers(0, 6)))


@settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(problem=partition_problems())
def test_partition_is_optimal_against_exhaustive_search(problem):
    cuts = list(every_cut(problem))
    if not cuts:
        with pytest.raises(InfeasiblePartitionError, match="no cut of"):
            plan_partition(problem)
        return
    step, slowest, _ = min(cuts)
    plan = plan_partition(problem)
    assert plan.step_seconds == pytest.approx(step, rel=1e-12)
    assert max(plan.stage_seconds) == pytest.approx(slowest, rel=1e-12)
    assert plan.boundaries[0] == 0 and plan.boundaries[-1] == len(problem.layers)
    assert len(plan.stage_plans) == problem.stages
    for s, ((a, b), stage_plan) in enumerate(zip(plan.stage_layers, plan.stage_plans)):
        assert b > a
        assert stage_plan.predicted_peak_bytes <= problem.budget_bytes[s]
        assert stage_plan == plan_stage(problem.stage_problem(s, a, b))


def test_the_cut_balances_work_when_memory_is_no_object():
    """Times only: work (forward + backward) 1, 1 and 4. Cut after layer 1:
    stages take 2 and 4, step = 6 + 3 * 4 = 18; after layer 0: 1 and 5, 21."""
    layers = [layer("a", 4, 4, 0.5), layer("b", 4, 4, 0.5), layer("c", 4, 4, 2.0)]
    problem = PartitionProblem(layers=layers, backward_s=[0.5, 0.5, 2.0], output_bytes=4, stages=2,
                               micro_batches=4, budget_bytes=[10**6, 10**6], planner_margins=False)
    plan = plan_partition(problem)
    assert plan.boundaries == (0, 2, 3)
    assert plan.stage_seconds == (2.0, 4.0) and plan.step_seconds == 18.0
    assert all(segment.decision.value == "store" for p in plan.stage_plans for segment in p.segments)


def test_recomputation_on_the_first_stage_can_beat_an_unbalanced_cut():
    """Four equal layers (input 1, saved 10, forward 1, backward 2), pp=2, 4
    micro-batches, 40 bytes per stage. Stage 0 holds 2 micro-batches: with
    two layers stored it needs 6 + 2 x 20 = 46 bytes, so it recomputes one
    layer (1 s): times 7 and 6, step 13 + 3 x 7 = 34. Giving it one layer
    stores everything but leaves stage 1 three: times 3 and 9, step 39."""
    layers = [layer(f"block{i}", 1, 10, 1.0) for i in range(4)]
    problem = PartitionProblem(layers=layers, backward_s=[2.0] * 4, output_bytes=1, stages=2, micro_batches=4,
                               budget_bytes=[40, 40], planner_margins=False)
    plan = plan_partition(problem)
    assert plan.boundaries == (0, 2, 4)
    assert plan.stage_seconds == (7.0, 6.0) and plan.step_seconds == 34.0
    assert [p.recompute_s for p in plan.stage_plans] == [1.0, 0.0]
    assert sorted(every_cut(problem))[0][2] == (0, 2, 4)


def test_the_loss_takes_its_time_and_memory_on_the_last_stage():
    """Four equal layers (input 1, saved 10, forward 1, backward 2), pp=2, 4
    micro-batches. Without the loss the even cut wins: 6 and 6, step
    12 + 3 x 6 = 30. A loss of 3 s: one layer last gives 3 and 12 (step 51);
    two gives 6 and 9, three gives 9 and 6 (both 15 + 3 x 9 = 42, the earlier
    boundaries win). The loss saving 60 bytes is held at the start of the last
    stage's backward: with two layers stored it peaks at 2 x (1 + 1) + 20 + 60
    = 84 bytes, so under 83 it recomputes a layer, and below 64 (the engine's
    4 and the loss's 60) no plan fits."""
    layers = [layer(f"block{i}", 1, 10, 1.0) for i in range(4)]
    common = dict(layers=layers, backward_s=[2.0] * 4, output_bytes=1, stages=2, micro_batches=4,
                  planner_margins=False)
    assert plan_partition(PartitionProblem(**common, budget_bytes=[100, 100])).step_seconds == 30.0
    plan = plan_partition(PartitionProblem(**common, budget_bytes=[100, 100], loss_s=3.0))
    assert plan.boundaries == (0, 2, 4) and plan.stage_seconds == (6.0, 9.0) and plan.step_seconds == 42.0
    saving = PartitionProblem(**common, budget_bytes=[100, 84], loss_s=3.0, loss_saved_bytes=60)
    assert saving.stage_problem(1, 2, 4).backward_start_bytes == 60
    assert saving.stage_problem(0, 0, 2).backward_start_bytes == 0
    assert plan_cut(saving, (0, 2, 4)).stage_plans[1].predicted_peak_bytes == 84
    tighter = PartitionProblem(**common, budget_bytes=[100, 83], loss_s=3.0, loss_saved_bytes=60)
    assert plan_cut(tighter, (0, 2, 4)).stage_seconds == (6.0, 10.0)
    assert plan_partition(tighter) == plan_cut(tighter, plan_partition(tighter).boundaries)
    too_tight = PartitionProblem(**common, budget_bytes=[100, 63], loss_s=3.0, loss_saved_bytes=60)
    with pytest.raises(InfeasiblePartitionError, match=r"stage 1 \(layers 2-3\) fits no plan within"):
        plan_cut(too_tight, (0, 2, 4))


def test_the_stage_planners_margins_are_in_every_stages_base():
    """One activation gradient (the largest boundary tensor in the stage) and
    small allocations (1% of the budget, at least 4 KiB)."""
    layers = [layer("a", 1000, 10, 1.0), layer("b", 3000, 10, 1.0), layer("c", 2000, 10, 1.0)]
    common = dict(layers=layers, backward_s=[1.0] * 3, output_bytes=500, stages=2, micro_batches=4,
                  budget_bytes=[10**6, 10**7])
    exact = PartitionProblem(**common, planner_margins=False)
    margined = PartitionProblem(**common)
    assert margined.stage_problem(0, 0, 2).base_bytes - exact.stage_problem(0, 0, 2).base_bytes == 3000 + 10**4
    assert margined.stage_problem(1, 2, 3).base_bytes - exact.stage_problem(1, 2, 3).base_bytes == 2000 + 10**5
    small = PartitionProblem(**common | dict(budget_bytes=[10**5, 10**5]))
    assert small.stage_problem(1, 1, 3).base_bytes - exact.stage_problem(1, 1, 3).base_bytes == 3000 + 4096


def test_plan_cut_checks_its_boundaries():
    layers = [layer(f"l{i}", 1, 1, 1.0) for i in range(3)]
    problem = PartitionProblem(layers=layers, backward_s=[1.0] * 3, output_bytes=1, stages=2, micro_batches=2,
                               budget_bytes=[100, 100], planner_margins=False)
    for bad in [(0, 3), (0, 0, 3), (1, 2, 3), (0, 2, 2)]:
        with pytest.raises(ValueError, match="do not cut 3 layers into 2"):
            plan_cut(problem, bad)


def test_no_cut_that_fits_names_each_stages_least_budget():
    layers = [layer(f"block{i}", 1, 10, 1.0) for i in range(3)]
    problem = PartitionProblem(layers=layers, backward_s=[1.0] * 3, output_bytes=1, stages=2, micro_batches=4,
                               budget_bytes=[5, 5], planner_margins=False)
    with pytest.raises(InfeasiblePartitionError, match=r"stage 0: at least .* MiB, stage 1: at least"):
        plan_partition(problem)


@pytest.mark.parametrize("changes, match", [
    (dict(stages=4), "3 layers cannot fill 4 stages"),
    (dict(backward_s=[1.0]), "backward_s has 1 entries for 3 layers"),
    (dict(budget_bytes=[10]), "budget_bytes needs one entry per stage"),
    (dict(extra_bytes=[1, -1]), "extra_bytes must be non-negative"),
    (dict(micro_batches=0), "micro_batches must be a positive int"),
    (dict(backward_s=[1.0, float("nan"), 1.0]), "backward_s must be finite"),
])
def test_problem_validation_names_the_field(changes, match):
    arguments = dict(layers=[layer(f"l{i}", 1, 1, 1.0) for i in range(3)], backward_s=[1.0] * 3, output_bytes=1,
                     stages=2, micro_batches=2, budget_bytes=[10, 10]) | changes
    with pytest.raises(ValueError, match=match):
        PartitionProblem(**arguments)
