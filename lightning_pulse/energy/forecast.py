"""Forecasts of a carbon-intensity or price signal, slot by slot, from a moment ``now`` on.

Every forecast answers the same question: the mean of the signal over each slot
``[starts[i], starts[i] + slot_s)``, ``starts[0] == now``, shape ``(S,)``. The decision at ``now`` is about
the slot that starts now, so slot 0 is the value observed now (the signal's current interval), except for
the oracle.

* :class:`SeasonalBlendForecast` (the default) reads only the past: the mean of the same time of day over
  the previous ``days`` days, plus the current anomaly (observed value minus that profile's value now),
  fading with the horizon as ``exp(-h / decay_hours)``. Its two parameters were chosen on Great Britain's
  2020 series only and are reported on Germany and France (``benchmarks/green_window.py``).
* :class:`SeriesForecast` follows a forecast series the user supplies (their grid operator's, a paid API's).
* :class:`OracleForecast` reads the future of the series itself: an upper bound, for benchmarks only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from lightning_pulse.energy.carbon import TimeSeries, WrappedSeries, whole_years

DAY_S = 86400.0


def slot_means(series: TimeSeries, starts: np.ndarray, slot_s: float) -> np.ndarray:
    """Mean of ``series`` over every ``[starts[i], starts[i] + slot_s)``, shape like ``starts``."""
    starts = np.asarray(starts, dtype=np.float64)
    return (series.integrals(starts + slot_s) - series.integrals(starts)) / slot_s


@runtime_checkable
class Forecast(Protocol):
    """Predicts slot means of the signal from ``now`` on."""

    #: whether it reads the future of the series (the oracle); never allowed outside benchmarks and tests
    reads_future: bool

    def predict(self, series: TimeSeries, now: float, starts: np.ndarray, slot_s: float) -> np.ndarray:
        """Slot means over ``[starts[i], starts[i] + slot_s)``; ``series`` is the signal's history."""


class SeasonalBlendForecast:
    """Same time of day over the previous ``days`` days, plus the current anomaly fading with the horizon.

    For a slot ``h`` seconds ahead: ``profile(h) + (x_now - profile(0)) * exp(-h / decay)``, where
    ``profile(h)`` is the mean of the slots at the same time of day on the previous ``days`` days (each
    one ending before ``now``), ``profile(0)`` the same for the slot starting now and ``x_now`` the value
    observed now. With less history than ``days`` days it uses what there is; with less than one day it
    repeats the observed value. Reads ``series`` before ``now`` only (and the value holding at ``now``).

    Args:
        days: how many previous days make the daily profile (positive).
        decay_hours: the anomaly's e-folding horizon in hours (positive): the weather is persistent for a
            day or two, so the current deviation from the usual day says something about tomorrow.
    """

    reads_future = False

    def __init__(self, days: int = 21, decay_hours: float = 48.0) -> None:
        if isinstance(days, bool) or not isinstance(days, int) or days < 1:
            raise ValueError(f"`days`={days!r} must be a positive int.")
        if isinstance(decay_hours, bool) or not isinstance(decay_hours, (int, float)) or not decay_hours > 0:
            raise ValueError(f"`decay_hours`={decay_hours!r} must be a positive number of hours.")
        self.days, self.decay_hours = days, float(decay_hours)

    def predict(self, series: TimeSeries, now: float, starts: np.ndarray, slot_s: float) -> np.ndarray:
        starts = np.asarray(starts, dtype=np.float64)
        observed = series.value_at(now)
        days = min(self.days, int((now - series.start) // DAY_S))
        if days < 1:
            return np.full(starts.shape, observed)
        ahead = starts - now
        # the same time of day, pulled back into the last day; a slot that would end after `now` one day back
        offset = np.mod(ahead, DAY_S)
        first = np.where(offset > DAY_S - slot_s, 2, 1)
        back = first[None, :] + np.arange(days)[:, None]  # (days, S)
        sources = now + offset[None, :] - DAY_S * back
        profile = slot_means(series, sources, slot_s).mean(axis=0)
        profile_now = slot_means(series, now - DAY_S * np.arange(1, days + 1), slot_s).mean()
        forecast = profile + (observed - profile_now) * np.exp(-ahead / (3600.0 * self.decay_hours))
        return np.maximum(forecast, 0.0)

    def __repr__(self) -> str:
        return f"SeasonalBlendForecast(days={self.days}, decay_hours={self.decay_hours:g})"


class SeriesForecast:
    """A forecast series the user supplies: its slot means, slot 0 replaced by the value observed now.

    A signal that wraps past its end by whole years (a run read at the same time of year,
    :class:`~lightning_pulse.energy.carbon.WrappedSeries`) has its forecast read wrapped alike, when the forecast
    spans those years too; else past its end the forecast's last value holds.

    Args:
        series: the forecast, on the same time axis as the signal.
    """

    reads_future = False

    def __init__(self, series: TimeSeries) -> None:
        self.series = series
        self._wrapped: dict[int, TimeSeries] = {}  # the forecast wrapped by so many years, built once

    def predict(self, series: TimeSeries, now: float, starts: np.ndarray, slot_s: float) -> np.ndarray:
        forecast = slot_means(self._read_as(series), starts, slot_s)
        forecast[0] = series.value_at(now)
        return forecast

    def _read_as(self, signal: TimeSeries) -> TimeSeries:
        """The forecast as the run reads ``signal``: wrapped by the same whole years where it spans them (a
        flat held value against a signal that goes on into January had steered every decision past the end)."""
        if not isinstance(signal, WrappedSeries) or whole_years(self.series) < signal.years:
            return self.series
        if signal.years not in self._wrapped:
            self._wrapped[signal.years] = WrappedSeries(self.series, signal.years)
        return self._wrapped[signal.years]

    def __repr__(self) -> str:
        return f"SeriesForecast({self.series.name})"


class OracleForecast:
    """The signal's own future: what a perfect forecast would say. Benchmarks and tests only."""

    reads_future = True

    def predict(self, series: TimeSeries, now: float, starts: np.ndarray, slot_s: float) -> np.ndarray:
        return slot_means(series, starts, slot_s)

    def __repr__(self) -> str:
        return "OracleForecast()"


FORECAST_NAMES = ("seasonal",)


def forecast_from(value: Any, field: str = "forecast") -> Forecast:
    """``"seasonal"`` (the default forecast), the path of a forecast CSV/JSON series, or a :class:`Forecast`.

    Raises:
        ValueError: naming ``field``, for an unknown name, an unreadable file or an object that is no forecast.
    """
    if isinstance(value, Forecast):
        return value
    if isinstance(value, str) and value in FORECAST_NAMES:
        return SeasonalBlendForecast()
    if isinstance(value, (str, Path)) and Path(value).suffix.lower() in (".csv", ".json"):
        from lightning_pulse.energy.signal import series_signal

        return SeriesForecast(series_signal(value, field).series)  # type: ignore[arg-type]
    raise ValueError(
        f"`{field}`={value!r} is not accepted; expected {list(FORECAST_NAMES)}, the path of a forecast "
        "series (.csv or .json), or an object with `predict(series, now, starts, slot_s)`."
    )


def forecast_error(
    series: TimeSeries,
    forecast: Forecast,
    origins: Sequence[float],
    horizons_h: Sequence[int],
    slot_s: float = 3600.0,
) -> dict[str, dict[str, float]]:
    """MAE and MAPE of ``forecast`` against the series' own slot means, by horizon.

    At every origin the forecast predicts the slots ``1..max(horizons_h)`` hours ahead (``slot_s`` wide);
    horizon ``h`` compares the slot starting ``h`` hours after the origin with what happened.

    Returns:
        ``{"<h>h": {"mae": ..., "mape_pct": ..., "n": ...}}``, MAPE over slots whose true mean is positive.
    """
    steps = int(round(3600.0 / slot_s))
    longest = max(horizons_h) * steps
    errors: dict[int, list[float]] = {h: [] for h in horizons_h}
    relative: dict[int, list[float]] = {h: [] for h in horizons_h}
    for origin in origins:
        starts = origin + slot_s * np.arange(longest + 1)
        predicted = forecast.predict(series, float(origin), starts, slot_s)
        actual = slot_means(series, starts, slot_s)
        for h in horizons_h:
            i = h * steps
            errors[h].append(abs(predicted[i] - actual[i]))
            if actual[i] > 0:
                relative[h].append(abs(predicted[i] - actual[i]) / actual[i])
    return {
        f"{h}h": {
            "mae": float(np.mean(errors[h])),
            "mape_pct": float(100.0 * np.mean(relative[h])) if relative[h] else math.nan,
            "n": len(errors[h]),
        }
        for h in horizons_h
    }
