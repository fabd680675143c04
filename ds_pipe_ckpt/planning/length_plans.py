"""One plan per micro-batch length, safe for any mix of lengths in flight.

Under 1F1B a stage holds ``k`` micro-batches at once, and with variable
lengths each follows the plan of its own length (:mod:`.shapes`). Planning
each length alone under the budget is not enough: a short micro-batch that
stores everything and a long one that checkpoints may each fit, and still
exceed the budget together (short ones first and the longest last is the
hard order). The cost model's peak, for one plan, is::

    base + (k - 1) * H + P1        (P1 = max_j (H_<=j + transient_j) >= H)

With ``e`` the engine's copies of one micro-batch's stage input and output
(``k + 1`` of them are in ``base``: one per micro-batch in flight and the
gradients of the one in its backward) and ``F`` the rest of ``base``, a mix of
micro-batches ``i`` in flight peaks at most at::

    F + sum_i (H_i + e_i) + max_j (P1_j - H_j + e_j)
      <= F + (k - 1) * max_i (H_i + e_i) + max_j (P1_j + 2 * e_j)

(the oldest micro-batch ``j`` is the one whose backward runs). So every plan
here keeps two figures under two limits: its *held* bytes ``H + e <= h`` and
its *single* peak ``P1 + 2e <= y``, with ``F + (k - 1) * h + y`` within the
budget. The limits come from the longest length's plan (the plan a static
planner would make for the maximum shape): ``y`` is its single peak and
``h`` the most the rest of the budget allows, so no length plans worse than
it. Each shorter length then takes the least-recomputation plan within both
limits: the exact solver under the combined limit, tightened until both hold
(a few solves), or a longer length's plan where that recomputes less (it
holds both limits too: a layer keeps no more for a shorter micro-batch), so
that no length recomputes more than a longer one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .cost_model import ChainCosts, peak_of_costs, predicted_peak_bytes, recompute_seconds
from .minimum_budget import InfeasibleBudgetError
from .plan import Decision, Segment, StagePlan
from .problem import StageProblem
from .solver import plan_stage

__all__ = ["LengthPlan", "LengthPlans", "plan_lengths", "held_and_single_peak", "TIGHTENINGS"]

TIGHTENINGS = 8  # solves per length before falling back to the longest length's plan


def held_and_single_peak(problem: StageProblem, plan: StagePlan) -> tuple[int, int]:
    """``H`` and ``P1`` of ``plan`` (module docstring): what one micro-batch
    holds between its forward and its backward, and its own peak above
    ``base`` when it is the only one in flight."""
    chain = ChainCosts(problem)
    costs = [chain.cost(s.start, s.end, s.decision) for s in plan.segments]
    return sum(c.held_bytes for c in costs), peak_of_costs(costs, 1, 0, problem.backward_keeps_graph)


@dataclass(frozen=True)
class LengthPlan:
    """The plan of micro-batches up to ``length`` long."""

    length: int
    problem: StageProblem
    plan: StagePlan
    engine_bytes: int  # e: the engine's copies of one micro-batch's stage input and output
    held_bytes: int  # H + e
    single_peak_bytes: int  # P1 + 2e
    borrowed_from: int | None = None  # the longer length whose plan this is (it recomputes least here)

    def counts(self) -> dict[Decision, int]:
        """Layers per decision."""
        counts = {decision: 0 for decision in Decision}
        for segment in self.plan.segments:
            counts[segment.decision] += segment.end - segment.start
        return counts


@dataclass(frozen=True)
class LengthPlans:
    """Every length's plan, and the peak they keep for any mix in flight."""

    by_length: tuple[LengthPlan, ...]  # ascending lengths; the last is the maximum
    in_flight: int
    fixed_bytes: int  # F: the part of base that is not per micro-batch
    held_limit_bytes: int  # h
    single_limit_bytes: int  # y

    @property
    def bound_bytes(self) -> int:
        """The highest peak any mix of these plans in flight can reach (module docstring)."""
        return self.bound_up_to(self.longest.length)

    def bound_up_to(self, edge: int) -> int:
        """The highest peak a step can reach whose micro-batches are all at
        most ``edge`` long (a bucket edge): any mix of the plans up to it in flight.

        Raises:
            KeyError: ``edge`` is not a bucket edge.
        """
        plans = [p for p in self.by_length if p.length <= self.for_edge(edge).length]
        held = max(p.held_bytes for p in plans)
        single = max(p.single_peak_bytes for p in plans)
        return self.fixed_bytes + (self.in_flight - 1) * held + single

    @property
    def longest(self) -> LengthPlan:
        return self.by_length[-1]

    def for_edge(self, edge: int) -> LengthPlan:
        for plan in self.by_length:
            if plan.length == edge:
                return plan
        raise KeyError(edge)


def _evaluated(problem: StageProblem, segments: tuple[Segment, ...]) -> StagePlan:
    """The plan ``segments`` as it costs on ``problem`` (another length's plan)."""
    held, _ = held_and_single_peak(problem, StagePlan(segments, 0, 0.0, 0))
    return StagePlan(segments, predicted_peak_bytes(problem, segments), recompute_seconds(problem, segments), held)


def _length_plan(length: int, problem: StageProblem, plan: StagePlan, engine_bytes: int,
                 borrowed_from: int | None = None) -> LengthPlan:
    held, single = held_and_single_peak(problem, plan)
    return LengthPlan(length, problem, plan, engine_bytes, held + engine_bytes, single + 2 * engine_bytes,
                      borrowed_from)


def plan_lengths(problems: dict[int, StageProblem], engine_bytes: dict[int, int]) -> LengthPlans:
    """Plan every length of ``problems`` (length -> the stage's problem at that
    length, each with the stage's budget) so that any mix in flight keeps the
    budget (module docstring).

    Raises:
        InfeasibleBudgetError: the longest length has no plan within the budget.
    """
    lengths = sorted(problems)
    longest_problem = problems[lengths[-1]]
    k = longest_problem.in_flight
    longest = _length_plan(lengths[-1], longest_problem, plan_stage(longest_problem), engine_bytes[lengths[-1]])

    def fixed(length: int) -> int:
        return problems[length].base_bytes - (k + 1) * engine_bytes[length]

    fixed_bytes = max(fixed(length) for length in lengths)
    single_limit = longest.single_peak_bytes
    room = longest_problem.budget_bytes - fixed_bytes - single_limit
    held_limit = max(longest.held_bytes, room // (k - 1)) if k > 1 else longest.held_bytes
    def over(plan: LengthPlan) -> int:
        """How far ``plan`` is above its limits (<= 0: within both)."""
        return max((k - 1) * (plan.held_bytes - held_limit), plan.single_peak_bytes - single_limit)

    plans = [longest]  # from the longest down
    for length in reversed(lengths[:-1]):
        problem, e = problems[length], engine_bytes[length]
        limit = fixed(length) + (k - 1) * held_limit + single_limit  # budget' of the module docstring
        candidates = []
        for _ in range(TIGHTENINGS):
            if limit < problem.base_bytes:
                break
            try:
                candidate = _length_plan(length, problem, plan_stage(dataclasses.replace(problem, budget_bytes=limit)),
                                         e)
            except InfeasibleBudgetError:
                break
            if over(candidate) <= 0:
                candidates.append(candidate)
                break
            limit -= over(candidate)
        # A longer length's plan keeps the limits here too (a layer keeps no more for a
        # shorter micro-batch), and may recompute less than a tightened solve: the
        # least recomputation of all wins; the longest's plan stands whatever it is.
        for longer in plans:
            borrowed = _length_plan(length, problem, _evaluated(problem, longer.plan.segments), e,
                                    borrowed_from=longer.borrowed_from or longer.length)
            if over(borrowed) <= 0 or longer is longest:
                candidates.append(borrowed)
        plans.append(min(candidates, key=lambda plan: plan.plan.recompute_s))  # stable: the own solve first
    return LengthPlans(by_length=tuple(reversed(plans)), in_flight=k, fixed_bytes=fixed_bytes,
                       held_limit_bytes=held_limit, single_limit_bytes=single_limit)
