"""Whether a sample's score says something about the sample: the rank agreement of its successive scores.

Hard-sample replay ranks samples by a loss measured once per visit. That rank means something only if a
sample's loss depends mostly on the sample. Where it depends more on a random draw made inside
``training_step`` (a diffusion model's timestep and noise, drawn per sample) or on the rest of the batch
(in-batch negatives), a sample's next score is unrelated to its last one, and top-k picks at random while it
reports hard-sample selection. :class:`RankAgreement` measures this once per fit, from what the score table
already holds: when a sample is scored again, its previous score and its new one make a pair; once
:data:`MIN_PAIRS` pairs are in, their Spearman rank correlation is the agreement. Host arrays only (the
scores reach the host when they are applied anyway): no device sync of its own.

Only samples that trained untouched are paired (a burst phase of a
:class:`~lightning_pulse.PulseCycle`): a selected sample was chosen for its previous score, and that
restricted range hides the agreement (an MLP on digits replaying every step read 0.07-0.12 there, 0.4-0.6
untouched). A run whose every step selects (no PulseCycle) is therefore not checked. :data:`LOW_AGREEMENT`
says where the threshold comes from.
"""

from __future__ import annotations

import math

import numpy as np

#: Pairs (a sample's previous score next to its new one) gathered before the agreement is measured: the
#: standard error of a Spearman correlation near 0 is about ``1 / sqrt(n)``, 0.05 at 400.
MIN_PAIRS = 400

#: Below this agreement the scores are taken to be draws rather than properties of the samples. Measured on
#: pairs of samples that trained untouched (PulseCycle's burst phases), previous score from the second epoch
#: on: a DDPM-style MLP denoiser on sklearn digits -0.05 to 0.03 (two seeds, and the sweep's repro); an MLP
#: classifier on digits 0.40-0.45, MNIST-1D's CNN 0.21-0.29 (the hardest case seen). Halfway, and three
#: standard errors above a true 0 at 400 pairs.
LOW_AGREEMENT = 0.15


def spearman(first: np.ndarray, second: np.ndarray) -> float:
    """Spearman's rank correlation of two equally long 1-D arrays (ties ranked by position; ``NaN`` for
    fewer than 3 values or a constant array)."""
    if first.size < 3:
        return math.nan
    ranks = [
        np.argsort(np.argsort(values, kind="stable"), kind="stable").astype(np.float64)
        for values in (first, second)
    ]
    a, b = (r - r.mean() for r in ranks)
    denominator = math.sqrt(float((a * a).sum() * (b * b).sum()))
    return float((a * b).sum() / denominator) if denominator else math.nan


class RankAgreement:
    """Collects (previous, new) score pairs until :data:`MIN_PAIRS`, then measures their agreement once.

    Attributes:
        value: the measured agreement, ``NaN`` until measured.
    """

    def __init__(self, min_pairs: int = MIN_PAIRS) -> None:
        self.min_pairs = min_pairs
        self.value = math.nan
        self._previous: list[np.ndarray] = []
        self._new: list[np.ndarray] = []
        self._count = 0

    @property
    def measured(self) -> bool:
        return not math.isnan(self.value)

    def add(
        self, previous: np.ndarray, new: np.ndarray, previous_steps: np.ndarray, since: int = 0
    ) -> str | None:
        """Add the pairs where both ``previous`` (the table's scores before this update) and ``new`` (the
        measured losses) are finite and the previous score was measured at step ``since`` or later (the first
        epoch's scores come from a model that changes fastest: a classifier's first-epoch scores agree with
        its next ones at about 0.1, its later ones at 0.6 and more); once there are enough, measure and return
        the warning when the agreement is low (once), else ``None``."""
        if self.measured:
            return None
        both = np.isfinite(previous) & np.isfinite(new) & (previous_steps >= since)
        if not both.any():
            return None
        self._previous.append(previous[both].astype(np.float64))
        self._new.append(new[both].astype(np.float64))
        self._count += int(both.sum())
        if self._count < self.min_pairs:
            return None
        self.value = spearman(np.concatenate(self._previous), np.concatenate(self._new))
        pairs, self._previous, self._new = self._count, [], []
        if math.isnan(self.value) or self.value >= LOW_AGREEMENT:
            return None
        return (
            f"a sample's successive scores barely agree: over {pairs} samples scored twice, the rank "
            f"correlation of their previous score with their new one is {self.value:.2f} (below "
            f"{LOW_AGREEMENT}). The per-sample loss depends on a random draw inside training_step (a "
            "diffusion model's timestep and noise) or on the rest of the batch more than on the sample, so "
            "the 'hardest' samples are picked at random. Use rule='random' for the cheaper epoch without the "
            "claim, or remove HardSampleReplay (a scorer that fixes or averages the draw is the other way). "
            "Said once; logged as hard_sample_replay/score_rank_agreement."
        )

    def state_dict(self) -> float:
        return self.value

    def load(self, value: float | None) -> None:
        """Restore a measured value (a checkpoint); a state without one (older, or a StabilityGuard snapshot
        taken before the measurement) keeps what was measured, so that a rollback does not warn twice."""
        if value is not None and not math.isnan(float(value)):
            self.value = float(value)
        self._previous, self._new, self._count = [], [], 0
