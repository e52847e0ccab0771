"""The copy a probe or a StabilityGuard re-run gets of a kept batch (:func:`lightning_pulse.probe.batch_copy`)
copies the plain data a batch object holds (a list, dict, set, deque, numpy array, dataclass), tensor or not,
so that a step's in-place change to it stays in the copy; handles stay shared.

Found by a review (s45, of the copy that copies only the paths to a batch's tensors): every object leading to
no tensor was shared, the batch's own plain data too. A ``validation_step`` that took the sample ids off its
batch (``batch.meta.pop("ids")``) took them off the kept batch: the second PulseCycle probe crashed the fit
with ``KeyError: 'ids'`` (at the commit before, 4 probes). An empty list the step appended to grew on the kept
batch, a numpy mask ``*= 2`` compounded (1 -> 8 over three copies), a nested dataclass's counter ``+= 1``
reached the kept batch (0 -> 3), and a ``deque`` of tensors, which the walk did not look into, was shared with
its tensors (``q[0].mul_(2)``: 1 -> 8; ``popleft``: ``IndexError`` at the third copy). The walk also read every
record of a Mapping that is no dict (an open ``shelve``: 2.9 s a copy) and, the Mapping closed, raised out of
the copy; a nested object that refused to copy was blamed on the batch's class."""

from __future__ import annotations

import collections
import dataclasses
import threading
import warnings
from collections.abc import Mapping

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from lightning_pulse import PulseCycle, StabilityGuard
from lightning_pulse.core.selection import containers_copied
from lightning_pulse.probe import RERUN, batch_copy
from tests.conftest import fast_tokenizer, trainer_kwargs
from tests.test_probe_batch_copy_shares import _Batch, _Reader, _Refuses
from tests.test_probe_kept_batches import _Probes, _Samples
from tests.test_stability_guard_batch_class_reruns import BATCHES, _Data, _ScalesItsBatch


@dataclasses.dataclass
class _Seen:
    count: int = 0


def _pop(batch):
    batch.meta.pop("ids")


def _append(batch):
    batch.cache.append(batch.x.sum())


def _scale_mask(batch):
    batch.mask *= 2


def _count(batch):
    batch.seen.count += 1


def _add(batch):
    batch.tags.add("seen")


def _scale_queued(batch):
    batch.queue[0].mul_(2.0)


def _popleft(batch):
    batch.queue.popleft()


@pytest.mark.parametrize(
    ("field", "value", "step"),
    [
        ("meta", {"ids": ["a", "b"]}, _pop),
        ("cache", [], _append),
        ("mask", np.ones(2), _scale_mask),
        ("seen", _Seen(), _count),
        ("tags", {"a"}, _add),
        ("queue", collections.deque([torch.ones(2)]), _scale_queued),
        ("queue", collections.deque([torch.ones(2), torch.ones(2)]), _popleft),
    ],
    ids=[
        "dict-pop",
        "list-append",
        "ndarray-imul",
        "dataclass-iadd",
        "set-add",
        "deque-mul_",
        "deque-popleft",
    ],
)
def test_a_steps_in_place_change_to_a_field_stays_out_of_the_kept_batch(field, value, step):
    batch = _Batch(torch.ones(2), torch.zeros(2), **{field: value}, reader=_Reader())
    before = repr(getattr(batch, field))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # copied, not handed over with a warning
        for _ in range(3):
            copied = batch_copy([batch], "PulseCycle", "the probe's `validation_step`", set())[0]
            step(copied)
            assert copied.reader is batch.reader  # the handle beside: shared
    assert repr(getattr(batch, field)) == before


def test_plain_data_that_will_not_copy_is_shared_and_the_rest_copied():
    lock = threading.Lock()
    locks = np.array([lock], dtype=object)  # an object array holding a lock: deepcopy raises
    batch = _Batch(torch.ones(2), torch.zeros(2), locks=locks, meta={"ids": [1, 2], "locks": locks})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        copied = batch_copy(batch)
    assert copied.locks is locks and copied.meta["locks"] is locks
    assert copied.meta is not batch.meta and copied.meta["ids"] is not batch.meta["ids"]


class _Closed(Mapping):
    """A Mapping that is no dict and cannot be read (a closed ``shelve``; an h5py file or zarr group alike)."""

    def __getitem__(self, key):
        raise ValueError("invalid operation on closed shelf")

    def __iter__(self):
        raise ValueError("invalid operation on closed shelf")

    def __len__(self) -> int:
        raise ValueError("invalid operation on closed shelf")


def test_a_mapping_that_is_no_dict_is_shared_unread():
    closed = _Closed()
    batch = _Batch(torch.ones(2), torch.zeros(2), reader=closed)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        copied = batch_copy(batch)
    assert copied is not batch and copied.reader is closed


def test_the_warning_names_the_object_that_refused_on_the_way_to_the_tensors():
    batch, uncopied = (
        _Batch(torch.ones(2), torch.zeros(2), inner=_Refuses(torch.ones(2), torch.zeros(2))),
        set(),
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert batch_copy(batch, "PulseCycle", "the probe's `validation_step`", uncopied) is batch
    (message,) = [str(warning.message) for warning in caught]
    assert message.startswith(
        "PulseCycle: a batch of class `_Batch` could not be copied (`_Refuses`, which it holds on the way to its "
        "tensors: TypeError: cannot pickle '_Refuses' object), so the probe's `validation_step` gets the batch"
    )
    assert "Let `_Refuses` be deep-copied" in message


class _Meta:
    def __init__(self, x, y, meta) -> None:
        self.x, self.y, self.meta = x, y, meta

    def to(self, *args, **kwargs):
        self.x, self.y = self.x.to(*args, **kwargs), self.y.to(*args, **kwargs)
        return self


class _PopsIds(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(8, 3)

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self.net(batch.x), batch.y)

    def validation_step(self, batch, batch_idx):
        ids = batch.meta.pop("ids")  # takes the sample ids off its batch
        self.log("val_loss", F.cross_entropy(self.net(batch.x), batch.y), batch_size=len(ids))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_every_probe_gets_the_metadata_a_validation_step_takes_off_its_batch(tmp_path):
    def collate(items):
        x, y = torch.stack([item["x"] for item in items]), torch.tensor([item["y"] for item in items])
        return _Meta(x, y, {"ids": list(range(len(items)))})

    cycle = PulseCycle(burst=3, replay=0, maintain=1, warmup=0, anneal=0, probe_batches=2)
    probes = _Probes(cycle)
    trainer = pl.Trainer(
        max_steps=16, callbacks=[cycle, probes], default_root_dir=tmp_path, **trainer_kwargs()
    )
    loaders = [
        DataLoader(_Samples(), batch_size=8, shuffle=shuffle, collate_fn=collate) for shuffle in (True, False)
    ]
    trainer.fit(_PopsIds(), *loaders)  # the 2nd probe raised KeyError: 'ids'
    assert len(probes.seen) >= 3 and all("val_loss" in probe for probe in probes.seen)


def test_a_stability_guard_rerun_of_a_batch_that_will_not_copy_says_so_once_naming_the_object(tmp_path):
    def collate(items):
        xs, ys, indices = zip(*items)
        x, y = torch.stack(xs), torch.stack(ys)
        return _Batch(x, y, index=indices[0], inner=_Refuses(x[:1].clone(), y[:1].clone()))

    guard = StabilityGuard(
        warmup=5, window=20, snapshot_every=5, rollback_margin=2, max_snapshots=3, rollback_after=2,
        skip_after_rollback=2,
    )  # fmt: skip
    module = _ScalesItsBatch()
    trainer = pl.Trainer(max_steps=BATCHES, callbacks=[guard], default_root_dir=tmp_path, **trainer_kwargs())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, DataLoader(_Data(), batch_size=16, collate_fn=collate))
    assert len([call for call in module.calls if not call[0]]) >= 2  # re-run more than once
    messages = [str(warning.message) for warning in caught if "could not be copied" in str(warning.message)]
    assert messages == [
        "StabilityGuard: a batch of class `_Batch` could not be copied (`_Refuses`, which it holds on the way to "
        "its tensors: TypeError: cannot pickle '_Refuses' object), so "
        f"{RERUN} gets the batch itself, and an in-place change to its tensors there reaches the batch as "
        "kept. Let `_Refuses` be deep-copied (a `__deepcopy__` that shares what cannot be copied) to have it "
        "copied."
    ]


class _AlignsWords(pl.LightningModule):
    """Reads its validation batch's alignment to the words (``word_ids``, ``token_to_chars``, as NER code
    does), which only a fast tokenizer's ``BatchEncoding`` with its encodings answers."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = nn.Embedding(22, 8), nn.Linear(8, 2)

    def _loss(self, batch):
        logits = self.head(self.emb(batch["input_ids"])).flatten(0, 1)
        return F.cross_entropy(logits, (batch["input_ids"] % 2).flatten())

    def training_step(self, batch, batch_idx):
        return self._loss(batch)

    def validation_step(self, batch, batch_idx):
        words = [word for word in batch.word_ids(0) if word is not None]
        assert batch.n_sequences == 1 and batch.token_to_chars(0, 0).start == 0
        self.log("val_loss", self._loss(batch))
        self.log("words", float(len(words)))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_every_probe_gets_a_fast_tokenizers_batch_encoding_with_its_encodings(tmp_path):
    # found by a sweep (s46, finding 1): the copy rebuilt the BatchEncoding from its entries, without its
    # encodings, so the first probe's `word_ids` raised "not available when using Python based tokenizers"
    tokenizer = fast_tokenizer()
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(2, 6, (64,), generator=g).tolist()
    texts = [" ".join(f"w{int(i)}" for i in torch.randint(0, 20, (n,), generator=g)) for n in lengths]

    def collate(rows):
        return tokenizer(rows, padding=True, return_tensors="pt")

    cycle = PulseCycle(burst=3, replay=0, maintain=1, warmup=0, anneal=0, probe_batches=2)
    probes = _Probes(cycle)
    trainer = pl.Trainer(
        max_steps=12, callbacks=[cycle, probes], default_root_dir=tmp_path, **trainer_kwargs()
    )
    loaders = [
        DataLoader(texts, batch_size=8, shuffle=shuffle, collate_fn=collate) for shuffle in (True, False)
    ]
    trainer.fit(_AlignsWords(), *loaders)
    assert len(probes.seen) >= 2 and all(probe["words"] >= 2 for probe in probes.seen)


class _WithSource(dict):
    pass


class _ListWithSource(list):
    pass


class _TupleWithSource(tuple):
    pass


class _UserDictWithSource(collections.UserDict):
    pass


_Pair = collections.namedtuple("_Pair", "x meta")


@pytest.mark.parametrize(
    "kind",
    [_WithSource, _UserDictWithSource, _ListWithSource, _TupleWithSource, _Pair, collections.OrderedDict],
)
def test_a_container_of_a_class_of_its_own_keeps_its_class_and_attributes(kind):
    x, meta = torch.ones(2), {"ids": [1, 2]}
    if kind in (_WithSource, _UserDictWithSource, collections.OrderedDict):
        batch = kind(x=x, meta=meta)
    else:
        batch = kind(x, meta) if kind is _Pair else kind([x, meta])
    if kind not in (_Pair, collections.OrderedDict):
        batch.source = ["loader"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        copied = batch_copy(batch)
    # of its class, its attributes copied as its entries are (plain data copied)
    assert type(copied) is kind and copied is not batch
    assert getattr(copied, "source", None) == getattr(batch, "source", None)
    if hasattr(batch, "source"):
        assert copied.source is not batch.source
    x_copy, meta_copy = (copied["x"], copied["meta"]) if isinstance(batch, Mapping) else copied
    assert x_copy is not x and torch.equal(x_copy, x) and meta_copy == meta and meta_copy is not meta


class _MaskedDict(dict):
    pass


class _MaskedList(list):
    pass


@pytest.mark.parametrize("kind", [_MaskedDict, _MaskedList])
def test_a_tensor_held_as_an_attribute_of_a_batch_container_is_copied_as_its_entries_are(kind):
    # a review: shared, a mask changed in place by validation_step reached the kept batch, each probe reading
    # the last one's result (1.5, 3.0, 6.0, 12.0 where Lightning's validation read 1.5 each time)
    x = torch.ones(2)
    batch = kind(x=x) if kind is _MaskedDict else kind([x])
    batch.mask = torch.ones(2)
    batch.ids = [1, 2]
    for _ in range(3):
        copied = batch_copy(batch)
        copied.mask.mul_(2)
        copied.ids.append(3)
    assert torch.equal(batch.mask, torch.ones(2)) and batch.ids == [1, 2]
    assert torch.equal(copied.mask, torch.full((2,), 2.0)) and copied.mask is not batch.mask


class _AttrDict(dict):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.__dict__ = self


class _SelfCopyList(list):
    def __copy__(self):
        return self


class _FrozenDict(dict):
    def __setitem__(self, key, value):
        raise TypeError("frozen")


class _EntriesAliased(collections.UserDict):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.store = self.data


def test_batch_classes_that_copy_in_their_own_ways_get_copies_of_their_own():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        attr = batch_copy(_AttrDict(x=torch.ones(2)))
        assert attr.x is attr["x"]  # one storage for both spellings, the copy's
        listed = _SelfCopyList([torch.ones(2), {"ids": [1]}])
        for copy_of in (batch_copy(listed), containers_copied(listed)):
            assert type(copy_of) is _SelfCopyList and copy_of is not listed
            copy_of[1]["ids"].append(2)
            copy_of.pop()
        assert len(listed) == 2 and listed[1] == {"ids": [1]}
        frozen = _FrozenDict(x=torch.ones(2))
        copy_of = batch_copy(frozen)
        assert type(copy_of) is _FrozenDict and copy_of["x"] is not frozen["x"]
        aliased = batch_copy(_EntriesAliased(x=torch.ones(2)))
        assert aliased.store is aliased.data
