"""The evaluation probe PulseCycle and ScheduledPrune run: the module's own ``validation_step`` outside
Lightning's loop, its logged figures aggregated as Lightning's validation epoch end aggregates them."""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

from lightning_pulse.probe import run_validation_probe
from tests.conftest import trainer_kwargs


def _validation_data() -> DataLoader:
    """19 samples in batches of 8, 8 and a short last one of 3."""
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(19, 6, generator=generator), torch.randint(0, 3, (19,), generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=8)


class _Classifier(pl.LightningModule):
    """Logs its loss (batch size inferred), its loss over the samples of class 0 (``batch_size`` given, as a
    masked or padded loss gives it) through ``log_dict``, and a torchmetrics accuracy object."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(6, 3)
        self.val_acc = MulticlassAccuracy(num_classes=3, average="micro")

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        self.log("val_loss", F.cross_entropy(logits, y))
        first = y == 0
        losses = F.cross_entropy(logits, y, reduction="none")
        first_loss = losses[first].sum() / first.sum().clamp(min=1)
        self.log_dict({"val_first_loss": first_loss}, batch_size=int(first.sum()))
        self.val_acc(logits, y)
        self.log("val_acc", self.val_acc)


def test_the_probe_weights_each_batch_by_its_size_as_lightnings_validation_does():
    """Review: the probe took the plain mean over batches, so the short last batch (3 samples) counted as
    much as a full one (8), and its figures differed from the real validation's."""
    module, loader = _Classifier(), _validation_data()
    trainer = pl.Trainer(**trainer_kwargs())
    (validated,) = trainer.validate(module, loader, verbose=False)
    probed = run_validation_probe(trainer, module, list(loader))

    with torch.no_grad():
        x, y = loader.dataset.tensors
        losses = F.cross_entropy(module.net(x), y, reduction="none")
        accuracy = (module.net(x).argmax(1) == y).double().mean().item()
    by_hand = sum(
        losses[start : start + 8].mean().item() * len(losses[start : start + 8]) for start in (0, 8, 16)
    )
    assert probed["val_loss"] == pytest.approx(by_hand / 19, rel=1e-6)
    assert probed["val_loss"] == pytest.approx(validated["val_loss"], rel=1e-5)
    # given batch_size: the samples of class 0, so the mean over every sample of class 0
    assert probed["val_first_loss"] == pytest.approx(losses[y == 0].mean().item(), rel=1e-5)
    assert probed["val_first_loss"] == pytest.approx(validated["val_first_loss"], rel=1e-5)
    # the accuracy object is computed once over every batch, as at Lightning's epoch end
    assert probed["val_acc"] == pytest.approx(accuracy, abs=1e-6)
    assert probed["val_acc"] == pytest.approx(validated["val_acc"], abs=1e-6)
    assert module.val_acc.update_count == 0  # the probe's updates were taken back


class _Reductions(pl.LightningModule):
    """Logs one loss under each of Lightning's reductions, and one value per step only (no epoch figure)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(6, 3)

    def validation_step(self, batch, batch_idx):
        x, y = batch["x"], batch["y"]
        loss = F.cross_entropy(self.net(x), y)
        self.log("val_max", loss, reduce_fx="max")
        self.log("val_sum", loss, reduce_fx="sum")
        self.log("val_min", loss, reduce_fx=torch.min)
        self.log_dict({"val_mean": loss}, reduce_fx="mean")
        self.log("val_step_only", loss, on_step=True, on_epoch=False)


def test_the_probe_reduces_each_figure_as_its_log_call_asks():
    """Review 19: every figure was a weighted mean, so one logged with ``reduce_fx="max"`` or ``"sum"`` read
    differently from the real validation (1.35 against 1.56 and 3.77); a value with no epoch figure came back
    too."""
    generator = torch.Generator().manual_seed(1)
    samples = [
        {"x": torch.randn(6, generator=generator), "y": torch.tensor(i % 3), "pad": torch.zeros(4)}
        for i in range(19)
    ]
    loader = DataLoader(samples, batch_size=8)
    module = _Reductions()
    trainer = pl.Trainer(**trainer_kwargs())
    (validated,) = trainer.validate(module, loader, verbose=False)
    probed = run_validation_probe(trainer, module, list(loader))
    assert set(probed) == {"val_max", "val_sum", "val_min", "val_mean"}  # no epoch figure: left out
    for name in probed:
        assert probed[name] == pytest.approx(validated[name], rel=1e-5), name
    assert probed["val_max"] > probed["val_mean"] > probed["val_min"]  # non-vacuous: the figures differ


class _ProbeDump(Callback):
    """After validation, runs the probe on this rank's validation batches and writes what it returned and
    every sample's loss and label to ``<directory>/rank<r>.json``."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def on_validation_end(self, trainer, pl_module):
        batches = list(trainer.val_dataloaders)
        probed = run_validation_probe(trainer, pl_module, batches)
        with torch.no_grad():
            x, y = (torch.cat(parts) for parts in zip(*batches))
            losses = F.cross_entropy(pl_module.net(x), y, reduction="none")
        dump = {"probed": probed, "losses": losses.tolist(), "labels": y.tolist()}
        Path(self.directory, f"rank{trainer.global_rank}.json").write_text(json.dumps(dump))


@pytest.mark.ddp
def test_under_ddp_the_probe_weights_every_ranks_batches_by_their_sizes(tmp_path):
    """Each rank's shard of the 19 samples is 10 (8 and a short 2); the class-0 samples, the batch size the
    module gives one figure, differ in number between ranks. The probe averaged each rank's mean of batch
    means; it is the mean over every rank's samples, as ``sync_dist=True`` makes Lightning's."""
    kwargs = trainer_kwargs(devices=2, strategy="ddp_spawn")
    trainer = pl.Trainer(callbacks=[_ProbeDump(str(tmp_path))], **kwargs)
    trainer.validate(_Classifier(), _validation_data(), verbose=False)
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert ranks[0]["probed"] == ranks[1]["probed"]
    losses = torch.tensor(ranks[0]["losses"] + ranks[1]["losses"], dtype=torch.float64)
    labels = torch.tensor(ranks[0]["labels"] + ranks[1]["labels"])
    first_per_rank = [labels[:10].eq(0).sum().item(), labels[10:].eq(0).sum().item()]
    assert len(losses) == 20 and first_per_rank[0] != first_per_rank[1]  # non-vacuous: unequal weights
    assert ranks[0]["probed"]["val_loss"] == pytest.approx(losses.mean().item(), rel=1e-5)
    assert ranks[0]["probed"]["val_first_loss"] == pytest.approx(losses[labels == 0].mean().item(), rel=1e-5)
