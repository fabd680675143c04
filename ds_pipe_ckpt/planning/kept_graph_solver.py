"""The exact plan for a stage whose backward keeps the graph
(``StageProblem.backward_keeps_graph``; :mod:`.cost_model`).

There a plan's peak less base is ``k * H + T``: ``H`` the bytes it holds per
micro-batch, ``T`` the largest transient of its segments. Each threshold
``tau`` on ``T`` (one of the segments' transients) leaves a simpler problem:
among the plans made of segments whose transient is at most ``tau``, the least
recomputation holding at most ``(cap - tau) // k`` bytes (``cap``: budget
less base). That is a shortest path over layer boundaries with Pareto fronts
of (held bytes, recompute units), made exact by keeping every front.

The optimum is the best of the thresholds' answers (least recomputation, then
lowest peak, then fewest segments). The thresholds are visited upwards: a plan
whose largest transient is below ``tau`` was met at its own threshold, so each
threshold adds only plans of peak at least ``k * (least held) + tau``. The
visit stops once ``tau`` leaves too little room for even the fastest plan of
any transient (its least recomputation within ``(cap - tau) // k`` only grows
with ``tau``) to match the best recomputation found, or to beat its peak
when it only matches it.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Iterable, NamedTuple

from .plan import Decision, merged_segments
from .problem import StageProblem

__all__ = ["KeptGraphMove", "KeptGraphPlan", "least_kept_graph_peak", "plan_kept_graph"]


class KeptGraphMove(NamedTuple):
    """One segment ``[start, end)`` under ``decision``, with its costs."""

    start: int
    end: int
    held: int
    transient: int
    units: int
    decision: Decision


class KeptGraphPlan(NamedTuple):
    """The optimal plan: its segments' moves, recompute units, held bytes and peak less base."""

    moves: tuple[KeptGraphMove, ...]
    units: int
    held: int
    peak: int


def _fronts_to_end(moves: list[list[KeptGraphMove]], tau: float, held_limit: int, units_limit: int) -> list[tuple]:
    """The Pareto front, by increasing held bytes (so decreasing units), of
    (held, units, node) over the plans of the whole chain whose segments'
    transients are at most ``tau``, that hold at most ``held_limit`` and
    recompute at most ``units_limit``. A node is ``(parent node, move)``; the
    first plan met is kept on ties."""
    n = len(moves)
    pending: list[list[tuple]] = [[] for _ in range(n + 1)]
    pending[0].append((0, 0, None))
    for start in range(n):
        front = _pareto(pending[start])
        pending[start] = []
        for move in moves[start]:
            if move.transient > tau:
                continue
            queue = pending[move.end].append
            for held, units, node in front:
                new_held = held + move.held
                if new_held > held_limit:
                    break  # the front goes by increasing held bytes
                if units + move.units <= units_limit:
                    queue((new_held, units + move.units, (node, move)))
    return _pareto(pending[n])


def _pareto(states: list[tuple]) -> list[tuple]:
    """The states that no other equals or beats in (held, units), by increasing held."""
    states.sort(key=lambda state: (state[0], state[1]))
    front: list[tuple] = []
    for state in states:
        if not front or state[1] < front[-1][1]:
            front.append(state)
    return front


def _moves_of(node: tuple | None) -> list[KeptGraphMove]:
    path = []
    while node is not None:
        node, move = node
        path.append(move)
    return path[::-1]


def _thresholds(moves: list[list[KeptGraphMove]]) -> list[int]:
    return sorted({move.transient for here in moves for move in here})


def _least_held(moves: list[list[KeptGraphMove]], tau: int) -> tuple[int, tuple | None] | None:
    """The least held bytes of a plan whose segments' transients are at most
    ``tau``, and that plan's node; None when there is none."""
    n = len(moves)
    least: list[tuple[int, tuple | None] | None] = [(0, None)] + [None] * n
    for start in range(n):
        if least[start] is None:
            continue
        held_before, node = least[start]
        for move in moves[start]:
            if move.transient <= tau:
                held = held_before + move.held
                if least[move.end] is None or held < least[move.end][0]:
                    least[move.end] = (held, (node, move))
    return least[n]


def _least_peak_plan(problem: StageProblem, moves: list[list[KeptGraphMove]]) -> KeptGraphPlan:
    """A plan of least ``k * H + T``: for each threshold, the plan of least
    held bytes, its peak at most ``k * held + tau`` (exact at the optimum's own threshold)."""
    k = problem.in_flight
    best: KeptGraphPlan | None = None
    for tau in _thresholds(moves):
        found = _least_held(moves, tau)
        if found is None:
            continue
        path = _moves_of(found[1])
        peak = k * found[0] + max(move.transient for move in path)
        if best is None or peak < best.peak:
            best = KeptGraphPlan(tuple(path), sum(move.units for move in path), found[0], peak)
    return best


def least_kept_graph_peak(problem: StageProblem, moves: list[list[KeptGraphMove]]) -> int:
    """The least ``k * H + T`` over every plan (base not included)."""
    return _least_peak_plan(problem, moves).peak


def plan_kept_graph(problem: StageProblem,
                    moves: list[list[KeptGraphMove]]) -> tuple[KeptGraphPlan | None, int]:
    """The optimal plan within the budget (module docstring), or None when
    none fits; and the least ``k * H + T`` of any plan (base not included)."""
    k = problem.in_flight
    capacity = problem.budget_bytes - problem.base_bytes
    # The incumbent: a plan of least peak. Every search below keeps only states
    # that recompute no more than the best plan found.
    incumbent = _least_peak_plan(problem, moves)
    if incumbent.peak > capacity:
        return None, incumbent.peak
    best = (incumbent.units, incumbent.peak, _segment_count(incumbent.moves), incumbent)
    # The fastest plans of any transient: a lower bound on the recomputation of
    # a plan holding at most a given number of bytes.
    fastest = _fronts_to_end(moves, float("inf"), capacity // k, best[0])
    fastest_held = [held for held, _, _ in fastest]
    for tau in _thresholds(moves):
        held_limit = (capacity - tau) // k
        index = bisect_right(fastest_held, held_limit)
        if held_limit < 0 or not index:
            break  # tau only grows: no plan within the best recomputation fits from here on
        least_units = fastest[index - 1][1]
        if least_units > best[0] or (least_units == best[0] and k * fastest[0][0] + tau >= best[1]):
            break  # neither bound falls as tau grows
        front = _fronts_to_end(moves, tau, held_limit, best[0])
        if not front:
            continue
        held, units, node = front[-1]  # least units (most held among the front)
        path = _moves_of(node)
        peak = k * held + max(move.transient for move in path)
        key = (units, peak, _segment_count(path))
        if key < best[:3]:
            best = (*key, KeptGraphPlan(tuple(path), units, held, peak))
    return best[3], incumbent.peak


def _segment_count(path: Iterable[KeptGraphMove]) -> int:
    """Segments once adjacent STOREs merge."""
    return len(merged_segments((move.start, move.end, move.decision) for move in path))
