"""Picklable pieces for two-process gloo tests (spawned processes import them by module path)."""

from __future__ import annotations

import json
from pathlib import Path

import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from lightning_pulse import phase_of


class RankSkewedClock:
    """A fake seconds counter that runs 10x faster on rank 1: if ranks decided wall-clock phase changes
    on their own clocks, they would switch at different steps."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.now += 1.0 if rank == 0 else 10.0
        return self.now


class PhaseDump(Callback):
    """Writes ``[(global_step, phase)]`` of every training batch to ``<directory>/rank<r>.json``."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.phases: list[tuple[int, str]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.phases.append((trainer.global_step, phase_of(trainer).value))

    def on_train_end(self, trainer, pl_module):
        Path(self.directory, f"rank{trainer.global_rank}.json").write_text(json.dumps(self.phases))


class RankOffsetClock:
    """A simulated clock 12 h ahead on rank 1: a rank that decided on its own clock would read another hour
    of the grid series, and pause at other steps."""

    def __init__(self, start: float) -> None:
        self.now = float(start)
        self.slept: list[float] = []

    def _offset(self) -> float:
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        return 12 * 3600.0 if rank == 1 else 0.0

    def time(self) -> float:
        return self.now + self._offset()

    def sleep(self, seconds: float) -> None:
        self.slept.append(float(seconds))
        self.now += max(float(seconds), 0.0)

    def advance(self, seconds: float) -> None:
        self.now += seconds


class SleepDump(Callback):
    """Writes ``[(global_step, seconds slept so far)]`` of every training batch to ``<directory>/rank<r>.json``."""

    def __init__(self, directory: str, clock: RankOffsetClock) -> None:
        self.directory, self.clock = directory, clock
        self.rows: list[tuple[int, float]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.clock.advance(600.0)  # each step takes 10 simulated minutes
        self.rows.append((trainer.global_step, sum(self.clock.slept)))

    def on_train_end(self, trainer, pl_module):
        Path(self.directory, f"rank{trainer.global_rank}.json").write_text(json.dumps(self.rows))
