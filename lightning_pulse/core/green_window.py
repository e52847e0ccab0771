"""When to run the expensive part of training: the green-window policy, its clocks and its accounting.

Plain Python and numpy, no Lightning: :class:`~lightning_pulse.GreenWindow` maps trainer hooks onto these
objects, and ``benchmarks/green_window.py`` drives the same objects on the 2020 grid series.

* :class:`GreenWindowPolicy` decides, at a moment, from the signal's history and a forecast, whether the
  slot starting now is clean enough to run, given the remaining compute, the remaining delay budget and an
  optional deadline. It never waits when waiting one slot could make the job miss its deadline or overrun
  its delay budget (:meth:`GreenWindowPolicy.decide`).
* :class:`SimulatedClock` stands in for the wall clock: sleeping advances it instantly, so days of a real
  series replay in seconds; :class:`SystemClock` is the real one; :class:`RunClock` keeps a run's time from
  going back (a resume on a clock that reads earlier than the checkpoint's save continues from the save), and
  on a clock with a monotonic companion finds the spans a forward step of the clock jumped over.
* :class:`ScheduleLedger` keeps what ran when, with its energy, and prices it against the counterfactual:
  the same energy on a carbon-agnostic schedule started at the same moment.
* :func:`simulate_job` runs a job of a given compute length through the policy on a clock, slot by slot.
"""

from __future__ import annotations

import importlib
import math
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from lightning_pulse.energy.carbon import TimeSeries, format_utc, parse_timestamp
from lightning_pulse.energy.forecast import Forecast
from lightning_pulse.energy.report import SMOKE_TEST
from lightning_pulse.energy.signal import LIVE_READ_TIMEOUT_S, GreenSignal, SignalUnreadable
from lightning_pulse.errors import PulseRefusal, plain_fields
from lightning_pulse.phase import (
    KNOWN_LENGTH,
    SECONDS_UNIT_NAMES,
    STEPS_BOUND_ONLY,
    UNKNOWN_STEPS_PER_BATCH,
    parse_duration,
)
from lightning_pulse.records import RECENT_RECORDS, append_recent

COMPUTE_KINDS = ("run", "light")
SEGMENT_KINDS = (*COMPUTE_KINDS, "wait")


# ---------------------------------------------------------------------------- clocks
class SystemClock:
    """The machine's clock: Unix seconds, and a real sleep. Its :meth:`monotonic` companion never steps: an
    NTP step or a suspend moves ``time()`` alone, and :class:`RunClock` books that as time away."""

    def time(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)

    def __call__(self) -> float:
        return self.time()


class SimulatedClock:
    """Unix seconds that move only when told: :meth:`sleep` and :meth:`advance` add seconds instantly.

    Calling the clock gives its time too, so the same object can be the time source of an EnergyLogger's
    account (``energy.account.clock = energy.account.wall_clock = clock``) and of a PulseCycle.

    Args:
        start: where the clock starts, Unix seconds or a UTC timestamp such as ``"2020-06-08 00:00:00"``.
    """

    def __init__(self, start: float | str = "2020-06-08 00:00:00") -> None:
        self.now = float(start) if isinstance(start, (int, float)) else parse_timestamp(str(start))

    def time(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += max(float(seconds), 0.0)

    advance = sleep

    def __call__(self) -> float:
        return self.now


def unbuilt_clock(clock: Any) -> str | None:
    """Why a ``clock`` given as ``{class_path, init_args}`` was not built, or ``None`` for any other value.
    jsonargparse hands GreenWindow's ``clock: Any`` on as that mapping (or a Namespace) when it cannot build
    it: building it again here names the real problem (a class_path typo, an unknown or bad init_arg)."""
    if hasattr(clock, "as_dict"):  # a jsonargparse Namespace
        clock = clock.as_dict()
    if not isinstance(clock, Mapping) or not isinstance(clock.get("class_path"), str):
        return None
    class_path, init_args = clock["class_path"], clock.get("init_args") or {}
    unknown = sorted(set(clock) - {"class_path", "init_args"})
    if unknown:
        return (
            f"{class_path}: unknown key(s) {', '.join(map(repr, unknown))} next to class_path and init_args"
        )
    if not isinstance(init_args, Mapping):
        return f"{class_path}: `init_args`={init_args!r} is not a mapping"
    module_name, _, name = class_path.rpartition(".")
    try:
        built = getattr(importlib.import_module(module_name), name)(**init_args)
    except Exception as error:  # what jsonargparse met and did not say
        arguments = ", ".join(f"{key}={value!r}" for key, value in init_args.items())
        return f"{class_path}({arguments}) could not be built ({type(error).__name__}: {error})"
    if all(callable(getattr(built, method, None)) for method in ("time", "sleep")):
        return None  # it builds here: the generic message stands
    return f"{class_path} builds a {type(built).__name__}, which has no `time()` and `sleep(seconds)`"


CLOCK_STEP_TOLERANCE_S = 1.0  # wall and monotonic progress differ by less: reading jitter, not a step
CLOCK_STEP_WARN_S = 60.0  # a step this long is warned (once a fit); shorter ones are booked silently


class RunClock:
    """A run's time: its clock's reading, moved later where needed so that it never goes back.

    A run resumed on a clock that reads earlier than its checkpoint's save (a SimulatedClock restarted at the
    run's start, a host whose clock is behind the saving host's) continues from the save: every reading moves
    later by the difference, as if the clock read the save time when training resumed. Durations then never
    come out negative, the signal and the deadline are read at the times the saving run would have read them,
    and no time is counted as waited while the run was down (none can be measured). A clock that steps back
    during a run (an NTP correction) is held the same way.

    A clock with a ``monotonic()`` companion (:class:`SystemClock`) is also read on it: where the clock moves
    further than the monotonic one between two readings (an NTP step forward, a resume from a laptop's
    suspend), the difference is time away, not compute. The run's time follows the clock (the signal's hours
    are the clock's), and the span jumped over is kept in :attr:`away` for the open segment to book as waited
    (:meth:`OpenSegment.close`); a step over :data:`CLOCK_STEP_WARN_S` is warned once (:attr:`news`). A clock
    of the user's without one is read next to the system clock's pair (:class:`SystemClock`): between two
    readings where it moved as ``time.time()`` did (a wrapper of it, or an offset), the system clock's step is
    its step; where it did not (a clock that moves only when told), it is taken as it reads, as a
    :class:`SimulatedClock` always is.

    Args:
        clock: an object with ``time()`` (Unix seconds) and ``sleep(seconds)``, maybe ``monotonic()``.

    Raises:
        ValueError: naming ``clock`` when it lacks one of them.
    """

    def __init__(self, clock: Any) -> None:
        if not all(callable(getattr(clock, name, None)) for name in ("time", "sleep")):
            if (unbuilt := unbuilt_clock(clock)) is not None:
                raise ValueError(
                    f"`clock`: {unbuilt}; give the class_path of a clock and its init_args (e.g. "
                    "lightning_pulse.SimulatedClock with `start`), or null for the system clock."
                )
            raise ValueError(
                f"`clock`={clock!r} must have `time()` (Unix seconds) and `sleep(seconds)` methods, or be "
                "None for the system clock."
            )
        self.clock = clock
        self.behind_s = 0.0  # added to every reading of the clock
        self.latest = -math.inf
        monotonic = getattr(clock, "monotonic", None)
        self.monotonic: Callable[[], float] | None = monotonic if callable(monotonic) else None
        # no companion of its own: the system clock's, for a clock that follows it (a step of the system clock
        # moved it too, and was booked as compute)
        self.system = None if self.monotonic or isinstance(clock, SimulatedClock) else SystemClock()
        self.last: tuple[float, float, float] | None = None  # the run's, monotonic and system time then
        self.away: list[tuple[float, float]] = []  # spans of the run's time a clock step jumped over
        self.news: list[str] = []  # warnings for the caller to give (GreenSchedule.news where built together)
        self.told_step = False

    def restart(
        self,
        saved: Mapping[str, Any] | None = None,
        suspended: Mapping[str, Any] | None = None,
        carried_s: float = 0.0,
    ) -> tuple[float, str | None]:
        """Training (re)starts, fresh or from a checkpoint that held the ``saved`` segment (saved at
        ``saved_at``) and maybe a suspend (``at``): the run's time continues from the later of the two when
        the clock reads earlier. ``carried_s`` is the shift the checkpoint's run already had (its
        :attr:`behind_s`): it applies first, since the resume file a suspend wrote is on the clock itself, so
        a run resumed at that file's time comes back at the run's own ``resume_at``. Returns the run's time
        now, and the line that says it was moved further (else ``None``).

        Raises:
            ValueError: when the clock's ``time()`` returns no number.
        """
        raw = self.clock.time()
        if isinstance(raw, bool) or not isinstance(raw, (int, float)):
            raise ValueError(f"`clock.time()` returned {raw!r}; it must return Unix seconds.")
        marks = [(saved or {}).get("saved_at"), (suspended or {}).get("at")]
        floor = max((float(mark) for mark in marks if mark is not None), default=-math.inf)
        now = raw + carried_s
        moved = max(floor - now, 0.0)
        self.behind_s, self.latest, self.last, self.away = carried_s + moved, -math.inf, None, []
        if not moved:
            return self.time(), None
        behind = f"{moved / 3600:.1f} h" if moved >= 3600 else f"{moved:.0f} s"
        return self.time(), (
            f"GreenWindow: the clock reads {format_utc(now)}, {behind} before the checkpoint's save at "
            f"{format_utc(floor)}; the run's time continues from the save (every reading moved {behind} "
            "later), and nothing is counted as waited while the run was down."
        )

    def suspension(self, now: float, decision: Decision) -> tuple[dict[str, float], float, float]:
        """A suspend at ``now`` (the run's time) on ``decision``: the record the checkpoint keeps (``at`` and
        ``resume_at``, the decision's resume time moved by the time since it was made, on the run's time), and
        the suspend's and the resume's times on the clock itself (less :attr:`behind_s`) for the resume file:
        wait-for-window reads it on the clock itself, not on the run's (moved) time."""
        resume_at = now + (decision.resume_at or now) - decision.at
        return {"at": now, "resume_at": resume_at}, now - self.behind_s, resume_at - self.behind_s

    def time(self) -> float:
        now = float(self.clock.time()) + self.behind_s
        if now < self.latest:  # the clock stepped back: the run's time carries on from where it was
            self.behind_s += self.latest - now
            now = self.latest
        if self.monotonic is not None or self.system is not None:
            wall = math.nan if self.system is None else self.system.time()
            mono = float(self.monotonic() if self.system is None else self.system.monotonic())
            if self.last is not None:
                stepped = (now - self.last[0]) - (mono - self.last[1])
                if self.system is not None:  # the system clock's step, where this clock moved as it did
                    moved = wall - self.last[2]
                    follows = abs(now - self.last[0] - moved) <= CLOCK_STEP_TOLERANCE_S
                    stepped = moved - (mono - self.last[1]) if follows else 0.0
                if stepped > CLOCK_STEP_TOLERANCE_S:
                    self.stepped(now - stepped, now)
            self.last = (now, mono, wall)
        self.latest = now
        return now

    def stepped(self, start: float, end: float) -> None:
        """The clock jumped from the run's ``start`` to ``end`` with no monotonic time passing: time away."""
        self.away.append((start, end))
        if end - start >= CLOCK_STEP_WARN_S and not self.told_step:
            self.told_step = True
            self.news.append(
                f"GreenWindow: the clock stepped forward {span_text(end - start)} at {format_utc(start)} "
                "(an NTP step, or a resume from suspend): the monotonic clock saw no time pass, so the step "
                "is booked as time away (waited: it counts against the delay budget), not as compute; the "
                "run's time, and the signal's hour, follow the clock."
            )

    def take_away(self, start: float, end: float) -> list[tuple[float, float]]:
        """The spans a clock step jumped over within ``[start, end]`` (the run's time), clipped to it; they
        are booked now, so spans that end by ``end`` are dropped."""
        within = [(max(a, start), min(b, end)) for a, b in self.away if b > start and a < end]
        self.away = [(max(a, end), b) for a, b in self.away if b > end]
        return within


WAIT_SLICE_S = 1.0  # a real pause sleeps in slices this long, so that a stop request (SIGTERM) ends it soon
FAST_DEV_RUN_LINE = (
    "GreenWindow: fast_dev_run: it does not act (no wait, hold or suspend: the smoke test runs its batches) "
    "and writes no report (kept in `.report`)."
)
NO_ENERGY_LINE = "GreenWindow: no EnergyLogger and no options.watts; savings in % and per kWh only."
NOTHING_TO_SUSPEND = (  # a suspend at a step where the fit ends anyway (SuspendSave): the run finishes
    "GreenWindow: the fit ends at this step anyway (its last step, or a stop asked): nothing to suspend."
)


def pause(clock: Any, seconds: float, stop: Callable[[], bool]) -> bool:
    """Sleep ``seconds`` on ``clock`` unless ``stop()`` says to stop (the trainer received SIGTERM): ``True``
    when the whole pause was slept. A real clock sleeps in :data:`WAIT_SLICE_S` slices and asks between them:
    Lightning's SIGTERM handler only sets a flag, and one long ``time.sleep`` resumes after it (PEP 475), so
    the process slept on (up to a slot) until the supervisor's SIGKILL. A :class:`SimulatedClock` moves
    in one step: no real time passes in it, so nothing can arrive meanwhile."""
    if isinstance(clock, SimulatedClock):
        if stop():
            return False
        clock.sleep(seconds)
        return True
    left = float(seconds)
    while left > 0:
        if stop():
            return False
        clock.sleep(min(left, WAIT_SLICE_S))
        left -= WAIT_SLICE_S
    return True


def pause_slot(
    run_clock: RunClock, segment: OpenSegment, seconds: float, stop: Callable[[], bool], account: Any = None
) -> str | None:
    """A pause of ``seconds`` on ``run_clock``'s clock (:func:`pause`, ended early when ``stop()``), booked in
    ``segment`` as waited from the run's time before it to the run's time after it. ``account``: an attached
    EnergyLogger's :class:`~lightning_pulse.energy.account.EnergyAccount` (or ``None``): the pause is booked
    there to no training stage (``not_training``), and its meters are read at the pause's end. Returns
    ``None`` when the whole pause was slept, else the line that says ``stop()`` (SIGTERM) ended it."""
    start = run_clock.time()
    with nullcontext() if account is None else account.not_training():
        slept = pause(run_clock.clock, seconds, stop)
        segment.waited(start, end := run_clock.time(), None if account is None else account.kwh_now())
    return None if slept else f"GreenWindow: SIGTERM received; the pause ends after {end - start:.0f} s."


# ---------------------------------------------------------------------------- the policy
@dataclass(frozen=True)
class Decision:
    """One run-or-wait decision and what it was based on.

    Attributes:
        at: when it was taken, in signal-series seconds.
        run: whether the slot starting now runs.
        reason: ``"clean"`` (the rule says run), ``"dirty"`` (it says wait), ``"deadline"`` or ``"budget"``
            (waiting one more slot could miss the deadline / overrun the delay budget, or the work left no
            longer fits before the deadline, so it runs), ``"max_time"`` (a pause would leave less than one
            slot of ``Trainer(max_time)`` to train in: :meth:`GreenSchedule.within_max_time`), ``"held"``
            (a series read past its end holds its last value: no later slot is cleaner, so it runs).
        signal: the value observed now.
        forecast_now: the forecast's value for the slot starting now (the observed value, except for an oracle).
        clean_below: the level the rule compared it against (``-inf`` when no slot has to run: light mode
            whose budget covers the rest of the run holds every slot).
        wait_s: seconds until the next decision when waiting (one slot), else 0.
        resume_at: when waiting, the start of the first later slot the forecast calls clean (or the latest
            start that still meets the deadline and budget): where a suspended run should come back.
        remaining_work_s: compute still to do, as the caller estimated it.
        budget_left_s: delay budget left before this decision.
    """

    at: float
    run: bool
    reason: str
    signal: float
    forecast_now: float
    clean_below: float
    wait_s: float
    resume_at: float | None
    remaining_work_s: float
    budget_left_s: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Decision:
        return cls(**{name: data[name] for name in cls.__dataclass_fields__})


UNHELD_STAGES = {"warmup": "warm-up", "anneal": "anneal"}  # PulseCycle's stages that a hold cannot lighten


def decision_line(decision: Decision, when_dirty: str, now: float, stage: str = "cycle") -> str:
    """The line that announces a switch between running and waiting (``when_dirty`` says how it waits), at
    wall time ``now``; ``stage``: PulseCycle's (light mode), whose warm-up and anneal a hold cannot lighten."""
    word = "runs" if decision.run else f"waits ({when_dirty})"
    level = (
        f"clean at or below {decision.clean_below:.4g}"
        if math.isfinite(decision.clean_below)
        else "its light budget covers the rest of the run"
    )
    line = f"GreenWindow: {word} at {format_utc(now)}: signal {decision.signal:.4g}, {level} ({decision.reason})."
    if decision.reason == "held":
        line = line[:-1] + ": the series has ended and holds its last value, so no later hour is cleaner."
    if not decision.run and when_dirty == "light" and stage in UNHELD_STAGES:
        line += (
            f" PulseCycle's {UNHELD_STAGES[stage]} trains as usual: nothing is held, nor charged to the delay "
            "budget, while it lasts."
        )
    return line


def parse_threshold(value: float | str | None, field: str = "threshold") -> tuple[str, float | None]:
    """``None`` -> ``("adaptive", None)``; ``"30%"`` -> ``("percentile", 30.0)``; ``250`` -> ``("absolute", 250.0)``."""
    allowed = "None (adaptive), a percentile such as '30%', or an absolute level >= 0 (a number)"
    if value is None:
        return "adaptive", None
    if isinstance(value, bool):
        raise ValueError(f"`{field}`={value!r} is not accepted; expected {allowed}.")
    if isinstance(value, str) and value.strip().endswith("%"):
        try:
            share = float(value.strip()[:-1])
        except ValueError:
            share = math.nan
        if not 0 < share < 100:
            raise ValueError(f"`{field}`={value!r}: a percentile must be in (0%, 100%); expected {allowed}.")
        return "percentile", share
    try:
        level = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"`{field}`={value!r} is not accepted; expected {allowed}.") from None
    if not math.isfinite(level) or level < 0:
        raise ValueError(f"`{field}`={value!r} is not accepted; expected {allowed}.")
    return "absolute", level


class GreenWindowPolicy:
    """Run or wait, one slot at a time, from the signal now and a forecast of the slots ahead.

    The window is ``[now, min(now + remaining_work + budget_left, deadline))``. The rule compares the
    forecast for the slot starting now with a level computed over the slots ahead:

    * ``"adaptive"`` (default): the ``k``-th smallest forecast slot in the window, ``k`` the slots of work
      left, i.e. "now is among the cleanest slots the remaining work still needs". With a perfect forecast it
      picks exactly the cleanest slots of the window (``benchmarks/green_window.py`` checks this against a
      direct computation).
    * ``"percentile"``: the given percentile of the forecast over the next ``horizon_s`` (default: the window).
    * ``"absolute"``: a fixed level in the signal's unit.

    Args:
        forecast: predicts slot means (:mod:`lightning_pulse.energy.forecast`).
        threshold: ``None`` (adaptive), ``"30%"`` (a percentile) or a number (absolute); see
            :func:`parse_threshold`.
        horizon_s: how far the percentile rule looks, in seconds; ``None`` = the whole window.
        slot_s: seconds per decision slot.
    """

    def __init__(
        self,
        forecast: Forecast,
        threshold: float | str | None = None,
        horizon_s: float | None = None,
        slot_s: float = 3600.0,
    ) -> None:
        self.rule, self.level = parse_threshold(threshold)
        if horizon_s is not None and not horizon_s > 0:
            raise ValueError(f"`horizon`={horizon_s!r} must be a positive duration or None.")
        if not slot_s > 0:
            raise ValueError(f"`slot`={slot_s!r} must be a positive duration.")
        self.forecast, self.horizon_s, self.slot_s = forecast, horizon_s, float(slot_s)

    def decide(
        self,
        series: TimeSeries,
        now: float,
        remaining_work_s: float,
        budget_left_s: float,
        deadline: float | None = None,
        holds_from: float = math.inf,
    ) -> tuple[Decision, np.ndarray, np.ndarray]:
        """The decision at ``now`` (series seconds), with the slot starts and forecast it used.
        ``holds_from``: the series time from which the signal holds its last value (a series read past its
        end). Slots from there on are that value, not a forecast: it is what the run will be charged there (a
        forecast of the held stretch reads the days before it, so a run waited for a clean guess and then ran
        at once when the end came); the slot straddling the end blends its forecast with that value by the
        share of it past the end. Once ``now`` is there the slot runs, reason ``"held"``: no slot ahead can
        be cleaner, and waiting would only spend the budget.

        Waiting happens only if ``now + slot + remaining_work <= deadline`` and ``slot <= budget_left``: a job
        that could still finish by the deadline when it starts running now can always still finish by it,
        whatever was waited before (running moves ``now`` and ``remaining_work`` by the same amount).
        A job that cannot finish by the deadline any more (``now + remaining_work > deadline``) runs, reason
        ``"deadline"``, whatever the signal.
        """
        slot = self.slot_s
        observed = series.value_at(now)
        end = now + max(remaining_work_s, 0.0) + max(budget_left_s, 0.0)
        if deadline is not None:
            end = min(end, deadline)
        slots = max(1, math.ceil((end - now) / slot - 1e-9))
        starts = now + slot * np.arange(slots)
        forecast = np.array(self.forecast.predict(series, now, starts, slot), dtype=np.float64)  # a copy
        # an oracle reads the series itself, which holds its last value past the end: its slot means are
        # already what the run is charged there, the straddling slot's included (blending it again counted
        # the held part twice)
        if math.isfinite(holds_from) and not getattr(self.forecast, "reads_future", False):
            held = series.value_at(holds_from)
            # a slot straddling the end is charged the held value for its share past the end
            past = np.clip((starts + slot - holds_from) / slot, 0.0, 1.0)
            forecast = np.where(
                starts >= holds_from, held, np.where(past > 0, forecast * (1 - past) + held * past, forecast)
            )
        # light mode passes no work once its light budget covers the rest of the run: no slot has to run
        work_slots = max(0, math.ceil(remaining_work_s / slot - 1e-9))
        if self.rule == "absolute":
            level = float(self.level)  # type: ignore[arg-type]
        elif self.rule == "percentile":
            ahead = slots if self.horizon_s is None else max(1, min(slots, math.ceil(self.horizon_s / slot)))
            level = float(np.percentile(forecast[:ahead], self.level))
        elif work_slots == 0:
            level = -math.inf  # every slot may be held
        else:
            level = float(np.partition(forecast, min(work_slots, slots) - 1)[min(work_slots, slots) - 1])
        # "at or below" the level: a forecast equal to it (up to rounding: a flat stretch's slot means differ
        # in the last digits) is clean
        clean = forecast[0] <= level + (1e-9 * abs(level) if math.isfinite(level) else 0.0)
        may_wait = now + slot + remaining_work_s <= end + 1e-6
        # the work left does not fit before the deadline: the window is shorter than the work, so the adaptive
        # level is its dirtiest slot and every slot would read "clean"; it runs because of the deadline
        late = deadline is not None and now + remaining_work_s > deadline + 1e-6
        if late:
            reason = "deadline"
        elif now >= holds_from:
            reason = "held"
        elif clean:
            reason = "clean"
        elif not may_wait:
            reason = (
                "deadline"
                if deadline is not None and deadline <= now + remaining_work_s + budget_left_s
                else "budget"
            )
        else:
            reason = "dirty"
        run = reason != "dirty"
        resume_at = None
        if not run:
            latest = end - remaining_work_s  # the last start that meets both bounds
            later = np.nonzero((forecast[1:] <= level) & (starts[1:] <= latest))[0]
            resume_at = float(starts[1 + later[0]]) if len(later) else float(max(now + slot, latest))
        decision = Decision(
            at=float(now),
            run=bool(run),
            reason=reason,
            signal=float(observed),
            forecast_now=float(forecast[0]),
            clean_below=level,
            wait_s=0.0 if run else slot,
            resume_at=resume_at,
            remaining_work_s=float(remaining_work_s),
            budget_left_s=float(budget_left_s),
        )
        return decision, starts, forecast


# ---------------------------------------------------------------------------- accounting
class ScheduleLedger:
    """What ran when (``run``, or held ``light``) and what waited, with energy, priced along the signal.

    Args:
        mean_signal: ``(t0, t1) -> mean signal`` over a wall-clock interval (a :class:`Rate`'s ``mean``).
        unit: the signal's unit, for reports (``"gCO2eq/kWh"``: savings are also given in kg).
    """

    def __init__(self, mean_signal: Callable[[float, float], float], unit: str = "gCO2eq/kWh") -> None:
        self.mean_signal, self.unit = mean_signal, unit
        self.segments: list[dict[str, Any]] = []  # the latest RECENT_RECORDS; older ones are folded
        self.folded = _no_folded_segments()

    def add(self, kind: str, start: float, end: float, kwh: float | None) -> None:
        """Record ``[start, end]`` of ``kind`` (``kwh``: its energy, ``None`` if unknown); merges with the last
        segment when it continues it."""
        if kind not in SEGMENT_KINDS:
            raise ValueError(f"`kind`={kind!r} is not one of {list(SEGMENT_KINDS)}.")
        if end <= start and not kwh:
            return
        last = self.segments[-1] if self.segments else None
        if last is not None and last["kind"] == kind and abs(last["end"] - start) < 1e-9:
            last["end"] = float(end)
            last["kwh"] = None if last["kwh"] is None or kwh is None else last["kwh"] + kwh
            return
        self.segments.append({"kind": kind, "start": float(start), "end": float(end), "kwh": kwh})
        if len(self.segments) > RECENT_RECORDS:  # a closed segment: its figures go into the folded totals
            self._fold(self.segments.pop(0))

    def _fold(self, segment: dict[str, Any]) -> None:
        folded, seconds = self.folded, segment["end"] - segment["start"]
        folded["count"] += 1
        folded["start"] = segment["start"] if folded["start"] is None else folded["start"]
        folded["seconds"][segment["kind"]] += seconds
        signal = self.mean_signal(segment["start"], segment["end"])
        if segment["kwh"] is None:
            folded["energy_known"] = False
        elif segment["kind"] == "wait":
            folded["wait_weighted_kwh"] += segment["kwh"] * signal
            folded["wait_kwh"] += segment["kwh"]
        else:
            folded["weighted_kwh"] += segment["kwh"] * signal
            folded["compute_kwh"] += segment["kwh"]
        if segment["kind"] != "wait":  # time stands in for energy: waiting weighs nothing
            folded["weighted_hours"] += seconds / 3600.0 * signal
            folded["compute_hours"] += seconds / 3600.0

    def seconds(self, *kinds: str) -> float:
        kept = sum(s["end"] - s["start"] for s in self.segments if s["kind"] in kinds)
        return float(kept + sum(self.folded["seconds"][kind] for kind in kinds))

    def summary(self, start: float | None = None) -> dict[str, Any]:
        """Energy, signal cost of the schedule as run, and of the counterfactual.

        The counterfactual spreads the compute segments' energy evenly over ``[start, start + compute
        seconds]``: the same energy on a schedule that ignores the signal, started at the same moment. Energy
        while waiting (a paused machine's idle draw) counts for the run (``signal_cost``, the saving) and not
        for the counterfactual; it is also given on its own (``wait_kwh``, ``wait_cost``, ``wait_kg``), and
        ``mean_signal_run`` is the compute segments' own mean (the whole cost over the compute energy could
        read above the signal's maximum). With no energy figures, time stands in for energy (constant power):
        the shares stay right, kg are ``None``.
        """
        folded = self.folded
        if not self.segments:
            return {"segments": 0}
        first = folded["start"] if folded["start"] is not None else self.segments[0]["start"]
        start = first if start is None else float(start)
        known = folded["energy_known"] and all(s["kwh"] is not None for s in self.segments)
        run_weighted = folded["weighted_kwh"] if known else folded["weighted_hours"]
        compute_weight = folded["compute_kwh"] if known else folded["compute_hours"]
        wait_weighted, wait_kwh = folded["wait_weighted_kwh"], folded["wait_kwh"]
        for segment in self.segments:
            signal = self.mean_signal(segment["start"], segment["end"])
            if segment["kind"] == "wait":  # without energy figures, waiting weighs nothing
                if known:
                    wait_weighted += segment["kwh"] * signal
                    wait_kwh += segment["kwh"]
                continue
            weight = segment["kwh"] if known else (segment["end"] - segment["start"]) / 3600.0
            run_weighted += weight * signal
            compute_weight += weight
        weighted = run_weighted + (wait_weighted if known else 0.0)
        compute_s = self.seconds(*COMPUTE_KINDS)
        counterfactual = compute_weight * self.mean_signal(start, start + compute_s)
        saving = counterfactual - weighted
        carbon = self.unit.startswith("gCO2")
        return {
            "segments": folded["count"] + len(self.segments),
            "energy_known": known,
            "energy_kwh": compute_weight if known else None,
            "compute_s": compute_s,
            "waited_s": self.seconds("wait"),
            "light_s": self.seconds("light"),
            "wait_kwh": wait_kwh if known else None,
            "wait_cost": wait_weighted if known else None,
            "wait_kg": wait_weighted / 1000.0 if known and carbon else None,
            "mean_signal_run": run_weighted / compute_weight if compute_weight else None,
            "mean_signal_counterfactual": counterfactual / compute_weight if compute_weight else None,
            "signal_cost": weighted if known else None,
            "counterfactual_cost": counterfactual if known else None,
            "saving": saving if known else None,
            "saving_kg": saving / 1000.0 if known and carbon else None,
            "saving_pct": 100.0 * saving / counterfactual if counterfactual else 0.0,
            "saving_per_kwh": saving / compute_weight if compute_weight else 0.0,
            "unit": self.unit,
        }

    def state_dict(self) -> dict[str, Any]:
        folded = {**self.folded, "seconds": dict(self.folded["seconds"])}
        return {"segments": [dict(s) for s in self.segments], "folded": folded}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.segments = [dict(s) for s in state.get("segments", [])]
        # older checkpoints kept every segment, or folded waits into `weighted_kwh` (no `wait_*` totals)
        folded = {**_no_folded_segments(), **(state.get("folded") or {})}
        self.folded = {**folded, "seconds": dict(folded["seconds"])}


def _no_folded_segments() -> dict[str, Any]:
    """The totals of the segments a :class:`ScheduleLedger` no longer keeps: none yet."""
    return {
        "count": 0,
        "start": None,
        "seconds": dict.fromkeys(SEGMENT_KINDS, 0.0),
        "energy_known": True,
        "weighted_kwh": 0.0,  # compute segments only
        "compute_kwh": 0.0,
        "wait_weighted_kwh": 0.0,  # a paused machine's idle draw
        "wait_kwh": 0.0,
        "weighted_hours": 0.0,
        "compute_hours": 0.0,
    }


# ---------------------------------------------------------------------------- simulation
def simulate_job(
    policy: GreenWindowPolicy,
    series: TimeSeries,
    start: float,
    work_s: float,
    budget_s: float,
    deadline: float | None = None,
    power_kw: float = 1.0,
    clock: SimulatedClock | None = None,
) -> dict[str, Any]:
    """Run a job of ``work_s`` compute seconds through ``policy`` from ``start``, slot by slot, on a
    :class:`SimulatedClock` (the signal's own time axis); a paused job draws nothing. Past ``series``' end
    its last value holds (a wrapping series has none), as GreenWindow reads it: those slots are that value,
    not a forecast.

    Returns:
        the ledger's :meth:`~ScheduleLedger.summary` plus ``finished_at``, ``decisions`` (count), ``waits``.
    """
    clock = clock or SimulatedClock(start)
    ledger = ScheduleLedger(series.mean)
    remaining, budget, decisions, waits = float(work_s), float(budget_s), 0, 0
    while remaining > 1e-9:
        now = clock.time()
        decision, _, _ = policy.decide(series, now, remaining, budget, deadline, series.end)
        decisions += 1
        if decision.run:
            seconds = min(policy.slot_s, remaining)
            clock.advance(seconds)
            ledger.add("run", now, now + seconds, power_kw * seconds / 3600.0)
            remaining -= seconds
        else:
            clock.sleep(decision.wait_s)
            ledger.add("wait", now, now + decision.wait_s, 0.0)
            budget -= decision.wait_s
            waits += 1
    return {**ledger.summary(start), "finished_at": clock.time(), "decisions": decisions, "waits": waits}


# ---------------------------------------------------------------------------- the plot
SEGMENT_COLOURS = {"run": "#d62728", "light": "#1f77b4", "wait": "#7f7f7f"}


def write_schedule_plot(
    path: str | Path,
    signal: tuple[Sequence[float], Sequence[float]],
    forecast: tuple[Sequence[float], Sequence[float]] | None,
    segments: Sequence[dict[str, Any]],
    decisions: Sequence[dict[str, Any]],
    unit: str = "gCO2eq/kWh",
) -> Path | None:
    """The signal, the first decision's forecast, the level each decision compared against, and the
    bursts, light phases and waits as bands, on one time axis (hours since the first segment). ``None``
    without matplotlib (an optional extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        from matplotlib.figure import Figure
    except ImportError:
        return None
    from lightning_pulse.energy.report import write_atomic

    origin = segments[0]["start"] if segments else (signal[0][0] if len(signal[0]) else 0.0)
    figure = Figure(figsize=(11, 4.0), constrained_layout=True)
    axes = figure.subplots()
    seen: set[str] = set()
    for segment in segments:
        kind = segment["kind"]
        axes.axvspan(
            (segment["start"] - origin) / 3600,
            (segment["end"] - origin) / 3600,
            color=SEGMENT_COLOURS.get(kind, "#cccccc"),
            alpha=0.15,
            linewidth=0,
            label=None if kind in seen else kind,
        )
        seen.add(kind)
    times, values = np.asarray(signal[0], dtype=float), np.asarray(signal[1], dtype=float)
    axes.step((times - origin) / 3600, values, where="post", color="black", linewidth=1.0, label="signal")
    if forecast is not None and len(forecast[0]):
        f_times = np.asarray(forecast[0], dtype=float)
        axes.step(
            (f_times - origin) / 3600,
            forecast[1],
            where="post",
            color="#ff7f0e",
            linestyle="--",
            linewidth=1.0,
            label="forecast (first decision)",
        )
    levels = [d for d in decisions if math.isfinite(d["clean_below"])]  # -inf: every slot held
    if levels:
        at = [(d["wall"] - origin) / 3600 for d in levels]
        axes.scatter(at, [d["clean_below"] for d in levels], s=6, color="#2ca02c", label="clean below")
    axes.set_xlabel(f"hours since {format_utc(origin)} UTC")
    axes.set_ylabel(unit)
    axes.set_title(
        "GreenWindow: signal, forecast and schedule (bands: run red, held light blue, wait grey)", fontsize=9
    )
    axes.legend(loc="upper right", fontsize=7)
    return write_atomic(path, lambda tmp: figure.savefig(tmp, format="png", dpi=110))


# ---------------------------------------------------------------------------- arguments
DURATION_FORMS = {  # what each duration field accepts besides a string with a unit of time
    "max_delay": ", or a share >= 0 of the expected compute time (a number: 1.0 = 100%)",
    "options.slot": ", or a number of seconds > 0",
    "expected_duration": ", a number of seconds > 0, or None",
    "options.signal_timeout": ", a number of seconds > 0, or None (the callable is then called on the "
    "training thread, with no bound)",
}


def seconds_of(value: Any, field: str) -> float | None:
    """Seconds from a duration string with a unit of time ("90s", "15min", "12h") or a number of seconds;
    ``None`` stays ``None``. Steps and epochs are refused: GreenWindow's durations are on its clock.

    Raises:
        ValueError: naming ``field``, the value and only the forms the field accepts.
    """
    if value is None:
        return None
    try:
        duration = parse_duration(value if isinstance(value, str) else f"{value}s", field)
    except ValueError:
        duration = None
    if duration is None or duration.kind != "seconds":
        forms = DURATION_FORMS.get(field, ", a number of seconds >= 0, or None")
        raise ValueError(
            f"`{field}`={value!r} must be a duration such as '90s', '15min' or '12h'{forms}; steps and epochs "
            "are not accepted."
        )
    return duration.amount


@dataclass
class GreenWindowOptions:
    """Rarely turned knobs of :class:`GreenWindow`.

    Args:
        slot: the decision slot ("1h"): the policy decides one slot at a time, and a pause lasts one slot.
        watts: power assumed for the accounting when no EnergyLogger is attached (then kg are estimates);
            ``None``: savings in % and per kWh only.
        signal_start: read a series signal from this moment (UTC) as if the run started then, as
            EnergyLogger's ``carbon_intensity_start`` (ISO 8601 text, Unix seconds, or a ``datetime``, pandas
            ``Timestamp`` or numpy ``datetime64``, read as it reads them); refused next to no ``signal`` (the
            EnergyLogger's series is read from its own start) and a callable (its readings carry their own
            times).
        unit: the signal's unit; ``gCO2eq/kWh`` gives savings in kg too, a price per energy (``EUR/MWh``) in
            money.
        report_dir: where the report goes; default the run's folder of the first logger (see the docs).
        signal_timeout: how long a live ``signal``'s reading is waited for ("10s", or seconds > 0, of real
            time); the callable runs on a thread of its own, and one that has not returned by then is a failed
            reading. ``None``: it is called on the training thread, with no bound, as for a callable that
            needs the main thread (a ``signal.alarm`` timeout, an asyncio event loop). Read by a callable
            ``signal`` only.
    """

    slot: str | float = "1h"
    watts: float | None = None
    signal_start: str | None = None
    unit: str = "gCO2eq/kWh"
    report_dir: str | None = None
    signal_timeout: str | float | None = LIVE_READ_TIMEOUT_S

    def __post_init__(self) -> None:
        plain_fields(self)  # np.float32(0.5) as 0.5, as the callbacks' own arguments
        self.slot_s = seconds_of(self.slot, "options.slot")
        if not self.slot_s:
            raise ValueError(f"`options.slot`={self.slot!r} must be a positive duration such as '1h'.")
        self.signal_timeout_s = seconds_of(self.signal_timeout, "options.signal_timeout")
        if self.signal_timeout_s == 0:  # never waited for: every reading would fail
            raise ValueError(
                f"`options.signal_timeout`={self.signal_timeout!r} must be a positive duration such as '10s'"
                f"{DURATION_FORMS['options.signal_timeout']}."
            )
        watts = self.watts
        if watts is not None and (
            isinstance(watts, bool) or not isinstance(watts, (int, float)) or not 0 <= watts < math.inf
        ):
            raise ValueError(f"`options.watts`={watts!r} must be a finite number of watts >= 0, or None.")
        if not isinstance(self.unit, str) or not self.unit.strip():
            raise ValueError(f"`options.unit`={self.unit!r} must be a non-empty string such as 'gCO2eq/kWh'.")
        if self.report_dir is not None and (
            not isinstance(self.report_dir, (str, os.PathLike)) or not str(self.report_dir).strip()
        ):
            raise ValueError(
                f"`options.report_dir`={self.report_dir!r} must be a directory path, or None for the run's "
                "own folder."
            )
        if self.signal_start is not None:
            try:
                parse_timestamp(str(self.signal_start))
            except ValueError:
                raise ValueError(
                    f"`options.signal_start`={self.signal_start!r} must be an ISO 8601 time such as "
                    "'2020-06-15 00:00:00' (UTC unless it says otherwise), Unix seconds, a datetime, or None."
                ) from None


def options_from(options: Mapping[str, Any] | None) -> GreenWindowOptions:
    """:class:`GreenWindowOptions` from a mapping (``None``: the defaults).

    Raises:
        ValueError: naming an unknown field and the known ones, or a field's bad value.
    """
    known = [field.name for field in fields(GreenWindowOptions)]
    unknown = sorted(set(options or {}) - set(known))
    if unknown:
        raise ValueError(
            f"`options`={dict(options or {})!r} has no field {unknown[0]!r}; its fields are {known}."
        )
    return GreenWindowOptions(**(options or {}))


MODES = ("light", "pause", "suspend")


def checked_arguments(
    when_dirty: str,
    forecast: Any,
    threshold: float | str | None,
    horizon: Any,
    max_delay: float | str | None,
    deadline: str | None,
    expected_duration: Any,
) -> tuple[str, Forecast, float, bool, float | AfterStart | None, float | None]:
    """GreenWindow's arguments, checked: ``(mode, forecast, delay, delay_is_share, deadline,
    expected_work_s)`` (``deadline``: see :func:`parse_deadline`).

    Raises:
        ValueError: naming the field, the value and what is allowed.
    """
    from lightning_pulse.energy.forecast import forecast_from

    if when_dirty not in MODES:
        raise ValueError(f"`when_dirty`={when_dirty!r} is not one of {list(MODES)}.")
    checked = forecast_from(forecast)
    if checked.reads_future:
        raise ValueError(f"`forecast`={checked!r} reads the future; it is for benchmarks only.")
    rule, _ = parse_threshold(threshold)
    if seconds_of(horizon, "horizon") is not None and rule != "percentile":
        raise ValueError(
            f"`horizon`={horizon!r} is read by a percentile `threshold` only (such as '30%'), and `threshold`="
            f"{threshold!r} is {rule}; drop `horizon`, or give a percentile threshold."
        )
    if max_delay is None:
        max_delay = 0.5 if when_dirty == "light" else 1.0
    share = isinstance(max_delay, (int, float)) and not isinstance(max_delay, bool)
    delay = float(max_delay) if share else seconds_of(max_delay, "max_delay")
    if delay is None or not math.isfinite(delay) or delay < 0:
        raise ValueError(f"`max_delay`={max_delay!r} must be a share >= 0 (1.0 = 100%) or a duration.")
    deadline_s = parse_deadline(deadline)
    expected = seconds_of(expected_duration, "expected_duration")
    if expected is not None and not expected > 0:  # no work to plan: every decision would be wrong
        raise ValueError(
            f"`expected_duration`={expected_duration!r} must be a positive duration such as '20h' (or "
            "seconds > 0), or None to measure it from the run's first steps."
        )
    return when_dirty, checked, delay, share, deadline_s, expected


@dataclass(frozen=True)
class AfterStart:
    """A deadline given as a duration (``"+36h"``): that long after the run's start, which a resumed run
    keeps, so it does not go stale in a config file the way a date does."""

    seconds: float


_NUMBER = re.compile(r"(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")


def parse_deadline(deadline: Any) -> float | AfterStart | None:
    """``None``; a UTC time (``"2026-03-01 08:00:00"``, Unix seconds) -> Unix seconds; ``"+36h"`` or
    ``"+3600"`` (a duration after a ``+``, as GreenWindow's other durations: a unit of time or seconds) ->
    :class:`AfterStart`.

    Raises:
        ValueError: naming ``deadline``, its value and both forms.
    """
    if deadline is None:
        return None
    text = str(deadline).strip()
    try:
        if text.startswith("+"):
            # as GreenWindow's other durations: a number of seconds, or a number with a unit of time
            after = text[1:].strip()
            seconds = seconds_of(float(after) if _NUMBER.fullmatch(after) else after, "deadline")
            if seconds is not None and 0 < seconds < math.inf:
                return AfterStart(seconds)
            raise ValueError
        return parse_timestamp(text)
    except ValueError:
        raise ValueError(
            f"`deadline`={deadline!r} is not a UTC time such as '2026-03-01 08:00:00', nor a positive "
            "duration after the run's start such as '+36h' or '+3600': seconds, or a number with a unit "
            f"({', '.join(SECONDS_UNIT_NAMES)})."
        ) from None


def passed_deadline(deadline: float | None, now: float, resumed: bool, light: bool = False) -> str | None:
    """The deadline is past at fit start (``now`` on the run's clock): a fresh run refuses (a typo'd date,
    or a clock that does not read what the deadline assumes); a resumed one, whose deadline passed while it
    was down, runs the rest without waiting (``light``: holds light as before, the deadline has no say), and
    is told so (the returned line). ``None`` when it is not past.

    Raises:
        ValueError: for a fresh run, naming ``deadline``, its value and the clock's time.
    """
    if deadline is None or now <= deadline:
        return None
    if not resumed:
        raise ValueError(
            f"`deadline`={format_utc(deadline)!r} (UTC) is already past: the clock reads {format_utc(now)} "
            "at fit start; give a later UTC time or None (on a SimulatedClock, start the clock before the "
            "deadline)."
        )
    return (
        f"GreenWindow: `deadline`={format_utc(deadline)!r} (UTC) passed while the run was down (the clock "
        f"reads {format_utc(now)}); it "
        f"{'holds light as before' if light else 'runs the rest without waiting'}."
    )


def run_status(
    suspended: bool,
    timers_left_s: list[float | None],
    steps_left: Callable[[], float],
    smoke_test: bool = False,
) -> str:
    """How a fit's training ended: ``"smoke_test"`` (a ``fast_dev_run``: a few batches that check the code,
    not a run; its report stays in ``.report``), ``"suspended"`` (it waits to resume), ``"stopped"``
    (Lightning's Timer, ``max_time``, ended it with steps left: ``timers_left_s`` are the Timers'
    ``time_remaining()``, ``steps_left`` the steps the run has left, read only then), else ``"complete"``:
    the run reached its planned length, or a callback ended it for good (EarlyStopping). Only a complete run
    settles its deadline record (:meth:`GreenSchedule.finish`): a run max_time stops is usually requeued,
    and its work left still decides whether it meets the deadline."""
    if smoke_test:  # a sweep: a 1-batch fast_dev_run's `.report` said "complete"
        return SMOKE_TEST
    if suspended:
        return "suspended"
    if any(left is not None and left <= 0 for left in timers_left_s) and steps_left() > 0:
        return "stopped"
    return "complete"


def fit_start_refusal(
    when_dirty: str,
    light_phases: bool | None,
    steps_replay: bool,
    checkpointing: bool,
    signal: bool,
    barebones: bool = False,
) -> str | None:
    """Why GreenWindow cannot run in this Trainer (``None``: it can). ``light_phases``: the attached
    PulseCycle has a light phase (``None``: no PulseCycle is attached); ``steps_replay``: a
    ``HardSampleReplay(mode="steps")`` is attached; ``checkpointing``: the Trainer has a ModelCheckpoint;
    ``signal``: a signal was given, or an attached EnergyLogger has a carbon-intensity series;
    ``barebones``: ``Trainer(barebones=True)``, which cannot have checkpointing."""
    if when_dirty == "light" and not light_phases:
        pulse_cycle = light_phases is not None
        return (
            "GreenWindow: when_dirty='light' keeps the run in PulseCycle's light phases (replay, maintain), "
            f"but {'the PulseCycle has no light phase' if pulse_cycle else 'no PulseCycle is attached'}; "
            "add PulseCycle(...) with a replay or maintain phase, or use when_dirty='pause' or 'suspend'."
        )
    if when_dirty == "light" and steps_replay:
        return (
            "GreenWindow: when_dirty='light' changes the phase sequence, and HardSampleReplay(mode='steps') "
            "plans its batches on that sequence at fit start; use HardSampleReplay(mode='batch'), or "
            "when_dirty='pause' or 'suspend'."
        )
    if when_dirty == "suspend" and not checkpointing:
        # barebones=True refuses enable_checkpointing=True (Lightning's ValueError): no way out there
        way_out = (
            "Trainer(barebones=True) turns checkpointing off (and refuses enable_checkpointing=True); use "
            "'pause'/'light', or drop barebones=True"
            if barebones
            else "enable checkpointing or use 'pause'/'light'"
        )
        return (
            "GreenWindow: when_dirty='suspend' saves the checkpoint the run resumes from in the "
            f"ModelCheckpoint's folder, and the Trainer has none; {way_out}."
        )
    if not signal:
        return (
            "GreenWindow: no `signal` was given and no EnergyLogger with a carbon_intensity series is "
            "attached; pass GreenWindow(signal='grid.csv') or EnergyLogger(carbon_intensity='grid.csv')."
        )
    return None


def clocks_apart(now: float, energy_now: float | None, slot_s: float) -> str | None:
    """The warning when GreenWindow's clock (``now``) and the EnergyLogger's wall clock (``energy_now``, read
    at the same moment) are more than a slot apart, as when only GreenWindow has a SimulatedClock; ``None``
    when they agree, or without an EnergyLogger's clock (``energy_now`` ``None``)."""
    if energy_now is None or abs(now - energy_now) <= slot_s:
        return None
    return (
        f"GreenWindow: its clock reads {format_utc(now)} and the EnergyLogger's {format_utc(energy_now)}; each "
        "reads the carbon-intensity series at its own clock's time, so their CO2 figures differ, and the energy "
        "of each slot is what the meters counted on the EnergyLogger's clock; to replay a run on a "
        "SimulatedClock, give both the same clock (energy.account.clock = energy.account.wall_clock = clock)."
    )


def unknown_length_refusal(
    total_steps: float, expected_work_s: float | None, manual_optimizers: int = 0
) -> str | None:
    """Why GreenWindow cannot decide in a run of unknown length (``total_steps`` infinite) without an
    ``expected_duration``: the work left, which every decision weighs against the cleaner hours ahead, is never
    known, so it would make no decision and report no saving. ``None`` when it can. ``manual_optimizers``: the
    count of optimizers a module under manual optimization steps itself, when more than one (the length in
    steps is then unknown whatever the epochs, see :data:`~lightning_pulse.phase.UNKNOWN_STEPS_PER_BATCH`)."""
    if math.isfinite(total_steps) or expected_work_s is not None:
        return None
    if manual_optimizers > 1:
        why, bound = UNKNOWN_STEPS_PER_BATCH.format(count=manual_optimizers), STEPS_BOUND_ONLY
    else:
        why, bound = "this run has no known length", KNOWN_LENGTH
    return (
        f"GreenWindow: every decision weighs the work left against the cleaner hours ahead, and {why}: it "
        f"would never decide. Give `expected_duration` (the run's compute time, e.g. '20h'), or {bound}."
    )


# ---------------------------------------------------------------------------- one run's bookkeeping
def duration_text(seconds: float) -> str:
    """``seconds`` as a person reads it: hours to a tenth, minutes under an hour, seconds under a minute."""
    if round(seconds / 60) >= 60:  # 3599 s reads "1.0 h", not "60 min"
        return f"{seconds / 3600:.1f} h"
    if round(seconds) >= 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds:.0f} s" if seconds >= 0.5 else "under a second"


def span_text(seconds: float) -> str:
    """:func:`duration_text`, with ``0 s`` for none (a budget of ``max_delay=0``)."""
    return "0 s" if seconds < 0.5 else duration_text(seconds)


def duration_arg(seconds: float) -> str:
    """``seconds`` as a duration argument (``'4h'``, ``'30min'``, ``'90s'``), to give back as it is (to the
    microsecond: ``"1.1h"`` parses to 3960.0000000000005 s, given back as ``'66min'``)."""
    seconds = round(seconds, 6)
    if seconds >= 3600 and seconds % 3600 == 0:
        return f"'{seconds / 3600:g}h'"
    return f"'{seconds / 60:g}min'" if seconds >= 60 and seconds % 60 == 0 else f"'{seconds:g}s'"


def changed_inputs(saved: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    """The arguments, of the budget's :attr:`GreenSchedule.inputs`, by which ``now`` builds another budget
    than ``saved`` did: ``max_delay`` (its value or kind), and ``expected_duration`` where both are shares (a
    duration budget is built from no ``expected_duration``). Values are compared to 1e-9 of their size: one
    duration written two ways (``"1.1h"``, ``"66min"``) is the same."""
    changed = (
        []
        if saved["share"] == now["share"] and _same(saved["max_delay"], now["max_delay"])
        else ["max_delay"]
    )
    if now["share"] and saved["share"] and not _same(saved["expected_work_s"], now["expected_work_s"]):
        changed.append("expected_duration")
    return changed


def _same(a: float | None, b: float | None) -> bool:
    return a == b if a is None or b is None else math.isclose(a, b, rel_tol=1e-9)


def input_text(field: str, inputs: Mapping[str, Any]) -> str:
    """``field`` of the budget's inputs as an argument: `max_delay`=0.5, `max_delay`='30min'."""
    if field == "max_delay":
        value = inputs["max_delay"]
        return f"`max_delay`={float(value)!r}" if inputs["share"] else f"`max_delay`={duration_arg(value)}"
    expected = inputs["expected_work_s"]
    return f"`expected_duration`={'None' if expected is None else duration_arg(expected)}"


DEADLINE_MARGIN = 0.1  # share of the remaining-work estimate kept in reserve before a deadline


class GreenSchedule:
    """The bookkeeping of one run under a :class:`GreenWindowPolicy`: the delay budget, what was waited or
    held light, how fast the run computes, every decision, and the :class:`ScheduleLedger`.

    Times are wall-clock seconds of the run's clock; ``to_series`` maps them onto the signal's time axis.

    Args:
        policy: the rule and forecast.
        max_delay: the delay budget: a share of the run's expected compute time (``1.0`` = as long again)
            when ``share`` is true, else seconds.
        share: how to read ``max_delay``.
        expected_work_s: the run's compute time if known in advance; else measured from its steps.
        deadline: wall-clock seconds by which the run must end, an :class:`AfterStart` (that long after the
            run's start), or ``None``.
        ledger: where segments go.
        light: the run is held in light phases instead of waiting. It then takes as long either way, so
            the window is the rest of the run: the slots that may be held (at most the budget left) are its
            dirtiest, and the rule picks the ``remaining - budget_left`` cleanest for bursts. The deadline
            has no say in that (holding light cannot move the end); one out of reach is still warned and
            recorded.
    """

    def __init__(
        self,
        policy: GreenWindowPolicy,
        max_delay: float,
        share: bool,
        expected_work_s: float | None,
        deadline: float | AfterStart | None,
        ledger: ScheduleLedger,
        light: bool = False,
    ) -> None:
        self.policy, self.max_delay, self.share, self.light = policy, float(max_delay), share, light
        self.expected_work_s, self.given_deadline, self.ledger = expected_work_s, deadline, ledger
        self.run_start: float | None = None
        self.planned_work_s: float | None = None
        self.budget_s: float | None = None
        self.from_step = 0  # the run's step its figures count from: > 0 for a GreenWindow added on a resume
        self.work_share = 1.0  # the share of the run's steps it plans (`expected_work_s` is the whole run's)
        self.saved_inputs: dict[str, Any] | None = None  # what a restored budget was built from (`inputs`)
        self.delayed_s = 0.0  # waited, plus held light: what the budget pays for
        self.compute_s = 0.0
        self.compute_steps = 0
        self.clock_away_s = 0.0  # of delayed_s: spans a forward step of the clock jumped over (RunClock)
        self.decisions: list[dict[str, Any]] = []  # the latest RECENT_RECORDS
        self.decision_count = 0
        self.first_forecast: tuple[list[float], list[float]] | None = None
        # while the latest estimate of the work left does not fit before the deadline: when it was found so;
        # at the end of a complete run, whether the run ended past it (:meth:`finish`)
        self.deadline_unmet: dict[str, Any] | None = None
        self.deadline_cleared: dict[str, Any] | None = None  # the latest such finding that did not hold
        self.told_passed = False  # this fit was told at its start that its deadline had passed
        self.news: list[str] = []  # warnings for the caller to give, once each
        self.told_max_time = False  # this fit was told that max_time shortens (or skips) its pauses

    @property
    def deadline(self) -> float | None:
        """The deadline in the run's seconds; one given after the start (:class:`AfterStart`) is ``None``
        until the run starts (:meth:`begin`, or a resumed run's start)."""
        if not isinstance(self.given_deadline, AfterStart):
            return self.given_deadline
        return None if self.run_start is None else self.run_start + self.given_deadline.seconds

    @property
    def shares(self) -> dict[str, float]:
        """``max_delay`` where it is a share placed on the run's length (Lightning's estimate when the budget
        is fixed, at the first decision); none given as a duration, or as a share of ``expected_duration``."""
        return {"max_delay": self.max_delay} if self.share and self.expected_work_s is None else {}

    @property
    def inputs(self) -> dict[str, Any]:
        """What the delay budget is built from: ``max_delay``, whether it is a share, and the expected compute
        time (for a share, what it is placed on; ``None``: the run's length as measured)."""
        return {"max_delay": self.max_delay, "share": self.share, "expected_work_s": self.expected_work_s}

    def remaining_work_s(self, steps_left: float) -> float | None:
        """Compute still to do: measured seconds per step times the steps left, else the expected time (of
        the part of the run it plans) minus what ran; ``None`` while neither is known."""
        if self.compute_steps > 0 and math.isfinite(steps_left):
            return max(steps_left, 0.0) * self.compute_s / self.compute_steps
        if self.expected_work_s is not None:
            return max(self.expected_work_s * self.work_share - self.compute_s, 0.0)
        return None

    def start_fit(self, step: int, steps_left: float) -> str | None:
        """This fit trains from the run's optimizer ``step``, with ``steps_left`` (at the run's pace) to go;
        before :meth:`begin`. With no state of its own at a step > 0 (added on a resume), it plans the rest of
        the run: returns :meth:`join`'s line, else ``None``."""
        return self.join(step, steps_left) if self.run_start is None and step > 0 else None

    def restarted(self, step: int, steps_left: float, held_open_s: float = 0.0) -> str | None:
        """Once the restart has counted the time away as waited (:func:`restart_run`): a restored budget built
        from another ``max_delay`` or ``expected_duration`` is built again from these (:meth:`rebuild_budget`;
        ``held_open_s``: light held in the segment still open); returns its warning, else ``None``. It used to
        keep the checkpoint's, and a resume with ``max_delay=0`` still waited 3 h."""
        saved, self.saved_inputs = self.saved_inputs, None
        if saved is None or self.budget_s is None or not (changed := changed_inputs(saved, self.inputs)):
            return None
        return self.rebuild_budget(saved, changed, step, steps_left, held_open_s)

    def join(self, step: int, steps_left: float) -> str:
        """Added on a resume at the run's ``step``: it plans the work left, the share ``steps_left`` of the
        run's steps (of ``expected_work_s``, the whole run's; taken whole where the run's length is unknown),
        and its figures count from ``step`` (the report's ``from_step``). It used to plan the whole run's
        ``expected_duration`` for the half left, and waited 6 h on a budget of 8 h for 4 h of work. The line
        gives the share of the run's batches: under a GradientAccumulationScheduler ``steps_left`` is in
        steps of the run's average size so far, not in its optimizer steps."""
        self.from_step = int(step)
        if math.isfinite(steps_left):
            self.work_share = max(steps_left, 0.0) / (step + max(steps_left, 0.0))
        expected = self.expected_work_s
        rest = f"{self.work_share:.0%} of the run's training batches"
        if expected is None:
            plan = f"it plans the work left, {rest}, at the pace it measures"
        elif math.isfinite(steps_left):
            plan = (
                f"it plans the work left, {rest}: {duration_text(expected * self.work_share)} of "
                f"`expected_duration` ({duration_text(expected)}, the whole run's)"
            )
        else:
            whole = duration_text(expected)
            plan = f"the run's length in steps is unknown: it plans `expected_duration` ({whole}) as the rest"
        return (
            f"GreenWindow: added on a resume at step {step}, with no state of its own in the checkpoint: "
            f"{plan}; its report (compute, waits, saving) counts from step {step} on."
        )

    def rebuild_budget(
        self,
        saved: dict[str, Any],
        changed: list[str],
        step: int,
        steps_left: float,
        held_open_s: float = 0.0,
    ) -> str:
        """Build the restored budget again from :attr:`inputs` where the checkpoint's was built from ``saved``
        ones that differ in the ``changed`` arguments (:func:`changed_inputs`), as a fresh run builds it: a
        duration, or the share of the planned work (``expected_duration``'s part that this schedule plans,
        else the run's length at its measured pace, else the planned work the checkpoint holds). What was waited or held light (``held_open_s`` of it still in the open segment)
        counts against it. Returns the warning."""
        budget_was = float(self.budget_s)  # type: ignore[arg-type]
        if self.share and self.expected_work_s is not None:
            self.planned_work_s = self.expected_work_s * self.work_share
        elif self.share and saved["expected_work_s"] is not None and self.compute_steps > 0:
            # placed on the run's length as measured (the steps since it joined, and those left)
            self.planned_work_s = (step - self.from_step + steps_left) * self.compute_s / self.compute_steps
        planned = float(self.planned_work_s)  # type: ignore[arg-type]
        self.budget_s = self.max_delay * planned if self.share else self.max_delay
        built = (
            f"{round(self.max_delay, 4)!r} x {duration_text(planned)} of planned work, " if self.share else ""
        )
        was = " and ".join(input_text(field, saved) for field in changed)
        delayed = self.delayed_s + held_open_s
        left = max(self.budget_s - delayed, 0.0)
        return (
            f"GreenWindow: resumed with {' and '.join(input_text(field, self.inputs) for field in changed)}, "
            f"where the checkpoint's delay budget was built from {was}: the budget is now "
            f"{span_text(self.budget_s)} ({built}was {span_text(budget_was)}), and the {span_text(delayed)} "
            f"already waited or held light counts against it, leaving {span_text(left)}. To keep the "
            f"checkpoint's budget, resume with {was}."
        )

    def budget_left_s(self) -> float:
        return max((self.budget_s or 0.0) - self.delayed_s, 0.0)

    def deadline_at_start(self, now: float) -> str | None:
        """:func:`passed_deadline` at this fit's start (``now``, before :meth:`begin`): a fresh run whose
        deadline is past is refused; a resumed one is told, and not told again when a decision finds it so."""
        line = passed_deadline(self.deadline, now, resumed=self.run_start is not None, light=self.light)
        self.told_passed = line is not None
        return line

    def begin(self, now: float) -> None:
        """Training starts at ``now``: the run's start, unless a resumed run has one already."""
        if self.run_start is None:
            self.run_start = now

    def ran(self, kind: str, start: float, end: float, steps: int, kwh: float | None) -> None:
        """``steps`` optimizer steps ran in ``[start, end]``, as ``kind`` (``"run"`` or ``"light"``)."""
        self.compute_s += max(end - start, 0.0)
        self.compute_steps += steps
        if kind == "light":
            self.delayed_s += max(end - start, 0.0)
        self.ledger.add(kind, start, end, kwh)

    def waited(self, start: float, end: float, kwh: float | None, away: bool = False) -> None:
        """``[start, end]`` was waited; ``away``: a clock step jumped over it (:attr:`clock_away_s`)."""
        self.delayed_s += max(end - start, 0.0)
        self.clock_away_s += max(end - start, 0.0) if away else 0.0
        self.ledger.add("wait", start, end, kwh)

    def decide(
        self,
        series: TimeSeries,
        to_series: Callable[[float], float],
        now: float,
        steps_left: float,
        holds_from: float = math.inf,
        time_left_s: float | None = None,
    ) -> Decision | None:
        """The decision at wall time ``now``, or ``None`` while the remaining work is unknown; ``holds_from``:
        the series time from which the signal holds its last value (:meth:`GreenWindowPolicy.decide`);
        ``time_left_s``: what Lightning's Timer (``max_time``) leaves of a pausing run
        (:meth:`within_max_time`)."""
        remaining = self.remaining_work_s(steps_left)
        if remaining is None:
            return None
        if self.budget_s is None:  # fixed once, from the first estimate of the whole run
            self.planned_work_s = remaining + self.compute_s
            self.budget_s = self.max_delay * self.planned_work_s if self.share else self.max_delay
        offset = to_series(now) - now
        deadline = None
        if self.deadline is not None:
            deadline = self.deadline + offset - DEADLINE_MARGIN * remaining
        if self.deadline is not None:
            self.follow_deadline(now, remaining)
        work, budget = remaining, self.budget_left_s()
        if self.light:
            # holding light cannot move the run's end, so the deadline has no say in what is held: out of
            # reach, bursting every slot would only throw the saving away
            deadline = None
            # the run takes as long either way: of the rest, `work` must burst and the rest may be held light
            work = max(remaining - budget, 0.0)
            budget = remaining - work
            if work == 0.0:  # the budget covers the rest of the run: a last partial slot may be held too
                budget = max(budget, self.policy.slot_s)
        decision, starts, forecast = self.policy.decide(
            series, now + offset, work, budget, deadline, holds_from
        )
        if time_left_s is not None and not decision.run:
            decision = self.within_max_time(decision, now, time_left_s)
        record = {**decision.to_dict(), "wall": now}
        if self.light:  # what is left of the run and of its light budget, not the policy's split of them
            record.update(remaining_work_s=float(remaining), budget_left_s=float(self.budget_left_s()))
        if decision.resume_at is not None:
            record["resume_at_wall"] = decision.resume_at - offset
        self.decision_count += 1
        append_recent(self.decisions, record)  # the latest RECENT_RECORDS, for the report
        if self.first_forecast is None:
            self.first_forecast = ((starts - offset).tolist(), forecast.tolist())
        return decision

    def withdraw(self, record: dict[str, Any] | None) -> None:
        """Take back the decision whose report record is ``record`` (the latest of :attr:`decisions`), where
        it was never acted on: a suspend at a step where the fit ends anyway (``SuspendSave``), or one the fit
        raised before. ``None`` (a rank that took no decision) changes nothing."""
        if record is not None and self.decisions and self.decisions[-1] is record:
            self.decisions.pop()
            self.decision_count -= 1

    def within_max_time(self, decision: Decision, now: float, time_left_s: float) -> Decision:
        """A pause that keeps less than one slot of ``max_time`` (``time_left_s`` at wall time ``now``) to
        train in after it: Lightning's Timer counts a pause as run time, and stopped the run at the pause's
        end, without a step in the slot it waited for (a 5 h run paused 7 h from its second hour). Such a
        pause is shortened to leave one slot, or not taken (the slot runs, reason ``"max_time"``) when one
        slot or less is left; the first time in a fit is told (:attr:`news`)."""
        slot, room = self.policy.slot_s, time_left_s - self.policy.slot_s
        if room >= decision.wait_s - 1e-6:
            return decision
        if room > 1e-6:
            capped, choice = replace(decision, wait_s=room), f"shortened to {duration_text(room)}"
        else:
            capped = replace(decision, run=True, reason="max_time", wait_s=0.0, resume_at=None)
            choice = "not taken: the run trains"
        if not self.told_max_time:
            self.told_max_time = True
            self.news.append(
                f"GreenWindow: Trainer(max_time) leaves {duration_text(max(time_left_s, 0.0))} at "
                f"{format_utc(now)} and its Timer counts a pause as run time: the pause of "
                f"{duration_text(decision.wait_s)} is {choice}, so that the run trains its last "
                f"{duration_text(slot)} before max_time stops it. Pauses stay within max_time from now on; "
                "for longer waits, give a larger max_time or use when_dirty='suspend'."
            )
        return capped

    def follow_deadline(self, now: float, remaining: float) -> None:
        """Keep :attr:`deadline_unmet` on the latest estimate of the work left (``remaining`` at ``now``).
        Out of reach, it is recorded and warned (:meth:`missed_deadline`). A record a later estimate overturns
        (the steps got faster, the run's length shrank) is cleared once the work fits with the reserve the
        decisions keep (so the run may wait again), and kept as :attr:`deadline_cleared`: a report must not
        say "unmet" of a run that then ended in time. Clearing only with the reserve keeps an estimate that
        hovers at the deadline from warning every slot; the end of the run settles the rest (:meth:`finish`).
        """
        deadline = float(self.deadline)  # type: ignore[arg-type]
        if now + remaining > deadline:
            if self.deadline_unmet is None:
                self.deadline_unmet = self.missed_deadline(now, remaining)
        elif self.deadline_unmet is not None and now + remaining * (1 + DEADLINE_MARGIN) <= deadline:
            found = self.deadline_unmet["at"]
            self.clear_unmet(now, "estimate")
            self.news.append(
                f"GreenWindow: the deadline {format_utc(deadline)} (UTC) is in reach again: at "
                f"{format_utc(now)} about {duration_text(remaining)} of work is left (estimated), "
                f"{duration_text(deadline - now)} before it (it was out of reach at {found} (UTC))"
                + ("." if self.light else "; the run may wait for clean hours again.")
            )

    def clear_unmet(self, now: float, by: str) -> None:
        """The out-of-reach record did not hold at ``now``: ``by`` a later ``"estimate"``, or the run's
        ``"end"`` by the deadline."""
        cleared = {"cleared_at": format_utc(now), "cleared_by": by}
        self.deadline_cleared = {**(self.deadline_unmet or {}), **cleared}
        self.deadline_unmet = None

    def missed_deadline(self, now: float, remaining: float) -> dict[str, Any]:
        """The record (for the report) of the deadline found out of reach at ``now`` with ``remaining``
        seconds of work left; it queues the warning, unless this fit was told at its start that the deadline
        had passed (a resumed run)."""
        deadline = float(self.deadline)  # type: ignore[arg-type]
        record = {
            "at": format_utc(now),
            "deadline": format_utc(deadline),
            "remaining_work_s": float(remaining),
            "ends_late_s": float(now + remaining - deadline),
        }
        # light mode holds light as it would without a deadline; its held steps are steps of the run, counted
        # in `remaining` (the run takes as long either way), so the end estimate holds in both modes
        does = "holds light as it would without a deadline" if self.light else "trains without waiting"
        late = f"the run {does} and ends about {duration_text(record['ends_late_s'])} past it"
        if now <= deadline:
            self.news.append(
                f"GreenWindow: the deadline {record['deadline']} (UTC) cannot be met: at {record['at']} "
                f"about {duration_text(remaining)} of work is left (estimated), {duration_text(deadline - now)} "
                f"before it; {late}. Give a later deadline, or less work."
            )
        elif not self.told_passed:  # it passed between two decisions, or before the first estimate
            self.news.append(
                f"GreenWindow: the deadline {record['deadline']} (UTC) has passed: at {record['at']}, "
                f"{duration_text(now - deadline)} after it, about {duration_text(remaining)} of work is left "
                f"(estimated); {late}. Give a later deadline, or less work."
            )
        return record

    def finish(self, now: float) -> None:
        """The run ended at ``now``, its planned length reached (status ``"complete"``: see
        :func:`run_status`): the deadline record becomes the outcome. Ended by the deadline (at or before
        it), an out-of-reach record is cleared (``cleared_by`` ``"end"``); ended past it, the record says by
        how much (``ends_late_s``, ``ended_at``; the estimate stays in ``estimated_late_s``), and a run that
        no decision found late (the steps slowed between two) is recorded at its end."""
        deadline = self.deadline
        if deadline is None:
            return
        if now <= deadline + 1e-6:
            if self.deadline_unmet is not None:
                self.clear_unmet(now, "end")
        elif self.deadline_unmet is None:
            self.deadline_unmet = {
                "at": format_utc(now),
                "deadline": format_utc(deadline),
                "remaining_work_s": 0.0,
                "ends_late_s": now - deadline,
                "ended_at": format_utc(now),
            }
        else:
            unmet = self.deadline_unmet
            self.deadline_unmet = {
                **unmet,
                "estimated_late_s": unmet.get("estimated_late_s", unmet["ends_late_s"]),
                "ends_late_s": now - deadline,
                "ended_at": format_utc(now),
            }

    def decide_from(
        self, signal: Any, now: float, steps_left: float, time_left_s: float | None = None
    ) -> Decision | None:
        """The decision at wall time ``now`` on ``signal`` (a
        :class:`~lightning_pulse.energy.signal.GreenSignal`, read only when a decision is due), or ``None``:
        once the last step is done (``steps_left`` <= 0: nothing is left to move into a cleaner hour), or
        while the remaining work is unknown (:meth:`decide`). A live signal whose first reading fails is
        refused (:class:`~lightning_pulse.PulseRefusal`, at the first decision: the run's start); a later
        failure holds its last good reading (:class:`~lightning_pulse.energy.signal.LiveSignal`)."""
        if steps_left <= 0:
            return None
        try:
            series, to_series = signal.now(now)  # a live reading far ahead of `now` is a failed one
        except SignalUnreadable as error:  # chained to the callable's own exception, where it raised one
            raise PulseRefusal(f"GreenWindow: {error}") from error.__cause__
        # a series read past its end holds its last value (a wrapping one has no end); a live signal can
        # change, and so can one that does not say (a signal of the caller's own, with no `live`)
        holds_from = series.end if getattr(signal, "live", True) is None else math.inf
        return self.decide(series, to_series, now, steps_left, holds_from, time_left_s)

    def metrics(self, decision: Decision) -> dict[str, float]:
        """What a decision logs: the signal and forecast behind it, and the seconds waited so far."""
        return {
            "green/signal": decision.signal,
            "green/forecast_now": decision.forecast_now,
            "green/clean_below": decision.clean_below,
            "green/run": float(decision.run),
            "green/waited_s": self.ledger.seconds("wait"),
            "green/delayed_s": self.delayed_s,
            "green/budget_left_s": self.budget_left_s(),
        }

    def summary(self) -> dict[str, Any]:
        return {
            **self.ledger.summary(self.run_start),
            "budget_s": self.budget_s,
            "budget_left_s": self.budget_left_s() if self.budget_s is not None else None,
            "planned_work_s": self.planned_work_s,
            "clock_away_s": self.clock_away_s,
            "from_step": self.from_step,
            "decisions": self.decision_count,
            "deadline": None if self.deadline is None else format_utc(self.deadline),
            "deadline_unmet": self.deadline_unmet,
            "deadline_cleared": self.deadline_cleared,
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "run_start": self.run_start,
            "planned_work_s": self.planned_work_s,
            "budget_s": self.budget_s,
            "budget_from": self.inputs,
            "from_step": self.from_step,
            "work_share": self.work_share,
            "delayed_s": self.delayed_s,
            "compute_s": self.compute_s,
            "compute_steps": self.compute_steps,
            "clock_away_s": self.clock_away_s,
            "decisions": [dict(d) for d in self.decisions],
            "decision_count": self.decision_count,
            "first_forecast": self.first_forecast,
            "deadline_unmet": self.deadline_unmet,
            "deadline_cleared": self.deadline_cleared,
            "ledger": self.ledger.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.run_start = state["run_start"]
        self.planned_work_s, self.budget_s = state["planned_work_s"], state["budget_s"]
        self.saved_inputs = state.get("budget_from")  # older checkpoints have none: their budget is kept
        self.from_step, self.work_share = int(state.get("from_step", 0)), float(state.get("work_share", 1.0))
        self.delayed_s, self.compute_s = float(state["delayed_s"]), float(state["compute_s"])
        self.compute_steps = int(state["compute_steps"])
        self.clock_away_s = float(state.get("clock_away_s", 0.0))  # older checkpoints have none
        self.decisions = [dict(d) for d in state["decisions"]]
        self.decision_count = int(state.get("decision_count", len(self.decisions)))
        first = state.get("first_forecast")
        self.first_forecast = None if first is None else (list(first[0]), list(first[1]))
        self.deadline_unmet = state.get("deadline_unmet")
        self.deadline_cleared = state.get("deadline_cleared")  # older checkpoints have none
        self.ledger.load_state_dict(state["ledger"])


class OpenSegment:
    """The compute since the last mark, not yet in the schedule's ledger: where it started on the run's clock,
    the meters' kWh then, its optimizer steps, and its kind: ``"light"`` for steps PulseCycle really held in a
    light phase, else ``"run"`` (warm-up and anneal train as usual while held, so they are neither reported
    as held nor charged to the budget). It is in the checkpoint: a run resumed from any checkpoint continues
    it (:meth:`resume`) instead of losing the compute since the last decision.

    Args:
        schedule: where closed segments go.
        watts: power while computing when no meter reads the energy (``options.watts``), or ``None``.
        run_clock: the run's clock, whose spans jumped over by a clock step (:attr:`RunClock.away`) are booked
            as waited, not compute; ``None``: none are.
    """

    def __init__(
        self, schedule: GreenSchedule, watts: float | None, run_clock: RunClock | None = None
    ) -> None:
        self.schedule, self.watts, self.run_clock = schedule, watts, run_clock
        self.start: float | None = None
        self.kwh: float | None = None
        self.steps = 0
        self.kind = "run"

    def begin(self, now: float, kwh: float | None) -> None:
        """A new segment starts at ``now`` (``kwh``: the meters' reading then, ``None`` without meters)."""
        self.start, self.kwh, self.steps = float(now), kwh, 0

    def used(self, kwh: float | None, seconds: float, computing: bool) -> float | None:
        """Energy since the mark: measured (``kwh``: the meters now), else ``watts`` while computing (a paused
        or suspended run is assumed to draw nothing), else unknown."""
        if kwh is not None and self.kwh is not None:
            return kwh - self.kwh
        if self.watts is not None:
            return self.watts * seconds / 3.6e6 if computing else 0.0
        return None

    def close(self, now: float, read_kwh: Callable[[], float | None]) -> None:
        """The compute up to ``now`` becomes a segment of its kind; the next one starts at ``now``. A span a
        clock step jumped over in it is waited between its parts: it used to count as compute, and a 1 h NTP
        step made a 1 s job plan 40 h of work and pause an hour."""
        if self.start is None or now <= self.start and not self.steps:
            return
        kwh = read_kwh()
        away = [] if self.run_clock is None else self.run_clock.take_away(self.start, now)
        starts, ends = [self.start, *(end for _, end in away)], [*(start for start, _ in away), now]
        computed = sum(end - start for start, end in zip(starts, ends))
        used = self.used(kwh, computed, True)
        for index, (start, end) in enumerate(zip(starts, ends)):
            last = index == len(away)  # its steps are booked once, with the last part
            share = (end - start) / computed if computed > 0 else float(last)  # the meters' energy, by time
            self.schedule.ran(
                self.kind, start, end, self.steps if last else 0, None if used is None else used * share
            )
            if not last:  # the span jumped over: no time passed in it, so no energy
                self.schedule.waited(end, starts[index + 1], None if used is None else 0.0, away=True)
        self.begin(now, kwh)

    def waited(self, start: float, end: float, kwh: float | None) -> None:
        """``[start, end]`` was waited (``kwh``: the meters at its end); the next segment starts at ``end``."""
        if self.run_clock is not None:  # a clock step within is waited as the rest is
            self.run_clock.take_away(start, end)
        self.schedule.waited(start, end, self.used(kwh, end - start, False))
        self.begin(end, kwh)

    def next_kind(self, kind: str, now: float, read_kwh: Callable[[], float | None]) -> None:
        """The steps after ``now`` (a step's end) are of ``kind``: a change closes the segment now, with the
        meters read now. Not at the next step's start: its time (data loading, a simulated step) has begun
        there, and the meters would book it to this segment while its time went to the next."""
        if kind != self.kind:
            if self.steps:
                self.close(now, read_kwh)
            self.kind = kind

    def stepped(self, steps: int) -> None:
        self.steps += steps

    def held_s(self, now: float) -> float:
        """The light held in this segment up to ``now``, not yet in the schedule's ``delayed_s``."""
        return max(now - self.start, 0.0) if self.kind == "light" and self.start is not None else 0.0

    def state_dict(self, now: float, next_check: float) -> dict[str, Any]:
        """The segment as saved at ``now``, and when the next decision is due; with the spans a clock step
        jumped over in it, not yet booked (a resume books them as waited, not as compute)."""
        state = {"start": self.start, "kwh": self.kwh, "steps": self.steps, "kind": self.kind}
        away = [] if self.run_clock is None else [[a, min(b, now)] for a, b in self.run_clock.away if a < now]
        return {**state, "saved_at": float(now), "next_check": float(next_check), "away": away}

    def restart(
        self,
        now: float,
        read_kwh: Callable[[], float | None],
        saved: dict[str, Any] | None = None,
        suspended_at: float | None = None,
    ) -> float:
        """Training starts at ``now``: afresh, after a suspend at ``suspended_at`` (the time away is waited),
        or from a checkpoint that held the ``saved`` segment (:meth:`resume`). Returns when the next decision
        is due (at once, but for a resume mid-slot)."""
        if suspended_at is not None:
            kwh = read_kwh()
            self.begin(suspended_at, kwh)
            self.waited(suspended_at, now, kwh)
        elif saved is not None:
            return self.resume(saved, now, read_kwh)
        else:
            self.begin(now, read_kwh())
        return -math.inf

    def resume(self, state: dict[str, Any], now: float, read_kwh: Callable[[], float | None]) -> float:
        """Continue the segment a checkpoint saved, at ``now``; returns when the next decision is due (the
        saved slot's end: a resume does not decide before the uninterrupted run would have). The compute up
        to the save stays in the segment; the time between the save and ``now`` (the run was down) is waited,
        as after a suspend."""
        self.start, self.kwh, self.steps = state["start"], state["kwh"], int(state["steps"])
        self.kind, saved = str(state["kind"]), float(state["saved_at"])
        if self.run_clock is not None:  # the saved spans not yet booked (older checkpoints have none)
            spans = [(float(a), float(b)) for a, b in state.get("away", [])]
            self.run_clock.away = spans + self.run_clock.away
        if self.start is None:
            self.begin(now, read_kwh())
        elif now > saved:
            self.close(saved, read_kwh)
            kwh = read_kwh()
            self.schedule.waited(saved, now, 0.0 if kwh is not None or self.watts is not None else None)
            self.begin(now, kwh)
        return float(state["next_check"])


def restart_run(
    now: float,
    account: Any,
    steps: tuple[int, float],
    signal: GreenSignal,
    segment: OpenSegment,
    saved: dict[str, Any] | None,
    suspended: Mapping[str, Any] | None,
) -> tuple[float, list[str], list[str]]:
    """Training (re)starts at ``now`` (the run's time, :meth:`RunClock.restart`), at ``steps``: the run's
    optimizer step and the steps left at its pace, from a checkpoint that held the ``saved`` segment and maybe
    a suspend (``suspended``), or afresh. ``account``: an attached EnergyLogger's
    :class:`~lightning_pulse.energy.account.EnergyAccount` (or ``None``), whose wall clock is compared with
    ``now`` and whose meters mark the segment. Returns when the next decision is due
    (:meth:`OpenSegment.restart`), the lines to warn (a rebuilt budget, clocks apart) and those to tell (added
    on a resume, how long the run was suspended).

    A rebuilt budget (:meth:`GreenSchedule.restarted`) is built once the time away is counted, so its warning
    counts it (it used to say "0 s already waited, leaving 3.0 h" of a run back from 7 h suspended, which had
    none left); the next decision is then due at once, not at the saved slot's end, so a light slot the
    checkpoint was holding is not held to its end on a budget that is spent."""
    schedule, energy_now = segment.schedule, None if account is None else account.wall_clock()
    read_kwh = (lambda: None) if account is None else account.kwh_now
    joined = schedule.start_fit(*steps)  # before `begin`: a run with no start of its own joined here
    signal.start_fit()  # a live signal's first failure in this fit is warned
    signal.anchor(now, energy_now)  # a followed EnergyLogger's run start, moved onto this clock
    schedule.begin(now)
    away = None if suspended is None else suspended["at"]  # suspended: the time away was waited
    next_check = segment.restart(now, read_kwh, saved, away)
    rebuilt = schedule.restarted(*steps, held_open_s=segment.held_s(now))
    resumed = None if away is None else f"GreenWindow: resuming after {(now - away) / 3600:.1f} h suspended."
    apart = clocks_apart(now, energy_now, schedule.policy.slot_s)
    warn, tell = [line for line in (rebuilt, apart) if line], [line for line in (joined, resumed) if line]
    return (-math.inf if rebuilt else next_check), warn, tell


def end_run(now: float, complete: bool, segment: OpenSegment, read_kwh: Callable[[], float | None]) -> None:
    """Training ends at ``now``: the open segment is closed; a ``complete`` run's deadline record becomes the
    outcome, not an estimate (:meth:`GreenSchedule.finish`)."""
    segment.close(now, read_kwh)
    if complete:
        segment.schedule.finish(now)


class GreenWindowParts(NamedTuple):
    """What a :class:`~lightning_pulse.GreenWindow` runs on, built from its arguments
    (:func:`green_window_parts`)."""

    options: GreenWindowOptions
    when_dirty: str
    forecast: Forecast
    policy: GreenWindowPolicy
    signal: GreenSignal
    clock: Any
    run_clock: RunClock  # the clock, never earlier than a resumed checkpoint's save
    schedule: GreenSchedule
    segment: OpenSegment  # the compute since the last mark


def green_window_parts(
    *,
    signal: Any,
    when_dirty: str,
    threshold: float | str | None,
    horizon: str | float | None,
    max_delay: float | str | None,
    deadline: str | None,
    forecast: Any,
    expected_duration: str | float | None,
    clock: Any,
    options: GreenWindowOptions | Mapping[str, Any] | None,
) -> GreenWindowParts:
    """GreenWindow's arguments (as :class:`~lightning_pulse.GreenWindow` takes them), checked, as the objects
    it runs on: the policy, the signal, the clock (``None``: the system clock), the schedule and its segment.

    Raises:
        ValueError: starting ``"GreenWindow: "``, naming the field, the value and what is allowed.
    """
    try:
        options = options if isinstance(options, GreenWindowOptions) else options_from(options)
        checked = checked_arguments(
            when_dirty, forecast, threshold, horizon, max_delay, deadline, expected_duration
        )
        when_dirty, checked_forecast, delay, share, deadline_s, expected = checked
        policy = GreenWindowPolicy(
            checked_forecast, threshold, seconds_of(horizon, "horizon"), options.slot_s
        )
        green_signal = GreenSignal(signal, options.signal_start, options.unit, options.signal_timeout_s)
        clock = clock or SystemClock()
        run_clock = RunClock(clock)
    except ValueError as error:
        text = str(error)
        raise ValueError(text if text.startswith("GreenWindow") else f"GreenWindow: {text}") from None
    ledger = ScheduleLedger(green_signal.mean, options.unit)
    schedule = GreenSchedule(policy, delay, share, expected, deadline_s, ledger, light=when_dirty == "light")
    segment = OpenSegment(schedule, options.watts, run_clock)
    run_clock.news = schedule.news  # a clock step is warned where the schedule's findings are
    return GreenWindowParts(
        options, when_dirty, checked_forecast, policy, green_signal, clock, run_clock, schedule, segment
    )


# ---------------------------------------------------------------------------- suspended runs
RESUME_FILE = "green_window.json"
WINDOW_FINISHED_EXIT = 3  # `wait-for-window`'s exit status on a run that completed: nothing to resume


class RunFinished(Exception):
    """:func:`wait_for_window` on the resume file of a run that completed: there is nothing to resume."""


def write_resume_file(
    folder: Path,
    now: float,
    resume_at: float,
    checkpoint: Path,
    decision: Decision,
    budget_left_s: float,
    earlier: Sequence[str | Path] = (),
) -> Path:
    """Record, next to the checkpoint, when a suspended run should come back. The resume files of the run's
    earlier suspends (``earlier``) that are still there get the same record: a resumed run that writes into
    another folder (the logger's next version folder) must not leave the one a wrapper reads naming the
    checkpoint it resumed from, which would train the steps since then again."""
    import json
    import shlex

    from lightning_pulse.energy.report import write_text_atomic

    record = {
        "status": "suspended",
        "resume_at": format_utc(resume_at),
        "resume_at_unix": resume_at,
        "suspended_at": format_utc(now),
        "checkpoint": str(checkpoint),
        # the checkpoint by its path: `--ckpt_path last` looks in the new run's logger version folder
        # (version_1 when the first run's logger wrote version_0), finds nothing and starts from step 0
        "resume_command": "lightning-pulse fit --config <your config> --ckpt_path "
        + shlex.quote(str(checkpoint)),
        "decision": decision.to_dict(),
        "budget_left_s": budget_left_s,
    }
    written = write_text_atomic(Path(folder) / RESUME_FILE, json.dumps(record, indent=2))
    for other in map(Path, earlier):
        if other.is_file() and other != written:
            write_text_atomic(other, json.dumps(record, indent=2))
    return written


def write_resume_notice(
    folder: Path,
    now: float,
    resume_at: float,
    checkpoint: Path,
    decision: Decision,
    schedule: GreenSchedule,
    earlier: Sequence[str | Path] = (),
) -> str:
    """:func:`write_resume_file` (with ``schedule``'s delay budget left), and the line that says until when
    the run is suspended, and where the file is."""
    left = schedule.budget_left_s()
    written = write_resume_file(folder, now, resume_at, checkpoint, decision, left, earlier)
    return f"GreenWindow: suspended until {format_utc(resume_at)} UTC ({written})."


def mark_resume_files_finished(
    folder: Path | None, earlier: Sequence[str | Path], now: float, step: int
) -> tuple[list[Path], str | None]:
    """A run that completed (its planned length, or EarlyStopping) says so in its resume file in ``folder``
    (its checkpoint folder; written even where it never suspended) and in those of its earlier suspends
    that are still there: ``wait-for-window`` then ends a wrapper's loop instead of resuming the last suspend
    again. Returns the files written, and the line that says why one could not be (else ``None``): it
    must not fail a finished run. A run that ends in an exception, or that ``max_time`` stops, does not come
    here: its files keep naming its last suspend checkpoint. ``folder`` is ``None`` for a run no longer in
    suspend mode (``when_dirty`` changed on a resume): only its earlier suspends' files are marked."""
    import json

    from lightning_pulse.energy.report import write_text_atomic

    record = {
        "status": "finished",
        "finished_at": format_utc(now),
        "finished_at_unix": now,
        "global_step": step,
    }
    paths = [] if folder is None else [Path(folder) / RESUME_FILE]
    paths += [path for path in map(Path, earlier) if path.is_file() and path not in paths]
    written, failures = [], []
    for path in paths:
        try:
            written.append(write_text_atomic(path, json.dumps(record, indent=2)))
        except OSError as error:
            failures.append(f"{path} ({error})")
    if not failures:
        return written, None
    return written, (
        f"GreenWindow: could not mark the resume file finished: {'; '.join(failures)}; `lightning-pulse "
        "wait-for-window` on it still names the last suspend checkpoint: delete the file by hand."
    )


def finished_line(path: str | Path, record: Mapping[str, Any]) -> str:
    """What ``wait-for-window`` says of the resume file of a run that completed."""
    return (
        f"{path}: the run finished at step {record.get('global_step')} ({record.get('finished_at')} UTC); "
        "there is nothing to resume."
    )


def finished_notice(written: Sequence[Path]) -> str:
    """The line a complete run says of the resume files it marked finished."""
    return (
        f"GreenWindow: the run is complete: {', '.join(map(str, written))} marked finished "
        f"(`lightning-pulse wait-for-window` exits {WINDOW_FINISHED_EXIT} on it: nothing to resume)."
    )


def read_resume_file(path: str | Path) -> dict[str, Any]:
    """The record a suspended run left (``path`` is the file or the folder holding it); ``status``
    ``"finished"`` once the run completed (:func:`mark_resume_files_finished`), else ``"suspended"``."""
    import json

    path = Path(path)
    if path.is_dir():
        path = path / RESUME_FILE
    try:
        record = json.loads(path.read_text())
        if record.setdefault("status", "suspended") != "finished":  # a file from before: a suspend
            float(record["resume_at_unix"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise ValueError(
            f"{path} is not a GreenWindow resume file ({type(error).__name__}: {error})."
        ) from None
    return record


def wait_for_window(path: str | Path, clock: SystemClock | SimulatedClock | None = None) -> float:
    """Sleep on ``clock`` until the suspended run's window opens; returns the seconds slept.

    Raises:
        RunFinished: the run has completed since (nothing to resume).
    """
    clock = clock or SystemClock()
    record = read_resume_file(path)
    if record["status"] == "finished":
        raise RunFinished(finished_line(path, record))
    seconds = max(float(record["resume_at_unix"]) - clock.time(), 0.0)
    clock.sleep(seconds)
    return seconds
