"""The benchmark harness times callbacks from outside, without touching their code."""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from benchmarks.harness import HookTimer
from tests.conftest import trainer_kwargs


class _CountsBatches(Callback):
    def __init__(self) -> None:
        self.batches = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.batches += 1
        sum(i * i for i in range(20_000))  # some CPU work inside the hook


def test_hook_timer_counts_every_call_of_the_overridden_hooks_only(mnist1d_small):
    callback, timer = _CountsBatches(), HookTimer()
    timer.install(callback)
    assert "on_train_batch_end" in vars(callback)  # wrapped on the instance
    assert "on_train_batch_start" not in vars(callback)  # a hook it does not override stays Lightning's
    module, data = mnist1d_small()
    pl.Trainer(max_steps=5, callbacks=[callback], **trainer_kwargs()).fit(module, data)
    assert callback.batches == 5
    assert timer.calls == {"_CountsBatches": 5}
    assert timer.cpu_s["_CountsBatches"] > 0.0


class _Announces(Callback):
    """Tells the other callback of something from inside its own hook, as PulseCycle tells phase listeners."""

    def __init__(self, listener) -> None:
        self.listener = listener

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.listener.on_pulse_phase_change(trainer, pl_module, None)
        self.evaluate()

    def evaluate(self) -> None:
        sum(i * i for i in range(20_000))


class _Listens(Callback):
    def on_pulse_phase_change(self, trainer, pl_module, change) -> None:
        sum(i * i for i in range(200_000))


def test_a_timed_call_inside_another_counts_for_the_inner_callback_and_apart_methods_are_kept_apart(
    mnist1d_small,
):
    listener = _Listens()
    announcer, timer = _Announces(listener), HookTimer()
    timer.install(announcer, apart=("evaluate",))
    timer.install(listener)
    module, data = mnist1d_small()
    pl.Trainer(max_steps=5, callbacks=[announcer, listener], **trainer_kwargs()).fit(module, data)
    assert timer.calls == {"_Announces": 5, "_Listens": 5}
    # the listener's work (10x the evaluation's) is not the announcer's, nor is the evaluation timed apart
    assert timer.cpu_s["_Listens"] > 3 * timer.cpu_s["_Announces"]
    assert timer.apart_cpu_s["_Announces.evaluate"] > timer.cpu_s["_Announces"]


def test_step_saving_replays_choice_at_the_sampler_is_timed_and_the_used_callback_still_pickles(
    mnist1d_small,
):
    """HardSampleReplay chooses each light batch in the sampler, outside its hooks: the timer wraps that method
    (OFF_HOOK_WORK) and counts it. A lean-core refactor once handed the sampler a closure instead: the timer
    then raised AttributeError on every benchmark with the callback, and a callback that had run a fit no
    longer pickled (a second fit under ddp_spawn pickles the callbacks)."""
    import pickle

    from lightning_pulse import HardSampleReplay, PulseCycle

    def fit(replay: HardSampleReplay) -> None:
        cycle = PulseCycle(burst=2, replay=4, maintain=0, warmup=0.0, anneal=0.0, maintain_eval="none")
        module, data = mnist1d_small()
        pl.Trainer(max_epochs=2, callbacks=[cycle, replay], **trainer_kwargs()).fit(module, data)

    timed, timer = HardSampleReplay(replay_fraction=0.5), HookTimer()
    timer.install(timed)
    assert "_choose" in vars(timed)  # wrapped on the instance
    fit(timed)
    assert timed.steps._choose is vars(timed)["_choose"]  # the sampler called the timed method
    assert timer.calls["HardSampleReplay"] > 0 and timer.cpu_s["HardSampleReplay"] > 0.0
    used = HardSampleReplay(replay_fraction=0.5)
    fit(used)
    assert isinstance(pickle.loads(pickle.dumps(used)), HardSampleReplay)


def test_stability_guards_step_hooks_on_the_optimizer_are_timed_with_its_hooks(mnist1d_small):
    """StabilityGuard registers step hooks on the optimizers (``StepChanges._enter``/``_leave``): they run
    inside ``optimizer.step()``, outside any callback hook, and count towards the guard's time."""
    from lightning_pulse import StabilityGuard

    guard, timer = StabilityGuard(), HookTimer()
    timer.install(guard)
    timed = {name: vars(guard._changes)[name] for name in ("_enter", "_leave")}  # wrapped on the instance
    registered = []

    class _Inspect(pl.Callback):
        def on_train_batch_end(self, trainer, *args) -> None:
            optimizer = trainer.optimizers[0]
            hooks = [
                *optimizer._optimizer_step_pre_hooks.values(),
                *optimizer._optimizer_step_post_hooks.values(),
            ]
            registered.append(all(any(hook is wrapped for hook in hooks) for wrapped in timed.values()))

    module, data = mnist1d_small()
    pl.Trainer(max_steps=3, callbacks=[guard, _Inspect()], **trainer_kwargs()).fit(module, data)
    assert registered == [True, True, True]
    assert timer.cpu_s["StabilityGuard"] > 0.0


def test_the_score_only_arm_scores_every_step_where_the_library_refuses_phases_that_never_come(mnist1d_small):
    # the benchmark's score-only arm (benchmarks/hard_sample_replay.py) uses phases no step of a run without a
    # PulseCycle is in: a user's HardSampleReplay is refused there, the arm's scores and trains full batches
    from benchmarks.hard_sample_replay import ScoreOnly

    module, data = mnist1d_small()
    replay = ScoreOnly(phases=("burst",), mode="batch", seed=0)
    trainer = pl.Trainer(max_steps=6, callbacks=[replay], **trainer_kwargs())
    trainer.fit(module, data)
    assert trainer.global_step == 6
    figures = replay.metrics()
    assert figures["active_share"] == 0.0  # never selected
    assert figures["table_seen"] == 6 * 64  # every sample of the 6 whole batches scored
