"""HardSampleReplay under DDP: two gloo processes gather scores and take the same decisions."""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import Callback

from lightning_pulse.callbacks.hard_sample_replay import HardSampleReplay
from tests.conftest import trainer_kwargs
from tests.ddp_workers import TwoGlooProcesses


class ReplayDump(Callback):
    """Writes, per rank, what HardSampleReplay decided at every step and its final table."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.steps: list[dict] = []

    def on_before_backward(self, trainer, pl_module, loss):
        replay = next(c for c in trainer.callbacks if isinstance(c, HardSampleReplay))
        self.steps.append(
            {
                "step": trainer.global_step,
                "threshold": replay.threshold,
                "origins": replay.trained_origins,
                "trained": replay.trained_indices.tolist(),
            }
        )

    def on_train_end(self, trainer, pl_module):
        replay = next(c for c in trainer.callbacks if isinstance(c, HardSampleReplay))
        table = replay.table
        record = {
            "steps": self.steps,
            "scores": table.scores.tobytes().hex(),
            "seen": table.seen,
            "replays": table.replays.tolist(),
            "metrics": replay.metrics(),
        }
        Path(self.directory, f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


@pytest.mark.ddp
def test_ranks_share_one_score_table_and_select_within_their_own_shards(mnist1d_small, tmp_path):
    model, data = mnist1d_small()
    replay = HardSampleReplay(rule="random", replay_fraction=0.5, mode="batch")
    trainer = pl.Trainer(
        callbacks=[replay, ReplayDump(str(tmp_path))],
        max_epochs=2,
        limit_val_batches=0,
        **trainer_kwargs(devices=2, strategy="ddp_spawn"),
    )
    trainer.fit(model, data)
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    # every rank wrote every rank's losses: one table, identical bit for bit, covering the whole dataset
    assert rank0["scores"] == rank1["scores"] and rank0["replays"] == rank1["replays"]
    assert rank0["seen"] == 720
    assert rank0["metrics"] == rank1["metrics"]
    # the same threshold at every step, and each rank selects from its own shard (batch sizes stay equal)
    assert [s["threshold"] for s in rank0["steps"]] == [s["threshold"] for s in rank1["steps"]]
    replay_sizes = []
    for mine, theirs in zip(rank0["steps"], rank1["steps"]):
        assert mine["step"] == theirs["step"]
        assert not set(mine["trained"]) & set(theirs["trained"])
        assert len(mine["trained"]) == len(theirs["trained"])
        if "selected" in mine["origins"]:
            replay_sizes.append((len(mine["trained"]), len(theirs["trained"])))
    # the second epoch's 6 replay steps: each cut, to the same size on both ranks (half of 64, of 40 at the end)
    assert replay_sizes == [(32, 32)] * 5 + [(20, 20)]
    assert rank0["metrics"]["replay_fraction"] == pytest.approx(0.75)
    # each rank trains on its own shard in the first epoch (6 batches of 64 or fewer per rank)
    first_epoch = [i for s in rank0["steps"][:6] for i in s["trained"]] + [
        i for s in rank1["steps"][:6] for i in s["trained"]
    ]
    assert sorted(set(first_epoch)) == list(range(720))


class TableDump(Callback):
    """Writes, per rank, the final score table and how many steps went unscored."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def on_train_end(self, trainer, pl_module):
        replay = next(c for c in trainer.callbacks if isinstance(c, HardSampleReplay))
        record = {"scores": replay.table.scores.tobytes().hex(), "unscored": replay.batches.unscored_steps}
        Path(self.directory, f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


@pytest.mark.ddp
def test_a_later_step_unscored_on_one_rank_keeps_both_ranks_in_step(tmp_path):
    # a loss over the labelled part of a batch: one unlabelled sample, so only one rank's batch stops splitting;
    # both ranks still record the step (its rows without scores) and gather alike
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from tests.test_hard_sample_replay import _LabelledOnly

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(128, 8, generator=generator)
    labelled = torch.ones(128, dtype=torch.bool)
    labelled[100] = False
    data = DataLoader(TensorDataset(x, (x[:, 0] > 0).long(), labelled), batch_size=16)
    trainer = pl.Trainer(
        callbacks=[HardSampleReplay(mode="batch"), TableDump(str(tmp_path))],
        max_epochs=2,
        limit_val_batches=0,
        **trainer_kwargs(devices=2, strategy=TwoGlooProcesses()),
    )
    trainer.fit(_LabelledOnly(), data)
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert rank0["scores"] == rank1["scores"]  # one table, bit for bit
    assert sorted([rank0["unscored"], rank1["unscored"]]) == [0, 2]  # one rank's batch, once a pass


class ParameterDump(Callback):
    """Writes, per rank, the module's parameters at the end of training."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def on_train_end(self, trainer, pl_module):
        import torch

        flat = torch.cat([p.detach().flatten() for p in pl_module.parameters()])
        Path(self.directory, f"rank{trainer.global_rank}.json").write_text(json.dumps(flat.tolist()))


@pytest.mark.ddp
def test_ranks_stay_identical_under_a_static_graph_with_a_weighted_loss(tmp_path):
    # regression sweep: reading the loss's parts with a second autograd pass before backward made the ranks'
    # parameters drift apart under DDPStrategy(static_graph=True) (0.06 after 6 steps); a hook now reads them
    from tests.test_hard_sample_replay import WeightedAuxiliaryLoss, _data

    pl.seed_everything(0)
    trainer = pl.Trainer(
        callbacks=[HardSampleReplay(mode="batch"), ParameterDump(str(tmp_path))],
        max_steps=6,
        limit_val_batches=0,
        **trainer_kwargs(devices=2, strategy=TwoGlooProcesses(static_graph=True)),
    )
    trainer.fit(WeightedAuxiliaryLoss(arch="mlp"), _data())
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert rank0 == rank1
