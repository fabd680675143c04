"""What the planner needs to know about each layer of a stage, measured on
the stage's first training micro-batch.

That micro-batch runs every local layer as its own checkpointed region (the
memory-safe choice while nothing is known) and, through the region's
observer hook (:class:`~ds_pipe_ckpt.region_call.RegionCall`), a
:class:`LayerMeter` per layer measures:

* in the forward: the bytes of the layer's tensor inputs, the bytes autograd
  saves for its backward (what it would keep without checkpointing: each
  storage counted once per stage, parameters and the stage input, which are
  held anyway, not at all), its forward time, and the most its forward holds
  at once as a stored layer runs it: the saved tensors are kept until the
  forward ends, and the step's memory tracker, marked before and after it
  (``marker``), gives the peak in between (:meth:`LayerMeter.read_forward_peak`);
* in the recomputation (run to the end, op by op through a dispatch mode): the
  bytes of the outputs selective checkpointing would keep (the save set of
  :mod:`ds_pipe_ckpt.selective`) and the share of the layer's op time those ops
  take, which selective checkpointing does not recompute; and whether the
  backward running it keeps the graph (``retain_graph=True``: DeepSpeed's
  engine does so for a stage that sends several floating-point tensors), in
  which case stored activations are not freed until the micro-batch's
  backward ends.

On CUDA every timing is bracketed by device synchronisations (this
micro-batch only).
"""

from __future__ import annotations

import time
import weakref
from typing import Any, Callable, Iterable

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..compat import backward_keeps_graph
from ..hooks import TransparentHooks, top_hooks
from .problem import LayerProfile

__all__ = ["LayerMeter", "StorageLedger", "backward_keeps_graph", "synchronize", "tensor_bytes"]


def _keep(tensor: Any) -> Any:
    return tensor


def synchronize(device: torch.device) -> None:
    """Waits for the device's queued work (CUDA), so that a timing covers it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def tensor_bytes(values: Iterable[Any]) -> int:
    """Bytes of the distinct storages of the tensors among ``values``."""
    seen, total = set(), 0
    for value in values:
        if isinstance(value, torch.Tensor):
            storage = value.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


class StorageLedger:
    """The storages already accounted for on a stage: each saved storage is
    charged to the first layer that saves it.

    A storage is recognised by its address only while a tensor charged for it
    is alive: inside checkpointed regions intermediate tensors are freed as
    soon as they are used, and their addresses are reused by later ones. A
    view is remembered by its base, which owns the storage: a linear layer
    saves a temporary view (``x.view(-1, d)``) of its input, which a
    checkpoint does not keep; the next linear on the same input (Llama's q, k
    and v projections) saves another view of the same storage, which stays
    alive and must not be charged again.
    """

    def __init__(self, held: Iterable[torch.Tensor] = ()):
        self._alive: dict[int, list[weakref.ref]] = {}
        for tensor in held:
            self._remember(tensor)

    def _remember(self, tensor: torch.Tensor) -> None:
        owner = tensor if tensor._base is None else tensor._base
        self._alive.setdefault(tensor.untyped_storage().data_ptr(), []).append(weakref.ref(owner))

    def _known(self, address: int) -> bool:
        refs = self._alive.get(address)
        if not refs:
            return False
        refs[:] = [ref for ref in refs if ref() is not None and ref().untyped_storage().data_ptr() == address]
        return bool(refs)

    def charge(self, tensor: torch.Tensor) -> int:
        """Bytes ``tensor`` adds: its storage's, the first time it is seen; 0 for
        parameters (always held) and storages already charged."""
        if isinstance(tensor, nn.Parameter):
            return 0
        storage = tensor.untyped_storage()
        known = self._known(storage.data_ptr())
        self._remember(tensor)
        return 0 if known else storage.nbytes()


class _OpMeter(TorchDispatchMode):
    """Times every op and adds up the output bytes of those in the save set."""

    def __init__(self, save_ops: frozenset, device: torch.device):
        super().__init__()
        self.save_ops = save_ops
        self.device = device
        self.total_s = 0.0
        self.saved_s = 0.0
        self.saved_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        synchronize(self.device)
        started = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        synchronize(self.device)
        elapsed = time.perf_counter() - started
        self.total_s += elapsed
        if func in self.save_ops:
            self.saved_s += elapsed
            self.saved_bytes += tensor_bytes(tree_leaves(out))
        return out


class LayerMeter:
    """The observer of one layer's region on the measurement micro-batch."""

    def __init__(self, name: str, ledger: StorageLedger, save_ops: frozenset, device: torch.device,
                 first_layer: bool, checkpointable: bool = True,
                 before_recomputation: Callable[[], None] | None = None,
                 marker: Callable[[str], None] | None = None):
        self.name = name
        # A layer the pipeline may not checkpoint runs plainly (it is always stored):
        # only its forward is measured.
        self.checkpointable = checkpointable
        self.ledger = ledger
        self.save_ops = save_ops
        self.device = device
        self.first_layer = first_layer
        self.input_bytes: int | None = None
        self.saved_bytes = 0
        self.saved_tensors = 0  # what autograd saved, counted (storages seen before included)
        self.input_saved_bytes = 0  # of saved_bytes, the layer's own input
        self.forward_s: float | None = None
        self.selective_saved_bytes: int | None = None
        self.selective_share: float | None = None  # of the op time, spent in save-set ops
        self.backward_keeps_graph: bool | None = None  # None: not seen (or this torch cannot tell)
        self.before_recomputation = before_recomputation  # called as the recomputation begins
        # Marks the memory tracker of the measured pass (None: nothing tracks it, e.g. another profiler).
        self.marker = marker
        self.forward_peak_bytes: int | None = None  # see read_forward_peak

    @property
    def _forward_marks(self) -> tuple[str, str]:
        return f"ds_pipe_ckpt: {self.name} forward begins", f"ds_pipe_ckpt: {self.name} forward ends"

    def read_forward_peak(self, marks: dict[str, int], interval_peaks: dict[str, int]) -> None:
        """The most the forward held at once (:attr:`~.problem.LayerProfile.forward_peak_bytes`),
        from the tracker's report of the pass whose forward ``marker`` marked
        (its ``marks`` and ``interval_peaks``): its input (not the stage's)
        and the peak between the two marks above the first. Left None where
        the marks are not in the report."""
        begins, ends = self._forward_marks
        if begins in marks and ends in interval_peaks and self.input_bytes is not None:
            self.forward_peak_bytes = self.input_bytes + max(0, interval_peaks[ends] - marks[begins])

    @property
    def complete(self) -> bool:
        return self.forward_s is not None and (self.selective_share is not None or not self.checkpointable
                                               or self.saves_nothing)

    @property
    def saves_nothing(self) -> bool:
        """The forward saved no tensor for backward (a mean, a reshape, a sum):
        torch never recomputes such a region, and storing it costs nothing."""
        return self.forward_s is not None and self.saved_tensors == 0

    def forward(self, run: Callable[[tuple], Any], args: tuple) -> Any:
        # The stage input is held by the engine whatever the plan: a checkpoint
        # starting at the first layer keeps nothing more.
        self.input_bytes = 0 if self.first_layer else tensor_bytes(args)
        # In a checkpointed region, stand in front of torch's hooks; a plain layer's
        # saved tensors are kept as they are.
        pack_inner, unpack_inner = top_hooks() or (_keep, _keep)
        ledger = self.ledger
        input_storages = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}

        kept = []  # the saved tensors, alive until the forward ends, as a stored layer keeps them

        def pack(tensor: torch.Tensor) -> Any:
            self.saved_tensors += 1
            kept.append(tensor)
            charged = ledger.charge(tensor)
            self.saved_bytes += charged
            if tensor.untyped_storage().data_ptr() in input_storages:
                self.input_saved_bytes += charged
            return pack_inner(tensor)

        begins, ends = self._forward_marks
        if self.marker is not None:
            self.marker(begins)
        synchronize(self.device)
        started = time.perf_counter()
        with TransparentHooks(pack, unpack_inner):
            out = run(args)
        synchronize(self.device)
        self.forward_s = time.perf_counter() - started
        if self.marker is not None:
            self.marker(ends)
        kept.clear()
        return out

    def recomputation(self, run: Callable[[tuple], Any], args: tuple) -> Any:
        if self.selective_share is not None:  # a second backward: measured already
            return run(args)
        self.backward_keeps_graph = backward_keeps_graph()
        if self.before_recomputation is not None:
            self.before_recomputation()
        meter = _OpMeter(self.save_ops, self.device)
        with meter:
            out = run(args)
        self.selective_saved_bytes = meter.saved_bytes
        self.selective_share = meter.saved_s / meter.total_s if meter.total_s > 0 else 0.0
        return out

    def profile(self, input_bytes_scale: float = 1.0) -> LayerProfile:
        """The measurements as the solver's :class:`LayerProfile`. ``input_bytes_scale``
        is the fraction of a checkpointed input kept on the device (1/mp with
        ``partition_activations``, 0 with ``cpu_checkpointing``)."""
        if not self.complete:
            raise RuntimeError(f"ds_pipe_ckpt: layer {self.name} was not measured completely")
        input_bytes = int(round(self.input_bytes * input_bytes_scale))
        forward_peak = self.forward_peak_bytes or 0
        # The recomputation reuses the held input: only as much of it as is held.
        input_saved = min(self.input_saved_bytes, input_bytes)
        if not self.checkpointable:
            return LayerProfile(name=self.name, input_bytes=input_bytes, saved_bytes=self.saved_bytes,
                                forward_s=self.forward_s, checkpointable=False, input_saved_bytes=input_saved,
                                forward_peak_bytes=forward_peak)
        if self.saves_nothing:  # never recomputed: checkpointed or selective, it keeps nothing and costs nothing
            return LayerProfile(name=self.name, input_bytes=input_bytes, input_saved_bytes=0, saved_bytes=0,
                                forward_s=self.forward_s, selective_saved_bytes=0, selective_recompute_s=0.0,
                                forward_peak_bytes=forward_peak)
        # Selective checkpointing keeps the outputs of the save-set ops whether or
        # not autograd would have: where that is more than the layer saves without
        # checkpointing, it is never better than storing the layer; leave it out.
        selective = self.selective_saved_bytes <= self.saved_bytes
        return LayerProfile(name=self.name,
                            input_bytes=input_bytes,
                            input_saved_bytes=input_saved,
                            saved_bytes=self.saved_bytes,
                            forward_s=self.forward_s,
                            selective_saved_bytes=self.selective_saved_bytes if selective else None,
                            selective_recompute_s=self.forward_s * (1.0 - self.selective_share) if selective else None,
                            forward_peak_bytes=forward_peak)
