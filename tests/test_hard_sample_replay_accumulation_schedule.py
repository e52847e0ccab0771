"""HardSampleReplay's epoch-based half-life and threshold refresh next to a GradientAccumulationScheduler.

``score_half_life`` in epochs is turned into optimizer steps, and the hardness threshold is refreshed twice an
epoch. Both read ``trainer.accumulate_grad_batches`` at fit start, which a scheduler sets only in its
``on_train_epoch_start``: under ``GradientAccumulationScheduler({0: 4})`` the 5-epoch half-life of a 3-step
epoch was 60 steps instead of 15, and the threshold was refreshed every 6 steps instead of every step, in
either callback order. Now both follow the schedule's factor for each epoch."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, GradientAccumulationScheduler, ModelCheckpoint

from lightning_pulse import HardSampleReplay
from tests.conftest import trainer_kwargs


class EpochLengths(Callback):
    """Per training batch: (epoch, batch index, half-life in steps, threshold refresh interval)."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, int, float | None, int]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        replay = next(c for c in trainer.callbacks if isinstance(c, HardSampleReplay))
        selector = replay.selector
        self.rows.append(
            (trainer.current_epoch, batch_idx, selector.table.half_life, selector.threshold_every)
        )

    def per_epoch(self) -> dict[int, tuple[float | None, int]]:
        out: dict[int, tuple[float | None, int]] = {}
        for epoch, _, half_life, every in self.rows:
            assert out.setdefault(epoch, (half_life, every)) == (half_life, every), "changed mid-epoch"
        return out


def _fit(mnist1d_small, schedule, replay_first, max_epochs, ckpt_path=None, callbacks=(), **kwargs):
    pl.seed_everything(0)
    model, data = mnist1d_small()
    replay = HardSampleReplay(mode="batch", score_half_life=5.0)
    if schedule is None:
        pair = [replay]
    else:
        pair = [replay, GradientAccumulationScheduler(dict(schedule))]
        pair = pair if replay_first else pair[::-1]
    lengths = EpochLengths()
    trainer = pl.Trainer(
        callbacks=[*pair, lengths, *callbacks], max_epochs=max_epochs, **trainer_kwargs(**kwargs)
    )
    trainer.fit(model, data, ckpt_path=ckpt_path)
    return trainer, model, lengths


def _weights(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("replay_first", [True, False], ids=["replay-first", "replay-last"])
def test_a_constant_schedule_trains_as_the_trainers_own_accumulation(mnist1d_small, replay_first):
    # mnist1d_small: 12 batches an epoch, 3 optimizer steps at 4 batches a step: a 5-epoch half-life is 15
    # steps and the threshold is refreshed every step (was 60 and 6 under the scheduler)
    _, plain_model, plain = _fit(mnist1d_small, None, True, 3, accumulate_grad_batches=4)
    trainer, model, lengths = _fit(mnist1d_small, {0: 4}, replay_first, 3)
    assert trainer.global_step == 9
    assert plain.per_epoch() == {0: (15.0, 1), 1: (15.0, 1), 2: (15.0, 1)}
    assert lengths.per_epoch() == plain.per_epoch()
    for ours, theirs in zip(_weights(model), _weights(plain_model), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


@pytest.mark.parametrize("replay_first", [True, False], ids=["replay-first", "replay-last"])
def test_a_changing_schedule_gives_each_epoch_its_own_length(mnist1d_small, replay_first):
    # 12, 12, 3 steps an epoch: an epoch's half-life and threshold refresh follow its own steps
    _, _, lengths = _fit(mnist1d_small, {0: 1, 2: 4}, replay_first, 3)
    assert lengths.per_epoch() == {0: (60.0, 6), 1: (60.0, 6), 2: (15.0, 1)}


@pytest.mark.parametrize("step", [24, 26], ids=["epoch-end", "mid-epoch"])
@pytest.mark.parametrize("replay_first", [True, False], ids=["replay-first", "replay-last"])
def test_a_resume_under_the_schedule_reads_the_same_lengths(mnist1d_small, tmp_path, replay_first, step):
    # {0: 1, 2: 4}: epochs 0 and 1 take 12 steps each, epoch 2 three. Step 24 is epoch 1's last batch, step
    # 26 is 8 batches into epoch 2. Both are saved at a batch's end, so Lightning resumes without an
    # on_train_epoch_start for epoch 2 and trains its batches at the Trainer's factor of 1: the epoch's
    # half-life and refresh are still the schedule's, as in the uninterrupted run (the old code read 60 steps
    # and 6 from the Trainer's factor at fit start)
    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1, save_last=False)
    schedule = {0: 1, 2: 4}
    _, _, full = _fit(
        mnist1d_small, schedule, replay_first, 4, callbacks=[checkpoint], enable_checkpointing=True
    )
    assert full.per_epoch() == {0: (60.0, 6), 1: (60.0, 6), 2: (15.0, 1), 3: (15.0, 1)}
    ckpt = next(tmp_path.glob(f"*step={step}.ckpt"))
    _, _, resumed = _fit(mnist1d_small, schedule, replay_first, 4, ckpt_path=str(ckpt))
    assert resumed.rows[0][:2] == ((2, 0) if step == 24 else (2, 8))
    assert resumed.per_epoch() == {2: (15.0, 1), 3: (15.0, 1)}
