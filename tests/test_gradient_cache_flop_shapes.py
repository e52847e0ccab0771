"""GradientCache's FLOP ledger on batches whose shapes vary: per-batch padding, another batch size."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.flop_counter import FlopCounterMode

from lightning_pulse import GradientCache
from lightning_pulse.core.backward_flops import BackwardFlopLedger
from lightning_pulse.core.freeze_units import discover_units
from tests.conftest import trainer_kwargs

V, T, N, B = 20, 40, 256, 16


class Tagger(pl.LightningModule):
    """A token tagger: embedding, projection, GRU, two linear layers; every token gets a label."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, 16)
        self.proj = nn.Linear(16, 32)
        self.rnn = nn.GRU(32, 32, batch_first=True)
        self.mid = nn.Linear(32, 32)
        self.out = nn.Linear(32, V)

    def training_step(self, batch, batch_idx):
        x, y = batch  # (B, L), L the batch's longest sequence
        h, _ = self.rnn(F.relu(self.proj(self.emb(x))))
        return F.cross_entropy(self.out(F.relu(self.mid(h))).reshape(-1, V), y.reshape(-1), ignore_index=-100)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def pad_to_longest(samples):
    """Dynamic padding: each batch as long as its longest sequence (samples: (tokens (T,), labels (T,), length))."""
    longest = max(int(length) for _, _, length in samples)
    x = torch.stack([tokens[:longest] for tokens, _, _ in samples])
    return x, torch.stack([labels[:longest] for _, labels, _ in samples])


def length_sorted_loader() -> DataLoader:
    """Longest sequences first, as a length-bucketing sampler gives: batch lengths run from 40 down to 2."""
    torch.manual_seed(0)
    lengths = torch.randint(2, T + 1, (N,)).sort(descending=True).values
    x, y = torch.randint(0, V, (N, T)), torch.randint(0, V, (N, T))
    y[torch.arange(T)[None] >= lengths[:, None]] = -100
    return DataLoader(TensorDataset(x, y, lengths), batch_size=B, collate_fn=pad_to_longest)


class BackwardFlops(Callback):
    """Counts the FLOPs of every backward with its own FlopCounterMode (independent of GradientCache's)."""

    def __init__(self) -> None:
        self.per_backward: list[int] = []
        self._counter: FlopCounterMode | None = None

    def on_before_backward(self, trainer, pl_module, loss):
        self._counter = FlopCounterMode(display=False)
        self._counter.__enter__()

    def on_after_backward(self, trainer, pl_module):
        self._counter.__exit__(None, None, None)
        self.per_backward.append(self._counter.get_total_flops())


def test_skipped_backward_flops_follow_each_batchs_padded_length():
    # before: each frozen-prefix length was measured once, on the first batch with it, and that figure was
    # charged to every later backward; the reference (nothing frozen) came from the first, 40-token batch,
    # so on this length-sorted loader the ledger reported 1.99x the FLOPs freezing really skipped
    pl.seed_everything(0)
    full = BackwardFlops()
    pl.Trainer(callbacks=[full], max_epochs=1, **trainer_kwargs()).fit(Tagger(), length_sorted_loader())

    pl.seed_everything(0)
    cache, ran, model = GradientCache(threshold=1.0, check_every=2, freeze_for=4), BackwardFlops(), Tagger()
    pl.Trainer(callbacks=[cache, ran], max_epochs=1, **trainer_kwargs()).fit(model, length_sorted_loader())

    assert len(full.per_backward) == len(ran.per_backward) == N // B
    assert full.per_backward[0] > 10 * full.per_backward[-1]  # the batches' shapes really vary
    skipped = sum(full.per_backward) - sum(ran.per_backward)
    assert skipped > 0.2 * sum(full.per_backward)  # freezing skipped a real share
    # measured once per prefix length, scaled to each batch's size: within the GRU's first step
    assert cache.ledger.skipped == pytest.approx(skipped, rel=0.03)
    assert cache.ledger.skipped_share == pytest.approx(skipped / sum(full.per_backward), rel=0.03)
    assert len(cache.ledger.flops_by_prefix) == 2 and 0 < cache.ledger.scaled_backwards < N // B
    assert not any(module._forward_hooks for module in model.modules())  # the sizes' hooks left with the fit


def test_the_ledger_scales_its_measurements_to_each_forward_and_leaves_no_hook_behind():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(40, 100), nn.ReLU(), nn.Linear(100, 100), nn.ReLU(), nn.Linear(100, 10))
    units, x = discover_units(model, None), torch.randn(32, 40)
    assert [unit.name for unit in units] == ["0", "2", "4"]

    def flops(rows: int, prefix: int) -> int:  # ground truth: this backward, counted by FlopCounterMode
        model[0].requires_grad_(prefix == 0)
        loss = model(x[:rows]).square().mean()
        with FlopCounterMode(display=False) as counter:
            loss.backward()
        return counter.get_total_flops()

    ledger, runs = BackwardFlopLedger(), [(32, 0), (32, 1), (8, 1), (8, 0), (8, 1)]
    for rows, prefix in runs:
        model[0].requires_grad_(prefix == 0)
        ledger.begin_forward(model, units)
        with torch.no_grad():
            model(x)  # a forward without a backward (pseudo-labels) adds nothing to the size
        loss = model(x[:rows]).square().mean()
        ledger.begin_backward(prefix)
        loss.backward()
        ledger.end_backward()
    assert ledger.flops_by_prefix == {0: flops(32, 0), 1: flops(32, 1)}  # measured once each, at 32 rows
    assert ledger.size_by_prefix == {0: 32 * 100, 1: 32 * 100}  # the first unit's output: 100 wide
    assert ledger.skipped == flops(32, 0) - flops(32, 1) + 2 * (flops(8, 0) - flops(8, 1))
    assert ledger.reference == sum(flops(rows, 0) for rows, _ in runs) and ledger.scaled_backwards == 3
    ledger.close()
    assert not any(module._forward_hooks for module in model.modules())
