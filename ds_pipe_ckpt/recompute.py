"""Recompute safety: a checkpointed region whose recomputation diverges from
its forward fails with an error that names the region, the micro-batch and,
where known, the op; never with silently different gradients.

Two levels:

* always on, with no per-op cost: the autograd graph a region builds (the
  sequence of backward nodes from its outputs back to its inputs, e.g.
  ``AddmmBackward0, TanhBackward0``) is recorded at the end of its forward and
  compared with the graph its recomputation builds. Recomputations run to the
  end (torch's early stop is off), so shorter paths, longer paths and different
  ops all show up, and the first differing node is named. Any
  ``CheckpointError`` torch raises while recomputing is re-raised naming the
  region; a region that modifies its own inputs in place is refused at forward
  time, and one whose saved input is modified in place later, before its
  recomputation, is refused then.
* ``activation_checkpointing.verify_recompute`` (or ``verify=True``): every op
  (also those that build no backward node) is recorded with its output shapes,
  dtypes and devices by a ``TorchDispatchMode`` and the recomputation is
  compared op by op. It costs a Python call per op.

Neither compares values: an op that returns different numbers with the same
shapes on recomputation (randomness outside torch's and DeepSpeed's generators)
cannot be seen without recomputing twice.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .errors import InPlaceInputError, RecomputeMismatchError

__all__ = ["Region", "RecomputeGuard", "CheckInputsUnmodified", "InputVersionCheck", "graph_signature"]

CAUSES = (
    "Usual causes: an op whose saved tensors depend on torch.is_grad_enabled() or on "
    "requires_grad (fused kernels, e.g. xformers SwiGLU); global state or caches filled on the "
    "first call (lazy init, memoised masks or rotary tables); data-dependent shapes or control "
    "flow; randomness that does not come from torch's generators or DeepSpeed's model-parallel "
    "RNG tracker.")
FIXES = (
    "Fixes: exclude the layer from checkpointing with PipelineModule(checkpointable_layers=[...]) "
    "(or do not wrap it in checkpoint()); make the op deterministic between calls; to find the "
    "op, set \"activation_checkpointing\": {\"verify_recompute\": true} (or checkpoint(..., "
    "verify=True)), and \"debug\": true for torch's op traces with stacks.")


@dataclass(frozen=True)
class Region:
    """What is checkpointed, for messages: a pipeline segment or a function."""

    name: str
    micro_batch: int | None = None

    def __str__(self) -> str:
        where = f" in micro-batch {self.micro_batch}" if self.micro_batch is not None else ""
        return f"{self.name}{where}"


def mismatch(region: Region, problem: str) -> RecomputeMismatchError:
    return RecomputeMismatchError(
        f"Recomputation of checkpointed {region} diverged from its forward: {problem}\n{CAUSES}\n{FIXES}")


@functools.lru_cache(maxsize=None)
def _saved_attributes(node_type: type) -> tuple[str, ...]:
    # Nodes expose what they saved as ``_raw_saved_<name>`` (a SavedTensor, None or a
    # sequence of them; ``_raw_saved_tensors`` for custom Functions). Reading them
    # does not unpack: no recomputation, no memory.
    return tuple(name for name in dir(node_type) if name.startswith("_raw_saved_"))


def _saved_count(node: Any) -> int:
    count = 0
    for name in _saved_attributes(type(node)):
        value = getattr(node, name)
        if isinstance(value, (tuple, list)):
            count += sum(v is not None for v in value)
        elif value is not None:
            count += 1
    return count


def graph_signature(outputs: Any, inputs: list) -> list[tuple[str, int]]:
    """(name, number of saved tensors) of each autograd node between ``outputs``
    and ``inputs``, depth first in ``next_functions`` order (deterministic for the
    same computation)."""
    stop = {t.grad_fn for t in inputs if t.grad_fn is not None}
    stack = [t.grad_fn for t in reversed(tree_leaves(outputs))
             if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    seen, signature = set(), []
    while stack:
        node = stack.pop()
        if node in seen or node in stop:
            continue
        seen.add(node)
        signature.append((node.name(), _saved_count(node)))
        stack.extend(n for n, _ in reversed(node.next_functions) if n is not None)
    return signature


def _node(signature: list, i: int, path: str) -> str:
    if i >= len(signature):
        return f"nothing (a {path} path)"
    name, saved = signature[i]
    return f"{name} saving {saved} tensor{'s' if saved != 1 else ''}"


def _first_difference(forward: list, recomputed: list) -> int:
    for i, (a, b) in enumerate(zip(forward, recomputed)):
        if a != b:
            return i
    return min(len(forward), len(recomputed))


def _tensor_meta(out: Any) -> tuple:
    return tuple((tuple(t.shape), t.dtype, t.device) for t in tree_leaves(out) if isinstance(t, torch.Tensor))


def _describe(op: tuple | None) -> str:
    if op is None:
        return "nothing"
    name, meta = op
    outputs = ", ".join(f"{list(shape)} {str(dtype).replace('torch.', '')} on {device}"
                        for shape, dtype, device in meta) or "no tensor"
    return f"{name} -> {outputs}"


# torch's checkpoint detaches tensors it saves during recomputation (not during
# the forward); those detaches are its own, not the region's.
_IGNORED_OPS = frozenset({torch.ops.aten.detach.default})


class OpTrace(TorchDispatchMode):
    """Records a forward's op sequence, then checks a recomputation against it."""

    def __init__(self, region: Region):
        super().__init__()
        self.region = region
        self.recorded: list[tuple] = []
        self.position: int | None = None  # None while recording

    @contextlib.contextmanager
    def replaying(self) -> Iterator[None]:
        self.position = 0
        with self:
            yield
        if self.position < len(self.recorded):
            raise mismatch(self.region, (
                f"it ran {self.position} ops where the forward ran {len(self.recorded)} (a shorter path); "
                f"first op not reproduced: #{self.position} {_describe(self.recorded[self.position])}."))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _IGNORED_OPS:
            return out
        op = (str(func), _tensor_meta(out))
        if self.position is None:
            self.recorded.append(op)
            return out
        expected = self.recorded[self.position] if self.position < len(self.recorded) else None
        if op != expected:
            extra = " (a longer path)" if expected is None else ""
            raise mismatch(self.region, (
                f"op #{self.position} differs{extra}: forward ran {_describe(expected)}, "
                f"recomputation ran {_describe(op)}."))
        self.position += 1
        return out


def check_inputs_unmodified(inputs: list, versions: list, region: Region) -> None:
    """Refuse a region that bumped the version counter of one of its inputs."""
    modified = [i for i, (t, v) in enumerate(zip(inputs, versions)) if t._version != v]
    if modified:
        raise InPlaceInputError(
            f"Checkpointed {region} modified its tensor input(s) {modified} in place during its "
            "forward; the recomputation would start from the modified values and compute different "
            "gradients. Make the first op of the region out-of-place (e.g. nn.ReLU(inplace=False)), "
            "or start the checkpointed region after it (exclude the layer with "
            "checkpointable_layers, or change activation_checkpoint_interval).")


def require_tensor_output(out: Any, region: Region) -> None:
    """Refuse a region that returns no tensor: nothing could flow back through it."""
    if not any(isinstance(t, torch.Tensor) for t in tree_leaves(out)):
        raise TypeError(f"Checkpointed {region} returned no tensor ({type(out).__name__}): there is "
                        "nothing to recompute and no gradient can flow through it. Call it without "
                        "checkpointing, or return the tensors it computes.")


class InputVersionCheck(torch.autograd.graph.saved_tensors_hooks):
    """Around one torch checkpoint call: the inputs torch saves for the
    recomputation (only those: inside the region torch's own hooks take over)
    are kept with their version counters, and the recomputation refuses an input
    that was modified in place after the forward, naming the region."""

    def __init__(self, region: Region):
        def pack(tensor: torch.Tensor) -> tuple:
            return tensor, tensor._version

        def unpack(packed: tuple) -> torch.Tensor:
            tensor, version = packed
            if tensor._version != version:
                raise InPlaceInputError(
                    f"The input of checkpointed {region} was modified in place after its forward "
                    f"(version {version} -> {tensor._version}), before it was recomputed; the "
                    "recomputation would see different values. Typically a later layer changes, in "
                    "place, a tensor this region received and passed on. Make that op out-of-place "
                    "(e.g. inplace=False, x = x + y instead of x += y) or clone the tensor first.")
            return tensor

        super().__init__(pack, unpack)


class CheckInputsUnmodified:
    """Wraps a function for DeepSpeed's reentrant checkpoint: its forward
    (under no_grad) must not modify the inputs it will be recomputed from."""

    def __init__(self, fn: Callable[..., Any], region: Region):
        self.fn = fn
        self.region = region

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        inputs = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
        versions = [t._version for t in inputs]
        out = self.fn(*args, **kwargs)
        check_inputs_unmodified(inputs, versions, self.region)
        require_tensor_output(out, self.region)
        return out


class RecomputeGuard:
    """Wraps the function handed to torch's checkpoint. The first call is the
    forward; every later call is a recomputation.

    ``early_stop=False`` (default): the recomputation runs to the end and its
    autograd graph must equal the forward's. ``early_stop=True``: torch stops the
    recomputation once every saved tensor is rebuilt, so only a recomputation
    that *finishes* (it saved fewer tensors: a shorter path) is caught here, plus
    torch's own checks; a longer path whose first tensors have the right shapes
    goes unseen. That is the trade ``activation_checkpointing.early_stop`` makes.
    """

    def __init__(self, fn: Callable[..., Any], region: Region, *, verify: bool, early_stop: bool):
        self.fn = fn
        self.region = region
        self.trace = OpTrace(region) if verify else None
        self.compare_graphs = not early_stop
        self.early_stop = early_stop
        self.forward_done = False
        self.forward_graph: list = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        inputs = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
        if not self.forward_done:
            self.forward_done = True
            return self._forward(args, kwargs, inputs)
        return self._recompute(args, kwargs, inputs)

    def _forward(self, args: tuple, kwargs: dict, inputs: list) -> Any:
        versions = [t._version for t in inputs]
        with self.trace if self.trace is not None else contextlib.nullcontext():
            out = self.fn(*args, **kwargs)
        require_tensor_output(out, self.region)
        if not torch.is_grad_enabled():  # torch does not checkpoint then: nothing to recompute
            return out
        check_inputs_unmodified(inputs, versions, self.region)
        if self.compare_graphs:
            self.forward_graph = graph_signature(out, inputs)
        return out

    def _recompute(self, args: tuple, kwargs: dict, inputs: list) -> Any:
        replay = self.trace.replaying() if self.trace is not None else contextlib.nullcontext()
        try:
            with replay:
                out = self.fn(*args, **kwargs)
        except RecomputeMismatchError:
            raise
        except torch_checkpoint.CheckpointError as err:
            problem = str(err).split("\n")[0].removeprefix("torch.utils.checkpoint: ")
            raise mismatch(self.region, problem) from err
        if self.early_stop:
            # torch stops a recomputation as soon as it has rebuilt every tensor the
            # forward saved; finishing means it saved fewer.
            raise mismatch(self.region, "the recomputation finished having saved fewer tensors than the "
                                        "forward (a shorter path).")
        if self.compare_graphs:
            graph = graph_signature(out, inputs)
            if graph != self.forward_graph:
                i = _first_difference(self.forward_graph, graph)
                raise mismatch(self.region, (
                    f"autograd node #{i} differs: the forward built {_node(self.forward_graph, i, 'longer')}, "
                    f"the recomputation built {_node(graph, i, 'shorter')} "
                    f"({len(self.forward_graph)} vs {len(graph)} nodes; "
                    f"{sum(n for _, n in self.forward_graph)} vs {sum(n for _, n in graph)} saved tensors)."))
        return out
