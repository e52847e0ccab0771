"""Two gloo processes with ``use_distributed_sampler=False``, each rank training its own shard (manual
sharding): what depends on the ranks sharing one dataset index space, or one epoch length, is refused at fit
start on every rank alike, instead of mixing samples, switching phases at other steps, or hanging at the first
epoch boundary."""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from lightning_pulse import EnergyLogger, GradientCache, HardSampleReplay, PulseCycle
from tests.conftest import trainer_kwargs
from tests.ddp_workers import TwoGlooProcesses

SAMPLES, BATCH = 96, 8


class _Indexed(Dataset):
    """Sample ``i`` is ``(features, label)``, the same in every process."""

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i):
        features = torch.randn(8, generator=torch.Generator().manual_seed(i))
        return features, int(features.sum() > 0)


class OwnShard(Sampler):
    """This rank's own shard, read in each process: rank r the samples r, r + 2, ... below ``lengths[r] * 2``
    (so shards of equal ``lengths`` are disjoint halves of the data)."""

    def __init__(self, lengths: tuple[int, int]) -> None:
        self.lengths = lengths

    def _rank(self) -> int:
        return torch.distributed.get_rank()

    def __iter__(self):
        return iter(range(self._rank(), 2 * self.lengths[self._rank()], 2))

    def __len__(self) -> int:
        return self.lengths[self._rank()]


class _Mlp(pl.LightningModule):
    """Trains on ``OwnShard(shards)``, or, for ``None``, on a DistributedSampler of the user's own, built in
    each rank (Lightning's own is not put in: ``use_distributed_sampler=False``)."""

    def __init__(self, shards: tuple[int, int] | None) -> None:
        super().__init__()
        self.shards = shards
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        sampler = DistributedSampler(_Indexed()) if self.shards is None else OwnShard(self.shards)
        return DataLoader(_Indexed(), batch_size=BATCH, sampler=sampler)


class StepsTaken(Callback):
    """Writes each rank's optimizer steps at the end of training to ``<directory>/rank<r>.json``."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def on_train_end(self, trainer, pl_module):
        Path(self.directory, f"rank{trainer.global_rank}.json").write_text(json.dumps(trainer.global_step))


def _fit(tmp_path, callbacks, shards, max_steps=4, find_unused=False):
    """Fit two gloo ranks for ``max_steps`` (fewer than a shard's batches: no epoch end is reached, so the
    code before a refusal at fit start did not hang here) on ``shards`` (:class:`_Mlp`)."""
    trainer = pl.Trainer(
        callbacks=callbacks,
        max_steps=max_steps,
        limit_val_batches=0,
        **trainer_kwargs(
            devices=2,
            strategy=TwoGlooProcesses(find_unused_parameters=find_unused),
            use_distributed_sampler=False,
            default_root_dir=str(tmp_path),
        ),
    )
    trainer.fit(_Mlp(shards))


@pytest.mark.ddp
def test_epoch_based_phase_durations_are_refused_when_the_ranks_epochs_differ_in_length(tmp_path):
    # sweep s6: each rank converted `0.5` epochs to steps from its own epoch (rank 0: 6 batches, rank 1: 5),
    # so the ranks switched phases at other steps; with GradientCache their weights then drifted apart
    cycle = PulseCycle(burst=0.5, replay=0.5, maintain=0, warmup=0.0, anneal=0.0, maintain_eval="none")
    with pytest.raises(
        Exception, match="PulseCycle: the ranks' training epochs hold different numbers"
    ) as info:
        _fit(tmp_path, [cycle], (48, 40))
    message = str(info.value)
    assert "(rank 0: 6, rank 1: 5)" in message and "phases counted in epochs" in message
    assert "use_distributed_sampler=True" in message and "give the durations in steps or seconds" in message


@pytest.mark.ddp
def test_hard_sample_replay_refuses_per_rank_shards_that_would_share_its_score_table(tmp_path):
    # sweep s6: with shards of equal length each row of the gathered score table mixed rank 0's sample 2k
    # with rank 1's 2k + 1, silently (shards of other lengths: an IndexError at the first epoch end)
    with pytest.raises(
        Exception, match="HardSampleReplay needs one dataset index space shared by the 2"
    ) as info:
        _fit(tmp_path, [HardSampleReplay(mode="batch")], (48, 48))
    message = str(info.value)
    assert "the training sampler is OwnShard, not a DistributedSampler" in message
    assert "use_distributed_sampler=True" in message


@pytest.mark.ddp
def test_hard_sample_replay_trains_on_the_users_own_distributed_sampler(tmp_path):
    # no false positive: a DistributedSampler the user built (Lightning's injection off) is one index space
    _fit(tmp_path, [HardSampleReplay(mode="batch"), StepsTaken(str(tmp_path))], None)
    assert [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)] == [4, 4]


@pytest.mark.ddp
@pytest.mark.parametrize("which", ["EnergyLogger", "GradientCache"])
def test_epoch_boundary_collectives_are_refused_when_the_ranks_epochs_differ_in_length(tmp_path, which):
    # sweep s6: rank 1 (5 batches) reached its epoch end and the callback's collective there while rank 0
    # (6 batches) was still training: both waited forever
    callback = {
        "EnergyLogger": lambda: EnergyLogger(country_iso_code="DEU", cpu="none", ram="none", gpu="none"),
        "GradientCache": lambda: GradientCache(threshold=2.0, check_every=2),
    }[which]()
    with pytest.raises(
        Exception, match=f"{which}: the ranks' training epochs hold different numbers"
    ) as info:
        _fit(tmp_path, [callback], (48, 40), find_unused=which == "GradientCache")
    message = str(info.value)
    assert "(rank 0: 6, rank 1: 5)" in message and "use_distributed_sampler=True" in message
