"""Step-saving replay's plan against the Trainer's settings: drop_last resumes, warm-up and anneal without an
exact fixed point, the lengths of LR schedules built for the plain run, and validation with an int or a
float interval."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from lightning import pytorch as pl
from lightning.pytorch.callbacks import Callback, EarlyStopping, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pulse import HardSampleReplay, PulseCycle
from lightning_pulse.core import step_plan
from lightning_pulse.core.step_plan import plan_steps, schedule_lengths
from lightning_pulse.errors import PulseRefusal
from lightning_pulse.phase import PhaseClock
from tests.conftest import trainer_kwargs


def _data(samples: int, seed: int = 0) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    return TensorDataset(
        torch.randn(samples, 10, generator=generator), torch.randint(0, 3, (samples,), generator=generator)
    )


class _Classifier(pl.LightningModule):
    """A linear classifier whose LR schedule is ``schedule(self, optimizer)``: ``(scheduler, interval)``."""

    def __init__(self, schedule=None) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 3))
        self.schedule = schedule
        self.validated_at: list[int] = []

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self.net(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", F.cross_entropy(self.net(batch[0]), batch[1]))

    def on_validation_epoch_end(self):
        if not self.trainer.sanity_checking:
            self.validated_at.append(self.trainer.global_step)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        if self.schedule is None:
            return optimizer
        scheduler, interval = self.schedule(self, optimizer)
        return [optimizer], [{"scheduler": scheduler, "interval": interval}]


def _one_cycle(module, optimizer):
    total = int(module.trainer.estimated_stepping_batches)
    return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=total), "step"


def _parameters(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in module.parameters()])


class _Epochs(Callback):
    """The epoch of every batch, by the global step it starts at."""

    def __init__(self) -> None:
        self.at: list[tuple[int, int]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.at.append((trainer.current_epoch, trainer.global_step))


# ---------------------------------------------------------------------------- drop_last resumes
def _fit_drop_last(accumulate: int, callbacks=(), ckpt_path=None):
    pl.seed_everything(0, verbose=False)
    module = _Classifier(_one_cycle)
    trainer = pl.Trainer(
        callbacks=[
            PulseCycle(burst=4, replay=6, maintain=1, warmup=0.1, anneal=0.1, maintain_eval="none"),
            HardSampleReplay(),
            *callbacks,
        ],
        max_epochs=6,
        accumulate_grad_batches=accumulate,
        **trainer_kwargs(enable_checkpointing=bool(callbacks)),
    )
    loader = DataLoader(_data(100), batch_size=8, drop_last=True)  # 12 batches a pass, 4 samples dropped
    trainer.fit(module, loader, ckpt_path=ckpt_path)
    return module, trainer


@pytest.mark.parametrize("accumulate", [1, 3])
def test_a_drop_last_run_resumed_from_a_pass_end_reproduces_the_uninterrupted_run(tmp_path, accumulate):
    """Held-out sweep: a drop_last pass ends at 96 of 100 samples, and the resume took a checkpoint saved on a
    pass's last batch for mid-epoch: from step 19 it took 45 of the 52 planned steps, OneCycleLR never
    ended."""
    epochs = _Epochs()
    every_step = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1, filename="{step}")
    full_module, full = _fit_drop_last(accumulate, [every_step, epochs])
    assert full.global_step == full.max_steps == full.lr_scheduler_configs[0].scheduler.total_steps
    # the optimizer step each pass ends at: the step after its last batch
    ends = sorted({step + 1 for (epoch, step), (after, _) in zip(epochs.at, epochs.at[1:]) if after != epoch})
    assert len(ends) == 5
    for end in ends:
        module, resumed = _fit_drop_last(accumulate, ckpt_path=str(tmp_path / f"step={end}.ckpt"))
        assert resumed.global_step == full.global_step, f"resumed from step {end}"
        assert torch.equal(_parameters(module), _parameters(full_module)), f"resumed from step {end}"


# ---------------------------------------------------------------------------- no exact fixed point
class _CosinePerEpoch(_Classifier):
    def __init__(self) -> None:
        super().__init__(self._cosine)

    @staticmethod
    def _cosine(module, optimizer):
        module.cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=module.trainer.max_epochs)
        return module.cosine, "epoch"


def _pulse(**overrides) -> PulseCycle:
    return PulseCycle(
        **{**dict(burst=4, replay=4, maintain=0, warmup=0.1, anneal=0.1, maintain_eval="none"), **overrides}
    )


def test_a_plan_without_an_exact_fixed_point_pins_its_span_and_keeps_max_epochs():
    """Held-out sweep: where warm-up and anneal have no exact fixed point, max_epochs was raised by one so the
    run could train a step past its planned batches, and a CosineAnnealingLR(T_max=max_epochs) per epoch was
    stepped past its total (4 of 3, the extra epoch at lr 0). The clock is now pinned to the span the plan
    placed them on, and the run is exactly its planned batches."""
    pl.seed_everything(0, verbose=False)
    module, replay, cycle = _CosinePerEpoch(), HardSampleReplay(), _pulse()
    trainer = pl.Trainer(callbacks=[cycle, replay], max_epochs=3, **trainer_kwargs(limit_val_batches=0))
    trainer.fit(module, DataLoader(_data(64), batch_size=16))
    plan = replay.steps.plan
    assert trainer.max_epochs == trainer.current_epoch == 3 and module.cosine.last_epoch == 3
    assert trainer.global_step == plan.total_steps == trainer.estimated_stepping_batches
    assert plan.span != plan.total_steps  # non-vacuous: no exact fixed point
    assert cycle.clock.span == plan.span and plan.steps_past_data == 0


def _fit_one_cycle(callbacks=(), ckpt_path=None):
    pl.seed_everything(0, verbose=False)
    module, replay = _Classifier(_one_cycle), HardSampleReplay()
    trainer = pl.Trainer(
        callbacks=[_pulse(), replay, *callbacks],
        max_epochs=3,
        **trainer_kwargs(limit_val_batches=0, enable_checkpointing=bool(callbacks)),
    )
    trainer.fit(module, DataLoader(_data(64), batch_size=16), ckpt_path=ckpt_path)
    return module, trainer, replay.steps.plan


def test_a_run_on_a_pinned_span_resumes_from_every_step_to_the_same_end(tmp_path):
    every_step = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1, filename="{step}")
    full_module, full, plan = _fit_one_cycle([every_step])
    assert plan.span != plan.total_steps == full.global_step  # non-vacuous, and every planned step taken
    schedule = full.lr_scheduler_configs[0].scheduler
    assert schedule.total_steps == schedule.last_epoch == full.global_step  # OneCycleLR raises past its total
    for step in range(1, full.global_step):
        module, resumed, _ = _fit_one_cycle(ckpt_path=str(tmp_path / f"step={step}.ckpt"))
        assert (resumed.global_step, resumed.current_epoch) == (full.global_step, 3), f"from step {step}"
        assert torch.equal(_parameters(module), _parameters(full_module)), f"from step {step}"


def test_plan_steps_places_warm_up_and_anneal_on_a_span_its_data_reaches():
    run = dict(batch_size=16, fraction=0.5, samples_per_epoch=64, max_epochs=3, max_steps=None)
    clock = PhaseClock({"burst": 4, "replay": 4}, order=["burst", "replay"], warmup=0.1, anneal=0.1)
    plan = plan_steps(clock, ["replay"], **run)
    # no total is its own fixed point here: the data of a span of 9 takes 10 steps, that of 10 takes 9
    assert (plan.span, plan.total_steps) == (9, 10)
    assert plan.total_steps == sum(
        len(sizes) for sizes in plan.batch_sizes
    )  # every step in the planned batches
    clock.pin_span(plan.span)  # a pinned clock (restored from a checkpoint) replans the same run
    again = plan_steps(clock, ["replay"], **run, total_steps=plan.total_steps)
    assert (again.batch_sizes, again.span, again.steps_past_data) == (plan.batch_sizes, 9, 0)
    restored = PhaseClock({"burst": 4, "replay": 4}, order=["burst", "replay"], warmup=0.1, anneal=0.1)
    restored.load_state_dict(clock.state_dict())
    assert restored.span == 9 and restored.copy().span == 9


# -------------------------------------------------------------------------- schedules built for the plain run
class _StepCounter(Callback):
    def __init__(self) -> None:
        self.steps = 0

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.steps += 1


def _decay_through_self(module, optimizer):
    module.total = int(module.trainer.estimated_stepping_batches)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: max(0.0, 1 - step / module.total)
    ), "step"


class _DecayMethod(_Classifier):
    """The length read by a bound method: ``LambdaLR(optimizer, self.decay)``."""

    def __init__(self) -> None:
        super().__init__(
            lambda module, optimizer: (torch.optim.lr_scheduler.LambdaLR(optimizer, module.decay), "step")
        )
        self.total = 0

    def configure_optimizers(self):
        self.total = int(self.trainer.estimated_stepping_batches)
        return super().configure_optimizers()

    def decay(self, step: int) -> float:
        return max(0.0, 1 - step / self.total)


@pytest.mark.parametrize(
    "module", [lambda: _Classifier(_decay_through_self), _DecayMethod], ids=["closure", "method"]
)
def test_a_schedule_reading_its_length_through_self_in_a_max_steps_run_is_refused(module):
    """Held-out sweep: ``LambdaLR(lambda s: 1 - s / self.total)`` with ``self.total`` from the unplanned
    ``estimated_stepping_batches`` (max_steps=37) trained 20 steps and stopped its decay at 46% of its
    peak."""
    counter = _StepCounter()
    trainer = pl.Trainer(
        max_epochs=-1,
        max_steps=37,
        callbacks=[HardSampleReplay(), counter],
        **trainer_kwargs(limit_val_batches=0),
    )
    with pytest.raises(
        PulseRefusal, match=r"max_epochs=-1.*built for max_steps=37 steps.*Set max_epochs too"
    ):
        trainer.fit(module(), DataLoader(_data(101), batch_size=8, shuffle=True))
    assert trainer.global_step == 0 and counter.steps == 0


def test_a_schedule_built_with_a_floor_rounded_epoch_count_is_refused():
    """Held-out sweep: Hugging Face's example scripts count ``len(loader) // accumulate * epochs`` (99 here)
    where Lightning counts 3 x ceil(100 / 3) = 102; only the exact 102 was refused, and the decay stopped at
    51/99."""

    def linear(module, optimizer):
        total = 100 // 3 * 3
        return torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.0, total_iters=total), "step"

    counter = _StepCounter()
    trainer = pl.Trainer(
        max_epochs=3,
        accumulate_grad_batches=3,
        callbacks=[HardSampleReplay(), counter],
        **trainer_kwargs(limit_val_batches=0),
    )
    with pytest.raises(PulseRefusal) as refusal:
        trainer.fit(_Classifier(linear), DataLoader(_data(300), batch_size=3, shuffle=True))
    assert str(refusal.value).startswith(
        "HardSampleReplay: the per-step LinearLR was built for 99 steps, the run's length without "
        "step-saving replay (max_epochs=3 of 34 optimizer steps, 102 in all, counted with the epochs' steps "
        "rounded down)"
    )
    assert "`self.trainer.estimated_stepping_batches`" in str(refusal.value)
    assert trainer.global_step == 0 and counter.steps == 0


@pytest.mark.parametrize("d_model", [512, 101])
def test_a_warm_up_count_and_a_model_width_are_no_length_of_the_run(d_model):
    """A Noam schedule reads a warm-up count from its closure and ``d_model`` through ``self``: both are read
    as lengths, above the planned steps, and neither is one of the plain run's, so the run trains. 101 lies
    between the plain run's lengths rounded down (99, 100) and up (102): a window of lengths refused it."""
    warmup = 60

    def noam(module, optimizer):
        module.d_model = d_model
        return torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: module.d_model**-0.5 * min((s + 1) ** -0.5, (s + 1) * warmup**-1.5)
        ), "step"

    replay = HardSampleReplay()
    trainer = pl.Trainer(
        max_epochs=3, accumulate_grad_batches=3, callbacks=[replay], **trainer_kwargs(limit_val_batches=0)
    )
    trainer.fit(_Classifier(noam), DataLoader(_data(300), batch_size=3, shuffle=True))
    assert {warmup, d_model} <= schedule_lengths(
        trainer.lr_scheduler_configs[0].scheduler
    )  # read, not refused
    assert warmup > replay.steps.plan.total_steps == trainer.global_step


class _CosineEvery(_Classifier):
    """A per-step cosine over ``length`` scheduler steps, stepped every ``frequency`` optimizer steps."""

    def __init__(self, length: int, frequency: int) -> None:
        super().__init__()
        self.length, self.frequency = length, frequency

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=self.length)
        config = {"scheduler": schedule, "interval": "step", "frequency": self.frequency}
        return {"optimizer": optimizer, "lr_scheduler": config}


def _fit_48_of_50(module: pl.LightningModule, counter: Callback) -> tuple[pl.Trainer, HardSampleReplay]:
    """One plain epoch of 50 batches that the plan takes in 48 steps (one replay phase of 2 light steps)."""
    replay = HardSampleReplay()
    cycle = PulseCycle(burst=20, replay=2, maintain=1, warmup=0.1, anneal=0.1, maintain_eval="none")
    trainer = pl.Trainer(
        max_epochs=1, callbacks=[cycle, replay, counter], **trainer_kwargs(limit_val_batches=0)
    )
    trainer.fit(module, DataLoader(_data(400), batch_size=8))
    return trainer, replay


def test_a_schedule_of_the_plain_run_over_its_frequency_that_the_planned_steps_still_reach_trains():
    """Held-out sweep: ``T_max=50 // 4`` stepped every 4 steps was refused (at 100% of its course) when the
    plan took 48 of the plain 50 steps, though the run steps it 12 times, its whole course."""
    pl.seed_everything(0)
    trainer, replay = _fit_48_of_50(_CosineEvery(50 // 4, frequency=4), _StepCounter())
    schedule = trainer.lr_scheduler_configs[0].scheduler
    assert replay.steps.plan.plain_steps == 50 and replay.steps.plan.total_steps == trainer.global_step == 48
    assert schedule.T_max == schedule.last_epoch == 12
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-9)


@pytest.mark.parametrize(("length", "frequency", "share"), [(50, 1, "96%"), (50 // 2, 2, "96%")])
def test_a_schedule_of_the_plain_run_that_the_planned_steps_stop_short_is_still_refused(
    length, frequency, share
):
    """The same plan cuts a schedule of the plain 50 steps (stepped 48 times) and one of 50 // 2 stepped every
    2 steps (stepped 24 times of 25)."""
    counter = _StepCounter()
    with pytest.raises(PulseRefusal, match=rf"built for {length} steps.*plans 48: .*stop at {share} "):
        _fit_48_of_50(_CosineEvery(length, frequency), counter)
    assert counter.steps == 0


def test_unplanned_lengths_cut_a_schedule_only_where_the_planned_steps_stop_it_short():
    from types import SimpleNamespace

    from lightning_pulse.step_saving import UnplannedLengths

    def cut(plain: int, planned: int, length: int, frequency: int):
        unplanned = UnplannedLengths(plain, max_epochs=1, batches=plain, accumulate=1, max_steps=None)
        optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=length)
        return unplanned.cut_short(
            SimpleNamespace(interval="step", frequency=frequency, scheduler=schedule), planned
        )

    # the unplanned length over the frequency, reached by the planned steps: its whole course
    assert cut(50, 48, 12, 4) is None and cut(103, 100, 20, 5) is None
    # stepped fewer times than its length: cut, with the share of its course reached
    assert cut(50, 48, 50, 1).share == pytest.approx(48 / 50)
    assert cut(50, 44, 12, 4).share == pytest.approx(11 / 12)
    undivided = cut(50, 40, 50, 4)  # the frequency left out of the count: stepped 10 times of 50, plain 12
    assert undivided.share == pytest.approx(10 / 50) and undivided.frequency == 1
    assert cut(50, 24, 12, 4).frequency == 4
    # stopped short by the unplanned run as well (stepped 12 times in either): not the plan's cut
    assert cut(50, 48, 13, 4) is None and cut(50, 48, 50, 4) is None


# ---------------------------------------------------------------------------- validation with an int interval
def test_an_int_val_check_interval_validates_each_planned_pass_end_as_the_plain_epoch_end():
    """Held-out sweep: validating every 4 batches of 12-batch epochs, the plain run validates every epoch's
    end and its final weights; the 6-batch planned passes validated only at their 4th batch."""
    pl.seed_everything(0, verbose=False)
    module, epochs = _Classifier(), _Epochs()
    trainer = pl.Trainer(
        max_epochs=4, val_check_interval=4, callbacks=[HardSampleReplay(), epochs], **trainer_kwargs()
    )
    trainer.fit(module, DataLoader(_data(96), batch_size=8), DataLoader(_data(32, seed=1), batch_size=8))
    pass_ends = [step + 1 for (epoch, step), (after, _) in zip(epochs.at, epochs.at[1:]) if after != epoch]
    pass_ends.append(trainer.global_step)
    assert len(pass_ends) == 4 and trainer.global_step < 4 * 12  # non-vacuous: the passes are shorter
    assert set(pass_ends) <= set(module.validated_at)
    assert 4 in module.validated_at  # the interval still counts within a pass


# ---------------------------------------------------------------------------- StochasticWeightAveraging
class _BatchNormClassifier(_Classifier):
    """With BatchNorm, so StochasticWeightAveraging adds an epoch that recomputes its statistics;
    ``read_length`` reads the run length in ``configure_optimizers``, which sets the data (and the plan) up
    before SWA's ``on_fit_start``."""

    def __init__(self, read_length: bool) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(10, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
        self.read_length = read_length

    def configure_optimizers(self):
        if self.read_length:
            self.length_read = self.trainer.estimated_stepping_batches
        return torch.optim.SGD(self.parameters(), lr=0.05)


@pytest.mark.parametrize("swa_first, read_length", [(False, False), (True, False), (False, True)])
def test_a_step_plan_next_to_swa_on_batch_norm_plans_the_training_epochs_and_keeps_the_update_epoch(
    caplog, swa_first, read_length
):
    """Held-out sweep: SWA raises max_epochs by one on a model with BatchNorm for an epoch that only
    recomputes BatchNorm statistics; the plan took it for a sixth epoch of data (49 steps "instead of 60"),
    the run ended at max_epochs after 39 and the end line read a share of the plain run's 60 where 50 train.
    The plan is of the 5 training epochs, max_steps leaves the update epoch its one step (capped at the plan,
    the fit ended before it), and that epoch recomputes the statistics over the whole data."""
    import logging

    from lightning.pytorch.callbacks import StochasticWeightAveraging

    class UpdateEpochBatches(Callback):
        def __init__(self) -> None:
            self.sizes: list[int] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.current_epoch == 5:
                self.sizes.append(len(batch[0]))

    pl.seed_everything(0, verbose=False)
    cycle, replay = _pulse(burst=3, replay=4, maintain=1), HardSampleReplay(rule="topk", replay_fraction=0.5)
    swa, epochs = StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=0.6), _Epochs()
    update_epoch = UpdateEpochBatches()
    callbacks = [cycle, replay, swa] if not swa_first else [swa, cycle, replay]
    callbacks += [epochs, update_epoch]
    trainer = pl.Trainer(callbacks=callbacks, max_epochs=5, **trainer_kwargs())
    module, data = _BatchNormClassifier(read_length), _data(80)
    with caplog.at_level(logging.INFO):
        trainer.fit(module, DataLoader(data, batch_size=8))  # 10 batches a pass: 50 steps in the plain run
    plan = replay.steps.plan
    assert plan.plain_steps == 50 and plan.total_steps < 50
    trained = [step for epoch, step in epochs.at if epoch < 5]
    assert (
        len(trained) == plan.total_steps and trainer.max_steps == trainer.global_step == plan.total_steps + 1
    )
    assert cycle.clock.step == plan.total_steps
    messages = [record.getMessage() for record in caplog.records]
    assert any(f"took {plan.total_steps} optimizer steps" in m and "plain run's 50." in m for m in messages)
    # the update epoch recomputed the statistics over one plain pass of all the data
    assert update_epoch.sizes == [8] * 10 and int(module.net[1].num_batches_tracked) == 10


def test_batch_mode_selects_nothing_in_the_batch_norm_epoch_of_swa():
    """Fixer W: in SWA's BatchNorm-update epoch HardSampleReplay(mode="batch") still cut the batches to the
    hard samples, so the averaged model's statistics came from them only (0.034 off a pass over the data)."""
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    class UpdateEpochBatches(Callback):
        def __init__(self) -> None:
            self.sizes: dict[int, list[int]] = {}

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.sizes.setdefault(trainer.current_epoch, []).append(len(batch[0]))

    pl.seed_everything(0, verbose=False)
    replay = HardSampleReplay(mode="batch", rule="topk", replay_fraction=0.5)
    update_epoch = UpdateEpochBatches()
    swa = StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=0.5)
    trainer = pl.Trainer(callbacks=[replay, swa, update_epoch], max_epochs=4, **trainer_kwargs())
    module = _BatchNormClassifier(read_length=False)
    trainer.fit(module, DataLoader(_data(80), batch_size=8))
    assert min(update_epoch.sizes[3]) < 8  # non-vacuous: the training epochs were cut
    assert update_epoch.sizes[4] == [8] * 10 and int(module.net[1].num_batches_tracked) == 10


# ------------------------------------------------------------------------ validation with a float interval
class _Validations(Callback):
    """Each pass's length and the batches of it (counted from 1) that validated, by epoch."""

    def __init__(self) -> None:
        self.batches: dict[int, int] = {}
        self.validated: dict[int, list[int]] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches[trainer.current_epoch] = batch_idx + 1

    def on_validation_epoch_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            at = trainer.fit_loop.epoch_loop.batch_idx + 1
            self.validated.setdefault(trainer.current_epoch, []).append(at)


def _fit_validations(callbacks, **trainer_args) -> _Validations:
    """Four epochs of 12 batches (96 samples in batches of 8)."""
    pl.seed_everything(0, verbose=False)
    validations = _Validations()
    trainer = pl.Trainer(max_epochs=4, callbacks=[*callbacks, validations], **trainer_kwargs(**trainer_args))
    trainer.fit(
        _Classifier(), DataLoader(_data(96), batch_size=8), DataLoader(_data(32, seed=1), batch_size=8)
    )
    return validations


@pytest.mark.parametrize(
    "interval, every_n_epochs, expected",
    [
        # the plain epoch validates at 6 and 12: each pass at its half and its end
        (0.5, 1, {0: [4, 8], 1: [4, 9], 2: [4, 9], 3: [4, 9]}),
        # the plain epoch at 3, 6, 9 and 12: each pass at its quarters, rounded down as Lightning rounds
        (0.25, 1, {0: [2, 4, 6, 8], 1: [2, 4, 6, 9], 2: [2, 4, 6, 9], 3: [2, 4, 6, 9]}),
        # the plain epoch at 5 and 10 (not its end): the same shares of the pass, not its end either
        (0.42, 1, {0: [3, 6], 1: [3, 7], 2: [3, 7], 3: [3, 7]}),
        # only every second epoch validates, at the same points
        (0.5, 2, {1: [4, 9], 3: [4, 9]}),
    ],
)
def test_a_float_val_check_interval_validates_each_planned_pass_at_its_shares_once(
    interval, every_n_epochs, expected
):
    """Held-out sweep: validating at 0.5 of 12-batch epochs (2 checks each), the 9-batch planned passes
    validated at batches 4 and 8 (every int(9 * 0.5)) and again at 9, the plain epoch's end moved to the
    pass's: 11 validations where the plain run had 8, two of them back to back. Each pass now validates as
    often as the plain epoch, at the same shares of it."""
    cycle = PulseCycle(burst=4, replay=4, maintain=2, warmup=0, anneal=0, probe_batches=1)
    validations = _fit_validations(
        [cycle, HardSampleReplay(rule="topk", replay_fraction=0.5)],
        val_check_interval=interval,
        check_val_every_n_epoch=every_n_epochs,
    )
    assert validations.batches == {0: 8, 1: 9, 2: 9, 3: 9}  # non-vacuous: passes shorter than the 12 batches
    assert validations.validated == expected


@pytest.mark.parametrize(
    "interval, every_n_epochs, expected",
    [
        # every 4 batches of a pass, and its end as the plain epoch's (12 a multiple of 4), every second epoch
        (4, 2, {1: [4, 6], 3: [4, 6]}),
        # counted over the run's batches across passes: its batches 5, 10, 15 and 20
        (5, None, {0: [5], 1: [4], 2: [3], 3: [2]}),
    ],
)
def test_an_int_val_check_interval_keeps_counting_batches_next_to_the_float_placement(
    interval, every_n_epochs, expected
):
    """The fractional interval's placement leaves an int interval as it was, by epoch or over the run."""
    validations = _fit_validations(
        [HardSampleReplay()], val_check_interval=interval, check_val_every_n_epoch=every_n_epochs
    )
    assert validations.batches == {0: 6, 1: 6, 2: 6, 3: 6}  # non-vacuous: passes shorter than the 12 batches
    assert validations.validated == expected


# ------------------------------------------------- validation with an int interval longer than a planned pass
def _light_cycle() -> list[Callback]:
    """PulseCycle and HardSampleReplay whose light phases cut the 12-batch epochs to passes of 8 and 9."""
    cycle = PulseCycle(burst=4, replay=4, maintain=2, warmup=0, anneal=0, probe_batches=1)
    return [cycle, HardSampleReplay(rule="topk", replay_fraction=0.5)]


@pytest.mark.parametrize(
    "interval, every_n_epochs, light, expected",
    [
        # plain: every epoch at batch 8; each 6-batch pass ends before its 8th: it validates at its end
        (8, 1, False, {0: [6], 1: [6], 2: [6], 3: [6]}),
        (8, 2, False, {1: [6], 3: [6]}),
        # passes of 8 and 9 batches: each reaches an 8th batch and validates there, not at its end as well
        (8, 1, True, {0: [8], 1: [8], 2: [8], 3: [8]}),
        # plain: every epoch at batch 11; each pass of 8 or 9 at its end
        (11, 1, True, {0: [8], 1: [9], 2: [9], 3: [9]}),
    ],
)
def test_an_int_val_check_interval_longer_than_a_planned_pass_validates_the_pass_at_its_end(
    interval, every_n_epochs, light, expected
):
    """Held-out sweep: Lightning refuses an int interval longer than the epoch (with
    `check_val_every_n_epoch` set), so the plain run validates every epoch; the DataLoader keeps its plain
    length, so Lightning accepted an interval longer than the planned passes, which their count from the
    pass's start never reached: `val_check_interval=20` on 23-batch epochs validated in none of 4 epochs (the
    plain run in each). A pass that reaches the interval validates there only, as before."""
    validations = _fit_validations(
        _light_cycle() if light else [HardSampleReplay()],
        val_check_interval=interval,
        check_val_every_n_epoch=every_n_epochs,
    )
    # non-vacuous: passes shorter than the 12 batches, some or all shorter than the interval
    assert validations.batches == ({0: 8, 1: 9, 2: 9, 3: 9} if light else {0: 6, 1: 6, 2: 6, 3: 6})
    assert validations.validated == expected


class _PlateauClassifier(_Classifier):
    """Its LR steps on the validation loss at each epoch's end: Lightning raises where an epoch has none."""

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0)
        return [optimizer], [{"scheduler": plateau, "interval": "epoch", "monitor": "val_loss"}]


def test_monitors_of_the_validation_loss_work_with_an_int_interval_longer_than_the_planned_passes(tmp_path):
    """The finding's setup: with no validation in any pass a monitored ModelCheckpoint saved no model,
    EarlyStopping never checked, and a ReduceLROnPlateau on the validation loss raised at the first epoch's
    end."""
    pl.seed_everything(0, verbose=False)
    module = _PlateauClassifier()
    best = ModelCheckpoint(dirpath=tmp_path, monitor="val_loss", filename="{step}")
    stop = EarlyStopping(monitor="val_loss", patience=100)
    trainer = pl.Trainer(
        max_epochs=4,
        val_check_interval=11,
        callbacks=[*_light_cycle(), best, stop],
        **trainer_kwargs(enable_checkpointing=True),
    )
    trainer.fit(module, DataLoader(_data(96), batch_size=8), DataLoader(_data(32, seed=1), batch_size=8))
    assert trainer.global_step == 35  # non-vacuous: passes of 8 and 9 of the 12 batches
    assert module.validated_at == [8, 17, 26, 35]  # each pass's end, the run's final weights among them
    assert Path(best.best_model_path).stem in {f"step={step}" for step in module.validated_at}
    assert stop.best_score is not None and torch.isfinite(stop.best_score)


def test_a_resume_validates_the_ends_of_passes_shorter_than_the_int_interval_as_the_uninterrupted_run(
    tmp_path,
):
    """Lightning reads on a resume whether the restored batch validated: resumed at or inside a pass, the run
    validates the later pass ends the uninterrupted run validated, not the restored one again."""

    def fit(callbacks=(), ckpt_path=None):
        pl.seed_everything(0, verbose=False)
        module = _Classifier()
        trainer = pl.Trainer(
            max_epochs=4,
            val_check_interval=8,
            callbacks=[HardSampleReplay(), *callbacks],
            **trainer_kwargs(enable_checkpointing=bool(callbacks)),
        )
        data = DataLoader(_data(96), batch_size=8), DataLoader(_data(32, seed=1), batch_size=8)
        trainer.fit(module, *data, ckpt_path=ckpt_path)
        return module

    every_step = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1, filename="{step}")
    full = fit([every_step])
    assert full.validated_at == [6, 12, 18, 24]  # the 6-batch passes' ends
    for saved in (6, 9, 12, 18):  # at a pass's end (before its validation) and inside one
        resumed = fit(ckpt_path=str(tmp_path / f"step={saved}.ckpt"))
        assert resumed.validated_at == [step for step in full.validated_at if step > saved]
        assert torch.equal(_parameters(resumed), _parameters(full))


def test_a_long_plan_without_an_exact_fixed_point_takes_few_simulations_of_the_run(monkeypatch):
    """Held-out sweep: next to a default PulseCycle, about half of all run lengths have no exact fixed point,
    and the plan then simulated the whole run once for each of 65 spans from its first tries on (73 whole-run
    simulations for 10,000 steps: 46.6 s CPU before step 0 of a 200,000-step run, again at every cut epoch's
    end), and pinned the last of them, ~90 steps short of the run. The closest tried pair around the crossing
    is now bisected: a few simulations, and a span within a step or two of the run's steps."""
    calls = []
    simulate = step_plan._simulate
    monkeypatch.setattr(step_plan, "_simulate", lambda *args: calls.append(args[-1]) or simulate(*args))
    clock = PhaseClock({"burst": 60, "replay": 30, "maintain": 10}, warmup=0.1, anneal=0.1)
    plan = plan_steps(clock, ["replay"], 32, 0.5, 32000, None, 10000)  # 1,000 batches an epoch
    assert plan.span is not None and plan.total_steps > 8000  # non-vacuous: tries ended without a fixed point
    assert len(calls) <= 10, f"{len(calls)} whole-run simulations"
    assert 0 <= plan.total_steps - plan.span <= 2 and plan.steps_past_data == 0
    assert plan.total_steps == sum(len(sizes) for sizes in plan.batch_sizes)
