"""The Llama pipeline example against transformers itself.

A small random ``LlamaForCausalLM`` (fp32, seeded; tied embeddings, and an
untied twin) is saved with ``save_pretrained`` and loaded by the example's
``--from-pretrained`` path (each stage reads only its own layers' tensors).
One ``run_ranks`` launch of 4 local ranks then:

* trains one step at pp=4, 2 and 1 (dp = 4 / pp; the untied model at pp=4
  only, where the head has a stage of its own) and checks that the
  pipeline's first loss equals ``LlamaForCausalLM(input_ids, labels=input_ids).loss``
  on the same batch within 1e-6 relative (transformers shifts the labels
  itself and ignores the last position; the pipeline is given those shifted
  targets, with -100 last);
* trains 3 steps at pp=2 x dp=2 with the example's configs ``none``,
  ``non_reentrant``, ``selective`` and ``planned`` (budgets: 0.75 x stage 0's
  peak without checkpointing, so that its planner must recompute, and 1.2 x
  stage 1's, whose logits, head and parameter gradients, which no plan can
  recompute, are most of its peak at this size) and checks
  that every mode's losses and final parameters equal the run without
  checkpointing, bit for bit, and that the planner's first planned step on
  each stage stays within its budget (stage 0 sends three tensors, so
  DeepSpeed's backward keeps its graph).

Also, in this process: a stage reads exactly its own layers' names, a missing
tensor is named, and the progress lines written outside a terminal.
"""

from __future__ import annotations

import io

import pytest
import torch
from transformers import LlamaForCausalLM

import llama_jobs
from ds_pipe_ckpt.testing import run_ranks
from examples.llama.model import small_config
from examples.training import LineProgress, make_progress

WORLD = 4
FIRST_LOSS_PPS = [4, 2, 1]
FIRST_LOSS_LAYOUTS = [("tied", pp) for pp in FIRST_LOSS_PPS] + [("untied", 4)]
MODES = ["none", "non_reentrant", "selective", "planned"]
MODE_PP, MODE_STEPS = 2, 3
BUDGET_FRACTIONS = [0.75, 1.2]  # of each stage's peak without checkpointing (the last one plans what it may store)
SEQUENCE = 64
TIMEOUT = 240  # seconds; about 30 s on 2 idle cores


def _save_model(directory, tied: bool) -> LlamaForCausalLM:
    torch.manual_seed(1234)
    model = LlamaForCausalLM(small_config(tie_word_embeddings=tied)).float()
    model.save_pretrained(directory)
    return model


def _hf_loss(directory, inputs: torch.Tensor) -> float:
    model = LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32)
    model.train()  # as the pipeline trains (the model has no dropout)
    with torch.no_grad():
        return float(model(input_ids=inputs, labels=inputs).loss)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("llama")
    paths = {"tied": root / "tied", "untied": root / "untied"}
    for label, path in paths.items():
        _save_model(path, tied=label == "tied")
    return {label: str(path) for label, path in paths.items()}


@pytest.fixture(scope="module")
def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """24 random byte sequences (3 global batches of 8) and their shifted
    targets, -100 at the last position (what transformers' loss ignores)."""
    generator = torch.Generator().manual_seed(7)
    inputs = torch.randint(0, 256, (llama_jobs.GLOBAL_BATCH * MODE_STEPS, SEQUENCE), generator=generator)
    targets = torch.cat([inputs[:, 1:], torch.full((len(inputs), 1), -100)], dim=1)
    return inputs, targets


@pytest.fixture(scope="module")
def runs(checkpoints, batch) -> list[dict]:
    inputs, targets = batch
    return run_ranks(llama_jobs.pipeline_runs, WORLD, checkpoints, FIRST_LOSS_LAYOUTS, inputs, targets, MODES,
                     MODE_PP, MODE_STEPS, BUDGET_FRACTIONS, timeout=TIMEOUT)


@pytest.mark.parametrize("label, pp", FIRST_LOSS_LAYOUTS, ids=[f"{label}-pp{pp}" for label, pp in FIRST_LOSS_LAYOUTS])
def test_first_loss_equals_transformers(runs, checkpoints, batch, label, pp):
    inputs, _ = batch
    expected = _hf_loss(checkpoints[label], inputs[:llama_jobs.GLOBAL_BATCH])
    for rank, result in enumerate(runs):
        actual = result["first_losses"][(label, pp)]
        assert actual == pytest.approx(expected, rel=1e-6, abs=0), (rank, label, pp, actual, expected)


def test_every_stage_loads_exactly_its_layers(runs, checkpoints):
    """At pp=4 (dp=1) the four ranks are the four stages: together they read
    every tensor of the checkpoint, and the tied head reads the embedding."""
    from safetensors import safe_open
    for label, directory in checkpoints.items():
        with safe_open(f"{directory}/model.safetensors", framework="pt") as handle:
            saved = set(handle.keys())
        names = [set(result["loaded"][(label, 4)]) for result in runs]
        assert set().union(*names) == saved | {"model.embed_tokens.weight"}
        assert "model.layers.0.self_attn.q_proj.weight" in names[0] and "model.norm.weight" in names[3]
        assert not any("model.layers.3." in name for name in names[0])
        head = "model.embed_tokens.weight" if label == "tied" else "lm_head.weight"
        assert head in names[3] and ("lm_head.weight" in saved) == (label == "untied")


@pytest.mark.parametrize("name", MODES[1:])
def test_checkpointing_reproduces_training_without_it(runs, name):
    for rank, result in enumerate(runs):
        baseline, run = result["modes"]["none"], result["modes"][name]
        assert len(run["losses"]) == MODE_STEPS
        assert run["losses"] == baseline["losses"], (rank, name, run["losses"], baseline["losses"])
        assert run["params"].keys() == baseline["params"].keys()
        differing = [k for k in baseline["params"] if not torch.equal(run["params"][k], baseline["params"][k])]
        assert not differing, (rank, name, differing)
    losses = runs[0]["modes"]["none"]["losses"]
    assert len(set(losses)) == MODE_STEPS, losses  # three different batches and updates


def test_planned_run_plans_every_stage_and_recomputes_on_the_first(runs):
    for result in runs:
        planned = result["modes"]["planned"]
        assert planned["budget_mb"] is not None and all(b > 0 for b in planned["budget_mb"])
        assert planned["decisions"], f"stage {planned['stage']}: no plan"
        if planned["stage"] == 0:
            assert set(planned["decisions"]) - {"store"}, planned["decisions"]


def test_the_first_planned_step_keeps_its_budget_although_the_graph_is_kept(runs):
    """Stage 0 sends (hidden, cos, sin): DeepSpeed runs its backward once per
    tensor with retain_graph=True, so every activation it stores stays until
    the micro-batch's backward ends. The plan counts that, and its first
    planned step (step 3, measured by the planner) stays within the budget and
    the prediction. The last stage sends the loss only. (Before the planner
    counted the kept graph, stage 0 stored decoder layer 1 here and measured
    2.15 MiB against a 2.09 MiB budget.)"""
    for result in runs:
        checked = result["modes"]["planned"]["checked"]
        stage = result["modes"]["planned"]["stage"]
        assert checked["keeps_graph"] == (stage == 0), (stage, checked)
        assert checked["measured_bytes"] is not None, f"stage {stage}: the first planned step was not measured"
        assert checked["measured_bytes"] <= checked["predicted_bytes"] <= checked["budget_bytes"], (stage, checked)


def test_missing_tensor_is_named(tmp_path, single_rank_process_group):
    from safetensors.torch import load_file, save_file

    from examples.llama.engine import build_module
    from examples.llama.pretrained import load_config
    from examples.training import pipeline_topology

    _save_model(tmp_path, tied=True)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.2.mlp.down_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(KeyError, match=r"lacks \['model.layers.2.mlp.down_proj.weight'\]"):
        build_module(load_config(tmp_path), pipeline_topology(1, 1), pretrained=tmp_path)


def test_progress_outside_a_terminal_prints_lines():
    stream = io.StringIO()  # not a TTY
    progress = make_progress(5, "llama none", enabled=True, log_every=2, stream=stream)
    assert isinstance(progress, LineProgress)
    for step in range(5):
        progress.set_postfix(loss=f"{5 - step:.4f}")
        progress.update()
    progress.close()
    assert stream.getvalue().splitlines() == ["llama none: step 2/5, loss=4.0000", "llama none: step 4/5, loss=2.0000",
                                              "llama none: step 5/5, loss=1.0000"]
    assert "\r" not in stream.getvalue()
    with pytest.raises(ValueError, match="every 0 steps"):
        LineProgress(5, "x", 0)
