"""GPT pipeline example under the ``deepspeed`` launcher: activation
checkpointing changes memory, never the math.

Two launches of ``examples/gpt/train.py`` train the same model (tied token
embedding and LM head, dropout 0.1 on) from the same initial weights, in the
same data order, once per JSON config:

* pp=2 on 2 ranks: no checkpointing, reentrant, non-reentrant, selective
  (``activation_checkpointing.policy``), non-reentrant with
  ``cpu_checkpointing``, and planned (``memory_budget_mb``: the planner
  measures each stage on its first step and follows its plan from the second);
* pp=2 x mp=2 on 4 ranks: no checkpointing and non-reentrant with
  ``partition_activations`` (checkpoint inputs sharded across the
  model-parallel pair);
* pp=2 on 2 ranks with ``--variable-lengths`` (each sample its own length,
  each micro-batch padded to its longest): no checkpointing, and planned
  (``variable_lengths.json``: a budget per stage and ``max_sequence_length``).

Asserted (CPU, fp32): every checkpointed run reproduces the run without
checkpointing of its launch exactly, every loss and every final parameter on
every rank; the two stages' copies of the tied embedding/head weight are
identical after training and differ from their initial value; the loss
decreases; checkpointing lowers every stage's peak memory; the outputs are
written; with variable lengths, every step's peak of every stage (in
``summary.json``) stays within that stage's budget.
"""

from __future__ import annotations

import functools
import json
import statistics
from pathlib import Path

import pytest
import torch

from ds_pipe_ckpt.testing import deepspeed_launch
from example_launches import LaunchCache, LaunchOutputs

from examples.gpt.data import build_corpus
from examples.gpt.model import EMBED_KEY, GPTConfig, TokenEmbedding

REPO_ROOT = Path(__file__).resolve().parents[2]
TRAIN_SCRIPT = REPO_ROOT / "examples" / "gpt" / "train.py"
CONFIG_DIR = REPO_ROOT / "examples" / "gpt" / "configs"

STEPS = 8
SEED = 0
BASELINE = "none"
# (pp, mp) -> the configs its launch trains, baseline first.
LAUNCHES = {
    (2, 1): (BASELINE, "reentrant", "non_reentrant", "selective", "cpu_offload", "planned", "planned_partition"),
    (2, 2): (BASELINE, "non_reentrant_partitioned"),
}
# The variable-length launch: its key in the cache, and its configs.
VARIABLE = (2, 1, "variable-lengths")
VARIABLE_CONFIGS = (BASELINE, "variable_lengths")
LAUNCH_TIMEOUT = 300  # seconds; about 25 s (2 ranks) and 40 s (4 ranks) on 2 idle cores
TIED_WEIGHT = f"tied_modules.{EMBED_KEY}.weight"


def launch_topology(root: Path, cache_dir: Path, key: tuple) -> LaunchOutputs:
    """One ``deepspeed`` launch training every config of ``key``: (pp, mp) of
    :data:`LAUNCHES`, or :data:`VARIABLE`."""
    pp, mp, *flags = key
    folder = root / "-".join([f"pp{pp}", f"mp{mp}", *flags])
    out_dir = folder / "out"
    names = VARIABLE_CONFIGS if key == VARIABLE else LAUNCHES[key]
    configs = [str(CONFIG_DIR / f"{name}.json") for name in names]
    args = ["--pp", str(pp), "--mp", str(mp), "--steps", str(STEPS), "--seed", str(SEED),
            "--cache-dir", str(cache_dir), "--out-dir", str(out_dir), "--save-params", "--no-progress",
            *[f"--{flag}" for flag in flags], "--deepspeed_config", *configs]
    deepspeed_launch(TRAIN_SCRIPT, pp * mp, args, folder / "logs", timeout=LAUNCH_TIMEOUT, cwd=REPO_ROOT)
    return LaunchOutputs(" ".join([f"pp={pp} mp={mp}", *flags]), json.loads((out_dir / "summary.json").read_text()), out_dir)


@pytest.fixture(scope="module")
def launches(tmp_path_factory) -> LaunchCache:
    root = tmp_path_factory.mktemp("gpt")
    build_corpus(root / "cache")  # once, before the first launch
    return LaunchCache(functools.partial(launch_topology, root, root / "cache"))


def _checkpointed_cases():
    for (pp, mp), names in LAUNCHES.items():
        for name in names[1:]:
            yield pytest.param(pp, mp, name, id=f"pp{pp}-mp{mp}-{name}")


def _first_difference(actual: list[float], expected: list[float]) -> str:
    diffs = [(step, a, e) for step, (a, e) in enumerate(zip(actual, expected), start=1) if a != e]
    if not diffs:
        return "no step differs"
    step, a, e = diffs[0]
    return (f"{len(diffs)} steps differ, first at step {step}: {a!r} vs {e!r}; "
            f"max abs diff {max(abs(a - e) for _, a, e in diffs):.3g}")


@pytest.mark.parametrize("pp, mp, name", list(_checkpointed_cases()))
def test_checkpointing_reproduces_training_without_it(launches, pp, mp, name):
    launch = launches.get((pp, mp))
    baseline, run = launch.run(BASELINE), launch.run(name)
    assert (baseline["checkpointing"], baseline["checkpoint_interval"]) == ("none", 0)
    expected = {"reentrant": ("reentrant", 1), "planned": ("planned", 0),
                "planned_partition": ("planned", 0)}.get(name, ("non_reentrant", 1))
    assert (run["checkpointing"], run["checkpoint_interval"]) == expected, run
    assert run["policy"] == ("selective" if name == "selective" else None)
    assert run["partition_activations"] == (name == "non_reentrant_partitioned")
    assert run["cpu_checkpointing"] == (name == "cpu_offload")

    assert len(run["losses"]) == STEPS
    assert run["losses"] == baseline["losses"], _first_difference(run["losses"], baseline["losses"])
    assert run["partition_method"] == ("planned" if name == "planned_partition" else "type:Block")
    if name == "planned_partition":
        # Cut elsewhere: the same parameters, held by other ranks. The tied
        # gradient is the sum of the two stages' parts either way (two terms:
        # the same in any order), so still bit for bit.
        ranks = range(pp * mp)
        expected = {k: v for rank in ranks for k, v in launch.params(BASELINE, rank).items()}
        actual = {k: v for rank in ranks for k, v in launch.params(name, rank).items()}
        assert actual.keys() == expected.keys()
        assert not [key for key in expected if not torch.equal(actual[key], expected[key])]
        return
    for rank in range(pp * mp):
        expected, actual = launch.params(BASELINE, rank), launch.params(name, rank)
        assert actual.keys() == expected.keys()
        differing = [key for key in expected if not torch.equal(actual[key], expected[key])]
        assert not differing, (f"rank {rank}: final parameters {differing} differ from the run without "
                               "checkpointing (max abs diff "
                               f"{max((actual[k] - expected[k]).abs().max().item() for k in differing):.3g})")


@pytest.mark.parametrize("name", LAUNCHES[(2, 1)])
def test_tied_embedding_and_head_share_one_trained_weight(launches, name):
    """Stage 0 (embedding) and stage 1 (LM head) each hold a copy of the tied
    weight: DeepSpeed all-reduces its gradient across them, so they stay equal
    while both are trained."""
    launch = launches.get((2, 1))
    first, last = launch.params(name, 0), launch.params(name, 1)
    assert TIED_WEIGHT in first and TIED_WEIGHT in last
    assert torch.equal(first[TIED_WEIGHT], last[TIED_WEIGHT])
    model = GPTConfig(**{k: v for k, v in launch.summary["meta"]["model"].items()})
    initial = TokenEmbedding(model, init_seed=SEED * 100_003).weight.detach()
    assert first[TIED_WEIGHT].shape == initial.shape == (model.vocab_size, model.dim)
    assert not torch.equal(first[TIED_WEIGHT], initial)
    # The head has no weight of its own: besides the numbered layers' (blocks, final
    # norm), the last stage holds only the tied module.
    assert [key for key in last if not key.split(".")[0].isdigit()] == [TIED_WEIGHT]


@pytest.mark.parametrize("pp, mp", list(LAUNCHES))
def test_loss_decreases(launches, pp, mp):
    for run in launches.get((pp, mp)).summary["runs"]:
        first, last = statistics.fmean(run["losses"][:2]), statistics.fmean(run["losses"][-2:])
        # Byte-level text starts at ln(256) = 5.55 nats; 8 steps of Adam at lr 1e-3 take it below 4.9.
        assert 5.2 < first < 5.7 and last < first - 0.5, (run["name"], run["losses"])


@pytest.mark.parametrize("pp, mp", list(LAUNCHES))
def test_full_checkpointing_lowers_every_stage_peak(launches, pp, mp):
    """Recomputing whole blocks lowers every stage's peak (measured: about 0.4 x
    on stage 0, 0.5-0.7 x on stage 1). Selective checkpointing keeps the matmul
    outputs, so how much it saves is the benchmark's business
    (``python -m benchmarks.pipeline``), not asserted here."""
    launch = launches.get((pp, mp))
    none = launch.run(BASELINE)["peak_memory_by_stage"]
    assert sorted(none) == [str(s) for s in range(pp)] and all(v > 0 for v in none.values())
    for run in launch.summary["runs"][1:]:
        peaks = run["peak_memory_by_stage"]
        assert peaks.keys() == none.keys() and all(v > 0 for v in peaks.values())
        assert len(run["peak_memory_by_rank"]) == pp * mp
        if run["policy"] is None:
            assert all(peaks[s] < none[s] for s in none), (run["name"], peaks, none)


def test_planned_run_keeps_every_stage_within_its_budget(launches):
    """The planned config's budget (``memory_budget_mb``: 5 MiB per stage, about half
    of stage 0's peak without checkpointing) holds on every stage in the measured
    (last) step."""
    launch = launches.get((2, 1))
    budget = json.loads((CONFIG_DIR / "planned.json").read_text())["activation_checkpointing"]["memory_budget_mb"]
    none, planned = launch.run(BASELINE)["peak_memory_by_stage"], launch.run("planned")["peak_memory_by_stage"]
    assert none["0"] > budget * 2**20, "the budget must make stage 0 checkpoint"
    assert all(peak <= budget * 2**20 for peak in planned.values()), planned


def test_writes_loss_curve_and_summary(launches):
    launch = launches.get((2, 1))
    meta = launch.summary["meta"]
    assert (meta["pp"], meta["mp"], meta["dp"], meta["steps"]) == (2, 1, 1, STEPS)
    assert len(meta["corpus_sha256"]) == 64 and "standard library" in meta["data"]
    assert [run["name"] for run in launch.summary["runs"]] == list(LAUNCHES[(2, 1)])
    rows = (launch.out_dir / "loss.csv").read_text().splitlines()
    assert rows[0] == "run,step,loss,samples_per_s"
    assert len(rows) == 1 + STEPS * len(LAUNCHES[(2, 1)])
    assert float(rows[1].split(",")[2]) == launch.run(BASELINE)["losses"][0]  # printed exactly
    assert (launch.out_dir / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_variable_lengths_reproduce_training_without_checkpointing(launches):
    launch = launches.get(VARIABLE)
    assert launch.summary["meta"]["variable_lengths"] is True
    baseline, run = launch.run(BASELINE), launch.run("variable_lengths")
    assert run["checkpointing"] == "planned" and len(run["losses"]) == STEPS
    assert run["losses"] == baseline["losses"], _first_difference(run["losses"], baseline["losses"])
    assert run["losses"] != launches.get((2, 1)).run(BASELINE)["losses"]  # other data than fixed lengths
    for rank in range(2):
        expected, actual = launch.params(BASELINE, rank), launch.params("variable_lengths", rank)
        assert actual.keys() == expected.keys()
        assert not [key for key in expected if not torch.equal(actual[key], expected[key])], rank


def test_variable_lengths_keep_every_step_of_every_stage_within_its_budget(launches):
    """``summary.json`` has each stage's budget and every step's peak: step 1
    less what it allocates once (the optimizer's state, the pipeline buffers),
    the planner's measuring step and first planned step, then ours around
    ``train_batch``. The budget (5 MiB per stage) is about half of stage 0's
    peak without checkpointing."""
    launch = launches.get(VARIABLE)
    section = json.loads((CONFIG_DIR / "variable_lengths.json").read_text())["activation_checkpointing"]
    assert section["max_sequence_length"] == GPTConfig().context
    run, none = launch.run("variable_lengths"), launch.run(BASELINE)
    budgets = {str(stage): int(mb * 2**20) for stage, mb in enumerate(section["memory_budget_mb"])}
    assert run["budget_bytes_by_stage"] == budgets
    assert none["peak_memory_by_stage"]["0"] > budgets["0"] * 1.5, "the budget must make stage 0 checkpoint"
    peaks = run["step_peaks_by_stage"]
    assert sorted(peaks) == ["0", "1"] and all(len(p) == STEPS and None not in p for p in peaks.values()), peaks
    over = {stage: [(step, peak) for step, peak in enumerate(p, start=1) if peak > budgets[stage]]
            for stage, p in peaks.items()}
    assert not any(over.values()), (over, budgets)
    assert run["steps_over_budget"] == []
    assert all(0 < kept for kept in run["first_step_kept_bytes_by_stage"].values())
    assert none["step_peaks_by_stage"] == {} and none["budget_bytes_by_stage"] == {}
