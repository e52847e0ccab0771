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
METHODS = (MEASURED, ESTIMATED, NONE)
COMPONENTS = ("gpu", "cpu", "ram")

# method bit flags, so methods of several ranks or intervals combine with a bitwise or
METHOD_FLAGS = {MEASURED: 1, ESTIMATED: 2, NONE: 0}


def method_from_flags(flags: int) -> str:
    """The weakest method present: anything estimated makes the figure estimated."""
    flags = int(flags)
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

    def close(self) -> None:  # noqa: B027
        """Release what :meth:`start` took (library handles, tracker threads). Must not raise."""

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

    def to_dict(self) -> dict[str, Any]:
        return {
            "component": self.component,
            "failed": self.failed,
            "reason": self.reason,
            "next": self.next,
            "elapsed_s": self.elapsed_s,
        }


MeterFactory = Callable[[], EnergyMeter]


class MeterChain:
    """The meters of one component, tried in order; the running total survives every hand-over.

    Args:
        component: ``"gpu"``, ``"cpu"`` or ``"ram"``.
        factories: functions building each meter, most preferred first. A meter is built only when its turn
            comes, so an unused fallback (e.g. codecarbon while RAPL works) costs nothing.
        warn: called once per failure with a one-line message.
        info: called with a one-line message when a meter is simply not present.

    The total is ``offset + active_meter.read_joules(now)``; on a failure ``offset`` keeps the last good
    total and the next meter starts from zero at that moment. Energy between the last good reading and the
    failure is not counted (at most one sampling period).
    """

    def __init__(
        self,
        component: str,
        factories: Sequence[tuple[str, MeterFactory]],
        warn: Callable[[str], None],
        info: Callable[[str], None] | None = None,
    ) -> None:
        if component not in COMPONENTS:
            raise ValueError(f"`component`={component!r} is not one of {list(COMPONENTS)}.")
        self.component = component
        self._factories = list(factories)
        self._position = -1
        self._warn = warn
        self._info = info or (lambda message: None)
        self.meter: EnergyMeter | None = None
        self.offset_j = 0.0
        self.last_total_j = 0.0
        self.events: list[MeterEvent] = []
        self._started_at = 0.0
        self._announced: set[str] = set()

    @property
    def method(self) -> str:
        return NONE if self.meter is None else self.meter.method

    @property
    def meter_name(self) -> str:
        return "none" if self.meter is None else self.meter.name

    def start(self, now: float) -> None:
        """Start the first meter that works."""
        self._started_at = now
        self._advance(now, failed=None, reason="")

    def read(self, now: float) -> tuple[float, str]:
        """``(total joules since start, method of the meter that produced the latest increment)``."""
        if self.meter is None:
            return self.last_total_j, NONE
        try:
            value = float(self.meter.read_joules(now))
            if not math.isfinite(value):
                raise MeterError(f"non-finite reading {value!r}")
        except Exception as error:  # a meter must never stop training: fall back instead
            failed = self.meter
            self._close(failed)
            self.offset_j = self.last_total_j
            self._advance(now, failed=failed, reason=_one_line(error))
            return self.last_total_j, NONE if self.meter is None else self.meter.method
        # counters never run backwards; a meter that does is reset rather than trusted
        self.last_total_j = max(self.last_total_j, self.offset_j + value)
        return self.last_total_j, self.meter.method

    @property
    def starting(self) -> bool:
        """Whether the active meter is still starting in the background (:attr:`EnergyMeter.starting`)."""
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

    def close(self) -> None:
        if self.meter is not None:
            self._close(self.meter)
            self.meter = None

    def describe(self) -> dict[str, Any]:
        described = self.meter.describe() if self.meter is not None else {"meter": "none", "method": NONE}
        return {**described, "fallbacks": [event.to_dict() for event in self.events]}

    # ------------------------------------------------------------------ internals
    def _advance(self, now: float, failed: EnergyMeter | None, reason: str) -> None:
        self.meter = None
        failures = [] if failed is None else [(failed.name, reason)]
        while self._position + 1 < len(self._factories):
            self._position += 1
            name, factory = self._factories[self._position]
            try:
                meter = factory()
                meter.start(now)
            except MeterUnavailable as error:
                self._info(
                    f"EnergyLogger: {self.component} meter '{name}' is not available ({_one_line(error)})."
                )
                continue
            except Exception as error:
                # a failure at start-up is reported like a failure mid-run: one line, then the next meter
                failures.append((name, _one_line(error)))
                continue
            self.meter = meter
            break
        for failed_name, failed_reason in failures:
            self._report(now, failed_name, failed_reason)

    def _report(self, now: float, failed_name: str, reason: str) -> None:
        next_name = self._next_name()
        self.events.append(MeterEvent(self.component, failed_name, reason, next_name, now - self._started_at))
        key = f"{failed_name}:{next_name}"
        if key in self._announced:
            return
        self._announced.add(key)
        then = (
            "no energy is counted for it from now on"
            if next_name == "none"
            else f"falling back to '{next_name}'"
        )
        self._warn(f"EnergyLogger: {self.component} meter '{failed_name}' failed ({reason}); {then}.")

    def _next_name(self) -> str:
        return "none" if self.meter is None else self.meter.name

    @staticmethod
    def _close(meter: EnergyMeter) -> None:
        try:
            meter.close()
        except Exception:  # closing a broken meter may fail too; nothing useful to do about it
            pass


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split()) or "no message"
    if len(text) > 160:
        text = text[:157] + "..."
    return f"{type(error).__name__}: {text}"
