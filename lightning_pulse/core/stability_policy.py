"""How StabilityGuard answers flagged steps: skip, roll back, stop. Plain Python and torch optimizers.

* :class:`StabilityGuardConfig`: the guard's rarely turned knobs, one validated dataclass.
* :class:`EscalationPolicy`: turns a stream of verdicts into actions and keeps the books: apply the update,
  skip it, roll back to a snapshot, or stop; spike and rollback memories, the skips after a rollback, the
  learning-rate cooldown, and the counts of spikes, skipped and undone steps (and their energy). It is a
  deterministic state machine, so DDP ranks fed the same (all-reduced) numbers take the same actions.
* :class:`StepEnergy`: each step's energy, from an energy meter's cumulative reading.
* :class:`StepChanges`: what the guard changes in one ``optimizer.step()`` (a skip, a lowered learning
  rate) and puts back right after it.
"""

from __future__ import annotations

import copy
import math
import os
import statistics
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from enum import Enum
from functools import partial
from typing import Any

import torch

from lightning_pulse.core.snapshots import hook_around_steps, load_keeping_groups, optimizers_within
from lightning_pulse.core.spike_detection import COLD_RATIO, SCALES, Verdict
from lightning_pulse.errors import names_itself
from lightning_pulse.records import append_recent

CAUSES = (None, "data", "state")  # where a flagged step came from, for EscalationPolicy.decide

#: non-finite flagged steps in a row (no step applied between, the model's state finite) that the rollback
#: test may still find the data's: a loss infinite on a few samples at any weights (a CTC target longer than
#: its input) fills a row by chance where about half the batches hold one (3 in a row in 4 of 4 seeds of 48
#: steps), and rolling back for it threw away every applied step. 16 in a row, at half the batches bad, come
#: once in about 130,000 steps, as for bad data that cannot be checked (8 presumed, 8 tested at the snapshot:
#: ``stability_steps.UNCHECKED_DATA_FAULTS + RECURRING_DATA_FAULTS``); a longer row is a data stream gone bad
#: for good, or the model, and escalates untested.
NONFINITE_ROW_TESTED = 16


class Action(str, Enum):
    """What :class:`EscalationPolicy` tells the trainer to do with one optimizer step."""

    APPLY = "apply"
    SKIP = "skip"  # drop this update; parameters and optimizer state stay as they are
    ROLLBACK = "rollback"  # drop this update, then return to the last good snapshot
    STOP = "stop"  # drop this update, return to the last good snapshot, save a checkpoint, raise

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class StabilityGuardConfig:
    """The rarely turned knobs of :class:`~lightning_pulse.StabilityGuard` (its ``config`` argument).

    Args:
        min_ratio: a spike must also be at least this many times the window median, in ``(1, 10]``.
        loss_scale: ``"log"`` (loss noise is multiplicative) or ``"linear"``, for losses that can be zero or
            negative. The gradient norm is always judged on a log scale.
        per_phase_baselines: keep one baseline window per pulse phase.
        learn_recurring_level: train the batches of recurring loss spikes once they make a fifth of recent
            steps, as a level of the data (a second task at a higher loss in round-robin multi-task
            training), and let the baselines learn it. Off by default: by share alone a second task cannot be
            told from a data source gone bad for good, which this would train on; either way it is said.
        spike_memory: steps over which flagged steps are counted towards ``rollback_after``.
        rollback_memory: steps over which rollbacks are counted towards ``max_rollbacks``.
        snapshot_at_maintain: also snapshot when a maintain phase starts (if its probe loss is finite).
        rewind_lr_schedule: ``True`` returns LR schedulers (and optimizer hyperparameters) to the snapshot
            too, except at a rollback whose spikes the rewound schedule brought back, with the rate raised far
            above the snapshot's (:class:`~lightning_pulse.core.schedule_replay.ScheduleReplay`); ``False``
            leaves them where ``trainer.global_step`` has them.
        lr_factor_after_rollback: factor on the learning rate during the cooldown after a rollback, in
            ``(0, 1]``; ``1`` leaves it alone.
        lr_cooldown_steps: applied steps the lowered learning rate lasts.
        stop_checkpoint_path: where to save the checkpoint before stopping (a ``str`` or ``os.PathLike``,
            kept as a ``str``); by default ``<default_root_dir>/stability_guard/stopped-step=<step>.ckpt``.

    Raises:
        ValueError: at construction, naming this class, the field and what is allowed, for a value out of range.
    """

    min_ratio: float = 1.5
    loss_scale: str = "log"
    per_phase_baselines: bool = True
    learn_recurring_level: bool = False
    spike_memory: int = 50
    rollback_memory: int = 1000
    snapshot_at_maintain: bool = True
    rewind_lr_schedule: bool = True
    lr_factor_after_rollback: float = 1.0
    lr_cooldown_steps: int = 0
    stop_checkpoint_path: str | None = None

    @names_itself
    def __post_init__(self) -> None:
        ratio = self.min_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 1 < ratio <= COLD_RATIO:
            raise ValueError(
                f"`min_ratio`={ratio!r} must be a number in (1, {COLD_RATIO:g}]: a spike is at least this many "
                f"times the window median, and {COLD_RATIO:g} times is what a window still warming up asks for."
            )
        if self.loss_scale not in SCALES:
            raise ValueError(f"`loss_scale`={self.loss_scale!r} is not one of {list(SCALES)}.")
        check_int("spike_memory", self.spike_memory, minimum=1)
        check_int("rollback_memory", self.rollback_memory, minimum=1)
        for name in (
            "per_phase_baselines",
            "learn_recurring_level",
            "snapshot_at_maintain",
            "rewind_lr_schedule",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"`{name}`={getattr(self, name)!r} must be True or False.")
        factor = self.lr_factor_after_rollback
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
            raise ValueError(f"`lr_factor_after_rollback`={factor!r} must be in (0, 1].")
        check_int("lr_cooldown_steps", self.lr_cooldown_steps, minimum=0)
        if factor != 1 and self.lr_cooldown_steps == 0:
            raise ValueError(
                f"`lr_factor_after_rollback`={factor!r} acts during the cooldown after a rollback, and "
                "`lr_cooldown_steps`=0 gives none: set lr_cooldown_steps > 0, or leave the factor at 1."
            )
        if factor == 1 and self.lr_cooldown_steps != 0:
            raise ValueError(
                f"`lr_cooldown_steps`={self.lr_cooldown_steps!r} lasts a cooldown in which "
                f"`lr_factor_after_rollback`={factor!r} leaves the learning rate as it is, so it would do "
                "nothing: set lr_factor_after_rollback < 1, or leave lr_cooldown_steps at 0."
            )
        path = self.stop_checkpoint_path
        if path is not None:  # a str, as the other path fields keep it (a checkpoint holds no PosixPath)
            text = os.fspath(path) if isinstance(path, (str, os.PathLike)) else None
            if not isinstance(text, str) or not text:
                raise ValueError(
                    f"`stop_checkpoint_path`={path!r} must be a non-empty path (str or Path) or None."
                )
            object.__setattr__(self, "stop_checkpoint_path", text)


class EscalationPolicy:
    """Decides, step by step, whether to apply, skip, roll back or stop, and counts what was lost.

    * A flagged step is skipped. A non-finite step whose batch held non-finite values is the data's fault
      (the model is healthy): it is skipped and never escalates. One that found the model's own state
      non-finite rolls back at once.
    * When ``rollback_after`` flagged steps fall within the last ``spike_memory`` steps, the run rolls
      back to its last good snapshot and then skips the next ``skip_after_rollback`` steps (the batches a
      spike came with are not trained on again, as PaLM did); the next ``lr_cooldown_steps`` applied steps
      are in a learning-rate cooldown.
    * Unless the rollback cannot help: when healthy steps came between the flagged ones and
      ``rollback_helps`` (given to :meth:`decide`) answers ``False``, the flagged batch spiking on the snapshot
      the rollback would return to as well, the spikes are the data's (outlier targets, a loss infinite on a
      few samples, which come back every epoch): the step is skipped, the incident ends, and its flagged steps
      count in ``recurring_spikes``. Flagged steps in an unbroken row escalate untested (every batch failing:
      a model or a whole data stream gone bad), unless every one of them is non-finite on a model whose
      state is finite (``cause`` ``None``), for up to :data:`NONFINITE_ROW_TESTED` steps in a row: a loss
      infinite on a few samples makes such rows by chance, and the test tells them from a model gone bad.
    * When a rollback is needed but ``max_rollbacks`` rollbacks already happened within the last
      ``rollback_memory`` steps, the run stops instead.

    ``step`` is the optimizer step being decided (``trainer.global_step`` before it is taken). The books
    follow the model's lineage: :meth:`lineage` is what a snapshot records, :meth:`rewind` returns to it and
    counts the applied steps (and energy) it undoes, once, however often the run goes back to it.

    Args:
        rollback_after: flagged steps within ``spike_memory`` that trigger a rollback.
        spike_memory: how many recent steps count towards ``rollback_after``.
        skip_after_rollback: steps skipped right after a rollback.
        max_rollbacks: rollbacks allowed within ``rollback_memory`` steps before the next one becomes a stop.
        rollback_memory: how many recent steps count towards ``max_rollbacks``.
        lr_cooldown_steps: applied steps of learning-rate cooldown after a rollback.

    Raises:
        ValueError: naming the argument, for a non-integer or out-of-range value.

    Example::

        policy = EscalationPolicy(rollback_after=2, max_rollbacks=1)
        assert policy.decide(5, Verdict.LOSS_SPIKE) is Action.SKIP
        assert policy.decide(6, Verdict.LOSS_SPIKE) is Action.ROLLBACK
    """

    def __init__(
        self,
        rollback_after: int = 3,
        spike_memory: int = 50,
        skip_after_rollback: int = 20,
        max_rollbacks: int = 3,
        rollback_memory: int = 1000,
        lr_cooldown_steps: int = 0,
    ) -> None:
        check_int("rollback_after", rollback_after, minimum=1)
        check_int("spike_memory", spike_memory, minimum=1)
        check_int("skip_after_rollback", skip_after_rollback, minimum=0)
        check_int("max_rollbacks", max_rollbacks, minimum=0)
        check_int("rollback_memory", rollback_memory, minimum=1)
        check_int("lr_cooldown_steps", lr_cooldown_steps, minimum=0)
        self.rollback_after = rollback_after
        self.spike_memory = spike_memory
        self.skip_after_rollback = skip_after_rollback
        self.max_rollbacks = max_rollbacks
        self.rollback_memory = rollback_memory
        self.lr_cooldown_steps = lr_cooldown_steps
        # escalation state
        self.spike_steps: list[int] = []  # flagged steps of the open incident
        self.rollback_steps: list[int] = []
        self.skip_remaining = 0
        self.cooldown_remaining = 0
        # the books
        self.spikes_by_kind: dict[str, int] = {verdict.value: 0 for verdict in Verdict if verdict.is_spike}
        self.steps_skipped = 0
        self.bad_batches = 0  # steps skipped because their batch held non-finite values
        self.recurring_spikes = 0  # flagged steps whose batch spiked on the rollback's snapshot too
        self.recurring_nonfinite = 0  # incidents of them resolved by a non-finite step (inf at any weights)
        # non-finite flagged steps on a finite model state (data faults too) since the last applied step
        self.nonfinite_row = 0
        self.rollbacks = 0
        self.steps_undone = 0  # applied updates thrown away by rollbacks
        self.energy_wasted_kwh = 0.0
        self.steps_lost_unmetered = 0  # lost steps begun before the meter's first reading: not in the above
        # the updates (and their energy) the current parameters descend from; a rollback cuts them back
        self.lineage_steps = 0
        self.lineage_energy_kwh = 0.0
        self.lineage_unmetered = 0  # the lineage's steps of unknown energy (StepEnergy.end gave None)
        self.stopped = False
        # what happened and when: {"step", "event" (a verdict, "rollback" or "stop"), "action" or "to_step"}
        self.events: list[dict[str, Any]] = []
        # the rollbacks and stop within ``rollback_memory``: {"step", "untested" (an unbroken row escalated
        # without the rollback test), "undone" (applied steps undone; None until booked), "scores" (the
        # thresholds its flagged steps pass at, :meth:`book_scores`), "nan_update" (the tensors an applied
        # update made NaN right before its step, :meth:`book_nan_update`)}, for the stop's message, which must
        # not blame the model on a test that never ran and names how far to raise the thresholds
        self.escalations: list[dict[str, Any]] = []

    @property
    def in_incident(self) -> bool:
        """Whether recent flagged steps (not yet resolved by a rollback) are remembered."""
        return bool(self.spike_steps)

    @property
    def incident_start(self) -> int | None:
        """The first flagged step still remembered, i.e. where the current trouble began."""
        return self.spike_steps[0] if self.spike_steps else None

    @property
    def healthy(self) -> bool:
        """No open incident and no skips pending: a state worth a snapshot."""
        return not self.spike_steps and self.skip_remaining == 0

    @property
    def spikes_detected(self) -> int:
        """Flagged steps of every kind (the sum of ``spikes_by_kind``)."""
        return sum(self.spikes_by_kind.values())

    @property
    def steps_lost(self) -> int:
        """Optimizer steps whose work is not in the model: skipped ones plus those undone by rollbacks."""
        return self.steps_skipped + self.steps_undone

    def forced_skip(self) -> bool:
        """True (and one fewer left) while steps remain to be skipped after a rollback."""
        if self.skip_remaining > 0:
            self.skip_remaining -= 1
            return True
        return False

    def decide(
        self,
        step: int,
        verdict: Verdict,
        cause: str | None = None,
        rollback_helps: Callable[[], bool] | None = None,
    ) -> Action:
        """The action for a step the detector judged ``verdict`` (call :meth:`forced_skip` first).

        ``cause`` says, for a non-finite step, where it came from (see :mod:`lightning_pulse.core.fault_origin`):
        ``"data"`` (the batch held non-finite values, the model is healthy): skipped, counted in
        ``bad_batches``, never escalated; ``"state"`` (the parameters or optimizer state are non-finite):
        skipping cannot help, so a rollback (or a stop) right away; ``None``: an ordinary flagged step.
        ``rollback_helps`` is called only when an ordinary flagged step would roll back or stop: ``False``
        skips the step instead and ends the incident (the spikes are the data's, see the class docstring).
        """
        if cause not in CAUSES:
            raise ValueError(f"`cause`={cause!r} is not one of {list(CAUSES)}.")
        while self.spike_steps and step - self.spike_steps[0] >= self.spike_memory:
            self.spike_steps.pop(0)
        while self.rollback_steps and step - self.rollback_steps[0] >= self.rollback_memory:
            self.rollback_steps.pop(0)
        while self.escalations and step - self.escalations[0]["step"] >= self.rollback_memory:
            self.escalations.pop(0)
        if verdict is Verdict.OK:
            return Action.APPLY
        event: dict[str, Any] = {"step": step, "event": verdict.value}
        if cause == "data":
            action = Action.SKIP
            self.bad_batches += 1
            self.nonfinite_row += 1  # no step applied either: a row of bad data counts towards the bound
        else:
            self.spike_steps.append(step)
            nonfinite = verdict in (Verdict.NONFINITE_LOSS, Verdict.NONFINITE_GRAD)
            self.nonfinite_row = self.nonfinite_row + 1 if nonfinite and cause is None else 0
            testable = self._healthy_between() or self._nonfinite_row_tested()
            if len(self.spike_steps) < self.rollback_after and cause is None:
                action = Action.SKIP
            elif cause is None and rollback_helps is not None and testable and not rollback_helps():
                action = Action.SKIP
                self.recurring_spikes += len(self.spike_steps)
                self.recurring_nonfinite += verdict is Verdict.NONFINITE_LOSS
                self.spike_steps = []
                event["cause"] = "recurring"
            elif len(self.rollback_steps) >= self.max_rollbacks:
                action = Action.STOP
            else:
                action = Action.ROLLBACK
            if action in (Action.ROLLBACK, Action.STOP):
                untested = cause is None and rollback_helps is not None and not testable
                self.escalations.append({"step": step, "untested": untested, "undone": None})
        self.spikes_by_kind[verdict.value] += 1
        event["action"] = action.value
        if cause is not None:
            event["cause"] = cause
        append_recent(self.events, event)
        return action

    def _healthy_between(self) -> bool:
        """Whether applied steps came between the incident's flagged steps (step numbers with gaps). Without
        any, every batch failed: a whole data stream gone bad, or the model, escalates untested (but see
        :meth:`_nonfinite_row_tested`)."""
        return self.spike_steps[-1] - self.spike_steps[0] + 1 > len(self.spike_steps)

    def _nonfinite_row_tested(self) -> bool:
        """Whether an unbroken row still gets the rollback test: each of the incident's flagged steps is
        non-finite on a finite model state, and the row (across incidents the test resolved) is at most
        :data:`NONFINITE_ROW_TESTED` long. A model gone bad is finite on the snapshot before it, so the test
        rolls it back; a batch non-finite there too is the data's."""
        return len(self.spike_steps) <= self.nonfinite_row <= NONFINITE_ROW_TESTED

    def finish(self, action: Action, energy_kwh: float | None = 0.0) -> None:
        """Book a step once its update was applied or dropped, with the energy it used (``None``: unknown,
        counted apart rather than as a 0 no meter measured)."""
        unmetered, energy_kwh = energy_kwh is None, energy_kwh or 0.0
        if action is Action.APPLY:
            self.lineage_unmetered += unmetered
            self.nonfinite_row = 0
            self.lineage_steps += 1
            self.lineage_energy_kwh += energy_kwh
            self.cooldown_remaining = max(0, self.cooldown_remaining - 1)
        else:
            self.steps_skipped += 1
            self.steps_lost_unmetered += unmetered
            self.energy_wasted_kwh += energy_kwh

    def lineage(self) -> dict[str, float]:
        """What a snapshot records, for :meth:`rewind`."""
        return {
            "lineage_steps": self.lineage_steps,
            "lineage_energy_kwh": self.lineage_energy_kwh,
            "lineage_unmetered": self.lineage_unmetered,
        }

    def rewind(self, lineage: Mapping[str, float]) -> int:
        """Return the books to a snapshot's :meth:`lineage`; the number of applied steps undone."""
        undone = self.lineage_steps - int(lineage["lineage_steps"])
        self.steps_undone += undone
        self.lineage_steps = int(lineage["lineage_steps"])
        self.energy_wasted_kwh += max(0.0, self.lineage_energy_kwh - float(lineage["lineage_energy_kwh"]))
        self.lineage_energy_kwh = float(lineage["lineage_energy_kwh"])
        kept_unmetered = int(lineage.get("lineage_unmetered", 0))
        self.steps_lost_unmetered += max(0, self.lineage_unmetered - kept_unmetered)
        self.lineage_unmetered = kept_unmetered
        return undone

    def rolled_back(self, step: int, to_step: int | None, undone: int | None = None) -> None:
        """Record a rollback at ``step`` (to the snapshot of ``to_step``, ``undone`` applied steps undone):
        the incident is resolved, the next steps are skipped, the cooldown starts. A rollback without a
        usable snapshot counts too."""
        self._book_undone(step, undone)
        self.rollback_steps.append(step)
        self.spike_steps = []  # the row of non-finite steps goes on: a rollback applies no step
        self.skip_remaining = self.skip_after_rollback
        self.cooldown_remaining = self.lr_cooldown_steps
        self.rollbacks += 1
        append_recent(self.events, {"step": step, "event": "rollback", "to_step": to_step})

    def stop(self, step: int, to_step: int | None, undone: int | None = None) -> None:
        self._book_undone(step, undone)
        self.stopped = True
        append_recent(self.events, {"step": step, "event": "stop", "to_step": to_step})

    def _book_undone(self, step: int, undone: int | None) -> None:
        if self.escalations and self.escalations[-1]["step"] == step:
            self.escalations[-1]["undone"] = undone

    def book_nan_update(self, step: int, names: Iterable[str]) -> None:
        """Book on the escalation at ``step`` that its state went NaN in the optimizer update applied right
        before it, from a finite loss and gradient norm (``names``: the parameters and optimizer-state tensors
        holding a NaN; none: nothing booked)."""
        names = list(names)
        if names and self.escalations and self.escalations[-1]["step"] == step:
            self.escalations[-1]["nan_update"] = names

    def book_scores(self, step: int, scores: Iterable[tuple[float, float] | None]) -> None:
        """Book on the escalation at ``step`` the highest thresholds its incident's flagged steps pass at
        (``(loss, grad_norm)`` each, :meth:`SpikeDetector.clearing_scores`; ``None``: a step not scored, a
        non-finite one, which no threshold lets through): ``"scores"``, ``None`` where any step was not."""
        if not self.escalations or self.escalations[-1]["step"] != step:
            return
        scores = list(scores)
        known = scores and all(score is not None for score in scores)
        self.escalations[-1]["scores"] = (
            [max(score[i] for score in scores) for i in (0, 1)] if known else None  # type: ignore[index]
        )

    def thresholds_passed(self) -> tuple[float, float] | None:
        """The lowest ``(loss_zscore, grad_norm_zscore)`` at which every flagged step behind the rollbacks and
        stop within ``rollback_memory`` would have been no spike (0.0: that threshold needs no change;
        ``inf``: none lets a step through, only ``None``); ``None`` where a step was not scored (a non-finite
        one, or booked before this was kept: a checkpoint of an earlier version, a fit resumed mid-incident).
        """
        scores = [escalation.get("scores") for escalation in self.escalations]
        if not scores or any(score is None for score in scores):
            return None
        return max(score[0] for score in scores), max(score[1] for score in scores)

    def state_dict(self) -> dict[str, Any]:
        return {
            "spike_steps": list(self.spike_steps),
            "rollback_steps": list(self.rollback_steps),
            "skip_remaining": self.skip_remaining,
            "cooldown_remaining": self.cooldown_remaining,
            "spikes_by_kind": dict(self.spikes_by_kind),
            "steps_skipped": self.steps_skipped,
            "bad_batches": self.bad_batches,
            "recurring_spikes": self.recurring_spikes,
            "recurring_nonfinite": self.recurring_nonfinite,
            "nonfinite_row": self.nonfinite_row,
            "rollbacks": self.rollbacks,
            "steps_undone": self.steps_undone,
            "energy_wasted_kwh": self.energy_wasted_kwh,
            "lineage_steps": self.lineage_steps,
            "lineage_energy_kwh": self.lineage_energy_kwh,
            "steps_lost_unmetered": self.steps_lost_unmetered,
            "lineage_unmetered": self.lineage_unmetered,
            "stopped": self.stopped,
            "events": [dict(event) for event in self.events],
            "escalations": [dict(escalation) for escalation in self.escalations],
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self.spike_steps = [int(s) for s in state_dict["spike_steps"]]
        self.rollback_steps = [int(s) for s in state_dict["rollback_steps"]]
        names = (
            "skip_remaining",
            "cooldown_remaining",
            "steps_skipped",
            "bad_batches",
            "recurring_spikes",
            "recurring_nonfinite",
            "nonfinite_row",
            "rollbacks",
            "steps_undone",
            "steps_lost_unmetered",
            "lineage_unmetered",
        )
        for name in names:
            setattr(self, name, int(state_dict.get(name, 0)))
        self.lineage_steps = int(state_dict.get("lineage_steps", 0))
        self.energy_wasted_kwh = float(state_dict.get("energy_wasted_kwh", 0.0))
        self.lineage_energy_kwh = float(state_dict.get("lineage_energy_kwh", 0.0))
        self.spikes_by_kind.update({k: int(n) for k, n in state_dict.get("spikes_by_kind", {}).items()})
        self.stopped = bool(state_dict.get("stopped", False))
        self.events = [dict(event) for event in state_dict.get("events", [])]
        self.escalations = [dict(escalation) for escalation in state_dict.get("escalations", [])]


#: a level of the data, not spikes: recurring spikes (flagged, and spiking on the rollback's snapshot too) at
#: least this many in the last ``window`` steps and at least this share of them. The outlier tests
#: (7 shifted targets in 1,500, 4 zero targets under a log loss, batches of 32) flag at most 17 and 12
#: steps in 100; a task or data source at a higher loss on every 2nd-4th batch makes 25-50 of 100.
LEVEL_MIN_STEPS = 5
LEVEL_SHARE = 0.2
#: recurring spikes that make this share of the last ``window`` steps are said (once a fit), not yet applied
NOTICE_SHARE = 0.05


class RecurringLevel:
    """Recurring spikes that make up a large, lasting share of recent steps: a level of the data (a second
    task, a data source with higher losses), not spikes, which are rare by nature.

    :meth:`record` takes the steps and losses of an incident the rollback test resolved as recurring. Once
    they make at least :data:`LEVEL_MIN_STEPS` and :data:`LEVEL_SHARE` of the last ``window`` steps,
    :attr:`found` is set for the rest of the fit, and :meth:`holds` tells a flagged step at that level (a loss
    within ``same_factor`` of the level's median; a NaN, a spike far above the level or a gradient spike of
    a step at the ordinary level is not): the
    caller applies it and lets it into the baselines, so the windows learn the second level, without the
    rollback test's forwards. Below that, at :data:`NOTICE_SHARE`, :meth:`record` says so once (the steps
    are still skipped). Non-finite steps never count.

    Args:
        window: the steps over which the share is taken (the detector's ``window``).
        same_factor: how far above the level's median a loss may be and still be at that level.
    """

    def __init__(self, window: int = 100, same_factor: float = 4.0, learn: bool = False) -> None:
        self.window = window
        self.same_factor = same_factor
        self.learn = learn  # StabilityGuardConfig.learn_recurring_level: else the share is only said
        self.steps: list[int] = []  # recurring steps, the last ``window`` steps only
        self.losses: list[float] = []  # the level's latest losses (recurring, then applied at the level)
        self.grad_norms: list[float] = []  # and their gradient norms: a step at the level's loss may explode
        self.found = False
        self.noticed = False  # the share below LEVEL_SHARE was said (once a fit)
        self.first: int | None = None  # the fit's first recurring step

    @property
    def needed(self) -> int:
        return max(LEVEL_MIN_STEPS, math.ceil(LEVEL_SHARE * self.window))

    def record(
        self, step: int, steps: Iterable[int], losses: Iterable[float], grad_norms: Iterable[float] = ()
    ) -> str | None:
        """Book an incident resolved as recurring at ``step``; the message to say, once a fit: at the switch
        to a level (:func:`level_message`), or at :data:`NOTICE_SHARE` before it."""
        steps = list(steps)
        self.first = min([*steps, step]) if self.first is None else self.first
        recent = [s for s in (*self.steps, *steps) if step - s < self.window]
        self.steps = recent
        self._keep(losses, grad_norms)
        if not self.found and len(recent) >= self.needed:
            self.found = self.noticed = True  # found: said once; with `learn`, its steps train from now on
            return level_message(len(recent), self.window, switched=self.learn, large=True)
        # said only once a whole window passed since the first: a level is said once, at its switch
        seen_a_window = step - self.first >= self.window
        many = len(recent) >= max(LEVEL_MIN_STEPS, NOTICE_SHARE * self.window)
        if not self.noticed and seen_a_window and many:
            self.noticed = True
            return level_message(len(self.steps), self.window, switched=False, large=False)
        return None

    def holds(self, loss: float | None, grad_norm: float | None = None) -> bool:
        """Whether a flagged step with ``loss`` is at the level found (its loss then joins the level's)."""
        if not (self.found and self.learn) or loss is None or not math.isfinite(loss) or not self.losses:
            return False
        median = statistics.median(self.losses)
        # far above it: a spike; far below it: an ordinary step (its gradient spike keeps its verdict)
        if not median / self.same_factor <= loss <= median * self.same_factor:
            return False
        # a gradient far above the level's own: an explosion on a batch of the level, not the level
        if grad_norm is not None and self.grad_norms:
            if (
                not math.isfinite(grad_norm)
                or grad_norm > statistics.median(self.grad_norms) * self.same_factor
            ):
                return False
        self._keep([loss], [] if grad_norm is None else [grad_norm])
        return True

    def _keep(self, losses: Iterable[float], grad_norms: Iterable[float] = ()) -> None:
        self.losses = (self.losses + [float(v) for v in losses if math.isfinite(v)])[-self.window :]
        kept = [float(v) for v in grad_norms if v is not None and math.isfinite(v)]
        self.grad_norms = (self.grad_norms + kept)[-self.window :]

    def start(self) -> None:
        """A new fit says its notice again (what was found stays: the windows hold the level)."""
        self.noticed, self.first = self.found, None

    def state_dict(self) -> dict[str, Any]:
        return {
            "steps": list(self.steps),
            "losses": list(self.losses),
            "grad_norms": list(self.grad_norms),
            "found": self.found,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self.steps = [int(s) for s in state_dict.get("steps", [])]
        self.losses = [float(v) for v in state_dict.get("losses", [])]
        self.grad_norms = [float(v) for v in state_dict.get("grad_norms", [])]
        self.found = bool(state_dict.get("found", False))
        self.noticed, self.first = self.found, None


def level_message(count: int, window: int, switched: bool, large: bool) -> str:
    """The once-a-fit warning about recurring spikes that make a large share of recent steps: ``switched``,
    their steps train from now on (``learn_recurring_level``); ``large``, the share reached the level's."""
    share = f"{count} of the last {window} steps ({count / window:.0%})"
    said = (
        "StabilityGuard: recurring loss spikes (batches that spike at the rollback's snapshot too) made "
        f"{share}, and they are skipped: that part of the data is not trained on. Spikes are rare; a share "
        "this large is either a level of the data (a task or a data source whose losses sit far above the "
        "others, as in round-robin multi-task training) or a data source gone bad: the guard cannot tell "
        "which."
    )
    if switched:
        return said + (
            " `learn_recurring_level` is on: from now on such steps are TRAINED ON and enter the baselines; "
            "non-finite values, spikes far above that level and gradient norms far above its own are still "
            "caught, but a fault whose loss lands within 4x of the level is trained on. If these batches are "
            "bad data, fix the data and turn `learn_recurring_level` off."
        )
    ways = (
        "bring the tasks' losses to one scale (normalise or weight each task's loss), or turn loss spikes "
        "off (`loss_zscore=None`; non-finite values are still caught)"
    )
    if large:
        ways = (
            f"set `config=StabilityGuardConfig(learn_recurring_level=True)` to train them as a level, {ways}"
        )
    return said + f" If it is a second task, {ways}. If it is bad data, fix the data."


class StepEnergy:
    """The energy of each optimizer step, from a meter's cumulative reading (``EnergyLogger.energy_so_far_kwh``).

    :meth:`begin` at the first batch of a step, :meth:`end` when it ended. A reading that fails turns the
    meter off for the rest of the run (a meter never kills the run), said once through ``warn``. A pause
    between the two (:meth:`on_pulse_pause`) is left out. :attr:`counted`: whether the steps' energy is
    counted (a meter was given and never failed); it stays so after :meth:`release`. ``known``: whether the
    meter has counted yet (``EnergyAccount.has_reading``); a step begun before that has unknown energy.
    """

    def __init__(
        self,
        read: Callable[[], float] | None = None,
        warn: Callable[[str], Any] | None = None,
        known: Callable[[], bool] | None = None,
    ) -> None:
        self.read = read
        self.warn = warn
        self.known = known
        self.counted = read is not None
        self._start: float | None = None
        self._unknown = False  # the step began before the meter's first reading
        self._paused_at: float | None = None

    @classmethod
    def of_callbacks(cls, callbacks: Iterable[Any], warn: Callable[[str], Any] | None = None) -> StepEnergy:
        """Read the first of ``callbacks`` with a callable ``energy_so_far_kwh`` (an EnergyLogger); none: off.
        Its ``account.has_reading`` (an EnergyLogger's), if any, tells whether the meter has counted yet."""
        for callback in callbacks:
            if callable(read := getattr(callback, "energy_so_far_kwh", None)):
                known = getattr(getattr(callback, "account", None), "has_reading", None)
                return cls(read, warn=warn, known=known if callable(known) else None)
        return cls(None, warn=warn)

    def begin(self) -> None:
        if self.read is not None and self._start is None:
            # a meter still starting reads 0 at both ends: not a measured 0 (why, at the step's start: the
            # first reading back-fills the time before it, part of this step)
            self._unknown = self.known is not None and not self.known()
            self._start = self._value()

    def on_pulse_pause(self, trainer: Any, paused: bool) -> None:
        """A :class:`~lightning_pulse.protocols.PauseListener` (the guard's): a
        :class:`~lightning_pulse.GreenWindow` pause inside a step (GreenWindow's batch end before the
        guard's) is idle draw, not the step's energy: the meter's growth over it is left out of the step
        (and of ``energy_wasted_kwh`` and the lineage's energy). A pause between two steps needs nothing: the
        next step's first reading comes after it."""
        if self._start is None:  # between steps (or no meter)
            return
        if paused:
            self._paused_at = self._value()
            return
        paused_at, self._paused_at = self._paused_at, None
        if paused_at is not None and (now := self._value()) is not None and self._start is not None:
            self._start += max(0.0, now - paused_at)  # the step's start moved past the pause's energy

    def end(self) -> float | None:
        """The step's energy in kWh; ``None`` where it is unknown (begun before the meter's first reading)."""
        start, self._start, self._paused_at = self._start, None, None
        now = self._value() if start is not None else None
        if now is not None and start is not None and self._unknown:
            return None
        return 0.0 if now is None or start is None else max(0.0, now - start)

    def release(self) -> None:
        """At the fit's end: let go of the meter (an EnergyLogger's bound method), which the guard no longer
        reads; the logger is not kept alive, nor copied, through the guard."""
        self.read, self.known, self._start, self._paused_at = None, None, None, None

    def __getstate__(self) -> dict[str, Any]:  # pickled (``ddp_spawn``) and copied without the meter's logger
        return {**self.__dict__, "read": None, "known": None}

    def _value(self) -> float | None:
        try:
            return None if self.read is None else float(self.read())
        except Exception as error:
            self.read, self.counted = None, False
            if self.warn is not None:
                self.warn(
                    f"StabilityGuard: reading energy failed ({error!r}); wasted energy is no longer counted."
                )
            return None


def _rates_saved_as(lrs: list[Any], optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """An optimizer ``state_dict`` post-hook: its groups' learning rates as ``lrs`` (:meth:`StepChanges.scale_lr`)."""
    for group, lr in zip(state["param_groups"], lrs):
        group["lr"] = lr


class StepChanges:
    """What the guard changes in one ``optimizer.step()``, put back right after it.

    * :meth:`skip`: every gradient set to ``None``. torch's own optimizers then skip each parameter entirely
      (no moment update, no step count, no weight decay; tested for every class in ``torch.optim``). Any
      other optimizer may keep global counters (schedule-free ones do), or read the gradients in its step
      (SAM stacks their norms: a list of none fails): its gradients are zeroed in place instead, and its
      state, its inner optimizers' (SAM's base optimizer) and the parameters are backed up and put back
      after its step, with the parameter-group dicts it shares with them kept the same objects, and the
      gradients set to ``None`` then, as on the other path.
    * :meth:`hold`: a backup taken before a step that may still be skipped after its parameters moved (a
      later closure evaluation of SAM or LBFGS that turns out non-finite); dropped after an applied step.
    * :meth:`scale_lr`: the learning rates of one step scaled, put back after the step, before Lightning
      steps the LR schedulers (chainable schedulers never see the lowered value). The optimizer's
      ``state_dict`` gives them unscaled meanwhile: a checkpoint saved inside the step (SLURM's requeue signal,
      ``OnExceptionCheckpoint``), which a resume trains again, holds the rates the step started from.

    :meth:`attach` registers step hooks on the optimizers. torch runs an instance's hooks from the ``step``
    of every optimizer class it has built, so a subclass's ``super().step()`` runs them before its own step
    ends: a depth count puts things back only when the outermost ``step`` returns. An optimizer whose class
    torch never built (a Lookahead that does not call ``Optimizer.__init__``, as commonly written) runs no
    step hooks: its instance's ``step`` is wrapped instead (``snapshots.hook_around_steps``), until
    :meth:`detach`.
    :meth:`restore` does it by hand where the optimizer did not step (a ``GradScaler`` that found infs).
    """

    def __init__(self) -> None:
        # the optimizer, the state dicts of it and its inner optimizers, and its parameters, before the step
        self._backup: tuple[torch.optim.Optimizer, list[tuple[Any, dict]], list[torch.Tensor]] | None = None
        self._skipping = False  # the backup goes back after the step (else it is dropped: a step applied)
        self._saved_lrs: tuple[torch.optim.Optimizer, list[Any]] | None = None
        self._unscaled_in_state: Any = None  # the state_dict hook that gives the saved rates (scale_lr)
        self._depth: dict[int, int] = {}
        self._handles: list[Any] = []

    def attach(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.detach()
        for optimizer in optimizers:
            # where torch runs no step hooks, a wrapped instance ``step``: put back right after the step too,
            # not after Lightning stepped the LR schedulers
            self._handles.extend(hook_around_steps(optimizer, self))

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles, self._depth = [], {}

    def hold(self, optimizer: torch.optim.Optimizer, repeats: bool | None = True) -> None:
        """Back up ``optimizer`` (one that :func:`needs_backup`) before its parameters move within the step,
        so that a :meth:`skip` decided at a later closure evaluation still puts back the state before the
        step; nothing where it evaluates the closure once a step (``repeats`` false; ``None``: unknown)."""
        always = type(optimizer) is torch.optim.LBFGS  # repeats in every step that does not converge at once
        if (repeats is not False or always) and self._backup is None and needs_backup(optimizer):
            self._backup = _backup_of(optimizer)

    def can_undo_within_step(self, optimizer: torch.optim.Optimizer, keep_gradients: bool = False) -> bool:
        """Whether a :meth:`skip` decided at a later closure evaluation would put back the state before the
        step: a backup is held (:meth:`hold`), or none is needed. A backup taken in the middle of the step
        would hold its half-done state (LBFGS's counted iteration without its previous gradient crashed the
        next step: a review), so without one the step stays applied, as before later evaluations were read."""
        return self._backup is not None or not (keep_gradients or needs_backup(optimizer))

    def skip(self, optimizer: torch.optim.Optimizer, keep_gradients: bool = False) -> None:
        """Make the coming ``optimizer.step()`` change nothing (or, decided within it, undo it).

        ``keep_gradients``: for code that runs between the decision and the step and needs gradients (clipping
        by value raises on a list of none): they are zeroed in place instead, and the step is undone from a
        backup of the state and parameters, as for an optimizer that ``needs_backup``. Either way the
        gradients are ``None`` once the step is over (:meth:`restore`), as after a step not taken."""
        backed_up = keep_gradients or needs_backup(optimizer)
        if backed_up and self._backup is None:  # LBFGS may decide twice; a held backup predates the step
            self._backup = _backup_of(optimizer)
        self._skipping = self._skipping or backed_up
        # torch's own optimizers skip a parameter without a gradient; another may read them all (SAM)
        zero = keep_gradients or not type(optimizer).__module__.startswith("torch.optim")
        for group in optimizer.param_groups:
            for param in group["params"]:
                if not zero:
                    param.grad = None
                elif param.grad is not None:
                    param.grad.zero_()

    def scale_lr(self, optimizer: torch.optim.Optimizer, factor: float) -> None:
        """Scale the learning rates of the coming ``optimizer.step()`` by ``factor`` (once per step)."""
        if self._saved_lrs is not None:  # decided again within the step (LBFGS): scale the original rates
            self.restore()
        lrs = [group["lr"] for group in optimizer.param_groups]
        self._saved_lrs = (optimizer, lrs)
        for group in optimizer.param_groups:
            group["lr"] = group["lr"] * factor
        try:  # an optimizer torch did not build (a Lookahead that skips Optimizer.__init__) has no such hooks
            self._unscaled_in_state = optimizer.register_state_dict_post_hook(partial(_rates_saved_as, lrs))
        except AttributeError:
            self._unscaled_in_state = None

    def restore(self) -> None:
        """Put back a backed-up state (of a skipped step, its gradients set to ``None``; a held one of an
        applied step is dropped) and scaled learning rates (nothing if none is pending)."""
        if self._backup is not None:
            optimizer, states, params = self._backup
            self._backup = None  # dropped after this: the optimizer may keep its tensors
            if self._skipping:  # all at once: a wrapper's own load may part the groups its inner ones share
                load_keeping_groups(states)
                with torch.no_grad():
                    live = [p for group in optimizer.param_groups for p in group["params"]]
                    for param, saved in zip(live, params):
                        # one the step left as it was keeps its version counter: a frozen layer's outputs that
                        # GradientCache's activation cache recorded stay valid (it drops them on any write)
                        if not torch.equal(param, saved):
                            param.copy_(saved)
                        # None, as a step not taken leaves them (and as the torch.optim skip sets them): the
                        # zeros the skip put in would tell the LR scheduler the parameter stepped, where its
                        # state is back to the one before (HF AdafactorSchedule read a missing `step`)
                        param.grad = None
        self._skipping = False
        if self._saved_lrs is not None:
            optimizer, lrs = self._saved_lrs
            for group, lr in zip(optimizer.param_groups, lrs):
                group["lr"] = lr
            self._saved_lrs = None
            if self._unscaled_in_state is not None:
                self._unscaled_in_state.remove()
                self._unscaled_in_state = None

    def _enter(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._depth[id(optimizer)] = self._depth.get(id(optimizer), 0) + 1

    def _leave(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        depth = self._depth[id(optimizer)] = max(0, self._depth.get(id(optimizer), 0) - 1)
        if depth == 0 and (self._backup is not None or self._saved_lrs is not None):
            self.restore()

    def __getstate__(self) -> dict[str, Any]:  # ``ddp_spawn`` pickles the callbacks: hooks stay behind
        return {**self.__dict__, "_handles": [], "_depth": {}}


def _backup_of(
    optimizer: torch.optim.Optimizer,
) -> tuple[torch.optim.Optimizer, list[tuple[Any, dict]], list[torch.Tensor]]:
    """What :meth:`StepChanges.restore` puts back: the state of ``optimizer`` and of its inner optimizers
    (copies), and its parameters' values."""
    owners = optimizers_within([optimizer])  # it first, then its inner ones
    states = [(owner, copy.deepcopy(owner.state_dict())) for owner in owners]
    return (
        optimizer,
        states,
        [p.detach().clone() for group in optimizer.param_groups for p in group["params"]],
    )


def needs_backup(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a skipped step needs the optimizer's state backed up (see :meth:`StepChanges.skip`)."""
    optimizer_type = type(optimizer)
    return not optimizer_type.__module__.startswith("torch.optim") or optimizer_type is torch.optim.LBFGS


def check_int(name: str, value: Any, minimum: int) -> None:
    """Raise a ``ValueError`` naming ``name`` unless ``value`` is an int >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"`{name}`={value!r} must be an int >= {minimum}.")
