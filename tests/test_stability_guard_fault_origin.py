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


class _CausalMaskBuffer(pl.LightningModule):
    """Causal self-attention over ``(B, T, F)`` features whose mask is a ``-inf`` buffer by design, as many
    hand-written GPTs keep it."""

    def __init__(self, length: int = 6):
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.qkv = nn.Linear(16, 48)
        self.out = nn.Linear(16, 2)
        self.register_buffer("causal_mask", torch.full((length, length), float("-inf")).triu(1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.embed(x)
        q, k, v = self.qkv(h).chunk(3, -1)
        scores = q @ k.transpose(-1, -2) / 4 + self.causal_mask  # (B, T, T)
        h = h + torch.softmax(scores, -1) @ v
        return nn.functional.cross_entropy(self.out(h.mean(1)), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def _sequences(bad_batch: int, value: float) -> DataLoader:
    """8 batches of 8 sequences; one time step of one sequence in ``bad_batch`` holds ``value``."""
    x = torch.randn(64, 6, 8, generator=torch.Generator().manual_seed(0))
    y = (x[:, :, 0].mean(1) > 0).long()
    x[8 * bad_batch + 1, 2] = value
    return DataLoader(TensorDataset(x, y), batch_size=8)


def test_an_overflow_under_a_minus_inf_mask_buffer_escalates_like_a_spike_not_as_the_models_fault(tmp_path):
    """Finite data (1e20) overflows the attention scores of batch 3 in every epoch; data and weights stay
    finite. The ``-inf`` mask buffer had counted as a non-finite model state: each such step rolled back at
    once, and the third rollback stopped the run. Now it escalates like a spike: skipped, and where a rollback
    was due, the rollback test finds the batch spiking at the snapshot too, so it is skipped as recurring."""
    torch.manual_seed(0)
    model = _CausalMaskBuffer()
    guard = StabilityGuard(
        warmup=5, snapshot_every=5, rollback_margin=2, max_snapshots=3, skip_after_rollback=2
    )
    trainer = pl.Trainer(max_steps=48, callbacks=[guard], default_root_dir=tmp_path, **trainer_kwargs())
    trainer.fit(model, _sequences(bad_batch=3, value=1e20))
    assert [event["step"] for event in guard.events] == [3, 11, 19, 27, 35, 43]  # batch 3 of each epoch
    assert {event.get("cause") for event in guard.events} == {None, "recurring"}  # never "state"
    assert guard.rollbacks == 0 and not guard.stopped and trainer.global_step == 48


def test_a_nan_batch_under_a_minus_inf_mask_buffer_mends_and_names_only_what_its_forward_made_bad():
    """The data-fault warning said the bad batch's forward had written into the ``-inf`` mask it never
    touched, and "set back" the mask."""
    torch.manual_seed(0)
    model = _CausalMaskBuffer()
    guard = StabilityGuard(warmup=5, snapshot_every=5, rollback_margin=2, max_snapshots=3)
    with pytest.warns(UserWarning, match="non-finite values in its data") as caught:
        pl.Trainer(max_steps=8, callbacks=[guard], **trainer_kwargs()).fit(model, _sequences(6, float("nan")))
    warning = next(str(w.message) for w in caught if "non-finite values in its data" in str(w.message))
    assert "causal_mask" not in warning and "set back" not in warning
    assert guard.bad_batches == 1 and guard.rollbacks == 0
    assert torch.equal(model.causal_mask, torch.full((6, 6), float("-inf")).triu(1))


def test_an_infinity_a_forward_wrote_into_a_buffer_counts_one_the_snapshot_holds_too_does_not():
    """A finite overflowing batch makes BatchNorm's running variance ``+inf`` (no NaN): still the model's
    state going bad, judged against the newest snapshot, whose copy was finite. The ``-inf`` mask the snapshot
    holds too never counts; with no snapshot to compare with, only a NaN does (as for snapshots)."""
    from lightning_pulse.core.fault_origin import trace_nonfinite
    from lightning_pulse.core.stability_steps import StabilityCore

    class MaskedNorm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Linear(3, 4)
            self.norm = nn.BatchNorm1d(4)
            self.register_buffer("causal_mask", torch.full((4, 4), float("-inf")).triu(1))

        def forward(self, x):  # (B, 3) -> (B, 4)
            h = self.norm(self.embed(x))
            scores = h[:, :, None] * h[:, None, :] + self.causal_mask  # (B, 4, 4)
            return (torch.softmax(scores, -1) @ h[:, :, None]).squeeze(-1)

    torch.manual_seed(0)
    model = MaskedNorm()
    core = StabilityCore(None, 3.0, 3.0, 20, 5, 2, 0, 10, 2, 0, 3)
    assert core.saved_forward_state(model) == (None, {})
    core.take_snapshot(0, model, [], [], {})  # the mask is in it, -inf
    newest, saved = core.saved_forward_state(model)
    assert newest is core.schedule.ring.newest()
    assert set(saved) == {"norm.running_mean", "norm.running_var", "norm.num_batches_tracked", "causal_mask"}
    clean = [(0, (torch.ones(8, 3),))]
    model(torch.randn(8, 3))
    assert nonfinite_forward_state(model, saved) == [] and nonfinite_forward_state(model) == []
    assert trace_nonfinite(model, [], clean, step=3, saved_forward_state=saved) == (None, [])

    huge = torch.randn(8, 3)
    huge[2] = 1e20  # finite: its squares overflow the batch variance
    model(huge)
    assert torch.isposinf(model.norm.running_var).any() and not model.norm.running_var.isnan().any()
    assert nonfinite_forward_state(model, saved) == ["norm.running_var"]
    assert trace_nonfinite(model, [], [(0, (huge,))], step=3, saved_forward_state=saved) == ("state", [])
    assert nonfinite_forward_state(model) == []  # no snapshot to tell: only a NaN counts


def test_an_infinity_in_an_element_the_snapshot_held_finite_counts_though_the_tensor_held_one_before():
    """The comparison was per tensor: a running maximum ``[-inf, 0.5]`` (channel 0 not seen yet) whose
    channel 1 overflowed to ``+inf`` was "infinite then too", so never counted."""
    model = nn.Module()
    model.register_buffer("running_max", torch.tensor([float("-inf"), 0.5]))
    saved = {"running_max": model.running_max.clone()}
    assert nonfinite_forward_state(model, saved) == []
    model.running_max[1] = float("inf")
    assert nonfinite_forward_state(model, saved) == ["running_max"]


class _MaskFilledAtFirstForward(_CausalMaskBuffer):
    """The mask buffer is registered as zeros and filled with ``-inf`` by the first forward."""

    def __init__(self, length: int = 6):
        super().__init__(length)
        self.causal_mask.zero_()
        self.filled = False

    def training_step(self, batch, batch_idx):
        if not self.filled:
            self.causal_mask.copy_(torch.full_like(self.causal_mask, float("-inf")).triu(1))
            self.filled = True
        return super().training_step(batch, batch_idx)


def test_a_mask_filled_at_the_first_forward_is_not_taken_for_an_infinity_the_step_wrote(tmp_path):
    """The fit-start snapshot, taken before any forward, held the zeros: the mask counted as "infinite now,
    finite then", so the first overflow (step 3) was blamed on the model's state and rolled back at once to
    that snapshot, zeros and all. A snapshot taken before the fit's first forward is no evidence about
    infinities now: the overflow escalates like a spike, as with a mask built in ``__init__``."""
    torch.manual_seed(0)
    model = _MaskFilledAtFirstForward()
    guard = StabilityGuard(
        warmup=5, snapshot_every=5, rollback_margin=2, max_snapshots=3, skip_after_rollback=2
    )
    trainer = pl.Trainer(max_steps=24, callbacks=[guard], default_root_dir=tmp_path, **trainer_kwargs())
    with pytest.warns(UserWarning):  # the mask turned infinite since the fit-start snapshot: said once
        trainer.fit(model, _sequences(bad_batch=3, value=1e20))
    assert [event["step"] for event in guard.events] == [3, 11, 19]  # batch 3 of each epoch
    assert "state" not in {event.get("cause") for event in guard.events}
    assert guard.rollbacks == 0 and not guard.stopped
    assert torch.equal(model.causal_mask, torch.full((6, 6), float("-inf")).triu(1))


class _BatchNormClassifier(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.norm = nn.BatchNorm1d(16)
        self.out = nn.Linear(16, 2)

    def training_step(self, batch, batch_idx):
        x, y = batch  # (B, T, 8)
        return nn.functional.cross_entropy(self.out(torch.relu(self.norm(self.embed(x.mean(1))))), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def test_a_running_variance_overflowing_on_a_finite_step_is_said_once_at_the_next_snapshot():
    """Batch 3 of each epoch (1e30, finite) overflows BatchNorm's running variance to ``+inf`` while its loss
    stays finite: nothing was flagged, no warning came, and every later snapshot kept the ``+inf`` (which then
    counts as by design). The next snapshot now compares its forward state with the previous one's."""
    torch.manual_seed(0)
    model = _BatchNormClassifier()
    guard = StabilityGuard(warmup=5, snapshot_every=5, rollback_margin=2, max_snapshots=3)
    with pytest.warns(UserWarning, match="infinite") as caught:
        pl.Trainer(max_steps=24, callbacks=[guard], **trainer_kwargs()).fit(model, _sequences(3, 1e30))
    said = [str(w.message) for w in caught if "infinite at step" in str(w.message)]
    assert len(said) == 1  # once a fit, though the snapshots of steps 10, 15 and 20 hold it too
    assert said[0].startswith(
        "StabilityGuard: norm.running_var is infinite at step 5 where the snapshot of step 0"
    )
    assert guard.events == [] and guard.snapshots_taken == 5  # the step was finite; no snapshot dropped
    assert torch.isposinf(model.norm.running_var).any()
