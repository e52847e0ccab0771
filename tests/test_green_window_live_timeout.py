"""GreenWindow's live signal under its bound (``options.signal_timeout``): real fits on a simulated clock.

A live callable with no timeout of its own (a network call on a dead connection) held the training thread at
its decision for as long as it hung: for ever, for a source that never answers. It now runs on a thread of its
own, waited for ``options.signal_timeout`` (10 s by default; ``None`` calls it on the training thread, as
before). The bound is real time; the tests shorten it and release every call they hang.
"""

from __future__ import annotations

import contextvars
import signal as os_signal
import threading
import warnings

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_pulse import GreenWindow, PulseRefusal, SimulatedClock
from lightning_pulse.callbacks.simulated_step_time import SimulatedStepTime
from lightning_pulse.energy import signal as signal_module
from lightning_pulse.energy.signal import LiveSignal, SignalUnreadable
from tests.conftest import trainer_kwargs

START = "2020-06-15 00:00:00"
STEP_S = 600.0  # 10 simulated minutes a step: a decision every 6 steps (one an hour)
THREAD = "lightning-pulse-live-signal"


def fit(callbacks, clock, steps, **kwargs) -> pl.Trainer:
    return pl.Trainer(
        callbacks=[SimulatedStepTime(clock, STEP_S), *callbacks],
        max_steps=steps,
        limit_val_batches=0,
        **trainer_kwargs(**kwargs),
    )


def green_on(live, clock, tmp_path, **options) -> GreenWindow:
    return GreenWindow(
        signal=live,
        when_dirty="pause",
        threshold=500.0,  # every reading is clean: a decision every slot (6 steps), at steps 0, 6, 12, ...
        expected_duration="6h",
        clock=clock,
        options={"watts": 100.0, "report_dir": str(tmp_path), **options},
    )


def live_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if "live `signal` failed" in str(w.message)]


class ReleaseAtStep(pl.Callback):
    """At ``step``, lets the hanging live-signal call return (``release``) and waits until that call itself
    has returned (its own ``done``), so the next decision finds it returned late; records the live-signal
    threads alive just before."""

    def __init__(self, step: int, release: threading.Event, live: LiveSignal) -> None:
        self.step, self.release, self.live = step, release, live
        self.threads: list[str] | None = None

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step == self.step:
            self.threads = [t.name for t in threading.enumerate() if t.name == THREAD]
            self.release.set()
            assert self.live._late is not None and self.live._late.done.wait(60.0)


def test_a_live_reading_that_hangs_is_a_failed_reading_and_its_late_answer_is_dropped(
    mnist1d_small, tmp_path
):
    clock = SimulatedClock(START)
    release, calls = threading.Event(), []

    def live() -> tuple[float, float]:
        calls.append(clock.time())
        if len(calls) == 2:  # hangs until released: a reading of 999 asked for at the second decision
            release.wait(60.0)
            return clock.time(), 999.0  # stamped when it returns, hours after it was asked for
        return clock.time(), 100.0 + len(calls)

    green = green_on(
        live, clock, tmp_path, signal_timeout="5s"
    )  # shortened for the test; long enough for a loaded 2-core machine
    release_at = ReleaseAtStep(20, release, green.signal.live)  # after the decision at step 18, before 24's
    trainer = fit([green, release_at], clock, steps=36, default_root_dir=tmp_path)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(*mnist1d_small(arch="mlp"))
    finally:
        release.set()
    assert trainer.global_step == 36 and green.report["status"] == "complete"
    (failed,) = live_warnings(caught)
    assert (
        f"the callable `{live.__qualname__}` did not return within 5 s (`options.signal_timeout`); " in failed
    )
    assert "raise `options.signal_timeout` above its own (None calls it on the training thread" in failed
    assert "its last good reading, 101 gCO2eq/kWh" in failed
    # step 6's call hung; steps 12 and 18 started none (it was outstanding: one thread, not one a decision)
    # and held 101; step 24 asked again, dropping the late 999 (a value of step 6, stamped at step 20)
    assert len(calls) == 4 and release_at.threads == [THREAD]
    assert [d["signal"] for d in green.report["decisions"]] == [101.0, 101.0, 101.0, 101.0, 103.0, 104.0]
    assert 999.0 not in green.signal.live.values
    assert green.report["signal"]["failed_readings"] == 3


def test_a_live_signal_whose_first_reading_hangs_is_refused_after_the_bound(mnist1d_small, tmp_path):
    clock, release = SimulatedClock(START), threading.Event()

    def hangs() -> tuple[float, float]:
        release.wait(60.0)
        return clock.time(), 100.0

    green = GreenWindow(
        signal=hangs, when_dirty="pause", expected_duration="4h", clock=clock, options={"signal_timeout": 5}
    )
    trainer = fit([green], clock, steps=4, default_root_dir=tmp_path)
    try:
        with pytest.raises(PulseRefusal) as refused:
            trainer.fit(*mnist1d_small(arch="mlp"))
    finally:
        release.set()
    assert str(refused.value).startswith(
        f"GreenWindow: `signal`: the callable `{hangs.__qualname__}` did not return within 5 s "
        "(`options.signal_timeout`); give it a timeout of its own under that, or raise "
        "`options.signal_timeout`"
    )
    assert "That was its first reading" in str(refused.value) and trainer.global_step == 0


def test_signal_timeout_none_calls_a_live_signal_that_needs_the_main_thread_on_the_training_thread(
    mnist1d_small, tmp_path
):
    # review of pass 41: a callable with a SIGALRM timeout of its own (signal.alarm, timeout-decorator's
    # default) can only run on the main thread; on the reading thread it was refused at train start, and no
    # setting gave the old behaviour back
    clock, threads = SimulatedClock(START), []

    def with_alarm() -> tuple[float, float]:
        previous = os_signal.signal(os_signal.SIGALRM, lambda *_: None)  # ValueError off the main thread
        os_signal.setitimer(os_signal.ITIMER_REAL, 30.0)
        try:
            threads.append(threading.current_thread().name)
            return clock.time(), 100.0 + len(threads)
        finally:
            os_signal.setitimer(os_signal.ITIMER_REAL, 0.0)
            os_signal.signal(os_signal.SIGALRM, previous)

    trainer = fit([green_on(with_alarm, clock, tmp_path)], clock, steps=4, default_root_dir=tmp_path)
    with pytest.raises(PulseRefusal) as refused:  # the default: on a thread of its own, where it cannot run
        trainer.fit(*mnist1d_small(arch="mlp"))
    assert str(refused.value).startswith(
        "GreenWindow: `signal`: the callable raised ValueError: signal only works in main thread"
    )
    assert (
        "(it ran on a thread of its own; `options.signal_timeout`=None calls it on the training thread). "
        "That was its first reading" in str(refused.value)
    )

    green = green_on(with_alarm, clock, tmp_path, signal_timeout=None)
    trainer = fit([green], clock, steps=18, default_root_dir=tmp_path / "none")
    trainer.fit(*mnist1d_small(arch="mlp"))
    assert threads == [threading.main_thread().name] * 3  # steps 0, 6 and 12
    assert [d["signal"] for d in green.report["decisions"]] == [101.0, 102.0, 103.0]
    assert green.report["signal"]["failed_readings"] == 0


REGION = contextvars.ContextVar("region", default="unset")


def test_a_live_signal_on_its_thread_reads_the_training_threads_context_variables(mnist1d_small, tmp_path):
    # review of pass 41: the reading thread started in an empty context, so a callable reading a ContextVar
    # (a config, a logging or tracing context bound in one) read its default: 999 here, not the region's 50
    clock = SimulatedClock(START)

    def by_region() -> tuple[float, float]:
        assert threading.current_thread().name == THREAD
        return clock.time(), 50.0 if REGION.get() == "FR" else 999.0

    green = green_on(by_region, clock, tmp_path)
    token = REGION.set("FR")
    try:
        fit([green], clock, steps=12, default_root_dir=tmp_path).fit(*mnist1d_small(arch="mlp"))
    finally:
        REGION.reset(token)
    assert [d["signal"] for d in green.report["decisions"]] == [50.0, 50.0]


def test_a_resume_into_the_same_instance_with_a_call_still_out_warns_again(mnist1d_small, tmp_path):
    # review of pass 41: the warning was given once per instance, not once per fit: a resume into the same
    # instance while the first fit's call was still out ran every decision on the held value, asked the source
    # nothing, and said nothing
    clock, release, calls = SimulatedClock(START), threading.Event(), []

    def live() -> tuple[float, float]:
        calls.append(clock.time())
        if len(calls) == 2:
            release.wait(60.0)
        return clock.time(), 100.0 + len(calls)

    green = green_on(live, clock, tmp_path, signal_timeout=5.0)
    saved = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=12, save_top_k=-1)
    first = fit([green, saved], clock, steps=12, enable_checkpointing=True, default_root_dir=tmp_path)
    resumed = fit([green], clock, steps=24, default_root_dir=tmp_path)
    said = []
    try:
        for trainer in (first, resumed):
            ckpt_path = None if trainer is first else str(next((tmp_path / "ckpt").glob("*step=12.ckpt")))
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                trainer.fit(*mnist1d_small(arch="mlp"), ckpt_path=ckpt_path)
            said.append(live_warnings(caught))
    finally:
        release.set()
    assert resumed.global_step == 24 and len(calls) == 2  # the second fit started no call: one was out
    assert len(said[0]) == 1 and "did not return within 5 s" in said[0][0]
    assert len(said[1]) == 1, said  # its first failure is warned again, in the fit it happened in
    out = f"the callable `{live.__qualname__}` has not returned from a reading that timed out after 5 s"
    assert out in said[1][0]
    assert green.report["signal"]["failed_readings"] == 3  # steps 6, 12 and 18


@pytest.mark.parametrize(
    ("value", "allowed"),
    [
        (0, "must be a positive duration such as '10s', a number of seconds > 0, or None"),
        ("0s", "must be a positive duration such as '10s', a number of seconds > 0, or None"),
        (-1.0, "must be a duration such as '90s', '15min' or '12h', a number of seconds > 0, or None"),
        ("30 steps", "must be a duration such as '90s', '15min' or '12h', a number of seconds > 0, or None"),
        (
            float("inf"),
            "must be a duration such as '90s', '15min' or '12h', a number of seconds > 0, or None",
        ),
    ],
)
def test_a_signal_timeout_that_is_no_positive_duration_is_refused_at_construction(value, allowed):
    with pytest.raises(ValueError) as refused:
        GreenWindow(signal=lambda: (0.0, 1.0), when_dirty="pause", options={"signal_timeout": value})
    assert str(refused.value).startswith(f"GreenWindow: `options.signal_timeout`={value!r} {allowed}")
    assert "(the callable is then called on the training thread, with no bound)" in str(refused.value)


def test_a_reading_for_which_no_thread_can_start_is_a_failed_reading(monkeypatch):
    # review of pass 41: `can't start new thread` (a container at its pids limit) escaped as a crash
    readings = iter([(1592179200.0, 100.0), (1592182800.0, 200.0)])
    live = LiveSignal(lambda: next(readings), warn=lambda line: None)
    assert live.observe() == (1592179200.0, 100.0)

    def no_thread(self) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(signal_module.threading.Thread, "start", no_thread)
    assert live.observe() == (1592179200.0, 100.0) and live.failed == 1 and live._late is None
    assert live.first_failure["error"].startswith("no thread could be started to call `test_a_reading_for")
    assert "(can't start new thread)" in live.first_failure["error"]
    fresh = LiveSignal(lambda: (1592179200.0, 100.0))
    with pytest.raises(
        SignalUnreadable, match=r"`options.signal_timeout`=None calls it on the training thread"
    ):
        fresh.observe()
