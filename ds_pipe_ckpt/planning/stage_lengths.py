"""A pipeline stage's variable-length micro-batches (``dynamic_shape: true``
with ``max_sequence_length``), as its planner sees them: the length bucket
each micro-batch falls in, the measured micro-batch (and, on the last stage,
its labels) kept until the first plan, and the stage measured at every
bucket edge from it.

It must not build problems or plan (:mod:`.stage_problem`, :mod:`.length_plans`).
"""

from __future__ import annotations

from typing import Any

from .shapes import SequenceLengths
from .stage_measurement import LengthMeasurement, StageMeasurer, detached

__all__ = ["StageLengths"]


class StageLengths:
    """The lengths stage ``stage`` plans for, and what it measured of them."""

    def __init__(self, lengths: SequenceLengths, stage: int, last_stage: bool):
        self.lengths = lengths
        self.stage = stage
        self.measured_length: int | None = None
        self._sample: tuple[tuple, bool] | None = None  # the measured micro-batch, and whether packed as a tuple
        self._labels_wanted = last_stage  # for the loss in every length's pass
        self._labels: tuple | None = None
        self._measurements: dict[int, LengthMeasurement] | None = None
        # The measuring step's micro-batch lengths, in the order this stage ran them.
        self.measuring_step_lengths: list[int] = []

    @property
    def max_length(self) -> int:
        return self.lengths.max_length

    @property
    def edges(self) -> tuple[int, ...]:
        return self.lengths.edges

    def edge_of(self, x: Any, micro_batch: int, *, in_measuring_step: bool = False) -> int:
        """The bucket edge of micro-batch ``x`` (a ConfigError above the longest
        length); its length is kept when it is ``in_measuring_step``."""
        where = f"pipeline stage {self.stage} (micro-batch {micro_batch})"
        length = self.lengths.length_of(x if isinstance(x, tuple) else (x, ), where)
        edge = self.lengths.edge_for(length, where)
        if in_measuring_step:
            self.measuring_step_lengths.append(length)
        return edge

    def keep_measured(self, inputs: tuple, packed: bool) -> None:
        """Keeps the measuring step's micro-batch (a copy), to measure every length from it."""
        self._sample = detached(inputs), packed
        self.measured_length = self.lengths.length_of(inputs, f"pipeline stage {self.stage}")

    def labels_keeper(self, loss_fn: Any) -> Any | None:
        """On the last stage, until the measured micro-batch's labels are kept:
        ``loss_fn`` that keeps them; else None."""
        if not self._labels_wanted:
            return None

        def keep_labels(outputs: Any, labels: Any) -> Any:
            self._labels_wanted = False
            self._labels = detached(labels)
            return loss_fn(outputs, labels)

        return keep_labels

    def measurements(self, measurer: StageMeasurer, input_scale: float) -> dict[int, LengthMeasurement]:
        """The stage measured at every edge and at each length of the measuring
        step (once: a plan made again reuses them; the kept micro-batch is
        dropped then)."""
        if self._measurements is None:
            sample, packed = self._sample
            self._measurements = {}
            for length in sorted({*self.edges, self.measured_length, *self.measuring_step_lengths}):
                inputs = self.lengths.resized(sample, self.measured_length, length)
                labels = None if self._labels is None else self.lengths.resized(self._labels, self.measured_length,
                                                                                  length)
                self._measurements[length] = measurer.measure_pass(inputs, packed, labels, length, input_scale)
            self._sample = None
        return self._measurements
