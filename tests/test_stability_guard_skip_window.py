"""StabilityGuard's forced skips: the batches skipped right after a rollback (``skip_after_rollback``).

Such a step is never judged, but its forward runs in training mode all the same. A NaN row in one of those
batches wrote NaN into BatchNorm's running statistics, which were never set back (the mend of a judged data
fault never ran): the fit ended with NaN buffers, a NaN validation loss and no warning. Every forced skip now
sets back what its forwards wrote, as a skipped data fault does: the window leaves the buffers as the rollback
left them.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn

from lightning_pulse import StabilityGuard
from tests.conftest import trainer_kwargs

BATCH = 8
SPIKE_STEPS = (12, 13, 14)  # the third rolls back; steps 15-20 are then skipped
SKIP_AFTER_ROLLBACK = 6
BAD_SAMPLE = 11  # batch 1 of each 8-batch epoch: steps 1 and 9 (judged data faults) and 17 (in the window)


class _BatchNormRegressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(4, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 16), nn.BatchNorm1d(16), nn.ReLU()
        )
        self.head = nn.Linear(16, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.global_step in SPIKE_STEPS:  # a loss spike the guard rolls back after three of
            x, y = x * 30, y * 30
        return nn.functional.mse_loss(self.head(self.net(x)).squeeze(-1), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _loader(with_nan: bool) -> torch.utils.data.DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=generator)
    y = x.sum(dim=1)
    if with_nan:
        x[BAD_SAMPLE, 2] = float("nan")
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)


class _BuffersAtBatchEnd(Callback):
    """The model's buffers at each batch end (listed after the guard: after its rollback or mend)."""

    def __init__(self) -> None:
        self.at: dict[int, dict[str, torch.Tensor]] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.at[trainer.global_step] = {name: b.clone() for name, b in pl_module.named_buffers()}


def _fit(with_nan: bool) -> tuple[StabilityGuard, _BuffersAtBatchEnd, _BatchNormRegressor]:
    pl.seed_everything(0)
    guard = StabilityGuard(
        window=20,
        warmup=5,
        snapshot_every=5,
        rollback_margin=2,
        max_snapshots=3,
        skip_after_rollback=SKIP_AFTER_ROLLBACK,
    )
    watch, model = _BuffersAtBatchEnd(), _BatchNormRegressor()
    trainer = pl.Trainer(max_steps=30, callbacks=[guard, watch], **trainer_kwargs())
    trainer.fit(model, _loader(with_nan))
    return guard, watch, model


def test_a_nan_batch_in_the_skip_window_after_a_rollback_leaves_no_nan_in_the_running_statistics():
    """The NaN row's batch at step 17, inside the window skipped after the rollback at step 14: BatchNorm's
    running mean and variance ended NaN (and with them the evaluation loss), ``bad_batches`` counting only
    the judged data faults. Now the window's steps leave the buffers as the rollback left them."""
    guard, watch, model = _fit(with_nan=True)
    assert [event["step"] for event in guard.events if event["event"] == "rollback"] == [14]
    after_rollback, after_window = watch.at[15], watch.at[15 + SKIP_AFTER_ROLLBACK]
    assert all(torch.isfinite(b).all() for b in after_window.values() if b.is_floating_point())
    assert all(torch.equal(after_rollback[name], after_window[name]) for name in after_rollback)
    assert all(torch.isfinite(b).all() for b in model.buffers() if b.is_floating_point())
    model.eval()
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(1))
    assert torch.isfinite(model.head(model.net(x))).all()


def test_the_skip_window_sets_back_what_healthy_forwards_wrote_too():
    """A skipped step leaves nothing behind, bad data or not: without the NaN row the window's buffers are
    the rollback's as well (they used to hold the statistics of the six skipped batches)."""
    guard, watch, _ = _fit(with_nan=False)
    assert guard.rollbacks == 1
    assert all(
        torch.equal(watch.at[15][name], watch.at[15 + SKIP_AFTER_ROLLBACK][name]) for name in watch.at[15]
    )
