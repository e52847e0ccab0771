"""When StabilityGuard takes its snapshots, so that each holds every callback's state of its moment.

Lightning calls a hook on the callbacks in list order, so a snapshot taken inside the guard's own hook holds
the callbacks listed after it as they were before their part of that hook. Two moments need the others done:

* the fit's start: after every ``on_train_start`` (a ScheduledPrune listed after the guard plans its schedule
  there; taken before, a rollback to it switched pruning off), from the strategy's ``on_train_start``, which
  the fit loop calls after the callbacks' and the module's (``compat.after_train_start``);
* a step's end, where a ``RollbackAware`` callback is listed after the guard (HardSampleReplay closes the
  step's books in its batch end) or a maintain entry is told after the guard's batch end: after every
  callback's ``on_train_batch_end`` (``compat.after_train_batch_ends``).

With the guard listed after every ``RollbackAware`` callback a step's snapshot is taken in its own batch end,
as always. Plain Lightning glue, no per-step work: the hooks are installed only where a snapshot is due.

A checkpoint's moment too: :attr:`SnapshotMoments.unfinished_step` tells a save inside a step whose update has
not run, which a resume trains again (``compat.in_unfinished_step``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl

from lightning_pulse import _lightning_compat as compat
from lightning_pulse.protocols import rollback_aware_after


class SnapshotMoments:
    """Takes the guard's snapshots (``take``) at the moments the module docstring names."""

    def __init__(self) -> None:
        self._start = compat.HookWatch(compat.after_train_start)
        self._end = compat.HookWatch(compat.after_train_batch_ends)
        self._plateaus = compat.HookWatch(compat.after_plateau_updates)  # a snapshot's plateau readings
        self._after_others = False  # a RollbackAware callback listed after the guard closes steps later
        # a step whose snapshot waits for every batch end (a checkpoint saved in between holds none of it)
        self.due_step: int | None = None
        self.unfinished_step = compat.UnfinishedStepWatch()  # the fit's, from its start (past an exception)

    def fit_starts(self, trainer: pl.Trainer, guard: Any, take: Callable[[], None]) -> None:
        """At the guard's ``on_train_start``: the fit-start snapshot once every ``on_train_start`` ran."""
        self._after_others = rollback_aware_after(trainer, guard)
        self.unfinished_step.watch(trainer)
        self._start.watch(trainer, lambda _: take())

    def step_ends(self, trainer: pl.Trainer, take: Callable[[], None], told_late: bool = False) -> None:
        """Snapshot the step just ended: now, or once every callback's batch end closed it (``told_late``: a
        maintain entry told after the guard's batch end; or a ``RollbackAware`` callback listed after the
        guard), if the run is still at that step then."""
        if not (told_late or self._after_others):
            return take()
        step = self.due_step = trainer.global_step

        def take_when_done(_: Any) -> None:
            self.due_step = None
            if trainer.global_step == step:
                take()

        self._end.once(trainer, take_when_done)

    def plateau_readings(self, trainer: pl.Trainer, take: Callable[[Any], None]) -> None:
        """``take(plateaus)`` after Lightning's plateau updates of this batch (``compat.after_plateau_updates``:
        a snapshot's readings), removed by :meth:`stop` if the fit ends before them."""
        self._plateaus.watch(trainer, take)

    def stop(self) -> None:
        """Remove what is installed (the fit's end, an exception)."""
        self.due_step = None
        self._start.stop()
        self._end.stop()
        self._plateaus.stop()
