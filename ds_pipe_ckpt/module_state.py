"""Module state across recomputation: a recomputation leaves every buffer of
the modules it runs exactly as the forward left it.

A recomputation is a second forward, and a forward that updates module state
in place updates it twice: BatchNorm's ``running_mean``, ``running_var`` and
``num_batches_tracked``, a call counter, an exponential moving average. Losses
and gradients still match, so nothing fails; the statistics used in
evaluation and saved in every checkpoint are not those of the same training
without checkpointing. torch's checkpoint (both modes) and DeepSpeed's do
this (pytorch issue 96136).

Here, per region:

* **Learning.** A region's first checkpointed call with grad enabled (and its
  first call under each combination of its modules' ``training`` flags) notes
  every buffer of the modules it runs, with a copy of its values: the modules
  the callable is made of (a module, the module behind a bound method or a
  ``functools.partial``, modules captured by a closure) and every module
  called during that forward (through a global forward pre-hook that exists
  for that call only). After the forward, a buffer has changed if its
  module's entry holds another tensor, its version counter moved, or its
  values differ. Version counters alone are not enough: BatchNorm's kernels
  update the running statistics without bumping them.
* **Every forward** of a region whose forward changes buffers keeps a copy of
  those buffers as they were before it ran (BatchNorm: three small tensors per
  layer and micro-batch in flight), in :class:`KeptBuffers`.
* **The recomputation** runs with each such buffer replaced, in its module's
  ``_buffers``, by a copy of the kept values: it starts from exactly what the
  forward saw (so a forward that reads what it updates recomputes the same
  tensors) and its updates land on the copy. The module's own buffer, which
  later forwards of other micro-batches may have moved on since, is put back
  untouched: the same tensor object, values and version.

A region whose modules own no buffers pays one attribute test per call after
its first; one whose buffers the forward leaves alone (a causal mask, a rotary
table) reads its buffer-owning modules' ``training`` flags.

What this cannot see (docs/troubleshooting.md says what to do): state that is
not a registered buffer (a Python attribute, a plain tensor attribute, a
global); a buffer of a module that is neither part of the callable nor called
during the forward; a buffer that a forward starts changing only on a later
call under the same ``training`` flags.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn
from torch.nn.modules.module import register_module_forward_pre_hook

from .regions import BufferFacts, Region, modules_of

__all__ = ["KeptBuffers", "keep_buffers"]

class KeptBuffers:
    """The buffers one forward of a region changes, as they were before it ran
    (see the module docstring), and the swap around its recomputation."""

    __slots__ = ("_entries", "_learning")

    def __init__(self, entries: list[tuple[nn.Module, str, torch.Tensor]], learning: "_Learning | None" = None):
        self._entries = entries  # (module, buffer name, values before the forward)
        self._learning = learning

    def __bool__(self) -> bool:
        return bool(self._entries) or self._learning is not None

    def run_forward(self, run: Callable[[tuple], Any], args: tuple) -> Any:
        """``run(args)``: the region's forward (learning what it changes, if
        this call learns)."""
        learning, self._learning = self._learning, None
        if learning is None:
            return run(args)
        learning.start()
        try:
            out = run(args)
        finally:
            learning.stop()
        self._entries = learning.finish()
        return out

    def swap_in(self) -> list[torch.Tensor | None]:
        """Give each module a copy of its kept buffers for a recomputation;
        returns the module's own buffers, for :meth:`swap_out`. A copy, not the
        kept tensor: a second recomputation (``retain_graph``) starts from the
        same values."""
        live = []
        for module, name, kept in self._entries:
            buffers = module._buffers
            live.append(buffers.get(name))
            buffers[name] = kept.clone()
        return live

    def swap_out(self, live: list[torch.Tensor | None]) -> None:
        """Put the modules' own buffers back after a recomputation."""
        for (module, name, _), tensor in zip(self._entries, live):
            module._buffers[name] = tensor


def keep_buffers(region: Region, function: Callable[..., Any]) -> KeptBuffers | None:
    """What one forward of ``region`` (running ``function``) must keep for its
    recomputation to leave module buffers alone; None when it keeps nothing.
    Call it right before the forward, with grad enabled."""
    facts = region.facts.buffers
    owners = facts.owners
    if owners is not None:
        if not owners:  # no buffer among the region's modules: the common case
            return None
        modules = [ref() for ref in owners]
        if None not in modules:
            changed = facts.changed_buffers(modules)
            if changed is not None:
                if not changed:
                    return None
                return KeptBuffers([(module, name, module._buffers[name].detach().clone())
                                    for module, name in changed if module._buffers.get(name) is not None])
    modules = region.modules if region.modules is not None else modules_of(function)
    return KeptBuffers([], _Learning(facts, modules))


class _Learning:
    """One forward that learns which buffers it changes (see the module docstring)."""

    __slots__ = ("_facts", "_seen", "_notes", "_handle")

    def __init__(self, facts: BufferFacts, modules: Sequence[nn.Module]):
        self._facts = facts
        self._seen: set[int] = set()
        # (module, name, tensor, version, values) for every buffer of a module the forward runs
        self._notes: list[tuple[nn.Module, str, torch.Tensor, int, torch.Tensor]] = []
        self._handle = None
        for module in modules:
            self._note(module)

    def _note(self, module: nn.Module, *_: Any) -> None:
        for submodule in module.modules():
            if id(submodule) in self._seen:
                continue
            self._seen.add(id(submodule))
            for name, tensor in submodule._buffers.items():
                if tensor is not None:
                    self._notes.append((submodule, name, tensor, tensor._version, tensor.detach().clone()))

    def start(self) -> None:
        self._handle = register_module_forward_pre_hook(self._note)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def finish(self) -> list[tuple[nn.Module, str, torch.Tensor]]:
        """Record what the forward changed in the facts; return the kept
        values of the changed buffers (for this call's recomputation)."""
        owners: dict[int, int] = {}
        modules: list[nn.Module] = []
        changes: list[tuple[int, str]] = []
        kept = []
        for module, name, tensor, version, before in self._notes:
            if id(module) not in owners:
                owners[id(module)] = len(modules)
                modules.append(module)
            now = module._buffers.get(name)
            if now is tensor and now._version == version and _same_values(now, before):
                continue
            changes.append((owners[id(module)], name))
            kept.append((module, name, before))
        facts = self._facts
        old = [ref() for ref in facts.owners] if facts.owners is not None else None
        if old is None or len(old) != len(modules) or any(a is not b for a, b in zip(old, modules)):
            # Another set of modules than the last learned call ran (or one died): start afresh.
            facts.owners = tuple(weakref.ref(module) for module in modules)
            facts.changed = {}
        facts.changed[tuple(module.training for module in modules)] = tuple(changes)
        return kept


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (a NaN equals a NaN in the same place)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point() or a.is_complex():
        return bool(torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num()))
    return bool(torch.equal(a, b))
