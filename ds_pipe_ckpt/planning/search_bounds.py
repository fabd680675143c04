"""The bounds of the exact per-stage search (:mod:`.solver`), steps 1 and 2
of its docstring: every segment a plan can place, with its costs
(:func:`segment_moves`), the least peak and held bytes of each suffix of the
chain (:func:`suffix_bounds`) and the least recomputation of a suffix holding
at most so many bytes (:class:`RecomputeBound`).

This module computes figures of suffix plans that the search prunes with and
that :mod:`.minimum_budget` reads the least peak from. It must not search for
or choose a plan (that is :mod:`.solver`); it imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import takewhile
from typing import Iterator, NamedTuple

from .cost_model import ChainCosts
from .kept_graph_solver import KeptGraphMove
from .plan import Decision
from .problem import StageProblem

__all__ = ["Move", "Moves", "segment_moves", "kept_graph_moves", "SuffixBounds", "suffix_bounds", "RecomputeBound"]


class Move(NamedTuple):
    """One segment a plan can place next, from a known start: layers
    [start, end). ``rebuild`` is held + transient."""

    end: int
    held: int
    rebuild: int
    units: int
    decision: Decision


@dataclass(frozen=True)
class Moves:
    """The segments starting at each position: the one-layer STORE, and the
    CHECKPOINT and (when allowed) SELECTIVE regions, each by increasing end."""

    store: tuple[Move, ...]
    regions: tuple[tuple[tuple[Move, ...], ...], ...]

    def all_from(self, start: int) -> Iterator[Move]:
        yield self.store[start]
        for regions in self.regions[start]:
            yield from regions


def segment_moves(problem: StageProblem, chain: ChainCosts) -> Moves:
    """Every segment of the chain with its cost (SELECTIVE only where allowed and available)."""
    n = problem.num_layers

    def move(start: int, end: int, decision: Decision) -> Move:
        cost = chain.cost(start, end, decision)
        return Move(end, cost.held_bytes, cost.held_bytes + cost.transient_bytes, cost.recompute_units, decision)

    def regions_from(start: int) -> tuple[tuple[Move, ...], ...]:
        # A region ends before the first layer that may not be checkpointed.
        ends = tuple(takewhile(lambda end: chain.checkpoint_available(start, end), range(start + 1, n + 1)))
        checkpoint = tuple(move(start, end, Decision.CHECKPOINT) for end in ends)
        if not problem.allow_selective:
            return (checkpoint,)
        return checkpoint, tuple(move(start, end, Decision.SELECTIVE) for end in ends
                                 if chain.selective_available(start, end))

    return Moves(store=tuple(move(start, start + 1, Decision.STORE) for start in range(n)),
                 regions=tuple(regions_from(start) for start in range(n)))


def kept_graph_moves(problem: StageProblem, chain: ChainCosts) -> list[list[KeptGraphMove]]:
    """:func:`segment_moves`, per start, in the form of :mod:`.kept_graph_solver`."""
    moves = segment_moves(problem, chain)
    return [[KeptGraphMove(start, move.end, move.held, move.rebuild - move.held, move.units, move.decision)
             for move in moves.all_from(start)] for start in range(problem.num_layers)]



def _pareto_2d(points: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The points that no other point equals or beats in both coordinates, by
    increasing first (so decreasing second) coordinate."""
    points.sort()
    front: list[tuple[int, int]] = []
    for point in points:
        if not front or point[1] < front[-1][1]:
            front.append(point)
    return front


class SuffixBounds(NamedTuple):
    """Step 1 of :mod:`.solver`'s docstring, per position i (suffix [i, n))."""

    least_peak: list[int]
    least_held: list[int]
    least_local_peak: list[int]
    most_held: list[int]


def suffix_bounds(problem: StageProblem, moves: Moves) -> SuffixBounds:
    """Step 1 of :mod:`.solver`'s docstring: backward fronts of (S, L) per suffix."""
    n, k = problem.num_layers, problem.in_flight
    fronts: list[list[tuple[int, int]]] = [[] for _ in range(n)] + [[(0, 0)]]
    most_held = [0] * (n + 1)
    for start in reversed(range(n)):
        fronts[start] = _pareto_2d([(move.held + held, max(move.rebuild, move.held + local_peak))
                                    for move in moves.all_from(start)
                                    for held, local_peak in fronts[move.end]])
        most_held[start] = max(move.held + most_held[move.end] for move in moves.all_from(start))
    return SuffixBounds(least_peak=[min((k - 1) * held + local for held, local in front) for front in fronts],
                        least_held=[front[0][0] for front in fronts],
                        least_local_peak=[front[-1][1] for front in fronts],
                        most_held=most_held)


class RecomputeBound:
    """Step 2 of :mod:`.solver`'s docstring: per position, the Pareto front of
    (held bytes, recompute units) over the suffix plans that hold no more than
    a plan that fits can: (budget - base) // k."""

    def __init__(self, problem: StageProblem, chain: ChainCosts) -> None:
        n = problem.num_layers
        held_limit = (problem.budget_bytes - problem.base_bytes) // problem.in_flight
        closed: list[tuple[int, int]] = [(0, 0)]
        open_checkpoint: list[tuple[int, int]] = []
        open_selective: list[tuple[int, int]] = []
        self._held: list[list[int]] = [[] for _ in range(n)] + [[0]]
        self._units: list[list[int]] = [[] for _ in range(n)] + [[0]]
        # At each layer, going left: ``closed`` holds the plans of layers [layer, n),
        # ``open_*`` those whose first region covers ``layer`` and may still grow
        # to its left, less that region's input bytes (added when it closes).
        for layer in reversed(range(n)):
            store = chain.cost(layer, layer + 1, Decision.STORE)
            checkpoint = chain.cost(layer, layer + 1, Decision.CHECKPOINT)
            if not chain.checkpoint_available(layer, layer + 1):  # no region may cover this layer
                open_checkpoint = open_selective = []
                closed = _pareto_2d(self._shifted(closed, store.held_bytes, 0, held_limit))
                self._held[layer] = [held for held, _ in closed]
                self._units[layer] = [units for _, units in closed]
                continue
            open_checkpoint = self._shifted(closed + open_checkpoint, 0, checkpoint.recompute_units, held_limit)
            if problem.allow_selective and chain.selective_available(layer, layer + 1):
                selective = chain.cost(layer, layer + 1, Decision.SELECTIVE)
                open_selective = self._shifted(closed + open_selective, selective.held_bytes - checkpoint.held_bytes,
                                               selective.recompute_units, held_limit)
            else:
                open_selective = []
            closed = _pareto_2d(self._shifted(closed, store.held_bytes, 0, held_limit)
                                + self._shifted(open_checkpoint + open_selective, checkpoint.held_bytes, 0,
                                                held_limit))
            self._held[layer] = [held for held, _ in closed]
            self._units[layer] = [units for _, units in closed]
        # The least recompute units of a plan of the whole chain that may fit
        # (there is one: the problem is feasible).
        self.least_units_of_chain: int = self._units[0][-1]

    @staticmethod
    def _shifted(points: list[tuple[int, int]], held: int, units: int, held_limit: int) -> list[tuple[int, int]]:
        """The Pareto front of ``points`` moved by (held, units), within the limit."""
        return _pareto_2d([(point_held + held, point_units + units) for point_held, point_units in points
                           if point_held + held <= held_limit])

    def front(self, position: int) -> tuple[list[int], list[int]]:
        """The front of ``position``: held bytes increasing, recompute units decreasing."""
        return self._held[position], self._units[position]
