"""What the GPT and Llama training scripts share (``examples/gpt/train.py``,
``examples/llama/train.py``): their common arguments and checks, one config's
run on the byte corpus's windows (of the context's length, or with
``--variable-lengths`` each of its own length), and the launch around the
runs (process group, corpus, summary lines, outputs).

A script gives what is its own: its extra arguments, how it loads its tokens,
how it builds an engine (:data:`BuildEngine`), its model's description for
``summary.json`` and its plot's title.
"""

from __future__ import annotations

import argparse
import gc
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import deepspeed
import torch
import torch.distributed as dist

from ds_pipe_ckpt import PartitionPlanning, partition_from_config
from ds_pipe_ckpt.memory import track_cpu_allocations
from examples.gpt.data import Corpus, first_micro_batch, micro_batches, variable_micro_batches, window_lengths
from examples.launching import add_launch_arguments, check_launch_arguments, save_parameters
from examples.outputs import write_loss_outputs
from examples.sampling import GlobalBatchSampler
from examples.training import (RunResult, add_progress_arguments, load_json_config, pipeline_topology, rank0_first,
                               summary_line, topology_text, train_run)

__all__ = ["BuildEngine", "TextExample", "add_text_arguments", "check_text_arguments", "lengths_error",
           "launch_text_example", "text_parser"]

REPO_ROOT = Path(__file__).resolve().parents[1]
# The keys that set a budget in activation_checkpointing.
_BUDGET_KEYS = ("memory_budget_mb", "max_memory_mb")

# (config, topology, partition method, partition planning, dynamic_shape) -> DeepSpeed's PipelineEngine.
BuildEngine = Callable[[dict, Any, str, "PartitionPlanning | None", bool], Any]


def text_parser(doc: str, **arguments: Any) -> argparse.ArgumentParser:
    """A parser described by the first paragraph of the script's ``doc``, with
    :func:`add_text_arguments` (given ``arguments``)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_text_arguments(parser, **arguments)
    return parser


def add_text_arguments(parser: argparse.ArgumentParser, *, out_dir: str, context: int, partition_method: str,
                       cache_help: str) -> None:
    """The launch and progress arguments, ``--memory-step``, ``--cache-dir``,
    ``--context``, ``--variable-lengths`` and ``--partition-method``."""
    add_launch_arguments(parser, steps=200, out_dir=out_dir)
    add_progress_arguments(parser)
    parser.add_argument("--memory-step", type=int, default=None,
                        help="the step whose memory is measured (1-based; default: the last)")
    parser.add_argument("--cache-dir", default=str(REPO_ROOT / ".cache" / "gpt"), help=cache_help)
    parser.add_argument("--context", type=int, default=context,
                        help="tokens per sequence (with --variable-lengths: the longest)")
    parser.add_argument("--variable-lengths", action="store_true",
                        help="each sample is a window of its own seeded length in [context / 4, context], each "
                        "micro-batch padded to its longest sample; the module is built with dynamic_shape=True, "
                        "and a config with a budget needs activation_checkpointing.max_sequence_length")
    parser.add_argument("--partition-method", default=partition_method, help="PipelineModule stage partitioning")


def lengths_error(config: dict, variable_lengths: bool, context: int) -> str | None:
    """Why the DeepSpeed ``config`` does not go with ``--variable-lengths``
    (or its absence) at ``--context``, or ``None`` when it does."""
    section = config.get("activation_checkpointing") or {}
    longest = section.get("max_sequence_length")
    if longest is not None and not variable_lengths:
        return (f"activation_checkpointing.max_sequence_length = {longest} plans for micro-batches of variable "
                "length: add --variable-lengths (or remove the key)")
    if variable_lengths and longest is None and any(section.get(key) is not None for key in _BUDGET_KEYS):
        return ("a budget with --variable-lengths needs activation_checkpointing.max_sequence_length, the longest "
                f"micro-batch: --context = {context}")
    if longest is not None and longest < context:
        return (f"activation_checkpointing.max_sequence_length = {longest} is less than --context = {context}, the "
                "longest micro-batch --variable-lengths draws")
    return None


def check_text_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """:func:`check_launch_arguments`, ``--log-every``, ``--context``,
    ``--memory-step`` (default: the last step) and every config against
    ``--variable-lengths`` (:func:`lengths_error`). Exits through ``parser.error``."""
    check_launch_arguments(parser, args)
    if args.log_every < 1:
        parser.error(f"--log-every must be >= 1, got {args.log_every}")
    if args.context < 1:
        parser.error(f"--context must be >= 1, got {args.context}")
    if args.memory_step is None:
        args.memory_step = args.steps
    if not 1 <= args.memory_step <= args.steps:
        parser.error(f"--memory-step must be in [1, --steps = {args.steps}], got {args.memory_step}")
    for path in args.deepspeed_config:
        try:
            error = lengths_error(load_json_config(path), args.variable_lengths, args.context)
        except (OSError, ValueError) as failure:
            parser.error(f"cannot read --deepspeed_config {path}: {failure}")
        if error is not None:
            parser.error(f"{path}: {error}")


@dataclass
class TextExample:
    """What a script gives :func:`launch_text_example`.

    ``load`` reads the tokens (on rank 0 first: it may write the cache) and
    checks them against the model; ``build`` makes an engine; ``source`` says
    where the model comes from (the first line printed); ``meta`` (the
    script's own entries of ``summary.json``'s ``meta``, its ``model`` among
    them) and the plot's ``title`` and ``ylabel`` go into the outputs.
    """

    label: str
    load: Callable[[], Corpus]
    build: BuildEngine
    source: str
    meta: dict
    title: str
    ylabel: str


class _CountedTokens:
    """The micro-batches of ``batches``, counting the tokens (padding included)
    of their inputs."""

    def __init__(self, batches: Iterator[tuple[torch.Tensor, torch.Tensor]]):
        self._batches, self.tokens, self.sequences = batches, 0, 0

    def __iter__(self):
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = next(self._batches)
        self.tokens += inputs.numel()
        self.sequences += len(inputs)
        return inputs, targets


def _train_config(example: TextExample, config_path: str, args: argparse.Namespace, topology,
                  corpus: Corpus) -> RunResult:
    """Train ``args.steps`` steps with the config at ``config_path``; rank 0
    prints its summary line."""
    config = load_json_config(config_path)
    # The config's pipeline.partition_method wins over --partition-method.
    inputs, labels = first_micro_batch(corpus, config, args.context, args.seed)
    method, planning = partition_from_config(config, default=args.partition_method, sample=inputs, labels=labels)
    engine = example.build(config, topology, method, planning, args.variable_lengths)
    rank = dist.get_rank()
    micro, accum = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    dp = topology.get_dim("data")
    global_batch = micro * accum * dp
    windows = corpus.num_windows(args.context)
    sampler = GlobalBatchSampler(windows, micro, accum, dp, engine.grid.get_data_parallel_rank(), args.steps,
                                 seed=args.seed)
    if args.variable_lengths:
        lengths = window_lengths(windows, args.context, args.seed)
        batches = _CountedTokens(variable_micro_batches(corpus, sampler, args.context, lengths))
    else:
        batches = _CountedTokens(micro_batches(corpus, sampler, args.context))
    result = train_run(engine, batches, config_path=config_path, config=config, steps=args.steps,
                       memory_step=args.memory_step, global_batch=global_batch, progress_label=example.label,
                       show_progress=not args.no_progress, log_every=args.log_every)
    if args.save_params:
        save_parameters(engine.module, args.out_dir, result.name, rank)
    if rank == 0:
        # Tokens per sequence: the padded micro-batches' (this rank's share of the data).
        length = batches.tokens / batches.sequences if batches.sequences else args.context
        print(summary_line(example.label, result, topology_text(topology), global_batch, length), flush=True)
    del engine
    gc.collect()
    return result


def launch_text_example(example: TextExample, args: argparse.Namespace) -> None:
    """The whole launch: the process group and (pp, mp, dp) grid, the tokens,
    one run per ``--deepspeed_config`` (same initial weights, dropout streams
    and data order), and on rank 0 the summary lines and ``loss.csv``,
    ``loss.png``, ``summary.json`` in ``--out-dir``."""
    if not torch.cuda.is_available():
        # Before any model state exists: frees of it inside a measured step are then counted exactly.
        track_cpu_allocations()
    deepspeed.init_distributed()
    topology = pipeline_topology(dist.get_world_size(), args.pp, args.mp)
    corpus = rank0_first(example.load)
    label = example.label
    if dist.get_rank() == 0:
        print(f"{label}: {topology_text(topology)} on {dist.get_world_size()} ranks ({dist.get_backend()}); "
              f"model: {example.source}; data: {corpus.description}", flush=True)
    runs = [_train_config(example, path, args, topology, corpus) for path in args.deepspeed_config]
    if dist.get_rank() == 0:
        meta = {"topology": topology_text(topology), "pp": args.pp, "mp": args.mp, "dp": topology.get_dim("data"),
                "world_size": dist.get_world_size(), "data": corpus.description,
                "corpus_sha256": corpus.manifest["sha256"], "corpus_tokens": corpus.manifest["tokens"],
                "python": corpus.manifest["python"], "seed": args.seed, "dropout_seed": args.dropout_seed,
                "steps": args.steps, "memory_step": args.memory_step, "context": args.context,
                "variable_lengths": args.variable_lengths, "partition_method": args.partition_method,
                "torch": torch.__version__, "deepspeed": deepspeed.__version__, **example.meta}
        paths = write_loss_outputs(Path(args.out_dir), runs, {"meta": meta, "runs": [asdict(run) for run in runs]},
                                   f"{example.title}, {meta['topology']}", example.ylabel)
        print(f"{label}: wrote {paths['csv']}, {paths['png']} and {paths['summary']}", flush=True)
    dist.barrier()
