"""A checkpoint saved inside a PulseCycle phase listener (``trainer.save_checkpoint`` in
``on_pulse_phase_change``) resumes a HardSampleReplay run as the uninterrupted run goes on.

PulseCycle tells its listeners in its own ``on_train_batch_end``, listed before HardSampleReplay, whose batch
end records the step's per-sample losses. The step had run (Lightning counts its batch processed and resumes
after it), but its measurement was not in the checkpoint: the resumed run chose from other scores (batch mode,
at an epoch's last batch: 320 rows pending and unapplied, the last step's missing, final weights off by 0.022;
steps mode, mid-pass: off by 0.021; with a scorer: 0.026). ModelCheckpoint at the same step, which Lightning
runs after every callback, resumed exactly.
"""

from __future__ import annotations

import json

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lightning_pulse import HardSampleReplay, PulseCycle
from lightning_pulse.core.per_sample_loss import OutputKeyScorer
from tests.conftest import trainer_kwargs
from tests.ddp_workers import TwoGlooProcesses
from tests.test_hard_sample_replay_ddp_resume import FinalState
from tests.test_step_saving_replay import CYCLE, OneCycleClassifier, ShuffleFreeData

# batches of 64 over 720 samples: 12 batches an epoch, the cycle's second change ends the first one
EPOCH_LONG_CYCLE = dict(burst=5, replay=7, maintain=0, warmup=0.0, anneal=0.0, maintain_eval="none")


class HandWrittenLoss(OneCycleClassifier):
    """A loss no captured function computes: scored by ``OutputKeyScorer("per_sample")``."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        per_sample = ((self(x).softmax(-1) - torch.nn.functional.one_hot(y, 10).float()) ** 2).sum(-1)
        return {"loss": per_sample.mean(), "per_sample": per_sample.detach()}


class SaveAtPhaseChange(Callback):
    """A user's phase listener: saves a checkpoint at the phase change after optimizer step ``at``."""

    def __init__(self, path, at: int) -> None:
        self.path, self.at, self.batch_idx, self.saved_at = path, at, 0, None
        self.epoch_ended = self.trained_after_save = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batch_idx = batch_idx

    def on_pulse_phase_change(self, trainer, pl_module, change):
        if change.reason == "resume" or trainer.global_step != self.at:
            return
        trainer.save_checkpoint(self.path)
        self.saved_at = trainer.global_step
        self.epoch_ended = self.batch_idx + 1 >= trainer.num_training_batches
        replay = next(c for c in trainer.callbacks if isinstance(c, HardSampleReplay))
        self.trained_after_save = replay.trained_indices  # the step's, until its batch end


def _fit(cycle, mode, scorer, listener=None, ckpt_path=None):
    pl.seed_everything(0)
    model = HandWrittenLoss() if scorer else OneCycleClassifier()
    replay = HardSampleReplay(rule="topk", replay_fraction=0.5, mode=mode, scorer=scorer)
    callbacks = [PulseCycle(**cycle), replay] + ([listener] if listener else [])
    trainer = pl.Trainer(callbacks=callbacks, max_epochs=4, **trainer_kwargs())
    trainer.fit(model, ShuffleFreeData(num_samples=1000, batch_size=64), ckpt_path=ckpt_path)
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    return weights, trainer.global_step, replay.table.scores.tobytes()


@pytest.mark.parametrize(
    ("cycle", "mode", "scorer", "at", "epoch_ended"),
    [
        (CYCLE, "steps", None, 10, False),
        (EPOCH_LONG_CYCLE, "batch", None, 12, True),
        (CYCLE, "steps", OutputKeyScorer("per_sample"), 10, False),
    ],
    ids=["steps-mid-pass", "batch-epochs-last-batch", "steps-scorer"],
)
def test_a_checkpoint_saved_by_a_phase_listener_resumes_as_the_uninterrupted_run(
    tmp_path, cycle, mode, scorer, at, epoch_ended
):
    listener = SaveAtPhaseChange(tmp_path / "listener.ckpt", at)
    full_weights, full_steps, full_scores = _fit(cycle, mode, scorer, listener)
    assert listener.saved_at == at and listener.epoch_ended == epoch_ended
    assert listener.trained_after_save is not None
    saved = torch.load(tmp_path / "listener.ckpt", weights_only=False)["callbacks"]
    state = next(state for key, state in saved.items() if key.startswith("HardSampleReplay"))
    if epoch_ended:  # applied, as the epoch's last batch end applies them (the resume runs no epoch end)
        assert state["unapplied"] is None
    else:  # the saved step's measurement is among the pending ones
        assert listener.saved_at - 1 in state["unapplied"]["steps"]

    resumed_weights, resumed_steps, resumed_scores = _fit(cycle, mode, scorer, ckpt_path=listener.path)
    assert resumed_steps == full_steps
    assert torch.equal(resumed_weights, full_weights)
    assert resumed_scores == full_scores


def _fit_two_ranks(model, data, directory, listener=None, ckpt_path=None) -> dict[int, dict]:
    directory.mkdir()
    # 360 samples per rank: 6 batches an epoch; the cycle changes phase at step 6, the first epoch's end
    cycle = PulseCycle(burst=3, replay=3, maintain=0, warmup=0.0, anneal=0.0, maintain_eval="none")
    callbacks = [cycle, HardSampleReplay(mode="batch"), FinalState(directory)] + (
        [listener] if listener else []
    )
    trainer = pl.Trainer(
        callbacks=callbacks,
        max_epochs=3,
        limit_val_batches=0,
        **trainer_kwargs(devices=2, strategy=TwoGlooProcesses()),
    )
    trainer.fit(model, data, ckpt_path=ckpt_path)
    return {rank: json.loads((directory / f"rank{rank}.json").read_text()) for rank in (0, 1)}


@pytest.mark.ddp
def test_a_checkpoint_saved_by_a_phase_listener_under_ddp_resumes_as_the_uninterrupted_run(
    mnist1d_small, tmp_path
):
    # every rank records every rank's rows at the save (a collective inside save_checkpoint, on every rank)
    pl.seed_everything(0)
    checkpoint = tmp_path / "listener.ckpt"
    full = _fit_two_ranks(*mnist1d_small(), tmp_path / "full", SaveAtPhaseChange(checkpoint, at=6))
    saved = torch.load(checkpoint, weights_only=False)["callbacks"]
    state = next(state for key, state in saved.items() if key.startswith("HardSampleReplay"))
    assert state["unapplied"] is None  # the epoch's last batch applied them before the checkpoint
    resumed = _fit_two_ranks(*mnist1d_small(), tmp_path / "resumed", ckpt_path=checkpoint)
    assert resumed[0] == resumed[1]  # the ranks agree
    assert resumed[0]["scores"] == full[0]["scores"]
    assert resumed[0]["parameters"] == full[0]["parameters"]


class ReturnedLoss(HandWrittenLoss):
    """Keeps the loss its ``training_step`` returned last."""

    def training_step(self, batch, batch_idx):
        output = super().training_step(batch, batch_idx)
        self.returned = float(output["loss"])
        return output


def test_a_scorer_of_a_step_finished_at_a_listeners_save_gets_the_loss_lightning_divides(tmp_path):
    """Review of the fix: Lightning's batch end gets the returned loss divided by ``accumulate_grad_batches``;
    the step finished early for the save gave the scorer the loss as returned, twice as large here."""
    seen: list[tuple[int, float]] = []  # (global step, the loss the scorer got over the one returned)

    class LossSeen(OutputKeyScorer):
        def __call__(self, pl_module, batch, outputs, batch_size):
            seen.append((pl_module.trainer.global_step, float(outputs["loss"]) / pl_module.returned))
            return super().__call__(pl_module, batch, outputs, batch_size)

    listener = SaveAtPhaseChange(tmp_path / "listener.ckpt", at=7)
    pl.seed_everything(0)
    replay = HardSampleReplay(rule="topk", replay_fraction=0.5, mode="steps", scorer=LossSeen("per_sample"))
    trainer = pl.Trainer(
        callbacks=[PulseCycle(**CYCLE), replay, listener],
        max_epochs=2,
        accumulate_grad_batches=2,
        **trainer_kwargs(),
    )
    trainer.fit(ReturnedLoss(), ShuffleFreeData(num_samples=1000, batch_size=64))
    assert listener.saved_at == 7  # the second epoch's first optimizer step
    at_save = [ratio for step, ratio in seen if step == 7]
    assert at_save and all(ratio == pytest.approx(0.5) for ratio in at_save), seen
    assert all(ratio == pytest.approx(0.5) for _, ratio in seen[1:]), seen  # the first: the fit's trial call


class SkipRestOfSecondEpoch(OneCycleClassifier):
    """Returns -1 from ``on_train_batch_start`` at the second epoch's sixth batch: Lightning counts that batch
    processed without running it."""

    def on_train_batch_start(self, batch, batch_idx):
        return -1 if self.current_epoch == 1 and batch_idx == 5 else None


class StateAtEpochEnd(Callback):
    """The callback's state at each training epoch's end, as a ModelCheckpoint there would save it."""

    def __init__(self) -> None:
        self.pending: list = []

    def on_train_epoch_end(self, trainer, pl_module):
        replay = next(c for c in trainer.callbacks if isinstance(c, HardSampleReplay))
        unapplied = replay.state_dict()["unapplied"]
        self.pending.append(None if unapplied is None else unapplied["steps"])


def test_a_batch_skipped_by_on_train_batch_start_is_not_finished_by_a_save(tmp_path):
    """Review of the fix: the skipped batch, counted processed, was finished at the epoch end's save as if it
    had trained (a pending step 17 that never ran)."""
    pl.seed_everything(0)
    saver = StateAtEpochEnd()
    replay = HardSampleReplay(replay_fraction=0.5, mode="batch")
    trainer = pl.Trainer(callbacks=[replay, saver], max_epochs=2, **trainer_kwargs(limit_val_batches=0))
    trainer.fit(SkipRestOfSecondEpoch(), ShuffleFreeData(num_samples=1000, batch_size=64))
    assert saver.pending == [None, None], saver.pending  # each epoch's end applied its steps; nothing after
