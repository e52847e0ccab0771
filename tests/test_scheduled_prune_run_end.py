"""ScheduledPrune makes no cut at the run's last step, after its last batch, on either cadence."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_pulse import HardSampleReplay, Phase, PulseCycle, ScheduledPrune
from lightning_pulse.core import prune_setup
from lightning_pulse.core.prune_schedule import PruneSchedule
from tests.conftest import trainer_kwargs
from tests.test_scheduled_prune import _LinearClassifier as _Classifier


def _data(samples: int = 640) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    rows = TensorDataset(
        torch.randn(samples, 16, generator=generator), torch.randint(0, 4, (samples,), generator=generator)
    )
    return DataLoader(rows, batch_size=32)


def _cycle() -> PulseCycle:
    # cycles of 20 steps: maintain phases start at 16 and 36
    return PulseCycle(burst=10, replay=6, maintain=4, warmup=0, anneal=0, maintain_eval="none")


def _zero_share(model: _Classifier) -> float:
    weights = [model.net[0].weight, model.net[2].weight]
    return sum(int((w == 0).sum()) for w in weights) / sum(w.numel() for w in weights)


class _LastBatch(Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.step = trainer.global_step


@pytest.mark.parametrize("bound", ["max_steps", "max_epochs"])
def test_a_maintain_phase_starting_at_the_runs_last_step_makes_no_cut_as_the_fit_start_plan_says(
    bound, recwarn
):
    # held-out sweep: the fit-start warning said "sparsity stops at 0.46", then the maintain phase starting at
    # max_steps=36, after the last batch (step 35), cut 0.46 -> 0.50 and the fit ended there: the delivered
    # model was cut with no step to recover (probe val_loss 0.564 -> 0.593)
    pl.seed_everything(0)
    cycle, prune, last = _cycle(), ScheduledPrune(final_sparsity=0.5, probe_batches=0), _LastBatch()
    # 20 batches a step for 36 steps, or 2 epochs of 18 batches
    length = {"max_steps": 36, "max_epochs": -1} if bound == "max_steps" else {"max_epochs": 2}
    trainer = pl.Trainer(callbacks=[cycle, prune, last], **trainer_kwargs(**length))
    model = _Classifier()
    trainer.fit(model, _data(640 if bound == "max_steps" else 576))
    assert trainer.global_step == 36 and last.step == 35
    assert [c.step for c in cycle.history if c.current is Phase.MAINTAIN] == [16, 36]  # the chance came
    plan = [str(w.message) for w in recwarn if "pruning at maintain-phase starts" in str(w.message)]
    assert len(plan) == 1 and "makes 1 cut(s)" in plan[0] and "sparsity stops at 0.46" in plan[0]
    assert [event["step"] for event in prune.events] == [16]  # as planned, not a second cut at 36
    assert _zero_share(model) == pytest.approx(0.461, abs=2e-3)
    said = [str(w.message) for w in recwarn if "the run ended at step 36" in str(w.message)]
    assert len(said) == 1 and "sparsity reached 0.461 of 0.5" in said[0]


def test_a_resumed_run_makes_the_same_cuts_as_the_uninterrupted_one_with_none_at_the_last_step(tmp_path):
    def fit(ckpt_path=None, checkpoints=()):
        pl.seed_everything(0)
        prune = ScheduledPrune(final_sparsity=0.5, probe_batches=0)
        trainer = pl.Trainer(
            max_steps=36,
            callbacks=[_cycle(), prune, *checkpoints],
            **trainer_kwargs(max_epochs=-1, enable_checkpointing=bool(checkpoints)),
        )
        model = _Classifier()
        trainer.fit(model, _data(), ckpt_path=ckpt_path)
        return [event["step"] for event in prune.events], model

    saved = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=20, save_top_k=-1, filename="{step}")
    straight, model = fit(checkpoints=[saved])
    resumed, resumed_model = fit(ckpt_path=tmp_path / "step=20.ckpt")
    assert straight == resumed == [16]
    assert torch.equal(model.net[0].weight == 0, resumed_model.net[0].weight == 0)


@pytest.mark.parametrize(
    ("start", "end", "steps"),
    [
        # `end=1.0` is the run's last step: the schedule ends a step before and still reaches 0.5 there
        (0, 1.0, [1, 11, 21, 31, 39]),
        # an end past the run: the chance landing on the last step is not taken
        (10, 100, [20, 30]),
    ],
)
def test_the_step_cadence_makes_no_cut_at_the_runs_last_step(start, end, steps):
    pl.seed_everything(0)
    prune = ScheduledPrune(final_sparsity=0.5, start=start, end=end, every=10, probe_batches=0)
    trainer = pl.Trainer(max_steps=40, callbacks=[prune], **trainer_kwargs(max_epochs=-1))
    trainer.fit(_Classifier(), _data())
    assert trainer.global_step == 40
    assert [event["step"] for event in prune.events] == steps
    assert prune.finished == (end == 1.0)
    if end == 1.0:
        assert prune.events[-1]["target_sparsity"] == 0.5


@pytest.mark.parametrize("prune_first", [True, False])
def test_no_cut_is_made_at_the_last_step_of_a_run_step_saving_replay_shortened(prune_first):
    # the sweep first saw it on a LoRA T5 with the whole suite: HardSampleReplay planned the run down to 36
    # steps, and a maintain phase started at that 36th step
    pl.seed_everything(0)
    cycle, prune = _cycle(), ScheduledPrune(final_sparsity=0.5, probe_batches=0)
    replay = HardSampleReplay(replay_fraction=0.5)
    callbacks = [cycle, prune, replay] if prune_first else [cycle, replay, prune]
    trainer = pl.Trainer(max_steps=47, callbacks=callbacks, **trainer_kwargs(max_epochs=-1))
    trainer.fit(_Classifier(), _data())
    assert trainer.global_step == trainer.max_steps == 36  # the replay's plan
    assert [c.step for c in cycle.history if c.current is Phase.MAINTAIN] == [16, 36]
    assert [event["step"] for event in prune.events] == [16]


def test_the_fit_start_plan_of_the_step_cadence_counts_no_cut_at_the_runs_last_step():
    # chances at 10 (target 0) and 55, the run's last step: no cut is made there, so none is warned of
    schedule = PruneSchedule(final_sparsity=0.5, start=10, end=100, every=45)
    schedule.resolve(55)
    assert prune_setup.abrupt_schedule_warning(schedule, run_end=55) is None
    assert "the one at step 55" in prune_setup.abrupt_schedule_warning(schedule, run_end=56)


class _TwoOptimizersABatch(_Classifier):
    """A module stepping two optimizers itself each batch: global_step (and max_steps) grows by 2 a batch."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        first, second = self.optimizers()
        first.zero_grad()
        second.zero_grad()
        self.manual_backward(torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1]))
        first.step()
        second.step()

    def configure_optimizers(self):
        return torch.optim.SGD(self.net[0].parameters(), lr=0.1), torch.optim.SGD(
            self.net[2].parameters(), lr=0.1
        )


@pytest.mark.parametrize("end", [1.0, 40])
def test_an_end_at_the_runs_end_is_reached_a_batch_before_it_when_a_batch_steps_two_optimizers(end, recwarn):
    # batches end at steps 2, 4, ..., 40: an `end` placed a step before the run's end (39) came due only at
    # step 40, where no cut is made, and the run ended at 0.07 of 0.5 while the plan promised the cut at 39
    pl.seed_everything(0)
    prune = ScheduledPrune(final_sparsity=0.5, start=0, end=end, every=100, probe_batches=0)
    trainer = pl.Trainer(max_steps=40, callbacks=[prune], **trainer_kwargs(max_epochs=-1))
    trainer.fit(_TwoOptimizersABatch(), _data())
    assert trainer.global_step == 40
    assert prune.schedule.end_step == 38
    assert [event["step"] for event in prune.events] == [2, 38]
    assert prune.finished and prune.events[-1]["target_sparsity"] == 0.5
    plan = [str(w.message) for w in recwarn if "takes sparsity" in str(w.message)]
    assert len(plan) == 1 and "the one at step 38 takes sparsity from 0.00 to 0.50" in plan[0]
    assert not [w for w in recwarn if "sparsity reached" in str(w.message) or "unfinished" in str(w.message)]


def test_a_fit_resumed_with_no_step_left_folds_the_checkpoints_masks_as_the_uninterrupted_fit_did(tmp_path):
    # held-out sweep: `trainer.fit(model, ckpt_path=<the run's last step>)` trains nothing, so no training hook
    # ran; the checkpoint's masks stayed on (`weight_orig`/`weight_mask`) and the model's state_dict did not
    # load into its plain class, where the uninterrupted fit had folded them at its end
    def fit(callbacks, ckpt_path=None):
        pl.seed_everything(0)
        prune = ScheduledPrune(final_sparsity=0.5, start=0.0, end=0.8, probe_batches=0)
        kwargs = trainer_kwargs(max_steps=20, default_root_dir=tmp_path)
        trainer = pl.Trainer(
            callbacks=[prune, *callbacks], **{**kwargs, "enable_checkpointing": bool(callbacks)}
        )
        model = _Classifier()
        trainer.fit(model, _data(), ckpt_path=ckpt_path)
        return model

    saver = ModelCheckpoint(
        dirpath=tmp_path / "ckpt", every_n_train_steps=20, save_top_k=-1, filename="{step}"
    )
    uninterrupted = fit([saver])
    resumed = fit([], ckpt_path=str(tmp_path / "ckpt" / "step=20.ckpt"))
    assert sorted(resumed.state_dict()) == sorted(uninterrupted.state_dict())
    _Classifier().load_state_dict(resumed.state_dict())  # loads into the plain class
    for name, tensor in uninterrupted.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[name], tensor, rtol=0, atol=0)
    assert _zero_share(resumed) == pytest.approx(_zero_share(uninterrupted)) and _zero_share(resumed) > 0.4
