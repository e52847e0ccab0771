"""StabilityGuard sets the buffers a bad batch's forward wrote back to their values before its step.

A data fault's step is skipped, but its forward already wrote BatchNorm's running statistics. They used to go
back to the newest snapshot's values: with ``snapshot_every=100`` every bad batch threw away up to 100 steps
of statistics (two runs differing only in ``snapshot_every`` ended with the same weights and different
validation losses). The guard now copies the buffers training forwards write before each optimizer step's
first forward (:class:`~lightning_pulse.core.snapshots.PreStepBuffers`), and the run ends as one in which that
step was skipped by hand.
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
    """Keeps a running mean by replacing its buffer's tensor at every training forward, not writing into
    it."""

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


class _ForwardInTrainModeFirst(pl.Callback):
    """Listed before the guard: a training-mode forward on the batch before the guard's copy (a scoring or
    logging pass), which on a bad batch writes its NaN into BatchNorm's statistics before the copy."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        with torch.no_grad():
            pl_module.net(batch[0])


def test_a_copy_taken_after_the_bad_batch_reached_the_buffers_falls_back_to_the_snapshot():
    """A review: the copy held the NaN a callback's forward wrote first, the mend "set it back", the data
    check failed on it and the steps rolled back as the model's (2 rollbacks, 0 bad batches, NaN buffers at
    the end). Such names fall back to the snapshot's values, as before the copy existed."""
    pl.seed_everything(0)
    model = _BatchNormRegressor()
    guard = StabilityGuard(snapshot_every=100, loss_zscore=None, grad_norm_zscore=None)
    pl.seed_everything(0)
    trainer = pl.Trainer(callbacks=[_ForwardInTrainModeFirst(), guard], **trainer_kwargs(max_epochs=4))
    with pytest.warns(UserWarning):
        trainer.fit(model, _loader(with_nan=True))
    assert guard.rollbacks == 0
    assert guard.bad_batches == 4
    assert all(torch.isfinite(buffer.float()).all() for buffer in model.buffers())


class _PruneAndFold(pl.Callback):
    """A user's own ``torch.nn.utils.prune``: masks changed at steps 4 and 8 (between snapshots), then folded
    into the weight at step 14, which deletes the mask buffer."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        layer = pl_module.net[0]
        if trainer.global_step in (4, 8):
            torch.nn.utils.prune.l1_unstructured(layer, "weight", amount=0.05 * trainer.global_step)
        if trainer.global_step == 14:
            torch.nn.utils.prune.remove(layer, "weight")


def test_pruning_masks_are_not_copied_before_each_step_and_folding_them_in_trains_on():
    """A review: masks a prune event changed between snapshots were learned as written by forwards and
    copied before every step (as large as the weights), and folding them in (the buffer deleted) crashed the
    next step with a KeyError."""
    model = _BatchNormRegressor()
    guard = StabilityGuard(snapshot_every=5, rollback_margin=5)
    trainer = pl.Trainer(callbacks=[guard, _PruneAndFold()], **trainer_kwargs(max_steps=30))
    trainer.fit(model, _loader(with_nan=False))
    assert trainer.global_step == 30
    assert not any(name.endswith("_mask") for name in guard.core.pre_step.names)
    assert any("running_mean" in name for name in guard.core.pre_step.names)


class _DropsItsRunningBuffer(pl.Callback):
    """Deletes a buffer the forwards write (a module that stops tracking a statistic) at step 12."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 12:
            del pl_module.net[3]._buffers["mean"]
            pl_module.net[3].mean = torch.zeros(16)  # a plain attribute from now on


def test_a_written_buffer_deleted_mid_fit_is_dropped_from_the_copy():
    model = _BatchNormRegressor()
    guard = StabilityGuard(snapshot_every=5, rollback_margin=5)
    trainer = pl.Trainer(callbacks=[guard, _DropsItsRunningBuffer()], **trainer_kwargs(max_steps=24))
    trainer.fit(model, _loader(with_nan=False))
    assert trainer.global_step == 24


class _PrunableRegressor(_BatchNormRegressor):
    """BatchNorm only (a structured cut can follow), with a ``forward`` for ScheduledPrune to trace."""

    def __init__(self, skip_steps_of: frozenset[int] = frozenset()) -> None:
        super().__init__(skip_steps_of)
        self.net = nn.Sequential(
            nn.Linear(4, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 16), nn.BatchNorm1d(16), nn.ReLU()
        )
        self.net.append(nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@pytest.mark.filterwarnings("ignore:`training_step` returned `None`")
@pytest.mark.parametrize("prune_after_guard", [True, False])
def test_a_bad_batch_right_after_a_structured_prune_leaves_the_buffers_as_a_run_that_skipped_it(
    prune_after_guard,
):
    """A review: a prune drops the pre-step copy (its shapes are gone) until an applied step learns anew.
    With ScheduledPrune listed after the guard, the snapshot after the cut comes one step later, so a bad
    batch at the step right after the cut (step 4) found neither a copy nor a snapshot that fits: its NaN
    stayed in BatchNorm's running statistics to the end of the fit, with no rollback and no warning. The
    names still there stay learned through the cut, copied in their new shapes from the next step on."""
    from lightning_pulse import ScheduledPrune

    after_cut = BAD_SAMPLE // BATCH + 2  # batch 4 of each epoch: the step right after the cut at step 4
    torch.manual_seed(0)
    by_hand, guarded = _PrunableRegressor(skip_steps_of=frozenset({after_cut})), _PrunableRegressor()
    guarded.load_state_dict(by_hand.state_dict())
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    x[after_cut * BATCH + 3, 2] = float("nan")
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(dim=1)), batch_size=BATCH)
    for model in (by_hand, guarded):
        pl.seed_everything(0)
        prune = ScheduledPrune(
            final_sparsity=0.5, mode="structured", start=4, end=4, every=4, probe_batches=0
        )
        callbacks = [prune]
        if model is guarded:
            guard = StabilityGuard(snapshot_every=100, loss_zscore=None, grad_norm_zscore=None)
            callbacks = [guard, prune] if prune_after_guard else [prune, guard]
        pl.Trainer(callbacks=callbacks, **trainer_kwargs(max_steps=8)).fit(model, loader)
        assert [event["step"] for event in prune.events] == [4]
    assert guard.bad_batches == 1 and guard.rollbacks == 0
    for (name, kept), (_, expected) in zip(guarded.named_buffers(), by_hand.named_buffers()):
        assert torch.equal(kept, expected), name
    for (name, kept), (_, expected) in zip(guarded.named_parameters(), by_hand.named_parameters()):
        assert torch.equal(kept, expected), name


class _QuantizedRegressor(_BatchNormRegressor):
    """An input fake quantizer (a moving-average min/max observer, as QAT's QuantStub has) before the
    BatchNorm regressor. ``blow_up``: the batch index whose inputs come x1000 too large, and how its loss
    turns out: ``"spike"`` (x1000, as an unnormalised batch does to a regression head) or ``"nonfinite"``
    (its overflow: ``inf``, with finite data)."""

    def __init__(self, skip_steps_of: frozenset[int] = frozenset(), blow_up: tuple[int, str] | None = None):
        super().__init__(skip_steps_of)
        self.quant = torch.ao.quantization.FakeQuantize()
        self.blow_up = blow_up

    def training_step(self, batch, batch_idx):
        if batch_idx in self.skip_steps_of:
            return None
        x, y = batch
        bad = self.blow_up is not None and batch_idx == self.blow_up[0]
        loss = nn.functional.mse_loss(self.net(self.quant(x * 1e3 if bad else x)).squeeze(-1), y)
        if bad:
            loss = loss * (1e3 if self.blow_up[1] == "spike" else float("inf"))
        return loss


@pytest.mark.filterwarnings("ignore:`training_step` returned `None`")
@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("blow_up", ["spike", "nonfinite"])
def test_a_skipped_loss_spike_leaves_observers_and_running_statistics_as_a_run_that_skipped_it_by_hand(
    accumulate, blow_up
):
    """Held-out sweep (QAT): a batch with inputs x1000 skipped as a loss spike kept what its forward wrote,
    unlike a data fault's: the input observer's range (a QAT input scale 0.084 instead of 0.0079 for the
    rest of the run, 12 levels for the [0, 1] input instead of 127) and BatchNorm's running statistics. Every
    dropped step now sets them back to their values before its first forward (the window's first
    micro-batch); the applied steps keep theirs, bit for bit."""
    bad_batch = 10
    window = {bad_batch // accumulate * accumulate + i for i in range(accumulate)}
    torch.manual_seed(0)
    by_hand = _QuantizedRegressor(skip_steps_of=frozenset(window))
    guarded = _QuantizedRegressor(blow_up=(bad_batch, blow_up))
    guarded.load_state_dict(by_hand.state_dict())
    x = torch.rand(128, 4, generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(dim=1)), batch_size=BATCH)
    guard = StabilityGuard(warmup=4, window=8, snapshot_every=4, rollback_margin=2)
    for model, callbacks in ((by_hand, []), (guarded, [guard])):
        pl.seed_everything(0)
        kwargs = trainer_kwargs(max_epochs=1, accumulate_grad_batches=accumulate)
        pl.Trainer(callbacks=callbacks, **kwargs).fit(model, loader)
    assert [(e["event"], e["action"]) for e in guard.events] == [
        ("loss_spike" if blow_up == "spike" else "nonfinite_loss", "skip")
    ]
    assert float(guarded.quant.scale) < 0.01  # [0, 1] inputs: 1/127; the kept x1000 batch left 0.041
    for (name, kept), (_, expected) in zip(guarded.named_buffers(), by_hand.named_buffers()):
        assert torch.equal(kept, expected), name
    for (name, kept), (_, expected) in zip(guarded.named_parameters(), by_hand.named_parameters()):
        assert torch.equal(kept, expected), name
