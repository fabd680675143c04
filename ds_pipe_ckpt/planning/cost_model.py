"""The memory and time model of one pipeline stage under an activation
checkpointing plan.

A stage runs a chain of ``n`` layers. Layer ``i`` is described by a
:class:`LayerProfile`:

* ``input_bytes`` x_i: bytes of the layer's input tensor(s), which is what a
  checkpoint region starting at layer ``i`` keeps;
* ``saved_bytes`` a_i: bytes autograd saves for backward when the layer runs
  without checkpointing;
* ``forward_s`` t_i: seconds of its forward, the cost of a full recomputation;
* optionally ``selective_saved_bytes`` s_i (<= a_i) and
  ``selective_recompute_s`` r_i: what the layer saves, and what recomputing it
  costs, under selective (op-level) checkpointing, which keeps the outputs of
  matmuls, attention and convolutions and recomputes the rest. When either is
  None, selective checkpointing is not available for the layer;
* ``grad_bytes`` g_i: bytes of the gradients of its parameters when they are
  allocated during the step (by its backward; 0 when they outlive steps);
* ``input_saved_bytes`` v_i (<= a_i, <= x_i): the part of a_i that is the
  layer's own input. A checkpoint region starting at layer ``i`` holds that
  input anyway, so its recomputation does not add it again.

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

SELECTIVE needs the selective figures of every layer of the segment;
CHECKPOINT and SELECTIVE need every layer of the segment to be
``checkpointable`` (a layer that is not, e.g. one excluded by the pipeline's
``checkpointable_layers``, is always stored).
Adjacent STORE segments are equivalent to one STORE segment; CHECKPOINT and
SELECTIVE segments are separate checkpoint regions even when adjacent.

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
import enum
import math
from dataclasses import dataclass
from fractions import Fraction
from itertools import accumulate
from typing import Iterable, Sequence

# Allocations too small for the model to place (the loss, its scalars, the engine's
# small tensors) vary a little between steps: the planners count this share of the
# peak (the stage planner: of its measuring step's; the partition planner: of the
# budget) in every plan, at least SMALL_ALLOCATIONS_MIN_BYTES.
SMALL_ALLOCATIONS_SHARE = 0.01
SMALL_ALLOCATIONS_MIN_BYTES = 4096

__all__ = [
    "LayerProfile",
    "StageProblem",
    "Decision",
    "Segment",
    "SegmentCost",
    "ChainCosts",
    "peak_of_costs",
    "validate_segments",
    "merged_segments",
    "gradients_as_base",
    "predicted_peak_bytes",
    "recompute_seconds",
]


def _require_int(owner: str, field: str, value: object, minimum: int) -> None:
    """Raises unless ``value`` is an int (not a bool) and at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{owner}: {field} must be an int, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{owner}: {field} must be >= {minimum}, got {value}")


def _require_seconds(owner: str, field: str, value: object) -> None:
    """Raises unless ``value`` is a finite, non-negative int or float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{owner}: {field} must be a number of seconds, got {value!r} ({type(value).__name__})")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{owner}: {field} must be finite and >= 0, got {value!r}")


@dataclass(frozen=True)
class LayerProfile:
    """The measured figures of one layer (see the module docstring for their meaning).

    Raises TypeError or ValueError, naming the layer and the field, for a
    negative or non-numeric figure, a non-finite time, or
    ``selective_saved_bytes > saved_bytes``. ``selective_recompute_s`` may
    exceed ``forward_s`` (measurement noise); the solver then simply prefers
    CHECKPOINT.
    """

    name: str
    input_bytes: int
    saved_bytes: int
    forward_s: float
    selective_saved_bytes: int | None = None
    selective_recompute_s: float | None = None
    checkpointable: bool = True
    grad_bytes: int = 0
    input_saved_bytes: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"LayerProfile: name must be a non-empty str, got {self.name!r}")
        owner = f"LayerProfile {self.name!r}"
        _require_int(owner, "input_bytes", self.input_bytes, 0)
        _require_int(owner, "saved_bytes", self.saved_bytes, 0)
        _require_seconds(owner, "forward_s", self.forward_s)
        if self.selective_saved_bytes is not None:
            _require_int(owner, "selective_saved_bytes", self.selective_saved_bytes, 0)
            if self.selective_saved_bytes > self.saved_bytes:
                raise ValueError(f"{owner}: selective_saved_bytes ({self.selective_saved_bytes}) must not exceed "
                                 f"saved_bytes ({self.saved_bytes})")
        if self.selective_recompute_s is not None:
            _require_seconds(owner, "selective_recompute_s", self.selective_recompute_s)
        if not isinstance(self.checkpointable, bool):
            raise TypeError(f"{owner}: checkpointable must be a bool, got {self.checkpointable!r}")
        _require_int(owner, "grad_bytes", self.grad_bytes, 0)
        _require_int(owner, "input_saved_bytes", self.input_saved_bytes, 0)
        if self.input_saved_bytes > min(self.saved_bytes, self.input_bytes):
            raise ValueError(f"{owner}: input_saved_bytes ({self.input_saved_bytes}) must not exceed saved_bytes "
                             f"({self.saved_bytes}) nor input_bytes ({self.input_bytes})")

    @property
    def has_selective(self) -> bool:
        """Whether selective checkpointing is available (both selective figures given)."""
        return self.selective_saved_bytes is not None and self.selective_recompute_s is not None


@dataclass(frozen=True)
class StageProblem:
    """One stage's planning problem.

    ``layers`` (any iterable of :class:`LayerProfile`, stored as a tuple) is the
    stage's chain in execution order; ``in_flight`` is k, the micro-batches
    whose activations the stage holds at once; ``budget_bytes`` bounds the
    predicted peak, which includes ``base_bytes``; ``label`` names the stage in
    error messages; ``allow_selective=False`` keeps the solver from choosing
    SELECTIVE (the evaluation functions still price any valid plan);
    ``backward_keeps_graph`` prices plans for a backward that keeps each
    micro-batch's stored activations until its end (module docstring).

    Raises TypeError or ValueError naming the field for an empty chain, a
    non-layer element, ``in_flight < 1`` or a negative byte count.
    """

    layers: tuple[LayerProfile, ...]
    in_flight: int
    budget_bytes: int
    base_bytes: int = 0
    label: str = "stage"
    allow_selective: bool = True
    held_gradient_bytes: int = 0
    backward_keeps_graph: bool = False
    backward_start_bytes: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.label, str):
            raise TypeError(f"StageProblem: label must be a str, got {self.label!r}")
        owner = f"StageProblem {self.label!r}"
        object.__setattr__(self, "layers", tuple(self.layers))
        if not self.layers:
            raise ValueError(f"{owner}: layers must not be empty")
        for index, layer in enumerate(self.layers):
            if not isinstance(layer, LayerProfile):
                raise TypeError(f"{owner}: layers[{index}] must be a LayerProfile, got {type(layer).__name__}")
        _require_int(owner, "in_flight", self.in_flight, 1)
        _require_int(owner, "budget_bytes", self.budget_bytes, 0)
        _require_int(owner, "base_bytes", self.base_bytes, 0)
        _require_int(owner, "held_gradient_bytes", self.held_gradient_bytes, 0)
        _require_int(owner, "backward_start_bytes", self.backward_start_bytes, 0)
        if not isinstance(self.allow_selective, bool):
            raise TypeError(f"{owner}: allow_selective must be a bool, got {self.allow_selective!r}")
        if not isinstance(self.backward_keeps_graph, bool):
            raise TypeError(f"{owner}: backward_keeps_graph must be a bool, got {self.backward_keeps_graph!r}")

    @property
    def num_layers(self) -> int:
        """n, the length of the chain."""
        return len(self.layers)


class Decision(enum.Enum):
    """How a segment's activations are kept for backward."""

    STORE = "store"
    CHECKPOINT = "checkpoint"
    SELECTIVE = "selective"


@dataclass(frozen=True)
class Segment:
    """Layers ``[start, end)`` of a stage, all handled by ``decision``.

    Raises TypeError or ValueError naming the field unless
    ``0 <= start < end`` and ``decision`` is a :class:`Decision`.
    """

    start: int
    end: int
    decision: Decision

    def __post_init__(self) -> None:
        _require_int("Segment", "start", self.start, 0)
        _require_int("Segment", "end", self.end, self.start + 1)
        if not isinstance(self.decision, Decision):
            raise TypeError(f"Segment: decision must be a Decision, got {self.decision!r}")


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
        # What the end of the forwards holds beyond k * H: the last segment's least transient.
        self._last_floor = max(problem.held_gradient_bytes, problem.backward_start_bytes)
        self._selective_saved = _prefix(layer.selective_saved_bytes or 0 for layer in layers)
        self._selective_capable = _prefix(int(layer.has_selective) for layer in layers)
        self._checkpointable = _prefix(int(layer.checkpointable) for layer in layers)
        units, unit = _exact_time_units([layer.forward_s for layer in layers] +
                                        [layer.selective_recompute_s or 0.0 for layer in layers])
        self._forward = _prefix(units[:len(layers)])
        self._selective_recompute = _prefix(units[len(layers):])
        self.time_unit_s = unit

    def checkpoint_available(self, start: int, end: int) -> bool:
        """Whether every layer of ``[start, end)`` may be checkpointed."""
        return self._checkpointable[end] - self._checkpointable[start] == end - start

    def selective_available(self, start: int, end: int) -> bool:
        """Whether every layer of ``[start, end)`` may be checkpointed and has selective figures."""
        return (self.checkpoint_available(start, end)
                and self._selective_capable[end] - self._selective_capable[start] == end - start)

    def cost(self, start: int, end: int, decision: Decision) -> SegmentCost:
        """The held bytes, transient bytes and recompute units of ``[start, end)``
        under ``decision`` (the table of the module docstring)."""
        saved = self._saved[end] - self._saved[start]
        peak_u = self._peak_u[start][end]
        floor = self._last_floor if end == self._n else 0
        if decision is Decision.STORE:
            # Kept graph: the segment's layers are not freed under the later gradients.
            grads = self._grads_after[start + 1] if self._keeps_graph else peak_u - self._saved[end]
            return SegmentCost(saved, max(grads, floor), 0)
        rebuilt = peak_u - self._saved[start] - self._input_saved[start]  # the held input is not rebuilt
        if decision is Decision.CHECKPOINT:
            return SegmentCost(self._input[start], max(rebuilt, floor), self._forward[end] - self._forward[start])
        selective_saved = self._selective_saved[end] - self._selective_saved[start]
        return SegmentCost(self._input[start] + selective_saved, max(rebuilt - selective_saved, floor),
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


def merged_segments(steps: Iterable[tuple[int, int, Decision]]) -> tuple[Segment, ...]:
    """The plan made of ``(start, end, decision)`` steps in chain order, with
    adjacent STORE steps merged into one segment (they are one and the same)."""
    segments: list[Segment] = []
    for start, end, decision in steps:
        if decision is Decision.STORE and segments and segments[-1].decision is Decision.STORE:
            start = segments.pop().start
        segments.append(Segment(start, end, decision))
    return tuple(segments)


def validate_segments(problem: StageProblem, segments: Sequence[Segment]) -> None:
    """Raises ValueError naming the offending segment unless ``segments`` tile
    ``[0, n)`` in order, every CHECKPOINT and SELECTIVE segment's layers are
    checkpointable and every SELECTIVE segment's layers have selective figures."""
    owner = f"stage {problem.label!r}"
    position = 0
    for index, segment in enumerate(segments):
        if not isinstance(segment, Segment):
            raise TypeError(f"{owner}: segments[{index}] must be a Segment, got {type(segment).__name__}")
        if segment.start != position:
            raise ValueError(f"{owner}: segments must tile [0, {problem.num_layers}) in order, but segments[{index}] "
                             f"= [{segment.start}, {segment.end}) starts at {segment.start}, expected {position}")
        if segment.end > problem.num_layers:
            raise ValueError(f"{owner}: segments[{index}] = [{segment.start}, {segment.end}) ends past the "
                             f"{problem.num_layers} layers of the stage")
        if segment.decision is not Decision.STORE:
            for layer in problem.layers[segment.start:segment.end]:
                if not layer.checkpointable:
                    raise ValueError(f"{owner}: segments[{index}] = [{segment.start}, {segment.end}) is "
                                     f"{segment.decision.name} but layer {layer.name!r} is not checkpointable")
        if segment.decision is Decision.SELECTIVE:
            for layer in problem.layers[segment.start:segment.end]:
                if not layer.has_selective:
                    raise ValueError(f"{owner}: segments[{index}] = [{segment.start}, {segment.end}) is SELECTIVE "
                                     f"but layer {layer.name!r} has no selective figures")
        position = segment.end
    if position != problem.num_layers:
        raise ValueError(f"{owner}: segments must tile [0, {problem.num_layers}), but they end at {position}")


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
