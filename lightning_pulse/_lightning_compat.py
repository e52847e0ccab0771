"""The only module that touches private Lightning (and torchmetrics) internals.

Every access is version-guarded and covered by ``tests/test_lightning_compat.py``, which fails loudly
when an upgrade moves an attribute, instead of letting a callback silently do nothing.
"""

from __future__ import annotations

import copy
import functools
import inspect
import math
import os
import re
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import GradientAccumulationScheduler, StochasticWeightAveraging
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torchmetrics import Metric

from lightning_pulse.core.comm_hook_memory import forget_compression_memory
from lightning_pulse.core.freeze_units import trainable_while
from lightning_pulse.core.run_shares import PlacedShares, shares_named
from lightning_pulse.core.step_plan import clock_epoch_steps, epoch_steps
from lightning_pulse.errors import PulseRefusal, first_names, pulse_class
from lightning_pulse.protocols import temporarily_frozen

LIGHTNING_VERSION = pl.__version__

_PROGRESS_ITEMS_ATTR = "_lightning_pulse_progress_items"


def add_progress_bar_item(trainer: pl.Trainer, key: str, value: Callable[[], str | float | None]) -> None:
    """Show ``key: value()`` in the Trainer's progress bar, whatever progress bar it has.

    ``ProgressBar.get_metrics`` is the documented override point; we wrap the bound method of the one
    instance the Trainer uses, so the user's own progress bar subclass keeps its behaviour.
    """
    bar = trainer.progress_bar_callback
    if bar is None:
        return
    items: dict[str, Callable[[], Any]] | None = getattr(bar, _PROGRESS_ITEMS_ATTR, None)
    if items is None:
        items = {}
        original = bar.get_metrics

        def get_metrics(trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
            metrics = dict(original(trainer, pl_module))
            for name, getter in items.items():
                shown = getter()
                if shown is not None:
                    metrics[name] = shown
            return metrics

        bar.get_metrics = get_metrics  # type: ignore[method-assign]
        setattr(bar, _PROGRESS_ITEMS_ATTR, items)
    items[key] = value


def val_dataloader_of(trainer: pl.Trainer, pl_module: pl.LightningModule) -> Any | None:
    """The validation dataloader(s) of the run, even before Lightning's validation loop has built them.

    ``trainer.val_dataloaders`` is only filled once the validation loop has run (sanity check or first
    epoch end); before that we ask the same sources Lightning would ask.
    """
    loaders = trainer.val_dataloaders
    if loaders is not None:
        return loaders
    # loaders given as fit(model, train, val): Lightning keeps them in the validation loop's data source
    source = getattr(getattr(trainer.fit_loop.epoch_loop, "val_loop", None), "_data_source", None)
    instance = getattr(source, "instance", None)
    if instance is not None and not isinstance(instance, (pl.LightningModule, pl.LightningDataModule)):
        return instance
    datamodule = trainer.datamodule
    if datamodule is not None and is_overridden("val_dataloader", datamodule):
        return datamodule.val_dataloader()
    if is_overridden("val_dataloader", pl_module):
        return pl_module.val_dataloader()
    return None


def validation_batches_taken(trainer: pl.Trainer, loader: Any) -> int | float:
    """How many batches of ``loader`` the fit's validation takes under the Trainer's ``limit_val_batches`` (an
    int caps them, a fraction takes that share; ``fast_dev_run`` and ``overfit_batches`` set it), reckoned by
    Lightning's own ``_parse_num_batches``; ``inf`` for a loader without a length. A limit Lightning refuses
    (a fraction of no whole batch, a fraction of a loader without a length) caps nothing here: Lightning's
    validation refuses it itself, with its message."""
    from lightning.pytorch.trainer.states import RunningStage

    return _batches_taken(RunningStage.VALIDATING, loader, trainer.limit_val_batches)


def training_batches_taken(trainer: pl.Trainer, loader: Any) -> int | float:
    """How many batches of ``loader`` an epoch of the fit trains under ``limit_train_batches``, as
    :func:`validation_batches_taken` reckons them: ``trainer.num_training_batches`` for ``loader``, known at
    its set-up (:func:`on_train_dataloader_ready`), before Lightning sets that figure (a reloaded DataLoader's
    too); ``inf`` for a loader without a length (a sampler without ``__len__``)."""
    from lightning.pytorch.trainer.states import RunningStage

    return _batches_taken(RunningStage.TRAINING, loader, trainer.limit_train_batches)


def _batches_taken(stage: Any, loader: Any, limit: int | float) -> int | float:
    from lightning.fabric.utilities.data import has_len
    from lightning.pytorch.trainer.connectors.data_connector import _parse_num_batches
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    length = len(loader) if has_len(loader) else math.inf
    try:
        return _parse_num_batches(stage, length, limit)
    except MisconfigurationException:
        return length


@contextmanager
def frozen_metric_states(module: Any) -> Iterator[None]:
    """Run a block that may update torchmetrics metrics on copies of their states, then give every metric
    back the very state objects it held (and its update count, cached ``compute`` and forward value).

    An out-of-loop evaluation (PulseCycle's maintain probe) calls the module's ``validation_step``, which
    updates the module's metric objects; without this, those updates would leak into the real epoch-end
    validation figures. The block updates copies, never the states themselves: under a launcher that pickles
    the module to its ranks (``ddp_spawn`` on CPU), a metric's state tensors (plain attributes, which
    Lightning's launcher does not un-share as it does parameters and buffers) are one memory for every rank.
    A ``MeanMetric``'s ``mean_value += ...`` then wrote into the other rank's state too, and the copy a rank
    kept on entry could hold the other rank's first batch; put back, it started every later probe off (a
    logged mean wrong by a different amount on each run). States shared between metrics (a
    ``MetricCollection``'s compute groups) stay shared in the copies.
    """
    memo: dict[int, Any] = {}
    saved = []
    for metric in module.modules():
        if isinstance(metric, Metric):
            states = {name: getattr(metric, name) for name in metric._defaults}
            saved.append((metric, states, metric._update_count, metric._computed, metric._forward_cache))
            for name, value in states.items():
                setattr(metric, name, copy.deepcopy(value, memo))
    try:
        yield
    finally:
        for metric, states, update_count, computed, forward_cache in saved:
            for name, value in states.items():
                setattr(metric, name, value)
            metric._update_count = update_count
            metric._computed = computed
            metric._forward_cache = forward_cache


class SkippedStepLogs:
    """Takes what a skipped optimizer step logged (``self.log`` in ``training_step`` and the hooks up to
    StabilityGuard's batch end, every micro-batch of its window) out of Lightning's epoch figures of the
    training results, so that the NaN loss of a skipped step does not make ``train_loss_epoch`` NaN (and
    ``EarlyStopping`` end the run). The step's own step values (``*_step``) are still published, as that step's,
    but no step-interval ``ReduceLROnPlateau`` reads them: Lightning's update of those schedulers after the
    step's batch end is passed over (:func:`pass_over_plateau_update`), so the step's NaN or spike is not a bad
    step to them, and a rollback leaves them at its snapshot's state. A monitor read at the epoch's end (an
    epoch-interval plateau scheduler, EarlyStopping, ModelCheckpoint) on a step value still reads the last
    step's: where that step was skipped, :meth:`epoch_ends` says so.

    Lightning's ``_ResultMetric.update`` rebinds ``value`` and ``cumulated_batch_size`` (``self.value =
    self.value + value * batch_size``; ``reduce_fx(self.value, value)`` for a max or min), never writes into
    them, so the references held at the step's first micro-batch (:meth:`step_starts`: a few attribute reads
    per logged key, no copy, no sync) are the epoch's figures without the step: :meth:`take_out` puts them
    back. A key the step logged first in its epoch goes back to its reset state, its step value kept; where no
    applied step logs it later in the epoch, it gets no epoch figure (:meth:`epoch_ends`). A torchmetrics object
    logged with ``self.log`` is the module's: its states keep what the step's update put in them, as all other
    module state the step's code changed. Holds the results weakly, and the logged figures by key, so a
    callback keeping it after the fit keeps no Trainer (and pickles).
    """

    def __init__(self, trainer: pl.Trainer | None = None) -> None:
        # the fit's training results: one collection the training epoch loop keeps for all its epochs
        loop = None if trainer is None else trainer.fit_loop.epoch_loop
        results = None if loop is None else loop._results
        self._results: Callable[[], Any] | None = None if results is None else weakref.ref(results)
        self._loop: Callable[[], Any] | None = None if loop is None else weakref.ref(loop)
        # key: (value, cumulated_batch_size, updates, step value)
        self._at_start: dict[str, tuple[Any, Any, int, Any]] = {}
        self._taken_out = 0  # steps taken out in this epoch
        # the step names (``name`` or ``name_step``) the last taken-out step logged, and its batch's count
        self._step_logged: tuple[int, set[str]] = (-1, set())
        self._unlogged: set[str] = set()  # the keys a taken-out step logged first in the epoch
        self._said: set[str] = set()  # the warnings said this fit, by kind

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_results": None, "_loop": None, "_at_start": {}, "_unlogged": set()}

    def _logged(self) -> Any:
        return None if self._results is None else self._results()

    def step_starts(self) -> dict[str, tuple[Any, Any, int, Any]]:
        """At the first micro-batch of an optimizer step: hold every logged result's figures, by reference.
        Returns the figures held before: those of a window that ended without an optimizer step, which
        :meth:`hold` puts back where that window goes on into this step."""
        held = self._at_start
        if (results := self._logged()) is not None:
            self._at_start = {
                key: (
                    result.value,
                    result.__dict__.get("cumulated_batch_size"),
                    result._update_count,
                    result._forward_cache,
                )
                for key, result in results.items()
            }
        return held

    def hold(self, held: dict[str, tuple[Any, Any, int, Any]]) -> None:
        """Hold ``held`` (from :meth:`step_starts`) as the figures at the current step's start."""
        self._at_start = held

    def take_out(self) -> None:
        """At the batch end of a skipped step: put back the epoch's figures held at its start, and keep the
        step-interval plateau schedulers from Lightning's update that follows."""
        loop = None if self._loop is None else self._loop()
        if (results := self._logged()) is None:
            return
        held = self._at_start
        if loop is not None:  # a new step value: a new tensor (``_ResultMetric.update`` clones it)
            fresh = [
                result
                for key, result in results.items()
                if result.meta.on_step and (key not in held or result._forward_cache is not held[key][3])
            ]
            logged = {result.meta.forked_name(True) for result in fresh}
            self._step_logged = (loop.batch_progress.total.processed, logged)
            # the plateau schedulers reading a value this step logged (a validation's, or one no dropped step
            # wrote, still reaches its own: a review)
            pass_over_plateau_update(loop, logged | {result.meta.name for result in fresh})
        for key, result in results.items():
            if not result.is_tensor or not result.meta.on_epoch:
                continue  # a torchmetrics object's states are the module's
            entry = held.get(key)
            if entry is not None and result._update_count == entry[2]:
                continue  # not logged by the step
            if entry is None or entry[2] == 0:  # logged first in the epoch by the step: as if it was not
                step_value = result._forward_cache  # but for its step value, published at this batch end
                result.reset()
                result._forward_cache, result.has_reset = step_value, False
                self._unlogged.add(key)
                continue
            result.value, batch_size, result._update_count = entry[:3]
            if batch_size is not None:
                result.cumulated_batch_size = batch_size
            result._computed = None
        self._taken_out += 1

    def epoch_ends(self, trainer: pl.Trainer, warn: Callable[[str], Any]) -> None:
        """At the training epoch's end, before the monitors read its figures, where a step of it was taken
        out: a key only skipped steps logged in the epoch gets no epoch figure (the mean of nothing is
        ``0 / 0``, NaN), and a monitored torchmetrics object holding a NaN is said, as is a monitored step value
        the epoch's last step logged where that step was skipped; once a fit each."""
        if not self._taken_out or (results := self._logged()) is None:
            return
        skipped, unlogged, self._taken_out, self._unlogged = self._taken_out, self._unlogged, 0, set()
        monitors, emptied, nan_metrics = _monitors(trainer), [], []
        for key, result in results.items():
            if result.has_reset or not result.meta.on_epoch:
                continue
            if key in unlogged and result._update_count == 0:
                result.has_reset = True  # left out of the epoch's figures, as a key not logged
                emptied.append(result.meta)
            elif not result.is_tensor and _read_by(result.meta, monitors) and _holds_nan(result.value):
                nan_metrics.append(result.meta)
        epoch = trainer.current_epoch
        if emptied and "emptied" not in self._said:
            self._said.add("emptied")
            warn(_emptied_message(emptied, monitors, epoch))
        if nan_metrics and "nan" not in self._said:
            self._said.add("nan")
            warn(_nan_metric_message(nan_metrics, monitors, epoch, skipped))
        loop = None if self._loop is None else self._loop()
        batch, logged = self._step_logged
        if loop is None or batch != loop.batch_progress.total.processed or "last" in self._said:
            return  # the epoch's last batch did not end a skipped step (or said already)
        per_step = {_plateau_monitor(c) for c in trainer.lr_scheduler_configs if c.interval == "step"}
        read = {
            key: [m for m in monitors[key] if m not in per_step] for key in sorted(logged) if key in monitors
        }
        if read := {key: found for key, found in read.items() if found}:  # read at the epoch's end
            self._said.add("last")
            warn(_last_step_message(read, epoch))


def pass_over_plateau_update(epoch_loop: Any, monitors: set[str] | frozenset[str] = frozenset()) -> None:
    """Call at the batch end of an optimizer step whose update was dropped: Lightning's update of the
    step-interval ``ReduceLROnPlateau`` schedulers that follows (the epoch loop's ``on_advance_end``, after
    every batch-end hook and any validation there) steps none of them whose monitor is in ``monitors`` (the
    values the step logged), for this batch only; one reading a validation's value is stepped as ever.

    That update reads the step's logged value (``trainer.callback_metrics[monitor]``): a skipped step's NaN
    or spike counted as a bad step (``num_bad_epochs``), and after a rollback, whose restore comes in the
    batch end, before it, left the scheduler a step past the snapshot's state, the rate cut where the
    patience was nearly used. Passed over, the scheduler counts no step, as for a step not taken; the other
    schedulers are stepped before the batch end, as ever. ``update_lr_schedulers`` is wrapped on this loop
    instance for its next plateau update only, and removes itself then; a wrapper left by a fit that raised
    before that update passes a later batch's update through (the batch counter differs)."""
    if epoch_loop is None or not callable(getattr(epoch_loop, "update_lr_schedulers", None)):
        return
    batch = epoch_loop.batch_progress.total.processed  # this batch's; a later batch's is higher

    def wrap(original: Callable[..., Any], state: dict[str, bool]) -> Callable[..., Any]:
        def update_lr_schedulers(interval: str, update_plateau_schedulers: bool) -> None:
            if interval != "step" or not update_plateau_schedulers:
                return original(interval, update_plateau_schedulers=update_plateau_schedulers)
            passed_over = state["active"] and epoch_loop.batch_progress.total.processed == batch
            remove()
            if not passed_over:
                return original(interval, update_plateau_schedulers=update_plateau_schedulers)
            strategy = epoch_loop.trainer.strategy
            configs = strategy.lr_scheduler_configs
            strategy.lr_scheduler_configs = [
                config for config in configs if not (config.reduce_on_plateau and config.monitor in monitors)
            ]
            try:
                original(interval, update_plateau_schedulers=update_plateau_schedulers)
            finally:
                strategy.lr_scheduler_configs = configs
            return None

        return update_lr_schedulers

    remove = _wrap_on_instance(epoch_loop, "update_lr_schedulers", wrap)


def after_plateau_updates(
    trainer: pl.Trainer, hook: Callable[[list[tuple[int, Any, Any]]], Any]
) -> Callable[[], None] | None:
    """Call at a batch end: ``hook(plateaus)`` right after each of Lightning's updates of the
    ``ReduceLROnPlateau`` schedulers that follow this batch's batch-end hooks (the step-interval ones in the
    epoch loop's ``on_advance_end``; at an epoch's last batch, the epoch-interval ones in the fit loop's),
    with ``(index in lr_scheduler_configs, scheduler, index of its optimizer or None)`` for each plateau
    scheduler config. Nothing is wrapped where the fit has none. ``update_lr_schedulers`` is wrapped on the
    epoch loop instance and removes itself at the first call of a later batch (at its step update already
    where no plateau scheduler is stepped per epoch), or a later fit. Returns a function removing it (``None``:
    nothing wrapped) for a fit that ends before that call (an exception, ``max_steps`` mid-epoch)."""
    configs = trainer.lr_scheduler_configs
    loop = trainer.fit_loop.epoch_loop
    if not any(config.reduce_on_plateau for config in configs):
        return None
    held = {id(optimizer): index for index, optimizer in enumerate(trainer.optimizers)}
    plateaus = [
        (index, c.scheduler, held.get(id(c.scheduler.optimizer)))
        for index, c in enumerate(configs)
        if c.reduce_on_plateau
    ]
    per_epoch = any(config.reduce_on_plateau and config.interval == "epoch" for config in configs)
    batch = loop.batch_progress.total.processed  # this batch's; a later batch's is higher

    def wrap(original: Callable[..., Any], state: dict[str, bool]) -> Callable[..., Any]:
        def update_lr_schedulers(interval: str, update_plateau_schedulers: bool) -> None:
            original(interval, update_plateau_schedulers=update_plateau_schedulers)
            this_batch = state["active"] and loop.batch_progress.total.processed == batch
            # the batch's last plateau update: its step one, or the epoch's where a plateau steps per epoch
            last_update = update_plateau_schedulers and (interval == "epoch" or not per_epoch)
            if not this_batch or last_update:
                remove()
            if this_batch and update_plateau_schedulers:
                hook(plateaus)

        return update_lr_schedulers

    remove = _wrap_on_instance(loop, "update_lr_schedulers", wrap)
    return remove


def _monitors(trainer: pl.Trainer) -> dict[str, list[str]]:
    """The training keys the fit's monitors read (:func:`training_key_monitors`), each with its monitors."""
    found: dict[str, list[str]] = {}
    for monitor, key in training_key_monitors(trainer):
        found.setdefault(key, []).append(monitor)
    return found


def _read_by(meta: Any, monitors: Mapping[str, list[str]]) -> list[str]:
    """The monitored keys among a logged value's epoch names (``name``, and ``name_epoch`` with ``on_step``)."""
    return [key for key in dict.fromkeys((meta.name, meta.forked_name(False))) if key in monitors]


def _holds_nan(metric: Any) -> bool:
    """Whether a torchmetrics metric's floating-point states hold a NaN (one host read)."""
    states = (getattr(metric, name, None) for name in getattr(metric, "_defaults", {}))
    tensors = [
        t
        for state in states
        for t in (state if isinstance(state, list) else [state])
        if isinstance(t, torch.Tensor) and t.is_floating_point()
    ]
    return bool(torch.stack([t.isnan().any() for t in tensors]).any()) if tensors else False


def _monitor_note(metas: list[Any], monitors: Mapping[str, list[str]]) -> str:
    read = [monitor for meta in metas for key in _read_by(meta, monitors) for monitor in monitors[key]]
    return f" Read by {', '.join(read)}." if read else ""


def _emptied_message(metas: list[Any], monitors: Mapping[str, list[str]], epoch: int) -> str:
    names = ", ".join(f"`{meta.name}`" for meta in metas)
    return (
        f"StabilityGuard: every step that logged {names} (`on_epoch=True`) in training epoch {epoch} was "
        "skipped, so it has no figure for that epoch: a skipped step's logged values are left out of the "
        "epoch's figures, and no applied step logged it. A monitor on it reads the last value published for "
        "it: an earlier epoch's figure, or (for the name without `_epoch`, logged `on_step=True` too) the step "
        "value of the last step that logged it, here a skipped one, maybe NaN; where none was, Lightning says "
        f"the key is missing.{_monitor_note(metas, monitors)} Said once a fit."
    )


def _nan_metric_message(metas: list[Any], monitors: Mapping[str, list[str]], epoch: int, skipped: int) -> str:
    names = ", ".join(f"`{meta.name}`" for meta in metas)
    return (
        f"StabilityGuard: the torchmetrics object(s) logged as {names} hold a NaN at the end of training epoch "
        f"{epoch}, in which {skipped} step(s) were skipped: a metric's states are the module's, and the guard "
        "takes a skipped step's logged values out of the epoch's figures, not the updates its "
        "`training_step` made to a metric. Its epoch figure is likely NaN, which a monitor takes for a bad "
        "epoch (`EarlyStopping` stops). Let the metric leave NaN out (`MeanMetric(nan_strategy='ignore')`), "
        f"or update it only with finite values.{_monitor_note(metas, monitors)} Said once a fit."
    )


def _last_step_message(monitors: Mapping[str, list[str]], epoch: int) -> str:
    names = ", ".join(f"`{key}`" for key in monitors)
    read = ", ".join(monitor for found in monitors.values() for monitor in found)
    return (
        f"StabilityGuard: the last step of training epoch {epoch} was skipped, and {read} read {names} at the "
        "epoch's end: a step value (logged `on_step`), the skipped step's own (NaN, or the spike). A "
        "ReduceLROnPlateau stepped per epoch counts it as a bad epoch, EarlyStopping stops on a NaN, "
        "ModelCheckpoint ranks it. Monitor an epoch figure instead (log with `on_epoch=True` and monitor "
        "`<name>_epoch`, or `<name>` logged `on_step=False`: skipped steps are left out of it) or a validation "
        "metric. A plateau scheduler stepped per step never reads a skipped step's value. Said once a fit."
    )


def _logged_result_problems() -> list[str]:
    """What :class:`SkippedStepLogs` relies on in Lightning's ``_ResultMetric``: its attributes, and an update
    that rebinds ``value`` and ``cumulated_batch_size`` (a reference held before it keeps the figure)."""
    from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultCollection

    results = _ResultCollection(training=True)
    results.log("training_step", "loss", torch.tensor(1.0), on_step=True, on_epoch=True, batch_size=2)
    result = next(iter(results.values()))
    names = ("value", "cumulated_batch_size", "has_reset", "_forward_cache", "_update_count", "_computed")
    problems = [f"_ResultMetric.{name}" for name in (*names, "is_tensor", "meta") if name not in vars(result)]
    if problems:
        return problems
    value, batch_size = result.value, result.cumulated_batch_size
    results.log("training_step", "loss", torch.tensor(3.0), on_step=True, on_epoch=True, batch_size=2)
    if result.value is value or result.cumulated_batch_size is batch_size or float(value) != 2.0:
        problems.append("_ResultMetric.update rebinding value and cumulated_batch_size")
    return problems


def private_api_problems() -> list[str]:
    """Names of the private attributes this module relies on that the installed versions no longer have."""
    from torchmetrics.aggregation import MeanMetric

    metric_attributes = vars(MeanMetric())
    problems = [
        f"torchmetrics.Metric.{name}"
        for name in ("_defaults", "_update_count", "_computed", "_forward_cache")
        if name not in metric_attributes
    ]
    if not callable(getattr(torch.Tensor, "_use_count", None)):
        problems.append("torch.Tensor._use_count")
    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

    if "update_lr_schedulers" not in _TrainingEpochLoop.on_advance_end.__code__.co_names:
        problems.append("_TrainingEpochLoop.on_advance_end calling update_lr_schedulers (plateau schedulers)")
    if "_batches_that_stepped" not in _TrainingEpochLoop.__init__.__code__.co_names:
        problems.append("_TrainingEpochLoop._batches_that_stepped")
    problems += _logged_result_problems()
    if hasattr(_TrainingEpochLoop, "update_restart_stage"):  # restart stages (Lightning 2.5): read past skips
        from lightning.pytorch.loops import training_epoch_loop

        stages = getattr(training_epoch_loop, "RestartStage", None)
        named = all(
            hasattr(stages, name) for name in ("NONE", "RESTARTED_ON_TRAIN_BATCH_END", "RESTARTED_ON_LAST")
        )
        if not named or "_restart_stage" not in _TrainingEpochLoop.__init__.__code__.co_names:
            problems.append("_TrainingEpochLoop._restart_stage, RestartStage")
    if "_current_fx_name" not in vars(pl.LightningModule()):
        problems.append("LightningModule._current_fx_name")
    if "_scale" not in vars(torch.amp.GradScaler("cpu")):
        problems.append("torch.amp.GradScaler._scale")
    from lightning.fabric.utilities import distributed as fabric_distributed

    if not callable(getattr(fabric_distributed, "_destroy_dist_connection", None)):
        problems.append("lightning.fabric.utilities.distributed._destroy_dist_connection")
    from lightning.pytorch.loops import _FitLoop
    from lightning.pytorch.trainer.connectors import data_connector

    if "_combined_loader_states_to_load" not in _FitLoop.__init__.__code__.co_names or (
        "_load_combined_loader_states"
        not in _FitLoop.setup_data.__code__.co_names  # after the DataLoader hook
    ):
        problems.append("_FitLoop._combined_loader_states_to_load, loaded in setup_data")
    if not isinstance(getattr(_FitLoop, "_can_stop_early", None), property):
        problems.append("_FitLoop._can_stop_early")
    for name in (
        "_should_check_val_fx",
        "_num_ready_batches_reached",
    ):  # SuspendSave's stop, after the module's
        if not callable(getattr(_TrainingEpochLoop, name, None)):
            problems.append(f"_TrainingEpochLoop.{name}")
    if not callable(getattr(data_connector, "_parse_num_batches", None)):
        problems.append("lightning.pytorch.trainer.connectors.data_connector._parse_num_batches")
    from lightning.pytorch.loops import utilities as loop_utilities
    from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

    if not callable(getattr(loop_utilities, "_is_max_limit_reached", None)):  # fit_ends_after_this_step
        problems.append("lightning.pytorch.loops.utilities._is_max_limit_reached")
    if not callable(getattr(_CheckpointConnector, "dump_checkpoint", None)):  # GreenWindow's suspend
        problems.append("_CheckpointConnector.dump_checkpoint")
    problems += _tuner_checkpoint_problems()
    if "_model_contains_batch_norm" not in vars(StochasticWeightAveraging(swa_lrs=0.1)):
        problems.append("StochasticWeightAveraging._model_contains_batch_norm")
    if "_average_model" not in vars(StochasticWeightAveraging(swa_lrs=0.1)):
        problems.append("StochasticWeightAveraging._average_model")
    from lightning.pytorch.strategies import DDPStrategy
    from torch.nn.parallel import DistributedDataParallel

    if "_ddp_comm_state" not in vars(DDPStrategy()):  # the communication hooks' state (comm_hook_states)
        problems.append("DDPStrategy._ddp_comm_state")
    if "_comm_hooks" not in DistributedDataParallel.__init__.__code__.co_names:
        problems.append("DistributedDataParallel._comm_hooks")
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.trainer.connectors.logger_connector.result import _Metadata

    checkpoint_attributes = vars(ModelCheckpoint(every_n_train_steps=1))
    problems += [
        f"ModelCheckpoint.{name}"
        for name in ("_every_n_train_steps", "_train_time_interval")
        if name not in checkpoint_attributes
    ]
    if "_results" not in _TrainingEpochLoop.__init__.__code__.co_names or not callable(
        getattr(_Metadata, "forked_name", None)
    ):
        problems.append("_TrainingEpochLoop._results (its results' meta.forked_name)")
    try:  # Lightning >= 2.5
        from lightning.pytorch.callbacks import EMAWeightAveraging
    except ImportError:
        return problems
    averaging_attributes = vars(EMAWeightAveraging())
    problems += [
        f"WeightAveraging.{name}"
        for name in ("_average_model", "_latest_update_step", "_latest_update_epoch", "_use_buffers")
        if name not in averaging_attributes
    ]
    return problems


_AVERAGING_COUNTERS = ("_latest_update_step", "_latest_update_epoch", "n_averaged")


class AveragedWeights:
    """What a StabilityGuard snapshot keeps of a weight-averaging callback: its average model's ``state_dict``
    and the counters of its updates, so a rollback returns the average with the model.

    Lightning's ``WeightAveraging`` (``EMAWeightAveraging``) folds the weights in at the end of each batch,
    and ``StochasticWeightAveraging`` at the end of an epoch. Its own ``state_dict`` holds the counters only
    (the average goes into checkpoints by ``on_save_checkpoint``), so a rollback of the model alone leaves in
    the average the weights of the undone steps, and, for a callback whose batch-end hook ran before the
    guard's, the non-finite weights of the step that triggered it: copied into the model at train end. Both
    keep the average in the private ``_average_model`` (a module, or ``None`` until made) and count updates
    in ``_latest_update_step`` / ``_latest_update_epoch`` (``n_averaged`` for SWA); restored in place.
    """

    def __init__(self, callback: Any) -> None:
        self.callback = callback

    def state_dict(self) -> dict[str, Any]:
        average = self.callback._average_model
        counters = {
            name: getattr(self.callback, name) for name in _AVERAGING_COUNTERS if hasattr(self.callback, name)
        }
        return {"average": None if average is None else average.state_dict(), "counters": counters}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        average = self.callback._average_model
        if average is not None and state_dict["average"] is not None:
            average.load_state_dict(state_dict["average"])
        for name, value in state_dict["counters"].items():
            current = getattr(self.callback, name, None)
            if isinstance(current, torch.Tensor):
                # SWA's ``n_averaged``: written in place, on its device. ``None`` (nothing averaged yet when the
                # snapshot was taken) becomes 0 once SWA has begun, which asserts it is not ``None`` at every
                # epoch start; a count of 0 makes its next average a copy of the weights (a review's crash)
                current.fill_(0 if value is None else int(value))
                continue
            setattr(self.callback, name, value)


def averaged_weights(callbacks: list[Any]) -> dict[str, AveragedWeights]:
    """The weight-averaging callbacks among ``callbacks`` (:class:`AveragedWeights`), keyed by their index."""
    return {
        f"{index}:averaged_weights": AveragedWeights(callback)
        for index, callback in enumerate(callbacks)
        if hasattr(callback, "_average_model")
        and (callback._average_model is None or isinstance(callback._average_model, torch.nn.Module))
    }


def averages_buffers(callback: Any) -> bool:
    """Whether a Lightning ``WeightAveraging`` (``EMAWeightAveraging``) averages the buffers too (its
    ``use_buffers``, kept in the private ``_use_buffers``; ``True``, the default, where it is not found)."""
    return bool(getattr(callback, "_use_buffers", True))


class CollectiveHold:
    """Tensors a callback handed to a collective, kept referenced until the backend's threads let go of them.

    A tensor handed to a collective is held by the backend's own thread (gloo's worker, NCCL's watchdog) for a
    while after the collective returned. Whoever drops the last reference frees its Python object, which needs
    the GIL; if that is the backend's thread while the rank exits, Python ends the thread waiting for the GIL
    with ``pthread_exit``, whose forced unwinding through C++ destructors calls ``std::terminate``: the rank
    aborts with "terminate called without an active exception" (SIGABRT) after a finished fit. So a callback
    :meth:`keep` s what it hands to collectives and :meth:`wait` s at teardown.
    """

    timeout_s = 10.0

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []

    def keep(self, *tensors: torch.Tensor) -> None:
        destroy_process_group_at_exit()
        self.tensors = [t for t in self.tensors if not backend_released(t)]
        for tensor in tensors:
            if not any(tensor is held for held in self.tensors):
                self.tensors.append(tensor)

    def wait(self) -> list[torch.Tensor]:
        """Yield the CPU until the backend has let go of every kept tensor (at most ``timeout_s``); returns
        and keeps those still held."""
        deadline = time.monotonic() + self.timeout_s
        held = [t for t in self.tensors if not backend_released(t)]
        while held and time.monotonic() < deadline:
            time.sleep(0)  # a thread yield, so a descheduled worker gets the core; not a timed wait
            held = [t for t in held if not backend_released(t)]
        self.tensors = held
        return held


_DESTROY_REGISTERED = False
# a worker releasing a step needs the GIL for a moment; this bounds the exit's delay where the group is kept
_EXIT_WAIT_S = 2.0


def destroy_process_group_at_exit() -> None:
    """Destroy the default process group in an ``atexit`` handler, while Python is still whole, its backend's
    threads joined on the exiting thread.

    Lightning registers the destruction for NCCL only; a gloo group is otherwise torn down during interpreter
    finalization, when a backend thread that still has to give a tensor back to Python can only end with
    ``std::terminate`` (see :class:`CollectiveHold`). Destroying it is not enough where a gloo worker is still
    releasing a step's collective: a communication hook's Python callbacks (PowerSGD's ``then`` chain) hold the
    group, so it outlived the handler and the worker, resumed during finalization, aborted the rank; or the
    worker dropped the group's last reference itself and its destruction joined that very thread
    ("Resource deadlock avoided"). The handler therefore holds the group and yields the GIL until no one else
    does (at most ``_EXIT_WAIT_S``), then drops it here. Registered once per process, on the first use.
    """
    global _DESTROY_REGISTERED
    if _DESTROY_REGISTERED or not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return
    import atexit

    atexit.register(_destroy_process_group_and_wait)
    _DESTROY_REGISTERED = True


def _destroy_process_group_and_wait() -> None:
    import sys

    from lightning.fabric.utilities.distributed import _destroy_dist_connection

    group = torch.distributed.group.WORLD if torch.distributed.is_initialized() else None
    _destroy_dist_connection()
    deadline = time.monotonic() + _EXIT_WAIT_S
    # 2: ``group`` and getrefcount's argument; a sleep, not a timed wait: it releases the GIL to the worker
    while group is not None and sys.getrefcount(group) > 2 and time.monotonic() < deadline:
        time.sleep(0.001)
    del group  # the last reference, mostly: the group's destruction joins gloo's workers on this thread


def reduce_held(strategy: Any, tensor: torch.Tensor, reduce_op: str, hold: CollectiveHold) -> torch.Tensor:
    """``strategy.reduce(tensor, reduce_op)``, keeping both tensors in ``hold`` (see :class:`CollectiveHold`)."""
    reduced = strategy.reduce(tensor, reduce_op=reduce_op)
    hold.keep(tensor, reduced)
    return reduced


def rank_zero_number(trainer: pl.Trainer, device: torch.device, value: float, hold: CollectiveHold) -> float:
    """Rank 0's ``value`` on every rank: a sum all-reduce of a tensor kept in ``hold`` until the backend lets
    go of it, not an object broadcast whose tensors nobody here can keep."""
    mine = torch.tensor([value if trainer.global_rank == 0 else 0.0], dtype=torch.float64)
    return float(reduce_held(trainer.strategy, mine.to(device), "sum", hold)[0])


def all_gather_held(strategy: Any, tensor: torch.Tensor, hold: CollectiveHold) -> torch.Tensor:
    """``tensor`` from every rank, stacked to ``(world_size, *tensor.shape)``, keeping the input and every
    output buffer in ``hold``. Lightning's ``strategy.all_gather`` goes through the autograd all-gather, whose
    output buffers are dropped inside torch while gloo's worker may still hold them (see
    :class:`CollectiveHold`); this one owns them. One process: ``tensor[None]``."""
    if strategy.world_size <= 1 or not torch.distributed.is_initialized():
        return tensor[None]
    tensor = tensor.to(strategy.root_device).contiguous()
    outputs = [torch.empty_like(tensor) for _ in range(strategy.world_size)]
    torch.distributed.all_gather(outputs, tensor)
    hold.keep(tensor, *outputs)
    return torch.stack(outputs)


def all_gather_of(trainer: pl.Trainer, hold: CollectiveHold) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """Under DDP, :func:`all_gather_held` on ``trainer``'s strategy (``tensor -> (world_size, *shape)``);
    ``None`` in a single process."""
    if trainer.world_size <= 1:
        return None
    strategy = trainer.strategy
    return lambda tensor: all_gather_held(strategy, tensor, hold)


def broadcast_held(strategy: Any, value: Any, hold: CollectiveHold) -> Any:
    """``strategy.broadcast(value, src=0)`` for a picklable object, with the exit-time process-group teardown
    registered (see :func:`destroy_process_group_at_exit`); the pickled buffers are torch's own, so ``hold``
    only learns that a collective ran."""
    hold.keep()
    return strategy.broadcast(value, src=0)


def all_gather_objects(trainer: pl.Trainer, value: Any) -> list[Any]:
    """``value`` (picklable) of every rank, in rank order; ``[value]`` in one process. The pickled buffers are
    torch's own, so only the exit-time process-group teardown is registered (see :func:`broadcast_held`)."""
    if trainer.world_size <= 1 or not torch.distributed.is_initialized():
        return [value]
    destroy_process_group_at_exit()
    gathered: list[Any] = [None] * trainer.world_size
    torch.distributed.all_gather_object(gathered, value)
    return gathered


def from_rank_zero(trainer: pl.Trainer) -> Callable[[list[Any]], list[Any]] | None:
    """Under DDP, a function that gives every process rank 0's list; ``None`` in a single process."""
    if trainer.world_size == 1:
        return None
    strategy, hold = trainer.strategy, CollectiveHold()
    return lambda values: list(broadcast_held(strategy, values, hold))


def refuse_uneven_epochs(
    trainer: pl.Trainer,
    callback: str,
    why: str,
    hold: CollectiveHold,
    other_way_out: str | None = None,
    only_if_an_epoch_ends: bool = False,
) -> None:
    """Raise :class:`~lightning_pulse.errors.PulseRefusal` at fit start, on every rank alike, when the ranks'
    training epochs hold different numbers of batches (``use_distributed_sampler=False`` with each rank's own
    shard): a rank then ends its epoch while another is still training, so a collective ``callback`` runs at
    an epoch boundary (``why``) meets another rank's per-step one and hangs. One all-gather of each rank's
    ``num_training_batches``; ranks whose loaders all have no length are not checked. ``other_way_out``
    is said after Lightning's. ``only_if_an_epoch_ends``: a run that ends before any rank can end an epoch
    (:func:`_may_end_an_epoch`) is not refused (the epoch-end hooks of a run stopped by ``max_steps`` come
    on every rank at the same step); decided after the gather, so every rank alike."""
    if trainer.world_size <= 1 or not torch.distributed.is_initialized():
        return
    batches = trainer.num_training_batches
    mine = torch.tensor([batches if math.isfinite(batches) else -1], dtype=torch.int64)
    counts = [int(count) for count in all_gather_held(trainer.strategy, mine, hold).flatten().tolist()]
    if len(set(counts)) > 1 and not (only_if_an_epoch_ends and not _may_end_an_epoch(trainer, min(counts))):
        per_rank = [f"rank {rank}: {'no length' if n < 0 else n}" for rank, n in enumerate(counts)]
        also = "" if other_way_out is None else f", or {other_way_out}"
        raise PulseRefusal(
            f"{callback}: the ranks' training epochs hold different numbers of batches "
            f"({first_names(per_rank, 4)}), and {why}. Keep Lightning's use_distributed_sampler=True (the "
            "default), or give every rank as many batches (shards of equal length, or an int "
            f"limit_train_batches that every rank's shard reaches){also}."
        )


def _may_end_an_epoch(trainer: pl.Trainer, shortest: int) -> bool:
    """Whether a rank whose training epoch holds ``shortest`` batches (``-1``: no length) may reach its end
    before the run does: the run's batches from here are bounded only by ``max_steps`` at a known number of
    batches a step (automatic optimization, no ``GradientAccumulationScheduler``); a resumed fit counts the
    batches its epoch has already trained."""
    if shortest < 0 or trainer.max_steps < 0 or accumulation_schedule(trainer) is not None:
        return True
    if trainer.lightning_module is None or not trainer.lightning_module.automatic_optimization:
        return True  # a module stepping its optimizers itself may take several batches a step
    trained = trainer.fit_loop.epoch_loop.batch_progress.current.ready
    left = (trainer.max_steps - trainer.global_step) * trainer.accumulate_grad_batches
    return trained + left >= shortest


def backend_released(tensor: torch.Tensor) -> bool:
    """Whether only Python still holds ``tensor``: no collective's backend thread (gloo's worker, NCCL's
    watchdog) keeps a reference to it. Reads torch's private reference count of the tensor's storage owner."""
    return tensor._use_count() <= 1


# ---------------------------------------------------------------------------- GreenWindow's deferred save
def append_callback_for_fit(trainer: pl.Trainer, callback: Any) -> None:
    """Append ``callback`` to ``trainer.callbacks`` (once), from a ``setup`` hook of the fit.

    Relies on Lightning's hook calls iterating ``trainer.callbacks`` itself, in order, at every hook (not a
    copy taken earlier), and on its checkpoint callbacks having been moved to the end before ``setup``: the
    callback then runs last in every later hook of the fit, after a ModelCheckpoint too.
    """
    if not any(c is callback for c in trainer.callbacks):
        trainer.callbacks.append(callback)


def remove_callback(trainer: pl.Trainer, callback: Any) -> None:
    """Take ``callback`` out of ``trainer.callbacks`` again (teardown, or an exception ending the fit)."""
    trainer.callbacks[:] = [c for c in trainer.callbacks if c is not callback]


# ---------------------------------------------------------------------------- ScheduledPrune (issue 6)
def loaded_checkpoint(trainer: pl.Trainer) -> dict[str, Any] | None:
    """The checkpoint dict Lightning is restoring from right now, or ``None``.

    Lightning loads the whole checkpoint before restoring the module's weights but only hands callbacks their
    state afterwards; a module whose shapes depend on a callback's state (structured pruning) needs it before.
    """
    connector = getattr(trainer, "_checkpoint_connector", None)
    return getattr(connector, "_loaded_checkpoint", None) or None


#: how Lightning's finders name the checkpoint they save before their trials (tuner/batch_size_scaling.py,
#: tuner/lr_finder.py) and restore after them, in ``default_root_dir``
_TUNER_CHECKPOINT_PREFIXES = (".scale_batch_size_", ".lr_find_")


def _tuner_checkpoint_problems() -> list[str]:
    """What :func:`restoring_tuner_checkpoint` relies on that the installed Lightning no longer has: the
    finders' checkpoint names (a rename would turn the refusal of a reused instance off without an error)."""
    import inspect

    from lightning.pytorch.tuner import batch_size_scaling, lr_finder

    problems = []
    for module, prefix in zip((batch_size_scaling, lr_finder), _TUNER_CHECKPOINT_PREFIXES):
        if f'"{prefix}' not in inspect.getsource(module) and f"'{prefix}" not in inspect.getsource(module):
            problems.append(f"{module.__name__} naming its checkpoint {prefix}<uuid>.ckpt")
    return problems


def restoring_tuner_checkpoint(trainer: pl.Trainer) -> bool:
    """Whether Lightning is restoring, right now, the checkpoint a batch-size or learning-rate search
    (``BatchSizeFinder``/``LearningRateFinder``, as callbacks or through ``Tuner``) saved before its trials: the
    state from before the trials, put back inside the fit's ``on_fit_start`` (no resume of a saved run)."""
    connector = getattr(trainer, "_checkpoint_connector", None)
    path = getattr(connector, "_ckpt_path", None)
    if not getattr(connector, "_loaded_checkpoint", None) or not isinstance(path, (str, os.PathLike)):
        return False  # nothing being restored (a rollback by hand, a load outside the connector)
    return os.path.basename(os.fspath(path)).startswith(_TUNER_CHECKPOINT_PREFIXES)


def spawns_worker_processes(trainer: pl.Trainer) -> bool:
    """Whether fit runs in spawned/forked workers whose final weights are copied back into the main process."""
    from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher

    return isinstance(getattr(trainer.strategy, "launcher", None), _MultiProcessingLauncher)


def rewrap_ddp(trainer: pl.Trainer) -> bool:
    """Wrap the LightningModule in a fresh ``DistributedDataParallel`` after its parameters were replaced.

    DDP's reducer holds the parameters it was built with; after a structural change it must be rebuilt, as
    ``DDPStrategy.configure_ddp`` builds it. The reducer registers only the parameters that require grad while
    it is built, and never averages the gradients of the others: those a
    :class:`~lightning_pulse.protocols.TemporaryFreezer` holds frozen for now (GradientCache's frozen prefix)
    are turned on while it is built, then off again, so that the ranks still average them once they are
    released. Parameters frozen otherwise (the user's) stay out, as at Lightning's own wrap. Call it after the
    :class:`~lightning_pulse.protocols.ParametersReplacedListener` callbacks followed the change: the freezers
    name the parameters they hold now. Returns whether the module was re-wrapped.

    The communication hook goes on the new wrapper too: Lightning's ``ddp_comm_hook`` as Lightning registers
    it, or else the one the user registered on the old wrapper (``strategy.model.register_comm_hook``; it was
    dropped silently). Its state's per-bucket memories, sized for the old buckets, are dropped first
    (PowerSGD's error feedback crashed the backward after the first cut: :func:`forget_comm_hook_memory`).
    """
    from lightning.pytorch.strategies import DDPStrategy
    from torch.nn.parallel import DistributedDataParallel

    strategy = trainer.strategy
    if not isinstance(strategy, DDPStrategy) or not isinstance(strategy.model, DistributedDataParallel):
        return False
    module, hooks = strategy.lightning_module, list(getattr(strategy.model, "_comm_hooks", None) or ())
    # the hook's last step may still be released by gloo's threads at exit: the group goes, and they end,
    # while Python is whole (a PowerSGD run with no probe, so no held collective to register it, aborted at
    # exit under load)
    destroy_process_group_at_exit()
    forget_comm_hook_memory(trainer, new_buckets=True)  # sized and keyed for the old wrapper's buckets
    with trainable_while(module, temporarily_frozen(trainer, module)):
        strategy.model = strategy._setup_model(module)
    strategy._register_ddp_hooks()  # Lightning's ``ddp_comm_hook`` (on CUDA only)
    if not getattr(strategy.model, "_comm_hooks", None):  # one registered on the wrapper itself: again
        for hook, state in hooks:
            strategy.model.register_comm_hook(state, hook)
    return True


def comm_hook_states(trainer: pl.Trainer) -> list[Any]:
    """The states of the fit's DDP communication hooks: ``DDPStrategy(ddp_comm_state=...)``, which Lightning
    registers on CUDA only, and those of hooks registered on the ``DistributedDataParallel`` wrapper itself
    (``trainer.strategy.model.register_comm_hook``), which torch keeps in ``_comm_hooks``. Empty elsewhere."""
    from torch.nn.parallel import DistributedDataParallel

    strategy, states = trainer.strategy, []
    if isinstance(strategy.model, DistributedDataParallel):
        states = [state for _, state in getattr(strategy.model, "_comm_hooks", None) or ()]
    if (own := getattr(strategy, "_ddp_comm_state", None)) is not None:
        states.append(own)
    return list({id(state): state for state in states if state is not None}.values())


def forget_comm_hook_memory(trainer: pl.Trainer, new_buckets: bool = False) -> None:
    """Drop what the fit's communication hooks remember of earlier steps (PowerSGD's error feedback and
    warm-start factors, :func:`~lightning_pulse.core.comm_hook_memory.forget_compression_memory`): after a
    step that was skipped or rolled back, and when the wrapper is rebuilt (``new_buckets``). Call it on every
    rank at the same step: PowerSGD draws its new factors from a generator the ranks keep in step."""
    for state in comm_hook_states(trainer):
        forget_compression_memory(state, new_buckets)


# ---------------------------------------------------------------------------- HardSampleReplay (issue 4)
def on_train_dataloader_ready(trainer: pl.Trainer, hook: Callable[[Any], None]) -> Callable[[], None]:
    """Call ``hook(dataloader)`` for every training DataLoader this trainer prepares, once Lightning has put
    its distributed sampler in and before the loader is first iterated. Returns a function removing the hook.

    Lightning creates the first epoch's iterator before any callback hook after ``setup`` runs, so a sampler
    wrapper installed in ``on_train_start`` would miss that epoch. ``Strategy.process_dataloader`` is the
    public per-loader step inside that window; it is wrapped on this trainer's strategy instance only.

    The hook changes the DataLoader it is given (an index-recording sampler, a planned batch sampler). Where
    the fit's validation may iterate that very object (:func:`shares_validation_loader`), the hook gets, and
    Lightning trains on, :func:`training_copy` of it instead, so that validation iterates the user's DataLoader
    as built (the same copy again at a reload of the same object: persistent workers are kept).
    """
    from lightning.pytorch.trainer.states import RunningStage

    # the user's loader and its copy, the latest only: a reload of the same object gets the same copy; keyed
    # by identity, not hash (a DataLoader subclass defining __eq__, a dataclass, cannot be hashed)
    latest: list[Any] = [None, None]

    def wrap(original: Callable[..., Any], state: dict[str, bool]) -> Callable[..., Any]:
        def process_dataloader(dataloader: object) -> object:
            dataloader = original(dataloader)
            if state["active"] and trainer.state.stage == RunningStage.TRAINING:
                if shares_validation_loader(trainer, dataloader):
                    if latest[0] is not dataloader:
                        latest[:] = [dataloader, training_copy(dataloader)]
                    dataloader = latest[1]
                hook(dataloader)
            return dataloader

        return process_dataloader

    return _wrap_on_instance(trainer.strategy, "process_dataloader", wrap)


def shares_validation_loader(trainer: pl.Trainer, loader: Any) -> bool:
    """Whether the fit's validation may iterate the training DataLoader ``loader`` itself (by identity:
    ``fit(model, loader, loader)``, or a ``val_dataloader`` hook returning the train loader). The validation
    DataLoaders are Lightning's once its validation loop built them (the sanity check); before that, the ones
    given to ``fit``; ones a hook of the module or datamodule will build are not known (the hook is not called
    here: Lightning calls it once, and it may be costly), and may be ``loader``: ``True``."""
    from lightning.pytorch.utilities import CombinedLoader
    from torch.utils.data import DataLoader

    if not isinstance(loader, DataLoader) or not trainer.enable_validation:
        return False
    source = getattr(trainer.fit_loop.epoch_loop.val_loop._data_source, "instance", None)
    from_hook = source is None or isinstance(source, (pl.LightningModule, pl.LightningDataModule))
    if from_hook and trainer.reload_dataloaders_every_n_epochs:  # the hook builds them again: unknown
        return True
    loaders = trainer.val_dataloaders
    if loaders is None:
        if from_hook:
            return True
        loaders = source
    flattened = (
        loaders.flattened if isinstance(loaders, CombinedLoader) else CombinedLoader(loaders).flattened
    )
    return any(candidate is loader for candidate in flattened)


class UsersBatchSizes(torch.utils.data.BatchSampler):
    """The copy of a user's plain ``BatchSampler`` that :func:`training_copy` makes: its ``sampler`` is its own
    (an index recorder goes there), its ``batch_size`` and ``drop_last`` are the user's (``users_batches``),
    read at every use and written there, so that a change made to either object (a batch-size curriculum on
    the user's DataLoader or on ``trainer.train_dataloader``) reaches training as it would without the copy.
    A class of its own, by name: it pickles, and Lightning's re-instantiation of a loader
    (``UsersBatchSizes(sampler, batch_size=..., drop_last=...)``) builds one that keeps its own sizes."""

    def _size(self, name: str) -> Any:
        users = self.__dict__.get("users_batches")
        return self.__dict__[f"_own_{name}"] if users is None else getattr(users, name)

    def _set_size(self, name: str, value: Any) -> None:
        users = self.__dict__.get("users_batches")
        if users is None:
            self.__dict__[f"_own_{name}"] = value
        else:
            setattr(users, name, value)

    batch_size = property(
        lambda self: self._size("batch_size"), lambda self, v: self._set_size("batch_size", v)
    )
    drop_last = property(lambda self: self._size("drop_last"), lambda self, v: self._set_size("drop_last", v))


def _batches_of_its_own(batches: Any) -> Any:
    """A copy of the ``BatchSampler`` ``batches`` with its own ``sampler`` and ``batches``' sizes
    (:class:`UsersBatchSizes`) where ``batches`` is a plain ``BatchSampler``; a plain copy of a subclass (its
    sizes are its own from then on: a curriculum on the user's object does not reach it)."""
    if type(batches) is not torch.utils.data.BatchSampler:
        return copy.copy(batches)
    copied = UsersBatchSizes.__new__(UsersBatchSizes)
    copied.__dict__.update((k, v) for k, v in vars(batches).items() if k not in ("batch_size", "drop_last"))
    copied.__dict__["users_batches"] = batches
    return copied


def training_copy(loader: Any) -> Any:
    """A shallow copy of the DataLoader ``loader`` for training to iterate: the same dataset, index sampler,
    collate function and worker settings, with a batch sampler of its own (a copy of a ``BatchSampler``, so
    that an index recorder or a planned batch sampler put into the copy leaves ``loader``'s alone, whose
    ``batch_size`` and ``drop_last`` stay ``loader``'s: :class:`UsersBatchSizes`; a custom one is shared, it is
    never changed) and no iterator yet (with persistent workers, it starts workers of its own, as a second
    DataLoader would; ``loader``'s stay with it)."""
    from torch.utils.data import BatchSampler

    copied = copy.copy(loader)
    batches = loader.batch_sampler
    if isinstance(batches, BatchSampler) and type(batches).__iter__ is BatchSampler.__iter__:
        # DataLoader.__setattr__ forbids setting it
        object.__setattr__(copied, "batch_sampler", _batches_of_its_own(batches))
    object.__setattr__(copied, "_iterator", None)
    return copied


def on_train_dataloaders_built(trainer: pl.Trainer, hook: Callable[[list[Any]], None]) -> Callable[[], None]:
    """Call ``hook(loaders)`` with the training iterables the fit's data set-up requests (a
    ``train_dataloader`` hook of the module or datamodule builds them; given to ``fit``,
    :func:`train_dataloaders_given` has them from ``setup`` on), flattened as that function flattens them,
    right after they are requested and before any of them is set up (:func:`on_train_dataloader_ready`, which
    sees them one by one). ``_DataLoaderSource.dataloader`` of the fit loop is wrapped on that instance only.
    Returns a function removing the hook."""
    from lightning.pytorch.utilities import CombinedLoader

    def wrap(original: Callable[..., Any], state: dict[str, bool]) -> Callable[..., Any]:
        def dataloader() -> Any:
            loaders = original()
            if state["active"]:
                combined = loaders if isinstance(loaders, CombinedLoader) else CombinedLoader(loaders)
                hook(combined.flattened)
            return loaders

        return dataloader

    return _wrap_on_instance(trainer.fit_loop._data_source, "dataloader", wrap)


def train_dataloaders_given(trainer: pl.Trainer) -> list[Any] | None:
    """The training iterables given to ``fit``, in the order Lightning's data set-up hands them over (it
    flattens them with a ``CombinedLoader``), known from ``setup`` on; ``None`` where a ``train_dataloader``
    hook of the module or datamodule builds them at the data set-up (not called here: Lightning calls it
    once, and it may be costly)."""
    from lightning.pytorch.utilities import CombinedLoader

    instance = getattr(getattr(trainer.fit_loop, "_data_source", None), "instance", None)
    if instance is None or isinstance(instance, (pl.LightningModule, pl.LightningDataModule)):
        return None
    return (instance if isinstance(instance, CombinedLoader) else CombinedLoader(instance)).flattened


def on_training_step_output(trainer: pl.Trainer, hook: Callable[[Any], None]) -> Callable[[], None]:
    """Call ``hook(output)`` with what ``training_step`` returned, right after it returns: under automatic
    optimization before the step's backward and update (no callback hook sees the output before the batch
    end, after the update). ``Strategy.training_step`` is wrapped on this trainer's strategy instance only, as
    :func:`on_train_dataloader_ready` wraps ``process_dataloader``. Returns a function removing the hook."""

    def wrap(original: Callable[..., Any], state: dict[str, bool]) -> Callable[..., Any]:
        def training_step(*args: Any, **kwargs: Any) -> Any:
            output = original(*args, **kwargs)
            if state["active"]:
                hook(output)
            return output

        return training_step

    return _wrap_on_instance(trainer.strategy, "training_step", wrap)


def on_training_step_input(trainer: pl.Trainer, hook: Callable[[Any], None]) -> Callable[[], None]:
    """Call ``hook(batch)`` with the batch ``training_step`` is about to get, right before the call: after
    every ``on_train_batch_start`` (the callbacks' and the module's) and whatever they did to the batch.
    Lightning's loops pass it first (``strategy.training_step(batch, batch_idx)``). Wrapped as
    :func:`on_training_step_output` wraps it; either may be installed first and removed in any order.
    Returns a function removing the hook."""

    def wrap(original: Callable[..., Any], state: dict[str, bool]) -> Callable[..., Any]:
        def training_step(*args: Any, **kwargs: Any) -> Any:
            if state["active"]:
                hook(args[0] if args else kwargs.get("batch"))
            return original(*args, **kwargs)

        return training_step

    return _wrap_on_instance(trainer.strategy, "training_step", wrap)


def after_train_start(trainer: pl.Trainer, hook: Callable[[Any], None]) -> Callable[[], None]:
    """Call ``hook(trainer)`` once every ``on_train_start`` has run (the callbacks', in their order, and the
    module's), before the first epoch's hooks: Lightning's fit loop calls the strategy's ``on_train_start``
    right after them. Wrapped on this trainer's strategy instance only, as :func:`on_train_dataloader_ready`
    wraps ``process_dataloader``. Returns a function removing the hook."""

    def wrap(original: Callable[..., Any], state: dict[str, bool]) -> Callable[..., Any]:
        def on_train_start(*args: Any, **kwargs: Any) -> Any:
            output = original(*args, **kwargs)
            if state["active"]:
                hook(trainer)
            return output

        return on_train_start

    return _wrap_on_instance(trainer.strategy, "on_train_start", wrap)


def after_exception_hooks(trainer: pl.Trainer, hook: Callable[[Any], None]) -> Callable[[], None]:
    """Call ``hook(trainer)`` once every ``on_exception`` hook has run (the callbacks', checkpoint callbacks
    last, and the datamodule's): Lightning's ``_interrupt`` calls the strategy's ``on_exception`` right after
    them, and no teardown hook follows an exception. Wrapped on this trainer's strategy instance only, as
    :func:`after_train_start` wraps ``on_train_start``. Returns a function removing the hook."""

    def wrap(original: Callable[..., Any], state: dict[str, bool]) -> Callable[..., Any]:
        def on_exception(*args: Any, **kwargs: Any) -> Any:
            output = original(*args, **kwargs)
            if state["active"]:
                hook(trainer)
            return output

        return on_exception

    return _wrap_on_instance(trainer.strategy, "on_exception", wrap)


class _LastBatchEnd(pl.Callback):
    """A stateless callback that calls ``hook(trainer)`` at its ``on_train_batch_end`` while ``active``
    (:func:`after_train_batch_ends`)."""

    def __init__(self, hook: Callable[[Any], None]) -> None:
        self.hook, self.active = hook, True

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        if self.active:
            self.hook(trainer)


def after_train_batch_ends(trainer: pl.Trainer, hook: Callable[[Any], None]) -> Callable[[], None]:
    """Call ``hook(trainer)`` once every callback's ``on_train_batch_end`` of this batch has run (in their
    order, with ``ModelCheckpoint``'s, which Lightning moves last), before the module's own: a stateless
    callback appended to ``trainer.callbacks`` (:func:`append_callback_for_fit`: Lightning's hook calls
    iterate the list itself) runs last in the hook now running, or in the next batch end. Nothing is put on the
    module (a review: a wrapper on the module instance was deep-copied with it, into ScheduledPrune's
    distillation teacher, which could then not be pickled). Returns a function removing it."""
    last = _LastBatchEnd(hook)
    append_callback_for_fit(trainer, last)

    def remove() -> None:
        last.active = False
        remove_callback(trainer, last)

    return remove


def _wrap_on_instance(
    owner: Any, name: str, wrap: Callable[[Callable[..., Any], dict[str, bool]], Callable[..., Any]]
) -> Callable[[], None]:
    """Put ``wrap(original, state)`` in place of ``owner``'s method ``name`` on that instance only; returns a
    function removing it. A wrapper another hook wrapped after it stays in the chain, passing calls through
    (``state["active"]`` is then false: a dict read, not a call, on a per-step path), so hooks may be
    installed and removed in any order."""
    original = getattr(owner, name)
    shadowed = name in vars(owner)  # another hook already wraps it on this instance
    state = {"active": True}
    wrapper = wrap(original, state)
    setattr(owner, name, wrapper)

    def remove() -> None:
        state["active"] = False
        if vars(owner).get(name) is wrapper:
            if shadowed:
                setattr(owner, name, original)
            else:
                delattr(owner, name)

    return remove


class HookWatch:
    """Holds at most one hook installed by ``install(trainer, hook)`` (:func:`on_train_dataloader_ready`,
    :func:`on_training_step_input`, :func:`after_train_start`, :func:`after_train_batch_ends`,
    :func:`after_exception_hooks`): :meth:`watch` replaces the previous one (a previous fit's, which ended
    before it was stopped), :meth:`once` calls its hook the next time only, :meth:`stop` removes it."""

    def __init__(self, install: Callable[[pl.Trainer, Callable[[Any], None]], Callable[[], None]]) -> None:
        self._install = install
        self._remove: Callable[[], None] | None = None

    def watch(self, trainer: pl.Trainer, hook: Callable[[Any], None] | None) -> None:
        """Call ``hook`` from now on, as the installer says (``None``: no hook)."""
        self.stop()
        self._remove = None if hook is None else self._install(trainer, hook)

    def once(self, trainer: pl.Trainer, hook: Callable[[Any], None]) -> None:
        """Call ``hook`` the next time only: removed before it runs (nothing stays on a per-step path)."""

        def call_once(argument: Any) -> None:
            self.stop()
            hook(argument)

        self.watch(trainer, call_once)

    def stop(self) -> None:
        if self._remove is not None:
            self._remove()
        self._remove = None


def drop_restored_loader_state(trainer: pl.Trainer, loader: Any) -> bool:
    """Whether Lightning held a checkpoint's state for the training DataLoader ``loader`` (one with
    ``state_dict``/``load_state_dict``, as torchdata's ``StatefulDataLoader``), which it would load into it
    before the resumed pass so that the loader itself skips the batches drawn before the checkpoint; that
    state is discarded (the pass starts as a plain DataLoader's does). Call it while the fit's data is set up
    (:func:`on_train_dataloader_ready`): ``FitLoop.setup_data`` loads the state right after."""
    from lightning.fabric.utilities.types import _Stateful

    fit_loop = trainer.fit_loop
    states = getattr(fit_loop, "_combined_loader_states_to_load", None)
    if not states or not fit_loop.restarting or not isinstance(loader, _Stateful):
        return False
    fit_loop._combined_loader_states_to_load = []
    return True


def replace_batch_sampler(loader: Any, batch_sampler: Any) -> None:
    """Put ``batch_sampler`` into a DataLoader that is already built (its ``__setattr__`` forbids it; the
    DataLoader reads ``batch_sampler`` again for every iterator, so the next pass uses the new one). A loader
    with persistent workers keeps its iterator between passes, and that iterator read the batch sampler when it
    was built: it is dropped (its workers shut down with it), so the next pass builds one over the new sampler."""
    object.__setattr__(loader, "batch_sampler", batch_sampler)
    if getattr(loader, "_iterator", None) is not None:
        loader._iterator = None


def without_persistent_workers(loader: Any) -> Any:
    """``loader``, or where it is a DataLoader with persistent workers, a copy of it without them: iterating
    the copy builds an iterator of its own (workers seeded, and an IterableDataset sharded, as the loader's
    are; shut down once it is dropped) and leaves the loader's iterator alone. Lightning's first validation
    builds that one, drawing its base seed from the global generator, and only resets it from then on: one
    built elsewhere would leave the run's generator a draw behind."""
    from torch.utils.data import DataLoader

    if not isinstance(loader, DataLoader) or not loader.persistent_workers:
        return loader
    transient = copy.copy(loader)
    object.__setattr__(transient, "persistent_workers", False)  # DataLoader.__setattr__ forbids it once built
    object.__setattr__(transient, "_iterator", None)
    return transient


def gradients_read_before_step(trainer: pl.Trainer, pl_module: pl.LightningModule, caller: Any) -> bool:
    """Whether code that Lightning runs after ``caller``'s ``on_before_optimizer_step`` and before the optimizer
    step may read gradients, and fail on parameters that all lack one: a later callback's or the module's own
    ``on_before_optimizer_step`` (a held-out module clipped by value there), clipping by value (torch raises
    on an empty list), or a module's own ``configure_gradient_clipping``. Norm clipping of no gradients is a
    no-op."""
    by_value = trainer.gradient_clip_val and trainer.gradient_clip_algorithm == "value"
    callbacks = list(trainer.callbacks)
    later = callbacks[callbacks.index(caller) + 1 :] if caller in callbacks else callbacks
    return (
        bool(by_value)
        or is_overridden("configure_gradient_clipping", pl_module)
        or is_overridden("on_before_optimizer_step", pl_module)
        or any(is_overridden("on_before_optimizer_step", callback, pl.Callback) for callback in later)
    )


#: the LightningModule's hooks that Lightning runs between a backward and the optimizer step, where a module's
#: own code may touch every parameter's gradient (gradient noise, zeroing rows, clipping by hand)
MODULE_GRADIENT_HOOKS = ("on_after_backward", "on_before_optimizer_step", "configure_gradient_clipping")


def gradient_reading_hooks(pl_module: pl.LightningModule) -> list[str]:
    """The module's own hooks, as ``"Class.hook"``, that Lightning runs between a backward and the optimizer
    step and that may touch every parameter's gradient, so fail on a ``None`` one
    (:data:`MODULE_GRADIENT_HOOKS`). Where :func:`gradients_read_before_step` asks whether code may need some
    parameter to have a gradient, this names the module's code that may need each one to. Callbacks are left
    out: one that only reads (a gradient-norm logger, Lightning's ``grad_norm``) skips a ``None`` gradient, and
    counting each would cost every fit with such a callback a zero gradient per frozen parameter per step."""
    name = type(pl_module).__name__
    return [
        f"{name}.{hook}"
        for hook in MODULE_GRADIENT_HOOKS
        if is_overridden(hook, pl_module) and _may_touch_gradients(getattr(type(pl_module), hook))
    ]


def _may_touch_gradients(hook: Any) -> bool:
    """Whether a hook's own code reads a ``.grad`` attribute (or its code cannot be read). One that only calls
    None-safe helpers (Lightning's ``grad_norm``, ``clip_grad_norm_``) and logs needs no stand-in gradients: a
    regression sweep found Lightning's ``grad_norm`` logging recipe given zeros, which it logged as norms of 0
    for every frozen layer. A hook that reaches gradients only through a helper of its own is not seen."""
    try:
        source = inspect.getsource(hook)
    except (OSError, TypeError):
        return True
    return re.search(r"\.grad\b", source) is not None


def prepare_evaluation_batch(trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> Any:
    """A batch fresh from a validation DataLoader made ready for ``validation_step`` as Lightning's evaluation
    loop makes it: the precision plugin's input conversion (``64-true``, ``bf16-true``), the module's
    ``on_before_batch_transfer``, then the move to its device with ``transfer_batch_to_device`` and
    ``on_after_batch_transfer``."""
    batch = trainer.precision_plugin.convert_input(batch)
    batch = pl_module._on_before_batch_transfer(batch, dataloader_idx=0)
    return trainer.strategy.batch_to_device(batch, pl_module.device, dataloader_idx=0)


def set_max_steps(trainer: pl.Trainer, steps: int) -> None:
    """Cap the fit at ``steps`` optimizer steps (``Trainer(max_steps=...)``, set after construction)."""
    trainer.fit_loop.epoch_loop.max_steps = int(steps)


def stop_takes_effect(trainer: pl.Trainer) -> bool:
    """Whether the fit ends at the next check of its loops for a stop asked for (``trainer.should_stop``):
    Lightning ignores the flag, and trains on, until ``Trainer(min_epochs=...)`` and ``min_steps=...`` are
    met (``FitLoop._can_stop_early``). In an epoch's end hooks the ending epoch counts already, as it does in
    the check that follows them. Read this, never ``should_stop`` alone, to conclude that the fit ends."""
    return bool(trainer.should_stop) and bool(getattr(trainer.fit_loop, "_can_stop_early", True))


def stop_this_fit(trainer: pl.Trainer) -> tuple[int | None, int | None]:
    """Stop the fit at the next check of its loops, even where ``Trainer(min_epochs/min_steps)`` are not met
    (they would overrule ``should_stop``: :func:`stop_takes_effect`): lifted for this fit. They come from the
    Trainer's arguments, not from a checkpoint, so a fit resumed with the same arguments honours them again.
    A stop asked before (``should_stop`` the minimums held back) is no longer told apart, and no checkpoint
    keeps it: a caller that saves one first records it (GreenWindow's suspend: ``SuspendSave.ask_stop_again``).
    Returns the ``(min_epochs, min_steps)`` lifted, for :func:`restore_loop_minimums` at the fit's end."""
    loop = trainer.fit_loop
    lifted = (loop.min_epochs, loop.epoch_loop.min_steps)
    trainer.should_stop = True
    loop.min_epochs, loop.epoch_loop.min_steps = 0, None
    return lifted


def restore_loop_minimums(trainer: pl.Trainer, lifted: tuple[int | None, int | None]) -> None:
    """Put back the ``(min_epochs, min_steps)`` :func:`stop_this_fit` lifted, for a later fit of the same
    Trainer (Lightning reads them again at each ``fit``)."""
    trainer.fit_loop.min_epochs, trainer.fit_loop.epoch_loop.min_steps = lifted


def fit_ends_after_this_step(trainer: pl.Trainer) -> bool:
    """At a training batch's end, once its hooks have run: whether the fit ends after it with no more training,
    as Lightning's loops will find: ``max_steps`` reached, the last batch of the ``max_epochs``-th epoch, or a
    stop asked (``should_stop``) that ``Trainer(min_epochs/min_steps)`` let take effect (at an epoch's last
    batch the ending epoch counts, as in the fit loop's check after it)."""
    from lightning.pytorch.loops.utilities import _is_max_limit_reached

    loop, epoch_loop = trainer.fit_loop, trainer.fit_loop.epoch_loop
    if _is_max_limit_reached(epoch_loop.global_step, loop.max_steps):
        return True
    epoch_ends = epoch_loop._num_ready_batches_reached()
    epochs = loop.epoch_progress.current.processed + int(epoch_ends)
    if epoch_ends and _is_max_limit_reached(epochs, loop.max_epochs or -1):
        return True
    met_epochs = not loop.min_epochs or epochs >= loop.min_epochs
    return bool(trainer.should_stop) and met_epochs and epoch_loop.global_step >= (epoch_loop.min_steps or 0)


def dump_checkpoint(trainer: pl.Trainer) -> dict[str, Any]:
    """The checkpoint ``trainer.save_checkpoint`` would save now, to write later (:func:`write_checkpoint`):
    its states are taken now (the weights' tensors are the live ones: write it before the next step)."""
    return trainer._checkpoint_connector.dump_checkpoint(False)


def write_checkpoint(trainer: pl.Trainer, checkpoint: dict[str, Any], path: Any) -> None:
    """Write a :func:`dump_checkpoint` as ``trainer.save_checkpoint`` does (a collective: on every rank)."""
    trainer.strategy.save_checkpoint(checkpoint, path)
    trainer.strategy.barrier("Trainer.save_checkpoint")


def after_module_batch_end(trainer: pl.Trainer, hook: Callable[[Any], None]) -> None:
    """Call ``hook(trainer)`` once, after the module's own ``on_train_batch_end`` of this batch (Lightning
    runs it after every callback's), before the epoch loop reads ``should_stop`` (whether to validate, whether
    the epoch ends): its ``_should_check_val_fx``, wrapped on this loop instance for that call only. A wrapper
    left by a fit that raised before it passes a later batch's call through (the batch counter differs)."""
    epoch_loop = trainer.fit_loop.epoch_loop
    batch = epoch_loop.batch_progress.total.ready  # this batch's; a later batch's is higher

    def wrap(original: Callable[..., Any], state: dict[str, bool]) -> Callable[..., Any]:
        def should_check_val_fx(*args: Any, **kwargs: Any) -> bool:
            due = state["active"] and epoch_loop.batch_progress.total.ready == batch
            remove()
            if due:
                hook(trainer)
            return original(*args, **kwargs)

        return should_check_val_fx

    remove = _wrap_on_instance(epoch_loop, "_should_check_val_fx", wrap)


# on the epoch loop: (training steps, max_steps set) of cap_training_steps, so run_length reads the first
_TRAINING_CAP_ATTR = "_lightning_pulse_training_cap"


def cap_training_steps(trainer: pl.Trainer, steps: int, batch_norm_step: bool) -> int:
    """Cap the fit's training at ``steps`` optimizer steps and return the ``max_steps`` set: one more with
    ``batch_norm_step``, for the step of a ``StochasticWeightAveraging``'s BatchNorm-update epoch after the
    training (``max_steps`` counts it: capped at ``steps``, the fit ended before that epoch, and the averaged
    weights kept BatchNorm statistics of other weights). :func:`run_length` reads ``steps`` while
    ``max_steps`` is the one set here."""
    cap = int(steps) + int(batch_norm_step)
    set_max_steps(trainer, cap)
    setattr(trainer.fit_loop.epoch_loop, _TRAINING_CAP_ATTR, (int(steps), cap))
    return cap


def _training_max_steps(trainer: pl.Trainer) -> float:
    """``trainer.max_steps`` (``inf`` for none) less a step :func:`cap_training_steps` left for the
    BatchNorm-update epoch."""
    if trainer.max_steps == -1:
        return math.inf
    training, cap = getattr(trainer.fit_loop.epoch_loop, _TRAINING_CAP_ATTR, (None, None))
    return training if training is not None and cap == trainer.max_steps else trainer.max_steps


def set_sampler_epoch(loader: Any, epoch: int) -> None:
    """Set the epoch of ``loader``'s sampler (and its batch sampler's) as Lightning does at an epoch's start.

    Lightning creates a fit's first iterator in ``FitLoop.setup_data``, before ``on_advance_start`` sets the
    samplers' epoch. A DataLoader with workers draws its first batches' indices when the iterator is created,
    so a pass that begins there is drawn in the sampler's previous epoch (a fresh sampler's 0 on a resume into
    epoch 1); this sets it first. Lightning's own call follows with the same epoch."""
    from lightning.fabric.utilities.data import _set_sampler_epoch

    _set_sampler_epoch(loader, epoch)


def set_epoch_batches(trainer: pl.Trainer, batches: int) -> None:
    """Tell Lightning that this epoch holds ``batches`` batches, for its validation: with a fractional
    ``val_check_interval`` it validates at multiples of ``val_check_batch``, which it computes once from the
    DataLoader's length, so the pass's next check goes there (:func:`mark_last_batch_of` places the later
    ones; on a resume Lightning reads it to tell whether the restored batch validated); an int interval keeps
    its count (:func:`mark_last_batch_of` may have moved the check to the previous pass's end). The epoch
    itself ends when the loader does."""
    interval, check = _val_check_interval(trainer), trainer.val_check_batch
    if trainer.check_val_every_n_epoch is None or batches <= 0 or not isinstance(check, int):
        return  # validation counted over the run's batches, by time, or on an endless loader
    if isinstance(interval, float):
        _place_fractional_check(trainer, batches, position=max(1, trainer.fit_loop.epoch_loop.batch_idx + 1))
    elif isinstance(interval, int):
        trainer.val_check_batch = interval


def _val_check_interval(trainer: pl.Trainer) -> int | float | None:
    """``trainer.val_check_interval``, or ``None`` where the interval is a time (Lightning 2.6 takes
    ``{"seconds": 30}``, ``"DD:HH:MM:SS"`` or a ``timedelta``, keeps it in ``_val_check_time_interval`` and
    sets no ``val_check_interval``): validation by time needs no batch placed for it."""
    if getattr(trainer, "_val_check_time_interval", None) is not None:
        return None
    return getattr(trainer, "val_check_interval", None)


def _fractional_checks(plain: int, batches: int, interval: float) -> list[int]:
    """The batches (counted from 1) of a pass of ``batches`` that validate, where the plain epoch of
    ``plain`` batches validates at each multiple of ``max(1, int(plain * interval))``: each of its checks at
    the same share of the pass, rounded down as Lightning rounds the interval. The pass validates as often as
    the plain epoch (less only where it holds fewer batches than checks), and at its end where the plain
    epoch did."""
    every = max(1, int(plain * interval))
    return sorted({max(1, check * batches // plain) for check in range(every, plain + 1, every)})


def _place_fractional_check(trainer: pl.Trainer, batches: int, position: int) -> None:
    """With a fractional ``val_check_interval``, at the ``position``-th batch (from 1) of a pass of
    ``batches``: set ``val_check_batch`` to the pass's next check (:func:`_fractional_checks`) at or after
    it, as Lightning validates where ``(batch_idx + 1) % val_check_batch == 0``. Checks every
    ``int(batches * interval)`` batches put a third check at 0.5 in a 9-batch pass (at 4 and 8), once its
    end was validated as the plain epoch's."""
    interval, check = _val_check_interval(trainer), trainer.val_check_batch
    plain = trainer.num_training_batches
    if trainer.check_val_every_n_epoch is None or not isinstance(interval, float):
        return
    if not isinstance(check, int) or not isinstance(plain, int) or plain <= 0 or batches <= 0:
        return  # by time, or on an endless loader
    later = [at for at in _fractional_checks(plain, min(batches, plain), interval) if at >= position]
    trainer.val_check_batch = later[0] if later else plain + 1  # no multiple of it left in the epoch


def _validate_at_pass_end(trainer: pl.Trainer, batches: int) -> None:
    """At the last batch of a pass of ``batches`` batches, with an int ``val_check_interval``: let Lightning
    validate there when the plain epoch (the DataLoader's length) validated at its end, its length a multiple
    of the interval, or when the pass ends before its first check. Lightning validates where
    ``(batch_idx + 1) % val_check_batch == 0``, so a shorter pass would miss the epoch's end (and the run's
    final weights) whenever its length is no multiple; the check moves to this batch, and
    :func:`set_epoch_batches` sets it back at the next pass.

    Lightning refuses an interval longer than the epoch, so the plain run validates every epoch it checks.
    The DataLoader keeps its plain length, so Lightning accepts an interval longer than a planned pass, which
    its count from the pass's start never reached: ``val_check_interval=20`` on 23-batch epochs validated
    none of the 12- to 19-batch passes of a held-out run."""
    interval, check = _val_check_interval(trainer), trainer.val_check_batch
    plain = trainer.num_training_batches
    if trainer.check_val_every_n_epoch is None or not isinstance(check, int) or not isinstance(plain, int):
        return
    if isinstance(interval, int) and plain > 0 and (plain % interval == 0 or batches < interval):
        trainer.val_check_batch = batches


def total_steps(trainer: pl.Trainer) -> float:
    """The run's optimizer steps: ``trainer.estimated_stepping_batches`` as a float, ``inf`` for a run of
    unknown length. Lightning returns ``max_steps`` for a DataLoader without a length, which is ``-1`` when
    only ``max_epochs`` bounds the run: read as a length, ``-1`` put every share-of-run setting at step 0 or
    before.

    Under a ``GradientAccumulationScheduler`` Lightning's estimate counts every epoch at the accumulation of
    the current one (a held-out run of 75 steps was estimated at 132 at its start and 18 from its fourth epoch
    on), so the epochs are counted one by one, each at its own accumulation: the short last window of an epoch
    steps at the epoch's end."""
    return run_length(trainer)[0]


def steps_left_at_run_pace(trainer: pl.Trainer) -> float:
    """Optimizer steps left (:func:`total_steps`), in steps of the size the run's have had on average: a time
    per step measured so far then times the work left. Under a ``GradientAccumulationScheduler`` a later step
    covers more batches, so the batches left are counted and divided by the run's batches per step so far."""
    steps, batches = run_length(trainer)
    steps_done, done = run_progress(trainer)
    steps_left = steps - steps_done
    if accumulation_schedule(trainer) is None or steps_left <= 0 or done <= 0 or steps_done <= 0:
        return steps_left
    return (batches - done) * steps_done / done


def run_end_status(trainer: pl.Trainer, suspended: bool) -> str:
    """How a fit's training ended (``core.green_window.run_status``): ``"smoke_test"`` (``fast_dev_run``),
    ``"suspended"``, ``"stopped"`` (Lightning's Timer, ``max_time``, ended it with steps left) or
    ``"complete"``. What GreenWindow and EnergyLogger report."""
    from lightning.pytorch.callbacks import Timer

    from lightning_pulse.core.green_window import run_status

    timers = [callback.time_remaining() for callback in trainer.callbacks if isinstance(callback, Timer)]
    smoke_test = bool(trainer.fast_dev_run)
    return run_status(suspended, timers, lambda: steps_left_at_run_pace(trainer), smoke_test=smoke_test)


def max_time_left_s(trainer: pl.Trainer) -> float | None:
    """Seconds the ``Trainer(max_time)`` Timers leave of the fit's training (the least), ``None`` without
    one. The Timer counts wall time (a GreenWindow pause included) on ``time.monotonic``, from its own
    ``on_train_start``: one not started yet (a decision at the fit's start, Lightning listing its Timer last)
    counts nothing, so a pause there is outside ``max_time``."""
    from lightning.pytorch.callbacks import Timer

    timers = [
        callback.time_remaining()
        for callback in trainer.callbacks
        if isinstance(callback, Timer) and callback.start_time() is not None
    ]
    left = [float(value) for value in timers if value is not None]
    return min(left) if left else None


def run_progress(trainer: pl.Trainer) -> tuple[int, int]:
    """``(optimizer steps, training batches on this rank)`` the run has taken so far, a resumed run's earlier
    part and an earlier ``fit`` of the same Trainer included: the counts :func:`run_length` gives in total."""
    return trainer.global_step, trainer.fit_loop.epoch_loop.total_batch_idx + 1


def steps_per_batch_unknown(trainer: pl.Trainer) -> bool:
    """Whether the optimizer steps a training batch makes are up to the module and not known before the run:
    manual optimization with more than one optimizer. Lightning's ``global_step`` (and ``max_steps``) counts
    every optimizer's ``step()``, two a batch for a GAN's two players, while ``estimated_stepping_batches``
    counts one a batch; players updated in turn (one step a batch, or a critic stepped five times for each
    generator step) are treated the same: how many steps a batch makes is the module's choice. With one
    optimizer, one step a batch is taken, as Lightning's estimate does; a module that steps it every N batches
    itself (manual accumulation) makes a run N times shorter than that (a documented limit)."""
    module = trainer.lightning_module
    return module is not None and not module.automatic_optimization and len(trainer.optimizers) > 1


def run_length(trainer: pl.Trainer) -> tuple[float, float]:
    """``(optimizer steps, training batches on this rank)`` of the run (:func:`total_steps`; ``inf`` for a
    run of unknown length): each epoch at its own accumulation, the epoch that reaches ``max_steps`` cut at
    its last window. Work measured per optimizer step does not scale to the rest of a run whose later steps
    cover more batches (a ``GradientAccumulationScheduler`` raising the accumulation): measured per batch it
    does. The epoch a ``StochasticWeightAveraging`` adds to update BatchNorm statistics trains nothing and is
    not counted (:func:`training_max_epochs`). A fit resumed from a checkpoint counts the steps and batches
    taken before it as they were taken, and this fit's epoch length from where it resumed (:func:`_epochs_length`).

    Where a batch's steps are unknown (:func:`steps_per_batch_unknown`), only ``max_steps`` gives a length in
    steps, and only when nothing else can end the run first (no ``max_epochs``, or a DataLoader without a
    length); the batches are then unknown. Otherwise both are ``inf``: read as one step a batch, a GAN's run
    was planned on half its steps."""
    # reading the estimate also sets the training DataLoader up if it is not yet
    estimate = float(trainer.estimated_stepping_batches)
    if estimate < 0:
        return math.inf, math.inf
    if steps_per_batch_unknown(trainer):
        # max_steps counts every optimizer's step, as global_step does: a length if nothing else ends the run
        epochs, batches_per_epoch = training_max_epochs(trainer), trainer.num_training_batches
        bounded_by_steps = epochs in (None, -1) or not math.isfinite(batches_per_epoch)
        return (min(estimate, _training_max_steps(trainer)) if bounded_by_steps else math.inf), math.inf
    batches, accumulate = _training_epoch_batches(trainer)
    window_of = _window_of(trainer, accumulate)
    max_epochs = training_max_epochs(trainer)
    # a run bounded by max_steps alone, or of unknown length
    if max_epochs in (None, -1) or not math.isfinite(batches) or batches < 1:
        estimate = min(estimate, _training_max_steps(trainer))
        # a resumed fit: the batches taken before it as they were taken (another accumulation's), the rest at
        # this fit's (saved at step 10 at 1, resumed to 60 steps at 2: 110 batches, not 120)
        _, before, _, taken = _resume_point(trainer) or (0, 0, 0, 0)
        return estimate, taken + max(estimate - before, 0) * window_of(trainer.current_epoch)
    steps, taken, _ = _epochs_length(trainer, batches, window_of, max_epochs)
    return float(steps), float(taken)


def _window_of(trainer: pl.Trainer, accumulate: int) -> Callable[[int], int]:
    """An epoch's accumulation by its index: a ``GradientAccumulationScheduler``'s, else ``accumulate``."""
    schedule = accumulation_schedule(trainer)
    return (lambda epoch: accumulate) if schedule is None else schedule.get_accumulate_grad_batches


def _epochs_length(
    trainer: pl.Trainer, batches: float, window_of: Callable[[int], int], max_epochs: int
) -> tuple[int, int, bool]:
    """``(optimizer steps, batches, whether max_steps ended it)`` of a ``max_epochs`` run of epochs of
    ``batches`` batches, counted from epoch 0, or, in a fit resumed from a checkpoint, from where it resumed
    (:func:`_resume_point`): the steps and batches taken before it, at whatever length the epochs had then,
    the rest of the restored epoch at this fit's length and accumulation, then the epochs left. Counted from
    epoch 0 at this fit's length, a resume that changed the epoch's length (``accumulate_grad_batches``, the
    batch size, the data set, ``limit_train_batches``) placed the shares of the run on the length of a fresh
    run with the new settings: saved at step 16 of 3 x 16 steps and resumed at accumulation 2, a run that
    ends at step 32 was read as 24 steps long, and its anneal of 0.2 covered 0.41 of it."""
    epoch, steps, done, taken = _resume_point(trainer) or (0, 0, 0, 0)
    steps_left, last = max(_training_max_steps(trainer) - steps, 0), max(max_epochs, 1) - 1
    for index in range(epoch, last + 1):
        window = window_of(index)
        # Lightning goes on in the restored epoch from its batch count: its windows keep their places
        # an epoch counted done in full stepped its short last window too
        stepped = (math.ceil(done / window) if done >= batches else done // window) if index == epoch else 0
        epoch_steps = max(math.ceil(batches / window) - stepped, 0)
        epoch_batches = max(batches - (done if index == epoch else 0), 0)
        if epoch_steps >= steps_left:  # max_steps ends it, unless exactly at the last epoch's end
            cut = epoch_steps > steps_left or index < last
            return steps + steps_left, taken + min(epoch_batches, steps_left * window), cut
        steps, taken, steps_left = steps + epoch_steps, taken + epoch_batches, steps_left - epoch_steps
    return steps, taken, False


# on the fit loop: where a fit resumed from a checkpoint stands at its train start (_resume_point)
_RESUME_POINT_ATTR = "_lightning_pulse_resume_point"


def _resume_point(trainer: pl.Trainer) -> tuple[int, int, int, int] | None:
    """``(epoch, optimizer steps, batches of that epoch Lightning counts trained, batches trained in all)``
    where this fit resumed from a checkpoint (``ckpt_path``), read once, at its train start (after Lightning
    restored the loops, before the restored epoch goes on); ``None`` for a fit that resumed nothing, or before
    its training starts. The restored epoch's batch count is the one Lightning's training epoch loop goes on
    from (:func:`_restored_epoch_batches`). A run whose passes a step-saving ``HardSampleReplay`` plans
    (``mode="steps"``) is left to its plan: its epochs hold fewer batches than the DataLoader's length, and
    the plan records the plain run's length it was made for."""
    from lightning.pytorch.trainer.states import RunningStage

    from lightning_pulse.callbacks.hard_sample_replay import HardSampleReplay  # it imports this module

    path = getattr(trainer, "ckpt_path", None)  # a stand-in trainer (a test's) may have none
    if path is None or any(isinstance(c, HardSampleReplay) and c.mode == "steps" for c in trainer.callbacks):
        return None
    # one object per `fit` call, kept through it (a DataLoader reloaded each epoch is another object)
    selector = trainer._data_connector._datahook_selector
    record = getattr(trainer.fit_loop, _RESUME_POINT_ATTR, None)
    if record is not None and record[0]() is selector and record[1] == path:
        return record[2]
    # before the training starts (setup, on_fit_start, a Tuner's trials) the loops are not restored yet
    # on_fit_start runs before Lightning restores the loops (the checkpoint is loaded, not yet applied)
    if trainer._checkpoint_connector._loaded_checkpoint:
        return None
    if trainer.state.stage != RunningStage.TRAINING or trainer.fit_loop._combined_loader is None:
        return None
    point = (trainer.current_epoch, trainer.global_step, *_restored_epoch_batches(trainer))
    setattr(trainer.fit_loop, _RESUME_POINT_ATTR, (weakref.ref(selector), path, point))
    return point


def _restored_epoch_batches(trainer: pl.Trainer) -> tuple[int, int]:
    """``(batches of the restored epoch, batches of the run)`` Lightning counts as trained where a resumed fit
    goes on, read at its train start. Lightning's training epoch loop resets its counters only when it starts
    (after ``on_train_start``): restarting, a batch saved at its ``on_train_batch_end`` counts as completed,
    and the epoch goes on from that count, whatever this fit's epoch length; only a count that reaches it
    starts the epoch over from its first batch (``limit_train_batches`` 16 -> 4 at batch 10: 4 batches more;
    a data set twice as long at the epoch's last batch: the next epoch goes on from batch 16 of 32). Saved
    elsewhere (at a validation's end), the first pass of a loop that validates at the restored count goes to
    that validation's end and trains nothing; then a count equal to this fit's length, or the restored last
    batch, ends the epoch. Otherwise a count at or past the length trains one batch more (the data
    fetcher, counting on from the restored count, calls the first batch fetched the last): read as one batch
    short of the length, the place from which that one batch, one optimizer step, is left (saved at batch 8
    of 16 with ``val_check_interval=0.5``, resumed at ``limit_train_batches=4``: 17 steps, not 16)."""
    epoch_loop = trainer.fit_loop.epoch_loop
    current, total = epoch_loop.batch_progress.current, epoch_loop.batch_progress.total
    if not epoch_loop.restarting:
        return 0, int(total.ready)
    saved_at_batch_end = int(getattr(epoch_loop, "restarted_on_train_batch_end", False))
    done = int(current.completed) + saved_at_batch_end
    if saved_at_batch_end and done >= trainer.num_training_batches:
        done = 0
    elif not saved_at_batch_end and math.isfinite(batches := trainer.num_training_batches):
        # Lightning 2.6's TrainingEpochLoop.advance: a restart that validates returns at once where saved at
        # the last hook (or mid-evaluation); its `done` then reads the count (==) and the restored last batch
        loop = trainer.fit_loop
        first_pass_trains = not (
            epoch_loop._should_check_val_fx(loop._data_fetcher)
            and (epoch_loop.val_loop.restarted_mid_evaluation or epoch_loop.restarted_on_last)
        )
        if not first_pass_trains and (done == batches or epoch_loop.batch_progress.is_last_batch):
            done = int(batches)  # the epoch ends: nothing more of it
        elif done >= batches:
            done = int(batches) - 1  # one batch more, the fetcher's last
    return done, int(total.completed) + saved_at_batch_end


# on the fit loop: the fit's settings placed as shares of the run's length (core.run_shares.PlacedShares)
_PLACED_SHARES_ATTR = "_lightning_pulse_placed_shares"


def note_run_shares(
    trainer: pl.Trainer,
    owner: str,
    placed: dict[str, Any] | str,
    in_steps: bool = False,
    in_duration: bool = False,
    rereads: bool = False,
) -> None:
    """At ``on_train_start``, where ``owner`` placed settings on the run's length (:func:`run_length`):
    remember them with the epoch length that length was read from, for :func:`check_run_shares`.

    ``placed``: the settings by name (the shares among them are kept, as
    :func:`~lightning_pulse.core.run_shares.shares_named` names them; none: nothing to note), or what was
    placed, in words. ``in_steps``, ``in_duration``: the settings also take int optimizer steps, a duration
    (ways out the warning names). ``rereads``: what was placed is read again at each epoch's end (a forecast),
    so only the epochs still to come are unseen. Lightning attaches a new training DataLoader for each fit and
    rebuilds none between the callbacks' ``on_train_start``: a note with another DataLoader than the record's
    is another fit's, and starts a new record."""
    if not (what := placed if isinstance(placed, str) else shares_named(**placed)):
        return
    if (loader := trainer.fit_loop._combined_loader) is None:  # a fit that trains nothing
        return
    record = getattr(trainer.fit_loop, _PLACED_SHARES_ATTR, None)
    if record is None or record.loader() is not loader:  # weakly: a rebuilt one's workers may end
        batches, steps = trainer.num_training_batches, run_length(trainer)[0]
        record = PlacedShares(weakref.ref(loader), batches, steps, _length_of_epochs(trainer, steps))
        setattr(trainer.fit_loop, _PLACED_SHARES_ATTR, record)
    record.place(owner, what, in_steps, in_duration, rereads)


def check_run_shares(trainer: pl.Trainer) -> None:
    """At a training epoch's start, after Lightning rebuilt the DataLoader
    (``reload_dataloaders_every_n_epochs``): warn once a fit, naming every setting :func:`note_run_shares`
    noted, when this epoch's length gives the run another length than the one they were placed on. In a
    growing curriculum no later epoch's length is known ahead, so they cannot be placed again right. A
    DataLoader rebuilt at the same length (to reshuffle or re-sample), or a run that ``max_steps`` alone
    bounds, says nothing. The same warning, worded for it, follows an epoch the module's
    ``on_train_batch_start`` ended early (it returned -1) in a run whose length ``max_epochs`` gave. Also
    callable at an epoch's first batch start (before its step)."""
    record = getattr(trainer.fit_loop, _PLACED_SHARES_ATTR, None)
    batches = trainer.num_training_batches
    if record is None or record.warned or in_batch_norm_update_epoch(trainer):
        return
    if batches_skipped(trainer) and (warning := record.cut_short()) is not None:
        rank_zero_warn(warning)
        return
    if batches == record.batches:
        return
    if (warning := record.moved(trainer.current_epoch, batches, run_length(trainer)[0])) is not None:
        rank_zero_warn(warning)


def _length_of_epochs(trainer: pl.Trainer, steps: float) -> bool:
    """Whether the run's length, ``steps`` (:func:`run_length`), is ``max_epochs`` whole epochs, not a
    ``max_steps`` reached first: epochs that end early shorten only such a run."""
    max_epochs, batches = training_max_epochs(trainer), trainer.num_training_batches
    if max_epochs in (None, -1) or not math.isfinite(steps) or not math.isfinite(batches):
        return False
    window_of = _window_of(trainer, trainer.accumulate_grad_batches)
    return not _epochs_length(trainer, batches, window_of, max_epochs)[2]


def accumulation_schedule(trainer: pl.Trainer) -> GradientAccumulationScheduler | None:
    """The trainer's ``GradientAccumulationScheduler``, if it has one."""
    return next((c for c in trainer.callbacks if isinstance(c, GradientAccumulationScheduler)), None)


def scheduled_accumulation(trainer: pl.Trainer) -> int:
    """The batches a step the current training epoch takes as the run is set up: a
    ``GradientAccumulationScheduler``'s factor for ``trainer.current_epoch``, read from its schedule, else
    ``trainer.accumulate_grad_batches``. The scheduler sets the Trainer's value only in its own
    ``on_train_epoch_start``, so before it (setup, ``on_train_start``, a caller's ``on_train_epoch_start``
    before the scheduler's) the Trainer still holds 1 or the previous epoch's factor. A fit resumed mid-epoch
    gets no ``on_train_epoch_start`` and Lightning trains that epoch's rest at the Trainer's 1; this still
    gives the schedule's factor, what the uninterrupted run had."""
    schedule = accumulation_schedule(trainer)
    if schedule is None:
        return trainer.accumulate_grad_batches
    return schedule.get_accumulate_grad_batches(trainer.current_epoch)


def scheduled_epoch_steps(trainer: pl.Trainer) -> int | None:
    """The current training epoch's optimizer steps at :func:`scheduled_accumulation` (``None``: an epoch of
    unknown length), whichever callback's ``on_train_epoch_start`` ran first."""
    return epoch_steps(trainer.num_training_batches, scheduled_accumulation(trainer))


def epoch_optimizer_steps(trainer: pl.Trainer) -> float | None:
    """The current training epoch's optimizer steps, as ``PhaseClock.advance`` takes an epoch's length
    (``core.step_plan.clock_epoch_steps``; a step-saving sampler reports the plain epoch's batches). Call it
    at the epoch's first training batch, not in ``on_train_epoch_start``: a ``GradientAccumulationScheduler``
    sets the epoch's ``accumulate_grad_batches`` in its own ``on_train_epoch_start``, which may come after the
    caller's (then the previous epoch's factor, or 1 at a run's start, was read: a 1.0-epoch burst took 8
    steps of a 6-step epoch). Lightning calls no ``on_train_epoch_start`` in a fit resumed mid-epoch, so the
    scheduler leaves the Trainer's factor for the rest of that epoch, and its steps are taken at that factor:
    read at the first batch, each step counts its batches' share of the epoch, as in the uninterrupted run."""
    return clock_epoch_steps(trainer.num_training_batches, trainer.accumulate_grad_batches)


# ---------------------------------------------------------------------------- StochasticWeightAveraging
# On a model with BatchNorm (and a finite max_epochs), Lightning's SWA raises `fit_loop.max_epochs` by one in
# its `on_fit_start` and lowers it again in its `on_train_end`. The epoch it adds (index `_max_epochs`, the
# user's max_epochs) only recomputes BatchNorm statistics for the averaged weights: at its start SWA sets
# `fit_loop._skip_backward`, raises `fit_loop.max_batches` by one and sets the accumulation to that count, so
# the epoch runs forward passes and, at its end, one optimizer step with no backward (global_step moves by
# one; the step applies whatever gradients the last training step left). Which of our hooks run before SWA's
# depends on the callback order, so the readers below give the same answer on either side of SWA's hooks.
def _swa_of(trainer: pl.Trainer) -> StochasticWeightAveraging | None:
    return next((c for c in trainer.callbacks if isinstance(c, StochasticWeightAveraging)), None)


def _batch_norm_swa(trainer: pl.Trainer) -> StochasticWeightAveraging | None:
    """The ``StochasticWeightAveraging`` that has raised ``trainer``'s ``max_epochs`` for its BatchNorm-update
    epoch in this fit, else ``None`` (none attached, no BatchNorm, an unbounded run, before SWA's
    ``on_fit_start`` or after its ``on_train_end``)."""
    swa = _swa_of(trainer)
    if swa is None or not swa._model_contains_batch_norm:
        return None
    user_epochs = getattr(swa, "_max_epochs", None)  # set in its on_fit_start
    if user_epochs in (None, -1) or trainer.fit_loop.max_epochs != user_epochs + 1:
        return None
    return swa


def adds_batch_norm_epoch(trainer: pl.Trainer) -> bool:
    """Whether a ``StochasticWeightAveraging`` of ``trainer`` adds (or added) an epoch to this fit that only
    updates BatchNorm statistics: the model holds BatchNorm and ``max_epochs`` is finite. Also true before
    SWA's ``on_fit_start`` (a DataLoader set up from ``configure_optimizers``)."""
    swa = _swa_of(trainer)
    if swa is None or trainer.max_epochs in (None, -1):
        return False
    if swa._model_contains_batch_norm is not None:
        return bool(swa._model_contains_batch_norm)
    module = trainer.lightning_module
    return module is not None and StochasticWeightAveraging.pl_module_contains_batch_norm(module)


def training_max_epochs(trainer: pl.Trainer) -> int | None:
    """``trainer.max_epochs`` less the BatchNorm-update epoch a ``StochasticWeightAveraging`` added: the
    epochs that train. Lightning's ``estimated_stepping_batches`` counts that epoch as training (a held-out
    run of 50 steps was read as 60: its anneal covered 3 steps instead of 10, its step plan 49 of 60)."""
    swa = _batch_norm_swa(trainer)
    return trainer.max_epochs if swa is None else swa._max_epochs


def in_batch_norm_update_epoch(trainer: pl.Trainer) -> bool:
    """Whether the epoch under way (or just finished, before the fit's end) is the one a
    ``StochasticWeightAveraging`` added to update BatchNorm statistics: no backward, no training step."""
    max_epochs = trainer.fit_loop.max_epochs
    if max_epochs in (None, -1) or trainer.current_epoch < max_epochs - 1:
        return False  # not the last epoch: no scan of the callbacks (this runs at every batch)
    swa = _batch_norm_swa(trainer)
    return swa is not None and trainer.current_epoch >= swa._max_epochs


def training_steps_taken(trainer: pl.Trainer) -> int:
    """``trainer.global_step`` less the optimizer step of a ``StochasticWeightAveraging``'s BatchNorm-update
    epoch (the accumulation window that spans the epoch closes with a step and no backward). For
    ``on_train_end``, where SWA may already have lowered ``max_epochs`` again: it ran when the fit ended one
    past that epoch, the condition SWA's own ``on_train_end`` tests."""
    swa = _swa_of(trainer)
    if swa is None or not swa._model_contains_batch_norm or getattr(swa, "_max_epochs", -1) in (None, -1):
        return trainer.global_step
    ran = trainer.current_epoch == swa._max_epochs + 1 and trainer.global_step > 0
    return trainer.global_step - int(ran)


def optimizer_steps_counter(trainer: pl.Trainer) -> Callable[[], int] | None:
    """A function that reads ``trainer.global_step`` later without keeping the trainer (its model, its data)
    alive: the fit loop's own count of optimizer steps, read in place (Lightning keeps one tracker for the
    Trainer's life, moves it on at every step and loads a restored checkpoint's count into it). ``None``
    where a Trainer has no fit loop of that shape."""
    epoch_loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    module = getattr(trainer, "lightning_module", None)
    try:
        if module is None or module.automatic_optimization:
            total = epoch_loop.automatic_optimization.optim_progress.optimizer.step.total
        else:
            total = epoch_loop.manual_optimization.optim_step_progress.total
    except AttributeError:
        return None
    return functools.partial(getattr, total, "completed")  # picklable: ddp_spawn pickles the callbacks


#: hooks Lightning runs after its count of batches that stepped moved past the epoch's last step
_AFTER_THE_LAST_COUNT = frozenset({"on_train_epoch_end", "on_train_end", "on_fit_end"})


def logging_step(trainer: pl.Trainer, epoch_end: bool = False) -> int:
    """The step Lightning gives a metric logged now: its count of batches that stepped, where
    ``LightningModule.log``, ``LearningRateMonitor`` and validation write (one behind ``global_step`` at a
    training batch's end; a batch count, not an optimizer count, with several optimizers). At a training
    epoch's or the fit's end, the last step's, as Lightning writes an epoch's metrics; ``epoch_end``: that
    step from the next epoch's start too (a figure of the epoch before, logged once it has closed).
    ``trainer.global_step`` where a Trainer has no fit loop of that shape."""
    epoch_loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    counted = getattr(epoch_loop, "_batches_that_stepped", None)
    if not isinstance(counted, int):
        return trainer.global_step
    hook = getattr(trainer.strategy.lightning_module, "_current_fx_name", None)
    # a restored fit that trained no batch: Lightning's count has not moved past the checkpoint's last step
    ran = not getattr(epoch_loop, "restarting", False)
    after_last = epoch_end or hook in _AFTER_THE_LAST_COUNT
    return counted - 1 if after_last and counted > 0 and ran else counted


def window_ended(trainer: pl.Trainer) -> bool:
    """At a training batch's end: whether its accumulation window ended (where an optimizer step was due)."""
    return not trainer.fit_loop._should_accumulate()


def _training_epoch_batches(trainer: pl.Trainer) -> tuple[float, int]:
    """``(batches, accumulation)`` of a training epoch: inside the BatchNorm-update epoch, the values SWA
    replaced (until its ``on_train_end``) with one batch more and an accumulation spanning the epoch."""
    batches, accumulate = trainer.num_training_batches, trainer.accumulate_grad_batches
    swa = _batch_norm_swa(trainer)
    if swa is None or trainer.current_epoch < swa._max_epochs:  # not the BatchNorm-update epoch
        return batches, accumulate
    saved = getattr(swa, "_accumulate_grad_batches", None)
    if saved is not None and accumulate == batches:
        return batches - 1, saved
    return batches, accumulate


def mark_last_batch_of(trainer: pl.Trainer, batches: int) -> None:
    """Call at each training batch (after its fetch) of an epoch that holds ``batches`` batches, fewer than the
    DataLoader's length: Lightning's data fetcher marks the last batch by that length, and there an accumulation
    window closes on a partial window and epoch-interval LR schedulers step, and the pass's end is validated
    where the plain epoch's end was, or where the pass holds no check (:func:`_validate_at_pass_end`). Not at
    the pass's start: the fetcher may still hold the previous epoch's count then. ``num_training_batches`` is
    left alone (``estimated_stepping_batches`` reads it)."""
    fetcher = trainer.fit_loop._data_fetcher
    if batches <= 0 or fetcher is None or fetcher.length is None:
        return
    fetcher.length = batches
    fetcher.done = fetcher.fetched >= batches
    _place_fractional_check(trainer, batches, position=trainer.fit_loop.epoch_loop.batch_idx + 1)
    if fetcher.done:  # the batch just fetched ends the pass
        trainer.fit_loop.epoch_loop.batch_progress.is_last_batch = True
        _validate_at_pass_end(trainer, batches)


def close_restored_epoch(trainer: pl.Trainer, cut_short: bool = False) -> None:
    """On a resume from a checkpoint saved on the last batch of an epoch shorter than the DataLoader's length
    (a planned pass), let Lightning count that epoch's batches as done, as it does for one saved on the loader's
    last batch. It resets an epoch's batch counters only when the restored count reaches
    ``num_training_batches``; otherwise the next epoch starts with the finished one's count and ends once that
    count reaches the loader's length (after one batch, in a held-out run). Call at ``on_train_start``.

    The counters move up together to the loader's length, keeping their gaps. Saved inside the last batch's
    end (``ModelCheckpoint(every_n_train_steps=...)``), that batch is ready but not completed: the training
    epoch loop completes it when it starts and the epoch ends there. Saved after it, at the epoch's validation
    (``every_n_epochs``), it is completed: the epoch ends with no further batch (setting every counter to one
    below the length trained a batch of the next pass in the finished epoch). Saved in the epoch's end hooks
    with no validation there, the epoch is closed outright (below); so is one ``cut_short`` (the module's
    ``on_train_batch_start`` returned -1 in it), which Lightning never validates: restarted, it fetched the
    next pass's first batch, and the hook skipped it and ended the epoch again."""
    fit_loop = trainer.fit_loop
    if fit_loop.restarted_on_epoch_end and (cut_short or not fit_loop.epoch_loop._should_check_val_epoch()):
        # saved in the epoch's end hooks with no validation there: a step-limited run restarts that epoch, and a
        # restarting epoch loop ends only once validation has run, so it trained the next pass's first batch in
        # the finished epoch. Nothing is left to run in it: close it as Lightning does in an epoch-limited run
        # (``RESUMED_ON_EPOCH_END``), and the next epoch starts afresh.
        fit_loop._restarting = False  # the public setter keeps a step-limited run restarting
        fit_loop.epoch_loop.restarting = False
        fit_loop.reset_restart_stage()
        if fit_loop.epoch_progress.current.completed < fit_loop.epoch_progress.current.processed:
            fit_loop.epoch_progress.increment_completed()
        return
    epoch_loop = fit_loop.epoch_loop
    last_batch = epoch_loop.restarted_on_train_batch_end and epoch_loop.batch_progress.is_last_batch
    if fit_loop.restarted_mid_epoch and last_batch:
        # Lightning's reset closed the epoch saved at its last batch but went on with the next one as one
        # restored mid-epoch: never counted started, its start hooks not called. A checkpoint saved inside it
        # read as one saved at an epoch's end, and its resume began that epoch's `batch_idx` at 0 again (the
        # batch a -1 keyed on it skips trained). The next epoch starts as in the uninterrupted run.
        fit_loop.reset_restart_stage()
    progress = fit_loop.epoch_loop.batch_progress.current
    total = trainer.num_training_batches
    if isinstance(total, int) and total > progress.ready:
        shift = total - progress.ready
        progress.ready, progress.started = total, progress.started + shift
        progress.processed, progress.completed = progress.processed + shift, progress.completed + shift
    # saved inside the epoch's end hooks (``on_train_epoch_end``): the epoch was counted as processed, and the
    # loop, which runs that end again, would count it twice, so the run lost its last epoch
    epochs = fit_loop.epoch_progress.current
    epochs.processed = min(epochs.processed, epochs.completed)


def restart_past_skipped_batches(trainer: pl.Trainer) -> Callable[[], None]:
    """Call inside the data set-up of a fit that a step-saving plan drives (before the fit loop's ``reset``):
    let Lightning decide where the restored epoch goes on as it would had every batch that the module's
    ``on_train_batch_start`` returned -1 for in an earlier epoch started and completed. Returns a function
    removing the hook (it removes itself once it ran).

    Lightning reads the batch counters of all epochs (``update_restart_stage``): a checkpoint saved in
    ``on_train_batch_end`` has every batch started and processed and all but the latest completed. A skipped
    batch counts ready and processed, never started nor completed, so after one no later checkpoint matched:
    the batch saved at was not completed, ``batch_idx`` stayed one behind (a -1 keyed on it came a batch
    late) and an epoch saved at its last batch was not closed (the resume trained the next pass's first batch
    in it, and the plan took it for an epoch ended after one batch). A skip in the restored epoch itself (it
    ended the epoch there) is left as Lightning reads it. Lightning < 2.5 has no restart stages: nothing."""
    epoch_loop = trainer.fit_loop.epoch_loop
    if not callable(getattr(epoch_loop, "update_restart_stage", None)):
        return lambda: None

    def wrap(original: Callable[..., Any], state: dict[str, bool]) -> Callable[..., Any]:
        def update_restart_stage() -> None:
            original()
            if state["active"]:
                remove()
                _restart_stage_past_skips(epoch_loop)

        return update_restart_stage

    remove = _wrap_on_instance(epoch_loop, "update_restart_stage", wrap)
    return remove


def _restart_stage_past_skips(epoch_loop: Any) -> None:
    from lightning.pytorch.loops.training_epoch_loop import RestartStage

    total, current = epoch_loop.batch_progress.total, epoch_loop.batch_progress.current
    # this epoch's batches have each run through (no skip ended it); earlier epochs' skips are the gap left
    skipped = int(total.processed - total.started) - int(current.processed - current.started)
    if not epoch_loop.restarting or epoch_loop._restart_stage != RestartStage.NONE or skipped <= 0:
        return
    started, completed = total.started + skipped, total.completed + skipped
    if started != total.ready or total.processed != started:
        return
    if completed == total.processed - 1:
        epoch_loop._restart_stage = RestartStage.RESTARTED_ON_TRAIN_BATCH_END
    elif completed == total.processed:
        epoch_loop._restart_stage = RestartStage.RESTARTED_ON_LAST


def forget_earlier_fit_validation(trainer: pl.Trainer) -> None:
    """Call at ``on_train_start``: clear the mark of a validation run by an earlier fit of this Trainer, as a
    new Trainer has it. A step-limited fit restored from a checkpoint restarts its epoch, and the restarting
    epoch loop counts as done once training is done and this mark is set: left over from the earlier fit, an
    epoch restored done (its last batch trained) ended before its first iteration, which is what clears the
    restart, so every following epoch ended the same way, training nothing, without end."""
    val_loop = getattr(trainer.fit_loop.epoch_loop, "val_loop", None)
    if val_loop is not None and hasattr(val_loop, "_has_run"):
        val_loop._has_run = False


def epoch_restarting(trainer: pl.Trainer) -> bool:
    """Whether the training epoch under way was restored from a checkpoint and goes on from it (it may end
    with no batch: its last one trained before the checkpoint)."""
    return bool(trainer.fit_loop.epoch_loop.restarting)


# ---------------------------------------------------------------------------- EnergyLogger (issue 3)
def set_callback_metric(trainer: pl.Trainer, name: str, value: float) -> None:
    """Make ``name`` monitorable (``ModelCheckpoint``/``EarlyStopping`` read ``trainer.callback_metrics``)
    without ``LightningModule.log``, whose result-collection bookkeeping costs about 0.5 ms per call.

    The public ``trainer.callback_metrics`` recomputes every logged result on each access, so the dict
    behind it is written directly where Lightning 2.x keeps it; elsewhere through the public property.
    """
    import torch

    tensor = torch.tensor(float(value))
    metrics = getattr(getattr(trainer, "_logger_connector", None), "_callback_metrics", None)
    if isinstance(metrics, dict):
        metrics[name] = tensor
    else:
        trainer.callback_metrics[name] = tensor


def checkpoints_monitoring(trainer: pl.Trainer, key: str) -> tuple[tuple[int, ...], list[Any]]:
    r"""For the ``ModelCheckpoint``\ s of ``trainer`` that monitor ``key``: the ``every_n_train_steps`` of
    those that save at training steps (checked at a batch's end: ``global_step % n == 0``), and the
    ``train_time_interval`` of those that save at times rank 0's clock picks. Lightning 2.x keeps both
    private (``_every_n_train_steps``, ``_train_time_interval``)."""
    every, timed = [], []
    for callback in trainer.checkpoint_callbacks:
        if getattr(callback, "monitor", None) != key:
            continue
        if (steps := getattr(callback, "_every_n_train_steps", 0) or 0) >= 1:
            every.append(int(steps))
        if (interval := getattr(callback, "_train_time_interval", None)) is not None:
            timed.append(interval)
    return tuple(sorted(set(every))), timed


# ---------------------------------------------------------------------------- HardSampleReplay (sweep 41)
def training_key_monitors(trainer: pl.Trainer) -> list[tuple[str, str]]:
    """``(the monitor, its key)`` for each EarlyStopping, ModelCheckpoint and ``ReduceLROnPlateau``
    scheduler config (``lr_scheduler={"monitor": ...}``) of ``trainer`` whose key was logged in the training
    loop (``self.log`` in ``training_step`` or a training hook, as ``name``, ``name_step`` or
    ``name_epoch``), not in validation. Reads the training loop's result collection, which Lightning 2.x keeps
    private (``fit_loop.epoch_loop._results``), so call it once the keys are logged (an epoch's end)."""
    results = getattr(trainer.fit_loop.epoch_loop, "_results", None)
    logged: set[str] = set()
    for result in (results or {}).values():
        meta = getattr(result, "meta", None)
        if meta is not None:
            logged.update((meta.name, meta.forked_name(True), meta.forked_name(False)))
    return [(monitor, key) for monitor, key in key_monitors(trainer) if key in logged]


def key_monitors(trainer: pl.Trainer) -> list[tuple[str, str]]:
    """``(the monitor, its key)`` for each EarlyStopping, ModelCheckpoint and ``ReduceLROnPlateau``
    scheduler config (``lr_scheduler={"monitor": ...}``) of ``trainer``: what reads a key of
    ``trainer.callback_metrics``. The schedulers' configs exist from ``on_fit_start`` on (the strategy's
    setup makes them)."""
    from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

    monitors = [
        (f"{type(callback).__name__}(monitor={callback.monitor!r})", callback.monitor)
        for callback in trainer.callbacks
        if isinstance(callback, (EarlyStopping, ModelCheckpoint)) and callback.monitor is not None
    ]
    for config in trainer.lr_scheduler_configs:
        if config.reduce_on_plateau and config.monitor is not None:
            monitors.append((_plateau_monitor(config), config.monitor))
    return monitors


def _plateau_monitor(config: Any) -> str:
    """How :func:`training_key_monitors` names a ``ReduceLROnPlateau`` scheduler config."""
    return f"{type(config.scheduler).__name__} (lr_scheduler config monitor={config.monitor!r})"


def _compiled_submodules(
    module: torch.nn.Module | None, in_place: bool = True
) -> Iterator[tuple[str, torch.nn.Module]]:
    """``(name, compiled part)`` of every part of ``module`` under ``torch.compile`` (the name ``""`` for
    ``module`` itself): a ``torch.compile(part)`` wrapper (``OptimizedModule``), or a part compiled in place
    with ``part.compile()``, which keeps the compiled call on the instance as the private
    ``_compiled_call_impl`` (no wrapper to find: GradientCache and HardSampleReplay used to miss it and train
    unrefused, or crash); ``in_place=False`` leaves those out."""
    from torch._dynamo.eval_frame import OptimizedModule

    for name, submodule in module.named_modules() if module is not None else ():
        if isinstance(submodule, OptimizedModule) or (in_place and _compiled_in_place(submodule) is not None):
            yield name, submodule


def _compiled_in_place(part: torch.nn.Module) -> Callable[..., Any] | None:
    """The compiled call that ``part.compile()`` set on ``part`` (what ``part(...)`` runs), else ``None``."""
    return part.__dict__.get("_compiled_call_impl")


def _in_place_dynamo_ctx(compiled_call: Callable[..., Any]) -> Any:
    """The dynamo context of a call compiled in place (``torch.compile(part._call_impl, **kwargs)``, which
    ``Module.compile`` stores without its arguments): the function dynamo returns keeps it only in its
    closure, as ``self``. ``None`` where this torch keeps it elsewhere."""
    code = getattr(compiled_call, "__code__", None)
    for name, cell in zip(code.co_freevars if code is not None else (), compiled_call.__closure__ or ()):
        if name == "self":
            try:
                return cell.cell_contents
            except ValueError:  # an empty cell
                return None
    return None


def _fullgraph(dynamo_ctx: Any) -> bool:
    """Whether a dynamo context (the private ``dynamo_ctx`` of a compiled module) makes a graph break an error."""
    return dynamo_ctx is not None and bool(
        getattr(dynamo_ctx, "fullgraph", False) or getattr(dynamo_ctx, "error_on_graph_break", False)
    )


def fullgraph_compiled_step(module: torch.nn.Module | None) -> str | None:
    """``"the LightningModule"`` when its ``training_step`` runs under ``torch.compile(..., fullgraph=True)``
    (Lightning unwrapped ``trainer.fit(torch.compile(model, fullgraph=True))`` and compiles its steps), else
    ``None``. Reads Lightning's private ``_compiler_ctx``."""
    context = getattr(module, "_compiler_ctx", None)
    return (
        "the LightningModule" if isinstance(context, dict) and _fullgraph(context.get("dynamo_ctx")) else None
    )


class FullgraphBreaks:
    """Hands dynamo's graph-break errors in the parts compiled with ``fullgraph=True`` to a handler, between
    :meth:`watch` and :meth:`release`, by wrapping the compiled call each keeps on its instance: the
    ``forward`` of a ``torch.compile(part)`` wrapper, the ``_compiled_call_impl`` of a part compiled in place
    with ``part.compile()`` (a part without one is left alone). Picklable while released."""

    def __init__(self) -> None:
        self._wrapped: list[tuple[torch.nn.Module, str, Callable[..., Any], Callable[..., Any]]] = []

    def watch(self, module: torch.nn.Module | None, handler: Callable[[str, str], None]) -> None:
        """Call ``handler(name, message)`` for such an error in a part of ``module`` (``name``, the part's
        name; ``message``, the error's text) inside its ``except`` block: what it raises replaces the error
        (which stays chained as its context); if it returns, the error goes on."""
        from torch._dynamo.exc import Unsupported

        def watching(name: str, call: Callable[..., Any]) -> Callable[..., Any]:
            @functools.wraps(call)
            def call_handing_graph_breaks(*args: Any, **kwargs: Any) -> Any:
                try:
                    return call(*args, **kwargs)
                except Unsupported as error:
                    handler(name or "the LightningModule", str(error))
                    raise

            return call_handing_graph_breaks

        self.release()
        for name, part in _compiled_submodules(module):
            if (call := _compiled_in_place(part)) is not None:
                attribute, context = "_compiled_call_impl", _in_place_dynamo_ctx(call)
            else:
                attribute, call, context = (
                    "forward",
                    part.__dict__.get("forward"),
                    getattr(part, "dynamo_ctx", None),
                )
            # a context this torch hides is watched too: the handler acts only on a captured loss's graph
            # break, which is an error (rather than a fallback to eager) only under fullgraph
            if call is not None and (context is None or _fullgraph(context)):
                setattr(part, attribute, watching(name, call))
                self._wrapped.append((part, attribute, getattr(part, attribute), call))

    def release(self) -> None:
        """Give every watched part its own compiled call back (unless something replaced ours since)."""
        for part, attribute, ours, call in self._wrapped:
            if part.__dict__.get(attribute) is ours:
                setattr(part, attribute, call)
        self._wrapped.clear()


def compiled_parts(module: torch.nn.Module | None) -> list[str]:
    """The names of every part of ``module`` that runs under ``torch.compile``: compiled submodules, and ``""``
    for ``module`` itself (compiled, or a LightningModule that Lightning unwrapped from
    ``trainer.fit(torch.compile(model))``). Not the parts compiled in place with ``part.compile()``:
    structured pruning, which reads this, cuts such a part (its wrapper-free call recompiles on the swapped
    layers)."""
    names = [name for name, _ in _compiled_submodules(module, in_place=False)]
    if getattr(module, "_compiler_ctx", None) is not None and "" not in names:
        names.insert(0, "")
    return names


def compiled_part(module: torch.nn.Module | None, trainable: bool = False) -> str | None:
    """What of ``module`` runs under ``torch.compile``: the name of a compiled submodule
    (``self.model = torch.compile(...)`` or ``self.model.compile()``), ``"the LightningModule"`` when
    Lightning unwrapped a compiled one (``trainer.fit(torch.compile(model))``) or it was compiled in place
    (``model.compile()``), else ``None``. ``trainable``: only a part holding a parameter that requires grad
    (not a compiled loss module, nor a frozen teacher)."""

    def counts(part: torch.nn.Module) -> bool:
        return not trainable or any(parameter.requires_grad for parameter in part.parameters())

    if module is not None and getattr(module, "_compiler_ctx", None) is not None and counts(module):
        return "the LightningModule"
    name = next((name for name, part in _compiled_submodules(module) if counts(part)), None)
    return None if name is None else name or "the LightningModule"


def compiled_trainable_part(module: torch.nn.Module | None) -> str | None:
    """:func:`compiled_part` holding a parameter that requires grad: the only kind whose compiled backward hands
    out gradients (of parameters a freezer would order) in its own order."""
    return compiled_part(module, trainable=True)


def compiled_part_holding(module: torch.nn.Module | None, submodules: list[torch.nn.Module]) -> str | None:
    """The name of a part of ``module`` under ``torch.compile`` that runs one of ``submodules`` (a compiled
    submodule holding it, one compiled in place with ``Module.compile()``, or ``"the LightningModule"`` that
    Lightning unwrapped from ``trainer.fit(torch.compile(model))``), else ``None``. Reads the private
    ``_compiler_ctx`` and ``_compiled_call_impl``."""
    if getattr(module, "_compiler_ctx", None) is not None:
        return "the LightningModule"
    wanted = {id(submodule) for submodule in submodules}
    for name, part in _compiled_submodules(module):
        if any(id(inner) in wanted for inner in part.modules()):
            return name or "the LightningModule"
    return None


def batches_fetched(trainer: pl.Trainer) -> int:
    """The training batches this fit's loop has fetched so far, all epochs (its batch progress: ``ready``)."""
    return int(trainer.fit_loop.epoch_loop.batch_progress.total.ready)


def batch_in_flight(trainer: pl.Trainer, fetched: int) -> bool:
    """Whether the batch fetched as the ``fetched``-th (:func:`batches_fetched`) is still in flight: fetched
    but not processed (an exception inside ``training_step`` saved by ``OnExceptionCheckpoint``), so
    Lightning's resume starts at it. Within ``on_train_batch_end`` the batch counts as processed."""
    progress = trainer.fit_loop.epoch_loop.batch_progress
    # the same batch (total.ready only grows within a fit); current's counts are reset on a restart
    return progress.total.ready == fetched and progress.current.processed < progress.current.ready


def batches_skipped(trainer: pl.Trainer) -> int:
    """The training batches this fit's loop skipped so far, all epochs: those the LightningModule's
    ``on_train_batch_start`` returned -1 for (each ended its epoch), which Lightning counts processed and
    never started. Read between batches or at a batch's start hooks (then the batch is neither)."""
    progress = trainer.fit_loop.epoch_loop.batch_progress.total
    return max(0, int(progress.processed) - int(progress.started))


def batch_skipped(trainer: pl.Trainer, fetched: int) -> bool:
    """Whether the batch fetched as the ``fetched``-th (:func:`batches_fetched`) did not train because the
    LightningModule's ``on_train_batch_start`` returned -1 for it: Lightning then counts it ready and
    processed but never started, and ends the epoch (it is the epoch's last fetched batch). Call it after the
    batch's start hooks (at the epoch's end): inside them, every batch is not started yet."""
    progress = trainer.fit_loop.epoch_loop.batch_progress
    return progress.total.ready == fetched and progress.current.started < progress.current.ready


def processed_batch_counts(trainer: pl.Trainer) -> tuple[float, int] | None:
    """``(the epoch's batches, accumulate_grad_batches)`` when the training batch fetched last has run its
    step through: Lightning counts it ``processed`` (after the update, before any ``on_train_batch_end``), and
    a checkpoint saved now resumes after it; ``None`` otherwise."""
    progress = trainer.fit_loop.epoch_loop.batch_progress
    current = progress.current  # `started` too: a batch whose on_train_batch_start returned -1 never ran
    if current.ready > 0 and current.started == current.processed == current.ready:
        return trainer.num_training_batches, trainer.accumulate_grad_batches
    return None


def in_unfinished_step(trainer: pl.Trainer) -> bool:
    """Whether a checkpoint saved now is saved inside a training step that a resume from it trains again: the
    training batch fetched last is counted ``ready`` and not ``processed`` (Lightning counts it processed
    once its optimizer step has run through, before any ``on_train_batch_end``). A resume restarts at the
    batches completed (``reset_on_restart``), so it trains that batch again from the weights before its
    update: a save from its ``on_train_batch_start`` to its ``optimizer.step`` (SLURM's requeue signal,
    handled wherever the main thread is; ``OnExceptionCheckpoint`` after an exception there). Inside the
    optimizer step the optimizer loop's counters (``optim_progress.optimizer.step``: ready, not completed)
    agree; the batch's cover the rest of it and manual optimization. A callback that books the step before
    its update saves, then, the state before that booking."""
    progress = trainer.fit_loop.epoch_loop.batch_progress.current
    return progress.processed < progress.ready


class UnfinishedStepWatch:
    """:func:`in_unfinished_step` for a callback that keeps no Trainer: :meth:`watch` at train start holds the
    fit's Trainer weakly (also past an exception, where ``OnExceptionCheckpoint`` saves), calling it asks."""

    def __init__(self) -> None:
        self._trainer: weakref.ReferenceType[pl.Trainer] | None = None

    def watch(self, trainer: pl.Trainer) -> None:
        self._trainer = weakref.ref(trainer)

    def __call__(self) -> bool:
        trainer = None if self._trainer is None else self._trainer()
        return trainer is not None and in_unfinished_step(trainer)

    def __getstate__(self) -> dict[str, Any]:  # pickled by ddp_spawn: no Trainer
        return {"_trainer": None}


def backward_loss_divisor(trainer: pl.Trainer, pl_module: pl.LightningModule) -> float | torch.Tensor:
    """What the loss a module's step returned was divided by to become the loss ``on_before_backward`` gets:
    ``accumulate_grad_batches`` under automatic optimization, over the GradScaler's scale under ``16-mixed``
    (Lightning scales the loss before it calls that hook). The scale is a copy of the scaler's tensor, read
    without a host sync; ``update()`` changes the scaler's in place after the step."""
    divided_by: float | torch.Tensor = (
        trainer.accumulate_grad_batches if pl_module.automatic_optimization else 1
    )
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    scale = getattr(scaler, "_scale", None)  # private to torch's GradScaler; None until its first scale()
    if scaler is not None and scaler.is_enabled() and isinstance(scale, torch.Tensor):
        divided_by = divided_by / scale.detach().clone()
    return divided_by


def loss_scale(trainer: pl.Trainer) -> Callable[[], torch.Tensor | None] | None:
    """A reader of the factor the run's GradScaler multiplies the loss by before its backward (``16-mixed``:
    the precision plugin's ``pre_backward`` scales the loss, ``unscale_`` divides every gradient by it before
    the step), or ``None`` where the run has no enabled scaler. Call it at backward time: the scaler makes its
    scale tensor at its first ``scale()``, and ``update()`` changes it in place after a step. It gives the
    scaler's own tensor (no copy, no host sync), or ``None`` before the first ``scale()``."""
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    if scaler is None or not scaler.is_enabled():
        return None
    return functools.partial(_scale_of, scaler)


def _scale_of(scaler: Any) -> torch.Tensor | None:
    scale = getattr(scaler, "_scale", None)  # private to torch's GradScaler; None until its first scale()
    return scale if isinstance(scale, torch.Tensor) else None


# ---------------------------------------------------------------------- HardSampleReplay added on a resume
def restored_position(trainer: pl.Trainer, epoch_batches: int) -> tuple[int, int]:
    """``(epoch, batches of it trained)`` where a fit goes on from the loops' restored progress (inside the
    data set-up): an epoch whose training ended (its ``epoch_batches`` trained, or its end hooks ran, as
    ``ModelCheckpoint(save_last=True)`` saves) gives the next epoch and no batch."""
    epochs = trainer.fit_loop.epoch_progress.current
    if epochs.processed > epochs.completed:  # saved in or after the epoch's end hooks
        return trainer.current_epoch + 1, 0
    if epochs.ready == epochs.completed:  # no epoch under way (a second fit of the Trainer): the batch
        return trainer.current_epoch, 0  # progress still holds the last epoch's count
    trained = int(trainer.fit_loop.epoch_loop.batch_progress.current.processed)
    return (trainer.current_epoch + 1, 0) if trained >= epoch_batches else (trainer.current_epoch, trained)


def restored_at_epoch_start(trainer: pl.Trainer) -> bool:
    """Whether a fit goes on at an epoch's start by the loops' restored epoch progress alone: saved in or after
    an epoch's end hooks, or with no epoch under way. Unlike :func:`restored_position` it reads no batch
    count, which a checkpoint of another number of processes (other epoch lengths) counts otherwise.

    Under ``max_steps`` (iteration-based training) Lightning keeps its fit loop restarting even from an epoch's
    end hooks (``FitLoop.restarting``), leaves the epoch open (``on_run_start`` syncs no ``completed``) and
    goes on in it by the restored batch count against this fit's batches: not an epoch start then."""
    epochs = trainer.fit_loop.epoch_progress.current
    if epochs.ready == epochs.completed:
        return True
    return epochs.processed > epochs.completed and not trainer.fit_loop.restarting


def samples_per_step(trainer: pl.Trainer, batch: Any = None, accumulation: int | None = None) -> int | None:
    """The samples one optimizer step trains, as the run is set up (at train start, after the data set-up):
    the training DataLoaders' ``batch_size`` (summed over several; a batch sampler's where the DataLoader has
    none) x ``accumulate_grad_batches`` x processes. A setting, not a count: an epoch's short last batch or a
    cut batch does not change it. Where the one training DataLoader states no batch size (a user's bucketing
    batch sampler, an iterable dataset that batches itself): read from ``batch``, the fit's first micro-batch
    (Lightning's ``extract_batch_size``; summed over the processes, one all-gather, so that every rank reads
    the same number), where given; else ``None``, as where it cannot be read (several DataLoaders of which
    one states no size, a batch without a tensor). ``accumulation``: the one read at train start (where given),
    so that both reads agree under a ``GradientAccumulationScheduler``, which sets its own at epoch start."""
    from lightning.pytorch.utilities import CombinedLoader

    loaders = trainer.train_dataloader
    if loaders is None:
        return None
    total = 0
    flattened = (loaders if isinstance(loaders, CombinedLoader) else CombinedLoader(loaders)).flattened
    for loader in flattened:
        size = getattr(loader, "batch_size", None)
        if not isinstance(size, int):
            size = getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            if batch is None or len(flattened) != 1:
                return None
            return _samples_of_first_batch(trainer, batch, accumulation)
        total += size
    windows = max(1, int(trainer.accumulate_grad_batches if accumulation is None else accumulation))
    return total * windows * trainer.world_size if total else None


def samples_reader(trainer: pl.Trainer) -> Callable[[Any], int | None]:
    """:func:`samples_per_step` of ``trainer`` given a batch (``None``: as the run is set up), at the
    accumulation of train start (a review: a scheduler's later one read a resume that changed nothing as one
    at another number of samples, and dropped the baselines)."""
    return functools.partial(samples_per_step, trainer, accumulation=int(trainer.accumulate_grad_batches))


def _samples_of_first_batch(trainer: pl.Trainer, batch: Any, accumulation: int | None = None) -> int | None:
    """:func:`samples_per_step` read from the fit's first micro-batch: its size x accumulation, summed over
    the processes (``None`` where a rank could not read it)."""
    from lightning.pytorch.utilities.data import extract_batch_size

    try:
        # silenced: its advice to pass `self.log(..., batch_size=)` is for the module's logs, not this read
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            size = int(extract_batch_size(batch))
    except Exception:  # no tensor in it (MisconfigurationException), or a batch class of its own
        size = 0
    if trainer.world_size > 1:  # every rank reaches its first step: the same number on each
        sizes = trainer.strategy.all_gather(torch.tensor(size, device=trainer.strategy.root_device))
        size = 0 if int(sizes.min()) < 1 else int(sizes.sum())
    windows = trainer.accumulate_grad_batches if accumulation is None else accumulation
    return size * max(1, int(windows)) if size > 0 else None


class PulseStateKey:
    """Keys a lightning-pulse callback's checkpoint state by its lightning-pulse class's name
    (:func:`~lightning_pulse.errors.pulse_class`); listed before ``Callback`` in the bases of each stateful
    one.

    Lightning's default key is the instance's class name, so a user's subclass saved and loaded under its own
    name: a checkpoint of ``PulseCycle`` resumed into ``class MyCycle(PulseCycle)`` (or back) dropped every
    state without a word (a structured ScheduledPrune cut the already cut model again), and a PulseCycle
    beside a subclass of it ran two clocks. With one key, the state resumes across them and the pair is
    refused (by Lightning for ``Trainer(callbacks=...)``, by ``errors.refuse_shared_key`` at fit start).
    Checkpoints saved by the lightning-pulse classes themselves keep their keys; one a subclass saved under
    its own name before is still found: Lightning loads ``_legacy_state_key`` where ``state_key`` is missing.
    """

    @property
    def state_key(self) -> str:
        return pulse_class(self).__qualname__

    @property
    def _legacy_state_key(self) -> str:  # Lightning's fallback key at a load: the subclass's own old key
        return type(self).__qualname__


def saved_state(states: Mapping[str, Any], callback: PulseStateKey) -> Any:
    """``callback``'s entry in a checkpoint's ``callbacks`` (``states``), found as Lightning's load finds it:
    under its ``state_key``, else under the key a subclass saved under before (:class:`PulseStateKey`)."""
    return states.get(callback.state_key, states.get(callback._legacy_state_key))
