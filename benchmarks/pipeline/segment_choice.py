"""Which segments to checkpoint, on a GPT stage with a large vocabulary, beside
upstream's reentrant path: ``python -m benchmarks.pipeline.segment_choice``.

The GPT example (tied token embedding and LM head, position table, blocks,
final norm) at pp=2 with ``activation_checkpoint_interval`` 1 and no
``checkpointable_layers``, trained by DeepSpeed's pipeline engine on 2 CPU
ranks. Rows:

* ``none``: no checkpointing (ds_pipe_ckpt's PipelineModule, interval 0);
* ``upstream_reentrant``: ``deepspeed.pipe.PipelineModule`` with DeepSpeed's
  reentrant checkpoint of the blocks (``checkpointable_layers=["Block"]``, as
  GPT-NeoX names its transformer layers): what these stacks run today.
  Upstream's own rule (every segment that owns parameters) cannot train this
  model: the embedding's reentrant checkpoint returns an output without
  ``grad_fn`` (its input is token ids), so stage 0's backward fails;
* ``every_segment``: ds_pipe_ckpt, torch's non-reentrant checkpoint of every
  segment, the head included (``checkpointable_layers`` naming every layer);
* ``non_reentrant``: ds_pipe_ckpt's default: segments whose checkpointing
  frees nothing (embedding, position table, head) run plainly.

Per mode: the median step time (the slower stage's) and the median of the
per-round ratios to ``upstream_reentrant`` (the modes take turns, one step
each, so that load drift cancels in the ratio); per stage, the peak bytes
of one step above its start (:mod:`ds_pipe_ckpt.memory`, a separate untimed step).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import ds_pipe_ckpt
from ds_pipe_ckpt.memory import track_cpu_allocations, track_memory
from ds_pipe_ckpt.testing import run_ranks

MODES = ("none", "upstream_reentrant", "every_segment", "non_reentrant")
EVERY_LAYER = ["TokenEmbedding", "PositionEmbedding", "Block", "FinalLayerNorm", "partial"]


def _build(mode: str, sizes, micro_batch: int, accumulation: int):
    import deepspeed
    from deepspeed.pipe import PipelineModule as UpstreamPipelineModule
    from examples.gpt.model import gpt_layer_specs, language_model_loss

    ds_pipe_ckpt.configure()
    config = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": accumulation,
              "train_batch_size": micro_batch * accumulation, "steps_per_print": 10**9,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
              "pipeline": {"activation_checkpoint_interval": 0 if mode == "none" else 1,
                           "use_reentrant": mode == "upstream_reentrant"}}
    torch.manual_seed(0)
    if mode == "upstream_reentrant":
        module = UpstreamPipelineModule(layers=gpt_layer_specs(sizes), num_stages=2, loss_fn=language_model_loss,
                                        partition_method="type:Block", activation_checkpoint_interval=1,
                                        checkpointable_layers=["Block"])
        engine, _, _, _ = deepspeed.initialize(model=module, config=config, model_parameters=module.parameters())
    else:
        module = ds_pipe_ckpt.PipelineModule(
            layers=gpt_layer_specs(sizes), num_stages=2, loss_fn=language_model_loss, partition_method="type:Block",
            checkpointable_layers=EVERY_LAYER if mode == "every_segment" else None)
        engine, _, _, _ = ds_pipe_ckpt.initialize(model=module, config=config, model_parameters=module.parameters())
    return engine


def _batches(sizes, micro_batch: int, count: int):
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, sizes.vocab_size, (count, micro_batch, sizes.context + 1), generator=g)
    return iter([(t[:, :-1], t[:, 1:]) for t in tokens])


def measure(args: argparse.Namespace) -> dict:
    """One rank's records: per mode, its step times (ms) and peak bytes."""
    from examples.gpt.model import GPTConfig

    torch.set_num_threads(1)
    track_cpu_allocations()
    sizes = GPTConfig(vocab_size=args.vocab, context=args.context, dim=args.dim, heads=args.heads,
                      blocks=args.blocks, dropout=0.0)
    steps = args.warmup + 1 + args.steps
    runs = {}
    for mode in args.modes:
        engine = _build(mode, sizes, args.micro_batch, args.accumulation)
        runs[mode] = (engine, _batches(sizes, args.micro_batch, steps * args.accumulation))
    record = {mode: {"times_ms": []} for mode in args.modes}
    for mode, (engine, data) in runs.items():
        for _ in range(args.warmup):
            engine.train_batch(data_iter=data)
        with track_memory("cpu") as tracker:
            engine.train_batch(data_iter=data)
        record[mode]["peak_bytes"] = tracker.report.peak_bytes
        module = engine.module
        record[mode]["segments"] = getattr(module, "segment_checkpointing", None)
    for _ in range(args.steps):
        for mode, (engine, data) in runs.items():
            dist.barrier()
            start = time.perf_counter()
            engine.train_batch(data_iter=data)
            record[mode]["times_ms"].append((time.perf_counter() - start) * 1e3)
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    args = parser.parse_args()
    records = run_ranks(measure, 2, args, timeout=3600)
    print(f"GPT pp=2, vocab {args.vocab}, dim {args.dim}, {args.blocks} blocks, context {args.context}, "
          f"micro-batch {args.micro_batch}, {args.accumulation} micro-batches per step; "
          f"median of {args.steps} steps (modes in turn)")
    print("| mode | step ms (median, min-max) | ÷ upstream_reentrant (median per round) | stage 0 peak MiB | stage 1 peak MiB |")
    print("|---|---:|---:|---:|---:|")
    # A step ends on the slowest stage: its time is the larger of the two ranks'.
    times = {mode: [max(a, b) for a, b in zip(records[0][mode]["times_ms"], records[1][mode]["times_ms"])]
             for mode in args.modes}
    for mode in args.modes:
        # Per-round ratios (the modes run one step each per round), so that load drift cancels.
        ratio = (f"{statistics.median(t / u for t, u in zip(times[mode], times['upstream_reentrant'])):.3f}"
                 if "upstream_reentrant" in times else "")
        print(f"| {mode} | {statistics.median(times[mode]):.0f} ({min(times[mode]):.0f}-{max(times[mode]):.0f}) | "
              f"{ratio} | {records[0][mode]['peak_bytes'] / 2**20:.2f} | "
              f"{records[1][mode]['peak_bytes'] / 2**20:.2f} |")
    for mode in args.modes:
        for rank in (0, 1):
            segments = records[rank][mode]["segments"]
            if segments:
                print(f"{mode}, stage {rank}: " + "; ".join(f"{k.split('(')[1].rstrip(')')}: {v}"
                                                           for k, v in segments.items()))


if __name__ == "__main__":
    main()
