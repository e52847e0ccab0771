"""A replay run's training data, without a trainer: its DataLoader's index tracker and its samples' selector,
from one set-up of the DataLoader to the next and from fit to fit.

:class:`ReplayData` is what :class:`~lightning_pulse.HardSampleReplay` keeps of the data. At each set-up of
the training DataLoader, :meth:`~ReplayData.loader_refusal` says whether it can be tracked and
:meth:`~ReplayData.attach` tracks its dataset indices and gives its samples a selector: the previous one
while they stay, with the scores a checkpoint restored before any data existed.
:meth:`~ReplayData.start_training` sets the scores' ageing and the selector's cadence once the epoch's length
is known; the state (:meth:`~ReplayData.state_dict`) carries the scores from run to run.

Example::

    data = ReplayData(ReplayConfig(replay_fraction=0.5), parse_half_life(2.0))
    assert data.loader_refusal(loader, at=(0, 0)) is None   # at: (epoch, step) of the set-up
    data.attach(loader, at=(0, 0))                          # a RecordingSampler goes into loader
    assert data.start_refusal(loader, mode="batch") is None
    data.start_training(steps_per_epoch=len(loader), log_every=50, planned_steps=10 * len(loader))
    for batch_idx, batch in enumerate(loader):
        indices = data.tracker.batch_indices(batch_idx)     # (B,) dataset indices of the batch
        ...                                                 # plan, train and record with data.selector
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor

from lightning_pulse.core.replay import (
    HardSampleSelector,
    ReplayConfig,
    epoch_half_life_note,
    loader_refusal,
    reloaded_data_note,
    several_loaders_refusal,
    shorter_than_an_epoch,
    training_monitor_note,
    uncut_batches_refusal,
)
from lightning_pulse.core.sample_index import SampleIndexTracker
from lightning_pulse.core.sample_scores import SampleScoreTable
from lightning_pulse.core.step_plan import epoch_steps, loader_epoch_steps
from lightning_pulse.phase import Duration


def _say_nothing(note: str | None) -> None:
    pass


class ReplayData:
    """A replay run's training data: its DataLoader's index tracker and its samples' selector.

    Args:
        config: the selection rule and its parameters, each new selector's.
        half_life: ``score_half_life``, parsed (:func:`~lightning_pulse.core.replay.parse_half_life`);
            ``None`` turns age weighting off.

    Attributes:
        selector: the selector of the latest data (``None`` before the first DataLoader).
        loader: the DataLoader tracked in this fit (``None`` before it, and after :meth:`detach`).
        tracker: its index tracker (``None`` before it, and after :meth:`detach`).
        ready: a selector exists for this fit's data, so :meth:`load_state_dict` applies at once.
    """

    def __init__(self, config: ReplayConfig, half_life: Duration | None = None) -> None:
        self.config = config
        self.half_life = half_life
        self.selector: HardSampleSelector | None = None
        self.loader: Any = None
        self.tracker: SampleIndexTracker | None = None
        self.ready = False
        # a checkpoint's scores loaded before any data, until a DataLoader sizes the table
        self._restored: dict[str, Any] | None = None
        self._set_up_at = (0, 0)  # (epoch, step) of the latest DataLoader's set-up
        self._monitors_due = False  # monitor_note's once a fit: from start_training to the first epoch end

    # ------------------------------------------------------------------ the data
    def loader_refusal(
        self, loader: Any, at: tuple[int, int], all_gather: Callable[[Tensor], Tensor] | None = None
    ) -> str | None:
        """Why ``loader``, handed over at a data set-up at ``at`` (epoch, step), is refused (completes
        "HardSampleReplay ..."), else ``None``: see :func:`~lightning_pulse.core.replay.loader_refusal`. A
        loader other than the one tracked, at the set-up this fit's data came at, is a second one of that
        set-up (a CombinedLoader)."""
        second = self.ready and at == self._set_up_at and loader is not self.loader
        return loader_refusal(loader, second, all_gather)

    def attach(
        self,
        loader: Any,
        at: tuple[int, int],
        accumulate: int = 1,
        new_table: Callable[[int], SampleScoreTable] = SampleScoreTable,
        warn: Callable[[str | None], None] = _say_nothing,
        batches: float | None = None,
    ) -> None:
        """Track ``loader``'s dataset indices (its set-up at ``at``, epoch and step) and give its samples a
        selector: the previous one while they are the same samples, else one on ``new_table(num_samples)``,
        into which a checkpoint's scores restored before any data go. ``warn`` gets what to say of a reloaded
        dataset (:func:`~lightning_pulse.core.replay.reloaded_data_note`), before anything is installed; the
        scores age by epochs of ``batches`` batches (``None``: a pass over ``loader``; a Trainer's
        ``limit_train_batches`` makes it fewer) at ``accumulate`` batches a step.

        Raises:
            PulseRefusal: for restored scores of a dataset of another size.
            ValueError: for a half-life in epochs with a DataLoader without a length.
        """
        note, fresh = reloaded_data_note(self.tracker.dataset if self.ready else None, loader.dataset)
        warn(note)
        self.loader, self.tracker, self._set_up_at = loader, SampleIndexTracker.install(loader), at
        restored, self._restored = self._restored, None
        current, size = None if fresh else self.selector, self.tracker.dataset_size  # fresh: a new table
        self.selector = HardSampleSelector.for_data(current, size, new_table, self.config, restored)
        steps = (
            loader_epoch_steps(loader, accumulate) if batches is None else epoch_steps(batches, accumulate)
        )
        self.selector.set_half_life(self.half_life, steps)
        self.ready = True

    def loader_state_restored(self, mode: str) -> str:
        """What a resume does with the training DataLoader's own state (one with ``state_dict``, as
        torchdata's ``StatefulDataLoader``; Lightning saves it mid-epoch): it is not loaded. Loaded, the
        loader would skip the batches drawn before the checkpoint by drawing them, which the steps mode's plan
        skips too (11 steps resumed for 17) and which the batch mode's tracker cannot tell from a prefetching
        worker's draws (a review: indices of other batches, or a crash, with DataLoader workers)."""
        rest = (
            "the replay's own checkpointed plan resumes the pass where the checkpoint was saved"
            if mode == "steps"
            else "the interrupted pass starts over, as a plain DataLoader's does on a mid-epoch resume"
        )
        return (
            "the checkpoint holds the training DataLoader's own state; it is not loaded, so what else it "
            f"holds (a shuffle generator's state, a stateful dataset's) is not restored: {rest}. "
            "To reproduce a shuffled order, seed the sampler per epoch (set_epoch), or resume from a "
            "checkpoint saved at an epoch's end."
        )

    def detach(self) -> None:
        """The fit is over: its DataLoader is no longer tracked (the selector and its scores stay)."""
        self.loader, self.tracker, self.ready = None, None, False

    # ------------------------------------------------------------------ training
    def start_refusal(self, loaders: Any, mode: str) -> str | None:
        """Why training cannot start (completes "HardSampleReplay ..."), else ``None``: ``loaders``, the fit's
        training DataLoaders, are several (:meth:`SampleIndexTracker.several_loaders_reason`), or ``mode``
        ``"batch"`` cannot cut batches of the tracked size
        (:func:`~lightning_pulse.core.replay.uncut_batches_refusal`)."""
        refusal = several_loaders_refusal(SampleIndexTracker.several_loaders_reason(loaders))
        if refusal is not None:
            return refusal
        assert self.selector is not None and self.tracker is not None
        return uncut_batches_refusal(mode, self.config, self.tracker.batch_size)

    def start_training(
        self,
        steps_per_epoch: int | None,
        log_every: int,
        planned_steps: float,
        mode: str = "batch",
        optimizers: int = 0,
        warn: Callable[[str | None], None] = _say_nothing,
    ) -> None:
        """Training starts with epochs of ``steps_per_epoch`` optimizer steps (``None``: unknown) and a
        metrics window every ``log_every`` applied steps: the scores age by that epoch and the selector's
        cadence follows it (:meth:`HardSampleSelector.set_cadence`). ``warn`` gets what to say of a half-life
        in epochs when the module steps its ``optimizers`` itself (manual optimization, several per batch;
        ``0``: it does not), then of a run of ``planned_steps`` optimizer steps shorter than an epoch.

        Raises:
            ValueError: for a half-life in epochs when the epoch's length is unknown.
        """
        assert self.selector is not None
        self.selector.set_half_life(self.half_life, steps_per_epoch)
        if optimizers:
            warn(epoch_half_life_note(self.half_life, steps_per_epoch, optimizers))
        warn(shorter_than_an_epoch(planned_steps, steps_per_epoch, mode))
        self.selector.set_cadence(steps_per_epoch, log_every)
        self._monitors_due = True

    def monitor_note(
        self, monitors: Callable[[], Sequence[tuple[str, str]]], phases: Sequence[str]
    ) -> str | None:
        """Once a fit (its first epoch end, where the keys the training loop logs are known): what to say of
        ``monitors()``, the ``(monitor, key)`` pairs whose key the training loop logged
        (:func:`~lightning_pulse.core.replay.training_monitor_note`); ``monitors`` is not called for a rule
        that leaves the training loss the loaded data's."""
        if not self._monitors_due:
            return None
        self._monitors_due = False
        return training_monitor_note(self.config.rule, monitors, phases)

    def epoch_length(self, steps_per_epoch: int | None) -> None:
        """The epoch starting is ``steps_per_epoch`` optimizer steps (a ``GradientAccumulationScheduler``
        changed the accumulation): from now on the scores age by epochs of that length and the threshold is
        refreshed twice in it, as :meth:`start_training` set them; the metrics window goes on."""
        assert self.selector is not None
        self.selector.set_half_life(self.half_life, steps_per_epoch)
        self.selector.set_threshold_every(steps_per_epoch)

    def choose(
        self, windows: list[list[int]], ordinals: list[int], steps: list[int], prior: float, rank: int = 0
    ) -> list[Any]:
        """Steps mode, at the sampler: the batches a pass's light steps train, cut from their ``windows``
        before any is loaded (:meth:`HardSampleSelector.choose_windows`)."""
        assert self.selector is not None and self.tracker is not None
        return self.selector.choose_windows(windows, self.tracker.batch_size, steps, ordinals, prior, rank)

    # ------------------------------------------------------------------ figures and state
    @property
    def table(self) -> SampleScoreTable | None:
        """The per-sample score table (``None`` before the first fit's DataLoader exists)."""
        return None if self.selector is None else self.selector.table

    @property
    def threshold(self) -> float:
        """The score above which a sample counts as hard (``NaN`` before anything was scored)."""
        return math.nan if self.selector is None else self.selector.threshold

    def window_due(self, epoch_end: bool = False) -> bool:
        """Whether the selector's metrics window is due to the loggers
        (:meth:`~lightning_pulse.core.replay.HardSampleSelector.window_due`)."""
        return self.selector is not None and self.selector.window_due(epoch_end)

    def window_metrics(self) -> dict[str, float]:
        """The selector's metrics window, taken (:meth:`HardSampleSelector.window_metrics`)."""
        assert self.selector is not None
        return self.selector.window_metrics()

    def state_dict(self, stream: dict[str, Any] | None = None) -> dict[str, Any]:
        """The scores' state (a checkpoint's, restored before any data, as it came), with the data
        ``stream``'s state (steps mode's :class:`~lightning_pulse.core.step_plan.StepSavingStream`) under
        ``"stream"`` when there is one."""
        state = dict(self._restored or {}) if self.selector is None else self.selector.state_dict()
        return state if stream is None else {**state, "stream": stream}

    def load_state_dict(self, state: dict[str, Any]) -> dict[str, Any] | None:
        """Load :meth:`state_dict`'s scores: at once while :attr:`ready`, else when a DataLoader sizes the
        table (:meth:`attach`). Returns the data stream's state it holds, if any."""
        state = dict(state)
        stream = state.pop("stream", None)
        if self.ready and self.selector is not None:
            self.selector.load_state_dict(state)
        else:
            self._restored = state
        return stream
