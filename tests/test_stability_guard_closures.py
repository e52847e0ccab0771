"""StabilityGuard with optimizers and modules that do not run one closure per optimizer step: SAM (two closure
evaluations, the second's gradient applied, gradients read in the step), LBFGS (trial points), and a module's
``optimizer_step`` that runs the closure without ``optimizer.step`` on some batches. Held-out sweep
findings."""

from __future__ import annotations

import copy
import sys

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_pulse import StabilityGuard
from lightning_pulse.core.snapshots import PreStepBuffers, take_snapshot
from lightning_pulse.core.stability_steps import StepRecord

FAULT_STEP = 12


class SAM(torch.optim.Optimizer):
    """Sharpness-aware minimization as it is usually written for Lightning: ``step(closure)`` evaluates the
    closure twice and stacks the gradients' norms (an empty list raises), its base optimizer's state lives
    outside its own ``state_dict`` and shares its parameter groups."""

    def __init__(self, params, rho=0.05, **kwargs):
        super().__init__(params, dict(rho=rho, **kwargs))
        self.base_optimizer = torch.optim.SGD(self.param_groups, **kwargs)
        self.param_groups = self.base_optimizer.param_groups

    @torch.no_grad()
    def first_step(self):
        norm = torch.norm(
            torch.stack([p.grad.norm() for g in self.param_groups for p in g["params"] if p.grad is not None])
        )
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    self.state[param]["old_p"] = param.data.clone()
                    param.add_(param.grad * group["rho"] / (norm + 1e-12))

    @torch.no_grad()
    def second_step(self):
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    param.data = self.state[param]["old_p"]
        self.base_optimizer.step()

    def step(self, closure=None):
        closure = torch.enable_grad()(closure)
        loss = closure()
        self.first_step()
        closure()
        self.second_step()
        return loss


class Classifier(pl.LightningModule):
    """A small MLP whose ``nan_at``-th closure evaluation within step ``FAULT_STEP`` gives NaN outputs."""

    def __init__(self, make_optimizer, nan_at: int | None = None) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
        self.make_optimizer, self.nan_at, self.evaluations = make_optimizer, nan_at, 0
        self.losses: list[tuple[int, float]] = []  # (global_step, loss) of every training_step

    def training_step(self, batch, batch_idx):
        out = self.net(batch[0])
        if self.trainer.global_step == FAULT_STEP:
            self.evaluations += 1
            if self.evaluations == self.nan_at:
                out = out * float("nan")
        loss = F.cross_entropy(out, batch[1])
        self.losses.append((self.trainer.global_step, loss.item()))
        return loss

    def configure_optimizers(self):
        return self.make_optimizer(self.parameters())


def _data() -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=generator)
    return DataLoader(TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long()), batch_size=16)


class StateAtFaultStep(pl.Callback):
    """The parameters and the optimizer's states (its inner optimizers' too) at the start of ``FAULT_STEP``,
    and at its batch end."""

    def __init__(self) -> None:
        self.before = self.after = None

    @staticmethod
    def _read(module):
        optimizer = module.trainer.optimizers[0]
        inner = getattr(optimizer, "base_optimizer", None)
        states = [copy.deepcopy(o.state_dict()["state"]) for o in (optimizer, inner) if o is not None]
        return [p.detach().clone() for p in module.parameters()], states

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == FAULT_STEP and self.before is None:
            self.before = self._read(pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == FAULT_STEP + 1 and self.after is None:
            self.after = self._read(pl_module)


def _fit(module, callbacks, max_steps=20, data=None, **trainer_args) -> pl.Trainer:
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        max_steps=max_steps,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        **trainer_args,
    )
    trainer.fit(module, _data() if data is None else data)
    return trainer


def _same(first, second) -> bool:
    if isinstance(first, torch.Tensor):
        return torch.equal(first, second)
    if isinstance(first, dict):
        return first.keys() == second.keys() and all(_same(first[k], second[k]) for k in first)
    if isinstance(first, (list, tuple)):
        return len(first) == len(second) and all(_same(a, b) for a, b in zip(first, second))
    return first == second


def _sam(params):
    return SAM(params, rho=0.05, lr=0.1, momentum=0.9)


def _lbfgs(params):
    return torch.optim.LBFGS(params, lr=0.5, max_iter=4)


@pytest.mark.parametrize("nan_at", [1, 2], ids=["first-evaluation", "second-evaluation"])
def test_a_skip_under_sam_leaves_the_weights_and_every_optimizer_state_as_before_the_step(nan_at):
    # held-out sweep: the skip set every gradient to None, so SAM's stack of their norms raised mid-run; and
    # a NaN in the second evaluation (whose gradient SAM applies) went unjudged, applied, rolled back later
    module, state = Classifier(_sam, nan_at=nan_at), StateAtFaultStep()
    guard = StabilityGuard(warmup=3, window=10, snapshot_every=10)
    _fit(module, [state, guard])
    assert (guard.steps_skipped, guard.rollbacks) == (1, 0)
    assert guard.events[0]["step"] == FAULT_STEP and guard.events[0]["action"] == "skip"
    assert _same(state.before, state.after)  # the parameters, SAM's state and its base SGD's momentum
    optimizer = module.trainer.optimizers[0]
    assert optimizer.param_groups is optimizer.base_optimizer.param_groups  # an LR schedule still reaches it
    assert all(torch.isfinite(p).all() for p in module.parameters())


def test_a_nonfinite_lbfgs_trial_point_skips_the_step_from_the_state_before_it():
    module, state = Classifier(_lbfgs, nan_at=3), StateAtFaultStep()
    # LBFGS's early steps spike by design: only non-finite values are judged here
    guard = StabilityGuard(loss_zscore=None, grad_norm_zscore=None, snapshot_every=10)
    _fit(module, [state, guard])
    assert (guard.steps_skipped, guard.rollbacks) == (1, 0) and guard.events[0]["step"] == FAULT_STEP
    assert _same(state.before, state.after)
    assert all(torch.isfinite(p).all() for p in module.parameters())


class SometimesSkipsTheUpdate(Classifier):
    """A module whose ``optimizer_step`` runs the closure but not ``optimizer.step`` on some batches."""

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure):
        if batch_idx % 5 == 3:
            optimizer_closure()
        else:
            optimizer.step(closure=optimizer_closure)


def _judged_losses(guard: StabilityGuard) -> dict[int, float]:
    judged: dict[int, float] = {}
    judge = guard.core.judge

    def spy(step, loss, *args, **kwargs):
        judged[step] = loss
        return judge(step, loss, *args, **kwargs)

    guard.core.judge = spy
    return judged


class SkipsTheUpdateAndZeroesInPlace(SometimesSkipsTheUpdate):
    """Zeroes its gradients with ``set_to_none=False``: a window without a step leaves zeros, not ``None``."""

    def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
        optimizer.zero_grad(set_to_none=False)


@pytest.mark.parametrize("module_class", [SometimesSkipsTheUpdate, SkipsTheUpdateAndZeroesInPlace])
@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_step_is_judged_on_its_own_windows_losses_when_a_window_ended_without_a_step(
    accumulate, module_class
):
    # held-out sweep: the loss of a batch whose window ran no optimizer step stayed in the record, and the
    # next step was judged on the sum of both (twice the loss): false spikes and rollbacks. Its gradients
    # were zeroed (to None, or to zeros in place), so it is no part of the next step's update
    module, guard = module_class(lambda p: torch.optim.SGD(p, lr=0.1)), StabilityGuard()
    judged = _judged_losses(guard)
    _fit(module, [guard], max_steps=12, accumulate_grad_batches=accumulate)
    windows: dict[int, list[float]] = {}
    for step, loss in module.losses:  # Lightning counts a window without ``optimizer.step`` as a step too
        windows.setdefault(step, []).append(loss)
    assert len(windows) == 12 and all(len(losses) == accumulate for losses in windows.values())
    unjudged = set(windows) - set(judged)  # the windows without an optimizer step
    assert len(unjudged) >= 2
    for step, loss in judged.items():
        assert loss == pytest.approx(sum(windows[step]) / accumulate, rel=1e-5), step
    assert guard.spikes_detected == 0


class AccumulatesByHand(Classifier):
    """Gradient accumulation by hand, as forum posts write it: ``optimizer_zero_grad`` zeroes every 2nd batch
    and ``optimizer_step`` steps every 2nd, running the closure alone on the others. The windows starting at a
    batch of ``skipped`` run no ``optimizer.step`` (a reference run skipping them by hand)."""

    def __init__(self, skipped=()) -> None:
        super().__init__(lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
        self.skipped = set(skipped)

    def training_step(self, batch, batch_idx):
        loss = F.cross_entropy(self.net(batch[0]), batch[1])
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return loss

    def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
        if batch_idx % 2 == 0:
            optimizer.zero_grad()

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure):
        if batch_idx % 2 == 1 and batch_idx - 1 not in self.skipped:
            optimizer.step(closure=optimizer_closure)
        else:
            optimizer_closure()


def _with_nan_samples(batches) -> DataLoader:
    loader = _data()
    x, y = loader.dataset.tensors
    x = x.clone()
    for batch in batches:
        x[batch * 16 + 3, 0] = float("nan")
    return DataLoader(TensorDataset(x, y), batch_size=16)


@pytest.mark.parametrize("offset", [0, 1], ids=["first-batch", "second-batch"])
def test_a_nan_sample_in_a_window_accumulated_by_hand_is_skipped_as_the_datas_wherever_it_is(offset):
    # loop-hooks sweep: with the NaN sample in the window's first batch, its loss and batch were let go at that
    # batch's end (a window without an optimizer step) while its NaN gradient stayed in .grad; the next step
    # read a finite loss and a non-finite gradient norm, was blamed on the model, and the third such step
    # rolled a healthy model back (24 of 48 steps lost). In the second batch, it was skipped as bad data
    windows = (4, 8, 12)  # each window's first batch, in both epochs
    loader = _with_nan_samples(window + offset for window in windows)
    guard, fits = StabilityGuard(warmup=3, window=10, snapshot_every=10), []
    for callbacks, skipped in (([guard], ()), ([], windows)):  # the reference: those windows skipped by hand
        pl.seed_everything(0, verbose=False)
        module = AccumulatesByHand(skipped)
        fits.append((module, _fit(module, callbacks, max_steps=-1, max_epochs=2, data=loader)))
    assert (guard.steps_skipped, guard.rollbacks, guard.spikes_by_kind["nonfinite_grad"]) == (6, 0, 0)
    found = [(sample["batch_idx"], sample["rows"]) for sample in guard.bad_samples]
    assert found == [(window + offset, [3]) for window in windows] * 2  # the NaN rows, each epoch
    (module, trainer), (reference, _) = fits
    assert all(map(torch.equal, module.parameters(), reference.parameters()))
    # every micro-batch of a skipped window leaves the epoch's figures: the NaN loss too
    assert torch.isfinite(trainer.callback_metrics["train_loss_epoch"])


@pytest.mark.parametrize("zeroing", [None, True, False], ids=["not-zeroed", "zeroed", "zeroed-in-place"])
def test_a_window_without_a_step_goes_on_into_the_next_only_where_its_gradients_were_not_zeroed(zeroing):
    """The record holds such a window until the next micro-batch's backward: its micro-batches, losses and
    generator states go on into the step where the gradients it left are still held, and the buffers its
    forward wrote are set back by a skip of that step too; where they were zeroed, the step is its own."""
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    pre_step, before = PreStepBuffers(), take_snapshot(0, model)
    model(torch.randn(5, 3))
    pre_step.learn(model, before)
    record = StepRecord(buffers=pre_step)
    start = [buffer.clone() for buffer in model[1].buffers()]
    for batch_idx in (0, 1):
        record.add(batch_idx, f"batch {batch_idx}")
        record.entered(f"batch {batch_idx}")
        if batch_idx == 0:
            assert pre_step.copied and pre_step.aside is None
        else:
            assert record.ended_window == 1 and pre_step.aside is not None
            after_first = [buffer.clone() for buffer in model[1].buffers()]
        loss = model(torch.randn(5, 3)).square().mean()
        if batch_idx == 1 and zeroing is not None:
            optimizer.zero_grad(set_to_none=zeroing)
        if record.ended_window:  # as the guard's on_before_backward
            record.settle([optimizer])
        record.losses.append(loss.detach())
        loss.backward()
        if batch_idx == 0:
            record.drop_window(ended=True, optimizers=[optimizer])
            assert [index for index, _ in record.batches] == [0] and len(record.losses) == 1
    carried = zeroing is None
    assert [index for index, _ in record.batches] == ([0, 1] if carried else [1])
    assert len(record.losses) == (2 if carried else 1) and set(record.drawn) == ({0, 1} if carried else {1})
    assert record.ended_window == 0 and pre_step.aside is None
    assert pre_step.restore() == pre_step.names  # a skip of the step: back to before its first forward
    assert all(map(torch.equal, model[1].buffers(), start if carried else after_first))


class FirstStepConverged(Classifier):
    """Step 0's loss is zeroed: LBFGS converges after one evaluation, so the guard first learns that the
    optimizer evaluates its closure once a step."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * 0 if self.trainer.global_step == 0 else loss


def test_a_nonfinite_lbfgs_trial_point_right_after_a_one_evaluation_step_is_skipped_from_before_the_step(
    monkeypatch,
):
    """Review: after a step with one evaluation no backup was held, so the skip at the next step's NaN trial
    point backed up LBFGS's half-done state (an iteration counted, no previous gradient): the step after
    it crashed inside LBFGS."""
    monkeypatch.setattr(sys.modules[__name__], "FAULT_STEP", 1)
    module, state = FirstStepConverged(_lbfgs, nan_at=3), StateAtFaultStep()
    guard = StabilityGuard(loss_zscore=None, grad_norm_zscore=None, snapshot_every=10)
    _fit(module, [state, guard])
    assert (guard.steps_skipped, guard.rollbacks) == (1, 0) and guard.events[0]["step"] == 1
    assert _same(state.before, state.after)
    assert all(torch.isfinite(p).all() for p in module.parameters())
