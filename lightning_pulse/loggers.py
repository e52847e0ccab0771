"""How every pulse callback logs: straight to the Trainer's loggers, on rank 0.

``pl_module.log`` is not allowed in every hook the callbacks run in, it re-emits the last value at every step
in between (what Lightning's ``LearningRateMonitor`` avoids the same way), and per step it costs more than
most of the callbacks' own work.
"""

from __future__ import annotations

from collections.abc import Mapping

import lightning.pytorch as pl

from lightning_pulse import _lightning_compat as compat


def log_to_loggers(trainer: pl.Trainer, metrics: Mapping[str, float] | None, step: int | None = None) -> None:
    """Write ``metrics`` to each of ``trainer``'s loggers at ``step``, on rank 0; nothing for empty
    ``metrics``.

    By default at the step Lightning writes the user's own metrics of the same moment
    (``compat.logging_step``): a phase change, an energy figure or a skipped step lines up with the loss of
    the step it belongs to, not one after it."""
    if not metrics or not trainer.is_global_zero:
        return
    at = compat.logging_step(trainer) if step is None else step
    for logger in trainer.loggers:
        logger.log_metrics(dict(metrics), step=at)


def log_closed_epoch(trainer: pl.Trainer, metrics: Mapping[str, float] | None) -> None:
    """:func:`log_to_loggers` at a training epoch's start, of the epoch before it (figures final only once it
    has closed): at that epoch's last step, where Lightning writes an epoch's own metrics."""
    log_to_loggers(trainer, metrics, compat.logging_step(trainer, epoch_end=True))
