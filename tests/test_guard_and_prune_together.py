"""StabilityGuard and a structured ScheduledPrune in one run: no pruning event in a step the guard drops."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pulse import PulseCycle, ScheduledPrune, StabilityGuard, StabilityGuardError
from lightning_pulse.core import pruning
from lightning_pulse.core.prune_events import PruneEvents
from lightning_pulse.core.prune_schedule import PruneSchedule
from lightning_pulse.core.stability_policy import Action
from lightning_pulse.core.stability_steps import StepRecord, no_snapshot_message
from lightning_pulse.phase import Phase, PhaseChange
from lightning_pulse.protocols import StepUndoer
from tests.conftest import trainer_kwargs


class _NaNLossAt(pl.LightningModule):
    """An MLP whose loss is NaN at the given optimizer steps (a divergence the guard rolls back)."""

    def __init__(self, nan_steps: tuple[int, ...]) -> None:
        super().__init__()
        # wide enough that each event cuts channels (0.4875 then 0.5 of 64 rounds to 31 then 32)
        layers = [nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU()]
        self.net = nn.Sequential(*layers, nn.Linear(32, 4))
        self.nan_steps = set(nan_steps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        return loss * float("nan") if self.global_step in self.nan_steps else loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def _rows() -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(512, 16, generator=generator)
    y = (x[:, :4].argmax(dim=1)).long()
    return DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True, generator=generator)


@pytest.mark.parametrize("guard_first", [False, True])
def test_a_rollback_at_a_maintain_entry_defers_the_cut_to_the_next_applied_step(guard_first, tmp_path):
    # held-out sweep: NaN losses at steps 14-16 made the guard decide a rollback at step 16, the batch before
    # a maintain entry. With PulseCycle listed first (as in the shipped YAML), its phase change reached
    # ScheduledPrune, which cut channels (from the diverged weights) before the guard's batch end rolled back;
    # the guard then found no snapshot that fitted and stopped the fit, blaming a cut "outside ScheduledPrune"
    pl.seed_everything(0)
    cycle = PulseCycle(burst=3, replay=2, maintain=1, warmup=0, anneal=0, probe_batches=1)
    guard = StabilityGuard(
        warmup=5, window=10, snapshot_every=4, rollback_after=3, rollback_margin=2, skip_after_rollback=1
    )
    prune = ScheduledPrune(final_sparsity=0.5, mode="structured", start=2, end=14, probe_batches=0)
    callbacks = [guard, cycle, prune] if guard_first else [cycle, guard, prune]
    trainer = pl.Trainer(max_steps=30, callbacks=callbacks, **trainer_kwargs(default_root_dir=tmp_path))
    model = _NaNLossAt(nan_steps=(14, 15, 16))
    trainer.fit(model, _rows())  # rolls back, does not stop
    assert guard.policy.rollback_steps == [16] and not guard.stopped
    assert trainer.global_step == 30
    # the maintain entry of step 17 came in the rolled-back step: the cut waits for step 18, the skip after
    # the rollback (on the snapshot's weights, which the guard snapshots cut),
    # and reaches the planned sparsity
    assert [event["step"] for event in prune.events] == [5, 11, 18]
    assert prune.sparsity == pytest.approx(0.5) and prune.finished
    assert [model.net[i].out_features for i in (0, 2, 4)] == [32, 32, 16]  # half the channels
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("guard_first", [False, True])
def test_a_rollback_on_the_step_cadence_defers_the_due_cut_to_the_next_applied_step(guard_first, tmp_path):
    # no PulseCycle: the event due at the end of the rolled-back step waits as the maintain entry's does
    pl.seed_everything(0)
    guard = StabilityGuard(
        warmup=5, window=10, snapshot_every=4, rollback_after=3, rollback_margin=2, skip_after_rollback=1
    )
    prune = ScheduledPrune(final_sparsity=0.5, mode="structured", start=5, end=17, every=6, probe_batches=0)
    callbacks = [guard, prune] if guard_first else [prune, guard]
    trainer = pl.Trainer(max_steps=30, callbacks=callbacks, **trainer_kwargs(default_root_dir=tmp_path))
    trainer.fit(_NaNLossAt(nan_steps=(14, 15, 16)), _rows())
    assert guard.policy.rollback_steps == [16] and not guard.stopped
    # chances at 5 (target 0: no event), 11 and 17, the end, which the rollback of step 16 moves to 18
    assert [event["step"] for event in prune.events] == [11, 18]
    assert prune.sparsity == pytest.approx(0.5) and prune.finished


def test_the_guard_says_which_step_it_drops_in_flight_and_after_its_batch_end():
    record = StepRecord()
    record.take_losses(17)  # at the step's optimizer hook, which decides it; its batch end to come
    record.decided = Action.ROLLBACK
    assert record.undoes(17)
    assert record.end() is Action.ROLLBACK
    assert record.undoes(17) and not record.undoes(18)  # listed before the asker: its batch end ran first
    record.take_losses(18)
    record.decided = Action.APPLY
    assert not record.undoes(18)
    record.end()
    assert not record.undoes(18) and record.applied(18) and not record.applied(17)
    record.take_losses(19)
    record.forced, record.decided = True, Action.SKIP  # a skip after a rollback, in flight
    assert record.undoes(19) and not record.undoes(19, forced_skips=False)
    assert not record.undoes(20)  # the step in flight is 19's: another step's answer is not this one's
    assert isinstance(StabilityGuard(), StepUndoer)


def _events() -> PruneEvents:
    schedule = PruneSchedule(0.5, 0.0, 2, 14, 100)
    schedule.resolve(30)
    core = PruneEvents(schedule, pruning.Pruner("unstructured"), None)
    core.uses_maintain = True
    return core


def test_a_deferred_maintain_event_survives_a_checkpoint_and_the_rollback_of_its_own_step():
    entry = PhaseChange(Phase.REPLAY, Phase.MAINTAIN, 2, 17, "budget", 2, 0.0)
    core = _events()
    assert core.after_phase_change(entry, undone=True) == (False, False)
    assert core.event_due(17) and core.deferred
    snapshot_before = _events().state_dict()  # taken before the deferral
    core.load_state_dict(snapshot_before, rollback=True)  # the rollback of the step that deferred it
    assert core.event_due(18)
    resumed = _events()
    resumed.load_state_dict(core.state_dict())  # a checkpoint saved meanwhile
    assert resumed.event_due(19)
    assert resumed.advance(19) == pytest.approx(0.5) and not resumed.event_due(20)
    # an applied maintain entry takes its event at once, as before
    assert _events().after_phase_change(entry, undone=False) == (False, True)


def test_the_stop_after_a_cut_by_scheduled_prune_names_it_and_no_snapshot_every():
    message = no_snapshot_message(16, "stopped.ckpt", cut_at=17)
    assert (
        "channels were cut at step 17 (ScheduledPrune" in message and "outside ScheduledPrune" not in message
    )
    # no ordering advice: the guard snapshots a cut in either order; the stop needs a cut in a dropped step
    assert "would not help" in message and "List StabilityGuard" not in message
    assert "whose update the guard dropped" in message


def _fit(order: str, nan_steps: tuple[int, ...], tmp_path, max_steps: int = 30, **guard_options):
    """A guard (``g``), a ScheduledPrune (``p``; events at 11 and 17, the end) and, with ``c``, a PulseCycle
    whose maintain entries (5, 11, 17) are its chances, else every 6 steps, listed in ``order``."""
    pl.seed_everything(0)
    options = {"warmup": 5, "window": 10, "snapshot_every": 4, "rollback_after": 3, "rollback_margin": 2}
    mode = guard_options.pop("mode", "structured")
    guard = StabilityGuard(**{**options, "skip_after_rollback": 1, **guard_options})
    every = {} if "c" in order else {"every": 6}
    prune = ScheduledPrune(final_sparsity=0.5, mode=mode, start=5, end=17, probe_batches=0, **every)
    cycle = PulseCycle(burst=3, replay=2, maintain=1, warmup=0, anneal=0, probe_batches=1)
    callbacks = [{"g": guard, "p": prune, "c": cycle}[key] for key in order]
    trainer = pl.Trainer(
        max_steps=max_steps, callbacks=callbacks, **trainer_kwargs(default_root_dir=tmp_path)
    )
    model = _NaNLossAt(nan_steps)
    trainer.fit(model, _rows())
    return guard, prune, model


@pytest.mark.parametrize("order", ["gp", "pg"])
def test_a_flagged_step_right_after_a_cut_rolls_back_to_the_cut_in_either_order(order, tmp_path):
    # review of the deferral: with the guard listed first, the cut at 17 came after its batch end, the guard
    # asked for a snapshot at the end of step 18, which was flagged and dropped the request; the rollback at
    # 19 found only uncut snapshots and stopped the fit. Now the guard snapshots
    # the cut before step 18's forward
    guard, prune, model = _fit(order, (17, 18, 19), tmp_path)
    assert not guard.stopped and guard.policy.rollback_steps == [19]
    assert [(e["step"], e["to_step"]) for e in guard.events if e["event"] == "rollback"] == [(19, 17)]
    assert [event["step"] for event in prune.events] == [11, 17] and prune.finished
    assert [model.net[i].out_features for i in (0, 2, 4)] == [32, 32, 16]


@pytest.mark.parametrize("order", ["cpg", "cgp"])
def test_a_cut_inside_an_open_incident_starts_a_new_one_that_can_roll_back(order, tmp_path):
    # review: a flagged step at 14, the cut at the maintain entry of 17, then flagged steps at 30-32. The
    # incident opened at 14 kept every snapshot away, so the rollback at 31 found only uncut ones and stopped
    # the run, though 13 healthy steps came after the cut. The cut now starts a new incident: the step after
    # it is snapshotted, and the flagged steps 30-32 make a rollback of their own, back to a cut snapshot
    guard, prune, model = _fit(order, (14, 30, 31, 32), tmp_path, max_steps=40)
    assert not guard.stopped and guard.policy.rollback_steps == [32]
    (to_step,) = [e["to_step"] for e in guard.events if e["event"] == "rollback"]
    assert 17 <= to_step <= 30  # a snapshot of the cut model
    assert [event["step"] for event in prune.events] == [11, 17] and prune.finished
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("mode", ["structured", "unstructured"])
def test_skips_after_a_rollback_that_reach_the_runs_end_hold_no_event_back(mode, tmp_path):
    # review: with the guard first, the event due at 17 waited through all `skip_after_rollback` skips after
    # the rollback of step 16, which reached the run's end: it ended at 0.492 of 0.5. A skip after a rollback
    # drops a batch on the snapshot's weights: the event is taken in the first one (the rollback's own step is
    # flagged and waits, in either order), and a structured cut there is snapshotted at once
    guard, prune, _ = _fit("gcp", (14, 15, 16), tmp_path, skip_after_rollback=14, mode=mode)
    assert guard.policy.rollback_steps == [16] and guard.steps_skipped == 2 + 14  # 14 and 15, then the skips
    assert [event["step"] for event in prune.events] == [11, 18]
    assert prune.sparsity == pytest.approx(0.5) and prune.finished


def test_a_rollback_during_the_skips_after_a_cut_made_in_them_returns_to_the_cut(tmp_path):
    # the cut made in the first skip after the rollback of 16 (step 18) is snapshotted before step 19, the
    # next skip: the second incident's rollback at 24 returns there, not to an
    # uncut snapshot (which would stop)
    guard, prune, model = _fit("cpg", (14, 15, 16, 22, 23, 24), tmp_path, skip_after_rollback=3)
    assert not guard.stopped and guard.policy.rollback_steps == [16, 24]
    assert [e["to_step"] for e in guard.events if e["event"] == "rollback"] == [11, 18]
    assert [event["step"] for event in prune.events] == [11, 18]
    assert [model.net[i].out_features for i in (0, 2, 4)] == [32, 32, 16]


def test_an_event_still_waiting_at_the_runs_end_says_the_guard_held_it(tmp_path):
    # every step from the last chance (17) to the run's end (20) flagged: the event never comes, and the
    # fit-end warning says why instead of a bare "sparsity reached 0.49 of 0.5"
    with pytest.warns(
        UserWarning, match=r"An event due \(a cut to 0.500\) waited for a step StabilityGuard did not flag"
    ):
        guard, prune, _ = _fit("gp", (16, 17, 18, 19), tmp_path, max_steps=20, rollback_after=10)
    assert not guard.stopped and [event["step"] for event in prune.events] == [11]
    assert prune.core.deferred and not prune.finished


@pytest.mark.parametrize("mode", ["structured", "unstructured"])
@pytest.mark.parametrize("guard_first", [False, True])
def test_a_final_cut_the_guard_pushes_onto_the_runs_last_step_is_said_to_have_waited(
    guard_first, mode, tmp_path
):
    # sweep: `end=1.0` places the final cut at 29 of 30 (a batch to train after it); the guard skipped 29, the
    # cut waited for 30, the run's last step, where no cut is made, and `advance` cleared the wait first: the
    # fit-end warning said only "sparsity reached 0.492 of 0.5", although the docs promise the wait is said
    pl.seed_everything(0)
    guard = StabilityGuard(warmup=5, window=10, snapshot_every=4, rollback_after=3, rollback_margin=2)
    prune = ScheduledPrune(final_sparsity=0.5, mode=mode, probe_batches=0, start=5, end=1.0, every=6)
    callbacks = [guard, prune] if guard_first else [prune, guard]
    trainer = pl.Trainer(max_steps=30, callbacks=callbacks, **trainer_kwargs(default_root_dir=tmp_path))
    with pytest.warns(UserWarning, match="ScheduledPrune: the run ended") as caught:
        trainer.fit(_NaNLossAt(nan_steps=(28,)), _rows())
    assert [(event["step"], event["action"]) for event in guard.policy.events] == [(28, "skip")]
    assert [event["step"] for event in prune.events] == [11, 17, 23] and not prune.finished
    said = [str(w.message) for w in caught if "ScheduledPrune: the run ended" in str(w.message)]
    assert len(said) == 1
    assert f"sparsity reached {prune.sparsity:.3f} of 0.5" in said[0] and prune.sparsity < 0.495
    assert "An event due (a cut to 0.500) waited for a step StabilityGuard did not flag" in said[0]
    assert "none came before the run's last step, where no cut is made" in said[0]


@pytest.mark.parametrize("cycle", [False, True], ids=["step_cadence", "maintain_entries"])
@pytest.mark.parametrize("guard_first", [True, False])
def test_a_rollback_to_the_fit_start_snapshot_keeps_the_pruning_schedule_in_either_order(
    guard_first, cycle, tmp_path
):
    # sweep (DDP): listed first, the guard snapshotted the fit's start in its own on_train_start, before
    # ScheduledPrune planned its schedule and cadence in its own; a rollback to that snapshot put back the
    # unplanned state, and with both at their defaults nothing was pruned for the rest of the run (sparsity 0
    # of 0.5, said only by the end warning). The fit-start snapshot now follows every callback's train start
    pl.seed_everything(0)
    guard, prune = StabilityGuard(), ScheduledPrune(probe_batches=0)
    callbacks = [guard, prune] if guard_first else [prune, guard]
    if cycle:
        pulse = PulseCycle(burst=6, replay=3, maintain=1, warmup=0, anneal=0, maintain_eval="none")
        callbacks.insert(0, pulse)
    trainer = pl.Trainer(max_steps=64, callbacks=callbacks, **trainer_kwargs(default_root_dir=tmp_path))
    trainer.fit(_NaNLossAt(nan_steps=(10, 11, 12)), _rows())
    assert [(e["step"], e["to_step"]) for e in guard.events if e["event"] == "rollback"] == [(12, 0)]
    # the schedule runs on in either order (before: no event at all with the guard listed first)
    assert [event["step"] for event in prune.events] == ([19, 29, 39, 49] if cycle else [14, 45])
    assert prune.sparsity == pytest.approx(0.5) and prune.finished


class _NaNWeightFrom(pl.Callback):
    """From ``step`` on, writes a NaN into the first layer's trained weight (``weight_orig`` once pruned)
    before every step: a model gone bad for good, which the guard rolls back, then stops."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step >= self.step:
            layer = pl_module.net[0]
            with torch.no_grad():
                getattr(layer, "weight_orig", layer.weight)[0, 0] = float("nan")


def test_a_skip_after_a_rollback_to_before_the_first_unstructured_prune_mends_and_the_run_stops(tmp_path):
    # held-out sweep (bf16, accumulation, injected faults): a rollback to the fit-start snapshot, taken before
    # ScheduledPrune's first unstructured event, then a forced skip whose forward left the pruned layer's
    # `weight` (now a plain attribute, weight_orig * weight_mask) NaN: the guard's mend copied the snapshot's
    # `weight` into a parameter the layer no longer has, and the fit died of `KeyError: 'weight'` mid-run,
    # with no stop checkpoint
    pl.seed_everything(0)
    guard = StabilityGuard(window=20, warmup=5, snapshot_every=100, skip_after_rollback=2)
    prune = ScheduledPrune(final_sparsity=0.5, start=2, end=8, every=2, probe_batches=0)  # unstructured
    trainer = pl.Trainer(
        max_steps=30,
        callbacks=[prune, guard, _NaNWeightFrom(12)],
        **trainer_kwargs(default_root_dir=tmp_path),
    )
    model = _NaNLossAt(nan_steps=())
    with pytest.raises(StabilityGuardError) as raised:
        trainer.fit(model, _rows())
    # rolled back to the fit's start three times (each time after the two forced skips), then stopped
    assert guard.policy.rollback_steps == [12, 15, 18]
    assert [event.get("to_step") for event in guard.events if event["event"] in ("rollback", "stop")] == [
        0
    ] * 4
    saved = torch.load(raised.value.checkpoint_path, weights_only=False)
    assert all(torch.isfinite(value).all() for value in saved["state_dict"].values())
    # the mend set the pruned layer's trained weight back to the snapshot's, as the rollback loads it
    # (the guard's stop is an exception: the masks are folded once its stop checkpoint is written)
    state = saved["state_dict"]
    assert torch.equal(state["net.0.weight_orig"] * state["net.0.weight_mask"], model.net[0].weight.cpu())
