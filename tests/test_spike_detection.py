"""The functional core of StabilityGuard's detection: robust z-scores and the detector's one verdict."""

from __future__ import annotations

import copy
import math
import random

import pytest

from lightning_pulse.core.spike_detection import POOLED, RunningRobustZ, SpikeDetector, Verdict, robust_zscore


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


def test_each_key_has_its_own_baseline_and_a_spike_also_stands_out_among_every_keys_values():
    detector = SpikeDetector(warmup=20)
    _warm(detector, key="burst")
    for _ in range(30):
        detector.accept(3.0, 2.0, "replay")  # replay trains on hard samples: higher loss is normal there
    assert detector.assess(3.0, 2.0, "replay").verdict is Verdict.OK
    assert detector.assess(3.0, 2.0, "maintain").verdict is Verdict.OK  # a new key starts its warm-up
    # 3x the burst median, but a value every key has had lately: not a spike (the burst window may be from
    # before the weights drifted while other phases ran); far above both, it is
    assert detector.assess(3.0, 2.0, "burst").verdict is Verdict.OK
    assert detector.assess(30.0, 2.0, "burst").verdict is Verdict.LOSS_SPIKE


def test_a_phase_back_after_others_ran_is_not_flagged_for_the_drift_of_its_absence():
    """A sweep: MLP + PulseCycle(burst=20, replay=10, maintain=5) + StabilityGuard(warmup=10); the gradient
    norm grew 4x over the 15 steps the burst was away, and the first burst step after maintain was flagged
    against the burst window of steps 10-19, then skips and a rollback (accuracy 0.733 against 0.907)."""
    detector = SpikeDetector(warmup=10)
    for step in range(35):  # healthy: the gradient norm grows smoothly from 0.3 to 1.3
        key = "burst" if step < 20 else "replay" if step < 30 else "maintain"
        detector.accept(1.0, 0.3 * (1.3 / 0.3) ** (step / 35), key)
    assert detector.assess(1.0, 1.31, "burst").verdict is Verdict.OK
    assert detector.assess(1.0, 1.31 * 1e4, "burst").verdict is Verdict.GRAD_SPIKE


def test_detector_state_round_trips():
    detector = SpikeDetector(warmup=20)
    _warm(detector, key="burst")
    restored = SpikeDetector(warmup=20)
    restored.load_state_dict(detector.state_dict())
    assert restored.baseline("burst") == detector.baseline("burst")
    assert restored.assess(5.0, 2.0, "burst") == detector.assess(5.0, 2.0, "burst")


def test_a_state_saved_on_the_other_loss_scale_is_converted_to_this_ones():
    """A StabilityGuard resumed with another ``loss_scale`` judged losses against values on the old one."""
    on_log = SpikeDetector(warmup=20)
    _warm(on_log, key="burst")
    on_linear = SpikeDetector(warmup=20, loss_scale="linear")
    _warm(on_linear, key="burst")
    saved = on_log.state_dict()
    restored = SpikeDetector(warmup=20, loss_scale="linear")
    restored.load_state_dict(saved)
    assert restored.converted == {"loss_scale": ("log", "linear")}
    ended = restored.state_dict()
    for key in ("burst", POOLED):
        assert ended["loss"][key]["values"] == pytest.approx(
            [math.exp(v) for v in saved["loss"][key]["values"]]
        )
        assert ended["loss"][key]["stamps"] == saved["loss"][key]["stamps"]
    assert ended["grad_norm"] == saved["grad_norm"]  # always on a log scale
    # judged as the detector that ran on a linear scale throughout (the same losses)
    assert ended["loss"]["burst"]["values"] == pytest.approx(
        on_linear.state_dict()["loss"]["burst"]["values"]
    )
    verdicts = [restored.assess(loss, 2.0, "burst").verdict for loss in (1.05, 1.3, 3.0)]
    assert verdicts == [on_linear.assess(loss, 2.0, "burst").verdict for loss in (1.05, 1.3, 3.0)]
    assert verdicts[-1] is Verdict.LOSS_SPIKE
    # back to a log scale: the log of each value, and a loss <= 0 left out as a log scale leaves it out
    linear_state = on_linear.state_dict()
    linear_state["loss"]["burst"] = {"values": [0.0, -1.0, 2.0], "stamps": [28, 29, 30]}
    back = SpikeDetector(warmup=20)
    back.load_state_dict(linear_state)
    assert back.converted == {"loss_scale": ("linear", "log")}
    assert back.state_dict()["loss"]["burst"] == {"values": [math.log(2.0)], "stamps": [30]}


def test_a_state_saved_under_another_main_key_is_merged_into_this_ones():
    """StabilityGuard keys a step without a pulse phase "burst" with per-phase baselines, "all" without."""
    per_phase = SpikeDetector(warmup=20, main_key="burst")
    _warm(per_phase, key="burst")
    for _ in range(3):
        per_phase.accept(1.0, 2.0, "replay")
    saved = per_phase.state_dict()
    one = SpikeDetector(warmup=20, main_key="all")
    one.load_state_dict(saved)
    assert one.converted == {"main_key": ("burst", "all")}
    for name in ("loss", "grad_norm"):  # the pooled window, every key's values: what "all" would hold
        assert one.state_dict()[name] == {"all": saved[name][POOLED], POOLED: saved[name][POOLED]}
    back = SpikeDetector(warmup=20, main_key="burst")
    back.load_state_dict(one.state_dict())
    assert back.converted == {"main_key": ("all", "burst")} and set(back.state_dict()["loss"]) == {
        "burst",
        POOLED,
    }


def test_a_state_of_an_earlier_version_loads_as_saved():
    """Before the scale and key were saved: taken as the detector's own, as before."""
    detector = SpikeDetector(warmup=20)
    _warm(detector, key="burst")
    saved = detector.state_dict()
    earlier = {name: value for name, value in saved.items() if name not in ("loss_scale", "main_key")}
    restored = SpikeDetector(warmup=20, loss_scale="linear", main_key="all")
    restored.load_state_dict(earlier)
    assert restored.converted == {}
    state = restored.state_dict()
    assert state["loss"] == saved["loss"] and state["grad_norm"] == saved["grad_norm"]


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


def test_the_pooled_window_holds_the_values_of_every_key():
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


def test_non_finite_values_never_enter_the_windows():
    tracker = RunningRobustZ(window=4, warmup=2)
    for value in (1.0, float("nan"), float("inf"), 2.0, float("-inf")):
        tracker.add(value)
    assert list(tracker.values) == [1.0, 2.0] and tracker.median == 1.5
    detector = SpikeDetector(warmup=20, loss_scale="linear")
    _warm(detector)
    assert detector.assess(float("nan"), 2.0, accept=True).verdict is Verdict.NONFINITE_LOSS
    assert detector.assess(1.0, float("inf"), accept=True).verdict is Verdict.NONFINITE_GRAD
    detector.accept(float("nan"), float("inf"))  # even a caller's explicit accept cannot poison them
    state = detector.state_dict()
    assert len(state["loss"]["default"]["values"]) == len(state["grad_norm"]["default"]["values"]) == 30
    assert all(
        math.isfinite(v) for v in state["loss"][POOLED]["values"] + state["grad_norm"][POOLED]["values"]
    )
    restored = RunningRobustZ(window=4, warmup=2)
    restored.load_state_dict({"values": [1.0, float("nan"), 3.0]})
    assert list(restored.values) == [1.0, 3.0]


def test_one_verdict_for_every_step_of_a_noisy_stream_flags_the_spikes_and_keeps_them_out_of_the_baseline():
    rng = random.Random(3)
    detector = SpikeDetector(warmup=20)
    flagged = {}
    for step in range(400):
        loss = rng.lognormvariate(0, 0.05) * (20 if step % 37 == 36 else 1)
        grad_norm = rng.lognormvariate(1, 0.05) * (30 if step % 53 == 52 else 1)
        if step % 101 == 100:
            loss = float("nan")
        key = "burst" if step % 10 < 7 else "replay"
        verdict = detector.assess(loss, grad_norm, key, accept=True).verdict
        if verdict is not Verdict.OK:
            flagged[step] = verdict
    nan_steps = {100, 201, 302}
    loss_steps = {s for s in range(400) if s % 37 == 36} - nan_steps
    grad_steps = {s for s in range(400) if s % 53 == 52} - nan_steps - loss_steps
    assert set(flagged) <= nan_steps | loss_steps | grad_steps  # no false positive
    assert {s for s, v in flagged.items() if v is Verdict.NONFINITE_LOSS} == nan_steps  # from the first step
    # once every key is warm, every injected spike is caught
    assert {s for s, v in flagged.items() if v is Verdict.LOSS_SPIKE} >= {s for s in loss_steps if s >= 70}
    assert {s for s, v in flagged.items() if v is Verdict.GRAD_SPIKE} >= {s for s in grad_steps if s >= 70}
    for name in ("loss", "grad_norm"):
        for window in detector.state_dict()[name].values():
            assert max(window["values"]) < min(window["values"]) + math.log(3)  # no spike got in


def test_a_key_warming_up_is_judged_in_the_pooled_spread_so_a_phase_shift_is_not_a_spike():
    rng = random.Random(1)
    detector = SpikeDetector(warmup=20, cold_ratio=10.0)
    for _ in range(60):  # a burst whose gradient norm is heavy-tailed: 0.2 .. 5
        detector.accept(1.0, math.exp(rng.uniform(-1.6, 1.6)), "burst")
    # a replay phase starts: 12x the pooled median, but inside the pooled spread: not a spike
    assert detector.assess(1.0, 12.0, "replay").verdict is Verdict.OK
    # a real fault right after the phase change is still caught: far outside the spread
    assert detector.assess(1.0, 1e5, "replay").verdict is Verdict.GRAD_SPIKE
    assert detector.assess(1e4, 1.0, "replay").verdict is Verdict.LOSS_SPIKE


def test_a_key_back_after_a_long_absence_is_not_judged_on_its_stale_window():
    # found on a held-out seq2seq transformer under the shipped suite: the anneal burst came ~100 steps after the
    # warm-up's burst, the gradient norm had grown 4x meanwhile (the loss fell), and the stale burst window
    # flagged three healthy steps as gradient spikes and rolled the run back
    rng = random.Random(2)
    detector = SpikeDetector(warmup=20, window=100)
    for _ in range(60):  # early training, in a burst: high loss, small gradient norm
        detector.accept(2.0 * rng.lognormvariate(0, 0.02), 0.5 * rng.lognormvariate(0, 0.02), "burst")
    for step in range(90):  # a long replay phase: the loss falls, the gradient norm grows
        grow = math.exp(1.4 * step / 90)
        detector.accept(
            1.5 / grow * rng.lognormvariate(0, 0.02), 0.5 * grow * rng.lognormvariate(0, 0.02), "replay"
        )
    # the burst is back: in line with the recent steps, 4x the stale burst median, and judged OK
    assert detector.assess(0.4, 2.0, "burst", accept=True).verdict is Verdict.OK
    burst = detector.state_dict()["grad_norm"]["burst"]
    assert min(burst["stamps"]) > detector.accepted_steps - 100  # only the last 100 accepted steps count
    assert len(burst["values"]) == 10  # of the first burst's 60 values, the 9 newest, and this step's
    # a real fault right after the return is still caught, against the pooled window
    assert detector.assess(0.4, 2e4, "burst").verdict is Verdict.GRAD_SPIKE
    # with the age limit saved and restored, a resumed detector judges alike
    restored = SpikeDetector(warmup=20, window=100)
    restored.load_state_dict(detector.state_dict())
    assert restored.state_dict() == detector.state_dict()
    assert restored.assess(0.4, 2.5, "burst") == detector.assess(0.4, 2.5, "burst")


def test_before_any_window_is_warm_a_loss_ten_times_the_median_so_far_is_divergence():
    detector = SpikeDetector(warmup=50)
    assert detector.assess(8.8, 1.0, accept=True).verdict is Verdict.OK
    assert detector.assess(9.5, 30.0, accept=True).verdict is Verdict.OK  # gradient norms may grow early
    assert detector.assess(40.0, 1.0, accept=True).verdict is Verdict.OK  # 4.5x: not yet
    assert detector.assess(446.0, 1.0, accept=True).verdict is Verdict.LOSS_SPIKE  # 47x the median 9.5
    healthy = SpikeDetector(warmup=50)
    assert all(  # a loss falling through the warm-up is never flagged
        healthy.assess(4.8 * 0.97**step, 1.0, accept=True).verdict is Verdict.OK for step in range(50)
    )
    linear = SpikeDetector(warmup=50, loss_scale="linear")  # a ratio to a median near zero means nothing
    linear.assess(0.01, 1.0, accept=True)
    assert linear.assess(5.0, 1.0).verdict is Verdict.OK


def _descending_losses(seed: int, steps: int, slope: float, flat_after: int, noise: float) -> list[float]:
    """A loss falling log-linearly from 0.69 (``slope`` per step on the log scale), flat after
    ``flat_after`` steps, with multiplicative small-batch noise."""
    rng = random.Random(seed)
    return [0.69 * math.exp(-slope * min(step, flat_after) + rng.gauss(0.0, noise)) for step in range(steps)]


@pytest.mark.parametrize("seed", range(5))
def test_a_1e4_loss_after_a_descent_by_decades_is_a_spike(seed):
    # as an HF Longformer classifier memorising its data (sweep C): the loss fell from 0.69 to 1e-4 within the
    # window, whose MAD on the log scale then spans decades, so the robust z-score of a x1e4 step (back to
    # the early level) stayed under 6 (5.996 on the recorded run) and the step went through unflagged
    detector = SpikeDetector()  # the defaults: window 100, warm-up 50
    losses = _descending_losses(seed, steps=70, slope=0.12, flat_after=70, noise=0.2)
    for loss in losses:
        assert detector.assess(loss, loss * 10, accept=True).verdict is Verdict.OK
    tracker = detector._loss["default"]
    spike = math.log(losses[-1] * 1e4)
    assert tracker.zscore(spike) < 6 < tracker.jump_zscore(spike)
    assessment = detector.assess(losses[-1] * 1e4, losses[-1] * 1e5)
    assert assessment.verdict is Verdict.LOSS_SPIKE and assessment.loss_z > 6


@pytest.mark.parametrize("seed", range(5))
def test_after_a_descent_a_lasting_shift_under_10x_is_not_a_spike(seed):
    # the jump score judges only values 10x (cold_ratio) the window median: a new data source that lifts a
    # loss which fell by decades to 3x its level stays unflagged, as before (judged by the jump score alone,
    # every one of its steps was a spike)
    detector = SpikeDetector()
    losses = _descending_losses(seed, steps=300, slope=0.05, flat_after=150, noise=0.1)
    for step, loss in enumerate(losses):
        shifted = loss * 3 if step >= 200 else loss
        assert detector.assess(shifted, 1.0, accept=True).verdict is Verdict.OK, step


def test_jump_zscore_measures_the_noise_of_one_step_not_the_trend():
    tracker = RunningRobustZ(window=21, warmup=10)
    assert tracker.jump_zscore(0.0) is None
    for step in range(21):  # a straight descent, +-0.1 around it
        tracker.add(-0.5 * step + (0.1 if step % 2 else -0.1))
    # successive differences: ten of -0.3, ten of -0.7 (MAD 0.2); the latest five values' median is -9.1
    spread = 1.4826 * 0.2 / math.sqrt(2)
    assert tracker.jump_zscore(-9.1 + 3 * spread) == pytest.approx(3.0)
    assert tracker.zscore(-9.1 + 3 * spread) < 0  # below the window's median (-5.1)


def test_a_log_scale_counts_the_losses_below_zero_apart_from_those_at_zero():
    """Only a loss below 0 needs a linear scale (the guard's advice): a 0 is left out harmlessly."""
    detector = SpikeDetector(warmup=20)
    for loss in (0.5, 0.0, 0.0, -0.1, 0.4):
        detector.assess(loss, 1.0, accept=True)
    assert (detector.unjudged_losses, detector.negative_losses) == (3, 1)
    restored = SpikeDetector(warmup=20)
    restored.load_state_dict(detector.state_dict())
    assert restored.negative_losses == 1
    state = detector.state_dict()
    del state["negative_losses"]  # a state of an earlier version: its unjudged losses taken as negative
    restored.load_state_dict(state)
    assert restored.negative_losses == 3


def _flags_at(detector: SpikeDetector, loss, grad_norm, key, which: str, threshold: float) -> bool:
    """Whether ``detector``'s windows flag the value at ``which`` (``"loss"`` or ``"grad_norm"``) with that
    threshold, the other one off."""
    judge = copy.deepcopy(detector)
    judge.loss_zscore = threshold if which == "loss" else None
    judge.grad_norm_zscore = threshold if which == "grad_norm" else None
    return judge.assess(loss, grad_norm, key).verdict.is_spike


def _phases() -> SpikeDetector:
    detector = SpikeDetector(warmup=20)
    _warm(detector, key="burst")
    for _ in range(30):
        detector.accept(3.0, 2.0, "replay")
    return detector


def _descended() -> SpikeDetector:
    detector = SpikeDetector()
    for loss in _descending_losses(0, steps=70, slope=0.12, flat_after=70, noise=0.2):
        detector.assess(loss, loss * 10, accept=True)
    return detector


def _early() -> SpikeDetector:
    detector = SpikeDetector(warmup=50)
    for loss in (8.8, 9.5, 40.0):
        detector.assess(loss, 1.0, accept=True)
    return detector


def _warmed() -> SpikeDetector:
    detector = SpikeDetector(warmup=20)
    _warm(detector)
    return detector


@pytest.mark.parametrize(
    ("build", "loss", "grad_norm", "key", "expected"),
    [
        (_warmed, 5.0, 50.0, "default", "scored"),  # each window's own z-score
        (_warmed, 1.05, 2.1, "default", "zero"),  # under min_ratio: no spike at any threshold
        (_descended, "x1e4", None, "default", "jump"),  # a loss 10x the median: its jump score counts too
        (_phases, 30.0, 2.0, "burst", "scored"),  # 10x the pooled median: the own window decides
        (_phases, 4.0, 2.0, "burst", "scored"),  # between: the lower of the own and the pooled score
        (_phases, 30.0, 2.0, "maintain", "scored"),  # a key warming up: the pooled score
        (_early, 446.0, 1.0, "default", "inf"),  # before any window is warm: the ratio alone, no threshold
    ],
)
def test_clearing_scores_are_the_thresholds_at_which_a_step_stops_being_a_spike(
    build, loss, grad_norm, key, expected
):
    detector = build()
    if loss == "x1e4":
        loss = math.exp(detector._loss["default"].values[-1]) * 1e4  # the last loss x1e4
        grad_norm = loss * 10
    clearing = detector.clearing_scores(loss, grad_norm, key)
    scores = {"loss": clearing.loss, "grad_norm": clearing.grad_norm}
    for which, score in scores.items():
        if score == 0.0:
            assert not _flags_at(detector, loss, grad_norm, key, which, 1e-9), which
        elif math.isinf(score):
            assert _flags_at(detector, loss, grad_norm, key, which, 1e12), which
        else:  # flagged just under the score, not at it
            assert _flags_at(detector, loss, grad_norm, key, which, score * (1 - 1e-9)), which
            assert not _flags_at(detector, loss, grad_norm, key, which, score), which
    if expected == "zero":
        assert scores == {"loss": 0.0, "grad_norm": 0.0}
    elif expected == "inf":
        assert clearing.loss == math.inf
    elif expected == "jump":
        tracker = detector._loss["default"]
        assert tracker.zscore(math.log(loss)) < clearing.loss == tracker.jump_zscore(math.log(loss))
        # under a threshold its z-score exceeds, the verdict's score is that z-score: a threshold just above
        # it still fails the jump score, which the clearing score names
        low = copy.deepcopy(detector)
        low.loss_zscore = tracker.zscore(math.log(loss)) / 2
        assert low.assess(loss, grad_norm).loss_z < low.clearing_scores(loss, grad_norm).loss == clearing.loss
    else:
        assert 0 < clearing.loss < math.inf
    # thresholds switched off need no raising
    off = copy.deepcopy(detector)
    off.loss_zscore = off.grad_norm_zscore = None
    assert off.clearing_scores(loss, grad_norm, key) == (0.0, 0.0)
