"""Where EnergyLogger and GreenWindow write their reports under a logger whose ``save_dir`` is a store every
run shares (MLflow, W&B, Comet: Lightning's ``trainer.log_dir`` is that root): each run in its own folder."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger

from lightning_pulse import EnergyLogger, GreenWindow, GreenWindowOptions, MeterConfig, SimulatedClock
from lightning_pulse.callbacks.simulated_step_time import SimulatedStepTime
from lightning_pulse.energy.config import AccountingConfig
from lightning_pulse.errors import PulseRefusal
from tests.conftest import trainer_kwargs

DE_JUNE = str(
    Path(__file__).resolve().parents[1] / "examples" / "data" / "carbon" / "de_2020_june_excerpt.csv"
)
REPLACED = "holds the report of another run"


class StoreLogger(Logger):
    """Shaped like MLFlowLogger or WandbLogger: one store root (``save_dir``) for every run, a new ``version``
    (the run id) for each."""

    def __init__(self, root: Path, version: str | int | None) -> None:
        super().__init__()
        self.root, self._version = root, version

    @property
    def name(self) -> str:
        return "experiment"

    @property
    def version(self) -> str | int | None:
        return self._version

    @property
    def save_dir(self) -> str:
        return str(self.root)

    def log_metrics(self, metrics, step=None) -> None:
        pass

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass


def fit(mnist1d_small, root, logger, steps=4, report_dir=None, ckpt_path=None, checkpoint=None, **accounting):
    """One fit with an EnergyLogger and a GreenWindow; both callbacks."""
    clock = SimulatedClock("2020-06-15 14:00:00")
    energy = EnergyLogger(
        cpu="constant", ram="none", gpu="none", meters=MeterConfig(cpu_watts=20.0), report_dir=report_dir,
        accounting=AccountingConfig(**accounting),
    )  # fmt: skip
    energy.account.clock = energy.account.wall_clock = clock  # one clock: no warning that they differ
    green = GreenWindow(
        signal=DE_JUNE,
        when_dirty="pause",
        max_delay=1.0,
        clock=clock,
        options=GreenWindowOptions(watts=20.0, report_dir=report_dir),
    )
    callbacks = [SimulatedStepTime(clock, 60.0), energy, green, *([checkpoint] if checkpoint else [])]
    trainer = pl.Trainer(
        callbacks=callbacks,
        max_steps=steps,
        limit_val_batches=0,
        **trainer_kwargs(logger=logger, default_root_dir=root, enable_checkpointing=checkpoint is not None),
    )
    trainer.fit(*mnist1d_small(arch="mlp"), ckpt_path=ckpt_path)
    return energy, green


def folders(energy: EnergyLogger, green: GreenWindow) -> tuple[Path, Path]:
    return energy.report_paths[0].parent, green.report_paths[0].parent


def test_two_runs_logged_to_one_store_keep_two_reports_each_in_its_run_folder(mnist1d_small, tmp_path):
    store = tmp_path / "store"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = fit(mnist1d_small, tmp_path, StoreLogger(store, "run-a"), steps=3)
        second = fit(mnist1d_small, tmp_path, StoreLogger(store, 7), steps=5)
    # <save_dir>/<name>/<version>, an int version named as ModelCheckpoint names it
    assert folders(*first) == (store / "experiment" / "run-a",) * 2
    assert folders(*second) == (store / "experiment" / "version_7",) * 2
    reports = sorted(store.rglob("energy_report.json"))
    assert [json.loads(p.read_text())["total"]["steps"] for p in reports] == [3, 5]
    assert [json.loads(p.read_text())["run"] for p in reports] == [
        "experiment/run-a",
        "experiment/version_7",
    ]  # named as its folder
    assert len(sorted(store.rglob("green_window_report.json"))) == 2
    assert not [w for w in caught if REPLACED in str(w.message)]


def test_a_new_run_in_the_store_compares_against_the_last_one_instead_of_being_refused(
    mnist1d_small, tmp_path
):
    store = tmp_path / "store"
    baseline, _ = fit(mnist1d_small, tmp_path, StoreLogger(store, "run-a"), steps=3)
    energy, _ = fit(
        mnist1d_small, tmp_path, StoreLogger(store, "run-b"), baseline=str(baseline.report_paths[0])
    )
    assert energy.report["comparison"] is not None
    assert json.loads(baseline.report_paths[0].read_text())["total"]["steps"] == 3  # the baseline is kept


@pytest.mark.parametrize("logger_class", [TensorBoardLogger, CSVLogger])
def test_tensorboard_and_csv_reports_stay_in_the_loggers_version_folder(
    mnist1d_small, tmp_path, logger_class
):
    for version in range(2):
        logger = logger_class(tmp_path / "logs")
        energy, green = fit(mnist1d_small, tmp_path, logger)
        assert folders(energy, green) == (Path(logger.log_dir),) * 2
        assert Path(logger.log_dir).name == f"version_{version}"


def test_a_resumed_run_continues_its_report_in_its_own_folder_without_a_warning(mnist1d_small, tmp_path):
    store, saves = tmp_path / "store", tmp_path / "checkpoints"
    saving = ModelCheckpoint(dirpath=saves, every_n_train_steps=3, save_top_k=-1)
    first, _ = fit(mnist1d_small, tmp_path, StoreLogger(store, "run-a"), steps=3, checkpoint=saving)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = fit(
            mnist1d_small,
            tmp_path,
            StoreLogger(store, "run-a"),
            steps=6,
            ckpt_path=str(saves / "epoch=0-step=3.ckpt"),
        )
    assert folders(*resumed) == (store / "experiment" / "run-a",) * 2
    assert resumed[0].report_paths[0] == first.report_paths[0]
    report = json.loads(resumed[0].report_paths[0].read_text())
    assert (report["total"]["steps"], report["resumed_runs"]) == (6, 1)
    assert not [w for w in caught if REPLACED in str(w.message)]


def test_a_report_replacing_another_runs_says_so_once_per_report(mnist1d_small, tmp_path):
    shared = tmp_path / "reports"
    fit(mnist1d_small, tmp_path, StoreLogger(tmp_path / "store", "run-a"), report_dir=shared)
    with pytest.warns(UserWarning, match=REPLACED) as caught:
        fit(mnist1d_small, tmp_path, StoreLogger(tmp_path / "store", "run-b"), report_dir=shared)
    said = [str(w.message) for w in caught if REPLACED in str(w.message)]
    assert [line.split(":")[0] for line in said] == ["EnergyLogger", "GreenWindow"]
    assert all("(experiment/run-a)" in line and "(experiment/run-b)" in line for line in said)


def test_a_logger_without_a_version_writes_into_its_save_dir(mnist1d_small, tmp_path):
    energy, green = fit(mnist1d_small, tmp_path, StoreLogger(tmp_path / "store", None))
    assert folders(energy, green) == (tmp_path / "store",) * 2
    assert energy.report["run"] is None


class _VersionRaises(StoreLogger):
    @property
    def version(self):
        raise RuntimeError("no run yet")


def test_a_logger_whose_version_cannot_be_read_leaves_the_reports_in_its_store(mnist1d_small, tmp_path):
    """Review of the 39th pass: the run's own folder read the logger's version unguarded, so a logger whose
    version raised failed a finished run at its end (GreenWindow's train end); the store's root, as before."""
    store = tmp_path / "store"
    energy, green = fit(mnist1d_small, tmp_path, _VersionRaises(store, None))
    assert folders(energy, green) == (store, store)
    assert energy.report["run"] is None


def test_a_run_continued_under_its_version_folders_name_is_the_same_run(mnist1d_small, tmp_path):
    """A regression sweep of the 39th pass: the report recorded the raw version (`experiment/0`) while the
    folder was `version_0`, so the same run continued with `version="version_0"` warned that it replaced
    another run's report."""
    store = tmp_path / "store"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = fit(mnist1d_small, tmp_path, StoreLogger(store, 0), steps=3)
        second = fit(mnist1d_small, tmp_path, StoreLogger(store, "version_0"), steps=3)
    assert folders(*first) == folders(*second) == (store / "experiment" / "version_0",) * 2
    assert not [w for w in caught if REPLACED in str(w.message)]


class _CountSteps(pl.Callback):
    steps = 0

    def on_train_batch_end(self, *args) -> None:
        self.steps += 1


def _one_callback(kind: str, clock: SimulatedClock) -> list[pl.Callback]:
    if kind == "energy":
        return [EnergyLogger(cpu="constant", ram="none", gpu="none", meters=MeterConfig(cpu_watts=20.0))]
    green = GreenWindow(signal=DE_JUNE, when_dirty="pause", max_delay=1.0, clock=clock,
                        options=GreenWindowOptions(watts=20.0))  # fmt: skip
    return [SimulatedStepTime(clock, 60.0), green]


@pytest.mark.parametrize("kind", ["energy", "green"])
@pytest.mark.parametrize("where", ["default_root_dir", "logger_save_dir"])
def test_an_unwritable_default_report_folder_is_refused_at_fit_start_not_found_after_the_training(
    mnist1d_small, tmp_path, kind, where
):
    """Fortieth pass: with no `report_dir`, a run folder that could not be written (a read-only working
    directory as `default_root_dir`; here one under a file, which root cannot write either) trained every
    step, then warned "could not write the ... report" and lost it; only an explicit `report_dir` was checked
    at fit start."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    root, logger = str(tmp_path), False
    if where == "default_root_dir":
        root = str(blocker / "run")
    else:
        logger = StoreLogger(blocker / "store", "run-a")
    counter = _CountSteps()
    callbacks = [*_one_callback(kind, SimulatedClock("2020-06-15 14:00:00")), counter]
    trainer = pl.Trainer(
        callbacks=callbacks,
        max_steps=4,
        limit_val_batches=0,
        **trainer_kwargs(logger=logger, default_root_dir=root),
    )
    field = "report_dir" if kind == "energy" else "options.report_dir"
    with pytest.raises(PulseRefusal) as refused:
        trainer.fit(*mnist1d_small(arch="mlp"))
    assert counter.steps == 0
    message = str(refused.value)
    assert message.startswith(
        ("EnergyLogger: " if kind == "energy" else "GreenWindow: ") + "the run's own folder"
    )
    assert f"cannot hold the report (it cannot be created: {str(blocker)!r} is not a folder)" in message
    assert f"give `{field}` a writable folder" in message


@pytest.mark.parametrize("kind", ["energy", "green"])
def test_a_default_report_folder_not_there_yet_is_checked_but_not_created_at_fit_start(
    mnist1d_small, tmp_path, kind
):
    """The check reads the first folder above it that exists: the run's folder is not made at fit start (a
    fit refused later would leave it behind, and TensorBoard and CSV loggers number their versions by the
    folders they find); without a report (`fast_dev_run` writes none) nothing is checked."""
    run = tmp_path / "store" / "experiment" / "run-a"
    seen: list[bool] = []

    class _RunFolderAtFitStart(pl.Callback):  # listed after the report's callback: after its check
        def on_fit_start(self, trainer, pl_module) -> None:
            seen.append(run.exists())

    clock, logger = SimulatedClock("2020-06-15 14:00:00"), StoreLogger(tmp_path / "store", "run-a")
    callbacks = [*_one_callback(kind, clock), _RunFolderAtFitStart()]
    trainer = pl.Trainer(callbacks=callbacks, max_steps=3, limit_val_batches=0,
                         **trainer_kwargs(logger=logger, default_root_dir=tmp_path))  # fmt: skip
    trainer.fit(*mnist1d_small(arch="mlp"))
    assert seen == [False] and trainer.global_step == 3
    reports = callbacks[0].report_paths if kind == "energy" else callbacks[1].report_paths
    assert reports and reports[0].parent == run

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    smoke = pl.Trainer(callbacks=_one_callback(kind, clock), fast_dev_run=True,
                       **trainer_kwargs(default_root_dir=str(blocker / "run")))  # fmt: skip
    smoke.fit(*mnist1d_small(arch="mlp"))
    assert smoke.global_step == 1
