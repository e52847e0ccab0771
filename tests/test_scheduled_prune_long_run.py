"""A long pruning schedule keeps its latest event records, and each distillation window finds its event."""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pulse import ScheduledPrune
from lightning_pulse.callbacks.scheduled_prune import DistillConfig
from lightning_pulse.core import prune_events
from lightning_pulse.records import RECENT_RECORDS
from tests.conftest import trainer_kwargs


class _Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _loader() -> DataLoader:
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(x, x[:, :2].argmax(1)), batch_size=8)


def test_a_long_schedule_keeps_its_latest_events_in_memory_and_in_checkpoints(tmp_path):
    # held-out sweep: every event was kept, each with a per-layer dict (1,199 events and 301 KB of checkpoint
    # state after 2,400 steps of an 8-layer MLP), where every other callback keeps its latest 1,000 records
    steps = RECENT_RECORDS + 10
    prune = ScheduledPrune(final_sparsity=0.5, start=0.0, end=1.0, every=1, probe_batches=0)
    trainer = pl.Trainer(
        max_steps=steps, limit_val_batches=0, callbacks=[prune], **trainer_kwargs(default_root_dir=tmp_path)
    )
    trainer.fit(_Tiny(), _loader())
    assert len(prune.events) == RECENT_RECORDS
    kept = [event["step"] for event in prune.events]  # one event per step: the latest, the first dropped
    assert kept[0] > 1 and kept == list(range(kept[-1] - RECENT_RECORDS + 1, kept[-1] + 1))
    assert prune.events[-1]["sparsity"] == pytest.approx(0.5, abs=0.02) == prune.sparsity  # the run's figures
    trainer.save_checkpoint(tmp_path / "end.ckpt")
    saved = torch.load(tmp_path / "end.ckpt", weights_only=False)["callbacks"][prune.state_key]
    assert len(saved["events"]) == RECENT_RECORDS and saved["events"][0]["step"] == kept[0]


def test_each_distillation_window_credits_its_own_event_after_older_records_drop_and_through_a_resume(
    tmp_path, monkeypatch
):
    # the window kept its event's index in the record list, which shifts once the oldest records drop: it
    # keeps the event's step now, in the checkpoint too
    monkeypatch.setattr(prune_events, "RECENT_RECORDS", 3)  # drops from the fourth event on, in a short run

    def fit(max_steps, ckpt_path=None):
        prune = ScheduledPrune(
            final_sparsity=0.6, start=0, end=28, every=4, probe_batches=0, distill=DistillConfig(steps=2)
        )
        every_step = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1)
        kwargs = trainer_kwargs(default_root_dir=tmp_path, enable_checkpointing=True)
        trainer = pl.Trainer(
            max_steps=max_steps, limit_val_batches=0, callbacks=[prune, every_step], **kwargs
        )
        trainer.fit(_Tiny(), _loader(), ckpt_path=ckpt_path)
        return prune

    whole = fit(32)
    assert [event["step"] for event in whole.events] == [21, 25, 28]
    # each window of 2 steps closed before the next event, on its own event's record
    assert all(event["distill_calls"] == 2 for event in whole.events)
    saved = torch.load(tmp_path / "epoch=2-step=22.ckpt", weights_only=False)["callbacks"]
    teacher = saved[whole.state_key]["teacher"]  # saved one step into the window after the event at 21
    assert teacher["event_step"] == 21 and teacher["steps_left"] == 1
    resumed = fit(32, ckpt_path=tmp_path / "epoch=2-step=22.ckpt")
    assert [event["step"] for event in resumed.events] == [21, 25, 28]
    assert [event["distill_calls"] for event in resumed.events] == [2, 2, 2]
    assert all(event["distill_loss"] > 0 for event in resumed.events)


def test_a_teacher_saved_with_its_events_index_by_an_earlier_version_finds_its_event_by_step(tmp_path):
    prune = ScheduledPrune(final_sparsity=0.5, start=0.0, end=1.0, every=4, distill=DistillConfig(steps=3))
    core, student = prune.core, _Tiny()
    core.events = [{"step": 4}, {"step": 8}]
    core.window.open(student, copy.deepcopy(student), 8)  # the teacher: the student before an event
    old = core.window.state_dict()
    old["event"] = 1  # the index an earlier version saved, with no step
    del old["event_step"]
    core.window.close()
    core.pending_teacher = old
    core.restore_teacher(student, 1)
    assert core.window.event_step == 8
    student(torch.randn(2, 8)).sum().backward()
    core.end_distillation()
    assert core.events[1]["distill_calls"] == 1 and "distill_calls" not in core.events[0]
