"""PulseCycle's maintain probe with a schedule-free optimizer: evaluated at its evaluation weights."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pulse import PulseCycle
from lightning_pulse.core.optimizer_modes import evaluation_point
from tests.conftest import trainer_kwargs


class ScheduleFreeSGD(torch.optim.Optimizer):
    """Schedule-free SGD, its modes as in ``schedulefree``: it trains at ``y`` (between ``z`` and the average
    ``x``), and ``eval()`` moves the parameters to ``x``, ``train()`` back to ``y``."""

    def __init__(self, params, lr: float = 1.0, beta: float = 0.9) -> None:
        super().__init__(params, dict(lr=lr, beta=beta, train_mode=True))

    def _state(self, p):
        state = self.state[p]
        if not state:
            state.update(z=p.detach().clone(), x=p.detach().clone(), k=0)
        return state

    @torch.no_grad()
    def eval(self):
        for group in self.param_groups:
            if group["train_mode"]:
                for p in group["params"]:
                    p.copy_(self._state(p)["x"])
                group["train_mode"] = False

    @torch.no_grad()
    def train(self):
        for group in self.param_groups:
            if not group["train_mode"]:
                for p in group["params"]:
                    state = self._state(p)
                    p.copy_((1 - group["beta"]) * state["z"] + group["beta"] * state["x"])
                group["train_mode"] = True

    @torch.no_grad()
    def step(self, closure=None):
        with torch.enable_grad():
            loss = closure() if closure is not None else None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    state = self._state(p)
                    state["k"] += 1
                    state["z"].add_(p.grad, alpha=-group["lr"])
                    state["x"].mul_(1 - 1 / state["k"]).add_(state["z"], alpha=1 / state["k"])
                    p.copy_((1 - group["beta"]) * state["z"] + group["beta"] * state["x"])
        return loss


def _data(start: int) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(640, 16, generator=generator)
    y = (x @ torch.randn(16, 4, generator=generator)).argmax(1)
    return DataLoader(TensorDataset(x[start : start + 320], y[start : start + 320]), batch_size=32)


class _ScheduleFreeModel(pl.LightningModule):
    """Calls ``optimizer.eval()``/``train()`` around validation, as schedule-free's README asks."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self.net(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", F.cross_entropy(self.net(batch[0]), batch[1]))

    def on_validation_epoch_start(self):
        self.optimizers().optimizer.eval()

    def on_validation_epoch_end(self):
        self.optimizers().optimizer.train()

    def configure_optimizers(self):
        return ScheduleFreeSGD(self.parameters())

    def train_dataloader(self):
        return _data(0)

    def val_dataloader(self):
        return _data(320)


class LossesAtTheTwoPoints(Callback):
    """At every maintain start, the probe batch's loss at the evaluation weights and at the training point."""

    def __init__(self) -> None:
        self.rows: list[tuple[float, float]] = []

    def on_pulse_phase_change(self, trainer, pl_module, change):
        if change.current.value != "maintain":
            return
        optimizer = trainer.optimizers[0]
        x, y = next(iter(trainer.val_dataloaders))
        with torch.no_grad():
            at_training_point = F.cross_entropy(pl_module.net(x), y).item()
            optimizer.eval()
            at_evaluation_weights = F.cross_entropy(pl_module.net(x), y).item()
            optimizer.train()
        self.rows.append((at_evaluation_weights, at_training_point))


def test_the_maintain_probe_measures_a_schedule_free_optimizers_evaluation_weights():
    """Sweep A: the probe ran validation_step without the module's validation hooks, so with schedule-free
    it measured the training point ``y`` instead of the weights the optimizer evaluates at, ``x``."""
    cycle = PulseCycle(
        burst=8, replay=0, maintain=2, warmup=0, anneal=0, probe_batches=1, order=["burst", "maintain"]
    )
    losses = LossesAtTheTwoPoints()
    model = _ScheduleFreeModel()
    pl.seed_everything(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = pl.Trainer(
            max_steps=20, callbacks=[cycle, losses], **trainer_kwargs(val_check_interval=1.0)
        )
        trainer.fit(model)
    at_evaluation_weights, at_training_point = losses.rows[-1]
    assert abs(at_evaluation_weights - at_training_point) > 1e-3  # the two points differ: the test can tell
    assert cycle.last_probe["val_loss"] == pytest.approx(at_evaluation_weights, rel=1e-5)
    assert all(group["train_mode"] for group in trainer.optimizers[0].param_groups)  # training mode again


def test_an_optimizer_already_in_evaluation_mode_and_one_without_modes_are_left_alone():
    parameter = nn.Parameter(torch.ones(2))
    schedule_free, plain = (
        ScheduleFreeSGD([parameter]),
        torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=0.1),
    )
    with evaluation_point([schedule_free, plain]) as switched:
        assert switched == [schedule_free] and not schedule_free.param_groups[0]["train_mode"]
    assert schedule_free.param_groups[0]["train_mode"]
    schedule_free.eval()
    with evaluation_point([schedule_free]) as switched:
        assert switched == []
    assert not schedule_free.param_groups[0]["train_mode"]  # left as it was found
    with pytest.raises(RuntimeError), evaluation_point([schedule_free.train() or schedule_free]):
        raise RuntimeError("the probe failed")
    assert schedule_free.param_groups[0]["train_mode"]  # put back also after an exception


class _TrainsSomething(torch.optim.SGD):
    """An optimizer with methods named ``train`` and ``eval`` that are not schedule-free's modes."""

    def train(self, steps):
        raise AssertionError("the probe must not call a train() that is not a mode switch")

    def eval(self):
        raise AssertionError("the probe must not call an eval() that is not a mode switch")


def test_only_optimizers_with_schedule_frees_flag_are_switched_and_their_weights_come_back_exactly():
    """Review: the two method names alone sent a custom optimizer's ``train(steps)`` through the probe (a
    crash); and schedule-free's in-place round trip is not exact, so the weights are copied back."""
    custom = _TrainsSomething([nn.Parameter(torch.ones(2))], lr=0.1)
    with evaluation_point([custom]) as switched:
        assert switched == []
    parameter = nn.Parameter(torch.tensor([0.1, 0.7]))
    schedule_free = ScheduleFreeSGD([parameter])
    before = parameter.detach().clone()
    with evaluation_point([schedule_free]) as switched:
        assert switched == [schedule_free]
        parameter.data.add_(1e-3)  # what an inexact round trip leaves behind
    assert torch.equal(parameter.detach(), before)
