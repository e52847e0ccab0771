"""GradientCache under DDP: two gloo processes freeze the same units and stay in sync."""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, Sampler, TensorDataset

from lightning_pulse import PulseCycle
from lightning_pulse.callbacks.gradient_cache import GradientCache
from tests.conftest import trainer_kwargs
from tests.ddp_workers import TwoGlooProcesses


class RankReport(Callback):
    """Writes, per rank, what GradientCache decided and where the parameters ended up."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.trains_first_layer: list[bool] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.trains_first_layer.append(pl_module.net[1].weight.requires_grad)

    def on_train_end(self, trainer, pl_module):
        cache = next(cb for cb in trainer.callbacks if isinstance(cb, GradientCache))
        report = {
            "events": cache.events,
            "trains_first_layer": self.trains_first_layer,
            "skipped": cache.ledger.skipped,
            "params": [float(p.detach().double().sum()) for p in pl_module.parameters()],
        }
        Path(self.folder, f"rank{trainer.global_rank}.json").write_text(json.dumps(report))


@pytest.mark.ddp
def test_two_gloo_processes_freeze_the_same_units_and_keep_parameters_identical(mnist1d_small, tmp_path):
    model, data = mnist1d_small()
    cycle = PulseCycle(burst=6, replay=12, maintain=0, warmup=0.0, anneal=0.0, maintain_eval="none")
    cache = GradientCache(threshold=2.0, check_every=3, freeze_for=6)
    trainer = pl.Trainer(
        callbacks=[cycle, cache, RankReport(str(tmp_path))],
        max_steps=24,
        **trainer_kwargs(
            devices=2,
            strategy=DDPStrategy(
                find_unused_parameters=True, start_method="spawn", process_group_backend="gloo"
            ),
            accumulate_grad_batches=2,
        ),
    )
    trainer.fit(model, data)
    rank0 = json.loads((tmp_path / "rank0.json").read_text())
    rank1 = json.loads((tmp_path / "rank1.json").read_text())
    assert rank0["events"], "nothing was frozen"
    assert rank0["events"] == rank1["events"]
    assert rank0["trains_first_layer"] == rank1["trains_first_layer"]
    assert not all(rank0["trains_first_layer"]) and any(rank0["trains_first_layer"])
    assert rank0["skipped"] > 0
    # unused-parameter handling kept the replicas identical through freezes and releases
    assert torch.allclose(torch.tensor(rank0["params"]), torch.tensor(rank1["params"]), rtol=0, atol=1e-9)


class Pondering(pl.LightningModule):
    """Blocks ``a`` and ``b`` looped twice on a batch of positive mean, once otherwise (ACT-style)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.head = nn.Linear(16, 32), nn.Linear(32, 4)
        self.a, self.b = nn.Linear(32, 32), nn.Linear(32, 32)

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = torch.tanh(self.inp(x))
        for _ in range(2 if x.mean() > 0 else 1):
            h = h + torch.tanh(self.b(h + torch.tanh(self.a(h))))
        return F.cross_entropy(self.head(h), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


class RankHalf(Sampler):
    """Rank 0 the even samples, rank 1 the odd ones (read in each process, unshuffled)."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __iter__(self):
        return iter(range(torch.distributed.get_rank(), self.length, 2))

    def __len__(self) -> int:
        return self.length // 2


class FrozenReport(Callback):
    def __init__(self, folder: str) -> None:
        self.folder = folder

    def on_train_end(self, trainer, pl_module):
        cache = next(cb for cb in trainer.callbacks if isinstance(cb, GradientCache))
        report = {
            "events": cache.events,
            "frozen": cache.freezer.frozen_names,
            "params": [float(p.detach().double().sum()) for p in pl_module.parameters()],
        }
        Path(self.folder, f"rank{trainer.global_rank}.json").write_text(json.dumps(report))


@pytest.mark.ddp
def test_a_loop_counted_from_each_ranks_data_freezes_the_same_units_on_both(tmp_path):
    # review 5: each rank marked the units' inputs from its own graph: rank 0 (looping twice) saw ``a`` read
    # ``b`` and froze [inp], rank 1 (once) froze [inp, a], and the replicas drifted apart silently
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 16, generator=generator)
    x[0::2] += 1.0  # rank 0's samples: looped twice
    x[1::2] -= 1.0  # rank 1's: once
    labels = torch.randint(0, 4, (64,), generator=generator)
    data = DataLoader(TensorDataset(x, labels), batch_size=8, sampler=RankHalf(64))
    # 0.6: inp and a (57% of the parameters) fit, b no more
    cache = GradientCache(threshold=1.0, check_every=3, freeze_for=48, max_frozen_share=0.6)
    strategy = TwoGlooProcesses(find_unused_parameters=True)
    trainer = pl.Trainer(
        callbacks=[cache, FrozenReport(str(tmp_path))],
        max_steps=8,
        **trainer_kwargs(devices=2, strategy=strategy, use_distributed_sampler=False),
    )
    trainer.fit(Pondering(), data)
    rank0 = json.loads((tmp_path / "rank0.json").read_text())
    rank1 = json.loads((tmp_path / "rank1.json").read_text())
    assert rank0["frozen"] == rank1["frozen"] == ["inp"]  # rank 0's reads: the loop freezes whole or not
    assert rank0["events"] == rank1["events"]
    assert torch.allclose(torch.tensor(rank0["params"]), torch.tensor(rank1["params"]), rtol=0, atol=1e-9)


@pytest.mark.ddp
def test_a_resume_mid_freeze_under_ddp_agrees_on_the_reads_of_the_resumed_first_backward(tmp_path):
    # a review of this pass: the resumed fit's first backward runs with the restored prefix opened and marks
    # the units' reads again; rank 0's are broadcast there too (each rank loops its own number of times here)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 16, generator=generator) + 1.0
    x[1::2] -= 2.0  # rank 1's samples loop once, rank 0's twice
    labels = torch.randint(0, 4, (64,), generator=generator)

    def run(max_epochs: int, folder: Path, ckpt_path: str | None = None, save: Path | None = None) -> list:
        folder.mkdir()
        data = DataLoader(TensorDataset(x, labels), batch_size=8, sampler=RankHalf(64))
        cache = GradientCache(threshold=1.0, check_every=3, freeze_for=48, max_frozen_share=0.6)
        strategy = TwoGlooProcesses(find_unused_parameters=True)
        trainer = pl.Trainer(
            callbacks=[cache, FrozenReport(str(folder))],
            max_epochs=max_epochs,
            **trainer_kwargs(devices=2, strategy=strategy, use_distributed_sampler=False),
        )
        trainer.fit(Pondering(), data, ckpt_path=ckpt_path)
        if save is not None:
            trainer.save_checkpoint(save)
        return [json.loads((folder / f"rank{rank}.json").read_text()) for rank in (0, 1)]

    whole = run(4, tmp_path / "whole")
    half = run(2, tmp_path / "half", save=tmp_path / "half.ckpt")
    resumed = run(4, tmp_path / "resumed", ckpt_path=str(tmp_path / "half.ckpt"))
    assert half[0]["frozen"]  # saved mid-freeze
    assert resumed[0]["events"] == resumed[1]["events"] == whole[0]["events"]
    assert resumed[0]["params"] == resumed[1]["params"]
