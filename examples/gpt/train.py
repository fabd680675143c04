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
their configuration. With ``--variable-lengths`` each sample has its own
length (at most ``--context``) and each micro-batch is padded to its longest;
a config with a budget then names ``activation_checkpointing.max_sequence_length``
(``configs/variable_lengths.json``).

Every rank measures the memory of one ``engine.train_batch()`` (the last step,
or ``--memory-step``): its peak above what was allocated when the step began
(:mod:`ds_pipe_ckpt.memory`); a run with a budget measures every step, and
``summary.json`` has every stage's step peaks and budget. Rank 0 shows a progress bar (in a terminal; else
a line every ``--log-every`` steps), prints one summary
line per run (with the peak of every pipeline stage) and writes ``loss.csv``,
``loss.png`` and ``summary.json`` into ``--out-dir``.

Without a GPU, ``DS_ACCELERATOR=cpu`` is set (unless set already) and DeepSpeed
picks the gloo backend.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``examples.gpt`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.launching import default_to_cpu  # noqa: E402

default_to_cpu()  # before DeepSpeed is imported
from examples.gpt.data import load_corpus  # noqa: E402
from examples.gpt.engine import DEFAULT_PARTITION_METHOD, build_engine  # noqa: E402
from examples.gpt.model import GPTConfig  # noqa: E402
from examples.text_training import TextExample, check_text_arguments, launch_text_example, text_parser  # noqa: E402

LABEL = "gpt"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    defaults = GPTConfig()
    parser = text_parser(__doc__, out_dir="runs/gpt", context=defaults.context,
                         partition_method=DEFAULT_PARTITION_METHOD, cache_help="where the corpus is cached")
    parser.add_argument("--mp", type=int, default=1,
                        help="model-parallel size (ranks of a stage compute the same thing; the group that "
                        "partition_activations shards checkpoint inputs across)")
    parser.add_argument("--dim", type=int, default=defaults.dim, help="model width")
    parser.add_argument("--heads", type=int, default=defaults.heads, help="attention heads")
    parser.add_argument("--blocks", type=int, default=defaults.blocks, help="transformer blocks")
    parser.add_argument("--dropout", type=float, default=defaults.dropout,
                        help="dropout on the attention and MLP outputs")
    args = parser.parse_args(argv)
    check_text_arguments(parser, args)
    try:
        args.model = GPTConfig(context=args.context, dim=args.dim, heads=args.heads, blocks=args.blocks,
                               dropout=args.dropout)
    except ValueError as error:
        parser.error(str(error))
    return args


def _build(args: argparse.Namespace, config: dict, topology, method: str, planning, dynamic_shape: bool):
    return build_engine(config, args.model, topology, seed=args.seed, dropout_seed=args.dropout_seed,
                        partition_method=method, partition_planning=planning, dynamic_shape=dynamic_shape)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    example = TextExample(label=LABEL, load=partial(load_corpus, args.cache_dir), build=partial(_build, args),
                          source="GPT, seeded", meta={"model": vars(args.model)},
                          title="GPT pipeline on Python stdlib bytes",
                          ylabel="training loss (next-byte cross-entropy, nats)")
    launch_text_example(example, args)


if __name__ == "__main__":
    main()
