"""A steps-mode HardSampleReplay run under ``accumulate_grad_batches=2``, resumed from a checkpoint saved inside
an accumulation window (at a micro-batch that took no optimizer step), trains the uninterrupted run's steps,
phases and batches, as Lightning keeps its windows: only the gradients the window had accumulated before the
save are lost, which no checkpoint holds (a plain Lightning run resumed there loses them too).

Found by a review: the resumed plan was played from the saved position as if a window started there, so every
later window of that pass was one micro-batch off Lightning's. Replay windows trained in the burst and plain
batches in the replay phase, and where the pass had an odd number of micro-batches left the plan counted one
optimizer step less: ``max_steps`` was capped one short and the run trained 16 optimizer steps of the
uninterrupted 17 (the review's run: 13 of 14).
"""

from __future__ import annotations

import math

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, OnExceptionCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel
from torch.utils.data import DataLoader

from lightning_pulse import HardSampleReplay, PulseCycle, phase_of
from lightning_pulse.core.step_plan import StepSavingStream
from lightning_pulse.phase import PhaseClock
from tests.conftest import trainer_kwargs
from tests.test_hard_sample_replay_cut_epochs import Samples

BATCH, SAMPLES = 16, 144  # 9 micro-batches an epoch: windows of 2 close at batch_idx 1, 3, 5, 7 and 8
CYCLE = dict(burst=6, replay=4, maintain=2, warmup=0.1, anneal=0.2, maintain_eval="none")


class Preempted(RuntimeError):
    pass


class Regression(BoringModel):
    """Lightning's BoringModel on 144 samples; raises inside ``training_step`` at the fit's micro-batch
    ``crash_at`` (a preemption)."""

    def __init__(self, crash_at: int | None = None) -> None:
        super().__init__()
        self.crash_at, self.calls = crash_at, 0

    def training_step(self, batch, batch_idx):
        self.calls += 1
        if self.calls - 1 == self.crash_at:
            raise Preempted("preempted")
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(Samples(SAMPLES), batch_size=BATCH)


class MicroBatches(Callback):
    """Per micro-batch: (epoch, batch_idx, global step at its end, phase, the window it was chosen from, the
    samples it trained); the optimizer steps taken; ``trainer.save_checkpoint`` at the fit's micro-batch
    ``save_at`` (in this callback's ``on_train_batch_end``)."""

    def __init__(self, save_at: int | None = None, path=None) -> None:
        self.save_at, self.path = save_at, path
        self.rows: list[tuple] = []
        self.steps, self.saved = 0, None
        self._trained: tuple = ()

    def on_before_backward(self, trainer, pl_module, loss):
        replay = next(c for c in trainer.callbacks if isinstance(c, HardSampleReplay))
        self._trained = (replay.offered_count, tuple(replay.trained_indices.tolist()))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.steps += 1

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        row = (trainer.current_epoch, batch_idx, trainer.global_step, phase_of(trainer).value, *self._trained)
        self.rows.append(row)
        if len(self.rows) - 1 == self.save_at:
            trainer.save_checkpoint(self.path)
            self.saved = row[:4]


class LoseWindowAt(Callback):
    """Drops the gradients accumulated up to the fit's micro-batch ``at``, as a resume from a checkpoint saved
    there does (Lightning saves no gradients): the run a mid-window resume can reproduce."""

    def __init__(self, at: int) -> None:
        self.at, self.calls = at, 0

    def on_after_backward(self, trainer, pl_module):
        if self.calls == self.at:
            for parameter in pl_module.parameters():
                parameter.grad = None
        self.calls += 1


def _fit(root, *extra, crash_at=None, ckpt_path=None):
    pl.seed_everything(0, verbose=False)
    model, log = Regression(crash_at), next((c for c in extra if isinstance(c, MicroBatches)), MicroBatches())
    callbacks = [PulseCycle(**CYCLE), HardSampleReplay(replay_fraction=0.5), *extra]
    callbacks += ([] if log in extra else [log]) + ([OnExceptionCheckpoint(dirpath=root)] if crash_at else [])
    settings = dict(default_root_dir=root, limit_val_batches=0, enable_checkpointing=crash_at is not None)
    trainer = pl.Trainer(
        callbacks=callbacks, max_epochs=4, accumulate_grad_batches=2, **trainer_kwargs(**settings)
    )
    try:
        trainer.fit(model, ckpt_path=ckpt_path)
    except Preempted:
        pass
    return trainer, log, torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    trainer, log, weights = _fit(tmp_path_factory.mktemp("uninterrupted"))
    assert trainer.global_step == log.steps == 17
    return log, weights


@pytest.mark.parametrize(
    ("save_at", "saved"),
    [(17, (2, 0, 9, "replay")), (9, (1, 0, 5, "burst"))],
    ids=["replay-phase-odd-rest", "burst-before-a-replay-phase"],
)
def test_a_resume_saved_inside_an_accumulation_window_keeps_lightnings_windows_and_the_runs_steps(
    tmp_path, uninterrupted, save_at, saved
):
    full, full_weights = uninterrupted
    saver = MicroBatches(save_at, tmp_path / "window.ckpt")
    _fit(tmp_path / "saved", saver)
    assert saver.saved == saved and full.rows[save_at][2] == full.rows[save_at - 1][2]  # no step there
    # the uninterrupted run with the window's gradients dropped at the save: what the resume can reproduce
    lost_trainer, lost, lost_weights = _fit(tmp_path / "lost", LoseWindowAt(save_at))
    assert lost_trainer.global_step == 17 and not torch.equal(lost_weights, full_weights)  # Lightning's loss

    resumed_trainer, resumed, resumed_weights = _fit(tmp_path / "resumed", ckpt_path=saver.path)
    # before: 16 steps of 17 from the replay phase (the plan played the pass's micro-batches 1-4 as windows
    # 1-2 and 3-4, where Lightning closes 0-1, 2-3 and 4 alone at the pass's end), and from the burst a plain
    # batch trained at step 8, in the replay phase, where the run trained a replay window
    assert resumed_trainer.global_step == 17 and saved[2] + resumed.steps == 17
    assert resumed.rows == lost.rows[save_at + 1 :]
    assert torch.equal(resumed_weights, lost_weights)


def test_a_resume_from_a_crash_in_a_windows_second_micro_batch_keeps_lightnings_windows(
    tmp_path, uninterrupted
):
    full, _ = uninterrupted
    crash_at = 18  # epoch 2, batch_idx 1: the replay phase's window of batch_idx 0 and 1, whose step is 10
    assert full.rows[crash_at][:4] == (2, 1, 10, "replay")
    crashed, _, _ = _fit(tmp_path, crash_at=crash_at)
    assert crashed.global_step == 9
    _, lost, lost_weights = _fit(tmp_path / "lost", LoseWindowAt(crash_at - 1))
    resumed_trainer, resumed, resumed_weights = _fit(
        tmp_path / "resumed", ckpt_path=str(tmp_path / "on_exception.ckpt")
    )
    assert resumed_trainer.global_step == 17  # before: 16
    assert resumed.rows == lost.rows[crash_at:]  # the micro-batch in flight trains again, and steps
    assert torch.equal(resumed_weights, lost_weights)


def _clock_at(step: int, total_steps: int) -> PhaseClock:
    clock = PhaseClock({"burst": 2, "replay": 2}, order=["burst", "replay"])
    for _ in range(step):
        clock.advance(steps=1, total_steps=total_steps)
    return clock


def test_a_plan_resumed_inside_an_accumulation_window_finishes_that_window_first():
    run = dict(
        batch_size=10,
        fraction=0.5,
        samples_per_epoch=90,
        max_epochs=2,
        max_steps=None,
        accumulate=2,
        drop_last=False,
    )
    whole = StepSavingStream().make_plan(_clock_at(0, 0), ["replay"], **run)
    sizes = whole.sizes_of(0)
    for trained in range(1, len(sizes)):
        stream = StepSavingStream()
        stream.plan = whole
        stream.sizes_for_pass(0, 0, math.nan, accumulate=2)
        for size in sizes[:trained]:
            stream.drawn(size)
        step = trained // 2  # Lightning steps at every second micro-batch of an epoch
        resumed = StepSavingStream()
        resumed.load_state_dict(stream.state_dict(step))
        rest = resumed.make_plan(_clock_at(step, whole.span), ["replay"], **run)
        assert rest.sizes_of(0) == sizes[trained:], f"resumed after {trained} micro-batches"
        assert rest.batch_sizes[1:] == whole.batch_sizes[1:], f"resumed after {trained} micro-batches"
        assert (rest.total_steps, rest.data_steps) == (whole.total_steps, None), f"after {trained}"
