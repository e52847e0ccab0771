"""HardSampleReplay with batches holding a tensor with the batch size along both first dimensions at the first
batch: time-major tokens whose time length equals it, per-sample pairwise tensors, features as many."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, Dataset

from lightning_pulse.callbacks.hard_sample_replay import HardSampleReplay
from lightning_pulse.errors import PulseRefusal
from tests.conftest import trainer_kwargs

BATCH, VOCAB, CLASSES = 8, 20, 4


class _Sequences(Dataset):
    """32 token sequences; the longest of the first batch (unshuffled) is 8 long, as long as the batch, and
    those of the second at most 6."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        lengths = [8, 5, 3, 6, 4, 7, 2, 5] + [6, 3, 4, 5, 2, 6, 3, 4] + [8, 7, 6, 5, 4, 3, 2, 8] * 2
        self.tokens = [torch.randint(1, VOCAB, (n,), generator=generator) for n in lengths]
        self.labels = torch.randint(0, CLASSES, (len(lengths),), generator=generator)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index):
        return self.tokens[index], self.labels[index]


def _time_major_with_a_padding_mask(samples):
    tokens, labels = zip(*samples)
    x = pad_sequence(list(tokens))  # (T, B): batch_first=False
    return [x, x.t() == 0, torch.stack(labels)]  # the mask is (B, T), as nn.MultiheadAttention reads it


class _TimeMajorAttention(pl.LightningModule):
    """nn.MultiheadAttention(batch_first=False) over (T, B) tokens with a (B, T) key_padding_mask."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 16)
        self.attention = torch.nn.MultiheadAttention(16, 2)
        self.head = torch.nn.Linear(16, CLASSES)
        self.shapes: list[tuple[int, ...]] = []

    def training_step(self, batch, batch_idx):
        x, mask, y = batch
        self.shapes.append(tuple(x.shape))
        h = self.embed(x)
        attended, _ = self.attention(h, h, h, key_padding_mask=mask)
        kept = (~mask).t().unsqueeze(-1)
        pooled = (attended * kept).sum(0) / kept.sum(0)
        return F.cross_entropy(self.head(pooled), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(mode: str, module: _TimeMajorAttention) -> None:
    trainer = pl.Trainer(
        callbacks=[HardSampleReplay(mode=mode, replay_fraction=0.5)], max_epochs=3, **trainer_kwargs()
    )
    trainer.fit(
        module, DataLoader(_Sequences(), batch_size=BATCH, collate_fn=_time_major_with_a_padding_mask)
    )


def test_batch_mode_refuses_a_time_major_batch_at_the_first_batch_whose_time_length_is_not_the_batch():
    # held-out sweep: the first batch, (8, 8) tokens, told neither layout; a later replay batch was cut along
    # time (x to (4, 8), the mask and labels to 4 samples) and nn.MultiheadAttention failed on the shapes
    module = _TimeMajorAttention()
    with pytest.raises(
        PulseRefusal,
        match=r"^HardSampleReplay cannot cut .*\(6, 8\).*batch\[0\] was \(8, 8\).*time-major.*mode='steps'",
    ):
        _fit("batch", module)
    assert module.shapes == [(8, 8)]  # refused at the second batch, before any cut


def test_steps_mode_trains_the_same_time_major_batches_whole():
    module = _TimeMajorAttention()
    _fit("steps", module)
    assert module.shapes and all(shape[1] == BATCH for shape in module.shapes)


# held-out sweep: a batch-first encoder's batch carried a (B, B) "same label" mask next to its tokens; the first
# cut kept its rows only ((8, 8) to (4, 8) next to 4 samples) and the pairwise loss failed at step 13


class _LabelledSequences(Dataset):
    """36 token sequences (4 full batches of 8 and a short one of 4); the first batch's longest is 8 long."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        lengths = [8, 5, 3, 6, 4, 7, 2, 5] + [
            int(n) for n in torch.randint(2, 12, (28,), generator=generator)
        ]
        self.tokens = [torch.randint(1, VOCAB, (n,), generator=generator) for n in lengths]
        self.labels = torch.randint(0, 3, (len(lengths),), generator=generator)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index):
        return self.tokens[index], self.labels[index]


def _batch_first_with(pairwise):
    """A collate_fn of batch-first tokens, their padding mask, the labels and ``pairwise(labels)`` (or none)."""

    def collate(samples):
        tokens, labels = zip(*samples)
        x = pad_sequence(list(tokens), batch_first=True)
        y = torch.stack(labels)
        batch = {"input_ids": x, "mask": (x != 0).float(), "labels": y}
        if pairwise is not None:
            batch["pairs"] = pairwise(y)
        return batch

    return collate


def _same_label(y):
    return (y[:, None] == y[None, :]).float()


def _lower_label(y):  # asymmetric: no symmetry says it is pairwise
    return (y[:, None] < y[None, :]).float()


class _PairwiseEncoder(pl.LightningModule):
    """A batch-first TransformerEncoder; its loss adds one on the samples' pairwise similarities against the
    batch's ``pairs`` (or, with ``relation``, against that relation of the labels computed here)."""

    def __init__(self, relation=None) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 16)
        layer = torch.nn.TransformerEncoderLayer(16, 2, 32, batch_first=True, dropout=0.0)
        self.encoder = torch.nn.TransformerEncoder(layer, 1)
        self.head = torch.nn.Linear(16, 3)
        self.relation = relation
        self.rows: list[int] = []

    def training_step(self, batch, batch_idx):
        mask, y = batch["mask"], batch["labels"]
        self.rows.append(len(y))
        h = self.encoder(self.embed(batch["input_ids"]), src_key_padding_mask=mask == 0)
        z = (h * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        pairs = self.relation(y) if self.relation is not None else batch["pairs"]
        if pairs.layout != torch.strided:  # a collate_fn that built it sparse
            pairs = pairs.to_dense()
        similarity = F.normalize(z, dim=1) @ F.normalize(z, dim=1).T
        return F.cross_entropy(self.head(z), y) + F.binary_cross_entropy_with_logits(5 * similarity, pairs)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def _fit_pairwise(mode, module, pairwise, tmp_path):
    trainer = pl.Trainer(
        callbacks=[HardSampleReplay(mode=mode, replay_fraction=0.5)],
        max_epochs=2,
        **trainer_kwargs(default_root_dir=tmp_path),
    )
    loader = DataLoader(_LabelledSequences(), batch_size=BATCH, collate_fn=_batch_first_with(pairwise))
    trainer.fit(module, loader)


def test_batch_mode_refuses_a_per_sample_pairwise_mask_before_any_cut_naming_the_ways_out(tmp_path):
    module = _PairwiseEncoder()
    with pytest.raises(
        PulseRefusal,
        match=r"^HardSampleReplay cannot cut .*pairwise \(B, B\).*batch\['pairs'\] \(8, 8\) is symmetric"
        r".*mode='steps'.*training_step",
    ):
        _fit_pairwise("batch", module, _same_label, tmp_path)
    assert module.rows == [BATCH]  # refused at the second batch, before any cut


def test_batch_mode_refuses_a_sparse_per_sample_pairwise_mask_before_any_cut(tmp_path):
    # a review: reading a sparse (B, B) mask's values raised NotImplementedError (no equal/diagonal on SparseCPU)
    module = _PairwiseEncoder()
    with pytest.raises(
        PulseRefusal,
        match=r"^HardSampleReplay cannot cut .*batch\['pairs'\] \(8, 8\) is symmetric.*mode='steps'",
    ):
        _fit_pairwise("batch", module, lambda y: _same_label(y).to_sparse(), tmp_path)
    assert module.rows == [BATCH]  # refused at the second batch, before any cut


def test_the_pairwise_refusal_names_a_one_hot_target_read_as_an_identity_matrix():
    from lightning_pulse.core.selection import PairwiseWatch

    # every batch holds each of its 3 classes once, in order: one-hot (3, 3) is the identity at both batches
    batch = {"x": torch.randn(3, 5), "target": torch.eye(3)}
    watch = PairwiseWatch(batch, 3)
    assert watch.refusal(batch, 3, cut=False, first=True) is None
    reason = watch.refusal(batch, 3, cut=False)
    assert reason is not None and "batch['target'] (3, 3) is symmetric" in reason
    assert "one-hot target" in reason and "pass class indices" in reason


def test_batch_mode_refuses_a_pairwise_mask_constant_at_the_first_batches_where_a_new_size_shows_it(tmp_path):
    # every sample of the first two batches has one label: their masks are all ones, no evidence; the short
    # last batch of 4 is (4, 4), follows the number of samples, and holds two labels (read at its new size)
    data = _LabelledSequences()
    data.labels[: 2 * BATCH] = 0
    module = _PairwiseEncoder()
    trainer = pl.Trainer(
        callbacks=[HardSampleReplay(mode="batch", replay_fraction=0.5)],
        max_epochs=2,
        **trainer_kwargs(default_root_dir=tmp_path),
    )
    with pytest.raises(
        PulseRefusal,
        match=r"^HardSampleReplay cannot cut .*batch\['pairs'\] was \(8, 8\) at the fit's first batch and is "
        r"\(4, 4\) at this batch of 4, symmetric .* not constant at a batch whose values were read",
    ):
        trainer.fit(module, DataLoader(data, batch_size=BATCH, collate_fn=_batch_first_with(_same_label)))
    assert module.rows == [BATCH] * 4  # the first epoch's full batches, uncut


# a sweep (regression): tokens padded to their batch's longest were (4, 4) in the full batch of 4 and (2, 2)
# in the last batch of 2; the shape alone was read as a pairwise tensor and the run refused mid-run


class _DynamicallyPadded(Dataset):
    """10 token sequences: in batches of 4 the full ones pad to length 4, the last one of 2 to length 2."""

    lengths = [4, 3, 2, 4, 1, 4, 3, 2, 2, 1]

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index):
        return torch.randint(1, VOCAB, (self.lengths[index],), generator=torch.Generator().manual_seed(index))


def _padded_to_the_longest(items):
    ids = pad_sequence(items, batch_first=True)
    return {"input_ids": ids, "attention_mask": (ids != 0).long()}


class _TokenLM(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 16)
        self.out = torch.nn.Linear(16, VOCAB)
        self.shapes: list[tuple[int, ...]] = []

    def training_step(self, batch, batch_idx):
        ids = batch["input_ids"]
        self.shapes.append(tuple(ids.shape))
        labels = ids.masked_fill(batch["attention_mask"] == 0, -100)
        return F.cross_entropy(self.out(self.embed(ids)).reshape(-1, VOCAB), labels.reshape(-1))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_batch_mode_trains_tokens_padded_to_a_length_that_equals_the_batch_size_at_two_sizes(tmp_path):
    module = _TokenLM()
    trainer = pl.Trainer(
        callbacks=[HardSampleReplay(mode="batch", replay_fraction=0.5)],
        max_steps=9,
        **trainer_kwargs(default_root_dir=tmp_path),
    )
    trainer.fit(module, DataLoader(_DynamicallyPadded(), batch_size=4, collate_fn=_padded_to_the_longest))
    assert trainer.global_step == 9 and (2, 2) in module.shapes
    assert min(shape[0] for shape in module.shapes[3:]) < 4  # the second epoch's full batches were cut


def test_the_pairwise_watch_needs_value_evidence_beside_a_shape_that_follows_the_batch():
    from lightning_pulse.core.selection import PairwiseWatch

    def labelled(y):
        y = torch.tensor(y)
        return {"y": y, "lower": (y[:, None] < y[None, :]).float(), "ids": torch.randint(1, 9, (len(y),) * 2)}

    first = labelled([0, 1, 2, 0])
    watch = PairwiseWatch(first, 4)
    assert watch.refusal(first, 4, cut=False, first=True) is None
    assert watch.refusal(labelled([2, 1, 0, 1]), 4, cut=False) is None
    # (3, 3) at a batch of 3: tokens by chance, and an asymmetric pairwise tensor, which is so not detected
    assert watch.refusal(labelled([1, 0, 2]), 3, cut=True) is None
    assert watch.watching and watch.sizes["batch['lower']"] == {3, 4}


@pytest.mark.parametrize("mode", ["steps", "batch"])
def test_the_pairwise_refusals_ways_out_train(mode, tmp_path):
    # steps mode: the collate_fn builds the mask for the samples the sampler chose (its loss would fail on a
    # mask of other samples); batch mode: the step computes it from the cut labels
    module = _PairwiseEncoder(relation=_same_label if mode == "batch" else None)
    _fit_pairwise(mode, module, _same_label if mode == "steps" else None, tmp_path)
    if mode == "batch":
        assert len(module.rows) == 10 and min(module.rows[5:]) < BATCH  # the second epoch's cut steps
    else:
        assert module.rows and sum(module.rows) < 2 * len(_LabelledSequences())  # fewer samples trained


class _SquareFeatures(pl.LightningModule):
    """An MLP over 8 features in batches of 8: ``(8, 8)`` at every full batch, ``(4, 8)`` at the short one."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(BATCH, 3)
        self.rows: list[int] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.rows.append(len(y))
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_batch_mode_cuts_features_and_tokens_as_long_as_the_batch(tmp_path):
    # not pairwise: features as many as the samples on every batch, tokens as long as them on the first
    generator = torch.Generator().manual_seed(0)
    features = torch.utils.data.TensorDataset(
        torch.randn(36, BATCH, generator=generator), torch.arange(36) % 3
    )
    square = _SquareFeatures()
    trainer = pl.Trainer(
        callbacks=[HardSampleReplay(mode="batch", replay_fraction=0.5)],
        max_epochs=2,
        **trainer_kwargs(default_root_dir=tmp_path),
    )
    trainer.fit(square, DataLoader(features, batch_size=BATCH))
    assert min(square.rows[5:]) < BATCH
    tokens = _PairwiseEncoder(relation=_same_label)
    _fit_pairwise("batch", tokens, None, tmp_path)
    assert min(tokens.rows[5:]) < BATCH


def test_the_pairwise_watch_reads_a_sorted_padding_mask_as_no_relation_and_a_cut_first_batch_at_once():
    from lightning_pulse.core.selection import PairwiseWatch

    # lengths 3, 2, 1 padded to 3: symmetric, but its diagonal holds 1 and 0; the tokens beside it are not
    padded = {
        "x": torch.tensor([[5, 6, 7], [8, 9, 0], [4, 0, 0]]),
        "mask": torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0]]),
    }
    watch = PairwiseWatch(padded, 3)
    assert watch.refusal(padded, 3, cut=False, first=True) is None
    assert watch.refusal(padded, 3, cut=True) is None
    # the fit's first batch is cut (a resumed fit): its symmetry is all there is to read before the harm
    labelled = {"y": torch.tensor([0, 1, 0]), "same": _same_label(torch.tensor([0, 1, 0]))}
    reason = PairwiseWatch(labelled, 3).refusal(labelled, 3, cut=True, first=True)
    assert (
        reason is not None
        and "batch['same'] (3, 3) is symmetric" in reason
        and "at the fit's first batch" in reason
    )


# held-out sweep "nnlayers": a time-major model (nn.LSTM / nn.Transformer with their default batch_first=False)
# whose sequence length equals the batch size gives a loss of (T, B), or (T * B,) rows, that looks batch-first;
# it was split along time (rank correlation with the true per-sample losses about 0.07). The fit's first step now
# tells the layout by the target's strides or by running training_step again on the batch reordered


SEQ = 8  # as long as BATCH: the shapes alone do not tell time from samples


def _sequences(samples=32):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(samples, SEQ, 3, generator=generator)
    y = torch.randn(samples, SEQ, generator=generator) * torch.linspace(0.1, 3.0, samples)[:, None]
    return torch.utils.data.TensorDataset(x, y)


class _LstmRegressor(pl.LightningModule):
    """An nn.LSTM regressor over (B, T, 3) batches; ``batch_first=False`` feeds it ``x.transpose(0, 1)`` and
    computes the loss on its (T, B) outputs against ``target(y)``."""

    def __init__(self, batch_first: bool, target=lambda y: y, lr: float = 0.0) -> None:
        super().__init__()
        self.rnn = torch.nn.LSTM(3, 16, batch_first=batch_first)
        self.out = torch.nn.Linear(16, 1)
        self.batch_first, self.target, self.lr = batch_first, target, lr
        self.calls = 0

    def predict(self, x):
        h, _ = self.rnn(x if self.batch_first else x.transpose(0, 1))
        return self.out(h).squeeze(-1)  # (B, T), or (T, B) time-major

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.calls += 1
        return F.mse_loss(self.predict(x), self.target(y if self.batch_first else y.t()))

    def true_losses(self, x, y):  # (N,): each sample's mean over its T steps
        with torch.no_grad():
            pred = self.predict(x)
            return ((pred if self.batch_first else pred.t()) - y).pow(2).mean(1)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class _Seq2Seq(pl.LightningModule):
    """PyTorch's translation tutorial in small: nn.Transformer over token ids, the loss on the logits flattened
    with ``reshape(-1, V)`` against the shifted targets (``batch_first=False``: (T, B, V) logits and
    ``tgt[:, 1:].t().reshape(-1)``, as the tutorial does)."""

    def __init__(self, batch_first: bool, dropout: float = 0.0, lr: float = 0.0) -> None:
        super().__init__()
        self.src_emb, self.tgt_emb = torch.nn.Embedding(VOCAB, 16), torch.nn.Embedding(VOCAB, 16)
        self.transformer = torch.nn.Transformer(16, 2, 1, 1, 32, dropout=dropout, batch_first=batch_first)
        self.out = torch.nn.Linear(16, VOCAB)
        self.batch_first, self.lr = batch_first, lr
        self.calls = 0

    def logits(self, src, tgt_in):  # (B, S), (B, T) -> (B, T, V), or (T, B, V) time-major
        mask = self.transformer.generate_square_subsequent_mask(tgt_in.shape[1])
        if not self.batch_first:
            src, tgt_in = src.t(), tgt_in.t()
        return self.out(self.transformer(self.src_emb(src), self.tgt_emb(tgt_in), tgt_mask=mask))

    def training_step(self, batch, batch_idx):
        src, tgt = batch
        self.calls += 1
        logits = self.logits(src, tgt[:, :-1])
        target = tgt[:, 1:] if self.batch_first else tgt[:, 1:].t()
        return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))

    def true_losses(self, src, tgt):  # (N,): each sample's mean over its T target tokens
        with torch.no_grad():
            logits = self.logits(src, tgt[:, :-1])
            logits = logits.permute(0, 2, 1) if self.batch_first else logits.permute(1, 2, 0)  # (N, V, T)
            return F.cross_entropy(logits, tgt[:, 1:], reduction="none").mean(1)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def _token_pairs(samples=32):
    generator = torch.Generator().manual_seed(0)
    src = torch.randint(0, VOCAB, (samples, 5), generator=generator)
    return torch.utils.data.TensorDataset(
        src, torch.randint(0, VOCAB, (samples, SEQ + 1), generator=generator)
    )


def _fit_sequences(module, data, tmp_path, max_epochs=1):
    replay = HardSampleReplay(mode="batch", replay_fraction=0.5, score_half_life=None)
    trainer = pl.Trainer(
        callbacks=[replay], max_epochs=max_epochs, **trainer_kwargs(default_root_dir=tmp_path)
    )
    trainer.fit(module, DataLoader(data, batch_size=BATCH, shuffle=True))
    return replay, trainer


@pytest.mark.parametrize("target", ["a view", "a copy"])
def test_a_time_major_lstm_loss_as_long_as_the_batch_is_refused_at_the_first_step(target, tmp_path):
    # a view (`y.t()`) is told by its strides; a copy (`y.t().contiguous()`) by training_step run again on the
    # batch reordered, its (T, B) rows staying in place
    module = _LstmRegressor(batch_first=False, target=(lambda y: y) if target == "a view" else torch.clone)
    with pytest.raises(
        PulseRefusal,
        match=r"^HardSampleReplay cannot split the module's mse_loss into samples: its unreduced loss \(8, 8\) "
        r"is time-major, the batch's 8 samples along its second dimension.*(transposed|stayed in place).*"
        r"`batch_first=True`.*`scorer=`",
    ):
        _fit_sequences(module, _sequences(), tmp_path)
    assert module.calls == 1  # refused at the first step; the check's runs leave no count behind


def test_the_translation_tutorials_time_major_transformer_with_as_many_target_tokens_as_samples_is_refused(
    tmp_path,
):
    module = _Seq2Seq(batch_first=False)
    with pytest.raises(
        PulseRefusal,
        match=r"^HardSampleReplay cannot split the module's cross_entropy into samples: its unreduced loss "
        r"\(64,\) is time-major, the batch's 8 samples along every 8th row.*stayed in place",
    ):
        _fit_sequences(module, _token_pairs(), tmp_path)
    assert module.calls == 1


@pytest.mark.parametrize("model", ["lstm", "lstm-copied-target", "transformer"])
def test_batch_first_sequence_models_as_long_as_the_batch_train_and_score_each_sample_exactly(
    model, tmp_path
):
    # weights fixed (lr=0): every stored score is the sample's true loss. The LSTM's target `y` is told by its
    # strides; a copy of it, and the Transformer's flattened `tgt[:, 1:].reshape(-1)`, by the step run again
    if model == "transformer":
        module, data = _Seq2Seq(True), _token_pairs()
    else:
        module, data = _LstmRegressor(True, torch.clone if model != "lstm" else lambda y: y), _sequences()
    replay, trainer = _fit_sequences(module, data, tmp_path, max_epochs=2)
    assert trainer.global_step == 8 and module.calls == 8
    truth = module.true_losses(*data.tensors)
    scores = torch.from_numpy(replay.table.scores)
    assert not scores.isnan().any()
    assert (scores - truth).abs().max() < 1e-4


class _MaskedTagger(pl.LightningModule):
    """A batch-first masked-token model as masked-LM recipes write it: ``training_step`` draws a mask over the
    (B, T) tokens and scores only the masked positions (``ignore_index``), T equal to B."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.out = torch.nn.Embedding(VOCAB + 1, 16), torch.nn.Linear(16, VOCAB)
        self.rnn = torch.nn.LSTM(16, 16, batch_first=True)

    def training_step(self, batch, batch_idx):
        tokens = batch[1][:, :SEQ]
        masked = torch.rand(tokens.shape) < 0.3
        labels = torch.where(masked, tokens, torch.full_like(tokens, -100))
        hidden, _ = self.rnn(self.emb(torch.where(masked, torch.full_like(tokens, VOCAB), tokens)))
        return F.cross_entropy(self.out(hidden).reshape(-1, VOCAB), labels.reshape(-1))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def test_a_batch_first_masked_lm_as_long_as_the_batch_is_not_taken_for_time_major(tmp_path):
    # the check's two runs draw the same mask, tied to positions, not to samples: each row's loss follows its
    # mask, not its sample, so the rows' means neither moved with the samples nor changed (a review: refused
    # as time-major). The samples left in place keep their losses whatever the draws: their rows decide
    replay, trainer = _fit_sequences(_MaskedTagger(), _token_pairs(), tmp_path)
    assert trainer.global_step == 4


def test_the_layout_check_leaves_the_training_as_it_was(monkeypatch, tmp_path):
    # dropout and SGD: the check's runs of training_step draw no random number and write no weight or buffer,
    # so the fit trains as one whose check never ran
    import lightning_pulse.core.replay_batch as replay_batch

    checked = replay_batch.sample_dimension_refusal
    runs = []

    def counted(capture, rerun):
        return checked(capture, lambda *args: runs.append(args) or rerun(*args))

    weights = []
    for check in (counted, lambda capture, rerun: None):
        monkeypatch.setattr(replay_batch, "sample_dimension_refusal", check)
        pl.seed_everything(0)
        module = _Seq2Seq(batch_first=True, dropout=0.3, lr=0.1)
        _fit_sequences(module, _token_pairs(), tmp_path)
        weights.append(torch.cat([p.detach().flatten() for p in module.parameters()]))
    assert len(runs) == 2  # the batch as it came and reordered, at the first step only
    assert torch.equal(weights[0], weights[1])


def test_rows_follow_the_samples_tells_samples_time_steps_and_pairs():
    from lightning_pulse.core.loss_layout import rows_follow_the_samples

    generator = torch.Generator().manual_seed(0)
    samples = torch.rand(6, generator=generator) * torch.arange(1.0, 7.0)  # each sample's own level
    noise = torch.rand(6, 6, generator=generator)
    order = torch.tensor([2, 0, 1, 5, 3, 4])
    batch_first = samples[:, None] + noise  # (B, T): row i is sample i
    assert rows_follow_the_samples(batch_first, batch_first[order], order, 6) is True
    time_major = batch_first.t()  # (T, B): reordered samples are reordered columns
    assert rows_follow_the_samples(time_major, time_major[:, order], order, 6) is False
    flattened = time_major.reshape(-1)  # (T * B,) rows of the time-major logits
    assert rows_follow_the_samples(flattened, time_major[:, order].reshape(-1), order, 6) is False
    pairwise = samples[:, None] * samples[None, :]  # (B, B) over pairs of samples
    assert rows_follow_the_samples(pairwise, pairwise[order][:, order], order, 6) is True
    assert rows_follow_the_samples(batch_first, torch.rand(6, 6, generator=generator), order, 6) is None
