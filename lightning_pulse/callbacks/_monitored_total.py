"""MonitoredTotal: EnergyLogger's ``energy/total_kwh`` in ``trainer.callback_metrics`` where monitors read it.

EnergyLogger puts the run's total there at every training epoch's end. ``EarlyStopping`` and
``ModelCheckpoint`` also check at a fit-time validation's end (``val_check_interval`` below an epoch, or any
validation that is not once an epoch), which Lightning runs before the training epoch's end: before the first
epoch end the key was missing and the fit crashed ("not available", "could not find the monitored key");
later it held the last epoch end's figure. So the total is published at the end of every fit-time validation
too, in ``on_validation_epoch_end``: every callback's runs before any ``on_validation_end``, where the
monitors check (``ModelCheckpoint`` is moved last by Lightning, ``EarlyStopping`` is not, so EnergyLogger's
own ``on_validation_end`` could come after it). And at the training steps where a
``ModelCheckpoint(monitor="energy/total_kwh", every_n_train_steps=n)`` saves (EnergyLogger's batch end runs
before it: Lightning moves checkpoint callbacks last); every rank is at the same step, so the read-out's
collective is reached by all. A ``train_time_interval`` save comes at times rank 0's clock picks, which the
ranks cannot foresee without a collective every step: warned at fit start instead.

Plain Lightning glue, no per-step work without such a ModelCheckpoint (one check of an empty tuple).
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_warn

from lightning_pulse import _lightning_compat as compat
from lightning_pulse.energy.account import EnergyAccount, TensorCollective
from lightning_pulse.loggers import refuse_logger_only_monitors

MONITORED = "energy/total_kwh"


class MonitoredTotal:
    """Publishes the running total (a read-out of every rank's meters, :meth:`publish`) where a monitor reads
    it between epoch ends; ``steps``: the ``every_n_train_steps`` of the ModelCheckpoints monitoring it."""

    def __init__(self) -> None:
        self.steps: tuple[int, ...] = ()
        self._published_step = -1

    def fit_starts(self, trainer: pl.Trainer) -> None:
        """At ``on_train_start``: the training steps where a ModelCheckpoint reads the total (not the step the
        fit starts at: nothing has trained in this fit there); a warning for time-triggered saves. A monitor
        on any other ``energy/`` figure (logger-only) is refused (:func:`refuse_logger_only_monitors`)."""
        refuse_logger_only_monitors(trainer, "EnergyLogger", "energy/", published=(MONITORED,))
        self.steps, timed = compat.checkpoints_monitoring(trainer, MONITORED)
        self._published_step = trainer.global_step
        if timed:
            rank_zero_warn(
                f"EnergyLogger: ModelCheckpoint(monitor={MONITORED!r}, train_time_interval={timed[0]}) saves "
                f"at times rank 0's clock picks, where `{MONITORED}` holds the figure of the latest "
                "validation or epoch end (none before the first: Lightning then waits for the next "
                "validation's end to save). For the total at the save itself, use `every_n_train_steps` "
                "(published at those steps) or save at validation or epoch ends."
            )

    def due_at(self, step: int) -> bool:
        """Whether a ModelCheckpoint reads the total at this batch end (``global_step`` ``step``): once a
        step (a step's later micro-batches under accumulation are not), the condition ModelCheckpoint uses.
        The same on every rank."""
        if step == self._published_step or all(step % every for every in self.steps):
            return False
        self._published_step = step
        return True

    def read_out(self, trainer: pl.Trainer, account: EnergyAccount, collective: TensorCollective) -> None:
        """Publish the account's running total (:meth:`EnergyAccount.running_total_kwh`). Every rank calls
        it at the same point: under DDP it gathers. A failure warns once and never fails the run."""
        try:
            value = account.running_total_kwh(collective)
        except Exception as error:  # as `guarded_hook`: instrumentation never stops training
            message = f"EnergyLogger: reading the running total failed ({type(error).__name__}: {error})."
            return account.warn_once("running_total_kwh", message)
        self.publish(trainer, value)

    @staticmethod
    def publish(trainer: pl.Trainer, value: float | None) -> None:
        """Put ``value`` where the monitors read it; ``None`` (nothing metered): no figure, rather than a 0.
        Not ``pl_module.log``: its bookkeeping costs about 0.5 ms per call."""
        if value is not None:
            compat.set_callback_metric(trainer, MONITORED, value)
