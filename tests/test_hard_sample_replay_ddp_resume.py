"""HardSampleReplay under DDP, resumed from a checkpoint saved at an epoch's
last batch: two gloo processes."""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_pulse.callbacks.hard_sample_replay import HardSampleReplay
from tests.conftest import trainer_kwargs
from tests.ddp_workers import TwoGlooProcesses


class FinalState(Callback):
    """Writes, per rank, the module's final parameters and HardSampleReplay's final score table."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def on_train_end(self, trainer, pl_module):
        replay = next(c for c in trainer.callbacks if isinstance(c, HardSampleReplay))
        flat = torch.cat([p.detach().flatten() for p in pl_module.parameters()])
        record = {"parameters": flat.numpy().tobytes().hex(), "scores": replay.table.scores.tobytes().hex()}
        Path(self.directory, f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


def _fit(model, data, directory: Path, ckpt_path: Path | None = None) -> dict[int, dict]:
    directory.mkdir()
    # 720 samples, 360 per rank: 6 batches of 64 (the last of 40), so step 6 is the first epoch's last batch
    saver = ModelCheckpoint(dirpath=directory, every_n_train_steps=6, save_top_k=-1, filename="{step}")
    trainer = pl.Trainer(
        callbacks=[HardSampleReplay(mode="batch"), FinalState(directory), saver],
        max_epochs=3,
        limit_val_batches=0,
        **trainer_kwargs(devices=2, strategy=TwoGlooProcesses(), enable_checkpointing=True),
    )
    trainer.fit(model, data, ckpt_path=ckpt_path)
    return {rank: json.loads((directory / f"rank{rank}.json").read_text()) for rank in (0, 1)}


@pytest.mark.ddp
def test_a_resume_from_an_epoch_end_checkpoint_under_ddp_reproduces_the_uninterrupted_run(
    mnist1d_small, tmp_path
):
    # Lightning resumes from a checkpoint saved at an epoch's last batch without running that epoch's end
    # hooks again: the steps measured but not yet applied were left unapplied, so the next epoch selected from
    # other scores (all of the last batch's samples still unscored, kept) and the weights differed
    pl.seed_everything(0)
    full = _fit(*mnist1d_small(), tmp_path / "full")
    checkpoint = tmp_path / "full" / "step=6.ckpt"
    saved = torch.load(checkpoint, weights_only=False)["callbacks"]
    state = next(state for key, state in saved.items() if key.startswith("HardSampleReplay"))
    assert state["unapplied"] is None  # the epoch's last batch applied them before the checkpoint
    resumed = _fit(*mnist1d_small(), tmp_path / "resumed", ckpt_path=checkpoint)
    assert resumed[0] == resumed[1]  # the ranks agree
    assert resumed[0]["scores"] == full[0]["scores"]
    assert resumed[0]["parameters"] == full[0]["parameters"]
