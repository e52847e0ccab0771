"""How many samples and tokens a batch holds, for energy per sample and per token.

* Samples: dimension 0 of the first tensor of rank >= 1 found in the batch (depth first through mappings,
  lists, tuples and dataclasses, in field order); a 0-dim tensor (a per-batch value, such as the token count
  a packing collator puts first) is passed over. A batch with no such tensor counts 1 (EnergyLogger then
  warns once when it holds no tensor at all: its per-sample figure would be wrong). Two layouts whose first
  tensor is not the samples are told at a batch type's first batch (:func:`sample_layout`) and then counted
  by :func:`count_with`: a PyTorch Geometric-style dict batch (the graphs of its node-to-graph ``batch``
  vector, not the nodes) and a time-major ``(T, B)`` batch (dimension 1, told by the DataLoader's batch
  size); a list of per-sample tensors (a collate_fn that keeps variable-length samples apart) counts its
  length (doubted at a batch size of 2 or 3, where a tuple of the batch's own inputs looks the same); a
  first batch whose count the DataLoader's batch size contradicts is doubted (warned once).
* Several training loaders (Lightning combines them: one batch per loader in each batch) are counted loader by
  loader and added up (:class:`BatchCounter`).
* Tokens, when the batch tells:
  - a mapping with ``attention_mask``: the number of non-zero mask entries (padding excluded);
  - a mapping with ``input_ids``: its number of elements;
  - a list or tuple whose first item is an integer tensor of rank >= 2 (token ids ``(B, T)``): ``B * T``;
  - otherwise unknown (``None``), and the per-token figure is reported as *none*.

An ``attention_mask`` sum is returned as a tensor so that a GPU batch is not synchronised every step; the
caller converts it later.

:func:`count_batch` gives both counts by the same rules, reading a list or tuple batch (the common shape)
in a few attribute look-ups, since it runs on every training batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import BatchSampler


def count_samples(batch: Any) -> int:
    """Dimension 0 of the first tensor of rank >= 1 in ``batch`` (``(B, ...)`` -> ``B``); 1 if there is none.
    A 0-dim tensor is a per-batch value (the token count packing collators put first), not a sample count:
    counted, it made every batch 1 sample."""
    if type(batch) in (list, tuple) and batch and type(batch[0]) is torch.Tensor and batch[0].dim() > 0:
        return int(batch[0].shape[0])  # the common case, fast
    tensor = first_tensor(batch)
    return 1 if tensor is None else int(tensor.shape[0])


def count_batch(
    batch: Any, layout: SampleLayout | None = None
) -> tuple[int | torch.Tensor, int | torch.Tensor | None]:
    """``(count_samples(batch), count_tokens(batch))``, cheaply for a list or tuple led by a tensor; the
    samples by ``layout`` (:func:`sample_layout`) when it is not the default rule."""
    if layout is not None and layout.kind != "first":
        return count_with(layout, batch), count_tokens(batch)
    if type(batch) in _SEQUENCES and batch and type(batch[0]) is torch.Tensor and batch[0].dim() > 0:
        shape = batch[0].shape
        if len(shape) >= 2 and _holds_token_ids(batch[0].dtype):
            return shape[0], batch[0].numel()
        return shape[0], None
    return count_samples(batch), count_tokens(batch)


_SEQUENCES = (list, tuple)
_TOKEN_DTYPES: dict[torch.dtype, bool] = {}


def _holds_token_ids(dtype: torch.dtype) -> bool:
    """Integer dtypes hold token ids (floating point, complex and bool do not)."""
    known = _TOKEN_DTYPES.get(dtype)
    if known is None:
        known = _TOKEN_DTYPES[dtype] = not (
            dtype.is_floating_point or dtype.is_complex or dtype is torch.bool
        )
    return known


def count_tokens(batch: Any) -> int | torch.Tensor | None:
    """Tokens in ``batch`` by the rules of this module; ``None`` when the batch does not tell."""
    if isinstance(batch, Mapping):
        mask = batch.get("attention_mask")
        if isinstance(mask, torch.Tensor):
            return (mask != 0).sum()
        ids = batch.get("input_ids")
        if isinstance(ids, torch.Tensor):
            return int(ids.numel())
        return None
    if isinstance(batch, (list, tuple)) and batch:
        first = batch[0]
        if (
            isinstance(first, torch.Tensor)
            and first.dim() >= 2
            and not first.is_floating_point()
            and not first.is_complex()
        ):
            if first.dtype is not torch.bool:
                return int(first.numel())
    return None


def first_tensor(batch: Any) -> torch.Tensor | None:
    """The first tensor of rank >= 1 in ``batch``, depth first through mappings, lists, tuples and dataclass
    instances (a 0-dim tensor is a per-batch value, not samples)."""
    return next((tensor for tensor in batch_tensors(batch) if tensor.dim() > 0), None)


def batch_tensors(batch: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """The tensors in ``batch``, depth first through mappings, lists, tuples and dataclass instances (in field
    order), at most 8 levels down."""
    if depth > 8:
        return
    if isinstance(batch, torch.Tensor):
        yield batch
        return
    if isinstance(batch, Mapping):
        items: Any = batch.values()
    elif isinstance(batch, (list, tuple)):
        items = batch
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        items = (getattr(batch, field.name) for field in dataclasses.fields(batch))
    else:
        return
    for item in items:
        yield from batch_tensors(item, depth + 1)


def leading_sizes(batch: Any) -> list[int]:
    """Dimension 0 of every tensor of rank >= 1 in ``batch``, in :func:`first_tensor`'s order."""
    return [int(tensor.shape[0]) for tensor in batch_tensors(batch) if tensor.dim() > 0]


def doubtful_sample_count(batch: Any) -> str | None:
    """Why dimension 0 of the first tensor may not be the batch's sample count: most of its tensors agree on
    another leading size (a graph batch led by a ``(2, E)`` edge index, say); ``None`` when nothing says so."""
    sizes = leading_sizes(batch)
    if len(sizes) < 2:
        return None
    common = max(set(sizes), key=sizes.count)
    if sizes.count(common) <= sizes.count(sizes[0]):
        return None
    return f"its tensors' leading sizes are {sizes[:6]}{' ...' if len(sizes) > 6 else ''}, the first being {sizes[0]}"


@dataclasses.dataclass(frozen=True)
class SampleLayout:
    """How the samples of a batch type are counted, decided once, at its first batch (:func:`sample_layout`),
    so that every later batch is counted by a shape look-up or two.

    ``kind``: ``"first"`` (dimension 0 of the first tensor, the documented rule), ``"graphs"`` (a PyTorch
    Geometric-style dict batch: its ``ptr`` or node-to-graph ``batch`` vector gives the graphs),
    ``"time_major"`` (dimension 1 of the first tensor: ``(T, B)`` batches, told by the loader's batch size) or
    ``"items"`` (the length of a list of per-sample tensors at ``path``: a collate_fn that keeps
    variable-length samples apart) or ``"items_or_first"`` (such a list whose first tensor is as long as the
    batch size: both readings count the same at this batch, and the next batch of the type tells them apart,
    :func:`second_look`).
    ``described``: what is counted, for the report. ``doubt``: why the count may still be wrong and the way
    out, warned once; the report says it too."""

    kind: str = "first"
    described: str = "dimension 0 of the first tensor of rank >= 1"
    doubt: str | None = None
    path: tuple[Any, ...] = ()  # ``"items"``: the keys, indices or fields down to the list of samples
    lengths: tuple[int, ...] = ()  # ``"items_or_first"``: the list's leading sizes at the first batch


_SAMPLE_COUNTER_WAY_OUT = "pass `accounting=AccountingConfig(sample_counter=...)`"
_KINDS = ("first", "graphs", "time_major", "items", "items_or_first")
# the rules :func:`sample_layout` and :func:`second_look` tell layouts by, saved with them: raised when they
# tell a batch otherwise, so that a resume from an older checkpoint tells its layouts again by the new ones
LAYOUT_RULES = 1


def graph_vector(batch: Any, loader_batch_size: int | None = None) -> torch.Tensor | None:
    """The node-to-graph vector of a PyTorch Geometric-style dict batch: a 1-D integer tensor named ``batch``,
    as long as dimension 0 of ``x`` (else of the first tensor): the nodes, sorted and starting at 0; else
    ``None``. Reads its values (once, at a batch type's first batch)."""
    vector = batch.get("batch") if isinstance(batch, Mapping) else None
    if vector is None:
        return None
    first = batch.get("x")  # the node features, wherever they are; else the first tensor
    if not isinstance(first, torch.Tensor) or first.dim() == 0:
        first = first_tensor(batch)
    if (
        not isinstance(vector, torch.Tensor)
        or vector.dim() != 1
        or vector.numel() == 0
        or not _holds_token_ids(vector.dtype)
        or first is None
        or first.shape[0] != vector.shape[0]
    ):
        return None
    steps = vector[1:] - vector[:-1]
    if int(vector[0]) != 0 or not bool(((steps == 0) | (steps == 1)).all()):
        return None
    graphs = int(vector[-1]) + 1
    # a per-sample id (0, 1, 2, ...) or flag (all 0) named `batch` is not a graph vector: its graphs would be
    # its rows, or not the loader's batch
    if graphs == vector.numel() or loader_batch_size not in (None, graphs):
        return None
    return vector


def sample_layout(batch: Any, loader_batch_size: int | None = None, uneven: bool = True) -> SampleLayout:
    """How to count the samples of ``batch``'s type, from its first batch: a node-to-graph ``batch`` vector
    (:func:`graph_vector`) counts graphs; a first tensor ``(T, B, ...)`` with the loader's batch size ``B``
    second and neither ``B`` nor 1 first counts dimension 1 (time-major), unless a list of ``B`` samples the
    labels confirm holds it; a list of ``B`` per-sample tensors (:func:`_sample_list`) counts its length; else
    dimension 0 of the first tensor, with a doubt when the loader's batch size or most of the batch's tensors
    say otherwise. ``loader_batch_size``: the training DataLoader's ``batch_size`` (what its first batch
    holds), if known; ``uneven``: whether its epochs may end on a short batch (:func:`loader_ends_short`)."""
    if graph_vector(batch, loader_batch_size) is not None:
        return SampleLayout(
            "graphs", "graphs: the node-to-graph `batch` vector's last value + 1 (`ptr`'s length - 1)"
        )
    first = first_tensor(batch)
    if first is None:
        return SampleLayout(
            doubt=f"found no tensor in a training batch of type {type(batch).__name__}, so each batch counts "
            "as 1 sample and the energy per sample is too high. Pass "
            "`accounting=AccountingConfig(sample_counter=...)` to count its samples."
        )
    size = int(first.shape[0])
    found = None if loader_batch_size is None else _sample_list(batch, loader_batch_size)
    if loader_batch_size is not None and first.dim() >= 2 and size not in (loader_batch_size, 1):
        # B second, and no batch-first tensor beside it: a (B, F) one makes the first N joined rows of B
        # columns (every image's (N, 4) boxes, in a batch of 4 images), not time steps; nor a list of B
        # samples the labels confirm (variable-length sequences of B features: 40 counted for 37)
        batch_first = any(t.dim() >= 2 and t.shape[0] == loader_batch_size for t in batch_tensors(batch))
        labelled_list = found is not None and found[1]
        if first.shape[1] == loader_batch_size and not batch_first and not labelled_list:
            return SampleLayout("time_major", "dimension 1 of the first tensor: time-major (T, B) batches")
    if found is not None:
        return _items_layout(found[0], loader_batch_size, uneven, lengths=found[2])
    # the loader's batch size confirming dimension 0 outweighs most tensors' leading sizes (a detection
    # batch's images next to its per-image target dicts)
    doubt = None if size == loader_batch_size else doubtful_sample_count(batch)
    if doubt is None and loader_batch_size is not None and size != loader_batch_size:
        doubt = f"the training DataLoader's batch_size is {loader_batch_size}"
    if doubt is None:
        return SampleLayout()
    return SampleLayout(
        described=f"dimension 0 of the first tensor of rank >= 1; MAY BE WRONG: {size} per batch, "
        f"but {doubt}",
        doubt=f"counts {size} samples per training batch (dimension 0 of its first tensor of rank >= 1), but "
        f"{doubt}. If that is not the sample count, {_SAMPLE_COUNTER_WAY_OUT}; the energy per token "
        "(`energy/j_per_token`) does not depend on it.",
    )


def _sample_list_path(batch: Any, loader_batch_size: int, depth: int = 0) -> tuple[Any, ...] | None:
    """Where, depth first (as :func:`first_tensor` reads), a list or tuple of ``loader_batch_size`` tensors of
    rank >= 1, of one dtype and one shape past dimension 0, lies in ``batch`` before any other tensor of rank
    >= 1: the keys, indices or field names down to it; ``None`` when there is none."""
    if depth > 3:
        return None
    if isinstance(batch, (list, tuple)):
        if len(batch) == loader_batch_size and _one_kind_of_tensor(batch):
            return ()
        children: Any = enumerate(batch)
    elif isinstance(batch, Mapping):
        children = batch.items()
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        children = ((field.name, getattr(batch, field.name)) for field in dataclasses.fields(batch))
    else:
        return None
    for key, item in children:
        if isinstance(item, torch.Tensor):
            if item.dim() > 0:  # the first tensor comes before any list after it
                return None
            continue
        found = _sample_list_path(item, loader_batch_size, depth + 1)
        if found is not None:
            return (key, *found)
    return None


def _one_kind_of_tensor(items: list | tuple) -> bool:
    """Tensors of rank >= 1, of one dtype and one shape past dimension 0 (samples of one dataset), at least
    one. A tuple of a batch's own tensors mostly differs in one of these (images and their joined boxes)."""
    if not items or not all(type(item) is torch.Tensor and item.dim() > 0 for item in items):
        return False
    first = items[0]
    return all(item.dtype == first.dtype and item.shape[1:] == first.shape[1:] for item in items)


def _sample_list(batch: Any, loader_batch_size: int) -> tuple[tuple[Any, ...], bool, tuple[int, ...]] | None:
    """``(path, labelled, lengths)`` where ``batch`` holds a list of its samples (:func:`_sample_list_path`),
    ``None`` if nowhere: their lengths differ (variable-length samples), or a tensor after them is as long as
    the list (the labels: ``labelled``) while they are not all that long (else they are batch-first inputs:
    two of a batch of 2). At a batch size of 1, the labels suffice: a batch of one sample holds one, whatever
    its length. ``lengths`` (the list's leading sizes; else ``()``) when its first is as long as the batch
    size: a sample that happens to be that long (a sweep: 134 samples counted for 64 when that was taken for
    batch-first), or a batch-first tensor beside some that are not per-sample (``(anchors (B, F), negatives
    (K, F))`` at B=2: 38 counted for 37). Both count ``B`` at this batch; the next one tells
    (:func:`second_look`)."""
    path = _sample_list_path(batch, loader_batch_size)
    if path is None:
        return None
    lengths = [int(item.shape[0]) for item in _at_path(batch, path)]
    labelled = loader_batch_size in leading_sizes(batch)[len(lengths) :]  # the list's tensors come first
    if len(set(lengths)) > 1 or (labelled and (loader_batch_size == 1 or lengths[0] != loader_batch_size)):
        pending = loader_batch_size > 1 and lengths[0] == loader_batch_size
        return path, labelled, tuple(lengths) if pending else ()
    return None


_FEW_ITEMS = 3  # a list this short may be a tuple of the batch's own inputs (nodes and edges)


def _items_layout(
    path: tuple[Any, ...], loader_batch_size: int, uneven: bool, lengths: tuple[int, ...] = ()
) -> SampleLayout:
    """The layout of a list of samples at ``path``. Doubted where it may as well be a tuple of as many of the
    batch's own inputs (graph batches ``((node_feats, edge_feats), y)`` at a batch size of 2): both count the
    same on every full batch, but a tuple keeps its length on a short last batch. ``lengths``: the list's
    leading sizes, its first as long as the batch size (told at the next batch: :func:`second_look`)."""
    if lengths:
        return SampleLayout(
            "items_or_first",
            "the length of the batch's list of per-sample tensors (dimension 0 of its first tensor, the same "
            "count, at the one batch seen)",
            path=path,
            lengths=lengths,
        )
    if not uneven or not 1 < loader_batch_size <= _FEW_ITEMS:
        return SampleLayout("items", "the length of the batch's list of per-sample tensors", path=path)
    why = (
        f"a tuple of {loader_batch_size} of the batch's own inputs (a graph's node and edge features, say) "
        f"looks so too, and counts {loader_batch_size} for the epoch's short last batch as well"
    )
    return SampleLayout(
        "items",
        f"the length of the batch's list of per-sample tensors; MAY BE WRONG: {why}",
        doubt=f"counts the length of a list of {loader_batch_size} tensors of one kind in each training "
        f"batch, taking them for its samples, but {why}. If that is not the sample count, "
        f"{_SAMPLE_COUNTER_WAY_OUT}; the energy per token (`energy/j_per_token`) does not depend on it.",
        path=path,
    )


def second_look(
    layout: SampleLayout, batch: Any, loader_batch_size: int, uneven: bool = True
) -> SampleLayout:
    """An ``"items_or_first"`` layout told at its batch type's second batch: the list's leading sizes as
    they were (a batch-first tensor beside some that are not per-sample, such as negatives or a memory bank)
    count dimension 0 of the first tensor; new sizes, the list's length (new samples)."""
    samples = _at_path(batch, layout.path)
    if not isinstance(samples, (list, tuple)) or not _one_kind_of_tensor(samples):
        return SampleLayout()
    if tuple(int(item.shape[0]) for item in samples) == layout.lengths:
        return SampleLayout()
    return _items_layout(layout.path, loader_batch_size, uneven)


def _at_path(batch: Any, path: tuple[Any, ...]) -> Any:
    """What lies at ``path`` (:func:`_sample_list_path`) in ``batch``; ``None`` where the batch differs."""
    for key in path:
        if isinstance(batch, (list, tuple, Mapping)):
            try:
                batch = batch[key]
            except (IndexError, KeyError, TypeError):
                return None
        elif isinstance(key, str) and dataclasses.is_dataclass(batch):
            batch = getattr(batch, key, None)
        else:
            return None
    return batch


def count_with(layout: SampleLayout, batch: Any) -> int | torch.Tensor:
    """The samples of ``batch`` by ``layout``: an int, or a 0-dim tensor (a node-to-graph vector's graphs,
    summed where the vector is and read at the next read-out, so that a GPU step is not synchronised)."""
    if layout.kind == "graphs" and isinstance(batch, Mapping):
        ptr = batch.get("ptr")
        if isinstance(ptr, torch.Tensor) and ptr.dim() == 1:
            return max(int(ptr.shape[0]) - 1, 0)
        vector = batch.get("batch")
        if isinstance(vector, torch.Tensor) and vector.dim() == 1:
            if vector.numel() == 0:
                return 0
            return vector[-1] + 1  # a tensor, added up where it is: read at read-outs, not every step
    if layout.kind in ("items", "items_or_first"):
        samples = _at_path(batch, layout.path)
        if isinstance(samples, (list, tuple)):
            return len(samples)
    if layout.kind == "time_major":
        if type(batch) in _SEQUENCES and batch and type(batch[0]) is torch.Tensor and batch[0].dim() > 1:
            return batch[0].shape[1]  # the common case, fast
        first = first_tensor(batch)
        if first is not None and first.dim() > 1:
            return int(first.shape[1])
    return count_samples(batch)


def describes(layout: SampleLayout, batch: Any, loader_batch_size: int | None) -> bool:
    """Whether ``layout`` (told from other batches of ``batch``'s type) can count ``batch``: what it counts
    is there (the graph vector, the list of samples, a first tensor of rank >= 2 for time-major), and the
    count is at most the loader's batch size. A saved time-major ``(T=50, B=32)`` layout counts batch-first
    ``(32, 50)`` rows as 50: not these. A short or cut batch of the run's data passes (it holds fewer)."""
    if layout.kind == "graphs":
        there = isinstance(batch, Mapping) and any(
            isinstance(batch.get(name), torch.Tensor) and batch[name].dim() == 1 for name in ("ptr", "batch")
        )
    elif layout.kind in ("items", "items_or_first"):
        there = isinstance(_at_path(batch, layout.path), (list, tuple))
    else:
        first = first_tensor(batch)
        there = first is not None and (layout.kind != "time_major" or first.dim() > 1)
    if not there:
        return False
    samples = count_with(layout, batch)  # a tensor (graphs by their vector) is not read: no GPU sync
    return loader_batch_size is None or not isinstance(samples, int) or samples <= loader_batch_size


def loader_batch_size(loader: Any) -> int | None:
    """The samples a training DataLoader's first batch holds: its ``batch_size`` (or its batch sampler's),
    at most its sampler's length (a dataset smaller than a batch); ``None`` when it does not say."""
    from lightning_pulse._lightning_compat import UsersBatchSizes

    size, batches = getattr(loader, "batch_size", None), getattr(loader, "batch_sampler", None)
    if isinstance(batches, UsersBatchSizes):  # training's copy of the user's (compat.training_copy)
        batches = batches.users_batches
    if not isinstance(size, int) and type(batches) is BatchSampler:
        size = batches.batch_size  # a custom batch sampler's `batch_size` may be a cap only
    if not isinstance(size, int) or size < 1:
        return None
    try:
        return min(size, len(loader.sampler))
    except (AttributeError, TypeError, NotImplementedError):  # an iterable dataset's sampler has no length
        return size


def loader_ends_short(loader: Any) -> bool:
    """Whether a training DataLoader's epochs may end on a short batch: ``False`` only when it drops the last
    one or its sampler's length is a multiple of its batch size."""
    size = loader_batch_size(loader)
    if size is None or getattr(loader, "drop_last", False):
        return size is None
    try:
        return len(loader.sampler) % size != 0
    except (AttributeError, TypeError, NotImplementedError):
        return True


def loader_parts(loaders: Any) -> list[tuple[tuple[Any, ...], int | None, bool]] | None:
    """The training loaders of a fit on several at once (a dict, list or tuple of them, nested or not, as
    ``trainer.train_dataloader`` gives what Lightning combined): each one's keys or indices and its batch size
    (:func:`loader_batch_size`) and whether it may end on a short batch (:func:`loader_ends_short`); ``None``
    for one loader. Each training batch holds one batch per loader at
    the same place (``None`` for a loader already exhausted, in ``CombinedLoader``'s mode ``"max_size"``)."""
    if not isinstance(loaders, (Mapping, list, tuple)):
        return None
    parts: list[tuple[tuple[Any, ...], int | None, bool]] = []

    def walk(node: Any, path: tuple[Any, ...]) -> None:
        if isinstance(node, (Mapping, list, tuple)):
            for key, child in node.items() if isinstance(node, Mapping) else enumerate(node):
                walk(child, (*path, key))
        else:
            parts.append((path, loader_batch_size(node), loader_ends_short(node)))

    walk(loaders, ())
    return parts


_MISSING = object()


def _loader_batch(batch: Any, path: tuple[Any, ...]) -> Any:
    """One loader's batch in a combined ``batch``: at ``path``, through the mappings, lists and tuples that
    Lightning combines the loaders' batches in; ``_MISSING`` where ``batch`` does not have that shape."""
    for key in path:
        if isinstance(batch, Mapping) and key in batch:
            batch = batch[key]
        elif isinstance(batch, (list, tuple)) and isinstance(key, int) and key < len(batch):
            batch = batch[key]
        else:
            return _MISSING
    return batch


class BatchCounter:
    """The samples and tokens of a fit's training batches, by the rules of this module: each batch type's
    layout told at its first batch (:func:`sample_layout`, with the training loader's batch size), then
    applied. On several training loaders (:func:`loader_parts`) each loader's batch is counted by its own
    layout and loader's batch size, and the loaders' counts are added up: the default rule alone found the
    first loader's batch only (a sweep: 40 samples counted for 60 trained). A combined batch that does not
    hold the loaders' batches at their places (joined in ``on_after_batch_transfer``, say) is counted as one
    batch, with a doubt.

    ``loaders``: ``trainer.train_dataloader``. ``told_before``: the layouts the run told before a resume
    (:meth:`state_dict`, from a checkpoint). A resumed fit applies each to its batch type for as long as it
    describes the batches (:func:`describes`), instead of telling its own from its first batch, which may be
    an epoch's short last batch or one cut in place (``HardSampleReplay(mode="batch")``): ``(B/2, F)`` rows
    with ``F == B`` were read as time-major, ``B`` samples counted for ``B/2``. A batch the saved layout does
    not describe (other data: batch-first ``(32, 50)`` rows by a time-major ``(T=50, B=32)`` layout count
    50) has its layout told from it, and that one is saved. In a fit resumed mid-epoch, a layout told past an
    epoch's first batch where none was saved (an EnergyLogger added on the resume, an older checkpoint) is
    provisional: not saved, and told again at its type's next batch that starts an epoch (a time-major
    misreading of a short last batch was inherited by every later resume: 80 samples counted for 70). A fresh
    fit tells and saves each layout at once, wherever its type first comes (provisional there, a type first
    seen mid-epoch was told again at an epoch's start from a batch HardSampleReplay had cut: 240 for 200)."""

    def __init__(self, loaders: Any = None, told_before: Sequence[Mapping[str, Any]] = ()) -> None:
        self.parts = loader_parts(loaders)
        self.batch_size = loader_batch_size(loaders) if self.parts is None else None
        self.uneven = loader_ends_short(loaders) if self.parts is None else True
        self.layouts: dict[tuple[tuple[Any, ...] | None, type], SampleLayout] = {}
        self._told_before = dict(filter(None, map(_saved_layout, told_before)))
        self._restored: set[tuple[tuple[Any, ...] | None, type]] = set()  # checked at each batch
        self._provisional: set[tuple[tuple[Any, ...] | None, type]] = set()  # told again at an epoch's start
        self._first_batch_idx: int | None = None  # past 0: the fit resumed mid-epoch

    def count(
        self, batch: Any, doubted: Callable[[str, str], None], batch_idx: int = 0
    ) -> tuple[int | torch.Tensor, int | torch.Tensor | None]:
        """``(samples, tokens)`` of ``batch``; ``doubted(key, why)`` once per layout that may count wrong.
        ``batch_idx``: the batch's index in its epoch (in a fit resumed mid-epoch, a layout told past 0 is
        provisional)."""
        if self._first_batch_idx is None:
            self._first_batch_idx = batch_idx
        if self.parts is None:
            return count_batch(
                batch, self._layout((), batch, self.batch_size, self.uneven, doubted, batch_idx)
            )
        batches = [(path, _loader_batch(batch, path), size, uneven) for path, size, uneven in self.parts]
        if any(part is _MISSING for _, part, _, _ in batches):
            return count_batch(batch, self._layout(None, batch, None, True, doubted, batch_idx))
        samples: int | torch.Tensor = 0
        tokens: int | torch.Tensor | None = 0
        for path, part, size, uneven in batches:
            if part is None:  # an exhausted loader
                continue
            layout = self._layout(path, part, size, uneven, doubted, batch_idx)
            part_samples, part_tokens = count_batch(part, layout)
            samples = samples + part_samples
            # known only when every loader's batch tells (the ledger's rule for a run's batches)
            tokens = None if tokens is None or part_tokens is None else tokens + part_tokens
        return samples, tokens

    def tokens(self, batch: Any) -> int | torch.Tensor | None:
        """The tokens of ``batch`` (every loader's, added up), for a ``sample_counter`` given without a
        ``token_counter``."""
        if self.parts is None:
            return count_tokens(batch)
        tokens: int | torch.Tensor | None = 0
        for path, _, _ in self.parts:
            part = _loader_batch(batch, path)
            if part is _MISSING:
                return count_tokens(batch)
            if part is not None:
                part_tokens = count_tokens(part)
                tokens = None if tokens is None or part_tokens is None else tokens + part_tokens
        return tokens

    def described(self) -> str | None:
        """What the samples counted, for the report; ``None`` for the default rule alone."""
        if not self.layouts:
            return None
        if self.parts is None or (len(self.parts) == 1 and None not in {path for path, _ in self.layouts}):
            # one loader, given alone or in a list or dict of one: nothing added up
            told = dict.fromkeys(layout.described for layout in self.layouts.values())
            return None if list(told) == [SampleLayout.described] else "; ".join(told)
        alike = {layout.described for layout in self.layouts.values()}
        if len(alike) == 1:  # said once
            return f"every training loader's batch, added up, each by {alike.pop()}"
        told = dict.fromkeys(
            f"{self._name(path)}{layout.described}" for (path, _), layout in self.layouts.items()
        )
        return f"every training loader's batch, added up: {'; '.join(told)}"

    def state_dict(self) -> list[dict[str, Any]]:
        """The layouts told or restored, but not the provisional ones, for a checkpoint: plain values only, so
        that a checkpoint loads with ``weights_only``; a layout under keys of other types is left out (told
        again on a resume). Those restored and not met yet are kept (a loader of another batch size may come
        back): a few records a batch type."""
        saved = dict(self._told_before)
        for (path, batch_type), layout in self.layouts.items():
            if (path, batch_type) not in self._provisional:
                saved[(path, _type_name(batch_type), self._loader_size(path))] = layout
        return [
            {
                "rules": LAYOUT_RULES,
                "path": None if path is None else list(path),
                "type": name,
                "batch_size": size,
                "layout": {
                    **dataclasses.asdict(layout),
                    "path": list(layout.path),
                    "lengths": list(layout.lengths),
                },
            }
            for (path, name, size), layout in saved.items()
            if _plain_keys(path) and _plain_keys(layout.path)
        ]

    def _layout(
        self,
        path: tuple[Any, ...] | None,
        batch: Any,
        size: int | None,
        uneven: bool,
        doubted: Callable[[str, str], None],
        batch_idx: int,
    ) -> SampleLayout:
        """``batch``'s layout: the one told, else the run's saved one while it describes the batches, else
        told from ``batch`` (provisional mid-epoch, where none was saved)."""
        key = (path, type(batch))
        layout = self.layouts.get(key)
        if (
            layout is not None
            and layout.kind != "items_or_first"
            and key not in self._restored
            and key not in self._provisional
        ):
            return layout  # the common case, fast
        if layout is None:
            layout = self._told_before.get((path, _type_name(type(batch)), size))
            if layout is not None:
                self._restored.add(key)
        if key in self._restored and not describes(layout, batch, size):
            self._restored.discard(key)  # other data than the run's: told from this batch, for good
            layout = None
        elif key in self._provisional and batch_idx == 0:
            self._provisional.discard(key)  # told again at an epoch's first batch, not a short last one
            layout = None
        elif layout is None and batch_idx > 0 and self._first_batch_idx:  # a fresh fit tells at once
            self._provisional.add(key)  # this batch may be an epoch's short last one
        if layout is None:
            layout = self._tell(path, batch, size, uneven)
        elif layout.kind == "items_or_first" and size is not None:
            # told at the type's previous batch (the run's last, if restored): both readings counted it alike
            layout = second_look(layout, batch, size, uneven)
        elif self.layouts.get(key) is layout:
            return layout
        self.layouts[key] = layout
        if layout.doubt is not None:  # each doubt once (one told again may differ)
            doubted(f"samples {path}: {layout.doubt}", f"{self._name(path)}{layout.doubt}")
        return layout

    def _loader_size(self, path: tuple[Any, ...] | None) -> int | None:
        """The loader batch size a layout at ``path`` is told with (as :meth:`count` gives it)."""
        if path is None:
            return None
        if self.parts is None:
            return self.batch_size
        return next(size for part, size, _ in self.parts if part == path)

    def _tell(self, path: tuple[Any, ...] | None, batch: Any, size: int | None, uneven: bool) -> SampleLayout:
        layout = sample_layout(batch, size, uneven)
        if path is not None or self.parts is None:
            return layout
        places = ", ".join(_place(part) for part, _, _ in self.parts)
        why = (
            f"the fit trains on {len(self.parts)} training loaders, whose batches Lightning combines into "
            f"one a step, one per loader, but a training batch of type {type(batch).__name__} does not hold "
            f"them at their places ({places})"
        )
        return SampleLayout(
            layout.kind,
            f"the whole combined batch, as one: {layout.described}; MAY BE WRONG: {why}",
            doubt=f"{why}, so its samples are counted as one batch's ({layout.described}). If that is not "
            f"the sample count, {_SAMPLE_COUNTER_WAY_OUT}; the energy per token (`energy/j_per_token`) does "
            "not depend on it.",
            path=layout.path,
        )

    def _name(self, path: tuple[Any, ...] | None) -> str:
        return "" if path is None or self.parts is None else f"training loader {_place(path)}: "


def _type_name(batch_type: type) -> str:
    return f"{batch_type.__module__}.{batch_type.__qualname__}"


def _plain_keys(path: tuple[Any, ...] | None) -> bool:
    return path is None or all(type(key) in (str, int) for key in path)


def _saved_layout(record: Mapping[str, Any]) -> tuple[tuple[Any, ...], SampleLayout] | None:
    """``((path, type name, loader batch size), layout)`` of a :meth:`BatchCounter.state_dict` record;
    ``None`` for one told by other rules (:data:`LAYOUT_RULES`) or that this version cannot read: its
    layout is told again."""
    try:
        if record.get("rules") != LAYOUT_RULES:
            return None
        path = None if record["path"] is None else tuple(record["path"])
        fields = dict(record["layout"])
        layout = SampleLayout(
            **{**fields, "path": tuple(fields["path"]), "lengths": tuple(fields["lengths"])}
        )
        key = (path, str(record["type"]), record["batch_size"])
        hash(key)  # a list inside would raise where the key is looked up, mid-fit
        readable = layout.kind in _KINDS and isinstance(layout.described, str)
        return (key, layout) if readable and isinstance(layout.doubt, (str, type(None))) else None
    except (AttributeError, KeyError, TypeError, ValueError):
        return None


def _place(path: tuple[Any, ...]) -> str:
    """A loader's keys or indices in the combined batch, as Python indexes it: ``['a']``, ``[0]``."""
    return "".join(f"[{key!r}]" for key in path)
