"""HardSampleReplay resumed: figures that follow the checkpoint, and a steps-mode plan of another length."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from examples.mnist1d import MNIST1DClassifier
from lightning_pulse import HardSampleReplay, PulseCycle
from lightning_pulse.errors import PulseRefusal
from tests.conftest import trainer_kwargs
from tests.test_step_saving_replay import CYCLE, OneCycleClassifier, ShuffleFreeData


def _fit(callbacks, epochs=2, ckpt_path=None, checkpoints=None):
    pl.seed_everything(0)
    model = MNIST1DClassifier()
    saving = []
    if checkpoints is not None:
        saving = [ModelCheckpoint(dirpath=checkpoints, every_n_train_steps=1, save_top_k=-1)]
    trainer = pl.Trainer(
        callbacks=[*callbacks, *saving],
        max_epochs=epochs,
        **trainer_kwargs(enable_checkpointing=bool(saving), log_every_n_steps=1),
    )
    trainer.fit(model, ShuffleFreeData(num_samples=1000, batch_size=64), ckpt_path=ckpt_path)
    return model, trainer


def _replay(trainer) -> HardSampleReplay:
    return next(c for c in trainer.callbacks if isinstance(c, HardSampleReplay))


def test_a_resume_from_before_the_first_threshold_ends_with_the_uninterrupted_runs_figures(tmp_path):
    # held-out sweep: the checkpoint of step 1 holds a NaN threshold (nothing scored when it was taken) that
    # the uninterrupted run redoes at step 2, after the first scores were applied; the resumed run kept it for
    # `threshold_every` steps, so its learned rate and final threshold differed (weights equal)
    def callbacks():
        return [PulseCycle(**CYCLE), HardSampleReplay(rule="topk", replay_fraction=0.5)]

    _, full = _fit(callbacks(), checkpoints=tmp_path)
    _, resumed = _fit(callbacks(), ckpt_path=str(next(tmp_path.glob("*step=1.ckpt"))))
    assert resumed.global_step == full.global_step
    figures = [_replay(t).metrics() for t in (full, resumed)]
    assert figures[1]["learned_rate"] == figures[0]["learned_rate"]
    assert figures[1]["threshold"] == figures[0]["threshold"]

    # a checkpoint written before the flag was saved still resumes (as before: the threshold waits)
    older = torch.load(next(tmp_path.glob("*step=1.ckpt")), weights_only=False)
    for key, state in older["callbacks"].items():
        if key.startswith("HardSampleReplay"):
            del state["applied_since_threshold"]
    torch.save(older, tmp_path / "older.ckpt")
    _, from_older = _fit(callbacks(), ckpt_path=str(tmp_path / "older.ckpt"))
    assert from_older.global_step == full.global_step


class SaveAtTrainStartAndStop(Callback):
    """Saves at the fit's start and stops it before any batch, as GreenWindow's suspend does at a resume whose
    window is still dirty (its save is listed last)."""

    def __init__(self, path) -> None:
        self.path = path

    def on_train_start(self, trainer, pl_module) -> None:
        trainer.save_checkpoint(self.path)
        trainer.should_stop = True


def test_a_checkpoint_saved_at_a_mid_epoch_resumes_start_by_a_callback_listed_after_it_resumes_the_run(
    tmp_path,
):
    # regression sweep of pass 41: HardSampleReplay let go of the restored stream state in its own
    # on_train_start, before the resumed pass began, so a save by a callback listed after it held the stream
    # at epoch 0, sample 0 (pass_prior NaN): resumed from it, the run trained 12 steps of 18, weights apart
    def callbacks(*last):
        return [PulseCycle(**CYCLE), HardSampleReplay(rule="topk", replay_fraction=0.5), *last]

    full_model, full = _fit(callbacks(), checkpoints=tmp_path / "steps")
    mid_epoch = next((tmp_path / "steps").glob("*step=5.ckpt"))
    _fit(callbacks(SaveAtTrainStartAndStop(tmp_path / "start.ckpt")), ckpt_path=str(mid_epoch))

    def stream(path):
        state = torch.load(path, weights_only=False)["callbacks"]
        saved = next(v for k, v in state.items() if k.startswith("HardSampleReplay"))["stream"]
        return {k: str(v) if isinstance(v, float) else v for k, v in saved.items()}  # NaN: no prior yet

    assert stream(mid_epoch)["samples"] > 0 and stream(tmp_path / "start.ckpt") == stream(mid_epoch)
    model, resumed = _fit(callbacks(), ckpt_path=str(tmp_path / "start.ckpt"))
    assert resumed.global_step == full.global_step
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), full_model.parameters()))


def _onecycle_fit(callbacks, ckpt_path=None, checkpoints=None, epochs=4):
    pl.seed_everything(0)
    model = OneCycleClassifier()
    saving = []
    if checkpoints is not None:
        saving = [ModelCheckpoint(dirpath=checkpoints, every_n_train_steps=1, save_top_k=-1)]
    trainer = pl.Trainer(
        callbacks=[*callbacks, *saving],
        max_epochs=epochs,
        **trainer_kwargs(enable_checkpointing=bool(saving)),
    )
    trainer.fit(model, ShuffleFreeData(num_samples=1000, batch_size=64), ckpt_path=ckpt_path)
    return trainer


def test_a_resume_with_the_pulse_cycle_left_out_says_the_plan_changed_and_trains_what_it_says(tmp_path):
    # held-out sweep: the checkpoint's plan was 57 steps, the resumed run announced 57 and trained 54 on other
    # data, with no word from the library (Lightning only says a callback is missing)
    saved = _onecycle_fit([PulseCycle(**CYCLE), HardSampleReplay(replay_fraction=0.5)], checkpoints=tmp_path)
    with pytest.warns(UserWarning, match="HardSampleReplay: the checkpoint's plan was") as caught:
        resumed = _onecycle_fit(
            [HardSampleReplay(replay_fraction=0.5)], ckpt_path=str(next(tmp_path.glob("*step=10.ckpt")))
        )
    said = [str(w.message) for w in caught if "checkpoint's plan was" in str(w.message)]
    assert len(said) == 1
    assert f"was {saved.global_step} optimizer steps, this run plans {resumed.global_step}" in said[0]
    assert "PulseCycle it was saved with is gone" in said[0] and resumed.global_step < saved.global_step


def test_a_resume_with_a_pulse_cycle_added_is_refused_before_its_restored_onecycle_is_stepped_past_its_end(
    tmp_path,
):
    # held-out sweep: HSR alone planned 48 steps, the resume with a PulseCycle planned 62 and the restored
    # OneCycleLR (48 steps) raised "Tried to step 49 times" mid-run
    _onecycle_fit([HardSampleReplay(replay_fraction=0.5)], checkpoints=tmp_path)
    resumed = None
    with pytest.raises(PulseRefusal, match="HardSampleReplay: the per-step OneCycleLR restored") as refusal:
        resumed = _onecycle_fit(
            [PulseCycle(**CYCLE), HardSampleReplay(replay_fraction=0.5)],
            ckpt_path=str(next(tmp_path.glob("*step=10.ckpt"))),
        )
    assert resumed is None and "a PulseCycle was added since" in str(refusal.value)


def test_a_resume_with_the_hard_sample_replay_left_out_is_refused_before_its_restored_onecycle_overruns(
    tmp_path,
):
    # held-out sweep: a PulseCycle with a step-saving HardSampleReplay planned 73 steps; resumed without the
    # HardSampleReplay the run took the plain 96 and the restored OneCycleLR raised "Tried to step 74 times"
    _onecycle_fit([PulseCycle(**CYCLE), HardSampleReplay(replay_fraction=0.5)], checkpoints=tmp_path)
    resumed = None
    with pytest.raises(PulseRefusal, match="PulseCycle: the per-step OneCycleLR restored") as refusal:
        resumed = _onecycle_fit([PulseCycle(**CYCLE)], ckpt_path=str(next(tmp_path.glob("*step=10.ckpt"))))
    assert resumed is None and "this run without a HardSampleReplay(mode='steps') takes 48" in str(
        refusal.value
    )


def test_a_resume_to_more_epochs_is_refused_before_its_restored_onecycle_overruns(tmp_path):
    # held-out sweep: resumed to max_epochs=10 the plan was remade longer and the restored OneCycleLR raised
    # "Tried to step 58 times" mid-run; the docs said the plan was the saved one
    _onecycle_fit([PulseCycle(**CYCLE), HardSampleReplay(replay_fraction=0.5)], checkpoints=tmp_path)
    with pytest.raises(PulseRefusal, match="HardSampleReplay: the per-step OneCycleLR restored") as refusal:
        _onecycle_fit(
            [PulseCycle(**CYCLE), HardSampleReplay(replay_fraction=0.5)],
            ckpt_path=str(next(tmp_path.glob("*step=10.ckpt"))),
            epochs=6,
        )
    assert "the run's max_epochs or max_steps changed" in str(refusal.value)


def test_the_plan_line_of_a_resume_with_the_pulse_cycle_left_out_states_the_steps_the_run_takes(
    tmp_path, caplog
):
    # sweep-cli-yaml: the fit-start line quoted the checkpoint's 64 steps ("41 of the 44 from step 20 on",
    # max_steps=64) while the warning after it said 61 and max_epochs ended the run at 61
    saved = _onecycle_fit([PulseCycle(**CYCLE), HardSampleReplay(replay_fraction=0.5)], checkpoints=tmp_path)
    caplog.set_level("INFO")
    caplog.clear()
    with pytest.warns(UserWarning, match="HardSampleReplay: the checkpoint's plan was"):
        resumed = _onecycle_fit(
            [HardSampleReplay(replay_fraction=0.5)], ckpt_path=str(next(tmp_path.glob("*step=10.ckpt")))
        )
    assert resumed.global_step < saved.global_step
    lines = [
        r.getMessage() for r in caplog.records if "HardSampleReplay: the run's data takes" in r.getMessage()
    ]
    assert len(lines) == 1, lines
    taken, rest = resumed.global_step, resumed.global_step - 10
    assert f"the run's data takes {taken} optimizer steps instead of " in lines[0], lines[0]
    assert f" of the {rest} from step 10 on in light phases" in lines[0], lines[0]
    assert f"but max_epochs=4 ends the run at step {taken}, where its data ends" in lines[0], lines[0]


class EveryThirdStepOneCycle(MNIST1DClassifier):
    """A OneCycleLR Lightning steps every third batch (``"frequency": 3``), built for the planned steps over
    its frequency (36 // 3 = 12), or a constant schedule (``one_cycle=False``) whose steps are counted."""

    def __init__(self, one_cycle: bool = True) -> None:
        super().__init__()
        self.one_cycle = one_cycle

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=1e-3)
        steps = int(self.trainer.estimated_stepping_batches) // 3
        schedule = (
            torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=5e-3, total_steps=steps)
            if self.one_cycle
            else torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
        )
        return [optimizer], [{"scheduler": schedule, "interval": "step", "frequency": 3}]


def _every_third_fit(fraction, root, ckpt_path=None, checkpoints=False, accumulate=1, one_cycle=True):
    pl.seed_everything(0)
    saving = [ModelCheckpoint(dirpath=root, every_n_train_steps=1, save_top_k=-1)] if checkpoints else []
    trainer = pl.Trainer(
        callbacks=[PulseCycle(**CYCLE), HardSampleReplay(replay_fraction=fraction), *saving],
        max_epochs=4,
        accumulate_grad_batches=accumulate,
        **trainer_kwargs(default_root_dir=root, enable_checkpointing=checkpoints),
    )
    data = ShuffleFreeData(num_samples=1000, batch_size=64)
    trainer.fit(EveryThirdStepOneCycle(one_cycle), data, ckpt_path=ckpt_path)
    return trainer


def test_a_resume_that_steps_a_scheduler_of_frequency_3_to_its_end_and_no_further_is_not_refused(tmp_path):
    # a review (older than pass 42): the check counted the scheduler's steps as the run's steps over its
    # frequency (40 // 3 = 13 of its 12), where Lightning counts each epoch's batches (9, 9 and 11 batches
    # from step 11 on: 3 + 3 + 3 steps after the 3 before), so a resume that ends the OneCycleLR exactly at
    # its end was refused
    saved = _every_third_fit(0.5, tmp_path, checkpoints=True)
    schedule = saved.lr_scheduler_configs[0].scheduler
    assert (saved.global_step, schedule.total_steps, schedule.last_epoch) == (36, 12, 11)
    resumed = _every_third_fit(0.62, tmp_path / "resumed", str(next(tmp_path.glob("*step=11.ckpt"))))
    schedule = resumed.lr_scheduler_configs[0].scheduler
    assert resumed.global_step == 40 and schedule.last_epoch == schedule.total_steps == 12
    # one that would step it past its end (43 steps from step 10: "Tried to step 13 times") is still refused
    with pytest.raises(PulseRefusal, match="the per-step OneCycleLR restored from the checkpoint spans 12"):
        _every_third_fit(0.8, tmp_path / "longer", str(next(tmp_path.glob("*step=10.ckpt"))))


@pytest.mark.parametrize("accumulate", [1, 2])
def test_the_scheduler_steps_a_resumed_plan_counts_are_those_lightning_takes(tmp_path, accumulate):
    # Lightning steps a scheduler of "frequency": 3 after a batch that takes an optimizer step whose number in
    # its epoch is a multiple of 3: per epoch, and in batches (every 6th under accumulate_grad_batches=2)
    saved = _every_third_fit(0.5, tmp_path, checkpoints=True, accumulate=accumulate, one_cycle=False)
    counted = []

    class Count(Callback):
        def on_train_start(self, trainer, pl_module):
            stream = _replay(trainer).steps.stream
            left = stream.plan.run_steps(True) - trainer.global_step
            schedule = trainer.lr_scheduler_configs[0].scheduler
            counted.append(schedule.last_epoch + stream.scheduler_steps(3, accumulate, left))

    steps = sorted(int(path.stem.split("step=")[1]) for path in tmp_path.glob("*.ckpt"))
    assert steps[-1] == saved.global_step
    taken = saved.lr_scheduler_configs[0].scheduler.last_epoch
    for step in steps[:-1:2]:
        pl.seed_everything(0)
        trainer = pl.Trainer(
            callbacks=[PulseCycle(**CYCLE), HardSampleReplay(replay_fraction=0.5), Count()],
            max_epochs=4,
            accumulate_grad_batches=accumulate,
            **trainer_kwargs(default_root_dir=tmp_path / "resumed", enable_checkpointing=False),
        )
        path = str(next(tmp_path.glob(f"*step={step}.ckpt")))
        data = ShuffleFreeData(num_samples=1000, batch_size=64)
        trainer.fit(EveryThirdStepOneCycle(False), data, ckpt_path=path)
        assert counted[-1] == trainer.lr_scheduler_configs[0].scheduler.last_epoch == taken, step
