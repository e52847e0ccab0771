"""The lightning-pulse console script: YAML configs end to end, --print_config, and bad input."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lightning_pulse import PulseCycle
from lightning_pulse.cli import HeldSeedLines, PulseCLI, main

ROOT = Path(__file__).resolve().parents[1]
PULSE_YAML = str(ROOT / "examples" / "mnist1d" / "pulse.yaml")
FAST = ["--trainer.max_steps", "8", "--trainer.logger", "false", "--trainer.enable_progress_bar", "false"]
FAST += ["--data.num_samples", "600", "--trainer.enable_checkpointing", "false"]


def test_pulse_yaml_trains_end_to_end_with_the_cycle_attached(tmp_path):
    cli = PulseCLI(
        model_class=None,
        datamodule_class=None,
        subclass_mode_model=True,
        subclass_mode_data=True,
        args=["fit", "--config", PULSE_YAML, *FAST, "--trainer.default_root_dir", str(tmp_path)],
    )
    cycles = [cb for cb in cli.trainer.callbacks if isinstance(cb, PulseCycle)]
    assert len(cycles) == 1
    assert cli.trainer.global_step == 8
    assert sum(cycles[0].clock.steps_by_phase.values()) == 8
    assert (tmp_path / "config.yaml").exists()


def test_top_level_help_names_the_commands_besides_lightnings(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code in (0, None)
    shown = " ".join(capsys.readouterr().out.split())  # argparse wraps the epilog
    for command in ("fit", "report DIR", "compare RUN_A RUN_B", "wait-for-window DIR"):
        assert command in shown


def test_print_config_round_trips(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", PULSE_YAML, "--print_config"])
    assert exit_info.value.code in (0, None)
    first = capsys.readouterr().out
    printed = tmp_path / "printed.yaml"
    printed.write_text(first)
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(printed), "--print_config"])
    second = capsys.readouterr().out
    assert yaml.safe_load(first) == yaml.safe_load(second)
    callbacks = yaml.safe_load(first)["trainer"]["callbacks"]
    assert callbacks[0]["class_path"].endswith("PulseCycle")
    assert callbacks[0]["init_args"]["burst"] == 36


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        ("burst: 36", "burst: -5min", "PulseCycle: `burst`='-5min' must be finite and non-negative"),
        (
            "burst: 36",
            "burts: 36",
            "`trainer.callbacks[0]` PulseCycle: Option 'burts' is not accepted (did you mean burst?); "
            "PulseCycle accepts: burst, ",
        ),
        ("replay_fraction: 0.5", "replay_fraction: 1.5", "`replay_fraction`=1.5"),
        ("warmup: 0.1", "warmup: lots", "PulseCycle: `warmup`=lots is not accepted; expected float"),
        ("anneal: 0.1", "anneal: 0.95", "PulseCycle: `warmup` + `anneal`"),
        (
            "burst: 36",
            "order: [burst, replayy]",
            "PulseCycle: `order`=['burst', 'replayy'] names an unknown phase",
        ),
        (
            "burst: 36\n        replay: 72\n        maintain: 4",
            "burst: 0\n        replay: 0\n        maintain: 0",
            "PulseCycle: Every phase in the cycle has zero duration (`burst`=0, `replay`=0, `maintain`=0)",
        ),
    ],
)
def test_bad_yaml_value_stops_before_training_with_the_callbacks_sentence_first(
    tmp_path, capsys, old, new, expected
):
    text = Path(PULSE_YAML).read_text()
    assert old in text
    bad = tmp_path / "bad.yaml"
    bad.write_text(text.replace(old, new))
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(bad), "--trainer.default_root_dir", str(tmp_path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("error: ") and expected in err[0], err[0]
    assert len(err) <= 2  # the sentence, and one line on how to see more
    assert not list(tmp_path.rglob("*.ckpt"))  # nothing trained


def test_a_typo_in_a_callback_option_on_the_command_line_names_that_callback(tmp_path, capsys):
    # the union's fallback (Lightning's base Callback) used to be named instead: "Callback accepts: args, kwargs"
    added = ["--trainer.callbacks+=lightning_pulse.StabilityGuard", "--trainer.callbacks.snapshot_evry", "10"]
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", PULSE_YAML, *added, "--trainer.default_root_dir", str(tmp_path)])
    assert exit_info.value.code == 2
    first = capsys.readouterr().err.strip().splitlines()[0]
    assert first.startswith("error: StabilityGuard: Option 'snapshot_evry' is not accepted"), first
    assert "snapshot_every" in first


def test_a_refused_value_is_the_first_line_the_user_reads_and_the_seed_line_follows_a_good_one(
    tmp_path, caplog
):
    # in a terminal, Lightning's "Seed set to 0" used to come before the error (the seed is set before the
    # classes are built); it is held back until they are, and dropped when one is refused. The refused run is
    # a real process, so the order is that of a terminal's stderr.
    text = Path(PULSE_YAML).read_text()
    bad = tmp_path / "bad.yaml"
    bad.write_text(text.replace("budget: 0.6", "budget: 1.7"))
    command = [sys.executable, "-m", "lightning_pulse.cli", "fit", "--config", str(bad)]
    command += ["--trainer.default_root_dir", str(tmp_path)]
    refused = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    lines = [line for line in refused.stderr.splitlines() if line.strip()]
    assert refused.returncode == 2 and lines[0].startswith("error: PulseCycle: `budget`=1.7"), lines[:3]
    assert "Seed set to" not in refused.stderr
    # a good one releases the held line (in this process: a second interpreter would only import again)
    caplog.set_level(logging.INFO, logger=HeldSeedLines.SEED_LOGGER)
    good = [*FAST, "--trainer.max_steps", "2", "--trainer.default_root_dir", str(tmp_path / "good")]
    assert main(["fit", "--config", PULSE_YAML, *good]) == 0
    assert "Seed set to 0" in caplog.text


def _unbounded_run(tmp_path) -> list[str]:
    """The pulse YAML with no step or epoch limit: its warm-up cannot be planned, so PulseCycle refuses it."""
    unbounded = ["--trainer.max_steps", "-1", "--trainer.max_epochs", "-1", "--model.scheduler", "none"]
    return ["fit", "--config", PULSE_YAML, *FAST, *unbounded, "--trainer.default_root_dir", str(tmp_path)]


def test_a_refusal_at_fit_start_is_one_line_with_no_traceback_and_no_report(tmp_path, capsys):
    # warm-up is a share of the run, so a run of unknown length is refused when training starts
    code = main(_unbounded_run(tmp_path))
    assert code == 2
    err = capsys.readouterr().err
    first = [line for line in err.splitlines() if line.startswith("error: ")]
    assert first and first[0].startswith(
        "error: PulseCycle: `warmup`=0.1 and `anneal`=0.1 are shares of the run"
    ), err
    assert "or `warmup=0` and `anneal=0`" in first[0]  # the way out, for both shares
    assert "Traceback" not in err
    assert not list(tmp_path.rglob("energy_report*"))  # no report for a run that never started


def test_the_traceback_is_there_when_asked_for(tmp_path, monkeypatch):
    from lightning_pulse.errors import PulseRefusal

    monkeypatch.setenv("LIGHTNING_PULSE_TRACEBACK", "1")
    with pytest.raises(PulseRefusal, match="PulseCycle: `warmup`=0.1 and `anneal`=0.1 are shares of the run"):
        main(_unbounded_run(tmp_path))


def test_console_script_resolves_class_paths_from_the_working_directory(tmp_path):
    """The installed `lightning-pulse` script finds `examples.*` when run from the repo root."""
    script = Path(sys.executable).with_name("lightning-pulse")
    if not script.exists():
        pytest.skip("console script not installed in this environment")
    env = {**os.environ, "PYTHONPATH": ""}
    result = subprocess.run(
        [str(script), "fit", "--config", PULSE_YAML, "--print_config"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,  # a hang bound only: a busy machine took 54 s to import here
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "examples.mnist1d.MNIST1DClassifier" in result.stdout


def test_wait_for_window_on_a_completed_run_says_so_and_exits_3_so_a_wrapper_loop_ends(tmp_path, capsys):
    # a sweep: a completed run's file kept its last suspend; `while wait-for-window DIR; do <resume>; done`
    # retrained the run's tail from that checkpoint on every pass, and never ended
    from lightning_pulse.core.green_window import mark_resume_files_finished

    mark_resume_files_finished(tmp_path, [], 1592215200.0, 40)
    assert main(["wait-for-window", str(tmp_path)]) == 3
    assert main(["wait-for-window", str(tmp_path / "green_window.json"), "--print", "--format", "unix"]) == 3
    out, err = capsys.readouterr()
    assert out == ""  # `sbatch --begin=$(... --print)` reads nothing
    assert (
        err.count("the run finished at step 40 (2020-06-15 10:00:00 UTC); there is nothing to resume.") == 2
    )
    with pytest.raises(SystemExit):
        main(["wait-for-window", "--help"])
    assert "3 the run has completed" in " ".join(capsys.readouterr().out.split())
    result = subprocess.run(  # the exit status a shell sees
        [sys.executable, "-m", "lightning_pulse.cli", "wait-for-window", str(tmp_path)],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=280,  # a hang bound only (pytest's own: 300 s)
    )
    assert result.returncode == 3 and result.stdout == "", result.stderr[-2000:]


@pytest.mark.parametrize(
    "config",
    sorted(str(p) for p in ROOT.glob("examples/*/*.yaml")),
    ids=lambda p: Path(p).parent.name + "/" + Path(p).name,
)
def test_every_example_config_parses(config, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", config, "--print_config"])
    assert exit_info.value.code in (0, None)
    assert "class_path" in capsys.readouterr().out


def test_report_subcommand_re_renders_an_energy_report(tmp_path, capsys):
    from lightning_pulse.energy.report import JSON_NAME, MARKDOWN_NAME, write_report
    from tests.test_energy_report import small_report

    write_report(small_report(), tmp_path)
    (tmp_path / MARKDOWN_NAME).unlink()
    assert main(["report", str(tmp_path)]) == 0
    assert (tmp_path / MARKDOWN_NAME).exists()
    assert MARKDOWN_NAME in capsys.readouterr().out
    (tmp_path / JSON_NAME).write_text("{}")
    with pytest.raises(SystemExit) as exit_info:
        main(["report", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "not a lightning-pulse energy report" in capsys.readouterr().err


def test_report_subcommand_finds_the_report_below_a_log_root_as_compare_does(tmp_path, capsys):
    # sweep C: `report LOGROOT` failed ("No energy_report.json in ...") where `compare LOGROOT` searched
    # below it
    from lightning_pulse.energy.report import MARKDOWN_NAME, write_report
    from tests.test_energy_report import small_report

    run = tmp_path / "lightning_logs" / "version_0"
    write_report(small_report(), run)
    (run / MARKDOWN_NAME).unlink()
    assert main(["report", str(tmp_path)]) == 0
    assert (run / MARKDOWN_NAME).exists() and str(run / MARKDOWN_NAME) in capsys.readouterr().out
    write_report(small_report(), tmp_path / "lightning_logs" / "version_1")
    with pytest.raises(SystemExit) as exit_info:  # two runs below it: which one is not guessed
        main(["report", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "2 energy reports below it (lightning_logs/version_0, lightning_logs/version_1)" in (
        capsys.readouterr().err
    )


def test_held_seed_lines_come_out_at_release_and_the_hooks_go_back(caplog):
    import logging
    import warnings

    from lightning_pulse.cli import HeldSeedLines

    show = warnings.showwarning
    caplog.set_level(logging.INFO, logger=HeldSeedLines.SEED_LOGGER)
    with HeldSeedLines() as held:
        logging.getLogger(HeldSeedLines.SEED_LOGGER).info("Seed set to 0")
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.warn("No seed found, seed set to 7", stacklevel=1)
        assert not caplog.records and len(held.warnings) == 1  # held
        held.release()
        assert [record.getMessage() for record in caplog.records] == ["Seed set to 0"]
        # warnings.showwarning was left replaced for the rest of the run (a bound method is never `is` itself)
        assert warnings.showwarning is show
    with HeldSeedLines():
        logging.getLogger(HeldSeedLines.SEED_LOGGER).info("dropped")
    assert warnings.showwarning is show and len(caplog.records) == 1
    assert not logging.getLogger(HeldSeedLines.SEED_LOGGER).filters


GRID = str(ROOT / "examples" / "data" / "carbon" / "de_2020_june_excerpt.csv")
_MAPPING = "is not accepted; expected a mapping of"


@pytest.mark.parametrize(
    ("callback", "expected"),
    [
        # a word where a list goes: the sentence was "Expected a <class 'collections.abc.Sequence'>", no field
        (
            {"class_path": "lightning_pulse.PulseCycle", "init_args": {"order": "burst"}},
            "PulseCycle: `order`=burst is not accepted; expected a list (in YAML, [burst] for a single item)",
        ),
        (
            {"class_path": "lightning_pulse.HardSampleReplay", "init_args": {"phases": "replay"}},
            "HardSampleReplay: `phases`=replay is not accepted; expected a list (in YAML, [replay]",
        ),
        (
            {"class_path": "lightning_pulse.GradientCache", "init_args": {"phases": "replay"}},
            "GradientCache: `phases`=replay is not accepted; expected a list (in YAML, [replay]",
        ),
        (
            {"class_path": "lightning_pulse.ScheduledPrune", "init_args": {"layer_types": "Linear"}},
            "ScheduledPrune: `layer_types`=Linear is not accepted; expected a list (in YAML, [Linear]",
        ),
        # a nested config given no mapping: the line was `Parser key "trainer.callbacks":` and nothing else
        (
            {"class_path": "lightning_pulse.EnergyLogger", "init_args": {"accounting": 5}},
            f"EnergyLogger: `accounting`=5 {_MAPPING} AccountingConfig's options (carbon_intensity_start, ",
        ),
        (
            {"class_path": "lightning_pulse.EnergyLogger", "init_args": {"meters": [1, 2]}},
            f"EnergyLogger: `meters`=[1, 2] {_MAPPING} MeterConfig's options (sampling_period, ",
        ),
        (
            {"class_path": "lightning_pulse.StabilityGuard", "init_args": {"config": [1]}},
            f"StabilityGuard: `config`=[1] {_MAPPING} StabilityGuardConfig's options (min_ratio, ",
        ),
        (
            {"class_path": "lightning_pulse.GreenWindow", "init_args": {"signal": GRID, "options": [1]}},
            f"GreenWindow: `options`=[1] {_MAPPING} GreenWindowOptions's options (slot, ",
        ),
        (
            {"class_path": "lightning_pulse.ScheduledPrune", "init_args": {"options": 5}},
            f"ScheduledPrune: `options`=5 {_MAPPING} PruneOptions's options (",
        ),
        # a word was tried as a config file: the line was "Expected a path but fast either not accessible ..."
        (
            {"class_path": "lightning_pulse.EnergyLogger", "init_args": {"meters": "fast"}},
            f"EnergyLogger: `meters`=fast {_MAPPING} MeterConfig's options (sampling_period, gpu_devices, "
            "cpu_watts, rapl_root, codecarbon_tracking_mode), the path of a YAML file holding one, or null.",
        ),
    ],
    ids=lambda value: (
        f"{value['class_path'].rpartition('.')[2]}.{list(value['init_args'])[-1]}"
        if isinstance(value, dict)
        else ""
    ),
)
def test_a_value_of_the_wrong_shape_names_the_callbacks_field_on_the_first_line(
    tmp_path, capsys, callback, expected
):
    config = yaml.safe_load(Path(PULSE_YAML).read_text())
    config["trainer"]["callbacks"] = [callback]
    config["trainer"]["default_root_dir"] = str(tmp_path)
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(config))
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(bad)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("error: ") and expected in err[0], err[0]
    assert "or null" in err[0] or "a list" in err[0]  # what is allowed
    assert len(err) <= 2  # the sentence, and one line on how to see more
    assert not list(tmp_path.rglob("*.ckpt")) and not list(
        tmp_path.rglob("energy_report*")
    )  # nothing trained


def _pulse_config_with_callbacks(tmp_path, callbacks) -> str:
    """The pulse YAML with ``trainer.callbacks`` replaced, written under ``tmp_path``."""
    config = yaml.safe_load(Path(PULSE_YAML).read_text())
    config["trainer"]["callbacks"] = callbacks
    config["trainer"]["default_root_dir"] = str(tmp_path)
    path = tmp_path / "config_under_test.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def _first_error_line(capsys, args) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) <= 2  # the sentence, and one line on how to see more
    return err[0]


_BAD_CYCLE = {"class_path": "lightning_pulse.PulseCycle", "init_args": {"burst": "-5min"}}
_SHORT_GUARD = {"class_path": "lightning_pulse.StabilityGuard", "init_args": {"window": 4}}


@pytest.mark.parametrize(
    ("callback", "expected"),
    [
        (_BAD_CYCLE, "error: PulseCycle: `burst`='-5min' must be finite and non-negative"),
        (_SHORT_GUARD, "error: StabilityGuard: `warmup`=50 must not exceed `window`=4."),
    ],
    ids=["constructor", "guard"],
)
@pytest.mark.parametrize("given_as", ["yaml", "command-line"])
def test_a_single_callback_mapping_is_reported_as_the_same_callback_in_a_list(
    tmp_path, capsys, callback, expected, given_as
):
    # Lightning types trainer.callbacks `list[Callback] | Callback`: a single mapping's refused value was
    # reported as "PulseCycle: Expected a <class 'list'>" (the list branch's line), naming no field
    if given_as == "yaml":
        args = ["fit", "--config", _pulse_config_with_callbacks(tmp_path, callback)]
    else:
        args = ["fit", "--config", PULSE_YAML, "--trainer.callbacks", json.dumps(callback)]
        args += ["--trainer.default_root_dir", str(tmp_path)]
    single = _first_error_line(capsys, args)
    in_a_list = _first_error_line(
        capsys, ["fit", "--config", _pulse_config_with_callbacks(tmp_path, [callback])]
    )
    assert single.startswith(expected), single
    assert single == in_a_list


@pytest.mark.parametrize(
    ("added", "expected"),
    [
        (
            [
                "--trainer.callbacks+=lightning_pulse.HyperConnectionMonitor",
                "--trainer.callbacks.every_n_steps=often",
            ],
            "error: HyperConnectionMonitor: `every_n_steps`=often is not accepted; expected int.",
        ),
        (
            ["--trainer.callbacks=lightning_pulse.PulseCycle", "--trainer.callbacks.init_args.warmup=abc"],
            "error: PulseCycle: `warmup`=abc is not accepted; expected float.",
        ),
    ],
    ids=["appended", "single"],
)
def test_a_wrong_typed_callback_option_on_the_command_line_names_the_field(tmp_path, capsys, added, expected):
    # the union's fallback (Lightning's base Callback, "Option 'every_n_steps' is not accepted") kept the
    # field out: "HyperConnectionMonitor: Expected a <class 'int'>. Got value: often"
    args = ["fit", "--config", PULSE_YAML, *added, "--trainer.default_root_dir", str(tmp_path)]
    assert _first_error_line(capsys, args) == expected


@pytest.mark.parametrize(
    ("callback", "expected"),
    [
        (
            {
                "class_path": "lightning_pulse.EnergyLogger",
                "init_args": {"accounting": {"token_counter": "len"}},
            },
            "error: `trainer.callbacks[0]` EnergyLogger: `accounting.token_counter`=len is not accepted; "
            "expected the dot import path of a "
            "function (package.module.function, here builtins.len), or null.",
        ),
        (
            {
                "class_path": "lightning_pulse.HardSampleReplay",
                "init_args": {"scorer": "torch.nn.functional.mse_loss"},
            },
            "error: `trainer.callbacks[0]` "
            "HardSampleReplay: `scorer`=torch.nn.functional.mse_loss is not accepted; expected the "
            "class_path of a PerSampleScorer (lightning_pulse.core.per_sample_loss.OutputKeyScorer, "
            "lightning_pulse.core.per_sample_loss.ForwardLossScorer or a subclass of your own), or null.",
        ),
        (
            {
                "class_path": "lightning_pulse.HardSampleReplay",
                "init_args": {"scorer": {"class_path": "torch.nn.MSELoss"}},
            },
            "error: `trainer.callbacks[0]` "
            "HardSampleReplay: `scorer`={'class_path': 'torch.nn.MSELoss'} is not accepted; "
            "expected the class_path of a PerSampleScorer (",
        ),
    ],
    ids=["token_counter", "scorer-function", "scorer-class"],
)
def test_a_function_or_class_field_given_the_wrong_thing_names_the_field_and_what_it_takes(
    tmp_path, capsys, callback, expected
):
    # the sentences were jsonargparse's: "Expected a dot import path string: len", "Expected a path but
    # torch.nn.functional.mse_loss either not accessible or invalid" (no field; a scorer is no path)
    first = _first_error_line(capsys, ["fit", "--config", _pulse_config_with_callbacks(tmp_path, [callback])])
    assert first.startswith(expected), first


_SCORERS = (
    "expected the class_path of a PerSampleScorer (lightning_pulse.core.per_sample_loss.OutputKeyScorer, "
    "lightning_pulse.core.per_sample_loss.ForwardLossScorer or a subclass of your own), or null."
)


@pytest.mark.parametrize(
    ("callback", "expected"),
    [
        (
            {
                "class_path": "lightning_pulse.HardSampleReplay",
                "init_args": {"scorer": {"class_path": "lightning_pulse.core.per_sample_loss.NoSuch"}},
            },
            "error: `trainer.callbacks[1]` "
            "HardSampleReplay: `scorer`={'class_path': 'lightning_pulse.core.per_sample_loss.NoSuch'} is "
            "not accepted: lightning_pulse.core.per_sample_loss.NoSuch cannot be imported (module "
            f"'lightning_pulse.core.per_sample_loss' has no attribute 'NoSuch'); {_SCORERS}",
        ),
        (
            {
                "class_path": "lightning_pulse.HardSampleReplay",
                "init_args": {
                    "scorer": {
                        "class_path": "lightning_pulse.core.per_sample_los.ForwardLossScorer",
                        "init_args": {"loss": "cross_entropy"},
                    }
                },
            },
            "error: `trainer.callbacks[1]` "
            "HardSampleReplay: `scorer`={'class_path': 'lightning_pulse.core.per_sample_los."
            "ForwardLossScorer', 'init_args': {'loss': 'cross_entropy'}} is not accepted: lightning_pulse.core."
            "per_sample_los.ForwardLossScorer cannot be imported (module 'lightning_pulse.core' has no "
            f"attribute 'per_sample_los'); {_SCORERS}",
        ),
        (
            {
                "class_path": "lightning_pulse.HardSampleReplay",
                "init_args": {"scorer": "no_such_package.Scorer"},
            },
            "error: `trainer.callbacks[1]` "
            "HardSampleReplay: `scorer`=no_such_package.Scorer is not accepted: no_such_package.Scorer "
            f"cannot be imported (No module named 'no_such_package'); {_SCORERS}",
        ),
        (
            {"class_path": "lightning_pulse.PulseCycle", "init_args": {"time_source": "time.monotonik"}},
            "error: `trainer.callbacks[1]` "
            "PulseCycle: `time_source`=time.monotonik is not accepted: time.monotonik cannot be imported "
            "(module 'time' has no attribute 'monotonik'); expected the dot import path of a function "
            "(package.module.function), or null.",
        ),
        (
            {"class_path": "lightning_pulse.callbaks.PulseCycle"},
            "error: `trainer.callbacks[1]`: class_path lightning_pulse.callbaks.PulseCycle cannot be "
            "imported: No module named 'lightning_pulse.callbaks' (did you mean "
            "lightning_pulse.PulseCycle?); expected the import path of a Callback class",
        ),
    ],
    ids=["scorer-class-typo", "scorer-module-typo", "scorer-no-package", "time_source-typo", "callback-typo"],
)
def test_a_class_or_function_path_that_does_not_import_names_the_field_and_what_it_takes(
    tmp_path, capsys, callback, expected
):
    # jsonargparse's import error led with the class the path named, which does not exist ("NoSuch: module
    # ... has no attribute 'NoSuch'") or is a real one blamed for the user's typo ("ForwardLossScorer: module
    # 'lightning_pulse.core' has no attribute 'per_sample_los'"); and named neither the field nor what it takes
    config = _pulse_config_with_callbacks(tmp_path, [{"class_path": "lightning_pulse.PulseCycle"}, callback])
    first = _first_error_line(capsys, ["fit", "--config", config])
    assert first.startswith(expected), first


@pytest.mark.parametrize("last", [True, False], ids=["prune-last", "prune-before-another"])
def test_a_bad_distill_value_in_yaml_names_its_config_as_the_other_nested_configs_do(tmp_path, capsys, last):
    # it was "error: `distill.weight`=-1.0 must be a positive finite number.", naming no class, where the
    # guard's config says "StabilityGuardConfig: `min_ratio`=..." (jsonargparse's report names the callback
    # only when the refused one is the last in the list)
    prune = {"class_path": "lightning_pulse.ScheduledPrune", "init_args": {"distill": {"weight": -1.0}}}
    guard = {"class_path": "lightning_pulse.StabilityGuard", "init_args": {"config": {"min_ratio": 20.0}}}
    cycle = {"class_path": "lightning_pulse.PulseCycle"}
    firsts = []
    for bad in (prune, guard):
        callbacks = [cycle, bad] if last else [bad, cycle]
        firsts.append(
            _first_error_line(capsys, ["fit", "--config", _pulse_config_with_callbacks(tmp_path, callbacks)])
        )
    # sweep D: now named as a wrong-typed or unknown nested key is, wherever the entry is in the list
    entry = "`trainer.callbacks[1]`" if last else "`trainer.callbacks[0]`"
    assert (
        firsts[0] == f"error: {entry} ScheduledPrune: `distill.weight`=-1.0 must be a positive finite number."
    )
    assert firsts[1].startswith(
        f"error: {entry} StabilityGuard: `config.min_ratio`=20.0 must be a number in "
    )


def test_two_callbacks_sharing_a_checkpoint_entry_are_one_line_naming_the_class_and_the_way_out(
    tmp_path, capsys
):
    # Lightning's RuntimeError ("Found more than one stateful callback of type `PulseCycle`") was a 30-line
    # traceback with exit code 1
    run = [*FAST, "--trainer.max_steps", "2", "--trainer.default_root_dir", str(tmp_path)]
    added = ["--trainer.callbacks+=lightning_pulse.PulseCycle"]
    first = _first_error_line(capsys, ["fit", "--config", PULSE_YAML, *added, *run])
    assert first == (
        "error: `trainer.callbacks` holds PulseCycle more than once; a Trainer takes one (a checkpoint keeps "
        "its state under the class name): remove the others."
    )
    monitors = ["--trainer.callbacks+=lightning_pulse.HyperConnectionMonitor"] * 2
    first = _first_error_line(capsys, ["fit", "--config", PULSE_YAML, *monitors, *run])
    assert first.startswith(
        "error: `trainer.callbacks` holds HyperConnectionMonitor more than once with `prefix`='mhc'"
    )
    assert "give each HyperConnectionMonitor a distinct `prefix`" in first
    # the way out: a monitor keeps its state under its prefix, so two with distinct ones train
    with pytest.warns(UserWarning, match="found no HyperConnection"):  # the MNIST-1D CNN has none
        assert main(["fit", "--config", PULSE_YAML, *monitors, "--trainer.callbacks.prefix=b", *run]) == 0


@pytest.mark.parametrize("value", ["1", "false"])
def test_jsonargparse_debug_is_read_as_jsonargparse_reads_it(tmp_path, capsys, monkeypatch, value):
    # the parser's docstring said JSONARGPARSE_DEBUG=1, which jsonargparse refuses with a traceback ("Invalid
    # boolean value"); and `false` turned the one-line errors off
    monkeypatch.setenv("JSONARGPARSE_DEBUG", value)
    bad = _pulse_config_with_callbacks(tmp_path, [_BAD_CYCLE])
    if value == "1":
        assert main(["fit", "--config", bad]) == 2
        first = capsys.readouterr().err.strip().splitlines()[0]
        assert first == (
            "error: JSONARGPARSE_DEBUG=1 is not accepted; expected true or false "
            "(or LIGHTNING_PULSE_TRACEBACK=1 for the full report and tracebacks)."
        )
    else:
        assert _first_error_line(capsys, ["fit", "--config", bad]).startswith("error: PulseCycle: `burst`=")


def test_ctrl_c_on_wait_for_window_exits_130_with_one_line_and_no_traceback(tmp_path, capsys):
    # sweep-cli-yaml: Ctrl-C on a wait one had started printed a KeyboardInterrupt traceback
    from lightning_pulse.cli import INTERRUPTED_EXIT, run_wait_for_window

    record = {
        "status": "suspended",
        "resume_at": "2020-06-15 11:00:00",
        "resume_at_unix": 1592218800.0,
        "checkpoint": "x.ckpt",
        "resume_command": "lightning-pulse fit --ckpt_path x.ckpt",
    }
    (tmp_path / "green_window.json").write_text(json.dumps(record))

    class InterruptedClock:  # the user presses Ctrl-C while the wait sleeps
        def time(self) -> float:
            return 1592215200.0

        def sleep(self, seconds: float) -> None:
            assert seconds == 3600.0
            raise KeyboardInterrupt

    assert run_wait_for_window([str(tmp_path)], clock=InterruptedClock()) == INTERRUPTED_EXIT == 130
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err
    assert err == (
        "wait-for-window: interrupted before the window opens; the run is still suspended, resume it with: "
        "lightning-pulse fit --ckpt_path x.ckpt\n"
    )


@pytest.mark.parametrize(
    "edit, expected",
    [
        (lambda text: text[: len(text) // 2], "is not a lightning-pulse energy report (not JSON: "),
        (
            lambda text: text.replace('"phases": {', '"phases": "x", "old_phases": {', 1),
            "`phases`='x' is not a mapping",
        ),
        (
            lambda text: text.replace('"timeline": {', '"timeline": null, "old_timeline": {', 1),
            "`timeline`=None is not",
        ),
        (
            lambda text: text.replace('"meters": {', '"meters": [], "old_meters": {', 1),
            "`meters`=[] is not a mapping",
        ),
    ],
    ids=["truncated", "phases-text", "timeline-null", "meters-list"],
)
def test_report_subcommand_on_a_broken_report_names_the_file_in_one_line(tmp_path, capsys, edit, expected):
    # sweep-cli-yaml: a truncated report gave json's message naming no file; a section of another type a
    # traceback (AttributeError), where `compare` gave one line naming the file
    from lightning_pulse.energy.report import JSON_NAME, write_report
    from tests.test_energy_report import small_report

    write_report(small_report(), tmp_path)
    text = (tmp_path / JSON_NAME).read_text()
    (tmp_path / JSON_NAME).write_text(edit(text))
    assert (tmp_path / JSON_NAME).read_text() != text
    with pytest.raises(SystemExit) as exit_info:
        main(["report", str(tmp_path)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err
    assert f"{tmp_path / JSON_NAME}" in err and expected in err, err


@pytest.mark.parametrize(
    ("clock", "expected"),
    [
        (
            "{class_path: lightning_pulse.SimulatedClok}",
            "lightning_pulse.SimulatedClok() could not be built (AttributeError: module 'lightning_pulse' "
            "has no attribute 'SimulatedClok')",
        ),
        (
            "{class_path: lightning_pulse.SimulatedClock, init_args: {start: notatime}}",
            "lightning_pulse.SimulatedClock(start='notatime') could not be built (ValueError: ",
        ),
        (
            "{class_path: lightning_pulse.SimulatedClock, init_args: {strat: '2020-06-19 00:00:00'}}",
            "unexpected keyword argument 'strat'",
        ),
    ],
    ids=["class-path-typo", "bad-start", "unknown-key"],
)
def test_a_green_window_clock_from_yaml_that_cannot_be_built_names_the_problem(
    tmp_path, capsys, clock, expected
):
    # sweep-cli-yaml: each was reported as "`clock`=... must have `time()` and `sleep(seconds)` methods"
    signal = ROOT / "examples" / "data" / "carbon" / "de_2020_june_excerpt.csv"
    config = {
        "trainer": {"max_steps": 2, "logger": False, "enable_checkpointing": False},
        "model": {"class_path": "examples.digits.DigitsClassifier", "init_args": {"channels": 8}},
        "data": {"class_path": "examples.digits.DigitsDataModule", "init_args": {"batch_size": 32}},
    }
    text = yaml.safe_dump(config).replace(
        "trainer:\n",
        "trainer:\n  callbacks:\n  - class_path: lightning_pulse.GreenWindow\n"
        f"    init_args: {{signal: {signal}, when_dirty: pause, clock: {clock}}}\n",
    )
    (tmp_path / "gw.yaml").write_text(text)
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(tmp_path / "gw.yaml"), "--trainer.default_root_dir", str(tmp_path)])
    assert exit_info.value.code == 2
    first = capsys.readouterr().err.strip().splitlines()[0]
    assert first.startswith("error: GreenWindow: `clock`: ") and expected in first, first
    assert "must have `time()`" not in first and "Namespace(" not in first


_CYCLE_ACCEPTS = "PulseCycle accepts: burst, replay, maintain, order, warmup, anneal, maintain_eval, "


@pytest.mark.parametrize(
    ("entry", "expected"),
    [
        (
            {"class_path": "lightning_pulse.PulseCycle", "init_args": {"warmup": "abc"}},
            "`trainer.callbacks[1]` PulseCycle: `warmup`=abc is not accepted; expected float.",
        ),
        (
            {"class_path": "lightning_pulse.PulseCycle", "init_args": {"burst_steps": "abc"}},
            "`trainer.callbacks[1]` PulseCycle: Option 'burst_steps' is not accepted (did you mean burst?); "
            f"{_CYCLE_ACCEPTS}",
        ),
        (
            {"class_path": "lightning_pulse.PulseCycle", "init_args": {"cycle_lenght": 3}},
            f"`trainer.callbacks[1]` PulseCycle: Option 'cycle_lenght' is not accepted; {_CYCLE_ACCEPTS}",
        ),
        (
            {"class_path": "lightning_pulse.PulseCycel", "init_args": {"burst": 3}},
            "`trainer.callbacks[1]`: class_path lightning_pulse.PulseCycel cannot be imported: module "
            "'lightning_pulse' has no attribute 'PulseCycel' (did you mean lightning_pulse.PulseCycle?); "
            "expected the import path of a Callback class",
        ),
        (
            "lightning.pytorch.callbacks.ModelCheckpont",
            "`trainer.callbacks[1]`: class_path lightning.pytorch.callbacks.ModelCheckpont cannot be "
            "imported: module 'lightning.pytorch.callbacks' has no attribute 'ModelCheckpont' (did you mean "
            "lightning.pytorch.callbacks.ModelCheckpoint?)",
        ),
        (
            {"init_args": {"burst": 3}},
            "`trainer.callbacks[1]`: the entry has no class_path (its keys: init_args); an entry is a "
            "mapping with class_path (the Callback's import path, such as lightning_pulse.PulseCycle) and, "
            "optionally, init_args",
        ),
        (
            {"class_path": "lightning_pulse.PulseCycle", "init_args": [36, 72]},
            "`trainer.callbacks[1]` PulseCycle: init_args=[36, 72] is not accepted; expected a mapping of "
            f"PulseCycle's options; {_CYCLE_ACCEPTS}",
        ),
        (
            {"class_path": "lightning_pulse.PulseCycle", "init_arg": {"burst": 3}},
            "`trainer.callbacks[1]` PulseCycle: key 'init_arg' is not accepted in a callback entry (did you "
            "mean init_args?); expected class_path, init_args (a mapping of the callback's options) or "
            "dict_kwargs.",
        ),
        (
            {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": {"monitr": "loss"}},
            "`trainer.callbacks[1]` ModelCheckpoint: Option 'monitr' is not accepted (did you mean "
            "monitor?); ModelCheckpoint accepts: dirpath, filename, monitor, ",
        ),
    ],
    ids=[
        "wrong-type",
        "wrong-key",
        "unknown-key",
        "class-typo",
        "lightning-class-typo",
        "no-class_path",
        "init_args-list",
        "entry-key-typo",
        "lightning-option-typo",
    ],
)
def test_a_malformed_callbacks_entry_in_yaml_names_the_entry_the_key_and_what_is_allowed(
    tmp_path, capsys, entry, expected
):
    # the first line was jsonargparse's, naming no entry: "Callback: `trainer.callbacks`=[Namespace(...),
    # {...}] is not accepted; ...", "PulseCycle: 'list' object has no attribute 'keys'", no close match
    good = {"class_path": "lightning_pulse.StabilityGuard"}
    first = _first_error_line(
        capsys, ["fit", "--config", _pulse_config_with_callbacks(tmp_path, [good, entry])]
    )
    assert first.startswith(f"error: {expected}"), first
    assert not list(tmp_path.rglob("*.ckpt"))  # nothing trained


@pytest.mark.parametrize("given_as", ["list", "mapping", "list-with-equals"])
def test_a_malformed_callbacks_entry_on_the_command_line_names_the_entry_too(tmp_path, capsys, given_as):
    entry = {"class_path": "lightning_pulse.PulseCycle", "init_args": ["burst", 36]}
    value = json.dumps(
        entry if given_as == "mapping" else [{"class_path": "lightning_pulse.StabilityGuard"}, entry]
    )
    option = (
        [f"--trainer.callbacks={value}"] if given_as == "list-with-equals" else ["--trainer.callbacks", value]
    )
    args = ["fit", "--config", PULSE_YAML, *option, "--trainer.default_root_dir", str(tmp_path)]
    where = "`trainer.callbacks`" if given_as == "mapping" else "`trainer.callbacks[1]`"
    assert _first_error_line(capsys, args).startswith(
        f"error: {where} PulseCycle: init_args=['burst', 36] is not accepted; expected a mapping of "
        "PulseCycle's options; PulseCycle accepts: burst, "
    )


def test_a_valid_callbacks_list_with_lightnings_own_callbacks_still_trains(tmp_path):
    # the entries are read only once the parser has refused the config: a good one trains as before
    callbacks = [
        {"class_path": "lightning_pulse.PulseCycle", "init_args": {"burst": 2, "replay": 2, "maintain": 1}},
        {"class_path": "lightning.pytorch.callbacks.ModelSummary", "init_args": {"max_depth": 2}},
        "lightning_pulse.StabilityGuard",
    ]
    config = _pulse_config_with_callbacks(tmp_path, callbacks)
    args = [
        "fit",
        "--config",
        config,
        *FAST,
        "--trainer.max_steps",
        "4",
        "--trainer.default_root_dir",
        str(tmp_path),
    ]
    assert main(args) == 0


_TYPO_WARMUP = {"class_path": "lightning_pulse.PulseCycle", "init_args": {"warmup": "abc"}}


@pytest.mark.parametrize(
    ("callbacks", "expected"),
    [
        # an entry given as a file is a dotted name all the same: it was blamed for the other entry's value
        (["early_stopping.yaml", _TYPO_WARMUP], "error: `trainer.callbacks[1]` PulseCycle: `warmup`=abc"),
        # the parser stops at the first entry: the line is about it, not about a later one it never read
        ([_TYPO_WARMUP, {"class_path": "no_such_module.Nope"}], "error: `trainer.callbacks[0]` PulseCycle:"),
        # an empty `init_args:` (None) gave "PulseCycle: 'NoneType' object has no attribute 'keys'"
        (
            [
                {"class_path": "lightning_pulse.StabilityGuard"},
                {"class_path": "lightning_pulse.PulseCycle", "init_args": None},
            ],
            "error: `trainer.callbacks[1]` PulseCycle: init_args=None is not accepted; expected a mapping",
        ),
    ],
    ids=["file-entry", "first-entry", "empty-init-args"],
)
def test_the_refused_callback_entry_is_the_one_named(tmp_path, capsys, callbacks, expected):
    (tmp_path / "early_stopping.yaml").write_text("class_path: lightning.pytorch.callbacks.EarlyStopping\n")
    args = ["fit", "--config", _pulse_config_with_callbacks(tmp_path, callbacks)]
    line = _first_error_line(capsys, args)
    assert line.startswith(expected), line


def test_an_unknown_option_of_a_single_callback_mapping_is_named_with_the_closest_option(tmp_path, capsys):
    callback = {"class_path": "lightning_pulse.PulseCycle", "init_args": {"burts": "2"}}
    line = _first_error_line(capsys, ["fit", "--config", _pulse_config_with_callbacks(tmp_path, callback)])
    assert line.startswith("error: `trainer.callbacks` PulseCycle: Option 'burts' is not accepted"), line
    assert "(did you mean burst?)" in line


def test_a_config_that_is_no_yaml_is_named_with_its_line_and_column(tmp_path, capsys):
    # a regression sweep: a mis-indented key gave "Problems parsing config: mapping values are not allowed in
    # this context", naming no file and no line (jsonargparse names "<unicode string>", in its full report)
    lines = Path(PULSE_YAML).read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if line.strip().startswith("max_epochs"))
    lines[at] = "   " + lines[at].strip() + ": 3"
    broken = tmp_path / "broken.yaml"
    broken.write_text("\n".join(lines))
    line = _first_error_line(capsys, ["fit", "--config", str(broken)])
    assert line.startswith("error: Problems parsing config: mapping values are not allowed"), line
    assert line.endswith(f"({broken}, line {at + 1}, column 14)."), line  # at the line's second colon


def test_a_scorer_mapping_without_class_path_names_the_field_and_asks_for_the_class_path(tmp_path, capsys):
    # sweep D: ForwardLossScorer's options with the class_path forgotten read "PerSampleScorer: Option 'loss'
    # is not accepted; PerSampleScorer accepts: args, kwargs" (the abstract base's *args, **kwargs), naming
    # neither HardSampleReplay nor `scorer`, and a way out that does not work
    for scorer in ({"loss": "cross_entropy", "input": 0, "target": 1}, {"a": 1}):
        callback = {"class_path": "lightning_pulse.HardSampleReplay", "init_args": {"scorer": scorer}}
        config = _pulse_config_with_callbacks(tmp_path, [callback])
        first = _first_error_line(capsys, ["fit", "--config", config])
        assert first.startswith(
            f"error: `trainer.callbacks[0]` HardSampleReplay: `scorer`={dict(sorted(scorer.items()))} is not accepted; "
            "expected the "
            "class_path of a PerSampleScorer (lightning_pulse.core.per_sample_loss."
        ), first
        assert first.endswith("or a subclass of your own) with its options under init_args, or null."), first
        assert "args, kwargs" not in first


_NESTED_TYPOS = [
    (
        "EnergyLogger",
        {"meters": {"sampling_perod": 1}},
        "meters.sampling_perod",
        "sampling_period",
        "MeterConfig",
    ),
    ("EnergyLogger", {"accounting": {"progres_bar": True}}, "accounting.progres_bar", "progress_bar", ""),
    (
        "StabilityGuard",
        {"config": {"min_ration": 2}},
        "config.min_ration",
        "min_ratio",
        "StabilityGuardConfig",
    ),
    ("ScheduledPrune", {"options": {"cadense": "steps"}}, "options.cadense", "cadence", "PruneOptions"),
    ("ScheduledPrune", {"distill": {"wieght": 1.0}}, "distill.wieght", "weight", "DistillConfig"),
    (
        "GreenWindow",
        {"signal": GRID, "options": {"slott": "1h"}},
        "options.slott",
        "slot",
        "GreenWindowOptions",
    ),
    (
        "HardSampleReplay",
        {
            "scorer": {
                "class_path": "lightning_pulse.core.per_sample_loss.ForwardLossScorer",
                "init_args": {"los": "cross_entropy"},
            }
        },
        "scorer.los",
        "loss",
        "ForwardLossScorer",
    ),
]


@pytest.mark.parametrize(
    ("callback", "init_args", "path", "meant", "config_class"),
    _NESTED_TYPOS,
    ids=[c[2] for c in _NESTED_TYPOS],
)
@pytest.mark.parametrize("position", [0, 1], ids=["first", "second"])
def test_a_typo_inside_a_nested_config_names_the_entry_the_field_path_and_the_closest_option(
    tmp_path, capsys, callback, init_args, path, meant, config_class, position
):
    # sweep D: "MeterConfig: Option 'sampling_perod' is not accepted; MeterConfig accepts: ..." named neither
    # the entry, the callback nor `meters`, and had no "did you mean" (a top-level typo has all of them)
    entry = {"class_path": f"lightning_pulse.{callback}", "init_args": init_args}
    callbacks = [entry, {"class_path": "lightning_pulse.PulseCycle"}]
    callbacks = callbacks if position == 0 else callbacks[::-1]
    first = _first_error_line(capsys, ["fit", "--config", _pulse_config_with_callbacks(tmp_path, callbacks)])
    field = path.partition(".")[0]
    assert first.startswith(
        f"error: `trainer.callbacks[{position}]` {callback}: `{path}` is not accepted (did you mean {meant}?); "
        f"`{field}` takes {config_class or 'AccountingConfig'}'s options: "
    ), first
    assert f" {meant}," in first or first.endswith(f" {meant}.")


@pytest.mark.parametrize(
    ("callback", "init_args", "expected"),
    [
        (
            "EnergyLogger",
            {"accounting": {"progress_bar": "maybe"}},
            "EnergyLogger: `accounting.progress_bar`=maybe is not accepted; expected bool.",
        ),
        (
            "EnergyLogger",
            {"meters": {"gpu_devices": 0}},
            "EnergyLogger: `meters.gpu_devices`=0 is not accepted; expected a list (in YAML, [0] for a single",
        ),
        (
            "StabilityGuard",
            {"config": {"rewind_lr_schedule": "maybe"}},
            "StabilityGuard: `config.rewind_lr_schedule`=maybe is not accepted; expected bool.",
        ),
        (
            "ScheduledPrune",
            {"options": {"make_permanent": "maybe"}},
            "ScheduledPrune: `options.make_permanent`=maybe is not accepted; expected bool.",
        ),
        (
            "HardSampleReplay",
            {
                "scorer": {
                    "class_path": "lightning_pulse.core.per_sample_loss.ForwardLossScorer",
                    "init_args": {"loss": "cross_entropi"},
                }
            },
            "HardSampleReplay: `scorer.loss`='cross_entropi' is not one of ['cross_entropy', ",
        ),
    ],
    ids=["accounting", "meters", "config", "options", "scorer-loss"],
)
def test_a_wrong_value_inside_a_nested_config_names_the_entry_and_the_field_path(
    tmp_path, capsys, callback, init_args, expected
):
    # sweep D: "AccountingConfig: `progress_bar`=maybe is not accepted; expected bool." and "`loss`=
    # 'cross_entropi' is not one of [...]" named neither the callback nor the field holding the config
    callbacks = [{"class_path": "lightning_pulse.PulseCycle"}]
    callbacks.append({"class_path": f"lightning_pulse.{callback}", "init_args": init_args})
    first = _first_error_line(capsys, ["fit", "--config", _pulse_config_with_callbacks(tmp_path, callbacks)])
    assert first.startswith(f"error: `trainer.callbacks[1]` {expected}"), first
    if callback == "HardSampleReplay":
        assert first.endswith("(did you mean cross_entropy?)."), first


_SCORER = "--trainer.callbacks.scorer=lightning_pulse.core.per_sample_loss.ForwardLossScorer"


@pytest.mark.parametrize(
    ("added", "expected"),
    [
        (
            [
                "--trainer.callbacks+=lightning_pulse.EnergyLogger",
                "--trainer.callbacks.meters.sampling_perod=1",
            ],
            "EnergyLogger (the last callback given): `meters.sampling_perod` is not accepted (did you mean "
            "sampling_period?); `meters` takes MeterConfig's options: sampling_period, ",
        ),
        (
            [
                "--trainer.callbacks+=lightning_pulse.StabilityGuard",
                '--trainer.callbacks.config={"min_ration": 2}',
            ],
            "StabilityGuard (the last callback given): `config.min_ration` is not accepted (did you mean "
            "min_ratio?); `config` takes StabilityGuardConfig's options: min_ratio, ",
        ),
        (
            [
                "--trainer.callbacks=lightning_pulse.EnergyLogger",
                "--trainer.callbacks.init_args.accounting.progres_bar=1",
            ],
            "EnergyLogger (the last callback given): `accounting.progres_bar` is not accepted (did you mean "
            "progress_bar?); `accounting` takes AccountingConfig's options: ",
        ),
        (
            [
                "--trainer.callbacks+=lightning_pulse.HardSampleReplay",
                _SCORER,
                "--trainer.callbacks.scorer.los=x",
            ],
            "HardSampleReplay (the last callback given): `scorer.los` is not accepted (did you mean loss?); "
            "`scorer` takes ForwardLossScorer's options: loss, ",
        ),
        (
            [
                "--trainer.callbacks+=lightning_pulse.HardSampleReplay",
                _SCORER,
                "--trainer.callbacks.scorer.init_arg.loss=x",
            ],
            "HardSampleReplay (the last callback given): `scorer.init_arg` is not accepted (did you mean "
            "init_args?); `scorer` takes class_path (the import path of a PerSampleScorer), init_args (a mapping of "
            "ForwardLossScorer's options) or dict_kwargs.",
        ),
        (
            [
                "--trainer.callbacks+=lightning_pulse.HardSampleReplay",
                _SCORER,
                "--trainer.callbacks.scorer.init_args.los=x",
            ],
            "HardSampleReplay (the last callback given): `scorer.init_args.los` is not accepted (did you mean "
            "loss?); `scorer` takes ForwardLossScorer's options: loss, ",
        ),
        (
            ["--trainer.callbacks+=lightning_pulse.HardSampleReplay", "--trainer.callbacks.scorer.los=x"],
            "HardSampleReplay (the last callback given): `scorer.los` was given before a class for `scorer`: give "
            "`--trainer.callbacks.scorer=<class_path>` first, the class_path of a PerSampleScorer ("
            "lightning_pulse.core.per_sample_loss.OutputKeyScorer, lightning_pulse.core.per_sample_loss."
            "ForwardLossScorer or a subclass of your own), then its options.",
        ),
        (
            [
                "--trainer.callbacks+=lightning_pulse.HardSampleReplay",
                "--trainer.callbacks.scorer.init_args.loss=x",
            ],
            "HardSampleReplay (the last callback given): `scorer.init_args.loss` was given before a class for "
            "`scorer`: give `--trainer.callbacks.scorer=<class_path>` first, the class_path of a PerSampleScorer (",
        ),
        (
            ["--trainer.callbacks+=lightning_pulse.EnergyLogger", "--trainer.callbacks.meters.gpu_devices=0"],
            "EnergyLogger (the last callback given): `meters.gpu_devices`=0 is not accepted; expected a list",
        ),
        (
            [
                "--trainer.callbacks+=lightning_pulse.ScheduledPrune",
                "--trainer.callbacks.options.make_permanent=maybe",
            ],
            "ScheduledPrune (the last callback given): `options.make_permanent`=maybe is not accepted; expected "
            "bool.",
        ),
    ],
    ids=[
        "meters-typo",
        "config-mapping-typo",
        "init-args-accounting-typo",
        "scorer-typo",
        "scorer-init-arg",
        "scorer-init-args-typo",
        "scorer-option-before-its-class",
        "scorer-init-args-option-before-its-class",
        "meters-value",
        "options-value",
    ],
)
def test_a_nested_config_on_the_command_line_names_the_last_callback_the_field_path_and_the_closest_option(
    tmp_path, capsys, added, expected
):
    # sweep-regress 4: the YAML form was named ("`trainer.callbacks[0]` EnergyLogger: `meters.sampling_perod`
    # ..."), the same typo on the command line still read "MeterConfig: Option 'sampling_perod' is not
    # accepted; MeterConfig accepts: ...": no callback, no field path, no "did you mean". Sweep s46 (finding
    # 2): a scorer option given before any scorer class read "`scorer`=NestedArg(key='los', val='x') is not
    # accepted", jsonargparse's internal value, and `scorer.init_args.los` was named `scorer.los`
    args = ["fit", "--config", PULSE_YAML, *added, "--trainer.default_root_dir", str(tmp_path)]
    first = _first_error_line(capsys, args)
    assert first.startswith(f"error: `trainer.callbacks` {expected}"), first
    assert "NestedArg" not in first


@pytest.mark.parametrize(
    ("scorer", "expected"),
    [
        (
            {
                "class_path": "lightning_pulse.core.per_sample_loss.ForwardLossScorer",
                "init_arg": {"loss": "mse_loss"},
            },
            "`scorer.init_arg` is not accepted (did you mean init_args?); `scorer` takes class_path (the import path "
            "of a PerSampleScorer), init_args (a mapping of ForwardLossScorer's options) or dict_kwargs.",
        ),
        (
            {"class_path": "lightning_pulse.core.per_sample_loss.ForwardLossScorer", "loss": "mse_loss"},
            "`scorer.loss` is not accepted (did you mean `scorer.init_args.loss`?); `scorer` takes class_path ",
        ),
        (
            {
                "class_pat": "lightning_pulse.core.per_sample_loss.ForwardLossScorer",
                "init_args": {"loss": "mse_loss"},
            },
            "`scorer.class_pat` is not accepted (did you mean class_path?); `scorer` takes class_path ",
        ),
        (
            {
                "class_path": "lightning_pulse.core.per_sample_loss.ForwardLosScorer",
                "init_arg": {"loss": "mse_loss"},
            },
            "`scorer.class_path` lightning_pulse.core.per_sample_loss.ForwardLosScorer cannot be imported: ",
        ),
    ],
    ids=["init-arg", "option-beside-class-path", "class-pat", "class-path-first"],
)
def test_a_scorer_mappings_own_keys_are_checked_as_a_callback_entrys_are(tmp_path, capsys, scorer, expected):
    # sweep-regress 4: a callback entry's `init_arg` got "did you mean init_args?", a scorer mapping's read
    # "PerSampleScorer: Option 'init_arg.loss' is not accepted" (no callback, no field, no way out)
    callbacks = [{"class_path": "lightning_pulse.HardSampleReplay", "init_args": {"scorer": scorer}}]
    first = _first_error_line(capsys, ["fit", "--config", _pulse_config_with_callbacks(tmp_path, callbacks)])
    assert first.startswith(f"error: `trainer.callbacks[0]` HardSampleReplay: {expected}"), first
    if "cannot be imported" in expected:
        assert first.endswith(
            "(did you mean lightning_pulse.core.per_sample_loss.ForwardLossScorer?); expected "
            "the import path of a PerSampleScorer."
        ), first
