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
(:mod:`ds_pipe_ckpt.memory`). Rank 0 shows a progress bar (in a terminal; else
a line every ``--log-every`` steps), prints one summary
line per run (with the peak of every pipeline stage) and writes ``loss.csv``,
``loss.png`` and ``summary.json`` into ``--out-dir``.

Without a GPU, ``DS_ACCELERATOR=cpu`` is set (unless set already) and DeepSpeed
picks the gloo backend.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

if __package__ in (None, ""):  # run as a script: make ``examples.gpt`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import deepspeed  # noqa: E402
import torch.distributed as dist  # noqa: E402

from ds_pipe_ckpt import partition_from_config  # noqa: E402
from ds_pipe_ckpt.memory import track_cpu_allocations  # noqa: E402
from examples.launching import add_launch_arguments, check_launch_arguments, save_parameters  # noqa: E402
from examples.sampling import GlobalBatchSampler  # noqa: E402
from examples.gpt.data import Corpus, first_micro_batch, load_corpus, micro_batches  # noqa: E402
from examples.training import (add_progress_arguments, load_json_config, pipeline_topology,  # noqa: E402
                               rank0_first, topology_text, train_run)
from examples.gpt.engine import DEFAULT_PARTITION_METHOD, build_engine  # noqa: E402
from examples.gpt.model import GPTConfig  # noqa: E402
from examples.gpt.report import RunResult, summary_line, write_outputs  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    defaults = GPTConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_launch_arguments(parser, steps=200, out_dir="runs/gpt")
    add_progress_arguments(parser)
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
    if args.log_every < 1:
        parser.error(f"--log-every must be >= 1, got {args.log_every}")
    if not 1 <= args.memory_step <= args.steps:
        parser.error(f"--memory-step must be in [1, --steps = {args.steps}], got {args.memory_step}")
    try:
        args.model = GPTConfig(context=args.context, dim=args.dim, heads=args.heads, blocks=args.blocks,
                               dropout=args.dropout)
    except ValueError as error:
        parser.error(str(error))
    return args


def train_one(config_path: str, args: argparse.Namespace, topology, corpus: Corpus) -> RunResult:
    """Train ``args.steps`` steps with the config at ``config_path``."""
    config = load_json_config(config_path)
    # The config's pipeline.partition_method wins over --partition-method.
    inputs, labels = first_micro_batch(corpus, config, args.context, args.seed)
    method, planning = partition_from_config(config, default=args.partition_method, sample=inputs, labels=labels)
    engine = build_engine(config, args.model, topology, seed=args.seed, dropout_seed=args.dropout_seed,
                          partition_method=method, partition_planning=planning)
    rank = dist.get_rank()
    micro, accum = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    dp = topology.get_dim("data")
    global_batch = micro * accum * dp
    sampler = GlobalBatchSampler(corpus.num_windows(args.context), micro, accum, dp,
                                 engine.grid.get_data_parallel_rank(), args.steps, seed=args.seed)
    result = train_run(engine, micro_batches(corpus, sampler, args.context), config_path=config_path, config=config,
                       steps=args.steps, memory_step=args.memory_step, global_batch=global_batch,
                       progress_label="gpt", show_progress=not args.no_progress, log_every=args.log_every)
    if args.save_params:
        save_parameters(engine.module, args.out_dir, result.name, rank)
    if rank == 0:
        print(summary_line(result, topology_text(topology), global_batch, args.context), flush=True)
    del engine
    gc.collect()
    return result


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        # Before any model state exists: frees of it inside a measured step are then counted exactly.
        track_cpu_allocations()
    deepspeed.init_distributed()
    topology = pipeline_topology(dist.get_world_size(), args.pp, args.mp)
    corpus = rank0_first(lambda: load_corpus(args.cache_dir))  # rank 0 writes the corpus if the cache lacks it
    if dist.get_rank() == 0:
        print(f"gpt: {topology_text(topology)} on {dist.get_world_size()} ranks ({dist.get_backend()}); "
              f"data: {corpus.description}", flush=True)
    runs = [train_one(path, args, topology, corpus) for path in args.deepspeed_config]
    if dist.get_rank() == 0:
        meta = {"topology": topology_text(topology), "pp": args.pp, "mp": args.mp,
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
