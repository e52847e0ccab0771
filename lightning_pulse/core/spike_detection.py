"""Loss- and gradient-spike detection. Plain Python.

* :func:`robust_zscore` and :class:`RunningRobustZ`: how far a new value sits above the median of a sliding
  window of accepted values, in units of the window's median absolute deviation (MAD), with a warm-up.
* :class:`SpikeDetector`: non-finite checks plus robust z-scores of the (log) loss and gradient norm, with one
  window per key (``StabilityGuard`` keys by pulse phase, so a replay phase that deliberately trains on
  high-loss samples is compared with earlier replay phases, not with bursts). :meth:`SpikeDetector.assess`
  is the one verdict, used for every step.

Nothing here imports Lightning or needs a tensor; the escalation that answers a verdict is in
:mod:`lightning_pulse.core.stability_policy`.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import deque
from collections.abc import Iterable, Mapping
from enum import Enum
from typing import Any, NamedTuple

# MAD * 1.4826 estimates the standard deviation of normally distributed data.
MAD_TO_STD = 1.4826
SCALES = ("log", "linear")
#: how far above the pooled median a spike must be while its own window warms up
COLD_RATIO = 10.0
POOLED = "*"  # the key of the baseline that pools every other key's values
#: how many of a window's latest values set the level a jump is measured from (``jump_zscore``)
RECENT = 5


class Verdict(str, Enum):
    """What the detector concluded about one optimizer step."""

    OK = "ok"
    NONFINITE_LOSS = "nonfinite_loss"
    NONFINITE_GRAD = "nonfinite_grad"
    LOSS_SPIKE = "loss_spike"
    GRAD_SPIKE = "grad_spike"

    @property
    def is_spike(self) -> bool:
        return self is not Verdict.OK

    def __str__(self) -> str:
        return self.value


def robust_zscore(value: float, history: Iterable[float]) -> float:
    """One-sided robust z-score of ``value`` against ``history``: ``(value - median) / (1.4826 * MAD)``.

    The median absolute deviation (MAD), scaled to estimate a standard deviation, is not inflated by a few
    outliers in ``history``, unlike the standard deviation. A zero MAD (constant history) gives ``inf`` for
    any larger value, so callers pair the score with a minimum ratio (see :class:`SpikeDetector`).

    Raises:
        ValueError: if ``history`` is empty.
    """
    values = list(history)
    if not values:
        raise ValueError("`history` must hold at least one value.")
    median = statistics.median(values)
    scale = MAD_TO_STD * statistics.median(abs(v - median) for v in values)
    if scale == 0:
        return 0.0 if value == median else math.copysign(math.inf, value - median)
    return (value - median) / scale


class RunningRobustZ:
    """Robust z-scores of new values against a sliding window of the values accepted so far.

    Values enter the window only through :meth:`add`, so a caller can keep spikes out of the baseline they
    are judged against; a non-finite value never enters. Each value may carry a ``stamp`` (the caller's clock
    when it entered), and :meth:`forget_before` drops the values stamped earlier: a window then holds what
    was accepted recently, not merely the last ``window`` values whenever they came.

    Args:
        window: how many recent accepted values form the baseline.
        warmup: how many values the window must hold before :meth:`zscore` gives a score.

    Raises:
        ValueError: if ``window < 2`` or ``warmup`` is not in ``[2, window]``.
    """

    def __init__(self, window: int = 100, warmup: int = 50) -> None:
        _check_int("window", window, minimum=2)
        _check_int("warmup", warmup, minimum=2)
        if warmup > window:
            raise ValueError(f"`warmup`={warmup} must not exceed `window`={window}.")
        self.window = window
        self.warmup = warmup
        self.values: deque[float] = deque()
        self.stamps: deque[int] = deque()  # when each value entered, on the caller's clock
        self._sorted: list[float] = []  # the same values, sorted: the median in O(1)

    @property
    def ready(self) -> bool:
        """Whether the warm-up is over."""
        return len(self.values) >= self.warmup

    @property
    def median(self) -> float | None:
        ordered = self._sorted
        if not ordered:
            return None
        middle = len(ordered) // 2
        return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2

    def zscore(self, value: float) -> float | None:
        """The robust z-score of ``value``, or ``None`` during the warm-up."""
        if not self.ready:
            return None
        # robust_zscore(value, self._sorted), with the window's median read off the sorted values (once)
        ordered = self._sorted
        median = self.median
        scale = MAD_TO_STD * statistics.median([abs(v - median) for v in ordered])  # type: ignore[operator]
        if scale == 0:
            return 0.0 if value == median else math.copysign(math.inf, value - median)  # type: ignore[operator]
        return (value - median) / scale  # type: ignore[operator]

    def jump_zscore(self, value: float) -> float | None:
        """How far ``value`` jumps above the median of the last :data:`RECENT` values, in units of the
        spread of successive differences (``1.4826 * MAD`` of the differences over sqrt(2): the noise of one
        value, like :meth:`zscore`'s scale on a window without a trend). ``None`` during the warm-up.

        A trend does not inflate this spread, unlike :meth:`zscore`'s: a loss that fell by decades inside
        the window has a MAD of decades, so a jump back to its early level scores under any threshold.
        """
        if not self.ready:
            return None
        values = list(self.values)  # in the order they entered
        differences = [later - earlier for earlier, later in zip(values, values[1:])]
        typical = statistics.median(differences)
        spread = MAD_TO_STD * statistics.median([abs(d - typical) for d in differences]) / math.sqrt(2)
        level = statistics.median(values[-RECENT:])
        if spread == 0:
            return 0.0 if value == level else math.copysign(math.inf, value - level)
        return (value - level) / spread

    def add(self, value: float, stamp: int = 0) -> None:
        value = float(value)
        if not math.isfinite(value):  # as OLMo-core's spike detection: a NaN or inf would poison the median
            return
        if len(self.values) == self.window:
            self._drop_oldest()
        self.values.append(value)
        self.stamps.append(stamp)
        bisect.insort(self._sorted, value)

    def forget_before(self, stamp: int) -> None:
        """Drop the values that entered before ``stamp``."""
        stamps = self.stamps
        while stamps and stamps[0] < stamp:
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        self.stamps.popleft()
        del self._sorted[bisect.bisect_left(self._sorted, self.values.popleft())]

    def state_dict(self) -> dict[str, Any]:
        return {"values": list(self.values), "stamps": list(self.stamps)}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self.values, self.stamps, self._sorted = deque(), deque(), []
        values = list(state_dict["values"])
        # a checkpoint from before stamps holds no ages: its values count as recent
        stamps = list(state_dict.get("stamps", [0] * len(values)))
        for value, stamp in list(zip(values, stamps))[-self.window :]:
            self.add(value, stamp)


class Assessment(NamedTuple):
    """The detector's verdict on one step, with the scores that led to it (``None`` = not computed)."""

    verdict: Verdict
    loss_z: float | None = None
    grad_norm_z: float | None = None


class Clearing(NamedTuple):
    """The lowest ``loss_zscore`` and ``grad_norm_zscore`` a step passes at
    (:meth:`SpikeDetector.clearing_scores`)."""

    loss: float
    grad_norm: float


_OK_UNSCORED = Assessment(Verdict.OK)  # the common verdict, built once (a NamedTuple is immutable)


class SpikeDetector:
    """Flags non-finite values and upward spikes of the loss and the gradient norm.

    A value is a spike when its robust z-score against the running window exceeds the threshold **and** it
    is at least ``min_ratio`` times the window median. By default both quantities are judged on a log
    scale: their noise is multiplicative (late in training a loss of 0.05 fluctuates by a factor, not by a
    constant), and on a log scale the z-score of a loss that trends down or a gradient norm that grows
    during early training stays small. Losses that can go negative need ``loss_scale="linear"``; a loss
    exactly 0 on some steps (a hinge, triplet or margin loss) does not: the log scale leaves its 0s out. On a
    linear scale a window mostly at 0 has a median and a MAD of 0, and every positive loss is a spike there.
    A loss at least ``cold_ratio`` times the median is also a spike when it jumps above the latest values by
    more than the threshold in the spread of successive differences (:meth:`RunningRobustZ.jump_zscore`):
    after a descent by decades inside the window the MAD spans decades and hides a x1e4 step.

    Each quantity gets a :class:`RunningRobustZ` per ``key``, plus one that pools every key. Only steps
    judged :attr:`Verdict.OK` enter the windows (``assess(..., accept=True)`` or :meth:`accept`), so a spike
    never raises the baseline it is judged against, and non-finite values never enter them. Non-finite
    values are flagged from the first step; spikes once the key's window is warm. A key still warming up
    (a phase that just started, or a short phase) is judged against the pooled window: a spike there must
    be at least ``cold_ratio`` times the pooled median *and* above the threshold in the pooled spread, so a
    phase that shifts the distribution on purpose (replay of the hardest samples) is not a spike, while a
    100x loss right after a phase change is. Before any window is warm (the first ``warmup`` steps of a
    run), a loss at least ``cold_ratio`` times the median of the losses accepted so far is a spike, from
    the second step on (divergence inside the warm-up); log scale only.

    A window holds only values accepted within the last ``window`` accepted steps. A key that returns after
    other keys ran for a while (the anneal burst after a long replay phase) is therefore judged on what its
    recent steps looked like, or, with too few of them, against the pooled window: never against a baseline
    from an earlier stage of training, when the loss was higher and the gradient norm lower (a stale burst
    baseline once flagged a healthy, improving run as a gradient spike and rolled it back).

    Args:
        loss_zscore: robust z-score above which a loss is a spike; ``None`` turns loss spikes off
            (non-finite losses are still flagged).
        grad_norm_zscore: the same for the global gradient norm; ``None`` turns it off.
        window: size of each running window, in accepted optimizer steps: at most this many values, none
            older than this many accepted steps.
        warmup: accepted steps a window needs before it judges spikes.
        min_ratio: a spike must also be at least this many times the window median (> 1).
        loss_scale: ``"log"`` or ``"linear"``: the scale the loss is judged on. The gradient norm is always
            judged on a log scale.
        cold_ratio: while a key warms up, a spike must be at least this many times the pooled median (and,
            once the pooled window is warm, above the threshold in its spread).
        main_key: the key most steps are judged under (``StabilityGuard``: ``"burst"`` with per-phase
            baselines, else ``"all"``). Saved with ``loss_scale``: a state saved with others is converted on
            load (:meth:`load_state_dict`).

    Raises:
        ValueError: naming the argument, for a non-positive threshold, ``min_ratio <= 1``, an unknown scale
            or a bad window (see :class:`RunningRobustZ`).

    Example::

        detector = SpikeDetector(warmup=20)
        for step in range(30):
            detector.assess(1.0 + 0.01 * (step % 3), 2.0, accept=True)
        assert detector.assess(50.0, 2.0).verdict is Verdict.LOSS_SPIKE
    """

    def __init__(
        self,
        loss_zscore: float | None = 6.0,
        grad_norm_zscore: float | None = 8.0,
        window: int = 100,
        warmup: int = 50,
        min_ratio: float = 1.5,
        loss_scale: str = "log",
        cold_ratio: float = COLD_RATIO,
        main_key: str = "default",
    ) -> None:
        for name, threshold in (("loss_zscore", loss_zscore), ("grad_norm_zscore", grad_norm_zscore)):
            if threshold is not None and not _is_positive_number(threshold):
                raise ValueError(f"`{name}`={threshold!r} must be a positive number, or None to turn it off.")
        if not _is_positive_number(min_ratio) or min_ratio <= 1:
            raise ValueError(f"`min_ratio`={min_ratio!r} must be a finite number > 1.")
        if loss_scale not in SCALES:
            raise ValueError(f"`loss_scale`={loss_scale!r} is not one of {list(SCALES)}.")
        if not _is_positive_number(cold_ratio) or cold_ratio < min_ratio:
            raise ValueError(
                f"`cold_ratio`={cold_ratio!r} must be a finite number >= `min_ratio`={min_ratio!r}."
            )
        RunningRobustZ(window, warmup)  # validates the window arguments
        self.loss_zscore = loss_zscore
        self.grad_norm_zscore = grad_norm_zscore
        self.window = window
        self.warmup = warmup
        self.min_ratio = float(min_ratio)
        self.cold_ratio = float(cold_ratio)
        self.loss_scale = loss_scale
        self.main_key = main_key
        # what the last load_state_dict converted: {"loss_scale" or "main_key": (the state's, this one's)};
        # a checkpoint's is said (and cleared) at train start, a rollback's snapshot's is left unread
        # (StabilityCore.start adds "samples_per_step" where a resume dropped the gradient-norm windows, or
        # "samples_unread" where it kept them for want of this fit's number)
        self.converted: dict[str, tuple[Any, Any]] = {}
        # log(ratio) for the log-scale ratio test, computed once
        self._log_ratio = {
            self.min_ratio: math.log(self.min_ratio),
            self.cold_ratio: math.log(self.cold_ratio),
        }
        self.unjudged_losses = 0  # losses <= 0 seen on a log scale
        self.negative_losses = 0  # those of them < 0 (a 0 is left out harmlessly: it cannot be a spike)
        self.accepted_steps = 0  # the windows' clock: a value is stamped with it when it enters
        # a healthy step's (key, values on their scales) judged with ``hold=True``, until :meth:`accept_held`
        self.held: tuple[str, float | None, float | None] | None = None
        self._loss: dict[str, RunningRobustZ] = {}
        self._grad_norm: dict[str, RunningRobustZ] = {}

    def assess(
        self,
        loss: float | None,
        grad_norm: float | None,
        key: str = "default",
        accept: bool = False,
        hold: bool = False,
    ) -> Assessment:
        """Judge one step. ``None`` means the value was not observed (it is then not judged).

        With ``accept=True`` a step judged OK also enters the baseline (what :meth:`accept` does); with
        ``hold=True`` it enters at :meth:`accept_held` (once its update ran: a checkpoint saved before holds
        the baselines without it). The
        returned z-scores are ``None`` for values that were not judged or not above ``min_ratio`` times the
        median (they cannot be spikes whatever their z-score; the ratio test is O(1), the MAD is not).
        """
        if loss is not None and not math.isfinite(loss):
            return Assessment(Verdict.NONFINITE_LOSS)
        if grad_norm is not None and not math.isfinite(grad_norm):
            return Assessment(Verdict.NONFINITE_GRAD)
        loss_scale = self.loss_scale
        if loss is None or loss_scale == "linear":
            scaled_loss = loss
        elif loss > 0:
            scaled_loss = math.log(loss)
        else:
            scaled_loss = None
            self.unjudged_losses += 1
            if loss < 0:
                self.negative_losses += 1
        scaled_grad = math.log(grad_norm) if grad_norm is not None and grad_norm > 0 else None
        loss_spike, loss_z = self._judge(self._loss, key, scaled_loss, self.loss_zscore, loss_scale)
        grad_spike, grad_z = self._judge(self._grad_norm, key, scaled_grad, self.grad_norm_zscore, "log")
        if loss_spike:
            return Assessment(Verdict.LOSS_SPIKE, loss_z, grad_z)
        if grad_spike:
            return Assessment(Verdict.GRAD_SPIKE, loss_z, grad_z)
        if accept:
            self.accepted_steps += 1
            self._add(self._loss, key, scaled_loss)
            self._add(self._grad_norm, key, scaled_grad)
        elif hold:
            self.held = (key, scaled_loss, scaled_grad)
        if loss_z is None and grad_z is None:
            return _OK_UNSCORED
        return Assessment(Verdict.OK, loss_z, grad_z)

    def forget_losses(self) -> bool:
        """Drop every loss window (the gradient-norm ones stay); whether any held a value."""
        held = any(tracker.values for tracker in self._loss.values())
        self._loss = {}
        return held

    def has_grad_norms(self) -> bool:
        """Whether any gradient-norm window holds a value."""
        return any(tracker.values for tracker in self._grad_norm.values())

    def forget_grad_norms(self) -> bool:
        """Drop every gradient-norm window (they warm up again, as in a fresh run; the loss ones stay); whether
        any held a value."""
        held = self.has_grad_norms()
        self._grad_norm = {}
        return held

    def accept_held(self) -> None:
        """The healthy step's values :meth:`assess` held (``hold=True``) enter the baselines, once."""
        held, self.held = self.held, None
        if held is not None:
            key, loss, grad_norm = held
            self.accepted_steps += 1
            self._add(self._loss, key, loss)
            self._add(self._grad_norm, key, grad_norm)

    def counted_unjudged(self, loss: float | None) -> tuple[int, int]:
        """What :meth:`assess` added to ``(unjudged_losses, negative_losses)`` for a step with ``loss`` and a
        finite gradient norm: a loss <= 0 (< 0) a log scale cannot judge."""
        if loss is None or self.loss_scale != "log" or not math.isfinite(loss) or loss > 0:
            return 0, 0
        return 1, int(loss < 0)

    def accept(self, loss: float | None, grad_norm: float | None, key: str = "default") -> None:
        """Add a healthy step's values to the baseline windows of ``key``."""
        self.accepted_steps += 1
        self._add(self._loss, key, self._on_scale(loss, self.loss_scale))
        self._add(self._grad_norm, key, self._on_scale(grad_norm, "log"))

    def clearing_scores(self, loss: float | None, grad_norm: float | None, key: str = "default") -> Clearing:
        """The thresholds a step's loss and gradient norm would pass at: at ``loss_zscore`` (or
        ``grad_norm_zscore``) at or above the score, that value is no spike against the current windows; 0.0:
        no spike at any threshold (or that threshold is ``None``); ``inf``: a spike at every one (a loss
        judged by its ratio to the median alone, before any window is warm). Each score is the highest of
        the tests :meth:`assess` makes (the jump score of a loss ``cold_ratio`` times the median too, not
        only the one that flagged it). A MAD or two per value: for flagged steps, not every step."""
        return Clearing(
            self._clearing(self._loss, key, self._on_scale(loss, self.loss_scale), self.loss_zscore),
            self._clearing(self._grad_norm, key, self._on_scale(grad_norm, "log"), self.grad_norm_zscore),
        )

    def _clearing(
        self, trackers: dict[str, RunningRobustZ], key: str, value: float | None, threshold: float | None
    ) -> float:
        """:meth:`_judge`'s verdict as the lowest threshold that gives no spike (:meth:`clearing_scores`)."""
        if value is None or threshold is None or not math.isfinite(value):
            return 0.0
        scale = self.loss_scale if trackers is self._loss else "log"
        own, pooled = trackers.get(key), trackers.get(POOLED) if key != POOLED else None
        if own is not None and own.ready:
            if not self._exceeds(value, own.median, self.min_ratio, scale):  # type: ignore[arg-type]
                return 0.0
            score = own.zscore(value)
            if trackers is self._loss and scale == "log":
                if self._exceeds(value, own.median, self.cold_ratio, scale):  # type: ignore[arg-type]
                    score = max(score, own.jump_zscore(value))  # type: ignore[type-var]
            if pooled is None or not pooled.ready:
                return score  # type: ignore[return-value]
            if self._exceeds(value, pooled.median, self.cold_ratio, scale):  # type: ignore[arg-type]
                return score  # type: ignore[return-value]
            if not self._exceeds(value, pooled.median, self.min_ratio, scale):  # type: ignore[arg-type]
                return 0.0
            return min(score, pooled.zscore(value))  # type: ignore[type-var]
        if pooled is not None and pooled.ready:
            if not self._exceeds(value, pooled.median, self.cold_ratio, scale):  # type: ignore[arg-type]
                return 0.0
            return pooled.zscore(value)  # type: ignore[return-value]
        early = trackers.get(POOLED)
        if trackers is not self._loss or scale != "log" or early is None or early.median is None:
            return 0.0
        return math.inf if self._exceeds(value, early.median, self.cold_ratio, scale) else 0.0

    def baseline(self, key: str = "default") -> dict[str, float | None]:
        """Median loss and gradient norm of ``key``'s windows, in their own units (``None`` while empty)."""
        out: dict[str, float | None] = {}
        for name, trackers, scale in (
            ("loss", self._loss, self.loss_scale),
            ("grad_norm", self._grad_norm, "log"),
        ):
            tracker = trackers.get(key)
            median = tracker.median if tracker is not None else None
            out[name] = math.exp(median) if median is not None and scale == "log" else median
        return out

    def state_dict(self) -> dict[str, Any]:
        return {
            "loss": {key: tracker.state_dict() for key, tracker in self._loss.items()},
            "grad_norm": {key: tracker.state_dict() for key, tracker in self._grad_norm.items()},
            "unjudged_losses": self.unjudged_losses,
            "negative_losses": self.negative_losses,
            "accepted_steps": self.accepted_steps,
            "loss_scale": self.loss_scale,
            "main_key": self.main_key,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore the windows. Those of a state saved on another ``loss_scale`` are converted to this one
        (a log-scale value's exponential; a linear one's log, a value <= 0 left out as a log scale leaves
        it out), and those saved under another ``main_key`` are merged into this one's: it gets the pooled
        window, which a detector that used only this key would hold. :attr:`converted` tells what was.
        A state of an earlier version (neither saved) is taken as this detector's."""
        self.held = None
        own = {"loss_scale": self.loss_scale, "main_key": self.main_key}
        saved = {name: state_dict.get(name, value) for name, value in own.items()}
        self.converted = {name: (value, own[name]) for name, value in saved.items() if value != own[name]}
        scale, main_key = saved["loss_scale"], saved["main_key"]
        for name, trackers in (("loss", self._loss), ("grad_norm", self._grad_norm)):
            trackers.clear()
            for key, tracker_state in state_dict[name].items():
                if name == "loss" and scale != self.loss_scale:
                    tracker_state = _rescaled(tracker_state, self.loss_scale)
                trackers[key] = RunningRobustZ(self.window, self.warmup)
                trackers[key].load_state_dict(tracker_state)
            if main_key != self.main_key and (pooled := trackers.get(POOLED)) is not None:
                trackers.clear()
                trackers[POOLED], trackers[self.main_key] = pooled, RunningRobustZ(self.window, self.warmup)
                trackers[self.main_key].load_state_dict(pooled.state_dict())
        self.unjudged_losses = int(state_dict.get("unjudged_losses", 0))
        # a state from before this count: its unjudged losses taken as negative (what was said of them then)
        self.negative_losses = int(state_dict.get("negative_losses", self.unjudged_losses))
        self.accepted_steps = int(state_dict.get("accepted_steps", 0))

    # ------------------------------------------------------------------ internals
    @staticmethod
    def _on_scale(value: float | None, scale: str) -> float | None:
        if value is None or scale == "linear":
            return value
        return math.log(value) if value > 0 else None

    def _exceeds(self, value: float, median: float, ratio: float, scale: str) -> bool:
        """Whether ``value`` is more than ``ratio`` times ``median`` (both on ``scale``)."""
        if scale == "log":
            log_ratio = self._log_ratio.get(ratio)
            return value - median > (math.log(ratio) if log_ratio is None else log_ratio)
        return value - median > (ratio - 1) * abs(median)

    def _judge(
        self,
        trackers: dict[str, RunningRobustZ],
        key: str,
        value: float | None,
        threshold: float | None,
        scale: str,
    ) -> tuple[bool, float | None]:
        """(is ``value`` a spike for ``key``, its z-score if computed)."""
        if value is None or threshold is None:
            return False, None
        own = trackers.get(key)
        if own is not None:
            own.forget_before(self.accepted_steps - self.window + 1)  # O(1) unless the key was away a while
        pooled = trackers.get(POOLED) if key != POOLED else None
        if own is not None and len(own.values) >= own.warmup:  # ``own.ready``, without a property call
            median = own.median
            if not self._exceeds(value, median, self.min_ratio, scale):  # type: ignore[arg-type]
                return False, None
            z = own.zscore(value)
            score = z
            if z is None or z <= threshold:
                # a window that holds a steep descent (a loss falling by decades as a model memorises its
                # data) has a spread of decades: a jump back to its early level scores under the threshold. A
                # loss at least cold_ratio times the median is also judged by how far it jumps above the
                # latest values, in the spread of successive differences, which a trend does not inflate. Only
                # there: a lasting shift to 1.5-3x after a descent (a new data source), a slow rise or a
                # periodic loss keep their verdicts (with this score for every value above min_ratio they
                # were flagged). Not for gradient norms: a lasting 10-30x rise after a descent (layers
                # unfrozen, a prune) would become a run of spikes, and a loss spike's gradient norm comes
                # with its loss.
                far = trackers is self._loss and scale == "log"
                far = far and self._exceeds(value, median, self.cold_ratio, scale)  # type: ignore[arg-type]
                jump = own.jump_zscore(value) if far else None
                if jump is None or jump <= threshold:
                    return False, z
                score = jump
            # a key back after other phases ran (a burst after replay and maintain) still holds its values of
            # the last visit: a spike must also stand out among every key's recent values, or the weights'
            # normal drift while it was away reads as one (a sweep: a gradient norm grown 4x over 15 steps
            # flagged at the first burst step after maintain, then a rollback). Standing out: above the
            # threshold in the pooled spread, or cold_ratio times the pooled median (phases at different
            # levels widen that spread). Without phases the pooled window holds the same values: the same
            # verdict, one more score for a flagged step only.
            if pooled is not None and pooled.ready:
                if self._exceeds(value, pooled.median, self.cold_ratio, scale):  # type: ignore[arg-type]
                    return True, score
                if not self._exceeds(value, pooled.median, self.min_ratio, scale):  # type: ignore[arg-type]
                    return False, score
                pooled_z = pooled.zscore(value)
                return pooled_z is not None and pooled_z > threshold, score
            return True, score
        if pooled is not None and pooled.ready:
            # a key still warming up (a phase that just started) is judged against every key's recent values:
            # far above their median (cold_ratio) and far outside their spread (the z-score). A phase that
            # deliberately shifts the distribution (replay of the hardest samples) stays inside that spread.
            if not self._exceeds(value, pooled.median, self.cold_ratio, scale):  # type: ignore[arg-type]
                return False, None
            z = pooled.zscore(value)
            return z is not None and z > threshold, z
        # the first steps of the run, before any window is warm: a loss far above the median of the healthy
        # losses seen so far is divergence. Not for gradient norms (they legitimately grow by more than that
        # early on), nor on a linear scale (a ratio to a median near zero means nothing).
        early = trackers.get(POOLED)
        if trackers is not self._loss or scale != "log" or early is None or early.median is None:
            return False, None
        return self._exceeds(value, early.median, self.cold_ratio, scale), None  # type: ignore[arg-type]

    def _add(self, trackers: dict[str, RunningRobustZ], key: str, value: float | None) -> None:
        if value is None:
            return
        own = trackers.get(key)
        if own is None:
            own = trackers[key] = RunningRobustZ(self.window, self.warmup)
        stamp = self.accepted_steps
        own.forget_before(stamp - self.window + 1)
        own.add(value, stamp)
        if key != POOLED:
            pooled = trackers.get(POOLED)
            if pooled is None:
                pooled = trackers[POOLED] = RunningRobustZ(self.window, self.warmup)
            pooled.add(value, stamp)


def _rescaled(tracker_state: Mapping[str, Any], scale: str) -> dict[str, Any]:
    """A :class:`RunningRobustZ` state of loss values on the other scale, converted to ``scale``."""
    values = list(tracker_state["values"])
    stamps = list(tracker_state.get("stamps", [0] * len(values)))
    if scale == "linear":  # from log: a value above ~709 (a loss over 1e307) overflows, and is left out
        pairs = [(math.exp(value), stamp) for value, stamp in zip(values, stamps) if value < 709.0]
    else:
        pairs = [(math.log(value), stamp) for value, stamp in zip(values, stamps) if value > 0]
    return {"values": [value for value, _ in pairs], "stamps": [stamp for _, stamp in pairs]}


def _is_positive_number(value: Any) -> bool:
    return (
        not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value > 0
    )


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"`{name}`={value!r} must be an int >= {minimum}.")
