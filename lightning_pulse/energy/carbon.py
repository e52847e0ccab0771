"""Carbon intensity (gCO2eq/kWh) and electricity price (per kWh), constant or varying over time.

A :class:`Rate` turns an energy interval into grams or money: ``mean(t0, t1)`` is the exact time average of
the rate over the interval (a step function integrated piecewise), so CO2 = sum over sampling intervals of
energy x mean intensity, which is energy x intensity integrated over time at constant power within an
interval. Sources:

* a constant (``float``);
* a country ISO code, through codecarbon's offline energy-mix data (:func:`carbon_intensity_from`);
* a CSV time series: header ``Time,Carbon Intensity`` (the 2020 grid series of Wiesner et al. 2021) or the
  generic ``timestamp,value``. Timestamps are ISO 8601 (naive ones are UTC) or Unix seconds; each value
  holds from its timestamp until the next one.

A run reads one continuous stretch of a series, fixed at its start: its own dates when the run starts inside
the series or reaches it within a day; else the same time of year in a year where that lies inside the series
(the bundled series are from 2020); or from a configured ``series_start`` (refused outside the series) as if
the run had started then. A reading past either end holds the series' nearest value, with one warning, and
the report records it.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

_TIME_COLUMNS = ("time", "timestamp", "datetime", "date")
_VALUE_COLUMNS = ("value", "carbon intensity", "carbon_intensity", "price")
#: a run that starts at most this long before a series reads its own dates: the series' first value stands in
#: for less than a day, where the same time of year could be the series' last hours (a run from 31 December
#: 23:00 on a series of the next calendar year) and hold its last value for the rest of the run
OWN_DATES_WITHIN_S = 24 * 3600.0


def parse_timestamp(text: str) -> float:
    """Unix seconds from ISO 8601 (naive = UTC, ``Z`` allowed) or from a number of Unix seconds."""
    text = text.strip()
    try:
        return float(text)
    except ValueError:
        pass
    moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return moment.timestamp()


def format_utc(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


class TimeSeries:
    """A step function of time: ``values[i]`` holds on ``[times[i], times[i+1])``.

    Before the first timestamp the first value holds; after the last one the last value holds.

    Args:
        times: Unix seconds, strictly increasing, shape ``(N,)``.
        values: finite, non-negative, shape ``(N,)``.
        name: where it came from, for reports.
    """

    def __init__(self, times: np.ndarray, values: np.ndarray, name: str = "series") -> None:
        times = np.asarray(times, dtype=np.float64)
        values = np.asarray(values, dtype=np.float64)
        if times.ndim != 1 or times.shape != values.shape or len(times) == 0:
            raise ValueError(f"{name}: times and values must be 1-D, of equal, non-zero length.")
        if np.any(np.diff(times) <= 0):
            raise ValueError(f"{name}: timestamps must be strictly increasing.")
        if not np.all(np.isfinite(values)) or np.any(values < 0):
            raise ValueError(f"{name}: values must be finite and non-negative.")
        self.times = times
        self.values = values
        self.name = name
        self.interval = float(np.median(np.diff(times))) if len(times) > 1 else 3600.0
        # integral of the step function from times[0] up to each timestamp
        self._cumulative = np.concatenate([[0.0], np.cumsum(values[:-1] * np.diff(times))])

    @property
    def start(self) -> float:
        return float(self.times[0])

    @property
    def end(self) -> float:
        """End of coverage: the last value holds for one typical interval."""
        return float(self.times[-1] + self.interval)

    @classmethod
    def from_csv(cls, path: str | Path, field: str = "series") -> TimeSeries:
        """Read ``Time,Carbon Intensity`` or ``timestamp,value`` CSV (header optional)."""
        path = Path(path)
        if not path.is_file():
            raise ValueError(
                f"`{field}`={str(path)!r} is not a file; expected a CSV with columns `timestamp,value`."
            )
        times: list[float] = []
        values: list[float] = []
        time_col, value_col = 0, 1
        with path.open(newline="") as handle:
            for line_number, row in enumerate(csv.reader(handle), start=1):
                if not row or all(not cell.strip() for cell in row):
                    continue
                if line_number == 1 and not _looks_numeric(row[1] if len(row) > 1 else ""):
                    names = [cell.strip().lower() for cell in row]
                    time_col = next((i for i, n in enumerate(names) if n in _TIME_COLUMNS), 0)
                    value_col = next((i for i, n in enumerate(names) if n in _VALUE_COLUMNS), 1)
                    continue
                try:
                    times.append(parse_timestamp(row[time_col]))
                    values.append(float(row[value_col]))
                except (ValueError, IndexError) as error:
                    raise ValueError(
                        f"`{field}`: {path}:{line_number} is not `timestamp,value` ({row!r}: {error})."
                    ) from error
        if not times:
            raise ValueError(f"`{field}`: {path} has no data rows.")
        try:
            return cls(np.array(times), np.array(values), name=path.name)
        except ValueError as error:
            raise ValueError(f"`{field}`: {path}: {error}") from error

    def integral(self, t: float) -> float:
        """Integral of the step function from ``times[0]`` to ``t`` (negative before the start)."""
        if t <= self.times[0]:
            return float(self.values[0] * (t - self.times[0]))
        index = int(np.searchsorted(self.times, t, side="right")) - 1
        return float(self._cumulative[index] + self.values[index] * (t - self.times[index]))

    def integrals(self, t: np.ndarray) -> np.ndarray:
        """:meth:`integral` at every point of ``t`` (any shape), in one vectorised pass."""
        t = np.asarray(t, dtype=np.float64)
        index = np.clip(np.searchsorted(self.times, t, side="right") - 1, 0, None)
        inside = self._cumulative[index] + self.values[index] * (t - self.times[index])
        return np.where(t <= self.times[0], self.values[0] * (t - self.times[0]), inside)

    def mean(self, t0: float, t1: float) -> float:
        """Time average over ``[t0, t1]``; the value at ``t0`` for an empty interval."""
        if t1 <= t0:
            return self.value_at(t0)
        return (self.integral(t1) - self.integral(t0)) / (t1 - t0)

    def value_at(self, t: float) -> float:
        index = int(np.searchsorted(self.times, t, side="right")) - 1
        return float(self.values[max(index, 0)])


def _looks_numeric(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


class Rate:
    """A per-kWh rate that is constant or follows a :class:`TimeSeries`.

    A run reads a series on one continuous stretch of it, fixed at the run's start (:meth:`anchor`): from
    ``series_start`` when set; else at the run's own dates when the start is inside the series or at most
    :data:`OWN_DATES_WITHIN_S` before it; else at the same time of year in a year where that lies inside the
    series (a whole-year shift: the series' middle year first); else, when no year does (a partial-year
    excerpt read at another season), at its own dates if the run starts before the series. A reading outside
    the series holds its nearest value (the last one after the end): no other year is stitched in, and it is
    warned once and recorded in :meth:`describe`.

    Args:
        source: a label for reports, e.g. ``"constant"``, ``"country:DEU"``, ``"series:de_2020.csv"``.
        unit: ``"gCO2eq/kWh"`` or e.g. ``"EUR/kWh"``.
        constant: the value, for a constant rate.
        series: the series, for a varying rate.
        series_start: Unix seconds; when set, the run's first second is read at this point of the series.
        notice: called once with a one-line message when the series is read at the same time of year
            (default: Lightning's ``rank_zero_info``).
        warn: called once with a one-line message when a reading holds a value outside the series
            (default: Lightning's ``rank_zero_warn``).
        reader: the callback whose messages these are.
        start_field: the setting that moves the series' start, named in the warnings.
        field: the setting this rate comes from (``carbon_intensity``, ``price_per_kwh``, ``signal``),
            named in the notice.
    """

    def __init__(
        self,
        source: str,
        unit: str,
        constant: float | None = None,
        series: TimeSeries | None = None,
        series_start: float | None = None,
        notice: Callable[[str], None] | None = None,
        warn: Callable[[str], None] | None = None,
        reader: str = "EnergyLogger",
        start_field: str = "accounting.carbon_intensity_start",
        field: str = "carbon_intensity",
    ) -> None:
        if (constant is None) == (series is None):
            raise ValueError("A Rate needs exactly one of `constant` and `series`.")
        self.source = source
        self.unit = unit
        self.constant = constant
        self.series = series
        self.series_start = series_start
        self.run_start: float | None = None
        self.notice = notice
        self.warn = warn
        self.reader = reader
        self.start_field = start_field
        self.field = field
        self._shift: tuple[float, float] | None = None  # (run_start, series time - wall time) for that start
        self.held: dict[str, dict[str, Any]] = {}  # "after" / "before" the series: the first reading held

    def anchor(self, run_start: float) -> None:
        """Fix the run's start (wall-clock Unix seconds), and with it where the run reads the series; kept
        across resumes."""
        if self.run_start is None:
            self.run_start = float(run_start)
            self.held = {}

    def fork(self, reader: str = "GreenWindow") -> Rate:
        """This rate for a reader on a clock of its own (a GreenWindow on a SimulatedClock next to an
        EnergyLogger on the system clock): the same series, unit and ``series_start``, but its own run start
        (:meth:`anchor_as`), so each reads the series at its own clock's time. A shared anchor would map one
        clock's times through the other's start: years off when one of them is simulated."""
        return Rate(
            self.source,
            self.unit,
            self.constant,
            self.series,
            self.series_start,
            self.notice,
            self.warn,
            reader,
            self.start_field,
            self.field,
        )

    def anchor_as(self, other: Rate, now: float, other_now: float) -> None:
        """Anchor at ``other``'s run start moved onto this reader's clock (``now`` on it is ``other_now`` on
        ``other``'s, read at the same moment): on one clock, the two read the same moment of the series. Kept
        when already anchored (a resume); at ``now`` when ``other`` has no anchor yet."""
        if self.run_start is None:
            self.anchor(now if other.run_start is None else other.run_start + (now - other_now))

    def series_time(self, wall: float) -> float:
        """Where in the series the wall-clock time ``wall`` is read: ``wall`` plus the run's shift."""
        return self._read(wall, wall)

    def _read(self, wall0: float, wall1: float) -> float:
        """The series time of ``wall0``; warns once when ``[wall0, wall1]`` reads outside the series."""
        series = self.series
        assert series is not None
        if self.run_start is None:
            self.anchor(wall0)
        shift = self._run_shift()
        first, last = wall0 + shift, wall1 + shift
        if last > series.end and "after" not in self.held:
            # from where the run's one stretch crosses the end, even when this reading starts later (a slot)
            crossed = max(series.end - shift, float(self.run_start))  # type: ignore[arg-type]
            self._hold("after", crossed, series.end, float(series.values[-1]))
        if first < series.start and "before" not in self.held:
            self._hold("before", wall0, series.start, float(series.values[0]))
        return first

    def _run_shift(self) -> float:
        """Series time minus wall time for this run: one value for the whole run, so the run reads one
        continuous stretch of the series (no jump at its end or at a new year)."""
        run_start = float(self.run_start)  # type: ignore[arg-type]
        if self._shift is None or self._shift[0] != run_start:
            series = self.series
            assert series is not None
            if self.series_start is not None:
                moved = self.series_start
            elif series.start <= run_start < series.end or (
                0.0 < series.start - run_start <= OWN_DATES_WITHIN_S
            ):
                moved = run_start
            else:
                moved = self._same_time_of_year(run_start)
            self._shift = (run_start, moved - run_start)
        return self._shift[1]

    def _same_time_of_year(self, wall: float) -> float:
        """Where a run starting at ``wall`` outside the series reads it: the same time of year in the series'
        middle year, else in the nearest other year it spans (or the one before or after) where that lies
        inside it (a December-February series); else, when none does, the run's own dates if they reach the
        series, else the middle year's (outside it: the held value's warning says what is read)."""
        series = self.series
        assert series is not None
        middle = datetime.fromtimestamp(0.5 * (series.start + series.end), timezone.utc).year
        first, last = (datetime.fromtimestamp(t, timezone.utc).year for t in (series.start, series.end))
        years = sorted(range(first - 1, last + 2), key=lambda year: (abs(year - middle), year))
        for year in years:
            moved = _in_year(wall, year)
            if series.start <= moved < series.end:
                (self.notice or _rank_zero_info)(
                    f"{self.reader}: `{self.field}` ({self.source}) covers {format_utc(series.start)[:10]} "
                    f"to {format_utc(series.end)[:10]}; the run's dates are read at the same time of year in "
                    f"{year}, from {format_utc(moved)} on, as one continuous stretch."
                )
                return moved
        return wall if wall < series.start else _in_year(wall, middle)

    def _hold(self, side: str, wall: float, edge: float, value: float) -> None:
        """Record and warn (once per side) that readings from ``wall`` hold the series' value at ``edge``."""
        series_time = wall + self._run_shift()
        self.held[side] = {
            "value": value,
            "from_utc": format_utc(wall),
            "series_time_utc": format_utc(series_time),
        }
        shown = f"{value:g}" if self.unit == "signal" else f"{value:g} {self.unit}"
        where = (
            f"its last value ({shown}) is held from {format_utc(wall)} on"
            if side == "after"
            else f"its first value ({shown}) is held while the run reads before it"
        )
        how = (
            f"from `{self.start_field}`"
            if self.series_start is not None
            else "at its own dates"
            if self._run_shift() == 0.0
            else "at the same time of year"
        )
        (self.warn or _rank_zero_warn)(
            f"{self.reader}: the {self.source} series {'ends' if side == 'after' else 'starts'} at "
            f"{format_utc(edge)} (UTC) and the run, read {how}, reaches {format_utc(series_time)}, "
            f"outside it: {where}; no other year is read in. Give a series that covers the run, or "
            f"`{self.start_field}` inside it."
        )

    def mean(self, wall0: float, wall1: float) -> float:
        """Average rate over the wall-clock interval ``[wall0, wall1]``."""
        if self.constant is not None:
            return self.constant
        duration = max(wall1 - wall0, 0.0)
        start = self._read(wall0, wall0 + duration)
        return self.series.mean(start, start + duration)  # type: ignore[union-attr]

    def describe(self) -> dict[str, Any]:
        described: dict[str, Any] = {"source": self.source, "unit": self.unit}
        if self.constant is not None:
            described["value"] = self.constant
        else:
            series = self.series
            assert series is not None
            described.update(
                series_from=format_utc(series.start),
                series_to=format_utc(series.end),
                series_mean=float(np.mean(series.values)),
                series_start=None if self.series_start is None else format_utc(self.series_start),
                run_start_read_at=None
                if self.run_start is None
                else format_utc(self.run_start + self._run_shift()),
                held={side: dict(held) for side, held in self.held.items()},
            )
        return described

    def state_dict(self) -> dict[str, Any]:
        return {"run_start": self.run_start, "held": {side: dict(held) for side, held in self.held.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("run_start") is not None:
            self.run_start = float(state["run_start"])
            self.held = {side: dict(held) for side, held in (state.get("held") or {}).items()}


def _in_year(wall: float, year: int) -> float:
    """The moment ``wall`` (Unix seconds) moved to ``year``, same UTC date and time (28 February for 29)."""
    moment = datetime.fromtimestamp(wall, timezone.utc)
    try:
        return moment.replace(year=year).timestamp()
    except ValueError:  # 29 February outside a leap year
        return moment.replace(year=year, day=28).timestamp()


def _rank_zero_info(message: str) -> None:
    from lightning.pytorch.utilities import rank_zero_info

    rank_zero_info(message)


def _rank_zero_warn(message: str) -> None:
    from lightning.pytorch.utilities import rank_zero_warn

    rank_zero_warn(message)


def refuse_start_outside_series(
    series: TimeSeries, start: float | None, field: str, value: Any = None
) -> None:
    """A series start outside the series would read one held value for the whole run: refused, naming
    ``field``, its value as given (``value``, else ``start`` in UTC) and the series' coverage."""
    if start is not None and not series.start <= start < series.end:
        given = format_utc(start) if value is None else value
        raise ValueError(
            f"`{field}`={given!r} is outside the series {series.name}, which covers "
            f"{format_utc(series.start)} to {format_utc(series.end)} (UTC): a run read from there would hold "
            "one value throughout. Give "
            f"a start inside that range, or leave {field} out to read the run's own dates (the same time of "
            "year when they are outside the series)."
        )


def refuse_start_without_series(start: str | None, start_field: str, why: str) -> None:
    """A series start next to a rate that is not a series would do nothing: refused, naming both."""
    if start is not None:
        raise ValueError(
            f"`accounting.{start_field}`={start!r} says where a CSV series starts, and {why}: give the series' "
            f"path, or leave {start_field} out."
        )


def parse_series_start(value: str | None, field: str) -> float | None:
    """The UTC timestamp ``value`` in seconds (``None`` stays ``None``); errors name ``field``."""
    if value is None:
        return None
    try:
        return parse_timestamp(str(value))
    except ValueError as error:
        raise ValueError(
            f"`{field}`={value!r} is not a timestamp; expected e.g. '2020-06-01 12:00:00' (UTC)."
        ) from error


def carbon_intensity_from(
    carbon_intensity: float | str | None,
    country_iso_code: str | None,
    series_start: str | None = None,
    notice: Callable[[str], None] | None = None,
) -> Rate | None:
    """The carbon-intensity :class:`Rate` of a run, or ``None`` when none was configured.

    ``carbon_intensity`` (a constant in g/kWh, or a CSV path) wins over ``country_iso_code``.

    Raises:
        ValueError: naming the argument, for a negative or non-finite constant, a missing or malformed file,
            or a country codecarbon has no data for.
    """
    unit = "gCO2eq/kWh"
    if carbon_intensity is not None:
        return _rate_from(
            carbon_intensity,
            field="carbon_intensity",
            start_field="carbon_intensity_start",
            unit=unit,
            series_start=series_start,
            notice=notice,
            kind="g/kWh",
            number="a finite g/kWh >= 0",
            expected="g/kWh (a number)",
        )
    if country_iso_code is not None:
        from lightning_pulse.energy.codecarbon_meter import country_carbon_intensity, validate_country

        code = validate_country(country_iso_code)
        refuse_start_without_series(
            series_start, "carbon_intensity_start", f"`country_iso_code`={code!r} gives a constant"
        )
        return Rate(f"country:{code}", unit, constant=country_carbon_intensity(code))
    refuse_start_without_series(series_start, "carbon_intensity_start", "no `carbon_intensity` is set")
    return None


def price_from(
    price_per_kwh: float | str | None,
    currency: str,
    series_start: str | None = None,
    notice: Callable[[str], None] | None = None,
) -> Rate | None:
    """The electricity-price :class:`Rate` (``currency`` per kWh), or ``None``.

    Raises:
        ValueError: naming ``price_per_kwh``, for a negative or non-finite constant or a bad file.
    """
    unit = f"{currency}/kWh"
    if price_per_kwh is None:
        refuse_start_without_series(series_start, "price_start", "no `price_per_kwh` is set")
        return None
    return _rate_from(
        price_per_kwh,
        field="price_per_kwh",
        start_field="price_start",
        unit=unit,
        series_start=series_start,
        notice=notice,
        kind="a price per kWh",
        number="a finite price >= 0",
        expected="a number",
    )


def _rate_from(
    value: float | str | Path,
    field: str,
    start_field: str,
    unit: str,
    series_start: str | None,
    notice: Callable[[str], None] | None,
    kind: str,
    number: str,
    expected: str,
) -> Rate:
    """A constant or CSV-series :class:`Rate` from a user value; errors name ``field``."""
    if isinstance(value, bool):
        raise ValueError(f"`{field}`={value!r} must be {kind} or a CSV path.")
    if isinstance(value, (int, float)):
        constant = float(value)
        if not math.isfinite(constant) or constant < 0:
            raise ValueError(f"`{field}`={value!r} must be {number} or a CSV path.")
        refuse_start_without_series(series_start, start_field, f"`{field}`={value!r} is a constant")
        return Rate("constant", unit, constant=constant)
    if isinstance(value, (str, Path)):
        if not Path(value).is_file():
            raise ValueError(
                f"`{field}`={str(value)!r} is neither a number nor a file; expected {number} as a number "
                f"(not a string), or the path of a CSV with columns `timestamp,value`."
            )
        series = TimeSeries.from_csv(value, field=field)
        start = parse_series_start(series_start, start_field)
        refuse_start_outside_series(series, start, f"accounting.{start_field}", series_start)
        return Rate(
            f"series:{series.name}",
            unit,
            series=series,
            series_start=start,
            notice=notice,
            start_field=f"accounting.{start_field}",
            field=field,
        )
    raise ValueError(
        f"`{field}`={value!r} has type {type(value).__name__}; "
        f"expected {expected} or the path of a `timestamp,value` CSV."
    )
