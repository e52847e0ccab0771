"""Configurations found by a held-out YAML sweep (s5) that were accepted and did nothing, or refused with a
line that named no field: each is now refused before training, the first line naming the class, the field,
the value and what is allowed."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import yaml
from lightning.pytorch.callbacks import Callback

from lightning_pulse import GradientCache, HardSampleReplay, HyperConnectionMonitor, PulseCycle
from lightning_pulse.cli import main
from lightning_pulse.core.stability_policy import StabilityGuardConfig
from lightning_pulse.errors import PulseRefusal
from tests.conftest import trainer_kwargs

PULSE_YAML = Path(__file__).resolve().parents[1] / "examples" / "mnist1d" / "pulse.yaml"


class _CountSteps(Callback):
    def __init__(self) -> None:
        self.steps = 0

    def on_train_batch_end(self, *args) -> None:
        self.steps += 1


# ---------------------------------------------------------------- GradientCache: an empty freezing window
@pytest.mark.parametrize(
    ("start_at", "release_at", "match"),
    [
        (20, 5, r"`release_at`=5 is not after `start_at`=20"),
        (0.8, 0.2, r"`release_at`=0.2 is not after `start_at`=0.8"),
        (7, 7, r"`release_at`=7 is not after `start_at`=7"),
        (None, 0, r"`release_at`=0 is not after `start_at`=None"),
    ],
)
def test_a_release_at_not_after_start_at_of_the_same_kind_fails_at_construction(start_at, release_at, match):
    # it was accepted, froze nothing, and the run's end note blamed weights still moving
    with pytest.raises(ValueError, match=rf"^GradientCache: {match}, so nothing would ever be frozen"):
        GradientCache(start_at=start_at, release_at=release_at)


def test_a_share_release_at_landing_before_a_step_start_at_is_refused_before_the_first_step(mnist1d_small):
    # a step against a share compares only once the run's length is known: 0.25 of 40 steps is step 10
    model, data = mnist1d_small()
    counter = _CountSteps()
    cache = GradientCache(threshold=2.0, check_every=2, freeze_for=2, start_at=30, release_at=0.25)
    trainer = pl.Trainer(callbacks=[cache, counter], **trainer_kwargs(max_steps=40))
    with pytest.raises(
        PulseRefusal, match=r"^GradientCache: `release_at`=0.25 is not after `start_at`=30 \(steps 30 and 10 "
    ):
        trainer.fit(model, data)
    assert counter.steps == 0


def test_a_step_start_at_before_a_share_release_at_freezes_inside_the_window(mnist1d_small):
    model, data = mnist1d_small()
    cache = GradientCache(threshold=2.0, check_every=2, freeze_for=2, start_at=4, release_at=0.5)
    pl.Trainer(callbacks=[cache], **trainer_kwargs(max_steps=16)).fit(model, data)
    steps = [event["step"] for event in cache.events]
    assert steps and all(4 <= step <= 8 for step in steps), cache.events


# ---------------------------------------------------------------- null where a list goes
@pytest.mark.parametrize(
    ("make", "match"),
    [
        (
            lambda: PulseCycle(order=None),
            r"^PulseCycle: `order`=None must be a list of phase names, such as \[",
        ),
        (lambda: PulseCycle(order=5), r"^PulseCycle: `order`=5 must be a list of phase names"),
        (
            lambda: HardSampleReplay(phases=None),
            r"^HardSampleReplay: `phases`=None must be a non-empty list of",
        ),
        (lambda: HardSampleReplay(phases=5), r"^HardSampleReplay: `phases`=5 must be a non-empty list of"),
    ],
    ids=["order-null", "order-number", "phases-null", "phases-number"],
)
def test_a_null_or_a_number_for_a_list_option_names_the_field_and_what_it_takes(make, match):
    # it was a bare TypeError: 'NoneType' object is not iterable
    with pytest.raises(ValueError, match=match):
        make()


# ---------------------------------------------------------------- options that would do nothing
def test_probe_batches_with_the_maintain_probe_off_is_refused():
    with pytest.raises(
        ValueError, match=r"^PulseCycle: `probe_batches`=7 .* `maintain_eval`='none' turns off"
    ):
        PulseCycle(maintain_eval="none", probe_batches=7)
    # left at its default it is not the user's choice, and is accepted
    assert PulseCycle(maintain_eval="none", probe_batches=4).probe_batches == 4


def test_a_guard_cooldown_whose_learning_rate_factor_is_one_is_refused():
    with pytest.raises(
        ValueError,
        match=r"^StabilityGuardConfig: `lr_cooldown_steps`=20 .* `lr_factor_after_rollback`=1.0 .* nothing",
    ):
        StabilityGuardConfig(lr_cooldown_steps=20)
    assert StabilityGuardConfig(lr_cooldown_steps=20, lr_factor_after_rollback=0.5).lr_cooldown_steps == 20


@pytest.mark.parametrize("per_layer", ["no", None, 1])
def test_a_per_layer_that_is_not_a_bool_is_refused(per_layer):
    # bool('no') is True and bool(None) is False: both were taken silently
    with pytest.raises(
        ValueError, match=rf"^HyperConnectionMonitor: `per_layer`={per_layer!r} must be a bool"
    ):
        HyperConnectionMonitor(per_layer=per_layer)


# ---------------------------------------------------------------- the CLI's first line
def _cli_error(tmp_path, capsys, callback: dict) -> str:
    config = yaml.safe_load(PULSE_YAML.read_text())
    config["trainer"]["callbacks"] = [callback]
    config["trainer"]["default_root_dir"] = str(tmp_path)
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(config))
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(bad)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) <= 2 and not list(tmp_path.rglob("*.ckpt"))  # one sentence, one hint; nothing trained
    return err[0]


def test_numbers_for_layer_types_in_yaml_name_the_field_the_entry_and_what_it_takes(tmp_path, capsys):
    # the line was "ScheduledPrune: Expected a <class 'str'>"
    callback = {"class_path": "lightning_pulse.ScheduledPrune", "init_args": {"layer_types": [1, 2]}}
    assert _cli_error(tmp_path, capsys, callback) == (
        "error: `trainer.callbacks[0]` ScheduledPrune: `layer_types`=[1, 2]: entry 1 is not accepted; "
        "expected a list of layer classes by name: a torch.nn name such as Linear, or a dotted import path "
        "such as mypackage.layers.MyConv, or null."
    )


@pytest.mark.parametrize(
    ("callback", "expected"),
    [
        (
            {"class_path": "lightning_pulse.PulseCycle", "init_args": {"order": None}},
            "error: PulseCycle: `order`=None must be a list of phase names",
        ),
        (
            {"class_path": "lightning_pulse.HyperConnectionMonitor", "init_args": {"per_layer": None}},
            "error: HyperConnectionMonitor: `per_layer`=None must be a bool",
        ),
    ],
    ids=["order", "per_layer"],
)
def test_a_null_in_yaml_for_a_list_or_a_bool_names_the_field(tmp_path, capsys, callback, expected):
    assert _cli_error(tmp_path, capsys, callback).startswith(expected)
