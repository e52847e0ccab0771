"""Trainer-free tests of :class:`~lightning_pulse.core.replay_data.ReplayData`: HardSampleReplay's training
data (index tracker, selector, scores restored before the data) across set-ups of the DataLoader and across
fits."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_pulse.core.replay import ReplayConfig, parse_half_life
from lightning_pulse.core.replay_data import ReplayData
from lightning_pulse.core.sample_index import RecordingSampler
from lightning_pulse.errors import PulseRefusal


def _loader(samples: int = 12, batch_size: int = 4) -> DataLoader:
    return DataLoader(TensorDataset(torch.arange(samples, dtype=torch.float32)), batch_size=batch_size)


def _scored(data: ReplayData) -> None:
    assert data.selector is not None
    data.selector.table.update(torch.arange(3), torch.tensor([1.0, 2.0, 3.0]), step=0)


def test_attaching_tracks_the_loader_and_sizes_the_selector_with_the_half_life_in_epochs_of_it():
    data, loader = ReplayData(ReplayConfig(), parse_half_life(2.0)), _loader(samples=12, batch_size=4)
    assert data.table is None and math.isnan(data.threshold) and not data.ready
    data.attach(loader, at=(0, 0), accumulate=2)
    assert isinstance(loader.batch_sampler.sampler, RecordingSampler) and data.tracker is not None
    assert data.ready and data.loader is loader and data.table is data.selector.table
    assert (
        data.table.num_samples == 12 and data.table.half_life == 4
    )  # 2 epochs of 2 steps (3 batches, 2 a step)


def test_a_second_loader_of_the_same_set_up_is_refused_and_a_later_set_up_or_the_tracked_loader_is_not():
    data, loader = ReplayData(ReplayConfig()), _loader()
    assert data.loader_refusal(_loader(), at=(0, 0)) is None  # nothing tracked yet
    data.attach(loader, at=(0, 0))
    second = data.loader_refusal(_loader(), at=(0, 0))
    assert second is not None and "CombinedLoader" in second
    assert data.loader_refusal(loader, at=(0, 0)) is None
    assert data.loader_refusal(_loader(), at=(1, 3)) is None  # a reload at a later epoch
    data.detach()
    assert data.loader_refusal(_loader(), at=(0, 0)) is None and data.tracker is None and data.loader is None


def test_a_reload_keeps_the_scores_for_the_same_samples_and_starts_again_with_a_note_for_another_length():
    data, notes = ReplayData(ReplayConfig()), []
    dataset = TensorDataset(torch.arange(12.0))
    data.attach(DataLoader(dataset, batch_size=4), at=(0, 0), warn=notes.append)
    _scored(data)
    kept = data.selector
    data.attach(DataLoader(dataset, batch_size=4), at=(1, 3), warn=notes.append)
    assert data.selector is kept and data.table.seen == 3 and notes == [None, None]
    data.attach(_loader(samples=10), at=(2, 6), warn=notes.append)
    assert data.selector is not kept and data.table.num_samples == 10 and data.table.seen == 0
    assert notes[-1] is not None and "another length" in notes[-1]


def test_scores_loaded_before_the_data_wait_for_it_and_a_load_while_ready_applies_at_once():
    source = ReplayData(ReplayConfig())
    source.attach(_loader(), at=(0, 0))
    _scored(source)
    saved = source.state_dict(stream={"step": 7})
    assert saved["stream"] == {"step": 7} and "stream" not in source.state_dict()
    resumed = ReplayData(ReplayConfig())
    assert resumed.load_state_dict(saved) == {"step": 7}  # the stream goes back to its owner
    assert resumed.selector is None and "stream" not in resumed.state_dict()  # kept as it came
    assert resumed.state_dict()["table"] is saved["table"]
    resumed.attach(_loader(), at=(0, 0))
    assert resumed.table.seen == 3 and resumed.state_dict()["table"] is not saved["table"]
    resumed.selector.table.update(torch.arange(3, 6), torch.ones(3), step=1)
    assert resumed.load_state_dict(saved) is not None and resumed.table.seen == 3  # at once: a rollback


def test_restored_scores_of_another_dataset_size_fail_when_the_data_comes():
    source = ReplayData(ReplayConfig())
    source.attach(_loader(samples=12), at=(0, 0))
    resumed = ReplayData(ReplayConfig())
    resumed.load_state_dict(source.state_dict())
    with pytest.raises(
        PulseRefusal, match="scores cover 12 training samples, and this fit's training data holds 8"
    ):
        resumed.attach(_loader(samples=8), at=(0, 0))


def test_starting_refuses_several_loaders_before_uncut_batches_and_warns_in_order():
    data = ReplayData(ReplayConfig(replay_fraction=0.5), parse_half_life(2.0))
    data.attach(_loader(samples=12, batch_size=2), at=(0, 0))  # half of 2 samples keeps 1: too few to cut
    several = data.start_refusal([_loader(), _loader()], mode="batch")
    assert several is not None and several.startswith("needs one training DataLoader")
    uncut = data.start_refusal(_loader(), mode="batch")
    assert uncut is not None and uncut.startswith("cannot cut batches of 2 sample(s)")
    assert data.start_refusal(_loader(), mode="steps") is None
    notes: list[str | None] = []
    data.start_training(4, log_every=2, planned_steps=4, mode="batch", optimizers=2, warn=notes.append)
    assert len(notes) == 2 and "2 optimizers" in notes[0] and "no sample trains twice" in notes[1]
    assert data.table.half_life == 8 and data.selector.threshold_every == 2 and data.selector.apply_every == 2
    notes.clear()
    data.start_training(4, log_every=2, planned_steps=40, warn=notes.append)
    assert notes == [None]  # no note for the optimizers when the module does not step them itself
    with pytest.raises(ValueError, match="in epochs"):
        data.start_training(None, log_every=2, planned_steps=math.inf)
