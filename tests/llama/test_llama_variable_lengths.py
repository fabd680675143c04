"""The Llama example under the ``deepspeed`` launcher with ``--variable-lengths``
(each sample its own length, each micro-batch padded to its longest; the
module built with ``dynamic_shape=True``), pp=2 on 2 ranks: no checkpointing,
then planned under ``configs/variable_lengths.json`` (a budget per stage and
``max_sequence_length``).

Asserted: ``summary.json`` has every step's peak of each stage and its budget,
no step of any stage goes over it, and the planned run's losses and final
parameters are those without checkpointing, bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ds_pipe_ckpt.testing import deepspeed_launch
from example_launches import LaunchOutputs

from examples.gpt.data import build_corpus

REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIG_DIR = REPO_ROOT / "examples" / "llama" / "configs"
CONFIGS = ("none", "variable_lengths")
STEPS = 6
TIMEOUT = 300  # seconds; about 30 s on 2 idle cores


@pytest.fixture(scope="module")
def launch(tmp_path_factory) -> LaunchOutputs:
    root = tmp_path_factory.mktemp("llama-variable")
    build_corpus(root / "cache")
    out_dir = root / "out"
    deepspeed_launch(REPO_ROOT / "examples" / "llama" / "train.py", 2,
                     ["--pp", "2", "--steps", str(STEPS), "--variable-lengths", "--cache-dir", str(root / "cache"),
                      "--out-dir", str(out_dir), "--save-params", "--no-progress",
                      "--deepspeed_config", *[str(CONFIG_DIR / f"{name}.json") for name in CONFIGS]],
                     root / "logs", timeout=TIMEOUT, cwd=REPO_ROOT)
    return LaunchOutputs("llama variable lengths", json.loads((out_dir / "summary.json").read_text()), out_dir)


def test_planned_losses_and_parameters_are_those_without_checkpointing(launch):
    assert launch.summary["meta"]["variable_lengths"] is True
    assert launch.run("variable_lengths")["checkpointing"] == "planned"
    assert launch.losses("variable_lengths") == launch.losses("none")
    assert len(set(launch.losses("none"))) == STEPS
    for rank in (0, 1):
        none, planned = launch.params("none", rank), launch.params("variable_lengths", rank)
        assert planned.keys() == none.keys()
        assert all(torch.equal(planned[key], none[key]) for key in none), rank


def test_every_step_of_every_stage_is_recorded_within_its_budget(launch):
    section = json.loads((CONFIG_DIR / "variable_lengths.json").read_text())["activation_checkpointing"]
    assert section["max_sequence_length"] == launch.summary["meta"]["context"]
    run = launch.run("variable_lengths")
    assert run["budget_bytes_by_stage"] == {str(s): int(mb * 2**20) for s, mb in enumerate(section["memory_budget_mb"])}
    for stage, peaks in run["step_peaks_by_stage"].items():
        assert len(peaks) == STEPS and None not in peaks, (stage, peaks)
        assert max(peaks) <= run["budget_bytes_by_stage"][stage], (stage, peaks, run["budget_bytes_by_stage"])
    assert sorted(run["step_peaks_by_stage"]) == ["0", "1"] and run["steps_over_budget"] == []
    # The budget binds: without checkpointing stage 0 peaks above it.
    assert launch.run("none")["peak_memory_by_stage"]["0"] > run["budget_bytes_by_stage"]["0"]
