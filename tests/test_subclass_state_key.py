"""A user's subclass of a lightning-pulse callback keeps the lightning-pulse class's checkpoint key: a
checkpoint resumes across the base class and the subclass with the state, and a callback beside a subclass of
it is refused as a second instance of one key."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pulse import (
    EnergyLogger,
    GradientCache,
    GreenWindow,
    HardSampleReplay,
    HyperConnectionMonitor,
    MeterConfig,
    PulseCycle,
    PulseRefusal,
    ScheduledPrune,
    StabilityGuard,
)
from lightning_pulse.cli import _duplicated_callback
from tests.conftest import trainer_kwargs


class MyCycle(PulseCycle):
    """A user's subclass: one hook overridden, calling super."""

    def on_train_end(self, trainer, pl_module):
        super().on_train_end(trainer, pl_module)


class MyPrune(ScheduledPrune):
    pass


class _Net(pl.LightningModule):
    def __init__(self, callbacks=()) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
        self.given = list(callbacks)
        self.steps_run = 0

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        self.steps_run += 1
        return F.cross_entropy(self(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", F.cross_entropy(self(batch[0]), batch[1]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def configure_callbacks(self):
        return self.given


def _loader():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(512, 16, generator=generator)
    return DataLoader(
        TensorDataset(x, (x @ torch.randn(16, 4, generator=generator)).argmax(1)), batch_size=32
    )


def _fit(tmp_path, cycle_cls, prune_cls, max_steps, ckpt_path=None):
    torch.manual_seed(0)
    model = _Net()
    cycle = cycle_cls(burst=4, replay=2, maintain=2, warmup=0.0, anneal=0.0, probe_batches=1)
    prune = prune_cls(final_sparsity=0.5, mode="structured", start=2, end=30, probe_batches=1)
    trainer = pl.Trainer(
        max_steps=max_steps,
        callbacks=[cycle, prune],
        **trainer_kwargs(default_root_dir=str(tmp_path), limit_val_batches=1),
    )
    trainer.fit(model, _loader(), _loader(), ckpt_path=ckpt_path)
    return trainer, model, cycle, prune


@pytest.mark.parametrize(
    ("saved_with", "resumed_into"),
    [((PulseCycle, ScheduledPrune), (MyCycle, MyPrune)), ((MyCycle, MyPrune), (PulseCycle, ScheduledPrune))],
    ids=["base-into-subclass", "subclass-into-base"],
)
def test_a_checkpoint_resumes_across_a_lightning_pulse_class_and_a_users_subclass(
    saved_with, resumed_into, tmp_path
):
    """Held-out sweep 39 (users' callbacks): the subclass saved and loaded under its own name, so a resume
    across them dropped every state without a word; the structured ScheduledPrune then cut the already cut
    model again (8 of 32 units left for final_sparsity=0.5) and the PulseCycle restarted at cycle 0."""
    trainer, model, cycle, _ = _fit(tmp_path, *saved_with, max_steps=24)
    assert model.net[0].out_features == 16 and cycle.cycle == 3
    trainer.save_checkpoint(tmp_path / "saved.ckpt")
    assert {"PulseCycle", "ScheduledPrune"} <= set(
        torch.load(tmp_path / "saved.ckpt", weights_only=False)["callbacks"]
    )

    _, model, cycle, prune = _fit(tmp_path, *resumed_into, max_steps=40, ckpt_path=tmp_path / "saved.ckpt")
    assert model.net[0].out_features == 16  # final_sparsity=0.5 of 32 units, reached before the save
    assert (
        cycle.cycle == 5 and len(prune.events) == 4
    )  # the state went on from the save, as an unbroken run's


def test_a_checkpoint_a_subclass_saved_under_its_own_name_still_resumes_into_it(tmp_path):
    """Review, 39th pass: before the shared key, ``MyCycle`` and ``MyPrune`` saved under their own names; such
    a checkpoint must still resume into them (Lightning's load falls back to ``_legacy_state_key``, and
    ScheduledPrune's early read of the cut structure the same way), not cut the model again."""
    trainer, model, cycle, _ = _fit(tmp_path, MyCycle, MyPrune, max_steps=24)
    trainer.save_checkpoint(tmp_path / "saved.ckpt")
    checkpoint = torch.load(tmp_path / "saved.ckpt", weights_only=False)
    states = checkpoint["callbacks"]
    states["MyCycle"], states["MyPrune"] = (
        states.pop("PulseCycle"),
        states.pop("ScheduledPrune"),
    )  # the old keys
    torch.save(checkpoint, tmp_path / "old.ckpt")

    _, model, cycle, prune = _fit(tmp_path, MyCycle, MyPrune, max_steps=40, ckpt_path=tmp_path / "old.ckpt")
    assert model.net[0].out_features == 16 and cycle.cycle == 5 and len(prune.events) == 4


def _stateful_pulse_callbacks(tmp_path):
    energy = dict(report_dir=str(tmp_path), cpu="constant", gpu="none", ram="none")
    return [
        (EnergyLogger, dict(energy, meters=MeterConfig(cpu_watts=10.0))),
        (PulseCycle, {}),
        (HardSampleReplay, {}),
        (GradientCache, {}),
        (StabilityGuard, {}),
        (ScheduledPrune, dict(final_sparsity=0.5)),
        (GreenWindow, {}),
        (HyperConnectionMonitor, dict(prefix="a")),
    ]


def test_every_stateful_lightning_pulse_callback_keys_a_users_subclass_by_its_own_class(tmp_path):
    for base, kwargs in _stateful_pulse_callbacks(tmp_path):
        subclass = type(f"My{base.__name__}", (base,), {})
        assert subclass(**kwargs).state_key == base(**kwargs).state_key, base.__name__
        assert base(**kwargs).state_key.startswith(base.__qualname__)
    # a monitor's prefix stays in its key: two with distinct prefixes still coexist, subclass or not
    assert HyperConnectionMonitor(prefix="a").state_key == "HyperConnectionMonitor{'prefix': 'a'}"
    mine = type("MyMonitor", (HyperConnectionMonitor,), {})
    assert mine(prefix="b").state_key == "HyperConnectionMonitor{'prefix': 'b'}"
    assert mine(prefix="b").state_key != HyperConnectionMonitor(prefix="a").state_key


def test_a_pulse_cycle_beside_a_users_subclass_of_it_is_refused_before_the_first_step(tmp_path):
    """Held-out sweep 39: PulseCycle plus MyCycle had two keys, so both were accepted and ran two clocks;
    listeners were told changes that phase_of() did not answer."""
    kw = dict(replay=2, maintain=2, warmup=0.0, anneal=0.0, maintain_eval="none")
    # configure_callbacks' callbacks join the list after Lightning's check of the keys
    model = _Net([PulseCycle(burst=4, **kw), MyCycle(burst=5, **kw)])
    trainer = pl.Trainer(max_steps=8, **trainer_kwargs(default_root_dir=str(tmp_path)))
    with pytest.raises(PulseRefusal) as caught:
        trainer.fit(model, _loader())
    assert str(caught.value).startswith("PulseCycle: 2 callbacks share the checkpoint key 'PulseCycle' ")
    assert "Keep one PulseCycle (MyCycle and PulseCycle: a subclass saves under its lightning-pulse" in str(
        caught.value
    )
    assert model.steps_run == 0 and trainer.global_step == 0

    # given together to the Trainer, Lightning's own check of the keys refuses the pair; the CLI says why
    pair = [PulseCycle(**kw), MyCycle(**kw)]
    with pytest.raises(RuntimeError, match="more than one stateful callback of type `MyCycle`"):
        pl.Trainer(callbacks=pair, **trainer_kwargs(default_root_dir=str(tmp_path)))
    assert _duplicated_callback("MyCycle", pair) == (
        "`trainer.callbacks` holds MyCycle and PulseCycle, which a checkpoint keeps under one key "
        "'PulseCycle' (a subclass keeps its lightning-pulse class's key); a Trainer takes one of them: "
        "remove the others."
    )
