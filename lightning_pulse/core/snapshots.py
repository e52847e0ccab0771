"""Bounded in-memory snapshots of a training state, kept on the CPU, for rollbacks. Plain torch.

A :class:`TrainingSnapshot` holds copies of everything a rollback returns to: the model's ``state_dict`` and its
non-persistent buffers (``register_buffer(..., persistent=False)``: running statistics a checkpoint leaves out
but training reads), each optimizer's and LR scheduler's ``state_dict``, the ``state_dict`` of selected callbacks, and whatever
bookkeeping the caller adds (``extra``). Every tensor is copied to the CPU, so snapshots cost host memory,
not accelerator memory. :class:`SnapshotRing` keeps the newest ``capacity`` snapshots;
:func:`nonfinite_tensors` tells a state that should not be kept.
"""

from __future__ import annotations

import contextlib
import copy
import operator
import sys
import warnings
from collections import ChainMap, OrderedDict, deque
from collections.abc import Iterable, Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from itertools import chain
from typing import Any, Protocol

import torch
from torch import nn
from torch.ao.quantization import FakeQuantizeBase
from torch.nn.parameter import is_lazy

from lightning_pulse.core.schedule_replay import LR_RAISED_FACTOR


class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state_dict: Any) -> Any: ...


# leaves that need no copy: nothing can change them in place
_IMMUTABLE = (int, float, bool, complex, str, bytes, type(None), torch.dtype, torch.device)
_IMMUTABLE_TYPES = frozenset(_IMMUTABLE)


def view_key(tensor: torch.Tensor) -> tuple[Any, ...] | None:
    """What makes two tensors one and the same view of memory: device, storage, offset, shape, strides, dtype
    and the conjugate/negative bits; ``None`` for a tensor with no storage to compare (empty, meta, sparse,
    quantised, nested, a subclass). ``model.state_dict()`` lists a tied weight (GPT-2's ``wte`` and
    ``lm_head``) under each of its names as two such views."""
    if (
        type(tensor) not in (torch.Tensor, nn.Parameter)
        or tensor.layout != torch.strided
        or tensor.is_quantized
        or tensor.is_nested
    ):
        return None
    try:
        pointer = tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a storage that cannot be read (a functional tensor's)
        return None
    if pointer == 0:  # no memory to share: an empty tensor, a meta one
        return None
    return (
        tensor.device,
        pointer,
        tensor.storage_offset(),
        tuple(tensor.shape),
        tensor.stride(),
        tensor.dtype,
        tensor.is_conj(),
        tensor.is_neg(),
    )


class CopyMemo:
    """The copies one snapshot made so far, so that a tensor reached again (a tied weight under its second
    name) gets the same copy, and the earlier copies refilled so far, so that one two names shared in the
    snapshot recycled is refilled for one of them only (the tie may have been undone since).

    Attributes:
        made: by :func:`view_key` of the source, ``(source, copy)``: the source is kept so that its memory, if
            it was a temporary (a callback's ``state_dict`` of clones), is not reused by a later tensor
            while the memo lives.
        refilled: the earlier copies refilled in place, by :func:`view_key` (by ``id`` where it has none).
    """

    def __init__(
        self, made: MutableMapping[Any, Any] | None = None, refilled: set[Any] | None = None
    ) -> None:
        self.made = {} if made is None else made
        self.refilled = set() if refilled is None else refilled

    def scoped(self) -> CopyMemo:
        """A memo that finds this one's copies but keeps its own new ones to itself: for a state whose
        temporaries should be freed once it is copied (one callback's, then the next's)."""
        return CopyMemo(ChainMap({}, self.made), self.refilled)


def copy_to_cpu(obj: Any, into: Any = None, memo: CopyMemo | None = None) -> Any:
    """A deep copy of ``obj`` in which every tensor is a detached CPU copy (containers are rebuilt).

    Views of the same memory (:func:`view_key`: a tied weight under two ``state_dict`` names) share one copy,
    as ``torch.save`` keeps them shared. Views that overlap otherwise (a weight and a slice of it) are copied
    apart.

    Args:
        obj: nested dicts, lists and tuples of tensors and plain values (a ``state_dict``).
        into: an earlier copy of an object of the same structure whose tensors may be overwritten: a tensor
            of the same shape and dtype is refilled with ``copy_`` instead of allocating a new one, so a
            ring of snapshots recycles its buffers (no fresh pages to fault in, no allocator churn).
        memo: the copies already made for the same snapshot (:class:`CopyMemo`), to share them across calls;
            ``None``: shared within ``obj`` only.
    """
    memo = CopyMemo() if memo is None else memo
    if isinstance(obj, torch.Tensor):
        source = obj.detach()
        key = view_key(source)
        if key is not None and key in memo.made:
            return memo.made[key][1]
        # an earlier copy is known by its memory, not its object: two objects over one memory (a loader that
        # does not keep a tie one object) are refilled once, not the first with the second's values
        earlier = (view_key(into) or id(into)) if isinstance(into, torch.Tensor) else None
        if (
            earlier is not None
            and earlier not in memo.refilled
            and into.device.type == "cpu"
            and into.shape == source.shape
            and into.dtype == source.dtype
            and into.layout == source.layout == torch.strided
        ):
            memo.refilled.add(earlier)
            copied = into.copy_(source)
        else:
            copied = source.to("cpu", copy=True)
        if key is not None:
            memo.made[key] = (source, copied)
        return copied
    if isinstance(obj, _IMMUTABLE):
        return obj
    if isinstance(obj, dict):
        copied = type(obj)() if type(obj) in (dict, OrderedDict) else {}
        previous = into if isinstance(into, dict) else {}
        for key, value in obj.items():
            copied[key] = copy_to_cpu(value, previous.get(key), memo)
        # nn.Module.state_dict() carries per-module versions here, which load_state_dict reads
        if hasattr(obj, "_metadata"):
            copied._metadata = copy.deepcopy(obj._metadata)  # type: ignore[attr-defined]
        return copied
    if isinstance(obj, (list, tuple)):
        if all(type(value) in _IMMUTABLE_TYPES for value in obj):
            # e.g. a detector window of floats, a scheduler's list of rates: one shallow copy, not a call per
            # element
            return list(obj) if isinstance(obj, list) else tuple(obj)
        previous = into if isinstance(into, (list, tuple)) and len(into) == len(obj) else [None] * len(obj)
        items = [copy_to_cpu(value, old, memo) for value, old in zip(obj, previous)]
        return items if isinstance(obj, list) else tuple(items)
    return copy.deepcopy(obj)


class StateCopyError(TypeError):
    """A selected callback's state that a snapshot cannot copy (a lock, a generator, an open file).

    Attributes:
        key: the callback's key in the snapshot.
        stateful: what gave the state (a :class:`RollbackState`).
        part: where in the state the value that cannot be copied is (``"['lock']"``), and its type's name.
    """

    def __init__(self, key: str, stateful: Any, part: tuple[str, str] | None, error: Exception) -> None:
        super().__init__(f"{type(error).__name__}: {error}")
        self.key, self.stateful, self.part = key, stateful, part


def uncopyable_part(obj: Any, path: str = "") -> tuple[str, str] | None:
    """The first value in ``obj`` (nested dicts, lists and tuples) that :func:`copy_to_cpu` cannot copy: its
    path (``"['lock']"``) and its type's name; ``None`` if there is none. Only asked after a copy failed."""
    if isinstance(obj, (torch.Tensor, *_IMMUTABLE)):
        return None
    if isinstance(obj, (dict, list, tuple)):
        items = obj.items() if isinstance(obj, dict) else enumerate(obj)
        return next(
            (found for key, value in items if (found := uncopyable_part(value, f"{path}[{key!r}]"))), None
        )
    try:
        copy.deepcopy(obj)
    except Exception:
        kind = type(obj)
        return (
            path,
            kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}",
        )
    return None


def copy_states(
    states: Mapping[str, Stateful] | None, into: Mapping[str, Any], memo: CopyMemo | None = None
) -> dict[str, Any]:
    """:func:`copy_to_cpu` of each ``state_dict()`` of ``states``, by key (``into``: an earlier copy; ``memo``:
    the copies the snapshot made already, which a state holding the same tensors shares).

    Raises:
        StateCopyError: naming the one whose state cannot be copied, and where in it.
    """
    copied = {}
    memo = CopyMemo() if memo is None else memo
    for key, stateful in (states or {}).items():
        state = stateful.state_dict()
        try:
            # scoped: the memo would keep this state's temporaries (clones on the accelerator) alive until
            # every other state is copied
            copied[key] = copy_to_cpu(state, into.get(key), memo.scoped())
        except Exception as error:  # deepcopy's: a TypeError for a lock, copy.Error, a class's own
            raise StateCopyError(key, stateful, uncopyable_part(state), error) from error
    return copied


def tensor_bytes(obj: Any) -> int:
    """Bytes held by the tensors inside ``obj`` (nested dicts, lists and tuples). Views of the same memory
    (:func:`view_key`: a tied weight's one copy under two names) count once."""
    sizes: dict[Any, int] = {}

    def visit(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            sizes[view_key(value) or id(value)] = value.numel() * value.element_size()
        elif isinstance(value, Mapping):
            for item in value.values():
                visit(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                visit(item)

    visit(obj)
    return sum(sizes.values())


def nonfinite_tensors(
    named: Mapping[str, torch.Tensor], nan_only: Mapping[str, torch.Tensor] | None = None
) -> list[str]:
    """The names of the floating-point tensors in ``named`` holding a NaN or an infinite value, then of those
    in ``nan_only`` holding a NaN (an infinity there can be by design: a ``-inf`` mask, an observer's starting
    ``inf``). One transfer per device the tensors are on.

    Each tensor is screened by its sum, one vectorised pass (an element-wise ``isfinite`` is several times
    slower on a CPU than the copy a snapshot makes): a NaN or an infinity makes the sum non-finite, a NaN
    makes it NaN. So do an overflow of finite values and opposite infinities, so a flagged sum is confirmed
    element by element (only then). Only plain dense tensors are read: a subclass (a quantised optimizer
    state) may not support the sum.
    """
    by_device: dict[torch.device, list[tuple[str, torch.Tensor, bool]]] = {}
    for tensors, only_nan in ((named, False), (nan_only or {}, True)):
        for name, tensor in tensors.items():
            if (
                type(tensor) in (torch.Tensor, nn.Parameter)
                and (tensor.is_floating_point() or tensor.is_complex())
                and tensor.layout == torch.strided
            ):
                by_device.setdefault(tensor.device, []).append((name, tensor.detach(), only_nan))
    flagged = []
    for screened in by_device.values():
        sums = torch.stack(
            [
                tensor.sum(dtype=torch.float32 if tensor.element_size() < 4 else None)
                for _, tensor, _ in screened
            ]
        )
        nan, finite = torch.stack([sums.isnan(), sums.isfinite()]).tolist()
        flagged += [
            (name, tensor, only_nan)
            for (name, tensor, only_nan), is_nan, is_finite in zip(screened, nan, finite)
            if (is_nan if only_nan else not is_finite)
        ]
    bad = set()
    for name, tensor, only_nan in flagged:
        values = tensor.float() if tensor.element_size() == 1 else tensor  # float8 has no isfinite
        if bool(values.isnan().any()) if only_nan else not bool(values.isfinite().all()):
            bad.add(name)
    return [name for tensors in (named, nan_only or {}) for name in tensors if name in bad]


@dataclass
class TrainingSnapshot:
    """A CPU copy of a training state at optimizer step ``step``.

    Attributes:
        step: the optimizer step the state belongs to (updates ``0..step-1`` applied).
        model: the model's ``state_dict``.
        optimizers: each optimizer's ``state_dict``.
        schedulers: each LR scheduler's ``state_dict``.
        callbacks: ``state_dict`` of each selected callback, by key.
        extra: the caller's bookkeeping at that step (copied, never restored by :func:`restore_snapshot`).
        buffers: the model's non-persistent buffers, by qualified name (not in its ``state_dict``).
        scheduler_kinds: the LR schedulers' classes (:func:`scheduler_kinds`); ``None``: not recorded.
        layout: the optimizers' parameter-group layout when taken (:func:`optimizer_layout`); ``None``: read
            from the saved states.
        inner_optimizers: for each optimizer, the ``state_dict`` of each optimizer it holds
            (:func:`optimizers_within`: SAM's base optimizer, whose state SAM's ``state_dict`` leaves out), or
            ``None`` where the wrapper's own ``state_dict`` nests it (Lookahead's ``"inner"``: kept once).
        inner_layout: the layout of those inner optimizers when taken; ``None``: not recorded.
        optimizer_kinds: the optimizers' classes (:func:`optimizer_kinds`); ``None``: not recorded.
        inner_kinds: the classes of those inner optimizers; ``None``: not recorded.
        parameter_ids: the identities of the parameters the optimizers held when taken
            (:func:`optimizer_parameter_ids`); ``None``: not recorded (a checkpoint's: ids are per process).
        plateau_rates: by optimizer index, the ``lr`` of each of its parameter groups as a
            ``ReduceLROnPlateau`` set them after the snapshot in its batch (:meth:`take_plateau_readings`);
            :func:`restore_snapshot` sets them last, whatever the optimizer's ``state_dict`` nests.
    """

    step: int
    model: dict[str, Any]
    optimizers: list[dict[str, Any]]
    schedulers: list[dict[str, Any]]
    callbacks: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    buffers: dict[str, Any] = field(default_factory=dict)
    scheduler_kinds: tuple[type, ...] | None = None
    layout: tuple[tuple[int, ...], ...] | None = None
    inner_optimizers: list[list[Any]] = field(default_factory=list)
    inner_layout: tuple[tuple[int, ...], ...] | None = None
    optimizer_kinds: tuple[type, ...] | None = None
    inner_kinds: tuple[type, ...] | None = None
    parameter_ids: tuple[int, ...] | None = None
    plateau_rates: dict[int, list[Any]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data the snapshot holds."""
        optimizers = [self.optimizers, self.inner_optimizers]
        return tensor_bytes(
            [self.model, *optimizers, self.schedulers, self.callbacks, self.extra, self.buffers]
        )

    @property
    def optimizer_layout(self) -> tuple[tuple[int, ...], ...]:
        """The parameter-group layout of the optimizers the states were saved from (see
        :func:`optimizer_layout`): recorded when taken, as a wrapper's ``state_dict`` may nest torch's
        (Lookahead's ``{"inner", "slow", "step"}``); else read from torch's layout of the saved states."""
        if self.layout is not None:
            return self.layout
        return tuple(
            tuple(len(group["params"]) for group in state["param_groups"]) for state in self.optimizers
        )

    def fits(
        self,
        model: nn.Module,
        optimizers: Sequence[torch.optim.Optimizer] | None = None,
        schedulers: Sequence[Any] | None = None,
    ) -> bool:
        """Whether the snapshot can still be loaded into ``model``: same entries with the same shapes, or the
        entries of layers masked since (:func:`fitted_state`); when ``optimizers`` are given, into them: the
        same classes (:func:`optimizer_kinds`, inner ones too), parameter-group layout
        (:func:`optimizer_layout`) and parameter objects (:func:`optimizer_parameter_ids`, where recorded);
        and when ``schedulers`` are given, into them: the same LR schedulers, in number and class
        (:func:`scheduler_kinds`).

        Another structural change since the snapshot (channels pruned away, a layer added, a parameter group
        added to an optimizer, an optimizer swapped for one of another class, an LR scheduler swapped or
        added: ``StochasticWeightAveraging``'s ``SWALR``) makes it unusable: Adam's state would load into SGD
        (which then ran on Adam's ``lr``), SGD's into Adam (``KeyError: 'step'``), a scheduler's state into
        another kind of scheduler, and the optimizer's groups would lose the keys the new one set on them
        (``SWALR``'s ``swa_lr``). So does a parameter replaced by a new object of the same shape (the module's
        ``self.head = nn.Linear(...)`` and a new optimizer over it): loading would put the old head's weights
        and momentum into the new one, undoing the module's own change. A parameter no optimizer holds is
        not compared: a forward may re-create one at every step (an EMA codebook).
        """
        if optimizers is not None and not self.holds_optimizers(optimizers):
            return False
        if optimizers is not None and optimizer_layout(optimizers) != self.optimizer_layout:
            return False
        if (
            optimizers is not None
            and self.parameter_ids is not None
            and optimizer_parameter_ids(optimizers) != self.parameter_ids
        ):
            return False
        if optimizers is not None and not self.holds_inner_optimizers(optimizers):
            return False
        if schedulers is not None and not self.holds_schedulers(schedulers):
            return False
        return fitted_state(self.model, model.state_dict()) is not None

    def holds_optimizers(self, optimizers: Sequence[torch.optim.Optimizer]) -> bool:
        """Whether the snapshot's optimizer states are of ``optimizers``: their number, and their classes
        where recorded (a state loads only into its own kind of optimizer)."""
        if self.optimizer_kinds is None:
            return len(optimizers) == len(self.optimizers)
        return optimizer_kinds(optimizers) == self.optimizer_kinds

    def holds_inner_optimizers(self, optimizers: Sequence[torch.optim.Optimizer]) -> bool:
        """Whether the inner optimizers of ``optimizers`` have the classes and the layout the snapshot saved
        theirs in (where it recorded them)."""
        inner = inner_optimizers(optimizers)
        return (self.inner_kinds is None or optimizer_kinds(inner) == self.inner_kinds) and (
            self.inner_layout is None or optimizer_layout(inner) == self.inner_layout
        )

    def holds_schedulers(self, schedulers: Sequence[Any]) -> bool:
        """Whether the snapshot's scheduler states are of ``schedulers`` (their number, and their classes
        where recorded)."""
        if self.scheduler_kinds is None:
            return len(schedulers) == len(self.schedulers)
        return scheduler_kinds(schedulers) == self.scheduler_kinds

    def take_plateau_readings(self, plateaus: Sequence[tuple[int, Any, int | None]]) -> None:
        """Copy in the state of ``ReduceLROnPlateau`` schedulers stepped after the snapshot in the batch it was
        taken in (``(index among the snapshot's schedulers, scheduler, index of its optimizer or None)``), and
        the rates they set in their optimizers' groups. Lightning steps them after every batch-end hook, where
        a snapshot is taken: without their reading of that batch, a rollback left them one reading behind the
        run at the snapshot's step (``num_bad_epochs`` 2 for 0, the rate cut a step early). The rates are also
        kept apart (:attr:`plateau_rates`): a wrapper's ``state_dict`` may nest its inner optimizer's groups
        (Lookahead's ``"inner"``), which the write below does not reach."""
        for index, scheduler, optimizer_index in plateaus:
            if index >= len(self.schedulers):
                continue
            self.schedulers[index] = copy_to_cpu(scheduler.state_dict())
            if optimizer_index is not None:
                rates = [copy_to_cpu(group["lr"]) for group in scheduler.optimizer.param_groups]
                self.plateau_rates[optimizer_index] = rates
            saved = self.optimizers[optimizer_index] if optimizer_index is not None else None
            groups = saved.get("param_groups") if isinstance(saved, dict) else None
            if groups is not None and len(groups) == len(scheduler.optimizer.param_groups):
                for group, live in zip(groups, scheduler.optimizer.param_groups):
                    group["lr"] = copy_to_cpu(live["lr"])


#: the fields of a :class:`TrainingSnapshot` a checkpoint carries (:func:`snapshot_state`); the classes it
#: records are left out: a checkpoint holds plain data, and a resume restores these optimizers' states anyway
_CHECKPOINTED_FIELDS = ("step", "model", "optimizers", "schedulers", "callbacks", "extra", "buffers")


def snapshot_state(snapshot: TrainingSnapshot) -> dict[str, Any]:
    """``snapshot`` as plain data for a checkpoint (its CPU tensors, not copied): :func:`snapshot_from_state`
    reads it back."""
    state = {name: getattr(snapshot, name) for name in _CHECKPOINTED_FIELDS}
    state["inner_optimizers"] = snapshot.inner_optimizers
    state["plateau_rates"] = snapshot.plateau_rates
    state["layout"] = None if snapshot.layout is None else [list(group) for group in snapshot.layout]
    inner = snapshot.inner_layout
    state["inner_layout"] = None if inner is None else [list(group) for group in inner]
    return state


def snapshot_from_state(state: Mapping[str, Any]) -> TrainingSnapshot:
    """The snapshot :func:`snapshot_state` wrote; its optimizers' and schedulers' classes are not recorded
    (:meth:`TrainingSnapshot.fits` then compares their number and layout)."""
    layout, inner = state.get("layout"), state.get("inner_layout")
    return TrainingSnapshot(
        **{name: state[name] for name in _CHECKPOINTED_FIELDS},
        inner_optimizers=list(state.get("inner_optimizers", [])),
        plateau_rates=dict(state.get("plateau_rates", {})),
        layout=None if layout is None else tuple(tuple(group) for group in layout),
        inner_layout=None if inner is None else tuple(tuple(group) for group in inner),
    )


def optimizer_layout(optimizers: Sequence[torch.optim.Optimizer]) -> tuple[tuple[int, ...], ...]:
    """For each optimizer, the number of parameters in each of its parameter groups: a saved optimizer state
    loads only into the layout it was saved from (``Optimizer.load_state_dict`` raises otherwise), and
    ``add_param_group`` (Lightning's ``BackboneFinetuning``) changes it. A ``len`` per group, no pass over the
    parameters."""
    return tuple(tuple(len(group["params"]) for group in optimizer.param_groups) for optimizer in optimizers)


def optimizer_parameter_ids(optimizers: Sequence[torch.optim.Optimizer]) -> tuple[int, ...]:
    """The ``id`` of each parameter ``optimizers`` hold, in group order: a module that assigns a new submodule
    (``self.head = nn.Linear(...)``) and builds a new optimizer over it keeps the layout and the shapes, only
    the parameter objects change. A re-initialisation in place (``reset_parameters()``) keeps them, and
    cannot be told from training."""
    groups = (group["params"] for optimizer in optimizers for group in optimizer.param_groups)
    return tuple(map(id, chain.from_iterable(groups)))


def optimizer_kinds(optimizers: Sequence[torch.optim.Optimizer]) -> tuple[type, ...]:
    """The classes of ``optimizers``, in order: a saved optimizer state loads only into its own kind (Adam's
    into SGD gave SGD Adam's ``lr`` and state keys; SGD's into Adam raised ``KeyError: 'step'``), and a
    callback may swap the optimizer mid-run (``trainer.optimizers = [...]``)."""
    return tuple(type(optimizer) for optimizer in optimizers)


def optimizers_within(optimizers: Iterable[Any], depth: int = 3) -> list[torch.optim.Optimizer]:
    """``optimizers`` and the torch optimizers they hold in their attributes (a wrapper's inner one:
    Lookahead's ``optimizer``, SAM's ``base_optimizer``), ``depth`` attributes deep, each state once.

    A wrapper keeps the state of the inner optimizer apart from its own; a cut must cut both. One that
    shares its inner optimizer's ``state`` mapping is listed once (a second cut of the same state would
    find tensors already cut).
    """
    found: list[torch.optim.Optimizer] = []
    states: set[int] = set()

    def visit(optimizer: torch.optim.Optimizer, level: int) -> None:
        if id(optimizer.state) not in states:
            states.add(id(optimizer.state))
            found.append(optimizer)
        for value in vars(optimizer).values() if level > 0 else ():
            for item in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(item, torch.optim.Optimizer) and item is not optimizer:
                    visit(item, level - 1)

    for optimizer in optimizers:
        visit(optimizer, depth)
    return found


def inner_optimizers(optimizers: Sequence[torch.optim.Optimizer]) -> list[torch.optim.Optimizer]:
    """The optimizers that ``optimizers`` hold (:func:`optimizers_within` of each, less itself), in order."""
    return [inner for optimizer in optimizers for inner in optimizers_within([optimizer])[1:]]


def _tensor_ids(obj: Any) -> set[int]:
    """The ids of the tensors in ``obj`` (nested dicts, lists and tuples)."""
    if isinstance(obj, torch.Tensor):
        return {id(obj)}
    values = obj.values() if isinstance(obj, Mapping) else obj if isinstance(obj, (list, tuple)) else ()
    return set().union(*(_tensor_ids(value) for value in values))


def states_within(optimizer: torch.optim.Optimizer, state: Mapping[str, Any]) -> list[Any]:
    """The ``state_dict`` of each optimizer ``optimizer`` holds (:func:`optimizers_within`), given its own
    ``state``; ``None`` for one whose state tensors ``state`` already holds (a Lookahead nests its inner
    optimizer's: its own ``load_state_dict`` puts that back), so a snapshot keeps each tensor once."""
    within = optimizers_within([optimizer])[1:]
    nested = _tensor_ids(state) if within else set()  # no walk for a plain optimizer
    states = []
    for inner in within:
        inner_state = inner.state_dict()
        held = _tensor_ids(inner_state.get("state", {}))
        states.append(None if held and held <= nested else inner_state)
    return states


def load_keeping_groups(loads: Sequence[tuple[torch.optim.Optimizer, Any]]) -> None:
    """Load each ``(optimizer, state)`` with :func:`load_optimizer_state` (none where ``state`` is ``None``),
    then give every optimizer back the parameter-group list and dicts it held before, with the loaded values.

    ``load_state_dict`` makes new ones (a wrapper's own load may make them inside its inner optimizer): a
    wrapper (SAM, Lookahead) sharing its inner optimizer's groups would part from it, so that the learning
    rates an LR scheduler or the guard's cooldown set on the one no longer reach the updates of the other.
    Put back innermost first: a wrapper whose ``param_groups`` reads its inner optimizer's finds them kept.
    """
    kept = [(optimizer, optimizer.param_groups, list(optimizer.param_groups)) for optimizer, _ in loads]
    for optimizer, state in loads:
        if state is not None:
            load_optimizer_state(optimizer, state)
    for optimizer, groups, dicts in reversed(kept):
        loaded = optimizer.param_groups
        if loaded is groups and all(now is dict_ for now, dict_ in zip(loaded, dicts)):
            continue
        for dict_, now in zip(dicts, list(loaded)):
            if now is not dict_:
                dict_.clear()
                dict_.update(now)
        groups[:] = dicts
        if optimizer.param_groups is not groups:
            optimizer.param_groups = groups


def is_zero_redundancy(optimizer: Any) -> bool:
    """Whether ``optimizer`` is torch's ``ZeroRedundancyOptimizer`` (each rank holds a shard of its state),
    by class name: no ``torch.distributed`` import on builds without it."""
    return any(kind.__name__ == "ZeroRedundancyOptimizer" for kind in type(optimizer).__mro__)


def scheduler_kinds(schedulers: Sequence[Any]) -> tuple[type, ...]:
    """The classes of ``schedulers``, in order: a scheduler's saved state loads only into its own kind, and
    ``StochasticWeightAveraging`` swaps the first for ``SWALR`` (or adds one) when averaging starts."""
    return tuple(type(scheduler) for scheduler in schedulers)


def fitted_state(saved: Mapping[str, Any], current: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """A snapshot's model state ``saved`` under the keys of the model's state now (``current``), or ``None``
    when it does not fit. Entries must match in name and shape, except where ``torch.nn.utils.prune`` masked a
    layer since (unstructured pruning): its parameter ``weight`` became ``weight_orig`` next to a
    ``weight_mask`` buffer. The saved weight goes back under the mask the layer has now: whoever pruned it
    (Lightning's ``ModelPruning``, the user's own ``torch.nn.utils.prune`` call) does not prune again, so what it pruned
    stays pruned. The masks of the layers ScheduledPrune prunes follow its restored record instead: its
    rollback load resets those its snapshot state says were not there yet (``load_rollback_state_dict``).
    The parameter keeps its name, so optimizers and hooks holding it are not disturbed."""
    fitted: dict[str, Any] = OrderedDict()
    fitted._metadata = getattr(saved, "_metadata", None)  # type: ignore[attr-defined]  # module versions
    for name, value in saved.items():
        key = name if name in current else f"{name}_orig"
        if key not in current or (key != name and f"{name}_mask" not in current):
            return None
        if isinstance(value, torch.Tensor) and value.shape != current[key].shape:
            return None
        fitted[key] = value
    for name, value in current.items():
        if name not in fitted:
            if not (name.endswith("_mask") and f"{name[: -len('_mask')]}_orig" in fitted):
                return None
            fitted[name] = value  # the mask it has now
    return saved if fitted.keys() == saved.keys() else fitted


#: the on/off switches of torch's fake quantizers (``torch.ao.quantization.FakeQuantizeBase``, the fused and
#: the learnable ones included): buffers that a QAT recipe sets once, between steps (``disable_observer``,
#: ``disable_fake_quant``, ``_LearnableFakeQuantize.enable_param_learning``), never a forward
QUANTIZER_SWITCHES = ("fake_quant_enabled", "observer_enabled", "static_enabled", "learning_enabled")


def quantizer_switches(model: nn.Module) -> dict[str, torch.Tensor]:
    """The fake quantizers' switches (:data:`QUANTIZER_SWITCHES`) ``model`` holds, by ``state_dict`` name.

    A rollback keeps their current values (:func:`restore_snapshot`), and a skipped step does not set them
    back (:class:`PreStepBuffers` leaves them out): a snapshot from before ``model.apply(disable_observer)``
    would otherwise turn the observers on again for the rest of the run, since nothing calls it again (the
    step counter does not go back), as ``fitted_state`` keeps another pruner's masks."""
    return {
        f"{prefix}.{name}" if prefix else name: buffer
        for prefix, module in model.named_modules(remove_duplicate=False)
        if isinstance(module, FakeQuantizeBase)
        for name in QUANTIZER_SWITCHES
        if isinstance(buffer := module._buffers.get(name), torch.Tensor)
    }


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: Mapping[str, Any]) -> None:
    """``optimizer.load_state_dict(state)``, with every state tensor back in the dtype it was saved in.

    ``Optimizer.load_state_dict`` casts each floating state tensor but ``step`` to its parameter's dtype:
    under ``bf16-true`` or ``64-true``, NAdam's ``mu_product`` and ASGD's ``eta`` and ``mu`` (float32 whatever
    the parameters) would come back rounded to bfloat16, or as float64. Those go back as saved instead, on the
    device ``load_state_dict`` put them on. Like ``load_state_dict``, the optimizer may keep references into
    ``state``: hand it a copy to keep ``state`` unchanged.
    """
    optimizer.load_state_dict(state)
    saved_state, live_state = state.get("state"), getattr(optimizer, "state", None)
    if not isinstance(saved_state, Mapping) or not isinstance(live_state, Mapping):
        return  # a ``state_dict`` of another layout than torch's: its own ``load_state_dict`` decides
    saved_ids = (index for group in state.get("param_groups", ()) for index in group.get("params", ()))
    params = (param for group in optimizer.param_groups for param in group["params"])
    for index, param in zip(saved_ids, params):
        if index in saved_state and param in live_state:
            _in_saved_dtypes(saved_state[index], live_state[param])


def _in_saved_dtypes(saved: Any, loaded: Any) -> Any:
    """``loaded`` (what ``load_state_dict`` made of ``saved``) with each tensor whose dtype it changed taken
    from ``saved`` again, moved to the loaded tensor's device (dicts are updated in place)."""
    if isinstance(saved, torch.Tensor) and isinstance(loaded, torch.Tensor):
        return saved.to(loaded.device) if saved.dtype != loaded.dtype else loaded
    if isinstance(saved, Mapping) and isinstance(loaded, dict):
        for key, value in saved.items():
            if key in loaded:
                loaded[key] = _in_saved_dtypes(value, loaded[key])
        return loaded
    if type(saved) in (list, tuple) and type(loaded) in (list, tuple) and len(saved) == len(loaded):
        return type(loaded)(_in_saved_dtypes(value, now) for value, now in zip(saved, loaded))
    return loaded


def non_persistent_buffers(
    model: nn.Module, state: Mapping[str, Any] | None = None
) -> dict[str, torch.Tensor]:
    """The buffers of ``model`` that its ``state_dict`` (``state``, if already taken) leaves out."""
    state = model.state_dict() if state is None else state
    return {
        name: buffer for name, buffer in model.named_buffers() if name not in state and buffer is not None
    }


def take_snapshot(
    step: int,
    model: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer] = (),
    schedulers: Sequence[Stateful] = (),
    callbacks: Mapping[str, Stateful] | None = None,
    extra: Mapping[str, Any] | None = None,
    reuse: TrainingSnapshot | None = None,
) -> TrainingSnapshot:
    """Copy the state of ``model``, ``optimizers``, ``schedulers`` and ``callbacks`` to the CPU.

    Args:
        reuse: a snapshot that is no longer needed (the one a :class:`SnapshotRing` is about to evict, see
            :meth:`SnapshotRing.recycle`): its tensors are overwritten where shapes and dtypes match, instead
            of allocating new ones. It must not be used afterwards.
    """
    old = reuse if reuse is not None else TrainingSnapshot(-1, {}, [], [])
    state = model.state_dict()
    layout = optimizer_layout(optimizers)  # before the states: one a wrapper nests is not torch's layout
    states = [optimizer.state_dict() for optimizer in optimizers]
    inner = [states_within(optimizer, state) for optimizer, state in zip(optimizers, states)]
    held = inner_optimizers(optimizers)
    memo = CopyMemo()  # one copy per tensor across the whole snapshot: a tied weight is copied once
    return TrainingSnapshot(
        step=int(step),
        model=copy_to_cpu(state, old.model, memo),
        buffers=copy_to_cpu(non_persistent_buffers(model, state), old.buffers, memo),
        optimizers=copy_to_cpu(states, old.optimizers, memo),
        inner_optimizers=copy_to_cpu(inner, old.inner_optimizers, memo),
        inner_layout=optimizer_layout(held),
        optimizer_kinds=optimizer_kinds(optimizers),
        inner_kinds=optimizer_kinds(held),
        schedulers=copy_to_cpu([scheduler.state_dict() for scheduler in schedulers], old.schedulers, memo),
        callbacks=copy_states(callbacks, old.callbacks, memo),
        extra=copy_to_cpu(dict(extra or {}), memo=memo),
        scheduler_kinds=scheduler_kinds(schedulers),
        layout=layout,
        parameter_ids=optimizer_parameter_ids(optimizers),
    )


def restore_snapshot(
    snapshot: TrainingSnapshot,
    model: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer] = (),
    schedulers: Sequence[Stateful] = (),
    callbacks: Mapping[str, Stateful] | None = None,
    rewind_schedule: bool = True,
) -> None:
    """Return ``model``, ``optimizers``, ``schedulers`` and ``callbacks`` to ``snapshot``.

    The on/off switches of torch's fake quantizers keep their current values (:func:`quantizer_switches`): a
    QAT recipe's ``disable_observer`` or ``disable_fake_quant`` is a one-shot call that nothing would redo.

    Parameters are overwritten in place (``load_state_dict`` copies into the existing tensors), so
    optimizers and DDP keep pointing at the same parameter objects. Optimizer state goes back to the
    parameters' devices (``Optimizer.load_state_dict`` moves it), in the dtypes it was saved in
    (:func:`load_optimizer_state`), with those of the optimizers a wrapper holds (SAM's base optimizer), the
    parameter-group dicts they share kept shared (:func:`load_keeping_groups`). The snapshot itself is left
    untouched, so it can be restored again.

    Args:
        rewind_schedule: ``True`` also returns the LR schedulers and the optimizers' hyperparameters
            (``lr``, momentum, ...) to the snapshot, but for the ``lr`` of an optimizer no scheduler drives
            (a rate set by hand, which nothing would set again). ``False`` keeps the current
            schedulers and hyperparameters, so a step-indexed schedule stays where the trainer's step
            counter is.

    Raises:
        ValueError: before anything is loaded, if the number of optimizers or schedulers differs from the
            snapshot's (with ``rewind_schedule``, the schedulers' classes too), if an optimizer is of another
            class than the saved state's, or its parameter groups (their number, or the parameters in one)
            differ from the saved state's (or an inner optimizer's from its saved one's), or if the snapshot
            no longer fits the model (:meth:`TrainingSnapshot.fits`).
    """
    if len(optimizers) != len(snapshot.optimizers) or (
        rewind_schedule and not snapshot.holds_schedulers(schedulers)
    ):
        saved_kinds = snapshot.scheduler_kinds or ()
        saved = f"{len(snapshot.schedulers)} scheduler(s) {[kind.__name__ for kind in saved_kinds]}"
        given = f"{len(schedulers)} {[kind.__name__ for kind in scheduler_kinds(schedulers)]}"
        raise ValueError(
            f"The snapshot holds {len(snapshot.optimizers)} optimizer(s) and {saved}, but "
            f"{len(optimizers)} and {given} were given."
        )
    if not snapshot.holds_optimizers(optimizers):
        raise ValueError(
            f"The snapshot holds the state of {[kind.__name__ for kind in snapshot.optimizer_kinds or ()]}, "
            f"but the optimizers now are {[kind.__name__ for kind in optimizer_kinds(optimizers)]}: an "
            "optimizer was swapped for one of another class since."
        )
    if (layout := optimizer_layout(optimizers)) != snapshot.optimizer_layout:
        raise ValueError(
            f"The snapshot's optimizer state has parameter groups of {snapshot.optimizer_layout} parameters, but "
            f"the optimizers now have {layout}: a parameter group was added or changed since."
        )
    if not snapshot.holds_inner_optimizers(optimizers):
        inner = inner_optimizers(optimizers)
        saved_inner = [kind.__name__ for kind in snapshot.inner_kinds or ()]
        raise ValueError(
            f"The snapshot's inner optimizer state (a wrapper's, SAM's base optimizer) is of {saved_inner} "
            f"with parameter groups of {snapshot.inner_layout} parameters, but the inner optimizers now are "
            f"{[kind.__name__ for kind in optimizer_kinds(inner)]} with {optimizer_layout(inner)}."
        )
    # everything is checked before anything is loaded: a state is never half restored
    fitted = fitted_state(snapshot.model, model.state_dict())
    if fitted is None:
        raise ValueError("The snapshot no longer fits the model: its entries or their shapes changed since.")
    switches = [(buffer, buffer.clone()) for buffer in quantizer_switches(model).values()]
    model.load_state_dict(fitted)
    for name, saved in snapshot.buffers.items():
        try:
            buffer = model.get_buffer(name)
        except AttributeError:  # the model no longer has it (its structure changed since the snapshot)
            continue
        if buffer is not None and buffer.shape == saved.shape:
            buffer.copy_(saved)
    with torch.no_grad():
        for buffer, now in switches:  # the user's one-shot calls since the snapshot stand
            buffer.copy_(now)
    scheduled = _scheduled_optimizers(schedulers)
    for index, (optimizer, state) in enumerate(zip(optimizers, snapshot.optimizers)):
        # an optimizer no LR scheduler drives keeps the rate its module or a callback set: nothing would set
        # the snapshot's again (a warm-up by hand in ``optimizer_step``, keyed on the step counter, which
        # does not go back, left a run at its warm-up rate for good after a rollback into the warm-up). Only
        # the rate: the counters an optimizer keeps in its groups (schedule-free's ``k`` and ``weight_sum``,
        # Prodigy's ``d``) go back with its state (a review)
        hand_set = rewind_schedule and not (
            scheduled is None or any(id(inner) in scheduled for inner in optimizers_within([optimizer]))
        )
        current_hyperparameters = [
            {name: value for name, value in group.items() if name != "params"}
            for group in optimizer.param_groups
        ]
        # the inner optimizers' own states too (SAM's base optimizer); the groups they share stay shared.
        # load_state_dict keeps references into the dict it is given: hand it a copy
        inner = snapshot.inner_optimizers[index] if index < len(snapshot.inner_optimizers) else []
        within = optimizers_within([optimizer])[1 : 1 + len(inner)]
        loads = [(optimizer, state), *zip(within, inner)]
        load_keeping_groups([(owner, copy.deepcopy(saved)) for owner, saved in loads])
        for group, hyperparameters in zip(optimizer.param_groups, current_hyperparameters):
            if rewind_schedule:  # keep the keys a scheduler set since (``initial_lr``, SWALR's ``swa_lr``)
                for name, value in hyperparameters.items():
                    group.setdefault(name, value)
                if hand_set and _kept_by_hand(hyperparameters.get("lr"), group.get("lr")):
                    group["lr"] = hyperparameters["lr"]
            else:
                group.update(hyperparameters)
    if rewind_schedule:
        for scheduler, state in zip(schedulers, snapshot.schedulers):
            scheduler.load_state_dict(copy.deepcopy(state))
        # last: a wrapper's groups are its inner optimizer's, which its own state nests
        for index, rates in snapshot.plateau_rates.items():
            groups = optimizers[index].param_groups if index < len(optimizers) else []
            if len(groups) == len(rates):
                for group, rate in zip(groups, rates):
                    group["lr"] = copy.deepcopy(rate)
    for key, stateful in (callbacks or {}).items():
        if key in snapshot.callbacks:
            stateful.load_state_dict(copy.deepcopy(snapshot.callbacks[key]))


def _kept_by_hand(current: Any, saved: Any) -> bool:
    """Whether a rollback keeps ``current``, the rate of an optimizer no LR scheduler drives, over the
    snapshot's ``saved``: a rate set by hand is set again by nothing (a warm-up keyed on the step counter), but
    one raised :data:`~lightning_pulse.core.schedule_replay.LR_RAISED_FACTOR` times or more above the
    snapshot's is the likely cause of the trouble (a rate set once by mistake): the snapshot's then (a
    regression sweep: kept, a x100 rate rolled back three times and stopped the run)."""
    if current is None:
        return False
    if not isinstance(current, (int, float)) or not isinstance(saved, (int, float)):
        return True
    return not (saved > 0 and current >= LR_RAISED_FACTOR * saved)


def _scheduled_optimizers(schedulers: Sequence[Any]) -> set[int] | None:
    """The ids of the optimizers ``schedulers`` drive (each torch scheduler's ``optimizer``, and the optimizers
    it holds); ``None`` where a scheduler names none (every optimizer then counts as driven)."""
    driven: set[int] = set()
    for scheduler in schedulers:
        optimizer = getattr(scheduler, "optimizer", None)
        if not isinstance(optimizer, torch.optim.Optimizer):
            return None
        driven.update(id(inner) for inner in optimizers_within([optimizer]))
    return driven


@contextlib.contextmanager
def holding(snapshot: TrainingSnapshot, model: nn.Module) -> Iterator[None]:
    """Run the block with ``model`` holding ``snapshot``'s parameters and buffers; its own come back after.

    Only the model: optimizers, schedulers and callbacks are not touched. The model's own state waits in a
    CPU copy (what a snapshot costs), so this is for rare checks, not for every step.
    """
    own = take_snapshot(-1, model)
    restore_snapshot(TrainingSnapshot(snapshot.step, snapshot.model, [], [], buffers=snapshot.buffers), model)
    try:
        yield
    finally:
        restore_snapshot(own, model)


class PreStepBuffers:
    """The buffers that training forwards write (BatchNorm's running statistics and ``num_batches_tracked``),
    and the parameters they write (an EMA codebook or a momentum encoder: frozen, or held by no optimizer;
    :func:`written_outside`), copied before each optimizer step's first forward, so that a step skipped as
    the data's fault can set them back to their values before it (StabilityGuard's mend). The newest snapshot
    may be ``snapshot_every`` steps older: setting them back to it threw those steps' statistics away at
    every bad batch.

    Which (:meth:`learn`): buffers whose values differ from a snapshot's copy, and parameters written outside
    the optimizers whose fingerprint (their sum, on their device: no copy of a frozen backbone crosses to the
    host) changed since the last learn, at the end of the first two applied steps after the fit's start or a
    structured prune (:attr:`learn_after`), and before each snapshot (tensors that start being written
    later); the set only grows. Values, not version counters: BatchNorm's kernel updates its running
    statistics without bumping theirs. The guard's own writes leave no trace there: its checks give buffers
    and parameters back bit for bit, a rollback returns them to a snapshot's values.

    Per step (:meth:`before_step`): a call that returns at once for a model whose forwards write no buffer
    or parameter (and inside an accumulation window: the copy is taken before the window's first
    micro-batch); else one ``torch._foreach_copy_`` into tensors allocated when the set was learned. Resumed,
    or before the first learn, there is no copy (:attr:`copied` is false): the mend sets back to the newest
    snapshot, which holds the values before the step when no step was applied since it (a resume inside the
    skip window after a rollback), and learns the set against it then; else only what was made non-finite.
    """

    def __init__(self) -> None:
        self.clear()

    def clear(
        self, learn_after: int | None = None, keep: nn.Module | None = None, names: list[str] | None = None
    ) -> None:
        """Forget the tensors learned and the copy (a new fit, or parameters replaced: the modules and shapes
        the copy was made for may be gone); ``learn_after``: learn at the end of the first applied step whose
        counter after it is past this one. ``keep``: the model whose tensors of ``names`` (default: the names
        learned so far) that it still holds stay learned, in copies of their current shapes (filled before
        the next step)."""
        kept = [] if keep is None else (self.names if names is None else names)
        self.names: list[str] = []
        self.slots: list[tuple[dict[str, Any], str]] = []  # (owner's ``_buffers``/``_parameters``, key)
        self.sources: list[torch.Tensor] = []  # the tensors the last copy read
        self.copies: list[torch.Tensor] = []
        self.copied = False  # the copies hold the values before the current step's first forward
        # the copy of a window that ended without an optimizer step, and its ``copied``, until :meth:`settle`;
        # and the copies last let go, refilled at the next such window (where their layouts still fit)
        self.aside: tuple[list[torch.Tensor], bool] | None = None
        self.spare: list[torch.Tensor] | None = None
        self.learn_after = learn_after
        self.early_learns = 2  # the applied steps from ``learn_after`` on that learn (then: snapshots only)
        self.fingerprints: dict[str, float] = {}  # of the parameters written outside, at the last learn
        if keep is not None and kept:
            held = {name for name, _ in [*keep.named_buffers(), *keep.named_parameters()]}
            self._allocate(keep, [name for name in kept if name in held])

    def learn(
        self, model: nn.Module, snapshot: TrainingSnapshot | None, optimizers: Sequence[Any] | None = None
    ) -> None:
        """Add the buffers of ``model`` whose values differ from ``snapshot``'s copies (same shape and dtype;
        the newest snapshot, taken before the forwards since), and, with ``optimizers``, the parameters
        written outside them whose fingerprint changed since the last call (:func:`fingerprints`). A
        comparison per buffer not learned yet, on the buffer's device, and a sum per such parameter: at a
        snapshot, not per step."""
        written = set(self.names)
        if optimizers is not None:
            outside = {
                name: p for name, p in written_outside(model, optimizers).items() if name not in written
            }
            # an optimizer's state for one of them (a unit a freezer released for a while, then froze again)
            # changed: an optimizer step wrote it, not a forward; so it is not learned as written
            states = {
                f"{name} {key}": value
                for optimizer in optimizers
                for name, param in outside.items()
                for key, value in optimizer.state.get(param, {}).items()
                if isinstance(value, torch.Tensor)
            }
            now = fingerprints({**outside, **states})
            stepped = {  # a state that is new since the last look counts too
                key.rpartition(" ")[0]
                for key, value in now.items()
                if key not in outside and self.fingerprints.get(key) != value
            }
            written.update(
                name
                for name, value in now.items()
                if name in outside and name not in stepped and self.fingerprints.get(name, value) != value
            )
            self.fingerprints = now
        saved = {} if snapshot is None else {**snapshot.model, **snapshot.buffers}
        switches = quantizer_switches(model)
        for name, buffer in model.named_buffers():
            before = saved.get(name)
            if name in written or not isinstance(before, torch.Tensor) or is_lazy(buffer):
                continue
            if buffer.layout != torch.strided:  # a sparse buffer: no in-place copy before each step
                continue
            if _is_pruning_mask(model, name):  # written by prune events between steps, never by a forward
                continue
            if name in switches:  # set by the user's calls between steps, never by a forward
                continue
            if before.shape == buffer.shape and before.dtype == buffer.dtype:
                if not torch.equal(buffer, before.to(buffer.device, non_blocking=True)):
                    written.add(name)
        if len(written) > len(self.names):
            tensors = [*model.named_buffers(), *model.named_parameters()]
            self._allocate(model, [name for name, _ in tensors if name in written])

    def _allocate(self, model: nn.Module, names: list[str]) -> None:
        self.names, self.slots = names, []
        for name in names:
            owner, _, key = name.rpartition(".")
            module = model.get_submodule(owner)
            self.slots.append((module._buffers if key in module._buffers else module._parameters, key))
        self.sources = [tensors[key] for tensors, key in self.slots]
        self.copies = [torch.empty_like(source, requires_grad=False) for source in self.sources]
        self.copied = False  # filled before the next step's first forward
        self.aside = self.spare = None

    def before_step(self, batches: Sequence[Any], ended: int = 0) -> None:
        """Before a micro-batch's forward: copy the learned tensors when it is an optimizer step's first
        (``batches``: the step's micro-batches so far, empty at its first), or when it follows the first
        ``ended`` of them, a window that ended without an optimizer step: that window's copy is kept aside
        until :meth:`settle` tells whether the window goes on into this step."""
        if len(batches) > ended or not self.slots:
            return
        sources = [tensors.get(key) for tensors, key in self.slots]  # a deleted one: dropped
        self.aside = None
        if not all(map(operator.is_, sources, self.sources)):  # a module replaced a tensor
            self._refit(sources)  # the window's copy fits the tensors no more: not kept aside
            if not self.sources:  # every one dropped
                return
        elif ended:
            self.aside = (self.copies, self.copied)
            spare, self.spare = self.spare, None
            self.copies = spare or [torch.empty_like(copy, requires_grad=False) for copy in self.copies]
        with torch.no_grad():  # a parameter that requires grad: no graph from it to the copy
            torch._foreach_copy_(self.copies, self.sources)
        self.copied = True

    def settle(self, carried: bool) -> None:
        """At the micro-batch after a window that ended without an optimizer step (:meth:`before_step`'s
        ``ended``): keep that window's copy where the window is ``carried`` on into this step (its gradients
        were not zeroed: the step's first forward was the window's), else this micro-batch's."""
        if self.aside is None:
            return
        (copies, copied), self.aside = self.aside, None
        if carried:
            self.spare, self.copies, self.copied = self.copies, copies, copied
        else:
            self.spare = copies

    def _refit(self, sources: list[Any]) -> None:
        """Follow tensors a module replaced (a buffer assigned anew, a parameter re-created as a new
        ``nn.Parameter``): a copy of the new shape, dtype or device where needed; one set to ``None`` is
        dropped."""
        kept = [index for index, source in enumerate(sources) if isinstance(source, torch.Tensor)]
        self.names = [self.names[index] for index in kept]
        self.slots = [self.slots[index] for index in kept]
        self.sources = [sources[index] for index in kept]
        copies, self.spare = [self.copies[index] for index in kept], None
        self.copies = [
            held if _same_layout(held, source) else torch.empty_like(source, requires_grad=False)
            for held, source in zip(copies, self.sources)
        ]

    def restore(self) -> list[str]:
        """Set the learned tensors back to their values before the current step's first forward; the names
        set back (``[]`` with no copy for this step)."""
        if not self.copied:
            return []
        with torch.no_grad():
            for (tensors, key), saved in zip(self.slots, self.copies):
                current = tensors.get(key)
                if isinstance(current, torch.Tensor) and _same_layout(current, saved):
                    current.copy_(saved)
                elif isinstance(current, nn.Parameter):  # re-created in another shape by the bad forward
                    tensors[key] = nn.Parameter(saved.clone(), requires_grad=current.requires_grad)
                else:  # the bad forward replaced the tensor by one of another shape (or dropped it)
                    tensors[key] = saved.clone()
        return list(self.names)


def written_outside(model: nn.Module, optimizers: Sequence[Any]) -> dict[str, nn.Parameter]:
    """The parameters of ``model`` that no optimizer step writes, by name: frozen ones (``requires_grad``
    false: an optimizer skips a parameter without a gradient) and those no optimizer holds (a momentum
    encoder, an EMA codebook, one a forward re-creates as a new ``nn.Parameter``, which no optimizer holds
    from then on). Only code of the module's own (a forward, ``training_step``) changes them, as it changes
    buffers. With no ``optimizers``, none: a caller that names none has every parameter count as trained. A
    set of ids and a pass over the parameters: for a snapshot or a flagged step, not per step."""
    if not optimizers:
        return {}
    held = {
        id(param) for optimizer in optimizers for group in optimizer.param_groups for param in group["params"]
    }
    return {
        name: param
        for name, param in model.named_parameters()
        if not param.requires_grad or id(param) not in held
    }


def fingerprints(tensors: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """A sum of each plain dense floating-point tensor of ``tensors``, by name, computed on its device (one
    transfer per device): what tells :meth:`PreStepBuffers.learn` a parameter was written. A write that
    keeps the sum bit for bit (rows swapped) goes unseen: that parameter falls back to the snapshot's values
    at a data fault, as one not learned yet."""
    by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in tensors.items():
        if type(tensor) in (torch.Tensor, nn.Parameter) and tensor.layout == torch.strided:
            if tensor.is_floating_point() and not is_lazy(tensor):
                by_device.setdefault(tensor.device, []).append((name, tensor.detach()))
    found: dict[str, float] = {}
    for named in by_device.values():
        sums = torch.stack([tensor.sum(dtype=torch.float32) for _, tensor in named]).tolist()
        found.update((name, value) for (name, _), value in zip(named, sums))
    return found


def _is_pruning_mask(model: nn.Module, name: str) -> bool:
    """Whether buffer ``name`` is the ``<tensor>_mask`` of ``torch.nn.utils.prune`` (next to
    ``<tensor>_orig``): as large as its weight, it would be copied before every step."""
    owner, _, key = name.rpartition(".")
    return key.endswith("_mask") and f"{key[: -len('_mask')]}_orig" in model.get_submodule(owner)._parameters


def _same_layout(tensor: torch.Tensor, other: torch.Tensor) -> bool:
    return tensor.shape == other.shape and tensor.dtype == other.dtype and tensor.device == other.device


class RollbackState:
    """What a snapshot keeps of one callback that rolls back with the model.

    ``rollback_state_dict()`` when the callback defines it (the part of its state that belongs to the model,
    e.g. :class:`~lightning_pulse.PulseCycle`'s probe but not its clock), else its whole ``state_dict()``;
    restored through the matching loader.
    """

    def __init__(self, callback: Any) -> None:
        self.callback = callback

    def state_dict(self) -> Any:
        own = getattr(self.callback, "rollback_state_dict", None)
        return own() if callable(own) else self.callback.state_dict()

    def load_state_dict(self, state_dict: Any) -> None:
        own = getattr(self.callback, "load_rollback_state_dict", None)
        load, name = (own, "load_rollback_state_dict") if callable(own) else (None, "load_state_dict")
        try:
            (load or self.callback.load_state_dict)(state_dict)
        except Exception as error:  # the user's error, kept; a note says whose load failed, and when
            note = (
                f"raised by {type(self.callback).__name__}.{name} while a StabilityGuard rollback restored "
                "its state (it sets `restore_on_rollback = True`, which promises a load that works mid-run); "
                "the model and optimizers were already restored, so the run cannot go on. Make it load any "
                "state its rollback_state_dict() (or state_dict()) gave, or set "
                "`restore_on_rollback = False`."
            )
            getattr(error, "add_note", partial(warnings.warn, stacklevel=2))(note)  # a note from Python 3.11
            raise


#: the most snapshots a ring can be asked to keep: a Python deque holds at most ``sys.maxsize`` items (a
#: larger ``max_snapshots`` raised a bare OverflowError naming no field). Each snapshot copies the model and
#: optimizer state to CPU memory, which bounds the count far lower; how many fit is the user's to judge.
MAX_SNAPSHOTS = sys.maxsize


class SnapshotRing:
    """The newest ``capacity`` snapshots, oldest evicted first.

    Raises:
        ValueError: if ``capacity < 1``.
    """

    def __init__(self, capacity: int = 2) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or not 1 <= capacity <= MAX_SNAPSHOTS:
            raise ValueError(f"`capacity`={capacity!r} must be an int from 1 to {MAX_SNAPSHOTS}.")
        self.capacity = capacity
        self._snapshots: deque[TrainingSnapshot] = deque(maxlen=capacity)

    def add(self, snapshot: TrainingSnapshot) -> None:
        # a newer snapshot of the same step replaces the older one (e.g. step and phase triggers together)
        if self._snapshots and self._snapshots[-1].step == snapshot.step:
            self._snapshots.pop()
        self._snapshots.append(snapshot)

    def recycle(self, step: int) -> TrainingSnapshot | None:
        """Remove and return the snapshot that adding one of ``step`` would evict (``None`` if none would be),
        so that its buffers can be refilled (``take_snapshot(..., reuse=...)``)."""
        if self._snapshots and self._snapshots[-1].step == step:
            return self._snapshots.pop()
        if len(self._snapshots) == self.capacity:
            return self._snapshots.popleft()
        return None

    def newest(self) -> TrainingSnapshot | None:
        return self._snapshots[-1] if self._snapshots else None

    def newest_at_or_before(self, step: int) -> TrainingSnapshot | None:
        """The newest snapshot taken at or before ``step``, or ``None``."""
        for snapshot in reversed(self._snapshots):
            if snapshot.step <= step:
                return snapshot
        return None

    def capture(
        self,
        step: int,
        model: nn.Module,
        optimizers: Sequence[torch.optim.Optimizer] = (),
        schedulers: Sequence[Stateful] = (),
        callbacks: Mapping[str, Stateful] | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> TrainingSnapshot:
        """Take a snapshot of step ``step`` into the ring, refilling the buffers of the one it evicts."""
        snapshot = take_snapshot(
            step, model, optimizers, schedulers, callbacks, extra, reuse=self.recycle(step)
        )
        self.add(snapshot)
        return snapshot

    def roll_back(
        self,
        step: int,
        model: nn.Module,
        optimizers: Sequence[torch.optim.Optimizer] = (),
        schedulers: Sequence[Stateful] = (),
        callbacks: Mapping[str, Stateful] | None = None,
        rewind_schedule: bool = True,
    ) -> tuple[TrainingSnapshot | None, bool]:
        """Restore :meth:`last_good` for ``step`` (one that fits ``model`` and ``optimizers``, and with
        ``rewind_schedule`` ``schedulers``) and forget the snapshots taken after it (they belong to the
        timeline that is undone); returns what :meth:`last_good` returned."""
        target, predates = self.last_good(model, step, optimizers, schedulers if rewind_schedule else None)
        if target is not None:
            restore_snapshot(target, model, optimizers, schedulers, callbacks, rewind_schedule)
            self.drop_after(target.step)
        return target, predates

    def oldest(self) -> TrainingSnapshot | None:
        return self._snapshots[0] if self._snapshots else None

    def rollback_candidates(
        self,
        model: nn.Module,
        step: int,
        optimizers: Sequence[torch.optim.Optimizer] | None = None,
        schedulers: Sequence[Any] | None = None,
    ) -> list[TrainingSnapshot]:
        """The snapshots a rollback for trouble at ``step`` could return to, in the order to try them: the
        one :meth:`last_good` picks, then the oldest held (empty when none fits ``model``, ``optimizers`` and
        ``schedulers``)."""
        newest, _ = self.last_good(model, step, optimizers, schedulers)
        oldest = self.oldest()
        if newest is None:
            return []
        return [newest] + ([oldest] if oldest is not None and oldest is not newest else [])

    def last_good(
        self,
        model: nn.Module,
        step: int,
        optimizers: Sequence[torch.optim.Optimizer] | None = None,
        schedulers: Sequence[Any] | None = None,
    ) -> tuple[TrainingSnapshot | None, bool]:
        """The snapshot to roll back to: the newest one taken at or before ``step`` that still fits
        ``model`` (and ``optimizers`` and ``schedulers``, when given: :meth:`TrainingSnapshot.fits`), else the
        oldest one that fits.

        Snapshots that no longer fit (channels pruned since, a parameter group added to an optimizer, an LR
        scheduler swapped) are dropped: they can never be loaded again.

        Returns:
            ``(snapshot, predates)``: ``snapshot`` is ``None`` when none fits; ``predates`` tells whether it
            was taken at or before ``step``.
        """
        for snapshot in list(self._snapshots):
            if not snapshot.fits(model, optimizers, schedulers):
                self._snapshots.remove(snapshot)
        target = self.newest_at_or_before(step)
        return (target, True) if target is not None else (self.oldest(), False)

    def discard(self, snapshot: TrainingSnapshot) -> None:
        self._snapshots.remove(snapshot)

    def drop_after(self, step: int) -> None:
        """Forget snapshots newer than ``step`` (they belong to a timeline that was rolled back)."""
        while self._snapshots and self._snapshots[-1].step > step:
            self._snapshots.pop()

    def clear(self) -> None:
        self._snapshots.clear()

    @property
    def nbytes(self) -> int:
        return sum(snapshot.nbytes for snapshot in self._snapshots)

    @property
    def steps(self) -> list[int]:
        return [snapshot.step for snapshot in self._snapshots]

    def __len__(self) -> int:
        return len(self._snapshots)

    def __iter__(self) -> Iterator[TrainingSnapshot]:
        return iter(self._snapshots)


class SnapshotSchedule:
    """When :class:`~lightning_pulse.StabilityGuard` snapshots, and which snapshot a rollback returns to.

    A snapshot is due every ``every`` steps, when one was requested (a maintain phase began, the model's
    structure changed) and when the optimizers' classes, parameter groups or parameters (objects replaced:
    a submodule assigned anew with a new optimizer) or the LR schedulers changed since the newest one (older
    snapshots no longer fit them), but only in a healthy state (no open incident, no skips pending). A
    rollback returns to the newest snapshot taken at least ``margin`` steps before the incident began.

    Args:
        every: steps between periodic snapshots; ``0``: only on request.
        capacity: snapshots kept (the ring's size).
        margin: how many steps a good snapshot must predate the first flagged step of an incident.

    Raises:
        ValueError: naming the argument (``snapshot_every``, ``max_snapshots``, ``rollback_margin``), for a
            value out of range or a ring that cannot reach ``margin`` steps back.
    """

    def __init__(self, every: int = 100, capacity: int = 2, margin: int = 10) -> None:
        for name, value, minimum in (("snapshot_every", every, 0), ("max_snapshots", capacity, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"`{name}`={value!r} must be an int >= {minimum}.")
        if isinstance(margin, bool) or not isinstance(margin, int) or margin < 0:
            raise ValueError(f"`rollback_margin`={margin!r} must be an int >= 0.")
        if capacity > MAX_SNAPSHOTS:
            raise ValueError(
                f"`max_snapshots`={capacity!r} must be an int from 1 to {MAX_SNAPSHOTS} (sys.maxsize, the most a "
                "Python deque holds); each snapshot is a copy of the model and optimizer state in CPU memory."
            )
        if every and (capacity - 1) * every < margin:
            raise ValueError(
                f"`max_snapshots`={capacity} snapshots every `snapshot_every`={every} steps never reach "
                f"`rollback_margin`={margin} steps back; allowed: (max_snapshots - 1) * snapshot_every >= "
                "rollback_margin."
            )
        self.every = every
        self.margin = margin
        self.ring = SnapshotRing(capacity)
        self.last_step: int | None = None
        self.taken = 0
        self.pending = False  # a snapshot was requested for the end of this step
        self.layout: tuple[tuple[int, ...], ...] | None = (
            None  # the optimizers' layout at the newest snapshot
        )
        self.scheduler_kinds: tuple[type, ...] | None = None  # and the schedulers' classes
        self.optimizer_kinds: tuple[type, ...] | None = None  # and the optimizers' classes
        self.inner_kinds: tuple[type, ...] = ()  # and their inner ones' (SAM's base optimizer)
        self.parameter_ids: tuple[int, ...] = ()  # and the ids of the parameters they held
        # the optimizers' own ids: their parameters are compared only when one of these changed (a new
        # optimizer), so a step pays a tuple per optimizer, not a pass over the parameters
        self.optimizer_ids: tuple[int, ...] = ()
        self.replaced = False  # the parameters changed since the newest snapshot: sticky until the next

    def due(
        self,
        step: int,
        healthy: bool,
        optimizers: Sequence[torch.optim.Optimizer] | None = None,
        schedulers: Sequence[Any] | None = None,
    ) -> bool:
        """Whether to snapshot at the end of the applied step that leaves the counter at ``step``: also when
        ``optimizers`` (if given) have other classes (:func:`optimizer_kinds`) or another parameter-group
        layout than at the newest snapshot (a ``len`` per group: :func:`optimizer_layout`), or ``schedulers``
        (if given) other classes (:func:`scheduler_kinds`), so that a rollback after a callback swapped the
        optimizer for another kind, after ``add_param_group``, or after ``StochasticWeightAveraging`` swapped
        in its scheduler, or after the module replaced parameters and built a new optimizer over them
        (:meth:`parameters_replaced`), has one that fits."""
        requested, self.pending = self.pending, False
        relaid = (
            optimizers is not None
            and self.layout is not None
            and (
                optimizer_kinds(optimizers) != self.optimizer_kinds
                or optimizer_layout(optimizers) != self.layout
                # a new optimizer: over replaced parameters? (a pass over them only then)
                or self.parameters_replaced(optimizers)
                # a wrapper's inner optimizer swapped (SAM(Adam) -> SAM(SGD)); no walk for plain optimizers
                or (
                    bool(self.inner_kinds)
                    and optimizer_kinds(inner_optimizers(optimizers)) != self.inner_kinds
                )
            )
        ) or (
            schedulers is not None
            and self.scheduler_kinds is not None
            and scheduler_kinds(schedulers) != self.scheduler_kinds
        )
        if requested or relaid:
            return healthy
        return bool(self.every) and step - (self.last_step or 0) >= self.every and healthy

    def parameters_replaced(self, optimizers: Sequence[torch.optim.Optimizer]) -> bool:
        """Whether ``optimizers`` hold other parameter objects than at the newest snapshot
        (:func:`optimizer_parameter_ids`). Read only when an optimizer is another object than then: torch
        keeps an optimizer's parameters, and a module that replaces some builds a new optimizer over them
        (or the parameters would not train). A new optimizer over the same parameters is no change, and is
        then the one compared. Once found, the change holds until the next snapshot: a later optimizer could
        take the address, so the ``id``, of the one then."""
        if not self.replaced and (ids := tuple(map(id, optimizers))) != self.optimizer_ids:
            if optimizer_parameter_ids(optimizers) == self.parameter_ids:
                self.optimizer_ids = ids
            else:
                self.replaced = True
        return self.replaced

    def take(
        self,
        step: int,
        model: nn.Module,
        optimizers: Sequence[torch.optim.Optimizer] = (),
        schedulers: Sequence[Stateful] = (),
        callbacks: Mapping[str, Stateful] | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> TrainingSnapshot:
        snapshot = self.ring.capture(step, model, optimizers, schedulers, callbacks, extra)
        self.settle(step, optimizers, schedulers)
        self.taken += 1
        return snapshot

    def settle(
        self, step: int, optimizers: Sequence[torch.optim.Optimizer] = (), schedulers: Sequence[Any] = ()
    ) -> None:
        """The snapshot due at ``step`` was dealt with: taken, or left out (a state with non-finite values is
        not kept). The next one is due a period later, not at every step until the state is fit to keep. A
        left-out one records the optimizers' classes and layout and the schedulers' classes too, so a change
        of optimizers, parameter groups or schedulers before it no longer makes a snapshot due at once: the
        next periodic one holds it (a rollback meanwhile returns only to a snapshot that fits)."""
        self.last_step, self.layout = step, optimizer_layout(optimizers)
        self.optimizer_kinds = optimizer_kinds(optimizers)
        self.inner_kinds = optimizer_kinds(inner_optimizers(optimizers))
        self.scheduler_kinds = scheduler_kinds(schedulers)
        self.parameter_ids = optimizer_parameter_ids(optimizers)
        self.optimizer_ids, self.replaced = tuple(map(id, optimizers)), False

    def roll_back(
        self,
        incident_start: int,
        model: nn.Module,
        optimizers: Sequence[torch.optim.Optimizer] = (),
        schedulers: Sequence[Stateful] = (),
        callbacks: Mapping[str, Stateful] | None = None,
        rewind_schedule: bool = True,
    ) -> tuple[TrainingSnapshot | None, bool]:
        """Restore the last good snapshot for an incident that began at ``incident_start``, one that fits
        ``model`` and ``optimizers`` (see :meth:`SnapshotRing.roll_back`)."""
        step = incident_start - self.margin
        return self.ring.roll_back(step, model, optimizers, schedulers, callbacks, rewind_schedule)


def runs_step_hooks(optimizer: torch.optim.Optimizer) -> bool:
    """Whether torch runs ``optimizer``'s step hooks around its whole ``step``: ``Optimizer.__init__`` wraps
    the class's ``step`` (marked ``hooked``) and makes the instance's hook dicts; a class that never calls it
    (or overrides ``step`` in a class torch never built) has neither."""
    return bool(getattr(type(optimizer).step, "hooked", False)) and hasattr(
        optimizer, "_optimizer_step_post_hooks"
    )


def hook_around_steps(optimizer: torch.optim.Optimizer, hooks: StepHooks) -> list[Any]:
    """Run ``hooks``' ``_enter`` and ``_leave`` around every ``step`` of ``optimizer``: as torch's step hooks
    where it runs them (:func:`runs_step_hooks`), else through a :class:`StepThrough` on the instance. The
    removable handles."""
    if runs_step_hooks(optimizer):
        return [
            optimizer.register_step_pre_hook(hooks._enter),
            optimizer.register_step_post_hook(hooks._leave),
        ]
    return [StepThrough(hooks, optimizer)]


class StepHooks(Protocol):
    def _enter(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> tuple[Any, Any] | None: ...

    def _leave(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None: ...


class StepThrough:
    """An optimizer instance's ``step`` that runs ``hooks``' ``_enter`` and ``_leave`` around the class's step
    (or an instance's own ``step`` set before), for an optimizer whose step runs no step hooks
    (:func:`runs_step_hooks`). Lightning calls the optimizer's ``step`` attribute, so the instance's one is
    found first. A removable handle: :meth:`remove` takes it out of the chain, in any order (StabilityGuard
    and GradientCache may both wrap the same optimizer in one fit). A class, not a closure: the optimizer
    stays picklable and copyable while it is attached.

    It marks the step as an LR scheduler's own wrapper does (``_wrapped_by_lr_sched``, ``_opt_called``): an
    LR scheduler would warn that ``step`` was overridden, and one built later (``StochasticWeightAveraging``'s
    ``SWALR``) would wrap it through ``step.__func__``, which it has not."""

    _wrapped_by_lr_sched = True

    def __init__(self, hooks: StepHooks, optimizer: torch.optim.Optimizer) -> None:
        self.hooks, self.optimizer = hooks, optimizer
        self.previous = getattr(optimizer, "__dict__", {}).get("step")
        optimizer.step = self  # type: ignore[method-assign]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        optimizer = self.optimizer
        optimizer._opt_called = True  # type: ignore[attr-defined]  # as an LR scheduler's wrapper records
        changed = self.hooks._enter(optimizer, args, kwargs)
        if changed is not None:  # new arguments, as torch takes them from a step pre hook
            args, kwargs = changed
        step = self.previous or type(optimizer).step.__get__(optimizer)
        result = step(*args, **kwargs)
        self.hooks._leave(optimizer, args, kwargs)
        return result

    def remove(self) -> None:
        outer = getattr(self.optimizer, "__dict__", {}).get("step")
        if outer is self:
            if self.previous is None:
                del self.optimizer.step
            else:
                self.optimizer.step = self.previous  # type: ignore[method-assign]
            return
        while isinstance(outer, StepThrough):  # wrapped again since: unlink it, the outer one stays
            if outer.previous is self:
                outer.previous = self.previous
                return
            outer = outer.previous
