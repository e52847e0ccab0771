"""The contracts between lightning-pulse callbacks, declared once.

A callback takes part in a contract by defining the methods (or the attribute) below; nothing needs to
inherit from these classes. The callbacks that call the hooks find them with :func:`listeners` so that
every contract is looked up the same way, in ``trainer.callbacks`` order.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

from lightning_pulse.core.snapshots import RollbackState

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_pulse.callbacks.pulse_cycle import PulseCycle
    from lightning_pulse.phase import PhaseChange


@runtime_checkable
class PhaseListener(Protocol):
    """Told by :class:`~lightning_pulse.PulseCycle` when the phase changes, after a resume
    (``change.reason == "resume"``) and after a :class:`~lightning_pulse.StabilityGuard` rollback: every
    listener but the guard, restored with the model or not, is told the phase training goes on in (reason
    ``"resume"``, ``change.previous`` ``None``, the phase and cycle it was already in), so that what it set
    for the phase and the rollback took back (a learning rate set in place, which ``rewind_lr_schedule``
    rewinds) is set again. No phase ended: a listener that books per phase must not count one
    (:func:`tell_restored_phase`)."""

    def on_pulse_phase_change(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, change: PhaseChange
    ) -> None: ...


@runtime_checkable
class PhaseStartListener(Protocol):
    """Told by :class:`~lightning_pulse.PulseCycle` that a phase starts, before anything runs for it (a
    maintain phase's probe) and before :class:`PhaseListener` hears of it: what is accounted by time (energy)
    then books the probe to the phase it runs for. A :class:`~lightning_pulse.StabilityGuard` rollback, which
    runs nothing for the restored phase, tells :class:`PhaseListener` only."""

    def on_pulse_phase_begin(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, change: PhaseChange
    ) -> None: ...


@runtime_checkable
class RollbackAware(Protocol):
    """State that a :class:`~lightning_pulse.StabilityGuard` rollback restores with the model.

    ``restore_on_rollback = True`` promises that ``load_state_dict`` works mid-run. A callback whose state
    only partly describes the model (a clock that must not go back) also defines ``rollback_state_dict()``
    and ``load_rollback_state_dict(state)``, which the guard then uses instead.
    """

    restore_on_rollback: bool

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


@runtime_checkable
class ParametersReplacedListener(Protocol):
    """Told when a callback replaced parameter tensors (structured pruning cut channels): ``remap`` maps
    each old parameter to its replacement, so that references to the old tensors can follow.
    :class:`~lightning_pulse.ScheduledPrune` cuts in place: the replacement is the old object, smaller
    (``remap.shape_before(old)`` gives its shape before the cut), so what is shaped like it must be cut."""

    def on_pulse_parameters_replaced(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, remap: Any
    ) -> None: ...


@runtime_checkable
class WeightsChangedListener(Protocol):
    """Told when a callback changed the values of parameters or buffers, in place or by replacing them (every
    :class:`~lightning_pulse.ScheduledPrune` event: an unstructured one writes the ``weight_mask`` buffers,
    which change what the layers compute with no parameter replaced). What was computed from the old values
    (recorded activations) is stale. A replacement is told to :class:`ParametersReplacedListener` first; an
    in-place change has no remap, so it is its own contract rather than an empty one."""

    def on_pulse_weights_changed(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None: ...


@runtime_checkable
class TemporaryFreezer(Protocol):
    """Holds parameters frozen (``requires_grad=False``) only for a while, as
    :class:`~lightning_pulse.GradientCache` does: ``temporarily_frozen(pl_module)`` gives the qualified names
    (as in ``pl_module.named_parameters()``) of those it holds frozen now and will release. A fresh DDP
    wrapper (:func:`~lightning_pulse._lightning_compat.rewrap_ddp`, after a structured prune) is built with
    them trainable, so that its reducer averages their gradients once they train again; what the user froze
    stays out. Names, not tensors: a structural change may replace the parameter objects."""

    def temporarily_frozen(self, pl_module: pl.LightningModule) -> list[str]: ...


@runtime_checkable
class StepUndoer(Protocol):
    """A callback that may drop the update of the optimizer step in flight (skip it, undo it by a rollback, or
    stop): :class:`~lightning_pulse.StabilityGuard`. ``undoes_step(step)`` says whether the update of the step
    that leaves the counter at ``step`` is or will be dropped, asked at that step's batch end, before or after
    the undoer's own batch end (whatever the callbacks' order). A callback that changes the model there asks
    first (:func:`step_undone`) and waits for an applied step: a change made on weights about to be rolled
    back is chosen from bad values, and the rollback finds no snapshot that fits a model cut since
    (:class:`~lightning_pulse.ScheduledPrune` defers its event). Without ``forced_skips``, the steps skipped
    after a rollback (whose weights are the rollback's snapshot's, not diverged) do not count."""

    def undoes_step(self, step: int, forced_skips: bool = True) -> bool: ...


@runtime_checkable
class PauseListener(Protocol):
    """Told when a callback stops training for a while between two steps (a
    :class:`~lightning_pulse.GreenWindow` pause): ``paused=True`` before it, ``False`` after it
    (:func:`pausing`). No step runs in between, so what is counted in training time leaves it out, each on
    its own clock: :class:`~lightning_pulse.PulseCycle`'s phases in seconds (a 15 min burst after a 4 h pause
    had ended after one step), :class:`~lightning_pulse.StabilityGuard`'s step energy (a pause inside a step,
    GreenWindow listed first, was that step's wasted energy)."""

    def on_pulse_pause(self, trainer: pl.Trainer, paused: bool) -> None: ...


_Contract = TypeVar("_Contract")


def listeners(trainer: pl.Trainer, contract: type[_Contract], exclude: object = None) -> Iterator[_Contract]:
    """The callbacks of ``trainer`` that take part in ``contract``, in ``trainer.callbacks`` order.

    ``RollbackAware`` requires ``restore_on_rollback`` to be exactly ``True``: a callback opts in.
    """
    for callback in trainer.callbacks:
        if callback is exclude or not isinstance(callback, contract):
            continue
        if contract is RollbackAware and getattr(callback, "restore_on_rollback", False) is not True:
            continue
        yield callback


def rollback_states(trainer: pl.Trainer, exclude: object = None) -> dict[str, RollbackState]:
    """The state of every ``RollbackAware`` callback, keyed by its index and state key (what a snapshot holds)."""
    aware = listeners(trainer, RollbackAware, exclude=exclude)
    return {f"{trainer.callbacks.index(cb)}:{cb.state_key}": RollbackState(cb) for cb in aware}


def rollback_aware_after(trainer: pl.Trainer, callback: object) -> bool:
    """Whether a ``RollbackAware`` callback is listed after ``callback`` in ``trainer.callbacks``: its
    ``on_train_batch_end`` closes each step's books after ``callback``'s."""
    index = trainer.callbacks.index(callback)
    return any(
        trainer.callbacks.index(aware) > index for aware in listeners(trainer, RollbackAware, callback)
    )


def tell_restored_phase(
    trainer: pl.Trainer, pl_module: pl.LightningModule, cycle: PulseCycle, exclude: object
) -> None:
    """Tell every :class:`PhaseListener` of ``trainer`` but ``exclude`` (the guard that rolled back), in
    ``trainer.callbacks`` order, then each function given to ``cycle.add_listener``, the phase training
    continues in after a rollback (``cycle.clock.resume_change()``, reason ``"resume"``), as after a
    checkpoint restore: a rollback does not turn the clock back. The restored ones follow the phase with the
    state they got back; the others set again what the rollback took back (the optimizers' hyperparameters
    go back with the snapshot)."""
    change = cycle.clock.resume_change()
    for listener in listeners(trainer, PhaseListener, exclude=exclude):
        listener.on_pulse_phase_change(trainer, pl_module, change)
    for function in cycle.added_listeners:
        function(trainer, pl_module, change)


def temporarily_frozen(trainer: pl.Trainer, pl_module: pl.LightningModule) -> set[str]:
    """The names of the parameters that a :class:`TemporaryFreezer` of ``trainer`` holds frozen now."""
    return {
        name
        for freezer in listeners(trainer, TemporaryFreezer)
        for name in freezer.temporarily_frozen(pl_module)
    }


def tell_weights_changed(
    trainer: pl.Trainer, pl_module: pl.LightningModule, remap: Any, exclude: object
) -> None:
    """Tell every :class:`ParametersReplacedListener` of ``remap`` when it replaced any tensor, then every
    :class:`WeightsChangedListener` that weights changed (an event of ``exclude``, which hears neither)."""
    if len(remap):
        for callback in listeners(trainer, ParametersReplacedListener, exclude=exclude):
            callback.on_pulse_parameters_replaced(trainer, pl_module, remap)
    for changed in listeners(trainer, WeightsChangedListener, exclude=exclude):
        changed.on_pulse_weights_changed(trainer, pl_module)


def step_undone(trainer: pl.Trainer, step: int, forced_skips: bool = True) -> bool:
    """Whether a :class:`StepUndoer` of ``trainer`` drops the update of the optimizer step that leaves the
    counter at ``step`` (``forced_skips``: also a skip after a rollback). DDP ranks get the same answer where
    the undoers decide alike (StabilityGuard: on all-reduced numbers)."""
    return any(undoer.undoes_step(step, forced_skips) for undoer in listeners(trainer, StepUndoer))


@contextmanager
def pausing(trainer: pl.Trainer, exclude: object = None) -> Iterator[None]:
    """Tell every :class:`PauseListener` of ``trainer`` that a pause starts, and that it ended (also when it
    ends in an exception, such as a KeyboardInterrupt while sleeping)."""
    told = list(listeners(trainer, PauseListener, exclude=exclude))
    for listener in told:
        listener.on_pulse_pause(trainer, True)
    try:
        yield
    finally:
        for listener in told:
            listener.on_pulse_pause(trainer, False)
