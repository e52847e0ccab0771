"""Two gloo processes with ``use_distributed_sampler=False``, each rank training its own shard (manual
sharding): what depends on the ranks sharing one dataset index space, or one epoch length, is refused at fit
start on every rank alike, instead of mixing samples, switching phases at other steps, or hanging at the first
epoch boundary; a rank-aware sampler over the one shared dataset, or a run that ends before any epoch end,
trains."""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler, Subset

from lightning_pulse import EnergyLogger, GradientCache, HardSampleReplay, PulseCycle
from lightning_pulse.core.replay import dataset_fingerprint, per_rank_data_refusal
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
    """Trains on ``OwnShard(shards)`` over the whole dataset, or, for ``None``, on a DistributedSampler of the
    user's own, built in each rank (Lightning's own is not put in: ``use_distributed_sampler=False``); with
    ``subsets``, on this rank's own ``Subset`` of the samples r, r + 2, ... (its local index k is another
    sample on each rank). ``lr=0`` keeps the weights, so a sample's loss is the same at every visit."""

    def __init__(self, shards: tuple[int, int] | None, subsets: bool = False, lr: float = 0.1) -> None:
        super().__init__()
        self.shards, self.subsets, self.lr = shards, subsets, lr
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def train_dataloader(self):
        if self.subsets:
            rank = torch.distributed.get_rank()
            own = Subset(_Indexed(), list(range(rank, 2 * self.shards[rank], 2)))
            return DataLoader(own, batch_size=BATCH)
        sampler = DistributedSampler(_Indexed()) if self.shards is None else OwnShard(self.shards)
        return DataLoader(_Indexed(), batch_size=BATCH, sampler=sampler)


class StepsTaken(Callback):
    """Writes each rank's optimizer steps at the end of training to ``<directory>/rank<r>.json``."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def on_train_end(self, trainer, pl_module):
        Path(self.directory, f"rank{trainer.global_rank}.json").write_text(json.dumps(trainer.global_step))


def _fit(tmp_path, callbacks, shards, max_steps=4, find_unused=False, **data):
    """Fit two gloo ranks for ``max_steps`` (by default fewer than a shard's batches: no epoch end is
    reached, so a missing refusal does not hang here) on ``shards`` (:class:`_Mlp`, with ``data``)."""
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
    trainer.fit(_Mlp(shards, **data))


class ScoreErrors(Callback):
    """Writes each rank's HardSampleReplay table at the end of training to ``<directory>/rank<r>.json``: how
    many rows are scored and their largest distance from the sample's own loss (the model never moved)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def on_train_end(self, trainer, pl_module):
        replay = next(c for c in trainer.callbacks if isinstance(c, HardSampleReplay))
        data = _Indexed()
        with torch.no_grad():
            samples = [data[i] for i in range(SAMPLES)]
            losses = [F.cross_entropy(pl_module.net(x[None]), torch.tensor([y])).item() for x, y in samples]
        scores = torch.as_tensor(replay.table.scores, dtype=torch.float64)
        scored = torch.isfinite(scores)
        error = (scores - torch.tensor(losses, dtype=torch.float64))[scored].abs().max().item()
        result = {"scored": int(scored.sum()), "max_error": error}
        Path(self.directory, f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


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
@pytest.mark.parametrize(
    ("lengths", "differ"), [((48, 48), "Subset indices"), ((48, 40), "lengths and Subset indices")]
)
def test_hard_sample_replay_refuses_per_rank_subsets_that_would_share_its_score_table(
    tmp_path, lengths, differ
):
    # sweep s6: with a Subset per rank, local index k is rank 0's sample 2k and rank 1's 2k + 1: equal lengths
    # mixed them in one row of the gathered table, silently; other lengths raised an IndexError at epoch end
    with pytest.raises(
        Exception, match="HardSampleReplay needs one dataset index space shared by the 2"
    ) as info:
        _fit(tmp_path, [HardSampleReplay(mode="batch")], lengths, subsets=True)
    message = str(info.value)
    rank_lengths = f"rank 0: {lengths[0]}, rank 1: {lengths[1]}"
    assert f"the ranks' training datasets differ ({differ}; lengths {rank_lengths})" in message
    assert "use_distributed_sampler=True" in message and "instead of a Subset or dataset per rank" in message


@pytest.mark.ddp
def test_hard_sample_replay_scores_a_rank_aware_sampler_over_the_shared_dataset_by_dataset_index(tmp_path):
    # review of eb164ca: OwnShard draws real indices r, r + 2, ... of the one dataset every rank holds, so
    # the gathered rows land on their own samples (the refusal of any sampler but a DistributedSampler
    # refused this, Lightning's documented way to use a custom distributed sampler)
    callbacks = [HardSampleReplay(mode="batch"), ScoreErrors(str(tmp_path))]
    _fit(tmp_path, callbacks, (48, 48), max_steps=12, lr=0.0)  # two epochs: every sample scored
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["scored"] == SAMPLES and result["max_error"] < 1e-5


@pytest.mark.ddp
def test_hard_sample_replay_trains_on_the_users_own_distributed_sampler(tmp_path):
    # no false positive: a DistributedSampler the user built (Lightning's injection off) is one index space
    _fit(tmp_path, [HardSampleReplay(mode="batch"), StepsTaken(str(tmp_path))], None)
    assert [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)] == [4, 4]


def _epoch_boundary_callback(which: str) -> Callback:
    return {
        "EnergyLogger": lambda: EnergyLogger(country_iso_code="DEU", cpu="none", ram="none", gpu="none"),
        "GradientCache": lambda: GradientCache(threshold=2.0, check_every=2),
    }[which]()


@pytest.mark.ddp
@pytest.mark.parametrize("which", ["EnergyLogger", "GradientCache"])
def test_epoch_boundary_collectives_are_refused_when_the_ranks_epochs_differ_in_length(tmp_path, which):
    # sweep s6: rank 1 (5 batches) reached its epoch end and the callback's collective there while rank 0
    # (6 batches) was still training: both waited forever. 6 steps: rank 1 would end its epoch
    with pytest.raises(
        Exception, match=f"{which}: the ranks' training epochs hold different numbers"
    ) as info:
        _fit(tmp_path, [_epoch_boundary_callback(which)], (48, 40), 6, find_unused=which == "GradientCache")
    message = str(info.value)
    assert "(rank 0: 6, rank 1: 5)" in message and "use_distributed_sampler=True" in message


@pytest.mark.ddp
@pytest.mark.parametrize("which", ["EnergyLogger", "GradientCache"])
def test_epoch_boundary_collectives_train_uneven_epochs_that_the_run_ends_before(tmp_path, which):
    # review of eb164ca: max_steps=4 ends the run before either rank's epoch end (5 and 6 batches), where
    # every rank meets the train-end collectives at the same step; such a run was refused too
    callbacks = [_epoch_boundary_callback(which), StepsTaken(str(tmp_path))]
    _fit(tmp_path, callbacks, (48, 40), 4, find_unused=which == "GradientCache")
    assert [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)] == [4, 4]


def test_the_dataset_fingerprint_is_the_same_for_the_same_data_and_names_what_differs():
    # built in each process: equal for the same data, whatever the objects' identity
    data = _Indexed()
    assert dataset_fingerprint(Subset(_Indexed(), [0, 2, 4])) == dataset_fingerprint(Subset(data, [0, 2, 4]))

    def ranks(*datasets):
        return lambda mine: torch.stack([torch.tensor(dataset_fingerprint(d)) for d in datasets])

    assert per_rank_data_refusal(data, ranks(data, _Indexed())) is None
    odd, even = Subset(data, [1, 3]), Subset(data, [0, 2])
    assert "differ (Subset indices; lengths rank 0: 2, rank 1: 2)" in per_rank_data_refusal(
        odd, ranks(even, odd)
    )
    assert "differ (dataset types and Subset indices; lengths rank 0: 96" in per_rank_data_refusal(
        data, ranks(data, Subset(data, range(SAMPLES)))
    )
