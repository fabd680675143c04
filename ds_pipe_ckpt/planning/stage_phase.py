"""The phases of one pipeline stage's checkpointing plan, and the one function
that moves between them.

A stage measures (every layer checkpointed), then plans; the first planned step
checks the plan's predicted peak against the measured one. A check that misses
(and may still calibrate) makes the next step's start plan again, and that plan
is checked in turn; a check that holds leaves the plan standing, or, with
variable lengths while a length bucket has not been a checked step's longest,
keeps checking the next steps. A measuring
step that could not measure every layer leaves the stage unplannable.

Pure: no torch, no DeepSpeed, no I/O. It must not decide when events happen;
``planning.stage.StagePlanner`` does, and moves its phase only through
``next_phase``.
"""

from __future__ import annotations

import enum


class StagePhase(enum.Enum):
    MEASURING = "measuring"  # no plan yet: every layer checkpointed, measured in the measuring step
    UNPLANNABLE = "unplannable"  # the measuring step missed a layer: no plan, ever
    CHECKING = "checking"  # planned; the next tracked step checks the prediction
    REPLAN_DUE = "replan due"  # the check missed: plan again at the next step's start
    PLANNED = "planned"  # the check held (or calibrations ran out): the plan stands


class StageEvent(enum.Enum):
    PLANNED = "planned"  # a plan was made from the measurement
    MEASUREMENT_INCOMPLETE = "measurement incomplete"
    REPLANNING = "replanning"  # the step start plans again from the missed check
    CHECK_HELD = "check held"  # or missed with no calibration left: the plan stands
    LENGTH_CHECK_HELD = "length check held"  # held, and a length bucket is still unseen: check the next step too
    CHECK_MISSED = "check missed"  # and calibrates


_TRANSITIONS: dict[tuple[StagePhase, StageEvent], StagePhase] = {
    (StagePhase.MEASURING, StageEvent.PLANNED): StagePhase.CHECKING,
    (StagePhase.MEASURING, StageEvent.MEASUREMENT_INCOMPLETE): StagePhase.UNPLANNABLE,
    (StagePhase.CHECKING, StageEvent.CHECK_HELD): StagePhase.PLANNED,
    (StagePhase.CHECKING, StageEvent.LENGTH_CHECK_HELD): StagePhase.CHECKING,
    (StagePhase.CHECKING, StageEvent.CHECK_MISSED): StagePhase.REPLAN_DUE,
    (StagePhase.REPLAN_DUE, StageEvent.REPLANNING): StagePhase.CHECKING,
}


class IllegalStageTransition(RuntimeError):
    pass


def next_phase(phase: StagePhase, event: StageEvent) -> StagePhase:
    """The phase after ``event`` in ``phase``; raises IllegalStageTransition
    naming both where the event cannot happen in that phase."""
    try:
        return _TRANSITIONS[phase, event]
    except KeyError:
        raise IllegalStageTransition(f"stage phase {phase.name} has no transition for event {event.name}") from None
