"""HardSampleReplay refuses before the first update what it cannot run: a scorer that fails on the fit's
first batch, a batch mode whose batches are too small to cut, and state carried in buffers replaced at every
batch (steps mode without a PulseCycle)."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_pulse.callbacks.hard_sample_replay import HardSampleReplay
from lightning_pulse.core.per_sample_loss import ForwardLossScorer, OutputKeyScorer
from lightning_pulse.errors import PulseRefusal
from tests.conftest import trainer_kwargs

V, T = 11, 6


def _tokens(n: int = 32, seed: int = 0) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    source = torch.randint(1, V, (n, T), generator=generator)
    return TensorDataset(source, source.flip(1))


class _Seq2Seq(pl.LightningModule):
    """A tiny encoder-decoder: ``forward(source, decoder_input)`` needs the decoder's input too (as T5's
    forward needs labels or decoder ids), so ``pl_module(batch[0])`` cannot run it."""

    def __init__(self, per_sample_key: str | None = None) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, 16)
        self.core = nn.Transformer(16, 2, 1, 1, 32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(16, V)
        self.per_sample_key = per_sample_key
        self.steps_trained = 0

    def forward(self, source: torch.Tensor, decoder_input: torch.Tensor) -> torch.Tensor:
        return self.head(self.core(self.embed(source), self.embed(decoder_input)))

    def training_step(self, batch, batch_idx):
        source, target = batch
        logits = self(source, F.pad(target[:, :-1], (1, 0)))
        self.steps_trained += 1
        rows = F.cross_entropy(logits.reshape(-1, V), target.reshape(-1), reduction="none").view(
            len(target), -1
        )
        loss = rows.mean()
        if self.per_sample_key is None:
            return loss
        return {"loss": loss, self.per_sample_key: rows.mean(1).detach()}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit_refused(module: pl.LightningModule, replay: HardSampleReplay, batch_size: int = 8) -> str:
    before = [p.detach().clone() for p in module.parameters()]
    trainer = pl.Trainer(callbacks=[replay], max_epochs=2, **trainer_kwargs())
    with pytest.raises(PulseRefusal) as refusal:
        trainer.fit(module, DataLoader(_tokens(), batch_size=batch_size))
    assert trainer.global_step == 0
    assert all(torch.equal(a, b) for a, b in zip(before, module.parameters())), "the weights were updated"
    return str(refusal.value)


def test_a_forward_loss_scorer_that_cannot_run_the_module_is_refused_before_the_first_update():
    """It failed at the end of step 1 with the model's own error (HF T5: "You must specify exactly one of
    input_ids or inputs_embeds"), naming neither the callback nor the scorer."""
    scorer = ForwardLossScorer("cross_entropy", input=0, target=1, flatten_tokens=True)
    message = _fit_refused(_Seq2Seq(), HardSampleReplay(scorer=scorer))
    first = message.splitlines()[0]
    assert first.startswith("HardSampleReplay") and "ForwardLossScorer" in first
    assert "TypeError" in first and "OutputKeyScorer" in first and "`scorer`" in first


def test_an_output_key_scorer_whose_key_training_step_does_not_return_is_refused_before_the_first_update():
    """The ValueError came after the first optimizer step, and the command line printed its traceback."""
    module = _Seq2Seq(per_sample_key=None)
    message = _fit_refused(module, HardSampleReplay(scorer=OutputKeyScorer("per_sample_loss")))
    first = message.splitlines()[0]
    assert (
        first.startswith("HardSampleReplay") and "OutputKeyScorer" in first and "'per_sample_loss'" in first
    )
    assert "training_step" in first and "drop `scorer`" in first
    assert module.steps_trained == 1  # found on the step's output, before its backward and update


def test_an_output_key_scorer_given_its_key_trains_and_scores():
    module = _Seq2Seq(per_sample_key="per_sample_loss")
    replay = HardSampleReplay(scorer=OutputKeyScorer("per_sample_loss"))
    trainer = pl.Trainer(callbacks=[replay], max_epochs=3, **trainer_kwargs())
    trainer.fit(module, DataLoader(_tokens(), batch_size=8))
    assert trainer.global_step == 6 and replay.metrics()["table_seen"] == 32  # every sample scored


class _Classifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Embedding(V, 8), nn.Flatten(), nn.Linear(8 * T, V))

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self.net(batch[0]), batch[1][:, 0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("batch_size", [1, 2])
def test_batch_mode_with_batches_too_small_to_cut_is_refused_at_fit_start(batch_size):
    """Batches of 1 or 2 are never cut below 2 samples: the whole run trained plain, said nothing, and
    `replayed_distinct` read 40 although no sample was ever left out."""
    message = _fit_refused(_Classifier(), HardSampleReplay(mode="batch"), batch_size=batch_size)
    first = message.splitlines()[0]
    assert first.startswith("HardSampleReplay") and f"batches of {batch_size}" in first
    assert "replay_fraction=0.5" in first and "batch_size of 3" in first and "mode='steps'" in first


def test_batch_mode_with_batches_of_three_still_cuts():
    replay = HardSampleReplay(mode="batch")
    trainer = pl.Trainer(callbacks=[replay], max_epochs=2, **trainer_kwargs())
    trainer.fit(_Classifier(), DataLoader(_tokens(), batch_size=3))
    assert replay.metrics()["replay_fraction"] < 1


B, H = 4, 8


class _BufferStateLM(pl.LightningModule):
    """A stateful LSTM whose hidden state is held in buffers rebound to the new state at every batch; its
    rows continue the previous batch's rows, so a cut batch mixes the streams."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.rnn, self.head = nn.Embedding(V, 8), nn.LSTM(8, H, batch_first=True), nn.Linear(H, V)
        self.register_buffer("h", torch.zeros(1, B, H))
        self.register_buffer("c", torch.zeros(1, B, H))
        self.rows_trained: list[int] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.rows_trained.append(len(x))
        out, (h, c) = self.rnn(self.emb(x), (self.h, self.c))
        self.h, self.c = h.detach(), c.detach()
        return F.cross_entropy(self.head(out).reshape(-1, V), y.reshape(-1))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_state_carried_in_buffers_replaced_every_batch_is_refused_by_the_read_replace_test():
    """Refused after the second optimizer step, one mixed step late (documented): a watch of the first batch's
    buffer reads refused it a step earlier, but also refused models that trained correctly (a buffer cast or
    grown once by the first batch, below), and was taken out."""
    module = _BufferStateLM()
    trainer = pl.Trainer(callbacks=[HardSampleReplay()], max_steps=16, **trainer_kwargs())
    with pytest.raises(
        PulseRefusal, match="HardSampleReplay cannot cut the batches of a module that carries"
    ):
        trainer.fit(module, DataLoader(_tokens(64), batch_size=B))
    assert trainer.global_step <= 2


class _BufferRebuiltOnce(pl.LightningModule):
    """A batch-shaped buffer the first batch reads and rebinds once (a cast, a cache grown by a column), then
    leaves alone: no state carried from one batch to the next."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.net = nn.Sequential(nn.Embedding(V, 8), nn.Flatten(), nn.Linear(8 * T, B))
        self.head = nn.Linear(B, V)
        self.register_buffer("cache", torch.ones(B, 4))

    def training_step(self, batch, batch_idx):
        if self.how == "cast" and self.cache.dtype != torch.float64:
            self.cache = self.cache.double()
        if self.how == "grow" and self.cache.shape[1] < 5:
            self.cache = torch.cat([self.cache, self.cache[:, :1]], 1)
        return F.cross_entropy(self.head(self.net(batch[0])), batch[1][:, 0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("how", ["cast", "grow"])
def test_a_batch_shaped_buffer_rebuilt_once_by_the_first_batch_is_not_refused(how):
    trainer = pl.Trainer(callbacks=[HardSampleReplay()], max_epochs=2, **trainer_kwargs())
    trainer.fit(_BufferRebuiltOnce(how), DataLoader(_tokens(64), batch_size=B))
    assert trainer.global_step == 16


class _BuffersUpdatedInPlace(pl.LightningModule):
    """Buffers as wide as the batch, updated in place at every batch (BatchNorm's running statistics, an EMA
    of the features, a step counter): never replaced, so never carried state."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Embedding(V, 8), nn.Flatten(), nn.Linear(8 * T, B), nn.BatchNorm1d(B))
        self.head = nn.Linear(B, V)
        self.register_buffer("feature_ema", torch.zeros(B))
        self.register_buffer("steps_seen", torch.zeros((), dtype=torch.long))

    def training_step(self, batch, batch_idx):
        features = self.net(batch[0])
        self.feature_ema.lerp_(features.detach().mean(0), 0.1)
        self.steps_seen += 1
        return F.cross_entropy(self.head(features), batch[1][:, 0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_buffers_as_wide_as_the_batch_updated_in_place_are_not_refused_in_steps_mode():
    replay = HardSampleReplay()
    trainer = pl.Trainer(callbacks=[replay], max_epochs=2, **trainer_kwargs())
    trainer.fit(_BuffersUpdatedInPlace(), DataLoader(_tokens(64), batch_size=B))
    assert replay.state_check.done and replay.state_check.found == {}
    assert trainer.global_step == 16  # 2 epochs of 16 batches, each trained on half its data


class _LossInACheckpoint(pl.LightningModule):
    """The chunked-loss pattern: the head and its loss run inside an activation checkpoint
    (``use_reentrant`` as given; ``None``: no checkpoint)."""

    def __init__(self, use_reentrant: bool | None) -> None:
        super().__init__()
        self.use_reentrant = use_reentrant
        self.body = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32))
        self.head = nn.Linear(32, 10)

    def _head_and_loss(self, hidden: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(hidden), y)

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.use_reentrant is None:
            return self._head_and_loss(self.body(x), y)
        return checkpoint(self._head_and_loss, self.body(x), y, use_reentrant=self.use_reentrant)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _vectors(n: int = 64) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, 16, generator=generator), torch.randint(0, 10, (n,), generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=8)


def test_a_loss_inside_a_reentrant_checkpoint_is_refused_naming_the_cause_and_use_reentrant_false():
    """A reentrant checkpoint runs its forward without autograd, so the captured loss call has no gradient:
    the refusal blamed "a value computed for logging?" and offered only `scorer=`; the non-reentrant form,
    which it now names, trains with the scores and weights of the module without a checkpoint."""
    torch.manual_seed(0)
    module = _LossInACheckpoint(use_reentrant=True)
    before = [p.detach().clone() for p in module.parameters()]
    trainer = pl.Trainer(callbacks=[HardSampleReplay()], max_epochs=3, **trainer_kwargs())
    with pytest.raises(PulseRefusal) as refusal:
        trainer.fit(module, _vectors())
    assert trainer.global_step == 0
    assert all(torch.equal(a, b) for a, b in zip(before, module.parameters())), "the weights were updated"
    first = str(refusal.value).splitlines()[0]
    assert first.startswith("HardSampleReplay") and "autograd off" in first
    assert "use_reentrant=True" in first and "use_reentrant=False" in first and "`scorer=`" in first
    assert "a value computed for logging?" not in first
    fitted = {}
    for use_reentrant in (None, False):
        torch.manual_seed(0)
        module, replay = _LossInACheckpoint(use_reentrant), HardSampleReplay()
        trainer = pl.Trainer(callbacks=[replay], max_epochs=3, **trainer_kwargs())
        trainer.fit(module, _vectors())
        assert replay.metrics()["replayed_distinct"] > 0  # it selected
        fitted[use_reentrant] = (trainer.global_step, list(replay.table.scores), _flat(module))
    assert fitted[False][0] == fitted[None][0] > 0
    assert fitted[False][1] == fitted[None][1]
    assert torch.equal(fitted[False][2], fitted[None][2])


def _flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in module.parameters()])
