"""StabilityGuard with an optimizer that maximizes the loss (torch's ``maximize=True``; held-out sweep s42,
optim finding 1): the module returns a reward (``-cross_entropy``) and the optimizer ascends it. The guard
judged the returned value as a loss to minimise, so a diverging ``Adam(lr=1.0, maximize=True)`` run, whose
reward fell from -1.5 to -63, was never flagged (the log scale cannot read a value <= 0; on a linear scale a
fall is no upward spike) and its end line called the fit clean, while the same run minimising the
cross-entropy was flagged at step 1. The guard now judges ``-loss`` where every parameter group maximizes,
says so in its lines, and refuses groups that mix the two directions.
"""

from __future__ import annotations

import logging
import re
import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pulse import StabilityGuard, StabilityGuardError
from lightning_pulse.core.stability_policy import StabilityGuardConfig
from lightning_pulse.errors import PulseRefusal
from tests.conftest import trainer_kwargs

POISONED = (4, 9, 12)  # batch indices whose inputs are scaled x300: a spike at any weights (the data's)
BATCHES = 16  # batches an epoch


class Objective(pl.LightningModule):
    """Cross-entropy minimised, or its negation (a reward) maximized: the same training bit for bit (Adam
    negates the gradient of a maximized loss, and -(-x) is x)."""

    def __init__(self, maximize: bool, lr: float = 0.01, reward: str = "negated") -> None:
        super().__init__()
        self.maximize, self.lr, self.reward = maximize, lr, reward
        torch.manual_seed(0)  # twins start from the same weights
        self.net = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 4))

    def training_step(self, batch, batch_idx):
        logits = self.net(batch[0])
        if self.reward == "probability":  # a reward > 0: the probability of the right class, ascended
            return logits.softmax(-1).gather(1, batch[1][:, None]).mean()
        ce = nn.functional.cross_entropy(logits, batch[1])
        return -ce if self.maximize else ce

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.lr, maximize=self.maximize)


def _loader(poisoned=POISONED) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(BATCHES * 16, 20, generator=g)
    y = (x @ torch.randn(20, 4, generator=g)).argmax(1)
    for batch in poisoned:
        x[16 * batch : 16 * batch + 16] *= 300
    return DataLoader(TensorDataset(x, y), batch_size=16)


def _guard(**overrides) -> StabilityGuard:
    arguments = dict(
        warmup=5, window=20, snapshot_every=5, rollback_margin=2, max_snapshots=3, rollback_after=2,
        skip_after_rollback=2,
    )  # fmt: skip
    return StabilityGuard(**{**arguments, **overrides})


def _fit(tmp_path, module, guard, max_steps, ckpt_path=None, poisoned=POISONED, saved_every=None):
    torch.manual_seed(0)
    callbacks, root = [guard], str(tmp_path)
    if saved_every is not None:
        callbacks.append(ModelCheckpoint(root, "{step}", every_n_train_steps=saved_every, save_top_k=-1))
    kwargs = trainer_kwargs(default_root_dir=root, enable_checkpointing=saved_every is not None)
    trainer = pl.Trainer(max_steps=max_steps, callbacks=callbacks, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, _loader(poisoned), ckpt_path=ckpt_path)
    return trainer


def _lines(caplog) -> list[str]:
    return [record.getMessage() for record in caplog.records if "StabilityGuard" in record.getMessage()]


def test_a_maximized_reward_is_judged_as_its_minimized_twin_and_its_lines_name_minus_loss(tmp_path, caplog):
    """Batches 4, 9 and 12 of each epoch spike at any weights: the minimising fit flags all 7 of them in 40
    steps, 3 found recurring by the rollback test (losses at a snapshot, negated too: else the maximizing fit
    rolled back 3 times instead). The maximizing twin now matches it step for step: the same events,
    baselines and final weights; before, it flagged nothing."""
    twins = {}
    for maximize in (False, True):
        caplog.clear()
        module, guard = Objective(maximize), _guard()
        with caplog.at_level(logging.INFO):
            _fit(tmp_path / str(maximize), module, guard, max_steps=40)
        twins[maximize] = module, guard, _lines(caplog)
    (minimized, low, low_lines), (maximized, high, high_lines) = twins[False], twins[True]
    flagged = [event["step"] for event in low.events]
    assert flagged == [4, 9, 12, 20, 25, 28, 36]
    assert sum(event.get("cause") == "recurring" for event in low.events) == 3 and low.rollbacks == 0
    assert high.events == low.events
    assert high.detector.state_dict() == low.detector.state_dict()  # the windows hold CE, not -CE
    assert all(torch.equal(a, b) for a, b in zip(minimized.parameters(), maximized.parameters()))
    # the minimising lines are as before; the maximizing ones give the same numbers as -loss, and say why
    assert low_lines[0] == (
        "StabilityGuard: step 4 flagged as loss_spike (loss=26.99, grad_norm=235.3; burst medians "
        "loss=1.432, grad_norm=0.8301); action: skip."
    )
    assert high_lines[0] == (
        "StabilityGuard: step 4 flagged as loss_spike (-loss=26.99, grad_norm=235.3; burst medians "
        "-loss=1.432, grad_norm=0.8301; -loss: the loss negated, since the optimizer runs with "
        "`maximize=True`); action: skip."
    )
    assert len(high_lines) == len(low_lines) == 8
    assert high_lines[-1] == low_lines[-1] + (
        " The guard judged -loss (the loss negated, since the optimizer runs with `maximize=True`): a "
        "sudden drop of the loss was a spike."
    )


@pytest.mark.parametrize("maximize", [False, True])
def test_a_diverging_reward_ascent_is_rolled_back_and_stopped_as_the_minimized_run(tmp_path, maximize):
    """The sweep's repro: Adam at lr=1.0 takes the cross-entropy from 1.5 to 63 at step 1. Minimising, the
    guard flags it at once; ascending -CE it called the fit clean. Now both stop after the second rollback,
    and the maximizing stop message ends saying that it judged -loss."""
    guard = _guard(rollback_after=3, skip_after_rollback=1, max_rollbacks=1, warmup=50, window=100)
    with pytest.raises(StabilityGuardError) as stop:
        _fit(tmp_path, Objective(maximize, lr=1.0), guard, max_steps=40, poisoned=())
    assert [(event["step"], event["event"]) for event in guard.events[:4]] == [
        (1, "loss_spike"), (2, "loss_spike"), (3, "loss_spike"), (3, "rollback"),
    ]  # fmt: skip
    assert guard.stopped and guard.rollbacks == 1
    said = str(stop.value)
    ending = "The guard judged -loss (the loss negated, since the optimizer runs with `maximize=True`)"
    assert said.startswith("StabilityGuard stopped training at step")
    assert (ending in said) is maximize


def test_parameter_groups_that_mix_maximize_are_refused_at_train_start(tmp_path):
    """One group ascends the loss, the other descends it: a spike of it has no one direction, so the guard
    refuses the fit before its first step, naming itself, the groups and the way out."""

    class MixedGroups(Objective):
        def configure_optimizers(self):
            first, second = self.net[0].parameters(), self.net[2].parameters()
            return torch.optim.Adam([{"params": first}, {"params": second, "maximize": True}], lr=0.01)

    module = MixedGroups(maximize=False)
    with pytest.raises(PulseRefusal) as refused:
        trainer = _fit(tmp_path, module, _guard(), max_steps=5)
    said = str(refused.value)
    assert said.startswith(
        "StabilityGuard cannot tell which way this run's loss should go: parameter group 1 "
    )
    assert "ascend it (`maximize=True`) and group 0 descend it" in said
    assert "Give every parameter group the same `maximize`" in said
    assert "remove StabilityGuard from the callbacks" in said
    trainer = module.trainer
    assert trainer.global_step == 0


def test_a_resumed_maximizing_fit_judges_as_the_uninterrupted_one(tmp_path):
    """The detector's windows, saved in a checkpoint at the end of epoch 1, hold the judged -loss values: the
    fit resumed from it flags the same steps after the resume (20, 25, 28, 36) and ends with the same
    baselines as the fit that ran through."""
    through = _guard()
    _fit(tmp_path, Objective(True), through, max_steps=40, saved_every=BATCHES)
    resumed = _guard()
    _fit(
        tmp_path / "resumed",
        Objective(True),
        resumed,
        max_steps=40,
        ckpt_path=tmp_path / f"step={BATCHES}.ckpt",
    )
    assert [event["step"] for event in resumed.events] == [4, 9, 12, 20, 25, 28, 36]
    assert resumed.events == through.events
    assert resumed.detector.state_dict() == through.detector.state_dict()
    assert min(resumed.detector.state_dict()["loss"]["burst"]["values"]) > -1  # log CE: about 0.2 to 0.4


def test_a_positive_reward_on_the_log_scale_is_said_unjudged_as_minus_loss_with_the_linear_way_out(
    tmp_path, caplog
):
    """A reward > 0 ascended (the right class's probability) is judged as -loss < 0, which a log scale cannot
    read: the warning and the end line say so as -loss, and point to the linear scale, which judges it."""
    guard = _guard()
    with pytest.warns(UserWarning) as warned, caplog.at_level(logging.INFO):
        torch.manual_seed(0)
        trainer = pl.Trainer(max_steps=6, callbacks=[guard], **trainer_kwargs(default_root_dir=str(tmp_path)))
        trainer.fit(Objective(True, reward="probability"), _loader(()))
    said = [str(w.message) for w in warned if "StabilityGuard" in str(w.message)]
    assert len(said) == 1 and re.fullmatch(
        r"StabilityGuard: -loss is -0\.\d+ <= 0 \(the loss negated, since the optimizer runs with "
        r"`maximize=True`\), which a log scale cannot judge; spikes of -loss \(drops of the loss\) go "
        r"unnoticed\. Pass `config=StabilityGuardConfig\(loss_scale='linear'\)` for such losses\.",
        said[0],
    ), said
    end = _lines(caplog)[-1]
    assert "but 6 of their -loss values were <= 0, which a log scale cannot judge" in end
    assert end.endswith("a sudden drop of the loss was a spike.")
    linear = _guard(config=StabilityGuardConfig(loss_scale="linear"))
    caplog.clear()
    with caplog.at_level(logging.INFO):
        _fit(tmp_path / "linear", Objective(True, reward="probability"), linear, max_steps=6, poisoned=())
    assert re.search(r"medians of the last 20 at most: -loss -0\.\d+, grad norm", _lines(caplog)[-1])


def test_two_optimizers_each_one_way_read_the_returned_loss_as_it_is_and_frozen_groups_do_not_count():
    # a review: a GAN's players (one descending a cross-entropy, one ascending a reward), each an optimizer of
    # its own under manual optimization, were refused as "mixed"; so was a frozen group's flag
    from lightning_pulse.core.loss_direction import maximizes_loss

    first, second = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    players = [
        torch.optim.SGD(first.parameters(), lr=0.1),
        torch.optim.SGD(second.parameters(), lr=0.1, maximize=True),
    ]
    assert maximizes_loss(players) is False
    frozen = torch.nn.Linear(2, 2).requires_grad_(False)
    groups = [{"params": frozen.parameters(), "maximize": True}, {"params": first.parameters()}]
    assert maximizes_loss([torch.optim.SGD(groups, lr=0.1)]) is False
    with pytest.raises(PulseRefusal, match="ascend it"):
        mixed = [{"params": second.parameters(), "maximize": True}, {"params": first.parameters()}]
        maximizes_loss([torch.optim.SGD(mixed, lr=0.1)])


def test_a_checkpoint_whose_loss_windows_hold_the_other_sign_is_resumed_with_them_dropped():
    # a review: a maximizing run's checkpoint from before the guard read `maximize` held the raw rewards
    # (~ -1.1); judged negated (+1.1) against them on a linear scale every resumed step was a spike, 3 rollbacks
    # and a stop followed. The state now says its sign, and an old or turned one drops the loss windows.
    from lightning_pulse import StabilityGuard, StabilityGuardConfig

    def core():
        return StabilityGuard(config=StabilityGuardConfig(loss_scale="linear")).core

    saved = core()
    for step in range(60):
        saved.detector.accept(-1.1 - 0.01 * (step % 3), 0.5, saved.detector.main_key)
    state = saved.state_dict()
    assert state["maximized"] is False
    del state["maximized"]  # as saved before the direction was read
    resumed = core()
    resumed.load_state_dict(state)
    parameter = torch.nn.Parameter(torch.zeros(2))
    with pytest.warns(UserWarning, match="loss baselines hold the loss as returned.*were dropped"):
        resumed.start(0, [torch.optim.SGD([parameter], lr=0.1, maximize=True)])
    assert resumed.maximized and resumed.detector.baseline(resumed.detector.main_key)["loss"] is None
    assert resumed.detector.baseline(resumed.detector.main_key)["grad_norm"] is not None  # kept
    same = core()
    same.load_state_dict(saved.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        same.start(0, [torch.optim.SGD([parameter], lr=0.1)])  # the same sign: kept, nothing said
    assert same.detector.baseline(same.detector.main_key)["loss"] is not None
