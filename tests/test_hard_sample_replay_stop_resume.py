"""HardSampleReplay (steps mode) resumed from a checkpoint saved at a stop inside an epoch (``max_time``, or
``trainer.should_stop`` from a callback): Lightning marks that epoch finished and resumes at the next one."""

from __future__ import annotations

import logging
import math

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from examples.mnist1d import MNIST1DClassifier
from lightning_pulse import HardSampleReplay, PulseCycle
from tests.conftest import trainer_kwargs
from tests.test_step_saving_replay import CYCLE, ShuffleFreeData


class StopAtStep(Callback):
    """What Lightning's ``Timer`` does when ``max_time`` runs out, at a step known in advance."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step >= self.step:
            trainer.should_stop = True


class EpochEnds(Callback):
    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.steps.append(trainer.global_step)


def _fit(extra=(), ckpt_path=None, root=None):
    pl.seed_everything(0)
    cycle, ends = PulseCycle(**CYCLE), EpochEnds()
    trainer = pl.Trainer(
        callbacks=[cycle, HardSampleReplay(replay_fraction=0.5), ends, *extra],
        max_epochs=4,
        default_root_dir=root,
        **trainer_kwargs(enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in extra)),
    )
    trainer.fit(MNIST1DClassifier(), ShuffleFreeData(num_samples=1000, batch_size=64), ckpt_path=ckpt_path)
    return trainer, cycle, ends


def _anneal_steps(cycle: PulseCycle) -> list[int]:
    return [change.step for change in cycle.clock.history if change.reason == "anneal"]


@pytest.mark.parametrize("saved_by", ["save_last", "save_checkpoint_after_fit"])
def test_a_resume_from_a_stop_inside_an_epoch_trains_the_plan_it_announces_and_its_anneal(
    tmp_path, caplog, saved_by
):
    # held-out sweep: the resume went on with the stopped pass under Lightning's next epoch, so the plan's
    # last pass and its anneal never trained; the plan line promised 38 more steps, 21 trained, the end line
    # said the run stopped early and the energy report said complete
    full, full_cycle, full_ends = _fit(root=tmp_path / "full")
    stop = full_ends.steps[1] - 3  # inside epoch 1's pass
    saving = ModelCheckpoint(dirpath=tmp_path / "ck", save_last=True)
    stopped, _, _ = _fit([StopAtStep(stop), saving], root=tmp_path / "stopped")
    assert stopped.global_step == stop < full.global_step
    checkpoint = saving.last_model_path
    if saved_by == "save_checkpoint_after_fit":
        checkpoint = str(tmp_path / "after.ckpt")
        stopped.save_checkpoint(checkpoint)

    caplog.clear()
    with (
        caplog.at_level(logging.INFO),
        pytest.warns(UserWarning, match=r"stop inside epoch 1, after \d+ batches .* resumes at epoch 2"),
    ):
        resumed, cycle, ends = _fit(ckpt_path=checkpoint, root=tmp_path / "resumed")
    # the run ends at the plan it announced (its max_steps cap), by its data, in max_epochs' last epoch
    assert resumed.global_step == resumed.max_steps == ends.steps[-1]
    assert len(ends.steps) == 2 and resumed.current_epoch == 4
    assert _anneal_steps(full_cycle) and _anneal_steps(cycle), "the planned anneal runs after the resume"
    assert "It stopped early" not in caplog.text
    assert f"trainer.max_steps={resumed.global_step} (the checkpoint was saved at a stop" in caplog.text


def test_the_plan_and_end_lines_of_a_resume_from_a_stop_inside_an_epoch_count_no_saving_on_its_dropped_rest(
    tmp_path, caplog
):
    # thirty-seventh pass, left open: the resume drops the rest of the stopped epoch (as a plain run does),
    # and its plan line's ratio counted those untrained samples' plain steps as saved (33 steps "instead of
    # 48", 0.688x, where the plain run takes 44 over the data it trains: 0.750x); so did PulseCycle's end line
    full, _, full_ends = _fit(root=tmp_path / "full")
    plain_epoch_steps = 12  # 768 training samples in batches of 64
    assert f"instead of {4 * plain_epoch_steps} " in caplog.text
    saving = ModelCheckpoint(dirpath=tmp_path / "ck", save_last=True)
    _fit([StopAtStep(full_ends.steps[1] - 3), saving], root=tmp_path / "stopped")
    checkpoint = torch.load(saving.last_model_path, weights_only=False)
    stream = next(v for k, v in checkpoint["callbacks"].items() if "HardSampleReplay" in k)["stream"]
    # the plain run's batches that reach the samples the stopped pass trained; the rest of the epoch drops
    dropped = plain_epoch_steps - math.ceil(stream["samples"] / 64)
    assert stream["epoch"] == 1 and dropped > 0

    caplog.clear()
    resaving = ModelCheckpoint(dirpath=tmp_path / "ck2", save_last=True)
    with caplog.at_level(logging.INFO), pytest.warns(UserWarning, match="stop inside epoch 1"):
        resumed, _, _ = _fit([resaving], ckpt_path=saving.last_model_path, root=tmp_path / "resumed")
    steps, plain = resumed.global_step, 4 * plain_epoch_steps - dropped
    assert f"takes {steps} optimizer steps instead of {plain} ({steps / plain:.3f}x;" in caplog.text
    assert (
        f"the plain run's {dropped} steps over the untrained rest of stopped epochs left out" in caplog.text
    )
    assert (
        f"the run took {steps} optimizer steps, {steps / plain:.3f} of the plain run's {plain} "
        in caplog.text
    )
    # a checkpoint of the resumed run keeps them out too (its own resume plans from it)
    saved = torch.load(resaving.last_model_path, weights_only=False)
    resumed_stream = next(v for k, v in saved["callbacks"].items() if "HardSampleReplay" in k)["stream"]
    assert resumed_stream["plain_dropped"] == dropped
