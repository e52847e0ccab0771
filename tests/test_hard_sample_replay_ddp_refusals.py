"""HardSampleReplay under DDP: a refusal that only one rank's batch or module shows is raised on every rank,
at the same step (a rank refusing alone leaves the others waiting in the next collective)."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from tests.conftest import trainer_kwargs
from tests.ddp_workers import TwoGlooProcesses
from tests.test_hard_sample_replay_ddp import _RefusalDump

BATCH = 4


class _Indexed(Dataset):
    """Sample ``i`` is ``(i, features, label)``; the collates below shape rank 0's batches unlike rank 1's."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i):
        generator = torch.Generator().manual_seed(i)
        return i, torch.randn(6, generator=generator), i % 3


def _split(samples):
    index, x, y = zip(*samples)
    return torch.tensor(index), torch.stack(x), torch.tensor(y)


def _rank_0_and_call(counted):
    """Whether this process is rank 0, and how many batches ``counted`` collated before this one."""
    counted.append(None)
    return torch.distributed.get_rank() == 0, len(counted) - 1


def _time_major_from_rank_0s_fourth_batch(samples, _calls=[]):  # noqa: B006 (the process's batches so far)
    """Time-major ``(T, B)`` tokens padded to the longest sample: 4 long (T == B, which no batch tells from
    batch-first), but 6 on rank 0's fourth batch, past the batches the ranks vote at before a step."""
    index, _, y = _split(samples)
    on_rank_0, call = _rank_0_and_call(_calls)
    length = 6 if on_rank_0 and call == 3 else BATCH
    return {"tokens": (index[None, :] + torch.arange(length)[:, None]) % 10, "y": y}


def _time_major_on_both_ranks_fourth_batch(samples, _calls=[]):  # noqa: B006 (the process's batches so far)
    """As above, but both ranks' fourth batches stop matching B, each its own
    way: 6 long on rank 0, 5 on 1."""
    index, _, y = _split(samples)
    on_rank_0, call = _rank_0_and_call(_calls)
    length = (6 if on_rank_0 else 5) if call == 3 else BATCH
    return {"tokens": (index[None, :] + torch.arange(length)[:, None]) % 10, "y": y}


class _TimeMajorBag(pl.LightningModule):
    """Embeds ``(T, B)`` tokens and averages them over time; writes, per rank, the batches it stepped."""

    def __init__(self, directory: str) -> None:
        super().__init__()
        self.embed, self.head, self.directory = torch.nn.Embedding(10, 8), torch.nn.Linear(8, 3), directory

    def training_step(self, batch, batch_idx):
        with Path(self.directory, f"steps{self.global_rank}.txt").open("a") as steps:
            steps.write(f"{batch_idx}\n")
        return torch.nn.functional.cross_entropy(self.head(self.embed(batch["tokens"]).mean(0)), batch["y"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _patches_joined_on_rank_0(samples, _calls=[]):  # noqa: B006 (the process's batches so far)
    """Features, labels and the samples' patches joined along the first dimension (no per-sample count beside
    them): two per sample on rank 1's batches, so its first two batches' ``(8, 2)`` keep their shape (a
    per-batch constant, for all a batch tells); on rank 0 two, then three per
    sample: ``(8, 2)``, ``(12, 2)``."""
    index, x, y = _split(samples)
    on_rank_0, call = _rank_0_and_call(_calls)
    per_sample = 2 + int(on_rank_0 and call == 1)
    return {"x": x, "y": y, "patches": torch.ones(per_sample * len(index), 2)}


class _CarriedOnRank0(pl.LightningModule):
    """Keeps its hidden state ``(B, 5)`` on the module and adds it to the next batch's unless that batch
    starts new streams (``fresh``): rank 1's batches always do, so only rank 0 reads the state it carries."""

    def __init__(self, directory: str) -> None:
        super().__init__()
        self.net, self.head, self.directory = torch.nn.Linear(6, 5), torch.nn.Linear(5, 3), directory
        self.state = None

    def training_step(self, batch, batch_idx):
        with Path(self.directory, f"steps{self.global_rank}.txt").open("a") as steps:
            steps.write(f"{batch_idx}\n")
        hidden = self.net(batch["x"])
        if self.state is not None and not bool(batch["fresh"].all()):
            hidden = hidden + self.state
        self.state = hidden.detach()
        return torch.nn.functional.cross_entropy(self.head(hidden), batch["y"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _Features(_CarriedOnRank0):
    def training_step(self, batch, batch_idx):
        with Path(self.directory, f"steps{self.global_rank}.txt").open("a") as steps:
            steps.write(f"{batch_idx}\n")
        return torch.nn.functional.cross_entropy(self.head(self.net(batch["x"])), batch["y"])


def _streams_fresh_on_rank_1(samples):
    index, x, y = _split(samples)
    return {
        "x": x,
        "y": y,
        "fresh": torch.full_like(index, torch.distributed.get_rank() == 1, dtype=torch.bool),
    }


def _fit_refused(module, collate, tmp_path, accumulate=1):
    """Fit two gloo ranks in batch mode; the text each rank's refusal had, and the batches each stepped."""
    trainer = pl.Trainer(
        callbacks=[_RefusalDump(str(tmp_path), mode="batch", replay_fraction=0.5)],
        max_epochs=2,
        limit_val_batches=0,
        accumulate_grad_batches=accumulate,
        **trainer_kwargs(devices=2, strategy=TwoGlooProcesses()),
    )
    with pytest.raises(Exception, match="PulseRefusal|HardSampleReplay"):
        trainer.fit(module, DataLoader(_Indexed(), batch_size=BATCH, collate_fn=collate))
    said = [tmp_path / f"rank{r}.txt" for r in (0, 1)]
    texts = [path.read_text() if path.exists() else "" for path in said]
    return texts, [(tmp_path / f"steps{r}.txt").read_text().split() for r in (0, 1)]


def _refused_alike(texts, start):
    """Both ranks raised the same refusal, found on one of them, which begins ``start``."""
    assert texts[0] == texts[1], texts
    assert texts[0].startswith(f"PulseRefusal: HardSampleReplay {start}"), texts[0]
    assert "of 2; every rank refuses alike, so that none waits for another in a collective.)" in texts[0]


@pytest.mark.ddp
def test_every_rank_refuses_a_time_major_batch_that_only_one_rank_shows_after_the_first_batches(tmp_path):
    # a review: one rank alone refused the batch whose T stopped matching B, past the batches the ranks vote
    # at, and the other stepped on into a backward that never completed (gloo: the peer closed; NCCL hangs)
    module = _TimeMajorBag(str(tmp_path))
    texts, steps = _fit_refused(module, _time_major_from_rank_0s_fourth_batch, tmp_path)
    _refused_alike(texts, "cannot cut a batch of 4 samples in mode='batch': it holds tensors of shape (6, 4)")
    assert "batch_first=True" in texts[0]
    # at the end of the same step: the rank that found it trained that batch whole, the other its cut
    assert steps[0] == steps[1] and len(steps[0]) > 3


@pytest.mark.ddp
@pytest.mark.parametrize("accumulate", [1, 2])
def test_ranks_finding_different_refusals_at_one_batch_raise_the_first_ranks_alike(tmp_path, accumulate):
    # a review: each rank's own text would have differed; the first refusing rank's is broadcast. With
    # accumulation the batch is the second micro-batch of a step: refused at that micro-batch's end alike
    module = _TimeMajorBag(str(tmp_path))
    texts, steps = _fit_refused(module, _time_major_on_both_ranks_fourth_batch, tmp_path, accumulate)
    _refused_alike(texts, "cannot cut a batch of 4 samples in mode='batch': it holds tensors of shape (6, 4)")
    assert "(Found on rank 0 of 2;" in texts[0]
    assert steps == [["0", "1", "2", "3"], ["0", "1", "2", "3"]]


@pytest.mark.ddp
def test_every_rank_refuses_joined_rows_that_only_one_rank_shows_before_either_steps(tmp_path):
    texts, steps = _fit_refused(_Features(str(tmp_path)), _patches_joined_on_rank_0, tmp_path)
    _refused_alike(
        texts, "cannot cut a batch of 4 samples in mode='batch': it holds batch['patches'] of shape"
    )
    assert steps == [["0"], ["0"]]  # both refused at the second batch's start


@pytest.mark.ddp
def test_every_rank_refuses_carried_state_that_only_one_rank_reads(tmp_path):
    texts, steps = _fit_refused(_CarriedOnRank0(str(tmp_path)), _streams_fresh_on_rank_1, tmp_path)
    _refused_alike(texts, "cannot cut the batches of a module that carries state from one batch to the next")
    assert steps == [["0", "1"], ["0", "1"]]  # both refused at the second batch's end
