"""HardSampleReplay's self-check: do a sample's successive scores agree?

Where the per-sample loss depends on a random draw made inside training_step (a diffusion model's timestep and
noise, drawn per sample) more than on the sample, top-k ranks the draw: the sweep's DDPM stored scores whose
rank correlation with each sample's expected loss was -0.07. Nothing said so. Once a run has scored 400
samples twice (untouched, in PulseCycle's burst phases, after its first epoch), the rank agreement of their
previous and new scores is measured, logged, and warned about when it is near zero.
"""

from __future__ import annotations

import math
import warnings

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

from lightning_pulse import HardSampleReplay, PulseCycle
from lightning_pulse.core.score_agreement import LOW_AGREEMENT, RankAgreement, spearman
from tests.conftest import RecordingLogger, trainer_kwargs

_DIGITS = load_digits()
X = torch.tensor(_DIGITS.data[:1280], dtype=torch.float32) / 16.0
Y = torch.tensor(_DIGITS.target[:1280])


class _Classifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class _Denoiser(_Classifier):
    """DDPM-style: the timestep and the noise are drawn per sample inside training_step."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(65, 128), nn.SiLU(), nn.Linear(128, 64))
        self.register_buffer("abar", torch.cumprod(1 - torch.linspace(1e-4, 0.02, 100), 0))

    def training_step(self, batch, batch_idx):
        x = batch[0] * 2 - 1
        t = torch.randint(0, 100, (x.shape[0],), device=x.device)
        noise = torch.randn_like(x)
        a = self.abar[t][:, None]
        noisy = a.sqrt() * x + (1 - a).sqrt() * noise
        return F.mse_loss(self.net(torch.cat([noisy, t[:, None] / 100], 1)), noise)


def _fit(module: pl.LightningModule, cycle: bool):
    torch.manual_seed(0)
    replay, logger = HardSampleReplay(rule="topk"), RecordingLogger()
    callbacks = (
        [PulseCycle(burst=40, replay=40, maintain=0, warmup=0, anneal=0), replay] if cycle else [replay]
    )
    trainer = pl.Trainer(
        **trainer_kwargs(max_steps=240, callbacks=callbacks, logger=logger, log_every_n_steps=20)
    )
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, Y), batch_size=32, shuffle=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, loader)
    said = [str(w.message) for w in caught if "successive scores" in str(w.message)]
    logged = [
        row["hard_sample_replay/score_rank_agreement"]
        for _, row in logger.rows
        if "hard_sample_replay/score_rank_agreement" in row
    ]
    return replay, said, logged


def test_a_loss_of_per_sample_random_draws_is_warned_about_once():
    replay, said, logged = _fit(_Denoiser(), cycle=True)
    agreement = replay.metrics()["score_rank_agreement"]
    assert abs(agreement) < LOW_AGREEMENT  # about 0: the scores rank the draws
    assert len(said) == 1  # before: no warning at all
    assert "HardSampleReplay" in said[0] and f"{agreement:.2f}" in said[0]
    assert "random draw" in said[0] and "rule='random'" in said[0] and "remove HardSampleReplay" in said[0]
    assert logged and logged[-1] == pytest.approx(agreement)
    assert replay.state_dict()["score_rank_agreement"] == pytest.approx(agreement)


def test_a_plain_classifier_is_not_warned_about():
    replay, said, logged = _fit(_Classifier(), cycle=True)
    assert replay.metrics()["score_rank_agreement"] > LOW_AGREEMENT + 0.2  # about 0.4 here (digits MLP)
    assert said == [] and logged


def test_a_run_whose_every_step_selects_is_not_checked():
    # only untouched samples pair up (a selected one was chosen for its previous score): none here
    replay, said, logged = _fit(_Denoiser(), cycle=False)
    assert math.isnan(replay.metrics()["score_rank_agreement"]) and said == [] and logged == []


def test_spearman_and_the_pairs_it_waits_for():
    rng = np.random.default_rng(0)
    base = rng.normal(size=300)
    assert spearman(base, base * 3 + 1) == pytest.approx(1.0)
    assert spearman(base, -base) == pytest.approx(-1.0)
    assert abs(spearman(base, rng.normal(size=300))) < 0.2
    check = RankAgreement(min_pairs=200)  # the default is 400
    steps = np.full(150, 10)
    assert check.add(base[:150], rng.normal(size=150), steps, since=5) is None and not check.measured
    assert (
        check.add(base[:150], rng.normal(size=150), np.zeros(150), since=5) is None
    )  # first epoch: left out
    assert not check.measured
    note = check.add(base[150:], rng.normal(size=150), steps, since=5)
    assert check.measured and note is not None and "300 samples scored twice" in note
    assert check.add(base, base, steps) is None  # measured once: nothing more
    check.load(math.nan)  # a rollback to a snapshot taken before the measurement keeps it
    assert check.measured
