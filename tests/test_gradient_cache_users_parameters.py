"""GradientCache and what the user's model does to its own parameters during the fit: a backbone frozen after
GradientCache's ``on_train_start``, parameters a forward re-creates. Real Trainer fits and the core
beneath."""

from __future__ import annotations

import logging
import re
import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from examples.mnist1d import MNIST1DClassifier
from lightning_pulse.callbacks.gradient_cache import GradientCache
from lightning_pulse.core.freeze_units import discover_units, record_gradient_order
from lightning_pulse.core.layer_freezing import FreezerLifecycle, FreezeSettings, LayerFreezer
from tests.conftest import trainer_kwargs

EAGER = dict(threshold=2.0, check_every=5, freeze_for=20)
BACKBONE = (1, 3)  # the MNIST-1D CNN's first two convolutions


class BackboneFrozen(MNIST1DClassifier):
    """The first two convolutions frozen at ``when``: in ``__init__`` (before the fit), in the module's
    ``on_train_start`` or in its first ``on_train_epoch_start`` ("head only in the first epoch"), or by a
    callback's ``on_train_start`` (the docs' advice under DDP); trained again from epoch 1 on."""

    def __init__(self, when: str) -> None:
        super().__init__(arch="cnn")
        self.when = when
        if when == "init":
            self.freeze_backbone(False)

    def freeze_backbone(self, trains: bool) -> None:
        for index in BACKBONE:
            self.net[index].requires_grad_(trains)

    def on_train_start(self) -> None:
        if self.when == "module.on_train_start":
            self.freeze_backbone(False)

    def on_train_epoch_start(self) -> None:
        if self.current_epoch == 0 and self.when == "module.on_train_epoch_start":
            self.freeze_backbone(False)
        if self.current_epoch == 1:
            self.freeze_backbone(True)


class FreezeBackboneOnTrainStart(Callback):
    def on_train_start(self, trainer, pl_module):
        pl_module.freeze_backbone(False)


def _fit_backbone_frozen(
    mnist1d_small, when: str
) -> tuple[GradientCache, BackboneFrozen, list[torch.Tensor]]:
    pl.seed_everything(0)
    _, data = mnist1d_small()
    model, cache = BackboneFrozen(when), GradientCache(**EAGER)
    backbone = [model.net[index].weight.detach().clone() for index in BACKBONE]
    callbacks = [cache, FreezeBackboneOnTrainStart()] if when == "callback.on_train_start" else [cache]
    trainer = pl.Trainer(callbacks=callbacks, **trainer_kwargs(max_epochs=2, limit_val_batches=0))
    trainer.fit(model, data)
    assert trainer.global_step == 2 * trainer.num_training_batches
    return cache, model, backbone


@pytest.mark.parametrize(
    "when", ["callback.on_train_start", "module.on_train_start", "module.on_train_epoch_start"]
)
def test_a_backbone_frozen_after_gradient_caches_train_start_counts_as_frozen_before_the_fit(
    mnist1d_small, when
):
    # held-out: each of these crashed the first backward ("cannot register a hook on a tensor that doesn't
    # require gradient"), the units having been found at GradientCache's on_train_start, the backbone in them;
    # the docs' advice under DDP (freeze in a callback's on_train_start) led there with the callback after it
    reference, reference_model, _ = _fit_backbone_frozen(mnist1d_small, "init")
    cache, model, backbone = _fit_backbone_frozen(mnist1d_small, when)
    # the same as a backbone frozen in __init__: left out of the units, unchanged while frozen, and taken into
    # them once it trains again at epoch 1 (a retrace), bit for bit
    assert cache.events == reference.events and any(e["reason"] == "retrace" for e in cache.events)
    assert [unit.name for unit in cache.freezer.units] == ["net.1", "net.3", "net.5", "net.8"]
    for param, other in zip(model.parameters(), reference_model.parameters()):
        assert torch.equal(param, other)
    assert not all(torch.equal(model.net[i].weight, w) for i, w in zip(BACKBONE, backbone))  # trained at 1
    assert all(p.requires_grad for p in model.parameters())


def test_a_unit_frozen_before_the_ordering_backward_is_left_out_of_the_units():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    lifecycle = FreezerLifecycle(FreezeSettings(check_every=2))
    lifecycle.start(None, model)
    assert [unit.name for unit in lifecycle.units] == ["0", "2", "4"]
    model[0].requires_grad_(False)  # after the units were found, before their first backward
    loss = model(torch.randn(4, 8)).pow(2).mean()
    lifecycle.begin_backward(loss)
    loss.backward()
    assert lifecycle.end_backward()
    assert [unit.name for unit in lifecycle.freezer.units] == ["2", "4"]
    assert lifecycle.freezer.outside == [model[0].weight, model[0].bias]  # watched, as if frozen before


def test_recording_the_gradient_order_skips_a_parameter_that_requires_no_gradient():
    first, second = nn.Linear(3, 3), nn.Linear(3, 1)
    first.requires_grad_(False)
    params = {"first.weight": first.weight, "second.weight": second.weight}
    with record_gradient_order(params) as order:
        second(first(torch.randn(2, 3))).sum().backward()
    assert order == ["second.weight"]


class ReCreatingVectorQuantizer(nn.Module):
    """A VQ-VAE codebook kept by exponential moving averages, written as the widely copied PyTorch port of
    Sonnet's VQ-VAE does it: the running sums and the codebook are ``nn.Parameter`` objects that the forward
    replaces by new ones (no optimizer holds them, no gradient reaches them). ``as_buffers``: the same values
    kept in buffers updated in place."""

    def __init__(self, codes: int = 16, dim: int = 8, decay: float = 0.9, as_buffers: bool = False) -> None:
        super().__init__()
        self.decay, self.as_buffers = decay, as_buffers
        codebook, sums = torch.randn(codes, dim), torch.randn(codes, dim)
        self.register_buffer("cluster_size", torch.ones(codes))
        if as_buffers:
            self.register_buffer("codebook", codebook)
            self.register_buffer("sums", sums)
        else:
            self.codebook = nn.Parameter(codebook)
            self.sums = nn.Parameter(sums)

    def forward(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        codebook = self.codebook.detach()
        index = torch.cdist(z.detach(), codebook).argmin(1)
        quantized = codebook[index]
        if self.training:
            onehot = F.one_hot(index, len(codebook)).to(z.dtype)
            cluster_size = self.cluster_size * self.decay + (1 - self.decay) * onehot.sum(0)
            sums = self.sums.detach() * self.decay + (1 - self.decay) * (onehot.t() @ z.detach())
            new_codebook = sums / (cluster_size + 1e-5).unsqueeze(1)
            self.cluster_size = cluster_size
            if self.as_buffers:
                self.sums.copy_(sums)
                self.codebook.copy_(new_codebook)
            else:
                self.sums = nn.Parameter(sums)
                self.codebook = nn.Parameter(new_codebook)
        commitment = F.mse_loss(z, quantized)
        return z + (quantized - z).detach(), commitment


class VQAutoencoder(pl.LightningModule):
    def __init__(self, as_buffers: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
        self.quantizer = ReCreatingVectorQuantizer(as_buffers=as_buffers)
        self.decoder = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16))

    def training_step(self, batch, batch_idx):
        quantized, commitment = self.quantizer(self.encoder(batch[0]))
        return F.mse_loss(self.decoder(quantized), batch[0]) + 0.25 * commitment

    def configure_optimizers(self):
        trained = [p for name, p in self.named_parameters() if not name.startswith("quantizer.")]
        return torch.optim.Adam(trained, lr=3e-3)


def _fit_vq(as_buffers: bool, caplog) -> tuple[GradientCache, VQAutoencoder, list[str]]:
    pl.seed_everything(0)
    x = torch.randn(320, 16, generator=torch.Generator().manual_seed(0))
    model = VQAutoencoder(as_buffers)
    cache = GradientCache(
        threshold=1.0, check_every=5, freeze_for=10, max_frozen_share=1.0, phases=["replay"]
    )
    caplog.clear()
    with caplog.at_level(logging.INFO):
        trainer = pl.Trainer(callbacks=[cache], **trainer_kwargs(max_steps=60))
        trainer.fit(model, DataLoader(TensorDataset(x), batch_size=32))
    return cache, model, [record.getMessage() for record in caplog.records]


def test_parameters_a_forward_re_creates_without_gradient_or_optimizer_do_not_stop_freezing(caplog):
    # held-out: each re-created parameter was taken for one that started training, so every window's end
    # released every unit and started the windows over (12 such lines in 60 steps), and nothing ever froze
    reference, reference_model, _ = _fit_vq(as_buffers=True, caplog=caplog)
    cache, model, messages = _fit_vq(as_buffers=False, caplog=caplog)
    assert not any("started training" in message for message in messages)
    assert any(event["to"] > event["from"] for event in reference.events)
    assert cache.events == reference.events  # frozen exactly as the same model with buffers
    for name in ("encoder.0.weight", "decoder.2.weight"):
        assert torch.equal(model.get_parameter(name), reference_model.get_parameter(name))


def test_a_parameter_outside_the_units_trains_once_it_has_a_gradient_or_an_optimizer_holds_it():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    model[0].requires_grad_(False)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    units = discover_units(model)
    outside = [model[0].weight, model[0].bias]
    freezer = LayerFreezer(units, FreezeSettings(), outside, optimizers=[optimizer])
    model[0].requires_grad_(True)
    assert not freezer.check_outside()  # requires grad, but nothing can move it
    model[0].weight.grad = torch.zeros_like(model[0].weight)
    assert freezer.check_outside() and freezer.outgrown  # a gradient reached it
    again = LayerFreezer(units, FreezeSettings(), outside, optimizers=[optimizer])
    model[0].weight.grad = None
    optimizer.add_param_group({"params": outside})  # BackboneFinetuning's way: the optimizer takes it
    assert again.check_outside()
    # a freezer not told the optimizers counts every parameter that requires grad, as before
    assert LayerFreezer(units, FreezeSettings(), outside).check_outside()


class _UnfrozenWithANewOptimizer(MNIST1DClassifier):
    """A CNN whose backbone (``net.1``, ``net.3``) is frozen in ``__init__`` and, at epoch 1's start, unfrozen
    together with a new optimizer that holds only trainable parameters (``setup_optimizers`` again)."""

    def __init__(self) -> None:
        super().__init__(arch="cnn")
        for index in (1, 3):
            self.net[index].requires_grad_(False)

    def configure_optimizers(self):
        return torch.optim.Adam([p for p in self.parameters() if p.requires_grad], lr=1e-3)

    def on_train_epoch_start(self):
        if self.current_epoch == 1:
            for index in (1, 3):
                self.net[index].requires_grad_(True)
            self.trainer.strategy.setup_optimizers(self.trainer)


def test_a_backbone_unfrozen_with_a_new_optimizer_at_an_epochs_start_is_followed_at_that_epochs_first_batch(
    mnist1d_small,
):
    # a review of this pass: the freezer looked only in the optimizers of the fit's start, so a backbone the
    # new optimizer held was taken for one no optimizer holds, and noticed at the next window's end (step 15)
    # after it had trained two steps while a unit after it stayed frozen
    _, data = mnist1d_small()
    pl.seed_everything(0)
    cache = GradientCache(threshold=2.0, check_every=5, freeze_for=20)
    trainer = pl.Trainer(callbacks=[cache], **trainer_kwargs(max_epochs=2, limit_val_batches=0))
    trainer.fit(_UnfrozenWithANewOptimizer(), data)
    retraces = [event["step"] for event in cache.events if event["reason"] == "retrace"]
    assert retraces and retraces[0] == 12  # epoch 1's first batch (12 batches an epoch)


class RawMLP(nn.Module):
    """A layer of the user's own: its parameters held as its attributes, no children."""

    def __init__(self, *weights: torch.Tensor) -> None:
        super().__init__()
        self.w1, self.b1, self.w2, self.w3 = map(nn.Parameter, weights)

    def forward(self, x):
        return F.relu(F.relu(x @ self.w1 + self.b1) @ self.w2) @ self.w3


class RawParameters(pl.LightningModule):
    """An MLP written with matmuls over one ``nn.ParameterDict`` or ``nn.ParameterList``: the automatic split
    keeps the container whole, so it is the model's single unit."""

    def __init__(self, container: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        w1, b1, w2, w3 = (
            torch.randn(16, 32) / 4,
            torch.zeros(32),
            torch.randn(32, 32) / 6,
            torch.randn(32, 4) / 6,
        )
        if container == "dict":
            self.p = nn.ParameterDict(
                {name: nn.Parameter(t) for name, t in zip(("w1", "b1", "w2", "w3"), (w1, b1, w2, w3))}
            )
            self.order = ["p.w1", "p.b1", "p.w2", "p.w3"]
        elif container == "list":
            self.p = nn.ParameterList([nn.Parameter(w1), nn.Parameter(w2), nn.Parameter(w3)])
            self.order = ["p.0", "p.1", "p.2"]
        else:
            self.p = RawMLP(w1, b1, w2, w3)
            self.order = ["p.w1", "p.b1", "p.w2", "p.w3"]

    def forward(self, x):
        p = self.p
        if isinstance(p, nn.ParameterDict):
            return F.relu(F.relu(x @ p["w1"] + p["b1"]) @ p["w2"]) @ p["w3"]
        if isinstance(p, nn.ParameterList):
            return F.relu(F.relu(x @ p[0]) @ p[1]) @ p[2]
        return p(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


class FrozenSets(Callback):
    """The names of the parameters that do not train, at each batch where they change."""

    def __init__(self) -> None:
        self.sets: list[list[str]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        frozen = [name for name, param in pl_module.named_parameters() if not param.requires_grad]
        if not self.sets or self.sets[-1] != frozen:
            self.sets.append(frozen)


def _fit_raw(container: str, **options) -> tuple[GradientCache, FrozenSets]:
    x = torch.randn(128, 16, generator=torch.Generator().manual_seed(0))
    cache, frozen = GradientCache(**EAGER, **options), FrozenSets()
    trainer = pl.Trainer(callbacks=[cache, frozen], **trainer_kwargs(max_steps=40))
    trainer.fit(RawParameters(container), DataLoader(TensorDataset(x, x[:, :4].argmax(1)), batch_size=16))
    return cache, frozen


@pytest.mark.parametrize("container", ["dict", "list", "module"])
def test_a_model_whose_weights_sit_in_one_parameter_container_is_told_the_units_that_freeze_them(container):
    # sweep: the container was the model's single unit, and fit start said only (info) "the model has a single
    # trainable unit, so nothing can be frozen": no freeze in the whole run, and no way out named
    with pytest.warns(
        UserWarning, match=r"single trainable unit, so nothing can be frozen: `p` holds"
    ) as said:
        cache, frozen = _fit_raw(container)
    assert frozen.sets == [[]] and not cache.events
    (message,) = [str(w.message) for w in said if "single trainable unit" in str(w.message)]
    kind = {
        "dict": "an nn.ParameterDict",
        "list": "an nn.ParameterList",
        "module": "a RawMLP without children",
    }
    assert f"in {kind[container]}, which the automatic split keeps whole" in message
    assert message.endswith("(each name is its own unit; any order).")
    units = eval(re.search(r"units=(\[[^]]*\])", message).group(1))
    assert sorted(units) == sorted(RawParameters(container).order)
    # the way out: the units named freeze, each frozen set a prefix of the forward order
    cache, frozen = _fit_raw(container, units=units)
    assert any(event["to"] > event["from"] for event in cache.events)
    order = RawParameters(container).order
    prefixes = [sorted(order[:count]) for count in range(len(order))]
    assert len(frozen.sets) > 1 and all(sorted(frozen_set) in prefixes for frozen_set in frozen.sets), (
        frozen.sets
    )


class OneLinear(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(16, 4)

    def forward(self, x):
        return self.layer(x)

    training_step, configure_optimizers = RawParameters.training_step, RawParameters.configure_optimizers


def test_a_single_torch_layer_is_not_told_to_split_its_weight_from_its_bias(caplog):
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(0))
    trainer = pl.Trainer(callbacks=[GradientCache(**EAGER)], **trainer_kwargs(max_steps=4))
    with caplog.at_level(logging.INFO), warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        trainer.fit(OneLinear(), DataLoader(TensorDataset(x, x[:, :4].argmax(1)), batch_size=16))
    assert (
        "GradientCache: the model has a single trainable unit, so nothing can be frozen." in caplog.messages
    )
    assert not any("units=" in str(w.message) for w in warned)


class _FirstLayerReplaced(pl.LightningModule):
    """An MLP whose module puts a fresh first layer in at epoch ``swap_epoch``'s start (a new ``nn.Linear``
    object) and makes a new optimizer; ``tell``: it also tells GradientCache that its units no longer cover
    what trains (:attr:`LayerFreezer.outgrown`), the way it reacts to a backbone the user unfroze. Each step
    records whether the live first layer moved and the backward FLOPs GradientCache counted as skipped."""

    def __init__(self, swap_epoch: int | None, tell: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.swap_epoch, self.tell = swap_epoch, tell
        self.backbone = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU())
        self.head = nn.Linear(32, 4)
        self.steps: list[tuple[int, bool, float]] = []  # (step, first layer moved, FLOPs counted skipped)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.head(self.backbone(x)), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def _cache(self) -> GradientCache:
        return next(c for c in self.trainer.callbacks if isinstance(c, GradientCache))

    def on_train_epoch_start(self):
        if self.current_epoch == self.swap_epoch:
            torch.manual_seed(1)
            self.backbone[0] = nn.Linear(16, 32)
            self.trainer.strategy.setup_optimizers(self.trainer)
            if self.tell:
                self._cache().freezer.outgrown = True

    def on_train_batch_start(self, batch, batch_idx):
        self._before = (self.backbone[0].weight.detach().clone(), self._cache().ledger.skipped)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        weight, skipped = self._before
        moved = not torch.equal(weight, self.backbone[0].weight.detach())
        self.steps.append((self.global_step, moved, self._cache().ledger.skipped - skipped))


def _fit_replaced(swap_epoch: int | None, tell: bool = False) -> tuple[GradientCache, _FirstLayerReplaced]:
    pl.seed_everything(0)
    x = torch.randn(128, 16, generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(x, x[:, :4].argmax(1)), batch_size=16)
    model = _FirstLayerReplaced(swap_epoch, tell)
    cache = GradientCache(threshold=1.0, check_every=2, freeze_for=8)
    trainer = pl.Trainer(callbacks=[cache], **trainer_kwargs(max_epochs=4, limit_val_batches=0))
    trainer.fit(model, data)
    return cache, model


def test_a_layer_the_module_replaces_is_no_longer_frozen_nor_counted_as_skipped():
    # sweep-surgery finding 3: the units kept the replaced layer's parameter objects, so every later freeze
    # "froze" them, logging frozen units and skipped backward FLOPs while the new layer trained at every step
    control, _ = _fit_replaced(None)
    assert any(event["to"] > event["from"] for event in control.events)
    assert not any(event["reason"] == "retrace" for event in control.events)
    cache, model = _fit_replaced(swap_epoch=2)
    told, told_model = _fit_replaced(swap_epoch=2, tell=True)
    swapped_at = 16  # epoch 2's first step (8 batches an epoch)
    assert any(event["reason"] == "retrace" and event["step"] == swapped_at for event in cache.events)
    false = [(step, skipped) for step, moved, skipped in model.steps if moved and skipped > 0]
    assert false == []
    assert any(skipped > 0 for step, _, skipped in model.steps if step > swapped_at)  # it froze again
    assert cache.events == told.events
    for name, param in model.named_parameters():
        assert torch.equal(param, told_model.get_parameter(name)), name
