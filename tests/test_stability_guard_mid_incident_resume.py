"""StabilityGuard resumed from a checkpoint saved mid-incident: the model went bad, steps were flagged, and
the rollback had not come yet. Snapshots were not in checkpoints, so the resumed fit's only rollback target
was the bad model it resumed from: its spikes kept coming, and it stopped with ``StabilityGuardError``
(blaming the data) where the uninterrupted run rolled back and finished. While an incident is open the
guard's state now carries the snapshots a rollback may return to, so the resumed fit rolls back as the
uninterrupted run does.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn

from lightning_pulse import StabilityGuard, StabilityGuardError
from tests.conftest import trainer_kwargs

GOES_BAD_AT = 13  # the step counter after which the first layer is scaled up: steps 13, 14, 15 spike
MAX_STEPS = 30


class _Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x).squeeze(-1), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


class _GoesBad(Callback):
    """Makes the model bad once, outside the optimizer (a corrupted update): every later batch spikes."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == GOES_BAD_AT:
            with torch.no_grad():
                pl_module.net[0].weight.mul_(40.0)


def _loader() -> torch.utils.data.DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(16, 4, generator=generator)
    # one batch an epoch: every checkpoint is at an epoch's end, so a resume continues the same data
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sin().sum(dim=1)), batch_size=16)


def _fit(
    checkpoints: Path | None = None, resume_from: Path | None = None, max_steps: int = MAX_STEPS
) -> tuple[StabilityGuard, nn.Module]:
    pl.seed_everything(0)
    guard = StabilityGuard(window=10, warmup=5, snapshot_every=5, rollback_margin=2, skip_after_rollback=2)
    callbacks: list[Callback] = [guard, _GoesBad()]
    if checkpoints is not None:
        callbacks.append(
            ModelCheckpoint(dirpath=checkpoints, filename="{step}", every_n_train_steps=1, save_top_k=-1)
        )
    trainer = pl.Trainer(
        max_steps=max_steps,
        callbacks=callbacks,
        default_root_dir=resume_from.parent if resume_from else None,
        **trainer_kwargs(enable_checkpointing=checkpoints is not None),
    )
    model = _Regressor()
    trainer.fit(model, _loader(), ckpt_path=resume_from)
    return guard, model


def test_a_run_resumed_mid_incident_rolls_back_and_ends_as_the_uninterrupted_run(tmp_path):
    whole_guard, whole = _fit(checkpoints=tmp_path)
    assert [(e["step"], e["to_step"]) for e in whole_guard.events if e["event"] == "rollback"] == [(15, 10)]
    for resume_at in (14, 15):  # one and two flagged steps in; the rollback comes at the third
        guard, resumed = _fit(resume_from=tmp_path / f"step={resume_at}.ckpt")
        assert [(e["step"], e["to_step"]) for e in guard.events if e["event"] == "rollback"] == [(15, 10)]
        assert guard.metrics() == whole_guard.metrics()  # the same spikes, skips and steps lost
        ended = dict(whole.named_parameters())
        for name, tensor in resumed.named_parameters():
            assert torch.equal(tensor, ended[name]), (resume_at, name)


def _guard_state(checkpoint: Path) -> dict:
    states = torch.load(checkpoint, weights_only=False)["callbacks"]
    return next(state for key, state in states.items() if key.startswith("StabilityGuard"))


def test_only_a_checkpoint_saved_mid_incident_carries_snapshots(tmp_path):
    """Ordinary checkpoints stay as small as before: snapshots ride along only while an incident is open,
    the two a rollback may return to (10, the one before the incident, and the oldest held, 5)."""
    _fit(checkpoints=tmp_path)
    carried = {
        step: [snapshot["step"] for snapshot in state["incident_snapshots"]]
        for step in range(1, MAX_STEPS + 1)
        if "incident_snapshots" in (state := _guard_state(tmp_path / f"step={step}.ckpt"))
    }
    assert carried == {14: [5, 10], 15: [5, 10]}


def test_a_resume_whose_checkpoint_went_bad_before_a_flag_stops_naming_the_checkpoint(tmp_path):
    """The checkpoint of step 13 was saved after the model went bad and before any step was flagged:
    nothing told the guard, so it carries no older snapshot, and every rollback returns to the bad state
    resumed at. The stop used to send the user to the data (which is fine); it now names the checkpoint
    first, and the way out."""
    _fit(checkpoints=tmp_path)
    with pytest.raises(StabilityGuardError) as stop:
        _fit(resume_from=tmp_path / "step=13.ckpt", max_steps=40)
    message = str(stop.value)
    assert "returned to the state this fit resumed at (step 13), its only snapshot" in message
    assert "saved after the model went bad" in message and "resume from an earlier checkpoint" in message


class _RingAtBatchStart(Callback):
    def __init__(self) -> None:
        self.rings: list[list[int]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        guard = next(c for c in trainer.callbacks if isinstance(c, StabilityGuard))
        self.rings.append(list(guard.snapshots.steps))


def test_a_fit_resumed_mid_incident_snapshots_not_the_state_it_resumed_at(tmp_path):
    # a review: the fit-start snapshot, owed at train start, was taken at the first batch of a fit resumed
    # mid-incident (of the bad state it resumed at), pushing the oldest good one out of the ring
    _fit(checkpoints=tmp_path)
    for resume_at in (14, 15):
        pl.seed_everything(0)
        guard = StabilityGuard(
            window=10, warmup=5, snapshot_every=5, rollback_margin=2, skip_after_rollback=2
        )
        ring = _RingAtBatchStart()
        trainer = pl.Trainer(max_steps=MAX_STEPS, callbacks=[guard, _GoesBad(), ring], **trainer_kwargs())
        trainer.fit(_Regressor(), _loader(), ckpt_path=tmp_path / f"step={resume_at}.ckpt")
        assert ring.rings[:2] == [[5, 10], [5, 10]], resume_at  # the uninterrupted run's ring
