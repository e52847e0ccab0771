"""StabilityGuard's forced skips: the batches skipped right after a rollback (``skip_after_rollback``).

Such a step is never judged, but its forward runs in training mode all the same. A NaN row in one of those
batches wrote NaN into BatchNorm's running statistics, which were never set back (the mend of a judged data
fault never ran): the fit ended with NaN buffers, a NaN validation loss and no warning. Every forced skip now
sets back what its forwards wrote, as a skipped data fault does: the window leaves the buffers as the rollback
left them.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
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


def _fit(
    with_nan: bool,
    checkpoints: Path | None = None,
    resume_from: Path | None = None,
    module: type[_BatchNormRegressor] = _BatchNormRegressor,
) -> tuple[StabilityGuard, _BuffersAtBatchEnd, _BatchNormRegressor]:
    """The run; ``checkpoints``: save one at the end of each epoch (8 steps) there; ``resume_from``: resume."""
    pl.seed_everything(0)
    guard = StabilityGuard(
        window=20,
        warmup=5,
        snapshot_every=5,
        rollback_margin=2,
        max_snapshots=3,
        skip_after_rollback=SKIP_AFTER_ROLLBACK,
    )
    watch, model = _BuffersAtBatchEnd(), module()
    callbacks: list[Callback] = [guard, watch]
    if checkpoints is not None:
        callbacks.append(
            ModelCheckpoint(dirpath=checkpoints, filename="{step}", every_n_train_steps=8, save_top_k=-1)
        )
    kwargs = trainer_kwargs(enable_checkpointing=checkpoints is not None)
    trainer = pl.Trainer(max_steps=30, callbacks=callbacks, **kwargs)
    trainer.fit(model, _loader(with_nan), ckpt_path=resume_from)
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


@pytest.mark.parametrize("with_nan", [False, True])
def test_a_run_resumed_inside_the_skip_window_ends_as_the_uninterrupted_run(tmp_path, with_nan):
    """Resumed from the checkpoint of step 16, four steps of the window (15-20) still to skip: the resumed
    fit had no copy of the buffers from before a step until its first applied one, so its skipped steps set
    back only what was non-finite; the running statistics of the rest of the window stayed, and every
    BatchNorm buffer ended unlike the uninterrupted run's (``num_batches_tracked`` 5 higher). Now they set
    back to the fit-start snapshot (the state the window keeps): the two runs end alike, bit for bit."""
    _, whole_watch, whole = _fit(with_nan, checkpoints=tmp_path)
    resumed_guard, watch, resumed = _fit(with_nan, resume_from=tmp_path / "step=16.ckpt")
    assert [event["step"] for event in resumed_guard.events if event["event"] == "rollback"] == [14]
    window_end = 15 + SKIP_AFTER_ROLLBACK
    assert all(torch.equal(watch.at[window_end][name], b) for name, b in whole_watch.at[window_end].items())
    ended = {**dict(whole.named_parameters()), **dict(whole.named_buffers())}
    for name, tensor in [*resumed.named_parameters(), *resumed.named_buffers()]:
        assert torch.equal(tensor, ended[name]), name


class _SpikeAtSixteen(_BatchNormRegressor):
    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.global_step == 16:  # a loss spike: skipped, its forward's statistics set back
            x, y = x * 30, y * 30
        return nn.functional.mse_loss(self.head(self.net(x)).squeeze(-1), y)


def test_a_run_resumed_before_a_kept_skip_and_a_data_fault_ends_as_the_uninterrupted_run(tmp_path):
    """Review: resumed at step 16, a skipped loss spike then the NaN row's data fault at 17. With no copy
    from before each step yet, the fault set back to the resumed snapshot, where the uninterrupted run set
    back to the values before step 17 (the spike then kept its forward's statistics; now both skips set back
    to the values before their own step). The checkpoint names the tensors forwards write, so the resumed fit
    copies them from its first step."""
    whole_guard, _, whole = _fit(True, checkpoints=tmp_path, module=_SpikeAtSixteen)
    resumed_guard, _, resumed = _fit(True, resume_from=tmp_path / "step=16.ckpt", module=_SpikeAtSixteen)
    kinds = [(event["event"], event["step"]) for event in resumed_guard.events if event["step"] >= 16]
    assert ("loss_spike", 16) in kinds and ("nonfinite_loss", 17) in kinds
    ended = {**dict(whole.named_parameters()), **dict(whole.named_buffers())}
    for name, tensor in [*resumed.named_parameters(), *resumed.named_buffers()]:
        assert torch.equal(tensor, ended[name]), name
