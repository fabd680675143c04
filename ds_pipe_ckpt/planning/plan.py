"""What a stage's checkpointing plan is: consecutive :class:`Segment` s
``[start, end)`` of its layers, each with a :class:`Decision`, and the
:class:`StagePlan` that the solver returns.

SELECTIVE needs the selective figures of every layer of the segment;
CHECKPOINT and SELECTIVE need every layer of the segment to be
``checkpointable`` (a layer that is not, e.g. one excluded by the pipeline's
``checkpointable_layers``, is always stored). Adjacent STORE segments are
equivalent to one STORE segment; CHECKPOINT and SELECTIVE segments are
separate checkpoint regions even when adjacent.

This module holds plans and checks that they are plans of a problem's chain
(:func:`validate_segments`). It must not price them (that is
:mod:`.cost_model`) or search for them (:mod:`.solver`); it imports no torch.
"""

from __future__ import annotations

import enum
from bisect import bisect_right
from dataclasses import dataclass
from typing import Iterable, Sequence

from .problem import StageProblem, require_int

__all__ = ["Decision", "Segment", "StagePlan", "merged_segments", "validate_segments"]


class Decision(enum.Enum):
    """How a segment's activations are kept for backward."""

    STORE = "store"
    CHECKPOINT = "checkpoint"
    SELECTIVE = "selective"


@dataclass(frozen=True)
class Segment:
    """Layers ``[start, end)`` of a stage, all handled by ``decision``.

    Raises TypeError or ValueError naming the field unless
    ``0 <= start < end`` and ``decision`` is a :class:`Decision`.
    """

    start: int
    end: int
    decision: Decision

    def __post_init__(self) -> None:
        require_int("Segment", "start", self.start, 0)
        require_int("Segment", "end", self.end, self.start + 1)
        if not isinstance(self.decision, Decision):
            raise TypeError(f"Segment: decision must be a Decision, got {self.decision!r}")


def merged_segments(steps: Iterable[tuple[int, int, Decision]]) -> tuple[Segment, ...]:
    """The plan made of ``(start, end, decision)`` steps in chain order, with
    adjacent STORE steps merged into one segment (they are one and the same)."""
    segments: list[Segment] = []
    for start, end, decision in steps:
        if decision is Decision.STORE and segments and segments[-1].decision is Decision.STORE:
            start = segments.pop().start
        segments.append(Segment(start, end, decision))
    return tuple(segments)


def validate_segments(problem: StageProblem, segments: Sequence[Segment]) -> None:
    """Raises ValueError naming the offending segment unless ``segments`` tile
    ``[0, n)`` in order, every CHECKPOINT and SELECTIVE segment's layers are
    checkpointable and every SELECTIVE segment's layers have selective figures."""
    owner = f"stage {problem.label!r}"
    position = 0
    for index, segment in enumerate(segments):
        if not isinstance(segment, Segment):
            raise TypeError(f"{owner}: segments[{index}] must be a Segment, got {type(segment).__name__}")
        if segment.start != position:
            raise ValueError(f"{owner}: segments must tile [0, {problem.num_layers}) in order, but segments[{index}] "
                             f"= [{segment.start}, {segment.end}) starts at {segment.start}, expected {position}")
        if segment.end > problem.num_layers:
            raise ValueError(f"{owner}: segments[{index}] = [{segment.start}, {segment.end}) ends past the "
                             f"{problem.num_layers} layers of the stage")
        if segment.decision is not Decision.STORE:
            for layer in problem.layers[segment.start:segment.end]:
                if not layer.checkpointable:
                    raise ValueError(f"{owner}: segments[{index}] = [{segment.start}, {segment.end}) is "
                                     f"{segment.decision.name} but layer {layer.name!r} is not checkpointable")
        if segment.decision is Decision.SELECTIVE:
            for layer in problem.layers[segment.start:segment.end]:
                if not layer.has_selective:
                    raise ValueError(f"{owner}: segments[{index}] = [{segment.start}, {segment.end}) is SELECTIVE "
                                     f"but layer {layer.name!r} has no selective figures")
        position = segment.end
    if position != problem.num_layers:
        raise ValueError(f"{owner}: segments must tile [0, {problem.num_layers}), but they end at {position}")


@dataclass(frozen=True)
class StagePlan:
    """The chosen plan of one stage.

    ``segments`` tile the stage's layers in order, adjacent STORE segments
    merged; ``predicted_peak_bytes`` includes the problem's base bytes;
    ``recompute_s`` is the recomputation time of one micro-batch's backward;
    ``held_bytes_per_micro_batch`` is H, what one micro-batch's forward holds
    until its backward.
    """

    segments: tuple[Segment, ...]
    predicted_peak_bytes: int
    recompute_s: float
    held_bytes_per_micro_batch: int

    def decision_of(self, layer_index: int) -> Decision:
        """The decision of the segment containing layer ``layer_index``.

        Raises IndexError for an index outside the stage's layers."""
        if not 0 <= layer_index < self.segments[-1].end:
            raise IndexError(f"layer_index {layer_index} is outside the stage's layers [0, {self.segments[-1].end})")
        starts = [segment.start for segment in self.segments]
        return self.segments[bisect_right(starts, layer_index) - 1].decision

    @property
    def checkpoint_boundaries(self) -> tuple[tuple[int, int], ...]:
        """The ``(start, end)`` layer ranges of the checkpoint regions
        (CHECKPOINT and SELECTIVE segments), in order; each is one
        checkpointed call over layers ``[start, end)``."""
        return tuple((segment.start, segment.end) for segment in self.segments
                     if segment.decision is not Decision.STORE)
