"""A checkpoint saved inside a training step, before its optimizer update, resumes as the uninterrupted run.

Held-out sweep "interrupt": Lightning's SLURM auto-requeue saves ``hpc_ckpt_N.ckpt`` in its SIGUSR1 handler,
wherever the main thread is (the forward, the backward, ``optimizer.step``), and ``OnExceptionCheckpoint``
saves after an exception raised in ``optimizer.step``. Such a checkpoint holds the weights before the step,
and Lightning resumes it by training that batch again. EnergyLogger counted the batch's samples twice (1312
samples for 1280), GradientCache scored the step twice (a unit frozen that the uninterrupted run never
froze, weights 0.016 off) and StabilityGuard recorded it twice in its detector (41 accepted steps after 40).
Each now saves its state as before the step's booking (``compat.in_unfinished_step``).

The save is made the simplest faithful way: inside ``optimizer.step``, after the closure (forward, backward,
``on_before_optimizer_step``) and before the update, by the module's ``optimizer_step``; the fit goes on, so
the same run is the uninterrupted reference. Saves land at an epoch's first batch, where a plain DataLoader
resumes bit for bit, or anywhere with ``ResumableLoader``, which resumes mid-epoch.
"""

from __future__ import annotations

import os
import signal
import stat

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, OnExceptionCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pulse import EnergyLogger, GradientCache, MeterConfig, StabilityGuard
from lightning_pulse import _lightning_compat as compat
from tests.conftest import trainer_kwargs

BATCHES = 8  # batches of 32 per epoch


class ClosureFirstSGD(torch.optim.SGD):
    """SGD that runs the closure (Lightning's: forward, backward, ``on_before_optimizer_step``), then calls
    ``inside()``, then updates the weights: where SLURM's requeue signal lands in a step."""

    def __init__(self, params, inside, **kwargs):
        super().__init__(params, **kwargs)
        self.inside = inside

    def step(self, closure=None):
        loss = closure()
        self.inside()
        super().step()
        return loss


class Net(pl.LightningModule):
    """An MLP that saves a checkpoint inside ``optimizer.step`` (after the closure, before the update) at global
    step ``save_at`` (``where="training_step"``: inside ``training_step``, before the backward), or raises
    there (``where="raise"``). ``spike_at``: the loss is 1000x at that step (or those steps)."""

    def __init__(self, save_at=None, path=None, where="optimizer_step", spike_at=None):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
        self.save_at, self.path, self.where = save_at, path, where
        self.spike_at = (spike_at,) if isinstance(spike_at, int) else tuple(spike_at or ())
        self.inside: list[bool] = []  # compat.in_unfinished_step at the save

    def _here(self, where):
        if self.where == where and self.trainer.global_step == self.save_at and not self.inside:
            self.inside.append(compat.in_unfinished_step(self.trainer))
            if where == "raise":
                raise RuntimeError("out of memory in the optimizer step")
            self.trainer.save_checkpoint(self.path)

    def training_step(self, batch, batch_idx):
        self._here("training_step")
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        return loss * 1000 if self.trainer.global_step in self.spike_at else loss

    def configure_optimizers(self):
        return ClosureFirstSGD(self.parameters(), self._inside_step, lr=0.05, momentum=0.9)

    def _inside_step(self):
        self._here("optimizer_step")
        self._here("raise")


class ResumableLoader(DataLoader):
    """A DataLoader whose checkpoint state is the batch Lightning trains next (the epoch's batches it
    completed: a batch in flight is trained again), so a resume mid-epoch goes on with the same data."""

    trainer: pl.Trainer | None = None
    skip = 0

    def __iter__(self):
        batches, (skip, self.skip) = super().__iter__(), (self.skip, 0)
        for _ in range(skip):
            next(batches)
        return batches

    def state_dict(self):
        return {"at": self.trainer.fit_loop.epoch_loop.batch_progress.current.processed}

    def load_state_dict(self, state):
        self.skip = state["at"]


def loader(resumable=False):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32 * BATCHES, 20, generator=g)
    y = (x @ torch.randn(20, 4, generator=g)).argmax(1)
    return (ResumableLoader if resumable else DataLoader)(TensorDataset(x, y), batch_size=32)  # no shuffle


def fit(root, callbacks, max_steps, ckpt_path=None, resumable=False, **model_kwargs):
    model = Net(**model_kwargs)
    extra = [c for c in callbacks if isinstance(c, OnExceptionCheckpoint)]
    kwargs = trainer_kwargs(enable_checkpointing=bool(extra), default_root_dir=root, deterministic=True)
    trainer = pl.Trainer(callbacks=callbacks, max_steps=max_steps, **kwargs)
    data = loader(resumable)
    if resumable:
        data.trainer = trainer
    try:
        trainer.fit(model, data, ckpt_path=ckpt_path)
    except RuntimeError as error:
        assert "out of memory" in str(error)
    return trainer, model


def weights(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def energy_logger(root):
    meters = MeterConfig(cpu_watts=10.0)
    return EnergyLogger(cpu="constant", gpu="none", ram="none", meters=meters, report_dir=str(root))


def tables(report):
    """Steps and samples of the whole run and per epoch."""
    rows = {"total": report["total"], **{f"epoch {k}": v for k, v in report["epochs"].items()}}
    return {name: (row["steps"], row["samples"]) for name, row in rows.items()}


@pytest.mark.parametrize("where", ["optimizer_step", "training_step"])
def test_energy_logger_resumed_inside_a_step_counts_that_batch_once(tmp_path, where):
    path = str(tmp_path / "mid_step.ckpt")
    energy = energy_logger(tmp_path / "full")
    _, model = fit(tmp_path / "full", [energy], 3 * BATCHES, save_at=BATCHES, path=path, where=where)
    assert model.inside == [True]  # the save was inside the step, as the test means it to be
    saved = torch.load(path, weights_only=False)["callbacks"]
    held = next(v for k, v in saved.items() if "EnergyLogger" in k)["snapshot"]["buckets"]["total"]
    assert (held["steps"], held["samples"], held["batches"]) == (BATCHES, 32 * BATCHES, BATCHES)
    assert tables(energy.report)["total"] == (3 * BATCHES, 3 * 32 * BATCHES)  # the run goes on

    resumed = energy_logger(tmp_path / "resumed")
    fit(tmp_path / "resumed", [resumed], 3 * BATCHES, ckpt_path=path)
    assert resumed.report["resumed_runs"] == 1
    # without the fix the checkpoint held the batch in flight: the assert on `held` fails (9 batches, 288)
    assert tables(resumed.report) == tables(energy.report)


def test_energy_logger_after_an_exception_in_the_optimizer_step_saves_without_that_batch(tmp_path):
    energy = energy_logger(tmp_path)
    saver = OnExceptionCheckpoint(dirpath=str(tmp_path), filename="on_exception")
    fit(tmp_path, [energy, saver], 3 * BATCHES, save_at=BATCHES, where="raise")
    saved = torch.load(tmp_path / "on_exception.ckpt", weights_only=False)["callbacks"]
    held = next(v for k, v in saved.items() if "EnergyLogger" in k)["snapshot"]["buckets"]["total"]
    assert (held["steps"], held["samples"], held["batches"]) == (BATCHES, 32 * BATCHES, BATCHES)
    # the interrupted fit's own report counts the batch it trained, as before
    assert tables(energy.report)["total"] == (BATCHES, 32 * (BATCHES + 1))


def gradient_cache():
    """Freezes the first unit at steps 3, 12, 21, ..., and releases it for a re-check at steps 9, 18, 27, ..."""
    return GradientCache(threshold=1.0, check_every=3, freeze_for=6)


def freezer_state(cache):
    state = cache.freezer.state_dict()
    return {k: v for k, v in state.items() if k not in ("snapshot", "version")}


# step 9 (the second epoch's first) closes a window and releases the unit frozen at 3; step 17 (the third
# epoch's first) trains with the unit frozen at 12: a frozen share counted, no window closes
@pytest.mark.parametrize("save_at", [BATCHES, 2 * BATCHES])
def test_gradient_cache_resumed_inside_a_step_scores_it_once(tmp_path, save_at):
    path = str(tmp_path / "mid_step.ckpt")
    cache = gradient_cache()
    _, model = fit(tmp_path / "full", [cache], 5 * BATCHES, save_at=save_at, path=path)
    assert model.inside == [True]
    # the run freezes and releases the unit every 3 and 6 steps: a step counted twice moves every later window
    assert [event["step"] for event in cache.events[:4]] == [3, 9, 12, 18]
    saved = next(v for k, v in torch.load(path, weights_only=False)["callbacks"].items() if "Gradient" in k)
    assert saved["cache"]["steps"] == save_at  # the freezer's count of steps before the one in flight
    assert ("movements" in saved["cache"]) == (save_at == BATCHES)  # the window that step closed
    assert saved["cache"]["frozen"] == [True, False, False]  # frozen at 3 (12): released at 9 (18)
    assert [event["step"] for event in saved["events"]][-1] < save_at + 1  # not its release

    resumed = gradient_cache()
    _, resumed_model = fit(tmp_path / "resumed", [resumed], 5 * BATCHES, ckpt_path=path)
    assert resumed.events == cache.events
    assert freezer_state(resumed) == freezer_state(cache)
    assert torch.equal(weights(resumed_model), weights(model))


def test_gradient_cache_after_an_exception_in_the_optimizer_step_resumes_as_the_uninterrupted_run(tmp_path):
    full = gradient_cache()
    _, model = fit(tmp_path / "full", [full], 3 * BATCHES)
    saver = OnExceptionCheckpoint(dirpath=str(tmp_path), filename="on_exception")
    fit(tmp_path, [gradient_cache(), saver], 3 * BATCHES, save_at=BATCHES, where="raise")
    resumed = gradient_cache()
    _, resumed_model = fit(
        tmp_path / "resumed", [resumed], 3 * BATCHES, ckpt_path=str(saver.dirpath) + "/on_exception.ckpt"
    )
    assert resumed.events == full.events
    assert freezer_state(resumed) == freezer_state(full)
    assert torch.equal(weights(resumed_model), weights(model))


def test_gradient_cache_resumed_inside_a_freeze_step_in_the_middle_of_an_epoch(tmp_path):
    """Global step 11 is the fourth batch of the second epoch and freezes the first unit (the step counting 12)."""
    path = str(tmp_path / "mid_step.ckpt")
    cache = gradient_cache()
    _, model = fit(tmp_path / "full", [cache], 3 * BATCHES, resumable=True, save_at=11, path=path)
    assert model.inside == [True]
    saved = next(v for k, v in torch.load(path, weights_only=False)["callbacks"].items() if "Gradient" in k)
    assert (saved["cache"]["steps"], saved["cache"]["frozen"]) == (11, [False, False, False])
    resumed = gradient_cache()
    _, resumed_model = fit(tmp_path / "resumed", [resumed], 3 * BATCHES, ckpt_path=path, resumable=True)
    assert [event["step"] for event in resumed.events] == [
        3,
        9,
        12,
        18,
        21,
    ] and resumed.events == cache.events
    assert freezer_state(resumed) == freezer_state(cache)
    assert torch.equal(weights(resumed_model), weights(model))


class UnfreezeOutsideUnits(Callback):
    """``net.2`` frozen at train start (outside GradientCache's units), turned on at global step ``at``'s
    batch start, in the middle of the first epoch: GradientCache finds it at the next window's end (step 6)."""

    def __init__(self, at):
        self.at = at

    def on_train_start(self, trainer, pl_module):
        pl_module.net[2].requires_grad_(trainer.global_step >= self.at)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.at:
            pl_module.net[2].requires_grad_(True)


@pytest.mark.parametrize("inside", [True, False], ids=["inside the retracing step", "after it"])
def test_gradient_cache_resumed_around_a_retrace_resumes_as_the_uninterrupted_run(tmp_path, inside):
    """The window end of global step 5 finds net.2 training and retraces the units (the freezer goes until the
    next backward orders them). Inside that step the checkpoint held no freezer and the step counted: the
    resume counted it again (windows a step early: events 8/14/17/23 for 9/15/18/24, weights 0.0111 off); it
    holds the freezer as before the step now, and the resumed step finds net.2 at its window end again. After
    the step (no freezer yet), the checkpoint lost the run's statistics (18 steps counted for 24, 2 freezes
    for 3); it keeps them for the next freezer now."""
    path, at = str(tmp_path / "mid_step.ckpt"), 4

    def callbacks(root, save=False):
        saver = [] if inside or not save else [SaveAtBatchEnd(6, path)]
        return [UnfreezeOutsideUnits(at), gradient_cache(), *saver]

    full = callbacks(tmp_path, save=True)
    save = dict(save_at=5, path=path) if inside else {}
    _, model = fit(tmp_path / "full", full, 3 * BATCHES, resumable=True, **save)
    assert [(event["step"], event["reason"]) for event in full[1].events][:3] == [
        (3, "check"),
        (6, "retrace"),
        (9, "check"),
    ]
    resumed = callbacks(tmp_path)
    _, resumed_model = fit(tmp_path / "resumed", resumed, 3 * BATCHES, ckpt_path=path, resumable=True)
    assert resumed[1].events == full[1].events
    assert freezer_state(resumed[1]) == freezer_state(full[1])
    assert torch.equal(weights(resumed_model), weights(model))
    saved = next(v for k, v in torch.load(path, weights_only=False)["callbacks"].items() if "Gradient" in k)
    if inside:  # the freezer before the step, which its window end retraces
        assert (saved["cache"]["steps"], saved["cache"]["outgrown"]) == (5, True)
        assert saved["events"][-1]["step"] == 3  # not the retrace's release
    else:  # the units wait for their order: the statistics for their freezer
        assert saved["cache"] is None and saved["statistics"]["steps"] == 6


class TurnBackOn(Callback):
    """Turns ``net.0`` (frozen by GradientCache at step 3) back on at global step 5's batch start."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == 5:
            pl_module.net[0].requires_grad_(True)


def test_a_unit_turned_back_on_at_a_resumed_fits_first_batch_is_dated_as_its_step(tmp_path):
    """The uninterrupted run finds the unit at global step 5's optimizer step (event step 6); the fit resumed
    from inside that step finds it at its first batch, before the forward, which dated it 5."""
    path = str(tmp_path / "mid_step.ckpt")
    full = [TurnBackOn(), gradient_cache()]
    _, model = fit(tmp_path / "full", full, 3 * BATCHES, resumable=True, save_at=5, path=path)
    assert (6, "taken back") in [(event["step"], event["reason"]) for event in full[1].events]
    resumed = [TurnBackOn(), gradient_cache()]
    _, resumed_model = fit(tmp_path / "resumed", resumed, 3 * BATCHES, ckpt_path=path, resumable=True)
    assert resumed[1].events == full[1].events
    assert torch.equal(weights(resumed_model), weights(model))


def guard():
    return StabilityGuard(warmup=5, window=10)


METERED = ("lineage_energy_kwh", "lineage_unmetered", "energy_wasted_kwh", "steps_lost_unmetered")


def detector_and_policy(guard):
    """The detector's state and the policy's counts (not the energy an EnergyLogger's meter gave it)."""
    state = guard.state_dict()
    return state["detector"], {k: v for k, v in state["policy"].items() if k not in METERED}


@pytest.mark.parametrize("spike", [False, True], ids=["healthy step", "flagged step"])
def test_stability_guard_resumed_inside_a_step_judges_it_once(tmp_path, spike):
    path, save_at = str(tmp_path / "mid_step.ckpt"), 2 * BATCHES
    spike_at = save_at if spike else None  # a loss spike in the step in flight: skipped, counted once
    full = guard()
    _, model = fit(tmp_path / "full", [full], 4 * BATCHES, save_at=save_at, path=path, spike_at=spike_at)
    assert model.inside == [True]
    assert full.spikes_by_kind["loss_spike"] == int(spike)
    saved = next(v for k, v in torch.load(path, weights_only=False)["callbacks"].items() if "Stability" in k)
    assert saved["detector"]["accepted_steps"] == save_at
    assert saved["detector"]["loss"]["*"]["stamps"][-1] == save_at

    resumed = guard()
    fit(tmp_path / "resumed", [resumed], 4 * BATCHES, ckpt_path=path, spike_at=spike_at)
    assert detector_and_policy(resumed) == detector_and_policy(full)  # 33 accepted steps without the fix
    assert resumed.detector.accepted_steps == 4 * BATCHES - int(spike)


def cooling_guard():
    """Rolls back at the first flagged step, skips the next batch, then halves the rate for 10 steps."""
    from lightning_pulse.core.stability_policy import StabilityGuardConfig

    config = StabilityGuardConfig(lr_factor_after_rollback=0.5, lr_cooldown_steps=10)
    kwargs = dict(rollback_after=1, rollback_margin=1, snapshot_every=2, skip_after_rollback=1)
    return StabilityGuard(warmup=5, window=10, config=config, **kwargs)


# a spike at 12: the save's step trains in the cooldown; at 15: the save's step is the skip after the rollback
@pytest.mark.parametrize("spike_at", [12, 15], ids=["cooldown step", "forced skip"])
def test_stability_guard_resumed_inside_a_step_after_a_rollback_resumes_as_the_uninterrupted_run(
    tmp_path, spike_at
):
    """After a rollback the guard skips the next batch, then halves the learning rate of each step of its
    cooldown, in place, putting it back after the step: a checkpoint saved inside such a step held the halved
    rate, and the resumed run took it for the rate (0.025 for 0.05 to the end; weights 0.093 off). The
    optimizer's state now gives the rate the step started from, and a skip in flight is counted once."""
    path, save_at = str(tmp_path / "mid_step.ckpt"), 2 * BATCHES
    full = cooling_guard()
    _, model = fit(tmp_path / "full", [full], 4 * BATCHES, save_at=save_at, path=path, spike_at=spike_at)
    assert full.rollbacks == 1 and model.inside == [True]
    saved = torch.load(path, weights_only=False)
    assert (
        saved["optimizer_states"][0]["param_groups"][0]["lr"] == 0.05
    )  # the cooldown's step trains at 0.025
    policy = next(v for k, v in saved["callbacks"].items() if "Stability" in k)["policy"]
    assert policy["skip_remaining"] == int(spike_at == 15)
    resumed = cooling_guard()
    _, resumed_model = fit(tmp_path / "resumed", [resumed], 4 * BATCHES, ckpt_path=path, spike_at=spike_at)
    assert resumed_model.trainer.optimizers[0].param_groups[0]["lr"] == 0.05
    assert detector_and_policy(resumed) == detector_and_policy(full)
    assert torch.equal(weights(resumed_model), weights(model))


def escalations(guard):
    return guard.state_dict()["policy"]["escalations"]


@pytest.mark.parametrize("inside", [True, False], ids=["inside the second spike's step", "before it"])
def test_stability_guard_resumed_in_an_open_incident_books_its_scores(tmp_path, inside):
    """Spikes at global steps 15 and 16 with ``rollback_after=2``: the second rolls back, and the escalation
    books the thresholds both flagged steps pass at. A checkpoint saved between them (after the first's update,
    or inside the second before its update) left the first's scores out, and the resumed escalation booked
    ``scores=None`` (``[239.3, 58.5]`` uninterrupted)."""
    from lightning_pulse.core.stability_policy import StabilityGuardConfig

    def incident_guard():
        config = StabilityGuardConfig(lr_factor_after_rollback=0.5, lr_cooldown_steps=10)
        kwargs = dict(rollback_after=2, rollback_margin=1, snapshot_every=2, skip_after_rollback=1)
        return StabilityGuard(warmup=5, window=10, config=config, **kwargs)

    path, spikes = str(tmp_path / "incident.ckpt"), (2 * BATCHES - 1, 2 * BATCHES)
    full = incident_guard()
    save = dict(save_at=2 * BATCHES, path=path) if inside else {}
    saver = [] if inside else [SaveAtBatchEnd(2 * BATCHES, path)]
    _, model = fit(tmp_path / "full", [full, *saver], 4 * BATCHES, spike_at=spikes, **save)
    assert full.rollbacks == 1 and escalations(full)[-1]["scores"] is not None
    resumed = incident_guard()
    _, resumed_model = fit(tmp_path / "resumed", [resumed], 4 * BATCHES, ckpt_path=path, spike_at=spikes)
    assert escalations(resumed) == escalations(full)
    assert detector_and_policy(resumed) == detector_and_policy(full)
    assert torch.equal(weights(resumed_model), weights(model))


class SaveAtBatchEnd(Callback):
    """Saves in ``on_train_batch_end`` at global step ``at``, listed before the guard: after the update."""

    def __init__(self, at, path):
        self.at, self.path = at, path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.at:
            assert not compat.in_unfinished_step(trainer)
            trainer.save_checkpoint(self.path)


def test_stability_guard_saved_after_the_update_before_its_batch_end_holds_the_step(tmp_path):
    """The guard books a healthy step's values at its batch end; a checkpoint saved after the update by a
    callback listed before the guard holds them (the resume goes on after that step)."""
    path, at = str(tmp_path / "batch_end.ckpt"), 2 * BATCHES
    full = guard()
    fit(tmp_path / "full", [SaveAtBatchEnd(at, path), full], 4 * BATCHES)
    saved = next(v for k, v in torch.load(path, weights_only=False)["callbacks"].items() if "Stability" in k)
    assert saved["detector"]["accepted_steps"] == at
    resumed = guard()
    fit(tmp_path / "resumed", [resumed], 4 * BATCHES, ckpt_path=path)
    assert detector_and_policy(resumed)[0] == detector_and_policy(full)[0]


class SlurmSignalInStep(Callback):
    """Sends SLURM's requeue signal (SIGUSR1; Lightning's handler saves ``hpc_ckpt_1.ckpt``) and then the
    requeue's SIGTERM from ``on_before_optimizer_step`` at global step ``at``, listed after the callbacks."""

    def __init__(self, at):
        self.at = at

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step == self.at:
            os.kill(os.getpid(), signal.SIGUSR1)
            os.kill(os.getpid(), signal.SIGTERM)


def test_slurm_requeue_signal_inside_a_step_resumes_every_count_as_the_uninterrupted_run(
    tmp_path, monkeypatch
):
    from lightning.pytorch.plugins.environments import SLURMEnvironment
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "scontrol").write_text("#!/bin/sh\nexit 0\n")
    (fake_bin / "scontrol").chmod(stat.S_IRWXU)
    monkeypatch.setenv("PATH", f"{fake_bin}{os.pathsep}{os.environ['PATH']}")
    slurm = dict(SLURM_JOB_ID="4242", SLURM_NTASKS="1", SLURM_NTASKS_PER_NODE="1", SLURM_JOB_NAME="train")
    slurm.update(SLURM_NODELIST="node1", SLURM_LOCALID="0", SLURM_PROCID="0", SLURM_NODEID="0")
    for name, value in slurm.items():
        monkeypatch.setenv(name, value)

    def run(root, signal_at=None, ckpt_path=None):
        callbacks = [energy_logger(root), gradient_cache(), guard()]
        model = Net()
        kwargs = trainer_kwargs(default_root_dir=root, deterministic=True)
        trainer = pl.Trainer(
            callbacks=callbacks + ([SlurmSignalInStep(signal_at)] if signal_at is not None else []),
            max_steps=3 * BATCHES,
            plugins=[SLURMEnvironment(auto_requeue=True)],
            **kwargs,
        )
        try:
            trainer.fit(model, loader(), ckpt_path=ckpt_path)
        except SIGTERMException:
            pass
        energy, cache, stability = callbacks
        return trainer, (tables(energy.report), cache.events, detector_and_policy(stability), weights(model))

    _, full = run(tmp_path / "full")
    first, _ = run(tmp_path / "requeued", signal_at=BATCHES)
    assert (tmp_path / "requeued" / "hpc_ckpt_1.ckpt").exists()  # then the SIGTERM ends the fit
    resumed, after = run(tmp_path / "requeued", ckpt_path="hpc")
    assert resumed.global_step == 3 * BATCHES
    assert after[:3] == full[:3]
    assert torch.equal(after[3], full[3])


def test_the_guards_state_inside_a_step_leaves_out_what_judging_it_counted():
    """Without a Trainer: a healthy step judged (its loss 0, which a log scale cannot judge) and not ended yet:
    the state for a checkpoint saved inside it holds neither its values nor its count of unjudged losses."""
    from lightning_pulse.core.stability_steps import StabilityCore, StepRecord

    core, record, said = StabilityCore(None, 6.0, 8.0, 10, 5, 3, 20, 100, 2, 10, 3), StepRecord(), []
    core.start(0)
    for step in range(8):
        record.take_losses(step + 1)
        core.judge_step(record, step, 0.0 if step == 7 else 1.0, 1.0, "all", lambda: None, said.append)
        if step < 7:
            core.finish_step(record.end(), step + 1)
    inside = core.state_dict(record=record, in_unfinished_step=True)["detector"]
    assert (inside["accepted_steps"], inside["unjudged_losses"], inside["grad_norm"]["*"]["stamps"][-1]) == (
        7,
        0,
        7,
    )
    assert said  # the loss at 0 was said, once
    core.finish_step(record.end(), 8)
    after = core.state_dict()["detector"]
    assert (after["accepted_steps"], after["unjudged_losses"], after["grad_norm"]["*"]["stamps"][-1]) == (
        8,
        1,
        8,
    )
