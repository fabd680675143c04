"""ds_pipe_ckpt.gradient_accumulation's correction, on engines shaped as
each DeepSpeed release's pipeline engine scales (in process, no ranks): what is
measured, what is corrected, and the refusal where a correction does not take.
The real engines of the installed DeepSpeed are checked in test_gradient_parity.py."""

import warnings

import pytest
import torch
import torch.nn as nn

from ds_pipe_ckpt import ConfigError, LayerSpec, PipelineModule, gradient_accumulation


class _Config:
    def __init__(self, steps):
        self.gradient_accumulation_steps = steps


class _Engine:
    """The parts of DeepSpeed's PipelineEngine that scale for accumulation."""

    def __init__(self, stage, stages, steps):
        self.stage_id, self.num_stages, self._config = stage, stages, _Config(steps)
        self.scale_wrt_gas, self.losses = None, None

    def gradient_accumulation_steps(self):
        return self._config.gradient_accumulation_steps

    def is_last_stage(self):
        return self.stage_id == self.num_stages - 1

    def _scale_loss_by_gas(self, loss):
        return loss / self.gradient_accumulation_steps()


class Release016(_Engine):
    """0.16/0.17: backward(loss) on the last stage; its prologue skips the
    division because the pipeline reduces gradients itself."""

    def _backward_prologue(self, loss, scale_wrt_gas=True):
        self.losses = loss.detach() if self.losses is None else self.losses + loss.detach()
        return loss


class Release018(_Engine):
    """0.18: a hook on every stage's outputs divides what arrives."""

    def _backward_prologue_per_tensor(self, grad):
        return grad / self.gradient_accumulation_steps()


class Release019(Release018):
    def _backward_prologue_per_tensor(self, grad):
        return super()._backward_prologue_per_tensor(grad) if self.is_last_stage() else grad


class Unknown(_Engine):
    """A scaling neither correction reaches (a future or patched engine): off the
    last stage the hook is replaced as 0.19's, on the last stage it is not."""

    def _backward_prologue_per_tensor(self, grad):
        return grad * 3


def _factors(release, stages=2, steps=4):
    return [gradient_accumulation.pipeline_gradient_scale(release(s, stages, steps)) for s in range(stages)]


@pytest.mark.parametrize("release, found", [(Release016, [1.0, 1.0]), (Release018, [0.25, 0.25]),
                                            (Release019, [1.0, 0.25])])
def test_the_scale_is_measured_per_stage(release, found):
    assert _factors(release) == found


@pytest.mark.parametrize("release", [Release016, Release018, Release019])
@pytest.mark.parametrize("stages", [2, 4])
def test_every_release_is_corrected_to_one_division_on_the_last_stage(release, stages):
    for stage in range(stages):
        engine = release(stage, stages, 4)
        note = gradient_accumulation.correct_gradient_accumulation(engine)
        last = stage == stages - 1
        assert gradient_accumulation.pipeline_gradient_scale(engine) == (0.25 if last else 1.0)
        # what a stage passes on is the product along the stages after it: 1/GA for every stage
        needed = (release is Release016 and last) or (release is Release018 and not last)
        assert (note is None) == (not needed)


def test_a_correction_holds_for_a_later_change_of_the_accumulation_steps():
    engine = Release016(1, 2, 1)  # configured with 1: the mechanism is seen at 2
    assert gradient_accumulation.correct_gradient_accumulation(engine) is not None
    engine._config.gradient_accumulation_steps = 8  # as set_train_batch_size does
    assert gradient_accumulation.pipeline_gradient_scale(engine) == 1 / 8


def test_the_probe_leaves_the_training_loss_log_alone():
    engine = Release016(1, 2, 4)
    engine.losses = torch.tensor(2.5)
    gradient_accumulation.pipeline_gradient_scale(engine)
    assert engine.losses == torch.tensor(2.5)


def test_the_corrected_last_stage_loss_is_scaled_as_a_plain_engine_scales_it():
    engine = Release016(1, 2, 4)
    gradient_accumulation.correct_gradient_accumulation(engine)
    assert engine._backward_prologue(torch.tensor(2.0)) == 0.5
    assert engine._backward_prologue(torch.tensor(2.0), scale_wrt_gas=False) == 2.0
    engine.scale_wrt_gas = False  # the engine's own override wins, as upstream's prologue reads it
    assert engine._backward_prologue(torch.tensor(2.0)) == 2.0


def test_an_engine_that_cannot_be_corrected_is_refused_with_the_fix():
    with pytest.raises(ConfigError) as error:
        gradient_accumulation.correct_gradient_accumulation(Unknown(1, 2, 4))
    assert gradient_accumulation.correct_gradient_accumulation(Unknown(0, 2, 4)) is not None  # stage 0: replaced
    message = str(error.value)
    assert error.value.key == "gradient_accumulation_steps"
    assert gradient_accumulation.deepspeed.__version__ in message
    assert "7773" in message and "8152" in message and "0.19" in message


def test_the_installed_releases_class_is_read_as_its_engines_behave():
    assert gradient_accumulation.engine_scales_accumulation_wrongly(Release016) is True
    assert gradient_accumulation.engine_scales_accumulation_wrongly(type("PipelineEngine", (Release018,), {})) is True
    assert gradient_accumulation.engine_scales_accumulation_wrongly(type("PipelineEngine", (Release019,), {
        "_backward_prologue_per_tensor": Release019._backward_prologue_per_tensor})) is False


def test_a_module_under_an_uncorrected_engine_warns_once_where_the_release_needs_it(single_rank_process_group):
    module = PipelineModule([LayerSpec(nn.Linear, 4, 4)], num_stages=1, partition_method="uniform")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module.train()
        module.train()
    relevant = [w for w in caught if "gradient_accumulation_steps" in str(w.message)]
    if gradient_accumulation.engine_scales_accumulation_wrongly():
        assert len(relevant) == 1 and "ds_pipe_ckpt.initialize" in str(relevant[0].message)
    else:
        assert relevant == []
