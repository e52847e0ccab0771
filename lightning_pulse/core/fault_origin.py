"""Where a non-finite step comes from: the batch's data, or the model's own state. Plain torch.

StabilityGuard asks only after a step came out non-finite (a rare event), so none of this runs, or
synchronises, on a healthy step.

* :func:`nonfinite_rows`: the rows of a batch holding a NaN or ``+inf`` (not ``-inf``: masks carry it on
  purpose). A batch made non-finite by its data is the data's fault: the model is healthy, the step is skipped
  and training goes on.
* :func:`weights_are_finite`: whether the parameters and optimizer states are all finite. When they are not,
  skipping cannot help: the model itself went bad and has to go back to a snapshot.
* :func:`nonfinite_forward_state`: the buffers and carried tensors a forward made bad (a NaN, or an infinity
  where the newest snapshot's copy was finite). A forward over bad data writes them (BatchNorm's running
  statistics), so with bad data they are mended, not rolled back.
* :func:`state_is_finite`: both of the above.
* :func:`forward_state_tensors`: the state a forward writes, by name, alike for the model and a snapshot.
* :func:`newly_nonfinite`: the tensors non-finite in an element where a saved copy was finite.
* :func:`batch_sample_ids`: the dataset indices of given rows, when the batch or its DataLoader tells them.
* :func:`trace_nonfinite`: the verdict on a non-finite step (``"state"``, ``"data"`` or neither), agreed by
  every DDP rank, with the bad samples.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_pulse.core.carried_state import carried_tensors, tensors_in
from lightning_pulse.core.snapshots import nonfinite_tensors

# the dict keys under which a batch commonly carries its samples' dataset indices
INDEX_KEYS = ("index", "indices", "idx", "sample_index", "sample_idx")


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


def nonfinite_rows(batch: Any) -> list[int]:
    """The positions along dimension 0 of the rows holding a NaN or ``+inf`` floating-point value, over every
    tensor in ``batch`` (nested dicts, lists, tuples). ``[]`` when the batch has none. One transfer.

    ``-inf`` does not count: batches carry it on purpose, as an additive attention or padding mask that the
    model reads, so it is no evidence against the data. Counted, it had made every step of such a batch "the
    data's fault": a model whose outputs went NaN was skipped at every step as bad data, never rolled back or
    stopped. A ``-inf`` that really is a bad value (``log(0)`` in a feature) makes an ordinary non-finite step:
    skipped, and when it recurs on the snapshot a rollback would go back to, skipped as the data's again
    (:class:`~lightning_pulse.core.stability_policy.EscalationPolicy`)."""
    masks = []
    for tensor in _tensors(batch):
        if tensor.is_floating_point() or tensor.is_complex():
            values = tensor.detach()
            finite = torch.isfinite(values) if values.is_complex() else ~(values.isnan() | values.isposinf())
            rows = finite.reshape(finite.shape[0], -1).all(dim=1) if finite.dim() else finite.reshape(1)
            masks.append(~rows.cpu())
    if not masks:
        return []
    bad = torch.zeros(max(len(mask) for mask in masks), dtype=torch.bool)
    for mask in masks:
        bad[: len(mask)] |= mask
    return bad.nonzero().flatten().tolist()


def _all_finite(tensors: Sequence[Tensor]) -> bool:
    if not tensors:
        return True
    device = tensors[0].device
    return bool(torch.stack([torch.isfinite(t.detach()).all().to(device) for t in tensors]).all().item())


def weights_are_finite(module: torch.nn.Module, optimizers: Iterable[torch.optim.Optimizer] = ()) -> bool:
    """Whether every floating-point parameter and optimizer-state tensor is finite: what only an optimizer step
    writes, so a skipped step leaves it as it was. One transfer."""
    tensors = [t for t in module.parameters() if t.is_floating_point()]
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
        tensors = tensors_in(value)
        named.update(
            {name: tensors[0]} if len(tensors) == 1 else {f"{name}[{i}]": t for i, t in enumerate(tensors)}
        )
    return named


def newly_nonfinite(
    current: Mapping[str, Tensor], saved: Mapping[str, Tensor], names: Iterable[str]
) -> list[str]:
    """Of ``names`` (keys of ``current``), those non-finite in an element where their copy in ``saved`` (same
    shape) was finite: ``[-inf, 0.5]`` then ``[-inf, inf]`` counts, a ``-inf`` mask held alike does not. One
    element-wise pass and one transfer a name: meant for the few tensors found non-finite."""
    found = []
    for name in names:
        now, then = current[name].detach(), saved.get(name)
        if then is not None and then.shape == now.shape:
            became = ~torch.isfinite(_comparable(now)) & torch.isfinite(_comparable(then)).to(now.device)
            if bool(became.any()):
                found.append(name)
    return found


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


def batch_sample_ids(
    batch: Any, rows: Sequence[int], loader_indices: Tensor | None = None
) -> list[int] | None:
    """The dataset indices of ``rows``: from an index field of a dict batch (:data:`INDEX_KEYS`), else from
    ``loader_indices`` (the batch's indices as the DataLoader drew them, e.g. a ``SampleIndexTracker``'s),
    else ``None``. Indices that do not line up with the batch (a batch recomposed on the way) give ``None``."""
    candidates = []
    if isinstance(batch, Mapping):
        candidates = [batch[key] for key in INDEX_KEYS if key in batch]
    if loader_indices is not None:
        candidates.append(loader_indices)
    for indices in candidates:
        if isinstance(indices, Tensor) and indices.dim() == 1 and not indices.is_floating_point():
            if rows and max(rows) < len(indices):
                return indices.detach().cpu()[list(rows)].tolist()
    return None


def find_bad_samples(
    batches: Sequence[tuple[int, Any]], step: int, loader: Any = None
) -> list[dict[str, Any]]:
    """The samples holding non-finite values in the micro-batches ``(batch_idx, batch)`` of optimizer step
    ``step``: one ``{"step", "batch_idx", "rows", "indices"}`` per bad batch (``indices``: dataset indices,
    from the batch or from a ``SampleIndexTracker`` installed on ``loader``, else ``None``)."""
    from lightning_pulse.core.sample_index import RecordingSampler

    sampler = getattr(getattr(loader, "batch_sampler", None), "sampler", None)
    tracker = getattr(sampler, "tracker", None) if isinstance(sampler, RecordingSampler) else None
    found = []
    for batch_idx, batch in batches:
        rows = nonfinite_rows(batch)
        if not rows:
            continue
        try:
            drawn = tracker.batch_indices(batch_idx) if tracker is not None else None
        except RuntimeError:  # not recorded (the tracker's pass started elsewhere): rows and step only
            drawn = None
        indices = batch_sample_ids(batch, rows, drawn)
        found.append({"step": step, "batch_idx": batch_idx, "rows": rows, "indices": indices})
    return found


def describe_bad_samples(samples: Sequence[Mapping[str, Any]]) -> str:
    """``"batch 3 rows [5] (dataset indices [812])"``, for a message."""
    parts = []
    for sample in samples:
        where = f" (dataset indices {sample['indices']})" if sample["indices"] is not None else ""
        parts.append(f"batch {sample['batch_idx']} rows {sample['rows']}{where}")
    return ", ".join(parts) or "on another rank"


def trace_nonfinite(
    module: torch.nn.Module,
    optimizers: Iterable[torch.optim.Optimizer],
    batches: Sequence[tuple[int, Any]],
    step: int,
    loader: Any = None,
    all_reduce_sum: Callable[[Tensor], Tensor] | None = None,
    saved_forward_state: Mapping[str, Tensor] | None = None,
) -> tuple[str | None, list[dict[str, Any]]]:
    """Where the non-finite optimizer step ``step`` came from, the same answer on every rank.

    ``("state", [])`` if the weights (:func:`weights_are_finite`) are non-finite on any rank; else
    ``("data", samples)`` if a micro-batch ``(batch_idx, batch)`` held non-finite values on any rank
    (``samples``: this rank's, from :func:`find_bad_samples`; empty on a rank whose batches were clean); else
    ``("state", [])`` if a forward made the forward state bad on any rank (:func:`nonfinite_forward_state`,
    against ``saved_forward_state``: the newest snapshot's); else
    ``(None, [])``. Bad data wins over a non-finite forward state because the bad batch's own forward wrote it
    (BatchNorm's running statistics take the NaN rows' mean): the caller skips the step and mends that state
    (:meth:`~lightning_pulse.core.stability_steps.StabilityCore.mend_forward_state`). Under DDP
    ``all_reduce_sum`` sums the three findings over ranks (one small collective, on this rare step only; every
    rank reaches it, since the verdict came from all-reduced numbers).
    """
    samples = find_bad_samples(batches, step, loader)
    weights_bad = not weights_are_finite(module, optimizers)
    forward_bad = bool(nonfinite_forward_state(module, saved_forward_state))
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    flags = torch.tensor([float(bool(samples)), float(weights_bad), float(forward_bad)], device=device)
    if all_reduce_sum is not None:
        flags = all_reduce_sum(flags)
    data_bad, weights_bad, forward_bad = (bool(flag) for flag in flags.tolist())
    if weights_bad:
        return "state", []
    if data_bad:
        return "data", samples
    return ("state", []) if forward_bad else (None, [])
