"""StabilityGuard's re-runs of ``training_step`` (the rollback test at a snapshot, the data check of a
non-finite step) on a batch class that is no collection (Lightning moves it through its ``.to()``) and that
``training_step`` changes in place.

Found by a sweep (s44, problem 2): a re-run copied the tensors of lists, tuples and mappings only, so such a
batch was handed over as it was kept: each re-run scaled it once more (three re-runs of one batch: losses
0.9565, 0.923, 1.0593, the batch at x*8), the flagged and reference losses were read on altered data, and
the batch Lightning still held for the later callbacks' ``on_train_batch_end`` changed. In the fit below
(a batch class, not a dataclass) the poisoned step 12's re-runs halved its batch twice more, the spike did not
recur on the snapshot, and the guard rolled back to step 0 (15 steps of work lost) where the data was at
fault. A re-run now gets a copy (:func:`lightning_pulse.probe.batch_copy`, the evaluation probe's).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_pulse import StabilityGuard
from tests.conftest import fast_tokenizer, trainer_kwargs

POISONED = (4, 9, 12)  # batch indices whose inputs are scaled x300: a spike at any weights (the data's)
BATCHES = 16


class _Box:
    """A batch class with a ``__dict__``, no collection."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, index: int) -> None:
        self.x, self.y, self.index = x, y, index

    def to(self, *args, **kwargs):
        self.x, self.y = self.x.to(*args, **kwargs), self.y.to(*args, **kwargs)
        return self


@dataclass(slots=True)
class _SlotBox:
    """A batch class with ``__slots__`` (``dataclass(slots=True)``; attrs' ``@define`` too)."""

    x: torch.Tensor
    y: torch.Tensor
    index: int

    def to(self, *args, **kwargs):
        self.x, self.y = self.x.to(*args, **kwargs), self.y.to(*args, **kwargs)
        return self


class _Data(Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(BATCHES * 16, 20, generator=g)
        self.y = (self.x @ torch.randn(20, 4, generator=g)).argmax(1)
        for batch in POISONED:
            self.x[16 * batch : 16 * batch + 16] *= 300

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int):
        return self.x[index], self.y[index], index


class _Calls(list):
    pass


class _ScalesItsBatch(pl.LightningModule):
    """Scales its batch's input in place in ``training_step`` (a normalisation written as ``mul_``), and
    keeps what every call got: ``(in the loop, first dataset index, sum of |x|)``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 4))
        self.calls = _Calls()  # not a list: a re-run puts the module's public lists back
        self.in_loop = False

    def on_train_batch_start(self, batch, batch_idx):
        self.in_loop = True

    def training_step(self, batch, batch_idx):
        got = float(batch.x.abs().sum())
        batch.x.mul_(0.5)
        loss = nn.functional.cross_entropy(self.net(batch.x), batch.y)
        self.calls.append((self.in_loop, int(batch.index), got))
        self.in_loop = False
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


class _BatchAtEnd(Callback):
    """Listed after the guard: the batch Lightning hands to ``on_train_batch_end``, by first dataset index."""

    def __init__(self) -> None:
        self.seen: dict[int, float] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seen[int(batch.index)] = float(batch.x.abs().sum())


@pytest.mark.parametrize("box", [_Box, _SlotBox])
def test_reruns_of_a_batch_class_the_step_scales_in_place_see_the_batch_as_the_step_left_it(tmp_path, box):
    def collate(items):
        xs, ys, indices = zip(*items)
        return box(torch.stack(xs), torch.stack(ys), indices[0])

    data = _Data()
    guard = StabilityGuard(
        warmup=5, window=20, snapshot_every=5, rollback_margin=2, max_snapshots=3, rollback_after=2,
        skip_after_rollback=2,
    )  # fmt: skip
    ends, module = _BatchAtEnd(), _ScalesItsBatch()
    trainer = pl.Trainer(
        max_steps=BATCHES, callbacks=[guard, ends], default_root_dir=tmp_path, **trainer_kwargs()
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, DataLoader(data, batch_size=16, collate_fn=collate))

    loader_x = {16 * b: float(data.x[16 * b : 16 * b + 16].abs().sum()) for b in range(BATCHES)}
    reruns = [call for call in module.calls if not call[0]]
    assert reruns  # the poisoned steps were flagged and re-run at snapshots
    for _, index, got in reruns:
        # a re-run gets the kept batch as the step left it (its in-place x*0.5; documented), never scaled again
        assert got == pytest.approx(loader_x[index] * 0.5, rel=1e-6)
    # the batch Lightning holds after the guard's re-runs is the one the step left
    assert ends.seen == pytest.approx({index: x * 0.5 for index, x in loader_x.items()}, rel=1e-6)
    # the poisoned batches spike at any weights: the data's, skipped, never rolled back
    assert guard.rollbacks == 0 and not guard.stopped
    assert {event["step"] for event in guard.events} and guard.recurring_spikes >= 1


class _Texts(Dataset):
    """Sentences of 2 to 5 words, labelled by their first word; the POISONED batches' rows marked."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        lengths = torch.randint(2, 6, (BATCHES * 16,), generator=g).tolist()
        self.texts = [
            " ".join(f"w{int(i)}" for i in torch.randint(0, 20, (n,), generator=g)) for n in lengths
        ]

    def __len__(self) -> int:
        return len(self.texts)

    def __getitem__(self, index: int):
        return self.texts[index], index // 16 in POISONED


class _AlignsWords(pl.LightningModule):
    """Reads its batch's word alignment in ``training_step`` (``word_ids``, as NER code does), which only a
    fast tokenizer's ``BatchEncoding`` with its encodings answers."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = nn.Embedding(22, 16), nn.Linear(16, 4)
        self.words = _Calls()  # not a list: a re-run puts the module's public lists back

    def training_step(self, batch, batch_idx):
        self.words.append(sum(word is not None for word in batch.word_ids(0)) * batch.n_sequences)
        pooled = (self.emb(batch["input_ids"]) * batch["scale"][:, None, None]).mean(1)
        return nn.functional.cross_entropy(self.head(pooled), batch["input_ids"][:, 0] % 4)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


def test_reruns_of_a_fast_tokenizers_batch_encoding_keep_its_encodings(tmp_path):
    # found by a sweep (s46, finding 1): a re-run's copy rebuilt the BatchEncoding from its entries, so
    # `word_ids` raised "not available when using Python based tokenizers" in the re-run
    tokenizer = fast_tokenizer()

    def collate(rows):
        texts, poisoned = zip(*rows)
        batch = tokenizer(list(texts), padding=True, return_tensors="pt")
        batch["scale"] = torch.tensor([300.0 if bad else 1.0 for bad in poisoned])
        return batch

    guard = StabilityGuard(
        warmup=5, window=20, snapshot_every=5, rollback_margin=2, max_snapshots=3, rollback_after=2,
        skip_after_rollback=2,
    )  # fmt: skip
    module = _AlignsWords()
    trainer = pl.Trainer(max_steps=BATCHES, callbacks=[guard], default_root_dir=tmp_path, **trainer_kwargs())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, DataLoader(_Texts(), batch_size=16, collate_fn=collate))
    # the re-runs raised there, so the guard took every test as inconclusive and said so
    assert not [warning for warning in caught if "re-running training_step" in str(warning.message)]
    assert len(module.words) > BATCHES  # re-run, each with the batch's word alignment
    # the poisoned batches spike at any weights: the data's, skipped, never rolled back
    assert guard.rollbacks == 0 and guard.recurring_spikes >= 1


class _TaggedList(list):
    """A batch class built on a list ``[x, y, {"index": i}]`` carrying what its entries do not (``source``);
    with ``.to()``, so Lightning moves it as it is."""

    def to(self, *args, **kwargs):
        self[0], self[1] = self[0].to(*args, **kwargs), self[1].to(*args, **kwargs)
        return self


class _TaggedTuple(tuple):
    """As :class:`_TaggedList`, built on a tuple."""

    def to(self, *args, **kwargs):
        moved = _TaggedTuple((self[0].to(*args, **kwargs), self[1].to(*args, **kwargs), self[2]))
        moved.source = self.source
        return moved


class _ReadsItsSource(_ScalesItsBatch):
    def training_step(self, batch, batch_idx):
        self.calls.append((self.in_loop, batch[2]["index"], batch.source))
        self.in_loop = False
        return nn.functional.cross_entropy(self.net(batch[0]), batch[1])


@pytest.mark.parametrize("tagged", [_TaggedList, _TaggedTuple])
def test_reruns_of_a_list_or_tuple_batch_class_keep_its_attributes(tmp_path, tagged):
    # found with s46's finding 1: the batch kept at training_step's entry (containers_copied) and a re-run's
    # copy of it were built again from their entries, without the `source` the step reads
    def collate(items):
        xs, ys, indices = zip(*items)
        batch = tagged([torch.stack(xs), torch.stack(ys), {"index": indices[0]}])
        batch.source = "loader"
        return batch

    guard = StabilityGuard(
        warmup=5, window=20, snapshot_every=5, rollback_margin=2, max_snapshots=3, rollback_after=2,
        skip_after_rollback=2,
    )  # fmt: skip
    module = _ReadsItsSource()
    trainer = pl.Trainer(max_steps=BATCHES, callbacks=[guard], default_root_dir=tmp_path, **trainer_kwargs())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, DataLoader(_Data(), batch_size=16, collate_fn=collate))
    assert not [warning for warning in caught if "re-running training_step" in str(warning.message)]
    reruns = [call for call in module.calls if not call[0]]
    assert reruns and all(source == "loader" for _, _, source in reruns)
    assert guard.rollbacks == 0 and guard.recurring_spikes >= 1
