"""The functional core of StabilityGuard's detection: robust z-scores, the detector and the escalation policy."""

from __future__ import annotations

import math
import random

import pytest

from lightning_pulse import _native
from lightning_pulse.core.spike_detection import (
    QUIET,
    Action,
    EscalationPolicy,
    RunningRobustZ,
    SpikeDetector,
    Verdict,
    robust_zscore,
)


def test_robust_zscore_is_distance_from_median_in_mad_units():
    history = [1.0, 2.0, 3.0, 4.0, 100.0]  # median 3, MAD 1: the outlier does not widen the scale
    assert robust_zscore(3.0, history) == 0.0
    assert robust_zscore(9.0, history) == pytest.approx(6.0 / 1.4826)
    assert robust_zscore(0.0, history) == pytest.approx(-3.0 / 1.4826)


def test_robust_zscore_of_constant_history_is_infinite_above_and_zero_at_the_median():
    assert robust_zscore(5.0, [5.0] * 4) == 0.0
    assert robust_zscore(5.1, [5.0] * 4) == math.inf
    with pytest.raises(ValueError, match="history"):
        robust_zscore(1.0, [])


def test_running_window_waits_for_warmup_and_forgets_the_oldest_values():
    tracker = RunningRobustZ(window=4, warmup=3)
    for value in (10.0, 20.0):
        tracker.add(value)
    assert tracker.zscore(100.0) is None
    tracker.add(30.0)
    assert tracker.zscore(20.0) == 0.0
    for value in (1.0, 2.0, 3.0):
        tracker.add(value)
    assert list(tracker.values) == [30.0, 1.0, 2.0, 3.0]
    assert tracker.median == 2.5
    restored = RunningRobustZ(window=4, warmup=3)
    restored.load_state_dict(tracker.state_dict())
    assert restored.median == 2.5 and restored.zscore(7.0) == tracker.zscore(7.0)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"window": 1}, "window"),
        ({"warmup": 1}, "warmup"),
        ({"window": 10, "warmup": 11}, "warmup"),
        ({"loss_zscore": 0}, "loss_zscore"),
        ({"grad_norm_zscore": -1.0}, "grad_norm_zscore"),
        ({"min_ratio": 1.0}, "min_ratio"),
        ({"loss_scale": "sqrt"}, "loss_scale"),
    ],
)
def test_detector_rejects_bad_arguments_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"`{field}`"):
        SpikeDetector(**kwargs)


def _warm(detector: SpikeDetector, steps: int = 30, key: str = "default", seed: int = 0) -> None:
    rng = random.Random(seed)
    for _ in range(steps):
        detector.accept(rng.uniform(0.9, 1.1), rng.uniform(1.8, 2.2), key)


def test_non_finite_values_are_flagged_even_before_warmup():
    detector = SpikeDetector(warmup=20)
    assert detector.assess(float("nan"), 1.0).verdict is Verdict.NONFINITE_LOSS
    assert detector.assess(1.0, float("inf")).verdict is Verdict.NONFINITE_GRAD
    assert detector.assess(1e6, 1e6).verdict is Verdict.OK  # no baseline yet: not judged


def test_loss_and_grad_norm_spikes_are_flagged_once_warm():
    detector = SpikeDetector(warmup=20)
    _warm(detector)
    assert detector.assess(1.05, 2.1).verdict is Verdict.OK
    loss_spike = detector.assess(5.0, 2.0)
    assert loss_spike.verdict is Verdict.LOSS_SPIKE and loss_spike.loss_z > 6
    assert detector.assess(1.0, 50.0).verdict is Verdict.GRAD_SPIKE


def test_a_spike_must_also_exceed_min_ratio_times_the_median():
    detector = SpikeDetector(loss_zscore=6.0, min_ratio=1.5, warmup=20)
    for _ in range(30):
        detector.accept(1.0, 1.0)  # zero spread: every larger value has an infinite z-score
    assert detector.assess(1.4, 1.0).verdict is Verdict.OK
    assert detector.assess(1.6, 1.0).verdict is Verdict.LOSS_SPIKE


def test_log_scale_tolerates_multiplicative_noise_of_a_small_late_loss():
    # late in training a 0.05 loss wanders by factors; on a linear scale its MAD is tiny
    rng = random.Random(1)
    losses = [0.05 * math.exp(rng.gauss(0.0, 0.5)) for _ in range(300)]
    verdicts = {}
    for scale in ("log", "linear"):
        detector = SpikeDetector(loss_zscore=6.0, grad_norm_zscore=None, loss_scale=scale, min_ratio=1.01)
        flagged = 0
        for loss in losses:
            if detector.assess(loss, None).verdict is Verdict.OK:
                detector.accept(loss, None)
            else:
                flagged += 1
        verdicts[scale] = flagged
    assert verdicts["log"] == 0
    assert verdicts["linear"] > 0


def test_losses_at_or_below_zero_are_counted_as_unjudged_on_a_log_scale():
    detector = SpikeDetector(warmup=20)
    _warm(detector)
    assert detector.assess(-3.0, 2.0).verdict is Verdict.OK
    assert detector.unjudged_losses == 1
    linear = SpikeDetector(loss_scale="linear", warmup=20)
    for _ in range(30):
        linear.accept(-1.0 + random.Random(2).uniform(-0.01, 0.01), 2.0)
    assert linear.assess(10.0, 2.0).verdict is Verdict.LOSS_SPIKE


def test_each_key_has_its_own_baseline():
    detector = SpikeDetector(warmup=20)
    _warm(detector, key="burst")
    for _ in range(30):
        detector.accept(3.0, 2.0, "replay")  # replay trains on hard samples: higher loss is normal there
    assert detector.assess(3.0, 2.0, "burst").verdict is Verdict.LOSS_SPIKE
    assert detector.assess(3.0, 2.0, "replay").verdict is Verdict.OK
    assert detector.assess(3.0, 2.0, "maintain").verdict is Verdict.OK  # a new key starts its warm-up


def test_detector_state_round_trips():
    detector = SpikeDetector(warmup=20)
    _warm(detector, key="burst")
    restored = SpikeDetector(warmup=20)
    restored.load_state_dict(detector.state_dict())
    assert restored.baseline("burst") == detector.baseline("burst")
    assert restored.assess(5.0, 2.0, "burst") == detector.assess(5.0, 2.0, "burst")


def test_policy_skips_then_rolls_back_then_stops():
    policy = EscalationPolicy(rollback_after=2, spike_memory=10, skip_after_rollback=3, max_rollbacks=1)
    assert policy.decide(0, Verdict.OK) is Action.APPLY
    assert policy.decide(5, Verdict.LOSS_SPIKE) is Action.SKIP
    assert policy.incident_start == 5
    assert policy.decide(6, Verdict.GRAD_SPIKE) is Action.ROLLBACK
    policy.rolled_back(6)
    assert not policy.in_incident
    assert [policy.consume_forced_skip() for _ in range(4)] == [True, True, True, False]
    assert policy.decide(11, Verdict.NONFINITE_LOSS) is Action.SKIP
    assert policy.decide(12, Verdict.NONFINITE_LOSS) is Action.STOP  # one rollback already, max_rollbacks=1


def test_policy_forgets_spikes_and_rollbacks_outside_their_memories():
    policy = EscalationPolicy(rollback_after=2, spike_memory=10, max_rollbacks=1, rollback_memory=100)
    assert policy.decide(0, Verdict.LOSS_SPIKE) is Action.SKIP
    assert policy.decide(10, Verdict.LOSS_SPIKE) is Action.SKIP  # step 0 is 10 steps back: forgotten
    policy.rolled_back(11)
    assert policy.decide(200, Verdict.LOSS_SPIKE) is Action.SKIP
    assert policy.decide(201, Verdict.LOSS_SPIKE) is Action.ROLLBACK  # the rollback at 11 is forgotten
    restored = EscalationPolicy(rollback_after=2, spike_memory=10, max_rollbacks=1, rollback_memory=100)
    restored.load_state_dict(policy.state_dict())
    assert restored.spike_steps == [200, 201] and restored.rollback_steps == []


@pytest.mark.parametrize(
    "field", ["rollback_after", "spike_memory", "skip_after_rollback", "max_rollbacks", "rollback_memory"]
)
def test_policy_rejects_bad_arguments_naming_the_field(field):
    with pytest.raises(ValueError, match=f"`{field}`"):
        EscalationPolicy(**{field: -1})


def test_assess_with_accept_adds_only_healthy_steps_to_the_baseline():
    detector = SpikeDetector(warmup=20)
    _warm(detector, steps=20)
    assert detector.assess(1.0, 2.0, accept=True).verdict is Verdict.OK
    assert detector.assess(50.0, 2.0, accept=True).verdict is Verdict.LOSS_SPIKE
    state = detector.state_dict()
    assert len(state["loss"]["default"]["values"]) == 21
    assert max(state["loss"]["default"]["values"]) < math.log(2.0)


def test_a_key_still_warming_up_catches_only_huge_spikes_against_the_pooled_baseline():
    detector = SpikeDetector(warmup=20, cold_ratio=10.0)
    _warm(detector, key="burst")
    for _ in range(3):
        detector.accept(1.0, 2.0, "maintain")  # a short phase: 3 steps, far from warm
    assert detector.assess(5.0, 2.0, "maintain").verdict is Verdict.OK  # 5x: left to the warm baseline
    assert detector.assess(500.0, 2.0, "maintain").verdict is Verdict.LOSS_SPIKE
    assert detector.assess(1.0, 300.0, "maintain").verdict is Verdict.GRAD_SPIKE
    with pytest.raises(ValueError, match="`cold_ratio`"):
        SpikeDetector(min_ratio=2.0, cold_ratio=1.5)


def test_the_pooled_window_is_shared_while_one_key_is_in_use_and_splits_at_the_second():
    detector = SpikeDetector(warmup=20)
    _warm(detector, key="burst")
    state = detector.state_dict()
    # one key so far: the pooled window holds exactly its values (and is saved as such)
    assert state["loss"]["*"] == state["loss"]["burst"]
    for _ in range(3):
        detector.accept(1.0, 2.0, "maintain")
    state = detector.state_dict()
    assert len(state["loss"]["burst"]["values"]) == 30 and len(state["loss"]["maintain"]["values"]) == 3
    assert state["loss"]["*"]["values"] == state["loss"]["burst"]["values"] + [0.0] * 3  # log(1.0)
    # a restored single-key detector judges like the original, and keeps adding each value once
    restored = SpikeDetector(warmup=20)
    single = SpikeDetector(warmup=20)
    _warm(single, key="burst")
    restored.load_state_dict(single.state_dict())
    restored.accept(1.2, 2.0, "burst")
    single.accept(1.2, 2.0, "burst")
    assert restored.state_dict() == single.state_dict()


def _with_shortcut(detector: SpikeDetector, shortcut: str) -> SpikeDetector:
    """The detector, with its quiet-step shortcut in Python or (StabilityGuard's hot path) the native one."""
    if shortcut == "native":
        module = _native.step_reader()
        if module is None:
            pytest.skip(f"the extension module cannot be built here: {_native.step_reader_error}")
        python_shortcut = detector.assess_quiet_step

        def native_shortcut(loss, grad_norm, key="default", accept=False):
            if not accept:  # the native shortcut is the guard's: it always accepts
                return python_shortcut(loss, grad_norm, key, accept)
            return QUIET if module.quiet_step(detector, loss, grad_norm, key) else None

        detector.assess_quiet_step = native_shortcut
    return detector


@pytest.mark.parametrize("shortcut", ["python", "native"])
def test_the_quiet_step_shortcut_gives_the_general_verdicts_and_baselines(shortcut):
    rng = random.Random(3)
    fast, general = _with_shortcut(SpikeDetector(warmup=20), shortcut), SpikeDetector(warmup=20)
    general.assess_quiet_step = lambda *args: None  # every step through the general path
    verdicts = set()
    for step in range(400):
        loss = rng.lognormvariate(0, 0.1) * (20 if step % 37 == 0 else 1)
        grad_norm = rng.lognormvariate(1, 0.1) * (30 if step % 53 == 0 else 1.6 if step % 7 == 0 else 1)
        if step % 101 == 0:
            loss = float("nan")
        key = "burst" if step % 10 < 7 else "replay"
        verdict = fast.assess(loss, grad_norm, key, accept=True)
        assert verdict == general.assess(loss, grad_norm, key, accept=True), step
        verdicts.add(verdict.verdict)
    assert fast.state_dict() == general.state_dict()
    assert verdicts == {Verdict.OK, Verdict.LOSS_SPIKE, Verdict.GRAD_SPIKE, Verdict.NONFINITE_LOSS}


@pytest.mark.parametrize("shortcut", ["python", "native"])
def test_the_quiet_step_shortcut_matches_the_general_path_while_keys_warm_up_and_on_cold_spikes(shortcut):
    # a key that appears late warms up against the pooled window: the shortcut must leave cold spikes (and
    # values too close to call) to the general path, and accept everything else exactly as it would
    rng = random.Random(11)
    fast = _with_shortcut(SpikeDetector(warmup=15, window=30), shortcut)
    general = SpikeDetector(warmup=15, window=30)
    general.assess_quiet_step = lambda *args: None
    cold_spikes = 0
    for step in range(300):
        key = "late" if step >= 120 and step % 3 == 0 else "early"
        loss = rng.lognormvariate(0, 0.2) * (40 if key == "late" and step % 7 == 0 else 1)
        grad_norm = rng.lognormvariate(0.5, 0.2) * (25 if step % 41 == 0 else 1)
        verdict = fast.assess(loss, grad_norm, key, accept=True)
        assert verdict == general.assess(loss, grad_norm, key, accept=True), step
        warming = len(fast.state_dict()["loss"].get(key, {"values": []})["values"]) < 15
        cold_spikes += verdict.verdict is Verdict.LOSS_SPIKE and warming
        assert fast.state_dict() == general.state_dict(), step
    assert cold_spikes > 0  # the late key's warm-up did see spikes, caught through the general path
