"""The copy a probe or a StabilityGuard re-run gets of a kept batch (:func:`lightning_pulse.probe.batch_copy`)
copies only the objects on the paths to the batch's tensors, and the plain data they hold, and shares every
other one (:mod:`tests.test_probe_batch_copy_plain_data`: the plain data).

Found by a sweep (s45, problem 2): the copy deep-copied every object a batch class reached besides its
tensors. A batch holding a lock, an open file or a database reader raised ``TypeError: cannot pickle
'_thread.lock' object``: StabilityGuard then blamed "re-running training_step", counted its rollback test as
inconclusive and rolled back 1 time where the same run without the handle found a data fault and rolled
back 0 times; a PulseCycle probe crashed the fit. A batch referring to its dataset had the dataset cloned for
every probe batch (an 80 MB table: 52-100 ms a batch)."""

from __future__ import annotations

import threading
import warnings

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_pulse import PulseCycle, StabilityGuard
from lightning_pulse.probe import batch_copy
from tests.conftest import trainer_kwargs
from tests.test_probe_kept_batches import _InPlaceBox, _Probes, _Samples
from tests.test_stability_guard_batch_class_reruns import BATCHES, _Data, _ScalesItsBatch


class _Reader:
    """A handle that cannot be deep-copied (a lock; an open file, an lmdb or h5py reader alike)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()


class _Table(Dataset):
    """A dataset the batch refers back to, holding its data as one tensor."""

    def __init__(self) -> None:
        self.table = torch.arange(12.0).view(4, 3)

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.table[index]


class _Batch:
    def __init__(self, x: torch.Tensor, y: torch.Tensor, **others) -> None:
        self.x, self.y = x, y
        self.__dict__.update(others)

    def to(self, *args, **kwargs):
        self.x, self.y = self.x.to(*args, **kwargs), self.y.to(*args, **kwargs)
        return self


def test_a_copy_shares_what_leads_to_no_tensor_and_copies_the_paths_to_the_tensors():
    reader, table = _Reader(), _Table()
    plain = {"rows": np.zeros((4, 3)), "names": ["a", "b"], "reader": reader}
    inner = _Batch(torch.ones(2), torch.zeros(2), reader=reader)
    batch = _Batch(torch.ones(2, 3), torch.zeros(2), inner=inner, source=table, meta=plain, handle=reader)

    copied = batch_copy(batch)

    assert copied is not batch and copied.inner is not inner  # on the paths to tensors: copied
    copied.x.mul_(3.0)
    copied.inner.x.mul_(3.0)
    assert batch.x.sum() == 6 and inner.x.sum() == 2  # the kept batch unchanged
    # the handle (three times: its lock), the dataset and its table: shared, not copied
    assert copied.handle is reader and copied.inner.reader is reader and copied.meta["reader"] is reader
    assert copied.source is table and copied.source.table is table.table
    # a mapping of no tensor, plain data: copied, so a step's in-place change to it stays in the copy
    assert copied.meta is not plain and copied.meta["rows"] is not plain["rows"]
    assert copied.meta["names"] == ["a", "b"] and copied.meta["names"] is not plain["names"]


class _Refuses(_Batch):
    """A batch class that refuses to be copied, its tensors beside (a reader's ``__getstate__`` that raises)."""

    def __reduce_ex__(self, protocol):
        raise TypeError("cannot pickle '_Refuses' object")


def test_a_batch_that_cannot_be_copied_is_used_as_it_is_said_once_naming_its_class():
    batch, uncopied = _Refuses(torch.ones(2), torch.zeros(2)), set()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            assert batch_copy([batch], "PulseCycle", "the probe's `validation_step`", uncopied)[0] is batch
    messages = [str(warning.message) for warning in caught]
    assert len(messages) == 1, messages
    assert messages[0].startswith("PulseCycle: a batch of class `_Refuses` could not be copied (TypeError")
    assert "training_step" not in messages[0] and "__deepcopy__" in messages[0]


def test_a_stability_guard_rerun_of_a_batch_holding_a_handle_finds_the_data_fault(tmp_path):
    """As the same run without the handle: the poisoned batches are the data's, skipped, 0 rollbacks."""

    def collate(items):
        xs, ys, indices = zip(*items)
        return _Batch(torch.stack(xs), torch.stack(ys), index=indices[0], reader=_Reader())

    guard = StabilityGuard(
        warmup=5, window=20, snapshot_every=5, rollback_margin=2, max_snapshots=3, rollback_after=2,
        skip_after_rollback=2,
    )  # fmt: skip
    trainer = pl.Trainer(max_steps=BATCHES, callbacks=[guard], default_root_dir=tmp_path, **trainer_kwargs())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(_ScalesItsBatch(), DataLoader(_Data(), batch_size=16, collate_fn=collate))
    failed = [str(warning.message) for warning in caught if "could not be copied" in str(warning.message)]
    failed += [
        str(warning.message) for warning in caught if "re-running training_step" in str(warning.message)
    ]
    assert not failed
    assert guard.events and guard.recurring_spikes >= 1
    assert guard.rollbacks == 0 and not guard.stopped


def test_every_probe_runs_on_a_copy_of_a_batch_class_holding_a_handle(tmp_path):
    reader = _Reader()

    def collate(items: list[dict]) -> _Batch:
        x, y = torch.stack([item["x"] for item in items]), torch.tensor([item["y"] for item in items])
        return _Batch(x, y, reader=reader)

    cycle = PulseCycle(burst=3, replay=0, maintain=1, warmup=0, anneal=0, probe_batches=2)
    probes = _Probes(cycle)
    trainer = pl.Trainer(
        max_steps=16, callbacks=[cycle, probes], default_root_dir=tmp_path, **trainer_kwargs()
    )
    loaders = [
        DataLoader(_Samples(), batch_size=8, shuffle=shuffle, collate_fn=collate) for shuffle in (True, False)
    ]
    trainer.fit(_InPlaceBox("step"), *loaders)  # its validation_step scales batch.x in place
    means = [probe["x_mean"] for probe in probes.seen]
    assert len(means) >= 3
    assert means == pytest.approx([0.919] * len(means), abs=5e-4)
