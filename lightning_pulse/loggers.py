"""How every pulse callback logs: straight to the Trainer's loggers, on rank 0.

``pl_module.log`` is not allowed in every hook the callbacks run in, it re-emits the last value at every step
in between (what Lightning's ``LearningRateMonitor`` avoids the same way), and per step it costs more than
most of the callbacks' own work.

A logger that fails (a tracking server out of reach, a store that refuses a name) never fails the run: the
project's rule is that measurement never kills training. Its failure is said once per logger, and the other
loggers still get the figures.

The folder of a run's own files (EnergyLogger's and GreenWindow's reports) is the first logger's run's too:
Lightning's ``trainer.log_dir`` is a run's own folder only for TensorBoardLogger and CSVLogger
(``save_dir/name/version``). For any other first logger (MLflow, W&B, Comet, one's own) it is the logger's
``save_dir``: the root of a store that every run shares (``./mlruns``), where each run's report would replace
the one before it (:func:`run_folder`).
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Collection, Mapping
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_warn

from lightning_pulse import _lightning_compat as compat
from lightning_pulse.errors import PulseRefusal, uncreatable_dir_reason

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


def refuse_logger_only_monitors(
    trainer: pl.Trainer, owner: str, namespace: str, published: Collection[str] = ()
) -> None:
    """At fit start (``on_fit_start`` or ``on_train_start``): refuse an EarlyStopping, a ModelCheckpoint or a
    ``ReduceLROnPlateau`` scheduler config (``compat.key_monitors``) that monitors a key under ``namespace``,
    where ``owner`` logs its own figures, to the loggers only (:func:`log_to_loggers`): such a key never
    reaches ``trainer.callback_metrics``, where monitors read. The fit trained up to the first check, then
    stopped with Lightning's "could not find the monitored key ... Did you call `log(...)` in the
    `LightningModule`?" (or "Early stopping conditioned on metric ... not available"), blaming the module for
    a key the user saw in TensorBoard. ``published``: the keys under ``namespace`` that ``owner`` does put in
    ``callback_metrics`` (EnergyLogger's ``energy/total_kwh``); they stay allowed.

    Raises:
        PulseRefusal: naming ``owner``, the monitor, the key, and the way out.
    """
    for monitor, key in compat.key_monitors(trainer):
        if isinstance(key, str) and key.startswith(namespace) and key not in published:
            but = "".join(f" but `{name}`" for name in published)
            allowed = "".join(f" or `{name}`, which {owner} puts there for monitors" for name in published)
            raise PulseRefusal(
                f"{owner}: {monitor} reads a figure that {owner} sends to the loggers only (as every key "
                f"under `{namespace}`{but}): it never reaches `trainer.callback_metrics`, where monitors "
                "read, so the fit would stop at the first check, after training up to it, with Lightning's "
                "'could not find the monitored key'. Way out: monitor a metric your LightningModule logs "
                f"with `self.log`, e.g. `val_loss` in `validation_step`{allowed}; a key your module logs "
                f"itself under `{namespace}` is refused too: log it under another name."
            )


def _drop_figures(trainer: pl.Trainer, logger: Logger, error: Exception) -> None:
    """Say, once per ``logger`` of ``trainer``, that its ``log_metrics`` raised ``error`` and that
    lightning-pulse's figures to it are being dropped (each later call is still tried: a server may come
    back)."""
    said = _FAILURES_SAID.setdefault(trainer, set())
    if id(logger) in said:
        return
    said.add(id(logger))
    reason = str(error).strip().splitlines()[0] if str(error).strip() else "no message"  # one line: the first
    rank_zero_warn(
        f"lightning-pulse: {type(logger).__name__}.log_metrics failed ({type(error).__name__}: {reason}); "
        "lightning-pulse's figures to this logger are being dropped while it fails (said once), the run and "
        "the other loggers go on. Lightning's own logging to it is not guarded: fix the logger or remove it."
    )


def run_folder(trainer: pl.Trainer, report_dir: str | os.PathLike | None = None) -> str:
    """``report_dir`` where given, else the folder of this run's files: the Trainer's ``log_dir`` for
    TensorBoard and CSV loggers (and ``default_root_dir`` without a logger), else
    ``<save_dir>/<name>/<version>`` of the first logger, as ModelCheckpoint builds its own (MLflow: the
    experiment id and the run id), so a report sits next to the run's checkpoints. A logger with no version
    (``None``) names no run: its ``save_dir``, as ``trainer.log_dir``.

    Without ``report_dir`` a collective under DDP, as ``trainer.log_dir`` is (a broadcast of rank 0's folder:
    the other ranks' loggers hold no run), so call it on every rank."""
    if report_dir is not None:
        return os.fspath(report_dir)
    loggers = trainer.loggers
    if not loggers or isinstance(loggers[0], (TensorBoardLogger, CSVLogger)):
        return trainer.log_dir or trainer.default_root_dir
    folder = _own_folder(loggers[0], trainer.default_root_dir) if trainer.is_global_zero else None
    return trainer.strategy.broadcast(folder)


def refuse_unwritable_run_folder(trainer: pl.Trainer, callback: str, field: str) -> None:
    """Raise :class:`~lightning_pulse.errors.PulseRefusal` at fit start where ``callback``'s report, written
    at the end into the run's own folder (:func:`run_folder`: ``field`` is not given), could not be written
    there: a read-only working directory as ``default_root_dir``, a ``save_dir`` under a file. The folder is
    not created: a logger creates its own later, and numbers its version by the folders it finds; the first
    folder above it that exists must take a new one. Rank 0 decides (the only rank that writes), every rank
    refuses (a broadcast). Nothing under ``fast_dev_run``, which writes no report."""
    if trainer.fast_dev_run:
        return
    folder = run_folder(trainer)  # a collective under DDP: every rank
    reason = uncreatable_dir_reason(folder) if trainer.is_global_zero else None
    if trainer.world_size > 1:
        reason = trainer.strategy.broadcast(reason)
    if reason is not None:
        whose = (
            "the logger a writable `save_dir`"
            if trainer.loggers
            else "the Trainer a writable `default_root_dir`"
        )
        raise PulseRefusal(
            f"{callback}: the run's own folder {folder!r}, where the report goes without `{field}`, cannot "
            f"hold the report ({reason}); give `{field}` a writable folder (or {whose})."
        )


def _own_folder(logger: Any, default_root_dir: str) -> str:
    root = logger.save_dir or default_root_dir  # a remote store (MLflow over http) keeps no local files
    name_and_version = _name_and_version(logger)
    if name_and_version is None:
        return root
    return os.path.join(root, *name_and_version)  # ModelCheckpoint's folder, less its `checkpoints`


def _name_and_version(logger: Any) -> tuple[str, str] | None:
    """The logger's name and version as ModelCheckpoint names its folder (``version_N`` for an int), or
    ``None`` where it has no version or reading one raises (a report is no reason to fail a run: its
    ``save_dir`` then, as before the run's own folder)."""
    try:
        name, version = logger.name, logger.version
    except Exception:
        return None
    if version is None:
        return None
    return str(name), version if isinstance(version, str) else f"version_{version}"


def logger_run(trainer: pl.Trainer) -> str | None:
    """The run's name in its first logger (``<name>/<version>``), recorded in its reports so that a report
    about to replace another run's can tell: ``None`` without a logger, with a logger of no version (or one
    whose version cannot be read), and on the ranks other than 0 (which write no report, and whose loggers
    hold no run)."""
    if not trainer.loggers or not trainer.is_global_zero:
        return None
    name_and_version = _name_and_version(trainer.loggers[0])  # as its folder (`version=0` is `version_0`)
    return None if name_and_version is None else "/".join(name_and_version)
