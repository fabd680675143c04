"""The memory and time model of one pipeline stage under an activation
checkpointing plan: what a plan (:mod:`.plan`) of a problem (:mod:`.problem`)
is predicted to peak at, and how long it recomputes.

This module prices plans. It must not search for one (that is
:mod:`.solver`) nor hold the problem's or the plan's types; it imports no
torch. The layer figures x_i (input bytes), a_i (saved bytes), t_i (forward
seconds), s_i and r_i (selective saved bytes and recompute seconds), g_i
(gradient bytes) and v_i (the saved bytes that are the layer's input) are
those of :class:`~.problem.LayerProfile`.

A plan splits the chain into consecutive :class:`Segment` s ``[start, end)``,
each with a :class:`Decision`. Each segment has a *held* size (bytes kept from
its forward until its backward), a *transient* size (what its backward adds on
top of that at its highest) and a recomputation time:

============  ============================  ==================================  ==========
decision      held                          transient                           recompute
============  ============================  ==================================  ==========
STORE         sum a_i                       max_l (G_>l - sum_{l<m<end} a_m)     0
CHECKPOINT    x_start                       max_l (sum_{start<=m<=l} a_m + G_>l)  sum t_i
                                            - v_start
SELECTIVE     x_start + sum s_i             max_l (sum_{start<=m<=l} a_m + G_>l)  sum r_i
                                            - v_start - sum s_i, at least 0
============  ============================  ==================================  ==========

with ``l`` over the segment's layers and ``G_>l`` the gradient bytes of the
stage's layers after ``l``: the backward of layer ``l`` runs while the
activations of the segment's layers up to ``l`` are alive (stored or rebuilt;
those after ``l`` are freed) and the gradients of every later layer exist.
Without gradient bytes (and v) these are the plain sums 0, sum a_i and
sum (a_i - s_i).
The last segment's transient is at least ``held_gradient_bytes`` and
``backward_start_bytes`` (below).

A segment's forward (of the micro-batch that fills the stage, while ``k - 1``
others are held) peaks at ``H_<j + forward_j``, with f_i the layers'
``forward_peak_bytes`` (what a stored layer's forward holds at once beyond
the saved bytes of the layers before it) and ``A_l`` the saved bytes of the
segment's layers before ``l``::

    forward_j = max_l (A_l + f_l)                   STORE
    forward_j = f_start + max_{l > start} f_l       CHECKPOINT, SELECTIVE

(a checkpointed forward keeps fewer of its layers' tensors than a stored
one: f bounds it; the segment's input stays alive through it). With a kept
graph (below) a STORE segment's forward is ``held_j + max_l (f_l - a_l)``,
which leaves out the later layers' saved bytes so that the term stays local
to the segment. The forward meets the base but for ``backward_only_bytes``,
so every segment's transient is also at least ``forward_j - held_j -
backward_only_bytes``: a layer whose forward holds more than its backward (a
distance matrix reduced to an index, a cast copy, the output under way) then
decides the peak where it runs. Split into one-layer STORE segments, a STORE
run's forward terms are the same, so the solvers' decomposition holds.

Which decisions a segment may take is said in :mod:`.plan`.

With ``k`` micro-batches in flight on the stage (DeepSpeed's 1F1B
TrainSchedule gives stage ``s`` of ``pp`` ``min(pp - s, micro_batches)``) and
``base`` bytes that do not depend on the plan (communication buffers, the
engine's copies of the stage's inputs and outputs), the predicted peak is::

    H      = sum over segments of held
    H_<=j  = sum of held over the segments up to and including j
    peak   = base + max(k * H, (k - 1) * H + max_j (H_<=j + transient_j))

The first term is the end of the k-th forward. The second is the backward of
segment ``j`` of the oldest micro-batch: the ``k - 1`` others are held in
full, its segments after ``j`` are already freed and segment ``j``'s
activations are rebuilt. ``held_gradient_bytes`` (every g_i, when the stage
runs forwards after its first backward of the step) are alive during those
later forwards, when k micro-batches are held again: ``k * H + that``, which
the last segment's transient covers. It covers ``backward_start_bytes`` too:
what the end of the forwards and the start of the backward hold beyond
``k * H`` that no segment's backward meets (the loss and the gradient of the
stage's output, on the last stage): ``k * H + that``. (For the last segment
``H_<=j = H``, so the second term is never below the first.) A plan is
feasible when ``peak <= budget``.

**A backward that keeps the graph** (``StageProblem.backward_keeps_graph``):
DeepSpeed's ``PipelineEngine`` (0.19) runs a stage's backward once per
floating-point tensor the stage sends, with ``retain_graph=True`` for all but
the last. Every activation stored for the micro-batch then stays until its
whole backward ends: nothing is freed as the backward goes (recomputed
activations still are, as torch's checkpoint unpacks them). The oldest
micro-batch holds all its ``H`` while segment ``j`` is rebuilt, and a STORE
segment's own layers are not freed under its gradients::

    transient(STORE) = max_l G_>l = G_>start
    peak = base + k * H + max_j transient_j

(CHECKPOINT and SELECTIVE transients are as above.)

Recomputation times are summed exactly: every time is a binary fraction, so
all of a problem's times are integer multiples of one power of two
(:attr:`ChainCosts.time_unit_s`), sums are exact integers of that unit and
plans that recompute equally long compare equal whatever the order of
addition. :func:`recompute_seconds` is that exact sum rounded once to a float.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from fractions import Fraction
from itertools import accumulate
from typing import Iterable, NamedTuple, Sequence

from .plan import Decision, Segment, validate_segments
from .problem import LayerProfile, StageProblem

# Allocations too small for the model to place (the loss, its scalars, the engine's
# small tensors) vary a little between steps: the planners count this share of the
# peak (the stage planner: of its measuring step's; the partition planner: of the
# budget) in every plan, at least SMALL_ALLOCATIONS_MIN_BYTES.
SMALL_ALLOCATIONS_SHARE = 0.01
SMALL_ALLOCATIONS_MIN_BYTES = 4096

__all__ = [
    "SegmentCost",
    "TransientParts",
    "ChainCosts",
    "peak_of_costs",
    "gradients_as_base",
    "predicted_peak_bytes",
    "recompute_seconds",
]


class TransientParts(NamedTuple):
    """What bounds a segment's transient, each beyond what it holds: its
    backward (rebuilt activations, later layers' gradients), the end of the
    forwards (the last segment: held gradients, the loss phase) and its
    forward (less what only a backward meets). The transient is their max."""

    backward: int
    forwards_end: int
    forward: int


@dataclass(frozen=True)
class SegmentCost:
    """A segment's held and transient bytes and its recomputation time in
    units of :attr:`ChainCosts.time_unit_s`."""

    held_bytes: int
    transient_bytes: int
    recompute_units: int


def _exact_time_units(times: Sequence[float]) -> tuple[list[int], Fraction]:
    """Expresses ``times`` as integer multiples of their common binary unit.

    Returns the integers and the unit (a power of two, in seconds) so that
    ``times[i] == integers[i] * unit`` exactly.
    """
    fractions = [Fraction(value) for value in times]
    denominator = math.lcm(*(value.denominator for value in fractions))
    return [value.numerator * (denominator // value.denominator) for value in fractions], Fraction(1, denominator)


def _prefix(values: Iterable[int]) -> list[int]:
    """Prefix sums: element ``i`` is the sum of the first ``i`` values."""
    return list(accumulate(values, initial=0))


class ChainCosts:
    """Segment costs of a problem's chain in O(1) each, from prefix sums.

    Layers without selective figures contribute 0 to the selective sums; a
    count of selective-capable layers tells whether a segment may be SELECTIVE.
    ``time_unit_s`` (a Fraction) is the second's fraction of which every time
    of the chain is an integer multiple.
    """

    def __init__(self, problem: StageProblem) -> None:
        layers = problem.layers
        n = len(layers)
        self._input = [layer.input_bytes for layer in layers]
        self._input_saved = [layer.input_saved_bytes for layer in layers]
        self._saved = _prefix(layer.saved_bytes for layer in layers)
        # U[b] = A[b] + G[b:], the gradient bytes of layers b.. plus the saved bytes
        # of layers before b; _peak_u[s][e] = max(U[s+1 .. e]) (the module docstring's
        # max over a segment's layers, from prefix sums).
        grads_after = list(accumulate((layer.grad_bytes for layer in reversed(layers)), initial=0))[::-1]
        self._grads_after = grads_after
        self._keeps_graph = problem.backward_keeps_graph
        u = [self._saved[b] + grads_after[b] for b in range(n + 1)]
        self._peak_u = [[0] * (n + 1) for _ in range(n + 1)]
        for start in range(n):
            running = 0
            for end in range(start + 1, n + 1):
                running = max(running, u[end]) if end > start + 1 else u[end]
                self._peak_u[start][end] = running
        self._n = n
        # The forwards. _forward_stored[s][e]: a STORE segment's forward beyond what it holds,
        # max over l in [s, e) of (A[l] + f_l) - A[e]; with a kept graph the peak is
        # k * H + max_j transient_j, and a term local to the segment leaves out what is held
        # after l: max of (f_l - a_l). _forward_after[s][e]: max over l in (s, e) of f_l (0 for one layer).
        forward = [layer.forward_peak_bytes for layer in layers]
        self._forward = forward
        self._forward_stored = [[0] * (n + 1) for _ in range(n + 1)]
        self._forward_after = [[0] * (n + 1) for _ in range(n + 1)]
        for start in range(n):
            stored = -math.inf
            after = 0
            for end in range(start + 1, n + 1):
                last = end - 1
                if problem.backward_keeps_graph:
                    stored = max(stored, forward[last] - layers[last].saved_bytes)
                    self._forward_stored[start][end] = stored
                else:
                    stored = max(stored, self._saved[last] + forward[last])
                    self._forward_stored[start][end] = stored - self._saved[end]
                after = max(after, forward[last]) if last > start else 0
                self._forward_after[start][end] = after
        self._backward_only = problem.backward_only_bytes
        # What the end of the forwards holds beyond k * H: the last segment's least transient.
        self._last_floor = max(problem.held_gradient_bytes, problem.backward_start_bytes)
        self._selective_saved = _prefix(layer.selective_saved_bytes or 0 for layer in layers)
        self._selective_capable = _prefix(int(layer.has_selective) for layer in layers)
        self._checkpointable = _prefix(int(layer.checkpointable) for layer in layers)
        units, unit = _exact_time_units([layer.forward_s for layer in layers] +
                                        [layer.selective_recompute_s or 0.0 for layer in layers])
        self._forward_units = _prefix(units[:len(layers)])
        self._selective_recompute = _prefix(units[len(layers):])
        self.time_unit_s = unit

    def checkpoint_available(self, start: int, end: int) -> bool:
        """Whether every layer of ``[start, end)`` may be checkpointed."""
        return self._checkpointable[end] - self._checkpointable[start] == end - start

    def selective_available(self, start: int, end: int) -> bool:
        """Whether every layer of ``[start, end)`` may be checkpointed and has selective figures."""
        return (self.checkpoint_available(start, end)
                and self._selective_capable[end] - self._selective_capable[start] == end - start)

    def transient_parts(self, start: int, end: int, decision: Decision) -> TransientParts:
        """The three bounds of ``[start, end)``'s transient under ``decision``
        (the module docstring): its backward's, the end of the forwards' (the
        last segment only, else 0) and its forward's."""
        peak_u = self._peak_u[start][end]
        floor = self._last_floor if end == self._n else 0
        if decision is Decision.STORE:
            # Kept graph: the segment's layers are not freed under the later gradients.
            grads = self._grads_after[start + 1] if self._keeps_graph else peak_u - self._saved[end]
            return TransientParts(grads, floor, self._forward_stored[start][end] - self._backward_only)
        rebuilt = peak_u - self._saved[start] - self._input_saved[start]  # the held input is not rebuilt
        # Beyond what the segment holds (its input; the selective outputs, which its forward makes too).
        forward = (self._forward[start] + self._forward_after[start][end] - self._input[start]
                   - self._backward_only)
        if decision is Decision.SELECTIVE:
            rebuilt -= self._selective_saved[end] - self._selective_saved[start]
        return TransientParts(rebuilt, floor, forward)

    def cost(self, start: int, end: int, decision: Decision) -> SegmentCost:
        """The held bytes, transient bytes and recompute units of ``[start, end)``
        under ``decision`` (the table of the module docstring)."""
        transient = max(self.transient_parts(start, end, decision))
        if decision is Decision.STORE:
            return SegmentCost(self._saved[end] - self._saved[start], transient, 0)
        if decision is Decision.CHECKPOINT:
            return SegmentCost(self._input[start], transient, self._forward_units[end] - self._forward_units[start])
        selective_saved = self._selective_saved[end] - self._selective_saved[start]
        return SegmentCost(self._input[start] + selective_saved, transient,
                           self._selective_recompute[end] - self._selective_recompute[start])

    def seconds(self, units: int) -> float:
        """``units`` time units in seconds, rounded once to the nearest float."""
        return float(units * self.time_unit_s)


def peak_of_costs(costs: Iterable[SegmentCost], in_flight: int, base_bytes: int,
                  backward_keeps_graph: bool = False) -> int:
    """The predicted peak of segments with these costs, in chain order (the
    module docstring's formula, term by term)."""
    costs = list(costs)
    total_held = sum(cost.held_bytes for cost in costs)
    if backward_keeps_graph:
        return base_bytes + in_flight * total_held + max(cost.transient_bytes for cost in costs)
    held_so_far = 0
    rebuilt_peak = 0
    for cost in costs:
        held_so_far += cost.held_bytes
        rebuilt_peak = max(rebuilt_peak, held_so_far + cost.transient_bytes)
    return base_bytes + max(in_flight * total_held, (in_flight - 1) * total_held + rebuilt_peak)


def gradients_as_base(layers: Sequence[LayerProfile], in_flight: int,
                      micro_batches: int) -> tuple[tuple[LayerProfile, ...], int]:
    """The layers, and the gradient bytes to count in ``base``. With more
    micro-batches than in flight, a stage's later forwards and backwards
    (1F1B's steady state) run with every parameter gradient allocated and
    ``k - 1`` other micro-batches held: the gradients are as good as base then
    (returned as bytes, the layers' ``grad_bytes`` set to 0). Otherwise each
    backward allocates them as it goes: the layers are returned as they are."""
    if micro_batches <= in_flight:
        return tuple(layers), 0
    return (tuple(dataclasses.replace(layer, grad_bytes=0) for layer in layers),
            sum(layer.grad_bytes for layer in layers))


def predicted_peak_bytes(problem: StageProblem, segments: Sequence[Segment]) -> int:
    """The predicted peak memory of the stage under the plan ``segments``,
    including ``problem.base_bytes``. Raises ValueError (see
    :func:`validate_segments`) for segments that are not a plan of the chain."""
    validate_segments(problem, segments)
    chain = ChainCosts(problem)
    costs = [chain.cost(segment.start, segment.end, segment.decision) for segment in segments]
    return peak_of_costs(costs, problem.in_flight, problem.base_bytes, problem.backward_keeps_graph)


def recompute_seconds(problem: StageProblem, segments: Sequence[Segment]) -> float:
    """The recomputation time, in seconds, of one micro-batch's backward under
    the plan ``segments`` (exact sum, rounded once). Raises ValueError (see
    :func:`validate_segments`) for segments that are not a plan of the chain."""
    validate_segments(problem, segments)
    chain = ChainCosts(problem)
    return chain.seconds(sum(chain.cost(segment.start, segment.end, segment.decision).recompute_units
                             for segment in segments))
