"""GradientCache: freeze the leading modules whose gradients have stabilised, so backward really stops early.

The algorithm lives in :mod:`lightning_pulse.core.gradient_cache`; this file is the Lightning glue.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_pulse.callbacks.pulse_cycle import phase_of
from lightning_pulse.core.gradient_cache import (
    SCALINGS,
    SCHEDULES,
    BackwardFlopLedger,
    CacheSettings,
    FreezeUnit,
    ModuleGradientCache,
    PrefixActivationCache,
    StepReport,
    discover_units,
    freezeout_factor,
    freezeout_points,
    order_units,
    record_gradient_order,
)
from lightning_pulse.phase import PHASE_NAMES, Phase, PhaseChange

if TYPE_CHECKING:
    from lightning_pulse.core.sample_index import SampleIndexTracker

METRIC_PREFIX = "gradient_cache/"


class GradientCache(Callback):
    r"""Caches per-module gradients and stops computing them for the leading modules that have stabilised.

    Every ``check_every`` optimizer steps each module unit (embedding, block, head, ... found automatically,
    in forward order) compares its fresh window-mean gradient with its cache. The longest run of stable units
    from the input side is frozen: their parameters get ``requires_grad=False``, so autograd stops backward
    at the first trainable unit and the frozen prefix costs no backward FLOPs at all (neither weight nor
    input gradients). A freeze lasts at most ``freeze_for`` steps; then the prefix trains for one window to
    refresh its cache and is frozen again only if the fresh gradient still passes the test.

    Frozen parameters get ``grad=None`` before the optimizer step, so torch optimizers leave them and their
    state alone (no momentum, no weight decay). With ``frozen_update="cached"`` they keep moving by their
    cached mean gradient times ``cached_decay ** staleness`` instead (the optimizer then treats it as a
    gradient, momentum included).

    Phases: freezing happens only in the phases named by ``phases`` (default: the light phases replay and
    maintain); a burst phase releases everything and keeps the caches fresh. With no
    :class:`~lightning_pulse.PulseCycle` in the Trainer the callback behaves as if always in the replay
    phase, i.e. it freezes continuously (plain Egeria/AutoFreeze-style training). ``start_at`` delays the
    first freeze and ``release_at`` ends all freezing for the rest of the run.

    Gradients are read in ``on_before_optimizer_step``: after gradient accumulation and DDP's all-reduce,
    before clipping. Under DDP the freeze decisions of rank 0 are broadcast, so every rank freezes the same
    units; the DDP strategy must be built with ``find_unused_parameters=True`` because frozen parameters
    drop out of the autograd graph, and must not use ``static_graph``.

    ``schedule="freezeout"`` replaces the stability test by FreezeOut's schedule (Brock et al. 2017): unit ``i``
    of the ``m`` freezable units gets the point ``t_i = (t0 + (1 - t0) * i / m) ** p`` (``p`` = 1, 2, 3 for
    ``scaling`` linear, squared, cubic) of the span from ``start_at`` to the end of the run; its learning rate
    is multiplied by ``0.5 * (1 + cos(pi * progress / t_i))`` over that span and it is frozen for good when the
    factor reaches zero, so freezing never jolts the loss. The factor multiplies whatever the user's optimizer
    and scheduler chose: the callback scales the unit's parameter update after each ``optimizer.step()``
    (``theta <- theta_before + factor * (theta_after - theta_before)``), which equals scaling that unit's
    learning rate for optimizers whose state does not depend on the learning rate (SGD with or without
    momentum, Adam, AdamW, RMSprop, ...), and leaves the user's module and optimizer untouched. The points are
    fixed by the step count, so every DDP rank and every resumed run makes the same decisions.

    With a :class:`~lightning_pulse.StabilityGuard` in the Trainer the caches, timers and frozen set roll
    back with the model (``restore_on_rollback``): ``load_state_dict`` called during training applies at once.

    Args:
        measure: how a unit's fresh gradient is compared with its cache. ``"plasticity"``: the unit's relative
            parameter movement over the window, divided by the largest it ever had (stable when <=
            ``threshold``; a parameter-space stand-in for Egeria's plasticity). ``"cosine"``: cosine similarity
            of the window-mean gradient with the cached one (stable when >= ``threshold``).
            ``"norm_change"``: AutoFreeze's relative change of the gradient norm (stable when <= ``threshold``).
        threshold: the stability threshold; ``None`` takes the measure's default (plasticity 0.2, cosine 0.5,
            norm_change 0.2).
        check_every: optimizer steps per gradient window; caches are checked at the end of every window.
        freeze_for: longest freeze, in optimizer steps, before a unit must refresh its cache (a multiple of
            ``check_every``).
        max_frozen_share: largest share of the trainable parameters that may be frozen at once, in (0, 1].
            The last unit in forward order (usually the head) always trains.
        frozen_update: ``"none"`` (frozen units stand still) or ``"cached"`` (they apply their decayed cached
            gradient). ``None``: ``"none"`` in ``mode="freeze"``, ``"cached"`` in ``mode="stale_replay"``.
        cached_decay: per-step decay of the cached gradient applied with ``frozen_update="cached"``, in [0, 1].
        mode: ``"freeze"`` freezes only stable units. ``"stale_replay"`` (opt-in, weakly supported by the
            literature) freezes every unit but the last regardless of stability and replays their stale
            cached gradients between refreshes.
        phases: the pulse phases in which units may be frozen.
        start_at: no freezing before this point (a warm-up): an ``int`` optimizer step, or a ``float`` share of
            the run's optimizer steps in [0, 1]. ``None``: from the start (the first check needs two windows).
            With ``schedule="freezeout"``: where the per-unit annealing starts (``None``: step 0, the paper).
        release_at: from this point on nothing is frozen: an ``int`` optimizer step, or a ``float`` share of
            the run's optimizer steps in [0, 1]. ``None``: never. Not with ``schedule="freezeout"``.
        units: explicit units as qualified module or parameter names, in forward order is not required (the
            order is traced). ``None`` finds them automatically.
        min_units: the automatic split expands the largest module until there are this many units.
        measure_flops: measure the backward FLOPs of each frozen-prefix length once with
            ``torch.utils.flop_counter`` and report FLOPs skipped. The measured backward runs about 3x slower.
        activation_cache_mb: memory for the activation cache (0: off). When the training DataLoader's sample
            indices can be tracked, the outputs of frozen modules are recorded per sample and replayed on later
            visits, so the frozen prefix's forward is skipped too. Only for data whose samples are the same at
            every visit (no random augmentation; checked once per freeze, and the cache switches itself off on
            a mismatch); modules with dropout or batch norm in training mode are not cached. Not with
            ``frozen_update='cached'``, where frozen modules move.
        schedule: ``"adaptive"`` (freeze the units that pass the ``measure`` test, release them to refresh) or
            ``"freezeout"`` (anneal each unit's learning rate to zero on its own cosine and freeze it for good
            then; ``measure``, ``threshold``, ``freeze_for`` and ``phases`` no longer decide anything). FreezeOut
            needs ``mode="freeze"``, ``frozen_update`` ``None``/``"none"``, no ``release_at``, and a run of known
            length (``max_epochs`` or ``max_steps``).
        t0: FreezeOut: where the first unit stops, before ``scaling`` (cubic 0.5 stops it at 12.5% of the
            span), in (0, 1).
        scaling: FreezeOut: ``"linear"``, ``"squared"`` or ``"cubic"`` spacing of the freeze points.
        scale_lr: FreezeOut: multiply unit ``i``'s factor by ``1 / t_i`` from the start of the annealing span
            (the paper's LR scaling, so early units do not lose most of their learning), up to ``1 / t0 ** p``.

    Raises:
        ValueError: at construction, naming the field, for an unknown ``measure``/``mode``/``frozen_update``
            or phase, a non-positive window, ``freeze_for`` not a multiple of ``check_every``, a threshold,
            share or decay out of range, or a bad ``start_at``/``release_at``. At setup, for manual optimization, a DDP
            strategy without ``find_unused_parameters=True`` or with ``static_graph=True``, or a multi-process
            strategy other than DDP. At fit start, for a ``units`` name the model does not have.

    Example::

        from lightning import Trainer
        from lightning_pulse import GradientCache, PulseCycle

        trainer = Trainer(max_epochs=20, callbacks=[PulseCycle(burst=200, replay=100, maintain=20), GradientCache()])

    The same in LightningCLI YAML::

        trainer:
          callbacks:
            - class_path: lightning_pulse.PulseCycle
              init_args: {burst: 200, replay: 100, maintain: 20}
            - class_path: lightning_pulse.GradientCache
              init_args: {measure: plasticity, check_every: 20, freeze_for: 200}
    """

    # load_state_dict works mid-run, so StabilityGuard rolls the caches and the frozen set back with the model
    restore_on_rollback = True

    def __init__(
        self,
        measure: str = "plasticity",
        threshold: float | None = None,
        check_every: int = 20,
        freeze_for: int = 200,
        max_frozen_share: float = 0.9,
        frozen_update: str | None = None,
        cached_decay: float = 0.9,
        mode: str = "freeze",
        phases: Sequence[str] = ("replay", "maintain"),
        start_at: int | float | None = None,
        release_at: int | float | None = None,
        units: Sequence[str] | None = None,
        min_units: int = 8,
        measure_flops: bool = True,
        activation_cache_mb: float = 0.0,
        schedule: str = "adaptive",
        t0: float = 0.5,
        scaling: str = "cubic",
        scale_lr: bool = False,
    ) -> None:
        super().__init__()
        self.settings = CacheSettings(
            measure=measure,
            threshold=threshold,
            check_every=check_every,
            freeze_for=freeze_for,
            max_frozen_share=max_frozen_share,
            frozen_update=frozen_update,
            cached_decay=cached_decay,
            mode=mode,
        )
        if isinstance(phases, str) or not all(name in PHASE_NAMES for name in phases) or not phases:
            raise ValueError(
                f"`phases`={phases!r} must be a non-empty list of phase names from {list(PHASE_NAMES)}."
            )
        for name, point in (("start_at", start_at), ("release_at", release_at)):
            if point is None:
                continue
            if isinstance(point, bool) or not isinstance(point, (int, float)):
                raise ValueError(f"`{name}`={point!r} must be an int step, a float share in [0, 1], or None.")
            if isinstance(point, int) and point < 0:
                raise ValueError(f"`{name}`={point!r} must be a non-negative int step.")
            if isinstance(point, float) and not 0.0 <= point <= 1.0:
                raise ValueError(f"`{name}`={point!r} must be a float share in [0, 1] of the run.")
        if units is not None and (
            isinstance(units, str) or not units or not all(isinstance(u, str) for u in units)
        ):
            raise ValueError(
                f"`units`={units!r} must be None or a non-empty list of module or parameter names."
            )
        if isinstance(min_units, bool) or not isinstance(min_units, int) or min_units < 2:
            raise ValueError(f"`min_units`={min_units!r} must be an int >= 2.")
        if (
            isinstance(activation_cache_mb, bool)
            or not isinstance(activation_cache_mb, (int, float))
            or not 0 <= activation_cache_mb < math.inf
        ):
            raise ValueError(
                f"`activation_cache_mb`={activation_cache_mb!r} must be a finite number >= 0 (0 is off)."
            )
        if activation_cache_mb and self.settings.effective_frozen_update == "cached":
            raise ValueError(
                f"`activation_cache_mb`={activation_cache_mb!r} needs frozen units that stand still, but "
                f"`frozen_update` is 'cached' (mode={mode!r}); set `activation_cache_mb=0` or `frozen_update='none'`."
            )
        if schedule not in SCHEDULES:
            raise ValueError(f"`schedule`={schedule!r} is not one of {list(SCHEDULES)}.")
        if isinstance(t0, bool) or not isinstance(t0, (int, float)) or not 0.0 < t0 < 1.0:
            raise ValueError(f"`t0`={t0!r} must be a number in (0, 1).")
        if scaling not in SCALINGS:
            raise ValueError(f"`scaling`={scaling!r} is not one of {list(SCALINGS)}.")
        if not isinstance(scale_lr, bool):
            raise ValueError(f"`scale_lr`={scale_lr!r} must be a bool.")
        if schedule == "freezeout":
            if mode != "freeze":
                raise ValueError(
                    f"`mode`={mode!r} contradicts `schedule`='freezeout', which freezes annealed units for good; "
                    "use `mode`='freeze'."
                )
            if self.settings.effective_frozen_update != "none":
                raise ValueError(
                    f"`frozen_update`={frozen_update!r} contradicts `schedule`='freezeout': an annealed unit's "
                    "learning rate is zero when it freezes; leave it None or 'none'."
                )
            if release_at is not None:
                raise ValueError(
                    f"`release_at`={release_at!r} is not allowed with `schedule`='freezeout', whose units stay "
                    "frozen once their learning rate reached zero; leave it None."
                )
        self.schedule = schedule
        self.t0 = float(t0)
        self.scaling = scaling
        self.scale_lr = scale_lr
        self.phases = tuple(Phase(name) for name in phases)
        self.start_at = start_at
        self.release_at = release_at
        self.unit_names = list(units) if units is not None else None
        self.min_units = min_units
        self.measure_flops = bool(measure_flops)
        self.activation_cache_mb = float(activation_cache_mb)

        self.cache: ModuleGradientCache | None = None
        self.ledger = BackwardFlopLedger()
        self.events: list[dict[str, Any]] = []  # every change of the frozen prefix: step, units, reason
        self._pending_state: dict[str, Any] | None = None
        # set from on_train_start to the end of training: a load_state_dict then applies at once (a rollback)
        self._fit_refs: tuple[pl.Trainer, pl.LightningModule] | None = None
        self._unit_specs: list[FreezeUnit] | None = None
        self._trace: AbstractContextManager[list[str]] | None = None
        self._trace_order: list[str] | None = None
        self._flop_context: AbstractContextManager[None] | None = None
        # FreezeOut: each freezable unit's stop step, the annealing start, the hooks on optimizer.step(), and
        # the (parameter, value before the step, factor) of the annealing units for the step in progress
        self.freeze_steps: list[float] = []
        self._anneal_start = 0.0
        self._total_steps = 0.0
        self._step_hooks: list[Any] = []
        self._before_step: list[tuple[list[torch.Tensor], list[torch.Tensor], float]] = []
        self.anneal_factor = 1.0  # FreezeOut: the smallest factor of a unit still training, last step
        self._phase_enabled = True
        self._start_step: int | None = None
        self._release_step: int | None = None
        self._step_skipped = 0.0
        self.activations: PrefixActivationCache | None = None
        self._tracker: SampleIndexTracker | None = None
        self._modules: dict[str, torch.nn.Module] = {}
        self._warned_activations = False
        # process CPU seconds spent in this callback's per-step bookkeeping, and in the measured backwards
        self.hook_cpu_s = 0.0
        self.flop_measure_cpu_s = 0.0
        self._measure_started = 0.0

    # ------------------------------------------------------------------ setup
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if not pl_module.automatic_optimization:
            raise ValueError(
                "GradientCache needs automatic optimization (`automatic_optimization=True`); it reads gradients in "
                "`on_before_optimizer_step` of the single optimizer Lightning steps for you."
            )
        # a new fit starts from scratch unless a checkpoint restore (which comes after setup) says otherwise
        self.cache = None
        self.ledger = BackwardFlopLedger()
        self.events = []
        self._pending_state = None
        self._fit_refs = None
        self._unit_specs = None
        self._warned_activations = False
        self.hook_cpu_s = 0.0
        self.flop_measure_cpu_s = 0.0

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        check_strategy(trainer)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start_step = self._resolve_step(trainer, "start_at", self.start_at)
        self._release_step = self._resolve_step(trainer, "release_at", self.release_at)
        if self.schedule == "freezeout":
            self._start_freezeout(trainer)
        self._phase_enabled = phase_of(trainer, default=Phase.REPLAY) in self.phases
        self._setup_activation_cache(trainer, pl_module)
        named = {name: p for name, p in pl_module.named_parameters() if p.requires_grad}
        self._fit_refs = (trainer, pl_module)
        if self._pending_state is not None:
            state, self._pending_state = self._pending_state, None
            if state["cache"] is not None:
                self.cache = self._cache_from_state(state["cache"], pl_module)
                # applied here, after the strategy wrapped the model: DDP must see every parameter trainable
                self.cache.apply_requires_grad()
                self._replan()
            self.ledger.load_state_dict(state["ledger"])
            self.events = list(state["events"])
            if self.cache is not None:
                return
        # fresh run (or a checkpoint from before the first backward): units are ordered at the first backward
        self._unit_specs = discover_units(pl_module, self.min_units, self.unit_names)
        for unit in self._unit_specs:
            unit.bind(named)

    def _cache_from_state(
        self, cache_state: dict[str, Any], pl_module: pl.LightningModule
    ) -> ModuleGradientCache:
        units = [
            FreezeUnit(name, list(params), used=bool(used))
            for name, params, used in zip(
                cache_state["units"], cache_state["unit_params"], cache_state["used"]
            )
        ]
        # restored units may be frozen now or were frozen when saved: bind against every parameter
        everything = dict(pl_module.named_parameters())
        for unit in units:
            unit.bind(everything)
        cache = ModuleGradientCache(units, self.settings)
        cache.load_state_dict(cache_state)
        return cache

    def _setup_activation_cache(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.activations, self._tracker = None, None
        self._modules = dict(pl_module.named_modules())
        if not self.activation_cache_mb:
            return
        from lightning_pulse.core.sample_index import SampleIndexTracker

        loader = trainer.train_dataloader
        reason = SampleIndexTracker.unsupported_reason(loader)
        if reason is not None:
            rank_zero_warn(f"GradientCache: the activation cache is off because {reason}.")
            return
        self._tracker = SampleIndexTracker.install(loader)
        size = self._tracker.dataset_size
        self.activations = PrefixActivationCache(size, size, int(self.activation_cache_mb * 2**20))

    def _replan(self) -> None:
        if self.activations is None or self.cache is None:
            return
        frozen = [
            (unit.name, self._modules[unit.name])
            for unit, is_frozen in zip(self.cache.units, self.cache.frozen)
            if is_frozen and unit.name in self._modules
        ]
        self.activations.plan(frozen)

    def _end_activation_batch(self) -> None:
        if self.activations is None:
            return
        self.activations.end_batch()
        reason = self.activations.disabled_reason
        if reason is not None and not self._warned_activations:
            self._warned_activations = True
            rank_zero_warn(f"GradientCache: the activation cache switched itself off: {reason}.")

    @staticmethod
    def _resolve_step(trainer: pl.Trainer, name: str, point: int | float | None) -> int | None:
        if point is None or isinstance(point, int):
            return point
        total = float(trainer.estimated_stepping_batches)
        if not math.isfinite(total):
            raise ValueError(
                f"`{name}`={point!r} is a share of the run, which needs a finite max_steps or max_epochs; give an "
                "int step instead."
            )
        return int(round(point * total))

    # ------------------------------------------------------------------ FreezeOut
    def _start_freezeout(self, trainer: pl.Trainer) -> None:
        total = float(trainer.estimated_stepping_batches)
        if not math.isfinite(total):
            raise ValueError(
                "`schedule`='freezeout' anneals every unit to zero before the end of the run, which needs a finite "
                "max_steps or max_epochs."
            )
        self._total_steps = total
        self._anneal_start = float(self._start_step or 0)
        self.freeze_steps = []  # filled once the units are in forward order (first backward or a restore)
        self._remove_step_hooks()
        self._step_hooks = [opt.register_step_post_hook(self._scale_update) for opt in trainer.optimizers]

    def _plan_freezeout(self) -> None:
        assert self.cache is not None
        span = max(self._total_steps - self._anneal_start, 0.0)
        points = freezeout_points(self.cache.schedulable_prefix, self.t0, self.scaling)
        self.freeze_steps = [self._anneal_start + span * point for point in points]

    def _freezeout_prefix(self, step: int) -> int:
        """How many leading units are frozen during optimizer step ``step`` (0-based)."""
        count = 0
        while count < len(self.freeze_steps) and self.freeze_steps[count] <= step:
            count += 1
        return count

    def _remember_annealing_units(self, step: int) -> None:
        """Before the update of step ``step``: keep the parameters of every unit whose factor is below 1."""
        assert self.cache is not None
        self._before_step = []
        factors = []
        span = max(self._total_steps - self._anneal_start, 1.0)
        for unit, frozen, stop in zip(self.cache.units, self.cache.frozen, self.freeze_steps):
            factor = freezeout_factor(step, self._anneal_start, stop)
            if self.scale_lr and step >= self._anneal_start:
                # FreezeOut's LR scaling: a unit that stops at share p of the span starts at 1/p of the LR
                factor *= span / max(stop - self._anneal_start, 1.0)
            if frozen or factor == 1.0:
                continue
            factors.append(factor)
            params = [p for p in unit.params if p.grad is not None]
            if params:
                self._before_step.append((params, [p.detach().clone() for p in params], factor))
        self.anneal_factor = min(factors, default=1.0)

    @torch.no_grad()
    def _scale_update(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        # theta <- factor * theta_after + (1 - factor) * theta_before: the unit's update times its factor
        before_step, self._before_step = self._before_step, []
        for params, before, factor in before_step:
            torch._foreach_mul_(params, factor)
            torch._foreach_add_(params, before, alpha=1.0 - factor)

    def _remove_step_hooks(self) -> None:
        for handle in self._step_hooks:
            handle.remove()
        self._step_hooks = []
        self._before_step = []

    # ------------------------------------------------------------------ forward and backward
    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._tracker is None or self.activations is None:
            return
        started = time.process_time()
        indices = self._tracker.batch_indices(batch_idx)  # asked for every batch, as the tracker requires
        if self.cache is not None and self.cache.frozen_prefix > 0:
            self.activations.begin_batch(indices)
        self.hook_cpu_s += time.process_time() - started

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._end_activation_batch()

    @override
    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor
    ) -> None:
        started = time.process_time()
        self._end_activation_batch()  # the forward is over: replayed modules get their own forward back
        if self.cache is None and self._unit_specs is not None and self._trace is None:
            params = {name: p for unit in self._unit_specs for name, p in zip(unit.param_names, unit.params)}
            self._trace = record_gradient_order(params)
            self._trace_order = self._trace.__enter__()
        prefix = self.cache.frozen_prefix if self.cache is not None else 0
        if self.measure_flops and self._flop_context is None and self.ledger.needs(prefix):
            self._flop_context = self.ledger.measuring(prefix)
            self._flop_context.__enter__()
            self._measure_started = time.process_time()
        self.hook_cpu_s += time.process_time() - started

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        started = time.process_time()
        prefix = self.cache.frozen_prefix if self.cache is not None else 0
        if self._flop_context is not None:
            context, self._flop_context = self._flop_context, None
            context.__exit__(None, None, None)
            self.flop_measure_cpu_s += time.process_time() - self._measure_started
            started = time.process_time()
        if self._trace is not None:
            self._finish_trace(trainer)
        if self.measure_flops:
            skipped = self.ledger.account(prefix)
            if skipped is not None:
                self._step_skipped += skipped
        self.hook_cpu_s += time.process_time() - started

    def _finish_trace(self, trainer: pl.Trainer) -> None:
        trace, self._trace = self._trace, None
        trace.__exit__(None, None, None)  # type: ignore[union-attr]
        order = list(self._trace_order or [])
        self._trace_order = None
        if trainer.world_size > 1:
            order = list(trainer.strategy.broadcast(order, src=0))
        units = order_units(self._unit_specs or [], order)
        self.cache = ModuleGradientCache(units, self.settings)
        self._unit_specs = None
        if self.cache.freezable_limit == 0:
            rank_zero_info("GradientCache: the model has a single trainable unit, so nothing can be frozen.")
        rank_zero_info(
            "GradientCache: units in forward order: "
            + ", ".join(f"{unit.name}({unit.numel})" + ("" if unit.used else "[unused]") for unit in units)
        )

    # ------------------------------------------------------------------ the step
    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if self.cache is None:
            return
        started = time.process_time()
        enabled_next = self._phase_enabled and self._in_freezing_span(trainer.global_step + 1)
        agree = None
        if trainer.world_size > 1:
            strategy = trainer.strategy

            def agree(flags: list[bool]) -> list[bool]:
                return list(strategy.broadcast(flags, src=0))

        before = self.cache.frozen_prefix
        target = None
        if self.schedule == "freezeout":
            if not self.freeze_steps:
                self._plan_freezeout()
            step = trainer.global_step
            self._remember_annealing_units(step)
            enabled_next, target = True, self._freezeout_prefix(step + 1)
        report = self.cache.after_backward(enabled_next, agree, target)
        if report.changed:
            reason = "freezeout" if target is not None else "check" if report.window_closed else "release"
            self._record(trainer.global_step + 1, before, reason)
            self._replan()
        # the metrics dict is built only for steps that reach a logger
        log_now = report.window_closed or trainer.global_step % max(trainer.log_every_n_steps, 1) == 0
        if log_now and trainer.loggers and trainer.is_global_zero:
            self._log(trainer, self._step_metrics(report))
        self._step_skipped = 0.0
        self.hook_cpu_s += time.process_time() - started

    def _step_metrics(self, report: StepReport) -> dict[str, float]:
        assert self.cache is not None
        metrics = {
            "frozen_share": report.frozen_share,
            "frozen_units": float(report.frozen_prefix),
            "staleness": float(self.cache.staleness),
        }
        if self.measure_flops:
            metrics["backward_flops_skipped"] = self._step_skipped
            share = self.ledger.skipped_share
            if share is not None:
                metrics["backward_flops_skipped_share"] = share
        if self.schedule == "freezeout":
            metrics["anneal_factor"] = self.anneal_factor
        hit_rate = self.cache.cache_hit_rate
        if hit_rate is not None:
            metrics["cache_hit_rate"] = hit_rate
        if self.activations is not None and self.activations.hit_rate is not None:
            metrics["activation_hit_rate"] = self.activations.hit_rate
        if report.similarity_at_refresh is not None:
            metrics["similarity_at_refresh"] = report.similarity_at_refresh
        return metrics

    def _in_freezing_span(self, step: int) -> bool:
        started = self._start_step is None or step >= self._start_step
        return started and (self._release_step is None or step < self._release_step)

    # ------------------------------------------------------------------ phases
    def on_pulse_phase_change(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, change: PhaseChange
    ) -> None:
        """Release everything when a burst starts; freeze the last stable prefix when a light phase starts.

        FreezeOut's schedule ignores phases."""
        self._phase_enabled = change.current in self.phases
        if self.cache is None or self.schedule == "freezeout":
            return
        before = self.cache.frozen_prefix
        enabled = self._phase_enabled and self._in_freezing_span(trainer.global_step)
        if change.reason == "resume":
            # a restored cache holds the frozen set of the moment it was saved; after a rollback the clock did
            # not go back, so a prefix saved in a light phase must not stay frozen in a burst
            changed = not enabled and self.cache.release_all()
        elif enabled:
            changed = self.cache.freeze_from_last_check()
        else:
            changed = self.cache.release_all()
        if changed:
            self._record(trainer.global_step, before, f"phase:{change.current.value}")
            self._replan()

    # ------------------------------------------------------------------ end
    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._fit_refs = None
        self._remove_step_hooks()
        self._close_contexts()
        if self._tracker is not None:
            type(self._tracker).uninstall(trainer.train_dataloader)
        if self.cache is not None:
            # the user's module leaves fit exactly as it came in: every parameter trainable
            self.cache.restore_requires_grad()

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._fit_refs = None
        self._remove_step_hooks()
        self._close_contexts()
        if self.cache is not None:
            self.cache.restore_requires_grad()

    def _close_contexts(self) -> None:
        if self.activations is not None:
            self.activations.end_batch()
        if self._flop_context is not None:
            context, self._flop_context = self._flop_context, None
            context.__exit__(None, None, None)
        if self._trace is not None:
            trace, self._trace = self._trace, None
            trace.__exit__(None, None, None)

    # ------------------------------------------------------------------ state
    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "cache": self.cache.state_dict() if self.cache is not None else None,
            "ledger": self.ledger.state_dict(),
            "events": list(self.events),
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the state of :meth:`state_dict`.

        Before training starts (a checkpoint restore, which Lightning runs before the strategy wraps the model)
        the state is applied in ``on_train_start``: DDP must see every parameter trainable when it wraps the
        model. During training (a :class:`~lightning_pulse.StabilityGuard` rollback) it applies at once: the
        caches, windows and timers return to the saved ones, the saved frozen set gets ``requires_grad`` off
        and every other unit on, and the activation cache starts over. The FLOP ledger and the event history
        keep counting what really ran.
        """
        if self._fit_refs is None:
            self._pending_state = dict(state_dict)
            return
        self._load_mid_run(dict(state_dict))

    def _load_mid_run(self, state: dict[str, Any]) -> None:
        trainer, pl_module = self._fit_refs  # type: ignore[misc]
        self._close_contexts()
        self._before_step = []  # a rollback between the snapshot and the update must not blend old weights in
        before = self.cache.frozen_prefix if self.cache is not None else 0
        cache_state = state["cache"]
        if self.cache is not None:
            self.cache.restore_requires_grad()
        if cache_state is None:
            if self.cache is not None:
                # saved before the first backward: the units are traced into forward order again
                self._unit_specs, self.cache = self.cache.units, None
        else:
            if self.cache is not None and [unit.name for unit in self.cache.units] == list(
                cache_state["units"]
            ):
                self.cache.load_state_dict(cache_state)
            else:
                self.cache = self._cache_from_state(cache_state, pl_module)
            self.cache.apply_requires_grad()
            self._unit_specs = None
        if self.activations is not None:
            # the records were made with parameters the rollback may have changed: record again
            self.activations.plan([])
            self._replan()
        self._step_skipped = 0.0
        after = self.cache.frozen_prefix if self.cache is not None else 0
        if after != before:
            self.events.append(
                {"step": int(trainer.global_step), "from": before, "to": after, "reason": "restore"}
            )

    # ------------------------------------------------------------------ reporting
    def _record(self, step: int, before: int, reason: str) -> None:
        assert self.cache is not None
        after = self.cache.frozen_prefix
        self.events.append({"step": int(step), "from": before, "to": after, "reason": reason})

    @staticmethod
    def _log(trainer: pl.Trainer, metrics: dict[str, float]) -> None:
        # straight to the loggers, like PulseCycle: cheaper than `pl_module.log` every step
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(
                    {METRIC_PREFIX + k: v for k, v in metrics.items()}, step=trainer.global_step
                )

    @property
    def frozen_units(self) -> list[str]:
        """Names of the units frozen now."""
        if self.cache is None:
            return []
        return [unit.name for unit, frozen in zip(self.cache.units, self.cache.frozen) if frozen]

    def benchmark_metrics(self) -> dict[str, Any]:
        """Run totals for the benchmark harness (all prefixed ``gc_``)."""
        cache = self.cache
        return {
            "gc_units": [unit.name for unit in cache.units] if cache else [],
            "gc_mean_frozen_share": cache.mean_frozen_share if cache else 0.0,
            "gc_backward_flops_skipped_share": self.ledger.skipped_share,
            "gc_backward_flops_skipped": self.ledger.skipped,
            "gc_backward_flops_by_prefix": dict(self.ledger.flops_by_prefix),
            "gc_cache_checks": cache.cache_checks if cache else 0,
            "gc_cache_hit_rate": cache.cache_hit_rate if cache else None,
            "gc_mean_similarity_at_refresh": cache.mean_similarity_at_refresh if cache else None,
            "gc_freezes": cache.freezes if cache else 0,
            "gc_prefix_changes": len(self.events),
            "gc_activation_hit_rate": self.activations.hit_rate if self.activations else None,
            "gc_activation_mb": self.activations.bytes_used / 2**20 if self.activations else 0.0,
            "gc_last_scores": {u.name: score for u, score in zip(cache.units, cache.scores)} if cache else {},
            "gc_first_frozen_step": self._first_frozen_steps(),
            "gc_freeze_steps": {unit.name: stop for unit, stop in zip(cache.units, self.freeze_steps)}
            if cache
            else {},
            "gc_hook_cpu_s": self.hook_cpu_s,
            "gc_flop_measure_cpu_s": self.flop_measure_cpu_s,
        }

    def _first_frozen_steps(self) -> dict[str, int]:
        """The optimizer step at which each unit was first frozen (units never frozen are left out)."""
        if self.cache is None:
            return {}
        names = [unit.name for unit in self.cache.units]
        first: dict[str, int] = {}
        for event in self.events:
            for index in range(event["from"], event["to"]):
                first.setdefault(names[index], int(event["step"]))
        return first


def check_strategy(trainer: pl.Trainer) -> None:
    """Raise a ValueError naming the fix if the Trainer's strategy cannot follow ``requires_grad`` changes.

    DDP registers every trainable parameter with its reducer when it wraps the model and, by default, waits
    for a gradient from each of them in every backward. A frozen parameter never produces one, so DDP must
    look for unused parameters (``find_unused_parameters=True``) and must not assume a static graph.
    """
    model = trainer.strategy.model
    if isinstance(model, DistributedDataParallel):
        if getattr(model, "static_graph", False):
            raise ValueError(
                "GradientCache changes which parameters get gradients, which `static_graph=True` forbids; use "
                "`DDPStrategy(find_unused_parameters=True)` without `static_graph`."
            )
        if not model.find_unused_parameters:
            raise ValueError(
                "GradientCache freezes parameters after DDP wrapped the model, so DDP must skip parameters that get "
                "no gradient: use `strategy=DDPStrategy(find_unused_parameters=True)` or the strategy name "
                "'ddp_find_unused_parameters_true' ('ddp_spawn_find_unused_parameters_true' for spawn)."
            )
        return
    if trainer.world_size > 1:
        raise ValueError(
            f"GradientCache supports single-process training and DDP; {type(trainer.strategy).__name__} shards or "
            "flattens parameters, so per-module `requires_grad` changes would not take effect. Use DDP."
        )
