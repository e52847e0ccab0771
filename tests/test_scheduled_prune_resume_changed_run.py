"""ScheduledPrune resumed into a run that differs from the checkpoint's: a later pruning start than the chance
the checkpoint saved (a longer run, a later ``start``), and a finished schedule given a higher
``final_sparsity``."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pulse import ScheduledPrune, StabilityGuard
from lightning_pulse.core import pruning
from lightning_pulse.core.prune_schedule import PruneSchedule
from tests.conftest import trainer_kwargs

# a regression of the first finding spun forever in on_train_start (SIGTERM did not stop it): fail instead
pytestmark = pytest.mark.timeout(30, method="signal")


class _MLP(pl.LightningModule):
    def __init__(self, nan_steps: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
        self.nan_steps = set(nan_steps)  # a divergence StabilityGuard rolls back

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        loss = F.cross_entropy(self(batch[0]), batch[1])
        return loss * float("nan") if self.global_step in self.nan_steps else loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def _data() -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(256, 16, generator=generator)
    y = (x[:, :4].argmax(dim=1) + (x[:, 4] > 0).long()) % 4
    return DataLoader(TensorDataset(x, y), batch_size=32)  # 8 batches an epoch


def _zeros(module: nn.Module) -> list[float]:
    layers = [layer for layer in module.net if isinstance(layer, nn.Linear)]
    return [float((pruning.effective_weight(layer) == 0).float().mean()) for layer in layers]


def _fit(prune: ScheduledPrune, max_steps: int, ckpt_path=None, checkpoints=None) -> _MLP:
    pl.seed_everything(0)
    module = _MLP()
    saving = (
        []
        if checkpoints is None
        else [ModelCheckpoint(dirpath=checkpoints, every_n_train_steps=4, save_top_k=-1)]
    )
    kwargs = trainer_kwargs(enable_checkpointing=checkpoints is not None)
    trainer = pl.Trainer(max_steps=max_steps, callbacks=[prune, *saving], **kwargs)
    trainer.fit(module, _data(), ckpt_path=ckpt_path)
    assert trainer.global_step == max_steps
    return module


@pytest.mark.parametrize(
    ("resumed_steps", "resumed_start"),
    [(32, 0.5), (16, 0.75)],  # a longer run with a share `start`; a later `start`
    ids=["longer_run", "later_start"],
)
def test_a_checkpoint_from_before_the_start_resumed_to_a_later_start_prunes_on_the_new_span(
    tmp_path, resumed_steps, resumed_start
):
    """Resume sweep: a checkpoint at step 4 of a 16-step run starting at step 8 saves its next chance at 8;
    resumed to 32 steps (start 16) or with start=0.75 (12), the fit spun forever in on_train_start (the plan
    asked `advance(8)`, which returned before the start without moving the chance). It now prunes as the
    uninterrupted run of the new arguments does."""
    _fit(ScheduledPrune(start=0.5, end=0.9, every=2, probe_batches=0), 16, checkpoints=tmp_path)
    checkpoint = str(next(tmp_path.glob("*step=4*.ckpt")))
    assert torch.load(checkpoint, weights_only=False)["callbacks"]["ScheduledPrune"]["next_event_step"] == 8

    def prune():
        return ScheduledPrune(start=resumed_start, end=0.9, every=2, probe_batches=0)

    resumed, uninterrupted = prune(), prune()
    module = _fit(resumed, resumed_steps, ckpt_path=checkpoint)
    _fit(uninterrupted, resumed_steps)
    start = round(resumed_start * resumed_steps)
    assert [event["step"] for event in resumed.events] == [event["step"] for event in uninterrupted.events]
    assert min(event["step"] for event in resumed.events) > start
    assert resumed.finished and resumed.sparsity == pytest.approx(0.5)
    assert _zeros(module) == pytest.approx([0.5] * 3, abs=0.01)


def test_a_chance_restored_before_the_start_moves_up_to_it_and_the_plan_ends():
    """The schedule itself: resolve() moves a restored chance up to the start, and advance() before the start
    moves the chance on, so no caller looping on it spins."""
    saved = PruneSchedule(start=0.5, end=0.9, every=2)
    saved.resolve(16)
    resumed = PruneSchedule(start=0.5, end=0.9, every=2)
    resumed.load_state_dict(saved.state_dict())  # next chance at step 8
    resumed.resolve(32)
    fresh = PruneSchedule(start=0.5, end=0.9, every=2)
    fresh.resolve(32)
    assert resumed.next_step == 16 and resumed.planned_cuts() == fresh.planned_cuts() != []
    # the state a rollback restores is not resolved again: the first chance moves the step on
    resumed.load_state_dict(saved.state_dict())
    assert resumed.advance(9) is None and resumed.next_step == 16
    assert resumed.planned_cuts() == fresh.planned_cuts()


class _StuckSchedule(PruneSchedule):
    """An ``advance`` that never moves the chance on (the bug of the first finding, in any form)."""

    def advance(self, step: int) -> float | None:
        return None


def test_a_plan_whose_chance_does_not_move_ends_rather_than_spin():
    schedule = _StuckSchedule(start=0.5, end=0.9, every=2)
    schedule.resolve(32)
    assert schedule.planned_cuts() == []


def test_a_plan_until_the_run_end_stops_there_however_far_an_int_end_lies():
    # chances at or after the run's end make no cut: without `until`, an int `end` of 2,000,000 on a 100-step
    # run plans every step of the span, 6 s and 2 million entries
    schedule = PruneSchedule(start=0, end=2_000_000, every=1)
    schedule.resolve(100)
    cuts = schedule.planned_cuts(until=100)
    assert [step for step, _, _ in cuts] == list(range(1, 100))


def test_a_reopened_schedule_with_no_step_left_says_only_that_the_sparsity_stays():
    """A review: with no step of the run left for a cut, the warning said both "pruning goes on ... cuts to
    0.800" and "the sparsity stays", then offered a way to keep what it kept anyway."""
    from lightning_pulse.core.prune_events import reopened_warning

    saved = PruneSchedule(start=0.2, end=0.6, every=2, final_sparsity=0.5)
    saved.resolve(40)
    saved.sparsity, saved.finished = 0.5, True
    raised = PruneSchedule(start=0.2, end=0.6, every=2, final_sparsity=0.8)
    raised.load_state_dict(saved.state_dict())
    raised.resolve(43)
    assert raised.reopen(42)
    text = reopened_warning(raised, 0.5, False, run_end=43)
    assert text == (
        "ScheduledPrune: the resumed schedule had finished at sparsity 0.500, below this run's "
        "`final_sparsity`=0.8, but no step of this run is left for a cut: the sparsity stays at 0.500."
    )
    assert "pruning goes on" in reopened_warning(raised, 0.5, False, run_end=100)


def test_a_finished_schedule_resumed_with_a_higher_final_sparsity_prunes_on_to_it_and_says_so(tmp_path):
    """Resume sweep: a schedule finished at 0.5, resumed to a longer run with final_sparsity=0.8, kept the
    model at 0.5 with nothing said (the restored `finished` stopped every chance), while a mid-run checkpoint
    resumed the same way reached 0.8. It now prunes on to 0.8 on the new run's span, said at fit start."""
    first = ScheduledPrune(final_sparsity=0.5, start=0.1, end=0.7, every=2, probe_batches=0)
    _fit(first, 16, checkpoints=tmp_path)
    assert first.finished and first.sparsity == pytest.approx(0.5)
    checkpoint = str(next(tmp_path.glob("*step=16*.ckpt")))
    resumed = ScheduledPrune(final_sparsity=0.8, start=0.1, end=0.7, every=2, probe_batches=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = _fit(resumed, 32, ckpt_path=checkpoint)
    said = [str(w.message) for w in caught if "finished at sparsity" in str(w.message)]
    assert len(said) == 1
    assert "finished at sparsity 0.500, below this run's `final_sparsity`=0.8" in said[0]
    new = [event for event in resumed.events if event["step"] > 16]
    assert new[0]["step"] == 17  # the next step: the span (steps 3 to 22) has begun
    assert f"the first, at step 17, cuts to {new[0]['target_sparsity']:.3f}" in said[0]
    assert resumed.finished and resumed.sparsity == pytest.approx(0.8)
    assert _zeros(module) == pytest.approx([0.8] * 3, abs=0.01)
    # the same final_sparsity: nothing opened, nothing said, no event
    kept = ScheduledPrune(final_sparsity=0.5, start=0.1, end=0.7, every=2, probe_batches=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = _fit(kept, 32, ckpt_path=checkpoint)
    assert not [w for w in caught if "finished at sparsity" in str(w.message)]
    assert [event["step"] for event in kept.events] == [event["step"] for event in first.events]
    assert _zeros(module) == pytest.approx([0.5] * 3, abs=0.01)


def test_a_rollback_to_the_fit_start_keeps_a_reopened_schedule_open(tmp_path):
    """StabilityGuard listed first snapshots the restored state before ScheduledPrune's fit start opens the
    finished schedule again: a rollback to that snapshot restores `finished` and would stop the pruning."""
    _fit(
        ScheduledPrune(final_sparsity=0.5, start=0.1, end=0.7, every=2, probe_batches=0),
        16,
        checkpoints=tmp_path,
    )
    checkpoint = str(next(tmp_path.glob("*step=16*.ckpt")))
    pl.seed_everything(0)
    guard = StabilityGuard(warmup=5, window=10, snapshot_every=1000, rollback_after=3, rollback_margin=1)
    prune = ScheduledPrune(final_sparsity=0.8, start=0.1, end=0.7, every=2, probe_batches=0)
    trainer = pl.Trainer(max_steps=32, callbacks=[guard, prune], **trainer_kwargs())
    module = _MLP(nan_steps=(18, 19, 20))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, _data(), ckpt_path=checkpoint)
    assert guard.policy.rollback_steps and not guard.stopped
    assert prune.finished and prune.sparsity == pytest.approx(0.8)
    assert _zeros(module) == pytest.approx([0.8] * 3, abs=0.01)
