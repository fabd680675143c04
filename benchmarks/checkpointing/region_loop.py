"""The per-call cost of checkpointing as a training loop sees it, garbage
collector included: N regions of ``Linear(64, 64)`` + GELU, each through
torch's non-reentrant checkpoint and through ``ds_pipe_ckpt.checkpoint``,
forward then backward, interleaved round by round in one process that has
imported DeepSpeed (whose ~400,000 long-lived objects every full collection
walks). Odd rounds run the variants in reverse order, so that a collection
that comes every other step does not always land on the same variant.

Run from the repository root::

    python -m benchmarks.checkpointing.region_loop 32 128 512 1024
    python -m benchmarks.checkpointing.region_loop --freeze 1024        # gc.freeze() after imports
    python -m benchmarks.checkpointing.region_loop --ablations 128      # what each guarantee costs

Prints, per N, torch's median time per region and, for each other variant,
the median of the per-round ratios variant ÷ torch. ``--ablations`` adds the
variants of :mod:`benchmarks.checkpointing.call_ablations`.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from typing import Sequence

import torch
import torch.nn as nn

from .call_ablations import ABLATIONS, OURS, TORCH, Ablation

__all__ = ["main"]


def _step(layers: Sequence[nn.Module], variant: Ablation) -> float:
    with variant.switched_off():
        x = torch.randn(32, 64, requires_grad=True)
        started = time.perf_counter()
        for layer in layers:
            x = variant.checkpoint(layer, x)
        x.sum().backward()
        return time.perf_counter() - started


def _measure(layers: Sequence[nn.Module], variants: Sequence[Ablation], rounds: int) -> dict[str, list[float]]:
    for variant in variants:  # warm-up; ours learns each region on its first call
        _step(layers, variant)
        _step(layers, variant)
    times: dict[str, list[float]] = {variant.name: [] for variant in variants}
    for index in range(rounds):
        for variant in (variants if index % 2 == 0 else variants[::-1]):
            times[variant.name].append(_step(layers, variant))
    return times


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.checkpointing.region_loop", description=__doc__.split("\n\n")[0])
    parser.add_argument("regions", type=int, nargs="+", help="numbers of regions per step")
    parser.add_argument("--freeze", action="store_true", help="gc.freeze() before measuring")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per N (default: max(25, 4096 / N))")
    parser.add_argument("--ablations", action="store_true",
                        help="also ours with its guarantees switched off one by one (benchmarks.checkpointing.call_ablations)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(max(args.regions))]
    variants = ABLATIONS if args.ablations else (TORCH, OURS)
    if args.freeze:
        gc.collect()
        gc.freeze()
    for n in args.regions:
        rounds = args.rounds or max(25, 4096 // n)
        times = _measure(layers[:n], variants, rounds)
        reference = times[TORCH.name]
        ratios = ", ".join(f"{name} / torch {statistics.median(a / b for a, b in zip(samples, reference)):.3f}"
                           for name, samples in times.items() if name != TORCH.name)
        print(f"N = {n}: torch {statistics.median(reference) / n * 1e6:.0f} us per region, {ratios} "
              f"(median of {rounds} rounds)", flush=True)


if __name__ == "__main__":
    main()
