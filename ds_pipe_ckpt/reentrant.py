"""The reentrant mode: DeepSpeed's own ``deepspeed.checkpointing.checkpoint``,
with what it silently gets wrong made exact or loud.

DeepSpeed's reentrant checkpoint runs the region under ``no_grad``, keeps its
inputs, and recomputes it in backward with grad enabled. Around it,
:class:`ReentrantRegion`:

* returns the region's output with the structure the region returned (lists,
  dicts, nested tuples, named tuples: anything ``torch.utils._pytree`` knows)
  and a gradient path for every tensor in it. DeepSpeed itself turns a list
  into a tuple, drops the gradient path of tensors nested below the top level
  and returns a dict as the name of its first key; here the output is
  flattened into its tensors and other leaves before DeepSpeed sees it, and
  rebuilt after. An output object that pytree cannot see into but that holds
  tensors is refused (its tensors would come back without a gradient path);
* leaves module buffers as the forward left them: the recomputation starts
  from copies of the buffers the forward changes, as they were before it
  (:mod:`ds_pipe_ckpt.module_state`);
* refuses a forward that modifies an input in place (the recomputation would
  start from the modified values; the caller's graph would not know about the
  change either, because the forward ran without grad). Called with grad
  disabled (evaluation), nothing is recomputed and there is no graph, so such
  a forward runs as it would without checkpointing, as in DeepSpeed;
* refuses a recomputation whose input was modified in place after the forward:
  DeepSpeed keeps the input tensors themselves (its detached copies share
  their version counters), so without this check the recomputation would
  silently compute different gradients. When DeepSpeed stores copies
  (``partition_activations`` over a group of more than one rank, or
  ``cpu_checkpointing``) the floating-point inputs are copies and cannot be
  reached; the others are still checked;
* hands back each input's gradient in the layout the recomputed graph gave it
  (:func:`_keep_gradient_layout`), so the layers before the region reduce it
  in the same order as without checkpointing: bitwise the same gradients
  where DeepSpeed's (and torch's reentrant checkpoint) differ in the last bits.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .compat import require_deepspeed_reentrant
from .errors import InPlaceInputError
from .module_state import KeptBuffers, keep_buffers
from .recompute import mismatch, require_tensor_output
from .regions import Region
from .upstream_checkpointing import ORIGINAL_CHECKPOINT

__all__ = ["ReentrantRegion", "reentrant_checkpoint"]

_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.Size, torch.dtype, torch.device)


def _keep_gradient_layout(leaf: torch.Tensor) -> None:
    """Make ``leaf.grad`` the gradient the recomputed graph computed for it, in
    that gradient's own memory layout.

    ``leaf`` is DeepSpeed's detached copy of a region input; its backward hands
    ``leaf.grad`` on as the input's gradient. torch's ``AccumulateGrad`` lays a
    new ``.grad`` out like the leaf (contiguous), where the graph without
    checkpointing passes the gradient on as computed (e.g. the strided gradient
    of a later ``transpose``). Same values, but a reduction in the layers before
    the region (a bias gradient summed over batch and sequence) would add them in
    another order and differ in the last bits from no checkpointing."""
    computed: list[torch.Tensor] = []

    def remember(grad: torch.Tensor) -> None:
        computed[:] = [grad]

    def restore(tensor: torch.Tensor) -> None:
        if computed and tensor.grad is not None and tensor.grad.stride() != computed[0].stride():
            tensor.grad = computed[0]
        computed.clear()

    leaf.register_hook(remember)
    leaf.register_post_accumulate_grad_hook(restore)


def _holds_tensor(value: Any) -> bool:
    """Whether an object pytree treats as a leaf has tensors among its attributes."""
    if isinstance(value, _PLAIN):
        return False
    attributes = getattr(value, "__dict__", None)
    values = list(attributes.values()) if isinstance(attributes, dict) else []
    for slot in getattr(type(value), "__slots__", ()):
        values.append(getattr(value, slot, None))
    return any(isinstance(v, torch.Tensor) for v in values)


class ReentrantRegion:
    """The function handed to DeepSpeed's reentrant checkpoint for one region
    (see the module docstring): first call the forward, second the recomputation."""

    def __init__(self, fn: Callable[..., Any], region: Region, kwarg_names: tuple[str, ...], *,
                 inputs_are_copied: bool, buffers: KeptBuffers | None = None, for_backward: bool = True):
        self.fn = fn
        # Whether a backward may recompute the forward (grad was enabled at the call).
        self.for_backward = for_backward
        self.region = region
        self.kwarg_names = kwarg_names
        self.inputs_are_copied = inputs_are_copied
        self.buffers = buffers  # module buffers the forward changes (ds_pipe_ckpt.module_state)
        self.spec = None
        self.versions: list[int | None] = []

    def _run(self, args: tuple) -> Any:
        if not self.kwarg_names:
            return self.fn(*args)
        split = len(args) - len(self.kwarg_names)
        return self.fn(*args[:split], **dict(zip(self.kwarg_names, args[split:])))

    def _checked(self, tensor: torch.Tensor) -> bool:
        """Whether DeepSpeed hands the recomputation this tensor itself (not a copy)."""
        return not (self.inputs_are_copied and tensor.is_floating_point())

    def __call__(self, *args: Any) -> tuple:
        if self.spec is None:
            return self._forward(args)
        return self._recompute(args)

    def _forward(self, args: tuple) -> tuple:
        versions = [a._version if isinstance(a, torch.Tensor) else None for a in args]
        out = self._run(args) if self.buffers is None else self.buffers.run_forward(self._run, args)
        modified = [i for i, (a, v) in enumerate(zip(args, versions)) if v is not None and a._version != v]
        if modified and self.for_backward:
            raise InPlaceInputError(
                f"Checkpointed {self.region} modified its tensor input(s) {modified} in place during its "
                "forward. DeepSpeed's reentrant checkpoint runs the forward without grad, so the caller's "
                "graph would not see the change and the recomputation would start from the modified values. "
                "Use the non-reentrant mode (pipeline.use_reentrant=false, or checkpoint(..., "
                "use_reentrant=False)), which handles in-place inputs exactly, or make the op out-of-place "
                "(e.g. nn.ReLU(inplace=False)).")
        require_tensor_output(out, self.region)
        leaves, self.spec = tree_flatten(out)
        opaque = [type(leaf).__name__ for leaf in leaves if not isinstance(leaf, torch.Tensor) and _holds_tensor(leaf)]
        if opaque:
            raise TypeError(
                f"Checkpointed {self.region} returned a {opaque[0]} holding tensors, which DeepSpeed's reentrant "
                "checkpoint cannot see into: its tensors would have no gradient path. Return tensors in "
                "tuples, lists, dicts or named tuples, register the class with torch.utils._pytree, or use "
                "use_reentrant=False.")
        self.versions = [a._version if isinstance(a, torch.Tensor) and self._checked(a) else None for a in args]
        return tuple(leaves)

    def _recompute(self, args: tuple) -> tuple:
        for i, (arg, version) in enumerate(zip(args, self.versions)):
            if version is not None and arg._version != version:
                raise InPlaceInputError(
                    f"The input {i} of checkpointed {self.region} was modified in place after its forward "
                    f"(version {version} -> {arg._version}), before it was recomputed; the recomputation "
                    "would see different values and compute wrong gradients. Typically a later layer "
                    "changes, in place, a tensor this region received (or returned). Make that op "
                    "out-of-place (e.g. inplace=False, x = x + y instead of x += y) or clone the tensor first.")
        for arg in args:
            if isinstance(arg, torch.Tensor) and arg.requires_grad and arg.is_leaf and arg.grad is None:
                _keep_gradient_layout(arg)
        buffers = self.buffers
        live = buffers.swap_in() if buffers is not None else None
        try:
            out = self._run(args)
        finally:
            if live is not None:
                buffers.swap_out(live)
        leaves, spec = tree_flatten(out)
        if spec != self.spec:
            raise mismatch(self.region, f"it returned {spec} where the forward returned {self.spec}.")
        return tuple(leaves)

    def rebuild(self, result: Any) -> Any:
        """DeepSpeed's return value (one leaf, or a tuple of them) in the region's structure."""
        leaves = list(result) if self.spec.num_leaves != 1 else [result]
        return tree_unflatten(leaves, self.spec)


def reentrant_checkpoint(function: Callable[..., Any], args: tuple, kwarg_names: tuple[str, ...], region: Region,
                         *, inputs_are_copied: bool) -> Any:
    """``deepspeed.checkpointing.checkpoint`` of ``function`` (see the module docstring);
    ``args`` ends with the values of the keyword arguments named ``kwarg_names``."""
    require_deepspeed_reentrant()
    for_backward = torch.is_grad_enabled()
    buffers = keep_buffers(region, function) if for_backward else None
    wrapped = ReentrantRegion(function, region, kwarg_names, inputs_are_copied=inputs_are_copied, buffers=buffers,
                              for_backward=for_backward)
    return wrapped.rebuild(ORIGINAL_CHECKPOINT(wrapped, *args))
