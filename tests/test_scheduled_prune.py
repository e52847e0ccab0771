"""ScheduledPrune through real Trainers on MNIST-1D: schedule, phases, structured shrinkage, resume, export."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader

from examples.mnist1d import MNIST1DClassifier, MNIST1DDataModule
from lightning_pulse import Phase, PulseCycle, ScheduledPrune
from lightning_pulse.callbacks.scheduled_prune import DistillConfig, PruneOptions
from lightning_pulse.core import prune_setup, pruning
from lightning_pulse.core.prune_schedule import PruneSchedule, cubic_sparsity
from lightning_pulse.core.step_plan import epoch_steps
from lightning_pulse.errors import PulseRefusal
from tests.conftest import RecordingLogger, trainer_kwargs


class OptimizerWatch(Callback):
    """Remembers the optimizer and scheduler objects the run started with."""

    def on_train_start(self, trainer, pl_module):
        self.optimizer = trainer.optimizers[0]
        self.schedulers = [config.scheduler for config in trainer.lr_scheduler_configs]


def _fixed_order_loaders(data: MNIST1DDataModule) -> tuple[DataLoader, DataLoader]:
    # an unshuffled loader makes an interrupted and an uninterrupted run see the same batches
    data.setup()
    return DataLoader(data.train_set, batch_size=64), DataLoader(data.val_set, batch_size=64)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"final_sparsity": 1.0}, "`final_sparsity`"),
        ({"final_sparsity": 0.3, "options": PruneOptions(initial_sparsity=0.5)}, "`initial_sparsity`"),
        ({"mode": "channels"}, "`mode`"),
        ({"options": {"cadence": "hourly"}}, "`cadence`"),
        ({"options": {"ranking": "best"}}, "`ranking`"),
        ({"start": 1.5}, "`start`"),
        ({"start": 50, "end": 10}, "`end`"),
        ({"every": 0}, "`every`"),
        ({"layer_types": ["Nonsense"]}, "`layer_types`"),
        ({"exclude_pattern": "(unclosed"}, "`exclude_pattern`"),
        ({"distill": {"temperature": 0}}, "DistillConfig: `temperature`"),
        ({"distill": True}, "`distill`"),
        ({"probe_batches": -1}, "`probe_batches`"),
        ({"options": {"min_channels": True}}, "`min_channels`"),
        ({"options": {"make_permanent": "yes"}}, "`make_permanent`"),
        ({"options": {"lottery_ticket_reset": True}}, "`options`"),
    ],
)
def test_invalid_arguments_fail_at_construction(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ScheduledPrune(**kwargs)


def test_a_schedule_that_cuts_at_once_is_said_at_fit_start_and_a_gradual_one_is_not(mnist1d_small, recwarn):
    # the defaults (every=100) on a 180-step run: one cut from 0 to 50% late in the run (a held-out ResNet's
    # loss jumped from 0.07 to 3.7 at it), which nothing said
    model, data = mnist1d_small()
    prune = ScheduledPrune(probe_batches=0)
    trainer = pl.Trainer(max_steps=180, callbacks=[prune], **trainer_kwargs(max_epochs=-1))
    trainer.fit(model, data)
    said = [str(w.message) for w in recwarn if "at once" in str(w.message)]
    assert len(said) == 1 and "from 0.00 to 0.50 at once" in said[0] and "Set `every` to about 13" in said[0]
    assert [event["step"] for event in prune.events][:1] == [118]  # what it warned about happened
    recwarn.clear()
    model, data = mnist1d_small()
    trainer = pl.Trainer(
        max_steps=180, callbacks=[ScheduledPrune(every=13, probe_batches=0)], **trainer_kwargs(max_epochs=-1)
    )
    trainer.fit(model, data)
    assert not [w for w in recwarn if "at once" in str(w.message)]


@pytest.mark.parametrize("mode", ["unstructured", "structured"])
def test_a_one_shot_schedule_prunes_to_the_final_sparsity_at_its_step(mnist1d_small, mode):
    # start == end is a one-shot prune: it used to finish at sparsity 0 with no event and no word
    # (unstructured), or be refused for a false reason (structured: every trial level was 0)
    model, data = mnist1d_small()
    prune = ScheduledPrune(final_sparsity=0.5, mode=mode, start=10, end=10, every=5, probe_batches=0)
    trainer = pl.Trainer(max_steps=20, callbacks=[prune], **trainer_kwargs(max_epochs=-1))
    trainer.fit(model, data)
    assert [event["step"] for event in prune.events] == [10]
    assert prune.events[0]["target_sparsity"] == 0.5 and prune.finished


def test_the_fit_end_line_names_the_fits_last_step_and_gives_the_probe_as_the_last_events(
    mnist1d_small, caplog
):
    # sw-savings: "at fit end, step 140: ... val_acc=0.5800" for a fit that trained to step 200 after that
    # event: the last event's step and probe were read as the fit's end
    model, data = mnist1d_small()
    prune = ScheduledPrune(final_sparsity=0.5, start=2, end=12, every=2, probe_batches=1)
    trainer = pl.Trainer(max_steps=30, callbacks=[prune], **trainer_kwargs(max_epochs=-1))
    with caplog.at_level(logging.INFO):
        trainer.fit(model, data)
    last = prune.events[-1]
    assert trainer.global_step == 30 and last["step"] == 12 and last["probe_after"]
    (line,) = [r.getMessage() for r in caplog.records if "at fit end" in r.getMessage()]
    assert line.startswith("ScheduledPrune: at fit end, step 30; the last prune event, step 12: sparsity ")
    assert line.endswith("; its probe is that event's, 18 steps before the fit's end."), line
    assert pruning.event_summary(last) in line


def test_step_cadence_follows_the_cubic_schedule_to_an_absolute_target(mnist1d_small):
    pl.seed_everything(0)
    model, data = mnist1d_small()
    logger = RecordingLogger()
    prune = ScheduledPrune(
        final_sparsity=0.7,
        start=10,
        end=40,
        every=10,
        probe_batches=1,
        options=PruneOptions(ranking="global"),
    )
    trainer = pl.Trainer(max_steps=48, callbacks=[prune], **trainer_kwargs(logger=logger))
    trainer.fit(model, data)

    # step 10 is the schedule's start (target 0): no event; then every 10 steps up to the end
    assert [event["step"] for event in prune.events] == [20, 30, 40]
    for event in prune.events:
        assert event["target_sparsity"] == pytest.approx(cubic_sparsity(event["step"], 0.0, 0.7, 10, 40))
        assert event["sparsity"] == pytest.approx(event["target_sparsity"], abs=1e-3)
        assert set(event["probe_after"]) == {"val_acc", "val_loss"}
    assert prune.events[-1]["target_sparsity"] == 0.7 and prune.finished
    assert prune.events[0]["params_nonzero"] < prune.events[0]["params"]
    # logged where Lightning writes the metrics of that moment (a validation after step 20 is at 19)
    assert [step for step, _ in logger.logged("prune/sparsity")] == [19, 29, 39]
    assert logger.logged("prune/layer/net.8") and logger.logged("prune/val_acc_after")
    # masks were made permanent at fit end, with 70% of the chosen weights zero
    assert not any(name.endswith("_orig") for name, _ in model.named_parameters())
    weights = [model.net[i].weight for i in (1, 3, 5, 8)]
    zeros = sum(int((w == 0).sum()) for w in weights) / sum(w.numel() for w in weights)
    assert zeros == pytest.approx(0.7, abs=1e-3)


@pytest.mark.parametrize("mode", ["unstructured", "structured"])
def test_layers_the_user_froze_are_never_pruned(mnist1d_small, mode, caplog):
    pl.seed_everything(0)
    model, data = mnist1d_small()
    model.net[1].requires_grad_(False)  # a frozen first conv, as a user freezes a pretrained stem
    frozen_before = model.net[1].weight.detach().clone()
    prune = ScheduledPrune(final_sparsity=0.5, start=4, end=12, every=4, probe_batches=1, mode=mode)
    with caplog.at_level("INFO"):
        pl.Trainer(max_steps=14, callbacks=[prune], **trainer_kwargs()).fit(model, data)
    assert prune.events and prune.events[-1]["sparsity"] > 0
    assert torch.equal(model.net[1].weight, frozen_before) and not model.net[1].weight.requires_grad
    assert "net.1 (frozen by the user" in caplog.text  # the setup line says what it left out, and why


class FreezeStemAtFitStart(Callback):
    """Freezes the first conv at fit start, as Lightning's BackboneFinetuning freezes a backbone."""

    def on_fit_start(self, trainer, pl_module):
        pl_module.net[1].requires_grad_(False)


@pytest.mark.parametrize("mode", ["unstructured", "structured"])
def test_layers_another_callback_freezes_at_fit_start_are_never_pruned_and_a_resume_keeps_the_set(
    mnist1d_small, mode, tmp_path
):
    # the frozen set was read at setup, before a later-listed callback froze its backbone: 50% of it was pruned
    pl.seed_everything(0)
    model, data = mnist1d_small()
    prune = ScheduledPrune(final_sparsity=0.5, start=4, end=12, every=4, probe_batches=1, mode=mode)
    trainer = pl.Trainer(max_steps=14, callbacks=[prune, FreezeStemAtFitStart()], **trainer_kwargs())
    stem_before = model.net[1].weight.detach().clone()
    trainer.fit(model, data)
    assert prune.events and torch.equal(model.net[1].weight, stem_before)
    # a resume keeps the set the run's start read, whatever is frozen when it resumes
    state = prune.state_dict()
    assert state["user_frozen"] == ["net.1"]
    resumed = ScheduledPrune(final_sparsity=0.5, start=4, end=12, every=4, probe_batches=1, mode=mode)
    resumed.load_state_dict({**state, "user_frozen": ["net.1", "net.3"]})
    assert resumed.core.restored_frozen == frozenset({"net.1", "net.3"})


def test_layers_under_a_parametrization_are_left_out_and_named(mnist1d_small, caplog):
    # held-out sweep: weight_norm and spectral_norm layers were silently skipped (the run reported sparsity 0.5
    # over one layer holding 6% of the weights, and named nothing)
    from torch.nn.utils.parametrizations import spectral_norm, weight_norm

    pl.seed_everything(0)
    model, data = mnist1d_small()
    weight_norm(model.net[1])  # the first conv
    spectral_norm(model.net[-1])  # the classifier
    before = {index: model.net[index].weight.detach().clone() for index in (1, len(model.net) - 1)}
    prune = ScheduledPrune(final_sparsity=0.5, start=4, end=12, every=4, probe_batches=1)
    with caplog.at_level("INFO"):
        pl.Trainer(max_steps=14, callbacks=[prune], **trainer_kwargs()).fit(model, data)
    assert prune.events and prune.events[-1]["sparsity"] > 0
    for index in before:  # trained, never masked
        assert not (model.net[index].weight == 0).any()
        assert not hasattr(model.net[index].parametrizations.weight, "original_mask")
    last = len(model.net) - 1
    for name in (
        "net.1 (its weight is computed by a parametrization",
        f"net.{last} (its weight is computed by",
    ):
        assert name in caplog.text


def test_layers_under_the_older_hook_norms_are_left_out_too(mnist1d_small, caplog):
    # torch.nn.utils.spectral_norm (GAN discriminators) keeps `weight_orig` as a pruned layer does: the layer was
    # selected and the first event crashed ("'weight' is not in list")
    from torch.nn.utils import spectral_norm, weight_norm

    pl.seed_everything(0)
    model, data = mnist1d_small()
    spectral_norm(model.net[-1])
    weight_norm(model.net[1])
    prune = ScheduledPrune(final_sparsity=0.5, start=4, end=12, every=4, probe_batches=1)
    with caplog.at_level("INFO"):
        pl.Trainer(max_steps=14, callbacks=[prune], **trainer_kwargs()).fit(model, data)
    assert prune.events and prune.events[-1]["sparsity"] > 0
    last = len(model.net) - 1
    assert (
        f"net.{last} (its weight is computed by" in caplog.text
        and "net.1 (its weight is computed" in caplog.text
    )
    assert not (model.net[last].weight_orig == 0).any()


def test_events_happen_only_when_maintain_phases_start(mnist1d_small):
    pl.seed_everything(0)
    model, data = mnist1d_small()
    cycle = PulseCycle(burst=6, replay=3, maintain=3, warmup=0, anneal=0, probe_batches=1)
    prune = ScheduledPrune(
        final_sparsity=0.5, start=0, end=30, probe_batches=1, options=PruneOptions(make_permanent=False)
    )
    trainer = pl.Trainer(max_steps=40, callbacks=[cycle, prune], **trainer_kwargs())
    trainer.fit(model, data)

    maintain_starts = [c.step for c in cycle.history if c.current is Phase.MAINTAIN]
    assert maintain_starts == [9, 21, 33]
    assert [event["step"] for event in prune.events] == [9, 21, 33]
    assert all(event["phase"] == "maintain" for event in prune.events)
    # the accuracy before an event is the probe PulseCycle ran at that maintain entry
    assert prune.events[-1]["probe_before"] == cycle.last_probe
    assert prune.events[-1]["sparsity"] == pytest.approx(0.5, abs=1e-3)
    assert pruning.current_mask(model.net[1]) is not None  # make_permanent=False keeps the masks


def test_a_plan_with_no_maintain_phase_in_the_pruning_span_prunes_on_the_step_cadence_or_is_refused(
    mnist1d_small, recwarn
):
    # held-out sweep: a budget stretched the replay phases past the run's end, so no maintain phase started;
    # the setup line promised pruning "at maintain-phase starts" and the run ended at 0% sparsity, unsaid
    def cycle():
        return PulseCycle(burst=8, replay=200, maintain=2, warmup=0, anneal=0, maintain_eval="none")

    pl.seed_everything(0)
    model, data = mnist1d_small()
    prune = ScheduledPrune(final_sparsity=0.5, start=10, end=30, every=5, probe_batches=0)
    trainer = pl.Trainer(max_steps=40, callbacks=[cycle(), prune], **trainer_kwargs())
    trainer.fit(model, data)
    said = [str(w.message) for w in recwarn if "no maintain phase starts between step 10" in str(w.message)]
    assert said and said[0].endswith("pruning on the step cadence instead.")
    assert [event["step"] for event in prune.events] == [15, 20, 25, 30]  # at step 10 the target is still 0
    assert prune.sparsity == pytest.approx(0.5, abs=1e-3)

    model, data = mnist1d_small()
    explicit = ScheduledPrune(
        final_sparsity=0.5, start=10, end=30, probe_batches=0, options={"cadence": "maintain"}
    )
    trainer = pl.Trainer(max_steps=40, callbacks=[cycle(), explicit], **trainer_kwargs())
    with pytest.raises(
        PulseRefusal, match=r"^ScheduledPrune: `cadence`='maintain' .* no maintain phase starts"
    ):
        trainer.fit(model, data)
    assert trainer.global_step == 0


def _linear_data(samples: int = 640) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(samples, 16, generator=generator), torch.randint(0, 4, (samples,), generator=generator)
    )
    return DataLoader(data, batch_size=32)


class WarningsAtFirstStep(Callback):
    """Records the abrupt-cut warnings already given when the first training batch starts."""

    def __init__(self, recwarn) -> None:
        self.recwarn = recwarn
        self.said: list[str] | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.said is None:
            self.said = [str(w.message) for w in self.recwarn if "at once" in str(w.message)]


def test_a_maintain_plan_that_cuts_at_once_is_said_at_fit_start_and_a_gradual_one_is_not(recwarn):
    # held-out sweep: PulseCycle() + ScheduledPrune() at their defaults on a 220-step run had one maintain start
    # in the pruning span, one cut from 0 to 0.48 (a BatchNorm CNN's probe accuracy 0.975 -> 0.284), and only
    # the step cadence warned of such a plan; here the same plan at half the length
    def fit(cycle):
        pl.seed_everything(0)
        prune, said = ScheduledPrune(probe_batches=0), WarningsAtFirstStep(recwarn)
        trainer = pl.Trainer(max_steps=110, callbacks=[cycle, prune, said], **trainer_kwargs(max_epochs=-1))
        trainer.fit(_LinearClassifier(), _linear_data())
        return [event["step"] for event in prune.events], said.said

    steps, said = fit(PulseCycle(burst=30, replay=15, maintain=5, maintain_eval="none"))
    assert steps == [56]  # warm-up to 11, burst, replay, maintain at 56; the next one falls in the anneal
    assert len(said) == 1 and "pruning at maintain-phase starts" in said[0] and "makes 1 cut(s)" in said[0]
    assert "at step 56 takes sparsity from 0.00 to 0.48 at once" in said[0]
    stops = (
        "no maintain phase starts at or after step 77 with a step left to train after it: "
        "sparsity stops at 0.48"
    )
    assert stops in said[0]
    assert "a cycle of about 8 steps" in said[0] and "cadence='steps') with `every`=8" in said[0]
    recwarn.clear()
    steps, said = fit(PulseCycle(burst=4, replay=2, maintain=2, maintain_eval="none"))
    assert len(steps) == 9 and said == []


@pytest.mark.parametrize(("end", "offered"), [(12, "a cycle of about 3 steps has 3 in it"), (7, "too short")])
def test_an_abrupt_cut_on_a_short_span_is_offered_cycles_that_exist(end, offered):
    # sweep (docs as written): the docs' own example, a 2-to-12 span, was told "a cycle of about 1 steps has 8
    # in it", and no PulseCycle has a one-step cycle (a burst step and a maintain step at least)
    schedule = PruneSchedule(start=2, end=end)
    schedule.resolve(20)
    said = prune_setup.abrupt_schedule_warning(schedule, maintain_at=[6, 14])
    assert offered in said and "about 1 steps" not in said


@pytest.mark.parametrize(
    "durations, accumulate",
    [({"burst": 12, "replay": 5, "maintain": 3}, 1), ({"burst": 0.5, "replay": 0.25, "maintain": 0.15}, 2)],
)
def test_the_maintain_starts_planned_at_fit_start_are_where_the_run_enters_maintain_phases(
    durations, accumulate
):
    # the abrupt-cut check on the maintain cadence reads this plan: steps and epoch fractions (20 batches, 10
    # steps an epoch with accumulation: phases of 5, 2.5 and 1.5 steps) land where the real clock changes
    cycle = PulseCycle(**durations, maintain_eval="none")
    planned = prune_setup.maintain_starts(cycle.clock.copy(), 10**6, 90, epoch_steps(20, accumulate))
    pl.seed_everything(0)
    trainer = pl.Trainer(
        max_steps=90, callbacks=[cycle], **trainer_kwargs(max_epochs=-1, accumulate_grad_batches=accumulate)
    )
    trainer.fit(_LinearClassifier(), _linear_data())
    entered = [change.step for change in cycle.history if change.current is Phase.MAINTAIN]
    assert len(entered) >= 3 and planned == entered
    # wall-clock phases end with the seconds the steps take: no plan, and no abrupt-cut warning from a guess
    seconds = PulseCycle(burst="30s", replay=5, maintain=5).clock
    assert prune_setup.maintain_starts(seconds, 70, 100, None) is None
    schedule = PruneSchedule(start=0, end=70)
    schedule.resolve(100)
    assert prune_setup.event_cadence("auto", seconds, schedule, 0, 100) == (True, [])


def test_a_maintain_plan_next_to_a_green_window_that_holds_light_phases_says_it_assumes_no_hold(
    recwarn, tmp_path
):
    # review: a GreenWindow held the cycle in its light phases while the grid was dirty, so the maintain
    # phases started elsewhere, and the abrupt-cut warning quoted the plan of 120 and 220 as the run's
    from lightning_pulse import GreenWindow, GreenWindowOptions, SimulatedClock
    from lightning_pulse.callbacks.simulated_step_time import SimulatedStepTime

    pl.seed_everything(0)
    clock = SimulatedClock("2020-06-15 00:00:00")
    signal = str(
        Path(__file__).resolve().parents[1] / "examples" / "data" / "carbon" / "de_2020_june_excerpt.csv"
    )
    green = GreenWindow(signal=signal, clock=clock, options=GreenWindowOptions(report_dir=str(tmp_path)))
    cycle, prune = PulseCycle(maintain_eval="none"), ScheduledPrune(probe_batches=0)
    said = WarningsAtFirstStep(recwarn)
    callbacks = [SimulatedStepTime(clock, 600.0), cycle, green, prune, said]
    kwargs = trainer_kwargs(max_epochs=-1, limit_val_batches=0)
    pl.Trainer(max_steps=300, callbacks=callbacks, **kwargs).fit(_LinearClassifier(), _linear_data())
    (warning,) = said.said
    assert "the PulseCycle's plan, if no GreenWindow hold moves its phases, makes 2 cut(s)" in warning
    assert "the one at step 120 takes sparsity" in warning  # the plan without holds
    assert [event["step"] for event in prune.events] == [60, 115, 155]  # the holds moved them


def test_epoch_phases_under_a_changing_gradient_accumulation_give_no_maintain_plan(recwarn):
    # review: with the accumulation raised from 1 to 3 at epoch 3, the plan kept the first epoch's 20 steps an
    # epoch, put the maintain starts at 42, 76 and 110 (the run's: 42, 67, 80, 93) and warned of its cuts
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    pl.seed_everything(0)
    cycle = PulseCycle(burst=1.0, replay=0.5, maintain=0.2, maintain_eval="none")
    prune, said = ScheduledPrune(probe_batches=0), WarningsAtFirstStep(recwarn)
    accumulation = GradientAccumulationScheduler({0: 1, 3: 3})
    trainer = pl.Trainer(max_epochs=12, callbacks=[accumulation, cycle, prune, said], **trainer_kwargs())
    trainer.fit(_LinearClassifier(), _linear_data())
    assert said.said == []
    entered = [change.step for change in cycle.history if change.current is Phase.MAINTAIN]
    assert entered[:4] == [42, 67, 80, 93] and [event["step"] for event in prune.events] == entered[:4]
    fresh = PulseCycle(burst=1.0, replay=0.5, maintain=0.2).clock
    assert prune_setup.maintain_starts(fresh, 86, 120, None) is None  # no one epoch length to plan by


class ReplacedListener(Callback):
    """Records every ``on_pulse_parameters_replaced`` notification."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def on_pulse_parameters_replaced(self, trainer, pl_module, remap):
        # cut in place: the same object, smaller than before (what holds the parameter stays valid)
        assert all(new is old and new.numel() == kept.numel() for old, new, kept in remap)
        assert all(remap.shape_before(old).numel() > new.numel() for old, new, _ in remap)
        self.calls.append(trainer.global_step)


def test_structured_pruning_shrinks_the_model_and_training_goes_on(mnist1d_small):
    pl.seed_everything(0)
    model, data = mnist1d_small(scheduler="onecycle")
    watch, listener = OptimizerWatch(), ReplacedListener()
    cycle = PulseCycle(burst=6, replay=2, maintain=4, warmup=0, anneal=0.1, probe_batches=1)
    prune = ScheduledPrune(
        final_sparsity=0.5, mode="structured", start=0, end=20, distill=DistillConfig(), probe_batches=1
    )
    kwargs = trainer_kwargs(accumulate_grad_batches=2, precision="bf16-mixed")
    trainer = pl.Trainer(max_steps=36, callbacks=[cycle, prune, watch, listener], **kwargs)
    trainer.fit(model, data)

    assert [model.net[i].out_channels for i in (1, 3, 5)] == [13, 13, 13]
    assert model.net[8].in_features == 65 and model.net[8].out_features == 10
    assert prune.events[-1]["params"] < prune.events[0]["params"] < 5210
    # the optimizer and the OneCycle scheduler are the objects the run started with, now on the new parameters
    optimizer = trainer.optimizers[0]
    assert optimizer is watch.optimizer and trainer.lr_scheduler_configs[0].scheduler.optimizer is optimizer
    assert optimizer.param_groups[0]["params"] == list(model.parameters())
    assert all(optimizer.state[p]["exp_avg"].shape == p.shape for p in model.parameters())
    assert torch.isfinite(trainer.callback_metrics["train_loss"])
    # distillation ran in each maintain window after an event, and stopped when the window ended
    maintain_batches = 4 * 2  # 4 optimizer steps of 2 accumulated batches
    assert all(0 < event["distill_calls"] <= maintain_batches for event in prune.events)
    assert prune._window.distiller is None
    # every event that cut channels told the listeners, at the event's step
    assert listener.calls == [event["step"] for event in prune.events]


def _structured_resume_callbacks():
    return ScheduledPrune(
        final_sparsity=0.6,
        mode="structured",
        start=4,
        end=30,
        every=6,
        probe_batches=1,
        distill=DistillConfig(steps=5),
        options=PruneOptions(ranking="global"),
    )


def test_resume_rebuilds_pruned_shapes_and_continues_like_the_uninterrupted_run(tmp_path):
    data = MNIST1DDataModule(num_samples=1000, batch_size=64)
    train, val = _fixed_order_loaders(data)

    pl.seed_everything(0)
    model = MNIST1DClassifier()
    prune = _structured_resume_callbacks()
    checkpoints = ModelCheckpoint(dirpath=tmp_path, every_n_epochs=1, save_top_k=-1)
    trainer = pl.Trainer(
        max_epochs=3, callbacks=[prune, checkpoints], **trainer_kwargs(enable_checkpointing=True)
    )
    trainer.fit(model, train, val)
    uninterrupted, full_events = model, prune.events

    # at the end of epoch 1 (step 24) channels are already gone and a distillation window is open
    checkpoint = torch.load(next(tmp_path.glob("epoch=1-*.ckpt")), weights_only=False)
    assert checkpoint["callbacks"]["ScheduledPrune"]["teacher"]["steps_left"] > 0
    assert checkpoint["state_dict"]["net.3.weight"].shape[0] < 25

    pl.seed_everything(0)
    model = MNIST1DClassifier()  # freshly built: 25 channels everywhere
    prune = _structured_resume_callbacks()
    trainer = pl.Trainer(max_epochs=3, callbacks=[prune], **trainer_kwargs())
    trainer.fit(model, train, val, ckpt_path=str(next(tmp_path.glob("epoch=1-*.ckpt"))))

    def comparable(events):
        skip = ("distill_loss",)
        return [{k: v for k, v in event.items() if k not in skip} for event in events]

    assert comparable(prune.events) == comparable(full_events)
    resumed_state, full_state = model.state_dict(), uninterrupted.state_dict()
    assert resumed_state.keys() == full_state.keys()
    for key in full_state:
        assert torch.allclose(resumed_state[key], full_state[key], atol=1e-6), key

    # outside a Trainer, the same checkpoint loads into a fresh module
    fresh = ScheduledPrune.load_pruned(MNIST1DClassifier(), checkpoint)
    assert fresh.net[3].weight.shape == checkpoint["state_dict"]["net.3.weight"].shape


def test_resume_restores_unstructured_masks_and_optimizer_order(tmp_path):
    data = MNIST1DDataModule(num_samples=1000, batch_size=64)
    train, val = _fixed_order_loaders(data)

    def run(ckpt_path=None, checkpoint_dir=None):
        pl.seed_everything(0)
        model = MNIST1DClassifier()
        prune = ScheduledPrune(
            final_sparsity=0.8, start=4, end=30, every=5, probe_batches=0, options={"make_permanent": False}
        )
        callbacks = [prune]
        if checkpoint_dir is not None:
            callbacks.append(ModelCheckpoint(dirpath=checkpoint_dir, every_n_epochs=1, save_top_k=-1))
        trainer = pl.Trainer(
            max_epochs=3,
            callbacks=callbacks,
            **trainer_kwargs(enable_checkpointing=checkpoint_dir is not None),
        )
        trainer.fit(model, train, val, ckpt_path=ckpt_path)
        return model, trainer

    full_model, full_trainer = run(checkpoint_dir=tmp_path)
    resumed_model, resumed_trainer = run(ckpt_path=str(next(tmp_path.glob("epoch=1-*.ckpt"))))
    assert torch.equal(resumed_model.net[3].weight_mask, full_model.net[3].weight_mask)
    for key, value in full_model.state_dict().items():
        assert torch.allclose(resumed_model.state_dict()[key], value, atol=1e-6), key
    full_optimizer, resumed_optimizer = full_trainer.optimizers[0], resumed_trainer.optimizers[0]
    for full_p, resumed_p in zip(
        full_optimizer.param_groups[0]["params"], resumed_optimizer.param_groups[0]["params"]
    ):
        assert torch.allclose(
            full_optimizer.state[full_p]["exp_avg"], resumed_optimizer.state[resumed_p]["exp_avg"]
        )


def test_spawning_ddp_refuses_structured_mode_at_setup(mnist1d_small):
    model, _ = mnist1d_small()
    trainer = pl.Trainer(**trainer_kwargs(devices=2, strategy="ddp_spawn"))
    with pytest.raises(PulseRefusal, match="^ScheduledPrune: .*strategy='ddp'"):
        ScheduledPrune(mode="structured").setup(trainer, model, stage="fit")
    with pytest.raises(PulseRefusal, match="make_permanent=False"):
        ScheduledPrune(options=PruneOptions(make_permanent=False)).setup(trainer, model, stage="fit")
    ScheduledPrune().setup(trainer, model, stage="fit")  # masks folded at fit end: fine


def test_no_matching_layer_fails_at_fit_start(mnist1d_small):
    model, data = mnist1d_small()
    trainer = pl.Trainer(max_steps=2, callbacks=[ScheduledPrune(exclude_pattern=".")], **trainer_kwargs())
    with pytest.raises(PulseRefusal, match="^ScheduledPrune: no layer"):
        trainer.fit(model, data)


class RestoreAt(Callback):
    """Saves the model and ScheduledPrune's state after step ``save_at``; loads both back after step
    ``load_at``, during training, as a StabilityGuard rollback does."""

    def __init__(self, prune: ScheduledPrune, save_at: int, load_at: int) -> None:
        self.prune, self.save_at, self.load_at = prune, save_at, load_at
        self.saved: tuple[dict, dict] | None = None
        self.after_load: dict | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.save_at and self.saved is None:
            model_state = {k: v.clone() for k, v in pl_module.state_dict().items()}
            self.saved = (model_state, self.prune.state_dict())
        elif trainer.global_step == self.load_at and self.after_load is None:
            model_state, prune_state = self.saved
            pl_module.load_state_dict(model_state)
            self.prune.load_state_dict(prune_state)
            self.after_load = {
                "events": len(self.prune.events),
                "distill_event": self.prune._window.event_step,
            }


def test_state_loaded_mid_run_redoes_the_undone_event_and_keeps_distillation_consistent(
    mnist1d_small,
):
    pl.seed_everything(0)
    model, data = mnist1d_small()
    prune = ScheduledPrune(
        final_sparsity=0.7, start=10, end=40, every=10, probe_batches=1, distill=DistillConfig()
    )
    # saved after the event at 20 (masks exist, distilling from its teacher); loaded two steps after
    # the event at 30, while its teacher distils
    restore = RestoreAt(prune, save_at=25, load_at=32)
    trainer = pl.Trainer(max_steps=48, callbacks=[prune, restore], **trainer_kwargs())
    trainer.fit(model, data)

    # the event at 30 was undone with the model; the schedule redid it at the next step, at step 33's target
    assert restore.after_load == {"events": 1, "distill_event": 20}
    assert [event["step"] for event in prune.events] == [20, 33, 40]
    assert prune.events[1]["target_sparsity"] == pytest.approx(cubic_sparsity(33, 0.0, 0.7, 10, 40))
    # the redone event distilled from its own teacher; the undone one's calls were not booked onto event 0
    assert prune.events[1]["distill_calls"] > 0
    assert prune.events[-1]["sparsity"] == pytest.approx(0.7, abs=1e-3) and prune.finished


def test_lightning_cli_nests_the_option_and_distillation_configs():
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_class_arguments(ScheduledPrune, "prune")
    config = parser.parse_object(
        {"prune": {"mode": "structured", "distill": {"steps": 3}, "options": {"ranking": "global"}}}
    )
    prune = parser.instantiate(config).prune
    assert prune.distill == DistillConfig(steps=3) and prune.options == PruneOptions(ranking="global")
    assert prune.pruner.ranking == "global" and prune.pruner.mode == "structured"


def test_callback_pickles_for_spawning_strategies():
    import pickle

    prune = pickle.loads(
        pickle.dumps(ScheduledPrune(distill=DistillConfig(), options=PruneOptions(ranking="global")))
    )
    assert prune.pruner.ranking == "global" and prune.distill == DistillConfig()


def test_a_run_resumed_from_a_checkpoint_saved_after_fit_keeps_its_pruned_weights_pruned(
    mnist1d_small, tmp_path, caplog
):
    # held-out sweep: masks are folded into the weights at fit end, so a longer run resumed from a checkpoint
    # saved after fit ("train longer") let the pruned weights grow back while the finished schedule reported 0.5
    def fit(max_steps, ckpt_path=None):
        pl.seed_everything(0)
        model, data = mnist1d_small()
        prune = ScheduledPrune(final_sparsity=0.5, start=0, end=20, every=5, probe_batches=0)
        trainer = pl.Trainer(max_steps=max_steps, callbacks=[prune], **trainer_kwargs())
        trainer.fit(model, data, ckpt_path=ckpt_path)
        return trainer, model, prune

    def layers(model):
        return [m for m in model.modules() if isinstance(m, (torch.nn.Conv1d, torch.nn.Linear))]

    def zero_share(model):
        weights = [layer.weight for layer in layers(model)]
        return sum(int((w == 0).sum()) for w in weights) / sum(w.numel() for w in weights)

    trainer, model, _ = fit(30)
    assert zero_share(model) == pytest.approx(0.5, abs=0.01)
    trainer.save_checkpoint(tmp_path / "after_fit.ckpt")
    with caplog.at_level(logging.INFO):
        trainer, model, prune = fit(60, ckpt_path=tmp_path / "after_fit.ckpt")
    assert trainer.global_step == 60 and prune.finished
    assert sum("pruned zeros masked again" in r.getMessage() for r in caplog.records) == 1  # and said
    assert zero_share(model) == pytest.approx(0.5, abs=0.01)  # 0.0 before: every pruned weight grew back
    assert all(pruning.current_mask(layer) is None for layer in layers(model))  # folded again at fit end


@pytest.mark.parametrize("cadence", ["maintain", "auto"])
def test_a_resume_after_the_last_maintain_start_keeps_the_cadence_of_the_uninterrupted_run(tmp_path, cadence):
    # regression sweep: the fit-start look for a maintain phase ahead ran again at a resume after the last one
    # (step 65, schedule end 66): cadence 'maintain' was refused, 'auto' fell back and pruned once more at 66
    def fit(checkpoints=None, ckpt_path=None):
        pl.seed_everything(0)
        cycle = PulseCycle(burst=10, replay=10, maintain=2, anneal=0.3, maintain_eval="none")
        prune = ScheduledPrune(
            final_sparsity=0.5, start=0, end=66, probe_batches=0, options={"cadence": cadence}
        )
        saving = (
            [ModelCheckpoint(dirpath=checkpoints, every_n_train_steps=65, save_top_k=-1)]
            if checkpoints
            else []
        )
        generator = torch.Generator().manual_seed(0)
        data = torch.utils.data.TensorDataset(
            torch.randn(640, 16, generator=generator), torch.randint(0, 4, (640,), generator=generator)
        )
        trainer = pl.Trainer(
            max_steps=100,
            callbacks=[cycle, prune, *saving],
            **trainer_kwargs(enable_checkpointing=bool(checkpoints)),
        )
        trainer.fit(_LinearClassifier(), DataLoader(data, batch_size=32), ckpt_path=ckpt_path)
        return [event["step"] for event in prune.events]

    uninterrupted = fit(checkpoints=tmp_path)
    assert uninterrupted == [30, 52]
    (checkpoint,) = tmp_path.glob("*step=65*.ckpt")
    assert fit(ckpt_path=checkpoint) == uninterrupted


class _LinearClassifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))

    def training_step(self, batch, batch_idx):
        return torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _CompiledInConfigureModel(MNIST1DClassifier):
    """Compiles its network in ``configure_model``, which Lightning calls after the callbacks' ``setup``."""

    def configure_model(self) -> None:
        if not isinstance(self.net, torch._dynamo.eval_frame.OptimizedModule):
            self.net = torch.compile(self.net, backend="eager")


@pytest.mark.parametrize("how", ["submodule", "whole-module", "in-configure-model"])
def test_structured_mode_on_a_compiled_model_is_refused_before_the_first_step_naming_torch_compile(
    mnist1d_small, how
):
    """A compiled submodule was refused with dynamo's internal assertion ("UnspecializedNNModuleVariable(...) is
    already tracked for mutation") and an `exclude_pattern` hint that could not help; `trainer.fit(torch.compile(
    module))` with a false "no channel group of the selected layers can be cut safely"."""
    torch._dynamo.reset()
    model, data = mnist1d_small()
    if how == "submodule":
        model.net = torch.compile(model.net, backend="eager")
    elif how == "in-configure-model":
        model = _CompiledInConfigureModel(arch="cnn")
    fitted = torch.compile(model, backend="eager") if how == "whole-module" else model
    prune = ScheduledPrune(mode="structured", start=2, end=4, every=1)
    steps = StepCounter()
    trainer = pl.Trainer(max_steps=6, callbacks=[prune, steps], **trainer_kwargs())
    part = "the LightningModule" if how == "whole-module" else "`net`"
    with pytest.raises(
        PulseRefusal, match=rf"^ScheduledPrune: mode='structured' .*torch\.compile \({part} is"
    ) as e:
        trainer.fit(fitted, data)
    assert "mode='unstructured'" in str(e.value) and "compile it after pruning" in str(e.value)
    assert steps.batches == 0 and prune.events == []


class StepCounter(Callback):
    def __init__(self) -> None:
        self.batches = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches += 1


class CompiledAgainstEager(Callback):
    """After each step, the compiled network's output against its uncompiled module's (whose pruning hooks
    apply the masks) on a fixed input."""

    def __init__(self) -> None:
        self.gaps: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        x = batch[0][:8]
        with torch.no_grad():
            self.gaps.append((pl_module.net(x) - pl_module.net._orig_mod(x)).abs().max().item())


def test_unstructured_mode_prunes_a_compiled_submodule_and_the_compiled_forward_uses_the_masks(mnist1d_small):
    """What the refusal of structured mode points to: masks are added to the layers of a compiled network
    mid-run and the compiled forward uses them at every step after each event."""
    torch._dynamo.reset()
    model, data = mnist1d_small()
    model.net = torch.compile(model.net, backend="eager")
    prune = ScheduledPrune(final_sparsity=0.5, start=2, end=10, every=1, probe_batches=0)
    check = CompiledAgainstEager()
    trainer = pl.Trainer(max_steps=14, callbacks=[prune, check], **trainer_kwargs())
    trainer.fit(model, data)
    assert prune.events[-1]["sparsity"] == pytest.approx(0.5, abs=0.01) and len(check.gaps) == 14
    assert max(check.gaps) < 1e-5
    layers = [m for m in model.net._orig_mod.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv1d))]
    zeros = sum(int((m.weight == 0).sum()) for m in layers) / sum(m.weight.numel() for m in layers)
    assert zeros == pytest.approx(0.5, abs=0.02)  # the masks, folded at fit end


class _CompiledTeacher(pl.LightningModule):
    """A network to prune, and a compiled teacher used in ``training_step`` only (left out of the pruning)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
        self.teacher = torch.compile(torch.nn.Linear(10, 2), backend="eager")

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self(x)
        with torch.no_grad():
            target = self.teacher(x)
        return torch.nn.functional.cross_entropy(out, y) + 0.1 * (out - target).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_structured_mode_prunes_a_model_whose_only_compiled_part_holds_no_layer_to_prune():
    # the pass's second review: the first form of the refusal above refused any compiled part anywhere in the
    # model, so a compiled teacher left out with `exclude_pattern` stopped a run the code before it pruned
    torch._dynamo.reset()
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(256, 10, generator=generator)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long()), batch_size=32)
    model = _CompiledTeacher()
    prune = ScheduledPrune(
        mode="structured",
        final_sparsity=0.5,
        start=2,
        end=6,
        every=1,
        probe_batches=0,
        exclude_pattern="teacher",
    )
    pl.Trainer(max_steps=10, callbacks=[prune], **trainer_kwargs()).fit(model, data)
    assert len(prune.events) == 4 and model.net[0].weight.shape[0] < 32  # channels were cut
    assert tuple(model.teacher._orig_mod.weight.shape) == (2, 10)


def _masked_parts(layer: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """``(the trained tensor, its mask)``: ``weight_orig`` and ``weight_mask``, or ``weight`` and ones."""
    if pruning.current_mask(layer) is not None:
        return layer.weight_orig, layer.weight_mask
    return layer.weight, torch.ones_like(layer.weight)


class _ReadsWeightBeforeCall(pl.LightningModule):
    """Reads its first layer's ``weight`` before calling the layer, in training (an L2 penalty on that layer,
    and a statistic without autograd) and in validation; records whether each read was the current masked
    weight."""

    def __init__(self, penalty: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        self.penalty = penalty
        self.reads: list[tuple[str, int, bool]] = []  # (stage, global step, the read was current)
        self.batch: tuple[torch.Tensor, torch.Tensor] | None = None

    def _read(self, stage: str) -> None:
        orig, mask = _masked_parts(self.net[0])
        with torch.no_grad():
            current = torch.equal(self.net[0].weight, orig * mask)
        self.reads.append((stage, self.global_step, current))

    def training_step(self, batch, batch_idx):
        self._read("train")
        self.batch = batch
        x, y = batch
        reg = self.penalty * self.net[0].weight.pow(2).sum() if self.penalty else 0.0
        return torch.nn.functional.cross_entropy(self.net(x), y) + reg

    def validation_step(self, batch, batch_idx):
        self._read("val")
        return torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


class ExplicitMaskedGradient(Callback):
    """At each optimizer step, the largest gap between the first layer's gradient and the one an explicit
    computation with ``W = weight_orig * weight_mask`` gives on the same batch."""

    def __init__(self) -> None:
        self.gaps: list[tuple[int, float]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        (x, y), first, last = pl_module.batch, pl_module.net[0], pl_module.net[2]
        trained, mask = _masked_parts(first)
        leaf = trained.detach().clone().requires_grad_(True)
        weight = leaf * mask
        hidden = torch.relu(torch.nn.functional.linear(x, weight, first.bias.detach()))
        out = torch.nn.functional.linear(hidden, pruning.effective_weight(last), last.bias.detach())
        loss = torch.nn.functional.cross_entropy(out, y) + pl_module.penalty * weight.pow(2).sum()
        (expected,) = torch.autograd.grad(loss, leaf)
        self.gaps.append((trainer.global_step, (trained.grad - expected).abs().max().item()))


def _read_before_call_fit(
    penalty: float, callbacks: list[Callback]
) -> tuple[_ReadsWeightBeforeCall, ScheduledPrune]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(512, 16, generator=generator)
    y = (x @ torch.randn(16, 4, generator=generator)).argmax(1)
    data = DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32)
    prune = ScheduledPrune(final_sparsity=0.5, start=6, end=18, every=3, probe_batches=0)
    model = _ReadsWeightBeforeCall(penalty)
    trainer = pl.Trainer(max_steps=30, limit_val_batches=2, callbacks=[prune, *callbacks], **trainer_kwargs())
    trainer.fit(model, data, data)
    return model, prune


def test_a_weight_read_before_its_layer_is_called_trains_through_the_events_with_the_masked_gradient():
    """Sweep C: an L2 penalty on a pruned layer, read before the layer's call, used last step's tensor
    (torch's mask hook recomputes `weight` only in the layer's call), so the fit crashed with "Trying to
    backward through the graph a second time" one step after the first event."""
    check = ExplicitMaskedGradient()
    model, prune = _read_before_call_fit(1e-2, [check])
    assert [event["step"] for event in prune.events] == [9, 12, 15, 18]
    assert len(check.gaps) == 30 and max(gap for _, gap in check.gaps) < 1e-6
    assert all(current for _, _, current in model.reads)  # the penalty read this step's masked weight too


def test_a_weight_read_without_grad_before_its_layer_is_called_sees_the_current_masked_weights():
    """The same read without autograd (a max-norm statistic), in training and validation: it silently saw the
    weight of the layer's last call, before the optimizer step (and before an event's new mask)."""
    model, prune = _read_before_call_fit(0.0, [])
    after_events = [(stage, step) for stage, step, _ in model.reads if step > prune.events[0]["step"]]
    assert {stage for stage, _ in after_events} == {"train", "val"}
    assert [(stage, step) for stage, step, current in model.reads if not current] == []


class _EmbeddingNormNet(pl.LightningModule):
    """Token ids -> embedding (mean over positions) -> Linear, LayerNorm, Linear, BatchNorm1d -> 4 classes."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(50, 16)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(16, 32),
            torch.nn.LayerNorm(32),
            torch.nn.ReLU(),
            torch.nn.Linear(32, 32),
            torch.nn.BatchNorm1d(32),
            torch.nn.ReLU(),
            torch.nn.Linear(32, 4),
        )

    def forward(self, ids):
        return self.net(self.emb(ids).mean(1))

    def training_step(self, batch, batch_idx):
        return torch.nn.functional.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _token_data(length: int = 6) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50, (256, length), generator=generator)
    return DataLoader(torch.utils.data.TensorDataset(ids, ids[:, 0] % 4), batch_size=32)


def test_structured_mode_with_layer_types_none_cuts_every_layer_that_makes_channels_and_reports_them():
    """Sweep B: `layer_types=None` (documented: any layer with a weight) crashed at the first batch in
    structured mode with "`layer_types`=() names no layer type", for every model: the trial cut resolved the
    resolved types again. The norm layers, which `None` also chooses, led the channel groups in the place of
    the layers before them (reported uncut while cut; a LayerNorm has no channel count), and an embedding's
    sparsity was read from its rows."""
    model = _EmbeddingNormNet()
    prune = ScheduledPrune(
        final_sparsity=0.5, mode="structured", start=2, end=6, every=2, probe_batches=0, layer_types=None
    )
    pl.Trainer(max_steps=8, callbacks=[prune], **trainer_kwargs()).fit(model, _token_data())
    last = prune.events[-1]
    assert last["layer_sparsity"] == {"emb": 0.5, "net.0": 0.5, "net.3": 0.5} and last["sparsity"] == 0.5
    assert last["uncut_layers"] == ["net.6"]  # its outputs are the logits
    assert tuple(model.emb.weight.shape) == (50, 8)
    assert [model.net[i].out_features for i in (0, 3, 6)] == [16, 16, 4]
    assert tuple(model.net[1].weight.shape) == (16,) and model.net[4].num_features == 16


class _FrozenProjectionWithStatistics(pl.LightningModule):
    """A trainable layer, then a frozen projection whose outputs are scaled by fixed per-channel statistics (a
    buffer: a cut of the projection's outputs breaks the product), then the head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = torch.nn.Linear(16, 32)
        self.projection = torch.nn.Linear(32, 32).requires_grad_(False)
        self.register_buffer("scale", torch.rand(32) + 0.5)
        self.head = torch.nn.Linear(32, 4)

    def forward(self, x):
        return self.head(torch.relu(self.projection(torch.relu(self.encoder(x)))) * self.scale)

    def training_step(self, batch, batch_idx):
        return torch.nn.functional.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)


def test_the_structured_check_leaves_out_the_layers_the_user_froze_as_the_cuts_do():
    """The trial cut at fit start chose its layers without the user-frozen set, so it cut a frozen layer that
    the events never cut, and refused this run ("pruning a copy of the model failed") for a cut that never
    comes."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(256, 16, generator=generator)
    data = DataLoader(torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long()), batch_size=32)
    model = _FrozenProjectionWithStatistics()
    prune = ScheduledPrune(final_sparsity=0.5, mode="structured", start=2, end=6, every=2, probe_batches=0)
    pl.Trainer(max_steps=8, callbacks=[prune], **trainer_kwargs()).fit(model, data)
    assert prune.events[-1]["layer_sparsity"] == {"encoder": 0.5}
    assert model.encoder.out_features == 16 and model.projection.out_features == 32


class _CheckpointedBlocks(pl.LightningModule):
    """Embedding -> residual MLP blocks run under activation checkpointing -> LayerNorm -> head."""

    def __init__(
        self, how: str, use_reentrant: bool, mlp_head: bool = False, frozen: str | None = None
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.how, self.use_reentrant = how, use_reentrant
        self.emb = torch.nn.Embedding(50, 16)
        self.blocks = torch.nn.Sequential(*[_ResidualMLP(16) for _ in range(2)])
        self.norm = torch.nn.LayerNorm(16)
        self.head = (
            torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
            if mlp_head
            else torch.nn.Linear(16, 4)
        )
        if frozen is not None:
            self.get_submodule(frozen).requires_grad_(False)

    def forward(self, ids):
        h = self.emb(ids)
        if self.how == "checkpoint_sequential":
            h = torch.utils.checkpoint.checkpoint_sequential(
                self.blocks, 2, h, use_reentrant=self.use_reentrant
            )
        else:
            for block in self.blocks:
                h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=self.use_reentrant)
        return self.head(self.norm(h).mean(1))

    def training_step(self, batch, batch_idx):
        return torch.nn.functional.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)


class _ResidualMLP(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.ln = torch.nn.LayerNorm(width)
        self.up, self.down = torch.nn.Linear(width, 2 * width), torch.nn.Linear(2 * width, width)

    def forward(self, h):
        return h + self.down(torch.relu(self.up(self.ln(h))))


@pytest.mark.parametrize("how", ["checkpoint", "checkpoint_sequential"])
def test_structured_mode_under_reentrant_checkpointing_is_refused_naming_use_reentrant_false(how):
    """Sweep A: the refusal blamed the model ("no channel group ... give the module a `forward`", or "it broke
    in blocks.0.ln ... `exclude_pattern`"): torch-pruning cannot see inside a reentrant checkpoint, whose
    forward runs without autograd. The way out it names, use_reentrant=False, prunes the same model."""
    steps = StepCounter()
    prune = ScheduledPrune(final_sparsity=0.5, mode="structured", start=2, end=6, every=2, probe_batches=0)
    trainer = pl.Trainer(max_steps=8, callbacks=[prune, steps], **trainer_kwargs())
    with pytest.raises(PulseRefusal, match=r"^ScheduledPrune: structured pruning cannot run") as refused:
        trainer.fit(_CheckpointedBlocks(how, use_reentrant=True), _token_data())
    message = str(refused.value)
    assert "reentrant activation checkpointing" in message and "Pass use_reentrant=False" in message
    assert "exclude_pattern" not in message and "give the module" not in message
    assert steps.batches == 0 and prune.events == []
    model = _CheckpointedBlocks(how, use_reentrant=False)
    prune = ScheduledPrune(final_sparsity=0.5, mode="structured", start=2, end=6, every=2, probe_batches=0)
    pl.Trainer(max_steps=8, callbacks=[prune], **trainer_kwargs()).fit(model, _token_data())
    assert prune.events[-1]["sparsity"] == 0.5 and model.blocks[0].up.out_features == 16


def _fit_structured(model: pl.LightningModule, data: DataLoader, **options) -> ScheduledPrune:
    prune = ScheduledPrune(
        final_sparsity=0.5, mode="structured", start=2, end=6, every=2, probe_batches=0, **options
    )
    pl.Trainer(max_steps=8, callbacks=[prune], **trainer_kwargs()).fit(model, data)
    return prune


def test_reentrant_checkpointed_layers_are_refused_even_when_the_trial_cut_of_the_others_passes():
    """Review: the refusal covered only a failing trial cut; with an MLP head the trial cut passed (it cut
    head.0) and the checkpointed blocks were left uncut, reported as "no channel group of theirs can be cut
    safely". The check now sees, on the trial's copy, which chosen layers ran with autograd off."""
    with pytest.raises(PulseRefusal, match="reentrant activation checkpointing") as refused:
        _fit_structured(_CheckpointedBlocks("checkpoint", use_reentrant=True, mlp_head=True), _token_data())
    assert "(blocks.0.down, blocks.0.up, blocks.1.down and 1 more)" in str(refused.value)
    assert "Pass use_reentrant=False" in str(refused.value)
    model = _CheckpointedBlocks("checkpoint", use_reentrant=False, mlp_head=True)
    prune = _fit_structured(model, _token_data())
    assert model.blocks[0].up.out_features == 16 and model.head[0].out_features == 32
    assert {"blocks.0.up", "blocks.1.up", "head.0"} <= set(prune.events[-1]["layer_sparsity"])


def test_layers_run_with_autograd_off_and_no_checkpoint_node_are_refused_naming_exclude_pattern():
    """Review: a reentrant checkpoint whose input needs no grad (after a frozen embedding) leaves no
    CheckpointFunctionBackward node in the graph, so that detection missed it (and these blocks get no
    gradient in training either): the refusal names the layers, a `torch.no_grad()` block or such a
    checkpoint, and `exclude_pattern`."""
    model = _CheckpointedBlocks("checkpoint", use_reentrant=True, mlp_head=True, frozen="emb")
    with pytest.raises(PulseRefusal, match="with autograd off") as refused:
        _fit_structured(model, _token_data())
    message = str(refused.value)
    assert "(blocks.0.down, blocks.0.up, blocks.1.down and 1 more)" in message
    assert "Leave these layers out with `exclude_pattern`" in message


def test_a_frozen_backbone_under_reentrant_checkpointing_still_prunes_the_layers_after_it():
    """The layers the user froze are not chosen, so running them with autograd off refuses nothing."""
    model = _CheckpointedBlocks("checkpoint", use_reentrant=True, mlp_head=True, frozen="blocks")
    prune = _fit_structured(model, _token_data())
    assert prune.events[-1]["layer_sparsity"] == {"head.0": 0.5} and model.head[0].out_features == 32


class _FrozenResidualBranch(pl.LightningModule):
    """h = relu(encoder(x)); h = h + frozen(h); head(h): every cut of the encoder's outputs cuts the frozen
    layer's outputs too (the residual sum)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = torch.nn.Linear(16, 32)
        self.frozen = torch.nn.Linear(32, 32).requires_grad_(False)
        self.head = torch.nn.Linear(32, 4)

    def forward(self, x):
        h = torch.relu(self.encoder(x))
        return self.head(h + self.frozen(h))

    def training_step(self, batch, batch_idx):
        return torch.nn.functional.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)


def test_a_run_whose_every_channel_group_cuts_a_frozen_layer_is_refused_naming_the_frozen_layer():
    """Review: the refusal said "no channel group ... give the module a `forward`", not the cause: the only
    group also cuts the layer the user froze. Cutting without the frozen set passes, so that is named."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(128, 16, generator=generator)
    data = DataLoader(torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long()), batch_size=32)
    with pytest.raises(PulseRefusal, match="also cuts a layer you froze") as refused:
        _fit_structured(_FrozenResidualBranch(), data)
    message = str(refused.value)
    assert "(`requires_grad=False`: frozen)" in message and "Unfreeze those layers" in message
    assert "give the module" not in message


class _FrozenNormConvNet(pl.LightningModule):
    """Conv, a BatchNorm the user froze, ReLU, [Conv, ReLU,] pool, Linear: the first conv's channel group cuts
    the frozen norm with it."""

    def __init__(self, second_conv: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        middle = [torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.ReLU()] if second_conv else []
        self.net = torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3, padding=1),
            torch.nn.BatchNorm2d(8).requires_grad_(False),
            torch.nn.ReLU(),
            *middle,
            torch.nn.AdaptiveAvgPool2d(1),
            torch.nn.Flatten(),
            torch.nn.Linear(8, 4),
        )

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        return torch.nn.functional.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)


def _image_data() -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(96, 3, 8, 8, generator=generator)
    return DataLoader(
        torch.utils.data.TensorDataset(x, torch.randint(0, 4, (96,), generator=generator)), batch_size=16
    )


def test_a_norm_the_user_froze_is_not_cut_with_the_layer_before_it():
    """Review: only frozen layers of the chosen types were kept out of the cut, so a frozen BatchNorm went
    from 8 to 4 features with the conv before it. A group that cuts a frozen layer's channels is left uncut."""
    model = _FrozenNormConvNet()
    norm_before = {name: value.clone() for name, value in model.net[1].named_parameters()}
    prune = _fit_structured(model, _image_data())
    assert model.net[1].num_features == 8 and model.net[0].out_channels == 8
    assert all(torch.equal(value, norm_before[name]) for name, value in model.net[1].named_parameters())
    assert model.net[3].out_channels == 4 and prune.events[-1]["uncut_layers"] == ["net.0", "net.7"]


def test_a_run_whose_only_channel_group_cuts_a_frozen_norm_is_refused_naming_the_norm():
    with pytest.raises(PulseRefusal, match="also cuts a layer you froze") as refused:
        _fit_structured(_FrozenNormConvNet(second_conv=False), _image_data())
    assert "(`requires_grad=False`: net.1)" in str(refused.value)


class _UserRMSNorm(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(width))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class _UserNormNet(pl.LightningModule):
    """Linear, a user's RMSNorm, Linear, ReLU, Linear."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(16, 32),
            _UserRMSNorm(32),
            torch.nn.Linear(32, 64),
            torch.nn.ReLU(),
            torch.nn.Linear(64, 4),
        )

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        return torch.nn.functional.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_layer_types_none_leaves_out_a_norm_of_any_class_by_its_one_dimensional_weight():
    """Review: the norms left out were a fixed list of torch classes; a user's (or Hugging Face's) RMSNorm was
    chosen, counted at setup and reported "left uncut". A weight of fewer than two dimensions is a per-channel
    scale, cut with the layer before it."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(128, 16, generator=generator)
    data = DataLoader(torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long()), batch_size=32)
    model = _UserNormNet()
    prune = _fit_structured(model, data, layer_types=None)
    assert prune.events[-1]["layer_sparsity"] == {"net.2": 0.5} and model.net[2].out_features == 32
    # net.0: torch-pruning holds the norm's weight as a bare parameter, which no cut touches; net.4: the
    # logits
    assert prune.events[-1]["uncut_layers"] == ["net.0", "net.4"]


class _LBFGSClassifier(MNIST1DClassifier):
    def configure_optimizers(self):
        return torch.optim.LBFGS(self.parameters(), lr=0.1, max_iter=3)


def test_structured_cuts_next_to_lbfgs_reset_its_history_and_training_goes_on():
    """Held-out: LBFGS's first step after a channel cut failed mid-run ("Expected offset 724 to equal 1732"):
    its history, flat vectors over all parameters, kept the old total size."""
    pl.seed_everything(0)
    model = _LBFGSClassifier()
    train, _ = _fixed_order_loaders(MNIST1DDataModule(num_samples=1000, batch_size=64))
    prune = ScheduledPrune(final_sparsity=0.5, mode="structured", start=2, end=8, every=3, probe_batches=0)
    trainer = pl.Trainer(max_steps=12, callbacks=[prune], **trainer_kwargs(max_epochs=-1))
    with pytest.warns(UserWarning, match=re.escape(pruning.LBFGS_RESET)) as said:
        trainer.fit(model, train)
    assert trainer.global_step == 12 and [event["step"] for event in prune.events] == [5, 8]
    assert [model.net[i].out_channels for i in (1, 3, 5)] == [13, 13, 13]
    optimizer = trainer.optimizers[0]
    assert optimizer.state[model.net[1].weight]["d"].numel() == sum(p.numel() for p in model.parameters())
    assert torch.isfinite(trainer.callback_metrics["train_loss"])
    assert sum(pruning.LBFGS_RESET in str(w.message) for w in said) == 2  # at each cut


def _true_precision_fit(path, precision: str, ckpt_path=None) -> MNIST1DClassifier:
    pl.seed_everything(0)
    model = MNIST1DClassifier()
    train, _ = _fixed_order_loaders(MNIST1DDataModule(num_samples=1000, batch_size=64))
    callbacks = [
        ScheduledPrune(final_sparsity=0.5, mode="structured", start=2, end=18, every=4, probe_batches=0)
    ]
    if ckpt_path is None:  # at the first epoch's last batch (12 batches), after the cuts at steps 6 and 10
        callbacks.append(
            ModelCheckpoint(dirpath=path, every_n_train_steps=12, save_top_k=-1, filename="{step}")
        )
    kwargs = trainer_kwargs(max_epochs=-1, precision=precision, enable_checkpointing=ckpt_path is None)
    trainer = pl.Trainer(max_steps=20, callbacks=callbacks, **kwargs)
    trainer.fit(model, train, ckpt_path=ckpt_path)
    return model


@pytest.mark.parametrize("precision", ["bf16-true", "64-true"])
def test_a_structured_run_under_true_precision_resumes_into_a_fresh_module_like_the_uninterrupted_run(
    tmp_path, precision
):
    """Held-out: the resume failed while the checkpoint loaded ("mat1 and mat2 must have the same dtype"): the
    recorded trace input is in the run's precision, and Lightning restores the module before converting it."""
    uninterrupted = _true_precision_fit(tmp_path, precision)
    checkpoint = tmp_path / "step=12.ckpt"
    assert (
        torch.load(checkpoint, weights_only=False)["state_dict"]["net.1.weight"].shape[0] < 25
    )  # cut by then
    resumed = _true_precision_fit(tmp_path, precision, ckpt_path=str(checkpoint))
    full, resumed_state = uninterrupted.state_dict(), resumed.state_dict()
    assert resumed_state.keys() == full.keys()
    # 64-true: Lightning loads the float64 checkpoint into the float32 module it converts only afterwards
    tolerance = 0.0 if precision == "bf16-true" else 1e-6
    for key in full:
        assert resumed_state[key].dtype == full[key].dtype, key
        assert torch.allclose(resumed_state[key], full[key], rtol=0.0, atol=tolerance), key


class _Float32StemBfloat16Body(_LinearClassifier):
    """A float32 stem before a bfloat16 body holding most of the parameter elements; forward casts between."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = torch.nn.Linear(16, 32)
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)).to(
            torch.bfloat16
        )

    def forward(self, x):
        return self.net(torch.relu(self.stem(x)).to(torch.bfloat16)).float()

    def training_step(self, batch, batch_idx):
        return torch.nn.functional.cross_entropy(self(batch[0]), batch[1])


def test_a_float32_stem_before_a_bfloat16_body_is_pruned_under_32_true_and_resumes(tmp_path):
    """Review: under 32-true such a model was refused at fit start ("the model does not run on the example
    it is traced with ... mat1 and mat2 must have the same dtype"): the trace input went to bfloat16, the
    dtype of most parameter elements, which the float32 stem does not take; a resume failed the same way."""

    def fit(ckpt_path=None) -> _Float32StemBfloat16Body:
        pl.seed_everything(0)
        model = _Float32StemBfloat16Body()
        prune = ScheduledPrune(
            final_sparsity=0.5, mode="structured", start=2, end=10, every=2, probe_batches=0
        )
        callbacks: list[Callback] = [prune]
        if ckpt_path is None:  # at the first epoch's end (6 batches), after the cuts at steps 2, 4 and 6
            callbacks.append(ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=6, save_top_k=-1))
        kwargs = trainer_kwargs(max_epochs=-1, precision="32-true", enable_checkpointing=ckpt_path is None)
        trainer = pl.Trainer(max_steps=12, callbacks=callbacks, **kwargs)
        trainer.fit(model, _linear_data(samples=192), ckpt_path=ckpt_path)
        return model

    uninterrupted = fit()
    assert (uninterrupted.stem.out_features, uninterrupted.net[0].out_features) == (16, 32)
    assert (
        uninterrupted.stem.weight.dtype == torch.float32
        and uninterrupted.net[0].weight.dtype == torch.bfloat16
    )
    (checkpoint,) = tmp_path.glob("*step=6.ckpt")
    resumed = fit(str(checkpoint))
    full = uninterrupted.state_dict()
    assert all(torch.equal(value, full[key]) for key, value in resumed.state_dict().items())


@pytest.mark.parametrize("precision", ["bf16-true", "64-true"])
def test_a_float32_example_input_array_is_traced_in_the_precision_of_the_run(precision):
    """Held-out: under bf16-true / 64-true a CNN with a float32 `example_input_array` was refused at fit start
    ("the model does not run on the example it is traced with ... give the LightningModule an
    `example_input_array`", which it had); Lightning converts the batches, never that example."""
    pl.seed_everything(0)
    model = MNIST1DClassifier()
    model.example_input_array = torch.randn(2, 40)
    train, _ = _fixed_order_loaders(MNIST1DDataModule(num_samples=1000, batch_size=64))
    prune = ScheduledPrune(final_sparsity=0.5, mode="structured", start=2, end=6, every=2, probe_batches=0)
    trainer = pl.Trainer(max_steps=8, callbacks=[prune], **trainer_kwargs(max_epochs=-1, precision=precision))
    trainer.fit(model, train)
    assert [model.net[i].out_channels for i in (1, 3, 5)] == [13, 13, 13]
    assert model.example_input_array.dtype == torch.float32  # the user's example is left as it was


class _LazyClassifier(_LinearClassifier):
    """Two ``nn.LazyLinear`` layers: their weights exist only after the first forward (the second's input is
    the first's output, so a structured cut changes both its shapes)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.LazyLinear(32),
            torch.nn.ReLU(),
            torch.nn.LazyLinear(32),
            torch.nn.ReLU(),
            torch.nn.Linear(32, 4),
        )

    def forward(self, x):
        return self.net(x)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", torch.nn.functional.cross_entropy(self(batch[0]), batch[1]))


def _lazy_fit(mode: str, sanity_check: bool, path: Path | None = None, ckpt_path=None, watch=None):
    pl.seed_everything(0)
    model = _LazyClassifier()
    prune = ScheduledPrune(0.5, mode=mode, start=2, end=10, every=2, probe_batches=0)
    callbacks: list[Callback] = [prune] + ([watch] if watch is not None else [])
    if path is not None:  # at the first epoch's end (6 batches), after the cuts at steps 4 and 6
        callbacks.append(ModelCheckpoint(dirpath=path, every_n_train_steps=6, save_top_k=-1))
    kwargs = trainer_kwargs(max_epochs=-1, enable_checkpointing=path is not None)
    if sanity_check:
        kwargs.update(num_sanity_val_steps=1, limit_val_batches=1)
    trainer = pl.Trainer(max_steps=12, callbacks=callbacks, **kwargs)
    data = _linear_data(samples=192)
    trainer.fit(model, data, data if sanity_check else None, ckpt_path=ckpt_path)
    return model, prune, trainer


@pytest.mark.parametrize("mode", ["unstructured", "structured"])
def test_a_lazy_model_whose_weights_no_sanity_check_created_is_refused_before_the_first_step(mode):
    """Held-out: without a validation loader ScheduledPrune crashed at fit start with torch's "Attempted to use
    an uninitialized parameter in numel", naming neither the callback nor the way out."""
    with pytest.raises(PulseRefusal) as caught:
        _lazy_fit(mode, sanity_check=False)
    message = str(caught.value)
    assert message.startswith("ScheduledPrune: the model's net.0.weight, net.0.bias, net.2.weight and 1 more")
    assert "`setup` or `configure_model`" in message
    assert "whose `validation_step` runs the forward (num_sanity_val_steps > 0)" in message


@pytest.mark.parametrize("mode", ["unstructured", "structured"])
def test_a_lazy_model_whose_weights_the_sanity_check_created_is_pruned(mode):
    model, prune, trainer = _lazy_fit(mode, sanity_check=True)
    assert [event["step"] for event in prune.events] == [4, 6, 8, 10] and trainer.global_step == 12
    if mode == "structured":
        assert (model.net[0].out_features, model.net[2].weight.shape) == (16, (16, 16))
    else:
        assert (model.net[0].weight == 0).float().mean().item() == pytest.approx(0.5, abs=0.01)


class WeightsAtTrainStart(Callback):
    def on_train_start(self, trainer, pl_module):
        self.state = {key: value.clone() for key, value in pl_module.state_dict().items()}


@pytest.mark.parametrize("mode", ["unstructured", "structured"])
def test_a_pruned_lazy_model_resumes_into_a_fresh_module_and_loads_with_load_pruned(tmp_path, mode):
    """Held-out: both failed while the checkpoint loaded ("Attempted to use an uninitialized parameter in
    ones_like" unstructured, "Can't access the shape of an uninitialized parameter" structured): the pruned
    state is fitted to the module before torch's lazy load hook creates its weights."""
    uninterrupted, _, _ = _lazy_fit(mode, sanity_check=True, path=tmp_path)
    (checkpoint,) = tmp_path.glob("*step=6.ckpt")
    saved = torch.load(checkpoint, weights_only=False)["state_dict"]
    loaded = ScheduledPrune.load_pruned(_LazyClassifier(), checkpoint).state_dict()
    assert loaded.keys() == saved.keys() and all(torch.equal(loaded[key], saved[key]) for key in saved)
    # no sanity check in the resumed run: the restore itself creates the lazy weights
    watch = WeightsAtTrainStart()
    resumed, prune, trainer = _lazy_fit(mode, sanity_check=False, ckpt_path=str(checkpoint), watch=watch)
    assert watch.state.keys() == saved.keys() and all(
        torch.equal(watch.state[key], saved[key]) for key in saved
    )
    assert [event["step"] for event in prune.events] == [4, 6, 8, 10] and trainer.global_step == 12
    full = uninterrupted.state_dict()
    assert all(torch.equal(value, full[key]) for key, value in resumed.state_dict().items())


class _TwoLayerClassifier(_LinearClassifier):
    """``_LinearClassifier`` with a ``forward`` (the structured trace calls it), its layers in ``dtype``."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.net.to(dtype)

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        return torch.nn.functional.cross_entropy(self(batch[0]).float(), batch[1])


@pytest.mark.parametrize(
    ("precision", "model_dtype"), [("32-true", torch.bfloat16), ("bf16-mixed", torch.float32)]
)
def test_bfloat16_batches_are_traced_as_the_precision_plugin_hands_them_over(precision, model_dtype):
    """Review: under 32-true a model the user put in bfloat16, whose loader yields bfloat16, was refused at
    fit start ("mat1 and mat2 must have the same dtype"): the trace input went up to float32, which only a
    mixed plugin's autocast (the trace runs outside it) wants. Under bf16-mixed a float32 model still gets
    float32."""
    pl.seed_everything(0)
    model = _TwoLayerClassifier(model_dtype)
    x, y = _linear_data(samples=192).dataset.tensors
    data = DataLoader(torch.utils.data.TensorDataset(x.bfloat16(), y), batch_size=32)
    prune = ScheduledPrune(final_sparsity=0.5, mode="structured", start=2, end=6, every=2, probe_batches=0)
    trainer = pl.Trainer(max_steps=8, callbacks=[prune], **trainer_kwargs(max_epochs=-1, precision=precision))
    trainer.fit(model, data)
    assert model.net[0].out_features == 16 and model.net[0].weight.dtype == model_dtype


class FrozenAtEvents(Callback):
    """Records whether the first layer was frozen when each structured event replaced its parameters."""

    def __init__(self) -> None:
        self.frozen: list[bool] = []

    def on_pulse_parameters_replaced(self, trainer, pl_module, remap):
        self.frozen.append(not pl_module.net[0].weight.requires_grad)


def test_a_layer_gradient_cache_froze_for_the_light_phases_is_cut_at_the_maintain_events():
    """Held-out sweep: the events come at maintain starts, when a GradientCache has its stable prefix frozen;
    the frozen first layer, fed by data that needs no grad, left no autograd node for the trace, so it was
    never cut and every event line said "sparsity 0.500 (target 0.500)" while naming it "left uncut"."""
    from lightning_pulse import GradientCache

    def fit(with_cache: bool) -> tuple[_TwoLayerClassifier, ScheduledPrune, FrozenAtEvents]:
        pl.seed_everything(0)
        model, watch = _TwoLayerClassifier(), FrozenAtEvents()
        cycle = PulseCycle(burst=8, replay=6, maintain=2, maintain_eval="none")
        prune = ScheduledPrune(final_sparsity=0.5, mode="structured", probe_batches=0)
        callbacks: list[Callback] = [cycle, prune, watch]
        if with_cache:
            callbacks.append(GradientCache(threshold=1.0, check_every=2, freeze_for=10))
        trainer = pl.Trainer(max_steps=60, callbacks=callbacks, **trainer_kwargs(max_epochs=-1))
        trainer.fit(model, _linear_data(samples=320))
        return model, prune, watch

    plain, _, _ = fit(with_cache=False)
    model, prune, watch = fit(with_cache=True)
    assert any(watch.frozen)  # the cache had the layer frozen at an event
    assert model.net[0].out_features == plain.net[0].out_features == 16
    assert "net.0" not in prune.events[-1]["uncut_layers"]


class _FrozenStemAndNorm(_TwoLayerClassifier):
    """Linear (frozen by the user), ReLU, Linear, LayerNorm (frozen by the user), ReLU, Linear, ReLU,
    Linear."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        linear = torch.nn.Linear
        self.net = torch.nn.Sequential(
            linear(16, 32), torch.nn.ReLU(), linear(32, 32), torch.nn.LayerNorm(32), torch.nn.ReLU(),
            linear(32, 32), torch.nn.ReLU(), linear(32, 4),
        )  # fmt: skip
        self.net[0].requires_grad_(False)
        self.net[3].requires_grad_(False)

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)


@pytest.mark.parametrize("with_cache", [False, True])
def test_a_layer_norm_the_user_froze_is_not_cut_at_maintain_events_with_or_without_gradient_cache(with_cache):
    """Review: the user-frozen LayerNorm after net.2 was cut to 16 features with it (with a GradientCache too,
    once the trace saw the layers the cache froze). Its group is now left uncut; net.5's is cut."""
    from lightning_pulse import GradientCache

    pl.seed_everything(0)
    model = _FrozenStemAndNorm()
    norm_before = model.net[3].weight.detach().clone()
    cycle = PulseCycle(burst=8, replay=6, maintain=2, maintain_eval="none")
    prune = ScheduledPrune(final_sparsity=0.5, mode="structured", probe_batches=0)
    callbacks: list[Callback] = [cycle, prune]
    if with_cache:
        callbacks.append(GradientCache(threshold=1.0, check_every=2, freeze_for=10))
    pl.Trainer(max_steps=60, callbacks=callbacks, **trainer_kwargs(max_epochs=-1)).fit(
        model, _linear_data(320)
    )
    assert prune.pruner.user_frozen == {"net.0", "net.3"}
    assert model.net[3].normalized_shape == (32,) and torch.equal(model.net[3].weight, norm_before)
    assert model.net[2].out_features == 32 and model.net[5].out_features == 16
    assert prune.events[-1]["uncut_layers"] == ["net.2", "net.7"]


class _BackboneAndHead(pl.LightningModule):
    """A backbone that BackboneFinetuning freezes, then unfreezes into a second parameter group; a head."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU())
        self.head = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))

    def forward(self, x):
        return self.head(self.backbone(x))

    def training_step(self, batch, batch_idx):
        return torch.nn.functional.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.Adam([p for p in self.parameters() if p.requires_grad], lr=0.01)


@pytest.mark.parametrize("finetuning_first", [True, False])
def test_a_run_next_to_backbone_finetuning_resumes_after_a_prune_event(tmp_path, finetuning_first):
    """Held-out sweep: BaseFinetuning keeps the optimizer's groups by parameter name, stored at the first
    epoch (`head.0.weight`); a mask renamed it `head.0.weight_orig`, and every resume after the first event
    failed in BaseFinetuning.on_fit_start with a bare `KeyError: 'head.0.weight'`, in either callback order.
    (The resumed weights are not compared with the uninterrupted run's: BackboneFinetuning's own resume does
    not reproduce that run, ScheduledPrune or not, since it freezes the backbone again at fit start and
    unfreezes it only at `unfreeze_backbone_at_epoch`, which lies before the resumed epoch.)"""
    from lightning.pytorch.callbacks import BackboneFinetuning

    def fit(ckpt_path=None) -> tuple[ScheduledPrune, list[list[str]]]:
        pl.seed_everything(0)
        model = _BackboneAndHead()
        finetuning = BackboneFinetuning(unfreeze_backbone_at_epoch=1)
        prune = ScheduledPrune(final_sparsity=0.5, start=5, end=35, every=5, probe_batches=0)
        callbacks: list[Callback] = [finetuning, prune] if finetuning_first else [prune, finetuning]
        if ckpt_path is None:
            callbacks.append(ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=10, save_top_k=-1))
        trainer = pl.Trainer(
            max_epochs=4, callbacks=callbacks, **trainer_kwargs(enable_checkpointing=ckpt_path is None)
        )
        trainer.fit(model, _linear_data(samples=320), ckpt_path=ckpt_path)
        assert trainer.global_step == 40
        names = {id(parameter): name for name, parameter in model.named_parameters()}
        groups = [[names[id(p)] for p in group["params"]] for group in trainer.optimizers[0].param_groups]
        return prune, groups

    uninterrupted, groups = fit()
    (checkpoint,) = tmp_path.glob("*step=20.ckpt")  # after the events at steps 5, 10, 15 and 20
    assert "head.0.weight_orig" in torch.load(checkpoint, weights_only=False)["state_dict"]
    resumed, resumed_groups = fit(str(checkpoint))
    # the groups BaseFinetuning restored hold the module's parameters, as the uninterrupted run's do
    assert (
        resumed_groups == groups and groups[0][0] == "head.0.weight" and groups[1][0] == "backbone.0.weight"
    )
    assert [event["step"] for event in resumed.events] == [event["step"] for event in uninterrupted.events]
    assert resumed.events[-1]["sparsity"] == 0.5


class StepsPerEpochAtEpochStart(Callback):
    """Records what ScheduledPrune reads as the optimizer steps of an epoch, at each epoch's start."""

    def __init__(self) -> None:
        self.read: list[int | None] = []

    def on_train_epoch_start(self, trainer, pl_module):
        from lightning_pulse.callbacks.scheduled_prune import _steps_per_epoch

        self.read.append(_steps_per_epoch(trainer))


def test_the_steps_of_an_epoch_are_known_once_the_last_accumulation_change_has_passed():
    """Review: with a GradientAccumulationScheduler of several factors they were never known, even in epochs
    (a resumed run's) past the last change, where one factor is left."""
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    read = StepsPerEpochAtEpochStart()
    callbacks = [GradientAccumulationScheduler({0: 1, 2: 2}), read]
    pl.Trainer(max_epochs=4, callbacks=callbacks, **trainer_kwargs()).fit(_LinearClassifier(), _linear_data())
    assert read.read == [None, None, 10, 10]  # 20 batches an epoch, 2 of them a step from epoch 2 on


class _SpikesAt(_LinearClassifier):
    """The loss times 1e4 at the given optimizer steps: a spike StabilityGuard skips, then rolls back."""

    def __init__(self, spike_steps: range) -> None:
        super().__init__()
        self.spike_steps = spike_steps

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * 1e4 if self.global_step in self.spike_steps else loss


class MasksAndRecord(Callback):
    """After every step (listed after StabilityGuard: after its rollback), the rollbacks so far, the zero
    share of the masks and of ``layer.weight`` over the pruned layers, and ScheduledPrune's sparsity and
    events."""

    def __init__(self, prune: ScheduledPrune, guard) -> None:
        self.prune, self.guard, self.rows = prune, guard, {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        layers = list(self.prune.pruner.layers(pl_module).values())
        masks = [pruning.current_mask(layer) for layer in layers]
        total = sum(layer.weight.numel() for layer in layers)
        mask_zeros = sum(int((mask == 0).sum()) for mask in masks if mask is not None) / total
        weight_zeros = sum(int((layer.weight == 0).sum()) for layer in layers) / total
        events = [event["step"] for event in self.prune.events]
        self.rows[trainer.global_step] = (
            self.guard.rollbacks,
            mask_zeros,
            weight_zeros,
            self.prune.sparsity,
            events,
        )


def test_a_rollback_to_a_snapshot_from_before_the_first_event_undoes_the_masks_with_the_record():
    """Held-out sweep (a Llama): a rollback to a snapshot taken before the first unstructured event put the
    saved weights back under the masks of step 24 (52.5% zeros) while ScheduledPrune's record went back to
    the snapshot (sparsity 0, no events); the events of steps 12-24 never came back to the record although
    their masks stayed. The rollback now undoes the masks too (the layers as they were at the snapshot), so
    the masks, ``layer.weight`` and the record agree at every step, and the undone events are redone."""
    from lightning_pulse import StabilityGuard

    pl.seed_everything(0)
    prune = ScheduledPrune(final_sparsity=0.6, start=8, end=40, every=4, probe_batches=0)
    guard = StabilityGuard(warmup=10, window=20, snapshot_every=10, rollback_after=2, skip_after_rollback=2)
    record = MasksAndRecord(prune, guard)
    options = trainer_kwargs(max_steps=50)
    pl.Trainer(callbacks=[prune, guard, record], **options).fit(_SpikesAt(range(25, 28)), _linear_data())

    assert [(e["step"], e["to_step"]) for e in guard.events if e["event"] == "rollback"] == [(26, 10)]
    assert record.rows[26][4] == [12, 16, 20, 24] and record.rows[26][1] == pytest.approx(0.525, abs=0.01)
    assert record.rows[27][1:] == (0.0, 0.0, 0.0, [])  # back to the step-10 snapshot: nothing pruned
    for step, (_, mask_zeros, weight_zeros, sparsity, _) in record.rows.items():
        assert mask_zeros == pytest.approx(sparsity, abs=2e-3) and weight_zeros == mask_zeros, step
    # redone at step 28, the first skip after the rollback: it drops a batch, on the snapshot's weights
    assert [event["step"] for event in prune.events] == [28, 32, 36, 40]
    assert prune.finished and record.rows[50][1] == pytest.approx(0.6, abs=2e-3)


def test_a_rollback_to_the_start_of_a_fit_resumed_after_a_fits_end_keeps_the_pruned_zeros_masked(tmp_path):
    """A fit resumed after a fit's end masks the zeros folded into the weights again at its start. A rollback
    to its fit-start snapshot (taken after that, though StabilityGuard is listed before ScheduledPrune; before
    it was taken with no masks, and the rollback load masked the zeros again) keeps the zeros masked, so they
    do not grow back and the record and the masks agree."""
    from lightning_pulse import StabilityGuard

    pl.seed_everything(0)
    options = {"final_sparsity": 0.5, "start": 0, "end": 16, "every": 2, "probe_batches": 0}
    trainer = pl.Trainer(callbacks=[ScheduledPrune(**options)], **trainer_kwargs(max_steps=20))
    trainer.fit(_LinearClassifier(), _linear_data())
    trainer.save_checkpoint(tmp_path / "pruned.ckpt")  # masks folded into the weights at fit end

    prune = ScheduledPrune(**options)
    guard = StabilityGuard(warmup=5, window=20, snapshot_every=10, rollback_after=2, rollback_margin=5)
    record = MasksAndRecord(prune, guard)
    model = _SpikesAt(range(28, 31))
    trainer = pl.Trainer(callbacks=[guard, prune, record], **trainer_kwargs(max_steps=40))
    trainer.fit(model, _linear_data(), ckpt_path=tmp_path / "pruned.ckpt")

    assert [e["to_step"] for e in guard.events if e["event"] == "rollback"] == [20]  # the fit-start snapshot
    for step, (_, mask_zeros, weight_zeros, sparsity, _) in record.rows.items():
        assert mask_zeros == pytest.approx(0.5, abs=2e-3) == sparsity and weight_zeros == mask_zeros, step
    layers = prune.pruner.layers(model).values()  # folded at this fit's end: the zeros stayed zeros
    assert all(float((layer.weight == 0).float().mean()) == pytest.approx(0.5, abs=2e-3) for layer in layers)


class _PruneOnceAt(Callback):
    """The user's own ``torch.nn.utils.prune`` call: half of ``net.2``'s weights, once, at the end of a step."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            torch.nn.utils.prune.l1_unstructured(pl_module.net[2], "weight", amount=0.5)


def test_a_rollback_undoes_only_scheduled_prunes_masks_and_keeps_another_pruners():
    """Review of sweep 20a: a rollback gave every layer masked since the snapshot a mask of ones, so pruning
    that nothing redoes (Lightning's ``ModelPruning``, the user's own ``torch.nn.utils.prune`` call) was
    silently lost. Now only ScheduledPrune's layers come back unpruned with its record (it redoes its events);
    another pruner's layer keeps its mask, the snapshot's weights going back under it."""
    from lightning_pulse import StabilityGuard

    pl.seed_everything(0)
    prune = ScheduledPrune(
        final_sparsity=0.6, start=8, end=40, every=4, probe_batches=0, exclude_pattern=r"net\.2"
    )
    guard = StabilityGuard(warmup=10, window=20, snapshot_every=10, rollback_after=2, skip_after_rollback=2)
    record = MasksAndRecord(prune, guard)
    model = _SpikesAt(range(25, 28))
    callbacks = [prune, _PruneOnceAt(12), guard, record]
    pl.Trainer(callbacks=callbacks, **trainer_kwargs(max_steps=50)).fit(model, _linear_data())

    assert [(e["step"], e["to_step"]) for e in guard.events if e["event"] == "rollback"] == [(26, 10)]
    assert list(prune.pruner.layers(model)) == ["net.0"]
    assert record.rows[27][1:] == (0.0, 0.0, 0.0, [])  # ScheduledPrune's layer: back to nothing pruned
    for step, (_, mask_zeros, weight_zeros, sparsity, _) in record.rows.items():
        assert mask_zeros == pytest.approx(sparsity, abs=2e-3) and weight_zeros == mask_zeros, step
    # pruned at step 12, after the snapshot, and by nothing since: still pruned (folded at fit end)
    assert float((model.net[2].weight == 0).float().mean()) == 0.5


def test_a_rollback_to_the_start_of_a_resumed_fit_undoes_the_events_since_and_keeps_the_folded_zeros(
    tmp_path,
):
    """A fit resumed after a fit's end that left the schedule unfinished goes on pruning. A rollback to its
    start snapshot (guard listed first; taken after ScheduledPrune masked the folded zeros again) sets the
    layers back to the folded zeros under their masks, so the events since are undone with the record and
    redone."""
    from lightning_pulse import StabilityGuard

    pl.seed_everything(0)
    options = {"final_sparsity": 0.6, "start": 0, "end": 16, "every": 2, "probe_batches": 0}
    trainer = pl.Trainer(callbacks=[ScheduledPrune(**options)], **trainer_kwargs(max_steps=10))
    with pytest.warns(UserWarning, match="schedule"):
        trainer.fit(_LinearClassifier(), _linear_data())
    trainer.save_checkpoint(tmp_path / "pruned.ckpt")  # masks folded into the weights at fit end
    folded = trainer.callbacks[0].sparsity

    prune = ScheduledPrune(**options)
    guard = StabilityGuard(
        warmup=5, window=20, snapshot_every=10, rollback_after=2, rollback_margin=5, skip_after_rollback=2
    )
    # read before ScheduledPrune's batch end (which redoes the undone events) and after it
    before_redo, record = MasksAndRecord(prune, guard), MasksAndRecord(prune, guard)
    trainer = pl.Trainer(callbacks=[guard, before_redo, prune, record], **trainer_kwargs(max_steps=30))
    trainer.fit(_SpikesAt(range(18, 21)), _linear_data(), ckpt_path=tmp_path / "pruned.ckpt")

    assert [e["to_step"] for e in guard.events if e["event"] == "rollback"] == [10]  # the fit-start snapshot
    rolled_back = min(step for step, row in before_redo.rows.items() if row[0] == 1)
    assert before_redo.rows[rolled_back - 1][3] == 0.6
    assert folded < 0.6 and before_redo.rows[rolled_back][3] == pytest.approx(
        folded
    )  # events since 10 undone
    for rows in (before_redo.rows, record.rows):
        for step, (_, mask_zeros, weight_zeros, sparsity, _) in rows.items():
            assert mask_zeros == pytest.approx(sparsity, abs=2e-3) and weight_zeros == mask_zeros, step
    # not redone in the rollback's own step (a flagged one: it waits, whatever the callbacks' order), but in
    # the first skip after it, on the snapshot's weights: a skip after a rollback holds no event back
    assert record.rows[rolled_back][3] == pytest.approx(folded) and record.rows[rolled_back + 1][3] == 0.6


def test_a_warning_from_the_prune_core_points_at_the_callbacks_hook():
    """The messages moved into `core/prune_events.py` with the lean-core refactor still name the callback's
    file, as Lightning's own callbacks' warnings do: a filter on the callback's module keeps matching."""
    pl.seed_everything(0)
    prune = ScheduledPrune(final_sparsity=0.6, start=0, end=16, every=2, probe_batches=0)
    trainer = pl.Trainer(callbacks=[prune], **trainer_kwargs(max_steps=10))
    with pytest.warns(UserWarning, match="schedule") as caught:
        trainer.fit(_LinearClassifier(), _linear_data())
    unfinished = [w for w in caught if "ScheduledPrune" in str(w.message) and "schedule" in str(w.message)]
    assert unfinished and all(w.filename.endswith("callbacks/scheduled_prune.py") for w in unfinished)
