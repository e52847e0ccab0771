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

A series whose dates do not cover the run (the bundled series are from 2020) is read at the same time of
year, or from a configured ``series_start`` as if the run had started then.
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

    Args:
        source: a label for reports, e.g. ``"constant"``, ``"country:DEU"``, ``"series:de_2020.csv"``.
        unit: ``"gCO2eq/kWh"`` or e.g. ``"EUR/kWh"``.
        constant: the value, for a constant rate.
        series: the series, for a varying rate.
        series_start: Unix seconds; when set, the run's first second is read at this point of the series.
        notice: called once with a one-line message when the series is read at the same time of year.
    """

    def __init__(
        self,
        source: str,
        unit: str,
        constant: float | None = None,
        series: TimeSeries | None = None,
        series_start: float | None = None,
        notice: Callable[[str], None] | None = None,
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
        self._noticed = False

    def anchor(self, run_start: float) -> None:
        """Fix the run's start (wall-clock Unix seconds) for ``series_start`` mapping; kept across resumes."""
        if self.run_start is None:
            self.run_start = float(run_start)

    def fork(self) -> Rate:
        """This rate for a reader on a clock of its own (a GreenWindow on a SimulatedClock next to an
        EnergyLogger on the system clock): the same series, unit and ``series_start``, but its own run start
        (:meth:`anchor_as`), so each reads the series at its own clock's time. A shared anchor would map one
        clock's times through the other's start: years off when one of them is simulated."""
        return Rate(self.source, self.unit, self.constant, self.series, self.series_start)

    def anchor_as(self, other: Rate, now: float, other_now: float) -> None:
        """Anchor at ``other``'s run start moved onto this reader's clock (``now`` on it is ``other_now`` on
        ``other``'s, read at the same moment): on one clock, the two read the same moment of the series. Kept
        when already anchored (a resume); at ``now`` when ``other`` has no anchor yet."""
        if self.run_start is None:
            self.anchor(now if other.run_start is None else other.run_start + (now - other_now))

    def series_time(self, wall: float) -> float:
        """Where in the series the wall-clock time ``wall`` is read."""
        assert self.series is not None
        if self.series_start is not None:
            if self.run_start is None:
                self.anchor(wall)
            return self.series_start + (wall - float(self.run_start))
        if self.series.start <= wall < self.series.end:
            return wall
        return self._same_time_of_year(wall)

    def _same_time_of_year(self, wall: float) -> float:
        series = self.series
        assert series is not None
        year = datetime.fromtimestamp(0.5 * (series.start + series.end), timezone.utc).year
        moment = datetime.fromtimestamp(wall, timezone.utc)
        try:
            moved = moment.replace(year=year)
        except ValueError:  # 29 February outside a leap year
            moved = moment.replace(year=year, day=28)
        if not self._noticed and self.notice is not None:
            self._noticed = True
            self.notice(
                f"EnergyLogger: the {self.source} series covers {format_utc(series.start)[:10]} to "
                f"{format_utc(series.end)[:10]}; the run's dates are read at the same time of year in {year}."
            )
        return min(max(moved.timestamp(), series.start), series.end)

    def mean(self, wall0: float, wall1: float) -> float:
        """Average rate over the wall-clock interval ``[wall0, wall1]``."""
        if self.constant is not None:
            return self.constant
        start = self.series_time(wall0)
        return self.series.mean(start, start + max(wall1 - wall0, 0.0))  # type: ignore[union-attr]

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
            )
        return described

    def state_dict(self) -> dict[str, Any]:
        return {"run_start": self.run_start}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("run_start") is not None:
            self.run_start = float(state["run_start"])


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
        return Rate(f"series:{series.name}", unit, series=series, series_start=start, notice=notice)
    raise ValueError(
        f"`{field}`={value!r} has type {type(value).__name__}; "
        f"expected {expected} or the path of a `timestamp,value` CSV."
    )
