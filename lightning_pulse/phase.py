"""The pulse rhythm as plain Python: phases, durations and the :class:`PhaseClock`.

Nothing here imports Lightning. :class:`~lightning_pulse.callbacks.pulse_cycle.PulseCycle` feeds the
clock with optimizer steps and seconds (read by a :class:`StepTimer`); everything else asks the clock which
phase it is.
"""

from __future__ import annotations

import math
import numbers
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any

from lightning_pulse.records import append_recent
from lightning_pulse.step_rows import is_step_row


class Phase(str, Enum):
    """The phases of a pulse cycle.

    * ``BURST``: ordinary training on fresh data, at full cost.
    * ``REPLAY``: a light phase that reuses what the run already has (hard-sample replay, cached
      gradient information).
    * ``MAINTAIN``: a light phase for evaluation, pruning and snapshots.
    """

    BURST = "burst"
    REPLAY = "replay"
    MAINTAIN = "maintain"

    @property
    def code(self) -> int:
        """A stable integer for loggers that only take numbers: burst=0, replay=1, maintain=2."""
        return _PHASE_CODES[self]

    def __str__(self) -> str:
        return self.value


_PHASE_CODES = {Phase.BURST: 0, Phase.REPLAY: 1, Phase.MAINTAIN: 2}
PHASE_NAMES = tuple(p.value for p in Phase)
#: what a share of the run needs, for the refusals: an IterableDataset without a length leaves max_epochs
#: without a step count, and max_time alone gives none
KNOWN_LENGTH = (
    "a run of known length: a finite max_steps, or max_epochs over a training DataLoader that has a length "
    "(max_time alone gives none)"
)

#: why a share of the run (or an epoch) has no length in optimizer steps under manual optimization with
#: ``{count}`` optimizers (:func:`~lightning_pulse._lightning_compat.steps_per_batch_unknown`)
UNKNOWN_STEPS_PER_BATCH = (
    "this module steps its {count} optimizers itself (manual optimization) and trainer.global_step counts "
    "every optimizer's step, so the run's length in optimizer steps is not known before its first batch "
    "(Lightning's estimate counts one step a batch; alternating updates are counted the same way)"
)
#: the way out of a share of such a run: a length ``global_step`` counts
STEPS_BOUND_ONLY = (
    "bound the run by max_steps alone (Trainer(max_steps=N) without max_epochs; it counts every step)"
)

_UNIT_ALIASES = {
    "step": "steps",
    "steps": "steps",
    "epoch": "epochs",
    "epochs": "epochs",
    "s": "seconds",
    "sec": "seconds",
    "secs": "seconds",
    "second": "seconds",
    "seconds": "seconds",
    "m": "minutes",
    "min": "minutes",
    "mins": "minutes",
    "minute": "minutes",
    "minutes": "minutes",
    "h": "hours",
    "hr": "hours",
    "hour": "hours",
    "hours": "hours",
}
_SECONDS_PER_UNIT = {"seconds": 1.0, "minutes": 60.0, "hours": 3600.0}
#: every spelling of a unit of time a duration takes (``"s"``, ``"min"``, ``"hours"``...), for messages
SECONDS_UNIT_NAMES = tuple(unit for unit, kind in _UNIT_ALIASES.items() if kind in _SECONDS_PER_UNIT)
_DURATION_RE = re.compile(r"^\s*([-+]?(?:\d+(?:\.\d*)?|\.\d+))\s*([a-zA-Z]+)\s*$")


@dataclass(frozen=True)
class Duration:
    """How long a phase lasts, in one of three units.

    Attributes:
        kind: ``"steps"`` (optimizer steps), ``"epochs"`` (fractions of an epoch allowed) or ``"seconds"``
            (wall clock).
        amount: a non-negative number in that unit; ``0`` means the phase is skipped.
    """

    kind: str
    amount: float

    @property
    def is_zero(self) -> bool:
        return self.amount == 0

    def __str__(self) -> str:
        if self.kind == "steps":
            return f"{int(self.amount)}steps"
        if self.kind == "epochs":
            return f"{self.amount:g}epochs"
        return f"{self.amount:g}s"


DurationLike = int | float | str | Duration


def parse_duration(value: DurationLike, field: str = "duration", allowed: str | None = None) -> Duration:
    """Turn a user-facing duration into a :class:`Duration`.

    Accepted forms:

    * an ``int``: optimizer steps (``200``);
    * a ``float``: epochs, fractions allowed (``0.25`` is a quarter of an epoch);
    * a string with a unit: ``"200steps"``, ``"0.5epoch"``, ``"90s"``, ``"15min"``, ``"1.5h"``.
      A bare number in a string follows the int/float rule.

    ``allowed`` is what the messages list as accepted: a field that takes fewer forms names only its own.

    Raises:
        ValueError: naming ``field``, the value and what is allowed, if the value is negative, not finite,
            or cannot be parsed.
    """
    allowed = allowed or (
        "an int of optimizer steps, a float of epochs, or a string like '200steps', '0.5epoch', '90s', "
        "'15min', '1h'"
    )
    if isinstance(value, Duration):
        duration = value
    elif isinstance(value, bool):
        raise ValueError(f"`{field}`={value!r} is not a duration; expected {allowed}.")
    elif isinstance(value, int):
        duration = Duration("steps", float(value))
    elif isinstance(value, float):
        duration = Duration("epochs", value)
    elif isinstance(value, str):
        text = value.strip()
        try:
            number: int | float = int(text)
        except ValueError:
            try:
                number = float(text)
            except ValueError:
                number = None  # type: ignore[assignment]
        if number is not None:
            return parse_duration(number, field, allowed)
        match = _DURATION_RE.match(text)
        unit = _UNIT_ALIASES.get(match.group(2).lower()) if match else None
        if match is None or unit is None:
            raise ValueError(f"`{field}`={value!r} cannot be parsed; expected {allowed}.")
        amount = float(match.group(1))
        if unit in _SECONDS_PER_UNIT:
            duration = Duration("seconds", amount * _SECONDS_PER_UNIT[unit])
        else:
            if unit == "steps" and not amount.is_integer():
                raise ValueError(f"`{field}`={value!r}: a step count must be a whole number.")
            duration = Duration(unit, amount)
    else:
        raise ValueError(f"`{field}`={value!r} has type {type(value).__name__}; expected {allowed}.")
    if not math.isfinite(duration.amount) or duration.amount < 0:
        raise ValueError(f"`{field}`={value!r} must be finite and non-negative; expected {allowed}.")
    return duration


@dataclass(frozen=True)
class PhaseChange:
    """One transition of the clock, as told to listeners and kept in the clock's history.

    Attributes:
        previous: the phase that ended, or ``None`` at the start of training.
        current: the phase that starts now.
        cycle: index of the cycle the new phase belongs to (0-based; warm-up and anneal keep the index of
            the cycle around them).
        step: the optimizer step at which the new phase starts.
        reason: ``"start"``, ``"budget"`` (the previous phase used up its duration), ``"warmup_end"``,
            ``"anneal"``, ``"resume"``, ``"hold"`` (a burst ended early by :meth:`PhaseClock.hold`) or
            ``"release"`` (a light phase ended early when the hold was let go) or ``"extended"`` (a finished
            run resumed to a longer one left its anneal: a new cycle starts).
        ended_steps: optimizer steps the previous phase lasted (0 at the start).
        ended_seconds: wall-clock seconds the previous phase lasted (0 at the start).
    """

    previous: Phase | None
    current: Phase
    cycle: int
    step: int
    reason: str
    ended_steps: int = 0
    ended_seconds: float = 0.0

    def metrics(self) -> dict[str, float]:
        """What :class:`~lightning_pulse.PulseCycle` logs at this change: the steps and seconds of the phase
        that ended. Empty at the start (no phase ended). Not the new phase's code or cycle: the row sits at
        the step the change follows, the ended phase's last, where ``pulse/phase`` is the phase it trained."""
        if self.previous is None:
            return {}
        ended = self.previous.value
        return {f"pulse/{ended}_steps": float(self.ended_steps), f"pulse/{ended}_seconds": self.ended_seconds}

    @property
    def place(self) -> str:
        """Where the run stands at this change, for a log line: ``"replay of cycle 2 at step 340"``."""
        return f"{self.current} of cycle {self.cycle} at step {self.step}"

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["previous"] = None if self.previous is None else self.previous.value
        data["current"] = self.current.value
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PhaseChange:
        previous = data["previous"]
        return cls(
            previous=None if previous is None else Phase(previous),
            current=Phase(data["current"]),
            cycle=int(data["cycle"]),
            step=int(data["step"]),
            reason=str(data["reason"]),
            ended_steps=int(data.get("ended_steps", 0)),
            ended_seconds=float(data.get("ended_seconds", 0.0)),
        )


def check_same_order(state: Mapping[str, Any], order: Sequence[Phase]) -> None:
    """Raise ``ValueError`` when the clock ``state`` was saved with another cycle order than ``order``."""
    new = [phase.value for phase in order]
    saved = state.get("order")
    if saved is None:  # saved before the order was: at least its phase must sit at its place in this order
        position, phase = int(state["position"]), str(state["phase"])
        if state["stage"] != "cycle" or (position < len(new) and new[position] == phase):
            return
        ran, resume = f"a cycle with {phase!r} at place {position + 1}", "the order it was saved with"
    elif list(saved) == new:
        return
    else:
        ran = resume = f"`order`={list(saved)}"
    raise ValueError(
        f"the checkpoint's clock ran {ran}, and this one's `order` is {new}: its phase and place in the "
        f"cycle do not carry over to another order. Resume with {resume}, or start a new run (no ckpt_path) "
        "from the checkpoint's weights."
    )


class PhaseClock:
    """Decides the current phase from optimizer steps, epochs and seconds.

    The clock is a pure state machine: the caller reports progress with :meth:`advance` and reads
    :attr:`phase`. Identical inputs give identical phase sequences, which is what makes DDP ranks agree
    (the callback broadcasts rank 0's seconds before calling :meth:`advance`).

    Training starts with a pure burst warm-up for the first ``warmup`` share of steps, then repeats the
    cycle ``order`` (each phase for its duration; zero-length phases are skipped), and ends with a pure
    burst anneal for the last ``anneal`` share of steps, so the end of training sees the full data.

    :attr:`step` counts the run's optimizer steps. A clock that starts with the run starts at 0; one placed at
    a later step before it starts (:meth:`begin_at`) counts from there, and its shares are of the steps left.

    Args:
        durations: phase name -> duration (see :func:`parse_duration`). Phases missing from the mapping
            last zero.
        order: the phases of one cycle, in order. Each must be a :class:`Phase` name and appear once.
        warmup: share of the optimizer steps from the clock's start to the run's end, at the start, that is
            pure burst. In ``[0, 1)``.
        anneal: share of those steps, at the end, that is pure burst. In ``[0, 1)``.

    Raises:
        ValueError: on an unknown phase, a bad duration, a cycle whose durations are all zero, or
            ``warmup + anneal >= 1``.
    """

    def __init__(
        self,
        durations: Mapping[str, DurationLike],
        order: Sequence[str] = PHASE_NAMES,
        warmup: float = 0.0,
        anneal: float = 0.0,
    ) -> None:
        for field, names in (("order", list(order)), ("durations", list(durations))):
            unknown = [name for name in names if name not in PHASE_NAMES]
            if unknown:
                raise ValueError(
                    f"`{field}`={names!r} names an unknown phase {unknown[0]!r}; allowed phases are "
                    f"{list(PHASE_NAMES)}."
                )
        if len(set(order)) != len(order) or not order:
            raise ValueError(f"`order`={list(order)!r} must list each phase at most once and not be empty.")
        for name, share in (("warmup", warmup), ("anneal", anneal)):
            if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share < 1:
                raise ValueError(f"`{name}`={share!r} must be a number in [0, 1).")
        if warmup + anneal >= 1:
            raise ValueError(
                f"`warmup` + `anneal` = {warmup} + {anneal} = {warmup + anneal:g} must be below 1, "
                "or no step would be left for the cycle."
            )
        self.durations = {Phase(name): parse_duration(durations.get(name, 0), name) for name in order}
        self.order = tuple(Phase(name) for name in order)
        if all(d.is_zero for d in self.durations.values()):
            given = ", ".join(f"`{phase.value}`={durations.get(phase.value, 0)!r}" for phase in self.order)
            raise ValueError(
                f"Every phase in the cycle has zero duration ({given}); give at least one a length."
            )
        self.warmup = float(warmup)
        self.anneal = float(anneal)
        self.reset()

    # ------------------------------------------------------------------ state
    def reset(self) -> None:
        self.phase: Phase = Phase.BURST
        self.position = 0  # index into `order` of the current cycle phase
        self.cycle = 0
        self.step = 0  # the run's optimizer step (see begin_at)
        self.origin = 0  # the step it started at: warm-up and anneal are shares of the steps from there
        self.steps_in_phase = 0
        self.seconds_in_phase = 0.0
        self.epochs_in_phase = 0.0
        self.stage = "pending"  # pending -> warmup -> cycle -> anneal
        self.history: list[PhaseChange] = []
        self.held = False  # see `hold`
        self._hold_due: bool | None = None  # a hold asked for before the step that trained was counted
        self.span: int | None = None  # see `pin_span`
        self.rows = PhaseRows()  # which steps log the phase, and what: PulseCycle's rows
        self.steps_by_phase = {phase.value: 0 for phase in Phase}
        self.seconds_by_phase = {phase.value: 0.0 for phase in Phase}
        # the current segment (one stay in one phase), which warm-up's hand-over to a burst does not end
        self._segment_steps = 0
        self._segment_seconds = 0.0

    @property
    def uses_wall_clock(self) -> bool:
        """Whether any phase is measured in seconds (then DDP ranks must share rank 0's seconds)."""
        return any(d.kind == "seconds" for d in self.durations.values())

    @property
    def uses_epochs(self) -> bool:
        return any(d.kind == "epochs" for d in self.durations.values())

    @property
    def in_cycle(self) -> bool:
        """False during warm-up and anneal."""
        return self.stage == "cycle"

    @property
    def label(self) -> str:
        """A short label for a progress bar: ``"burst(warmup)"``, ``"replay c3"``; ASCII, as any stdout can
        print it (Lightning's TQDM bar writes to ``sys.stdout``, which raises on what its encoding lacks)."""
        if self.stage in ("warmup", "anneal"):
            return f"{self.phase}({self.stage})"
        return f"{self.phase} c{self.cycle}"

    def state_dict(self) -> dict[str, Any]:
        return {
            "phase": self.phase.value,
            "position": self.position,
            "cycle": self.cycle,
            "step": self.step,
            "steps_in_phase": self.steps_in_phase,
            "seconds_in_phase": self.seconds_in_phase,
            "epochs_in_phase": self.epochs_in_phase,
            "stage": self.stage,
            "history": [change.to_dict() for change in self.history],
            "steps_by_phase": dict(self.steps_by_phase),
            "seconds_by_phase": dict(self.seconds_by_phase),
            "segment_steps": self._segment_steps,
            "segment_seconds": self._segment_seconds,
            "held": self.held,
            "span": self.span,
            "order": [phase.value for phase in self.order],
            "origin": self.origin,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`.

        Raises:
            ValueError: for a state saved with another cycle ``order``: its phase and place in the cycle
                would not be this clock's (a phase left out fails a step later; a reshuffled order repeats
                or skips a phase). A state from before the order was saved is checked on its phase's place.
        """
        check_same_order(state, self.order)
        self.phase = Phase(state["phase"])
        self.position = int(state["position"])
        self.cycle = int(state["cycle"])
        self.step = int(state["step"])
        self.steps_in_phase = int(state["steps_in_phase"])
        self.seconds_in_phase = float(state["seconds_in_phase"])
        self.epochs_in_phase = float(state["epochs_in_phase"])
        self.stage = str(state["stage"])
        self.history = [PhaseChange.from_dict(item) for item in state["history"]]
        self.steps_by_phase = {k: int(v) for k, v in state["steps_by_phase"].items()}
        self.seconds_by_phase = {k: float(v) for k, v in state["seconds_by_phase"].items()}
        self._segment_steps = int(state["segment_steps"])
        self._segment_seconds = float(state["segment_seconds"])
        self.held = bool(state.get("held", False))
        span = state.get("span")
        self.span = None if span is None else int(span)
        self.origin = int(state.get("origin", 0))  # saved before it was: every clock started at step 0

    def pin_span(self, span: int | None) -> None:
        """Place warm-up and anneal as shares of ``span`` steps from now on, whatever run length each call
        passes (``None``: the one passed). A step plan pins the span it solved warm-up and anneal on: where
        no exact fixed point exists, the run's length differs from it by a step or two, and the boundaries
        must stay where the plan put them (the plan's batches depend on them). Kept in :meth:`state_dict`."""
        self.span = None if span is None else int(span)

    def begin_at(self, step: int) -> None:
        """Place a clock that has not started at the run's optimizer step ``step``: it counts the run's steps
        from there, and warm-up and anneal become shares of the steps left (a PulseCycle added when resuming a
        checkpoint saved without one, whose fit starts at the checkpoint's step). A started clock, restored or
        running, is left as it is."""
        if self.stage == "pending":
            self.step = self.origin = int(step)

    def late_start_plan(self, total_steps: float) -> str:
        """For the log, on a clock placed past step 0 (:meth:`begin_at`): where it started and what it placed
        on the steps left to the run's end ``total_steps``."""
        end = self._run_end(total_steps)
        if end is None or not math.isfinite(end):
            rest = "the rest of the run (of unknown length)"
        else:
            rest = f"the {max(end - self.origin, 0):g} steps left (steps {self.origin} to {end:g})"
        placed = [f"a warm-up to step {self._warmup_end(total_steps)}"] if self.warmup else []
        if self.anneal:
            placed.append(f"an anneal from step {self._anneal_start(total_steps)}")
        plan = f": {' and '.join(placed)}, as shares of them" if placed else ", with no warm-up or anneal"
        return (
            f"starting at step {self.origin} with no saved state (none of PulseCycle's was restored: a "
            f"checkpoint without it, or a later fit of the Trainer): its clock counts the run's steps from "
            f"there, and its phases run on {rest}{plan}."
        )

    def start(self, total_steps: int | float | None) -> PhaseChange | None:
        """Enter the first phase. Returns the change, or ``None`` if the clock was already running
        (a resumed run keeps its restored phase)."""
        if self.stage != "pending":
            return None
        if self._warmup_end(total_steps) > self.step:
            self.stage = "warmup"
            return self._enter(Phase.BURST, "start")
        self.stage = "cycle"
        self.position = self._first_nonzero(0, skip_burst=self.held)
        return self._enter(self.order[self.position], "start")

    def advance(
        self,
        steps: int = 1,
        seconds: float = 0.0,
        steps_per_epoch: float | None = None,
        total_steps: int | float | None = None,
    ) -> list[PhaseChange]:
        """Report ``steps`` finished optimizer steps that took ``seconds`` of wall clock.

        Args:
            steps: optimizer steps finished since the last call.
            seconds: wall-clock seconds they took.
            steps_per_epoch: optimizer steps in one epoch; needed by epoch-based durations.
            total_steps: the run's total optimizer steps; needed by warm-up and anneal.

        Returns:
            The phase changes that happened, in order (usually none or one).
        """
        if self.stage == "pending":
            self.start(total_steps)
        changes: list[PhaseChange] = []
        self.step += steps
        self.steps_in_phase += steps
        self.seconds_in_phase += seconds
        self._segment_steps += steps
        self._segment_seconds += seconds
        self.steps_by_phase[self.phase.value] += steps
        self.seconds_by_phase[self.phase.value] += seconds
        if steps_per_epoch:
            self.epochs_in_phase += steps / steps_per_epoch

        anneal_from = self._anneal_start(total_steps)
        if self.stage == "anneal" and (anneal_from is None or self.step < anneal_from):
            # a finished run resumed to a longer one ("train longer"): its anneal moves to the new end, and a
            # new cycle starts
            # (told even when the cycle starts with the burst the anneal was: listeners count the new cycle)
            self.stage, self.cycle = "cycle", self.cycle + 1
            self.position = self._first_nonzero(0, skip_burst=self.held)
            changes.append(self._enter(self.order[self.position], "extended"))
        if self.stage != "anneal" and anneal_from is not None and self.step >= anneal_from:
            self.stage = "anneal"
            if self.phase is not Phase.BURST:
                changes.append(self._enter(Phase.BURST, "anneal"))
            return changes
        if self.stage == "warmup":
            if self.step >= self._warmup_end(total_steps):
                self.stage = "cycle"
                self.position = self._first_nonzero(0, skip_burst=self.held)
                next_phase = self.order[self.position]
                if next_phase is not self.phase:
                    changes.append(self._enter(next_phase, "warmup_end"))
                else:
                    self._restart_budget()
            return changes
        if self.stage != "cycle":
            return changes
        while self._budget_spent(steps_per_epoch):
            wrapped_position = self._first_nonzero(self.position + 1, skip_burst=self.held)
            if wrapped_position <= self.position:
                self.cycle += 1
            self.position = wrapped_position
            next_phase = self.order[self.position]
            if next_phase is self.phase:
                # a one-phase cycle: only the budget restarts
                self._restart_budget()
                break
            changes.append(self._enter(next_phase, "budget"))
        return changes

    def copy(self) -> PhaseClock:
        """An independent clock in this one's state, to play forward without touching this one (no history)."""
        copy = PhaseClock.__new__(PhaseClock)
        copy.durations, copy.order = dict(self.durations), self.order
        copy.warmup, copy.anneal = self.warmup, self.anneal
        copy.reset()
        # the copy only plays forward: the past changes are not needed, nor converted
        history, self.history = self.history, []
        try:
            copy.load_state_dict(self.state_dict())
        finally:
            self.history = history
        return copy

    def counted(
        self,
        steps: int,
        seconds: float,
        steps_per_epoch: float | None = None,
        total_steps: int | float | None = None,
    ) -> tuple[PhaseClock, list[PhaseChange]]:
        """A copy of this clock (history included) as PulseCycle's batch end leaves it once it counts
        ``steps`` that took ``seconds`` (:meth:`advance`) and applies the hold waiting for them
        (:meth:`take_due_hold`), and the changes that batch end tells. This clock is left as it is, so nothing
        changes or is told before that batch end: for a checkpoint saved inside the step
        (:mod:`lightning_pulse.core.uncounted_step`)."""
        after = self.copy()
        after.history = list(self.history)
        changes = after.advance(steps, seconds, steps_per_epoch, total_steps)
        if self._hold_due is not None:
            changes += after.hold(self._hold_due)
        return after, changes

    def first_entry(
        self, phase: Phase, from_step: int, steps_per_epoch: float | None, total_steps: float
    ) -> int | None:
        """The first optimizer step in ``[from_step, total_steps)`` at which a copy of this clock, played forward
        from now, enters ``phase``; ``None`` when it does not. Step and epoch durations only (wall-clock phases
        are not decided by steps: ``from_step`` is returned, as for a clock that cannot start here). Stops at
        anneal (a burst to the end) or after two cycles without the phase."""
        sim = self.copy()
        try:
            if sim.stage == "pending" and (change := sim.start(total_steps)) is not None:
                if change.current is phase and from_step <= change.step < total_steps:
                    return change.step
            if self.uses_wall_clock:
                return from_step
            last_cycle = None
            while sim.step < total_steps:
                for change in sim.advance(
                    sim.steps_to_boundary(total_steps), 0.0, steps_per_epoch, total_steps
                ):
                    if change.current is phase and from_step <= change.step < total_steps:
                        return change.step
                if sim.stage == "anneal":  # after the step: a restored anneal may have ended ("extended")
                    return None
                if sim.step >= from_step and sim.stage == "cycle":
                    last_cycle = sim.cycle + 2 if last_cycle is None else last_cycle
                    if sim.cycle >= last_cycle:  # two whole cycles went by without it: it never comes
                        return None
        except ValueError:  # no run length for warm-up or anneal: PulseCycle refuses that itself
            return from_step
        return None

    def steps_to_boundary(self, total_steps: float) -> int:
        """Optimizer steps up to the clock's next possible change (at least 1): the end of a phase counted in
        steps, the warm-up's end or the anneal's start. Playing forward by these jumps lands on every change at
        its own step, at a cost per phase rather than per step."""
        if self.stage == "anneal":
            return 1
        bounds = []
        if self.stage == "cycle":  # warm-up is burst, which an order may leave out of `durations`
            duration = self.durations[self.phase]
            if duration.kind != "steps":  # an epoch duration: its boundary depends on fractions of an epoch
                return 1
            bounds.append(math.ceil(duration.amount - 1e-9) - self.steps_in_phase)
        if self.stage == "warmup":
            bounds.append(self._warmup_end(total_steps) - self.step)
        if (anneal_from := self._anneal_start(total_steps)) is not None:
            bounds.append(anneal_from - self.step)
        return max(1, min(bounds, default=1))

    @property
    def reachable_phases(self) -> tuple[Phase, ...]:
        """The phases this clock can be in: the cycle's phases with a length, and burst where a warm-up or anneal
        (pure burst) is set. However late a phase comes (after a long warm-up, or only in a long run), it is
        here; a phase left out of ``order`` or of length zero never comes, in a run of any length, under any
        :meth:`hold` (which only skips bursts) and in any resume (which keeps the ``order``)."""
        phases = tuple(phase for phase in self.order if not self.durations[phase].is_zero)
        if Phase.BURST not in phases and (self.warmup or self.anneal):
            phases = (Phase.BURST, *phases)
        return phases

    @property
    def light_phases(self) -> tuple[Phase, ...]:
        """The cycle's phases other than burst that have a length (where :meth:`hold` can keep the run)."""
        return tuple(p for p in self.order if p is not Phase.BURST and not self.durations[p].is_zero)

    def hold(self, held: bool, step: int | None = None) -> list[PhaseChange]:
        """Keep the cycle in its light phases while ``held`` (for a scheduler such as GreenWindow).

        Holding ends a running burst now and moves to the next light phase; while held, a burst that falls
        due is skipped and the light phases follow one another. Letting go ends a light phase now and
        starts a burst. Warm-up and anneal stay pure burst: the hold takes effect when the cycle starts.
        Returns the phase changes (none if nothing changed).

        ``step`` is the run's optimizer step now (``trainer.global_step``). Past the clock's own, inside a
        step (:meth:`PhaseRows.step_starts`), the step that just trained is not counted yet (a scheduler's
        batch end that runs before PulseCycle's): the hold waits for :meth:`take_due_hold`, after
        :meth:`advance` counts that step, so it takes effect at the same step whatever the callback order.
        A waiting hold is not in :meth:`state_dict`; PulseCycle saves a checkpoint taken between the two batch
        ends (a callback's ``trainer.save_checkpoint``, a StabilityGuard's stop, listed between them) as
        :meth:`counted`, the step counted and the hold applied, as its batch end leaves the clock.
        """
        if step is not None and self.rows.in_step and step > self.step and self.stage != "pending":
            self._hold_due = bool(held)
            return []
        self._hold_due = None
        held = bool(held)
        changed, self.held = held != self.held, held
        if not changed or self.stage != "cycle" or not self.light_phases:
            return []
        if held and self.phase is Phase.BURST:
            position = self._first_nonzero(self.position + 1, skip_burst=True)
            reason = "hold"
        elif not held and self.phase is not Phase.BURST:
            if Phase.BURST not in self.order or self.durations[Phase.BURST].is_zero:
                return []
            position, reason = self.order.index(Phase.BURST), "release"
        else:
            return []
        if position <= self.position:
            self.cycle += 1
        self.position = position
        self.rows.phase_ended_by_hold()
        return [self._enter(self.order[position], reason)]

    @property
    def holding(self) -> bool:
        """Whether the cycle is held (:meth:`hold`), a hold that waits for its step to be counted included."""
        return self.held if self._hold_due is None else self._hold_due

    def take_due_hold(self) -> bool | None:
        """The hold that waits for the step that trained to be counted (:meth:`hold`), or ``None``; the
        caller applies it now, after :meth:`advance`."""
        due, self._hold_due = self._hold_due, None
        return due

    def end_rows(self) -> dict[str, float]:
        """At the fit's end, what PulseCycle logs at its last step: that step's row where none was written
        (:meth:`PhaseRows.take_last_row`), and ``pulse/<phase>_steps`` and ``pulse/<phase>_seconds`` of the
        phase in progress, as a change logs those of the phase it ends (none if it trained no step): the
        logged steps add up to the run's. A fit resumed in that phase logs it whole when it ends, a later row
        at a later step (the last row of a phase is its figure, as the last of an epoch is EnergyLogger's)."""
        row = dict(self.rows.take_last_row() or {})
        if self._segment_steps > 0:
            phase = f"pulse/{self.phase.value}"
            row[f"{phase}_steps"], row[f"{phase}_seconds"] = float(self._segment_steps), self._segment_seconds
        return row

    def start_or_resume(self, total_steps: int | float | None, step: int = 0) -> PhaseChange:
        """:meth:`start` at the run's optimizer ``step`` (:meth:`begin_at`), or on a clock already running (a
        resumed run keeps its restored phase) the :meth:`resume_change`: the change to tell listeners either
        way."""
        self.begin_at(step)
        change = self.start(total_steps)
        return self.resume_change() if change is None else change

    def start_note(self, change: PhaseChange, total_steps: float) -> str | None:
        """The line for the log at the fit's start, given the :meth:`start_or_resume` ``change``: where a
        resume goes on, or what a clock that started past step 0 with no saved state placed
        (:meth:`late_start_plan`); ``None`` for a clock that starts with the run."""
        if change.reason == "resume":
            return f"resuming in {change.place}."
        return self.late_start_plan(total_steps) if self.origin > 0 else None

    def resume_change(self) -> PhaseChange:
        """The change that tells listeners the phase training goes on in, reason ``"resume"``: after a
        checkpoint restore or a StabilityGuard rollback (which does not turn the clock back). Not kept in
        :attr:`history`: no phase ended."""
        return PhaseChange(None, self.phase, self.cycle, self.step, "resume")

    def check_epoch_length(self, batches_per_epoch: float) -> None:
        """Raise ``ValueError`` if a phase lasts epochs but an epoch has no length (an infinite dataloader)."""
        if self.uses_epochs and not math.isfinite(batches_per_epoch):
            raise ValueError(
                "epoch-based phase durations need a dataloader with a length; give the durations in steps or "
                "seconds instead."
            )

    def check_fit(
        self, batches_per_epoch: float, total_steps: float, optimizers_stepped_by_module: int = 0
    ) -> None:
        """Raise ``ValueError`` for a fit this clock cannot follow: where the module steps
        ``optimizers_stepped_by_module`` optimizers itself (manual optimization with several),
        :meth:`check_steps_per_batch_unknown` first, before the clock's own, generic, run-length refusal; then
        :meth:`check_epoch_length` and :meth:`check_run_length` (every share of a run of unknown length)."""
        if optimizers_stepped_by_module:
            self.check_steps_per_batch_unknown(optimizers_stepped_by_module, total_steps)
        self.check_epoch_length(batches_per_epoch)
        self.check_run_length(total_steps)

    def check_run_length(self, total_steps: int | float | None) -> None:
        """Raise ``ValueError`` if a share of the run this clock will still read (warm-up, before it ends;
        anneal) cannot be placed, the run having no known length (``total_steps`` infinite, no pinned span).

        Every such share is named in the one message, with a way out that covers them all: checked one at a
        time, the warm-up's way out (``warmup=0``) led to the anneal's refusal, a step into the run.
        """
        end = self._run_end(total_steps)
        if end is not None and math.isfinite(end):
            return
        still_read = {"anneal": self.anneal}
        if self.stage in ("pending", "warmup"):  # a resumed clock past its warm-up never reads it again
            still_read = {"warmup": self.warmup, **still_read}
        shares = [name for name, share in still_read.items() if share]
        if shares:
            given = " and ".join(f"`{name}`={getattr(self, name)!r}" for name in shares)
            what = "is a share" if len(shares) == 1 else "are shares"
            off = " and ".join(f"`{name}=0`" for name in shares)
            raise ValueError(f"{given} {what} of the run, which needs {KNOWN_LENGTH}; set one, or {off}.")

    def check_steps_per_batch_unknown(self, optimizers: int, total_steps: float) -> None:
        """Raise ``ValueError`` for settings read in optimizer steps per epoch or per run where a batch's
        steps are up to a module that steps ``optimizers`` optimizers itself: phases counted in epochs always,
        and warm-up or anneal unless the run's length in steps is known (``total_steps``: from max_steps)."""
        reason = UNKNOWN_STEPS_PER_BATCH.format(count=optimizers)
        if self.uses_epochs:
            given = ", ".join(f"`{p.value}`={d}" for p, d in self.durations.items() if d.kind == "epochs")
            raise ValueError(
                f"phases counted in epochs ({given}) need an epoch's length in optimizer steps, and "
                f"{reason}; give the durations in steps or seconds."
            )
        shares = [
            f"`{name}`={share!r}"
            for name, share in (("warmup", self.warmup), ("anneal", self.anneal))
            if share
        ]
        if shares and self.span is None and not math.isfinite(total_steps):
            what = "are shares" if len(shares) > 1 else "is a share"
            raise ValueError(
                f"{' and '.join(shares)} {what} of the run's optimizer steps, and {reason}. Set `warmup=0` "
                f"and `anneal=0`, or {STEPS_BOUND_ONLY}."
            )

    def remaining(self, steps_per_epoch: float | None = None) -> float:
        """Share of the current phase's budget still left, in ``[0, 1]`` (1 outside the cycle)."""
        if self.stage != "cycle":
            return 1.0
        duration = self.durations[self.phase]
        used = self._used(duration, steps_per_epoch)
        return max(0.0, 1.0 - used / duration.amount) if duration.amount else 0.0

    # ------------------------------------------------------------------ internals
    def _enter(self, phase: Phase, reason: str) -> PhaseChange:
        change = PhaseChange(
            previous=None if reason == "start" else self.phase,
            current=phase,
            cycle=self.cycle,
            step=self.step,
            reason=reason,
            ended_steps=self._segment_steps,
            ended_seconds=self._segment_seconds,
        )
        self.phase = phase
        self._segment_steps = 0
        self._segment_seconds = 0.0
        self._restart_budget()
        append_recent(self.history, change)
        return change

    def _restart_budget(self) -> None:
        self.steps_in_phase = 0
        self.seconds_in_phase = 0.0
        self.epochs_in_phase = 0.0

    def _first_nonzero(self, position: int, skip_burst: bool = False) -> int:
        if skip_burst and not self.light_phases:
            skip_burst = False
        for offset in range(len(self.order)):
            candidate = (position + offset) % len(self.order)
            phase = self.order[candidate]
            if not self.durations[phase].is_zero and not (skip_burst and phase is Phase.BURST):
                return candidate
        raise AssertionError("unreachable: constructor rejects all-zero cycles")

    def _used(self, duration: Duration, steps_per_epoch: float | None) -> float:
        if duration.kind == "steps":
            return float(self.steps_in_phase)
        if duration.kind == "seconds":
            return self.seconds_in_phase
        if not steps_per_epoch:
            raise ValueError("An epoch-based phase duration needs the number of steps per epoch.")
        return self.epochs_in_phase

    def _budget_spent(self, steps_per_epoch: float | None) -> bool:
        duration = self.durations[self.phase]
        # a tiny tolerance keeps epoch fractions like 0.1 * 10 steps from missing their boundary
        return self._used(duration, steps_per_epoch) >= duration.amount - 1e-9

    def _run_end(self, total_steps: int | float | None) -> int | float | None:
        """The step warm-up and anneal are placed up to: the pinned span (:meth:`pin_span`) or the run's."""
        return self.span if self.span is not None else total_steps

    def _steps_left(self, share: str, total_steps: int | float | None) -> float:
        """The steps from the clock's start to the run's end, which warm-up and anneal are shares of."""
        end = self._run_end(total_steps)
        if end is None or not math.isfinite(end):
            raise ValueError(
                f"`{share}`={getattr(self, share)!r} is a share of the run, which needs {KNOWN_LENGTH}; set "
                f"one, or `{share}=0`."
            )
        return max(end - self.origin, 0)

    def _warmup_end(self, total_steps: int | float | None) -> int:
        """The step the warm-up ends at (the clock's start: none)."""
        if not self.warmup:
            return self.origin
        return self.origin + int(round(self.warmup * self._steps_left("warmup", total_steps)))

    def _anneal_start(self, total_steps: int | float | None) -> int | None:
        """The step the anneal starts at, or ``None`` without one."""
        if not self.anneal:
            return None
        return self.origin + int(round((1.0 - self.anneal) * self._steps_left("anneal", total_steps)))


class StepTimer:
    """Reads what :meth:`PhaseClock.advance` takes from the run: the optimizer steps finished since the last
    reading and the seconds they took.

    Args:
        time_source: seconds counter; ``time.monotonic`` when ``None``. Tests inject a fake one.

    Raises:
        ValueError: for a ``time_source`` that is not callable.
    """

    def __init__(self, time_source: Callable[[], float] | None = None) -> None:
        if time_source is not None and not callable(time_source):
            raise ValueError(
                f"`time_source`={time_source!r} must be a callable returning seconds, or None for "
                "time.monotonic."
            )
        self.time_source = time_source or time.monotonic
        self._step = 0
        self._tick: float | None = None
        self._paused_at: float | None = None

    def start(self, step: int) -> None:
        """Count from optimizer step ``step`` (the run's, which a resume does not start at 0) and now.

        Raises:
            ValueError: when the time source returns something other than a number of seconds.
        """
        self._step, self._paused_at = step, None
        self._tick = self._now()

    def _now(self) -> float:
        # A Python float, whatever real number the source returns (numpy's float32 included): the readings
        # reach the checkpoint, which torch.load's default weights_only=True refuses when they hold numpy.
        now = self.time_source()
        if isinstance(now, bool) or not isinstance(now, numbers.Real):
            raise ValueError(f"`time_source` returned {now!r}; it must return seconds as a number.")
        return float(now)

    def lap(self, step: int) -> tuple[int, float] | None:
        """``(steps, seconds)`` from the last reading to optimizer step ``step``, which becomes the last reading;
        ``None`` when no step finished since (inside an accumulation window, or a skipped step)."""
        steps = step - self._step
        if steps <= 0:
            return None
        self._step = step
        now = self._now()
        seconds = now - (self._tick if self._tick is not None else now)
        self._tick = now
        return steps, seconds

    def pause(self, paused: bool) -> None:
        """Leave the time from ``pause(True)`` to ``pause(False)`` out of the next lap: no step ran in it (a
        GreenWindow pause), so no phase counted in time may spend it. Before :meth:`start` it does nothing
        (start reads the time afresh)."""
        if self._tick is None:
            return
        now = self._now()
        if paused:
            self._paused_at = now
        elif self._paused_at is not None:
            self._tick += max(now - self._paused_at, 0.0)
            self._paused_at = None


class PhaseRows:
    """Which steps get a ``pulse/phase`` and ``pulse/cycle`` row, and what it says: the phase and cycle the
    step trained in, read at its start (:meth:`step_starts`), since a scheduler holding light at its batch end
    (:meth:`PhaseClock.hold`, GreenWindow) can move the clock before PulseCycle's batch end reads it.

    A row at every ``log_every_n_steps``-th step, as Lightning logs (none at ``0``, as Lightning's), and at
    every switch whatever that cadence: the first step of a phase and the last one of a phase the clock ended,
    so that a phase shorter than the cadence still shows, at its true steps.
    """

    def __init__(self) -> None:
        self.trained: dict[str, float] = {}  # this step's phase code and cycle
        self._previous: dict[str, float] | None = None  # the last step's (None: the fit's first step)
        self._in_step = False  # between a step's start and its row's decision
        self._ended_by_hold = False  # a hold ended the step's phase before its row was decided
        self._unwritten: dict[str, float] | None = None  # the last step's row, where none was written
        self._late_row: dict[str, float] | None = None  # that row, due since a hold ended its phase after it

    def step_starts(self, clock: PhaseClock) -> None:
        self.trained = {"pulse/phase": clock.phase.code, "pulse/cycle": clock.cycle}
        self._in_step, self._ended_by_hold = True, False

    def after_step(self, step: int, every_n_steps: int, ended: bool) -> dict[str, float] | None:
        """The row of the step that just ended, or ``None``: ``step`` is Lightning's ``global_step`` after it,
        ``ended`` whether the clock ended a phase with it."""
        first = self.trained != self._previous
        self._previous, self._in_step = self.trained, False
        due = first or ended or self._ended_by_hold or is_step_row(step, every_n_steps)  # 0: none
        self._unwritten = None if due else self.trained
        return self.trained if due else None

    @property
    def in_step(self) -> bool:
        """Whether a step has started (:meth:`step_starts`) and its row is not decided yet
        (:meth:`after_step`): the clock has not counted it."""
        return self._in_step

    def phase_ended_by_hold(self) -> None:
        """A hold (:meth:`PhaseClock.hold`) ended the phase: the step in it that trained last was its last.
        Before that step's row was decided, it is written; after, it is due now (:meth:`take_late_row`)."""
        if self._in_step:
            self._ended_by_hold = True
        else:
            self._late_row, self._unwritten = self._unwritten, None

    def take_late_row(self) -> dict[str, float] | None:
        row, self._late_row = self._late_row, None
        return row

    def take_last_row(self) -> dict[str, float] | None:
        """At the fit's end: the last step's row where none was written (off the cadence, no phase ended),
        so the fit's last step, the last of its phase, shows; a later fit's hold finds none left."""
        row, self._unwritten = self._unwritten, None
        return row


#: what PulseCycle's ``maintain_eval`` accepts
PROBE_MODES = ("probe", "none")


#: PulseCycle's defaults for the options that belong to one phase: set away from them for a phase that
#: ``order`` leaves out, they would do nothing (a test holds them to PulseCycle's signature)
PHASE_OPTION_DEFAULTS = {
    "burst": {"burst": 60},
    "replay": {"replay": 30, "budget": None},
    "maintain": {"maintain": 10, "maintain_eval": "probe", "probe_batches": 4},
}


def _is_default(field: str, value: Any, default: Any) -> bool:
    """Whether ``value`` is ``default``, durations compared as durations (``"10 steps"`` is ``10``)."""
    if value == default:
        return True
    if field in PHASE_NAMES:
        try:
            return parse_duration(value, field) == parse_duration(default, field)
        except ValueError:
            return False
    return False


def _means_off(field: str, value: Any) -> bool:
    """Whether ``value`` of a phase's option says the phase is off (a zero length, no maintain evaluation): the
    same as leaving the phase out of ``order``, so not an option that would do nothing."""
    if field == "maintain_eval":
        return value == "none"
    if field in PHASE_NAMES:
        try:
            return parse_duration(value, field).is_zero
        except ValueError:
            return False
    return False


def check_cycle_options(
    maintain_eval: str,
    probe_batches: int,
    budget: float | None,
    durations: dict[str, Any] | None = None,
    order: Sequence[str] = PHASE_NAMES,
) -> float | None:
    """Validate PulseCycle's options besides the clock's; return ``budget`` as a float (or ``None``).

    Raises:
        ValueError: naming the field, for an unknown ``maintain_eval``, a non-positive ``probe_batches``, a
            ``budget`` outside ``(0, 1)``, or an option of a phase that ``order`` leaves out, set away from
            its default (it would do nothing).
    """
    if maintain_eval not in PROBE_MODES:
        raise ValueError(f"PulseCycle: `maintain_eval`={maintain_eval!r} is not one of {list(PROBE_MODES)}.")
    if isinstance(probe_batches, bool) or not isinstance(probe_batches, int) or probe_batches < 1:
        raise ValueError(f"PulseCycle: `probe_batches`={probe_batches!r} must be a positive int.")
    if budget is not None and (
        isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0 < budget < 1
    ):
        raise ValueError(
            f"PulseCycle: `budget`={budget!r} must be a number in (0, 1): the share of the plain run's "
            "optimizer steps to spend (or None for the durations as given)."
        )
    if maintain_eval == "none" and probe_batches != PHASE_OPTION_DEFAULTS["maintain"]["probe_batches"]:
        raise ValueError(
            f"PulseCycle: `probe_batches`={probe_batches!r} sizes the maintain probe, which "
            "`maintain_eval`='none' turns off, so it would do nothing; drop it, or use maintain_eval='probe'."
        )
    given = {
        **(durations or {}),
        "maintain_eval": maintain_eval,
        "probe_batches": probe_batches,
        "budget": budget,
    }
    for phase, defaults in PHASE_OPTION_DEFAULTS.items():
        if phase in order:
            continue
        for field, default in defaults.items():
            if (
                field not in given
                or _is_default(field, given[field], default)
                or _means_off(field, given[field])
            ):
                continue
            raise ValueError(
                f"PulseCycle: `{field}`={given[field]!r} belongs to the {phase} phase, which `order`="
                f"{list(order)} leaves out, so it would do nothing; drop it, or add {phase!r} to `order`."
            )
    return None if budget is None else float(budget)


def cycle_clock(
    burst: DurationLike,
    replay: DurationLike,
    maintain: DurationLike,
    order: Sequence[str],
    warmup: float,
    anneal: float,
    maintain_eval: str,
    probe_batches: int,
    budget: float | None,
) -> tuple[PhaseClock, float | None]:
    """PulseCycle's :class:`PhaseClock` and its ``budget`` as a float (or ``None``), from its options: the
    phase durations and the clock's checked first, then the rest (:func:`check_cycle_options`).

    Raises:
        ValueError: for an ``order`` that is not a list of phase names, and as :class:`PhaseClock` and
            :func:`check_cycle_options` do.
    """
    # a string is a sequence too: its letters would be read as phases; a set has no order
    if isinstance(order, str) or not isinstance(order, Sequence):
        raise ValueError(f"`order`={order!r} must be a list of phase names, such as {list(PHASE_NAMES)}.")
    durations = {"burst": burst, "replay": replay, "maintain": maintain}
    clock = PhaseClock(durations, order=list(order), warmup=warmup, anneal=anneal)
    return clock, check_cycle_options(maintain_eval, probe_batches, budget, durations, list(order))


def unreachable_phases(owner: str, phases: Sequence[Any], clock: PhaseClock | None) -> str | None:
    """Why ``owner``, which acts only in ``phases``, would do nothing, or ``None`` where one of them comes: next
    to a PulseCycle whose ``clock`` has none of them (:attr:`PhaseClock.reachable_phases`), or without one
    (``clock`` ``None``: :func:`unreachable_alone`). Only where none comes: a callback left one phase acts in it."""
    if clock is None:
        return unreachable_alone(owner, phases)
    names = [getattr(phase, "value", phase) for phase in phases]
    has = [phase.value for phase in clock.reachable_phases]
    if any(name in has for name in names):
        return None
    order = [phase.value for phase in clock.order]
    why = ", ".join(
        f"{name!r} is left out of its `order`={order}"
        if name not in order
        else f"`{name}`={clock.durations[Phase(name)]} skips it"  # as given: 0s, 0epochs, 0steps
        for name in names
    )
    one = "that phase" if len(names) == 1 else "one of them"
    ones = [phase.value for phase in clock.light_phases] or has  # its light phases, where it has any
    return (
        f"{owner}: `phases`={names} never come in the attached PulseCycle, whose phases are {has} ({why}), so "
        f"it would do nothing in a run of any length. Give the PulseCycle {one} (in `order`, with a length "
        f"above 0), set {owner}'s `phases` to phases it has ({ones}), or remove {owner}."
    )


def unreachable_alone(owner: str, phases: Sequence[Any]) -> str | None:
    """Why ``owner``, which acts only in ``phases``, would do nothing in a run without a PulseCycle (every
    step of such a run counts as ``replay``, so phases without it never come), or ``None`` where ``phases``
    include replay."""
    names = [getattr(phase, "value", phase) for phase in phases]
    if Phase.REPLAY.value in names:
        return None
    return (
        f"{owner}: `phases`={names} never come in a run without a PulseCycle (every step counts as "
        "'replay'), so it would do nothing. Add a PulseCycle to the callbacks, or include 'replay'."
    )
