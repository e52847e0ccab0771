"""The signal a carbon- or price-aware schedule follows: a known series, or live readings.

A *series signal* is a :class:`~lightning_pulse.energy.carbon.TimeSeries` (from the ``Time,Carbon Intensity``
or ``timestamp,value`` CSV that :mod:`lightning_pulse.energy.carbon` reads, a JSON list, or pairs in Python)
read through a :class:`~lightning_pulse.energy.carbon.Rate`, so a run in 2026 on the 2020 series reads the
same time of year (wrapping past the end of a whole-year series to its start), or a configured start, exactly
as :class:`~lightning_pulse.EnergyLogger` does (a run at its own dates or from a configured start holds the
last value past the series' end, with one warning). A *live
signal* is a callable returning ``(unix_seconds, value)`` (an API poll, a meter): its history is what it has
returned so far, so no forecast can read its future. A reading stamped more than :data:`LIVE_AHEAD_S` ahead of
the decision's clock (Unix milliseconds, a local time taken as UTC), or that does not return within its
bound (GreenWindow's ``options.signal_timeout``, :data:`LIVE_READ_TIMEOUT_S` by default), is a failed reading.
"""

from __future__ import annotations

import contextvars
import json
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from lightning_pulse.energy.carbon import (
    DATED_RANGE,
    Rate,
    TimeSeries,
    _rank_zero_warn,
    compact_dates_refusal,
    format_utc,
    is_dated,
    other_unit_hint,
    parse_series_start,
    parse_timestamp,
    read_series_text,
    refuse_start_outside_series,
    time_described,
)

SignalSource = str | Path | Sequence[Any] | TimeSeries | Callable[[], tuple[float, float]]
#: a live reading stamped further ahead of the clock than this is a failed reading: a reading of the value
#: now is stamped now, or at the end of the period it covers (up to an hour ahead for hourly data); one
#: further ahead moved every decision there (Unix milliseconds: to the year 52000; a local time read as UTC:
#: by its offset), and its history with it. Two minutes more are allowed for a source's clock ahead of ours
LIVE_AHEAD_S = 3600.0 + 120.0
#: the default bound on a live reading (GreenWindow's ``options.signal_timeout``): one that has not returned
#: after this many seconds (real time, on any clock) is a failed reading; the callable runs on a thread of its
#: own, and the decision goes on without it. A call with no timeout of its own (an API poll on a dead
#: connection) held the training thread for ever. Twice httpx's default timeout (5 s), so a client with a
#: timeout of its own usually fails first, with its own message
LIVE_READ_TIMEOUT_S = 10.0
#: the setting that bounds a live reading, named by the messages about it
TIMEOUT_SETTING = "`options.signal_timeout`"


def is_pair_list(value: Any) -> bool:
    """Whether ``value`` is a sequence that can hold pairs (a list, a tuple, Hydra's ListConfig), not a
    string."""
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes))


def series_from_json(path: str | Path, field: str = "signal") -> TimeSeries:
    """A series from a JSON list of ``[time, value]`` pairs or ``{"time": ..., "value": ...}`` objects
    (times ISO 8601, naive = UTC, or Unix seconds)."""
    path = Path(path)
    try:
        items = json.loads(read_series_text(path, field))  # a BOM (Windows editors, PowerShell) is skipped
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"`{field}`={str(path)!r} is not a readable JSON file ({error}).") from None
    return series_from_pairs(items, field, name=path.name)


def series_from_pairs(items: Any, field: str = "signal", name: str = "series") -> TimeSeries:
    """A series from ``[[time, value], ...]`` or ``[{"time": t, "value": v}, ...]`` (any sequences and
    mappings: Hydra gives a ListConfig of ListConfigs)."""
    if not is_pair_list(items) or len(items) == 0:
        raise ValueError(
            f"`{field}` must be a non-empty list of [time, value] pairs or {{'time', 'value'}} objects."
        )
    times, values = [], []
    for index, item in enumerate(items):
        try:
            if isinstance(item, Mapping):
                moment = item.get("time", item.get("timestamp"))
                value = item.get("value", item.get("carbon_intensity"))
            else:
                moment, value = item
            times.append(moment if isinstance(moment, (int, float)) else parse_timestamp(str(moment)))
            values.append(float(value))
        except (TypeError, ValueError) as error:
            raise ValueError(
                f"`{field}`: item {index} ({item!r}) is not a (time, value) pair: {error}."
            ) from None
    array = np.array(times, dtype=np.float64)
    compact = compact_dates_refusal(array, "item")
    if compact is not None:
        raise ValueError(f"`{field}`: {name}: item 0 ({float(array[0])!r}) {compact}.")
    try:
        return TimeSeries(array, np.array(values), name=name)
    except ValueError as error:
        raise ValueError(f"`{field}`: {error}") from None


def series_signal(
    source: str | Path | Sequence[Any] | TimeSeries,
    field: str = "signal",
    series_start: float | str | None = None,
    unit: str = "signal",
) -> Rate:
    """A :class:`Rate` over the series ``source`` names (CSV or JSON path, list of pairs, a TimeSeries), read
    from ``series_start`` (the user's ``options.signal_start``: Unix seconds, text, a datetime, a pandas
    Timestamp or a numpy datetime64, read as :func:`parse_series_start` reads EnergyLogger's start; quoted as
    given when refused) when set; ``unit``: the signal's (GreenWindow's ``options.unit``), for its report and
    warnings."""
    if isinstance(source, TimeSeries):
        series = source
    elif isinstance(source, (str, Path)):
        path = Path(source)
        series = (
            series_from_json(path, field)
            if path.suffix.lower() == ".json"
            else TimeSeries.from_csv(path, field)
        )
    elif is_pair_list(source):
        series = series_from_pairs(source, field)
    else:
        raise ValueError(
            f"`{field}`={source!r} has type {type(source).__name__}; expected a CSV or JSON path, a list of "
            "(time, value) pairs, a callable returning (time, value), or None."
        )
    # a datetime, pandas Timestamp or numpy datetime64 as EnergyLogger's carbon_intensity_start reads it
    start = parse_series_start(series_start, "options.signal_start")
    given = None if isinstance(series_start, (int, float)) else series_start
    refuse_start_outside_series(series, start, "options.signal_start", given)
    rate = Rate(
        f"series:{series.name}",
        unit,
        series=series,
        series_start=None if start is None else float(start),
        reader="GreenWindow",
        start_field="options.signal_start",
        field=field,
    )
    rate.warn_gaps(repr(str(source)) if isinstance(source, (str, Path)) else f"({series.name})")
    return rate


#: the way out of a live signal that fails before any good reading (a refusal at fit start)
LIVE_WAY_OUT = (
    "Check the source (one call by hand should return (unix_seconds, value)), or give `signal` a series: a "
    "CSV or JSON path, or a list of (time, value) pairs."
)


def _ahead_text(seconds: float) -> str:
    """How far a reading is ahead of the clock: minutes, hours, days, or years (Unix milliseconds: 50000)."""
    year = 365.2425 * 86400
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.0f} days" if seconds < 2 * year else f"{seconds / year:.0f} years"


class SignalUnreadable(ValueError):
    """A live signal's first reading failed: no good reading can stand in for it (GreenWindow refuses the run
    at fit start). The callable's own exception, if it raised, is the ``__cause__``."""


class _Call:
    """One call of a live signal's callable, on a daemon thread (a call that never returns must not keep the
    process from exiting): :attr:`done` is set once it returned (:attr:`result`) or raised (:attr:`error`).

    It runs in a copy of the caller's :mod:`contextvars` context, so a ``ContextVar`` (a config, a logging or
    tracing context) or :mod:`decimal`'s context reads as on the training thread; thread-local state
    (``threading.local``, ``torch.no_grad``) cannot be carried to another thread."""

    def __init__(self, read: Callable[[], Any]) -> None:
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None
        threading.Thread(  # RuntimeError where no thread can start (a container at its pids limit)
            target=contextvars.copy_context().run,
            args=(self._run, read),
            name="lightning-pulse-live-signal",
            daemon=True,
        ).start()

    def _run(self, read: Callable[[], Any]) -> None:
        try:
            self.result = read()
        except BaseException as error:  # handed to the caller's thread
            self.error = error
        finally:
            self.done.set()


class LiveSignal:
    """Readings of a callable ``read() -> (unix_seconds, value)``, kept as the history forecasts see.

    A reading older than the last one is ignored; one at the same time replaces it. Once a reading was good,
    a failed one (the callable raised, returned no pair of finite numbers, a value below 0, or a time outside
    :data:`~lightning_pulse.energy.carbon.DATED_RANGE` or more than :data:`LIVE_AHEAD_S` ahead of the clock's
    ``now`` given to :meth:`observe`, or it did not return within ``timeout_s``) is counted in ``failed``
    and the last good reading stands in for it, with one warning a fit (``warn``: Lightning's
    ``rank_zero_warn`` by default): a meter that fails must not end a run. With no good reading yet,
    :class:`SignalUnreadable` says why. ``timeout_s``: seconds of real time a reading is waited for, the
    callable running on a thread of its own (:meth:`_call`); ``None`` calls it on the caller's thread,
    unbounded (one that needs the main thread: a ``signal.alarm`` timeout, an asyncio event loop).
    """

    def __init__(
        self,
        read: Callable[[], tuple[float, float]],
        name: str = "live",
        unit: str = "signal",
        warn: Callable[[str], None] | None = None,
        timeout_s: float | None = LIVE_READ_TIMEOUT_S,
    ) -> None:
        self.read, self.name, self.unit, self.warn, self.timeout_s = read, name, unit, warn, timeout_s
        self.times: list[float] = []
        self.values: list[float] = []
        self._series: TimeSeries | None = None
        self.failed = 0  # readings that failed, the last good one held in their place
        self.first_failure: dict[str, Any] | None = None
        self._warned = False  # once per fit (start_fit): a source that is down fails at every decision
        self._late: _Call | None = None  # a call that timed out, not returned yet: no other starts meanwhile

    def start_fit(self) -> None:
        """A fit starts: its first failed reading is warned, even where an earlier fit's was (a resume into
        the same instance, with a call of the earlier fit still out, ran on the held value and said
        nothing)."""
        self._warned = False

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (``ddp_spawn``) or deep-copied (a sweep) after a fit: a call still out is not the copy's
        (its thread and event are this process's; the event's lock does not pickle), so the copy asks
        again."""
        return {**self.__dict__, "_late": None}

    def observe(self, now: float | None = None) -> tuple[float, float]:
        """Read the callable at the clock's ``now`` (``None``: unchecked against a clock); returns ``(time,
        value)``: the last good reading where this one failed."""
        try:
            moment, value = self._read(now)
        except SignalUnreadable as error:
            if not self.times:
                # a callable that raised on the reading thread may need the training thread (see _call)
                raised_there = error.__cause__ is not None and self.timeout_s is not None
                there = f" (it ran on a thread of its own; {TIMEOUT_SETTING}=None calls it on the training "
                there += "thread)"
                raise SignalUnreadable(
                    f"`signal`: {str(error).rstrip('.')}{there if raised_there else ''}. That was its first "
                    "reading, so no earlier one can stand in for it (a later failure holds the last good "
                    f"reading). {LIVE_WAY_OUT}"
                ) from error.__cause__
            self._hold(str(error).rstrip("."))
            return self.times[-1], self.values[-1]
        if self.times and moment < self.times[-1]:
            return self.times[-1], self.values[-1]
        if self.times and moment == self.times[-1]:
            self.values[-1] = value
        else:
            self.times.append(moment)
            self.values.append(value)
        self._series = None
        return moment, value

    def _read(self, now: float | None) -> tuple[float, float]:
        """One reading of the callable, checked (against the clock's ``now`` where given):
        :class:`SignalUnreadable` (no way out in it) if it failed."""
        reading = self._call()
        try:
            moment, value = reading
            moment, value = float(moment), float(value)
        except (TypeError, ValueError, ArithmeticError):  # an int too large for a float too
            raise SignalUnreadable(
                f"the callable returned {reading!r}; it must return a (unix_seconds, value) pair of numbers"
            ) from None
        if not np.isfinite(moment) or not np.isfinite(value) or value < 0:
            raise SignalUnreadable(
                f"the callable returned {reading!r}; its time must be finite and its value finite and >= 0"
            )
        if not is_dated(moment) or (now is not None and moment - now > LIVE_AHEAD_S):
            raise SignalUnreadable(self._misdated(reading, moment, now))
        return moment, value

    def _call(self) -> Any:
        """The callable's answer, waited for ``timeout_s`` at most; :class:`SignalUnreadable` if it raised or
        did not answer in time. A call that timed out is left to finish on its thread, and no other starts
        until it has: a source that hangs at every call would pile up a thread a decision. Its answer, when it
        comes, is dropped: it is a reading of the moment it was asked for, and the next decision asks again
        rather than take it as the value at its own, later time. ``timeout_s`` ``None``: called here."""
        if self.timeout_s is None:
            try:
                return self.read()
            except Exception as error:  # an API timeout, a meter that is down: any failure of the source
                raise SignalUnreadable(f"the callable raised {type(error).__name__}: {error}") from error
        bound = f"{self.timeout_s:g} s ({TIMEOUT_SETTING})"
        if self._late is not None and not self._late.done.is_set():
            raise SignalUnreadable(
                f"the callable `{self._name}` has not returned from a reading that timed out after {bound}; "
                "no other reading starts until it does"
            )
        try:
            call = _Call(self.read)
        except RuntimeError as error:  # can't start new thread
            raise SignalUnreadable(
                f"no thread could be started to call `{self._name}` ({error}); {TIMEOUT_SETTING}=None calls "
                "it on the training thread"
            ) from None
        self._late = call  # out until it returns (a Ctrl-C in the wait leaves it out)
        if not call.done.wait(min(self.timeout_s, threading.TIMEOUT_MAX)):
            raise SignalUnreadable(
                f"the callable `{self._name}` did not return within {bound}; give it a timeout of its own "
                f"under that, or raise {TIMEOUT_SETTING} above its own (None calls it on the training "
                "thread, with no bound)"
            )
        self._late, error = None, call.error
        if isinstance(error, Exception):  # an API timeout, a meter that is down: any failure of the source
            raise SignalUnreadable(f"the callable raised {type(error).__name__}: {error}") from error
        if error is not None:  # SystemExit, KeyboardInterrupt: as if raised here, as before
            raise error
        return call.result

    @property
    def _name(self) -> str:
        return getattr(self.read, "__qualname__", None) or type(self.read).__name__

    def _misdated(self, reading: Any, moment: float, now: float | None) -> str:
        """Why a reading's time is refused: outside the dates a signal has, or too far ahead of the clock."""
        name = self._name
        ahead = -math.inf if now is None else moment - now
        where = f"{time_described(moment)}, outside {DATED_RANGE}"
        if now is not None and ahead > LIVE_AHEAD_S:
            where = f"{_ahead_text(ahead)} ahead of the clock's {format_utc(now)} UTC"
        hint = other_unit_hint(moment)
        if hint is None and LIVE_AHEAD_S < ahead <= 15 * 3600:  # the widest UTC offset is 14 h
            hint = (
                "a local time read as UTC",
                "stamp it with time.time(), or an aware datetime's timestamp()",
            )
        return (
            f"the callable `{name}` returned {reading!r}, stamped {where}"
            + (f", and looks like {hint[0]}" if hint else "")
            + "; a reading's time must be Unix seconds (UTC) at most "
            + f"{LIVE_AHEAD_S / 60:.0f} min ahead of the clock (the end of an hourly period, and two minutes "
            + "of clock skew)"
            + (f": {hint[1]}" if hint else "")
        )

    def _hold(self, failure: str) -> None:
        """Count a failed reading; the first of this fit is warned, naming what stands in for it."""
        self.failed += 1
        held, since = self.values[-1], format_utc(self.times[-1])
        if self.first_failure is None:
            self.first_failure = {"error": failure, "after_utc": since, "held_value": held}
        if self._warned:
            return
        self._warned = True
        shown = f"{held:g}" if self.unit == "signal" else f"{held:g} {self.unit}"
        (self.warn or _rank_zero_warn)(
            f"GreenWindow: a reading of the live `signal` failed: {failure}. The decisions take its last "
            f"good reading, {shown} from {since} (UTC), as the value now until a reading succeeds, and "
            "training goes on. Later failures are not warned again: the report's `signal` block counts them "
            "(`failed_readings`). Check the source if this persists."
        )

    def history(self) -> TimeSeries:
        """Every reading so far, as a step function."""
        if not self.times:
            raise ValueError(f"{self.name}: no reading yet.")
        if self._series is None:
            self._series = TimeSeries(np.array(self.times), np.array(self.values), name=self.name)
        return self._series

    def state_dict(self) -> dict[str, Any]:
        return {
            "times": list(self.times),
            "values": list(self.values),
            "failed": self.failed,
            "first_failure": self.first_failure,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.times = [float(t) for t in state.get("times", [])]
        self.values = [float(v) for v in state.get("values", [])]
        self.failed, self.first_failure = int(state.get("failed", 0)), state.get("first_failure")
        self._series = None


def refuse_start_without_own_series(source: SignalSource | None, series_start: float | str | None) -> None:
    """``options.signal_start`` places the run in a series of GreenWindow's own: next to no ``signal`` (the
    EnergyLogger's series, read from the EnergyLogger's start so that the two reports price the same hours) or
    a live signal (its readings carry their own times) it would do nothing, and was silently ignored."""
    if series_start is None or (source is not None and not callable(source)):
        return
    given = f"`options.signal_start`={series_start!r}"
    if source is None:
        raise ValueError(
            f"{given} says where a series of GreenWindow's own starts, and `signal` is None: GreenWindow "
            "follows the EnergyLogger's carbon-intensity series, read from the EnergyLogger's own start, so "
            "that both reports price the same hours. Set that start on the EnergyLogger "
            "(`accounting.carbon_intensity_start`), give `signal` the series' path, or leave signal_start "
            "out."
        )
    raise ValueError(
        f"{given} says where a series starts, and `signal` is a callable: a live signal's readings carry "
        "their own times. Leave signal_start out, or give `signal` a series' path to replay it from that "
        "start."
    )


class GreenSignal:
    """The signal a :class:`~lightning_pulse.GreenWindow` follows: a series (read through a :class:`Rate`,
    so on the same time axis as EnergyLogger's) or live readings; ``None`` until :meth:`use` gives a rate, or
    :meth:`follow` an EnergyLogger's.

    Args:
        source: see :data:`SignalSource`, or ``None`` (filled in at fit start).
        series_start: where a series is read from (the run's start maps there): ``options.signal_start`` as
            the user gave it (:func:`series_signal`); refused without a series of its own.
        unit: the signal's unit (``options.unit``); a followed EnergyLogger series keeps its own.
        timeout_s: how long a live reading is waited for (``options.signal_timeout``; see
            :class:`LiveSignal`).
    """

    def __init__(
        self,
        source: SignalSource | None,
        series_start: float | str | None = None,
        unit: str = "signal",
        timeout_s: float | None = LIVE_READ_TIMEOUT_S,
    ) -> None:
        refuse_start_without_own_series(source, series_start)
        self.live = LiveSignal(source, unit=unit, timeout_s=timeout_s) if callable(source) else None
        self.rate = (
            None
            if source is None or callable(source)
            else series_signal(source, "signal", series_start, unit)
        )
        self.follows: Rate | None = None  # the EnergyLogger's rate, when its series is the signal
        self.saved: dict[str, Any] = {}  # the state a checkpoint held (:meth:`load_state_dict`)

    @property
    def known(self) -> bool:
        return self.rate is not None or self.live is not None

    def use(self, rate: Rate) -> None:
        self.rate = rate

    def start_fit(self) -> None:
        """A fit (or a resume) starts: a live signal warns its first failed reading of it."""
        if self.live is not None:
            self.live.start_fit()

    def follow(self, rate: Rate) -> None:
        """At fit start: a signal with no source of its own (or that followed one in an earlier fit) follows
        ``rate``, the EnergyLogger's carbon-intensity series, through a fork of it on this reader's clock
        (:meth:`Rate.fork`), with the state a checkpoint held. A signal of its own is kept."""
        if self.known and self.follows is None:
            return
        self.follows = rate
        self.use(rate.fork())
        self.load_state_dict(self.saved)

    def anchor(self, now: float, other_now: float | None = None) -> None:
        """The run starts at ``now`` (kept across resumes). A followed rate is first anchored at the
        EnergyLogger's run start moved onto this clock (``other_now``: the EnergyLogger's clock at the same
        moment, ``None`` without one; :meth:`Rate.anchor_as`)."""
        if self.follows is not None and other_now is not None:
            self.rate.anchor_as(self.follows, now, other_now)  # type: ignore[union-attr]
        if self.rate is not None:
            self.rate.anchor(now)

    def now(self, at: float | None = None) -> tuple[TimeSeries, Callable[[float], float]]:
        """The history to forecast from (reading a live signal now, its time checked against the clock's
        ``at``; a series as the run reads it, wrapped past its end when the run wraps), and the wall -> series
        time mapping (for a live signal, the time of the reading just taken where that is later: call it with
        the time the decision read before)."""
        if self.live is not None:
            moment, _ = self.live.observe(at)
            # the reading just taken is the value now, for the decision that asked for it: the callable's own
            # clock stamps it after the decision read the time (microseconds on the system clock), where the
            # history still held the reading before (every decision acted on the previous one, a slot late)
            return self.live.history(), lambda wall: max(wall, moment)
        assert self.rate is not None and self.rate.run_series is not None
        return self.rate.run_series, self.rate.series_time

    def mean(self, t0: float, t1: float) -> float:
        """Mean over the wall-clock interval ``[t0, t1]`` (NaN for a live signal with no reading yet)."""
        if self.live is not None:
            return self.live.history().mean(t0, t1) if self.live.times else float("nan")
        assert self.rate is not None
        return self.rate.mean(t0, t1)

    def describe(self) -> dict[str, Any] | None:
        if self.live is not None:
            return {
                "source": f"live:{self.live.name}",
                "unit": self.live.unit,
                "readings": len(self.live.times),
                "failed_readings": self.live.failed,  # each decided on the last good reading, held
                "first_failure": self.live.first_failure,
            }
        return None if self.rate is None else self.rate.describe()

    def state_dict(self) -> dict[str, Any]:
        return {
            "rate": None if self.rate is None else self.rate.state_dict(),
            "live": None if self.live is None else self.live.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.saved = state  # loaded again onto a rate that :meth:`follow` gives later
        if self.rate is not None and state.get("rate"):
            self.rate.load_state_dict(state["rate"])
        if self.live is not None and state.get("live"):
            self.live.load_state_dict(state["live"])
