"""The callbacks' metrics land at the step Lightning gives the user's own metrics of the same moment."""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from lightning_pulse import EnergyLogger, PulseCycle
from lightning_pulse.loggers import log_to_loggers
from tests.conftest import RecordingLogger, trainer_kwargs


class LogsAtBatchEnd(Callback):
    """Logs a marker through the library's logging path at every training batch's end."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        log_to_loggers(trainer, {"marker": float(trainer.global_step)})


def test_a_batch_end_metric_shares_the_step_of_the_loss_it_follows(mnist1d_small, tmp_path):
    model, data = mnist1d_small()
    logger = RecordingLogger()
    trainer = pl.Trainer(
        callbacks=[LogsAtBatchEnd()],
        **trainer_kwargs(logger=logger, max_steps=6, log_every_n_steps=1, default_root_dir=tmp_path),
    )
    trainer.fit(model, data)
    losses = [step for step, _ in logger.logged("train_loss")]
    markers = logger.logged("marker")
    assert losses == [0, 1, 2, 3, 4, 5]
    # the marker logged after optimizer step k (global_step k) sits where that step's loss sits: k - 1
    assert [step for step, _ in markers] == losses
    assert [value for _, value in markers] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]


def test_energy_and_phase_metrics_line_up_with_the_training_loss(mnist1d_small, tmp_path):
    model, data = mnist1d_small()
    logger = RecordingLogger()
    callbacks = [
        PulseCycle(burst=3, replay=2, maintain=1, warmup=0, anneal=0, maintain_eval="none"),
        EnergyLogger(country_iso_code="DEU"),
    ]
    trainer = pl.Trainer(
        callbacks=callbacks,
        **trainer_kwargs(logger=logger, max_steps=8, log_every_n_steps=1, default_root_dir=tmp_path),
    )
    trainer.fit(model, data)
    loss_steps = {step for step, _ in logger.logged("train_loss")}
    assert loss_steps == set(range(8))
    library = [
        step for step, metrics in logger.rows if any(key.startswith(("energy/", "pulse/")) for key in metrics)
    ]
    assert {step for step, _ in logger.logged("pulse/burst_steps")} == {2}  # the burst ended with step 3
    # every figure lands on a step that has a loss, the epoch's and the run's summaries on the last one, where
    # Lightning writes an epoch's own metrics
    assert set(library) <= loss_steps
    assert [step for step, _ in logger.logged("energy/epoch_kwh")] == [7]
    assert [step for step, _ in logger.logged("energy/final_kwh")] == [7]
