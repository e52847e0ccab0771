"""StabilityGuard when the module replaces a submodule mid-run (``self.head = nn.Linear(...)`` and a new
optimizer of the same class over the new parameters, the same shapes and group layout).

The guard compared the optimizers' classes, their groups' sizes and the model's keys and shapes: all the
same after such a swap, so a rollback returned to a snapshot taken before it and loaded the old head's
trained weights (and momentum) into the new head, undoing the module's own change for the rest of the run,
with nothing said. The parameters the optimizers hold are now compared by identity too: the swap makes a
snapshot due at the first healthy step after it and older snapshots no longer fit, as after an optimizer
swapped for another class (``tests/test_stability_guard_optimizer_swap.py``).
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pulse import StabilityGuard, StabilityGuardError
from tests.conftest import trainer_kwargs

SWAP_STEP = 22


class _SwapsItsHead(pl.LightningModule):
    """A small classifier that puts in a fresh head at ``SWAP_STEP`` (a new task's head) and re-creates its
    optimizer; its batches are corrupted (inputs x1e3, labels shifted) at ``spike_steps``."""

    def __init__(self, spike_steps: tuple[int, ...]) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU())
        self.head = nn.Linear(32, 4)
        self.spike_steps = set(spike_steps)
        self.heads: dict[str, torch.Tensor] = {}  # a dict of tensors: not in the snapshots' state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.global_step in self.spike_steps:
            x, y = x * 1e3, (y + 1) % 4
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def on_train_batch_start(self, batch, batch_idx):
        if self.global_step == SWAP_STEP and "old" not in self.heads:
            self.heads["old"] = self.head.weight.detach().clone()
            self.head = nn.Linear(32, 4)
            self.heads["fresh"] = self.head.weight.detach().clone()
            self.trainer.strategy.setup_optimizers(self.trainer)

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(128, 16, generator=generator)
        return DataLoader(
            TensorDataset(x, x[:, :4].argmax(1)), batch_size=16, shuffle=True, generator=generator
        )


class _HeadAfterRollback(Callback):
    """The head's weight at the first batch after the guard's first rollback."""

    def __init__(self, guard: StabilityGuard) -> None:
        self.guard, self.head = guard, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.head is None and self.guard.rollbacks:
            self.head = pl_module.head.weight.detach().clone()


def _fit(tmp_path, spike_steps: tuple[int, ...]):
    pl.seed_everything(0)
    model = _SwapsItsHead(spike_steps)
    guard = StabilityGuard(warmup=8, window=20, snapshot_every=4, rollback_margin=2, skip_after_rollback=2)
    probe = _HeadAfterRollback(guard)
    trainer = pl.Trainer(
        max_steps=40, callbacks=[guard, probe], default_root_dir=tmp_path, **trainer_kwargs()
    )
    return trainer, model, guard, probe


def test_a_rollback_after_the_module_replaced_its_head_keeps_the_new_head(tmp_path):
    """Corrupted batches at steps 25-27, three steps after the swap at 22: the rollback went back to the
    step-20 snapshot and loaded the old head's weights into the new head (bit for bit). The first healthy
    step after the swap is snapshotted now, and the rollback returns there: the head is the new one."""
    trainer, model, guard, probe = _fit(tmp_path, spike_steps=(25, 26, 27))
    trainer.fit(model)
    rollbacks = [event for event in guard.events if event["event"] == "rollback"]
    assert len(rollbacks) == 1 and rollbacks[0]["to_step"] > SWAP_STEP
    assert not torch.equal(probe.head, model.heads["old"])
    # the new head after two healthy steps from its fresh values, far from the old head's trained weights
    assert (probe.head - model.heads["fresh"]).abs().max() < 0.05
    assert (probe.head - model.heads["old"]).abs().max() > 0.2
    assert not guard.stopped and trainer.global_step == 40


def test_a_replaced_head_with_no_healthy_step_after_it_stops_instead_of_loading_the_old_head(tmp_path):
    """Corrupted batches from the swap's own step on (22-24): no healthy step after the swap, so every
    snapshot held is of the old head. The rollback used to load it into the new head and train on; now the
    run stops with a checkpoint of the current state, nothing loaded, and the message names the replaced
    parameters."""
    trainer, model, guard, probe = _fit(tmp_path, spike_steps=(22, 23, 24))
    with pytest.raises(StabilityGuardError, match=r"no snapshot fits its optimizers.*parameters replaced"):
        trainer.fit(model)
    assert guard.rollbacks == 0 and probe.head is None
    assert not torch.equal(model.head.weight.detach(), model.heads["old"])
