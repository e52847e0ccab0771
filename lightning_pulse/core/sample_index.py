"""Which dataset indices each training batch holds, without changing the batch.

A :class:`RecordingSampler` is slipped in between a DataLoader's ``BatchSampler`` and the sampler it
draws from (``RandomSampler``, ``SequentialSampler``, Lightning's ``DistributedSampler``, or any
other index sampler). It hands the same indices on, in the same order, and remembers them. Because a
DataLoader always draws indices in the main process and returns batches in that order (also with worker
processes), the ``k``-th batch of an epoch is the ``k``-th group of ``batch_size`` recorded indices.

:class:`SampleIndexTracker` is the public face: install it on a DataLoader once (it is shared: a second
install returns the same tracker), then ask :meth:`SampleIndexTracker.batch_indices` for each batch.

Example::

    tracker = SampleIndexTracker.install(loader)
    for batch_idx, (x, y) in enumerate(loader):
        indices = tracker.batch_indices(batch_idx)   # LongTensor (B,): loader.dataset[indices[i]] is sample i
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
    SubsetRandomSampler,
)

from lightning_pulse.core.selection import holds_item_per_sample
from lightning_pulse.energy.counting import batch_tensors


class RecordingSampler(Sampler[int]):
    """Yields exactly what ``sampler`` yields and records it, for :class:`SampleIndexTracker`.

    Args:
        sampler: the index sampler to wrap.
        forward_set_epoch: call ``sampler.set_epoch`` from this wrapper's ``set_epoch``. Off when the
            DataLoader also exposes ``sampler`` directly (Lightning then calls it there, and calling it
            twice is not harmless for every sampler).
        chunk: how many indices are drawn from ``sampler`` at a time. The batch size: a batch sampler asks for
            a batch's worth at once anyway, so the sampler is never read further ahead than without the wrapper.
    """

    def __init__(
        self, sampler: Sampler[int] | Sequence[int], forward_set_epoch: bool = True, chunk: int = 1
    ) -> None:
        self.sampler = sampler
        self.forward_set_epoch = forward_set_epoch
        self.chunk = max(1, int(chunk))
        self.iteration = 0  # how many passes over the sampler have started
        self.pending: deque[int] = deque()  # indices drawn in this pass and not yet released
        self.stream_start = 0  # position in this pass's index stream of pending[0]
        # a PlannedBatchSampler's pass: the batches it yielded and the tracker has not released, in order
        # (it knows each batch whole, so nothing is recorded index by index)
        self.batches: deque[np.ndarray] | None = None

    def __iter__(self) -> Iterator[int]:
        source = self._start_pass(batches=None)
        # pass indices on in chunks: a per-index Python loop would cost more than the sampler itself
        while chunk := list(islice(source, self.chunk)):
            self.pending.extend(chunk)
            yield from chunk

    def __len__(self) -> int:
        return len(self.sampler)  # type: ignore[arg-type]

    def begin_batch_pass(self) -> Iterator[int]:
        """Start a pass whose batches are recorded whole (:meth:`record_batch`); returns the wrapped sampler's
        order, read directly."""
        return self._start_pass(batches=deque())

    def _start_pass(self, batches: deque[np.ndarray] | None) -> Iterator[int]:
        self.iteration += 1
        self.pending.clear()
        self.stream_start = 0
        self.batches = batches
        return iter(self.sampler)

    def record_batch(self, indices: Sequence[int] | np.ndarray) -> None:
        """Record one batch of a pass started with :meth:`begin_batch_pass`, as it is yielded."""
        assert self.batches is not None
        self.batches.append(np.asarray(indices, dtype=np.int64))

    def set_epoch(self, epoch: int) -> None:
        set_epoch = getattr(self.sampler, "set_epoch", None)
        if self.forward_set_epoch and callable(set_epoch):
            set_epoch(epoch)


class SampleIndexTracker:
    """Looks up the dataset indices of every batch a map-style DataLoader yields.

    Works with shuffling, with worker processes (indices are drawn in the main process, batches come back
    in order) and with ``DistributedSampler`` (install after the distributed sampler is in place: each rank
    then sees the global dataset indices of its own shard). Use :meth:`install`, not the constructor.

    Contract for callers: ask :meth:`batch_indices` for every batch of an epoch, in order (a Lightning
    callback does it in ``on_train_batch_start``). The first call of each epoch fixes the alignment, so a
    ``batch_idx`` that does not start at 0 (a run resumed mid-epoch) is handled. Several callers may share
    one tracker: asking twice for the same batch returns the same indices.

    Attributes:
        dataset: the DataLoader's dataset (for fetching samples by index).
        collate_fn: the DataLoader's ``collate_fn``.
        batch_size: the DataLoader's batch size.
    """

    def __init__(self, recorder: RecordingSampler, dataset: Any, collate_fn: Any, batch_size: int) -> None:
        self.recorder = recorder
        self.dataset = dataset
        self.collate_fn = collate_fn
        self.batch_size = batch_size
        self._iteration = -1
        self._base = 0
        self._ordinal = -1
        self._indices: Tensor | None = None

    # ------------------------------------------------------------------ install
    @staticmethod
    def several_loaders_reason(loaders: Any) -> str | None:
        """Why ``loaders`` (``trainer.train_dataloader``) cannot be tracked as one stream of dataset indices: a
        dict, list or tuple of several DataLoaders (Lightning combines them into one batch of several datasets),
        or ``None`` otherwise."""
        several = list(loaders.values()) if isinstance(loaders, Mapping) else loaders
        if isinstance(several, (list, tuple)) and len(several) > 1:
            return f"the fit trains on {len(several)} DataLoaders at once (a CombinedLoader)"
        return None

    @staticmethod
    def unsupported_reason(loader: Any) -> str | None:
        """Why indices cannot be tracked for ``loader``, or ``None`` if they can."""
        if not isinstance(loader, DataLoader):
            return f"the training dataloader is a {type(loader).__name__}, not a torch DataLoader"
        if isinstance(loader.dataset, IterableDataset):
            return "the dataset is an IterableDataset, which has no indices"
        batch_sampler = loader.batch_sampler
        if batch_sampler is None:
            return "the DataLoader has batch_size=None (no automatic batching)"
        planned = isinstance(batch_sampler, PlannedBatchSampler)
        if (
            not planned
            and type(batch_sampler).__iter__ is not BatchSampler.__iter__
            or not hasattr(batch_sampler, "sampler")
        ):
            return f"the DataLoader uses a custom batch sampler ({type(batch_sampler).__name__})"
        if not getattr(loader, "in_order", True):
            return "the DataLoader has in_order=False, so batches may come back out of order"
        try:
            len(loader.dataset)
        except TypeError:
            return "the dataset has no length"
        return None

    @classmethod
    def install(cls, loader: DataLoader) -> SampleIndexTracker:
        """Put a :class:`RecordingSampler` into ``loader`` (once) and return its tracker.

        Install before the DataLoader is iterated: a pass that already started keeps drawing from the
        unwrapped sampler.

        Raises:
            ValueError: if the loader cannot be tracked (see :meth:`unsupported_reason`).
        """
        reason = cls.unsupported_reason(loader)
        if reason is not None:
            raise ValueError(f"Cannot track sample indices: {reason}.")
        batch_sampler = loader.batch_sampler
        existing = batch_sampler.sampler
        if isinstance(existing, RecordingSampler):
            return existing.tracker  # type: ignore[attr-defined]
        recorder = RecordingSampler(
            existing, forward_set_epoch=loader.sampler is not existing, chunk=batch_sampler.batch_size
        )
        batch_sampler.sampler = recorder
        tracker = cls(recorder, loader.dataset, loader.collate_fn, batch_sampler.batch_size)
        recorder.tracker = tracker  # type: ignore[attr-defined]
        return tracker

    @staticmethod
    def uninstall(loader: DataLoader) -> None:
        """Put the original sampler back (no-op if none was installed)."""
        batch_sampler = getattr(loader, "batch_sampler", None)
        recorder = getattr(batch_sampler, "sampler", None)
        if isinstance(recorder, RecordingSampler):
            batch_sampler.sampler = recorder.sampler

    # ------------------------------------------------------------------ queries
    @property
    def dataset_size(self) -> int:
        return len(self.dataset)

    def batch_indices(self, batch_idx: int) -> Tensor:
        """The dataset indices ``(B,)`` (int64) of the batch Lightning calls ``batch_idx``, in batch order.

        Raises:
            RuntimeError: if the batch's indices were not recorded (the tracker was installed after the
                DataLoader pass started, or batches were asked for out of order).
        """
        recorder = self.recorder
        if recorder.iteration != self._iteration:
            self._iteration = recorder.iteration
            self._base = batch_idx
            self._ordinal = -1
        ordinal = batch_idx - self._base
        if ordinal == self._ordinal and self._indices is not None:
            return self._indices
        if ordinal < self._ordinal:
            raise RuntimeError(
                f"SampleIndexTracker: batch {batch_idx} was asked for after a later batch of the same epoch."
            )
        if recorder.batches is not None:
            return self._planned_batch(batch_idx, ordinal)
        start, size = ordinal * self.batch_size, self.batch_size
        drop = start - recorder.stream_start
        for _ in range(min(drop, len(recorder.pending))):
            recorder.pending.popleft()
        recorder.stream_start = max(start, recorder.stream_start)
        count = min(size, len(recorder.pending))
        if count == 0 or drop < 0:
            raise RuntimeError(
                f"SampleIndexTracker: no recorded indices for batch {batch_idx}. The tracker must be installed "
                "before the DataLoader starts a pass, and asked for every batch in order."
            )
        self._indices = torch.from_numpy(
            np.fromiter(islice(recorder.pending, count), dtype=np.int64, count=count)
        )
        self._ordinal = ordinal
        return self._indices

    def _planned_batch(self, batch_idx: int, ordinal: int) -> Tensor:
        """:meth:`batch_indices` in a planned pass: the batch as yielded (a light step's cut, not its window)."""
        batches = self.recorder.batches
        assert batches is not None
        # batches passed over since the last one asked for (batch_indices has ruled out going back)
        for _ in range(min(ordinal - self._ordinal - 1, len(batches))):
            batches.popleft()
        if not batches:
            raise RuntimeError(
                f"SampleIndexTracker: no recorded indices for batch {batch_idx}. The tracker must be installed "
                "before the DataLoader starts a pass, and asked for every batch in order."
            )
        self._indices = torch.from_numpy(batches.popleft())
        self._ordinal = ordinal
        return self._indices

    def fetch(self, indices: Sequence[int] | Tensor) -> Any:
        """A collated batch of ``dataset[i]`` for ``indices`` (in the calling process, on the CPU)."""
        return self.collate_fn([self.dataset[int(i)] for i in indices])


@dataclass
class _Block:
    """The block of batches a :class:`PlannedBatchSampler` is yielding: their windows, their cuts (``None``:
    a plain batch), the epoch ordinal of the first, how many lead with a given cut, the first not yielded."""

    batches: list[list[int]]
    cuts: list[Any]
    ordinal: int
    given: int
    undrawn: int = 0


class PlannedBatchSampler(BatchSampler):
    """A ``BatchSampler`` whose batches follow a plan: each pass yields the raw batch sizes ``sizes_for_pass``
    gives, from the same index sampler (step-saving replay fetches a larger window for a light-phase step).

    With ``choose``, the windows larger than ``batch_size`` are cut before they are loaded: for each block of
    :attr:`CHOOSE_BLOCK` batches, ``choose(windows, ordinals)`` gets every such window of the block (its dataset
    indices) and the batches' places in the epoch, and returns one cut per window (its ``indices``: the dataset
    indices to yield, in window order), so the DataLoader loads only the samples that train. What each batch was cut from is kept in
    :attr:`windows`, in order, for the consumer to :meth:`take_window`. :meth:`choose_again` cuts the windows
    not yet yielded again (a rollback restored the scores they were cut from); a pass's first batches may come
    with their cuts already :attr:`given` (a resume's, cut before such a rollback).

    Args:
        original: the DataLoader's batch sampler (its ``sampler`` and ``drop_last`` are kept).
        sizes_for_pass: called at the start of every pass; returns ``(skip, sizes)``: how many of the pass's
            leading indices were already trained (a resume mid-epoch) and the sizes of the batches to yield.
        plain_length: the batch count Lightning is told (``len``), the plain pass's, so the run's step
            estimate is the plain run's capped by ``max_steps``; the pass ends when its planned batches do.
        choose: the cuts of a pass's windows that are larger than a batch.
    """

    #: batches whose windows are read and chosen together (bounds the indices held at once)
    CHOOSE_BLOCK = 256

    def __init__(
        self,
        original: BatchSampler,
        sizes_for_pass: Callable[[], tuple[int, list[int]]],
        plain_length: int,
        choose: Callable[[list[list[int]], list[int]], list[Any]] | None = None,
    ) -> None:
        # BatchSampler.__init__ only validates; the attributes Lightning and the tracker read are these
        self.sampler = original.sampler
        self.batch_size = original.batch_size
        self.drop_last = original.drop_last
        self.original = original
        self.sizes_for_pass = sizes_for_pass
        self.plain_length = plain_length
        self.choose = choose
        # per yielded batch: (raw window size, the cut or None)
        self.windows: deque[tuple[int, Any]] = deque()
        self._first_ordinal = 0
        # the cuts (or None) of the next pass's first batches, yielded as given instead of chosen: the
        # uninterrupted run cut them before a rollback, from scores a resume no longer holds
        self.given: deque[Any] = deque()
        # how many of `windows`' leading batches hold such a cut (given, or yielded before choose_again), and
        # whether the batch taken last did
        self.fixed_ahead = 0
        self.taken_fixed = False
        self._block: _Block | None = None  # the block being yielded

    def __iter__(self) -> Iterator[list[int]]:
        skip, sizes = self.sizes_for_pass()  # sets `given` for a resumed pass
        recorder = self.sampler if isinstance(self.sampler, RecordingSampler) else None
        self.windows.clear()
        self.fixed_ahead, self._block = 0, None
        source = iter(self.sampler) if recorder is None else recorder.begin_batch_pass()
        if skip:
            for _ in islice(source, skip):
                pass
        # the plain BatchSampler reads its sampler to the end where a pass reaches the data's end: before a
        # short last batch, else when asked past the last one (workers do). A sampler with its own generator
        # (RandomSampler) draws once more there, so a pass that stopped short left it a draw behind: the next
        # epoch's shuffle was another than the plain run's
        ends = self._ends_data(skip + int(sum(sizes)))
        # the plain pass's last batch is short (it read its sampler to the end before yielding it) whatever
        # the plan's last window is; at most the indices the length promises, and the one that ends them, are read
        short_end = ends and not self.drop_last and len(self.sampler) % self.batch_size != 0  # type: ignore[arg-type]
        rest = len(self.sampler) - skip - int(sum(sizes)) + 1 if ends else 0  # type: ignore[arg-type]
        # windows in blocks of CHOOSE_BLOCK batches (the sampler's order does not depend on training), so the
        # light ones of a block are chosen in one call, and a huge dataset's pass is never held whole
        ordinal = self._first_ordinal
        for first in range(0, len(sizes), self.CHOOSE_BLOCK):
            block = sizes[first : first + self.CHOOSE_BLOCK]
            order = list(islice(source, int(sum(block))))
            bounds = np.minimum(np.concatenate([[0], np.cumsum(block, dtype=np.int64)]), len(order))
            batches = [order[a:b] for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
            given = self._take_given(batches)
            self._block = current = _Block(batches, [None] * len(batches), ordinal, given)
            self._choose_from(given)
            for k, batch in enumerate(batches):
                # read at its turn, not before: choose_again may have cut it again since the block was chosen
                cut = self.given.popleft() if k < given else current.cuts[k]
                current.undrawn = k + 1
                self.windows.append((len(batch), cut))
                self.fixed_ahead += k < given
                if recorder is not None:
                    recorder.record_batch(batch if cut is None else cut.indices.numpy())
                if short_end and first + k == len(sizes) - 1:
                    for _ in islice(source, rest):
                        pass
                yield batch if cut is None else cut.indices.tolist()
            if len(batches) < len(block):  # the sampler ran out
                return
            ordinal += len(block)
        if ends:
            for _ in islice(source, rest):
                pass

    def _ends_data(self, taken: int) -> bool:
        """Whether a pass that reads ``taken`` indices ends where the plain BatchSampler reads its sampler to
        the end (a pass the plan cuts short, at the run's end, does not; nor one of a sampler without a length,
        which may never end)."""
        try:
            rest = len(self.sampler)  # type: ignore[arg-type]
        except (TypeError, NotImplementedError):
            return False
        return rest - taken < (self.batch_size if self.drop_last else 1)

    def _take_given(self, batches: list[list[int]]) -> int:
        """How many of ``batches``, from the first, take their cut from :attr:`given`: those whose given cut
        fits (``None`` for a plain batch, else indices of its window). A resume planned otherwise than its
        checkpoint (other settings) draws other windows: the cuts that do not fit are dropped and chosen."""
        fits = 0
        for cut, batch in zip(self.given, batches):
            light = len(batch) > self.batch_size
            if (cut is not None) != light or (light and not np.isin(cut.indices.numpy(), batch).all()):
                self.given = deque(islice(self.given, fits))
                break
            fits += 1
        return fits

    def _choose_from(self, start: int) -> None:
        """Cut the current block's light windows from its ``start``-th batch on."""
        block = self._block
        assert block is not None
        batches = block.batches
        light = [k for k in range(start, len(batches)) if len(batches[k]) > self.batch_size]
        if light and self.choose is not None:
            chosen = self.choose([batches[k] for k in light], [block.ordinal + k for k in light])
            for k, cut in zip(light, chosen):
                block.cuts[k] = cut

    def choose_again(self) -> None:
        """Cut the pass's windows not yet yielded again, from the scores as they are now (a rollback restored
        older ones); the batches already yielded (loaded, or being loaded) keep their cuts, which a resume
        cannot choose again: :meth:`fixed_cuts` lists them. Later blocks are cut when reached anyway."""
        if self._block is not None:
            self._choose_from(max(self._block.undrawn, self._block.given))
        self.fixed_ahead = len(self.windows)

    def fixed_cuts(self) -> list[Any]:
        """The cuts (or ``None``) of the batches after the one taken last whose cut a resume could not choose
        again (see :attr:`given`), in order; normally none."""
        return [cut for _, cut in islice(self.windows, self.fixed_ahead)] + list(self.given)

    def start_pass_at(self, ordinal: int) -> None:
        """The epoch ordinal of the next pass's first batch (a resumed pass starts past its trained batches)."""
        self._first_ordinal = ordinal

    def take_window(self) -> tuple[int, Any]:
        """``(raw size, cut)`` of the oldest batch not yet taken (batches are taken in the order yielded)."""
        self.taken_fixed = self.fixed_ahead > 0
        self.fixed_ahead = max(0, self.fixed_ahead - 1)
        return self.windows.popleft()

    def __len__(self) -> int:
        return self.plain_length


def draws_each_index_once(sampler: Any) -> bool:
    """Whether the index ``sampler`` draws no dataset index twice in a pass, over every rank's shard: torch's
    ``SequentialSampler``, ``RandomSampler`` without replacement over at most its data,
    ``SubsetRandomSampler`` of distinct indices, and ``DistributedSampler`` with no padding sample (its
    shards split one permutation). Any other may repeat one (a ``WeightedRandomSampler``, a class-balanced
    sampler drawing with replacement, Lightning's wrapper of a custom sampler), so a pass's later choice of
    its window could read a score from the same pass: see
    :meth:`~lightning_pulse.core.sample_scores.SampleScoreTable.begin_pass`."""
    kind = type(sampler)
    if kind is SequentialSampler:
        return True
    if kind is RandomSampler:
        return not sampler.replacement and sampler.num_samples <= len(sampler.data_source)
    if kind is SubsetRandomSampler:
        indices = np.asarray(sampler.indices)
        return bool(np.unique(indices).size == indices.size)
    if kind is DistributedSampler:
        return sampler.total_size <= len(sampler.dataset)  # type: ignore[arg-type]  # no padding sample
    return False


class RanksReadAhead:
    """Under data parallelism, every rank's :meth:`PlannedBatchSampler.fixed_cuts` (as checkpoint states), for
    the checkpoint that rank 0 alone writes: each rank's list as it stood when it was gathered (a rollback) or
    restored (a resume), and how many batches the fit had drawn then. Every rank draws the same number of
    batches (one a micro-batch, in lockstep), so a rank's list later is the rest past the batches drawn since;
    nothing is exchanged per step."""

    def __init__(self) -> None:
        self.lists: list[list[Any]] | None = None  # rank r's at [r]; None: no rank holds such a cut
        self.drawn_at = 0

    def set(self, lists: list[list[Any]] | None, drawn: int) -> None:
        self.lists, self.drawn_at = lists, drawn

    def of_ranks(
        self, rank: int, own: list[Any], drawn: int, latest_untrained: bool
    ) -> list[list[Any]] | None:
        """Every rank's list now, ``own`` for ``rank``; with ``latest_untrained`` the batch drawn last (still
        in flight) leads each list that held it. ``None`` when none was gathered."""
        if self.lists is None:
            return None
        since = drawn - self.drawn_at
        ranks = []
        for other, cuts in enumerate(self.lists):
            start = since - 1 if latest_untrained and 0 < since <= len(cuts) else since
            ranks.append(own if other == rank else cuts[start:])
        return ranks


def read_ahead_of_rank(
    of_ranks: list[list[Any]] | None, saved: list[Any], rank: int, world_size: int
) -> tuple[list[Any], list[list[Any]] | None, str | None]:
    """``(this rank's cuts, every rank's, a warning)`` of a resumed pass's batches drawn ahead of a rollback,
    from a checkpoint holding every rank's (``of_ranks``) or, older or from one process, its writer's
    (``saved``). A rank whose cuts it lacks chooses those batches again from the restored scores (other
    samples than the uninterrupted run's), which the warning says (the same on every rank)."""
    if of_ranks is not None:
        if len(of_ranks) == world_size:
            return list(of_ranks[rank]), of_ranks, None
        lacking = f"the cuts of {len(of_ranks)} processes, not of this run's {world_size}: every rank chooses"
        return [], None, _READ_AHEAD_LACKING.format(lacking=lacking, way_out=f"on {len(of_ranks)} processes")
    if world_size == 1 or not saved:
        return list(saved), None, None
    lists = [list(saved)] + [[] for _ in range(world_size - 1)]
    others = "rank 1 chooses" if world_size == 2 else f"ranks 1 to {world_size - 1} choose"
    lacking = f"one process's cuts only (saved by an earlier version, or by a single process): {others}"
    way_out = "on one process if one process saved it, else from a checkpoint saved by this version"
    note = _READ_AHEAD_LACKING.format(lacking=lacking, way_out=way_out)
    return lists[rank], lists, note


_READ_AHEAD_LACKING = (
    "HardSampleReplay: the checkpoint was saved after a StabilityGuard rollback, while DataLoader workers "
    "held batches drawn ahead of it whose cuts a resume cannot choose again, and holds {lacking} those "
    "batches again from the restored scores, so the resumed run trains other samples than the uninterrupted "
    "one. To reproduce it, resume {way_out}."
)


#: the way out when a batch's rows are not its drawn dataset indices (completes a sentence)
KEEP_ONE_ROW_PER_INDEX = (
    "keep one row per drawn index: return a stand-in sample from the Dataset, or leave the unreadable "
    "samples out of the Dataset before the fit, instead of dropping them in the collate_fn"
)


def unmatched_rows(batch: Any, *counts: int) -> int | None:
    """The rows ``batch`` holds when they are none of ``counts`` (how many dataset indices it stands for), as
    after a collate_fn that drops unreadable samples (7 rows for 8 drawn indices); ``None`` when they may be.

    The rows are the most common first dimension of its tensors; they may be one of ``counts`` when a
    tensor has one as its first or second dimension (time-major, ``(T, B)``), or when it holds no tensor of
    rank >= 1, or when it holds a list or tuple of one item per index (:func:`holds_item_per_sample`: a
    detection collate's ``tuple(zip(*items))``, whose ``(C, H, W)`` images count channels, not samples). A
    batch of sequences packed into one row (:func:`packed_sequence_rows`) holds its tokens' rows.
    """
    packed = packed_sequence_rows(batch, max(counts))
    if packed is not None:
        return packed
    if any(holds_item_per_sample(batch, count) for count in counts if count >= 2):
        return None
    shapes = [tensor.shape for tensor in batch_tensors(batch) if tensor.dim() > 0]
    if not shapes or any(shape[0] in counts or (len(shape) > 1 and shape[1] in counts) for shape in shapes):
        return None
    sizes = [int(shape[0]) for shape in shapes]
    return max(set(sizes), key=sizes.count)


def packed_sequence_rows(batch: Any, drawn: int) -> int | None:
    """The token count ``T`` of a batch that packs its ``drawn`` sequences into one row of ``T`` tokens (HF's
    ``DataCollatorWithFlattening``: ``input_ids``, ``labels`` and ``position_ids`` each ``(1, T)``), else
    ``None``. Told by every tensor being ``(1, T)`` with ``T >= drawn``, or by ``position_ids`` ``(1, T)``
    that restart within the row (next to flash-attention's ``cu_seq_lens``): one row for several indices is
    not a batch that lost samples, and no later batch holds a row per index."""
    tensors = [tensor for tensor in batch_tensors(batch) if tensor.dim() > 0]
    if drawn < 2 or not tensors or any(tensor.shape[0] == drawn for tensor in tensors):
        return None
    lengths = {int(tensor.shape[1]) for tensor in tensors if tensor.dim() == 2 and tensor.shape[0] == 1}
    if len(lengths) != 1 or (length := lengths.pop()) < drawn:
        return None
    if all(tensor.dim() == 2 and tensor.shape[0] == 1 for tensor in tensors):
        return length
    positions = batch.get("position_ids") if isinstance(batch, Mapping) else None
    if isinstance(positions, Tensor) and tuple(positions.shape) == (1, length) and length > 1:
        if bool((positions[0, 1:] <= positions[0, :-1]).any()):  # a new sequence starts at a lower position
            return length
    return None


def rows_short_of_indices(batch: Any, *counts: int) -> int | None:
    """:func:`unmatched_rows` when they are fewer than the most of ``counts`` (a collate_fn dropped samples);
    ``None`` also for a batch holding more rows than indices (packed rows: a graph batch's nodes, sequences
    packed into one row)."""
    rows = unmatched_rows(batch, *counts)
    return rows if rows is not None and rows < max(counts) else None


def unmatched_rows_cause(rows: int, drawn: int) -> str:
    """Says that a batch holds ``rows`` rows for its ``drawn`` dataset indices, and the likely cause."""
    if rows > drawn:
        return (
            f"the batch holds {rows} rows for the {drawn} dataset indices the sampler drew for it and no "
            f"tensor of {drawn} rows: more rows than samples (packed rows, as a graph batch's nodes or "
            "packed sequences' tokens), so a loss over its rows cannot be told by sample"
        )
    return (
        f"the batch holds {rows} rows for the {drawn} dataset indices the sampler drew for it (a collate_fn "
        "that drops samples, unreadable ones?), so its rows cannot be told by sample"
    )


#: the way out when a loss is over a batch's packed rows (completes a sentence)
SCORE_PACKED_ROWS = (
    "set `scorer=` to a PerSampleScorer that returns one loss per sample, e.g. "
    "lightning_pulse.core.per_sample_loss.OutputKeyScorer(key='per_sample_loss') with training_step "
    "returning {'loss': loss, 'per_sample_loss': per_sample}, each sample's mean over its rows: "
    "`per_sample = torch.zeros(B).index_add_(0, sample_of_row, per_row) / counts` of the "
    "`reduction='none'` loss, where sample_of_row is each row's sample (a graph batch's `batch` vector; for "
    "packed sequences `(position_ids[0] == 0).cumsum(0) - 1`, or read from `cu_seqlens`) (or a per-sample "
    "loss term in the loss itself, which is then captured)"
)
