"""A monitor on a key a callback sends to the loggers only is refused at fit start, naming the callback.

``pulse/probe/val_loss``, ``prune/sparsity``, ``stability/rollbacks``, ... go straight to the loggers
(``log_to_loggers``) and never reach ``trainer.callback_metrics``: a ModelCheckpoint, EarlyStopping or
ReduceLROnPlateau on one trained up to its first check, then stopped with Lightning's hint that the
LightningModule did not log it. EnergyLogger's ``energy/total_kwh`` does reach ``callback_metrics``.
"""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pulse import (
    EnergyLogger,
    GradientCache,
    GreenWindow,
    GreenWindowOptions,
    HardSampleReplay,
    HyperConnectionMonitor,
    PulseCycle,
    ScheduledPrune,
    StabilityGuard,
)
from lightning_pulse.errors import PulseRefusal
from tests.conftest import trainer_kwargs


class _Net(pl.LightningModule):
    def __init__(self, plateau_on: str | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.l2 = nn.Linear(8, 16), nn.Linear(16, 2)
        self.plateau_on = plateau_on

    def forward(self, x):
        return self.l2(torch.relu(self.l1(x)))

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", F.cross_entropy(self(batch[0]), batch[1]))

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        if self.plateau_on is None:
            return optimizer
        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "monitor": self.plateau_on}}


def _loader() -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=generator)
    return DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=8)


def _fit(callbacks, tmp_path, model=None, max_epochs=2):
    trainer = pl.Trainer(
        max_epochs=max_epochs,
        callbacks=callbacks,
        default_root_dir=tmp_path,
        **trainer_kwargs(enable_checkpointing=True),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model or _Net(), _loader(), _loader())
    return trainer


def _cycle():
    return PulseCycle(burst=3, replay=0, maintain=2, warmup=0, anneal=0, probe_batches=1)


OWN_KEYS = {
    "PulseCycle": (_cycle, "pulse/probe/val_loss"),
    "ScheduledPrune": (lambda: ScheduledPrune(final_sparsity=0.3, start=1, end=6, every=2), "prune/sparsity"),
    "StabilityGuard": (StabilityGuard, "stability/rollbacks"),
    "HardSampleReplay": (HardSampleReplay, "hard_sample_replay/mean_loss"),
    "GradientCache": (GradientCache, "gradient_cache/frozen_units"),
    "HyperConnectionMonitor": (HyperConnectionMonitor, "mhc/forward_gain"),
}


@pytest.mark.parametrize("owner", sorted(OWN_KEYS))
@pytest.mark.parametrize("monitor_class", [ModelCheckpoint, EarlyStopping])
def test_a_monitor_on_a_logger_only_key_is_refused_at_fit_start_naming_the_callback(
    owner, monitor_class, tmp_path
):
    make, key = OWN_KEYS[owner]
    kwargs = {"dirpath": tmp_path} if monitor_class is ModelCheckpoint else {}
    with pytest.raises(PulseRefusal) as refusal:
        _fit([make(), monitor_class(monitor=key, **kwargs)], tmp_path)
    message = str(refusal.value)
    assert message.startswith(f"{owner}: {monitor_class.__name__}(monitor='{key}')"), message
    assert "loggers only" in message and "callback_metrics" in message and "`val_loss`" in message


@pytest.mark.parametrize("key", ["pulse/phase", "pulse/probe/val_loss"])
def test_a_plateau_scheduler_on_a_logger_only_key_is_refused_before_the_first_step(key, tmp_path):
    seen = []

    class _Steps(pl.Callback):
        def on_train_batch_start(self, trainer, *args):
            seen.append(trainer.global_step)

    with pytest.raises(PulseRefusal, match=r"PulseCycle: ReduceLROnPlateau \(lr_scheduler config monitor="):
        _fit([_cycle(), _Steps()], tmp_path, model=_Net(plateau_on=key))
    assert seen == []


def test_energy_figures_other_than_the_total_are_refused_and_the_total_stays_monitorable(tmp_path):
    logger_only = ModelCheckpoint(dirpath=tmp_path / "a", monitor="energy/power_w")
    with pytest.raises(PulseRefusal, match="EnergyLogger: ModelCheckpoint.*energy/total_kwh"):
        _fit([EnergyLogger(report_dir=tmp_path / "r1"), logger_only], tmp_path)
    total = ModelCheckpoint(dirpath=tmp_path / "b", monitor="energy/total_kwh")
    stop = EarlyStopping(monitor="energy/total_kwh", mode="min", patience=5)
    trainer = _fit([EnergyLogger(report_dir=tmp_path / "r2"), total, stop], tmp_path)
    assert trainer.global_step == 16 and total.best_model_score is not None


def test_green_window_figures_are_refused(tmp_path):
    options = GreenWindowOptions(report_dir=tmp_path / "report")
    window = GreenWindow(signal=[(0, 1.0), (3600, 2.0)], when_dirty="pause", options=options)
    with pytest.raises(PulseRefusal, match=r"GreenWindow: EarlyStopping\(monitor='green/signal'\)"):
        _fit([window, EarlyStopping(monitor="green/signal")], tmp_path)


def test_a_key_of_a_callback_not_in_the_fit_is_left_to_lightning(tmp_path):
    # `prune/...` next to a PulseCycle alone: not a key of this fit's callbacks (the module may log it)
    class _LogsPrune(_Net):
        def validation_step(self, batch, batch_idx):
            self.log("prune/val_loss", F.cross_entropy(self(batch[0]), batch[1]))

    checkpoint = ModelCheckpoint(dirpath=tmp_path, monitor="prune/val_loss")
    trainer = _fit([_cycle(), checkpoint], tmp_path, model=_LogsPrune())
    assert trainer.global_step == 16 and checkpoint.best_model_score is not None
