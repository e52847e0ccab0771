"""The evaluation probe's torchmetrics figures under DDP: over every rank's probe batches, at every probe, with
ranks that validate on uneven shards."""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import MeanMetric, SumMetric

from lightning_pulse import PulseCycle
from tests.conftest import trainer_kwargs
from tests.ddp_workers import run_python_in_its_own_session

#: (global_step, loss) of each `validation_step` the probe called in this process
_PROBE_LOSSES: list[tuple[int, float]] = []


class _LogsAMeanAndASum(pl.LightningModule):
    """Logs a torchmetrics mean and sum of its validation loss. Rank 0 validates on 3 batches, rank 1 on 2.
    Each rank writes the losses its probe batches gave and the cycle's figures after each step."""

    def __init__(self, directory: str) -> None:
        super().__init__()
        self.directory = directory
        self.net = torch.nn.Linear(4, 2)
        self.mean, self.sum = MeanMetric(), SumMetric()
        self.figures: list[tuple[int, dict[str, float]]] = []

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self.net(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx):
        loss = F.cross_entropy(self.net(batch[0]), batch[1])
        _PROBE_LOSSES.append((self.trainer.global_step, loss.item()))
        self.mean.update(loss)
        self.sum.update(loss)
        self.log("val_mean", self.mean)
        self.log("val_sum", self.sum)

    def on_train_batch_end(self, outputs, batch, batch_idx):  # after PulseCycle's, which runs the probe
        cycle = next(c for c in self.trainer.callbacks if isinstance(c, PulseCycle))
        if cycle.last_probe and (not self.figures or self.figures[-1][1] != cycle.last_probe):
            self.figures.append((self.trainer.global_step, dict(cycle.last_probe)))

    def on_train_end(self):
        outcome = {"losses": _PROBE_LOSSES, "figures": self.figures}
        Path(self.directory, f"rank{self.global_rank}.json").write_text(json.dumps(outcome))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=4)

    def val_dataloader(self):  # uneven shards: 12 rows (3 batches) on rank 0, 5 rows (2 batches) on rank 1
        rows = 12 if self.global_rank == 0 else 5
        x = torch.randn(rows, 4, generator=torch.Generator().manual_seed(1 + self.global_rank))
        return DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=4)


def fit_with_uneven_shards(directory: str) -> None:
    """Two gloo ranks started by pickling the module to them (as ``ddp_spawn`` does), 6 steps, maintain phases
    (a probe each) at steps 2 and 5; no epoch ends, so Lightning's own validation never runs. Run in a
    subprocess by the test below, which ends it if it hangs."""
    from tests.ddp_workers import TwoGlooProcesses

    torch.manual_seed(0)
    cycle = PulseCycle(
        burst=2, replay=0, maintain=1, order=["burst", "maintain"], warmup=0, anneal=0, probe_batches=4
    )
    kwargs = trainer_kwargs(devices=2, strategy=TwoGlooProcesses(), use_distributed_sampler=False)
    trainer = pl.Trainer(callbacks=[cycle], max_steps=6, limit_val_batches=4, **kwargs)
    trainer.fit(_LogsAMeanAndASum(directory))


@pytest.mark.ddp
def test_logged_metrics_are_over_both_ranks_uneven_probe_batches_at_every_probe(tmp_path):
    # regression sweep (pass 47): the metric states reach the ranks in memory both share; the probe updated
    # them in place there, so each rank's sum held both ranks' batches (the probe's `val_sum` was twice the
    # sum), and the copy of the states a rank put back after the probe could hold the other rank's first
    # batch: every later probe's `val_mean` was off, by a different amount on each run (0.4993 for 0.5991)
    call = f"from tests import test_probe_metrics_ddp as t; t.fit_with_uneven_shards({str(tmp_path)!r})"
    returncode, stderr = run_python_in_its_own_session(call, "the two ranks hung in the evaluation probe")
    assert returncode == 0, stderr[-3000:]
    rank0, rank1 = (json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1))
    assert rank0["figures"] == rank1["figures"]
    assert [step for step, _ in rank0["figures"]] == [2, 5]
    for step, figures in rank0["figures"]:
        losses = [loss for ran, loss in rank0["losses"] + rank1["losses"] if ran == step]
        assert len(losses) == 5  # 3 batches on rank 0, 2 on rank 1
        assert figures["val_sum"] == pytest.approx(sum(losses), abs=1e-5)
        assert figures["val_mean"] == pytest.approx(sum(losses) / len(losses), abs=1e-5)
