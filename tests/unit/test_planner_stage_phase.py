import pytest

from ds_pipe_ckpt.planning.stage_phase import IllegalStageTransition, StageEvent, StagePhase, next_phase


@pytest.mark.parametrize("phase, event, after", [
    (StagePhase.MEASURING, StageEvent.PLANNED, StagePhase.CHECKING),
    (StagePhase.MEASURING, StageEvent.MEASUREMENT_INCOMPLETE, StagePhase.UNPLANNABLE),
    (StagePhase.CHECKING, StageEvent.CHECK_HELD, StagePhase.PLANNED),
    (StagePhase.CHECKING, StageEvent.CHECK_MISSED, StagePhase.REPLAN_DUE),
    (StagePhase.CHECKING, StageEvent.LENGTH_CHECK_HELD, StagePhase.CHECKING),
    (StagePhase.REPLAN_DUE, StageEvent.REPLANNING, StagePhase.CHECKING),
])
def test_every_legal_transition(phase, event, after):
    assert next_phase(phase, event) is after


def test_an_illegal_transition_names_phase_and_event():
    with pytest.raises(IllegalStageTransition, match="stage phase PLANNED has no transition for event REPLANNING"):
        next_phase(StagePhase.PLANNED, StageEvent.REPLANNING)


def test_only_the_listed_transitions_are_legal():
    legal = 0
    for phase in StagePhase:
        for event in StageEvent:
            try:
                next_phase(phase, event)
                legal += 1
            except IllegalStageTransition:
                pass
    assert legal == 6
