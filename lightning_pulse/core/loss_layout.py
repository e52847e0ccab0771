"""Which dimension of a captured loss holds the batch's samples, where its shape cannot tell.

:class:`~lightning_pulse.core.per_sample_loss.LossCapture` splits an unreduced loss along its first dimension:
``(B, ...)`` rows, or ``B`` consecutive runs of a flattened ``(B*T, ...)``. A time-major module
(``nn.LSTM`` / ``nn.Transformer`` with their default ``batch_first=False``) computes its loss on ``(T, B)``
outputs, or on ``(T, B, V)`` logits flattened to ``(T*B, V)``: with ``T != B`` the shapes refuse it, but with
``T == B`` (``32`` / ``32`` is a common sequence length and batch size) ``(T, B)`` looks like ``(B, T)`` and
the split took each time step's loss over the batch for a sample's (a held-out sweep: rank correlation 0.07
with the true per-sample losses).

Where a captured call's shape has ``B`` along both of its first dimensions, or ``B * B`` rows, the fit's first
step tells them apart by evidence, once: by the call's ``target`` where it is a view of a batch tensor (its
strides say which dimension steps through the samples: ``y`` or ``y.t()``); else the module's own
``training_step`` is run twice more on the batch, the second time with its samples reordered (a permutation),
in eval mode and outside the training loop (:func:`lightning_pulse.probe.captured_losses`: no random draw,
buffer, logged value or weight changes). Each row's mean (what would be a sample's score) either moves with
the samples (the rows are samples) or stays where it was (the rows are time steps, each over all samples:
refused). A loss of ``B`` rows, or of another ``T``, runs nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from lightning_pulse.core.per_sample_loss import CapturedLoss, LossCapture, ambiguous_sample_dimension

#: ``(positions, pairwise=False) -> [(name, unreduced loss)]``: the captured calls of a re-run of the step on
#: the batch's samples at ``positions`` (``(B,)``, in that order), in call order; ``pairwise``: a batch tensor
#: with ``B`` along both first dimensions reordered along both
Rerun = Callable[..., list[tuple[str, Tensor]]]

#: A row mean within this share of the rows' mean magnitude of where a hypothesis puts it fits it exactly
#: (the same samples computed at other batch positions: rounding only)
EXACT = 1e-4
#: Otherwise one hypothesis is taken when it fits this many times better than the other
MARGIN = 10.0

_WAYS_OUT = (
    "Compute the loss on batch-first outputs (`batch_first=True`, or `.transpose(0, 1)` of the outputs and "
    "targets before the loss, so that each sample's elements are its own row), or set `scorer=` to a "
    "PerSampleScorer (e.g. OutputKeyScorer over each sample's mean loss)."
)


def ambiguous_calls(capture: LossCapture) -> list[int]:
    """The positions in ``capture.records`` of the calls that split into the batch's ``B`` samples and whose
    shape holds ``B`` along both of its first dimensions, ``(B, B, ...)``, or ``B * B`` rows
    (:func:`~lightning_pulse.core.per_sample_loss.ambiguous_sample_dimension`): a time-major ``(T, B)`` loss,
    or ``(T, B, V)`` logits flattened, with ``T == B`` look the same as batch-first ones."""
    return [
        position
        for position, record in enumerate(capture.records)
        if record.maps_onto_batch and ambiguous_sample_dimension(record.shape, capture.batch_size)
    ]


def rows_follow_the_samples(before: Tensor, after: Tensor, order: Tensor, batch_size: int) -> bool | None:
    """Whether the unreduced loss ``after``, computed on the batch with its samples at ``order``, holds in row
    ``i`` (of ``B``: :func:`~lightning_pulse.core.per_sample_loss.rows_per_sample`) what ``before`` (on the
    batch as it came) held in row ``order[i]``: ``True``, its rows are samples; ``False``, each row's mean stayed
    where it was (its rows are positions over all samples: time steps); ``None``, neither fits."""
    means = [loss.detach().float().reshape(batch_size, -1).mean(dim=1) for loss in (before, after)]
    before_means, after_means = (torch.nan_to_num(mean.cpu()) for mean in means)
    followed = float((after_means - before_means[order.cpu()]).abs().mean())
    stayed = float((after_means - before_means).abs().mean())
    exact = EXACT * float(before_means.abs().mean()) + 1e-12
    if followed <= exact or followed * MARGIN <= stayed:
        return True
    if stayed <= exact or stayed * MARGIN <= followed:
        return False
    return None


def where_the_swapped_samples_changed(
    before: Tensor, after: Tensor, swapped: Tensor, batch_size: int
) -> bool | None:
    """Whether ``after``, computed on the batch with the samples at the positions ``swapped`` (a boolean mask
    of ``B``) exchanged among themselves and the others where they were, changed only in rows those samples
    hold: ``True`` where the loss (read as ``(B, B, ...)``) changed in the swapped rows outside the swapped
    columns and nowhere in the other rows; ``False`` for the reverse (its second dimension holds the samples:
    time-major); ``None`` where neither. Unlike :func:`rows_follow_the_samples` it holds where the step draws
    random numbers tied to positions (a masked-LM's mask: both runs draw the same): the samples left in place
    keep their losses whatever those draws are (a review: an 8x8 masked-LM was refused as time-major)."""
    grid = [loss.detach().float().cpu().reshape(batch_size, batch_size, -1) for loss in (before, after)]
    scale = EXACT * float(torch.nan_to_num(grid[0]).abs().mean()) + 1e-12
    changed = (torch.nan_to_num(grid[1] - grid[0], nan=1.0).abs() > scale).any(dim=2)
    swapped = swapped.cpu()
    rows_only = bool(changed[swapped][:, ~swapped].any()) and not bool(changed[~swapped][:, swapped].any())
    columns_only = bool(changed[~swapped][:, swapped].any()) and not bool(changed[swapped][:, ~swapped].any())
    return True if rows_only else False if columns_only else None


def sample_dimension_refusal(capture: LossCapture, rerun: Rerun | None) -> str | None:
    """Why HardSampleReplay must refuse ``capture``'s losses (after its name, with the way out), or ``None``.

    Only the calls whose shape cannot tell where the samples are (:func:`ambiguous_calls`) are judged: by their
    target where it is a view of a batch tensor (:attr:`~lightning_pulse.core.per_sample_loss.CapturedLoss.
    samples_along`, nothing run); else ``rerun`` runs the step twice (the batch as it came, then its samples in
    another order; a third time with its ``(B, B)`` tensors reordered along both dimensions where that tells
    nothing) and :func:`rows_follow_the_samples` judges. Refused: a call whose samples lie along its
    second dimension (time-major), and, since a split along the wrong dimension would be silent, one that
    neither tells (the step could not run again, its calls differ between the runs, or they follow neither
    order). ``rerun`` ``None``: only the targets are read."""
    records = capture.records
    positions = ambiguous_calls(capture)
    for position in positions:
        if records[position].samples_along == 1:
            return _time_major(
                records[position], capture.batch_size, "its target is a batch tensor transposed"
            )
    positions = [position for position in positions if records[position].samples_along is None]
    if not positions or rerun is None:
        return None
    size = capture.batch_size
    # the first half's samples exchanged in pairs, the others left in place: where the loss changes tells
    # which dimension holds the samples (where_the_swapped_samples_changed), and each row's mean whether it
    # moved with its sample (rows_follow_the_samples)
    half = max(2, size // 2 - (size // 2) % 2)
    order = torch.arange(size)
    order[:half] = order[:half].reshape(-1, 2).flip(1).reshape(-1)
    try:
        before, after = rerun(torch.arange(size)), rerun(order)
        verdicts = _verdicts(records, positions, before, after, order, size)
        if None in verdicts and False not in verdicts:  # a (B, B) batch tensor may be pairwise: reordered
            # along both of its dimensions then, not only along its first (tokens as long as the batch)
            verdicts = _verdicts(records, positions, before, rerun(order, True), order, size)
    except Exception as error:  # measurement never kills a run: said in the refusal
        first = str(error).strip().splitlines()[0][:200] if str(error).strip() else ""
        return _undecided(records[positions[0]], size, f"it raised {type(error).__name__}: {first}")
    for position, verdict in zip(positions, verdicts):
        if verdict is False:
            stayed = (
                "run again at the first step on the batch with its samples reordered, each row's loss stayed in "
                "place instead of moving with its sample"
            )
            return _time_major(records[position], size, stayed)
        if verdict is None:
            neither = "each row's loss neither moved with its sample nor stayed in place"
            return _undecided(records[position], size, neither)
        if verdict == _DIFFERED:
            return _undecided(records[position], size, "its loss calls differed when it ran again")
    return None


#: a verdict of :func:`_verdicts`: the re-run's calls were not the step's
_DIFFERED = "differed"


def _verdicts(
    records: list[CapturedLoss],
    positions: list[int],
    before: list[tuple[str, Tensor]],
    after: list[tuple[str, Tensor]],
    order: Tensor,
    size: int,
) -> list[bool | str | None]:
    """:func:`rows_follow_the_samples` for each call at ``positions``, or :data:`_DIFFERED` where a re-run's call
    there is not the step's (another loss, another shape)."""
    verdicts: list[bool | str | None] = []
    for position in positions:
        record = records[position]
        runs = [calls[position] if position < len(calls) else None for calls in (before, after)]
        if any(run is None or run[0] != record.name or tuple(run[1].shape) != record.shape for run in runs):
            verdicts.append(_DIFFERED)
            continue
        swapped = order != torch.arange(size)
        where = where_the_swapped_samples_changed(runs[0][1], runs[1][1], swapped, size)
        verdicts.append(
            rows_follow_the_samples(runs[0][1], runs[1][1], order, size) if where is None else where
        )
    return verdicts


def _time_major(record: CapturedLoss, size: int, evidence: str) -> str:
    along = "its second dimension" if record.shape[:2] == (size, size) else f"every {size}th row"
    return (
        f"cannot split the module's {record.name} into samples: its unreduced loss {record.shape} is time-major, "
        f"the batch's {size} samples along {along} (as a `batch_first=False` model's outputs are, its sequence "
        f"length equal to the batch size; {evidence}), so each sample's score would be one time step's loss "
        f"over the whole batch. {_WAYS_OUT}"
    )


def _undecided(record: CapturedLoss, size: int, why: str) -> str:
    square = record.shape[:2] == (size, size)
    shape = f"the batch size {size} along both of its first dimensions" if square else f"{size} * {size} rows"
    return (
        f"cannot split the module's {record.name} into samples: its unreduced loss {record.shape} has {shape}, so "
        "its shape does not tell a batch-first loss from a time-major one (a `batch_first=False` model whose "
        "sequence length equals the batch size), and the check that tells them apart, training_step run again "
        f"on the batch with its samples reordered, could not: {why}. {_WAYS_OUT} A batch size other than the "
        "sequence length lets the shapes tell."
    )
