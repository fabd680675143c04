"""Train a CIFAR-10 pipeline (AlexNet-style, or a ResNet with BatchNorm) with
DeepSpeed and ds_pipe_ckpt.

Launch it the way DeepSpeed jobs are launched::

    deepspeed --num_gpus 8 examples/cifar10/train.py --pp 2 --mp 2 \\
        --deepspeed_config examples/cifar10/configs/non_reentrant.json
    deepspeed --num_gpus 8 examples/cifar10/train.py --pp 2 --mp 2 \\
        --deepspeed_config examples/cifar10/configs/resnet_non_reentrant.json
    torchrun --nproc_per_node 8 examples/cifar10/train.py --pp 2 --mp 2 --deepspeed_config ...

The model is ``--model`` (default ``alexnet``), unless a config names one in
this example's own section, ``"cifar10": {"model": "resnet"}`` (DeepSpeed
ignores top-level keys it does not know): the ``resnet_*.json`` configs do, so
one launch can train both models.

The data-parallel size is ``world_size / (pp * mp)``. Batch sizes, optimizer
and activation checkpointing (``pipeline.activation_checkpoint_interval``,
``pipeline.use_reentrant``, ``activation_checkpointing``) come from the JSON.
Several configs may be given: each is trained in turn, in one launch, from the
same initial weights and in the same data order, so runs of one model differ
only in their configuration. After training, each run is evaluated in eval
mode on the test split through the engine (``eval_batch``).

Without a GPU, ``DS_ACCELERATOR=cpu`` is set (unless set already) and DeepSpeed
picks the gloo backend. Rank 0 shows a progress bar, prints one summary line
per run and writes ``loss.csv``, ``loss.png`` and ``summary.json`` (losses,
eval loss and accuracy per run) into ``--out-dir``.
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
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

if __package__ in (None, ""):  # run as a script: make ``examples.cifar10`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import deepspeed  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology  # noqa: E402

import ds_pipe_ckpt  # noqa: E402
from examples.cifar10.data import CifarData, load_cifar10, micro_batches  # noqa: E402
from examples.launching import add_launch_arguments, check_launch_arguments, save_parameters  # noqa: E402
from examples.sampling import GlobalBatchSampler  # noqa: E402
from examples.training import add_progress_arguments, make_progress  # noqa: E402
from examples.cifar10.model import (ALEXNET_CHANNELS, MODELS, RESNET_WIDTHS, alexnet_layers,  # noqa: E402
                                    resnet_layers)
from examples.cifar10.report import RunResult, summary_line, write_outputs  # noqa: E402
from examples.cifar10.tensor_parallel import seed_model_parallel_rng  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]
# This example's own section of a DeepSpeed JSON config: {"cifar10": {"model": "resnet"}}.
CONFIG_SECTION = "cifar10"
CONFIG_SECTION_KEYS = ("model",)
DEFAULT_MODEL = "alexnet"
# Label of the padding that fills the last evaluation micro-batches (ignored).
_PAD_LABEL = -100


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_launch_arguments(parser, steps=100, out_dir="runs/cifar10")
    add_progress_arguments(parser)
    parser.add_argument("--mp", type=int, default=1, help="tensor-parallel size of the classifier head")
    parser.add_argument("--data-dir", default=None,
                        help="torchvision CIFAR-10 root (holding cifar-10-batches-py); default "
                        "$CIFAR10_DATASET_PATH, else generated CIFAR-10-format data")
    parser.add_argument("--cache-dir", default=str(REPO_ROOT / ".cache" / "cifar10"),
                        help="where generated data is written")
    parser.add_argument("--model", choices=MODELS, default=None,
                        help=f"model of the configs that do not name one in their \"{CONFIG_SECTION}\" "
                        f"section (default {DEFAULT_MODEL}); a config naming another model is an error")
    parser.add_argument("--channels", type=int, nargs=5, default=list(ALEXNET_CHANNELS),
                        help="alexnet: output channels of the five convolutions")
    parser.add_argument("--widths", type=int, nargs="+", default=list(RESNET_WIDTHS),
                        help="resnet: channels of each resolution stage (32x32, 16x16, 8x8, ...)")
    parser.add_argument("--blocks", type=int, default=1, help="resnet: basic blocks per width")
    parser.add_argument("--resnet-steps", type=int, default=None,
                        help="optimizer steps of each resnet run; default --steps")
    parser.add_argument("--eval-samples", type=int, default=None,
                        help="test-split images evaluated after each run (the first N); default all, "
                        "0 for no evaluation")
    parser.add_argument("--hidden", type=int, default=256, help="hidden width of the classifier head")
    parser.add_argument("--dropout", type=float, default=0.1, help="dropout in the classifier head")
    parser.add_argument("--label-smoothing", type=float, default=0.1,
                        help="label smoothing of the cross-entropy loss")
    parser.add_argument("--partition-method", default="parameters",
                        help="PipelineModule partition_method")
    args = parser.parse_args(argv)
    check_launch_arguments(parser, args)
    for name in ("resnet_steps", "blocks"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.log_every < 1:
        parser.error(f"--log-every must be >= 1, got {args.log_every}")
    if args.eval_samples is not None and args.eval_samples < 0:
        parser.error(f"--eval-samples must be >= 0, got {args.eval_samples}")
    try:
        # Every config read and its model resolved before any training.
        args.models = [config_model(path, _load_config(path), args.model) for path in args.deepspeed_config]
    except (OSError, ValueError) as error:
        parser.error(str(error))
    return args


class Layout:
    """This rank's place in the (pipe, data, model) grid, and its tensor-parallel
    group: the ranks that differ only in the model coordinate (DeepSpeed's
    slice-parallel group). Created here because the layers need it before
    ``PipelineModule`` builds its own grid."""

    def __init__(self, pp: int, mp: int):
        world = dist.get_world_size()
        if world % (pp * mp):
            raise ValueError(f"world size {world} is not divisible by pp * mp = {pp} * {mp}")
        self.pp, self.mp, self.dp = pp, mp, world // (pp * mp)
        self.rank = dist.get_rank()
        self.topology = PipeModelDataParallelTopology(num_pp=pp, num_mp=mp, num_dp=self.dp)
        self.tp_rank = self.topology.get_coord(self.rank).model
        self.tp_group = None
        # Every rank takes part in creating every group.
        for ranks in self.topology.get_axis_comm_lists("model"):
            group = dist.new_group(ranks)
            if self.rank in ranks:
                self.tp_group = group

    def __str__(self) -> str:
        return f"pp={self.pp} mp={self.mp} dp={self.dp}"


def _load_config(path: str) -> dict:
    with open(path) as handle:
        config = json.load(handle)
    if "optimizer" not in config:
        raise ValueError(f"{path}: no \"optimizer\" section; this example builds its optimizer from the "
                         "config, e.g. {\"type\": \"Adam\", \"params\": {\"lr\": 0.001, \"torch_adam\": true}}")
    return config


def config_model(path: str, config: dict, flag: str | None) -> str:
    """The model a config trains: its ``"cifar10": {"model": ...}``, else
    ``--model`` (``flag``), else ``alexnet``. A config and a flag that name
    different models are an error."""
    section = config.get(CONFIG_SECTION)
    if section is None:
        return flag or DEFAULT_MODEL
    if not isinstance(section, dict) or set(section) - set(CONFIG_SECTION_KEYS):
        raise ValueError(f"{path}: \"{CONFIG_SECTION}\" must be an object with the keys "
                         f"{list(CONFIG_SECTION_KEYS)}, got {section!r}")
    model = section.get("model")
    if model is None:
        return flag or DEFAULT_MODEL
    if model not in MODELS:
        raise ValueError(f"{path}: {CONFIG_SECTION}.model = {model!r} is not one of {list(MODELS)}")
    if flag is not None and flag != model:
        raise ValueError(f"{path} names the model {model!r} ({CONFIG_SECTION}.model) but --model is {flag!r}")
    return model


def steps_of(model: str, args: argparse.Namespace) -> int:
    return args.resnet_steps if model == "resnet" and args.resnet_steps is not None else args.steps


def _mode(module: ds_pipe_ckpt.PipelineModule) -> str:
    return "none" if module.activation_checkpoint_interval == 0 else module.checkpoint_mode


def build_layers(model: str, args: argparse.Namespace, layout: Layout) -> list[nn.Module]:
    if model == "resnet":
        return resnet_layers(10, layout.tp_group, layout.tp_rank, layout.mp, widths=args.widths,
                             blocks=args.blocks, hidden=args.hidden, dropout=args.dropout)
    return alexnet_layers(10, layout.tp_group, layout.tp_rank, layout.mp, channels=args.channels,
                          hidden=args.hidden, dropout=args.dropout)


def build_engine(config_path: str, model: str, args: argparse.Namespace, layout: Layout):
    """Model and engine for one config, from the seeds: the same initial weights
    and dropout streams for every config and topology."""
    config = _load_config(config_path)
    torch.manual_seed(args.seed)
    seed_model_parallel_rng(args.seed if args.dropout_seed is None else args.dropout_seed, layout.tp_rank)
    layers = build_layers(model, args, layout)
    module = ds_pipe_ckpt.PipelineModule(layers=layers, topology=layout.topology,
                                         loss_fn=nn.CrossEntropyLoss(label_smoothing=args.label_smoothing),
                                         partition_method=args.partition_method)
    engine, _, _, _ = ds_pipe_ckpt.initialize(model=module, config=config,
                                              model_parameters=[p for p in module.parameters() if p.requires_grad])
    return engine, module


class EvalData:
    """The test images each data-parallel rank evaluates, as micro-batches,
    built on first use and reused by every run of the launch.

    Evaluation step ``j`` covers items ``[j * G, (j + 1) * G)`` of the test split
    (in order), ``G = micro * dp``; rank ``d`` takes the ``d``-th ``micro`` of
    them. Past the last item, micro-batches are filled with zero images labelled
    -100 (ignored), so every topology evaluates exactly the same images.
    """

    def __init__(self, data: CifarData | None, samples: int):
        self.data, self.samples = data, samples
        self._cache: dict[tuple[int, int, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def micro_batches(self, micro: int, dp: int, dp_rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        key = (micro, dp, dp_rank)
        if key not in self._cache:
            batches = []
            per_step = micro * dp
            for first in range(dp_rank * micro, -(-self.samples // per_step) * per_step, per_step):
                items = [self.data.dataset[i] for i in range(first, min(first + micro, self.samples))]
                images = [image for image, _ in items]
                labels = [label for _, label in items]
                padding = micro - len(items)
                if padding:
                    shape = images[0].shape if images else self.data.dataset[0][0].shape
                    images += [torch.zeros(shape)] * padding
                    labels += [_PAD_LABEL] * padding
                batches.append((torch.stack(images), torch.tensor(labels, dtype=torch.long)))
            self._cache[key] = batches
        return self._cache[key]


def evaluate(engine, module: ds_pipe_ckpt.PipelineModule, layout: Layout, eval_data: EvalData,
             label_smoothing: float) -> tuple[int, float]:
    """``(correct, summed loss)`` over the first ``eval_data.samples`` test images,
    in eval mode, through the pipeline engine, on every rank.

    One ``engine.eval_batch`` with as many micro-batches as this rank's share:
    with ``compute_loss=False`` and ``reduce_output=None`` it returns, on the
    last stage, the logits of every micro-batch in order (``return_logits``
    keeps only the last). The loss is the training criterion (cross-entropy with
    ``label_smoothing``) summed over the images, accumulated in float64. The last
    stage's first tensor-parallel rank of each data-parallel rank contributes
    its counts to an all-reduce over all ranks.
    """
    micro = engine.train_micro_batch_size_per_gpu()
    batches = eval_data.micro_batches(micro, layout.dp, engine.grid.get_data_parallel_rank())
    labels_seen: list[torch.Tensor] = []

    def feed():
        for images, labels in batches:
            labels_seen.append(labels)  # the last stage consumes micro-batches in order
            yield images, labels

    # Without a loss, the last stage also adds each micro-batch's logits into the
    # engine's running total_loss, which train_batch resets but eval_batch does
    # not: after training it holds the last step's scalar loss, and adding
    # [micro, classes] logits to it fails. Start the total afresh, as train_batch does.
    engine.total_loss = None
    outputs = engine.eval_batch(feed(), compute_loss=False, reduce_output=None, num_micro_batches=len(batches))
    totals = torch.zeros(2, dtype=torch.float64, device=engine.device)
    if engine.is_last_stage() and layout.tp_rank == 0:
        assert len(outputs) == len(labels_seen) == len(batches), (len(outputs), len(labels_seen), len(batches))
        for logits, labels in zip(outputs, labels_seen):
            labels = labels.to(logits.device)
            valid = labels != _PAD_LABEL
            totals[0] += (logits.argmax(dim=1)[valid] == labels[valid]).sum().double()
            totals[1] += F.cross_entropy(logits.float(), labels, ignore_index=_PAD_LABEL, reduction="sum",
                                         label_smoothing=label_smoothing).double()
    dist.all_reduce(totals)
    return int(totals[0].item()), float(totals[1].item())


def train_one(config_path: str, model: str, args: argparse.Namespace, layout: Layout, data: CifarData,
              eval_data: EvalData) -> RunResult:
    """Train with the config at ``config_path``, then evaluate on the test split."""
    steps = steps_of(model, args)
    engine, module = build_engine(config_path, model, args, layout)
    micro, accum = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    global_batch = micro * accum * layout.dp
    sampler = GlobalBatchSampler(len(data.dataset), micro, accum, layout.dp, engine.grid.get_data_parallel_rank(),
                                 steps, seed=args.seed)
    batches = micro_batches(data.dataset, sampler)
    result = RunResult(name=Path(config_path).stem, config=str(config_path), checkpointing=_mode(module),
                       partition_activations=ds_pipe_ckpt.current_settings().config.partition_activations,
                       checkpoint_interval=module.activation_checkpoint_interval, model=model,
                       gradient_accumulation_steps=accum)

    bar = make_progress(steps, result.name, enabled=layout.rank == 0 and not args.no_progress,
                        log_every=args.log_every)
    start = time.perf_counter()
    for _ in range(steps):
        step_start = time.perf_counter()
        loss = float(engine.train_batch(data_iter=batches))
        rate = global_batch / (time.perf_counter() - step_start)
        result.losses.append(loss)
        result.samples_per_s.append(rate)
        bar.set_postfix(loss=f"{loss:.4f}", samples_s=f"{rate:.0f}")
        bar.update()
    result.wall_s = time.perf_counter() - start
    bar.close()

    if eval_data.samples:
        start = time.perf_counter()
        correct, loss_sum = evaluate(engine, module, layout, eval_data, args.label_smoothing)
        result.eval_samples, result.eval_correct = eval_data.samples, correct
        result.eval_loss, result.eval_accuracy = loss_sum / eval_data.samples, correct / eval_data.samples
        result.eval_s = time.perf_counter() - start

    if args.save_params:
        save_parameters(module, args.out_dir, result.name, layout.rank)
    if layout.rank == 0:
        print(summary_line(result, str(layout), data.kind, global_batch), flush=True)
    del engine, module
    gc.collect()
    return result


def load_data(args: argparse.Namespace, layout: Layout) -> tuple[CifarData, EvalData]:
    """The training split and the test images to evaluate. Rank 0 first (it
    writes generated data if the cache lacks it), then the others."""
    if layout.rank == 0:
        data = load_cifar10(args.data_dir, args.cache_dir, seed=args.seed, train=True)
    dist.barrier()
    if layout.rank != 0:
        data = load_cifar10(args.data_dir, args.cache_dir, seed=args.seed, train=True)
    if args.eval_samples == 0:
        return data, EvalData(None, 0)
    test = load_cifar10(args.data_dir, args.cache_dir, seed=args.seed, train=False)
    samples = len(test.dataset) if args.eval_samples is None else args.eval_samples
    if samples > len(test.dataset):
        raise ValueError(f"--eval-samples {samples} > the {len(test.dataset)} images of the test split")
    return data, EvalData(test, samples)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    deepspeed.init_distributed()
    layout = Layout(args.pp, args.mp)
    data, eval_data = load_data(args, layout)
    if layout.rank == 0:
        evaluated = (f"; evaluation: the first {eval_data.samples} of {eval_data.data.description}"
                     if eval_data.samples else "; no evaluation")
        print(f"cifar10: {layout} on {dist.get_world_size()} ranks ({dist.get_backend()}); "
              f"data: {data.description}{evaluated}", flush=True)
    runs = [train_one(path, model, args, layout, data, eval_data)
            for path, model in zip(args.deepspeed_config, args.models)]
    if layout.rank == 0:
        meta = {"topology": str(layout), "pp": layout.pp, "mp": layout.mp, "dp": layout.dp,
                "world_size": dist.get_world_size(), "data": data.description, "data_kind": data.kind,
                "eval_data": eval_data.data.description if eval_data.samples else None,
                "eval_samples": eval_data.samples,
                "seed": args.seed, "dropout_seed": args.dropout_seed, "steps": args.steps,
                "resnet_steps": steps_of("resnet", args), "models": sorted(set(args.models)),
                "channels": args.channels, "widths": args.widths, "blocks": args.blocks,
                "hidden": args.hidden, "dropout": args.dropout,
                "label_smoothing": args.label_smoothing}
        paths = write_outputs(Path(args.out_dir), runs, meta)
        print(f"cifar10: wrote {paths['csv']}, {paths['png']} and {paths['summary']}", flush=True)
        if data.generated:
            print("cifar10: the data are generated (a fixed pattern per class plus noise), not CIFAR-10: a test "
                  "accuracy near 100% shows that training learns and that the runs agree, not skill on CIFAR-10; "
                  "for the real images set CIFAR10_DATASET_PATH (or --data-dir) to a torchvision CIFAR-10 root "
                  "(the folder holding cifar-10-batches-py/)", flush=True)
    dist.barrier()


if __name__ == "__main__":
    main()
