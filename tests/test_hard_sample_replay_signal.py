"""The measures of ``benchmarks/studies/hard_sample_replay_signal.py``, on cases whose answers are known."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.studies.hard_sample_replay_signal import (
    easy_half_loss_ratio,
    per_sample_losses_and_gradients,
    signal_measures,
)
from lightning_pulse.core.sample_scores import SampleScoreTable


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
