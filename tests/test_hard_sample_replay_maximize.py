"""HardSampleReplay with an optimizer that maximizes the returned value (torch's ``maximize=True``): the module
returns a reward (``-cross_entropy``) and the optimizer ascends it. One captured loss call was scored by its own
value, right in either direction; but several captured terms are scored by each sample's part in the returned
value, which under ``maximize=True`` is a reward: the highest scores were the easiest samples, and those were
replayed (a digits classifier with an auxiliary head: 15-18% of the maximizing run's replayed samples were the
ones its minimising twin replayed, where a choice at random shares 50%). A loss that pushes up only its easiest samples was refused as a policy gradient,
its coefficients read with the wrong sign. The capture now reads the parts and coefficients of ``-loss``, the
value the optimizer descends, and parameter groups that mix both directions are refused at train start.
"""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pulse import HardSampleReplay, PulseCycle
from lightning_pulse.core.per_sample_loss import OutputKeyScorer
from lightning_pulse.errors import PulseRefusal
from tests.conftest import trainer_kwargs


def _digits() -> TensorDataset:
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data[:384] / 16, dtype=torch.float32)
    return TensorDataset(x, torch.tensor(digits.target[:384]))


class _Objective(pl.LightningModule):
    """A digits classifier whose objective is minimised, or negated (a reward) and maximized: the same
    training bit for bit (SGD negates a maximized parameter's gradient, and -(-x) is x).

    ``loss``: ``"one_term"`` (the cross-entropy), ``"aux_head"`` (plus 0.3 times an auxiliary head's, as
    GoogLeNet's), ``"flood"`` (per-sample flooding ``|ce - b|``, which pushes up the samples below ``b``: the
    easiest), ``"reinforce"`` (a policy gradient's ``ce * advantage``), ``"scored"`` (the cross-entropy, with
    each sample's term returned under ``per_sample_loss``)."""

    def __init__(self, maximize: bool, loss: str = "aux_head", mixed: bool = False) -> None:
        super().__init__()
        self.maximize, self.loss, self.mixed = maximize, loss, mixed
        torch.manual_seed(0)  # twins start from the same weights
        self.body, self.head, self.aux = nn.Linear(64, 32), nn.Linear(32, 10), nn.Linear(32, 10)

    def training_step(self, batch, batch_idx):
        x, y = batch
        features = torch.relu(self.body(x))
        logits = self.head(features)
        output = {}
        if self.loss == "one_term":
            loss = F.cross_entropy(logits, y)
        elif self.loss == "aux_head":
            loss = F.cross_entropy(logits, y) + 0.3 * F.cross_entropy(self.aux(features), y)
        elif self.loss == "flood":
            loss = (F.cross_entropy(logits, y, reduction="none") - 2.3).abs().mean()
        elif self.loss == "reinforce":
            ce = F.cross_entropy(logits, y, reduction="none")
            reward = (logits.argmax(1) == y).float() + torch.linspace(0, 1, len(y))
            loss = (ce * (reward - reward.mean()) / reward.std()).mean()
        else:
            ce = F.cross_entropy(logits, y, reduction="none")
            loss, output["per_sample_loss"] = ce.mean(), ce.detach()  # a loss, whichever way it goes
        loss = -loss if self.maximize else loss
        return {"loss": loss, **output} if output else loss

    def configure_optimizers(self):
        if self.mixed:  # an adversarial part ascends the loss the rest descends
            groups = [{"params": self.body.parameters(), "maximize": True}]
            groups.append({"params": [*self.head.parameters(), *self.aux.parameters()], "maximize": False})
            return torch.optim.SGD(groups, lr=0.1)
        return torch.optim.SGD(self.parameters(), lr=0.1, maximize=self.maximize)


class _Chosen(pl.Callback):
    """The samples each light step selected (listed after HardSampleReplay: read at its batch start)."""

    def __init__(self, replay: HardSampleReplay) -> None:
        self.replay, self.steps = replay, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        indices, origins = self.replay.trained_indices, self.replay.trained_origins
        if indices is not None and self.replay.offered_count > len(indices):
            self.steps.append(sorted(indices[np.array(origins) == "selected"].tolist()))


def _fit(module: _Objective, setting: str = "steps_pulse", **replay_kwargs):
    pl.seed_everything(0, verbose=False)
    if setting == "batch_infobatch":
        replay_kwargs = {"rule": "infobatch", **replay_kwargs}
    replay = HardSampleReplay(score_half_life=None, **replay_kwargs)
    chosen = _Chosen(replay)
    cycle = [PulseCycle(burst=12, replay=12, maintain=2)] if setting == "steps_pulse" else []
    trainer = pl.Trainer(max_epochs=4, callbacks=[*cycle, replay, chosen], **trainer_kwargs())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, DataLoader(_digits(), batch_size=32, shuffle=True))
    weights = torch.cat([p.detach().flatten() for p in module.parameters()])
    return trainer, replay, chosen.steps, weights


@pytest.mark.parametrize(
    "loss, setting",
    [
        ("aux_head", "steps_pulse"),
        ("aux_head", "steps_alone"),
        ("aux_head", "batch_infobatch"),
        ("one_term", "steps_pulse"),
    ],
)
def test_a_maximized_reward_replays_the_samples_its_minimized_twin_replays(loss, setting):
    _, descended, chosen_descended, weights_descended = _fit(_Objective(False, loss), setting)
    _, ascended, chosen_ascended, weights_ascended = _fit(_Objective(True, loss), setting)
    assert len(chosen_ascended) >= 8 and sum(map(len, chosen_ascended)) > 100  # light steps selected
    # the same scores (the descended value's parts: positive, the highest the hardest), so the same samples
    # replayed, the same weights; before, the aux-head reward's scores were those negated, and 15-18% of the
    # selected samples were the twin's (InfoBatch's: 71%)
    scores = ascended.table.scores
    assert np.nanmin(scores) > 0 and np.array_equal(scores, descended.table.scores, equal_nan=True)
    assert chosen_ascended == chosen_descended
    assert torch.equal(weights_ascended, weights_descended)


def test_a_maximized_loss_that_pushes_up_only_its_easiest_samples_is_not_refused():
    # -|ce - b| ascended pushes up the samples below b, as |ce - b| descended does; the coefficients read
    # with the loss's own sign made its hardest samples look pushed up (a policy gradient): refused at step 0
    trainer, replay, _, weights = _fit(_Objective(True, "flood"))
    _, twin, _, twin_weights = _fit(_Objective(False, "flood"))
    assert trainer.global_step == 36 and replay.table.seen == 384
    assert np.array_equal(replay.table.scores, twin.table.scores, equal_nan=True)
    assert torch.equal(weights, twin_weights)


def test_a_maximized_policy_gradient_is_still_refused_naming_the_negated_coefficients():
    with pytest.raises(PulseRefusal) as refused:
        _fit(_Objective(True, "reinforce"))
    said = str(refused.value)
    assert said.startswith("HardSampleReplay cannot score the samples of step 0's loss: its captured ")
    assert "cross_entropy(reduction='none') (d(-loss) / d its elements from " in said
    assert "an element it pushes up has a loss of" in said and "scorer=" in said


def test_parameter_groups_that_mix_maximize_are_refused_at_train_start_naming_the_ways_out():
    module = _Objective(False, mixed=True)
    before = [p.detach().clone() for p in module.parameters()]
    with pytest.raises(PulseRefusal) as refused:
        _fit(module)
    said = str(refused.value)
    assert said.startswith(
        "HardSampleReplay cannot tell which way this run's loss should go: parameter group 0 ascend it "
        "(`maximize=True`) and group 1 descend it, so a sample's loss says no one thing about how hard it is"
    )
    for way_out in ("gradient reversal layer", "scorer=", "rule='random'", "remove HardSampleReplay"):
        assert way_out in said
    assert all(torch.equal(p, q) for p, q in zip(module.parameters(), before))  # before the first step


def test_a_scorer_or_the_random_rule_trains_next_to_mixed_maximize_groups():
    # no score from the captured loss: nothing depends on the direction. A scorer's values are read as given
    trainer, replay, chosen, _ = _fit(_Objective(False, "scored", mixed=True), scorer=OutputKeyScorer())
    assert trainer.global_step == 36 and len(chosen) == 12
    trainer, replay, _, _ = _fit(_Objective(False, mixed=True), rule="random")
    assert trainer.global_step == 36 and replay.metrics()["replay_fraction"] < 1.0


def test_a_scorers_values_are_read_as_given_under_maximize():
    # the module returns each sample's negated reward as its loss: the scores are those values, not negated
    # again, and the twin that returns its losses to descend scores the same
    _, ascended, chosen, _ = _fit(_Objective(True, "scored"), scorer=OutputKeyScorer())
    _, descended, twin_chosen, _ = _fit(_Objective(False, "scored"), scorer=OutputKeyScorer())
    assert np.nanmin(ascended.table.scores) > 0
    assert np.array_equal(ascended.table.scores, descended.table.scores, equal_nan=True)
    assert chosen == twin_chosen
