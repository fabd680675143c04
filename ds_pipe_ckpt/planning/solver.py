"""Exact per-stage checkpointing planner: the plan of least recomputation
whose predicted peak (:mod:`.cost_model`) fits the stage's budget.

Objective, lexicographic: least recomputation time, then lowest predicted
peak, then fewest segments (adjacent STORE segments merged); remaining ties go
to the plan the search meets first, which is deterministic. Times are summed
exactly (:class:`.cost_model.ChainCosts`), so ties are real ties.

This module is the search (step 3 below) and :func:`plan_stage`, which
returns a :class:`~.plan.StagePlan`. The bounds of steps 1 and 2 are in
:mod:`.search_bounds`; the least feasible budget, and the
:class:`~.minimum_budget.InfeasibleBudgetError` that reports it, in
:mod:`.minimum_budget`. It must not price segments itself (that is
:mod:`.cost_model`) nor hold plan or problem types; it imports no torch.

States and dominance
--------------------
Write ``cap`` for budget less base. A plan prefix ending at position ``i``
(layers ``[0, i)``) is summarised by its recompute time ``t``, its held bytes
``P`` and ``R``, the running maximum of ``H_<=j + transient_j`` over its
segments. For a suffix plan of layers ``[i, n)`` holding ``S`` bytes, with
``L = max_j (its own H_<=j + transient_j)`` (so ``L >= S``), the whole plan's
peak less base is ``(k-1)*(P+S) + max(R, P+L) = max(W + (k-1)*S,
k*P + (k-1)*S + L)`` with ``W = (k-1)*P + R``: the cost model's formula, whose
``k*H`` term never exceeds the other. Hence:

* ``R`` may be raised to ``P + Lmin_i`` (``Lmin_i``: the least ``L`` of any
  suffix plan) without changing any plan's peak; states are kept so, and a
  segment whose rebuild sets the new ``R`` makes states differing only in
  ``R`` equal.
* Equal ``t``: a state with ``P``, ``W`` and segment score no larger than
  another's is at least as good under every completion (no higher peak, no
  more segments). The segment score is ``2 * segments - (1 if the last
  segment is STORE)``: STORE goes one layer at a time and is free after a
  STORE, and every extension preserves this order.
* Smaller ``t``: only feasibility matters. A completion that fits after state
  B holds ``S <= Smax_B``, the least of the suffix's most held bytes,
  ``(cap - k*P_B) // k``, ``(cap - k*P_B - Lmin_i) // (k-1)`` and
  ``(cap - W_B) // (k-1)``. So A, faster than B, dominates B when
  ``P_A <= P_B`` and ``W_A <= cap - (k-1)*Smax_B``; for ``k = 1`` when
  ``P_A <= P_B`` alone.

Keeping per position only the states that no other dominates is exact.

Algorithm
---------
1. Backwards, the Pareto fronts of ``(S, L)`` over the suffix plans of each
   position give its least suffix peak ``g_i = min (k-1)*S + L``, least held
   ``Smin_i``, ``Lmin_i`` and most held bytes; ``base + g_0`` is
   :func:`~.minimum_budget.minimum_peak_bytes`.
2. Backwards, layer by layer (a region open or closed at each boundary), the
   Pareto fronts of ``(S, t)`` give the least recompute time of a suffix
   holding at most ``X`` bytes: a lower bound on what a prefix state still
   pays, ``X`` being the most its completion may hold.
3. Forwards, per position, the fronts of the dominance above, branch and
   bound: a state is dropped when no completion can fit,
   ``max(k*P + g_i, (k-1)*(P + Smin_i) + R) > cap``, or when its ``t`` plus the
   bound of step 2 exceeds a threshold. A first pass keeps only the few states
   of least bound per position; the plan it finds, if any, is a threshold.
   Otherwise the threshold starts at the bound of the empty prefix and grows
   (beyond the least bound dropped, geometrically) until a pass finds a plan.
   The exact pass with a threshold that some plan meets finds the optimum:
   every plan within the threshold survives, or one at least as good.
   Regions from one start are visited by increasing end; a state leaves the
   longer ones once it cannot fit or its ``t`` alone exceeds the threshold.

A stage whose backward keeps the graph (``StageProblem.backward_keeps_graph``)
has a simpler peak, ``k * H + max_j transient_j``, and its own exact search
(:mod:`.kept_graph_solver`).

Complexity: a pass of step 3 makes ``O(n^2 F)`` extensions, each checked
against its position's front in ``O(log F)``, ``F`` the largest front; steps
1 and 2 take ``O(n^2 F1)`` and ``O(n F2 log F2)`` for their 2-D fronts. The problem contains 0/1 knapsack (large
``k``, checkpoints of zero-byte inputs), so fronts can grow exponentially on
adversarial figures. On a 64-layer transformer stage (embedding, 62 blocks,
head; k from 1 to 16; budgets from the least to storing everything) ``F``
stays in the hundreds: identical blocks plan in 0.05-0.5 s of CPython, and
blocks whose times differ by up to 2%, the hardest case measured, in up to
about 1.1 s at budgets a tenth of the way up from the least (many plans then
lie within the bound's slack of the optimum).
"""

from __future__ import annotations

import gc
import math
from bisect import bisect_left, bisect_right
from contextlib import contextmanager
from operator import itemgetter
from typing import Iterator

from .cost_model import ChainCosts
from .kept_graph_solver import plan_kept_graph
from .minimum_budget import InfeasibleBudgetError
from .plan import Segment, StagePlan, merged_segments
from .problem import StageProblem
from .search_bounds import Move, Moves, RecomputeBound, SuffixBounds, kept_graph_moves, segment_moves, suffix_bounds

__all__ = ["plan_stage"]


# A forward state: (recompute units t, segment score, P, R, t + least suffix
# units, node), node being (parent node, start, end, decision), or None for the
# empty prefix.
_State = tuple
_UNITS = itemgetter(0)
_TIE_ORDER = itemgetter(1, 2, 3)
_DOMINANCE_ORDER = itemgetter(0, 1, 2, 3)
_BOUND = itemgetter(4)
_INCUMBENT_BEAM = 8
"""States kept per position by the search for an incumbent (step 3); 0: none."""


class _Staircase:
    """Points (P, W) of which none equals or beats another in both
    coordinates, by increasing P (so decreasing W)."""

    def __init__(self) -> None:
        self._held: list[int] = []
        self._weight: list[int] = []

    def __bool__(self) -> bool:
        """Whether it has points."""
        return bool(self._held)

    def least_weight(self, held: int) -> int | None:
        """The least W among the points with P <= ``held``, or None."""
        index = bisect_right(self._held, held)
        return self._weight[index - 1] if index else None

    def absorb(self, other: _Staircase) -> None:
        """Adds the points of ``other``, and empties it."""
        if other:
            for held, weight in zip(other._held, other._weight):
                self.add(held, weight)
            other._held, other._weight = [], []

    def add(self, held: int, weight: int) -> None:
        """Adds a point, unless a present point equals or beats it, dropping those it beats."""
        index = bisect_right(self._held, held)
        if index and self._weight[index - 1] <= weight:
            return
        index = bisect_left(self._held, held, hi=index)
        stop = index
        while stop < len(self._weight) and self._weight[stop] >= weight:
            stop += 1
        self._held[index:stop] = [held]
        self._weight[index:stop] = [weight]


def _sort_for_dominance(states: list[_State]) -> None:
    """Sorts states by (t, segment score, P, R), sorting by t alone first:
    states of equal t are few."""
    states.sort(key=_UNITS)
    first = 0
    for index in range(1, len(states) + 1):
        if index == len(states) or states[index][0] != states[first][0]:
            if index - first > 1:
                states[first:index] = sorted(states[first:index], key=_TIE_ORDER)
            first = index


class _Search:
    """Step 3 of the module docstring: one forward search.

    ``threshold`` (or None) bounds t + least suffix units of the states kept;
    ``beam`` (or None) keeps at each position only that many states, those of
    least t + least suffix units, which makes the search a fast heuristic
    whose plan, if it finds one, is an incumbent."""

    def __init__(self, problem: StageProblem, moves: Moves, bounds: SuffixBounds, recompute: RecomputeBound,
                 threshold: int | None, beam: int | None) -> None:
        self._moves = moves
        self._bounds = bounds
        self._recompute = recompute
        self._threshold = math.inf if threshold is None else threshold
        self._beam = beam
        self._k = problem.in_flight
        self._capacity = problem.budget_bytes - problem.base_bytes
        self._pending: list[list[_State]] = [[] for _ in range(problem.num_layers + 1)]
        # At most the least t + least suffix units of a state dropped for the threshold.
        self.least_dropped: int | None = None

    def run(self) -> _State | None:
        """The best complete state found, or None."""
        root = (0, 0, 0, self._bounds.least_local_peak[0], self._recompute.least_units_of_chain, None)
        self._pending[0].append(root)
        for start in range(len(self._pending) - 1):
            front = self._front(start, self._pending[start])
            self._pending[start] = []
            if self._beam is not None and len(front) > self._beam:
                front = sorted(sorted(front, key=_BOUND)[:self._beam], key=_DOMINANCE_ORDER)
            self._expand(start, front)
        if not self._pending[-1]:
            return None
        k = self._k
        # Least t, then least peak ((k-1)*P + R at the end), then fewest segments.
        return min(self._pending[-1], key=lambda state: (state[0], (k - 1) * state[2] + state[3], state[1] + 1 >> 1))

    def _front(self, position: int, states: list[_State]) -> list[_State]:
        """The states that no other dominates (module docstring), in dominance order."""
        k, capacity = self._k, self._capacity
        local_floor = self._bounds.least_local_peak[position]
        held_ceiling = self._bounds.most_held[position]
        _sort_for_dominance(states)
        faster = _Staircase()  # (P, W) of the kept states of smaller t
        tied = _Staircase()  # (P, W) of the kept states of the current t
        tied_units = None
        front: list[_State] = []
        for state in states:
            units, _, held, peak = state[:4]
            if units != tied_units:
                faster.absorb(tied)
                tied_units = units
            weight = (k - 1) * held + peak
            if tied:
                least = tied.least_weight(held)
                if least is not None and least <= weight:
                    continue
            least = faster.least_weight(held)
            if least is not None:
                if k == 1:
                    continue
                most_suffix = min(held_ceiling, (capacity - k * held) // k,
                                  (capacity - k * held - local_floor) // (k - 1), (capacity - weight) // (k - 1))
                if least <= capacity - (k - 1) * most_suffix:
                    continue
            tied.add(held, weight)
            front.append(state)
        return front

    def _expand(self, start: int, front: list[_State]) -> None:
        """Queues the extensions of ``front`` (in dominance order) by every segment from ``start``."""
        self._spread(start, front, (self._moves.store[start],), store=True)
        for regions in self._moves.regions[start]:
            self._spread(start, front, regions, store=False)

    def _spread(self, start: int, states: list[_State], moves: tuple[Move, ...], store: bool) -> None:
        """Queues the extensions of ``states`` (in dominance order) by ``moves``,
        segments from ``start`` by increasing end, but those that cannot fit or
        exceed the threshold.

        A state leaves the longer segments once it cannot fit, once its t
        alone exceeds the threshold (both only grow with the end), and once the
        segment sets its R (as all longer ones will) while an earlier state so
        set holds no more."""
        k, capacity, threshold = self._k, self._capacity, self._threshold
        most_per_micro_batch = capacity // k
        bounds, recompute = self._bounds, self._recompute
        least_dropped = math.inf
        active = states
        for end, move_held, rebuild, move_units, decision in moves:
            least_peak, least_held = bounds.least_peak[end], bounds.least_held[end]
            # What R becomes (normalised) when this segment sets it.
            overhang = max(rebuild, move_held + bounds.least_local_peak[end])
            suffix_held, suffix_units = recompute.front(end)
            queue = self._pending[end].append
            still_active: list[_State] = []
            keep = still_active.append
            overridden_held = collapsed_held = None
            for state in active:
                units, score, held, peak, _, node = state
                new_held = held + move_held
                new_units = units + move_units
                set_by_segment = peak <= held + rebuild
                if (k - 1) * new_held + (held + rebuild if set_by_segment else peak) > capacity:
                    continue
                if new_units > threshold:
                    least_dropped = min(least_dropped, new_units)
                    continue
                if set_by_segment:
                    if overridden_held is not None and held >= overridden_held:
                        continue
                    overridden_held = held
                keep(state)
                if peak <= held + overhang:
                    if collapsed_held is not None and held >= collapsed_held:
                        continue  # an earlier state reaches the same R with no more P
                    collapsed_held = held
                    new_peak = held + overhang
                else:
                    new_peak = peak
                if k * new_held + least_peak > capacity or (k - 1) * (new_held + least_held) + new_peak > capacity:
                    continue
                if k == 1:
                    limit = capacity - new_held
                else:
                    limit = min((capacity - new_peak) // (k - 1), most_per_micro_batch) - new_held
                index = bisect_right(suffix_held, limit)
                if not index:
                    continue
                bound = new_units + suffix_units[index - 1]
                if bound > threshold:
                    least_dropped = min(least_dropped, bound)
                    continue
                new_score = (score if score & 1 else score + 1) if store else ((score + 1) >> 1) * 2 + 2
                queue((new_units, new_score, new_held, new_peak, bound, (node, start, end, decision)))
            active = still_active
        if least_dropped < math.inf:
            self._dropped(least_dropped)

    def _dropped(self, bound: int) -> None:
        """Records a state dropped for the threshold, whose t + least suffix
        units is at least ``bound``."""
        if self.least_dropped is None or bound < self.least_dropped:
            self.least_dropped = bound


def _segments_of(node: tuple | None) -> tuple[Segment, ...]:
    """The plan recorded by a state's node chain, adjacent STORE segments merged."""
    steps = []
    while node is not None:
        node, start, end, decision = node
        steps.append((start, end, decision))
    return merged_segments(reversed(steps))


def _next_threshold(first: int, current: int, least_dropped: int) -> int:
    """The threshold after ``current`` found no plan: at least the least dropped
    bound, and half as far again from the first threshold (at least 1/128 of
    it), so that a few rounds reach the optimum without overshooting it much."""
    return max(least_dropped, current + max((current - first) // 2, first >> 7, 1))


def plan_stage(problem: StageProblem) -> StagePlan:
    """The optimal plan of the stage (see the module docstring for the objective).

    Raises InfeasibleBudgetError, carrying the least feasible budget, when no
    plan's predicted peak fits ``problem.budget_bytes``.
    """
    chain = ChainCosts(problem)
    if problem.backward_keeps_graph:
        return _plan_kept_graph(problem, chain)
    moves = segment_moves(problem, chain)
    bounds = suffix_bounds(problem, moves)
    minimum = problem.base_bytes + bounds.least_peak[0]
    if minimum > problem.budget_bytes:
        raise InfeasibleBudgetError(problem.label, problem.budget_bytes, minimum, problem.in_flight)
    with _cyclic_gc_paused():
        units, _, held, peak, _, node = _optimal_state(problem, moves, bounds, RecomputeBound(problem, chain))
    return StagePlan(segments=_segments_of(node),
                     predicted_peak_bytes=problem.base_bytes + (problem.in_flight - 1) * held + peak,
                     recompute_s=chain.seconds(units),
                     held_bytes_per_micro_batch=held)


def _plan_kept_graph(problem: StageProblem, chain: ChainCosts) -> StagePlan:
    """:func:`plan_stage` for a backward that keeps the graph (:mod:`.kept_graph_solver`)."""
    with _cyclic_gc_paused():
        plan, least_peak = plan_kept_graph(problem, kept_graph_moves(problem, chain))
    if plan is None:
        raise InfeasibleBudgetError(problem.label, problem.budget_bytes, problem.base_bytes + least_peak,
                                    problem.in_flight)
    return StagePlan(segments=merged_segments((move.start, move.end, move.decision) for move in plan.moves),
                     predicted_peak_bytes=problem.base_bytes + plan.peak, recompute_s=chain.seconds(plan.units),
                     held_bytes_per_micro_batch=plan.held)


@contextmanager
def _cyclic_gc_paused() -> Iterator[None]:
    """Pauses Python's cyclic garbage collector, restoring its state after.

    The search allocates hundreds of thousands of small tuples, none in a
    reference cycle; in a process holding many objects (torch), the full
    collections that these allocations trigger would take about a third of
    the planning time, for nothing."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _optimal_state(problem: StageProblem, moves: Moves, bounds: SuffixBounds,
                   recompute: RecomputeBound) -> _State:
    """Step 3 of the module docstring for a problem that some plan fits: the
    pass for an incumbent, then exact passes until one finds a plan."""
    first = recompute.least_units_of_chain
    incumbent = (_Search(problem, moves, bounds, recompute, None, _INCUMBENT_BEAM).run()
                 if _INCUMBENT_BEAM else None)
    threshold = first if incumbent is None else incumbent[0]
    while True:
        search = _Search(problem, moves, bounds, recompute, threshold, None)
        state = search.run()
        if state is not None:
            return state
        threshold = _next_threshold(first, threshold, search.least_dropped)
