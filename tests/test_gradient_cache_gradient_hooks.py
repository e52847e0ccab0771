"""GradientCache next to a LightningModule whose own hooks touch every parameter's gradient (gradient noise in
``on_before_optimizer_step``, zeroing rows in ``on_after_backward``): a held-out sweep's finding. Frozen
parameters had ``grad=None``, so such a module, which trains plain, crashed in its own hook at the first
freeze (``AttributeError: 'NoneType' object has no attribute 'add_'``), hundreds of steps into a run."""

from __future__ import annotations

import logging
import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.utilities import grad_norm
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pulse import _lightning_compat as compat
from lightning_pulse.callbacks.gradient_cache import GradientCache
from tests.conftest import trainer_kwargs


def _data() -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(256, 16, generator=generator)
    y = (x @ torch.randn(16, 4, generator=generator)).argmax(1)
    return DataLoader(TensorDataset(x, y), batch_size=16)


class _Net(pl.LightningModule):
    """SGD with momentum and weight decay: a zero gradient at the step would move a frozen parameter."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
        self.hook_calls = 0

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)


class _Noise(_Net):
    """Gradient noise as commonly written: every ``p.grad`` touched (``guarded``: those that are not None)."""

    guarded = False

    def on_before_optimizer_step(self, optimizer):
        self.hook_calls += 1
        for index, param in enumerate(self.parameters()):
            if self.guarded and param.grad is None:
                continue
            noise = torch.Generator().manual_seed(1000 * self.global_step + index)
            param.grad.add_(torch.randn(param.shape, generator=noise) * 0.01)


class _GuardedNoise(_Noise):
    guarded = True


class _HandAccumulatedNoise(_Noise):
    """The forum's hand-made accumulation: zero every 2nd batch, step every 2nd batch (the closure by hand on
    the others), so a step may end a batch with no update and no zeroing after it."""

    def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
        if batch_idx % 2 == 0:
            optimizer.zero_grad()

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure):
        if batch_idx % 2:
            optimizer.step(closure=optimizer_closure)
        else:
            optimizer_closure()


class _GuardedHandAccumulatedNoise(_HandAccumulatedNoise):
    guarded = True


class _Mask(_Net):
    """The forum pattern: rows of the first layer's gradient zeroed after each backward."""

    guarded = False

    def on_after_backward(self):
        self.hook_calls += 1
        if not self.guarded or self.net[0].weight.grad is not None:
            self.net[0].weight.grad[:4] = 0


class _GuardedMask(_Mask):
    guarded = True


class _FrozenWatch(Callback):
    """Per batch: the parameters GradientCache held frozen at its start, and whether any moved by its end."""

    def __init__(self, cache: GradientCache) -> None:
        self.cache, self.frozen_batches, self.moved = cache, 0, []
        self._before: list[tuple[torch.Tensor, torch.Tensor]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        freezer = self.cache.freezer
        units = [] if freezer is None else [u for u, f in zip(freezer.units, freezer.frozen) if f]
        self._before = [(p, p.detach().clone()) for unit in units for p in unit.params]
        self.frozen_batches += bool(self._before)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.moved += [trainer.global_step for p, copy in self._before if not torch.equal(p.detach(), copy)]


class _SkippingScaler(torch.amp.GradScaler):
    """AMP's GradScaler finding infs at every third step, so skipping it (no scaling, so CPU runs it)."""

    def __init__(self) -> None:
        super().__init__("cpu")
        self.calls = 0

    def scale(self, outputs):
        return outputs

    def unscale_(self, optimizer):
        pass

    def step(self, optimizer, *args, **kwargs):
        self.calls += 1
        return None if self.calls % 3 == 0 else optimizer.step(*args, **kwargs)

    def update(self, new_scale=None):
        pass


def _fit(module: type[_Net], amp_skips: bool = False, **kwargs) -> tuple[_Net, GradientCache, _FrozenWatch]:
    pl.seed_everything(0, verbose=False)
    model = module()
    cache = GradientCache(check_every=2, freeze_for=4, threshold=1.0, max_frozen_share=0.9)
    watch = _FrozenWatch(cache)
    if amp_skips:
        kwargs["plugins"] = [MixedPrecision("16-mixed", "cpu", scaler=_SkippingScaler())]
    trainer = pl.Trainer(**trainer_kwargs(max_steps=24, callbacks=[cache, watch], **kwargs))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, _data())
    assert trainer.global_step == 24
    return model, cache, watch


@pytest.mark.parametrize(
    ("module", "reference", "hook_calls", "kwargs"),
    [
        (_Noise, _GuardedNoise, 24, {}),
        (_Noise, _GuardedNoise, 24, dict(accumulate_grad_batches=2, precision="bf16-mixed")),
        (_Noise, _GuardedNoise, 24, dict(amp_skips=True)),  # no update at every third step
        (_Mask, _GuardedMask, 48, dict(accumulate_grad_batches=2)),
        # Lightning runs no on_before_optimizer_step for a closure called by hand
        (_HandAccumulatedNoise, _GuardedHandAccumulatedNoise, 12, {}),
    ],
    ids=[
        "noise",
        "noise-accumulate2-bf16",
        "noise-amp-skips",
        "mask-accumulate2",
        "noise-accumulated-by-hand",
    ],
)
def test_a_module_hook_touching_every_gradient_trains_as_one_that_skips_frozen_ones(
    module, reference, hook_calls, kwargs, monkeypatch
):
    model, cache, watch = _fit(module, **kwargs)  # crashed in the module's hook at the first freeze
    with monkeypatch.context() as patch:  # the reference: frozen parameters' grad None, its hook skips them
        patch.setattr(compat, "gradient_reading_hooks", lambda *args: [])
        guarded, guarded_cache, _ = _fit(reference, **kwargs)
    assert model.hook_calls == hook_calls == guarded.hook_calls
    assert watch.frozen_batches >= 8 and watch.moved == []  # frozen parameters stood still, bit for bit
    assert cache.events == guarded_cache.events and any(event["to"] for event in cache.events)
    assert cache.ledger.state_dict() == guarded_cache.ledger.state_dict() and cache.ledger.skipped > 0
    for trained, reference_param in zip(model.parameters(), guarded.parameters()):
        assert torch.equal(trained, reference_param)  # the zeros reached no update (momentum, weight decay)


class _CountStepHooks(Callback):
    def __init__(self) -> None:
        self.hooks: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.hooks.append(len(trainer.optimizers[0]._optimizer_step_pre_hooks))


@pytest.mark.parametrize("module", [_Net, _Noise])
def test_the_zero_gradients_cost_nothing_without_such_a_hook_and_leave_no_hook_behind(module, caplog):
    pl.seed_everything(0, verbose=False)
    model, count = module(), _CountStepHooks()
    trainer = pl.Trainer(
        **trainer_kwargs(
            max_steps=6, callbacks=[GradientCache(check_every=2, freeze_for=2, threshold=1.0), count]
        )
    )
    with caplog.at_level(logging.INFO, logger="lightning.pytorch"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, _data())
    said = "`_Noise.on_before_optimizer_step` may read every parameter's gradient" in caplog.text
    assert said == (module is _Noise)
    assert set(count.hooks) == ({1} if module is _Noise else {0})  # a plain module's steps run no hook
    assert len(trainer.optimizers[0]._optimizer_step_pre_hooks) == 0


def test_the_hooks_given_zero_gradients_are_the_modules_own():
    assert compat.gradient_reading_hooks(_Net()) == []
    assert compat.gradient_reading_hooks(_Mask()) == ["_Mask.on_after_backward"]
    assert compat.gradient_reading_hooks(_HandAccumulatedNoise()) == [
        "_HandAccumulatedNoise.on_before_optimizer_step"
    ]


class _GradNormLogger(_Net):
    """Lightning's recipe: log the gradient norms in ``on_before_optimizer_step`` (``grad_norm`` skips ``None``)."""

    def on_before_optimizer_step(self, optimizer):
        self.log_dict(grad_norm(self, norm_type=2))


def test_a_hook_that_reads_no_grad_attribute_gets_no_zero_gradients():
    # a regression sweep: the recipe got zeros, logged as norms of 0 for every frozen layer, and paid for them
    assert compat.gradient_reading_hooks(_GradNormLogger()) == []
