"""A pipeline stage's planning problem, built from what its measured steps and
passes showed.

The stage planner (:mod:`.stage`) measures; this module turns the figures into
the solver's :class:`~.problem.StageProblem`:

* what does not depend on the plan (the engine's stage inputs and outputs for
  the micro-batches in flight, the parameters' gradients that outlive steps);
* what the measuring step showed beyond the model (:class:`Unmodelled`, in
  parts), counted in every plan's base so that the prediction is an upper bound;
* with variable lengths, the problem at each bucket edge, with those parts
  grown to that length (:func:`length_problems`);
* the words of a budget's floor: what the least feasible peak is made of.

Pure: plain numbers and :class:`~.problem.LayerProfile` s in, plain data out;
no torch, no module, no ranks. It must not measure or decide when to plan.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Mapping, Sequence

from .cost_model import (SMALL_ALLOCATIONS_MIN_BYTES, SMALL_ALLOCATIONS_SHARE, ChainCosts, gradients_as_base,
                         peak_of_costs, predicted_peak_bytes)
from .plan import Decision, Segment
from .problem import LayerProfile, StageProblem

__all__ = ["KnownBuffer", "StageFacts", "Unmodelled", "LengthFigures", "stage_problem",
           "measured_segments", "largest_boundary_bytes", "measuring_step_model_bytes",
           "unmodelled_from_measuring_step", "unmodelled_growth",
           "length_problems", "gradient_base_bytes", "floor_text"]

MIB = 2**20


@dataclass(frozen=True)
class KnownBuffer:
    """Memory outside the activations that the engine is known to allocate in
    every step (e.g. ZeRO's reduce bucket): named in the plan's floor."""

    description: str
    bytes: int
    fix: str = ""


@dataclass(frozen=True)
class StageFacts:
    """What the problem needs of the stage besides its layers: where it sits in
    the pipeline and its measured micro-batch's stage input and output."""

    stage: int
    num_stages: int
    in_flight: int  # micro-batches in flight under 1F1B
    micro_batches: int
    stage_input_bytes: int
    stage_output_bytes: int
    backward_keeps_graph: bool

    @property
    def last_stage(self) -> bool:
        return self.stage == self.num_stages - 1

    @property
    def label(self) -> str:
        return f"pipeline stage {self.stage}"

    @property
    def engine_bytes_per_micro_batch(self) -> int:
        """The engine's copies of one micro-batch's stage input and output (the
        last stage's output, its logits, lives only until the loss's backward:
        the loss phase shows it)."""
        return self.stage_input_bytes + (0 if self.last_stage else self.stage_output_bytes)

    def engine_base_bytes(self, per_micro_batch: int | None = None) -> int:
        """The engine's buffers for the micro-batches in flight, plus one incoming
        and one outgoing gradient."""
        per_micro_batch = self.engine_bytes_per_micro_batch if per_micro_batch is None else per_micro_batch
        return (self.in_flight + 1) * per_micro_batch


@dataclass(frozen=True)
class Unmodelled:
    """What the measuring step showed beyond the model, at the measured length, in parts.

    The measuring step is a whole step of a known plan (every layer its own
    checkpoint region): what it measured beyond that plan's prediction (the
    backward's workspace, the engine's and the optimizer's buffers, ZeRO's
    reduce bucket) is there whatever the plan. Two things it cannot carry over
    are counted on top: small allocations (a share of the peak), and one
    activation gradient in flight, which the backward holds at a segment
    boundary while it computes the next: the measuring step's peak (inside a
    layer's recomputation) shows it there, but a plan that moves its peak
    elsewhere meets one more of it. On the last stage the loss phase (its
    logits, the loss and their gradients) is compared with the model's
    ``k * H`` on its own, so that it is not charged to the rebuilds, which
    never meet it.
    """

    rebuild_extra_bytes: int = 0
    margin_bytes: int = 0
    boundary_bytes: int = 0
    start_extra_bytes: int = 0

    @property
    def base_bytes(self) -> int:
        """What every plan's base counts of it."""
        return self.rebuild_extra_bytes + self.margin_bytes + self.boundary_bytes

    @property
    def backward_start_bytes(self) -> int:
        """What the loss phase showed beyond the base's part of it."""
        return max(0, self.start_extra_bytes - self.rebuild_extra_bytes - self.boundary_bytes)


@dataclass(frozen=True)
class LengthFigures:
    """The stage measured at one micro-batch length: its problem (from its
    layers measured at that length) and what its measured pass showed."""

    problem: StageProblem
    engine_bytes: int  # the engine's copies of one micro-batch's stage input and output
    workspace_bytes: int | None  # the pass's peak beyond the model (None: not measured)
    loss_phase_bytes: int | None  # the last stage's loss phase in the pass (None: not measured)
    output_bytes: int  # the stage's output (on the last stage: the logits)


def stage_problem(facts: StageFacts, layers: Sequence[LayerProfile], grad_bytes: Sequence[int], *,
                  budget_bytes: int | None, unmodelled_bytes: int, backward_start_bytes: int,
                  engine_bytes_per_micro_batch: int | None = None, backward_only_bytes: int = 0) -> StageProblem:
    """The solver's problem: ``layers`` with their parameters' ``grad_bytes``
    (those allocated anew each step), the gradients the stage holds for the
    whole step moved into the base, and the engine's buffers and
    ``unmodelled_bytes`` counted there; ``backward_only_bytes`` of the latter
    only a backward meets (:attr:`Unmodelled.boundary_bytes`)."""
    layers = tuple(dataclasses.replace(layer, grad_bytes=grads) for layer, grads in zip(layers, grad_bytes))
    layers, gradients = gradients_as_base(layers, facts.in_flight, facts.micro_batches)
    return StageProblem(layers=layers, in_flight=facts.in_flight, budget_bytes=budget_bytes,
                        base_bytes=facts.engine_base_bytes(engine_bytes_per_micro_batch) + gradients
                        + unmodelled_bytes, label=facts.label, backward_keeps_graph=facts.backward_keeps_graph,
                        backward_start_bytes=backward_start_bytes, backward_only_bytes=backward_only_bytes)


def measured_segments(problem: StageProblem) -> list[Segment]:
    """What the measuring step ran: every checkpointable layer its own
    checkpoint region, the others stored."""
    return [Segment(i, i + 1, Decision.CHECKPOINT if layer.checkpointable else Decision.STORE)
            for i, layer in enumerate(problem.layers)]


def largest_boundary_bytes(stage_input_bytes: int, problem: StageProblem) -> int:
    """The largest tensor that crosses a layer boundary inside the stage (its
    input, a layer's input): the size of an activation gradient in flight
    between segments. (The gradient of the stage's output comes with the loss
    or from the next stage, at the backward's start, which the measuring
    step's loss phase shows.)"""
    return max([stage_input_bytes] + [layer.input_bytes for layer in problem.layers])


def measuring_step_model_bytes(facts: StageFacts, step: Sequence[LengthFigures], grad_bytes: Sequence[int]) -> int:
    """The model's peak of a measuring step whose micro-batches, in the order
    the stage ran them, were measured as ``step`` (each its length's figures,
    built with nothing unmodelled), every layer its own checkpoint region;
    ``grad_bytes`` are the layers' parameter gradients that each step
    allocates anew (as :func:`stage_problem` takes them).

    Under DeepSpeed's 1F1B the backward of micro-batch ``j`` runs while
    ``j .. j + k - 1`` are in flight (``k`` = ``facts.in_flight``); it peaks
    at what the others hold (their activations and the engine's copies of
    their stage input and output, ``H_i + e_i``) plus its own single peak
    ``P1_j + 2 e_j`` (:mod:`.length_plans`' notation) above the part of the
    base that is not per micro-batch. The first backward of the step meets
    the parameter gradients as it allocates them, layer by layer; the later
    ones meet them all. With every micro-batch of one length this is
    :func:`~.cost_model.predicted_peak_bytes` of the measured plan. With
    several lengths in the step, modelling them all at the first
    micro-batch's length would charge the others' activations as memory the
    model does not see, or hide that memory where they are shorter.

    Raises:
        ValueError: ``step`` is empty.
    """
    if not step:
        raise ValueError("a measuring step has at least one micro-batch")
    k = facts.in_flight
    gradients = sum(grad_bytes) if facts.micro_batches > k else 0  # what stage_problem moved into the base

    def held_single_fixed(problem: StageProblem, engine_bytes: int) -> tuple[int, int, int]:
        chain = ChainCosts(problem)
        costs = [chain.cost(s.start, s.end, s.decision) for s in measured_segments(problem)]
        held = sum(cost.held_bytes for cost in costs) + engine_bytes
        single = peak_of_costs(costs, 1, 0, problem.backward_keeps_graph) + 2 * engine_bytes
        return held, single, problem.base_bytes - (k + 1) * engine_bytes

    figures = [held_single_fixed(f.problem, f.engine_bytes) for f in step]
    held = [h for h, _, _ in figures]
    fixed = max(f for _, _, f in figures)
    peaks = [fixed + sum(held[j + 1:j + k]) + single for j, (_, single, _) in enumerate(figures) if j > 0]
    first = step[0].problem
    if gradients:
        layers = tuple(dataclasses.replace(layer, grad_bytes=g) for layer, g in zip(first.layers, grad_bytes))
        first = dataclasses.replace(first, layers=layers, base_bytes=first.base_bytes - gradients)
    _, single, first_fixed = held_single_fixed(first, step[0].engine_bytes)
    peaks.append(first_fixed + sum(held[1:k]) + single)
    return max(peaks)


def unmodelled_from_measuring_step(facts: StageFacts, problem: StageProblem, measuring_step_peak_bytes: int,
                                   loss_phase_peak_bytes: int | None, modelled_bytes: int | None = None
                                   ) -> Unmodelled:
    """What the measuring step (peak ``measuring_step_peak_bytes``; on the last
    stage its loss phase's peak) showed beyond ``problem`` (the measured
    micro-batch's, built with nothing unmodelled) under the plan it ran, whose
    model peaks at ``modelled_bytes`` (default: every micro-batch as the
    measured one; with lengths varying inside the step,
    :func:`measuring_step_model_bytes`)."""
    segments = measured_segments(problem)
    modelled = predicted_peak_bytes(problem, segments) if modelled_bytes is None else modelled_bytes
    margin = max(SMALL_ALLOCATIONS_MIN_BYTES, int(SMALL_ALLOCATIONS_SHARE * measuring_step_peak_bytes))
    rebuild_extra = max(0, measuring_step_peak_bytes - modelled)
    start_extra = 0
    if loss_phase_peak_bytes is not None:
        held = sum(ChainCosts(problem).cost(s.start, s.end, s.decision).held_bytes for s in segments)
        # The measuring step's first micro-batch meets no parameter gradient yet
        # (they come with its backward): compared with the engine's part of base.
        start_extra = max(0, loss_phase_peak_bytes - (facts.engine_base_bytes() + facts.in_flight * held))
    return Unmodelled(rebuild_extra_bytes=rebuild_extra, margin_bytes=margin,
                      boundary_bytes=largest_boundary_bytes(facts.stage_input_bytes, problem),
                      start_extra_bytes=start_extra)


def unmodelled_growth(facts: StageFacts, unmodelled: Unmodelled, measured: LengthFigures, at_length: LengthFigures,
                      ratio: float) -> tuple[int, int, int]:
    """How much ``unmodelled`` (seen at the measured length, whose pass is
    ``measured``) grows by at a length ``ratio`` times it (pass ``at_length``),
    in parts: the activation gradient in flight (the largest layer boundary at
    that length), the small allocations' margin (with the length), and the
    backward's workspace as the two passes differ (where someone else profiled
    them: as the square of the length, no faster than eager attention's
    scores). Never below 0."""
    boundary = largest_boundary_bytes(facts.stage_input_bytes, at_length.problem) - unmodelled.boundary_bytes
    margin = unmodelled.margin_bytes * (ratio - 1)
    if at_length.workspace_bytes is not None and measured.workspace_bytes is not None:
        workspace = at_length.workspace_bytes - measured.workspace_bytes
    else:
        workspace = unmodelled.rebuild_extra_bytes * (ratio**2 - 1)
    return max(0, boundary), max(0, math.ceil(margin)), max(0, math.ceil(workspace))


def _loss_phase_growth(unmodelled: Unmodelled, measured: LengthFigures, at_length: LengthFigures,
                       ratio: float) -> int:
    """How much more the loss phase holds at a length than at the measured one
    (where a pass did not measure it: grown with the length, a loss over the tokens)."""
    if measured.loss_phase_bytes is not None and at_length.loss_phase_bytes is not None:
        return max(0, at_length.loss_phase_bytes - measured.loss_phase_bytes)
    return max(0, math.ceil(unmodelled.start_extra_bytes * (ratio - 1)))


def _dynamic_buffer_bytes(facts: StageFacts, measured: LengthFigures, longest: LengthFigures) -> int:
    """With dynamic shapes DeepSpeed's engine allocates its buffers anew as
    shapes change: its pipeline buffer slots (``max(2, k)`` stage inputs,
    kept until the slot is reused, and on the last stage its outputs, the
    logits, which its backward does not free), the receive buffer and the
    gradient buffer, each up to the longest micro-batch, and briefly two of
    one while it replaces it. What the measuring step showed of them, at
    the length of its longest micro-batch (``measured``; its peak is where
    that one is in flight), is in the base; this is the rest, up to the
    longest length."""
    slots = max(2, facts.in_flight) + 2
    grown = longest.engine_bytes - measured.engine_bytes
    if facts.last_stage:
        grown += longest.output_bytes - measured.output_bytes
    return slots * max(0, grown)


def length_problems(facts: StageFacts, unmodelled: Unmodelled, figures: Mapping[int, LengthFigures],
                    edges: Sequence[int], measured_length: int,
                    step_longest_length: int | None = None) -> dict[int, StageProblem]:
    """The stage's problem at every bucket edge in ``edges`` (``figures`` has
    them, ``measured_length`` and ``step_longest_length``, the measuring
    step's longest micro-batch, by default the measured one; each problem
    built with the measuring step's unmodelled bytes in its base). What the
    measuring step showed beyond the model was seen at the measured length:
    grown to each edge (:func:`unmodelled_growth`), and the loss phase as the
    measured passes' loss phases grew, less what the base counts of it; the
    engine's buffers from the step's longest micro-batch on."""
    measured, longest = figures[measured_length], figures[max(edges)]
    buffers_seen = figures[measured_length if step_longest_length is None else step_longest_length]
    dynamic = _dynamic_buffer_bytes(facts, buffers_seen, longest)
    problems = {}
    for length in edges:
        at_length = figures[length]
        ratio = length / measured_length
        boundary, margin, workspace = unmodelled_growth(facts, unmodelled, measured, at_length, ratio)
        start = max(0, unmodelled.start_extra_bytes + _loss_phase_growth(unmodelled, measured, at_length, ratio)
                    - (unmodelled.rebuild_extra_bytes + workspace) - (unmodelled.boundary_bytes + boundary))
        problems[length] = dataclasses.replace(at_length.problem, base_bytes=at_length.problem.base_bytes + boundary
                                               + margin + workspace + dynamic, backward_start_bytes=start,
                                               backward_only_bytes=at_length.problem.backward_only_bytes + boundary)
    return problems


def gradient_base_bytes(problem: StageProblem, engine_bytes: int, unmodelled_bytes: int) -> int:
    """The parameter gradients in ``problem``'s base: what is left of it beside
    ``engine_bytes`` (the engine's buffers) and ``unmodelled_bytes``."""
    return max(0, problem.base_bytes - engine_bytes - unmodelled_bytes)


def floor_text(facts: StageFacts, problem: StageProblem, minimum_bytes: int, *, engine_bytes: int,
               unmodelled_bytes: int, known_buffers: Sequence[KnownBuffer] = ()) -> str:
    """What the least feasible peak ``minimum_bytes`` of ``problem`` is made of:
    the part the plan controls (the activations it keeps) and the part it does
    not (``engine_bytes`` and ``unmodelled_bytes`` of its base, the rest
    parameter gradients), with the known big non-activation buffers named."""
    gradients = gradient_base_bytes(problem, engine_bytes, unmodelled_bytes)
    held = "inputs" if facts.last_stage else "inputs and outputs"
    parts = [f"{engine_bytes / MIB:.2f} MiB the engine's stage {held} ({facts.in_flight} micro-batch(es) in flight, "
             "and their gradients)"]
    if gradients:
        parts.append(f"{gradients / MIB:.2f} MiB parameter gradients")
    if unmodelled_bytes:
        known = "".join(f"; of it, {buffer.description}: {buffer.bytes / MIB:.2f} MiB"
                        + (f" ({buffer.fix})" if buffer.fix else "")
                        for buffer in known_buffers if buffer.bytes)
        parts.append(f"{unmodelled_bytes / MIB:.2f} MiB that the measured steps showed beyond the "
                     f"layers' activations (the backward's workspace, the engine's and the optimizer's buffers"
                     f"{known})")
    start = (f" The end of the forwards also holds {problem.backward_start_bytes / MIB:.2f} MiB beyond the "
             "activations (the loss, the gradient of the stage's output), counted with them."
             if problem.backward_start_bytes else "")
    return (f"Of that, {(minimum_bytes - problem.base_bytes) / MIB:.2f} MiB is what the plan controls (the "
            f"activations it keeps) and {problem.base_bytes / MIB:.2f} MiB is not: {', '.join(parts)}.{start}")
