"""What the stage-boundary planner (:mod:`.partition`) needs to know about
every layer of a pipeline, measured before any stage exists.

:func:`profile_layer_specs` builds the layers of a ``PipelineModule`` layer
list one at a time (``LayerSpec``, ``TiedLayerSpec``, modules, callables, as
DeepSpeed's ``PipelineModule`` builds them), on one device, and runs each on
the output of the one before, starting from a sample micro-batch. Only one
layer (and the tied modules met so far) is alive at a time, so the whole
model never needs to fit. Per layer:

* a plain forward and backward, timed after a warm-up run (lazy
  initialisation and first-call allocations would inflate the first): the
  least of three runs;
* a checkpointed forward and backward observed by the stage planner's own
  :class:`~.profile.LayerMeter`: the bytes of the layer's input, what
  autograd saves for its backward without checkpointing (parameters and the
  input's part counted apart), and the selective figures from its
  recomputation;
* the bytes of its trainable parameters' gradients.

A tied module (``TiedLayerSpec``) is built once and its gradient counted at
each use: a stage holding one use holds the whole parameter and gradient;
two uses on one stage are counted twice (an upper bound).

Given the pipeline's ``loss_fn`` and a micro-batch's labels, the loss is
measured too, as the last stage runs it on the last layer's output: its
forward and backward time, and what it saves for its backward beyond its
input (a cross-entropy's log-probabilities: as large as the logits, which
for a large vocabulary is more than a transformer layer saves).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn
from deepspeed.pipe import LayerSpec, TiedLayerSpec

from ..checkpoint import checkpoint_region
from ..compat import require_checkpoint_hooks
from ..regions import Region, RegionFacts, modules_of
from ..selective import ops_to_keep
from ..settings import current_settings
from .problem import LayerProfile
from .partition import PartitionProblem
from .profile import LayerMeter, StorageLedger, synchronize, tensor_bytes

__all__ = ["LayerChainProfile", "profile_layer_specs", "spec_name", "TIMED_RUNS"]

TIMED_RUNS = 3  # plain forward + backward runs per layer after the warm-up; the least time is kept


@dataclass(frozen=True)
class LayerChainProfile:
    """The measured chain: one :class:`~.problem.LayerProfile` and one
    backward time per layer, and the bytes of the last layer's output."""

    layers: tuple[LayerProfile, ...]
    backward_s: tuple[float, ...]
    output_bytes: int
    loss_s: float = 0.0
    loss_saved_bytes: int = 0

    def partition_problem(self, stages: int, micro_batches: int, budget_bytes: Sequence[int],
                          extra_bytes: Sequence[int] = (), allow_selective: bool = True) -> PartitionProblem:
        """The stage-boundary problem of this chain (:class:`~.partition.PartitionProblem`)."""
        return PartitionProblem(layers=self.layers, backward_s=self.backward_s, output_bytes=self.output_bytes,
                                stages=stages, micro_batches=micro_batches, budget_bytes=tuple(budget_bytes),
                                extra_bytes=tuple(extra_bytes), allow_selective=allow_selective,
                                loss_s=self.loss_s, loss_saved_bytes=self.loss_saved_bytes)


def _as_inputs(value: Any) -> tuple:
    """A layer's output as the next layer's inputs: detached, floating-point
    tensors requiring grad (as a pipeline stage receives them)."""
    values = value if isinstance(value, tuple) else (value, )
    return tuple(v.detach().requires_grad_(v.is_floating_point()) if isinstance(v, torch.Tensor) else v
                 for v in values)


def _call(function: Callable[[Any], Any], inputs: tuple, packed: bool) -> Any:
    """Calls ``function`` as DeepSpeed's pipeline does: on the tuple, or on its only element."""
    return function(inputs if packed else inputs[0])


def _caller(function: Callable[[Any], Any], packed: bool) -> Callable[..., Any]:
    """``function`` on ``*args`` as :func:`_call` calls it, bound to this
    layer's ``function`` and ``packed`` now: the loop rebinds both for the next
    layer and deletes ``function``, so a closure over the loop's names would
    call another layer, or fail, if autograd ran it late."""
    return lambda *args: _call(function, args, packed)


def _backward(output: Any, generator: torch.Generator) -> bool:
    """Backward from every output that requires grad, with a seeded random
    gradient; False when none does."""
    tensors = [t for t in (output if isinstance(output, tuple) else (output, ))
               if isinstance(t, torch.Tensor) and t.requires_grad]
    if not tensors:
        return False
    grads = [torch.randn(t.shape, generator=generator, dtype=t.dtype).to(t.device) for t in tensors]
    torch.autograd.backward(tensors, grads)
    return True


def profile_layer_specs(specs: Sequence[Any], sample: Any, *, device: torch.device | str | None = None,
                        seed: int = 0, loss_fn: Callable[..., Any] | None = None,
                        labels: Any = None) -> LayerChainProfile:
    """Measure every layer of ``specs`` (a ``PipelineModule`` layer list) on
    ``sample`` (the first layer's input: a tensor or a tuple, as the data
    loader gives it to the first stage), one layer at a time on ``device``
    (default: the sample's), and ``loss_fn(output, labels)`` after the last
    layer when both are given. See the module docstring.

    Raises:
        ValueError: no layers, or a layer whose output does not require grad
            although it takes time to recompute (named), so that its backward
            and recomputation cannot be measured.
    """
    require_checkpoint_hooks("pipeline.partition_method", "planned")
    if not specs:
        raise ValueError("profile_layer_specs: no layers to profile")
    first = sample[0] if isinstance(sample, tuple) else sample
    device = torch.device(device) if device is not None else first.device
    generator = torch.Generator().manual_seed(seed)
    save_ops = frozenset(ops_to_keep(current_settings().config.save_ops))
    options = current_settings().options(use_reentrant=False, policy="full", early_stop=False)
    tied: dict[str, nn.Module] = {}
    packed = isinstance(sample, tuple)
    inputs = tuple(v.to(device) if isinstance(v, torch.Tensor) else v for v in (sample if packed else (sample, )))
    profiles: list[LayerProfile] = []
    backward_times: list[float] = []
    for index, spec in enumerate(specs):
        function = _build(spec, tied, device)
        name = f"layer {index} ({spec_name(spec)})"
        parameters = [p for m in modules_of(function) for p in m.parameters() if p.requires_grad]
        # Warm-up, then the timed plain runs: the least of TIMED_RUNS (noise only adds).
        _backward(_call(function, inputs, packed), generator)
        forward_s = backward_s = float("inf")
        for _ in range(TIMED_RUNS):
            synchronize(device)
            started = time.perf_counter()
            output = _call(function, inputs, packed)
            synchronize(device)
            forward_s = min(forward_s, time.perf_counter() - started)
            started = time.perf_counter()
            differentiable = _backward(output, generator)
            synchronize(device)
            backward_s = min(backward_s, time.perf_counter() - started) if differentiable else 0.0
        for p in parameters:
            p.grad = None
        # The measured checkpointed run.
        # Held whatever the plan: parameters and buffers. The input is not: it is the
        # previous layer's output, kept by this one where stored (the partition
        # takes that part out where a stage starts, as the engine holds it there).
        held = [*(p for m in modules_of(function) for p in m.parameters()),
                *(b for m in modules_of(function) for b in m.buffers())]
        meter = LayerMeter(name, StorageLedger(held), save_ops, device, first_layer=False)
        flat = tuple(inputs)
        region = Region(name, micro_batch=0, facts=RegionFacts(), modules=tuple(modules_of(function)))
        checkpointed = checkpoint_region(_caller(function, packed), flat, {}, region, options, observer=meter)
        _backward(checkpointed, generator)
        for p in parameters:
            p.grad = None
        if not meter.complete:
            raise ValueError(f"profile_layer_specs: {name}'s output does not reach a backward (nothing in it "
                             "requires grad), so its recomputation cannot be measured; a pipeline layer must "
                             "pass on a tensor that requires grad")
        profile = meter.profile()
        grads = sum(p.numel() * p.element_size() for p in parameters)
        profiles.append(LayerProfile(name=profile.name, input_bytes=profile.input_bytes,
                                     saved_bytes=profile.saved_bytes, forward_s=forward_s,
                                     selective_saved_bytes=profile.selective_saved_bytes,
                                     selective_recompute_s=(None if profile.selective_recompute_s is None else
                                                            forward_s * profile.selective_recompute_s
                                                            / max(profile.forward_s, 1e-12)),
                                     grad_bytes=grads, input_saved_bytes=profile.input_saved_bytes))
        backward_times.append(backward_s)
        packed = isinstance(output, tuple)
        inputs = _as_inputs(output)
        del output, checkpointed, function, meter
    loss_s, loss_saved = 0.0, 0
    if loss_fn is not None and labels is not None:
        loss_s, loss_saved = _profile_loss(loss_fn, inputs if packed else inputs[0], labels, device)
    return LayerChainProfile(layers=tuple(profiles), backward_s=tuple(backward_times),
                             output_bytes=tensor_bytes(inputs), loss_s=loss_s, loss_saved_bytes=loss_saved)


def _profile_loss(loss_fn: Callable[..., Any], output: Any, labels: Any, device: torch.device) -> tuple[float, int]:
    """The loss's forward + backward time (the least of TIMED_RUNS after a
    warm-up) and the bytes it saves for its backward beyond its input and
    labels.

    Raises:
        ValueError: the loss is not a tensor that requires grad.
    """
    packed = isinstance(labels, tuple)
    labels = tuple(v.to(device) if isinstance(v, torch.Tensor) else v for v in (labels if packed else (labels, )))
    inputs = (*(output if isinstance(output, tuple) else (output, )), *labels)
    labels = labels if packed else labels[0]
    ledger = StorageLedger([t for t in inputs if isinstance(t, torch.Tensor)])
    saved = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        saved += ledger.charge(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = loss_fn(output, labels)
    if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
        raise ValueError(f"profile_layer_specs: the loss function returned {type(loss).__name__}"
                         f"{'' if not isinstance(loss, torch.Tensor) else ' that does not require grad'}; "
                         "the pipeline's loss_fn must return a tensor to backward from")
    loss.backward()
    seconds = float("inf")
    for _ in range(TIMED_RUNS):
        synchronize(device)
        started = time.perf_counter()
        loss_fn(output, labels).backward()
        synchronize(device)
        seconds = min(seconds, time.perf_counter() - started)
    return seconds, saved


def _build(spec: Any, tied: dict[str, nn.Module], device: torch.device) -> Callable[[Any], Any]:
    """The layer as DeepSpeed's ``PipelineModule._build`` makes it, on ``device``."""
    if isinstance(spec, TiedLayerSpec):
        if spec.key not in tied:
            tied[spec.key] = spec.build().to(device)
        module = tied[spec.key]
        return module if spec.forward_fn is None else partial(spec.forward_fn, module)
    if isinstance(spec, LayerSpec):
        return spec.build().to(device)
    if isinstance(spec, nn.Module):
        return spec.to(device)
    return spec  # a callable (a lambda): no parameters


def spec_name(spec: Any) -> str:
    """A layer list entry's type name, as DeepSpeed prints it."""
    if isinstance(spec, LayerSpec):
        return spec.typename.__name__
    if isinstance(spec, nn.Module):
        return type(spec).__name__
    return getattr(spec, "__name__", type(spec).__name__)
