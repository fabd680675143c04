"""Where the host time of a checkpointed call goes: steps of a stage under
cProfile, per checkpointed region, by the code it runs in.

cProfile adds its own cost to every Python call, so the Python-heavy groups
are overstated against the C++ ones: read the figures as where the time goes
and how many calls each path makes, not as step times (those are measured
without the profiler).
"""

from __future__ import annotations

import cProfile
import gc
import pstats
from dataclasses import dataclass
from typing import Sequence

from .measure import Stage
from .variants import Variant

__all__ = ["CallProfile", "GROUPS", "profile_variant", "markdown_lines"]

# (group, test on the profiler's (file, function name)), first match wins.
GROUPS = (
    ("ds_pipe_ckpt", lambda file, name: "/ds_pipe_ckpt/" in file),
    ("DeepSpeed", lambda file, name: "/deepspeed/" in file),
    ("torch.utils.checkpoint", lambda file, name: file.endswith("torch/utils/checkpoint.py")),
    ("autograd engine (backward ops included)", lambda file, name: "run_backward" in name),
    ("torch.nn modules", lambda file, name: "/torch/nn/" in file),
    ("torch's other Python (grad mode, autocast, RNG, dynamo)", lambda file, name: "/torch/" in file),
    ("torch built-ins (ops, hooks stack, RNG states)", lambda file, name: file == "~" and "torch" in name),
    ("Python built-ins and library", lambda file, name: True),
)


@dataclass
class CallProfile:
    """One profiled step of one variant, per checkpointed region."""

    variant: str
    calls: float  # Python-visible calls (functions and built-ins)
    seconds: dict[str, float]  # own time by group
    top: list[tuple[str, float, float]]  # (function, calls, own seconds) of ds_pipe_ckpt, most first


def _group(file: str, name: str) -> str:
    return next(group for group, matches in GROUPS if matches(file, name))


def profile_variant(stage: Stage, variant: Variant, regions: int, top: int = 8, calls: int = 2048) -> CallProfile:
    """Profile steps of ``variant`` on ``stage`` until about ``calls`` region
    calls are seen (after one unprofiled step: a region learns about itself on
    its first call), with the garbage collector off (its pauses land wherever
    it happens to run)."""
    steps = max(1, calls // regions)
    profiler = cProfile.Profile()
    with variant.configured():
        stage.time_step(variant.checkpoint)
        enabled = gc.isenabled()
        gc.disable()
        try:
            for _ in range(steps):
                stage.clear_grads()
                profiler.runcall(stage.step, variant.checkpoint)
        finally:
            if enabled:
                gc.enable()
    regions *= steps
    stats = pstats.Stats(profiler).stats
    seconds = {group: 0.0 for group, _ in GROUPS}
    ours = []
    calls = 0
    for (file, line, name), (_, count, own, _, _) in stats.items():
        group = _group(file, name)
        seconds[group] += own / regions
        calls += count
        if group == "ds_pipe_ckpt":
            ours.append((f"{file.rsplit('/ds_pipe_ckpt/', 1)[-1]}:{line}({name})", count / regions, own / regions))
    ours.sort(key=lambda entry: -entry[2])
    return CallProfile(variant.name, calls / regions, seconds, ours[:top])


def markdown_lines(profiles: Sequence[CallProfile]) -> list[str]:
    """A table of the groups per variant, then ds_pipe_ckpt's own functions."""
    if not profiles:
        return []
    lines = ["Profile (cProfile, garbage collector off), per region call: Python-visible calls and "
             "own time in us by where it is spent (profiler overhead included):", "",
             "| variant | calls | " + " | ".join(group for group, _ in GROUPS) + " |",
             "|---|---:|" + "---:|" * len(GROUPS)]
    for profile in profiles:
        lines.append(f"| {profile.variant} | {profile.calls:.0f} | "
                     + " | ".join(f"{profile.seconds[group] * 1e6:.1f}" for group, _ in GROUPS) + " |")
    for profile in profiles:
        if profile.top:
            lines += ["", f"{profile.variant}: ds_pipe_ckpt's own time per region call, largest first: "
                      + "; ".join(f"`{name}` {calls:.0f} x {seconds * 1e6:.1f} us" for name, calls, seconds in profile.top)]
    return lines + [""]
