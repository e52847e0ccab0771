"""StabilityGuard's re-runs of a recorded batch (the rollback test, the non-finite data check) draw what the
step drew: each micro-batch's torch generator states are recorded at its ``training_step``'s entry and set
back for its re-run, inside an isolation that gives the run its own generators back.

Found by a held-out sweep: a diffusion loss (timestep and noise drawn per sample in ``training_step``, SNR
weights capped at 1000) was stopped after 3 rollbacks, its spikes called the model's, because the re-runs
drew other timesteps than the step had (and the flagged and the reference batch drew the same ones).
"""

from __future__ import annotations

import math

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.seed import isolate_rng
from torch.utils.data import DataLoader, TensorDataset

from lightning_pulse.callbacks.stability_guard import StabilityGuard
from lightning_pulse.core.snapshots import take_snapshot
from lightning_pulse.core.stability_policy import Action
from lightning_pulse.core.stability_steps import StepRecord
from tests.conftest import trainer_kwargs


def _regression_data(samples: int = 256) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 4, generator=generator)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.3 * torch.randn(samples, 1, generator=generator)
    return TensorDataset(x, y)


class RareHeavyWeights(pl.LightningModule):
    """A linear regression whose loss weights each sample by a weight drawn in ``training_step``: 1, or
    ``heavy`` for one sample in 250 (a diffusion loss's SNR weight at a small timestep). A step that draws it
    spikes; the data and the model are healthy. ``drawn``: each real step's largest weight (re-runs left
    out)."""

    def __init__(self, heavy: float = 1000.0) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.heavy = heavy
        self.drawn: dict[int, float] = {}
        self.in_loop = False  # set at each batch start: the loop's own training_step comes first

    def on_train_batch_start(self, batch, batch_idx):
        self.in_loop = True

    def training_step(self, batch, batch_idx):
        x, y = batch
        weight = torch.where(torch.rand(len(x)) < 0.004, self.heavy, 1.0)
        if self.in_loop:
            self.drawn[self.global_step], self.in_loop = float(weight.max()), False
        return (weight * (self.layer(x) - y).pow(2).squeeze(1)).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.02)


def _fit(callbacks: list, heavy: float = 1000.0, steps: int = 320, seed: int = 3) -> RareHeavyWeights:
    pl.seed_everything(seed, verbose=False)
    module = RareHeavyWeights(heavy)
    loader = DataLoader(_regression_data(), batch_size=8, shuffle=True)
    pl.Trainer(**trainer_kwargs(max_steps=steps, callbacks=callbacks)).fit(module, loader)
    return module


@pytest.mark.parametrize("heavy", [1000.0, math.inf])
def test_spikes_the_steps_own_draws_make_are_skipped_as_the_datas_never_rolled_back(heavy):
    # the old re-runs drew other weights than the step: the spike never came again, so it was the model's
    # (1000: a rollback, 177 steps lost in 320; an infinite weight: 2 rollbacks for non-finite losses)
    guard = StabilityGuard()
    module = _fit([guard], heavy)
    assert guard.rollbacks == 0 and not guard.stopped and len(module.drawn) == 320
    heavy_steps = {step for step, weight in module.drawn.items() if weight > 1}
    flagged = {event["step"] for event in guard.events}
    # the loss spikes on steps that drew a heavy weight, and only there; re-run from the states those steps
    # drew from, their batches spike at the snapshot too: the data's, skipped
    assert flagged and flagged <= heavy_steps
    assert guard.recurring_spikes >= 1 and guard.steps_skipped == len(flagged)


class ReplayChecker(Callback):
    """Listed after the guard: at each optimizer step, before the update, the guard's re-runs of this step's
    batch and of the last applied step's (the rollback test's reference), each at the weights it trained
    at."""

    def __init__(self, guard: StabilityGuard) -> None:
        self.guard = guard
        self.previous: tuple | None = None  # the last step's weights and trained loss
        self.compared: list[tuple[float, ...]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        flagged = self.guard._flagged_step(trainer, pl_module)
        trained = pl_module.trained_loss
        now = take_snapshot(trainer.global_step, pl_module)  # the weights this step trained at
        (replayed,) = flagged.losses_of(flagged.record.batches)
        at_now, _ = flagged.losses_at_snapshot(now)
        if self.previous is not None and flagged.comparable:
            earlier, earlier_loss = self.previous
            _, reference = flagged.losses_at_snapshot(earlier)
            self.compared.append((trained, replayed, at_now, earlier_loss, reference))
        self.previous = (now, trained)


class Dropout(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 32), torch.nn.Dropout(0.5), torch.nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def on_before_backward(self, loss):
        self.trained_loss = float(loss.detach())  # the loop's step only: a re-run calls no backward

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class DrawsAtBatchStart(Callback):
    """Listed after the guard: draws from torch's generator at each batch start (a mixup callback's mixing
    weight), between the guard's batch start and ``training_step``."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.mixing = torch.rand(1)


@pytest.mark.parametrize("draw_before_step", [False, True], ids=["plain", "a-later-hook-draws"])
def test_a_replayed_batch_gives_the_loss_it_trained_on_bit_for_bit_with_dropout(draw_before_step):
    # held-out sweep: the states were kept at the guard's batch start, so a later hook's draw shifted every
    # re-run's dropout masks; they are kept at training_step's entry
    pl.seed_everything(0, verbose=False)
    guard = StabilityGuard()
    checker = ReplayChecker(guard)
    loader = DataLoader(_regression_data(64), batch_size=8, shuffle=True)
    callbacks = [guard, *([DrawsAtBatchStart()] if draw_before_step else []), checker]
    pl.Trainer(**trainer_kwargs(max_steps=12, callbacks=callbacks)).fit(Dropout(), loader)
    assert len(checker.compared) == 11
    for trained, replayed, at_now, earlier_loss, reference in checker.compared:
        # the flagged batch (at the current weights and at a snapshot of them) and the reference batch (at
        # the weights it trained at) each draw their own step's dropout masks: the very losses that trained
        assert replayed == trained and at_now == trained and reference == earlier_loss
    assert len({row[0] for row in checker.compared}) == 11  # a different loss each step: real comparisons


def test_the_guards_rollback_tests_leave_the_runs_later_draws_as_they_were():
    guard = StabilityGuard()
    guarded, plain = _fit([guard]), _fit([])
    assert guard.recurring_spikes >= 1  # the rollback tests ran, replaying the heavy draws
    # yet every step of the guarded run drew what the same run without a guard drew (the data order and each
    # training_step's draws): the replays set the generators inside an isolation that gives them back
    assert guarded.drawn == plain.drawn and len(plain.drawn) == 320


def test_the_step_record_keeps_each_batchs_states_until_its_step_ends_an_applied_ones_as_the_reference():
    record = StepRecord(device="cpu")
    torch.manual_seed(0)
    record.add(0, "a")
    torch.rand(2)  # a later batch-start hook's draw
    record.entered("a")  # training_step's entry: its states
    first = torch.rand(3)  # what batch 0's training_step would draw
    record.entered("a")  # a closure evaluated again: the states of its first evaluation stay
    record.add(1, "b")
    record.entered("b")
    (generator, state), *gpu = record.drawn[0]
    assert generator is torch.default_generator and not gpu  # a CPU module: no CUDA generator recorded
    with isolate_rng():
        generator.set_state(state)
        assert torch.equal(torch.rand(3), first)
    record.decided = Action.APPLY
    record.end()
    assert set(record.reference_drawn) == {0, 1} and record.drawn == {}
    record.add(2, "c")
    record.entered("c")
    record.decided = Action.SKIP
    record.end()  # a skipped step's states go with its batches; the reference stays the applied step's
    assert set(record.reference_drawn) == {0, 1} and record.drawn == {}
    record.add(3, "d")
    record.entered("d")
    record.drop_window(ended=True)
    assert record.drawn == {} and record.drawn_states == ({}, record.reference_drawn)


class EndsTheFirstEpochInsideAWindow(Dropout):
    """Its ``on_train_batch_start`` returns -1 at the first epoch's second batch (Lightning skips the rest of
    the epoch), inside an accumulation window of two. Keeps each micro-batch's loss as it trained."""

    def __init__(self) -> None:
        super().__init__()
        self.window: list[float] = []

    def on_train_batch_start(self, batch, batch_idx):
        if self.current_epoch == 0 and batch_idx == 1:
            return -1

    def on_before_backward(self, loss):
        self.window.append(float(loss.detach()))


class WindowReplays(Callback):
    """Listed after the guard: at each optimizer step, the guard's re-runs of the step's micro-batches next to
    the losses they trained with (Lightning divides each by the window's length before backward)."""

    def __init__(self, guard: StabilityGuard) -> None:
        self.guard = guard
        self.rows: list[tuple[list[float], list[float]]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        flagged = self.guard._flagged_step(trainer, pl_module)
        replayed = [flagged.losses_of([batch])[0] for batch in flagged.record.batches]
        trained = [loss * trainer.accumulate_grad_batches for loss in pl_module.window]
        self.rows.append((replayed, trained))
        pl_module.window = []


def test_a_window_an_epoch_ended_early_is_let_go_before_the_next_epochs_first_step():
    # a review: the abandoned window's batch and states stayed in the record, so the next step's loss summed
    # both windows' losses and its re-runs drew the abandoned batch's dropout masks
    pl.seed_everything(0, verbose=False)
    guard = StabilityGuard()
    replays = WindowReplays(guard)
    loader = DataLoader(_regression_data(16), batch_size=4)
    trainer = pl.Trainer(
        **trainer_kwargs(max_epochs=2, accumulate_grad_batches=2, callbacks=[guard, replays])
    )
    module = EndsTheFirstEpochInsideAWindow()
    module.window = []
    trainer.fit(module, loader)
    assert trainer.global_step == 2  # the second epoch's two windows; the first epoch's was abandoned
    first_window = replays.rows[0][1]
    assert len(first_window) == 3  # the abandoned micro-batch trained its backward too, then the window's two
    for replayed, trained in replays.rows:
        # each window's own micro-batches, each re-run drawing the masks it trained with
        assert replayed == trained[-len(replayed) :] and len(replayed) == 2
