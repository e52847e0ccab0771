"""GradientCache under DDP: two gloo processes freeze the same units and stay in sync."""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy

from lightning_pulse import PulseCycle
from lightning_pulse.callbacks.gradient_cache import GradientCache
from tests.conftest import trainer_kwargs


class RankReport(Callback):
    """Writes, per rank, what GradientCache decided and where the parameters ended up."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.trains_first_layer: list[bool] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.trains_first_layer.append(pl_module.net[1].weight.requires_grad)

    def on_train_end(self, trainer, pl_module):
        cache = next(cb for cb in trainer.callbacks if isinstance(cb, GradientCache))
        report = {
            "events": cache.events,
            "trains_first_layer": self.trains_first_layer,
            "skipped": cache.ledger.skipped,
            "params": [float(p.detach().double().sum()) for p in pl_module.parameters()],
        }
        Path(self.folder, f"rank{trainer.global_rank}.json").write_text(json.dumps(report))


@pytest.mark.ddp
def test_two_gloo_processes_freeze_the_same_units_and_keep_parameters_identical(mnist1d_small, tmp_path):
    model, data = mnist1d_small()
    cycle = PulseCycle(burst=6, replay=12, maintain=0, warmup=0.0, anneal=0.0, maintain_eval="none")
    cache = GradientCache(threshold=2.0, check_every=3, freeze_for=6)
    trainer = pl.Trainer(
        callbacks=[cycle, cache, RankReport(str(tmp_path))],
        max_steps=24,
        **trainer_kwargs(
            devices=2,
            strategy=DDPStrategy(
                find_unused_parameters=True, start_method="spawn", process_group_backend="gloo"
            ),
            accumulate_grad_batches=2,
        ),
    )
    trainer.fit(model, data)
    rank0 = json.loads((tmp_path / "rank0.json").read_text())
    rank1 = json.loads((tmp_path / "rank1.json").read_text())
    assert rank0["events"], "nothing was frozen"
    assert rank0["events"] == rank1["events"]
    assert rank0["trains_first_layer"] == rank1["trains_first_layer"]
    assert not all(rank0["trains_first_layer"]) and any(rank0["trains_first_layer"])
    assert rank0["skipped"] > 0
    # unused-parameter handling kept the replicas identical through freezes and releases
    assert torch.allclose(torch.tensor(rank0["params"]), torch.tensor(rank1["params"]), rtol=0, atol=1e-9)
