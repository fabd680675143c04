"""A stage's planning problem: the measured figures of its layers
(:class:`LayerProfile`) and what the plan must fit (:class:`StageProblem`).

This module holds the problem's data and checks that it is well formed. It
must not price plans (that is :mod:`.cost_model`), say what a plan is
(:mod:`.plan`) or search for one (:mod:`.solver`); it imports no torch.

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
  input anyway, so its recomputation does not add it again;
* ``checkpointable``: False for a layer that must be stored (one excluded by
  the pipeline's ``checkpointable_layers``);
* ``forward_peak_bytes`` f_i: the most the layer's forward holds at once, run
  without checkpointing, beyond what the layers before it saved: its input
  (all of it, unless it is the stage's input, which the engine holds), what
  it saves as it goes, its temporaries (a distance matrix it reduces, a cast)
  and its output. 0 where it was not measured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["LayerProfile", "StageProblem"]


def require_int(owner: str, field: str, value: object, minimum: int) -> None:
    """Raises unless ``value`` is an int (not a bool) and at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{owner}: {field} must be an int, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{owner}: {field} must be >= {minimum}, got {value}")


def require_seconds(owner: str, field: str, value: object) -> None:
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
    forward_peak_bytes: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"LayerProfile: name must be a non-empty str, got {self.name!r}")
        owner = f"LayerProfile {self.name!r}"
        require_int(owner, "input_bytes", self.input_bytes, 0)
        require_int(owner, "saved_bytes", self.saved_bytes, 0)
        require_seconds(owner, "forward_s", self.forward_s)
        if self.selective_saved_bytes is not None:
            require_int(owner, "selective_saved_bytes", self.selective_saved_bytes, 0)
            if self.selective_saved_bytes > self.saved_bytes:
                raise ValueError(f"{owner}: selective_saved_bytes ({self.selective_saved_bytes}) must not exceed "
                                 f"saved_bytes ({self.saved_bytes})")
        if self.selective_recompute_s is not None:
            require_seconds(owner, "selective_recompute_s", self.selective_recompute_s)
        if not isinstance(self.checkpointable, bool):
            raise TypeError(f"{owner}: checkpointable must be a bool, got {self.checkpointable!r}")
        require_int(owner, "grad_bytes", self.grad_bytes, 0)
        require_int(owner, "input_saved_bytes", self.input_saved_bytes, 0)
        require_int(owner, "forward_peak_bytes", self.forward_peak_bytes, 0)
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
    micro-batch's stored activations until its end (:mod:`.cost_model`);
    ``backward_only_bytes`` is the part of ``base_bytes`` that only a backward
    meets (the activation gradient in flight between segments): the forwards'
    peaks are priced without it.

    Raises TypeError or ValueError naming the field for an empty chain, a
    non-layer element, ``in_flight < 1``, a negative byte count or
    ``backward_only_bytes > base_bytes``.
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
    backward_only_bytes: int = 0

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
        require_int(owner, "in_flight", self.in_flight, 1)
        require_int(owner, "budget_bytes", self.budget_bytes, 0)
        require_int(owner, "base_bytes", self.base_bytes, 0)
        require_int(owner, "held_gradient_bytes", self.held_gradient_bytes, 0)
        require_int(owner, "backward_start_bytes", self.backward_start_bytes, 0)
        require_int(owner, "backward_only_bytes", self.backward_only_bytes, 0)
        if self.backward_only_bytes > self.base_bytes:
            raise ValueError(f"{owner}: backward_only_bytes ({self.backward_only_bytes}) must not exceed base_bytes "
                             f"({self.base_bytes}): it is the part of the base that only the backward meets")
        if not isinstance(self.allow_selective, bool):
            raise TypeError(f"{owner}: allow_selective must be a bool, got {self.allow_selective!r}")
        if not isinstance(self.backward_keeps_graph, bool):
            raise TypeError(f"{owner}: backward_keeps_graph must be a bool, got {self.backward_keeps_graph!r}")

    @property
    def num_layers(self) -> int:
        """n, the length of the chain."""
        return len(self.layers)
