from __future__ import annotations

import lightning.pytorch as pl
import pytest

from examples.charlm import CharLMDataModule, CharTransformerLM
from tests.conftest import trainer_kwargs


def test_charlm_cosine_schedule_warms_up_then_decays_to_floor():
    model = CharTransformerLM(d_model=16, n_layers=1, seq_len=16, lr=1e-2, scheduler="cosine")
    lrs = []

    class RecordLearningRate(pl.Callback):
        def on_train_batch_start(self, trainer, *args):
            lrs.append(trainer.optimizers[0].param_groups[0]["lr"])

    trainer = pl.Trainer(
        **trainer_kwargs(max_steps=40, limit_val_batches=0, callbacks=[RecordLearningRate()])
    )
    trainer.fit(model, CharLMDataModule(seq_len=16, batch_size=4, max_chars=20000))
    assert lrs[0] < lrs[2] <= 1e-2 + 1e-12
    assert max(lrs) == pytest.approx(1e-2)
    assert lrs[-1] < 0.2e-2 and lrs[-1] >= 0.1e-2 - 1e-12


def test_charlm_rejects_unknown_scheduler():
    with pytest.raises(ValueError, match="scheduler"):
        CharTransformerLM(scheduler="step")
