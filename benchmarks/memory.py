"""Peak memory of a region of code, counted from every allocation and free.

On CUDA the caching allocator keeps the counts (``torch.cuda.memory_allocated``,
``torch.cuda.max_memory_allocated``). On CPU torch keeps none, but with
``profile_memory=True`` the profiler records one event per allocation (positive
size) and per free (negative size) made through torch's CPU allocator, with the
block's address, op-internal workspaces included. Replaying those events in
time order gives the bytes allocated at every instant, hence the peak.

Both methods count bytes *above* what was allocated when the region began
(parameters, inputs, anything older).

CPU caveat: the profiler learns a block's size only when it sees the
allocation, so a free of a block allocated before the region is either dropped
(size unknown) or reported with a stale size (the address was used by an
earlier profiled block). The region must therefore not free memory it did not
allocate: keep references to pre-existing tensors until it ends, and clear
``.grad`` before it starts. Frees of unknown blocks that the profiler does
report are detected and raise :class:`ForeignFreeError`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile, record_function

__all__ = ["ForeignFreeError", "MemoryReport", "MemoryTracker", "track_memory"]

# Prefix of the empty profiler ranges that mark points in time on CPU.
_MARK_PREFIX = "benchmarks.memory.mark:"


class ForeignFreeError(RuntimeError):
    """The tracked region freed a block it did not allocate (CPU method only)."""


@dataclass
class MemoryReport:
    """Bytes allocated above the start of the region: the peak, the amount
    still allocated at the end, and at each :meth:`MemoryTracker.mark`."""

    peak_bytes: int = 0
    final_bytes: int = 0
    marks: dict[str, int] = field(default_factory=dict)


class MemoryTracker:
    """Handle yielded by :func:`track_memory`: call :meth:`mark` inside the
    region; read :attr:`report` after it."""

    def __init__(self, device: torch.device):
        self.device = device
        self.report = MemoryReport()
        self.mark_names: list[str] = []
        self.cuda_base_bytes = 0

    def mark(self, name: str) -> None:
        """Record the bytes allocated now under ``name`` (e.g. ``"forward"``)."""
        if name in self.mark_names:
            raise ValueError(f"mark {name!r} used twice")
        self.mark_names.append(name)
        if self.device.type == "cuda":
            self.report.marks[name] = torch.cuda.memory_allocated(self.device) - self.cuda_base_bytes
        else:
            # An empty profiler range; its timestamp places it among the memory events.
            with record_function(_MARK_PREFIX + name):
                pass


@contextlib.contextmanager
def track_memory(device: torch.device | str) -> Iterator[MemoryTracker]:
    """Measure the memory the body of the ``with`` allocates on ``device``::

        with track_memory("cpu") as tracker:
            out = model(x)
            tracker.mark("forward")
            out.backward(grad)
        tracker.report.peak_bytes, tracker.report.marks["forward"]
    """
    device = torch.device(device)
    tracker = MemoryTracker(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        tracker.cuda_base_bytes = torch.cuda.memory_allocated(device)
        yield tracker
        torch.cuda.synchronize(device)
        tracker.report.peak_bytes = torch.cuda.max_memory_allocated(device) - tracker.cuda_base_bytes
        tracker.report.final_bytes = torch.cuda.memory_allocated(device) - tracker.cuda_base_bytes
    elif device.type == "cpu":
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            yield tracker
        _replay_cpu_events(prof.profiler.kineto_results.experimental_event_tree(), tracker)
    else:
        raise ValueError(f"no memory-tracking method for device type {device.type!r}")


def _walk(events: Iterable[Any]) -> Iterator[Any]:
    for event in events:
        yield event
        yield from _walk(event.children)


def _replay_cpu_events(event_tree: Iterable[Any], tracker: MemoryTracker) -> None:
    """Fill ``tracker.report`` from the profiler's CPU allocation events and marks."""
    timeline = []  # (time, order of recording, allocation fields or mark name)
    for order, event in enumerate(_walk(event_tree)):
        if event.tag == _EventType.Allocation and event.extra_fields.device.type == "cpu":
            timeline.append((event.start_time_ns, order, event.extra_fields))
        elif event.name.startswith(_MARK_PREFIX):
            timeline.append((event.start_time_ns, order, event.name[len(_MARK_PREFIX):]))
    timeline.sort(key=lambda item: item[:2])

    report = tracker.report
    live: dict[int, int] = {}  # address -> size of the blocks allocated in the region
    allocated = 0
    for _, _, item in timeline:
        if isinstance(item, str):
            report.marks[item] = allocated
        elif item.alloc_size > 0:
            live[item.ptr] = item.alloc_size
            allocated += item.alloc_size
            report.peak_bytes = max(report.peak_bytes, allocated)
        else:
            size = live.pop(item.ptr, None)
            if size is None:
                raise ForeignFreeError(
                    f"the tracked region freed a block of {-item.alloc_size} bytes that it did not "
                    "allocate; keep pre-existing tensors (and .grad) alive until the region ends")
            allocated -= size
    report.final_bytes = allocated
    missing = [name for name in tracker.mark_names if name not in report.marks]
    if missing:
        raise RuntimeError(f"the profiler recorded no event for the marks {missing}")
