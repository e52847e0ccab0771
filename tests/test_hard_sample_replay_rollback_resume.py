"""HardSampleReplay (steps mode) under StabilityGuard: a checkpoint saved after a rollback inside a replay
pass resumes the uninterrupted run bit for bit.

MNIST-1D (720 training samples, shuffle-free batches of 64), ``PulseCycle(burst=6, replay=12)``: the second
pass starts at step 9 in the replay phase, its windows of 128 cut to 64. A NaN written into the first weight
before step 10 makes the guard roll back at once to its snapshot of step 8, in the first pass: the restored
scores lack the measurements of step 8 (and hold first-pass steps not yet applied), on samples the second
pass still has to draw. The sampler had cut that whole pass at its start, and the resume cut the rest again
from the restored scores: other samples, final weights 0.06-0.10 apart. Now the rollback cuts the windows not
yet drawn again from the restored scores (the first pass's steps applied first, as its epoch end had), which
is what a resume reads; the batches the DataLoader's workers had drawn ahead keep their cuts, which the
checkpoint carries.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, OnExceptionCheckpoint
from torch.utils.data import DataLoader

from examples.mnist1d import MNIST1DClassifier, MNIST1DDataModule
from lightning_pulse import HardSampleReplay, PulseCycle, StabilityGuard
from lightning_pulse.core.sample_index import PlannedBatchSampler
from tests.conftest import trainer_kwargs

FAULT_STEP, SNAPSHOT_STEP, SECOND_PASS_STEP = 10, 8, 9


class ShuffleFreeData(MNIST1DDataModule):
    def train_dataloader(self):
        return DataLoader(
            self.train_set,
            batch_size=self.hparams.batch_size,
            shuffle=False,
            num_workers=self.hparams.num_workers,
        )


class NaNWeightBefore(Callback):
    """Writes a NaN into the model's first weight before step ``step`` (once): a model-state fault, rolled
    back at once."""

    def __init__(self, step: int) -> None:
        self.step, self.done = step, False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step and not self.done:
            self.done = True
            with torch.no_grad():
                next(pl_module.parameters()).view(-1)[0] = float("nan")


class PassStarts(Callback):
    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 0:
            self.steps.append(trainer.global_step)


class Preempted(RuntimeError):
    pass


class PreemptedAt(MNIST1DClassifier):
    """Raises inside ``training_step`` at step ``step`` (once): the batch in flight never trains."""

    def __init__(self, step: int) -> None:
        super().__init__(arch="mlp")
        self.step, self.raised = step, False

    def training_step(self, batch, batch_idx):
        if self.trainer.global_step == self.step and not self.raised:
            self.raised = True
            raise Preempted()
        return super().training_step(batch, batch_idx)


def _fit(root, workers: int, checkpoints: bool = False, resume=None, preempt_at: int | None = None):
    pl.seed_everything(0)
    guard = StabilityGuard(
        warmup=5, snapshot_every=4, max_snapshots=3, rollback_margin=1, skip_after_rollback=1
    )
    passes = PassStarts()
    callbacks = [
        PulseCycle(burst=6, replay=12, maintain=0, warmup=0, anneal=0),
        HardSampleReplay(replay_fraction=0.5),
        guard,
        NaNWeightBefore(FAULT_STEP),
        passes,
    ]
    if checkpoints:
        callbacks.append(
            ModelCheckpoint(dirpath=root, filename="{step}", every_n_train_steps=1, save_top_k=-1)
        )
    if preempt_at is not None:
        callbacks.append(OnExceptionCheckpoint(dirpath=root))
    trainer = pl.Trainer(
        callbacks=callbacks,
        max_epochs=4,
        default_root_dir=root,
        **trainer_kwargs(enable_checkpointing=checkpoints or preempt_at is not None, limit_val_batches=0),
    )
    model = MNIST1DClassifier(arch="mlp") if preempt_at is None else PreemptedAt(preempt_at)
    data = ShuffleFreeData(num_samples=1000, batch_size=64, num_workers=workers)
    trainer.fit(model, data, ckpt_path=resume)
    replay = next(c for c in callbacks if isinstance(c, HardSampleReplay))
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    return weights, replay.table.scores.copy(), guard, passes, trainer


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    runs = {}

    def run(workers: int):
        if workers not in runs:
            root = tmp_path_factory.mktemp(f"uninterrupted{workers}")
            runs[workers] = (root, *_fit(root, workers, checkpoints=True))
        return runs[workers]

    return run


# workers: the DataLoader's two workers had drawn four batches ahead when the guard rolled back
@pytest.mark.parametrize("workers", [0, 2], ids=["no-workers", "two-workers"])
def test_a_checkpoint_saved_after_a_rollback_inside_a_replay_pass_resumes_the_uninterrupted_run(
    uninterrupted, tmp_path, workers
):
    root, weights, scores, guard, passes, trainer = uninterrupted(workers)
    rollbacks = [(event["step"], event["to_step"]) for event in guard.events if event["event"] == "rollback"]
    assert rollbacks == [(FAULT_STEP, SNAPSHOT_STEP)]
    assert SNAPSHOT_STEP < SECOND_PASS_STEP < FAULT_STEP and SECOND_PASS_STEP in passes.steps
    # saved right after the rollback, and three steps on, past a threshold refresh (it applies measured steps)
    for step in (FAULT_STEP + 1, FAULT_STEP + 3):
        checkpoint = root / f"step={step}.ckpt"
        stream = next(
            state["stream"]
            for name, state in torch.load(checkpoint, weights_only=False)["callbacks"].items()
            if name.startswith("HardSampleReplay")
        )
        resumed_weights, resumed_scores, resumed_guard, _, resumed = _fit(
            tmp_path / str(step), workers, resume=checkpoint
        )
        assert resumed.global_step == trainer.global_step
        assert resumed_guard.events == guard.events
        assert torch.equal(resumed_weights, weights), f"resumed from step {step}"
        assert resumed_scores.tobytes() == scores.tobytes()
        # not vacuous: the batches drawn ahead of the rollback, and only those, are saved with their cuts
        assert ("fixed_cuts" in stream) == (workers > 0)


def test_a_batch_drawn_ahead_of_a_rollback_and_preempted_in_flight_is_resumed_with_its_cut(
    uninterrupted, tmp_path
):
    _, weights, scores, *_ = uninterrupted(2)
    with pytest.raises(
        Preempted
    ):  # the first of the four batches the workers had drawn ahead of the rollback
        _fit(tmp_path, 2, preempt_at=FAULT_STEP + 1)
    checkpoint = torch.load(tmp_path / "on_exception.ckpt", weights_only=False)
    stream = next(v["stream"] for k, v in checkpoint["callbacks"].items() if k.startswith("HardSampleReplay"))
    assert len(stream["fixed_cuts"]) == 4  # the batch in flight, left out of the trained ones, and three more
    resumed_weights, resumed_scores, *_ = _fit(tmp_path / "resumed", 2, resume=tmp_path / "on_exception.ckpt")
    assert torch.equal(resumed_weights, weights)
    assert resumed_scores.tobytes() == scores.tobytes()


def test_a_rolled_back_replay_pass_chosen_in_blocks_of_one_window_trains_what_one_block_does(
    uninterrupted, tmp_path, monkeypatch
):
    # the docs: choosing a pass's windows a block ahead gives what choosing each just before it trains would;
    # a rollback mid-pass once broke it (the block kept the cuts made from the scores it undid)
    _, weights, *_ = uninterrupted(0)
    monkeypatch.setattr(PlannedBatchSampler, "CHOOSE_BLOCK", 1)
    one_by_one, *_ = _fit(tmp_path, 0)
    assert torch.equal(one_by_one, weights)


def test_the_sampler_cuts_again_only_windows_not_yet_yielded_and_yields_given_cuts_that_fit():
    from types import SimpleNamespace

    from torch.utils.data import TensorDataset

    plain = DataLoader(TensorDataset(torch.arange(40)), batch_size=4, shuffle=False)
    calls = []

    def choose(windows, ordinals):  # the even or odd half of each window, by how often it was called
        calls.append(ordinals)
        return [SimpleNamespace(indices=torch.tensor(window[len(calls) % 2 :: 2])) for window in windows]

    sampler = PlannedBatchSampler(plain.batch_sampler, lambda: (0, [8, 8, 8, 8]), 10, choose)
    passes = iter(sampler)
    assert [next(passes) for _ in range(2)] == [[1, 3, 5, 7], [9, 11, 13, 15]]
    sampler.choose_again()  # two yielded: the rest is cut again, the yielded ones are fixed
    assert calls[-1] == [2, 3] and sampler.fixed_ahead == 2
    assert [cut.indices.tolist() for cut in sampler.fixed_cuts()] == [[1, 3, 5, 7], [9, 11, 13, 15]]
    assert list(passes) == [[16, 18, 20, 22], [24, 26, 28, 30]]
    # a resume's given cuts: the first fits its window, the second was cut from another one (another plan)
    sampler.given.extend(
        [SimpleNamespace(indices=torch.tensor([0, 2, 4, 6])), SimpleNamespace(indices=torch.tensor([0]))]
    )
    again = list(sampler)
    assert again[0] == [0, 2, 4, 6] and again[1] != [0] and calls[-1] == [1, 2, 3]
    assert not sampler.given
