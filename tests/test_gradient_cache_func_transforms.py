"""GradientCache on modules whose ``training_step`` differentiates through the model: per-sample gradients
through ``vmap(grad(functional_call(...)))``, a Jacobian penalty through ``vmap(jacrev(net))``, a PINN's and a
gradient penalty's ``torch.autograd.grad(..., create_graph=True)``.

Before: the activation cache's forward gate ran inside ``grad()`` and crashed at the first freeze (``zero_``
on a tensor the transform captured); the per-sample model was warned about wav2vec2's feature encoder; the
Jacobian penalty and a conv critic's gradient penalty were warned about "a tied input and output layer", and a
PINN's units were said to be "a weight-shared layer, a looped block" freezing with "a loop, or a custom
autograd Function"."""

from __future__ import annotations

import logging
import warnings

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, jacrev, vmap
from torch.utils.data import DataLoader, TensorDataset

from lightning_pulse import GradientCache
from tests.conftest import trainer_kwargs


def _classes(samples: int = 160) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 12, generator=generator)
    y = (x @ torch.randn(12, 3, generator=generator)).argmax(1)
    return DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)


class _PerSampleWeights(pl.LightningModule):
    """Loss weights from per-sample gradient norms, the torch.func tutorial's recipe."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh(), nn.Linear(24, 3))

    def _one(self, params, x, y):
        return F.cross_entropy(functional_call(self.net, params, (x[None],)), y[None])

    def training_step(self, batch, batch_idx):
        x, y = batch
        params = {name: value.detach() for name, value in self.net.named_parameters()}
        per_sample = vmap(grad(self._one), in_dims=(None, 0, 0))(params, x, y)
        norms = torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in per_sample.values()))
        weights = (norms / norms.mean()).detach()
        return (F.cross_entropy(self.net(x), y, reduction="none") * weights).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _JacobianPenalty(_PerSampleWeights):
    """A contractive penalty: the input Jacobian of the whole net, through ``vmap(jacrev(...))``."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        J = vmap(jacrev(self.net))(x)  # (B, 3, 12)
        return F.cross_entropy(self.net(x), y) + 1e-3 * J.pow(2).sum() / len(x)


class _Pinn(pl.LightningModule):
    """A heat-equation residual u_t - 0.1 u_xx from ``torch.autograd.grad(..., create_graph=True)``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        tx = batch[0].clone().requires_grad_(True)
        u = self.net(tx)
        du = torch.autograd.grad(u.sum(), tx, create_graph=True)[0]
        u_xx = torch.autograd.grad(du[:, 1].sum(), tx, create_graph=True)[0][:, 1:]
        boundary = self.net(torch.zeros(8, 2)).pow(2).mean()
        return (du[:, :1] - 0.1 * u_xx).pow(2).mean() + boundary

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=3e-3)


class _ConvCritic(pl.LightningModule):
    """A conv classifier with an input-gradient penalty (WGAN-GP's form), ``create_graph=True``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv1d(2, 6, 3), nn.Tanh(), nn.Conv1d(6, 6, 3), nn.Tanh(), nn.Flatten(), nn.Linear(6 * 8, 3)
        )

    def training_step(self, batch, batch_idx):
        x = batch[0].clone().requires_grad_(True)
        out = self.net(x)
        g = torch.autograd.grad(out.logsumexp(1).sum(), x, create_graph=True)[0]
        return F.cross_entropy(out, batch[1]) + 0.1 * (g.flatten(1).norm(dim=1) - 1).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _fit(model, data, tmp_path, caplog, max_steps=24, freeze_for=8, **options):
    """The fit's GradientCache and every message it gave (warnings and info lines)."""
    torch.manual_seed(0)
    cache = GradientCache(check_every=4, freeze_for=freeze_for, threshold=1.0, **options)
    trainer = pl.Trainer(
        max_steps=max_steps, callbacks=[cache], default_root_dir=tmp_path, **trainer_kwargs()
    )
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.INFO):
        warnings.simplefilter("always")
        trainer.fit(model, data)
    said = [str(w.message) for w in caught] + [record.getMessage() for record in caplog.records]
    said = [line for line in said if "GradientCache" in line]
    for line in said:
        print(line[:300])
    assert trainer.global_step == max_steps
    return cache, said


def test_per_sample_gradients_under_vmap_grad_run_for_real_and_the_cache_replays_the_rest(tmp_path, caplog):
    pl.seed_everything(0)
    plain_model = _PerSampleWeights()
    cached_model = _PerSampleWeights()
    cached_model.load_state_dict(plain_model.state_dict())
    fit = dict(max_steps=36, freeze_for=32)
    plain, _ = _fit(plain_model, _classes(64), tmp_path / "plain", caplog, **fit)
    cache, said = _fit(cached_model, _classes(64), tmp_path / "cached", caplog, **fit, activation_cache_mb=4)
    activations = cache.activations
    assert activations is not None
    print("events", cache.events, "hits", activations.hits, "transform calls", activations.transform_calls)
    assert cache.events == plain.events and any(event["to"] > 0 for event in cache.events)
    assert activations.hits >= 1 and activations.transform_calls >= 1 and activations.disabled_reason is None
    # the transform's calls ran on the per-sample inputs with the swapped-in weights: training equals the
    # run without the cache
    for name, value in plain_model.state_dict().items():
        assert torch.equal(value, cached_model.state_dict()[name]), name
    # what the transform differentiates is its own: no backward runs through the frozen units
    assert not any("backward still runs through" in line for line in said)


class _LossInsideVmap(_PerSampleWeights):
    """The whole loss computed inside ``vmap`` over ``functional_call`` with the live parameters: the net
    runs only inside the transform."""

    def training_step(self, batch, batch_idx):
        params = dict(self.net.named_parameters())
        return vmap(self._one, in_dims=(None, 0, 0))(params, *batch).mean()


def test_a_frozen_module_called_only_inside_vmap_is_named_with_the_transform(tmp_path, caplog):
    pl.seed_everything(0)
    plain_model = _LossInsideVmap()
    cached_model = _LossInsideVmap()
    cached_model.load_state_dict(plain_model.state_dict())
    fit = dict(max_steps=36, freeze_for=32)
    plain, _ = _fit(plain_model, _classes(64), tmp_path / "plain", caplog, **fit)
    cache, said = _fit(cached_model, _classes(64), tmp_path / "cached", caplog, **fit, activation_cache_mb=4)
    assert cache.events == plain.events and any(event["to"] > 0 for event in cache.events)
    uncached = [line for line in said if "cannot replay the frozen module `net.0`" in line]
    assert len(uncached) == 1 and "ran only inside a torch.func transform" in uncached[0]
    assert "did not run in a frozen batch" not in uncached[0]
    for name, value in plain_model.state_dict().items():
        assert torch.equal(value, cached_model.state_dict()[name]), name


def test_a_jacobian_penalty_through_vmap_jacrev_is_no_tie_and_the_notes_name_the_transform(tmp_path, caplog):
    pl.seed_everything(0)
    _, said = _fit(_JacobianPenalty(), _classes(), tmp_path, caplog)
    text = " ".join(said)
    assert "tied" not in text and "tie_word_embeddings" not in text
    assert "a weight-shared layer, a looped block" not in text and "a loop, or a custom" not in text
    assert "the backward of a derivative taken through the model (a torch.func transform" in text
    assert "no prefix can freeze in this fit" in text


def test_a_pinns_create_graph_derivative_is_named_instead_of_a_loop(tmp_path, caplog):
    generator = torch.Generator().manual_seed(0)
    points = DataLoader(TensorDataset(torch.rand(256, 2, generator=generator)), batch_size=32, shuffle=True)
    pl.seed_everything(0)
    _, said = _fit(_Pinn(), points, tmp_path, caplog)
    text = " ".join(said)
    assert "a weight-shared layer, a looped block" not in text and "a loop, or a custom" not in text
    assert "torch.autograd.grad(..., create_graph=True) in training_step" in text
    assert "net.0 (after net.4)" in text and "no prefix can freeze in this fit" in text


def test_a_gradient_penalty_through_a_conv_layer_is_no_tie(tmp_path, caplog):
    """The penalty's double backward reads each conv weight again (``ConvolutionBackwardBackward0``): the
    first conv was pinned as a tied input and output layer."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(128, 2, 12, generator=generator)
    y = x.mean((1, 2)).gt(0).long() + x[:, 0, 0].gt(0).long()
    pl.seed_everything(0)
    _, said = _fit(
        _ConvCritic(), DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True), tmp_path, caplog
    )
    text = " ".join(said)
    assert "tied" not in text and "read again outside its own forward" not in text
    assert "torch.autograd.grad(..., create_graph=True) in training_step" in text
