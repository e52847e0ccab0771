"""StabilityGuard under DDP: two gloo processes take the same decisions at the same steps.

The fault hits rank 1 only. Rank 0's own loss stays normal, so only a decision made from all-reduced
numbers makes both ranks skip and roll back together (otherwise their parameters would part).
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback

from benchmarks.stability_guard import FaultInjector
from examples.mnist1d import MNIST1DClassifier, MNIST1DDataModule
from lightning_pulse.callbacks.stability_guard import StabilityGuard
from tests.conftest import trainer_kwargs
from tests.ddp_workers import PowerSGDOnTheWrapper, TwoGlooProcesses


class GuardDump(Callback):
    """Writes the guard's events, counters and snapshot steps, and a digest of the parameters, to
    ``rank<r>.json``."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def on_train_end(self, trainer, pl_module):
        guard = next(cb for cb in trainer.callbacks if isinstance(cb, StabilityGuard))
        params = torch.cat([p.detach().flatten() for p in pl_module.parameters()])
        record = {
            "events": guard.events,
            "counters": [guard.spikes_detected, guard.steps_skipped, guard.rollbacks, guard.steps_lost],
            "snapshots": [guard.snapshots.steps, guard.snapshots_taken],
            "params": params.tolist(),
        }
        Path(self.directory, f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


def fit_two_ranks(tmp_path, faults, guard, max_steps, spawn=False) -> tuple[dict, dict]:
    """A two-process gloo fit of the MNIST-1D MLP with ``faults`` and ``guard``; each rank's dumped record.
    ``spawn``: ranks in fresh interpreters (``ddp_spawn``), not forked from the preloaded server."""
    strategy = "ddp_spawn" if spawn else TwoGlooProcesses()
    trainer = pl.Trainer(
        callbacks=[*faults, guard, GuardDump(str(tmp_path))],
        max_steps=max_steps,
        **trainer_kwargs(devices=2, strategy=strategy, limit_val_batches=0),
    )
    trainer.fit(MNIST1DClassifier(arch="mlp"), MNIST1DDataModule(num_samples=1000, batch_size=60))
    return tuple(json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1))


@pytest.mark.ddp
def test_ranks_skip_and_roll_back_together_when_one_rank_sees_the_fault(tmp_path):
    pl.seed_everything(0)
    guard = StabilityGuard(
        warmup=10,
        grad_norm_zscore=None,
        rollback_after=2,
        skip_after_rollback=2,
        snapshot_every=5,
        rollback_margin=2,
    )
    fault = FaultInjector("scale", start=25, length=3, ranks=(1,))
    # ddp_spawn: ranks that also exit through a whole interpreter's teardown (the gloo exit abort)
    rank0, rank1 = fit_two_ranks(tmp_path, [fault], guard, max_steps=32, spawn=True)
    assert (
        rank0["events"]
        == rank1["events"]
        == [
            {"step": 25, "event": "loss_spike", "action": "skip"},
            {"step": 26, "event": "loss_spike", "action": "rollback"},
            {"step": 26, "event": "rollback", "to_step": 20},
        ]
    )
    # flagged 25 and 26, forced skips 27 and 28; updates 20..24 undone
    assert rank0["counters"] == rank1["counters"] == [2, 4, 1, 9]
    assert rank0["params"] == rank1["params"]


@pytest.mark.ddp
def test_ranks_agree_that_a_nan_batch_on_one_rank_is_the_datas_fault(tmp_path):
    pl.seed_everything(0)
    guard = StabilityGuard(warmup=10, rollback_after=2, snapshot_every=5, rollback_margin=2)
    fault = FaultInjector("nan", start=15, length=4, ranks=(1,))
    rank0, rank1 = fit_two_ranks(tmp_path, [fault], guard, max_steps=24)
    # rank 0's batches were clean, rank 1's not: both skipped the four steps as the data's fault, no rollback
    expected = [
        {"step": s, "event": "nonfinite_loss", "action": "skip", "cause": "data"} for s in range(15, 19)
    ]
    assert rank0["events"] == rank1["events"] == expected
    assert rank0["counters"] == rank1["counters"] == [4, 4, 0, 4]
    assert rank0["params"] == rank1["params"]


@pytest.mark.ddp
def test_ranks_agree_that_spikes_a_snapshot_reproduces_are_the_datas_and_skip_them(tmp_path):
    # rank 1's inputs are scaled at steps 25 and 27 only: finite data that spikes the loss, with a healthy step
    # between. At the second flag the rollback test runs each rank's batches at the snapshot's weights and sums
    # the losses over ranks: both ranks find the spike reproduced there and skip instead of rolling back.
    pl.seed_everything(0)
    guard = StabilityGuard(
        warmup=10, grad_norm_zscore=None, rollback_after=2, snapshot_every=5, rollback_margin=2
    )
    faults = [FaultInjector("scale", start=step, length=1, ranks=(1,)) for step in (25, 27)]
    rank0, rank1 = fit_two_ranks(tmp_path, faults, guard, max_steps=32)
    assert rank0["events"] == rank1["events"]
    assert rank0["events"] == [
        {"step": 25, "event": "loss_spike", "action": "skip"},
        {"step": 27, "event": "loss_spike", "action": "skip", "cause": "recurring"},
    ]
    assert rank0["counters"] == rank1["counters"] == [2, 2, 0, 2]
    assert rank0["params"] == rank1["params"]


class NaNInABufferOnRank1At10(Callback):
    """A buffer holding ``-inf`` by design on both ranks; rank 1 alone has a NaN in it when step 10 ends (the
    snapshot due then), and mends it in the next step."""

    def on_train_start(self, trainer, pl_module):
        pl_module.register_buffer("scratch", torch.tensor([0.0, float("-inf")]), persistent=False)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_rank == 1 and trainer.global_step in (10, 11):
            pl_module.scratch[0] = float("nan") if trainer.global_step == 10 else 0.0


@pytest.mark.ddp
def test_a_nan_in_one_ranks_state_leaves_the_snapshot_out_on_every_rank(tmp_path):
    """Each rank screens its own state; the finding is all-reduced, so rank 0, whose state is finite, leaves
    the step-10 snapshot out too and the rings stay alike (otherwise a rollback would part the ranks)."""
    pl.seed_everything(0)
    guard = StabilityGuard(warmup=10, snapshot_every=5, rollback_margin=2, max_snapshots=3)
    rank0, rank1 = fit_two_ranks(tmp_path, [NaNInABufferOnRank1At10()], guard, max_steps=22)
    assert rank0["snapshots"] == rank1["snapshots"] == [[5, 15, 20], 4]  # 0, 5, 15, 20 taken; 10 left out
    assert rank0["params"] == rank1["params"]


class _RankView(Callback):
    """Before the guard: each rank works in its own folder (``rank<r>``, where rank 0's ``stops`` is a
    regular file); with ``block_at``, rank 0 turns the stop checkpoint's folder into a file at that step (a
    folder removed, a disk full)."""

    def __init__(self, directory: str, block_at: int | None = None) -> None:
        self.directory, self.block_at = Path(directory), block_at

    def setup(self, trainer, pl_module, stage):
        os.chdir(self.directory / f"rank{trainer.global_rank}")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        folder = Path("stops")
        if trainer.global_step == self.block_at and trainer.is_global_zero and folder.is_dir():
            shutil.rmtree(folder)
            folder.write_text("")


class _SaysWhatItRaised(StabilityGuard):
    """A guard that writes, per rank, what its hooks raised to ``said<r>.txt`` (a rank's own exception is not
    what the launching process reraises, and the ranks run no ``on_exception`` hook)."""

    def __init__(self, directory: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.directory = directory

    def _said(self, trainer, hook, *args) -> None:
        try:
            getattr(super(), hook)(trainer, *args)
        except Exception as error:
            Path(self.directory, f"said{trainer.global_rank}.txt").write_text(
                f"{type(error).__name__}: {error}"
            )
            raise

    def setup(self, trainer, pl_module, stage):
        self._said(trainer, "setup", pl_module, stage)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._said(trainer, "on_train_batch_end", pl_module, outputs, batch, batch_idx)


def _stop_on_two_ranks(tmp_path, block_at=None):
    """A two-rank fit whose guard stops at step 25, saving to ``stops/stop.ckpt`` in each rank's folder; what
    each rank raised."""
    for rank in (0, 1):
        (tmp_path / f"rank{rank}").mkdir()
    if block_at is None:
        (tmp_path / "rank0" / "stops").write_text("")  # rank 0 cannot write it; rank 1 could
    config = {"stop_checkpoint_path": "stops/stop.ckpt"}
    guard = _SaysWhatItRaised(
        str(tmp_path),
        grad_norm_zscore=None,
        rollback_after=2,
        skip_after_rollback=2,
        snapshot_every=5,
        rollback_margin=2,
        max_rollbacks=1,
        config=config,
    )
    fault = FaultInjector("scale", start=20, length=100)
    trainer = pl.Trainer(
        callbacks=[_RankView(str(tmp_path), block_at), fault, guard],
        max_steps=60,
        **trainer_kwargs(devices=2, strategy=TwoGlooProcesses(), limit_val_batches=0),
    )
    with pytest.raises(Exception, match="StabilityGuard"):
        trainer.fit(MNIST1DClassifier(arch="mlp"), MNIST1DDataModule(num_samples=1000, batch_size=60))
    return [(tmp_path / f"said{rank}.txt").read_text() for rank in (0, 1)]


@pytest.mark.ddp
def test_ranks_refuse_a_stop_path_rank_zero_cannot_write_together(tmp_path):
    """Rank 0 writes the checkpoint, so its finding is every rank's: rank 1, which could write the path in its
    folder, refuses too instead of waiting in the next collective."""
    said = _stop_on_two_ranks(tmp_path)
    assert said[0] == said[1], said
    assert said[0].startswith("PulseRefusal: StabilityGuard: `config.stop_checkpoint_path`='stops/stop.ckpt'")
    assert "cannot be created: File exists" in said[0]


@pytest.mark.ddp
def test_ranks_raise_the_guards_error_together_when_the_stop_checkpoint_cannot_be_written(tmp_path):
    """Rank 0's save fails; rank 1, which writes nothing, waits in the save's barrier: both raise the guard's
    error with the reason."""
    said = _stop_on_two_ranks(tmp_path, block_at=22)
    assert said[0] == said[1], said
    assert said[0].startswith("StabilityGuardError: StabilityGuard stopped training at step 25")
    assert "But that checkpoint could not be written (FileExistsError: " in said[0]


@pytest.mark.ddp
@pytest.mark.parametrize("kind", ["nan", "scale"])
def test_a_skipped_step_leaves_nothing_in_powersgds_error_feedback(tmp_path, kind):
    # strategy sweep: PowerSGD's error feedback kept a skipped step's compression error (NaN after a NaN batch,
    # huge after a 1e4 spike) and added it to every later gradient: steps flagged at normal losses, 3
    # rollbacks, then a stop blaming the data. The guard now clears the hook's memories at a skip or rollback.
    pl.seed_everything(0)
    guard = StabilityGuard(
        warmup=5, rollback_after=2, snapshot_every=4, rollback_margin=2, skip_after_rollback=2
    )
    faults = [PowerSGDOnTheWrapper(str(tmp_path)), FaultInjector(kind, start=10, length=1, ranks=(1,))]
    rank0, rank1 = fit_two_ranks(tmp_path, faults, guard, max_steps=20)
    assert rank0["events"] == rank1["events"]
    assert len(rank0["events"]) == 1 and rank0["events"][0]["step"] == 10, rank0["events"]
    assert rank0["counters"] == rank1["counters"] == [1, 1, 0, 1]
    assert rank0["params"] == rank1["params"] and all(math.isfinite(v) for v in rank0["params"])
    hooks = [json.loads((tmp_path / f"powersgd_rank{rank}.json").read_text()) for rank in (0, 1)]
    assert hooks[0]["trained"][-1] == 20 and hooks[0]["memory"][0] > 0 and hooks[0]["memory"][1]
