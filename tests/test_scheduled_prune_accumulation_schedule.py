"""ScheduledPrune's distillation term after a resume under a GradientAccumulationScheduler, in either order.

The distillation term is divided by the accumulation, as Lightning divides the loss. A resume reopens the
checkpoint's open window at fit start, where a scheduler has not set the epoch's factor yet (the Trainer
holds 1): the term was 4 times too strong under ``GradientAccumulationScheduler({0: 4})`` until the window
closed."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, GradientAccumulationScheduler, ModelCheckpoint

from lightning_pulse import ScheduledPrune
from lightning_pulse.core.distillation import DistillConfig
from tests.conftest import trainer_kwargs


class DistillWeights(Callback):
    """Per optimizer step (mnist1d_small at 4 batches a step): (step, the open window's term weight)."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, float | None]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        prune = next(c for c in trainer.callbacks if isinstance(c, ScheduledPrune))
        if batch_idx % 4 == 0:
            distiller = prune.core.window.distiller
            self.rows.append((trainer.global_step, None if distiller is None else distiller.weight))


def _fit(mnist1d_small, scheduled, prune_first, tmp_path, ckpt_path=None):
    pl.seed_everything(0)
    model, data = mnist1d_small()
    # events from step 2 every 2 steps, each opening a 4-step window: one is open at epoch 1's end (step 6)
    prune = ScheduledPrune(final_sparsity=0.5, start=2, end=8, every=2, distill=DistillConfig(steps=4))
    weights, kwargs = DistillWeights(), {}
    callbacks = [prune, weights]
    if scheduled:
        gas = GradientAccumulationScheduler({0: 4})
        callbacks = [*callbacks, gas] if prune_first else [gas, *callbacks]
    else:
        kwargs["accumulate_grad_batches"] = 4
    if ckpt_path is None:  # saved at on_train_epoch_end: the resumed epoch starts with on_train_epoch_start
        callbacks.append(ModelCheckpoint(dirpath=tmp_path, save_on_train_epoch_end=True, save_top_k=-1))
        kwargs["enable_checkpointing"] = True
    trainer = pl.Trainer(callbacks=callbacks, max_epochs=3, **trainer_kwargs(**kwargs))
    trainer.fit(model, data, ckpt_path=ckpt_path)
    return trainer, [p.detach().clone() for p in model.parameters()], weights.rows


@pytest.mark.parametrize("prune_first", [True, False], ids=["prune-first", "prune-last"])
def test_a_resumed_distillation_window_is_divided_by_the_scheduled_accumulation(
    mnist1d_small, tmp_path, prune_first
):
    plain_dir, scheduled_dir = tmp_path / "plain", tmp_path / "scheduled"
    _fit(mnist1d_small, False, prune_first, plain_dir)
    _, _, full = _fit(mnist1d_small, True, prune_first, scheduled_dir)
    assert [row for row in full if row[0] >= 6] == [(6, 0.25), (7, 0.25), (8, 0.25)]
    ckpt = next(scheduled_dir.glob("epoch=1-*.ckpt"))
    trainer, weights, resumed = _fit(mnist1d_small, True, prune_first, tmp_path, ckpt_path=str(ckpt))
    assert trainer.global_step == 9
    assert resumed == [(6, 0.25), (7, 0.25), (8, 0.25)]  # the old code: 1.0 for steps 6 and 7
    # the same resume under the Trainer's own accumulation gives the same weights
    _, plain, _ = _fit(
        mnist1d_small, False, prune_first, tmp_path, ckpt_path=str(next(plain_dir.glob("epoch=1-*")))
    )
    for ours, theirs in zip(weights, plain, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
