"""The analytic memory floor of per-segment checkpointing, from tensor sizes.

Run a stage of segments ``s_0 .. s_{L-1}`` with every segment checkpointed and
backward from a gradient the caller supplies (as a pipeline stage does). When
the backward of segment ``i`` starts, right after its recomputation, these
tensors are necessarily alive:

* the inputs of segments ``1 .. i``, saved by their checkpoints until their
  own backward (segment 0's is the stage input, allocated before the step;
  those of segments ``i+1 ..`` were released by their backward);
* the stage output;
* everything segment ``i`` saves for backward, rebuilt by the recomputation:
  its *activations* (the distinct storages autograd saves in its forward, minus
  its input and parameters, which the recomputation reuses);
* the gradient arriving from segment ``i+1`` (for the last segment it is the
  caller's, allocated before the step);
* the parameter gradients of segments ``i+1 .. L-1``, already accumulated.

The floor is the largest of these sums over ``i``: a lower bound on the peak of
any implementation that keeps segment inputs on the device and recomputes a
whole segment before its backward. What a real run adds on top is the
transient gradient buffers inside one segment's backward and op workspaces.

Sizes are taken from one forward of the stage without checkpointing, with
``saved_tensors_hooks`` recording what autograd saves; nothing is measured
from the allocator.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from .workloads import Workload

__all__ = ["SegmentSizes", "Floor", "segment_sizes", "checkpointing_floor"]


@dataclass(frozen=True)
class SegmentSizes:
    """Bytes of one segment's input, output, saved activations and parameters.

    ``input_is_view_of_previous`` is set when the input shares its storage with
    the previous segment's input (that segment returned a view, e.g. a
    flatten): its memory is then counted there, not again here.
    """

    input_bytes: int
    output_bytes: int
    activation_bytes: int
    parameter_bytes: int
    input_is_view_of_previous: bool = False


@dataclass(frozen=True)
class Floor:
    """The floor and the terms of the sum that reaches it (at segment ``segment``)."""

    floor_bytes: int
    segment: int
    held_inputs_bytes: int
    output_bytes: int
    activation_bytes: int
    incoming_grad_bytes: int
    parameter_grad_bytes: int

    def as_dict(self) -> dict:
        """The fields, for the JSON record."""
        return asdict(self)


def _storage_key(tensor: torch.Tensor) -> tuple[torch.device, int]:
    return tensor.device, tensor.untyped_storage().data_ptr()


def _tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().nbytes()


def segment_sizes(workload: Workload, device: torch.device) -> list[SegmentSizes]:
    """Sizes of each segment of ``workload`` for one forward on ``device``."""
    sizes = []
    x = workload.make_input(device)
    previous_input_key = None
    for segment in workload.segments:
        input_key = _storage_key(x)
        reused = {input_key} | {_storage_key(p) for p in segment.parameters()}
        saved: dict[tuple[torch.device, int], int] = {}

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            key = _storage_key(tensor)
            if key not in reused:
                saved[key] = _tensor_bytes(tensor)
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            y = segment(x)
        sizes.append(SegmentSizes(input_bytes=_tensor_bytes(x),
                                  output_bytes=_tensor_bytes(y),
                                  activation_bytes=sum(saved.values()),
                                  parameter_bytes=sum(_tensor_bytes(p) for p in segment.parameters()),
                                  input_is_view_of_previous=input_key == previous_input_key))
        x, previous_input_key = y, input_key
    return sizes


def checkpointing_floor(sizes: list[SegmentSizes]) -> Floor:
    """The floor of per-segment checkpointing of a stage with these segment sizes."""
    last = len(sizes) - 1
    candidates = []
    for i, segment in enumerate(sizes):
        held_inputs = sum(s.input_bytes for s in sizes[1:i + 1] if not s.input_is_view_of_previous)
        incoming_grad = sizes[i + 1].input_bytes if i < last else 0
        parameter_grads = sum(s.parameter_bytes for s in sizes[i + 1:])
        total = held_inputs + sizes[last].output_bytes + segment.activation_bytes + incoming_grad + parameter_grads
        candidates.append(Floor(floor_bytes=total, segment=i, held_inputs_bytes=held_inputs,
                                output_bytes=sizes[last].output_bytes,
                                activation_bytes=segment.activation_bytes,
                                incoming_grad_bytes=incoming_grad, parameter_grad_bytes=parameter_grads))
    return max(candidates, key=lambda floor: floor.floor_bytes)
