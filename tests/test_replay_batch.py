"""A replay run's batch life cycle without a Trainer: plan, cut in place, capture the loss, record."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from lightning_pulse.core.replay import SELECTED, UNTOUCHED, HardSampleSelector, ReplayConfig
from lightning_pulse.core.replay_batch import ReplayBatchLifecycle, StepInFlight
from lightning_pulse.core.sample_scores import SampleScoreTable
from lightning_pulse.errors import PulseRefusal


def _data(size: int = 8) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(size, 3, generator=generator), torch.randint(0, 4, (size,), generator=generator)]


def _started(size: int = 8) -> tuple[ReplayBatchLifecycle, HardSampleSelector]:
    batches = ReplayBatchLifecycle("batch")
    batches.start_fit()
    return batches, HardSampleSelector(SampleScoreTable(size), ReplayConfig("topk", replay_fraction=0.5))


def _train(
    batches: ReplayBatchLifecycle,
    selector: HardSampleSelector,
    model: nn.Module,
    batch: list,
    step: int,
    active: bool,
) -> StepInFlight:
    """One training step as HardSampleReplay's hooks drive it (indices 0..B-1, batch_idx = step)."""
    started = batches.start_batch(selector, batch, torch.arange(len(batch[0])), step, step, active)
    loss = F.cross_entropy(model(batch[0]), batch[1])
    batches.close_capture()
    finished = batches.finish_batch(model, batch, outputs=loss)
    assert finished is started and batches.current is None
    batches.check_carried_state(finished)
    return finished


def test_a_light_batch_is_cut_in_place_to_its_hardest_samples_and_their_captured_losses_are_recorded():
    torch.manual_seed(0)
    model, (x, y) = nn.Linear(3, 4), _data()
    batches, selector = _started()
    try:
        first = _train(batches, selector, model, [x, y], step=0, active=False)  # scores every sample
        assert first.plan.roles.tolist() == [UNTOUCHED] * 8 and first.offered_count == 8
        selector.apply()
        with torch.no_grad():
            losses = F.cross_entropy(model(x), y, reduction="none")
        np.testing.assert_allclose(selector.table.scores, losses.numpy(), rtol=1e-6)

        batch = [x, y]
        light = _train(batches, selector, model, batch, step=1, active=True)
        hardest = torch.sort(torch.topk(losses, 4).indices).values
        assert light.plan.indices.tolist() == hardest.tolist() and light.plan.roles.tolist() == [SELECTED] * 4
        assert torch.equal(batch[0], x[hardest]) and torch.equal(batch[1], y[hardest])  # cut in place
        assert light.offered_count == 8 and light.plan.offered == 8.0
        selector.apply()
        assert selector.table.steps.tolist() == [1 if i in hardest.tolist() else 0 for i in range(8)]
        assert selector.totals["selected_count"] == 4 and selector.totals["untouched_count"] == 8
    finally:
        batches.release()


def test_a_step_dropped_in_flight_records_nothing():
    model, (x, y) = nn.Linear(3, 4), _data()
    batches, selector = _started()
    try:
        batches.start_batch(selector, [x, y], torch.arange(8), step=0, batch_idx=0, active=False)
        F.cross_entropy(model(x), y)
        batches.drop_step()  # a rollback: the model this step was measured on is replaced
        assert batches.current is None
        assert batches.finish_batch(model, [x, y], outputs=None) is None
        selector.apply()
        assert selector.totals["steps"] == 0 and selector.table.seen == 0
    finally:
        batches.release()


class _CarriesState(nn.Module):
    """A stateful module: each batch reads the state the previous one stored, shaped by the batch size."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 4)
        self.state: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x) if self.state is None else self.linear(x) + self.state
        self.state = out.detach()
        return out


def test_a_cut_is_refused_before_it_is_made_while_the_module_holds_batch_shaped_state():
    model, (x, y) = _CarriesState(), _data()
    batches, selector = _started()
    try:
        _train(batches, selector, model, [x, y], step=0, active=False)
        selector.apply()  # every sample scored: the next light batch is cut
        batch = [x, y]
        with pytest.raises(
            PulseRefusal, match=r"^HardSampleReplay cannot cut the batches .* `state` \(tensor"
        ):
            batches.start_batch(selector, batch, torch.arange(8), step=1, batch_idx=1, active=True)
        assert batch[0] is x and batch[1] is y and batches.current is None  # nothing was cut or started
    finally:
        batches.release()


def test_the_batch_size_is_the_recorded_indices_not_a_reading_of_the_batch():
    # held-out sweep: Lightning's reading (the first tensor's dim 0) took a 0-dim count for a batch of 1 and a
    # time-major (T, B) tensor for a batch of T, and the run failed with a RuntimeError blaming the collate_fn
    batches = ReplayBatchLifecycle("steps")
    batches.start_fit()
    selector = HardSampleSelector(SampleScoreTable(8), ReplayConfig("topk", replay_fraction=0.5))
    try:
        for batch in (
            {"num_tokens": torch.tensor(37), "tokens": [torch.arange(n) for n in range(3, 11)]},
            [torch.zeros(5, 8, dtype=torch.long), torch.zeros(8)],
        ):
            started = batches.start_batch(selector, batch, torch.arange(8), step=0, batch_idx=0, active=True)
            assert started.batch_size == 8 and started.offered_count == 8
            batches.drop_step()
    finally:
        batches.release()


def test_batch_mode_refuses_a_time_major_batch_at_the_first_batch_only():
    # a (T, B) batch cut along its first dimension would be cut along time: refused before any step
    batches, selector = _started()
    try:
        time_major = [torch.zeros(5, 8), torch.zeros(8)]
        with pytest.raises(PulseRefusal, match=r"^HardSampleReplay cannot cut .*\(5, 8\).*mode='steps'"):
            batches.start_batch(selector, time_major, torch.arange(8), step=0, batch_idx=0, active=False)
        assert batches.current is None
    finally:
        batches.release()
    # a first batch of one sample says nothing of the layout: the first batch of two or more is checked
    batches, selector = _started()
    try:
        batches.start_batch(
            selector, [torch.zeros(5, 1), torch.zeros(1)], torch.arange(1), 0, 0, active=False
        )
        batches.drop_step()
        with pytest.raises(PulseRefusal, match=r"\(5, 8\)"):
            batches.start_batch(
                selector, [torch.zeros(5, 8), torch.zeros(8)], torch.arange(8), 1, 1, active=True
            )
    finally:
        batches.release()
    # a later batch is not checked: a short last batch of 3 next to a (1, 3, 1, 1) statistic, or a (2, 3)
    # per-batch table, trains (checking every batch refused such runs mid-way)
    batches, selector = _started()
    try:
        first = [torch.zeros(8, 3, 4, 4), torch.zeros(8), torch.zeros(1, 3, 1, 1)]
        batches.start_batch(selector, first, torch.arange(8), step=0, batch_idx=0, active=False)
        batches.drop_step()
        last = [torch.zeros(3, 3, 4, 4), torch.zeros(3), torch.zeros(2, 3)]
        batches.start_batch(selector, last, torch.arange(3), step=1, batch_idx=1, active=True)
        assert batches.current is not None
    finally:
        batches.release()


def test_batch_mode_follows_a_first_batch_square_tensor_and_refuses_it_later_when_time_major():
    # held-out sweep: (T, B) tokens with T == B at the first batch told neither layout, and a later batch was
    # cut along time; the places that were (B, B) are read on every later batch, before its cut
    batches, selector = _started(32)
    try:
        first = [torch.zeros(8, 8), torch.zeros(8, 8, dtype=torch.bool), torch.zeros(8)]
        batches.start_batch(selector, first, torch.arange(8), step=0, batch_idx=0, active=False)
        batches.drop_step()
        batches.start_batch(selector, first, torch.arange(8, 16), step=1, batch_idx=1, active=False)
        batches.drop_step()
        later = [torch.zeros(5, 8), torch.zeros(8, 5, dtype=torch.bool), torch.zeros(8)]
        with pytest.raises(PulseRefusal, match=r"\(5, 8\).*batch\[0\] was \(8, 8\).*mode='steps'"):
            batches.start_batch(selector, later, torch.arange(16, 24), step=2, batch_idx=2, active=True)
        assert batches.current is None
    finally:
        batches.release()
    # batch-first (B, L) tokens with L == B at the first batch, then another L, and a per-batch (2, 3) table
    # elsewhere on a short last batch of 3: trained (only the first batch's square places are read)
    batches, selector = _started(32)
    try:
        first = [torch.zeros(8, 8), torch.zeros(8), torch.zeros(2, 3)]
        batches.start_batch(selector, first, torch.arange(8), step=0, batch_idx=0, active=False)
        batches.drop_step()
        later = [torch.zeros(8, 5), torch.zeros(8), torch.zeros(2, 3)]
        batches.start_batch(selector, later, torch.arange(8, 16), step=1, batch_idx=1, active=False)
        batches.drop_step()
        last = [torch.zeros(3, 6), torch.zeros(3), torch.zeros(2, 3)]
        batches.start_batch(selector, last, torch.arange(16, 19), step=2, batch_idx=2, active=True)
        assert batches.current is not None
    finally:
        batches.release()
    # a review: a collate_fn that drops an unreadable sample gives batch-first (7, 8) tokens for 8 indices,
    # which looks time-major; it holds no tensor of B rows and is not cut, so it trains (unscored), as before
    batches, selector = _started(32)
    try:
        first = [torch.zeros(8, 8), torch.zeros(8)]
        batches.start_batch(selector, first, torch.arange(8), step=0, batch_idx=0, active=False)
        batches.drop_step()
        dropped = [torch.zeros(7, 8), torch.zeros(7)]
        batches.start_batch(selector, dropped, torch.arange(8, 16), step=1, batch_idx=1, active=True)
    finally:
        batches.release()


def _scored_infobatch() -> tuple:
    """A linear model, 16 samples, and a batch-mode InfoBatch selector (r = 0.5) that has scored them all,
    with their losses; the caller releases the lifecycle."""
    torch.manual_seed(0)
    model, (x, y) = nn.Linear(3, 4), _data(16)
    batches = ReplayBatchLifecycle("batch")
    batches.start_fit()
    selector = HardSampleSelector(SampleScoreTable(16), ReplayConfig("infobatch", prune_ratio=0.5))
    try:
        _train(batches, selector, model, [x, y], step=0, active=False)  # scores every sample
    except BaseException:
        batches.release()  # the loss capture it installed must not outlive the test
        raise
    selector.apply()
    with torch.no_grad():
        losses = F.cross_entropy(model(x), y, reduction="none")
    return model, x, y, batches, selector, losses


def test_an_infobatch_step_weights_a_sum_loss_to_estimate_the_loaded_batchs_sum():
    # held-out sweep: the weights carry k/n for a mean over the k kept samples, and a reduction="sum" loss got
    # them as they were: 0.76x the loaded batch's sum on the pruned steps, silently a smaller learning rate
    model, x, y, batches, selector, losses = _scored_infobatch()
    try:
        threshold = selector.current_threshold(1)
        batch = [x.clone(), y.clone()]
        light = batches.start_batch(selector, batch, torch.arange(16), step=1, batch_idx=1, active=True)
        kept = light.plan.indices
        assert 0 < len(kept) < 16 and torch.equal(batch[0], x[kept])  # pruned and cut
        weighted_sum = F.cross_entropy(model(batch[0]), batch[1], reduction="sum")
        batches.close_capture()
        batches.drop_step()
        # each kept sample stands for 1 / q of the loaded batch: q = 1 - r below the threshold, 1 above
        keep_probability = torch.where(losses[kept] < threshold, 0.5, 1.0)
        assert weighted_sum.item() == pytest.approx(float((losses[kept] / keep_probability).sum()), rel=1e-5)
    finally:
        batches.release()


def test_an_infobatch_step_keeping_half_of_an_all_easy_batch_still_weights_a_sum_loss():
    # held-out sweep: with r = 0.5 and 4 of 8 easy samples kept, each weight (1/q)(k/n) is exactly 1, read as
    # "nothing pruned" and dropped: a reduction="sum" loss got half the loaded batch's sum, with no word
    model, x, y, batches, selector, losses = _scored_infobatch()
    try:
        easy = torch.sort(torch.argsort(losses)[:8]).values  # 8 samples below the mean score
        assert bool((losses[easy] < selector.current_threshold(1)).all())
        kept_counts = set()
        for batch_idx in range(1, 25):  # the draws vary with batch_idx; each pruned step must weigh by 1 / q
            batch = [x[easy].clone(), y[easy].clone()]
            light = batches.start_batch(
                selector, batch, easy.clone(), step=1, batch_idx=batch_idx, active=True
            )
            weighted_sum = F.cross_entropy(model(batch[0]), batch[1], reduction="sum")
            batches.close_capture()
            batches.drop_step()
            kept = light.plan.indices
            kept_counts.add(len(kept))
            if len(kept) < 8:
                assert weighted_sum.item() == pytest.approx(float(losses[kept].sum() / 0.5), rel=1e-5)
        assert 4 in kept_counts  # the step whose weights are all exactly 1 was among them
    finally:
        batches.release()


def test_a_tuple_batch_holding_a_tuple_of_names_is_refused_at_the_first_batch_and_a_list_one_is_cut():
    # held-out sweep: zip(*items) gives the names as a tuple, which a tuple batch cannot change in place; the
    # cut left all B names next to the k kept samples, names[i] another sample's, with no word
    x, y = _data()
    dataset = [(x[i], y[i], i, f"sample{i}") for i in range(8)]

    def loader(container: type) -> DataLoader:
        def collate(items):
            xs, ys, ids, names = zip(*items)
            return container([torch.stack(xs), torch.stack(ys), torch.tensor(ids), names])

        return DataLoader(dataset, batch_size=8, collate_fn=collate)

    model = nn.Linear(3, 4)
    batches, selector = _started()
    try:
        batch = next(iter(loader(tuple)))
        with pytest.raises(
            PulseRefusal, match=r"batch\[3\] is a tuple of 8 per-sample items.*list.*mode='steps'"
        ):
            batches.start_batch(selector, batch, batch[2], step=0, batch_idx=0, active=False)
        assert batches.current is None
    finally:
        batches.release()
    batches, selector = _started()
    try:
        _train(batches, selector, model, next(iter(loader(list))), step=0, active=False)
        selector.apply()
        batch = next(iter(loader(list)))
        _train(batches, selector, model, batch, step=1, active=True)
        assert len(batch[2]) == 4 and batch[3] == tuple(f"sample{i}" for i in batch[2].tolist())
    finally:
        batches.release()


def _ctc_batch(seed: int) -> dict:
    """8 samples of 12 frames with their 2..4 labels concatenated, as a collate_fn makes nn.CTCLoss's 1-D
    targets (``torch.cat``), next to their lengths."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 5, (8,), generator=generator)
    return {
        "x": torch.randn(8, 12, 4, generator=generator),
        "in_len": torch.full((8,), 12),
        "targets": torch.randint(1, 6, (int(lengths.sum()),), generator=generator),
        "tgt_len": lengths,
    }


def _ctc_step(batches, selector, model, batch, step, active) -> None:
    started = batches.start_batch(selector, batch, torch.arange(8), step, step, active)
    log_probs = model(batch["x"]).log_softmax(-1).transpose(0, 1)
    loss = F.ctc_loss(log_probs, batch["targets"], batch["in_len"], batch["tgt_len"])
    batches.close_capture()
    assert batches.finish_batch(model, batch, outputs=loss) is started


def test_ctc_targets_concatenated_are_refused_before_the_second_batch_or_a_first_cut_one_trains():
    # held-out sweep: the cut kept 4 of 8 target lengths and all 26 targets; CTC stopped the fit mid-run with
    # a size error that did not name the callback (with lengths summing right, it would read others' labels)
    torch.manual_seed(0)
    model = nn.Linear(4, 6)
    batches, selector = _started()
    refused = (
        r"^HardSampleReplay cannot cut a batch of 8 samples in mode='batch': it holds batch\['targets'\]"
    )
    try:
        _ctc_step(batches, selector, model, _ctc_batch(0), step=0, active=False)  # scores the 8 samples
        second = _ctc_batch(1)
        with pytest.raises(PulseRefusal, match=refused + r" \(\d+ items, the sum of batch\['tgt_len'\]\)"):
            batches.start_batch(selector, second, torch.arange(8), step=1, batch_idx=1, active=False)
        assert batches.current is None
        selector.apply()
        batches.start_fit()  # a fit resumed on these scores: its first batch is cut, no second one confirms
        first = _ctc_batch(2)
        with pytest.raises(PulseRefusal, match=refused + r".*mode='steps'.*\(B, S\)"):
            batches.start_batch(selector, first, torch.arange(8), step=1, batch_idx=1, active=True)
        assert len(first["tgt_len"]) == 8 and len(first["targets"]) == int(first["tgt_len"].sum())  # uncut
    finally:
        batches.release()


def test_a_class_weight_vector_as_long_as_the_first_batchs_labels_sum_is_not_refused_and_kept_whole():
    # a (K,) per-batch constant matches the labels' sum by chance at one batch: the next one does not confirm
    torch.manual_seed(0)
    model, weights = nn.Linear(3, 10), torch.linspace(0.5, 1.5, 10)
    x = torch.randn(8, 3)
    labels = [torch.tensor([1, 1, 1, 1, 1, 1, 2, 2]), torch.tensor([3, 5, 9, 0, 2, 7, 4, 1])]  # sums 10, 31
    batches = ReplayBatchLifecycle("batch")
    batches.start_fit()
    selector = HardSampleSelector(SampleScoreTable(16), ReplayConfig("topk", replay_fraction=0.5))
    try:
        for step, (y, indices) in enumerate([(labels[0], torch.arange(8)), (labels[1], torch.arange(8, 16))]):
            batch = [x, y, weights]
            started = batches.start_batch(selector, batch, indices, step, step, active=False)
            loss = F.cross_entropy(model(batch[0]), batch[1], weight=batch[2])
            batches.close_capture()
            assert batches.finish_batch(model, batch, outputs=loss) is started
        selector.apply()
        batch = [x, labels[1], weights]
        light = batches.start_batch(selector, batch, torch.arange(8, 16), step=2, batch_idx=2, active=True)
        assert len(light.plan.indices) == 4 and len(batch[1]) == 4  # cut by sample
        assert batch[2] is weights and len(weights) == 10  # the constant kept whole
        batches.drop_step()
    finally:
        batches.release()


def test_sorted_labels_from_zero_next_to_a_shared_position_vector_match_the_same_way_twice_and_are_not_refused():
    # a review: a (B,) domain label [0]*4 + [1]*4 (or in-batch targets arange(B)) next to a shared arange(16)
    # position vector read as offsets on every batch, so the second batch "confirmed" it and a valid module was
    # refused; a constant splits the same way on every batch into unequal items, which no concatenation does
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    batches = ReplayBatchLifecycle("batch")
    batches.start_fit()
    selector = HardSampleSelector(SampleScoreTable(24), ReplayConfig("topk", replay_fraction=0.5))
    try:
        for step in range(3):
            x, y = torch.randn(8, 3), torch.randint(0, 2, (8,))
            batch = {"x": x, "y": y, "domain": torch.tensor([0] * 4 + [1] * 4), "pos": torch.arange(16)}
            indices = torch.arange(8 * min(step, 1), 8 * min(step, 1) + 8)  # the third: scored samples again
            started = batches.start_batch(selector, batch, indices, step, step, active=step == 2)
            loss = F.cross_entropy(model(batch["x"]), batch["y"])
            batches.close_capture()
            assert batches.finish_batch(model, batch, outputs=loss) is started
            selector.apply()
        assert (
            len(batch["x"]) == 4 and len(batch["pos"]) == 16
        )  # the third batch cut, the constant kept whole
    finally:
        batches.release()


def _joined_as(batch: dict, layout: str) -> dict:
    """``_ctc_batch``'s targets split by their lengths as a list or tuple of ints, by ``nn.EmbeddingBag``-style
    ``(B,)`` offsets or by ``(B + 1,)`` cumulative lengths (``cu_seqlens``) instead of a ``(B,)`` tensor."""
    lengths = batch.pop("tgt_len")
    cumulative = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    split = {
        "list": lengths.tolist(),
        "tuple": tuple(lengths.tolist()),
        "offsets": cumulative[:-1],
        "cu_seqlens": cumulative,
    }[layout]
    return {**batch, layout: split}


def _target_lengths(batch: dict) -> torch.Tensor:
    if "offsets" in batch:
        return torch.diff(batch["offsets"], append=torch.tensor([len(batch["targets"])]))
    if "cu_seqlens" in batch:
        return torch.diff(batch["cu_seqlens"])
    return torch.as_tensor(batch["list" if "list" in batch else "tuple"])


@pytest.mark.parametrize("layout", ["list", "tuple", "offsets", "cu_seqlens"])
def test_joined_targets_split_by_a_list_of_lengths_offsets_or_cu_seqlens_are_refused_at_the_second_batch(
    layout,
):
    # review of the twentieth pass: CTC lengths as a list or tuple of ints crashed at the first cut step with
    # torch's size error; EmbeddingBag offsets and cu_seqlens crashed later or trained on other samples' bags
    torch.manual_seed(0)
    model = nn.Linear(4, 6)
    batches, selector = _started()
    try:
        first = _joined_as(_ctc_batch(0), layout)
        started = batches.start_batch(selector, first, torch.arange(8), step=0, batch_idx=0, active=False)
        log_probs = model(first["x"]).log_softmax(-1).transpose(0, 1)
        loss = F.ctc_loss(log_probs, first["targets"], first["in_len"], _target_lengths(first))
        batches.close_capture()
        assert batches.finish_batch(model, first, outputs=loss) is started
        second = _joined_as(_ctc_batch(1), layout)
        with pytest.raises(
            PulseRefusal, match=rf"it holds batch\['targets'\] \(\d+ items, .*batch\['{layout}'\]"
        ):
            batches.start_batch(selector, second, torch.arange(8), step=1, batch_idx=1, active=False)
    finally:
        batches.release()
