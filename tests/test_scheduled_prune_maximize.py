"""ScheduledPrune's distillation under an optimizer that maximizes the returned value (torch's
``maximize=True``; the module returns the reward ``-cross_entropy``). The distillation term is added to the
logits' gradient from outside the module's loss, and such an optimizer negates every gradient, that one too:
the student was pushed away from its pre-event teacher (a digits MLP: the KL to the teacher over the third
event's window 25650 against its minimising twin's 0.064, training cross-entropy 9.6 against 0.80). The term is now added
negated where every parameter group maximizes, and mixed groups are refused at train start. Pruning itself
(magnitudes), PulseCycle, GradientCache and the probes read no direction: the other tests here check that a
maximizing twin trains bit for bit as its minimising one next to all of them.
"""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pulse import GradientCache, HardSampleReplay, PulseCycle, ScheduledPrune
from lightning_pulse.core.distillation import DistillConfig
from lightning_pulse.errors import PulseRefusal
from tests.conftest import trainer_kwargs


def _digits(first: int, last: int) -> TensorDataset:
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data[first:last] / 16, dtype=torch.float32)
    return TensorDataset(x, torch.tensor(digits.target[first:last]))


class _Objective(pl.LightningModule):
    """A digits MLP minimising the cross-entropy, or maximizing its negation: the same training bit for bit.
    ``mixed``: the first layer ascends the loss the rest descends."""

    def __init__(self, maximize: bool, mixed: bool = False) -> None:
        super().__init__()
        self.maximize, self.mixed = maximize, mixed
        torch.manual_seed(0)  # twins start from the same weights
        self.net = nn.Sequential(
            nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 32), nn.ReLU(), nn.Linear(32, 10)
        )  # fmt: skip

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        loss = F.cross_entropy(self(batch[0]), batch[1])
        return -loss if self.maximize else loss

    def validation_step(self, batch, batch_idx):
        self.log("val_ce", F.cross_entropy(self(batch[0]), batch[1]))

    def configure_optimizers(self):
        if self.mixed:
            groups = [{"params": self.net[0].parameters(), "maximize": True}]
            groups.append({"params": [*self.net[2].parameters(), *self.net[4].parameters()]})
            return torch.optim.SGD(groups, lr=0.1, momentum=0.9)
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9, maximize=self.maximize)


def _fit(module: _Objective, callbacks: list, saved_to=None, ckpt_path=None) -> pl.Trainer:
    """Four epochs of 12 batches (in order where a run resumes: Lightning restarts an epoch's loader)."""
    pl.seed_everything(0, verbose=False)
    kwargs = trainer_kwargs(enable_checkpointing=saved_to is not None)
    if saved_to is not None:
        callbacks = [*callbacks, ModelCheckpoint(saved_to, "{step}", every_n_train_steps=12, save_top_k=-1)]
    trainer = pl.Trainer(max_epochs=4, callbacks=callbacks, **kwargs)
    shuffle = saved_to is None and ckpt_path is None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(
            module,
            DataLoader(_digits(0, 384), batch_size=32, shuffle=shuffle),
            DataLoader(_digits(384, 448), batch_size=32),
            ckpt_path=ckpt_path,
        )
    return trainer


def _pruned(distill: DistillConfig | None = None) -> list:
    cycle = PulseCycle(burst=6, replay=0, maintain=6, order=["burst", "maintain"])
    return [cycle, ScheduledPrune(final_sparsity=0.6, start=0, end=0.8, distill=distill)]


def _weights(trainer: pl.Trainer) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in trainer.lightning_module.parameters()])


def test_distillation_under_a_maximized_reward_pulls_the_student_toward_its_teacher_as_its_twin_does():
    descended = _fit(_Objective(False), _pruned(DistillConfig(weight=4.0)))
    ascended = _fit(_Objective(True), _pruned(DistillConfig(weight=4.0)))
    twin, events = descended.callbacks[1].events, ascended.callbacks[1].events
    assert [e["step"] for e in events] == [11, 23, 35] and all(e["distill_calls"] > 0 for e in events[:2])
    # the KL to the teacher over each window, as the twin's (it was 0.0008, 0.12, 25650 against 0.0005,
    # 0.013, 0.064: the student ascended it), and the same weights
    assert [e.get("distill_loss") for e in events] == [e.get("distill_loss") for e in twin]
    assert events[-1]["distill_loss"] < 0.1
    assert torch.equal(_weights(ascended), _weights(descended))


def test_a_resume_inside_a_maximized_runs_distillation_window_pulls_toward_the_teacher_as_the_run_did(
    tmp_path,
):
    # the window reopened at a resume reads the direction first: it adds the term negated as the run did
    full = _fit(_Objective(True), _pruned(DistillConfig(weight=4.0)), saved_to=tmp_path)
    saved = torch.load(tmp_path / "step=24.ckpt", weights_only=True)["callbacks"]["ScheduledPrune"]
    assert saved["teacher"] is not None  # inside the window of the event of step 23
    resumed = _fit(_Objective(True), _pruned(DistillConfig(weight=4.0)), ckpt_path=tmp_path / "step=24.ckpt")
    events = resumed.callbacks[1].events
    assert [e.get("distill_loss") for e in events] == [
        e.get("distill_loss") for e in full.callbacks[1].events
    ]
    assert events[-1]["distill_loss"] < 0.1 and torch.equal(_weights(resumed), _weights(full))


def test_distillation_next_to_parameter_groups_that_mix_maximize_is_refused_at_train_start():
    with pytest.raises(PulseRefusal) as refused:
        _fit(_Objective(False, mixed=True), _pruned(DistillConfig()))
    said = str(refused.value)
    assert said.startswith(
        "ScheduledPrune's distillation (`distill`) cannot tell which way this run's loss should go: parameter "
        "group 0 ascend it (`maximize=True`) and group 1 descend it, so the term it adds to the logits' "
        "gradient would pull the groups that descend the loss toward the model before the event"
    )
    assert "gradient reversal layer" in said and "or leave `distill` out" in said
    # without distillation nothing reads the direction: the same groups prune
    trainer = _fit(_Objective(False, mixed=True), _pruned())
    assert len(trainer.callbacks[1].events) == 3


def test_a_maximized_twin_trains_bit_for_bit_next_to_the_callbacks_that_read_no_direction():
    # PulseCycle's probe, GradientCache's freezing (plasticity of the weights), magnitude pruning and
    # HardSampleReplay's one captured call: nothing there depends on which way the optimizer moves the loss
    def callbacks():
        cache = GradientCache(threshold=1.0, check_every=4, freeze_for=8, max_frozen_share=0.9)
        return [*_pruned(DistillConfig()), cache, HardSampleReplay(phases=("maintain",))]

    descended, ascended = _fit(_Objective(False), callbacks()), _fit(_Objective(True), callbacks())
    assert torch.equal(_weights(ascended), _weights(descended))
    cache, twin_cache = ascended.callbacks[2], descended.callbacks[2]
    assert cache.events and cache.events == twin_cache.events  # it froze, at the same steps
    assert ascended.callbacks[0].last_probe == descended.callbacks[0].last_probe
    replay, twin_replay = ascended.callbacks[3], descended.callbacks[3]
    assert replay.metrics() == twin_replay.metrics()
