"""HardSampleReplay(mode="steps") with an index sampler that draws with replacement: a sample can come twice in
a pass, and is rescored between its two windows. The pass's windows are chosen from the scores as they stood
at the pass's start, so a resume mid-pass and a pass chosen in smaller blocks train what the uninterrupted run
does."""

from __future__ import annotations

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, Dataset, RandomSampler, SequentialSampler, WeightedRandomSampler

from lightning_pulse import HardSampleReplay, PulseCycle
from lightning_pulse.core.sample_index import PlannedBatchSampler, draws_each_index_once
from lightning_pulse.core.sample_scores import SampleScoreTable
from tests.conftest import trainer_kwargs

SAMPLES, BATCH, SAVED_AT = 120, 8, 30


class Points(Dataset):
    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int):
        x = torch.randn(8, generator=torch.Generator().manual_seed(index))
        return x, index % 3, index


class ClassBalanced(WeightedRandomSampler):
    """A weighted draw with replacement, seeded per epoch (``set_epoch``) as the docs ask for a resume."""

    def __init__(self) -> None:
        weights = torch.ones(SAMPLES)
        weights[:6] = 10.0
        super().__init__(weights, int(1.2 * SAMPLES), replacement=True)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.generator = torch.Generator().manual_seed(100 + epoch)


class Recorder(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
        self.seen: list[tuple[int, list[int]]] = []

    def training_step(self, batch, batch_idx):
        x, y, ids = batch
        self.seen.append((self.global_step, ids.tolist()))
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(tmp_path, checkpoints=None, ckpt_path=None):
    callbacks = [
        HardSampleReplay(replay_fraction=0.5),
        PulseCycle(burst=4, replay=4, maintain=2, warmup=0, anneal=0),
    ]
    if checkpoints is not None:
        callbacks.append(
            ModelCheckpoint(
                dirpath=checkpoints, every_n_train_steps=SAVED_AT, save_top_k=-1, filename="{step}"
            )
        )
    model = Recorder()
    trainer = pl.Trainer(
        max_epochs=3,
        callbacks=callbacks,
        default_root_dir=tmp_path,
        **trainer_kwargs(enable_checkpointing=checkpoints is not None),
    )
    loader = DataLoader(Points(), batch_size=BATCH, sampler=ClassBalanced())
    trainer.fit(model, loader, ckpt_path=ckpt_path)
    return model, trainer


def _weights_apart(a: nn.Module, b: nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def test_a_resume_inside_a_pass_of_a_sampler_drawing_with_replacement_trains_the_uninterrupted_runs_samples(
    tmp_path,
):
    # a sweep: a class-balanced WeightedRandomSampler(replacement=True) seeded per epoch, saved mid-pass: the
    # resumed pass chose its rest from a table holding scores of samples trained earlier in the same pass,
    # so from the first step after the resume it trained other samples (weights 0.05 apart), with no word
    full, trainer = _fit(tmp_path / "full", checkpoints=tmp_path / "ckpt")
    saved = tmp_path / "ckpt" / f"step={SAVED_AT}.ckpt"
    resumed, again = _fit(tmp_path / "resumed", ckpt_path=str(saved))
    after = [entry for entry in full.seen if entry[0] >= SAVED_AT]
    assert again.global_step == trainer.global_step
    assert resumed.seen == after
    assert _weights_apart(full, resumed) == 0.0

    stream = next(
        s for k, s in torch.load(saved, weights_only=False)["callbacks"].items() if "HardSampleReplay" in k
    )["stream"]
    assert 0 < stream["batches"] < 18  # inside a pass of an epoch that began before the checkpoint
    kept = stream["pass_scores"]  # the pass-start scores of the samples the pass trained so far, no more
    assert 0 < kept["slots"].numel() <= stream["samples"]
    assert kept["slots"].unique().numel() == kept["slots"].numel()

    # an older checkpoint, without the pass-start scores, still resumes (choosing from the scores it holds)
    older = torch.load(saved, weights_only=False)
    for key, state in older["callbacks"].items():
        if "HardSampleReplay" in key:
            del state["stream"]["pass_scores"]
    torch.save(older, tmp_path / "older.ckpt")
    _, from_older = _fit(tmp_path / "older", ckpt_path=str(tmp_path / "older.ckpt"))
    assert from_older.global_step == trainer.global_step


def test_a_pass_of_a_sampler_drawing_with_replacement_chosen_in_small_blocks_trains_what_one_block_does(
    tmp_path, monkeypatch
):
    # the later blocks of a pass are chosen when the DataLoader reaches them; a sample drawn again there was
    # read with the score it got earlier in the pass, so the samples trained depended on the block size
    whole, _ = _fit(tmp_path / "whole")
    monkeypatch.setattr(PlannedBatchSampler, "CHOOSE_BLOCK", 2)
    blocks, _ = _fit(tmp_path / "blocks")
    assert blocks.seen == whole.seen
    assert _weights_apart(whole, blocks) == 0.0


def test_the_table_reads_a_pass_as_it_began_and_carries_what_it_needs_for_that():
    table = SampleScoreTable(6, half_life=4.0)
    table.update(np.array([0, 1, 2]), np.array([1.0, 2.0, 3.0], dtype=np.float32), step=0)
    table.begin_pass(5)
    before = table.pass_start_array(np.arange(6), 7, prior=2.0)
    table.update(np.array([1, 3]), np.array([9.0, 4.0], dtype=np.float32), step=5)
    table.update_steps(np.array([1, 2]), np.array([8.0, 7.0], dtype=np.float32), [2], [6])
    np.testing.assert_array_equal(table.pass_start_array(np.arange(6), 7, prior=2.0), before)
    assert table.effective_array(np.array([1]), 7, prior=2.0)[0] != before[1]
    state = table.pass_start_state()
    assert state is not None and state["slots"].tolist() == [1, 2, 3]  # those written in the pass only
    assert state["scores"][:2].tolist() == [2.0, 3.0] and np.isnan(state["scores"][2].item())

    resumed = SampleScoreTable(6, half_life=4.0)
    resumed.load_state_dict(table.state_dict())
    resumed.begin_pass(5, state)
    np.testing.assert_array_equal(resumed.pass_start_array(np.arange(6), 7, prior=2.0), before)
    resumed.begin_pass(8)  # the next pass begins with the scores as they are now
    np.testing.assert_array_equal(
        resumed.pass_start_array(np.arange(6), 9, prior=2.0), resumed.effective_array(np.arange(6), 9, 2.0)
    )


@pytest.mark.parametrize(
    ("sampler", "once"),
    [
        (SequentialSampler(range(10)), True),
        (RandomSampler(range(10)), True),
        (RandomSampler(range(10), replacement=True), False),
        (RandomSampler(range(10), num_samples=15), False),
        (WeightedRandomSampler(torch.ones(10), 10), False),
    ],
)
def test_which_samplers_draw_each_index_once_in_a_pass(sampler, once):
    assert draws_each_index_once(sampler) is once
