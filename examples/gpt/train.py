"""Train the GPT pipeline example (byte-level, Python standard-library text)
with DeepSpeed and ds_pipe_ckpt.

Launch it the way DeepSpeed jobs are launched::

    deepspeed --num_gpus 2 examples/gpt/train.py --pp 2 \\
        --deepspeed_config examples/gpt/configs/none.json examples/gpt/configs/non_reentrant.json
    torchrun --nproc_per_node 4 examples/gpt/train.py --pp 2 --mp 2 --deepspeed_config ...

The data-parallel size is ``world_size / (pp * mp)``. Batch sizes, optimizer
and activation checkpointing (``pipeline.activation_checkpoint_interval``,
``pipeline.use_reentrant``, ``activation_checkpointing``) come from the JSON.
Several configs may be given: each is trained in turn, in one launch, from the
same initial weights, dropout streams and data order, so runs differ only in
their configuration.

Every rank measures the memory of one ``engine.train_batch()`` (the last step,
or ``--memory-step``): its peak above what was allocated when the step began
(:mod:`ds_pipe_ckpt.memory`). Rank 0 shows a progress bar, prints one summary
line per run (with the peak of every pipeline stage) and writes ``loss.csv``,
``loss.png`` and ``summary.json`` into ``--out-dir``.

Without a GPU, ``DS_ACCELERATOR=cpu`` is set (unless set already) and DeepSpeed
picks the gloo backend.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

if __package__ in (None, ""):  # run as a script: make ``examples.gpt`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import deepspeed  # noqa: E402
import torch.distributed as dist  # noqa: E402
from tqdm import tqdm  # noqa: E402

import ds_pipe_ckpt  # noqa: E402
from ds_pipe_ckpt.memory import track_cpu_allocations, track_memory  # noqa: E402
from examples.launching import add_launch_arguments, check_launch_arguments, save_parameters  # noqa: E402
from examples.sampling import GlobalBatchSampler  # noqa: E402
from examples.gpt.data import Corpus, load_corpus, micro_batches  # noqa: E402
from examples.gpt.engine import (DEFAULT_PARTITION_METHOD, build_engine, checkpointing_mode,  # noqa: E402
                                 pipeline_topology)
from examples.gpt.model import GPTConfig  # noqa: E402
from examples.gpt.report import RunResult, summary_line, write_outputs  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    defaults = GPTConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_launch_arguments(parser, steps=200, out_dir="runs/gpt")
    parser.add_argument("--mp", type=int, default=1,
                        help="model-parallel size (ranks of a stage compute the same thing; the group that "
                        "partition_activations shards checkpoint inputs across)")
    parser.add_argument("--memory-step", type=int, default=None,
                        help="the step whose memory is measured (1-based; default: the last)")
    parser.add_argument("--cache-dir", default=str(REPO_ROOT / ".cache" / "gpt"), help="where the corpus is cached")
    parser.add_argument("--context", type=int, default=defaults.context, help="tokens per sequence")
    parser.add_argument("--dim", type=int, default=defaults.dim, help="model width")
    parser.add_argument("--heads", type=int, default=defaults.heads, help="attention heads")
    parser.add_argument("--blocks", type=int, default=defaults.blocks, help="transformer blocks")
    parser.add_argument("--dropout", type=float, default=defaults.dropout,
                        help="dropout on the attention and MLP outputs")
    parser.add_argument("--partition-method", default=DEFAULT_PARTITION_METHOD,
                        help="PipelineModule stage partitioning")
    args = parser.parse_args(argv)
    check_launch_arguments(parser, args)
    if args.memory_step is None:
        args.memory_step = args.steps
    if not 1 <= args.memory_step <= args.steps:
        parser.error(f"--memory-step must be in [1, --steps = {args.steps}], got {args.memory_step}")
    try:
        args.model = GPTConfig(context=args.context, dim=args.dim, heads=args.heads, blocks=args.blocks,
                               dropout=args.dropout)
    except ValueError as error:
        parser.error(str(error))
    return args


def _load_config(path: str) -> dict:
    with open(path) as handle:
        return json.load(handle)


def _gather_peaks(peak_bytes: int, stage: int) -> tuple[dict[str, int], dict[str, int]]:
    """(largest peak of each stage, every rank's peak), on every rank."""
    records: list = [None] * dist.get_world_size()
    dist.all_gather_object(records, (dist.get_rank(), stage, peak_bytes))
    by_stage: dict[str, int] = {}
    for _, record_stage, peak in records:
        by_stage[str(record_stage)] = max(peak, by_stage.get(str(record_stage), peak))
    by_rank = {str(rank): peak for rank, _, peak in sorted(records)}
    return by_stage, by_rank


def _train_step(engine, batches, measure: bool) -> tuple[float, int]:
    """One ``engine.train_batch()``: its loss and, with ``measure``, its peak
    memory (bytes above what was allocated when it began; else 0)."""
    if not measure:
        return float(engine.train_batch(data_iter=batches)), 0
    with track_memory(engine.device) as tracker:
        loss = float(engine.train_batch(data_iter=batches))
    return loss, tracker.report.peak_bytes


def train_one(config_path: str, args: argparse.Namespace, topology, corpus: Corpus) -> RunResult:
    """Train ``args.steps`` steps with the config at ``config_path``."""
    config = _load_config(config_path)
    engine = build_engine(config, args.model, topology, seed=args.seed, dropout_seed=args.dropout_seed,
                          partition_method=args.partition_method)
    rank = dist.get_rank()
    micro, accum = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    dp = topology.get_dim("data")
    global_batch = micro * accum * dp
    sampler = GlobalBatchSampler(corpus.num_windows(args.context), micro, accum, dp,
                                 engine.grid.get_data_parallel_rank(), args.steps, seed=args.seed)
    batches = micro_batches(corpus, sampler, args.context)
    settings = ds_pipe_ckpt.current_settings().config
    result = RunResult(name=Path(config_path).stem, config=str(config_path), checkpointing=checkpointing_mode(engine),
                       policy=(config.get("activation_checkpointing") or {}).get("policy"),
                       partition_activations=settings.partition_activations,
                       cpu_checkpointing=settings.cpu_checkpointing,
                       checkpoint_interval=engine.module.activation_checkpoint_interval,
                       memory_step=args.memory_step)

    bar = tqdm(total=args.steps, desc=result.name, unit="step", dynamic_ncols=True, mininterval=0.5,
               disable=rank != 0 or args.no_progress)
    start = time.perf_counter()
    peak_bytes = 0
    for step in range(1, args.steps + 1):
        measure = step == args.memory_step
        if measure:
            gc.collect()  # no garbage of earlier steps freed inside the measured step
        step_start = time.perf_counter()
        loss, peak = _train_step(engine, batches, measure)
        peak_bytes = peak if measure else peak_bytes
        rate = global_batch / (time.perf_counter() - step_start)
        result.losses.append(loss)
        result.samples_per_s.append(rate)
        bar.set_postfix(loss=f"{loss:.4f}", samples_s=f"{rate:.0f}")
        bar.update()
    result.wall_s = time.perf_counter() - start
    bar.close()
    result.peak_memory_by_stage, result.peak_memory_by_rank = _gather_peaks(peak_bytes, engine.stage_id)

    if args.save_params:
        save_parameters(engine.module, args.out_dir, result.name, rank)
    if rank == 0:
        print(summary_line(result, _topology_text(topology), global_batch, args.context), flush=True)
    del engine
    gc.collect()
    return result


def _topology_text(topology) -> str:
    return f"pp={topology.get_dim('pipe')} mp={topology.get_dim('model')} dp={topology.get_dim('data')}"


def load_data(args: argparse.Namespace) -> Corpus:
    """Rank 0 first (it writes the corpus if the cache lacks it), then the others."""
    if dist.get_rank() == 0:
        corpus = load_corpus(args.cache_dir)
    dist.barrier()
    if dist.get_rank() != 0:
        corpus = load_corpus(args.cache_dir)
    return corpus


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        # Before any model state exists: frees of it inside a measured step are then counted exactly.
        track_cpu_allocations()
    deepspeed.init_distributed()
    topology = pipeline_topology(dist.get_world_size(), args.pp, args.mp)
    corpus = load_data(args)
    if dist.get_rank() == 0:
        print(f"gpt: {_topology_text(topology)} on {dist.get_world_size()} ranks ({dist.get_backend()}); "
              f"data: {corpus.description}", flush=True)
    runs = [train_one(path, args, topology, corpus) for path in args.deepspeed_config]
    if dist.get_rank() == 0:
        meta = {"topology": _topology_text(topology), "pp": args.pp, "mp": args.mp,
                "dp": topology.get_dim("data"), "world_size": dist.get_world_size(),
                "data": corpus.description, "corpus_sha256": corpus.manifest["sha256"],
                "corpus_tokens": corpus.manifest["tokens"], "python": corpus.manifest["python"],
                "seed": args.seed, "dropout_seed": args.dropout_seed, "steps": args.steps,
                "memory_step": args.memory_step, "model": vars(args.model),
                "partition_method": args.partition_method, "torch": torch.__version__,
                "deepspeed": deepspeed.__version__}
        paths = write_outputs(Path(args.out_dir), runs, meta)
        print(f"gpt: wrote {paths['csv']}, {paths['png']} and {paths['summary']}", flush=True)
    dist.barrier()


if __name__ == "__main__":
    main()
