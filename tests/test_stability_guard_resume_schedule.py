"""StabilityGuard resumed from a checkpoint saved between two periodic snapshots: its snapshot of the state it
resumes at used to restart the periodic count, so the later snapshots came at the resume step plus multiples
of ``snapshot_every`` and a later rollback returned to another step than the uninterrupted run's (a held-out
sweep: step 17 for 15, weights up to 0.037 apart). The count now goes on from the checkpoint's last periodic
snapshot.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pulse import PulseCycle, StabilityGuard
from tests.conftest import trainer_kwargs

NAN_AT, EPOCH_BATCHES, MAX_STEPS = 20, 12, 36


class _Classifier(pl.LightningModule):
    """A plain module whose loss turns NaN at one step (a bad step from outside the guard's reach)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 10))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        return loss * float("nan") if self.trainer.global_step == NAN_AT else loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class _RollbackTargets(Callback):
    """The step whose weights each rollback restored, read against the weights kept after every step."""

    def __init__(self) -> None:
        self.after_step: dict[int, list[torch.Tensor]] = {}
        self.targets: list[list[int]] = []
        self.rollbacks = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        guard = next(c for c in trainer.callbacks if isinstance(c, StabilityGuard))
        weights = [p.detach().clone() for p in pl_module.parameters()]
        if guard.policy.rollbacks != self.rollbacks:
            self.rollbacks = guard.policy.rollbacks
            self.targets.append(
                [s for s, kept in self.after_step.items() if all(map(torch.equal, kept, weights))]
            )
        self.after_step[trainer.global_step] = weights


class _BatchesSeen(Callback):
    """A callback that rolls back with the model, listed after the guard: the guard then snapshots after every
    callback's batch end, and a checkpoint saved at a snapshot's step holds the previous periodic step."""

    restore_on_rollback = True

    def __init__(self) -> None:
        self.seen = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seen += 1

    def state_dict(self):
        return {"seen": self.seen}

    def load_state_dict(self, state_dict):
        self.seen = state_dict["seen"]


def _fit(root, every: int, ckpt_path=None, listed_after: bool = False, extra: Callback | None = None):
    pl.seed_everything(0, verbose=False)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(EPOCH_BATCHES * 16, 16, generator=generator)
    y = (x @ torch.randn(16, 10, generator=generator)).argmax(1)
    loader = DataLoader(TensorDataset(x, y), batch_size=16)
    guard = StabilityGuard(
        warmup=5, window=10, snapshot_every=every, rollback_after=1, skip_after_rollback=2, rollback_margin=1
    )
    targets = _RollbackTargets()
    callbacks = [guard, *([extra] if extra else []), targets, *([_BatchesSeen()] if listed_after else [])]
    if ckpt_path is None:
        callbacks.append(ModelCheckpoint(dirpath=root, every_n_train_steps=EPOCH_BATCHES, save_top_k=-1))
    trainer = pl.Trainer(
        max_steps=MAX_STEPS,
        callbacks=callbacks,
        default_root_dir=root,
        **trainer_kwargs(enable_checkpointing=ckpt_path is None),
    )
    model = _Classifier()
    trainer.fit(model, loader, ckpt_path=ckpt_path)
    return [p.detach().clone() for p in model.parameters()], targets.targets


# 5: the checkpoint (step 12) falls between periodic snapshots (10, 15); 4: the resume step is one's (12),
# taken before the checkpoint, or after it (a rollback-aware callback listed after the guard)
@pytest.mark.parametrize(("every", "listed_after"), [(5, False), (5, True), (4, False), (4, True)])
def test_a_resume_between_periodic_snapshots_rolls_back_where_the_uninterrupted_run_does(
    tmp_path, every, listed_after
):
    full_weights, full_targets = _fit(tmp_path, every, listed_after=listed_after)
    checkpoint = next(tmp_path.glob(f"*step={EPOCH_BATCHES}.ckpt"))
    resumed_weights, resumed_targets = _fit(
        tmp_path / "resumed", every, ckpt_path=str(checkpoint), listed_after=listed_after
    )
    expected = (NAN_AT - 1) // every * every  # the newest periodic snapshot at least rollback_margin before
    assert full_targets == [[expected]]
    assert resumed_targets == full_targets
    assert all(map(torch.equal, resumed_weights, full_weights))


class _CutAfterGuard(Callback):
    """Tells the guard, after its batch end of step 12, that parameters were replaced (a structured cut listed
    after it, through the documented contract): the guard owes a snapshot, taken after the step's save."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == EPOCH_BATCHES:
            guard = next(c for c in trainer.callbacks if isinstance(c, StabilityGuard))
            guard.on_pulse_parameters_replaced(trainer, pl_module, None)


@pytest.mark.parametrize("asked_by", ["maintain entry", "cut"])
def test_a_resume_whose_step_snapshot_was_asked_for_after_the_save_keeps_the_uninterrupted_schedule(
    tmp_path, asked_by
):
    # a snapshot asked for at the checkpoint's step (a maintain entry told after the guard's batch end, a cut)
    # restarts the periodic count after the save: the checkpoint holds the previous periodic step (10), and a
    # resume that kept it snapshotted at 15 where the uninterrupted run did at 17 (weights 0.034 apart)
    def asking():
        if asked_by == "cut":
            return _CutAfterGuard()
        return PulseCycle(burst=8, replay=4, maintain=4, warmup=0, anneal=0, maintain_eval="none")

    full_weights, full_targets = _fit(tmp_path, 5, listed_after=False, extra=asking())
    checkpoint = next(tmp_path.glob(f"*step={EPOCH_BATCHES}.ckpt"))
    resumed_weights, resumed_targets = _fit(tmp_path / "resumed", 5, str(checkpoint), extra=asking())
    assert full_targets == [[17]] and resumed_targets == full_targets
    assert all(map(torch.equal, resumed_weights, full_weights))
