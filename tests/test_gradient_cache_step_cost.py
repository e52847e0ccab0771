"""GradientCache's per-step hooks on a plain single-process fit: no work that the step does not need.

In a char-LM fit (benchmarks/overhead.py) two pieces of per-step work with nothing to do cost about 22 µs of
GradientCache's ~190 µs a step: a grad-mode context around the optimizer check at each batch end, and a failed
attribute lookup on the module (nn.Module.__getattr__ raises) at each backward, for DDP's sync flag.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch

from lightning_pulse.callbacks.gradient_cache import GradientCache
from tests.conftest import trainer_kwargs

# every unit counts as stable after one window, so freezes happen in a short fit
EAGER = dict(threshold=2.0, check_every=5, freeze_for=20)


def test_per_step_hooks_enter_no_grad_mode_context_and_miss_no_module_attribute(mnist1d_small, monkeypatch):
    pl.seed_everything(0)
    model, data = mnist1d_small()
    cache = GradientCache(**EAGER)
    inside: list[str] = []  # the GradientCache hook running now
    contexts: list[str] = []  # grad-mode contexts entered inside on_train_batch_end
    misses: list[str] = []  # attributes looked up on the module and missing, inside on_after_backward

    def within(name, hook):
        def run(*args, **kwargs):
            inside.append(name)
            try:
                return hook(*args, **kwargs)
            finally:
                inside.pop()

        return run

    for name in ("on_train_batch_end", "on_after_backward"):
        setattr(cache, name, within(name, getattr(cache, name)))
    enter = torch.no_grad.__enter__

    def counted_enter(self):
        if inside and inside[-1] == "on_train_batch_end":
            contexts.append("no_grad")
        return enter(self)

    monkeypatch.setattr(torch.no_grad, "__enter__", counted_enter)
    module_getattr = torch.nn.Module.__getattr__

    def watched_getattr(self, name):
        try:
            return module_getattr(self, name)
        except AttributeError:
            if inside and inside[-1] == "on_after_backward":
                misses.append(name)
            raise

    monkeypatch.setattr(torch.nn.Module, "__getattr__", watched_getattr)
    trainer = pl.Trainer(callbacks=[cache], max_steps=30, limit_train_batches=10, **trainer_kwargs())
    trainer.fit(model, data)

    assert cache.events, "nothing froze: the frozen steps are not covered"
    assert contexts == []  # torch's optimizers leave frozen parameters alone: nothing to check or put back
    assert misses == []
    assert all(param.requires_grad for param in model.parameters())
