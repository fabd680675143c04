"""What a checkpointed region is: its name in messages, and what was learned
about it on its first call.

A region is a pipeline segment (named by its layers) or the function given to
:func:`ds_pipe_ckpt.checkpoint` (named by what the user wrote: a module by its
class, a bound method or a ``functools.partial`` of one by
``Class.method``). Facts learned on a region's first call (:class:`RegionFacts`:
whether its forward modifies an input in place, which module buffers it
changes, whether it saves anything for backward beyond its inputs and
parameters) are kept per region so that
later calls act on them: a pipeline module keeps them per segment, and
:class:`RegionRegistry` keeps one :class:`Region` per function, keyed by what
the function *is* (the same module, the same method of the same object, the
same code with the same captured objects) rather than by the callable object,
which callers such as transformers create anew on every call.
"""

from __future__ import annotations

import collections
import functools
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

import torch.nn as nn

__all__ = ["BufferFacts", "Region", "RegionFacts", "RegionRegistry", "describe_callable", "modules_of", "region_key"]


_Change = tuple[int, str]  # (index into BufferFacts.owners, buffer name)


class BufferFacts:
    """What a region's forward does to the buffers of the modules it runs.

    ``owners`` is None until a call has been learned, then weak references to
    the modules that own buffers (in the order first seen); ``changed`` maps
    the owners' ``training`` flags to the ``(owner, buffer name)`` pairs a
    forward under those flags changes.
    """

    __slots__ = ("owners", "changed")

    def __init__(self) -> None:
        self.owners: tuple[weakref.ref, ...] | None = None
        self.changed: dict[tuple[bool, ...], tuple[_Change, ...]] = {}

    def changed_buffers(self, modules: list[nn.Module]) -> list[tuple[nn.Module, str]] | None:
        """The ``(module, buffer name)`` pairs of ``owners`` (alive, as
        ``modules``) named in ``changed`` for their current ``training`` flags,
        or None when that combination has not been learned yet."""
        changes = self.changed.get(tuple(module.training for module in modules))
        if changes is None:
            return None
        return [(modules[owner], name) for owner, name in changes]


@dataclass
class RegionFacts:
    """What a region's first call showed.

    ``mutated_inputs`` is ``None`` until a call has been checkpointed (with grad
    enabled), then the positions of the tensor inputs that the region's forward
    modified in place (empty when it modifies none). ``buffers``: which module
    buffers its forward changes (:mod:`ds_pipe_ckpt.module_state`).
    ``saves_only_inputs`` is ``None`` until a checkpointed call's saved tensors
    have been seen, then whether every tensor its forward saved for backward
    was (a view of) one of its inputs or of its modules' parameters: run
    plainly, such a region keeps exactly what checkpointing keeps, so
    checkpointing it frees nothing and only adds a recomputation
    (:class:`~ds_pipe_ckpt.saved_inputs.SavedTensorLearner`).
    """

    mutated_inputs: frozenset[int] | None = None
    buffers: BufferFacts = field(default_factory=BufferFacts)
    saves_only_inputs: bool | None = None

    @property
    def learned(self) -> bool:
        return self.mutated_inputs is not None

    @property
    def mutates_inputs(self) -> bool:
        return bool(self.mutated_inputs)


class Region:
    """A checkpointed region, for messages and for what is learned about it.

    ``name`` is a string, or the checkpointed callable itself, described (by
    :func:`describe_callable`) only when a message needs it: a pipeline module
    creates a region on every checkpointed call. ``modules``: the modules the
    region is made of, where its callable does not show them (a pipeline
    segment's layers); None: found from the callable (:func:`modules_of`).
    """

    __slots__ = ("_name", "micro_batch", "facts", "modules")

    def __init__(self, name: str | Callable[..., Any], micro_batch: int | None = None,
                 facts: RegionFacts | None = None, modules: tuple[nn.Module, ...] | None = None):
        self._name = name
        self.micro_batch = micro_batch
        self.facts = facts if facts is not None else RegionFacts()
        self.modules = modules

    @property
    def name(self) -> str:
        name = self._name
        return name if isinstance(name, str) else f"function {describe_callable(name)}"

    def __str__(self) -> str:
        where = f" in micro-batch {self.micro_batch}" if self.micro_batch is not None else ""
        return f"{self.name}{where}"

    def __repr__(self) -> str:
        return f"Region({str(self)!r})"


def _is_method_of(function: Any, obj: Any) -> bool:
    """Whether ``function`` is a method defined on ``obj``'s class (or a base),
    possibly under a ``functools.wraps`` wrapper (transformers wraps ``forward``)."""
    name = getattr(function, "__name__", None)
    if name is None:
        return False
    for cls in type(obj).__mro__:
        attribute = vars(cls).get(name)
        while attribute is not None:
            if attribute is function:
                return True
            attribute = getattr(attribute, "__wrapped__", None)
    return False


def _unwrap(function: Any) -> tuple[Any, Any]:
    """``(function, instance)``: the function that partials and bound methods
    end up calling, and the object it is a method of, if any
    (``partial(Block.forward, block, **kw)`` and ``block.forward`` both give
    ``(Block.forward, block)``)."""
    instance = None
    while True:
        if isinstance(function, functools.partial):
            if instance is None and function.args and _is_method_of(function.func, function.args[0]):
                instance = function.args[0]
            function = function.func
        elif hasattr(function, "__func__") and hasattr(function, "__self__"):  # a bound method
            if instance is None:
                instance = function.__self__
            function = function.__func__
        else:
            return function, instance


def describe_callable(function: Callable[..., Any]) -> str:
    """The name a user recognises: ``GPT2Block.forward`` for a bound method or a
    ``functools.partial(GPT2Block.forward, block, **kw)``; the class for a module
    (``Linear``) or another callable object; the qualified name for a function."""
    target, _ = _unwrap(function)
    if isinstance(target, nn.Module) or not (hasattr(target, "__qualname__") or hasattr(target, "__name__")):
        return type(target).__name__
    return getattr(target, "__qualname__", None) or target.__name__


def modules_of(function: Callable[..., Any]) -> list[nn.Module]:
    """The modules a callable is made of: itself, the object of a bound method
    or of a ``functools.partial`` of a method, a partial's module arguments,
    and the modules its closure captured."""
    found = []
    while isinstance(function, functools.partial):
        found += [a for a in (*function.args, *function.keywords.values()) if isinstance(a, nn.Module)]
        function = function.func
    target, instance = _unwrap(function)
    found += [obj for obj in (target, instance) if isinstance(obj, nn.Module)]
    for cell in getattr(target, "__closure__", None) or ():
        try:
            if isinstance(cell.cell_contents, nn.Module):
                found.append(cell.cell_contents)
        except ValueError:  # an empty cell
            pass
    return found


def region_key(function: Callable[..., Any]) -> tuple[Hashable, tuple[Any, ...]]:
    """A key that is the same on every call of the same region, and the objects
    it stands for (the key holds only their identities).

    A module: the module. A bound method or a partial of a method: the function
    and the object. A plain function: its code and the identities of the objects
    its closure captured, so that ``lambda x: layer(x)`` created anew on each
    call is recognised as long as ``layer`` is the same object.
    """
    if isinstance(function, nn.Module):  # the common case, on every call: no unwrapping
        return id(function), (function, )
    target, instance = _unwrap(function)
    code = getattr(target, "__code__", None)
    if code is not None:
        captured = []
        for cell in getattr(target, "__closure__", None) or ():
            try:
                captured.append(cell.cell_contents)
            except ValueError:  # an empty cell
                captured.append(None)
        key = ("function", code, tuple(map(id, captured)), id(instance) if instance is not None else None)
        return key, (*captured, instance)
    if instance is None and isinstance(target, nn.Module):  # e.g. a partial of a module: the module's key
        return id(target), (target, )
    return ("object", id(target), id(instance) if instance is not None else None), (target, instance)


def _weak(value: Any) -> Callable[[], Any] | None:
    """A weak reference to ``value``, or None for objects that take none (ints, None, ...)."""
    try:
        return weakref.ref(value)
    except TypeError:
        return None


class RegionRegistry:
    """The regions of the functions given to :func:`ds_pipe_ckpt.checkpoint`,
    one per function (see the module docstring), with what each showed on its
    first call.

    Keys hold object identities, which Python reuses once an object is freed,
    so each entry also keeps weak references to the objects it stands for: an
    entry whose objects are gone is not taken for a new object at the same
    address. A region is named when it is first seen, and holds its name, not
    its function. Bounded (least recently used first out). Facts are re-checked
    on every call anyway: a region that modifies an input it was not known to
    modify fails loudly.
    """

    def __init__(self, capacity: int = 4096):
        self._capacity = capacity
        self._entries: collections.OrderedDict[Hashable, tuple[Region, tuple]] = collections.OrderedDict()

    def region_for(self, function: Callable[..., Any]) -> Region:
        """The region ``function`` is a call of (a new one the first time)."""
        if isinstance(function, nn.Module):  # the common case, on every call: the shortest path
            key = id(function)  # region_key()'s key for a module, without building it
            entry = self._entries.get(key)
            if entry is not None and entry[1][0]() is function:
                self._entries.move_to_end(key)
                return entry[0]
        key, anchors = region_key(function)
        entry = self._entries.get(key)
        if entry is not None and all(ref is None or ref() is anchor for ref, anchor in zip(entry[1], anchors)):
            self._entries.move_to_end(key)
            return entry[0]
        region = Region(f"function {describe_callable(function)}")
        self._entries[key] = (region, tuple(_weak(anchor) for anchor in anchors))
        self._entries.move_to_end(key)
        if len(self._entries) > self._capacity:
            self._entries.popitem(last=False)
        return region

    def facts_for(self, function: Callable[..., Any]) -> RegionFacts:
        """What ``function``'s region showed on its first call."""
        return self.region_for(function).facts

    def __len__(self) -> int:
        return len(self._entries)
