"""Step a pipeline stage under each checkpointing variant and record its peak
memory, the memory held after its forward, and its step times.

A step is what a pipeline stage does per micro-batch: forward through every
segment (each checkpointed as one unit, unless the variant is ``none``), then
``torch.autograd.backward(output, grad_output)`` with the gradient a later
stage would send. Parameter gradients are cleared before each step, so each
step allocates them afresh.

It measures only: it prints nothing and starts no ranks (:mod:`.runner` does both).
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from ds_pipe_ckpt.memory import MemoryReport, MemoryTracker, track_cpu_allocations, track_memory

from .variants import CheckpointFn, Variant, variant
from .workloads import Workload, build_workload

__all__ = ["Result", "Stage", "UnaccountedMemoryError", "measure_variants", "measure_in_rank"]


class UnaccountedMemoryError(RuntimeError):
    """The memory figures of a step could not be verified (see :meth:`Stage.measure_memory`)."""


@dataclass
class Result:
    """The figures for one workload under one variant (one JSON record)."""

    workload: str
    variant: str
    peak_bytes: int
    held_after_forward_bytes: int
    floor_bytes: int | None
    samples_s: list[float] = field(default_factory=list)

    @property
    def time_median_s(self) -> float:
        return statistics.median(self.samples_s)

    @classmethod
    def from_json(cls, record: dict) -> "Result":
        """Inverse of :meth:`as_json`."""
        return cls(record["workload"], record["variant"], record["peak_bytes"],
                   record["held_after_forward_bytes"], record["floor_bytes"], list(record["samples_s"]))

    def as_json(self) -> dict:
        """The JSON record: figures, summary statistics and every timed sample."""
        return {
            "workload": self.workload,
            "variant": self.variant,
            "peak_bytes": self.peak_bytes,
            "held_after_forward_bytes": self.held_after_forward_bytes,
            "floor_bytes": self.floor_bytes,
            "time_median_s": self.time_median_s,
            "time_min_s": min(self.samples_s),
            "time_max_s": max(self.samples_s),
            "samples_s": list(self.samples_s),
        }


class Stage:
    """A workload placed on a device with its input and output gradient."""

    def __init__(self, workload: Workload, device: torch.device):
        self.workload = workload.to(device)
        self.device = device
        self.parameters = workload.parameters()
        self.input = workload.make_input(device)
        with torch.no_grad():
            output = self.forward(None)
        generator = torch.Generator().manual_seed(1)
        self.grad_output = torch.randn(output.shape, generator=generator).to(device)

    def forward(self, checkpoint: CheckpointFn | None) -> torch.Tensor:
        """Run every segment, each through ``checkpoint`` unless it is None."""
        x = self.input
        for segment in self.workload.segments:
            x = segment(x) if checkpoint is None else checkpoint(segment, x)
        return x

    def step(self, checkpoint: CheckpointFn | None, tracker: MemoryTracker | None = None) -> None:
        """Forward, then backward from :attr:`grad_output`; marks ``"forward"`` on ``tracker``."""
        output = self.forward(checkpoint)
        if tracker is not None:
            tracker.mark("forward")
        torch.autograd.backward(output, self.grad_output)

    def clear_grads(self) -> None:
        """Drop the gradients the previous step left."""
        for tensor in (*self.parameters, self.input):
            tensor.grad = None

    @property
    def gradient_bytes(self) -> int:
        """What a step leaves allocated: the parameters' and the input's gradients."""
        return sum(t.numel() * t.element_size() for t in (*self.parameters, self.input))

    def measure_memory(self, checkpoint: CheckpointFn | None,
                       agree: Callable[[bool], bool] = lambda done: done,
                       attempts: int = 20) -> MemoryReport:
        """Memory of one step above what is allocated before it, checked.

        The check, on CPU: what the tracker counts as still allocated at the end
        must be exactly :attr:`gradient_bytes`; a step that ends otherwise is
        measured again and the first exact one is returned. What the check
        catches: a block whose free the tracker does not see, or sees late. A
        gloo collective in the step (``ours_partitioned``'s all-gather) is run
        by one of gloo's worker threads, whose work item holds the input and
        output tensors until that thread is done with it, which can be after
        the caller's ``wait()`` has returned; whichever of the two threads lets
        go last frees the blocks, and in these steps it is mostly the worker
        (a bare all-gather of 256 KiB shards in a loop showed the 768 KiB of
        shard and output freed after the caller's region had ended). Unless
        :func:`~ds_pipe_ckpt.memory.track_cpu_allocations` is on, a free on
        that unprofiled thread is never subtracted, every figure after it is
        overstated, and on 2 CPU cores most steps end 0.1 to 3 MiB over (of
        20 steps in a rank, 0 to 5 were exact): :func:`measure_in_rank` turns
        it on. With it on, every figure is what the allocator had handed out
        at that instant, gloo's held blocks included: a worker that lets go
        only after the end of the region leaves blocks that really were still
        allocated then, and that step is measured again; one that lets go late
        but before the end raises the peak by what it held (``alexnet_stage``,
        quick, 2 CPU cores: 14.1 MiB in most steps, 14.5 or 15.0 MiB in about
        1 in 10, every one of them exact at the end). (CUDA's allocator
        counters see every free; they also round sizes up, so the check does
        not apply there.) ``agree`` turns
        "this rank has an exact measurement" into "every rank has one", so that
        all ranks take the same number of steps (their collectives must pair up).
        """
        exact = None
        for _ in range(attempts):
            # Cleared outside the tracked region: it must not free what it did not allocate.
            self.clear_grads()
            with track_memory(self.device) as tracker:
                self.step(checkpoint, tracker)
            if exact is None and (self.device.type != "cpu"
                                  or tracker.report.final_bytes == self.gradient_bytes):
                exact = tracker.report
            if agree(exact is not None):
                return exact
        raise UnaccountedMemoryError(
            f"{self.workload.name}: in {attempts} steps the memory tracker never ended (on every rank) with "
            f"exactly the {self.gradient_bytes} bytes of gradients allocated (last here: "
            f"{tracker.report.final_bytes}); some frees were not seen, or the checkpointing path keeps "
            "memory across steps")

    def time_step(self, checkpoint: CheckpointFn | None) -> float:
        """Wall-clock seconds of one step."""
        self.clear_grads()
        self._synchronize()
        start = time.perf_counter()
        self.step(checkpoint)
        self._synchronize()
        return time.perf_counter() - start

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def measure_variants(stage: Stage, variants: Sequence[Variant], floor_bytes: int | None,
                     repetitions: int, warmup: int = 1) -> list[Result]:
    """Measure ``variants`` on ``stage`` in this process.

    Memory is measured once per variant after warm-up (it is deterministic;
    :meth:`Stage.measure_memory` checks it).
    Timed steps go round-robin over the variants, so that a change in machine
    load during the run affects every variant alike, in reverse order every
    other round, so that a garbage collection that comes at a fixed period of
    steps does not land on the same variant every time.
    """
    results = []
    for candidate in variants:
        with candidate.configured():
            for _ in range(warmup):
                stage.time_step(candidate.checkpoint)
            memory = stage.measure_memory(candidate.checkpoint)
        results.append(Result(stage.workload.name, candidate.name, memory.peak_bytes,
                              memory.marks["forward"], floor_bytes if candidate.has_floor else None))
    pairs = list(zip(variants, results))
    for index in range(repetitions):
        for candidate, result in (pairs if index % 2 == 0 else pairs[::-1]):
            with candidate.configured():
                result.samples_s.append(stage.time_step(candidate.checkpoint))
    return results


def measure_in_rank(jobs: Sequence[tuple[str, str]], preset: str, device_type: str, repetitions: int,
                    warmup: int, threads: int) -> list[dict]:
    """One rank's share of the multi-rank variants, run by
    :func:`ds_pipe_ckpt.testing.run_ranks`: each ``(workload, variant)`` of
    ``jobs`` measured as :func:`measure_variants` does, on this rank's process
    group and device (``cuda:LOCAL_RANK`` for ``device_type="cuda"``).
    Returns :meth:`Result.as_json` records.

    On CPU it turns on :func:`~ds_pipe_ckpt.memory.track_cpu_allocations`
    before it builds the first stage and leaves it on, so that the frees gloo's
    worker threads make are counted (see :meth:`Stage.measure_memory`). The
    timed steps run with it on too; its cost (about 2 us per allocation) did
    not show in them: ``ours_partitioned`` on the quick ``alexnet_stage``,
    alternating steps on and off, 2 ranks on 2 CPU cores: median 172 ms on,
    174 ms off.
    """
    torch.set_num_threads(threads)
    rank = torch.distributed.get_rank()
    device = torch.device(device_type)
    if device.type == "cpu":
        track_cpu_allocations()
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)

    def all_ranks_agree(done: bool) -> bool:
        pending = torch.tensor([0 if done else 1], device=device)
        torch.distributed.all_reduce(pending)
        return pending.item() == 0

    records = []
    for workload_name, variant_name in jobs:
        candidate = variant(variant_name)
        stage = Stage(build_workload(workload_name, preset), device)
        with candidate.configured(rank):
            for _ in range(warmup):
                stage.time_step(candidate.checkpoint)
            memory = stage.measure_memory(candidate.checkpoint, agree=all_ranks_agree)
            samples = [stage.time_step(candidate.checkpoint) for _ in range(repetitions)]
        records.append(Result(workload_name, variant_name, memory.peak_bytes, memory.marks["forward"], None,
                              samples).as_json())
    return records
