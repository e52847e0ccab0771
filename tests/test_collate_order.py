"""A collate_fn that reorders a batch's samples (sorted by length, longest first, for
``pack_padded_sequence(enforce_sorted=True)``) breaks the row-to-dataset-index mapping every index-keyed
callback relies on. A held-out sweep found it silent: HardSampleReplay stored 82 of 96 scores against
other samples, StabilityGuard named other samples as bad, GradientCache's activation cache blamed
augmentation. It is told at the fit's first batches (:mod:`lightning_pulse.core.collate_order`); pipelines
that keep the order are not refused."""

from __future__ import annotations

import random

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_sequence
from torch.utils.data import DataLoader, Dataset

from lightning_pulse import GradientCache, HardSampleReplay, StabilityGuard
from lightning_pulse.core import collate_order
from lightning_pulse.core.collate_order import collate_keeps_order
from lightning_pulse.errors import PulseRefusal
from tests.conftest import trainer_kwargs

SAMPLES, FEATURES, CLASSES = 48, 4, 3


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)  # the shuffled orders, the same at every run


def _length(index: int) -> int:
    return 1 + (index * 7) % 5  # 1..5 steps: every batch of 8 holds several lengths


class _Sequences(Dataset):
    """Sample ``i``: a ``(L_i, 4)`` sequence, its class and ``i``; ``noisy``: random augmentation drawn from
    torch, numpy and ``random`` at every read."""

    def __init__(self, noisy: bool = False, nan_at: int | None = None) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = [torch.randn(_length(i), FEATURES, generator=generator) for i in range(SAMPLES)]
        self.y = torch.randint(0, CLASSES, (SAMPLES,), generator=generator)
        self.noisy = noisy
        if nan_at is not None:
            self.x[nan_at][0, 0] = float("nan")

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int):
        x = self.x[index]
        if self.noisy:
            x = (
                x
                + 0.1 * torch.randn_like(x)
                + float(np.random.uniform(-0.1, 0.1))
                + random.uniform(-0.1, 0.1)
            )
        return x, int(self.y[index]), index


def pad_in_order(samples):
    """Pads to the batch's longest sequence, the samples in the order received."""
    x = pad_sequence([s[0] for s in samples], batch_first=True)
    lengths = torch.tensor([len(s[0]) for s in samples])
    return x, lengths, torch.tensor([s[1] for s in samples]), torch.tensor([s[2] for s in samples])


def sort_by_length(samples):
    """The collate_fn ``pack_padded_sequence(enforce_sorted=True)`` asks for: longest first."""
    return pad_in_order(sorted(samples, key=lambda sample: -len(sample[0])))


def as_dict(collate):
    def collate_dict(samples):
        x, lengths, y, index = collate(samples)
        return {"x": x, "lengths": lengths, "y": y, "idx": index}

    return collate_dict


def pad_like_hf(samples):
    """A DataCollatorWithPadding-like dict: padded inputs and an attention mask, no index field."""
    x, lengths, y, _ = pad_in_order(samples)
    mask = (torch.arange(x.shape[1])[None, :] < lengths[:, None]).long()
    return {"input_values": x, "attention_mask": mask, "labels": y}


class _SequenceClassifier(pl.LightningModule):
    """A GRU over packed sequences (``encoder="gru"``) or an MLP over their mean (``"mean"``); records each
    trained sample's loss by dataset index (where the batch names it) and the inputs it trained on."""

    def __init__(self, encoder: str = "gru", enforce_sorted: bool = True) -> None:
        super().__init__()
        self.encoder, self.enforce_sorted = encoder, enforce_sorted
        self.rnn = nn.GRU(FEATURES, 8, batch_first=True)
        self.body = nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
        self.head = nn.Linear(8 if encoder == "gru" else 16, CLASSES)
        self.steps = 0
        self.own_losses: dict[int, float] = {}
        self.inputs: list[torch.Tensor] = []
        self.watched, self.watched_rows = -1, []  # the rows a sample sat in, where the batch names it

    def training_step(self, batch, batch_idx):
        if isinstance(batch, dict) and "x" in batch:
            x, lengths, y, index = batch["x"], batch["lengths"], batch["y"], batch["idx"]
        elif isinstance(batch, dict):  # pad_like_hf's
            x, lengths, y, index = (
                batch["input_values"],
                batch["attention_mask"].sum(1),
                batch["labels"],
                None,
            )
        else:
            x, lengths, y, index = batch
        self.steps += 1
        self.inputs.append(x.detach().clone())
        if index is not None and self.watched in index.tolist():
            self.watched_rows.append(index.tolist().index(self.watched))
        if self.encoder == "gru":
            packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=self.enforce_sorted)
            features = self.rnn(packed)[1][-1]
        else:
            valid = torch.arange(x.shape[1])[None, :, None] < lengths[:, None, None]
            features = self.body(x.masked_fill(~valid, 0.0).sum(1) / lengths[:, None])
        per_sample = F.cross_entropy(self.head(features), y, reduction="none")
        if index is not None:
            self.own_losses.update(zip(index.tolist(), per_sample.detach().tolist()))
        return per_sample.mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _OrderVerdict(Callback):
    """Notes what the tracker told of the collate_fn's order at the fit's last batch."""

    def __init__(self, replay: HardSampleReplay) -> None:
        self.replay, self.keeps_order = replay, "not told"

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        order = getattr(self.replay.tracker, "order", None)  # (no such check before the fix)
        self.keeps_order = "not told" if order is None else order.keeps_order


def _fit_replay(module, loader, mode="steps", epochs=4):
    replay = HardSampleReplay(mode=mode, score_half_life=None)
    verdict = _OrderVerdict(replay)
    trainer = pl.Trainer(callbacks=[replay, verdict], max_epochs=epochs, **trainer_kwargs())
    trainer.fit(module, loader)
    return trainer, replay, verdict


@pytest.mark.parametrize("mode", ["steps", "batch"])
def test_a_collate_fn_that_sorts_by_length_is_refused_before_the_first_step(mode):
    module = _SequenceClassifier()
    before = [p.detach().clone() for p in module.parameters()]
    loader = DataLoader(_Sequences(), batch_size=8, shuffle=True, collate_fn=sort_by_length)
    with pytest.raises(PulseRefusal) as refusal:
        _fit_replay(module, loader, mode)
    message = str(refusal.value)
    assert message.startswith("HardSampleReplay cannot tell which sample each row of a batch is")
    assert "collate_fn `sort_by_length` puts a batch's samples in another order" in message
    assert "enforce_sorted=False" in message  # the way out
    assert module.steps == 0  # no training_step ran, no weight moved
    assert all(torch.equal(p, b) for p, b in zip(module.parameters(), before))


class _EqualFirst(_Sequences):
    """The first 8 sequences all 3 steps long: a sort by length leaves the first batch (unshuffled) as it
    came."""

    def __init__(self) -> None:
        super().__init__()
        self.x[:8] = [x[:1].expand(3, FEATURES).clone() + k for k, x in enumerate(self.x[:8])]


def test_a_sort_that_leaves_the_first_batch_as_it_came_is_refused_at_the_first_batch_it_moves():
    # one batch whose lengths are all equal tells nothing: the check goes on to the next batches
    module = _SequenceClassifier()
    loader = DataLoader(_EqualFirst(), batch_size=8, collate_fn=sort_by_length)
    with pytest.raises(
        PulseRefusal, match="collate_fn `sort_by_length` puts a batch's samples in another order"
    ):
        _fit_replay(module, loader, "batch")
    assert module.steps == 1  # its rows were the drawn samples in order


def test_a_batch_whose_index_field_names_its_samples_in_another_order_is_refused():
    loader = DataLoader(_Sequences(), batch_size=8, shuffle=True, collate_fn=as_dict(sort_by_length))
    with pytest.raises(PulseRefusal, match="dataset index field names them in another order"):
        _fit_replay(_SequenceClassifier(), loader, "batch")


@pytest.mark.parametrize("mode", ["steps", "batch"])
def test_the_way_out_trains_and_scores_each_sample_by_its_own_loss(mode):
    module = _SequenceClassifier(enforce_sorted=False)
    loader = DataLoader(_Sequences(), batch_size=8, shuffle=True, collate_fn=pad_in_order)
    trainer, replay, verdict = _fit_replay(module, loader, mode, epochs=3)
    assert trainer.state.finished and verdict.keeps_order is True  # told, not left unknown
    scores = replay.selector.table.scores
    errors = [abs(float(scores[i]) - loss) for i, loss in module.own_losses.items()]
    assert len(errors) == SAMPLES and max(errors) < 1e-5


def _hf_padding():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import DataCollatorWithPadding, PreTrainedTokenizerFast

    vocab = {word: i for i, word in enumerate("[PAD] [UNK] a b c d e".split())}
    tokens = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokens.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tokens, pad_token="[PAD]", unk_token="[UNK]")
    return tokenizer, DataCollatorWithPadding(tokenizer)


class _Texts(Dataset):
    def __init__(self) -> None:
        self.tokenizer, _ = _hf_padding()

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int):
        text = " ".join("abcde"[(index + k) % 5] for k in range(_length(index)))
        return {**self.tokenizer(text), "labels": index % CLASSES}


class _TextClassifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(7, 8), nn.Linear(8, CLASSES)

    def training_step(self, batch, batch_idx):
        mask = batch["attention_mask"][..., None]
        mean = (self.embed(batch["input_ids"]) * mask).sum(1) / mask.sum(1)
        return F.cross_entropy(self.head(mean), batch["labels"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _FixedLength(Dataset):
    """The sequences cut to their first step: ``(x, length, y, i)`` samples that ``default_collate``
    stacks."""

    def __init__(self, data: _Sequences) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int):
        x, y, index = self.data[index]
        return x[:1], torch.tensor(1), y, index


@pytest.mark.parametrize("pipeline", ["default", "dict", "padding", "augmented", "hf_padding"])
def test_collate_fns_that_keep_the_order_are_not_refused(pipeline):
    # each is told to keep the order (not left unknown): torch's default_collate and HF's collators by name,
    # the others by the check, which random augmentation in the Dataset does not mislead (both orders
    # collate the same samples, read once)
    module, data = _SequenceClassifier("mean"), _Sequences(noisy=pipeline == "augmented")
    if pipeline == "default":
        loader = DataLoader(_FixedLength(data), batch_size=8, shuffle=True)
    elif pipeline == "hf_padding":
        module = _TextClassifier()
        loader = DataLoader(_Texts(), batch_size=8, shuffle=True, collate_fn=_hf_padding()[1])
    else:
        collate = {"dict": as_dict(pad_in_order), "padding": pad_like_hf, "augmented": pad_in_order}[pipeline]
        loader = DataLoader(data, batch_size=8, shuffle=True, collate_fn=collate)
    trainer, _, verdict = _fit_replay(module, loader, "steps")
    assert trainer.state.finished and verdict.keeps_order is True


def test_the_order_check_draws_nothing_from_the_runs_random_streams(monkeypatch):
    # the check reads the first batch's samples again in the main process: a Dataset augmenting from torch,
    # numpy and random must still hand the run the values it would have had without the check
    def inputs_trained(check: bool) -> list[torch.Tensor]:
        torch.manual_seed(1), np.random.seed(1), random.seed(1)
        monkeypatch.setattr(collate_order, "PROBED_BATCHES", 3 if check else 0)
        module = _SequenceClassifier("mean")
        loader = DataLoader(_Sequences(noisy=True), batch_size=8, shuffle=True, collate_fn=pad_in_order)
        _, _, verdict = _fit_replay(module, loader, "batch")
        assert verdict.keeps_order is (True if check else None)
        return module.inputs

    checked, unchecked = inputs_trained(True), inputs_trained(False)
    assert len(checked) == len(unchecked) == 24  # 4 epochs of 6 batches
    assert all(torch.equal(a, b) for a, b in zip(checked, unchecked))


def test_gradient_cache_switches_its_activation_cache_off_naming_a_sorting_collate_fn():
    # it recorded under the wrong indices until its first check of a replayed batch switched it off, naming
    # augmentation first among the possible causes
    cache = GradientCache(check_every=4, freeze_for=200, threshold=1.0, activation_cache_mb=4.0)
    trainer = pl.Trainer(callbacks=[cache], max_epochs=3, **trainer_kwargs())
    loader = DataLoader(_Sequences(), batch_size=8, shuffle=True, collate_fn=sort_by_length)
    with pytest.warns(UserWarning, match="activation cache switched itself off") as said:
        trainer.fit(_SequenceClassifier("mean"), loader)
    notes = [str(w.message) for w in said if "switched itself off" in str(w.message)]
    assert (
        len(notes) == 1 and "collate_fn `sort_by_length` puts a batch's samples in another order" in notes[0]
    )
    assert "augmentation" not in notes[0] and "enforce_sorted=False" in notes[0]
    assert trainer.state.finished and cache.activations.hits == 0


def test_stability_guard_names_no_other_sample_for_a_row_a_sorting_collate_fn_moved():
    # GradientCache's tracker gave the guard the drawn indices, in the sampler's order: the NaN row was named
    # by another sample's index
    bad = 13
    guard = StabilityGuard(warmup=5, window=20, snapshot_every=10)
    cache = GradientCache(check_every=4, freeze_for=200, threshold=1.0, activation_cache_mb=4.0)
    trainer = pl.Trainer(callbacks=[guard, cache], max_epochs=2, **trainer_kwargs())
    loader = DataLoader(_Sequences(nan_at=bad), batch_size=8, shuffle=True, collate_fn=sort_by_length)
    module = _SequenceClassifier("mean")
    module.watched = bad
    with pytest.warns(UserWarning):
        trainer.fit(module, loader)
    assert len(guard.bad_samples) == 2  # once an epoch
    assert [found["rows"] for found in guard.bad_samples] == [[row] for row in module.watched_rows]
    assert [found["indices"] for found in guard.bad_samples] == [None, None]  # the rows, and no other sample


def _padded(samples):
    x, lengths, y, _ = pad_in_order(samples)
    return x, lengths, y


def _sorted(samples):
    return _padded(sorted(samples, key=lambda sample: -len(sample[0])))


def _shuffled(samples):
    return _padded([samples[k] for k in torch.randperm(len(samples)).tolist()])


def _masked(samples):
    x, lengths, y = _padded(samples)
    return x * (torch.rand(x.shape) > 0.3), lengths, y


def _mixup(samples):
    x, _, y = _padded(samples)
    mix, partner = float(np.random.beta(1.0, 1.0)), torch.randperm(len(samples))
    return mix * x + (1 - mix) * x[partner], y, y[partner]


def _time_major_sorted(samples):
    x, _, y = _sorted(samples)
    return x.transpose(0, 1), y  # (T, B), no lengths


def _named(samples):
    x, _, y = _padded(samples)
    return {"x": x, "names": [f"sample-{s[2]}" for s in samples], "y": y, "row": torch.arange(len(samples))}


@pytest.mark.parametrize(
    ("collate", "told"),
    [
        (_padded, True),
        (_named, True),  # a list of names, and a (B,) row counter that says nothing of the samples
        (lambda s: _padded(s[:1] * len(s)), None),  # every row alike: no order to tell
        (_sorted, False),
        (_time_major_sorted, False),
        (_shuffled, False),
        (_masked, None),  # random per row: neither order's rows, never taken for a reorder
        (_mixup, None),
    ],
)
def test_the_order_of_a_collate_fn_is_told_from_its_rows_both_ways(collate, told):
    samples = [_Sequences()[i] for i in range(8)]
    states = torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate()
    assert collate_keeps_order(collate, samples) is told
    assert torch.equal(states[0], torch.get_rng_state()) and random.getstate() == states[2]
    assert (np.random.get_state()[1] == states[1]).all()


def test_a_dataset_that_reads_only_in_its_workers_is_not_refused():
    # a Dataset set up by worker_init_fn (an LMDB handle, say) raises when read in the main process: the order
    # stays untold and the fit trains
    class _WorkerOnly(_Sequences):
        def __getitem__(self, index):
            if torch.utils.data.get_worker_info() is None:
                raise RuntimeError("opened in worker_init_fn only")
            return super().__getitem__(index)

    loader = DataLoader(_WorkerOnly(), batch_size=8, shuffle=True, collate_fn=pad_in_order, num_workers=1)
    trainer, _, verdict = _fit_replay(_SequenceClassifier(enforce_sorted=False), loader, "steps", epochs=1)
    assert trainer.state.finished and verdict.keeps_order is None
