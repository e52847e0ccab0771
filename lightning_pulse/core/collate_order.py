"""Whether a DataLoader's collate_fn keeps a batch's samples in the order the sampler drew them.

:class:`~lightning_pulse.core.sample_index.SampleIndexTracker` names the ``k``-th row of a batch by the
``k``-th index the sampler drew for it. A collate_fn that puts the samples in another order (sorted by length,
longest first, for ``pack_padded_sequence(enforce_sorted=True)``) broke that without a sign: a held-out sweep
found 82 of 96 replay scores stored against other samples. :class:`CollateOrderCheck` tells from a
DataLoader's first :data:`PROBED_BATCHES` batches (a reorder from the first batch that shows one):

1. a dict batch that names its samples' dataset indices (a key of
   :data:`~lightning_pulse.core.fault_origin.INDEX_KEYS`) is compared with the drawn indices: exact;
2. otherwise the batch's samples are read from the Dataset once more, in the main process, and collated twice,
   in the drawn order and reversed (:func:`collate_keeps_order`); the torch, numpy and ``random`` generators
   are put back after each call, so the run draws what it drew without the check, and random augmentation in
   the Dataset does not matter (both orders collate the same samples). A collate_fn that keeps the order gives
   the same rows reversed; one that reorders gives the same rows in another order. Anything else (a
   collate_fn drawing random numbers per row: masking, mixup) tells nothing and is never taken for a reorder.

``torch``'s ``default_collate`` and Hugging Face's data collators keep the order: nothing is read for them.

Example::

    check = CollateOrderCheck(loader.dataset, loader.collate_fn)
    for batch_idx, batch in enumerate(loader):
        if check.check(batch, tracker.batch_indices(batch_idx)) is False:
            raise RuntimeError(check.cause)
"""

from __future__ import annotations

import inspect
import random
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import fields, is_dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lightning_pulse.core.fault_origin import INDEX_KEYS

#: the modules whose collate functions keep the samples' order (their batches are never read again)
KEEPS_ORDER_MODULES = ("torch.utils.data.", "transformers.data.data_collator")

#: how many of a DataLoader's first batches of two or more samples are checked (fewer once one reorders, or
#: the Dataset cannot be read in the main process). More than one: a collate_fn sorting by length leaves a
#: batch whose lengths are all equal (truncated to the same maximum) as it came, so one such batch tells
#: nothing
PROBED_BATCHES = 5

#: the way out of a collate_fn that reorders a batch's samples (completes a sentence)
KEEP_THE_DRAWN_ORDER = (
    "keep the samples in the order the collate_fn receives them and pass `enforce_sorted=False` to "
    "`pack_padded_sequence` (or `pack_sequence`; the default is True), which sorts by length inside and "
    "returns its outputs in the batch's order; a sort of your own in training_step works too if the loss is "
    "computed on the rows put back in the batch's order"
)


def known_to_keep_order(collate_fn: Any) -> bool:
    """Whether ``collate_fn`` is one that keeps the samples' order (:data:`KEEPS_ORDER_MODULES`)."""
    function = getattr(collate_fn, "func", collate_fn)
    module = function.__module__ if inspect.isroutine(function) else type(function).__module__
    return isinstance(module, str) and module.startswith(KEEPS_ORDER_MODULES)


class CollateOrderCheck:
    """Whether a DataLoader's ``collate_fn`` keeps each batch's samples in the order drawn (module docstring).

    Args:
        dataset: the DataLoader's dataset (read by index in the main process).
        collate_fn: the DataLoader's ``collate_fn``.

    Attributes:
        keeps_order: ``False`` from the first checked batch whose samples it reorders on; ``True`` once every
            one of the :data:`PROBED_BATCHES` checked batches that told kept them (at once for a collate_fn
            :func:`known_to_keep_order`); else ``None`` (not yet, or never told).
    """

    def __init__(self, dataset: Any, collate_fn: Any) -> None:
        self.dataset = dataset
        self.collate_fn = collate_fn
        known = known_to_keep_order(collate_fn)
        self.keeps_order: bool | None = True if known else None
        self._probes_left = 0 if known else PROBED_BATCHES
        self._kept = 0  # checked batches whose order was kept
        self._checked: Tensor | None = None  # the indices last checked (several callers ask per batch)
        self._told_by = ""  # how a reorder was found, for :attr:`cause`

    def check(self, batch: Any, indices: Tensor) -> bool | None:
        """:attr:`keeps_order`, after checking ``batch`` (as the collate_fn returned it) with its drawn
        dataset ``indices`` ``(B,)`` if it is one of the first :data:`PROBED_BATCHES` of two or more
        samples."""
        if self._probes_left <= 0 or indices is self._checked or indices.numel() < 2:
            return self.keeps_order
        self._checked, self._probes_left = indices, self._probes_left - 1
        verdict = order_from_index_field(batch, indices)
        self._told_by = "its batch's dataset index field names them in another order"
        if verdict is None:
            verdict = self._probe(indices)
            self._told_by = (
                "given a batch's samples reversed, it returned them in another order than reversed, as a "
                "collate_fn that sorts them by length does"
            )
        self._kept += verdict is True
        if verdict is False:
            self.keeps_order, self._probes_left = False, 0
        elif self._probes_left == 0 and self._kept:
            self.keeps_order = True
        return self.keeps_order

    @property
    def cause(self) -> str:
        """Says that the collate_fn reorders a batch's samples and how that was found (once it was)."""
        function = getattr(self.collate_fn, "func", self.collate_fn)  # a functools.partial names its function
        name = getattr(function, "__qualname__", None) or type(function).__name__
        return (
            f"the DataLoader's collate_fn `{name}` puts a batch's samples in another order than the sampler "
            f"drew them ({self._told_by})"
        )

    def _probe(self, indices: Tensor) -> bool | None:
        try:
            with _random_state_kept():
                samples = [self.dataset[int(index)] for index in indices]
            return collate_keeps_order(self.collate_fn, samples)
        except Exception:  # a Dataset set up by worker_init_fn only, say: left untold, and not read again
            self._probes_left = 0
            return None


def order_from_index_field(batch: Any, indices: Tensor) -> bool | None:
    """``True`` when a dict ``batch`` names its samples ``indices`` (``(B,)``) in that order under a key of
    :data:`~lightning_pulse.core.fault_origin.INDEX_KEYS`, ``False`` when it names them in another order,
    ``None`` when it holds no such field (or one that holds other values: not dataset indices)."""
    if not isinstance(batch, Mapping):
        return None
    drawn = indices.detach().cpu().long()
    for key in INDEX_KEYS:
        field = batch.get(key)
        if isinstance(field, Tensor) and field.dim() == 1 and not field.is_floating_point():
            named = field.detach().cpu().long()
            if named.shape == drawn.shape and torch.equal(named.sort().values, drawn.sort().values):
                return torch.equal(named, drawn)
    return None


def collate_keeps_order(collate_fn: Any, samples: Sequence[Any]) -> bool | None:
    """Whether ``collate_fn`` keeps ``samples`` in their order: ``True`` when collating them reversed gives
    the rows reversed, ``False`` when it gives the same rows in another order, else ``None`` (no part holds
    a row per sample, its rows are alike both ways, or the rows differ: a collate_fn drawing random numbers).
    Each call starts from the same random state, which is put back after it."""
    with _random_state_kept():
        forward = collate_fn(list(samples))
    with _random_state_kept():
        backward = collate_fn(list(samples)[::-1])
    return compare_orders(forward, backward, len(samples))


def compare_orders(forward: Any, backward: Any, count: int) -> bool | None:
    """:func:`collate_keeps_order` for the batches ``forward`` and ``backward`` collated from ``count``
    samples in one order and reversed."""
    pairs = _row_pairs(forward, backward, count)
    if not pairs:
        return None
    flip = list(range(count - 1, -1, -1))
    if all(_same(after, _take(before, flip)) for before, after in pairs):
        # the rows reversed: the order kept, unless reversing leaves them as they were (all alike)
        return None if all(_same(before, _take(before, flip)) for before, _ in pairs) else True
    return False if _matching_order(pairs) is not None else None


def _row_pairs(forward: Any, backward: Any, count: int) -> list[tuple[Any, Any]] | None:
    """The parts of the two batches holding a row per sample, rows first, paired (``None`` when the batches
    differ in structure). A ``(T, B)`` tensor counts transposed; an integer ``(B,)`` tensor that numbers the
    rows (``PackedSequence.sorted_indices``: a permutation of ``0..B-1``) says where a row is, not what it
    holds, and does not count; nor do parts of another shape in each batch (the items of a list of
    variable-length sequences, one per sample: the two orders give them in other places)."""
    before, after = list(_parts(forward)), list(_parts(backward))
    if [path for path, _ in before] != [path for path, _ in after]:
        return None
    pairs = []
    for (_, one), (_, other) in zip(before, after):
        if isinstance(one, Tensor) != isinstance(other, Tensor) or _shape(one) != _shape(other):
            continue
        one, other = _rows(one, count), _rows(other, count)
        if one is not None and other is not None and not (_numbers_rows(one) and _numbers_rows(other)):
            pairs.append((one, other))
    return pairs


def _parts(batch: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """``(path, part)`` for the tensors (and numeric numpy arrays) of ``batch`` and its lists of plain
    per-sample values (names, ids)."""
    if isinstance(batch, Tensor):
        yield path, batch
    elif isinstance(batch, np.ndarray) and batch.dtype.kind in "biuf":
        yield path, torch.from_numpy(batch)
    elif isinstance(batch, Mapping):
        for key in batch:
            yield from _parts(batch[key], f"{path}[{key!r}]")
    elif isinstance(batch, (list, tuple)):
        if batch and all(isinstance(item, (str, bytes, int, float)) for item in batch):
            yield path, list(batch)
        else:
            for position, item in enumerate(batch):
                yield from _parts(item, f"{path}[{position}]")
    elif is_dataclass(batch) and not isinstance(batch, type):
        for field in fields(batch):
            yield from _parts(getattr(batch, field.name), f"{path}.{field.name}")


def _shape(part: Any) -> tuple[int, ...]:
    return tuple(part.shape) if isinstance(part, Tensor) else (len(part),)


def _rows(part: Any, count: int) -> Any:
    """``part`` with one row per sample along its first dimension, or ``None``."""
    if isinstance(part, list):
        return part if len(part) == count else None
    if part.dim() >= 1 and part.shape[0] == count:
        return part.detach().cpu()
    if part.dim() >= 2 and part.shape[1] == count:  # time-major (T, B)
        return part.detach().cpu().transpose(0, 1)
    return None


def _numbers_rows(rows: Any) -> bool:
    """Whether ``rows`` is an integer ``(B,)`` tensor holding ``0..B-1`` in some order (row positions)."""
    if (
        not isinstance(rows, Tensor)
        or rows.dim() != 1
        or rows.is_floating_point()
        or rows.dtype == torch.bool
    ):
        return False
    return torch.equal(rows.long().sort().values, torch.arange(len(rows)))


def _take(rows: Any, order: Sequence[int]) -> Any:
    return rows[list(order)] if isinstance(rows, Tensor) else [rows[k] for k in order]


def _same(one: Any, other: Any) -> bool:
    if not isinstance(one, Tensor):
        return one == other
    if one.shape != other.shape or one.dtype != other.dtype:
        return False
    if torch.equal(one, other):
        return True
    return one.is_floating_point() and bool(((one == other) | (one.isnan() & other.isnan())).all())


def _matching_order(pairs: list[tuple[Any, Any]]) -> list[int] | None:
    """An order ``o`` with ``after[k] == before[o[k]]`` for every pair and row, else ``None``: rows are
    matched by a print of each (:func:`_row_prints`), then compared whole."""
    keys_before = list(zip(*(_row_prints(before) for before, _ in pairs)))
    keys_after = list(zip(*(_row_prints(after) for _, after in pairs)))
    unmatched: dict[tuple[Any, ...], list[int]] = defaultdict(list)
    for row, key in enumerate(keys_before):
        unmatched[key].append(row)
    order = []
    for key in keys_after:
        if not unmatched[key]:
            return None
        order.append(unmatched[key].pop(0))
    return order if all(_same(after, _take(before, order)) for before, after in pairs) else None


def _row_prints(rows: Any) -> list[Any]:
    """Per row: the value itself (a plain list), or the shape-free sums ``(sum, weighted sum)`` of a tensor
    row, in float64 and with NaN as 0; equal rows print alike (one computation per row, in the same order)."""
    if not isinstance(rows, Tensor):
        return list(rows)
    flat = torch.nan_to_num(rows.reshape(len(rows), -1).double(), nan=0.0)
    weights = torch.linspace(1.0, 2.0, flat.shape[1], dtype=torch.float64)
    return list(zip(flat.sum(1).tolist(), (flat * weights).sum(1).tolist()))


@contextmanager
def _random_state_kept() -> Iterator[None]:
    """Run the body and put back the torch (CPU and the current CUDA device), numpy and ``random`` states."""
    python_state, numpy_state = random.getstate(), np.random.get_state()
    cuda = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=cuda):
            yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)
