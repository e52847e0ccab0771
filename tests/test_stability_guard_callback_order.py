"""StabilityGuard anywhere in the callback list: a snapshot holds every callback's state at its step's end.

A tiny MLP on sklearn's digits (1,400 samples, unshuffled batches of 64), PulseCycle(6/4/2) and, in the first
test, HardSampleReplay. Listed before a ``RollbackAware`` callback (PulseCycle, HardSampleReplay), the guard
used to snapshot in its own batch end, before that callback closed the step: HardSampleReplay's state in every
snapshot lacked the step's measured batch (a rollback returned it a step behind the weights), and the
maintain-entry snapshot, asked for by PulseCycle's batch end after the guard's, came a step late (and every
periodic one after it). Now each order gives the same snapshot steps, and the same rollback.
"""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pulse import HardSampleReplay, PulseCycle, StabilityGuard
from tests.conftest import trainer_kwargs


@pytest.fixture(scope="module")
def digits():
    data = load_digits()
    x, y = torch.tensor(data.data, dtype=torch.float32) / 16, torch.tensor(data.target)
    return TensorDataset(x[:1400], y[:1400])


class Net(pl.LightningModule):
    def __init__(self, nan_at: int | None) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
        self.nan_at, self.fired = nan_at, False

    def training_step(self, batch, batch_idx):
        loss = F.cross_entropy(self.net(batch[0]), batch[1])
        if self.global_step == self.nan_at and not self.fired:
            self.fired = True
            loss = loss * float("nan")
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class Spy(Callback):
    """Listed last: the replay state once every batch end of a step ran, and the snapshot steps held at each
    step's start."""

    def __init__(self, guard: StabilityGuard, replay: HardSampleReplay | None) -> None:
        self.guard, self.replay = guard, replay
        self.at_end: dict[int, dict] = {}
        self.rings: list[tuple[int, list[int]]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.rings.append((trainer.global_step, [s.step for s in self.guard.snapshots._snapshots]))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.replay is not None:
            self.at_end[trainer.global_step] = copy.deepcopy(self.replay.rollback_state_dict())


def same(a, b) -> bool:
    """Equal, NaN equal to NaN (an unscored sample)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and torch.equal(a.double().nan_to_num(-7.0), b.double().nan_to_num(-7.0))
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True
    return a == b


def fit(digits, order: str, nan_at: int | None, mode: str | None = None, max_steps: int = 48):
    pl.seed_everything(0)
    made = {
        "pulse": PulseCycle(burst=6, replay=4, maintain=2, warmup=0, anneal=0, probe_batches=1),
        "hsr": HardSampleReplay(mode=mode) if mode else None,
        "guard": StabilityGuard(
            warmup=5, window=20, snapshot_every=8, max_snapshots=3, rollback_margin=2, skip_after_rollback=3,
            rollback_after=1,
        ),
    }  # fmt: skip
    spy = Spy(made["guard"], made["hsr"])
    model = Net(nan_at)
    callbacks = [made[name] for name in order.split(",") if made[name] is not None] + [spy]
    trainer = pl.Trainer(callbacks=callbacks, max_steps=max_steps, **trainer_kwargs(limit_val_batches=0))
    trainer.fit(model, DataLoader(digits, batch_size=64))
    return model, made, spy


@pytest.mark.parametrize("mode, nan_at", [("steps", 15), ("batch", 18)])
def test_snapshots_hold_every_rollback_aware_state_at_the_end_of_their_step(digits, mode, nan_at):
    runs = {order: fit(digits, order, nan_at, mode) for order in ("pulse,hsr,guard", "guard,pulse,hsr")}
    for order, (_, made, spy) in runs.items():
        held = [s for s in made["guard"].snapshots._snapshots if s.step in spy.at_end]
        assert len(held) == 3, order
        for snapshot in held:  # the replay state the snapshot returns to: the one its step ended with
            state = next(v for k, v in snapshot.callbacks.items() if "HardSampleReplay" in k)
            assert same(state, spy.at_end[snapshot.step]), (order, snapshot.step)
    (model_a, made_a, spy_a), (model_b, made_b, spy_b) = runs.values()
    assert made_a["guard"].rollbacks >= 1
    assert spy_a.rings == spy_b.rings
    assert made_a["guard"].metrics() == made_b["guard"].metrics()
    assert same(made_a["hsr"].state_dict(), made_b["hsr"].state_dict())
    for p, q in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(p, q)


def test_maintain_entry_snapshot_is_taken_at_its_step_in_either_order(digits):
    # maintain phases start at steps 10 and 22: snapshots at 0, 8, 10 (maintain), 18, 22 (maintain)
    rings = {
        order: fit(digits, order, None, max_steps=24)[2].rings for order in ("pulse,guard", "guard,pulse")
    }
    first, second = rings.values()
    assert dict(first)[11] == [0, 8, 10] and dict(first)[23] == [10, 18, 22]
    assert first == second


def test_a_snapshot_after_every_batch_end_puts_nothing_on_the_module_a_distillation_teacher_copies(
    digits, tmp_path
):
    # a review: the deferred snapshot was a wrapper on the module instance; ScheduledPrune's distillation
    # teacher, deep-copied at a maintain entry that was also a prune step, kept it and could not be pickled
    from lightning_pulse import ScheduledPrune
    from lightning_pulse.core.distillation import DistillConfig

    pl.seed_everything(0)
    guard = StabilityGuard(warmup=5, window=20, snapshot_every=4, max_snapshots=3, rollback_margin=1)
    cycle = PulseCycle(burst=6, replay=4, maintain=2, warmup=0, anneal=0, maintain_eval="none")
    prune = ScheduledPrune(
        final_sparsity=0.5, start=1, end=30, probe_batches=0, distill=DistillConfig(steps=2)
    )
    model = Net(None)
    trainer = pl.Trainer(callbacks=[guard, cycle, prune], max_steps=24, **trainer_kwargs(limit_val_batches=0))
    trainer.fit(model, DataLoader(digits, batch_size=64))
    assert [event["step"] for event in prune.events] == [10, 22]
    assert "on_train_batch_end" not in vars(model)
    assert [type(c) for c in trainer.callbacks if type(c).__module__.startswith("lightning_pulse._")] == []
    trainer.save_checkpoint(tmp_path / "after.ckpt")  # the module and everything it holds pickle
