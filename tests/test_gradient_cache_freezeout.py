"""GradientCache's FreezeOut schedule: per-unit cosine LR annealing, then a permanent freeze (real MNIST-1D fits)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader

from examples.mnist1d.models import build_mnist1d_network
from lightning_pulse.callbacks.gradient_cache import GradientCache
from lightning_pulse.core.gradient_cache import freezeout_factor, freezeout_points
from tests.conftest import stop_after_epochs, trainer_kwargs

# the CNN's units in forward order; max_frozen_share 0.9 lets the first three freeze (the head always trains)
UNITS = ["net.1", "net.3", "net.5", "net.8"]
LINEAR = dict(schedule="freezeout", t0=0.5, scaling="linear")


class TrainsFirstLayers(Callback):
    """Per training batch: the optimizer step and which of the three freezable conv layers require grad."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, tuple[bool, ...]]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        flags = tuple(pl_module.get_submodule(name).weight.requires_grad for name in UNITS[:3])
        self.rows.append((trainer.global_step, flags))


def test_points_and_factor_follow_the_paper():
    # linear: evenly from t0; cubic: (t0 + (1 - t0) i / m) ** 3, so t0 = 0.5 stops the first unit at 1/8
    assert freezeout_points(3, 0.4, "linear") == pytest.approx([0.4, 0.6, 0.8])
    assert freezeout_points(2, 0.5, "cubic") == pytest.approx([0.125, 0.75**3])
    assert freezeout_points(2, 0.5, "squared") == pytest.approx([0.25, 0.75**2])
    assert freezeout_factor(5, 10, 30) == 1.0
    assert freezeout_factor(20, 10, 30) == pytest.approx(0.5)
    assert freezeout_factor(15, 10, 30) == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))
    assert freezeout_factor(30, 10, 30) == 0.0


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"schedule": "egeria"}, "schedule"),
        ({"t0": 0.0}, "t0"),
        ({"t0": 1.0}, "t0"),
        ({"t0": True}, "t0"),
        ({"scaling": "quartic"}, "scaling"),
        ({"scale_lr": 1}, "scale_lr"),
        ({"schedule": "freezeout", "mode": "stale_replay"}, "mode"),
        ({"schedule": "freezeout", "frozen_update": "cached"}, "frozen_update"),
        ({"schedule": "freezeout", "release_at": 0.9}, "release_at"),
    ],
)
def test_invalid_freezeout_arguments_fail_at_construction(kwargs, field):
    with pytest.raises(ValueError, match=f"`{field}`"):
        GradientCache(**kwargs)


class PerUnitAdamW(pl.LightningModule):
    """The MNIST-1D CNN trained by AdamW; ``per_unit_lr`` gives each unit its own group with FreezeOut's factor
    as a LambdaLR, the reference that GradientCache's update scaling must reproduce."""

    def __init__(self, per_unit_lr: list[float] | None = None, scale_lr: bool = False) -> None:
        super().__init__()
        self.net = build_mnist1d_network("cnn")
        self.per_unit_lr = per_unit_lr
        self.scale_lr = scale_lr

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        if self.per_unit_lr is None:
            return torch.optim.AdamW(self.net.parameters(), lr=1e-2, weight_decay=0.1)
        groups = [{"params": list(self.get_submodule(name).parameters())} for name in UNITS]
        optimizer = torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1)
        stops = self.per_unit_lr + [math.inf]
        # FreezeOut's LR scaling over a 60-step run: a unit stopping at step s starts at 60 / s of the LR
        scales = [60.0 / stop if self.scale_lr and stop < math.inf else 1.0 for stop in stops]
        lambdas = [
            lambda step, stop=stop, scale=scale: scale * freezeout_factor(step, 0.0, stop)
            for stop, scale in zip(stops, scales)
        ]
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambdas)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _fit_adamw(mnist1d_small, callbacks, per_unit_lr=None, scale_lr=False, **overrides):
    pl.seed_everything(3)
    model = PerUnitAdamW(per_unit_lr, scale_lr)
    _, data = mnist1d_small()
    trainer = pl.Trainer(
        callbacks=callbacks, **trainer_kwargs(max_steps=60, limit_val_batches=0, **overrides)
    )
    trainer.fit(model, data)
    return model


@pytest.mark.parametrize("scale_lr", [False, True])
def test_freezeout_equals_per_unit_adamw_learning_rates_and_freezes_at_the_scheduled_steps(
    mnist1d_small, scale_lr
):
    cache, watch = GradientCache(**LINEAR, scale_lr=scale_lr), TrainsFirstLayers()
    model = _fit_adamw(mnist1d_small, [cache, watch])
    # t0 0.5 linear over 60 steps: the three freezable units stop at 30, 40 and 50, for good
    assert [round(stop) for stop in cache.freeze_steps] == [30, 40, 50]
    assert [(e["step"], e["to"], e["reason"]) for e in cache.events] == [
        (30, 1, "freezeout"),
        (40, 2, "freezeout"),
        (50, 3, "freezeout"),
    ]
    for step, flags in watch.rows:
        assert flags == tuple(step < stop for stop in (30, 40, 50)), step
    assert cache.ledger.skipped > 0
    # the same run with per-unit parameter groups whose learning rates follow the factors (AdamW: decoupled
    # weight decay scales with the learning rate too, so only scaling the whole update matches)
    reference = _fit_adamw(mnist1d_small, [], per_unit_lr=[30.0, 40.0, 50.0], scale_lr=scale_lr)
    plain = _fit_adamw(mnist1d_small, [])
    for (name, param), other, unannealed in zip(
        model.net.named_parameters(), reference.net.parameters(), plain.net.parameters()
    ):
        assert torch.allclose(param, other, rtol=0, atol=2e-5), name
        assert not torch.allclose(param, unannealed, rtol=0, atol=1e-3), name


def test_freezeout_with_accumulation_and_bf16_freezes_only_between_optimizer_steps(mnist1d_small):
    cache, watch = GradientCache(**LINEAR, start_at=0.5), TrainsFirstLayers()
    model, data = mnist1d_small()
    trainer = pl.Trainer(
        callbacks=[cache, watch],
        **trainer_kwargs(max_steps=40, accumulate_grad_batches=2, precision="bf16-mixed"),
    )
    trainer.fit(model, data)
    # annealing starts at step 20 of 40: the units stop at 20 + 20 * (0.5, 2/3, 5/6)
    assert [e["step"] for e in cache.events] == [30, 34, 37]
    assert len(watch.rows) == 80
    by_step: dict[int, set[tuple[bool, ...]]] = {}
    for step, flags in watch.rows:
        by_step.setdefault(step, set()).add(flags)
    assert all(len(states) == 1 for states in by_step.values())
    assert all(p.requires_grad for p in model.parameters())


def test_resume_mid_anneal_reproduces_the_uninterrupted_run(mnist1d_small, tmp_path):
    def run(max_epochs: int, ckpt_path: str | None = None, save: Path | None = None):
        pl.seed_everything(11)
        model, data = mnist1d_small()
        data.setup("fit")
        loader = DataLoader(data.train_set, batch_size=64, shuffle=False)
        cache = GradientCache(schedule="freezeout", t0=0.6, scaling="squared")
        callbacks = [cache] + ([stop_after_epochs(max_epochs)] if max_epochs < 6 else [])
        trainer = pl.Trainer(callbacks=callbacks, max_epochs=6, limit_train_batches=9, **trainer_kwargs())
        trainer.fit(model, train_dataloaders=loader, ckpt_path=ckpt_path)
        if save is not None:
            trainer.save_checkpoint(save)
        return model, cache

    whole_model, whole_cache = run(max_epochs=6)
    # 54 steps: stops at 54 * (0.36, 0.5378, 0.7511) = 19.4, 29.0, 40.6
    assert [e["step"] for e in whole_cache.events] == [20, 30, 41]
    checkpoint = tmp_path / "half.ckpt"
    _, half_cache = run(max_epochs=3, save=checkpoint)
    assert [e["step"] for e in half_cache.events] == [20], "the checkpoint must fall between two freezes"
    resumed_model, resumed_cache = run(max_epochs=6, ckpt_path=str(checkpoint))
    assert resumed_cache.events == whole_cache.events
    assert resumed_cache.ledger.skipped == whole_cache.ledger.skipped
    for name, param in whole_model.named_parameters():
        assert torch.equal(param, dict(resumed_model.named_parameters())[name]), name


class RankParams(Callback):
    def __init__(self, folder: str) -> None:
        self.folder = folder

    def on_train_end(self, trainer, pl_module):
        cache = next(cb for cb in trainer.callbacks if isinstance(cb, GradientCache))
        report = {"events": cache.events, "params": [float(p.double().sum()) for p in pl_module.parameters()]}
        Path(self.folder, f"rank{trainer.global_rank}.json").write_text(json.dumps(report))


@pytest.mark.ddp
def test_two_gloo_processes_anneal_and_freeze_alike(mnist1d_small, tmp_path):
    model, data = mnist1d_small()
    trainer = pl.Trainer(
        callbacks=[GradientCache(**LINEAR), RankParams(str(tmp_path))],
        max_steps=20,
        **trainer_kwargs(
            devices=2,
            strategy=DDPStrategy(
                find_unused_parameters=True, start_method="spawn", process_group_backend="gloo"
            ),
        ),
    )
    trainer.fit(model, data)
    rank0 = json.loads((tmp_path / "rank0.json").read_text())
    rank1 = json.loads((tmp_path / "rank1.json").read_text())
    assert [e["step"] for e in rank0["events"]] == [10, 14, 17]
    assert rank0["events"] == rank1["events"]
    assert torch.allclose(torch.tensor(rank0["params"]), torch.tensor(rank1["params"]), rtol=0, atol=1e-9)
