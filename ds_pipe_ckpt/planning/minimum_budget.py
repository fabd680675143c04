"""The least budget a stage's plan can fit (:func:`minimum_peak_bytes`) and
the error that reports it when the budget is smaller
(:class:`InfeasibleBudgetError`).

This module answers "how much memory does the stage need at the least" and
says so in the error; it must not search for the plan of least
recomputation (that is :mod:`.solver`); it imports no torch.
"""

from __future__ import annotations

from .cost_model import ChainCosts
from .kept_graph_solver import least_kept_graph_peak
from .problem import StageProblem
from .search_bounds import kept_graph_moves, segment_moves, suffix_bounds

__all__ = ["InfeasibleBudgetError", "minimum_peak_bytes"]

MIB = 1 << 20


class InfeasibleBudgetError(ValueError):
    """No plan of the stage fits its budget.

    ``minimum_bytes`` is the least predicted peak over all plans, i.e. the
    smallest budget for which :func:`~.solver.plan_stage` succeeds.
    """

    def __init__(self, label: str, budget_bytes: int, minimum_bytes: int, in_flight: int) -> None:
        self.label = label
        self.budget_bytes = budget_bytes
        self.minimum_bytes = minimum_bytes
        self.in_flight = in_flight
        super().__init__(
            f"stage {label!r}: no activation checkpointing plan fits the memory budget of "
            f"{budget_bytes / MIB:.2f} MiB ({budget_bytes} bytes) with {in_flight} micro-batch(es) in flight; "
            f"the smallest budget that fits is {minimum_bytes / MIB:.2f} MiB ({minimum_bytes} bytes)")

    def __reduce__(self):
        return type(self), (self.label, self.budget_bytes, self.minimum_bytes, self.in_flight)


def minimum_peak_bytes(problem: StageProblem) -> int:
    """The least predicted peak over every plan of the stage (base included),
    i.e. the smallest budget for which :func:`~.solver.plan_stage` succeeds. Honours
    ``allow_selective``; ignores ``budget_bytes``."""
    if problem.backward_keeps_graph:
        return problem.base_bytes + least_kept_graph_peak(problem, kept_graph_moves(problem, ChainCosts(problem)))
    bounds = suffix_bounds(problem, segment_moves(problem, ChainCosts(problem)))
    return problem.base_bytes + bounds.least_peak[0]
