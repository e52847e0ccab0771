"""SuspendSave: GreenWindow's suspend checkpoint, saved once every callback's hook of the step has run.

Saved inside GreenWindow's own ``on_train_batch_end``, the checkpoint held the callbacks listed after it as
they were before their hook of that step ran, a step behind: with ``[GreenWindow, PulseCycle]`` every suspend
and resume trained one more step of the phase in progress. Lightning moves its checkpoint callbacks to the end
of ``trainer.callbacks`` for this reason. GreenWindow is no checkpoint callback (it decides in its hook
whether to save at all, and its place in the list orders its other hooks), so it hands the suspend to a
:class:`SuspendSave` appended at the end of the list: it runs at the end of the same hook, after a
ModelCheckpoint's save of the step, on every rank (``save_checkpoint`` is a collective; every rank takes the
same decision, rank 0's). At the end of a complete run it marks the run's resume files finished
(:meth:`SuspendSave.run_ended`): they used to name the last suspend checkpoint for good, and a wrapper that
looped on ``wait-for-window`` trained the run's tail again from it on every call. At a batch end the states
are taken in that hook and written, and the fit stopped, after the LightningModule's own ``on_train_batch_end``
(Lightning runs it after every callback's): a stop it asks there is kept, or ends the run with no suspend.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_pulse import _lightning_compat as compat
from lightning_pulse.core.green_window import (
    NOTHING_TO_SUSPEND,
    RESUME_FILE,
    Decision,
    decision_line,
    finished_notice,
    mark_resume_files_finished,
    write_resume_notice,
)

SUSPEND_CHECKPOINT = "last-green-window.ckpt"


class SuspendSave(Callback):
    """Saves the suspend a GreenWindow decided (:meth:`due`) at the end of the hook now running (training
    start or a training batch's end), writes when to resume and stops the fit. Stateless: a checkpoint holds
    no entry for it, so a fit resumes from it with or without one, in any callback order.
    """

    def __init__(self) -> None:
        # (owner, decision, now, resume_at, energy, earlier files, undo: what _drop puts back)
        self._due: tuple[Any, Decision, float, float, Any, list[str], tuple[Any, ...]] | None = None
        self._lifted: tuple[int | None, int | None] | None = None  # the Trainer's minimums, lifted to stop

    def attach(self, trainer: pl.Trainer) -> None:
        """Listed last in ``trainer.callbacks`` for this fit (once), after Lightning ordered them."""
        compat.append_callback_for_fit(trainer, self)

    def detach(self, trainer: pl.Trainer) -> None:
        """Out of ``trainer.callbacks`` again; a suspend still due is dropped (the fit raised before it was
        written: the GreenWindow's state is put back, :meth:`_drop`). The Trainer's ``min_epochs``/``min_steps``
        a suspend lifted are put back for a later fit of it."""
        if self._due is not None:
            self._drop(self._due)
            self._due = None
        if self._lifted is not None:
            compat.restore_loop_minimums(trainer, self._lifted)
            self._lifted = None
        compat.remove_callback(trainer, self)

    def due(
        self,
        trainer: pl.Trainer,
        owner: Any,
        decision: Decision,
        suspension: tuple[dict[str, Any], float, float],
        told: bool,
        energy: Any,
    ) -> None:
        """Suspend once every callback's part of the hook now running is done (``suspension``: the record
        for the GreenWindow's state and the clock's now and resume time for the resume file; ``told``: the
        decision switches the run to waiting, its line is logged with the save; ``energy``: the EnergyLogger
        whose later energy is carried). ``owner``, the GreenWindow (``_waiting`` already set): its
        ``suspended`` gets the record, with ``stop_asked`` where a stop was asked by the save
        (:meth:`ask_stop_again`); its ``resume_files`` (in its state, so in the checkpoint) get this suspend's
        now, last; the earlier ones, in other folders, get its record too. Where the suspend is dropped (the
        fit ends at this step anyway, or raises first) its state, the decision in its report and the log
        are as if it had never been decided (:meth:`_drop`)."""
        (record, now, resume_at), schedule = suspension, owner.schedule
        file, before = str(_folder(trainer) / RESUME_FILE), list(owner.resume_files)
        owner.suspended = record
        owner.resume_files[:] = [*(earlier := [other for other in before if other != file]), file]
        line = decision_line(decision, "suspend", owner.run_clock.time()) if told else None
        # its record in the report: rank 0 decided (the latest); the other ranks have none
        decided = schedule.decisions[-1] if trainer.is_global_zero and schedule.decisions else None
        self._due = (owner, decision, now, resume_at, energy, earlier, (before, told, line, decided))

    @staticmethod
    def ask_stop_again(trainer: pl.Trainer, suspended: dict[str, Any] | None) -> None:
        """At the train start of a fit resumed from a suspend (``suspended``: its record), a stop asked before
        it is asked again: an EarlyStopping's at an epoch end that ``Trainer(min_epochs/min_steps)`` held
        back. Lightning keeps no ``should_stop`` in a checkpoint, and the suspend's own stop hid it; the
        resumed fit trained on to the epoch's end, past where the uninterrupted run stopped (26 steps for 22).
        Lightning acts on it as in that run: once the minimums are met, at once where they are."""
        if suspended is not None and suspended.get("stop_asked"):
            trainer.should_stop = True
            rank_zero_info("GreenWindow: the stop asked before the suspend is asked again.")

    def run_ended(self, trainer: pl.Trainer, status: str, files: list[str], now: float) -> None:
        """At train end (``now`` on the clock itself): a complete run marks its resume files (``files``, and
        the one in its checkpoint folder) finished, so that ``wait-for-window`` sends no wrapper back to its
        last suspend. The folder's own file only where attached (suspend mode): a run resumed in another mode
        marks its earlier suspends' files only. Rank 0 writes; a fast_dev_run writes no file."""
        attached = any(callback is self for callback in trainer.callbacks)
        if (
            status != "complete"
            or not (attached or files)
            or trainer.fast_dev_run
            or not trainer.is_global_zero
        ):
            return
        folder = _folder(trainer) if attached else None
        written, failure = mark_resume_files_finished(folder, files, now, trainer.global_step)
        if failure is not None:
            rank_zero_warn(failure)
        if written:
            rank_zero_info(finished_notice(written))

    def _save_due(self, trainer: pl.Trainer, batch_end: bool) -> None:
        if self._due is None:
            return
        checkpoint = compat.dump_checkpoint(trainer)  # every callback's state after its hook; written below
        if not batch_end:
            self._finish(trainer, checkpoint, False)
            return
        # the module's own on_train_batch_end runs after every callback's: a stop it asks is read after it
        compat.after_module_batch_end(trainer, lambda trainer: self._finish(trainer, checkpoint, True))

    def _finish(self, trainer: pl.Trainer, checkpoint: dict[str, Any], batch_end: bool) -> None:
        if self._due is None:  # detached: the fit raised in between
            return
        due, self._due = self._due, None
        owner, decision, now, resume_at, energy, earlier, (_, _, line, _) = due
        # the fit ends here anyway (its last step, a stop that takes effect), complete: nothing to suspend (a
        # resume trained 0 steps, after wait-for-window waited for it); a max_time stop with work left suspends
        ends = batch_end and compat.fit_ends_after_this_step(trainer)
        ends = ends and compat.run_end_status(trainer, False) == "complete"
        # rank 0's word on every rank: the save is a collective, and a Timer's time left is the rank's own (its
        # on_train_start's): a rank whose Timer started later found "complete" and left rank 0 in the barrier
        if trainer.world_size > 1:
            ends = compat.from_rank_zero(trainer)([ends])[0]  # type: ignore[misc]
        if ends:
            self._drop(due)
            rank_zero_info(NOTHING_TO_SUSPEND)
            return
        if line is not None:
            rank_zero_info(line)
        if trainer.should_stop:  # asked before, or by the module's hook; stop_this_fit sets it anyway
            owner.suspended["stop_asked"] = True
            checkpoint["callbacks"][owner.state_key]["suspended"] = owner.suspended
        folder = _folder(trainer)
        compat.write_checkpoint(trainer, checkpoint, path := folder / SUSPEND_CHECKPOINT)
        if energy is not None:  # its energy after this (Lightning validates after a stop) is carried
            energy.account.saved_for_suspend(path)
        if trainer.is_global_zero:
            rank_zero_info(
                write_resume_notice(folder, now, resume_at, path, decision, owner.schedule, earlier)
            )
        # here: the callbacks before this one ran their hook as if never stopped. Trainer(min_epochs/min_steps)
        # would overrule a bare should_stop (it trained on through the dirty hours, suspending again and
        # again): lifted for this fit, a resumed fit has them from its Trainer's arguments
        lifted = compat.stop_this_fit(trainer)
        self._lifted = lifted if self._lifted is None else self._lifted

    @staticmethod
    def _drop(due: tuple[Any, ...]) -> None:
        """A suspend :meth:`due` set up and that is not written: the GreenWindow's ``suspended``,
        ``resume_files`` and waiting put back, and the decision taken back from its report."""
        owner, (before, told, _, decided) = due[0], due[-1]
        owner.suspended, owner.resume_files[:] = None, before
        owner._waiting = not told  # waiting before only where the decision was no switch
        owner.schedule.withdraw(decided)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._save_due(trainer, False)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._save_due(trainer, True)


def _folder(trainer: pl.Trainer) -> Path:
    """The folder of the suspend checkpoint and the resume file: the ModelCheckpoint's (absolute: a resumed
    run may start in another working directory)."""
    checkpointing = trainer.checkpoint_callback
    return Path(checkpointing.dirpath or trainer.default_root_dir).absolute()  # type: ignore[union-attr]
