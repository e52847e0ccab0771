"""A steps-mode HardSampleReplay run resumed from the checkpoint ``OnExceptionCheckpoint`` saves when an
exception hits inside ``training_step`` trains what the uninterrupted run trained.

Held-out sweep: the batch in flight had been counted as trained when it was drawn (at the batch's start), so
the checkpoint's data position skipped it although its step never ran; the resumed run trained every later
batch one step early (final weights off by up to 0.066). Lightning's own batch progress counts that batch
``ready`` but not ``processed`` and resumes after the processed batches; the stream now does the same.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, OnExceptionCheckpoint

from lightning_pulse import HardSampleReplay, PulseCycle
from lightning_pulse.core.step_plan import StepSavingStream
from tests.conftest import trainer_kwargs
from tests.test_step_saving_replay import CYCLE, OneCycleClassifier, ShuffleFreeData


class Preempted(RuntimeError):
    pass


class CrashingClassifier(OneCycleClassifier):
    """Raises inside ``training_step`` (or, as the control, in ``on_train_batch_end``) at ``crash_step``."""

    def __init__(self, crash_step: int | None = None, where: str = "training_step") -> None:
        super().__init__()
        self.crash_step, self.where = crash_step, where

    def training_step(self, batch, batch_idx):
        if self.where == "training_step" and self.trainer.global_step == self.crash_step:
            raise Preempted("preempted")
        return super().training_step(batch, batch_idx)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.where == "on_train_batch_end" and self.trainer.global_step == self.crash_step:
            raise Preempted("preempted")


class StepLog(Callback):
    """Per batch: (epoch, global step, phase, a fingerprint of the batch that trains)."""

    def __init__(self) -> None:
        self.batches: list[tuple[int, int, str, float]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        phase = next(c for c in trainer.callbacks if isinstance(c, PulseCycle)).phase.value
        self.batches.append(
            (trainer.current_epoch, trainer.global_step, phase, float(batch[0].double().sum()))
        )


def _fit(tmp_path, crash_step=None, where="training_step", ckpt_path=None):
    pl.seed_everything(0)
    model, log = CrashingClassifier(crash_step, where), StepLog()
    callbacks = [PulseCycle(**CYCLE), HardSampleReplay(rule="topk", replay_fraction=0.5), log]
    callbacks.append(OnExceptionCheckpoint(dirpath=tmp_path))
    trainer = pl.Trainer(callbacks=callbacks, max_epochs=4, **trainer_kwargs(enable_checkpointing=True))
    try:
        trainer.fit(model, ShuffleFreeData(num_samples=1000, batch_size=64), ckpt_path=ckpt_path)
    except Preempted:
        pass
    return model, trainer, log


def _parameters(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in module.parameters()])


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    model, trainer, log = _fit(tmp_path_factory.mktemp("uninterrupted"))
    table = next(c for c in trainer.callbacks if isinstance(c, HardSampleReplay)).table
    return _parameters(model), trainer.global_step, table.scores.tobytes(), log.batches


def _crash_step(batches, at: str) -> int:
    """A replay step that opens a planned pass (``pass-start``) or lies inside one (``mid-pass``)."""
    for (epoch, _, _, _), (next_epoch, step, phase, _) in zip(batches, batches[1:]):
        opens_pass = next_epoch != epoch
        if phase == "replay" and opens_pass == (at == "pass-start"):
            return step
    raise AssertionError(f"no replay step at {at}")


@pytest.mark.parametrize("where", ["training_step", "on_train_batch_end"])
@pytest.mark.parametrize("at", ["mid-pass", "pass-start"])
def test_a_resume_from_an_exception_checkpoint_trains_the_batch_in_flight_and_reproduces_the_run(
    tmp_path, uninterrupted, where, at
):
    full_weights, full_steps, full_scores, full_batches = uninterrupted
    crash_step = _crash_step(full_batches, at)
    _, crashed, _ = _fit(tmp_path, crash_step, where)
    assert crashed.global_step == crash_step
    checkpoint = torch.load(tmp_path / "on_exception.ckpt", weights_only=False)
    # what Lightning resumes from: the batches processed in the epoch (an exception inside training_step
    # leaves the batch in flight ready, not processed); the stream's saved position counts those batches, no
    # more
    progress = checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"]
    stream = next(v for k, v in checkpoint["callbacks"].items() if "HardSampleReplay" in k)["stream"]
    assert stream["batches"] == progress["processed"]
    if where == "training_step":
        assert progress["ready"] == progress["processed"] + 1

    resumed_model, resumed, log = _fit(tmp_path / "resumed", ckpt_path=str(tmp_path / "on_exception.ckpt"))
    # the resumed run's first step trains the batch the uninterrupted run trained at that step
    first_step = log.batches[0][1]
    assert log.batches[0][3] == next(b[3] for b in full_batches if b[1] == first_step)
    assert resumed.global_step == full_steps
    assert torch.equal(_parameters(resumed_model), full_weights)
    table = next(c for c in resumed.callbacks if isinstance(c, HardSampleReplay)).table
    assert table.scores.tobytes() == full_scores


def test_the_streams_state_leaves_out_a_batch_drawn_whose_step_did_not_run():
    stream = StepSavingStream()
    stream.drawn(128)
    stream.drawn(64)
    trained = stream.state_dict(global_step=2)
    assert (trained["samples"], trained["batches"], trained["trained"]) == (192, 2, 192)
    in_flight = stream.state_dict(global_step=1, latest_untrained=True)
    assert (in_flight["samples"], in_flight["batches"], in_flight["trained"]) == (128, 1, 128)
    assert stream.checkpoint(1, latest_untrained=True) == in_flight
