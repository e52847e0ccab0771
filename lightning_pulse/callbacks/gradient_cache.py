"""GradientCache: freeze the leading modules that have stopped moving, so backward really stops early.

The algorithm lives in :mod:`lightning_pulse.core.layer_freezing` (units: :mod:`~lightning_pulse.core.freeze_units`,
FLOPs: :mod:`~lightning_pulse.core.backward_flops`, activation replay: :mod:`~lightning_pulse.core.activation_cache`);
this file is the Lightning glue.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_pulse.callbacks.pulse_cycle import phase_of
from lightning_pulse.core.activation_cache import LoaderActivationCache, PrefixActivationCache
from lightning_pulse.core.backward_flops import BackwardFlopLedger
from lightning_pulse.core.freeze_units import (
    ForwardOrderTrace,
    FreezeUnit,
    discover_units,
    pinned_note,
    replace_unit_parameters,
)
from lightning_pulse.core.layer_freezing import (
    FreezeSettings,
    FreezeWindow,
    LayerFreezer,
    check_wrapped_model,
    restore_freezer,
)
from lightning_pulse.errors import PulseRefusal, refuse_sharded_strategy
from lightning_pulse.phase import Phase, PhaseChange

METRIC_PREFIX = "gradient_cache/"


class GradientCache(Callback):
    r"""Freezes the leading module units whose parameters have stopped moving, so backward stops early.

    Every ``check_every`` optimizer steps each unit (embedding, block, head, ... found automatically, in forward
    order) is scored by its plasticity: its relative parameter movement over the window divided by the largest
    it ever had. The longest run of stable units (score ``<= threshold``) from the input side is frozen with
    ``requires_grad=False``, so autograd stops backward at the first trainable unit: the frozen prefix costs no
    backward FLOPs. A freeze lasts at most ``freeze_for`` steps; then the prefix trains one window and is frozen
    again only if still stable. Frozen parameters get ``grad=None``, so torch optimizers leave them and their
    state alone.

    Freezing happens in the phases named by ``phases``; a burst releases everything. Without a
    :class:`~lightning_pulse.PulseCycle` the callback acts as if always in the replay phase (continuous,
    Egeria/AutoFreeze-style freezing). Decisions fall between optimizer steps (never inside an accumulation
    window). Under DDP rank 0's verdicts are broadcast once per window; the strategy needs
    ``find_unused_parameters=True`` and no ``static_graph``. A :class:`~lightning_pulse.StabilityGuard` rollback
    takes the scores, timers and frozen set back with the model.

    Args:
        threshold: a unit is stable when its plasticity score is ``<= threshold`` (>= 0); scores never exceed 1,
            so ``1.0`` freezes whatever has been scored once.
        check_every: optimizer steps per window; units are scored at the end of every window.
        freeze_for: longest freeze in optimizer steps before a re-check; a multiple of ``check_every``.
        max_frozen_share: largest share of the trainable parameters frozen at once, in (0, 1]. The last unit in
            forward order (usually the head) always trains.
        phases: the pulse phases in which units may be frozen.
        start_at: no freezing before this point: an ``int`` optimizer step or a ``float`` share of the run.
        release_at: nothing is frozen from this point on (same forms as ``start_at``); ``None``: never.
        units: explicit units as module or parameter names (the order is traced); ``None``: automatic split.
        activation_cache_mb: memory for replaying the frozen modules' outputs per sample, which skips the frozen
            prefix's forward too (0: off). Needs a map-style DataLoader and samples that are the same at every
            visit (checked: the cache switches itself off on a mismatch).
        measure_flops: measure each frozen-prefix length's backward once with ``torch.utils.flop_counter`` and
            log the backward FLOPs skipped.

    A unit holding a parameter that the model also holds elsewhere (a tied embedding and output layer, found
    with ``named_parameters(remove_duplicate=False)``) never freezes: the frozen prefix stops before it, and the
    setup log names it. Structured pruning's replaced parameters are followed
    (``on_pulse_parameters_replaced``); names saved before an unstructured prune resolve to ``weight_orig``.

    Raises:
        ValueError: at construction, naming the field, for a value out of range. At train start, for a
            ``units`` name the model does not have, or a share of a run of unknown length.
        PulseRefusal: at setup, for manual optimization, FSDP/DeepSpeed/model parallel, DDP without
            ``find_unused_parameters=True`` or with ``static_graph=True``, or another multi-process strategy.

    Example::

        from lightning import Trainer
        from lightning_pulse import GradientCache, PulseCycle

        trainer = Trainer(max_epochs=20, callbacks=[PulseCycle(burst=200, replay=100, maintain=20), GradientCache()])
    """

    # load_state_dict works mid-run, so StabilityGuard rolls the scores and the frozen set back with the model
    restore_on_rollback = True

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
        self.settings = FreezeSettings(threshold, check_every, freeze_for, max_frozen_share)
        self.window = FreezeWindow(phases, start_at, release_at)  # type: ignore[arg-type]
        if units is not None and (
            isinstance(units, str) or not units or not all(isinstance(u, str) for u in units)
        ):
            raise ValueError(
                f"`units`={units!r} must be None or a non-empty list of module or parameter names."
            )
        mb = activation_cache_mb
        if isinstance(mb, bool) or not isinstance(mb, (int, float)) or not 0 <= mb < math.inf:
            raise ValueError(f"`activation_cache_mb`={mb!r} must be a finite number >= 0 (0 is off).")
        if not isinstance(measure_flops, bool):
            raise ValueError(f"`measure_flops`={measure_flops!r} must be a bool.")
        self.phases = tuple(Phase(name) for name in self.window.phases)
        self.unit_names = list(units) if units is not None else None
        self.activation_cache_mb = float(activation_cache_mb)
        self.measure_flops = measure_flops

        self.freezer: LayerFreezer | None = None
        self.ledger = BackwardFlopLedger()
        self.events: list[dict[str, Any]] = []  # every change of the frozen prefix: step, from, to, reason
        self._replay: LoaderActivationCache | None = None
        self._pending_state: dict[str, Any] | None = None
        # set from on_train_start to the end of training: a load_state_dict then applies at once (a rollback)
        self._fit_refs: tuple[pl.Trainer, pl.LightningModule] | None = None
        self._trace: ForwardOrderTrace | None = None  # discovered units, until a backward orders them
        self._phase_enabled = True
        self._span: tuple[int | None, int | None] = (None, None)

    @property
    def frozen_units(self) -> list[str]:
        """Names of the units frozen now."""
        return self.freezer.frozen_names if self.freezer is not None else []

    @property
    def activations(self) -> PrefixActivationCache | None:
        """The activation cache of the current fit (``None`` when off)."""
        return self._replay.cache if self._replay is not None else None

    # ------------------------------------------------------------------ setup
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if not pl_module.automatic_optimization:
            raise PulseRefusal(
                "GradientCache: it needs automatic optimization, because it freezes and releases units between "
                "the optimizer steps Lightning runs; set `automatic_optimization = True` or remove GradientCache."
            )
        refuse_sharded_strategy(
            trainer,
            "GradientCache",
            "a rank holds flattened shards, so per-module `requires_grad` is not per layer",
        )
        # a new fit starts from scratch unless a checkpoint restore (which comes after setup) says otherwise
        self.freezer, self.ledger, self.events = None, BackwardFlopLedger(), []
        self._pending_state, self._fit_refs, self._trace = None, None, None

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        check_wrapped_model(trainer.strategy.model, trainer.world_size, type(trainer.strategy).__name__)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._span = self.window.steps(float(trainer.estimated_stepping_batches))
        self._phase_enabled = phase_of(trainer, default=Phase.REPLAY) in self.phases
        self._setup_activation_cache(trainer, pl_module)
        self._fit_refs = (trainer, pl_module)
        if self._pending_state is not None:
            state, self._pending_state = self._pending_state, None
            # applied here, after the strategy wrapped the model: DDP must see every parameter trainable
            self.freezer = restore_freezer(None, state["cache"], pl_module, self.settings)
            self._replan()
            self.ledger.load_state_dict(state["ledger"])
            self.events = list(state["events"])
            if self.freezer is not None:
                _log_shared(self.freezer.units)
                return
        # a fresh run (or a checkpoint from before the first backward): units are ordered at the first backward
        self._trace = ForwardOrderTrace(discover_units(pl_module, self.unit_names))
        _log_shared(self._trace.units)

    def _setup_activation_cache(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._replay = None
        if self.activation_cache_mb:
            budget = int(self.activation_cache_mb * 2**20)
            replay = LoaderActivationCache.attach(trainer.train_dataloader, budget, pl_module)
            if isinstance(replay, str):
                rank_zero_warn(f"GradientCache: the activation cache is off because {replay}.")
            else:
                self._replay = replay

    def _replan(self, again: bool = False) -> None:
        if self._replay is not None:
            self._replay.plan(self.frozen_units, again)

    def _end_activation_batch(self) -> None:
        reason = self._replay.end_batch() if self._replay is not None else None
        if reason is not None:
            rank_zero_warn(f"GradientCache: the activation cache switched itself off: {reason}.")

    # ------------------------------------------------------------------ forward and backward
    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._replay is not None:
            self._replay.begin_batch(
                batch_idx, frozen=self.freezer is not None and self.freezer.frozen_prefix > 0
            )

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._end_activation_batch()

    @override
    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor
    ) -> None:
        self._end_activation_batch()  # the forward is over: replayed modules get their own forward back
        if self._trace is not None and not self._trace.running:
            self._trace.begin()
        if self.measure_flops:
            self.ledger.begin_backward(self.freezer.frozen_prefix if self.freezer is not None else 0)

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.measure_flops:
            self.ledger.end_backward()
        if self._trace is not None and self._trace.running:
            units, self._trace = self._trace.finish(_from_rank_zero(trainer)), None
            self.freezer = LayerFreezer(units, self.settings)
            if self.freezer.freezable_limit == 0:
                rank_zero_info(
                    "GradientCache: the model has a single trainable unit, so nothing can be frozen."
                )
            elif self.freezer.pinned_first is not None:
                rank_zero_warn(f"GradientCache: {self.freezer.pinned_first}.")
            rank_zero_info(
                "GradientCache: units in forward order: "
                + ", ".join(f"{u.name}({u.numel})" + ("" if u.used else "[unused]") for u in units)
            )

    # ------------------------------------------------------------------ the step
    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if self.freezer is None:
            return
        before = self.freezer.frozen_prefix
        enabled = self._phase_enabled and self._in_span(trainer.global_step + 1)
        report = self.freezer.step(enabled, _from_rank_zero(trainer))  # DDP: one broadcast per window
        if report.changed:
            self._record(trainer.global_step + 1, before, "check" if report.window_closed else "release")
        # the metrics dict is built only for steps that reach a logger
        if trainer.loggers and (
            report.window_closed or trainer.global_step % max(trainer.log_every_n_steps, 1) == 0
        ):
            self._log(trainer, report.frozen_share, report.frozen_prefix)
        self.ledger.new_step()

    def _in_span(self, step: int) -> bool:
        start, release = self._span
        return (start is None or step >= start) and (release is None or step < release)

    @override
    def on_pulse_phase_change(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, change: PhaseChange
    ) -> None:
        """Release everything when a burst starts; freeze the last stable prefix when a light phase starts."""
        self._phase_enabled = change.current in self.phases
        if self.freezer is None:
            return
        before = self.freezer.frozen_prefix
        enabled = self._phase_enabled and self._in_span(trainer.global_step)
        if change.reason == "resume":
            # a restored state holds the frozen set of the moment it was saved; after a rollback the clock did
            # not go back, so a prefix saved in a light phase must not stay frozen in a burst
            changed = not enabled and self.freezer.release_all()
        elif enabled:
            changed = self.freezer.freeze_from_last_check()
        else:
            changed = self.freezer.release_all()
        if changed:
            self._record(trainer.global_step, before, f"phase:{change.current.value}")

    def on_pulse_parameters_replaced(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, remap: Any
    ) -> None:
        """Follow parameters that structured pruning replaced: units, window snapshots, FLOP measurements."""
        if self.freezer is not None:
            self.freezer.replace_parameters(remap)
        if self._trace is not None:
            replace_unit_parameters(self._trace.units, remap)
        self.ledger.remeasure()
        self._replan(again=True)

    # ------------------------------------------------------------------ end
    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._end_fit()
        if self._replay is not None:
            self._replay.detach(trainer.train_dataloader)

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._end_fit()

    def _end_fit(self) -> None:
        self._fit_refs = None
        self._close_contexts()
        if self.freezer is not None:
            # the user's module leaves fit exactly as it came in: every parameter trainable
            self.freezer.restore_requires_grad()

    def _close_contexts(self) -> None:
        if self.activations is not None:
            self.activations.end_batch()
        if self._trace is not None:
            self._trace.close()
        self.ledger.close()

    # ------------------------------------------------------------------ state
    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "cache": self.freezer.state_dict() if self.freezer is not None else None,
            "ledger": self.ledger.state_dict(),
            "events": list(self.events),
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the state of :meth:`state_dict`.

        Before training starts (a checkpoint restore, which Lightning runs before the strategy wraps the model)
        the state is applied in ``on_train_start``: DDP must see every parameter trainable when it wraps the
        model. During training (a :class:`~lightning_pulse.StabilityGuard` rollback) it applies at once: scores,
        windows and timers return to the saved ones, the saved frozen set gets ``requires_grad`` off and every
        other unit on, and the activation cache starts over. The FLOP ledger and ``events`` keep counting what
        really ran.
        """
        if self._fit_refs is None:
            self._pending_state = dict(state_dict)
            return
        trainer, pl_module = self._fit_refs
        self._close_contexts()
        before = self.freezer.frozen_prefix if self.freezer is not None else 0
        units = self.freezer.units if self.freezer is not None else None
        self.freezer = restore_freezer(self.freezer, state_dict["cache"], pl_module, self.settings)
        if self.freezer is not None:
            self._trace = None
        elif units is not None:
            # saved before the first backward: the units are traced into forward order again
            self._trace = ForwardOrderTrace(units)
        # the records were made with parameters the rollback may have changed: record again
        self._replan(again=True)
        self.ledger.new_step()
        after = self.freezer.frozen_prefix if self.freezer is not None else 0
        if after != before:
            self.events.append(
                {"step": int(trainer.global_step), "from": before, "to": after, "reason": "restore"}
            )

    # ------------------------------------------------------------------ reporting
    def _record(self, step: int, before: int, reason: str) -> None:
        assert self.freezer is not None
        self.events.append(
            {"step": int(step), "from": before, "to": self.freezer.frozen_prefix, "reason": reason}
        )
        self._replan()

    def _log(self, trainer: pl.Trainer, frozen_share: float, frozen_prefix: int) -> None:
        assert self.freezer is not None
        metrics = {
            "frozen_share": frozen_share,
            "frozen_units": float(frozen_prefix),
            "staleness": float(self.freezer.staleness),
            "backward_flops_skipped": self.ledger.step_skipped if self.measure_flops else None,
            "backward_flops_skipped_share": self.ledger.skipped_share,
            "cache_hit_rate": self.freezer.cache_hit_rate,
            "activation_hit_rate": self.activations.hit_rate if self.activations is not None else None,
        }
        # straight to the loggers, like PulseCycle: cheaper than `pl_module.log` every step
        if trainer.is_global_zero:
            logged = {METRIC_PREFIX + k: v for k, v in metrics.items() if v is not None}
            for logger in trainer.loggers:
                logger.log_metrics(logged, step=trainer.global_step)


def _log_shared(units: Sequence[FreezeUnit]) -> None:
    if (note := pinned_note(units)) is not None:
        rank_zero_info(f"GradientCache: {note}.")


def _from_rank_zero(trainer: pl.Trainer) -> Callable[[list[Any]], list[Any]] | None:
    """Under DDP, a function that gives every process rank 0's list; ``None`` in a single process."""
    if trainer.world_size == 1:
        return None
    strategy = trainer.strategy
    return lambda values: list(strategy.broadcast(values, src=0))
