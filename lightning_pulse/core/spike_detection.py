"""Loss- and gradient-spike detection, and the escalation policy that answers spikes. Plain Python.

* :func:`robust_zscore` and :class:`RunningRobustZ`: how far a new value sits above the median of a sliding
  window of accepted values, in units of the window's median absolute deviation (MAD), with a warm-up.
* :class:`SpikeDetector`: non-finite checks plus robust z-scores of the (log) loss and gradient norm, with one
  window per key (``StabilityGuard`` keys by pulse phase, so a replay phase that deliberately trains on
  high-loss samples is compared with earlier replay phases, not with bursts).
* :class:`EscalationPolicy`: turns a stream of verdicts into actions: apply the update, skip it, roll back
  to a snapshot, or stop. It is a deterministic state machine, so DDP ranks fed the same (all-reduced)
  numbers take the same actions.

Nothing here imports Lightning or needs a tensor.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from enum import Enum
from typing import Any, NamedTuple

# MAD * 1.4826 estimates the standard deviation of normally distributed data.
MAD_TO_STD = 1.4826

# bound once: used on every optimizer step
_INF = math.inf
_log = math.log
_bisect_left = bisect.bisect_left
_insort = bisect.insort


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


class Action(str, Enum):
    """What :class:`EscalationPolicy` tells the trainer to do with one optimizer step."""

    APPLY = "apply"
    SKIP = "skip"  # drop this update; parameters and optimizer state stay as they are
    ROLLBACK = "rollback"  # drop this update, then return to the last good snapshot
    STOP = "stop"  # drop this update, return to the last good snapshot, save a checkpoint, raise

    def __str__(self) -> str:
        return self.value


def robust_zscore(value: float, history: Iterable[float]) -> float:
    """One-sided robust z-score of ``value`` against ``history``: ``(value - median) / (1.4826 * MAD)``.

    The median absolute deviation (MAD), scaled to estimate a standard deviation, is not inflated by a few
    outliers in ``history``, unlike the standard deviation. A zero MAD (constant history) gives ``inf`` for
    any larger value, so callers pair the score with a minimum ratio (see :class:`SpikeDetector`).

    Args:
        value: the new observation.
        history: the reference values (at least one).

    Returns:
        The z-score; positive when ``value`` is above the median.
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
    are judged against.

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
        # the same values, kept sorted so the median costs O(1) per step; unboxed doubles in one block, so the
        # binary searches and the shift of an update touch a few cache lines, not one float object per probe
        self._sorted: list[float] = []

    @property
    def ready(self) -> bool:
        """Whether the warm-up is over."""
        return len(self.values) >= self.warmup

    @property
    def median(self) -> float | None:
        return _sorted_median(self._sorted) if self._sorted else None

    def zscore(self, value: float) -> float | None:
        """The robust z-score of ``value``, or ``None`` during the warm-up."""
        if not self.ready:
            return None
        return robust_zscore(value, self._sorted)

    def add(self, value: float) -> None:
        value = float(value)
        values, ordered = self.values, self._sorted
        if len(values) == self.window:
            del ordered[_bisect_left(ordered, values.popleft())]
        values.append(value)
        _insort(ordered, value)

    def state_dict(self) -> dict[str, Any]:
        return {"values": list(self.values)}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self.values = deque(float(v) for v in list(state_dict["values"])[-self.window :])
        self._sorted = sorted(self.values)


SCALES = ("log", "linear")
POOLED = "*"  # the key of the baseline that pools every other key's values


class Assessment(NamedTuple):
    """The detector's verdict on one step, with the scores that led to it (``None`` = not judged)."""

    verdict: Verdict
    loss_z: float | None = None
    grad_norm_z: float | None = None


#: The verdict of a common quiet step (no z-scores computed), shared: it is returned on nearly every step.
QUIET = Assessment(Verdict.OK)


class SpikeDetector:
    """Flags non-finite values and upward spikes of the loss and the gradient norm.

    A value is a spike when its robust z-score against the running window exceeds the threshold **and** it
    is at least ``min_ratio`` times the window median. By default both quantities are judged on a log
    scale: their noise is multiplicative (late in training a loss of 0.05 fluctuates by a factor, not by a
    constant), and on a log scale the z-score of a loss that trends down or a gradient norm that grows
    during early training stays small. Losses that can be zero or negative need ``loss_scale="linear"``.

    Each quantity gets a :class:`RunningRobustZ` per ``key``, plus one that pools every key. Only steps
    judged :attr:`Verdict.OK` should be passed to :meth:`accept`, so a spike never raises the baseline it is
    judged against. Non-finite values are flagged from the first step; spikes once the key's window is
    warm, and before that only values at least ``cold_ratio`` times the pooled median (a short phase
    that has seen few steps is not blind to a 100x loss).

    Args:
        loss_zscore: robust z-score above which a loss is a spike; ``None`` turns loss spikes off
            (non-finite losses are still flagged).
        grad_norm_zscore: the same for the global gradient norm; ``None`` turns it off.
        window: size of each running window, in optimizer steps.
        warmup: accepted steps a window needs before it judges spikes.
        min_ratio: a spike must also be at least this many times the window median (> 1).
        loss_scale: ``"log"`` or ``"linear"``: the scale the loss is judged on. The gradient norm is always
            judged on a log scale.
        cold_ratio: while a key warms up, a value at least this many times the pooled median is a spike.

    Raises:
        ValueError: naming the argument, for a non-positive threshold, ``min_ratio <= 1``, an unknown scale
            or a bad window (see :class:`RunningRobustZ`).
    """

    def __init__(
        self,
        loss_zscore: float | None = 6.0,
        grad_norm_zscore: float | None = 8.0,
        window: int = 100,
        warmup: int = 50,
        min_ratio: float = 1.5,
        loss_scale: str = "log",
        cold_ratio: float = 10.0,
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
        self._log_min_ratio = math.log(self.min_ratio)
        self.cold_ratio = float(cold_ratio)
        self._log_cold_ratio = math.log(self.cold_ratio)
        self.loss_scale = loss_scale
        self._log_loss = loss_scale == "log"
        self.unjudged_losses = 0  # losses <= 0 seen on a log scale
        self._loss: dict[str, RunningRobustZ] = {}
        self._grad_norm: dict[str, RunningRobustZ] = {}

    def _tracker(self, trackers: dict[str, RunningRobustZ], key: str) -> RunningRobustZ:
        tracker = trackers.get(key)
        if tracker is None:
            tracker = trackers[key] = RunningRobustZ(self.window, self.warmup)
            if key != POOLED:
                pooled = trackers.get(POOLED)
                if pooled is None:
                    # while one key is in use the pooled window holds exactly its values: share the object, so
                    # a run without phases (or with one baseline) pays for one window per quantity, not two
                    trackers[POOLED] = tracker
                elif any(pooled is other for name, other in trackers.items() if name != POOLED):
                    trackers[POOLED] = _copy_tracker(
                        pooled
                    )  # a second key: the pooled window goes its own way
        return tracker

    @staticmethod
    def _on_scale(value: float | None, scale: str) -> float | None:
        if value is None or scale == "linear":
            return value
        return math.log(value) if value > 0 else None

    def _score(
        self, tracker: RunningRobustZ, value: float | None, threshold: float | None, scale: str
    ) -> tuple[bool, float | None]:
        """(is it a spike, its z-score). The z-score is computed only for a value above ``min_ratio`` times
        the median: the ratio test is O(1), the MAD is not, and most steps fail the ratio test."""
        if value is None or threshold is None or not tracker.ready:
            return False, None
        median = tracker.median
        assert median is not None  # a warm tracker holds values
        excess = value - median
        if excess <= (self._log_min_ratio if scale == "log" else (self.min_ratio - 1) * abs(median)):
            return False, None
        z = tracker.zscore(value)
        return z is not None and z > threshold, z

    def assess(
        self, loss: float | None, grad_norm: float | None, key: str = "default", accept: bool = False
    ) -> Assessment:
        """Judge one step. ``None`` means the value was not observed (it is then not judged).

        With ``accept=True`` a step judged OK also enters the baseline (what :meth:`accept` does, in one
        pass). The returned z-scores are ``None`` for values that were not judged or not above
        ``min_ratio`` times the median (they cannot be spikes whatever their z-score).
        """
        quiet = self.assess_quiet_step(loss, grad_norm, key, accept)
        if quiet is not None:
            return quiet
        if loss is not None and not math.isfinite(loss):
            return Assessment(Verdict.NONFINITE_LOSS)
        if grad_norm is not None and not math.isfinite(grad_norm):
            return Assessment(Verdict.NONFINITE_GRAD)
        scaled_loss = self._on_scale(loss, self.loss_scale)
        if loss is not None and scaled_loss is None:
            self.unjudged_losses += 1
        scaled_grad = self._on_scale(grad_norm, "log")
        loss_tracker = self._loss.get(key) or self._tracker(self._loss, key)
        grad_tracker = self._grad_norm.get(key) or self._tracker(self._grad_norm, key)
        loss_spike, loss_z = self._score(loss_tracker, scaled_loss, self.loss_zscore, self.loss_scale)
        grad_spike, grad_z = self._score(grad_tracker, scaled_grad, self.grad_norm_zscore, "log")
        if key != POOLED and not (loss_tracker.ready and grad_tracker.ready):
            # a key still warming up is not blind: values far above every key's recent median are caught
            loss_spike = loss_spike or self._cold_spike(
                self._loss, loss_tracker, scaled_loss, self.loss_zscore, self.loss_scale
            )
            grad_spike = grad_spike or self._cold_spike(
                self._grad_norm, grad_tracker, scaled_grad, self.grad_norm_zscore, "log"
            )
        if loss_spike:
            return Assessment(Verdict.LOSS_SPIKE, loss_z, grad_z)
        if grad_spike:
            return Assessment(Verdict.GRAD_SPIKE, loss_z, grad_z)
        if accept:
            self._add(self._loss, loss_tracker, scaled_loss, key)
            self._add(self._grad_norm, grad_tracker, scaled_grad, key)
        return Assessment(Verdict.OK, loss_z, grad_z)

    def assess_quiet_step(
        self, loss: float | None, grad_norm: float | None, key: str = "default", accept: bool = True
    ) -> Assessment | None:
        """The verdict of a common step in one pass, or ``None`` when :meth:`assess` must judge it.

        Common: both values observed, finite and positive, the loss judged on a log scale, and neither value
        high enough to be a spike whatever its z-score: at most ``min_ratio`` times the median of its warm
        window or, while the key's window warms up, at most ``cold_ratio`` times the pooled median. The
        verdict is then :attr:`Verdict.OK` with no z-scores, as :meth:`assess` would give, and with
        ``accept=True`` the values enter the windows as they would there. ``None`` changes nothing.

        It runs every optimizer step, so the common case is written out in this one function (medians read
        off the sorted windows, the window updates of :meth:`RunningRobustZ.add` inline): inside a training
        step, where the interpreter's caches are cold, every further call and object touched costs
        microseconds.

        StabilityGuard runs the same function natively where it can (``quiet_step`` in
        ``lightning_pulse/_csrc/step_reader.cpp``), on this detector's own attributes (``_log_loss``,
        ``_loss``, ``_grad_norm``, ``_log_min_ratio``, the trackers' ``_sorted``, ``values``, ``window``,
        ``warmup``) and calling :meth:`_below_spike_level` and :meth:`_add_pooled`: a change here must be made
        there too.
        ``tests/test_spike_detection.py`` holds both to the general path, step by step.
        """
        if (
            loss is None
            or grad_norm is None
            or not self._log_loss
            or not (0.0 < loss < _INF and 0.0 < grad_norm < _INF)  # NaN fails every comparison
        ):
            return None
        loss_tracker = self._loss.get(key)
        grad_tracker = self._grad_norm.get(key)
        if loss_tracker is None or grad_tracker is None:
            return None
        scaled_loss, scaled_grad = _log(loss), _log(grad_norm)
        ordered_loss, ordered_grad = loss_tracker._sorted, grad_tracker._sorted
        if len(ordered_loss) >= loss_tracker.warmup and len(ordered_grad) >= grad_tracker.warmup:
            limit = self._log_min_ratio
            middle = len(ordered_loss) // 2
            median = (
                ordered_loss[middle]
                if len(ordered_loss) % 2
                else (ordered_loss[middle - 1] + ordered_loss[middle]) / 2
            )
            if scaled_loss - median > limit:
                return None
            middle = len(ordered_grad) // 2
            median = (
                ordered_grad[middle]
                if len(ordered_grad) % 2
                else (ordered_grad[middle - 1] + ordered_grad[middle]) / 2
            )
            if scaled_grad - median > limit:
                return None
        elif not (
            self._below_spike_level(self._loss, loss_tracker, scaled_loss, key)
            and self._below_spike_level(self._grad_norm, grad_tracker, scaled_grad, key)
        ):
            return None
        if accept:
            # the two windows' updates written out, not looped over: no tuples to build on the hot path
            values = loss_tracker.values
            if len(values) == loss_tracker.window:
                del ordered_loss[_bisect_left(ordered_loss, values.popleft())]
            values.append(scaled_loss)
            _insort(ordered_loss, scaled_loss)
            values = grad_tracker.values
            if len(values) == grad_tracker.window:
                del ordered_grad[_bisect_left(ordered_grad, values.popleft())]
            values.append(scaled_grad)
            _insort(ordered_grad, scaled_grad)
            if key != POOLED:
                # the pooled windows: the same objects while one key is in use (see `_tracker`)
                pooled = self._loss.get(POOLED)
                if pooled is not loss_tracker:
                    self._add_pooled(self._loss, pooled, scaled_loss)
                pooled = self._grad_norm.get(POOLED)
                if pooled is not grad_tracker:
                    self._add_pooled(self._grad_norm, pooled, scaled_grad)
        return QUIET

    def _below_spike_level(
        self, trackers: dict[str, RunningRobustZ], own: RunningRobustZ, value: float, key: str
    ) -> bool:
        """Whether a positive, log-scaled ``value`` is too low to be a spike: at most ``min_ratio`` times the
        median of its warm window, or, while that warms up, at most ``cold_ratio`` times the pooled median
        (no cold check for the pooled key itself, as in :meth:`assess`)."""
        if own.ready:
            return value - own.median <= self._log_min_ratio  # type: ignore[operator]
        pooled = trackers.get(POOLED)
        if key == POOLED or pooled is None or not pooled.ready:
            return True
        return value - pooled.median <= self._log_cold_ratio  # type: ignore[operator]

    def _add_pooled(
        self, trackers: dict[str, RunningRobustZ], pooled: RunningRobustZ | None, value: float
    ) -> None:
        if pooled is None:
            pooled = self._tracker(trackers, POOLED)
        pooled.add(value)

    def _cold_spike(
        self,
        trackers: dict[str, RunningRobustZ],
        own: RunningRobustZ,
        value: float | None,
        threshold: float | None,
        scale: str,
    ) -> bool:
        if value is None or threshold is None or own.ready:
            return False
        pooled = trackers.get(POOLED)
        if pooled is None or not pooled.ready:
            return False
        median = pooled.median
        assert median is not None
        if scale == "log":
            return value - median > self._log_cold_ratio
        return value - median > (self.cold_ratio - 1) * abs(median)

    def _add(
        self, trackers: dict[str, RunningRobustZ], own: RunningRobustZ, value: float | None, key: str
    ) -> None:
        if value is None:
            return
        own.add(value)
        if key != POOLED:
            pooled = trackers.get(POOLED)
            if pooled is None:
                pooled = self._tracker(trackers, POOLED)
            if pooled is not own:
                pooled.add(value)

    def accept(self, loss: float | None, grad_norm: float | None, key: str = "default") -> None:
        """Add a healthy step's values to the baseline windows of ``key``."""
        self._add(self._loss, self._tracker(self._loss, key), self._on_scale(loss, self.loss_scale), key)
        self._add(self._grad_norm, self._tracker(self._grad_norm, key), self._on_scale(grad_norm, "log"), key)

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
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        for name, trackers in (("loss", self._loss), ("grad_norm", self._grad_norm)):
            trackers.clear()
            for key, tracker_state in state_dict[name].items():
                tracker = trackers[key] = RunningRobustZ(self.window, self.warmup)
                tracker.load_state_dict(tracker_state)
            own = [tracker for key, tracker in trackers.items() if key != POOLED]
            pooled = trackers.get(POOLED)
            if len(own) == 1 and (pooled is None or pooled.values == own[0].values):
                trackers[POOLED] = own[0]  # one key in use: share its window again (see `_tracker`)
        self.unjudged_losses = int(state_dict.get("unjudged_losses", 0))


class EscalationPolicy:
    """Decides, step by step, whether to apply, skip, roll back or stop.

    * A flagged step is skipped.
    * When ``rollback_after`` flagged steps fall within the last ``spike_memory`` steps, the run rolls
      back to its last good snapshot and then skips the next ``skip_after_rollback`` steps (the batches a
      spike came with are not trained on again, as PaLM did).
    * When a rollback is needed but ``max_rollbacks`` rollbacks already happened within the last
      ``rollback_memory`` steps, the run stops instead.

    ``step`` is the optimizer step being decided (``trainer.global_step`` before it is taken).

    Args:
        rollback_after: flagged steps within ``spike_memory`` that trigger a rollback.
        spike_memory: how many recent steps count towards ``rollback_after``.
        skip_after_rollback: steps skipped right after a rollback.
        max_rollbacks: rollbacks allowed within ``rollback_memory`` steps before the next one becomes a stop.
        rollback_memory: how many recent steps count towards ``max_rollbacks``.

    Raises:
        ValueError: naming the argument, for a non-integer or out-of-range value.
    """

    def __init__(
        self,
        rollback_after: int = 3,
        spike_memory: int = 50,
        skip_after_rollback: int = 20,
        max_rollbacks: int = 3,
        rollback_memory: int = 1000,
    ) -> None:
        _check_int("rollback_after", rollback_after, minimum=1)
        _check_int("spike_memory", spike_memory, minimum=1)
        _check_int("skip_after_rollback", skip_after_rollback, minimum=0)
        _check_int("max_rollbacks", max_rollbacks, minimum=0)
        _check_int("rollback_memory", rollback_memory, minimum=1)
        self.rollback_after = rollback_after
        self.spike_memory = spike_memory
        self.skip_after_rollback = skip_after_rollback
        self.max_rollbacks = max_rollbacks
        self.rollback_memory = rollback_memory
        self.spike_steps: list[int] = []  # flagged steps of the open incident
        self.rollback_steps: list[int] = []
        self.skip_remaining = 0

    @property
    def in_incident(self) -> bool:
        """Whether recent flagged steps (not yet resolved by a rollback) are remembered."""
        return bool(self.spike_steps)

    @property
    def incident_start(self) -> int | None:
        """The first flagged step still remembered, i.e. where the current trouble began."""
        return self.spike_steps[0] if self.spike_steps else None

    def forget_old(self, step: int) -> None:
        """Drop flagged steps and rollbacks that fell out of their memories."""
        # both lists are in step order: drop from the front (usually nothing, checked in O(1))
        while self.spike_steps and step - self.spike_steps[0] >= self.spike_memory:
            self.spike_steps.pop(0)
        while self.rollback_steps and step - self.rollback_steps[0] >= self.rollback_memory:
            self.rollback_steps.pop(0)

    def decide(self, step: int, verdict: Verdict) -> Action:
        """The action for a step the detector judged ``verdict`` (not called for forced skips)."""
        if self.spike_steps or self.rollback_steps:
            self.forget_old(step)
        if verdict is Verdict.OK:
            return Action.APPLY
        self.spike_steps.append(step)
        if len(self.spike_steps) < self.rollback_after:
            return Action.SKIP
        if len(self.rollback_steps) >= self.max_rollbacks:
            return Action.STOP
        return Action.ROLLBACK

    def consume_forced_skip(self) -> bool:
        """True (and one fewer left) while steps remain to be skipped after a rollback."""
        if self.skip_remaining > 0:
            self.skip_remaining -= 1
            return True
        return False

    def rolled_back(self, step: int) -> None:
        """Record a rollback at ``step``: the incident is resolved, the next steps are skipped."""
        self.rollback_steps.append(step)
        self.spike_steps = []
        self.skip_remaining = self.skip_after_rollback

    def state_dict(self) -> dict[str, Any]:
        return {
            "spike_steps": list(self.spike_steps),
            "rollback_steps": list(self.rollback_steps),
            "skip_remaining": self.skip_remaining,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self.spike_steps = [int(s) for s in state_dict["spike_steps"]]
        self.rollback_steps = [int(s) for s in state_dict["rollback_steps"]]
        self.skip_remaining = int(state_dict["skip_remaining"])


def _sorted_median(ordered: Sequence[float]) -> float:
    """The median of a non-empty sorted list."""
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def _copy_tracker(tracker: RunningRobustZ) -> RunningRobustZ:
    copied = RunningRobustZ(tracker.window, tracker.warmup)
    copied.values = deque(tracker.values)
    copied._sorted = list(tracker._sorted)
    return copied


def _is_positive_number(value: Any) -> bool:
    return (
        not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value > 0
    )


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"`{name}`={value!r} must be an int >= {minimum}.")
