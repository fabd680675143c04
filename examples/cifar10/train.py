"""Train the AlexNet-style CIFAR-10 pipeline with DeepSpeed and ds_pipe_ckpt.

Launch it the way DeepSpeed jobs are launched::

    deepspeed --num_gpus 8 examples/cifar10/train.py --pp 2 --mp 2 \\
        --deepspeed_config examples/cifar10/configs/non_reentrant.json
    torchrun --nproc_per_node 8 examples/cifar10/train.py --pp 2 --mp 2 --deepspeed_config ...

The data-parallel size is ``world_size / (pp * mp)``. Batch sizes, optimizer
and activation checkpointing (``pipeline.activation_checkpoint_interval``,
``pipeline.use_reentrant``, ``activation_checkpointing``) come from the JSON.
Several configs may be given: each is trained in turn, in one launch, from the
same initial weights and in the same data order, so runs differ only in
their configuration.

Without a GPU, ``DS_ACCELERATOR=cpu`` is set (unless set already) and DeepSpeed
picks the gloo backend. Rank 0 shows a progress bar, prints one summary line
per run and writes ``loss.csv``, ``loss.png`` and ``summary.json`` into
``--out-dir``.
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

if __package__ in (None, ""):  # run as a script: make ``examples.cifar10`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import deepspeed  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology  # noqa: E402
from tqdm import tqdm  # noqa: E402

import ds_pipe_ckpt  # noqa: E402
from examples.cifar10.data import CifarData, load_cifar10, micro_batches  # noqa: E402
from examples.launching import add_launch_arguments, check_launch_arguments, save_parameters  # noqa: E402
from examples.sampling import GlobalBatchSampler  # noqa: E402
from examples.cifar10.model import ALEXNET_CHANNELS, alexnet_layers  # noqa: E402
from examples.cifar10.report import RunResult, summary_line, write_outputs  # noqa: E402
from examples.cifar10.tensor_parallel import seed_model_parallel_rng  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_launch_arguments(parser, steps=100, out_dir="runs/cifar10")
    parser.add_argument("--mp", type=int, default=1, help="tensor-parallel size of the classifier head")
    parser.add_argument("--data-dir", default=None,
                        help="torchvision CIFAR-10 root (holding cifar-10-batches-py); default "
                        "$CIFAR10_DATASET_PATH, else generated CIFAR-10-format data")
    parser.add_argument("--cache-dir", default=str(REPO_ROOT / ".cache" / "cifar10"),
                        help="where generated data is written")
    parser.add_argument("--channels", type=int, nargs=5, default=list(ALEXNET_CHANNELS),
                        help="output channels of the five convolutions")
    parser.add_argument("--hidden", type=int, default=256, help="hidden width of the classifier head")
    parser.add_argument("--dropout", type=float, default=0.1, help="dropout in the classifier head")
    parser.add_argument("--label-smoothing", type=float, default=0.1,
                        help="label smoothing of the cross-entropy loss")
    parser.add_argument("--partition-method", default="parameters",
                        help="PipelineModule partition_method")
    args = parser.parse_args(argv)
    check_launch_arguments(parser, args)
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


def _mode(module: ds_pipe_ckpt.PipelineModule) -> str:
    return "none" if module.activation_checkpoint_interval == 0 else module.checkpoint_mode


def build_engine(config_path: str, args: argparse.Namespace, layout: Layout):
    """Model and engine for one config, from the seeds: the same initial weights
    and dropout streams for every config and topology."""
    config = _load_config(config_path)
    torch.manual_seed(args.seed)
    seed_model_parallel_rng(args.seed if args.dropout_seed is None else args.dropout_seed, layout.tp_rank)
    layers = alexnet_layers(10, layout.tp_group, layout.tp_rank, layout.mp, channels=args.channels,
                            hidden=args.hidden, dropout=args.dropout)
    module = ds_pipe_ckpt.PipelineModule(layers=layers, topology=layout.topology,
                                         loss_fn=nn.CrossEntropyLoss(label_smoothing=args.label_smoothing),
                                         partition_method=args.partition_method)
    engine, _, _, _ = ds_pipe_ckpt.initialize(model=module, config=config,
                                              model_parameters=[p for p in module.parameters() if p.requires_grad])
    return engine, module


def train_one(config_path: str, args: argparse.Namespace, layout: Layout, data: CifarData) -> RunResult:
    """Train ``args.steps`` steps with the config at ``config_path``."""
    engine, module = build_engine(config_path, args, layout)
    micro, accum = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    global_batch = micro * accum * layout.dp
    sampler = GlobalBatchSampler(len(data.dataset), micro, accum, layout.dp, engine.grid.get_data_parallel_rank(),
                                 args.steps, seed=args.seed)
    batches = micro_batches(data.dataset, sampler)
    result = RunResult(name=Path(config_path).stem, config=str(config_path), checkpointing=_mode(module),
                       partition_activations=ds_pipe_ckpt.current_settings().config.partition_activations,
                       checkpoint_interval=module.activation_checkpoint_interval)

    bar = tqdm(total=args.steps, desc=result.name, unit="step", dynamic_ncols=True, mininterval=0.5,
               disable=layout.rank != 0 or args.no_progress)
    start = time.perf_counter()
    for _ in range(args.steps):
        step_start = time.perf_counter()
        loss = float(engine.train_batch(data_iter=batches))
        rate = global_batch / (time.perf_counter() - step_start)
        result.losses.append(loss)
        result.samples_per_s.append(rate)
        bar.set_postfix(loss=f"{loss:.4f}", samples_s=f"{rate:.0f}")
        bar.update()
    result.wall_s = time.perf_counter() - start
    bar.close()

    if args.save_params:
        save_parameters(module, args.out_dir, result.name, layout.rank)
    if layout.rank == 0:
        print(summary_line(result, str(layout), data.kind, global_batch), flush=True)
    del engine, module
    gc.collect()
    return result


def load_data(args: argparse.Namespace, layout: Layout) -> CifarData:
    """Rank 0 first (it writes generated data if the cache lacks it), then the others."""
    if layout.rank == 0:
        data = load_cifar10(args.data_dir, args.cache_dir, seed=args.seed, train=True)
    dist.barrier()
    if layout.rank != 0:
        data = load_cifar10(args.data_dir, args.cache_dir, seed=args.seed, train=True)
    return data


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    deepspeed.init_distributed()
    layout = Layout(args.pp, args.mp)
    data = load_data(args, layout)
    if layout.rank == 0:
        print(f"cifar10: {layout} on {dist.get_world_size()} ranks ({dist.get_backend()}); "
              f"data: {data.description}", flush=True)
    runs = [train_one(path, args, layout, data) for path in args.deepspeed_config]
    if layout.rank == 0:
        meta = {"topology": str(layout), "pp": layout.pp, "mp": layout.mp, "dp": layout.dp,
                "world_size": dist.get_world_size(), "data": data.description, "data_kind": data.kind,
                "seed": args.seed, "dropout_seed": args.dropout_seed, "steps": args.steps,
                "channels": args.channels, "hidden": args.hidden, "dropout": args.dropout,
                "label_smoothing": args.label_smoothing}
        paths = write_outputs(Path(args.out_dir), runs, meta)
        print(f"cifar10: wrote {paths['csv']}, {paths['png']} and {paths['summary']}", flush=True)
    dist.barrier()


if __name__ == "__main__":
    main()
