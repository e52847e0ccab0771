"""The measures of ``benchmarks/hard_sample_replay_signal.py``, on cases whose answers are known."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.hard_sample_replay_signal import per_sample_losses_and_gradients, signal_measures


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
