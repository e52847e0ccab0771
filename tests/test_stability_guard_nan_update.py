"""StabilityGuard's stop after an optimizer update that makes the weights NaN from finite gradients (held-out
sweep "spikes", problem 4): a digits MLP with ``Adam(eps=0.0)`` (pixels 0 in every image give their weights a
gradient of 0, and the first update is 0 / (sqrt(0) + 0)) was rolled back to step 0 three times and stopped,
rightly, but the message said the spikes came from the model and advised a lower learning rate, which still
divides 0 by 0. It now names the optimizer's update and its ``eps``."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pulse import StabilityGuard, StabilityGuardError
from lightning_pulse.core.spike_detection import Verdict
from lightning_pulse.core.stability_policy import Action, EscalationPolicy
from lightning_pulse.core.stability_steps import nan_update_facts, stop_message, updated_to_nan
from tests.conftest import trainer_kwargs


class _Digits(pl.LightningModule):
    def __init__(self, eps: float) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
        self.eps = eps

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3, eps=self.eps)


def test_a_stop_after_adam_with_eps_0_names_the_update_and_eps_not_a_lower_learning_rate(tmp_path):
    x, y = load_digits(return_X_y=True)
    data = TensorDataset(torch.tensor(x, dtype=torch.float32) / 16, torch.tensor(y))
    pl.seed_everything(0)
    guard = StabilityGuard(skip_after_rollback=5)
    trainer = pl.Trainer(callbacks=[guard], max_steps=60, **trainer_kwargs(default_root_dir=str(tmp_path)))
    with warnings.catch_warnings(), pytest.raises(StabilityGuardError) as stopped:
        warnings.simplefilter("ignore")
        trainer.fit(_Digits(eps=0.0), DataLoader(data, batch_size=32, shuffle=True))
    message = str(stopped.value)
    assert [e["step"] for e in guard.events if e["event"] in ("rollback", "stop")] == [1, 8, 15, 22]
    assert all(e.get("cause") == "state" for e in guard.events if e.get("action") in ("rollback", "stop"))
    assert "net.0.weight" in message and "NaN right after an optimizer update" in message
    assert "`eps`=0" in message and "lower learning rate" not in message  # said before
    assert "came from the model" not in message
    assert stopped.value.checkpoint_path is not None


def _stopping_policy(nan_updates):
    """A policy whose rollbacks and stop each follow a non-finite state; ``nan_updates``: what each booked."""
    policy = EscalationPolicy(rollback_after=1, max_rollbacks=len(nan_updates) - 1)
    for step, names in zip((1, 23, 45), nan_updates):
        action = policy.decide(step, Verdict.NONFINITE_LOSS, "state")
        policy.book_nan_update(step, names)
        (policy.rolled_back if action is Action.ROLLBACK else policy.stop)(step, 0, 1)
    assert policy.stopped
    return policy


def test_the_update_is_named_only_where_every_escalation_found_its_nan():
    named = _stopping_policy([["net.0.weight"], ["net.0.weight", "net.2.weight"], ["net.0.weight"]])
    facts = nan_update_facts(named, ["1", "23", "45"])
    assert facts is not None and facts.startswith(
        "Each rollback and this stop found net.0.weight, net.2.weight NaN"
    )
    message = stop_message(named, 45, 0, 2, "stopped.ckpt")
    assert facts in message and "lower learning rate" not in message
    # one escalation without (a state gone infinite, a forward's buffers): the model's reading, as before
    mixed = _stopping_policy([["net.0.weight"], [], ["net.0.weight"]])
    assert nan_update_facts(mixed, ["1", "23", "45"]) is None
    assert "with a lower learning rate" in stop_message(mixed, 45, 0, 2, "stopped.ckpt")


def test_only_nan_in_what_the_optimizers_update_is_named():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    optimizer = torch.optim.Adam(model[0].parameters(), eps=0.0)
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    assert updated_to_nan(model, [optimizer]) == []
    with torch.no_grad():
        model[0].weight[0, 0] = float("nan")
        model[1].weight[0, 0] = float("nan")  # not the optimizer's: a forward's or the user's write
        model[0].bias[0] = float("inf")  # an overflow, not the update's 0/0
        optimizer.state[model[0].weight]["exp_avg_sq"][0, 1] = float("nan")
    assert updated_to_nan(model, [optimizer]) == ["0.weight", "exp_avg_sq of 0.weight"]
