"""GPU checks of the compiled pack/unpack ops: bit-exact against the pure-torch
fallback for random shapes, dtypes (bf16 and fp16 included), world sizes,
ranks and (un)aligned pointers; several launches; side streams; and a
checkpointed segment stored through the ops (device shard, pinned host
memory, pooled buffers) with gradients equal to plain checkpointing.

Runs under pytest or as a plain script (``python tests/gpu/test_kernels_gpu.py``;
the GPU machine has neither pytest nor DeepSpeed). Skips when no GPU is visible.
"""

from __future__ import annotations

import functools
import os
import random
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.utils.checkpoint as torch_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))
from standalone import import_modules  # noqa: E402

kernels, op_builder, pack, pool_module, stash = import_modules("placement.kernels", "placement.op_builder", "placement.pack", "placement.pool", "placement.stash")

try:
    import pytest
except ImportError:  # the plain-script runner below
    pytest = None

NO_GPU = "no CUDA device is visible"
# DS_PIPE_CKPT_GPU_TESTS_ON_CPU=1 runs the same checks on CPU tensors (through the
# ops' CPU implementation): a dry run of this file's logic on a machine without a GPU.
DEVICE = "cpu" if os.environ.get("DS_PIPE_CKPT_GPU_TESTS_ON_CPU") == "1" else "cuda"
if pytest is not None:
    pytestmark = pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason=NO_GPU)

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.uint8, torch.bool]
if hasattr(torch, "float8_e4m3fn"):
    DTYPES.append(torch.float8_e4m3fn)


@functools.cache
def ops() -> str:
    """Build (or load the cached) library and register its ops; returns its path."""
    started = time.perf_counter()
    library = op_builder.build()
    kernels.load_library(library)
    print(f"ops library ready in {time.perf_counter() - started:.1f} s: {library}", flush=True)
    return str(library)


def _random_tensor(rng: random.Random, dtype: torch.dtype, device: str = DEVICE) -> torch.Tensor:
    shape = [rng.randint(1, 40) for _ in range(rng.randint(0, 3))]
    if rng.random() < 0.1:
        shape = [rng.randint(1000, 300_000)]  # several blocks per tensor
    source = torch.randint(0, 256, (int(torch.tensor(shape).prod()) * dtype.itemsize + 16, ), dtype=torch.uint8,
                           device=device)
    if rng.random() < 0.3:  # a view whose data pointer is not 16-byte aligned
        skip = rng.randint(1, 15) // dtype.itemsize * dtype.itemsize
        source = source[skip:]
    count = int(torch.tensor(shape).prod())
    return source[:count * dtype.itemsize].view(dtype).view(shape)


def _random_case(seed: int, device: str = DEVICE):
    rng = random.Random(seed)
    tensors = [_random_tensor(rng, rng.choice(DTYPES), device) for _ in range(rng.randint(1, 8))]
    world = rng.choice([1, 2, 3, 4, 8])
    return rng, tensors, pack.PackLayout.plan(tensors, world)


def test_status_reports_the_compiled_path():
    ops()
    status = kernels.status()
    print(f"kernels.status(): {status}")
    assert status.compiled or DEVICE == "cpu", status


def test_pack_and_unpack_match_the_fallback_bit_for_bit():
    ops()
    for seed in range(200):
        rng, tensors, layout = _random_case(seed)
        views = layout.storage_views(tensors)
        offsets = list(layout.offsets)
        if seed % 4 == 3:  # arbitrary offsets, which the ops accept (ds_pipe_ckpt aligns them)
            offsets, cursor = [], rng.randint(0, 9)
            for t in views:
                offsets.append(cursor)
                cursor += t.numel() * t.element_size() + rng.randint(0, 17)
        end = offsets[-1] + views[-1].numel() * views[-1].element_size()
        for rank in range(layout.world_size):
            begin = layout.shard_begin(rank) + (rng.randint(0, 7) if seed % 5 == 4 else 0)
            expected = torch.full((layout.shard_bytes + 5, ), 0xA5, dtype=torch.uint8, device=DEVICE)
            got = expected.clone()
            pack.pack_fallback(views, offsets, begin, expected)
            torch.ops.ds_pipe_ckpt.pack(views, offsets, begin, got)
            assert torch.equal(got, expected), f"seed {seed} rank {rank}: pack differs"
        buffer = torch.randint(0, 256, (end + 3, ), dtype=torch.uint8, device=DEVICE)
        expected_outs = [torch.empty_like(t) for t in views]
        got_outs = [torch.empty_like(t) for t in views]
        pack.unpack_fallback(buffer, offsets, expected_outs)
        torch.ops.ds_pipe_ckpt.unpack(buffer, offsets, got_outs)
        for i, (a, b) in enumerate(zip(got_outs, expected_outs)):
            assert torch.equal(pack.byte_view(a), pack.byte_view(b)), f"seed {seed}: unpack of tensor {i} differs"


def test_round_trip_restores_values_dtypes_and_strides():
    ops()
    base = torch.randn(64, 48, device=DEVICE, dtype=torch.bfloat16)
    tensors = [base.t(), torch.randn(3, 5, 7, 9, device=DEVICE, dtype=torch.float16).to(
        memory_format=torch.channels_last), base[:, ::3], torch.randn(1001, device=DEVICE), base[1:, 1:]]
    layout = pack.PackLayout.plan(tensors, 4)
    shards = []
    for rank in range(4):
        shard = torch.empty(layout.shard_bytes, dtype=torch.uint8, device=DEVICE)
        kernels.pack(layout.storage_views(tensors), layout.offsets, layout.shard_begin(rank), shard)
        shards.append(shard)
    gathered = torch.cat(shards)
    fresh, storage = layout.empty(torch.device(DEVICE))
    kernels.unpack(gathered, layout.offsets, storage)
    for original, view, copy in zip(tensors, layout.views(gathered), fresh):
        assert torch.equal(original, view) and torch.equal(original, copy)
        assert view.dtype == original.dtype and copy.stride() == view.stride()


def test_more_segments_than_one_launch_carries():
    ops()
    tensors = [torch.randn(n % 13 + 1, device=DEVICE) for n in range(150)]  # ~300 segments with gaps
    layout = pack.PackLayout.plan(tensors, 3)
    for rank in range(3):
        expected = torch.empty(layout.shard_bytes, dtype=torch.uint8, device=DEVICE)
        got = torch.empty_like(expected)
        pack.pack_fallback(tensors, layout.offsets, layout.shard_begin(rank), expected)
        torch.ops.ds_pipe_ckpt.pack(tensors, layout.offsets, layout.shard_begin(rank), got)
        assert torch.equal(got, expected)


def test_ops_run_on_the_current_stream():
    ops()
    if DEVICE == "cpu":
        return
    side = torch.cuda.Stream()
    x = torch.randn(1 << 22, device=DEVICE)
    layout = pack.PackLayout.plan([x], 2)
    out = torch.empty(layout.shard_bytes, dtype=torch.uint8, device=DEVICE)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        y = x * 2  # produced on the side stream, consumed there by the op
        torch.ops.ds_pipe_ckpt.pack([y], layout.offsets, layout.shard_begin(1), out)
    torch.cuda.current_stream().wait_stream(side)
    expected = torch.empty_like(out)
    pack.pack_fallback([y], layout.offsets, layout.shard_begin(1), expected)
    assert torch.equal(out, expected)


def _fake_runtime(world_size, rank, cpu, pool, originals):
    """What SegmentStash needs from ds_pipe_ckpt.placement.runtime.CheckpointRuntime, with an
    all-gather that builds the other ranks' shards from the original inputs (one GPU)."""

    def all_gather(output, shard):
        layout = pack.PackLayout.plan(originals, world_size)
        for r in range(world_size):
            part = output.narrow(0, r * layout.shard_bytes, layout.shard_bytes)
            if r == rank:
                part.copy_(shard)
            else:
                pack.pack_fallback(layout.storage_views(originals), layout.offsets, layout.shard_begin(r), part)

    return SimpleNamespace(config=SimpleNamespace(cpu_checkpointing=cpu), partitioned=True, world_size=world_size,
                           rank=rank, pool=pool, profiler=None, synchronize_boundary=lambda: None,
                           all_gather=all_gather)


def test_checkpointed_segment_through_the_ops_has_exact_gradients():
    ops()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(33, 64), nn.GELU(), nn.Linear(64, 33)).to(DEVICE)

    def segment(x, y, mask):
        return net(x) * y.float().sum() + mask.float().sum()

    def run(runtime_args):
        net.zero_grad(set_to_none=True)
        g = torch.Generator(device=DEVICE).manual_seed(1)
        x = torch.randn(7, 33, device=DEVICE, generator=g).requires_grad_()
        y = torch.randn(9, 5, device=DEVICE, dtype=torch.bfloat16, generator=g).t().requires_grad_()
        mask = torch.randn(3, device=DEVICE, generator=g) > 0
        inputs = (x * 1.0, y * 1.0, mask)
        if runtime_args is None:
            out = torch_checkpoint.checkpoint(segment, *inputs, use_reentrant=False)
        else:
            runtime = _fake_runtime(originals=[t.detach().clone() for t in inputs[:2]], **runtime_args)
            holder = stash.SegmentStash(runtime)
            with torch.autograd.graph.saved_tensors_hooks(holder.pack, holder.unpack):
                out = torch_checkpoint.checkpoint(segment, *inputs, use_reentrant=False)
            holder.seal()
            if runtime.pool is None and runtime.config.cpu_checkpointing:
                assert holder._stored.device.type == "cpu" and holder._stored.is_pinned() == (DEVICE == "cuda")
        out.square().sum().backward()
        return [p.grad for p in net.parameters()] + [x.grad, y.grad]

    reference = run(None)
    for world_size, rank, cpu, pooled in [(1, 0, False, False), (1, 0, True, False), (4, 2, False, False),
                                          (4, 3, True, False), (2, 1, False, True), (4, 0, True, True)]:
        pool = pool_module.BufferPool(2) if pooled else None
        got = run(dict(world_size=world_size, rank=rank, cpu=cpu, pool=pool))
        for a, b in zip(reference, got):
            assert torch.equal(a, b), (world_size, rank, cpu, pooled)
        if pool is not None:
            assert pool.in_use == 0


def main() -> int:
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print(f"SKIPPED: {NO_GPU}")
        return 0
    where = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU dry run"
    print(f"device: {where}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    failures = 0
    for name, test in [(n, f) for n, f in globals().items() if n.startswith("test_") and callable(f)]:
        started = time.perf_counter()
        try:
            test()
            print(f"PASS {name} ({time.perf_counter() - started:.1f} s)", flush=True)
        except Exception:  # report every test, then fail
            failures += 1
            print(f"FAIL {name}\n{traceback.format_exc()}", flush=True)
    print(f"{failures} failed" if failures else "all GPU kernel tests passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
