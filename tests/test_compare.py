"""The savings ledger (issue 19): ``lightning-pulse compare RUN_A RUN_B`` and EnergyLogger's baseline.

Two tiny real fits, a plain one and one with a PulseCycle, each with an EnergyLogger and a CSVLogger; the
comparison must hold exactly the ratios of what the two reports hold, and bad inputs fail with one line.
"""

from __future__ import annotations

import csv
import json
import logging
import shutil
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

from examples.mnist1d import MNIST1DClassifier, MNIST1DDataModule
from lightning_pulse import PulseCycle
from lightning_pulse.callbacks.energy_logger import EnergyLogger
from lightning_pulse.cli import main
from lightning_pulse.energy.compare import (
    COMPARISON_JSON,
    COMPARISON_MARKDOWN,
    COMPARISON_PNG,
    FIGURES,
    chart_title,
    compare_runs,
    comparison_line,
    comparison_markdown,
    load_run,
    ratio_of,
    write_comparison_plot,
)
from lightning_pulse.energy.config import AccountingConfig, MeterConfig
from lightning_pulse.energy.metric_quality import metric_direction, pair_text, verdict
from lightning_pulse.energy.report import JSON_NAME
from lightning_pulse.errors import PulseRefusal
from tests.conftest import trainer_kwargs


def fit(root: Path, pulse: bool, baseline: str | None = None) -> Path:
    """One tiny run; returns its log directory (which holds energy_report.json and metrics.csv)."""
    pl.seed_everything(0, verbose=False)
    callbacks = []
    if pulse:
        callbacks.append(
            PulseCycle(burst=4, replay=2, maintain=2, warmup=0.0, anneal=0.0, maintain_eval="none")
        )
    callbacks.append(
        EnergyLogger(
            cpu="constant",
            ram="none",
            carbon_intensity=250.0,
            price_per_kwh=0.3,
            meters=MeterConfig(sampling_period=0.05, cpu_watts=10.0),
            accounting=AccountingConfig(baseline=baseline),
        )
    )
    trainer = pl.Trainer(
        callbacks=callbacks,
        **trainer_kwargs(
            max_epochs=2,
            limit_train_batches=8,
            limit_val_batches=2,
            logger=CSVLogger(root),
            log_every_n_steps=4,
        ),
    )
    trainer.fit(MNIST1DClassifier(arch="mlp"), MNIST1DDataModule(num_samples=600, batch_size=32))
    return Path(trainer.logger.log_dir)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    plain = fit(root / "plain", pulse=False)
    pulsed = fit(root / "pulse", pulse=True, baseline=str(plain / JSON_NAME))
    return root, plain, pulsed


def report(directory: Path) -> dict:
    return json.loads((directory / JSON_NAME).read_text())


def test_compare_gives_exactly_the_ratios_the_reports_hold(runs, capsys):
    root, plain, pulsed = runs
    # log directories as the user has them: the logger's root (the report is found below it) and the run's
    assert main(["compare", str(root / "plain"), str(pulsed)]) == 0
    out = capsys.readouterr().out
    assert "| energy (kWh) |" in out and "B/A" in out
    written = {p.name for p in pulsed.iterdir()}
    assert {COMPARISON_JSON, COMPARISON_MARKDOWN, COMPARISON_PNG} <= written  # next to RUN_B
    comparison = json.loads((pulsed / COMPARISON_JSON).read_text())

    a, b = report(plain)["total"], report(pulsed)["total"]
    for key, *_ in FIGURES:
        assert ratio_of(comparison, key) == b[key] / a[key], key  # exactly: the same division
    assert a["steps"] == b["steps"] == 16 and ratio_of(comparison, "steps") == 1.0
    assert ratio_of(comparison, "energy_kwh") > 0 and ratio_of(comparison, "co2_kg") > 0

    # each run's final logged metrics, read from its report, with their ratio
    metrics_a, metrics_b = report(plain)["metrics"], report(pulsed)["metrics"]
    assert {"val_loss", "val_acc"} <= set(metrics_a) and {"val_loss", "val_acc"} <= set(metrics_b)
    assert ratio_of(comparison, "val_loss") == metrics_b["val_loss"] / metrics_a["val_loss"]
    assert all(not row["metric"].startswith("energy/") for row in comparison["metrics"])
    markdown = (pulsed / COMPARISON_MARKDOWN).read_text()
    assert "val_loss" in markdown and f"{ratio_of(comparison, 'energy_kwh'):.3f}x" in markdown


def test_the_energy_logger_with_a_baseline_puts_the_same_comparison_in_its_report(runs, capsys):
    _, plain, pulsed = runs
    own = report(pulsed)["comparison"]
    assert (
        main(["compare", str(plain / JSON_NAME), str(pulsed / JSON_NAME), "--out", str(pulsed.parent)]) == 0
    )
    capsys.readouterr()
    cli = json.loads((pulsed.parent / COMPARISON_JSON).read_text())
    assert own["figures"] == cli["figures"] and own["metrics"] == cli["metrics"]
    md = (pulsed / "energy_report.md").read_text()
    assert "## Against the baseline" in md and "| wall time (s) |" in md
    assert "comparison" not in report(plain)  # no baseline, no comparison
    # and the ratios went to the run's own logger
    rows = list(csv.DictReader((pulsed / "metrics.csv").read_text().splitlines()))
    logged = {
        k: float(v) for row in rows for k, v in row.items() if k.startswith("energy/vs_baseline_") and v
    }
    expected = {
        f"energy/vs_baseline_{k}": ratio_of(own, k) for k in ("duration_s", "energy_kwh", "co2_kg", "cost")
    }
    assert logged == pytest.approx(expected, rel=1e-9)


def test_metrics_come_from_metrics_csv_when_the_report_has_none(runs, tmp_path):
    _, plain, pulsed = runs
    copy = tmp_path / "old"
    copy.mkdir()
    old = report(plain)
    del old["metrics"]  # a report written before reports held metrics
    (copy / JSON_NAME).write_text(json.dumps(old))
    shutil.copy(plain / "metrics.csv", copy / "metrics.csv")
    run = load_run(copy)
    assert run["metrics_source"] == "metrics.csv"
    assert run["metrics"]["val_loss"] == pytest.approx(report(plain)["metrics"]["val_loss"], rel=1e-6)
    comparison = compare_runs(run, load_run(pulsed))
    assert (
        ratio_of(comparison, "energy_kwh")
        == report(pulsed)["total"]["energy_kwh"] / old["total"]["energy_kwh"]
    )


@pytest.mark.parametrize(
    "make, expected",
    [
        (lambda d: d / "missing.json", "no such file or directory"),
        (lambda d: d, "no energy_report.json in this directory or below it"),
        (lambda d: write(d / "x.json", '{"hello": 1}'), "is not a lightning-pulse energy report"),
        (
            lambda d: write(d / "x.json", "not json at all"),
            "is not a lightning-pulse energy report (not JSON",
        ),
    ],
)
def test_bad_inputs_fail_with_one_line_and_exit_code_2(runs, tmp_path, capsys, make, expected):
    _, plain, _ = runs
    bad = make(tmp_path)
    for argv in (["compare", str(plain), str(bad)], ["compare", str(bad), str(plain)]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: ") and expected in err, err


def test_a_directory_with_several_reports_is_ambiguous(runs, capsys):
    root, plain, _ = runs
    assert main(["compare", str(root), str(plain)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "2 energy reports below it" in err


def test_a_baseline_that_is_not_a_report_fails_at_construction(tmp_path):
    with pytest.raises(ValueError, match=r"`accounting.baseline`=.*no such file or directory"):
        AccountingConfig(baseline=str(tmp_path / "nope.json"))
    with pytest.raises(ValueError, match=r"`accounting.baseline`=.*not a lightning-pulse energy report"):
        AccountingConfig(baseline=str(write(tmp_path / "x.json", "[]")))


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def _fit_against(baseline: str, **trainer_overrides) -> tuple[pl.Trainer, EnergyLogger]:
    report_dir = trainer_overrides.pop("report_dir", None)
    energy = EnergyLogger(
        cpu="constant",
        ram="none",
        report_dir=report_dir,
        meters=MeterConfig(cpu_watts=10.0),
        accounting=AccountingConfig(baseline=baseline),
    )
    run = {"max_steps": 4, "limit_val_batches": 0, **trainer_overrides}
    trainer = pl.Trainer(callbacks=[energy], **trainer_kwargs(**run))
    trainer.fit(MNIST1DClassifier(arch="mlp"), MNIST1DDataModule(num_samples=600, batch_size=32))
    return trainer, energy


@pytest.mark.parametrize(
    "where",
    [
        "logger=False, the same default_root_dir",
        "report_dir = the baseline's folder, baseline named by its file",
    ],
)
def test_a_run_whose_report_would_replace_its_baseline_is_refused_at_fit_start(runs, tmp_path, where):
    # both runs writing into one folder (logger=False writes into default_root_dir): the run compared with the
    # baseline used to write its own report over the baseline's, which was lost without a word
    _, plain, _ = runs
    folder = tmp_path / "shared"
    folder.mkdir()
    shutil.copy(plain / JSON_NAME, folder / JSON_NAME)  # a real run's report, alone in its folder
    before = (folder / JSON_NAME).read_bytes()
    if where.startswith("logger=False"):
        baseline, overrides = str(folder), {"default_root_dir": folder}
    else:
        baseline, overrides = (
            str(folder / JSON_NAME),
            {"report_dir": str(folder), "logger": CSVLogger(tmp_path)},
        )
    with pytest.raises(PulseRefusal) as refusal:
        _fit_against(baseline, **overrides)
    first = str(refusal.value).splitlines()[0]
    assert first.startswith(f"EnergyLogger: `accounting.baseline`={baseline!r} is "), first
    assert "set `report_dir`" in first and "attach a logger" in first  # the ways out
    assert (folder / JSON_NAME).read_bytes() == before  # the baseline is untouched
    assert not list(tmp_path.rglob("energy_report.md"))  # and nothing was trained or reported

    # the way out: this run's own folder; the baseline stays and the comparison is made
    trainer, energy = _fit_against(baseline, default_root_dir=folder, report_dir=str(tmp_path / "b"))
    assert trainer.global_step == 4 and energy.report_paths[0] == tmp_path / "b" / JSON_NAME
    assert (folder / JSON_NAME).read_bytes() == before
    assert ratio_of(energy.report["comparison"], "steps") == 4 / report(plain)["total"]["steps"]


def test_errors_name_the_argument_and_what_is_expected(tmp_path):
    from lightning_pulse.energy.compare import load_run

    with pytest.raises(FileNotFoundError) as caught:
        load_run(tmp_path / "typo", field="RUN_A")
    message = str(caught.value)
    assert message.startswith("`RUN_A`=") and "typo" in message
    assert "expected an energy_report.json or a log directory holding one" in message
    with pytest.raises(ValueError, match=r"^`RUN_B`='': the path is empty"):
        load_run("", field="RUN_B")


def test_an_empty_baseline_is_refused_naming_the_field(tmp_path, monkeypatch):
    # sweep B: "" became Path("."), searched below the current directory, and one report there was taken
    monkeypatch.chdir(tmp_path)
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "energy_report.json").write_text('{"schema": "x"}')
    with pytest.raises(ValueError, match=r"^EnergyLogger: `accounting.baseline`='': the path is empty"):
        AccountingConfig(baseline="")


def test_a_partial_figure_gets_no_ratio_but_a_note(runs, tmp_path):
    # a meter lost mid-run leaves an undercount: 0.3x "saved" would be the meter's failure, not the run's
    _, plain, pulsed = runs
    lost = tmp_path / "lost"
    lost.mkdir()
    undercount = report(pulsed)
    undercount["total"]["energy_kwh"] *= 0.3
    undercount["total"]["energy_method"] = "partial"
    (lost / JSON_NAME).write_text(json.dumps(undercount))
    comparison = compare_runs(load_run(plain), load_run(lost))
    for figure in ("energy_kwh", "co2_kg", "cost"):  # CO2 and cost come from the undercounted energy
        row = next(row for row in comparison["figures"] if row["figure"] == figure)
        assert row["ratio"] is None and "partial" in row["note"]
    assert ratio_of(comparison, "duration_s") is not None  # the wall time is still compared


def test_an_interrupted_run_gets_a_note_on_its_cost_rows_and_a_marked_chart(runs, tmp_path):
    # sweep C: a run that crashed at step 20 of 48 was compared with a complete one with no note (energy B/A
    # 2.70x)
    _, plain, pulsed = runs
    crashed = tmp_path / "crashed"
    crashed.mkdir()
    partial = report(plain)
    partial["status"] = "interrupted"
    for key in ("duration_s", "energy_kwh", "co2_kg", "cost"):
        partial["total"][key] /= 4
    for key in ("steps", "samples"):
        partial["total"][key] //= 4
    (crashed / JSON_NAME).write_text(json.dumps(partial))
    comparison = compare_runs(load_run(crashed), load_run(pulsed))
    rows = {row["figure"]: row for row in comparison["figures"]}
    for figure in ("duration_s", "energy_kwh", "co2_kg", "cost"):
        row = rows[figure]
        assert row["note"].startswith("A is interrupted: unequal work (A: 4 steps, B: 16)"), row
        per_step = (row["b"] / 16) / (row["a"] / 4)
        assert f"per optimizer step {per_step:.3f}x" in row["note"]
        assert row["ratio"] == row["b"] / row["a"]  # still given, next to its note
    assert rows["steps"]["note"] is None and rows["samples"]["note"] is None
    markdown = comparison_markdown(comparison)
    assert "| energy (kWh) |" in markdown and "(A is interrupted: unequal work" in markdown
    assert chart_title(comparison).endswith("\nA is interrupted: its totals cover only part of the run")
    assert "\n" not in chart_title(compare_runs(load_run(plain), load_run(pulsed)))


def test_a_fast_dev_run_report_saved_by_hand_is_compared_as_a_smoke_test(runs, tmp_path, capsys):
    # sweep-flags: a fast_dev_run's `.report` (no file is written under fast_dev_run) said "complete" for its
    # 1 batch; saved and compared, its ratios read as those of a whole run, with no note
    _, _, pulsed = runs
    energy = EnergyLogger(
        cpu="constant", ram="none", carbon_intensity=250.0, meters=MeterConfig(cpu_watts=10.0)
    )
    trainer = pl.Trainer(callbacks=[energy], **trainer_kwargs(fast_dev_run=True, default_root_dir=tmp_path))
    trainer.fit(MNIST1DClassifier(arch="mlp"), MNIST1DDataModule(num_samples=600, batch_size=32))
    assert trainer.global_step == 1 and energy.report_paths == [] and energy.report["status"] == "smoke_test"
    smoke = tmp_path / "smoke"
    smoke.mkdir()
    (smoke / JSON_NAME).write_text(json.dumps(energy.report))
    comparison = compare_runs(load_run(smoke), load_run(pulsed))
    rows = {row["figure"]: row for row in comparison["figures"]}
    for figure in ("duration_s", "energy_kwh", "co2_kg"):
        assert rows[figure]["note"].startswith(
            "A is a fast_dev_run smoke test: unequal work (A: 1 steps, B: 16)"
        )
        assert rows[figure]["ratio"] is None and rows[figure]["note"].endswith("; no ratio")  # withheld
    assert comparison["a"]["status"] == "smoke_test"
    assert chart_title(comparison).endswith(
        "\nA is a fast_dev_run smoke test: its totals cover only part of the run"
    )
    assert main(["compare", str(smoke), str(pulsed), "--out", str(tmp_path / "out")]) == 0
    markdown = (tmp_path / "out" / COMPARISON_MARKDOWN).read_text()
    assert "(smoke_test)" in markdown and "A is a fast_dev_run smoke test: unequal work" in markdown


def red_and_green_pixels(png: Path) -> int:
    from matplotlib.image import imread

    pixels = (imread(png)[..., :3] * 255).round()
    colours = np.array([[214, 39, 40], [44, 160, 44]])  # the chart's red and green
    return int((np.abs(pixels[:, :, None, :] - colours).sum(-1) < 6).any(-1).sum())


def test_the_chart_colours_only_time_energy_co2_and_cost(runs, tmp_path):
    # sweep C: optimizer steps and samples were painted red above 1, like costs; the docs colour only costs
    _, plain, pulsed = runs
    more_steps = report(plain)
    more_steps["total"]["steps"] *= 2
    more_steps["total"]["samples"] *= 2
    (tmp_path / JSON_NAME).write_text(json.dumps(more_steps))
    comparison = compare_runs(load_run(plain), load_run(tmp_path))
    comparison["metrics"] = []
    assert ratio_of(comparison, "steps") == 2.0 and ratio_of(comparison, "energy_kwh") == 1.0
    assert red_and_green_pixels(write_comparison_plot(comparison, tmp_path / "same_cost.png")) == 0
    more_steps["total"]["energy_kwh"] *= 2  # a cost above the baseline: red
    (tmp_path / JSON_NAME).write_text(json.dumps(more_steps))
    dearer = compare_runs(load_run(plain), load_run(tmp_path))
    assert red_and_green_pixels(write_comparison_plot(dearer, tmp_path / "dearer.png")) > 100
    more_steps["status"] = "interrupted"  # against a run that did not finish: no verdict in colour
    (tmp_path / JSON_NAME).write_text(json.dumps(more_steps))
    unfinished = compare_runs(load_run(plain), load_run(tmp_path))
    assert red_and_green_pixels(write_comparison_plot(unfinished, tmp_path / "unfinished.png")) == 0


@pytest.mark.parametrize(
    "edit, expected",
    [
        (lambda r: r.update(metrics=["x"]), "`metrics`=['x'] is not a mapping of metric names to numbers"),
        (lambda r: r["total"].update(energy_kwh="abc"), "`total.energy_kwh`='abc' is not a number or null"),
        (lambda r: r["metrics"].update(val_loss="low"), "`metrics.val_loss`='low' is not a number or null"),
        (lambda r: r["total"].update(energy_method=3), "`total.energy_method`=3 is not a method name"),
    ],
)
def test_a_hand_edited_report_of_the_wrong_types_is_refused_naming_the_file(
    runs, tmp_path, capsys, edit, expected
):
    # sweep C: `"metrics": ["x"]` failed with "dictionary update sequence element #0 ..." (no file named), and
    # `"energy_kwh": "abc"` was printed as a figure
    _, plain, _ = runs
    edited = report(plain)
    edit(edited)
    path = write(tmp_path / "edited.json", json.dumps(edited))
    assert main(["compare", str(plain), str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: `RUN_B`={str(path)!r}: {path}: "), err
    assert expected in err, err


def _fit_with_codecarbon_ram(root: Path, tracking_mode: str) -> Path:
    """A tiny run whose RAM codecarbon meters in ``tracking_mode``; returns its log directory."""
    pl.seed_everything(0, verbose=False)
    meters = MeterConfig(sampling_period=0.05, cpu_watts=10.0, codecarbon_tracking_mode=tracking_mode)
    energy = EnergyLogger(cpu="constant", ram="codecarbon", country_iso_code="DEU", meters=meters)
    trainer = pl.Trainer(
        callbacks=[energy],
        **trainer_kwargs(max_epochs=1, limit_train_batches=8, limit_val_batches=0, logger=CSVLogger(root)),
    )
    trainer.fit(MNIST1DClassifier(arch="mlp"), MNIST1DDataModule(num_samples=600, batch_size=32))
    return Path(trainer.logger.log_dir)


def test_runs_metered_in_different_codecarbon_tracking_modes_get_no_energy_ratio(tmp_path, capsys):
    # sweep-cli-yaml: the same run in "machine" (the baseline YAML plus EnergyLogger) and "process" mode (the
    # pulse YAML) compared at 0.59x energy with no note: the node's RAM against this process's share
    machine = _fit_with_codecarbon_ram(tmp_path / "machine", "machine")
    process = _fit_with_codecarbon_ram(tmp_path / "process", "process")
    assert report(machine)["meters"]["ram"]["tracking_mode"] == "machine"
    assert main(["compare", str(machine), str(process), "--out", str(tmp_path / "cmp")]) == 0
    out = capsys.readouterr().out
    assert "not comparable: codecarbon tracking mode 'machine' in A, 'process' in B (ram)" in out
    assert "Meter both runs with the same `meters.codecarbon_tracking_mode`." in out
    comparison = json.loads((tmp_path / "cmp" / COMPARISON_JSON).read_text())
    for figure in ("energy_kwh", "co2_kg", "cost"):
        row = next(row for row in comparison["figures"] if row["figure"] == figure)
        assert row["ratio"] is None, row
    assert "'machine' in A, 'process' in B" in comparison["not_comparable"]
    assert ratio_of(comparison, "duration_s") is not None and ratio_of(comparison, "steps") == 1.0

    # one tracking mode on both sides compares as before
    same = compare_runs(load_run(machine), load_run(machine))
    assert ratio_of(same, "energy_kwh") == 1.0 and same["not_comparable"] is None
    assert "not comparable" not in comparison_markdown(same)


class _Scored(MNIST1DClassifier):
    """Logs its validation accuracy under a name that says nothing of its direction too."""

    def validation_step(self, batch, batch_idx):
        super().validation_step(batch, batch_idx)
        self.log("val_score", self.val_acc)


def _fit_scored(root: Path, lr: float, baseline: str | None = None, monitor: bool = True) -> Path:
    """A tiny run of ``_Scored`` at ``lr`` (0: it never learns); with ``monitor``, a ModelCheckpoint on
    ``val_score`` in mode ``"max"``. Returns its log directory."""
    pl.seed_everything(0, verbose=False)
    callbacks: list = [
        EnergyLogger(
            cpu="constant",
            ram="none",
            meters=MeterConfig(sampling_period=0.05, cpu_watts=10.0),
            accounting=AccountingConfig(baseline=baseline),
        )
    ]
    if monitor:
        callbacks.append(ModelCheckpoint(dirpath=root / "checkpoints", monitor="val_score", mode="max"))
    trainer = pl.Trainer(
        callbacks=callbacks,
        **trainer_kwargs(
            max_epochs=2,
            limit_train_batches=8,
            limit_val_batches=2,
            logger=CSVLogger(root),
            enable_checkpointing=monitor,
        ),
    )
    trainer.fit(_Scored(arch="mlp", lr=lr), MNIST1DDataModule(num_samples=600, batch_size=32))
    return Path(trainer.logger.log_dir)


def test_a_run_worse_than_its_baseline_is_said_to_be_worse_beside_its_savings(tmp_path, caplog, capsys):
    # sw-savings (b): with a baseline, the comparison showed `val_acc` 0.909x next to a 0.25x energy with no
    # word that the result was worse; nothing said which way a metric is better
    plain = _fit_scored(tmp_path / "plain", lr=1e-2)
    with caplog.at_level(logging.INFO):
        worse = _fit_scored(tmp_path / "worse", lr=0.0, baseline=str(plain), monitor=False)
    a, b = report(plain)["metrics"], report(worse)["metrics"]
    assert b["val_acc"] < a["val_acc"] and b["val_loss"] > a["val_loss"]  # lr=0: it never learned
    comparison = report(worse)["comparison"]
    rows = {row["metric"]: row for row in comparison["metrics"]}
    for name, better in (("val_acc", "max"), ("val_loss", "min"), ("val_score", "max")):
        assert rows[name]["better"] == better and rows[name]["verdict"] == "worse", rows[name]
        assert rows[name]["difference"] == b[name] - a[name]
    # a training loss is measured on the batches each run trained (a replay run picks the hardest): not judged
    assert rows["train_loss"]["better"] is None and rows["train_loss"]["verdict"] is None
    # `val_score`'s direction is the baseline's ModelCheckpoint's mode, recorded in its report
    assert report(plain)["metric_modes"] == {"val_score": "max"} and report(worse)["metric_modes"] == {}
    drop = f"val_acc ({b['val_acc']:.4g} against {a['val_acc']:.4g}, {b['val_acc'] - a['val_acc']:+.4g})"
    assert comparison["worse"].startswith(f"Quality: B is worse than the baseline in {drop}, val_loss (")
    markdown = (worse / "energy_report.md").read_text()
    assert f"**{comparison['worse']}**" in markdown
    assert f"| {b['val_acc'] - a['val_acc']:+.4g} (worse than the baseline; higher is better) |" in markdown
    (line,) = [r.getMessage() for r in caplog.records if "against the baseline" in r.getMessage()]
    energy = ratio_of(comparison, "energy_kwh")
    assert (
        line.startswith("EnergyLogger: against the baseline, wall time ") and f"energy {energy:.3f}x" in line
    )
    assert (
        f"val_acc {b['val_acc']:.4g} against {a['val_acc']:.4g} (" in line
        and "worse than the baseline)" in line
    )

    # the other way round, from the command line: better, and no quality line
    assert main(["compare", str(worse), str(plain), "--out", str(tmp_path / "cmp")]) == 0
    out = capsys.readouterr().out
    assert "Quality:" not in out and "(better than the baseline; higher is better)" in out
    reverse = json.loads((tmp_path / "cmp" / COMPARISON_JSON).read_text())
    assert reverse["worse"] is None
    assert {row["metric"]: row["verdict"] for row in reverse["metrics"]}["val_acc"] == "better"
    # a worse metric is red in the chart, a better one green
    assert red_and_green_pixels(tmp_path / "cmp" / COMPARISON_PNG) > 100


def test_a_metric_a_monitor_watches_takes_the_monitors_mode(tmp_path):
    # `val_score` says nothing of its direction by name: the ModelCheckpoint that monitors it in mode "max"
    # does; the runs' modes are recorded in their reports, and a report edited into a mode of neither kind is
    # refused naming the entry
    plain = _fit_scored(tmp_path / "plain", lr=1e-2)
    worse = _fit_scored(tmp_path / "worse", lr=0.0, baseline=str(plain))
    assert report(worse)["metric_modes"] == {"val_score": "max"}
    row = next(row for row in report(worse)["comparison"]["metrics"] if row["metric"] == "val_score")
    assert row["better"] == "max" and row["verdict"] == "worse"
    flipped = report(worse)
    flipped["metric_modes"] = {"val_score": "min"}  # a monitor in mode "min": then lower is better
    path = write(tmp_path / "flipped.json", json.dumps(flipped))
    row = next(
        row
        for row in compare_runs(load_run(plain), load_run(path))["metrics"]
        if row["metric"] == "val_score"
    )
    assert row["better"] is None and row["verdict"] is None  # the two runs disagree: not judged
    flipped["metric_modes"] = {"val_score": "up"}
    with pytest.raises(ValueError, match=r"`metric_modes.val_score`='up' is not 'min' or 'max'"):
        load_run(write(tmp_path / "bad.json", json.dumps(flipped)))


def test_a_process_mode_ram_figure_is_said_to_be_a_constant_power_times_wall_time(tmp_path):
    # sw-savings problem 1: in codecarbon's process mode RAM is 10 W on x86 for any process up to 16 GB (its
    # floor of two DIMMs), 82-96% of a CPU fit's energy, so the energy ratio of two runs was their wall ratio;
    # the report and the comparison said the figure was "this process's share" of memory
    first = _fit_with_codecarbon_ram(tmp_path / "a", "process")
    second = _fit_with_codecarbon_ram(tmp_path / "b", "process")
    total = report(second)["total"]
    ram = total["energy_kwh_by_component"]["ram"]
    watts = ram * 3.6e6 / total["duration_s"]
    markdown = (second / "energy_report.md").read_text()
    assert (
        "RAM is codecarbon's `process`-mode estimate: a power priced by the size of the process's" in markdown
    )
    assert (
        f"Here {watts:.3g} W over the whole run, {100 * ram / total['energy_kwh']:.1f}% of the energy."
        in markdown
    )
    comparison = compare_runs(load_run(first), load_run(second))
    note = comparison["ram_note"]
    assert note.startswith(
        "RAM is codecarbon's `process`-mode estimate, a power priced by the size"
    ) and note in (comparison_markdown(comparison))
    total_a = report(first)["total"]
    share_a = total_a["energy_kwh_by_component"]["ram"] / total_a["energy_kwh"]
    # rv-savings S1: the watts are each run's own mean (codecarbon 2 prices RAM by size), not an assumed 10 W
    watts_a = total_a["energy_kwh_by_component"]["ram"] * 3.6e6 / total_a["duration_s"]
    assert f"({watts_a:.3g} W on average, {share_a:.0%} of A's energy; {watts:.3g} W on average, " in note
    assert "10 W" not in note
    assert f"energy {ratio_of(comparison, 'energy_kwh'):.3f}x, wall time " in note and "the CPU part " in note
    machine = _fit_with_codecarbon_ram(tmp_path / "m", "machine")  # the node's RAM: no such note
    assert compare_runs(load_run(machine), load_run(machine))["ram_note"] is None
    assert "`process`-mode" not in (machine / "energy_report.md").read_text()


class _Troubled(MNIST1DClassifier):
    """Logs its training loss under other spellings and its accuracy as `val_f1` too; with `crash_at` it raises
    at that step, with `diverge_at` its loss is NaN from that step on (a run that diverged)."""

    crash_at: int | None = None
    diverge_at: int | None = None

    def training_step(self, batch, batch_idx):
        if self.crash_at is not None and self.global_step >= self.crash_at:
            raise RuntimeError("crashed on purpose")
        loss = super().training_step(batch, batch_idx)
        for name in ("loss", "training_loss", "trn_loss"):
            self.log(name, loss)
        if self.diverge_at is not None and self.global_step >= self.diverge_at:
            return loss * float("nan")
        return loss

    def validation_step(self, batch, batch_idx):
        super().validation_step(batch, batch_idx)
        self.log("val_f1", self.val_acc)


def _fit_troubled(root: Path, baseline: str | None = None, **trouble) -> Path:
    """A 12-step run of ``_Troubled`` (``trouble``: its ``crash_at`` / ``diverge_at``), lr 0 for the
    baseline (no baseline given) so that the other run's training metrics differ; returns its report's
    folder."""
    pl.seed_everything(0, verbose=False)
    model = _Troubled(arch="mlp", lr=1e-2 if baseline else 0.0)
    model.crash_at, model.diverge_at = trouble.get("crash_at"), trouble.get("diverge_at")
    energy = EnergyLogger(
        cpu="constant",
        ram="none",
        report_dir=str(root),
        meters=MeterConfig(sampling_period=0.05, cpu_watts=10.0),
        accounting=AccountingConfig(baseline=baseline),
    )
    trainer = pl.Trainer(
        callbacks=[energy],
        **trainer_kwargs(max_epochs=2, limit_train_batches=6, limit_val_batches=2, default_root_dir=root),
    )
    try:
        trainer.fit(model, MNIST1DDataModule(num_samples=600, batch_size=32))
    except RuntimeError as error:
        assert "crashed on purpose" in str(error)
    return root


def _fit_end_line(caplog) -> str:
    (line,) = [r.getMessage() for r in caplog.records if "against the baseline" in r.getMessage()]
    return line


def test_the_fit_end_line_of_a_crashed_run_says_its_ratios_are_of_unequal_work(tmp_path, caplog):
    # rv-savings M1: a run that raised at step 8 of 12 read "wall time 0.222x, energy 0.222x" at fit end, as a
    # saving; the report's note "B is interrupted: unequal work" was in the Markdown and the PNG only
    plain = _fit_troubled(tmp_path / "plain")
    with caplog.at_level(logging.INFO):
        crashed = _fit_troubled(tmp_path / "crashed", baseline=str(plain), crash_at=8)
    assert report(crashed)["status"] == "interrupted" and report(crashed)["total"]["steps"] == 8
    line = _fit_end_line(caplog)
    energy = ratio_of(report(crashed)["comparison"], "energy_kwh")
    assert f"energy {energy:.3f}x, not a saving: B is interrupted: unequal work (A: 12 steps, B: 8); " in line


def test_training_losses_of_any_spelling_are_shown_not_judged_and_f1_is_judged(tmp_path):
    # rv-savings M2: `loss`, `training_loss` and `trn_loss` (the batches the run trained: the hardest ones under
    # HardSampleReplay) were judged "min" by name, `train_loss` not; S3: `f1` / `r2` lost their digit and were
    # never judged
    plain = _fit_troubled(tmp_path / "plain")
    other = _fit_troubled(tmp_path / "other", baseline=str(plain))
    rows = {row["metric"]: row for row in report(other)["comparison"]["metrics"]}
    for name in ("loss", "training_loss", "trn_loss", "train_loss"):
        assert rows[name]["difference"] and rows[name]["better"] is None and rows[name]["verdict"] is None
    assert rows["val_f1"]["better"] == "max" and rows["val_f1"]["verdict"] in ("better", "equal")
    assert rows["val_acc"]["better"] == "max" and rows["val_loss"]["better"] == "min"
    for name, better in (
        ("val_r2", "max"),
        ("test_top1", "max"),
        ("val_acc5", "max"),
        ("val_loss_gap", None),
    ):
        assert metric_direction(name) == better, name
    assert metric_direction("acc") is None and metric_direction("f1") is None  # no held-out part
    # a monitor names the direction of any metric it watches, a training one too
    assert metric_direction("trn_loss", {"trn_loss": "min"}) == "min"


def test_a_diverged_run_is_worse_than_its_finite_baseline(tmp_path, caplog):
    # rv-savings M3: a run whose val_loss went NaN had it dropped from its report, and the fit-end line said "no
    # final metric whose better direction is known"
    plain = _fit_troubled(tmp_path / "plain")
    with caplog.at_level(logging.INFO):
        diverged = _fit_troubled(tmp_path / "diverged", baseline=str(plain), diverge_at=3)
    written = report(diverged)
    assert written["nonfinite_metrics"]["val_loss"] == "nan" and "val_loss" not in written["metrics"]
    rows = {row["metric"]: row for row in written["comparison"]["metrics"]}
    assert rows["val_loss"]["b"] == "nan" and rows["val_loss"]["verdict"] == "worse"
    a = report(plain)["metrics"]["val_loss"]
    line = _fit_end_line(caplog)
    assert f"val_loss nan against {a:.4g} (not finite, worse than the baseline)" in line, line
    assert "no final metric" not in line
    assert f"val_loss (nan against {a:.4g}: not finite)" in written["comparison"]["worse"]
    assert "| val_loss |" in comparison_markdown(written["comparison"])
    # from the command line too: the report's `nonfinite_metrics` is read back
    again = compare_runs(load_run(plain), load_run(diverged))
    assert {row["metric"]: row["verdict"] for row in again["metrics"]}["val_loss"] == "worse"
    # a judged metric of the baseline missing from B is named
    missing = dict(written, nonfinite_metrics={})
    path = write(tmp_path / "missing.json", json.dumps(missing))
    assert "B has no val_loss" in comparison_line(compare_runs(load_run(plain), load_run(path)))


def test_a_monitor_mode_against_the_name_is_not_judged_and_float_noise_is_equal(tmp_path):
    # rv-savings S2: ModelCheckpoint(monitor="val_acc") keeps Lightning's default mode="min", and a run with a
    # higher accuracy was called worse; S4: two float32 neighbours of one accuracy were "worse"
    plain = _fit_scored(tmp_path / "plain", lr=1e-2)
    worse = _fit_scored(tmp_path / "worse", lr=0.0, baseline=str(plain))
    slip = report(worse)
    slip["metric_modes"] = {"val_acc": "min"}
    path = write(tmp_path / "slip.json", json.dumps(slip))
    comparison = compare_runs(load_run(plain), load_run(path))
    row = next(row for row in comparison["metrics"] if row["metric"] == "val_acc")
    assert row["better"] is None and row["verdict"] is None
    assert "(not judged: the monitor says min, the name says max)" in comparison_markdown(comparison)
    a = float(np.float32(0.9413))
    b = float(np.nextafter(np.float32(a), np.float32(0)))
    assert verdict(a, b, "max") == "equal" and verdict(a, a - 1e-4, "max") == "worse"
    row = {"a": 0.941204, "b": 0.941201, "difference": 0.941201 - 0.941204}
    assert pair_text(row).startswith("0.941201 against 0.941204")  # the precision that tells them apart


class _Reward(pl.LightningModule):
    """A digits classifier whose shared step returns the reward ``-cross_entropy``, ascended
    (``maximize=True``), and logs it as ``train_loss`` and ``val_loss``, next to ``val_acc``."""

    def __init__(self, lr: float) -> None:
        super().__init__()
        self.lr = lr
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))

    def _step(self, batch):
        return -torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1])

    def training_step(self, batch, batch_idx):
        reward = self._step(batch)
        self.log("train_loss", reward)
        return reward

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._step(batch))
        self.log("val_acc", (self.net(batch[0]).argmax(1) == batch[1]).float().mean())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, maximize=True)


def _fit_reward(root: Path, lr: float, baseline: str | None = None) -> Path:
    from sklearn.datasets import load_digits

    digits = load_digits()
    x, y = torch.tensor(digits.data[:384] / 16, dtype=torch.float32), torch.tensor(digits.target[:384])
    pl.seed_everything(0, verbose=False)
    logger = EnergyLogger(
        cpu="constant",
        ram="none",
        meters=MeterConfig(sampling_period=0.05, cpu_watts=10.0),
        accounting=AccountingConfig(baseline=baseline),
    )
    trainer = pl.Trainer(callbacks=[logger], **trainer_kwargs(max_epochs=2, logger=CSVLogger(root)))
    train, val = TensorDataset(x[:256], y[:256]), TensorDataset(x[256:], y[256:])
    trainer.fit(_Reward(lr), DataLoader(train, batch_size=32), DataLoader(val, batch_size=64))
    return Path(trainer.logger.log_dir)


def test_a_loss_named_metric_of_a_run_that_ascends_its_objective_is_not_judged_by_its_name(tmp_path, caplog):
    # held-out: a module ascending the reward -CE logs it as `val_loss`; a run at lr=0, which never learned,
    # was called better than its baseline in val_loss (-2.329 against -2.253: lower), next to a val_acc of
    # 0.008 against 0.19
    plain = _fit_reward(tmp_path / "plain", lr=0.1)
    with caplog.at_level(logging.INFO):
        worse = _fit_reward(tmp_path / "worse", lr=0.0, baseline=str(plain))
    written = report(worse)
    assert report(plain)["loss_maximized"] is True and written["loss_maximized"] is True
    rows = {row["metric"]: row for row in written["comparison"]["metrics"]}
    assert rows["val_loss"]["b"] < rows["val_loss"]["a"] < 0  # the reward, lower: worse
    assert rows["val_loss"]["better"] is None and rows["val_loss"]["verdict"] is None
    assert rows["val_loss"]["note"] == (
        "both runs' optimizers ascend the value the module returns (`maximize=True`), so val_loss may hold "
        "that reward, better higher, rather than a loss; a monitor's `mode` judges it"
    )
    assert rows["val_acc"]["verdict"] == "worse"  # an accuracy is one whichever way the objective goes
    (line,) = [r.getMessage() for r in caplog.records if "against the baseline" in r.getMessage()]
    assert "val_loss" not in line and "better than the baseline" not in line
    assert "(not judged: both runs' optimizers ascend" in comparison_markdown(written["comparison"])
    # a monitor's mode is the user's word: it judges the metric; a baseline that descended names run B only
    written["metric_modes"] = {"val_loss": "max"}
    path = write(tmp_path / "monitored.json", json.dumps(written))
    row = next(
        r for r in compare_runs(load_run(plain), load_run(path))["metrics"] if r["metric"] == "val_loss"
    )
    assert row["better"] == "max" and row["verdict"] == "worse" and row["note"] is None
    descended = dict(report(plain), loss_maximized=False)
    path = write(tmp_path / "descended.json", json.dumps(descended))
    row = next(
        r for r in compare_runs(load_run(path), load_run(worse))["metrics"] if r["metric"] == "val_loss"
    )
    assert row["verdict"] is None and row["note"].startswith("run B's optimizer ascends the value")
    # a report edited into another type is refused naming the entry
    with pytest.raises(ValueError, match=r"`loss_maximized`='yes' is not true or false"):
        load_run(write(tmp_path / "bad.json", json.dumps(dict(descended, loss_maximized="yes"))))
