"""ScheduledPrune on a small CNN built from this library's own ``ManifoldHyperConnection`` (``channel_dim=1``,
as docs/mhc.md shows). A held-out sweep: the fit-start warning told the user to build the stream maps
("`phi_res` of ManifoldHyperConnection is not a layer's `weight`") "from `nn.Linear` layers"."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pulse import ScheduledPrune
from lightning_pulse.core import pruning
from lightning_pulse.errors import PulseRefusal
from lightning_pulse.nn import ManifoldHyperConnection, collapse_streams, expand_streams
from tests.conftest import trainer_kwargs

STREAMS, CHANNELS = 4, 8


class _HyperConnectedCNN(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, CHANNELS, 3, padding=1), nn.ReLU())
        branch = nn.Sequential(
            nn.BatchNorm2d(CHANNELS), nn.ReLU(), nn.Conv2d(CHANNELS, CHANNELS, 3, padding=1)
        )
        self.block = ManifoldHyperConnection(branch, dim=CHANNELS, n_streams=STREAMS, channel_dim=1)
        self.head = nn.Linear(CHANNELS, 4)

    def forward(self, x):
        streams = self.block(expand_streams(self.stem(x), STREAMS, channel_dim=1))
        return self.head(collapse_streams(streams, channel_dim=1).mean((2, 3)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(0)
        x, y = torch.randn(64, 1, 6, 6, generator=generator), torch.randint(0, 4, (64,), generator=generator)
        return DataLoader(TensorDataset(x, y), batch_size=16)


def _fit(prune: ScheduledPrune) -> list[str]:
    pl.seed_everything(0)
    trainer = pl.Trainer(callbacks=[prune], **trainer_kwargs(max_steps=8, limit_val_batches=0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(_HyperConnectedCNN())
    return [str(w.message) for w in caught if "ScheduledPrune" in str(w.message)]


def test_the_stream_maps_of_hyper_connections_are_not_counted_out_of_reach():
    prune = ScheduledPrune(final_sparsity=0.5, start=2, end=6, every=2, probe_batches=0)
    said = _fit(prune)
    assert not [message for message in said if "out of its reach" in message]
    assert prune.events and prune.events[-1]["sparsity"] == pytest.approx(0.5, abs=0.01)


def test_a_structured_search_that_runs_out_of_time_names_the_hyper_connections_not_rotary_attention(
    monkeypatch,
):
    # the sweep's model waited out the 60 s search and was told of rotary attention it does not have; the
    # search takes minutes here, so half a second runs it out on any machine
    monkeypatch.setattr(pruning, "STRUCTURED_CHECK_SECONDS", 0.5)
    prune = ScheduledPrune(final_sparsity=0.5, mode="structured", start=2, end=6, every=2, probe_batches=0)
    with pytest.raises(PulseRefusal) as refusal:
        _fit(prune)
    message = str(refusal.value)
    assert "did not finish within 0.5 s, on the streams of HyperConnection layers (block)" in message
    assert "rotary" not in message


class _HyperConnectedMLP(_HyperConnectedCNN):
    """Linear layers only, as in an mHC transformer's feed-forward blocks: no convolution anywhere."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Flatten(), nn.Linear(36, CHANNELS), nn.ReLU())
        branch = nn.Sequential(nn.Linear(CHANNELS, 16), nn.ReLU(), nn.Linear(16, CHANNELS))
        self.block = ManifoldHyperConnection(branch, dim=CHANNELS, n_streams=2)

    def forward(self, x):
        return self.head(collapse_streams(self.block(expand_streams(self.stem(x), 2))))


def _structured_fit(model: pl.LightningModule, exclude_pattern: str | None = None) -> pl.Trainer:
    prune = ScheduledPrune(
        final_sparsity=0.5,
        mode="structured",
        start=2,
        end=6,
        every=2,
        probe_batches=0,
        exclude_pattern=exclude_pattern,
    )
    pl.seed_everything(0)
    trainer = pl.Trainer(callbacks=[prune], **trainer_kwargs(max_steps=8, limit_val_batches=0))
    trainer.fit(model)
    return trainer


def _first_search_runs_out(monkeypatch) -> None:
    """The fit's own search runs out of time at once (it never ends on the streams); the trial cut that checks
    the offered pattern gets the full time, as in a real run, so a busy machine cannot time it out."""
    trial_cut, calls = pruning._trial_cut, []

    def timed_trial_cut(*args, **kwargs):
        calls.append(None)
        monkeypatch.setattr(pruning, "STRUCTURED_CHECK_SECONDS", 0.5 if len(calls) == 1 else 60.0)
        return trial_cut(*args, **kwargs)

    monkeypatch.setattr(pruning, "_trial_cut", timed_trial_cut)


def test_the_endless_search_on_hyper_connection_streams_is_named_with_a_checked_pattern_that_works(
    monkeypatch,
):
    # a held-out sweep's Linear-only mHC Llama was told of "HyperConnection layers around convolutions", with
    # an unchecked `exclude_pattern` for the blocks; the search never ends on the streams, but leaving out the
    # layers that write into them (the stem's, the branch's last) lets the branch's hidden width be cut
    _first_search_runs_out(monkeypatch)
    with pytest.raises(PulseRefusal) as refusal:
        _structured_fit(_HyperConnectedMLP())
    message = str(refusal.value)
    assert "on the streams of HyperConnection layers (block), where it never ends" in message
    assert "convolution" not in message and "attention" not in message
    pattern = r"^(stem\.1|block\.branch\.2)$"
    assert (
        f"with `exclude_pattern`={pattern!r} (the layers writing into the streams) the trial cut passes"
        in (message)
    )
    assert message.endswith(
        "Use the `exclude_pattern` named, or mode='unstructured' (its masks need no dependency search)."
    )
    monkeypatch.undo()
    model = _HyperConnectedMLP()
    trainer = _structured_fit(model, exclude_pattern=pattern)
    assert trainer.global_step == 8
    assert model.block.branch[0].out_features < 16 and model.block.branch[2].out_features == CHANNELS


def test_the_stream_refusal_offers_no_pattern_where_leaving_the_writers_out_leaves_nothing_to_cut(
    monkeypatch,
):
    # the CNN's only branch convolution writes into the streams: with it and the stem left out, no layer is
    # left to cut, so no pattern is offered
    _first_search_runs_out(monkeypatch)
    prune = ScheduledPrune(final_sparsity=0.5, mode="structured", start=2, end=6, every=2, probe_batches=0)
    with pytest.raises(PulseRefusal) as refusal:
        _fit(prune)
    message = str(refusal.value)
    assert "exclude_pattern" not in message
    assert message.endswith("Use mode='unstructured' (its masks need no dependency search).")


class _ResidualBranchCNN(_HyperConnectedCNN):
    """A ResNet basic block as the branch: every convolution and norm in it is as wide as the streams."""

    def __init__(self) -> None:
        super().__init__()
        branch = nn.Sequential(
            nn.Conv2d(CHANNELS, CHANNELS, 3, padding=1),
            nn.BatchNorm2d(CHANNELS),
            nn.ReLU(),
            nn.Conv2d(CHANNELS, CHANNELS, 3, padding=1),
            nn.BatchNorm2d(CHANNELS),
        )
        self.block = ManifoldHyperConnection(branch, dim=CHANNELS, n_streams=2, channel_dim=1)

    def forward(self, x):
        streams = self.block(expand_streams(self.stem(x), 2, channel_dim=1))
        return self.head(collapse_streams(streams, channel_dim=1).mean((2, 3)))


def test_a_residual_branch_gets_a_pattern_of_its_last_layers_only_and_its_first_convolution_is_cut(
    monkeypatch,
):
    # a review: with every layer of the branch as wide as the streams, all of them were left out and nothing
    # was left to cut, so no pattern was offered; only the branch's last convolution writes into the streams
    # (the norm after it is no chosen layer), and leaving it and the stem out lets the first one be cut
    _first_search_runs_out(monkeypatch)
    with pytest.raises(PulseRefusal) as refusal:
        _structured_fit(_ResidualBranchCNN())
    pattern = r"^(stem\.0|block\.branch\.3)$"
    assert f"`exclude_pattern`={pattern!r} (the layers writing into the streams) the trial cut passes" in str(
        refusal.value
    )
    monkeypatch.undo()
    model = _ResidualBranchCNN()
    trainer = _structured_fit(model, exclude_pattern=pattern)
    assert trainer.global_step == 8
    assert model.block.branch[0].out_channels < CHANNELS and model.block.branch[3].out_channels == CHANNELS
