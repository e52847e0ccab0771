"""The client models train as written, with no lightning-pulse callback: the baseline of the model matrix.

Each fit must lower the validation loss, so a client that is broken on its own cannot make a callback look
wrong (or right) in the matrix.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest

from tests.clients import CLIENTS
from tests.conftest import trainer_kwargs

pytest.importorskip("transformers")


@pytest.mark.parametrize("name", sorted(CLIENTS))
def test_client_learns_without_any_callback(name):
    pl.seed_everything(0, verbose=False)
    module, data = CLIENTS[name]()
    trainer = pl.Trainer(max_steps=40, limit_val_batches=4, **trainer_kwargs())
    before = trainer.validate(module, data, verbose=False)[0]["val_loss"]
    trainer = pl.Trainer(max_steps=40, limit_val_batches=4, **trainer_kwargs())
    trainer.fit(module, data)
    after = trainer.validate(module, data, verbose=False)[0]["val_loss"]
    assert after < 0.95 * before, f"{name}: val_loss {before:.3f} -> {after:.3f}"
