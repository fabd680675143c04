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
and data order. With ``--variable-lengths`` each sample has its own length
(at most ``--context``) and each micro-batch is padded to its longest; a
config with a budget then names ``activation_checkpointing.max_sequence_length``
(``configs/variable_lengths.json``).

Every rank measures the memory of one ``engine.train_batch()`` (the last step,
or ``--memory-step``); a run with a budget measures every step, and
``summary.json`` has every stage's step peaks and budget. Rank 0 shows progress (a bar in a terminal, else a line
every ``--log-every`` steps), prints one summary line per run (with the peak of
every pipeline stage) and writes ``loss.csv``, ``loss.png`` and
``summary.json`` into ``--out-dir``.

Without a GPU, ``DS_ACCELERATOR=cpu`` is set (unless set already) and DeepSpeed
picks the gloo backend.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``examples.llama`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.launching import default_to_cpu  # noqa: E402

default_to_cpu()  # before DeepSpeed is imported
from examples.gpt.data import Corpus  # noqa: E402
from examples.llama.data import load_tokens  # noqa: E402
from examples.llama.engine import DEFAULT_PARTITION_METHOD, build_engine  # noqa: E402
from examples.llama.model import ATTENTION_IMPLEMENTATIONS, small_config  # noqa: E402
from examples.llama.pretrained import has_tokenizer, load_config  # noqa: E402
from examples.text_training import TextExample, check_text_arguments, launch_text_example, text_parser  # noqa: E402

LABEL = "llama"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    defaults = small_config()
    parser = text_parser(__doc__, out_dir="runs/llama", context=64, partition_method=DEFAULT_PARTITION_METHOD,
                         cache_help="where the corpus (and its tokens under a checkpoint's tokenizer) is cached")
    parser.add_argument("--from-pretrained", metavar="DIR", default=None,
                        help="a Hugging Face Llama checkpoint directory (config.json, safetensors; a tokenizer "
                        "if any): its config and weights; the model-size options below are then ignored")
    parser.add_argument("--hidden", type=int, default=defaults.hidden_size, help="hidden size")
    parser.add_argument("--layers", type=int, default=defaults.num_hidden_layers, help="decoder layers")
    parser.add_argument("--heads", type=int, default=defaults.num_attention_heads, help="attention heads")
    parser.add_argument("--kv-heads", type=int, default=defaults.num_key_value_heads, help="key/value heads")
    parser.add_argument("--intermediate", type=int, default=defaults.intermediate_size, help="MLP width")
    parser.add_argument("--untied", action="store_true", help="a separate LM head weight (tie_word_embeddings false)")
    parser.add_argument("--attn-implementation", choices=ATTENTION_IMPLEMENTATIONS, default=None,
                        help="transformers' attention implementation (default: sdpa)")
    args = parser.parse_args(argv)
    args.mp = 1  # no tensor-parallel layers: check_launch_arguments checks --mp too
    check_text_arguments(parser, args)
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


def _load(cache_dir: str, tokenizer_dir: str | None, vocab_size: int) -> Corpus:
    """The tokens, checked against the model's vocabulary."""
    corpus = load_tokens(cache_dir, tokenizer_dir)
    largest = int(corpus.tokens.max())
    if largest >= vocab_size:
        raise ValueError(f"the data has token id {largest} but the model's vocab_size is {vocab_size}: byte-level "
                         "data needs at least 256 (give the checkpoint directory a tokenizer, or a larger vocabulary)")
    return corpus


def _build(args: argparse.Namespace, config: dict, topology, method: str, planning, dynamic_shape: bool):
    engine, loaded = build_engine(config, args.model, topology, seed=args.seed, pretrained=args.from_pretrained,
                                  dropout_seed=args.dropout_seed, partition_method=method,
                                  partition_planning=planning, dynamic_shape=dynamic_shape)
    if loaded is not None and engine.grid.get_data_parallel_rank() == 0:
        print(f"{LABEL}: stage {engine.stage_id} loaded {len(loaded.names)} tensors ({loaded.bytes / 2**20:.1f} MiB) "
              f"from {len(loaded.files)} file(s)", flush=True)
    return engine


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
    tokenizer_dir = (args.from_pretrained if args.from_pretrained is not None and has_tokenizer(args.from_pretrained)
                     else None)
    unit = "next-byte" if tokenizer_dir is None else "next-token"
    example = TextExample(label=LABEL, load=partial(_load, args.cache_dir, tokenizer_dir, args.model.vocab_size),
                          build=partial(_build, args), source=args.from_pretrained or "LlamaConfig, seeded",
                          meta={"tokenizer": tokenizer_dir, "from_pretrained": args.from_pretrained,
                                "model": _model_meta(args)},
                          title="Llama pipeline on Python stdlib text",
                          ylabel=f"training loss ({unit} cross-entropy, nats)")
    launch_text_example(example, args)


if __name__ == "__main__":
    main()
