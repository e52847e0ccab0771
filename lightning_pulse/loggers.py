"""How every pulse callback logs: straight to the Trainer's loggers, on rank 0.

``pl_module.log`` is not allowed in every hook the callbacks run in, it re-emits the last value at every step
in between (what Lightning's ``LearningRateMonitor`` avoids the same way), and per step it costs more than
most of the callbacks' own work.

A logger that fails (a tracking server out of reach, a store that refuses a name) never fails the run: the
project's rule is that measurement never kills training. Its failure is said once per logger, and the other
loggers still get the figures.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping

import lightning.pytorch as pl
from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities import rank_zero_warn

from lightning_pulse import _lightning_compat as compat

#: by Trainer, the ids of its loggers whose failure was said: once per logger, not at every failed call. Ids,
#: not the loggers: a logger need not be hashable; the Trainer holds its loggers, so no id is reused
_FAILURES_SAID: weakref.WeakKeyDictionary[pl.Trainer, set[int]] = weakref.WeakKeyDictionary()


def log_to_loggers(trainer: pl.Trainer, metrics: Mapping[str, float] | None, step: int | None = None) -> None:
    """Write ``metrics`` to each of ``trainer``'s loggers at ``step``, on rank 0; nothing for empty
    ``metrics``.

    By default at the step Lightning writes the user's own metrics of the same moment
    (``compat.logging_step``): a phase change, an energy figure or a skipped step lines up with the loss of
    the step it belongs to, not one after it.

    A logger that raises is left out of this call, with a warning the first time (:func:`_drop_figures`);
    the loggers after it still get ``metrics``."""
    if not metrics or not trainer.is_global_zero:
        return
    at = compat.logging_step(trainer) if step is None else step
    for logger in trainer.loggers:
        try:
            logger.log_metrics(dict(metrics), step=at)
        except Exception as error:  # the figures are lost to this logger; the run goes on
            _drop_figures(trainer, logger, error)


def log_closed_epoch(trainer: pl.Trainer, metrics: Mapping[str, float] | None) -> None:
    """:func:`log_to_loggers` at a training epoch's start, of the epoch before it (figures final only once it
    has closed): at that epoch's last step, where Lightning writes an epoch's own metrics."""
    log_to_loggers(trainer, metrics, compat.logging_step(trainer, epoch_end=True))


def _drop_figures(trainer: pl.Trainer, logger: Logger, error: Exception) -> None:
    """Say, once per ``logger`` of ``trainer``, that its ``log_metrics`` raised ``error`` and that
    lightning-pulse's figures to it are being dropped (each later call is still tried: a server may come
    back)."""
    said = _FAILURES_SAID.setdefault(trainer, set())
    if id(logger) in said:
        return
    said.add(id(logger))
    rank_zero_warn(
        f"lightning-pulse: {type(logger).__name__}.log_metrics failed ({type(error).__name__}: {error}); "
        "lightning-pulse's figures to this logger are being dropped while it fails (said once), the run and "
        "the other loggers go on. Lightning's own logging to it is not guarded: fix the logger or remove it."
    )
