"""The report: JSON written atomically, Markdown with every figure's method, PNG, and re-rendering."""

from __future__ import annotations

import json
import os

import pytest

from lightning_pulse.energy.carbon import Rate
from lightning_pulse.energy.ledger import EnergyLedger
from lightning_pulse.energy.meter import ESTIMATED, MEASURED
from lightning_pulse.energy.report import (
    JSON_NAME,
    MARKDOWN_NAME,
    PNG_NAME,
    assemble_report,
    render_report,
    report_markdown,
    write_report,
)


def small_report() -> dict:
    ledger = EnergyLedger(intensity=Rate("constant", "gCO2eq/kWh", constant=400.0))
    ledger.begin(0.0, 100.0, {"gpu": (0.0, MEASURED), "cpu": (0.0, ESTIMATED)})
    ledger.mark(0.0, 100.0, stage="train", phase="burst", cycle=0, epoch=0)
    ledger.count_batch(ledger.current_keys(), 50, None)
    ledger.record(5.0, 105.0, {"gpu": (5000.0, MEASURED), "cpu": (100.0, ESTIMATED)})
    ledger.mark(5.0, 105.0, phase="replay")
    ledger.count_batch(ledger.current_keys(), 50, None)
    ledger.record(8.0, 108.0, {"gpu": (6500.0, MEASURED), "cpu": (160.0, ESTIMATED)})
    return assemble_report(
        ledger.snapshot(8.0),
        meters={"gpu": {"meter": "nvml-counter", "counted_on": "every rank, summed"}},
        intensity=ledger.intensity,
    )


def test_report_files_are_written_and_labelled(tmp_path):
    report = small_report()
    paths = write_report(report, tmp_path / "out")
    assert [p.name for p in paths] == [JSON_NAME, MARKDOWN_NAME, PNG_NAME]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(
        [JSON_NAME, MARKDOWN_NAME, PNG_NAME]
    )
    data = json.loads((tmp_path / "out" / JSON_NAME).read_text())
    assert data["phases"]["burst"]["energy_kwh"] == pytest.approx(5100 / 3.6e6)
    assert data["phases"]["replay"]["methods"] == {"gpu": MEASURED, "cpu": ESTIMATED, "ram": "none"}
    markdown = (tmp_path / "out" / MARKDOWN_NAME).read_text()
    assert "| burst | 5.0 s | 0.001417 (estimated) |" in markdown
    assert "| gpu | nvml-counter | measured |" in markdown
    assert "— (none)" in markdown  # cost: no price given
    assert (tmp_path / "out" / PNG_NAME).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    umask = os.umask(0)
    os.umask(umask)
    assert all(p.stat().st_mode & 0o777 == 0o666 & ~umask for p in paths)  # not mkstemp's private 0600


def test_render_report_rebuilds_markdown_and_png_from_the_json(tmp_path):
    write_report(small_report(), tmp_path)
    data = json.loads((tmp_path / JSON_NAME).read_text())
    data["phases"]["burst"]["energy_kwh"] = 123.0  # an edit to the data shows up in the re-rendered table
    (tmp_path / JSON_NAME).write_text(json.dumps(data))
    (tmp_path / PNG_NAME).unlink()
    paths = render_report(tmp_path)
    assert [p.name for p in paths] == [MARKDOWN_NAME, PNG_NAME]
    assert "| burst | 5.0 s | 123 (estimated) |" in (tmp_path / MARKDOWN_NAME).read_text()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_render_report_rejects_a_missing_or_foreign_json(tmp_path):
    with pytest.raises(FileNotFoundError, match=JSON_NAME):
        render_report(tmp_path)
    (tmp_path / JSON_NAME).write_text(json.dumps({"hello": 1}))
    with pytest.raises(ValueError, match="not a lightning-pulse energy report"):
        render_report(tmp_path)


def test_render_report_finds_the_report_below_a_log_root_as_compare_does(tmp_path):
    # review 18: the docs said `render_report(DIR)` finds it as `compare` does; only the command line did
    run = tmp_path / "lightning_logs" / "version_0"
    write_report(small_report(), run, chart=False)
    (run / MARKDOWN_NAME).unlink()
    assert render_report(tmp_path) == [run / MARKDOWN_NAME, run / PNG_NAME]
    write_report(small_report(), tmp_path / "lightning_logs" / "version_1", chart=False)
    with pytest.raises(ValueError, match=r"2 energy reports below it \(lightning_logs/version_0, "):
        render_report(tmp_path)  # which one is not guessed


def test_a_first_value_held_before_the_series_is_not_said_to_end_when_the_run_reaches_it():
    # review 18: "held ... until the run reaches the series" for a June excerpt read from February, which the
    # run never reaches
    report = small_report()
    held = {"value": 170.3, "from_utc": "2026-02-01 00:00:00", "series_time_utc": "2020-02-01 00:00:00"}
    report["carbon_intensity"] = {"source": "series:june.csv", "unit": "gCO2eq/kWh", "held": {"before": held}}
    markdown = report_markdown(report)
    assert (
        "its first value, 170.3 gCO2eq/kWh, is held from 2026-02-01 00:00:00 UTC while the run reads before "
        "the series." in markdown
    )
    assert "until the run reaches" not in markdown


def test_a_run_that_wraps_past_the_series_end_says_so_in_the_markdown():
    # review 19: the JSON recorded `wraps` and the Markdown said nothing of the year read after the end
    report = small_report()
    wraps = {"at_utc": "2021-01-01 00:00:00", "to_utc": "2020-01-01 00:00:00", "years": 1}
    report["carbon_intensity"] = {
        "source": "series:de_2020.csv",
        "unit": "gCO2eq/kWh",
        "held": {},
        "wraps": wraps,
    }
    assert (
        "- Carbon intensity: the run reads series:de_2020.csv at the same time of year and goes on past its end "
        "(2021-01-01 00:00:00) at 2020-01-01 00:00:00, 1 year back." in report_markdown(report)
    )


def test_a_failed_write_leaves_the_previous_file_intact(tmp_path):
    from lightning_pulse.energy.report import write_atomic

    target = tmp_path / "energy_report.json"
    target.write_text("previous")

    def broken(path):
        path.write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_atomic(target, broken)
    assert target.read_text() == "previous"
    assert [p.name for p in tmp_path.iterdir()] == ["energy_report.json"]
