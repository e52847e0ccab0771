"""StabilityGuard: notice divergence, skip or roll back, and keep training instead of restarting the run."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from typing_extensions import override

from lightning_pulse.callbacks.pulse_cycle import PulseCycle, pulse_cycle_of
from lightning_pulse.core.grad_norm import step_loss_and_grad_norm
from lightning_pulse.core.snapshots import (
    RollbackState,
    SnapshotRing,
    TrainingSnapshot,
    restore_snapshot,
    take_snapshot,
)
from lightning_pulse.core.spike_detection import SpikeDetector
from lightning_pulse.core.stability_policy import (
    Action,
    EscalationPolicy,
    StabilityGuardConfig,
    StepChanges,
    check_int,
)
from lightning_pulse.phase import Phase, PhaseChange
from lightning_pulse.protocols import PhaseListener, RollbackAware, listeners

__all__ = ["StabilityGuard", "StabilityGuardConfig", "StabilityGuardError"]


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
    per pulse phase. Its :class:`~lightning_pulse.core.stability_policy.EscalationPolicy` answers:

    1. **Skip**: the flagged step's update is dropped; parameters and optimizer state stay untouched.
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
        MisconfigurationException: at fit start, for a module using manual optimization.
        StabilityGuardError: during training, when the guard stops the run (after saving a checkpoint).

    Example::

        from lightning import Trainer
        from lightning_pulse import StabilityGuard

        trainer = Trainer(max_epochs=20, callbacks=[StabilityGuard(snapshot_every=200, skip_after_rollback=50)])
    """

    spikes_by_kind = _from_policy("spikes_by_kind")
    steps_skipped = _from_policy("steps_skipped")
    rollbacks = _from_policy("rollbacks")
    steps_undone = _from_policy("steps_undone")
    energy_wasted_kwh = _from_policy("energy_wasted_kwh")
    lineage_steps = _from_policy("lineage_steps")
    stopped = _from_policy("stopped")
    events = _from_policy("events")

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
        check_int("snapshot_every", snapshot_every, minimum=0)
        check_int("max_snapshots", max_snapshots, minimum=1)
        check_int("rollback_margin", rollback_margin, minimum=0)
        if snapshot_every and (max_snapshots - 1) * snapshot_every < rollback_margin:
            raise ValueError(
                f"`max_snapshots`={max_snapshots} snapshots every `snapshot_every`={snapshot_every} steps never "
                f"reach `rollback_margin`={rollback_margin} steps back; allowed: (max_snapshots - 1) * "
                "snapshot_every >= rollback_margin."
            )
        self.snapshot_every = snapshot_every
        self.rollback_margin = rollback_margin
        self.snapshots = SnapshotRing(max_snapshots)
        self.last_snapshot_step: int | None = None
        self.snapshots_taken = 0
        self._changes = StepChanges()
        self._losses: list[torch.Tensor] = []  # the micro-batch losses of the current optimizer step
        self._decided: Action | None = None  # the current optimizer step's action, until its batch end
        self._snapshot_pending = False  # a maintain phase began or the model's structure changed
        self._cycle: PulseCycle | None = None
        self._energy_source: Callable[[], float] | None = None
        self._energy_step_start: float | None = None

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
            "stability/rollbacks": float(self.rollbacks),
            "stability/steps_lost": float(self.steps_lost),
            **{f"stability/spikes_{kind}": float(n) for kind, n in self.spikes_by_kind.items()},
        }
        if self._energy_source is not None:
            out["stability/energy_wasted_kwh"] = self.energy_wasted_kwh
        return out

    # ------------------------------------------------------------------ hooks
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and not pl_module.automatic_optimization:
            raise MisconfigurationException(
                "StabilityGuard supports automatic optimization only; this module sets "
                "`automatic_optimization = False`."
            )

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._changes.attach(trainer.optimizers)
        self._cycle = pulse_cycle_of(trainer)
        readers = [getattr(callback, "energy_so_far_kwh", None) for callback in trainer.callbacks]
        self._energy_source = next((reader for reader in readers if callable(reader)), None)
        self._energy_step_start, self._losses, self._decided, self._snapshot_pending = None, [], None, False
        self.snapshots.clear()
        self._take_snapshot(trainer, pl_module)  # the state training starts from (or resumes at) is good

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._energy_source is not None and self._energy_step_start is None:  # first batch of a window
            self._energy_step_start = self._read_energy()

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
        if self.policy.forced_skip():
            self._changes.skip(optimizer)
            self._decided = Action.SKIP
            return
        reduce = (
            (lambda stats: trainer.strategy.reduce(stats, reduce_op="sum"))
            if trainer.world_size > 1
            else None
        )
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
        self._decided = action = self.policy.decide(step, verdict)
        if action is Action.APPLY:
            if self.policy.cooldown_remaining and self.config.lr_factor_after_rollback < 1:
                self._changes.scale_lr(optimizer, self.config.lr_factor_after_rollback)
            return
        self._changes.skip(optimizer)
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
        self._changes.restore()  # normally done right after the step; not if a GradScaler skipped it
        self.policy.finish(action, self._step_energy())
        if action is Action.APPLY:
            if self._snapshot_due(trainer):
                self._take_snapshot(trainer, pl_module)
            return
        self._snapshot_pending = False  # the maintain entry (or new structure) came with a flagged step
        if action is Action.ROLLBACK:
            self._rollback(trainer, pl_module)
        elif action is Action.STOP:
            self._stop(trainer, pl_module)
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
            self._snapshot_pending = True

    def on_pulse_parameters_replaced(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, remap: Any
    ) -> None:
        """Snapshot at the end of the step: older snapshots no longer fit a model whose channels were cut."""
        self._snapshot_pending = self._snapshot_pending or self.policy.healthy

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "detector": self.detector.state_dict(),
            "policy": self.policy.state_dict(),
            "last_snapshot_step": self.last_snapshot_step,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.detector.load_state_dict(state_dict["detector"])
        # checkpoints of earlier versions kept the counters next to the policy's state
        self.policy.load_state_dict({**state_dict, **state_dict["policy"]})
        last = state_dict["last_snapshot_step"]
        self.last_snapshot_step = None if last is None else int(last)

    # ------------------------------------------------------------------ snapshots and rollbacks
    def _baseline_key(self) -> str:
        if not self.config.per_phase_baselines:
            return "all"
        return self._cycle.phase.value if self._cycle is not None else Phase.BURST.value

    def _snapshot_due(self, trainer: pl.Trainer) -> bool:
        """Whether to snapshot at the end of an applied step."""
        if self._snapshot_pending:
            self._snapshot_pending = False
            return self.policy.healthy
        last = self.last_snapshot_step or 0
        return (
            bool(self.snapshot_every)
            and trainer.global_step - last >= self.snapshot_every
            and self.policy.healthy
        )

    def _take_snapshot(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        step = trainer.global_step
        snapshot = take_snapshot(
            step,
            pl_module,
            trainer.optimizers,
            [config.scheduler for config in trainer.lr_scheduler_configs],
            self._rollback_callbacks(trainer),
            reuse=self.snapshots.recycle(step),
            extra={"detector": self.detector.state_dict(), **self.policy.lineage()},
        )
        self.snapshots.add(snapshot)
        self.last_snapshot_step = step
        self.snapshots_taken += 1

    def _restore_last_good(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule
    ) -> tuple[TrainingSnapshot | None, int]:
        """Return to the newest snapshot that predates the incident by ``rollback_margin``; the snapshot
        (``None`` if none fits the model any more) and the applied steps undone."""
        start = self.policy.incident_start
        trusted_until = (trainer.global_step if start is None else start) - self.rollback_margin
        target, predates = self.snapshots.last_good(pl_module, trusted_until)
        if target is None:
            rank_zero_warn(
                "StabilityGuard: no snapshot fits the model any more (its structure changed since they were "
                "taken); the parameters stay as they are."
            )
            return None, 0
        if not predates:
            rank_zero_warn(
                f"StabilityGuard: no snapshot predates step {trusted_until}; returning to the oldest one kept "
                f"(step {target.step})."
            )
        restore_snapshot(
            target,
            pl_module,
            trainer.optimizers,
            [config.scheduler for config in trainer.lr_scheduler_configs],
            self._rollback_callbacks(trainer),
            rewind_schedule=self.config.rewind_lr_schedule,
        )
        self.detector.load_state_dict(target.extra["detector"])
        undone = self.policy.rewind(target.extra)
        self.snapshots.drop_after(target.step)
        self._announce_restored_phase(trainer, pl_module)
        return target, undone

    def _rollback(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        step = trainer.global_step - 1  # the flagged step that triggered it (already taken)
        target, undone = self._restore_last_good(trainer, pl_module)
        to_step = None if target is None else target.step
        self.policy.rolled_back(step, to_step)
        rank_zero_warn(
            f"StabilityGuard: rollback {self.rollbacks} at step {step} to the snapshot of step {to_step} "
            f"({undone} applied step(s) undone); skipping the next {self.policy.skip_remaining} batch(es)."
        )

    def _stop(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        step = trainer.global_step - 1
        recent_rollbacks = len(self.policy.rollback_steps)
        target, _ = self._restore_last_good(trainer, pl_module)
        to_step = None if target is None else target.step
        self.policy.stop(step, to_step)
        path = self.config.stop_checkpoint_path or os.path.join(
            trainer.default_root_dir, "stability_guard", f"stopped-step={step}.ckpt"
        )
        self._log(trainer, self.metrics())
        trainer.save_checkpoint(path)
        state = (
            f"The model, optimizer and schedulers were returned to the snapshot of step {to_step}"
            if target is not None
            else "No snapshot fitted the model any more, so the checkpoint holds the current state"
        )
        flagged = [str(e["step"]) for e in self.events if e["event"] not in ("rollback", "stop")][-8:]
        raise StabilityGuardError(
            f"StabilityGuard stopped training at step {step}: spikes kept coming after {recent_rollbacks} "
            f"rollback(s) within {self.policy.rollback_memory} steps (`max_rollbacks`={self.policy.max_rollbacks}). "
            f"{state} and saved to {path!r}. Inspect the data around the flagged steps (last flagged: "
            f"{', '.join(flagged) or 'none'}) or lower the learning rate, then resume from that checkpoint.",
            checkpoint_path=path,
        )

    def _rollback_callbacks(self, trainer: pl.Trainer) -> dict[str, RollbackState]:
        """The callbacks whose state goes back with the model (:class:`~lightning_pulse.protocols.RollbackAware`)."""
        aware = list(listeners(trainer, RollbackAware, exclude=self))
        return {
            f"{index}:{callback.state_key}": RollbackState(callback)
            for index, callback in enumerate(trainer.callbacks)
            if any(callback is other for other in aware)
        }

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

    # ------------------------------------------------------------------ energy and logging
    def _step_energy(self) -> float:
        """Energy of the optimizer step that just ended, from the attached meter (0 without one)."""
        start, self._energy_step_start = self._energy_step_start, None
        now = self._read_energy() if start is not None else None
        return 0.0 if now is None or start is None else max(0.0, now - start)

    def _read_energy(self) -> float | None:
        if self._energy_source is None:
            return None
        try:
            return float(self._energy_source())
        except Exception as error:  # a meter never kills the run
            rank_zero_warn(
                f"StabilityGuard: reading energy failed ({error!r}); energy wasted is no longer counted."
            )
            self._energy_source = None
            return None

    @staticmethod
    def _log(trainer: pl.Trainer, metrics: dict[str, float]) -> None:
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4g}"
