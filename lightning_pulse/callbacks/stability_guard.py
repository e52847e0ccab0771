"""StabilityGuard: notice divergence, skip or roll back, and keep training instead of restarting the run."""

from __future__ import annotations

import math
import os
from functools import partial
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_pulse.callbacks.pulse_cycle import PulseCycle, pulse_cycle_of
from lightning_pulse.core.carried_state import carried_tensors, restore_carried_tensors
from lightning_pulse.core.fault_origin import describe_bad_samples, trace_nonfinite
from lightning_pulse.core.grad_norm import step_loss_and_grad_norm
from lightning_pulse.core.snapshots import RollbackState, SnapshotSchedule
from lightning_pulse.core.spike_detection import SpikeDetector, Verdict
from lightning_pulse.core.stability_policy import (
    Action,
    EscalationPolicy,
    StabilityGuardConfig,
    StepChanges,
    StepEnergy,
)
from lightning_pulse.errors import PulseRefusal, refuse_sharded_strategy
from lightning_pulse.phase import Phase, PhaseChange
from lightning_pulse.protocols import PhaseListener, RollbackAware, listeners

__all__ = ["StabilityGuard", "StabilityGuardConfig", "StabilityGuardError"]

NONFINITE = (Verdict.NONFINITE_LOSS, Verdict.NONFINITE_GRAD)


class StabilityGuardError(RuntimeError):
    """Raised by :class:`StabilityGuard` when rollbacks no longer help; a checkpoint was saved first."""

    def __init__(self, message: str, checkpoint_path: str) -> None:
        super().__init__(message)
        self.checkpoint_path = checkpoint_path


def _from_policy(name: str) -> property:
    return property(lambda self: getattr(self.policy, name), doc=f"The policy's ``{name}`` (checkpointed).")


class StabilityGuard(Callback):
    r"""Detects non-finite values and loss or gradient-norm spikes, and answers them, escalating.

    Every optimizer step the guard reads the step's loss (the mean over the accumulation window and, under
    DDP, over ranks) and the global gradient norm before clipping, and asks its
    :class:`~lightning_pulse.core.spike_detection.SpikeDetector` for a verdict: non-finite, or a robust
    z-score (median and MAD, log scale) above the threshold against a window of recent healthy steps, kept
    per pulse phase (a phase that just started is judged against all phases' spread, so a phase change is not
    a spike). Before any window is warm, a loss ten times the median of the losses so far is divergence.
    Its :class:`~lightning_pulse.core.stability_policy.EscalationPolicy` answers:

    1. **Skip**: the flagged step's update is dropped; parameters and optimizer state stay untouched. A
       non-finite step whose batch holds non-finite values is the data's fault: it is skipped, never
       escalated, its samples are kept in ``bad_samples`` (dataset indices where the batch or the loader
       tells them) and counted in ``bad_batches``; a non-finite model state rolls back at once.
    2. **Roll back**: after ``rollback_after`` flagged steps, the model, optimizer, LR schedulers and the
       callbacks that opt in (:class:`~lightning_pulse.protocols.RollbackAware`) return to the newest CPU
       snapshot taken at least ``rollback_margin`` steps before the trouble began; the next
       ``skip_after_rollback`` batches are not trained on.
    3. **Stop**: when a rollback is needed after ``max_rollbacks`` recent ones, the guard returns to the last
       good snapshot, saves a checkpoint and raises :class:`StabilityGuardError`.

    Snapshots are taken every ``snapshot_every`` steps, at each maintain phase of a
    :class:`~lightning_pulse.PulseCycle` and after a structured pruning event, never during an incident;
    ``max_snapshots`` are kept. Public counters (also logged under ``stability/``): ``spikes_by_kind``,
    ``steps_skipped``, ``rollbacks``, ``steps_undone``, ``steps_lost``, ``events`` and, with an
    ``EnergyLogger``, ``energy_wasted_kwh``. Decisions come from all-reduced numbers, so all DDP ranks act
    alike. Put the guard after callbacks that change gradients (``GradientCache``).

    Args:
        loss_zscore: robust z-score above which a loss is a spike; ``None`` turns loss spikes off.
        grad_norm_zscore: the same for the gradient norm; ``None`` turns it off.
        window: optimizer steps in each running baseline window.
        warmup: healthy steps a window needs before it judges spikes (non-finite values are always caught).
        rollback_after: flagged steps within ``config.spike_memory`` steps that trigger a rollback.
        skip_after_rollback: optimizer steps (batches, or accumulation windows) skipped after a rollback.
        snapshot_every: take a snapshot every this many optimizer steps; ``0``: only at maintain phases, after
            pruning events and at the start of training.
        max_snapshots: snapshots kept in CPU memory.
        rollback_margin: a snapshot counts as good only if taken at least this many steps before the first
            flagged step of the incident (damage can precede its detection).
        max_rollbacks: rollbacks allowed within ``config.rollback_memory`` steps; the next needed one stops.
        config: the rarely turned knobs (:class:`~lightning_pulse.core.stability_policy.StabilityGuardConfig`).

    Raises:
        ValueError: at construction, naming the argument, for a value out of range.
        PulseRefusal: at fit start, for a module using manual optimization, or under FSDP, DeepSpeed or
            model parallelism (a rank holds a shard of the parameters and gradients).
        StabilityGuardError: during training, when the guard stops the run (after saving a checkpoint).

    Example::

        from lightning import Trainer
        from lightning_pulse import StabilityGuard

        trainer = Trainer(max_epochs=20, callbacks=[StabilityGuard(snapshot_every=200, skip_after_rollback=50)])
    """

    spikes_by_kind = _from_policy("spikes_by_kind")
    steps_skipped = _from_policy("steps_skipped")
    bad_batches = _from_policy("bad_batches")
    rollbacks = _from_policy("rollbacks")
    steps_undone = _from_policy("steps_undone")
    energy_wasted_kwh = _from_policy("energy_wasted_kwh")
    lineage_steps = _from_policy("lineage_steps")
    stopped = _from_policy("stopped")
    events = _from_policy("events")
    last_snapshot_step = property(
        lambda self: self.schedule.last_step, doc="The step of the newest snapshot."
    )
    snapshots_taken = property(lambda self: self.schedule.taken, doc="Snapshots taken in this fit.")

    def __init__(
        self,
        loss_zscore: float | None = 6.0,
        grad_norm_zscore: float | None = 8.0,
        window: int = 100,
        warmup: int = 50,
        rollback_after: int = 3,
        skip_after_rollback: int = 20,
        snapshot_every: int = 100,
        max_snapshots: int = 2,
        rollback_margin: int = 10,
        max_rollbacks: int = 3,
        config: StabilityGuardConfig | None = None,
    ) -> None:
        super().__init__()
        config = StabilityGuardConfig() if config is None else config
        if not isinstance(config, StabilityGuardConfig):
            raise ValueError(f"`config`={config!r} must be a StabilityGuardConfig or None.")
        self.config = config
        self.detector = SpikeDetector(
            loss_zscore, grad_norm_zscore, window, warmup, config.min_ratio, config.loss_scale
        )
        self.policy = EscalationPolicy(
            rollback_after,
            config.spike_memory,
            skip_after_rollback,
            max_rollbacks,
            config.rollback_memory,
            config.lr_cooldown_steps,
        )
        self.schedule = SnapshotSchedule(snapshot_every, max_snapshots, rollback_margin)
        self.snapshots = self.schedule.ring
        self._changes = StepChanges()
        self._losses: list[torch.Tensor] = []  # the micro-batch losses of the current optimizer step
        self._batches: list[tuple[int, Any]] = []  # and its micro-batches, by reference
        self.bad_samples: list[dict[str, Any]] = []  # {"step", "batch_idx", "rows", "indices"}, newest last
        self._decided: Action | None = None  # the current optimizer step's action, until its batch end
        self._cycle: PulseCycle | None = None
        self._energy = StepEnergy()

    @property
    def spikes_detected(self) -> int:
        return sum(self.spikes_by_kind.values())

    @property
    def steps_lost(self) -> int:
        """Optimizer steps whose work is not in the model: skipped ones plus those undone by rollbacks."""
        return self.steps_skipped + self.steps_undone

    def metrics(self) -> dict[str, float]:
        """The stability figures of the run so far, as logged under ``stability/``."""
        out = {
            "stability/spikes": float(self.spikes_detected),
            "stability/steps_skipped": float(self.steps_skipped),
            "stability/bad_batches": float(self.bad_batches),
            "stability/rollbacks": float(self.rollbacks),
            "stability/steps_lost": float(self.steps_lost),
            **{f"stability/spikes_{kind}": float(n) for kind, n in self.spikes_by_kind.items()},
        }
        if self._energy.read is not None:
            out["stability/energy_wasted_kwh"] = self.energy_wasted_kwh
        return out

    # ------------------------------------------------------------------ hooks
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if not pl_module.automatic_optimization:
            raise PulseRefusal(
                "StabilityGuard supports automatic optimization only; this module sets "
                "`automatic_optimization = False`. Let Lightning run the optimizer (return the loss from "
                "`training_step`), or remove StabilityGuard from the callbacks."
            )
        refuse_sharded_strategy(
            trainer,
            "StabilityGuard",
            "each rank holds a shard of the parameters and gradients, so its gradient norm, snapshots and "
            "rollbacks would be a shard's, not the model's",
        )

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._changes.attach(trainer.optimizers)
        self._cycle = pulse_cycle_of(trainer)
        readers = [getattr(callback, "energy_so_far_kwh", None) for callback in trainer.callbacks]
        self._energy = StepEnergy(next((r for r in readers if callable(r)), None), warn=rank_zero_warn)
        self._losses, self._batches, self._decided, self.schedule.pending = [], [], None, False
        self.snapshots.clear()
        self._take_snapshot(trainer, pl_module)  # the state training starts from (or resumes at) is good

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._energy.begin()  # at the first batch of an optimizer step
        self._batches.append((batch_idx, batch))

    @override
    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor
    ) -> None:
        self._losses.append(loss.detach())  # read once per optimizer step, with the gradient norm

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        # after the accumulation window, DDP's all-reduce and the AMP unscale; before clipping. LBFGS runs this
        # once per closure evaluation: the last decision counts (booked once, at the batch end).
        losses, self._losses = self._losses, []
        batches = self._batches  # kept to the batch end: LBFGS may decide again, on the same batch
        if self.policy.forced_skip():
            self._changes.skip(optimizer)
            self._decided = Action.SKIP
            return
        reduce = partial(trainer.strategy.reduce, reduce_op="sum") if trainer.world_size > 1 else None
        loss, grad_norm = step_loss_and_grad_norm(optimizer.param_groups, losses, reduce, trainer.world_size)
        key = self._baseline_key()
        unjudged_before = self.detector.unjudged_losses
        verdict = self.detector.assess(loss, grad_norm, key, accept=True).verdict
        if self.detector.unjudged_losses and not unjudged_before:
            rank_zero_warn(
                f"StabilityGuard: the loss is {loss:.4g} <= 0, which a log scale cannot judge; loss spikes go "
                "unnoticed. Pass `config=StabilityGuardConfig(loss_scale='linear')` for such losses."
            )
        step = trainer.global_step
        cause = self._nonfinite_cause(trainer, pl_module, batches) if verdict in NONFINITE else None
        self._decided = action = self.policy.decide(step, verdict, cause)
        if action is Action.APPLY:
            if self.policy.cooldown_remaining and self.config.lr_factor_after_rollback < 1:
                self._changes.scale_lr(optimizer, self.config.lr_factor_after_rollback)
            return
        self._changes.skip(optimizer)
        if cause == "data":
            return
        baseline = self.detector.baseline(key)
        rank_zero_info(
            f"StabilityGuard: step {step} flagged as {verdict} (loss={_fmt(loss)}, grad_norm={_fmt(grad_norm)}; "
            f"{key} medians loss={_fmt(baseline['loss'])}, grad_norm={_fmt(baseline['grad_norm'])}); "
            f"action: {action}."
        )

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        action, self._decided = self._decided, None
        if action is None:  # inside an accumulation window
            return
        self._batches = []
        self._changes.restore()  # normally done right after the step; not if a GradScaler skipped it
        self.policy.finish(action, self._energy.end())
        if action is Action.APPLY:
            if self.schedule.due(trainer.global_step, self.policy.healthy):
                self._take_snapshot(trainer, pl_module)
            return
        self.schedule.pending = False  # the maintain entry (or new structure) came with a flagged step
        if action is not Action.SKIP:
            self._roll_back(trainer, pl_module, action)
        self._log(trainer, self.metrics())

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._changes.detach()
        self._log(trainer, self.metrics())
        if self.spikes_detected or self.rollbacks:
            rank_zero_info(
                f"StabilityGuard: {self.spikes_detected} spike(s), {self.steps_skipped} step(s) skipped, "
                f"{self.rollbacks} rollback(s), {self.steps_lost} step(s) of work lost."
            )

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._changes.detach()

    def on_pulse_phase_change(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, change: PhaseChange
    ) -> None:
        """Snapshot at the end of this step when a maintain phase starts, if healthy and the probe is finite
        (after every listener handled the change: a pruning event at maintain entry is inside the snapshot)."""
        if (
            not self.config.snapshot_at_maintain
            or change.current is not Phase.MAINTAIN
            or change.reason == "resume"
        ):
            return
        cycle = pulse_cycle_of(trainer)
        probe = cycle.last_probe if cycle is not None else {}
        if self.policy.healthy and all(math.isfinite(value) for value in probe.values()):
            self.schedule.pending = True

    def on_pulse_parameters_replaced(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, remap: Any
    ) -> None:
        """Snapshot at the end of the step: older snapshots no longer fit a model whose channels were cut."""
        self.schedule.pending = self.schedule.pending or self.policy.healthy

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "detector": self.detector.state_dict(),
            "policy": self.policy.state_dict(),
            "last_snapshot_step": self.last_snapshot_step,
            "bad_samples": self.bad_samples,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.detector.load_state_dict(state_dict["detector"])
        # checkpoints of earlier versions kept the counters next to the policy's state
        self.policy.load_state_dict({**state_dict, **state_dict["policy"]})
        self.bad_samples = [dict(sample) for sample in state_dict.get("bad_samples", [])]
        last = state_dict["last_snapshot_step"]
        self.schedule.last_step = None if last is None else int(last)

    # ------------------------------------------------------------------ non-finite steps
    def _nonfinite_cause(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batches: list
    ) -> str | None:
        """Where a non-finite step came from (``trace_nonfinite``); a data fault's samples are remembered."""
        reduce = partial(trainer.strategy.reduce, reduce_op="sum") if trainer.world_size > 1 else None
        cause, samples = trace_nonfinite(
            pl_module, trainer.optimizers, batches, trainer.global_step, trainer.train_dataloader, reduce
        )
        if cause != "data":
            return cause
        self.bad_samples = [*self.bad_samples, *samples][-1000:]
        if self.policy.bad_batches == 0:
            rank_zero_warn(
                f"StabilityGuard: step {trainer.global_step} has non-finite values in its data "
                f"({describe_bad_samples(samples)}); the model is healthy, so the step is skipped and training "
                "goes on. Later such steps are skipped silently: see `StabilityGuard.bad_samples` and the "
                "`stability/bad_batches` counter."
            )
        return "data"

    # ------------------------------------------------------------------ snapshots and rollbacks
    def _baseline_key(self) -> str:
        if not self.config.per_phase_baselines:
            return "all"
        return self._cycle.phase.value if self._cycle is not None else Phase.BURST.value

    def _training_state(self, trainer: pl.Trainer) -> tuple[list, list, dict[str, RollbackState]]:
        """What a snapshot holds besides the module: optimizers, LR schedulers, the opted-in callbacks."""
        schedulers = [config.scheduler for config in trainer.lr_scheduler_configs]
        return trainer.optimizers, schedulers, self._rollback_callbacks(trainer)

    def _take_snapshot(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        extra = {
            "detector": self.detector.state_dict(),
            "carried": carried_tensors(pl_module),
            **self.policy.lineage(),
        }
        self.schedule.take(trainer.global_step, pl_module, *self._training_state(trainer), extra=extra)

    def _roll_back(self, trainer: pl.Trainer, pl_module: pl.LightningModule, action: Action) -> None:
        """Return to the newest snapshot taken ``rollback_margin`` steps before the incident; then go on
        (``Action.ROLLBACK``) or save a checkpoint and raise (``Action.STOP``)."""
        step = trainer.global_step - 1  # the flagged step that triggered it (already taken)
        recent_rollbacks = len(self.policy.rollback_steps)
        start = self.policy.incident_start
        target, predates = self.schedule.roll_back(
            step if start is None else start,
            pl_module,
            *self._training_state(trainer),
            self.config.rewind_lr_schedule,
        )
        undone = 0
        if target is None:
            rank_zero_warn(
                "StabilityGuard: no snapshot fits the model any more; the parameters stay as they are."
            )
        else:
            if not predates:
                rank_zero_warn(
                    f"StabilityGuard: no snapshot predates step {start} enough; using the oldest one."
                )
            self.detector.load_state_dict(target.extra["detector"])
            restore_carried_tensors(pl_module, target.extra.get("carried", {}))
            undone = self.policy.rewind(target.extra)
            self._announce_restored_phase(trainer, pl_module)
        to_step = None if target is None else target.step
        if action is Action.ROLLBACK:
            self.policy.rolled_back(step, to_step)
            rank_zero_warn(
                f"StabilityGuard: rollback {self.rollbacks} at step {step} to the snapshot of step {to_step} "
                f"({undone} applied step(s) undone); skipping the next {self.policy.skip_remaining} batch(es)."
            )
            return
        self.policy.stop(step, to_step)
        path = self.config.stop_checkpoint_path or os.path.join(
            trainer.default_root_dir, "stability_guard", f"stopped-step={step}.ckpt"
        )
        self._log(trainer, self.metrics())
        trainer.save_checkpoint(path)
        flagged = [str(e["step"]) for e in self.events if e["event"] not in ("rollback", "stop")][-8:]
        raise StabilityGuardError(
            f"StabilityGuard stopped training at step {step}: spikes kept coming after {recent_rollbacks} "
            f"rollback(s) within {self.policy.rollback_memory} steps "
            f"(`max_rollbacks`={self.policy.max_rollbacks}). The checkpoint {path!r} holds the snapshot of step "
            f"{to_step} (None: no snapshot fitted, the current state). Inspect the data around the flagged steps "
            f"(last: {', '.join(flagged)}) or lower the learning rate, then resume from that checkpoint.",
            checkpoint_path=path,
        )

    def _rollback_callbacks(self, trainer: pl.Trainer) -> dict[str, RollbackState]:
        """The callbacks whose state goes back with the model (``RollbackAware``), by index and state key."""
        aware = listeners(trainer, RollbackAware, exclude=self)
        return {f"{trainer.callbacks.index(cb)}:{cb.state_key}": RollbackState(cb) for cb in aware}

    def _announce_restored_phase(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Tell each restored phase listener the current phase (reason ``"resume"``), as after a checkpoint
        restore: the clock did not go back, so the phase it is told is the one training continues in."""
        cycle = pulse_cycle_of(trainer)
        if cycle is None:
            return
        change = PhaseChange(None, cycle.phase, cycle.cycle, cycle.clock.step, "resume")
        for state in self._rollback_callbacks(trainer).values():
            if isinstance(state.callback, PhaseListener):
                state.callback.on_pulse_phase_change(trainer, pl_module, change)

    @staticmethod
    def _log(trainer: pl.Trainer, metrics: dict[str, float]) -> None:
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4g}"
