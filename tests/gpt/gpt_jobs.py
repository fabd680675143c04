"""Rank functions for the GPT tests that run in ``run_ranks`` processes
(module level, so that ``spawn`` can import them)."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import torch.distributed as dist

from ds_pipe_ckpt.memory import track_cpu_allocations, track_memory
from examples.sampling import GlobalBatchSampler
from examples.gpt.data import load_corpus, micro_batches
from examples.gpt.engine import build_engine, pipeline_topology
from examples.gpt.model import GPTConfig

CONFIG_DIR = Path(__file__).resolve().parents[2] / "examples" / "gpt" / "configs"


def step_memory(config_names: list[str], pp: int, cache_dir: str, measured: list[bool]) -> dict[str, list]:
    """For each config: train ``len(measured)`` steps, measuring those marked
    True; return ``{config: [(step, peak_bytes, final_bytes), ...]}`` for this rank."""
    track_cpu_allocations()
    corpus = load_corpus(cache_dir)
    results = {}
    for name in config_names:
        config = json.loads((CONFIG_DIR / f"{name}.json").read_text())
        engine = build_engine(config, GPTConfig(), pipeline_topology(dist.get_world_size(), pp))
        sampler = GlobalBatchSampler(corpus.num_windows(64), engine.train_micro_batch_size_per_gpu(),
                                     engine.gradient_accumulation_steps(), 1, 0, len(measured))
        batches = micro_batches(corpus, sampler, 64)
        rows = []
        for step, measure in enumerate(measured, start=1):
            if not measure:
                engine.train_batch(data_iter=batches)
                continue
            gc.collect()
            with track_memory("cpu") as tracker:
                engine.train_batch(data_iter=batches)
            rows.append((step, tracker.report.peak_bytes, tracker.report.final_bytes))
        results[name] = rows
        del engine
        gc.collect()
    return results
