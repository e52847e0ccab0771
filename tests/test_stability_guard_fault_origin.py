"""Where a non-finite step comes from, without a Trainer: the batch's rows, the model's state, the samples."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lightning_pulse.callbacks.stability_guard import StabilityGuard, StabilityGuardError
from lightning_pulse.core.fault_origin import (
    batch_sample_ids,
    describe_bad_samples,
    find_bad_samples,
    nonfinite_forward_state,
    nonfinite_rows,
    state_is_finite,
)
from lightning_pulse.core.sample_index import SampleIndexTracker
from tests.conftest import trainer_kwargs


def test_nonfinite_rows_are_found_in_every_floating_tensor_of_a_nested_batch():
    x = torch.zeros(4, 3)
    x[2, 1] = float("nan")
    mask = torch.ones(4, 5)
    mask[0, 4] = float("inf")
    batch = {"x": x, "extra": [mask, torch.arange(4)], "y": torch.tensor([0, 1, 2, 3])}
    assert nonfinite_rows(batch) == [0, 2]
    assert nonfinite_rows((torch.ones(4, 3), torch.arange(4))) == []
    assert (
        nonfinite_rows({"input_ids": torch.arange(8).view(2, 4)}) == []
    )  # integer data cannot be non-finite
    causal = torch.zeros(4, 4).masked_fill(torch.ones(4, 4).triu(1).bool(), float("-inf"))
    assert nonfinite_rows({"x": torch.zeros(4, 3), "mask": causal}) == []  # -inf: a mask, on purpose


def test_state_is_finite_looks_at_parameters_buffers_and_optimizer_state():
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    assert state_is_finite(model, [optimizer])
    model[1].running_mean[0] = float("nan")  # a forward pass on a NaN batch leaves this behind
    assert not state_is_finite(model, [optimizer])
    model[1].running_mean[0] = 0.0
    next(iter(optimizer.state.values()))["exp_avg_sq"].view(-1)[0] = float("inf")
    assert state_is_finite(model) and not state_is_finite(model, [optimizer])


def test_sample_ids_come_from_the_batch_or_the_loader_else_none():
    rows = [1, 3]
    assert batch_sample_ids({"x": torch.zeros(4), "index": torch.tensor([9, 8, 7, 6])}, rows) == [8, 6]
    assert batch_sample_ids((torch.zeros(4),), rows, torch.tensor([40, 41, 42, 43])) == [41, 43]
    assert batch_sample_ids((torch.zeros(4),), rows) is None
    assert batch_sample_ids((torch.zeros(4),), rows, torch.tensor([5])) is None  # does not line up


def test_find_bad_samples_reads_dataset_indices_from_an_installed_index_tracker():
    x = torch.zeros(20, 2)
    x[13, 0] = float("nan")
    loader = DataLoader(TensorDataset(x, torch.arange(20)), batch_size=5, shuffle=True)
    tracker = SampleIndexTracker.install(loader)
    found, labels = [], {}
    for batch_idx, batch in enumerate(loader):
        tracker.batch_indices(batch_idx)  # as HardSampleReplay asks for every batch
        found += find_bad_samples([(batch_idx, batch)], step=batch_idx, loader=loader)
        labels[batch_idx] = batch[1]
    assert len(found) == 1 and found[0]["indices"] == [13]
    assert labels[found[0]["batch_idx"]][found[0]["rows"]].tolist() == [13]  # the row within its batch
    assert describe_bad_samples(found) == f"batch {found[0]['batch_idx']} rows {found[0]['rows']} " + (
        "(dataset indices [13])"
    )
    assert describe_bad_samples([]) == "on another rank"


def test_trace_nonfinite_gives_every_rank_the_same_cause():
    from lightning_pulse.core.fault_origin import trace_nonfinite

    model = torch.nn.Linear(2, 1)
    clean = [(0, (torch.ones(3, 2), torch.zeros(3)))]
    dirty = [(0, (torch.tensor([[1.0, float("nan")], [1.0, 1.0], [1.0, 1.0]]), torch.zeros(3)))]
    assert trace_nonfinite(model, [], clean, step=7) == (None, [])
    cause, samples = trace_nonfinite(model, [], dirty, step=7)
    assert cause == "data" and samples == [{"step": 7, "batch_idx": 0, "rows": [0], "indices": None}]

    def other_rank(flags):  # two ranks: the other one's findings are (bad data, healthy state)
        return flags + torch.tensor([1.0, 0.0, 0.0])

    # this rank's batch was clean: it still agrees that the data is at fault, with no samples of its own
    assert trace_nonfinite(model, [], clean, step=7, all_reduce_sum=other_rank) == ("data", [])
    with torch.no_grad():
        model.weight[0, 0] = float("inf")
    assert trace_nonfinite(model, [], dirty, step=7, all_reduce_sum=other_rank) == ("state", [])


def test_bad_data_wins_over_the_forward_state_its_own_forward_made_non_finite():
    from lightning_pulse.core.fault_origin import trace_nonfinite
    from lightning_pulse.core.stability_steps import StabilityCore

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    core = StabilityCore(None, 3.0, 3.0, 20, 5, 2, 0, 10, 2, 0, 3)
    core.take_snapshot(0, model, [], [], {})
    model(torch.randn(8, 3))  # a healthy forward moves the running statistics away from the snapshot's
    healthy_mean = model[1].running_mean.clone()
    x = torch.randn(8, 3)
    x[2, 1] = float("nan")
    model(x)  # the bad row's forward writes NaN into the running statistics
    assert nonfinite_forward_state(model) == ["1.running_mean", "1.running_var"]
    cause, samples = trace_nonfinite(model, [], [(0, (x,))], step=9)
    assert cause == "data" and samples[0]["rows"] == [2]
    # with no bad data to explain it, the same state is the model's fault
    assert trace_nonfinite(model, [], [(0, (torch.ones(8, 3),))], step=9) == ("state", [])

    assert core.mend_forward_state(model) == ["1.running_mean", "1.running_var"]
    assert nonfinite_forward_state(model) == [] and state_is_finite(model)
    assert torch.equal(model[1].running_mean, torch.zeros(4))  # the snapshot's, not the healthy forward's
    assert not torch.equal(healthy_mean, torch.zeros(4))
    assert core.mend_forward_state(model) == []  # nothing left to mend


def test_mending_carried_state_hands_the_model_a_copy_never_the_snapshots_tensor():
    """A module updating its carried state in place (``self.h.copy_(h)``) wrote into the snapshot the guard had
    mended it from: the next bad batch put NaN into the snapshot itself, every later mend and rollback restored
    NaN, and the run ended on a NaN state after 3 rollbacks."""
    from lightning_pulse.core.stability_steps import StabilityCore

    class InPlaceState(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.cell = nn.Linear(3, 3)
            self.h = torch.zeros(2, 3)  # a plain attribute, updated in place

        def forward(self, x):
            h = torch.tanh(self.cell(x) + self.h)
            self.h.copy_(h.detach())
            return h

    model = InPlaceState()
    core = StabilityCore(None, 3.0, 3.0, 20, 5, 2, 0, 10, 2, 0, 3)
    core.take_snapshot(0, model, [], [], {})
    for _ in range(2):  # two bad batches, each mended
        model(torch.full((2, 3), float("nan")))
        assert core.mend_forward_state(model) == ["h"] and torch.isfinite(model.h).all()
    assert torch.equal(core.schedule.ring.newest().extra["carried"]["h"], torch.zeros(2, 3))


def test_carried_state_kept_as_a_dict_is_seen_and_mended():
    """An LSTM keeping ``self.state = {"h": ..., "c": ...}`` met a NaN row: the mend did not see a dict, the next
    clean steps came out non-finite from the state, and the run rolled back and ended on a NaN state."""
    from lightning_pulse.core.stability_steps import StabilityCore

    class DictState(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lstm = nn.LSTM(3, 4, batch_first=True)
            self.state = None

        def forward(self, x):
            previous = None if self.state is None else (self.state["h"], self.state["c"])
            out, (h, c) = self.lstm(x, previous)
            self.state = {"h": h.detach(), "c": c.detach()}
            return out

    model = DictState()
    model(torch.randn(2, 5, 3))
    core = StabilityCore(None, 3.0, 3.0, 20, 5, 2, 0, 10, 2, 0, 3)
    core.take_snapshot(0, model, [], [], {})
    model(torch.full((2, 5, 3), float("nan")))
    assert nonfinite_forward_state(model) == ["state"]
    assert core.mend_forward_state(model) == ["state"] and nonfinite_forward_state(model) == []


class _MaskedSamples(Dataset):
    """Samples with an additive mask whose last position is padding: ``-inf`` in every batch, on purpose."""

    def __init__(self, n: int, nan_sample: int | None = None):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 8, generator=g)
        self.y = (self.x[:, 0] > 0).long()
        if nan_sample is not None:
            self.x[nan_sample, 2] = float("nan")  # one bad sample: the data's fault, once an epoch

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "y": self.y[i], "mask": torch.tensor([0.0, 0.0, 0.0, float("-inf")])}


class _MaskedClassifier(pl.LightningModule):
    """Reads the mask (harmlessly); from step ``fault_from`` on its outputs turn NaN, its weights stay finite."""

    def __init__(self, fault_from: int | None = None):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
        self.fault_from = fault_from

    def training_step(self, batch, batch_idx):
        out = self.net(batch["x"]) + 0 * torch.softmax(batch["mask"], -1)[:, :1]
        if self.fault_from is not None and self.trainer.global_step >= self.fault_from:
            out = out * float("nan")  # a fault of the model that never ends
        return nn.functional.cross_entropy(out, batch["y"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _masked_guard() -> StabilityGuard:
    return StabilityGuard(
        warmup=5, snapshot_every=5, max_snapshots=3, rollback_margin=5, skip_after_rollback=2, max_rollbacks=1
    )


def test_a_model_fault_behind_a_minus_inf_mask_is_not_blamed_on_the_data(tmp_path):
    """Every batch carries -inf, on purpose. Before, each non-finite step found "non-finite data" and was skipped
    as a bad batch: 48 of 60 steps dropped silently and fit returned normally. -inf is not counted against the
    data now, so the model's fault is flagged as such: skipped, rolled back, then stopped."""
    guard = _masked_guard()
    trainer = pl.Trainer(max_steps=60, callbacks=[guard], default_root_dir=tmp_path, **trainer_kwargs())
    model = _MaskedClassifier(fault_from=12)
    with pytest.warns(UserWarning), pytest.raises(StabilityGuardError) as stopped:
        trainer.fit(model, DataLoader(_MaskedSamples(512), batch_size=16))
    causes = {event.get("cause") for event in guard.events if "action" in event}
    assert "data" not in causes and guard.bad_batches == 0
    assert guard.rollbacks == 1 and guard.stopped and trainer.global_step < 30
    assert "stopped-step=" in stopped.value.checkpoint_path
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_one_bad_sample_an_epoch_under_a_minus_inf_mask_is_only_ever_skipped():
    guard = _masked_guard()
    trainer = pl.Trainer(max_epochs=5, callbacks=[guard], **trainer_kwargs())
    with pytest.warns(UserWarning, match="non-finite values in its data"):
        trainer.fit(_MaskedClassifier(), DataLoader(_MaskedSamples(128, nan_sample=50), batch_size=16))
    assert [(e["step"], e["cause"]) for e in guard.events] == [(3 + 8 * epoch, "data") for epoch in range(5)]
    assert guard.bad_batches == guard.steps_skipped == 5 and guard.rollbacks == 0 and not guard.stopped
