"""Carbon intensity and price: constants, codecarbon countries, and CSV series (the real 2020 grid data)."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pytest

from lightning_pulse.energy.carbon import Rate, TimeSeries, carbon_intensity_from, parse_timestamp, price_from

ROOT = Path(__file__).resolve().parents[1]
EXCERPT = ROOT / "examples" / "data" / "carbon" / "de_2020_excerpt.csv"
SHARED = ROOT.parent / "shared" / "data" / "carbon-intensity"


def utc(text: str) -> float:
    return datetime.fromisoformat(text).replace(tzinfo=timezone.utc).timestamp()


def test_reads_the_wiesner_format_excerpt():
    series = TimeSeries.from_csv(EXCERPT)
    assert len(series.times) == 384
    assert series.start == utc("2020-06-01 00:00:00")
    assert series.interval == 900.0
    assert series.value_at(utc("2020-06-01 00:10:00")) == pytest.approx(170.31920747158335)
    assert series.value_at(utc("2020-06-01 00:15:00")) == pytest.approx(171.3764373735293)


@pytest.mark.skipif(not (SHARED / "de_2020.csv").exists(), reason="shared carbon data not on this machine")
def test_reads_the_full_2020_series_with_the_published_statistics():
    series = TimeSeries.from_csv(SHARED / "de_2020.csv")
    assert len(series.times) == 37147
    # the README's table: min 101, mean 315, max 593
    assert (round(series.values.min()), round(series.values.mean()), round(series.values.max())) == (
        101,
        315,
        593,
    )


def test_mean_integrates_the_step_function_exactly():
    series = TimeSeries(np.array([0.0, 100.0, 200.0]), np.array([100.0, 300.0, 50.0]))
    assert series.mean(50.0, 150.0) == pytest.approx(200.0)  # half at 100, half at 300
    assert series.mean(90.0, 210.0) == pytest.approx((10 * 100 + 100 * 300 + 10 * 50) / 120)
    assert series.mean(-50.0, 0.0) == pytest.approx(100.0)  # before the start: first value
    assert series.mean(500.0, 600.0) == pytest.approx(50.0)  # after the end: last value
    assert series.mean(120.0, 120.0) == pytest.approx(300.0)


def test_generic_timestamp_value_csv_with_iso_and_unix_times(tmp_path):
    path = tmp_path / "price.csv"
    path.write_text("timestamp,value\n2024-01-01T00:00:00Z,0.20\n1704070800,0.40\n")
    series = TimeSeries.from_csv(path)
    assert series.times.tolist() == [utc("2024-01-01 00:00:00"), utc("2024-01-01 01:00:00")]
    rate = price_from(str(path), "EUR")
    assert rate is not None and rate.unit == "EUR/kWh"
    assert rate.mean(utc("2024-01-01 00:30:00"), utc("2024-01-01 01:30:00")) == pytest.approx(0.30)


def test_malformed_series_fails_at_construction_naming_the_field(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("Time,Carbon Intensity\n2020-01-01 00:00:00,200\nyesterday,300\n")
    with pytest.raises(ValueError, match=r"`carbon_intensity`: .*bad.csv:3"):
        carbon_intensity_from(str(path), None)
    path.write_text("Time,Carbon Intensity\n2020-01-01 01:00:00,200\n2020-01-01 00:00:00,300\n")
    with pytest.raises(ValueError, match="strictly increasing"):
        carbon_intensity_from(str(path), None)
    with pytest.raises(ValueError, match="`carbon_intensity`='missing.csv' is neither a number nor a file"):
        carbon_intensity_from("missing.csv", None)
    with pytest.raises(ValueError, match="`carbon_intensity`=-5"):
        carbon_intensity_from(-5, None)
    with pytest.raises(ValueError, match="`carbon_intensity_start`='soon'"):
        carbon_intensity_from(str(EXCERPT), None, series_start="soon")


def test_run_outside_the_series_reads_the_same_time_of_year():
    notices: list[str] = []
    rate = carbon_intensity_from(str(EXCERPT), None, notice=notices.append)
    assert rate is not None
    moment = utc("2026-06-02 07:20:00")
    expected = TimeSeries.from_csv(EXCERPT).value_at(utc("2020-06-02 07:20:00"))
    assert rate.mean(moment, moment + 60) == pytest.approx(expected)
    rate.mean(moment + 60, moment + 120)
    assert len(notices) == 1 and "same time of year in 2020" in notices[0]


def test_series_start_replays_the_series_from_a_chosen_moment():
    rate = carbon_intensity_from(str(EXCERPT), None, series_start="2020-06-03 12:00:00")
    assert isinstance(rate, Rate)
    run_start = 1_900_000_000.0
    rate.anchor(run_start)
    series = TimeSeries.from_csv(EXCERPT)
    two_hours_in = run_start + 7200
    assert rate.mean(two_hours_in, two_hours_in + 1) == pytest.approx(
        series.value_at(utc("2020-06-03 14:00:00"))
    )
    state = rate.state_dict()
    resumed = carbon_intensity_from(str(EXCERPT), None, series_start="2020-06-03 12:00:00")
    resumed.load_state_dict(state)
    resumed.anchor(run_start + 99_999)  # a resumed fit keeps the first fit's anchor
    assert resumed.mean(two_hours_in, two_hours_in + 1) == pytest.approx(
        rate.mean(two_hours_in, two_hours_in + 1)
    )


def test_constant_and_country_sources():
    assert carbon_intensity_from(None, None) is None
    constant = carbon_intensity_from(250, "FRA")  # the explicit value wins over the country
    assert constant.source == "constant" and constant.mean(0, 10) == 250
    country = carbon_intensity_from(None, "bra")
    assert country.source == "country:BRA" and 50 < country.mean(0, 1) < 200
    assert parse_timestamp("2020-06-01 00:00:00") == utc("2020-06-01 00:00:00")


def test_a_fork_reads_the_series_on_its_own_clock_from_the_same_moment():
    series = TimeSeries(np.array([0.0, 3600.0, 7200.0]), np.array([100.0, 200.0, 300.0]))
    shared = Rate("series:test", "gCO2eq/kWh", series=series, series_start=0.0)
    shared.anchor(1.7e9)  # the EnergyLogger's start, on the system clock
    fork = shared.fork()
    assert fork.run_start is None and fork.series is series and fork.series_start == 0.0
    # the same moment is 1.7e9 + 10 on the system clock and 1.5e9 + 10 on a simulated one
    fork.anchor_as(shared, now=1.5e9 + 10.0, other_now=1.7e9 + 10.0)
    fork.anchor(1.5e9 + 99.0)  # a later anchor keeps the first (a resume)
    assert fork.run_start == 1.5e9 and shared.run_start == 1.7e9
    assert fork.series_time(1.5e9 + 3700.0) == shared.series_time(1.7e9 + 3700.0) == 3700.0
    assert fork.mean(1.5e9 + 3600.0, 1.5e9 + 7200.0) == 200.0
    unanchored = shared.fork()
    unanchored.anchor_as(Rate("series:test", "gCO2eq/kWh", series=series, series_start=0.0), 5.0, 9.0)
    assert unanchored.run_start == 5.0  # the other has no anchor yet: at this clock's now


def test_a_string_that_is_not_a_file_says_a_number_is_accepted_too():
    from lightning_pulse import EnergyLogger

    with pytest.raises(ValueError) as caught:
        EnergyLogger(price_per_kwh="0,30")
    first = str(caught.value).splitlines()[0]
    assert first.startswith("EnergyLogger: `price_per_kwh`='0,30' is neither a number nor a file")
    assert "a finite price >= 0 as a number" in first and "CSV" in first
