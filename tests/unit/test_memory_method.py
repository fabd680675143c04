"""The memory method (ds_pipe_ckpt.memory) gives known answers.

Every expected figure below is derived by hand from tensor sizes (fp32, 4 bytes
an element): what is allocated, what autograd saves, and when it is freed.
Sizes are multiples of 512 bytes, the CUDA caching allocator's rounding, and
each CUDA case runs once untracked first (cuBLAS keeps a workspace it
allocates on first use), so that the same answers hold on CUDA.
"""

import threading

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint

from benchmarks.checkpointing.floor import checkpointing_floor, segment_sizes
from benchmarks.checkpointing.measure import Stage
from ds_pipe_ckpt.memory import cpu_allocations_tracked, track_cpu_allocations, track_memory
from benchmarks.checkpointing.variants import variant
from benchmarks.checkpointing.workloads import gpt_stage

F32 = 4
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_single_matmul_allocates_exactly_its_output(device):
    a = torch.randn(256, 512, device=device)
    b = torch.randn(512, 128, device=device)
    a @ b  # warm-up
    with track_memory(device) as tracker:
        c = a @ b
        tracker.mark("after matmul")
    expected = 256 * 128 * F32
    assert tracker.report.marks["after matmul"] == expected
    assert tracker.report.peak_bytes == expected
    assert tracker.report.final_bytes == expected
    del c


@pytest.mark.parametrize("device", DEVICES)
def test_peak_follows_allocations_and_frees_in_order(device):
    with track_memory(device) as tracker:
        a = torch.empty(1024, device=device)
        b = torch.empty(3072, device=device)
        tracker.mark("a and b")
        del a
        c = torch.empty(2048, device=device)  # b + c = 5120 elements: the peak
        del b
        tracker.mark("c only")
    assert tracker.report.marks == {"a and b": 4096 * F32, "c only": 2048 * F32}
    assert tracker.report.peak_bytes == 5120 * F32
    # The peak from the previous mark (or the start) up to each mark: the second saw b + c.
    assert tracker.report.interval_peaks == {"a and b": 4096 * F32, "c only": 5120 * F32}
    assert tracker.report.final_bytes == 2048 * F32
    del c


@pytest.mark.parametrize("device", DEVICES)
def test_linear_forward_backward(device):
    """y = x @ w: the forward allocates y (mm saves x and w, which already exist);
    the backward allocates w.grad = x.T @ g and nothing that outlives it."""
    m, k, n = 64, 32, 48
    x = torch.randn(m, k, device=device)
    w = torch.randn(k, n, device=device, requires_grad=True)
    g = torch.randn(m, n, device=device)
    (x @ w).backward(g)  # warm-up
    w.grad = None
    with track_memory(device) as tracker:
        y = x @ w
        tracker.mark("forward")
        y.backward(g)
        del y
    assert tracker.report.marks["forward"] == m * n * F32
    assert tracker.report.peak_bytes == (m * n + k * n) * F32
    assert tracker.report.final_bytes == k * n * F32


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpointed"])
def test_activations_held_after_forward(device, checkpointed):
    """exp(exp(x)) saves both exp results; checkpointed, it keeps only its output
    (and, with preserve_rng_state=False, nothing else)."""
    n = 10_240
    x = torch.randn(n, device=device, requires_grad=True)

    def fn(t):
        return t.exp().exp()

    with track_memory(device) as tracker:
        y = torch_checkpoint.checkpoint(fn, x, use_reentrant=False, preserve_rng_state=False) \
            if checkpointed else fn(x)
        tracker.mark("forward")
        y.backward(torch.ones_like(y))
        del y
    assert tracker.report.marks["forward"] == (1 if checkpointed else 2) * n * F32
    assert tracker.report.peak_bytes >= 2 * n * F32  # both exp results exist at once either way
    assert tracker.report.final_bytes == n * F32  # x.grad


def test_memory_allocated_before_the_region_is_not_counted():
    before = torch.empty(1_000_000)
    with track_memory("cpu") as tracker:
        small = torch.empty(10)
    assert tracker.report.peak_bytes == 10 * F32
    del before, small


@pytest.fixture
def cpu_allocations():
    """The CPU allocator records every block's size (on every thread) during the test."""
    previous = track_cpu_allocations(True)
    yield
    track_cpu_allocations(previous)


@pytest.fixture
def no_cpu_allocation_tracking():
    """Only the profiler makes the CPU allocator record sizes during the test."""
    previous = track_cpu_allocations(False)
    yield
    track_cpu_allocations(previous)


def _free_preexisting_then_allocate(device, preexisting):
    """Region: allocate 1024 floats, free the 4096-float ``preexisting[0]``,
    allocate 2048 floats. Relative to the start: +1024, -3072, -1024 floats."""
    with track_memory(device) as tracker:
        a = torch.empty(1024, device=device)
        tracker.mark("a")
        preexisting.clear()
        tracker.mark("freed")
        b = torch.empty(2048, device=device)
        tracker.mark("b")
    del a, b
    return tracker.report


@pytest.mark.parametrize("device", DEVICES)
def test_freeing_a_preexisting_tensor_inside_the_region_is_counted(device, cpu_allocations):
    """Allocated before the region and outside any profiler: the allocator's
    running total still knows its size."""
    preexisting = [torch.empty(4096, device=device)]
    report = _free_preexisting_then_allocate(device, preexisting)
    assert report.marks == {"a": 1024 * F32, "freed": -3072 * F32, "b": -1024 * F32}
    assert report.peak_bytes == 1024 * F32
    assert report.final_bytes == -1024 * F32


def test_freeing_a_block_from_an_earlier_profiled_region_is_counted(no_cpu_allocation_tracking):
    """Without process-wide tracking, a block allocated under an earlier memory
    profile has its size recorded too."""
    assert not cpu_allocations_tracked()
    with track_memory("cpu"):
        preexisting = [torch.empty(4096)]
    report = _free_preexisting_then_allocate("cpu", preexisting)
    assert report.marks == {"a": 1024 * F32, "freed": -3072 * F32, "b": -1024 * F32}
    assert report.peak_bytes == 1024 * F32


def test_free_on_another_thread_is_counted(cpu_allocations):
    """A tensor released by a thread the profiler does not follow (as gloo's
    worker threads release buffers) lowers the count when it happens."""
    with track_memory("cpu") as tracker:
        held = [torch.empty(4096)]
        tracker.mark("allocated")
        worker = threading.Thread(target=held.clear)
        worker.start()
        worker.join()
        tracker.mark("freed elsewhere")
        c = torch.empty(1024)
    assert tracker.report.marks == {"allocated": 4096 * F32, "freed elsewhere": 0}
    assert tracker.report.peak_bytes == 4096 * F32
    assert tracker.report.final_bytes == 1024 * F32
    del c


def test_gpt_stage_peak_is_above_the_analytic_floor_and_close_to_it():
    """Two independent methods agree: the floor, from the sizes of the tensors
    autograd saves, bounds the peak the allocator events show from below, and
    the gap is the gradient of the 4x MLP hidden plus small buffers."""
    workload = gpt_stage(layers=3, dim=32, heads=2, batch=2, seq=64)
    floor = checkpointing_floor(segment_sizes(workload, torch.device("cpu")))
    memory = Stage(workload, torch.device("cpu")).measure_memory(variant("torch_non_reentrant").checkpoint)
    mlp_hidden_grad = 2 * 64 * 4 * 32 * F32
    assert floor.floor_bytes <= memory.peak_bytes <= floor.floor_bytes + 2 * mlp_hidden_grad
