"""What every energy meter is, and the fallback chain that keeps measuring when one breaks.

A meter reports the energy one component (``"gpu"``, ``"cpu"`` or ``"ram"``) used since the meter started,
in joules, and says how it knows: ``"measured"`` (a hardware counter or power sensor) or ``"estimated"``
(a model, or a constant). A :class:`MeterChain` holds the meters of one component in order of preference;
when the active one fails it warns once, hands over to the next, and keeps the running total continuous.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

MEASURED = "measured"
ESTIMATED = "estimated"
NONE = "none"
#: a figure with uncounted time in it: its component was metered, then every meter of it was lost
PARTIAL = "partial"
METHODS = (MEASURED, ESTIMATED, PARTIAL, NONE)
COMPONENTS = ("gpu", "cpu", "ram")

# method bit flags, so methods of several ranks or intervals combine with a bitwise or. A chain that has lost
# every meter reads PARTIAL: its intervals hold no energy, and a figure that also holds counted energy is
# partial
METHOD_FLAGS = {MEASURED: 1, ESTIMATED: 2, PARTIAL: 4, NONE: 0}


def method_from_flags(flags: int) -> str:
    """The weakest method present: uncounted time next to counted energy makes the figure partial, anything
    estimated makes it estimated; uncounted time alone is none."""
    flags = int(flags)
    counted = flags & (METHOD_FLAGS[MEASURED] | METHOD_FLAGS[ESTIMATED])
    if flags & METHOD_FLAGS[PARTIAL]:
        return PARTIAL if counted else NONE
    if flags & METHOD_FLAGS[ESTIMATED]:
        return ESTIMATED
    if flags & METHOD_FLAGS[MEASURED]:
        return MEASURED
    return NONE


def weakest_method(methods: Sequence[str]) -> str:
    """Combine methods of figures that are added together (``none`` parts are ignored)."""
    flags = 0
    for method in methods:
        flags |= METHOD_FLAGS[method]
    return method_from_flags(flags)


class MeterUnavailable(RuntimeError):
    """The meter does not exist on this machine (no NVML library, no RAPL zone). Not worth a warning."""


class MeterError(RuntimeError):
    """The meter exists but failed (permission denied, a driver error, a library raising)."""


class EnergyMeter(ABC):
    """One source of energy figures for one component.

    Subclasses set :attr:`component`, :attr:`method` and :attr:`name`. ``now`` is a monotonic time in
    seconds, passed in so that meters which integrate power over time can be tested with a fake clock.
    """

    component: str = "cpu"
    method: str = MEASURED
    name: str = "meter"

    def start(self, now: float) -> None:  # noqa: B027 - most meters need no set-up
        """Take the baseline. Raise :class:`MeterUnavailable` or :class:`MeterError` if it cannot run."""

    @abstractmethod
    def read_joules(self, now: float) -> float:
        """Energy in joules since :meth:`start`. Raises on failure."""

    @property
    def starting(self) -> bool:
        """Whether a start that runs in the background is not finished: its readings are the zero point, and
        the energy of the meantime comes with its first real reading."""
        return False

    def settle(self, timeout: float) -> None:  # noqa: B027 - most meters start synchronously
        """Wait (at most ``timeout`` seconds) for a start that runs in the background to finish, so that a
        last reading holds its energy. Must not raise."""

    def give_up_start(self, reason: str) -> None:  # noqa: B027 - most meters start synchronously
        """A start that runs in the background has not finished in time and is given up (its chain falls
        back): let go of it, so that nothing waits for it any more. Must not raise."""

    def close(self) -> None:  # noqa: B027
        """Release what :meth:`start` took (library handles, tracker threads). Must not raise."""

    def take_notices(self) -> list[str]:
        """One line for each discontinuity the meter corrected since the last call (a counter that was reset,
        a reading out of range): the chain warns once per kind, records an event and labels the interval
        *estimated*. Most meters have none."""
        notices: list[str] = getattr(self, "_notices", [])
        self._notices: list[str] = []
        return notices

    def notice(self, message: str) -> None:
        """Queue a discontinuity for :meth:`take_notices`."""
        if not hasattr(self, "_notices"):
            self._notices = []
        self._notices.append(message)

    def describe(self) -> dict[str, Any]:
        return {"meter": self.name, "method": self.method}


@dataclass
class MeterEvent:
    """A fallback, as shown in the report: which meter stopped, why, and what took over."""

    component: str
    failed: str
    reason: str
    next: str
    elapsed_s: float
    #: ``"fallback"`` (the meter stopped) or ``"corrected"`` (it keeps going; one interval is estimated)
    kind: str = "fallback"

    def to_dict(self) -> dict[str, Any]:
        return {
            "component": self.component,
            "failed": self.failed,
            "reason": self.reason,
            "next": self.next,
            "elapsed_s": self.elapsed_s,
            "kind": self.kind,
        }


MeterFactory = Callable[[], EnergyMeter]


#: a counter total lower than the last one by more than this is a reset, not rounding
BACKWARDS_TOLERANCE_J = 1e-3
#: the most events one chain keeps (a meter out of range at every reading would grow the report without end)
MAX_EVENTS = 100


class MeterChain:
    """The meters of one component, tried in order; the running total survives every hand-over.

    Args:
        component: ``"gpu"``, ``"cpu"`` or ``"ram"``.
        factories: functions building each meter, most preferred first. A meter is built only when its turn
            comes, so an unused fallback (e.g. codecarbon while RAPL works) costs nothing.
        warn: called with a one-line message per failure (several meters failing at one instant: one line).
        info: called with a one-line message when a meter is simply not present.
        required: the user asked for this component by name (``meters.gpu_devices``): a meter that is not
            present is then a failure (a warning and a report event), not an info line.
        announced: a set shared by the chains of one process: a failure whose reason another chain already
            warned about (one codecarbon tracker serves CPU and RAM; one NVML serves both GPU meters) is an
            info line, not a second warning. Its event is recorded all the same.

    The total is ``offset + active_meter.read_joules(now)``; on a failure ``offset`` keeps the last good
    total and the next meter starts from zero at that moment. Energy between the last good reading and the
    failure is not counted (at most one sampling period). A meter that failed before it ever delivered a
    reading (codecarbon's background start failing after its hardware detection) is replaced from its own
    start on, so an estimator next in line (a constant) covers that span too. A total that runs backwards (a
    counter reset by a driver reload) is rebased where it was, with a warning, an event and the interval
    labelled *estimated*. When every meter is gone, readings say :data:`PARTIAL` if the component had counted
    energy before (its figure is partial), else :data:`NONE`.
    """

    def __init__(
        self,
        component: str,
        factories: Sequence[tuple[str, MeterFactory]],
        warn: Callable[[str], None],
        info: Callable[[str], None] | None = None,
        required: bool = False,
        announced: set[str] | None = None,
    ) -> None:
        if component not in COMPONENTS:
            raise ValueError(f"`component`={component!r} is not one of {list(COMPONENTS)}.")
        self.component = component
        self._factories = list(factories)
        self._position = -1
        self._warn = warn
        self._info = info or _ignore
        self.required = bool(required)
        self.meter: EnergyMeter | None = None
        self.offset_j = 0.0
        self.last_total_j = 0.0
        self.events: list[MeterEvent] = []
        self._started_at = 0.0
        self._announced: set[Any] = set()
        self._shared = announced if announced is not None else set()
        self._meter_since = 0.0  # when the active meter's count starts
        self._delivered = False  # whether the active meter has delivered a reading (not a start's zero point)
        self._counted = False  # whether any meter of this chain has
        self._closed_description: dict[str, Any] | None = None  # the active meter's, when the chain closed
        self._given_up: str | None = None  # why the active meter's background start was given up

    def __getstate__(self) -> dict[str, Any]:
        # pickled and deep-copied with its EnergyLogger (``ddp_spawn``, a sweep's copies): a copy is a closed
        # chain, its records and description kept; the meters (a codecarbon tracker, NVML handles), the
        # factories building them (closures) and the warners stay with the fit that ran them
        closed = self._closed_description if self.meter is None else self.meter.describe()
        dropped = {"_factories": [], "meter": None, "_closed_description": closed}
        return {**self.__dict__, **dropped, "_warn": _ignore, "_info": _ignore}

    @property
    def method(self) -> str:
        return NONE if self.meter is None else self.meter.method

    @property
    def meter_name(self) -> str:
        return "none" if self.meter is None else self.meter.name

    def start(self, now: float) -> None:
        """Start the first meter that works."""
        self._started_at = now
        self._closed_description = None
        self._advance(now, since=now, failures=[])

    def read(self, now: float) -> tuple[float, str]:
        """``(total joules since start, method of the meter that produced the latest increment)``."""
        meter = self.meter
        if meter is None:
            return self.last_total_j, PARTIAL if self._counted else NONE
        was_starting = self.starting
        try:
            if self._given_up is not None:
                raise MeterError(self._given_up)
            value = float(meter.read_joules(now))
            if not math.isfinite(value):
                raise MeterError(f"non-finite reading {value!r}")
        except Exception as error:  # a meter must never stop training: fall back instead
            self._close(meter)
            self.offset_j = self.last_total_j
            since = now if self._delivered else min(self._meter_since, now)
            self._advance(now, since=since, failures=[(meter.name, _one_line(error))])
            if self.meter is not None and since < now:
                return self.read(now)  # the replacement's count since the failed meter's start
            return self.last_total_j, self.method if self.meter is not None else self._lost()
        method = meter.method
        notices = meter.take_notices()
        total = self.offset_j + value
        if total < self.last_total_j - BACKWARDS_TOLERANCE_J:
            notices.append(
                f"its total went back from {self.last_total_j:.6g} J to {total:.6g} J (a counter reset); "
                "rebased there"
            )
            self.offset_j = self.last_total_j - value
        total = max(total, self.last_total_j)
        if not was_starting:
            self._delivered = self._counted = True
        for notice in notices:
            self._correct(now, meter.name, notice)
        if notices and method == MEASURED:
            method = ESTIMATED  # the interval holds a correction, not a plain measurement
        self.last_total_j = total
        return total, method

    @property
    def starting(self) -> bool:
        """Whether the active meter is still starting in the background (:attr:`EnergyMeter.starting`)."""
        if self._given_up is not None:
            return False  # it fails at the next reading
        try:
            return self.meter is not None and bool(self.meter.starting)
        except Exception:  # a meter that cannot tell fails at its next reading, and falls back there
            return False

    def settle(self, timeout: float) -> None:
        """Let the active meter finish a background start (see :meth:`EnergyMeter.settle`)."""
        if self.meter is not None:
            try:
                self.meter.settle(timeout)
            except Exception:  # a meter that cannot settle fails at its next reading, and falls back there
                pass

    def give_up_start(self, reason: str) -> None:
        """The active meter's background start did not finish in time (``reason`` says so): it fails at the
        next reading, which falls back to the next meter from this meter's own start, so the fallback's
        estimate covers the whole span, never a zero nobody counted."""
        meter = self.meter
        if meter is None or not self.starting:
            return
        self._given_up = reason
        try:
            meter.give_up_start(reason)
        except Exception:  # it fails at the next reading all the same
            pass

    def close(self) -> None:
        if self.meter is not None:
            # an interrupted run's report is built after the meters close: it still names the one that counted
            self._closed_description = self.meter.describe()
            self._close(self.meter)
            self.meter = None

    def describe(self) -> dict[str, Any]:
        if self.meter is not None:
            described = self.meter.describe()
        else:
            described = self._closed_description or {"meter": "none", "method": NONE}
        return {**described, "fallbacks": [event.to_dict() for event in self.events]}

    # ------------------------------------------------------------------ internals
    def _lost(self) -> str:
        return PARTIAL if self._counted else NONE

    def _advance(self, now: float, since: float, failures: list[tuple[str, str]]) -> None:
        self.meter, self._given_up = None, None
        while self._position + 1 < len(self._factories):
            self._position += 1
            name, factory = self._factories[self._position]
            try:
                meter = factory()
                meter.start(since)
            except MeterUnavailable as error:
                if self.required:
                    failures.append((name, _one_line(error)))
                else:
                    self._info(
                        f"EnergyLogger: {self.component} meter '{name}' is not available "
                        f"({_one_line(error)})."
                    )
                continue
            except Exception as error:
                # a failure at start-up is reported like a failure mid-run: one line, then the next meter
                failures.append((name, _one_line(error)))
                continue
            self.meter = meter
            self._meter_since = since
            self._delivered = False
            break
        if failures:
            self._report(now, since, failures)

    def _event(self, event: MeterEvent) -> None:
        if len(self.events) < MAX_EVENTS:
            self.events.append(event)

    def _report(self, now: float, since: float, failures: list[tuple[str, str]]) -> None:
        """One line for the meters that failed at this instant, one event each."""
        next_name = self._next_name()
        for name, reason in failures:
            self._event(MeterEvent(self.component, name, reason, next_name, now - self._started_at))
        names = [name for name, _ in failures]
        reasons = list(dict.fromkeys(reason for _, reason in failures))
        key = (tuple(names), next_name)
        if key in self._announced:
            return
        self._announced.add(key)
        quoted = " and ".join(f"'{name}'" for name in names)
        if len(reasons) == 1:
            what = f"{self.component} meter{'s' if len(names) > 1 else ''} {quoted} failed ({reasons[0]})"
        else:
            listed = ", ".join(f"'{name}' ({reason})" for name, reason in failures)
            what = f"{self.component} meters {listed} failed"
        if next_name != "none":
            then = f"falling back to '{next_name}'"
            if since < now:
                then += f", which also covers the {now - since:.1f} s since the failed meter's start"
        elif self._counted:
            then = "no energy is counted for it from now on, and its figure is labelled partial"
        else:
            then = "no energy is counted for it"
        message = f"EnergyLogger: {what}; {then}."
        if all(reason in self._shared for reason in reasons):
            self._info(message)  # another chain already warned about this very failure
            return
        self._shared.update(reasons)
        self._warn(message)

    def _correct(self, now: float, name: str, notice: str) -> None:
        """A meter corrected a discontinuity and keeps going: an event, and a warning once per meter."""
        self._event(MeterEvent(self.component, name, notice, name, now - self._started_at, kind="corrected"))
        key = ("corrected", name)
        if key in self._announced:
            return
        self._announced.add(key)
        self._warn(
            f"EnergyLogger: {self.component} meter '{name}': {notice}; it keeps measuring, and the interval "
            "is labelled estimated (any further correction is listed in the report's events)."
        )

    def _next_name(self) -> str:
        return "none" if self.meter is None else self.meter.name

    @staticmethod
    def _close(meter: EnergyMeter) -> None:
        try:
            meter.close()
        except Exception:  # closing a broken meter may fail too; nothing useful to do about it
            pass


def _ignore(message: str) -> None:
    return None


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split()) or "no message"
    if len(text) > 160:
        text = text[:157] + "..."
    return f"{type(error).__name__}: {text}"
