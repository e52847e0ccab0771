"""The measures of ``benchmarks/studies/hard_sample_replay_signal.py``, on cases whose answers are known; and
what HardSampleReplay says of a batch whose rows are not its drawn samples (a collate_fn that drops some)."""

from __future__ import annotations

import math

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from benchmarks.studies.hard_sample_replay_signal import (
    easy_half_loss_ratio,
    per_sample_losses_and_gradients,
    signal_measures,
)
from lightning_pulse.callbacks.hard_sample_replay import HardSampleReplay
from lightning_pulse.core.sample_scores import SampleScoreTable
from lightning_pulse.errors import PulseRefusal
from tests.conftest import trainer_kwargs


def test_per_sample_gradients_equal_one_sample_at_a_time_autograd():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(7, 8), nn.Linear(8, 7))  # (B, T) tokens -> (B, T, V) logits
    tokens, targets = torch.randint(0, 7, (70, 5)), torch.randint(0, 7, (70, 5))
    losses, gradients, token_losses = per_sample_losses_and_gradients(model, tokens, targets)
    assert gradients.shape == (70, sum(p.numel() for p in model.parameters()))
    assert token_losses.shape == (350,)
    for i in (0, 63, 64, 69):  # either side of a chunk boundary
        loss = F.cross_entropy(model(tokens[i : i + 1]).reshape(-1, 7), targets[i])
        expected = torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, list(model.parameters()))])
        assert losses[i] == pytest.approx(float(loss), rel=1e-5)
        torch.testing.assert_close(gradients[i], expected, rtol=1e-4, atol=1e-6)


def test_learned_easy_half_carries_no_gradient_and_top_k_keeps_the_full_direction():
    direction = torch.randn(16)
    hard = direction + 0.05 * torch.randn(50, 16)  # the hard half: noisy copies of one direction
    gradients = torch.cat([torch.zeros(50, 16), hard])
    losses = torch.cat([torch.full((50,), 0.01), torch.linspace(1.0, 2.0, 50)]).numpy()
    out = signal_measures(losses, gradients, torch.Generator().manual_seed(0))["f0.5"]
    assert out["fair_share_ratio"] == 0.0
    assert out["cos_topk"] == pytest.approx(1.0)
    assert out["cos_random"] < out["cos_topk"]


def test_identical_samples_carry_an_even_share():
    gradients = torch.ones(40, 3)
    losses = torch.full((40,), 2.0).numpy()
    out = signal_measures(losses, gradients, torch.Generator().manual_seed(0))
    for kept in ("f0.5", "f0.7"):
        assert out[kept]["fair_share_ratio"] == pytest.approx(1.0)
        assert out[kept]["loss_fair_share_ratio"] == pytest.approx(1.0)
        assert out[kept]["cos_topk"] == pytest.approx(1.0) == out[kept]["cos_random"]
    assert out["loss_cv"] == pytest.approx(0.0)


def test_validation_and_reducible_rankings():
    torch.manual_seed(0)
    useful, noise = torch.randn(8), torch.randn(8)
    # 20 "noisy" samples: the highest loss, all of it irreducible, pointing away from the useful direction;
    # 20 learnable ones: lower loss, none of it irreducible, pointing the useful way
    gradients = torch.cat([noise + 0.01 * torch.randn(20, 8), useful + 0.01 * torch.randn(20, 8)])
    losses = torch.cat([torch.full((20,), 3.0), torch.full((20,), 1.0)]).numpy()
    reference = torch.cat([torch.full((20,), 3.0), torch.zeros(20)]).numpy()
    out = signal_measures(losses, gradients, torch.Generator().manual_seed(0), useful, reference)
    half = out["f0.5"]
    assert half["cos_val_topk"] == pytest.approx(_cos(noise, useful), abs=0.01)  # top-k takes the noise
    assert half["cos_val_topk_reducible"] == pytest.approx(1.0, abs=0.01)  # reducible top-k the useful half
    assert half["cos_val_topk"] < half["cos_val_random"] < half["cos_val_topk_reducible"]
    # the dropped half by reducible loss is the noisy one: its share of the gradient norms, over 1/2
    noisy_share = float(gradients[:20].norm(dim=1).sum() / gradients.norm(dim=1).sum())
    assert half["fair_share_reducible"] == pytest.approx(2 * noisy_share)
    assert out["cos_val_full"] == pytest.approx(_cos(gradients.mean(0), useful))


def _cos(a, b):
    return float(torch.dot(a, b) / (a.norm() * b.norm()))


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
    assert easy_half_loss_ratio(table) == pytest.approx(expected)


def test_easy_half_loss_ratio_is_nan_where_it_means_nothing():
    assert math.isnan(easy_half_loss_ratio(SampleScoreTable(4)))  # nothing scored
    zeros = SampleScoreTable(4)
    zeros.update(torch.arange(4), torch.zeros(4), step=0)
    assert math.isnan(easy_half_loss_ratio(zeros))
    negative = SampleScoreTable(4)
    negative.update(torch.arange(4), torch.tensor([-1.0, 2.0, 3.0, 4.0]), step=0)
    assert math.isnan(easy_half_loss_ratio(negative))


# ------------------------------------------------------------------ a collate_fn that drops samples
class _UnreadableAt(torch.utils.data.Dataset):
    """96 dict samples; ``None`` for those at ``unreadable`` (files that fail to load)."""

    def __init__(self, unreadable: set[int]) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(96, 6, generator=generator)
        self.y = (self.x[:, 0] > 0).long()
        self.unreadable = unreadable

    def __len__(self):
        return 96

    def __getitem__(self, index):
        return None if index in self.unreadable else {"x": self.x[index], "y": self.y[index]}


def _skip_unreadable(items):
    """The usual collate_fn that drops the samples that failed to load: 7 rows for 8 drawn indices."""
    return torch.utils.data.default_collate([item for item in items if item is not None])


class _DictClassifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 2))

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self.net(batch["x"]), batch["y"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit_dropping(mode: str, unreadable: set[int]) -> tuple[pl.Trainer, HardSampleReplay]:
    loader = DataLoader(_UnreadableAt(unreadable), batch_size=8, collate_fn=_skip_unreadable)
    replay = HardSampleReplay(mode=mode)
    trainer = pl.Trainer(callbacks=[replay], max_epochs=3, **trainer_kwargs())
    trainer.fit(_DictClassifier(), loader)
    return trainer, replay


@pytest.mark.parametrize("mode", ["steps", "batch"])
def test_a_step_a_collate_fn_dropped_a_sample_from_is_said_to_hold_fewer_rows_than_indices(mode):
    # held-out sweep: 7 rows for 8 drawn indices; the step is recorded without scores (right), but the warning
    # blamed the loss ("did not split ... unreduced shape (7,)"), which is not what to change
    with pytest.warns(UserWarning, match=r"the loss of step \d+ could not split") as said:
        trainer, replay = _fit_dropping(mode, {13})  # in the second batch of each pass
    notes = [str(w.message) for w in said if "could not split" in str(w.message)]
    assert len(notes) == 1 and "the batch holds 7 rows for the 8 dataset indices the sampler drew" in notes[0]
    assert (
        "collate_fn that drops samples" in notes[0]
        and "return a stand-in sample from the Dataset" in notes[0]
    )
    assert "unreduced shape" not in notes[0] and not [w for w in said if "did not split" in str(w.message)]
    assert replay.batches.unscored_steps >= 2 and trainer.state.finished  # the run went on to its end
    scores = replay.selector.table.scores
    assert math.isnan(scores[13]) and all(not math.isnan(score) for score in scores[:8])


def _fit_dropping_first(module: pl.LightningModule, mode: str) -> tuple[pl.Trainer, HardSampleReplay]:
    """A fit whose first batch lost a sample to the collate_fn (index 2 of 0..7: 7 rows for 8 indices)."""
    replay = HardSampleReplay(mode=mode)
    trainer = pl.Trainer(callbacks=[replay], max_epochs=2, **trainer_kwargs())
    loader = DataLoader(_UnreadableAt({2}), batch_size=8, collate_fn=_skip_unreadable)
    trainer.fit(module, loader)
    return trainer, replay


@pytest.mark.parametrize("mode", ["steps", "batch"])
def test_a_first_batch_a_collate_fn_dropped_a_sample_from_trains_unscored_as_a_later_one_does(mode):
    # held-out sweep: the same short batch was refused first ("cannot split the loss of step 0", "cannot cut
    # the fit's first batch") and trained with a warning second, so whether a shuffled run started depended on
    # where the unreadable file fell
    with pytest.warns(UserWarning, match=r"the loss of step 0 could not split") as said:
        trainer, replay = _fit_dropping_first(_DictClassifier(), mode)
    notes = [str(w.message) for w in said if "could not split" in str(w.message)]
    assert len(notes) == 1 and "the batch holds 7 rows for the 8 dataset indices the sampler drew" in notes[0]
    assert (
        "collate_fn that drops samples" in notes[0]
        and "return a stand-in sample from the Dataset" in notes[0]
    )
    for wrong_way in ("per-sample part", "per-sample loss", "mode='steps'", "scorer="):
        assert wrong_way not in notes[0]
    assert trainer.state.finished and replay.batches.unscored_steps >= 2  # both passes' first batches
    scores = replay.selector.table.scores
    assert math.isnan(scores[2]) and sum(not math.isnan(score) for score in scores) >= 48  # the rest scored


class _FirstRowLoss(_DictClassifier):
    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self.net(batch["x"][:1]), batch["y"][:1])  # one row's loss: no sample's split


class _CarriedInput(_DictClassifier):
    """Carries a batch-shaped state to the next batch, started anew when the batch size changes."""

    def __init__(self) -> None:
        super().__init__()
        self.carried = None

    def training_step(self, batch, batch_idx):
        x = batch["x"]
        if self.carried is None or self.carried.shape[0] != x.shape[0]:
            self.carried = torch.zeros_like(x)
        self.carried = (x + self.carried).detach()
        return F.cross_entropy(self.net(self.carried), batch["y"])


@pytest.mark.parametrize("mode", ["steps", "batch"])
def test_the_first_step_checks_judge_the_first_full_batch_when_the_first_lost_a_sample(mode):
    # a short first batch is passed over, not taken as the batch that shows a loss that never splits or state
    # carried across batches: on it, a (7, 6) state looked like none of its 8 samples' and the check ended
    with pytest.raises(PulseRefusal, match="found no per-sample loss") as refused:
        _fit_dropping_first(_FirstRowLoss(), mode)
    assert "7 rows" not in str(refused.value)
    with pytest.raises(PulseRefusal, match="carries state from one batch to the next: `carried`"):
        _fit_dropping_first(_CarriedInput(), mode)


def test_unmatched_rows_tells_a_batch_short_of_its_indices_from_other_layouts():
    from lightning_pulse.core.sample_index import unmatched_rows

    short = {"x": torch.zeros(7, 6), "y": torch.zeros(7), "count": torch.tensor(7)}
    assert unmatched_rows(short, 8) == 7
    assert unmatched_rows(short, 4, 7) is None  # a cut of 7 of the 8
    assert unmatched_rows([torch.zeros(12, 8), torch.zeros(9, 8)], 8) is None  # time-major (T, B)
    assert unmatched_rows({"paths": ["a", "b"], "count": torch.tensor(2)}, 8) is None  # nothing to tell by
