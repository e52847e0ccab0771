"""The evaluation probes (PulseCycle's maintain probe, ScheduledPrune's event probes) take only what the fit's
validation would take: nothing under ``limit_val_batches=0`` (said once), at most its batches under a smaller
limit."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pulse import PulseCycle, ScheduledPrune
from tests.conftest import trainer_kwargs


def _loader(samples: int, seed: int) -> DataLoader:
    generator = torch.Generator().manual_seed(seed)
    x, y = torch.randn(samples, 6, generator=generator), torch.randint(0, 3, (samples,), generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=8)


class _Counting(pl.LightningModule):
    """Keeps the ``batch_idx`` of every ``validation_step`` call made outside Lightning's validation loop (the
    probes'), and counts those made inside it (in private attributes: the probes give public ones back)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
        self._probe_calls: list[int] = []
        self._loop_calls = 0
        self.in_the_loop = False  # the probes call no validation hook but `validation_step`

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def on_validation_epoch_start(self):
        self.in_the_loop = True

    def on_validation_epoch_end(self):
        self.in_the_loop = False

    def validation_step(self, batch, batch_idx):
        if self.in_the_loop:
            self._loop_calls += 1
        else:
            self._probe_calls.append(batch_idx)
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.net(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _pulse_cycle() -> PulseCycle:
    return PulseCycle(burst=2, replay=1, maintain=1, warmup=0, anneal=0, probe_batches=3)


def _scheduled_prune() -> ScheduledPrune:
    return ScheduledPrune(final_sparsity=0.5, start=2, end=10, every=2, probe_batches=3)


CALLBACKS = {"PulseCycle": _pulse_cycle, "ScheduledPrune": _scheduled_prune}


@pytest.mark.parametrize("name", CALLBACKS)
def test_validation_switched_off_switches_the_probe_off_and_says_so(name):
    """Sweep of Lightning flows: under ``limit_val_batches=0`` a plain fit made no ``validation_step`` call,
    but the maintain probe made 4 and ScheduledPrune's probes 36, logging probe figures, and nothing said so.
    Users switch validation off for speed or because the validation data or step is not ready."""
    module, callback = _Counting(), CALLBACKS[name]()
    trainer = pl.Trainer(**trainer_kwargs(max_steps=12, limit_val_batches=0, callbacks=[callback]))
    with pytest.warns(UserWarning, match="limit_val_batches=0") as warned:
        trainer.fit(module, _loader(48, 0), _loader(32, 1))

    assert module._probe_calls == [] and module._loop_calls == 0
    messages = [str(record.message) for record in warned if "limit_val_batches" in str(record.message)]
    assert len(messages) == 1  # once, not at every probe
    way_out = 'maintain_eval="none"' if name == "PulseCycle" else "probe_batches=0"
    assert messages[0].startswith(f"{name}: `limit_val_batches=0` switches validation off")
    assert way_out in messages[0] and "\n" not in messages[0]
    if name == "PulseCycle":
        assert callback.last_probe == {}
    else:
        assert callback.events
        assert not any(event["probe_before"] or event["probe_after"] for event in callback.events)


def test_validation_switched_off_leaves_a_validation_dataloader_that_is_not_ready_alone():
    """Lightning asks for no validation dataloader when validation is off; the probe asked the module's
    ``val_dataloader`` for one, so a fit whose validation data was not ready yet crashed in the probe."""

    class NotReady(_Counting):
        def val_dataloader(self):
            raise RuntimeError("the validation data is not ready")

    trainer = pl.Trainer(**trainer_kwargs(max_steps=12, limit_val_batches=0, callbacks=[_pulse_cycle()]))
    with pytest.warns(UserWarning, match="PulseCycle: `limit_val_batches=0`"):
        trainer.fit(NotReady(), _loader(48, 0))
    assert trainer.global_step == 12


@pytest.mark.parametrize("name", CALLBACKS)
@pytest.mark.parametrize(
    ("limit", "validated", "taken"), [(1, 1, [0]), (0.5, 2, [0, 1]), (1.0, 4, [0, 1, 2]), (5, 4, [0, 1, 2])]
)
def test_the_probe_takes_at_most_the_batches_the_fits_validation_takes(name, limit, validated, taken):
    """Each probe evaluates the first ``probe_batches`` (3) validation batches, but no more than Lightning's
    validation takes of the 4 there are under ``limit_val_batches``: 1 of them for ``1``, 2 for ``0.5``."""
    module, callback = _Counting(), CALLBACKS[name]()
    trainer = pl.Trainer(**trainer_kwargs(max_steps=12, limit_val_batches=limit, callbacks=[callback]))
    trainer.fit(module, _loader(48, 0), _loader(32, 1))

    assert module._loop_calls == 2 * validated  # Lightning's own validation, at the end of each of 2 epochs
    probes = module._probe_calls.count(0)
    assert probes >= 2
    assert module._probe_calls == taken * probes
