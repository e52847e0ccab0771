"""What a StabilityGuard skip or rollback does to what the module logs and to its torchmetrics metrics (sweep
s41, metrics findings 2 and 3): a skipped step's logged values leave Lightning's epoch figures, and a rollback
leaves the module's metric states alone. A step-interval ``ReduceLROnPlateau`` never reads a skipped step's
value, and a rollback leaves it at the snapshot's state (sweep s42 "optim", problem 2), the run's at the
snapshot's step (pass 43)."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, EarlyStopping
from torch import nn
from torch.optim.lr_scheduler import ReduceLROnPlateau
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from lightning_pulse import StabilityGuard
from tests.conftest import trainer_kwargs

SAMPLES, BATCH = 320, 32  # 10 batches an epoch


def _data(nan_rows=()) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(SAMPLES, 16, generator=generator), torch.randint(0, 4, (SAMPLES,), generator=generator)
    x[list(nan_rows)] = float("nan")  # bad samples: their steps are skipped as the data's fault
    return TensorDataset(x, y)


class _Logging(pl.LightningModule):
    """Logs its loss as a mean (step and epoch), a max and a sum of rows; keeps each micro-batch's loss and
    size. ``only_nan``: logs a key only when the loss is not finite. ``damage_at``: a NaN put into a weight
    at that step (the guard rolls back at once). ``metric``: a ``MeanMetric`` that keeps NaN, logged as an
    object."""

    def __init__(self, only_nan: bool = False, damage_at: int | None = None, metric: bool = False) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
        self.only_nan, self.damage_at = only_nan, damage_at
        self.accuracy = MulticlassAccuracy(num_classes=4, average="micro")
        self.mean_loss = MeanMetric(nan_strategy="disable") if metric else None
        self.rows: list[tuple[int, int, int, float, int]] = []  # epoch, step, batch_idx, loss, batch size

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.global_step == self.damage_at:
            self.damage_at = None
            with torch.no_grad():
                self.net[0].weight[0, 0] = float("nan")
        logits = self.net(x)
        loss = F.cross_entropy(logits, y)
        self.rows.append((self.current_epoch, self.global_step, batch_idx, float(loss.detach()), len(x)))
        self.accuracy.update(logits, y)
        self.log("train_acc", self.accuracy, on_step=False, on_epoch=True)  # Lightning resets it at epoch end
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        self.log("max_loss", loss, on_step=False, on_epoch=True, reduce_fx="max")
        self.log("rows", float(len(x)), on_step=False, on_epoch=True, reduce_fx="sum")
        if self.only_nan and not torch.isfinite(loss):
            self.log("nan_loss", loss, on_step=False, on_epoch=True)
        if self.mean_loss is not None:
            self.mean_loss.update(loss.detach())
            self.log("mean_loss", self.mean_loss, on_step=False, on_epoch=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class _Epochs(Callback):
    """Listed after the guard: the optimizer steps it dropped (by the counter before them), each epoch's
    figures as the monitors read them, and the samples the accuracy metric counted in it."""

    def __init__(self, guard: StabilityGuard) -> None:
        self.guard, self.dropped, self.figures, self.counted = guard, set(), {}, {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.guard.undoes_step(trainer.global_step):  # only true at a window's end
            self.dropped.add(trainer.global_step - 1)

    def on_train_epoch_end(self, trainer, pl_module):
        self.figures[trainer.current_epoch] = {k: float(v) for k, v in trainer.callback_metrics.items()}
        accuracy = pl_module.accuracy
        self.counted[trainer.current_epoch] = int((accuracy.tp + accuracy.fn).sum())


def _fit(tmp_path, module, data, guard, *callbacks, epochs=2, **kwargs):
    pl.seed_everything(0)
    epochs_seen = _Epochs(guard)
    trainer = pl.Trainer(
        callbacks=[guard, epochs_seen, *callbacks],
        max_epochs=epochs,
        default_root_dir=tmp_path,
        **trainer_kwargs(**kwargs),
    )
    trainer.fit(module, DataLoader(data, batch_size=BATCH))
    return trainer, epochs_seen


def _applied(module: _Logging, epochs: _Epochs, epoch: int) -> list[tuple[float, int]]:
    """Each applied micro-batch's loss and size in ``epoch``."""
    return [
        (loss, size) for e, step, _, loss, size in module.rows if e == epoch and step not in epochs.dropped
    ]


def test_a_skipped_nan_step_leaves_the_epoch_loss_finite_and_early_stopping_trains_every_epoch(tmp_path):
    """The guard's headline case, three NaN samples: their steps were skipped, but the NaN loss they logged
    stayed in Lightning's epoch mean, so ``train_loss_epoch`` was NaN every epoch and
    ``EarlyStopping(monitor="train_loss_epoch")`` silently ended a 4-epoch run after its first epoch."""
    module, guard = _Logging(), StabilityGuard()
    stopping = EarlyStopping(monitor="train_loss_epoch", patience=3)
    trainer, epochs = _fit(tmp_path, module, _data([5, 100, 250]), guard, stopping, epochs=4)
    assert guard.steps_skipped == 12 and trainer.current_epoch == 4
    for epoch, figures in epochs.figures.items():
        applied = _applied(module, epochs, epoch)
        assert len(applied) == 7
        mean = sum(loss * size for loss, size in applied) / sum(size for _, size in applied)
        assert figures["train_loss_epoch"] == pytest.approx(mean, rel=1e-5)
        assert figures["max_loss"] == pytest.approx(max(loss for loss, _ in applied), rel=1e-6)
        assert figures["rows"] == sum(size for _, size in applied)


def test_every_micro_batch_of_a_skipped_accumulation_window_leaves_the_epoch_figures(tmp_path):
    """Gradient accumulation: all micro-batches of a skipped optimizer step are taken out, the fit's first
    window included (every key is created by that skipped step)."""
    module, guard = _Logging(), StabilityGuard()
    trainer, epochs = _fit(tmp_path, module, _data([0, 150]), guard, accumulate_grad_batches=2)
    assert guard.steps_skipped == 4 and trainer.global_step == 10
    for epoch, figures in epochs.figures.items():
        applied = _applied(module, epochs, epoch)
        assert len(applied) == 6  # windows (0, 1) and (4, 5) skipped
        mean = sum(loss * size for loss, size in applied) / sum(size for _, size in applied)
        assert figures["train_loss_epoch"] == pytest.approx(mean, rel=1e-5)
        assert figures["max_loss"] == pytest.approx(max(loss for loss, _ in applied), rel=1e-6)
        assert figures["rows"] == sum(size for _, size in applied)


def test_a_key_only_skipped_steps_logged_has_no_epoch_figure_and_is_said_once(tmp_path):
    """Where every step that logged a key in an epoch was skipped, the key has no figure for it (not the NaN
    of ``0 / 0``), and the guard says so once, naming the key and its monitor."""
    module, guard = _Logging(only_nan=True), StabilityGuard()
    stopping = EarlyStopping(monitor="train_loss_epoch", patience=3)
    with pytest.warns(UserWarning, match="every step that logged `nan_loss`") as said:
        _, epochs = _fit(tmp_path, module, _data([5]), guard, stopping)
    assert sum("nan_loss" in str(w.message) for w in said) == 1
    assert all("nan_loss" not in figures for figures in epochs.figures.values())


def test_a_monitored_metric_object_holding_a_nan_after_a_skipped_step_is_said(tmp_path):
    """A torchmetrics object is the module's: the guard leaves its states as the step's update left them.
    A monitored one that keeps NaN (``nan_strategy="disable"``) is said, naming it and its monitor, instead of
    letting EarlyStopping end the run without a word."""
    module, guard = _Logging(metric=True), StabilityGuard()
    with pytest.warns(
        UserWarning, match=r"logged as `mean_loss` hold a NaN.*Read by EarlyStopping\(monitor='mean_loss'\)"
    ):
        _fit(tmp_path, module, _data([5]), guard, EarlyStopping(monitor="mean_loss", patience=3))


def test_a_rollback_to_an_earlier_epochs_snapshot_leaves_this_epochs_metric_states_alone(tmp_path):
    """A rollback returned the module's torchmetrics states with the snapshot: one taken at the end of epoch
    0 brought epoch 0's counts, already logged and reset, back into epoch 1 (twice the samples an epoch
    has). Metrics record what ran, as the logged values of the steps a rollback undid; the flagged step and
    the skips after the rollback leave the epoch's logged figures."""
    module = _Logging(damage_at=13)  # epoch 1's fourth step; the snapshot of step 10 ends epoch 0
    guard = StabilityGuard(snapshot_every=5, rollback_margin=2, skip_after_rollback=3)
    trainer, epochs = _fit(tmp_path, module, _data(), guard)
    assert guard.rollbacks == 1 and guard.events[-1]["to_step"] == 10
    assert epochs.dropped == {13, 14, 15, 16}
    assert epochs.counted == {0: SAMPLES, 1: SAMPLES}  # every training_step's update, this epoch's only
    applied = _applied(module, epochs, 1)
    mean = sum(loss * size for loss, size in applied) / sum(size for _, size in applied)
    assert epochs.figures[1]["train_loss_epoch"] == pytest.approx(mean, rel=1e-5)


class _Plateau(_Logging):
    """Cuts its rate by a ``ReduceLROnPlateau`` on the step's logged loss, stepped every optimizer step (or
    at each epoch's end: ``interval``)."""

    def __init__(self, interval: str = "step", lookahead: bool = False, **kwargs) -> None:
        super().__init__(**kwargs)
        self.interval, self.lookahead = interval, lookahead

    def configure_optimizers(self):
        optimizer = super().configure_optimizers()
        if self.lookahead:  # a wrapper whose state_dict nests its inner optimizer's groups
            from tests.test_stability_guard_fit_start import _Lookahead

            optimizer = _Lookahead(optimizer)
        if self.interval == "step+epoch":  # one plateau per step, one per epoch (on the epoch's mean)
            configs = [
                {"scheduler": ReduceLROnPlateau(optimizer, patience=1, factor=0.5), "interval": interval}
                | {"monitor": f"train_loss_{interval}"}
                for interval in ("step", "epoch")
            ]
            return [optimizer], configs
        plateau = ReduceLROnPlateau(optimizer, patience=2, factor=0.5)
        config = {"scheduler": plateau, "interval": self.interval, "monitor": "train_loss_step"}
        return {"optimizer": optimizer, "lr_scheduler": config}


PLATEAU_FIELDS = ("last_epoch", "num_bad_epochs", "best", "cooldown_counter", "_last_lr")


def _plateau_state(trainer) -> dict:
    """The plateau scheduler's counters and the rate it set."""
    state = trainer.lr_scheduler_configs[0].scheduler.state_dict()
    return {key: state[key] for key in PLATEAU_FIELDS} | {"lr": trainer.optimizers[0].param_groups[0]["lr"]}


class _AfterRollback(Callback):
    """Listed after the guard: the plateau scheduler's state at the first five batch starts after the
    rollback, and its state in the snapshot the rollback returned to."""

    def __init__(self, guard: StabilityGuard) -> None:
        self.guard, self.saved, self.seen = guard, None, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.guard.rollbacks and self.saved is None:
            to_step = self.guard.events[-1]["to_step"]
            snapshot = next(s for s in self.guard.snapshots._snapshots if s.step == to_step)
            saved, lr = snapshot.schedulers[0], snapshot.optimizers[0]["param_groups"][0]["lr"]
            self.saved = {key: saved[key] for key in PLATEAU_FIELDS} | {"lr": lr}
        if self.saved is not None and len(self.seen) < 5:
            self.seen.append(_plateau_state(trainer))


def test_a_skipped_steps_logged_loss_is_no_bad_step_to_a_step_interval_plateau_scheduler(tmp_path):
    """Lightning steps a step-interval plateau scheduler after the batch end, on the step's logged value: a
    skipped step's NaN counted as a bad step (``num_bad_epochs``), and three in a patience of 2 cut the rate.
    Now the scheduler sees the applied steps' losses only, as one stepped by hand on them."""
    module, guard = _Plateau(), StabilityGuard()
    trainer, epochs = _fit(tmp_path, module, _data([5, 100, 250]), guard)
    applied = [loss for _, step, _, loss, _ in module.rows if step not in epochs.dropped]
    assert guard.steps_skipped == 6 and len(applied) == 14
    reference = ReduceLROnPlateau(
        torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.05), patience=2, factor=0.5
    )
    for loss in applied:
        reference.step(loss)
    expected = {
        key: reference.state_dict()[key] for key in ("last_epoch", "num_bad_epochs", "best", "_last_lr")
    }
    state = _plateau_state(trainer)
    assert {key: state[key] for key in expected} == expected and state["lr"] == reference._last_lr[0]


def test_a_rollback_leaves_a_step_interval_plateau_scheduler_at_its_snapshots_state(tmp_path):
    """The guard restores the schedulers in its batch end, and Lightning then stepped the plateau scheduler
    on the flagged step's NaN: one step past the snapshot's state, and one more for each skip after the
    rollback. Now it stays at the snapshot's state until the first applied step after the rollback."""
    module = _Plateau(damage_at=13)
    guard = StabilityGuard(snapshot_every=5, rollback_margin=2, skip_after_rollback=3)
    after = _AfterRollback(guard)
    _, epochs = _fit(tmp_path, module, _data(), guard, after)
    assert guard.rollbacks == 1 and guard.events[-1]["to_step"] == 10
    assert epochs.dropped == {13, 14, 15, 16}
    assert len(after.seen) == 5 and after.seen[:4] == [after.saved] * 4  # the batch starts of steps 14 to 17
    assert after.seen[4]["last_epoch"] == after.saved["last_epoch"] + 1  # step 18's: step 17 applied, counted


class _StatesAtBatchStart(Callback):
    """Listed after the guard: the plateau scheduler's state at every batch start, by ``global_step`` (the
    first seen for a step: the run's before any rollback)."""

    def __init__(self) -> None:
        self.states: dict[int, dict] = {}
        self.seen: list[tuple[int, dict]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        state = _plateau_state(trainer)
        self.states.setdefault(trainer.global_step, state)
        self.seen.append((trainer.global_step, state))


@pytest.mark.parametrize(
    ("interval", "snapshot_every", "damage_at", "to_step"),
    [("step", 6, 9, 6), ("step", 5, 13, 10), ("epoch", 5, 13, 10)],
)
def test_a_rollback_returns_a_plateau_scheduler_to_the_runs_state_at_the_snapshots_step(
    tmp_path, interval, snapshot_every, damage_at, to_step
):
    """A snapshot taken in a batch end came before Lightning's update of the plateau schedulers of that
    batch (per step: after every batch-end hook; per epoch: after the epoch's end), so a rollback left them
    one reading behind the run at the snapshot's step: ``last_epoch`` 5 for 6, ``num_bad_epochs`` 2 for 0 and
    the rate 0.05 where the run had cut it to 0.025 (a review, pass 43). Now the snapshot takes in that
    reading and the rate it set."""
    pl.seed_everything(0)  # the module's weights too: the readings, hence the rate's cuts, are fixed
    module = _Plateau(interval, damage_at=damage_at)
    guard = StabilityGuard(snapshot_every=snapshot_every, rollback_margin=2, skip_after_rollback=3)
    states = _StatesAtBatchStart()
    _fit(tmp_path, module, _data(), guard, states)
    assert guard.rollbacks == 1 and guard.events[-1]["to_step"] == to_step
    after = [state for step, state in states.seen if step > damage_at][0]  # the first batch start after it
    assert after == states.states[to_step]
    if to_step == 6:  # Lightning's update after the snapshot's batch cut the rate
        assert after["lr"] == 0.025 and states.states[5]["lr"] == 0.05


def test_a_rollback_returns_a_lookahead_wrapped_optimizer_to_the_rate_its_plateau_set(tmp_path):
    """A review: the snapshot took in the plateau's update of its batch, but wrote the rate it set only into a
    saved optimizer state with top-level ``param_groups``; Lookahead nests its inner optimizer's (``"inner"``),
    so after the rollback the scheduler said ``_last_lr`` 0.025 and ``num_bad_epochs`` 0 while the optimizer
    ran on 0.05 (the cut lost, and not made again for ``patience + 1`` readings)."""
    pl.seed_everything(0)
    module = _Plateau("step", lookahead=True, damage_at=9)
    guard = StabilityGuard(snapshot_every=6, rollback_margin=2, skip_after_rollback=3)
    states = _StatesAtBatchStart()
    _fit(tmp_path, module, _data(), guard, states)
    assert guard.rollbacks == 1 and guard.events[-1]["to_step"] == 6
    after = [state for step, state in states.seen if step > 9][0]
    assert states.states[5]["lr"] == 0.05 and states.states[6]["lr"] == 0.025  # cut after step 6's batch
    assert after == states.states[6]


class _BothPlateaus(Callback):
    """Listed after the guard: both plateau schedulers' states and the rate at every batch start."""

    def __init__(self) -> None:
        self.states: dict[int, list] = {}
        self.seen: list[tuple[int, list]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        configs = trainer.lr_scheduler_configs
        state = [{k: c.scheduler.state_dict()[k] for k in PLATEAU_FIELDS} for c in configs]
        state.append(trainer.optimizers[0].param_groups[0]["lr"])
        self.states.setdefault(trainer.global_step, state)
        self.seen.append((trainer.global_step, state))


@pytest.mark.parametrize(("snapshot_every", "to_step"), [(10, 10), (5, 10), (7, 7)])
def test_a_rollback_returns_a_step_and_an_epoch_plateau_to_the_runs_state_at_the_snapshots_step(
    tmp_path, snapshot_every, to_step
):
    """A step-interval and an epoch-interval plateau on one optimizer; a snapshot at an epoch's last batch
    (step 10: Lightning updates the step one after the batch end, the epoch one after the epoch's end) or
    inside an epoch (7). The wrapper that takes in their readings is gone at the fit's end."""
    pl.seed_everything(0)
    module = _Plateau("step+epoch", damage_at=13)
    guard = StabilityGuard(snapshot_every=snapshot_every, rollback_margin=2, skip_after_rollback=3)
    states = _BothPlateaus()
    trainer, _ = _fit(tmp_path, module, _data(), guard, states, epochs=3)
    assert guard.rollbacks == 1 and guard.events[-1]["to_step"] == to_step
    after = [state for step, state in states.seen if step > 13][0]
    assert after == states.states[to_step]
    assert "update_lr_schedulers" not in vars(trainer.fit_loop.epoch_loop)


class _Raise(Callback):
    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == 15:
            raise RuntimeError("a later batch-end hook failed")


@pytest.mark.parametrize("ends", ["max_steps", "exception"])
def test_a_fit_ending_before_the_plateau_updates_leaves_no_wrapper_installed(tmp_path, ends):
    """A review: the wrapper that takes in a snapshot's plateau readings removed itself only at a later update
    call, so a fit ending mid-epoch at ``max_steps`` on a snapshot step with an epoch plateau, or raising in a
    later batch-end hook, left it on the epoch loop (holding the snapshot) to fire in a later fit. The
    guard now removes it at its teardown and on an exception."""
    module = _Plateau("step+epoch")
    guard = StabilityGuard(snapshot_every=5, rollback_margin=2)
    trainer = pl.Trainer(
        callbacks=[guard] + ([_Raise()] if ends == "exception" else []),
        max_epochs=3,
        max_steps=15 if ends == "max_steps" else -1,
        default_root_dir=tmp_path,
        **trainer_kwargs(),
    )
    if ends == "exception":
        with pytest.raises(RuntimeError, match="later batch-end hook"):
            trainer.fit(module, DataLoader(_data(), batch_size=BATCH))
    else:
        trainer.fit(module, DataLoader(_data(), batch_size=BATCH))
    assert trainer.global_step == 15
    assert "update_lr_schedulers" not in vars(trainer.fit_loop.epoch_loop)


@pytest.mark.parametrize("interval", ["epoch", "step"])
def test_a_step_value_read_at_the_end_of_an_epoch_whose_last_step_was_skipped_is_said_once(
    tmp_path, interval
):
    """Read at the epoch's end (Lightning's default interval for a scheduler), ``train_loss_step`` is the
    epoch's last step's value: where the guard skipped that step, its NaN, which the plateau scheduler counts
    as a bad epoch. Nothing can take it out of what the scheduler reads: it is said, naming the monitor and the
    way out. A scheduler stepped per step never reads it, and nothing is said."""
    module, guard = _Plateau(interval), StabilityGuard()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        trainer, _ = _fit(tmp_path, module, _data([5, 300]), guard)  # batch 9: each epoch's last
    assert guard.steps_skipped == 4
    last = [str(w.message) for w in said if "the last step of training epoch" in str(w.message)]
    plateau = trainer.lr_scheduler_configs[0].scheduler
    if interval == "step":
        assert last == [] and plateau.last_epoch == 16
        return
    assert len(last) == 1 and "training epoch 0" in last[0] and "monitor='train_loss_step'" in last[0]
    assert "`<name>_epoch`" in last[0]
    assert plateau.last_epoch == 2 and plateau.num_bad_epochs == 2  # what it says: NaN, a bad epoch, twice


def test_a_step_plateau_on_a_validation_metric_still_reads_a_validation_that_a_skipped_batch_ran(tmp_path):
    # a review: every step-interval plateau scheduler was passed over at a dropped batch, so one monitoring
    # val_loss (frequency = val_check_interval, Lightning's recipe) lost the validations those batches ran
    import torch.nn.functional as F
    from torch.optim.lr_scheduler import ReduceLROnPlateau
    from torch.utils.data import DataLoader, TensorDataset

    readings: list[float] = []

    class Recording(ReduceLROnPlateau):
        def step(self, metrics, *args, **kwargs):
            readings.append(float(metrics))
            return super().step(metrics, *args, **kwargs)

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))

        def training_step(self, batch, batch_idx):
            loss = F.cross_entropy(self.net(batch[0]), batch[1])
            self.log("train_loss", loss)
            return loss

        def validation_step(self, batch, batch_idx):
            self.log("val_loss", F.cross_entropy(self.net(batch[0]), batch[1]))

        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
            plateau = Recording(optimizer, patience=1, factor=0.5)
            config = {"scheduler": plateau, "interval": "step", "frequency": 5, "monitor": "val_loss"}
            return {"optimizer": optimizer, "lr_scheduler": config}

    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(160, 8, generator=generator), torch.randint(0, 3, (160,), generator=generator)
    x[[32, 72]] = float("nan")  # batches 4 and 9 of 8 rows: the ones that end with a validation
    val = TensorDataset(
        torch.randn(64, 8, generator=generator), torch.randint(0, 3, (64,), generator=generator)
    )
    pl.seed_everything(0)
    guard = StabilityGuard()
    kwargs = {"max_epochs": 1, "default_root_dir": tmp_path, "logger": False, "enable_checkpointing": False}
    kwargs.update(enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer = pl.Trainer(val_check_interval=5, callbacks=[guard], **kwargs)
    trainer.fit(Module(), DataLoader(TensorDataset(x, y), batch_size=8), DataLoader(val, batch_size=32))
    assert guard.steps_skipped == 2
    assert len(readings) == 4  # every validation reached the scheduler (2 of 4 before)
