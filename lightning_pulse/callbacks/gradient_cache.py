"""GradientCache: freeze the leading modules that have stopped moving, so backward really stops early.

The Lightning glue of :mod:`lightning_pulse.core.layer_freezing` (units: ``core.freeze_units``, FLOPs:
``core.backward_flops``, activation replay: ``core.activation_cache``)."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_pulse import _lightning_compat as compat
from lightning_pulse._lightning_compat import from_rank_zero
from lightning_pulse.callbacks.hard_sample_replay import HardSampleReplay
from lightning_pulse.callbacks.pulse_cycle import phase_of, refuse_unreachable_phases
from lightning_pulse.core.activation_cache import LoaderActivationCache, PrefixActivationCache, check_cache_mb
from lightning_pulse.core.backward_flops import BackwardFlopLedger, check_measure_flops
from lightning_pulse.core.custom_functions import add_ddp_inner_backward_note
from lightning_pulse.core.freeze_metrics import METRIC_PREFIX as METRIC_PREFIX
from lightning_pulse.core.freeze_metrics import freeze_metrics
from lightning_pulse.core.freeze_units import check_unit_names
from lightning_pulse.core.layer_freezing import (
    FreezerLifecycle,
    FreezeSettings,
    FreezeWindow,
    LayerFreezer,
    in_span,
    refuse_compiled_module,
    refuse_setup,
)
from lightning_pulse.errors import (
    OneRunPerInstance,
    names_itself,
    refuse_uninitialized_parameters,
    refusing,
)
from lightning_pulse.loggers import log_to_loggers, refuse_logger_only_monitors
from lightning_pulse.phase import Phase, PhaseChange
from lightning_pulse.step_rows import is_step_row, step_rows_every


class GradientCache(compat.PulseStateKey, Callback):
    r"""Freezes the leading module units whose parameters have stopped moving, so backward stops early.

    Every ``check_every`` optimizer steps each unit (embedding, block, head, ..., in forward order) is scored
    by its plasticity, its movement over the window against the largest it ever had. The longest stable run
    (score ``<= threshold``) from the input side gets ``requires_grad=False``: backward stops at the first
    trainable unit. A freeze lasts at most ``freeze_for`` steps, then the prefix trains a window and refreezes
    only if still stable. Frozen parameters get ``grad=None`` (an optimizer moving them stops freezing).

    Freezing happens in ``phases`` (always without a :class:`~lightning_pulse.PulseCycle`; a burst releases
    everything), between optimizer steps; under DDP rank 0's verdicts are broadcast once per window. A
    ``StabilityGuard`` rollback takes the scores, timers and frozen set back.

    Args:
        threshold: a unit is stable when its plasticity score is ``<= threshold`` (>= 0); scores never exceed 1,
            so ``1.0`` freezes whatever has been scored once.
        check_every: optimizer steps per window; units are scored at the end of every window.
        freeze_for: longest freeze in optimizer steps before a re-check; a multiple of ``check_every``.
        max_frozen_share: largest share of the trainable parameters frozen at once, in (0, 1]. Heads
            (units whose output no other unit reads: the last, a second head) always train.
        phases: the pulse phases in which units may be frozen.
        start_at: no freezing before this point: an ``int`` optimizer step or a ``float`` share of the run.
        release_at: nothing is frozen from this point on (same forms as ``start_at``); ``None``: never.
        units: explicit units as module or parameter names (the order is traced); ``None``: automatic split.
        activation_cache_mb: memory for replaying the frozen modules' outputs per sample, which skips the frozen
            prefix's forward too (0: off). It lives on each cached module's output device: accelerator memory on
            a GPU. Needs one map-style DataLoader (worker processes are fine) and samples that are the same at
            every visit (checked: the cache switches itself off on a mismatch).
        measure_flops: log the backward FLOPs skipped (torch's FLOP formulas, scaled to each batch's size).

    A unit holding a tied or shared parameter never freezes (the setup log names it). Parameters frozen before
    the first backward (a backbone) belong to no unit; once they train, everything is released and the units
    found again. Pruned parameters are followed. A frozen module whose activations require grad (HF wav2vec2's
    feature encoder) lets backward run through the prefix anyway: a warning says so, once.

    Raises:
        ValueError: at construction, naming the field, for a value out of range.
        PulseRefusal: at setup, for manual optimization, ``torch.compile`` of a part with parameters that train
            (again at fit start, for one compiled in ``configure_model``, and when one starts training; a
            compiled loss module or frozen teacher is fine), a strategy other than one process or DDP, DDP
            without ``find_unused_parameters=True`` or with ``static_graph=True``, or ``activation_cache_mb``
            with ``reload_dataloaders_every_n_epochs``; at fit start, for LBFGS, ``phases`` that never come, a
            share of a run of unknown length, lazy parameters, a second fit without a checkpoint, the cache on
            data whose sample indices cannot be tracked; at train start, for a ``units`` name the model does
            not have or entries that overlap.

    Example::

        from lightning import Trainer
        from lightning_pulse import GradientCache, PulseCycle
        trainer = Trainer(max_epochs=20, callbacks=[PulseCycle(burst=200, replay=100, maintain=20), GradientCache()])
    """

    # load_state_dict works mid-run, so StabilityGuard rolls the scores and the frozen set back with the model
    restore_on_rollback = True

    @names_itself
    def __init__(
        self,
        threshold: float = 0.2,
        check_every: int = 20,
        freeze_for: int = 200,
        max_frozen_share: float = 0.9,
        phases: Sequence[str] = ("replay", "maintain"),
        start_at: int | float | None = None,
        release_at: int | float | None = None,
        units: Sequence[str] | None = None,
        activation_cache_mb: float = 0.0,
        measure_flops: bool = True,
    ) -> None:
        super().__init__()
        self._one_run = OneRunPerInstance("GradientCache")
        self.settings = FreezeSettings(threshold, check_every, freeze_for, max_frozen_share)
        self.window = FreezeWindow(phases, start_at, release_at)  # type: ignore[arg-type]
        self.unit_names = check_unit_names(units)
        self.activation_cache_mb = check_cache_mb(activation_cache_mb)
        self.measure_flops = check_measure_flops(measure_flops)
        self.phases = tuple(Phase(name) for name in self.window.phases)

        self._lifecycle = FreezerLifecycle(self.settings, self.unit_names)  # the freezer and its units
        self.ledger = BackwardFlopLedger()
        self._replay: LoaderActivationCache | None = None
        self._loader_watch = compat.HookWatch(compat.on_train_dataloader_ready)
        # set from on_train_start to the end of training: a load_state_dict then applies at once (a rollback)
        self._fit_refs: tuple[pl.Trainer, pl.LightningModule] | None = None
        self._unfinished_step = compat.UnfinishedStepWatch()  # a save inside a step: the state before it
        self._held = compat.CollectiveHold()  # the hit rates' gathered counts, until gloo's worker lets go
        self._phase_enabled = True
        self._span: tuple[int | None, int | None] = (None, None)

    @property
    def freezer(self) -> LayerFreezer | None:
        """The fit's freezer (``None`` until the first backward orders the units or a checkpoint restores it)."""
        return self._lifecycle.freezer

    @property
    def frozen_units(self) -> list[str]:
        """Names of the units frozen now."""
        return self._lifecycle.frozen_names

    @property
    def events(self) -> list[dict[str, Any]]:
        """The latest 1,000 changes of the frozen prefix (``step``, ``from``, ``to``, ``reason``)."""
        return self._lifecycle.events

    @property
    def activations(self) -> PrefixActivationCache | None:
        """The activation cache of the current fit (``None`` when off)."""
        return self._replay.cache if self._replay is not None else None

    # ------------------------------------------------------------------ setup
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._one_run.setup(trainer, self)  # in every stage: see FitRestores
        if stage != "fit":
            return
        refuse_setup(trainer, pl_module, compat.compiled_trainable_part(pl_module), self.activation_cache_mb)
        self._loader_watch.watch(trainer, LoaderActivationCache.track if self.activation_cache_mb else None)
        # a new fit starts from scratch unless a checkpoint restore (which comes after setup) says otherwise
        self._lifecycle = FreezerLifecycle(self.settings, self.unit_names)
        self.ledger, self._fit_refs = BackwardFlopLedger(), None

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        refuse_logger_only_monitors(trainer, "GradientCache", "gradient_cache/")
        refuse_compiled_module(compat.compiled_trainable_part(pl_module))  # again: configure_model compiles
        self._lifecycle.check_fit_start(trainer.strategy, pl_module, trainer.world_size, trainer.optimizers)
        self._lifecycle.stand_in_for(compat.gradient_reading_hooks(pl_module), rank_zero_info)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._one_run.start(trainer)  # before anything is planned from a state of another run
        refuse_uninitialized_parameters(pl_module, "GradientCache")  # here: the sanity check may create them
        refuse_unreachable_phases("GradientCache", self.phases, trainer)
        why = "it takes rank 0's frozen layers at each epoch start, which ranks would reach at other steps"
        compat.refuse_uneven_epochs(trainer, "GradientCache", why, self._held, only_if_an_epoch_ends=True)
        with refusing("GradientCache"):  # a share of a run of unknown length (max_time only)
            self._span = self.window.steps(compat.total_steps(trainer))
        shares = {"start_at": self.window.start_at, "release_at": self.window.release_at}
        compat.note_run_shares(trainer, "GradientCache", shares, in_steps=True)
        self._phase_enabled = phase_of(trainer, default=Phase.REPLAY) in self.phases
        cut = next((c for c in trainer.callbacks if isinstance(c, HardSampleReplay)), None)
        trained = None if cut is None else lambda: cut.trained_indices  # a batch cut in place, maybe after us
        self._replay = LoaderActivationCache.for_fit(
            trainer.train_dataloader, self.activation_cache_mb, pl_module, rank_zero_warn, trained
        )
        self._loader_watch.stop()  # the data is set up (reloading it is refused with the cache)
        self._fit_refs = (trainer, pl_module)
        self._unfinished_step.watch(trainer)
        # a checkpoint applies here, after the strategy wrapped the model: DDP must see every parameter
        # trainable; `units` changed since it was saved are honoured there (scores start over on them)
        pending, step = self._lifecycle.pending, trainer.global_step
        self._lifecycle.resume(pending, pl_module, self._replay, rank_zero_info, step, self.ledger)

    def _end_activation_batch(self) -> None:
        if self._replay is not None and (reason := self._replay.end_batch()) is not None:
            warnings.warn(self._replay.switch_off_warning(reason), stacklevel=2)  # on its rank, named

    # ------------------------------------------------------------------ forward and backward
    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx == 0 or self._lifecycle.resumed_first_batch:  # where recipes unfreeze a backbone: look
            compat.check_run_shares(trainer)  # and a DataLoader rebuilt at another length moves the window
            self._lifecycle.follow_optimizers(trainer.optimizers)  # a recipe may have made new ones
            self._retrace(trainer, pl_module, check=True)
            # a unit turned back on: released before the forward (mid-epoch, a resume: dated as its step)
            self._lifecycle.release_taken_back(trainer.global_step + (batch_idx > 0), self._replay)
        self._lifecycle.begin_forward()  # a resumed fit's first backward trains its prefix: graph checked
        self.ledger.begin_forward(pl_module, self._lifecycle.units if self.measure_flops else ())  # its size
        if self._replay is not None:  # not that batch: its prefix's outputs require grad, no record of them
            self._replay.begin_batch(batch_idx, frozen=self._lifecycle.backward_prefix > 0)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._end_activation_batch()
        if (before := self._lifecycle.optimizer_moved_frozen_units(from_rank_zero(trainer))) is not None:
            rank_zero_warn(self._lifecycle.optimizer_check.warning())  # freezing stopped for good
            self._lifecycle.record(trainer.global_step, before, "optimizer", self._replay)

    @override
    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor
    ) -> None:
        self._end_activation_batch()  # the forward is over: replayed modules get their own forward back
        self._lifecycle.begin_backward(loss)  # the fit's first checks the graph; one orders waiting units
        if self.measure_flops:
            self.ledger.begin_backward(self._lifecycle.backward_prefix)

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.measure_flops:
            self.ledger.end_backward()
        if self._lifecycle.end_backward(from_rank_zero(trainer)):  # freezes a restored prefix, orders units
            self._lifecycle.announce(rank_zero_info, rank_zero_warn)  # once per fit, not at each rollback

    # ------------------------------------------------------------------ the step
    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if self._lifecycle.repeated_evaluation() or self.freezer is None:  # SAM's second closure: counted
            return
        before = self.freezer.frozen_prefix
        enabled = self._phase_enabled and in_span(self._span, trainer.global_step + 1)
        report = self._lifecycle.step(enabled, from_rank_zero(trainer), trainer.optimizers)
        self._lifecycle.record_step(trainer.global_step + 1, before, report, self._replay)
        # Lightning's rule (the loss's rows): the step this optimizer step completes is a multiple
        every = step_rows_every(None, trainer.log_every_n_steps)  # 0: the checks' rows only
        due = report.window_closed or is_step_row(trainer.global_step + 1, every)
        if due:  # every rank joins the hit rates' gather (a logger may be on rank 0 only); the lowest logged
            gather = functools.partial(compat.all_gather_held, trainer.strategy, hold=self._held)
            rate = self._replay.logged_hit_rate(gather) if self._replay is not None else {}
            if trainer.is_global_zero and trainer.loggers:  # the metrics dict: only for a logged step
                metrics = freeze_metrics(report, self.freezer, self.ledger, None, self.measure_flops)
                log_to_loggers(trainer, {**metrics, **rate})
        self.ledger.new_step()
        if report.outgrown or report.misplaced:  # parameters outside the units train, or a unit had no place
            self._retrace(trainer, pl_module)

    def _retrace(self, trainer: pl.Trainer, pl_module: pl.LightningModule, check: bool = False) -> None:
        """Discover the units again once parameters outside them train (``check``: look now, one broadcast)."""
        # a compiled part frozen at fit start that trains now: its compiled backward would order the units
        refuse_compiled_module(compat.compiled_trainable_part(pl_module))
        retraced = self._lifecycle.retrace(pl_module, from_rank_zero(trainer) if check else None, check)
        if retraced is not None:
            self.ledger.remeasure()
            (rank_zero_warn if retraced[2] else rank_zero_info)(f"GradientCache: {retraced[0]}.")
            if retraced[1]:
                self._lifecycle.record(trainer.global_step, retraced[1], "retrace", self._replay)

    @override
    def on_pulse_phase_change(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, change: PhaseChange
    ) -> None:
        """Release everything when a burst starts; freeze the last stable prefix when a light phase starts."""
        self._phase_enabled = change.current in self.phases
        enabled = self._phase_enabled and in_span(self._span, trainer.global_step)
        if (before := self._lifecycle.follow_phase(enabled, resume=change.reason == "resume")) is not None:
            self._lifecycle.record(trainer.global_step, before, f"phase:{change.current.value}", self._replay)

    def on_pulse_parameters_replaced(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, remap: Any
    ) -> None:
        """Follow parameters that structured pruning replaced: units, window snapshots, FLOP measurements."""
        self._lifecycle.follow(remap, self._replay)
        self.ledger.remeasure()

    def on_pulse_weights_changed(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Drop the recorded activations: weights changed in place (an unstructured prune event's masks)."""
        self._lifecycle.replan(self._replay, again=True)

    def temporarily_frozen(self, pl_module: pl.LightningModule) -> list[str]:
        """Names of the parameters it holds frozen now, which a DDP re-wrap registers (TemporaryFreezer)."""
        return self._lifecycle.held_frozen_names(pl_module)

    # ------------------------------------------------------------------ end
    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._one_run.end()
        if (note := self._lifecycle.idle_note(trainer.global_step, self.events)) is not None:
            rank_zero_info(f"GradientCache: {note}.")
        self._end_fit()
        if self._replay is not None:
            self._replay.detach(trainer.train_dataloader)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, error: BaseException) -> None:
        add_ddp_inner_backward_note(error, rank_zero_warn)  # where check_wrapped_model's advice led
        self._end_fit()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._loader_watch.stop()  # a fit with no step left never reached on_train_start

    def _end_fit(self) -> None:
        self._loader_watch.stop()  # a fit refused before on_train_start's stop: no hook left on the strategy
        self._fit_refs = None
        self._held.wait()  # the rank may exit right after this (see compat.CollectiveHold)
        self._lifecycle.close(self._replay, self.ledger)
        self._lifecycle.end()  # the user's module leaves fit exactly as it came in: every parameter trainable

    # ------------------------------------------------------------------ state
    @override
    def state_dict(self) -> dict[str, Any]:
        # the restored state as it was while a restored fit trained nothing (no on_train_start came)
        return self._lifecycle.state_dict(self.ledger.state_dict(), self.events, self._unfinished_step())

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the state of :meth:`state_dict`.

        A checkpoint restore loads the ledger and ``events`` at once, the rest in ``on_train_start`` (DDP must
        see every parameter trainable when it wraps the model; a fit with nothing to train keeps it for
        :meth:`state_dict`). During training (a rollback) it applies at once: scores, windows, timers and the
        frozen set return, the activation cache starts over; the FLOP ledger and ``events`` count what ran.
        """
        if not self._one_run.restored():  # loaded by validate, test or predict: no resume
            return
        if self._fit_refs is None:
            self._lifecycle.hold(state_dict)  # applied by on_train_start
            self.ledger.load_state_dict(state_dict["ledger"])
            return
        trainer, pl_module = self._fit_refs
        self._lifecycle.close(self._replay, self.ledger)
        self._lifecycle.roll_back(state_dict, pl_module, trainer.global_step, self._replay)  # records changes
        self.ledger.new_step()
