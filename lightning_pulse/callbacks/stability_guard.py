"""StabilityGuard: notice divergence, skip or roll back, and keep training instead of restarting the run."""

from __future__ import annotations

import copy
import math
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from typing_extensions import override

from lightning_pulse import _native
from lightning_pulse.callbacks.pulse_cycle import PulseCycle, pulse_cycle_of
from lightning_pulse.core.grad_norm import HostStepReader, prepare
from lightning_pulse.core.snapshots import SnapshotRing, TrainingSnapshot, restore_snapshot, take_snapshot
from lightning_pulse.core.spike_detection import (
    QUIET,
    Action,
    Assessment,
    EscalationPolicy,
    SpikeDetector,
    Verdict,
)
from lightning_pulse.phase import Phase, PhaseChange
from lightning_pulse.protocols import PhaseListener, RollbackAware, listeners

STAT_LOSS, STAT_GRAD_NORM_SQ, STAT_HAS_LOSS = range(3)
_thread_time = time.thread_time  # bound once: the hot path reads it twice per hook


class StabilityGuardError(RuntimeError):
    """Raised by :class:`StabilityGuard` when rollbacks no longer help; a checkpoint was saved first."""

    def __init__(self, message: str, checkpoint_path: str) -> None:
        super().__init__(message)
        self.checkpoint_path = checkpoint_path


class StabilityGuard(Callback):
    r"""Detects non-finite values and loss or gradient-norm spikes, and answers them, escalating.

    Every optimizer step, the guard looks at the step's loss (the mean over the accumulation window and,
    under DDP, over ranks) and the global gradient norm before clipping. A step is flagged when either is
    non-finite, or when its robust z-score (median and MAD, on a log scale) against a running window of
    recent healthy steps exceeds a threshold and it is at least ``min_ratio`` times the median. Windows are
    kept per pulse phase, because a replay phase trains on high-loss samples on purpose. Responses
    escalate:

    1. **Skip**: a flagged step's update is dropped, leaving parameters and optimizer state untouched (no
       moment update, no step count, no weight decay). The LR scheduler still steps, so the schedule keeps
       following ``trainer.global_step``.
    2. **Roll back**: after ``rollback_after`` flagged steps within ``spike_memory`` steps, the model, the
       optimizer, the LR schedulers (unless ``rewind_lr_schedule=False``) and the state of the other
       lightning-pulse callbacks return to the newest snapshot taken at least ``rollback_margin`` steps
       before the trouble began. The next ``skip_after_rollback`` batches are then consumed without
       training on them, as PaLM did, and the learning rate can be lowered for ``lr_cooldown_steps``.
    3. **Stop**: when a rollback is needed after ``max_rollbacks`` rollbacks within ``rollback_memory``
       steps, the guard returns to the last good snapshot, saves a checkpoint and raises
       :class:`StabilityGuardError`.

    Snapshots live in CPU memory: every ``snapshot_every`` steps and at each maintain phase of a
    :class:`~lightning_pulse.PulseCycle` (at the end of that step, after every listener handled the phase
    change, so a pruning event at maintain entry is inside the snapshot), never while an incident is open, at
    most ``max_snapshots`` at a time; the buffers of the snapshot a new one evicts are refilled in place. The
    run's step counter never goes back: work undone by a rollback is counted as lost.

    Callbacks roll back with the model when they opt in with a class attribute ``restore_on_rollback =
    True``, which promises that their ``load_state_dict`` can be called mid-run. A callback may restrict
    what goes back to the part of its state that describes the model with ``rollback_state_dict()`` /
    ``load_rollback_state_dict(state)``. Of the pulse callbacks, ``ScheduledPrune``, ``HardSampleReplay`` and
    ``GradientCache`` go back whole; ``PulseCycle`` restores only its last probe, its clock keeps the real
    time and steps; ``EnergyLogger`` does not opt in: energy spent stays counted (the lost part is reported
    as wasted). Restored callbacks that listen to phase changes are told the current phase again with
    reason ``"resume"``, as after a checkpoint restore. Snapshots that no longer fit the model (pruned since)
    are dropped; a structured pruning event triggers a fresh snapshot.

    Metrics (``stability/*`` in the Trainer's loggers, and :meth:`benchmark_metrics`): spikes detected (by
    kind), steps skipped, rollbacks, steps lost (skipped plus undone) and, when a callback with
    ``energy_so_far_kwh()`` (``EnergyLogger``) is attached, the energy those lost steps used.

    Under DDP every decision is computed from all-reduced numbers, so all ranks take the same action at
    the same step. Only automatic optimization is supported. Each optimizer step costs one gradient-norm
    read (one native call, which also reads the loss, for fp32 gradients in host memory; else one fused norm
    pass), at most one host synchronisation (the decision has to exist before the update) and, under DDP, one
    all-reduce of three numbers. Put the guard after callbacks that change gradients (``GradientCache``), so
    it judges the gradients the optimizer will use.

    Args:
        loss_zscore: robust z-score above which a loss is a spike; ``None`` turns loss spikes off.
        grad_norm_zscore: the same for the gradient norm; ``None`` turns it off.
        window: optimizer steps in each running baseline window.
        warmup: healthy steps a window needs before it judges spikes (non-finite values are always caught).
        min_ratio: a spike must also be at least this many times the window median.
        loss_scale: ``"log"`` (default: loss noise is multiplicative) or ``"linear"``, for losses that can be
            zero or negative. The gradient norm is always judged on a log scale.
        rollback_after: flagged steps within ``spike_memory`` steps that trigger a rollback.
        spike_memory: steps over which flagged steps are counted.
        skip_after_rollback: optimizer steps (batches, or accumulation windows) skipped after a rollback.
        snapshot_every: take a snapshot every this many optimizer steps; ``0`` only at maintain phases and at
            the start of training.
        snapshot_at_maintain: also take a snapshot when a maintain phase starts (and its probe loss is
            finite).
        max_snapshots: snapshots kept in CPU memory.
        rollback_margin: a snapshot counts as good only if taken at least this many steps before the first
            flagged step of the incident (damage can precede its detection by a few steps).
        lr_factor_after_rollback: factor on the learning rate during the cooldown after a rollback, in
            ``(0, 1]``; ``1`` leaves it alone.
        lr_cooldown_steps: applied steps the lowered learning rate lasts.
        rewind_lr_schedule: ``True`` returns LR schedulers (and optimizer hyperparameters) to the snapshot
            too; ``False`` leaves them where ``trainer.global_step`` has them.
        per_phase_baselines: keep one baseline window per pulse phase.
        max_rollbacks: rollbacks allowed within ``rollback_memory`` steps; the next needed one stops the run.
        rollback_memory: steps over which rollbacks are counted.
        stop_checkpoint_path: where to save the checkpoint before stopping; by default
            ``<default_root_dir>/stability_guard/stopped-step=<step>.ckpt``.

    Raises:
        ValueError: at construction, naming the argument, for a value out of range.
        MisconfigurationException: at fit start, for a module using manual optimization.
        StabilityGuardError: during training, when the guard stops the run (after saving a checkpoint).

    Example::

        from lightning import Trainer
        from lightning_pulse import StabilityGuard

        trainer = Trainer(max_epochs=20, callbacks=[StabilityGuard(snapshot_every=200, skip_after_rollback=50)])

    The same in LightningCLI YAML::

        trainer:
          callbacks:
            - class_path: lightning_pulse.StabilityGuard
              init_args: {snapshot_every: 200, skip_after_rollback: 50}
    """

    def __init__(
        self,
        loss_zscore: float | None = 6.0,
        grad_norm_zscore: float | None = 8.0,
        window: int = 100,
        warmup: int = 50,
        min_ratio: float = 1.5,
        loss_scale: str = "log",
        rollback_after: int = 3,
        spike_memory: int = 50,
        skip_after_rollback: int = 20,
        snapshot_every: int = 100,
        snapshot_at_maintain: bool = True,
        max_snapshots: int = 2,
        rollback_margin: int = 10,
        lr_factor_after_rollback: float = 1.0,
        lr_cooldown_steps: int = 0,
        rewind_lr_schedule: bool = True,
        per_phase_baselines: bool = True,
        max_rollbacks: int = 3,
        rollback_memory: int = 1000,
        stop_checkpoint_path: str | None = None,
    ) -> None:
        super().__init__()
        self.detector = SpikeDetector(loss_zscore, grad_norm_zscore, window, warmup, min_ratio, loss_scale)
        self.policy = EscalationPolicy(
            rollback_after, spike_memory, skip_after_rollback, max_rollbacks, rollback_memory
        )
        for name, value, minimum in (
            ("snapshot_every", snapshot_every, 0),
            ("max_snapshots", max_snapshots, 1),
            ("rollback_margin", rollback_margin, 0),
            ("lr_cooldown_steps", lr_cooldown_steps, 0),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"`{name}`={value!r} must be an int >= {minimum}.")
        if (
            isinstance(lr_factor_after_rollback, bool)
            or not isinstance(lr_factor_after_rollback, (int, float))
            or not 0 < lr_factor_after_rollback <= 1
        ):
            raise ValueError(f"`lr_factor_after_rollback`={lr_factor_after_rollback!r} must be in (0, 1].")
        for name, flag in (
            ("snapshot_at_maintain", snapshot_at_maintain),
            ("rewind_lr_schedule", rewind_lr_schedule),
            ("per_phase_baselines", per_phase_baselines),
        ):
            if not isinstance(flag, bool):
                raise ValueError(f"`{name}`={flag!r} must be True or False.")
        if snapshot_every and (max_snapshots - 1) * snapshot_every < rollback_margin:
            raise ValueError(
                f"`max_snapshots`={max_snapshots} snapshots every `snapshot_every`={snapshot_every} steps never "
                f"reach `rollback_margin`={rollback_margin} steps back; allowed: (max_snapshots - 1) * "
                "snapshot_every >= rollback_margin."
            )
        if stop_checkpoint_path is not None and (
            not isinstance(stop_checkpoint_path, str) or not stop_checkpoint_path
        ):
            raise ValueError(
                f"`stop_checkpoint_path`={stop_checkpoint_path!r} must be a non-empty path or None."
            )
        self.snapshot_every = snapshot_every
        self.snapshot_at_maintain = snapshot_at_maintain
        self.rollback_margin = rollback_margin
        self.lr_factor_after_rollback = float(lr_factor_after_rollback)
        self.lr_cooldown_steps = lr_cooldown_steps
        self.rewind_lr_schedule = rewind_lr_schedule
        self.per_phase_baselines = per_phase_baselines
        self.stop_checkpoint_path = stop_checkpoint_path
        self.snapshots = SnapshotRing(max_snapshots)

        # counters (checkpointed)
        self.spikes_by_kind: dict[str, int] = {verdict.value: 0 for verdict in Verdict if verdict.is_spike}
        self.steps_skipped = 0
        self.rollbacks = 0
        self.steps_undone = 0  # applied updates thrown away by rollbacks
        self.energy_wasted_kwh = 0.0
        # the updates (and their energy) the current parameters descend from; a rollback cuts them back
        self.lineage_steps = 0
        self.lineage_energy_kwh = 0.0
        self.cooldown_remaining = 0
        self.last_snapshot_step: int | None = None
        self.stopped = False
        # what happened and when: {"step", "event" (a verdict, "rollback" or "stop"), "action" or "to_step"}
        self.events: list[dict[str, Any]] = []
        self.guard_cpu_seconds = 0.0  # CPU time of this thread inside the guard's hooks (overhead accounting)
        self.snapshot_cpu_seconds = 0.0  # the part of it spent taking snapshots
        self.snapshots_taken = 0

        # per-step transient state
        self._losses: list[torch.Tensor] = []  # the micro-batch losses of the current optimizer step
        self._host_reader = HostStepReader()  # one native call per step for fp32 CPU gradients
        # the detector's quiet step as one native call, resolved at fit start (None: the Python one)
        self._native_quiet_step: Callable[..., bool] | None = None
        self._decided: Action | None = None
        # an upper bound of trainer.global_step, kept by counting decided steps: Lightning's property chain
        # is read only when a snapshot may be due (see `_snapshot_due`)
        self._step_bound = 0
        # below this step bound an applied step leaves nothing for on_train_batch_end (no snapshot due, no
        # energy to book): see `_update_quiet_until`
        self._quiet_until = 0
        self._end_quiet = False  # the decided step is such a step
        self._key: str | None = None  # the baseline key while it cannot change (no per-phase baselines)
        self._snapshot_pending = False  # a maintain phase began or the model's structure changed
        self._saved_lrs: tuple[torch.optim.Optimizer, list[Any]] | None = None
        self._backup: tuple[dict[str, Any], list[torch.Tensor]] | None = None
        self._backup_optimizer: torch.optim.Optimizer | None = None
        self._hook_handles: list[Any] = []
        # how deep each optimizer is in nested `step` calls: torch hooks the `step` of every optimizer class it
        # has built, so a subclass's `super().step()` runs the instance's post-hooks before its own step ends
        self._step_depth: dict[int, int] = {}
        self._depth_handles: list[Any] = []
        self._energy_source: Callable[[], float] | None = None
        self._energy_step_start: float | None = None
        self._cycle: PulseCycle | None = None
        self._world_size = 1

    # ------------------------------------------------------------------ public API
    def __getstate__(self) -> dict[str, Any]:
        # the extension module is loaded from the kernel cache, not importable by name in another process
        # (``ddp_spawn`` pickles the callbacks); it is resolved again at fit start
        state = self.__dict__.copy()
        state["_native_quiet_step"] = None
        return state

    @property
    def spikes_detected(self) -> int:
        return sum(self.spikes_by_kind.values())

    @property
    def steps_lost(self) -> int:
        """Optimizer steps whose work is not in the model: skipped ones plus those undone by rollbacks."""
        return self.steps_skipped + self.steps_undone

    def metrics(self) -> dict[str, float]:
        """The stability figures of the run so far, as logged under ``stability/``."""
        out: dict[str, float] = {
            "stability/spikes": float(self.spikes_detected),
            "stability/steps_skipped": float(self.steps_skipped),
            "stability/rollbacks": float(self.rollbacks),
            "stability/steps_lost": float(self.steps_lost),
        }
        for kind, count in self.spikes_by_kind.items():
            out[f"stability/spikes_{kind}"] = float(count)
        if self._energy_source is not None:
            out["stability/energy_wasted_kwh"] = self.energy_wasted_kwh
        return out

    def benchmark_metrics(self) -> dict[str, Any]:
        """Figures for the benchmark harness (merged into each run's ``extra``)."""
        return {
            "spikes_detected": self.spikes_detected,
            "spikes_by_kind": dict(self.spikes_by_kind),
            "steps_skipped": self.steps_skipped,
            "rollbacks": self.rollbacks,
            "steps_undone": self.steps_undone,
            "steps_lost": self.steps_lost,
            "energy_wasted_kwh": self.energy_wasted_kwh if self._energy_source is not None else None,
            "guard_cpu_seconds": self.guard_cpu_seconds,
            "snapshot_cpu_seconds": self.snapshot_cpu_seconds,
            "snapshots_taken": self.snapshots_taken,
            "snapshot_bytes": self.snapshots.nbytes,
            "stopped": self.stopped,
        }

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
        started = _thread_time()
        self._remove_hooks()
        self._remove_depth_hooks()
        self._step_depth = {}
        # the depth counters only serve `_after_optimizer_step`, registered for a lowered learning rate or a
        # backed-up optimizer; a run that can need neither pays nothing in each optimizer step for them
        if self.lr_factor_after_rollback < 1 or any(
            _needs_backup(optimizer) for optimizer in trainer.optimizers
        ):
            for optimizer in trainer.optimizers:
                self._depth_handles.append(optimizer.register_step_pre_hook(self._enter_optimizer_step))
                self._depth_handles.append(optimizer.register_step_post_hook(self._leave_optimizer_step))
        # the native read and the detector's native quiet step share one extension module: its one-off build,
        # if any, happens here rather than inside the first step. The quiet step runs on Python floats, so it
        # serves any device; the read declines what is not fp32 in host memory.
        prepare()
        module = _native.step_reader() if type(self.detector) is SpikeDetector else None
        self._native_quiet_step = module.quiet_step if module is not None else None
        self._cycle = pulse_cycle_of(trainer)
        self._key = None if self.per_phase_baselines and self._cycle is not None else self._baseline_key()
        self._step_bound = trainer.global_step
        self._world_size = trainer.world_size
        self._energy_source = None
        for callback in trainer.callbacks:
            reader = getattr(callback, "energy_so_far_kwh", None)
            if callable(reader):
                self._energy_source = reader
                break
        self._energy_step_start = None
        self._losses = []
        self._decided = None
        self._snapshot_pending = False
        # the state training starts from (or resumes at) is the first good one
        self.snapshots.clear()
        self._take_snapshot(trainer, pl_module)  # also sets `_quiet_until`
        self.guard_cpu_seconds += _thread_time() - started

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
        # no host synchronisation here: the values are read once per optimizer step, with the gradient norms
        self._losses.append(loss)

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        # The hot path of every optimizer step: one fused norm pass, the detector's one-pass verdict, and
        # nothing else on a quiet step (no Lightning step counter, no policy call). Everything that happens
        # only around incidents is in `_respond`.
        started = _thread_time()
        if self._decided is not None:
            # LBFGS evaluates its closure again within the step: this decision replaces the earlier one
            self._retract_decision()
        losses, self._losses = self._losses, []
        policy = self.policy
        if policy.skip_remaining and policy.consume_forced_skip():
            self._skip_update(optimizer)
            self._decided = Action.SKIP
            self._step_bound += 1
            self._end_quiet = False
            self.guard_cpu_seconds += _thread_time() - started
            return
        if self._world_size == 1:
            # Lightning divides each micro-batch loss by accumulate_grad_batches: their sum is the mean.
            reads = self._host_reader(optimizer.param_groups, losses)  # fp32 gradients in host memory
            if reads is not None:
                squares, loss = reads
                grad_norm = math.sqrt(squares)
            else:
                grads = [
                    grad
                    for group in optimizer.param_groups
                    for p in group["params"]
                    if (grad := p.grad) is not None
                ]
                loss, grad_norm = _loss_and_grad_norm(grads, losses)
        else:
            loss, grad_norm = self._global_loss_and_grad_norm(
                trainer, pl_module, optimizer, losses, self._world_size
            )
        key = self._key if self._key is not None else self._baseline_key()
        quiet_step = self._native_quiet_step
        if quiet_step is not None:
            assessment = QUIET if quiet_step(self.detector, loss, grad_norm, key) else None
        else:
            assessment = self.detector.assess_quiet_step(loss, grad_norm, key)
        if assessment is None:  # not a common step: the detector's general path
            assessment = self._assess(loss, grad_norm, key)
        if (
            assessment.verdict is Verdict.OK
            and not policy.spike_steps
            and not policy.rollback_steps
            and not self.cooldown_remaining
        ):
            # nothing remembered: the policy would apply it and forget nothing, so the step is not needed
            self._decided = Action.APPLY
            self.lineage_steps += 1
            self._step_bound += 1
            self._end_quiet = self._step_bound < self._quiet_until
        else:
            self._respond(trainer, optimizer, assessment, loss, grad_norm, key)
        self.guard_cpu_seconds += _thread_time() - started

    def _assess(self, loss: float | None, grad_norm: float | None, key: str) -> Assessment:
        detector = self.detector
        unjudged_before = detector.unjudged_losses
        assessment = detector.assess(loss, grad_norm, key, accept=True)
        if detector.unjudged_losses and not unjudged_before:
            rank_zero_warn(
                f"StabilityGuard: the loss is {loss:.4g} <= 0, which a log scale cannot judge; loss spikes go "
                "unnoticed. Pass `loss_scale='linear'` for losses that can be zero or negative."
            )
        return assessment

    def _retract_decision(self) -> None:
        """Take back the step counts of this step's earlier decision (the step is decided again)."""
        self._step_bound -= 1
        if self._decided is Action.APPLY:
            self.lineage_steps -= 1
        self._decided = None

    def _respond(
        self,
        trainer: pl.Trainer,
        optimizer: torch.optim.Optimizer,
        assessment: Assessment,
        loss: float | None,
        grad_norm: float | None,
        key: str,
    ) -> None:
        """Decide and prepare the step's action when there is more to it than applying a quiet step."""
        step = trainer.global_step
        action = self.policy.decide(step, assessment.verdict)
        self._decided = action
        self._step_bound = step + 1
        self._end_quiet = False
        if action is Action.APPLY:
            self.lineage_steps += 1
            if self.cooldown_remaining > 0 and self.lr_factor_after_rollback < 1:
                self._saved_lrs = (optimizer, [group["lr"] for group in optimizer.param_groups])
                for group in optimizer.param_groups:
                    group["lr"] = group["lr"] * self.lr_factor_after_rollback
                self._undo_after_step(optimizer)
            return
        self.spikes_by_kind[assessment.verdict.value] += 1
        self.events.append({"step": step, "event": assessment.verdict.value, "action": action.value})
        self._skip_update(optimizer)
        baseline = self.detector.baseline(key)
        rank_zero_info(
            f"StabilityGuard: step {step} flagged as {assessment.verdict} (loss={_fmt(loss)}, "
            f"grad_norm={_fmt(grad_norm)}; {key} medians loss={_fmt(baseline['loss'])}, "
            f"grad_norm={_fmt(baseline['grad_norm'])}); action: {action}."
        )

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        action = self._decided
        if action is None:  # inside an accumulation window
            return
        self._decided = None
        if self._end_quiet and not self._snapshot_pending:
            # an applied step with nothing to book (all counted in on_before_optimizer_step): flag reads only,
            # cheaper than the timer pair that would measure them
            return
        started = _thread_time()
        if self._hook_handles:
            # normally done right after the step; not if the optimizer did not step (a GradScaler found infs)
            self._undo_pending_changes()
            self._remove_hooks()  # not from inside the hook: torch is iterating over the hooks then
        step_energy = 0.0
        if self._energy_source is not None:
            energy_now = self._read_energy()
            if energy_now is not None and self._energy_step_start is not None:
                step_energy = max(0.0, energy_now - self._energy_step_start)
            self._energy_step_start = None
        if action is Action.APPLY:
            self.lineage_energy_kwh += step_energy
            if self.cooldown_remaining > 0:
                self.cooldown_remaining -= 1
            if self._snapshot_due(trainer):
                self._take_snapshot(trainer, pl_module)
        else:
            self._snapshot_pending = False  # the maintain entry (or new structure) came with a flagged step
            self.steps_skipped += 1
            self.energy_wasted_kwh += step_energy
            if action is Action.ROLLBACK:
                self._rollback(trainer, pl_module)
            elif action is Action.STOP:
                self._stop(trainer, pl_module)
            self._log(trainer, self.metrics())
        self.guard_cpu_seconds += _thread_time() - started

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._remove_hooks()
        self._remove_depth_hooks()
        self._log(trainer, self.metrics())
        if self.spikes_detected or self.rollbacks:
            rank_zero_info(
                f"StabilityGuard: {self.spikes_detected} spike(s), {self.steps_skipped} step(s) skipped, "
                f"{self.rollbacks} rollback(s), {self.steps_lost} step(s) of work lost."
            )

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._remove_hooks()
        self._remove_depth_hooks()

    def on_pulse_phase_change(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, change: PhaseChange
    ) -> None:
        """Snapshot when a maintain phase starts, if the run is healthy and the probe is finite.

        The snapshot is taken at the end of the step (in :meth:`on_train_batch_end`), after every listener
        has handled the phase change: a pruning event at maintain entry then lies inside the snapshot, which
        therefore still fits the pruned model.
        """
        if not self.snapshot_at_maintain or change.current is not Phase.MAINTAIN or change.reason == "resume":
            return
        cycle = pulse_cycle_of(trainer)
        probe = cycle.last_probe if cycle is not None else {}
        if self._healthy() and all(math.isfinite(value) for value in probe.values()):
            self._snapshot_pending = True

    def on_pulse_parameters_replaced(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, remap: Any
    ) -> None:
        """Snapshot at the end of the step: older snapshots no longer fit a model whose channels were cut."""
        if self._healthy():
            self._snapshot_pending = True

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "detector": self.detector.state_dict(),
            "policy": self.policy.state_dict(),
            "spikes_by_kind": dict(self.spikes_by_kind),
            "steps_skipped": self.steps_skipped,
            "rollbacks": self.rollbacks,
            "steps_undone": self.steps_undone,
            "energy_wasted_kwh": self.energy_wasted_kwh,
            "lineage_steps": self.lineage_steps,
            "lineage_energy_kwh": self.lineage_energy_kwh,
            "cooldown_remaining": self.cooldown_remaining,
            "last_snapshot_step": self.last_snapshot_step,
            "stopped": self.stopped,
            "events": [dict(event) for event in self.events],
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.detector.load_state_dict(state_dict["detector"])
        self.policy.load_state_dict(state_dict["policy"])
        self.spikes_by_kind.update({kind: int(n) for kind, n in state_dict["spikes_by_kind"].items()})
        self.steps_skipped = int(state_dict["steps_skipped"])
        self.rollbacks = int(state_dict["rollbacks"])
        self.steps_undone = int(state_dict["steps_undone"])
        self.energy_wasted_kwh = float(state_dict["energy_wasted_kwh"])
        self.lineage_steps = int(state_dict["lineage_steps"])
        self.lineage_energy_kwh = float(state_dict["lineage_energy_kwh"])
        self.cooldown_remaining = int(state_dict["cooldown_remaining"])
        last = state_dict["last_snapshot_step"]
        self.last_snapshot_step = None if last is None else int(last)
        self._update_quiet_until()
        self.stopped = bool(state_dict["stopped"])
        self.events = [dict(event) for event in state_dict.get("events", [])]

    # ------------------------------------------------------------------ detection
    @staticmethod
    def _global_loss_and_grad_norm(
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        optimizer: torch.optim.Optimizer,
        losses: list[torch.Tensor],
        world_size: int,
    ) -> tuple[float | None, float | None]:
        """The step's loss (mean over the accumulation window and ranks) and global gradient norm."""
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if world_size == 1:
            # Lightning divides each micro-batch loss by accumulate_grad_batches: their sum is the mean.
            return _loss_and_grad_norm(grads, losses)
        device = grads[0].device if grads else pl_module.device
        stats = torch.zeros(3, dtype=torch.float64, device=device)
        with torch.no_grad():
            if grads:
                stats[STAT_GRAD_NORM_SQ] = _total_norm(grads).to(device, torch.float64).square()
            if losses:
                stats[STAT_LOSS] = (
                    torch.stack([loss.detach() for loss in losses]).to(device, torch.float64).sum()
                )
                stats[STAT_HAS_LOSS] = 1.0
        # one collective per step; its result is bitwise the same on every rank, and so are the decisions.
        # DDP gradients are identical on all ranks, hence the squared norm is divided back by world size.
        stats = trainer.strategy.reduce(stats, reduce_op="sum")
        loss_total, grad_norm_sq, ranks_with_loss = stats.tolist()
        loss = loss_total / ranks_with_loss if ranks_with_loss else None
        return loss, math.sqrt(grad_norm_sq / world_size)

    # ------------------------------------------------------------------ responses
    def _skip_update(self, optimizer: torch.optim.Optimizer) -> None:
        """Make the coming ``optimizer.step()`` change nothing.

        torch's own optimizers skip parameters whose ``grad`` is ``None`` entirely (checked for every class
        in ``torch.optim`` by the tests): no moment update, no step count, no weight decay. For any other
        optimizer, which may keep global counters, the state and parameters are also backed up and put
        back right after its step.
        """
        if _needs_backup(optimizer):
            params = [p for group in optimizer.param_groups for p in group["params"]]
            self._backup = (copy.deepcopy(optimizer.state_dict()), [p.detach().clone() for p in params])
            self._backup_optimizer = optimizer
            self._undo_after_step(optimizer)
        for group in optimizer.param_groups:
            for param in group["params"]:
                param.grad = None

    def _undo_after_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Have the coming ``optimizer.step()`` call :meth:`_undo_pending_changes` right after it.

        Registered only for the steps that need it; torch runs post-hooks registered while ``step`` is
        already running (we are inside its closure). Lightning steps the LR schedulers right after the
        optimizer, before ``on_train_batch_end``: this is the last moment to undo a lowered rate.
        """
        if not self._hook_handles:
            self._hook_handles.append(optimizer.register_step_post_hook(self._after_optimizer_step))

    def _enter_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._step_depth[id(optimizer)] = self._step_depth.get(id(optimizer), 0) + 1

    def _leave_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        # registered before :meth:`_after_optimizer_step`, so it runs first: the outermost step reads 0
        self._step_depth[id(optimizer)] = max(0, self._step_depth.get(id(optimizer), 0) - 1)

    def _after_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._step_depth.get(id(optimizer), 0) > 0:
            # a subclass's `super().step()` returned (torch hooked the parent's `step` too): the subclass may
            # still change its state (a global counter) after it; undo once the outermost `step` has returned
            return
        started = _thread_time()
        self._undo_pending_changes()
        self.guard_cpu_seconds += _thread_time() - started

    def _undo_pending_changes(self) -> None:
        """Put back what the guard changed for one step: a backed-up state, learning rates scaled down."""
        if self._backup is not None and self._backup_optimizer is not None:
            state, params = self._backup
            optimizer = self._backup_optimizer
            optimizer.load_state_dict(state)
            with torch.no_grad():
                live = [p for group in optimizer.param_groups for p in group["params"]]
                for param, saved in zip(live, params):
                    param.copy_(saved)
            self._backup = None
            self._backup_optimizer = None
        if self._saved_lrs is not None:
            # before the LR scheduler steps, so chainable schedulers never see the lowered value
            optimizer, lrs = self._saved_lrs
            for group, lr in zip(optimizer.param_groups, lrs):
                group["lr"] = lr
            self._saved_lrs = None

    def _restore_last_good(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule
    ) -> tuple[TrainingSnapshot | None, int]:
        """Return to the newest snapshot that predates the incident by ``rollback_margin``.

        Returns the snapshot (``None`` if none fits the model any more) and how many applied steps were
        undone.
        """
        target = self._last_good_snapshot(trainer, pl_module)
        if target is None:
            return None, 0
        restore_snapshot(
            target,
            pl_module,
            trainer.optimizers,
            [config.scheduler for config in trainer.lr_scheduler_configs],
            self._rollback_callbacks(trainer),
            rewind_schedule=self.rewind_lr_schedule,
        )
        self.detector.load_state_dict(target.extra["detector"])
        # skipped steps were counted when they were skipped; here the applied ones that are undone. Counting
        # along the lineage, a second rollback to the same snapshot does not count the first one's again.
        undone = self.lineage_steps - int(target.extra["lineage_steps"])
        self.steps_undone += undone
        self.lineage_steps = int(target.extra["lineage_steps"])
        self.energy_wasted_kwh += max(
            0.0, self.lineage_energy_kwh - float(target.extra["lineage_energy_kwh"])
        )
        self.lineage_energy_kwh = float(target.extra["lineage_energy_kwh"])
        self.snapshots.drop_after(target.step)
        self._announce_restored_phase(trainer, pl_module)
        return target, undone

    def _last_good_snapshot(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule
    ) -> TrainingSnapshot | None:
        incident_start = self.policy.incident_start
        trusted_until = (
            trainer.global_step if incident_start is None else incident_start
        ) - self.rollback_margin
        for snapshot in list(self.snapshots):
            if not snapshot.fits(pl_module):  # e.g. channels pruned since: it can never be loaded again
                self.snapshots.discard(snapshot)
        target = self.snapshots.newest_at_or_before(trusted_until)
        if target is None and len(self.snapshots):
            target = self.snapshots.oldest()
            rank_zero_warn(
                f"StabilityGuard: no snapshot predates step {trusted_until}; returning to the oldest one kept "
                f"(step {target.step})."  # type: ignore[union-attr]
            )
        if target is None:
            rank_zero_warn(
                "StabilityGuard: no snapshot fits the model any more (its structure changed since they were "
                "taken); the parameters stay as they are."
            )
        return target

    def _rollback(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        step = trainer.global_step - 1  # the index of the flagged step that triggered it (already taken)
        target, undone = self._restore_last_good(trainer, pl_module)
        # a rollback without a usable snapshot still counts: the skips follow, and repeated trouble stops
        self.policy.rolled_back(step)
        self.rollbacks += 1
        to_step = None if target is None else target.step
        self.events.append({"step": step, "event": "rollback", "to_step": to_step})
        self.cooldown_remaining = self.lr_cooldown_steps
        rank_zero_warn(
            f"StabilityGuard: rollback {self.rollbacks} at step {step} to the snapshot of step {to_step} "
            f"({undone} applied step(s) undone); skipping the next {self.policy.skip_remaining} batch(es)."
        )

    def _stop(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        step = trainer.global_step - 1  # the index of the flagged step that triggered it (already taken)
        recent_rollbacks = len(self.policy.rollback_steps)
        target, _ = self._restore_last_good(trainer, pl_module)
        self.stopped = True
        to_step = None if target is None else target.step
        self.events.append({"step": step, "event": "stop", "to_step": to_step})
        path = self.stop_checkpoint_path or os.path.join(
            trainer.default_root_dir, "stability_guard", f"stopped-step={step}.ckpt"
        )
        self._log(trainer, self.metrics())
        trainer.save_checkpoint(path)
        state = (
            f"The model, optimizer and schedulers were returned to the snapshot of step {to_step}"
            if target is not None
            else "No snapshot fitted the model any more, so the checkpoint holds the current state"
        )
        raise StabilityGuardError(
            f"StabilityGuard stopped training at step {step}: spikes kept coming after {recent_rollbacks} "
            f"rollback(s) within {self.policy.rollback_memory} steps (`max_rollbacks`={self.policy.max_rollbacks}). "
            f"{state} and saved to {path!r}. Inspect the data around the flagged steps "
            f"({self._flagged_steps()}) or lower the learning rate, then resume from that checkpoint.",
            checkpoint_path=path,
        )

    def _flagged_steps(self) -> str:
        steps = [event["step"] for event in self.events if event["event"] not in ("rollback", "stop")]
        shown = ", ".join(str(s) for s in steps[-8:])
        return f"last flagged: {shown}" if steps else "none flagged"

    def _rollback_callbacks(self, trainer: pl.Trainer) -> dict[str, _RollbackState]:
        """The callbacks whose state goes back with the model: those that opt in with a true
        ``restore_on_rollback`` attribute, which promises that their ``load_state_dict`` (or
        ``load_rollback_state_dict``) works mid-run."""
        return {
            f"{index}:{callback.state_key}": _RollbackState(callback)
            for index, callback in enumerate(trainer.callbacks)
            if any(callback is aware for aware in listeners(trainer, RollbackAware, exclude=self))
        }

    def _announce_restored_phase(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Tell each restored callback the current phase, as PulseCycle does after a checkpoint restore.

        A restored callback may hold state of another phase (a frozen set saved in a light phase, a replay
        buffer being filled): the clock did not go back (see :class:`~lightning_pulse.PulseCycle`), so the
        phase it is told is the one training continues in, at the clock's step.
        """
        cycle = pulse_cycle_of(trainer)
        if cycle is None:
            return
        change = PhaseChange(None, cycle.phase, cycle.cycle, cycle.clock.step, "resume")
        for state in self._rollback_callbacks(trainer).values():
            if isinstance(state.callback, PhaseListener):
                state.callback.on_pulse_phase_change(trainer, pl_module, change)

    def _baseline_key(self) -> str:
        if not self.per_phase_baselines:
            return "all"
        return self._cycle.phase.value if self._cycle is not None else Phase.BURST.value

    # ------------------------------------------------------------------ snapshots
    def _healthy(self) -> bool:
        # `_decided` is still set when PulseCycle announces a phase before our own on_train_batch_end, and
        # when ScheduledPrune reports new structure from its on_train_batch_end
        return (
            not self.policy.in_incident
            and self.policy.skip_remaining == 0
            and self._decided in (None, Action.APPLY)
        )

    def _update_quiet_until(self) -> None:
        """Recompute the step bound below which an applied step needs no work at its end: the next periodic
        snapshot's step (none with ``snapshot_every=0``); an energy meter books every step."""
        if self._energy_source is not None:
            self._quiet_until = -1
        elif self.snapshot_every == 0:
            self._quiet_until = sys.maxsize
        else:
            self._quiet_until = (self.last_snapshot_step or 0) + self.snapshot_every

    def _snapshot_due(self, trainer: pl.Trainer) -> bool:
        """Whether to snapshot at the end of an applied step (called after its update)."""
        if self._snapshot_pending:
            self._snapshot_pending = False
            return self._healthy()
        if self.snapshot_every == 0:
            return False
        last = self.last_snapshot_step if self.last_snapshot_step is not None else 0
        # an upper bound of the step counter spares reading Lightning's on most steps; were the bound ever
        # behind, a snapshot would come late, never early, and the next read puts the bound right
        if self._step_bound - last < self.snapshot_every:
            return False
        self._step_bound = step = trainer.global_step
        return self._healthy() and step - last >= self.snapshot_every

    def _take_snapshot(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        started = _thread_time()
        step = trainer.global_step
        self.snapshots.add(
            take_snapshot(
                step,
                pl_module,
                trainer.optimizers,
                [config.scheduler for config in trainer.lr_scheduler_configs],
                self._rollback_callbacks(trainer),
                reuse=self.snapshots.recycle(step),
                extra={
                    "detector": self.detector.state_dict(),
                    # an applied step whose on_train_batch_end has not run yet belongs to the lineage
                    "lineage_steps": self.lineage_steps,  # an applied step counts from its decision
                    "lineage_energy_kwh": self.lineage_energy_kwh + self._unbooked_step_energy(),
                },
            )
        )
        self.last_snapshot_step = step
        self._update_quiet_until()
        self.snapshots_taken += 1
        self.snapshot_cpu_seconds += _thread_time() - started

    def _unbooked_step_energy(self) -> float:
        """Energy of an applied step whose on_train_batch_end has not run yet (a snapshot taken at a phase
        change announced by a callback placed before the guard)."""
        if self._decided is not Action.APPLY or self._energy_step_start is None:
            return 0.0
        energy_now = self._read_energy()
        return 0.0 if energy_now is None else max(0.0, energy_now - self._energy_step_start)

    # ------------------------------------------------------------------ plumbing
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

    def _remove_hooks(self) -> None:
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []

    def _remove_depth_hooks(self) -> None:
        for handle in self._depth_handles:
            handle.remove()
        self._depth_handles = []

    @staticmethod
    def _log(trainer: pl.Trainer, metrics: dict[str, float]) -> None:
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)


class _RollbackState:
    """What a snapshot keeps of one opted-in callback: ``rollback_state_dict()`` when the callback defines
    it (the part of its state that belongs to the model, e.g. :class:`~lightning_pulse.PulseCycle`'s probe
    but not its clock), else its whole ``state_dict()``; restored through the matching loader."""

    def __init__(self, callback: Callback) -> None:
        self.callback = callback

    def state_dict(self) -> Any:
        own = getattr(self.callback, "rollback_state_dict", None)
        return own() if callable(own) else self.callback.state_dict()

    def load_state_dict(self, state_dict: Any) -> None:
        own = getattr(self.callback, "load_rollback_state_dict", None)
        if callable(own):
            own(state_dict)
        else:
            self.callback.load_state_dict(state_dict)


def _loss_and_grad_norm(
    grads: list[torch.Tensor], losses: list[torch.Tensor], read_each: bool | None = None
) -> tuple[float | None, float | None]:
    """The summed ``losses`` and the 2-norm of all ``grads`` together, read with torch, with at most one sync.

    The guard's own path for fp32 gradients in host memory is one native call
    (:class:`~lightning_pulse.core.grad_norm.HostStepReader`); this is the path for everything else. One fused
    per-tensor norm (the kernel ``clip_grad_norm_`` uses); the per-tensor norms are combined on the host
    (``math.hypot``: no overflow for norms near the dtype's maximum). How the values reach the host depends on
    where they are. On an accelerator, the norms and the losses are stacked and copied in one ``tolist``: one
    synchronisation per step, which the decision needs before the update anyway. In host memory there is
    nothing to synchronise, and reading each 0-d tensor with ``item`` costs less than the ``stack`` (it was
    the cheapest of the reads we profiled inside MNIST-1D fits on CPU). Gradients that the fused path cannot
    take together (several devices, sparse layouts) go through :func:`_total_norm`. ``read_each`` forces the
    host-memory (``True``) or accelerator (``False``) way; by default the first gradient's device decides.
    """
    if not grads:
        return _host_sum(losses), None
    if read_each is None:
        read_each = grads[0].is_cpu
    try:
        norms = _foreach_norm(grads, 2.0) if _foreach_norm is not None else None
        if norms is not None and read_each:
            return _host_sum(losses), math.hypot(*[norm.item() for norm in norms])
        if norms is not None:
            values = torch.stack([*norms, *[value.detach() for value in losses]]).tolist()
            count = len(norms)
            return (sum(values[count:]) if losses else None), math.hypot(*values[:count])
    except RuntimeError:  # e.g. gradients or losses on more than one device
        pass
    return _host_sum(losses), _total_norm(grads).item()


def _host_sum(losses: list[torch.Tensor]) -> float | None:
    """The sum of the (0-d) ``losses`` as a Python float; ``None`` when there are none."""
    if len(losses) == 1:  # no accumulation: the common case, without a generator
        return losses[0].item()
    return sum(value.item() for value in losses) if losses else None


def _total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all gradients together (what ``clip_grad_norm_`` computes), without touching them.

    Gradients on one device with one dtype (the common case) take torch's fused per-tensor norm, the kernel
    ``clip_grad_norm_`` uses, directly: ``get_total_norm`` costs twice as much on small models for its
    grouping. Anything else goes through ``get_total_norm`` (torch >= 2.6) or a plain loop.
    """
    first = grads[0]
    if _foreach_norm is not None and all(
        g.device == first.device and g.dtype == first.dtype and g.layout == torch.strided for g in grads
    ):
        return torch.linalg.vector_norm(torch.stack(_foreach_norm(grads, 2.0)), 2.0)
    if hasattr(torch.nn.utils, "get_total_norm"):
        return torch.nn.utils.get_total_norm(grads, 2.0)
    norms = [torch.linalg.vector_norm(g.detach(), 2.0, dtype=torch.float32) for g in grads]
    return torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]), 2.0)


_foreach_norm = getattr(torch, "_foreach_norm", None)


def _needs_backup(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a skipped step needs the optimizer's state backed up (see ``StabilityGuard._skip_update``)."""
    optimizer_type = type(optimizer)
    return not optimizer_type.__module__.startswith("torch.optim") or optimizer_type is torch.optim.LBFGS


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4g}"
