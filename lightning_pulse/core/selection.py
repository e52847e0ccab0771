"""Selection rules over per-sample scores, and applying a selection to a batch in place.

Rules take the (stale, age-weighted) scores of the candidate samples, ``NaN`` for a sample never scored,
and return a :class:`Selection`: which candidates to train on and, for InfoBatch, the loss weights that
keep the gradient unbiased. A never-scored sample is always kept, even beyond the requested count: until
it has been seen once, nothing says it is easy (so the first epoch of a run trains on everything).

* :func:`select_topk`: the ``count`` highest scores.
* :func:`infobatch_prune`: InfoBatch (Qin et al. 2024): drop each below-threshold sample with probability
  ``prune_ratio``, weight the kept below-threshold ones by ``1 / (1 - prune_ratio)``.
* :func:`select_random`: a uniform subset of the scored samples; the control that shows whether scores matter.

The batch helpers (:func:`take_samples`, :func:`assign_in_place`) work on any nesting of lists, tuples,
named tuples, dicts and dataclasses. A *per-sample leaf* is a tensor whose first dimension is the batch size
``B`` (or a list of ``B`` strings, or below the top level a list or tuple of ``B`` alike items not all of which
are per-sample themselves, as ``zip(*items)`` makes); every other leaf is shared by the whole batch and kept.
:func:`whole_parts` notes those a full batch held with another first dimension or length than ``B``, so that
:func:`take_samples` keeps them whole also at a batch of their size (an epoch's short last batch).
:func:`cut_refusal` says when a cut would go wrong: a batch that cannot change in place (a
per-sample tuple held by a tuple included), one with no per-sample leaf, or one holding a tensor with ``B``
second and another length first (time-major). :func:`concatenated_parts` finds what a cut would leave whole
next to the kept samples' lengths or offsets: the samples' variable-length items concatenated (CTC's 1-D
targets, ``nn.EmbeddingBag``'s input, packed tokens next to their ``cu_seqlens``, graphs' nodes next to their
node-to-graph vector, a VLM's image patches next to each image's grid); :func:`joined_rows` the tensors whose
first dimension is not ``B``, for a caller that refuses one whose first dimension changes from batch to batch
with nothing beside it that says how it splits (:func:`joined_rows_refusal`); :func:`square_parts` the tensors
whose first two dimensions are both ``B`` (either layout), for a caller that refuses a later batch holding
``(T, B)`` there (:func:`time_major_later_refusal`); :class:`PairwiseWatch` those of them that are per-sample
pairwise ``(B, B)`` tensors (a same-label mask), which a cut would keep whole along the second dimension.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import numbers
from collections import UserDict, UserList
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.nn.utils.rnn import PackedSequence

RULES = ("topk", "infobatch", "random")


@dataclass(frozen=True)
class Selection:
    """The outcome of a rule.

    Attributes:
        positions: ``(k,)`` int64 positions into the candidates, ascending (batch order is kept).
        weights: ``(k,)`` float32 loss weights, or ``None`` when the kept samples count equally.
        threshold: the score that separated kept from dropped (``NaN`` where the rule has none).
    """

    positions: Tensor
    weights: Tensor | None
    threshold: float

    @property
    def count(self) -> int:
        return int(self.positions.numel())


# The rules run on a few hundred numbers per step, where NumPy's per-call cost is a small fraction of
# torch's; they take and return tensors, and draw their randomness from a torch.Generator.
def _as_numpy(scores: Tensor | np.ndarray) -> np.ndarray:
    if isinstance(scores, torch.Tensor):
        if scores.dtype == torch.float32 and scores.is_cpu and not scores.requires_grad:
            return scores.numpy()  # the common case, without three no-op conversions
        return scores.detach().cpu().float().numpy()
    return np.asarray(scores, dtype=np.float32)


def _check_count(count: int, available: int) -> int:
    if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 0:
        raise ValueError(f"`count`={count!r} must be a non-negative int.")
    return min(int(count), available)


def _selection(positions: np.ndarray, weights: np.ndarray | None, threshold: float) -> Selection:
    order = np.argsort(positions, kind="stable")
    return Selection(
        torch.from_numpy(positions[order].astype(np.int64)),
        None if weights is None else torch.from_numpy(weights[order].astype(np.float32)),
        threshold,
    )


def select_topk(scores: Tensor | np.ndarray, count: int) -> Selection:
    """Keep the ``count`` highest scores; never-scored samples are always kept (even beyond ``count``).

    Ties go to the earlier position.

    Args:
        scores: ``(n,)`` scores, ``NaN`` for never scored.
        count: how many to keep.
    """
    values = _as_numpy(scores)
    count = _check_count(count, values.size)
    unseen = np.isnan(values)
    seen = np.flatnonzero(~unseen)
    remaining = max(0, count - (values.size - seen.size))
    order = seen[np.argsort(-values[seen], kind="stable")[:remaining]]
    threshold = float(values[order[-1]]) if remaining else math.nan
    keep = unseen.copy()
    keep[order] = True
    # a mask read in order gives the positions ascending, as :func:`_selection` would sort them
    return Selection(torch.from_numpy(np.flatnonzero(keep).astype(np.int64, copy=False)), None, threshold)


def infobatch_prune(
    scores: Tensor | np.ndarray,
    threshold: float,
    prune_ratio: float,
    generator: torch.Generator | None = None,
) -> Selection:
    """InfoBatch's soft pruning of one batch, with weights that keep the mean loss unbiased.

    Each sample with a score below ``threshold`` is dropped with probability ``prune_ratio``; the others
    (and never-scored samples) are kept. A kept sample ``i`` was kept with probability ``q_i`` (1, or
    ``1 - prune_ratio``), so weighting its loss by ``1 / q_i`` makes the sum over the kept samples an
    unbiased estimate of the sum over the whole batch. The weights returned also carry the factor ``k / n``
    (kept over offered), so the module's ordinary *mean* over the ``k`` kept samples estimates the mean over
    all ``n`` without bias, step by step; the number of steps per epoch does not change. A *sum* over the kept
    samples needs that factor taken out again (``weights * n / k``, as
    :class:`~lightning_pulse.core.per_sample_loss.LossCapture` does for a ``reduction="sum"`` loss).

    Args:
        scores: ``(n,)`` scores, ``NaN`` for never scored.
        threshold: InfoBatch uses the mean score over the dataset.
        prune_ratio: ``r`` in ``[0, 1)``.
    """
    if not 0.0 <= prune_ratio < 1.0:
        raise ValueError(f"`prune_ratio`={prune_ratio!r} must be in [0, 1).")
    values = _as_numpy(scores)
    n = values.size
    with np.errstate(invalid="ignore"):
        below = ~np.isnan(values) & (values < threshold)
    draws = torch.rand(n, generator=generator, dtype=torch.float64).numpy()
    positions = np.flatnonzero(~(below & (draws < prune_ratio)))
    if positions.size == 0:  # keep at least one sample: an empty batch has no mean
        positions = np.zeros(1, dtype=np.int64)
    keep_probability = np.where(below[positions], 1.0 - prune_ratio, 1.0)
    weights = (1.0 / keep_probability) * (positions.size / n)
    return _selection(positions, weights, float(threshold))


def select_random(
    scores: Tensor | np.ndarray, count: int, generator: torch.Generator | None = None
) -> Selection:
    """The control: never-scored samples, then a uniform random subset of the rest, ``count`` in all.

    It spends exactly what :func:`select_topk` spends, so comparing the two shows what the scores add.
    """
    values = _as_numpy(scores)
    count = _check_count(count, values.size)
    unseen = np.isnan(values)
    seen = np.flatnonzero(~unseen)
    remaining = max(0, count - (values.size - seen.size))
    chosen = seen[torch.randperm(seen.size, generator=generator)[:remaining].numpy()]
    return _selection(np.concatenate([np.flatnonzero(unseen), chosen]), None, math.nan)


# ---------------------------------------------------------------------- batches
def _is_string_list(value: Any, batch_size: int) -> bool:
    return isinstance(value, list) and len(value) == batch_size and all(isinstance(v, str) for v in value)


def _is_per_sample(value: Any, batch_size: int, nested: bool = True) -> bool:
    """A tensor whose first dimension is the batch's, a list of ``B`` strings, or, below the top level, a list
    or tuple of one item per sample (:func:`_is_per_sample_sequence`). The top-level list or tuple is the
    batch's own container (``[x, y]``), whatever its length."""
    if isinstance(value, torch.Tensor):
        return value.dim() >= 1 and value.shape[0] == batch_size
    if _is_string_list(value, batch_size):
        return True
    return nested and _is_per_sample_sequence(value, batch_size)


def _is_per_sample_sequence(value: Any, batch_size: int) -> bool:
    """A list or plain tuple of ``B`` alike items (:func:`_alike`) not all of which are per-sample themselves:
    what a collate_fn makes of the samples' target dicts (detection), names, ids or variable-length sequences
    (one of which may be ``B`` long by chance), by ``zip(*items)`` or a list. A named tuple, a list or tuple
    whose every part holds ``B`` rows (``[y1, y2]`` of a multi-task target, as ``default_collate`` makes of a
    sample's ``(y1, y2)``, on a short last batch of 2), or one of unlike parts that happens to be ``B`` long
    (``(y, class_w, count)``: a ``(B,)`` and a ``(K,)`` tensor and a 0-dim one, on a short last batch of 3), is
    a structure whose parts are cut one by one."""
    return (
        (type(value) is tuple or isinstance(value, list))
        and len(value) == batch_size
        and not _all_present_per_sample(value, batch_size)
        and _alike(value)
    )


def _all_present_per_sample(items: list[Any] | tuple[Any, ...], batch_size: int) -> bool:
    """Every item but ``None`` holds ``B`` rows (``(ids, None)``: a structure with an optional part)."""
    present = [item for item in items if item is not None]
    return bool(present) and all(_is_per_sample(item, batch_size) for item in present)


def _alike(items: list[Any] | tuple[Any, ...]) -> bool:
    """Whether ``items`` could be one field of several samples: one Python type (numbers count as one: an id
    list ``[1, 1.5, 2]``) and, for tensors, one dtype and number of dimensions (the lengths may differ:
    variable-length sequences). Mappings may differ in their keys (a detection target with an optional
    ``iscrowd``). ``None`` goes with anything (an optional field some samples lack), and so does an empty tensor
    among tensors (the boxes of an image with none, often ``torch.tensor([])``)."""
    present = [item for item in items if item is not None]
    if isinstance(present[0] if present else None, torch.Tensor):
        present = [item for item in present if not (isinstance(item, torch.Tensor) and item.numel() == 0)]
    if not present:
        return True
    first = present[0]
    if all(isinstance(item, numbers.Number) and not isinstance(item, torch.Tensor) for item in present):
        return True
    if not all(type(item) is type(first) for item in present):
        return False
    if isinstance(first, torch.Tensor):
        return all(item.dim() == first.dim() and item.dtype == first.dtype for item in present)
    return True  # mappings: a detection target may carry optional keys


def _rebuild(container: Any, items: list[Any]) -> Any:
    if isinstance(container, tuple) and hasattr(container, "_fields"):  # named tuple
        return type(container)(*items)
    return type(container)(items)


def _is_dataclass_batch(value: Any) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


#: what a batch's containers hold that is no container: kept as it is, never walked into
_LEAVES = (Tensor, str, bytes, int, float, type(None))


def entries_replaced(container: Any, replace: Callable[[Any], Any]) -> Any:
    """A copy of ``container`` (a dict, list or tuple, a ``UserDict`` or ``UserList``, or a subclass of one)
    with each entry (a mapping's values) ``replace``d, of its class and with its instance attributes: a batch
    class built on a container carries what its entries do not (a Hugging Face ``BatchEncoding`` its
    fast-tokenizer encodings, which ``word_ids()`` reads; built again from its entries it lost them). A mutable
    one is copied shallowly (``copy.copy``: its class, its attributes, storage of its own) and its entries are
    set in the copy; a tuple, which cannot change, is built again from its entries (a named tuple's field by
    field) and given the original's attributes.

    Raises:
        Exception: what the class raises: a ``copy.copy`` it refuses, a constructor that takes no items.
    """
    if isinstance(container, tuple):
        rebuilt = _rebuild(container, [replace(item) for item in container])
        if getattr(container, "__dict__", None):  # a subclass's attributes (a named tuple has none)
            rebuilt.__dict__.update(container.__dict__)
        return rebuilt
    copied = copy.copy(container)
    if copied is container:  # a __copy__ that returns the object itself: entries set here would reach it
        raise TypeError(f"copy.copy of a {type(container).__qualname__} returns the object itself")
    entries = copied.data if isinstance(copied, (UserDict, UserList)) else copied
    for key, value in list(entries.items() if isinstance(entries, Mapping) else enumerate(entries)):
        entries[key] = replace(value)
    return copied


def rebuilt(container: Any, replace: Callable[[Any], Any]) -> Any:
    """``container`` built again from its ``replace``d entries, of its class, without its instance attributes:
    the way out where :func:`entries_replaced` is refused (a ``__copy__`` returning the object itself, a
    read-only mapping whose ``__setitem__`` raises)."""
    if isinstance(container, Mapping):
        return type(container)({key: replace(value) for key, value in container.items()})
    return _rebuild(container, [replace(item) for item in container])


def containers_copied(batch: Any) -> Any:
    """``batch`` with each container in it copied (dicts and other mutable mappings, lists, dataclasses, the
    tuples that hold one of these) and everything else shared, tensors included: what a ``training_step`` that
    pops or rebinds entries (``batch.pop("labels")``) leaves as it received it, for microseconds a batch and
    no tensor data. A list or tuple of over 8 items whose first item is no container is taken as one of leaves
    (per-sample strings or tensors), as one of 8 or fewer that holds none: a list is copied, a tuple kept,
    neither walked. An object of another kind (a graph batch, a read-only mapping, a mapping other than a dict
    or ``UserDict``, whose storage a shallow copy may share) is the same object.

    Raises:
        Exception: what copying a mapping or dataclass of the user's own raises (``copy.copy``).
    """
    if isinstance(batch, _LEAVES):
        return batch
    if type(batch) is dict:  # the common batch, also Hugging Face's collators' (a dict of tensors)
        return {key: v if isinstance(v, _LEAVES) else containers_copied(v) for key, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        # a short one is a batch's parts, each looked at; a long one holds per-sample items, alike
        if all(isinstance(item, _LEAVES) for item in (batch if len(batch) <= 8 else batch[:1])):
            return batch if isinstance(batch, tuple) else copy.copy(batch)  # a tuple of leaves cannot change
        if type(batch) in (list, tuple):
            return type(batch)([containers_copied(item) for item in batch])
        try:
            return entries_replaced(batch, containers_copied)  # a subclass's attributes kept
        except Exception:  # a class that will not be copied shallowly: built again, as before
            return rebuilt(batch, containers_copied)
    # a dict subclass holds its entries, a UserDict (a BatchEncoding, which keeps its encodings) its .data,
    # which copy.copy copies; another mapping may keep them in an attribute the copy would share: by reference
    if isinstance(batch, (dict, UserDict)):
        copied = copy.copy(batch)
        if copied is batch:  # a __copy__ that returns the object itself: built again from its entries
            return rebuilt(batch, containers_copied)
        entries = copied.data if isinstance(copied, UserDict) else copied  # BatchEncoding.items() costs 1 µs
        for key, value in entries.items():
            if not isinstance(value, _LEAVES):
                entries[key] = containers_copied(value)
        return copied
    if _is_dataclass_batch(batch):
        copied = copy.copy(batch)
        for field in dataclasses.fields(batch):
            if not isinstance(value := getattr(batch, field.name), _LEAVES):
                object.__setattr__(copied, field.name, containers_copied(value))  # a frozen one too
        return copied
    return batch


def take_samples(
    batch: Any,
    positions: Tensor,
    batch_size: int,
    nested: bool = False,
    whole: Mapping[str, tuple[Any, ...]] | None = None,
    where: str = "batch",
) -> Any:
    """A new batch of the same structure holding only the samples at ``positions`` (in that order).

    ``whole``: the parts a full batch showed are no samples' (:func:`whole_parts`), kept whole here when they
    have the same shape, whatever ``batch_size`` (a ``(10,)`` class-weight vector on a last batch of 10)."""
    if _is_per_sample(batch, batch_size, nested) and not (whole and whole.get(where) == _size_of(batch)):
        if isinstance(batch, torch.Tensor):
            if batch.is_sparse:  # no indexing by a tensor there, only index_select
                return batch.index_select(0, positions.to(batch.device))
            return batch[positions.to(batch.device)]
        kept = [batch[int(i)] for i in positions]
        return tuple(kept) if isinstance(batch, tuple) else kept
    if isinstance(batch, (Mapping, list, tuple)) or _is_dataclass_batch(batch):
        parts = [
            take_samples(value, positions, batch_size, True, whole, where + key)
            for key, value in _parts(batch)
        ]
        if type(batch) is dict:  # the common batch: as cheap as it gets
            return dict(zip(batch.keys(), parts))
        if isinstance(batch, Mapping):
            return _rebuilt_mapping(batch, parts, positions, batch_size)
        if type(batch) in (list, tuple) or (isinstance(batch, tuple) and hasattr(batch, "_fields")):
            return _rebuild(batch, parts)
        if isinstance(batch, (list, tuple)):  # a subclass: its instance attributes kept, as a dict subclass's
            cut = iter(parts)
            try:
                return entries_replaced(batch, lambda _: next(cut))
            except Exception:  # a class that will not be copied shallowly: built again from its parts
                return _rebuild(batch, parts)
        return _rebuilt_dataclass(batch, parts)
    return batch


def _rebuilt_mapping(batch: Mapping[Any, Any], parts: list[Any], positions: Tensor, batch_size: int) -> Any:
    """``batch`` (a mapping other than a plain dict) holding ``parts``: a dict subclass or ``UserDict`` copied
    (``copy.copy``: a ``defaultdict`` keeps its ``default_factory``, an ``OrderedDict`` its order, a Hugging
    Face ``BatchEncoding`` its attributes, its per-sample ``encodings`` cut too) and its entries set; another
    mapping built by its constructor from a dict, as before."""
    if not isinstance(batch, (dict, UserDict)):
        return type(batch)(dict(zip(batch.keys(), parts)))  # type: ignore[call-arg]
    copied = copy.copy(batch)
    entries = copied.data if isinstance(copied, UserDict) else copied
    for key, part in zip(list(batch.keys()), parts):
        entries[key] = part
    encodings = getattr(copied, "_encodings", None)  # a BatchEncoding's: one per sample
    if isinstance(encodings, list) and len(encodings) == batch_size:
        copied._encodings = [encodings[int(i)] for i in positions]  # type: ignore[union-attr]
    return copied


def _rebuilt_dataclass(batch: Any, parts: list[Any]) -> Any:
    """``batch`` (a dataclass, frozen too) holding ``parts``, one per field: made anew from its ``init``
    fields (``dataclasses.replace``, so that ``__post_init__`` derives its ``init=False`` fields, a ``size``,
    a mask, an order of the rows, from the cut parts). An ``init=False`` field that ``__post_init__`` does not
    derive (the whole batch made anew from its own ``init`` fields gives another value: set after
    construction, by a collate) is set from ``parts``. Where making it anew fails (a ``__post_init__`` that
    checks a size, an ``__init__`` of the class's own), a copy with every field set from ``parts``."""
    fields = dataclasses.fields(batch)
    try:
        new = dataclasses.replace(batch, **{f.name: part for f, part in zip(fields, parts) if f.init})
    except Exception:  # its own __init__/__post_init__ refused the cut batch: the fields as they were cut
        new = copy.copy(batch)
        for f, part in zip(fields, parts):
            object.__setattr__(new, f.name, part)
        return new
    late = [(f, part) for f, part in zip(fields, parts) if not f.init]
    if not late:
        return new
    # which init=False fields __post_init__ derives: the batch made anew from its own init fields gives them
    # back (kept as derived from the cut); any other was set after construction: the cut's (a frozen one too)
    again = dataclasses.replace(batch) if hasattr(type(batch), "__post_init__") else None
    for f, part in late:
        derived = again is not None and _same(getattr(again, f.name, _UNSET), getattr(batch, f.name, _UNSET))
        if not derived or not hasattr(new, f.name):
            object.__setattr__(new, f.name, part)
    return new


_UNSET = object()


def _same(a: Any, b: Any) -> bool:
    """Whether two field values are equal (tensors by shape and values; what fails to compare: no)."""
    if a is b:
        return True
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return (
            isinstance(a, Tensor) and isinstance(b, Tensor) and a.shape == b.shape and bool(torch.equal(a, b))
        )
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:
        return False


def _size_of(value: Any) -> tuple[Any, ...] | None:
    """What tells a part is the one a full batch held: a tensor's shape, a list's or tuple's length."""
    if isinstance(value, torch.Tensor):
        return tuple(value.shape)
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, len(value))
    return None


def _leading_size(value: Any) -> int | None:
    if isinstance(value, torch.Tensor):
        return int(value.shape[0]) if value.dim() >= 1 else None
    return len(value) if isinstance(value, (list, tuple)) else None


def whole_parts(
    batch: Any, batch_size: int, nested: bool = False, where: str = "batch"
) -> dict[str, tuple[Any, ...]]:
    """The parts of a (full) batch of ``batch_size`` samples that :func:`take_samples` keeps whole and whose
    first dimension or length is not ``batch_size``, by where they are, with their sizes: a per-batch constant
    (a ``(K,)`` class-weight vector, a list of ``K`` class names). A per-sample part has the batch's size at
    every batch, so one of another size at a full batch is none; passed to :func:`take_samples`, it stays
    whole at a batch whose size happens to be its own (an epoch's short last batch of ``K``)."""
    if _is_per_sample(batch, batch_size, nested):
        return {}
    found: dict[str, tuple[Any, ...]] = {}
    size = _size_of(batch)
    if nested and size is not None and _leading_size(batch) not in (None, batch_size):
        found[where] = size
    if isinstance(batch, (Mapping, list, tuple)) or _is_dataclass_batch(batch):
        for key, value in _parts(batch):
            found.update(whole_parts(value, batch_size, True, where + key))
    return found


def _contents(batch: Any) -> Any:
    if isinstance(batch, Mapping):
        return batch.values()
    if isinstance(batch, (list, tuple)):
        return batch
    return [getattr(batch, field.name) for field in dataclasses.fields(batch)]


def _leaves(batch: Any, batch_size: int, nested: bool = False) -> Iterator[tuple[Any, bool]]:
    """Each leaf :func:`take_samples` reaches in ``batch``, with whether it cuts it (a per-sample leaf)."""
    if _is_per_sample(batch, batch_size, nested):
        yield batch, True
    elif isinstance(batch, (Mapping, list, tuple)) or _is_dataclass_batch(batch):
        for value in _contents(batch):
            yield from _leaves(value, batch_size, True)
    else:
        yield batch, False


def holds_item_per_sample(batch: Any, batch_size: int) -> bool:
    """Whether ``batch`` holds a per-sample leaf that is not a tensor: a list of ``B`` strings, or below the
    top level a list or tuple of ``B`` alike items (torchvision's detection collate ``tuple(zip(*items))``
    makes ``B`` images of ``(C, H, W)`` and ``B`` target dicts), so it holds a row per index whatever its
    tensors' first dimensions."""
    return any(per_sample and not isinstance(leaf, Tensor) for leaf, per_sample in _leaves(batch, batch_size))


def _looks_time_major(value: Any, batch_size: int) -> bool:
    """A tensor with ``B`` second and something else first: ``(T, B)`` or ``(T, B, F)``, as a time-major
    collate pads (``pad_sequence(batch_first=False)``). ``(B, ...)`` with ``B`` elsewhere too is batch-first
    (an image whose channels or height equal ``B``) and is cut along its first dimension; a leading 1 is a
    broadcast dimension (per-batch statistics ``(1, C, 1, 1)``, a class-weight row ``(1, K)``), not time."""
    return (
        isinstance(value, torch.Tensor)
        and value.dim() >= 2
        and value.shape[0] not in (batch_size, 1)
        and value.shape[1] == batch_size
    )


def _shapes(tensors: list[Tensor]) -> str:
    return ", ".join(str(tuple(t.shape)) for t in tensors)


def cut_refusal(batch: Any, batch_size: int, nested: bool = False) -> str | None:
    """Why :func:`assign_in_place` could not cut ``batch`` to some of its samples (``None``: it can), found
    without changing it; a reason completes "HardSampleReplay ...".

    Refused: a batch that cannot change in place; one with no per-sample leaf (no tensor of first dimension
    ``B``, no list of ``B`` items), so a cut would leave it whole; one holding a tensor with ``B`` second and
    neither ``B`` nor 1 first (time-major, ``(T, B)``), which a cut along the first dimension would cut along
    time. Other leaves (a 0-dim count, a ``(num_classes,)`` weight vector) are the whole batch's and kept.
    ``batch_size`` is ``B``, the number of dataset indices the sampler gave the batch.
    """
    if (reason := _immutable_refusal(batch, batch_size, nested)) is not None:
        return reason
    if batch_size < 2:  # a batch of one is never cut (core.replay.MIN_COMPOSED): nothing to misread
        return None
    leaves = list(_leaves(batch, batch_size, nested))
    time_major = [leaf for leaf, _ in leaves if _looks_time_major(leaf, batch_size)]
    if time_major:
        return _time_major_reason(time_major, batch_size)
    if not any(per_sample for _, per_sample in leaves):
        tensors = [leaf for leaf, _ in leaves if isinstance(leaf, torch.Tensor)]
        held = f"tensors of shape {_shapes(tensors)}" if tensors else "no tensor"
        return (
            f"cannot cut a batch of {batch_size} samples in mode='batch': it holds no per-sample part (a "
            f"tensor whose first dimension is {batch_size}, or a list of {batch_size} items), only {held}, "
            "so a cut would leave it whole. Use mode='steps', which chooses the samples at the sampler, "
            "before they are loaded, or a batch-first collate."
        )
    return None


def _time_major_reason(tensors: list[Tensor], batch_size: int, before: str = "") -> str:
    """Why a cut of a batch holding the time-major ``tensors`` is refused; ``before`` says what an earlier
    batch held there."""
    return (
        f"cannot cut a batch of {batch_size} samples in mode='batch': it holds tensors of shape "
        f"{_shapes(tensors)}, {batch_size} along the second dimension and not the first{before}: time-major "
        "(as pad_sequence(batch_first=False) pads), which a cut along the first dimension would cut "
        "along time, or a per-batch table with one column per sample, which it cannot tell apart. Use "
        "mode='steps', which chooses the samples at the sampler, before they are loaded, or a "
        "batch-first collate (pad_sequence(..., batch_first=True))."
    )


def square_parts(batch: Any, batch_size: int) -> dict[str, tuple[int, ...]]:
    """The shapes of the tensors of two or more dimensions in ``batch`` whose first two dimensions are both
    ``B``, by where they are: batch-first ``(B, L)`` whose padded length ``L`` is ``B`` by chance, or
    time-major ``(T, B)`` whose ``T`` is, which :func:`cut_refusal` cannot tell apart. A later batch shows
    which (:func:`time_major_later_refusal`)."""
    return {
        where: tuple(t.shape)
        for where, t in _parts_with_paths(batch, batch_size)
        if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[0] == t.shape[1] == batch_size
    }


def time_major_later_refusal(square: dict[str, tuple[int, ...]], batch: Any, batch_size: int) -> str | None:
    """The reason, after the callback's name, for refusing to cut a later batch whose tensor at one of the
    places ``square`` (:func:`square_parts` of the first batch) now has ``B`` second and another length first:
    time-major. Only those places are read, so a per-batch constant elsewhere whose width matches a short last
    batch's size (a ``(2, 3)`` table next to 3 samples) never refuses a run mid-way; none is read when
    ``square`` is empty (one walk over the batch's tensors otherwise)."""
    if not square:
        return None
    parts = list(_parts_with_paths(batch, batch_size))
    shown = {where: t for where, t in parts if where in square and _looks_time_major(t, batch_size)}
    # a batch that lost rows (a collate_fn dropped a sample: (7, 8) batch-first tokens for 8 indices) holds no
    # tensor of B rows, and is not cut; a time-major one holds its (B,) labels or (B, T) mask next to (T, B)
    if not shown or not any(isinstance(t, Tensor) and t.dim() and t.shape[0] == batch_size for _, t in parts):
        return None
    before = "; ".join(f"{where} was {square[where]}" for where in shown)
    before = f" ({before} at the fit's first batch, which told neither layout)"
    return _time_major_reason(list(shown.values()), batch_size, before)


def _is_square(value: Any, batch_size: int) -> bool:
    return (
        isinstance(value, torch.Tensor)
        and value.dim() >= 2
        and value.shape[0] == value.shape[1] == batch_size
    )


def _pairwise_reason(shown: dict[str, str], batch_size: int) -> str:
    """Why a cut of a batch holding the per-sample pairwise tensors ``shown`` (where: what showed it) is
    refused."""
    found = "; ".join(f"{where} {why}" for where, why in shown.items())
    return (
        f"cannot cut a batch of {batch_size} samples in mode='batch': it holds a per-sample pairwise "
        f"(B, B) tensor, one row and one column per sample (a same-label mask, a similarity or distance "
        f"matrix): {found}. A cut keeps only its rows (to (k, {batch_size}) next to k kept samples), and "
        "nothing says that its second dimension is the samples too (a (B, F) feature or token tensor whose "
        "F equals B would be cut wrongly along both). Use mode='steps', which chooses the samples at the "
        "sampler, before the collate_fn builds the pairwise tensor for them, or compute the pairwise "
        "tensor in training_step from the batch's per-sample parts (e.g. "
        "`same = labels[:, None] == labels[None, :]`). A (B, C) one-hot target with C == B whose batches "
        "each hold every class once, in order, reads as one too (an identity matrix): pass class indices "
        "instead, or use mode='steps'."
    )


def pairwise_elsewhere_reason(ranks: list[int], world_size: int, batch_size: int) -> str:
    """Why a rank whose own batch showed no per-sample pairwise tensor refuses with the ranks ``ranks``
    (of ``world_size``) whose batches did, so that every rank refuses alike before a collective."""
    on = f"rank{'s' * (len(ranks) > 1)} {', '.join(map(str, ranks))} of {world_size}"
    return _pairwise_reason(
        {
            f"on {on}": "(named there), where this rank's batch did not show it (its values may have been "
            "constant, e.g. every sample of one label), so every rank refuses alike"
        },
        batch_size,
    )


class PairwiseWatch:
    """Finds, before a batch-mode cut, a per-sample pairwise ``(B, B)`` tensor that a cut along the first
    dimension would keep whole along its second (``(k, B)`` next to ``k`` samples).

    A tensor with ``B`` along both first dimensions at the fit's first checked batch (:func:`square_parts`)
    may be batch-first ``(B, F)`` whose ``F`` is ``B`` (features, tokens padded to a length), time-major, or
    pairwise. It is watched while it stays ``(b, b)`` at every batch of ``b`` samples (a batch-first one of
    another length leaves). It is pairwise, and refused, when

    * it was ``(b, b)`` at batches of two sizes (an epoch's short last batch), and relation-like (symmetric in
      its first two dimensions with one value along its diagonal, not constant) at one of the batches whose
      values were read: the fit's first two, and the first batch of each new size (so a mask constant at the
      first two batches, every sample of one label, is found at the short last batch when it varies there).
      The shape alone says nothing: tokens padded to the longest of their batch are ``(4, 4)`` in a batch of
      4 and ``(2, 2)`` in one of 2 by chance (a sweep: such a run was refused mid-run). An asymmetric
      pairwise tensor is so not detected; or
    * it was symmetric in its first two dimensions with one value along its diagonal at every batch read,
      and not constant at one of them, at the fit's second batch or at the first cut, whichever comes first
      (a same-label mask, a similarity matrix; a feature or token tensor is so by no chance, an all-ones
      padding mask of a full-length batch is constant, one of a batch sorted by length has 1 and 0 along
      its diagonal; two batches, because one-hot labels of 3 classes in batches of 3 are, 1 time in 27).
      Values are read only for such tensors and only at those two batches and at the first batch of each
      new size while watched: up to three device syncs per tensor at each (its symmetry, its diagonal,
      whether it is constant; a sparse one is made dense). A ``(B, C)`` one-hot target with ``C == B``
      whose batches each hold every class once, in order, is an identity matrix at both and refused too.

    Each rank decides from its own batch; under data parallelism the caller votes on :meth:`refusal`
    (:class:`~lightning_pulse.core.replay_batch.ReplayBatchLifecycle`), so that every rank refuses or none
    does.

    A square tensor that is neither (an asymmetric pairwise tensor) is cut along its first dimension.
    """

    def __init__(self, batch: Any, batch_size: int) -> None:
        square = {where: t for where, t in _parts_with_paths(batch, batch_size) if _is_square(t, batch_size)}
        # the batch sizes at which each watched place was (b, b), at every batch read so far
        self.sizes: dict[str, set[int]] = {where: {batch_size} for where in square}
        self.first_shapes = {where: tuple(t.shape) for where, t in square.items()}
        self._symmetric = {where for where, t in square.items() if _is_relation_like(t)}
        self._varied = {where for where in self._symmetric if not _is_constant(square[where])}
        # relation-like and not constant at some batch whose values were read: what makes a (b, b) shape at
        # batches of two sizes evidence (the shape alone matches tokens padded to a length that equals b)
        self._related = set(self._varied)
        self._batches_read = 1
        self._values_read = False  # the fit's second batch or first cut has been read for symmetry

    @property
    def values_pending(self) -> bool:
        """Whether a later batch's values may still make :meth:`refusal` refuse (not only its shape)."""
        return not self._values_read and bool(self._symmetric)

    @property
    def watching(self) -> bool:
        """Whether some tensor is still watched for its shape (a batch of a new size may refuse)."""
        return bool(self.sizes)

    def refusal(self, batch: Any, batch_size: int, cut: bool, first: bool = False) -> str | None:
        """The reason, after the callback's name, for refusing to cut ``batch`` (``cut``: the plan cuts it;
        ``first``: the batch the watch was made from), or ``None``. A batch that lost rows (a collate_fn
        dropped a sample) holds no tensor of ``B`` rows, is not cut, and is not read."""
        if not self.sizes or batch_size < 2:
            return None
        held: dict[str, Any] = {}
        if not first:
            parts = list(_parts_with_paths(batch, batch_size))
            if not any(isinstance(t, Tensor) and t.dim() and t.shape[0] == batch_size for _, t in parts):
                return None
            held = {where: t for where, t in parts if where in self.sizes}
            for where in list(self.sizes):
                tensor = held.get(where)
                if not _is_square(tensor, batch_size):
                    del self.sizes[where]
                    self._symmetric.discard(where)
                    continue
                new_size = batch_size not in self.sizes[where]
                self.sizes[where].add(batch_size)
                if where in self._symmetric:
                    if not _is_relation_like(tensor):
                        self._symmetric.discard(where)
                    elif not _is_constant(tensor):
                        self._varied.add(where)
                        self._related.add(where)
                elif new_size and where not in self._related and _is_related(tensor):
                    self._related.add(where)
            self._batches_read += 1
        followed = {
            where: f"was {self.first_shapes[where]} at the fit's first batch and is "
            f"{tuple(held[where].shape)} at this batch of {batch_size}, symmetric in its first two "
            "dimensions with one value along its diagonal and not constant at a batch whose values were "
            "read: its second dimension follows the number of samples"
            for where, sizes in self.sizes.items()
            if len(sizes) >= 2 and where in self._related
        }
        if followed:
            return _pairwise_reason(followed, batch_size)
        if not self._values_read and (cut or self._batches_read >= 2):
            read = "first batch" if self._batches_read == 1 else "first two batches"
            symmetric = {
                where: f"{self.first_shapes[where]} is symmetric in its first two dimensions with one value "
                f"along its diagonal, and not constant, at the fit's {read}"
                for where in self._symmetric & self._varied
                if where in self.sizes
            }
            # read once: a pairwise tensor constant on both batches (one label each) is missed, as documented
            self._values_read = True
            self._symmetric.clear()
            if symmetric:
                return _pairwise_reason(symmetric, batch_size)
        return None


def _is_relation_like(tensor: Tensor) -> bool:
    """``(b, b, ...)`` symmetric in the first two dimensions with one value along the diagonal, as a relation
    between the samples is (a same-label mask's 1s, a distance matrix's 0s). A padding mask of a batch sorted
    by length can be symmetric (lengths 3, 2, 1 padded to 3), but its diagonal then holds both 1 and 0."""
    if tensor.shape[0] < 3:  # a batch of 2 is never cut to fewer (core.replay.MIN_COMPOSED): nothing to tell
        return False
    tensor = _dense(tensor)
    diagonal = tensor.diagonal(dim1=0, dim2=1)
    return bool(torch.equal(tensor, tensor.transpose(0, 1))) and _is_constant(diagonal)


def _is_related(tensor: Tensor) -> bool:
    return _is_relation_like(tensor) and not _is_constant(tensor)


def _is_constant(tensor: Tensor) -> bool:
    tensor = _dense(tensor)
    return tensor.numel() == 0 or bool((tensor == tensor.reshape(-1)[0]).all())


def _dense(tensor: Tensor) -> Tensor:
    """``tensor`` with values to compare: a sparse one (a pairwise mask the collate_fn built sparse) has no
    ``torch.equal`` or ``diagonal``; read at two batches only, so made dense there."""
    return tensor if tensor.layout == torch.strided else tensor.to_dense()


def _parts_with_paths(
    batch: Any, batch_size: int, where: str = "batch", nested: bool = False
) -> Iterator[tuple[str, Tensor | list[int] | tuple[int, ...]]]:
    """Each tensor :func:`take_samples` reaches in ``batch``, and each per-sample list or tuple of ints (CTC's
    ``target_lengths`` may be one), with how to reach it (``batch['targets']``), but for the items of other
    per-sample lists and the parts of a ``PackedSequence`` (its ``batch_sizes`` count steps, not items)."""
    if isinstance(batch, torch.Tensor):
        yield where, batch
    elif isinstance(batch, PackedSequence):
        return
    elif _is_per_sample(batch, batch_size, nested):
        if _is_int_sequence(batch):
            yield where, batch
    elif isinstance(batch, (Mapping, list, tuple)) or _is_dataclass_batch(batch):
        for key, value in _parts(batch):
            yield from _parts_with_paths(value, batch_size, where + key, True)


def _is_int_sequence(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and all(
        isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in value
    )


def _is_int_tensor(tensor: Tensor) -> bool:
    dtype = tensor.dtype
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


#: the most columns a ``(B, k)`` integer tensor may have to be read as each sample's item count, the
#: product of its row (Qwen2-VL's ``image_grid_thw``, ``(B, 3)``: an image's patches are ``t * h * w``); a
# wider one is a
#: padded sequence, not a size
MAX_SIZE_COLUMNS = 4


def _item_counts(
    part: Tensor | list[int] | tuple[int, ...], batch_size: int
) -> tuple[str, tuple[int, ...]] | None:
    """Each sample's item count if ``part`` gives one non-negative integer per sample, with how it is read:
    a ``(B,)`` tensor, a list or tuple of ``B`` ints (``"the sum of"``), or a ``(B, k)`` integer tensor of at
    most :data:`MAX_SIZE_COLUMNS` columns, each row a sample's sizes whose product is its count (``"the sum
    of the row products of"``); else ``None``."""
    if isinstance(part, torch.Tensor):
        if part.dim() not in (1, 2) or part.shape[0] != batch_size or not _is_int_tensor(part):
            return None
        if part.dim() == 2 and not 1 <= part.shape[1] <= MAX_SIZE_COLUMNS:
            return None
        if not bool((part >= 0).all()):
            return None
        if part.dim() == 1:
            return "the sum of", tuple(int(n) for n in part.tolist())
        return "the sum of the row products of", tuple(int(n) for n in part.prod(dim=1).tolist())
    if len(part) != batch_size or min(part) < 0:
        return None
    return "the sum of", tuple(int(n) for n in part)


def _padded_sizes(tensors: list[Tensor], batch_size: int) -> set[int]:
    """The sizes of the dimensions after the first of the batch's per-sample tensors (a padded length ``L``
    of ``(B, L)`` token ids): a tensor of two or more dimensions whose first is one of them may be the whole
    batch's, sized by the padding (a shared ``(L, L)`` attention mask, an ``(L, D)`` position table)."""
    return {size for t in tensors if t.dim() >= 2 and t.shape[0] == batch_size for size in t.shape[1:]}


def _is_cumulative(tensor: Tensor, size: int) -> bool:
    """A ``(size,)`` integer tensor that starts at 0 and never decreases."""
    return (
        tensor.shape == (size,)
        and _is_int_tensor(tensor)
        and int(tensor[0]) == 0
        and bool((tensor[1:] >= tensor[:-1]).all())
    )


def _sample_id_counts(tensor: Tensor, batch_size: int) -> tuple[int, ...] | None:
    """For a 1-D integer tensor that never decreases and holds each of ``0 .. B-1`` (a row-to-sample vector:
    PyTorch Geometric's node-to-graph ``batch``), the rows of each sample (its bincount); else ``None``.
    Sorted ids with a gap, or not starting at 0, are no such vector."""
    if not _is_int_tensor(tensor) or int(tensor[0]) != 0 or int(tensor[-1]) != batch_size - 1:
        return None
    steps = tensor[1:] - tensor[:-1]
    if not bool(((steps == 0) | (steps == 1)).all()):
        return None
    return tuple(int(n) for n in torch.bincount(tensor, minlength=batch_size).tolist())


def concatenated_parts(batch: Any, batch_size: int, with_items: bool = False) -> dict[tuple[str, str], Any]:
    """The tensors of ``batch`` whose first dimension is longer than ``B`` and that a part of ``batch`` splits
    along it into the samples' items, as ``{(where, how it is split): length}``: the samples' variable-length
    items joined (``torch.cat``), as a collate_fn makes ``nn.CTCLoss``'s 1-D ``targets`` next to their
    ``target_lengths``, ``nn.EmbeddingBag``'s 1-D input next to its ``offsets``, packed tokens next to their
    ``cu_seqlens`` (PyTorch Geometric's node-to-graph vector next to its ``ptr``), or a vision-language
    model's image patches, ``(sum of patches, D)``, next to each image's patch grid (Qwen2-VL's
    ``pixel_values`` and ``image_grid_thw``). Split by

    * lengths: ``B`` non-negative ints (a ``(B,)`` tensor, a list or tuple) that sum to its length, or a
      ``(B, k)`` non-negative integer tensor of a few columns (:data:`MAX_SIZE_COLUMNS`) whose row products
      do (a grid ``t, h, w`` per sample);
    * offsets: a ``(B,)`` integer tensor from 0, never decreasing, each value below its length;
    * cumulative lengths: a ``(B + 1,)`` integer tensor from 0, never decreasing, ending at its length;
    * itself (1-D only): an integer tensor that never decreases and holds each sample id ``0 .. B-1`` (a
      row-to-sample vector, PyTorch Geometric's bare node-to-graph ``batch``; what it indexes, ``(N, F)``
      node features, is joined alike).

    A cut along the first dimension keeps such a tensor whole (it is not ``B`` long) next to the kept samples'
    lengths or offsets. A per-batch constant (a ``(K,)`` class-weight vector, a ``(K, D)`` codebook) matches
    only when some ``(B,)`` integers (labels) happen to sum to ``K`` or to be sorted from 0, so a caller
    confirms a match on a second batch. A tensor of two or more dimensions whose first is also a later
    dimension of a per-sample tensor (``(L, L)`` next to ``(B, L)`` token ids) is left out: it may be the
    batch's own, sized by the padding.

    ``with_items``: each value is ``(length, the samples' item lengths)`` instead, for a caller that tells a
    concatenation (its items change from batch to batch, or are all as long) from a constant that matches on
    every batch (sorted labels from 0 next to a ``(K,)`` position vector).

    Costs a few reductions per ``(B,)``, ``(B, k)`` or ``(B + 1,)`` integer tensor (device syncs on an
    accelerator) when a tensor whose first dimension is longer than ``B`` is held, nothing otherwise.
    """
    parts = list(_parts_with_paths(batch, batch_size))
    padded = _padded_sizes([t for _, t in parts if isinstance(t, torch.Tensor)], batch_size)
    joined = [
        (where, t)
        for where, t in parts
        if isinstance(t, torch.Tensor)
        and t.dim() >= 1
        and t.shape[0] > batch_size
        and (t.dim() == 1 or t.shape[0] not in padded)
    ]
    if not joined:
        return {}
    flat = [(where, int(t.shape[0])) for where, t in joined]
    found: dict[tuple[str, str], Any] = {}
    for where, tensor in joined:
        # a vector that splits itself: each row's sample id, 0 to B - 1 in order (PyTorch Geometric's bare
        # node-to-graph `batch` vector, with no `ptr` or `num_nodes` beside it)
        lengths = _sample_id_counts(tensor, batch_size) if tensor.dim() == 1 else None
        if lengths is not None:
            how = f"its values the sample ids 0 to {batch_size - 1} in order, a row-to-sample vector"
            found[(where, how)] = (int(tensor.shape[0]), lengths) if with_items else int(tensor.shape[0])
    for split, part in parts:
        counts = _item_counts(part, batch_size)
        matches: list[tuple[str, str, int, tuple[int, ...]]] = []
        if counts is not None:
            how, items = counts
            total = sum(items)
            matches += [(where, f"{how} {split}", n, items) for where, n in flat if n == total]
        if isinstance(part, torch.Tensor) and part.dim() == 1:
            # offsets end above 0 (labels of one class, all 0, are no offsets)
            if counts is not None and sum(counts[1]) > 0 and _is_cumulative(part, batch_size):
                last = int(part[-1])
                matches += [
                    (where, f"split at the offsets {split}", n, _item_lengths(part, n, True))
                    for where, n in flat
                    if n > last
                ]
            if _is_cumulative(part, batch_size + 1):
                last = int(part[-1])
                matches += [
                    (where, f"split by the cumulative lengths {split}", n, _item_lengths(part, n, False))
                    for where, n in flat
                    if n == last
                ]
        for where, how, n, items in matches:
            found[(where, how)] = (n, items) if with_items else n
    return found


def _item_lengths(bounds: Tensor, length: int, offsets: bool) -> tuple[int, ...]:
    """The samples' item lengths that a concatenation of ``length`` items split at ``bounds`` implies:
    ``(B,)`` offsets (the last item runs to ``length``) or ``(B + 1,)`` cumulative lengths."""
    values = tuple(int(v) for v in bounds.tolist())
    ends = (*values, length) if offsets else values
    return tuple(end - start for start, end in zip(ends, ends[1:]))


def concatenation_refusal(found: dict[tuple[str, str], int], batch_size: int) -> str | None:
    """The reason, after the callback's name, for refusing to cut a batch holding the concatenations ``found``
    (:func:`concatenated_parts`); ``None`` if none."""
    if not found:
        return None
    parts = "; ".join(f"{where} ({length} items, {split})" for (where, split), length in found.items())
    return (
        f"cannot cut a batch of {batch_size} samples in mode='batch': it holds {parts}: the samples' "
        "variable-length items concatenated, it seems (as torch.cat(targets) for nn.CTCLoss makes, or "
        "torch.cat(texts) next to nn.EmbeddingBag's offsets, or graphs joined as PyTorch Geometric joins "
        "them: node rows next to a node-to-graph vector, or images of several sizes joined as Qwen2-VL's "
        "processor joins them: patch rows next to each image's patch grid), which a cut along the first "
        "dimension would keep whole next to the kept samples' lengths or offsets, so these would index "
        "other samples' items (or fail on a size). Use mode='steps', which chooses the samples at the "
        "sampler, before they are loaded, or pad them to a (B, S) tensor (nn.CTCLoss takes padded targets, "
        "nn.EmbeddingBag a padding_idx). "
        "A per-batch constant as long (a class-weight vector) can be held by the module instead of the batch."
    )


def joined_rows(batch: Any, batch_size: int) -> dict[str, tuple[int, ...]]:
    """The shapes of the tensors of two or more dimensions in ``batch`` whose first dimension is neither
    ``B``, nor 1 (a broadcast one), nor a later dimension of a per-sample tensor (a padded length), by where
    they are (``batch['pixel_values']``): what a cut along the first dimension keeps whole. One whose first
    dimension changes from one batch to the next (:func:`joined_rows_refusal`) holds rows of the samples
    joined, with nothing beside it that says how they split (image patches of several sizes with a grid of one
    row per image, not per sample; a graph's nodes; a detection batch's boxes with an image-index column); one
    that keeps its shape is a constant (a codebook)."""
    tensors = [(where, t) for where, t in _parts_with_paths(batch, batch_size) if isinstance(t, torch.Tensor)]
    padded = _padded_sizes([t for _, t in tensors], batch_size)
    return {
        where: tuple(t.shape)
        for where, t in tensors
        if t.dim() >= 2 and t.shape[0] not in (batch_size, 1) and t.shape[0] not in padded
    }


def joined_rows_refusal(
    before: dict[str, tuple[int, ...]], now: dict[str, tuple[int, ...]], batch_size: int
) -> str | None:
    """The reason, after the callback's name, for refusing to cut a batch whose :func:`joined_rows` ``now``
    hold a tensor whose first dimension was another in the batch ``before`` (another full one); ``None`` if
    none."""
    changed = {
        where: shape for where, shape in now.items() if where in before and before[where][0] != shape[0]
    }
    if not changed:
        return None
    held = "; ".join(
        f"{where} of shape {shape} (before: {before[where]})" for where, shape in changed.items()
    )
    return (
        f"cannot cut a batch of {batch_size} samples in mode='batch': it holds {held}, whose first dimension "
        f"is not the batch's {batch_size} samples and changes from batch to batch: the samples' rows joined "
        "along it, it seems (image patches of several sizes, as Qwen2-VL's processor joins them; a graph's "
        "nodes; a detection batch's boxes with an image-index column), which a cut along the first dimension "
        "would keep whole next to the kept samples, so the model would read other samples' rows (or fail on "
        "a size). Use mode='steps', which chooses the samples at the sampler, before they are loaded, or "
        "pad them to a (B, ...) tensor. A tensor the whole batch shares whose size changes (negatives drawn "
        "per batch) can be made in training_step instead."
    )


def _parts(batch: Any) -> list[tuple[str, Any]]:
    """``(how to reach it, part)`` for each part of a container batch, e.g. ``("[3]", names)``."""
    if isinstance(batch, Mapping):
        return [(f"[{key!r}]", value) for key, value in batch.items()]
    if isinstance(batch, (list, tuple)):
        return [(f"[{i}]", value) for i, value in enumerate(batch)]
    return [(f".{field.name}", getattr(batch, field.name)) for field in dataclasses.fields(batch)]


def _immutable_refusal(
    batch: Any, batch_size: int, nested: bool = False, where: str = "batch", replaced: bool = False
) -> str | None:
    """:func:`cut_refusal`'s reason for a part that cannot change in place. ``replaced``: ``batch`` is (in) a
    tuple that a dict, list or mutable dataclass holds, which assign_in_place replaces whole, rebuilt."""
    if isinstance(batch, torch.Tensor) or _is_per_sample(batch, batch_size, nested):
        return None
    if isinstance(batch, (dict, MutableMapping, list)) or (
        _is_dataclass_batch(batch) and not type(batch).__dataclass_params__.frozen  # type: ignore[attr-defined]
    ):
        # a part here, a per-sample tuple or a tuple holding one included, is replaced by assignment
        return next(
            (
                reason
                for key, value in _parts(batch)
                if (reason := _immutable_refusal(value, batch_size, True, where + key, True)) is not None
            ),
            None,
        )
    if isinstance(batch, tuple):
        for key, value in _parts(batch):
            if not replaced and type(value) is tuple and _is_per_sample_sequence(value, batch_size):
                # only a tensor can change in place (Tensor.set_): the tuple would keep all B items
                return (
                    f"cannot cut a batch of {batch_size} samples in mode='batch': its part {where + key} "
                    f"is a tuple of {batch_size} per-sample items (as zip(*items) in a collate_fn makes) "
                    "held by a tuple, which cannot change in place (Lightning ignores what "
                    "on_train_batch_start returns), so it would keep every sample's item next to the kept "
                    "samples. Make it a list (e.g. list(names) in the collate_fn) or the batch a list or "
                    "dict, or use mode='steps', which chooses the samples at the sampler, before they are "
                    "loaded."
                )
            if isinstance(value, (torch.Tensor, list, tuple, Mapping)) or _is_dataclass_batch(value):
                if (reason := _immutable_refusal(value, batch_size, True, where + key, replaced)) is not None:
                    return reason
        return None
    # a read-only mapping, a frozen dataclass, or an object of its own (a graph batch) at the top
    if isinstance(batch, Mapping) or _is_dataclass_batch(batch) or not nested:
        return (
            f"cannot cut a batch of type {type(batch).__name__} in mode='batch': it cannot be changed in place "
            "(Lightning ignores what on_train_batch_start returns). Use mode='steps', which chooses the samples "
            "at the sampler, before they are loaded, or a dict, list or tuple batch."
        )
    return None


def assign_in_place(batch: Any, new: Any) -> None:
    """Make ``batch`` hold ``new``'s contents without replacing the ``batch`` object itself.

    Lists and dicts get new elements; a tensor held by a tuple is re-pointed at the new data with
    ``Tensor.set_`` (same Python object, new storage and shape). That is how a callback changes what
    ``training_step`` receives: Lightning ignores what ``on_train_batch_start`` returns, so a batch that cannot
    be changed in place cannot be selected from.

    Raises:
        TypeError: if ``batch`` (or a part of it that changed) is immutable and not a tensor.
    """
    if isinstance(batch, torch.Tensor):
        with torch.no_grad():
            batch.set_(new)
        return
    if isinstance(batch, (dict, MutableMapping)):  # a Hugging Face BatchEncoding is a UserDict
        for key in list(batch):
            batch[key] = new[key]
        return
    if _is_dataclass_batch(batch) and not type(batch).__dataclass_params__.frozen:  # type: ignore[attr-defined]
        for field in dataclasses.fields(batch):
            setattr(batch, field.name, getattr(new, field.name))
        return
    if isinstance(batch, list):
        batch[:] = list(new)
        return
    if isinstance(batch, tuple):
        if len(batch) != len(new):  # a per-sample tuple: zip would re-point its first items at others' data
            raise TypeError(
                f"Cannot cut a tuple of {len(batch)} per-sample items held by a tuple batch in place; use a "
                "list."
            )
        for old, value in zip(batch, new):
            if old is value:
                continue
            if isinstance(old, (torch.Tensor, list, tuple, Mapping)):
                assign_in_place(old, value)
            elif old != value:
                raise TypeError(
                    f"Cannot change a {type(old).__name__} held by a tuple batch in place; use a list or dict batch "
                    "(default_collate makes lists), or a tuple of tensors."
                )
        return
    if isinstance(batch, Mapping):
        raise TypeError(
            f"Cannot change a read-only mapping batch ({type(batch).__name__}) in place; use a dict."
        )
    raise TypeError(
        f"Cannot change a batch of type {type(batch).__name__} in place; use a list or dict batch "
        "(default_collate makes lists), or a tuple of tensors."
    )
