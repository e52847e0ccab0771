"""Carbon intensity (gCO2eq/kWh) and electricity price (per kWh), constant or varying over time.

A :class:`Rate` turns an energy interval into grams or money: ``mean(t0, t1)`` is the exact time average of
the rate over the interval (a step function integrated piecewise), so CO2 = sum over sampling intervals of
energy x mean intensity, which is energy x intensity integrated over time at constant power within an
interval. Sources:

* a constant (``float``);
* a country ISO code, through codecarbon's offline energy-mix data (:func:`carbon_intensity_from`);
* a CSV time series: header ``Time,Carbon Intensity`` (the 2020 grid series of Wiesner et al. 2021) or the
  generic ``timestamp,value``. Timestamps are ISO 8601 (naive ones are UTC) or Unix seconds, from 1900 to
  2199 (:data:`EARLIEST_TIME`, :data:`LATEST_TIME`: Unix milliseconds are refused, with a hint, and so is a
  file whose every timestamp spells a compact date, ``2020061500``: :func:`compact_dates_refusal`); each value
  holds from its timestamp until the next one. A row has at most as many cells as the header (two without
  one): an extra cell is refused, as a decimal comma (``0,31``) would lose its decimals, and so is a row that
  fills a header's unnamed column with what looks like a decimal comma's half or the row's timestamp.

A run reads one continuous stretch of a series, fixed at its start: its own dates when the run starts inside
the series or reaches it within a day; else the same time of year in a year where that lies inside the series
(the bundled series are from 2020); or from a configured ``series_start`` (refused outside the series) as if
the run had started then. A run read at the same time of year on a series of at least one whole year goes on
past its end a whole number of years back (:class:`WrappedSeries`: 2021-01-01 reads 2020-01-01 on a 2020
series). Any other reading past either end holds the series' nearest value, with one warning, and the report
records it.
"""

from __future__ import annotations

import codecs
import csv
import io
import math
import re
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
#: a step between two rows longer than this many times the series' median spacing is a gap: rows are missing
#: there, and the value before it holds across it. The 2020 grid series have steps of up to twice their median
#: (``de_2020.csv``: two 30-min steps in a 15-min series; ``gb_2020.csv`` mixes 15 and 30 min), which are not
#: gaps. A series whose spacing changes (hourly, then 15-min rows) reads its longer steps as gaps.
GAP_FACTOR = 2.0
GAPS_RECORDED = 20  # the report's `gaps` lists the first ones; `gap_count` counts them all
#: a series' times (and a live signal's) lie from 1900-01-01 up to 2200-01-01 (UTC): no grid or price data is
#: older, none is that far ahead, and a number outside is in another unit (Unix milliseconds read as seconds
#: are the year 52000; a compact ``202006150000`` is the year 8371), which read as seconds failed at fit start
EARLIEST_TIME = -2208988800.0
LATEST_TIME = 7258118400.0
DATED_RANGE = "1900-01-01 to 2200-01-01 (UTC)"
_YEAR_S = 365.2425 * 24 * 3600  # the mean Gregorian year, for a year no datetime can hold
_EPOCH_UNITS = (("milliseconds", "1000"), ("microseconds", "1e6"), ("nanoseconds", "1e9"))
_LIKELY_FROM, _LIKELY_TO = 631152000.0, 4102444800.0  # 1990-01-01, 2100-01-01: where a hint's reading lands
#: compact calendar stamps by their number of digits. The 8- and 10-digit ones are inside DATED_RANGE as Unix
#: seconds (``2020061500`` s is 2034-01-05, ``20200615`` s is 1970-08-22), so a file of them is refused as a
#: whole (:func:`compact_dates_refusal`); the 12- and 14-digit ones are outside it and refused row by row
_COMPACT_PATTERNS = {8: "YYYYMMDD", 10: "YYYYMMDDHH", 12: "YYYYMMDDHHMM", 14: "YYYYMMDDHHMMSS"}


def parse_timestamp(text: str) -> float:
    """Unix seconds from ISO 8601 (naive = UTC, ``Z`` allowed) or from a number of Unix seconds."""
    text = text.strip()
    try:
        seconds = float(text)
    except ValueError:
        pass
    else:
        if not math.isfinite(seconds):
            raise ValueError(f"{text!r} is not a finite number of Unix seconds")
        return seconds
    moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return moment.timestamp()


def format_utc(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def is_dated(seconds: float) -> bool:
    """Whether Unix ``seconds`` lie in :data:`DATED_RANGE`: a date a series or a live reading can have."""
    return EARLIEST_TIME <= seconds < LATEST_TIME


def time_described(seconds: float) -> str:
    """Unix ``seconds`` as a UTC time, or, outside :data:`DATED_RANGE`, as the year they reach."""
    if is_dated(seconds):
        return f"{format_utc(seconds)} UTC"
    return f"{seconds:.6g} Unix seconds, about the year {int(1970 + seconds // _YEAR_S)}"


def compact_date(seconds: float) -> datetime | None:
    """The calendar time a whole number's digits spell as a compact stamp (:data:`_COMPACT_PATTERNS`:
    ``YYYYMMDD[HH[MM[SS]]]``, a year from 1900 to 2199): ``2020061500`` is 2020-06-15 00:00; ``None`` when
    they spell none (a month 13, an hour 24, another number of digits)."""
    if not (math.isfinite(seconds) and float(seconds).is_integer()):
        return None
    digits = f"{seconds:.0f}"
    if len(digits) not in _COMPACT_PATTERNS or not "1900" <= digits[:4] < "2200":
        return None
    try:
        return datetime(int(digits[:4]), *(int(digits[i : i + 2]) for i in range(4, len(digits), 2)))
    except ValueError:
        return None


def other_unit_hint(seconds: float) -> tuple[str, str] | None:
    """What a time outside :data:`DATED_RANGE` (or a live reading far ahead) probably is, and how to write
    it: a compact date (``202006150000``), or Unix milliseconds, microseconds or nanoseconds; ``None`` when
    nothing fits."""
    moment = compact_date(seconds)
    if moment is not None:
        return "a compact date", f"write '{moment:%Y-%m-%d %H:%M:%S}'"
    for unit, per_second in _EPOCH_UNITS:
        scaled = seconds / float(per_second)
        if _LIKELY_FROM <= scaled < _LIKELY_TO:
            return f"Unix {unit}", f"divide by {per_second} ({format_utc(scaled)} UTC)"
    return None


def _undated_text(seconds: float) -> str:
    """Why a time outside :data:`DATED_RANGE` is refused, and what is allowed."""
    hint = other_unit_hint(seconds)
    return (
        f"reads as {time_described(seconds)}, outside {DATED_RANGE}"
        + (f", and looks like {hint[0]}" if hint else "")
        + "; timestamps are ISO 8601 (naive ones are UTC) or Unix seconds"
        + (f": {hint[1]}" if hint else "")
    )


def compact_dates_refusal(times: np.ndarray, every: str) -> str | None:
    """Why a series read from text (a CSV, a JSON file, pairs) is refused at its first time when every time
    lies in :data:`DATED_RANGE` and spells a compact date (:func:`compact_date`); ``None`` when one does not.

    A series of real Unix seconds spells dates row after row for at most 11 rows at a 5-min step, 4 at 15
    min, 2 at 30 min, 1 hourly (docs/energy.md). Live readings and a :class:`TimeSeries` built in Python are
    not checked: one reading of whole Unix seconds in the 2030s can spell a date. ``every`` names the rows
    (``timestamp of the file``, ``item``).

    Args:
        times: Unix seconds, shape ``(N,)``.
    """
    # stops at the first time that spells no compact date: the first one, for ISO or Unix-second series
    if not all(is_dated(t) and compact_date(t) is not None for t in times):
        return None
    seconds = float(times[0])
    moment = compact_date(seconds)
    assert moment is not None
    pattern = _COMPACT_PATTERNS[len(f"{seconds:.0f}")]
    return (
        f"reads as {time_described(seconds)} in Unix seconds, and as {moment:%Y-%m-%d %H:%M:%S} in a "
        f"compact {pattern} date, as every {every} does: a series of Unix seconds almost never spells dates "
        "row after row, so it is refused, not guessed; timestamps are ISO 8601 (naive ones are UTC) or Unix "
        f"seconds: write '{moment:%Y-%m-%d %H:%M:%S}' (and Unix seconds that spell dates as ISO 8601 too)"
    )


def _first_invalid_row(times: np.ndarray, values: np.ndarray) -> tuple[int, str] | None:
    """The index of the first row of a series that breaks its rules, and the rule: ``"date"`` (its timestamp
    is finite and outside :data:`DATED_RANGE`), ``"order"`` (its timestamp is not after the one before, or not
    finite) or ``"value"`` (not finite, or negative); ``None``: all valid.

    Args:
        times: Unix seconds, shape ``(N,)``.
        values: shape ``(N,)``.
    """
    late = np.flatnonzero(~(np.diff(times) > 0)) + 1  # `~(> 0)` also catches a NaN timestamp
    bad = np.flatnonzero(~np.isfinite(values) | (values < 0))
    undated = np.flatnonzero(np.isfinite(times) & ((times < EARLIEST_TIME) | (times >= LATEST_TIME)))
    found = [(int(undated[0]), "date")] if undated.size else []
    found += [(int(late[0]), "order")] if late.size else []
    found += [(int(bad[0]), "value")] if bad.size else []
    return min(found) if found else None


def _moment(seconds: float) -> str:
    return time_described(seconds) if math.isfinite(seconds) else repr(float(seconds))


def _dated(text: str, seconds: float) -> str:
    """A timestamp as the file wrote it, with its UTC time where that reads differently (an offset, Unix
    seconds): two rows that look apart can be the same instant."""
    utc = _moment(seconds)
    return repr(text) if f"{text} UTC" == utc else f"{text!r} ({utc})"


#: byte-order marks and the codec that reads past each; UTF-32 LE's first (it starts with UTF-16 LE's)
_BOMS = (
    (codecs.BOM_UTF32_LE, "UTF-32 LE", "utf-32"),
    (codecs.BOM_UTF32_BE, "UTF-32 BE", "utf-32"),
    (codecs.BOM_UTF8, "UTF-8", "utf-8-sig"),  # Excel's "CSV UTF-8", PowerShell 5.1's `-Encoding utf8`
    (codecs.BOM_UTF16_LE, "UTF-16 LE", "utf-16"),  # PowerShell 5.1's `>`, Excel's "Unicode Text"
    (codecs.BOM_UTF16_BE, "UTF-16 BE", "utf-16"),
)


def _save_as_utf8(path: Path) -> str:
    """The way out for a series file that is not UTF-8 text."""
    excel = 'Excel: Save As "CSV UTF-8"; ' if path.suffix.lower() != ".json" else ""
    return (
        f"save it as UTF-8 ({excel}PowerShell: `Out-File -Encoding utf8` rather than `>`; an editor: "
        "encoding UTF-8); UTF-16 and UTF-32 are read when they start with their byte-order mark"
    )


def read_series_text(path: Path, field: str) -> str:
    """The text of a series file: UTF-8, or UTF-16 or UTF-32 that starts with its byte-order mark (the mark
    is skipped, as UTF-8's is). Any other file (a Windows code page such as cp1252, UTF-16 without its mark)
    is refused, naming ``field``, the file and the encoding its bytes suggest: the decoding error reached the
    user bare.

    Raises:
        OSError: the file cannot be read.
        ValueError: the file is not UTF-8 text (nor UTF-16 or UTF-32 with its mark); the message starts with
            ``field``, and the callers put the callback's name before it.
    """
    data = path.read_bytes()
    for bom, name, codec in _BOMS:
        if data.startswith(bom):
            try:
                return data.decode(codec)
            except UnicodeDecodeError as error:
                raise ValueError(
                    f"`{field}`: {path} starts with the byte-order mark of {name}, and its bytes from "
                    f"{error.start} on do not decode as {name} ({error.reason}); {_save_as_utf8(path)}."
                ) from None
    if b"\x00" in data:  # UTF-8 text has none; UTF-16 or UTF-32 of ASCII text has one or three per character
        raise ValueError(f"`{field}`: {path} is not UTF-8: {_nul_encoding(data)}; {_save_as_utf8(path)}.")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        start = max(data.rfind(b"\n", 0, error.start) + 1, error.start - 40)
        near = data[start : error.start + 1].decode("utf-8", "backslashreplace")
        raise ValueError(
            f"`{field}`: {path}:{line} is not UTF-8: byte 0x{data[error.start]:02x} (at '{near}') does not "
            f"decode, as in a file saved in a Windows code page such as cp1252; {_save_as_utf8(path)}."
        ) from None


def _nul_encoding(data: bytes) -> str:
    """What a file's NUL bytes say of its encoding: UTF-16 or UTF-32 without a byte-order mark, by where
    they fall in each code unit (ASCII text in UTF-16 LE: every second byte, from the second), or binary."""
    for width, name in ((4, "UTF-32"), (2, "UTF-16")):
        units = [data[i : i + width] for i in range(0, len(data) - len(data) % width, width)]
        if len(units) < 2:
            continue
        zero = b"\x00" * (width - 1)
        if sum(unit.endswith(zero) for unit in units) >= 0.9 * len(units):
            return f"its NUL bytes follow each character, as {name} LE without a byte-order mark writes them"
        if sum(unit.startswith(zero) for unit in units) >= 0.9 * len(units):
            return f"its NUL bytes precede each character, as {name} BE without a byte-order mark writes them"
    return f"it has NUL bytes (the first at byte {data.index(0)}), which no UTF-8 text has"


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
        invalid = _first_invalid_row(times, values)
        if invalid is not None:
            row, rule = invalid
            if rule == "date":
                raise ValueError(f"{name}: item {row} ({float(times[row])!r}) {_undated_text(times[row])}.")
            if rule == "order":
                raise ValueError(
                    f"{name}: item {row} ({_moment(times[row])}) is not after item {row - 1} "
                    f"({_moment(times[row - 1])}); timestamps must be strictly increasing."
                )
            raise ValueError(f"{name}: item {row} ({float(values[row])!r}) must be finite and non-negative.")
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
        """Read ``Time,Carbon Intensity`` or ``timestamp,value`` CSV (header optional), or the same separated
        by tabs (Excel's "Unicode Text", a TSV): see :func:`_delimiter`."""
        path = Path(path)
        if not path.is_file():
            raise ValueError(
                f"`{field}`={str(path)!r} is not a file; expected a CSV with columns `timestamp,value`."
            )
        times: list[float] = []
        values: list[float] = []
        rows: list[tuple[int, str, str]] = []  # (line number, timestamp text, value text) of each data row
        time_col, value_col = 0, 1
        header: list[str] | None = None
        unnamed: list[int] = []  # the header's unnamed columns other than the time and value ones
        text = read_series_text(path, field)
        delimiter = _delimiter(text)
        shape = "`timestamp,value`" if delimiter == "," else "`timestamp<tab>value`"
        with io.StringIO(text, newline="") as handle:
            for line_number, row in enumerate(csv.reader(handle, delimiter=delimiter), start=1):
                if not row or all(not cell.strip() for cell in row):
                    continue
                # the first row that is not blank (a blank line can come before the header)
                if header is None and not rows and not _looks_numeric(row[1] if len(row) > 1 else ""):
                    header = list(row)  # its unnamed cells too: a column of notes the rows fill
                    names = [cell.strip().lower() for cell in row]
                    time_col = next((i for i, n in enumerate(names) if n in _TIME_COLUMNS), 0)
                    value_col = next((i for i, n in enumerate(names) if n in _VALUE_COLUMNS), 1)
                    unnamed = [i for i, n in enumerate(names) if not n and i not in (time_col, value_col)]
                    continue
                if len(_filled(row)) > (2 if header is None else len(header)):
                    raise ValueError(
                        f"`{field}`: {path}:{line_number}: {_extra_cells(row, header, value_col)}."
                    )
                misread = (
                    _misaligned(row, header, unnamed, time_col, value_col) if header and unnamed else None
                )
                if misread:
                    raise ValueError(f"`{field}`: {path}:{line_number}: {misread}.")
                try:
                    times.append(parse_timestamp(row[time_col]))
                    values.append(float(row[value_col]))
                except (ValueError, IndexError) as error:
                    hint = f"; {_SEMICOLONS}" if any(";" in cell for cell in row) else ""
                    if delimiter == "\t" and (comma := _comma_in_number(row, value_col)):
                        hint = f"; {comma}"
                    raise ValueError(
                        f"`{field}`: {path}:{line_number} is not {shape} ({row!r}: {error}){hint}."
                    ) from error
                rows.append((line_number, row[time_col].strip(), row[value_col].strip()))
        if not times:
            raise ValueError(f"`{field}`: {path} has no data rows.")
        time_array, value_array = np.array(times), np.array(values)
        compact = compact_dates_refusal(time_array, "timestamp of the file")
        if compact is not None:
            raise ValueError(f"`{field}`: {path}:{rows[0][0]}: timestamp {rows[0][1]!r} {compact}.")
        # checked here rather than in __init__, so the message names the file once and the line of the row
        invalid = _first_invalid_row(time_array, value_array)
        if invalid is not None:
            index, rule = invalid
            line, moment, value = rows[index]
            if rule == "date":
                raise ValueError(
                    f"`{field}`: {path}:{line}: timestamp {moment!r} {_undated_text(times[index])}."
                )
            if rule == "order":
                before_line, before, _ = rows[index - 1]
                raise ValueError(
                    f"`{field}`: {path}:{line}: timestamp {_dated(moment, times[index])} is not after line "
                    f"{before_line}'s {_dated(before, times[index - 1])}; timestamps must be strictly "
                    "increasing."
                )
            raise ValueError(f"`{field}`: {path}:{line}: value {value!r} must be finite and non-negative.")
        return cls(time_array, value_array, name=path.name)

    def gaps(self) -> list[dict[str, Any]]:
        """The steps longer than :data:`GAP_FACTOR` times the median spacing (:attr:`interval`), first to
        last: the last row before each (``from_utc``), the first row after it (``to_utc``), its ``hours`` and
        the ``value`` held across it."""
        steps = np.diff(self.times)
        found = np.flatnonzero(steps > GAP_FACTOR * self.interval * (1 + 1e-9))
        return [
            {
                "from_utc": format_utc(self.times[i]),
                "to_utc": format_utc(self.times[i + 1]),
                "hours": float(steps[i]) / 3600,
                "value": float(self.values[i]),
            }
            for i in found
        ]

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


class WrappedSeries(TimeSeries):
    """``series`` read on past its end at the same time of year: a time ``t`` at or after the end reads
    ``t - k * period``, ``k`` the fewest periods that bring it back inside, ``period`` the series' span
    rounded down to ``years`` whole calendar years from its start (2020-01-01 to 2021-01-01: 366 days). On a
    series of whole years, past the end it goes on at the start. Before the start the first value holds, as
    in a :class:`TimeSeries`.

    The integral is periodic past the end, ``integral(t) = k * lap + integral(t - k * period)`` with ``lap``
    the integral over the series' last ``period``: a run of any length reads it with no copy of the data.

    Args:
        series: the series, at least ``years`` long (:func:`whole_years`).
        years: whole calendar years from the series' start, positive.
    """

    def __init__(self, series: TimeSeries, years: int) -> None:
        super().__init__(series.times, series.values, series.name)
        self.years = years
        self.wraps_at = series.end
        self.period = _in_year(series.start, _year_of(series.start) + years) - series.start
        self.lap = series.integral(self.wraps_at) - series.integral(self.wraps_at - self.period)

    @property
    def end(self) -> float:
        """No end: the series goes on, a whole number of years back."""
        return math.inf

    def _laps(self, t: np.ndarray | float) -> np.ndarray:
        """How many periods back ``t`` is read: none before the series' end."""
        return np.maximum(
            np.floor((np.asarray(t, dtype=np.float64) - self.wraps_at) / self.period) + 1.0, 0.0
        )

    def integral(self, t: float) -> float:
        laps = float(self._laps(t))
        return laps * self.lap + super().integral(t - laps * self.period)

    def integrals(self, t: np.ndarray) -> np.ndarray:
        t = np.asarray(t, dtype=np.float64)
        laps = self._laps(t)
        return laps * self.lap + super().integrals(t - laps * self.period)

    def value_at(self, t: float) -> float:
        return super().value_at(t - float(self._laps(t)) * self.period)


def whole_years(series: TimeSeries) -> int:
    """The series' span in whole calendar years from its start (0 for a partial-year excerpt)."""
    first = _year_of(series.start)
    years = 0
    while _in_year(series.start, first + years + 1) <= series.end:
        years += 1
    return years


def _filled(row: list[str]) -> list[str]:
    """A CSV row without its trailing empty cells (a trailing comma adds one)."""
    while row and not row[-1].strip():
        row = row[:-1]
    return row


#: the way out for a row whose cells are separated by semicolons (never read: one cell to a comma reader)
_SEMICOLONS = (
    "its cells look separated by ';', as a spreadsheet in a decimal-comma locale exports them: write commas "
    "between cells and a decimal point (2020-06-15 00:00:00,123.4)"
)


def _delimiter(text: str) -> str:
    """The cell separator of a series file: a tab where its first row that is not blank holds more cells
    (two or more) split at tabs than at commas, as Excel's "Unicode Text" and TSV files do (a timestamp or a
    number never holds a tab); else a comma. A ``;``-separated file is not read: it comes from a
    decimal-comma locale, whose numbers (``123,4``, ``1.234,5``) do not read one way; it is refused, naming
    the separator (``_SEMICOLONS``)."""
    first = next((line for line in text.splitlines() if line.strip()), "")
    tabs = sum(1 for cell in first.split("\t") if cell.strip())
    return "\t" if tabs >= 2 and tabs >= sum(1 for cell in first.split(",") if cell.strip()) else ","


def _comma_in_number(row: list[str], col: int) -> str | None:
    """The way out when cell ``col`` of a tab-separated row is a number written with a comma (``123,4``,
    ``1,234``), which reads either way; ``None`` when it is not."""
    cell = row[col].strip() if 0 <= col < len(row) else ""
    if not re.fullmatch(r"[-+]?\d+(,\d+)+", cell):
        return None
    decimal = f"{cell.replace(',', '.')} where it is a decimal comma, " if cell.count(",") == 1 else ""
    return (
        f"its value {cell!r} holds a comma: write {decimal}{cell.replace(',', '')} where it separates "
        "thousands (numbers take a decimal point and no separator)"
    )


def _decimal_comma(row: list[str], first: int) -> str | None:
    """The way out when cells ``first`` and ``first + 1`` of ``row`` look like one number split at a decimal
    comma (``0`` and ``31`` of ``0,31``); ``None`` when they do not."""
    whole = row[first].strip() if 0 <= first < len(row) else ""
    decimals = row[first + 1].strip() if 0 <= first + 1 < len(row) else ""
    if not (re.fullmatch(r"[-+]?\d+", whole) and re.fullmatch(r"\d+", decimals)):
        return None
    return f"{whole},{decimals} looks like a decimal comma: write {whole}.{decimals} (commas separate cells)"


def _misaligned(
    row: list[str], header: list[str], unnamed: list[int], time_col: int, value_col: int
) -> str | None:
    """Why a row of a file whose header has unnamed columns (``unnamed``: a notes column, a pandas index)
    would not be read as the header says, or ``None``. A decimal comma (``123,4``) adds a cell, so a row that
    leaves an unnamed column empty or out has as many cells as the header and no extra cell to refuse: the
    number's halves are read as the value and the unnamed cell next to it (123), or the value is shifted (4),
    or the row's timestamp lands in the unnamed column and the time column reads a number as Unix seconds."""

    def under(col: int) -> str:
        return (
            f"under {header[col].strip()!r}" if header[col].strip() else f"under its unnamed column {col + 1}"
        )

    for col in unnamed:
        if max(col, time_col) >= len(row):
            continue
        stamp = row[col].strip()
        if not _looks_numeric(stamp) and _looks_numeric(row[time_col]) and _is_timestamp(stamp):
            comma = next(filter(None, (_decimal_comma(row, i) for i in range(len(row)) if i != col)), None)
            return (
                f"the row {row!r} has its timestamp {stamp!r} {under(col)} and {row[time_col].strip()!r} "
                f"{under(time_col)} of the header {header!r}: its cells do not line up with the header"
                + (f"; {comma}" if comma else "")
                + "; give every row the header's columns (a pandas index too), or a header that names only "
                + "them"
            )
        if abs(col - value_col) == 1:
            first = min(col, value_col)
            comma = _decimal_comma(row, first)
            if comma:
                halves = f"{row[first].strip()!r} {under(first)} and {row[first + 1].strip()!r}"
                return (
                    f"the row {row!r} has {halves} {under(first + 1)} of the header {header!r}, and would be "
                    f"read as the value {row[value_col].strip()}; {comma}, or name the unnamed column in the "
                    "header if it holds notes (`note`)"
                )
    return None


def _is_timestamp(text: str) -> bool:
    try:
        parse_timestamp(text)
    except ValueError:
        return False
    return True


def _extra_cells(row: list[str], header: list[str] | None, value_col: int) -> str:
    """Why a data row with more cells than the header (two without one) is refused: its extra cells would be
    dropped, a decimal comma's decimals with them (``0,31`` read as 0)."""
    shape = f"the header's {len(header)} ({header!r})" if header is not None else "2 (`timestamp,value`)"
    way_out = _decimal_comma(row, value_col) or (
        _SEMICOLONS
        if any(";" in cell for cell in row)
        else "give each row one cell per column, and a header that names them all"
    )
    return (
        f"the row {row!r} has {len(_filled(row))} cells, more than {shape}: its extra cells would be "
        f"dropped; {way_out}"
    )


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
    excerpt read at another season), at its own dates if the run starts before the series. A run read at the
    same time of year on a series of at least one whole year wraps past its end by whole years
    (:class:`WrappedSeries`, :attr:`run_series`), said in the notice and in :meth:`describe`. Any other
    reading outside the series holds its nearest value (the last one after the end): no other year is
    stitched in, and it is warned once and recorded in :meth:`describe`.

    Args:
        source: a label for reports, e.g. ``"constant"``, ``"country:DEU"``, ``"series:de_2020.csv"``.
        unit: ``"gCO2eq/kWh"`` or e.g. ``"EUR/kWh"``.
        constant: the value, for a constant rate.
        series: the series, for a varying rate.
        series_start: Unix seconds; when set, the run's first second is read at this point of the series.
        notice: called once with a one-line message when the series is read at the same time of year, saying
            whether it wraps (default: Lightning's ``rank_zero_info``).
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
        # (run_start, series time - wall time, the series as read) for that start
        self._reading: tuple[float, float, TimeSeries] | None = None
        self.held: dict[str, dict[str, Any]] = {}  # "after" / "before" the series: the first reading held
        self.gaps = [] if series is None else series.gaps()  # rows missing inside the series (GAP_FACTOR)

    def warn_gaps(self, where: str) -> None:
        """Warn once, at load, when the series has gaps (:meth:`TimeSeries.gaps`): ``where`` names the file
        (or the list) they are in. The report's block records them under ``gaps``."""
        if not self.gaps:
            return
        series = self.series
        assert series is not None
        first = self.gaps[0]
        shown = f"{first['value']:g}" if self.unit == "signal" else f"{first['value']:g} {self.unit}"
        more = f" (the first of {len(self.gaps)})" if len(self.gaps) > 1 else ""
        plural = "s" if len(self.gaps) > 1 else ""
        spacing = (
            f"{series.interval / 60:g} min" if series.interval < 3600 else f"{series.interval / 3600:g} h"
        )
        (self.warn or _rank_zero_warn)(
            f"{self.reader}: `{self.field}` {where} has {len(self.gaps)} gap"
            f"{plural} longer than {GAP_FACTOR:g}x its usual {spacing} between rows: "
            f"no rows from {first['from_utc']} to {first['to_utc']} (UTC), {first['hours']:.1f} h{more}; "
            f"the value before a gap ({shown} there) is held across it, as if measured. Fill the missing "
            "rows, or give a series without gaps; the report records them under `gaps`."
        )

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

    @property
    def run_series(self) -> TimeSeries | None:
        """The series as this run reads it: a :class:`WrappedSeries` when the run wraps past the series' end,
        else :attr:`series` (also before :meth:`anchor`, and for a constant)."""
        if self.series is None or self.run_start is None:
            return self.series
        return self._run_reading()[1]

    def series_time(self, wall: float) -> float:
        """Where in the series the wall-clock time ``wall`` is read: ``wall`` plus the run's shift."""
        return self._read(wall, wall)

    def _read(self, wall0: float, wall1: float) -> float:
        """The series time of ``wall0``; warns once when ``[wall0, wall1]`` reads outside the series."""
        assert self.series is not None
        if self.run_start is None:
            self.anchor(wall0)
        shift, series = self._run_reading()  # a wrapping run's series has no end
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
        return self._run_reading()[0]

    def _run_reading(self) -> tuple[float, TimeSeries]:
        """The run's shift (:meth:`_run_shift`) and the series as it reads it (:attr:`run_series`)."""
        run_start = float(self.run_start)  # type: ignore[arg-type]
        if self._reading is None or self._reading[0] != run_start:
            series = self.series
            assert series is not None
            read = series
            if self.series_start is not None:
                moved = self.series_start
            elif series.start <= run_start < series.end or (
                0.0 < series.start - run_start <= OWN_DATES_WITHIN_S
            ):
                moved = run_start
            else:
                moved, read = self._same_time_of_year(run_start)
            self._reading = (run_start, moved - run_start, read)
        return self._reading[1], self._reading[2]

    def _same_time_of_year(self, wall: float) -> tuple[float, TimeSeries]:
        """Where a run starting at ``wall`` outside the series reads it, and the series as it reads it: the
        same time of year in the series' middle year, else in the nearest other year it spans (or the one
        before or after) where that lies inside it (a December-February series), wrapping past the end by
        whole years when the series spans one or more; else, when no year does, the run's own dates if they
        reach the series, else the middle year's (outside it: the held value's warning says what is read)."""
        series = self.series
        assert series is not None
        middle = _year_of(0.5 * (series.start + series.end))
        first, last = _year_of(series.start), _year_of(series.end)
        years = sorted(range(first - 1, last + 2), key=lambda year: (abs(year - middle), year))
        for year in years:
            moved = _in_year(wall, year)
            if series.start <= moved < series.end:
                read, wrapping = series, ""
                whole = whole_years(series)
                if whole:
                    read = WrappedSeries(series, whole)
                    back = format_utc(read.wraps_at - read.period)
                    wrapping = (
                        f", wrapping at its end to {back} ({whole} year{'s' if whole > 1 else ''} back)"
                    )
                (self.notice or _rank_zero_info)(
                    f"{self.reader}: `{self.field}` ({self.source}) covers {format_utc(series.start)[:10]} "
                    f"to {format_utc(series.end)[:10]}; the run's dates are read at the same time of year in "
                    f"{year}, from {format_utc(moved)} on, as one continuous stretch{wrapping}."
                )
                return moved, read
        return (wall if wall < series.start else _in_year(wall, middle)), series

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
        return self._run_reading()[1].mean(start, start + duration)

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
                wraps=_wrap_described(self.run_series),  # type: ignore[arg-type]
                gaps=[dict(gap) for gap in self.gaps[:GAPS_RECORDED]],
                gap_count=len(self.gaps),
            )
        return described

    def state_dict(self) -> dict[str, Any]:
        return {"run_start": self.run_start, "held": {side: dict(held) for side, held in self.held.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("run_start") is not None:
            self.run_start = float(state["run_start"])
            self.held = {side: dict(held) for side, held in (state.get("held") or {}).items()}


def _wrap_described(read: TimeSeries) -> dict[str, Any] | None:
    """Where a wrapping run goes on past the series' end (series times); ``None`` when it does not wrap."""
    if not isinstance(read, WrappedSeries):
        return None
    return {
        "at_utc": format_utc(read.wraps_at),
        "to_utc": format_utc(read.wraps_at - read.period),
        "years": read.years,
    }


def _year_of(seconds: float) -> int:
    return datetime.fromtimestamp(seconds, timezone.utc).year


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
        rate = Rate(
            f"series:{series.name}",
            unit,
            series=series,
            series_start=start,
            notice=notice,
            start_field=f"accounting.{start_field}",
            field=field,
        )
        rate.warn_gaps(repr(str(value)))
        return rate
    raise ValueError(
        f"`{field}`={value!r} has type {type(value).__name__}; "
        f"expected {expected} or the path of a `timestamp,value` CSV."
    )
