"""Carbon intensity and price: constants, codecarbon countries, and CSV series (the real 2020 grid data)."""

from __future__ import annotations

import time
import warnings
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


def test_a_csv_saved_by_excel_with_a_byte_order_mark_reads_its_named_columns(tmp_path):
    # held-out sweep: Excel's "CSV UTF-8" starts with a BOM, so the header's first name was "\ufeffvalue": not
    # known, the value column defaulted to the time column and the file was refused as "not `timestamp,value`"
    path = tmp_path / "excel.csv"
    path.write_text(
        "value,timestamp\n300,2020-06-15T00:00:00Z\n100,2020-06-15T01:00:00Z\n", encoding="utf-8-sig"
    )
    series = TimeSeries.from_csv(path)
    assert series.times.tolist() == [utc("2020-06-15 00:00:00"), utc("2020-06-15 01:00:00")]
    assert series.values.tolist() == [300.0, 100.0]


# a byte-order mark and the text after it, as Windows PowerShell 5.1's `>` and Excel's "Unicode Text"
# (UTF-16 LE) and other tools write them
WITH_BOM = {
    "utf-16-le": lambda text: b"\xff\xfe" + text.encode("utf-16-le"),
    "utf-16-be": lambda text: b"\xfe\xff" + text.encode("utf-16-be"),
    "utf-32-le": lambda text: b"\xff\xfe\x00\x00" + text.encode("utf-32-le"),
}


@pytest.mark.parametrize("encoding", list(WITH_BOM))
def test_a_csv_in_utf16_or_utf32_with_a_byte_order_mark_reads_as_its_utf8_copy(tmp_path, encoding):
    # sweep: refused at construction with a bare "'utf-8' codec can't decode byte 0xff in position 0"
    path = tmp_path / "carbon.csv"
    path.write_bytes(WITH_BOM[encoding](EXCERPT.read_text()))
    series, utf8 = TimeSeries.from_csv(path), TimeSeries.from_csv(EXCERPT)
    assert series.times.tolist() == utf8.times.tolist() and series.values.tolist() == utf8.values.tolist()


def _tab_separated(text: str) -> str:
    """``text`` (a comma CSV of plain cells) as Excel's "Unicode Text" writes it: cells separated by tabs."""
    return text.replace(",", "\t")


@pytest.mark.parametrize("encoding", ["utf-16-le", "utf-8"])
def test_a_tab_separated_series_as_excels_unicode_text_writes_it_reads_as_its_csv_copy(tmp_path, encoding):
    # sweep s44: the docs said Excel's "Unicode Text" files are read; they are tab-separated, and the reader
    # split on commas only: `ci.txt:2 is not `timestamp,value` (['2026-12-07 00:00:00\t200']: ...)`
    from lightning_pulse.energy.signal import series_signal

    text = _tab_separated(EXCERPT.read_text())
    path = tmp_path / "carbon.txt"
    path.write_bytes(WITH_BOM[encoding](text) if encoding in WITH_BOM else text.encode())
    series, csv_copy = TimeSeries.from_csv(path), TimeSeries.from_csv(EXCERPT)
    assert (
        series.times.tolist() == csv_copy.times.tolist()
        and series.values.tolist() == csv_copy.values.tolist()
    )
    for rate in (price_from(str(path), "EUR"), series_signal(str(path))):  # a price, GreenWindow's `signal`
        assert rate.series.values.tolist() == csv_copy.values.tolist()


@pytest.mark.parametrize(
    ("rows", "says"),
    [
        (  # Excel's "Unicode Text" in a decimal-comma locale
            "Time\tCarbon Intensity\n2020-06-15 00:00:00\t123,4\n",
            "ci.txt:2 is not `timestamp<tab>value` (['2020-06-15 00:00:00', '123,4']: could not convert string "
            "to float: '123,4'); its value '123,4' holds a comma: write 123.4 where it is a decimal comma, 1234 "
            "where it separates thousands (numbers take a decimal point and no separator).",
        ),
        (  # no header, a stray comma: split on tabs all the same
            "2020-06-15 00:00:00\t123\n2020-06-15 01:00:00\t1,234\n",
            "ci.txt:2 is not `timestamp<tab>value` (['2020-06-15 01:00:00', '1,234']: could not convert string "
            "to float: '1,234'); its value '1,234' holds a comma: write 1.234 where it is a decimal comma, 1234 "
            "where it separates thousands (numbers take a decimal point and no separator).",
        ),
    ],
    ids=["decimal-comma", "no-header"],
)
def test_a_tab_separated_series_with_decimal_commas_is_refused_naming_them(tmp_path, rows, says):
    path = tmp_path / "ci.txt"
    path.write_bytes(WITH_BOM["utf-16-le"](rows))
    with pytest.raises(ValueError, match=r"^`carbon_intensity`: ") as refused:
        carbon_intensity_from(str(path), None)
    assert str(refused.value).endswith(says)


def test_a_comma_csv_with_a_stray_tab_is_still_read_on_commas(tmp_path):
    path = tmp_path / "ci.csv"
    path.write_text("timestamp,value\t\n2020-06-15 00:00:00,123.4\n2020-06-15 01:00:00,120\n")
    assert TimeSeries.from_csv(path).values.tolist() == [123.4, 120.0]


@pytest.mark.parametrize("tabs", [False, True], ids=["powershell-csv", "excel-unicode-text"])
def test_energy_logger_counts_co2_from_a_utf16_csv_as_powershell_writes_it(tmp_path, tabs):
    import lightning.pytorch as pl

    from examples.mnist1d import MNIST1DClassifier, MNIST1DDataModule
    from lightning_pulse import EnergyLogger, MeterConfig
    from tests.conftest import trainer_kwargs

    path = tmp_path / "carbon.csv"
    text = EXCERPT.read_text()  # Excel's "Unicode Text" separates cells by tabs (sweep s44)
    path.write_bytes(WITH_BOM["utf-16-le"](_tab_separated(text) if tabs else text))
    energy = EnergyLogger(
        carbon_intensity=str(path),
        gpu="none",
        cpu="constant",
        ram="none",
        meters=MeterConfig(sampling_period=0.05, cpu_watts=100.0),
        report_dir=str(tmp_path),
    )
    shift = utc("2026-06-02 10:00:00") - time.time()
    energy.account.wall_clock = lambda: time.time() + shift  # read at 2020-06-02 10:00, inside the excerpt
    trainer = pl.Trainer(callbacks=[energy], max_steps=3, limit_val_batches=0, **trainer_kwargs())
    trainer.fit(MNIST1DClassifier(arch="mlp"), MNIST1DDataModule(num_samples=300, batch_size=32))
    block = energy.report["carbon_intensity"]
    assert block["source"] == "series:carbon.csv" and block["run_start_read_at"].startswith(
        "2020-06-02 10:00"
    )
    expected = TimeSeries.from_csv(EXCERPT).value_at(utc("2020-06-02 10:00:00"))
    assert energy.report["total"]["g_co2_per_kwh"] == pytest.approx(expected)


@pytest.mark.parametrize(
    "data, said",
    [
        (
            EXCERPT.read_text().encode(
                "utf-16-le"
            ),  # PowerShell's `Out-File -Encoding unicode -NoBOM` and co.
            " is not UTF-8: its NUL bytes follow each character, as UTF-16 LE without a byte-order mark "
            "writes them",
        ),
        (
            EXCERPT.read_text().encode("utf-16-be"),
            " is not UTF-8: its NUL bytes precede each character, as UTF-16 BE without a byte-order mark "
            "writes them",
        ),
        (
            EXCERPT.read_text().replace("Carbon Intensity", "Carbon Intensité").encode("cp1252"),
            ":1 is not UTF-8: byte 0xe9 (at 'Time,Carbon Intensit\\xe9') does not decode, as in a file saved "
            "in a Windows code page such as cp1252",
        ),
    ],
    ids=["utf-16-le-without-bom", "utf-16-be-without-bom", "cp1252"],
)
def test_a_csv_that_is_not_utf8_is_refused_at_construction_naming_the_encoding_and_the_way_out(
    tmp_path, data, said
):
    # sweep: a bare "'utf-8' codec can't decode byte", or (UTF-16 without a BOM) a row of cells with NULs
    from lightning_pulse import EnergyLogger, GreenWindow

    path = tmp_path / "carbon.csv"
    path.write_bytes(data)
    for build, first in [
        (lambda: EnergyLogger(carbon_intensity=str(path)), f"EnergyLogger: `carbon_intensity`: {path}"),
        (lambda: GreenWindow(signal=str(path)), f"GreenWindow: `signal`: {path}"),
    ]:
        with pytest.raises(ValueError) as refused:
            build()
        message = str(refused.value)
        assert message.startswith(first + said), message
        assert 'save it as UTF-8 (Excel: Save As "CSV UTF-8";' in message and "\n" not in message


def test_a_blank_line_before_the_header_still_reads_the_header(tmp_path):
    # sweep: only line 1 could be the header, so after a blank line it was read as a data row and refused
    path = tmp_path / "carbon.csv"
    path.write_text("\n \nvalue,timestamp\n300,2020-06-15T00:00:00Z\n100,2020-06-15T01:00:00Z\n")
    series = TimeSeries.from_csv(path)
    assert series.times.tolist() == [utc("2020-06-15 00:00:00"), utc("2020-06-15 01:00:00")]
    assert series.values.tolist() == [300.0, 100.0]


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


@pytest.mark.parametrize(
    ("rows", "first_line"),
    [
        (  # a duplicated timestamp: the second row of the pair
            "2020-06-01 00:00:00,100\n2020-06-01 01:00:00,120\n2020-06-01 01:00:00,130\n",
            "ci.csv:4: timestamp '2020-06-01 01:00:00' is not after line 3's '2020-06-01 01:00:00'; "
            "timestamps must be strictly increasing.",
        ),
        (  # two offsets on the same instant: the UTC time shows why
            "2020-06-01T02:00:00+02:00,100\n2020-06-01T00:00:00Z,200\n",
            "ci.csv:3: timestamp '2020-06-01T00:00:00Z' (2020-06-01 00:00:00 UTC) is not after line 2's "
            "'2020-06-01T02:00:00+02:00' (2020-06-01 00:00:00 UTC); timestamps must be strictly increasing.",
        ),
        (
            "2020-06-01 00:00:00,100\n2020-06-01 01:00:00,-1\n",
            "ci.csv:3: value '-1' must be finite and non-negative.",
        ),
        ("1590969600,100\nnan,2\n", "ci.csv:3 is not `timestamp,value` (['nan', '2']: 'nan' is not a finite"),
    ],
)
def test_a_refused_csv_is_named_once_with_the_line_of_its_first_bad_row(tmp_path, rows, first_line):
    # sweep 20d: "`carbon_intensity`: /x/dup_ts.csv: dup_ts.csv: timestamps must be strictly increasing."
    path = tmp_path / "ci.csv"
    path.write_text("timestamp,value\n" + rows)
    with pytest.raises(ValueError) as refused:
        carbon_intensity_from(str(path), None)
    message = str(refused.value).splitlines()[0]
    assert message.startswith(f"`carbon_intensity`: {tmp_path}/{first_line}")
    assert message.count("ci.csv") == 1


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


def hourly_series(first: str, last: str, value=lambda hours: hours) -> TimeSeries:
    """An hourly series from ``first`` to ``last`` (UTC) whose value is ``value(hours since first)``."""
    hours = np.arange(int((utc(last) - utc(first)) // 3600) + 1, dtype=np.float64)
    return TimeSeries(utc(first) + 3600.0 * hours, value(hours), name="hourly.csv")


def test_a_run_that_walks_off_the_series_end_holds_the_last_value_with_one_warning():
    # sweep C: past the end, each reading was mapped to the same time of year in the series' middle year, so a
    # run started on 2021-01-08 read 2020-01-10 from 2021-01-10 on: another year stitched in, in silence
    series = hourly_series("2020-01-01 00:00:00", "2021-01-09 00:00:00")
    warned: list[str] = []
    rate = Rate("series:hourly.csv", "gCO2eq/kWh", series=series, warn=warned.append)
    rate.anchor(utc("2021-01-08 12:00:00"))  # inside the series: the run's own dates
    assert rate.series_time(utc("2021-01-08 13:00:00")) == utc("2021-01-08 13:00:00")
    last = float(series.values[-1])
    for hours in range(1, 30):
        moment = utc("2021-01-09 00:00:00") + 3600.0 * hours
        assert rate.series_time(moment) == moment  # one continuous stretch, never another year
        assert rate.mean(moment, moment + 60) == last  # the last value, held
    assert len(warned) == 1, warned
    assert "hourly.csv series ends at 2021-01-09 01:00:00" in warned[0] and "last value" in warned[0]
    assert "held" in warned[0] and "no other year" in warned[0]
    held = rate.describe()["held"]["after"]
    assert held["value"] == last and held["from_utc"] == "2021-01-09 01:00:00"


def test_a_run_started_outside_the_series_reads_one_continuous_stretch_across_a_new_year():
    # sweep C: the same time of year was taken per reading, so a run over a new year's eve jumped back a year
    series = hourly_series("2019-12-20 00:00:00", "2021-01-09 00:00:00")
    rate = Rate("series:hourly.csv", "gCO2eq/kWh", series=series, notice=lambda message: None)
    start = utc("2026-12-31 22:00:00")
    rate.anchor(start)
    assert rate.series_time(start) == utc("2020-12-31 22:00:00")
    for hours in (1, 2, 3, 4, 48):
        assert rate.series_time(start + 3600.0 * hours) == utc("2020-12-31 22:00:00") + 3600.0 * hours
    assert rate.describe()["run_start_read_at"] == "2020-12-31 22:00:00"
    assert rate.describe()["held"] == {}


def test_a_partial_year_series_at_another_season_says_its_last_value_is_held():
    # sweep C: a June excerpt read in December was clamped to its last value while the notice said "read at
    # the same time of year in 2020"
    notices: list[str] = []
    rate = carbon_intensity_from(str(EXCERPT), None, notice=notices.append)
    series = TimeSeries.from_csv(EXCERPT)
    december = utc("2026-12-04 10:00:00")
    rate.anchor(december)
    with pytest.warns(UserWarning) as caught:
        assert rate.mean(december, december + 600) == pytest.approx(float(series.values[-1]), rel=1e-9)
        rate.mean(december + 600, december + 1200)
    messages = [str(warning.message) for warning in caught]
    assert len(messages) == 1 and messages[0].startswith(
        "EnergyLogger: the series:de_2020_excerpt.csv series"
    )
    assert "last value" in messages[0] and "held" in messages[0]
    assert "`accounting.carbon_intensity_start`" in messages[0]  # the way out
    assert not any("same time of year in 2020" in notice for notice in notices)  # not what happens
    assert rate.describe()["held"]["after"]["value"] == float(series.values[-1])


def test_the_energy_report_records_a_held_value_in_its_carbon_intensity_block(tmp_path):
    import lightning.pytorch as pl

    from examples.mnist1d import MNIST1DClassifier, MNIST1DDataModule
    from lightning_pulse import EnergyLogger, MeterConfig
    from tests.conftest import trainer_kwargs

    energy = EnergyLogger(
        carbon_intensity=str(EXCERPT),
        gpu="none",
        cpu="constant",
        ram="none",
        meters=MeterConfig(sampling_period=0.05, cpu_watts=100.0),
        report_dir=str(tmp_path),
    )
    shift = utc("2026-12-04 10:00:00") - time.time()
    energy.account.wall_clock = lambda: (
        time.time() + shift
    )  # the run's dates: a December, outside the excerpt
    trainer = pl.Trainer(callbacks=[energy], max_steps=3, limit_val_batches=0, **trainer_kwargs())
    with pytest.warns(UserWarning, match="last value .* is held"):
        trainer.fit(MNIST1DClassifier(arch="mlp"), MNIST1DDataModule(num_samples=300, batch_size=32))
    last = float(TimeSeries.from_csv(EXCERPT).values[-1])
    block = energy.report["carbon_intensity"]
    assert block["held"]["after"]["value"] == last and block["run_start_read_at"].startswith(
        "2020-12-04 10:00"
    )
    assert energy.report["total"]["g_co2_per_kwh"] == pytest.approx(last)
    assert "is held from 2026-12-04 10:00" in (tmp_path / "energy_report.md").read_text()


@pytest.mark.parametrize(
    "build, field",
    [
        (
            lambda: carbon_intensity_from(str(EXCERPT), None, series_start="2030-01-01"),
            "carbon_intensity_start",
        ),
        (lambda: price_from(str(EXCERPT), "EUR", series_start="2019-05-01 00:00:00"), "price_start"),
    ],
)
def test_a_series_start_outside_the_series_is_refused_at_construction(build, field):
    # sweep C: accepted, and every figure then read the series' last value, held for the whole run
    with pytest.raises(ValueError) as caught:
        build()
    message = str(caught.value)
    assert (
        message.startswith(f"`accounting.{field}`=")
        and "is outside the series de_2020_excerpt.csv" in message
    )
    assert "covers 2020-06-01 00:00:00 to 2020-06-05 00:00:00 (UTC)" in message


def test_callbacks_refuse_a_series_start_outside_their_series_naming_the_field():
    from lightning_pulse import AccountingConfig, EnergyLogger, GreenWindow, GreenWindowOptions

    with pytest.raises(ValueError, match=r"^EnergyLogger: `accounting.carbon_intensity_start`='2030-01-01"):
        EnergyLogger(
            carbon_intensity=str(EXCERPT), accounting=AccountingConfig(carbon_intensity_start="2030-01-01")
        )
    with pytest.raises(  # the value as given (review 18: it showed '2020-07-01 00:00:00')
        ValueError, match=r"^GreenWindow: `options.signal_start`='2020-07-01' is outside"
    ):
        GreenWindow(signal=str(EXCERPT), options=GreenWindowOptions(signal_start="2020-07-01"))
    inside = GreenWindow(signal=str(EXCERPT), options=GreenWindowOptions(signal_start="2020-06-02"))
    assert inside.signal.rate.series_start == utc("2020-06-02 00:00:00")


def _paused_green_window_run(series, start, mnist1d_small, tmp_path):
    """A GreenWindow (``when_dirty="pause"``, 300 W) on ``series`` from ``start`` on a simulated clock (or on
    ``start``, a SimulatedClock), an hour a step, and the 36-step fit of a small MLP to run:
    ``(green_window, fit)``."""
    import lightning.pytorch as pl

    from lightning_pulse import GreenWindow, GreenWindowOptions, SimulatedClock
    from lightning_pulse.callbacks.simulated_step_time import SimulatedStepTime
    from tests.conftest import trainer_kwargs

    clock = start if isinstance(start, SimulatedClock) else SimulatedClock(start)
    green = GreenWindow(
        signal=series,
        when_dirty="pause",
        clock=clock,
        expected_duration="36h",
        options=GreenWindowOptions(watts=300.0, report_dir=str(tmp_path)),
    )
    model, data = mnist1d_small(arch="mlp")
    trainer = pl.Trainer(
        callbacks=[SimulatedStepTime(clock, 3600.0), green],
        max_steps=36,
        limit_val_batches=0,
        **trainer_kwargs(),
    )
    return green, lambda: trainer.fit(model, data)


def test_green_window_past_its_signal_end_holds_the_last_value_and_warns(mnist1d_small, tmp_path):
    # sweep C: a 72 h job started two days before its series' end read, past it, the same time of year of the
    # series' first January (300 instead of 525 g/kWh) in silence, and reported a 50.7% "saving" from the jump
    january_2020 = 31 * 24  # hours
    series = hourly_series(
        "2020-01-01 00:00:00",
        "2021-01-03 00:00:00",
        lambda hours: np.where(hours < january_2020, 100.0, 500.0),
    )
    green, fit = _paused_green_window_run(series, "2021-01-02 00:00:00", mnist1d_small, tmp_path)
    with pytest.warns(UserWarning) as caught:
        fit()
    held = [str(w.message) for w in caught if "held" in str(w.message)]
    assert len(held) == 1 and held[0].startswith(
        "GreenWindow: the series:hourly.csv series ends at 2021-01-03 01:00"
    )
    past_end = [d for d in green.report["decisions"] if d["wall"] >= series.end]
    assert past_end and all(d["signal"] == 500.0 for d in past_end)  # the last value, not January 2020's 100
    assert green.report["signal"]["held"]["after"]["value"] == 500.0
    assert green.report["summary"]["saving_pct"] == pytest.approx(
        0.0, abs=1e-9
    )  # a flat signal saves nothing


@pytest.mark.parametrize(
    "first, last, run_start",
    [
        ("2026-01-01 00:00:00", "2026-01-02 23:00:00", "2025-12-31 23:00:00"),  # a day-ahead price series
        ("2020-01-01 00:00:00", "2020-12-31 23:00:00", "2019-12-31 23:00:00"),  # a whole year, like de_2020
        ("2020-01-01 00:00:00", "2020-12-31 23:00:00", "2019-12-31 01:00:00"),  # 23 h before it
    ],
)
def test_a_run_starting_just_before_a_series_in_the_next_calendar_year_reads_its_own_dates(
    first, last, run_start
):
    # sweep C, review 18: the same time of year of 31 December 23:00 is the series' last hour (or past the
    # end of a 2-day series), so the whole run, after at most an hour, held the series' last value
    series = hourly_series(first, last, lambda hours: 100.0 + hours)
    warned: list[str] = []
    notices: list[str] = []
    rate = Rate("series:hourly.csv", "EUR/kWh", series=series, notice=notices.append, warn=warned.append)
    start = utc(run_start)
    rate.anchor(start)
    assert rate.mean(start, start + 60) == 100.0  # the first value, held until the series starts
    for hours in (5.5, 36.5):
        moment = utc(first) + 3600.0 * hours
        assert rate.series_time(moment) == moment  # the run's own dates, one continuous stretch
        assert rate.mean(moment, moment + 60) == series.value_at(moment) == 100.0 + int(hours)
    assert notices == [] and len(warned) == 1
    assert "read at its own dates" in warned[0] and "is held while the run reads before it" in warned[0]
    described = rate.describe()
    assert described["run_start_read_at"] == run_start and set(described["held"]) == {"before"}
    assert described["held"]["before"]["from_utc"] == run_start


def test_a_december_to_february_series_is_read_in_the_year_that_holds_that_time_of_year():
    # sweep C, review 18: the series' middle year (2021) put a December run in December 2021, past its end
    series = hourly_series("2020-12-01 00:00:00", "2021-02-28 23:00:00")
    for run_start, read_at in (
        ("2026-12-15 06:00:00", "2020-12-15 06:00:00"),
        ("2027-02-01 06:00:00", "2021-02-01 06:00:00"),
    ):
        notices: list[str] = []
        rate = Rate("series:hourly.csv", "gCO2eq/kWh", series=series, notice=notices.append, warn=pytest.fail)
        rate.anchor(utc(run_start))
        assert rate.series_time(utc(run_start) + 7200.0) == utc(read_at) + 7200.0
        assert rate.describe()["run_start_read_at"] == read_at and rate.describe()["held"] == {}
        assert len(notices) == 1 and f"same time of year in {read_at[:4]}" in notices[0]


def test_a_partial_year_excerpt_read_at_another_season_before_it_reads_the_runs_own_dates():
    # no year holds December in a June excerpt: a run from December 2019 reaches the series at its own dates
    # (before: December 2020, past the end, holding the last value for good)
    series = TimeSeries.from_csv(EXCERPT)
    warned: list[str] = []
    rate = Rate("series:de_2020_excerpt.csv", "gCO2eq/kWh", series=series, warn=warned.append)
    start = utc("2019-12-01 00:00:00")
    rate.anchor(start)
    assert rate.series_time(start) == start
    assert rate.mean(start, start + 60) == pytest.approx(float(series.values[0]), rel=1e-9)
    inside = utc("2020-06-02 07:20:00")
    assert rate.mean(inside, inside + 60) == pytest.approx(series.value_at(inside), rel=1e-9)
    assert len(warned) == 1 and "first value" in warned[0] and "while the run reads before it" in warned[0]
    assert set(rate.describe()["held"]) == {"before"}


def test_the_same_time_of_year_notice_names_the_rate_it_is_about(tmp_path):
    # review 18: intensity and price on one file gave two identical lines
    notices: list[str] = []
    intensity = carbon_intensity_from(str(EXCERPT), None, notice=notices.append)
    price = price_from(str(EXCERPT), "EUR", notice=notices.append)
    moment = utc("2026-06-02 07:20:00")
    for rate in (intensity, price):
        rate.anchor(moment)
        rate.mean(moment, moment + 60)
    assert len(notices) == 2 and notices[0] != notices[1]
    assert "`carbon_intensity`" in notices[0] and "`price_per_kwh`" in notices[1]
    assert all("same time of year in 2020" in notice for notice in notices)


def test_a_held_last_value_is_dated_where_the_run_crosses_the_series_end():
    # review 18: a reading that starts past the end (a slot) dated the hold from that reading: a slot late
    series = hourly_series("2020-06-01 00:00:00", "2020-06-02 23:00:00")
    rate = Rate("series:hourly.csv", "gCO2eq/kWh", series=series, warn=lambda message: None)
    rate.anchor(utc("2020-06-02 12:00:00"))
    later = series.end + 1800.0
    assert rate.mean(later, later + 3600.0) == float(series.values[-1])
    assert rate.describe()["held"]["after"]["from_utc"] == "2020-06-03 00:00:00"  # series.end, not 00:30


def year_2020(value=lambda hours: 100.0 + hours) -> TimeSeries:
    """An hourly series of 2020 (366 days, to 2021-01-01 00:00 like ``de_2020.csv``)."""
    return hourly_series("2020-01-01 00:00:00", "2020-12-31 23:00:00", value)


@pytest.mark.parametrize(
    "run_start, read_at",
    [
        ("2025-12-31 12:00:00", "2020-12-31 12:00:00"),  # a 2026 run over a new year's eve
        ("2019-12-30 00:00:00", "2020-12-30 00:00:00"),  # two days before the series: no own dates
    ],
)
def test_a_run_read_at_the_same_time_of_year_wraps_past_a_whole_year_series_end(run_start, read_at):
    # review 19: from 2021-01-01 on the run held the 31 December value for the rest of the run (weeks, for a
    # long one), with a warning, where the same time of year is the series' January
    series = year_2020()
    notices: list[str] = []
    rate = Rate("series:hourly.csv", "gCO2eq/kWh", series=series, notice=notices.append, warn=pytest.fail)
    start = utc(run_start)
    rate.anchor(start)
    assert rate.series_time(start) == utc(read_at)
    new_year = start + utc("2021-01-01 00:00:00") - utc(read_at)  # where the run crosses the series' end
    for hours in (0, 5, 24 * 40):  # January 2020, hour by hour, and February six weeks on
        moment = new_year + 3600.0 * hours
        assert rate.mean(moment, moment + 60) == series.value_at(utc("2020-01-01 00:00:00") + 3600.0 * hours)
        assert rate.mean(moment, moment + 60) == 100.0 + hours
    assert len(notices) == 1 and "wrapping at its end to 2020-01-01 00:00:00 (1 year back)" in notices[0]
    described = rate.describe()
    assert described["held"] == {} and described["run_start_read_at"] == read_at
    assert described["wraps"] == {
        "at_utc": "2021-01-01 00:00:00",
        "to_utc": "2020-01-01 00:00:00",
        "years": 1,
    }
    resumed = Rate("series:hourly.csv", "gCO2eq/kWh", series=series, notice=notices.append, warn=pytest.fail)
    resumed.load_state_dict(rate.state_dict())
    resumed.anchor(start + 86400.0)  # a resume keeps the first fit's anchor, and with it the wrap
    assert resumed.mean(new_year + 7200.0, new_year + 7260.0) == 102.0 and resumed.describe() == described


def test_the_mean_over_an_interval_across_a_wrapping_series_end_is_the_wrapped_mean():
    series = year_2020()
    last = 100.0 + 366 * 24 - 1  # 2020-12-31 23:00
    rate = Rate(
        "series:hourly.csv", "gCO2eq/kWh", series=series, notice=lambda message: None, warn=pytest.fail
    )
    rate.anchor(utc("2025-12-31 12:00:00"))  # read at 2020-12-31 12:00
    crossing = utc(
        "2025-12-31 23:30:00"
    )  # 2020-12-31 23:30 to 2021-01-01 01:30: half of 23:00, 00:00, half of 01:00
    assert rate.mean(crossing, crossing + 7200.0) == pytest.approx((0.5 * last + 100.0 + 0.5 * 101.0) / 2)
    # three years on, a whole period reads every hour of 2020 once: its mean, with no drift from the laps
    later = utc("2028-12-31 12:00:00") + 1800.0
    assert rate.mean(later, later + 366 * 86400.0) == pytest.approx(float(series.values.mean()), rel=1e-12)
    # a three-year series wraps three years back: 2022-01-01 reads 2019-01-01
    three = hourly_series("2019-01-01 00:00:00", "2021-12-31 23:00:00", lambda hours: 100.0 + hours)
    rate = Rate(
        "series:hourly.csv", "gCO2eq/kWh", series=three, notice=lambda message: None, warn=pytest.fail
    )
    rate.anchor(utc("2026-12-31 00:00:00"))  # its middle year: 2020-12-31
    moment = utc("2028-01-01 07:00:00")  # series time 2022-01-01 07:00
    assert rate.mean(moment, moment + 60) == 107.0 and rate.describe()["wraps"]["years"] == 3


@pytest.mark.parametrize(
    "first, last, run_start, series_start",
    [
        ("2020-01-01 00:00:00", "2020-12-31 23:00:00", "2020-12-31 12:00:00", None),  # its own dates
        (
            "2020-01-01 00:00:00",
            "2020-12-31 23:00:00",
            "2025-12-31 12:00:00",
            "2020-12-31 12:00:00",
        ),  # a start
        (
            "2020-06-01 00:00:00",
            "2020-06-30 23:00:00",
            "2026-06-29 00:00:00",
            None,
        ),  # a June excerpt, in June
    ],
)
def test_a_run_at_its_own_dates_from_a_start_or_on_a_partial_year_still_holds_past_the_end(
    first, last, run_start, series_start
):
    series = hourly_series(first, last, lambda hours: 100.0 + hours)
    warned: list[str] = []
    rate = Rate(
        "series:hourly.csv",
        "gCO2eq/kWh",
        series=series,
        series_start=None if series_start is None else utc(series_start),
        notice=lambda message: None,
        warn=warned.append,
    )
    start = utc(run_start)
    rate.anchor(start)
    past_end = start + series.end - rate.series_time(start) + 3600.0 * 5
    assert rate.mean(past_end, past_end + 60) == float(series.values[-1])  # no other year stitched in
    assert len(warned) == 1 and "last value" in warned[0] and "no other year" in warned[0]
    assert set(rate.describe()["held"]) == {"after"} and rate.describe()["wraps"] is None


def test_green_window_read_at_the_same_time_of_year_wraps_its_signal_into_january(mnist1d_small, tmp_path):
    # review 19: a run from 2025-12-31 12:00 on a 2020 series held the 31 December value past 2021-01-01
    january = 31 * 24  # hours
    series = year_2020(lambda hours: np.where(hours < january, 100.0, 500.0))
    green, fit = _paused_green_window_run(series, "2025-12-31 12:00:00", mnist1d_small, tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit()
    assert not [str(w.message) for w in caught if "held" in str(w.message)]
    new_year = utc("2026-01-01 00:00:00")
    decisions = green.report["decisions"]
    assert [d["signal"] for d in decisions if d["wall"] < new_year] and all(
        d["signal"] == 500.0 for d in decisions if d["wall"] < new_year
    )
    past_end = [d for d in decisions if d["wall"] >= new_year]
    assert past_end and all(d["signal"] == 100.0 for d in past_end)  # January 2020, not 31 December's 500
    assert green.report["signal"]["wraps"]["to_utc"] == "2020-01-01 00:00:00"


def test_a_gap_inside_a_series_is_warned_once_naming_the_file_and_recorded(tmp_path):
    rows = EXCERPT.read_text().splitlines()
    holed = tmp_path / "holed.csv"
    holed.write_text("\n".join(r for r in rows if not r.startswith("2020-06-02")) + "\n")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rate = carbon_intensity_from(str(holed), None)
        whole = carbon_intensity_from(str(EXCERPT), None)
    told = [str(w.message) for w in caught]
    assert len(told) == 1 and f"'{holed}' has 1 gap longer than 2x its usual 15 min between rows" in told[0]
    assert "no rows from 2020-06-01 23:45:00 to 2020-06-03 00:00:00 (UTC), 24.2 h" in told[0]
    assert rate.describe()["gaps"] == [
        {
            "from_utc": "2020-06-01 23:45:00",
            "to_utc": "2020-06-03 00:00:00",
            "hours": 24.25,
            "value": float(TimeSeries.from_csv(holed).value_at(utc("2020-06-01 23:45:00"))),
        }
    ]
    assert rate.describe()["gap_count"] == 1 and whole.describe()["gaps"] == []
    # one missing row of an hourly series (a 2 h step, twice the usual) is no gap: the 2020 files have those
    series = TimeSeries(np.array([0.0, 3600.0, 10800.0, 14400.0]), np.array([1.0, 2.0, 3.0, 4.0]))
    assert series.gaps() == []


@pytest.mark.skipif(not (SHARED / "de_2020.csv").exists(), reason="shared carbon data not on this machine")
@pytest.mark.parametrize("country", ["de", "fr", "gb"])
def test_the_real_2020_series_load_without_a_gap_warning(country):
    # de_2020.csv has two 30-min steps in its 15-min rows, gb_2020.csv mixes 15 and 30 min: no gaps
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rate = carbon_intensity_from(str(SHARED / f"{country}_2020.csv"), None)
    assert not [w for w in caught if "gap" in str(w.message)] and rate.describe()["gap_count"] == 0


@pytest.mark.parametrize(
    ("stamps", "said"),
    [
        (  # JavaScript, Grafana and InfluxDB export Unix milliseconds
            [str((1592179200 + 1800 * i) * 1000) for i in range(4)],
            "ci.csv:2: timestamp '1592179200000' reads as 1.59218e+12 Unix seconds, about the year "
            "52424, outside 1900-01-01 to 2200-01-01 (UTC), and looks like Unix milliseconds; timestamps "
            "are ISO 8601 (naive ones are UTC) or Unix seconds: divide by 1000 (2020-06-15 00:00:00 UTC).",
        ),
        (  # compact YYYYMMDDHHMM stamps, read as Unix seconds: the year 8371
            ["202006150000", "202006150030"],
            "ci.csv:2: timestamp '202006150000' reads as 2.02006e+11 Unix seconds, about the year 8371, "
            "outside 1900-01-01 to 2200-01-01 (UTC), and looks like a compact date; timestamps are ISO "
            "8601 (naive ones are UTC) or Unix seconds: write '2020-06-15 00:00:00'.",
        ),
    ],
    ids=["milliseconds", "compact-dates"],
)
def test_a_csv_stamped_in_another_unit_is_refused_at_construction_naming_its_line(tmp_path, stamps, said):
    # held-out sweep: accepted, then GreenWindow's fit raised a bare "ValueError: year 52426 is out of
    # range" at train start and EnergyLogger's metering stopped with it (no report); compact stamps read as
    # the year 8371
    from lightning_pulse import EnergyLogger, GreenWindow, MeterConfig
    from lightning_pulse.energy.signal import series_from_pairs

    path = tmp_path / "ci.csv"
    path.write_text(
        "timestamp,value\n" + "".join(f"{stamp},{250 + 10 * i}\n" for i, stamp in enumerate(stamps))
    )
    with pytest.raises(ValueError) as refused:
        EnergyLogger(carbon_intensity=str(path), cpu="constant", meters=MeterConfig(cpu_watts=100.0))
    assert str(refused.value) == f"EnergyLogger: `carbon_intensity`: {tmp_path}/{said}"
    with pytest.raises(ValueError) as refused:
        GreenWindow(signal=str(path), when_dirty="pause")
    assert str(refused.value) == f"GreenWindow: `signal`: {tmp_path}/{said}"
    # the same numbers in a list of pairs (and a JSON file) are refused as its item
    with pytest.raises(ValueError, match=r"^`signal`: series: item 0 \(.*looks like (Unix milli|a compact)"):
        series_from_pairs([[stamp, 300.0] for stamp in stamps])


@pytest.mark.parametrize(
    ("rows", "said"),
    [
        (  # a price with decimal commas, unquoted in a comma CSV: every price read as 0.0
            "timestamp,value\n2020-06-15 00:00:00,0,31\n2020-06-15 01:00:00,0,27\n",
            "price.csv:2: the row ['2020-06-15 00:00:00', '0', '31'] has 3 cells, more than the header's "
            "2 (['timestamp', 'value']): its extra cells would be dropped; 0,31 looks like a decimal comma: "
            "write 0.31 (commas separate cells).",
        ),
        (  # no header: two cells
            "2020-06-15 00:00:00,0.31\n2020-06-15 01:00:00,0.27,EUR\n",
            "price.csv:2: the row ['2020-06-15 01:00:00', '0.27', 'EUR'] has 3 cells, more than 2 "
            "(`timestamp,value`): its extra cells would be dropped; give each row one cell per column, and a "
            "header that names them all.",
        ),
    ],
    ids=["decimal-comma", "no-header"],
)
def test_a_csv_row_with_more_cells_than_its_header_is_refused_at_construction(tmp_path, rows, said):
    # held-out sweep: the extra cells were dropped without a word, "0,31" EUR/kWh read as 0.0 (every cost 0)
    # and a France carbon row "19,7" as 19.0
    path = tmp_path / "price.csv"
    path.write_text(rows)
    with pytest.raises(ValueError) as refused:
        price_from(str(path), "EUR")
    assert str(refused.value) == f"`price_per_kwh`: {tmp_path}/{said}"
    # a trailing comma adds an empty cell, not a column: still read
    path.write_text("timestamp,value,\n2020-06-15 00:00:00,0.31,\n2020-06-15 01:00:00,0.27,\n")
    assert TimeSeries.from_csv(path).values.tolist() == [0.31, 0.27]


def test_a_header_ending_in_an_unnamed_column_takes_rows_that_fill_it(tmp_path):
    """Regression sweep of the fortieth pass: a spreadsheet's notes column with no name (`timestamp,value,`)
    was refused as cells beyond the header's two; the header has three."""
    path = tmp_path / "grid.csv"
    path.write_text("timestamp,value,\n2020-01-01 00:00:00,100,checked\n2020-01-01 01:00:00,110,\n")
    series = TimeSeries.from_csv(path)
    assert series.values.tolist() == [100.0, 110.0]


@pytest.mark.parametrize(
    ("stamps", "said"),
    [
        (  # compact date-hours across a day's end: as Unix seconds 1 s, then 77 s apart, in January 2034
            ["2020061522", "2020061523", "2020061600", "2020061601"],
            "ci.csv:2: timestamp '2020061522' reads as 2034-01-05 08:12:02 UTC in Unix seconds, and as "
            "2020-06-15 22:00:00 in a compact YYYYMMDDHH date, as every timestamp of the file does: a series of "
            "Unix seconds almost never spells dates row after row, so it is refused, not guessed; timestamps "
            "are ISO 8601 (naive ones are UTC) or Unix seconds: write '2020-06-15 22:00:00' (and Unix seconds "
            "that spell dates as ISO 8601 too).",
        ),
        (  # compact dates of a daily series, as Unix seconds a day in August 1970
            ["20200615", "20200616", "20200617"],
            "ci.csv:2: timestamp '20200615' reads as 1970-08-22 19:16:55 UTC in Unix seconds, and as "
            "2020-06-15 00:00:00 in a compact YYYYMMDD date, as every timestamp of the file does: a series of "
            "Unix seconds almost never spells dates row after row, so it is refused, not guessed; timestamps "
            "are ISO 8601 (naive ones are UTC) or Unix seconds: write '2020-06-15 00:00:00' (and Unix seconds "
            "that spell dates as ISO 8601 too).",
        ),
    ],
    ids=["date-hours", "dates"],
)
def test_a_csv_of_compact_dates_inside_the_dated_range_is_refused_not_read_as_seconds(tmp_path, stamps, said):
    """Left open by the fortieth pass: `2020061500` is 2034-01-05 as Unix seconds, inside 1900-2199, so a
    file of compact date-hours was read 14 years off (and `20200615` as 1970) with no word."""
    from lightning_pulse import EnergyLogger, GreenWindow, MeterConfig
    from lightning_pulse.energy.signal import series_from_pairs

    path = tmp_path / "ci.csv"
    path.write_text(
        "timestamp,value\n" + "".join(f"{stamp},{250 + 10 * i}\n" for i, stamp in enumerate(stamps))
    )
    with pytest.raises(ValueError) as refused:
        EnergyLogger(carbon_intensity=str(path), cpu="constant", meters=MeterConfig(cpu_watts=100.0))
    assert str(refused.value) == f"EnergyLogger: `carbon_intensity`: {tmp_path}/{said}"
    with pytest.raises(ValueError) as refused:
        GreenWindow(signal=str(path), when_dirty="pause")
    assert str(refused.value) == f"GreenWindow: `signal`: {tmp_path}/{said}"
    # the same numbers as a list of pairs (and a JSON file, read as one) are refused as its item
    with pytest.raises(
        ValueError, match=r"^`signal`: series: item 0 \(2020061\d+\.0\) reads as .* in a compact"
    ):
        series_from_pairs([[stamp, 300.0] for stamp in stamps])


@pytest.mark.parametrize(
    ("first", "step", "rows"),
    [
        (2_000_000_000, 3600, 48),  # hourly from 2033-05-18: its second stamp spells no date (day 36)
        (1_900_010_100, 300, 12),  # 5-min from 2030-03-17: the longest run that spells dates is 11 rows
        (2_100_010_100, 900, 5),  # 15-min from 2036-07-18: at most 4 rows spell dates
        (1_592_179_200, 1800, 48),  # 2020-06-15, as the bundled series' own times read
    ],
    ids=["hourly-2033", "5min-2030", "15min-2036", "30min-2020"],
)
def test_unix_seconds_whose_digits_start_like_a_year_are_still_read_as_seconds(tmp_path, first, step, rows):
    """The compact-date refusal needs every timestamp of the file to spell a date: a Unix-seconds series of
    the 2030s (digits 19..., 20..., 21...) stops spelling one within a few rows and is read as before."""
    path = tmp_path / "ci.csv"
    path.write_text("timestamp,value\n" + "".join(f"{first + step * i},{100 + i}\n" for i in range(rows)))
    series = TimeSeries.from_csv(path)
    assert series.times.tolist() == [float(first + step * i) for i in range(rows)]
    assert series.interval == step


def test_a_live_signal_stamped_in_whole_seconds_that_spell_a_date_keeps_deciding(mnist1d_small, tmp_path):
    """The compact-date refusal is for the text a user brings (a CSV, JSON, pairs), not for a live signal's
    history or a TimeSeries built in Python: a source stamping whole Unix seconds in 2033 (2000010100 s spells
    2000-01-01 00h) has a first history of one reading that spells a date, which a check inside TimeSeries
    refused mid-fit."""
    from lightning_pulse import SimulatedClock

    start = 2_000_010_100.0  # 2033-05-18 06:21:40 UTC
    series = hourly_series(
        "2033-05-17 00:00:00", "2033-05-20 00:00:00", lambda hours: 200.0 + 100.0 * (hours % 2)
    )
    clock = SimulatedClock(start)
    green, fit = _paused_green_window_run(
        lambda: (float(int(clock.time())), series.value_at(clock.time())), clock, mnist1d_small, tmp_path
    )
    fit()
    readings = green.signal.live.times
    assert readings[0] == start and len(readings) == len(green.report["decisions"]) >= 2
    assert TimeSeries(np.array([start]), np.array([200.0])).start == start


@pytest.mark.parametrize(
    ("rows", "said"),
    [
        (  # a notes column with no name: the decimals land in it, and every value loses them
            "timestamp,value,\n2020-06-15 00:00:00,123,4\n2020-06-15 01:00:00,120,5\n",
            "ci.csv:2: the row ['2020-06-15 00:00:00', '123', '4'] has '123' under 'value' and '4' under its "
            "unnamed column 3 of the header ['timestamp', 'value', ''], and would be read as the value 123; "
            "123,4 looks like a decimal comma: write 123.4 (commas separate cells), or name the unnamed column "
            "in the header if it holds notes (`note`).",
        ),
        (  # an unnamed column before the value, left out of the rows: the value read is the decimals
            "timestamp,,value\n2020-06-15 00:00:00,123,4\n2020-06-15 01:00:00,120,5\n",
            "ci.csv:2: the row ['2020-06-15 00:00:00', '123', '4'] has '123' under its unnamed column 2 and "
            "'4' under 'value' of the header ['timestamp', '', 'value'], and would be read as the value 4; "
            "123,4 looks like a decimal comma: write 123.4 (commas separate cells), or name the unnamed column "
            "in the header if it holds notes (`note`).",
        ),
        (  # a pandas index's unnamed header cell, rows without it: the number read as 1970's Unix seconds
            ",timestamp,value\n2020-06-15 00:00:00,100,4\n2020-06-15 01:00:00,110,5\n",
            "ci.csv:2: the row ['2020-06-15 00:00:00', '100', '4'] has its timestamp '2020-06-15 00:00:00' under "
            "its unnamed column 1 and '100' under 'timestamp' of the header ['', 'timestamp', 'value']: its "
            "cells do not line up with the header; 100,4 looks like a decimal comma: write 100.4 (commas "
            "separate cells); give every row the header's columns (a pandas index too), or a header that names "
            "only them.",
        ),
    ],
    ids=["unnamed-after-value", "unnamed-before-value", "unnamed-index"],
)
def test_a_decimal_comma_filling_a_headers_unnamed_column_is_refused_at_construction(tmp_path, rows, said):
    """Left open by the fortieth pass: a header's unnamed column counts as a cell of every row, so a decimal
    comma's extra cell filled it and the row was read with no extra cell to refuse (123,4 as 123, or as 4, or
    at 100 Unix seconds)."""
    from lightning_pulse import EnergyLogger, GreenWindow, MeterConfig

    path = tmp_path / "ci.csv"
    path.write_text(rows)
    with pytest.raises(ValueError) as refused:
        EnergyLogger(carbon_intensity=str(path), cpu="constant", meters=MeterConfig(cpu_watts=100.0))
    assert str(refused.value) == f"EnergyLogger: `carbon_intensity`: {tmp_path}/{said}"
    with pytest.raises(ValueError) as refused:
        GreenWindow(signal=str(path), when_dirty="pause")
    assert str(refused.value) == f"GreenWindow: `signal`: {tmp_path}/{said}"


def test_an_unnamed_column_holding_notes_or_a_pandas_index_is_still_read(tmp_path):
    """What the unnamed-column refusal leaves alone: notes that are no decimal comma's half (a word, a number
    next to a decimal-point value), a named notes column, and a pandas index in every row."""
    path = tmp_path / "ci.csv"
    path.write_text(
        "timestamp,value,\n2020-06-15 00:00:00,123.5,4\n2020-06-15 01:00:00,120,checked\n"
        "2020-06-15 02:00:00,118,\n"
    )
    assert TimeSeries.from_csv(path).values.tolist() == [123.5, 120.0, 118.0]
    path.write_text("timestamp,value,note\n2020-06-15 00:00:00,123,4\n2020-06-15 01:00:00,120,5\n")
    assert TimeSeries.from_csv(path).values.tolist() == [123.0, 120.0]
    path.write_text(",timestamp,value\n0,2020-06-15 00:00:00,123.4\n1,2020-06-15 01:00:00,120\n")
    series = TimeSeries.from_csv(path)
    assert series.values.tolist() == [123.4, 120.0] and series.start == utc("2020-06-15 00:00:00")


@pytest.mark.parametrize(
    "rows",
    [
        "timestamp;value\n2020-06-15 00:00:00;123,4\n",  # a spreadsheet's export in a German locale
        ";carbon_intensity\n2020-06-15T00:00Z;123,4\n",  # and its pandas index
        "timestamp;value\n2020-06-15 00:00:00;123\n",  # no decimals in the row
    ],
    ids=["decimal-comma", "unnamed-index", "whole-number"],
)
def test_a_semicolon_separated_csv_is_refused_naming_the_separator(tmp_path, rows):
    """A `;`-separated file was refused too, but told to give each row one cell per column (or named the ISO
    format) rather than its separator."""
    path = tmp_path / "ci.csv"
    path.write_text(rows)
    with pytest.raises(ValueError, match=r"^`carbon_intensity`: .*ci\.csv:2") as refused:
        carbon_intensity_from(str(path), None)
    assert str(refused.value).endswith(
        "its cells look separated by ';', as a spreadsheet in a decimal-comma locale exports them: write "
        "commas between cells and a decimal point (2020-06-15 00:00:00,123.4)."
    )
