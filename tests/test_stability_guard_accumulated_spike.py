"""StabilityGuard under gradient accumulation and a data spike in one micro-batch (held-out sweep "spikes",
problem 3): with ``accumulate_grad_batches=2``, 4 samples x1000 that come back every epoch, averaged with a
clean micro-batch, flag the step for its gradient norm only (window loss 2.32 against a median of 1.41, under
``min_ratio`` squared), which went untested; the third such step within ``spike_memory`` rolled back to the
fit's start (105 applied steps undone). The micro-batch whose own loss spikes is now tested alone."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_pulse import StabilityGuard
from lightning_pulse.core.stability_steps import FlaggedStep, StepRecord
from tests.conftest import trainer_kwargs
from tests.test_stability_guard_untrained_snapshot import _Digits, shuffled_digits


def _flagged(micro_batches, losses, all_reduce_sum=None):
    record = StepRecord()
    for batch_idx in micro_batches:
        record.add(batch_idx, f"batch {batch_idx}")
    record.losses = [torch.tensor(loss) for loss in losses]
    record.take_losses(1)
    return FlaggedStep(None, 0, record, [], [], None, all_reduce_sum, False, None, None)


def test_the_highest_micro_batch_and_its_own_loss_are_read_from_the_recorded_losses():
    # Lightning divides each micro-batch's loss by the window's length: 0.41 and 1.91 are 0.81 and 3.82
    highest = _flagged([40, 41], [0.40625, 1.91190]).highest_micro_batch()
    assert highest is not None and highest[1] == (41, "batch 41") and abs(highest[0] - 3.8238) < 1e-4
    # a maximized objective returns the negated loss, judged as -value: the same micro-batch
    negated = _flagged([40, 41], [-0.40625, -1.91190]).highest_micro_batch(maximized=True)
    assert negated is not None and negated[1] == (41, "batch 41") and abs(negated[0] - 3.8238) < 1e-4
    assert (
        _flagged([40], [3.8]).highest_micro_batch() is None
    )  # no accumulation: the window's loss is its own
    assert _flagged([40, 41], [3.8]).highest_micro_batch() is None  # a micro-batch that returned None
    assert _flagged([40, 41], [0.4, 1.9], all_reduce_sum=sum).highest_micro_batch() is None  # DDP: per rank


def test_a_recurring_x1000_micro_batch_under_accumulation_is_skipped_not_rolled_back_to_the_start():
    x, y = shuffled_digits()
    x[672:675] = float("nan")  # micro-batch 21 of each epoch: skipped as the data's
    x[1312:1316] *= 1000  # micro-batch 41, beside a clean 40 in its window
    pl.seed_everything(0)
    guard = StabilityGuard()
    trainer = pl.Trainer(callbacks=[guard], max_steps=130, accumulate_grad_batches=2, **trainer_kwargs())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(_Digits(), DataLoader(TensorDataset(x, y), batch_size=32, drop_last=True))
    flagged = [e for e in guard.events if e["event"] == "grad_spike"]
    assert [e["step"] for e in flagged] == [66, 89, 112]
    # at step 112 the x1000 micro-batch's loss is 3.82 (its window's 2.32); at the step-0 snapshot 17.2
    # against an ordinary batch's 2.31: the data's. Before, rolled back untested to step 0 (130 steps lost)
    assert flagged[-1] == {"step": 112, "event": "grad_spike", "cause": "recurring", "action": "skip"}
    assert guard.rollbacks == 0 and guard.steps_lost == 9  # the 3 flagged steps and 6 batches of NaN rows
