"""Selection rules, batch surgery, the score table, the hard-sample buffer and sample-index tracking."""

from __future__ import annotations

import math
from collections import namedtuple

import numpy as np
import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    TensorDataset,
)

from lightning_pulse.core.sample_index import SampleIndexTracker
from lightning_pulse.core.sample_scores import BYTES_PER_SAMPLE, HardSampleBuffer, SampleScoreTable
from lightning_pulse.core.selection import (
    assign_in_place,
    batch_size_of,
    concat_samples,
    infobatch_prune,
    select_proportional,
    select_random,
    select_topk,
    take_samples,
)

NAN = math.nan


# ---------------------------------------------------------------------- rules
def test_topk_keeps_the_highest_scores_and_every_never_scored_sample():
    scores = torch.tensor([0.1, 0.9, NAN, 0.5, 0.7, NAN])
    selection = select_topk(scores, 4)
    assert selection.positions.tolist() == [1, 2, 4, 5]
    assert selection.threshold == pytest.approx(0.7)
    # never-scored samples are kept even beyond the count
    assert select_topk(scores, 1).positions.tolist() == [2, 5]


def test_proportional_draws_high_losses_more_often_and_never_drops_unseen():
    scores = torch.tensor([0.01, 0.01, 0.01, 5.0, NAN])
    generator = torch.Generator().manual_seed(0)
    picks = np.zeros(5)
    for _ in range(400):
        picks[select_proportional(scores, 2, generator).positions.numpy()] += 1
    assert picks[4] == 400  # the unseen sample every time
    assert picks[3] > 390  # 5.0 against 0.01: nearly always the second pick
    assert picks[:3].sum() < 10


def test_random_control_spends_what_topk_spends_but_ignores_scores():
    scores = torch.tensor([0.0, 0.0, 0.0, 0.0, 9.0, 9.0, NAN])
    generator = torch.Generator().manual_seed(0)
    counts = np.zeros(7)
    for _ in range(300):
        selection = select_random(scores, 3, generator)
        assert selection.count == select_topk(scores, 3).count == 3
        counts[selection.positions.numpy()] += 1
    assert counts[6] == 300
    # the two 9.0 samples are not favoured: each of the six scored samples gets about 2/6 of the 600 picks
    assert np.all(np.abs(counts[:6] - 100) < 40)


def test_infobatch_weights_make_the_kept_mean_an_unbiased_estimate_of_the_full_mean():
    losses = torch.tensor([0.1, 0.2, 0.3, 0.4, 2.0, 3.0, 4.0, 5.0])
    threshold, ratio = float(losses.mean()), 0.5
    generator = torch.Generator().manual_seed(0)
    estimates, kept = [], []
    for _ in range(4000):
        selection = infobatch_prune(losses, threshold, ratio, generator)
        estimates.append(float((losses[selection.positions] * selection.weights).mean()))
        kept.append(selection.count)
        below = losses[selection.positions] < threshold
        scale = selection.count / losses.numel()
        assert torch.allclose(
            selection.weights[below], torch.full_like(selection.weights[below], scale / (1 - ratio))
        )
        assert torch.allclose(selection.weights[~below], torch.full_like(selection.weights[~below], scale))
    assert np.mean(estimates) == pytest.approx(float(losses.mean()), rel=0.02)
    # four samples are below the mean, each dropped half the time
    assert np.mean(kept) == pytest.approx(8 - 4 * ratio, abs=0.1)


def test_infobatch_keeps_unseen_and_above_threshold_samples():
    scores = torch.tensor([NAN, 0.1, 10.0])
    selection = infobatch_prune(
        scores, threshold=1.0, prune_ratio=0.99, generator=torch.Generator().manual_seed(3)
    )
    assert {0, 2} <= set(selection.positions.tolist())
    with pytest.raises(ValueError, match="prune_ratio"):
        infobatch_prune(scores, 1.0, 1.0)


# ---------------------------------------------------------------------- batches
def test_take_and_concat_follow_any_batch_structure():
    Pair = namedtuple("Pair", "x y")
    batch = {
        "pair": Pair(torch.arange(4.0), torch.arange(4) * 10),
        "text": list("abcd"),
        "shared": torch.ones(3),
    }
    taken = take_samples(batch, torch.tensor([3, 1]), 4)
    assert taken["pair"].x.tolist() == [3.0, 1.0] and taken["pair"].y.tolist() == [30, 10]
    assert taken["text"] == ["d", "b"]
    assert taken["shared"] is batch["shared"]  # not per-sample: shared by the batch
    joined = concat_samples(taken, take_samples(batch, torch.tensor([0]), 4), 2, 1)
    assert joined["pair"].x.tolist() == [3.0, 1.0, 0.0] and joined["text"] == ["d", "b", "a"]
    assert batch_size_of(joined) == 3


def test_assign_in_place_changes_lists_dicts_and_tensors_held_by_tuples():
    listed = [torch.arange(4.0), torch.arange(4)]
    ref = listed
    assign_in_place(listed, take_samples(listed, torch.tensor([0, 2]), 4))
    assert ref is listed and listed[0].tolist() == [0.0, 2.0]

    x, y = torch.arange(4.0), torch.arange(4)
    tupled = (x, y)
    assign_in_place(tupled, take_samples(tupled, torch.tensor([1, 3]), 4))
    assert tupled[0] is x and x.tolist() == [1.0, 3.0] and y.tolist() == [1, 3]

    with pytest.raises(TypeError, match="tuple"):
        assign_in_place((["a", "b"], "label"), (["a"], "other"))


# ---------------------------------------------------------------------- score table
def test_stale_scores_fade_toward_the_running_mean_by_half_life():
    table = SampleScoreTable(4, half_life=10)
    table.update(torch.tensor([0, 1]), torch.tensor([4.0, 0.0]), step=0)
    assert table.prior == pytest.approx(2.0)
    now = table.effective(torch.tensor([0, 1, 2]), step=10)
    # one half-life later each score is halfway to the prior 2.0; index 2 was never scored
    assert now[:2].tolist() == pytest.approx([3.0, 1.0])
    assert math.isnan(now[2])
    table.update(torch.tensor([0]), torch.tensor([5.0]), step=10)  # seen again: refreshed, age 0
    assert float(table.effective(torch.tensor([0]), step=10)) == pytest.approx(5.0)


def test_repeated_indices_merge_into_their_mean():
    table = SampleScoreTable(3)
    table.update(torch.tensor([2, 0, 2]), torch.tensor([1.0, 5.0, 3.0]), step=1)
    assert table.scores.tolist()[0] == 5.0 and table.scores.tolist()[2] == 2.0


def test_reuse_and_learned_rates_count_replayed_samples():
    table = SampleScoreTable(5)
    table.update(torch.arange(5), torch.tensor([5.0, 4.0, 3.0, 2.0, 1.0]), step=0)
    table.mark_replayed(torch.tensor([0, 1]))
    table.update(torch.tensor([0, 1]), torch.tensor([0.5, 4.5]), step=1, threshold=3.0)  # 0 learned, 1 not
    table.mark_replayed(torch.tensor([1]))  # 1 came back
    stats = table.stats()
    assert stats["replayed_distinct"] == 2
    assert stats["learned_rate"] == pytest.approx(0.5)
    assert stats["came_back_rate"] == pytest.approx(0.5)
    assert stats["table_bytes"] == 5 * BYTES_PER_SAMPLE


@pytest.mark.parametrize(
    ("losses", "expected"),
    [
        ([2.0, 2.0, 2.0, 2.0], 1.0),  # every sample alike: the easier half carries its whole share
        ([0.0, 0.0, 3.0, 5.0], 0.0),  # the easier half learned
        ([4.0, 1.0, 3.0, 2.0], 0.6),  # (1 + 2) / (10 * 2 / 4)
        ([1.0, 4.0, 1.0], 0.5),  # odd count: the easier 1 of 3 against a third of the total, 1 / (6 / 3)
    ],
)
def test_easy_half_loss_ratio_weighs_the_easier_half_against_its_fair_share(losses, expected):
    table = SampleScoreTable(len(losses) + 2)  # two entries never scored, which must not count
    table.update(torch.arange(len(losses)), torch.tensor(losses), step=0)
    assert table.easy_half_loss_ratio() == pytest.approx(expected)
    assert table.stats()["easy_half_loss_ratio"] == pytest.approx(expected)


def test_easy_half_loss_ratio_is_nan_where_it_means_nothing():
    assert math.isnan(SampleScoreTable(4).easy_half_loss_ratio())  # nothing scored
    one = SampleScoreTable(4)
    one.update(torch.tensor([1]), torch.tensor([2.0]), step=0)
    assert math.isnan(one.easy_half_loss_ratio())
    zeros = SampleScoreTable(4)
    zeros.update(torch.arange(4), torch.zeros(4), step=0)
    assert math.isnan(zeros.easy_half_loss_ratio())
    negative = SampleScoreTable(4)  # e.g. a Gaussian negative log-likelihood from a custom scorer
    negative.update(torch.arange(4), torch.tensor([-1.0, 2.0, 3.0, 4.0]), step=0)
    assert math.isnan(negative.easy_half_loss_ratio())
    learnability = SampleScoreTable(4, score="learnability")
    learnability.update(torch.arange(4), torch.tensor([1.0, 2.0, 3.0, 4.0]), step=0)
    assert math.isnan(learnability.easy_half_loss_ratio())


def _state_arrays(table):
    return [table.scores.tobytes(), table.steps.tolist(), table.replays.tolist(), table.awaiting.tolist()] + [
        table.learned.tolist(),
        table.prior,
    ]


@pytest.mark.parametrize("repeat", [False, True], ids=["distinct", "sample-measured-twice"])
def test_several_steps_applied_at_once_equal_step_by_step_updates(repeat):
    generator = torch.Generator().manual_seed(0)
    sizes = [4, 3, 4]
    indices = torch.tensor(
        [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10] if not repeat else [0, 1, 2, 3, 4, 5, 6, 0, 8, 9, 10]
    )
    losses = torch.rand(11, generator=generator) * 4
    losses[5] = NAN  # a non-finite loss is not written, but its sample still counts as replayed
    replayed = np.zeros(11, dtype=bool)
    replayed[[1, 5, 8]] = True
    steps, thresholds = [3, 4, 5], [1.0, 2.0, NAN]

    def seeded():
        table = SampleScoreTable(12, half_life=10)
        table.update(torch.arange(12), torch.linspace(0.5, 3.0, 12), step=0)
        table.mark_replayed(torch.tensor([0, 2, 4, 8]))  # awaiting: judged learned or not at the next measure
        return table

    one_by_one, together = seeded(), seeded()
    start = 0
    for size, step, threshold in zip(sizes, steps, thresholds):
        part = slice(start, start + size)
        one_by_one.update(indices[part], losses[part], step, threshold, may_repeat=False)
        one_by_one.mark_replayed(indices[part][torch.from_numpy(replayed[part])], may_repeat=False)
        start += size
    together.update_steps(indices, losses, sizes, steps, thresholds, replayed=replayed)

    assert one_by_one.learned.any() and one_by_one.replays.max() >= 1
    assert _state_arrays(together)[:5] == _state_arrays(one_by_one)[:5]
    assert together.prior == pytest.approx(one_by_one.prior, rel=1e-12)


def test_learnability_scores_are_each_loss_above_the_samples_own_best():
    table = SampleScoreTable(3, score="learnability")
    table.update(torch.arange(3), torch.tensor([2.0, 5.0, 1.0]), step=0)
    assert table.scores.tolist() == [0.0, 0.0, 0.0]  # first measure: the sample's best so far
    table.update(torch.arange(3), torch.tensor([1.0, 5.5, 3.0]), step=1)
    # 0 improved (nothing left to reduce), 1 stays hard (irreducible-looking), 2 was learned and forgotten
    assert table.scores.tolist() == pytest.approx([0.0, 0.5, 2.0])
    assert table.hardest(1, step=2).tolist() == [2]
    restored = SampleScoreTable(3, score="learnability")
    restored.load_state_dict(table.state_dict())
    assert restored.minima.tolist() == [1.0, 5.0, 1.0]
    with pytest.raises(ValueError, match="learnability"):
        SampleScoreTable(3).load_state_dict(table.state_dict())
    with pytest.raises(ValueError, match="score"):
        SampleScoreTable(3, score="margin")


def test_hardest_skips_recently_trained_and_excluded_samples():
    table = SampleScoreTable(6)
    table.update(torch.arange(6), torch.tensor([1.0, 9.0, 8.0, 7.0, 2.0, 3.0]), step=0)
    table.update(torch.tensor([1]), torch.tensor([9.5]), step=10)
    picked = table.hardest(2, step=10, exclude=torch.tensor([2]), recent_steps=3)
    assert picked.tolist() == [3, 5]


def test_table_state_round_trips_and_refuses_another_dataset():
    table = SampleScoreTable(4, half_life=5)
    table.update(torch.tensor([1, 3]), torch.tensor([0.5, 2.5]), step=7)
    table.mark_replayed(torch.tensor([3]))
    restored = SampleScoreTable(4, half_life=5)
    restored.load_state_dict(table.state_dict())
    assert np.array_equal(restored.scores, table.scores, equal_nan=True)
    assert restored.replays.tolist() == table.replays.tolist() and restored.prior == table.prior
    with pytest.raises(ValueError, match="different dataset"):
        SampleScoreTable(5).load_state_dict(table.state_dict())


# ---------------------------------------------------------------------- buffer
def test_buffer_keeps_the_hardest_samples_within_capacity():
    buffer = HardSampleBuffer(capacity=3)
    x = torch.arange(5.0).unsqueeze(1).repeat(1, 2)
    batch = [x, torch.arange(5)]
    entered = buffer.offer(batch, torch.tensor([0.1, 5.0, 0.2, 4.0, 3.0]), step=0)
    assert entered == 3 and buffer.size == 3
    slots, replay = buffer.take(3, step=1)
    assert sorted(replay[1].tolist()) == [1, 3, 4]  # the samples themselves, by their label
    assert torch.equal(replay[0][:, 0], replay[1].float())
    # a harder sample displaces the weakest
    buffer.offer([torch.full((1, 2), 9.0), torch.tensor([9])], torch.tensor([10.0]), step=2)
    _, replay = buffer.take(3, step=3)
    assert sorted(replay[1].tolist()) == [1, 3, 9]
    assert buffer.memory_bytes == 3 * BYTES_PER_SAMPLE + 3 * 2 * 4 + 3 * 8
    restored = HardSampleBuffer(capacity=3)
    restored.load_state_dict(buffer.state_dict())
    assert torch.equal(restored.take(3, step=3)[1][1], replay[1])


# ---------------------------------------------------------------------- sample indices
class _IndexDataset(Dataset):
    """Each sample carries its own index, so a test can check what the tracker says."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int):
        return torch.tensor([float(index)]), index


def _check_all_batches(loader, tracker, start=0):
    seen = []
    for batch_idx, (x, labels) in enumerate(loader, start=start):
        indices = tracker.batch_indices(batch_idx)
        assert indices.tolist() == labels.tolist() == x[:, 0].long().tolist()
        assert tracker.batch_indices(batch_idx) is indices  # a second caller gets the same answer
        seen += indices.tolist()
    return seen


def test_tracker_follows_shuffling_and_worker_processes_across_epochs():
    loader = DataLoader(_IndexDataset(50), batch_size=8, shuffle=True, num_workers=2)
    tracker = SampleIndexTracker.install(loader)
    assert SampleIndexTracker.install(loader) is tracker
    first = _check_all_batches(loader, tracker)
    second = _check_all_batches(loader, tracker, start=3)  # a batch_idx that does not start at 0 (resume)
    assert sorted(first) == sorted(second) == list(range(50)) and first != second


def test_tracker_sees_each_ranks_global_indices_under_a_distributed_sampler():
    dataset = _IndexDataset(30)
    sampler = DistributedSampler(dataset, num_replicas=2, rank=1, shuffle=True, seed=3)
    loader = DataLoader(dataset, batch_size=4, sampler=sampler)
    tracker = SampleIndexTracker.install(loader)
    sampler.set_epoch(2)
    seen = _check_all_batches(loader, tracker)
    assert seen == list(sampler)
    SampleIndexTracker.uninstall(loader)
    assert loader.batch_sampler.sampler is sampler


def test_untrackable_loaders_say_why():
    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(3))

    assert "IterableDataset" in SampleIndexTracker.unsupported_reason(DataLoader(Stream()))
    dataset = TensorDataset(torch.arange(10))

    class OddBatches(BatchSampler):
        def __iter__(self):
            yield [0, 1, 2]

    custom = DataLoader(dataset, batch_sampler=OddBatches(range(10), 3, False))
    assert "custom batch sampler" in SampleIndexTracker.unsupported_reason(custom)
    with pytest.raises(ValueError, match="custom batch sampler"):
        SampleIndexTracker.install(custom)
