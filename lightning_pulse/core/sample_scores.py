"""Where per-sample scores live: a table keyed by dataset index.

Scores go stale: a loss measured many steps ago says less about the sample today. The table keeps, for every
score, the optimizer step it was measured at, and reads it *age-weighted*:

    effective = prior + (score - prior) * 0.5 ** (age / half_life)

where ``prior`` is a running mean of recently measured losses. A fresh score counts fully; an old one fades
toward the typical loss, so an easy-looking sample that was skipped for a long time is eventually picked
again, and a once-hard sample does not stay "hard" forever on an old measurement. A score is refreshed
(age 0) whenever its sample is trained on again.

Memory bound (documented in ``docs/hard-sample-replay.md``): 14 bytes per dataset sample (float32 score,
int32 step, int32 replay count, two bool flags), allocated once: 14 MB for a million samples; 8 more while
the scores a pass began with are kept (:meth:`SampleScoreTable.begin_pass`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

BYTES_PER_SAMPLE = 4 + 4 + 4 + 1 + 1
_UNKEPT = -2  # a pass-start step that no entry holds (-1: never scored)


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


class SampleScoreTable:
    """Per-sample scores keyed by dataset index.

    Held in NumPy arrays: a step touches a few hundred entries, where NumPy's per-call cost is a small
    fraction of torch's. Reads and writes take and return tensors.

    Args:
        num_samples: the dataset size ``N``.
        half_life: age (in optimizer steps) at which a score counts half; ``None`` disables age weighting.
        prior_momentum: momentum of the running mean of measured scores that stale scores fade toward.

    Example::

        table = SampleScoreTable(num_samples=len(dataset), half_life=500)
        table.update(indices, losses, step=trainer.global_step)
        scores = table.effective(indices, step)     # NaN for never-scored samples
    """

    def __init__(self, num_samples: int, half_life: float | None = None, prior_momentum: float = 0.9) -> None:
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
            raise ValueError(f"`num_samples`={num_samples!r} must be a positive int.")
        if half_life is not None and (not math.isfinite(half_life) or half_life <= 0):
            raise ValueError(f"`half_life`={half_life!r} must be a positive number of steps or None.")
        if not 0.0 <= prior_momentum < 1.0:
            raise ValueError(f"`prior_momentum`={prior_momentum!r} must be in [0, 1).")
        self.half_life = half_life
        self.prior_momentum = prior_momentum
        self.scores = np.full(num_samples, np.nan, dtype=np.float32)
        self.steps = np.full(num_samples, -1, dtype=np.int32)
        self.replays = np.zeros(num_samples, dtype=np.int32)
        self.awaiting = np.zeros(num_samples, dtype=bool)  # replayed, not yet measured again
        self.learned = np.zeros(num_samples, dtype=bool)
        self.prior = math.nan
        # see begin_pass: the step the pass under way began at, and each entry's score and step before its
        # first write in that pass (allocated at the first such pass)
        self.pass_start: int | None = None
        self._start_scores: np.ndarray | None = None
        self._start_steps: np.ndarray | None = None

    @property
    def num_samples(self) -> int:
        return int(self.scores.size)

    @property
    def memory_bytes(self) -> int:
        return self.num_samples * BYTES_PER_SAMPLE

    @property
    def seen(self) -> int:
        return int((self.steps >= 0).sum())

    def _as_scores(self, slots: np.ndarray, losses: np.ndarray) -> np.ndarray:
        """The scores kept for measured (finite) ``losses`` of ``slots``: the losses themselves. A study may
        subclass the table to keep something else (the benchmarks' reducible loss)."""
        return losses

    # ------------------------------------------------------------------ writes
    def update(
        self,
        indices: Tensor | np.ndarray,
        losses: Tensor | np.ndarray,
        step: int,
        threshold: float | None = None,
        may_repeat: bool = True,
    ) -> None:
        """Record measured ``losses`` for dataset ``indices`` at ``step``.

        A sample that was replayed and now measures below ``threshold`` counts as learned. Repeated indices
        (``DistributedSampler`` pads ranks with repeats) are merged into their mean; pass
        ``may_repeat=False`` to skip that check when indices are known to be distinct.
        """
        slots, values = _np_indices(indices), _np_values(losses)
        if may_repeat:
            slots, values = _unique_mean(slots, values)
        finite = np.isfinite(values)
        if not finite.all():
            slots, values = slots[finite], values[finite]
        if slots.size == 0:
            return
        values = self._as_scores(slots, values)
        awaiting = self.awaiting[slots]
        if awaiting.any():
            if threshold is not None and math.isfinite(threshold):
                self.learned[slots[awaiting & (values < threshold)]] = True
            self.awaiting[slots] = False
        self._keep_pass_start(slots, step)
        self.scores[slots] = values
        self.steps[slots] = step
        self._fold_mean(float(np.add.reduce(values, dtype=np.float64)) / values.size)

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
        each step in order would (``may_repeat=False``: indices within one step are distinct). Vectorized when
        no index appears twice; step by step otherwise.

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
        slots, losses = _np_indices(indices), _np_values(losses)
        starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
        ordered = np.sort(slots)
        if ordered.size > 1 and not (ordered[1:] != ordered[:-1]).all():  # a sample measured twice
            for start, size, step, threshold in zip(starts.tolist(), sizes.tolist(), steps, thresholds):
                part = slice(start, start + size)
                self.update(slots[part], losses[part], int(step), float(threshold), may_repeat=False)
                if replayed is not None:
                    self.mark_replayed(slots[part][replayed[part]], may_repeat=False)
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
            entry_steps = entry_steps if finite.all() else entry_steps[finite]
            self._keep_pass_start(written, entry_steps)
            self.scores[written] = values
            self.steps[written] = entry_steps
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

    def begin_pass(self, step: int, kept: Mapping[str, Any] | None = None) -> None:
        """A pass that may draw a sample twice starts at optimizer ``step``: until the next pass, keep each
        entry's score and step from before its first write at a step of the pass, so that
        :meth:`pass_start_array` reads the pass's samples as they stood when it began, however many of them
        trained since. ``kept``: :meth:`pass_start_state` of the same pass, saved (a resume inside it).
        Costs 8 bytes per sample, allocated once."""
        if self._start_scores is None or self._start_steps is None:
            self._start_scores = np.full(self.num_samples, np.nan, dtype=np.float32)
            self._start_steps = np.full(self.num_samples, _UNKEPT, dtype=np.int32)
        else:
            self._start_steps[:] = _UNKEPT
        self.pass_start = int(step)
        if kept is not None:
            slots = torch.as_tensor(kept["slots"]).numpy().astype(np.int64, copy=False)
            self._start_scores[slots] = torch.as_tensor(kept["scores"]).numpy()
            self._start_steps[slots] = torch.as_tensor(kept["steps"]).numpy()

    def _kept_pass(self) -> tuple[int, np.ndarray, np.ndarray] | None:
        """``(pass start, kept steps, kept scores)`` while a pass keeps its starting entries, else ``None``."""
        if self.pass_start is None or self._start_steps is None or self._start_scores is None:
            return None
        return self.pass_start, self._start_steps, self._start_scores

    def _keep_pass_start(self, slots: np.ndarray, steps: int | np.ndarray) -> None:
        """Before ``slots`` are written at ``steps``: keep the entries written for the first time in the pass
        under way (see :meth:`begin_pass`)."""
        if (kept := self._kept_pass()) is None:
            return
        start, kept_steps, kept_scores = kept
        first = slots[(self.steps[slots] < start) & (np.asarray(steps) >= start)]
        if first.size:
            kept_scores[first] = self.scores[first]
            kept_steps[first] = self.steps[first]

    def _fold_mean(self, batch_mean: float) -> None:
        if math.isnan(self.prior):
            self.prior = batch_mean
        else:
            self.prior = self.prior_momentum * self.prior + (1 - self.prior_momentum) * batch_mean

    def mark_replayed(self, indices: Tensor | np.ndarray, may_repeat: bool = True) -> None:
        """Note that these samples were trained on because they were selected as hard (``may_repeat=False``
        skips merging repeated indices when they are known to be distinct)."""
        slots = _np_indices(indices)
        if may_repeat:
            slots = np.unique(slots)
        self.replays[slots] += 1
        self.awaiting[slots] = True

    # ------------------------------------------------------------------ reads
    def _effective(self, slots: np.ndarray, step: int | np.ndarray, prior: float | None = None) -> np.ndarray:
        return self._age_weighted(self.scores[slots], self.steps[slots], step, prior)

    def _age_weighted(
        self, scores: np.ndarray, steps: np.ndarray, step: int | np.ndarray, prior: float | None
    ) -> np.ndarray:
        prior = self.prior if prior is None else prior
        if self.half_life is None or math.isnan(prior):
            return scores
        age = np.maximum(step - steps, 0).astype(np.float32)
        return prior + (scores - prior) * np.exp2(-age / np.float32(self.half_life))

    def effective(self, indices: Tensor | np.ndarray, step: int) -> Tensor:
        """Age-weighted scores ``(n,)`` of dataset ``indices`` at ``step`` (``NaN`` for never scored)."""
        return torch.from_numpy(self.effective_array(indices, step))

    def effective_array(
        self, indices: Tensor | np.ndarray, step: int | np.ndarray, prior: float | None = None
    ) -> np.ndarray:
        """:meth:`effective` as a float32 host array (no tensor wrapping: the selection works on arrays).
        ``step`` may be one step per index; ``prior`` replaces the running prior (a sampler choosing ahead of
        training fixes it per pass)."""
        return self._effective(_np_indices(indices), step, prior)

    def pass_start_array(
        self, indices: Tensor | np.ndarray, step: int | np.ndarray, prior: float | None = None
    ) -> np.ndarray:
        """:meth:`effective_array` of the entries as they stood when the pass under way began (see
        :meth:`begin_pass`): an entry written since reads its earlier score and step. The same as
        :meth:`effective_array` when no pass keeps its starting scores."""
        slots = _np_indices(indices)
        if (kept := self._kept_pass()) is None:
            return self._effective(slots, step, prior)
        start, kept_steps, kept_scores = kept
        scores, steps = self.scores[slots], self.steps[slots]
        # an entry written in the pass and kept (not one written before it began to keep: an older checkpoint)
        earlier = (steps >= start) & (kept_steps[slots] != _UNKEPT)
        if earlier.any():
            scores, steps = scores.copy(), steps.copy()
            scores[earlier] = kept_scores[slots[earlier]]
            steps[earlier] = kept_steps[slots[earlier]]
        return self._age_weighted(scores, steps, step, prior)

    def pass_start_state(self) -> dict[str, Tensor] | None:
        """The kept starting entries (see :meth:`begin_pass`) that the table's own no longer hold (written in
        the pass since): ``slots``, ``scores`` and ``steps``, each ``(n,)``; ``None`` when there are none.
        Only samples that trained in the pass so far, and only while a pass keeps them."""
        if (kept := self._kept_pass()) is None:
            return None
        start, kept_steps, kept_scores = kept
        slots = np.flatnonzero((self.steps >= start) & (kept_steps != _UNKEPT))
        if slots.size == 0:
            return None
        return {
            "slots": torch.from_numpy(slots.astype(np.int32 if self.num_samples < 2**31 else np.int64)),
            "scores": torch.from_numpy(kept_scores[slots].copy()),
            "steps": torch.from_numpy(kept_steps[slots].copy()),
        }

    def _scored(self) -> np.ndarray:
        return np.flatnonzero(self.steps >= 0)

    def mean_score(self, step: int) -> float:
        """Mean age-weighted score over the scored samples (InfoBatch's threshold); ``NaN`` if none."""
        scored = self._scored()
        return float(self._effective(scored, step).mean()) if scored.size else math.nan

    def quantile_score(self, quantile: float, step: int) -> float:
        """The ``quantile`` (in ``[0, 1]``) of the age-weighted scores of scored samples; ``NaN`` if none."""
        scored = self._scored()
        if scored.size == 0:
            return math.nan
        values = self._effective(scored, step)
        rank = min(values.size, max(1, math.ceil(quantile * values.size))) - 1
        return float(np.partition(values, rank)[rank])

    def stats(self) -> dict[str, float]:
        """Size, coverage and reuse: how many samples were replayed, came back, and measured as learned."""
        replayed = self.replays > 0
        distinct = int(replayed.sum())
        return {
            "table_samples": float(self.num_samples),
            "table_seen": float(self.seen),
            "table_bytes": float(self.memory_bytes),
            "replayed_distinct": float(distinct),
            "came_back_rate": float((self.replays > 1).sum()) / distinct if distinct else 0.0,
            "learned_rate": float((self.learned & replayed).sum()) / distinct if distinct else 0.0,
        }

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {
            "scores": torch.from_numpy(self.scores.copy()),
            "steps": torch.from_numpy(self.steps.copy()),
            "replays": torch.from_numpy(self.replays.copy()),
            "awaiting": torch.from_numpy(self.awaiting.copy()),
            "learned": torch.from_numpy(self.learned.copy()),
            "prior": self.prior,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if tuple(state["scores"].shape) != self.scores.shape:
            raise ValueError(
                f"The checkpoint's scores cover {state['scores'].numel()} samples but this table has "
                f"{self.scores.size}; it was saved for a different dataset."
            )
        for name in ("scores", "steps", "replays", "awaiting", "learned"):
            getattr(self, name)[:] = torch.as_tensor(state[name]).numpy()
        self.prior = float(state["prior"])
