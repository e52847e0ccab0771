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
