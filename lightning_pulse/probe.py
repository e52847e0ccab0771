"""The evaluation probe PulseCycle (at each maintain phase) and ScheduledPrune (around each prune event) run:
the module's own ``validation_step`` on a few fixed held-out batches, outside Lightning's validation loop.

It needs the Trainer (its strategy, precision plugin and validation dataloader), so it is Lightning glue,
not core; it lives apart because two callbacks share it.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import inspect
import itertools
import math
import types
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from functools import partial
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.data import extract_batch_size
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.seed import isolate_rng
from torch.utils._pytree import tree_leaves
from torch.utils.data import DataLoader, Dataset, Sampler

from lightning_pulse import _lightning_compat as compat
from lightning_pulse.core.carried_state import kept_buffers, kept_carried_state, kept_python_state
from lightning_pulse.core.optimizer_modes import at_evaluation_point
from lightning_pulse.core.per_sample_loss import LossCapture
from lightning_pulse.core.selection import entries_replaced, rebuilt, take_samples
from lightning_pulse.core.snapshots import TrainingSnapshot, holding
from lightning_pulse.core.stability_steps import DrawnState
from lightning_pulse.core.validation_streams import ProbeFailed, state_reset_note
from lightning_pulse.loggers import log_to_loggers

#: the tensors the probes of this process handed to a collective (see ``compat.CollectiveHold``); the callbacks
#: that run a probe wait for them at teardown
PROBE_COLLECTIVES = compat.CollectiveHold()
#: what gets a batch StabilityGuard could not copy (:func:`batch_copy`)
RERUN = "the re-run of the flagged step's `training_step`"

# how `self.log` and `self.log_dict` take their arguments: a captured call's `batch_size` is read by them
_LOG = inspect.signature(pl.LightningModule.log)
_LOG_DICT = inspect.signature(pl.LightningModule.log_dict)


def first_validation_batches(
    trainer: pl.Trainer, pl_module: pl.LightningModule, count: int
) -> tuple[list[Any], bool]:
    """The first ``count`` batches of the run's first validation dataloader (empty if there is none), and whether
    there are several (a list or dict of them: Lightning then passes ``dataloader_idx`` to ``validation_step``).
    At most as many as the fit's validation takes of it (``limit_val_batches``): the probe evaluates only data
    that Lightning would validate on.

    Taken inside ``isolate_rng``: creating a DataLoader iterator draws a seed from the global generator, and
    an evaluation must not change the training run's shuffling or dropout. The loader's own generators (its
    ``generator``, its sampler's, its batch sampler's and that one's sampler's: a shuffle, the workers' base
    seed) are restored too, which ``isolate_rng`` leaves: else every later validation saw another permutation,
    and with ``limit_val_batches`` another ``val_loss``. A loader with persistent workers is
    read through a copy without them (``compat.without_persistent_workers``): its own iterator, which the
    fit's first validation builds (drawing that seed) and only resets from then on, is never the probe's.
    """
    loaders = compat.val_dataloader_of(trainer, pl_module)
    several = isinstance(loaders, (list, tuple, Mapping)) and len(loaders) > 1
    if isinstance(loaders, Mapping):
        loaders = list(loaders.values())
    if isinstance(loaders, (list, tuple)):
        loaders = loaders[0] if loaders else None
    batches: list[Any] = []
    if loaders is not None:
        count = min(count, compat.validation_batches_taken(trainer, loaders))
    if loaders is None or count < 1:
        return batches, several
    with isolate_rng(), _loader_generators_kept(loaders):
        for batch in compat.without_persistent_workers(loaders):
            batches.append(batch)
            if len(batches) >= count:
                break
    return batches, several


@contextmanager
def _loader_generators_kept(loader: Any) -> Iterator[None]:
    """Restore, on the way out, the state of each distinct ``torch.Generator`` a DataLoader reaches."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    holders = (
        loader,
        getattr(loader, "sampler", None),
        batch_sampler,
        getattr(batch_sampler, "sampler", None),
    )
    generators = {
        id(g): g for h in holders if isinstance(g := getattr(h, "generator", None), torch.Generator)
    }
    states = [(generator, generator.get_state()) for generator in generators.values()]
    try:
        yield
    finally:
        for generator, state in states:
            generator.set_state(state)


@contextmanager
def outside_the_loop(
    pl_module: pl.LightningModule,
    log: Callable[..., None],
    log_dict: Callable[..., None],
    step_context: AbstractContextManager,
    grad_mode: bool = False,
) -> Iterator[None]:
    """Run one of the module's own steps outside Lightning's loop without leaving a trace in the run: ``self.log``
    and ``self.log_dict`` go to ``log`` and ``log_dict``; torchmetrics states, the tensor state the module
    carries between batches (an RNN's hidden state) and its public lists, dicts and numbers (the Lightning
    docs' ``self.validation_step_outputs.append(loss)``, counters) come back; and a step that draws random
    numbers (dropout, a diffusion's noise) draws from a copy of the generators. ``step_context`` is the
    precision plugin's context for that kind of step. ``grad_mode``: autograd on, as in Lightning's training
    step (a loss that calls ``torch.autograd.grad``, a physics or gradient-penalty term, needs it); nothing
    calls ``backward``, so no parameter's ``.grad`` changes. Off: nothing records a gradient, as in
    validation."""
    pl_module.log = log  # type: ignore[method-assign]
    pl_module.log_dict = log_dict  # type: ignore[method-assign]
    try:
        with (
            kept_python_state(pl_module),
            compat.frozen_metric_states(pl_module),
            kept_carried_state(pl_module),
            isolate_rng(),
            torch.set_grad_enabled(grad_mode),
            step_context,
        ):
            yield
    finally:
        del pl_module.log
        del pl_module.log_dict


def run_validation_probe(
    trainer: pl.Trainer,
    pl_module: pl.LightningModule,
    batches: list[Any],
    several: bool = False,
    unlogged: set[str] | None = None,
    owner: str = "lightning_pulse",
    uncopied: set[type] | None = None,
    failed_on_all: bool = False,
) -> dict[str, float]:
    """Evaluate the module's own ``validation_step`` on ``batches`` (of the first of ``several`` validation
    dataloaders: then called with ``dataloader_idx=0``, as Lightning does) and return what it logs, reduced as
    Lightning's epoch end reduces it (each batch a copy, prepared as Lightning prepares a fresh one, so
    ``batches`` stay as they are): a mean (the default ``reduce_fx``) weighted by each batch's size
    (``self.log(..., batch_size=...)``, else inferred from the batch as Lightning infers it, only for these), so
    a short last batch counts for its samples; ``"sum"``, ``"max"`` and ``"min"`` as named; a torchmetrics
    object computed once, after the last batch, over all the batches it saw. A value logged with
    ``on_epoch=False`` has no epoch figure and is left out. The names of values logged with ``logger=False``
    are added to ``unlogged``, where given: the figures keep them, the callbacks do not send them to the
    loggers (the user kept them out of the loggers).

    The module's ``self.log`` calls are captured instead of reaching Lightning's logger connector; its
    torchmetrics states, any tensor state it carries between batches (an RNN's hidden state), its public
    lists, dicts and numbers (outputs kept for the epoch end, counters) and its buffers (one written in eval
    mode: a count of validation samples, a running mean updated in every forward) are restored afterwards;
    and it draws from a copy of the random generators; so neither training nor the real validation loop sees
    anything of the probe. The tensor state ``validation_step`` carries from batch to batch (a stateful RNN's)
    is the training stream's: the probe calls none of the module's validation hooks (see
    :mod:`lightning_pulse.core.validation_streams`). ``failed_on_all``: a ``validation_step`` that raises is
    told to every rank after that batch (a vote every rank reaches after each batch and after the metrics'
    ``compute``: :func:`_failure_told_to_every_rank`), and :class:`ProbeFailed`, naming each failed rank's
    error, is raised on all of them, so none waits in a collective the one that failed never reaches.
    Under DDP every rank calls this at the same step and gets the figures over every rank's batches, as
    ``sync_dist=True`` gives them: the weighted sums and the weights summed over ranks, sums summed, maxima and
    minima taken over ranks.
    """
    sums: dict[str, float] = {}  # a mean's values times their batch sizes; a sum's values
    weights: dict[str, float] = {}  # a mean's batch sizes
    extremes: dict[str, tuple[str, float]] = {}  # "max" / "min" and the value so far
    metrics: dict[str, Any] = {}  # torchmetrics objects logged, computed after the last batch
    # the batch validation_step runs on, and its size, inferred once where a call gives none
    batch: Any = None
    inferred_size: int | None = None

    def size_of_the_batch() -> int:
        nonlocal inferred_size
        if inferred_size is None:
            try:
                inferred_size = extract_batch_size(batch)
            except MisconfigurationException:  # no tensor in it: Lightning's validation says so
                inferred_size = 1
        return inferred_size

    def capture(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        arguments = _LOG.bind_partial(pl_module, name, value, *args, **kwargs).arguments
        reduction = _reduction(arguments.get("reduce_fx", "mean"))
        if arguments.get("on_epoch") is False or reduction is None:
            return
        if arguments.get("logger") is False and unlogged is not None:
            unlogged.add(name)
        if hasattr(value, "compute") and callable(value.compute):  # a torchmetrics Metric object
            metrics[name] = value
            return
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                return
            value = value.detach().float().item()
        if not isinstance(value, (int, float)):
            return
        value = float(value)
        if reduction == "mean":
            batch_size = arguments.get("batch_size")
            weight = float(size_of_the_batch() if batch_size is None else batch_size)
            sums[name] = sums.get(name, 0.0) + value * weight
            weights[name] = weights.get(name, 0.0) + weight
        elif reduction == "sum":
            sums[name] = sums.get(name, 0.0) + value
            weights[name] = 1.0 / trainer.world_size  # summed over ranks: 1, so the figure is the sum
        else:
            pick = max if reduction == "max" else min
            extremes[name] = (reduction, pick(extremes[name][1], value) if name in extremes else value)

    def capture_dict(dictionary: Mapping[str, Any], *args: Any, **kwargs: Any) -> None:
        arguments = _LOG_DICT.bind_partial(pl_module, dictionary, *args, **kwargs).arguments
        keys = ("batch_size", "reduce_fx", "on_epoch", "logger")
        shared = {key: arguments[key] for key in keys if key in arguments}
        for name, value in dictionary.items():
            capture(name, value, **shared)

    modes = {module: module.training for module in pl_module.modules()}
    pl_module.eval()
    told = partial(_failure_told_to_every_rank, trainer, pl_module, failed_on_all)
    try:
        with (
            kept_buffers(pl_module),
            outside_the_loop(pl_module, capture, capture_dict, trainer.precision_plugin.val_step_context()),
        ):
            for index in itertools.count():
                # every rank is past this batch, raised or not, before any goes on to the next one's collectives;
                # a rank with fewer batches (an uneven validation shard) votes until every rank has had its last
                with told(more=index + 1 < len(batches)) as vote:
                    if index < len(batches):
                        # a copy: a module that transforms its batch in place (`batch["x"] = transforms(...)` in
                        # on_before_batch_transfer, an in-place op on CPU) leaves the kept batch as it came
                        batch = batch_copy(batches[index], owner, "the probe's `validation_step`", uncopied)
                        batch = compat.prepare_evaluation_batch(trainer, pl_module, batch)
                        inferred_size = None
                        if several:
                            pl_module.validation_step(batch, index, 0)
                        else:
                            pl_module.validation_step(batch, index)
                if not vote.more:
                    break
            # inside: the metrics' states are the probe's until outside_the_loop restores them; a vote after
            # each, since `compute` syncs (torchmetrics' all_gather) and a rank may fail after it: one vote over
            # them all left a rank that failed in the first in the vote while another synced the second (a review)
            for name, metric in metrics.items():
                with told():
                    value = metric.compute()
                    if isinstance(value, torch.Tensor) and value.numel() == 1:  # alike on every rank
                        sums[name], weights[name] = float(value.detach().float()), 1.0
    finally:
        for module, training in modes.items():
            module.train(training)
    figures: dict[str, float] = {}
    if names := sorted(sums):
        totals = torch.tensor(
            [[sums[name] for name in names], [weights[name] for name in names]],
            dtype=torch.float64,
            device=pl_module.device,
        )
        if trainer.world_size > 1:
            totals = compat.reduce_held(trainer.strategy, totals, "sum", PROBE_COLLECTIVES)
        figures.update(zip(names, (totals[0] / totals[1]).tolist()))
    for reduction in ("max", "min"):  # rarely logged: a collective each only where one is
        if names := sorted(name for name, (kind, _) in extremes.items() if kind == reduction):
            values = torch.tensor(
                [extremes[name][1] for name in names], dtype=torch.float64, device=pl_module.device
            )
            if trainer.world_size > 1:
                values = compat.reduce_held(trainer.strategy, values, reduction, PROBE_COLLECTIVES)
            figures.update(zip(names, values.tolist()))
    return dict(sorted(figures.items()))


@contextmanager
def _failure_told_to_every_rank(
    trainer: pl.Trainer, pl_module: pl.LightningModule, on: bool = True, more: bool = False
) -> Iterator[types.SimpleNamespace]:
    """Run a part of the probe that calls the module's code; where ``on``, an ``Exception`` it raises on any rank
    is told to every rank, and :class:`ProbeFailed` raised on all of them, naming each failed rank's error.
    ``more``: whether this rank has another batch after this part; what it yields has ``more`` set, after the
    part, to whether any rank has.

    Under DDP every rank reaches the vote after the same part, raised or not: a rank that failed must not sit in
    the vote while another goes on to the next batch's collectives (a ``self.all_gather``, a torchmetrics
    ``dist_sync_on_step``) or to ``metric.compute()``'s sync, or both wait for good. The vote is one small
    all-reduce per part; the errors' texts are gathered only once one failed (every rank knows it by then, so
    all reach that gather). One process: no collective. Off: what is raised goes through unchanged."""
    told = types.SimpleNamespace(more=more)
    if not on:
        yield told
        return
    error: Exception | None = None
    try:
        yield told
    except Exception as raised:
        error = raised
    said = None if error is None else ProbeFailed.said(error)
    failures: list[tuple[int | None, str]] = []
    if trainer.world_size <= 1:
        if said is not None:
            failures.append((None, said))
    else:
        votes = torch.tensor(
            [float(error is not None), float(more)], dtype=torch.float64, device=pl_module.device
        )
        failed, anywhere = compat.reduce_held(trainer.strategy, votes, "sum", PROBE_COLLECTIVES).tolist()
        told.more = anywhere > 0
        if failed > 0:
            gathered = compat.all_gather_objects(trainer, said)
            failures = [(rank, text) for rank, text in enumerate(gathered) if text is not None]
    if failures:
        raise ProbeFailed(error, failures) from error


def _attributes_copied(original: Any, copy_of_it: Any, copied_along: Callable[[Any], Any]) -> Any:
    """``copy_of_it`` (a shallow copy of the container ``original``) with its instance attributes copied as its
    entries are: a tensor held there (a mask beside the entries) changed in place by ``validation_step`` reached
    the kept batch, each probe reading the last one's result; an AttrDict (``self.__dict__ = self``) gets its own
    ``__dict__``. A ``UserDict``'s or ``UserList``'s ``data`` is its entries, already copied."""
    attributes = getattr(copy_of_it, "__dict__", None)
    if not attributes:
        return copy_of_it
    if getattr(original, "__dict__", None) is original:
        copy_of_it.__dict__ = copy_of_it
        return copy_of_it
    entries_held = isinstance(copy_of_it, (collections.UserDict, collections.UserList))
    for name, value in list(attributes.items()):
        if entries_held and name == "data":
            continue
        if entries_held and value is original.data:  # another name for its entries: the copy's
            attributes[name] = copy_of_it.data
        else:
            attributes[name] = copied_along(value)
    return copy_of_it


def batch_copy(
    batch: Any, owner: str = "lightning_pulse", use: str = "", uncopied: set[type] | None = None
) -> Any:
    """A copy of a kept batch for one probe or one re-run of ``training_step``: its tensors cloned through
    lists, tuples and mappings, each copied with its class and instance attributes (a Hugging Face
    ``BatchEncoding`` keeps the encodings ``word_ids()`` reads: :func:`entries_replaced`); any other object
    holding tensors (a dataclass, a batch class with ``.to()``, which Lightning moves as it is, one with
    ``__slots__`` such as ``dataclass(slots=True)`` or an attrs class, or one holding them through another
    object) copied along the paths to its tensors, those cloned, and with the plain data it holds (a list, dict, set, deque, numpy array or dataclass: ``_DATA``), as an
    in-place change in it would reach the kept batch. Every other object that leads to no tensor (a lock, a
    file or database handle, a tokenizer), plain data that will not copy, and every module or dataset the batch
    refers to is shared, not copied. An object holding no tensor is passed as it is; one that still cannot be
    copied too, said once per class in ``uncopied`` (``"<owner>: ..."``; ``use``: what gets the batch)."""

    def copied(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.clone()
        try:
            memo = _copy_memo(value)
            return value if memo is None else copy.deepcopy(value, memo)
        except Exception as error:  # measurement never kills a run: the batch itself, said once
            if uncopied is None or type(value) not in uncopied:
                if uncopied is not None:
                    uncopied.add(type(value))
                name, refused = type(value).__qualname__, _refused(error, value)
                held = "" if refused is None else f"`{refused}`, which it holds on the way to its tensors: "
                rank_zero_warn(
                    f"{owner}: a batch of class `{name}` could not be copied ({held}{type(error).__name__}: "
                    f"{error}), so {use or 'it'} gets the batch itself, and an in-place change to its tensors "
                    f"there reaches the batch as kept. Let `{refused or name}` be deep-copied (a `__deepcopy__` "
                    "that shares what cannot be copied) to have it copied."
                )
            return value

    def copied_along(value: Any) -> Any:
        if type(value) is dict:  # the common batch
            return {key: copied_along(item) for key, item in value.items()}
        if type(value) in (list, tuple):
            return type(value)([copied_along(item) for item in value])
        if isinstance(value, (dict, collections.UserDict, list, tuple)):
            try:  # of its class and with its attributes, as Lightning hands it over (a BatchEncoding's encodings)
                result = entries_replaced(value, copied_along)
            except Exception:
                # a class that refuses a shallow copy: built again from its entries, or copied as others are
                try:
                    return rebuilt(value, copied_along)
                except Exception:
                    return copied(value)
            return _attributes_copied(value, result, copied_along)
        if isinstance(value, Mapping):  # another mapping: built from its entries, as Lightning moves one
            return type(value)(
                collections.OrderedDict((key, copied_along(item)) for key, item in value.items())
            )
        return copied(value)

    return copied_along(batch)


# values that hold no tensor and are not looked into: scalars, strings, classes, modules, functions
_LEAVES = (type(None), bool, int, float, complex, str, bytes, bytearray, type, types.ModuleType)
_LEAVES += (types.FunctionType, types.BuiltinFunctionType, types.MethodType, torch.dtype, torch.device)
# objects a batch may refer to that are not of it: shared by its copies, not looked into (the model, a
# dataset the batch refers back to, a loader or a sampler)
_SOURCES = (torch.nn.Module, Dataset, DataLoader, Sampler)
# plain data: copied with a batch where it leads to no tensor, so a step's in-place change to it (a `pop`, an
# `append`, `*=`) stays in the copy; any other object that leads to no tensor (a handle, a tokenizer) is shared
_DATA = (list, tuple, dict, set, frozenset, collections.deque, collections.UserDict, collections.UserList)
_DATA += (np.ndarray,)


def _copy_memo(value: Any) -> dict[int, Any] | None:
    """The memo that makes ``copy.deepcopy(value, memo)`` copy only the objects on the paths from ``value`` to
    its tensors (:func:`_object_graph`) and the plain data they hold: each tensor cloned (as in a list, not
    deep-copied: a view copies its own elements, not its storage), the plain data off those paths copied (each
    tried once: what will not copy, an object array holding a lock, as itself), every other object it reaches
    as itself. ``None`` if it holds no tensor."""
    tensors, objects, parents = _object_graph(value)
    if not tensors:
        return None
    leading: set[int] = set()
    pending = list(tensors)
    while pending:
        for parent in parents.get(pending.pop(), ()):
            if parent not in leading:
                leading.add(parent)
                pending.append(parent)
    memo = {key: tensor.clone() for key, tensor in tensors.items()}
    memo[id(memo)] = [*tensors.values(), *objects.values()]  # deepcopy's keep-alive: no walked id is reused
    children: dict[int, list[int]] = {}
    for key, item in objects.items():
        for parent in () if key in leading else parents.get(key, ()):
            children.setdefault(parent, []).append(key)
        if key not in leading and (isinstance(item, _SOURCES) or not _is_data(item)):
            memo[key] = item  # shared
    data: set[int] = set()  # the plain data the copied objects reach through plain data
    pending = list(leading)
    while pending:
        for key in children.get(pending.pop(), ()):
            if key not in memo and key not in data:
                data.add(key)
                pending.append(key)
    for key in reversed(objects):  # each tried once, what it holds first (reached after it)
        if key in data:
            size = len(memo)
            try:
                copy.deepcopy(objects[key], memo)
            except Exception:  # shared: what the try copied is dropped (deepcopy only adds to the memo)
                while len(memo) > size:
                    memo.popitem()
                memo[key] = objects[key]
    return memo


def _is_data(item: Any) -> bool:
    return isinstance(item, _DATA) or dataclasses.is_dataclass(item)


def _refused(error: Exception, batch: Any) -> str | None:
    """The class of the object ``copy.deepcopy`` was copying when it raised ``error``, if not ``batch``'s."""
    trace, refused = error.__traceback__, None
    while trace is not None:
        if trace.tb_frame.f_code is copy.deepcopy.__code__:
            refused = trace.tb_frame.f_locals.get("x")
        trace = trace.tb_next
    return None if refused is None or refused is batch else type(refused).__qualname__


def _object_graph(value: Any) -> tuple[dict[int, torch.Tensor], dict[int, Any], dict[int, list[int]]]:
    """What ``value`` reaches through collections and objects' attributes (``__dict__`` and the ``__slots__``
    of every class of its MRO), each once: its tensors and the other objects (not looked into: modules,
    datasets, loaders, samplers), by id; and, by id, the objects each is reached from."""
    tensors: dict[int, torch.Tensor] = {}
    objects: dict[int, Any] = {}  # kept until the copy: no id is reused meanwhile
    parents: dict[int, list[int]] = {}
    pending: list[tuple[Any, int | None]] = [(value, None)]
    while pending:
        item, parent = pending.pop()
        if isinstance(item, _LEAVES):
            continue
        key = id(item)
        if parent is not None:
            parents.setdefault(key, []).append(parent)
        if key in objects or key in tensors:
            continue
        if isinstance(item, torch.Tensor):
            tensors[key] = item
            continue
        objects[key] = item
        if isinstance(item, _SOURCES):
            continue
        children: list[Any] = []
        if isinstance(item, dict):  # another Mapping through its attributes: a shelf or h5py file is not read
            children += item.keys()
            children += item.values()
        elif isinstance(item, (list, tuple, set, frozenset, collections.deque)):
            children += item
        if type(item) not in (dict, list, tuple, set, frozenset):  # a class's own attributes too
            children += getattr(item, "__dict__", {}).values()
            children += _slot_values(item)
        pending.extend((child, key) for child in children)
    return tensors, objects, parents


def _slot_values(item: Any) -> Iterator[Any]:
    for cls in type(item).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name in ("__dict__", "__weakref__"):
                continue
            if name.startswith("__") and not name.endswith("__"):
                name = f"_{cls.__name__.lstrip('_')}{name}"  # a private slot's name is mangled
            try:
                yield getattr(item, name)
            except AttributeError:  # an unset slot
                continue


def _reduction(reduce_fx: Any) -> str | None:
    """Lightning's name for a ``self.log`` reduction (``"mean"``, ``"sum"``, ``"max"``, ``"min"``), or ``None``
    for one it refuses itself."""
    if isinstance(reduce_fx, str):
        name = reduce_fx.lower()
        name = "mean" if name == "avg" else name
    else:
        name = {torch.mean: "mean", torch.sum: "sum", torch.max: "max", torch.min: "min"}.get(reduce_fx, "")
    return name if name in ("mean", "sum", "max", "min") else None


def training_losses(
    trainer: pl.Trainer,
    pl_module: pl.LightningModule,
    batches: list[tuple[int, Any]],
    grad_mode: bool = True,
    drawn: Mapping[int, DrawnState] | None = None,
    uncopied: set[type] | None = None,
) -> list[float]:
    """The losses the module's own ``training_step`` returns on ``(batch_idx, batch)`` pairs, without training.

    As the validation probe, with autograd on as in training unless ``grad_mode`` is false (no ``backward``
    either way; off, no graph is built, and a loss that calls ``torch.autograd.grad`` fails): ``self.log``
    calls dropped, torchmetrics states, carried tensor state and the random generators as they were; also
    the module's public lists, dicts and numbers (``self.training_step_outputs.append(loss)``, counters).
    Each batch is a copy, so a ``training_step`` that changes its batch in place leaves the batch that
    trained (and that later callbacks see) as it was. The modules stay in training mode (a batch's training
    loss is the figure compared), so buffers a training forward updates (BatchNorm's running statistics)
    change: the caller restores them (:func:`lightning_pulse.core.snapshots.holding` does). A step that
    returns no loss (Lightning's way to skip a batch) gives none.

    ``drawn``: by ``batch_idx``, the generator states a batch's ``training_step`` drew from when it trained
    (``StepRecord.drawn``); each such batch's step draws from them (its dropout masks, a diffusion's timesteps
    and noise), so that a re-run reproduces what trained. The run's generators come back after all the same.
    """
    losses: list[float] = []
    drawn = drawn or {}

    def drop(*args: Any, **kwargs: Any) -> None:
        return None

    with outside_the_loop(
        pl_module, drop, drop, trainer.precision_plugin.train_step_context(), grad_mode=grad_mode
    ):
        for batch_idx, batch in batches:
            for generator, state in drawn.get(batch_idx, ()):  # inside isolate_rng: the run's come back
                generator.set_state(state)
            output = pl_module.training_step(batch_copy(batch, "StabilityGuard", RERUN, uncopied), batch_idx)
            loss = output.get("loss") if isinstance(output, dict) else output
            if isinstance(loss, torch.Tensor):
                losses.append(float(loss.detach().float()))
    return losses


def captured_losses(
    trainer: pl.Trainer,
    pl_module: pl.LightningModule,
    batch: Any,
    batch_idx: int,
    batch_size: int,
    positions: torch.Tensor,
    pairwise: bool = False,
) -> list[tuple[str, torch.Tensor]]:
    """The unreduced losses of the ``torch.nn.functional`` losses the module's own ``training_step`` calls on
    the samples of ``batch`` (``batch_size`` of them) at ``positions``, in that order (a copy: batch mode's cut
    of it), each with its name, in call order
    (:meth:`~lightning_pulse.core.per_sample_loss.LossCapture.unreduced_losses`). ``pairwise``: a tensor with
    ``B`` along both first dimensions is reordered along both (a per-sample pairwise mask), not only along its
    first (tokens as long as the batch).

    Without training and without a trace, as :func:`training_losses` runs a step, with autograd on; and in eval
    mode, every buffer given back (:func:`~lightning_pulse.core.carried_state.kept_buffers`): no dropout draw
    or batch statistic couples the samples, so each sample's loss is its own wherever it sits in the batch.
    HardSampleReplay's check of which dimension of a loss holds the samples
    (:mod:`lightning_pulse.core.loss_layout`), once a fit.

    Raises:
        ValueError: under manual optimization, whose ``training_step`` steps its optimizers (not run).
    """
    if not pl_module.automatic_optimization:
        raise ValueError("its training_step steps its own optimizers (manual optimization), so it is not run")
    copied = batch_copy(batch, "HardSampleReplay", "its check of the loss's layout")
    reordered = take_samples(copied, positions, batch_size)
    for leaf in tree_leaves(reordered) if pairwise else ():
        if isinstance(leaf, torch.Tensor) and tuple(leaf.shape[:2]) == (batch_size, batch_size):
            leaf.copy_(leaf.index_select(1, positions.to(leaf.device)))  # a copy's: the batch is not touched

    def drop(*args: Any, **kwargs: Any) -> None:
        return None

    modes = {module: module.training for module in pl_module.modules()}
    capture = LossCapture(batch_size, batch=reordered)
    pl_module.eval()
    try:
        with (
            outside_the_loop(pl_module, drop, drop, trainer.precision_plugin.train_step_context(), True),
            kept_buffers(pl_module),
            capture,
        ):
            pl_module.training_step(reordered, batch_idx)
    finally:
        for module, training in modes.items():
            module.train(training)
    return capture.unreduced_losses()


def step_rerun(
    trainer: pl.Trainer, pl_module: pl.LightningModule
) -> Callable[..., list[tuple[str, torch.Tensor]]]:
    """``(batch, batch_idx, batch_size, positions) ->`` :func:`captured_losses` of this fit's module."""
    return partial(captured_losses, trainer, pl_module)


def losses_at(
    trainer: pl.Trainer,
    pl_module: pl.LightningModule,
    snapshot: TrainingSnapshot,
    flagged: list[tuple[int, Any]],
    reference: list[tuple[int, Any]],
    hold: compat.CollectiveHold,
    drawn: tuple[Mapping[int, DrawnState], Mapping[int, DrawnState]] = ({}, {}),
    uncopied: set[type] | None = None,
) -> tuple[float, float]:
    """The mean training loss of the ``flagged`` and of the ``reference`` batches with ``snapshot``'s weights
    swapped in (StabilityGuard's rollback test); the module's own state comes back bit for bit. ``drawn``: the
    generator states each list's batches drew from when they trained (:func:`training_losses`; every rank its
    own). Under DDP the sums are all-reduced, so every rank gets the same two numbers (every rank calls this
    at the same step). A ``training_step`` that raises on a rank raises on every rank, after the
    all-reduce."""
    failure: Exception | None = None
    with holding(snapshot, pl_module):
        try:
            flagged_losses = training_losses(trainer, pl_module, flagged, drawn=drawn[0], uncopied=uncopied)
            reference_losses = training_losses(
                trainer, pl_module, reference, drawn=drawn[1], uncopied=uncopied
            )
        except Exception as error:  # raised after the all-reduce, which every rank must reach
            failure, flagged_losses, reference_losses = error, [], []
    sums = torch.tensor(
        [
            sum(flagged_losses),
            len(flagged_losses),
            sum(reference_losses),
            len(reference_losses),
            failure is not None,
        ],
        dtype=torch.float64,
        device=pl_module.device,
    )
    if trainer.world_size > 1:
        sums = compat.reduce_held(trainer.strategy, sums, "sum", hold)
    flagged_sum, flagged_count, reference_sum, reference_count, failed = sums.tolist()
    if failed:  # on every rank alike
        raise failure if failure is not None else RuntimeError("training_step failed on another rank")
    if not flagged_count or not reference_count:  # every step skipped its batch: nothing to compare
        return math.nan, math.nan
    return flagged_sum / flagged_count, reference_sum / reference_count


def rerun_losses(
    trainer: pl.Trainer, pl_module: pl.LightningModule, record: Any, hold: compat.CollectiveHold
) -> tuple[Callable[..., list[float]], Callable[..., tuple[float, float]]]:
    """StabilityGuard's re-runs of ``training_step`` for a flagged step (``FlaggedStep.losses_of`` and
    ``losses_at``), drawing from the states ``record`` (the fit's ``StepRecord``) kept, and telling a batch class
    that does not copy once a fit (``record.uncopied``)."""
    return (
        partial(
            training_losses, trainer, pl_module, grad_mode=False, drawn=record.drawn, uncopied=record.uncopied
        ),
        partial(
            losses_at, trainer, pl_module, hold=hold, drawn=record.drawn_states, uncopied=record.uncopied
        ),
    )


class HeldOutProbe:
    """A callback's evaluation probe: the first ``batches`` validation batches, taken once per fit, and the
    module's ``validation_step`` run on them. Where there is no validation data or ``validation_step``, or the
    Trainer's ``limit_val_batches=0`` switches validation off, it warns once (``"<owner>: ... <what_stops>"``,
    with ``off_switch``, the owner's argument that turns the probe off) and answers ``None`` from then on."""

    def __init__(self, owner: str, batches: int, what_stops: str, off_switch: str) -> None:
        self.owner = owner
        self.batches = batches
        self.what_stops = what_stops
        self.off_switch = off_switch
        self._data: list[Any] | None = None
        self._several = False  # several validation dataloaders (the batches are the first one's)
        self._unavailable = False
        self.unlogged: set[str] = set()  # the names validation_step logged with `logger=False` this fit
        self.uncopied: set[type] = set()  # the batch classes found not to copy (said once each)
        self._reset_noted = False  # the note of a module that resets carried state for validation: once a fit

    @property
    def off(self) -> bool:
        """Whether the probe answers ``None`` for the rest of the fit (no validation data, ``limit_val_batches=0``,
        or a run that raised)."""
        return self._unavailable

    def reset(self) -> None:
        """Take the batches again at the next run (a new fit may have new validation data)."""
        self._data = None
        self.unlogged = set()
        self._reset_noted = False

    def for_loggers(self, figures: Mapping[str, float], prefix: str) -> dict[str, float]:
        """``figures`` as sent to the loggers, each name after ``prefix``: without those the module logged
        with ``logger=False`` (a progress-bar-only or private figure stays out of the loggers)."""
        return {f"{prefix}{name}": value for name, value in figures.items() if name not in self.unlogged}

    def logged_run(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, prefix: str
    ) -> dict[str, float] | None:
        """:meth:`run` on the weights the optimizers evaluate at (``at_evaluation_point``: a schedule-free
        optimizer's), its figures logged under ``prefix`` (:meth:`for_loggers`); ``None`` if unavailable."""
        figures = self.evaluated(trainer, pl_module)
        if figures is not None:
            log_to_loggers(trainer, self.for_loggers(figures, prefix))
        return figures

    def evaluated(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, float] | None:
        """:meth:`run` on the weights the optimizers evaluate at (``at_evaluation_point``): a schedule-free
        optimizer's evaluation point ``x``, where Lightning's validation (the module's hooks) reads it, not
        its training point ``y``. Every probe runs here: ScheduledPrune's called :meth:`run` itself and read
        ``y``, so next to a PulseCycle an event's "before" (the cycle's probe, at ``x``) and "after" (its own,
        at ``y``) were of two weight vectors."""
        return at_evaluation_point(trainer.optimizers, self.run, trainer, pl_module)

    def shares_batches(self, other: HeldOutProbe) -> bool:
        """Whether this probe reads the very batches ``other`` has read: the same ``batches`` count, and
        ``other``'s kept batches, which this probe takes as its own where it has taken none yet (they are the
        first ``batches`` of the same dataloader; a shuffled or iterable one gives other batches to a second
        read). A figure of ``other`` then stands for one of this probe's; otherwise it is of other data."""
        if other.batches != self.batches or not other._data:
            return False
        if self._data is None:
            self._data, self._several = other._data, other._several
        return self._data is other._data

    def run(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, float] | None:
        """What ``validation_step`` logs on the probe's batches (:func:`run_validation_probe`), or ``None`` if
        unavailable."""
        if self._unavailable or self.batches == 0:
            return None
        if self._data is None and trainer.limit_val_batches == 0:
            # switched off for speed, or because the validation data or step is not ready: the probe follows
            rank_zero_warn(
                f"{self.owner}: `limit_val_batches={trainer.limit_val_batches}` switches validation off, so "
                f"{self.what_stops}. Set `limit_val_batches` above 0 to run it, or `{self.off_switch}` to "
                "turn it off without this warning."
            )
            self._unavailable = True
            return None
        if self._data is None:
            self._data, self._several = first_validation_batches(trainer, pl_module, self.batches)
        if not self._data or not callable(getattr(pl_module, "validation_step", None)):
            rank_zero_warn(f"{self.owner}: no validation dataloader or `validation_step`; {self.what_stops}.")
            self._unavailable = True
            return None
        if not self._reset_noted:
            self._reset_noted = True
            if (note := state_reset_note(pl_module, self.owner, self.off_switch)) is not None:
                rank_zero_warn(note)
        try:
            return run_validation_probe(
                trainer, pl_module, self._data, self._several, self.unlogged, self.owner, self.uncopied, True
            )
        except ProbeFailed as failed:  # a measurement never ends a run: said, and off for this fit
            rank_zero_warn(failed.message(self.owner, self.off_switch))
            self._unavailable = True
            return None
