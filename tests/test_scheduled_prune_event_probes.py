"""A prune event's "before" and "after" probes read the same batches, at the same point of the optimizer.

Next to a PulseCycle, an event reused the cycle's maintain probe as its "before" figure whatever batches it
read: ``PulseCycle(probe_batches=1)`` with ``ScheduledPrune(probe_batches=4)`` compared one batch before the
cut with four after it (+13.2% val_loss for a cut that changed it by 0.0%). And its own probes read a
schedule-free optimizer's training point ``y``, where the cycle's probe (and Lightning's validation) read
its evaluation point ``x``: "before" and "after" were of two weight vectors.
"""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pulse import PulseCycle, ScheduledPrune
from lightning_pulse.core.optimizer_modes import evaluation_point
from lightning_pulse.phase import Phase
from lightning_pulse.probe import first_validation_batches, run_validation_probe
from tests.conftest import trainer_kwargs
from tests.test_pulse_cycle_schedule_free import _ScheduleFreeModel


class _Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.l2 = nn.Linear(8, 32), nn.Linear(32, 2)

    def forward(self, x):
        return self.l2(torch.relu(self.l1(x)))

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", F.cross_entropy(self(batch[0]), batch[1]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _prune_event_next_to_a_cycle(cycle_batches: int) -> dict:
    generator = torch.Generator().manual_seed(0)
    x, xv = torch.randn(256, 8, generator=generator), torch.randn(64, 8, generator=generator)
    y, yv = (x[:, 0] > 0).long(), (xv[:, 0] > 0).long()
    yv[16:] = 1 - yv[16:]  # the first validation batch is clean, the three after it mislabelled
    torch.manual_seed(0)
    prune = ScheduledPrune(final_sparsity=0.05, start=1, end=7, probe_batches=4)
    cycle = PulseCycle(burst=3, replay=0, maintain=2, warmup=0, anneal=0, probe_batches=cycle_batches)
    trainer = pl.Trainer(max_steps=8, callbacks=[cycle, prune], limit_val_batches=4, **trainer_kwargs())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(
            _Net(),
            DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True),
            DataLoader(TensorDataset(xv, yv), batch_size=16),
        )
    assert prune.events[0]["phase"] == "maintain"
    return prune.events[0]


def test_an_event_next_to_a_cycle_probing_other_batches_reads_its_own_before_figure():
    same, other = _prune_event_next_to_a_cycle(4), _prune_event_next_to_a_cycle(1)
    before, after = other["probe_before"]["val_loss"], other["probe_after"]["val_loss"]
    # the same four batches before and after the cut: the tiny cut moves val_loss by well under 1%
    assert before == pytest.approx(same["probe_before"]["val_loss"], rel=1e-6)
    assert after == pytest.approx(same["probe_after"]["val_loss"], rel=1e-6)
    assert abs(after - before) / before < 0.01


class _AtEvaluationPoint(Callback):
    """The probe's figure at the optimizer's evaluation point, where a maintain phase starts (a PulseCycle's
    event) or at each batch end (the step cadence's): listed before ScheduledPrune, before its cut; after
    it, after its cut."""

    def __init__(self, at_phase_change: bool) -> None:
        self.at_phase_change, self.figures = at_phase_change, {}

    def _read(self, trainer, pl_module) -> None:
        batches, several = first_validation_batches(trainer, pl_module, 4)
        with evaluation_point(trainer.optimizers):
            figure = run_validation_probe(trainer, pl_module, batches, several)["val_loss"]
        self.figures.setdefault(trainer.global_step, figure)

    def on_pulse_phase_change(self, trainer, pl_module, change) -> None:
        if self.at_phase_change and change.current is Phase.MAINTAIN:
            self._read(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        if not self.at_phase_change:
            self._read(trainer, pl_module)


@pytest.mark.parametrize("with_cycle", [True, False], ids=["next-to-pulse-cycle", "step-cadence"])
def test_an_events_probes_read_a_schedule_free_optimizers_evaluation_point(with_cycle):
    before, after = _AtEvaluationPoint(with_cycle), _AtEvaluationPoint(with_cycle)
    prune = ScheduledPrune(final_sparsity=0.3, start=1, end=7, probe_batches=4, every=3)
    cycle = (
        [PulseCycle(burst=3, replay=0, maintain=2, warmup=0, anneal=0, probe_batches=4)] if with_cycle else []
    )
    callbacks = [before, *cycle, prune, after]
    trainer = pl.Trainer(max_steps=8, callbacks=callbacks, limit_val_batches=4, **trainer_kwargs())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(_ScheduleFreeModel())
    event = prune.events[0]
    step = event["step"]
    assert event["probe_before"]["val_loss"] == pytest.approx(before.figures[step], rel=1e-6)
    assert event["probe_after"]["val_loss"] == pytest.approx(after.figures[step], rel=1e-6)


class _ValidationFailsFromStepEight(_Net):
    def validation_step(self, batch, batch_idx):
        if self.trainer.state.stage == "train" and self.trainer.global_step >= 8:
            raise KeyError("label")  # in the probes from the second maintain phase on
        super().validation_step(batch, batch_idx)


def test_an_event_does_not_reuse_a_cycle_probe_that_is_off_as_its_before_figure():
    # a review: once the cycle's probe was off (its validation_step raised), an event at a maintain entry still
    # reused the cycle's last good figures, an older step's, as its "before" figures
    generator = torch.Generator().manual_seed(0)
    x, xv = torch.randn(256, 8, generator=generator), torch.randn(64, 8, generator=generator)
    prune = ScheduledPrune(final_sparsity=0.5, start=1, end=11, every=1, probe_batches=2)
    cycle = PulseCycle(burst=3, replay=0, maintain=2, warmup=0, anneal=0, probe_batches=2)
    trainer = pl.Trainer(max_steps=12, callbacks=[cycle, prune], limit_val_batches=2, **trainer_kwargs())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(
            _ValidationFailsFromStepEight(),
            DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=16),
            DataLoader(TensorDataset(xv, (xv[:, 0] > 0).long()), batch_size=16),
        )
    at_maintain = [event for event in prune.events if event["phase"] == "maintain"]
    assert [event["step"] for event in at_maintain][:2] == [3, 8]
    assert at_maintain[0]["probe_before"] and at_maintain[0]["probe_before"] == cycle.last_probe
    assert not at_maintain[1]["probe_before"]  # no figures of step 3 passed off as step 8's
