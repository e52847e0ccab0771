"""HyperConnectionMonitor on client models: they hold no hyper-connection layer, so it says so once and
changes nothing."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from lightning_pulse import HyperConnectionMonitor
from tests.clients import CLIENTS
from tests.conftest import trainer_kwargs

pytest.importorskip("transformers")


@pytest.mark.parametrize("name", sorted(CLIENTS))
def test_a_model_without_hyper_connections_gets_one_warning_and_an_unchanged_run(name, recwarn):
    pl.seed_everything(0, verbose=False)
    module, data = CLIENTS[name]()
    monitor = HyperConnectionMonitor(every_n_steps=5)
    pl.Trainer(max_steps=20, limit_val_batches=0, callbacks=[monitor], **trainer_kwargs()).fit(module, data)
    warned = [w for w in recwarn if "found no HyperConnection" in str(w.message)]
    assert len(warned) == 1 and monitor.history == []
    pl.seed_everything(0, verbose=False)
    plain, data = CLIENTS[name]()
    pl.Trainer(max_steps=20, limit_val_batches=0, **trainer_kwargs()).fit(plain, data)
    for watched, alone in zip(module.parameters(), plain.parameters()):
        assert torch.equal(watched, alone)  # the monitor left training bit for bit as it was
