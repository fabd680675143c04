"""Where a plan's predicted peak falls and what it is made of: the terms of
:mod:`.cost_model`'s formula at the moment that decides the peak, so that a
reader of the plan (or of a step that did not fit it) sees which term to
question.

Pure: a problem and a plan in, plain numbers out; no torch. It must not
price plans differently from :mod:`.cost_model` (the parts add up to
:func:`~.cost_model.predicted_peak_bytes`, which a test checks) nor search.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Sequence

from .cost_model import ChainCosts
from .plan import Segment, validate_segments
from .problem import StageProblem

__all__ = ["PeakMoment", "PeakBreakdown", "peak_breakdown"]

MIB = 2**20


class PeakMoment(enum.Enum):
    """The moment of a step at which a plan's predicted peak falls."""

    FORWARDS_END = "the end of the forwards"  # k micro-batches held, nothing rebuilt
    LOSS_PHASE = "the start of the backward"  # the last segment's floor: held gradients, the loss phase
    BACKWARD = "the backward of"  # a segment's activations rebuilt, or its later layers' gradients
    FORWARD = "the forward of"  # a segment's forward holds more than it keeps


@dataclass(frozen=True)
class PeakBreakdown:
    """The predicted peak as ``base_bytes + held_bytes + transient_bytes``, at ``moment``
    (of ``segment``, for a backward or a forward)."""

    moment: PeakMoment
    segment: Segment | None
    base_bytes: int  # what does not depend on the plan (StageProblem.base_bytes)
    held_bytes: int  # the activations the micro-batches in flight hold then
    transient_bytes: int  # what the moment adds on top (rebuilt, its forward's, the loss phase's)

    @property
    def peak_bytes(self) -> int:
        return self.base_bytes + self.held_bytes + self.transient_bytes

    def describe(self, segment_names: str = "") -> str:
        """One sentence: where, and the three terms in MiB."""
        where = self.moment.value + (f" {segment_names or self.segment}" if self.segment is not None else "")
        return (f"at {where}: {self.base_bytes / MIB:.2f} MiB that no plan changes + {self.held_bytes / MIB:.2f} "
                f"MiB of activations held + {self.transient_bytes / MIB:.2f} MiB that moment adds")


def peak_breakdown(problem: StageProblem, segments: Sequence[Segment]) -> PeakBreakdown:
    """The terms of the predicted peak of ``segments`` on ``problem`` (ties go to
    the earliest moment). Raises ValueError for segments that are not a plan."""
    validate_segments(problem, segments)
    chain = ChainCosts(problem)
    k, base = problem.in_flight, problem.base_bytes
    costs = [chain.cost(s.start, s.end, s.decision) for s in segments]
    total = sum(cost.held_bytes for cost in costs)
    best = PeakBreakdown(PeakMoment.FORWARDS_END, None, base, k * total, 0)
    held_so_far = 0
    for segment, cost in zip(segments, costs):
        held_so_far += cost.held_bytes
        held = k * total if problem.backward_keeps_graph else (k - 1) * total + held_so_far
        if held + cost.transient_bytes <= best.held_bytes + best.transient_bytes:
            continue
        parts = chain.transient_parts(segment.start, segment.end, segment.decision)
        moment = (PeakMoment.BACKWARD if parts.backward == cost.transient_bytes
                  else PeakMoment.LOSS_PHASE if parts.forwards_end == cost.transient_bytes else PeakMoment.FORWARD)
        best = PeakBreakdown(moment, None if moment is PeakMoment.LOSS_PHASE else segment, base, held,
                             cost.transient_bytes)
    return best
