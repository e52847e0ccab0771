"""PulseCycle's state for a checkpoint saved inside an optimizer step its clock has not counted yet.

PulseCycle counts a step on its clock in its own ``on_train_batch_end``. A checkpoint saved before that (a
``trainer.save_checkpoint`` in the ``on_train_batch_end`` of a callback listed before PulseCycle, a
StabilityGuard listed first that stops the fit) is saved after the step's update, which Lightning counts
processed and resumes after. Saved as it stood, the clock resumed a step behind the run, and every later phase
came a step late (next to a step-saving HardSampleReplay: 28 steps of a 29-step run, weights 0.035 off).

:class:`UncountedStep` saves the clock as that batch end leaves it (:meth:`PhaseClock.counted`), and changes
nothing before it: the batch end counts the same lap (the seconds read at the save, so the run and its
resume count the same) and tells its changes, as always. The listeners' states in the checkpoint are from
before those changes, so a resume tells them: the phase the step trained in (reason ``"resume"``) where a
resume tells the phase, then each change with its own reason once every callback's ``on_train_start`` has
restored its state, as the batch end told them (a maintain entry's probe, a pruning event, a freeze).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import lightning.pytorch as pl

from lightning_pulse import _lightning_compat as compat
from lightning_pulse.phase import PhaseChange, PhaseClock, StepTimer

Lap = tuple[int, float]  # (optimizer steps, seconds), as StepTimer.lap reads them


def _joined(first: Lap | None, second: Lap | None) -> Lap | None:
    if first is None or second is None:
        return first if second is None else second
    return first[0] + second[0], first[1] + second[1]


class UncountedStep:
    """Saves PulseCycle's clock with the step a checkpoint is saved inside, and tells its changes at a resume.

    :meth:`start` at train start (after the timer starts) and :meth:`detach` at its end: only a fit's own
    steps are counted early. Pickled without the Trainer (``ddp_spawn`` pickles callbacks).

    Args:
        timer: PulseCycle's, which reads the steps and seconds its clock counts.
    """

    def __init__(self, timer: StepTimer) -> None:
        self.timer = timer
        self._trainer: weakref.ReferenceType[pl.Trainer] | None = None
        self._early: Lap | None = None  # read at a save, not counted on the clock yet: the batch end does
        self.untold: list[PhaseChange] = []  # a restored state's: to tell at the fit's start
        self._start = compat.HookWatch(compat.after_train_start)

    def detach(self) -> None:
        self._trainer, self._early = None, None
        self._start.stop()

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_trainer": None, "_start": compat.HookWatch(compat.after_train_start)}

    def saved_state(
        self, clock: PhaseClock, steps_per_epoch: float | None, total_steps: float
    ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """``(the clock's state to save, the changes to tell at its resume)``: where the batch fetched last
        has run its step through (``compat.processed_batch_counts``) and the clock has not counted it, the
        clock as PulseCycle's batch end will leave it, and the phase the step trained in followed by that
        batch end's changes (none where it makes none); else the clock as it stands. ``steps_per_epoch`` and
        ``total_steps`` are those the batch end passes to :meth:`PhaseClock.advance`."""
        trainer = None if self._trainer is None else self._trainer()
        if self.untold:  # restored, not told yet (a save in an on_train_start of the resume): keep them
            return clock.state_dict(), [change.to_dict() for change in self.untold]
        if trainer is None or compat.processed_batch_counts(trainer) is None:
            return clock.state_dict(), []
        if compat.in_batch_norm_update_epoch(trainer):  # PulseCycle counts no step of it
            return clock.state_dict(), []
        self._early = _joined(self._early, self.timer.lap(trainer.global_step))
        if self._early is None:  # no step ran since the clock counted the last one (mid accumulation window)
            return clock.state_dict(), []
        after, changes = clock.counted(*self._early, steps_per_epoch, total_steps)
        trained_in = replace(clock.resume_change(), step=after.step)  # what the listeners were told last
        return after.state_dict(), [change.to_dict() for change in (trained_in, *changes)] if changes else []

    def lap(self, step: int) -> Lap | None:
        """At PulseCycle's batch end: the steps and seconds up to optimizer ``step`` that the clock has not
        counted, those a save read early included (:meth:`StepTimer.lap`)."""
        if self._early is None:  # the usual step: no save read it early
            return self.timer.lap(step)
        early, self._early = self._early, None
        return _joined(early, self.timer.lap(step))

    def load(self, saved: Sequence[Mapping[str, Any]]) -> None:
        self.untold = [PhaseChange.from_dict(change) for change in saved]

    def start(self, trainer: pl.Trainer, change: PhaseChange, tell: Callable[[PhaseChange], None]) -> None:
        """At PulseCycle's ``on_train_start``, after the timer started, given the clock's
        :meth:`PhaseClock.start_or_resume` ``change``: count ``trainer``'s steps early from now on, and
        ``tell(change)``. A resume of a clock saved inside a step (:meth:`saved_state`) tells instead the
        phase that step trained in, and the changes its count made, which no listener in the checkpoint was
        told, once every ``on_train_start`` has run (``compat.after_train_start``): a listener listed after
        PulseCycle applies its restored state in its own; the uninterrupted run told them after the step."""
        self._trainer, self._early = weakref.ref(trainer), None
        untold = self.untold
        if not untold or change.reason != "resume":
            self.untold = []
            return tell(change)

        def tell_the_rest(_: Any) -> None:
            self.untold = []
            for later in untold:
                tell(later)

        self._start.once(trainer, tell_the_rest)
