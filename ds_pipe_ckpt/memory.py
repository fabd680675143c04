"""Peak memory of a region of code: bytes allocated above what was allocated
when the region began.

::

    from ds_pipe_ckpt.memory import track_memory, track_cpu_allocations

    track_cpu_allocations()          # CPU only, once, before the state the region frees is created
    with track_memory(device) as tracker:
        loss = engine.train_batch(data)
        tracker.mark("after step")   # optional: the count at a point in time
    tracker.report.peak_bytes, tracker.report.final_bytes, tracker.report.marks

Figures are relative to the start of the region: memory the region frees that
was allocated before it (last step's buffers, gradients) lowers them, and can
make ``final_bytes`` negative; the peak is at least 0 (the start).

**CUDA**: the caching allocator's counters (``torch.cuda.memory_allocated``,
``max_memory_allocated``), which see every allocation and free on the device.

**CPU**: torch keeps no such counters by default. Its CPU allocator can keep a
running total of the bytes it has handed out and not yet taken back: it records
each block's size when the block is allocated and subtracts it when the block is
freed. It does so while the torch profiler profiles memory on the allocating
(freeing) thread, or on every thread while c10's flag
``caffe2_report_cpu_memory_usage`` is set (:func:`track_cpu_allocations`). The
profiler (``profile_memory=True``) then records one event per allocation and
free made on the profiled thread, each carrying that running total
(``total_allocated``) at that instant. The region's figures are:

* start: the total read by a probe (a 1-byte allocation and its free, inside a
  marker range) when the region begins; marks and the end likewise;
* peak: the largest total carried by any allocation event of the region, minus
  the start.

Because the total is the allocator's own, frees of blocks allocated before the
region are counted when they happen; nothing is replayed or matched by
address. The figures are exact when the allocator knows the size of every
block the region frees and sees every free: :func:`track_cpu_allocations`
ensures both for every block allocated after it was called, on every thread
(gloo's worker threads included). Without it the allocator knows only blocks
allocated on a thread while that thread was profiled, and subtracts only frees
made on such a thread: a block allocated outside any profiled region, or
released by another thread, stays counted, and the figures after its free are
too high by its size (inside DeepSpeed's pipeline engine: 1.5 MiB on a stage;
``tests/gpt/test_gpt_step_memory.py``). Allocations that a non-profiled thread
makes and frees between two events of the profiled thread do not show in the
peak (they do in every total taken while they live).
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

__all__ = ["MemoryReport", "MemoryTracker", "track_memory", "track_cpu_allocations", "cpu_allocations_tracked"]

# Prefix of the profiler ranges that hold a probe.
_PROBE_PREFIX = "ds_pipe_ckpt.memory.probe:"
_START, _END = "<start>", "<end>"
# c10's flag (c10/core/CPUAllocator.cpp) that makes the CPU allocator record every block's size.
_FLAG = "FLAGS_caffe2_report_cpu_memory_usage"


@dataclass
class MemoryReport:
    """Bytes allocated above the start of the region: the peak (>= 0), the
    amount at the end, and at each :meth:`MemoryTracker.mark` (``marks``),
    with the peak from the previous mark (or the start) up to each mark
    (``interval_peaks``); and
    ``start_bytes``, what was allocated when the region began (CUDA: all of
    it; CPU: what the allocator counts, i.e. the blocks allocated since
    :func:`track_cpu_allocations` was turned on)."""

    peak_bytes: int = 0
    final_bytes: int = 0
    marks: dict[str, int] = field(default_factory=dict)
    start_bytes: int = 0
    interval_peaks: dict[str, int] = field(default_factory=dict)


class MemoryTracker:
    """Handle yielded by :func:`track_memory`: call :meth:`mark` inside the
    region; read :attr:`report` after it."""

    def __init__(self, device: torch.device):
        self.device = device
        self.report = MemoryReport()
        self.mark_names: list[str] = []
        self.cuda_base_bytes = 0
        self.cuda_peak_bytes = 0  # the largest peak of the intervals between marks so far

    def mark(self, name: str) -> None:
        """Record the bytes allocated now (above the start) under ``name``.

        On CUDA a mark resets the device's peak statistics
        (``torch.cuda.reset_peak_memory_stats``) to measure the next interval.

        Raises:
            ValueError: ``name`` was used before in this region.
        """
        if name in self.mark_names or name in (_START, _END):
            raise ValueError(f"mark {name!r} used twice (or reserved); give each mark its own name")
        self.mark_names.append(name)
        if self.device.type == "cuda":
            self.report.marks[name] = torch.cuda.memory_allocated(self.device) - self.cuda_base_bytes
            # The peak since the previous mark; the region's peak is the largest of these.
            peak = torch.cuda.max_memory_allocated(self.device) - self.cuda_base_bytes
            self.report.interval_peaks[name] = peak
            self.cuda_peak_bytes = max(self.cuda_peak_bytes, peak)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            _probe(name)


def _probe(name: str) -> None:
    """A 1-byte allocation and its free, inside a named profiler range: the
    free's event carries the allocator's total at this instant."""
    from torch.profiler import record_function

    with record_function(_PROBE_PREFIX + name):
        probe = torch.empty(1, dtype=torch.uint8)
        del probe


def _c10_flag() -> ctypes.c_bool:
    libraries = sorted((Path(torch.__file__).parent / "lib").glob("*c10.*"))
    errors = []
    for library in libraries:
        try:
            return ctypes.c_bool.in_dll(ctypes.CDLL(str(library)), _FLAG)
        except (OSError, ValueError) as error:
            errors.append(f"{library.name}: {error}")
    raise RuntimeError(
        f"cannot reach c10's {_FLAG[6:]} flag ({'; '.join(errors) or 'no c10 library found'}): this torch "
        "build does not export it. CPU memory figures then count only blocks allocated while the profiler "
        "ran on the allocating thread: profile the steps before the measured one as well, or measure on CUDA.")


def cpu_allocations_tracked() -> bool:
    """Whether :func:`track_cpu_allocations` is on (the CPU allocator records
    every block's size, on every thread)."""
    return bool(_c10_flag().value)


def track_cpu_allocations(enabled: bool = True) -> bool:
    """Make torch's CPU allocator record the size of every block it allocates
    and subtract it when the block is freed, in every thread, from now on, so
    that :func:`track_memory` counts frees of blocks allocated before its
    region exactly. Returns the previous setting.

    Call it early (before building the model and optimizer whose buffers a
    measured region frees). Cost: about 2 us per allocation (measured on a
    2-core CPU). It may be turned off again: later regions are then exact as
    long as every block they free was allocated while sizes were recorded.

    Raises:
        RuntimeError: this torch build does not export the flag.
    """
    flag = _c10_flag()
    previous = bool(flag.value)
    flag.value = bool(enabled)
    return previous


@contextlib.contextmanager
def track_memory(device: torch.device | str) -> Iterator[MemoryTracker]:
    """Measure the memory allocated on ``device`` while the body of the ``with`` runs::

        with track_memory("cpu") as tracker:
            out = model(x)
            tracker.mark("forward")
            out.backward(grad)
        tracker.report.peak_bytes, tracker.report.marks["forward"]

    The body runs under the torch profiler on CPU (slower, same results).

    Raises:
        ValueError: a device type other than ``cpu`` and ``cuda``.
        RuntimeError: (CPU) the profiler recorded no event for a probe.
    """
    device = torch.device(device)
    tracker = MemoryTracker(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        tracker.cuda_base_bytes = torch.cuda.memory_allocated(device)
        yield tracker
        torch.cuda.synchronize(device)
        tracker.report.peak_bytes = max(0, tracker.cuda_peak_bytes,
                                        torch.cuda.max_memory_allocated(device) - tracker.cuda_base_bytes)
        tracker.report.final_bytes = torch.cuda.memory_allocated(device) - tracker.cuda_base_bytes
        tracker.report.start_bytes = tracker.cuda_base_bytes
        tracker.report.interval_peaks = {name: max(0, peak) for name, peak in tracker.report.interval_peaks.items()}
    elif device.type == "cpu":
        from torch.profiler import ProfilerActivity, profile

        # Kineto's log lines (levels 0-5) would go to stderr at every start; read at
        # the first start. Left alone when the user set it.
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            _probe(_START)
            yield tracker
            _probe(_END)
        tracker.report = _report_from_events(prof.profiler.kineto_results.experimental_event_tree(),
                                             tracker.mark_names)
    else:
        raise ValueError(f"no memory-tracking method for device type {device.type!r}; use cpu or cuda")


def _walk(events: Iterable[Any], probe: str | None = None) -> Iterator[tuple[Any, str | None]]:
    """Every event with the name of the probe range it is inside, if any."""
    for event in events:
        inner = event.name[len(_PROBE_PREFIX):] if event.name.startswith(_PROBE_PREFIX) else probe
        yield event, inner
        yield from _walk(event.children, inner)


def _report_from_events(event_tree: Iterable[Any], mark_names: list[str]) -> MemoryReport:
    """The figures from the profiler's CPU allocation events (see the module docstring)."""
    from torch._C._profiler import _EventType

    probes: dict[str, tuple[int, int]] = {}  # name -> (time of its free, allocator total after it)
    allocations: list[tuple[int, int]] = []  # (time, allocator total) of the other allocation events
    for event, probe in _walk(event_tree):
        if event.tag != _EventType.Allocation or event.extra_fields.device.type != "cpu":
            continue
        fields = event.extra_fields
        if probe is None:
            if fields.alloc_size > 0:
                allocations.append((event.start_time_ns, fields.total_allocated))
        elif fields.alloc_size < 0:
            probes[probe] = (event.start_time_ns, fields.total_allocated)
    missing = [name for name in (_START, *mark_names, _END) if name not in probes]
    if missing:
        raise RuntimeError(f"the profiler recorded no allocation event for the memory probes {missing}; "
                           "is another profiler with profile_memory=False active in this thread?")
    (start_ns, base), (end_ns, end) = probes[_START], probes[_END]
    allocations.sort()
    times = [time_ns for time_ns, _ in allocations]

    def highest(first_ns: int, last_ns: int) -> int:
        """The highest total of the allocation events from ``first_ns`` to ``last_ns``, less the start."""
        inside = allocations[bisect.bisect_left(times, first_ns):bisect.bisect_right(times, last_ns)]
        return max((total for _, total in inside), default=base) - base

    marks = {name: probes[name][1] - base for name in mark_names}
    peak = max([0, end - base, *marks.values(), highest(start_ns, end_ns)])
    interval_peaks = {}
    previous_ns, previous_bytes = start_ns, 0
    for name in mark_names:  # in the order they were made
        mark_ns = probes[name][0]
        interval_peaks[name] = max(0, previous_bytes, marks[name], highest(previous_ns, mark_ns))
        previous_ns, previous_bytes = mark_ns, marks[name]
    return MemoryReport(peak_bytes=peak, final_bytes=end - base, marks=marks, start_bytes=base,
                        interval_peaks=interval_peaks)
