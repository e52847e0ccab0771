"""The benchmark harness times callbacks from outside, without touching their code."""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from benchmarks.harness import HookTimer
from tests.conftest import trainer_kwargs


class _CountsBatches(Callback):
    def __init__(self) -> None:
        self.batches = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.batches += 1
        sum(i * i for i in range(20_000))  # some CPU work inside the hook


def test_hook_timer_counts_every_call_of_the_overridden_hooks_only(mnist1d_small):
    callback, timer = _CountsBatches(), HookTimer()
    timer.install(callback)
    assert "on_train_batch_end" in vars(callback)  # wrapped on the instance
    assert "on_train_batch_start" not in vars(callback)  # a hook it does not override stays Lightning's
    module, data = mnist1d_small()
    pl.Trainer(max_steps=5, callbacks=[callback], **trainer_kwargs()).fit(module, data)
    assert callback.batches == 5
    assert timer.calls == {"_CountsBatches": 5}
    assert timer.cpu_s["_CountsBatches"] > 0.0
