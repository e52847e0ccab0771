"""Unbroken rows of non-finite steps on a finite model: a loss infinite on a few samples at any weights (a CTC
target longer than its input) is skipped as the data's; a model gone bad, or a data stream gone bad for good,
still escalates."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pulse.callbacks.stability_guard import StabilityGuard, StabilityGuardError
from lightning_pulse.core.spike_detection import Verdict
from lightning_pulse.core.stability_policy import NONFINITE_ROW_TESTED, Action, EscalationPolicy
from tests.conftest import trainer_kwargs

FRAMES, LONGEST = 8, 12  # input frames; a target of 12 labels cannot align with 8 frames: CTC loss inf


class _Ctc(pl.LightningModule):
    """Frames of 4 features to 5 classes (0 the blank) under ``nn.CTCLoss`` as torch and HF default it
    (``zero_infinity=False``); ``blow_up_at``: the weights are multiplied by 1e20 (finite) before that step,
    so every later batch's logits overflow (a NaN loss) while the snapshot's weights give finite ones."""

    def __init__(self, blow_up_at: int | None = None):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 5))
        self.ctc = nn.CTCLoss(zero_infinity=False)
        self.blow_up_at = blow_up_at

    def loss(self, batch):
        x, targets, target_lengths = batch
        log_probs = self.net(x).log_softmax(-1).transpose(0, 1)  # (T, B, C)
        input_lengths = torch.full((x.shape[0],), x.shape[1], dtype=torch.long)
        return self.ctc(log_probs, targets, input_lengths, target_lengths)

    def training_step(self, batch, batch_idx):
        if self.trainer.global_step == self.blow_up_at and torch.is_grad_enabled():
            self.blow_up_at = None  # once
            with torch.no_grad():
                self.net[0].weight.mul_(1e20)
                self.net[2].weight.mul_(1e20)
        return self.loss(batch)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.02)


def _ctc_data(impossible: list[int], count: int = 64):
    """``count`` samples of 3 labels each; those at ``impossible`` have 12, more than the 8 frames."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(count, FRAMES, 4, generator=generator)
    targets = torch.randint(1, 5, (count, LONGEST), generator=generator)
    lengths = torch.full((count,), 3, dtype=torch.long)
    lengths[impossible] = LONGEST
    return TensorDataset(x, targets, lengths)


def _fit(module, data, guard, tmp_path, batch_size=4):
    trainer = pl.Trainer(max_epochs=1, callbacks=[guard], default_root_dir=tmp_path, **trainer_kwargs())
    trainer.fit(module, DataLoader(data, batch_size=batch_size))  # unshuffled: the bad batches' places known
    return trainer


def test_an_unbroken_row_of_non_finite_steps_on_a_finite_model_gets_the_rollback_test():
    asked = []

    def cannot_help() -> bool:
        asked.append(True)
        return False

    policy = EscalationPolicy(rollback_after=3)
    decided = [policy.decide(s, Verdict.NONFINITE_LOSS, rollback_helps=cannot_help) for s in (5, 6, 7)]
    assert decided == [Action.SKIP] * 3 and asked and policy.healthy and policy.recurring_spikes == 3
    assert policy.recurring_nonfinite == 1 and policy.events[-1]["cause"] == "recurring"
    # a model gone bad is finite on the snapshot: the test says the rollback helps, and it rolls back
    policy = EscalationPolicy(rollback_after=3)
    decided = [policy.decide(s, Verdict.NONFINITE_LOSS, rollback_helps=lambda: True) for s in (5, 6, 7)]
    assert decided == [Action.SKIP, Action.SKIP, Action.ROLLBACK]
    # a finite loss spike in the row: escalated untested, as before
    asked.clear()
    policy = EscalationPolicy(rollback_after=3)
    policy.decide(5, Verdict.LOSS_SPIKE, rollback_helps=cannot_help)
    policy.decide(6, Verdict.NONFINITE_LOSS, rollback_helps=cannot_help)
    assert (
        policy.decide(7, Verdict.NONFINITE_LOSS, rollback_helps=cannot_help) is Action.ROLLBACK and not asked
    )
    # past NONFINITE_ROW_TESTED in a row, with no step applied, it escalates untested: a stream gone bad
    policy = EscalationPolicy(rollback_after=3)
    actions = [policy.decide(s, Verdict.NONFINITE_LOSS, rollback_helps=cannot_help) for s in range(40)]
    escalated = (NONFINITE_ROW_TESTED // 3 + 1) * 3 - 1  # the first incident past the row
    assert actions.index(Action.ROLLBACK) == escalated and set(actions[:escalated]) == {Action.SKIP}
    restored = EscalationPolicy()
    restored.load_state_dict(policy.state_dict())
    assert restored.nonfinite_row == policy.nonfinite_row == 40 and restored.recurring_nonfinite > 0
    # an applied step ends the row
    policy.finish(Action.APPLY)
    assert policy.nonfinite_row == 0


def test_the_row_bound_is_that_of_bad_data_that_cannot_be_checked():
    from lightning_pulse.core.stability_steps import RECURRING_DATA_FAULTS, UNCHECKED_DATA_FAULTS

    assert NONFINITE_ROW_TESTED == UNCHECKED_DATA_FAULTS + RECURRING_DATA_FAULTS


def test_three_ctc_batches_in_a_row_with_an_impossible_target_are_skipped_and_the_run_keeps_its_training(
    tmp_path,
):
    """Batches 5, 6 and 7 (and 11) each hold a target longer than the frames: their loss is inf at any
    weights, on finite inputs and a finite model. The row of 3 used to roll back to the only snapshot (step
    0) and skip the next 20 batches: the fit ended with the initial model. Now each is found inf on the
    snapshot too (the rollback test) and skipped; the other 12 steps train."""
    data = _ctc_data(impossible=[21, 26, 30, 45])  # batches of 4: 5, 6, 7 and 11
    module = _Ctc()
    start = {name: value.clone() for name, value in module.state_dict().items()}
    good = [i for i in range(64) if i not in (21, 26, 30, 45)]
    with torch.no_grad():
        before = float(module.loss(data[good]))
    guard = StabilityGuard()
    trainer = _fit(module, data, guard, tmp_path)
    skipped = sorted(event["step"] for event in guard.events if event.get("action") == "skip")
    assert guard.rollbacks == 0 and skipped == [5, 6, 7, 11] and guard.steps_lost == 4
    # the end-of-training line names the likely cause and the way out
    assert "1 recurring incident(s) ended on a loss non-finite" in guard.core.summary()
    assert "`nn.CTCLoss(zero_infinity=True)`" in guard.core.summary()
    assert trainer.global_step == 16 and not guard.stopped
    moved = max(float((module.state_dict()[name] - value).abs().max()) for name, value in start.items())
    with torch.no_grad():
        after = float(module.loss(data[good]))
    assert moved > 0.05 and after < before - 0.3, (moved, before, after)


def test_a_model_whose_loss_turns_inf_on_every_batch_still_rolls_back(tmp_path):
    """At step 6 the weights blow up (finite): every batch is inf from then on, a row the rollback test finds
    finite at the snapshot (step 0): rolled back after 3, as before, and training recovers."""
    data = _ctc_data(impossible=[])
    module = _Ctc(blow_up_at=6)
    guard = StabilityGuard(skip_after_rollback=2)
    _fit(module, data, guard, tmp_path)
    assert [(e["step"], e.get("to_step")) for e in guard.events if e["event"] == "rollback"] == [(8, 0)]
    assert torch.isfinite(module.loss(data[:])) and guard.recurring_spikes == 0


def test_a_ctc_data_stream_gone_bad_for_good_still_escalates(tmp_path):
    """From batch 4 on, every batch holds an impossible target: each is inf on the snapshot too, so the
    rollback test calls each incident the data's, but after NONFINITE_ROW_TESTED of them in a row with no
    step applied the next incident escalates untested: a stop here (``max_rollbacks=0``)."""
    data = _ctc_data(impossible=list(range(16, 128, 4)), count=128)
    guard = StabilityGuard(max_rollbacks=0)
    with pytest.raises(StabilityGuardError):
        _fit(_Ctc(), data, guard, tmp_path)
    stop = next(event["step"] for event in guard.events if event["event"] == "stop")
    assert stop == 4 + (NONFINITE_ROW_TESTED // 3 + 1) * 3 - 1
    assert guard.recurring_spikes == stop - 4 - 2  # the two flagged since the last recurring incident


def test_a_fits_first_batches_all_inf_are_skipped_not_rolled_back_to_the_same_weights(tmp_path):
    """Batches 0, 1 and 2 each hold an impossible target: no step applied yet, so no ordinary batch to compare
    with at the snapshot (step 0). It holds the very weights the row ran on, so a rollback there changes
    nothing for those batches; it used to roll back (0 steps undone) and skip the next 20 batches."""
    data = _ctc_data(impossible=[1, 6, 11])
    guard = StabilityGuard()
    _fit(_Ctc(), data, guard, tmp_path)
    assert guard.rollbacks == 0 and guard.steps_skipped == 3 and guard.recurring_spikes == 3


class _NanFromTheStart(_Ctc):
    def training_step(self, batch, batch_idx):
        return self.loss(batch) * float("nan")  # a bug: every batch NaN at any weights, the inputs finite


def test_a_model_non_finite_on_every_batch_from_the_start_still_stops_after_the_row(tmp_path):
    """No step ever applies: each incident is skipped while the row lasts (the weights are the snapshot's),
    then the run stops (``max_rollbacks=0``), NONFINITE_ROW_TESTED steps later than it used to."""
    guard = StabilityGuard(max_rollbacks=0)
    with pytest.raises(StabilityGuardError):
        _fit(_NanFromTheStart(), _ctc_data(impossible=[], count=128), guard, tmp_path)
    stop = next(event["step"] for event in guard.events if event["event"] == "stop")
    assert stop == (NONFINITE_ROW_TESTED // 3 + 1) * 3 - 1 and guard.steps_skipped == stop + 1
    # the end line does not blame samples for what the stop found to be the model's (a review: it did)
    assert guard.policy.recurring_nonfinite > 0
    assert "likely samples" not in (guard.core.summary() or "")
