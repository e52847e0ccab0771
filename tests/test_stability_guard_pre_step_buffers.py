"""StabilityGuard sets the buffers a bad batch's forward wrote back to their values before its step.

A data fault's step is skipped, but its forward already wrote BatchNorm's running statistics. They used to go
back to the newest snapshot's values: with ``snapshot_every=100`` every bad batch threw away up to 100 steps of
statistics (two runs differing only in ``snapshot_every`` ended with the same weights and different validation
losses). The guard now copies the buffers training forwards write before each optimizer step's first forward
(:class:`~lightning_pulse.core.snapshots.PreStepBuffers`), and the run ends as one in which that step was
skipped by hand.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_pulse import StabilityGuard
from lightning_pulse.core.snapshots import PreStepBuffers, take_snapshot
from lightning_pulse.core.stability_policy import Action
from tests.conftest import trainer_kwargs

BATCH = 8
BAD_SAMPLE = 21  # in batch 2 of each epoch (no shuffling): a sample that comes back every epoch


class _MeanByReplacement(nn.Module):
    """Keeps a running mean by replacing its buffer's tensor at every training forward, not writing into it."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.mean = 0.9 * self.mean + 0.1 * x.detach().mean(dim=0)
        return x - self.mean


class _BatchNormRegressor(pl.LightningModule):
    """BatchNorm (one with a cumulative average, which reads ``num_batches_tracked``) and a buffer replaced
    at every forward. ``skip_steps_of``: the batch indices whose step it skips by hand, before the forward."""

    def __init__(self, skip_steps_of: frozenset[int] = frozenset()) -> None:
        super().__init__()
        self.skip_steps_of = skip_steps_of
        self.net = nn.Sequential(
            nn.Linear(4, 16),
            nn.BatchNorm1d(16),
            nn.ReLU(),
            _MeanByReplacement(16),
            nn.Linear(16, 16),
            nn.BatchNorm1d(16, momentum=None),
            nn.ReLU(),
            nn.Linear(16, 1),
        )

    def training_step(self, batch, batch_idx):
        if batch_idx in self.skip_steps_of:
            return None
        x, y = batch
        return nn.functional.mse_loss(self.net(x).squeeze(-1), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _loader(with_nan: bool) -> torch.utils.data.DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=generator)
    y = x.sum(dim=1)
    if with_nan:
        x[BAD_SAMPLE, 2] = float("nan")
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)


def _fit(model: pl.LightningModule, callbacks: list, accumulate: int) -> None:
    pl.seed_everything(0)
    kwargs = trainer_kwargs(max_epochs=4, accumulate_grad_batches=accumulate)
    pl.Trainer(callbacks=callbacks, **kwargs).fit(model, _loader(with_nan=True))


@pytest.mark.filterwarnings("ignore:`training_step` returned `None`")
@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_recurring_nan_sample_leaves_the_buffers_as_a_run_that_skipped_its_steps_by_hand(accumulate):
    """Before, each bad batch set BatchNorm's running statistics back to the fit-start snapshot (step 0) and
    left ``num_batches_tracked`` counting the bad forward; with accumulation, the window's other micro-batch
    had written them too, and it is skipped with it."""
    bad_batch = BAD_SAMPLE // BATCH
    window = {bad_batch // accumulate * accumulate + i for i in range(accumulate)}  # skipped together
    torch.manual_seed(0)
    by_hand = _BatchNormRegressor(skip_steps_of=frozenset(window))
    guarded = _BatchNormRegressor()
    guarded.load_state_dict(by_hand.state_dict())
    _fit(by_hand, [], accumulate)
    guard = StabilityGuard(snapshot_every=100, loss_zscore=None, grad_norm_zscore=None)
    with pytest.warns(UserWarning, match="non-finite values in its data") as warnings:
        _fit(guarded, [guard], accumulate)
    assert guard.bad_batches == 4 and guard.rollbacks == 0  # once an epoch, the data's fault
    for (name, kept), (_, expected) in zip(guarded.named_buffers(), by_hand.named_buffers()):
        assert torch.equal(kept, expected), name
    for (name, kept), (_, expected) in zip(guarded.named_parameters(), by_hand.named_parameters()):
        assert torch.equal(kept, expected), name
    said = next(str(w.message) for w in warnings if "in its data" in str(w.message))
    assert (
        "net.1.running_mean, net.1.running_var, net.3.mean, net.5.running_mean, net.5.running_var: " in said
    )
    assert "set back to their values before this step." in said


def test_the_buffers_forwards_write_are_learned_from_their_values_and_copied_before_a_steps_first_forward():
    """BatchNorm's kernel writes its running statistics without bumping their version counters: they are
    told by their values. A constant buffer is not copied; a model that writes none copies nothing."""
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    model.register_buffer("constant", torch.arange(4.0))
    pre_step = PreStepBuffers()
    pre_step.learn(model, take_snapshot(0, model))
    assert pre_step.names == []  # nothing written since the snapshot
    before = take_snapshot(0, model)
    model(torch.randn(5, 3))
    pre_step.learn(model, before)
    assert pre_step.names == ["1.running_mean", "1.running_var", "1.num_batches_tracked"]
    pre_step.before_step([("a micro-batch", None)])  # inside an accumulation window: no copy
    assert not pre_step.copied
    pre_step.before_step([])
    kept = [buffer.clone() for buffer in model[1].buffers()]
    model(torch.full((5, 3), float("nan")))
    assert pre_step.restore() == pre_step.names
    assert all(torch.equal(buffer, saved) for buffer, saved in zip(model[1].buffers(), kept))


def test_a_prune_that_replaces_parameters_drops_the_copy_until_a_step_learns_anew():
    """The copy holds the shapes and modules before the cut: set back after it, a BatchNorm of the channels
    cut would get the old shapes. Until the first applied step after the prune learns again, a data fault
    falls back to the snapshot's values."""
    guard = StabilityGuard()
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    guard.core.start(0)
    guard.core.take_snapshot(0, model, [], [], {})
    model(torch.randn(5, 3))
    guard.core.finish_step(Action.APPLY, 1, model=model)
    assert guard.core.pre_step.names == ["1.running_mean", "1.running_var", "1.num_batches_tracked"]
    guard.core.pre_step.before_step([])
    assert guard.core.pre_step.copied
    guard.core.parameters_replaced(1)
    assert not guard.core.pre_step.copied and guard.core.pre_step.restore() == []
    model(torch.randn(5, 3))
    guard.core.finish_step(Action.APPLY, 2, model=model)  # learns again, against the newest snapshot
    assert guard.core.pre_step.names == ["1.running_mean", "1.running_var", "1.num_batches_tracked"]
