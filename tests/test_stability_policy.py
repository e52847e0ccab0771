"""StabilityGuard's escalation without a Trainer: the policy's decisions and books, and the one-step changes."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_pulse.core.spike_detection import Verdict
from lightning_pulse.core.stability_policy import (
    Action,
    EscalationPolicy,
    StabilityGuardConfig,
    StepChanges,
    StepEnergy,
)
from lightning_pulse.core.stability_steps import guard_metrics


def test_policy_skips_then_rolls_back_then_stops():
    policy = EscalationPolicy(rollback_after=2, spike_memory=10, skip_after_rollback=3, max_rollbacks=1)
    assert policy.decide(0, Verdict.OK) is Action.APPLY
    assert policy.decide(5, Verdict.LOSS_SPIKE) is Action.SKIP
    assert policy.incident_start == 5
    assert policy.decide(6, Verdict.GRAD_SPIKE) is Action.ROLLBACK
    policy.rolled_back(6, to_step=0)
    assert not policy.in_incident
    assert [policy.forced_skip() for _ in range(4)] == [True, True, True, False]
    assert policy.decide(11, Verdict.NONFINITE_LOSS) is Action.SKIP
    assert policy.decide(12, Verdict.NONFINITE_LOSS) is Action.STOP  # one rollback already, max_rollbacks=1


def test_policy_forgets_spikes_and_rollbacks_outside_their_memories():
    policy = EscalationPolicy(rollback_after=2, spike_memory=10, max_rollbacks=1, rollback_memory=100)
    assert policy.decide(0, Verdict.LOSS_SPIKE) is Action.SKIP
    assert policy.decide(10, Verdict.LOSS_SPIKE) is Action.SKIP  # step 0 is 10 steps back: forgotten
    policy.rolled_back(11, to_step=0)
    assert policy.decide(200, Verdict.LOSS_SPIKE) is Action.SKIP
    assert policy.decide(201, Verdict.LOSS_SPIKE) is Action.ROLLBACK  # the rollback at 11 is forgotten
    restored = EscalationPolicy(rollback_after=2, spike_memory=10, max_rollbacks=1, rollback_memory=100)
    restored.load_state_dict(policy.state_dict())
    assert restored.spike_steps == [200, 201] and restored.rollback_steps == []


@pytest.mark.parametrize(
    "field", ["rollback_after", "spike_memory", "skip_after_rollback", "max_rollbacks", "rollback_memory"]
)
def test_policy_rejects_bad_arguments_naming_the_field(field):
    with pytest.raises(ValueError, match=f"`{field}`"):
        EscalationPolicy(**{field: -1})


def test_the_books_count_skipped_and_undone_steps_once_along_the_lineage():
    policy = EscalationPolicy(rollback_after=2, skip_after_rollback=1, lr_cooldown_steps=2)
    for _ in range(5):
        policy.finish(Action.APPLY, energy_kwh=1.0)
    snapshot = policy.lineage()  # taken after 5 applied steps
    for step in range(5, 8):
        policy.finish(policy.decide(step, Verdict.OK), energy_kwh=1.0)
    assert policy.decide(8, Verdict.LOSS_SPIKE) is Action.SKIP
    policy.finish(Action.SKIP, energy_kwh=1.0)
    assert policy.decide(9, Verdict.LOSS_SPIKE) is Action.ROLLBACK
    policy.finish(Action.ROLLBACK, energy_kwh=1.0)
    assert policy.rewind(snapshot) == 3  # steps 5-7 undone
    policy.rolled_back(9, to_step=5)
    assert (policy.steps_skipped, policy.steps_undone, policy.rollbacks) == (2, 3, 1)
    assert policy.energy_wasted_kwh == 5.0  # two dropped steps and three undone ones
    assert policy.forced_skip() and not policy.forced_skip()
    policy.finish(Action.SKIP)
    assert policy.cooldown_remaining == 2
    policy.finish(Action.APPLY)
    policy.finish(Action.APPLY)
    policy.finish(Action.APPLY)
    assert policy.cooldown_remaining == 0
    # going back to the same snapshot again does not count the first rollback's steps twice
    assert policy.rewind(snapshot) == 3 and policy.steps_undone == 6
    assert policy.spikes_by_kind["loss_spike"] == 2
    assert [e["event"] for e in policy.events] == ["loss_spike", "loss_spike", "rollback"]
    restored = EscalationPolicy(rollback_after=2, skip_after_rollback=1, lr_cooldown_steps=2)
    restored.load_state_dict(copy.deepcopy(policy.state_dict()))
    assert restored.state_dict() == policy.state_dict()


def test_a_snapshot_is_worth_taking_only_outside_incidents_and_their_skips():
    policy = EscalationPolicy(rollback_after=2, skip_after_rollback=1)
    assert policy.healthy
    policy.decide(3, Verdict.NONFINITE_GRAD)
    assert not policy.healthy
    policy.decide(4, Verdict.NONFINITE_GRAD)
    policy.rolled_back(4, to_step=0)
    assert not policy.healthy  # one skip pending
    policy.forced_skip()
    assert policy.healthy


def test_config_defaults_are_the_documented_ones_and_bad_fields_fail():
    config = StabilityGuardConfig()
    assert (config.min_ratio, config.loss_scale, config.spike_memory, config.rollback_memory) == (
        1.5,
        "log",
        50,
        1000,
    )
    with pytest.raises(ValueError, match="`snapshot_at_maintain`"):
        StabilityGuardConfig(snapshot_at_maintain=1)
    with pytest.raises(ValueError, match="`lr_factor_after_rollback`"):
        StabilityGuardConfig(lr_factor_after_rollback=0)


class CountingSGD(torch.optim.Optimizer):
    """Outside torch.optim, with a counter that moves without gradients (as schedule-free optimizers do)."""

    def __init__(self, params):
        super().__init__(params, {"lr": 0.1})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["k"] = group.get("k", 0) + 1
            for param in group["params"]:
                if param.grad is not None:
                    param.add_(param.grad, alpha=-group["lr"])
                    self.state[param]["seen"] = self.state[param].get("seen", 0) + 1


def _loss(model):
    model.zero_grad()
    model(torch.ones(2, 3)).sum().backward()


def test_a_skip_leaves_an_optimizer_outside_torch_optim_exactly_as_it_was():
    model = nn.Linear(3, 2)
    optimizer = CountingSGD(model.parameters())
    changes = StepChanges()
    changes.attach([optimizer])
    _loss(model)
    optimizer.step()
    before = (copy.deepcopy(optimizer.state_dict()), [p.detach().clone() for p in model.parameters()])
    _loss(model)
    changes.skip(optimizer)
    # zeroed, not None: such an optimizer may read every gradient in its step (SAM stacks their norms)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    optimizer.step()
    assert optimizer.state_dict() == before[0] and optimizer.param_groups[0]["k"] == 1
    assert all(torch.equal(p, saved) for p, saved in zip(model.parameters(), before[1]))
    # then None, as a step not taken leaves them: zeros beside the restored state read as a stepped
    # parameter to an LR scheduler (HF's AdafactorSchedule raised KeyError: 'step' on a fresh parameter)
    assert all(p.grad is None for p in model.parameters())
    _loss(model)
    optimizer.step()  # nothing pending: the next step trains
    assert optimizer.param_groups[0]["k"] == 2
    changes.detach()


@pytest.mark.parametrize("make_optimizer", [CountingSGD, torch.optim.SGD], ids=["outside", "torch.optim"])
def test_gradients_are_none_after_a_skip_from_a_backup_and_kept_after_an_applied_step(make_optimizer):
    # a held-out sweep: a skip from a backup left the zeroed gradients (HF Adafactor's schedule then read the
    # restored, empty state of a parameter it took for stepped); torch.optim's own skip sets None
    model = nn.Linear(3, 2)
    optimizer = make_optimizer(model.parameters())
    changes = StepChanges()
    changes.attach([optimizer])
    _loss(model)
    changes.hold(optimizer)  # a backup before a step that may still be skipped (SAM), dropped: applied
    optimizer.step()
    assert all(p.grad is not None and p.grad.any() for p in model.parameters())
    _loss(model)
    changes.skip(optimizer, keep_gradients=True)  # zeroed for clipping by value, undone from a backup
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    optimizer.step()
    assert all(p.grad is None for p in model.parameters())
    changes.detach()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
@pytest.mark.parametrize("make_optimizer", [torch.optim.NAdam, torch.optim.ASGD], ids=["NAdam", "ASGD"])
def test_a_skip_from_a_backup_gives_back_optimizer_state_kept_in_another_dtype(make_optimizer, dtype):
    # held-out sweep: the backup went back through Optimizer.load_state_dict, which casts every state tensor
    # but `step` to its parameter's dtype: under bf16-true NAdam's float32 `mu_product` came back rounded
    model = nn.Linear(3, 2).to(dtype)
    optimizer = make_optimizer(model.parameters(), lr=0.1, weight_decay=0.1)
    changes = StepChanges()
    changes.attach([optimizer])
    for _ in range(2):
        model.zero_grad()
        model(torch.ones(2, 3, dtype=dtype)).sum().backward()
        optimizer.step()
    before = copy.deepcopy(optimizer.state_dict()["state"])
    assert any(v.dtype == torch.float32 for fields in before.values() for v in fields.values())
    model.zero_grad()
    model(torch.ones(2, 3, dtype=dtype)).sum().backward()
    changes.skip(optimizer, keep_gradients=True)  # clipping by value reads the gradients: backed up
    optimizer.step()
    after = optimizer.state_dict()["state"]
    for key, fields in before.items():
        for field, value in fields.items():
            assert after[key][field].dtype == value.dtype and torch.equal(after[key][field], value), field
    changes.detach()


def test_a_skip_from_a_backup_leaves_a_frozen_parameter_unwritten():
    # a review: the backup's restore wrote every parameter back, a frozen one too, bumping its version
    # counter, so GradientCache's activation cache took it for a change and recorded its outputs again
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
    model[0].requires_grad_(False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    changes = StepChanges()
    changes.attach([optimizer])
    model(torch.ones(2, 3)).sum().backward()
    frozen_version, trained = model[0].weight._version, model[1].weight.detach().clone()
    changes.skip(optimizer, keep_gradients=True)  # clipping by value reads the gradients: backed up
    optimizer.step()
    assert model[0].weight._version == frozen_version and torch.equal(model[1].weight, trained)
    changes.detach()


def test_a_scaled_learning_rate_holds_inside_the_step_only():
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    seen = []
    changes = StepChanges()
    changes.attach([optimizer])
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: seen.append(opt.param_groups[0]["lr"]))
    _loss(model)
    changes.scale_lr(optimizer, 0.1)
    changes.scale_lr(
        optimizer, 0.1
    )  # the step decided again (LBFGS re-evaluates its closure): not compounded
    optimizer.step()
    assert seen == [pytest.approx(0.05)] and optimizer.param_groups[0]["lr"] == 0.5
    changes.scale_lr(optimizer, 0.1)
    changes.restore()  # the optimizer did not step (a GradScaler skipped it): put back by hand
    assert optimizer.param_groups[0]["lr"] == 0.5


def test_step_energy_is_the_meters_difference_and_a_failing_meter_is_dropped_with_one_warning():
    readings = iter([1.0, 1.5, 2.0, 2.25])
    energy = StepEnergy(lambda: next(readings))
    energy.begin()
    energy.begin()  # the second batch of an accumulation window: the step still starts at 1.0
    assert energy.end() == 1.5 - 1.0
    energy.begin()
    assert energy.end() == 0.25
    assert StepEnergy().end() == 0.0  # no meter

    def broken():
        raise RuntimeError("meter gone")

    warnings = []
    energy = StepEnergy(broken, warn=warnings.append)
    energy.begin()
    assert energy.end() == 0.0 and energy.read is None
    energy.begin()
    assert energy.end() == 0.0 and len(warnings) == 1 and "meter gone" in warnings[0]


def test_step_energy_leaves_out_a_pause_inside_the_step_and_ignores_one_between_steps():
    meter = [0.0]
    energy = StepEnergy(lambda: meter[0])
    energy.begin()
    meter[0] = 1.0  # the step's work
    energy.on_pulse_pause(None, True)
    meter[0] = 9.0  # the pause's idle draw (GreenWindow's batch end before the guard's)
    energy.on_pulse_pause(None, False)
    meter[0] = 9.5
    assert energy.end() == pytest.approx(1.5)
    energy.on_pulse_pause(None, True)  # between steps (GreenWindow after the guard): the next begin is later
    meter[0] = 20.0
    energy.on_pulse_pause(None, False)
    energy.begin()
    meter[0] = 21.0
    assert energy.end() == pytest.approx(1.0)
    StepEnergy().on_pulse_pause(None, True)  # no meter: nothing to do


def test_step_energy_reads_the_first_callback_with_an_energy_meter():
    class Meter:
        def __init__(self, kwh):
            self.energy_so_far_kwh = lambda: kwh

    no_meter = type("NoMeter", (), {"energy_so_far_kwh": 3.0})()  # not callable: not a meter
    energy = StepEnergy.of_callbacks([object(), no_meter, Meter(1.0), Meter(2.0)])
    assert energy.read is not None and energy.read() == 1.0
    assert StepEnergy.of_callbacks([object()]).read is None


def test_the_policy_counts_spikes_of_every_kind_and_the_steps_lost():
    policy = EscalationPolicy(rollback_after=2, skip_after_rollback=1)
    policy.decide(3, Verdict.LOSS_SPIKE)
    policy.decide(4, Verdict.GRAD_SPIKE)
    assert policy.spikes_detected == 2
    policy.finish(Action.SKIP)
    policy.finish(Action.APPLY)
    policy.finish(Action.APPLY)
    assert policy.rewind({"lineage_steps": 0, "lineage_energy_kwh": 0.0}) == 2
    assert policy.steps_lost == 1 + 2  # skipped, then undone


def test_a_data_fault_is_skipped_and_never_escalates_while_a_bad_model_state_rolls_back_at_once():
    policy = EscalationPolicy(rollback_after=2, max_rollbacks=1)
    actions = [policy.decide(step, Verdict.NONFINITE_LOSS, cause="data") for step in range(10)]
    assert actions == [Action.SKIP] * 10 and not policy.in_incident
    assert policy.bad_batches == 10 and policy.spikes_by_kind["nonfinite_loss"] == 10
    assert policy.events[0] == {"step": 0, "event": "nonfinite_loss", "action": "skip", "cause": "data"}
    # the model's own state went bad: the first such step rolls back; with no rollback left, it stops
    assert policy.decide(10, Verdict.NONFINITE_GRAD, cause="state") is Action.ROLLBACK
    policy.rolled_back(10, to_step=0)
    policy.skip_remaining = 0
    assert policy.decide(11, Verdict.NONFINITE_LOSS, cause="state") is Action.STOP
    restored = EscalationPolicy()
    restored.load_state_dict(policy.state_dict())
    assert restored.bad_batches == 10
    with pytest.raises(ValueError, match="`cause`"):
        policy.decide(12, Verdict.NONFINITE_LOSS, cause="cosmic ray")


def test_a_rollback_that_cannot_help_becomes_a_skip_that_ends_the_incident():
    policy = EscalationPolicy(rollback_after=2, max_rollbacks=0)  # a needed rollback would stop the run
    asked = []

    def cannot_help() -> bool:
        asked.append(True)
        return False

    assert policy.decide(5, Verdict.LOSS_SPIKE, rollback_helps=cannot_help) is Action.SKIP
    assert not asked  # asked only where the step would roll back or stop
    assert policy.decide(6, Verdict.OK) is Action.APPLY
    assert policy.decide(7, Verdict.LOSS_SPIKE, rollback_helps=cannot_help) is Action.SKIP
    assert asked and policy.healthy and policy.recurring_spikes == 2
    assert policy.events[-1]["cause"] == "recurring"
    assert policy.decide(9, Verdict.LOSS_SPIKE, rollback_helps=lambda: True) is Action.SKIP
    assert policy.decide(11, Verdict.LOSS_SPIKE, rollback_helps=lambda: True) is Action.STOP
    # every batch of a row failing is not a few bad samples: it escalates without asking
    asked.clear()
    policy = EscalationPolicy(rollback_after=2)
    assert policy.decide(20, Verdict.LOSS_SPIKE, rollback_helps=cannot_help) is Action.SKIP
    assert policy.decide(21, Verdict.LOSS_SPIKE, rollback_helps=cannot_help) is Action.ROLLBACK and not asked
    # a model state gone non-finite rolls back whatever the test says
    policy = EscalationPolicy(rollback_after=3)
    assert policy.decide(1, Verdict.NONFINITE_LOSS, "state", rollback_helps=cannot_help) is Action.ROLLBACK
    restored = EscalationPolicy()
    restored.load_state_dict({**EscalationPolicy().state_dict(), "recurring_spikes": 4})
    assert restored.recurring_spikes == 4


@pytest.mark.parametrize(
    ("then", "reference", "now", "reproduced"),
    [
        (300.0, 0.2, 375.0, True),  # an outlier target: the same spike on a trained snapshot
        (230.0, 8.0, 358.0, True),  # and on the untrained one, where every loss is high
        (0.3, 0.005, 12.6, False),  # a rare class, hard but learnt there; 40x worse now: damage since
        (1.0, 0.9, 1.2, False),  # ordinary there: not the batch
        (float("inf"), 1.0, float("inf"), True),  # infinite there too (log(0) on a sample)
        (float("nan"), 1.0, 5.0, True),
        (50.0, 1.0, float("inf"), False),  # non-finite now, finite there: the model went bad
        (5.0, float("nan"), 5.0, False),  # nothing to compare with: escalate as before
        (5.0, 0.0, 5.0, False),
        (2.0, 1.0, 2.2, False),  # within 4x, but not min_ratio squared above an ordinary batch there
        (2.5, 1.0, 2.2, True),
    ],
)
def test_spike_reproduced(then, reference, now, reproduced):
    from lightning_pulse.core.stability_steps import spike_reproduced

    assert spike_reproduced(then, reference, now, min_ratio=1.5) is reproduced


def test_the_rollback_test_goes_to_the_first_snapshot_where_the_batch_is_ordinary_and_tests_no_further():
    from types import SimpleNamespace

    from lightning_pulse.core.stability_steps import rollback_test

    newest, oldest = SimpleNamespace(step=200), SimpleNamespace(step=0)
    asked = []

    def losses(spiking_on):
        def at(target):
            asked.append(target.step)
            return (300.0 if target.step in spiking_on else 0.3), 0.2

        return at

    assert rollback_test([newest, oldest], losses({200, 0}), 375.0, 1.5) == (False, None)
    assert asked == [200, 0]
    asked.clear()
    assert rollback_test([newest, oldest], losses({200}), 375.0, 1.5) == (True, 0)  # damage since the oldest
    asked.clear()
    assert rollback_test([newest, oldest], losses(set()), 375.0, 1.5) == (True, 200) and asked == [200]
    assert rollback_test([], losses(set()), 375.0, 1.5) == (True, None)  # nothing to test: escalate


def test_holding_swaps_weights_and_buffers_in_and_puts_every_bit_back():
    from lightning_pulse.core.snapshots import holding, take_snapshot

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    model(torch.randn(8, 4))
    earlier = take_snapshot(3, model)
    with torch.no_grad():
        model[0].weight.add_(1.0)
    model(torch.randn(8, 4))  # the running statistics move on
    before = copy.deepcopy(model.state_dict())
    with holding(earlier, model):
        assert all(torch.equal(model.state_dict()[k], v) for k, v in earlier.model.items())
        model(torch.randn(8, 4))  # a training-mode forward inside moves the buffers again
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


def test_the_guards_core_detects_rolls_a_model_back_and_checkpoints_without_a_trainer():
    """StabilityCore, the guard's algorithm as one object: a loss spike after a healthy stretch rolls the model,
    the optimizer and the detector's windows back to the snapshot before it, and its state round-trips."""
    from lightning_pulse.core.stability_steps import StabilityCore

    def make_core():
        return StabilityCore(StabilityGuardConfig(), 6.0, 8.0, 20, 5, 1, 2, 5, 2, 0, 3)

    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    core = make_core()
    state = ([optimizer], [], {})
    core.take_snapshot(0, model, *state)
    kept = {}
    for step in range(12):
        verdict, action, _, _ = core.judge(step, 1.0 + 0.01 * (step % 3), 1.0, "all", lambda: None)
        assert (verdict, action) == (Verdict.OK, Action.APPLY)
        with torch.no_grad():
            model.weight.add_(0.1)
        core.policy.finish(action)
        if core.schedule.due(step + 1, core.policy.healthy):
            core.take_snapshot(step + 1, model, *state)
            kept[step + 1] = model.weight.detach().clone()
    assert sorted(kept) == [5, 10] and core.schedule.ring.steps == [5, 10]
    with torch.no_grad():
        model.weight.add_(100.0)  # the damage of step 12, flagged by its loss
    verdict, action, _, _ = core.judge(12, 500.0, 1.0, "all", lambda: None)
    assert (verdict, action) == (Verdict.LOSS_SPIKE, Action.ROLLBACK)
    core.policy.finish(action)
    warnings: list[str] = []
    target, undone = core.return_to_snapshot(model, state, 12, warnings.append)
    assert target.step == 10 and undone == 2 and not warnings
    assert torch.equal(model.weight, kept[10])
    restored = make_core()
    restored.load_state_dict(core.state_dict())
    assert restored.state_dict() == core.state_dict()
    assert restored.detector.baseline("all") == core.detector.baseline("all")


def test_the_step_record_keeps_an_applied_steps_batches_as_the_rollback_tests_reference():
    from lightning_pulse.core.stability_steps import StepRecord

    record = StepRecord()
    record.batches.append((0, "a"))
    record.losses.append(1.0)
    assert record.end() is None  # inside an accumulation window: nothing decided, nothing let go
    record.batches.append((1, "b"))
    record.losses.append(2.0)
    assert record.take_losses() == [1.0, 2.0] and record.take_losses() == []
    record.decided = Action.APPLY
    assert record.end() is Action.APPLY and record.decided is None
    assert record.reference == [(0, "a"), (1, "b")] and record.batches == []
    record.batches.append((2, "c"))
    record.decided = Action.SKIP
    assert record.end() is Action.SKIP and record.reference == [(0, "a"), (1, "b")] and record.batches == []


def test_the_guards_core_books_steps_snapshots_when_due_and_starts_each_fit_afresh():
    from lightning_pulse.core.stability_steps import StabilityCore
    from lightning_pulse.phase import Phase, PhaseChange

    core = StabilityCore(None, 6.0, 8.0, 20, 5, 1, 2, 5, 2, 0, 3)
    model = nn.Linear(3, 1)
    core.take_snapshot(0, model, [], [], {})
    assert [core.finish_step(Action.APPLY, step, 0.5) for step in range(1, 6)] == [False] * 4 + [True]
    assert core.policy.lineage_steps == 5 and core.policy.lineage_energy_kwh == 2.5
    maintain = PhaseChange(Phase.BURST, Phase.MAINTAIN, 0, 6, "budget")
    core.request_maintain_snapshot(maintain, {"val_loss": float("nan")})  # a non-finite probe: no snapshot
    assert not core.schedule.pending
    core.request_maintain_snapshot(PhaseChange(None, Phase.MAINTAIN, 0, 6, "resume"), {})
    assert not core.schedule.pending
    core.request_maintain_snapshot(maintain, {"val_loss": 0.3})
    assert core.schedule.pending
    # the maintain entry came with a flagged step: no snapshot at its end, and the request is dropped
    assert not core.finish_step(Action.SKIP, 6, 0.25) and not core.schedule.pending
    assert core.policy.steps_skipped == 1 and core.policy.energy_wasted_kwh == 0.25
    core.request_maintain_snapshot(maintain, {})
    core.rollback_to = 0
    core.start()
    assert not core.schedule.pending and core.rollback_to is None and len(core.schedule.ring) == 0


def test_the_guards_core_mends_a_data_faults_forward_state_and_warns_at_the_first_bad_batch_only():
    from lightning_pulse.core.stability_steps import StabilityCore

    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    core = StabilityCore(None, 6.0, 8.0, 20, 5, 1, 2, 5, 2, 0, 3)
    core.take_snapshot(0, model, [], [], {})
    with torch.no_grad():
        model[1].running_mean.fill_(float("nan"))  # what a bad row's forward writes
    samples = [{"step": 4, "batch_idx": 0, "rows": [2], "indices": None}]
    warning = core.data_fault(model, 4, samples)
    assert warning.startswith("StabilityGuard: step 4 has non-finite values in its data")
    assert "1.running_mean" in warning and torch.equal(model[1].running_mean, torch.zeros(4))
    assert core.bad_samples == samples
    core.policy.decide(4, Verdict.NONFINITE_LOSS, cause="data")  # the policy counts the bad batch
    assert core.data_fault(model, 5, samples) is None and len(core.bad_samples) == 2


def test_the_guards_core_concludes_a_rollback_or_a_stop_with_its_message_and_checkpoint_path(tmp_path):
    from lightning_pulse.core.snapshots import take_snapshot
    from lightning_pulse.core.stability_steps import StabilityCore

    model = nn.Linear(3, 1)
    target = take_snapshot(10, model)
    core = StabilityCore(None, 6.0, 8.0, 20, 5, 1, 2, 5, 2, 0, 3)
    message, path = core.conclude_rollback(Action.ROLLBACK, 14, target, 3, str(tmp_path))
    assert path is None and core.policy.rollbacks == 1 and not core.policy.stopped
    assert message.startswith("StabilityGuard: rollback 1 at step 14 to the snapshot of step 10 (3 applied")
    message, path = core.conclude_rollback(Action.STOP, 30, target, 0, str(tmp_path))
    assert path == str(tmp_path / "stability_guard" / "stopped-step=30.ckpt") and core.policy.stopped
    assert message.startswith(
        "StabilityGuard stopped training at step 30: spikes kept coming after 1 rollback"
    )
    assert core.policy.events[-1] == {"step": 30, "event": "stop", "to_step": 10}
    # a rollback that found no snapshot fitting the model cannot help: it stops too
    message, path = core.conclude_rollback(Action.ROLLBACK, 40, None, 0, str(tmp_path))
    assert "no snapshot fits the model any more" in message and path.endswith("stopped-step=40.ckpt")
    assert core.policy.rollbacks == 1 and core.policy.events[-1]["to_step"] is None


def test_the_guards_core_leaves_a_non_finite_state_out_of_its_snapshots_and_returns_to_a_finite_one():
    """A NaN in a branch the loss does not use leaves the loss finite: the snapshots taken then held it,
    evicted the finite ones from the ring, and a rollback returned to them. Now such a state is left out (said
    once a stretch, also when only another rank holds it): a NaN or infinity in a parameter or the optimizer
    state, a NaN in a buffer; a ``-inf`` mask buffer is not."""
    from lightning_pulse.core.stability_steps import StabilityCore

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    model.register_buffer("mask", torch.tensor([0.0, float("-inf")]))  # by design
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(8, 3)).sum().backward()
    optimizer.step()
    core = StabilityCore(None, 6.0, 8.0, 20, 5, 1, 2, 5, 2, 0, 3)  # every 5 steps, 2 kept, no margin
    state, warnings = ([optimizer], [], {}), []
    assert core.take_snapshot(0, model, *state, warnings.append) and core.take_snapshot(5, model, *state)
    finite = copy.deepcopy(model.state_dict())
    optimizer.state[model[2].weight]["exp_avg"][0, 0] = float("nan")  # a NaN only the optimizer state holds
    assert not core.take_snapshot(10, model, *state, warnings.append)
    with torch.no_grad():
        model[1].running_var.fill_(float("nan"))
    assert not core.take_snapshot(15, model, *state, warnings.append)
    assert core.schedule.ring.steps == [0, 5] and core.schedule.taken == 2
    assert len(warnings) == 1 and warnings[0].startswith(
        "StabilityGuard: no snapshot at step 10: exp_avg of 2.weight holds non-finite values"
    )
    assert core.left_out == (10, ["exp_avg of 2.weight"])
    assert not core.schedule.due(19, True) and core.schedule.due(20, True)  # a period later, not every step
    target, _ = core.return_to_snapshot(model, state, 20, warnings.append)
    assert target.step == 5 and core.left_out is None and len(warnings) == 1
    assert all(torch.equal(model.state_dict()[k], v) for k, v in finite.items())
    assert all(torch.isfinite(t).all() for t in optimizer.state[model[2].weight].values())
    # a state non-finite on another rank only is left out on every rank
    assert not core.take_snapshot(20, model, *state, warnings.append, all_reduce_sum=lambda flag: flag + 1)
    assert warnings[-1].startswith("StabilityGuard: no snapshot at step 20: tensors (on another rank) hold")
    assert core.take_snapshot(25, model, *state, all_reduce_sum=lambda flag: flag)
    assert core.schedule.ring.steps == [5, 25]


def test_with_no_finite_snapshot_a_rollback_stops_naming_the_non_finite_tensors(tmp_path):
    from lightning_pulse.core.stability_steps import StabilityCore

    model = nn.Linear(3, 1)
    with torch.no_grad():
        model.bias.fill_(float("nan"))  # e.g. resumed from a checkpoint that held it
    core = StabilityCore(None, 6.0, 8.0, 20, 5, 1, 2, 5, 2, 0, 3)
    assert not core.take_snapshot(0, model, [], [], {}) and len(core.schedule.ring) == 0
    warnings: list[str] = []
    assert core.return_to_snapshot(model, ([], [], {}), 7, warnings.append) == (None, 0)
    assert warnings == [
        "StabilityGuard: no snapshot with a finite state is held: none was taken since step 0 (a non-finite "
        "state); the parameters stay as they are."
    ]
    message, path = core.conclude_rollback(Action.ROLLBACK, 7, None, 0, str(tmp_path))
    assert message.startswith(
        "StabilityGuard stopped training at step 7: it had to roll back, but it holds no snapshot with a "
        "finite state that fits the model: the snapshots since step 0 were left out because bias held "
        "non-finite values"
    )
    assert path.endswith("stopped-step=7.ckpt") and core.policy.stopped


def test_the_guards_core_screens_the_optimizer_state_of_each_parameter_outside_the_model():
    """The optimizer state of every parameter outside the model was named "exp_avg of a parameter outside the
    model", so each overwrote the one before and only the last was screened: a NaN in the first one's state
    was snapshotted."""
    from lightning_pulse.core.stability_steps import StabilityCore

    model, outside = nn.Linear(2, 2), [nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))]
    optimizer = torch.optim.Adam([*model.parameters(), *outside])
    (model(torch.ones(1, 2)).sum() + sum(p.sum() for p in outside)).backward()
    optimizer.step()
    optimizer.state[outside[0]]["exp_avg"].fill_(float("nan"))
    core, warnings = StabilityCore(None, 6.0, 8.0, 20, 5, 1, 2, 5, 2, 0, 3), []
    assert not core.take_snapshot(0, model, [optimizer], [], {}, warnings.append)
    assert core.left_out == (0, ["exp_avg of parameter 2 of optimizer 0 (outside the model)"])
    assert len(core.schedule.ring) == 0 and len(warnings) == 1


def test_the_guards_core_says_why_no_snapshot_was_left_to_return_to():
    """A rollback that found no snapshot said "no finite snapshot is held" whenever one had been left out,
    also with finite ones held that no longer fit the model; a parameter infinite by design got the advice for
    a NaN branch only."""
    from lightning_pulse.core.stability_steps import StabilityCore

    model = nn.Sequential(nn.Linear(3, 2))
    core, warnings = StabilityCore(None, 6.0, 8.0, 20, 5, 1, 2, 5, 2, 0, 3), []
    assert core.take_snapshot(0, model, [], [], {})
    model.mask = nn.Parameter(torch.tensor([0.0, float("-inf")]), requires_grad=False)  # new structure too
    assert not core.take_snapshot(5, model, [], [], {}, warnings.append)
    assert warnings[0].startswith("StabilityGuard: no snapshot at step 5: mask holds non-finite values.")
    assert (
        "A parameter infinite by design (a mask held as an `nn.Parameter`) belongs in a buffer" in warnings[0]
    )
    assert core.return_to_snapshot(model, ([], [], {}), 7, warnings.append) == (None, 0)
    assert warnings[1] == (
        "StabilityGuard: no snapshot fits the model any more (or its optimizers' classes, parameter "
        "groups or parameters, or its LR schedulers), and none was taken since step 5 (a non-finite state); "
        "the parameters stay as they are."
    )


def test_steps_begun_before_the_meters_first_reading_have_unknown_energy_not_a_measured_zero():
    # a stand-in EnergyLogger: its meter (codecarbon) still starting reads 0 until its first reading
    class Account:
        counted = False

        def has_reading(self):
            return self.counted

    class Logger:
        account, kwh = Account(), 0.0

        def energy_so_far_kwh(self):
            return self.kwh

    logger = Logger()
    energy = StepEnergy.of_callbacks([object(), logger])
    policy = EscalationPolicy()
    energy.begin()
    policy.finish(Action.APPLY, energy.end())  # applied, unknown: in the lineage
    snapshot = policy.lineage()
    energy.begin()
    policy.finish(Action.APPLY, energy.end())
    energy.begin()
    policy.finish(Action.SKIP, energy.end())  # lost, unknown: not a measured 0
    assert policy.steps_lost_unmetered == 1 and policy.energy_wasted_kwh == 0.0
    logger.account.counted = True
    energy.begin()
    logger.kwh = 0.5
    policy.finish(Action.SKIP, energy.end())  # lost after the first reading: measured
    assert policy.energy_wasted_kwh == 0.5 and policy.steps_lost_unmetered == 1
    policy.rewind(snapshot)  # undoes one applied step of unknown energy
    assert policy.steps_lost_unmetered == 2
    metrics = guard_metrics(policy, with_energy=True)
    assert metrics["stability/energy_wasted_kwh"] == 0.5 and metrics["stability/steps_lost_unmetered"] == 2.0
    assert "stability/steps_lost_unmetered" not in guard_metrics(EscalationPolicy(), True)
