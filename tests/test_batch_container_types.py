"""Batch containers a cut rebuilds (HardSampleReplay's batch mode, StabilityGuard's data check): a
``defaultdict`` (a hand-written collate's), an ``OrderedDict``, a ``BatchEncoding``, a named tuple and
dataclasses with ``init=False`` fields, frozen or not, keep their type and what they hold."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, UserDict, defaultdict, namedtuple

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pulse import HardSampleReplay, PulseCycle, StabilityGuard
from lightning_pulse.core.selection import assign_in_place, cut_refusal, take_samples
from tests.conftest import trainer_kwargs


@dataclasses.dataclass
class _Derived:
    """A batch whose ``size`` ``__post_init__`` derives (``field(init=False)``)."""

    x: torch.Tensor
    y: torch.Tensor
    size: int = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.size = int(self.x.shape[0])


@dataclasses.dataclass(frozen=True)
class _FrozenDerived:
    x: torch.Tensor
    size: int = dataclasses.field(init=False)
    mask: torch.Tensor | None = dataclasses.field(init=False, default=None)  # set after construction

    def __post_init__(self) -> None:
        object.__setattr__(self, "size", int(self.x.shape[0]))


@dataclasses.dataclass
class _Checked:
    """A batch whose ``__post_init__`` refuses any size but 4: rebuilt as a copy with its fields set."""

    x: torch.Tensor

    def __post_init__(self) -> None:
        if self.x.shape[0] != 4:
            raise ValueError("4 rows expected")


def test_take_samples_keeps_a_defaultdicts_factory_and_an_ordered_dicts_type_and_order():
    batch = defaultdict(list, x=torch.arange(4.0), y=torch.arange(4))
    cut = take_samples(batch, torch.tensor([3, 1]), 4)
    assert type(cut) is defaultdict and cut.default_factory is list
    assert cut["x"].tolist() == [3.0, 1.0] and cut["y"].tolist() == [3, 1] and cut["missing"] == []
    assert batch["x"].tolist() == [0.0, 1.0, 2.0, 3.0] and "missing" not in batch  # the batch is left alone
    assign_in_place(batch, cut)
    assert batch["x"].tolist() == [3.0, 1.0]

    ordered = OrderedDict([("y", torch.arange(4)), ("x", torch.arange(4.0))])
    cut = take_samples(ordered, torch.tensor([0, 2]), 4)
    assert type(cut) is OrderedDict and list(cut) == ["y", "x"] and cut["x"].tolist() == [0.0, 2.0]

    class Tagged(UserDict):
        def __init__(self, data, tag):  # a constructor of its own: not called by the cut
            super().__init__(data)
            self.tag = tag

    tagged = Tagged({"x": torch.arange(4.0)}, tag="train")
    cut = take_samples(tagged, torch.tensor([1]), 4)
    assert type(cut) is Tagged and cut.tag == "train" and cut["x"].tolist() == [1.0]
    assert tagged["x"].shape == (4,)


def test_take_samples_keeps_a_list_or_tuple_subclasss_attributes():
    # the cut rebuilt a list or tuple subclass from its items: what it carried beside them was dropped
    class TaggedList(list):
        pass

    class TaggedTuple(tuple):
        __slots__ = ()  # no __dict__: nothing to keep, and nothing to fail on

    class SourcedTuple(tuple):
        pass

    for batch in (
        TaggedList([torch.arange(4.0), torch.arange(4)]),
        SourcedTuple((torch.arange(4.0), torch.arange(4))),
    ):
        batch.source = "shard-3"
        cut = take_samples(batch, torch.tensor([3, 1]), 4)
        assert type(cut) is type(batch) and cut.source == "shard-3"
        assert cut[0].tolist() == [3.0, 1.0] and cut[1].tolist() == [3, 1] and batch[0].shape == (4,)
    slotted = take_samples(TaggedTuple((torch.arange(4.0),)), torch.tensor([2]), 4)
    assert type(slotted) is TaggedTuple and slotted[0].tolist() == [2.0]


def test_take_samples_cuts_a_batch_encodings_per_sample_encodings_with_its_rows():
    from transformers import BatchEncoding

    encoding = BatchEncoding(
        {"input_ids": torch.arange(8).view(4, 2)}, encoding=["e0", "e1", "e2", "e3"], n_sequences=1
    )
    cut = take_samples(encoding, torch.tensor([2, 0]), 4)
    assert type(cut) is BatchEncoding and cut["input_ids"].tolist() == [[4, 5], [0, 1]]
    assert cut._encodings == ["e2", "e0"] and encoding._encodings == ["e0", "e1", "e2", "e3"]


def test_take_samples_rebuilds_named_tuples_and_dataclasses_with_init_false_fields():
    Pair = namedtuple("Pair", "x y")
    cut = take_samples(Pair(torch.arange(4.0), torch.arange(4)), torch.tensor([1, 2]), 4)
    assert type(cut) is Pair and cut.x.tolist() == [1.0, 2.0]

    batch = _Derived(torch.arange(8.0).view(4, 2), torch.arange(4))
    cut = take_samples(batch, torch.tensor([3, 1, 0]), 4)
    assert type(cut) is _Derived and cut.size == 3 and cut.y.tolist() == [3, 1, 0]  # derived anew
    assert batch.size == 4
    assign_in_place(batch, cut)
    assert batch.size == 3 and batch.x.shape == (3, 2)

    frozen = _FrozenDerived(torch.arange(4.0))
    object.__setattr__(frozen, "mask", torch.tensor([True, False, True, True]))
    cut = take_samples(frozen, torch.tensor([1, 2]), 4)
    assert type(cut) is _FrozenDerived and cut.size == 2
    assert cut.mask.tolist() == [False, True]  # an init=False field set after construction is cut, not reset

    checked = _Checked(torch.arange(4.0))
    cut = take_samples(checked, torch.tensor([0, 3]), 4)  # its __post_init__ refuses 2 rows: a copy instead
    assert type(cut) is _Checked and cut.x.tolist() == [0.0, 3.0] and checked.x.shape == (4,)


# ------------------------------------------------------------------------------------------ through a fit
def _dataclass_collate(items):
    return _Derived(torch.stack([x for x, _ in items]), torch.stack([y for _, y in items]))


def _defaultdict_collate(items):  # the classic hand-written collate
    lists = defaultdict(list)
    for x, y in items:
        lists["x"].append(x)
        lists["y"].append(y)
    return defaultdict(list, x=torch.stack(lists["x"]), y=torch.stack(lists["y"]))


def _dict_collate(items):
    return {"x": torch.stack([x for x, _ in items]), "y": torch.stack([y for _, y in items])}


COLLATES = {"dataclass": _dataclass_collate, "defaultdict": _defaultdict_collate}


class _Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(8, 1)
        self.sizes: list[int] = []

    def training_step(self, batch, batch_idx):
        if isinstance(batch, dict):
            x, y = batch["x"], batch["y"]
        else:
            x, y = batch.x, batch.y
            assert batch.size == x.shape[0]  # the derived field follows the cut
        self.sizes.append(int(x.shape[0]))
        return F.mse_loss(self.net(x).squeeze(1), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _data(nan_row: int | None = None) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=generator)
    if nan_row is not None:
        x[nan_row] = float("nan")
    return TensorDataset(x, torch.randn(64, generator=generator))


def _fit(tmp_path, collate, callbacks, nan_row=None):
    model = _Regression()
    trainer = pl.Trainer(
        **trainer_kwargs(max_epochs=2, callbacks=callbacks, default_root_dir=tmp_path, deterministic=True)
    )
    trainer.fit(model, DataLoader(_data(nan_row), batch_size=8, collate_fn=collate))
    return trainer, model


def _replay_callbacks():
    cycle = PulseCycle(burst=2, replay=3, maintain=1, warmup=0, anneal=0, maintain_eval="none")
    return [cycle, HardSampleReplay(mode="batch")]


@pytest.mark.parametrize("kind", sorted(COLLATES))
def test_hard_sample_replay_batch_mode_cuts_dataclass_and_defaultdict_batches_as_dicts(tmp_path, kind):
    # held-out sweep: the first cut (step 8 of 16) raised TypeError (defaultdict) or ValueError
    # (dataclasses.replace of an init=False field)
    assert cut_refusal(COLLATES[kind]([(torch.zeros(8), torch.zeros(())) for _ in range(4)]), 4) is None
    trainer, model = _fit(tmp_path / "a", COLLATES[kind], _replay_callbacks())
    reference_trainer, reference = _fit(tmp_path / "b", _dict_collate, _replay_callbacks())
    assert trainer.global_step == reference_trainer.global_step == 16
    assert model.sizes == reference.sizes and min(model.sizes) < 8  # cut batches trained
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        assert torch.equal(mine, theirs)


@pytest.mark.parametrize("kind", sorted(COLLATES))
def test_stability_guard_checks_a_nan_dataclass_or_defaultdict_batch_as_a_dict_one(tmp_path, kind):
    # held-out sweep: the data check of the NaN batch (at step 5) crashed the fit the guard should save
    def guard():
        return [StabilityGuard(warmup=3, window=5, snapshot_every=4, rollback_margin=4)]

    trainer, model = _fit(tmp_path / "a", COLLATES[kind], guard(), nan_row=42)
    reference_trainer, reference = _fit(tmp_path / "b", _dict_collate, guard(), nan_row=42)
    assert trainer.global_step == reference_trainer.global_step
    mine, theirs = trainer.callbacks[0], reference_trainer.callbacks[0]
    figures = {key: value for key, value in mine.metrics().items() if "energy" not in key}
    assert figures == {key: value for key, value in theirs.metrics().items() if "energy" not in key}
    assert figures["stability/steps_skipped"] >= 1  # the NaN batch's step, skipped as the dict batch's
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.equal(a, b) and torch.isfinite(a).all()


@dataclasses.dataclass
class _PaddedRows:
    """Fields ``__post_init__`` derives from the whole batch: a count that may fall to its default, and an
    order and weights of the rows."""

    lengths: torch.Tensor
    n_empty: int = dataclasses.field(init=False, default=0)
    order: torch.Tensor = dataclasses.field(init=False)
    weights: torch.Tensor = dataclasses.field(init=False)

    def __post_init__(self):
        self.n_empty = int((self.lengths == 0).sum())
        self.order = self.lengths.argsort()
        self.weights = self.lengths / self.lengths.sum()


def test_take_samples_keeps_what_post_init_derives_from_the_kept_rows():
    # a review: the cut set a derived field back from the full batch where its recomputed value equalled the
    # field's default (n_empty 1 for rows without an empty one: a loss divided by B - n_empty, scaled by 4/3)
    # or where the cut changed it (an order of 4 rows for 2: [2, 3]; weights summing to 0.706)
    batch = _PaddedRows(torch.tensor([3.0, 0.0, 5.0, 7.0]))
    cut = take_samples(batch, torch.tensor([2, 3]), 4)
    assert cut.n_empty == 0
    assert cut.order.tolist() == [0, 1]
    assert torch.allclose(cut.weights, torch.tensor([5 / 12, 7 / 12]))
    assert batch.n_empty == 1 and batch.order.tolist() == [1, 0, 2, 3]  # the original unchanged
