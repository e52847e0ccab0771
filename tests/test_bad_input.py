"""Bad input found by a held-out sweep (436 bad values, from Python and from YAML through the CLI): each is now
refused before the first training step, and the message starts with the callback's name and names the field."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import Callback

from lightning_pulse import (
    EnergyLogger,
    GradientCache,
    GreenWindow,
    HardSampleReplay,
    HyperConnectionMonitor,
    PulseCycle,
    ScheduledPrune,
    StabilityGuard,
)
from lightning_pulse.core.green_window import GreenWindowOptions
from lightning_pulse.core.stability_policy import StabilityGuardConfig
from lightning_pulse.energy.signal import LiveSignal
from lightning_pulse.errors import PulseRefusal
from tests.conftest import trainer_kwargs


class _CountSteps(Callback):
    def __init__(self) -> None:
        self.steps = 0

    def on_train_batch_end(self, *args) -> None:
        self.steps += 1


def _refused_before_the_first_step(make_data, callbacks, match: str) -> None:
    counter = _CountSteps()
    model, data = make_data()
    trainer = pl.Trainer(max_epochs=1, callbacks=[*callbacks, counter], **trainer_kwargs())
    with pytest.raises(PulseRefusal, match=match):
        trainer.fit(model, data)
    assert counter.steps == 0


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: HardSampleReplay(mode="Steps"), r"^HardSampleReplay: `mode`='Steps'"),
        (lambda: ScheduledPrune(mode="Structured"), r"^ScheduledPrune: `mode`='Structured'"),
        (lambda: GradientCache(phases=[]), r"^GradientCache: `phases`=\[\]"),
        (lambda: StabilityGuard(window=1), r"^StabilityGuard: `window`=1"),
        (lambda: HyperConnectionMonitor(every_n_steps=0), r"^HyperConnectionMonitor: `every_n_steps`=0"),
    ],
    ids=["replay", "prune", "cache", "guard", "monitor"],
)
def test_every_callbacks_construction_error_starts_with_its_name(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"report_dir": 5}, "options.report_dir"),  # used to fail at on_train_end, after all the training
        ({"report_dir": " "}, "options.report_dir"),
        ({"watts": True}, "options.watts"),  # a bool is an int to Python: it counted as 1 W
        ({"watts": float("inf")}, "options.watts"),
        ({"unit": ""}, "options.unit"),
        ({"unit": 5}, "options.unit"),
    ],
)
def test_green_window_options_refuse_values_of_the_wrong_kind(kwargs, field):
    with pytest.raises(ValueError, match=f"`{field}`="):
        GreenWindowOptions(**kwargs)


def test_a_clock_without_sleep_or_a_time_source_that_is_not_callable_is_refused_at_construction():
    class TimeOnly:
        def time(self) -> float:
            return 0.0

    with pytest.raises(ValueError, match=r"^GreenWindow: `clock`=.* `sleep\(seconds\)`"):
        GreenWindow(signal=[(0, 1.0), (3600, 2.0)], when_dirty="pause", clock=TimeOnly())
    with pytest.raises(ValueError, match=r"^PulseCycle: `time_source`=5 must be a callable"):
        PulseCycle(time_source=5)


def test_a_time_source_returning_no_number_is_refused_at_fit_start(mnist1d_small):
    # it raised a bare TypeError after the first optimizer step
    _refused_before_the_first_step(
        mnist1d_small, [PulseCycle(burst="10s", time_source=lambda: "x")], r"`time_source` returned 'x'"
    )


def test_a_live_signal_reading_of_the_wrong_shape_names_the_field():
    with pytest.raises(ValueError, match=r"^`signal`: the callable returned 'bad'"):
        LiveSignal(lambda: "bad").observe()


def test_an_empty_report_dir_is_refused_instead_of_writing_to_the_working_directory():
    with pytest.raises(ValueError, match=r"^EnergyLogger: `report_dir`=''"):
        EnergyLogger(report_dir="")


def test_a_prune_schedule_that_starts_after_the_run_ends_is_refused(mnist1d_small):
    # 12 steps: it was accepted, pruned nothing and said nothing
    prune = ScheduledPrune(final_sparsity=0.5, start=1000, end=2000)
    _refused_before_the_first_step(
        mnist1d_small, [prune], r"^ScheduledPrune: the schedule starts at step 1000"
    )


def test_a_guard_learning_rate_factor_that_can_never_act_is_refused():
    with pytest.raises(ValueError, match=r"`lr_factor_after_rollback`=0.5 .* `lr_cooldown_steps`=0"):
        StabilityGuardConfig(lr_factor_after_rollback=0.5)


@pytest.mark.parametrize(
    "callback",
    [lambda: HardSampleReplay(mode="batch", phases=["maintain"]), lambda: GradientCache(phases=["burst"])],
    ids=["replay", "cache"],
)
def test_phases_that_never_come_without_a_pulse_cycle_are_refused(mnist1d_small, callback):
    # without a PulseCycle every step counts as 'replay': these never selected or froze anything, silently
    _refused_before_the_first_step(mnist1d_small, [callback()], r"`phases`=.* without a PulseCycle")
