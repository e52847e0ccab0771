"""HardSampleReplay: train replay phases on the hardest samples only, with no change to the LightningModule."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_pulse import _lightning_compat as compat
from lightning_pulse.callbacks.pulse_cycle import phase_of, pulse_cycle_of
from lightning_pulse.core.per_sample_loss import (
    LossCapture,
    PerSampleScorer,
    concat_per_sample,
    loss_capture_scope,
)
from lightning_pulse.core.sample_index import SampleIndexTracker
from lightning_pulse.core.sample_scores import SCORES, HardSampleBuffer, SampleScoreTable
from lightning_pulse.core.selection import (
    RULES,
    Selection,
    assign_in_place,
    batch_size_of,
    concat_samples,
    infobatch_prune,
    select_proportional,
    select_random,
    select_topk,
    take_samples,
)
from lightning_pulse.phase import PHASE_NAMES, Phase, parse_duration

TRACKING_MODES = ("auto", "index", "buffer")
MODES = ("batch", "epoch")

# why a sample was in the batch training_step saw
_UNTOUCHED, _SELECTED, _POOL, _UNSEEN = 0, 1, 2, 3
_ROLE_NAMES = ("untouched", "selected", "pool", "unseen")


class HardSampleReplay(Callback):
    r"""Trains replay phases on the hardest samples: smaller batches of high-loss samples, so less compute.

    Every training step, the loss the module already computes is captured per sample (a scoped hook on the
    ``torch.nn.functional`` losses, which ``torch.nn`` loss modules also use; no second forward pass) and
    stored in a score table keyed by dataset index. In the phases listed in ``phases`` (by default the
    replay phase of a :class:`~lightning_pulse.PulseCycle`; continuously when no PulseCycle is attached),
    each batch the DataLoader delivers is cut down *before* the forward pass to the samples the ``rule``
    selects from their stored (age-weighted) scores: a batch of ``B`` trains on about ``replay_fraction * B``
    samples, so the step costs about ``replay_fraction`` of a full one. The number of steps per epoch does not
    change, so step-based LR schedulers (``OneCycleLR``) and ``max_steps`` work as configured. Other phases
    train untouched (their losses still refresh the scores).

    Samples never scored are always trained on (so the first epoch of a standalone run is a full one).
    With ``pool_fraction > 0``, part of each replay batch is instead made of the hardest samples of the
    whole table (fetched by index from the dataset), a replay of samples seen earlier.

    ``mode="epoch"`` (standalone only) selects at the sampler instead: every epoch yields ``replay_fraction`` of
    the dataset, never-scored samples first, then the rule's choice, in full batches. The shorter epoch length
    is declared before Lightning reads it, so ``num_training_batches``, ``estimated_stepping_batches`` and
    ``OneCycleLR`` plan for it. It saves steps (and their fixed cost), not just FLOPs per step.

    Where dataset indices cannot be known (an ``IterableDataset``, a custom batch sampler), the callback keeps
    a bounded buffer of the hardest samples themselves and replays from it (``pool_fraction`` then defaults to
    0.5, since fresh samples have no score before their forward pass).

    Args:
        rule: how samples are chosen: ``"topk"`` (highest scores), ``"proportional"`` (drawn with probability
            proportional to ``score ** power``, as Selective-Backprop), ``"infobatch"`` (drop below-mean
            samples with probability ``prune_ratio`` and weight the kept ones by ``1/(1-prune_ratio)`` so the
            loss stays unbiased; the only rule that changes the loss value) or ``"random"`` (a uniform subset:
            the control, same compute as ``"topk"``).
        replay_fraction: share of each replay-phase batch that is trained on, in ``(0, 1]``; the compute of a
            replay step relative to a full one. Not used by ``"infobatch"``, whose batch size follows from
            ``prune_ratio``.
        pool_fraction: share of the trained samples of a replay step taken from the hardest samples of the
            whole table (or buffer) rather than from the current batch, in ``[0, 1)``. ``None``: 0 with index
            tracking, 0.5 in buffer mode. Must be 0 for ``"infobatch"``.
        prune_ratio: InfoBatch's ``r``, in ``[0, 1)``.
        power: exponent of the ``"proportional"`` rule, ``> 0``.
        score_half_life: age at which a stored score counts half (stale scores fade toward the running mean
            loss). An ``int`` counts optimizer steps, a ``float`` epochs, a string carries its unit
            (``"500steps"``, ``"2epochs"``); ``None`` turns age weighting off.
        phases: the phases in which batches are selected; other phases train untouched.
        tracking: ``"auto"`` (dataset indices when the DataLoader allows, else the buffer), ``"index"`` (fail if
            indices are unavailable) or ``"buffer"``.
        buffer_size: how many samples the hard-sample buffer holds (buffer mode only).
        mode: ``"batch"`` (smaller replay batches, same steps; works with PulseCycle, ``max_steps`` and any
            scheduler) or ``"epoch"`` (shorter epochs of full batches; without a PulseCycle, with dataset
            indices, rules ``"topk"``, ``"proportional"`` or ``"random"``).
        scorer: a :class:`~lightning_pulse.core.per_sample_loss.PerSampleScorer` for modules whose loss the
            capture cannot see; ``None`` captures the module's own ``torch.nn.functional`` / ``torch.nn`` loss.
        score: what a sample's stored score is: ``"loss"`` (its last measured loss) or ``"learnability"`` (its
            last loss minus the lowest loss it has had so far: RHO-LOSS's reducible loss, with the sample's own
            best standing in for the irreducible-loss model, so no second model; needs dataset indices).
        anneal: share of the run's optimizer steps, at its end, trained on untouched batches (InfoBatch's
            annealing, 0.125 in the paper); ``mode="batch"`` only, and the run's length must be known.
        seed: seed of the selection's random draws (identical on every rank).
        log_every_n_steps: how often metrics go to the loggers; ``None`` follows the Trainer's setting.

    Raises:
        ValueError: at construction, naming the argument, for a value outside the ranges above or a
            combination the mode does not support. At fit start, for ``tracking="index"`` or ``mode="epoch"``
            with a DataLoader whose indices cannot be tracked, an epoch-based half-life with an infinite
            DataLoader, or ``mode="epoch"`` next to a PulseCycle.
        RuntimeError: at the first training step whose loss yields no per-sample value (no
            ``torch.nn.functional`` loss splitting into the batch's samples was called and no ``scorer`` is
            set), saying what was captured and what to configure.

    Example::

        from lightning import Trainer
        from lightning_pulse import HardSampleReplay, PulseCycle

        trainer = Trainer(max_epochs=20, callbacks=[PulseCycle(burst=200, replay=100, maintain=20), HardSampleReplay()])

    The same in LightningCLI YAML::

        trainer:
          callbacks:
            - class_path: lightning_pulse.HardSampleReplay
              init_args: {rule: topk, replay_fraction: 0.5}
    """

    # load_state_dict works mid-run, so StabilityGuard rolls scores and buffer back with the model
    restore_on_rollback = True

    def __init__(
        self,
        rule: str = "topk",
        replay_fraction: float = 0.5,
        pool_fraction: float | None = None,
        prune_ratio: float = 0.5,
        power: float = 1.0,
        score_half_life: int | float | str | None = 5.0,
        phases: Sequence[str] = ("replay",),
        tracking: str = "auto",
        buffer_size: int = 4096,
        mode: str = "batch",
        scorer: PerSampleScorer | None = None,
        score: str = "loss",
        anneal: float = 0.0,
        seed: int = 0,
        log_every_n_steps: int | None = None,
    ) -> None:
        super().__init__()
        if rule not in RULES:
            raise ValueError(f"`rule`={rule!r} is not one of {list(RULES)}.")
        if _not_number(replay_fraction) or not 0.0 < replay_fraction <= 1.0:
            raise ValueError(f"`replay_fraction`={replay_fraction!r} must be a number in (0, 1].")
        if pool_fraction is not None and (_not_number(pool_fraction) or not 0.0 <= pool_fraction < 1.0):
            raise ValueError(f"`pool_fraction`={pool_fraction!r} must be None or a number in [0, 1).")
        if rule == "infobatch" and pool_fraction:
            raise ValueError(
                f"`pool_fraction`={pool_fraction!r} must be 0 or None with rule='infobatch': its 1/(1-r) rescale keeps "
                "the gradient unbiased only over the batch's own samples."
            )
        if _not_number(prune_ratio) or not 0.0 <= prune_ratio < 1.0:
            raise ValueError(f"`prune_ratio`={prune_ratio!r} must be a number in [0, 1).")
        if _not_number(power) or not power > 0:
            raise ValueError(f"`power`={power!r} must be a positive number.")
        self.half_life_duration = None
        if score_half_life is not None:
            self.half_life_duration = parse_duration(score_half_life, "score_half_life")
            if self.half_life_duration.kind == "seconds" or self.half_life_duration.is_zero:
                raise ValueError(
                    f"`score_half_life`={score_half_life!r} must be a positive number of steps (int, '500steps') or "
                    "epochs (float, '2epochs'), or None."
                )
        phases = [phases] if isinstance(phases, str) else list(phases)
        unknown = [p for p in phases if p not in PHASE_NAMES]
        if unknown or not phases:
            raise ValueError(
                f"`phases`={phases!r} must be a non-empty list of phases from {list(PHASE_NAMES)}."
            )
        if tracking not in TRACKING_MODES:
            raise ValueError(f"`tracking`={tracking!r} is not one of {list(TRACKING_MODES)}.")
        if mode not in MODES:
            raise ValueError(f"`mode`={mode!r} is not one of {list(MODES)}.")
        if mode == "epoch" and rule == "infobatch":
            raise ValueError(
                "`mode`='epoch' needs epochs of a length known in advance, which InfoBatch's random pruning does "
                "not give; use rule='topk', 'proportional' or 'random', or mode='batch'."
            )
        if mode == "epoch" and pool_fraction:
            raise ValueError(f"`pool_fraction`={pool_fraction!r} must be 0 or None with mode='epoch'.")
        if mode == "epoch" and tracking == "buffer":
            raise ValueError(
                "`tracking`='buffer' cannot be combined with mode='epoch', which needs dataset indices."
            )
        if isinstance(buffer_size, bool) or not isinstance(buffer_size, int) or buffer_size < 1:
            raise ValueError(f"`buffer_size`={buffer_size!r} must be a positive int.")
        if scorer is not None and not isinstance(scorer, PerSampleScorer):
            raise ValueError(f"`scorer`={scorer!r} must be a PerSampleScorer instance (or None).")
        if scorer is not None and rule == "infobatch":
            raise ValueError(
                "`scorer` cannot be combined with rule='infobatch': its 1/(1-r) rescale is applied through the "
                "captured loss, which a custom scorer replaces."
            )
        if score not in SCORES:
            raise ValueError(f"`score`={score!r} is not one of {list(SCORES)}.")
        if score != "loss" and tracking == "buffer":
            raise ValueError(
                f"`score`={score!r} needs dataset indices; it cannot be combined with tracking='buffer'."
            )
        if _not_number(anneal) or not 0.0 <= anneal < 1.0:
            raise ValueError(f"`anneal`={anneal!r} must be a number in [0, 1).")
        if anneal and mode == "epoch":
            raise ValueError(
                f"`anneal`={anneal!r} must be 0 with mode='epoch', whose epoch length is fixed when training starts."
            )
        if log_every_n_steps is not None and (
            isinstance(log_every_n_steps, bool)
            or not isinstance(log_every_n_steps, int)
            or log_every_n_steps < 1
        ):
            raise ValueError(f"`log_every_n_steps`={log_every_n_steps!r} must be a positive int or None.")
        self.rule = rule
        self.replay_fraction = float(replay_fraction)
        self.pool_fraction = pool_fraction
        self.prune_ratio = float(prune_ratio)
        self.power = float(power)
        self.phases = tuple(phases)
        self.tracking = tracking
        self.buffer_size = buffer_size
        self.mode = mode
        self.scorer = scorer
        self.score = score
        self.anneal = float(anneal)
        self.seed = int(seed)
        self.log_every_n_steps = log_every_n_steps

        self.tracker: SampleIndexTracker | None = None
        self.table: SampleScoreTable | None = None
        self.buffer: HardSampleBuffer | None = None
        self.untracked_reason: str | None = None
        self._loader: Any = None
        self._remove_hook: Any = None
        self._saved_state: dict[str, Any] | None = None
        self._capture: LossCapture | None = None
        self._batch: dict[str, Any] | None = None
        self._threshold = (math.nan, -1)  # (value, step it was computed at)
        self._recent_steps = 1
        self._threshold_every = 1
        self._apply_every = _APPLY_EVERY
        self._select_until: float = math.inf  # the step from which `anneal` trains untouched
        self._world_size = 1
        self._applied_since_threshold = (
            False  # a NaN threshold (nothing scored yet) is recomputed after an apply
        )
        self._half_life_steps: float | None = None
        self._totals = _zero_totals()
        self._window = _zero_totals()
        self._step_totals = _zero_totals()
        self._timing = {"scoring_s": 0.0, "selection_s": 0.0, "step_s": 0.0, "apply_s": 0.0}
        self._unapplied: list[_Measured] = []  # measured steps not yet applied to the table
        self._store_ready = (
            False  # the table or buffer of the current fit exists: load_state_dict applies at once
        )
        self._cycle_mark: float | None = (
            None  # CPU clock at the last batch start (step time = start to start)
        )
        self._scope: Any = None
        self._trainer: pl.Trainer | None = None
        self._epoch_offered_ratio = 1.0

    # ------------------------------------------------------------------ public
    @property
    def effective_pool_fraction(self) -> float:
        """``pool_fraction`` with its mode-dependent default resolved."""
        if self.pool_fraction is not None:
            return float(self.pool_fraction)
        return 0.5 if self.buffer is not None else 0.0

    @property
    def threshold(self) -> float:
        """The current hardness threshold: the score above which a sample counts as hard (``NaN`` early on)."""
        return self._threshold[0]

    @property
    def trained_indices(self) -> torch.Tensor | None:
        """Dataset indices ``(k,)`` of the samples the current training step trains on, in batch order (set
        from ``on_train_batch_start`` to ``on_train_batch_end``; ``None`` outside a step or in buffer mode)."""
        return None if self._batch is None else self._batch["indices"]

    @property
    def trained_origins(self) -> list[str] | None:
        """Why each sample of the current step is there: ``"untouched"`` (a phase that does not select),
        ``"selected"`` (chosen from the batch by the rule), ``"unseen"`` (never scored, always kept) or
        ``"pool"`` (replayed from the table or buffer)."""
        return None if self._batch is None else [_ROLE_NAMES[role] for role in self._batch["roles"]]

    def metrics(self) -> dict[str, float]:
        """Totals since fit start: replay fraction, pool share, losses by origin, table/buffer size, reuse.

        Measured steps reach the table and these totals in bulk (every 32 steps at most, at every epoch end and
        at the end of training), so during an epoch they may not count the most recent steps yet."""
        totals = self._totals
        figures = _figures(totals)
        store = self.table if self.table is not None else self.buffer
        if store is not None:
            figures.update(store.stats())
        figures["threshold"] = self.threshold
        return figures

    def benchmark_metrics(self) -> dict[str, float]:
        """Figures for ``benchmarks/harness.py``: :meth:`metrics` plus the CPU time spent scoring (loss capture,
        table update, gathering) and selecting (choosing and composing batches), each also as a share of the
        CPU time of the training steps (batch start to next batch start, so data loading and every hook
        count)."""
        figures = {f"hsr_{name}": value for name, value in self.metrics().items()}
        step = self._timing["step_s"]
        figures.update(
            hsr_scoring_s=self._timing["scoring_s"],
            hsr_selection_s=self._timing["selection_s"],
            hsr_step_s=step,
            hsr_scoring_share=self._timing["scoring_s"] / step if step else math.nan,
            hsr_selection_share=self._timing["selection_s"] / step if step else math.nan,
        )
        return figures

    # ------------------------------------------------------------------ setup
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._trainer = trainer
        self._store_ready = False  # until this fit's table or buffer exists
        self._unapplied = []
        if self._remove_hook is not None:
            self._remove_hook()
        self._remove_hook = compat.on_train_dataloader_ready(trainer, self._on_train_dataloader)

    def _on_train_dataloader(self, loader: Any) -> None:
        # runs inside Lightning's data setup, before the loader's first pass (and on a resume, after the
        # checkpoint's state was handed over), so the first epoch is tracked and can already be selected
        self._loader = loader
        self.tracker = None
        reason = "tracking='buffer' was asked for" if self.tracking == "buffer" else None
        reason = reason or SampleIndexTracker.unsupported_reason(loader)
        self.untracked_reason = reason
        if reason is not None:
            if self.tracking == "index" or self.mode == "epoch" or self.score != "loss":
                field = (
                    "tracking='index'"
                    if self.tracking == "index"
                    else ("mode='epoch'" if self.mode == "epoch" else f"score={self.score!r}")
                )
                raise ValueError(
                    f"HardSampleReplay: {field} needs dataset indices, but {reason}. Use mode='batch' with "
                    "tracking='auto' or 'buffer'."
                )
            return
        self.tracker = SampleIndexTracker.install(loader)
        size = self.tracker.dataset_size
        if self.table is None or self.table.num_samples != size or self.table.score != self.score:
            self.table = SampleScoreTable(size, score=self.score)
        self.buffer = None
        self.table.half_life = self._resolve_half_life(self._estimate_steps_per_epoch(loader))
        if self._saved_state is not None:
            self._load_saved_state()
        self._store_ready = True
        if self.mode == "epoch":
            self.tracker.select_passes(self._select_epoch, self._epoch_length)

    def _estimate_steps_per_epoch(self, loader: Any) -> float | None:
        try:
            batches = len(loader)
        except TypeError:
            return None
        accumulate = self._trainer.accumulate_grad_batches if self._trainer is not None else 1
        return float(math.ceil(batches / accumulate)) if batches else None

    def _resolve_half_life(self, steps_per_epoch: float | None) -> float | None:
        duration = self.half_life_duration
        if duration is None:
            return None
        if duration.kind == "steps":
            return duration.amount
        if steps_per_epoch is None:
            raise ValueError(
                f"HardSampleReplay: `score_half_life`={duration} is in epochs but the training DataLoader has no "
                "length; give it in steps."
            )
        return duration.amount * steps_per_epoch

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.mode == "epoch" and pulse_cycle_of(trainer) is not None:
            raise ValueError(
                "HardSampleReplay: mode='epoch' chooses each epoch's samples when the epoch starts, so it cannot "
                "follow a PulseCycle's step-based phases; use mode='batch' with a PulseCycle."
            )
        steps_per_epoch = _steps_per_epoch(trainer)
        self._world_size = trainer.world_size
        self._select_until = math.inf
        if self.anneal:
            total = trainer.estimated_stepping_batches
            if not math.isfinite(total):
                raise ValueError(
                    f"HardSampleReplay: `anneal`={self.anneal} needs a run of known length (max_epochs or max_steps "
                    "with a finite DataLoader)."
                )
            self._select_until = round(total * (1.0 - self.anneal))
        self._half_life_steps = self._resolve_half_life(steps_per_epoch)
        # a sample just trained on is not replayed again from the pool for a quarter epoch
        self._recent_steps = max(1, int(steps_per_epoch // 4)) if steps_per_epoch else 10
        self._threshold_every = max(1, int(steps_per_epoch // 2)) if steps_per_epoch else 50
        # metrics reach the loggers when measured steps are applied: often enough for the logging cadence (a
        # setting, not whether a logger is attached, so attaching one never changes what is selected)
        self._apply_every = min(_APPLY_EVERY, self.log_every_n_steps or max(trainer.log_every_n_steps, 1))

        if self.table is not None:
            self.table.half_life = self._half_life_steps
        else:
            if self.tracking == "auto":
                rank_zero_warn(
                    f"HardSampleReplay: sample indices cannot be tracked ({self.untracked_reason}); replaying from a "
                    f"buffer of the {self.buffer_size} hardest samples instead. Fresh samples have no score before "
                    "their forward pass, so the fresh part of a replay batch is a random subset."
                )
            if self.buffer is None:
                self.buffer = HardSampleBuffer(self.buffer_size, half_life=self._half_life_steps)
            self.buffer.half_life = self._half_life_steps
            if self._saved_state is not None:
                self._load_saved_state()
        self._store_ready = True
        self._window = _zero_totals()
        if self.scorer is None and self._scope is None:
            self._scope = loss_capture_scope()
            self._scope.__enter__()
        store = "table of dataset indices" if self.table is not None else "hard-sample buffer"
        rank_zero_info(
            f"HardSampleReplay: mode={self.mode}, rule={self.rule}, replay_fraction={self.replay_fraction:g}, "
            f"pool_fraction={self.effective_pool_fraction:g}, phases={list(self.phases)}, scores in a {store}."
        )

    # ------------------------------------------------------------------ epoch mode
    def _epoch_length(self, full_length: int) -> int:
        return max(1, round(self.replay_fraction * full_length))

    def _select_epoch(self, order: list[int]) -> list[int]:
        """The indices an epoch trains on: ``replay_fraction`` of the sampler's order, never-scored samples first,
        then the rule's choice among the scored ones; the sampler's (shuffled) order is kept."""
        count = min(self._epoch_length(len(order)), len(order))
        self._apply_measured()
        trainer = self._trainer
        step = trainer.global_step if trainer is not None else 0
        rank = trainer.global_rank if trainer is not None else 0
        candidates = torch.tensor(order, dtype=torch.long)
        scores = (
            self.table.effective(candidates, step).numpy()
            if self.table is not None
            else np.full(len(order), np.nan)
        )
        unseen = np.flatnonzero(np.isnan(scores))
        if unseen.size >= count:
            positions = unseen[:count]
        else:
            seen = np.flatnonzero(~np.isnan(scores))
            generator = torch.Generator().manual_seed(_mix(self.seed, step, -2, rank))
            chosen = self._select(torch.from_numpy(scores[seen]), count - unseen.size, step, generator)
            positions = np.concatenate([unseen, seen[chosen.positions.numpy()]])
        self._epoch_offered_ratio = len(order) / count
        return [order[p] for p in np.sort(positions)]

    # ------------------------------------------------------------------ per batch
    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        started = time.process_time()
        self._mark_cycle(started)
        self._close_capture()
        applied_before = self._timing["apply_s"]
        offered = batch_size_of(batch)
        if offered is None:
            raise RuntimeError(
                f"HardSampleReplay: the training batch ({type(batch).__name__}) holds no tensor, so its samples "
                "cannot be counted."
            )
        step = trainer.global_step
        indices = None
        if self.tracker is not None:
            indices = self.tracker.batch_indices(batch_idx)
            if indices.numel() != offered:
                raise RuntimeError(
                    f"HardSampleReplay: batch {batch_idx} holds {offered} samples but {indices.numel()} dataset "
                    "indices were recorded for it; the batch size must be the DataLoader's (no collate_fn that "
                    "adds or drops samples)."
                )
        active = phase_of(trainer, default=Phase.REPLAY).value in self.phases and step < self._select_until
        roles = np.full(offered, _UNTOUCHED, dtype=np.int64)
        weights = None
        pool_slots = None
        offered_for_metrics = float(offered)
        if active and self.mode == "epoch":
            # the epoch's sampler already chose these samples; say which had never been scored
            assert indices is not None and self.table is not None
            roles = np.where(np.isnan(self.table.scores[indices.numpy()]), _UNSEEN, _SELECTED)
            offered_for_metrics = offered * self._epoch_offered_ratio
        elif active:
            new_batch, indices, roles, weights, pool_slots = self._compose(
                trainer, batch, batch_idx, step, offered, indices
            )
            if new_batch is not None:
                try:
                    assign_in_place(batch, new_batch)
                except TypeError as error:
                    raise RuntimeError(
                        f"HardSampleReplay: cannot change the batch in place ({error}). Lightning ignores what a "
                        "callback returns, so the batch must be a list or dict (default_collate makes lists), or a "
                        "tuple of tensors."
                    ) from error
        trained = int(roles.size)
        self._batch = {
            "step": step,
            "indices": indices,
            "roles": roles,
            "pool_slots": pool_slots,
            "offered": offered_for_metrics,
            "trained": trained,
            "active": active,
        }
        selected = time.process_time()
        # time spent applying earlier steps' scores (a pool draw or a threshold needs them) is scoring
        self._timing["selection_s"] += selected - started - (self._timing["apply_s"] - applied_before)
        if self.scorer is None:
            self._capture = LossCapture(batch_size=trained, sample_weights=weights)
            self._capture.__enter__()
            self._timing["scoring_s"] += time.process_time() - selected

    def _compose(
        self,
        trainer: pl.Trainer,
        batch: Any,
        batch_idx: int,
        step: int,
        offered: int,
        indices: torch.Tensor | None,
    ) -> tuple[Any, torch.Tensor | None, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """``(new batch or None if unchanged, indices, roles, loss weights, buffer slots)`` of a replay step."""
        # top-k draws nothing; the other rules get a generator seeded by (seed, step, batch, rank), so a resumed
        # run draws what the uninterrupted one would have
        generator = None
        if self.rule != "topk" or self.table is None:
            generator = torch.Generator().manual_seed(_mix(self.seed, step, batch_idx, trainer.global_rank))
        budget = max(1, round(self.replay_fraction * offered))
        pool_count = round(self.effective_pool_fraction * budget)
        if self.table is not None:
            assert indices is not None
            scores = self.table.effective(indices, step)
            selection = self._select(scores, budget - pool_count, step, generator)
        else:
            # fresh samples have no score before their forward pass: until the buffer holds something the
            # whole batch is kept (it fills the buffer), then a random share is
            scores = torch.full((offered,), math.nan if self.buffer is None or self.buffer.size == 0 else 0.0)
            selection = select_random(scores, budget - pool_count, generator)
        roles = np.where(np.isnan(scores.numpy()[selection.positions.numpy()]), _UNSEEN, _SELECTED)
        weights = selection.weights
        if weights is not None and bool((weights == 1).all()):
            weights = None  # nothing pruned: leave the module's loss exactly as it is
        new_indices = indices[selection.positions] if indices is not None else None
        new_batch = None if selection.count == offered else take_samples(batch, selection.positions, offered)
        pool_slots = None
        # never-scored samples are always kept; the pool only fills what they leave of the budget
        pool_count = min(pool_count, max(0, budget - selection.count))
        if pool_count > 0:
            extra, extra_indices, pool_slots = self._pool_batch(trainer, step, pool_count, indices)
            if extra is not None:
                extra_count = batch_size_of(extra) or 0
                fresh = new_batch if new_batch is not None else batch
                new_batch = concat_samples(fresh, extra, selection.count, extra_count)
                roles = np.concatenate([roles, np.full(extra_count, _POOL)])
                if new_indices is not None and extra_indices is not None:
                    new_indices = torch.cat([new_indices, extra_indices])
        return new_batch, new_indices, roles, weights, pool_slots

    def _select(
        self, scores: torch.Tensor, count: int, step: int, generator: torch.Generator | None
    ) -> Selection:
        if self.rule == "topk":
            return select_topk(scores, count)
        if self.rule == "proportional":
            return select_proportional(scores, count, generator, self.power)
        if self.rule == "random":
            return select_random(scores, count, generator)
        return infobatch_prune(scores, self._current_threshold(step), self.prune_ratio, generator)

    def _pool_batch(
        self, trainer: pl.Trainer, step: int, count: int, indices: torch.Tensor | None
    ) -> tuple[Any, torch.Tensor | None, torch.Tensor | None]:
        pool_rule = (
            "random" if self.rule == "random" else ("proportional" if self.rule == "proportional" else "topk")
        )
        # the same draw on every rank; each rank replays its own share of it
        generator = torch.Generator().manual_seed(_mix(self.seed, step, -1, 0))
        self._apply_measured()
        if self.table is not None and self.tracker is not None:
            world = trainer.world_size
            picked = self.table.hardest(
                count * world,
                step,
                recent_steps=self._recent_steps,
                rule=pool_rule,
                generator=generator,
                power=self.power,
            )[trainer.global_rank :: world]
            if indices is not None and picked.numel():
                picked = picked[~torch.isin(picked, indices)]
            if picked.numel() == 0:
                return None, None, None
            extra = compat.prepare_extra_training_batch(trainer, self.tracker.fetch(picked))
            return extra, picked, None
        assert self.buffer is not None
        slots, extra = self.buffer.take(count, step, self._recent_steps, pool_rule, generator, self.power)
        if extra is None or slots.numel() == 0:
            return None, None, None
        return move_data_to_device(extra, trainer.strategy.root_device), None, slots

    @override
    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor
    ) -> None:
        # stop before backward: anything after (e.g. a maintain-phase probe) is not this batch's loss
        started = time.process_time()
        self._close_capture()
        context = self._batch
        if context is not None and self.scorer is None:
            self._check_captured(context)  # fail before the first optimizer step, not after it
        self._timing["scoring_s"] += time.process_time() - started

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        started = time.process_time()
        self._close_capture()
        context = self._batch
        if context is None:
            return
        self._batch = None
        # the step's per-sample losses are kept as they are (a capture, or the scorer's tensor, possibly on the
        # accelerator) and applied to the table every `_APPLY_EVERY` steps in one vectorized pass: no host
        # transfer, no per-step table writes
        losses = self._per_sample_losses(pl_module, batch, outputs, context)
        step = context["step"]
        threshold = self._current_threshold(step)
        entry = _Measured(
            context["indices"],
            losses,
            context["roles"],
            step,
            threshold,
            context["active"],
            context["offered"],
        )
        shared = self._world_size > 1
        if self.buffer is not None or shared:
            entry.losses = torch.from_numpy(_host_losses([losses]))
        if self.buffer is not None:
            self._update_buffer(batch, entry.losses, entry.roles, context["pool_slots"], step, threshold)
        if shared:
            # every rank keeps every rank's rows, so the tables and the selection stay identical
            entry.indices, entry.losses, entry.roles, entry.offered = _gather(
                trainer, entry.indices, entry.losses, entry.roles, entry.offered
            )
            entry.shared = True
        self._unapplied.append(entry)
        if len(self._unapplied) >= self._apply_every or self.buffer is not None:
            self._apply_measured()
        self._timing["scoring_s"] += time.process_time() - started

    def _mark_cycle(self, now: float | None) -> None:
        # a training step's full CPU cost (data loading, every hook, forward, backward, optimizer) is the time
        # from one batch start to the next; validation and epoch ends close the open interval instead
        if self._cycle_mark is not None:
            self._timing["step_s"] += time.process_time() - self._cycle_mark
        self._cycle_mark = now

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._mark_cycle(None)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._mark_cycle(None)
        self._apply_measured()  # the next epoch selects from every score of this one

    def _per_sample_losses(
        self, pl_module: pl.LightningModule, batch: Any, outputs: Any, context: dict
    ) -> LossCapture | torch.Tensor:
        trained = context["trained"]
        if self.scorer is not None:
            with torch.no_grad():
                losses = self.scorer(pl_module, batch, outputs, trained)
            losses = torch.as_tensor(losses).detach().flatten()
            if losses.numel() != trained:
                raise RuntimeError(
                    f"HardSampleReplay: the scorer {type(self.scorer).__name__} returned {losses.numel()} losses for a "
                    f"batch of {trained} samples."
                )
            return losses
        return self._check_captured(context)

    def _check_captured(self, context: dict) -> LossCapture:
        capture = context.get("capture")
        if capture is None or not capture.maps_onto_batch:
            account = capture.describe() if capture is not None else "training_step was not run"
            raise RuntimeError(
                f"HardSampleReplay found no per-sample loss in training_step ({account}; batch of "
                f"{context['trained']} samples). It captures torch.nn.functional losses (F.cross_entropy, "
                "F.mse_loss, ...) and torch.nn loss modules whose unreduced loss splits into the batch's samples, "
                "called during training_step. For any other loss, set `scorer=` to a PerSampleScorer, e.g. "
                "lightning_pulse.core.per_sample_loss.OutputKeyScorer (training_step returns per-sample losses) or "
                "ForwardLossScorer (a second, gradient-free forward pass)."
            )
        return capture

    def _apply_measured(self) -> None:
        """Apply the kept steps' losses to the table (one vectorized update) and to the running totals."""
        pending = self._unapplied
        if not pending:
            return
        started = time.process_time()
        self._unapplied = []
        losses = _host_losses([entry.losses for entry in pending])
        roles = np.concatenate([entry.roles for entry in pending])
        sizes = np.fromiter((entry.roles.size for entry in pending), dtype=np.int64, count=len(pending))
        if self.table is not None:
            indices = np.concatenate([entry.indices.numpy() for entry in pending])
            hard = None
            if any(entry.active for entry in pending):
                active = np.repeat([entry.active for entry in pending], sizes)
                hard = active & ((roles == _SELECTED) | (roles == _POOL))
            if any(entry.shared for entry in pending):  # DDP: repeated padding samples merge step by step
                for entry, start, size in zip(pending, np.cumsum(sizes) - sizes, sizes):
                    part = slice(int(start), int(start + size))
                    self.table.update(
                        indices[part], losses[part], entry.step, entry.threshold, may_repeat=True
                    )
                    if hard is not None and hard[part].any():
                        self.table.mark_replayed(indices[part][hard[part]], may_repeat=True)
            else:
                self.table.update_steps(
                    indices,
                    losses,
                    sizes,
                    [entry.step for entry in pending],
                    [entry.threshold for entry in pending],
                    replayed=hard,
                )
        self._count(pending, losses, roles)
        self._applied_since_threshold = True
        elapsed = time.process_time() - started
        self._timing["apply_s"] += elapsed
        self._timing["scoring_s"] += elapsed
        if self._trainer is not None:
            self._log(self._trainer)

    def _update_buffer(
        self,
        batch: Any,
        losses: torch.Tensor,
        roles: np.ndarray,
        pool_slots: torch.Tensor | None,
        step: int,
        threshold: float,
    ) -> None:
        assert self.buffer is not None
        is_pool = torch.from_numpy(roles == _POOL)
        if pool_slots is not None and bool(is_pool.any()):
            self.buffer.update(pool_slots, losses[is_pool], step, threshold)
            self.buffer.mark_replayed(pool_slots)
        fresh_positions = torch.nonzero(~is_pool).flatten()
        if fresh_positions.numel():
            fresh = take_samples(batch, fresh_positions, int(roles.size)) if bool(is_pool.any()) else batch
            self.buffer.offer(fresh, losses[fresh_positions], step, threshold)

    def _current_threshold(self, step: int) -> float:
        value, computed_at = self._threshold
        store = self.table if self.table is not None else self.buffer
        if store is None:
            return math.nan
        # the threshold scans every score, so it is refreshed a few times per epoch, not every step
        if (
            computed_at >= 0
            and step - computed_at < self._threshold_every
            and not (math.isnan(value) and self._applied_since_threshold)
        ):
            return value
        self._apply_measured()
        self._applied_since_threshold = False
        if self.rule == "infobatch":
            value = store.mean_score(step)
        else:
            value = store.quantile_score(1.0 - self.replay_fraction, step)
        self._threshold = (value, step)
        return value

    def _close_capture(self) -> None:
        capture = self._capture
        if capture is None:
            return
        capture.close()
        self._capture = None
        if self._batch is not None:
            self._batch["capture"] = capture
            self._timing["scoring_s"] += capture.overhead_seconds

    # ------------------------------------------------------------------ metrics
    def _count(self, pending: list[_Measured], losses: np.ndarray, roles: np.ndarray) -> None:
        step = self._step_totals  # what these steps add to both running totals
        step[_STEPS] = len(pending)
        step[_ACTIVE_STEPS] = sum(entry.active for entry in pending)
        step[_OFFERED] = sum(entry.offered for entry in pending if entry.active)
        step[_TRAINED] = sum(entry.roles.size for entry in pending if entry.active)
        finite = np.isfinite(losses)
        if not finite.all():
            roles, losses = roles[finite], losses[finite]
        step[_COUNTS] = np.bincount(roles, minlength=len(_ROLE_NAMES))
        step[_SUMS] = np.bincount(roles, weights=losses, minlength=len(_ROLE_NAMES))
        self._totals += step
        self._window += step

    def _log(self, trainer: pl.Trainer) -> None:
        every = self.log_every_n_steps or max(trainer.log_every_n_steps, 1)
        if not trainer.is_global_zero or not trainer.loggers or self._window[_STEPS] < every:
            return
        figures = _figures(self._window)
        store = self.table if self.table is not None else self.buffer
        if store is not None:
            figures.update(store.stats())
        figures["threshold"] = self.threshold
        metrics = {f"hard_sample_replay/{k}": v for k, v in figures.items() if not math.isnan(v)}
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
        self._window = _zero_totals()

    # ------------------------------------------------------------------ lifecycle
    def _release(self) -> None:
        self._close_capture()
        self._batch = None
        if self._scope is not None:
            self._scope.__exit__(None, None, None)
            self._scope = None

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._close_capture()
        self._batch = None
        self._apply_measured()
        self._release()

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._release()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._release()
        if stage != "fit":
            return
        if self._remove_hook is not None:
            self._remove_hook()
            self._remove_hook = None
        if self._loader is not None:
            SampleIndexTracker.uninstall(self._loader)
            self._loader = None
        self.tracker = None
        self._trainer = None
        self._store_ready = False
        self._unapplied = []

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "table": self.table.state_dict() if self.table is not None else None,
            "buffer": self.buffer.state_dict() if self.buffer is not None else None,
            "unapplied": _unapplied_state(self._unapplied),
            "totals": dict(zip(_TOTAL_NAMES, self._totals.tolist())),
            "threshold": list(self._threshold),
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore scores, buffer, measured-but-unapplied steps, totals and threshold.

        At a checkpoint restore (before the fit's DataLoader exists, which sizes the table) the state is applied
        when the table is built. During training (a :class:`~lightning_pulse.StabilityGuard` rollback) it applies
        at once; a step in flight is then dropped, its losses having been measured on the model being replaced.
        The DataLoader's pass (which batches come next, an epoch's selection) is not rewound.
        """
        self._saved_state = state_dict
        if self._store_ready:
            self._close_capture()
            self._batch = None
            self._load_saved_state()

    def _load_saved_state(self) -> None:
        state, self._saved_state = self._saved_state, None
        assert state is not None
        if self.table is not None:
            if state.get("table") is None:
                raise ValueError(
                    "HardSampleReplay: the checkpoint has a hard-sample buffer, not a score table."
                )
            self.table.load_state_dict(state["table"])
        elif self.buffer is not None:
            if state.get("buffer") is None:
                raise ValueError(
                    "HardSampleReplay: the checkpoint has a score table, not a hard-sample buffer."
                )
            self.buffer.load_state_dict(state["buffer"])
        self._unapplied = _unapplied_from_state(state.get("unapplied"))
        saved = state.get("totals", {})
        self._totals = np.array([float(saved.get(name, 0.0)) for name in _TOTAL_NAMES])
        value, step = state.get("threshold", (math.nan, -1))
        self._threshold = (float(value), int(step))


# ---------------------------------------------------------------------- helpers
#: measured steps kept before they are applied to the table together (also at every epoch end, and before
#: anything reads the whole table: a threshold refresh, a pool draw, an epoch's selection)
_APPLY_EVERY = 32


class _Measured:
    """One training step's measurement, kept until it is applied to the table."""

    __slots__ = ("indices", "losses", "roles", "step", "threshold", "active", "offered", "shared")

    def __init__(
        self,
        indices: torch.Tensor | None,
        losses: LossCapture | torch.Tensor | np.ndarray,
        roles: np.ndarray,
        step: int,
        threshold: float,
        active: bool,
        offered: float,
    ) -> None:
        self.indices = indices
        self.losses = losses  # a capture (read when applied), or (B,) losses
        self.roles = roles
        self.step = step
        self.threshold = threshold
        self.active = active
        self.offered = offered
        self.shared = False  # rows of every DDP rank (indices may repeat: padding)


def _host_losses(parts: Sequence[LossCapture | torch.Tensor | np.ndarray]) -> np.ndarray:
    """The per-sample losses of several steps as one float32 host array, with one device transfer."""
    if parts and all(isinstance(part, LossCapture) for part in parts):
        joined = concat_per_sample(list(parts))  # type: ignore[arg-type]
        if joined is not None:
            return joined
    values = [part.per_sample() if isinstance(part, LossCapture) else part for part in parts]
    on_device = [v for v in values if isinstance(v, torch.Tensor) and not v.is_cpu]
    if on_device:
        device = on_device[0].device
        joined = torch.cat([torch.as_tensor(v).to(device).float().flatten() for v in values])
        return joined.cpu().numpy()
    arrays = [
        v.detach().float().numpy().reshape(-1)
        if isinstance(v, torch.Tensor)
        else np.asarray(v, dtype=np.float32).reshape(-1)
        for v in values
    ]
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)


def _unapplied_state(unapplied: list[_Measured]) -> dict[str, Any] | None:
    """The measured steps not yet applied, as tensors and lists (reading them changes nothing)."""
    if not unapplied:
        return None
    indexed = all(entry.indices is not None for entry in unapplied)
    return {
        "indices": torch.cat([entry.indices for entry in unapplied]).clone() if indexed else None,
        "losses": torch.from_numpy(_host_losses([entry.losses for entry in unapplied]).copy()),
        "roles": torch.from_numpy(np.concatenate([entry.roles for entry in unapplied])),
        "sizes": [int(entry.roles.size) for entry in unapplied],
        "steps": [entry.step for entry in unapplied],
        "thresholds": [entry.threshold for entry in unapplied],
        "active": [entry.active for entry in unapplied],
        "offered": [entry.offered for entry in unapplied],
        "shared": [entry.shared for entry in unapplied],
    }


def _unapplied_from_state(state: dict[str, Any] | None) -> list[_Measured]:
    if not state:
        return []
    entries = []
    start = 0
    losses = torch.as_tensor(state["losses"]).float()
    roles = torch.as_tensor(state["roles"]).long().numpy()
    indices = state.get("indices")
    for position, size in enumerate(state["sizes"]):
        part = slice(start, start + size)
        entry = _Measured(
            None if indices is None else torch.as_tensor(indices)[part].long().clone(),
            losses[part].clone(),
            roles[part].copy(),
            int(state["steps"][position]),
            float(state["thresholds"][position]),
            bool(state["active"][position]),
            float(state["offered"][position]),
        )
        entry.shared = bool(state["shared"][position])
        entries.append(entry)
        start += size
    return entries


def _not_number(value: Any) -> bool:
    return isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)


def _mix(seed: int, step: int, batch_idx: int, rank: int) -> int:
    return (seed * 1_000_003 + step * 10_007 + (batch_idx + 1) * 101 + rank) % (2**63 - 1)


def _steps_per_epoch(trainer: pl.Trainer) -> float | None:
    batches = trainer.num_training_batches
    if not math.isfinite(batches) or batches <= 0:
        return None
    return float(math.ceil(batches / trainer.accumulate_grad_batches))


def _gather(
    trainer: pl.Trainer, indices: torch.Tensor | None, losses: torch.Tensor, roles: np.ndarray, offered: float
) -> tuple[torch.Tensor | None, torch.Tensor, np.ndarray, float]:
    """Every rank's (index, loss, role) rows, in rank order, identical on every rank, and the summed offered
    batch size."""
    device = trainer.strategy.root_device
    sizes = torch.tensor([float(losses.numel()), float(offered)], dtype=torch.float64, device=device)
    gathered_sizes = trainer.strategy.all_gather(sizes).reshape(-1, 2).cpu()
    counts = [int(n) for n in gathered_sizes[:, 0].tolist()]
    capacity = int(max(counts))
    rows = torch.full((capacity, 3), math.nan, dtype=torch.float64)
    rows[: losses.numel(), 0] = indices.double() if indices is not None else -1.0
    rows[: losses.numel(), 1] = losses.double()
    rows[: losses.numel(), 2] = torch.from_numpy(roles).double()
    gathered = trainer.strategy.all_gather(rows.to(device)).cpu().reshape(-1, capacity, 3)
    parts = [gathered[rank, : int(n)] for rank, n in enumerate(counts)]
    merged = torch.cat(parts)
    merged_indices = merged[:, 0].long() if indices is not None else None
    return (
        merged_indices,
        merged[:, 1].float(),
        merged[:, 2].long().numpy(),
        float(gathered_sizes[:, 1].sum()),
    )


# running totals are one float64 vector: steps, active steps, offered and trained samples, then the count and the
# loss sum of each role (untouched, selected, pool, unseen)
_TOTAL_NAMES = (
    "steps",
    "active_steps",
    "offered",
    "trained",
    *(f"{name}_count" for name in _ROLE_NAMES),
    *(f"{name}_loss" for name in _ROLE_NAMES),
)
_STEPS, _ACTIVE_STEPS, _OFFERED, _TRAINED = range(4)
_COUNTS = slice(4, 4 + len(_ROLE_NAMES))
_SUMS = slice(4 + len(_ROLE_NAMES), 4 + 2 * len(_ROLE_NAMES))


def _zero_totals() -> np.ndarray:
    return np.zeros(len(_TOTAL_NAMES))


def _figures(vector: np.ndarray) -> dict[str, float]:
    totals = dict(zip(_TOTAL_NAMES, vector.tolist()))

    def mean(names: Sequence[str]) -> float:
        count = sum(totals[f"{n}_count"] for n in names)
        return sum(totals[f"{n}_loss"] for n in names) / count if count else math.nan

    trained = totals["trained"]
    return {
        "replay_fraction": trained / totals["offered"] if totals["offered"] else math.nan,
        "pool_share": totals["pool_count"] / trained if trained else math.nan,
        "active_share": totals["active_steps"] / totals["steps"] if totals["steps"] else math.nan,
        "loss_replayed": mean(("selected", "pool")),
        "loss_pool": mean(("pool",)),
        "loss_fresh": mean(("untouched", "unseen")),
    }
