"""Where a non-finite step comes from: the batch's data, or the model's own state. Plain torch.

StabilityGuard asks only after a step came out non-finite (a rare event), so none of this runs, or
synchronises, on a healthy step.

* :func:`batch_sample_count`: how many samples a batch holds (its index count, or the leading size all its
  tensors share).
* :func:`nonfinite_rows`: the sample rows of a batch holding a NaN or ``+inf`` (not ``-inf``: masks carry it
  on purpose). A batch made non-finite by its data is the data's fault: the model is healthy, the step is
  skipped and training goes on.
* :func:`without_bad_rows`, :func:`zero_filled` and :func:`data_explains_step`: whether the step's loss is
  finite without those rows, or (where the rows cannot be cut out) with its NaN and ``+inf`` values set to 0;
  if not, the data holds NaN on purpose (missing labels) or by chance, and the model is at fault.
* :func:`weights_are_finite`: whether the parameters and optimizer states are all finite. When they are not,
  skipping cannot help: the model itself went bad and has to go back to a snapshot. A parameter no optimizer
  step writes (frozen, or held by no optimizer: an EMA codebook a forward writes) counts with the forward
  state instead (:func:`~lightning_pulse.core.snapshots.written_outside`).
* :func:`nonfinite_forward_state`: the buffers and carried tensors a forward made bad (a NaN, or an infinity
  where the newest snapshot's copy was finite). A forward over bad data writes them (BatchNorm's running
  statistics), so with bad data they are mended, not rolled back.
* :func:`state_is_finite`: both of the above.
* :func:`forward_state_tensors`: the state a forward writes, by name, alike for the model and a snapshot.
* :func:`newly_nonfinite`: the tensors non-finite in an element where a saved copy was finite.
* :func:`finite_evidence`: the elements of the forward state after the fit's first forward a later infinity
  counts in, as masks (an infinity the first forward wrote counts unless it is a ``-inf`` mask).
* :func:`batch_sample_ids`: the dataset indices of given rows, when the batch, a callback that cut it, or its
  DataLoader tells them.
* :func:`trace_nonfinite`: the verdict on a non-finite step (``"state"``, ``"data"`` or neither), agreed by
  every DDP rank, with the bad samples.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor

from lightning_pulse.core.carried_state import carried_tensors, tensors_in
from lightning_pulse.core.selection import take_samples
from lightning_pulse.core.snapshots import nonfinite_tensors, written_outside
from lightning_pulse.energy.counting import leading_sizes

# the dict keys under which a batch commonly carries its samples' dataset indices
INDEX_KEYS = ("index", "indices", "idx", "sample_index", "sample_idx")

#: the fewest rows a batch cut of its bad rows keeps for its loss to be recomputed (:func:`without_bad_rows`)
MIN_ROWS_LEFT = 2


def _tensors(batch: Any) -> Iterator[Tensor]:
    if isinstance(batch, Tensor):
        yield batch
    elif isinstance(batch, Mapping):
        for value in batch.values():
            yield from _tensors(value)
    elif isinstance(batch, (list, tuple)):
        for value in batch:
            yield from _tensors(value)
    else:  # a dataclass or other container: its tensor attributes
        for value in getattr(batch, "__dict__", {}).values():
            if isinstance(value, (Tensor, Mapping, list, tuple)):
                yield from _tensors(value)


def batch_sample_count(batch: Any, index_counts: Iterable[int] = ()) -> int | None:
    """How many samples ``batch`` holds: the length of its index field (:data:`INDEX_KEYS`), else the first of
    ``index_counts`` (the lengths of the indices a replay callback trained, of the loader's) that is the
    leading size of one of its tensors; else the leading size all its tensors of rank >= 1 share; ``None``
    (not known) when they differ or there is none. A guess from differing sizes named the wrong rows: the
    first tensor's (a tie) made time step 2 of a time-major ``(5, 16, F)`` input beside ``(16,)`` labels a
    sample row, and the size most tensors share made node 4 of a graph batch (node features ``(40, F)``, a
    node-to-graph ``batch (40,)``, labels ``(4,)``) sample 4."""
    # EnergyLogger's reading, else the tensors found here (held as an object's attributes: not read there)
    sizes = leading_sizes(batch) or [int(tensor.shape[0]) for tensor in _tensors(batch) if tensor.dim()]
    for count in [*(len(field) for field in _index_fields(batch)), *index_counts]:
        if count in sizes:
            return count
    return sizes[0] if sizes and len(set(sizes)) == 1 else None


def nonfinite_rows(batch: Any, sample_count: int | None = None) -> list[int] | None:
    """The sample rows of ``batch`` holding a NaN or ``+inf`` floating-point value, over every tensor in it
    (nested dicts, lists, tuples): positions along dimension 0 of the tensors whose leading size is the
    batch's ``sample_count`` (by default :func:`batch_sample_count`). ``[]`` when the batch has none; ``None``
    when such a value sits in a tensor of another leading size (the node features of a graph batch, a
    time-major ``(T, B, F)`` tensor, a 0-dim value), or the sample count is not known: the batch is bad, but
    which samples hold it is not known.
    Counted as sample rows, node 4 of a graph batch was named as graph 4. One transfer, and one per bad
    tensor.

    ``-inf`` does not count: batches carry it on purpose, as an additive attention or padding mask that the
    model reads, so it is no evidence against the data. Counted, it had made every step of such a batch "the
    data's fault": a model whose outputs went NaN was skipped at every step as bad data, never rolled back or
    stopped. A ``-inf`` that really is a bad value (``log(0)`` in a feature) makes an ordinary non-finite step:
    skipped, and when it recurs on the snapshot a rollback would go back to, skipped as the data's again
    (:class:`~lightning_pulse.core.stability_policy.EscalationPolicy`)."""
    bad = []  # (the tensor, which of its rows hold a bad value)
    for tensor in _tensors(batch):
        if tensor.is_floating_point() or tensor.is_complex():
            values = tensor.detach()
            finite = torch.isfinite(values) if values.is_complex() else ~(values.isnan() | values.isposinf())
            # the row width spelt out, not -1: a tensor with a zero-size dimension (an image's (0, 4) boxes)
            # cannot be reshaped with -1
            width = math.prod(finite.shape[1:])
            rows = ~(finite.reshape(finite.shape[0], width).all(dim=1) if finite.dim() else finite.reshape(1))
            bad.append((tensor, rows))
    if not bad:
        return []
    device = bad[0][1].device
    flags = torch.stack([rows.any().to(device) for _, rows in bad]).cpu().tolist()  # one transfer if clean
    bad = [pair for pair, flagged in zip(bad, flags) if flagged]
    if not bad:
        return []
    count = batch_sample_count(batch) if sample_count is None else sample_count
    if any(tensor.dim() == 0 or tensor.shape[0] != count for tensor, _ in bad):
        return None
    found = torch.zeros(count, dtype=torch.bool)
    for _, rows in bad:
        found |= rows.cpu()
    return found.nonzero().flatten().tolist()


def without_bad_rows(batch: Any, rows: Sequence[int] | None, sample_count: int) -> Any | None:
    """``batch`` without its ``rows`` (of ``sample_count``; :func:`nonfinite_rows`), as a new batch of the
    same structure (:func:`~lightning_pulse.core.selection.take_samples`), to recompute a non-finite step's
    loss without them; ``None`` where that cannot be: rows unknown, fewer than :data:`MIN_ROWS_LEFT` left
    (one row's loss normalised by batch statistics, BatchNorm's, is NaN: a real data fault was charged to
    the model), or a NaN or ``+inf`` still in what is left (a part the cut did not reach)."""
    if not rows or sample_count - len(rows) < MIN_ROWS_LEFT:
        return None
    kept = torch.ones(sample_count, dtype=torch.bool)
    kept[list(rows)] = False
    cut = take_samples(batch, kept.nonzero().flatten(), sample_count)
    return cut if nonfinite_rows(cut, sample_count - len(rows)) == [] else None


def zero_filled(batch: Any) -> Any | None:
    """``batch`` with every NaN and ``+inf`` of its floating-point (and each non-finite value of its complex)
    tensors set to 0, as a new batch of the same structure and shapes: to recompute a non-finite step's loss
    where its bad rows cannot be cut out (rows unknown, too few left, a module that cannot take a smaller
    batch). ``-inf`` is left: a mask holds it on purpose (:func:`nonfinite_rows`). ``None`` where a NaN or
    ``+inf`` is still left (in an object the copy does not reach)."""

    def fill(tensor: Tensor) -> Tensor:
        if tensor.is_complex():
            return torch.where(torch.isfinite(tensor), tensor, torch.zeros((), dtype=tensor.dtype))
        if not tensor.is_floating_point():
            return tensor
        bad = tensor.isnan() | tensor.isposinf()
        return tensor.masked_fill(bad, 0)

    filled = apply_to_collection(batch, Tensor, lambda tensor: fill(tensor.detach()))
    return filled if nonfinite_rows(filled) == [] else None


def _all_finite(tensors: Sequence[Tensor]) -> bool:
    if not tensors:
        return True
    device = tensors[0].device
    return bool(torch.stack([torch.isfinite(t.detach()).all().to(device) for t in tensors]).all().item())


def weights_are_finite(
    module: torch.nn.Module, optimizers: Iterable[torch.optim.Optimizer] = (), leave_out: Iterable[str] = ()
) -> bool:
    """Whether every floating-point parameter (but those named in ``leave_out``) and optimizer-state tensor is
    finite: what only an optimizer step writes, so a skipped step leaves it as it was. One transfer."""
    left_out = set(leave_out)
    tensors = [t for name, t in module.named_parameters() if t.is_floating_point() and name not in left_out]
    for optimizer in optimizers:
        for state in optimizer.state.values():
            tensors.extend(v for v in state.values() if isinstance(v, Tensor) and v.is_floating_point())
    return _all_finite(tensors)


def forward_state_tensors(buffers: Mapping[str, Tensor], carried: Mapping[str, Any]) -> dict[str, Tensor]:
    """The state a forward writes, by name: the ``buffers``, then the ``carried`` tensors (see
    :func:`~lightning_pulse.core.carried_state.carried_tensors`), a lone tensor under its attribute's name and
    each of a tuple, list or dict of them as ``"name[i]"``. A snapshot's copy and the live model's are named
    alike, so they compare name by name."""
    named = dict(buffers)
    for name, value in carried.items():
        # a sparse attribute (a graph's adjacency) is read, not written, and no element-wise check takes it
        tensors = tuple(tensor for tensor in tensors_in(value) if tensor.layout is torch.strided)
        if not tensors:
            continue
        named.update(
            {name: tensors[0]} if len(tensors) == 1 else {f"{name}[{i}]": t for i, t in enumerate(tensors)}
        )
    return named


def newly_nonfinite(
    current: Mapping[str, Tensor], saved: Mapping[str, Tensor], names: Iterable[str]
) -> list[str]:
    """Of ``names`` (keys of ``current``), those non-finite in an element where their copy in ``saved`` (same
    shape) was finite: ``[-inf, 0.5]`` then ``[-inf, inf]`` counts, a ``-inf`` mask held alike does not. A
    boolean tensor in ``saved`` is the mask of the elements that were finite (:func:`finite_evidence`). One
    element-wise pass and one transfer a name: meant for the few tensors found non-finite."""
    found = []
    for name in names:
        now, then = current[name].detach(), saved.get(name)
        if then is not None and then.shape == now.shape:
            finite_then = then if then.dtype == torch.bool else torch.isfinite(_comparable(then))
            became = ~torch.isfinite(_comparable(now)) & finite_then.to(now.device)
            if bool(became.any()):
                found.append(name)
    return found


def finite_evidence(
    current: Mapping[str, Tensor], before: Mapping[str, Tensor]
) -> tuple[dict[str, Tensor], bool]:
    """Which elements of the forward state ``current`` (named by :func:`forward_state_tensors`) a later
    infinity counts in (:func:`newly_nonfinite`), as CPU boolean masks: where ``current`` is finite, and where
    it is NaN or ``+inf`` but ``before`` (the same names, taken before the fit's first forward) was finite.
    A ``-inf`` there is by design (a causal mask the first forward fills: ``-inf`` is what masks hold, as for
    :func:`nonfinite_rows`); a ``+inf`` is an overflow (BatchNorm's running variance after a batch of huge
    values) or a bad batch's write (its running mean after a ``+inf`` row), and counts. An all-finite tensor
    costs nothing (an expanded ``True``); only a tensor holding a non-finite value keeps a mask, a byte an
    element. Returns the masks and whether ``before`` made one count where ``current`` alone would not."""
    evidence, overflowed_any = {}, False
    for name, tensor in current.items():
        now = _comparable(tensor.detach())
        finite = torch.isfinite(now)
        if bool(finite.all()):
            evidence[name] = torch.ones((), dtype=torch.bool).expand(tensor.shape)
            continue
        then = before.get(name)
        if then is not None and then.shape == tensor.shape:
            overflowed = torch.isfinite(_comparable(then)).to(now.device) & ~finite & ~torch.isneginf(now)
            overflowed_any |= bool(overflowed.any())
            finite |= overflowed
        evidence[name] = finite.cpu()
    return evidence, overflowed_any


def _comparable(tensor: Tensor) -> Tensor:
    return tensor.float() if tensor.element_size() == 1 else tensor  # float8 has no isfinite


def nonfinite_forward_state(module: torch.nn.Module, saved: Mapping[str, Tensor] | None = None) -> list[str]:
    """The buffers (qualified names) and carried tensors (dotted attribute names, see
    :func:`~lightning_pulse.core.carried_state.carried_tensors`) that a forward made bad: holding a NaN, or an
    infinity in an element where their copy in ``saved`` (the newest snapshot's, named by
    :func:`forward_state_tensors`; same shape) was finite (:func:`newly_nonfinite`). A batch with non-finite
    data makes BatchNorm's running statistics or an RNN's carried hidden state NaN in its forward, before any
    step; an overflowing one can make them infinite.

    An infinity the snapshot held too, or one with no saved copy to compare with, is no evidence: a buffer can
    hold it by design (a ``-inf`` causal mask, an observer's starting ``inf``), which is why snapshots keep it
    (:meth:`~lightning_pulse.core.stability_steps.StabilityCore.nonfinite_state`). Counted, such a mask had
    blamed every overflow inside the forward on the model's state: rolled back at once, then stopped. Two
    transfers, and one a tensor found infinite, on a non-finite step only."""
    carried = carried_tensors(module)
    buffers = dict(module.named_buffers())
    current = forward_state_tensors(buffers, carried)
    bad = set(nonfinite_tensors({}, nan_only=current))
    infinite = [name for name in nonfinite_tensors(current) if name not in bad]
    bad.update(newly_nonfinite(current, saved or {}, infinite))
    owners = (name if name in buffers or name in carried else name[: name.rindex("[")] for name in current)
    return list(dict.fromkeys(owner for owner, name in zip(owners, current) if name in bad))


def state_is_finite(module: torch.nn.Module, optimizers: Iterable[torch.optim.Optimizer] = ()) -> bool:
    """Whether every floating-point parameter and optimizer-state tensor is finite and no buffer or carried
    tensor (a plain tensor attribute, such as an RNN's hidden state) holds a NaN: :func:`nonfinite_forward_state`
    with no snapshot to compare with, where an infinity can be by design."""
    return weights_are_finite(module, optimizers) and not nonfinite_forward_state(module)


def _index_fields(batch: Any) -> list[Tensor]:
    """The 1-D integer tensors a dict batch holds under an index key (:data:`INDEX_KEYS`)."""
    if not isinstance(batch, Mapping):
        return []
    return [batch[key] for key in INDEX_KEYS if key in batch and _is_index_tensor(batch[key])]


def _is_index_tensor(value: Any) -> bool:
    return isinstance(value, Tensor) and value.dim() == 1 and not value.is_floating_point()


def batch_sample_ids(
    batch: Any,
    rows: Sequence[int] | None,
    loader_indices: Tensor | None = None,
    sample_count: int | None = None,
    trained_indices: Tensor | None = None,
) -> list[int] | None:
    """The dataset indices of ``rows``: from an index field of a dict batch (:data:`INDEX_KEYS`), else from
    ``trained_indices`` (those of the samples the step trained, where a callback cut the batch in place:
    ``HardSampleReplay.trained_indices``), else from ``loader_indices`` (the batch's indices as the DataLoader
    drew them, e.g. a ``SampleIndexTracker``'s), else ``None``. Indices count only when there are as many as
    the batch's samples (``sample_count``, by default :func:`batch_sample_count`): the loader's 8 for a batch
    cut to 4 rows, or for 7 rows left by a collate_fn that dropped a corrupt sample, had named a row by
    another sample's index."""
    if not rows:
        return None
    given = [t for t in (trained_indices, loader_indices) if t is not None and _is_index_tensor(t)]
    if sample_count is None:
        sample_count = batch_sample_count(batch, [len(t) for t in given])
    for found in [*_index_fields(batch), *given]:
        if len(found) == sample_count and max(rows) < sample_count:
            return found.detach().cpu()[list(rows)].tolist()
    return None


def _bad_batches(
    batches: Sequence[tuple[int, Any]], loader: Any, trained: Mapping[int, Tensor] | None
) -> Iterator[tuple[int, Any, int | None, list[int] | None, list[int] | None]]:
    """``(batch_idx, batch, sample count, bad rows, their dataset indices)`` for each micro-batch (bad rows
    ``[]``: a clean one; ``None``: bad, which rows unknown)."""
    from lightning_pulse.core.sample_index import RecordingSampler

    sampler = getattr(getattr(loader, "batch_sampler", None), "sampler", None)
    tracker = getattr(sampler, "tracker", None) if isinstance(sampler, RecordingSampler) else None
    for batch_idx, batch in batches:
        cut = (trained or {}).get(batch_idx)
        try:
            drawn = tracker.batch_indices(batch_idx) if tracker is not None else None
        except RuntimeError:  # not recorded (the tracker's pass started elsewhere): rows and step only
            drawn = None
        given = [t for t in (cut, drawn) if t is not None and _is_index_tensor(t)]
        count = batch_sample_count(batch, [len(t) for t in given])
        rows = nonfinite_rows(batch, count)
        ids = batch_sample_ids(batch, rows, drawn, count, cut) if rows else None
        yield batch_idx, batch, count, rows, ids


def find_bad_samples(
    batches: Sequence[tuple[int, Any]],
    step: int,
    loader: Any = None,
    trained: Mapping[int, Tensor] | None = None,
) -> list[dict[str, Any]]:
    """The samples holding non-finite values in the micro-batches ``(batch_idx, batch)`` of optimizer step
    ``step``: one ``{"step", "batch_idx", "rows", "indices"}`` per bad batch (``rows``: sample rows within
    the batch, ``None`` when the value is in a tensor without one row per sample, :func:`nonfinite_rows`;
    ``indices``: their dataset indices, from the batch, from ``trained`` (batch_idx to the indices of the
    samples trained, where a callback cut the batch) or from a ``SampleIndexTracker`` installed on
    ``loader``, else ``None``: :func:`batch_sample_ids`)."""
    return [
        {"step": step, "batch_idx": batch_idx, "rows": rows, "indices": ids}
        for batch_idx, _, _, rows, ids in _bad_batches(batches, loader, trained)
        if rows != []
    ]


def describe_bad_samples(samples: Sequence[Mapping[str, Any]]) -> str:
    """``"batch 3 rows [5] (dataset indices [812])"``, for a message."""
    parts = []
    for sample in samples:
        where = f" (dataset indices {sample['indices']})" if sample["indices"] is not None else ""
        rows = "(rows unknown)" if sample["rows"] is None else f"rows {sample['rows']}"
        parts.append(f"batch {sample['batch_idx']} {rows}{where}")
    return ", ".join(parts) or "on another rank"


#: the losses of ``(batch_idx, batch)`` micro-batches at the current weights, ``None`` for one that gives none
LossesOf = Callable[[list[tuple[int, Any]]], list[float | None]]


def trace_nonfinite(
    module: torch.nn.Module,
    optimizers: Iterable[torch.optim.Optimizer],
    batches: Sequence[tuple[int, Any]],
    step: int,
    loader: Any = None,
    all_reduce_sum: Callable[[Tensor], Tensor] | None = None,
    saved_forward_state: Mapping[str, Tensor] | None = None,
    trained: Mapping[int, Tensor] | None = None,
    losses_of: LossesOf | None = None,
    presume_data: bool = True,
) -> tuple[str | None, list[dict[str, Any]], bool]:
    """Where the non-finite optimizer step ``step`` came from, the same answer on every rank:
    ``(cause, samples, unchecked)``.

    ``("state", [], False)`` if the weights (:func:`weights_are_finite`: the parameters an optimizer step
    writes, and the optimizer states) are non-finite on any rank. Else, if
    a micro-batch ``(batch_idx, batch)`` held a NaN or ``+inf`` on any rank: ``("data", samples, unchecked)``
    (``samples``: this rank's, :func:`find_bad_samples` with ``trained``; empty on a rank whose batches were
    clean) when the data explains the step (:func:`data_explains_step`, with ``losses_of``: the loss is
    finite without the bad rows, or with them set to 0); ``unchecked`` when that could not be checked, and
    then only if ``presume_data``. When only ``presume_data=False`` kept the step from the data: ``(None,
    samples, True)``, whatever the forward state holds: the bad batch's own forward may have written it, so
    the caller mends it and tests the batch at a snapshot (the data's if non-finite there too). Taken as the
    state's, 80% of the steps of a module with BatchNorm that cannot take a smaller
    batch, on data with one corrupt sample in 40, had rolled back at once, and stopped the run. Otherwise,
    as for a step without bad data: ``("state", [], False)`` if a forward made the forward state bad on any
    rank (:func:`nonfinite_forward_state`, against ``saved_forward_state``: the newest snapshot's), or a
    parameter no optimizer step writes holds a NaN or an infinity
    (:func:`~lightning_pulse.core.snapshots.written_outside`: an EMA codebook kept in parameters, which a
    forward over bad data makes NaN as it does BatchNorm's statistics), else ``(None, [], False)``.

    NaN in the data is no proof: data can hold it on purpose (missing labels a multi-task loss masks out).
    Taken as proof, every overflow of such a model was skipped as bad data, never rolled back or stopped.
    Bad data wins over a non-finite forward state because the bad batch's own forward wrote it (BatchNorm's
    running statistics take the NaN rows' mean): the caller skips the step and mends that state
    (:meth:`~lightning_pulse.core.stability_steps.StabilityCore.mend_forward_state`). Under DDP
    ``all_reduce_sum`` sums the three findings over ranks (one small collective, on this rare step only; every
    rank reaches it, since the verdict came from all-reduced numbers), and the check's two.
    """
    traced = list(_bad_batches(batches, loader, trained))
    samples = [
        {"step": step, "batch_idx": batch_idx, "rows": rows, "indices": ids}
        for batch_idx, _, _, rows, ids in traced
        if rows != []
    ]
    optimizers = list(optimizers)
    # the parameters a forward writes (an EMA codebook) go bad with the forward state, by the data's fault too
    outside = written_outside(module, optimizers)
    weights_bad = not weights_are_finite(module, optimizers, leave_out=outside)
    forward_bad = bool(nonfinite_forward_state(module, saved_forward_state) or nonfinite_tensors(outside))
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    flags = torch.tensor([float(bool(samples)), float(weights_bad), float(forward_bad)], device=device)
    if all_reduce_sum is not None:
        flags = all_reduce_sum(flags)
    data_bad, weights_bad, forward_bad = (bool(flag) for flag in flags.tolist())
    if weights_bad:
        return "state", [], False
    explained, unchecked = (
        data_explains_step(traced, losses_of, all_reduce_sum, device) if data_bad else (False, False)
    )
    if explained and (presume_data or not unchecked):
        return "data", samples, unchecked
    if explained:  # unchecked, and bad data no longer presumed: the caller tests it at a snapshot
        return None, samples, True
    return ("state" if forward_bad else None), [], False


def data_explains_step(
    traced: Sequence[tuple[int, Any, int | None, list[int] | None, Any]],
    losses_of: LossesOf | None,
    all_reduce_sum: Callable[[Tensor], Tensor] | None = None,
    device: torch.device | None = None,
) -> tuple[bool, bool]:
    """Whether the bad values of a non-finite step explain it (``traced``: its micro-batches as
    :func:`_bad_batches` reads them): ``(explained, unchecked)``. Each micro-batch's loss is recomputed
    (``losses_of``, at the weights of the step) without its bad rows (:func:`without_bad_rows`), a clean one
    as it is; where the rows cannot be cut out (rows unknown, fewer than :data:`MIN_ROWS_LEFT` left, or no
    loss on the smaller batch: a shape fixed in the module), with its NaN and ``+inf`` values set to 0
    (:func:`zero_filled`) instead. A non-finite loss among them is the model's (not explained): without that
    second check, every batch holding NaN in each row on purpose (a task with no label) had its model's
    overflows skipped as bad data. ``unchecked``: some bad micro-batch could be checked neither way (no
    loss either way, or no ``losses_of``: a finite loss tells nothing of a non-finite gradient), so the data
    is presumed at fault. Under DDP every rank runs two forwards per micro-batch, the second only where its
    first gave no loss (else as it is, its loss unused), so that their forwards' collectives
    (SyncBatchNorm) pair up; ``all_reduce_sum`` sums the two findings."""
    if losses_of is None:
        return True, True
    cuts, fills = [], []  # per micro-batch: what the first and the second forward run (None: none)
    for batch_idx, batch, count, rows, _ in traced:
        if rows == []:
            cuts.append((batch_idx, batch))
            fills.append(None)
            continue
        cut = None if rows is None or count is None else without_bad_rows(batch, rows, count)
        cuts.append(None if cut is None else (batch_idx, cut))
        filled = zero_filled(batch)
        fills.append(None if filled is None else (batch_idx, filled))
    distributed = all_reduce_sum is not None
    first = _run_each(losses_of, cuts, traced, distributed)
    seconds = [fill if loss is None else None for fill, loss in zip(fills, first)]  # only where needed
    second = _run_each(losses_of, seconds, traced, distributed)
    judged = [loss if loss is not None else other for loss, other in zip(first, second)]
    bad = [rows != [] for _, _, _, rows, _ in traced]
    refuted = any(loss is not None and not math.isfinite(loss) for loss in judged)
    unchecked = any(loss is None and is_bad for loss, is_bad in zip(judged, bad))
    if all_reduce_sum is not None:
        found = all_reduce_sum(torch.tensor([float(refuted), float(unchecked)], device=device))
        refuted, unchecked = (bool(flag) for flag in found.tolist())
    return not refuted, unchecked


def _run_each(
    losses_of: LossesOf,
    runs: Sequence[tuple[int, Any] | None],
    traced: Sequence[tuple[int, Any, Any, Any, Any]],
    distributed: bool,
) -> list[float | None]:
    """The losses of the ``runs`` (``None`` where none is wanted); under DDP every micro-batch runs (a
    ``None`` one as it is, its loss dropped), so each rank runs as many forwards."""
    wanted = [run is not None for run in runs]
    if distributed:
        runs = [run if run is not None else (item[0], item[1]) for run, item in zip(runs, traced)]
    else:
        runs = [run for run in runs if run is not None]
    losses = iter(losses_of(list(runs)) if runs else [])
    found = []
    for want in wanted:
        loss = next(losses) if distributed or want else None
        found.append(loss if want else None)
    return found
