"""GradientCache on layers that read their own weight twice inside their forward (spectral norm, weight
standardisation): no tie, so they freeze; a weight read again by another module is still a tie.

Held-out sweep: a GAN discriminator's MLP with spectral norm on every layer never froze anything, and the
warning said its first layer was "a tied input and output layer" to untie with `tie_word_embeddings=False`.
"""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.nn.utils import parametrizations
from torch.utils.data import DataLoader, TensorDataset

from lightning_pulse.callbacks.gradient_cache import GradientCache
from tests.conftest import trainer_kwargs

LAYERS = ["layers.0", "layers.1", "layers.2", "layers.3"]


class WSLinear(nn.Linear):
    """A linear layer with weight standardisation written in its forward (as BiT's and NFNet's layers do)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        return F.linear(x, (w - w.mean(1, keepdim=True)) / (w.std(1, keepdim=True) + 1e-5), self.bias)


def spectral(layer: nn.Linear) -> nn.Module:
    return parametrizations.spectral_norm(layer)


def spectral_hook(layer: nn.Linear) -> nn.Module:
    return nn.utils.spectral_norm(layer)  # the older form: a forward pre-hook computes `weight`


def standardised(layer: nn.Linear) -> nn.Module:
    new = WSLinear(layer.in_features, layer.out_features)
    new.load_state_dict(layer.state_dict())
    return new


class NormalisedMLP(pl.LightningModule):
    """A discriminator-like MLP whose every layer is wrapped by ``wrap``."""

    def __init__(self, wrap) -> None:
        super().__init__()
        torch.manual_seed(0)
        layers = [nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 4)]
        self.layers = nn.ModuleList(wrap(layer) for layer in layers)

    def training_step(self, batch, batch_idx):
        x, y = batch
        for layer in self.layers[:-1]:
            x = F.relu(layer(x))
        return F.cross_entropy(self.layers[-1](x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=3e-3)


def rule_data() -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(640, 16, generator=generator)
    y = (x @ torch.randn(16, 4, generator=generator)).argmax(1)
    return DataLoader(TensorDataset(x, y), batch_size=32)


class WatchFirstLayer(Callback):
    """Per optimizer step: which parameters were frozen (``requires_grad`` off at batch start) and changed
    over the step; for a spectral-normed first layer also how far its power-iteration vector ``u`` moved and
    how far its estimate ``u . (W v)`` of the weight's largest singular value is from the true one."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, str, bool, bool]] = []  # step, name, frozen, changed
        self.first: list[
            tuple[bool, float, float]
        ] = []  # first layer's weight frozen, u moved, estimate error

    @staticmethod
    def _power_iteration(module):
        layer = module.layers[0]
        if hasattr(layer, "parametrizations"):
            norm = layer.parametrizations.weight[0]
            return layer.parametrizations.weight.original, norm._u, norm._v
        if hasattr(layer, "weight_u"):
            return layer.weight_orig, layer.weight_u, layer.weight_v
        return None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._before = {n: (p.requires_grad, p.detach().clone()) for n, p in pl_module.named_parameters()}
        if (found := self._power_iteration(pl_module)) is not None:
            self._frozen, self._u = not found[0].requires_grad, found[1].clone()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        for name, param in pl_module.named_parameters():
            trains, value = self._before[name]
            self.rows.append((trainer.global_step, name, not trains, not torch.equal(value, param.detach())))
        if (found := self._power_iteration(pl_module)) is not None:
            weight, u, v = found
            weight = weight.detach()
            true = torch.linalg.matrix_norm(weight, 2)
            error = float((torch.vdot(u, torch.mv(weight, v)) - true).abs() / true)
            self.first.append((self._frozen, float((u - self._u).abs().max()), error))

    def frozen(self) -> set[str]:
        return {name for _, name, frozen, _ in self.rows if frozen}

    def changed_while_frozen(self) -> set[str]:
        return {name for _, name, frozen, changed in self.rows if frozen and changed}

    def changed(self) -> set[str]:
        return {name for _, name, _, changed in self.rows if changed}


def fit(wrap, units=None) -> tuple[GradientCache, WatchFirstLayer, list[str], pl.LightningModule]:
    cache = GradientCache(check_every=4, freeze_for=8, threshold=1.0, units=units)
    watch = WatchFirstLayer()
    module = NormalisedMLP(wrap)
    trainer = pl.Trainer(**trainer_kwargs(max_steps=60, callbacks=[cache, watch]))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, rule_data())
    said = [str(w.message) for w in caught if "GradientCache" in str(w.message)]
    return cache, watch, said, module


@pytest.mark.parametrize(
    ("wrap", "units"),
    [(spectral, None), (spectral, LAYERS), (spectral_hook, None)],
    ids=["auto", "units", "hook"],
)
def test_a_spectral_normed_discriminator_freezes_and_its_frozen_layers_stand_still(wrap, units):
    """Spectral norm reads its weight twice in the layer's own forward (``sigma = u . (W v)``, then
    ``W / sigma``): that was taken for a tie, every layer was pinned and nothing ever froze, whatever
    ``units`` said. While frozen, the weight stands still and the power iteration goes on (``u``, ``v`` are
    buffers, updated by each training forward), so the estimate of the frozen weight's norm converges to the
    true one."""
    cache, watch, said, module = fit(wrap, units)
    assert said == []  # no "tied input and output layer ... untie them"
    assert not any(unit.pinned for unit in cache.freezer.units)
    assert any(event["to"] > 0 for event in cache.events) and cache.ledger.skipped_share > 0.3
    weight = next(
        name for name, _ in module.named_parameters() if name.startswith("layers.0.") and "bias" not in name
    )
    assert weight in watch.frozen()
    assert watch.changed_while_frozen() == set()  # frozen parameters stand still
    assert watch.changed() == {
        name for name, _ in module.named_parameters()
    }  # and each trains when not frozen
    # the first frozen span of the first layer: u keeps moving, and the norm estimate gets closer to the truth
    start = next(i for i, row in enumerate(watch.first) if row[0])
    span = watch.first[start : next(i for i in range(start, len(watch.first)) if not watch.first[i][0])]
    assert len(span) > 2 and all(moved > 0 for _, moved, _ in span)
    assert span[-1][2] < span[0][2]


def test_hand_written_weight_standardisation_is_no_tie_and_freezes():
    """``(w - mean(w)) / std(w)`` in the layer's forward reads its weight by three kinds of op, all inside its
    own forward: it was pinned like a tied embedding and nothing froze."""
    cache, watch, said, module = fit(standardised)
    assert said == [] and not any(unit.pinned for unit in cache.freezer.units)
    assert [unit.name for unit in cache.freezer.units] == LAYERS
    assert "layers.0.weight" in watch.frozen() and any(event["to"] > 0 for event in cache.events)
    assert watch.changed_while_frozen() == set()
    assert watch.changed() == {name for name, _ in module.named_parameters()}


class SpectralTiedLM(pl.LightningModule):
    """A spectral-normed embedding read again as the output projection, ``F.linear(h, embed.weight)``: its
    spectral norm runs again there, outside the embedding's forward, so it is still a tie."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = parametrizations.spectral_norm(nn.Embedding(32, 16))
        self.blocks = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.embed(x)
        logits = F.linear(h + self.blocks(h), self.embed.weight)
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=3e-3)


def test_a_spectral_normed_embedding_read_again_as_the_output_projection_stays_pinned():
    tokens = torch.randint(0, 32, (128, 9), generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=16)
    cache = GradientCache(check_every=4, freeze_for=8, threshold=1.0)
    with pytest.warns(
        UserWarning, match=r"GradientCache: the first unit in forward order, embed.* \(Div, Mv\)"
    ):
        pl.Trainer(**trainer_kwargs(max_steps=24, callbacks=[cache])).fit(SpectralTiedLM(), data)
    assert cache.freezer.units[0].name.startswith("embed") and cache.freezer.units[0].pinned
    assert cache.events == []
