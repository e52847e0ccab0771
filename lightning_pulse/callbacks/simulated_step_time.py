"""SimulatedStepTime: every training step takes a fixed time on a simulated clock, so days replay in seconds."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_pulse.core.green_window import SimulatedClock


class SimulatedStepTime(Callback):
    """Each training batch takes ``seconds`` on a :class:`SimulatedClock`: days of a series replay in seconds.

    For simulations and tests of :class:`~lightning_pulse.GreenWindow`; put it first in the callbacks so that
    every callback sees the step's time.

    Args:
        clock: the clock every time-aware callback of the run reads.
        seconds: simulated seconds per training batch.

    Example::

        from lightning_pulse import GreenWindow, SimulatedClock
        from lightning_pulse.callbacks.simulated_step_time import SimulatedStepTime

        clock = SimulatedClock("2020-06-15 00:00:00")
        callbacks = [SimulatedStepTime(clock, 600.0), GreenWindow(signal="grid.csv", when_dirty="pause", clock=clock)]
    """

    def __init__(self, clock: SimulatedClock, seconds: float) -> None:
        self.clock, self.seconds = clock, float(seconds)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self.clock.advance(self.seconds)
