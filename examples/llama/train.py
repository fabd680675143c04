"""Train transformers' Llama as a DeepSpeed pipeline with ds_pipe_ckpt, from a
small ``LlamaConfig`` or from a Hugging Face checkpoint directory.

Launch it the way DeepSpeed jobs are launched::

    deepspeed --num_gpus 2 examples/llama/train.py --pp 2 \\
        --deepspeed_config examples/llama/configs/none.json examples/llama/configs/non_reentrant.json
    torchrun --nproc_per_node 8 examples/llama/train.py --pp 4 --from-pretrained /models/llama \\
        --deepspeed_config my_bf16_zero1.json

The data-parallel size is ``world_size / pp``. Without ``--from-pretrained``
the model is ``LlamaConfig`` with the sizes given here (a byte-level
vocabulary of 256), seeded so that the weights do not depend on the layout.
With it, the config is the checkpoint's and each stage reads only its own
layers' weights from the safetensors files; the text is tokenised with the
checkpoint's tokenizer when the directory has one, else it is bytes.

Batch sizes, optimizer, precision and activation checkpointing
(``pipeline.activation_checkpoint_interval``, ``pipeline.use_reentrant``,
``activation_checkpointing``) come from the JSON. Several configs may be
given: each is trained in turn, in one launch, from the same initial weights
and data order.

Every rank measures the memory of one ``engine.train_batch()`` (the last step,
or ``--memory-step``). Rank 0 shows progress (a bar in a terminal, else a line
every ``--log-every`` steps), prints one summary line per run (with the peak of
every pipeline stage) and writes ``loss.csv``, ``loss.png`` and
``summary.json`` into ``--out-dir``.

Without a GPU, ``DS_ACCELERATOR=cpu`` is set (unless set already) and DeepSpeed
picks the gloo backend.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from dataclasses import asdict
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

if __package__ in (None, ""):  # run as a script: make ``examples.llama`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import deepspeed  # noqa: E402
import torch.distributed as dist  # noqa: E402

from ds_pipe_ckpt import partition_from_config  # noqa: E402
from ds_pipe_ckpt.memory import track_cpu_allocations  # noqa: E402
from examples.gpt.data import Corpus, first_micro_batch, micro_batches  # noqa: E402
from examples.launching import add_launch_arguments, check_launch_arguments, save_parameters  # noqa: E402
from examples.outputs import write_loss_outputs  # noqa: E402
from examples.sampling import GlobalBatchSampler  # noqa: E402
from examples.training import (RunResult, add_progress_arguments, load_json_config, pipeline_topology,  # noqa: E402
                               rank0_first, summary_line, topology_text, train_run)
from examples.llama.data import load_tokens  # noqa: E402
from examples.llama.engine import DEFAULT_PARTITION_METHOD, build_engine  # noqa: E402
from examples.llama.model import ATTENTION_IMPLEMENTATIONS, small_config  # noqa: E402
from examples.llama.pretrained import has_tokenizer, load_config  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]
LABEL = "llama"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    defaults = small_config()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_launch_arguments(parser, steps=200, out_dir="runs/llama")
    add_progress_arguments(parser)
    parser.add_argument("--memory-step", type=int, default=None,
                        help="the step whose memory is measured (1-based; default: the last)")
    parser.add_argument("--cache-dir", default=str(REPO_ROOT / ".cache" / "gpt"),
                        help="where the corpus (and its tokens under a checkpoint's tokenizer) is cached")
    parser.add_argument("--from-pretrained", metavar="DIR", default=None,
                        help="a Hugging Face Llama checkpoint directory (config.json, safetensors; a tokenizer "
                        "if any): its config and weights; the model-size options below are then ignored")
    parser.add_argument("--context", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--hidden", type=int, default=defaults.hidden_size, help="hidden size")
    parser.add_argument("--layers", type=int, default=defaults.num_hidden_layers, help="decoder layers")
    parser.add_argument("--heads", type=int, default=defaults.num_attention_heads, help="attention heads")
    parser.add_argument("--kv-heads", type=int, default=defaults.num_key_value_heads, help="key/value heads")
    parser.add_argument("--intermediate", type=int, default=defaults.intermediate_size, help="MLP width")
    parser.add_argument("--untied", action="store_true", help="a separate LM head weight (tie_word_embeddings false)")
    parser.add_argument("--attn-implementation", choices=ATTENTION_IMPLEMENTATIONS, default=None,
                        help="transformers' attention implementation (default: sdpa)")
    parser.add_argument("--partition-method", default=DEFAULT_PARTITION_METHOD,
                        help="PipelineModule stage partitioning")
    args = parser.parse_args(argv)
    args.mp = 1  # no tensor-parallel layers: check_launch_arguments checks --mp too
    check_launch_arguments(parser, args)
    if args.log_every < 1:
        parser.error(f"--log-every must be >= 1, got {args.log_every}")
    if args.context < 1:
        parser.error(f"--context must be >= 1, got {args.context}")
    if args.memory_step is None:
        args.memory_step = args.steps
    if not 1 <= args.memory_step <= args.steps:
        parser.error(f"--memory-step must be in [1, --steps = {args.steps}], got {args.memory_step}")
    try:
        if args.from_pretrained is not None:
            args.model = load_config(args.from_pretrained)
            if args.attn_implementation is not None:
                args.model._attn_implementation = args.attn_implementation
        else:
            args.model = small_config(hidden_size=args.hidden, num_hidden_layers=args.layers,
                                      num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                                      intermediate_size=args.intermediate, tie_word_embeddings=not args.untied,
                                      attn_implementation=args.attn_implementation or "sdpa")
    except (ValueError, FileNotFoundError) as error:
        parser.error(str(error))
    return args


def _check_vocabulary(corpus: Corpus, vocab_size: int) -> None:
    largest = int(corpus.tokens.max())
    if largest >= vocab_size:
        raise ValueError(f"the data has token id {largest} but the model's vocab_size is {vocab_size}: byte-level "
                         "data needs at least 256 (give the checkpoint directory a tokenizer, or a larger vocabulary)")


def train_one(config_path: str, args: argparse.Namespace, topology, corpus: Corpus) -> RunResult:
    """Train ``args.steps`` steps with the config at ``config_path``."""
    config = load_json_config(config_path)
    # The config's pipeline.partition_method wins over --partition-method.
    inputs, labels = first_micro_batch(corpus, config, args.context, args.seed)
    method, planning = partition_from_config(config, default=args.partition_method, sample=inputs, labels=labels)
    engine, loaded = build_engine(config, args.model, topology, seed=args.seed, pretrained=args.from_pretrained,
                                  dropout_seed=args.dropout_seed, partition_method=method,
                                  partition_planning=planning)
    rank = dist.get_rank()
    if loaded is not None and engine.grid.get_data_parallel_rank() == 0:
        print(f"{LABEL}: stage {engine.stage_id} loaded {len(loaded.names)} tensors ({loaded.bytes / 2**20:.1f} MiB) "
              f"from {len(loaded.files)} file(s)", flush=True)
    micro, accum = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    dp = topology.get_dim("data")
    global_batch = micro * accum * dp
    sampler = GlobalBatchSampler(corpus.num_windows(args.context), micro, accum, dp,
                                 engine.grid.get_data_parallel_rank(), args.steps, seed=args.seed)
    result = train_run(engine, micro_batches(corpus, sampler, args.context), config_path=config_path, config=config,
                       steps=args.steps, memory_step=args.memory_step, global_batch=global_batch,
                       progress_label=LABEL, show_progress=not args.no_progress, log_every=args.log_every)
    if args.save_params:
        save_parameters(engine.module, args.out_dir, result.name, rank)
    if rank == 0:
        print(summary_line(LABEL, result, topology_text(topology), global_batch, args.context), flush=True)
    del engine
    gc.collect()
    return result


def _model_meta(args: argparse.Namespace) -> dict:
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "max_position_embeddings", "tie_word_embeddings", "rms_norm_eps",
            "rope_parameters", "torch_dtype")
    values = args.model.to_dict()
    meta = {key: values[key] for key in keys if key in values}
    meta["attn_implementation"] = args.model._attn_implementation
    return meta


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        # Before any model state exists: frees of it inside a measured step are then counted exactly.
        track_cpu_allocations()
    deepspeed.init_distributed()
    topology = pipeline_topology(dist.get_world_size(), args.pp)
    tokenizer_dir = (args.from_pretrained if args.from_pretrained is not None and has_tokenizer(args.from_pretrained)
                     else None)
    corpus = rank0_first(lambda: load_tokens(args.cache_dir, tokenizer_dir))  # rank 0 writes the caches
    _check_vocabulary(corpus, args.model.vocab_size)
    if dist.get_rank() == 0:
        source = args.from_pretrained or "LlamaConfig, seeded"
        print(f"{LABEL}: {topology_text(topology)} on {dist.get_world_size()} ranks ({dist.get_backend()}); "
              f"model: {source}; data: {corpus.description}", flush=True)
    runs = [train_one(path, args, topology, corpus) for path in args.deepspeed_config]
    if dist.get_rank() == 0:
        meta = {"topology": topology_text(topology), "pp": args.pp, "dp": topology.get_dim("data"),
                "world_size": dist.get_world_size(), "data": corpus.description,
                "corpus_sha256": corpus.manifest["sha256"], "corpus_tokens": corpus.manifest["tokens"],
                "python": corpus.manifest["python"], "tokenizer": tokenizer_dir,
                "from_pretrained": args.from_pretrained, "seed": args.seed, "dropout_seed": args.dropout_seed,
                "steps": args.steps, "memory_step": args.memory_step, "context": args.context,
                "model": _model_meta(args), "partition_method": args.partition_method,
                "torch": torch.__version__, "deepspeed": deepspeed.__version__}
        unit = "next-byte" if tokenizer_dir is None else "next-token"
        paths = write_loss_outputs(Path(args.out_dir), runs, {"meta": meta, "runs": [asdict(run) for run in runs]},
                                   f"Llama pipeline on Python stdlib text, {meta['topology']}",
                                   f"training loss ({unit} cross-entropy, nats)")
        print(f"{LABEL}: wrote {paths['csv']}, {paths['png']} and {paths['summary']}", flush=True)
    dist.barrier()


if __name__ == "__main__":
    main()
