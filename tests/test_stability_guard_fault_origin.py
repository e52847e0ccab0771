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
from tests.conftest import AttributeStoredMapping, trainer_kwargs


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
    assert trace_nonfinite(model, [], clean, step=7) == (None, [], False)
    cause, samples, unchecked = trace_nonfinite(model, [], dirty, step=7)
    assert cause == "data" and samples == [{"step": 7, "batch_idx": 0, "rows": [0], "indices": None}]
    assert unchecked  # no loss to recompute: presumed

    def other_rank(flags):  # two ranks: the other one's findings are (bad data, healthy state)
        return flags + torch.tensor([1.0, 0.0, 0.0])

    # this rank's batch was clean: it still agrees that the data is at fault, with no samples of its own
    assert trace_nonfinite(model, [], clean, step=7, all_reduce_sum=other_rank) == ("data", [], True)
    with torch.no_grad():
        model.weight[0, 0] = float("inf")
    assert trace_nonfinite(model, [], dirty, step=7, all_reduce_sum=other_rank) == ("state", [], False)


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
    cause, samples, _ = trace_nonfinite(model, [], [(0, (x,))], step=9)
    assert cause == "data" and samples[0]["rows"] == [2]
    # with no bad data to explain it, the same state is the model's fault
    assert trace_nonfinite(model, [], [(0, (torch.ones(8, 3),))], step=9) == ("state", [], False)
    # bad data no longer presumed at fault: not the state's either (its own forward wrote it), for the
    # caller to test at a snapshot; it was ("state", [], True): a rollback at once
    cause, samples, unchecked = trace_nonfinite(model, [], [(0, (x,))], step=9, presume_data=False)
    assert (cause, samples[0]["rows"], unchecked) == (None, [2], True)

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
    assert trace_nonfinite(model, [], clean, step=3, saved_forward_state=saved) == (None, [], False)

    huge = torch.randn(8, 3)
    huge[2] = 1e20  # finite: its squares overflow the batch variance
    model(huge)
    assert torch.isposinf(model.norm.running_var).any() and not model.norm.running_var.isnan().any()
    assert nonfinite_forward_state(model, saved) == ["norm.running_var"]
    found = trace_nonfinite(model, [], [(0, (huge,))], step=3, saved_forward_state=saved)
    assert found == ("state", [], False)
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


def test_a_mask_filled_at_the_first_forward_is_not_taken_for_an_infinity_the_step_wrote(tmp_path, recwarn):
    """The fit-start snapshot, taken before any forward, held the zeros: the mask counted as "infinite now,
    finite then", so the first overflow (step 3) was blamed on the model's state and rolled back at once to
    that snapshot, zeros and all. A snapshot taken before the fit's first forward is no evidence about
    infinities now: the overflow escalates like a spike, as with a mask built in ``__init__``. Nor is the
    mask said to have turned infinite at the step-5 snapshot (it was, against the fit-start one): both
    compare with the forward state kept after the fit's first step."""
    torch.manual_seed(0)
    model = _MaskFilledAtFirstForward()
    guard = StabilityGuard(
        warmup=5, snapshot_every=5, rollback_margin=2, max_snapshots=3, skip_after_rollback=2
    )
    trainer = pl.Trainer(max_steps=24, callbacks=[guard], default_root_dir=tmp_path, **trainer_kwargs())
    trainer.fit(model, _sequences(bad_batch=3, value=1e20))
    assert [str(w.message) for w in recwarn if "StabilityGuard" in str(w.message)] == []
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
    assert said[0].startswith(  # step 1: the copy kept after the fit's first step, finite then
        "StabilityGuard: norm.running_var is infinite at step 5 where it held finite values at step 1."
    )
    assert guard.events == [] and guard.snapshots_taken == 5  # the step was finite; no snapshot dropped
    assert torch.isposinf(model.norm.running_var).any()


def test_an_infinity_a_bad_batch_wrote_before_the_first_periodic_snapshot_is_mended_too(recwarn):
    """Batch 2 holds a ``+inf`` (no NaN): its forward makes BatchNorm's running mean ``+inf`` and its running
    variance NaN. Before the first periodic snapshot only the fit-start one was held, which is no evidence
    about infinities (it predates the first forward): the NaN was mended and the ``+inf`` left, so the running
    mean stayed infinite (and the step-5 snapshot said it "turned infinite"). The forward state kept after the
    fit's first applied step is the evidence until a periodic snapshot exists."""
    x = torch.randn(64, 1, 8, generator=torch.Generator().manual_seed(0))  # sequences of one time step
    y = (x[:, 0, 0] > 0).long()
    x[8 * 2 + 1, 0, 3] = float("inf")  # one feature: the embedding's outputs are infinite, not NaN
    torch.manual_seed(0)
    model = _BatchNormClassifier()
    guard = StabilityGuard(warmup=5, snapshot_every=5, rollback_margin=2, max_snapshots=3)
    trainer = pl.Trainer(max_steps=8, callbacks=[guard], **trainer_kwargs())
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=8))
    assert [str(w.message) for w in recwarn if "StabilityGuard" in str(w.message)] == [
        "StabilityGuard: step 2 has non-finite values in its data (batch 2 rows [1]); the model is healthy, "
        "so the step is skipped and training goes on. Its forward had written them into norm.running_mean, "
        "norm.running_var: set back to their values before this step. Later such steps are skipped silently: "
        "see `StabilityGuard.bad_samples` and the `stability/bad_batches` counter."
    ]  # the copy taken before the step, not the fit-start snapshot's values (step 0)
    assert [(event["step"], event.get("cause")) for event in guard.events] == [(2, "data")]
    assert guard.rollbacks == 0 and guard.snapshots.steps == [0, 5]
    assert all(torch.isfinite(buffer).all() for buffer in model.buffers())


def _one_step_sequences(bad_batch: int, value: float) -> DataLoader:
    """8 batches of 8 sequences of one time step; a feature of a sequence in ``bad_batch`` holds ``value``."""
    x = torch.randn(64, 1, 8, generator=torch.Generator().manual_seed(0))
    y = (x[:, 0, 0] > 0).long()
    x[8 * bad_batch + 1, 0, 3] = value
    return DataLoader(TensorDataset(x, y), batch_size=8)


def test_an_infinity_a_bad_first_batch_wrote_is_mended_at_once(recwarn):
    """Batch 0 (the fit's first step) holds a ``+inf``: its forward makes BatchNorm's running mean ``+inf``
    and its running variance NaN. Only the NaN was mended (no evidence about infinities before the first
    applied step), and the copy kept after step 1 held the ``+inf``, so it counted as by design: the running
    mean stayed infinite for the whole run, and nothing said so. Before the first applied step, the fit-start
    snapshot is the evidence, where only a ``-inf`` (a mask the first forward fills) is by design."""
    torch.manual_seed(0)
    model = _BatchNormClassifier()
    guard = StabilityGuard(warmup=5, snapshot_every=5, rollback_margin=2, max_snapshots=3)
    pl.Trainer(max_steps=8, callbacks=[guard], **trainer_kwargs()).fit(
        model, _one_step_sequences(0, float("inf"))
    )
    assert [str(w.message) for w in recwarn if "StabilityGuard" in str(w.message)] == [
        "StabilityGuard: step 0 has non-finite values in its data (batch 0 rows [1]); the model is healthy, "
        "so the step is skipped and training goes on. Its forward had written them into norm.running_mean, "
        "norm.running_var: set back to their values at step 0. Later such steps are skipped silently: "
        "see `StabilityGuard.bad_samples` and the `stability/bad_batches` counter."
    ]
    assert [(event["step"], event.get("cause")) for event in guard.events] == [(0, "data")]
    assert all(torch.isfinite(buffer).all() for buffer in model.buffers())


def test_a_running_variance_overflowing_on_the_fits_first_step_is_said_at_the_next_snapshot():
    """Batch 0 (1e30, finite) overflows BatchNorm's running variance to ``+inf`` on the fit's first step,
    which applies. The copy kept after that step held the ``+inf``, so it counted as by design and nothing
    was said (it was, against the fit-start snapshot, before that copy existed). A ``+inf`` the first step
    wrote where the fit-start snapshot held a finite value now counts as finite then: said once, at the next
    snapshot."""
    torch.manual_seed(0)
    model = _BatchNormClassifier()
    guard = StabilityGuard(warmup=5, snapshot_every=5, rollback_margin=2, max_snapshots=3)
    with pytest.warns(UserWarning, match="infinite") as caught:
        pl.Trainer(max_steps=16, callbacks=[guard], **trainer_kwargs()).fit(
            model, _one_step_sequences(0, 1e30)
        )
    said = [str(w.message) for w in caught if "infinite at step" in str(w.message)]
    assert len(said) == 1  # once a fit: batch 0 comes back at step 8, and the snapshots keep the +inf
    assert said[0].startswith(
        "StabilityGuard: norm.running_var is infinite at step 5 where it held finite values at step 0."
    )
    assert guard.events == [] and torch.isposinf(model.norm.running_var).any()


def test_a_minus_inf_mask_filled_by_a_bad_first_batchs_forward_is_left_alone():
    """The fit-start snapshot is the evidence about infinities at a data fault in the fit's first step: the
    ``-inf`` causal mask that step's forward filled (zeros in that snapshot) is by design, not set back."""
    torch.manual_seed(0)
    model = _MaskFilledAtFirstForward()
    guard = StabilityGuard(warmup=5, snapshot_every=5, rollback_margin=2, max_snapshots=3)
    with pytest.warns(UserWarning, match="non-finite values in its data") as caught:
        pl.Trainer(max_steps=8, callbacks=[guard], **trainer_kwargs()).fit(model, _sequences(0, float("inf")))
    assert all("causal_mask" not in str(w.message) for w in caught)
    assert [(event["step"], event.get("cause")) for event in guard.events] == [(0, "data")]
    assert torch.equal(model.causal_mask, torch.full((6, 6), float("-inf")).triu(1))


class _BigTableWithMask(_CausalMaskBuffer):
    """A 4 MiB finite buffer (a frozen embedding table, a rotary cache) next to the ``-inf`` mask."""

    def __init__(self):
        super().__init__()
        self.register_buffer("table", torch.randn(1024, 1024))


def test_the_forward_state_kept_after_the_first_step_costs_a_byte_per_element_of_infinite_tensors_only():
    """The evidence kept after the fit's first step was a CPU copy of every buffer, held for the whole fit,
    though only which elements were finite is read: 4 MiB more for this table. Now a finite tensor costs
    nothing and the mask one byte an element; the kept masks still tell a new infinity."""
    torch.manual_seed(0)
    model = _BigTableWithMask()
    guard = StabilityGuard(warmup=5, snapshot_every=5, rollback_margin=2, max_snapshots=3)
    pl.Trainer(max_steps=3, callbacks=[guard], **trainer_kwargs()).fit(model, _sequences(0, 0.0))
    step, kept = guard.core.first_forward
    assert step == 1 and set(kept) == {"causal_mask", "table"}
    assert sum(tensor.untyped_storage().nbytes() for tensor in kept.values()) == 1 + 6 * 6
    assert kept["table"].shape == (1024, 1024) and kept["table"].all()
    assert torch.equal(kept["causal_mask"], torch.ones(6, 6).tril().bool())
    assert nonfinite_forward_state(model, kept) == []
    model.table[3, 4] = float("inf")
    assert nonfinite_forward_state(model, kept) == ["table"]


def test_a_buffer_the_snapshot_lacks_is_not_said_to_be_set_back():
    """A non-persistent buffer registered after the snapshot (the snapshot still fits) and made NaN by a bad
    batch was named as "set back to the newest snapshot's values", though nothing could set it back."""
    from lightning_pulse.core.stability_steps import StabilityCore

    model = nn.BatchNorm1d(2)
    core = StabilityCore(None, 3.0, 3.0, 20, 5, 2, 0, 10, 2, 0, 3)
    core.take_snapshot(3, model, [], [], {})
    model.register_buffer("scratch", torch.full((2,), float("nan")), persistent=False)
    model.running_mean.fill_(float("nan"))
    assert core.mend_forward_state(model) == ["running_mean"]
    assert torch.equal(model.running_mean, torch.zeros(2)) and model.scratch.isnan().all()


# ---------------------------------------------------------------- which samples: cut, dropped, graph rows
class _Classifier(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 3))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("guard_first", [False, True])
def test_bad_samples_of_a_batch_hard_sample_replay_cut_name_the_sample_that_trained(guard_first):
    """``HardSampleReplay(mode="batch")`` cuts each batch of 16 in place to 8 rows: the NaN row of a cut batch
    was mapped through the loader's 16 indices (the batch as loaded), naming a healthy sample (38, 184, 127
    for sample 37). The guard now takes the indices of the samples trained from the replay callback."""
    from lightning_pulse import HardSampleReplay

    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(256, 10, generator=generator), torch.randint(0, 3, (256,), generator=generator)
    x[37, 4] = float("nan")
    pl.seed_everything(0)
    guard, replay = StabilityGuard(), HardSampleReplay(mode="batch", replay_fraction=0.5)
    callbacks = [guard, replay] if guard_first else [replay, guard]
    trainer = pl.Trainer(max_epochs=4, callbacks=callbacks, **trainer_kwargs())
    trainer.fit(_Classifier(), DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True))
    assert len(guard.bad_samples) == 4  # once an epoch
    assert [sample["indices"] for sample in guard.bad_samples] == [[37]] * 4
    assert max(sample["rows"][0] for sample in guard.bad_samples[1:]) < 8  # rows of cut batches


class _DropsUnreadable(Dataset):
    """Sample 5 cannot be read (``None``): the collate_fn leaves it out, so its batch has 4 rows for 5
    indices."""

    def __init__(self):
        self.x = torch.zeros(20, 2)
        self.x[8, 0] = float("nan")

    def __len__(self) -> int:
        return 20

    def __getitem__(self, i: int):
        return None if i == 5 else (self.x[i], i)


def _skip_unreadable(items):
    return torch.utils.data.default_collate([item for item in items if item is not None])


def test_a_batch_a_collate_fn_shortened_names_its_bad_rows_but_no_dataset_index():
    """The loader's 5 indices for 4 rows shifted every row after the dropped sample: row 2 (sample 8) was
    named as sample 7. Indices that are not one per row are not used now."""
    loader = DataLoader(_DropsUnreadable(), batch_size=5, collate_fn=_skip_unreadable)
    tracker = SampleIndexTracker.install(loader)
    found = []
    for batch_idx, batch in enumerate(loader):
        tracker.batch_indices(batch_idx)
        found += find_bad_samples([(batch_idx, batch)], step=batch_idx, loader=loader)
    assert found == [{"step": 1, "batch_idx": 1, "rows": [2], "indices": None}]
    x, ids = next(batch for i, batch in enumerate(loader) if i == 1)
    assert ids[2] == 8 and x[2].isnan().any()  # row 2 is sample 8 indeed
    assert batch_sample_ids((x, ids), [2], torch.tensor([5, 6, 7, 8, 9])) is None
    assert batch_sample_ids((x, ids), [2], torch.tensor([6, 7, 8, 9])) == [8]


def _graph_batch(nan_node: int | None = None, nan_label: int | None = None) -> dict:
    """3 graphs of 4, 5 and 3 nodes as a PyG-style dict: node features ``(12, 6)``, edge index ``(2, 12)``,
    node-to-graph ``batch (12,)``, per-graph ``y (3,)`` and ``idx (3,)``."""
    sizes = [4, 5, 3]
    x = torch.randn(sum(sizes), 6, generator=torch.Generator().manual_seed(0))
    y = torch.ones(3)
    if nan_node is not None:
        x[nan_node, 2] = float("nan")
    if nan_label is not None:
        y[nan_label] = float("nan")
    batch = torch.cat([torch.full((n,), g) for g, n in enumerate(sizes)])
    edges = torch.arange(24).view(2, 12) % 12
    return {"x": x, "edge_index": edges, "batch": batch, "y": y, "idx": torch.tensor([40, 41, 42])}


def test_rows_are_unknown_where_the_tensors_leading_sizes_differ_and_nothing_counts_the_samples():
    """Without an index field or indices that say how many samples a batch holds, rows count only where every
    tensor has the same leading size. A time-major ``(5, 16, F)`` input beside ``(16,)`` labels counted 5
    samples (a tie went to the first tensor): its time step 2 was named as row 2 and cut out of the batch for
    the check. A PyG-style dict without ``idx`` counted its 40 nodes: node 4 was named as sample 4."""
    from lightning_pulse.core.fault_origin import batch_sample_count, without_bad_rows

    x, y = torch.randn(5, 16, 8), torch.randint(0, 3, (16,))
    x[2, 9, 0] = float("nan")
    assert batch_sample_count((x, y)) is None and nonfinite_rows((x, y)) is None
    assert without_bad_rows((x, y), nonfinite_rows((x, y)), 5) is None
    assert batch_sample_count((x, y), [16]) == 16  # the loader's 16 indices say it
    nodes = torch.randn(40, 8)
    nodes[4, 0] = float("nan")
    graphs = {"x": nodes, "edge_index": torch.randint(0, 40, (2, 100)), "y": torch.randn(4)}
    graphs["batch"] = torch.arange(40) // 10
    assert batch_sample_count(graphs) is None and nonfinite_rows(graphs) is None
    assert find_bad_samples([(0, graphs)], step=3) == [
        {"step": 3, "batch_idx": 0, "rows": None, "indices": None}
    ]
    # every tensor sharing the leading size still counts: rows known
    assert batch_sample_count((torch.randn(16, 8), y, torch.full((16,), 5))) == 16


def test_a_nan_on_a_graph_node_is_not_read_as_a_sample_row():
    """Node 1 of a graph batch was read as sample row 1 and named as graph 41. A value in a tensor whose
    leading size is not the batch's sample count (here 3, from ``idx``) makes the batch bad with rows unknown;
    one in the per-graph labels has its row and index."""
    assert nonfinite_rows(_graph_batch()) == []
    assert nonfinite_rows(_graph_batch(nan_node=1)) is None
    assert nonfinite_rows(_graph_batch(nan_label=1)) == [1]
    assert find_bad_samples([(0, _graph_batch(nan_node=1))], step=2) == [
        {"step": 2, "batch_idx": 0, "rows": None, "indices": None}
    ]
    assert find_bad_samples([(0, _graph_batch(nan_label=2))], step=2)[0]["indices"] == [42]
    assert describe_bad_samples(find_bad_samples([(0, _graph_batch(nan_node=1))], step=2)) == (
        "batch 0 (rows unknown)"
    )
    # time-major (T, B, F) with B = 4 from the batch's index field: a bad time step is no sample row
    sequences = {"x": torch.zeros(7, 4, 2), "idx": torch.arange(4)}
    sequences["x"][5, 0, 0] = float("nan")
    assert nonfinite_rows(sequences) is None


class _GraphClassifier(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.lin, self.out = nn.Linear(6, 16), nn.Linear(16, 2)

    def training_step(self, batch, batch_idx):
        h = self.lin(batch["x"]).relu()
        pooled = torch.zeros(len(batch["y"]), 16).index_add_(0, batch["batch"], h)
        return nn.functional.cross_entropy(self.out(pooled), batch["y"].long())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


class _Graphs(Dataset):
    def __init__(self):
        generator = torch.Generator().manual_seed(0)
        self.sizes = torch.randint(5, 9, (32,), generator=generator).tolist()
        self.x = [torch.randn(k, 6, generator=generator) for k in self.sizes]
        self.x[16][4, 2] = float("nan")  # node 4 of graph 16: the first graph of the third batch

    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int):
        return i, self.x[i]


def _collate_graphs(items):
    graph_of_node = torch.cat([torch.full((len(x),), j) for j, (_, x) in enumerate(items)])
    indices = torch.tensor([i for i, _ in items])
    return {"x": torch.cat([x for _, x in items]), "batch": graph_of_node, "y": indices % 2, "idx": indices}


def test_a_graph_batch_with_a_nan_node_is_skipped_without_naming_another_graph():
    guard = StabilityGuard()
    trainer = pl.Trainer(max_epochs=2, callbacks=[guard], **trainer_kwargs())
    with pytest.warns(UserWarning, match=r"non-finite values in its data \(batch 2 \(rows unknown\)\)"):
        trainer.fit(_GraphClassifier(), DataLoader(_Graphs(), batch_size=8, collate_fn=_collate_graphs))
    assert guard.bad_samples == [
        {"step": 2, "batch_idx": 2, "rows": None, "indices": None},
        {"step": 6, "batch_idx": 2, "rows": None, "indices": None},
    ]
    assert guard.bad_batches == 2 and guard.rollbacks == 0


# ---------------------------------------------------------------------- NaN in the data on purpose
class _MissingLabels(Dataset):
    """A multi-task regression whose labels are NaN where missing (15%), the usual encoding; optionally one
    input row corrupt (NaN), and optionally a task with no label at all."""

    def __init__(self, n: int = 256, bad_input: int | None = None, unlabelled_task: bool = False):
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 8, generator=generator)
        self.y = self.x @ torch.randn(8, 4, generator=generator)
        self.y[torch.rand(self.y.shape, generator=generator) < 0.15] = float("nan")
        if unlabelled_task:
            self.y[:, 3] = float("nan")
        if bad_input is not None:
            self.x[bad_input, 2] = float("nan")

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


class _MaskedRegression(pl.LightningModule):
    """Masks the missing labels out of its loss; from step ``overflow_from`` on its forward overflows (its
    weights stay finite), a fault of the model that never ends."""

    def __init__(self, overflow_from: int | None = None, fixed_batch: int | None = None):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4))
        self.overflow_from, self.fixed_batch = overflow_from, fixed_batch

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.fixed_batch is not None:  # a shape written into the module: a smaller batch fails
            x = x.view(self.fixed_batch, 8)
        prediction = self.net(x)
        if self.overflow_from is not None and self.trainer.global_step >= self.overflow_from:
            prediction = prediction * torch.tensor(1e39)
        known = ~y.isnan()
        return ((prediction - y.nan_to_num()) ** 2 * known).sum() / known.sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _missing_labels_guard() -> StabilityGuard:
    return StabilityGuard(
        warmup=5, snapshot_every=5, max_snapshots=3, rollback_margin=2, skip_after_rollback=2, max_rollbacks=1
    )


def test_an_overflow_of_a_model_whose_labels_are_nan_where_missing_is_the_models_fault(tmp_path):
    """Every batch holds NaN labels, masked out of the loss. Each overflow of the model was blamed on the data
    and skipped (60 of 90 steps, no rollback, the fit ended "normally"). The loss recomputed without the rows
    holding NaN is still non-finite, so the model is at fault: rolled back, then stopped."""
    guard = _missing_labels_guard()
    trainer = pl.Trainer(max_steps=60, callbacks=[guard], default_root_dir=tmp_path, **trainer_kwargs())
    with pytest.warns(UserWarning, match="rollback 1"), pytest.raises(StabilityGuardError):
        trainer.fit(_MaskedRegression(overflow_from=12), DataLoader(_MissingLabels(), batch_size=16))
    assert guard.bad_batches == 0 and guard.bad_samples == []
    assert {event.get("cause") for event in guard.events} == {None}
    assert guard.rollbacks == 1 and guard.stopped and trainer.global_step < 30


def test_a_corrupt_input_among_missing_labels_is_still_the_datas_fault(recwarn):
    """The check passes for a real bad sample: without its row (and those with missing labels) the loss is
    finite. Skipped once an epoch, never rolled back; the running statistics its forward wrote, and those the
    check's own forward wrote, are the snapshot's and the step's as before."""
    torch.manual_seed(0)
    model = _MaskedRegression()
    guard = _missing_labels_guard()
    trainer = pl.Trainer(max_epochs=3, callbacks=[guard], **trainer_kwargs())
    trainer.fit(model, DataLoader(_MissingLabels(bad_input=50), batch_size=16))
    assert [(event["step"], event["cause"]) for event in guard.events] == [
        (3, "data"),
        (19, "data"),
        (35, "data"),
    ]
    assert [sample["rows"] for sample in guard.bad_samples][0][0] == 2  # row 2 of batch 3 is sample 50
    assert guard.core.unchecked_data_faults == 0  # checked, not presumed
    assert guard.rollbacks == 0 and not guard.stopped
    assert all(torch.isfinite(buffer).all() for buffer in model.buffers())
    said = [str(w.message) for w in recwarn if "non-finite values in its data" in str(w.message)]
    assert len(said) == 1 and "set back" in said[0]


def test_a_corrupt_input_is_checked_with_zeros_when_the_module_cannot_take_a_smaller_batch(recwarn):
    """``training_step`` fails on the batch without its bad row (a batch size written into the module): the
    loss recomputed with the NaN set to 0 is finite, so the step is the data's, checked, not presumed."""
    guard = _missing_labels_guard()
    trainer = pl.Trainer(max_epochs=2, callbacks=[guard], **trainer_kwargs())
    trainer.fit(_MaskedRegression(fixed_batch=16), DataLoader(_MissingLabels(bad_input=50), batch_size=16))
    assert [(event["step"], event["cause"]) for event in guard.events] == [(3, "data"), (19, "data")]
    assert guard.rollbacks == 0 and guard.core.unchecked_data_faults == 0  # an applied step came between


def test_an_overflow_of_a_model_whose_every_row_holds_a_nan_label_is_the_models_at_once(tmp_path):
    """A task with no label anywhere leaves every row of every batch holding NaN: no row is left to recompute
    the loss without. The loss recomputed with the NaN set to 0 is still non-finite (the model overflows from
    step 12 on), so the model is at fault at once: rolled back, then stopped. It was presumed the data's for 8
    steps in a row first."""
    guard = _missing_labels_guard()
    trainer = pl.Trainer(max_steps=80, callbacks=[guard], default_root_dir=tmp_path, **trainer_kwargs())
    data = DataLoader(_MissingLabels(unlabelled_task=True), batch_size=16)
    with pytest.warns(UserWarning, match="rollback 1"), pytest.raises(StabilityGuardError):
        trainer.fit(_MaskedRegression(overflow_from=12), data)
    assert guard.bad_batches == 0 and {event.get("cause") for event in guard.events} == {None}
    assert guard.rollbacks == 1 and guard.stopped and trainer.global_step < 25


class _OverflowsOnHugeInputs(pl.LightningModule):
    """Its output scales with its input's largest value, so huge finite inputs overflow the squared loss;
    missing labels (NaN) are masked out of the loss."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        prediction = self.net(x) * x.abs().amax(1, keepdim=True)
        known = ~y.isnan()
        return ((prediction - y.nan_to_num()) ** 2 * known).sum() / known.sum().clamp(min=1)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_a_model_overflowing_on_every_batch_of_data_with_nan_in_every_row_escalates(tmp_path):
    """Every batch has a task with no label (NaN in every row); from batch 12 on the inputs are huge and
    finite, and the model overflows on each. The data was presumed at fault 8 times, then each step's batch,
    non-finite on the snapshot too (its inputs are), was called the data's: 28 steps in a row skipped, no
    rollback, and the fit ended "normally". With the NaN set to 0 the loss is still non-finite: not the NaN
    labels' fault. Each batch is non-finite on the snapshot too, so the row is skipped as the data's while it
    lasts (a loss infinite on a few samples makes such rows by chance), and escalates once no step applied
    for NONFINITE_ROW_TESTED steps: a data stream gone bad for good rolls back, then stops."""
    from lightning_pulse.core.stability_policy import NONFINITE_ROW_TESTED

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(640, 8, generator=generator)
    y = x @ torch.randn(8, 4, generator=generator)
    x[12 * 16 :] *= 1e20
    y[:, 3] = float("nan")
    guard = _missing_labels_guard()
    trainer = pl.Trainer(max_epochs=1, callbacks=[guard], default_root_dir=tmp_path, **trainer_kwargs())
    with pytest.warns(UserWarning, match="rollback 1"), pytest.raises(StabilityGuardError):
        trainer.fit(_OverflowsOnHugeInputs(), DataLoader(TensorDataset(x, y), batch_size=16))
    assert guard.bad_batches == 0 and {event.get("cause") for event in guard.events} <= {None, "recurring"}
    rollback = next(event["step"] for event in guard.events if event["event"] == "rollback")
    assert rollback == 12 + (NONFINITE_ROW_TESTED // 3 + 1) * 3 - 1  # the first incident past the row
    assert guard.rollbacks == 1 and guard.stopped and trainer.global_step == rollback + 1 + 2 + 3


def _time_major(items):
    return torch.stack([x for x, _ in items], dim=1), torch.stack([y for _, y in items])


class _SequenceClassifier(pl.LightningModule):
    """Reads time-major ``(T, B, F)`` inputs beside ``(B,)`` labels: which rows hold a bad value is not
    known."""

    def __init__(self):
        super().__init__()
        self.net = nn.Linear(4, 3)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x.mean(0)), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def test_time_major_batches_with_a_corrupt_value_in_each_stay_the_datas_fault(tmp_path):
    """Rows unknown, so no row can be cut out: checked with the NaN set to 0 instead, the loss is finite and
    each step is the data's. Presumed for 8 steps, then tested on a snapshot (none comparable: no batch had
    applied), the 9th was taken for the model's: rolled back, then stopped."""
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(160, 5, 4, generator=generator), torch.randint(0, 3, (160,), generator=generator)
    x[torch.arange(10) * 16 + 3, 2, 1] = float("nan")  # one value in every batch of 16
    guard = StabilityGuard(max_rollbacks=1)
    trainer = pl.Trainer(max_epochs=2, callbacks=[guard], default_root_dir=tmp_path, **trainer_kwargs())
    trainer.fit(_SequenceClassifier(), DataLoader(TensorDataset(x, y), batch_size=16, collate_fn=_time_major))
    assert [event.get("cause") for event in guard.events] == ["data"] * 20
    assert all(sample["rows"] is None for sample in guard.bad_samples)
    assert guard.rollbacks == 0 and not guard.stopped and guard.core.unchecked_data_faults == 0


class _FixedBatchClassifier(pl.LightningModule):
    """A batch size written into the module (a smaller batch fails), with BatchNorm."""

    def __init__(self, batch_size: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
        self.batch_size = batch_size

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x.view(self.batch_size, 8)), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def test_frequent_bad_data_a_module_cannot_take_without_its_row_is_checked_with_zeros(recwarn, tmp_path):
    """One corrupt sample in each of batches 1-12 of 20 (as one in 40 does to 80% of batches of 64): the
    module cannot take the batch without it, but with the NaN set to 0 its loss is finite: every step is the
    data's, checked (no presumption, no snapshot test), skipped, no rollback, buffers mended."""
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(320, 8, generator=generator), torch.randint(0, 3, (320,), generator=generator)
    x[torch.arange(1, 13) * 16 + 5, 2] = float("nan")  # row 5 of batches 1-12
    model, guard = _FixedBatchClassifier(16), StabilityGuard(max_rollbacks=1)
    trainer = pl.Trainer(max_epochs=2, callbacks=[guard], default_root_dir=tmp_path, **trainer_kwargs())
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=16))
    bad_steps = [*range(1, 13), *range(21, 33)]
    assert [(event["step"], event.get("cause")) for event in guard.events] == [
        (step, "data") for step in bad_steps
    ]
    assert guard.rollbacks == 0 and not guard.stopped and guard.bad_batches == 24
    assert all(torch.isfinite(buffer).all() for buffer in model.buffers())
    assert not [w for w in recwarn if "escalates as the model's" in str(w.message)]


class _RefusesZeros(_FixedBatchClassifier):
    """Refuses an input holding an exact 0 (its sentinel for a missing value) as well as a smaller batch: the
    data can be checked neither way. ``shift`` moves the loss (below 0: a density's NLL, an ELBO)."""

    def __init__(self, batch_size: int, shift: float = 0.0):
        super().__init__(batch_size)
        self.shift = shift

    def training_step(self, batch, batch_idx):
        if bool((batch[0] == 0).any()):
            raise ValueError("0 marks a missing input")
        return super().training_step(batch, batch_idx) + self.shift


def _bad_from(first: int, last: int, batches: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``batches`` batches of 16 for :class:`_RefusesZeros`; row 5 of batches ``first`` to ``last`` NaN."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(batches * 16, 8, generator=generator)
    y = torch.randint(0, 3, (batches * 16,), generator=generator)
    x[torch.arange(first, last + 1) * 16 + 5, 2] = float("nan")
    return x, y


@pytest.mark.parametrize("shift", [0.0, -10.0])
def test_bad_data_that_cannot_be_checked_is_skipped_as_it_recurs_on_the_snapshot(recwarn, tmp_path, shift):
    """Corrupt rows in batches 1-12 of 20, a module that takes the batch neither without them nor with them
    set to 0: presumed the data's for steps 1-8, then each step is tested on the snapshot, where its batch is
    NaN too (BatchNorm over the NaN row) and an ordinary one is not: the data's, skipped, no rollback. With a
    loss below 0 that test had said a rollback helps (it asked for a log scale and a positive reference):
    steps 9-12 were taken for the model's, rolled back, and the run stopped in its 4th epoch."""
    x, y = _bad_from(1, 12, 20)
    model, guard = _RefusesZeros(16, shift), StabilityGuard(max_rollbacks=1)
    trainer = pl.Trainer(max_epochs=2, callbacks=[guard], default_root_dir=tmp_path, **trainer_kwargs())
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=16))
    bad_steps = [*range(1, 13), *range(21, 33)]
    assert [(event["step"], event.get("cause")) for event in guard.events] == [
        (step, "data") for step in bad_steps
    ]
    assert guard.rollbacks == 0 and not guard.stopped and guard.bad_batches == 24
    assert all(torch.isfinite(buffer).all() for buffer in model.buffers())
    said = [str(w.message) for w in recwarn if "escalates as the model's" in str(w.message)]
    assert len(said) == 1 and said[0].startswith("StabilityGuard: step 9 is non-finite")


def test_an_unbroken_row_of_bad_data_recurring_on_the_snapshot_escalates_in_the_end(tmp_path):
    """Every batch from the 4th on holds a corrupt row that can be checked neither way and recurs on the
    snapshot: a data stream gone bad for good. After 8 presumed and RECURRING_DATA_FAULTS = 8 tested steps
    in a row, with no step applied between, the next is the model's: rolled back (it had been skipped for
    ever)."""
    from lightning_pulse.core.stability_steps import UNCHECKED_DATA_FAULTS

    x, y = _bad_from(4, 29, 30)
    guard = StabilityGuard(max_rollbacks=1)
    trainer = pl.Trainer(max_epochs=1, callbacks=[guard], default_root_dir=tmp_path, **trainer_kwargs())
    trainer.fit(_RefusesZeros(16), DataLoader(TensorDataset(x, y), batch_size=16))
    row = UNCHECKED_DATA_FAULTS + 8  # RECURRING_DATA_FAULTS
    flagged = [event for event in guard.events if event.get("event") == "nonfinite_loss"]
    causes = [(event["step"], event.get("cause")) for event in flagged]
    assert causes[:row] == [(step, "data") for step in range(4, 4 + row)]
    assert causes[row] == (4 + row, None)
    assert guard.bad_batches == row and guard.rollbacks == 1  # then the epoch's last batches are skipped


class _WeightsBlowUpOnce(pl.LightningModule):
    """Masks its missing labels out of the loss and refuses a label of exactly 0 (as a log-target regression
    might); at step 12 its weights blow up (finite, times 1e25) once."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        self.blown = False

    def training_step(self, batch, batch_idx):
        x, y = batch
        if bool((y == 0).any()):
            raise ValueError("a label of 0 is not valid")
        if self.trainer.global_step == 12 and not self.blown and torch.is_grad_enabled():
            self.blown = True
            with torch.no_grad():
                self.net[2].weight.mul_(1e25)
        known = ~y.isnan()
        return ((self.net(x) - y.nan_to_num()) ** 2 * known).sum() / known.sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_bad_data_that_cannot_be_checked_is_the_models_when_its_batch_is_finite_on_the_snapshot(tmp_path):
    """Every row holds a NaN label (a task with no label), and the module takes the batch neither without
    them nor with them set to 0. From step 12 its weights are huge: presumed the data's for 8 steps, then
    tested on the snapshot, where the same batch is finite: the model's, rolled back, and training
    recovers."""
    from lightning_pulse.core.stability_steps import UNCHECKED_DATA_FAULTS

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(640, 8, generator=generator)
    y = x @ torch.randn(8, 4, generator=generator)
    y[:, 3] = float("nan")
    guard = _missing_labels_guard()
    trainer = pl.Trainer(max_epochs=1, callbacks=[guard], default_root_dir=tmp_path, **trainer_kwargs())
    trainer.fit(_WeightsBlowUpOnce(), DataLoader(TensorDataset(x, y), batch_size=16))
    flagged = [event for event in guard.events if event.get("event") == "nonfinite_loss"]
    causes = [(event["step"], event.get("cause")) for event in flagged]
    row = 12 + UNCHECKED_DATA_FAULTS
    assert causes[:UNCHECKED_DATA_FAULTS] == [(step, "data") for step in range(12, row)]
    assert causes[UNCHECKED_DATA_FAULTS] == (row, None)
    assert guard.rollbacks == 1 and not guard.stopped and trainer.global_step == 40


def test_the_snapshot_test_needs_a_non_finite_batch_and_a_finite_ordinary_one_on_each_snapshot():
    """A non-finite loss is no matter of scale: a reference loss below 0 counts (it had made the test say a
    rollback helps). Finite flagged loss, a non-finite ordinary one, or no snapshot: it cannot tell."""
    from lightning_pulse.core.stability_steps import StabilityCore

    model, nan = nn.Linear(2, 2), float("nan")
    core = StabilityCore(None, 3.0, 3.0, 20, 5, 2, 0, 10, 2, 0, 3)
    assert not core.recurs_at_snapshot(model, 30, True, lambda target: (nan, 1.0))  # no snapshot held
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    core.take_snapshot(0, model, [optimizer], [], {})
    for losses, recurs in [((nan, -3.0), True), ((nan, 1.0), True), ((5.0, 1.0), False), ((nan, nan), False)]:
        assert (
            core.recurs_at_snapshot(model, 30, True, lambda target, found=losses: found, [optimizer])
            is recurs
        )
    assert not core.recurs_at_snapshot(model, 30, False, lambda target: (nan, 1.0), [optimizer])


class _GradModes(pl.LightningModule):
    """Notes whether autograd was on at each ``training_step`` call (a private list: the recompute keeps
    public ones as they were)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Linear(8, 3)
        self._grad_modes: list[bool] = []

    def training_step(self, batch, batch_idx):
        self._grad_modes.append(torch.is_grad_enabled())
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def test_the_loss_without_the_bad_rows_is_recomputed_without_a_graph(tmp_path):
    """The check's forward ran with autograd on, building a graph while the step's gradients were held."""
    x, y = torch.randn(64, 8), torch.randint(0, 3, (64,))
    x[37, 1] = float("nan")  # row 5 of batch 2
    model, guard = _GradModes(), StabilityGuard()
    trainer = pl.Trainer(max_epochs=1, callbacks=[guard], default_root_dir=tmp_path, **trainer_kwargs())
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=16))
    assert [(event["step"], event.get("cause")) for event in guard.events] == [(2, "data")]
    assert guard.core.unchecked_data_faults == 0
    assert model._grad_modes == [True, True, True, False, True]  # batch 2's check ran after its step


class _OutOfMemoryInChecks(_GradModes):
    """Runs out of memory in a forward without autograd (as the check's forward might, the step's gradients
    still held)."""

    def training_step(self, batch, batch_idx):
        if not torch.is_grad_enabled():
            raise torch.OutOfMemoryError("out of memory (a test's)")
        return super().training_step(batch, batch_idx)


def test_a_check_that_runs_out_of_memory_counts_the_batch_unchecked_and_says_so(tmp_path):
    """The check's failure is no reason to end the run, and running out of memory no reason to hide: the
    batch is presumed the data's (unchecked), and a warning says why, once."""
    x, y = torch.randn(64, 8), torch.randint(0, 3, (64,))
    x[[37, 53], 1] = float("nan")  # batches 2 and 3, in a row
    guard = StabilityGuard()
    trainer = pl.Trainer(max_epochs=1, callbacks=[guard], default_root_dir=tmp_path, **trainer_kwargs())
    with pytest.warns(UserWarning, match="ran out of memory") as caught:
        trainer.fit(_OutOfMemoryInChecks(), DataLoader(TensorDataset(x, y), batch_size=16))
    assert [(event["step"], event.get("cause")) for event in guard.events] == [(2, "data"), (3, "data")]
    assert guard.core.unchecked_data_faults == 2 and guard.rollbacks == 0
    assert len([w for w in caught if "ran out of memory" in str(w.message)]) == 1


class _StandardisedLoss(pl.LightningModule):
    """A loss normalised by batch statistics: one row's standard deviation is NaN."""

    def __init__(self):
        super().__init__()
        self.net = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        prediction = self.net(x).squeeze(1)
        return ((prediction - prediction.mean()) / prediction.std() - y).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_a_check_that_would_leave_one_row_is_not_run(tmp_path):
    """A batch of 2 with one corrupt row: the loss of the one row left is NaN (its standard deviation), so a
    real data fault was charged to the model. With fewer than 2 rows left it is presumed the data's."""
    from lightning_pulse.core.fault_origin import without_bad_rows

    assert without_bad_rows((torch.ones(2, 4),), [1], 2) is None
    assert without_bad_rows((torch.ones(3, 4),), [1], 3)[0].shape == (2, 4)
    x, y = torch.randn(16, 4, generator=torch.Generator().manual_seed(0)), torch.zeros(16)
    x[5, 0] = float("nan")  # batch 2 of 8
    guard = StabilityGuard()
    trainer = pl.Trainer(max_epochs=2, callbacks=[guard], default_root_dir=tmp_path, **trainer_kwargs())
    trainer.fit(_StandardisedLoss(), DataLoader(TensorDataset(x, y), batch_size=2))
    assert [(event["step"], event.get("cause")) for event in guard.events] == [(2, "data"), (10, "data")]
    assert guard.rollbacks == 0 and guard.bad_batches == 2


def test_presumed_data_faults_are_counted_in_a_row_only():
    from lightning_pulse.core.stability_policy import Action
    from lightning_pulse.core.stability_steps import UNCHECKED_DATA_FAULTS, StabilityCore

    model = nn.Linear(2, 2)
    core = StabilityCore(None, 3.0, 3.0, 20, 5, 2, 0, 10, 2, 0, 3)
    for step in range(UNCHECKED_DATA_FAULTS - 1):
        core.data_fault(model, step, [], unchecked=True)
    assert core.presumes_data
    core.finish_step(Action.APPLY, 10)  # a healthy step between: the row starts again
    for step in range(UNCHECKED_DATA_FAULTS - 1):
        core.data_fault(model, 11 + step, [], unchecked=True)
    core.data_fault(model, 30, [])  # a checked one too
    assert core.presumes_data and core.unchecked_data_faults == 0
    for step in range(UNCHECKED_DATA_FAULTS):
        core.data_fault(model, 40 + step, [], unchecked=True)
    assert not core.presumes_data


def test_the_check_recomputes_every_micro_batch_on_every_rank_and_agrees():
    """Under DDP each rank runs one forward per micro-batch (a bad one that cannot be cut as it is), so that
    collectives inside the forward pair up; a non-finite loss on another rank is the model's fault here
    too."""
    from lightning_pulse.core.fault_origin import _bad_batches, data_explains_step

    x = torch.ones(4, 2)
    x[1, 0] = float("nan")
    unknown = {"x": torch.ones(4, 2), "t": torch.full((3,), float("nan"))}  # rows unknown
    traced = list(_bad_batches([(0, (x,)), (1, (torch.ones(4, 2),)), (2, unknown)], None, None))
    ran = []

    def losses_of(batches):
        ran.extend(batches)
        return [1.0] * len(batches)

    assert data_explains_step(traced, losses_of) == (True, False)  # the unknown one with its NaN set to 0
    assert [batch_idx for batch_idx, _ in ran] == [0, 1, 2] and [len(b[0]) for _, b in ran[:2]] == [3, 4]
    assert ran[2][1]["t"].tolist() == [0.0, 0.0, 0.0]
    ran.clear()
    assert data_explains_step(traced, losses_of, lambda flags: flags) == (True, False)
    assert [batch_idx for batch_idx, _ in ran] == [0, 1, 2, 0, 1, 2]  # two forwards each, on every rank
    ran.clear()
    no_loss_when_cut = lambda batches: [None if len(b[0]) == 3 else 1.0 for _, b in batches]  # noqa: E731
    assert data_explains_step(traced[:1], no_loss_when_cut) == (True, False)  # then with the NaN set to 0
    assert data_explains_step(traced[:1], lambda batches: [None] * len(batches)) == (True, True)
    assert data_explains_step(traced[:2], losses_of) == (True, False)
    refuted_elsewhere = data_explains_step(traced[:2], losses_of, lambda f: f + torch.tensor([1.0, 0.0]))
    assert refuted_elsewhere == (False, False)
    assert data_explains_step(traced[:2], lambda batches: [1.0, float("nan")]) == (False, False)


def test_zero_filled_sets_nan_and_plus_inf_to_zero_and_keeps_masks_and_shapes():
    from lightning_pulse.core.fault_origin import zero_filled

    x = torch.tensor([[float("nan"), 1.0], [float("inf"), float("-inf")]])
    batch = {"x": x, "ids": torch.tensor([3, 4]), "nodes": [torch.full((3, 2), float("nan"))]}
    filled = zero_filled(batch)
    assert filled["x"].tolist() == [[0.0, 1.0], [0.0, float("-inf")]] and x.isnan().any()  # a copy
    assert filled["ids"].tolist() == [3, 4] and filled["nodes"][0].tolist() == [[0.0, 0.0]] * 3


def test_the_guards_warnings_on_a_flagged_step_point_at_the_callbacks_file(tmp_path):
    """The warnings of a flagged step's checks (a data fault, a check out of memory) come from the guard's
    core since the lean-core refactor, on the guard's behalf: they still name the callback's file, so a
    warnings filter on the callback's module keeps matching."""
    x, y = torch.randn(64, 8), torch.randint(0, 3, (64,))
    x[[37, 53], 1] = float("nan")  # batches 2 and 3, in a row
    trainer = pl.Trainer(
        max_epochs=1, callbacks=[StabilityGuard()], default_root_dir=tmp_path, **trainer_kwargs()
    )
    with pytest.warns(UserWarning, match="ran out of memory") as caught:
        trainer.fit(_OutOfMemoryInChecks(), DataLoader(TensorDataset(x, y), batch_size=16))
    guards = [w for w in caught if str(w.message).startswith("StabilityGuard")]
    assert len(guards) >= 2 and any("ran out of memory" in str(w.message) for w in guards)
    assert all(w.filename.endswith("callbacks/stability_guard.py") for w in guards), [
        w.filename for w in guards
    ]


# ---------------------------------------------------------------- a training_step that changes its batch
class _WeightedRows(Dataset):
    """64 dict samples ``{"x", "y", "weight"}``; sample 21's weight is NaN (one batch of 8 an epoch)."""

    def __init__(self):
        generator = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(64, 6, generator=generator), torch.randn(64, 1, generator=generator)
        self.weight = torch.ones(64)
        self.weight[21] = float("nan")

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "y": self.y[i], "weight": self.weight[i]}


class _PopsWeight(pl.LightningModule):
    def __init__(self, pops: bool):
        super().__init__()
        self.pops = pops
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        weight = batch.pop("weight") if self.pops else batch["weight"]  # a common idiom: take a key out
        return (
            nn.functional.mse_loss(self.net(batch["x"]), batch["y"], reduction="none").mean(1) * weight
        ).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


@pytest.mark.parametrize("pops", [False, True])
def test_a_training_step_that_pops_a_key_of_its_batch_still_has_a_nan_sample_found_in_the_data(pops):
    """``w = batch.pop("weight")`` left the guard, which kept the batch by reference, a batch without the NaN
    weight: the fault was charged to the model (no bad samples) and its third flag rolled the run back to its
    start. The guard keeps the batch's containers as ``training_step`` received them now: each NaN batch is
    the data's, skipped, and the run never rolls back, as when the key is only read."""
    pl.seed_everything(0)
    guard = StabilityGuard(warmup=3, window=20, snapshot_every=4, rollback_margin=2)
    trainer = pl.Trainer(max_epochs=3, callbacks=[guard], **trainer_kwargs())
    trainer.fit(_PopsWeight(pops), DataLoader(_WeightedRows(), batch_size=8))
    assert [(sample["batch_idx"], sample["rows"]) for sample in guard.bad_samples] == [(2, [5])] * 3
    assert guard.metrics()["stability/bad_batches"] == 3 and guard.metrics()["stability/rollbacks"] == 0


class _ConstantSample(Dataset):
    """64 dict samples ``{"x", "y"}``; sample 21's ``x`` is constant: standardized per sample, it is NaN."""

    def __init__(self):
        generator = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(64, 6, generator=generator), torch.randn(64, 1, generator=generator)
        self.x[21] = 1.0

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "y": self.y[i]}


def _standardize(batch: dict) -> None:
    x = batch["x"]
    batch["x"] = (x - x.mean(1, keepdim=True)) / x.std(1, keepdim=True)  # rebound, as augmentations do


class _Standardizes(pl.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        _standardize(batch)


class _StandardizedRegressor(pl.LightningModule):
    """Pops ``y`` from its batch; standardizes ``x`` in its ``on_train_batch_start`` where ``own_hook``."""

    def __init__(self, own_hook: bool):
        super().__init__()
        self.own_hook = own_hook
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))

    def on_train_batch_start(self, batch, batch_idx):
        if self.own_hook:
            _standardize(batch)

    def training_step(self, batch, batch_idx):
        y = batch.pop("y")
        return nn.functional.mse_loss(self.net(batch["x"]), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


@pytest.mark.parametrize("where", ["a callback listed after the guard", "the module's own hook"])
def test_a_batch_start_hook_after_the_guard_that_makes_a_nan_row_leaves_it_the_datas_fault(where):
    """A batch-start hook that runs after the guard's (a callback listed after it, the module's own
    ``on_train_batch_start``) rebinds ``batch["x"]`` standardized: sample 21's row turns NaN. The guard had
    copied the batch before the rebinding, so its checks saw the raw, finite ``x``: the step was charged to
    the model and the run rolled back. It reads the batch as it stands now, with what ``training_step``
    popped (``y``) put back: each NaN batch is the data's, skipped, and the run never rolls back."""
    pl.seed_everything(0)
    guard = StabilityGuard(warmup=3, window=20, snapshot_every=4, rollback_margin=2)
    own_hook = where == "the module's own hook"
    callbacks = [guard] if own_hook else [guard, _Standardizes()]
    trainer = pl.Trainer(max_epochs=3, callbacks=callbacks, **trainer_kwargs())
    trainer.fit(_StandardizedRegressor(own_hook), DataLoader(_ConstantSample(), batch_size=8))
    assert [(sample["batch_idx"], sample["rows"]) for sample in guard.bad_samples] == [(2, [5])] * 3
    assert guard.metrics()["stability/bad_batches"] == 3 and guard.metrics()["stability/rollbacks"] == 0


class _PopsWeightClassifier(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 3))

    def training_step(self, batch, batch_idx):
        weight = batch.pop("weight")
        return (
            nn.functional.cross_entropy(self.net(batch["x"]), batch["y"], reduction="none") * weight
        ).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("guard_first", [False, True])
def test_a_popped_nan_weight_of_a_batch_hard_sample_replay_cut_names_the_sample_that_trained(guard_first):
    """``HardSampleReplay(mode="batch")`` cuts each batch of 16 in place to 8 rows and ``training_step`` pops
    the NaN weight of sample 37. Listed first, the guard copies the batch before the cut: the weight it puts
    back is cut as the batch was, so sample 37 is named, in the cut batch's rows."""
    from lightning_pulse import HardSampleReplay

    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(256, 10, generator=generator), torch.randint(0, 3, (256,), generator=generator)
    weight = torch.ones(256)
    weight[37] = float("nan")
    samples = [{"x": x[i], "y": y[i], "weight": weight[i]} for i in range(256)]
    pl.seed_everything(0)
    guard, replay = StabilityGuard(), HardSampleReplay(mode="batch", replay_fraction=0.5)
    callbacks = [guard, replay] if guard_first else [replay, guard]
    trainer = pl.Trainer(max_epochs=4, callbacks=callbacks, **trainer_kwargs())
    trainer.fit(_PopsWeightClassifier(), DataLoader(samples, batch_size=16, shuffle=True))
    assert [sample["indices"] for sample in guard.bad_samples] == [[37]] * 3  # an epoch's cut left it out
    assert max(sample["rows"][0] for sample in guard.bad_samples[1:]) < 8  # rows of cut batches


class _NotesMeta(pl.Callback):
    """Listed before the guard: notes the nested ``meta`` dict of each batch as loaded."""

    meta = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.meta = batch["meta"]


class _ReadsItsOwnMeta(pl.LightningModule):
    """Checks that its batch's nested ``meta`` dict is the one its batch was loaded with (``noted``)."""

    def __init__(self, noted: _NotesMeta):
        super().__init__()
        self.noted = noted
        self.net = nn.Linear(6, 1)

    def training_step(self, batch, batch_idx):
        assert batch["meta"] is self.noted.meta
        return nn.functional.mse_loss(self.net(batch["x"]), batch["y"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def test_a_mapping_that_keeps_its_entries_in_an_attribute_reaches_training_step_unchanged():
    """The guard's copy of a ``MutableMapping`` subclass (``copy.copy``: a new object sharing its entries
    attribute) wrote its nested copies into the user's batch: ``training_step`` got a ``meta`` dict other
    than the one its batch was loaded with. Such a mapping is kept by reference now, as any object of the
    user's own."""

    def collate(samples):
        return AttributeStoredMapping(
            {"x": torch.randn(len(samples), 6), "y": torch.randn(len(samples), 1), "meta": {"n": 1}}
        )

    pl.seed_everything(0)
    noted, guard = _NotesMeta(), StabilityGuard(warmup=3, window=20)
    trainer = pl.Trainer(max_steps=4, callbacks=[noted, guard], **trainer_kwargs())
    trainer.fit(_ReadsItsOwnMeta(noted), DataLoader(range(32), batch_size=8, collate_fn=collate))
    assert trainer.global_step == 4


class _WeightedSamples(Dataset):
    """64 regression samples with a weight, 0 for sample 21 (the third batch of 8, row 5)."""

    def __init__(self):
        generator = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(64, 6, generator=generator), torch.randn(64, 1, generator=generator)
        self.w = torch.ones(64, 1)
        self.w[21] = 0.0

    def __len__(self):
        return 64

    def __getitem__(self, index):
        return {"x": self.x[index], "y": self.y[index], "w": self.w[index]}


class _ReweightsLabels(pl.Callback):
    """Listed after the guard: rebinds ``y`` to ``y * w / w`` (NaN where the weight is 0)."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        batch["y"] = batch["y"] * batch["w"] / batch["w"]


class _PopsWhatAHookMade(pl.LightningModule):
    """``training_step`` pops ``y`` (and ``v``, which its own ``on_train_batch_start`` adds where
    ``adds_key``: NaN where the weight is 0)."""

    def __init__(self, adds_key: bool):
        super().__init__()
        self.adds_key = adds_key
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))

    def on_train_batch_start(self, batch, batch_idx):
        if self.adds_key:
            batch["v"] = torch.where(batch["w"] == 0, float("nan"), 1.0)

    def training_step(self, batch, batch_idx):
        y = batch.pop("y")
        scale = batch.pop("v") if self.adds_key else 1.0
        return ((self.net(batch["x"]) - y) ** 2 * scale).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


@pytest.mark.parametrize("hook", ["a later callback rebinds the popped key", "the module's hook adds it"])
def test_an_entry_a_later_batch_start_hook_made_and_training_step_popped_is_checked_as_trained(hook):
    """The guard keeps the batch as ``training_step`` got it (its containers copied at the step's entry):
    a NaN label a callback listed after the guard rebound, or a NaN key the module's own
    ``on_train_batch_start`` added, both popped by the step, is the data's fault (skipped, never rolled
    back). Kept from the guard's batch start, the first was checked with the finite label it had before
    and charged to the model; the second's re-run for the rollback test raised ``KeyError`` out of the fit."""
    pl.seed_everything(0)
    guard = StabilityGuard(warmup=3, window=20, snapshot_every=4, rollback_margin=2)
    adds_key = hook == "the module's hook adds it"
    callbacks = [guard] if adds_key else [guard, _ReweightsLabels()]
    trainer = pl.Trainer(max_epochs=3, callbacks=callbacks, **trainer_kwargs())
    trainer.fit(_PopsWhatAHookMade(adds_key), DataLoader(_WeightedSamples(), batch_size=8))
    assert [(sample["batch_idx"], sample["rows"]) for sample in guard.bad_samples] == [(2, [5])] * 3
    assert guard.metrics()["stability/bad_batches"] == 3 and guard.metrics()["stability/rollbacks"] == 0


class _StashesPerBatch(pl.LightningModule):
    """Its ``on_train_batch_start`` stashes a per-batch scale on a private list, which ``training_step``
    consumes: a re-run of ``training_step`` alone finds the list empty and raises ``IndexError``."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
        self._scales = []

    def on_train_batch_start(self, batch, batch_idx):
        self._scales.append(100.0 if batch_idx in (5, 7) else 1.0)  # loss spikes, a healthy step between

    def training_step(self, batch, batch_idx):
        return ((self.net(batch["x"]) - batch["y"]) ** 2).mean() * self._scales.pop()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def test_a_training_step_that_fails_when_the_rollback_test_re_runs_it_leaves_the_test_inconclusive():
    """The rollback test re-runs ``training_step`` on the spiking batch; here the re-run raises. The test
    counts as inconclusive (the spike is rolled back, as an untested one), said once; the fit goes on."""
    pl.seed_everything(0)
    guard = StabilityGuard(warmup=3, window=20, rollback_after=2, snapshot_every=2, rollback_margin=1)
    trainer = pl.Trainer(max_epochs=1, callbacks=[guard], **trainer_kwargs())
    with pytest.warns(UserWarning, match="re-running training_step .* raised IndexError") as caught:
        trainer.fit(_StashesPerBatch(), DataLoader(_WeightedSamples(), batch_size=8))
    assert sum("re-running training_step" in str(warning.message) for warning in caught) == 1
    assert guard.metrics()["stability/rollbacks"] == 1 and trainer.global_step == 8
