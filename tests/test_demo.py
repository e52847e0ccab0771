"""``python -m examples.demo`` (``make demo``): its timed arms start after an untimed warm-up fit, and a
config with no pulse method is refused before any fit."""

from __future__ import annotations

import json
import logging
import sys
import warnings

import pytest
import yaml

import benchmarks.harness as harness
from examples import demo

# a meter that needs no codecarbon: the tests check the order of fits, not energy figures
CONSTANT_METER = {
    "class_path": "lightning_pulse.EnergyLogger",
    "init_args": {"country_iso_code": "DEU", "cpu": "constant", "ram": "none", "meters": {"cpu_watts": 10.0}},
}


def write_config(path, callbacks):
    config = {
        "trainer": {"max_epochs": 1, "callbacks": callbacks},
        "model": {"class_path": "examples.mnist1d.MNIST1DClassifier", "init_args": {"arch": "cnn"}},
        "data": {
            "class_path": "examples.mnist1d.MNIST1DDataModule",
            "init_args": {"num_samples": 500, "batch_size": 100},
        },
    }
    path.write_text(yaml.safe_dump(config))
    return path


def run_demo(monkeypatch, arguments):
    """``demo.main`` in this process: its quieting of Lightning (a global warnings filter and logger levels,
    right for a command) is undone after it, or every later test that expects a warning fails."""
    monkeypatch.setattr(sys, "argv", ["python -m examples.demo", *arguments])
    levels = {name: logging.getLogger(name).level for name in demo.LIGHTNING_LOGGERS}
    try:
        with warnings.catch_warnings():
            demo.main()
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


@pytest.fixture
def fits(monkeypatch):
    """Every fit the harness runs, in order: (arm, trainer arguments, the arm's callback classes)."""
    recorded = []
    real_run_one = harness.run_one

    def recording_run_one(workload, arm, seed, trainer_kwargs, workload_kwargs, count_flops):
        specs = getattr(arm.callbacks, "specs", [])
        names = [spec["class_path"].rpartition(".")[2] for spec in specs]
        recorded.append((arm.name, dict(trainer_kwargs), names))
        return real_run_one(workload, arm, seed, trainer_kwargs, workload_kwargs, count_flops)

    monkeypatch.setattr(harness, "run_one", recording_run_one)
    return recorded


def test_an_untimed_warm_up_fit_with_the_suite_and_its_meter_runs_before_the_first_timed_arm(
    tmp_path, fits, monkeypatch
):
    # the plain arm runs first: without the warm-up it carried the process's one-time costs (codecarbon's
    # start), and the demo's control (both arms training alike) read 0.2x to 0.6x fit wall time, pulse/plain
    cycle = {
        "class_path": "lightning_pulse.PulseCycle",
        "init_args": {"burst": 3, "replay": 2, "maintain": 0},
    }
    config = write_config(tmp_path / "pulse.yaml", [cycle, CONSTANT_METER])
    output = tmp_path / "demo" / "summary.json"
    run_demo(monkeypatch, ["--config", str(config), "--channels", "4", "--output", str(output)])

    first_arm, first_trainer, first_callbacks = fits[0]
    assert first_arm == "warm-up" and "max_steps" in first_trainer, fits
    assert first_callbacks == ["PulseCycle", "EnergyLogger"]
    assert [arm for arm, _, _ in fits[1:]] == ["plain", "plain", "pulse", "pulse"]  # timed + FLOP-counted
    assert all(trainer == {"max_epochs": 1} for _, trainer, _ in fits[1:])
    # the warm-up is in no reported figure: the runs are the two arms, and each arm's timed energy report
    # (pass 1) is its own; the warm-up's report is in a folder of its own
    result = json.loads(output.read_text())
    assert [run["arm"] for run in result["runs"]] == ["plain", "pulse"]
    assert sorted(p.name for p in (output.parent / "plain").iterdir()) == ["pass1", "pass2"]
    assert (output.parent / "warm-up" / "pass1" / "energy_report.json").exists()


@pytest.mark.parametrize("callbacks", [[], [CONSTANT_METER]], ids=["no callbacks", "EnergyLogger only"])
def test_a_config_with_no_pulse_method_is_refused_before_any_fit(
    tmp_path, fits, capsys, callbacks, monkeypatch
):
    config = write_config(tmp_path / "plain.yaml", callbacks)
    output = tmp_path / "demo" / "summary.json"
    with pytest.raises(SystemExit) as refused:
        run_demo(monkeypatch, ["--config", str(config), "--channels", "4", "--output", str(output)])

    assert refused.value.code == 2
    message = capsys.readouterr().err
    assert f"--config {config}" in message and "trainer.callbacks" in message and "pulse" in message
    assert fits == []
    assert not output.parent.exists()


def test_a_suite_without_pulse_cycle_reports_all_its_steps_as_burst_steps(tmp_path, fits, monkeypatch):
    guard = {"class_path": "lightning_pulse.StabilityGuard"}
    config = write_config(tmp_path / "guard.yaml", [guard, CONSTANT_METER])
    output = tmp_path / "demo" / "summary.json"
    run_demo(monkeypatch, ["--config", str(config), "--channels", "4", "--output", str(output)])

    result = json.loads(output.read_text())
    plain_steps, pulse_steps = (run["steps"] for run in result["runs"])
    assert f"| steps burst/replay/maintain | {plain_steps}/0/0 | {pulse_steps}/0/0 |" in (
        output.with_suffix(".md").read_text()
    )


def test_the_energy_rows_leave_out_co2_where_the_meter_knows_no_grid():
    # a held-out fix's find: an EnergyLogger without `country_iso_code` reports `co2_kg` None, and formatting
    # it raised TypeError after both fits, losing their figures
    plain = {"energy_kwh": 2e-4, "energy_method": "estimated", "co2_kg": None, "co2_method": "none"}
    pulse = {"energy_kwh": 1e-4, "energy_method": "estimated", "co2_kg": None, "co2_method": "none"}
    assert demo.energy_rows(plain, pulse) == [("energy, kWh (estimated)", "0.0002", "0.0001", "0.500x")]
    plain.update(co2_kg=4e-5, co2_method="intensity")
    pulse.update(co2_kg=2e-5, co2_method="intensity")
    assert demo.energy_rows(plain, pulse)[1] == ("CO2, kg (intensity)", "4e-05", "2e-05", "0.500x")
