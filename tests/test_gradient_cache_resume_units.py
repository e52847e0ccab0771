"""GradientCache resumed with another `units` argument than the checkpoint's run: real fits on MNIST-1D."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_pulse.callbacks.gradient_cache import GradientCache
from lightning_pulse.core.layer_freezing import UNITS_ARGUMENT
from lightning_pulse.errors import PulseRefusal
from tests.conftest import trainer_kwargs

# threshold 2.0: every unit counts as stable once scored, so each window's end freezes what it may
EAGER = dict(threshold=2.0, check_every=5, freeze_for=20)
OTHER_UNITS = ["net.5", "net.8"]  # the two convolutions before them form "<rest>"


def run(mnist1d_small, steps: int, ckpt_path: Path | None = None, save: Path | None = None, **cache_kw):
    pl.seed_everything(7)
    model, data = mnist1d_small()
    data.setup("fit")
    loader = DataLoader(data.train_set, batch_size=64, shuffle=False)  # order independent of the RNG state
    cache = GradientCache(**EAGER, **cache_kw)
    # whole epochs of 6 batches: a checkpoint at an epoch's end resumes bit for bit
    epochs = steps // 6
    trainer = pl.Trainer(callbacks=[cache], max_epochs=epochs, limit_train_batches=6, **trainer_kwargs())
    trainer.fit(model, train_dataloaders=loader, ckpt_path=None if ckpt_path is None else str(ckpt_path))
    if save is not None:
        trainer.save_checkpoint(save)
    return model, cache


def strip_units_argument(path: Path) -> None:
    """Make the checkpoint look written by a release that did not save the `units` argument."""
    saved = torch.load(path, weights_only=False)
    for key, state in saved["callbacks"].items():
        if key.startswith("GradientCache"):
            state.pop(UNITS_ARGUMENT, None)
    torch.save(saved, path)


@pytest.mark.parametrize("argument_saved", [True, False], ids=["saved", "older_checkpoint"])
def test_a_resume_with_other_units_uses_them_as_a_fresh_fit_does_and_says_so(
    mnist1d_small, tmp_path, caplog, argument_saved
):
    checkpoint = tmp_path / "default_units.ckpt"
    _, saved_cache = run(mnist1d_small, 12, save=checkpoint)
    assert saved_cache.frozen_units == [] and any(saved_cache.freezer.frozen), "written mid-freeze"
    saved_prefix = saved_cache.freezer.frozen_prefix
    if not argument_saved:
        strip_units_argument(checkpoint)
    _, fresh = run(mnist1d_small, 12, units=OTHER_UNITS)
    with caplog.at_level("INFO"):
        _, resumed = run(mnist1d_small, 24, ckpt_path=checkpoint, units=OTHER_UNITS)

    # the units of a fresh fit with this argument, in its forward order (before: the checkpoint's four)
    assert [unit.name for unit in resumed.freezer.units] == [unit.name for unit in fresh.freezer.units]
    assert [unit.name for unit in fresh.freezer.units] == ["<rest>", "net.5", "net.8"]
    # the saved prefix is released where the fit resumes, then the new units freeze as a fresh fit's do,
    # one window after the resumed step
    assert fresh.events[0] == {"step": 5, "from": 0, "to": fresh.events[0]["to"], "reason": "check"}
    new_events = resumed.events[len(saved_cache.events) :]
    assert resumed.events[: len(saved_cache.events)] == saved_cache.events
    assert new_events[:2] == [
        {"step": 12, "from": saved_prefix, "to": 0, "reason": "units"},
        {"step": 17, "from": 0, "to": fresh.events[0]["to"], "reason": "check"},
    ]
    # the run's statistics go on: steps counted over both fits, the checkpoint's freezes with the new ones
    assert resumed.freezer.steps == 24
    assert resumed.freezer.freezes == saved_cache.freezer.freezes + fresh.freezer.freezes
    said = [record.getMessage() for record in caplog.records if "`units` changed" in record.getMessage()]
    assert len(said) == 1
    assert "['net.1', 'net.3', 'net.5', 'net.8']" in said[0] and "['net.5', 'net.8']" in said[0]
    assert f"frozen prefix of {saved_prefix} unit(s) is released" in said[0]
    assert ("resume with `units`=None" if argument_saved else "resume with the `units` that gave") in said[0]


def test_a_resume_with_a_units_name_the_model_lacks_is_refused_before_the_first_step(mnist1d_small, tmp_path):
    checkpoint = tmp_path / "default_units.ckpt"
    run(mnist1d_small, 12, save=checkpoint)
    # before: the checkpoint's units were kept and the name never looked at
    with pytest.raises(PulseRefusal, match="`units` entry 'net.99' is neither a module nor a parameter"):
        run(mnist1d_small, 24, ckpt_path=checkpoint, units=["net.99"])


def test_an_argument_that_gives_the_checkpoint_s_units_again_keeps_its_freezing_bit_for_bit(
    mnist1d_small, tmp_path
):
    # the automatic split of this model is these four modules: naming them is no change (a guard: the
    # comparison is by the units an argument gives, not by the argument)
    whole_model, whole = run(mnist1d_small, 24)
    checkpoint = tmp_path / "default_units.ckpt"
    run(mnist1d_small, 12, save=checkpoint)
    model, resumed = run(mnist1d_small, 24, ckpt_path=checkpoint, units=["net.8", "net.5", "net.3", "net.1"])
    assert [unit.name for unit in resumed.freezer.units] == ["net.1", "net.3", "net.5", "net.8"]
    assert resumed.events == whole.events and all(event["reason"] != "units" for event in resumed.events)
    for name, param in whole_model.named_parameters():
        assert torch.equal(param, dict(model.named_parameters())[name]), name


def test_a_guard_rollback_after_a_resume_with_other_units_keeps_them(mnist1d_small, tmp_path):
    """A StabilityGuard listed first snapshots at fit start, before GradientCache takes the checkpoint over:
    a rollback to that snapshot put the checkpoint's units back, silently, and the next checkpoint saved them
    under this fit's `units` argument, so every later resume kept them (a review)."""
    from lightning_pulse import StabilityGuard

    checkpoint = tmp_path / "default_units.ckpt"
    run(mnist1d_small, 12, save=checkpoint)
    pl.seed_everything(7)
    model, data = mnist1d_small()
    data.setup("fit")
    loader = DataLoader(data.train_set, batch_size=64, shuffle=False)
    original = model.training_step

    def training_step(batch, batch_idx):  # a fault after the resume: the guard rolls back to its fit start
        loss = original(batch, batch_idx)
        return loss * float("nan") if model.trainer.global_step in (14, 15, 16) else loss

    model.training_step = training_step
    guard, cache = StabilityGuard(snapshot_every=1000), GradientCache(**EAGER, units=OTHER_UNITS)
    trainer = pl.Trainer(callbacks=[guard, cache], max_epochs=4, limit_train_batches=6, **trainer_kwargs())
    trainer.fit(model, train_dataloaders=loader, ckpt_path=str(checkpoint))

    rollbacks = [event for event in guard.events if event["event"] == "rollback"]
    assert rollbacks and rollbacks[0]["to_step"] == 12  # the fit-start snapshot
    assert [unit.name for unit in cache.freezer.units] == ["<rest>", "net.5", "net.8"]
    state = cache.state_dict()
    assert state["cache"]["units"] == ["<rest>", "net.5", "net.8"] and state[UNITS_ARGUMENT] == OTHER_UNITS
