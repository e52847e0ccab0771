"""HardSampleReplay on losses a held-out sweep found scored wrong with no word: a hand-written term next to a
captured one (a VAE's KL), a penalty on a weight of ``B`` rows, a ``D x D`` feature matrix with ``D == B``."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pulse import HardSampleReplay
from lightning_pulse.core.per_sample_loss import LossCapture, OutputKeyScorer
from lightning_pulse.errors import PulseRefusal

B = 16


def _fit(module: pl.LightningModule, data: TensorDataset, **replay) -> HardSampleReplay:
    replay_callback = HardSampleReplay(mode="batch", **replay)
    trainer = pl.Trainer(
        max_steps=2,
        callbacks=[replay_callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
    )
    trainer.fit(module, DataLoader(data, batch_size=B, shuffle=False))
    return replay_callback


class _VAE(pl.LightningModule):
    """The textbook VAE loss: `F.binary_cross_entropy(reduction='sum')` plus the KL written with tensor
    ops."""

    def __init__(self, per_sample_output: bool = False) -> None:
        super().__init__()
        self.enc, self.mu, self.logvar = nn.Linear(12, 16), nn.Linear(16, 4), nn.Linear(16, 4)
        self.dec = nn.Linear(4, 12)
        self.per_sample_output = per_sample_output

    def training_step(self, batch, batch_idx):
        x = batch[0]
        h = torch.relu(self.enc(x))
        mu, logvar = self.mu(h), self.logvar(h)
        reconstruction = torch.sigmoid(self.dec(mu))
        if self.per_sample_output:  # the way out the warning names: each sample's whole loss, returned
            rec = F.binary_cross_entropy(reconstruction, x, reduction="none").sum(1)
            kl = -0.5 * (1 + logvar - mu.pow(2) - logvar.exp()).sum(1)
            return {"loss": (rec + kl).mean(), "per_sample_loss": (rec + kl).detach()}
        rec = F.binary_cross_entropy(reconstruction, x, reduction="sum")
        kl = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())
        return (rec + kl) / x.shape[0]

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_hand_written_term_on_the_batch_next_to_a_captured_loss_is_said_at_the_first_step():
    # held-out sweep: the stored score was the reconstruction term alone, the KL (part of the loss that
    # trains) left out with no word (rank correlation 0.53 with each sample's loss). Said, not refused: a
    # batch-level term written by hand (a load-balancing loss) looks the same, and such models train well on
    # the scores
    torch.manual_seed(0)
    data = TensorDataset(torch.rand(4 * B, 12))
    with pytest.warns(UserWarning, match="^HardSampleReplay: its scores leave out part of the loss") as said:
        replay = _fit(_VAE(), data)
    message = next(str(w.message) for w in said if "leave out part" in str(w.message))
    assert "OutputKeyScorer" in message and "binary_cross_entropy" in message
    assert sum("leave out part" in str(w.message) for w in said) == 1  # once, not at every step
    assert replay.table.seen == 2 * B  # it trained
    # the way out it names: each sample's whole loss returned, read by OutputKeyScorer, and nothing said
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*leave out part of the loss")
        replay = _fit(_VAE(per_sample_output=True), data, scorer=OutputKeyScorer())
    assert replay.table.seen == 2 * B


class _Classifier(pl.LightningModule):
    """A cross-entropy with one of the additions that the captured calls account for (or that adds the same
    to every sample): none of them is reported."""

    def __init__(self, extra: str) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(12, 16), nn.Linear(16, 3)
        self.extra = extra

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.head(torch.relu(self.body(x)))
        if self.extra == "weight penalty":
            return F.cross_entropy(logits, y) + 1e-3 * sum(p.pow(2).sum() for p in self.parameters())
        if self.extra == "scaled sum":
            return 2.0 * F.cross_entropy(logits, y) + 0.5 * F.mse_loss(logits, F.one_hot(y, 3).float())
        ce = F.cross_entropy(logits, y, reduction="none")
        if self.extra == "focal":
            return ((1 - torch.exp(-ce)) ** 2 * ce).mean()
        mask = (x[:, 0] > 0.2).float()  # a mask read from the batch, over the captured losses
        return (ce * mask).sum() / mask.sum().clamp_min(1)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fits_with_nothing_said(module: pl.LightningModule) -> HardSampleReplay:
    """Fit ``module`` on a classification set; the warning of a part of the loss left out is an error."""
    torch.manual_seed(0)
    data = TensorDataset(torch.rand(4 * B, 12), torch.randint(0, 3, (4 * B,)))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*leave out part of the loss")
        return _fit(module, data)


@pytest.mark.parametrize("extra", ["weight penalty", "scaled sum", "focal", "masked mean"])
def test_terms_the_captured_calls_account_for_and_weight_penalties_still_train(extra):
    assert _fits_with_nothing_said(_Classifier(extra)).table.seen == 2 * B


def test_unaccounted_part_tells_a_term_on_the_batch_from_one_on_the_weights_or_on_the_captured_losses():
    torch.manual_seed(0)
    layer, head = nn.Linear(6, 8), nn.Linear(8, 3)
    x, y = torch.randn(B, 6), torch.randint(0, 3, (B,))
    constants = [*layer.parameters(), *head.parameters()]

    def judged(make_loss):
        with LossCapture(batch_size=B) as capture:
            loss = make_loss(head(torch.relu(layer(x))))
        return capture.unaccounted_part(loss, constants)

    # a term on the batch's activations written by hand: reported
    assert judged(lambda out: F.cross_entropy(out, y) + out.pow(2).mean()) is not None
    assert judged(lambda out: F.cross_entropy(out, y) - (out.softmax(1) * out.log_softmax(1)).sum(1).mean())
    # accounted for: scaled, summed, reduced by hand over a mask read from the batch, or weights alone
    assert judged(lambda out: 3 * F.cross_entropy(out, y) / 2) is None
    assert judged(lambda out: (F.cross_entropy(out, y, reduction="none") * (x[:, 0] > 0)).sum() / B) is None
    assert judged(lambda out: F.cross_entropy(out, y) + 1e-2 * layer.weight.pow(2).sum()) is None
    assert judged(lambda out: F.cross_entropy(out, y) + F.mse_loss(out, torch.zeros_like(out))) is None


class _WeightTermWithConstants(pl.LightningModule):
    """Cross-entropy plus a term on the weights alone whose constants are plain tensors with a first dimension
    that is a multiple of B (hidden width 4B): EWC with its Fisher kept in a dict, a soft-orthogonality
    mask."""

    def __init__(self, extra: str) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(12, 4 * B), nn.Linear(4 * B, 3)
        self.extra = extra
        self.fisher = {name: torch.rand_like(p) for name, p in self.named_parameters()}
        self.anchor = {name: p.detach().clone() for name, p in self.named_parameters()}

    def training_step(self, batch, batch_idx):
        x, y = batch
        ce = F.cross_entropy(self.head(torch.relu(self.body(x))), y)
        if self.extra == "ewc":
            terms = (self.fisher[n] * (p - self.anchor[n]) ** 2 for n, p in self.named_parameters())
            return ce + sum(term.sum() for term in terms)
        w = self.body.weight
        return ce + 1e-3 * ((w @ w.T) * (1 - torch.eye(4 * B))).pow(2).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


@pytest.mark.parametrize("extra", ["ewc", "orthogonality"])
def test_a_term_on_the_weights_alone_is_not_reported_whatever_its_constants_shapes(extra):
    # review: constants of a multiple of B rows that are not registered buffers (EWC's Fisher in a dict, a
    # mask made in the step) were read as the batch, and the warning said the term depended on the samples
    assert _fits_with_nothing_said(_WeightTermWithConstants(extra)).table.seen == 2 * B


class _WeightAnchored(pl.LightningModule):
    """Cross-entropy plus an L2-SP penalty `F.mse_loss(body.weight, w0)` on a weight of B rows."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(12, B), nn.Linear(B, 3)
        self.register_buffer("w0", torch.randn(B, 12) * 3)

    def training_step(self, batch, batch_idx):
        x, y = batch
        ce = F.cross_entropy(self.head(torch.relu(self.body(x))), y)
        return ce + F.mse_loss(self.body.weight, self.w0)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)  # the scores are of the weights the step saw


def test_a_penalty_on_a_weight_of_b_rows_is_left_out_not_split_over_the_samples():
    # held-out sweep: row k of the weight penalty was added to sample k's score (rank correlation 0.32 with
    # the samples' own cross-entropy)
    torch.manual_seed(0)
    x, y = torch.randn(2 * B, 12), torch.randint(0, 3, (2 * B,))
    module = _WeightAnchored()
    replay = _fit(module, TensorDataset(x, y))
    with torch.no_grad():
        expected = F.cross_entropy(module.head(torch.relu(module.body(x[:B]))), y[:B], reduction="none")
    assert torch.allclose(torch.as_tensor(replay.table.scores[:B]), expected, atol=1e-5)


def test_rows_of_a_parameter_are_left_out_but_a_parameter_broadcast_to_the_batch_is_per_sample():
    torch.manual_seed(0)
    weight, bias = nn.Parameter(torch.randn(B, 5)), nn.Parameter(torch.randn(5))
    logits, y = torch.randn(B, 3, requires_grad=True), torch.randint(0, 3, (B,))
    for penalty in (
        lambda: F.mse_loss(weight, torch.zeros(B, 5)),
        lambda: F.l1_loss(weight.float() - 1, weight.detach()),
    ):
        with LossCapture(batch_size=B) as capture:
            F.cross_entropy(logits, y) + penalty()
        assert "are a parameter's" in capture.describe()
        assert torch.allclose(capture.per_sample(), F.cross_entropy(logits, y, reduction="none").detach())
    targets = torch.randn(B, 5)  # a learned constant prediction: each row's error is its sample's
    with LossCapture(batch_size=B) as capture:
        F.mse_loss(bias.expand(B, 5), targets)
    assert capture.maps_onto_batch
    assert torch.allclose(capture.per_sample(), ((bias - targets) ** 2).mean(1).detach())


def test_a_feature_matrix_summed_over_the_batch_is_not_split_into_samples_when_its_size_is_b():
    # held-out sweep: Barlow Twins' `F.mse_loss(z1.T @ z2 / B, I)` with D == B was split into B "per-sample"
    # scores that were the rows of the feature cross-correlation matrix (refused for D != B)
    torch.manual_seed(0)
    encoder = nn.Linear(6, B)
    x = torch.randn(B, 6)
    for transpose in (lambda z: z.T, lambda z: z.t(), lambda z: z.transpose(0, 1)):
        z1, z2 = encoder(x), encoder(x + 0.1)
        with LossCapture(batch_size=B) as capture:
            F.mse_loss(transpose(z1) @ z2 / B, torch.eye(B), reduction="sum")
        assert not capture.maps_onto_batch and "features, not samples" in capture.describe()
        with pytest.raises(PulseRefusal, match="features, not samples"):
            capture.require()
    z1, z2 = encoder(x), encoder(x + 0.1)
    weight = nn.Parameter(torch.randn(6, B))
    for rows_are_samples in (
        lambda: z1 @ z2.T,  # CLIP's B x B similarities: one row per sample
        lambda: (weight.T @ x.T).T,  # a head written as a product with the batch second
    ):
        with LossCapture(batch_size=B) as capture:
            F.cross_entropy(rows_are_samples(), torch.arange(B))
        assert capture.maps_onto_batch, capture.describe()


class _Barlow(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.f = nn.Linear(12, B)
        self.bn = nn.BatchNorm1d(B, affine=False)

    def training_step(self, batch, batch_idx):
        x = batch[0]
        z1, z2 = self.bn(self.f(x)), self.bn(self.f(x.flip(1)))
        c = z1.T @ z2 / x.shape[0]
        return F.mse_loss(c, torch.eye(c.shape[0]), reduction="sum") / c.shape[0]

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_barlow_twins_loss_whose_feature_count_is_b_is_refused_at_the_first_step():
    torch.manual_seed(0)
    with pytest.raises(PulseRefusal, match="features, not samples"):
        _fit(_Barlow(), TensorDataset(torch.rand(4 * B, 12)))


class _ReplacedTokenDetector(pl.LightningModule):
    """ELECTRA's discriminator (a tiny ``ElectraForPreTraining`` from its config): its loss inside the model
    is ``binary_cross_entropy_with_logits`` on the rows its attention mask picks (``loss="inside"``); or the
    way out the refusal names, the same loss on all rows, unreduced and averaged over the mask
    (``"masked_mean"``), which keeps each sample's score in ``self.scores``."""

    def __init__(self, loss: str) -> None:
        from transformers import ElectraConfig, ElectraForPreTraining

        super().__init__()
        config = ElectraConfig(
            vocab_size=30, embedding_size=16, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
            intermediate_size=32, max_position_embeddings=12, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )  # fmt: skip
        self.model, self.loss, self.scores = ElectraForPreTraining(config), loss, []

    def training_step(self, batch, batch_idx):
        ids, mask, labels = batch
        if self.loss == "inside":
            return self.model(input_ids=ids, attention_mask=mask, labels=labels).loss
        logits = self.model(input_ids=ids, attention_mask=mask).logits
        losses = F.binary_cross_entropy_with_logits(logits, labels.float(), reduction="none")
        self.scores.append(((losses * mask).sum(1) / mask.sum(1)).detach())
        return (losses * mask).sum() / mask.sum()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _replaced_tokens() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 30, (4 * B, 12), generator=generator)
    lengths = torch.randint(4, 13, (4 * B,), generator=generator)
    mask = (torch.arange(12) < lengths[:, None]).long()
    labels = (torch.rand(4 * B, 12, generator=generator) < 0.3).long()
    return TensorDataset(ids * mask, mask, labels)


def test_a_masked_loss_without_ignore_index_is_refused_naming_a_way_out_it_has():
    # held-out sweep (twenty-third pass): ELECTRA with an attention mask was refused (its rows are picked by
    # the mask) pointing at `ignore_index`, which binary_cross_entropy_with_logits has not
    torch.manual_seed(0)
    with pytest.raises(PulseRefusal) as refusal:
        _fit(_ReplacedTokenDetector("inside"), _replaced_tokens())
    message = str(refusal.value)
    assert "binary_cross_entropy_with_logits" in message and "picked by an index or a mask" in message
    assert "ignore_index" not in message
    assert "`reduction='none'` and average it over the mask, `(loss * mask).sum() / mask.sum()`" in message
    # the way out trains, and each sample's score is its loss over its own tokens
    torch.manual_seed(0)
    module = _ReplacedTokenDetector("masked_mean")
    replay = _fit(module, _replaced_tokens())
    scores = replay.table.scores[: 2 * B]
    assert torch.allclose(torch.as_tensor(scores).float(), torch.cat(module.scores), rtol=1e-5)


def test_a_masked_loss_with_ignore_index_still_names_it():
    logits = torch.randn(B, 5, 7, requires_grad=True)  # a picking is read from the graph
    labels, mask = torch.randint(0, 7, (B, 5)), torch.rand(B, 5) < 0.5
    with LossCapture(batch_size=B) as capture:
        F.cross_entropy(logits[mask], labels[mask])
    assert "compute it on all rows with `ignore_index` for the unlabelled ones" in capture.describe()
    assert "reduction='none'" not in capture.describe()
