"""The per-call cost of checkpointing as a training loop sees it, garbage
collector included: N regions of ``Linear(64, 64)`` + GELU, each through
torch's non-reentrant checkpoint and through ``ds_pipe_ckpt.checkpoint``,
forward then backward, the two interleaved round by round in one process
that has imported DeepSpeed (whose ~400,000 long-lived objects every full
collection walks).

Run from the repository root::

    python -m benchmarks.region_loop 32 128 512 1024
    python -m benchmarks.region_loop --freeze 1024     # gc.freeze() after imports

Prints, per N, torch's median time per region and the median of the
per-round ratios ours ÷ torch.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from typing import Callable, Sequence

import torch
import torch.nn as nn
import torch.utils.checkpoint as torch_checkpoint

import ds_pipe_ckpt

__all__ = ["main"]


def _step(layers: Sequence[nn.Module], checkpoint: Callable) -> float:
    x = torch.randn(32, 64, requires_grad=True)
    started = time.perf_counter()
    for layer in layers:
        x = checkpoint(layer, x)
    x.sum().backward()
    return time.perf_counter() - started


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.region_loop", description=__doc__.split("\n\n")[0])
    parser.add_argument("regions", type=int, nargs="+", help="numbers of regions per step")
    parser.add_argument("--freeze", action="store_true", help="gc.freeze() before measuring")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per N (default: max(5, 4096 / N))")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(max(args.regions))]
    variants = {"torch": lambda layer, x: torch_checkpoint.checkpoint(layer, x, use_reentrant=False),
                "ours": lambda layer, x: ds_pipe_ckpt.checkpoint(layer, x, use_reentrant=False)}
    if args.freeze:
        gc.collect()
        gc.freeze()
    for n in args.regions:
        for checkpoint in variants.values():  # warm-up; ours learns each region on its first call
            _step(layers[:n], checkpoint)
            _step(layers[:n], checkpoint)
        torch_times, ratios = [], []
        for _ in range(args.rounds or max(5, 4096 // n)):
            torch_s = _step(layers[:n], variants["torch"])
            ratios.append(_step(layers[:n], variants["ours"]) / torch_s)
            torch_times.append(torch_s)
        print(f"N = {n}: torch {statistics.median(torch_times) / n * 1e6:.0f} us per region, ours / torch "
              f"{statistics.median(ratios):.3f} (median of {len(ratios)} rounds)", flush=True)


if __name__ == "__main__":
    main()
