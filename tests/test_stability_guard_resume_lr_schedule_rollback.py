"""A resume between two rollbacks whose spikes come from the user's LR schedule (the typo'd LambdaLR of
tests/test_stability_guard_lr_schedule_replay.py, a ModelCheckpoint every 10 steps, no shuffling): from a
checkpoint saved at an epoch's end (40 batches an epoch) the resumed run, its second rollback (which keeps the
schedule, from the checkpoint's record of the first) included, is the uninterrupted one. A mid-epoch save
would part the runs at the resume: Lightning restarts a plain DataLoader's interrupted epoch from its first
batch, and warns (docs/stability-guard.md, "Checkpoints"); a helper took that for the guard's."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset

from lightning_pulse import StabilityGuard
from tests.conftest import trainer_kwargs
from tests.test_stability_guard_lr_schedule_replay import TypoSchedule


def _fit(root, samples: int, ckpt=None):
    x, y = load_digits(return_X_y=True)
    data = TensorDataset(torch.tensor(x[:samples], dtype=torch.float32) / 16, torch.tensor(y[:samples]))
    pl.seed_everything(0)
    guard = StabilityGuard(warmup=20, window=40, snapshot_every=20, rollback_margin=5, skip_after_rollback=5)
    saver = ModelCheckpoint(dirpath=str(root), every_n_train_steps=10, save_top_k=-1)
    kwargs = trainer_kwargs(default_root_dir=str(root), enable_checkpointing=True)
    trainer = pl.Trainer(callbacks=[guard, saver], max_steps=100, **kwargs)
    model = TypoSchedule()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, DataLoader(data, batch_size=32, shuffle=False), ckpt_path=ckpt)
    resumable = [w for w in caught if "dataloader is not resumable" in str(w.message)]
    return guard, model, resumable


def _checkpoint(root, step: int) -> str:
    return str(next(root.glob(f"*-step={step}.ckpt")))


def test_a_resume_at_an_epochs_end_rolls_back_as_the_uninterrupted_run(tmp_path):
    guard, model, _ = _fit(tmp_path / "run", samples=1280)  # 40 batches an epoch: step 80 ends epoch 1
    rollbacks = [e for e in guard.events if e["event"] == "rollback"]
    assert [(e["step"], e["to_step"]) for e in rollbacks] == [(63, 40), (87, 80)]
    assert "lr_schedule" not in rollbacks[0] and rollbacks[1]["lr_schedule"] == "kept"  # after the resume
    resumed, again, warned = _fit(tmp_path / "resumed", 1280, _checkpoint(tmp_path / "run", 80))
    assert not warned
    assert resumed.events == guard.events
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))
