"""The gradual pruning schedule of Zhu & Gupta (2017), as plain Python: when to prune, and to what sparsity.

:class:`PruneSchedule` is configured with the user's ``start``/``end`` (an optimizer step or a share of the
run), resolved to steps once the run's length is known, and tracks the sparsity its events reached so far.
Targets are absolute and only grow: an event prunes to the schedule's value at its step, never by a share of
what is left.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable
from typing import Any

from lightning_pulse.phase import KNOWN_LENGTH

#: the default step cadence, which cadence='maintain' never reads
PRUNE_EVERY_DEFAULT = 100

_EPSILON = 1e-9


def cubic_sparsity(step: float, initial: float, final: float, start_step: float, end_step: float) -> float:
    """Sparsity at ``step`` on the schedule of Zhu & Gupta (2017), Eq. 1.

    ``s_t = s_f + (s_i - s_f) * (1 - (t - t_0) / (n * dt))**3`` for ``t_0 <= t <= t_0 + n * dt``, with
    ``t_0 = start_step`` and ``t_0 + n * dt = end_step``; ``s_i`` before the start, ``s_f`` after the end.
    Pruning is fast early, while the network is redundant, and slows as it approaches the final sparsity.
    """
    if step >= end_step:  # first: a one-shot schedule (start == end) prunes to `final` at that step
        return float(final)
    if step <= start_step:
        return float(initial)
    progress = (step - start_step) / (end_step - start_step)
    return float(final + (initial - final) * (1.0 - progress) ** 3)


def check_share(value: Any, field: str, upper_open: bool = False) -> None:
    """Raise a ``ValueError`` naming ``field`` unless ``value`` is a number in ``[0, 1]`` (``[0, 1)``)."""
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if not ok or value < 0 or (value >= 1 if upper_open else value > 1):
        allowed = "[0, 1)" if upper_open else "[0, 1]"
        raise ValueError(f"`{field}`={value!r} must be a number in {allowed}.")


def check_int(value: Any, field: str, minimum: int) -> None:
    """Raise a ``ValueError`` naming ``field`` unless ``value`` is an ``int >= minimum`` (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"`{field}`={value!r} must be an int >= {minimum}.")


def check_when(value: Any, field: str) -> None:
    """Raise a ``ValueError`` naming ``field`` unless ``value`` is an int step >= 0 or a float share in [0, 1]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(
            f"`{field}`={value!r} must be an int optimizer step or a float share of the run in [0, 1]."
        )
    if isinstance(value, int) and value < 0:
        raise ValueError(f"`{field}`={value!r} must be a non-negative optimizer step.")
    if isinstance(value, float) and not 0 <= value <= 1:
        raise ValueError(f"`{field}`={value!r} is a share of the run and must be in [0, 1].")


def resolve_step(when: int | float, total_steps: float, field: str) -> int:
    """An ``int`` step as given, or a ``float`` share of ``total_steps`` rounded to a step."""
    if isinstance(when, int):
        return when
    if not math.isfinite(total_steps):
        raise ValueError(
            f"`{field}`={when} is a share of the run, which needs {KNOWN_LENGTH}; give an int step instead."
        )
    return int(round(when * total_steps))


class PruneSchedule:
    """When to prune and to what sparsity, with the sparsity reached so far.

    Events come from outside: :meth:`advance` is called at each chance to prune (a maintain-phase start, or a
    step at or after :attr:`next_step` on the step cadence) and returns the target to prune to, or ``None``
    when the schedule asks for nothing more than what was reached. Before :meth:`resolve` the span is unknown.

    Args:
        final_sparsity: sparsity at and after ``end``, in ``[0, 1)``.
        initial_sparsity: sparsity at ``start``, in ``[0, final_sparsity]``.
        start: an ``int`` optimizer step, or a ``float`` share of the run in ``[0, 1]``.
        end: same forms; not before ``start``.
        every: steps between chances on the step cadence.

    Raises:
        ValueError: naming the field, for a value out of range or of the wrong type.
    """

    def __init__(
        self,
        final_sparsity: float = 0.5,
        initial_sparsity: float = 0.0,
        start: int | float = 0.1,
        end: int | float = 0.7,
        every: int = PRUNE_EVERY_DEFAULT,
    ) -> None:
        check_share(final_sparsity, "final_sparsity", upper_open=True)
        check_share(initial_sparsity, "initial_sparsity", upper_open=True)
        if initial_sparsity > final_sparsity:
            raise ValueError(
                f"`initial_sparsity`={initial_sparsity} must not exceed `final_sparsity`={final_sparsity}; "
                "sparsity only grows."
            )
        check_when(start, "start")
        check_when(end, "end")
        if type(start) is type(end) and end < start:
            raise ValueError(f"`end`={end!r} comes before `start`={start!r}.")
        check_int(every, "every", minimum=1)
        self.final_sparsity = float(final_sparsity)
        self.initial_sparsity = float(initial_sparsity)
        self.start, self.end, self.every = start, end, every
        self.start_step = self.end_step = 0
        self.sparsity = 0.0  # the target of the last event
        self.finished = False
        self.next_step: int | None = None

    @property
    def shares(self) -> dict[str, int | float]:
        """``start`` and ``end`` as given: a ``float`` is a share of the run, placed on its length."""
        return {"start": self.start, "end": self.end}

    def resolve(self, total_steps: float) -> None:
        """Fix the span in optimizer steps for a run of ``total_steps`` (``inf`` if unknown); a restored
        chance before ``start`` moves up to it."""
        self.start_step = resolve_step(self.start, total_steps, "start")
        self.end_step = resolve_step(self.end, total_steps, "end")
        if self.end_step < self.start_step:
            raise ValueError(f"`end` (step {self.end_step}) comes before `start` (step {self.start_step}).")
        # a resume whose start moved past the chance its checkpoint saved (a longer run with a share `start`,
        # a smaller batch, a later `start`): nothing is due before the start, and a chance left before it
        # hung planned_cuts (advance never moved it)
        if not self.finished and (self.next_step is None or self.next_step < self.start_step):
            self.next_step = self.start_step

    def reopen(self, step: int) -> bool:
        """At a resume at optimizer ``step``: open a schedule the checkpoint restored as finished again when
        this run's ``final_sparsity`` is above the sparsity it reached (raised on resume), its next chance on
        the step cadence at the next step or at ``start``. Returns whether it did; call after :meth:`resolve`.
        A finished mid-run schedule meets the raised target as an unfinished one does: at the schedule's value
        at each later chance, on this run's span."""
        if not self.finished or self.final_sparsity <= self.sparsity + _EPSILON:
            return False
        self.finished = False
        self.next_step = max(step + 1, self.start_step)
        return True

    def target(self, step: int) -> float:
        """The schedule's sparsity at ``step``."""
        return cubic_sparsity(
            step, self.initial_sparsity, self.final_sparsity, self.start_step, self.end_step
        )

    def sample_targets(self, count: int = 8) -> list[float]:
        """``count`` targets of the resolved schedule at evenly spaced steps from ``start`` to ``end`` (the
        last is ``final_sparsity``): the levels a model is checked at before training."""
        span = self.end_step - self.start_step
        steps = [self.start_step + span * (i + 1) / count for i in range(count)] if span else [self.end_step]
        return sorted({t for t in (self.target(step) for step in steps) if t > 0.0})

    def due(self, step: int) -> bool:
        """Whether the step cadence has a chance to prune at ``step``."""
        return not self.finished and self.next_step is not None and step >= self.next_step

    def advance(self, step: int) -> float | None:
        """Take the chance to prune at ``step``: the sparsity to prune to now, or ``None``."""
        if self.finished:
            return None
        if step < self.start_step:
            self.next_step = self.start_step  # the chance moves on: a caller looping on it cannot spin
            return None
        target = self.target(step)
        reached_end = step >= self.end_step
        self.next_step = None if reached_end else min(step + self.every, self.end_step)
        self.finished = reached_end
        if target <= self.sparsity + _EPSILON:
            return None
        self.sparsity = target
        return target

    def planned_cuts(
        self, chances: Iterable[int] | None = None, until: float = math.inf
    ) -> list[tuple[int, float, float]]:
        """The events of the resolved schedule, as ``(step, from, to)`` sparsities, from the sparsity reached
        so far (nothing is changed): at the step cadence's chances, or at ``chances`` (the steps, in order, at
        which maintain phases start), before step ``until`` (the run's end, where no cut is made).

        ``until`` bounds the work too: an int ``end`` far past a short run with ``every=1`` took 3 s and a
        million entries at 10**6 without it. Each step-cadence chance moves :attr:`next_step` past the one
        before, up to ``end``, where the schedule finishes; a chance that does not (a bug) ends the plan rather
        than the fit (a chance left before ``start`` on a resume spun here forever, deaf to SIGTERM)."""
        cuts: list[tuple[int, float, float]] = []
        if math.isinf(self.end_step):
            return cuts
        trial = copy.copy(self)  # its fields are numbers: advancing it leaves this schedule as it is
        given = None if chances is None else iter(chances)
        while not trial.finished:
            step = trial.next_step if given is None else next(given, None)
            if step is None or step >= until:
                break
            before = trial.sparsity
            if (target := trial.advance(step)) is not None:
                cuts.append((step, before, target))
            if given is None and not trial.finished and (trial.next_step is None or trial.next_step <= step):
                break
        return cuts

    def state_dict(self) -> dict[str, Any]:
        return {"sparsity": self.sparsity, "finished": self.finished, "next_event_step": self.next_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sparsity = float(state["sparsity"])
        self.finished = bool(state["finished"])
        self.next_step = state["next_event_step"]
