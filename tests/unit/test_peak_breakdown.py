"""The predicted peak's terms (planning.peak_breakdown): they add up to the
cost model's peak for any plan, and name the moment that decides it."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ds_pipe_ckpt.planning.cost_model import predicted_peak_bytes
from ds_pipe_ckpt.planning.peak_breakdown import PeakBreakdown, PeakMoment, peak_breakdown
from ds_pipe_ckpt.planning.plan import Decision, Segment
from ds_pipe_ckpt.planning.problem import LayerProfile, StageProblem
from test_planner_solver import canonical_plans, chains

STORE, CHECKPOINT = Decision.STORE, Decision.CHECKPOINT


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(chain=chains(), data=st.data())
def test_the_terms_add_up_to_the_predicted_peak_of_any_plan(chain, data):
    plans = list(canonical_plans(chain))
    segments = [Segment(*s) for s in data.draw(st.sampled_from(plans), label="plan")]
    terms = peak_breakdown(chain, segments)
    assert terms.peak_bytes == predicted_peak_bytes(chain, segments)
    assert terms.base_bytes == chain.base_bytes
    assert (terms.segment is None) == (terms.moment in (PeakMoment.FORWARDS_END, PeakMoment.LOSS_PHASE))


def _layer(name: str, saved: int, forward_peak: int = 0) -> LayerProfile:
    return LayerProfile(name, input_bytes=10, saved_bytes=saved, forward_s=0.25, forward_peak_bytes=forward_peak)


def test_each_moment_by_hand():
    """Two layers, 2 micro-batches in flight, base 7; inputs 10 bytes each."""
    layers = (_layer("a", 40), _layer("b", 60))
    problem = StageProblem(layers, in_flight=2, budget_bytes=0, base_bytes=7)
    # Both stored: the end of the forwards holds 2 x 100 and nothing is rebuilt.
    stored = [Segment(0, 2, STORE)]
    assert peak_breakdown(problem, stored) == PeakBreakdown(PeakMoment.FORWARDS_END, None, 7, 200, 0)
    # Both checkpointed apart: the backward of b holds the other micro-batch's 20 and its own
    # 20 inputs, and rebuilds b's 60.
    apart = [Segment(0, 1, CHECKPOINT), Segment(1, 2, CHECKPOINT)]
    terms = peak_breakdown(problem, apart)
    assert (terms.moment, terms.segment, terms.held_bytes, terms.transient_bytes) == (
        PeakMoment.BACKWARD, apart[1], 40, 60)
    # A forward that holds 150 bytes at once in b (a distance matrix it reduces): its forward decides.
    wide = StageProblem((_layer("a", 40), _layer("b", 60, forward_peak=150)), in_flight=2, budget_bytes=0,
                        base_bytes=7)
    terms = peak_breakdown(wide, apart)
    assert (terms.moment, terms.segment, terms.held_bytes, terms.transient_bytes) == (
        PeakMoment.FORWARD, apart[1], 40, 140)
    assert terms.peak_bytes == predicted_peak_bytes(wide, apart) == 187
    # The loss phase on top of two stored micro-batches.
    lossy = StageProblem(layers, in_flight=2, budget_bytes=0, base_bytes=7, backward_start_bytes=30)
    terms = peak_breakdown(lossy, stored)
    assert (terms.moment, terms.segment, terms.held_bytes, terms.transient_bytes) == (
        PeakMoment.LOSS_PHASE, None, 200, 30)
    assert "the start of the backward" in terms.describe()
