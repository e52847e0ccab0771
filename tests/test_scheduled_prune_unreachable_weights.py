"""ScheduledPrune on layers a mask cannot reach: a hypernetwork whose forward calls its target network with
generated weights (``torch.func.functional_call``: the target's own weights are never read, and a mask hook
overwrote the generated ones), and a model holding a ``torch.jit.script``'ed part (a raw ``AttributeError``
at fit start)."""

from __future__ import annotations

import copy
import logging

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.func import functional_call
from torch.utils.data import DataLoader, TensorDataset

from lightning_pulse import ScheduledPrune
from lightning_pulse.core import pruning
from lightning_pulse.errors import PulseRefusal
from tests.conftest import trainer_kwargs


def _data(samples: int = 256) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 16, generator=generator)
    y = (x[:, :4].argmax(dim=1) + (x[:, 4] > 0).long()) % 4
    return DataLoader(TensorDataset(x, y), batch_size=32)


class _Classifier(pl.LightningModule):
    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=3e-3)


class _Hyper(_Classifier):
    """``forward`` runs ``target`` with weights the ``hyper`` network makes: ``target``'s own are unused."""

    def __init__(self) -> None:
        super().__init__()
        self.target = nn.Sequential(nn.Linear(16, 12), nn.ReLU(), nn.Linear(12, 4))
        self.shapes = {name: p.shape for name, p in self.target.named_parameters()}
        self.z = nn.Parameter(torch.randn(8))
        total = sum(shape.numel() for shape in self.shapes.values())
        self.hyper = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, total))

    def generated(self) -> dict[str, torch.Tensor]:
        chunks = (self.hyper(self.z) * 0.1).split([shape.numel() for shape in self.shapes.values()])
        return {name: chunk.view(shape) for (name, shape), chunk in zip(self.shapes.items(), chunks)}

    def forward(self, x):
        return functional_call(self.target, self.generated(), (x,))

    @torch.no_grad()
    def by_hand(self, x):
        g = self.generated()
        return F.linear(torch.relu(F.linear(x, g["0.weight"], g["0.bias"])), g["2.weight"], g["2.bias"])


class _UsesGenerated(Callback):
    """At each batch start: whether the module's forward computes with the generated weights."""

    def __init__(self) -> None:
        self.seen: list[bool] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        with torch.no_grad():
            self.seen.append(torch.allclose(pl_module(batch[0]), pl_module.by_hand(batch[0]), atol=1e-6))


def _prune(**kwargs) -> ScheduledPrune:
    return ScheduledPrune(final_sparsity=0.5, start=4, end=12, every=2, probe_batches=0, **kwargs)


def _masked(module: nn.Module) -> set[str]:
    return set(pruning.masked_layer_names(module))


def test_a_hypernetworks_target_layers_are_left_out_and_the_generated_weights_stay_in_use(caplog):
    pl.seed_everything(0)
    model, uses, prune = _Hyper(), _UsesGenerated(), _prune()
    with caplog.at_level(logging.INFO):
        pl.Trainer(max_steps=16, callbacks=[uses, prune], **trainer_kwargs()).fit(model, _data())
    # every step's forward computed with the generated weights, the events' steps and those after included
    assert uses.seen == [True] * 16
    # the hypernetwork's own layers were pruned; the target's, whose weights are never read, were not
    assert set(prune.events[-1]["layer_sparsity"]) == {"hyper.0", "hyper.2"}
    assert prune.events[-1]["sparsity"] == pytest.approx(0.5, abs=0.01)
    assert not any(name.startswith("target") for name in _masked(model))
    x = next(iter(_data()))[0]
    assert torch.allclose(model(x), model.by_hand(x), atol=1e-6)
    said = " ".join(record.getMessage() for record in caplog.records)
    assert "left out from the first event on: target.0, target.2" in said


def test_a_hypernetwork_with_only_its_target_to_prune_is_refused_after_the_first_step_before_any_mask():
    pl.seed_everything(0)
    model = _Hyper()
    trainer = pl.Trainer(max_steps=16, callbacks=[_prune(exclude_pattern="hyper")], **trainer_kwargs())
    with pytest.raises(PulseRefusal, match=r"target\.0, target\.2 read a `weight` passed in") as caught:
        trainer.fit(model, _data())
    assert "exclude_pattern" in str(caught.value)
    assert trainer.global_step == 1  # decided after the first step's forwards, not at the first event
    assert _masked(model) == set()  # refused before the first mask


class _Plain(_Classifier):
    """An ordinary model with a layer called on some batches only and a copy of itself run as a teacher."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU())
        self.sometimes = nn.Linear(32, 32)
        self.head = nn.Linear(32, 4)
        self.calls = 0

    def forward(self, x):
        h = self.body(x)
        self.calls += 1
        return self.head(self.sometimes(h) if self.calls % 3 == 0 else h)

    def training_step(self, batch, batch_idx):
        if self.global_step == 0:  # a deep copy carries the layers' hooks: its calls are not the layers'
            teacher = copy.deepcopy(self)
            with torch.no_grad():
                teacher.body[0].weight.mul_(0.5)
                teacher(batch[0])
        return super().training_step(batch, batch_idx)


def test_an_ordinary_model_keeps_every_layer_a_deep_copy_and_a_layer_seldom_called_included():
    pl.seed_everything(0)
    model, prune = _Plain(), _prune()
    pl.Trainer(max_steps=16, callbacks=[prune], **trainer_kwargs()).fit(model, _data())
    assert set(prune.events[-1]["layer_sparsity"]) == {"body.0", "body.2", "sometimes", "head"}
    assert prune.pruner.not_trained == {}


class _Encoder(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.fc = nn.Linear(width, 24)

    def forward(self, x):
        return torch.relu(self.fc(x))


class _WithScripted(_Classifier):
    def __init__(self, eager_first: bool = False) -> None:
        super().__init__()
        self.pre = nn.Linear(16, 16) if eager_first else nn.Identity()
        self.enc = torch.jit.script(_Encoder())
        self.mid, self.head = nn.Linear(24, 24), nn.Linear(24, 4)

    def forward(self, x):
        return self.head(torch.relu(self.mid(self.enc(self.pre(x)))))


@pytest.mark.parametrize(
    "mode, exclude", [("unstructured", None), ("structured", None), ("unstructured", "enc")]
)
def test_a_scripted_part_is_left_out_and_named_and_the_eager_layers_are_pruned(mode, exclude, caplog):
    pl.seed_everything(0)
    model = _WithScripted()
    prune = _prune(mode=mode, exclude_pattern=exclude)
    with caplog.at_level(logging.INFO):
        pl.Trainer(max_steps=16, callbacks=[prune], **trainer_kwargs()).fit(model, _data())
    assert prune.finished
    assert set(prune.events[-1]["layer_sparsity"]) <= {"mid", "head"}
    assert prune.events[-1]["layer_sparsity"]["mid"] == pytest.approx(0.5, abs=0.05)
    said = " ".join(record.getMessage() for record in caplog.records)
    assert ("enc.fc (inside a torch.jit.script'ed part" in said) == (exclude is None)
    x = next(iter(_data()))[0]
    assert model(x).shape == (32, 4)


def test_structured_with_an_eager_layer_feeding_a_scripted_part_is_refused():
    """Cutting ``pre``'s output channels would have to cut the scripted layer's input, which the trace
    cannot see into: the run is refused at fit start, naming the scripted part."""
    pl.seed_everything(0)
    model = _WithScripted(eager_first=True)
    prune = _prune(mode="structured")
    with pytest.raises(PulseRefusal) as caught:
        pl.Trainer(max_steps=16, callbacks=[prune], **trainer_kwargs()).fit(model, _data())
    assert "ScheduledPrune" in str(caught.value) and "enc" in str(caught.value)


class _DetachedTarget(_Classifier):
    """A stop-gradient consistency term: the net is also called through ``functional_call`` with its own
    weights detached (aliases of its parameters), as per-sample-gradient code does through ``vmap``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        detached = {name: value.detach() for name, value in self.net.named_parameters()}
        target = functional_call(self.net, detached, (batch[0],)).softmax(-1)
        logits = self(batch[0])
        return F.cross_entropy(logits, batch[1]) + F.mse_loss(logits.softmax(-1), target)


def test_a_call_with_the_layers_own_weights_detached_is_not_a_substitution():
    """A review: a detached alias of the layer's own weight was taken for a weight passed in, and a healthy
    model was refused ("no layer can be pruned")."""
    pl.seed_everything(0)
    model, prune = _DetachedTarget(), _prune()
    pl.Trainer(max_steps=16, callbacks=[prune], **trainer_kwargs()).fit(model, _data())
    assert prune.events and prune.events[-1]["sparsity"] == pytest.approx(0.5, abs=0.01)
    assert set(prune.events[-1]["layer_sparsity"]) == {"net.0", "net.2"}


def test_the_watch_does_not_recompile_a_compiled_model():
    """A review: the watch counted calls in its hooks, and dynamo guarded on the count: one recompile per step
    up to the recompile limit, after which the model ran uncompiled."""
    from torch._dynamo.utils import counters

    class Compiled(_Classifier):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.compile(
                nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)), backend="eager"
            )

        def forward(self, x):
            return self.net(x)

    torch._dynamo.reset()
    counters.clear()
    pl.seed_everything(0)
    prune = ScheduledPrune(final_sparsity=0.5, start=8, end=9, every=1, probe_batches=0)
    pl.Trainer(max_steps=9, callbacks=[prune], **trainer_kwargs()).fit(Compiled(), _data())
    assert counters["stats"]["unique_graphs"] <= 3  # the first compile, and one after the watch came off
