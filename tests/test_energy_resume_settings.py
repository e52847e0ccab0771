"""EnergyLogger resumed with other settings than the checkpoint's: a rate given, changed or dropped, another
currency, or the EnergyLogger itself added on the resume of a checkpoint saved without it."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from examples.mnist1d import MNIST1DClassifier, MNIST1DDataModule
from lightning_pulse.callbacks.energy_logger import EnergyLogger
from lightning_pulse.energy.account import EnergyAccount
from lightning_pulse.energy.carbon import Rate
from lightning_pulse.energy.compare import chart_title, compare_runs, load_run
from lightning_pulse.energy.config import MeterConfig
from lightning_pulse.energy.meter import ESTIMATED, NONE, PARTIAL
from lightning_pulse.energy.report import JSON_NAME, MARKDOWN_NAME
from lightning_pulse.energy.suspend_carry import carry_path
from lightning_pulse.errors import PulseRefusal
from tests.conftest import trainer_kwargs
from tests.test_energy_ledger import ManualClock, constant_chain

G_PER_KWH = "gCO2eq/kWh"


def fit(root: Path, energy: EnergyLogger | None, max_epochs: int, resume: bool = False) -> pl.Trainer:
    """12 steps an epoch, ``last.ckpt`` saved in ``root`` at the end; ``resume``: from it."""
    pl.seed_everything(0)
    callbacks = [ModelCheckpoint(dirpath=root, save_last=True, save_top_k=0)]
    if energy is not None:
        callbacks.insert(0, energy)
    options = trainer_kwargs(
        max_epochs=max_epochs, limit_train_batches=12, limit_val_batches=2, enable_checkpointing=True
    )
    trainer = pl.Trainer(callbacks=callbacks, default_root_dir=root, **options)
    ckpt_path = str(root / "last.ckpt") if resume else None
    trainer.fit(
        MNIST1DClassifier(arch="mlp"), MNIST1DDataModule(num_samples=1000, batch_size=20), ckpt_path=ckpt_path
    )
    return trainer


def energy_logger(root: Path, **kwargs) -> EnergyLogger:
    meters = MeterConfig(sampling_period=0.05, cpu_watts=10.0)
    return EnergyLogger(cpu="constant", ram="none", gpu="none", report_dir=str(root), meters=meters, **kwargs)


def energy_warnings(record) -> list[str]:
    return [str(w.message) for w in record if str(w.message).startswith("EnergyLogger:")]


# (argument, value, figure, its method, the rate block in the report)
RATES = {
    "carbon_intensity": ("carbon_intensity", 400.0, "co2_kg", "co2_method", "carbon_intensity"),
    "price_per_kwh": ("price_per_kwh", 0.3, "cost", "cost_method", "price"),
}


@pytest.mark.parametrize("rate", sorted(RATES))
def test_a_rate_given_only_on_a_resume_makes_the_figure_partial_not_the_whole_runs(tmp_path, rate, recwarn):
    # sweep-resume2 #3: the part before the resume was booked at 0 g (0 cost) and the sum labelled estimated,
    # a whole-run figure at 154.7 g/kWh for a constant 400; epoch 0 said 0.0 g/kWh, estimated
    argument, value, figure, method, block = RATES[rate]
    per_kwh = value / 1000 if figure == "co2_kg" else value  # kg CO2 (or cost) per kWh
    fit(tmp_path, energy_logger(tmp_path), max_epochs=2)
    energy = energy_logger(tmp_path, **{argument: value})
    fit(tmp_path, energy, max_epochs=4, resume=True)
    report, total = energy.report, energy.report["total"]

    assert total[method] == PARTIAL
    for epoch in ("0", "1"):  # before the resume: no rate, no figure
        assert report["epochs"][epoch][figure] is None and report["epochs"][epoch][method] == NONE
    for epoch in ("2", "3"):
        assert report["epochs"][epoch][method] == ESTIMATED
        assert report["epochs"][epoch][figure] == pytest.approx(
            per_kwh * report["epochs"][epoch]["energy_kwh"]
        )
    described = report[block]
    # the figure is the counted part's: the rate times the energy less what no rate counted
    counted_kwh = total["energy_kwh"] - described["uncounted_kwh"]
    assert 0 < counted_kwh < total["energy_kwh"]
    assert total[figure] == pytest.approx(per_kwh * counted_kwh, rel=1e-6)
    if figure == "co2_kg":
        assert total["g_co2_per_kwh"] == pytest.approx(value, rel=1e-6)
    assert [(part["from_step"], part["source"], part["value"]) for part in described["parts"]] == [
        (0, None, None),
        (24, "constant", value),
    ]
    said = energy_warnings(recwarn)
    assert len(said) == 1 and said[0].startswith(
        f"EnergyLogger: `{argument}` is given on this resume (step 24)"
    )
    assert "steps 0-24" in said[0] and f"give `{argument}` from its start" in said[0]
    markdown = (tmp_path / MARKDOWN_NAME).read_text()
    assert (
        "(partial)" in markdown and "not the whole run's" in markdown and "at steps 0-24 had no" in markdown
    )
    assert "uncounted_kwh=" not in markdown  # said in the line above, not as a raw float in the footer


@pytest.mark.parametrize("rate", sorted(RATES))
def test_a_plain_resume_with_the_same_rate_reports_a_whole_run_figure_as_before(tmp_path, rate, recwarn):
    argument, value, figure, method, block = RATES[rate]
    fit(tmp_path, energy_logger(tmp_path, **{argument: value}), max_epochs=2)
    energy = energy_logger(tmp_path, **{argument: value})
    fit(tmp_path, energy, max_epochs=4, resume=True)
    report, total = energy.report, energy.report["total"]
    assert total[method] == ESTIMATED and report["figures_from_step"] == 0 and report["resumed_runs"] == 1
    assert total[figure] == pytest.approx(value * total["energy_kwh"] / (1000 if figure == "co2_kg" else 1))
    assert "parts" not in report[block] and "uncounted_kwh" not in report[block]
    assert energy_warnings(recwarn) == []


def test_another_currency_on_a_resume_is_refused_at_fit_start(tmp_path):
    # sweep-resume2 #4: a cost of 7.7e-08 EUR was added to the resumed part's USD and the sum labelled USD
    fit(tmp_path, energy_logger(tmp_path, price_per_kwh=0.3, currency="EUR"), max_epochs=1)
    with pytest.raises(PulseRefusal) as refused:
        fit(tmp_path, energy_logger(tmp_path, price_per_kwh=0.3, currency="USD"), max_epochs=2, resume=True)
    first_line = str(refused.value).splitlines()[0]
    assert first_line.startswith("EnergyLogger: `currency`='USD' on this resume, but the checkpoint's run")
    assert "in 'EUR'" in first_line and "Resume with `currency`='EUR'" in first_line


def test_an_energy_logger_added_on_a_resume_says_its_figures_start_at_the_resume(tmp_path, caplog):
    # sweep-resume2 #5: added at step 30 of 50 to a checkpoint saved without it, its report of 20 steps read
    # "complete; 0 resume(s)" as the whole run's, and nothing said the figures start at step 30
    fit(tmp_path, None, max_epochs=2)
    energy = energy_logger(tmp_path)
    with caplog.at_level(logging.INFO):
        fit(tmp_path, energy, max_epochs=4, resume=True)
    report = energy.report
    assert report["figures_from_step"] == 24 and report["total"]["steps"] == 24
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("EnergyLogger:")]
    added = [line for line in lines if "added to this run at step 24" in line]
    assert len(added) == 1 and "from step 24 on only, not the whole run" in added[0]
    assert any("the run from step 24 on (24 steps)" in line for line in lines if "forecast" in line)
    markdown = (tmp_path / MARKDOWN_NAME).read_text()
    assert (
        "**Figures from step 24 on only**: EnergyLogger's figures start there (it was added on a" in markdown
    )
    # compared with a run metered whole, its totals are unequal work, not a saving
    whole = tmp_path / "whole"
    whole.mkdir()
    (whole / JSON_NAME).write_text(json.dumps({**report, "figures_from_step": 0}))
    comparison = compare_runs(load_run(whole), load_run(tmp_path / JSON_NAME))
    energy_row = next(row for row in comparison["figures"] if row["figure"] == "energy_kwh")
    assert energy_row["note"].startswith("B counts from step 24 on: unequal work (A: 24 steps, B: 24)")
    assert "B counts from step 24 on: its totals cover only part of the run" in chart_title(comparison)

    caplog.clear()
    again = energy_logger(tmp_path)  # its own checkpoint: the figures still start at step 24
    with caplog.at_level(logging.INFO):
        fit(tmp_path, again, max_epochs=5, resume=True)
    assert again.report["figures_from_step"] == 24 and again.report["total"]["steps"] == 36
    assert again.report["resumed_runs"] == 1
    assert not any("added to this run" in r.getMessage() for r in caplog.records)


def test_a_later_fit_of_a_trainer_without_a_checkpoint_says_its_figures_cover_that_fit_not_a_resume(
    tmp_path, caplog
):
    # review of the fix above: a second `fit` of one Trainer, with no checkpoint, said "added to this run
    # at step 24, with no state of its own" and, in the Markdown, "added on a resume of a checkpoint saved
    # without it": neither happened (it metered steps 0-24 and, a new run, dropped them); step 24 was right
    energy = energy_logger(tmp_path)
    options = trainer_kwargs(max_epochs=2, limit_train_batches=12, limit_val_batches=2)
    trainer = pl.Trainer(callbacks=[energy], default_root_dir=tmp_path, **options)
    pl.seed_everything(0)
    trainer.fit(MNIST1DClassifier(arch="mlp"), MNIST1DDataModule(num_samples=1000, batch_size=20))
    assert energy.report["figures_from_step"] == 0
    trainer.fit_loop.max_epochs = 4
    with caplog.at_level(logging.INFO):
        trainer.fit(trainer.lightning_module, MNIST1DDataModule(num_samples=1000, batch_size=20))
    report = energy.report
    assert (
        report["figures_from_step"] == 24 and report["total"]["steps"] == 24 and report["resumed_runs"] == 0
    )
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("EnergyLogger:")]
    assert not any("added to this run" in line for line in lines)
    later = [line for line in lines if "this fit starts at step 24 with no checkpoint" in line]
    assert len(later) == 1 and "cover this fit only, from step 24 on, not the steps before" in later[0]
    markdown = (tmp_path / MARKDOWN_NAME).read_text()
    assert "or a later `fit` of a Trainer started there with no checkpoint" in markdown


# ---------------------------------------------------------------------- the account, on a manual clock
def rate(value: float, unit: str = G_PER_KWH) -> Rate:
    return Rate("constant", unit, constant=value)


def account(clock: ManualClock, intensity: Rate | None, price: Rate | None = None) -> EnergyAccount:
    return EnergyAccount(
        intensity, price, sampling_period=3600.0, clock=clock, wall_clock=lambda: 1e9 + clock()
    )


def train(account: EnergyAccount, clock: ManualClock, step: int, seconds: float, said: list[str]) -> None:
    """A fit from ``step`` (a resume past 0) that trains ``seconds`` at 36 W (0.001 kWh in 100 s)."""
    account.start([constant_chain("cpu", 36.0)])
    account.begin_training(lambda: step)
    account.join_run(step, step > 0, said.append, said.append)
    account.mark_training("burst", None, 0)
    clock.now += seconds


def test_a_changed_rate_adds_the_parts_each_at_its_own_rate_and_says_so():
    # sweep-resume2 #4 (note): 400 then 100 gave a blended figure and a report describing only the new rate
    clock, said = ManualClock(), []
    first = account(clock, rate(400.0))
    train(first, clock, 0, 100.0, said)
    state = first.state_dict()
    first.stop()
    resumed = account(clock, rate(100.0))
    resumed.load_state_dict(state)
    train(resumed, clock, 10, 100.0, said)
    report = resumed.report("complete", "EUR")
    resumed.stop()
    assert report["total"]["co2_kg"] == pytest.approx(0.001 * 0.4 + 0.001 * 0.1)
    assert report["total"]["co2_method"] == ESTIMATED
    assert [(p["from_step"], p["value"]) for p in report["carbon_intensity"]["parts"]] == [
        (0, 400.0),
        (10, 100.0),
    ]
    assert said == [
        "EnergyLogger: `carbon_intensity` changed on this resume (step 10): constant 400 gCO2eq/kWh before, "
        "constant 100 gCO2eq/kWh from here; the run's CO2 adds the parts, each at its own rate (the report "
        "lists them)."
    ]


def version_1_buckets(snapshot: dict) -> dict:
    """``snapshot`` as a version-1 account (before rate parts were kept) saved it: no uncounted joules."""
    for bucket in snapshot["buckets"].values():
        bucket.pop("co2_uncounted_j"), bucket.pop("cost_uncounted_j")
    return snapshot


def version_1(state: dict) -> dict:
    """``state`` as a version-1 account saved it: no rate parts, no start step, no uncounted joules."""
    state = {key: value for key, value in state.items() if key not in ("rates", "from_step")} | {"version": 1}
    return {**state, "snapshot": version_1_buckets(state["snapshot"])}


def test_a_version_1_checkpoint_of_a_run_without_a_rate_resumed_with_one_is_partial():
    # checkpoints saved before the parts were kept: a run with no intensity counted none of its energy
    clock, said = ManualClock(), []
    first = account(clock, None)
    train(first, clock, 0, 100.0, said)
    state = first.state_dict()
    first.stop()
    state = version_1(state)
    resumed = account(clock, rate(400.0))
    resumed.load_state_dict(state)
    train(resumed, clock, 10, 100.0, said)
    total = resumed.report("complete", "EUR")["total"]
    resumed.stop()
    assert total["co2_method"] == PARTIAL and total["co2_kg"] == pytest.approx(0.001 * 0.4)
    assert total["g_co2_per_kwh"] == pytest.approx(400.0) and total["energy_kwh"] == pytest.approx(0.002)
    assert len(said) == 1 and "is given on this resume (step 10)" in said[0]


def test_a_version_1_checkpoint_with_the_same_rate_resumes_as_before():
    clock, said = ManualClock(), []
    first = account(clock, rate(400.0))
    train(first, clock, 0, 100.0, said)
    state = first.state_dict()
    first.stop()
    state = version_1(state)
    resumed = account(clock, rate(400.0))
    resumed.load_state_dict(state)
    train(resumed, clock, 10, 100.0, said)
    report = resumed.report("complete", "EUR")
    resumed.stop()
    assert report["total"]["co2_method"] == ESTIMATED and report["total"]["co2_kg"] == pytest.approx(0.0008)
    assert report["figures_from_step"] == 0 and "parts" not in report["carbon_intensity"] and said == []


def test_a_dropped_rate_is_said_and_the_report_has_no_figure():
    clock, said = ManualClock(), []
    first = account(clock, None, rate(0.3, "EUR/kWh"))
    train(first, clock, 0, 100.0, said)
    state = first.state_dict()
    first.stop()
    resumed = account(clock, None, None)
    resumed.load_state_dict(state)
    train(resumed, clock, 10, 100.0, said)
    report = resumed.report("complete", "EUR")
    resumed.stop()
    assert report["price"] is None and report["total"]["cost"] is None
    assert said == [
        "EnergyLogger: no `price_per_kwh` on this resume (step 10); the run before counted its cost with "
        "constant 0.3 EUR/kWh: the report has no cost."
    ]


def test_a_version_1_suspend_checkpoint_and_carry_file_resumed_with_a_rate_leave_the_whole_fit_unpriced(
    tmp_path,
):
    # review: a GreenWindow suspend checkpoint and its carry file saved before the parts were kept, of a run
    # without a carbon intensity, resumed with one: the carry file's figures (which replace the checkpoint's)
    # must count no joule as priced, or the CO2 came back estimated at 327 g/kWh for a constant 400; and the
    # file must still match the checkpoint that gained fields on loading, or its 0.0005 kWh are lost
    clock, said = ManualClock(), []
    checkpoint = tmp_path / "last-green-window.ckpt"
    first = account(clock, None)
    train(first, clock, 0, 100.0, said)  # 0.001 kWh up to the suspend checkpoint
    state = first.state_dict()
    first.saved_for_suspend(checkpoint)
    clock.now += 50.0  # Lightning's validation after the stop: 0.0005 kWh more, in the carry file only
    first.carry_past_checkpoint(writes=True)
    first.stop()
    record = json.loads(carry_path(checkpoint).read_text())  # as version 1 wrote it (the format kept its 1)
    assert record["version"] == 1
    for name in ("co2_uncounted_j", "cost_uncounted_j"):
        record["checkpoint_total"].pop(name)
    version_1_buckets(record["snapshot"])
    carry_path(checkpoint).write_text(json.dumps(record))

    resumed = account(clock, rate(400.0))
    resumed.load_state_dict(version_1(state))
    resumed.extend_carried(checkpoint, said.append)
    train(resumed, clock, 10, 100.0, said)
    report = resumed.report("complete", "EUR")
    resumed.stop()
    total = report["total"]
    assert total["energy_kwh"] == pytest.approx(0.0025)
    assert report["carbon_intensity"].get("uncounted_kwh") == pytest.approx(0.0015)  # the whole suspended fit
    assert total["co2_method"] == PARTIAL and total["co2_kg"] == pytest.approx(0.001 * 0.4)
    assert total["g_co2_per_kwh"] == pytest.approx(400.0)
    assert said[0].startswith("EnergyLogger: the suspended fit used 0.0005 kWh after saving its checkpoint")
    assert len(said) == 2 and "leaves out the 0.0015 kWh used there" in said[1]
