"""A user's callbacks around a StabilityGuard rollback, through real Trainers: phase listeners told the phase
again, opted-in states that cannot be copied refused at fit start, a rollback load that fails named."""

from __future__ import annotations

import threading

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.stability_guard import FaultInjector
from lightning_pulse import EnergyLogger, MeterConfig, PulseCycle, SimulatedClock, StabilityGuard
from lightning_pulse.callbacks import stability_guard as guard_module
from lightning_pulse.errors import PulseRefusal
from lightning_pulse.protocols import PhaseListener, RollbackAware, listeners
from tests.conftest import trainer_kwargs

LR = {"burst": 0.05, "replay": 0.01, "maintain": 0.001}


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))

    def training_step(self, batch, batch_idx):
        return torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def _data(samples: int = 512) -> DataLoader:
    torch.manual_seed(0)
    x = torch.randn(samples, 16)
    return DataLoader(TensorDataset(x, (x @ torch.randn(16, 4)).argmax(1)), batch_size=32)


class LRPerPhase(Callback):
    """A user's callback, not restored with the model: one learning rate per phase, set at each change."""

    def __init__(self) -> None:
        self.told: list[tuple[int, str, str]] = []
        self.lr_used: dict[int, float] = {}

    def on_pulse_phase_change(self, trainer, pl_module, change):
        self.told.append((change.step, change.current.value, change.reason))
        for group in trainer.optimizers[0].param_groups:
            group["lr"] = LR[change.current.value]

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.lr_used[trainer.global_step] = optimizer.param_groups[0]["lr"]


def _cycle() -> PulseCycle:
    return PulseCycle(burst=20, replay=10, maintain=10, warmup=0.0, anneal=0.0, maintain_eval="none")


def test_a_phase_listener_not_restored_with_the_model_sets_its_rate_again_after_a_rollback(tmp_path):
    # sweep-usercb, finding 1: the snapshot (maintain entry, step 30) holds the maintain rate; the rollback in
    # the next burst (flags at steps 45-47) rewinds the rate to it, and only restored listeners were told the
    # phase again: every applied burst step after it trained at 0.001 instead of 0.05
    torch.manual_seed(0)
    listener, functions_told = LRPerPhase(), []
    cycle = _cycle()
    cycle.add_listener(lambda trainer, pl_module, change: functions_told.append((change.step, change.reason)))
    guard = StabilityGuard(snapshot_every=0, warmup=5, window=20, skip_after_rollback=2)
    callbacks = [cycle, listener, FaultInjector("nan_output", 45, 3), guard]
    trainer = pl.Trainer(max_steps=60, callbacks=callbacks, **trainer_kwargs(default_root_dir=str(tmp_path)))
    trainer.fit(Net(), _data())
    assert guard.rollbacks == 1
    resumed = [told for told in listener.told if told[2] == "resume"]
    assert resumed == [(48, "burst", "resume")]  # once, at the rollback, in the phase it was already in
    assert (48, "resume") in functions_told  # a function given to add_listener too
    after = {step: lr for step, lr in listener.lr_used.items() if 50 <= step < 60}  # applied burst steps
    assert len(after) == 10
    assert set(after.values()) == {LR["burst"]}


def _tell_restored_only(trainer, pl_module, cycle, exclude):
    """The guard's telling before the fix: only the callbacks restored with the model."""
    change = cycle.clock.resume_change()
    for callback in listeners(trainer, RollbackAware, exclude=exclude):
        if isinstance(callback, PhaseListener):
            callback.on_pulse_phase_change(trainer, pl_module, change)


class StepTakesTime(Callback):
    """A minute of simulated time in each step, read by the meters inside it: energy figures are exact."""

    def __init__(self, clock: SimulatedClock, energy: EnergyLogger) -> None:
        self.clock, self.energy = clock, energy

    def on_before_backward(self, trainer, pl_module, loss):
        self.clock.advance(60.0)
        self.energy.account.kwh_now()


def _energy_figures(tmp_path, guard_first: bool) -> tuple[dict, list]:
    torch.manual_seed(0)
    clock = SimulatedClock("2020-06-15 12:00:00")
    energy = EnergyLogger(
        gpu="none", cpu="constant", ram="none", meters=MeterConfig(sampling_period=0.05, cpu_watts=100.0)
    )
    energy.account.clock = energy.account.wall_clock = clock
    guard = StabilityGuard(snapshot_every=0, warmup=5, window=20, skip_after_rollback=2)
    pair = [guard, energy] if guard_first else [energy, guard]
    listener = LRPerPhase()
    callbacks = [StepTakesTime(clock, energy), FaultInjector("nan_output", 45, 3), _cycle(), *pair, listener]
    trainer = pl.Trainer(max_steps=60, callbacks=callbacks, **trainer_kwargs(default_root_dir=str(tmp_path)))
    trainer.fit(Net(), _data(640))  # 20 batches an epoch: no epoch starts right after the rollback
    assert guard.rollbacks == 1
    report = energy.report
    figures = {key: report[key] for key in ("total", "phases", "cycles", "stages", "epochs")}
    return figures, listener.told


@pytest.mark.parametrize(
    "guard_first", [True, False]
)  # the rollback before or after EnergyLogger's batch end
def test_a_phase_told_again_after_a_rollback_books_nothing_in_energy_logger(
    tmp_path, monkeypatch, guard_first
):
    # told the phase it was already in, EnergyLogger dropped the data wait after the rollback's batch (a
    # minute of the training loop's seconds here) and re-marked its label: its figures must be those of the
    # same fit in which it is not told again
    told_again, told = _energy_figures(tmp_path / "fixed", guard_first)
    assert (48, "burst", "resume") in told
    monkeypatch.setattr(guard_module, "tell_restored_phase", _tell_restored_only)
    not_told, _ = _energy_figures(tmp_path / "before", guard_first)
    assert told_again == not_told


class CounterWithALock(Callback):
    restore_on_rollback = True

    def __init__(self) -> None:
        self.n, self.lock = 0, threading.Lock()

    def on_train_batch_end(self, *args):
        self.n += 1

    def state_dict(self):
        return {"n": self.n, "lock": self.lock}

    def load_state_dict(self, state_dict):
        self.n = state_dict["n"]


def test_an_opted_in_state_that_cannot_be_copied_is_refused_at_fit_start_naming_the_callback(tmp_path):
    # sweep-usercb, finding 4: the fit-start snapshot failed with a bare "cannot pickle '_thread.lock' object"
    trainer = pl.Trainer(
        max_steps=10,
        callbacks=[CounterWithALock(), StabilityGuard()],
        **trainer_kwargs(default_root_dir=str(tmp_path)),
    )
    with pytest.raises(PulseRefusal) as refused:
        trainer.fit(Net(), _data())
    message = str(refused.value)
    assert message.startswith("StabilityGuard: CounterWithALock sets `restore_on_rollback = True`")
    assert "state_dict()['lock'] is a _thread.lock" in message
    assert "cannot pickle '_thread.lock' object" in message
    assert "`rollback_state_dict()`" in message and "`restore_on_rollback = False`" in message
    assert trainer.global_step == 0


class LoadFails(Callback):
    restore_on_rollback = True

    def state_dict(self):
        return {"n": 1}

    def load_state_dict(self, state_dict):
        raise KeyError("not_saved")


def test_a_load_that_fails_in_a_rollback_keeps_its_error_and_names_the_callback(tmp_path):
    guard = StabilityGuard(snapshot_every=0, warmup=5, window=20)
    callbacks = [LoadFails(), FaultInjector("nan_output", 12, 3), guard]
    trainer = pl.Trainer(max_steps=30, callbacks=callbacks, **trainer_kwargs(default_root_dir=str(tmp_path)))
    with pytest.raises(KeyError) as failed:
        trainer.fit(Net(), _data())
    note = " ".join(getattr(failed.value, "__notes__", []))
    assert "LoadFails.load_state_dict while a StabilityGuard rollback restored its state" in note
    assert "`restore_on_rollback = False`" in note
