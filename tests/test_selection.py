"""Selection rules, batch surgery, the score table, the selector (no Trainer) and sample-index tracking."""

from __future__ import annotations

import math
from collections import UserDict, namedtuple

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

from lightning_pulse.core.replay import (
    MODEL_PARALLEL_REFUSAL,
    SELECTED,
    UNSEEN,
    HardSampleSelector,
    ReplayConfig,
    gather_rows,
    parse_half_life,
    setup_refusal,
    validate_replay_args,
)
from lightning_pulse.core.sample_index import SampleIndexTracker
from lightning_pulse.core.sample_scores import BYTES_PER_SAMPLE, SampleScoreTable
from lightning_pulse.core.selection import (
    assign_in_place,
    concatenated_parts,
    containers_copied,
    cut_refusal,
    infobatch_prune,
    select_random,
    select_topk,
    take_samples,
    whole_parts,
)
from lightning_pulse.errors import PulseRefusal
from tests.conftest import AttributeStoredMapping

NAN = math.nan


# ---------------------------------------------------------------------- rules
def test_topk_keeps_the_highest_scores_and_every_never_scored_sample():
    scores = torch.tensor([0.1, 0.9, NAN, 0.5, 0.7, NAN])
    selection = select_topk(scores, 4)
    assert selection.positions.tolist() == [1, 2, 4, 5]
    assert selection.threshold == pytest.approx(0.7)
    # never-scored samples are kept even beyond the count
    assert select_topk(scores, 1).positions.tolist() == [2, 5]


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
def test_take_follows_any_batch_structure():
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


def test_parts_a_full_batch_held_whole_stay_whole_at_a_batch_as_long_as_them():
    # a (10,) class-weight vector and 10 class names, whole at batches of 16, read as the samples' at an
    # epoch's last batch of 10 and cut with them (a sweep: cross_entropy failed on weights of 5)
    names = [f"class {k}" for k in range(10)]

    def batch(size: int) -> dict:
        return {"x": torch.randn(size, 4), "y": (torch.arange(size), names), "w": torch.arange(10.0)}

    whole = whole_parts(batch(16), 16)
    # the (y, names) structure too: at a last batch of 2 it stays a structure, not 2 samples' items
    assert whole == {"batch['y']": ("tuple", 2), "batch['y'][1]": ("list", 10), "batch['w']": (10,)}
    last = batch(10)
    taken = take_samples(last, torch.tensor([7, 2]), 10, whole=whole)
    assert taken["x"].shape == (2, 4) and taken["y"][0].tolist() == [7, 2]  # the samples are cut
    assert taken["w"] is last["w"] and taken["y"][1] == names
    assert take_samples(last, torch.tensor([7, 2]), 10)["w"].tolist() == [7.0, 2.0]  # by shape alone: cut
    # a part of another size than the full batch showed is judged by its shape, as before
    assert take_samples({"w": torch.arange(12.0)}, torch.tensor([1]), 12, whole=whole)["w"].tolist() == [1.0]


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


def test_batch_encodings_dataclasses_and_per_sample_lists_are_cut_in_place_in_step():
    from dataclasses import dataclass

    from transformers import BatchEncoding

    encoding = BatchEncoding({"input_ids": torch.arange(8).view(4, 2), "labels": torch.arange(4)})
    assign_in_place(encoding, take_samples(encoding, torch.tensor([2, 0]), 4))
    assert encoding["labels"].tolist() == [2, 0] and encoding["input_ids"].tolist() == [[4, 5], [0, 1]]

    @dataclass
    class Batch:
        x: torch.Tensor
        y: torch.Tensor
        note: str = "kept"

    batch = Batch(torch.arange(4.0), torch.arange(4))
    assign_in_place(batch, take_samples(batch, torch.tensor([3, 1]), 4))
    assert batch.x.tolist() == [3.0, 1.0] and batch.y.tolist() == [3, 1] and batch.note == "kept"

    # a detection collate: stacked images and one target dict per image, which follow their images
    images = torch.arange(4.0)
    detection = (images, [{"id": i} for i in range(4)])
    assign_in_place(detection, take_samples(detection, torch.tensor([1, 2]), 4))
    assert images.tolist() == [1.0, 2.0] and [t["id"] for t in detection[1]] == [1, 2]
    # the top-level list is the batch's container, even when its length is the batch size
    pair = [torch.arange(2.0), torch.arange(2)]
    assert len(take_samples(pair, torch.tensor([1]), 2)) == 2


def test_a_batch_that_cannot_be_cut_in_place_is_named_before_any_step():
    from dataclasses import dataclass
    from types import MappingProxyType

    @dataclass(frozen=True)
    class Frozen:
        x: torch.Tensor

    class GraphBatch:  # an object of its own, as graph libraries collate
        def __init__(self) -> None:
            self.x = torch.zeros(4, 3)

    for batch in (Frozen(torch.zeros(4)), MappingProxyType({"x": torch.zeros(4)}), GraphBatch()):
        reason = cut_refusal(batch, 4)
        assert reason and type(batch).__name__ in reason and "mode='steps'" in reason
    for batch in ((torch.zeros(4), [{"id": 0}] * 4), {"x": torch.zeros(4), "n": 3}, [torch.zeros(4), "tag"]):
        assert cut_refusal(batch, 4) is None


def test_a_tuple_of_per_sample_items_is_cut_where_it_can_be_replaced_and_refused_in_a_tuple():
    # held-out sweep: zip(*items) in a collate_fn gives the samples' names as a tuple, which no cut followed:
    # x, y and idx held the kept samples, names all B, names[i] another sample's, with no word
    x, names = torch.arange(4.0), ("a", "b", "c", "d")
    for batch in ([x.clone(), names], {"x": x.clone(), "names": names}):
        assert cut_refusal(batch, 4) is None
        assign_in_place(batch, take_samples(batch, torch.tensor([1, 3]), 4))
        parts = list(batch.values()) if isinstance(batch, dict) else batch
        assert parts[0].tolist() == [1.0, 3.0] and parts[1] == ("b", "d")  # still a tuple, as collated
    # a tuple batch cannot replace its parts, and only a tensor can change in place: refused, naming the part
    tupled = (x.clone(), torch.arange(4), names)
    reason = cut_refusal(tupled, 4)
    assert reason and "batch[2]" in reason and "list" in reason and "mode='steps'" in reason
    assert "batch[1][1]" in cut_refusal((x, (x, ({"id": 0},) * 4)), 4)  # found wherever a tuple holds it
    assert cut_refusal((x, [x, ({"id": 0},) * 4]), 4) is None  # a list holding it replaces it
    with pytest.raises(TypeError, match="tuple"):  # never zipped short, re-pointing others' tensors
        assign_in_place((x, tuple(torch.zeros(2) for _ in range(4))), (x, (torch.ones(2),) * 2))
    # a tuple of per-sample tensors (a multi-task target), or a named tuple, is a structure cut part by part
    y1, y2 = torch.arange(4), torch.arange(4) * 10
    structured = (x.clone(), (y1, y2))
    assert cut_refusal(structured, 4) is None and cut_refusal((x, (y1, y2, y1, y2)), 4) is None
    assign_in_place(structured, take_samples(structured, torch.tensor([0, 2]), 4))
    assert y1.tolist() == [0, 2] and y2.tolist() == [0, 20]


def test_a_tuple_of_variable_length_sequences_one_of_them_b_long_is_cut_by_sample():
    # held-out sweep: zip(*items) of token sequences of lengths 3, 4, 2, 5 with B = 4 was read as a structure
    # because one sequence is 4 long: that one was cut along its tokens, the others kept whole, with no word
    x = torch.arange(4.0)
    batch = [x.clone(), tuple(torch.arange(length) for length in (3, 4, 2, 5))]
    assert cut_refusal(batch, 4) is None
    assign_in_place(batch, take_samples(batch, torch.tensor([1, 2]), 4))
    assert batch[0].tolist() == [1.0, 2.0] and [s.tolist() for s in batch[1]] == [[0, 1, 2, 3], [0, 1]]
    # a tuple batch cannot shorten it in place (Tensor.set_ would re-point the sequences): refused
    tupled = (x.clone(), tuple(torch.arange(length) for length in (3, 4, 2, 5)))
    assert "batch[1] is a tuple of 4 per-sample items" in cut_refusal(tupled, 4)
    # a tuple whose every part holds B rows is still a structure, also when it has B parts
    y1, y2 = torch.tensor([1, 2]), torch.tensor([10, 20])
    pair = [torch.arange(2.0), (y1, y2)]
    assert cut_refusal(pair, 2) is None
    assign_in_place(pair, take_samples(pair, torch.tensor([1]), 2))
    assert pair[0].tolist() == [1.0] and [t.tolist() for t in pair[1]] == [[2], [20]]


def test_a_tuple_holding_a_names_tuple_is_cut_where_a_dict_or_list_replaces_it_whole():
    # held-out sweep: {"x": x, "target": (y, names)} was refused ("batch['target'][1] is a tuple of 4
    # per-sample items") though the cut rebuilds the inner tuple and the dict replaces it whole
    x, y, names = torch.arange(4.0), torch.arange(4), ("a", "b", "c", "d")
    for batch in ([x.clone(), (y.clone(), names)], {"x": x.clone(), "target": (y.clone(), names)}):
        assert cut_refusal(batch, 4) is None
        assign_in_place(batch, take_samples(batch, torch.tensor([1, 3]), 4))
        first, (labels, kept_names) = batch.values() if isinstance(batch, dict) else batch
        assert first.tolist() == [1.0, 3.0] and labels.tolist() == [1, 3] and kept_names == ("b", "d")
    # held by a tuple batch it is changed in place, which the names tuple cannot be: still refused
    assert "batch[1][1] is a tuple of 4 per-sample items" in cut_refusal((x, (y, names)), 4)
    assert "batch[1][0][1]" in cut_refusal((x, ((y, names),)), 4)


def _target_batch(outer: str, size: int) -> list | tuple | dict:
    """``[x, (y, class_w, count)]``: a ``(B,)`` target, a ``(5,)`` class weight and a 0-dim count."""
    x = torch.arange(size * 2.0).reshape(size, 2)
    target = (torch.arange(size) * 10, torch.linspace(0.1, 0.5, 5), torch.tensor(float(size)))
    if outer == "dict":
        return {"x": x, "target": target}
    return [x, target] if outer == "list" else (x, target)


@pytest.mark.parametrize("outer", ["list", "tuple", "dict"])
def test_a_structure_tuple_as_long_as_the_short_last_batch_is_cut_part_by_part_as_the_first_batch_was(outer):
    # held-out sweep: the first batch (B = 8) passed cut_refusal, then the short last batch of 3 read
    # (y, class_w, count) as 3 samples' items and cut it as such: a list or dict batch lost a part (unpacking
    # crashed), a tuple one was refused mid-run. Unlike parts are a structure at any B: y is cut, the rest kept.
    for size, positions in ((8, [0, 2, 5]), (3, [0, 2])):
        batch = _target_batch(outer, size)
        assert cut_refusal(batch, size) is None
        assign_in_place(batch, take_samples(batch, torch.tensor(positions), size))
        x, (y, class_w, count) = batch.values() if isinstance(batch, dict) else batch
        assert x[:, 0].tolist() == [2.0 * p for p in positions]
        assert y.tolist() == [10 * p for p in positions]
        assert class_w.shape == (5,) and count.dim() == 0 and count.item() == size
    # the same with a 0-dim weight between two per-sample parts, (y, weight, lengths)
    parts = [torch.arange(3.0), (torch.arange(3), torch.tensor(1.0), torch.tensor([4, 5, 6]))]
    assign_in_place(parts, take_samples(parts, torch.tensor([1, 2]), 3))
    assert parts[1][0].tolist() == [1, 2] and parts[1][1].dim() == 0 and parts[1][2].tolist() == [5, 6]


class _MultiTaskPairs(Dataset):
    """Samples ``(x, (y1, y2))``, which ``default_collate`` makes ``[x, [y1, y2]]``: lists, not tuples."""

    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int):
        return torch.tensor([float(i)]), (torch.tensor(i), torch.tensor(10 * i))


def test_a_nested_list_as_long_as_the_short_last_batch_is_cut_part_by_part_as_the_first_batch_was():
    # review: default_collate's [x, [y1, y2]] passed at the batches of 4, then the short last batch of 2 read
    # [y1, y2] as 2 samples' items and kept one uncut (2,) tensor: y1 was lost, y2 held both samples
    batches = list(DataLoader(_MultiTaskPairs(), batch_size=4))
    assert [len(b[0]) for b in batches] == [4, 2] and type(batches[1][1]) is list
    for batch, last in zip(batches, (3, 5)):
        size = len(batch[0])
        assert cut_refusal(batch, size) is None
        assign_in_place(batch, take_samples(batch, torch.tensor([size - 1]), size))
        assert batch[0].tolist() == [[float(last)]]
        assert batch[1][0].tolist() == [last] and batch[1][1].tolist() == [10 * last]
    # unlike parts, [y, class_w, count] on a short last batch of 3, as a list too: y cut, the rest kept
    parts = [torch.arange(3.0), [torch.arange(3), torch.linspace(0.1, 0.5, 5), torch.tensor(3.0)]]
    assign_in_place(parts, take_samples(parts, torch.tensor([0, 2]), 3))
    assert parts[0].tolist() == [0.0, 2.0] and parts[1][0].tolist() == [0, 2]
    assert parts[1][1].shape == (5,) and parts[1][2].item() == 3.0


def test_names_or_ids_with_a_missing_one_are_still_cut_by_sample():
    # review: ("a", None, "c") of an optional field was read as unlike parts, a structure, and kept whole
    # next to the kept samples
    for names in (("a", None, "c"), [None, 7, 9], (None, None, None)):
        batch = [torch.arange(3.0), names]
        assert cut_refusal(batch, 3) is None
        assign_in_place(batch, take_samples(batch, torch.tensor([0, 2]), 3))
        assert batch[0].tolist() == [0.0, 2.0] and batch[1] == type(names)(names[i] for i in (0, 2))


@pytest.mark.parametrize("size", [2, 3, 8])
def test_per_sample_lists_that_collate_fns_make_are_cut_by_sample_at_any_batch_size(size):
    # a batch of 2 or 3 is as long as many structures: the lists below are still one item per sample
    targets = [
        {"boxes": torch.rand(i % 3 + 1, 4), "labels": torch.full((i % 3 + 1,), i)} for i in range(size)
    ]
    sequences = [torch.full((size + i,), i) for i in range(size)]  # the first one B long by chance
    names = [f"img{i}.png" for i in range(size)]
    ids = list(range(100, 100 + size))
    batch = {"images": torch.arange(float(size)), "targets": targets, "tokens": sequences}
    batch.update(names=names, ids=ids)
    assert cut_refusal(batch, size) is None
    positions = [0, size - 1]
    assign_in_place(batch, take_samples(batch, torch.tensor(positions), size))
    assert batch["images"].tolist() == [float(p) for p in positions]
    assert [int(t["labels"][0]) for t in batch["targets"]] == positions
    assert [t["boxes"].shape[0] for t in batch["targets"]] == [p % 3 + 1 for p in positions]
    assert [s.tolist() for s in batch["tokens"]] == [[p] * (size + p) for p in positions]
    assert batch["names"] == [f"img{p}.png" for p in positions]
    assert batch["ids"] == [100 + p for p in positions]


@pytest.mark.parametrize("size", [3, 4, 8])
def test_per_sample_lists_of_items_that_differ_a_little_are_still_cut_by_sample(size):
    # review 19: a detection target with an optional key, an empty image's `torch.tensor([])` boxes, ids mixing
    # int and float, metadata dicts of different keys: all one item per sample, kept whole while the images were
    # cut (2 images kept with all 8 targets: the model zipped them into mismatched pairs)
    targets = [
        {"boxes": torch.rand(i % 3 + 1, 4), "labels": torch.full((i % 3 + 1,), i)} for i in range(size)
    ]
    targets[1]["iscrowd"] = torch.zeros(2)
    boxes = [torch.rand(i % 3 + 1, 4) for i in range(size)]
    boxes[1] = torch.tensor([])
    scale = [1.5 if i % 2 else i for i in range(size)]
    meta = [{"id": i} if i % 2 else {"id": i, "flipped": True} for i in range(size)]
    batch = [torch.arange(float(size)), targets, boxes, scale, meta]
    assert cut_refusal(batch, size) is None
    positions = [0, size - 1]
    assign_in_place(batch, take_samples(batch, torch.tensor(positions), size))
    assert batch[0].tolist() == [float(p) for p in positions]
    assert [int(t["labels"][0]) for t in batch[1]] == positions
    assert [b.shape[0] for b in batch[2]] == [p % 3 + 1 for p in positions]
    assert batch[3] == [1.5 if p % 2 else p for p in positions] and [m["id"] for m in batch[4]] == positions


def test_a_structure_with_an_absent_part_is_cut_part_by_part_on_a_batch_of_two():
    # review 19: `(ids, None)` at B=2 was cut as two samples, to `(None,)`: the ids were lost
    for size in (2, 8):
        batch = {
            "inputs": (torch.arange(float(size * 7)).view(size, 7), None),
            "y": torch.arange(float(size)),
        }
        assert cut_refusal(batch, size) is None
        assign_in_place(batch, take_samples(batch, torch.tensor([1]), size))
        ids, absent = batch["inputs"]
        assert (
            absent is None
            and ids.tolist() == [[float(v) for v in range(7, 14)]]
            and batch["y"].tolist() == [1.0]
        )


def test_a_time_major_batch_or_one_without_a_per_sample_part_is_refused_but_batch_first_ones_are_cut():
    # held-out sweep: a (T, B) batch cut along its first dimension is cut along time
    b = 4
    refused = {
        "time-major": ((torch.zeros(7, b), torch.zeros(b)), "(7, 4)"),
        "time-major features": ({"x": torch.zeros(7, b, 3), "y": torch.zeros(b)}, "(7, 4, 3)"),
        "a lone time-major tensor": (torch.zeros(7, b), "(7, 4)"),
        "no per-sample part": ({"count": torch.tensor(9), "tokens": torch.zeros(3)}, "no per-sample part"),
        "a top-level list of sequences": ([torch.zeros(3), torch.zeros(5)], "no per-sample part"),
    }
    for name, (batch, said) in refused.items():
        reason = cut_refusal(batch, b)
        assert reason and said in reason and "mode='steps'" in reason, name
    weighted = {"count": torch.tensor(9), "x": torch.zeros(b, 3), "class_weight": torch.ones(10)}
    fine = {
        "images whose channels and height equal B": ([torch.zeros(b, b, b, 5), torch.zeros(b)], b),
        "a square (B, B) tensor": ((torch.zeros(b, b),), b),
        "a 0-dim count and a class-weight vector": (weighted, b),
        "variable-length sequences": (
            {"tokens": [torch.zeros(n) for n in (3, 9, 2, 5)], "y": torch.zeros(b)},
            b,
        ),
        "a batch of one (never cut), time-major": ((torch.zeros(7, 1), torch.zeros(1)), 1),
    }
    for name, (batch, size) in fine.items():
        assert cut_refusal(batch, size) is None, name
    kept = take_samples(weighted, torch.tensor([0, 2]), b)
    assert kept["x"].shape == (2, 3) and kept["class_weight"].shape == (10,) and int(kept["count"]) == 9


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


# ---------------------------------------------------------------------- selector
def _selector(rule="topk", size=8, **kwargs):
    return HardSampleSelector(SampleScoreTable(size), ReplayConfig(rule=rule, **kwargs))


@pytest.mark.parametrize("rule", ["topk", "random", "infobatch"])
def test_selector_never_cuts_a_batch_to_one_sample(rule):
    """An epoch's short last batch of 2 was cut to 1 sample, and BatchNorm raised mid-run ("Expected more than 1
    value per channel when training"); a cut that would keep one sample trains the batch whole."""
    # InfoBatch keeps its own share (prune_ratio): replay_fraction is refused there
    selector = _selector(rule, **({} if rule == "infobatch" else {"replay_fraction": 0.3}))
    indices = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7])
    selector.record(
        indices, torch.arange(8.0), selector.compose(indices, 0, 0).roles, 0, active=True, offered=8
    )
    selector.apply()
    for step, last in enumerate((torch.tensor([6, 7]), torch.tensor([5, 6, 7])), start=1):
        composed = selector.compose(last, step=step, batch_idx=9)
        assert composed.indices.numel() >= 2, composed
    assert selector.compose(torch.tensor([7]), step=3, batch_idx=9).indices.tolist() == [
        7
    ]  # one offered: kept


def test_selector_cuts_a_batch_to_its_hardest_samples_once_they_are_scored():
    selector = _selector(replay_fraction=0.5)
    indices = torch.tensor([7, 2, 5, 0])
    first = selector.compose(indices, step=0, batch_idx=0)
    assert first.positions is None and first.indices.tolist() == [7, 2, 5, 0]  # nothing scored: all kept
    assert (first.roles == UNSEEN).all()
    selector.record(indices, torch.tensor([0.1, 3.0, 0.2, 2.0]), first.roles, step=0, active=True, offered=4)
    assert selector.table.seen == 0  # kept until applied in bulk
    selector.apply()
    second = selector.compose(indices, step=1, batch_idx=1)
    assert second.positions.tolist() == [1, 3] and second.indices.tolist() == [2, 0]
    assert (second.roles == SELECTED).all() and second.weights is None
    metrics = selector.metrics()
    assert metrics["table_seen"] == 4 and metrics["replay_fraction"] == 1.0


def test_selector_applies_in_bulk_what_it_would_apply_step_by_step():
    def run(apply_every):
        selector = _selector("topk", size=32)
        selector.apply_every, selector.threshold_every = apply_every, 100
        generator = torch.Generator().manual_seed(0)
        for step in range(12):  # indices repeat across steps
            indices = torch.randperm(32, generator=generator)[:8]
            roles = np.full(8, SELECTED)
            selector.record(indices, torch.rand(8, generator=generator), roles, step, active=True, offered=16)
        selector.apply()
        return selector

    bulk, single = run(32), run(1)
    assert bulk.table.seen > 8
    assert bulk.table.scores.tobytes() == single.table.scores.tobytes()
    assert bulk.table.replays.tolist() == single.table.replays.tolist()
    # the totals too (the threshold, and with it the learned rate, follows when steps were applied)
    for name in ("replay_fraction", "active_share", "loss_replayed", "came_back_rate"):
        assert bulk.metrics()[name] == pytest.approx(single.metrics()[name])
    assert bulk.metrics()["replay_fraction"] == 0.5


def test_infobatch_selector_weights_kept_below_mean_samples():
    selector = _selector("infobatch", size=8, prune_ratio=0.5)
    indices = torch.arange(8)
    selector.table.update(indices, torch.tensor([0.1, 0.1, 0.1, 0.1, 5.0, 5.0, 5.0, 5.0]), step=0)
    chosen = selector.compose(indices, step=1, batch_idx=0)
    assert selector.threshold == pytest.approx(2.55)
    assert {4, 5, 6, 7} <= set(chosen.indices.tolist()) and chosen.indices.numel() < 8
    assert chosen.weights is not None and chosen.weights.max() > chosen.weights.min()


def test_gathered_rows_come_back_in_rank_order_with_uneven_batches():
    per_rank = {
        0: (torch.tensor([0, 1, 2]), torch.tensor([0.5, 1.5, 2.5]), np.array([1, 1, 2]), 3.0),
        1: (torch.tensor([3, 4]), torch.tensor([3.5, 4.5]), np.array([1, 0]), 2.0),
    }
    calls = []

    def fake_all_gather(tensor):  # what each rank would send at this call, padded to one shape
        call = len(calls)
        calls.append(tensor)
        if call == 0:
            return torch.stack([torch.tensor([3.0, 3.0]), torch.tensor([2.0, 2.0])]).double()
        other = torch.full_like(tensor, math.nan)
        other[:2, 0], other[:2, 1], other[:2, 2] = (
            3.0 + torch.arange(2.0),
            torch.tensor([3.5, 4.5]),
            torch.tensor([1.0, 0.0]),
        )
        return torch.stack([tensor, other])

    indices, losses, roles, offered = gather_rows(fake_all_gather, *per_rank[0])
    assert indices.tolist() == [0, 1, 2, 3, 4]
    assert losses.tolist() == pytest.approx([0.5, 1.5, 2.5, 3.5, 4.5])
    assert roles.tolist() == [1, 1, 2, 1, 0] and offered == 5.0


def test_selector_state_round_trips_unapplied_steps_and_totals():
    selector = _selector("random", size=16, seed=1)
    selector.threshold_every = 100  # a threshold refresh would apply the kept steps
    for step in range(3):
        indices = torch.arange(step * 4, step * 4 + 4)
        chosen = selector.compose(indices, step, batch_idx=step)
        selector.record(chosen.indices, torch.rand(4), chosen.roles, step, active=True, offered=4)
    state = selector.state_dict()
    assert state["unapplied"]["sizes"] == [4, 4, 4]
    restored = _selector("random", size=16, seed=1)
    restored.load_state_dict(state)
    assert restored.table.seen == 0
    restored.apply(), selector.apply()
    assert restored.table.scores.tobytes() == selector.table.scores.tobytes()
    assert restored.metrics() == pytest.approx(selector.metrics(), nan_ok=True)


def test_the_selector_for_new_data_keeps_a_table_of_its_size_and_takes_a_state_restored_before_it():
    selector = _selector("topk", size=8)
    selector.record(torch.arange(4), torch.rand(4), np.full(4, SELECTED), 0, active=True, offered=4)
    kept = HardSampleSelector.for_data(selector, 8, SampleScoreTable, selector.config)
    assert kept is selector and kept.state_dict()["unapplied"] is None  # measured on the data before: dropped
    scored = _selector("topk", size=6)
    scored.table.update(torch.arange(3), torch.tensor([1.0, 2.0, 3.0]), step=0)
    resized = HardSampleSelector.for_data(selector, 6, SampleScoreTable, selector.config, scored.state_dict())
    assert resized is not selector and resized.table.num_samples == 6 and resized.table.seen == 3
    with pytest.raises(PulseRefusal, match="HardSampleReplay: the checkpoint's sample scores cover 6"):
        HardSampleSelector.for_data(None, 5, SampleScoreTable, selector.config, scored.state_dict())


def test_the_half_life_in_epochs_follows_the_epoch_length_and_needs_one():
    selector = _selector(size=4)
    selector.set_half_life(parse_half_life(2.0), steps_per_epoch=30)
    assert selector.table.half_life == 60
    selector.set_half_life(parse_half_life("500steps"), steps_per_epoch=None)
    assert selector.table.half_life == 500
    with pytest.raises(ValueError, match="has no length"):
        selector.set_half_life(parse_half_life(2.0), steps_per_epoch=None)


def test_a_logger_gets_the_window_figures_that_have_a_value_and_the_run_end_says_if_nothing_was_selected():
    selector = _selector(size=8)
    indices = torch.arange(4)
    chosen = selector.compose(indices, step=0, batch_idx=0)  # nothing scored yet: every sample is unseen
    selector.record(chosen.indices, torch.rand(4), chosen.roles, 0, active=True, offered=4)
    assert selector.window_steps == 0  # kept, not applied yet
    assert selector.end_run().startswith("nothing was selected in this run. 1 steps")
    assert selector.window_steps == 1
    metrics = selector.window_metrics()
    assert metrics["hard_sample_replay/table_seen"] == 4 and metrics["hard_sample_replay/loss_fresh"] > 0
    assert "hard_sample_replay/loss_replayed" not in metrics  # NaN: nothing replayed yet
    assert "hard_sample_replay/threshold" not in metrics
    assert selector.window_steps == 0  # a new window
    assert "hard_sample_replay/replay_fraction" not in selector.window_metrics()  # an empty one: no figure


def test_setup_refusals_name_the_first_reason_and_the_mode_follows_the_rule():
    assert setup_refusal(False, None, None) is None
    assert setup_refusal(True, "LearningRateFinder", "net") == MODEL_PARALLEL_REFUSAL
    assert "the attached LearningRateFinder" in setup_refusal(False, "LearningRateFinder", "net")
    assert setup_refusal(False, None, "encoder").startswith("cannot capture the loss of encoder")
    assert validate_replay_args("replay", None, "topk", None, None) == (("replay",), "steps")
    assert validate_replay_args(["replay"], None, "infobatch", None, None) == (("replay",), "batch")
    with pytest.raises(ValueError, match="needs batches of a count known in advance"):
        validate_replay_args(["replay"], "steps", "infobatch", None, None)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"rule": "proportional"}, "rule"),
        ({"replay_fraction": 0}, "replay_fraction"),
        ({"prune_ratio": -0.1}, "prune_ratio"),
    ],
)
def test_replay_config_names_the_bad_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ReplayConfig(**kwargs)


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


def test_concatenated_parts_finds_ctc_targets_next_to_their_lengths_and_not_padded_or_packed_ones():
    # held-out sweep: batch mode cut the (B,) target lengths but kept torch.cat(targets) whole, and CTC failed
    # mid-run with a size error that did not name the callback
    generator = torch.Generator().manual_seed(0)
    targets = [torch.randint(1, 6, (int(n),), generator=generator) for n in (2, 4, 3, 4, 2, 3, 4, 4)]
    lengths = torch.tensor([len(t) for t in targets])
    frames = torch.full((8,), 15)
    concatenated = {"x": torch.randn(8, 15, 4), "in_len": frames, "targets": torch.cat(targets)}
    concatenated["tgt_len"] = lengths
    assert concatenated_parts(concatenated, 8) == {("batch['targets']", "the sum of batch['tgt_len']"): 26}
    assert concatenated_parts([concatenated["x"], torch.cat(targets), lengths], 8) == {
        ("batch[1]", "the sum of batch[2]"): 26
    }
    padded = torch.nn.utils.rnn.pad_sequence(targets, batch_first=True)  # (B, S): cut by sample
    assert concatenated_parts({"targets": padded, "tgt_len": lengths}, 8) == {}
    # a per-batch constant as long as B or shorter is never taken for one, whatever the labels sum to
    labels = torch.tensor([0, 1, 0, 0, 1, 0, 0, 0])
    assert concatenated_parts([torch.randn(8, 3), labels, torch.tensor([0.3, 0.7])], 8) == {}
    # a PackedSequence's batch_sizes (6 steps) sum its 4 rows' sorted_indices (0 + 1 + 2 + 3) by chance
    packed = torch.nn.utils.rnn.pack_sequence([torch.randn(n) for n in (6, 5, 3, 2)], enforce_sorted=False)
    assert len(packed.batch_sizes) == 6 and int(packed.sorted_indices.sum()) == 6
    assert concatenated_parts([packed, torch.tensor([1, 0, 1, 1])], 4) == {}


def test_concatenated_parts_takes_lengths_from_a_list_or_tuple_and_finds_offsets_and_cumulative_lengths():
    # review of the twentieth pass: CTC's target_lengths as a tuple or list of ints (nn.CTCLoss takes them),
    # nn.EmbeddingBag's (B,) offsets and packed tokens' (B + 1,) cu_seqlens were missed: batch mode crashed
    # mid-run or trained on other samples' items
    lengths = [2, 4, 3, 4, 2, 3, 4, 4]
    targets = torch.randint(1, 6, (26,))
    for given in (lengths, tuple(lengths)):
        assert concatenated_parts({"targets": targets, "tgt_len": given}, 8) == {
            ("batch['targets']", "the sum of batch['tgt_len']"): 26
        }
    cumulative = torch.tensor([0, *lengths]).cumsum(0)  # (B + 1,), ending at 26
    assert concatenated_parts([torch.tensor([1, 0, 2, 3, 0, 1, 2, 3]), targets, cumulative[:-1]], 8) == {
        ("batch[1]", "split at the offsets batch[2]"): 26
    }
    assert concatenated_parts({"ids": targets, "cu_seqlens": cumulative}, 8) == {
        ("batch['ids']", "split by the cumulative lengths batch['cu_seqlens']"): 26
    }
    # not lengths, offsets or cumulative lengths: a list of names, floats, labels of one class, unsorted labels,
    # a (B + 1,) vector ending short of the tensor
    assert concatenated_parts([targets, ["a"] * 8, [0.5] * 8], 8) == {}
    assert concatenated_parts([targets, torch.zeros(8, dtype=torch.long)], 8) == {}
    assert concatenated_parts([targets, torch.tensor([0, 3, 1, 2, 0, 1, 2, 3])], 8) == {}
    assert concatenated_parts([targets, cumulative - torch.arange(9)], 8) == {}


def test_containers_copied_copies_dicts_and_user_dicts_and_keeps_other_mappings_by_reference():
    # review of 7988f9e: a MutableMapping's copy shared its entries attribute, so the nested copies were
    # written into the user's batch, and a key training_step deleted left the copy too
    meta = {"ids": [1, 2]}
    store = AttributeStoredMapping({"x": torch.ones(2), "meta": meta})
    assert containers_copied(store) is store and store["meta"] is meta
    for batch in ({"x": torch.ones(2), "meta": meta}, UserDict({"x": torch.ones(2), "meta": meta})):
        copied = containers_copied(batch)
        assert copied is not batch and type(copied) is type(batch) and batch["meta"] is meta
        del batch["x"]
        assert "x" in copied and copied["meta"] == meta and copied["meta"] is not meta
