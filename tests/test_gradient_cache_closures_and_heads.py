"""GradientCache under an optimizer that evaluates its closure twice (SAM), after the fit, on a fake-quantized
(QAT) model's activation cache, and on a model with two heads (DANN): held-out sweep findings."""

from __future__ import annotations

import logging
import warnings

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pulse.callbacks.gradient_cache import GradientCache
from tests.conftest import trainer_kwargs
from tests.qat_models import EagerQATClassifier


def _data(batch_size: int = 32, features: int = 16) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(512, features, generator=generator)
    y = (x @ torch.randn(features, 4, generator=generator)).argmax(1)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


class SAM(torch.optim.Optimizer):
    """Sharpness-aware minimization as usually written for Lightning: ``step`` evaluates the closure twice,
    and both of its steps skip a parameter without a gradient."""

    def __init__(self, params, lr: float = 0.05, rho: float = 0.05) -> None:
        super().__init__(params, dict(lr=lr, rho=rho))

    @torch.no_grad()
    def step(self, closure=None):
        with torch.enable_grad():
            loss = closure()
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        norm = torch.norm(torch.stack([g.norm() for g in grads])) if grads else torch.tensor(0.0)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.state[p]["old"] = p.detach().clone()
                    p.add_(p.grad * group["rho"] / (norm + 1e-12))
        with torch.enable_grad():
            closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.copy_(self.state[p]["old"])
                    p.add_(p.grad, alpha=-group["lr"])
        return loss


class _MLP(pl.LightningModule):
    def __init__(self, optimizer: str = "sgd") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
        self.optimizer = optimizer
        self.training_steps = 0

    def training_step(self, batch, batch_idx):
        self.training_steps += 1
        return F.cross_entropy(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        if self.optimizer == "sam":
            return SAM(self.parameters())
        return torch.optim.SGD(self.parameters(), lr=0.05)


class FirstLayerWatch(Callback):
    """Per optimizer step: whether ``net.0`` was frozen at its start and at its end, and whether it moved;
    plus GradientCache's ``frozen_units`` during the fit."""

    def __init__(self, cache: GradientCache) -> None:
        self.cache = cache
        self.rows: list[tuple[int, bool, bool, bool]] = []
        self.frozen_units_seen: list[list[str]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.weight = pl_module.net[0].weight.detach().clone()
        self.frozen_at_start = not pl_module.net[0].weight.requires_grad

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        weight = pl_module.net[0].weight
        moved = not torch.equal(self.weight, weight)
        self.rows.append((trainer.global_step, self.frozen_at_start, not weight.requires_grad, moved))
        self.frozen_units_seen.append(self.cache.frozen_units)


def _fit(optimizer: str, max_steps: int = 30, **settings):
    cache = GradientCache(
        **{**dict(check_every=4, freeze_for=8, threshold=1.0, max_frozen_share=0.9), **settings}
    )
    watch = FirstLayerWatch(cache)
    model = _MLP(optimizer)
    pl.seed_everything(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pl.Trainer(max_steps=max_steps, callbacks=[cache, watch], **trainer_kwargs()).fit(model, _data())
    return cache, watch, model


def test_windows_and_freezes_count_optimizer_steps_under_an_optimizer_that_evaluates_its_closure_twice():
    """Sweep A: under SAM, ``check_every`` and ``freeze_for`` were counted in closure evaluations (the hook
    before the optimizer step runs once per evaluation), so windows and freezes lasted half the steps."""
    sgd, _, _ = _fit("sgd")
    sam, watch, model = _fit("sam")
    assert model.training_steps == 2 * 30  # two closure evaluations per optimizer step
    steps = [(event["step"], event["from"], event["to"]) for event in sam.events]
    assert steps[:2] == [(4, 0, 1), (12, 1, 0)]  # frozen at the first window's end, released freeze_for later
    assert [event["step"] for event in sam.events] == [event["step"] for event in sgd.events]
    assert sam.freezer.steps == 30
    # a unit frozen at a step's first evaluation is not moved by it: SAM's perturbation (made with that
    # evaluation's gradients) would otherwise stay, as its second step restores only what has a gradient
    became_frozen = [step for step, before, after, _ in watch.rows if after and not before]
    assert became_frozen and all(not moved for step, before, after, moved in watch.rows if after)
    assert all(not moved for _, before, _, moved in watch.rows if before)


def test_sam_is_checked_once_not_held_at_every_frozen_step():
    """Review: SAM holds its base optimizer and was held like Lookahead (a copy and a compare of the frozen
    prefix at every frozen step). It perturbs and restores at every step, so its first frozen step shows what
    it does: checked once, no copy held; a Lookahead around SAM still is held (its sync is periodic)."""
    from lightning_pulse.core.layer_freezing import holds_frozen_parameters_every_step

    sam, watch, model = _fit("sam")
    check = sam._lifecycle.optimizer_check
    assert sam._lifecycle.repeats_closure and any(after for _, _, after, _ in watch.rows)
    assert check.checked and not check.moved and check.put_back == 0 and not check._copies
    assert check._verified  # the frozen layer was checked at its first frozen step
    optimizer = model.trainer.optimizers[0]
    assert not holds_frozen_parameters_every_step(optimizer, repeats_closure=True)

    class LookaheadAroundSAM(torch.optim.Optimizer):
        def __init__(self, inner: torch.optim.Optimizer) -> None:
            super().__init__([p for group in inner.param_groups for p in group["params"]], {})
            self.inner = inner

    assert holds_frozen_parameters_every_step(LookaheadAroundSAM(optimizer), repeats_closure=True)


def test_frozen_units_is_empty_once_the_fit_has_turned_every_parameter_back_on():
    """Sweep B: ``frozen_units`` listed the units frozen at the last event after the fit, while every
    parameter trained again."""
    cache, watch, model = _fit("sgd", max_steps=10, freeze_for=40)
    assert watch.frozen_units_seen[-1] == ["net.0"]  # the fit ended with a frozen prefix
    assert all(p.requires_grad for p in model.parameters())
    assert cache.frozen_units == []
    assert cache.state_dict()["cache"]["frozen"] == [
        True,
        False,
        False,
    ]  # the checkpoint keeps the frozen set


def _qat_model() -> EagerQATClassifier:
    torch.manual_seed(0)
    return EagerQATClassifier((16, 32, 32, 4))


class DisableObservers(Callback):
    def __init__(self, keep: str | None = None) -> None:
        self.keep = keep  # the module whose observers stay on

    def on_train_start(self, trainer, pl_module):
        from torch.ao.quantization import disable_observer, enable_observer

        pl_module.apply(disable_observer)
        if self.keep is not None:
            pl_module.get_submodule(self.keep).apply(enable_observer)


def _fit_qat(observers_on: bool | str) -> tuple[GradientCache, list[str]]:
    """``observers_on``: all, none (``False``), or only those of the module it names."""
    cache = GradientCache(
        check_every=4, freeze_for=40, threshold=1.0, activation_cache_mb=8, units=["net.1", "net.3", "net.5"]
    )
    keep = observers_on if isinstance(observers_on, str) else None
    callbacks = [cache] if observers_on is True else [cache, DisableObservers(keep)]
    pl.seed_everything(0)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer = pl.Trainer(max_steps=40, callbacks=callbacks, **trainer_kwargs())
        trainer.fit(_qat_model(), DataLoader(_data().dataset, batch_size=32, shuffle=True))
    return cache, [str(w.message) for w in record if "activation cache" in str(w.message)]


def test_the_activation_cache_on_a_qat_model_names_the_fake_quant_observers_as_why_it_does_not_replay():
    """Sweep C: on an eager QAT model the cache switched off blaming data augmentation or noise; the frozen
    layers' inputs changed because the fake-quant observers move their scale at every training forward. The
    frozen layers' own observers are written by their forward (by torch's fused op, which bumps no version
    counter): the first frozen layer is named as one the cache cannot replay at its first recorded forward."""
    cache, messages = _fit_qat(observers_on=True)
    assert len(messages) == 1 and cache.activations.hits == 0
    assert "cannot replay the frozen module `net.1`" in messages[0]
    assert "`weight_fake_quant.scale`" in messages[0] and "fake-quant observers" in messages[0]
    assert "disable_observer" in messages[0] and "augmentation" not in messages[0]
    assert list(cache.activations.uncached) == ["net.1"] and cache.activations.disabled_reason is None
    # the way out the message names works: with the observers off, the same run replays
    cache, messages = _fit_qat(observers_on=False)
    assert messages == [] and cache.activations.hits > 0
    # the input stub's observer alone (before the frozen layers, in no unit) changes what they are given: the
    # cache switches itself off and names it
    cache, messages = _fit_qat(observers_on="net.0")
    assert len(messages) == 1 and "switched itself off" in messages[0] and cache.activations.uncached == {}
    assert "fake-quant observers" in messages[0] and "net.0.activation_post_process" in messages[0]
    assert "augmentation" not in messages[0]


class GradReverse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return -ctx.scale * grad, None


class _DANN(pl.LightningModule):
    """A class head and a domain head behind gradient reversal, on shared features; the class head is called
    first, so it comes before the domain head in forward order."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.feat = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU())
        self.cls = nn.Linear(32, 4)
        self.dom = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        domain = (x[:, :8].sum(1) > x[:, 8:].sum(1)).long()
        features = self.feat(x)
        return F.cross_entropy(self.cls(features), y) + F.cross_entropy(
            self.dom(GradReverse.apply(features, 0.3)), domain
        )

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=3e-3)


class ClassHeadWatch(Callback):
    def __init__(self) -> None:
        self.cls_frozen: list[bool] = []
        self.feat_frozen: list[bool] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.cls_frozen.append(not pl_module.cls.weight.requires_grad)
        self.feat_frozen.append(not pl_module.feat[2].weight.requires_grad)


def test_every_head_of_a_two_head_model_trains_and_the_frozen_prefix_stops_before_the_first(caplog):
    """Sweep C: on a DANN the frozen prefix, taken in forward order, froze the class head (called before the
    domain head) while the domain head trained: accuracy fell to chance."""
    cache, watch = (
        GradientCache(check_every=4, freeze_for=8, threshold=1.0, max_frozen_share=1.0),
        ClassHeadWatch(),
    )
    pl.seed_everything(0)
    with caplog.at_level(logging.INFO), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pl.Trainer(max_steps=40, callbacks=[cache, watch], **trainer_kwargs()).fit(_DANN(), _data())
    assert [unit.name for unit in cache.freezer.units][:3] == ["feat.0", "feat.2", "cls"]
    assert not any(watch.cls_frozen)
    assert any(watch.feat_frozen)  # the shared features before the heads still freeze
    assert max(event["to"] for event in cache.events) == 2
    assert "are heads and never freeze" in caplog.text and "cls, dom.2" in caplog.text


class _WideAndDeep(pl.LightningModule):
    """Wide & Deep: a linear term on the raw input (computed first) summed with a deep trunk's head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.wide = nn.Linear(16, 4)
        self.deep = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU())
        self.head = nn.Linear(32, 4)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.wide(x) + self.head(self.deep(x)), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=3e-3)


def test_a_wide_part_on_the_raw_input_is_not_a_head_so_the_deep_trunk_still_freezes():
    """Review: once every unit no other unit reads counted as a head, Wide & Deep's wide part (forward
    position 0) ended the frozen prefix before it began, and nothing ever froze."""
    cache = GradientCache(check_every=4, freeze_for=8, threshold=1.0, max_frozen_share=1.0)
    pl.seed_everything(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pl.Trainer(max_steps=40, callbacks=[cache], **trainer_kwargs()).fit(_WideAndDeep(), _data())
    assert [unit.name for unit in cache.freezer.units][0] == "wide"
    assert cache.events and max(event["to"] for event in cache.events) >= 2  # the wide part and the trunk
