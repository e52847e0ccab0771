"""StabilityGuard through real Trainers: clean skips, rollbacks, stops, resume, metrics.

Faults are injected from outside the user's module by ``FaultInjector`` (shared with the benchmark), a
callback that mutates the batch in place (``training_step`` sees the same list) or raises the optimizer's
learning rate for a window.
"""

from __future__ import annotations

import copy
import logging
import math
import re
import warnings

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from benchmarks.stability_guard import FaultInjector
from examples.mnist1d import MNIST1DClassifier, MNIST1DDataModule
from lightning_pulse import GradientCache, HardSampleReplay, PulseCycle, ScheduledPrune
from lightning_pulse.callbacks.energy_logger import EnergyLogger
from lightning_pulse.callbacks.stability_guard import StabilityGuard, StabilityGuardError
from lightning_pulse.core import stability_steps as steps
from lightning_pulse.core.snapshots import copy_to_cpu
from lightning_pulse.core.spike_detection import POOLED
from lightning_pulse.core.stability_policy import StabilityGuardConfig
from lightning_pulse.energy import MeterConfig
from lightning_pulse.errors import PulseRefusal
from lightning_pulse.phase import PhaseChange
from lightning_pulse.protocols import rollback_states
from tests.conftest import trainer_kwargs


class StepRecorder(Callback):
    """Copies params, Adam state and scheduler position at the end of every step (after the update)."""

    restore_on_rollback = True  # a stateful callback the guard must roll back with the model

    def __init__(self) -> None:
        self.after_step: dict[int, dict] = {}
        self.batches_seen = 0
        self.announcements: list[PhaseChange] = []
        self.lr_at_step: dict[int, float] = {}
        self.lr_between_steps: dict[int, float] = {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        # placed after the guard in the callback list: sees the rate the update will use
        self.lr_at_step[trainer.global_step] = optimizer.param_groups[0]["lr"]

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.lr_between_steps[trainer.global_step] = trainer.optimizers[0].param_groups[0]["lr"]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.batches_seen += 1
        self.after_step[trainer.global_step] = capture(trainer, pl_module)

    def on_pulse_phase_change(self, trainer, pl_module, change):
        self.announcements.append(change)

    def state_dict(self):
        return {"batches_seen": self.batches_seen}

    def load_state_dict(self, state_dict):
        self.batches_seen = state_dict["batches_seen"]


class StepEnergy(Callback):
    """Each optimizer step's energy as the guard read it: the meter readings it takes at a step's first batch
    and at the step's end (its ``StepEnergy``), recorded by wrapping its reader. A reader of its own at other
    hooks read other moments, which a busy machine moved by up to a fifth of a 3 ms step."""

    def __init__(self, guard: StabilityGuard) -> None:
        self.guard = guard
        self.by_step: dict[int, float] = {}
        self._begun: float | None = None

    def on_train_start(self, trainer, pl_module):  # listed after the guard: its reader is chosen by now
        energy = self.guard._energy
        read = energy.read

        def recorded() -> float:
            value = read()
            if self._begun is None:  # begin: the first batch of a step
                self._begun = value
            else:  # end: the step (global_step - 1 by now) is over
                self.by_step[trainer.global_step - 1], self._begun = value - self._begun, None
            return value

        energy.read = recorded


def capture(trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict:
    optimizer = trainer.optimizers[0]
    schedulers = [config.scheduler for config in trainer.lr_scheduler_configs]
    return {
        "params": {name: p.detach().clone() for name, p in pl_module.named_parameters()},
        "optimizer": copy.deepcopy(optimizer.state_dict()["state"]),
        "lr": optimizer.param_groups[0]["lr"],
        "scheduler_epoch": schedulers[0].last_epoch if schedulers else None,
    }


def assert_same_state(actual: dict, expected: dict) -> None:
    assert actual["params"].keys() == expected["params"].keys()
    for name, value in expected["params"].items():
        assert torch.equal(actual["params"][name], value), name
    assert actual["optimizer"].keys() == expected["optimizer"].keys()
    for key, state in expected["optimizer"].items():
        for field, value in state.items():
            assert torch.equal(actual["optimizer"][key][field], value), (key, field)
    assert actual["lr"] == expected["lr"]
    assert actual["scheduler_epoch"] == expected["scheduler_epoch"]


@pytest.fixture(scope="module")
def small_data():
    """1000 generated MNIST-1D samples: 900 train, 100 val; 15 batches of 60 per epoch."""
    data = MNIST1DDataModule(num_samples=1000, batch_size=60)
    data.setup()
    return data


# ---------------------------------------------------------------- skip


class StateAroundStep(Callback):
    """Captures the state before optimizer step ``step`` and after it."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.before = self.after = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step and self.before is None:
            self.before = capture(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step + 1 and self.after is None:
            self.after = capture(trainer, pl_module)


@pytest.mark.parametrize(("precision", "accumulate"), [("32-true", 1), ("bf16-mixed", 2)])
def test_skipped_step_leaves_parameters_and_optimizer_state_unchanged(small_data, precision, accumulate):
    pl.seed_everything(0)
    # weight decay on: a step that merely zeroed the gradients would still shrink the weights
    model = MNIST1DClassifier(arch="mlp", weight_decay=0.1)
    skipped, following = StateAroundStep(6), StateAroundStep(7)
    guard = StabilityGuard()
    trainer = pl.Trainer(
        callbacks=[FaultInjector("nan", start=6), guard, skipped, following],
        max_steps=10,
        precision=precision,
        accumulate_grad_batches=accumulate,
        **trainer_kwargs(limit_val_batches=0),
    )
    trainer.fit(model, small_data)

    assert guard.events == [{"step": 6, "event": "nonfinite_loss", "action": "skip", "cause": "data"}]
    assert_same_state(skipped.after, skipped.before)
    assert skipped.after["optimizer"][0]["step"].item() == 6  # Adam's step count did not move either
    changed = [
        name
        for name, value in following.before["params"].items()
        if not torch.equal(following.after["params"][name], value)
    ]
    assert changed, "the step after the skipped one trains again"
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert (guard.steps_skipped, guard.steps_lost, guard.rollbacks) == (1, 1, 0)


def counting_sgd_classifier():
    """A classifier whose optimizer lives outside ``torch.optim`` and keeps a global counter that moves even
    without gradients, like schedule-free optimizers do. The classes are fresh on every call: torch wraps a
    class's ``step`` (to run the instance's hooks) the first time an instance of that very class is built,
    and never unwraps it, so whether the parent's ``step`` runs the hooks too must not depend on earlier tests.
    """

    class ParentSGD(torch.optim.Optimizer):  # SGD with momentum, not built on `torch.optim.SGD.step`
        def __init__(self, params, lr, momentum):
            super().__init__(params, {"lr": lr, "momentum": momentum})

        @torch.no_grad()
        def step(self, closure=None):
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            for group in self.param_groups:
                for param in group["params"]:
                    if param.grad is None:
                        continue
                    state = self.state[param]
                    if "momentum_buffer" not in state:
                        state["momentum_buffer"] = param.grad.clone()
                    else:
                        state["momentum_buffer"].mul_(group["momentum"]).add_(param.grad)
                    param.add_(state["momentum_buffer"], alpha=-group["lr"])
            return loss

    class CountingSGD(ParentSGD):
        def step(self, closure=None):
            loss = super().step(closure)
            for group in self.param_groups:
                group["k"] = group.get("k", 0) + 1
            return loss

    class CountingSGDClassifier(MNIST1DClassifier):
        def configure_optimizers(self):
            return CountingSGD(self.parameters(), lr=0.05, momentum=0.9)

    return CountingSGDClassifier(arch="mlp"), ParentSGD


@pytest.mark.parametrize("parent_step_hooked", [False, True], ids=["parent-plain", "parent-hooked"])
def test_skip_puts_back_the_state_of_an_optimizer_that_steps_without_gradients(
    small_data, parent_step_hooked
):
    pl.seed_everything(0)
    model, parent = counting_sgd_classifier()
    if parent_step_hooked:
        # as after any earlier `torch.optim.SGD(...)` in the process: `super().step()` runs the post-hooks too,
        # before the subclass moves its counter
        parent([torch.nn.Parameter(torch.zeros(1))], lr=0.1, momentum=0.9)
    assert bool(getattr(parent.step, "hooked", False)) is parent_step_hooked
    around = StateAroundStep(4)
    guard = StabilityGuard()
    trainer = pl.Trainer(
        callbacks=[FaultInjector("nan", start=4), guard, around],
        max_steps=6,
        **trainer_kwargs(limit_val_batches=0),
    )
    trainer.fit(model, small_data)
    assert guard.events == [{"step": 4, "event": "nonfinite_loss", "action": "skip", "cause": "data"}]
    assert_same_state(around.after, around.before)
    assert trainer.optimizers[0].param_groups[0]["k"] == 5  # 6 steps, one of them undone


def test_an_lbfgs_step_with_several_closure_evaluations_counts_once(small_data):
    # LBFGS runs the closure (and on_before_optimizer_step) several times per step: the step is judged on its
    # first evaluation, and the line search's trial points stay out of the baselines (a held-out LBFGS fit with
    # warmup=10 had its windows filled four times a step with them, flagged healthy steps and rolled back)
    class LBFGSClassifier(MNIST1DClassifier):
        def configure_optimizers(self):
            return torch.optim.LBFGS(self.parameters(), lr=0.1, max_iter=3)

    pl.seed_everything(0)
    counter = ClosureCounter()
    guard = StabilityGuard(
        loss_zscore=None, grad_norm_zscore=None, snapshot_every=4, max_snapshots=3, rollback_margin=4
    )
    trainer = pl.Trainer(callbacks=[guard, counter], max_steps=12, **trainer_kwargs(limit_val_batches=0))
    trainer.fit(LBFGSClassifier(arch="mlp"), small_data)
    assert counter.calls > trainer.global_step == 12  # non-vacuous: more evaluations than steps
    assert guard.lineage_steps == 12 and guard.steps_lost == 0
    assert guard.snapshots.steps == [4, 8, 12]
    assert guard.detector.accepted_steps == 12
    assert len(guard.detector.state_dict()["loss"]["*"]["values"]) == 12  # one value a step


class ClosureCounter(Callback):
    def __init__(self) -> None:
        self.calls = 0

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.calls += 1


# ---------------------------------------------------------------- rollback


@pytest.fixture(scope="module")
def rollback_run(small_data, tmp_path_factory):
    """A pulse run whose learning rate explodes at step 30; the guard snapshots at maintain phases only."""
    pl.seed_everything(0)
    model = MNIST1DClassifier(arch="mlp", scheduler="onecycle")
    cycle = PulseCycle(burst=8, replay=4, maintain=2, warmup=0, anneal=0, maintain_eval="none")
    recorder = StepRecorder()
    energy = EnergyLogger(
        cpu="constant", ram="none", gpu="none", meters=MeterConfig(sampling_period=0.02, cpu_watts=10.0)
    )
    guard = StabilityGuard(
        warmup=10,
        # a 50-step one-cycle schedule ramps the gradient norm up 4x in 15 steps: judge the loss only
        grad_norm_zscore=None,
        rollback_after=2,
        skip_after_rollback=3,
        snapshot_every=0,
        max_snapshots=3,
        rollback_margin=1,
        config=StabilityGuardConfig(lr_factor_after_rollback=0.1, lr_cooldown_steps=4),
    )
    step_energy = StepEnergy(guard)
    trainer = pl.Trainer(
        callbacks=[
            cycle,
            FaultInjector("lr", start=30, length=2, factor=100.0),
            guard,
            step_energy,
            recorder,
            energy,
        ],
        max_steps=50,
        **trainer_kwargs(limit_val_batches=0, default_root_dir=str(tmp_path_factory.mktemp("rollback"))),
    )
    trainer.fit(model, small_data)
    trainer.step_energy = step_energy  # for the energy test; the other tests take the fixture's four values
    return trainer, guard, recorder, energy


def test_repeated_spikes_roll_back_to_the_last_maintain_snapshot(rollback_run):
    trainer, guard, recorder, _ = rollback_run
    rollbacks = [event for event in guard.events if event["event"] == "rollback"]
    assert len(rollbacks) == 1 and guard.rollbacks == 1
    flagged = [event["step"] for event in guard.events if event["event"] not in ("rollback", "stop")]
    assert flagged[0] in (31, 32) and rollbacks[0]["step"] == flagged[1]
    # maintain phases start at steps 12, 26, 40: the newest one before the trouble is 26
    assert rollbacks[0]["to_step"] == 26
    rolled_back_at = rollbacks[0]["step"] + 1  # the step counter after the flagged step
    assert_same_state(recorder.after_step[rolled_back_at], recorder.after_step[26])
    assert guard.steps_undone == flagged[0] - 26  # the updates 26 .. first flagged - 1
    assert guard.steps_skipped == 2 + 3
    assert guard.steps_lost == guard.steps_undone + guard.steps_skipped
    assert all(math.isfinite(p.sum().item()) for p in trainer.lightning_module.parameters())


def test_rollback_restores_the_callbacks_that_opt_in_and_only_those(rollback_run):
    trainer, guard, recorder, energy = rollback_run
    cycle = trainer.callbacks[0]
    # PulseCycle opts in for its probe only; the EnergyLogger (a meter) does not
    assert [state.callback for state in rollback_states(trainer, exclude=guard).values()] == [cycle, recorder]
    # the recorder's counter went back with the model: 50 batches ran, those of steps 26..rollback undone (the
    # snapshot of step 26 holds its count at that step's end, 26); listed after the guard, it then counts the
    # flagged batch at its own batch end, after the rollback
    rolled_back_at = next(e["step"] for e in guard.events if e["event"] == "rollback") + 1
    assert recorder.batches_seen == 50 - (rolled_back_at - 26) + 1
    # ... and, like after a checkpoint restore, it was told the current phase again
    resumes = [change for change in recorder.announcements if change.reason == "resume"]
    assert [change.step for change in resumes] == [rolled_back_at]
    # the clock and the meter kept counting what really happened
    assert cycle.clock.step == 50 and sum(cycle.clock.steps_by_phase.values()) == 50
    assert energy.report["total"]["steps"] == 50


def test_learning_rate_is_lowered_inside_steps_during_the_cooldown_only(rollback_run):
    _, guard, recorder, _ = rollback_run
    rolled_back_at = next(e["step"] for e in guard.events if e["event"] == "rollback") + 1
    first_applied = rolled_back_at + 3  # three steps skipped after the rollback
    for step in range(first_applied, first_applied + 4):
        assert recorder.lr_at_step[step] == pytest.approx(0.1 * recorder.lr_between_steps[step])
    for step in range(first_applied + 4, 50):
        assert recorder.lr_at_step[step] == recorder.lr_between_steps[step]
    # the scheduler never saw the lowered rate: it is rewound to the snapshot and steps on from there
    assert recorder.after_step[50]["scheduler_epoch"] == 50 - (rolled_back_at - 26)


def test_energy_of_lost_steps_is_taken_from_the_energy_logger(rollback_run):
    trainer, guard, _, energy = rollback_run
    metrics = guard.metrics()
    total = energy.energy_so_far_kwh()
    assert 0 < guard.energy_wasted_kwh < total
    assert metrics["stability/energy_wasted_kwh"] == guard.energy_wasted_kwh
    # the lost steps are the updates 26 .. first flagged - 1 (undone), the two flagged steps and the three
    # skipped after the rollback: their energy, as the guard read the meter at each step, is what it calls
    # wasted (a reading per step, not a share of the run's time: this machine may be busy with other work)
    assert guard.steps_lost == 10
    lost = [trainer.step_energy.by_step[step] for step in range(26, 36)]
    assert all(step_kwh > 0 for step_kwh in lost)
    assert guard.energy_wasted_kwh == pytest.approx(sum(lost), rel=1e-9)


# ---------------------------------------------------------------- stop


def test_stop_saves_the_last_good_state_then_raises(small_data, tmp_path):
    pl.seed_everything(0)
    model = MNIST1DClassifier(arch="mlp")
    recorder = StepRecorder()
    guard = StabilityGuard(
        rollback_after=2,
        skip_after_rollback=2,
        snapshot_every=5,
        max_snapshots=2,
        rollback_margin=2,
        max_rollbacks=1,
    )
    trainer = pl.Trainer(
        # inputs scaled by 1e4 (finite data: not the data's fault): loss spikes that persist
        callbacks=[FaultInjector("scale", start=20, length=100), guard, recorder],
        max_steps=60,
        **trainer_kwargs(limit_val_batches=0, default_root_dir=str(tmp_path)),
    )
    with pytest.raises(StabilityGuardError, match="stopped training at step 25") as raised:
        trainer.fit(model, small_data)
    # 20, 21 flagged -> rollback to 15; 22, 23 skipped; 24, 25 flagged -> stop, back to 15 again
    assert [event["event"] for event in guard.events] == ["loss_spike"] * 2 + ["rollback"] + [
        "loss_spike"
    ] * 2 + ["stop"]
    assert guard.stopped and guard.events[-1]["to_step"] == 15
    # six steps skipped; updates 15..19 undone, counted once although the run went back to step 15 twice
    assert (guard.steps_skipped, guard.steps_undone) == (6, 5)
    path = raised.value.checkpoint_path
    assert path == str(tmp_path / "stability_guard" / "stopped-step=25.ckpt")
    checkpoint = torch.load(path, weights_only=False)
    saved = {name.removeprefix("net."): value for name, value in checkpoint["state_dict"].items()}
    expected = recorder.after_step[15]["params"]
    assert all(torch.equal(saved[name.removeprefix("net.")], value) for name, value in expected.items())
    assert checkpoint["global_step"] == 26  # saved after step 25
    state = next(value for key, value in checkpoint["callbacks"].items() if key.startswith("StabilityGuard"))
    assert state["policy"]["stopped"] is True
    # the message says what the checkpoint holds, and a way out that works: a new run from the weights (a resume
    # with ckpt_path restores the learning rate and the rollback count, and stopped again 2 steps later)
    message = str(raised.value)
    assert "holds the snapshot of step 15." in message and "None:" not in message
    assert "load_from_checkpoint" in message and "resuming with ckpt_path restores" in message


def _stopping_run(tmp_path, path, *extra):
    """The stop above (at step 25, back to the snapshot of step 15), saving to ``path``."""
    pl.seed_everything(0)
    config = StabilityGuardConfig(stop_checkpoint_path=path)
    guard = StabilityGuard(
        rollback_after=2,
        skip_after_rollback=2,
        snapshot_every=5,
        rollback_margin=2,
        max_rollbacks=1,
        config=config,
    )
    return pl.Trainer(
        callbacks=[FaultInjector("scale", start=20, length=100), guard, *extra],
        max_steps=60,
        **trainer_kwargs(limit_val_batches=0, default_root_dir=str(tmp_path)),
    )


@pytest.mark.parametrize("where", ["under a file", "a folder", "under /proc"])
def test_a_stop_checkpoint_path_that_cannot_be_written_is_refused_at_fit_start(small_data, tmp_path, where):
    """Held-out sweep: such a path was found only at the stop, after the whole run up to it, and the save's bare
    FileNotFoundError (FileExistsError) came instead of the guard's error, with no checkpoint."""
    (tmp_path / "a_file").write_text("")
    path = {
        "under a file": str(tmp_path / "a_file" / "stop.ckpt"),
        "a folder": str(tmp_path),
        "under /proc": "/proc/no_such_dir/stop.ckpt",
    }[where]
    trainer = _stopping_run(tmp_path, path)
    with pytest.raises(PulseRefusal) as refused:
        trainer.fit(MNIST1DClassifier(arch="mlp"), small_data)
    message = str(refused.value)
    assert message.startswith(
        f"StabilityGuard: `config.stop_checkpoint_path`={path!r} cannot hold the checkpoint"
    )
    reason = {"under a file": "cannot be created: File exists", "a folder": "(it is a folder)"}
    assert reason.get(where, "cannot be created") in message
    assert "give a file path in a writable folder, or None" in message
    assert trainer.global_step == 0


def test_ranks_take_rank_zeros_finding_on_the_stop_checkpoint_path(tmp_path):
    """Rank 0 writes the checkpoint, so it decides; every rank raises its refusal (none waits in a collective)."""
    (tmp_path / "a_file").write_text("")
    bad, good = str(tmp_path / "a_file" / "stop.ckpt"), str(tmp_path / "new" / "stop.ckpt")
    said = []
    steps.refuse_unwritable_stop_path(bad, False, lambda values: said.append(values) or [None])
    assert said == [[None]]  # another rank does not look; rank 0 found the path fine
    with pytest.raises(PulseRefusal, match="its folder .* cannot be created"):
        steps.refuse_unwritable_stop_path(good, False, lambda values: ["its folder 'x' cannot be created"])
    steps.refuse_unwritable_stop_path(good, True, None)
    assert (tmp_path / "new").is_dir()  # made, as the save would


class _FolderBecomesAFile(Callback):
    """Replaces the stop checkpoint's folder with a regular file at step 22 (a folder removed, a disk full)."""

    def __init__(self, folder) -> None:
        self.folder = folder

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 22 and trainer.is_global_zero:
            self.folder.rmdir()
            self.folder.write_text("")


def test_a_stop_whose_checkpoint_cannot_be_written_still_raises_the_guards_error(small_data, tmp_path):
    folder = tmp_path / "stops"
    recorder = StepRecorder()
    trainer = _stopping_run(tmp_path, str(folder / "stop.ckpt"), recorder, _FolderBecomesAFile(folder))
    with pytest.raises(StabilityGuardError, match="stopped training at step 25") as raised:
        trainer.fit(MNIST1DClassifier(arch="mlp"), small_data)
    message = str(raised.value)
    assert "holds the snapshot of step 15." in message and "load_from_checkpoint" in message  # what it was
    assert "But that checkpoint could not be written (FileExistsError: " in message
    assert raised.value.checkpoint_path is None
    assert isinstance(raised.value.__cause__, FileExistsError)
    # the way out works: the state is in memory, back at the snapshot of step 15
    trainer.save_checkpoint(tmp_path / "rescued.ckpt")
    saved = torch.load(tmp_path / "rescued.ckpt", weights_only=False)["state_dict"]
    expected = recorder.after_step[15]["params"]
    assert all(torch.equal(saved[name], value) for name, value in expected.items())


# ---------------------------------------------------------------- resume


def test_resume_restores_baselines_so_spikes_are_caught_without_a_new_warmup(small_data, tmp_path):
    def fit(max_steps, guard, faults, ckpt_path=None):
        pl.seed_everything(0)
        trainer = pl.Trainer(
            callbacks=[*faults, guard], max_steps=max_steps, **trainer_kwargs(limit_val_batches=0)
        )
        trainer.fit(MNIST1DClassifier(arch="mlp"), small_data, ckpt_path=ckpt_path)
        return trainer

    first = StabilityGuard(warmup=20)
    fit(30, first, [FaultInjector("nan", start=3)]).save_checkpoint(tmp_path / "mid.ckpt")
    resumed = StabilityGuard(warmup=20)
    fit(36, resumed, [FaultInjector("scale", start=32)], ckpt_path=tmp_path / "mid.ckpt")
    assert resumed.events == [
        {"step": 3, "event": "nonfinite_loss", "action": "skip", "cause": "data"},
        {"step": 32, "event": "loss_spike", "action": "skip"},
    ]
    assert resumed.steps_skipped == 2
    # the windows the resumed guard judged step 32 against are the saved ones, continued (not a new warm-up)
    saved = first.detector.state_dict()["loss"]["burst"]["values"]
    continued = resumed.detector.state_dict()["loss"]["burst"]["values"]
    assert len(saved) == 29 and continued[: len(saved)] == saved and len(continued) == len(saved) + 5


# ---------------------------------------------------------------- configuration


class ManualModule(MNIST1DClassifier):
    def __init__(self) -> None:
        super().__init__(arch="mlp")
        self.automatic_optimization = False


def test_manual_optimization_is_rejected_at_fit_start(small_data):
    trainer = pl.Trainer(callbacks=[StabilityGuard()], max_steps=1, **trainer_kwargs())
    with pytest.raises(MisconfigurationException, match="automatic optimization"):
        trainer.fit(ManualModule(), small_data)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"loss_zscore": -1}, "loss_zscore"),
        ({"config": {"min_ratio": 0.5}}, "min_ratio"),
        ({"config": {"loss_scale": "exp"}}, "loss_scale"),
        ({"config": {"spike_memory": 0}}, "spike_memory"),
        ({"config": 5}, "config"),
        ({"warmup": 200}, "warmup"),
        ({"max_rollbacks": -1}, "max_rollbacks"),
        ({"rollback_after": 0}, "rollback_after"),
        ({"snapshot_every": -1}, "snapshot_every"),
        ({"max_snapshots": 0}, "max_snapshots"),
        ({"max_snapshots": 2, "snapshot_every": 5, "rollback_margin": 10}, "rollback_margin"),
    ],
)
def test_bad_arguments_fail_at_construction_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"`{field}`"):
        StabilityGuard(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"lr_factor_after_rollback": 2.0}, "lr_factor_after_rollback"),
        ({"lr_cooldown_steps": 1.5}, "lr_cooldown_steps"),
        ({"rewind_lr_schedule": "yes"}, "rewind_lr_schedule"),
        ({"stop_checkpoint_path": ""}, "stop_checkpoint_path"),
    ],
)
def test_bad_config_fields_fail_at_construction_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"`{field}`"):
        StabilityGuardConfig(**kwargs)


# ---------------------------------------------------------------- the pulse callbacks roll back with the model


def _rollback_state(callback) -> dict:
    own = getattr(callback, "rollback_state_dict", None)
    return copy_to_cpu(own() if callable(own) else callback.state_dict())


def _same(actual, expected, path="state") -> list[str]:
    """Paths where two states differ (tensors and arrays bit-equal, NaN equal to NaN)."""
    if isinstance(expected, torch.Tensor):
        ok = (
            isinstance(actual, torch.Tensor)
            and actual.shape == expected.shape
            and actual.dtype == expected.dtype
        )
        return [] if ok and torch.equal(actual.nan_to_num(7.0), expected.nan_to_num(7.0)) else [path]
    if isinstance(expected, np.ndarray):
        ok = isinstance(actual, np.ndarray) and actual.shape == expected.shape
        nan_ok = expected.dtype.kind == "f"
        return [] if ok and np.array_equal(actual, expected, equal_nan=nan_ok) else [path]
    if isinstance(expected, dict):
        if not isinstance(actual, dict) or actual.keys() != expected.keys():
            return [path]
        return [p for key in expected for p in _same(actual[key], expected[key], f"{path}.{key}")]
    if isinstance(expected, (list, tuple)):
        if not isinstance(actual, (list, tuple)) or len(actual) != len(expected):
            return [path]
        return [p for i, (a, e) in enumerate(zip(actual, expected)) for p in _same(a, e, f"{path}[{i}]")]
    if isinstance(expected, float) and math.isnan(expected):
        return [] if isinstance(actual, float) and math.isnan(actual) else [path]
    return [] if actual == expected else [path]


class PulseStateRecorder(Callback):
    """Placed last: each opted-in callback's state at the end of every step (after any rollback), and what
    each one was given, and reported, right when the guard restored it."""

    def __init__(self, callbacks: dict) -> None:
        self.callbacks = callbacks
        self.at_step: dict[int, dict] = {}
        self.loaded: dict[str, tuple[dict, dict]] = {}
        for name, callback in callbacks.items():
            method = (
                "load_rollback_state_dict"
                if hasattr(callback, "load_rollback_state_dict")
                else "load_state_dict"
            )
            original = getattr(callback, method)

            def spy(state, _original=original, _name=name, _callback=callback):
                given = copy_to_cpu(state)
                _original(state)
                self.loaded[_name] = (given, _rollback_state(_callback))

            setattr(callback, method, spy)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.at_step[trainer.global_step] = {name: _rollback_state(c) for name, c in self.callbacks.items()}


def test_rollback_returns_every_opted_in_pulse_callback_to_its_state_at_the_snapshot(small_data):
    pl.seed_everything(0)
    model = MNIST1DClassifier(arch="mlp")
    # cycles of 15 steps: maintain phases (with a probe and a pruning event) start at steps 12, 27 and 42
    cycle = PulseCycle(burst=8, replay=4, maintain=3, warmup=0, anneal=0, probe_batches=1)
    replay = HardSampleReplay(replay_fraction=0.5, mode="batch")  # the steps of this test are fixed
    cache = GradientCache(threshold=2.0, check_every=5, freeze_for=20)
    prune = ScheduledPrune(
        final_sparsity=0.5, start=0, end=45, probe_batches=1, options={"make_permanent": False}
    )
    guard = StabilityGuard(
        loss_zscore=None,  # pruning and freezing move the loss and the gradient norm on purpose:
        grad_norm_zscore=None,  # only the injected NaN steps are flagged
        rollback_after=2,
        skip_after_rollback=2,
        snapshot_every=5,
        max_snapshots=3,
        rollback_margin=5,
        config=StabilityGuardConfig(snapshot_at_maintain=False),
    )
    opted_in = {"cycle": cycle, "replay": replay, "cache": cache, "prune": prune}
    recorder = PulseStateRecorder(opted_in)
    # NaN at steps 29-30, right after the pruning event at 27: the newest snapshot 5 steps before is step 20
    fault = FaultInjector("nan_output", start=29, length=2)  # finite data: escalates
    trainer = pl.Trainer(
        callbacks=[cycle, replay, cache, prune, fault, guard, recorder],
        max_steps=50,
        **trainer_kwargs(limit_val_batches=1),
    )
    trainer.fit(model, small_data)

    rollbacks = [event for event in guard.events if event["event"] == "rollback"]
    assert [(event["step"], event["to_step"]) for event in rollbacks] == [(30, 20)]
    assert [state.callback for state in rollback_states(trainer, exclude=guard).values()] == list(
        opted_in.values()
    )
    snapshot_state, rolled_back = recorder.at_step[20], recorder.at_step[31]
    for name in opted_in:
        given, reported = recorder.loaded[name]
        # the guard handed each callback its own state of the snapshot step, which had moved on since ...
        assert _same(given, snapshot_state[name]) == [], name
        assert name == "cache" or _same(recorder.at_step[30][name], snapshot_state[name]), name
        # ... and the callback took all of it: its reported state right after the load is that state
        if name == "cache":  # GradientCache's FLOP ledger and event history keep counting what really ran
            assert _same(reported["cache"], given["cache"]) == []
        else:
            assert _same(reported, given) == [], name
    # the undone pruning event (27) is gone from the record, as from the model; the next maintain entry redid it
    assert [event["step"] for event in snapshot_state["prune"]["events"]] == [12]
    assert [event["step"] for event in rolled_back["prune"]["events"]] == [12]
    assert [event["step"] for event in prune.events] == [12, 42]
    # PulseCycle's probe went back with the model (the one of step 12), its clock did not
    assert rolled_back["cycle"] == snapshot_state["cycle"] != recorder.at_step[30]["cycle"]
    assert cycle.clock.step == 50 and sum(cycle.clock.steps_by_phase.values()) == 50
    assert all(math.isfinite(p.sum().item()) for p in model.parameters())


def test_a_structured_pruning_event_is_followed_by_a_snapshot_that_fits_the_smaller_model(small_data):
    pl.seed_everything(0)
    model = MNIST1DClassifier(arch="mlp")
    prune = ScheduledPrune(final_sparsity=0.5, mode="structured", start=5, end=15, every=5, probe_batches=0)
    guard = StabilityGuard(snapshot_every=0, max_snapshots=2, rollback_margin=0)
    trainer = pl.Trainer(callbacks=[prune, guard], max_steps=18, **trainer_kwargs(limit_val_batches=0))
    trainer.fit(model, small_data)

    assert [event["step"] for event in prune.events] == [10, 15]
    # no periodic snapshots: besides the one at the start, only those the events asked for, after the cut
    assert guard.snapshots.steps == [10, 15] and guard.snapshots_taken == 3
    # each event cut channels again: the snapshot of step 10 no longer fits, the one after the last cut does
    assert [snapshot.fits(model) for snapshot in guard.snapshots] == [False, True]


def test_lightning_cli_nests_the_config_as_a_plain_mapping():
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_class_arguments(StabilityGuard, "guard")
    parsed = parser.parse_object(
        {
            "guard": {
                "snapshot_every": 50,
                "config": {"min_ratio": 2.0, "lr_cooldown_steps": 10, "lr_factor_after_rollback": 0.5},
            }
        }
    )
    guard = parser.instantiate_classes(parsed)["guard"]
    assert isinstance(guard, StabilityGuard) and guard.schedule.every == 50
    assert guard.config == StabilityGuardConfig(
        min_ratio=2.0, lr_cooldown_steps=10, lr_factor_after_rollback=0.5
    )
    assert guard.detector.min_ratio == 2.0 and guard.policy.lr_cooldown_steps == 10


def test_the_rollback_tests_training_step_calls_leave_the_module_and_the_batches_as_they_were():
    # Found by a held-out sweep: the extra calls appended to the Lightning docs' `training_step_outputs`,
    # moved counters, changed in place a batch later callbacks still read, and a `None` return (Lightning's
    # skip) entered the mean as NaN.
    from lightning_pulse.probe import training_losses

    class Recording(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(3, 1)
            self.training_step_outputs, self.seen, self.stats = [], 0, {"calls": 0}

        def training_step(self, batch, batch_idx):
            x, y = batch
            x.sub_(x.mean())  # in place, as some input pipelines do
            self.seen += len(x)
            self.stats["calls"] += 1
            loss = torch.nn.functional.mse_loss(self.layer(x), y)
            self.training_step_outputs.append(loss.detach())
            return None if batch_idx == 1 else loss

    module = Recording()
    batch = (torch.arange(6.0).reshape(2, 3) + 5, torch.ones(2, 1))
    before = batch[0].clone()
    losses = training_losses(pl.Trainer(**trainer_kwargs()), module, [(0, batch), (1, batch)])
    assert len(losses) == 1  # the skipped batch gives no loss
    expected = torch.nn.functional.mse_loss(module.layer(before - before.mean()), batch[1])
    assert losses[0] == pytest.approx(expected.item())
    assert torch.equal(batch[0], before)
    assert (module.training_step_outputs, module.seen, module.stats) == ([], 0, {"calls": 0})


class DigitsBatchNormMLP(pl.LightningModule):
    """An ordinary BatchNorm classifier on scikit-learn's digits, written without the guard in mind."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64), torch.nn.ReLU(), torch.nn.Linear(64, 10)
        )

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=3e-3)


def _digits_tensors() -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    digits = load_digits()
    return torch.tensor(digits.data, dtype=torch.float32) / 16, torch.tensor(digits.target)


def _digits_loader(x=None, y=None):
    x, y = _digits_tensors() if x is None else (x, y)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=64, shuffle=True)


def test_a_nan_row_under_batchnorm_is_skipped_as_the_datas_fault_and_its_running_statistics_mended():
    """The bad row's forward writes NaN into BatchNorm's running statistics before any step. That is the data's
    doing: the step is skipped and the statistics go back to the snapshot's, with no rollback (before, the
    non-finite buffers were blamed on the model, the guard rolled back at every epoch and stopped the run)."""
    x, y = _digits_tensors()
    x[5, 3] = float("nan")
    loader = _digits_loader(x, y)
    pl.seed_everything(0)
    model = DigitsBatchNormMLP()
    guard = StabilityGuard(snapshot_every=10, warmup=10)
    trainer = pl.Trainer(max_epochs=4, callbacks=[guard], **trainer_kwargs())
    with pytest.warns(UserWarning, match=r"non-finite values in its data .*net\.1\.running_mean"):
        trainer.fit(model, loader)
    assert [event["cause"] for event in guard.events if "cause" in event] == ["data"] * 4  # once an epoch
    assert guard.rollbacks == 0 and trainer.global_step == 4 * 29  # a skipped step is still a step
    assert all(torch.isfinite(b).all() for b in model.buffers())
    model.eval()
    clean = torch.isfinite(x).all(dim=1)
    accuracy = (model(x[clean]).argmax(dim=1) == y[clean]).float().mean().item()
    assert accuracy > 0.9, accuracy


class _GrowsThenBreaks(DigitsBatchNormMLP):
    """Adds a buffer at step 12 (its structure changes, as a model growing a layer does), and a weight goes NaN
    at step 20, before the guard's next snapshot."""

    def on_train_batch_start(self, batch, batch_idx):
        if self.global_step == 12 and not hasattr(self, "grown"):
            self.register_buffer("grown", torch.zeros(1))
        if self.global_step == 20:
            with torch.no_grad():
                self.net[0].weight[0, 0] = float("nan")


def test_a_rollback_with_no_snapshot_that_fits_stops_the_run_instead_of_training_on_a_bad_state(tmp_path):
    """It warned that no snapshot fits, logged a "rollback to the snapshot of step None", and the run finished
    with NaN weights and no error."""
    pl.seed_everything(0)
    guard = StabilityGuard(snapshot_every=30)
    trainer = pl.Trainer(max_epochs=2, callbacks=[guard], default_root_dir=tmp_path, **trainer_kwargs())
    with pytest.raises(
        StabilityGuardError,
        match=r"^StabilityGuard stopped training at step 20: it had to roll back, but no snapshot fits",
    ):
        trainer.fit(_GrowsThenBreaks(), _digits_loader())
    assert guard.rollbacks == 0 and trainer.global_step == 21


class _TaskHeads(pl.LightningModule):
    """A trunk and two task heads; the batch's ``task`` field picks the head, and task 1 comes in batch 30
    only (multi-task and mixture-of-experts models leave a branch unused for a while)."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU())
        self.heads = torch.nn.ModuleList([torch.nn.Linear(16, 2), torch.nn.Linear(16, 2)])

    def training_step(self, batch, batch_idx):
        head = self.heads[int(batch["task"][0])]
        return torch.nn.functional.cross_entropy(head(self.trunk(batch["x"])), batch["y"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self):
        x = torch.randn(64 * 32, 8, generator=torch.Generator().manual_seed(0))
        task = (torch.arange(len(x)) // 32 == 30).long()
        rows = [{"x": x[i], "y": (x[i, 0] > 0).long(), "task": task[i]} for i in range(len(x))]
        return torch.utils.data.DataLoader(rows, batch_size=32)


class _NaNIntoTheIdleHeadAt8(Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == 8:
            with torch.no_grad():
                pl_module.heads[1].weight.fill_(float("nan"))


def test_a_nan_in_an_unused_branch_is_never_snapshotted_so_the_rollback_returns_to_a_finite_state():
    """A NaN written into the idle head at step 8 left the loss finite, so the snapshots of steps 10 to 25
    held it and evicted the finite ones. When batch 30 used the head, the step was non-finite from the state
    and the guard rolled back to the snapshot of step 25, as NaN as the state it left: the run ended normally,
    one rollback reported, with a NaN head. Now the snapshots holding it are left out (said once) and the
    rollback returns to the step-5 snapshot, the newest finite one."""
    pl.seed_everything(0)
    model, guard = _TaskHeads(), StabilityGuard(warmup=5, snapshot_every=5, rollback_margin=5)
    trainer = pl.Trainer(max_steps=50, callbacks=[_NaNIntoTheIdleHeadAt8(), guard], **trainer_kwargs())
    with pytest.warns(UserWarning) as caught:
        trainer.fit(model)
    messages = [str(warning.message) for warning in caught]
    left_out = [m for m in messages if m.startswith("StabilityGuard: no snapshot at step")]
    assert len(left_out) == 1 and left_out[0].startswith(
        "StabilityGuard: no snapshot at step 10: heads.1.weight holds non-finite values. A rollback must "
        "never"
    )
    assert any(
        m.startswith("StabilityGuard: rollback 1 at step 30 to the snapshot of step 5 ") for m in messages
    )
    assert guard.events[-1] == {"step": 30, "event": "rollback", "to_step": 5} and guard.rollbacks == 1
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert guard.snapshots.steps == [0, 5]  # the finite snapshots stayed in the ring (`max_snapshots=2`)


class _CausalMaskBuiltAtFirstForward(pl.LightningModule):
    """Self-attention over the batch with a ``-inf`` causal mask that the first forward builds (a lazy cache),
    after the fit started; and a BatchNorm, whose running statistics the training loss never reads."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(8, 16)
        self.norm = torch.nn.BatchNorm1d(16)
        self.out = torch.nn.Linear(16, 2)
        self.register_buffer("mask", torch.zeros(0), persistent=False)

    def training_step(self, batch, batch_idx):
        x, y = batch
        hidden = self.norm(self.embed(x))
        if self.mask.numel() == 0:
            self.mask = torch.full((len(x), len(x)), float("-inf")).triu(1)
        attended = torch.softmax(hidden @ hidden.T / 4 + self.mask, dim=-1) @ hidden
        return torch.nn.functional.cross_entropy(self.out(attended), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self):
        x = torch.randn(64 * 32, 8, generator=torch.Generator().manual_seed(0))
        return torch.utils.data.DataLoader(list(zip(x, (x[:, 0] > 0).long())), batch_size=32)


class _NaNRunningVarFrom8To20(Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step in (8, 21):
            pl_module.norm.running_var.fill_(float("nan") if trainer.global_step == 8 else 1.0)


def test_a_buffer_infinite_by_design_never_stops_snapshots_and_a_buffer_with_a_nan_is_left_out():
    """A ``-inf`` mask built by the first forward was finite (empty) when the guard first saw it, so every
    later snapshot was left out, with advice about a NaN branch; under a resume the record was lost and the
    opposite happened. Buffers are now left out for a NaN only: the mask never stops snapshots, while the NaN
    in the running variance (steps 8 to 20) leaves the snapshots of steps 10 to 20 out."""
    pl.seed_everything(0)
    model = _CausalMaskBuiltAtFirstForward()
    guard = StabilityGuard(warmup=5, snapshot_every=5, rollback_margin=5)
    trainer = pl.Trainer(max_steps=40, callbacks=[_NaNRunningVarFrom8To20(), guard], **trainer_kwargs())
    with pytest.warns(UserWarning) as caught:
        trainer.fit(model)
    left_out = [str(w.message) for w in caught if str(w.message).startswith("StabilityGuard: no snapshot")]
    assert len(left_out) == 1 and left_out[0].startswith(
        "StabilityGuard: no snapshot at step 10: norm.running_var holds non-finite values."
    )
    assert guard.snapshots_taken == 6 and guard.snapshots.steps == [35, 40]  # 0, 5, 25, 30, 35, 40
    assert torch.isinf(guard.snapshots.newest().buffers["mask"]).sum() == 32 * 31 // 2


def test_a_rollback_after_an_unstructured_pruning_event_returns_to_the_snapshot_before_it():
    """Unstructured ScheduledPrune masked the layers after the step-0 snapshot; a NaN weight at step 25 found no
    snapshot that fit, and the run ended normally with NaN weights. The snapshot fits: the layers come back
    unpruned with the record, and the schedule prunes them again to its final sparsity."""

    class BreaksAt25(DigitsBatchNormMLP):
        def on_train_batch_start(self, batch, batch_idx):
            if self.global_step == 25:
                with torch.no_grad():
                    self.net[0].weight_orig[0, 0] = float("nan")

    pl.seed_everything(0)
    model, guard = BreaksAt25(), StabilityGuard(snapshot_every=30)
    prune = ScheduledPrune(every=10, start=10, end=50, probe_batches=0)
    trainer = pl.Trainer(max_epochs=3, callbacks=[prune, guard], **trainer_kwargs())
    trainer.fit(model, _digits_loader())
    assert guard.rollbacks == 1 and [e["to_step"] for e in guard.events if e["event"] == "rollback"] == [0]
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert prune.events[-1]["sparsity"] == pytest.approx(0.5, abs=0.01)


class _DigitsBackboneMLP(pl.LightningModule):
    """A fine-tuning module as BackboneFinetuning expects it: a ``backbone`` and a ``head``, the optimizer over
    the trainable parameters only (the backbone joins it later as a new parameter group)."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU())
        self.head = torch.nn.Linear(64, 10)

    def forward(self, x):
        return self.head(self.backbone(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam([p for p in self.parameters() if p.requires_grad], lr=3e-3)


def test_a_rollback_after_backbone_finetuning_added_a_param_group_returns_to_a_snapshot_that_fits():
    """BackboneFinetuning adds the backbone to the optimizer as a new parameter group at epoch 1 (step 29). A
    fault at step 45 rolled back to the step-0 snapshot, whose optimizer state has one group: the weights were
    restored, then ``Optimizer.load_state_dict`` raised "loaded state dict has a different number of parameter
    groups" mid-run. The guard now snapshots at the end of the first step after the change and returns there."""
    from lightning.pytorch.callbacks import BackboneFinetuning

    pl.seed_everything(0)
    model, guard = _DigitsBackboneMLP(), StabilityGuard()
    fault = FaultInjector("nan_output", start=45, length=3)  # NaN outputs: three flagged steps, a rollback
    callbacks = [BackboneFinetuning(unfreeze_backbone_at_epoch=1), guard, fault]
    trainer = pl.Trainer(max_epochs=3, callbacks=callbacks, **trainer_kwargs())
    with pytest.warns(UserWarning, match="rollback 1 at step 47 to the snapshot of step 30"):
        trainer.fit(model, _digits_loader())
    assert trainer.global_step == 3 * 29 and guard.rollbacks == 1
    assert len(trainer.optimizers[0].param_groups) == 2
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert all(snapshot.fits(model, trainer.optimizers) for snapshot in guard.snapshots)


def test_a_rollback_with_no_snapshot_that_fits_the_optimizers_groups_stops_without_restoring_anything(
    tmp_path,
):
    """A parameter group added by the user (``optimizer.add_param_group``) in the very step a weight goes NaN:
    no healthy step came after the change, so no snapshot fits the optimizer. The guard used to restore the
    weights and then crash in ``Optimizer.load_state_dict``; it now checks before loading anything and stops
    the run with a checkpoint of the current state, saying why."""

    class UnfreezeAndBreakAt20(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 20 and len(trainer.optimizers[0].param_groups) == 1:
                pl_module.backbone.requires_grad_(True)
                trainer.optimizers[0].add_param_group({"params": list(pl_module.backbone.parameters())})
                with torch.no_grad():
                    pl_module.head.weight[0, 0] = float("nan")

    pl.seed_everything(0)
    model, guard = _DigitsBackboneMLP(), StabilityGuard(snapshot_every=10)
    model.backbone.requires_grad_(False)
    trainer = pl.Trainer(
        max_epochs=2, callbacks=[guard, UnfreezeAndBreakAt20()], default_root_dir=tmp_path, **trainer_kwargs()
    )
    with pytest.raises(
        StabilityGuardError, match=r"no snapshot fits .*optimizer's parameter groups"
    ) as error:
        trainer.fit(model, _digits_loader())
    assert guard.rollbacks == 0 and trainer.global_step == 21
    assert math.isnan(model.head.weight[0, 0].item())  # nothing was loaded: the state is the current one
    assert torch.load(error.value.checkpoint_path, weights_only=False)["global_step"] == 21


class _SWAClassifier(pl.LightningModule):
    def __init__(self, step_lr: bool) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
        self.step_lr = step_lr

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.05)
        if not self.step_lr:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.9)}


class _NaNWeightAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step == self.step:
            with torch.no_grad():
                pl_module.net[0].weight[0, 0] = float("nan")


def _swa_fit(tmp_path, step_lr: bool, nan_at: int) -> tuple[pl.Trainer, StabilityGuard, _SWAClassifier]:
    """80 samples in batches of 8: 10 steps an epoch; StochasticWeightAveraging starts at epoch 1 (step 10),
    swapping StepLR for its SWALR, or adding SWALR where the module has no scheduler."""
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(80, 8, generator=generator), torch.randint(0, 3, (80,), generator=generator)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    pl.seed_everything(0)
    model = _SWAClassifier(step_lr)
    guard = StabilityGuard(snapshot_every=5, rollback_margin=2, max_snapshots=2, skip_after_rollback=2)
    swa = StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=2)
    callbacks = [_NaNWeightAt(nan_at), guard, swa]
    trainer = pl.Trainer(max_epochs=3, callbacks=callbacks, default_root_dir=tmp_path, **trainer_kwargs())
    trainer.fit(model, loader)
    return trainer, guard, model


@pytest.mark.parametrize("step_lr", [False, True], ids=["no-scheduler", "step-lr"])
def test_a_rollback_after_swa_swapped_in_its_scheduler_returns_to_a_snapshot_taken_since(tmp_path, step_lr):
    """A NaN weight at step 12, in SWA's first epoch: the rollback returned to the step-10 snapshot, taken
    before SWA swapped in SWALR. With no scheduler of the module's, it raised "The snapshot holds 1
    optimizer(s) and 0 scheduler(s), but 1 and 1 were given" out of the batch end; with StepLR, StepLR's state
    went into SWALR and the restored groups lacked SWALR's ``swa_lr`` (``KeyError`` at the epoch's scheduler
    step). The first healthy step after the swap is snapshotted now, and a snapshot of other schedulers is
    never returned to."""
    from torch.optim.swa_utils import SWALR

    with pytest.warns(UserWarning, match="rollback 1 at step 13 to the snapshot of step 11"):
        trainer, guard, model = _swa_fit(tmp_path, step_lr, nan_at=12)
    assert guard.rollbacks == 1 and not guard.stopped and trainer.global_step == 30
    assert [type(config.scheduler) for config in trainer.lr_scheduler_configs] == [SWALR]
    assert all("swa_lr" in group for group in trainer.optimizers[0].param_groups)
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("step_lr", [False, True], ids=["no-scheduler", "step-lr"])
def test_a_rollback_with_no_snapshot_of_swas_scheduler_stops_with_a_checkpoint(tmp_path, step_lr):
    """The weight goes NaN in the first step after the swap: the snapshot due then is left out (a NaN), and
    every snapshot held is of the schedulers before the swap. The run stops with a checkpoint of the
    current state, saying why, instead of crashing mid-run in a scheduler's ``load_state_dict``."""
    with pytest.raises(StabilityGuardError, match=r"no snapshot with a finite state that fits") as error:
        _swa_fit(tmp_path, step_lr, nan_at=10)
    assert torch.load(error.value.checkpoint_path, weights_only=False)["global_step"] == 12


def test_restore_snapshot_checks_the_optimizers_groups_before_loading_anything():
    from lightning_pulse.core.snapshots import restore_snapshot, take_snapshot

    model = _DigitsBackboneMLP()
    optimizer = torch.optim.SGD(model.head.parameters(), lr=0.1)
    snapshot = take_snapshot(0, model, [optimizer])
    optimizer.add_param_group({"params": list(model.backbone.parameters())})
    assert snapshot.fits(model) and not snapshot.fits(model, [optimizer])
    with torch.no_grad():
        model.head.weight.add_(1.0)
    changed = model.head.weight.detach().clone()
    with pytest.raises(ValueError, match="parameter groups"):
        restore_snapshot(snapshot, model, [optimizer])
    assert torch.equal(model.head.weight, changed) and len(optimizer.param_groups) == 2


def test_a_clean_run_ends_with_one_line_of_what_the_guard_watched(caplog):
    """A run with nothing to answer still says, once, how many steps the guard judged and against what baseline
    (before, a clean run ended in silence: nothing told the user the guard was watching)."""
    pl.seed_everything(0)
    guard = StabilityGuard(warmup=10)
    trainer = pl.Trainer(max_epochs=2, callbacks=[guard], **trainer_kwargs())
    with caplog.at_level(logging.INFO):
        trainer.fit(DigitsBatchNormMLP(), _digits_loader())
    lines = [record.getMessage() for record in caplog.records if "StabilityGuard:" in record.getMessage()]
    assert guard.spikes_detected == 0 and guard.rollbacks == 0
    assert len(lines) == 1, lines
    assert re.fullmatch(
        r"StabilityGuard: no spike or non-finite value in this fit's 58 optimizer step\(s\) \(medians of "
        r"the last 100 at "
        r"most: loss [0-9.e-]+, grad norm [0-9.e-]+\)\.",
        lines[0],
    ), lines[0]


def test_the_clean_run_line_of_a_resumed_fit_counts_only_this_fits_steps(tmp_path, caplog):
    """The line counted the detector's judged steps, which the checkpoint carries: a fit resumed after one
    epoch (29 steps) for a second one said 58 optimizer steps, 29 of them another fit's."""
    pl.seed_everything(0)
    first = pl.Trainer(max_epochs=1, callbacks=[StabilityGuard(warmup=10)], **trainer_kwargs())
    first.fit(DigitsBatchNormMLP(), _digits_loader())
    first.save_checkpoint(tmp_path / "epoch-1.ckpt")
    guard = StabilityGuard(warmup=10)
    trainer = pl.Trainer(max_epochs=2, callbacks=[guard], **trainer_kwargs())
    caplog.clear()
    with caplog.at_level(logging.INFO):
        trainer.fit(DigitsBatchNormMLP(), _digits_loader(), ckpt_path=tmp_path / "epoch-1.ckpt")
    lines = [record.getMessage() for record in caplog.records if "StabilityGuard:" in record.getMessage()]
    assert guard.spikes_detected == 0 and guard.detector.accepted_steps == 58 and trainer.global_step == 58
    assert len(lines) == 1 and lines[0].startswith(
        "StabilityGuard: no spike or non-finite value in this fit's 29 optimizer step(s) (medians of "
    ), lines


class _GaussianNLLRegressor(pl.LightningModule):
    """A heteroscedastic regression (mean and log-variance heads) on ``F.gaussian_nll_loss``: its loss goes
    negative once the predicted variance falls below ``1 / (2 pi)``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        mean, log_var = self.net(batch[0]).unbind(-1)
        loss = torch.nn.functional.gaussian_nll_loss(mean, batch[1], log_var.exp())
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def _gaussian_nll_loader():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(640, 8, generator=generator)
    y = x @ torch.randn(8, generator=generator) * 0.5 + 0.05 * torch.randn(640, generator=generator)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32, shuffle=True)


def test_the_end_line_of_a_loss_gone_negative_says_how_many_losses_a_log_scale_left_unjudged(caplog):
    """A Gaussian NLL loss goes negative: a log scale cannot judge a loss <= 0. The end line said "no spike"
    over all the steps and gave as the loss median that of the positive losses only (0.55 where the run's was
    -0.6); it now counts the unjudged losses, names the way out and gives no loss median. On the linear scale
    every loss is judged: the usual line, whose loss median is the run's."""
    lines, grad_norms = {}, {}
    for scale in ("log", "linear"):
        pl.seed_everything(0)
        model = _GaussianNLLRegressor()
        guard = StabilityGuard(config={"loss_scale": scale})
        trainer = pl.Trainer(max_epochs=2, callbacks=[guard], **trainer_kwargs())
        caplog.clear()
        with caplog.at_level(logging.INFO), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the mid-run warning about the first loss <= 0
            trainer.fit(model, _gaussian_nll_loader())
        lines[scale] = [
            r.getMessage() for r in caplog.records if r.getMessage().startswith("StabilityGuard:")
        ]
        assert guard.spikes_detected == 0 and trainer.global_step == len(model.losses) == 40
        grad_norms[scale] = guard.detector.baseline(POOLED)["grad_norm"]
    unjudged = sum(loss <= 0 for loss in model.losses)
    assert 0 < unjudged < 40, model.losses  # both kinds of loss, so a positive-only median would differ
    assert lines["log"] == [
        "StabilityGuard: no spike or non-finite value in this fit's 40 optimizer step(s), but "
        f"{unjudged} of their losses were <= 0, which a log scale cannot judge, so a loss spike there would "
        "have gone unnoticed: pass `config=StabilityGuardConfig(loss_scale='linear')` for such losses "
        f"(medians of the last 100 at most: grad norm {grad_norms['log']:.4g}; "
        "no loss median: on a log scale it would be of the positive losses only)."
    ], lines["log"]
    assert lines["linear"] == [
        "StabilityGuard: no spike or non-finite value in this fit's 40 optimizer step(s) (medians of the "
        f"last 100 at most: loss {np.median(model.losses):.4g}, grad norm {grad_norms['linear']:.4g})."
    ], lines["linear"]


class _TripletEncoder(pl.LightningModule):
    """A triplet-margin embedding (anchor, a noisy positive, a rolled-batch negative): once it converges the
    loss is exactly 0 on many steps, as a hinge or margin-ranking loss."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x = batch[0]
        anchor, positive = self.enc(x), self.enc(x + 0.05 * torch.randn_like(x))
        loss = torch.nn.functional.triplet_margin_loss(anchor, positive, self.enc(x.roll(1, 0)), margin=1.0)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


def test_a_triplet_loss_at_zero_on_most_steps_trains_without_a_false_spike_on_the_log_scale(caplog):
    """A converged triplet loss is exactly 0 on many steps. The guard's advice for a loss at 0 on the default
    log scale was to switch to a linear scale, where a window at 0 has a median and a MAD of 0 and every
    positive loss is a spike (9 in these 300 healthy steps, 50 skipped, 3 rollbacks; in 600 steps
    StabilityGuardError stopped it). The log scale trains it with no flag, and its messages say the 0s are
    left out, advising a linear scale only for a loss below 0."""
    pl.seed_everything(0)
    model = _TripletEncoder()
    guard = StabilityGuard()  # the log scale
    trainer = pl.Trainer(max_steps=300, callbacks=[guard], **trainer_kwargs())
    data = torch.utils.data.TensorDataset(torch.randn(512, 8))
    with caplog.at_level(logging.INFO), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=32, shuffle=True))
    zeros = sum(loss == 0 for loss in model.losses)
    assert 0.2 * 300 < zeros < 0.8 * 300, zeros  # many steps at 0, many positive ones
    flagged = [event["step"] for event in guard.events if event.get("event") == "loss_spike"]
    assert flagged == [] and guard.rollbacks == 0 and guard.steps_skipped == 0, guard.events
    said = [str(w.message) for w in caught] + [r.getMessage() for r in caplog.records]
    guard_said = [line for line in said if line.startswith("StabilityGuard:")]
    # the advice to switch ("pass `config=StabilityGuardConfig(loss_scale='linear')` for such losses") is gone
    assert not any("for such losses" in line for line in guard_said), guard_said
    assert any(line.startswith("StabilityGuard: the loss is 0, which a log scale") for line in guard_said)
    grad_norm = guard.detector.baseline(POOLED)["grad_norm"]
    assert guard_said[-1] == (
        "StabilityGuard: no spike or non-finite value in this fit's 300 optimizer step(s), but "
        f"{zeros} of their losses were 0, which a log scale leaves out of its loss baselines: the "
        "positive losses were judged against the positive ones (once `warmup` of them fell within the "
        "last `window` steps; before, only a loss 10x their median was a spike) (medians of the last 100 "
        f"at most: grad norm {grad_norm:.4g}; no loss median: on a log scale it would be of the positive "
        "losses only)."
    ), guard_said


class _SpikyLinearMLP(pl.LightningModule):
    """Two Linear layers; the loss times 1e4 at steps 34-36: a spike the guard rolls back."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))

    def training_step(self, batch, batch_idx):
        loss = torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1])
        return loss * 1e4 if self.global_step in (34, 35, 36) else loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def test_a_rollback_keeps_the_pruning_of_lightnings_model_pruning_done_since_the_snapshot():
    """Review of sweep 20a: Lightning's ModelPruning pruned half the Linear weights once, at the end of epoch 0
    (step 20); a rollback from step 35 to the step-15 snapshot gave them masks of ones, and nothing pruned
    them again (0% zeros at fit end, no warning). Masks ScheduledPrune does not own stay: the snapshot's
    weights go back under them."""
    from lightning.pytorch.callbacks import ModelPruning

    torch.manual_seed(0)
    x = torch.randn(320, 8)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x[:, :4].argmax(1)), batch_size=16)
    model = _SpikyLinearMLP()
    once = ModelPruning("l1_unstructured", amount=0.5, apply_pruning=lambda epoch: epoch == 0, verbose=0)
    guard = StabilityGuard(
        warmup=10, window=20, snapshot_every=15, rollback_after=2, skip_after_rollback=2, rollback_margin=10
    )
    pl.Trainer(max_steps=60, callbacks=[once, guard], **trainer_kwargs()).fit(model, loader)

    assert [(e["step"], e["to_step"]) for e in guard.events if e["event"] == "rollback"] == [(35, 15)]
    weights = [layer.weight for layer in model.net if isinstance(layer, torch.nn.Linear)]  # folded at fit end
    zeros = sum(int((weight == 0).sum()) for weight in weights) / sum(weight.numel() for weight in weights)
    assert zeros == pytest.approx(0.5, abs=1e-3)


def test_detect_anomaly_is_said_at_train_start_and_not_without_it(small_data):
    # held-out sweep: with Trainer(detect_anomaly=True) the first NaN raises in backward, before the guard
    # can skip the step, and nothing said so
    def fit(detect_anomaly):
        pl.seed_everything(0)
        trainer = pl.Trainer(
            callbacks=[StabilityGuard()], max_steps=2, detect_anomaly=detect_anomaly, **trainer_kwargs()
        )
        trainer.fit(MNIST1DClassifier(arch="mlp"), small_data)

    with pytest.warns(UserWarning, match=r"^StabilityGuard: `Trainer\(detect_anomaly=True\)` raises"):
        fit(True)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="StabilityGuard: `Trainer")
        fit(False)


def test_a_burst_back_after_replay_and_maintain_is_not_flagged_for_the_drift_of_its_absence():
    """A held-out sweep (25th pass): an MLP on digits with PulseCycle(burst=20, replay=10, maintain=5) and
    StabilityGuard(warmup=10), no fault. The gradient norm grew about 4x while the burst was away; the first
    burst step after maintain was flagged against the burst window of steps 10-19: two skips, a rollback, 58
    steps lost, accuracy 0.733 against 0.907. A spike must now also stand out among every phase's values."""
    from sklearn.datasets import load_digits
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    digits = load_digits()
    features = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    order = torch.randperm(len(features), generator=torch.Generator().manual_seed(0))
    dataset = TensorDataset(features[order][:1400], torch.tensor(digits.target)[order][:1400])

    class DigitsMLP(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            widths = [64, 48, 48, 48]
            layers = [m for a, b in zip(widths, widths[1:]) for m in (nn.Linear(a, b), nn.ReLU())]
            self.net = nn.Sequential(*layers, nn.Linear(48, 10))

        def training_step(self, batch, batch_idx):
            return nn.functional.cross_entropy(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=3e-3)

    pl.seed_everything(0, verbose=False)
    cycle = PulseCycle(burst=20, replay=10, maintain=5, warmup=0.0, anneal=0.0, maintain_eval="none")
    guard = StabilityGuard(warmup=10)
    loader = DataLoader(dataset, batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(1))
    pl.Trainer(max_steps=80, callbacks=[cycle, guard], **trainer_kwargs()).fit(DigitsMLP(), loader)
    assert guard.events == [] and guard.steps_skipped == 0 and guard.rollbacks == 0
