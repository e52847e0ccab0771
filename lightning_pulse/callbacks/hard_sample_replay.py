"""HardSampleReplay: train replay phases on the hardest samples only, with no change to the LightningModule."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_pulse import _lightning_compat as compat
from lightning_pulse.callbacks.pulse_cycle import phase_of, refuse_unreachable_phases
from lightning_pulse.core import replay
from lightning_pulse.core.per_sample_loss import PerSampleScorer
from lightning_pulse.core.replay_batch import ReplayBatchLifecycle, refuse
from lightning_pulse.core.replay_data import ReplayData
from lightning_pulse.core.sample_scores import SampleScoreTable
from lightning_pulse.errors import OneRunPerInstance, names_itself, tuner_search
from lightning_pulse.loggers import log_to_loggers, refuse_logger_only_monitors
from lightning_pulse.phase import Phase
from lightning_pulse.probe import step_rerun
from lightning_pulse.step_rows import step_rows_every
from lightning_pulse.step_saving import StepSavingLoader


class HardSampleReplay(compat.PulseStateKey, Callback):
    r"""Trains light phases on the hardest samples, in fewer steps (or, in batch mode, smaller batches).

    Every step, the loss the module already computes is captured per sample (a scoped hook on the
    ``torch.nn.functional`` losses, which ``torch.nn`` loss modules call; no second forward pass) and kept in a
    score table keyed by dataset index. In the phases listed in ``phases`` (by default a
    :class:`~lightning_pulse.PulseCycle`'s replay phase; every step without one) the ``rule`` picks from the
    age-weighted scores; never-scored samples always train. ``mode="steps"`` (the default): for such a step the
    sampler draws a window of ``B / replay_fraction`` indices and keeps the ``B`` picked before any is loaded, so
    the run loads and trains fewer samples in fewer steps (without a PulseCycle, every epoch trains full batches
    on ``replay_fraction`` of its data); the run is planned at fit start and ``trainer.max_steps`` set to the
    plan (:mod:`lightning_pulse.step_saving`), so ``OneCycleLR`` and every schedule plan for the real steps.
    ``mode="batch"``: each batch is cut to about ``replay_fraction * B``, steps unchanged. The algorithm is
    :class:`~lightning_pulse.core.replay.HardSampleSelector`, run batch by batch by
    :class:`~lightning_pulse.core.replay_batch.ReplayBatchLifecycle`; this callback maps hooks onto them. A run
    shorter than an epoch cannot select (samples are scored when they train): it warns at fit start.

    Args:
        rule: ``"topk"`` (highest scores), ``"infobatch"`` (drop below-mean samples with probability
            ``prune_ratio``, weight the kept ones so the mean loss stays unbiased; batch mode only) or
            ``"random"`` (a uniform subset of top-k's size: the control).
        replay_fraction: share of the offered samples trained on in a light phase (of each window or batch),
            in ``(0, 1]``. Not read by ``"infobatch"``: set there, it is refused.
        prune_ratio: InfoBatch's ``r``, in ``[0, 1)``; read by ``"infobatch"`` only (set for another rule, refused).
        phases: the phases in which batches are selected; other phases train untouched.
        mode: ``"steps"`` (full batches from wider windows, fewer steps) or ``"batch"`` (smaller batches, same
            steps); ``None``: ``"steps"``, or ``"batch"`` for ``"infobatch"``. ``"epoch"`` was removed (steps
            mode without a PulseCycle does what it did); it fails naming the replacement.
        score_half_life: age at which a stored score counts half: ``int`` steps, ``float`` epochs, or
            ``"500steps"`` / ``"2epochs"``; ``None`` turns age weighting off.
        scorer: a :class:`~lightning_pulse.core.per_sample_loss.PerSampleScorer` for modules whose loss the
            capture cannot see; ``None`` captures the module's own loss.
        seed: seed of the selection's random draws (identical on every rank).
        log_every_n_steps: how often metrics go to the loggers; ``None`` follows the Trainer's setting.

    Raises:
        ValueError: at construction, naming the argument, for a value outside the ranges above or
            ``rule="infobatch"`` with ``mode="steps"``; at fit start, for an epoch-based half-life with an
            infinite DataLoader.
        PulseRefusal: at fit start, under DDP for ranks training different datasets; for a DataLoader whose
            dataset indices cannot be tracked (an ``IterableDataset``, a custom batch sampler), several training
            DataLoaders, ``ModelParallelStrategy``, parameter groups mixing ``maximize`` (scores read),
            a Tuner search (``LearningRateFinder``/``BatchSizeFinder``), batches too small for ``mode="batch"``
            to cut at ``replay_fraction`` (the smallest that cuts is named), a ``training_step`` compiled with
            ``fullgraph=True`` unless a ``scorer`` is set (rule other than ``'infobatch'``), ``phases``
            that never come (none the PulseCycle has; with none, no ``"replay"``), a second run of this instance
            unless a checkpoint was restored into it, or in ``mode="steps"`` a run or sampler of unknown
            length, a resume from a mid-epoch checkpoint that holds no state of it, ``limit_train_batches``,
            ``overfit_batches``, ``reload_dataloaders_every_n_epochs``, a ``GradientAccumulationScheduler``, a
            per-step LR scheduler built for the run's unplanned length (``max_steps``, or ``max_epochs`` of
            plain epochs) when the plan is shorter, a PulseCycle in seconds or manual optimization stepping
            several optimizers per batch; after the fit's first two batches (trained in full, before any
            replay step), for a module carrying state from one batch to the next (a stateful RNN) or a loss
            computed time-major (``T == B`` too, by the step run again); at the first step, before any update,
            with a ``scorer`` that raises on the fit's first batch (tried once on ``training_step``'s output);
            without a ``scorer`` (or with rule='infobatch'): for a loss called in a ``fullgraph=True`` part, a
            loss with no per-sample value, or packed rows (graph nodes, packed tokens: more rows than indices,
            none of B rows) the loss does not split; in ``mode="batch"``, at the first batch, for a batch that
            cannot be cut in place: immutable, holding nothing per sample (or fewer rows), or time-major.

    Example::

        from lightning import Trainer
        from lightning_pulse import HardSampleReplay, PulseCycle
        trainer = Trainer(max_epochs=20, callbacks=[PulseCycle(burst=200, replay=100, maintain=20), HardSampleReplay()])
    """

    restore_on_rollback = True  # load_state_dict works mid-run: StabilityGuard rolls scores back too

    @names_itself
    def __init__(
        self,
        rule: str = "topk",
        replay_fraction: float = 0.5,
        prune_ratio: float = 0.5,
        phases: Sequence[str] = ("replay",),
        mode: str | None = None,
        score_half_life: int | float | str | None = 5.0,
        scorer: PerSampleScorer | None = None,
        seed: int = 0,
        log_every_n_steps: int | None = None,
    ) -> None:
        super().__init__()
        self._one_run = OneRunPerInstance("HardSampleReplay")
        self.config = replay.ReplayConfig(rule, replay_fraction, prune_ratio, seed)
        self.data = ReplayData(self.config, replay.parse_half_life(score_half_life))  # tracker, selector
        self.phases, self.mode = replay.validate_replay_args(phases, mode, rule, scorer, log_every_n_steps)
        self.steps = StepSavingLoader()  # mode="steps": the plan and where the run stands in its data
        self.scorer = scorer
        self.log_every_n_steps = log_every_n_steps
        self._trainer: pl.Trainer | None = None
        self._remove_hook: Any = None
        self._held = compat.CollectiveHold()  # gathered rows, until gloo's worker lets go of them
        self.batches = ReplayBatchLifecycle(self.mode, scorer, self._held, rule)  # plan, cut, capture, record
        self._fullgraph = compat.FullgraphBreaks()  # fit start to end: a loss in a fullgraph part refused

    # ------------------------------------------------------------------ public state
    selector = property(lambda self: self.data.selector, doc="The selector (None before any DataLoader).")
    tracker = property(lambda self: self.data.tracker, doc="The index tracker of the fit's DataLoader.")
    table = property(lambda self: self.data.table, doc=ReplayData.table.__doc__)
    threshold = property(lambda self: self.data.threshold, doc=ReplayData.threshold.__doc__)

    @property
    def trained_indices(self) -> torch.Tensor | None:
        """Dataset indices ``(k,)`` of the samples the current step trains on (batch start to batch end)."""
        return None if (step := self.batches.current) is None else step.plan.indices

    @property
    def offered_count(self) -> int | None:
        """How many samples the data offered for the current step: in steps mode the window the sampler cut the
        batch from (only the batch is loaded); otherwise the batch as the loader yielded it."""
        return None if (step := self.batches.current) is None else step.offered_count

    @property
    def trained_origins(self) -> list[str] | None:
        """Why each sample of the current step is there: ``"untouched"``, ``"selected"`` or ``"unseen"``."""
        return None if (step := self.batches.current) is None else step.plan.origins

    state_check = property(lambda self: self.batches.state_check, doc="The carried-state check.")
    _gather = property(lambda self: compat.all_gather_of(self._trainer, self._held))  # DDP: every rank's rows

    def metrics(self) -> dict[str, float]:
        """Totals since fit start: replay fraction, losses by origin, table size and reuse, threshold. Steps
        reach them in bulk (every 32 steps at most, and at every epoch end)."""
        return {} if self.selector is None else self.selector.metrics()

    def _new_table(self, num_samples: int) -> SampleScoreTable:
        return SampleScoreTable(num_samples)

    # ------------------------------------------------------------------ setup
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._one_run.setup(trainer, self)  # in every stage: see FitRestores
        if stage != "fit":
            return
        parallel = isinstance(trainer.strategy, ModelParallelStrategy)
        refuse(replay.setup_refusal(parallel, tuner_search(trainer), None))
        self._trainer, self._run_checked, self.steps.stream.held = trainer, False, None
        self.data.ready = False  # a checkpoint's scores loaded from here on wait for this fit's DataLoader
        if self.mode == "steps":
            self.steps.uncap(trainer)  # a second fit of the same Trainer plans for the user's max_steps
            self.steps = StepSavingLoader()
            self.steps.check_at_setup(trainer, compat.train_dataloaders_given(trainer))
        self._remove_hooks()
        hooks = [compat.on_train_dataloader_ready(trainer, self._on_train_dataloader)]
        if self.mode == "steps":  # a hook's second DataLoader is refused before the Trainer's settings
            hooks.append(compat.on_train_dataloaders_built(trainer, self.steps.check_deferred))
        if self.scorer is not None:  # tried once on the fit's first training_step output, before the update
            hooks.append(compat.on_training_step_output(trainer, self.batches.step_returned))
        self._remove_hook = lambda: [remove() for remove in hooks]

    def _on_train_dataloader(self, loader: Any) -> None:
        # inside Lightning's data set-up, before the first pass: the first epoch is tracked and can be chosen
        if not self._run_checked:  # here, not at on_train_start: a fit whose steps are done never gets there
            self._one_run.start(self._trainer)
            self._run_checked = True
        # a CombinedLoader's second loader: refused before anything is installed; DDP: one all-gather per rank
        at = (self._trainer.current_epoch, self._trainer.global_step)
        refuse(self.data.loader_refusal(loader, at, compat.all_gather_of(self._trainer, self._held)))
        self.steps.check_deferred()  # steps mode, DataLoaders from a hook: the Trainer's settings, only now
        self.steps.release()  # a reload (batch mode): the previous loader is the user's again
        self.steps.loader = loader  # given back at the fit's end (also when the set-up fails from here on)
        batches = compat.training_batches_taken(self._trainer, loader)  # an epoch's, limit_train_batches too
        accumulate = compat.scheduled_accumulation(self._trainer)  # a scheduler's, before it sets it
        self.data.attach(loader, at, accumulate, self._new_table, _warn, batches)
        if compat.drop_restored_loader_state(self._trainer, loader):  # Lightning would load it next
            _warn(self.data.loader_state_restored(self.mode))
        if self.mode == "steps" and self.steps.plan is None:  # planned once per fit
            self.steps.install(self._trainer, loader, self.tracker, self.selector, self.phases, self._choose)

    def _choose(
        self, windows: list[list[int]], ordinals: list[int], steps: list[int], prior: float
    ) -> list[Any]:
        # steps mode, at the sampler: a pass's batches before any loads. A method: pickled, timed by HookTimer
        assert self._trainer is not None
        return self.data.choose(windows, ordinals, steps, prior, self._trainer.global_rank)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        refuse_logger_only_monitors(trainer, "HardSampleReplay", "hard_sample_replay/")
        if self.batches.captures_losses:  # after configure_model, which may compile (a scorer: no capture)
            refuse(replay.setup_refusal(False, None, compat.fullgraph_compiled_step(pl_module)))
            self._fullgraph.watch(pl_module, lambda *error: refuse(replay.fullgraph_loss_refusal(*error)))

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        refuse(self.data.start_refusal(trainer.train_dataloader, self.mode))  # several loaders, uncut batches
        refuse_unreachable_phases("HardSampleReplay", self.phases, trainer)
        steps_per_epoch = compat.scheduled_epoch_steps(trainer)  # a scheduler's factor, before it sets it
        # a module stepping several optimizers itself: scores age by its steps, an epoch is read as batches
        manual = len(trainer.optimizers) if compat.steps_per_batch_unknown(trainer) else 0
        log_every = step_rows_every(self.log_every_n_steps, trainer.log_every_n_steps)  # 0: epoch ends only
        planned = compat.total_steps(trainer)  # the run's optimizer steps (inf: unknown)
        self.data.start_training(steps_per_epoch, log_every, planned, self.mode, manual, _warn)
        self.steps.on_train_start(trainer)  # steps mode only: Lightning learns the planned pass's length
        self.batches.start_fit(trainer.world_size, trainer.optimizers, step_rerun(trainer, pl_module))
        rank_zero_info(f"HardSampleReplay: {self.config.describe(self.mode, self.phases)}")

    # ------------------------------------------------------------------ per batch
    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        selector, tracker = self.data.selector, self.data.tracker
        assert selector is not None and tracker is not None
        # the sampler's indices say how many samples the batch holds (a cut batch's: the cut, as loaded)
        step, indices = trainer.global_step, tracker.batch_indices(batch_idx)
        # SWA's BatchNorm-update epoch recomputes the statistics over the plain data: no selection there
        in_phase = phase_of(trainer, default=Phase.REPLAY).value in self.phases
        active = in_phase and not compat.in_batch_norm_update_epoch(trainer)
        window, cut = self.steps.next_batch() if self.mode == "steps" else (0, None)
        self.batches.start_batch(
            selector, batch, indices, step, batch_idx, active, trainer.global_rank, window, cut, pl_module
        )

    @override
    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor
    ) -> None:
        divided_by = compat.backward_loss_divisor(trainer, pl_module)  # `loss` as the step returned it
        _warn(self.batches.close_capture(loss, divided_by))  # refuses a first step whose loss does not split

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # the captured calls the backward did not reach (logged values) stop counting; refused before an update
        _warn(self.batches.after_backward(manual=not pl_module.automatic_optimization))

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        last = batch_idx + 1 >= trainer.num_training_batches  # see finish_batch's epoch_ends
        if (finished := self.batches.finish_batch(pl_module, batch, outputs, self._gather, last)) is not None:
            self._log(trainer)  # before the carried-state check: a refused step is still logged
            self.batches.check_carried_state(finished)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if compat.accumulation_schedule(trainer) and not compat.in_batch_norm_update_epoch(trainer):
            self.data.epoch_length(compat.scheduled_epoch_steps(trainer))  # its factor, in either order

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.steps.on_train_epoch_end(trainer)  # steps mode: an epoch that drew no batch is refused
        _warn(self.data.monitor_note(lambda: compat.training_key_monitors(trainer), self.phases))
        if (selector := self.data.selector) is not None:
            selector.apply()  # the next epoch selects from every score of this one
            self._log(trainer, epoch_end=True)

    def _log(self, trainer: pl.Trainer, epoch_end: bool = False) -> None:
        # whether the window is due first: it is cheaper than the trainer's properties
        if self.data.window_due(epoch_end) and trainer.is_global_zero and trainer.loggers:
            log_to_loggers(trainer, self.data.window_metrics())

    # ------------------------------------------------------------------ lifecycle
    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._one_run.end()
        self.batches.release()
        _warn(self.selector.end_run() if self.selector is not None else None)

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self.batches.release()
        self._fullgraph.release()
        self.steps.release()  # Lightning calls no teardown hook after an exception: what setup put on the
        self._remove_hooks()  # Trainer comes off here, else a later fit without this instance ran them
        if trainer.state.fn == "fit":  # and the plan's max_steps cap, which that fit read as the user's
            self.steps.uncap(trainer)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.batches.release()
        self._fullgraph.release()
        self._held.wait()  # the rank may exit right after this (see compat.CollectiveHold)
        if stage != "fit":
            return
        self._remove_hooks()
        if self.mode == "steps":  # a checkpoint saved after the fit resumes it
            self.steps.stream.hold(trainer.global_step)
        self.steps.release(fit_ended=True)
        self._trainer = None
        self.data.detach()

    def _remove_hooks(self) -> None:
        remove, self._remove_hook = self._remove_hook, None
        if remove is not None:
            remove()

    @override
    def state_dict(self) -> dict[str, Any]:
        if (trainer := self._trainer) is not None and (counts := compat.processed_batch_counts(trainer)):
            self.batches.finish_trained_step(self._gather, *counts)  # a save before the batch end
        step = trainer.global_step if self.mode == "steps" and trainer is not None else None
        # a fit with nothing left to train keeps the restored one (no pass ran)
        stream = self.steps.checkpoint(step)  # leaves out a batch in flight (an exception in training_step)
        return self.data.state_dict(stream)

    def rollback_state_dict(self) -> dict[str, Any]:
        """What a :class:`~lightning_pulse.StabilityGuard` rollback returns to: the scores (they describe the
        model); the data stream goes on, since its samples were really drawn."""
        return {k: v for k, v in self.state_dict().items() if k != "stream"}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore scores, measured-but-unapplied steps, totals and threshold.

        At a checkpoint restore (before the DataLoader that sizes the table exists) it applies when the table is
        built; during training (a :class:`~lightning_pulse.StabilityGuard` rollback) at once, dropping a step in
        flight (measured on the model being replaced). The DataLoader's pass is not rewound; in steps mode its
        windows not drawn yet are cut again from the restored scores.
        """
        if not self._one_run.restored():  # loaded by validate, test or predict: no resume
            return
        if self.data.ready:  # a rollback: the scores apply at once, the data stream is not rewound
            self.batches.drop_step()
            self.data.load_state_dict(state_dict)
            self.steps.choose_again()  # steps mode: the windows not drawn yet, from the restored scores
        else:  # the scores apply when a DataLoader sizes the table
            self.steps.stream.restore(self.data.load_state_dict(state_dict))

    load_rollback_state_dict = load_state_dict  # a rollback mid-training: load_state_dict says how


def _warn(note: str | None) -> None:
    if note is not None:
        rank_zero_warn(f"HardSampleReplay: {note}")
