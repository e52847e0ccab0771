"""HardSampleReplay (steps mode) resumed from a checkpoint saved at a stop inside an epoch (``max_time``, or
``trainer.should_stop`` from a callback): Lightning marks that epoch finished and resumes at the next one."""

from __future__ import annotations

import logging

import lightning.pytorch as pl
import pytest
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
