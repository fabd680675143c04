"""The outputs of the examples' training launches, as their tests read them:
one launch per topology, made on first use and shared by the tests that need
it; a launch that failed fails every such test with its report."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Generic, Hashable, TypeVar

import torch

from ds_pipe_ckpt.testing import LaunchFailure

__all__ = ["LaunchOutputs", "LaunchCache"]

Key = TypeVar("Key", bound=Hashable)


@dataclass
class LaunchOutputs:
    """What one launch of an example's ``train.py`` wrote (``summary.json`` with
    its ``runs``; with ``--save-params``, every rank's final parameters)."""

    label: str
    summary: dict
    out_dir: Path

    def run(self, name: str) -> dict:
        for run in self.summary["runs"]:
            if run["name"] == name:
                return run
        raise KeyError(f"{self.label}: no run named {name!r}; ran {[r['name'] for r in self.summary['runs']]}")

    def losses(self, name: str) -> list[float]:
        return self.run(name)["losses"]

    def params(self, name: str, rank: int) -> dict[str, torch.Tensor]:
        return torch.load(self.out_dir / "params" / name / f"rank{rank}.pt", weights_only=True)


class LaunchCache(Generic[Key]):
    """``launch(key)`` once per key, on first use; a :class:`LaunchFailure` is
    kept and raised again for every later request of that key."""

    def __init__(self, launch: Callable[[Key], LaunchOutputs]):
        self._launch = launch
        self._done: dict[Key, LaunchOutputs | LaunchFailure] = {}

    def get(self, key: Key) -> LaunchOutputs:
        if key not in self._done:
            try:
                self._done[key] = self._launch(key)
            except LaunchFailure as failure:
                self._done[key] = failure
        outcome = self._done[key]
        if isinstance(outcome, LaunchFailure):
            raise outcome
        return outcome
