"""Where per-sample scores live: a table keyed by dataset index, or a bounded buffer of hard samples.

Scores go stale: a loss measured many steps ago says less about the sample today. Both stores keep, for
every score, the optimizer step it was measured at, and read it *age-weighted*:

    effective = prior + (score - prior) * 0.5 ** (age / half_life)

where ``prior`` is a running mean of recently measured losses. A fresh score counts fully; an old one fades
toward the typical loss, so an easy-looking sample that was skipped for a long time is eventually picked
again, and a once-hard sample does not stay "hard" forever on an old measurement. A score is refreshed
(age 0) whenever its sample is trained on again.

Memory bounds (documented in ``docs/hard-sample-replay.md``):

* :class:`SampleScoreTable`: 14 bytes per dataset sample (float32 score, int32 step, int32 replay count,
  two bool flags), allocated once: 14 MB for a million samples; 18 bytes with learnability scores (the
  float32 lowest loss too).
* :class:`HardSampleBuffer`: ``capacity`` samples' tensors plus 14 bytes of bookkeeping each.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lightning_pulse.core.selection import batch_size_of, take_samples

BYTES_PER_SAMPLE = 4 + 4 + 4 + 1 + 1

#: What a table keeps per sample: ``"loss"`` (the last measured loss) or ``"learnability"`` (the last
#: loss minus the lowest loss the sample has had so far: a reducible loss in the spirit of RHO-LOSS, with
#: the sample's own best standing in for the irreducible-loss model; 4 more bytes per sample).
SCORES = ("loss", "learnability")


def _np_indices(indices: Tensor | np.ndarray | Sequence[int]) -> np.ndarray:
    if isinstance(indices, torch.Tensor):
        if indices.is_cpu and indices.dtype == torch.int64 and not indices.requires_grad:
            return indices.numpy()
        return indices.detach().cpu().long().numpy()
    return np.asarray(indices, dtype=np.int64)


def _np_values(values: Tensor | np.ndarray | Sequence[float]) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        if values.is_cpu and values.dtype == torch.float32 and not values.requires_grad:
            return values.numpy()
        return values.detach().cpu().float().numpy()
    return np.asarray(values, dtype=np.float32)


class _ScoreState:
    """Bookkeeping shared by the table and the buffer: scores, steps, replay counts, learned flags.

    Held in NumPy arrays: a step touches a few hundred entries, where NumPy's per-call cost is a small
    fraction of torch's. Reads and writes take and return tensors.
    """

    def __init__(self, size: int, half_life: float | None, prior_momentum: float) -> None:
        if half_life is not None and (not math.isfinite(half_life) or half_life <= 0):
            raise ValueError(f"`half_life`={half_life!r} must be a positive number of steps or None.")
        if not 0.0 <= prior_momentum < 1.0:
            raise ValueError(f"`prior_momentum`={prior_momentum!r} must be in [0, 1).")
        self.half_life = half_life
        self.prior_momentum = prior_momentum
        self.scores = np.full(size, np.nan, dtype=np.float32)
        self.steps = np.full(size, -1, dtype=np.int32)
        self.replays = np.zeros(size, dtype=np.int32)
        self.awaiting = np.zeros(size, dtype=bool)  # replayed, not yet measured again
        self.learned = np.zeros(size, dtype=bool)
        self.prior = math.nan
        self.minima: np.ndarray | None = None  # lowest loss measured per entry, for learnability scores

    def _as_scores(self, slots: np.ndarray, losses: np.ndarray) -> np.ndarray:
        """The scores kept for measured (finite) ``losses``: the losses themselves, or, with learnability
        scores, each loss minus the lowest loss its entry has had so far (and that lowest loss updated)."""
        if self.minima is None:
            return losses
        lowest = np.fmin(self.minima[slots], losses)
        self.minima[slots] = lowest
        return losses - lowest

    # ------------------------------------------------------------------ writes
    def _write(
        self,
        slots: np.ndarray,
        losses: np.ndarray,
        step: int,
        threshold: float | None,
        fold_prior: bool = True,
        may_repeat: bool = True,
    ) -> None:
        if may_repeat:
            slots, losses = _unique_mean(slots, losses)
        finite = np.isfinite(losses)
        if not finite.all():
            slots, losses = slots[finite], losses[finite]
            if slots.size == 0:
                return
        elif slots.size == 0:
            return
        losses = self._as_scores(slots, losses)
        awaiting = self.awaiting[slots]
        if awaiting.any():
            if threshold is not None and math.isfinite(threshold):
                self.learned[slots[awaiting & (losses < threshold)]] = True
            self.awaiting[slots] = False
        self.scores[slots] = losses
        self.steps[slots] = step
        if fold_prior:
            self._fold_prior(losses)

    def _write_steps(
        self,
        slots: np.ndarray,
        losses: np.ndarray,
        sizes: np.ndarray,
        steps: np.ndarray,
        thresholds: np.ndarray,
        replayed: np.ndarray | None,
    ) -> None:
        """Several steps' writes at once, with the result of a ``_write`` then ``_mark_replayed`` per step, in
        order. Vectorized when no slot appears twice; step by step otherwise."""
        starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
        ordered = np.sort(slots)
        if ordered.size > 1 and not (ordered[1:] != ordered[:-1]).all():  # a sample measured twice
            for start, size, step, threshold in zip(starts.tolist(), sizes.tolist(), steps, thresholds):
                part = slice(start, start + size)
                self._write(slots[part], losses[part], int(step), float(threshold), may_repeat=False)
                if replayed is not None:
                    self._mark_replayed(slots[part][replayed[part]], may_repeat=False)
            return
        finite = np.isfinite(losses)
        written, values = (slots, losses) if finite.all() else (slots[finite], losses[finite])
        values = self._as_scores(written, values)
        if written.size:
            awaiting = self.awaiting[written]
            if awaiting.any():
                # each slot appears once, so its flag was set before these steps: judge it at its own step
                entry_thresholds = np.repeat(thresholds, sizes)
                if not finite.all():
                    entry_thresholds = entry_thresholds[finite]
                self.learned[written[awaiting & (values < entry_thresholds)]] = True
                self.awaiting[written] = False
            entry_steps = np.repeat(steps.astype(np.int32), sizes)
            self.scores[written] = values
            self.steps[written] = entry_steps if finite.all() else entry_steps[finite]
        # the running mean folds in each step's mean of finite losses, in order
        kept = np.zeros(losses.size, dtype=np.float64)
        kept[finite] = values
        sums = np.add.reduceat(kept, starts)
        counts = np.add.reduceat(finite.astype(np.int64), starts)
        for total, count in zip(sums.tolist(), counts.tolist()):
            if count:
                self._fold_mean(total / count)
        if replayed is not None and replayed.any():
            marked = slots[replayed]
            self.replays[marked] += 1
            self.awaiting[marked] = True

    def _fold_prior(self, losses: np.ndarray) -> None:
        self._fold_mean(float(np.add.reduce(losses, dtype=np.float64)) / losses.size)

    def _fold_mean(self, batch_mean: float) -> None:
        if math.isnan(self.prior):
            self.prior = batch_mean
        else:
            self.prior = self.prior_momentum * self.prior + (1 - self.prior_momentum) * batch_mean

    def _mark_replayed(self, slots: np.ndarray, may_repeat: bool = True) -> None:
        if may_repeat:
            slots = np.unique(slots)
        self.replays[slots] += 1
        self.awaiting[slots] = True

    # ------------------------------------------------------------------ reads
    def _effective(self, slots: np.ndarray, step: int) -> np.ndarray:
        scores = self.scores[slots]
        if self.half_life is None or math.isnan(self.prior):
            return scores
        age = np.maximum(step - self.steps[slots], 0).astype(np.float32)
        return self.prior + (scores - self.prior) * np.exp2(-age / np.float32(self.half_life))

    def effective_at(self, slots: Tensor | np.ndarray, step: int) -> Tensor:
        """Age-weighted scores of ``slots`` at ``step`` (``NaN`` for never scored)."""
        return torch.from_numpy(self._effective(_np_indices(slots), step))

    def _scored(self) -> np.ndarray:
        return np.flatnonzero(self.steps >= 0)

    def mean_score(self, step: int) -> float:
        """Mean age-weighted score over the scored entries (InfoBatch's threshold); ``NaN`` if none."""
        scored = self._scored()
        return float(self._effective(scored, step).mean()) if scored.size else math.nan

    def quantile_score(self, quantile: float, step: int) -> float:
        """The ``quantile`` (in ``[0, 1]``) of the age-weighted scores of scored entries; ``NaN`` if none."""
        scored = self._scored()
        if scored.size == 0:
            return math.nan
        values = self._effective(scored, step)
        rank = min(values.size, max(1, math.ceil(quantile * values.size))) - 1
        return float(np.partition(values, rank)[rank])

    def _pick(
        self,
        count: int,
        step: int,
        recent_steps: int,
        rule: str,
        generator: torch.Generator | None,
        power: float,
        exclude: np.ndarray | None = None,
    ) -> np.ndarray:
        candidates = self.steps >= 0
        if recent_steps > 0:
            candidates &= self.steps < step - recent_steps + 1
        if exclude is not None and exclude.size:
            candidates[exclude] = False
        pool = np.flatnonzero(candidates)
        count = min(count, pool.size)
        if count <= 0:
            return np.zeros(0, dtype=np.int64)
        scores = self._effective(pool, step)
        if rule == "random":
            picked = torch.randperm(pool.size, generator=generator)[:count].numpy()
        elif rule == "proportional":
            weights = np.maximum(scores.astype(np.float64), 0.0) ** power
            if weights.sum() <= 0.0:
                weights = np.ones_like(weights)
            picked = torch.multinomial(
                torch.from_numpy(weights), count, replacement=False, generator=generator
            ).numpy()
        else:
            picked = np.argsort(-scores, kind="stable")[:count]
        return pool[picked]

    def _reuse_stats(self) -> dict[str, float]:
        replayed = self.replays > 0
        distinct = int(replayed.sum())
        return {
            "replayed_distinct": float(distinct),
            "came_back_rate": float((self.replays > 1).sum()) / distinct if distinct else 0.0,
            "learned_rate": float((self.learned & replayed).sum()) / distinct if distinct else 0.0,
        }

    def _state(self) -> dict[str, Any]:
        return {
            "scores": torch.from_numpy(self.scores.copy()),
            "steps": torch.from_numpy(self.steps.copy()),
            "replays": torch.from_numpy(self.replays.copy()),
            "awaiting": torch.from_numpy(self.awaiting.copy()),
            "learned": torch.from_numpy(self.learned.copy()),
            "prior": self.prior,
            **({"minima": torch.from_numpy(self.minima.copy())} if self.minima is not None else {}),
        }

    def _load(self, state: Mapping[str, Any]) -> None:
        if tuple(state["scores"].shape) != self.scores.shape:
            raise ValueError(
                f"The checkpoint's scores cover {state['scores'].numel()} samples but this store has "
                f"{self.scores.size}; it was saved for a different dataset or buffer size."
            )
        if (self.minima is None) != (state.get("minima") is None):
            raise ValueError(
                "The checkpoint's scores are "
                + ("learnability scores" if state.get("minima") is not None else "losses")
                + " but this store keeps "
                + ("learnability scores." if self.minima is not None else "losses.")
            )
        for name in ("scores", "steps", "replays", "awaiting", "learned"):
            getattr(self, name)[:] = torch.as_tensor(state[name]).numpy()
        if self.minima is not None:
            self.minima[:] = torch.as_tensor(state["minima"]).numpy()
        self.prior = float(state["prior"])


def _unique_mean(slots: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Merge repeated slots (DistributedSampler pads ranks with repeated samples) into their mean, in a
    deterministic order, so every rank writes the same table."""
    unique, inverse = np.unique(slots, return_inverse=True)
    if unique.size == slots.size:
        order = np.argsort(slots, kind="stable")
        return slots[order], values[order]
    sums = np.bincount(inverse, weights=values.astype(np.float64), minlength=unique.size)
    counts = np.bincount(inverse, minlength=unique.size)
    return unique, (sums / counts).astype(np.float32)


class SampleScoreTable(_ScoreState):
    """Per-sample scores keyed by dataset index.

    Args:
        num_samples: the dataset size ``N``.
        half_life: age (in optimizer steps) at which a score counts half; ``None`` disables age weighting.
        prior_momentum: momentum of the running mean of measured scores that stale scores fade toward.
        score: what is kept per sample, one of :data:`SCORES`: ``"loss"``, or ``"learnability"`` (the loss
            minus the lowest loss the sample has had so far).

    Example::

        table = SampleScoreTable(num_samples=len(dataset), half_life=500)
        table.update(indices, losses, step=trainer.global_step)
        scores = table.effective(indices, step)     # NaN for never-scored samples
    """

    def __init__(
        self,
        num_samples: int,
        half_life: float | None = None,
        prior_momentum: float = 0.9,
        score: str = "loss",
    ) -> None:
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
            raise ValueError(f"`num_samples`={num_samples!r} must be a positive int.")
        if score not in SCORES:
            raise ValueError(f"`score`={score!r} is not one of {list(SCORES)}.")
        super().__init__(num_samples, half_life, prior_momentum)
        self.score = score
        if score == "learnability":
            self.minima = np.full(num_samples, np.inf, dtype=np.float32)

    @property
    def num_samples(self) -> int:
        return int(self.scores.size)

    @property
    def memory_bytes(self) -> int:
        return self.num_samples * (BYTES_PER_SAMPLE + (4 if self.minima is not None else 0))

    @property
    def seen(self) -> int:
        return int((self.steps >= 0).sum())

    def update(
        self,
        indices: Tensor,
        losses: Tensor,
        step: int,
        threshold: float | None = None,
        may_repeat: bool = True,
    ) -> None:
        """Record measured ``losses`` for dataset ``indices`` at ``step``.

        A sample that was replayed and now measures below ``threshold`` counts as learned. Repeated indices
        (``DistributedSampler`` pads ranks with repeats) are merged into their mean; pass
        ``may_repeat=False`` to skip that check when indices are known to be distinct.
        """
        self._write(_np_indices(indices), _np_values(losses), step, threshold, may_repeat=may_repeat)

    def update_steps(
        self,
        indices: Tensor | np.ndarray,
        losses: Tensor | np.ndarray,
        sizes: Sequence[int] | np.ndarray,
        steps: Sequence[int] | np.ndarray,
        thresholds: Sequence[float] | np.ndarray | None = None,
        replayed: np.ndarray | None = None,
    ) -> None:
        """Record the measurements of several steps at once, as :meth:`update` then :meth:`mark_replayed` for
        each step in order would (``may_repeat=False``: indices within one step are distinct).

        Args:
            indices: ``(n,)`` dataset indices, the steps' batches one after another.
            losses: ``(n,)`` measured losses.
            sizes: ``(S,)`` how many of the ``n`` entries each step has.
            steps: ``(S,)`` the optimizer step of each.
            thresholds: ``(S,)`` the hardness threshold at each step (``None``: no learned-rate judgement).
            replayed: ``(n,)`` bool, the entries trained on because they were selected as hard.
        """
        sizes = np.asarray(sizes, dtype=np.int64)
        steps = np.asarray(steps, dtype=np.int64)
        thresholds = np.full(sizes.size, np.nan) if thresholds is None else np.asarray(thresholds, np.float64)
        if sizes.size == 0 or int(sizes.sum()) == 0:
            return
        if (sizes <= 0).any():
            keep = sizes > 0
            sizes, steps, thresholds = sizes[keep], steps[keep], thresholds[keep]
        self._write_steps(_np_indices(indices), _np_values(losses), sizes, steps, thresholds, replayed)

    def mark_replayed(self, indices: Tensor, may_repeat: bool = True) -> None:
        """Note that these samples were trained on because they were selected as hard (``may_repeat=False``
        skips merging repeated indices when they are known to be distinct)."""
        self._mark_replayed(_np_indices(indices), may_repeat)

    def effective(self, indices: Tensor, step: int) -> Tensor:
        """Age-weighted scores of dataset ``indices`` at ``step`` (``NaN`` for never scored)."""
        return self.effective_at(indices, step)

    def hardest(
        self,
        count: int,
        step: int,
        exclude: Tensor | None = None,
        recent_steps: int = 0,
        rule: str = "topk",
        generator: torch.Generator | None = None,
        power: float = 1.0,
    ) -> Tensor:
        """Dataset indices of ``count`` hard samples for replay.

        Candidates are the scored samples not in ``exclude`` and not measured in the last ``recent_steps``
        steps (so one stubborn sample is not replayed step after step). ``rule`` ``"topk"`` takes the
        highest age-weighted scores, ``"proportional"`` draws in proportion to ``score ** power``,
        ``"random"`` draws uniformly.
        """
        excluded = None if exclude is None else _np_indices(exclude)
        return torch.from_numpy(self._pick(count, step, recent_steps, rule, generator, power, excluded))

    def easy_half_loss_ratio(self) -> float:
        """How much the easier half of the scored samples still weighs: the summed loss of the half with the
        lowest stored losses over half the summed loss of all scored samples.

        1 when every sample has the same loss, near 0 when the easier half is learned. It says whether a
        selection by loss has anything to exploit: where the easier half carries almost nothing, dropping it
        costs nothing (0.01-0.03 on MNIST-1D from halfway through the run, where top-k beats a random
        subset); where it carries most of its share, top-k only tilts the gradient (0.65-0.74 on the char LM,
        where no rule beats random; see ``benchmarks/results/hard_sample_replay_signal.md``). The stored
        losses are those of each sample's last visit, up to an epoch old. ``NaN`` with fewer than 2 scored
        samples, a negative stored loss or a zero total (the ratio assumes losses of at least 0, as
        cross-entropy's are), or with ``score="learnability"`` (its scores are not losses). Costs one pass
        over the table at every log: about 8 ms per million samples on this project's CPU.
        """
        if self.score != "loss":
            return math.nan
        losses = self.scores[self._scored()].astype(np.float64)
        if losses.size < 2 or losses.min() < 0:
            return math.nan
        total = losses.sum()
        if not total > 0:
            return math.nan
        half = losses.size // 2
        easier = np.partition(losses, half - 1)[:half].sum()
        return float(easier / (total * half / losses.size))

    def stats(self) -> dict[str, float]:
        return {
            "table_samples": float(self.num_samples),
            "table_seen": float(self.seen),
            "table_bytes": float(self.memory_bytes),
            "easy_half_loss_ratio": self.easy_half_loss_ratio(),
            **self._reuse_stats(),
        }

    def state_dict(self) -> dict[str, Any]:
        return self._state()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._load(state)


class HardSampleBuffer(_ScoreState):
    """The hardest samples seen so far, stored themselves, for data that has no dataset index.

    Holds at most ``capacity`` samples. Every per-sample leaf of the batch (a tensor whose first dimension
    is the batch size) is kept in a preallocated ``(capacity, ...)`` tensor on the CPU, so every sample must
    have the same shapes (pad variable-length data, or use index tracking). A new sample enters when its
    loss beats the weakest age-weighted score in the buffer.

    Args:
        capacity: the most samples kept.
        half_life: as for :class:`SampleScoreTable`.
        prior_momentum: as for :class:`SampleScoreTable`.
    """

    def __init__(self, capacity: int, half_life: float | None = None, prior_momentum: float = 0.9) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"`capacity`={capacity!r} must be a positive int.")
        super().__init__(capacity, half_life, prior_momentum)
        self.capacity = capacity
        self.storage: Any = None  # the batch structure, per-sample leaves of shape (capacity, ...)

    @property
    def size(self) -> int:
        return int((self.steps >= 0).sum())

    @property
    def memory_bytes(self) -> int:
        leaves = _tensor_leaves(self.storage)
        return self.capacity * BYTES_PER_SAMPLE + sum(t.numel() * t.element_size() for t in leaves)

    def offer(self, batch: Any, losses: Tensor, step: int, threshold: float | None = None) -> int:
        """Keep the samples of ``batch`` whose loss beats the weakest entries; returns how many entered.

        ``losses`` are the batch's ``(B,)`` measured losses (they also update the running prior).
        """
        values = _np_values(losses)
        batch_size = values.size
        if batch_size_of(batch) != batch_size:
            raise ValueError(
                f"The batch holds {batch_size_of(batch)} samples but {batch_size} losses were given."
            )
        finite = np.flatnonzero(np.isfinite(values))
        if finite.size == 0:
            return 0
        if self.storage is None:
            first = torch.from_numpy(finite[:1])
            self.storage = _allocate_like(take_samples(batch, first, batch_size), self.capacity)
        occupied = self.steps >= 0
        current = np.where(occupied, self._effective(np.arange(self.capacity), step), -np.inf)
        candidates = np.concatenate([current, values[finite]])
        keep = np.argsort(-candidates, kind="stable")[: self.capacity]
        keep = keep[np.isfinite(candidates[keep])]  # empty slots (-inf) are free, not kept
        entering = keep[keep >= self.capacity] - self.capacity  # positions in `finite`
        self._fold_prior(values[finite])
        if entering.size == 0:
            return 0
        kept_slots = np.zeros(self.capacity, dtype=bool)
        kept_slots[keep[keep < self.capacity]] = True
        slots = np.flatnonzero(~kept_slots)[: entering.size]
        positions = finite[entering]
        chosen = take_samples(batch, torch.from_numpy(positions), batch_size)
        _write_rows(self.storage, torch.from_numpy(slots), _to_cpu(chosen))
        self.replays[slots] = 0
        self.learned[slots] = False
        self.awaiting[slots] = False
        self._write(slots, values[positions], step, threshold, fold_prior=False, may_repeat=False)
        return int(slots.size)

    def take(
        self,
        count: int,
        step: int,
        recent_steps: int = 0,
        rule: str = "topk",
        generator: torch.Generator | None = None,
        power: float = 1.0,
    ) -> tuple[Tensor, Any]:
        """``(slots, batch)`` of up to ``count`` stored samples for replay, chosen like
        :meth:`SampleScoreTable.hardest`; ``batch`` is ``None`` when nothing qualifies."""
        slots = self._pick(count, step, recent_steps, rule, generator, power)
        if slots.size == 0 or self.storage is None:
            return torch.zeros(0, dtype=torch.long), None
        slots_tensor = torch.from_numpy(slots)
        return slots_tensor, take_samples(self.storage, slots_tensor, self.capacity)

    def update(self, slots: Tensor, losses: Tensor, step: int, threshold: float | None = None) -> None:
        """Record re-measured losses of replayed entries."""
        self._write(_np_indices(slots), _np_values(losses), step, threshold)

    def mark_replayed(self, slots: Tensor) -> None:
        """Note that these entries were replayed."""
        self._mark_replayed(_np_indices(slots))

    def stats(self) -> dict[str, float]:
        return {
            "buffer_capacity": float(self.capacity),
            "buffer_samples": float(self.size),
            "buffer_bytes": float(self.memory_bytes),
            **self._reuse_stats(),
        }

    def state_dict(self) -> dict[str, Any]:
        return {**self._state(), "storage": self.storage}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._load(state)
        self.storage = state.get("storage")


def _tensor_leaves(tree: Any) -> list[Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, Mapping):
        return [leaf for value in tree.values() for leaf in _tensor_leaves(value)]
    if isinstance(tree, (list, tuple)):
        return [leaf for value in tree for leaf in _tensor_leaves(value)]
    return []


def _to_cpu(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.detach().cpu()
    if isinstance(tree, Mapping):
        return type(tree)({key: _to_cpu(value) for key, value in tree.items()})
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return type(tree)(*[_to_cpu(value) for value in tree])
    if isinstance(tree, (list, tuple)):
        return type(tree)(_to_cpu(value) for value in tree)
    return tree


def _allocate_like(one_sample_batch: Any, capacity: int) -> Any:
    """Storage with the structure of a one-sample batch, per-sample leaves grown to ``capacity`` rows."""
    if isinstance(one_sample_batch, torch.Tensor):
        if one_sample_batch.dim() >= 1 and one_sample_batch.shape[0] == 1:
            return torch.zeros((capacity, *one_sample_batch.shape[1:]), dtype=one_sample_batch.dtype)
        return one_sample_batch.detach().cpu()
    if (
        isinstance(one_sample_batch, list)
        and len(one_sample_batch) == 1
        and isinstance(one_sample_batch[0], str)
    ):
        return [""] * capacity
    if isinstance(one_sample_batch, Mapping):
        return type(one_sample_batch)({k: _allocate_like(v, capacity) for k, v in one_sample_batch.items()})
    if isinstance(one_sample_batch, tuple) and hasattr(one_sample_batch, "_fields"):
        return type(one_sample_batch)(*[_allocate_like(v, capacity) for v in one_sample_batch])
    if isinstance(one_sample_batch, (list, tuple)):
        return type(one_sample_batch)(_allocate_like(v, capacity) for v in one_sample_batch)
    return one_sample_batch


def _write_rows(storage: Any, slots: Tensor, samples: Any) -> None:
    if isinstance(storage, torch.Tensor):
        if storage.dim() >= 1 and isinstance(samples, torch.Tensor) and samples.shape[0] == slots.numel():
            if samples.shape[1:] != storage.shape[1:]:
                raise ValueError(
                    f"HardSampleBuffer stores fixed-shape samples; got a sample of shape {tuple(samples.shape[1:])} "
                    f"for storage of shape {tuple(storage.shape[1:])}. Pad the data or use index tracking."
                )
            storage[slots] = samples.to(storage.dtype)
        return
    if isinstance(storage, list) and samples and isinstance(samples, list) and isinstance(samples[0], str):
        for slot, text in zip(slots.tolist(), samples):
            storage[slot] = text
        return
    if isinstance(storage, Mapping):
        for key in storage:
            _write_rows(storage[key], slots, samples[key])
        return
    if isinstance(storage, (list, tuple)):
        for part, sample in zip(storage, samples):
            _write_rows(part, slots, sample)
