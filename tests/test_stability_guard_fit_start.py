"""StabilityGuard with what its fit-start snapshot or its rollback must account for: buffers shaped by the
first forward (eager QAT), weight-averaging callbacks, optimizers whose ``state_dict`` is not torch's layout
(a Lookahead wrapper), and ZeRO's sharded optimizer (refused)."""

from __future__ import annotations

import copy
from collections import OrderedDict

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, EMAWeightAveraging, StochasticWeightAveraging
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pulse import _lightning_compat as compat
from lightning_pulse.callbacks.stability_guard import StabilityGuard
from tests.conftest import trainer_kwargs
from tests.ddp_workers import TwoGlooProcesses
from tests.qat_models import EagerQATClassifier


def _data(rows: int = 240, nan_row: int | None = None) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 16, generator=generator)
    y = (x[:, :4].sum(1) > 0).long()
    if nan_row is not None:
        x[nan_row] = float("nan")
    return DataLoader(TensorDataset(x, y), batch_size=8)


class _MLP(pl.LightningModule):
    """A small classifier; ``nan_weight_at``: a NaN written into a weight when that step starts (a model-state
    fault, as an overflow would leave)."""

    def __init__(self, nan_weight_at: int | None = None, lookahead: bool = False) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2))
        self.nan_weight_at, self.lookahead = nan_weight_at, lookahead

    def forward(self, x):
        return self.net(x)

    def on_train_batch_start(self, batch, batch_idx):
        if self.global_step == self.nan_weight_at:
            with torch.no_grad():
                self.net[2].weight[0, 0] = float("nan")

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self):
        inner = torch.optim.Adam(self.parameters(), lr=3e-3)
        return _Lookahead(inner) if self.lookahead else inner


# ---------------------------------------------------------------- 1. buffers shaped by the first forward


def test_a_start_snapshot_that_the_first_forward_unfitted_is_retaken_so_a_nan_row_is_a_data_fault(tmp_path):
    torch.manual_seed(0)
    model = EagerQATClassifier()
    assert model.net[1].weight_fake_quant.activation_post_process.min_val.shape == (0,)
    guard = StabilityGuard(snapshot_every=100)
    trainer = pl.Trainer(max_steps=20, callbacks=[guard], default_root_dir=tmp_path, **trainer_kwargs())
    trainer.fit(model, _data(nan_row=8 * 12 + 3))  # a NaN row in step 12's batch, before the next snapshot
    # the step-0 snapshot no longer fitted after the first forward: retaken at the end of step 0
    assert guard.snapshots.steps == [1]
    assert guard.events == [{"step": 12, "event": "nonfinite_loss", "action": "skip", "cause": "data"}]
    assert guard.rollbacks == 0 and not guard.stopped


def test_a_start_snapshot_that_still_fits_is_not_retaken(tmp_path):
    torch.manual_seed(0)
    guard = StabilityGuard(snapshot_every=100)
    trainer = pl.Trainer(max_steps=5, callbacks=[guard], default_root_dir=tmp_path, **trainer_kwargs())
    trainer.fit(_MLP(), _data())
    assert guard.snapshots.steps == [0] and guard.snapshots_taken == 1


class _PlansAtTrainStart(Callback):
    """Rolls back with the model; makes its plan in ``on_train_start``, as ScheduledPrune does."""

    restore_on_rollback = True

    def __init__(self) -> None:
        self.plan: str | None = None

    def on_train_start(self, trainer, pl_module):
        self.plan = f"from step {trainer.global_step}"

    def state_dict(self):
        return {"plan": self.plan}

    def load_state_dict(self, state_dict):
        self.plan = state_dict["plan"]


@pytest.mark.parametrize("taken_at", ["train_start", "first_batch"])
def test_the_start_snapshot_holds_what_a_callback_listed_after_the_guard_planned_at_train_start(
    tmp_path, monkeypatch, taken_at
):
    # sweep: taken in the guard's own on_train_start, the snapshot predated the plans of the callbacks listed
    # after it; a rollback to it put their unplanned state back (ScheduledPrune then never pruned again)
    if taken_at == "first_batch":  # no hook after every train start: the first batch start takes it
        monkeypatch.setattr(compat, "after_train_start", lambda trainer, hook: lambda: None)
    guard, planner = StabilityGuard(snapshot_every=100, rollback_margin=2), _PlansAtTrainStart()
    callbacks = [guard, planner]
    trainer = pl.Trainer(max_steps=10, callbacks=callbacks, **trainer_kwargs(default_root_dir=tmp_path))
    trainer.fit(_MLP(nan_weight_at=6), _data())  # a NaN weight: rolled back at once, to the step-0 snapshot
    assert [(e["step"], e["to_step"]) for e in guard.events if e["event"] == "rollback"] == [(6, 0)]
    assert planner.plan == "from step 0"
    assert guard.snapshots_taken == 1 and guard.snapshots.steps == [0]


# ---------------------------------------------------------------- 2. weight-averaging callbacks


def _fit_with(callbacks, tmp_path, max_steps=40, **trainer_overrides) -> _MLP:
    pl.seed_everything(0)
    model = _MLP(nan_weight_at=25)
    kwargs = trainer_kwargs(default_root_dir=tmp_path, **trainer_overrides)
    pl.Trainer(max_steps=max_steps, callbacks=callbacks, **kwargs).fit(model, _data())
    return model


@pytest.mark.parametrize("ema_first", [True, False])
def test_an_ema_callback_in_either_order_rolls_back_with_the_model(tmp_path, ema_first):
    guard, ema = StabilityGuard(snapshot_every=10, rollback_margin=5), EMAWeightAveraging(decay=0.9)
    model = _fit_with([ema, guard] if ema_first else [guard, ema], tmp_path)
    assert guard.rollbacks == 1
    # the average is copied into the model at train end: the step-25 NaN weight must not be in it
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_an_ema_callback_ends_with_the_same_weights_listed_before_or_after_the_guard(tmp_path):
    weights = []
    for ema_first in (True, False):
        guard, ema = StabilityGuard(snapshot_every=10, rollback_margin=5), EMAWeightAveraging(decay=0.9)
        model = _fit_with([ema, guard] if ema_first else [guard, ema], tmp_path)
        weights.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    torch.testing.assert_close(weights[0], weights[1])


class _Buffered(pl.LightningModule):
    """A regressor whose forwards write buffers: BatchNorm's running statistics, a call counter and a running
    mean of the inputs. ``skip_by_hand``: the batch whose step it skips (returns ``None``, no forward);
    ``nan_weight_at``: a NaN written into a weight when that step starts (a rollback, then forced skips)."""

    def __init__(self, skip_by_hand: int | None = None, nan_weight_at: int | None = None) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 1))
        self.register_buffer("calls", torch.zeros(()))
        self.register_buffer("x_mean", torch.zeros(16))
        self.skip_by_hand, self.nan_weight_at = skip_by_hand, nan_weight_at

    def on_train_batch_start(self, batch, batch_idx):
        if self.global_step == self.nan_weight_at:
            with torch.no_grad():
                self.net[3].weight[0, 0] = float("nan")

    def training_step(self, batch, batch_idx):
        if batch_idx == self.skip_by_hand:
            return None
        self.calls += 1
        self.x_mean.mul_(0.9).add_(batch[0].mean(0), alpha=0.1)
        return F.mse_loss(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


def _spiking_data(spike: int | None) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(8 * 20, 16, generator=generator)
    y = x[:, :4].sum(1, keepdim=True)
    if spike is not None:  # the batch whose loss spikes (about 1e6 times the others')
        rows = slice(spike * 8, spike * 8 + 8)
        x[rows], y[rows] = x[rows] * 5 + 3, y[rows] * 1e3
    return DataLoader(TensorDataset(x, y), batch_size=8)


def _ema_fit(order: str, incident: str, tmp_path) -> tuple[dict, StabilityGuard]:
    torch.manual_seed(0)
    spike, nan_weight_at = (12, None) if incident == "spike" else (None, 12)
    model = _Buffered(skip_by_hand=spike if order == "by-hand" else None, nan_weight_at=nan_weight_at)
    ema = EMAWeightAveraging(decay=0.5, update_starting_at_step=0)
    guard = StabilityGuard(warmup=5, snapshot_every=4, rollback_margin=4, skip_after_rollback=3)
    callbacks = {"by-hand": [ema], "guard-first": [guard, ema], "ema-first": [ema, guard]}[order]
    kwargs = trainer_kwargs(default_root_dir=tmp_path, max_epochs=1, num_sanity_val_steps=0)
    pl.Trainer(callbacks=callbacks, **kwargs).fit(model, _spiking_data(spike))
    return {k: v.clone() for k, v in model.state_dict().items()}, guard  # the average, copied in at train end


@pytest.mark.filterwarnings("ignore:`training_step` returned `None`")
@pytest.mark.parametrize("incident", ["spike", "rollback"])
def test_an_ema_listed_before_the_guard_never_averages_a_skipped_steps_forward_writes(tmp_path, incident):
    """Regression sweep: a skipped step's forward writes (BatchNorm's running statistics, a call counter, a
    running mean) were set back only in the guard's batch end; an EMA listed before the guard had folded them
    into its average first (``calls`` 18.0078 against 18.0039 skipped by hand). They are now set back as soon
    as the skip is decided, so both orders end alike; after a rollback, the forced skips' writes too."""
    ema_first, guard = _ema_fit("ema-first", incident, tmp_path)
    guard_first, _ = _ema_fit("guard-first", incident, tmp_path)
    expected = ("loss_spike", "skip") if incident == "spike" else ("nonfinite_loss", "rollback")
    assert [(e["event"], e["action"]) for e in guard.events[:1]] == [expected]
    assert guard.steps_skipped == (1 if incident == "spike" else 1 + 3)  # the flagged step, 3 forced skips
    references = [guard_first]
    if incident == "spike":  # and as a run that skipped the batch by hand
        references.append(_ema_fit("by-hand", incident, tmp_path)[0])
    for reference in references:
        for name, value in reference.items():
            assert torch.equal(ema_first[name], value), name


class _RecordSWA(Callback):
    """After the guard's batch end: SWA's count of averaged weights at the end of each step, and right after
    the rollback."""

    def __init__(self) -> None:
        self.by_step: dict[int, int | None] = {}
        self.at_rollback: object = "no rollback"

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        guard = next(c for c in trainer.callbacks if isinstance(c, StabilityGuard))
        swa = next(c for c in trainer.callbacks if isinstance(c, StochasticWeightAveraging))
        count = None if swa.n_averaged is None else int(swa.n_averaged)
        if guard.rollbacks == 1 and self.at_rollback == "no rollback":
            self.at_rollback = count
        elif guard.rollbacks == 0:
            self.by_step[trainer.global_step] = count


def test_a_rollback_over_epoch_starts_takes_back_what_swa_averaged_since(tmp_path):
    # 30 batches an epoch; SWA folds the weights in as each epoch starts (steps 0, 30, 60); the NaN weight of
    # step 65 rolls back to the snapshot taken when SWA swapped in its scheduler (step 1): the averages of the
    # undone epochs must go with them, or SWA copies them into the model at train end
    guard = StabilityGuard(snapshot_every=0, rollback_margin=0)
    record, swa = _RecordSWA(), StochasticWeightAveraging(swa_lrs=1e-3, swa_epoch_start=1)
    pl.seed_everything(0)
    model = _MLP(nan_weight_at=65)
    trainer = pl.Trainer(
        max_epochs=3, callbacks=[swa, guard, record], **trainer_kwargs(default_root_dir=tmp_path)
    )
    trainer.fit(model, _data())
    to_step = guard.events[-1]["to_step"]
    assert guard.rollbacks == 1 and to_step < 30
    assert record.by_step[64] != record.by_step[to_step]  # SWA averaged since the snapshot
    assert record.at_rollback == record.by_step[to_step]
    assert all(torch.isfinite(p).all() for p in model.parameters())


# ---------------------------------------------------------------- 4. a wrapper optimizer's nested state


class _Lookahead(torch.optim.Optimizer):
    """Lookahead (Zhang et al. 2019) as commonly written: shares the inner optimizer's ``param_groups``; its
    ``state_dict`` nests the inner one's, ``{"inner", "slow", "step"}`` (Lightning checkpoints it as is)."""

    def __init__(self, optimizer: torch.optim.Optimizer, k: int = 5, alpha: float = 0.5) -> None:
        self.optimizer, self.k, self.alpha, self._step = optimizer, k, alpha, 0
        self.param_groups, self.defaults = optimizer.param_groups, optimizer.defaults
        self.state = {p: {"slow": p.detach().clone()} for g in self.param_groups for p in g["params"]}
        self._optimizer_step_pre_hooks, self._optimizer_step_post_hooks = OrderedDict(), OrderedDict()

    def _params(self):
        return [p for group in self.param_groups for p in group["params"]]

    def step(self, closure=None):
        loss = self.optimizer.step(closure)
        self._step += 1
        if self._step % self.k == 0:
            with torch.no_grad():
                for p in self._params():
                    slow = self.state[p]["slow"]
                    slow.add_(p - slow, alpha=self.alpha)
                    p.copy_(slow)
        return loss

    def zero_grad(self, set_to_none=True):
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        slow = [self.state[p]["slow"].clone() for p in self._params()]
        return {"inner": self.optimizer.state_dict(), "slow": slow, "step": self._step}

    def load_state_dict(self, state_dict):
        self.optimizer.load_state_dict(state_dict["inner"])
        self.param_groups = self.optimizer.param_groups
        for p, slow in zip(self._params(), state_dict["slow"]):
            self.state[p] = {"slow": slow.clone().to(p)}
        self._step = state_dict["step"]


class _KeepOptimizerState(Callback):
    """The optimizer's state at the end of step ``at`` (``before``) and right after the guard's rollback."""

    def __init__(self, at: int) -> None:
        self.at, self.before, self.after_rollback = at, None, None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        guard = next(c for c in trainer.callbacks if isinstance(c, StabilityGuard))
        if trainer.global_step == self.at and guard.rollbacks == 0:
            self.before = copy.deepcopy(trainer.optimizers[0].state_dict())
        if guard.rollbacks == 1 and self.after_rollback is None:
            self.after_rollback = copy.deepcopy(trainer.optimizers[0].state_dict())


def test_a_rollback_restores_a_wrapper_optimizers_nested_state_exactly(tmp_path):
    guard = StabilityGuard(snapshot_every=10, rollback_margin=5)
    kept = _KeepOptimizerState(at=20)
    pl.seed_everything(0)
    model = _MLP(nan_weight_at=28, lookahead=True)
    trainer = pl.Trainer(max_steps=35, callbacks=[guard, kept], **trainer_kwargs(default_root_dir=tmp_path))
    trainer.fit(model, _data())
    assert guard.rollbacks == 1 and guard.events[-1]["to_step"] == 20
    before, after = kept.before, kept.after_rollback
    assert after["step"] == before["step"] == 20
    for slow_before, slow_after in zip(before["slow"], after["slow"]):
        assert torch.equal(slow_before, slow_after)
    for index, entry in before["inner"]["state"].items():
        for key, value in entry.items():
            assert torch.equal(after["inner"]["state"][index][key], value)
    assert all(torch.isfinite(p).all() for p in model.parameters())


# ---------------------------------------------------------------- 3. ZeRO's sharded optimizer


class _ZeroMLP(_MLP):
    def configure_optimizers(self):
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(self.parameters(), optimizer_class=torch.optim.Adam, lr=3e-3)


@pytest.mark.ddp
def test_zero_redundancy_optimizer_under_ddp_is_refused_before_the_first_step(tmp_path):
    trainer = pl.Trainer(
        max_steps=5,
        callbacks=[StabilityGuard()],
        **trainer_kwargs(
            devices=2, strategy=TwoGlooProcesses(), default_root_dir=tmp_path, limit_val_batches=0
        ),
    )
    with pytest.raises(Exception, match="StabilityGuard does not support torch's ZeroRedundancyOptimizer"):
        trainer.fit(_ZeroMLP(), _data())


def test_a_rollback_to_before_swa_began_averaging_lets_swa_go_on(tmp_path):
    """Review: a rollback to a snapshot taken before SWA's first average set its ``n_averaged`` back to
    ``None`` while SWA had begun; its next epoch start asserts it is not ``None`` (the run crashed)."""
    from lightning_pulse.core.stability_policy import StabilityGuardConfig

    guard = StabilityGuard(
        snapshot_every=10,
        rollback_margin=0,
        skip_after_rollback=2,
        config=StabilityGuardConfig(rewind_lr_schedule=False),
    )
    swa = StochasticWeightAveraging(swa_lrs=1e-3, swa_epoch_start=2)  # begins at step 30
    pl.seed_everything(0)
    model = _MLP(nan_weight_at=30)
    trainer = pl.Trainer(max_epochs=4, callbacks=[swa, guard], **trainer_kwargs(default_root_dir=tmp_path))
    trainer.fit(model, _data())
    assert guard.rollbacks == 1 and swa.n_averaged is not None and int(swa.n_averaged) >= 1
    assert all(torch.isfinite(p).all() for p in model.parameters())
