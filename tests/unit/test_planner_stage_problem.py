"""The stage's planning problem and budget verdicts, from plain numbers (no
torch, no module, no ranks): planning.stage_problem and planning.stage_budget."""

import dataclasses

import pytest

from ds_pipe_ckpt import ConfigError
from ds_pipe_ckpt.planning import LayerProfile, predicted_peak_bytes
from ds_pipe_ckpt.planning.stage_budget import MAX_CALIBRATIONS, StepCheck, budget_from_max_memory, no_plan_fits
from ds_pipe_ckpt.planning.stage_problem import (LengthFigures, StageFacts, Unmodelled, floor_text, length_problems,
                                                 measured_segments, measuring_step_model_bytes, stage_problem,
                                                 unmodelled_from_measuring_step)

KIB = 1024


def _facts(stage=0, num_stages=2, in_flight=2, input_bytes=64 * KIB, output_bytes=64 * KIB):
    return StageFacts(stage=stage, num_stages=num_stages, in_flight=in_flight, micro_batches=4,
                      stage_input_bytes=input_bytes, stage_output_bytes=output_bytes, backward_keeps_graph=False)


def _layers(scale=1):
    return [LayerProfile(name=f"layer {i}", input_bytes=64 * KIB * scale, saved_bytes=512 * KIB * scale,
                         forward_s=0.001) for i in range(3)]


def _problem(facts, scale=1, unmodelled=0, start=0, engine=None, grads=(0, 0, 0)):
    return stage_problem(facts, _layers(scale), list(grads), budget_bytes=8 << 20, unmodelled_bytes=unmodelled,
                         backward_start_bytes=start, engine_bytes_per_micro_batch=engine)


def test_the_base_counts_the_engines_buffers_for_the_micro_batches_in_flight_and_what_is_unmodelled():
    facts = _facts()
    problem = _problem(facts, unmodelled=1000)
    assert facts.engine_base_bytes() == 3 * (128 * KIB)  # (k + 1) x (input + output)
    assert problem.base_bytes == 3 * 128 * KIB + 1000
    last = _facts(stage=1)
    assert last.engine_base_bytes() == 3 * 64 * KIB  # the last stage's output is the loss phase's


def test_the_measuring_step_peak_beyond_the_model_is_counted_in_parts():
    facts = _facts()
    problem = _problem(facts)
    modelled = predicted_peak_bytes(problem, measured_segments(problem))
    unmodelled = unmodelled_from_measuring_step(facts, problem, modelled + 50 * KIB, loss_phase_peak_bytes=None)
    assert unmodelled.rebuild_extra_bytes == 50 * KIB
    assert unmodelled.margin_bytes == max(4096, int(0.01 * (modelled + 50 * KIB)))
    assert unmodelled.boundary_bytes == 64 * KIB  # the largest tensor crossing a layer boundary
    assert unmodelled.base_bytes == 50 * KIB + unmodelled.margin_bytes + 64 * KIB
    assert unmodelled.backward_start_bytes == 0
    below = unmodelled_from_measuring_step(facts, problem, modelled - 1, loss_phase_peak_bytes=None)
    assert below.rebuild_extra_bytes == 0  # never below the model


def test_a_loss_phase_above_the_held_activations_is_the_backward_start():
    facts = _facts(stage=1)
    problem = _problem(facts)
    modelled = predicted_peak_bytes(problem, measured_segments(problem))
    held = 2 * 64 * KIB  # every layer checkpointed: each holds its input, two micro-batches in flight
    loss_phase = facts.engine_base_bytes() + 3 * held + 300 * KIB
    unmodelled = unmodelled_from_measuring_step(facts, problem, modelled, loss_phase_peak_bytes=loss_phase)
    assert unmodelled.start_extra_bytes == 300 * KIB
    assert unmodelled.backward_start_bytes == 300 * KIB - 64 * KIB  # less the boundary the base counts


def _figures(facts, length, measured_length, workspace):
    scale = length // measured_length if length >= measured_length else 1
    engine = facts.engine_bytes_per_micro_batch * length // measured_length
    return LengthFigures(_problem(facts, scale=scale, engine=engine), engine, workspace, None,
                         facts.stage_output_bytes * length // measured_length)


GRADS = (100 * KIB, 200 * KIB, 300 * KIB)


def _length(facts, length, grads=GRADS):
    """The figures of micro-batches ``length`` long (activations and engine copies in proportion to 16)."""
    engine = facts.engine_bytes_per_micro_batch * length // 16
    layers = [LayerProfile(name=f"layer {i}", input_bytes=4 * KIB * length, saved_bytes=32 * KIB * length,
                           forward_s=0.001) for i in range(3)]
    problem = stage_problem(facts, layers, list(grads), budget_bytes=8 << 20, unmodelled_bytes=0,
                            backward_start_bytes=0, engine_bytes_per_micro_batch=engine)
    return LengthFigures(problem, engine, None, None, facts.stage_output_bytes * length // 16)


@pytest.mark.parametrize("in_flight", [1, 2, 3])
def test_a_measuring_step_of_one_length_is_modelled_as_its_plan_predicts(in_flight):
    facts = _facts(in_flight=in_flight)
    figures = _length(facts, 32)
    problem = figures.problem
    assert (measuring_step_model_bytes(facts, [figures] * 4, GRADS)
            == predicted_peak_bytes(problem, measured_segments(problem)))


def test_a_measuring_step_of_mixed_lengths_models_each_micro_batch_at_its_own_length():
    """Measured on a short micro-batch while longer ones were in flight: their
    activations are the model's, not memory it does not see."""
    facts = _facts(in_flight=2)
    short, long = _length(facts, 8), _length(facts, 64)
    step = [short, long, long, long]
    modelled = measuring_step_model_bytes(facts, step, GRADS)
    as_if_all_short = predicted_peak_bytes(short.problem, measured_segments(short.problem))
    assert modelled == predicted_peak_bytes(long.problem, measured_segments(long.problem))  # windows 1 and 2
    assert modelled > as_if_all_short
    unmodelled = unmodelled_from_measuring_step(facts, short.problem, modelled + 10 * KIB, None, modelled)
    assert unmodelled.rebuild_extra_bytes == 10 * KIB


def test_the_first_backward_of_a_measuring_step_meets_the_gradients_as_they_come():
    """The longest micro-batch first and short ones after: the step's peak is
    in the first backward, which allocates the parameters' gradients layer by
    layer, so what it shows beyond the model is not hidden by gradients
    counted in full."""
    facts = _facts(in_flight=2)
    long, short = _length(facts, 64), _length(facts, 8)
    modelled = measuring_step_model_bytes(facts, [long, short, short, short], GRADS)
    with_every_gradient = predicted_peak_bytes(long.problem, measured_segments(long.problem))
    assert modelled < with_every_gradient
    accruing = _length(facts, 64, grads=(0, 0, 0))
    layers = [dataclasses.replace(layer, grad_bytes=g) for layer, g in zip(accruing.problem.layers, GRADS)]
    first = dataclasses.replace(accruing.problem, layers=tuple(layers))
    # The first window: the short micro-batch held, the long one's own peak as the plan
    # predicts a micro-batch alone that allocates its gradients as it goes.
    single = predicted_peak_bytes(dataclasses.replace(first, in_flight=1), measured_segments(first)) - first.base_bytes
    held_short = short.engine_bytes + sum(layer.input_bytes for layer in short.problem.layers)
    e = long.engine_bytes
    assert modelled == (first.base_bytes - 3 * e) + held_short + single + 2 * e
    with pytest.raises(ValueError, match="at least one micro-batch"):
        measuring_step_model_bytes(facts, [], GRADS)


def test_what_was_unmodelled_grows_to_each_length_and_the_buffers_to_the_longest():
    facts = _facts()
    unmodelled = Unmodelled(rebuild_extra_bytes=40 * KIB, margin_bytes=8 * KIB, boundary_bytes=64 * KIB)
    figures = {16: _figures(facts, 16, 16, 10 * KIB), 32: _figures(facts, 32, 16, 30 * KIB),
               64: _figures(facts, 64, 16, 90 * KIB)}
    problems = length_problems(facts, unmodelled, figures, edges=(32, 64), measured_length=16)
    dynamic = (max(2, facts.in_flight) + 2) * (figures[64].engine_bytes - figures[16].engine_bytes)
    # at 64 (x4): the boundary grew 64 -> 256 KiB, the margin x4, the workspace by the passes' difference
    grown = (256 - 64) * KIB + 3 * 8 * KIB + (90 - 10) * KIB
    assert problems[64].base_bytes == figures[64].problem.base_bytes + grown + dynamic
    grown_32 = (128 - 64) * KIB + 8 * KIB + (30 - 10) * KIB
    assert problems[32].base_bytes == figures[32].problem.base_bytes + grown_32 + dynamic
    assert set(problems) == {32, 64}


def test_unmeasured_workspace_grows_with_the_square_of_the_length():
    facts = _facts()
    unmodelled = Unmodelled(rebuild_extra_bytes=40 * KIB, margin_bytes=0, boundary_bytes=64 * KIB)
    figures = {16: _figures(facts, 16, 16, None), 32: _figures(facts, 32, 16, None)}
    problems = length_problems(facts, unmodelled, figures, edges=(32, ), measured_length=16)
    dynamic = 4 * (figures[32].engine_bytes - figures[16].engine_bytes)
    assert problems[32].base_bytes == figures[32].problem.base_bytes + 64 * KIB + 3 * 40 * KIB + dynamic


def test_the_floor_names_its_parts():
    facts = _facts()
    problem = _problem(facts, unmodelled=2 << 20)
    text = floor_text(facts, problem, problem.base_bytes + (1 << 20), engine_bytes=facts.engine_base_bytes(),
                      unmodelled_bytes=2 << 20)
    assert text.startswith("Of that, 1.00 MiB is what the plan controls")
    assert "0.38 MiB the engine's stage inputs and outputs (2 micro-batch(es) in flight" in text
    assert "2.00 MiB that the measured steps showed beyond the layers' activations" in text


def test_a_step_check_plans_again_while_calibrations_are_left():
    held = StepCheck(stage=1, predicted_bytes=100, measured_bytes=90, budget_bytes=120, calibrations=0)
    assert not held.missed and not held.calibrates
    under = StepCheck(stage=1, predicted_bytes=100, measured_bytes=110, budget_bytes=120, calibrations=0)
    assert under.missed and under.calibrates and under.unseen_bytes == 10
    assert "pipeline stage 1's checkpointing plan predicted" in under.warning()
    assert "Planning again at the next step's start" in under.warning()
    spent = StepCheck(stage=1, predicted_bytes=100, measured_bytes=110, budget_bytes=120,
                      calibrations=MAX_CALIBRATIONS)
    assert spent.missed and not spent.calibrates and "The plan stands." in spent.warning()
    over = StepCheck(stage=0, predicted_bytes=130, measured_bytes=125, budget_bytes=120, calibrations=0)
    assert over.missed  # within the prediction, above the budget


def test_max_memory_leaves_what_a_step_does_not_begin_with():
    key = "activation_checkpointing.max_memory_mb"
    assert budget_from_max_memory(key, 10 << 20, 4 << 20, stage=0) == 6 << 20
    with pytest.raises(ConfigError, match=r"more than the 4\.00 MiB allocated when a step begins on pipeline stage 0"):
        budget_from_max_memory(key, 4 << 20, 4 << 20, stage=0)
    with pytest.raises(ConfigError, match="ran under another profiler"):
        budget_from_max_memory(key, 4 << 20, None, stage=0)


def test_no_plan_fits_names_the_smallest_budget_in_the_keys_terms():
    error = no_plan_fits("activation_checkpointing.max_memory_mb", stage=1, in_flight=1, budget_bytes=6 << 20,
                         minimum_bytes=7 << 20, step_start_bytes=4 << 20, floor="FLOOR.", max_sequence_length=128)
    assert error.key == "activation_checkpointing.max_memory_mb" and error.value == 10.0
    message = str(error)
    assert "at least 11.00 MiB for pipeline stage 1" in message
    assert "(with the 4.00 MiB allocated when a step begins" in message
    assert "FLOOR." in message and "max_sequence_length (128" in message
