"""StabilityGuard with optimizer wrappers shaped as they are commonly written: a Lookahead that shares its
inner optimizer's ``param_groups`` and nests its state (with or without calling ``Optimizer.__init__``; its
``load_state_dict`` loads the inner one and re-links the groups), and SAM, whose base optimizer's state is not
in SAM's ``state_dict``. A skip and a rollback must behave as with the plain inner optimizer: weights and
inner state back, the parameter groups still shared, the LR schedule and the guard's cooldown reaching the
inner optimizer's updates."""

from __future__ import annotations

import copy
from collections import OrderedDict

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pulse.callbacks.stability_guard import StabilityGuard
from lightning_pulse.core.stability_policy import StabilityGuardConfig
from tests.conftest import trainer_kwargs

FAULT_STEP = 20


class _Recording:
    """An optimizer that records the learning rate each of its updates uses: read after the closure (where
    the guard decides, and lowers it in a cooldown), as the update reads it."""

    rates: list[float]

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.rates.append(round(self.param_groups[0]["lr"], 7))
        super().step()
        return loss


class _RecordingAdam(_Recording, torch.optim.Adam):
    def __init__(self, params, **kwargs) -> None:
        super().__init__(params, **kwargs)
        self.rates = []


class _RecordingSGD(_Recording, torch.optim.SGD):
    def __init__(self, params, **kwargs) -> None:
        super().__init__(params, **kwargs)
        self.rates = []


class _CommonLookahead(torch.optim.Optimizer):
    """Lookahead as pytorch_optimizer and many repositories write it: no ``Optimizer.__init__`` (torch never
    wraps its ``step``, so no step hooks run), the inner optimizer's ``param_groups`` shared, its state nested
    in ``{"inner", "slow", "steps"}``, and a ``load_state_dict`` that loads the inner one and re-links."""

    def __init__(self, optimizer: torch.optim.Optimizer, k: int = 2, alpha: float = 0.5) -> None:
        self.optimizer, self.k, self.alpha, self.steps = optimizer, k, alpha, 0
        self.param_groups, self.defaults, self.state = optimizer.param_groups, optimizer.defaults, {}

    def step(self, closure=None):
        loss = self.optimizer.step(closure)
        self.steps += 1
        with torch.no_grad():
            for p in (p for group in self.param_groups for p in group["params"]):
                slow = self.state.setdefault(p, {"slow": p.detach().clone()})["slow"]
                if self.steps % self.k == 0:
                    slow.add_(p - slow, alpha=self.alpha)
                    p.copy_(slow)
        return loss

    def zero_grad(self, set_to_none=True):
        self.optimizer.zero_grad(set_to_none)

    def _params(self):
        return [p for group in self.param_groups for p in group["params"]]

    def state_dict(self):
        slow = {i: self.state[p]["slow"].clone() for i, p in enumerate(self._params()) if p in self.state}
        return {"inner": self.optimizer.state_dict(), "slow": slow, "steps": self.steps}

    def load_state_dict(self, state_dict):
        self.optimizer.load_state_dict(state_dict["inner"])
        self.param_groups = self.optimizer.param_groups
        params = self._params()
        self.state = {params[i]: {"slow": slow.clone()} for i, slow in state_dict["slow"].items()}
        self.steps = state_dict["steps"]


class _HookDictsLookahead(_CommonLookahead):
    """The same with the step-hook dicts set by hand: hooks can be registered, but torch never runs them."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(optimizer)
        self._optimizer_step_pre_hooks, self._optimizer_step_post_hooks = OrderedDict(), OrderedDict()


class _BuiltLookahead(_CommonLookahead):
    """The same, built through ``Optimizer.__init__`` (torch wraps its ``step`` and runs the step hooks)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        torch.optim.Optimizer.__init__(self, optimizer.param_groups, optimizer.defaults)
        self.optimizer, self.k, self.alpha, self.steps = optimizer, 2, 0.5, 0
        self.param_groups, self.state = optimizer.param_groups, {}


class _SAM(torch.optim.Optimizer):
    """SAM (Foret et al. 2021) as commonly written: its base optimizer shares its groups; the base's state
    (SGD's momentum) is not in SAM's ``state_dict``."""

    def __init__(self, base: torch.optim.Optimizer, rho: float = 0.05) -> None:
        for group in base.param_groups:
            group["rho"] = rho
        super().__init__(base.param_groups, {**base.defaults, "rho": rho})
        self.base_optimizer, self.param_groups = base, base.param_groups

    def step(self, closure=None):
        closure = torch.enable_grad()(closure)
        loss = closure()
        with torch.no_grad():
            grads = [p.grad.norm() for g in self.param_groups for p in g["params"] if p.grad is not None]
            norm = torch.norm(torch.stack(grads))
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        self.state[p]["old_p"] = p.detach().clone()
                        p.add_(p.grad * group["rho"] / (norm + 1e-12))
        closure()
        with torch.no_grad():
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.copy_(self.state[p]["old_p"])
        self.base_optimizer.step()
        return loss


WRAPPERS = {
    "common_lookahead": _CommonLookahead,
    "hook_dicts_lookahead": _HookDictsLookahead,
    "built_lookahead": _BuiltLookahead,
    "sam": _SAM,
}


class _Net(pl.LightningModule):
    """``wrapper``: a key of ``WRAPPERS`` or ``None`` (the inner optimizer alone); ``inner``: ``"adam"`` or
    ``"sgd"`` (with momentum). ``fault``: ``"rollback"`` writes a NaN into a weight at the start of step
    ``FAULT_STEP`` (the state's fault), ``"skip"`` a NaN into that step's batch (the data's)."""

    def __init__(self, wrapper: str | None, inner: str = "adam", fault: str | None = None) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2))
        self.wrapper, self.inner_kind, self.fault = wrapper, inner, fault
        self.inner: torch.optim.Optimizer | None = None

    def forward(self, x):
        return self.net(x)

    def on_train_batch_start(self, batch, batch_idx):
        if self.global_step == FAULT_STEP and self.fault == "rollback":
            with torch.no_grad():
                self.net[2].weight[0, 0] = float("nan")
        if self.global_step == FAULT_STEP and self.fault == "skip":
            batch[0][0, 0] = float("nan")

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self):
        if self.inner_kind == "adam":
            self.inner = _RecordingAdam(self.parameters(), lr=0.01)
        else:
            self.inner = _RecordingSGD(self.parameters(), lr=0.05, momentum=0.9)
        optimizer = self.inner if self.wrapper is None else WRAPPERS[self.wrapper](self.inner)
        schedule = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.1, total_iters=40)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def _data() -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(640, 16, generator=generator)
    y = (x[:, :4].sum(1) > 0).long()
    return DataLoader(TensorDataset(x, y), batch_size=16)


def _fit(tmp_path, wrapper, fault, inner="adam", callbacks=(), max_steps=40) -> tuple[_Net, StabilityGuard]:
    pl.seed_everything(0)
    guard = StabilityGuard(
        warmup=8,
        grad_norm_zscore=None,
        snapshot_every=10,
        rollback_margin=5,
        skip_after_rollback=2,
        config=StabilityGuardConfig(lr_factor_after_rollback=0.5, lr_cooldown_steps=5),
    )
    model = _Net(wrapper, inner, fault)
    trainer = pl.Trainer(
        max_steps=max_steps, callbacks=[guard, *callbacks], **trainer_kwargs(default_root_dir=tmp_path)
    )
    trainer.fit(model, _data())
    return model, guard


@pytest.mark.parametrize("fault", ["skip", "rollback"])
@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_a_skip_or_rollback_under_a_wrapper_keeps_the_lr_schedule_reaching_the_inner_updates(
    tmp_path, wrapper, fault
):
    """Review (sweep): after a rollback (SAM, Lookahead) or a skip (Lookahead) the wrapper and its inner
    optimizer held different group dicts, so the LR stayed frozen for the rest of the run; a Lookahead that
    does not call ``Optimizer.__init__`` crashed at train start; one with hand-set hook dicts had its LR put
    back after Lightning stepped the schedule."""
    inner = "sgd" if wrapper == "sam" else "adam"
    plain, plain_guard = _fit(tmp_path, None, fault, inner)
    wrapped, guard = _fit(tmp_path, wrapper, fault, inner)
    expected_events = plain_guard.events
    assert expected_events and [e["event"] for e in guard.events] == [e["event"] for e in expected_events]
    assert guard.rollbacks == (1 if fault == "rollback" else 0)
    optimizer = wrapped.trainer.optimizers[0]
    assert optimizer.param_groups is wrapped.inner.param_groups
    assert all(mine is its for mine, its in zip(optimizer.param_groups, wrapped.inner.param_groups))
    assert wrapped.inner.rates == plain.inner.rates  # the schedule and the cooldown, as without the wrapper
    # the guard's step wrapper of a hookless optimizer is gone; the LR scheduler's own one is back
    assert getattr(vars(optimizer)["step"], "__wrapped__", None) is type(optimizer).step


class _Watch(Callback):
    """Copies of the parameters, the inner optimizer's state and the wrapper's own (its counter and state
    entries) at the end of the steps in ``at`` (the first time each is reached)."""

    def __init__(self, *at: int) -> None:
        self.at, self.seen = at, {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step
        if step in self.at and step not in self.seen:
            optimizer = trainer.optimizers[0]
            self.seen[step] = (
                [p.detach().clone() for p in pl_module.parameters()],
                copy.deepcopy(pl_module.inner.state_dict()["state"]),
                getattr(optimizer, "steps", None),  # Lookahead's counter
                copy.deepcopy(list(optimizer.state.values())),  # Lookahead's slow weights, SAM's old ones
            )


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("wrapper", ["sam", "common_lookahead", "built_lookahead"])
def test_a_rollback_under_a_wrapper_returns_the_inner_optimizers_state_to_the_snapshot(tmp_path, wrapper):
    """Review (sweep): under SAM the rollback restored the weights but kept the base SGD's momentum of the 10
    undone steps (SAM's ``state_dict`` does not hold it)."""
    watch = _Watch(10, FAULT_STEP + 1)  # the snapshot's step, and the step after the rollback
    model, guard = _fit(tmp_path, wrapper, "rollback", "sgd" if wrapper == "sam" else "adam", [watch], 21)
    assert guard.rollbacks == 1 and guard.events[-1]["to_step"] == 10
    snapshot, after = watch.seen[10], watch.seen[FAULT_STEP + 1]
    assert _same(snapshot[0], after[0])  # the weights
    assert snapshot[1] and _same(snapshot[1], after[1])  # the inner optimizer's state (momentum, moments)
    assert _same(snapshot[2:], after[2:])  # the wrapper's own state


@pytest.mark.parametrize("wrapper", ["sam", "common_lookahead", "built_lookahead"])
def test_a_skipped_step_under_a_wrapper_leaves_weights_and_every_state_as_before(tmp_path, wrapper):
    watch = _Watch(FAULT_STEP, FAULT_STEP + 1)  # before the skipped step, and after it
    model, guard = _fit(tmp_path, wrapper, "skip", "sgd" if wrapper == "sam" else "adam", [watch], 21)
    assert guard.events == [
        {"step": FAULT_STEP, "event": "nonfinite_loss", "action": "skip", "cause": "data"}
    ]
    before, after = watch.seen[FAULT_STEP], watch.seen[FAULT_STEP + 1]
    assert _same(before, after)


def test_the_guards_step_wrapper_comes_off_when_the_fit_raises(tmp_path):
    """A review: the wrapper put on the `step` of an optimizer that never called `Optimizer.__init__` stayed
    after an exception mid-fit (Lightning runs no train-end hook then): a later fit wrapped it twice, and a
    stale guard's restore could run inside it."""

    class RaiseAtStep(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 3:
                optimizers.append(trainer.optimizers[0])
                raise RuntimeError("stop here")

    optimizers: list = []
    with pytest.raises(RuntimeError, match="stop here"):
        _fit(tmp_path, "common_lookahead", None, callbacks=[RaiseAtStep()])
    from lightning_pulse.core.snapshots import StepThrough

    # the LR scheduler's own wrapper of `step` is back, the guard's is gone
    assert optimizers and not isinstance(vars(optimizers[0]).get("step"), StepThrough)
