"""A step-saving run resumed with other settings: the plan is remade for them, and the messages name them."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import TensorDataset

from examples.digits import DigitsDataModule
from lightning_pulse import HardSampleReplay, PulseCycle
from lightning_pulse.errors import PulseRefusal
from tests.clients import _DigitsClassifier
from tests.conftest import trainer_kwargs

CYCLE = dict(burst=8, replay=8, maintain=4, maintain_eval="none")


class DigitsMLP(_DigitsClassifier):
    def __init__(self, lr: float = 3e-3) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))

    def forward(self, x):
        return self.net(x)


class FirstRows(DigitsDataModule):
    """Digits with only the first ``rows`` training samples (``None``: all 1295)."""

    def __init__(self, rows: int | None = None) -> None:
        super().__init__(batch_size=64)
        self.rows = rows

    def setup(self, stage: str | None = None) -> None:
        super().setup(stage)
        if self.rows is not None and len(self.train_set) != self.rows:
            self.train_set = TensorDataset(*(t[: self.rows] for t in self.train_set.tensors))


def _fit(callbacks, ckpt_path=None, checkpoints=None, every=30, rows=None, epochs=6):
    pl.seed_everything(0)
    torch.set_num_threads(1)
    saving = []
    if checkpoints is not None:
        saving = [ModelCheckpoint(dirpath=checkpoints, every_n_train_steps=every, save_top_k=-1)]
    trainer = pl.Trainer(
        callbacks=[*callbacks, *saving],
        max_epochs=epochs,
        **trainer_kwargs(enable_checkpointing=bool(saving)),
    )
    trainer.fit(DigitsMLP(), FirstRows(rows), ckpt_path=ckpt_path)
    return trainer


def _checkpoint(tmp_path, callbacks, step=30, **kwargs) -> str:
    """A mid-epoch checkpoint (21 plain steps an epoch) of a fit of ``callbacks``."""
    _fit(callbacks, checkpoints=tmp_path, every=step, **kwargs)
    return str(next(tmp_path.glob(f"*step={step}.ckpt")))


def _cycle(trainer) -> PulseCycle:
    return next(c for c in trainer.callbacks if isinstance(c, PulseCycle))


def test_a_budget_added_on_resume_remakes_the_plan_and_the_run_ends_in_its_anneal(tmp_path):
    # sweep F7: the checkpoint's 97-step plan was kept for a budget added on resume: the run trained 80 steps,
    # never reached its anneal (a share of 97), ended in a 42-step replay phase, and the budget warning said
    # 97 steps (0.770) for a run of 80, with only a generic "callbacks changed" warning
    path = _checkpoint(tmp_path, [PulseCycle(**CYCLE), HardSampleReplay()])
    with pytest.warns(UserWarning) as caught:
        resumed = _fit([PulseCycle(**CYCLE, budget=0.6), HardSampleReplay()], ckpt_path=path)
    cycle = _cycle(resumed)
    assert cycle.plan.total_steps == resumed.global_step < 97  # the run is its plan: no steps past it
    assert cycle.clock.stage == "anneal" and cycle.clock.phase.value == "burst"
    # the anneal is the last tenth of the remade plan's span, not of the checkpoint's 97 steps
    assert cycle.clock.span != 97 and abs(cycle.clock.span - resumed.global_step) <= 2
    assert cycle.clock.history[-1].step <= round(0.9 * cycle.clock.span)
    said = "\n".join(str(w.message) for w in caught)
    assert "PulseCycle's `budget` None -> 0.6 (its replay phase 8steps -> " in said
    assert "planned again from step 30 on" in said and "a PulseCycle added or removed" not in said
    # the shortfall names this plan's steps and the steps trained before the resume with the old settings
    assert f"its plan takes {resumed.global_step} of the plain run's 126" in said
    assert "its first 30 trained before the resume, with the checkpoint's settings" in said


def test_a_longer_burst_on_resume_places_the_anneal_on_the_new_length(tmp_path):
    # sweep F7: burst 8 -> 20 on resume trained 106 steps with its anneal from step 87 (0.9 x the old 97)
    path = _checkpoint(tmp_path, [PulseCycle(**CYCLE), HardSampleReplay()])
    with pytest.warns(UserWarning) as caught:
        resumed = _fit([PulseCycle(**{**CYCLE, "burst": 20}), HardSampleReplay()], ckpt_path=path)
    cycle = _cycle(resumed)
    assert cycle.plan.total_steps == resumed.global_step and cycle.clock.span == cycle.plan.span
    assert abs(cycle.clock.span - resumed.global_step) <= 2 and cycle.clock.stage == "anneal"
    said = "\n".join(str(w.message) for w in caught)
    assert (
        "PulseCycle's `burst` 8steps -> 20steps; the rest of the run was planned again from step 30" in said
    )


def test_a_resume_with_the_same_settings_keeps_the_checkpoints_plan_without_a_word(tmp_path):
    path = _checkpoint(tmp_path, [PulseCycle(**CYCLE), HardSampleReplay()])
    saved = torch.load(path, weights_only=False)["callbacks"]
    stream = next(v for k, v in saved.items() if k.startswith("HardSampleReplay"))["stream"]
    assert stream["settings"]["burst"] == "8steps" and stream["settings"]["budget"] is None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = _fit([PulseCycle(**CYCLE), HardSampleReplay()], ckpt_path=path)
    assert resumed.global_step == 97 and _cycle(resumed).clock.span == 97
    assert not [w for w in caught if "checkpoint's plan" in str(w.message)]

    # a checkpoint saved before the settings were: its plan is kept, as before (what changed is not known)
    older = torch.load(path, weights_only=False)
    del next(v for k, v in older["callbacks"].items() if k.startswith("HardSampleReplay"))["stream"][
        "settings"
    ]
    torch.save(older, tmp_path / "older.ckpt")
    with pytest.warns(UserWarning, match="callbacks' settings changed since .PulseCycle's phase lengths"):
        resumed = _fit(
            [PulseCycle(**{**CYCLE, "burst": 20}), HardSampleReplay()], ckpt_path=str(tmp_path / "older.ckpt")
        )
    assert _cycle(resumed).clock.span == 97


def test_hard_sample_replays_own_fraction_changed_on_resume_is_named_not_a_pulse_cycle(tmp_path):
    # sweep F6: with no PulseCycle in either run, the warning blamed "a PulseCycle added or removed"
    path = _checkpoint(tmp_path, [HardSampleReplay(replay_fraction=0.5)], step=15, epochs=4)
    with pytest.warns(UserWarning, match="HardSampleReplay: the checkpoint's plan was") as caught:
        resumed = _fit([HardSampleReplay(replay_fraction=0.9)], ckpt_path=path, epochs=4)
    said = "\n".join(str(w.message) for w in caught if "checkpoint's plan" in str(w.message))
    assert "HardSampleReplay's `replay_fraction` 0.5 -> 0.9" in said and "PulseCycle" not in said
    assert (
        resumed.global_step
        == next(c for c in resumed.callbacks if isinstance(c, HardSampleReplay)).steps.plan.total_steps
    )


@pytest.mark.parametrize("mode", ["steps", "batch"])
def test_a_resume_on_a_dataset_of_another_size_is_refused_naming_both_sizes_and_the_ways_out(tmp_path, mode):
    # sweep F4: a bare ValueError from the score table, naming neither HardSampleReplay nor a way out
    path = _checkpoint(tmp_path, [HardSampleReplay()], step=15, epochs=2)
    with pytest.raises(PulseRefusal) as refused:
        _fit([HardSampleReplay(mode=mode)], ckpt_path=path, rows=800, epochs=2)
    message = str(refused.value)
    assert message.startswith("HardSampleReplay: the checkpoint's sample scores cover 1295 training samples")
    assert "holds 800" in message and "Resume on the data the checkpoint was saved with" in message
    assert "load_from_checkpoint" in message and "mode='batch' keeps the same per-sample scores" in message
