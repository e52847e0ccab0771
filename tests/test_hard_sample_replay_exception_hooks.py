"""A fit with HardSampleReplay that raises (an exception in ``training_step``) leaves nothing of it on the
Trainer: Lightning calls no ``teardown`` after an exception, only ``on_exception``.

Thirty-seventh pass, left open: the hooks HardSampleReplay's ``setup`` wraps onto the Trainer (its strategy's
``process_dataloader``, the fit loop's DataLoader source) and the plan's ``max_steps`` cap stayed after the
exception. A later fit of that Trainer without the instance (it dropped, or new callbacks built, as the
second-run refusal advises) still ran the old instance's DataLoader hook, which put its index-recording
sampler into the new fit's DataLoader and warned of a "reloaded" DataLoader, and the old plan's cap stayed
``max_steps``: a plain fit stopped at step 20 instead of 29 (weights 0.079 apart), and a resume with new
callbacks read the cap as the user's ``max_steps``, planned 29 steps for the 36-step run and was refused (its
OneCycleLR built for 36).
"""

from __future__ import annotations

import shutil
import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import OnExceptionCheckpoint

from examples.mnist1d import MNIST1DClassifier
from lightning_pulse import HardSampleReplay, PulseCycle
from lightning_pulse.core.sample_index import RecordingSampler
from tests.conftest import trainer_kwargs
from tests.test_hard_sample_replay_exception_resume import CrashingClassifier, Preempted, _parameters
from tests.test_step_saving_replay import CYCLE, ShuffleFreeData


class Crashing(MNIST1DClassifier):
    def __init__(self, crash_step: int | None = None) -> None:
        super().__init__()
        self.crash_step = crash_step

    def training_step(self, batch, batch_idx):
        if self.trainer.global_step == self.crash_step:
            raise Preempted("preempted")
        return super().training_step(batch, batch_idx)


def _crash_then_fit_plain(tmp_path, with_replay: bool, mode: str):
    """Fit with (or without, the control) a HardSampleReplay until ``training_step`` raises at step 5, inside
    the PulseCycle's first burst (full batches: the control trains the same ones), then fit the same Trainer
    again without either callback."""
    pl.seed_everything(0)
    model = Crashing(crash_step=5)
    callbacks = [PulseCycle(burst=8, replay=4, maintain=2, warmup=0.0, anneal=0.0, maintain_eval="none")]
    if with_replay:
        callbacks.append(HardSampleReplay(mode=mode))
    trainer = pl.Trainer(callbacks=callbacks, max_epochs=3, default_root_dir=tmp_path, **trainer_kwargs())
    with pytest.raises(Preempted):
        trainer.fit(model, ShuffleFreeData(num_samples=500, batch_size=50))
    trainer.callbacks = [c for c in trainer.callbacks if not isinstance(c, (HardSampleReplay, PulseCycle))]
    model.crash_step = None
    data = ShuffleFreeData(num_samples=500, batch_size=50)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, data)
    loader = trainer.train_dataloader
    return trainer, model, loader, [str(w.message) for w in caught if "HardSampleReplay" in str(w.message)]


@pytest.mark.parametrize("mode", ["steps", "batch"])
def test_a_fit_of_the_trainer_without_the_callback_after_its_fit_raised_trains_as_if_it_never_ran(
    tmp_path, mode
):
    control, control_model, _, _ = _crash_then_fit_plain(tmp_path / "control", False, mode)
    trainer, model, loader, notes = _crash_then_fit_plain(tmp_path / "replay", True, mode)
    # before: the old instance's DataLoader hook ran in the plain fit (a RecordingSampler in the user's
    # DataLoader, a "reloaded training DataLoader" warning) and, in steps mode, its plan's cap cut it short
    assert not isinstance(loader.batch_sampler.sampler, RecordingSampler)
    assert notes == []
    assert trainer.max_steps == control.max_steps == -1
    assert trainer.global_step == control.global_step
    assert torch.equal(_parameters(model), _parameters(control_model))


def _resume_fit(trainer, checkpoint):
    pl.seed_everything(0)
    model = CrashingClassifier()
    trainer.fit(model, ShuffleFreeData(num_samples=1000, batch_size=64), ckpt_path=checkpoint)
    return model


def _callbacks(tmp_path):
    return [
        PulseCycle(**CYCLE),
        HardSampleReplay(replay_fraction=0.5),
        OnExceptionCheckpoint(dirpath=tmp_path),
    ]


def test_a_resume_on_the_trainer_whose_fit_raised_with_new_callbacks_trains_as_a_fresh_trainer_does(tmp_path):
    pl.seed_everything(0)
    trainer_kw = dict(max_epochs=4, default_root_dir=tmp_path, **trainer_kwargs(enable_checkpointing=True))
    trainer = pl.Trainer(callbacks=_callbacks(tmp_path), **trainer_kw)
    with pytest.raises(Preempted):
        trainer.fit(CrashingClassifier(crash_step=20), ShuffleFreeData(num_samples=1000, batch_size=64))
    checkpoint = str(tmp_path / "saved.ckpt")
    shutil.copy(tmp_path / "on_exception.ckpt", checkpoint)  # OnExceptionCheckpoint removes it at teardown
    assert trainer.max_steps == -1  # the plan's cap (36) is not left behind as the user's max_steps

    # the second-run refusal's way out: new callbacks (here on the same Trainer), resumed from the checkpoint
    trainer.callbacks = _callbacks(tmp_path)
    resumed = _resume_fit(trainer, checkpoint)
    fresh_trainer = pl.Trainer(callbacks=_callbacks(tmp_path / "fresh"), **trainer_kw)
    fresh = _resume_fit(fresh_trainer, checkpoint)
    assert trainer.global_step == fresh_trainer.global_step == 36
    assert torch.equal(_parameters(resumed), _parameters(fresh))
