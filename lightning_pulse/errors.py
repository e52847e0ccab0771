"""The one exception a lightning-pulse callback raises when it refuses a run at fit start, and the checks
that several callbacks share: pytorch_lightning's Trainer, sharded strategies, Tuner searches, one training
run per instance, one instance per checkpoint key (a user's subclass keeps its lightning-pulse class's key),
states loaded by validate, test or predict, parameters a lazy module has not created yet, a plain check's
``ValueError`` as a refusal, a refusal rank 0 alone meets as a value it shares, and the argument checks (a
callback's name first in its errors, numpy numbers as Python's, nested configs given as mappings)."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import numbers
import os
import sys
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import numpy as np
from lightning.pytorch.trainer.states import TrainerFn, TrainerState, TrainerStatus
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.nn.parameter import is_lazy

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback
    from torch import nn


def first_names(names: Sequence[str], most: int) -> str:
    """``"a, b, c and 5 more"``: the first ``most`` of ``names``, and how many a message leaves out."""
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return ", ".join(names[:most]) + more


class PulseRefusal(MisconfigurationException):
    """A callback cannot handle this model, strategy or run, and says so before the first step.

    The message names the callback, the reason and the way out, e.g. ``"PulseCycle: epoch-based phase
    durations need a dataloader with a length; give the durations in steps or seconds instead."``. The
    ``lightning-pulse`` command prints it as one line (exit code 2) instead of a traceback.
    """


def tell_no_report(error: BaseException, where: str, in_train_loop: bool) -> None:
    """The EnergyLogger's info line for a fit that ``error`` stopped ``where`` (as its account says) with
    nothing trained; none for a refusal or a misconfiguration before the first training batch (a
    :class:`PulseRefusal` or Lightning's ``MisconfigurationException`` there, a ``ValueError`` or
    ``TypeError`` before the training loop: at setup or fit start), whose own message says what stopped the
    fit: the line before it only pushed it off the first line."""
    refused = isinstance(error, MisconfigurationException) or (
        isinstance(error, (ValueError, TypeError)) and not in_train_loop
    )
    if not (refused and where.startswith("before")):
        rank_zero_info(f"EnergyLogger: the fit stopped {where}; no energy report.")


class StabilityGuardError(RuntimeError):
    """Raised by :class:`~lightning_pulse.StabilityGuard` when rollbacks no longer help; a checkpoint was saved
    first, at ``checkpoint_path`` (``None`` where that save failed: the message says why, and the error is
    chained to the save's)."""

    def __init__(self, message: str, checkpoint_path: str | None) -> None:
        super().__init__(message)
        self.checkpoint_path = checkpoint_path


@contextmanager
def refusing(callback: str) -> Iterator[None]:
    """Turn a ``ValueError`` raised inside the block by a plain-Python check (a clock, a schedule, a span given
    as a share of a run of unknown length) into a :class:`PulseRefusal` starting with ``callback``'s name."""
    try:
        yield
    except ValueError as error:
        raise PulseRefusal(f"{callback}: {error}") from None


def result_or_refusal(call: Callable[..., Any], *args: Any) -> Any:
    """``call(*args)``, or the :class:`PulseRefusal` it raised, returned: for what rank 0 alone computes and
    broadcasts, so that the caller raises the refusal on every rank after the broadcast. Raised on rank 0
    before it, it left the other ranks waiting there (gloo ends them with "Connection closed by peer", NCCL
    at the process group's timeout)."""
    try:
        return call(*args)
    except PulseRefusal as refusal:
        return refusal


def names_itself(init: Callable[..., None]) -> Callable[..., None]:
    """Decorate a callback's ``__init__`` so that a ``ValueError`` it raises starts with the callback's name, as
    Lightning's own messages do: "StabilityGuard: `window`=1 must be an int >= 2." The arguments (a config
    dataclass's fields, for a ``__post_init__``) go through :func:`plain_argument` first. The signature is
    kept (``functools.wraps``), so LightningCLI reads the same arguments."""

    @functools.wraps(init)
    def checked(self: Any, *args: Any, **kwargs: Any) -> None:
        if init.__name__ == "__post_init__":  # a config dataclass: its fields are the arguments
            plain_fields(self)
        args = tuple(plain_argument(value) for value in args)
        kwargs = {key: plain_argument(value) for key, value in kwargs.items()}
        try:
            init(self, *args, **kwargs)
        except ValueError as error:
            name = type(self).__name__
            text = str(error)
            if text.startswith(name):
                raise
            raise ValueError(f"{name}: {text}") from None
        except OverflowError:  # float(10**400) in a check: a bare "int too large to convert to float"
            if (field := _beyond_float_range(init, self, args, kwargs)) is None:
                raise
            name = type(self).__name__
            beyond = f"{name}: `{field}` is an integer beyond the range of a float ({FLOAT_RANGE})"
            allowed = _check_as_infinity(init, self, args, kwargs, field)
            raise ValueError(beyond + (f"; as inf: {allowed}" if allowed else ".")) from None

    return checked


def _beyond_float_range(init: Callable[..., None], owner: Any, args: tuple, kwargs: dict) -> str | None:
    """The name of the first argument of ``init`` (a config dataclass's field, for a ``__post_init__``) that is
    an integer too large for a float, or ``None``."""
    if init.__name__ == "__post_init__":
        return next((field for field, value in vars(owner).items() if too_large_for_float(value)), None)
    try:
        named = inspect.signature(init).bind(owner, *args, **kwargs).arguments
    except TypeError:
        return None
    return next((field for field, value in named.items() if too_large_for_float(value)), None)


#: how an integer beyond the float range is told: what a float-valued argument can hold
FLOAT_RANGE = f"at most {sys.float_info.max:.4g}"


def too_large_for_float(value: Any) -> bool:
    """Whether ``value`` is an integer that a check's ``float(value)`` would meet with ``OverflowError``."""
    return isinstance(value, int) and not isinstance(value, bool) and abs(value) > sys.float_info.max


def _check_as_infinity(init: Callable[..., None], owner: Any, args: tuple, kwargs: dict, field: str) -> str:
    """What the argument checks say of ``field`` given as an infinity of its sign: the range they allow
    (``"`replay_fraction`=inf must be a number in (0, 1]."``), or ``""`` where they accept it or say something
    else."""
    try:
        if init.__name__ == "__post_init__":
            object.__setattr__(owner, field, math.inf if getattr(owner, field) > 0 else -math.inf)
            init(owner)
        else:
            bound = inspect.signature(init).bind(owner, *args, **kwargs)
            bound.arguments[field] = math.inf if bound.arguments[field] > 0 else -math.inf
            init(*bound.args, **bound.kwargs)
    except ValueError as error:
        return str(error).removeprefix(f"{type(owner).__name__}: ") if field in str(error) else ""
    except Exception:
        return ""
    return ""


def plain_number(value: Any) -> Any:
    """``value`` as a Python ``int`` when it is an integer of another type (``np.int64(100)``, as numpy and
    Hydra sweeps give), as a ``float`` when it is a real of another type (``np.float32(0.1)`` as ``0.1``,
    the decimal it prints as, not the binary float32 widened: a duration of 0.3 epoch ends where Python's 0.3
    does), a numpy bool as ``bool``; anything else as it is. A bool stays a bool (refused where a number is
    asked), and so do ``Fraction`` (exact, so a float would change it) and ``Decimal`` (not a
    ``numbers.Real``): the checks refuse them by name."""
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, bool) or type(value) in (int, float) or not isinstance(value, numbers.Real):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, np.floating) and value.dtype.itemsize < 8:
        return float(str(value))  # numpy prints the shortest decimal that reads back as the same float32
    return value if isinstance(value, numbers.Rational) else float(value)


def plain_argument(value: Any) -> Any:
    """:func:`plain_number`, a 1-D numpy array of strings or objects as a list (``phases``, ``order``,
    ``layer_types`` from a numpy or Hydra sweep: a list check would otherwise meet numpy's "truth value of
    an array is ambiguous", naming no field), and a 0-d array as its one value."""
    if isinstance(value, np.ndarray) and value.ndim == 1 and value.dtype.kind in "UO":
        return value.tolist()
    if isinstance(value, np.ndarray) and value.ndim == 0:
        value = value.item()
    return plain_number(value)


def plain_fields(config: Any) -> None:
    """:func:`plain_number` on each field of a (possibly frozen) config dataclass, before its checks read
    them: a checkpoint or report keeps Python numbers (``torch.load(weights_only=True)`` refuses numpy's)."""
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if (plain := plain_number(value)) is not value:
            object.__setattr__(config, field.name, plain)


def as_config(value: Any, cls: type, field: str) -> Any:
    """``value`` as a ``cls`` dataclass: ``None`` and instances as they are, a mapping as ``cls(**value)``."""
    if value is None or isinstance(value, cls):
        return value
    if isinstance(value, Mapping):
        try:
            return cls(**value)
        except TypeError as error:
            raise ValueError(f"`{field}`={dict(value)!r}: {error}.") from None
    raise ValueError(f"`{field}`={value!r} must be a {cls.__name__} (or a mapping of its fields) or None.")


def unwritable_dir_reason(directory: str | os.PathLike) -> str | None:
    """Why ``directory`` cannot hold files written later (``"it cannot be created: ..."``, ``"it is not
    writable"``), or ``None``; a missing folder is created, as the writer would."""
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as error:
        return f"it cannot be created: {error.strerror or error}"
    return None if os.access(directory, os.W_OK | os.X_OK) else "it is not writable"


def uncreatable_dir_reason(directory: str | os.PathLike) -> str | None:
    """:func:`unwritable_dir_reason` without creating ``directory``: why it could not be created (its first
    existing parent is no folder, or not writable) or written, or ``None``."""
    path = target = os.path.abspath(directory)
    while not os.path.lexists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    if not os.path.isdir(path):
        return f"it cannot be created: {path!r} is not a folder"
    if not os.access(path, os.W_OK | os.X_OK):
        return "it is not writable" if path == target else f"it cannot be created: {path!r} is not writable"
    return None


def refuse_unwritable_dir(
    callback: str, field: str, directory: str | os.PathLike | None, trainer: pl.Trainer | None = None
) -> None:
    """Raise :class:`PulseRefusal` at fit start for a report folder that cannot be created or written: the
    report is written at the end, and a run should not learn after all its training that it is lost. Without
    ``directory``, the ``trainer``'s run folder, where the report goes by default
    (:func:`~lightning_pulse.loggers.refuse_unwritable_run_folder`)."""
    if directory is None:
        if trainer is not None:
            from lightning_pulse.loggers import refuse_unwritable_run_folder  # it imports this module

            refuse_unwritable_run_folder(trainer, callback, field)
        return
    if (reason := unwritable_dir_reason(directory)) is not None:
        raise PulseRefusal(
            f"{callback}: `{field}`={os.fspath(directory)!r} cannot hold the report ({reason}); give a writable "
            "folder, or None for the run's own folder."
        )


def refuse_uninitialized_parameters(module: nn.Module, callback: str) -> None:
    """Raise :class:`PulseRefusal` at fit start when a lazy module of ``module`` (``nn.LazyLinear``,
    ``nn.LazyConv2d``, ...) has not created its parameters or buffers yet: they exist only after the model's
    first forward, and ``callback`` reads every weight before the first step (torch's own error there names
    neither the callback nor the way out). A validation sanity check runs that forward before training starts,
    if ``validation_step`` calls it; a lazy module the forward never calls is created by neither."""
    lazy = [name for name, tensor in (*module.named_parameters(), *module.named_buffers()) if is_lazy(tensor)]
    if lazy:
        raise PulseRefusal(
            f"{callback}: the model's {first_names(lazy, 3)} do not exist yet (a lazy module such as "
            f"nn.LazyLinear creates them the first time it is called), and {callback} reads every weight "
            "before the first step. Run one forward on an example batch in the LightningModule's `setup` or "
            "`configure_model` (e.g. `self(self.example_input_array)`), or keep a validation loader whose "
            "`validation_step` runs the forward (num_sanity_val_steps > 0); a lazy module the forward never "
            "calls (an auxiliary head) must be created (call it once) or removed."
        )


def sharded_strategy_name(trainer: pl.Trainer) -> str | None:
    """The name of the trainer's strategy when it shards parameters or gradients (FSDP, DeepSpeed, model
    parallel), else ``None``. Under those a rank holds a shard, so per-rank norms, masks and ``requires_grad``
    flags are not the model's."""
    from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy

    strategy = trainer.strategy
    for sharded in (FSDPStrategy, DeepSpeedStrategy, ModelParallelStrategy):
        if isinstance(strategy, sharded):
            return type(strategy).__name__
    return None


def refuse_sharded_strategy(trainer: pl.Trainer, callback: str, reason: str) -> None:
    """Raise :class:`PulseRefusal` naming ``callback``, the strategy and ``reason`` under a sharded strategy."""
    name = sharded_strategy_name(trainer)
    if name is not None:
        raise PulseRefusal(
            f"{callback} does not support {name}: {reason}. Train with strategy='ddp' (or one device), "
            f"or remove {callback} from the callbacks."
        )


def tuner_search(trainer: pl.Trainer) -> str | None:
    """The class name of an attached learning-rate or batch-size search, else ``None``.

    ``Tuner.lr_find`` and ``Tuner.scale_batch_size`` run their trials as a fit carrying these callbacks, and
    restore the checkpoint they saved before the trials when done.
    """
    from lightning.pytorch.callbacks import BatchSizeFinder, LearningRateFinder

    for callback in getattr(trainer, "callbacks", ()):
        if isinstance(callback, (LearningRateFinder, BatchSizeFinder)):
            return type(callback).__name__
    return None


def pulse_class(callback: object) -> type:
    """The lightning-pulse class ``callback`` is an instance of: the first class in its MRO defined in the
    lightning-pulse package (``PulseCycle`` for a user's ``class MyCycle(PulseCycle)``)."""
    return _pulse_class_of(type(callback))


# kept per class: Lightning reads ``state_key`` (hence this) at every hook call of every callback, six times a
# training step each; walking the MRO each time cost 1.3 µs a read warm (0.3 µs cached), outside the hooks
@functools.lru_cache(maxsize=256)
def _pulse_class_of(kind: type) -> type:
    from lightning.pytorch.callbacks import Callback

    def ours(cls: type) -> bool:  # a callback class of the package (not a mixin of it)
        module = getattr(cls, "__module__", None) or ""
        return module.partition(".")[0] == __package__ and issubclass(cls, Callback)

    return next((cls for cls in kind.__mro__ if ours(cls)), kind)


def refuse_shared_key(trainer: pl.Trainer, callback: Callback) -> None:
    """Raise :class:`PulseRefusal` when another of the trainer's callbacks has ``callback``'s ``state_key``.

    A checkpoint keeps one state per key, so a resume would load the last one saved into each instance (one
    EnergyLogger reporting the other's power, two PulseCycles' clocks). Lightning checks the keys only for
    ``Trainer(callbacks=...)``: those returned by ``LightningModule.configure_callbacks`` join the list later.
    """
    key, name = callback.state_key, pulse_class(callback).__qualname__
    # entries of the list (an instance listed twice runs its hooks twice), stateful ones only: Lightning's own
    # check's rule (a callback without a state_dict saves nothing)
    callbacks = getattr(trainer, "callbacks", ())
    sharing = [other for other in callbacks if other.state_key == key and _stateful(other)]
    if len(sharing) < 2:
        return
    distinct = (
        ", or give each a distinct `prefix`" if isinstance(getattr(callback, "prefix", None), str) else ""
    )
    kinds = sorted({type(other).__qualname__ for other in sharing})  # a subclass beside its base class
    subclass = f" ({' and '.join(kinds)}: a subclass saves under its lightning-pulse class's key)"
    raise PulseRefusal(
        f"{name}: {len(sharing)} callbacks share the checkpoint key {key!r} (e.g. returned by "
        "LightningModule.configure_callbacks, whose callbacks Lightning does not check for unique keys), so "
        "a checkpoint would keep one state for all of them and a resume would load it into each. Keep one "
        f"{name}"
        f"{subclass if len(kinds) > 1 else ''}{distinct}."
    )


def refuse_other_lightning_package(trainer: pl.Trainer, callback: Callback) -> None:
    """Raise :class:`PulseRefusal` when ``trainer`` is ``pytorch_lightning``'s, not ``lightning``'s.

    The two packages ship the same code under distinct classes. A ``pytorch_lightning.Trainer`` runs these
    callbacks' hooks, but every check of its strategy, loggers, precision or callbacks against
    ``lightning.pytorch``'s classes misses: StabilityGuard crashed at train start, and ScheduledPrune refused
    a single device as an unsupported strategy.
    """
    # any class of the MRO: a project's own wrapper (`class Trainer(pytorch_lightning.Trainer)`) comes first
    if any(base.__module__.partition(".")[0] == "pytorch_lightning" for base in type(trainer).__mro__):
        name = pulse_class(callback).__qualname__
        raise PulseRefusal(
            f"{name}: this Trainer is pytorch_lightning.Trainer (or a subclass of it), and lightning-pulse runs on the `lightning` "
            "package's (the same code under other classes, which its checks of strategies, loggers and "
            "callbacks would miss); import the Trainer and your LightningModule from `lightning.pytorch` "
            "(`import lightning.pytorch as pl`) instead of `pytorch_lightning`."
        )


def _stateful(callback: Callback) -> bool:
    from lightning.pytorch.callbacks import Callback

    return type(callback).state_dict is not Callback.state_dict


class FitRestores:
    """Tells a callback whether a state Lightning loads into it is a resume of the fit it starts.

    Lightning loads a checkpoint's callback states in every stage: ``trainer.validate(ckpt_path=...)``
    (``test``, ``predict``) loads them too, to evaluate the checkpoint's weights. Kept, such a state would be
    carried into the next ``trainer.fit`` of the same instances, which has no ``ckpt_path`` and starts at
    step 0 (evaluate a checkpoint, then fine-tune the model that holds its weights). :meth:`setup`, in every
    stage (Lightning calls the ``setup`` hooks before it restores), notes the trainer; :meth:`restored`, from
    ``load_state_dict``, says to drop the state while that trainer runs another stage than fit. A load
    outside a running trainer (by hand) and one during a fit (a resume, a StabilityGuard rollback) apply.
    """

    def __init__(self) -> None:
        self._trainer_state: TrainerState | None = None  # one object for the Trainer's life, updated in place
        self._trainer: weakref.ReferenceType[pl.Trainer] | None = None  # weak: not its model and data

    def setup(self, trainer: pl.Trainer, callback: Callback) -> None:
        """At ``callback``'s ``setup`` hook, in every stage (before Lightning restores a checkpoint into the
        callback); refuses ``pytorch_lightning``'s Trainer (:func:`refuse_other_lightning_package`); at a
        fit's, refuses a second callback with its checkpoint key (:func:`refuse_shared_key`).
        """
        self._trainer_state = getattr(trainer, "state", None)  # a stand-in trainer (a test's) may have none
        try:
            self._trainer = weakref.ref(trainer)
        except TypeError:  # a stand-in trainer without weak references
            self._trainer = None
        refuse_other_lightning_package(trainer, callback)
        if getattr(self._trainer_state, "fn", None) == TrainerFn.FITTING:
            refuse_shared_key(trainer, callback)

    def restored(self) -> bool:
        """From ``load_state_dict``: whether to load the state (not while validate, test or predict run)."""
        state = self._trainer_state
        return state is None or state.status != TrainerStatus.RUNNING or state.fn == TrainerFn.FITTING

    def tuner_restore(self) -> bool:
        """From ``load_state_dict``: whether the load is a batch-size or learning-rate search putting back the
        state it saved before its trials (inside the fit's ``on_fit_start``), not a resume."""
        from lightning_pulse import _lightning_compat as compat  # it imports this module

        trainer = None if self._trainer is None else self._trainer()
        return trainer is not None and compat.restoring_tuner_checkpoint(trainer)

    def __getstate__(self) -> dict[str, Any]:  # pickled by ``ddp_spawn`` after a fit too: no weak reference
        return {**self.__dict__, "_trainer": None}


class OneRunPerInstance(FitRestores):
    """Refuses a second training run of a callback instance whose state belongs to its first run.

    Such a callback holds one run's plan and tables (a phase clock planned for that run's length, a score
    table of its data, units of its module, snapshots of its weights). Carried into another ``trainer.fit``,
    on the same Trainer or a new one (a loop over folds), they would be silently wrong. :meth:`start`, at
    ``on_train_start``, refuses when this instance already started a run, unless a checkpoint was just
    restored into it (:meth:`restored`, from ``load_state_dict``: a resume); then it records the run. A Tuner
    search (a ``BatchSizeFinder`` or ``LearningRateFinder``, as callbacks or through ``Tuner``) does not count
    as a run, and its restore of the state it saved before its trials is no resume either
    (:meth:`FitRestores.tuner_restore`): the real fit after it is refused or recorded as without the search.
    A state loaded by validate, test or predict is dropped (:class:`FitRestores`): it is no resume. An earlier
    fit that stopped before its first optimizer step (a refusal at train start, an exception in the first
    ``training_step``) is refused too (the instance may be partly set up for it), and so is a ``fast_dev_run``
    smoke test; the message says which.

    Args:
        callback: the callback's name, for the message.
    """

    def __init__(self, callback: str) -> None:
        super().__init__()
        self.callback = callback
        self.started_at_step: int | None = None
        self._restored = False
        # the started fit's optimizer steps, read at the next start (its Trainer may be gone by then)
        self._steps_counted: Callable[[], int] | None = None
        self._smoke_test = False  # the started fit was a fast_dev_run

    def restored(self) -> bool:
        """A checkpoint's state is loaded into the instance (a mid-run rollback is cleared at the run's end):
        whether to load it (:meth:`FitRestores.restored`)."""
        if not super().restored():
            return False
        # a search putting back the state it saved before its trials: loaded as before, but it is no resume
        self._restored = self._restored or not self.tuner_restore()
        return True

    def start(self, trainer: pl.Trainer) -> None:
        """At ``on_train_start``.

        Raises:
            PulseRefusal: when the instance already trained a run and nothing was restored into it.
        """
        restored, self._restored = self._restored, False
        if self.started_at_step is not None and not restored:
            raise PulseRefusal(self._second_run_message())
        from lightning_pulse import _lightning_compat as compat  # it imports this module

        self.started_at_step = trainer.global_step
        self._steps_counted = compat.optimizer_steps_counter(trainer)
        self._smoke_test = bool(getattr(trainer, "fast_dev_run", False))

    def _second_run_message(self) -> str:
        """The refusal of a second run: what the earlier fit of this instance did decides the way out."""
        name, step = self.callback, self.started_at_step
        counted = None if self._steps_counted is None else self._steps_counted()
        if counted is not None and step is not None and counted <= step:
            return (
                f"{name}: this instance's earlier trainer.fit stopped before its first optimizer step (a "
                "refusal or an exception at train start or in the first training_step): it trained nothing, "
                "but it may have left the instance partly set up for that fit. Create new callbacks for this "
                "fit (build the callback list again)."
            )
        if self._smoke_test:
            return (
                f"{name}: this instance ran a fast_dev_run smoke test, and its state belongs to that test; "
                "the real fit needs new callbacks: build the callback list again for its Trainer."
            )
        return (
            f"{name}: this instance already trained a run (from step {step}), and its state belongs to that "
            "run; a second trainer.fit would carry it into this one. Create new callbacks for each fit (e.g. "
            "inside the loop over folds), or continue a saved run with trainer.fit(..., ckpt_path=...)."
        )

    def end(self) -> None:
        """At ``on_train_end``: a restore seen during the run (a rollback) is not a resume of the next one."""
        self._restored = False
