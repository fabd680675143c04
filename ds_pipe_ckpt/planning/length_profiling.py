"""Measuring a stage's layers between training steps, on a stand-in
micro-batch of another length (:mod:`.shapes`), without touching training:
the random streams, the module's buffers (BatchNorm's running statistics) and
the parameters' ``.grad`` are as they were before, so that a run with a
budget trains bit for bit as one without."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import torch
from deepspeed.runtime.activation_checkpointing import checkpointing as ds_checkpointing

__all__ = ["isolated_from_training", "backward_through", "modules_parameters"]


@contextmanager
def isolated_from_training(module: torch.nn.Module, device: torch.device) -> Iterator[None]:
    """Runs the block with the CPU's, the device's and DeepSpeed's
    model-parallel random states, the module's buffers and its pipeline
    bookkeeping (``micro_offset``, ``curr_layer``) restored afterwards."""
    cpu_state = torch.get_rng_state()
    cuda_state = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    tracker = ds_checkpointing.get_cuda_rng_tracker() if device.type == "cuda" else None
    tracker_states = tracker.get_states() if tracker is not None else None
    buffers = [(buffer, buffer.detach().clone()) for buffer in module.buffers()]
    bookkeeping = {name: getattr(module, name) for name in ("micro_offset", "curr_layer") if hasattr(module, name)}
    try:
        yield
    finally:
        torch.set_rng_state(cpu_state)
        if cuda_state is not None:
            torch.cuda.set_rng_state(cuda_state, device)
        if tracker is not None:
            tracker.set_states(tracker_states)
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
        for name, value in bookkeeping.items():
            setattr(module, name, value)


def backward_through(outputs: Sequence[Any], sources: Sequence[Any]) -> int:
    """The backward of ``outputs`` (their tensors that require grad, with
    gradients of ones) to every tensor of ``sources`` that requires grad,
    computed and dropped: no ``.grad`` is written. Returns the bytes of the
    gradients of ``sources`` that are not parameters (the stage input's)."""
    tensors = [t for t in outputs if isinstance(t, torch.Tensor) and t.requires_grad]
    targets = [t for t in sources if isinstance(t, torch.Tensor) and t.requires_grad]
    if not tensors or not targets:
        return 0
    grads = torch.autograd.grad(tensors, targets, [torch.ones_like(t) for t in tensors], allow_unused=True)
    return sum(g.numel() * g.element_size() for g, t in zip(grads, targets)
               if g is not None and not isinstance(t, torch.nn.Parameter))


def modules_parameters(function: Any) -> list[torch.nn.Parameter]:
    """The trainable parameters of a pipeline layer: a module, or a
    ``TiedLayerSpec``'s ``forward_fn`` bound to its module."""
    modules = [function] if isinstance(function, torch.nn.Module) else \
        [a for a in getattr(function, "args", ()) if isinstance(a, torch.nn.Module)]
    return [p for module in modules for p in module.parameters() if p.requires_grad]
