"""``python -m ds_pipe_ckpt.parity_cli``: the gradient-parity check of the
installed DeepSpeed on local ranks, on a small model, in every checkpointing
mode it runs here; prints each stage's relative difference and exits 1 when one
is above the tolerance. ``make compat`` runs it for its gradient-parity column.

    python -m ds_pipe_ckpt.parity_cli --pp 2 4 --ga 4 --json parity.json

The model is a 15-layer MLP (Linear/Tanh), micro-batches of 2, SGD with
learning rate 1, one step; gradient clipping at 0.05 (below the model's norm,
so a wrong norm changes every update). On a CPU set ``DS_ACCELERATOR=cpu``.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

__all__ = ["MODES", "parity_of_modes", "main"]

# JSON settings per mode (the interval is the PipelineModule's argument).
MODES = {
    "none": {"interval": 0, "pipeline": {}},
    "non_reentrant": {"interval": 1, "pipeline": {"use_reentrant": False}},
    "reentrant": {"interval": 1, "pipeline": {"use_reentrant": True}},
}
WIDTH, DEPTH, MICRO_BATCH, CLIP = 16, 15, 2, 0.05


def _layers() -> list:
    import torch.nn as nn

    from .pipe import LayerSpec

    layers = [LayerSpec(nn.Linear, 8, WIDTH)]
    while len(layers) < DEPTH - 1:
        layers += [LayerSpec(nn.Tanh), LayerSpec(nn.Linear, WIDTH, WIDTH)]
    return layers[:DEPTH - 1] + [LayerSpec(nn.Linear, WIDTH, 4)]


def parity_of_modes(modes: list[str], pp: int, ga: int) -> dict[str, Any]:
    """On every rank of a job: each mode's :class:`~ds_pipe_ckpt.parity.ParityReport`."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    from .parity import check_gradient_parity

    dp = dist.get_world_size() // pp
    generator = torch.Generator().manual_seed(7)
    inputs = torch.randn(ga * dp, MICRO_BATCH, 8, generator=generator)
    micro_batches = [(x, x[..., :4].argmax(dim=-1)) for x in inputs]
    reports = {}
    for mode in modes:
        config = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": ga,
                  "train_batch_size": MICRO_BATCH * ga * dp, "steps_per_print": 10**9,
                  "gradient_clipping": CLIP, "pipeline": dict(MODES[mode]["pipeline"])}
        reports[mode] = check_gradient_parity(_layers(), nn.CrossEntropyLoss(), micro_batches, config,
                                              num_stages=pp, activation_checkpoint_interval=MODES[mode]["interval"])
    return reports


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ds_pipe_ckpt.parity_cli", description=__doc__.split("\n\n")[0])
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4], help="pipeline stages (one rank each)")
    parser.add_argument("--ga", type=int, default=4, help="gradient_accumulation_steps")
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=None,
                        help="default: every mode the installed DeepSpeed runs on this device")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)

    from . import compat
    from .testing import run_ranks

    modes = args.modes
    if modes is None:
        modes = [m for m in MODES if m != "reentrant" or compat.deepspeed_reentrant_runs()]
    results, ok = [], True
    for pp in args.pp:
        reports = run_ranks(parity_of_modes, pp, modes, pp, args.ga, timeout=600)[0]
        for mode, report in reports.items():
            ok = ok and report.ok
            results.append({"pp": pp, "ga": args.ga, "mode": mode, "ok": report.ok, "tolerance": report.tolerance,
                            "stages": [s.relative_difference for s in report.stages],
                            "update_ratios": [s.update_ratio for s in report.stages]})
            print(f"pp={pp} GA={args.ga} {mode:>13}: largest relative difference per stage "
                  f"{' '.join(f'{d:.2g}' for d in results[-1]['stages'])} "
                  f"({'within' if report.ok else 'ABOVE'} {report.tolerance:g})", flush=True)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"deepspeed": compat.deepspeed.__version__, "torch": compat.torch.__version__,
                       "results": results}, out, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
