"""Throughput of the compiled pack/unpack ops against the pure-torch fallback
and a plain device-to-device copy of the same bytes.

``python tests/gpu/bench.py`` (CUDA, PyTorch and nvcc only; builds the ops if
needed). Prints one row per case and op, as a table, last. Bandwidth counts
the bytes written (the shard for pack, the tensors for unpack); the copy
column is ``dst.copy_(src)`` of that many contiguous bytes.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from standalone import import_modules  # noqa: E402

kernels, op_builder, pack = import_modules("placement.kernels", "placement.op_builder", "placement.pack")

MIB = 1 << 20
DEVICE = "cpu" if os.environ.get("DS_PIPE_CKPT_GPU_TESTS_ON_CPU") == "1" else "cuda"  # dry run on CPU

# (name, [(numel, dtype), ...], world size)
CASES = [
    ("1 x 256 MiB bf16, whole", [(128 * MIB, torch.bfloat16)], 1),
    ("1 x 256 MiB bf16, 1/8 shard", [(128 * MIB, torch.bfloat16)], 8),
    ("hidden+mask fp16, 1/4 shard", [(8 * 4096 * 4096 + 3, torch.float16), (8 * 4096, torch.float32)], 4),
    ("8 x ~16 MiB mixed, 1/2 shard", [(4 * MIB + 7 * i, (torch.float32, torch.bfloat16)[i % 2]) for i in range(8)], 2),
    ("64 x ~256 KiB fp32, 1/8 shard", [(64 * 1024 + 5 * i, torch.float32) for i in range(64)], 8),
]
if DEVICE == "cpu":
    CASES = [(name, [(max(1, n // 256), dtype) for n, dtype in spec], world) for name, spec, world in CASES]


class Timer:
    """Mean seconds per call over ``iters`` calls after ``warmup`` calls (CUDA events on GPU)."""

    def __init__(self, warmup: int = 3, iters: int = 20):
        self.warmup, self.iters = warmup, iters

    def __call__(self, fn) -> float:
        for _ in range(self.warmup):
            fn()
        if DEVICE == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for _ in range(self.iters):
                fn()
            stop.record()
            torch.cuda.synchronize()
            return start.elapsed_time(stop) / 1e3 / self.iters
        import time
        started = time.perf_counter()
        for _ in range(self.iters):
            fn()
        return (time.perf_counter() - started) / self.iters


def _gbps(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:8.1f}"


def bench_case(name, spec, world, timer):
    tensors = [torch.randn(numel, device=DEVICE).to(dtype) for numel, dtype in spec]
    layout = pack.PackLayout.plan(tensors, world)
    views = layout.storage_views(tensors)
    rank = world // 2
    shard = torch.empty(layout.shard_bytes, dtype=torch.uint8, device=DEVICE)
    begin = layout.shard_begin(rank)

    rows = []
    copy_src = torch.empty(layout.shard_bytes, dtype=torch.uint8, device=DEVICE)
    copy_dst = torch.empty_like(copy_src)
    copy_s = timer(lambda: copy_dst.copy_(copy_src))
    op_s = timer(lambda: torch.ops.ds_pipe_ckpt.pack(views, layout.offsets, begin, shard))
    fallback_s = timer(lambda: pack.pack_fallback(views, layout.offsets, begin, shard))
    rows.append((name, "pack", layout.shard_bytes, op_s, fallback_s, copy_s))

    gathered = torch.empty(layout.total_bytes, dtype=torch.uint8, device=DEVICE)
    _, outs = layout.empty(torch.device(DEVICE))
    copy_src = torch.empty(layout.used_bytes, dtype=torch.uint8, device=DEVICE)
    copy_dst = torch.empty_like(copy_src)
    copy_s = timer(lambda: copy_dst.copy_(copy_src))
    op_s = timer(lambda: torch.ops.ds_pipe_ckpt.unpack(gathered, layout.offsets, outs))
    fallback_s = timer(lambda: pack.unpack_fallback(gathered, layout.offsets, outs))
    rows.append((name, "unpack", layout.used_bytes, op_s, fallback_s, copy_s))
    return rows


def main() -> int:
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("SKIPPED: no CUDA device is visible")
        return 0
    kernels.load_library(op_builder.build())
    timer = Timer()
    rows = []
    for name, spec, world in CASES:
        rows.extend(bench_case(name, spec, world, timer))
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    where = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU (dry run)"
    print(f"\npack/unpack throughput on {where} (GB/s of bytes written; higher is better)")
    header = f"{'case':34} {'op':6} {'MiB':>9} {'kernel':>8} {'fallback':>8} {'d2d copy':>8} {'kernel/copy':>11}"
    print(header)
    print("-" * len(header))
    for name, op, nbytes, op_s, fallback_s, copy_s in rows:
        print(f"{name:34} {op:6} {nbytes / MIB:9.2f} {_gbps(nbytes, op_s)} {_gbps(nbytes, fallback_s)} "
              f"{_gbps(nbytes, copy_s)} {copy_s / op_s:11.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
