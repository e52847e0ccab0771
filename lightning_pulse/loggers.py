"""How every pulse callback logs: straight to the Trainer's loggers, on rank 0.

``pl_module.log`` is not allowed in every hook the callbacks run in, it re-emits the last value at every step
in between (what Lightning's ``LearningRateMonitor`` avoids the same way), and per step it costs more than
most of the callbacks' own work.
"""

from __future__ import annotations

from collections.abc import Mapping

import lightning.pytorch as pl


def log_to_loggers(trainer: pl.Trainer, metrics: Mapping[str, float] | None, step: int | None = None) -> None:
    """Write ``metrics`` to each of ``trainer``'s loggers at ``step`` (the global step by default), on rank 0;
    nothing for empty ``metrics``."""
    if not metrics or not trainer.is_global_zero:
        return
    at = trainer.global_step if step is None else step
    for logger in trainer.loggers:
        logger.log_metrics(dict(metrics), step=at)
