"""What StabilityGuard handed to its core, without a Trainer: the step record's loss and forced skip, a flagged
step's checks (where a non-finite step came from, the data check's losses, the rollback test), the summary
line and the guard's figures."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lightning_pulse.core.spike_detection import Verdict
from lightning_pulse.core.stability_policy import Action, EscalationPolicy
from lightning_pulse.core.stability_steps import (
    UNCHECKED_DATA_FAULTS,
    FlaggedStep,
    StabilityCore,
    StepRecord,
    caches_activations,
    flag_message,
    guard_figure,
)


def _core() -> StabilityCore:
    # rollback_after=2, no skips after a rollback, snapshot_every=10, 2 snapshots, no margin, 3 rollbacks
    return StabilityCore(None, 3.0, 3.0, 20, 5, 2, 0, 10, 2, 0, 3)


def _mse_losses(model: nn.Module):
    """Each ``(batch_idx, (x, y))`` pair's loss at ``model``'s weights, as ``probe.training_losses`` gives."""

    def losses_of(pairs):
        with torch.no_grad():
            return [float(nn.functional.mse_loss(model(x), y)) for _, (x, y) in pairs]

    return losses_of


def _flagged(model, record, losses_of, losses_at=None, caches=False, step=5) -> FlaggedStep:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses_at = losses_at or (lambda target, flagged, reference: (math.nan, 1.0))
    return FlaggedStep(model, step, record, [optimizer], [], None, None, caches, losses_of, losses_at)


def test_decided_before_judging_takes_one_forced_skip_per_step_and_keeps_a_decision():
    policy = EscalationPolicy(rollback_after=2, spike_memory=10, skip_after_rollback=2)
    policy.skip_remaining = 2
    record = StepRecord()
    assert record.decided_before_judging(policy) is Action.SKIP and policy.skip_remaining == 1
    # LBFGS evaluates its closure again within the step: the same decision, no second skip taken
    assert record.decided_before_judging(policy) is Action.SKIP and policy.skip_remaining == 1
    assert record.end() is Action.SKIP
    assert record.decided_before_judging(policy) is Action.SKIP and policy.skip_remaining == 0
    record.end()
    assert record.decided_before_judging(policy) is None  # judged as usual
    record.decided = Action.APPLY
    policy.skip_remaining = 1
    assert record.decided_before_judging(policy) is Action.APPLY and policy.skip_remaining == 1


def test_caches_activations_only_where_a_callback_holds_a_cache():
    assert not caches_activations([SimpleNamespace(), SimpleNamespace(activations=None)])
    assert caches_activations([SimpleNamespace(), SimpleNamespace(activations={})])


def test_a_flagged_step_compares_at_a_snapshot_with_its_record_batches_and_reference():
    calls = []

    def losses_at(target, flagged, reference):
        calls.append((target, flagged, reference))
        return 4.0, 2.0

    record = StepRecord()
    record.batches.append((3, "flagged"))
    flagged = _flagged(nn.Linear(2, 1), record, lambda pairs: [], losses_at)
    assert not flagged.comparable  # no applied step yet
    record.reference = [(2, "ordinary")]
    assert flagged.comparable
    assert flagged.losses_at_snapshot("snapshot") == (4.0, 2.0)
    assert calls == [("snapshot", [(3, "flagged")], [(2, "ordinary")])]
    assert not _flagged(nn.Linear(2, 1), record, lambda pairs: [], losses_at, caches=True).comparable


def test_losses_for_a_check_gives_none_for_a_failure_and_warns_once_a_fit_on_out_of_memory():
    core, model, warnings = _core(), nn.Linear(2, 1), []

    def losses_of(pairs):
        ((index, _),) = pairs
        if index == 1:
            raise torch.OutOfMemoryError("out of memory (a test's)")
        if index == 2:
            raise ValueError("a shape fixed in the module")
        return [1.5] if index == 0 else []

    pairs = [(0, None), (1, None), (2, None), (3, None)]
    saved = core.saved_forward_state(model)
    assert core.losses_for_a_check(model, saved, losses_of, warnings.append, pairs) == [1.5, None, None, None]
    core.losses_for_a_check(model, saved, losses_of, warnings.append, pairs)
    assert len(warnings) == 1 and "ran out of memory" in warnings[0] and "Said once per fit." in warnings[0]
    core.start(0)  # a new fit says it again
    core.losses_for_a_check(model, saved, losses_of, warnings.append, pairs)
    assert len(warnings) == 2


def _nan_row_step(model: nn.Module) -> StepRecord:
    x, y = torch.randn(4, 2, generator=torch.Generator().manual_seed(0)), torch.zeros(4, 1)
    x[1, 0] = float("nan")
    record = StepRecord()
    record.batches.append((0, (x, y)))
    record.trained = {0: torch.tensor([10, 11, 12, 13])}  # a callback cut the batch: its dataset indices
    record.loss, record.key = math.nan, "all"
    return record


def test_nonfinite_cause_finds_bad_data_by_the_loss_without_its_rows():
    torch.manual_seed(0)
    model, core, warnings = nn.Linear(2, 1), _core(), []
    record = _nan_row_step(model)
    assert core.nonfinite_cause(_flagged(model, record, _mse_losses(model)), warnings.append) == "data"
    assert core.bad_samples == [{"step": 5, "batch_idx": 0, "rows": [1], "indices": [11]}]
    assert core.unchecked_data_faults == 0  # checked: the loss without row 1 is finite
    assert len(warnings) == 1 and "step 5 has non-finite values in its data" in warnings[0]
    # under an activation cache no forward runs: presumed the data's, unchecked
    assert core.nonfinite_cause(_flagged(model, record, _mse_losses(model), caches=True), warnings.append)
    assert core.unchecked_data_faults == 1
    with torch.no_grad():
        model.weight.fill_(math.nan)
    assert core.nonfinite_cause(_flagged(model, record, _mse_losses(model)), warnings.append) == "state"


def test_nonfinite_cause_tests_unchecked_bad_data_at_a_snapshot_once_no_longer_presumed():
    torch.manual_seed(0)
    model, core, warnings = nn.Linear(2, 1), _core(), []
    core.take_snapshot(0, model, [torch.optim.SGD(model.parameters(), lr=0.1)], [], {})
    record = _nan_row_step(model)
    record.reference = [(9, "ordinary")]

    def unchecked(pairs):
        raise RuntimeError("the module fails on the batch checked")

    core.unchecked_data_faults = UNCHECKED_DATA_FAULTS
    at_snapshot = [(math.nan, 1.0)]  # non-finite at the snapshot too: the data's
    flagged = _flagged(model, record, unchecked, lambda target, flagged, reference: at_snapshot[0])
    assert core.nonfinite_cause(flagged, warnings.append) == "data"
    assert core.unchecked_data_faults == UNCHECKED_DATA_FAULTS + 1
    assert "like the 8 non-finite steps before it" in warnings[0] and len(warnings) == 2  # and the data's
    at_snapshot[0] = (2.0, 1.0)  # finite at the snapshot: the model's
    assert core.nonfinite_cause(flagged, warnings.append) is None
    assert len(warnings) == 2  # the presumption's end is said once a fit


def test_flagged_rollback_helps_compares_the_records_loss_at_the_snapshot():
    torch.manual_seed(0)
    model, core = nn.Linear(2, 1), _core()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    core.take_snapshot(0, model, [optimizer], [], {})
    record = StepRecord()
    record.batches, record.reference = [(3, "flagged")], [(2, "ordinary")]
    record.loss, record.key = 50.0, "all"
    losses = [(40.0, 1.0)]  # the batch spikes at the snapshot's weights too: the data's, no rollback
    flagged = _flagged(model, record, lambda pairs: [], lambda target, flagged, reference: losses[0], step=30)
    assert not core.flagged_rollback_helps(flagged, Verdict.LOSS_SPIKE)
    losses[0] = (1.0, 1.0)  # ordinary there: damage since, a rollback to that snapshot helps
    assert core.flagged_rollback_helps(flagged, Verdict.LOSS_SPIKE) and core.rollback_to == 0
    # a gradient spike is tested only with a loss far above its key's baseline median (here 1.0)
    for step in range(3):
        core.judge(step, 1.0, 1.0, "all", lambda: None)
    losses[0] = (40.0, 1.0)
    assert not core.flagged_rollback_helps(flagged, Verdict.GRAD_SPIKE)
    record.key = "burst"  # no baseline there: the loss cannot count as spiked, and a rollback helps
    assert core.flagged_rollback_helps(flagged, Verdict.GRAD_SPIKE)
    record.reference = []  # nothing to compare with: it cannot tell, so it helps
    assert core.flagged_rollback_helps(flagged, Verdict.LOSS_SPIKE)


def test_summary_counts_the_steps_judged_in_this_fit():
    core = _core()
    core.start(0)
    for step in range(3):
        core.judge(step, 1.0, 2.0, "all", lambda: None)
    assert core.summary() == (
        "StabilityGuard: no spike or non-finite value in this fit's 3 optimizer step(s) (medians of the last "
        "20 at most: loss 1, grad norm 2)."
    )
    core.start(3)  # a new fit that judged nothing yet
    assert core.summary() is None


def test_summary_counts_this_fits_losses_a_log_scale_could_not_judge_and_gives_no_loss_median_then():
    """The log-scale loss window holds the positive losses only: with losses <= 0 its median is not the
    run's, so the line leaves it out and says how many went unjudged (a flag message labels it)."""
    core = _core()
    core.start(0)
    for step, loss in enumerate([4.0, -0.5, 0.0]):
        core.judge(step, loss, 2.0, "all", lambda: None)
    assert core.summary() == (
        "StabilityGuard: no spike or non-finite value in this fit's 3 optimizer step(s), but 2 of their "
        "losses were <= 0, which a log scale cannot judge, so a loss spike there would have gone unnoticed: "
        "pass `config=StabilityGuardConfig(loss_scale='linear')` for such losses (medians of the last 20 at "
        "most: grad norm 2; no loss median: on a log scale it would be of the positive losses only)."
    )
    assert "loss=4 of the positive losses, grad_norm=2" in flag_message(
        3, Verdict.GRAD_SPIKE, Action.SKIP, -0.5, 50.0, "all", core.detector
    )
    core.start(3)  # a new fit (a resumed one): the losses the last fit could not judge are not its own
    core.judge(3, 4.0, 2.0, "all", lambda: None)
    assert core.summary() == (
        "StabilityGuard: no spike or non-finite value in this fit's 1 optimizer step(s) (medians of the last "
        "20 at most: loss 4, grad norm 2)."
    )
    core.judge(4, 4.0, 2.0, "all", lambda: None)
    verdict, *_ = core.judge(5, -1.0, 1e4, "all", lambda: None)  # the spike line says them too
    assert verdict is Verdict.GRAD_SPIKE
    assert core.summary().endswith(
        "0 rollback(s), 0 step(s) of work lost. Also, 1 of this fit's losses was <= 0, which a log scale "
        "cannot judge, so a loss spike there would have gone unnoticed: pass "
        "`config=StabilityGuardConfig(loss_scale='linear')` for such losses."
    )


def test_guard_figure_reads_the_policy_and_cannot_be_set():
    class Holder:
        rollbacks = guard_figure("rollbacks")

        def __init__(self):
            self.policy = SimpleNamespace(rollbacks=4)

    holder = Holder()
    assert holder.rollbacks == 4 and Holder.rollbacks.__doc__ == "The policy's ``rollbacks`` (checkpointed)."
    holder.policy.rollbacks = 5
    assert holder.rollbacks == 5
    with pytest.raises(AttributeError):
        holder.rollbacks = 1
